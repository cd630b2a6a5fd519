//! `oxccl-check --links`: the speed of every link between two ranks, and
//! which links (and ranks) are slow beside the others of their kind.
//!
//! A job whose collectives are correct can still crawl because of one bad
//! link: a NIC that negotiated a lower speed, a host whose egress is
//! throttled, a rank placed across a slow bridge. A ring runs at its
//! slowest link, so every rank of the job waits for it, and nothing in a
//! collective's timing says which link it was. Here the ranks measure the
//! pairs one at a time, every other rank waiting in a barrier, so each
//! figure is that link's alone: an 8-byte round trip (the median of a
//! few), and `bytes` sent one way (then acknowledged) in each direction,
//! the fastest of up to six tries: a slow link is slow every time, while a
//! busy machine slows any one try (on the 2-vCPU VM of
//! `docs/performance.md`, medians of five flagged healthy shared-memory
//! links at 0.45x). A first try slower than half a second is the only
//! one: the other ranks wait in a barrier meanwhile, each wait bounded by
//! the communicators' timeout, which the round trips and one transfer
//! each way must then fit in.
//!
//! Links are compared only with links of their kind (in-process, shared
//! memory, TCP): a TCP link is not slow for being slower than shared
//! memory. A directed link is *slow* when it moves less than half of what
//! the upper quartile of its kind moves. A rank is named a slow sender
//! when every link of a kind out of it is slow and one of the ranks it
//! sends to receives fine from a third rank (a slow receiver likewise,
//! with one of its senders sending fine to a third rank): its host's
//! egress (or ingress) is the likely cause. When a whole host is slow and
//! there are only two, no third rank clears the other end, and no rank is
//! named.
//! Ranks on a machine with more ranks than CPUs
//! ([`Communicator::ranks_outnumber_cpus`]) take turns on them, so their
//! links to each other measure that sharing (on the 2-vCPU VM, four ranks'
//! pairs on one CPU ran at a third of pairs on two): the report says so,
//! and leaves their in-process and shared-memory links out of the
//! findings. The findings are warnings, not failures: a shared machine's
//! figures move between runs.

use std::time::Instant;

use oxccl::{Communicator, LinkKind};

/// Round trips timed after one untimed, and transfers after the first
/// (which counts too, as [`SLOW_FIRST_SECONDS`] says).
const ROUND_TRIPS: usize = 21;
const TRANSFERS: usize = 5;

/// A first transfer slower than this is the direction's only one: the
/// other ranks wait in a barrier meanwhile, each wait bounded by the
/// communicators' timeout (60 s by default).
const SLOW_FIRST_SECONDS: f64 = 0.5;

/// The link kinds this tool knows, in the order its all-gather codes them.
const KINDS: [LinkKind; 3] = [LinkKind::InProcess, LinkKind::SharedMemory, LinkKind::Tcp];

/// Below this fraction of its kind's upper quartile a link is slow.
const SLOW_FRACTION: f64 = 0.5;

/// The full matrices are printed up to this many ranks; beyond, only the
/// summary and the findings.
const MATRIX_MAX_RANKS: usize = 16;

