//! Deterministic inputs with closed-form results, shared by the tests and by
//! `oxccl-perf`'s `-c` check.
//!
//! Rank `r`'s element `i` is `1 + h(r, i) mod 3` (for `Prod`, `1 + h(r, i) mod
//! 2`, so products are powers of two), `h` a hash: every value is 1, 2 or 3.
//! Every partial result of every reduction of up to 85 ranks is then an
//! integer exactly representable in every type (bf16 holds integers up to 256
//! exactly), so the expected value is exact: integer types wrap, as the
//! reductions do. Past that ([`exactly_checkable`]) half-precision sums
//! round by the fold order, and no closed form holds. The hash, not a period, decides the pattern: with `(r + i)
//! mod 3` a block moved by a multiple of 3 elements (an all-gather whose
//! blocks are, or a reduce-scatter that hands every rank block 0) and one
//! rank's data in another's place read the same.

use crate::comm::Communicator;
use crate::error::Error;
use crate::types::{Element, OpKind, Rank, ReduceOp};
use half::{bf16, f16};

/// Rank `rank`'s input element at global index `index`.
pub fn input_value(rank: Rank, index: usize, op: ReduceOp) -> i64 {
    let modulus = if op == ReduceOp::Prod { 2 } else { 3 };
    // splitmix64's finaliser over (rank, index).
    let mut z = (index as u64) ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    1 + (z % modulus) as i64
}

/// Fills `buf` with rank `rank`'s inputs, for global indices starting at `first_index`.
pub fn fill<T: Element>(buf: &mut [T], rank: Rank, first_index: usize, op: ReduceOp) {
    for (i, v) in buf.iter_mut().enumerate() {
        *v = T::from_i64_wrapping(input_value(rank, first_index + i, op));
    }
}

/// The reduction over `world` ranks of the inputs at `index` (over no
/// ranks, `world` 0: 1 for a product, else 0; never a division by zero).
pub fn reduced_value<T: Element>(world: usize, index: usize, op: ReduceOp) -> T {
    let values = (0..world).map(|r| input_value(r, index, op));
    let divisor = world.max(1);
    match op {
        ReduceOp::Sum => T::from_i64_wrapping(values.sum()),
        // Floats in f64: the product of 1s and 2s is 2^k, exact there until
        // it overflows the type to infinity, as the reduction does (an i64
        // fold wraps to i64::MIN at 63 twos and to 0 from 64). Integers
        // wrap, as the reductions do.
        ReduceOp::Prod if T::DTYPE.is_float() => {
            T::from_f64(values.fold(1.0, |acc, v| acc * v as f64))
        }
        ReduceOp::Prod => T::from_i64_wrapping(values.fold(1i64, i64::wrapping_mul)),
        ReduceOp::Min => T::from_i64_wrapping(values.min().unwrap_or(0)),
        ReduceOp::Max => T::from_i64_wrapping(values.max().unwrap_or(0)),
        ReduceOp::Avg => {
            let sum: i64 = values.sum();
            if T::DTYPE.is_float() {
                T::from_f64(sum as f64 / divisor as f64)
            } else {
                // As the reductions do: the sum wraps in the type (an `i8`
                // sum of 128 is -128), then the quotient truncates toward
                // zero. `to_f64` is exact for every integer of 32 bits or
                // less, and 64-bit sums here are far from wrapping.
                let wrapped = T::from_i64_wrapping(sum).to_f64() as i64;
                T::from_i64_wrapping(wrapped / divisor as i64)
            }
        }
    }
}

/// Whether [`reduced_value`] is what every correct backend returns for a
/// reduction over `world` ranks: every partial result an integer the type
/// holds. Not for bf16 sums of more than 85 ranks (values up to 3 pass
/// 256, past which bf16 rounds at each step, by the fold order) nor f16
/// sums of more than 682 (2048). Nor, where the backend premultiplies
/// its Avg (`premultiplied_avg`: NCCL's floats, the host's f16), for an
/// Avg that [`tolerance`] checks only to within 1/(4·world): one missing
/// rank moves the mean by at least 1/(3·world) of it with these inputs
/// (a term of at least 1 in a sum of at most 3·world), which a wider
/// tolerance, less the result's own rounding, would let pass. For f16 that
/// is from 17 ranks (16 is a power of two, checked exactly), bf16 from 6,
/// f32 from about 1450.
pub fn exactly_checkable(
    dtype: crate::types::DType,
    op: ReduceOp,
    world: usize,
    premultiplied_avg: bool,
) -> bool {
    use crate::types::DType;
    let epsilon = match dtype {
        DType::BF16 => f64::from(bf16::EPSILON),
        DType::F16 => f64::from(f16::EPSILON),
        DType::F32 => f64::from(f32::EPSILON),
        DType::F64 => f64::EPSILON,
        _ => 0.0,
    };
    // As `tolerance` (which is generic over the element type).
    let relative = if premultiplied_avg && op == ReduceOp::Avg && !world.is_power_of_two() {
        (world + 1) as f64 * epsilon
    } else {
        0.0
    };
    if relative * 4.0 * world as f64 >= 1.0 {
        return false;
    }
    let exact_sum_ranks = match dtype {
        DType::BF16 => 85,
        DType::F16 => 682,
        _ => return true,
    };
    !matches!(op, ReduceOp::Sum | ReduceOp::Avg) || world <= exact_sum_ranks
}

