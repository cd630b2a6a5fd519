//! Starting the ranks of a job on one node: the library behind `oxccl-run`.
//!
//! [`launch`] does on one node what `torchrun --no-python` or `mpirun` does:
//! it starts [`LaunchSpec::nproc_per_node`] copies of a program with the
//! environment the [`bootstrap`](crate::bootstrap) reads (torchrun's
//! names: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, plus
//! `OXCCL_JOB_ID`), prefixes their output with `[rank R] `, and supervises
//! them: when one rank fails, the others are stopped (`SIGTERM`, then
//! `SIGKILL` after [`LaunchSpec::kill_grace`]), so a job never hangs on a
//! dead peer; nor on a rank that outlives `SIGKILL` (stuck in the kernel):
//! after [`REAP_AFTER_KILL`] it is named, with what it waits in, and left
//! ([`RankExit::Unreaped`]). `SIGINT`, `SIGTERM` and `SIGHUP` sent to the
//! launcher are forwarded to every rank, except those from the terminal
//! (Ctrl-C, a hang-up), which the ranks, in the launcher's process group,
//! get themselves (then the kill grace runs as after a forward). Children
//! are killed by the kernel if the launcher dies (`PR_SET_PDEATHSIG`).
//!
//! ```no_run
//! use oxccl::launch::{launch, LaunchSpec};
//! let mut spec = LaunchSpec::new("./train");
//! spec.nproc_per_node = 4;
//! let report = launch(&spec)?;
//! std::process::exit(report.exit_code());
//! # Ok::<(), oxccl::Error>(())
//! ```

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::types::Rank;

/// torchrun's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Default rendezvous address (a single-node job).
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// Default time the ranks get between `SIGTERM` and `SIGKILL` when a job is stopped.
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(5);

/// The environment variable that names a job; inherited by the ranks, and
/// used to name (and clean up) the job's shared-memory segments.
pub const JOB_ID_VAR: &str = "OXCCL_JOB_ID";

/// How often the supervisor checks its children and pending signals.
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// How often the launcher records the processes below its ranks
/// ([`Job::below_ranks`]); also before every signal it sends.
const SURVEY_INTERVAL: Duration = Duration::from_millis(200);
/// How long the launcher waits for ranks it sent `SIGKILL` to vanish. A
/// process in uninterruptible sleep ignores even that until the kernel
/// call it is in returns, which may be never; past this the launcher names
/// it, with what it waits in, and finishes without it (the process stays
/// the kernel's to reap once it leaves that call).
pub const REAP_AFTER_KILL: Duration = Duration::from_secs(10);
/// Longer kill graces are treated as this (a year).
const MAX_KILL_GRACE: Duration = Duration::from_secs(365 * 24 * 3600);
/// A line longer than this is printed in pieces (progress bars that redraw
/// with `\r` never end a line).
const MAX_LINE: usize = 64 * 1024;

/// What to start, and how, on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Ranks started on this node (at least 1).
    pub nproc_per_node: usize,
    /// Nodes in the job (at least 1); every node runs `nproc_per_node` ranks.
    pub nnodes: usize,
    /// This node's index, below `nnodes`; its ranks are
    /// `node_rank * nproc_per_node ..` `(node_rank + 1) * nproc_per_node`.
    pub node_rank: usize,
    /// Address of node 0, where rank 0 hosts the rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store on node 0 (1..=65535).
    pub master_port: u16,
    /// The program every rank runs (looked up on `PATH` if it has no `/`).
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Variables set for every rank after the launcher's own (they win).
    pub extra_env: Vec<(OsString, OsString)>,
    /// Pipe each rank's stdout and stderr and re-print every line prefixed
    /// with `[rank R] `; when false the ranks write straight to the
    /// launcher's stdout and stderr.
    pub prefix_output: bool,
    /// How long stopped ranks get between `SIGTERM` (or a forwarded signal)
    /// and `SIGKILL`.
    pub kill_grace: Duration,
    /// Whether each rank is bound to one CPU (mpirun's `--bind-to`).
    pub bind: Bind,
    /// Make this process a child subreaper while the job runs, so that a
    /// process whose parent below a rank ended is adopted by it rather
    /// than by init: stopping the job then still reaches it, and every
    /// adopted process that ends is reaped. For a process that does
    /// nothing but launch (`oxccl-run` sets it); a host program with
    /// children of its own should leave it off, since any orphan of those
    /// is adopted and reaped too. Off: stopping reaches the processes
    /// still below a rank.
    pub adopt_orphans: bool,
}

/// CPU binding of the ranks a launcher starts (mpirun's `--bind-to`).
///
/// Bound ranks stay on their core: the scheduler cannot stack two
/// spinning ranks on one CPU while another idles (which costs a shared
/// memory collective 10-50x in latency), and caches stay warm. Like Open
/// MPI, binding is the default when there are at least as many CPUs as
/// local ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bind {
    /// When the launcher may use at least `nproc_per_node` CPUs, each
    /// local rank gets its own share of them (`n / nproc`, the last
    /// `n % nproc` ranks one more), whole cores where there are at least as
    /// many cores as ranks (a core's hardware threads, numbered apart by
    /// Linux, stay together), so no two ranks share a core and each rank's
    /// own threads (a framework's intra-op pool, data loaders) have its
    /// whole share, not one core; else `None`. With as many CPUs as ranks,
    /// as `Core`.
    #[default]
    Auto,
    /// Local rank `i` runs on the `i`-th CPU the launcher may use (modulo
    /// their number).
    Core,
    /// No binding: the scheduler places the ranks.
    None,
}

impl Bind {
    /// Parses `auto`, `core` or `none`.
    pub fn from_name(name: &str) -> Option<Bind> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Bind::Auto),
            "core" => Some(Bind::Core),
            "none" => Some(Bind::None),
            _ => None,
        }
    }
}

