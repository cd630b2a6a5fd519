//! Criterion benches of the host collectives and of `send_recv` (a pair
//! exchanging, as pipeline stages and ring attention do), over threads
//! (`threads2`: an in-process group) and over processes (`procs2`: this
//! binary re-run as rank 1, linked by shared memory), with throughput set
//! to the bus bytes so criterion prints bus bandwidth (nccl-tests' busbw:
//! algbw × 2(N-1)/N for all-reduce, × (N-1)/N for all-gather and
//! reduce-scatter, × 1 for broadcast and sendrecv).
//!
//! `cargo bench --bench collectives -- --test` runs every case once (what
//! CI does); `OXCCL_ALGO=ring` benches the schedules instead of the arena.

use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use oxccl::bootstrap::TcpStore;
use oxccl::{Communicator, ReduceOp};

const RANKS: usize = 2;
/// Set in the environment of a worker process: it is a rank, not criterion.
const WORKER_VAR: &str = "OXCCL_BENCH_WORKER";

#[derive(Clone, Copy, Debug)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    SendRecv,
}

const COLLS: [Coll; 5] = [
    Coll::AllReduce,
    Coll::AllGather,
    Coll::ReduceScatter,
    Coll::Broadcast,
    Coll::SendRecv,
];

impl Coll {
    fn code(self) -> u64 {
        self as u64
    }
    fn from_code(code: u64) -> Option<Coll> {
        COLLS.into_iter().find(|c| c.code() == code)
    }
    fn bus_factor(self) -> f64 {
        let n = RANKS as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter => (n - 1.0) / n,
            Coll::Broadcast | Coll::SendRecv => 1.0,
        }
    }
}

/// Buffers for one size, reused across iterations (nccl-tests' size: the
/// largest buffer).
struct Bufs {
    full: Vec<f32>,
    part: Vec<f32>,
    /// What `send_recv` receives (it sends `full`).
    received: Vec<f32>,
}

impl Bufs {
    fn new(coll: Coll, bytes: usize) -> Bufs {
        let count = (bytes / 4 / RANKS * RANKS).max(RANKS);
        let exchanged = if matches!(coll, Coll::SendRecv) {
            count
        } else {
            0
        };
        Bufs {
            full: vec![1.0; count],
            part: vec![1.0; count / RANKS],
            received: vec![0.0; exchanged],
        }
    }
}

fn run_op(comm: &mut Communicator, coll: Coll, b: &mut Bufs) -> oxccl::Result<()> {
    match coll {
        Coll::AllReduce => comm.all_reduce_in_place(&mut b.full, ReduceOp::Sum),
        Coll::AllGather => comm.all_gather(&b.part, &mut b.full),
        Coll::ReduceScatter => comm.reduce_scatter(&b.full, &mut b.part, ReduceOp::Sum),
        Coll::Broadcast => comm.broadcast_in_place(&mut b.full, 0),
        Coll::SendRecv => {
            // A shift around the ranks (two: each with the other).
            let rank = comm.rank();
            let (next, prev) = ((rank + 1) % RANKS, (rank + RANKS - 1) % RANKS);
            comm.send_recv(&b.full, next, &mut b.received, prev)
        }
    }
}

/// Runs `iters` calls after a barrier; returns this rank's time.
fn timed(comm: &mut Communicator, coll: Coll, b: &mut Bufs, iters: u64) -> Duration {
    comm.barrier().expect("barrier");
    let start = Instant::now();
    for _ in 0..iters {
        run_op(comm, coll, b).expect("collective");
    }
    start.elapsed()
}

