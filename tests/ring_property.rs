//! The central property: all_reduce(x) == all_gather(reduce_scatter(x)) bit
//! for bit, every rank holds identical bits, the in-place calls give the
//! out-of-place bits, and the result matches an f64 reference within the
//! dtype's tolerance (exactly for integers, min and max). Float inputs have
//! full mantissas, both signs and a spread of magnitudes, so that a rank
//! or schedule summing in another order gets other bits. Ranks run as
//! threads (the shared arena, or the ring schedules with `Algo::Ring`) and
//! over TCP (the schedules `choose` picks, or the forced family).

mod common;

use std::time::Duration;

use common::{run_ranks_net, run_ranks_with};
use oxccl::{bf16, f16, Algo, Communicator, Element, ReduceOp, TransportKind};
use proptest::prelude::*;

/// Relative rounding unit of each dtype (0 for integers: exact).
fn epsilon<T: Element>() -> f64 {
    match T::DTYPE {
        oxccl::DType::F16 => 2f64.powi(-10),
        oxccl::DType::BF16 => 2f64.powi(-7),
        oxccl::DType::F32 => 2f64.powi(-23),
        oxccl::DType::F64 => 2f64.powi(-52),
        _ => 0.0,
    }
}

fn mix(seed: u64, rank: usize, i: usize) -> u64 {
    let mut z = seed ^ ((rank as u64) << 32) ^ i as u64;
    z = (z ^ (z >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z ^ (z >> 29)
}

/// Integer inputs: 0..100, so sums of i8/u8 and products of every width wrap.
fn raw_int(seed: u64, rank: usize, i: usize) -> i64 {
    (mix(seed, rank, i) % 100) as i64
}

/// Inputs: as [`raw_int`] for integers. For floats: for `Prod`, values in
/// [0.5, 2) so products stay finite; otherwise ±(1 + a full 52-bit
/// fraction) · 2^(−8..8), rounded to the type, so sums round at every step
/// and their order shows in the bits (values like k/1024 add exactly, in
/// any order).
fn value<T: Element>(seed: u64, rank: usize, i: usize, op: ReduceOp) -> T {
    let z = mix(seed, rank, i);
    if !T::DTYPE.is_float() {
        T::from_i64_wrapping(raw_int(seed, rank, i))
    } else if op == ReduceOp::Prod {
        T::from_f64(0.5 + (z % 1536) as f64 / 1024.0)
    } else {
        let fraction = (z >> 12) as f64 / (1u64 << 52) as f64;
        let exponent = ((z >> 4) % 16) as i32 - 8;
        let sign = if z & 1 == 1 { -1.0 } else { 1.0 };
        T::from_f64(sign * (1.0 + fraction) * 2f64.powi(exponent))
    }
}

/// The exact integer result under oxccl's semantics, computed independently
/// in i64 (wrapping modulo 2^64 and then to the type is wrapping in the type).
fn int_expected<T: Element>(seed: u64, world: usize, i: usize, op: ReduceOp) -> T {
    let vals: Vec<i64> = (0..world).map(|r| raw_int(seed, r, i)).collect();
    let sum = vals.iter().fold(0i64, |a, &b| a.wrapping_add(b));
    match op {
        ReduceOp::Sum => T::from_i64_wrapping(sum),
        ReduceOp::Prod => T::from_i64_wrapping(vals.iter().fold(1i64, |a, &b| a.wrapping_mul(b))),
        ReduceOp::Min => T::from_i64_wrapping(*vals.iter().min().unwrap()),
        ReduceOp::Max => T::from_i64_wrapping(*vals.iter().max().unwrap()),
        ReduceOp::Avg => {
            let wrapped = T::from_i64_wrapping(sum).to_f64();
            T::from_f64((wrapped / world as f64).trunc())
        }
    }
}

/// The f64 reference and the magnitude its rounding error scales with: the
/// sum of the terms' magnitudes for sums (a sum that cancels keeps the
/// error of its terms), the result for products, 0 for min and max (exact).
fn reference<T: Element>(seed: u64, world: usize, i: usize, op: ReduceOp) -> (f64, f64) {
    let vals: Vec<f64> = (0..world)
        .map(|r| value::<T>(seed, r, i, op).to_f64())
        .collect();
    let magnitude: f64 = vals.iter().map(|v| v.abs()).sum();
    match op {
        ReduceOp::Sum => (vals.iter().sum(), magnitude),
        ReduceOp::Avg => (
            vals.iter().sum::<f64>() / world as f64,
            magnitude / world as f64,
        ),
        ReduceOp::Prod => {
            let p: f64 = vals.iter().product();
            (p, p.abs())
        }
        ReduceOp::Min => (vals.iter().cloned().fold(f64::INFINITY, f64::min), 0.0),
        ReduceOp::Max => (vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max), 0.0),
    }
}

/// Where the ranks run.
#[derive(Clone, Copy, Debug)]
enum Ranks {
    /// Threads of one group (the shared arena unless `Algo::Ring`).
    Threads,
    /// Threads joined over TCP, as processes on several hosts would be.
    Tcp,
}

/// One rank's results for one op: all-reduce, the composed reduce-scatter
/// then all-gather, the three in-place calls, and an all-reduce of a count
/// the world size does not divide.
struct OpResults<T> {
    op: ReduceOp,
    all_reduce: Vec<T>,
    composed: Vec<T>,
    all_reduce_in_place: Vec<T>,
    composed_in_place: Vec<T>,
    uneven: Vec<T>,
}

fn check<T: Element>(
    world: usize,
    per_rank: usize,
    seed: u64,
    chunk_bytes: usize,
    (algo, ranks): (Algo, Ranks),
) -> Result<(), String> {
    let builder = Communicator::builder()
        .timeout(Duration::from_secs(20))
        .chunk_bytes(chunk_bytes)
        .algo(algo);
    let body = move |comm: &mut Communicator| {
        let (rank, world) = (comm.rank(), comm.world_size());
        let count = per_rank * world;
        // One more element than a multiple of the world, and fewer than the
        // world when per_rank is 0: chunks of different sizes, empty pieces.
        let uneven_count = count + 1 + per_rank % world.max(1);
        let mut out = Vec::new();
        for op in ReduceOp::ALL {
            let x: Vec<T> = (0..uneven_count)
                .map(|i| value::<T>(seed, rank, i, op))
                .collect();
            let x_even = &x[..count];
            let mut all_reduce = vec![T::zeroed(); count];
            comm.all_reduce(x_even, &mut all_reduce, op)?;
            let mut part = vec![T::zeroed(); per_rank];
            comm.reduce_scatter(x_even, &mut part, op)?;
            let mut composed = vec![T::zeroed(); count];
            comm.all_gather(&part, &mut composed)?;

            let mut all_reduce_in_place = x_even.to_vec();
            comm.all_reduce_in_place(&mut all_reduce_in_place, op)?;
            let mut composed_in_place = x_even.to_vec();
            comm.reduce_scatter_in_place(&mut composed_in_place, op)?;
            comm.all_gather_in_place(&mut composed_in_place)?;

            let mut uneven = vec![T::zeroed(); uneven_count];
            comm.all_reduce(&x, &mut uneven, op)?;
            out.push(OpResults {
                op,
                all_reduce,
                composed,
                all_reduce_in_place,
                composed_in_place,
                uneven,
            });
        }
        Ok(out)
    };
    let results = match ranks {
        Ranks::Threads => run_ranks_with(world, builder, body)?,
        Ranks::Tcp => run_ranks_net(world, builder, TransportKind::Tcp, body)?,
    };
    let eps = epsilon::<T>();
    let bits = |v: &[T]| -> Vec<u8> { bytemuck::cast_slice(v).to_vec() };
    let what = |op: ReduceOp| format!("{} {op} world {world} {algo:?} {ranks:?}", T::DTYPE);
    for (rank, per_op) in results.iter().enumerate() {
        for (k, r) in per_op.iter().enumerate() {
            let op = r.op;
            let ar = bits(&r.all_reduce);
            for (name, other) in [
                ("all_gather(reduce_scatter)", &r.composed),
                ("all_reduce_in_place", &r.all_reduce_in_place),
                ("in-place all_gather(reduce_scatter)", &r.composed_in_place),
            ] {
                if ar != bits(other) {
                    return Err(format!("{}: all_reduce != {name} on rank {rank}", what(op)));
                }
            }
            let rank0 = &results[0][k];
            if ar != bits(&rank0.all_reduce) || bits(&r.uneven) != bits(&rank0.uneven) {
                return Err(format!("{}: rank {rank} bits differ from rank 0", what(op)));
            }
            for (i, v) in r.all_reduce.iter().chain(&r.uneven).enumerate() {
                // Element i of the uneven all-reduce follows the even one.
                let i = if i < r.all_reduce.len() {
                    i
                } else {
                    i - r.all_reduce.len()
                };
                let (got, want, ok) = if eps == 0.0 {
                    let want = int_expected::<T>(seed, world, i, op);
                    (v.to_f64(), want.to_f64(), *v == want)
                } else {
                    let (want, magnitude) = reference::<T>(seed, world, i, op);
                    // One rounding per step plus the final one, and the
                    // rounding of the reference's inputs already in it.
                    let bound = (world as f64 + 1.0) * eps * magnitude * 2.0;
                    let got = v.to_f64();
                    (got, want, (got - want).abs() <= bound)
                };
                if !ok {
                    return Err(format!(
                        "{} element {i}: got {got}, reference {want}",
                        what(op)
                    ));
                }
            }
        }
    }
    Ok(())
}

macro_rules! prop_for {
    ($name:ident, $t:ty) => {
        proptest! {
            #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
            #[test]
            fn $name(
                world in 1usize..=8,
                // Small counts, and counts past the direct schedules' limit
                // over TCP (64 KiB sent by each rank) for most worlds.
                per_rank in prop_oneof![3 => 0usize..40, 1 => 300usize..9000],
                seed in any::<u64>(),
                chunk in prop::sample::select(vec![2usize, 16, 64, 1 << 20]),
                algo in prop::sample::select(vec![Algo::Auto, Algo::Ring, Algo::Direct]),
                ranks in prop::sample::select(vec![Ranks::Threads, Ranks::Tcp]),
            ) {
                // Pieces of a few bytes over thousands of elements would be
                // hundreds of thousands of frames: large counts get pieces
                // of at least 4 KiB.
                let chunk = if per_rank >= 300 { chunk.max(4096) } else { chunk };
                check::<$t>(world, per_rank, seed, chunk, (algo, ranks)).map_err(TestCaseError::fail)?;
            }
        }
    };
}

prop_for!(ring_property_f32, f32);
prop_for!(ring_property_f64, f64);
prop_for!(ring_property_f16, f16);
prop_for!(ring_property_bf16, bf16);
prop_for!(ring_property_i8, i8);
prop_for!(ring_property_u8, u8);
prop_for!(ring_property_i32, i32);
prop_for!(ring_property_u32, u32);
prop_for!(ring_property_i64, i64);
prop_for!(ring_property_u64, u64);

/// The arena's all-reduce (between threads: the zero-copy one, each rank
/// folding its share of every input) against its reduce-scatter and
/// all-gather, bit for bit, for a float, a half and an integer type.
#[test]
fn direct_all_reduce_equals_all_gather_of_reduce_scatter() {
    for world in [2, 3] {
        let arena = (Algo::Direct, Ranks::Threads);
        check::<f32>(world, 40_000, 7, 1 << 20, arena).unwrap();
        check::<bf16>(world, 70_001, 8, 1 << 20, arena).unwrap();
        check::<i32>(world, 33_333, 9, 1 << 20, arena).unwrap();
    }
}

/// An f16 Avg runs as calls over segments of at most 1 MiB of input, each
/// taking the same piece of every chunk the ring cuts (of every block of a
/// reduce-scatter), in equal segments: so its bits are those of one call
/// summing the inputs each rank scaled by `f16(1/world)` itself, whatever
/// order the schedule folds in, and the all-reduce still equals the
/// all-gather of its reduce-scatter (`check`). World 3 (with two ranks
/// every fold order agrees), 174 765 elements per rank: two segments per
/// chunk, where cutting at the segment's size would leave a 3-element tail
/// that the table gives the direct schedules (rank order, not the ring's);
/// also one more element (chunks of unequal length). Between threads and
/// over TCP, forced ring and the table's choice (the arena, between
/// threads). Cutting segments out of the whole input instead of per
/// chunk, or leaving the short tail, fails it.
#[test]
fn segmented_f16_avg_gives_the_bits_of_one_call() {
    const PER_RANK: usize = 174_765;
    for (algo, ranks) in [
        (Algo::Ring, Ranks::Threads),
        (Algo::Ring, Ranks::Tcp),
        (Algo::Auto, Ranks::Tcp),
        (Algo::Auto, Ranks::Threads),
    ] {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .chunk_bytes(64 << 10)
            .algo(algo);
        let body = move |comm: &mut Communicator| {
            let (rank, world) = (comm.rank(), comm.world_size());
            let scalar = f16::from_f32((1.0 / world as f64) as f32).to_f32();
            let scale = |x: &[f16]| -> Vec<f16> {
                x.iter()
                    .map(|v| f16::from_f32(v.to_f32() * scalar))
                    .collect()
            };
            // (what, the Avg's bits, one Sum call's bits over scaled inputs)
            let mut pairs: Vec<(String, Vec<f16>, Vec<f16>)> = Vec::new();
            for count in [PER_RANK * world, PER_RANK * world + 1] {
                let x: Vec<f16> = (0..count)
                    .map(|i| value::<f16>(12, rank, i, ReduceOp::Sum))
                    .collect();
                let scaled = scale(&x);
                let mut avg = vec![f16::ZERO; count];
                comm.all_reduce(&x, &mut avg, ReduceOp::Avg)?;
                let mut sum = vec![f16::ZERO; count];
                comm.all_reduce(&scaled, &mut sum, ReduceOp::Sum)?;
                let mut avg_in_place = x.clone();
                comm.all_reduce_in_place(&mut avg_in_place, ReduceOp::Avg)?;
                pairs.push((format!("all_reduce {count}"), avg, sum.clone()));
                pairs.push((format!("all_reduce_in_place {count}"), avg_in_place, sum));
                let mut avg = vec![f16::ZERO; count];
                let mut sum = vec![f16::ZERO; count];
                comm.reduce(&x, &mut avg, ReduceOp::Avg, 1)?;
                comm.reduce(&scaled, &mut sum, ReduceOp::Sum, 1)?;
                if rank == 1 {
                    pairs.push((format!("reduce {count}"), avg, sum));
                }
            }
            let count = PER_RANK * world;
            let x: Vec<f16> = (0..count)
                .map(|i| value::<f16>(13, rank, i, ReduceOp::Sum))
                .collect();
            let mut avg = vec![f16::ZERO; PER_RANK];
            let mut sum = vec![f16::ZERO; PER_RANK];
            comm.reduce_scatter(&x, &mut avg, ReduceOp::Avg)?;
            comm.reduce_scatter(&scale(&x), &mut sum, ReduceOp::Sum)?;
            pairs.push(("reduce_scatter".to_string(), avg, sum));
            Ok(pairs)
        };
        let results = match ranks {
            Ranks::Threads => run_ranks_with(3, builder, body),
            Ranks::Tcp => run_ranks_net(3, builder, TransportKind::Tcp, body),
        }
        .unwrap_or_else(|e| panic!("{algo:?} {ranks:?}: {e}"));
        for (rank, pairs) in results.iter().enumerate() {
            for (what, avg, sum) in pairs {
                let differ = avg
                    .iter()
                    .zip(sum)
                    .position(|(a, s)| a.to_bits() != s.to_bits());
                assert_eq!(
                    differ, None,
                    "{algo:?} {ranks:?} rank {rank} {what}: the Avg's bits differ from one \
                     Sum call's at that element"
                );
            }
        }
        check::<f16>(3, PER_RANK, 11, 64 << 10, (algo, ranks)).unwrap();
    }
}
