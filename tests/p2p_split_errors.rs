//! Send/recv ordering, split groups side by side, bad input, timeouts and
//! lost peers.

mod common;

use std::time::Duration;

use common::{run_ranks, run_ranks_with};
use oxccl::{f16, Communicator, Error, OpKind, ReduceOp};

#[test]
fn send_recv_preserve_order_between_pairs() {
    run_ranks(4, |comm| {
        let (rank, world) = (comm.rank(), comm.world_size());
        let next = (rank + 1) % world;
        let prev = (rank + world - 1) % world;
        for i in 0..50u32 {
            comm.send(&[rank as u32 * 1000 + i; 3], next)?;
        }
        for i in 0..50u32 {
            let mut buf = [0u32; 3];
            comm.recv(&mut buf, prev)?;
            assert_eq!(buf, [prev as u32 * 1000 + i; 3], "message {i} from {prev}");
        }
        Ok(())
    });
}

#[test]
fn a_send_racing_a_collective_does_not_mix_with_it() {
    run_ranks(2, |comm| {
        let mut v = vec![1.0f32; 100];
        if comm.rank() == 0 {
            comm.send(&[7i64; 5], 1)?;
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        } else {
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            let mut got = [0i64; 5];
            comm.recv(&mut got, 0)?;
            assert_eq!(got, [7; 5]);
        }
        assert!(v.iter().all(|&x| x == 2.0));
        Ok(())
    });
}

#[test]
fn split_groups_work_side_by_side() {
    // 8 ranks: tensor-parallel groups of 4 (color = rank / 4) and
    // pipeline groups across them (color = rank % 4), used interleaved.
    run_ranks(8, |comm| {
        let rank = comm.rank();
        let mut tp = comm.split((rank / 4) as u32, rank as i64)?;
        let mut pp = comm.split((rank % 4) as u32, -(rank as i64))?;
        assert_eq!(tp.world_size(), 4);
        assert_eq!(tp.rank(), rank % 4);
        assert_eq!(pp.world_size(), 2);
        assert_eq!(pp.rank(), 1 - rank / 4, "key -rank reverses the order");
        // Groups of an in-process group share memory like their parent.
        assert_eq!(
            tp.algorithm_for::<f32>(OpKind::AllReduce, 1 << 20),
            "zerocopy"
        );
        oxccl::check::every_collective::<f32>(&mut tp, &[0, 3, 5000]).map_err(|e| {
            oxccl::Error::Failed {
                op: OpKind::Split,
                rank,
                first_error: e.to_string(),
            }
        })?;
        for _ in 0..3 {
            let mut a = vec![rank as i32; 10];
            tp.all_reduce_in_place(&mut a, ReduceOp::Sum)?;
            let base = (rank / 4 * 4) as i32;
            assert_eq!(a[0], 4 * base + 6);
            let mut b = vec![rank as i32; 10];
            pp.all_reduce_in_place(&mut b, ReduceOp::Max)?;
            assert_eq!(b[9], (rank % 4 + 4) as i32);
            comm.barrier()?;
        }
        let none = comm.split_or_none(if rank == 0 { None } else { Some(1) }, 0)?;
        assert_eq!(none.is_none(), rank == 0);
        if let Some(mut rest) = none {
            assert_eq!(rest.world_size(), 7);
            let mut x = [1u8];
            rest.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            assert_eq!(x[0], 7);
        }
        Ok(())
    });
}

