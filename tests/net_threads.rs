//! The multi-process transport with ranks as threads of this process: the
//! full collective matrix over shared memory and over TCP (loopback), small
//! rings and tiny pieces to force frames to stream through full buffers, and
//! abort/lost-peer behaviour. Real processes are in `tests/multiprocess.rs`.

mod common;

use std::time::{Duration, Instant};

use common::run_ranks_net;
use oxccl::check::{edge_counts, every_collective_every_dtype};
use oxccl::{Communicator, Error, LinkKind, ReduceOp, TransportKind};

fn fail(what: String) -> Error {
    Error::Config {
        name: "test".into(),
        value: String::new(),
        reason: what,
    }
}

fn matrix(kind: TransportKind, chunk_bytes: usize) {
    for world in [1, 2, 3, 4] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .chunk_bytes(chunk_bytes);
        run_ranks_net(world, builder, kind, |comm| {
            let counts = edge_counts(comm.world_size());
            every_collective_every_dtype(comm, &counts).map_err(|e| fail(e.to_string()))
        })
        .unwrap_or_else(|e| panic!("{kind:?} world {world}: {e}"));
    }
}

#[test]
fn every_collective_over_shm() {
    matrix(TransportKind::Shm, oxccl::DEFAULT_CHUNK_BYTES);
}

#[test]
fn every_collective_over_tcp() {
    matrix(TransportKind::Tcp, oxccl::DEFAULT_CHUNK_BYTES);
}