/// Binds the calling thread to the `local_rank`-th CPU this process may
/// use, as [`Bind::Core`] does for launched ranks: only when there are at
/// least `local_world` such CPUs. Returns whether it bound. For ranks run
/// as threads (`oxccl-perf -t`, benches), which no launcher places.
pub fn bind_thread_like_a_rank(local_rank: usize, local_world: usize) -> bool {
    let cpus = allowed_cpus();
    if cpus.is_empty() || local_world > cpus.len() {
        return false;
    }
    // SAFETY: a zeroed cpu_set_t is valid; pid 0 is the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus[local_rank % cpus.len()], &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The CPUs `bind` gives local rank `local_rank` of `local_world` out of
/// the launcher's `cpus`; empty for no binding. `core_of(cpu)` names the
/// physical core a CPU is a hardware thread of (see [`cpu_core`]).
pub fn rank_cpus(
    bind: Bind,
    cpus: &[usize],
    core_of: impl Fn(usize) -> Option<(u32, u32)>,
    local_rank: usize,
    local_world: usize,
) -> Vec<usize> {
    match bind {
        _ if cpus.is_empty() || local_world == 0 => Vec::new(),
        Bind::None => Vec::new(),
        Bind::Core => vec![cpus[local_rank % cpus.len()]],
        Bind::Auto if local_world > cpus.len() => Vec::new(),
        Bind::Auto => {
            // Slice i of w: [i·n/w, (i+1)·n/w), every item used once.
            let slice = |n: usize| local_rank * n / local_world..(local_rank + 1) * n / local_world;
            // Whole cores when every CPU's core is known and there are
            // enough: Linux numbers a core's second thread far from its
            // first (cpu0 and cpu8 on 8 cores), so slicing by number would
            // give two ranks the two threads of every core.
            let mut cores: Vec<((u32, u32), Vec<usize>)> = Vec::new();
            for &cpu in cpus {
                let Some(core) = core_of(cpu) else {
                    return cpus[slice(cpus.len())].to_vec();
                };
                match cores.iter_mut().find(|(c, _)| *c == core) {
                    Some((_, threads)) => threads.push(cpu),
                    None => cores.push((core, vec![cpu])),
                }
            }
            if cores.len() < local_world {
                return cpus[slice(cpus.len())].to_vec();
            }
            cores[slice(cores.len())]
                .iter()
                .flat_map(|(_, threads)| threads.iter().copied())
                .collect()
        }
    }
}

/// The (package, core) `cpu` is a hardware thread of, from sysfs; `None`
/// where the system does not say.
pub fn cpu_core(cpu: usize) -> Option<(u32, u32)> {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{cpu}/topology/{name}"))
            .ok()?
            .trim()
            .parse::<u32>()
            .ok()
    };
    Some((read("physical_package_id")?, read("core_id")?))
}

/// The CPUs this process may run on (its affinity), in order; empty if
/// the system call fails. `oxccl-run` binds ranks to these.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

impl LaunchSpec {
    /// One rank of `program` on one node, with the defaults of `oxccl-run`:
    /// `127.0.0.1:29500`, prefixed output, a 5 s kill grace.
    pub fn new(program: impl Into<OsString>) -> Self {
        LaunchSpec {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: DEFAULT_MASTER_ADDR.into(),
            master_port: DEFAULT_MASTER_PORT,
            program: program.into(),
            args: Vec::new(),
            extra_env: Vec::new(),
            prefix_output: true,
            kill_grace: DEFAULT_KILL_GRACE,
            bind: Bind::Auto,
            adopt_orphans: false,
        }
    }

    /// Ranks in the whole job: `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes.saturating_mul(self.nproc_per_node)
    }

    /// The global rank of local rank `local_rank` on this node.
    pub fn global_rank(&self, local_rank: usize) -> Rank {
        self.node_rank * self.nproc_per_node + local_rank
    }

    /// Checks the layout and the program.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the field when `nproc_per_node` or `nnodes`
    /// is 0, `node_rank >= nnodes`, `master_port` is 0, the world size
    /// overflows or exceeds 65536, or `program` is empty.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, value: String, reason: &str| {
            Err(Error::Config {
                name: name.into(),
                value,
                reason: reason.into(),
            })
        };
        if self.nproc_per_node == 0 {
            return bad(
                "nproc_per_node",
                "0".into(),
                "expected at least 1 rank per node",
            );
        }
        if self.nnodes == 0 {
            return bad("nnodes", "0".into(), "expected at least 1 node");
        }
        if self.node_rank >= self.nnodes {
            return bad(
                "node_rank",
                self.node_rank.to_string(),
                &format!("must be below nnodes ({})", self.nnodes),
            );
        }
        match self.nnodes.checked_mul(self.nproc_per_node) {
            None => {
                return bad(
                    "nproc_per_node",
                    self.nproc_per_node.to_string(),
                    "nnodes * nproc_per_node overflows",
                )
            }
            // Checked here, before any rank starts: every rank would fail
            // its own world-size check, after a fork each.
            Some(world) if world > crate::bootstrap::MAX_WORLD_SIZE => {
                return bad(
                    "nproc_per_node",
                    self.nproc_per_node.to_string(),
                    &format!(
                        "nnodes * nproc_per_node = {world}, above the largest world size, {}",
                        crate::bootstrap::MAX_WORLD_SIZE
                    ),
                )
            }
            Some(_) => {}
        }
        if self.master_port == 0 {
            return bad("master_port", "0".into(), "expected a port in 1..=65535");
        }
        if self.program.is_empty() {
            return bad("program", String::new(), "no program to run");
        }
        Ok(())
    }

    /// The job id the ranks will see: `OXCCL_JOB_ID` from `extra_env`, else
    /// from the launcher's environment, else (several nodes) a hash of
    /// `master_addr:master_port` and, under Slurm, the job and step ids
    /// (`SLURM_JOB_ID`, `SLURM_STEP_ID`), which every node of a step computes
    /// alike and consecutive jobs on one address do not, else (one node) a
    /// random 16-hex-digit id.
    pub fn job_id(&self) -> String {
        self.job_id_with(|name| std::env::var_os(name))
    }

    /// [`job_id`](Self::job_id), reading the launcher's environment through
    /// `var`.
    fn job_id_with(&self, var: impl Fn(&str) -> Option<std::ffi::OsString>) -> String {
        if let Some((_, v)) = self
            .extra_env
            .iter()
            .rev()
            .find(|(k, _)| k.as_os_str() == OsStr::new(JOB_ID_VAR))
            .filter(|(_, v)| !v.to_string_lossy().trim().is_empty())
        {
            return v.to_string_lossy().trim().to_owned();
        }
        // Trimmed, and empty counts as unset, as the ranks read it
        // (`LaunchEnv`): the clean-up looks for the names the ranks gave
        // their segments, and an empty id would turn off the check that a
        // launcher started them.
        if let Some(v) = var(JOB_ID_VAR).filter(|v| !v.to_string_lossy().trim().is_empty()) {
            return v.to_string_lossy().trim().to_owned();
        }
        if self.nnodes > 1 {
            // Without the scheduler's ids, two jobs given the same address
            // and port one after the other would share an id, and the
            // first's clean-up could remove the second's segments on a
            // node where the second had started already.
            let scheduler: Vec<String> = ["SLURM_JOB_ID", "SLURM_STEP_ID"]
                .iter()
                .filter_map(|name| var(name))
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            let mut key = format!("{}:{}", self.master_addr, self.master_port);
            if !scheduler.is_empty() {
                key = format!("{key}:{}", scheduler.join("."));
            }
            format!("{:016x}", fnv1a(key.as_bytes()))
        } else {
            format!("{:016x}", random_u64())
        }
    }
}