/// How far, relatively, a float Avg over `world` ranks may be from
/// [`reduced_value`] when the backend computes it as a sum of inputs each
/// multiplied by 1/world rounded to the type (`premultiplied_avg`: NCCL's
/// `ncclAvg`, and the host's for the types whose
/// [`Kernels::AVG_PREMULTIPLIES`](crate::host::reduce::Kernels::AVG_PREMULTIPLIES)):
/// with a world that is not a power of two the scalar, each product and
/// each addition round once, at most half a unit in the last place each
/// on these positive inputs, and the expected value once more. 0 (exact)
/// otherwise.
pub fn tolerance<T: Element>(op: ReduceOp, world: usize, premultiplied_avg: bool) -> f64 {
    let epsilon = match T::DTYPE {
        crate::types::DType::BF16 => f64::from(bf16::EPSILON),
        crate::types::DType::F16 => f64::from(f16::EPSILON),
        crate::types::DType::F32 => f64::from(f32::EPSILON),
        crate::types::DType::F64 => f64::EPSILON,
        _ => return 0.0,
    };
    if premultiplied_avg && op == ReduceOp::Avg && !world.is_power_of_two() {
        (world + 1) as f64 * epsilon
    } else {
        0.0
    }
}

/// Whether `got` is `expected`, or within `tolerance` of it relatively
/// (see [`tolerance`]).
pub fn matches<T: Element>(got: T, expected: T, tolerance: f64) -> bool {
    if tolerance == 0.0 {
        return got == expected;
    }
    let (g, e) = (got.to_f64(), expected.to_f64());
    (g - e).abs() <= tolerance * e.abs()
}

/// Number of elements of `got` that differ from the expected reduction, for
/// global indices starting at `first_index`.
pub fn count_wrong_reduced<T: Element>(
    got: &[T],
    world: usize,
    first_index: usize,
    op: ReduceOp,
) -> usize {
    let tolerance = tolerance::<T>(op, world, T::AVG_PREMULTIPLIES);
    got.iter()
        .enumerate()
        .filter(|(i, v)| {
            !matches(
                **v,
                reduced_value::<T>(world, first_index + i, op),
                tolerance,
            )
        })
        .count()
}

/// Number of elements of `got` that differ from rank `rank`'s inputs.
pub fn count_wrong_input<T: Element>(
    got: &[T],
    rank: Rank,
    first_index: usize,
    op: ReduceOp,
) -> usize {
    got.iter()
        .enumerate()
        .filter(|(i, v)| **v != T::from_i64_wrapping(input_value(rank, first_index + i, op)))
        .count()
}

/// Why a check failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// A call returned an error.
    #[error(transparent)]
    Comm(#[from] Error),
    /// A call completed with wrong values.
    #[error("{0}")]
    Wrong(String),
}

/// `n` zeroed elements, or an error naming the counts when the system
/// will not allocate them (the counts are the caller's: an error, not an
/// abort).
fn zeroed<T: Element>(n: usize, rank: Rank) -> Result<Vec<T>, CheckError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| {
        CheckError::Comm(Error::InvalidArgument {
            op: OpKind::AllGather,
            rank,
            arg: "counts",
            reason: format!("the check's buffers of {n} elements: {e}"),
        })
    })?;
    v.resize(n, T::zeroed());
    Ok(v)
}

/// Refuses counts whose largest buffer (`count × world` elements) holds
/// more bytes than one allocation can (`isize::MAX`), before any product
/// of them could overflow.
fn check_counts<T: Element>(counts: &[usize], rank: Rank, world: usize) -> Result<(), CheckError> {
    let too_large = counts.iter().find(|&&count| {
        count
            .checked_mul(world)
            .and_then(|n| n.checked_mul(std::mem::size_of::<T>()))
            .is_none_or(|bytes| bytes > isize::MAX as usize)
    });
    match too_large {
        Some(&count) => Err(CheckError::Comm(Error::InvalidArgument {
            op: OpKind::AllGather,
            rank,
            arg: "counts",
            reason: format!(
                "{count} {} per rank over {world} ranks is more than one allocation can hold",
                T::DTYPE
            ),
        })),
        None => Ok(()),
    }
}

