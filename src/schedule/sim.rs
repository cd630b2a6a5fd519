//! A simulator that runs the plans of all N ranks over symbolic elements in
//! memory (unit tests only).
//!
//! Each element records which logical element it is and which ranks have
//! contributed to it, so a run checks, for any plan: every send has exactly one
//! matching receive of the same length, nothing deadlocks (sends are eager, as
//! in the executors), each contribution is combined exactly once (so a reduced
//! element is combined exactly N-1 times), `Avg` divides exactly once, and
//! every element ends where the sequential definition of the collective puts it.
//! Each element also carries a fingerprint of how its terms were grouped
//! and in which operand order, so that a run checks that every rank reduces
//! an element in the same order (the ranks' bits agree), that all-reduce
//! groups as reduce-scatter does, and that the direct plans fold in rank
//! order (host by host on hosts of the same size).

use std::collections::{HashMap, VecDeque};

use super::{plan_in_order, plan_with, BufId, Family, Plan, RingOrder, Span, Step};
use crate::desc::{BufDesc, CollectiveDesc, MemoryKind};
use crate::types::{DType, OpKind, ReduceOp};

/// A symbolic element: logical index, contributing ranks, combine and divide
/// counts, and the grouping fingerprint ([`leaf`], [`node`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sym {
    elem: usize,
    ranks: u64,
    combines: u32,
    divides: u32,
    tree: u64,
}

const UNSET: Sym = Sym {
    elem: usize::MAX,
    ranks: 0,
    combines: 0,
    divides: 0,
    tree: 0,
};