/// How a rank ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RankExit {
    /// It exited with this status.
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
    /// It was still there [`REAP_AFTER_KILL`] after `SIGKILL` (stuck in
    /// the kernel: uninterruptible sleep on a dead NFS server, a wedged
    /// driver call), and the launcher stopped waiting for it.
    Unreaped,
}

impl RankExit {
    /// Whether it exited with status 0.
    pub fn success(self) -> bool {
        self == RankExit::Code(0)
    }

    /// The shell's exit code for it: the status, or `128 + signal`, in 0..=255.
    pub fn shell_code(self) -> i32 {
        match self {
            RankExit::Code(0) => 0,
            RankExit::Code(c) if (1..=255).contains(&c) => c,
            RankExit::Code(_) => 1,
            RankExit::Signal(s) => (128 + s).clamp(1, 255),
            // It was sent SIGKILL, as a shell reports a killed job.
            RankExit::Unreaped => 128 + libc::SIGKILL,
        }
    }

    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => RankExit::Code(code),
            (None, Some(sig)) => RankExit::Signal(sig),
            (None, None) => RankExit::Code(1),
        }
    }
}

impl fmt::Display for RankExit {
    /// `exited with status 3` / `was killed by signal 9 (SIGKILL)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RankExit::Code(code) => write!(f, "exited with status {code}"),
            RankExit::Signal(sig) => match signal_name(sig) {
                Some(name) => write!(f, "was killed by signal {sig} ({name})"),
                None => write!(f, "was killed by signal {sig}"),
            },
            RankExit::Unreaped => write!(
                f,
                "was still running {}s after SIGKILL (not waited for)",
                REAP_AFTER_KILL.as_secs()
            ),
        }
    }
}

/// `SIGKILL` for 9 and so on, for the signals a job commonly dies of.
pub fn signal_name(sig: i32) -> Option<&'static str> {
    Some(match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    })
}

/// One rank of a finished launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankReport {
    /// Its global rank.
    pub rank: Rank,
    /// Its rank on this node.
    pub local_rank: usize,
    /// Its process id.
    pub pid: u32,
    /// How it ended.
    pub exit: RankExit,
}

/// The outcome of [`launch`]: every rank started on this node has ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchReport {
    /// The job id the ranks saw (`OXCCL_JOB_ID`).
    pub job_id: String,
    /// Every local rank, in local-rank order.
    pub ranks: Vec<RankReport>,
    /// The first rank seen to fail (non-zero status or a signal), before
    /// the launcher stopped the others; `None` if none failed on its own.
    pub first_failure: Option<(Rank, RankExit)>,
    /// The first of `SIGINT`, `SIGTERM`, `SIGHUP` the launcher received and
    /// forwarded, if any.
    pub interrupted: Option<i32>,
}

impl LaunchReport {
    /// The launcher's exit code: `128 + signal` if it was interrupted, else
    /// 0 if every rank exited 0, else the first failing rank's status (or
    /// `128 + signal` if a signal killed it).
    pub fn exit_code(&self) -> i32 {
        if let Some(sig) = self.interrupted {
            return RankExit::Signal(sig).shell_code();
        }
        if let Some((_, exit)) = self.first_failure {
            return exit.shell_code();
        }
        self.ranks
            .iter()
            .map(|r| r.exit.shell_code())
            .find(|&c| c != 0)
            .unwrap_or(0)
    }

    /// Whether every rank exited 0 and the launcher was not interrupted.
    pub fn success(&self) -> bool {
        self.exit_code() == 0
    }
}

/// Runs a job's ranks on this node and waits until every one has ended.
///
/// In order: validates `spec`; on node 0, checks that `master_port` is free
/// (rank 0 will host the rendezvous store there); installs handlers that
/// forward `SIGINT`, `SIGTERM` and `SIGHUP` to the ranks; starts the ranks;
/// supervises them (see the [module docs](self)); removes the job's leftover
/// shared-memory segments (`/dev/shm/oxccl-{job_id}-*`); restores the
/// signal handlers. Progress and failures are reported on stderr, prefixed
/// `oxccl-run: `.
///
/// Call it from a thread that outlives the job (the main thread):
/// `PR_SET_PDEATHSIG` fires when the *thread* that started a child exits.
/// Only one launch should run in a process at a time (the signal handlers
/// are process-wide).
///
/// # Errors
///
/// - [`Error::Config`] when `spec` fails [`LaunchSpec::validate`].
/// - [`Error::Bootstrap`] when the port is in use on node 0 (nothing is
///   started), or when a rank cannot be started (the program is missing or
///   not executable; the ranks already started are stopped first).
///
/// A rank that fails is not an error: it is in the [`LaunchReport`].
pub fn launch(spec: &LaunchSpec) -> Result<LaunchReport> {
    spec.validate()?;
    // A job of one rank hosts no store (unless told to use a file store,
    // which takes no port either): two such jobs may share the port.
    if spec.node_rank == 0 && spec.world_size() > 1 {
        check_port_free(spec.master_port)?;
    }
    let job_id = spec.job_id();
    let _signals = SignalGuard::install();
    let _subreaper = spec.adopt_orphans.then(SubreaperGuard::install);
    let mut job = Job::new(spec);

    let outcome = job.spawn_all(spec, &job_id).map(|()| job.supervise());
    if outcome.is_err() {
        job.stop_all();
    }
    job.finish_output();
    // Adopted processes that have ended since the last look.
    job.survey();
    remove_shm_segments(&job_id);
    let interrupted = outcome?;

    Ok(LaunchReport {
        job_id,
        ranks: job
            .procs
            .iter()
            .map(|p| RankReport {
                rank: p.rank,
                local_rank: p.local_rank,
                pid: p.pid,
                exit: p.exit.unwrap_or(RankExit::Code(1)),
            })
            .collect(),
        first_failure: job.first_failure,
        interrupted,
    })
}

