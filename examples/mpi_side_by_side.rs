//! Open MPI and oxccl in the same two processes, batch against batch.
//!
//! `scripts/compare-mpi.sh` runs Open MPI's benchmark and `oxccl-perf` one
//! after the other, seconds apart; on a VM whose vCPUs move between
//! placements every few seconds (docs/performance.md), many of those pairs
//! straddle a move. Here each rank loads Open MPI (`dlopen`, so building
//! this needs no MPI) and joins an oxccl communicator too, and every pair
//! is one batch of each library, back to back on the same buffers,
//! milliseconds apart, in alternating order. The ratio of each pair is
//! taken, and the median ratio reported.
//!
//! Both libraries get the same timing: a barrier (Open MPI's), then `B`
//! calls timed on each rank, the slowest rank's time per call; `B` makes a
//! batch last at least 2 ms for the slower library (one call each from 2
//! ms), as `mpi_coll_bench.c` chooses its batches. Sizes and buffers follow
//! `mpi_coll_bench.c` (f32, sum; the size is the whole buffer for
//! all-reduce and broadcast, the gathered buffer for all-gather and
//! reduce-scatter; for `sendrecv`, what each rank sends to the next and
//! receives from the previous, `MPI_Sendrecv` against
//! `Communicator::send_recv`): out of place, and broadcast in place as
//! `MPI_Bcast`.
//! Each library's result is checked once per size before timing. The
//! buffers start on a cache line (as `oxccl-perf`'s and PyTorch's), or
//! `--offset` bytes past one (16: where `malloc` puts a large `Vec`, and
//! `mpi_coll_bench.c`'s buffers).
//!
//! ```text
//! mpirun -np 2 --bind-to core target/release/examples/mpi_side_by_side \
//!     [--colls allreduce,allgather,reduce_scatter,broadcast,sendrecv] \
//!     [--sizes 8,1024,...] [--budget SECONDS] [--offset BYTES]
//! ```
//!
//! oxccl's ranks come from mpirun's variables (`Communicator::from_env`),
//! its transport from `OXCCL_TRANSPORT`; Open MPI's from its own `--mca`
//! options. Only Open MPI is supported: its handles (`MPI_COMM_WORLD`,
//! `MPI_FLOAT`, …) are the addresses of exported objects, which is what
//! this program looks up (`OXCCL_MPI_LIBRARY` names the library; default
//! `libmpi.so.40`, then `libmpi.so`). Rank 0 prints one line per size:
//!
//! `PAIRED,coll,bytes,batch,pairs,mpi_us,oxccl_us,ratio,ratio_q1,ratio_q3,check`
//!
//! with each library's median time per call, the quartiles of the pairs'
//! ratios Open MPI / oxccl (above 1: oxccl is ahead), and `ok`, or which
//! library's result was wrong on some rank (`WRONG-MPI`, `WRONG-OXCCL`).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::time::Instant;

use oxccl::{Communicator, ReduceOp};

type Handle = *mut c_void;

/// `MPI_Init_thread`: argc, argv, required level, provided level.
type InitThreadFn =
    unsafe extern "C" fn(*mut c_int, *mut *mut *mut c_char, c_int, *mut c_int) -> c_int;
type AbortFn = unsafe extern "C" fn(Handle, c_int) -> c_int;
type FinalizeFn = unsafe extern "C" fn() -> c_int;
type CommQueryFn = unsafe extern "C" fn(Handle, *mut c_int) -> c_int;
type BarrierFn = unsafe extern "C" fn(Handle) -> c_int;
/// `MPI_Allreduce` and `MPI_Reduce_scatter_block`: send, receive, count,
/// type, operation, communicator.
type ReduceFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, c_int, Handle, Handle, Handle) -> c_int;
type AllgatherFn =
    unsafe extern "C" fn(*const c_void, c_int, Handle, *mut c_void, c_int, Handle, Handle) -> c_int;
type BcastFn = unsafe extern "C" fn(*mut c_void, c_int, Handle, c_int, Handle) -> c_int;
/// `MPI_Sendrecv`: send buffer, count, type, destination, tag; receive
/// buffer, count, type, source, tag; communicator, status.
type SendrecvFn = unsafe extern "C" fn(
    *const c_void,
    c_int,
    Handle,
    c_int,
    c_int,
    *mut c_void,
    c_int,
    Handle,
    c_int,
    c_int,
    Handle,
    *mut c_void,
) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_char, *mut c_int) -> c_int;