fn ensure(wrong: usize, what: impl FnOnce() -> String) -> Result<(), CheckError> {
    if wrong == 0 {
        Ok(())
    } else {
        Err(CheckError::Wrong(format!(
            "{wrong} wrong elements: {}",
            what()
        )))
    }
}

/// Counts that exercise the edges for `world` ranks: empty, one element,
/// fewer than the ranks, one more than the ranks, and a prime-sized block.
pub fn edge_counts(world: usize) -> Vec<usize> {
    let mut c = vec![0, 1, world.saturating_sub(1), world + 1, 10_007];
    c.dedup();
    c
}

/// Runs every collective (both variants where there are two) for one dtype
/// on one communicator, for each count in `counts` (per-rank counts for
/// all-gather, reduce-scatter and all-to-all), every op and every root, plus
/// a ring of point-to-point messages, and checks every element against its
/// closed form (bf16 and f16 Sum and Avg past [`exactly_checkable`]'s range
/// have none and are skipped). Every rank must call it with the same
/// arguments.
///
/// # Errors
///
/// [`CheckError::Comm`] when a call fails, [`CheckError::Wrong`] naming the
/// call and the count of wrong elements.
pub fn every_collective<T: Element>(
    comm: &mut Communicator,
    counts: &[usize],
) -> Result<(), CheckError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    check_counts::<T>(counts, rank, world)?;
    for &count in counts {
        // Sums with no closed form (half precision over many ranks: they
        // round by the fold order), and premultiplied Avgs whose tolerance
        // could hide a missing rank, are skipped (`exactly_checkable`).
        for op in ReduceOp::ALL
            .into_iter()
            .filter(|&op| exactly_checkable(T::DTYPE, op, world, T::AVG_PREMULTIPLIES))
        {
            let ctx = || format!("{} {op} count {count} world {world}", T::DTYPE);
            // all_reduce
            let mut send = zeroed::<T>(count, rank)?;
            fill(&mut send, rank, 0, op);
            let mut recv = zeroed::<T>(count, rank)?;
            comm.all_reduce(&send, &mut recv, op)?;
            ensure(count_wrong_reduced(&recv, world, 0, op), || {
                format!("all_reduce {}", ctx())
            })?;
            let mut buf = send.clone();
            comm.all_reduce_in_place(&mut buf, op)?;
            ensure(count_wrong_reduced(&buf, world, 0, op), || {
                format!("all_reduce in place {}", ctx())
            })?;

            // reduce_scatter: `count` per rank
            let mut full = zeroed::<T>(count * world, rank)?;
            fill(&mut full, rank, 0, op);
            let mut part = zeroed::<T>(count, rank)?;
            comm.reduce_scatter(&full, &mut part, op)?;
            ensure(count_wrong_reduced(&part, world, rank * count, op), || {
                format!("reduce_scatter {}", ctx())
            })?;
            comm.reduce_scatter_in_place(&mut full, op)?;
            let mine = &full[rank * count..(rank + 1) * count];
            ensure(count_wrong_reduced(mine, world, rank * count, op), || {
                format!("reduce_scatter in place {}", ctx())
            })?;

            // reduce to every root
            for root in 0..world {
                let mut recv = zeroed::<T>(if rank == root { count } else { 0 }, rank)?;
                comm.reduce(&send, &mut recv, op, root)?;
                ensure(count_wrong_reduced(&recv, world, 0, op), || {
                    format!("reduce root {root} {}", ctx())
                })?;
                let mut buf = send.clone();
                comm.reduce_in_place(&mut buf, op, root)?;
                let wrong = if rank == root {
                    count_wrong_reduced(&buf, world, 0, op)
                } else {
                    count_wrong_input(&buf, rank, 0, op)
                };
                ensure(wrong, || format!("reduce in place root {root} {}", ctx()))?;
            }
        }
        let op = ReduceOp::Sum;
        // all_gather: rank r contributes its inputs for indices r*count..
        let mut mine = zeroed::<T>(count, rank)?;
        fill(&mut mine, 0, rank * count, op);
        let mut gathered = zeroed::<T>(count * world, rank)?;
        comm.all_gather(&mine, &mut gathered)?;
        ensure(count_wrong_input(&gathered, 0, 0, op), || {
            format!("all_gather count {count}")
        })?;
        let mut buf = zeroed::<T>(count * world, rank)?;
        buf[rank * count..(rank + 1) * count].copy_from_slice(&mine);
        comm.all_gather_in_place(&mut buf)?;
        ensure(count_wrong_input(&buf, 0, 0, op), || {
            format!("all_gather in place count {count}")
        })?;

        // broadcast from every root
        for root in 0..world {
            let mut src = zeroed::<T>(count, rank)?;
            fill(&mut src, root, 0, op);
            let mut recv = zeroed::<T>(count, rank)?;
            let send: &[T] = if rank == root { &src } else { &[] };
            comm.broadcast(send, &mut recv, root)?;
            ensure(count_wrong_input(&recv, root, 0, op), || {
                format!("broadcast root {root} count {count}")
            })?;
            let mut buf = if rank == root {
                src.clone()
            } else {
                zeroed::<T>(count, rank)?
            };
            comm.broadcast_in_place(&mut buf, root)?;
            ensure(count_wrong_input(&buf, root, 0, op), || {
                format!("broadcast in place root {root}")
            })?;
        }

        // all_to_all: block p of rank r's input is rank r's inputs at p*count..
        let mut send = zeroed::<T>(count * world, rank)?;
        fill(&mut send, rank, 0, op);
        let mut recv = zeroed::<T>(count * world, rank)?;
        comm.all_to_all(&send, &mut recv)?;
        for from in 0..world {
            let block = &recv[from * count..(from + 1) * count];
            let mut expected = zeroed::<T>(count, rank)?;
            fill(&mut expected, from, rank * count, op);
            ensure(usize::from(block != expected.as_slice()), || {
                format!("all_to_all from {from} count {count}")
            })?;
        }
        // send/recv around the ring (both directions at once, so a
        // transport that blocks on send would deadlock here)
        if world > 1 {
            let next = (rank + 1) % world;
            let prev = (rank + world - 1) % world;
            comm.send(&send[..count], next)?;
            let mut got = zeroed::<T>(count, rank)?;
            comm.recv(&mut got, prev)?;
            ensure(count_wrong_input(&got, prev, 0, op), || {
                format!("send/recv from {prev} count {count}")
            })?;
            // The same exchange in one call, out of place and in place.
            got.fill(T::zeroed());
            comm.send_recv(&send[..count], next, &mut got, prev)?;
            ensure(count_wrong_input(&got, prev, 0, op), || {
                format!("send_recv from {prev} count {count}")
            })?;
            let mut buf = send[..count].to_vec();
            comm.send_recv_in_place(&mut buf, next, prev)?;
            ensure(count_wrong_input(&buf, prev, 0, op), || {
                format!("send_recv in place from {prev} count {count}")
            })?;
        }
        comm.barrier()?;
    }
    Ok(())
}

