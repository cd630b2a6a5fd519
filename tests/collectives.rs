//! Every collective over world sizes {1,2,3,4,5,8}, counts {0, 1, N-1, N+1,
//! 10_007}, in place and out of place, a tiny and the default chunk size,
//! every dtype and op, against closed-form expectations
//! (`oxccl::check::every_collective`, shared with `oxccl-check` and the
//! multi-process tests).

mod common;

use std::time::Duration;

use common::{run_ranks, run_ranks_with};
use oxccl::check::{edge_counts, every_collective_every_dtype};
use oxccl::{Algo, Communicator, ReduceOp};

const WORLDS: [usize; 6] = [1, 2, 3, 4, 5, 8];

fn fail(what: String) -> oxccl::Error {
    oxccl::Error::Config {
        name: "test".into(),
        value: String::new(),
        reason: what,
    }
}

fn matrix(chunk_bytes: usize, algo: Algo) {
    for world in WORLDS {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .chunk_bytes(chunk_bytes)
            .algo(algo);
        run_ranks_with(world, builder, |comm| {
            let counts = edge_counts(comm.world_size());
            every_collective_every_dtype(comm, &counts).map_err(|e| fail(e.to_string()))
        })
        .unwrap_or_else(|e| panic!("world {world}: {e}"));
    }
}

/// The schedules over the point-to-point links (what runs across hosts).
#[test]
fn every_collective_ring_default_chunks() {
    matrix(oxccl::DEFAULT_CHUNK_BYTES, Algo::Ring);
}

/// 64-byte pieces force thousands of pipeline steps (Gloo's
/// `setMaxSegmentSize(128)` trick).
#[test]
fn every_collective_ring_tiny_chunks() {
    matrix(64, Algo::Ring);
}

/// Recursive doubling and binomial trees over the point-to-point links
/// (what small calls among many ranks across hosts run): power-of-two
/// worlds and those whose first ranks pair up.
#[test]
fn every_collective_tree() {
    matrix(oxccl::DEFAULT_CHUNK_BYTES, Algo::Tree);
}

/// Trees among 32 ranks (threads here; over the links the table takes them
/// from 32 ranks): five rounds of recursive doubling, no pairs.
#[test]
fn every_collective_tree_among_32_ranks() {
    use oxccl::check::every_collective;
    let builder = Communicator::builder()
        .timeout(Duration::from_secs(60))
        .algo(Algo::Tree);
    run_ranks_with(32, builder, |comm| {
        every_collective::<i32>(comm, &[1, 33]).map_err(|e| fail(e.to_string()))
    })
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The shared arena (what runs among ranks of one host).
#[test]
fn every_collective_direct() {
    matrix(oxccl::DEFAULT_CHUNK_BYTES, Algo::Direct);
}

/// Counts past the arena's zero-copy threshold, for one- and eight-byte
/// elements, with partial last blocks and shares cut on cache lines
/// (threads share an address space: the arena's staged rounds run across
/// processes, in `multiprocess.rs`).
#[test]
fn every_collective_direct_many_pieces() {
    use oxccl::check::every_collective;
    for world in [2, 3] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .algo(Algo::Direct);
        run_ranks_with(world, builder, |comm| {
            every_collective::<u8>(comm, &[262_100, 600_007]).map_err(|e| fail(e.to_string()))?;
            every_collective::<f64>(comm, &[32_765, 100_003]).map_err(|e| fail(e.to_string()))
        })
        .unwrap_or_else(|e| panic!("world {world}: {e}"));
    }
}