/// Sixteen ranks over TCP, as across hosts, running trees (recursive
/// doubling, binomial; `OXCCL_ALGO=tree`, which the table takes from 32
/// ranks): every result checks.
#[test]
fn sixteen_ranks_over_tcp_run_trees() {
    use oxccl::check::every_collective;
    use oxccl::OpKind;
    let builder = Communicator::builder()
        .timeout(Duration::from_secs(60))
        .algo(oxccl::Algo::Tree);
    run_ranks_net(16, builder, TransportKind::Tcp, |comm| {
        let chose = |op| comm.algorithm_for::<i32>(op, 4096);
        let names = [
            chose(OpKind::AllReduce),
            chose(OpKind::ReduceScatter),
            chose(OpKind::AllGather),
            chose(OpKind::Broadcast),
            chose(OpKind::Reduce),
        ];
        if names != ["doubling", "doubling", "doubling", "binomial", "binomial"] {
            return Err(fail(format!("rank {}: ran {names:?}", comm.rank())));
        }
        every_collective::<i32>(comm, &[1, 15, 17, 300]).map_err(|e| fail(e.to_string()))
    })
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn tiny_pieces_over_shm_and_tcp() {
    matrix(TransportKind::Shm, 64);
    matrix(TransportKind::Tcp, 64);
}

/// 64 MiB all-reduces through 1 MiB rings (and socket buffers): frames far
/// larger than any buffer, sent eagerly by every rank at once.
#[test]
fn large_messages_stream_through_small_buffers() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(60))
            .chunk_bytes(64 << 20);
        run_ranks_net(3, builder, kind, move |comm| {
            let n = 16 << 20;
            let mut v = vec![comm.rank() as f32 + 1.0; n];
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            if v.iter().any(|&x| x != 6.0) {
                return Err(fail(format!("{kind:?}: wrong sum")));
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
    }
}

/// Every rank sends 40 MiB to the next before receiving from the previous
/// (a pair, then a ring of three), in many small frames: more than a
/// receiver reads ahead (16 MiB) plus the links' buffers, so ranks must
/// keep draining each other while they wait to write, or all would wait
/// for room until the deadline.
#[test]
fn ranks_sending_around_a_cycle_before_receiving_do_not_stall() {
    for (world, kind) in [
        (2, TransportKind::Shm),
        (2, TransportKind::Tcp),
        (3, TransportKind::Shm),
        (3, TransportKind::Tcp),
    ] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .chunk_bytes(256 << 10);
        run_ranks_net(world, builder, kind, move |comm| {
            let n = 10 << 20;
            let (rank, world) = (comm.rank(), comm.world_size());
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            let mine = vec![rank as u32 + 7; n];
            comm.send(&mine, next)?;
            let mut theirs = vec![0u32; n];
            comm.recv(&mut theirs, prev)?;
            if theirs.iter().any(|&x| x != prev as u32 + 7) {
                return Err(fail(format!("{kind:?}: wrong data")));
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("world {world} {kind:?}: {e}"));
    }
}

/// A receive waiting on one rank whose frame depends on another rank's
/// large send draining into this one: rank 0 sends 40 MiB to rank 1, then
/// a word to rank 2; rank 2 forwards a word to rank 1; rank 1 waits for
/// rank 2's word first. Rank 1 must keep reading rank 0's frames past its
/// read-ahead while it waits, or all three wait until the deadline.
#[test]
fn a_wait_on_one_rank_still_drains_another() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .chunk_bytes(256 << 10);
        run_ranks_net(3, builder, kind, move |comm| {
            let n = 10 << 20;
            match comm.rank() {
                0 => {
                    comm.send(&vec![5u32; n], 1)?;
                    comm.send(&[1u32], 2)?;
                }
                1 => {
                    let mut word = [0u32];
                    comm.recv(&mut word, 2)?;
                    let mut big = vec![0u32; n];
                    comm.recv(&mut big, 0)?;
                    if word[0] != 2 || big.iter().any(|&x| x != 5) {
                        return Err(fail(format!("{kind:?}: wrong data")));
                    }
                }
                _ => {
                    let mut word = [0u32];
                    comm.recv(&mut word, 0)?;
                    comm.send(&[word[0] + 1], 1)?;
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
    }
}

/// `link_to` names what carries messages to each peer, in a split by the
/// split's ranks; `None` for the rank itself and for ranks it lacks.
#[test]
fn each_peers_link_is_named() {
    for (kind, link) in [
        (TransportKind::Shm, LinkKind::SharedMemory),
        (TransportKind::Tcp, LinkKind::Tcp),
    ] {
        run_ranks_net(3, Communicator::builder(), kind, move |comm| {
            let (rank, world) = (comm.rank(), comm.world_size());
            let links: Vec<_> = (0..world + 1).map(|p| comm.link_to(p)).collect();
            let expected: Vec<_> = (0..world + 1)
                .map(|p| (p != rank && p < world).then_some(link))
                .collect();
            if links != expected {
                return Err(fail(format!("rank {rank}: {links:?}")));
            }
            // Keys reversed: global rank 1 is the pair's rank 0, global
            // rank 0 its rank 1.
            let pair = comm.split(u32::from(rank == 2), -(rank as i64))?;
            let in_pair: Vec<_> = (0..3).map(|p| pair.link_to(p)).collect();
            let expected = match rank {
                0 => vec![Some(link), None, None],
                1 => vec![None, Some(link), None],
                _ => vec![None, None, None],
            };
            if in_pair != expected {
                return Err(fail(format!("rank {rank} in its split: {in_pair:?}")));
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
    }
    let group = Communicator::local_group(2).expect("two threads");
    for comm in &group {
        let peer = 1 - comm.rank();
        assert_eq!(comm.link_to(peer), Some(LinkKind::InProcess));
        assert_eq!(comm.link_to(comm.rank()), None);
        assert_eq!(comm.link_to(2), None);
        assert_eq!(LinkKind::InProcess.name(), "in-process");
    }
}

/// Threads outnumber the CPUs when there are more of them than this
/// process may run on.
#[test]
fn threads_beyond_the_cpus_outnumber_them() {
    // The CPUs of this process's affinity (not `available_parallelism`,
    // which a CPU quota may lower).
    // SAFETY: cpu_set_t is plain data, written by sched_getaffinity.
    let cpus = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        libc::CPU_COUNT(&set) as usize
    };
    let crowded = Communicator::local_group(cpus + 1).expect("threads");
    assert!(crowded.iter().all(|c| c.ranks_outnumber_cpus()));
    let alone = Communicator::local_group(1).expect("one thread");
    assert!(!alone[0].ranks_outnumber_cpus());
    // A split answers for its whole group, and a thread pinned to one CPU
    // afterwards does not change the answer.
    let group = Communicator::local_group(2).expect("two threads");
    let crowded_pair = cpus < 2;
    let handles: Vec<_> = group
        .into_iter()
        .map(|mut comm| {
            std::thread::spawn(move || {
                oxccl::launch::bind_thread_like_a_rank(comm.rank(), 2);
                let single = comm.split(comm.rank() as u32, 0).expect("split");
                (comm.ranks_outnumber_cpus(), single.ranks_outnumber_cpus())
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("no panic"), (crowded_pair, crowded_pair));
    }
    let big = Communicator::local_group(cpus + 1).expect("threads");
    let handles: Vec<_> = big
        .into_iter()
        .map(|mut comm| {
            std::thread::spawn(move || {
                let single = comm.split(comm.rank() as u32, 0).expect("split");
                single.ranks_outnumber_cpus()
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().expect("no panic"));
    }
}

#[test]
fn splits_share_the_links() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        run_ranks_net(4, Communicator::builder(), kind, move |comm| {
            let rank = comm.rank();
            let mut pair = comm.split((rank / 2) as u32, rank as i64)?;
            let mut v = vec![rank as i32; 100];
            pair.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            let expected = if rank < 2 { 1 } else { 5 };
            if v.iter().any(|&x| x != expected) {
                return Err(fail(format!("rank {rank}: {:?}", &v[..3])));
            }
            comm.barrier()?;
            // The pair gets its own arena on shared memory (two-shot for a
            // large all-reduce), and every collective checks out on it.
            let algo = pair.algorithm_for::<f32>(oxccl::OpKind::AllReduce, 1 << 20);
            let expected = if kind == TransportKind::Shm {
                "twoshot"
            } else {
                "ring"
            };
            if algo != expected {
                return Err(fail(format!("split group runs {algo}, not {expected}")));
            }
            every_collective_every_dtype(&mut pair, &edge_counts(2))
                .map_err(|e| fail(e.to_string()))?;
            Ok(pair.transport_description())
        })
        .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
    }
}

#[test]
fn a_dropped_peer_is_reported_not_waited_for() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let builder = Communicator::builder().timeout(Duration::from_secs(30));
        let result = run_ranks_net(3, builder, kind, |comm| {
            if comm.rank() == 2 {
                return Ok(Duration::ZERO); // leaves without joining the collective
            }
            let start = Instant::now();
            let mut v = vec![1.0f32; 1000];
            match comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
                Err(Error::PeerLost { peer: 2, .. }) => Ok(start.elapsed()),
                other => Err(fail(format!("rank {}: {other:?}", comm.rank()))),
            }
        })
        .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        for waited in &result[..2] {
            assert!(
                *waited < Duration::from_secs(10),
                "{kind:?}: waited {waited:?}"
            );
        }
    }
}

/// A rank that drops its communicator while an `AbortHandle` of it lives
/// on (a watchdog's) has left: its peers learn so at once. The handle held
/// the whole fabric, so no leave or goodbye went out until it was dropped
/// (between processes, the rank's exit then read as a crash).
#[test]
fn a_live_abort_handle_does_not_hide_a_departure() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let store = std::sync::Arc::new(oxccl::bootstrap::MemoryStore::new());
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .transport(kind);
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (store, builder) = (store.clone(), builder.clone());
                std::thread::spawn(move || -> Result<Option<Duration>, String> {
                    let mut comm = builder.init(rank, 2, store).map_err(|e| e.to_string())?;
                    if rank == 1 {
                        let watchdog = comm.abort_handle();
                        drop(comm);
                        std::thread::sleep(Duration::from_secs(6));
                        drop(watchdog);
                        return Ok(None);
                    }
                    let start = Instant::now();
                    let mut v = vec![1.0f32; 1000];
                    match comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
                        Err(Error::PeerLost { peer: 1, .. }) => Ok(Some(start.elapsed())),
                        other => Err(format!("rank 0: {other:?}")),
                    }
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        let waited = results[0]
            .clone()
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"))
            .expect("rank 0 waited");
        assert!(
            waited < Duration::from_secs(3),
            "{kind:?}: rank 0 waited {waited:?} for a rank that had left"
        );
    }
}

/// A rank whose peer left while a large send to it was still queued drops
/// its communicator at once: what is queued for a peer that has gone (its
/// goodbye read) is never written, so the drop does not wait out the
/// goodbye's 2 s flush for it.
#[test]
fn a_drop_does_not_wait_to_flush_to_a_departed_peer() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let store = std::sync::Arc::new(oxccl::bootstrap::MemoryStore::new());
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .transport(kind);
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (store, builder) = (store.clone(), builder.clone());
                std::thread::spawn(move || -> Result<Duration, String> {
                    let mut comm = builder.init(rank, 2, store).map_err(|e| e.to_string())?;
                    if rank == 0 {
                        std::thread::sleep(Duration::from_millis(300));
                        drop(comm);
                        return Ok(Duration::ZERO);
                    }
                    // 64 MiB: more than the ring or the socket buffers hold.
                    let big = vec![1u8; 64 << 20];
                    match comm.send(&big, 0) {
                        Err(Error::PeerLost { peer: 0, .. }) => {}
                        other => return Err(format!("rank 1's send: {other:?}")),
                    }
                    let start = Instant::now();
                    drop(comm);
                    Ok(start.elapsed())
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        let dropped_in = results[1]
            .clone()
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert!(
            dropped_in < Duration::from_secs(1),
            "{kind:?}: the drop took {dropped_in:?}"
        );
    }
}

/// Survivors name the rank whose loss started a failure, not a rank that
/// failed because of it: over TCP, ring all-reduce (0 → 1 → 2 → 3 → 0),
/// rank 3 leaves; rank 0, which receives from it, fails and leaves; ranks
/// 1 and 2 come late, when both departures are there, and name rank 3
/// (rank 0, looked at first, had entered the call: its departure is not
/// what stopped it). The race this stop's cause-carrying leave frame
/// closes (a rank that entered the call, failed because of a death this
/// rank has not read yet, then left) is not reproducible here with threads.
#[test]
fn a_failure_names_the_lost_rank_that_caused_it() {
    let builder = Communicator::builder()
        .timeout(Duration::from_secs(30))
        .algo(oxccl::Algo::Ring);
    let result = run_ranks_net(4, builder, TransportKind::Tcp, |comm| {
        if comm.rank() == 3 {
            return Ok(None); // leaves without joining the collective
        }
        if comm.rank() != 0 {
            std::thread::sleep(Duration::from_millis(500));
        }
        let mut v = vec![1.0f32; 100_000];
        match comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
            Err(Error::PeerLost { peer, .. }) => Ok(Some(peer)),
            other => Err(fail(format!("rank {}: {other:?}", comm.rank()))),
        }
    })
    .unwrap();
    assert_eq!(result, [Some(3), Some(3), Some(3), None]);
}

/// Survivors of a call whose rank 2 is late name rank 2. Over a TCP ring:
/// rank 3, which entered first, times out naming it, and ranks 0 and 1,
/// which entered later and wait on rank 3 (or on a rank waiting on it),
/// say that a peer gave up because rank 2 did not answer (before, they
/// said "peer rank 3 is gone", blaming the messenger). When several ranks'
/// timers run out together, the first to fire is what the others name;
/// here rank 3's fires 1.5 s before theirs.
#[test]
fn ranks_behind_a_timed_out_one_name_the_late_rank() {
    let body = |comm: &mut Communicator| -> oxccl::Result<Option<(&'static str, usize)>> {
        match comm.rank() {
            2 => {
                std::thread::sleep(Duration::from_secs(6));
                return Ok(None);
            }
            3 => {}
            _ => std::thread::sleep(Duration::from_millis(1500)),
        }
        let mut v = vec![1.0f32; 100_000];
        match comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
            Err(Error::Timeout { peer, .. }) => Ok(Some(("timeout", peer))),
            Err(Error::PeerTimedOut { late, .. }) => Ok(Some(("behind", late))),
            other => Err(fail(format!("rank {}: {other:?}", comm.rank()))),
        }
    };
    let builder = Communicator::builder().timeout(Duration::from_secs(3));
    let runs = [
        // TCP links running a ring 0 → 1 → 2 → 3 → 0 (rank 3 receives
        // from rank 2; the others wait on rank 3 or behind it).
        (
            "tcp ring",
            run_ranks_net(
                4,
                builder.clone().algo(oxccl::Algo::Ring),
                TransportKind::Tcp,
                body,
            ),
        ),
        // The shared arena across "processes" (staged: every rank awaits
        // every other; a failed rank's cause is in its control line).
        (
            "shm arena",
            run_ranks_net(4, builder.clone(), TransportKind::Shm, body),
        ),
        // Threads: zero copy, where the rank that times out withdraws its
        // post and waits for the others to fail before it returns.
        ("threads", common::run_ranks_with(4, builder, body)),
    ];
    for (what, result) in runs {
        let result = result.unwrap_or_else(|e| panic!("{what}: {e}"));
        if what == "tcp ring" {
            assert_eq!(
                result,
                [
                    Some(("behind", 2)),
                    Some(("behind", 2)),
                    None,
                    Some(("timeout", 2))
                ],
                "{what}"
            );
        } else {
            // In the arena every rank waits on rank 2 itself, each wait
            // timed from its start (rank 3's starts once ranks 0 and 1
            // have posted): whoever fires first, every rank names rank 2,
            // never the rank that gave up first.
            for (rank, outcome) in result.iter().enumerate() {
                let expected = rank == 2 || matches!(outcome, Some((_, 2)));
                assert!(expected, "{what}: rank {rank}: {result:?}");
            }
        }
    }
}

/// A rank that drops a sub-communicator while keeping its parent (and so
/// its links) is lost to the sub-communicator's later calls at once, as a
/// rank that dropped everything is, small and large; and the parent, which
/// it still uses, is not harmed.
#[test]
fn a_dropped_sub_communicator_is_reported_not_waited_for() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let builder = Communicator::builder().timeout(Duration::from_secs(30));
        let result = run_ranks_net(3, builder, kind, |comm| {
            let mut waited = Duration::ZERO;
            // A communicator fails for good at its first error, so each
            // size gets its own sub-communicator.
            for len in [1000, 1 << 20] {
                let mut child = comm.split(0, 0)?;
                if comm.rank() == 2 {
                    drop(child);
                    continue;
                }
                let start = Instant::now();
                let mut v = vec![1.0f32; len];
                match child.all_reduce_in_place(&mut v, ReduceOp::Sum) {
                    Err(Error::PeerLost { peer: 2, .. }) => {}
                    other => return Err(fail(format!("rank {} ({len}): {other:?}", comm.rank()))),
                }
                waited = waited.max(start.elapsed());
            }
            comm.barrier()?;
            let mut v = vec![1u32; 4096];
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            if v.iter().any(|&x| x != 3) {
                return Err(fail(format!("parent after the loss: {:?}", &v[..3])));
            }
            Ok(waited)
        })
        .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        for waited in &result[..2] {
            assert!(
                *waited < Duration::from_secs(10),
                "{kind:?}: waited {waited:?}"
            );
        }
    }
}