/// Fails if `port` cannot be bound on all interfaces.
fn check_port_free(port: u16) -> Result<()> {
    let context = format!("oxccl-run: node 0 hosts the rendezvous store on port {port}");
    match TcpListener::bind(("0.0.0.0", port)) {
        Ok(listener) => {
            drop(listener);
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Err(Error::Bootstrap {
            context,
            detail: format!(
                "port {port} is already in use (another job, or an earlier run still \
                 exiting?); choose another --master-port"
            ),
        }),
        Err(e) => Err(Error::Bootstrap {
            context,
            detail: format!("cannot listen on port {port}: {e}; choose another --master-port"),
        }),
    }
}

/// One started rank.
struct Proc {
    rank: Rank,
    local_rank: usize,
    pid: u32,
    child: Child,
    exit: Option<RankExit>,
}

/// The ranks of one launch and their output readers.
struct Job {
    procs: Vec<Proc>,
    readers: Vec<JoinHandle<()>>,
    /// Set once every rank has been reaped: readers drain what is buffered and stop.
    output_done: Arc<AtomicBool>,
    first_failure: Option<(Rank, RankExit)>,
    kill_grace: Duration,
    /// What "kill" sends: `SIGKILL`; unit tests send a signal the ranks
    /// ignore, to stand for a rank that no signal ends.
    kill_signal: i32,
    /// How long ranks sent `kill_signal` get to vanish ([`REAP_AFTER_KILL`]).
    reap_after_kill: Duration,
    /// Processes seen below the ranks (their children, and theirs), so that
    /// stopping the job reaches them too, including those whose parent has
    /// ended since (the launcher, a child subreaper while it runs, adopts
    /// them): a rank that is a shell script running `python` without `exec`
    /// would otherwise leave `python` running, holding GPUs, shared memory
    /// and sockets. Looked at every [`SURVEY_INTERVAL`] and before each
    /// signal.
    below_ranks: std::collections::BTreeSet<u32>,
    last_survey: Option<Instant>,
    /// [`LaunchSpec::adopt_orphans`]: every child of this process that is
    /// not a rank is the job's, and is reaped when it ends.
    adopt_orphans: bool,
}

impl Job {
    fn new(spec: &LaunchSpec) -> Self {
        Job {
            procs: Vec::with_capacity(spec.nproc_per_node),
            readers: Vec::new(),
            output_done: Arc::new(AtomicBool::new(false)),
            first_failure: None,
            // Capped so that `now + grace` cannot overflow.
            kill_grace: spec.kill_grace.min(MAX_KILL_GRACE),
            kill_signal: libc::SIGKILL,
            reap_after_kill: REAP_AFTER_KILL,
            below_ranks: Default::default(),
            last_survey: None,
            adopt_orphans: spec.adopt_orphans,
        }
    }

    fn spawn_all(&mut self, spec: &LaunchSpec, job_id: &str) -> Result<()> {
        let launcher_pid = std::process::id() as libc::pid_t;
        let world = spec.world_size().to_string();
        let local_world = spec.nproc_per_node.to_string();
        let node_rank = spec.node_rank.to_string();
        let port = spec.master_port.to_string();
        let cpus = allowed_cpus();
        for local_rank in 0..spec.nproc_per_node {
            let rank = spec.global_rank(local_rank);
            let share = rank_cpus(spec.bind, &cpus, cpu_core, local_rank, spec.nproc_per_node);
            // Built here: the child may only make system calls before exec.
            let affinity = (!share.is_empty()).then(|| {
                // SAFETY: a zeroed cpu_set_t is valid; CPU_SET stays within
                // it for the CPUs sched_getaffinity reported.
                unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    for &cpu in &share {
                        libc::CPU_SET(cpu, &mut set);
                    }
                    set
                }
            });
            let mut cmd = Command::new(&spec.program);
            cmd.args(&spec.args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", &world)
                .env("LOCAL_RANK", local_rank.to_string())
                .env("LOCAL_WORLD_SIZE", &local_world)
                .env("GROUP_RANK", &node_rank)
                .env("NODE_RANK", &node_rank)
                .env("MASTER_ADDR", &spec.master_addr)
                .env("MASTER_PORT", &port)
                .env(JOB_ID_VAR, job_id);
            // `job_id` already holds extra_env's OXCCL_JOB_ID, trimmed.
            for (k, v) in spec
                .extra_env
                .iter()
                .filter(|(k, _)| k.as_os_str() != OsStr::new(JOB_ID_VAR))
            {
                cmd.env(k, v);
            }
            if spec.prefix_output {
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
            }
            // SAFETY: the closure runs in the forked child before exec and
            // calls only async-signal-safe functions (prctl, getppid, _exit,
            // sched_setaffinity) and plain memory writes on its stack.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    // The launcher may have died before the prctl took effect.
                    if libc::getppid() != launcher_pid {
                        libc::_exit(1);
                    }
                    if let Some(set) = &affinity {
                        // Best effort: a failed binding leaves the rank unbound.
                        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set);
                    }
                    Ok(())
                });
            }
            let mut child = cmd.spawn().map_err(|e| Error::Bootstrap {
                context: format!("oxccl-run: starting rank {rank}"),
                detail: format!(
                    "cannot run `{}`: {e}{}",
                    spec.program.to_string_lossy(),
                    if e.kind() == io::ErrorKind::NotFound && !has_slash(&spec.program) {
                        " (is it on PATH?)"
                    } else {
                        ""
                    }
                ),
            })?;
            let prefix = format!("[rank {rank}] ");
            let pipes = [
                (child.stdout.take().map(OwnedFd::from), Stream::Stdout),
                (child.stderr.take().map(OwnedFd::from), Stream::Stderr),
            ];
            // Recorded before its readers start, so that a failure to start
            // them stops it with the others (`stop_all`).
            self.procs.push(Proc {
                rank,
                local_rank,
                pid: child.id(),
                child,
                exit: None,
            });
            for (fd, stream) in pipes {
                let Some(fd) = fd else { continue };
                let reader = spawn_reader(fd, prefix.clone(), stream, self.output_done.clone())
                    .map_err(|e| Error::Bootstrap {
                        context: format!("oxccl-run: starting rank {rank}"),
                        detail: format!(
                            "cannot start a thread to read its output: {e} (a limit on \
                             threads or processes, such as pids.max or ulimit -u?)"
                        ),
                    })?;
                self.readers.push(reader);
            }
        }
        Ok(())
    }

    fn running(&self) -> usize {
        self.procs.iter().filter(|p| p.exit.is_none()).count()
    }

    /// Sends `sig` to every rank not yet reaped (its pid cannot have been
    /// reused) and to the processes below the ranks ([`Job::below_ranks`]).
    fn signal_running(&mut self, sig: i32) {
        let below = self.job_processes_below();
        let ranks = self
            .procs
            .iter()
            .filter(|p| p.exit.is_none())
            .map(|p| p.pid);
        for pid in ranks.chain(below) {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe {
                libc::kill(pid as libc::pid_t, sig);
            }
        }
    }

    /// The pids of the ranks not yet reaped.
    fn running_pids(&self) -> Vec<u32> {
        self.procs
            .iter()
            .filter(|p| p.exit.is_none())
            .map(|p| p.pid)
            .collect()
    }

    /// Records the processes now below the running ranks, forgets those
    /// that are gone, and reaps those the launcher adopted that have ended.
    fn survey(&mut self) {
        self.last_survey = Some(Instant::now());
        for p in self.procs.iter().filter(|p| p.exit.is_none()) {
            self.below_ranks.extend(descendants_of(p.pid));
        }
        let me = std::process::id();
        if self.adopt_orphans {
            // Orphans adopted between two looks were never recorded: reap
            // every child that is not a rank once it has ended, or each
            // would stay a zombie for the rest of the job.
            let ranks = self.running_pids();
            for pid in children_of_self() {
                // Ranks are std's `Child`ren, reaped by `reap`.
                if !ranks.contains(&pid) && is_zombie(pid) {
                    reap_child(pid);
                }
            }
        }
        self.below_ranks.retain(|&pid| match parent_of(pid) {
            None => false,
            // Adopted: ours to reap once it ends (a zombie until then).
            Some(parent) if parent == me => !reap_child(pid),
            Some(_) => true,
        });
    }

    /// [`survey`](Self::survey) when [`SURVEY_INTERVAL`] has passed.
    fn survey_if_due(&mut self) {
        if self
            .last_survey
            .is_none_or(|at| at.elapsed() >= SURVEY_INTERVAL)
        {
            self.survey();
        }
    }

    /// The recorded processes below the ranks that are still the job's: a
    /// pid is signalled only while its parent is a rank, another of them,
    /// or the launcher (which adopted it), so a pid reused by an unrelated
    /// process is left alone.
    fn job_processes_below(&mut self) -> Vec<u32> {
        self.survey();
        let me = std::process::id();
        let ranks = self.running_pids();
        self.below_ranks
            .iter()
            .copied()
            .filter(|&pid| {
                parent_of(pid).is_some_and(|parent| {
                    parent == me || ranks.contains(&parent) || self.below_ranks.contains(&parent)
                })
            })
            .collect()
    }

    /// Kills the ranks still running and reaps them, for at most
    /// `reap_after_kill`; a rank still there then is named and given up on
    /// ([`RankExit::Unreaped`]) so that the launcher finishes.
    fn kill_and_reap(&mut self) {
        self.signal_running(self.kill_signal);
        let deadline = Instant::now() + self.reap_after_kill;
        loop {
            self.reap_quietly();
            if self.running() == 0 {
                return;
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        for p in self.procs.iter_mut().filter(|p| p.exit.is_none()) {
            say(&format!(
                "rank {} (pid {}) is still running {:?} after SIGKILL ({}); not waiting for it",
                p.rank,
                p.pid,
                self.reap_after_kill,
                kernel_wait_of(p.pid)
            ));
            p.exit = Some(RankExit::Unreaped);
            self.first_failure
                .get_or_insert((p.rank, RankExit::Unreaped));
        }
    }

    /// [`reap`](Self::reap) where the caller reports the failures itself
    /// (the first one is still recorded).
    fn reap_quietly(&mut self) {
        for (rank, _, exit) in self.reap() {
            self.first_failure.get_or_insert((rank, exit));
        }
    }

    /// Reaps every rank that has ended; returns the newly failed ones.
    fn reap(&mut self) -> Vec<(Rank, u32, RankExit)> {
        let mut failed = Vec::new();
        for p in self.procs.iter_mut().filter(|p| p.exit.is_none()) {
            let exit = match p.child.try_wait() {
                Ok(Some(status)) => RankExit::from_status(status),
                Ok(None) => continue,
                // Cannot happen for our own unreaped child; count it as failed.
                Err(_) => RankExit::Code(1),
            };
            p.exit = Some(exit);
            if !exit.success() {
                failed.push((p.rank, p.pid, exit));
            }
        }
        failed
    }

    /// Watches the ranks until every one has ended. Returns the first signal
    /// the launcher received, if any.
    fn supervise(&mut self) -> Option<i32> {
        let mut interrupted = None;
        // When set, the ranks still running at that instant get SIGKILL.
        let mut kill_at: Option<Instant> = None;
        loop {
            let pending = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
            if pending != 0 {
                let sig = pending & !FROM_TERMINAL;
                interrupted.get_or_insert(sig);
                let running = self.running();
                let name = signal_name(sig).unwrap_or("a signal");
                if pending & FROM_TERMINAL != 0 {
                    // A second copy would cut short the ranks' own handling
                    // of the first (Python's KeyboardInterrupt, a flush).
                    say(&format!(
                        "interrupted by {name} from the terminal, which the {running} running \
                         rank{} got too",
                        plural(running)
                    ));
                } else {
                    say(&format!(
                        "interrupted by {name}; forwarding it to the {running} running rank{}",
                        plural(running)
                    ));
                    self.signal_running(sig);
                }
                kill_at.get_or_insert_with(|| Instant::now() + self.kill_grace);
            }

            self.survey_if_due();
            let mut failed = self.reap();
            // Ranks that find a dead peer exit within milliseconds of it, so
            // one pass can reap the victim and its witnesses together: a
            // rank killed by a signal is the likelier cause, so it goes first.
            failed.sort_by_key(|(rank, _, exit)| (matches!(exit, RankExit::Code(_)), *rank));
            let stopping = kill_at.is_some();
            for (rank, pid, exit) in failed {
                if self.first_failure.is_none() {
                    self.first_failure = Some((rank, exit));
                }
                if !stopping {
                    say(&format!("rank {rank} (pid {pid}) {exit}"));
                }
                if kill_at.is_none() {
                    let running = self.running();
                    if running > 0 {
                        say(&format!(
                            "stopping the other {running} rank{}",
                            plural(running)
                        ));
                    }
                    // The processes below the ranks get their SIGTERM even
                    // when no rank is left to stop (the failed one was the
                    // last): they too may clean up before the kill.
                    if running > 0 || !self.job_processes_below().is_empty() {
                        self.signal_running(libc::SIGTERM);
                    }
                    kill_at = Some(Instant::now() + self.kill_grace);
                }
            }

            // A stop also waits, within the same grace, for the processes
            // below the ranks (a shell's child that ignores SIGTERM outlives
            // the shell): at its end they get the kill too.
            if self.running() == 0 && (kill_at.is_none() || self.job_processes_below().is_empty()) {
                return interrupted;
            }
            if let Some(at) = kill_at {
                if Instant::now() >= at {
                    let running = self.running();
                    if running > 0 {
                        say(&format!(
                            "{running} rank{} still running after {:?}; killing {}",
                            plural(running),
                            self.kill_grace,
                            if running == 1 { "it" } else { "them" }
                        ));
                    } else {
                        let below = self.job_processes_below().len();
                        say(&format!(
                            "{below} process{} the ranks started still running after {:?}; \
                             killing {}",
                            if below == 1 { "" } else { "es" },
                            self.kill_grace,
                            if below == 1 { "it" } else { "them" }
                        ));
                    }
                    // Bounded: a rank that outlives SIGKILL is given up on.
                    self.kill_and_reap();
                    return interrupted;
                }
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Stops every running rank: `SIGTERM`, then `SIGKILL` after the grace;
    /// reaps them all.
    fn stop_all(&mut self) {
        self.reap();
        if self.running() == 0 {
            return;
        }
        self.signal_running(libc::SIGTERM);
        let deadline = Instant::now() + self.kill_grace;
        while self.running() > 0 && Instant::now() < deadline {
            std::thread::sleep(POLL_INTERVAL);
            self.reap();
        }
        if self.running() > 0 {
            self.kill_and_reap();
        }
    }

    /// Lets the readers print what the ranks wrote before they ended, then
    /// joins them. Output of processes the ranks left behind is not waited for.
    fn finish_output(&mut self) {
        self.output_done.store(true, Ordering::SeqCst);
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

/// Every process below `pid` (children, theirs, ...), from the kernel's
/// per-thread child lists (`/proc/PID/task/TID/children`); empty where
/// those cannot be read.
fn descendants_of(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut queue = vec![pid];
    // Bounded, in case pids are reused while the tree is read.
    while let Some(parent) = queue.pop() {
        if found.len() >= 65_536 {
            break;
        }
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Ok(list) = std::fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in list
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                if child != pid && !found.contains(&child) {
                    found.push(child);
                    queue.push(child);
                }
            }
        }
    }
    found
}

/// This process's children, from the kernel's per-thread child lists.
fn children_of_self() -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Reaps child `pid` if it has ended (never waits); whether it did.
fn reap_child(pid: u32) -> bool {
    let mut status = 0;
    // SAFETY: waitpid on one specific pid, a child of this process that no
    // `std::process::Child` owns (the callers pass no rank).
    unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) == pid as libc::pid_t }
}

/// Whether process `pid` has ended and waits to be reaped.
fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|at| stat[at + 1..].split_whitespace().next().map(|s| s == "Z"))
            .unwrap_or(false)
    })
}

