//! Micro-benchmark of the reduction kernels every collective runs: `a ⊕ b`
//! into a third buffer, for every element type, at sizes that live in L1,
//! in L2 and in memory. Throughput counts the bytes touched (two reads and
//! one write), to read against the memory-bandwidth figures in
//! `../shared/anchors/README.md` (`membw`: copy 14.8 GB/s, add 18.9 GB/s
//! on both cores of the reference machine).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use oxccl::host::reduce::Kernels;
use oxccl::{bf16, f16, Element, ReduceOp};

fn bench_type<T: Element + Kernels>(c: &mut Criterion, make: impl Fn(usize) -> T) {
    let mut group = c.benchmark_group(format!("reduce/{}", T::DTYPE.name()));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for bytes in [16 << 10, 256 << 10, 16 << 20] {
        let n = bytes / std::mem::size_of::<T>();
        let a: Vec<T> = (0..n).map(&make).collect();
        let b: Vec<T> = (0..n).map(|i| make(i + 7)).collect();
        let mut out = vec![T::zeroed(); n];
        group.throughput(Throughput::BytesDecimal(3 * bytes as u64));
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            group.bench_with_input(BenchmarkId::new(op.name(), bytes), &bytes, |bench, _| {
                bench.iter(|| T::combine_into(op, &mut out, &a, &b));
            });
        }
    }
    group.finish();
}

fn kernels(c: &mut Criterion) {
    bench_type::<f32>(c, |i| (i % 1000) as f32 * 0.5);
    bench_type::<f64>(c, |i| (i % 1000) as f64 * 0.5);
    bench_type::<f16>(c, |i| f16::from_f32((i % 100) as f32 * 0.5));
    bench_type::<bf16>(c, |i| bf16::from_f32((i % 100) as f32 * 0.5));
    bench_type::<i8>(c, |i| (i % 100) as i8);
    bench_type::<u8>(c, |i| (i % 200) as u8);
    bench_type::<i32>(c, |i| i as i32);
    bench_type::<u32>(c, |i| i as u32);
    bench_type::<i64>(c, |i| i as i64);
    bench_type::<u64>(c, |i| i as u64);
}

criterion_group!(benches, kernels);
criterion_main!(benches);