/// A rank whose communicator failed, its process staying (here: aborted,
/// then kept alive until the others are done), is lost to the others' waits
/// at once instead of after their timeout, whichever rank they wait on.
#[test]
fn a_failed_rank_that_stays_is_reported_not_waited_for() {
    let done = std::sync::Arc::new(std::sync::Barrier::new(3));
    let builder = Communicator::builder().timeout(Duration::from_secs(20));
    let result = run_ranks_net(3, builder, TransportKind::Tcp, move |comm| {
        let mut v = vec![1.0f32; 1 << 18];
        let start = Instant::now();
        let outcome = if comm.rank() == 0 {
            comm.abort_handle().abort();
            match comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
                Err(Error::Aborted { .. }) => Ok(Duration::ZERO),
                other => Err(fail(format!("rank 0: {other:?}"))),
            }
        } else {
            match comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
                Err(Error::PeerLost { peer: 0, .. }) => Ok(start.elapsed()),
                other => Err(fail(format!("rank {}: {other:?}", comm.rank()))),
            }
        };
        done.wait();
        outcome
    })
    .unwrap();
    for waited in &result[1..] {
        assert!(*waited < Duration::from_secs(10), "waited {waited:?}");
    }
}

#[test]
fn abort_unblocks_a_waiting_call() {
    let builder = Communicator::builder().timeout(Duration::from_secs(60));
    let result = run_ranks_net(2, builder, TransportKind::Tcp, |comm| {
        if comm.rank() == 1 {
            // Rank 1 never joins; rank 0 is aborted from another thread.
            std::thread::sleep(Duration::from_secs(1));
            return Ok(());
        }
        let handle = comm.abort_handle();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            handle.abort();
        });
        let mut v = [0u8; 4];
        let start = Instant::now();
        let r = comm.recv(&mut v, 1);
        let _ = aborter.join();
        match r {
            Err(Error::Aborted { .. }) if start.elapsed() < Duration::from_secs(5) => Ok(()),
            other => Err(fail(format!("{other:?} after {:?}", start.elapsed()))),
        }
    });
    result.unwrap();
}