/// The zero-copy collectives on buffers from
/// [`Communicator::alloc_shared`]: all-reduce, reduce-scatter and
/// all-gather in and out of place, broadcast and reduce in place, for every
/// operator, with each result checked. Where the communicator has a shared
/// arena and a call is large enough, it must have run zero-copy
/// (`last_direct_algorithm() == Some("zerocopy")`); the error says
/// otherwise. Large enough: across processes the arena's bound
/// (`zero_copy_min_bytes`: 2 KiB; 32 KiB for broadcasts with more ranks
/// than CPUs, and those from 2 KiB up to it must have been staged);
/// between threads what `algorithm_for_reduction` names zero copy (from
/// 2 KiB, later with more ranks than CPUs: the lanes and staged
/// broadcasts go further).
///
/// # Errors
///
/// [`CheckError`] naming the first wrong call, or a communication error.
pub fn every_collective_shared<T: Element>(
    comm: &mut Communicator,
    counts: &[usize],
) -> Result<(), CheckError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    check_counts::<T>(counts, rank, world)?;
    for &count in counts {
        let direct = |comm: &Communicator, what: &str, kind: OpKind, bytes: usize, op: ReduceOp| {
            // Ranks joined by a shared arena run a 1 MiB all-reduce in it
            // (zero-copy between threads, two-shot across processes).
            let arena = matches!(
                comm.algorithm_for::<T>(OpKind::AllReduce, 1 << 20),
                "zerocopy" | "twoshot"
            );
            // A premultiplied Avg (f16) reads its input from the
            // communicator's scaled copy, not from the allocation: across
            // processes no peer can map it (between threads any buffer
            // is zero-copy).
            let threads = comm.algorithm_for::<T>(OpKind::AllReduce, 1 << 20) == "zerocopy";
            let scaled_copy = op == ReduceOp::Avg && T::AVG_PREMULTIPLIES && world > 1;
            // Across processes with shared buffers the lanes stop below
            // 2 KiB (an all-gather's: of its part), and calls from there
            // reach the direct paths' decision; the lanes and the mailbox
            // report no direct algorithm.
            let lane_bytes = if kind == OpKind::AllGather {
                bytes / world
            } else {
                bytes
            };
            let decided = !threads && arena && lane_bytes >= 2048;
            let expect = if threads {
                comm.algorithm_for_reduction::<T>(kind, op, bytes) == "zerocopy"
            } else {
                decided && bytes >= comm.zero_copy_min_bytes(kind).unwrap_or(2048) && !scaled_copy
            };
            let ran = comm.last_direct_algorithm();
            ensure(usize::from(expect && ran != Some("zerocopy")), || {
                format!("{what} count {count} on alloc_shared buffers ran {ran:?}, not zero-copy")
            })?;
            ensure(
                usize::from(decided && !expect && ran == Some("zerocopy")),
                || {
                    format!("{what} count {count} on alloc_shared buffers ran zero-copy below its bound")
                },
            )
        };
        let bytes = count * std::mem::size_of::<T>();
        for op in ReduceOp::ALL
            .into_iter()
            .filter(|&op| exactly_checkable(T::DTYPE, op, world, T::AVG_PREMULTIPLIES))
        {
            let ctx = || {
                format!(
                    "{} {op} count {count} world {world} (alloc_shared)",
                    T::DTYPE
                )
            };
            let mut send = comm.alloc_shared::<T>(count)?;
            fill(&mut send, rank, 0, op);
            let mut recv = comm.alloc_shared::<T>(count)?;
            comm.all_reduce(&send, &mut recv, op)?;
            ensure(count_wrong_reduced(&recv, world, 0, op), || {
                format!("all_reduce {}", ctx())
            })?;
            direct(comm, "all_reduce", OpKind::AllReduce, bytes, op)?;
            comm.all_reduce_in_place(&mut send, op)?;
            ensure(count_wrong_reduced(&send, world, 0, op), || {
                format!("all_reduce in place {}", ctx())
            })?;
            direct(comm, "all_reduce in place", OpKind::AllReduce, bytes, op)?;

            let mut full = comm.alloc_shared::<T>(count * world)?;
            fill(&mut full, rank, 0, op);
            comm.reduce_scatter(&full, &mut recv, op)?;
            ensure(count_wrong_reduced(&recv, world, rank * count, op), || {
                format!("reduce_scatter {}", ctx())
            })?;
            comm.reduce_scatter_in_place(&mut full, op)?;
            ensure(
                count_wrong_reduced(
                    &full[rank * count..(rank + 1) * count],
                    world,
                    rank * count,
                    op,
                ),
                || format!("reduce_scatter in place {}", ctx()),
            )?;
            direct(
                comm,
                "reduce_scatter in place",
                OpKind::ReduceScatter,
                bytes * world,
                op,
            )?;

            fill(&mut send, rank, 0, op);
            comm.reduce_in_place(&mut send, op, world - 1)?;
            let wrong = if rank == world - 1 {
                count_wrong_reduced(&send, world, 0, op)
            } else {
                count_wrong_input(&send, rank, 0, op)
            };
            ensure(wrong, || format!("reduce in place {}", ctx()))?;

            // Out of place, the root's output alone in an allocation: off
            // the root the output is not written, so an empty one (as
            // NCCL's ncclReduce allows) keeps the call zero-copy.
            let root = world - 1;
            fill(&mut send, rank, 0, op);
            if rank == root {
                comm.reduce(&send, &mut recv, op, root)?;
                ensure(count_wrong_reduced(&recv, world, 0, op), || {
                    format!("reduce {}", ctx())
                })?;
            } else {
                comm.reduce(&send, &mut [], op, root)?;
            }
            direct(
                comm,
                "reduce, empty output off the root",
                OpKind::Reduce,
                bytes,
                op,
            )?;
            // The same with the root's output in an allocation the others
            // have dropped, and forgotten by allocating again: every rank
            // must still take the same path (they hung, the root zero-copy
            // and the others staged).
            let root_out = comm.alloc_shared::<T>(count)?;
            let root_out = (rank == root).then_some(root_out);
            let _later = comm.alloc_shared::<T>(1)?;
            fill(&mut send, rank, 0, op);
            if let Some(mut out) = root_out {
                comm.reduce(&send, &mut out, op, root)?;
                ensure(count_wrong_reduced(&out, world, 0, op), || {
                    format!("reduce into an allocation only the root kept {}", ctx())
                })?;
            } else {
                comm.reduce(&send, &mut [], op, root)?;
            }
            direct(
                comm,
                "reduce into an allocation only the root kept",
                OpKind::Reduce,
                bytes,
                op,
            )?;
        }
        let op = ReduceOp::Sum;
        let mut mine = comm.alloc_shared::<T>(count)?;
        fill(&mut mine, 0, rank * count, op);
        let mut gathered = comm.alloc_shared::<T>(count * world)?;
        comm.all_gather(&mine, &mut gathered)?;
        ensure(count_wrong_input(&gathered, 0, 0, op), || {
            format!("all_gather count {count} (alloc_shared)")
        })?;
        direct(
            comm,
            "all_gather",
            OpKind::AllGather,
            bytes * world,
            ReduceOp::Sum,
        )?;
        gathered.fill(T::zeroed());
        gathered[rank * count..(rank + 1) * count].copy_from_slice(&mine);
        comm.all_gather_in_place(&mut gathered)?;
        ensure(count_wrong_input(&gathered, 0, 0, op), || {
            format!("all_gather in place count {count} (alloc_shared)")
        })?;
        for root in 0..world {
            let mut buf = comm.alloc_shared::<T>(count)?;
            if rank == root {
                fill(&mut buf, root, 0, op);
            }
            comm.broadcast_in_place(&mut buf, root)?;
            ensure(count_wrong_input(&buf, root, 0, op), || {
                format!("broadcast in place root {root} count {count} (alloc_shared)")
            })?;
            direct(
                comm,
                "broadcast in place",
                OpKind::Broadcast,
                bytes,
                ReduceOp::Sum,
            )?;

            // Out of place with an empty input off the root (ignored there,
            // as in ncclBroadcast): still zero-copy.
            let mut recv = comm.alloc_shared::<T>(count)?;
            if rank == root {
                comm.broadcast(&buf, &mut recv, root)?;
            } else {
                comm.broadcast(&[], &mut recv, root)?;
            }
            ensure(count_wrong_input(&recv, root, 0, op), || {
                format!(
                    "broadcast root {root} count {count} (alloc_shared, empty input off the root)"
                )
            })?;
            direct(
                comm,
                "broadcast, empty input off the root",
                OpKind::Broadcast,
                bytes,
                ReduceOp::Sum,
            )?;
            // The same from one allocation holding both the root's input
            // and every output: the others then read the root's input.
            let mut both = comm.alloc_shared::<T>(2 * count)?;
            let (send, recv) = both.split_at_mut(count);
            if rank == root {
                fill(send, root, 0, op);
                comm.broadcast(send, recv, root)?;
            } else {
                comm.broadcast(&[], recv, root)?;
            }
            ensure(count_wrong_input(recv, root, 0, op), || {
                format!("broadcast root {root} count {count} (one alloc_shared, empty input off the root)")
            })?;
            direct(
                comm,
                "broadcast from one allocation, empty input off the root",
                OpKind::Broadcast,
                bytes,
                ReduceOp::Sum,
            )?;
        }
        comm.barrier()?;
    }
    Ok(())
}

