//! oxccl-perf: an nccl-tests-style benchmark of oxccl's collectives.
//!
//! Same flags, columns and bus-bandwidth formulas as nccl-tests
//! (`all_reduce_perf` and friends). Ranks are threads of one process
//! (`-t N`), or processes: one per rank under a launcher (`oxccl-run`,
//! torchrun, mpirun, srun), or `-np N` to start N copies of itself through
//! `oxccl::launch`. The header says which transport carried the traffic.

use std::process::ExitCode;
use std::time::Instant;

#[path = "perf/report.rs"]
mod report;

#[cfg(feature = "cuda")]
#[path = "perf/device.rs"]
mod device;

use oxccl::check::{fill, input_value, reduced_value};
use oxccl::{bf16, f16, Communicator, DType, Element, ReduceOp};

const USAGE: &str = "\
usage: oxccl-perf [options]
  -b, --minbytes <size>   smallest size (default 8; suffixes K M G)
  -e, --maxbytes <size>   largest size (default 32M)
  -f, --stepfactor <n>    multiply the size by n each step (default 2; 1: add -i instead)
  -i, --stepbytes <size>  add this many bytes each step instead (as nccl-tests: used
                          when -f is not given or is 1; default with -f 1: 1M)
  -n, --iters <n>         timed iterations per size (default 20)
  -w, --warmup_iters <n>  untimed iterations per size (default 5)
      --samples <s>       time the -n iterations as s samples of n/s calls, each
                          after a barrier, and report the median sample (the
                          upper one for even s; each sample's time across ranks
                          as -a asks), as Open MPI's and OSU-style benchmarks do;
                          s must divide n (default 1: the mean over the n calls,
                          as nccl-tests; host backend only)
  -c, --check <0|1>       check results (default 1)
  -a, --average <0..3>    the time reported: rank 0's (0), the ranks' mean (1, default,
                          as nccl-tests), their minimum (2) or maximum (3)
  -d, --datatype <type>   int8 uint8 int32 uint32 int64 uint64 half float double bfloat16
                          (default float), several separated by commas, or all
  -o, --op <op>           sum prod max min avg (default sum), several separated by
                          commas, or all
  -r, --root <rank>       root of broadcast and reduce (default 0), or all (or -1, as
                          nccl-tests spells it: every rank in turn)
  -t, --nthreads <n>      ranks, one thread each (default 2)
      -np <n>             ranks, one process each (shared memory or TCP, see
                          OXCCL_TRANSPORT); under a launcher, one rank per process
      --collective <name> all_reduce all_gather reduce_scatter broadcast reduce sendrecv all_to_all
                          (default all_reduce)
      --sizes <list>      exactly these sizes, comma-separated (e.g. 8,1K,64K,16M), instead of -b/-e/-f
  -J, --json <file>       also write the results as JSON
      --label <text>      name of this run in JSON and plots (default: collective, ranks, transport)
      --plot <file.svg>   plot busbw against size: this run, and every --compare run
      --compare <file>    a JSON file from an earlier -J run to draw on the same plot (repeatable)
      --plot-only         draw the --compare runs without running a benchmark
      --offset <bytes>    start the host buffers this far past a 64-byte boundary
                          (default 0; 16 is where malloc puts a large Vec)
      --shared            host buffers from Communicator::alloc_shared (peers in other
                          processes map them: zero copy); the algo column then says
                          what ran
      --backend <name>    host (CPU buffers, default), nccl (GPU buffers, one GPU per
                          rank: -t ranks as threads, or one per process under a
                          launcher) or cuda-ring (oxccl's own GPU ring: -t ranks as
                          threads, several per GPU allowed); GPU runs are timed with
                          CUDA events and print the device's copy bandwidth; need the
                          cuda (cuda-ring) or nccl feature
  -T, --timeout <secs>    fail a call that waits on a peer longer than this (the
                          communicators' timeout, OXCCL_TIMEOUT; default 60 s): a hung
                          run ends with an error naming the call and the rank; 0, as
                          in nccl-tests, waits as long as allowed (a year)
  -h, --help              this text

NCCL_TESTS_MIN_BW=<GB/s>, as for nccl-tests: the footer's average bus bandwidth
is marked FAILED, and the exit status is 1, below 0.9 times this figure.

The last column, algo, is the algorithm oxccl chose for that size
(OXCCL_ALGO=auto|ring|direct|tree overrides the choice).";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    SendRecv,
    AllToAll,
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::AllGather => "all_gather",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::SendRecv => "sendrecv",
            Coll::AllToAll => "all_to_all",
        }
    }

    fn parse(s: &str) -> Option<Coll> {
        Some(match s {
            "all_reduce" | "allreduce" => Coll::AllReduce,
            "all_gather" | "allgather" => Coll::AllGather,
            "reduce_scatter" | "reducescatter" => Coll::ReduceScatter,
            "broadcast" => Coll::Broadcast,
            "reduce" => Coll::Reduce,
            "sendrecv" => Coll::SendRecv,
            "all_to_all" | "alltoall" => Coll::AllToAll,
            _ => return None,
        })
    }

    fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce)
    }

    fn rooted(self) -> bool {
        matches!(self, Coll::Broadcast | Coll::Reduce)
    }

    /// nccl-tests' bus-bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }

    /// The variants measured on `backend`: out of place, and in place
    /// where the collective has one (all-to-all has none, as in NCCL; nor
    /// has send/recv on GPUs, whose send and receive run concurrently in
    /// one group and cannot share a buffer): the others' in-place columns
    /// read N/A.
    fn variants(self, backend: &str) -> &'static [bool] {
        let device = backend != "host";
        if self == Coll::AllToAll || (device && self == Coll::SendRecv) {
            &[false]
        } else {
            &[false, true]
        }
    }

    /// Whether the count must divide by the number of ranks.
    fn per_rank(self) -> bool {
        matches!(self, Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll)
    }

    /// The count column of the table and of the JSON for a buffer of
    /// `count` elements: nccl-tests' count, per rank where the count
    /// divides by the ranks.
    fn shown_count(self, count: usize, ranks: usize) -> usize {
        if self.per_rank() {
            count / ranks.max(1)
        } else {
            count
        }
    }
}

/// nccl-tests' `-a`: which time of the ranks' is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TimeAcrossRanks {
    Rank0,
    Mean,
    Min,
    Max,
}

impl TimeAcrossRanks {
    fn from_code(code: usize) -> Option<TimeAcrossRanks> {
        [Self::Rank0, Self::Mean, Self::Min, Self::Max]
            .get(code)
            .copied()
    }