/// What one rank measured, for every peer `p` (in rank order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// Link kind to `p` (`None` for this rank itself).
    pub kind: Vec<Option<LinkKind>>,
    /// GB/s of `bytes` sent from this rank to `p` (the fastest try).
    pub gbps_to: Vec<f64>,
    /// Microseconds of an 8-byte round trip with `p`, measured by the lower
    /// rank of the pair (`NaN` on the other).
    pub round_trip_us: Vec<f64>,
    /// Whether this rank's machine has more of the job's ranks than CPUs.
    pub crowded: bool,
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Measures every pair, one at a time (every rank must call it). Returns
/// every rank's [`Measured`], in rank order.
pub fn measure(comm: &mut Communicator, bytes: usize) -> Result<Vec<Measured>, String> {
    let (me, world) = (comm.rank(), comm.world_size());
    let err = |e: oxccl::Error| e.to_string();
    // The user's size: an error, not an abort, where it cannot be had.
    let zeroed = || -> Result<Vec<u8>, String> {
        let mut v = Vec::new();
        v.try_reserve_exact(bytes)
            .map_err(|e| format!("--link-bytes {bytes}: {e}"))?;
        v.resize(bytes, 0);
        Ok(v)
    };
    let (payload, mut inbox) = (zeroed()?, zeroed()?);
    let (mut word, mut word_in) = ([0u8; 8], [0u8; 8]);
    let mut mine = Measured {
        kind: (0..world).map(|p| comm.link_to(p)).collect(),
        gbps_to: vec![f64::NAN; world],
        round_trip_us: vec![f64::NAN; world],
        crowded: comm.ranks_outnumber_cpus(),
    };
    for low in 0..world {
        for high in low + 1..world {
            if me == low || me == high {
                let peer = if me == low { high } else { low };
                // Round trips: the lower rank starts each.
                let mut trips = Vec::with_capacity(ROUND_TRIPS);
                for _ in 0..=ROUND_TRIPS {
                    let start = Instant::now();
                    if me == low {
                        comm.send(&word, peer).map_err(err)?;
                        comm.recv(&mut word_in, peer).map_err(err)?;
                    } else {
                        comm.recv(&mut word_in, peer).map_err(err)?;
                        comm.send(&word, peer).map_err(err)?;
                    }
                    trips.push(start.elapsed().as_secs_f64() * 1e6);
                }
                if me == low {
                    mine.round_trip_us[peer] = median(trips.split_off(1));
                }
                // Each direction in turn, the lower rank sending first: a
                // first transfer, then the sender tells how many more
                // follow (none when the first was slow, so that the ranks
                // waiting in the barrier meanwhile stay within their
                // timeout on the very link this looks for).
                for sender in [low, high] {
                    let mut transfer = |comm: &mut Communicator| -> Result<f64, String> {
                        if me == sender {
                            let start = Instant::now();
                            comm.send(&payload, peer).map_err(err)?;
                            comm.recv(&mut word_in, peer).map_err(err)?;
                            Ok(start.elapsed().as_secs_f64())
                        } else {
                            comm.recv(&mut inbox, peer).map_err(err)?;
                            word[0] = word[0].wrapping_add(1);
                            comm.send(&word, peer).map_err(err)?;
                            Ok(f64::NAN)
                        }
                    };
                    let first = transfer(comm)?;
                    let mut tries = [0u8; 8];
                    if me == sender {
                        let more = if first > SLOW_FIRST_SECONDS {
                            0
                        } else {
                            TRANSFERS
                        };
                        tries = (more as u64).to_le_bytes();
                        comm.send(&tries, peer).map_err(err)?;
                    } else {
                        comm.recv(&mut tries, peer).map_err(err)?;
                    }
                    let more = u64::from_le_bytes(tries).min(TRANSFERS as u64);
                    let mut fastest = first;
                    for _ in 0..more {
                        fastest = fastest.min(transfer(comm)?);
                    }
                    if me == sender {
                        mine.gbps_to[peer] = bytes as f64 / fastest / 1e9;
                    }
                }
            }
            comm.barrier().map_err(err)?;
        }
    }
    share(comm, &mine)
}

/// Every rank's [`Measured`], through one all-gather.
fn share(comm: &mut Communicator, mine: &Measured) -> Result<Vec<Measured>, String> {
    let world = comm.world_size();
    // A kind's place in KINDS, plus one; 0 for none (a kind this build
    // does not know is sent as none too: no figure to judge it by).
    let code = |kind: Option<LinkKind>| {
        kind.and_then(|k| KINDS.iter().position(|&known| known == k))
            .map_or(0.0, |at| (at + 1) as f64)
    };
    let mut row: Vec<f64> = mine.kind.iter().map(|&k| code(k)).collect();
    row.extend(&mine.gbps_to);
    row.extend(&mine.round_trip_us);
    row.push(f64::from(u8::from(mine.crowded)));
    let mut all = vec![0.0f64; row.len() * world];
    comm.all_gather(&row, &mut all).map_err(|e| e.to_string())?;
    Ok(all
        .chunks(row.len())
        .map(|r| Measured {
            kind: r[..world]
                .iter()
                .map(|&c| {
                    (c as usize)
                        .checked_sub(1)
                        .and_then(|at| KINDS.get(at).copied())
                })
                .collect(),
            gbps_to: r[world..2 * world].to_vec(),
            round_trip_us: r[2 * world..3 * world].to_vec(),
            crowded: r[3 * world] != 0.0,
        })
        .collect())
}

