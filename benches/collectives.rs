//! Criterion benches of the host collectives over in-process ranks, with
//! throughput set to the bus bytes so criterion prints bus bandwidth
//! (nccl-tests' busbw: algbw × 2(N-1)/N for all-reduce, × (N-1)/N for
//! all-gather and reduce-scatter).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use oxccl::{Communicator, ReduceOp};

const RANKS: usize = 2;

#[derive(Clone, Copy, Debug)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
}

/// Runs `iters` calls on every rank and returns the slowest rank's time.
fn run(coll: Coll, bytes: usize, iters: u64) -> Duration {
    let comms = Communicator::local_group(RANKS).expect("local group");
    let count = bytes / 4 / RANKS * RANKS;
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            std::thread::spawn(move || {
                let mut full = vec![1.0f32; count];
                let mut part = vec![0.0f32; count / RANKS];
                comm.barrier().expect("barrier");
                let start = Instant::now();
                for _ in 0..iters {
                    match coll {
                        Coll::AllReduce => comm.all_reduce_in_place(&mut full, ReduceOp::Sum),
                        Coll::AllGather => comm.all_gather(&part.clone(), &mut full),
                        Coll::ReduceScatter => comm.reduce_scatter(&full, &mut part, ReduceOp::Sum),
                    }
                    .expect("collective");
                }
                start.elapsed()
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .max()
        .unwrap_or_default()
}

fn collectives(c: &mut Criterion) {
    for (coll, factor) in [
        (Coll::AllReduce, 2.0 * (RANKS as f64 - 1.0) / RANKS as f64),
        (Coll::AllGather, (RANKS as f64 - 1.0) / RANKS as f64),
        (Coll::ReduceScatter, (RANKS as f64 - 1.0) / RANKS as f64),
    ] {
        let mut group = c.benchmark_group(format!("{coll:?}/threads{RANKS}"));
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(2));
        for bytes in [8usize << 10, 1 << 20, 16 << 20] {
            group.throughput(Throughput::Bytes((bytes as f64 * factor) as u64));
            group.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
                b.iter_custom(|iters| run(coll, bytes, iters))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, collectives);
criterion_main!(benches);