    /// What this rank contributes (its time, `t`) to an all-reduce by
    /// [`reduce_op`](Self::reduce_op), whose result divided by
    /// [`divisor`](Self::divisor) is the figure.
    fn contribution(self, t: f64, rank: usize) -> f64 {
        match self {
            Self::Rank0 if rank != 0 => 0.0,
            _ => t,
        }
    }

    fn reduce_op(self) -> ReduceOp {
        match self {
            Self::Rank0 | Self::Mean => ReduceOp::Sum,
            Self::Min => ReduceOp::Min,
            Self::Max => ReduceOp::Max,
        }
    }

    fn divisor(self, ranks: usize) -> f64 {
        match self {
            Self::Mean => ranks.max(1) as f64,
            _ => 1.0,
        }
    }
}

#[derive(Clone, Debug)]
struct Args {
    min_bytes: usize,
    max_bytes: usize,
    /// How each size follows the one before: `-f`, or `-i`.
    step: SizeStep,
    iters: usize,
    /// `--samples`: the `iters` timed calls split into this many equal
    /// batches, each after a barrier; the reported time is the median
    /// batch. 1 (the default) is nccl-tests' mean over all calls.
    samples: usize,
    warmup: usize,
    check: bool,
    /// `-a`: how the ranks' times make the one reported.
    average: TimeAcrossRanks,
    /// The element type, reduction and root of the size sweep running
    /// now: one of [`combinations`] (`-d`, `-o` and `-r` may ask for
    /// several).
    dtype: DType,
    op: ReduceOp,
    root: usize,
    /// `-d`, `-o`: the types and reductions to sweep, in order.
    dtypes: Vec<DType>,
    ops: Vec<ReduceOp>,
    /// `-r all`: every rank as the root in turn.
    all_roots: bool,
    ranks: usize,
    /// `-np`: start this many processes.
    processes: Option<usize>,
    coll: Coll,
    /// `--sizes`: an explicit list instead of the geometric series.
    sizes: Option<Vec<usize>>,
    json: Option<String>,
    label: Option<String>,
    plot: Option<String>,
    compare: Vec<String>,
    plot_only: bool,
    /// `--backend`: `host` (CPU buffers) or `nccl` (GPU buffers).
    backend: String,
    /// `--shared`: host buffers from `Communicator::alloc_shared`.
    shared: bool,
    /// `--offset`: where the host buffers start past a cache line (bytes).
    offset: usize,
    /// `-T`: the communicators' wait limit, when given.
    timeout: Option<std::time::Duration>,
    /// `NCCL_TESTS_MIN_BW`: the average bus bandwidth (GB/s) a run must
    /// reach within 10 %, when set.
    min_busbw: Option<f64>,
}

/// How the size list steps from `-b` to `-e`, as nccl-tests steps it: by a
/// factor when `-f` is above 1, else by `-i` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SizeStep {
    Factor(usize),
    Bytes(usize),
}

impl SizeStep {
    /// The size after `size`, `None` past `max` or on overflow.
    fn next(self, size: usize, max: usize) -> Option<usize> {
        match self {
            SizeStep::Factor(f) => size.checked_mul(f),
            SizeStep::Bytes(b) => size.checked_add(b),
        }
        .filter(|&next| next <= max)
    }

    /// nccl-tests' header: `step: 2(factor)` or `step: 1048576(bytes)`.
    fn describe(self) -> String {
        match self {
            SizeStep::Factor(f) => format!("{f}(factor)"),
            SizeStep::Bytes(b) => format!("{b}(bytes)"),
        }
    }
}

fn parse_size(s: &str) -> Result<usize, String> {
    oxccl::parse_byte_size(s).ok_or_else(|| format!("bad size {:?}", s.trim()))
}

/// `-d`'s or `-o`'s value: one name, several separated by commas (each
/// once, in the order given), or `all` (every one, in nccl-tests' order).
fn name_list<V: Copy + PartialEq>(
    value: &str,
    all: &[V],
    from_name: impl Fn(&str) -> Option<V>,
    what: &str,
) -> Result<Vec<V>, String> {
    if value == "all" {
        return Ok(all.to_vec());
    }
    let mut list = Vec::new();
    for name in value.split(',').map(str::trim) {
        let v = from_name(name).ok_or_else(|| format!("unknown {what} {name:?}"))?;
        if list.contains(&v) {
            return Err(format!("{what} {name:?} is named twice"));
        }
        list.push(v);
    }
    Ok(list)
}

/// The size sweeps that `-d`, `-o` and `-r` ask for, in nccl-tests' order
/// (each type, within it each reduction, within that each root), each as
/// `a` with that type, reduction and root. Reductions apply only to the
/// collectives that reduce and roots only to rooted ones (`-r all`: ranks
/// `0..world`); the others sweep once per type.
fn combinations(a: &Args, world: usize) -> Vec<Args> {
    let ops = if a.coll.reduces() {
        &a.ops[..]
    } else {
        &a.ops[..1]
    };
    let roots = if a.coll.rooted() && a.all_roots {
        0..world
    } else {
        a.root..a.root + 1
    };
    let mut runs = Vec::new();
    for &dtype in &a.dtypes {
        for &op in ops {
            for root in roots.clone() {
                runs.push(Args {
                    dtype,
                    op,
                    root,
                    ..a.clone()
                });
            }
        }
    }
    runs
}

/// The names of `list` joined by commas, or `all` when it is `all` in
/// its order (for the JSON's and the plot's labels).
fn list_text<V: Copy + PartialEq>(
    list: &[V],
    all: &[V],
    name: impl Fn(V) -> &'static str,
) -> String {
    if list == all {
        "all".into()
    } else {
        list.iter().map(|&v| name(v)).collect::<Vec<_>>().join(",")
    }
}