/// The parent of process `pid`, from `/proc/PID/stat`; `None` when it is
/// gone (or a zombie's entry cannot be read).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name, which is in parentheses and may hold any
    // byte: the state, then the parent.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    fields.next()?;
    fields.next()?.parse().ok()
}

/// Makes the launcher a child subreaper while the job runs: a process whose
/// parent below a rank ends is adopted by the launcher instead of by init,
/// so stopping the job still reaches it ([`Job::below_ranks`]). Restores
/// the previous setting when dropped.
struct SubreaperGuard {
    previous: libc::c_int,
}

impl SubreaperGuard {
    fn install() -> SubreaperGuard {
        let mut previous: libc::c_int = 0;
        // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the pointer;
        // PR_SET_CHILD_SUBREAPER takes a flag. Failure leaves the setting as
        // it was (stopping then reaches the processes still below a rank).
        unsafe {
            libc::prctl(
                libc::PR_GET_CHILD_SUBREAPER,
                &mut previous as *mut libc::c_int,
            );
            libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong);
        }
        SubreaperGuard { previous }
    }
}

impl Drop for SubreaperGuard {
    fn drop(&mut self) {
        // SAFETY: as in `install`.
        unsafe {
            libc::prctl(libc::PR_SET_CHILD_SUBREAPER, self.previous as libc::c_ulong);
        }
    }
}