/// With more threads than CPUs the arena keeps small calls off zero copy:
/// the lanes reach 4 KiB and broadcasts stage below 32 KiB. Pinned to one
/// CPU (the group counts the creating thread's CPUs, and its threads
/// inherit the mask), groups of two and three run every collective across
/// those bounds, whatever the host's CPU count.
#[test]
fn crowded_threads_run_every_collective_across_the_lane_and_staging_bounds() {
    use oxccl::check::every_collective;
    let result = || {
        for world in [2, 3] {
            let builder = Communicator::builder().timeout(Duration::from_secs(30));
            run_ranks_with(world, builder, move |comm| {
                let names = [
                    comm.algorithm_for::<f32>(oxccl::OpKind::AllReduce, 4096),
                    comm.algorithm_for::<f32>(oxccl::OpKind::Broadcast, 16 * 1024),
                ];
                if names != ["lane", "direct"] {
                    return Err(fail(format!("not crowded: {names:?}")));
                }
                // f32: 4 KiB, just above; 32 KiB, just below and at it.
                every_collective::<f32>(comm, &[1024, 1025, 8191, 8192])
                    .and_then(|()| every_collective::<u8>(comm, &[4095, 4097, 32_769]))
                    .map_err(|e| fail(e.to_string()))
            })
            .map_err(|e| format!("world {world}: {e}"))?;
        }
        Ok::<(), String>(())
    };
    common::on_one_cpu(result).unwrap();
}

/// Small broadcasts from every root in turn wrap the arena's mailboxes
/// (`oxccl::check::broadcast_burst`).
#[test]
fn small_broadcasts_wrap_the_mailboxes() {
    for world in [2, 3, 4] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .algo(Algo::Direct);
        run_ranks_with(world, builder, |comm| {
            oxccl::check::broadcast_burst(comm, 3000).map_err(|e| fail(e.to_string()))
        })
        .unwrap_or_else(|e| panic!("world {world}: {e}"));
    }
}

/// Small all-reduces in the arena's lanes among calls that let a rank run
/// ahead (`oxccl::check::lane_burst`).
#[test]
fn small_all_reduces_reuse_the_lanes_safely() {
    for world in [2, 3, 4] {
        let builder = Communicator::builder().timeout(Duration::from_secs(30));
        run_ranks_with(world, builder, |comm| {
            oxccl::check::lane_burst(comm, 2000).map_err(|e| fail(e.to_string()))
        })
        .unwrap_or_else(|e| panic!("world {world}: {e}"));
    }
}

/// Outputs of 16 MiB and more are written with non-temporal stores (no read
/// for ownership); an odd count puts part boundaries off the 16-byte grid.
#[test]
fn large_outputs_written_past_the_cache_are_correct() {
    use oxccl::check::every_collective;
    for world in [2, 3] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(60))
            .algo(Algo::Direct);
        run_ranks_with(world, builder, |comm| {
            every_collective::<f32>(comm, &[4_194_311]).map_err(|e| fail(e.to_string()))
        })
        .unwrap_or_else(|e| panic!("world {world}: {e}"));
    }
}

#[test]
fn one_byte_chunks_still_move_whole_elements() {
    let builder = Communicator::builder().chunk_bytes(1);
    run_ranks_with(3, builder, |comm| {
        let mut v = vec![comm.rank() as u64 + 1; 10];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        if v.iter().all(|&x| x == 6) {
            Ok(())
        } else {
            Err(fail(format!("sum {v:?}")))
        }
    })
    .unwrap();
}

/// Buffers from `alloc_shared` between threads (ordinary memory, zero-copy
/// as any buffer) and on ring-only communicators (no arena).
#[test]
fn collectives_on_alloc_shared_buffers_between_threads() {
    for (world, algo) in [(2, Algo::Auto), (3, Algo::Auto), (3, Algo::Ring)] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .algo(algo);
        run_ranks_with(world, builder, |comm| {
            oxccl::check::every_collective_shared::<f32>(comm, &[0, 1, 7, 4099])
                .and_then(|()| {
                    oxccl::check::every_collective_shared::<oxccl::f16>(comm, &[5, 2050])
                })
                .map_err(|e| fail(e.to_string()))
        })
        .unwrap_or_else(|e| panic!("world {world} {algo:?}: {e}"));
    }
}