fn parse_args() -> Result<Args, String> {
    let mut factor: Option<usize> = None;
    let mut step_bytes: Option<usize> = None;
    let mut a = Args {
        min_bytes: 8,
        max_bytes: 32 << 20,
        step: SizeStep::Factor(2),
        iters: 20,
        samples: 1,
        warmup: 5,
        check: true,
        average: TimeAcrossRanks::Mean,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: 0,
        dtypes: vec![DType::F32],
        ops: vec![ReduceOp::Sum],
        all_roots: false,
        ranks: 2,
        processes: None,
        coll: Coll::AllReduce,
        sizes: None,
        json: None,
        label: None,
        plot: None,
        compare: Vec::new(),
        plot_only: false,
        backend: "host".into(),
        shared: false,
        offset: 0,
        timeout: None,
        min_busbw: None,
    };
    // `args_os`: `args` panics on an argument that is not UTF-8.
    let argv: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("argument {a:?} is not UTF-8"))
        })
        .collect::<Result<_, _>>()?;
    let mut i = 0;
    while i < argv.len() {
        let flag = argv[i].as_str();
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        if flag == "--plot-only" {
            a.plot_only = true;
            i += 1;
            continue;
        }
        if flag == "--shared" {
            a.shared = true;
            i += 1;
            continue;
        }
        let value = argv
            .get(i + 1)
            .ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("{flag}: bad number {value:?}"))
        };
        match flag {
            "-b" | "--minbytes" => a.min_bytes = parse_size(value)?,
            "-e" | "--maxbytes" => a.max_bytes = parse_size(value)?,
            "-f" | "--stepfactor" => factor = Some(num()?),
            "-i" | "--stepbytes" => step_bytes = Some(parse_size(value)?),
            "-T" | "--timeout" => {
                let seconds = value
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .ok_or_else(|| format!("{flag}: seconds, 0 or more, not {value:?}"))?;
                // 0: no limit in nccl-tests; the communicators bound any
                // wait to their longest (MAX_TIMEOUT).
                a.timeout = Some(if seconds == 0.0 {
                    oxccl::MAX_TIMEOUT
                } else {
                    std::time::Duration::try_from_secs_f64(seconds).unwrap_or(oxccl::MAX_TIMEOUT)
                });
            }
            "-n" | "--iters" => a.iters = num()?,
            "-w" | "--warmup_iters" => a.warmup = num()?,
            "--samples" => a.samples = num()?,
            "-c" | "--check" => a.check = num()? != 0,
            "-a" | "--average" => {
                a.average = TimeAcrossRanks::from_code(num()?)
                    .ok_or_else(|| format!("{flag}: 0 (rank 0), 1 (mean), 2 (min) or 3 (max)"))?
            }
            "-d" | "--datatype" => {
                a.dtypes = name_list(value, &DType::ALL, DType::from_name, "datatype")?
            }
            "-o" | "--op" => a.ops = name_list(value, &ReduceOp::ALL, ReduceOp::from_name, "op")?,
            // nccl-tests takes -1 for every root (its help says "all").
            "-r" | "--root" if value == "all" || value == "-1" => a.all_roots = true,
            "-r" | "--root" => (a.root, a.all_roots) = (num()?, false),
            "-t" | "--nthreads" => a.ranks = num()?,
            "-np" => a.processes = Some(num()?),
            "--collective" => {
                a.coll =
                    Coll::parse(value).ok_or_else(|| format!("unknown collective {value:?}"))?
            }
            "--sizes" => {
                a.sizes = Some(
                    value
                        .split(',')
                        .filter(|t| !t.trim().is_empty())
                        .map(parse_size)
                        .collect::<Result<_, _>>()?,
                )
            }
            "-J" | "--json" => a.json = Some(value.clone()),
            "--label" => a.label = Some(value.clone()),
            "--plot" => a.plot = Some(value.clone()),
            "--compare" => a.compare.push(value.clone()),
            "--offset" => a.offset = num()?,
            "--backend" => match value.as_str() {
                "host" | "nccl" | "cuda-ring" => a.backend = value.clone(),
                _ => {
                    return Err(format!(
                        "unknown backend {value:?} (host, nccl or cuda-ring)"
                    ))
                }
            },
            _ => return Err(format!("unknown option {flag}")),
        }
        i += 2;
    }
    if let Some(n) = a.processes {
        a.ranks = n;
    }
    // As nccl-tests: a factor above 1 wins; otherwise -i's bytes (1 MiB
    // when -f 1 came alone).
    a.step = match (factor, step_bytes) {
        (Some(0), _) => return Err("need -f >= 1".into()),
        (Some(f), _) if f > 1 => SizeStep::Factor(f),
        (_, Some(0)) => return Err("need -i >= 1 (a step of 0 bytes never ends)".into()),
        (_, Some(b)) => SizeStep::Bytes(b),
        (Some(_), None) => SizeStep::Bytes(1 << 20),
        (None, None) => SizeStep::Factor(2),
    };
    (a.dtype, a.op) = (a.dtypes[0], a.ops[0]);
    // Every type's size is a power of two: a multiple of the largest is
    // a multiple of them all.
    let largest_element = a.dtypes.iter().map(|d| d.size()).max().unwrap_or(1);
    if a.offset >= BUFFER_ALIGN || !a.offset.is_multiple_of(largest_element) {
        let sizes_differ = a.dtypes.iter().any(|d| d.size() != largest_element);
        let which = if sizes_differ { "the largest " } else { "" };
        return Err(format!(
            "--offset takes bytes below {BUFFER_ALIGN}, a multiple of the element size \
             ({which}{largest_element})"
        ));
    }
    if a.offset != 0 && (a.shared || a.backend != "host") {
        return Err(
            "--offset places private host buffers (not with --shared or a GPU backend)".into(),
        );
    }
    if a.ranks == 0 || a.min_bytes > a.max_bytes || a.iters == 0 {
        return Err("need -t >= 1, -b <= -e and -n >= 1".into());
    }
    // Only a run has a bandwidth to check (not --plot-only).
    if let Some(text) = std::env::var_os("NCCL_TESTS_MIN_BW").filter(|_| !a.plot_only) {
        let text = text.to_string_lossy();
        a.min_busbw = Some(
            text.trim()
                .parse::<f64>()
                .ok()
                .filter(|gbps| gbps.is_finite() && *gbps >= 0.0)
                .ok_or_else(|| format!("NCCL_TESTS_MIN_BW={text:?}: a bandwidth in GB/s"))?,
        );
    }
    if a.samples == 0 || !a.iters.is_multiple_of(a.samples) {
        return Err(format!(
            "--samples {} must be at least 1 and divide -n {}",
            a.samples, a.iters
        ));
    }
    if a.samples > 1 && a.backend != "host" {
        // GPU runs time one stream of calls with CUDA events.
        return Err("--samples: host backend only".into());
    }
    if a.min_bytes == 0 && a.sizes.is_none() && matches!(a.step, SizeStep::Factor(_)) {
        // 0 times the factor stays 0: the size list would never end.
        return Err("need -b >= 1 (a zero-byte row: --sizes 0,...)".into());
    }
    // Under a launcher the world size is known once the communicator is
    // (-t and -np are not passed to the ranks); the call then checks.
    if under_launcher() {
        return Ok(a);
    }
    if a.coll.rooted() && !a.all_roots && a.root >= a.ranks {
        return Err(format!(
            "root {} is out of range for {} ranks",
            a.root, a.ranks
        ));
    }
    if a.coll == Coll::SendRecv && a.ranks < 2 {
        return Err("sendrecv needs at least 2 ranks".into());
    }
    Ok(a)
}