fn invalid_arg(result: oxccl::Result<()>) -> (OpKind, &'static str) {
    match result {
        Err(Error::InvalidArgument { op, arg, .. }) => (op, arg),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn bad_input_is_returned_on_the_calling_rank_before_any_io() {
    // A world of one would also work, but with 3 ranks the other ranks must
    // not be disturbed: they go on with a correct collective afterwards.
    run_ranks(3, |comm| {
        let w = comm.world_size();
        let mut out = vec![0f32; 4];
        assert_eq!(
            invalid_arg(comm.all_reduce(&[1.0f32; 5], &mut out, ReduceOp::Sum)),
            (OpKind::AllReduce, "recv")
        );
        assert_eq!(
            invalid_arg(comm.all_gather(&[1.0f32; 2], &mut out)),
            (OpKind::AllGather, "recv")
        );
        assert_eq!(
            invalid_arg(comm.reduce_scatter(&[1.0f32; 5], &mut out[..1], ReduceOp::Sum)),
            (OpKind::ReduceScatter, "send")
        );
        assert_eq!(
            invalid_arg(comm.reduce_scatter_in_place(&mut out, ReduceOp::Sum)),
            (OpKind::ReduceScatter, "buf")
        );
        assert_eq!(
            invalid_arg(comm.all_gather_in_place(&mut out)),
            (OpKind::AllGather, "buf")
        );
        assert_eq!(
            invalid_arg(comm.reduce_scatter(&[1.0f32; 4], &mut out[..1], ReduceOp::Sum)),
            (OpKind::ReduceScatter, "send")
        );
        assert_eq!(
            invalid_arg(comm.broadcast_in_place(&mut out, w)),
            (OpKind::Broadcast, "root")
        );
        // Out of place, where a broadcast in the arena skips `run`: the
        // root's input must match its output, and off the root the ignored
        // input must be empty or of the output's length.
        let (me, other) = (comm.rank(), (comm.rank() + 1) % w);
        let short = [1.0f32; 3];
        assert_eq!(
            invalid_arg(comm.broadcast(&[1.0f32; 4], &mut out, w)),
            (OpKind::Broadcast, "root")
        );
        for root in [me, other] {
            assert_eq!(
                invalid_arg(comm.broadcast(&short, &mut out, root)),
                (OpKind::Broadcast, "send"),
                "root {root}"
            );
        }
        assert_eq!(
            invalid_arg(comm.reduce_in_place(&mut out, ReduceOp::Max, 7)),
            (OpKind::Reduce, "root")
        );
        // A reduce in the arena skips `run` too: the root's output must
        // match its input, and off the root the ignored output must be
        // empty or of the input's length.
        assert_eq!(
            invalid_arg(comm.reduce(&[1.0f32; 4], &mut out, ReduceOp::Sum, w)),
            (OpKind::Reduce, "root")
        );
        for root in [me, other] {
            assert_eq!(
                invalid_arg(comm.reduce(&[1.0f32; 4], &mut out[..3], ReduceOp::Sum, root)),
                (OpKind::Reduce, "recv"),
                "root {root}"
            );
        }
        assert_eq!(invalid_arg(comm.send(&out, w)), (OpKind::Send, "peer"));
        assert_eq!(
            invalid_arg(comm.recv(&mut out, comm.rank())),
            (OpKind::Recv, "peer")
        );
        assert_eq!(
            invalid_arg(comm.all_to_all(&[0u8; 4], &mut [0u8; 4])),
            (OpKind::AllToAll, "send")
        );
        // An f16 Avg, which scales its input a segment at a time first, is
        // refused alike and scales nothing (off the root a reduce's output
        // must be empty or the input's length).
        let (half, mut out16) = ([f16::ONE; 5], [f16::ZERO; 4]);
        assert_eq!(
            invalid_arg(comm.all_reduce(&half, &mut out16, ReduceOp::Avg)),
            (OpKind::AllReduce, "recv")
        );
        assert_eq!(
            invalid_arg(comm.reduce_scatter(&half, &mut out16[..1], ReduceOp::Avg)),
            (OpKind::ReduceScatter, "send")
        );
        assert_eq!(
            invalid_arg(comm.reduce_scatter_in_place(&mut out16, ReduceOp::Avg)),
            (OpKind::ReduceScatter, "buf")
        );
        for root in [me, other] {
            assert_eq!(
                invalid_arg(comm.reduce(&half, &mut out16, ReduceOp::Avg, root)),
                (OpKind::Reduce, "recv"),
                "root {root}"
            );
        }
        assert_eq!(
            invalid_arg(comm.reduce_in_place(&mut out16, ReduceOp::Avg, w)),
            (OpKind::Reduce, "root")
        );
        let msg = comm
            .all_reduce(&[1.0f32; 5], &mut out, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("all_reduce") && msg.contains("recv"), "{msg}");
        // Nothing moved and nothing was numbered: the next collective works.
        let mut v = vec![1u32; 9];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        assert!(v.iter().all(|&x| x == 3));
        Ok(())
    });
}

#[test]
fn a_missing_rank_times_out_naming_the_op_seq_and_peer() {
    let builder = Communicator::builder().timeout(Duration::from_millis(300));
    let err = run_ranks_with(3, builder, |comm| {
        let mut v = vec![1f32; 16];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        if comm.rank() != 2 {
            // Rank 2 skips the second collective, then waits for the others to give up.
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        } else {
            std::thread::sleep(Duration::from_millis(1500));
        }
        Ok(())
    })
    .unwrap_err();
    assert!(err.contains("all_reduce #1 timed out"), "{err}");
    assert!(err.contains("waiting for rank"), "{err}");
}

#[test]
fn a_peer_that_leaves_is_reported_as_lost_not_a_hang() {
    let builder = Communicator::builder().timeout(Duration::from_secs(30));
    let started = std::time::Instant::now();
    let err = run_ranks_with(2, builder, |comm| {
        if comm.rank() == 1 {
            return Ok(()); // drops its communicator without joining
        }
        let mut v = vec![1f32; 16];
        let result = comm.all_reduce_in_place(&mut v, ReduceOp::Sum);
        match &result {
            Err(Error::PeerLost {
                peer: 1,
                op: OpKind::AllReduce,
                seq: 0,
                ..
            }) => {}
            other => panic!("expected PeerLost from rank 1, got {other:?}"),
        }
        // The communicator is now unusable, and says so.
        let again = comm.barrier().unwrap_err();
        assert!(matches!(again, Error::Failed { .. }), "{again}");
        result
    })
    .unwrap_err();
    assert!(err.contains("peer rank 1 is gone"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "PeerLost must not wait for the timeout"
    );
}

#[test]
fn mismatched_collectives_are_detected() {
    let err = run_ranks_with(
        2,
        Communicator::builder().timeout(Duration::from_secs(5)),
        |comm| {
            let mut v = vec![1f32; 8];
            if comm.rank() == 0 {
                comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
            } else {
                comm.broadcast_in_place(&mut v, 1)
            }
        },
    )
    .unwrap_err();
    assert!(
        err.contains("mismatch") || err.contains("timed out"),
        "{err}"
    );
}

#[test]
fn abort_unblocks_a_call_in_progress() {
    let mut comms = Communicator::builder()
        .timeout(Duration::from_secs(60))
        .local_group(2)
        .unwrap();
    let mut c0 = comms.remove(0);
    let handle = c0.abort_handle();
    let waiter = std::thread::spawn(move || {
        let mut v = [0u8; 4];
        c0.all_reduce_in_place(&mut v, ReduceOp::Sum)
    });
    std::thread::sleep(Duration::from_millis(100));
    handle.abort();
    let result = waiter.join().unwrap();
    assert!(matches!(result, Err(Error::Aborted { .. })), "{result:?}");
    drop(comms);
}

/// A small broadcast goes through the root's mailbox and returns at once
/// on the root; a rank that runs another call where the root broadcast,
/// or broadcasts while the root runs another call, or disagrees on the
/// count, gets a mismatch naming the root (not a timeout).
#[test]
fn a_small_broadcast_against_another_call_is_a_mismatch() {
    type Call = fn(&mut Communicator) -> oxccl::Result<()>;
    let root_broadcasts: Call = |comm| comm.broadcast_in_place(&mut [1u8; 2], 0);
    let reader_reduces: Call = |comm| comm.all_reduce_in_place(&mut [1u8; 2], ReduceOp::Sum);
    let reader_wants_three: Call = |comm| comm.broadcast_in_place(&mut [1u8; 3], 0);
    let root_reduces: Call = |comm| comm.all_reduce_in_place(&mut [1u8; 2], ReduceOp::Sum);
    let reader_broadcasts: Call = |comm| comm.broadcast_in_place(&mut [1u8; 2], 0);
    for (root_call, reader_call) in [
        (root_broadcasts, reader_reduces),
        (root_broadcasts, reader_wants_three),
        (root_reduces, reader_broadcasts),
    ] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .algo(oxccl::Algo::Direct);
        let started = std::time::Instant::now();
        let err = run_ranks_with(2, builder, move |comm| {
            // A warm-up call, so the mismatch is not the first.
            comm.barrier()?;
            if comm.rank() == 0 {
                root_call(comm)
            } else {
                reader_call(comm)
            }
        })
        .unwrap_err();
        assert!(
            err.contains("mismatch") && err.contains("rank 0 runs a different call"),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(10), "{err}");
    }
}

/// In the shared arena, ranks that disagree on the count (or the type, the
/// operator, the root) get a mismatch naming the peer, never a misread.
#[test]
fn arena_reports_a_count_mismatch() {
    let builder = Communicator::builder()
        .timeout(Duration::from_secs(10))
        .algo(oxccl::Algo::Direct);
    let err = run_ranks_with(2, builder, |comm| {
        let mut v = vec![1.0f32; 4 + comm.rank()];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
    })
    .unwrap_err();
    assert!(
        err.contains("mismatch") && err.contains("different call"),
        "{err}"
    );
}

/// An f16 Avg runs as calls over segments of at most 1 MiB of input, and
/// ranks that disagree on its count may cut different numbers of them:
/// one segment of 524 288 elements against two of 524 288 (1 048 576 in
/// all, world 2). Every segment's signature names the whole call's count,
/// so both ranks get a mismatch at the first segment, through the arena
/// and over the ring's links, rather than one rank returning `Ok` with its
/// elements reduced against the other's second half.
#[test]
fn f16_avg_ranks_disagreeing_on_the_count_get_a_mismatch() {
    for algo in [oxccl::Algo::Auto, oxccl::Algo::Ring] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(10))
            .algo(algo);
        let started = std::time::Instant::now();
        let errors = run_ranks_with(2, builder, |comm| {
            let count = 524_288 << comm.rank();
            let mut buf = vec![f16::ONE; count];
            Ok(comm
                .all_reduce_in_place(&mut buf, ReduceOp::Avg)
                .err()
                .map(|e| e.to_string()))
        })
        .unwrap_or_else(|e| panic!("{algo:?}: {e}"));
        for (rank, error) in errors.iter().enumerate() {
            let error = error.as_deref().unwrap_or("returned Ok");
            assert!(
                error.contains("mismatch") || error.contains("different call"),
                "{algo:?} rank {rank}: {error}"
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{algo:?}: {errors:?}"
        );
    }
}

/// A small all-reduce runs in the arena's lanes, outside the slot rounds:
/// a rank in the lanes whose peer awaits a staged broadcast (slot rounds)
/// where it runs the all-reduce, and the peer, each get a mismatch naming
/// the other (not a timeout); so do two ranks whose other call is also a
/// lane call (a barrier, a small reduce-scatter, a zero-copy all-reduce,
/// which posts its buffers in one), and a rank whose peer broadcasts
/// through its mailbox as root instead.
#[test]
fn a_lane_all_reduce_against_another_call_is_a_mismatch() {
    type Call = fn(&mut Communicator) -> oxccl::Result<()>;
    let lane: Call = |comm| comm.all_reduce_in_place(&mut [1.0f32; 2], ReduceOp::Sum);
    let zero_copy: Call = |comm| comm.all_reduce_in_place(&mut vec![1.0f32; 20_000], ReduceOp::Sum);
    let small_reduce_scatter: Call = |comm| {
        let send = [1.0f32; 4];
        comm.reduce_scatter(&send, &mut [0.0f32; 2], ReduceOp::Sum)
    };
    let barrier: Call = |comm| comm.barrier();
    // 100 bytes: past the mailbox, staged through a slot round.
    let staged_broadcast: Call = |comm| comm.broadcast_in_place(&mut [1u8; 100], 0);
    let root_broadcasts: Call = |comm| comm.broadcast_in_place(&mut [1u8; 8], 1);
    let lane_call = Some("call #1 with signature");
    // (what, rank 1's call, what rank 1 must report: None if it returns)
    for (what, other, reported) in [
        ("a zero-copy all-reduce", zero_copy, lane_call),
        ("a small reduce-scatter", small_reduce_scatter, lane_call),
        ("a barrier", barrier, lane_call),
        ("a staged broadcast", staged_broadcast, Some("in the lanes")),
        ("a broadcast as root", root_broadcasts, None),
    ] {
        let builder = Communicator::builder().timeout(Duration::from_secs(30));
        let started = std::time::Instant::now();
        let errors = run_ranks_with(2, builder, move |comm| {
            // A warm-up lane call, so the mismatch is not the first.
            lane(comm)?;
            let result = if comm.rank() == 0 {
                lane(comm)
            } else {
                other(comm)
            };
            Ok(result.err().map(|e| e.to_string()))
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let lane_error = errors[0].clone().unwrap_or_default();
        assert!(
            lane_error.contains("rank 1 runs a different call"),
            "{what}: {errors:?}"
        );
        if let Some(reported) = reported {
            let other_error = errors[1].clone().unwrap_or_default();
            assert!(
                other_error.contains("rank 0 runs a different call")
                    && other_error.contains(reported),
                "{what}: {errors:?}"
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what}: {errors:?}"
        );
    }
}

/// Over the in-process links (`Algo::Ring`), a rank whose call failed is
/// named at once to the ranks still waiting on it elsewhere in the ring.
/// Rank 1 leaves without joining; rank 2, which receives from it, fails
/// and keeps its communicator; rank 0 receives from rank 2 only, and must
/// not wait out its 30 s timeout for frames rank 2 will never send. It
/// names rank 1, whose departure made rank 2 fail (the cause rank 2 gave),
/// as over the processes' links.
#[test]
fn a_failure_over_the_links_is_told_to_ranks_waiting_elsewhere() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let builder = Communicator::builder()
        .timeout(Duration::from_secs(30))
        .algo(oxccl::Algo::Ring);
    let started = std::time::Instant::now();
    let rank0_done = Arc::new(AtomicBool::new(false));
    let done = rank0_done.clone();
    let outcomes = run_ranks_with(3, builder, move |comm| {
        if comm.rank() == 1 {
            return Ok(None); // drops its communicator without joining
        }
        let mut v = vec![1f32; 4096];
        let result = comm.all_reduce_in_place(&mut v, ReduceOp::Sum);
        if comm.rank() == 0 {
            done.store(true, Ordering::SeqCst);
        } else {
            // Rank 2 holds on to its failed communicator meanwhile.
            let until = std::time::Instant::now() + Duration::from_secs(20);
            while !done.load(Ordering::SeqCst) && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(Some(result.map_err(|e| e.to_string())))
    })
    .unwrap();
    let rank0 = outcomes[0].clone().unwrap().unwrap_err();
    assert!(rank0.contains("peer rank 1 is gone"), "{rank0}");
    let rank2 = outcomes[2].clone().unwrap().unwrap_err();
    assert!(rank2.contains("peer rank 1 is gone"), "{rank2}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "rank 0 waited {:?}",
        started.elapsed()
    );
    assert!(rank0_done.load(Ordering::SeqCst));
}

/// `Duration::MAX` is how a caller says "never give up": every wait's
/// deadline is now plus the timeout, which must not overflow (it panicked
/// in `Instant + Duration`); the communicator waits `MAX_TIMEOUT`.
#[test]
fn a_timeout_of_duration_max_waits_long_instead_of_panicking() {
    let builder = Communicator::builder().timeout(Duration::MAX);
    let timeouts = run_ranks_with(3, builder, |comm| {
        if comm.rank() == 1 {
            // Late, so that the others wait (and compute a deadline).
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut small = vec![1f32; 4];
        comm.all_reduce_in_place(&mut small, ReduceOp::Sum)?;
        let mut large = vec![1f32; 1 << 16];
        comm.all_reduce_in_place(&mut large, ReduceOp::Sum)?;
        comm.barrier()?;
        assert_eq!((small[0], large[0]), (3.0, 3.0));
        Ok(comm.config().timeout)
    })
    .unwrap();
    assert!(
        timeouts.iter().all(|&t| t == oxccl::MAX_TIMEOUT),
        "{timeouts:?}"
    );
}

/// `u32::MAX` is an ordinary color (`None` is what joins no group): its
/// group forms and works.
#[test]
fn the_largest_color_is_an_ordinary_group() {
    let sums = run_ranks(3, |comm| {
        let color = if comm.rank() == 1 { 7 } else { u32::MAX };
        let mut group = comm.split(color, 0)?;
        let mut v = vec![1f32; 8];
        group.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        Ok((group.world_size(), v[0]))
    });
    assert_eq!(sums, vec![(2, 2.0), (1, 1.0), (2, 2.0)]);
}

/// A rank whose zero-copy call fails after it posted its buffers (here
/// rank 2 comes after the others' timeout) gets them back untouched: a
/// late peer that finds the post afterwards must not read or write them
/// once the call returned, since the caller may free or reuse them.
#[test]
fn buffers_of_a_failed_zero_copy_call_are_not_touched_after_it_returns() {
    let n = 1 << 20;
    let all_done = std::sync::Arc::new(std::sync::Barrier::new(3));
    let builder = Communicator::builder().timeout(Duration::from_millis(300));
    let result = run_ranks_with(3, builder, move |comm| {
        let rank = comm.rank();
        let mut v = vec![rank as f32 + 1.0; n];
        if rank == 2 {
            std::thread::sleep(Duration::from_millis(900));
        }
        let outcome = comm.all_reduce_in_place(&mut v, ReduceOp::Sum);
        let after_return = v.clone();
        all_done.wait();
        if rank < 2 && outcome.is_ok() {
            return Ok(format!("rank {rank} finished without rank 2"));
        }
        if rank == 2 && outcome.is_ok() {
            return Ok("rank 2 ran the call on buffers returned to their owners".into());
        }
        // Rank 2 is done too (the barrier): nobody may have written since.
        Ok(if v == after_return {
            String::new()
        } else {
            format!("rank {rank}'s buffer changed after its call returned")
        })
    })
    .unwrap();
    let complaints: Vec<_> = result.into_iter().filter(|r| !r.is_empty()).collect();
    assert!(complaints.is_empty(), "{complaints:?}");
}

/// After `abort()`, a call whose peers have all posted already (nothing to
/// wait for) still returns an error rather than completing.
#[test]
fn a_call_after_abort_fails_even_when_nothing_waits() {
    let aborted = std::sync::Arc::new(std::sync::Barrier::new(2));
    let result = run_ranks_with(2, Communicator::builder(), move |comm| {
        if comm.rank() == 0 {
            comm.abort_handle().abort();
        }
        aborted.wait();
        let mut outcomes = Vec::new();
        for len in [2, 16 << 10, 1 << 20] {
            let mut v = vec![1.0f32; len];
            outcomes.push(comm.all_reduce_in_place(&mut v, ReduceOp::Sum).is_err());
        }
        let mut v = vec![1.0f32; 64];
        outcomes.push(comm.broadcast_in_place(&mut v, 0).is_err());
        Ok(outcomes)
    })
    .unwrap();
    for (rank, outcomes) in result.iter().enumerate() {
        assert!(outcomes.iter().all(|&e| e), "rank {rank}: {outcomes:?}");
    }
}

/// Ranks that disagree on a staged broadcast's root all return from it
/// (each "root" only posts), and the disagreement is found when a later
/// call compares the recent rounds. Zero-copy calls (here 4 KiB
/// all-reduces between threads) did not compare them, so while only they
/// followed, every rank went on with `Ok` and rank 1 kept its own data.
#[test]
fn a_root_disagreement_is_reported_by_the_zero_copy_calls_after_it() {
    let result = run_ranks_with(3, Communicator::builder(), |comm| {
        let root = if comm.rank() == 1 { 1 } else { 0 };
        let mut data = vec![comm.rank() as u8; 1024];
        let mut refused = matches!(
            comm.broadcast_in_place(&mut data, root),
            Err(Error::Mismatch { .. })
        );
        for _ in 0..100 {
            let mut v = vec![1.0f32; 1024];
            match comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
                Err(Error::Mismatch { .. }) => refused = true,
                Err(_) => break,
                Ok(()) => {}
            }
        }
        Ok(refused)
    })
    .unwrap();
    assert!(result.iter().any(|&r| r), "{result:?}");
}

/// `alloc_shared` after `abort()` fails as every other call does, then the
/// communicator reports the abort: a group of one (no arena) and two
/// threads (the arena's agreement, which the last rank in passed without
/// looking at the flag) both handed out buffers.
#[test]
fn alloc_shared_after_abort_fails() {
    let mut solo = Communicator::local_group(1).unwrap().remove(0);
    solo.abort();
    assert!(matches!(
        solo.alloc_shared::<f32>(4),
        Err(Error::Aborted {
            op: OpKind::AllocShared,
            ..
        })
    ));
    assert!(matches!(solo.barrier(), Err(Error::Failed { .. })));

    let aborted = std::sync::Arc::new(std::sync::Barrier::new(2));
    let result = run_ranks_with(2, Communicator::builder(), move |comm| {
        if comm.rank() == 0 {
            comm.abort_handle().abort();
        }
        aborted.wait();
        Ok(comm.alloc_shared::<f32>(1024).is_err())
    })
    .unwrap();
    assert_eq!(result, vec![true, true]);
}

/// An allocation the system refuses is an error on every rank, not an
/// abort of the process, and the communicator goes on working.
#[test]
fn an_alloc_shared_too_large_for_the_system_is_an_error() {
    let result = run_ranks_with(2, Communicator::builder(), |comm| {
        let refused = matches!(
            comm.alloc_shared::<u8>(1 << 46),
            Err(Error::Bootstrap { .. })
        );
        let mut v = vec![1u32; 4096];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        Ok(refused && v.iter().all(|&x| x == 2))
    })
    .unwrap();
    assert_eq!(result, vec![true, true]);
}

/// A staged broadcast (here 1 KiB between threads) whose ranks disagree on
/// the root, where each only posts and nobody reads the other's header, is
/// found a few rounds later as a `Mismatch` naming the call, not left to
/// return `Ok` with every rank's own data.
#[test]
fn a_staged_broadcast_with_disagreeing_roots_is_found() {
    let result = run_ranks_with(2, Communicator::builder(), |comm| {
        let mut v = vec![1.0f32; 256];
        // Late in a communicator's life, and (below) its very first call.
        for _ in 0..8 {
            comm.broadcast_in_place(&mut v, 0)?;
        }
        let root = comm.rank();
        let mut outcome = comm.broadcast_in_place(&mut v, root);
        for _ in 0..8 {
            outcome = outcome.and_then(|()| comm.broadcast_in_place(&mut v, 0));
        }
        Ok(match outcome {
            Err(Error::Mismatch { detail, .. }) => detail.contains("different root"),
            Err(Error::PeerLost { .. }) => true,
            _ => false,
        })
    })
    .unwrap();
    assert_eq!(result, vec![true, true]);
}

/// The first staged call of a communicator with disagreeing roots is found
/// too, in the rounds that follow it.
#[test]
fn a_first_staged_broadcast_with_disagreeing_roots_is_found() {
    let result = run_ranks_with(2, Communicator::builder(), |comm| {
        let mut v = vec![1.0f32; 256];
        let root = comm.rank();
        let mut outcome = comm.broadcast_in_place(&mut v, root);
        for _ in 0..8 {
            outcome = outcome.and_then(|()| comm.broadcast_in_place(&mut v, 0));
        }
        Ok(matches!(
            outcome,
            Err(Error::Mismatch { .. }) | Err(Error::PeerLost { .. })
        ))
    })
    .unwrap();
    assert_eq!(result, vec![true, true]);
}

/// A communicator whose only staged call is its first, a broadcast with
/// disagreeing roots, followed only by lane calls (8-byte all-reduces, no
/// staged round after it to compare in), finds it at the first lane call:
/// every peer has posted its staged rounds by the time its lane post is
/// seen.
#[test]
fn disagreeing_roots_followed_only_by_lane_calls_are_found() {
    let result = run_ranks_with(2, Communicator::builder(), |comm| {
        let mut v = vec![1.0f32; 256];
        let root = comm.rank();
        let broadcast = comm.broadcast_in_place(&mut v, root);
        let mut x = [1.0f32, 2.0];
        let first_lane_call =
            broadcast.and_then(|()| comm.all_reduce_in_place(&mut x, ReduceOp::Sum));
        Ok(match first_lane_call {
            Err(Error::Mismatch { detail, .. }) => detail.contains("different root"),
            _ => false,
        })
    })
    .unwrap();
    assert_eq!(result, vec![true, true]);
}

/// The same when the call after the staged broadcast is a barrier.
#[test]
fn disagreeing_roots_followed_by_a_barrier_are_found() {
    let result = run_ranks_with(2, Communicator::builder(), |comm| {
        let mut v = vec![1.0f32; 256];
        let root = comm.rank();
        let outcome = comm
            .broadcast_in_place(&mut v, root)
            .and_then(|()| comm.barrier());
        Ok(match outcome {
            Err(Error::Mismatch { detail, .. }) => detail.contains("different root"),
            _ => false,
        })
    })
    .unwrap();
    assert_eq!(result, vec![true, true]);
}

/// The same when the calls after the staged broadcast are mailbox
/// broadcasts (8 bytes), whose root waits for nobody: a rank that receives
/// finds the disagreement (the root had posted its staged round), and the
/// communicator fails on that rank at once and on the other at its next
/// wait at the latest.
#[test]
fn disagreeing_roots_followed_by_mailbox_broadcasts_are_found() {
    let result = run_ranks_with(2, Communicator::builder(), |comm| {
        let mut v = vec![1.0f32; 256];
        let root = comm.rank();
        let mut outcome = comm.broadcast_in_place(&mut v, root);
        let mut small = [1.0f32, 2.0];
        for _ in 0..4 {
            outcome = outcome.and_then(|()| comm.broadcast_in_place(&mut small, 0));
        }
        let found_here = matches!(&outcome, Err(Error::Mismatch { detail, .. }) if detail.contains("different root"));
        let later = outcome.is_err() || comm.barrier().is_err();
        Ok((found_here, later))
    })
    .unwrap();
    // Rank 1 receives from rank 0, which had posted its staged round.
    assert!(result[1].0, "{result:?}");
    assert!(result.iter().all(|&(_, later)| later), "{result:?}");
}

/// The same through the mailboxes (8-byte broadcasts): of two ranks that
/// each took themselves for the root, at least one learns of the other's
/// message in that very call (each stores its own, then looks at the
/// other's), and the other at its next wait at the latest.
#[test]
fn a_mailbox_broadcast_with_disagreeing_roots_is_found() {
    let result = run_ranks_with(2, Communicator::builder(), |comm| {
        let mut v = [1.0f32, 2.0];
        for _ in 0..4 {
            comm.broadcast_in_place(&mut v, 0)?;
        }
        let root = comm.rank();
        let this_call = comm.broadcast_in_place(&mut v, root);
        let later = this_call
            .as_ref()
            .map_err(|_| ())
            .map(|()| comm.barrier().is_err());
        Ok((this_call.is_err(), later.unwrap_or(true)))
    })
    .unwrap();
    assert!(result.iter().any(|&(now, _)| now), "{result:?}");
    assert!(
        result.iter().all(|&(now, later)| now || later),
        "{result:?}"
    );
}

/// A message of no elements is still a message: it is matched against the
/// receive it meets, like any other. A 3-element send against an empty
/// receive (or the other way round) is a `Mismatch` on the receiver at
/// once, not an `Ok` that leaves the elements behind (nor a timeout), and
/// empty messages that agree pass and keep the pairs' order.
#[test]
fn an_empty_message_is_matched_like_any_other() {
    let transports: [Option<oxccl::TransportKind>; 3] = [
        None,
        Some(oxccl::TransportKind::Tcp),
        Some(oxccl::TransportKind::Shm),
    ];
    for transport in transports {
        for empty_sender in [true, false] {
            let builder = Communicator::builder().timeout(Duration::from_secs(10));
            let body = move |comm: &mut Communicator| {
                let start = std::time::Instant::now();
                let outcome = if comm.rank() == 0 {
                    let data: &[u32] = if empty_sender { &[] } else { &[1, 2, 3] };
                    comm.send(data, 1)
                } else {
                    let mut buf = vec![0u32; if empty_sender { 3 } else { 0 }];
                    comm.recv(&mut buf, 0)
                };
                Ok((
                    matches!(outcome, Err(Error::Mismatch { .. })),
                    outcome.is_ok(),
                    start.elapsed(),
                ))
            };
            let results = match transport {
                None => run_ranks_with(2, builder, body),
                Some(kind) => common::run_ranks_net(2, builder, kind, body),
            }
            .unwrap();
            let (mismatch, _, waited) = results[1];
            assert!(
                mismatch && waited < Duration::from_secs(5),
                "{transport:?}, empty sender {empty_sender}: receiver {results:?}"
            );
            assert!(results[0].1, "{transport:?}: the sender's call is fine");
        }
        // Empty messages that agree: delivered in order between others.
        let builder = Communicator::builder().timeout(Duration::from_secs(10));
        let body = |comm: &mut Communicator| {
            if comm.rank() == 0 {
                comm.send::<u32>(&[], 1)?;
                comm.send(&[5u32, 6], 1)?;
                comm.send::<u32>(&[], 1)?;
            } else {
                comm.recv::<u32>(&mut [], 0)?;
                let mut got = [0u32; 2];
                comm.recv(&mut got, 0)?;
                assert_eq!(got, [5, 6]);
                comm.recv::<u32>(&mut [], 0)?;
            }
            Ok(())
        };
        match transport {
            None => run_ranks_with(2, builder, body),
            Some(kind) => common::run_ranks_net(2, builder, kind, body),
        }
        .unwrap();
    }
}

/// After an abort, a call that moves nothing over the links (no elements,
/// or a group of one) fails as every other call does: `Aborted` first,
/// then `Failed` naming it, never `Ok`.
#[test]
fn a_call_that_moves_nothing_fails_after_abort() {
    let mut solo = Communicator::builder().local_group(1).unwrap().remove(0);
    solo.abort();
    let first = solo.all_reduce_in_place(&mut [1.0f32], ReduceOp::Sum);
    assert!(matches!(first, Err(Error::Aborted { .. })), "{first:?}");
    let next = solo.barrier();
    assert!(matches!(next, Err(Error::Failed { .. })), "{next:?}");

    let aborted = std::sync::Arc::new(std::sync::Barrier::new(2));
    let builder = Communicator::builder().algo(oxccl::Algo::Ring);
    let outcomes = run_ranks_with(2, builder, move |comm| {
        if comm.rank() == 0 {
            comm.abort();
        }
        aborted.wait();
        let empty = comm.all_reduce_in_place::<f32>(&mut [], ReduceOp::Sum);
        Ok(matches!(empty, Err(Error::Aborted { .. })))
    })
    .unwrap();
    assert_eq!(outcomes, [true, true]);
}

/// A device group larger than a job is refused before any device is
/// looked at (the cuda-ring group sizes an n × n table of paths).
#[cfg(feature = "cuda")]
#[test]
fn a_device_group_larger_than_a_job_is_refused() {
    match oxccl::DeviceCommunicator::builder().local_group(100_000) {
        Err(Error::InvalidArgument { arg, reason, .. }) => {
            assert_eq!(arg, "world_size");
            assert!(reason.contains("100000 ranks"), "{reason}");
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("a group of 100000 ranks was made"),
    }
}

/// A job of one rank takes no port: two such jobs on a node (`srun -n1`
/// sweeps) collided on MASTER_PORT, the second failing with "port in use"
/// though it meets nobody. Here the port is held by someone else.
#[test]
fn a_job_of_one_rank_needs_no_free_port() {
    let holder = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = holder.local_addr().unwrap().port().to_string();
    let env = oxccl::bootstrap::LaunchEnv::from_vars(|name| match name {
        "RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("1".into()),
        "MASTER_PORT" => Some(port.clone()),
        _ => None,
    })
    .unwrap();
    let mut comm = Communicator::builder().from_launch_env(&env).unwrap();
    let mut v = vec![3.0f32; 16];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v, vec![3.0; 16]);
}

/// A process that drops its communicator and makes the next one from the
/// same rendezvous may reach the previous job's store while that job's
/// rank 0 is still dropping its own: the rank connects again until the
/// new store is up. It was refused, told that a communicator it made from
/// the same rendezvous "is still alive". Ranks are threads here, each
/// with its own launch variables; rank 0 drops 400 ms after rank 1.
#[test]
fn a_communicator_made_again_waits_out_the_previous_store() {
    // Below the ephemeral range: a port the kernel handed out and took
    // back could go to another test's peer listener on 127.0.0.1.
    let port = common::free_port().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let port = port.clone();
            std::thread::spawn(move || -> Result<f32, String> {
                let env = oxccl::bootstrap::LaunchEnv::from_vars(|name| match name {
                    "RANK" => Some(rank.to_string()),
                    "WORLD_SIZE" => Some("2".into()),
                    "MASTER_ADDR" => Some("127.0.0.1".into()),
                    "MASTER_PORT" => Some(port.clone()),
                    "OXCCL_TRANSPORT" => Some("tcp".into()),
                    _ => None,
                })
                .map_err(|e| e.to_string())?;
                let builder = Communicator::builder()
                    .timeout(Duration::from_secs(10))
                    .transport(oxccl::TransportKind::Tcp);
                let mut total = 0.0;
                for round in 0..2 {
                    let mut comm = builder.from_launch_env(&env).map_err(|e| e.to_string())?;
                    let mut v = vec![1.0f32; 8];
                    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
                        .map_err(|e| e.to_string())?;
                    total += v[0];
                    if rank == 0 && round == 0 {
                        std::thread::sleep(Duration::from_millis(400));
                    }
                }
                Ok(total)
            })
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        assert_eq!(handle.join().unwrap(), Ok(4.0), "rank {rank}");
    }
}

/// Runs `body` on `n` ranks of the in-process transport (`None`) or of the
/// multi-process one over `kind`, as threads.
fn run_on<R, F>(
    transport: Option<oxccl::TransportKind>,
    n: usize,
    body: F,
) -> std::result::Result<Vec<R>, String>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> oxccl::Result<R> + Send + Sync + 'static,
{
    let builder = Communicator::builder().timeout(Duration::from_secs(30));
    match transport {
        None => run_ranks_with(n, builder, body),
        Some(kind) => common::run_ranks_net(n, builder, kind, body),
    }
}

const EVERY_TRANSPORT: [Option<oxccl::TransportKind>; 3] = [
    None,
    Some(oxccl::TransportKind::Tcp),
    Some(oxccl::TransportKind::Shm),
];

/// What rank `rank` sends in round `round` of the exchange tests.
fn message(rank: usize, round: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (rank as u32) << 24 ^ round << 20 ^ i)
        .collect()
}

/// `send_recv` around a ring of three, out of place and in place, from an
/// empty message to one of many pipeline pieces (12 MiB, past what a
/// receiver reads ahead); with the same peer both ways (two ranks); and
/// each half meeting a lone `recv` or `send` of the peer, in the pair's
/// order among the peer's other messages.
#[test]
fn send_recv_exchanges_and_each_half_meets_a_lone_call() {
    for transport in EVERY_TRANSPORT {
        run_on(transport, 3, |comm| {
            let (rank, world) = (comm.rank(), comm.world_size());
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            for (round, len) in [0, 3, 70_000, 3 << 20].into_iter().enumerate() {
                let round = round as u32;
                let mine = message(rank, round, len);
                let expected = message(prev, round, len);
                let mut theirs = vec![0u32; len];
                comm.send_recv(&mine, next, &mut theirs, prev)?;
                assert!(theirs == expected, "out of place, {len} elements");
                let mut buf = mine.clone();
                comm.send_recv_in_place(&mut buf, next, prev)?;
                assert!(buf == expected, "in place, {len} elements");
                // Rank 0 sends and receives alone, around a lone send of
                // an extra word to its next rank; the others exchange.
                theirs.fill(0);
                if rank == 0 {
                    comm.send(&mine, next)?;
                    comm.send(&[round], next)?;
                    comm.recv(&mut theirs, prev)?;
                } else {
                    comm.send_recv(&mine, next, &mut theirs, prev)?;
                    if rank == 1 {
                        let mut word = [u32::MAX];
                        comm.recv(&mut word, 0)?;
                        assert_eq!(word, [round]);
                    }
                }
                assert!(theirs == expected, "beside lone calls, {len} elements");
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
        // Two ranks: the peer is both the destination and the source, and
        // it may exchange too, receive its whole message before sending,
        // or send before receiving (messages of many pieces).
        run_on(transport, 2, |comm| {
            let (rank, peer) = (comm.rank(), 1 - comm.rank());
            let len = 1 << 20;
            let mut buf = message(rank, 9, len);
            comm.send_recv_in_place(&mut buf, peer, peer)?;
            assert!(buf == message(peer, 9, len), "swapped in place");
            for (round, peer_receives_first) in [(10, true), (11, false)] {
                let mine = message(rank, round, len);
                let mut theirs = vec![0u32; len];
                if rank == 0 {
                    comm.send_recv(&mine, peer, &mut theirs, peer)?;
                } else if peer_receives_first {
                    comm.recv(&mut theirs, peer)?;
                    comm.send(&mine, peer)?;
                } else {
                    comm.send(&mine, peer)?;
                    comm.recv(&mut theirs, peer)?;
                }
                let order = if peer_receives_first {
                    "recv, send"
                } else {
                    "send, recv"
                };
                assert!(theirs == message(peer, round, len), "against {order}");
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{transport:?}, two ranks: {e}"));
    }
}

/// Bad peers are refused before anything moves, naming the half; a
/// message of another length is a `Mismatch` on its receiver, as for a
/// lone `recv`.
#[test]
fn send_recv_refuses_bad_peers_and_reports_a_mismatch() {
    run_ranks(3, |comm| {
        let (rank, w) = (comm.rank(), comm.world_size());
        let next = (rank + 1) % w;
        let mut out = [0u32; 4];
        assert_eq!(
            invalid_arg(comm.send_recv(&[1u32; 4], w, &mut out, next)),
            (OpKind::Send, "peer")
        );
        assert_eq!(
            invalid_arg(comm.send_recv(&[1u32; 4], next, &mut out, rank)),
            (OpKind::Recv, "peer")
        );
        assert_eq!(
            invalid_arg(comm.send_recv_in_place(&mut out, rank, next)),
            (OpKind::Send, "peer")
        );
        // Nothing was numbered (neither half, to or from either
        // neighbour): exchanges both ways round the ring still match.
        let prev = (rank + w - 1) % w;
        comm.send_recv(&[rank as u32; 4], next, &mut out, prev)?;
        assert_eq!(out, [prev as u32; 4]);
        comm.send_recv(&[rank as u32 + 10; 4], prev, &mut out, next)?;
        assert_eq!(out, [next as u32 + 10; 4]);
        Ok(())
    });
    every_rank_finds_its_receive_mismatched(|comm| {
        let peer = 1 - comm.rank();
        // Each sends 5 elements and expects 4.
        let mut recv = [0u32; 4];
        comm.send_recv(&[7u32; 5], peer, &mut recv, peer)
    });
}

/// Runs `exchange` on two ranks over every transport and checks that it
/// fails on both with a `Mismatch` of its receive.
fn every_rank_finds_its_receive_mismatched<F>(exchange: F)
where
    F: Fn(&mut Communicator) -> oxccl::Result<()> + Send + Sync + Copy + 'static,
{
    for transport in EVERY_TRANSPORT {
        let outcomes = run_on(transport, 2, move |comm| Ok(exchange(comm)))
            .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
        for (rank, outcome) in outcomes.iter().enumerate() {
            assert!(
                matches!(
                    outcome,
                    Err(Error::Mismatch {
                        op: OpKind::Recv,
                        ..
                    })
                ),
                "{transport:?}, rank {rank}: {outcome:?}"
            );
        }
    }
}

/// A peer that never answers an exchange: the receive half times out,
/// naming the call (`recv`, its number on this pair) and the silent peer,
/// and the communicator refuses later calls with that first error.
#[test]
fn a_send_recv_whose_peer_never_answers_times_out_naming_the_receive() {
    for transport in EVERY_TRANSPORT {
        let builder = Communicator::builder().timeout(Duration::from_millis(300));
        let body = |comm: &mut Communicator| {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1200));
                return Ok(None);
            }
            // A word sent to the peer first: the exchange's send half is
            // send #1, its receive half recv #0 (numbered per direction).
            comm.send(&[1u32], 1)?;
            let outcome = comm.send_recv(&vec![1.5f32; 1 << 20], 1, &mut vec![0f32; 1 << 20], 1);
            let later = comm.barrier();
            Ok(Some((outcome, later)))
        };
        let results = match transport {
            None => run_ranks_with(2, builder, body),
            Some(kind) => common::run_ranks_net(2, builder, kind, body),
        }
        .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
        let (outcome, later) = results[0].as_ref().expect("rank 0 reports");
        match outcome {
            Err(Error::Timeout {
                op,
                seq,
                rank,
                peer,
                ..
            }) => {
                assert_eq!(
                    (*op, *seq, *rank, *peer),
                    (OpKind::Recv, 0, 0, 1),
                    "{transport:?}"
                )
            }
            other => panic!("{transport:?}: expected a receive timeout, got {other:?}"),
        }
        assert!(
            matches!(later, Err(Error::Failed { .. })),
            "{transport:?}: {later:?}"
        );
    }
}

/// Messages of up to 4 KiB between ranks of one host go through the
/// arena's pair lanes, larger ones and those sent while the lane is full
/// over the links: whichever way each went, a pair's messages arrive in
/// the order sent, also when each rank sends many before receiving any,
/// and an exchange's halves may go different ways.
#[test]
fn small_messages_keep_their_order_whichever_way_they_go() {
    // In elements of u32: empty, small, the lane's largest (4 KiB), one
    // element past it, and a message of several pipeline pieces.
    let lengths = [
        0, 1, 3, 1024, 1025, 2, 70_000, 4, 5, 1024, 6, 7, 8, 9, 10, 11,
    ];
    for transport in EVERY_TRANSPORT {
        run_on(transport, 2, move |comm| {
            let (rank, peer) = (comm.rank(), 1 - comm.rank());
            // One way: rank 0 sends them all before rank 1 receives any,
            // so the lane fills and later small ones take the links.
            if rank == 0 {
                for (round, &len) in lengths.iter().enumerate() {
                    comm.send(&message(rank, round as u32, len), peer)?;
                }
            }
            comm.barrier()?;
            if rank == 1 {
                for (round, &len) in lengths.iter().enumerate() {
                    let mut got = vec![u32::MAX; len];
                    comm.recv(&mut got, peer)?;
                    assert!(got == message(peer, round as u32, len), "one way, #{round}");
                }
            }
            // Both ways at once, each rank sending everything first.
            for (round, &len) in lengths.iter().enumerate() {
                comm.send(&message(rank, 100 + round as u32, len), peer)?;
            }
            for (round, &len) in lengths.iter().enumerate() {
                let mut got = vec![u32::MAX; len];
                comm.recv(&mut got, peer)?;
                assert!(
                    got == message(peer, 100 + round as u32, len),
                    "both ways, #{round}"
                );
            }
            // A lane that filled and then drained part-way: rank 0 sends
            // six (four into the lane, two over the links), rank 1 takes
            // one, rank 0 sends two more (into the lane, behind newer
            // numbers than the two on the links), rank 1 takes the rest.
            let round = |i: usize| 400 + i as u32;
            if rank == 0 {
                for i in 0..6 {
                    comm.send(&message(rank, round(i), 2), peer)?;
                }
            }
            comm.barrier()?;
            let mut got = [0u32; 2];
            if rank == 1 {
                comm.recv(&mut got, peer)?;
                assert!(got[..] == message(peer, round(0), 2), "drained, #0");
            }
            comm.barrier()?;
            if rank == 0 {
                for i in 6..8 {
                    comm.send(&message(rank, round(i), 2), peer)?;
                }
            } else {
                for i in 1..8 {
                    comm.recv(&mut got, peer)?;
                    assert!(got[..] == message(peer, round(i), 2), "drained, #{i}");
                }
            }
            // Exchanges whose halves differ in size: rank 0 sends small
            // and receives large, rank 1 the reverse, then in place.
            for (round, (small, large)) in [(3, 70_000), (1024, 1025), (0, 1200)]
                .into_iter()
                .enumerate()
            {
                let round = 200 + round as u32;
                let (mine, theirs) = if rank == 0 {
                    (small, large)
                } else {
                    (large, small)
                };
                let mut got = vec![u32::MAX; theirs];
                comm.send_recv(&message(rank, round, mine), peer, &mut got, peer)?;
                assert!(
                    got == message(peer, round, theirs),
                    "exchange {small}/{large}"
                );
            }
            for len in [1, 1024, 1025] {
                let mut buf = message(rank, 300, len);
                comm.send_recv_in_place(&mut buf, peer, peer)?;
                assert!(buf == message(peer, 300, len), "in place, {len}");
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
    }
}

/// A rank that sends more small messages than its lane holds and then
/// drops its communicator: its peer still receives every one, from the
/// lane and then from the links; split groups have lanes of their own.
#[test]
fn messages_outlive_a_sender_that_left_and_split_groups_have_their_own_lanes() {
    for transport in EVERY_TRANSPORT {
        run_on(transport, 2, |comm| {
            if comm.rank() == 0 {
                for round in 0..10 {
                    comm.send(&message(0, round, 3), 1)?;
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
            for round in 0..10 {
                let mut got = [0u32; 3];
                comm.recv(&mut got, 0)?;
                assert!(
                    got[..] == message(0, round, 3),
                    "#{round} after the sender left"
                );
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
        run_on(transport, 4, |comm| {
            let rank = comm.rank();
            let mut pair = comm.split((rank / 2) as u32, rank as i64)?;
            let peer = 1 - pair.rank();
            for round in 0..6 {
                // The pair and the parent interleave small exchanges: each
                // communicator numbers its own messages.
                let mut got = vec![0u32; 5];
                pair.send_recv(&message(rank, round, 5), peer, &mut got, peer)?;
                assert!(got == message(rank ^ 1, round, 5), "in the pair, {round}");
                let (next, prev) = ((rank + 1) % 4, (rank + 3) % 4);
                comm.send_recv(&message(rank, 50 + round, 5), next, &mut got, prev)?;
                assert!(
                    got == message(prev, 50 + round, 5),
                    "in the parent, {round}"
                );
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{transport:?}, split: {e}"));
    }
}

/// A send that lends its buffer (the receive copies straight out of it)
/// is done with it when it returns: the sender overwrites the buffer at
/// once, while its receiver is copying the last message out of it (each
/// round, both ways) or before the receiver has started (between threads:
/// a burst received after a barrier; across processes sends this large
/// wait for their receiver), and every message arrives as it was sent.
/// Messages of one pipeline piece (a lender with nothing else to take
/// back reaches the end of its call while its receiver copies, and must
/// wait for that copy) and of several, out of place and in place.
#[test]
fn a_lent_buffer_may_change_as_soon_as_its_send_returns() {
    const LEN: usize = 300_000;
    for transport in EVERY_TRANSPORT {
        let in_process = transport.is_none();
        run_on(transport, 2, move |comm| {
            let (rank, peer) = (comm.rank(), 1 - comm.rank());
            let mut buf = vec![0u32; LEN];
            let mut got = vec![0u32; LEN];
            let fill = |buf: &mut [u32], rank: usize, round: u32| {
                buf.iter_mut()
                    .for_each(|x| *x = (rank as u32) << 24 ^ round);
            };
            for round in 0..100 {
                // 200 KiB: one piece.
                let len = if round % 2 == 0 { 50_000 } else { LEN };
                let (buf, got) = (&mut buf[..len], &mut got[..len]);
                fill(buf, rank, round);
                if rank == 0 {
                    comm.send(buf, peer)?;
                    buf.fill(u32::MAX);
                    comm.recv(got, peer)?;
                } else {
                    comm.recv(got, peer)?;
                    comm.send(buf, peer)?;
                    buf.fill(u32::MAX);
                }
                assert!(
                    got.iter().all(|&x| x == (peer as u32) << 24 ^ round),
                    "round {round}, rank {rank}"
                );
                fill(buf, rank, 100 + round);
                comm.send_recv(buf, peer, got, peer)?;
                buf.fill(u32::MAX);
                assert!(
                    got.iter()
                        .all(|&x| x == (peer as u32) << 24 ^ (100 + round)),
                    "exchange {round}, rank {rank}"
                );
                fill(buf, rank, 200 + round);
                comm.send_recv_in_place(buf, peer, peer)?;
                assert!(
                    buf.iter()
                        .all(|&x| x == (peer as u32) << 24 ^ (200 + round)),
                    "in place {round}, rank {rank}"
                );
            }
            if !in_process {
                return Ok(());
            }
            if rank == 0 {
                for round in 0..4 {
                    fill(&mut buf, rank, 300 + round);
                    comm.send(&buf, peer)?;
                }
                buf.fill(u32::MAX);
            }
            comm.barrier()?;
            if rank == 1 {
                for round in 0..4 {
                    comm.recv(&mut got, peer)?;
                    assert!(got.iter().all(|&x| x == 300 + round), "burst {round}");
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
    }
}

/// A message sent small (through a pair lane) to a receive too large for
/// the lane, or sent large (over the links) to a small receive, is a
/// length `Mismatch` on the receiver, whether it was there before the
/// receive or came while it waited; never a timeout, nor a wait until
/// the deadline (20 s here): the sender stays, in a barrier that the
/// receiver's failure ends. (TCP has no arena, so no lanes: there both
/// sizes go over the links, and their headers differ.)
#[test]
fn a_length_mismatch_across_the_lane_size_is_reported_as_one() {
    for transport in EVERY_TRANSPORT {
        for (sent, expected) in [(2usize, 2048usize), (2048, 2)] {
            for receiver_waits_first in [false, true] {
                let builder = Communicator::builder().timeout(Duration::from_secs(20));
                let body = move |comm: &mut Communicator| {
                    if comm.rank() == 0 {
                        if receiver_waits_first {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        comm.send(&vec![7u32; sent], 1)?;
                        if !receiver_waits_first {
                            comm.barrier()?;
                        }
                        // Fails once the receiver has.
                        let _ = comm.barrier();
                        return Ok(None);
                    }
                    if !receiver_waits_first {
                        comm.barrier()?;
                    }
                    let mut got = vec![0u32; expected];
                    let started = std::time::Instant::now();
                    let outcome = comm.recv(&mut got, 0);
                    Ok(Some((outcome, started.elapsed())))
                };
                let results = match transport {
                    None => run_ranks_with(2, builder, body),
                    Some(kind) => common::run_ranks_net(2, builder, kind, body),
                }
                .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
                let (outcome, waited) = results[1].as_ref().expect("rank 1 reports");
                assert!(
                    *waited < Duration::from_secs(10),
                    "{transport:?}, {sent} elements sent, {expected} expected: the mismatch \
                     came after {waited:?}"
                );
                assert!(
                    matches!(
                        outcome,
                        Err(Error::Mismatch {
                            op: OpKind::Recv,
                            seq: 0,
                            rank: 1,
                            peer: 0,
                            ..
                        })
                    ),
                    "{transport:?}, {sent} elements sent, {expected} expected, receiver \
                     first: {receiver_waits_first}: {outcome:?}"
                );
            }
        }
    }
}

/// Equal byte counts of different element types are a `Mismatch` through
/// a pair lane too (the message carries its call's digest), on both halves
/// of an exchange.
#[test]
fn a_lane_message_of_another_type_is_a_mismatch() {
    every_rank_finds_its_receive_mismatched(|comm| {
        let peer = 1 - comm.rank();
        if comm.rank() == 0 {
            comm.send_recv(&[1u32, 2], peer, &mut [0u32; 2], peer)
        } else {
            comm.send_recv(&[1f32, 2.0], peer, &mut [0f32; 2], peer)
        }
    });
}

/// A point-to-point receive fails with its peer, not with any rank of the
/// group, as over the links: rank 2 fails at once (a length mismatch),
/// while rank 1 still receives what rank 0 sends it afterwards, small
/// (through a pair lane) and large (over the links, or the in-process
/// mailboxes).
#[test]
fn a_receive_does_not_fail_with_a_third_rank() {
    for transport in EVERY_TRANSPORT {
        let outcomes = run_on(transport, 3, |comm| match comm.rank() {
            0 => {
                comm.send(&[1u32], 2)?;
                std::thread::sleep(Duration::from_millis(100));
                comm.send(&[7u32, 8], 1)?;
                // Rank 1 waits for this one, rank 2 long failed.
                std::thread::sleep(Duration::from_millis(50));
                comm.send(&message(0, 1, 100_000), 1)?;
                Ok(true)
            }
            1 => {
                let mut got = [0u32; 2];
                comm.recv(&mut got, 0)?;
                let mut large = vec![0u32; 100_000];
                comm.recv(&mut large, 0)?;
                Ok(got == [7, 8] && large == message(0, 1, 100_000))
            }
            _ => {
                let mut got = [0u32; 2];
                Ok(matches!(
                    comm.recv(&mut got, 0),
                    Err(Error::Mismatch { .. })
                ))
            }
        })
        .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
        assert_eq!(outcomes, [true, true, true], "{transport:?}");
    }
}