/// Every rank receives identical bits, NaN payloads and signs included,
/// whatever its buffers' alignment: ranks fold separately in the one-shot
/// and lane paths, and a kernel's scalar head and vector body must not
/// pick different NaNs.
#[test]
fn every_rank_gets_the_same_nan_bits_whatever_its_alignment() {
    let cases = [3usize, 40, 1000, 20_000].into_iter().flat_map(|len| {
        [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod]
            .into_iter()
            .flat_map(move |op| (1..8).map(move |shift| (len, op, shift)))
    });
    for (len, op, shift) in cases {
        {
            let outs = run_ranks(2, move |comm| {
                let rank = comm.rank();
                let nan = if rank == 0 {
                    0x7fc0_0001u32
                } else {
                    0xffc0_0002u32
                };
                let input: Vec<f32> = (0..len)
                    .map(|i| {
                        if i % 3 == 0 {
                            f32::from_bits(nan)
                        } else {
                            i as f32
                        }
                    })
                    .collect();
                // Rank 1's output starts `4 · shift` bytes past a 32-byte
                // boundary, rank 0's on one.
                let mut store = vec![0f32; len + 16];
                let skip = (store.as_ptr() as usize / 4) % 8;
                let at = if rank == 0 {
                    (8 - skip) % 8
                } else {
                    (8 - skip + shift) % 8
                };
                comm.all_reduce(&input, &mut store[at..at + len], op)?;
                Ok(store[at..at + len]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<u32>>())
            });
            assert_eq!(outs[0], outs[1], "len {len}, {op:?}, shift {shift}");
        }
    }
}

