//! The central property: all_reduce(x) == all_gather(reduce_scatter(x)) bit
//! for bit, every rank holds identical bits, and the result matches an f64
//! reference within the dtype's tolerance (exactly for integers).

mod common;

use std::time::Duration;

use common::run_ranks_with;
use oxccl::{bf16, f16, Algo, Communicator, Element, ReduceOp};
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

/// Inputs: as [`raw_int`] for integers; values in [0.5, 2) for floats so
/// products stay finite.
fn value<T: Element>(seed: u64, rank: usize, i: usize) -> T {
    if T::DTYPE.is_float() {
        T::from_f64(0.5 + (mix(seed, rank, i) % 1536) as f64 / 1024.0)
    } else {
        T::from_i64_wrapping(raw_int(seed, rank, i))
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

fn reference<T: Element>(seed: u64, world: usize, i: usize, op: ReduceOp) -> f64 {
    let vals: Vec<f64> = (0..world)
        .map(|r| value::<T>(seed, r, i).to_f64())
        .collect();
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Avg => vals.iter().sum::<f64>() / world as f64,
        ReduceOp::Prod => vals.iter().product(),
        ReduceOp::Min => vals.iter().cloned().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
    }
}

fn check<T: Element>(
    world: usize,
    per_rank: usize,
    seed: u64,
    chunk_bytes: usize,
    algo: Algo,
) -> Result<(), String> {
    let builder = Communicator::builder()
        .timeout(Duration::from_secs(20))
        .chunk_bytes(chunk_bytes)
        .algo(algo);
    let results = run_ranks_with(world, builder, move |comm| {
        let (rank, world) = (comm.rank(), comm.world_size());
        let count = per_rank * world;
        let x: Vec<T> = (0..count).map(|i| value::<T>(seed, rank, i)).collect();
        let mut out = Vec::new();
        for op in ReduceOp::ALL {
            let mut ar = vec![T::zeroed(); count];
            comm.all_reduce(&x, &mut ar, op)?;
            let mut part = vec![T::zeroed(); per_rank];
            comm.reduce_scatter(&x, &mut part, op)?;
            let mut composed = vec![T::zeroed(); count];
            comm.all_gather(&part, &mut composed)?;
            out.push((op, ar, composed));
        }
        Ok(out)
    })?;
    let eps = epsilon::<T>();
    for (rank, per_op) in results.iter().enumerate() {
        for (k, (op, ar, composed)) in per_op.iter().enumerate() {
            let ar_bits: &[u8] = bytemuck::cast_slice(ar);
            let composed_bits: &[u8] = bytemuck::cast_slice(composed);
            if ar_bits != composed_bits {
                return Err(format!(
                    "{} {op}: all_reduce != all_gather(reduce_scatter) on rank {rank}",
                    T::DTYPE
                ));
            }
            let rank0: &[u8] = bytemuck::cast_slice(&results[0][k].1);
            if ar_bits != rank0 {
                return Err(format!(
                    "{} {op}: rank {rank} bits differ from rank 0",
                    T::DTYPE
                ));
            }
            for (i, v) in ar.iter().enumerate() {
                let got = v.to_f64();
                let want = if eps == 0.0 {
                    int_expected::<T>(seed, world, i, *op).to_f64()
                } else {
                    reference::<T>(seed, world, i, *op)
                };
                let ok = if eps == 0.0 {
                    *v == int_expected::<T>(seed, world, i, *op)
                } else {
                    // One rounding per step plus the final one, relative to the magnitude.
                    let bound = (world as f64 + 1.0) * eps * want.abs().max(1e-300) * 2.0;
                    (got - want).abs() <= bound
                };
                if !ok {
                    return Err(format!(
                        "{} {op} world {world} element {i}: got {got}, reference {want}",
                        T::DTYPE
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
            fn $name(world in 1usize..=8, per_rank in 0usize..40, seed in any::<u64>(), chunk in prop::sample::select(vec![2usize, 16, 64, 1 << 20]), algo in prop::sample::select(vec![Algo::Ring, Algo::Direct])) {
                check::<$t>(world, per_rank, seed, chunk, algo).map_err(TestCaseError::fail)?;
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
        check::<f32>(world, 40_000, 7, 1 << 20, Algo::Direct).unwrap();
        check::<bf16>(world, 70_001, 8, 1 << 20, Algo::Direct).unwrap();
        check::<i32>(world, 33_333, 9, 1 << 20, Algo::Direct).unwrap();
    }
}