#[test]
fn rendezvous_names_the_ranks_that_never_joined() {
    let store = std::sync::Arc::new(oxccl::bootstrap::MemoryStore::new());
    let builder = Communicator::builder().timeout(Duration::from_millis(300));
    let err = match builder.init(0, 6, store) {
        Err(e) => e,
        Ok(_) => panic!("rendezvous of one rank out of six succeeded"),
    };
    let text = err.to_string();
    assert!(
        text.starts_with("rank 0: ") && text.contains("ranks 1, 2, 3, 4 and 5 never joined"),
        "{text}"
    );
}

/// Ranks that joined but never set up their shared memory (stopped,
/// failed, or told another transport) are not reported as never having
/// joined: the message names the step they missed.
#[test]
fn rendezvous_names_the_step_a_joined_rank_missed() {
    use oxccl::bootstrap::Store;
    let store = std::sync::Arc::new(oxccl::bootstrap::MemoryStore::new());
    let builder = Communicator::builder()
        .transport(TransportKind::Shm)
        .timeout(Duration::from_millis(500));
    // Rank 1 "joins" by hand: it announces itself as rank 1 does (the
    // keys a rank sets first) by copying what rank 0 sets, then stops.
    let joiner = {
        let store = store.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(mine)) = store.try_get("oxccl/rank/0") {
                    let _ = store.set("oxccl/rank/1", &mine);
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let err = match builder.init(0, 2, store) {
        Err(e) => e,
        Ok(_) => panic!("set-up with a stopped peer succeeded"),
    };
    joiner.join().unwrap();
    let text = err.to_string();
    assert!(
        text.starts_with("rank 0: ") && !text.contains("never joined"),
        "{text}"
    );
}

/// A rank that finds its number taken in the store (another job on the
/// same MASTER_PORT, or RANK given twice) is refused before it announces
/// itself, with the holder named; a rank started for another world size
/// is refused at rendezvous. The job that got there first is untouched.
#[test]
fn a_second_claim_of_a_rank_and_a_foreign_world_size_are_refused() {
    let store = std::sync::Arc::new(oxccl::bootstrap::MemoryStore::new());
    let builder = Communicator::builder().timeout(Duration::from_secs(20));
    let joined: Vec<_> = (0..2)
        .map(|rank| {
            let (store, builder) = (store.clone(), builder.clone());
            std::thread::spawn(move || builder.init(rank, 2, store))
        })
        .collect();
    let mut comms: Vec<Communicator> = joined
        .into_iter()
        .map(|h| h.join().unwrap().expect("the first job joins"))
        .collect();

    let quick = Communicator::builder().timeout(Duration::from_millis(500));
    let text = match quick.init(1, 2, store.clone()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a second rank 1 joined"),
    };
    // Both claimants are this process here (another process's claim is
    // in tests/multiprocess.rs): told as such.
    let pid = std::process::id();
    assert!(
        text.contains("rank 1 of the job at")
            && text.contains(&format!(
                "is already taken by this same process (pid {pid})"
            ))
            && text.contains("MASTER_PORT"),
        "{text}"
    );

    // Rank 2 is free in that store, but its job has 3 ranks: the entries
    // of ranks 0 and 1 complete its rendezvous and say world size 2.
    let text = match quick.init(2, 3, store.clone()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a rank of a 3-rank job joined a 2-rank job"),
    };
    assert!(
        text.contains("was started for world size 2, this rank for 3"),
        "{text}"
    );

    // The first job still works.
    let handles: Vec<_> = comms
        .drain(..)
        .map(|mut comm| {
            std::thread::spawn(move || {
                let mut v = vec![comm.rank() as u32 + 1; 5];
                comm.all_reduce_in_place(&mut v, ReduceOp::Sum).map(|()| v)
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap().unwrap(), vec![3; 5]);
    }
}

/// Ranks that would plan calls differently (another algorithm family or
/// pipeline piece) or pick other links are refused at rendezvous, each
/// naming the setting and both values: with `OXCCL_ALGO=ring` on one rank
/// only, a TCP all-reduce returned `Ok` with a wrong sum on the other.
#[test]
fn ranks_whose_settings_differ_are_refused_at_rendezvous() {
    use oxccl::Algo;
    let base = Communicator::builder()
        .timeout(Duration::from_secs(20))
        .transport(TransportKind::Tcp);
    let cases = [
        (base.clone().algo(Algo::Ring), "OXCCL_ALGO", "ring", "auto"),
        (
            base.clone().chunk_bytes(4096),
            "OXCCL_CHUNK_BYTES",
            "4096",
            "auto",
        ),
        (
            base.clone().transport(TransportKind::Auto),
            "OXCCL_TRANSPORT",
            "auto",
            "tcp",
        ),
    ];
    for (odd, name, odd_value, usual) in cases {
        let store = std::sync::Arc::new(oxccl::bootstrap::MemoryStore::new());
        let joined: Vec<_> = (0..2)
            .map(|rank| {
                let builder = if rank == 0 { odd.clone() } else { base.clone() };
                let store = store.clone();
                std::thread::spawn(move || builder.init(rank, 2, store))
            })
            .collect();
        for (rank, handle) in joined.into_iter().enumerate() {
            let text = match handle.join().unwrap() {
                Err(e @ Error::Config { .. }) => e.to_string(),
                Err(e) => panic!("rank {rank}: {name}: another error: {e}"),
                Ok(_) => panic!("rank {rank}: ranks with another {name} joined"),
            };
            let (mine, theirs) = if rank == 0 {
                (odd_value, usual)
            } else {
                (usual, odd_value)
            };
            assert!(
                text.contains(&format!("{name}=\"{mine}\""))
                    && text.contains(&format!("rank {} with {name}={theirs}", 1 - rank)),
                "{text}"
            );
        }
    }
}

#[test]
fn rendezvous_through_a_file_store() {
    let dir = std::env::temp_dir().join(format!("oxccl-filestore-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = std::sync::Arc::new(oxccl::bootstrap::FileStore::new(&dir).unwrap());
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || -> oxccl::Result<Vec<u32>> {
                let mut comm = Communicator::builder()
                    .timeout(Duration::from_secs(20))
                    .init(rank, 3, store)?;
                let mut v = vec![rank as u32 + 1; 7];
                comm.all_reduce_in_place(&mut v, ReduceOp::Prod)?;
                Ok(v)
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap().unwrap(), vec![6; 7]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs an all-reduce, and an all-gather of a reduce-scatter, of the same
/// inputs (`per_rank` elements per rank) on `world` ranks over TCP; checks
/// that every rank holds the same bits both ways; returns the algorithm
/// the all-reduce ran.
fn all_reduce_and_composed_agree(
    world: usize,
    per_rank: usize,
    builder: oxccl::CommBuilder,
) -> &'static str {
    let results = run_ranks_net(world, builder, TransportKind::Tcp, move |comm| {
        let rank = comm.rank();
        let count = per_rank * world;
        let x: Vec<f32> = (0..count)
            .map(|i| ((i * 7919 + rank * 104_729) % 1000) as f32 * 0.001 + 0.1)
            .collect();
        let mut ar = vec![0.0f32; count];
        comm.all_reduce(&x, &mut ar, ReduceOp::Sum)?;
        let mut part = vec![0.0f32; per_rank];
        comm.reduce_scatter(&x, &mut part, ReduceOp::Sum)?;
        let mut composed = vec![0.0f32; count];
        comm.all_gather(&part, &mut composed)?;
        let algo = comm.algorithm_for::<f32>(oxccl::OpKind::AllReduce, count * 4);
        Ok((ar, composed, algo))
    })
    .unwrap_or_else(|e| panic!("world {world} per_rank {per_rank}: {e}"));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (rank, (ar, composed, _)) in results.iter().enumerate() {
        let what = format!("world {world} per_rank {per_rank} rank {rank}");
        assert_eq!(bits(ar), bits(composed), "{what}");
        assert_eq!(bits(ar), bits(&results[0].0), "{what} differs from rank 0");
    }
    results[0].2
}

/// Over TCP the table picks direct schedules for small buffers and the ring
/// for large ones; either way all-reduce equals all-gather of reduce-scatter
/// bit for bit, and every rank holds the same bits. The largest size cuts
/// each rank's chunk into several of the ring's 1 MiB TCP pieces and an
/// uneven rest.
#[test]
fn all_reduce_is_all_gather_of_reduce_scatter_over_tcp_for_both_families() {
    for per_rank in [3usize, 5_000, 40_000, 700_001] {
        let builder = Communicator::builder().timeout(Duration::from_secs(30));
        let algo = all_reduce_and_composed_agree(3, per_rank, builder);
        // Direct while a rank sends at most 256 KiB: bytes · (N − 1).
        let expected = if per_rank <= 5_000 { "oneshot" } else { "ring" };
        assert_eq!(algo, expected, "per_rank {per_rank}");
    }
}

/// The same for the trees (`OXCCL_ALGO=tree`), with worlds whose first
/// ranks pair up before the rounds (3, 6) and one that needs no pairs (4):
/// recursive doubling folds the lower ranks first on every rank, and the
/// reduce-scatter runs the same rounds.
#[test]
fn all_reduce_is_all_gather_of_reduce_scatter_over_tcp_for_trees() {
    for (world, per_rank) in [(3usize, 3usize), (4, 5_000), (6, 1_001)] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .algo(oxccl::Algo::Tree);
        let algo = all_reduce_and_composed_agree(world, per_rank, builder);
        assert_eq!(algo, "doubling", "world {world}");
    }
}

/// Without a piece size set, the ring collectives cut 1 MiB pieces where
/// every link is TCP and everything else 256 KiB ones; shared-memory links
/// keep 256 KiB for all; a piece size set wins everywhere; a split's
/// members choose alike (here, on one host, as their parent: which groups
/// count as TCP by their hosts is `net`'s unit test). Fails when
/// `OXCCL_CHUNK_BYTES` is set in the environment.
#[test]
fn pipeline_pieces_are_chosen_by_collective_and_links() {
    use oxccl::types::OpKind;
    const OPS: [OpKind; 8] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::Send,
        OpKind::Recv,
        OpKind::AllToAll,
    ];
    let ring = |op: OpKind| {
        matches!(
            op,
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather
        )
    };
    for (kind, set) in [
        (TransportKind::Tcp, None),
        (TransportKind::Shm, None),
        (TransportKind::Tcp, Some(4096)),
    ] {
        let mut builder = Communicator::builder().timeout(Duration::from_secs(30));
        if let Some(bytes) = set {
            builder = builder.chunk_bytes(bytes);
        }
        let chosen = run_ranks_net(3, builder, kind, |comm| {
            // Ranks 0 and 2 in one group, rank 1 alone.
            let mut sub = comm.split((comm.rank() % 2) as u32, 0)?;
            // Pieces cut alike on every rank, so a large all-reduce works.
            let mut v = vec![1u32; (3 << 20) + 5];
            sub.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            if v.iter().any(|&x| x as usize != sub.world_size()) {
                return Err(fail("wrong sum".into()));
            }
            Ok(OPS.map(|op| (comm.chunk_bytes_for(op), sub.chunk_bytes_for(op))))
        })
        .unwrap_or_else(|e| panic!("{kind:?} {set:?}: {e}"));
        for (rank, per_op) in chosen.iter().enumerate() {
            for (op, (whole, sub)) in OPS.iter().zip(per_op) {
                let expected = match set {
                    Some(bytes) => bytes,
                    None if kind == TransportKind::Tcp && ring(*op) => {
                        oxccl::DEFAULT_TCP_RING_CHUNK_BYTES
                    }
                    None => oxccl::DEFAULT_CHUNK_BYTES,
                };
                assert_eq!(*whole, expected, "{kind:?} {set:?} rank {rank} {op:?}");
                // Rank 1's group of one has no link, and answers as a TCP
                // group only where the job forced TCP.
                assert_eq!(
                    *sub, expected,
                    "{kind:?} {set:?} rank {rank} {op:?} (split)"
                );
            }
        }
    }
}

/// Broadcasts whose root runs ahead of its receivers (they pause now and
/// then): large frames arrive before their call starts, wait in the link
/// (held) or land in buffers posted ahead, and every call still gets its
/// own data, in place and out of place, at sizes that split into uneven
/// chunks. An all-gather every few calls interleaves frames from every rank.
#[test]
fn a_root_running_ahead_with_large_broadcasts_gets_every_call_right() {
    for (world, kind) in [
        (2, TransportKind::Tcp),
        (3, TransportKind::Tcp),
        (2, TransportKind::Shm),
    ] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(60))
            .chunk_bytes(256 << 10)
            .algo(oxccl::Algo::Ring);
        run_ranks_net(world, builder, kind, move |comm| {
            let rank = comm.rank();
            let world = comm.world_size();
            for call in 0..40usize {
                let root = (call / 10) % world;
                // 64 KiB to about 2 MiB, not a multiple of the chunk.
                let n = (16 << 10) + call * 13_001;
                let value = |i: usize| (call * 1_000_003 + i) as u32;
                let expected: Vec<u32> = (0..n).map(value).collect();
                if rank != root && call % 7 == 3 {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let mut out = vec![0u32; n];
                if call % 2 == 0 {
                    if rank == root {
                        out.copy_from_slice(&expected);
                    }
                    comm.broadcast_in_place(&mut out, root)?;
                } else {
                    let send = if rank == root { expected.clone() } else { vec![0; n] };
                    comm.broadcast(&send, &mut out, root)?;
                }
                if out != expected {
                    let first = out.iter().zip(&expected).position(|(a, b)| a != b);
                    return Err(fail(format!(
                        "{kind:?} world {world} rank {rank} call {call}: first wrong element {first:?}"
                    )));
                }
                if call % 5 == 4 {
                    let part = 40_000 + call;
                    let mine = vec![(rank * 7 + call) as u32; part];
                    let mut all = vec![0u32; part * world];
                    comm.all_gather(&mine, &mut all)?;
                    for (r, piece) in all.chunks(part).enumerate() {
                        if piece.iter().any(|&x| x != (r * 7 + call) as u32) {
                            return Err(fail(format!("{kind:?} call {call}: all-gather piece {r}")));
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{kind:?} world {world}: {e}"));
    }
}

/// A large frame that nothing has asked for yet stays in its link; a frame
/// behind it on the same link, on another communicator, is still reached
/// (the wait stalls, and the held frame is read into a buffer of its own).
#[test]
fn a_frame_behind_a_held_one_still_arrives() {
    let builder = Communicator::builder().timeout(Duration::from_secs(30));
    run_ranks_net(2, builder, TransportKind::Tcp, |comm| {
        let mut other = comm.split(0, comm.rank() as i64)?;
        let n = 1 << 20;
        if comm.rank() == 0 {
            comm.send(&vec![3u32; n], 1)?;
            other.send(&[9u32], 1)?;
        } else {
            let mut word = [0u32];
            other.recv(&mut word, 0)?;
            let mut big = vec![0u32; n];
            comm.recv(&mut big, 0)?;
            if word[0] != 9 || big.iter().any(|&x| x != 3) {
                return Err(fail("wrong data".into()));
            }
        }
        Ok(())
    })
    .unwrap();
}

/// A call that fails takes back the destinations it posted ahead: the
/// root's frames, arriving after the receiver timed out, go to buffers of
/// their own and never into the receiver's (reused) buffer.
#[test]
fn a_failed_call_withdraws_what_it_posted_ahead() {
    let builder = Communicator::builder()
        .timeout(Duration::from_secs(2))
        .chunk_bytes(128 << 10)
        .algo(oxccl::Algo::Ring);
    run_ranks_net(2, builder, TransportKind::Tcp, |comm| {
        let mut after = comm.split(0, comm.rank() as i64)?;
        let start = Instant::now();
        let n = 256 << 10; // 1 MiB in 8 chunks: 7 posted ahead
        if comm.rank() == 0 {
            std::thread::sleep(Duration::from_secs(3));
            comm.broadcast_in_place(&mut vec![5u32; n], 0)?;
            after.barrier()?;
            return Ok(());
        }
        let mut buf = vec![0u32; n];
        match comm.broadcast_in_place(&mut buf, 0) {
            Err(Error::Timeout { .. }) => {}
            other => return Err(fail(format!("expected a timeout, got {other:?}"))),
        }
        buf.fill(7);
        // Enter the barrier after the root's late broadcast went out: the
        // barrier's wait reads those frames.
        std::thread::sleep(Duration::from_secs(4).saturating_sub(start.elapsed()));
        after.barrier()?;
        if let Some(i) = buf.iter().position(|&x| x != 7) {
            return Err(fail(format!("element {i} overwritten with {}", buf[i])));
        }
        Ok(())
    })
    .unwrap();
}

/// Calls that agree on the operation and on each frame's size but not on
/// the element type, the reduce operation or the element count are a
/// `Mismatch` over the links (TCP, and the in-process ring) rather than a
/// wrong result or a truncated receive. (An eager send is done once its
/// frames are queued: the receive is the one told.)
#[test]
fn calls_that_differ_only_in_type_op_or_count_are_mismatches() {
    fn mismatch(result: oxccl::Result<()>) -> Result<(), Error> {
        match result {
            Err(Error::Mismatch { .. }) => Ok(()),
            // The peer's own error names this rank as failed.
            Err(Error::PeerLost { .. }) => Ok(()),
            other => Err(fail(format!("{other:?}"))),
        }
    }
    type Body = fn(&mut Communicator) -> oxccl::Result<()>;
    let cases: [(&str, Body); 3] = [
        ("f32 against i32", |comm| {
            if comm.rank() == 0 {
                comm.all_reduce_in_place(&mut [1.0f32; 4096], ReduceOp::Sum)
            } else {
                comm.all_reduce_in_place(&mut [1i32; 4096], ReduceOp::Sum)
            }
        }),
        ("sum against max", |comm| {
            let op = if comm.rank() == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            };
            comm.all_reduce_in_place(&mut [1.0f32; 4096], op)
        }),
        ("a send of twice the receive", |comm| {
            if comm.rank() == 0 {
                comm.send(&vec![1.0f32; 1 << 17], 1)?;
                Err(Error::Mismatch {
                    op: oxccl::OpKind::Send,
                    seq: 0,
                    rank: 0,
                    peer: 1,
                    detail: "not the sender's to tell".into(),
                })
            } else {
                comm.recv(&mut vec![0.0f32; 1 << 16], 0)
            }
        }),
    ];
    for (what, body) in cases {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(10))
            .chunk_bytes(64 << 10);
        let over_tcp = run_ranks_net(2, builder.clone(), TransportKind::Tcp, move |comm| {
            mismatch(body(comm))
        });
        let ring = builder.algo(oxccl::Algo::Ring);
        let in_process = common::run_ranks_with(2, ring, move |comm| mismatch(body(comm)));
        for (how, outcome) in [("tcp", over_tcp), ("threads, ring", in_process)] {
            if let Err(e) = outcome {
                panic!("{what} ({how}): {e}");
            }
        }
    }
}

/// Ranks that disagree on a broadcast's root each only send: over the links
/// the frame nobody received is found at the end of that call or of the
/// next, a `Mismatch`, instead of every rank returning `Ok` with its own
/// data.
#[test]
fn a_broadcast_whose_ranks_disagree_on_the_root_is_a_mismatch() {
    let builder = Communicator::builder().timeout(Duration::from_secs(10));
    run_ranks_net(2, builder, TransportKind::Tcp, |comm| {
        let mut v = vec![comm.rank() as f32; 4096];
        let root = comm.rank();
        let first = comm.broadcast_in_place(&mut v, root);
        let second = first.and_then(|()| comm.barrier());
        match second {
            Err(Error::Mismatch { detail, .. }) if detail.contains("different root") => Ok(()),
            // The peer found it first and failed: this rank learns so.
            Err(Error::PeerLost { .. }) => Ok(()),
            other => Err(fail(format!("rank {}: {other:?}", comm.rank()))),
        }
    })
    .unwrap_or_else(|e| panic!("tcp: {e}"));
    let ring = Communicator::builder()
        .timeout(Duration::from_secs(10))
        .algo(oxccl::Algo::Ring);
    common::run_ranks_with(2, ring, |comm| {
        let mut v = vec![comm.rank() as f32; 4096];
        let root = comm.rank();
        let outcome = comm
            .broadcast_in_place(&mut v, root)
            .and_then(|()| comm.barrier());
        match outcome {
            Err(Error::Mismatch { .. }) | Err(Error::PeerLost { .. }) => Ok(()),
            other => Err(fail(format!("rank {} (ring): {other:?}", comm.rank()))),
        }
    })
    .unwrap();
}

/// A frame of another call with the same byte count (an `f32` send against
/// an `i32` receive) is refused without a byte of it written into the
/// receiver's buffer, over TCP and shared memory. The receive is posted
/// first, so the frame starts arriving while its destination waits: it
/// was read straight into it, and only then compared with the call.
#[test]
fn a_mismatched_frame_never_lands_in_the_callers_buffer() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let builder = Communicator::builder().timeout(Duration::from_secs(10));
        let result = run_ranks_net(2, builder, kind, |comm| {
            if comm.rank() == 0 {
                // Rank 1's receive is posted by the time this arrives.
                std::thread::sleep(Duration::from_millis(300));
                let _ = comm.send(&[1.5f32; 4096], 1);
                Ok(None)
            } else {
                let mut out = vec![-7i32; 4096];
                let refused = matches!(comm.recv(&mut out, 0), Err(Error::Mismatch { .. }));
                Ok(Some((refused, out.iter().all(|&x| x == -7))))
            }
        })
        .unwrap();
        assert_eq!(result[1], Some((true, true)), "{kind:?}");
    }
}