/// Buffers for one size, reused across iterations.
struct Bufs<T> {
    send: Vec<T>,
    recv: Vec<T>,
}

/// Where a host run's buffers live: private memory aligned to a cache
/// line, or (`--shared`) memory from `Communicator::alloc_shared`, which
/// peers in other processes map (zero copy).
enum Storage<T: Element> {
    Plain(Aligned<T>),
    Shared(oxccl::SharedBuffer<T>),
}

/// Alignment of the private host buffers: a cache line, as an ML
/// framework's CPU tensors have (PyTorch's CPU allocator aligns to 64
/// bytes; OSU's MPI benchmarks align to a page, nccl-tests' `cudaMalloc`
/// to 256 bytes). A `Vec` would leave it to `malloc`'s history: 16 bytes,
/// and a different offset for every rank's buffers, which moved
/// zero-copy all-reduce at 64 KiB by a third between otherwise identical
/// runs.
const BUFFER_ALIGN: usize = 64;

/// A private host buffer of [`BUFFER_ALIGN`]-aligned, initialised elements.
struct Aligned<T: Element> {
    ptr: std::ptr::NonNull<T>,
    len: usize,
    /// Elements allocated before `ptr` (`--offset`).
    skip: usize,
}

// SAFETY: it owns its elements, like a Vec<T>.
unsafe impl<T: Element> Send for Aligned<T> {}

impl<T: Element> Aligned<T> {
    /// The layout of `len` elements (`values` of a live slice: its size
    /// fits the address space).
    fn layout(len: usize) -> std::alloc::Layout {
        let bytes = (len * std::mem::size_of::<T>()).max(1);
        std::alloc::Layout::from_size_align(bytes, BUFFER_ALIGN.max(std::mem::align_of::<T>()))
            .expect("a buffer size that fits the address space")
    }

    /// A copy of `values` starting `offset` bytes (a multiple of the
    /// element size) past a [`BUFFER_ALIGN`] boundary, or an error when
    /// the system will not allocate it.
    fn from_slice(values: &[T], offset: usize) -> Result<Aligned<T>, String> {
        let skip = offset / std::mem::size_of::<T>();
        let layout = Self::layout(values.len() + skip);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) } as *mut T;
        let Some(base) = std::ptr::NonNull::new(raw) else {
            return Err(format!("cannot allocate {} bytes", layout.size()));
        };
        // SAFETY: `skip` elements into an allocation of len + skip.
        let ptr = unsafe { base.add(skip) };
        // SAFETY: a fresh allocation with room for values.len() elements
        // past `ptr`.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), ptr.as_ptr(), values.len()) };
        Ok(Aligned {
            ptr,
            len: values.len(),
            skip,
        })
    }
}

impl<T: Element> Drop for Aligned<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in from_slice with this layout, `skip`
        // elements before `ptr`.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr().sub(self.skip).cast(),
                Self::layout(self.len + self.skip),
            )
        }
    }
}

impl<T: Element> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: len initialised elements, owned.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: len initialised elements, owned exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> std::ops::Deref for Storage<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Storage::Plain(v) => v,
            Storage::Shared(s) => s,
        }
    }
}

impl<T: Element> std::ops::DerefMut for Storage<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Storage::Plain(v) => v,
            Storage::Shared(s) => s,
        }
    }
}

/// A host run's buffers, placed.
struct Placed<T: Element> {
    send: Storage<T>,
    recv: Storage<T>,
}

/// Moves prepared buffers where `--shared` wants them (a collective
/// allocation per buffer, so every rank must place the same buffers).
fn place<T: Element>(comm: &mut Communicator, a: &Args, b: Bufs<T>) -> oxccl::Result<Placed<T>> {
    if !a.shared {
        let aligned =
            |v: &[T]| Aligned::from_slice(v, a.offset).map_err(|e| too_large(a, comm.rank(), e));
        return Ok(Placed {
            send: Storage::Plain(aligned(&b.send)?),
            recv: Storage::Plain(aligned(&b.recv)?),
        });
    }
    let mut send = comm.alloc_shared::<T>(b.send.len())?;
    send.copy_from_slice(&b.send);
    let mut recv = comm.alloc_shared::<T>(b.recv.len())?;
    recv.copy_from_slice(&b.recv);
    Ok(Placed {
        send: Storage::Shared(send),
        recv: Storage::Shared(recv),
    })
}

/// Runs the collective once, out of place or in place.
fn run_once<T: Element>(
    comm: &mut Communicator,
    a: &Args,
    b: &mut Placed<T>,
    in_place: bool,
) -> oxccl::Result<()> {
    // The ring neighbours, for send/recv only: two divisions are a
    // sizable part of a timed 8-byte call.
    let neighbours = |comm: &Communicator| {
        let (rank, n) = (comm.rank(), comm.world_size());
        ((rank + 1) % n, (rank + n - 1) % n)
    };
    // Each call's `Result` is taken apart (`?`), not returned from the
    // match: moving a whole `Result` (the size of `oxccl::Error`) copies it
    // in 16-byte loads that wait for the library's 8-byte store of `Ok` to
    // reach the cache, a wait the timed loop would add to every call.
    match (a.coll, in_place) {
        (Coll::AllReduce, false) => comm.all_reduce(&b.send, &mut b.recv, a.op)?,
        (Coll::AllReduce, true) => comm.all_reduce_in_place(&mut b.recv, a.op)?,
        (Coll::AllGather, false) => comm.all_gather(&b.send, &mut b.recv)?,
        (Coll::AllGather, true) => comm.all_gather_in_place(&mut b.recv)?,
        (Coll::ReduceScatter, false) => comm.reduce_scatter(&b.send, &mut b.recv, a.op)?,
        (Coll::ReduceScatter, true) => comm.reduce_scatter_in_place(&mut b.recv, a.op)?,
        (Coll::Broadcast, false) => comm.broadcast(&b.send, &mut b.recv, a.root)?,
        (Coll::Broadcast, true) => comm.broadcast_in_place(&mut b.recv, a.root)?,
        (Coll::Reduce, false) => comm.reduce(&b.send, &mut b.recv, a.op, a.root)?,
        (Coll::Reduce, true) => comm.reduce_in_place(&mut b.recv, a.op, a.root)?,
        // Both directions at once, as nccl-tests' sendrecv groups them.
        (Coll::SendRecv, false) => {
            let (next, prev) = neighbours(comm);
            comm.send_recv(&b.send, next, &mut b.recv, prev)?;
        }
        (Coll::SendRecv, true) => {
            let (next, prev) = neighbours(comm);
            comm.send_recv_in_place(&mut b.recv, next, prev)?;
        }
        (Coll::AllToAll, _) => comm.all_to_all(&b.send, &mut b.recv)?,
    }
    Ok(())
}