/// `calls` back-to-back broadcasts of 1 to 72 bytes, in place and out of
/// place, from one root for 150 calls and then the next, with a
/// three-element all-reduce after every 251st. The readers pause at each
/// change of root, so the root fills its arena mailbox and must wait for
/// them to read before it writes more; 2,000 calls wrap every ring several
/// times, with messages across a ring's end. Every rank must call it with
/// the same arguments.
///
/// # Errors
///
/// As [`every_collective`].
pub fn broadcast_burst(comm: &mut Communicator, calls: usize) -> Result<(), CheckError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let byte = |call: usize, j: usize| (call * 31 + j * 7 + 1) as u8;
    for call in 0..calls {
        let root = call / 150 % world;
        if call % 150 == 0 && rank != root {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        // 1 to 64 bytes (the mailbox), and 72 (a slot round) last in each block.
        let len = if call % 150 == 149 {
            72
        } else {
            1 + call * 13 % 64
        };
        let expected: Vec<u8> = (0..len).map(|j| byte(call, j)).collect();
        let mut buf = if rank == root {
            expected.clone()
        } else {
            vec![0u8; len]
        };
        if call % 2 == 0 {
            comm.broadcast_in_place(&mut buf, root)?;
        } else {
            let send = buf.clone();
            comm.broadcast(&send, &mut buf, root)?;
        }
        let wrong = buf.iter().zip(&expected).filter(|(a, b)| a != b).count();
        ensure(wrong, || {
            format!("broadcast #{call} of {len} bytes from root {root}, world {world}")
        })?;
        if call % 251 == 250 {
            let mut sum = [rank as u32 + 1; 3];
            comm.all_reduce_in_place(&mut sum, ReduceOp::Sum)?;
            let want = (world * (world + 1) / 2) as u32;
            ensure(sum.iter().filter(|&&v| v != want).count(), || {
                format!("all_reduce after broadcast #{call}, world {world}")
            })?;
        }
    }
    Ok(())
}