/// The Open MPI entry points and predefined handles this program uses.
struct Mpi {
    init_thread: InitThreadFn,
    abort: AbortFn,
    finalize: FinalizeFn,
    comm_rank: CommQueryFn,
    comm_size: CommQueryFn,
    barrier: BarrierFn,
    allreduce: ReduceFn,
    allgather: AllgatherFn,
    reduce_scatter_block: ReduceFn,
    bcast: BcastFn,
    sendrecv: SendrecvFn,
    library_version: VersionFn,
    world: Handle,
    float: Handle,
    double: Handle,
    sum: Handle,
    max: Handle,
}

impl Mpi {
    fn load() -> Result<Mpi, String> {
        let names = match std::env::var("OXCCL_MPI_LIBRARY") {
            Ok(name) => vec![name],
            Err(_) => vec!["libmpi.so.40".to_string(), "libmpi.so".to_string()],
        };
        let mut lib = std::ptr::null_mut();
        for name in &names {
            let c = CString::new(name.as_str()).map_err(|e| e.to_string())?;
            // RTLD_GLOBAL: Open MPI's components, loaded by MPI_Init,
            // resolve their references to libmpi through the global scope.
            // SAFETY: a valid C string; the library stays loaded for the
            // process's life (never closed).
            lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if !lib.is_null() {
                break;
            }
        }
        if lib.is_null() {
            return Err(format!(
                "cannot load Open MPI ({}; set OXCCL_MPI_LIBRARY)",
                names.join(", ")
            ));
        }
        let symbol = |name: &str| -> Result<*mut c_void, String> {
            let c = CString::new(name).map_err(|e| e.to_string())?;
            // SAFETY: `lib` is a live handle, `c` a valid C string.
            let ptr = unsafe { libc::dlsym(lib, c.as_ptr()) };
            if ptr.is_null() {
                Err(format!(
                    "{name} not found in the MPI library (only Open MPI is supported)"
                ))
            } else {
                Ok(ptr)
            }
        };
        // SAFETY (every transmute): the symbols are Open MPI's functions
        // with exactly these C signatures (mpi.h, MPI-3).
        unsafe {
            Ok(Mpi {
                init_thread: std::mem::transmute::<*mut c_void, InitThreadFn>(symbol(
                    "MPI_Init_thread",
                )?),
                abort: std::mem::transmute::<*mut c_void, AbortFn>(symbol("MPI_Abort")?),
                finalize: std::mem::transmute::<*mut c_void, FinalizeFn>(symbol("MPI_Finalize")?),
                comm_rank: std::mem::transmute::<*mut c_void, CommQueryFn>(symbol(
                    "MPI_Comm_rank",
                )?),
                comm_size: std::mem::transmute::<*mut c_void, CommQueryFn>(symbol(
                    "MPI_Comm_size",
                )?),
                barrier: std::mem::transmute::<*mut c_void, BarrierFn>(symbol("MPI_Barrier")?),
                allreduce: std::mem::transmute::<*mut c_void, ReduceFn>(symbol("MPI_Allreduce")?),
                allgather: std::mem::transmute::<*mut c_void, AllgatherFn>(symbol(
                    "MPI_Allgather",
                )?),
                reduce_scatter_block: std::mem::transmute::<*mut c_void, ReduceFn>(symbol(
                    "MPI_Reduce_scatter_block",
                )?),
                bcast: std::mem::transmute::<*mut c_void, BcastFn>(symbol("MPI_Bcast")?),
                sendrecv: std::mem::transmute::<*mut c_void, SendrecvFn>(symbol("MPI_Sendrecv")?),
                library_version: std::mem::transmute::<*mut c_void, VersionFn>(symbol(
                    "MPI_Get_library_version",
                )?),
                world: symbol("ompi_mpi_comm_world")?,
                float: symbol("ompi_mpi_float")?,
                double: symbol("ompi_mpi_double")?,
                sum: symbol("ompi_mpi_op_sum")?,
                max: symbol("ompi_mpi_op_max")?,
            })
        }
    }