/// `len` copies of `value`, or an error when the system will not allocate
/// them (the sizes are the user's: an error, not an abort).
fn filled<T: Clone>(len: usize, value: T) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|e| format!("{len} elements of {} bytes: {e}", std::mem::size_of::<T>()))?;
    v.resize(len, value);
    Ok(v)
}

/// The error of a buffer this rank could not allocate (`why`).
fn too_large(a: &Args, rank: usize, why: String) -> oxccl::Error {
    oxccl::Error::InvalidArgument {
        op: op_kind(a.coll),
        rank,
        arg: "size",
        reason: format!("the benchmark's buffers: {why}"),
    }
}

/// Allocates and fills the buffers for `count` elements (nccl-tests' count:
/// the full buffer), returning them and, when `with_expected`, the expected
/// output (else an empty list: it costs a buffer's worth of memory and a
/// hash per element and rank, which only a check needs).
#[allow(clippy::needless_late_init)]
fn prepare<T: Element>(
    a: &Args,
    rank: usize,
    n: usize,
    count: usize,
    in_place: bool,
    with_expected: bool,
) -> Result<(Bufs<T>, Vec<Option<T>>), String> {
    let per = count / n;
    let z = T::zeroed();
    let op = a.op;
    let input = |r: usize, i: usize| T::from_i64_wrapping(input_value(r, i, op));
    // Reduced values without a closed form (half-precision sums of many
    // ranks round by the fold order), or whose premultiplied Avg's
    // tolerance could not tell a missing rank (`check::exactly_checkable`),
    // are not checked; the header says so. The GPU backends' checks allow
    // NCCL's premultiplied Avg for every float (`perf/device.rs`).
    let premultiplied = a.backend != "host" || T::AVG_PREMULTIPLIES;
    let checkable = oxccl::check::exactly_checkable(T::DTYPE, op, n, premultiplied);
    let reduced_value = |n: usize, i: usize, op: ReduceOp| -> Option<T> {
        checkable.then(|| reduced_value(n, i, op))
    };
    let expect = |len: usize, at: &dyn Fn(usize) -> Option<T>| -> Result<Vec<Option<T>>, String> {
        let mut v = filled(if with_expected { len } else { 0 }, None)?;
        v.iter_mut().enumerate().for_each(|(i, e)| *e = at(i));
        Ok(v)
    };
    let (send_len, recv_len) = match a.coll {
        Coll::AllReduce | Coll::Broadcast | Coll::SendRecv | Coll::AllToAll => (count, count),
        Coll::Reduce => (count, count),
        Coll::AllGather => (per, count),
        Coll::ReduceScatter => (count, per),
    };
    let mut send = filled(send_len, z)?;
    let mut recv = filled(recv_len, z)?;
    // `None` marks elements whose value is unspecified (not checked).
    let expected: Result<Vec<Option<T>>, String>;
    match a.coll {
        Coll::AllReduce => {
            fill(&mut send, rank, 0, op);
            expected = expect(count, &|i| reduced_value(n, i, op));
        }
        Coll::Reduce => {
            fill(&mut send, rank, 0, op);
            expected = expect(count, &|i| {
                if rank == a.root {
                    reduced_value(n, i, op)
                } else if in_place {
                    Some(input(rank, i))
                } else {
                    None
                }
            });
        }
        Coll::ReduceScatter => {
            fill(&mut send, rank, 0, op);
            expected = if in_place {
                expect(count, &|i| {
                    (i / per.max(1) == rank).then(|| reduced_value(n, i, op))?
                })
            } else {
                expect(per, &|i| reduced_value(n, rank * per + i, op))
            };
        }
        Coll::AllGather => {
            fill(&mut send, 0, rank * per, op);
            expected = expect(count, &|i| Some(input(0, i)));
        }
        Coll::Broadcast => {
            // Only the root's input holds data: elsewhere zeros, which no
            // input is, so a broadcast that copied its own input would fail.
            if rank == a.root {
                fill(&mut send, a.root, 0, op);
            }
            expected = expect(count, &|i| Some(input(a.root, i)));
        }
        Coll::SendRecv => {
            fill(&mut send, rank, 0, op);
            expected = expect(count, &|i| Some(input((rank + n - 1) % n, i)));
        }
        Coll::AllToAll => {
            fill(&mut send, rank, 0, op);
            expected = expect(count, &|i| {
                Some(input(i / per.max(1), rank * per + i % per.max(1)))
            });
        }
    }
    if in_place {
        // The one buffer starts as the out-of-place input, placed as NCCL's
        // in-place conventions require.
        match a.coll {
            Coll::AllGather => recv[rank * per..(rank + 1) * per].copy_from_slice(&send),
            Coll::ReduceScatter => recv = send.clone(),
            Coll::Broadcast if rank != a.root => {}
            _ => {
                let len = recv.len();
                recv.copy_from_slice(&send[..len]);
            }
        }
    }
    Ok((Bufs { send, recv }, expected?))
}

struct Measurement {
    time_us: f64,
    wrong: u64,
    /// How the timed calls reached their peers, when directly.
    direct: Option<&'static str>,
}