fn input(elem: usize, rank: usize) -> Sym {
    Sym {
        elem,
        ranks: 1 << rank,
        combines: 0,
        divides: 0,
        tree: leaf(rank),
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The fingerprint of rank `rank`'s term.
fn leaf(rank: usize) -> u64 {
    splitmix(rank as u64 + 1)
}

/// The fingerprint of combining two groups, `a ⊕ b`: the grouping counts
/// (floats do not associate), and so does the operands' order. Addition
/// and multiplication commute bit for bit on ordinary values, but which NaN
/// payload survives two NaNs meeting, and the sign of zero that Min/Max
/// keep on a tie (`-0.0` against `+0.0`), are the first operand's: two
/// ranks folding `x ⊕ y` and `y ⊕ x` can disagree.
fn node(a: u64, b: u64) -> u64 {
    splitmix(a ^ splitmix(b))
}

impl Sym {
    /// Everything but the grouping, to compare with [`reduced`].
    fn ungrouped(self) -> Sym {
        Sym { tree: 0, ..self }
    }
}

fn combine(local: Sym, incoming: Sym) -> Result<Sym, String> {
    if local.elem != incoming.elem {
        return Err(format!(
            "combining element {} with element {}",
            local.elem, incoming.elem
        ));
    }
    if local.ranks & incoming.ranks != 0 || local.divides + incoming.divides != 0 {
        return Err(format!(
            "element {}: a contribution combined twice or after Avg",
            local.elem
        ));
    }
    Ok(Sym {
        elem: local.elem,
        ranks: local.ranks | incoming.ranks,
        combines: local.combines + incoming.combines + 1,
        divides: 0,
        tree: node(local.tree, incoming.tree),
    })
}

struct Rank {
    send: Vec<Sym>,
    recv: Vec<Sym>,
    scratch: Vec<Sym>,
    in_place: bool,
}

impl Rank {
    fn read(&self, span: Span) -> Result<Vec<Sym>, String> {
        let buf = match span.buf {
            BufId::Send if self.in_place => {
                return Err("in-place plan refers to the send buffer".into())
            }
            BufId::Send => &self.send,
            BufId::Recv => &self.recv,
            BufId::Scratch => &self.scratch,
        };
        buf.get(span.range())
            .map(<[Sym]>::to_vec)
            .ok_or_else(|| format!("span {span:?} outside a buffer of {}", buf.len()))
    }

    fn write(&mut self, span: Span, data: &[Sym]) -> Result<(), String> {
        let buf = match span.buf {
            BufId::Send => return Err("plan writes the send buffer".into()),
            BufId::Recv => &mut self.recv,
            BufId::Scratch => &mut self.scratch,
        };
        let len = buf.len();
        buf.get_mut(span.range())
            .ok_or_else(|| format!("span {span:?} outside a buffer of {len}"))?
            .copy_from_slice(data);
        Ok(())
    }
}

/// Runs every rank's plan; returns every rank's receive buffer.
fn simulate(plans: &[Plan], mut ranks: Vec<Rank>) -> Result<Vec<Vec<Sym>>, String> {
    let n = plans.len();
    let mut queues: HashMap<(usize, usize), VecDeque<Vec<Sym>>> = HashMap::new();
    let mut pc = vec![0usize; n];
    loop {
        let mut progress = false;
        for r in 0..n {
            while let Some(step) = plans[r].steps.get(pc[r]) {
                let from = match *step {
                    Step::Recv { peer, .. } | Step::RecvReduce { peer, .. } => Some(peer),
                    Step::RecvReduceSend { from, .. } | Step::RecvCopySend { from, .. } => {
                        Some(from)
                    }
                    _ => None,
                };
                let incoming = match from {
                    Some(p) => match queues.get_mut(&(p, r)).and_then(VecDeque::pop_front) {
                        Some(frame) => Some(frame),
                        None => break, // blocked: try other ranks
                    },
                    None => None,
                };
                let me = &mut ranks[r];
                let check_len = |frame: &Vec<Sym>, len: usize| {
                    if frame.len() == len {
                        Ok(())
                    } else {
                        Err(format!(
                            "rank {r} step {}: frame of {} where {len} expected",
                            pc[r],
                            frame.len()
                        ))
                    }
                };
                match *step {
                    Step::Send { peer, src } => queues
                        .entry((r, peer))
                        .or_default()
                        .push_back(me.read(src)?),
                    Step::Recv { dst, .. } => {
                        let frame = incoming.unwrap_or_default();
                        check_len(&frame, dst.len)?;
                        me.write(dst, &frame)?;
                    }
                    Step::RecvReduce { local, dst, .. } => {
                        let frame = incoming.unwrap_or_default();
                        check_len(&frame, dst.len)?;
                        let out: Vec<Sym> = me
                            .read(local)?
                            .into_iter()
                            .zip(frame)
                            .map(|(l, i)| combine(l, i))
                            .collect::<Result<_, _>>()?;
                        me.write(dst, &out)?;
                    }
                    Step::RecvReduceSend { to, local, .. } => {
                        let frame = incoming.unwrap_or_default();
                        check_len(&frame, local.len)?;
                        let out: Vec<Sym> = me
                            .read(local)?
                            .into_iter()
                            .zip(frame)
                            .map(|(l, i)| combine(l, i))
                            .collect::<Result<_, _>>()?;
                        queues.entry((r, to)).or_default().push_back(out);
                    }
                    Step::RecvCopySend { to, dst, .. } => {
                        let frame = incoming.unwrap_or_default();
                        check_len(&frame, dst.len)?;
                        me.write(dst, &frame)?;
                        queues.entry((r, to)).or_default().push_back(frame);
                    }
                    Step::Copy { src, dst } => {
                        let data = me.read(src)?;
                        me.write(dst, &data)?;
                    }
                    Step::ReduceLocal { src, dst } => {
                        let out: Vec<Sym> = me
                            .read(dst)?
                            .into_iter()
                            .zip(me.read(src)?)
                            .map(|(acc, x)| combine(acc, x))
                            .collect::<Result<_, _>>()?;
                        me.write(dst, &out)?;
                    }
                    Step::DivideByWorld { span } => {
                        let mut data = me.read(span)?;
                        data.iter_mut().for_each(|s| s.divides += 1);
                        me.write(span, &data)?;
                    }
                }
                pc[r] += 1;
                progress = true;
            }
        }
        if (0..n).all(|r| pc[r] == plans[r].steps.len()) {
            break;
        }
        if !progress {
            let stuck: Vec<String> = (0..n)
                .filter(|&r| pc[r] < plans[r].steps.len())
                .map(|r| format!("rank {r} at {:?}", plans[r].steps[pc[r]]))
                .collect();
            return Err(format!("deadlock: {}", stuck.join(", ")));
        }
    }
    if let Some(((s, d), q)) = queues.iter().find(|(_, q)| !q.is_empty()) {
        return Err(format!(
            "{} frames from rank {s} to rank {d} never received",
            q.len()
        ));
    }
    Ok(ranks.into_iter().map(|r| r.recv).collect())
}

/// What the simulator plans with: a family (its rings and chains in rank
/// order), the ring family in an order other than the ranks'
/// ([`shuffled`]), or a family on hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scheme {
    Of(Family),
    RingShuffled,
    /// A family over ranks on hosts of the same size (the ring and direct
    /// families in two levels: [`super::two_level`]), as few hosts as the
    /// world allows or as many, placed round-robin or in blocks; worlds
    /// that are 1, 2 or prime have none.
    OnHosts {
        family: Family,
        fewest: bool,
        round_robin: bool,
    },
    /// A family over ranks on hosts of unequal size ([`unequal_hosts`]):
    /// the direct family through a leader per host
    /// ([`super::host_leaders`]).
    OnUnequalHosts(Family),
}

/// Every scheme each check runs.
const SCHEMES: [Scheme; 12] = [
    Scheme::Of(Family::Ring),
    Scheme::Of(Family::Direct),
    Scheme::Of(Family::Tree),
    Scheme::RingShuffled,
    Scheme::OnHosts {
        family: Family::Ring,
        fewest: true,
        round_robin: true,
    },
    Scheme::OnHosts {
        family: Family::Ring,
        fewest: false,
        round_robin: true,
    },
    Scheme::OnHosts {
        family: Family::Ring,
        fewest: true,
        round_robin: false,
    },
    Scheme::OnHosts {
        family: Family::Direct,
        fewest: true,
        round_robin: true,
    },
    Scheme::OnHosts {
        family: Family::Direct,
        fewest: false,
        round_robin: true,
    },
    Scheme::OnHosts {
        family: Family::Direct,
        fewest: true,
        round_robin: false,
    },
    Scheme::OnUnequalHosts(Family::Direct),
    Scheme::OnUnequalHosts(Family::Ring),
];

/// Ranks on hosts of unequal size for every world from 4, interleaved,
/// some holding one rank: an odd world puts rank `r` on host `r % 3`
/// while `r < 4`, then on host 1 (5 ranks: 0 3 | 1 4 | 2; 9 ranks: 0 3 |
/// 1 4 5 6 7 8 | 2); an even one puts rank 0 alone on the first host and
/// the others on two hosts by parity (6 ranks: 0 | 1 3 5 | 2 4).
fn unequal_hosts(world: usize) -> RingOrder {
    let host_of: Vec<usize> = (0..world)
        .map(|r| match (world % 2, r) {
            (0, 0) => 0,
            (0, _) => 1 + r % 2,
            _ if r < 4 => r % 3,
            _ => 1,
        })
        .collect();
    RingOrder::grouping_hosts(&host_of)
}

/// Rank `r` on host `r % H` (round-robin) or `r / (world / H)`, `H` the
/// least or the greatest divisor of `world` that leaves two ranks or more
/// a host (one host where none does; 9 ranks: 3 hosts of 3 either way).
fn on_hosts(world: usize, fewest: bool, round_robin: bool) -> RingOrder {
    let mut divisors = (2..world).filter(|d| world.is_multiple_of(*d));
    let hosts = if fewest {
        divisors.next()
    } else {
        divisors.next_back()
    };
    let hosts = hosts.unwrap_or(1);
    let host_of: Vec<usize> = (0..world)
        .map(|r| {
            if round_robin {
                r % hosts
            } else {
                r / (world / hosts)
            }
        })
        .collect();
    RingOrder::grouping_hosts(&host_of)
}

/// A ring order unlike rank order for every world from 2: even ranks
/// ascending, then odd ones descending (5 ranks: 0 2 4 3 1; 2 ranks: 0 1,
/// which is rank order, the only one of two up to rotation).
fn shuffled(world: usize) -> RingOrder {
    let evens = (0..world).step_by(2);
    let odds = (1..world).step_by(2).rev();
    RingOrder::from_ranks(evens.chain(odds).collect())
}

/// Builds every rank's plan for `op` and runs it. `send_len`/`recv_len` are
/// per-rank lengths; `send_init(rank, i)` gives the inputs.
#[allow(clippy::too_many_arguments)]
fn run(
    scheme: Scheme,
    op: OpKind,
    world: usize,
    send_len: usize,
    recv_len: usize,
    in_place: bool,
    reduce: Option<ReduceOp>,
    root: Option<usize>,
    piece_elems: usize,
    send_init: impl Fn(usize, usize) -> Sym,
) -> Result<Vec<Vec<Sym>>, String> {
    let host = |len| BufDesc {
        len,
        memory: MemoryKind::Host,
    };
    let mut plans = Vec::new();
    let mut ranks = Vec::new();
    for r in 0..world {
        let mut desc = CollectiveDesc::new(op, DType::U64, r, world, MemoryKind::Host);
        desc = if in_place {
            desc.with_in_place(host(recv_len))
        } else {
            desc.with_send(host(send_len)).with_recv(host(recv_len))
        };
        if let Some(o) = reduce {
            desc = desc.with_reduce_op(o);
        }
        if let Some(root) = root {
            desc = desc.with_root(root);
        }
        desc.validate().map_err(|e| e.to_string())?;
        plans.push(match scheme {
            Scheme::Of(family) => plan_with(&desc, piece_elems * 8, family),
            Scheme::RingShuffled => {
                plan_in_order(&desc, piece_elems * 8, Family::Ring, &shuffled(world))
            }
            Scheme::OnHosts {
                family,
                fewest,
                round_robin,
            } => {
                let order = on_hosts(world, fewest, round_robin);
                plan_in_order(&desc, piece_elems * 8, family, &order)
            }
            Scheme::OnUnequalHosts(family) => {
                plan_in_order(&desc, piece_elems * 8, family, &unequal_hosts(world))
            }
        });
        let send: Vec<Sym> = (0..send_len).map(|i| send_init(r, i)).collect();
        let mut recv = vec![UNSET; recv_len];
        if in_place {
            recv = (0..recv_len).map(|i| send_init(r, i)).collect();
        }
        let scratch = vec![UNSET; plans[r].scratch_len];
        ranks.push(Rank {
            send,
            recv,
            scratch,
            in_place,
        });
    }
    simulate(&plans, ranks)
}

fn full(world: usize) -> u64 {
    (1u64 << world) - 1
}

fn reduced(elem: usize, world: usize, avg: bool) -> Sym {
    Sym {
        elem,
        ranks: full(world),
        combines: world as u32 - 1,
        divides: u32::from(avg && world > 1),
        tree: 0,
    }
}

/// Up to 8, and beyond: the tree family pairs ranks below the power of two.
const WORLDS: [usize; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17];
const PIECES: [usize; 3] = [1, 3, 1000];

fn counts(world: usize) -> [usize; 5] {
    [0, 1, world.saturating_sub(1), world + 1, 37]
}

#[test]
fn all_reduce_plans_reduce_every_element_exactly_once_per_rank() {
    for family in SCHEMES {
        for world in WORLDS {
            for count in counts(world) {
                for piece in PIECES {
                    for in_place in [false, true] {
                        for avg in [false, true] {
                            let op = if avg { ReduceOp::Avg } else { ReduceOp::Sum };
                            let out = run(
                                family,
                                OpKind::AllReduce,
                                world,
                                count,
                                count,
                                in_place,
                                Some(op),
                                None,
                                piece,
                                |r, i| input(i, r),
                            )
                            .unwrap_or_else(|e| {
                                panic!("world {world} count {count} piece {piece}: {e}")
                            });
                            for (r, buf) in out.iter().enumerate() {
                                for (i, s) in buf.iter().enumerate() {
                                    assert_eq!(
                                        s.ungrouped(),
                                        reduced(i, world, avg),
                                        "rank {r} world {world} count {count} piece {piece}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_and_all_gather_plans_match_their_definitions() {
    for family in SCHEMES {
        for world in WORLDS {
            for per in [0, 1, 2, 9] {
                for piece in PIECES {
                    for in_place in [false, true] {
                        let out = run(
                            family,
                            OpKind::ReduceScatter,
                            world,
                            per * world,
                            if in_place { per * world } else { per },
                            in_place,
                            Some(ReduceOp::Sum),
                            None,
                            piece,
                            |r, i| input(i, r),
                        )
                        .unwrap();
                        for (r, buf) in out.iter().enumerate() {
                            let mine = if in_place {
                                &buf[r * per..(r + 1) * per]
                            } else {
                                &buf[..]
                            };
                            for (i, s) in mine.iter().enumerate() {
                                assert_eq!(s.ungrouped(), reduced(r * per + i, world, false));
                            }
                            // In place, the other blocks keep the input.
                            if in_place {
                                for (i, s) in buf.iter().enumerate() {
                                    if i / per.max(1) != r {
                                        assert_eq!(*s, input(i, r), "{family:?} world {world}");
                                    }
                                }
                            }
                        }
                        let out = run(
                            family,
                            OpKind::AllGather,
                            world,
                            if in_place { per * world } else { per },
                            per * world,
                            in_place,
                            None,
                            None,
                            piece,
                            |r, i| {
                                if in_place {
                                    // The in-place buffer holds this rank's part at r*per.
                                    if i / per.max(1) == r {
                                        input(i, r)
                                    } else {
                                        UNSET
                                    }
                                } else {
                                    input(r * per + i, r)
                                }
                            },
                        )
                        .unwrap();
                        for buf in out {
                            for (i, s) in buf.iter().enumerate() {
                                assert_eq!(
                                    *s,
                                    input(i, i / per.max(1)),
                                    "all_gather world {world} per {per}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn rooted_plans_match_their_definitions() {
    for family in SCHEMES {
        for world in WORLDS {
            for root in [0, world / 2, world - 1] {
                for count in counts(world) {
                    for piece in PIECES {
                        for in_place in [false, true] {
                            let out = run(
                                family,
                                OpKind::Broadcast,
                                world,
                                count,
                                count,
                                in_place,
                                None,
                                Some(root),
                                piece,
                                |r, i| {
                                    if r == root {
                                        input(i, r)
                                    } else if in_place {
                                        UNSET
                                    } else {
                                        input(i, r)
                                    }
                                },
                            )
                            .unwrap();
                            for buf in &out {
                                assert!(
                                    buf.iter().enumerate().all(|(i, s)| *s == input(i, root)),
                                    "broadcast world {world} root {root}"
                                );
                            }
                            let out = run(
                                family,
                                OpKind::Reduce,
                                world,
                                count,
                                count,
                                in_place,
                                Some(ReduceOp::Avg),
                                Some(root),
                                piece,
                                |r, i| input(i, r),
                            )
                            .unwrap();
                            for (r, buf) in out.iter().enumerate() {
                                for (i, s) in buf.iter().enumerate() {
                                    if r == root {
                                        assert_eq!(
                                            s.ungrouped(),
                                            reduced(i, world, true),
                                            "reduce world {world} root {root}"
                                        );
                                    } else if in_place {
                                        assert_eq!(
                                            *s,
                                            input(i, r),
                                            "in-place reduce must not touch non-roots"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn all_to_all_and_barrier_plans_match_their_definitions() {
    for family in SCHEMES {
        for world in WORLDS {
            for per in [0, 1, 5] {
                for piece in PIECES {
                    let out = run(
                        family,
                        OpKind::AllToAll,
                        world,
                        per * world,
                        per * world,
                        false,
                        None,
                        None,
                        piece,
                        |r, i| input(i, r),
                    )
                    .unwrap();
                    for (r, buf) in out.iter().enumerate() {
                        for (j, s) in buf.iter().enumerate() {
                            let from = j / per;
                            assert_eq!(*s, input(r * per + j % per, from));
                        }
                    }
                }
            }
            run(
                family,
                OpKind::Barrier,
                world,
                0,
                0,
                false,
                None,
                None,
                1,
                |r, i| input(i, r),
            )
            .unwrap();
        }
    }
}

#[test]
fn a_plan_with_a_missing_receive_is_caught() {
    let mut plans = vec![Plan::default(), Plan::default()];
    plans[0].steps.push(Step::Send {
        peer: 1,
        src: Span::new(BufId::Send, 0, 1),
    });
    let ranks = (0..2)
        .map(|r| Rank {
            send: vec![input(0, r)],
            recv: vec![UNSET],
            scratch: Vec::new(),
            in_place: false,
        })
        .collect();
    assert!(simulate(&plans, ranks)
        .unwrap_err()
        .contains("never received"));
    let mut plans = vec![Plan::default(), Plan::default()];
    for (r, p) in plans.iter_mut().enumerate() {
        p.steps.push(Step::Recv {
            peer: 1 - r,
            dst: Span::new(BufId::Recv, 0, 1),
        });
    }
    let ranks = (0..2)
        .map(|r| Rank {
            send: vec![input(0, r)],
            recv: vec![UNSET],
            scratch: Vec::new(),
            in_place: false,
        })
        .collect();
    assert!(simulate(&plans, ranks).unwrap_err().contains("deadlock"));
}

/// How a direct plan over `order` (of `world` ranks) groups every
/// element: in rank order, ((x0 ⊕ x1) ⊕ x2) ⊕ …; where the order knows
/// its hosts, each host's terms in the host's order, then the host sums
/// in host order.
fn direct_on_hosts_order(order: &RingOrder, world: usize) -> u64 {
    let fold = |terms: &mut dyn Iterator<Item = u64>| {
        let first = terms.next().expect("a term");
        terms.fold(first, node)
    };
    if !order.knows_hosts() {
        return fold(&mut (0..world).map(leaf));
    }
    let host_sum = |span: std::ops::Range<usize>| fold(&mut span.map(|q| leaf(order.rank_at(q))));
    fold(&mut order.host_spans().map(host_sum))
}

/// Every rank of an all-reduce holds each element grouped alike (so the
/// ranks' bits agree), reduce-scatter groups each element as all-reduce
/// does (all-reduce = all-gather of reduce-scatter, bit for bit), and the
/// direct plans fold in rank order, ((x0 ⊕ x1) ⊕ x2) ⊕ …, whichever rank
/// folds, or in two levels on hosts ([`direct_on_hosts_order`]).
#[test]
fn reductions_group_alike_on_every_rank() {
    for family in SCHEMES {
        for world in WORLDS {
            for per in [1, 2, 9] {
                for piece in PIECES {
                    for in_place in [false, true] {
                        let count = per * world;
                        let sum = Some(ReduceOp::Sum);
                        let what = format!(
                            "{family:?} world {world} per {per} piece {piece} in place {in_place}"
                        );
                        let ar = run(
                            family,
                            OpKind::AllReduce,
                            world,
                            count,
                            count,
                            in_place,
                            sum,
                            None,
                            piece,
                            |r, i| input(i, r),
                        )
                        .unwrap();
                        let rs = run(
                            family,
                            OpKind::ReduceScatter,
                            world,
                            count,
                            if in_place { count } else { per },
                            in_place,
                            sum,
                            None,
                            piece,
                            |r, i| input(i, r),
                        )
                        .unwrap();
                        let rank_order = (1..world).fold(leaf(0), |acc, r| node(acc, leaf(r)));
                        let direct_order = match family {
                            Scheme::Of(Family::Direct) => Some(rank_order),
                            Scheme::OnHosts {
                                family: Family::Direct,
                                fewest,
                                round_robin,
                            } => Some(direct_on_hosts_order(
                                &on_hosts(world, fewest, round_robin),
                                world,
                            )),
                            Scheme::OnUnequalHosts(Family::Direct) => {
                                Some(direct_on_hosts_order(&unequal_hosts(world), world))
                            }
                            _ => None,
                        };
                        for i in 0..count {
                            let tree = ar[0][i].tree;
                            for (r, buf) in ar.iter().enumerate() {
                                assert_eq!(buf[i].tree, tree, "{what}: rank {r} element {i}");
                            }
                            let (owner, j) = (i / per, i % per);
                            let part = if in_place { owner * per + j } else { j };
                            assert_eq!(
                                rs[owner][part].tree, tree,
                                "{what}: reduce-scatter element {i}"
                            );
                            if let Some(order) = direct_order {
                                assert_eq!(tree, order, "{what}: element {i}");
                            }
                        }
                        // A direct reduce folds as the direct all-reduce.
                        for root in [0, world / 2, world - 1] {
                            let Some(order) = direct_order else { break };
                            let reduced = run(
                                family,
                                OpKind::Reduce,
                                world,
                                count,
                                count,
                                in_place,
                                sum,
                                Some(root),
                                piece,
                                |r, i| input(i, r),
                            )
                            .unwrap();
                            for (i, element) in reduced[root].iter().enumerate() {
                                assert_eq!(
                                    element.tree, order,
                                    "{what}: reduce to {root}, element {i}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