    /// The slowest rank's value of `x`.
    fn max_over_ranks(&self, x: f64) -> f64 {
        let mut out = 0.0f64;
        // SAFETY: one double in, one out, predefined handles.
        unsafe {
            (self.allreduce)(
                (&x as *const f64).cast(),
                (&mut out as *mut f64).cast(),
                1,
                self.double,
                self.max,
                self.world,
            )
        };
        out
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    SendRecv,
}

impl Coll {
    fn from_name(name: &str) -> Option<Coll> {
        match name {
            "allreduce" => Some(Coll::AllReduce),
            "allgather" => Some(Coll::AllGather),
            "reduce_scatter" => Some(Coll::ReduceScatter),
            "broadcast" => Some(Coll::Broadcast),
            "sendrecv" => Some(Coll::SendRecv),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::AllGather => "allgather",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::Broadcast => "broadcast",
            Coll::SendRecv => "sendrecv",
        }
    }
}

/// `len` elements whose first sits `offset` bytes past a cache-line
/// boundary (a multiple of 4 below 64).
struct Buffer {
    storage: Vec<f32>,
    start: usize,
    len: usize,
}

impl Buffer {
    fn new(len: usize, offset: usize) -> Buffer {
        let storage = vec![0.0f32; len + 16];
        let misalignment = storage.as_ptr() as usize % 64;
        let start = ((64 + offset - misalignment) % 64) / 4;
        Buffer {
            storage,
            start,
            len,
        }
    }
}

impl std::ops::Deref for Buffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.storage[self.start..self.start + self.len]
    }
}

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// One size of one collective: the buffers both libraries run on.
struct Case<'a> {
    mpi: &'a Mpi,
    coll: Coll,
    rank: usize,
    world: usize,
    /// Elements of the whole buffer (the size / 4).
    count: usize,
    send: Buffer,
    recv: Buffer,
}