fn measure<T: Element>(
    comm: &mut Communicator,
    a: &Args,
    count: usize,
    in_place: bool,
) -> oxccl::Result<Measurement> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let (b, _) =
        prepare::<T>(a, rank, n, count, in_place, false).map_err(|e| too_large(a, rank, e))?;
    let mut b = place(comm, a, b)?;
    for _ in 0..a.warmup {
        run_once(comm, a, &mut b, in_place)?;
    }
    // One batch of calls per sample, each started after a barrier; this
    // rank's µs per call in each.
    let batch = a.iters / a.samples;
    let mut mine = Vec::with_capacity(a.samples);
    for _ in 0..a.samples {
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..batch {
            run_once(comm, a, &mut b, in_place)?;
        }
        mine.push(start.elapsed().as_secs_f64() * 1e6 / batch as f64);
    }
    let direct = comm.last_direct_algorithm();
    let mut wrong = 0u64;
    if a.check {
        // As nccl-tests does: after the timed calls, on the same buffers
        // (refilled), so the call checked takes the paths the timed ones
        // took.
        let (fresh, expected) =
            prepare::<T>(a, rank, n, count, in_place, true).map_err(|e| too_large(a, rank, e))?;
        b.send.copy_from_slice(&fresh.send);
        b.recv.copy_from_slice(&fresh.recv);
        run_once(comm, a, &mut b, in_place)?;
        let got = if a.coll == Coll::Reduce && !in_place && rank != a.root {
            &b.recv[..0]
        } else {
            &b.recv[..]
        };
        // An f16 Avg scales each term by 1/n first (`check::tolerance`).
        let tolerance = if a.coll.reduces() {
            oxccl::check::tolerance::<T>(a.op, n, T::AVG_PREMULTIPLIES)
        } else {
            0.0
        };
        wrong = got
            .iter()
            .zip(&expected)
            .filter(|(g, e)| e.is_some_and(|e| !oxccl::check::matches(**g, e, tolerance)))
            .count() as u64;
    }
    drop(b);
    // Each sample's time across the ranks as `-a` asks, then the median
    // sample (one sample: the mean over all the calls); and every rank's
    // wrong values.
    let mut t: Vec<f64> = mine
        .iter()
        .map(|&us| a.average.contribution(us, rank))
        .collect();
    comm.all_reduce_in_place(&mut t, a.average.reduce_op())?;
    let time_us = median_sample(&mut t) / a.average.divisor(n);
    let mut w = [wrong];
    comm.all_reduce_in_place(&mut w, ReduceOp::Sum)?;
    Ok(Measurement {
        time_us,
        wrong: w[0],
        direct,
    })
}

/// The median of the samples, the upper one of an even count (as Open
/// MPI's benchmark in `shared/anchors` takes it). Sorts `samples`.
fn median_sample(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// One size's results, as printed and as written with `-J`.
#[derive(Clone, Debug, Default, PartialEq)]
struct Row {
    bytes: usize,
    count: usize,
    /// The table's type, redop and root columns (`none` and -1 where the
    /// collective has no reduction or root): a run may sweep several.
    dtype: &'static str,
    redop: &'static str,
    root: i64,
    algo: String,
    /// Out of place, then in place.
    time_us: [f64; 2],
    algbw: [f64; 2],
    busbw: [f64; 2],
    wrong: [u64; 2],
}

/// Everything one run measured.
struct RunResult {
    /// This process's rank and the world size, from its communicator.
    rank: usize,
    ranks: usize,
    wrong: u64,
    /// The busbw figures measured, summed, and how many (for the footer's
    /// average).
    busbw_sum: f64,
    busbw_count: usize,
    rows: Vec<Row>,
    /// What carried the traffic, at the start (the header's) and after the
    /// last size: the arena's slot stores may have been measured again
    /// meanwhile (the ranks' cores moved), which the footer then reports.
    transport: String,
    transport_at_end: String,
}

impl RunResult {
    /// A run with nothing measured yet, of rank `rank` of `ranks`.
    fn new(rank: usize, ranks: usize, transport: String) -> RunResult {
        RunResult {
            rank,
            ranks,
            wrong: 0,
            busbw_sum: 0.0,
            busbw_count: 0,
            rows: Vec::new(),
            transport_at_end: transport.clone(),
            transport,
        }
    }

    /// Adds one size's measurements (its busbw to the footer's average).
    fn push(&mut self, row: Row, measured: usize) {
        self.wrong += row.wrong.iter().sum::<u64>();
        self.busbw_sum += row.busbw[..measured].iter().sum::<f64>();
        self.busbw_count += measured;
        self.rows.push(row);
    }
}

/// A row of `a`'s sweep (its type, reduction and root columns) for a
/// buffer of `count` elements, `bytes` bytes, run by `algo`.
fn new_row(a: &Args, bytes: usize, count: usize, algo: String) -> Row {
    Row {
        bytes,
        count,
        dtype: a.dtype.name(),
        redop: if a.coll.reduces() {
            a.op.name()
        } else {
            "none"
        },
        root: if a.coll.rooted() { a.root as i64 } else { -1 },
        algo,
        ..Row::default()
    }
}

fn op_kind(coll: Coll) -> oxccl::OpKind {
    use oxccl::OpKind;
    match coll {
        Coll::AllReduce => OpKind::AllReduce,
        Coll::AllGather => OpKind::AllGather,
        Coll::ReduceScatter => OpKind::ReduceScatter,
        Coll::Broadcast => OpKind::Broadcast,
        Coll::Reduce => OpKind::Reduce,
        Coll::SendRecv => OpKind::Send,
        Coll::AllToAll => OpKind::AllToAll,
    }
}

/// The sizes to run, in bytes: `--sizes`, else from `-b` by `-f` or `-i`
/// up to `-e`.
fn size_list(a: &Args) -> Vec<usize> {
    match &a.sizes {
        Some(list) => list.clone(),
        None => {
            std::iter::successors(Some(a.min_bytes), |&s| a.step.next(s, a.max_bytes)).collect()
        }
    }
}

/// nccl-tests' element count for `size` bytes: the whole buffer, rounded
/// down to a multiple of the ranks where each rank holds a block.
fn count_for(a: &Args, size: usize, elem: usize, n: usize) -> usize {
    let unit = if a.coll.per_rank() { elem * n } else { elem };
    (size / unit) * unit / elem
}

/// One table line, nccl-tests' columns plus the algorithm. The count
/// column is nccl-tests' too: elements per rank for the collectives where
/// each rank holds a block (all-gather's input, reduce-scatter's output,
/// all-to-all's block), of `n` ranks.
fn print_row(a: &Args, row: &Row, n: usize) {
    let mut cols = String::new();
    for k in 0..2 {
        let wrong = if a.check {
            row.wrong[k].to_string()
        } else {
            "N/A".into()
        };
        if k >= a.coll.variants(&a.backend).len() {
            cols += &format!("  {:>7}  {:>6}  {:>6}  {:>5}", "N/A", "N/A", "N/A", "N/A");
            continue;
        }
        cols += &format!(
            "  {:7.2}  {:6.2}  {:6.2}  {:>5}",
            row.time_us[k], row.algbw[k], row.busbw[k], wrong
        );
    }
    println!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}{cols}  {:>8}",
        row.bytes,
        a.coll.shown_count(row.count, n),
        row.dtype,
        row.redop,
        row.root,
        row.algo
    );
}