/// What [`findings`] concluded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Findings {
    /// Per kind: how many directed links, their median and upper-quartile
    /// GB/s.
    pub kinds: Vec<(LinkKind, usize, f64, f64)>,
    /// `(from, to, GB/s, fraction of its kind's upper quartile)`.
    pub slow_links: Vec<(usize, usize, f64, f64)>,
    /// `(rank, kind)`: every link of that kind out of the rank is slow.
    pub slow_senders: Vec<(usize, LinkKind)>,
    /// `(rank, kind)`: every link of that kind into the rank is slow.
    pub slow_receivers: Vec<(usize, LinkKind)>,
}

/// The upper quartile of `values` (not empty), by nearest rank: the
/// smallest value with at least three quarters of them at or below it.
fn upper_quartile(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[(3 * v.len()).div_ceil(4) - 1]
}

/// Compares every directed link with the others of its kind.
pub fn findings(all: &[Measured]) -> Findings {
    let world = all.len();
    // Links within a crowded machine measure its CPU sharing: not judged.
    let link = |from: usize, to: usize| {
        let kind = all[from].kind[to]?;
        let within_machine = matches!(kind, LinkKind::InProcess | LinkKind::SharedMemory);
        if within_machine && all[from].crowded && all[to].crowded {
            return None;
        }
        Some((kind, all[from].gbps_to[to]))
    };
    let mut kinds: Vec<LinkKind> = Vec::new();
    for (from, to) in (0..world).flat_map(|f| (0..world).map(move |t| (f, t))) {
        if let Some((kind, _)) = link(from, to) {
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
    }
    let mut out = Findings::default();
    for kind in kinds {
        let of_kind: Vec<(usize, usize, f64)> = (0..world)
            .flat_map(|f| (0..world).map(move |t| (f, t)))
            .filter_map(|(f, t)| match link(f, t) {
                Some((k, gbps)) if k == kind => Some((f, t, gbps)),
                _ => None,
            })
            .collect();
        let speeds: Vec<f64> = of_kind.iter().map(|l| l.2).collect();
        let reference = upper_quartile(&speeds);
        out.kinds
            .push((kind, speeds.len(), median(speeds.clone()), reference));
        let slow = |gbps: f64| gbps < SLOW_FRACTION * reference;
        for &(f, t, gbps) in &of_kind {
            if slow(gbps) {
                out.slow_links.push((f, t, gbps, gbps / reference));
            }
        }
        // A rank is named a slow sender when every link of the kind out of
        // it is slow and one of the ranks it sends to receives fine from a
        // third rank: that clears the receiving end. Likewise a slow
        // receiver, with one of its senders sending fine to a third rank.
        // When a whole host is slow and there are only two, no third rank
        // clears the other end, and no rank is named.
        let mut fine = vec![vec![false; world]; world];
        for &(f, t, gbps) in &of_kind {
            fine[f][t] = !slow(gbps);
        }
        let others = |rank: usize| (0..world).filter(move |&third| third != rank);
        for rank in 0..world {
            let out_of: Vec<_> = of_kind.iter().filter(|l| l.0 == rank).collect();
            let into: Vec<_> = of_kind.iter().filter(|l| l.1 == rank).collect();
            if !out_of.is_empty()
                && out_of.iter().all(|l| slow(l.2))
                && out_of
                    .iter()
                    .any(|l| others(rank).any(|third| fine[third][l.1]))
            {
                out.slow_senders.push((rank, kind));
            }
            if !into.is_empty()
                && into.iter().all(|l| slow(l.2))
                && into
                    .iter()
                    .any(|l| others(rank).any(|third| fine[l.0][third]))
            {
                out.slow_receivers.push((rank, kind));
            }
        }
    }
    out
}

/// The report rank 0 prints: the matrices (up to [`MATRIX_MAX_RANKS`]),
/// each kind's spread, and the findings.
pub fn report(all: &[Measured], bytes: usize) -> String {
    let world = all.len();
    let mut text = format!(
        "oxccl-check: links among {world} ranks, one pair at a time: an 8-byte round trip \
         (median of {ROUND_TRIPS}) and {} sent one way (fastest of up to {})\n",
        size_text(bytes),
        TRANSFERS + 1
    );
    if world < 2 {
        text += "oxccl-check: links: one rank, no links\n";
        return text;
    }
    if world <= MATRIX_MAX_RANKS {
        text += "oxccl-check: links: GB/s one way (row: from, column: to; s shm, t tcp, i in-process)\n";
        text += &matrix(all, |from, to| {
            let kind = all[from].kind[to]?;
            Some(format!("{}{:.3}", kind_letter(kind), all[from].gbps_to[to]))
        });
        text += "oxccl-check: links: round trip, microseconds\n";
        text += &matrix(all, |from, to| {
            let (low, high) = (from.min(to), from.max(to));
            all[low].kind[high]?;
            Some(format!("{:.1}", all[low].round_trip_us[high]))
        });
    }
    let crowded: Vec<String> = (0..world)
        .filter(|&r| all[r].crowded)
        .map(|r| r.to_string())
        .collect();
    if !crowded.is_empty() {
        text += &format!(
            "oxccl-check: links: ranks {} run on machines with more ranks than CPUs: links \
             between ranks sharing a CPU measure that sharing, and their in-process and \
             shared-memory links are not judged\n",
            crowded.join(" ")
        );
    }
    let found = findings(all);
    for (kind, count, median, upper) in &found.kinds {
        text += &format!(
            "oxccl-check: links: {} {count} directed links: median {median:.3} GB/s, upper quartile {upper:.3}\n",
            kind.name()
        );
    }
    if found.kinds.is_empty() {
        text += "oxccl-check: links: none judged (every link is within a crowded machine)\n";
        return text;
    }
    if found.slow_links.is_empty() {
        text += "oxccl-check: links: no slow link (none below half of its kind's upper quartile)\n";
        return text;
    }
    const LISTED: usize = 20;
    for &(from, to, gbps, fraction) in found.slow_links.iter().take(LISTED) {
        let kind = all[from].kind[to].map_or("?", LinkKind::name);
        text += &format!(
            "oxccl-check: links: WARNING slow link {from}->{to} ({kind}): {gbps:.3} GB/s, \
             {fraction:.2}x its kind's upper quartile\n"
        );
    }
    if found.slow_links.len() > LISTED {
        text += &format!(
            "oxccl-check: links: WARNING and {} more slow links\n",
            found.slow_links.len() - LISTED
        );
    }
    for (ranks, way) in [
        (&found.slow_senders, "out of"),
        (&found.slow_receivers, "into"),
    ] {
        for &(rank, kind) in ranks.iter() {
            text += &format!(
                "oxccl-check: links: WARNING every {} link {way} rank {rank} is slow: look at its host's network\n",
                kind.name()
            );
        }
    }
    text
}

/// A kind's initial (`i` in-process, `s` shm, `t` tcp), before its cells.
fn kind_letter(kind: LinkKind) -> &'static str {
    &kind.name()[..1]
}