impl Case<'_> {
    fn per_rank(&self) -> usize {
        self.count / self.world
    }

    fn run_mpi(&mut self) {
        let m = self.mpi;
        let (count, per) = (self.count as c_int, self.per_rank() as c_int);
        let (s, r) = (self.send.as_ptr().cast(), self.recv.as_mut_ptr().cast());
        // SAFETY: the buffers hold `count` elements (all-gather's input and
        // reduce-scatter's output `per`), predefined handles.
        unsafe {
            match self.coll {
                Coll::AllReduce => (m.allreduce)(s, r, count, m.float, m.sum, m.world),
                Coll::AllGather => (m.allgather)(s, per, m.float, r, per, m.float, m.world),
                Coll::ReduceScatter => (m.reduce_scatter_block)(s, r, per, m.float, m.sum, m.world),
                Coll::Broadcast => {
                    (m.bcast)(self.send.as_mut_ptr().cast(), count, m.float, 0, m.world)
                }
                Coll::SendRecv => {
                    let (next, prev) = self.neighbours();
                    // A null status is MPI_STATUS_IGNORE in Open MPI.
                    (m.sendrecv)(
                        s,
                        count,
                        m.float,
                        next as c_int,
                        0,
                        r,
                        count,
                        m.float,
                        prev as c_int,
                        0,
                        m.world,
                        std::ptr::null_mut(),
                    )
                }
            };
        }
    }

    fn run_oxccl(&mut self, comm: &mut Communicator) -> oxccl::Result<()> {
        let per = self.per_rank();
        match self.coll {
            Coll::AllReduce => comm.all_reduce(&self.send, &mut self.recv, ReduceOp::Sum),
            Coll::AllGather => comm.all_gather(&self.send[..per], &mut self.recv),
            Coll::ReduceScatter => {
                comm.reduce_scatter(&self.send, &mut self.recv[..per], ReduceOp::Sum)
            }
            Coll::Broadcast => comm.broadcast_in_place(&mut self.send, 0),
            Coll::SendRecv => {
                let (next, prev) = self.neighbours();
                comm.send_recv(&self.send, next, &mut self.recv, prev)
            }
        }
    }

    /// The ranks this one sends to and receives from in `sendrecv`.
    fn neighbours(&self) -> (usize, usize) {
        let (rank, world) = (self.rank, self.world);
        ((rank + 1) % world, (rank + world - 1) % world)
    }

    /// The input pattern of `mpi_coll_bench.c`.
    fn fill(&mut self) {
        let rank = self.rank;
        for (i, x) in self.send.iter_mut().enumerate() {
            *x = (rank + 1) as f32 + (i % 7) as f32;
        }
        self.recv.fill(0.0);
    }

    /// Whether the call just run after `fill` left the right result
    /// (`mpi_coll_bench.c`'s check).
    fn correct(&self) -> bool {
        let world = self.world;
        let rank_sum: f32 = (1..=world).map(|r| r as f32).sum();
        let reduced = |i: usize| rank_sum + world as f32 * (i % 7) as f32;
        let per = self.per_rank();
        match self.coll {
            Coll::AllReduce => (0..self.count).all(|i| self.recv[i] == reduced(i)),
            Coll::AllGather => (0..self.count)
                .all(|i| self.recv[i] == (i / per + 1) as f32 + ((i % per) % 7) as f32),
            Coll::ReduceScatter => (0..per).all(|j| self.recv[j] == reduced(self.rank * per + j)),
            Coll::Broadcast => (0..self.count).all(|i| self.send[i] == 1.0 + (i % 7) as f32),
            Coll::SendRecv => {
                let from = self.neighbours().1;
                (0..self.count).all(|i| self.recv[i] == (from + 1) as f32 + (i % 7) as f32)
            }
        }
    }

    /// Seconds per call over a batch of `batch` calls after a barrier, the
    /// slowest rank's.
    fn time_batch(&mut self, comm: Option<&mut Communicator>, batch: usize) -> oxccl::Result<f64> {
        // SAFETY: a predefined communicator.
        unsafe { (self.mpi.barrier)(self.mpi.world) };
        let start = Instant::now();
        match comm {
            Some(comm) => {
                for _ in 0..batch {
                    self.run_oxccl(comm)?;
                }
            }
            None => {
                for _ in 0..batch {
                    self.run_mpi();
                }
            }
        }
        let mine = start.elapsed().as_secs_f64() / batch as f64;
        Ok(self.mpi.max_over_ranks(mine))
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let at = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[at]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Runs `coll` at `bytes`: checks, warms up, then alternates batches.
fn measure(
    mpi: &Mpi,
    comm: &mut Communicator,
    coll: Coll,
    bytes: usize,
    budget: f64,
    offset: usize,
) -> oxccl::Result<Option<String>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let count = bytes / 4;
    // All-gather and reduce-scatter give every rank count / world elements.
    let splits = matches!(coll, Coll::AllGather | Coll::ReduceScatter);
    // An exchange needs a peer (oxccl refuses sending to oneself).
    let lone = coll == Coll::SendRecv && world < 2;
    if count == 0 || lone || (splits && !count.is_multiple_of(world)) || count > c_int::MAX as usize
    {
        return Ok(None);
    }
    let mut case = Case {
        mpi,
        coll,
        rank,
        world,
        count,
        send: Buffer::new(count, offset),
        recv: Buffer::new(count, offset),
    };
    case.fill();
    case.run_mpi();
    let mpi_wrong = !case.correct();
    case.fill();
    case.run_oxccl(comm)?;
    let oxccl_wrong = !case.correct();
    // 1 for Open MPI wrong on some rank, 2 for oxccl, 3 for both.
    let wrong = mpi.max_over_ranks(f64::from(u8::from(mpi_wrong)))
        + 2.0 * mpi.max_over_ranks(f64::from(u8::from(oxccl_wrong)));
    let check = match wrong as u8 {
        0 => "ok",
        1 => "WRONG-MPI",
        2 => "WRONG-OXCCL",
        _ => "WRONG-BOTH",
    };

    // Warm up both, then estimate both (as mpi_coll_bench.c: 2 calls from
    // 64 MiB, 5 from 1 MiB, 50 below).
    let warm = if bytes >= 64 << 20 {
        2
    } else if bytes >= 1 << 20 {
        5
    } else {
        50
    };
    let mpi_estimate = {
        case.time_batch(None, warm)?;
        case.time_batch(None, warm)?
    };
    let oxccl_estimate = {
        case.time_batch(Some(comm), warm)?;
        case.time_batch(Some(comm), warm)?
    };
    let slower = mpi_estimate.max(oxccl_estimate).max(1e-7);
    let batch = if slower > 2e-3 {
        1
    } else {
        ((2e-3 / slower).ceil() as usize).min(10_000)
    };
    let pairs = ((budget / (2.0 * slower * batch as f64)) as usize).clamp(7, 400);
    let (mut mpi_times, mut oxccl_times, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for p in 0..pairs {
        let (m, o) = if p % 2 == 0 {
            let m = case.time_batch(None, batch)?;
            (m, case.time_batch(Some(comm), batch)?)
        } else {
            let o = case.time_batch(Some(comm), batch)?;
            (case.time_batch(None, batch)?, o)
        };
        mpi_times.push(m);
        oxccl_times.push(o);
        ratios.push(m / o);
    }
    let (mpi_times, oxccl_times, ratios) = (sorted(mpi_times), sorted(oxccl_times), sorted(ratios));
    Ok(Some(format!(
        "PAIRED,{},{bytes},{batch},{pairs},{:.3},{:.3},{:.3},{:.3},{:.3},{}",
        coll.name(),
        quantile(&mpi_times, 0.5) * 1e6,
        quantile(&oxccl_times, 0.5) * 1e6,
        quantile(&ratios, 0.5),
        quantile(&ratios, 0.25),
        quantile(&ratios, 0.75),
        check
    )))
}

fn parse_args() -> Result<(Vec<Coll>, Vec<usize>, f64, usize), String> {
    let mut colls = vec![
        Coll::AllReduce,
        Coll::AllGather,
        Coll::ReduceScatter,
        Coll::Broadcast,
    ];
    let mut sizes = vec![8, 1024];
    sizes.extend(
        (0..)
            .map(|k| 4096usize << (2 * k))
            .take_while(|&s| s <= 256 << 20),
    );
    let mut budget = 1.0;
    let mut offset = 0;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            println!(
                "usage: mpirun -np N mpi_side_by_side [--colls LIST] [--sizes BYTES,...] \
                 [--budget SECONDS] [--offset BYTES] (see the source's header)"
            );
            std::process::exit(0);
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--colls" => {
                colls = value
                    .split(',')
                    .map(|c| Coll::from_name(c).ok_or_else(|| format!("unknown collective {c}")))
                    .collect::<Result<_, _>>()?
            }
            "--sizes" => {
                sizes = value
                    .split(',')
                    .map(|s| s.parse().map_err(|_| format!("bad size {s}")))
                    .collect::<Result<_, _>>()?
            }
            "--budget" => budget = value.parse().map_err(|_| format!("bad budget {value}"))?,
            "--offset" => {
                offset = value
                    .parse()
                    .ok()
                    .filter(|o: &usize| o.is_multiple_of(4) && *o < 64)
                    .ok_or_else(|| format!("bad offset {value} (a multiple of 4 below 64)"))?
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok((colls, sizes, budget, offset))
}

fn main() {
    let (colls, sizes, budget, offset) = parse_args().unwrap_or_else(|e| {
        eprintln!("mpi_side_by_side: {e}");
        std::process::exit(2)
    });
    let mpi = Mpi::load().unwrap_or_else(|e| {
        eprintln!("mpi_side_by_side: {e}");
        std::process::exit(1)
    });
    // oxccl runs threads of its own (never calling MPI): FUNNELED.
    const MPI_THREAD_FUNNELED: c_int = 1;
    let mut provided = 0;
    // SAFETY: MPI_Init_thread accepts null arguments (MPI-2); called once.
    unsafe {
        (mpi.init_thread)(
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            MPI_THREAD_FUNNELED,
            &mut provided,
        )
    };
    // Every failure after MPI_Init ends the whole job at once (a peer may
    // be waiting in an MPI call), whatever the launcher does with a rank
    // that exits.
    let abort = |message: String| -> ! {
        eprintln!("mpi_side_by_side: {message}");
        // SAFETY: a predefined communicator; MPI_Abort does not return.
        unsafe { (mpi.abort)(mpi.world, 1) };
        std::process::exit(1)
    };
    let (mut rank, mut world) = (0, 0);
    // SAFETY: predefined communicator, valid out pointers.
    unsafe {
        (mpi.comm_rank)(mpi.world, &mut rank);
        (mpi.comm_size)(mpi.world, &mut world);
    }
    let result = (|| -> oxccl::Result<()> {
        let mut comm = Communicator::from_env()?;
        if (comm.rank(), comm.world_size()) != (rank as usize, world as usize) {
            abort(format!(
                "oxccl rank {}/{} is MPI rank {rank}/{world}",
                comm.rank(),
                comm.world_size()
            ));
        }
        if rank == 0 {
            let mut version = [0 as c_char; 8192];
            let mut len = 0;
            // SAFETY: a buffer larger than MPI_MAX_LIBRARY_VERSION_STRING.
            unsafe { (mpi.library_version)(version.as_mut_ptr(), &mut len) };
            // SAFETY: MPI writes a NUL-terminated string.
            let version = unsafe { CStr::from_ptr(version.as_ptr()) }.to_string_lossy();
            println!(
                "# {}; oxccl {}",
                version.lines().next().unwrap_or(""),
                comm.transport_description()
            );
            println!(
                "# PAIRED,coll,bytes,batch,pairs,mpi_us,oxccl_us,ratio,ratio_q1,ratio_q3,check"
            );
        }
        let at_start = comm.transport_description();
        for &coll in &colls {
            for &bytes in &sizes {
                if let Some(line) = measure(&mpi, &mut comm, coll, bytes, budget, offset)? {
                    if rank == 0 {
                        println!("{line}");
                    }
                }
            }
        }
        // The arena measures its slot stores again when the cores move
        // (as oxccl-perf's footer says): which it used by the end.
        let at_end = comm.transport_description();
        if rank == 0 && at_end != at_start {
            println!("# oxccl at the end: {at_end}");
        }
        Ok(())
    })();
    if let Err(e) = result {
        abort(format!("rank {rank}: {e}"));
    }
    // SAFETY: every MPI call of this process has returned.
    unsafe { (mpi.finalize)() };
}