/// Sweeps the sizes for `a`'s type, reduction and root, adding the rows
/// to `result`.
fn bench<T: Element>(
    comm: &mut Communicator,
    a: &Args,
    result: &mut RunResult,
) -> oxccl::Result<()> {
    let n = comm.world_size();
    let elem = std::mem::size_of::<T>();
    let mut last_count = usize::MAX;
    for size in size_list(a) {
        let count = count_for(a, size, elem, n);
        if count == last_count {
            continue;
        }
        last_count = count;
        let bytes = count * elem;
        let algo = comm
            .algorithm_for_reduction::<T>(op_kind(a.coll), a.op, bytes)
            .to_string();
        let mut row = new_row(a, bytes, count, algo);
        let variants = a.coll.variants(&a.backend);
        for (k, &in_place) in variants.iter().enumerate() {
            let s = measure::<T>(comm, a, count, in_place)?;
            if a.shared {
                // What actually ran: zero copy needs every rank's buffers
                // in one allocation, which the prediction cannot see.
                if let Some(direct) = s.direct {
                    row.algo = direct.to_string();
                }
            }
            let algbw = bytes as f64 / s.time_us / 1e3;
            let busbw = algbw * a.coll.bus_factor(n);
            (row.time_us[k], row.algbw[k], row.busbw[k], row.wrong[k]) =
                (s.time_us, algbw, busbw, s.wrong);
        }
        if comm.rank() == 0 {
            print_row(a, &row, n);
        }
        result.push(row, variants.len());
    }
    Ok(())
}

/// Evaluates `$body` with `$T` the element type that `$dtype` names, or
/// `$unsupported` (evaluated only then) for a type this build cannot run.
macro_rules! with_element_type {
    ($dtype:expr, $unsupported:expr, |$T:ident| $body:expr) => {
        match $dtype {
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U64 => {
                type $T = u64;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            _ => $unsupported,
        }
    };
}
// For `device` (declared above the macro, so out of its textual scope).
#[cfg(feature = "cuda")]
use with_element_type;

/// Every sweep `-d`, `-o` and `-r` ask for ([`combinations`]), on one
/// communicator, as one run (one table, one footer).
fn bench_all(comm: &mut Communicator, a: &Args) -> oxccl::Result<RunResult> {
    let mut result = RunResult::new(comm.rank(), comm.world_size(), comm.transport_description());
    for one in combinations(a, comm.world_size()) {
        let rank = comm.rank();
        with_element_type!(
            one.dtype,
            Err(oxccl::Error::InvalidArgument {
                op: op_kind(one.coll),
                rank,
                arg: "datatype",
                reason: format!("{} is not an element type this benchmark runs", one.dtype),
            }),
            |T| bench::<T>(comm, &one, &mut result)
        )?;
    }
    result.transport_at_end = comm.transport_description();
    Ok(result)
}

/// Whether a launcher started this process as one rank of a job.
fn under_launcher() -> bool {
    oxccl::bootstrap::LaunchEnv::launcher_present()
}

/// The table's header, printed by rank 0 once it knows the transport.
fn print_header(a: &Args, ranks: usize, what: &str, transport: &str) {
    println!(
        "# oxccl-perf: collective {:?}, {ranks} ranks ({what}), backend {}, transport {transport}",
        a.coll, a.backend
    );
    // `--sizes` replaces -b, -e and the step: the header names its list.
    let sizes = match &a.sizes {
        Some(list) => format!(
            "sizes: {}",
            list.iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
        None => format!(
            "minBytes {} maxBytes {} step: {}",
            a.min_bytes,
            a.max_bytes,
            a.step.describe()
        ),
    };
    println!(
        "#  {sizes} warmup iters: {} iters: {} {} validation: {}",
        a.warmup,
        a.iters,
        if a.samples > 1 {
            format!("(median of {} samples)", a.samples)
        } else {
            "(mean)".to_string()
        },
        u8::from(a.check)
    );
    // The roots do not matter here: the sweeps of each type and reduction.
    let sweeps = combinations(a, 1);
    for one in sweeps.iter().filter(|_| a.check && a.coll.reduces()) {
        let (dtype, op) = (one.dtype, one.op);
        let premultiplied = a.backend != "host" || dtype.avg_premultiplies_on_host();
        if oxccl::check::exactly_checkable(dtype, op, ranks, premultiplied) {
            continue;
        }
        let why = if op == ReduceOp::Avg
            && oxccl::check::exactly_checkable(dtype, ReduceOp::Sum, ranks, premultiplied)
        {
            "is premultiplied, and its rounding could hide a missing rank"
        } else {
            "rounds by the order it folds in (no closed form)"
        };
        println!(
            "# check: {} {} over {ranks} ranks {why}: reduced values are not checked, moved \
             ones are",
            dtype.name(),
            op.name()
        );
    }
    println!("#");
    println!("#{:>61}{:>35}", "out-of-place", "in-place");
    println!("#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  {:>5}  {:>8}", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "algo");
    println!("#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  {:>5}  {:>8}", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "");
}

/// The host communicators' settings: the environment's, with `-T`'s
/// timeout over `OXCCL_TIMEOUT`.
fn comm_builder(a: &Args) -> oxccl::CommBuilder {
    let builder = Communicator::builder();
    match a.timeout {
        Some(timeout) => builder.timeout(timeout),
        None => builder,
    }
}

/// This process is one rank of a launched job.
fn run_as_rank(a: &Args) -> Result<RunResult, String> {
    let mut comm = comm_builder(a).from_env().map_err(|e| e.to_string())?;
    if comm.rank() == 0 {
        let transport = comm.transport_description();
        print_header(a, comm.world_size(), "processes", &transport);
    }
    bench_all(&mut comm, a).map_err(|e| {
        // Most errors name their rank already.
        let (rank, text) = (comm.rank(), e.to_string());
        if text.starts_with(&format!("rank {rank}:")) {
            text
        } else {
            format!("rank {rank}: {text}")
        }
    })
}

/// The host backend's run: this process as one rank under a launcher,
/// else `-t` ranks as its threads.
fn run_on_host(a: &Args) -> Result<RunResult, String> {
    if under_launcher() {
        return run_as_rank(a);
    }
    print_header(a, a.ranks, "threads", "in-process");
    let comms = comm_builder(a)
        .local_group(a.ranks)
        .map_err(|e| e.to_string())?;
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            let a = a.clone();
            std::thread::spawn(move || {
                // One core each when there are enough (`--bind-to core`): a rank
                // is one thread here.
                oxccl::launch::bind_thread_like_a_rank(comm.rank(), comm.world_size());
                bench_all(&mut comm, &a).map_err(|e| e.to_string())
            })
        })
        .collect();
    let mut out = Err("no ranks".to_string());
    for (rank, h) in handles.into_iter().enumerate() {
        let r = h.join().map_err(|_| format!("rank {rank} panicked"))?;
        if rank == 0 || r.is_err() {
            out = r;
        }
    }
    out
}