/// A world × world table of `cell(from, to)`, `-` where it is `None`.
fn matrix(all: &[Measured], cell: impl Fn(usize, usize) -> Option<String>) -> String {
    let world = all.len();
    let cells: Vec<Vec<String>> = (0..world)
        .map(|f| {
            (0..world)
                .map(|t| cell(f, t).unwrap_or_else(|| "-".into()))
                .collect()
        })
        .collect();
    let width = cells
        .iter()
        .flatten()
        .map(String::len)
        .max()
        .unwrap_or(1)
        .max(4);
    let mut text = format!("{:>6}", "");
    for t in 0..world {
        text += &format!(" {:>width$}", t);
    }
    text.push('\n');
    for (f, row) in cells.iter().enumerate() {
        text += &format!("{f:>6}");
        for c in row {
            text += &format!(" {c:>width$}");
        }
        text.push('\n');
    }
    text
}

fn size_text(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `world` ranks, `per_host` to a host (shared memory within, TCP
    /// across), every link at `gbps(from, to)`.
    fn job(world: usize, per_host: usize, gbps: impl Fn(usize, usize) -> f64) -> Vec<Measured> {
        (0..world)
            .map(|f| Measured {
                kind: (0..world)
                    .map(|t| {
                        (t != f).then_some(if t / per_host == f / per_host {
                            LinkKind::SharedMemory
                        } else {
                            LinkKind::Tcp
                        })
                    })
                    .collect(),
                gbps_to: (0..world).map(|t| gbps(f, t)).collect(),
                // Measured by the lower rank of each pair only.
                round_trip_us: (0..world)
                    .map(|t| if f < t { 10.0 + t as f64 } else { f64::NAN })
                    .collect(),
                crowded: false,
            })
            .collect()
    }

    #[test]
    fn a_host_with_a_slow_egress_is_named_and_links_are_judged_by_kind() {
        // Three hosts of two; shared memory 20x faster than TCP; host 2's
        // ranks (4, 5) send over TCP at a tenth.
        let speed = |f: usize, t: usize| match (f / 2, t / 2) {
            (a, b) if a == b => 20.0,
            (2, _) => 0.1,
            _ => 1.0 + 0.01 * (f + t) as f64,
        };
        let found = findings(&job(6, 2, speed));
        assert_eq!(found.slow_senders, [(4, LinkKind::Tcp), (5, LinkKind::Tcp)]);
        assert!(found.slow_receivers.is_empty());
        // Every TCP link out of host 2, and nothing else.
        let slow: Vec<(usize, usize)> = found.slow_links.iter().map(|l| (l.0, l.1)).collect();
        assert_eq!(
            slow,
            [
                (4, 0),
                (4, 1),
                (4, 2),
                (4, 3),
                (5, 0),
                (5, 1),
                (5, 2),
                (5, 3)
            ]
        );
        assert!(found
            .kinds
            .contains(&(LinkKind::SharedMemory, 6, 20.0, 20.0)));
        let text = report(&job(6, 2, speed), 1 << 20);
        assert!(
            text.contains("WARNING every tcp link out of rank 4 is slow"),
            "{text}"
        );
        assert!(
            text.contains("WARNING slow link 5->3 (tcp): 0.100 GB/s"),
            "{text}"
        );
        assert!(!text.contains("no slow link"), "{text}");
    }

    #[test]
    fn even_links_have_no_findings_and_one_slow_link_names_no_rank() {
        let even = job(4, 2, |f, t| if f / 2 == t / 2 { 8.0 } else { 1.0 });
        let found = findings(&even);
        assert!(found.slow_links.is_empty() && found.slow_senders.is_empty());
        assert!(report(&even, 4096).contains("no slow link"));
        // One link of four ranks' twelve TCP links: the link, not a rank.
        let one = job(4, 1, |f, t| if (f, t) == (1, 3) { 0.2 } else { 1.0 });
        let found = findings(&one);
        assert_eq!(found.slow_links.len(), 1);
        assert_eq!((found.slow_links[0].0, found.slow_links[0].1), (1, 3));
        assert!(found.slow_senders.is_empty() && found.slow_receivers.is_empty());
        // Two ranks: one link each way, nothing to compare a rank with.
        let two = job(2, 1, |f, _| if f == 0 { 0.1 } else { 1.0 });
        let found = findings(&two);
        assert!(found.slow_senders.is_empty() && found.slow_receivers.is_empty());
    }

    #[test]
    fn a_crowded_machines_shared_memory_links_are_not_judged() {
        // Three hosts of two: ranks 0 and 1 share a CPU, their links run at
        // a third of the others' shared memory. Host 2's TCP sends run at a
        // tenth.
        let speed = |f: usize, t: usize| match (f / 2, t / 2) {
            _ if f + t == 1 => 3.0,
            (a, b) if a == b => 9.0,
            (2, _) => 0.1,
            _ => 1.0,
        };
        let mut all = job(6, 2, speed);
        let slow = |found: &Findings| -> Vec<(usize, usize)> {
            found.slow_links.iter().map(|l| (l.0, l.1)).collect()
        };
        assert!(slow(&findings(&all)).contains(&(0, 1)));
        for rank in &mut all {
            rank.crowded = true;
        }
        let found = findings(&all);
        assert!(
            slow(&found).iter().all(|&(f, t)| f >= 4 && t < 4),
            "{found:?}"
        );
        assert_eq!(found.slow_senders, [(4, LinkKind::Tcp), (5, LinkKind::Tcp)]);
        assert!(found.kinds.iter().all(|k| k.0 == LinkKind::Tcp));
        let text = report(&all, 1 << 20);
        assert!(
            text.contains("ranks 0 1 2 3 4 5 run on machines with more ranks than CPUs"),
            "{text}"
        );
        // One crowded host: nothing left to judge.
        let mut one_host = job(4, 4, |f, t| if f % 2 == t % 2 { 3.0 } else { 9.0 });
        one_host.iter_mut().for_each(|r| r.crowded = true);
        assert!(report(&one_host, 8).contains("links: none judged"));
    }

    #[test]
    fn two_hosts_name_no_rank() {
        // Host 1's egress throttled: every TCP link out of ranks 2 and 3 is
        // slow, and so is every one into ranks 0 and 1; no third host says
        // which end is at fault.
        let found = findings(&job(4, 2, |f, t| match (f / 2, t / 2) {
            (a, b) if a == b => 9.0,
            (1, _) => 0.1,
            _ => 1.0,
        }));
        assert_eq!(found.slow_links.len(), 4);
        assert!(found.slow_senders.is_empty(), "{found:?}");
        assert!(found.slow_receivers.is_empty(), "{found:?}");
    }

    #[test]
    fn the_upper_quartile_is_by_nearest_rank() {
        assert_eq!(upper_quartile(&[4.0, 1.0, 3.0, 2.0]), 3.0);
        assert_eq!(upper_quartile(&[1.0, 2.0]), 2.0);
        assert_eq!(upper_quartile(&[5.0]), 5.0);
        assert_eq!(upper_quartile(&[1.0, 2.0, 3.0, 4.0, 5.0]), 4.0);
    }

    /// The measurement itself, over three threads: every off-diagonal
    /// figure is there (round trips on the lower rank's side), shared
    /// with every rank alike.
    #[test]
    fn threads_measure_every_link() {
        let comms = Communicator::local_group(3).expect("three threads");
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| std::thread::spawn(move || measure(&mut comm, 4096)))
            .collect();
        let results: Vec<Vec<Measured>> = handles
            .into_iter()
            .map(|h| h.join().expect("no panic").expect("measured"))
            .collect();
        // Every rank holds the same figures (NaN where none: compared as text).
        let first = format!("{:?}", results[0]);
        assert!(results.iter().all(|r| format!("{r:?}") == first));
        let all = &results[0];
        for (f, rank) in all.iter().enumerate() {
            for t in 0..3 {
                if f == t {
                    assert_eq!(rank.kind[t], None);
                    continue;
                }
                assert_eq!(rank.kind[t], Some(LinkKind::InProcess));
                assert!(rank.gbps_to[t].is_finite() && rank.gbps_to[t] > 0.0);
                assert_eq!(rank.round_trip_us[t].is_finite(), f < t, "{f}->{t}");
            }
        }
        let text = report(all, 4096);
        // A matrix cell of an in-process link: `i` and GB/s.
        let cell = |c: &str| {
            c.strip_prefix('i')
                .is_some_and(|v| v.parse::<f64>().is_ok())
        };
        assert!(
            text.lines().any(|l| l.split_whitespace().any(cell)),
            "{text}"
        );
    }

    #[test]
    fn a_slow_receiver_is_named() {
        let found = findings(&job(4, 1, |_, t| if t == 2 { 0.05 } else { 1.0 }));
        assert_eq!(found.slow_receivers, [(2, LinkKind::Tcp)]);
        assert!(found.slow_senders.is_empty());
    }

    #[test]
    fn the_report_prints_matrices_for_small_worlds_only() {
        let small = report(&job(3, 3, |_, _| 5.0), 1 << 20);
        assert!(small.contains("round trip, microseconds"), "{small}");
        assert!(small.contains("s5.000"), "{small}");
        // Round trips read from the lower rank of each pair, both ways.
        assert_eq!(small.matches(" 11.0").count(), 2, "{small}");
        assert!(!small.contains("NaN"), "{small}");
        assert!(small.contains("1 MiB sent one way"), "{small}");
        let large = report(&job(MATRIX_MAX_RANKS + 1, 1, |_, _| 1.0), 1000);
        assert!(!large.contains("round trip, microseconds"), "{large}");
        assert!(large.contains("1000 B sent one way"), "{large}");
        assert!(report(&job(1, 1, |_, _| 1.0), 8).contains("one rank, no links"));
    }
}