/// Runs `calls` small all-reduces, reduces and all-gathers (the arena's
/// *lanes*, which rewrite each rank's lane slots every other lane call
/// without asking the peers) among calls that let a rank run ahead of
/// the others: small broadcasts
/// (the root returns at once), a rank that now and then sleeps before a
/// call, and a larger all-reduce every few calls (another path). Each
/// all-reduce's terms change from call to call and are checked exactly,
/// so a slot rewritten before a peer read it shows as a wrong sum. Every
/// rank must call it with the same arguments.
///
/// # Errors
///
/// As [`every_collective`].
pub fn lane_burst(comm: &mut Communicator, calls: usize) -> Result<(), CheckError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    // Integers: exact sums whatever the order.
    let term = |call: usize, r: usize, j: usize| ((call * 131 + r * 17 + j) % 1000) as i64;
    let sum = |call: usize, j: usize| (0..world).map(|r| term(call, r, j)).sum::<i64>();
    for call in 0..calls {
        if call % 97 == 0 && rank == call / 97 % world {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // 1 to 40 elements: from one line to several.
        let len = 1 + call * 7 % 40;
        let mut buf: Vec<i64> = (0..len).map(|j| term(call, rank, j)).collect();
        if call % 2 == 0 {
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
        } else {
            let send = buf.clone();
            comm.all_reduce(&send, &mut buf, ReduceOp::Sum)?;
        }
        let wrong = (0..len).filter(|&j| buf[j] != sum(call, j)).count();
        ensure(wrong, || {
            format!("all_reduce #{call} of {len} elements, world {world}")
        })?;
        // A reduce to each root in turn, and an all-gather: other lane
        // calls between the all-reduces.
        let root = call % world;
        let mut reduced = [0i64; 3];
        let own: Vec<i64> = (0..3).map(|j| term(call, rank, j)).collect();
        comm.reduce(&own, &mut reduced, ReduceOp::Sum, root)?;
        if rank == root {
            ensure(
                (0..3).filter(|&j| reduced[j] != sum(call, j)).count(),
                || format!("reduce #{call} to root {root}, world {world}"),
            )?;
        }
        if call % 3 == 0 {
            let mut gathered = vec![0i64; world];
            comm.all_gather(&own[..1], &mut gathered)?;
            ensure(
                (0..world)
                    .filter(|&r| gathered[r] != term(call, r, 0))
                    .count(),
                || format!("all_gather #{call}, world {world}"),
            )?;
        }
        // A broadcast from each root in turn: the root does not wait.
        let mut word = [if rank == root { call as u64 } else { 0 }];
        comm.broadcast_in_place(&mut word, root)?;
        ensure(usize::from(word[0] != call as u64), || {
            format!("broadcast after all_reduce #{call}, world {world}")
        })?;
        if call % 50 == 49 {
            let mut large = vec![rank as u32 + 1; 40_000];
            comm.all_reduce_in_place(&mut large, ReduceOp::Sum)?;
            let want = (world * (world + 1) / 2) as u32;
            ensure(large.iter().filter(|&&v| v != want).count(), || {
                format!("large all_reduce after #{call}, world {world}")
            })?;
        }
    }
    Ok(())
}