/// `--backend nccl|cuda-ring`: the same table on GPU buffers.
#[cfg(feature = "cuda")]
fn run_on_gpus(a: &Args) -> Result<RunResult, String> {
    device::run(a)
}

#[cfg(not(feature = "cuda"))]
fn run_on_gpus(_: &Args) -> Result<RunResult, String> {
    Err(
        "this oxccl-perf was built without GPU support: rebuild with \
         `cargo build --release --features nccl`"
            .into(),
    )
}

fn main() -> ExitCode {
    // Like the C tools it stands beside: a reader that goes away (`| head`)
    // ends the process quietly instead of a panic in `println!`.
    // SAFETY: setting a signal's disposition to the default is async-safe
    // and happens before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("oxccl-perf: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if a.plot_only {
        return plot_only(&a);
    }
    if let Some(n) = a.processes.filter(|_| !under_launcher()) {
        return launch_self(n);
    }
    let result = if a.backend != "host" {
        run_on_gpus(&a)
    } else {
        run_on_host(&a)
    };
    match result {
        // Only rank 0 prints the footer and writes the files (under
        // mpirun or srun too, where RANK is not set).
        Ok(run) if run.rank != 0 => {
            if run.wrong == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Ok(run) => {
            println!(
                "# Out of bounds values : {} {}",
                run.wrong,
                if run.wrong == 0 { "OK" } else { "FAILED" }
            );
            let avg_busbw = if run.busbw_count > 0 {
                run.busbw_sum / run.busbw_count as f64
            } else {
                0.0
            };
            // nccl-tests' health check: below 90 % of NCCL_TESTS_MIN_BW fails.
            let too_slow = a.min_busbw.is_some_and(|min| avg_busbw < 0.9 * min);
            println!(
                "# Avg bus bandwidth    : {avg_busbw:.4}{}",
                match a.min_busbw {
                    None => "",
                    Some(_) if too_slow => " FAILED",
                    Some(_) => " OK",
                }
            );
            if run.transport_at_end != run.transport {
                println!("# Transport at the end : {}", run.transport_at_end);
            }
            println!("#");
            if let Err(e) = write_outputs(&a, &run) {
                eprintln!("oxccl-perf: {e}");
                return ExitCode::FAILURE;
            }
            if run.wrong == 0 && !too_slow {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("oxccl-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The run's name in JSON and plots.
fn run_label(a: &Args, run: &RunResult) -> String {
    a.label.clone().unwrap_or_else(|| {
        format!(
            "oxccl {} {} {}x{} {}",
            a.coll.name(),
            dtypes_text(a),
            run.ranks,
            if a.processes.is_some() || under_launcher() {
                "proc"
            } else {
                "thread"
            },
            run.transport
        )
    })
}

/// `-d`'s types as the labels name them: `float`, `half,float` or `all`.
fn dtypes_text(a: &Args) -> String {
    list_text(&a.dtypes, &DType::ALL, DType::name)
}

/// `-o`'s reductions likewise.
fn ops_text(a: &Args) -> String {
    list_text(&a.ops, &ReduceOp::ALL, ReduceOp::name)
}

/// Reads the `--compare` runs (a series for each sweep in each).
fn compare_runs(a: &Args) -> Result<Vec<report::Series>, String> {
    let mut series = Vec::new();
    for file in &a.compare {
        let text = std::fs::read_to_string(file).map_err(|e| format!("reading {file}: {e}"))?;
        series.extend(report::parse_json(&text).map_err(|e| format!("{file}: {e}"))?);
    }
    Ok(series)
}

/// `-J` and `--plot`, on rank 0 after a run.
fn write_outputs(a: &Args, run: &RunResult) -> Result<(), String> {
    let label = run_label(a, run);
    let json = report::to_json(&label, a, run);
    if let Some(path) = &a.json {
        std::fs::write(path, &json).map_err(|e| format!("writing {path}: {e}"))?;
        println!("# JSON written to {path}");
    }
    if let Some(path) = &a.plot {
        let mut series = report::parse_json(&json)?;
        series.extend(compare_runs(a)?);
        std::fs::write(path, report::svg(&series)).map_err(|e| format!("writing {path}: {e}"))?;
        println!("# plot written to {path}");
    }
    Ok(())
}

/// `--plot-only`: draws the `--compare` runs.
fn plot_only(a: &Args) -> ExitCode {
    let Some(path) = &a.plot else {
        eprintln!("oxccl-perf: --plot-only needs --plot <file.svg>");
        return ExitCode::from(2);
    };
    let series = match compare_runs(a) {
        Ok(s) if !s.is_empty() => s,
        Ok(_) => {
            eprintln!("oxccl-perf: --plot-only needs at least one --compare <file.json>");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("oxccl-perf: {e}");
            return ExitCode::FAILURE;
        }
    };
    match std::fs::write(path, report::svg(&series)) {
        Ok(()) => {
            println!("# plot written to {path}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("oxccl-perf: writing {path}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `-np N`: runs N copies of this program (without `-np`) as the ranks of
/// one job on this host, through the same launcher as `oxccl-run`.
fn launch_self(n: usize) -> ExitCode {
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("oxccl-perf: cannot find its own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut argv = std::env::args_os().skip(1);
    while let Some(arg) = argv.next() {
        if arg == "-np" {
            argv.next();
        } else {
            args.push(arg);
        }
    }
    let mut spec = oxccl::launch::LaunchSpec::new(program);
    spec.args = args;
    spec.nproc_per_node = n;
    // Only rank 0 prints the table; other ranks print only errors.
    spec.prefix_output = false;
    if let Some(port) = std::env::var("MASTER_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
    {
        spec.master_port = port;
    } else if let Some(port) = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .ok()
        .map(|a| a.port())
    {
        // A free port, so that several benchmarks can run side by side.
        spec.master_port = port;
    }
    match oxccl::launch::launch(&spec) {
        Ok(report) => ExitCode::from(report.exit_code().clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("oxccl-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::median_sample;

    #[test]
    fn the_median_sample_is_the_middle_one_or_the_upper_of_two() {
        assert_eq!(median_sample(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_sample(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
        assert_eq!(median_sample(&mut [5.0]), 5.0);
    }
}