/// What a process is doing in the kernel, for a report on one that
/// outlives `SIGKILL`: its state letter (`D`: uninterruptible sleep) and
/// the kernel function it waits in, from `/proc`, as far as they can be read.
fn kernel_wait_of(pid: u32) -> String {
    // The state follows the command name, which is in parentheses and may
    // itself hold spaces or parentheses: read past the last ')'.
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let after = &stat[stat.rfind(')')? + 1..];
            after.split_whitespace().next().map(str::to_owned)
        });
    let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan"))
        .ok()
        .map(|w| w.trim().to_owned())
        .filter(|w| !w.is_empty() && w != "0");
    match (state, wchan) {
        (Some(state), Some(wchan)) => format!("state {state}, waiting in {wchan}"),
        (Some(state), None) => format!("state {state}"),
        (None, _) => "its state cannot be read".to_owned(),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

fn has_slash(program: &OsStr) -> bool {
    program.as_encoded_bytes().contains(&b'/')
}

/// Prints `oxccl-run: {msg}` on stderr as one write.
fn say(msg: &str) {
    let line = format!("oxccl-run: {msg}\n");
    let mut err = io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.flush();
}

#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// How long a reader goes on copying once every rank has ended: what the
/// ranks wrote is in the pipe by then; a process a rank left behind may
/// keep writing (and hold the pipe open) for ever.
const OUTPUT_DRAIN: Duration = Duration::from_secs(1);

/// Copies `fd` to the launcher's stdout or stderr line by line, each line
/// prefixed, until end of file, or once `done` is set until nothing more is
/// buffered or [`OUTPUT_DRAIN`] has passed.
fn spawn_reader(
    fd: OwnedFd,
    prefix: String,
    stream: Stream,
    done: Arc<AtomicBool>,
) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("oxccl-run-output".into())
        .spawn(move || {
            let raw = fd.as_raw_fd();
            let mut file = File::from(fd);
            let mut pending: Vec<u8> = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            let mut drain_until = None;
            loop {
                let finishing = done.load(Ordering::SeqCst);
                if finishing
                    && Instant::now()
                        >= *drain_until.get_or_insert_with(|| Instant::now() + OUTPUT_DRAIN)
                {
                    break;
                }
                let mut pfd = libc::pollfd {
                    fd: raw,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, owned by `file` for the whole call.
                let ready = unsafe { libc::poll(&mut pfd, 1, if finishing { 0 } else { 50 }) };
                if ready < 0 {
                    if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    break;
                }
                if ready == 0 {
                    if finishing {
                        break;
                    }
                    continue;
                }
                match file.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        pending.extend_from_slice(&buf[..n]);
                        if let Some(last_nl) = pending.iter().rposition(|&b| b == b'\n') {
                            let rest = pending.split_off(last_nl + 1);
                            emit(stream, &prefix, &pending);
                            pending = rest;
                        }
                        if pending.len() >= MAX_LINE {
                            pending.push(b'\n');
                            emit(stream, &prefix, &pending);
                            pending.clear();
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            if !pending.is_empty() {
                pending.push(b'\n');
                emit(stream, &prefix, &pending);
            }
        })
}

/// Writes complete lines (`text` ends with a newline), each prefixed, in
/// one locked write per line so lines of different ranks never mix.
fn emit(stream: Stream, prefix: &str, text: &[u8]) {
    let mut line = Vec::with_capacity(prefix.len() + 128);
    let write = |line: &[u8]| match stream {
        Stream::Stdout => {
            let mut out = io::stdout().lock();
            let _ = out.write_all(line);
            let _ = out.flush();
        }
        Stream::Stderr => {
            let mut err = io::stderr().lock();
            let _ = err.write_all(line);
            let _ = err.flush();
        }
    };
    for piece in text.split_inclusive(|&b| b == b'\n') {
        line.clear();
        line.extend_from_slice(prefix.as_bytes());
        line.extend_from_slice(piece);
        write(&line);
    }
}

/// Removes `/dev/shm/oxccl-{job_id}-*`: segments ranks that crashed during
/// setup could not unlink. Errors are ignored.
fn remove_shm_segments(job_id: &str) {
    // Named as the shared-memory transport names them.
    let prefix = format!("oxccl-{}-", crate::transport::shm::sanitize_job_id(job_id));
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.as_encoded_bytes().starts_with(prefix.as_bytes()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// 64-bit FNV-1a: stable across builds and platforms, so every node of a
/// job derives the same id.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    if File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_ok()
    {
        return u64::from_ne_bytes(bytes);
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    fnv1a(&(nanos ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes())
}

/// The last signal received and not yet forwarded (0: none), with
/// [`FROM_TERMINAL`] set when it came from the terminal. One word, so that
/// the supervisor reads a signal and where it came from together: a
/// terminal's signal landing between two separate reads must not mark a
/// `kill`'s as already delivered.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// In [`PENDING_SIGNAL`]: the signal came from the terminal (Ctrl-C, a
/// hang-up). The kernel sends those to the whole foreground process group,
/// and the ranks, which stay in the launcher's group, have it already.
const FROM_TERMINAL: i32 = 1 << 16;

/// Whether the launcher leads its session (`ssh -t host oxccl-run …`, a
/// tmux pane's command, `setsid`): a hang-up then reaches the session
/// leader alone (the foreground group gets it only once the leader
/// exits), so the launcher forwards it like any other signal. Set when
/// the handlers are installed.
static SESSION_LEADER: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: with SA_SIGINFO the kernel passes a valid siginfo_t (checked
    // for null all the same); reading a field is async-signal-safe.
    let from_kernel = !info.is_null() && unsafe { (*info).si_code } == libc::SI_KERNEL;
    let only_to_leader = sig == libc::SIGHUP && SESSION_LEADER.load(Ordering::SeqCst);
    let from_terminal = from_kernel && !only_to_leader;
    let flag = if from_terminal { FROM_TERMINAL } else { 0 };
    PENDING_SIGNAL.store(sig | flag, Ordering::SeqCst);
}

const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The forwarding handlers, installed for one launch; the previous ones are
/// restored on drop.
struct SignalGuard {
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

impl SignalGuard {
    fn install() -> Self {
        PENDING_SIGNAL.store(0, Ordering::SeqCst);
        // SAFETY: getsid and getpid only read this process's ids.
        let leader = unsafe { libc::getsid(0) == libc::getpid() };
        SESSION_LEADER.store(leader, Ordering::SeqCst);
        let mut previous = Vec::new();
        for sig in FORWARDED {
            // SAFETY: the sigaction structs are zero-initialised plain data,
            // and the handler only stores to an atomic (async-signal-safe).
            unsafe {
                // A signal the launcher was started with ignored (`nohup`
                // ignores SIGHUP, a shell's `&` SIGINT) stays ignored, here
                // and in the ranks, which inherit the disposition through
                // exec: a handler would undo it (handled signals go back to
                // the default at exec) and a logout would end the job.
                let mut current: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut current) == 0
                    && current.sa_sigaction == libc::SIG_IGN
                {
                    continue;
                }
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal
                    as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)
                    as usize;
                action.sa_flags = libc::SA_RESTART | libc::SA_SIGINFO;
                libc::sigemptyset(&mut action.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &action, &mut old) == 0 {
                    previous.push((sig, old));
                }
            }
        }
        // A launcher started with SIGCHLD ignored (inherited from a daemon
        // or a shell that set it) would have its ranks reaped by the
        // kernel: waiting for them then fails (ECHILD), and every rank that
        // ended read as failed. The default disposition keeps them ours.
        // SAFETY: as above; SIG_DFL installs no handler.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut action.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGCHLD, &action, &mut old) == 0 {
                previous.push((libc::SIGCHLD, old));
            }
        }
        SignalGuard { previous }
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        for (sig, old) in &self.previous {
            // SAFETY: restores an action that sigaction itself returned.
            unsafe {
                libc::sigaction(*sig, old, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` gives each local rank its own contiguous share of the CPUs,
    /// all of them used, not one core per rank (every thread of the rank
    /// would inherit that core); `core` one each; fewer CPUs than ranks or
    /// `none`: no binding.
    #[test]
    fn each_rank_gets_its_share_of_the_cpus() {
        let unknown = |_| None;
        let cpus: Vec<usize> = (10..20).collect();
        let shares: Vec<Vec<usize>> = (0..3)
            .map(|r| rank_cpus(Bind::Auto, &cpus, unknown, r, 3))
            .collect();
        assert_eq!(shares, [&cpus[0..3], &cpus[3..6], &cpus[6..10]]);
        assert_eq!(rank_cpus(Bind::Auto, &cpus, unknown, 0, 1), cpus);
        assert_eq!(rank_cpus(Bind::Auto, &[4, 5], unknown, 1, 2), [5]);
        assert!(rank_cpus(Bind::Auto, &[4, 5], unknown, 2, 3).is_empty());
        assert_eq!(rank_cpus(Bind::Core, &cpus, unknown, 12, 13), [12]);
        assert!(rank_cpus(Bind::None, &cpus, unknown, 0, 2).is_empty());
        assert!(rank_cpus(Bind::Core, &[], unknown, 0, 2).is_empty());
    }

    /// 8 cores of two hardware threads, numbered as Linux numbers them
    /// (cpu c and cpu c + 8 share core c): two ranks get four whole cores
    /// each, not the first and second threads of all eight; with more ranks
    /// than cores, threads are shared out by number.
    #[test]
    fn ranks_get_whole_cores_when_there_are_enough() {
        let cpus: Vec<usize> = (0..16).collect();
        let core_of = |cpu: usize| Some((0, (cpu % 8) as u32));
        let mut first = rank_cpus(Bind::Auto, &cpus, core_of, 0, 2);
        first.sort_unstable();
        assert_eq!(first, [0, 1, 2, 3, 8, 9, 10, 11]);
        let mut second = rank_cpus(Bind::Auto, &cpus, core_of, 1, 2);
        second.sort_unstable();
        assert_eq!(second, [4, 5, 6, 7, 12, 13, 14, 15]);
        assert_eq!(rank_cpus(Bind::Auto, &cpus, core_of, 9, 16), [9]);
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(RankExit::Code(0).shell_code(), 0);
        assert_eq!(RankExit::Code(3).shell_code(), 3);
        assert_eq!(RankExit::Signal(9).shell_code(), 137);
        assert_eq!(
            RankExit::Signal(9).to_string(),
            "was killed by signal 9 (SIGKILL)"
        );
        assert_eq!(RankExit::Code(3).to_string(), "exited with status 3");
    }

    /// A rank that no signal ends (here: one that ignores the signal the
    /// test sends for "kill", standing for a process stuck in the kernel)
    /// is given up on after `reap_after_kill`, named as unreaped, and the
    /// others are reaped as usual.
    #[test]
    fn a_rank_that_outlives_the_kill_is_given_up_on() {
        let spec = LaunchSpec::new("sh");
        let mut job = Job::new(&spec);
        job.kill_grace = Duration::from_millis(100);
        job.kill_signal = libc::SIGUSR2;
        job.reap_after_kill = Duration::from_millis(300);
        let start = |rank: Rank, script: &str| {
            let child = Command::new("sh").args(["-c", script]).spawn().unwrap();
            Proc {
                rank,
                local_rank: rank,
                pid: child.id(),
                child,
                exit: None,
            }
        };
        // Rank 0 fails once the others' shells are up (rank 1 must have
        // installed its traps); rank 1 ignores SIGTERM and the "kill";
        // rank 2 ends on SIGTERM.
        job.procs.push(start(0, "sleep 0.3; exit 3"));
        job.procs
            .push(start(1, "trap '' TERM USR2; while :; do sleep 0.05; done"));
        job.procs.push(start(2, "sleep 30"));
        let began = Instant::now();
        assert_eq!(job.supervise(), None);
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "{:?}",
            began.elapsed()
        );
        assert_eq!(job.procs[0].exit, Some(RankExit::Code(3)));
        assert_eq!(job.procs[1].exit, Some(RankExit::Unreaped));
        assert_eq!(job.procs[2].exit, Some(RankExit::Signal(libc::SIGTERM)));
        assert_eq!(job.first_failure, Some((0, RankExit::Code(3))));
        assert_eq!(RankExit::Unreaped.shell_code(), 137);
        // The same bound on the spawn-failure path.
        let mut stuck = Job::new(&spec);
        stuck.kill_grace = Duration::from_millis(100);
        stuck.kill_signal = libc::SIGUSR2;
        stuck.reap_after_kill = Duration::from_millis(300);
        stuck
            .procs
            .push(start(0, "trap '' TERM USR2; while :; do sleep 0.05; done"));
        // Give the shell time to install its traps.
        std::thread::sleep(Duration::from_millis(200));
        stuck.stop_all();
        assert_eq!(stuck.procs[0].exit, Some(RankExit::Unreaped));
        assert!(kernel_wait_of(stuck.procs[0].pid).starts_with("state "));
        for p in job.procs.iter_mut().chain(stuck.procs.iter_mut()) {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }

    #[test]
    fn spec_validation_names_the_field() {
        let mut spec = LaunchSpec::new("true");
        assert!(spec.validate().is_ok());
        spec.nnodes = 2;
        spec.node_rank = 2;
        let e = spec.validate().unwrap_err().to_string();
        assert!(e.contains("node_rank"), "{e}");
        spec.node_rank = 1;
        assert_eq!(spec.global_rank(1), 2);
        assert_eq!(spec.world_size(), 2);
    }

    #[test]
    fn multi_node_job_id_is_deterministic() {
        let mut spec = LaunchSpec::new("true");
        spec.nnodes = 2;
        spec.extra_env.push((JOB_ID_VAR.into(), "given".into()));
        assert_eq!(spec.job_id(), "given");
        spec.extra_env.clear();
        // Trimmed; empty counts as unset.
        let given =
            |value: &'static str| move |name: &str| (name == JOB_ID_VAR).then(|| value.into());
        assert_eq!(spec.job_id_with(given(" job ")), "job");
        assert_eq!(spec.job_id_with(given("")).len(), 16);
        assert_eq!(spec.job_id_with(given("  ")).len(), 16);
        let none = |_: &str| None;
        let id = spec.job_id_with(none);
        assert_eq!(id, spec.job_id_with(none));
        assert_eq!(id.len(), 16);
        // Another Slurm job (or step) on the same address gets another id;
        // the nodes of one step agree.
        let slurm = |job: &'static str, step: &'static str| {
            move |name: &str| match name {
                "SLURM_JOB_ID" => Some(job.into()),
                "SLURM_STEP_ID" => Some(step.into()),
                _ => None,
            }
        };
        let first = spec.job_id_with(slurm("1001", "0"));
        assert_eq!(first, spec.job_id_with(slurm("1001", "0")));
        assert_ne!(first, spec.job_id_with(slurm("1002", "0")));
        assert_ne!(first, spec.job_id_with(slurm("1001", "1")));
        assert_ne!(first, id);
        spec.master_port += 1;
        assert_ne!(id, spec.job_id_with(none));
    }
}