/// [`every_collective`] for every element type.
///
/// # Errors
///
/// As [`every_collective`].
pub fn every_collective_every_dtype(
    comm: &mut Communicator,
    counts: &[usize],
) -> Result<(), CheckError> {
    every_collective::<f32>(comm, counts)?;
    every_collective::<f64>(comm, counts)?;
    every_collective::<f16>(comm, counts)?;
    every_collective::<bf16>(comm, counts)?;
    every_collective::<i8>(comm, counts)?;
    every_collective::<u8>(comm, counts)?;
    every_collective::<i32>(comm, counts)?;
    every_collective::<u32>(comm, counts)?;
    every_collective::<i64>(comm, counts)?;
    every_collective::<u64>(comm, counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reduction_over_no_ranks_is_zero_not_a_panic() {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min] {
            assert_eq!(reduced_value::<i32>(0, 3, op), 0, "{op:?}");
            assert_eq!(reduced_value::<f32>(0, 3, op), 0.0, "{op:?}");
        }
    }

    /// Integer averages wrap the sum in the type before dividing, as the
    /// reductions do: 64 ranks' `i8` inputs sum past 127 (about 128 on
    /// average), and a sum of 128 is -128 in an `i8`, so its average is -2.
    #[test]
    fn an_integer_average_divides_the_wrapped_sum() {
        let mut wrapped_any = false;
        for index in 0..64 {
            let sum: i64 = (0..64).map(|r| input_value(r, index, ReduceOp::Avg)).sum();
            wrapped_any |= sum > 127;
            let expected = (sum as i8 as i64 / 64) as i8;
            assert_eq!(reduced_value::<i8>(64, index, ReduceOp::Avg), expected);
            assert_eq!(
                reduced_value::<i32>(64, index, ReduceOp::Avg),
                (sum / 64) as i32
            );
        }
        assert!(wrapped_any);
    }

    /// A float product over many ranks is 2^k, as the reduction computes
    /// it, up to the type's overflow to infinity: the i64 fold it replaced
    /// wrapped to i64::MIN at 63 twos and to 0 from 64.
    #[test]
    fn a_float_product_over_many_ranks_is_a_power_of_two() {
        for world in [63, 64, 128, 300] {
            for index in 0..32 {
                let twos = (0..world)
                    .filter(|&r| input_value(r, index, ReduceOp::Prod) == 2)
                    .count() as i32;
                let exact = 2f64.powi(twos);
                assert_eq!(reduced_value::<f64>(world, index, ReduceOp::Prod), exact);
                assert_eq!(
                    reduced_value::<f32>(world, index, ReduceOp::Prod),
                    exact as f32
                );
            }
        }
        // The integer product still wraps, as the reduction does.
        assert_eq!(
            reduced_value::<i64>(1, 0, ReduceOp::Prod),
            input_value(0, 0, ReduceOp::Prod)
        );
    }

    /// Which reductions have a closed form, and where NCCL's premultiplied
    /// Avg needs a tolerance.
    #[test]
    fn closed_forms_and_tolerances() {
        assert!(exactly_checkable(bf16::DTYPE, ReduceOp::Sum, 85, false));
        assert!(!exactly_checkable(bf16::DTYPE, ReduceOp::Avg, 86, false));
        assert!(exactly_checkable(bf16::DTYPE, ReduceOp::Max, 300, true));
        assert!(exactly_checkable(f16::DTYPE, ReduceOp::Sum, 682, true));
        assert!(!exactly_checkable(f16::DTYPE, ReduceOp::Sum, 683, true));
        assert!(exactly_checkable(f32::DTYPE, ReduceOp::Sum, 100_000, true));
        // Where Avg premultiplies, its tolerance must tell a mean that
        // lost a rank; where it does not, the check is exact at any world.
        assert!(exactly_checkable(f16::DTYPE, ReduceOp::Avg, 15, true));
        assert!(!exactly_checkable(f16::DTYPE, ReduceOp::Avg, 17, true));
        assert!(exactly_checkable(f16::DTYPE, ReduceOp::Avg, 64, true));
        assert!(exactly_checkable(bf16::DTYPE, ReduceOp::Avg, 5, true));
        assert!(!exactly_checkable(bf16::DTYPE, ReduceOp::Avg, 6, true));
        assert!(exactly_checkable(bf16::DTYPE, ReduceOp::Avg, 85, false));
        assert!(exactly_checkable(f32::DTYPE, ReduceOp::Avg, 1000, true));
        assert!(exactly_checkable(f32::DTYPE, ReduceOp::Avg, 3001, false));
        // Every f16 world checked: the premultiplied fold (as the host
        // computes it, in rank order) passes at every index, and the same
        // fold without rank 0 fails at some.
        for world in (3..=682).filter(|&w| exactly_checkable(f16::DTYPE, ReduceOp::Avg, w, true)) {
            let tol = tolerance::<f16>(ReduceOp::Avg, world, true);
            let scalar = f16::from_f32((1.0 / world as f64) as f32).to_f32();
            let fold = |from: usize, index: usize| {
                (from..world).fold(f16::ZERO, |acc, r| {
                    let v = input_value(r, index, ReduceOp::Avg) as f32;
                    let term = f16::from_f32(v * scalar);
                    f16::from_f32(acc.to_f32() + term.to_f32())
                })
            };
            let expected = |index| reduced_value::<f16>(world, index, ReduceOp::Avg);
            assert!(
                (0..64).all(|i| matches(fold(0, i), expected(i), tol)),
                "world {world}: a correct premultiplied Avg fails the check"
            );
            assert!(
                (0..64).any(|i| !matches(fold(1, i), expected(i), tol)),
                "world {world}: an Avg missing rank 0 passes the check"
            );
        }
        assert_eq!(tolerance::<f32>(ReduceOp::Avg, 4, true), 0.0);
        assert_eq!(tolerance::<f32>(ReduceOp::Avg, 3, false), 0.0);
        assert_eq!(tolerance::<i8>(ReduceOp::Avg, 3, true), 0.0);
        // 1, 3, 3 averaged as NCCL does: each times 1/3 rounded to f32.
        let third = 1.0f32 / 3.0;
        let premultiplied = 1.0 * third + 3.0 * third + 3.0 * third;
        let exact = 7.0f32 / 3.0;
        let tol = tolerance::<f32>(ReduceOp::Avg, 3, true);
        assert!(matches(premultiplied, exact, tol));
        assert!(!matches(exact * 1.001, exact, tol));
    }

    /// The pattern has no short period: blocks of a multiple of 3 elements
    /// (all-gather's, reduce-scatter's) differ, and so do ranks.
    #[test]
    fn blocks_and_ranks_differ() {
        let block = |rank: Rank, first: usize| {
            (first..first + 12).map(move |i| input_value(rank, i, ReduceOp::Sum))
        };
        assert!(!block(0, 0).eq(block(0, 12)));
        assert!(!block(0, 0).eq(block(3, 0)));
        assert!((0..1000).all(|i| (1..=3).contains(&input_value(7, i, ReduceOp::Sum))));
        assert!((0..1000).all(|i| (1..=2).contains(&input_value(7, i, ReduceOp::Prod))));
    }
}