/// An f16 `Avg` scales every rank's input by 1/world (rounded to f16)
/// before it sums, as NCCL's `ncclAvg` does: ranks holding 40000 and more
/// average to about that, where summing first (80000 and more) passes
/// f16's largest value, 65504, and gives `inf`. Every reducing call, in
/// and out of place, in the lanes (3 elements), beyond (10 007) and over
/// several of the 1 MiB segments it is scaled and reduced in (600 011
/// elements; a segment takes a piece of every chunk, or of every block of
/// a reduce-scatter), through the arena, the schedules between threads
/// and over TCP.
///
/// The values depend on the rank, the position and a reduce-scatter's
/// block (a cycle of 13, which no chunk's or segment's length is a
/// multiple of), so a piece reduced into the wrong place, or taken from
/// the wrong block, shows. They are chosen so that every scaled term, and so
/// every partial sum, is a multiple of 32 below 65504, exact in f16: the
/// expected bits do not depend on the order a schedule folds in (the
/// arena folds in rank order, the ring in ring order).
#[test]
fn f16_avg_scales_each_term_first_so_the_sum_cannot_overflow() {
    use oxccl::f16;
    // Multiples of 64 from 40000 (halved: multiples of 32) whose product
    // with f16(1/3) rounds to a multiple of 32.
    let third = f16::from_f32((1.0 / 3.0f64) as f32).to_f32();
    let cycle: [f16; 13] = (0..)
        .map(|k| 40000.0 + 64.0 * k as f32)
        .filter(|x| f16::from_f32(x * third).to_f32() % 32.0 == 0.0)
        .take(13)
        .map(f16::from_f32)
        .collect::<Vec<_>>()
        .try_into()
        .unwrap();
    assert!(cycle[12].to_f32() < 48000.0);
    let value = move |rank: usize, i: usize| cycle[(i + 5 * rank) % 13];
    // What NCCL computes: each term times f16(1/world), rounded to f16,
    // then summed in f32 and rounded to f16 at each step (exact here).
    let expected = move |world: usize, i: usize| {
        let scalar = f16::from_f32((1.0 / world as f64) as f32).to_f32();
        let term = |r: usize| f16::from_f32(value(r, i).to_f32() * scalar);
        (1..world).fold(term(0), |acc, r| {
            f16::from_f32(acc.to_f32() + term(r).to_f32())
        })
    };
    // What each result is compared with: element `i + shift` of the
    // reduction, or (off a reduce's root) the rank's own input left alone.
    #[derive(Clone, Copy)]
    enum Want {
        Reduced { shift: usize },
        OwnInput,
    }
    const REDUCED: Want = Want::Reduced { shift: 0 };
    let body = move |comm: &mut Communicator| -> oxccl::Result<Vec<(String, Want, Vec<f16>)>> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let mut results = Vec::new();
        for count in [3usize, 10_007, 600_011] {
            let input: Vec<f16> = (0..count).map(|i| value(rank, i)).collect();
            let mut out = vec![f16::ZERO; count];
            comm.all_reduce(&input, &mut out, ReduceOp::Avg)?;
            results.push((format!("all_reduce {count}"), REDUCED, out));
            let mut buf = input.clone();
            comm.all_reduce_in_place(&mut buf, ReduceOp::Avg)?;
            results.push((format!("all_reduce_in_place {count}"), REDUCED, buf));
            // Block r holds what rank r's result takes from this rank:
            // value(rank, i + 3r) at r·count + i.
            let whole: Vec<f16> = (0..count * world)
                .map(|j| value(rank, j % count + 3 * (j / count)))
                .collect();
            let mine = Want::Reduced { shift: 3 * rank };
            let mut part = vec![f16::ZERO; count];
            comm.reduce_scatter(&whole, &mut part, ReduceOp::Avg)?;
            results.push((format!("reduce_scatter {count}"), mine, part));
            let mut buf = whole.clone();
            comm.reduce_scatter_in_place(&mut buf, ReduceOp::Avg)?;
            results.push((
                format!("reduce_scatter_in_place {count}"),
                mine,
                buf[rank * count..(rank + 1) * count].to_vec(),
            ));
            let mut out = vec![f16::ZERO; count];
            comm.reduce(&input, &mut out, ReduceOp::Avg, world - 1)?;
            if rank == world - 1 {
                results.push((format!("reduce {count}"), REDUCED, out));
            }
            let mut buf = input.clone();
            comm.reduce_in_place(&mut buf, ReduceOp::Avg, 0)?;
            if rank == 0 {
                results.push((format!("reduce_in_place {count}"), REDUCED, buf));
            } else {
                // Off the root an in-place reduce leaves the buffer alone.
                results.push((
                    format!("reduce_in_place {count}, off the root"),
                    Want::OwnInput,
                    buf,
                ));
            }
        }
        Ok(results)
    };
    let builder = || Communicator::builder().timeout(Duration::from_secs(30));
    for world in [2usize, 3] {
        let runs = [
            ("arena", run_ranks_with(world, builder(), body)),
            (
                "ring between threads",
                run_ranks_with(world, builder().algo(Algo::Ring), body),
            ),
            (
                "tcp",
                common::run_ranks_net(world, builder(), oxccl::TransportKind::Tcp, body),
            ),
        ];
        let wants: Vec<f16> = (0..13).map(|i| expected(world, i)).collect();
        for (how, run) in runs {
            let ranks = run.unwrap_or_else(|e| panic!("world {world}, {how}: {e}"));
            for (rank, results) in ranks.iter().enumerate() {
                for (what, kind, got) in results {
                    for (i, g) in got.iter().enumerate() {
                        let want = match kind {
                            Want::Reduced { shift } => wants[(i + shift) % 13],
                            Want::OwnInput => value(rank, i),
                        };
                        assert!(want.is_finite(), "{want}");
                        assert_eq!(
                            g.to_bits(),
                            want.to_bits(),
                            "world {world}, {how}, rank {rank}, {what}: element {i} is {g}, \
                             not {want}"
                        );
                    }
                }
            }
        }
    }
}