/// Threads: a fresh in-process group per measurement; the slowest rank's time.
fn run_threads(coll: Coll, bytes: usize, iters: u64) -> Duration {
    let comms = Communicator::local_group(RANKS).expect("local group");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            std::thread::spawn(move || {
                let mut b = Bufs::new(coll, bytes);
                run_op(&mut comm, coll, &mut b).expect("warm-up");
                timed(&mut comm, coll, &mut b, iters)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .max()
        .unwrap_or_default()
}

/// Processes: this process is rank 0; the others are this binary re-run as
/// workers that take orders `[collective, bytes, iters]` by broadcast
/// (iters 0: exit) and report their time with a max-reduction.
struct ProcessGroup {
    comm: Communicator,
    workers: Vec<Child>,
}

impl ProcessGroup {
    fn start() -> ProcessGroup {
        let store = TcpStore::host("127.0.0.1:0".parse().expect("address")).expect("store");
        let port = store.local_addr().expect("store address").port();
        let exe = std::env::current_exe().expect("bench executable");
        let workers = (1..RANKS)
            .map(|rank| {
                Command::new(&exe)
                    .env(WORKER_VAR, "1")
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", RANKS.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("LOCAL_WORLD_SIZE", RANKS.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .spawn()
                    .expect("worker process")
            })
            .collect();
        let comm = Communicator::builder()
            .init(0, RANKS, Arc::new(store))
            .expect("rank 0 joins");
        ProcessGroup { comm, workers }
    }

    fn run(&mut self, coll: Coll, bytes: usize, iters: u64) -> Duration {
        let mut order = [coll.code(), bytes as u64, iters];
        self.comm.broadcast_in_place(&mut order, 0).expect("order");
        let mut b = Bufs::new(coll, bytes);
        run_op(&mut self.comm, coll, &mut b).expect("warm-up");
        let mine = timed(&mut self.comm, coll, &mut b, iters);
        let mut slowest = [mine.as_nanos() as u64];
        self.comm
            .all_reduce_in_place(&mut slowest, ReduceOp::Max)
            .expect("times");
        Duration::from_nanos(slowest[0])
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        let mut order = [0u64, 0, 0];
        let _ = self.comm.broadcast_in_place(&mut order, 0);
        for w in &mut self.workers {
            let _ = w.wait();
        }
    }
}

/// A worker rank: follows rank 0's orders until told to stop.
fn worker() {
    let mut comm = Communicator::from_env().expect("worker joins");
    loop {
        let mut order = [0u64; 3];
        comm.broadcast_in_place(&mut order, 0).expect("order");
        let [code, bytes, iters] = order;
        let Some(coll) = Coll::from_code(code).filter(|_| iters > 0) else {
            return;
        };
        let mut b = Bufs::new(coll, bytes as usize);
        run_op(&mut comm, coll, &mut b).expect("warm-up");
        let mine = timed(&mut comm, coll, &mut b, iters);
        let mut slowest = [mine.as_nanos() as u64];
        comm.all_reduce_in_place(&mut slowest, ReduceOp::Max)
            .expect("times");
    }
}

const SIZES: [usize; 3] = [8, 64 << 10, 16 << 20];

fn bench_threads(c: &mut Criterion) {
    for coll in COLLS {
        let mut group = c.benchmark_group(format!("{coll:?}/threads{RANKS}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1));
        for bytes in SIZES {
            group.throughput(Throughput::BytesDecimal(
                (bytes as f64 * coll.bus_factor()) as u64,
            ));
            group.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
                b.iter_custom(|iters| run_threads(coll, bytes, iters))
            });
        }
        group.finish();
    }
}

fn bench_processes(c: &mut Criterion) {
    let mut procs = ProcessGroup::start();
    for coll in COLLS {
        let mut group = c.benchmark_group(format!("{coll:?}/procs{RANKS}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1));
        for bytes in SIZES {
            group.throughput(Throughput::BytesDecimal(
                (bytes as f64 * coll.bus_factor()) as u64,
            ));
            group.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
                b.iter_custom(|iters| procs.run(coll, bytes, iters))
            });
        }
        group.finish();
    }
}

fn main() {
    if std::env::var_os(WORKER_VAR).is_some() {
        worker();
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench_threads(&mut c);
    bench_processes(&mut c);
    c.final_summary();
}
