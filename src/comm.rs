//! [`Communicator`]: the typed API, its configuration, and the private enum of
//! backends behind it.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::bootstrap::{FileStore, LaunchEnv, Store, TcpStore};
use crate::desc::{BufDesc, CollectiveDesc, MemoryKind};
use crate::error::{Error, Result};
use crate::host::arena::{self, pair_lanes, Arena, Buffers, CallSig, Geometry};
use crate::host::executor::{self, Bufs, CallInfo};
use crate::host::shared::{SharedBuffer, SharedRegion};
use crate::schedule::{self, RingOrder};
use crate::transport::local::{LocalEndpoint, LocalGroup};
use crate::transport::net::{self, TransportKind};
use crate::transport::shm::LinkStores;
use crate::transport::{Elsewhere, FailureCause, LinkKind, Space, Transport, TransportError};
use crate::types::{DType, Element, OpKind, Rank, ReduceOp};

/// Default wait before a peer is declared unresponsive.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest wait a communicator keeps: longer timeouts (`Duration::MAX`
/// for "never give up", `OXCCL_TIMEOUT=1e19`) wait this long, a year. Every
/// deadline is `now + timeout`, which would overflow past it.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The timeout a communicator runs with: `timeout` within 1 ms (shorter
/// ones, zero included, would fail every wait at once) and
/// [`MAX_TIMEOUT`]. Every builder passes its timeout through here.
pub(crate) fn bounded_timeout(timeout: Duration) -> Duration {
    timeout.clamp(Duration::from_millis(1), MAX_TIMEOUT)
}
/// Default pipeline piece size in bytes of the schedules that run over
/// the links, except ring collectives over TCP
/// ([`DEFAULT_TCP_RING_CHUNK_BYTES`]). Chains (broadcast, reduce), send and
/// receive, all-to-all, and every schedule over shared-memory links use it:
/// a shared-memory ring holds 1 MiB ([`DEFAULT_SHM_RING_BYTES`]), and
/// pieces of it pipeline there. Measured on the 2-vCPU VM of
/// `docs/performance.md` (stop 41), 2 processes, `OXCCL_ALGO=ring` over
/// shared memory, 1 MiB pieces against these, paired batch by batch:
/// broadcast 1.32–1.78× slower from 1 MiB, all-reduce and reduce-scatter
/// 1.05–1.08× slower from 4 MiB.
pub const DEFAULT_CHUNK_BYTES: usize = 256 * 1024;

/// Default pipeline piece size in bytes of the ring collectives
/// (all-reduce, reduce-scatter, all-gather) when every link among the
/// ranks is TCP. Each piece costs a ring step's synchronisation (a frame
/// awaited from one neighbour before the next goes on), which over TCP
/// outweighs the pipelining finer pieces give. Measured on the 2-vCPU VM
/// of `docs/performance.md` (stop 41), 2 processes over loopback, paired
/// batch by batch in one run against [`DEFAULT_CHUNK_BYTES`]: all-gather,
/// all-reduce and reduce-scatter 1.08–1.27× faster at 1–16 MiB (in both
/// placements), broadcast even; against 512 KiB pieces even to 16 MiB and
/// 1.06–1.24× faster at 64 MiB; 2 MiB pieces no better. NCCL's ring
/// collectives, likewise, move chunks four times its broadcast's.
pub const DEFAULT_TCP_RING_CHUNK_BYTES: usize = 1 << 20;
/// Default size of each shared-memory ring (one per ordered pair of local
/// ranks): 1 MiB, so 8 ranks on a host need 56 rings, about 56 MiB of
/// `/dev/shm` (Docker's default is 64 MiB).
pub const DEFAULT_SHM_RING_BYTES: usize = 1 << 20;

/// Settings every communicator carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommConfig {
    /// How long any single wait for a peer may last (`OXCCL_TIMEOUT`).
    /// One wait outlasts it on purpose: after a zero-copy call fails, the
    /// rank waits until every peer that may still touch its buffers lets go
    /// of them, printing which rank it waits for, rather than return
    /// buffers a peer still reads or writes (see `docs/architecture.md`).
    pub timeout: Duration,
    /// Pipeline piece size in bytes of every schedule over the links
    /// (`OXCCL_CHUNK_BYTES`); at least one element. `None`: chosen per
    /// call ([`Communicator::chunk_bytes_for`]: [`DEFAULT_TCP_RING_CHUNK_BYTES`]
    /// for ring collectives when every link is TCP, [`DEFAULT_CHUNK_BYTES`]
    /// otherwise).
    pub chunk_bytes: Option<usize>,
    /// Which links join ranks of different processes (`OXCCL_TRANSPORT`).
    pub transport: TransportKind,
    /// Which network interface TCP links use, in NCCL's `NCCL_SOCKET_IFNAME`
    /// syntax (`OXCCL_SOCKET_IFNAME`: `eth`, `^docker,lo`, `=eth0`).
    pub socket_ifname: Option<String>,
    /// Bytes of each shared-memory ring, a power of two of at least 4 KiB
    /// (`OXCCL_SHM_RING_BYTES`).
    pub shm_ring_bytes: usize,
    /// Which algorithms collectives use (`OXCCL_ALGO`).
    pub algo: Algo,
    /// How ranks in separate processes write what they stage into the
    /// shared arena, and what their shared-memory links write into each
    /// other's rings (`OXCCL_SHM_STORES`).
    pub shm_stores: ShmStores,
}

/// How staged data goes into the shared arena's slots between processes
/// (`OXCCL_SHM_STORES`: `auto`, `auto:SECONDS`, `cached`, `streaming`).
///
/// A slot is written by one core and read by the others. Where the cores
/// share a cache, ordinary (`Cached`) stores leave the lines there for the
/// readers; where they do not (two dies of one CPU, two sockets, or a VM
/// whose virtual CPUs sit on such cores), each line the reader takes from
/// the writer's cache crosses between them one at a time, and writing
/// around the caches (`Streaming`, non-temporal stores) lets the reader
/// stream the slot from memory instead: 4–5 times faster there, about
/// half as fast where the cache is shared. `Auto` measures both.
/// Every rank's arena uses the same mode (the lowest rank that forces one
/// wins).
///
/// Each rank's own setting also governs what its shared-memory links write
/// (point-to-point calls, and collectives that run over the links:
/// `OXCCL_ALGO=ring`, or ranks on several hosts), with no agreement needed
/// (a reader reads whatever landed): `Cached` and `Streaming` as above for
/// each write of 32 KiB and more into a peer's ring, and `Auto` lets each
/// link's writer choose as it goes, by timing its own writes (the
/// `remeasure` interval does not apply to them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShmStores {
    /// Measured at set-up, and again every `remeasure` and whenever the
    /// ranks' cores move (`None`: only at set-up): the ranks push a slot's
    /// worth through the slot ring with each kind of store, and
    /// `Streaming` runs when that took at least a fifth less time. Every
    /// 4096 rounds or 128 MiB of calls the ranks time a few empty rounds;
    /// a round trip 1.6× longer or shorter than at the last measurement,
    /// at two checks in a row, means the cores moved (at most every
    /// 200 ms to 6.4 s, backing off while measurements keep the mode). A
    /// re-measurement takes a few milliseconds inside one call; rank 0's
    /// interval rules.
    /// Communicators made by `split` keep their parent's mode at the split
    /// and do not measure again.
    Auto {
        /// How often to measure again (`OXCCL_SHM_STORES=auto:SECONDS`;
        /// `auto:0` measures only at set-up).
        remeasure: Option<Duration>,
    },
    /// Ordinary stores.
    Cached,
    /// Non-temporal stores for staged pieces of 4 KiB and more.
    Streaming,
}

/// How often [`ShmStores::Auto`] measures again by default: virtual CPUs
/// that a hypervisor moves between cores may change which mode wins every
/// few minutes (the VM of `docs/performance.md`).
pub const DEFAULT_SHM_STORES_REMEASURE: Duration = Duration::from_secs(30);

impl Default for ShmStores {
    fn default() -> Self {
        ShmStores::Auto {
            remeasure: Some(DEFAULT_SHM_STORES_REMEASURE),
        }
    }
}

impl ShmStores {
    /// Parses `auto`, `auto:SECONDS` (a duration as `OXCCL_TIMEOUT` takes
    /// it, or `0` for set-up only), `cached` or `streaming`
    /// (case-insensitive).
    pub fn from_name(name: &str) -> Option<ShmStores> {
        let name = name.trim().to_ascii_lowercase();
        if let Some(every) = name.strip_prefix("auto:") {
            // Zero in any unit (`0`, `0s`, `0ms`) measures at set-up only.
            let remeasure = if duration_seconds(every)? == 0.0 {
                None
            } else {
                Some(parse_duration(every)?)
            };
            return Some(ShmStores::Auto { remeasure });
        }
        match name.as_str() {
            "" | "auto" => Some(ShmStores::default()),
            "cached" => Some(ShmStores::Cached),
            "streaming" => Some(ShmStores::Streaming),
            _ => None,
        }
    }
}

/// Which algorithm family runs the collectives (`OXCCL_ALGO`).
///
/// `Auto` picks by operation, size, world size and what links the ranks:
/// see `docs/performance.md` for the table. The others force one family
/// at every size; operations that have no form in it (all-to-all,
/// barrier, send/recv) keep their usual schedules, except that `Ring` and
/// `Tree`, which build no arena, also keep small sends and receives off the
/// arena's pair lanes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Algo {
    /// Chosen per call.
    #[default]
    Auto,
    /// Pipelined ring (all-reduce, reduce-scatter, all-gather) and chain
    /// (broadcast, reduce) schedules over the point-to-point links, at every
    /// size, even where the shared arena exists.
    Ring,
    /// One step straight to every peer: through the shared arena when every
    /// rank is on one host (one-shot all-reduce for small messages, two-shot
    /// for large ones), else direct schedules over the links.
    Direct,
    /// Recursive doubling (all-reduce, reduce-scatter, all-gather) and
    /// binomial trees (broadcast, reduce) over the point-to-point links, at
    /// every size, even where the shared arena exists: what `Auto` runs for
    /// small calls among many ranks across hosts. The device backends run
    /// as under `Auto`.
    Tree,
}

impl Algo {
    /// Parses `auto`, `ring`, `direct` or `tree` (case-insensitive).
    pub fn from_name(name: &str) -> Option<Algo> {
        match name.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Some(Algo::Auto),
            "ring" => Some(Algo::Ring),
            "direct" | "arena" => Some(Algo::Direct),
            "tree" => Some(Algo::Tree),
            _ => None,
        }
    }

    /// Whether collectives run over the point-to-point links only, with
    /// no shared arena (nor its lanes) even among ranks of one host.
    pub(crate) fn links_only(self) -> bool {
        matches!(self, Algo::Ring | Algo::Tree)
    }
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: DEFAULT_TIMEOUT,
            chunk_bytes: None,
            transport: TransportKind::Auto,
            socket_ifname: None,
            shm_ring_bytes: DEFAULT_SHM_RING_BYTES,
            algo: Algo::Auto,
            shm_stores: ShmStores::default(),
        }
    }
}

impl CommConfig {
    /// Defaults overridden by `OXCCL_TIMEOUT` (`30`, `30s`, `500ms`, `2m`),
    /// `OXCCL_CHUNK_BYTES`, `OXCCL_TRANSPORT` (`auto`, `shm`, `tcp`),
    /// `OXCCL_SOCKET_IFNAME`, `OXCCL_SHM_RING_BYTES`, `OXCCL_ALGO` and
    /// `OXCCL_SHM_STORES`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the variable when one is malformed.
    pub fn from_env() -> Result<Self> {
        let mut config = CommConfig::default();
        if let Some(value) = env_value("OXCCL_TIMEOUT")? {
            config.timeout = parse_duration(&value).ok_or_else(|| Error::Config {
                name: "OXCCL_TIMEOUT".into(),
                value: value.clone(),
                reason: "expected a positive duration such as 30, 30s, 500ms or 2m".into(),
            })?;
        }
        if let Some(value) = env_value("OXCCL_CHUNK_BYTES")? {
            config.chunk_bytes = if value.eq_ignore_ascii_case("auto") {
                None
            } else {
                Some(parse_byte_size(&value).filter(|&b| b > 0).ok_or_else(|| {
                    Error::Config {
                        name: "OXCCL_CHUNK_BYTES".into(),
                        value: value.clone(),
                        reason: "expected auto or a positive number of bytes, such as \
                                     262144 or 256K"
                            .into(),
                    }
                })?)
            };
        }
        if let Some(value) = env_value("OXCCL_TRANSPORT")? {
            config.transport = TransportKind::from_name(&value).ok_or_else(|| Error::Config {
                name: "OXCCL_TRANSPORT".into(),
                value: value.clone(),
                reason: "expected auto, shm or tcp".into(),
            })?;
        }
        if let Some(value) = env_value("OXCCL_SOCKET_IFNAME")? {
            config.socket_ifname = Some(value).filter(|v| !v.trim().is_empty());
        }
        if let Some(value) = env_value("OXCCL_SHM_RING_BYTES")? {
            config.shm_ring_bytes = parse_byte_size(&value)
                .filter(|&b| (4096..=1 << 30).contains(&b) && b.is_power_of_two())
                .ok_or_else(|| Error::Config {
                    name: "OXCCL_SHM_RING_BYTES".into(),
                    value: value.clone(),
                    reason: "expected a power of two from 4096 (4K) to 1 GiB (1G)".into(),
                })?;
        }
        if let Some(value) = env_value("OXCCL_ALGO")? {
            config.algo = Algo::from_name(&value).ok_or_else(|| Error::Config {
                name: "OXCCL_ALGO".into(),
                value: value.clone(),
                reason: "expected auto, ring, direct or tree".into(),
            })?;
        }
        if let Some(value) = env_value("OXCCL_SHM_STORES")? {
            config.shm_stores = ShmStores::from_name(&value).ok_or_else(|| Error::Config {
                name: "OXCCL_SHM_STORES".into(),
                value: value.clone(),
                reason: "expected auto, auto:SECONDS (0: at set-up only), cached or streaming"
                    .into(),
            })?;
        }
        Ok(config)
    }

    /// Sets the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the pipeline piece size in bytes.
    pub fn with_chunk_bytes(mut self, chunk_bytes: usize) -> Self {
        self.chunk_bytes = Some(chunk_bytes.max(1));
        self
    }
}

/// A byte count as the environment variables (`OXCCL_CHUNK_BYTES`,
/// `OXCCL_SHM_RING_BYTES`) and the tools' size flags take it: a whole
/// number with an optional `K`, `M` or `G` suffix (either case; binary:
/// `256K` is 262144), spaces around it ignored. `None` when it is not one,
/// or overflows `usize`.
pub fn parse_byte_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (number, scale) = match text.chars().last()?.to_ascii_uppercase() {
        'K' => (&text[..text.len() - 1], 1usize << 10),
        'M' => (&text[..text.len() - 1], 1 << 20),
        'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    number.parse::<usize>().ok()?.checked_mul(scale)
}

/// Parses `30`, `30s`, `1.5s`, `500ms`, `2m` into a positive duration.
fn parse_duration(text: &str) -> Option<Duration> {
    match duration_seconds(text)? {
        // Past what a Duration holds (1e20 s) is "as long as allowed", not
        // a panic: `bounded_timeout` takes it down to MAX_TIMEOUT.
        seconds if seconds > 0.0 => {
            Some(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
        }
        _ => None,
    }
}

/// The seconds a duration as [`parse_duration`] reads it stands for, zero
/// and negative ones included; `None` when it is not a finite number.
fn duration_seconds(text: &str) -> Option<f64> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let seconds: f64 = number.trim().parse().ok()?;
    // A finite number of minutes may still overflow to +inf seconds, which
    // `parse_duration` reads as "as long as allowed".
    seconds.is_finite().then_some(seconds * scale)
}

/// The implementations behind [`Communicator`] (static dispatch).
enum Backend {
    Host(Transport),
}

/// A handle that aborts a communicator's group from any thread.
///
/// Every call in progress on every communicator of the group in this process
/// (including split sub-communicators) returns [`Error::Aborted`] within a few
/// milliseconds; a communicator that was between calls returns it from its
/// next call, whatever the call (one that moves no data included); every
/// call after that returns [`Error::Failed`] naming the abort. Ranks in other processes see this
/// rank leave once its communicators are dropped.
///
/// The group is the communicator a split started from and every
/// communicator split from it: aborting a sub-communicator aborts its
/// parent and its siblings in this process too (they share the links and
/// the flag), unlike `ncclCommAbort`, which aborts one communicator. A rank
/// that must give up on one sub-group gives up on all of them.
#[derive(Clone)]
pub struct AbortHandle {
    target: AbortTarget,
}

#[derive(Clone)]
enum AbortTarget {
    Local(Arc<LocalGroup>),
    /// The process's fabric's abort flag, not the fabric: a handle kept by
    /// a watchdog must not keep the fabric alive after the communicators
    /// are dropped, or the rank's departure (leave and goodbye frames)
    /// would never be sent, and its peers would read its exit as a crash.
    Net(Arc<AtomicBool>),
}

impl AbortHandle {
    /// Aborts the group.
    pub fn abort(&self) {
        match &self.target {
            AbortTarget::Local(group) => group.abort(),
            // Every wait on the fabric and in the arena polls the flag.
            AbortTarget::Net(aborted) => aborted.store(true, Ordering::SeqCst),
        }
    }
}

/// One rank's handle on a group of ranks that run collectives together.
///
/// `Send` but not `Sync`: one thread drives a communicator at a time, as with
/// NCCL. Every rank must call the same collectives in the same order with
/// matching arguments; a rank whose arguments fail validation returns
/// [`Error::InvalidArgument`] at once and its peers see it as late.
///
/// After a timeout, a lost peer, a mismatch or an abort the communicator is
/// unusable (ranks can no longer agree on sequence numbers) and every later
/// call returns [`Error::Failed`].
///
/// Sharing one communicator between threads does not compile:
///
/// ```compile_fail
/// fn assert_sync<T: Sync>() {}
/// assert_sync::<oxccl::Communicator>();
/// ```
pub struct Communicator {
    rank: Rank,
    world: usize,
    config: CommConfig,
    /// Sequence number of the next collective.
    seq: u64,
    /// Sequence number of the next send to / receive from each peer.
    sends: Vec<u64>,
    recvs: Vec<u64>,
    /// The first fatal error, after which the communicator is unusable.
    failed: Option<String>,
    backend: Backend,
    /// The shared arena of an all-local world (`None` across hosts, and
    /// with `OXCCL_ALGO=ring`; split groups get one through the parent's).
    arena: Option<Arena>,
    /// Where an `Avg` of a premultiplying type scales its input, a segment
    /// at a time ([`Communicator::avg_by_segments`]); kept between calls,
    /// at most [`AVG_SEGMENT_BYTES`]. `u64`s, for any element's alignment.
    avg_scratch: Vec<u64>,
    /// While a premultiplied `Avg` runs its segments: a word naming the
    /// whole call's element count and the segment ([`segment_tag`]),
    /// mixed into each segment call's signature and frame digest, so that
    /// ranks passing different counts fail with a mismatch rather than
    /// pair segments of different calls; 0 otherwise.
    segment_tag: u64,
    _not_sync: PhantomData<Cell<()>>,
}

/// A segment of a rank's input scaled for a premultiplied `Avg`, in the
/// communicator's scratch (`u64` words, for any element's alignment),
/// which it holds for the segment's call ([`Communicator::scaled_segment`]).
struct ScaledInput<T> {
    words: Vec<u64>,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: Element> ScaledInput<T> {
    fn elements(&self) -> &[T] {
        // The words this input fills (the scratch may be longer).
        let words = std::mem::size_of::<T>() * self.len;
        &bytemuck::cast_slice(&self.words[..words.div_ceil(8)])[..self.len]
    }

    fn elements_mut(&mut self) -> &mut [T] {
        let words = std::mem::size_of::<T>() * self.len;
        &mut bytemuck::cast_slice_mut(&mut self.words[..words.div_ceil(8)])[..self.len]
    }
}

/// The buffers of a premultiplied `Avg` ([`Communicator::avg_by_segments`]):
/// the input is `send`, or `buf` in place, read segment by segment before
/// each segment's output is written.
enum AvgBufs<'a, T> {
    OutOfPlace { send: &'a [T], recv: &'a mut [T] },
    InPlace(&'a mut [T]),
}

impl<T> AvgBufs<'_, T> {
    fn input(&self) -> &[T] {
        match self {
            AvgBufs::OutOfPlace { send, .. } => send,
            AvgBufs::InPlace(buf) => buf,
        }
    }

    fn output(&mut self) -> &mut [T] {
        match self {
            AvgBufs::OutOfPlace { recv, .. } => recv,
            AvgBufs::InPlace(buf) => buf,
        }
    }
}

/// The call a premultiplied `Avg` runs for each of its segments
/// ([`Communicator::avg_by_segments`]).
#[derive(Clone, Copy)]
enum AvgCall {
    AllReduce,
    /// The result lands at `output[at..]`.
    ReduceScatter {
        at: usize,
    },
    Reduce {
        root: Rank,
    },
}

/// Bytes of input a premultiplied `Avg` scales and reduces per call
/// ([`Communicator::avg_by_segments`]), and so the most its scratch holds:
/// a core's L2 on Zen 4, so the scaled segment is read back from cache.
/// f16 Avg all-reduce, four rounds alternating with the whole input
/// scaled first (Zen 4 VM, ms, out of / in place): 2 threads 16 MiB
/// 3.0–3.9 / 2.2–2.8 against 3.5–5.3 / 3.5–5.2, 64 MiB 11.8–13.3 /
/// 8.7–12.4 against 17.1–23.1 / 16.5–20.4; 2 processes 16 MiB 4.6–5.8 /
/// 3.8–5.0 against 4.3–6.2 / 5.1–6.0, 64 MiB 18.5–24.9 / 13.6–19.5
/// against 18.7–24.2 / 21.1–23.9; 1 MiB (one segment) even. Segments of
/// 512 KiB and 2 MiB ran within the same spread.
///
/// A call larger than one segment runs equal segments of more than half
/// of one: more than the direct schedules take
/// ([`schedule::DIRECT_MAX_BYTES_SENT`]), so every segment gets the family
/// the whole call would (and its fold order).
const AVG_SEGMENT_BYTES: usize = 1024 * 1024;
const _: () = assert!(AVG_SEGMENT_BYTES / 2 > schedule::DIRECT_MAX_BYTES_SENT);

/// [`Communicator::segment_tag`] for segment `index` of a premultiplied
/// `Avg` of `whole_count` elements: never 0.
fn segment_tag(whole_count: usize, index: usize) -> u64 {
    let z = (whole_count as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (index as u64)
            .wrapping_add(1)
            .wrapping_mul(0xD6E8_FEB8_6659_FD93);
    z | 1
}

/// Elements of each of `parts` blocks that one segment of a premultiplied
/// `Avg` of `T` takes ([`AVG_SEGMENT_BYTES`] in all, at least one).
fn avg_segment_elements<T>(parts: usize) -> usize {
    (AVG_SEGMENT_BYTES / std::mem::size_of::<T>() / parts.max(1)).max(1)
}

/// Builds communicators with explicit settings.
#[derive(Clone, Debug, Default)]
pub struct CommBuilder {
    timeout: Option<Duration>,
    chunk_bytes: Option<usize>,
    transport: Option<TransportKind>,
    algo: Option<Algo>,
    job_id: Option<String>,
}

impl CommBuilder {
    /// Wait limit for every wait on a peer (overrides `OXCCL_TIMEOUT`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Pipeline piece size in bytes (overrides `OXCCL_CHUNK_BYTES`).
    pub fn chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = Some(bytes.max(1));
        self
    }

    /// Which links to use between processes (overrides `OXCCL_TRANSPORT`).
    pub fn transport(mut self, transport: TransportKind) -> Self {
        self.transport = Some(transport);
        self
    }

    /// Which algorithms to use (overrides `OXCCL_ALGO`).
    pub fn algo(mut self, algo: Algo) -> Self {
        self.algo = Some(algo);
        self
    }

    /// A name for the job, used in shared-memory segment names so that
    /// `oxccl-run` can clean up after ranks that crash (default:
    /// `OXCCL_JOB_ID`, else derived from the job's token).
    pub fn job_id(mut self, id: impl Into<String>) -> Self {
        self.job_id = Some(id.into());
        self
    }

    /// The configuration: environment first, then the builder's settings.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when an environment variable is malformed.
    pub fn config(&self) -> Result<CommConfig> {
        let mut config = CommConfig::from_env()?;
        if let Some(t) = self.timeout {
            config.timeout = t;
        }
        if let Some(b) = self.chunk_bytes {
            config.chunk_bytes = Some(b);
        }
        if let Some(t) = self.transport {
            config.transport = t;
        }
        if let Some(a) = self.algo {
            config.algo = a;
        }
        config.timeout = bounded_timeout(config.timeout);
        Ok(config)
    }

    /// Joins a job of `world_size` ranks in separate processes (or threads)
    /// as rank `rank`, meeting the others through `store`, and links every
    /// pair: shared memory on one host, TCP between hosts.
    ///
    /// Blocks until every rank has joined, for at most the timeout.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a rank out of range;
    /// [`Error::RendezvousTimeout`] naming the ranks that never joined;
    /// [`Error::Bootstrap`] when a link cannot be made; [`Error::Config`] for
    /// a malformed environment.
    pub fn init(
        &self,
        rank: Rank,
        world_size: usize,
        store: Arc<dyn Store>,
    ) -> Result<Communicator> {
        self.init_toward(rank, world_size, store, None, None)
    }

    /// Joins the job described by the launcher's environment variables
    /// (torchrun / `oxccl-run`, Open MPI, Slurm: see [`LaunchEnv`]). Rank 0
    /// hosts the rendezvous store on `MASTER_PORT` (on every interface); the
    /// others connect to `MASTER_ADDR:MASTER_PORT`, retrying until the
    /// timeout. `OXCCL_STORE=file:/dir` uses a [`FileStore`] instead.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming a missing or contradictory variable;
    /// [`Error::Bootstrap`] when the port is taken or the store cannot be
    /// reached; [`Error::RendezvousTimeout`] naming the ranks that never
    /// joined; as [`init`](Self::init).
    pub fn from_env(&self) -> Result<Communicator> {
        self.from_launch_env(&LaunchEnv::from_env()?)
    }

    /// [`from_env`](Self::from_env) with the variables already read.
    ///
    /// # Errors
    ///
    /// As [`from_env`](Self::from_env).
    pub fn from_launch_env(&self, env: &LaunchEnv) -> Result<Communicator> {
        let timeout = self.config()?.timeout;
        let (store, toward) = launch_store(env, timeout)?;
        let mut builder = self.clone();
        if builder.job_id.is_none() {
            builder.job_id = env.job_id.clone();
        }
        // A rank that reaches the previous job's store (this process's
        // earlier communicator, whose rank 0 is still dropping its own)
        // connects again, as it first did.
        // A file store never goes away: no point connecting again.
        let again = env.clone();
        let reconnect = env.file_store.is_none().then(|| -> net::Reconnect {
            Box::new(move |deadline| {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                launch_store(&again, left).map(|(store, _)| store)
            })
        });
        builder.init_toward(env.rank, env.world_size, store, toward, reconnect)
    }

    /// [`init`](Self::init), picking the network interface that reaches
    /// `toward` (the master's address) unless `OXCCL_SOCKET_IFNAME` says otherwise.
    fn init_toward(
        &self,
        rank: Rank,
        world_size: usize,
        store: Arc<dyn Store>,
        toward: Option<std::net::IpAddr>,
        reconnect: Option<net::Reconnect>,
    ) -> Result<Communicator> {
        let config = self.config()?;
        check_rank(rank, world_size)?;
        let job_id = self
            .job_id
            .clone()
            .map_or_else(|| env_value("OXCCL_JOB_ID"), |id| Ok(Some(id)))?
            .map(|id| id.trim().to_owned())
            .filter(|id| !id.is_empty());
        let (endpoint, arena_segment) = net::connect(net::Setup {
            rank,
            world: world_size,
            store,
            timeout: config.timeout,
            transport: config.transport,
            socket_ifname: config.socket_ifname.clone(),
            toward,
            job_id,
            shm_ring_bytes: config.shm_ring_bytes,
            shm_link_stores: match config.shm_stores {
                ShmStores::Cached => LinkStores::Cached,
                ShmStores::Streaming => LinkStores::Streaming,
                ShmStores::Auto { .. } => LinkStores::Adaptive,
            },
            arena_bytes: if config.algo.links_only() {
                0
            } else {
                Arena::region_bytes(world_size)
            },
            // What decides how a call is planned and which links join the
            // ranks, named as the environment variables are and compared
            // by their parsed values (`256K` and `262144` agree).
            settings: vec![
                (
                    "OXCCL_ALGO",
                    format!("{:?}", config.algo).to_ascii_lowercase(),
                ),
                (
                    "OXCCL_CHUNK_BYTES",
                    config
                        .chunk_bytes
                        .map_or_else(|| "auto".into(), |b| b.to_string()),
                ),
                (
                    "OXCCL_TRANSPORT",
                    format!("{:?}", config.transport).to_ascii_lowercase(),
                ),
            ],
            reconnect,
        })?;
        let arena = arena_segment
            .map(|segment| {
                Arena::shared(
                    segment,
                    Geometry::new(world_size),
                    rank,
                    endpoint.abort_flag(),
                    config.timeout,
                    config.shm_stores,
                )
            })
            .transpose()?;
        let mut comm = Communicator::new(rank, world_size, config, Transport::Net(endpoint));
        comm.arena = arena;
        Ok(comm)
    }

    /// `n` communicators of one in-process group, one per thread
    /// (NCCL's `ncclCommInitAll`). Element `i` is rank `i`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed environment, [`Error::InvalidArgument`] for `n == 0`.
    pub fn local_group(&self, n: usize) -> Result<Vec<Communicator>> {
        let config = self.config()?;
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: OpKind::Init,
                rank: 0,
                arg: "n",
                reason: "a group needs at least one rank".into(),
            });
        }
        check_rank(0, n)?;
        let group = LocalGroup::new(n);
        let members: Vec<usize> = (0..n).collect();
        let mut arenas: Vec<Option<Arena>> = if n > 1 && !config.algo.links_only() {
            Arena::local_group(
                n,
                group.abort_flag(),
                config.timeout,
                group.outnumbers_cpus(),
            )
            .ok_or_else(|| Error::Bootstrap {
                context: format!("local_group of {n} ranks"),
                detail: "the system would not allocate their shared arena".into(),
            })?
            .into_iter()
            .map(Some)
            .collect()
        } else {
            (0..n).map(|_| None).collect()
        };
        Ok((0..n)
            .map(|rank| {
                let endpoint = LocalEndpoint::new(group.clone(), 0, members.clone(), rank);
                let mut comm =
                    Communicator::new(rank, n, config.clone(), Transport::Local(endpoint));
                comm.arena = arenas[rank].take();
                comm
            })
            .collect())
    }
}

/// The value of the environment variable `name`, `None` when unset; an
/// [`Error::Config`] when it is not UTF-8 (taken for unset, it would run
/// with the default the user meant to change).
pub(crate) fn env_value(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(raw)) => Err(Error::Config {
            name: name.into(),
            value: raw.to_string_lossy().into_owned(),
            reason: "not UTF-8".into(),
        }),
    }
}

/// Mixes a parent context id, the split's sequence number and the color into
/// a child context id (splitmix64 finaliser): equal on every member, distinct
/// between siblings and generations with overwhelming probability.
fn child_ctx(parent: u64, seq: u64, color: u32) -> u64 {
    let mut z =
        parent ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (u64::from(color) << 32 | 0x5151);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What [`Communicator::fail`] does, for callers that hold other fields
/// of the communicator borrowed.
fn record_failure(
    failed: &mut Option<String>,
    (transport, arena): (&Transport, Option<&Arena>),
    error: &Error,
) {
    *failed = Some(error.to_string());
    let cause = FailureCause::of(error);
    transport.mark_failed(cause);
    if let Some(arena) = arena {
        arena.mark_failed(cause);
    }
}

/// The collectives `Communicator::arena_fast` takes, with what it needs
/// of each.
#[derive(Clone, Copy)]
enum FastCall {
    AllReduce(ReduceOp),
    Broadcast { root: Rank },
    AllGather,
    ReduceScatter(ReduceOp),
    Reduce { op: ReduceOp, root: Rank },
}

/// The arena's view of an in-place call on `base` with `count` elements
/// per rank where the count is per rank (see `CollectiveDesc::count`):
/// reduce-scatter's result and all-gather's input are this rank's part of
/// the one buffer; every other collective reads and writes it whole.
///
/// # Safety
/// `base` holds `world · count` elements for an all-gather, a split's
/// exchange or a reduce-scatter (so `rank · count` lies inside).
unsafe fn in_place_buffers<T>(op: OpKind, base: *mut T, rank: Rank, count: usize) -> Buffers<T> {
    let (input, output) = match op {
        OpKind::ReduceScatter => (base.cast_const(), base.add(rank * count)),
        OpKind::AllGather | OpKind::Split => (base.add(rank * count).cast_const(), base),
        _ => (base.cast_const(), base),
    };
    Buffers {
        input,
        output,
        in_place: true,
    }
}

/// What a call needs to build its plan over the links: see
/// [`Communicator::links_planner`].
struct LinksPlanner<'d> {
    desc: &'d CollectiveDesc,
    chunk_bytes: usize,
    family: schedule::Family,
    order: &'d RingOrder,
}

impl LinksPlanner<'_> {
    fn plan(&self) -> schedule::Plan {
        schedule::plan_in_order(self.desc, self.chunk_bytes, self.family, self.order)
    }
}

/// A lone `send` (or `send_recv`'s send half) among ranks with pair
/// lanes: a message of at most [`pair_lanes::MAX_BYTES`] goes into the
/// lane to `peer` when it has room, anything else over the links.
fn send_by_lane<T: Element>(
    arena: &mut Arena,
    transport: &Transport,
    info: &CallInfo,
    (data, peer): (&[T], Rank),
    links: LinksPlanner<'_>,
) -> Result<()> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    if bytes.len() <= pair_lanes::MAX_BYTES && arena.pair_send(info, peer, bytes) {
        return Ok(());
    }
    let bufs = Bufs::OutOfPlace {
        send: data,
        recv: &mut [],
    };
    executor::execute(transport, info, &links.plan(), bufs)
}

/// A lone `recv` (or `send_recv`'s receive half) among ranks with pair
/// lanes: a message of at most [`pair_lanes::MAX_BYTES`] comes through the
/// lane from `peer`, or over the links when the lane was full as it was
/// sent; a larger one over the links.
fn recv_by_lane<T: Element>(
    arena: &mut Arena,
    transport: &Transport,
    info: &CallInfo,
    (out, peer): (&mut [T], Rank),
    links: LinksPlanner<'_>,
) -> Result<()> {
    let bytes = std::mem::size_of_val(out);
    if bytes <= pair_lanes::MAX_BYTES {
        // The frame the message's first (only) piece would arrive as.
        let first = executor::header::<T>(info, 0, out.len());
        // Asked after the wait's first spin, then every few µs (every 2 ms
        // once it sleeps); from the fourth time on (some 20 µs in) it reads
        // the links past their read-ahead, as a receive over them does
        // once it stalls.
        let mut asked = 0u32;
        let on_links = || {
            asked += 1;
            transport.has_frame(peer, &first, asked >= 4)
        };
        let into = bytemuck::cast_slice_mut(out);
        match arena.pair_recv((info, &first), peer, into, on_links) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            // A peer that failed may have sent this message over the links
            // before: they deliver it, or report the loss themselves.
            Err(Error::PeerLost { .. } | Error::PeerTimedOut { .. })
                if transport.has_frame(peer, &first, true) => {}
            Err(e) => return Err(e),
        }
    }
    let bufs = Bufs::OutOfPlace {
        send: &[],
        recv: out,
    };
    recv_over_links(Some(arena), info, (peer, bytes), |elsewhere| {
        executor::execute_watching(transport, info, &links.plan(), bufs, elsewhere)
    })
}

/// Runs `receive`, which takes a message of `bytes` from `peer` over the
/// links, watching what it is given (see [`Transport::recv_into`]). Where
/// the ranks have pair lanes and the message is too large for them, that
/// is the lane: a message there (before the wait, while it lasts, or when
/// it failed, timed out or found the peer gone) was sent small, and is
/// reported as the length mismatch it is, not as a peer that never sent.
fn recv_over_links(
    arena: Option<&Arena>,
    info: &CallInfo,
    (peer, bytes): (Rank, usize),
    receive: impl FnOnce(Elsewhere<'_>) -> Result<()>,
) -> Result<()> {
    let Some(arena) = arena.filter(|a| a.has_pair_lanes() && bytes > pair_lanes::MAX_BYTES) else {
        return receive(None);
    };
    let sent_small = || {
        let sent = arena.pair_lane_holds(peer, info.seq)?;
        Some(info.error(
            peer,
            TransportError::Mismatch(format!(
                "peer sent {sent} bytes where {bytes} were expected (counts differ between \
                 ranks?)"
            )),
        ))
    };
    if let Some(mismatch) = sent_small() {
        return Err(mismatch);
    }
    let mut in_lane = || arena.pair_lane_holds(peer, info.seq).is_some();
    receive(Some(&mut in_lane)).map_err(|e| sent_small().unwrap_or(e))
}

/// Runs one validated collective through the arena.
fn run_in_arena<T: Element>(
    arena: &mut Arena,
    desc: &CollectiveDesc,
    (info, segment_tag): (&CallInfo, u64),
    bufs: Bufs<'_, T>,
) -> Result<()> {
    let count = desc.count();
    arena.maybe_remeasure_stores(info, count * std::mem::size_of::<T>())?;
    let root = desc.root.unwrap_or(0);
    let sig = CallSig {
        seq: info.seq,
        signature: arena::signature(desc.op, desc.dtype as u8, desc.reduce_op, root, count)
            ^ segment_tag,
    };
    let rank = desc.rank;
    let op = info.reduce_op;
    let buffers = match bufs {
        Bufs::OutOfPlace { send, recv } => Buffers {
            input: send.as_ptr(),
            output: recv.as_mut_ptr(),
            in_place: false,
        },
        // SAFETY: validated: an all-gather's, a split's or a
        // reduce-scatter's buffer holds world·count elements.
        Bufs::InPlace(buf) => unsafe { in_place_buffers(desc.op, buf.as_mut_ptr(), rank, count) },
    };
    match desc.op {
        OpKind::AllReduce => arena.all_reduce(info, &sig, buffers, count, op),
        OpKind::ReduceScatter => arena.reduce_scatter(info, &sig, buffers, count, op),
        // Split exchanges (color, key) pairs with an in-place all-gather.
        OpKind::AllGather | OpKind::Split => arena.all_gather(info, &sig, buffers, count),
        OpKind::Broadcast => arena.broadcast(info, &sig, buffers, count, root),
        OpKind::Reduce => arena.reduce(info, &sig, buffers, count, op, root),
        OpKind::AllToAll => arena.all_to_all(info, &sig, buffers, count),
        OpKind::Barrier => arena.barrier(info, &sig),
        // `uses_arena` keeps these on the point-to-point links, and
        // allocation has its own entry point.
        OpKind::Send | OpKind::Recv | OpKind::AllocShared | OpKind::Init => Err(Error::Failed {
            op: desc.op,
            rank,
            first_error: "internal error: point-to-point call routed to the arena".into(),
        }),
    }
}

/// Marker stored in the split table for ranks that join no group.
const NO_COLOR: u64 = u64::MAX;

/// The rendezvous store a launched rank uses, and the master's address (to
/// pick the interface that reaches it): `OXCCL_STORE=file:` → a
/// [`FileStore`]; otherwise rank 0 hosts a [`TcpStore`] on `MASTER_PORT` on
/// every interface and the others connect to `MASTER_ADDR:MASTER_PORT`,
/// retrying until `timeout`. Shared by the host and device communicators.
/// `InvalidArgument` unless `rank` is a rank of a job of `world_size`
/// (what every `init` checks before any rendezvous).
pub(crate) fn check_rank(rank: Rank, world_size: usize) -> Result<()> {
    if world_size > crate::bootstrap::MAX_WORLD_SIZE {
        return Err(Error::InvalidArgument {
            op: OpKind::Init,
            rank,
            arg: "world_size",
            reason: format!(
                "{world_size} ranks; a job has at most {}",
                crate::bootstrap::MAX_WORLD_SIZE
            ),
        });
    }
    if rank >= world_size {
        return Err(Error::InvalidArgument {
            op: OpKind::Init,
            rank,
            arg: "rank",
            reason: format!("rank {rank} is out of range for world size {world_size}"),
        });
    }
    Ok(())
}

pub(crate) fn launch_store(
    env: &LaunchEnv,
    timeout: Duration,
) -> Result<(Arc<dyn Store>, Option<std::net::IpAddr>)> {
    // A job of one rank meets nobody: no port to take (two one-rank jobs
    // on a node, `srun -n1` sweeps, collided on MASTER_PORT) and no name
    // to resolve.
    if env.world_size == 1 && env.file_store.is_none() {
        return Ok((Arc::new(crate::bootstrap::MemoryStore::new()), None));
    }
    let master = env.store_address();
    // Only to pick the interface that faces the master: a name the
    // resolver is slow on gets a few seconds here, not the timeout (the
    // connection to the store resolves it again, by its own deadline).
    let toward = crate::bootstrap::resolve_by(
        &master,
        std::time::Instant::now() + timeout.min(Duration::from_secs(5)),
    )
    .ok()
    .and_then(|addrs| addrs.into_iter().next())
    .map(|a| a.ip());
    let store: Arc<dyn Store> = if let Some(dir) = &env.file_store {
        // Wrapped like the TCP stores' errors: every rank's error names it.
        let store = FileStore::new(dir.clone()).map_err(|e| Error::Bootstrap {
            context: format!(
                "rank {} of {}: the file store (OXCCL_STORE)",
                env.rank, env.world_size
            ),
            detail: e.to_string(),
        })?;
        Arc::new(store.lock_timeout(timeout))
    } else if env.rank == 0 {
        let any: std::net::IpAddr = match toward {
            Some(std::net::IpAddr::V6(_)) => std::net::Ipv6Addr::UNSPECIFIED.into(),
            _ => std::net::Ipv4Addr::UNSPECIFIED.into(),
        };
        Arc::new(
            TcpStore::host((any, env.master_port).into()).map_err(|e| Error::Bootstrap {
                context: format!("rank 0 of {}", env.world_size),
                detail: e.to_string(),
            })?,
        )
    } else {
        Arc::new(
            TcpStore::connect(&master, timeout).map_err(|e| Error::Bootstrap {
                context: format!(
                    "rank {} of {}: reaching the rendezvous store that rank 0 hosts",
                    env.rank, env.world_size
                ),
                detail: e.to_string(),
            })?,
        )
    };
    Ok((store, toward))
}

/// Whether `OXCCL_DEBUG` asks for INFO lines (`INFO` or `TRACE`), printed
/// to stderr as `oxccl INFO …` (NCCL's `NCCL_DEBUG=INFO`).
pub(crate) fn debug_info() -> bool {
    std::env::var("OXCCL_DEBUG")
        .is_ok_and(|v| matches!(v.trim().to_ascii_uppercase().as_str(), "INFO" | "TRACE"))
}

/// Prints `oxccl INFO <line>` to stderr in one `write`, so that the lines
/// of ranks sharing a terminal or a pipe never interleave mid-line
/// (`eprintln!` writes a line in pieces). Callers check [`debug_info`].
pub(crate) fn info_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let text = format!("oxccl INFO {line}\n");
    // Nowhere to report a failed write to stderr.
    let _ = std::io::stderr().write_all(text.as_bytes());
}

impl Communicator {
    fn new(rank: Rank, world: usize, config: CommConfig, transport: Transport) -> Communicator {
        if world > 1 && debug_info() {
            // As NCCL's "Channel 00 : 0 1 2 3": which ranks the ring (and
            // the chains) joins in turn, so a ring that crosses between
            // hosts more than it must shows.
            let order = transport.ring_order();
            let ring: Vec<String> = (0..world).map(|q| order.rank_at(q).to_string()).collect();
            let levels = match order.hosts() {
                Some((hosts, per_host)) => {
                    format!(" (two levels: {hosts} hosts x {per_host} ranks)")
                }
                None if order.knows_hosts() => {
                    let sizes: Vec<String> =
                        order.host_spans().map(|s| s.len().to_string()).collect();
                    format!(" (hosts of {} ranks)", sizes.join(" "))
                }
                None => String::new(),
            };
            let crowded = if transport.crowded() {
                "; more ranks than CPUs on this machine: waits yield"
            } else {
                ""
            };
            info_line(format_args!(
                "rank {rank}/{world}: ring {}{levels} over {}{crowded}",
                ring.join(" "),
                transport.describe()
            ));
        }
        Communicator {
            rank,
            world,
            config,
            seq: 0,
            sends: vec![0; world],
            recvs: vec![0; world],
            failed: None,
            backend: Backend::Host(transport),
            arena: None,
            avg_scratch: Vec::new(),
            segment_tag: 0,
            _not_sync: PhantomData,
        }
    }

    /// A builder for explicit settings.
    pub fn builder() -> CommBuilder {
        CommBuilder::default()
    }

    /// `n` communicators of one in-process group with settings from the
    /// environment (every `OXCCL_*` setting of [`CommConfig::from_env`]: a
    /// malformed one is an error, and `OXCCL_ALGO=ring` or `tree` leaves out
    /// the shared arena).
    ///
    /// # Errors
    ///
    /// As [`CommBuilder::local_group`].
    pub fn local_group(n: usize) -> Result<Vec<Communicator>> {
        CommBuilder::default().local_group(n)
    }

    /// This rank, in `0..world_size()`.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Joins the job described by the launcher's environment variables,
    /// with settings from the environment: see [`CommBuilder::from_env`].
    ///
    /// ```no_run
    /// // oxccl-run --nproc-per-node 4 -- ./my_prog   (or torchrun, mpirun, srun)
    /// let mut comm = oxccl::Communicator::from_env()?;
    /// let mut grads = vec![1.0f32; 1 << 20];
    /// comm.all_reduce_in_place(&mut grads, oxccl::ReduceOp::Avg)?;
    /// # Ok::<(), oxccl::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`CommBuilder::from_env`].
    pub fn from_env() -> Result<Communicator> {
        CommBuilder::default().from_env()
    }

    /// The settings in force.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }

    /// What carries messages from this rank to `peer` (a rank of this
    /// communicator): between threads of one process, shared memory between
    /// processes of one host, or TCP. `None` for this rank itself and for
    /// a rank the communicator does not have. (The shared arena, where
    /// there is one, carries some calls among the ranks of one host
    /// besides.)
    pub fn link_to(&self, peer: Rank) -> Option<LinkKind> {
        let Backend::Host(transport) = &self.backend;
        transport.link_kind(peer)
    }

    /// Whether this rank's machine runs more of the job's ranks than the
    /// CPUs they may run on together. For processes, every rank of the job
    /// on this kernel counts (containers and network namespaces of one
    /// machine included) against the union of their affinities, and then
    /// every wait for a peer yields its CPU at once instead of spinning
    /// (`OXCCL_DEBUG=INFO` says so). For threads, the whole group that
    /// `local_group` made counts (a split answers for it) against the
    /// affinity of the thread that made it, read then (before any thread
    /// pins itself), and then the shared arena's
    /// waits yield at once. Either way, messages between ranks that share
    /// a CPU wait for it.
    pub fn ranks_outnumber_cpus(&self) -> bool {
        let Backend::Host(transport) = &self.backend;
        match transport {
            Transport::Local(endpoint) => endpoint.group().outnumbers_cpus(),
            Transport::Net(_) => transport.crowded(),
        }
    }

    /// What carries this communicator's traffic: `in-process`, `shm`,
    /// `tcp (eth0 10.0.0.2)`, `shm+tcp (...)`; with the shared arena between
    /// processes, also how it stores staged data (`arena: cached slot
    /// stores (measured 1 time, last: ...)`).
    pub fn transport_description(&self) -> String {
        let Backend::Host(transport) = &self.backend;
        match &self.arena {
            Some(arena) if arena.across_processes() => {
                format!(
                    "{}; arena: {}",
                    transport.describe(),
                    arena.stores_description()
                )
            }
            _ => transport.describe(),
        }
    }

    /// A handle that aborts this communicator's group from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        let target = match &self.backend {
            Backend::Host(Transport::Local(endpoint)) => {
                AbortTarget::Local(endpoint.group().clone())
            }
            Backend::Host(Transport::Net(endpoint)) => AbortTarget::Net(endpoint.abort_flag()),
        };
        AbortHandle { target }
    }

    /// Aborts this communicator's group — the communicator it was split
    /// from and every split of it, in this process: see [`AbortHandle`].
    pub fn abort(&self) {
        self.abort_handle().abort();
    }

    fn desc<T: Element>(&self, op: OpKind) -> CollectiveDesc {
        CollectiveDesc::new(op, T::DTYPE, self.rank, self.world, MemoryKind::Host)
    }

    /// Validates, numbers, plans and executes one call.
    fn run<T: Element>(&mut self, desc: CollectiveDesc, bufs: Bufs<'_, T>) -> Result<()> {
        desc.validate()?;
        if let Some(first) = &self.failed {
            return Err(Error::Failed {
                op: desc.op,
                rank: self.rank,
                first_error: first.clone(),
            });
        }
        let in_arena = self.uses_arena(&desc);
        let info = self.number_call(&desc, in_arena);
        let Backend::Host(transport) = &self.backend;
        let links = self.links_planner(&desc, transport.ring_order());
        let peer = desc.peer.unwrap_or(0);
        let result = match (in_arena, self.arena.as_mut()) {
            _ if transport.is_aborted() => Err(info.error(self.rank, TransportError::Aborted)),
            (true, Some(arena)) => run_in_arena(arena, &desc, (&info, self.segment_tag), bufs),
            // (No arena exists under `OXCCL_ALGO=ring` or `tree`, so neither
            // do lanes.)
            (false, Some(arena)) if arena.has_pair_lanes() => match (desc.op, bufs) {
                (OpKind::Send, Bufs::OutOfPlace { send, .. }) => {
                    send_by_lane(arena, transport, &info, (send, peer), links)
                }
                (OpKind::Recv, Bufs::OutOfPlace { recv, .. }) => {
                    recv_by_lane(arena, transport, &info, (recv, peer), links)
                }
                (_, bufs) => executor::execute(transport, &info, &links.plan(), bufs),
            },
            _ => executor::execute(transport, &info, &links.plan(), bufs),
        };
        // Rebuilt rather than moved, as in `arena_fast`.
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                self.fail(&e);
                Err(e)
            }
        }
    }

    /// Gives a validated call its sequence number (per peer and direction
    /// for sends and receives, else the communicator's collective count)
    /// and describes it for the executor or the arena (`in_arena`).
    fn number_call(&mut self, desc: &CollectiveDesc, in_arena: bool) -> CallInfo {
        let (space, seq) = match desc.op {
            OpKind::Send => {
                let peer = desc.peer.unwrap_or(0);
                self.sends[peer] += 1;
                (Space::PointToPoint, self.sends[peer] - 1)
            }
            OpKind::Recv => {
                let peer = desc.peer.unwrap_or(0);
                self.recvs[peer] += 1;
                (Space::PointToPoint, self.recvs[peer] - 1)
            }
            _ => {
                self.seq += 1;
                (Space::Collective, self.seq - 1)
            }
        };
        let Backend::Host(transport) = &self.backend;
        CallInfo {
            op: desc.op,
            seq,
            space,
            ctx: transport.ctx(),
            rank: self.rank,
            world: self.world,
            reduce_op: desc.reduce_op.unwrap_or(ReduceOp::Sum),
            timeout: self.config.timeout,
            // Carried by frames over the links and by messages in the pair
            // lanes; collectives in the arena compare their own signatures.
            digest: if in_arena {
                0
            } else {
                CallInfo::digest_of(desc) ^ (self.segment_tag ^ (self.segment_tag >> 32)) as u32
            },
        }
    }

    /// What the plan of a call over the links (not in the arena) needs of
    /// this communicator, taken before the arena is borrowed: a pair-lane
    /// call builds its plan only when it goes over the links after all.
    /// `order`: the transport's [`Transport::ring_order`] (borrowed from
    /// the backend, not from all of `self`).
    fn links_planner<'d>(
        &self,
        desc: &'d CollectiveDesc,
        order: &'d RingOrder,
    ) -> LinksPlanner<'d> {
        LinksPlanner {
            desc,
            chunk_bytes: self.chunk_bytes_for(desc.op),
            family: self.plan_family(desc),
            order,
        }
    }

    /// The two halves of a `send_recv`: a lone `send` of `sent` to `dst`
    /// and a lone `recv` of `received` from `src`.
    fn exchange_descs<T: Element>(
        &self,
        (sent, dst): (BufDesc, Rank),
        (received, src): (BufDesc, Rank),
    ) -> (CollectiveDesc, CollectiveDesc) {
        (
            self.desc::<T>(OpKind::Send).with_send(sent).with_peer(dst),
            self.desc::<T>(OpKind::Recv)
                .with_recv(received)
                .with_peer(src),
        )
    }

    /// Runs a `send_recv`: validates both halves, numbers them as a lone
    /// `send` and a lone `recv` would be (neither runs in the arena's
    /// rounds: [`uses_arena`](Self::uses_arena)), and runs the send, then
    /// the receive: one after the other where either half is small enough
    /// for a pair lane, else as one plan over the links
    /// ([`schedule::exchange`]), whose receives of 64 KiB or more are posted
    /// first out of place.
    fn run_exchange<T: Element>(
        &mut self,
        (sending, receiving): (CollectiveDesc, CollectiveDesc),
        bufs: Bufs<'_, T>,
    ) -> Result<()> {
        sending.validate()?;
        receiving.validate()?;
        if let Some(first) = &self.failed {
            return Err(Error::Failed {
                op: OpKind::Send,
                rank: self.rank,
                first_error: first.clone(),
            });
        }
        let send_info = self.number_call(&sending, false);
        let recv_info = self.number_call(&receiving, false);
        let Backend::Host(transport) = &self.backend;
        let order = transport.ring_order();
        let (send_links, recv_links) = (
            self.links_planner(&sending, order),
            self.links_planner(&receiving, order),
        );
        let (dst, src) = (sending.peer.unwrap_or(0), receiving.peer.unwrap_or(0));
        let bytes = |d: &CollectiveDesc| d.count() * d.dtype.size();
        let by_lane = bytes(&sending).min(bytes(&receiving)) <= pair_lanes::MAX_BYTES;
        let result = match self.arena.as_mut().filter(|a| a.has_pair_lanes()) {
            _ if transport.is_aborted() => Err(send_info.error(self.rank, TransportError::Aborted)),
            // Each half alone, the send first. A small one never waits (a
            // full lane sends over the links); a large one waits at most
            // for room in its link, reading what arrives meanwhile, as a
            // lone `send` does, and its receiver drains it whether it
            // receives or exchanges (its own send half then is small).
            Some(arena) if by_lane => match bufs {
                Bufs::OutOfPlace { send, recv } => {
                    send_by_lane(arena, transport, &send_info, (send, dst), send_links).and_then(
                        |()| recv_by_lane(arena, transport, &recv_info, (recv, src), recv_links),
                    )
                }
                Bufs::InPlace(buf) => {
                    send_by_lane(arena, transport, &send_info, (&*buf, dst), send_links).and_then(
                        |()| recv_by_lane(arena, transport, &recv_info, (buf, src), recv_links),
                    )
                }
            },
            arena => {
                let plan = schedule::exchange(
                    send_links.plan(),
                    recv_links.plan(),
                    matches!(bufs, Bufs::InPlace(_)),
                );
                recv_over_links(
                    arena.as_deref(),
                    &recv_info,
                    (src, bytes(&receiving)),
                    |elsewhere| {
                        let infos = (&send_info, &recv_info);
                        executor::execute_exchange(transport, infos, &plan, bufs, elsewhere)
                    },
                )
            }
        };
        if let Err(e) = &result {
            self.fail(e);
        }
        result
    }

    /// Makes `error` this communicator's first failure: every later call
    /// returns [`Error::Failed`] naming it, and the ranks waiting in the
    /// shared arena learn that this rank takes part in no further call.
    fn fail(&mut self, error: &Error) {
        let Backend::Host(transport) = &self.backend;
        record_failure(&mut self.failed, (transport, self.arena.as_ref()), error);
    }

    /// An all-reduce, broadcast, all-gather, reduce-scatter or reduce in
    /// the shared arena, straight from the typed entry points: small
    /// all-reduces in the lanes (see [`Arena::lane_all_reduce`]), the path
    /// of tensor-parallel decoding's per-layer calls, small broadcasts in the
    /// root's mailbox (see `Arena::mailbox_broadcast`), the others as
    /// `run_in_arena` runs them. It skips what `run` spends on a call
    /// (descriptor, validation, dispatch): a third of an 8-byte all-reduce,
    /// and a tenth of a 2 KiB zero-copy one between threads. An 8-byte
    /// broadcast (2 processes, near, medians of eight alternating rounds)
    /// ran 0.0878 → 0.0758 µs out of place and 0.0854 → 0.0678 in place
    /// with this path and the `Result`s taken apart (below); an 8-byte
    /// all-gather 0.0777 → 0.0587 µs and an 8-byte reduce-scatter 0.1018 →
    /// 0.0902 with this path (medians of both placements of twelve
    /// alternating rounds each); an 8-byte reduce 0.1023 → 0.0896 µs out
    /// of place and 0.0999 → 0.0859 in place (near, medians of ten
    /// alternating rounds, faster in all ten).
    ///
    /// `None` where `run` takes the call: no arena, `OXCCL_ALGO=ring` or `tree`, a
    /// failed communicator, nothing to move, or a root out of range (which
    /// `run` reports). `count` is the call's count as
    /// `CollectiveDesc::count` has it (per rank for all-gather and
    /// reduce-scatter), and `bufs` are what `run_in_arena` would make of
    /// valid slices: the caller checked the lengths as `validate` does
    /// (equal out of place for all-reduce and on a broadcast's or a
    /// reduce's root, the ignored buffer off the root (a broadcast's input,
    /// a reduce's output) empty or equal, `world · count` for the
    /// whole buffers of all-gather and reduce-scatter, the in-place ones
    /// through `in_place_buffers`). With the root checked here, that is all
    /// `validate` would check of these calls on host memory.
    ///
    /// Callers take the answer apart (`Some(Ok(()))` → `Ok(())`) rather
    /// than return the `Result` inside: a `Result` is the size of `Error`,
    /// and moving it whole copies it in 16-byte loads, the first of which
    /// waits for the callee's 8-byte store of `Ok` to reach the cache
    /// (the store cannot be forwarded to a wider load). In `perf record`
    /// of 8-byte broadcasts, the two loads after `run`'s call into the
    /// arena held about a fifth of the root's samples.
    #[inline]
    fn arena_fast<T: Element>(
        &mut self,
        call: FastCall,
        bufs: Buffers<T>,
        count: usize,
    ) -> Option<Result<()>> {
        let in_range = match call {
            FastCall::Broadcast { root } | FastCall::Reduce { root, .. } => root < self.world,
            FastCall::AllReduce(_) | FastCall::AllGather | FastCall::ReduceScatter(_) => true,
        };
        if count == 0 || !in_range || self.failed.is_some() || self.config.algo.links_only() {
            return None;
        }
        let arena = self.arena.as_mut()?;
        let Backend::Host(transport) = &self.backend;
        let ctx = transport.ctx();
        let seq = self.seq;
        self.seq += 1;
        let (op, reduce_op, root) = match call {
            FastCall::AllReduce(op) => (OpKind::AllReduce, Some(op), 0),
            FastCall::Broadcast { root } => (OpKind::Broadcast, None, root),
            FastCall::AllGather => (OpKind::AllGather, None, 0),
            FastCall::ReduceScatter(op) => (OpKind::ReduceScatter, Some(op), 0),
            FastCall::Reduce { op, root } => (OpKind::Reduce, Some(op), root),
        };
        let info = CallInfo {
            op,
            seq,
            space: Space::Collective,
            ctx,
            rank: self.rank,
            world: self.world,
            reduce_op: reduce_op.unwrap_or(ReduceOp::Sum),
            timeout: self.config.timeout,
            digest: 0,
        };
        // As `run_in_arena` signs the call.
        let sig = CallSig {
            seq,
            signature: arena::signature(op, T::DTYPE as u8, reduce_op, root, count)
                ^ self.segment_tag,
        };
        let bytes = count * std::mem::size_of::<T>();
        let result = if arena.aborted() {
            Err(info.error(self.rank, TransportError::Aborted))
        } else {
            match call {
                FastCall::AllReduce(op) if arena.lane_fits(bytes) => {
                    arena.lane_all_reduce(&info, &sig, bufs, count, op)
                }
                FastCall::AllReduce(op) => arena
                    .maybe_remeasure_stores(&info, bytes)
                    .and_then(|()| arena.all_reduce(&info, &sig, bufs, count, op)),
                FastCall::Broadcast { root } => arena
                    .maybe_remeasure_stores(&info, bytes)
                    .and_then(|()| arena.broadcast(&info, &sig, bufs, count, root)),
                FastCall::AllGather => arena
                    .maybe_remeasure_stores(&info, bytes)
                    .and_then(|()| arena.all_gather(&info, &sig, bufs, count)),
                FastCall::ReduceScatter(op) => arena
                    .maybe_remeasure_stores(&info, bytes)
                    .and_then(|()| arena.reduce_scatter(&info, &sig, bufs, count, op)),
                FastCall::Reduce { op, root } => arena
                    .maybe_remeasure_stores(&info, bytes)
                    .and_then(|()| arena.reduce(&info, &sig, bufs, count, op, root)),
            }
        };
        // Rebuilt rather than moved (see above).
        match result {
            Ok(()) => Some(Ok(())),
            Err(e) => {
                self.fail(&e);
                Some(Err(e))
            }
        }
    }

    /// Whether this call runs through the shared arena.
    fn uses_arena(&self, desc: &CollectiveDesc) -> bool {
        let arena_op = !matches!(desc.op, OpKind::Send | OpKind::Recv);
        arena_op && self.arena.is_some() && !self.config.algo.links_only()
    }

    /// The algorithm a collective of `bytes` (nccl-tests' size: the largest
    /// buffer) and element type `T` would use on this communicator, as
    /// `oxccl-perf` reports it: `zerocopy`, `lane`, `mailbox`, `oneshot`,
    /// `twoshot`, `cma`, `direct`, `ring`, `chain`, `doubling`, `binomial`
    /// or `dissemination`.
    pub fn algorithm_for<T: Element>(&self, op: OpKind, bytes: usize) -> &'static str {
        let elem = T::DTYPE.size();
        let desc = self.desc::<T>(op);
        if let (true, Some(arena)) = (self.uses_arena(&desc), &self.arena) {
            return arena.algorithm_name(op, bytes, elem);
        }
        if matches!(op, OpKind::Send | OpKind::Recv)
            && bytes <= pair_lanes::MAX_BYTES
            && self.arena.as_ref().is_some_and(Arena::has_pair_lanes)
        {
            return "lane";
        }
        // What the table sees: the largest buffer of the call.
        let desc = desc.with_recv(BufDesc {
            len: bytes / elem,
            memory: MemoryKind::Host,
        });
        let Backend::Host(transport) = &self.backend;
        let family = schedule::family_that_runs(&desc, self.plan_family(&desc));
        schedule::family_name_in(family, op, transport.ring_order())
    }

    /// [`algorithm_for`](Self::algorithm_for) a call that reduces by
    /// `reduce_op`: a premultiplied `Avg` (`f16`) runs as calls of at most
    /// 1 MiB of input each (scaled a segment at a time, see
    /// `avg_by_segments`), and this names what they use.
    pub fn algorithm_for_reduction<T: Element>(
        &self,
        op: OpKind,
        reduce_op: ReduceOp,
        bytes: usize,
    ) -> &'static str {
        let segmented = matches!(
            op,
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::Reduce
        ) && self.premultiplies::<T>(reduce_op);
        if !segmented {
            return self.algorithm_for::<T>(op, bytes);
        }
        // The segments' size as `avg_by_segments` cuts them (equal, so
        // the first stands for all).
        let parts = if op == OpKind::Reduce { 1 } else { self.world };
        let elem = std::mem::size_of::<T>();
        let longest = (bytes / elem).div_ceil(parts);
        let segments = longest.div_ceil(avg_segment_elements::<T>(parts)).max(1);
        if segments == 1 {
            return self.algorithm_for::<T>(op, bytes);
        }
        self.algorithm_for::<T>(op, longest.div_ceil(segments) * parts * elem)
    }

    /// How the last collective that ran in the shared arena reached its
    /// peers' buffers, when it did so directly: `zerocopy` (threads; or
    /// processes whose buffers all lie in one [`alloc_shared`](Self::alloc_shared)
    /// allocation) or `cma`; `None` when it was staged through the arena's
    /// slots or ran over the links. For tools that report what ran.
    pub fn last_direct_algorithm(&self) -> Option<&'static str> {
        self.arena.as_ref().and_then(Arena::last_direct_name)
    }

    /// The smallest call of `op` (bytes in its largest buffer) that the
    /// shared arena runs zero copy: between threads on any buffers, across
    /// processes on [`alloc_shared`](Self::alloc_shared) ones; `None`
    /// without an arena. For the checks in [`crate::check`].
    pub(crate) fn zero_copy_min_bytes(&self, op: OpKind) -> Option<usize> {
        self.arena
            .as_ref()
            .map(|arena| arena.zero_copy_min_bytes(op))
    }

    /// The pipeline piece size, in bytes, of a call of `op` that runs
    /// over the links (not in a shared arena): the one configured
    /// ([`CommConfig::chunk_bytes`]), or else [`DEFAULT_TCP_RING_CHUNK_BYTES`]
    /// for the ring collectives (all-reduce, reduce-scatter, all-gather)
    /// when every link among the ranks is TCP, and [`DEFAULT_CHUNK_BYTES`]
    /// for everything else. Every rank answers alike (peers cut the same
    /// frames).
    pub fn chunk_bytes_for(&self, op: OpKind) -> usize {
        if let Some(bytes) = self.config.chunk_bytes {
            return bytes;
        }
        let ring_collective = matches!(
            op,
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather
        );
        let Backend::Host(transport) = &self.backend;
        if ring_collective && transport.links_all_tcp() {
            DEFAULT_TCP_RING_CHUNK_BYTES
        } else {
            DEFAULT_CHUNK_BYTES
        }
    }

    /// The schedule family for a call over the links: forced by
    /// `OXCCL_ALGO`, else from the table by size and world size.
    fn plan_family(&self, desc: &CollectiveDesc) -> schedule::Family {
        match self.config.algo {
            Algo::Ring => schedule::Family::Ring,
            Algo::Direct => schedule::Family::Direct,
            Algo::Tree => schedule::Family::Tree,
            Algo::Auto => {
                let Backend::Host(transport) = &self.backend;
                schedule::choose_for(desc, transport.crowded_host())
            }
        }
    }

    /// Whether a reduction by `op` over `T` scales each rank's input by
    /// `1/world` before the call and then sums (`Avg` of `f16`, as NCCL's
    /// `ncclAvg`: see [`Kernels::AVG_PREMULTIPLIES`]). Every rank decides
    /// alike from the call's type and operator; the call keeps `Avg` in its
    /// signature, so a peer calling `Sum` is still a mismatch.
    ///
    /// [`Kernels::AVG_PREMULTIPLIES`]: crate::host::reduce::Kernels::AVG_PREMULTIPLIES
    /// A failed communicator does not scale: the call goes on to fail at
    /// once, with the first failure's cause.
    fn premultiplies<T: Element>(&self, op: ReduceOp) -> bool {
        op == ReduceOp::Avg && T::AVG_PREMULTIPLIES && self.world > 1 && self.failed.is_none()
    }

    /// A premultiplied `Avg` ([`premultiplies`](Self::premultiplies)) run
    /// as calls over consecutive segments of its input: each segment is
    /// scaled by `1/world` into the communicator's scratch, then reduced
    /// as a `Sum` would be by a call of its own.
    ///
    /// A segment takes the same range of every *part* of the input: the
    /// `world` chunks an all-reduce's ring cuts it into
    /// ([`ChunkLayout`](schedule::ChunkLayout)), a reduce-scatter's `world`
    /// blocks, or a reduce's whole input; the pieces are packed part after
    /// part. So each element keeps its chunk, and a ring folds its terms
    /// in the order one call would (the arena and the direct and chain
    /// schedules fold in an order that does not depend on the position).
    /// The parts are cut into segments of equal length, so a call larger
    /// than one segment runs segments of more than half of one, never a
    /// short tail that the table would give another schedule family than
    /// the whole call (see [`AVG_SEGMENT_BYTES`]). Hence the bits are those
    /// of one call summing the scaled inputs, and an all-reduce still
    /// equals the all-gather of its reduce-scatter. A reduce-scatter's and
    /// a reduce's segment reduces straight into its place in the output;
    /// an all-reduce's reduces in place in the scratch (its pieces lie
    /// apart in the output) and is copied out piece by piece, so the
    /// output is written only by segments that succeeded. Even with one
    /// segment, where it could reduce straight into the output: f16 Avg,
    /// 2 threads, four alternating rounds, µs out of / in place, 256 KiB
    /// 39–44 / 38–44 against 84–106 / 214–376 straight, 1 MiB 148–195 /
    /// 145–170 against 288–322 / 797–865 (the output is then wholly this
    /// rank's, where a zero-copy fold writes half of it from the peer's
    /// core); 2 processes, 1 MiB, 143–146 against 116–141.
    ///
    /// Why segments: the scratch then holds one segment whatever the
    /// call's size, where scaling the whole input first kept a copy as
    /// large as the largest input so far (NCCL scales inline and needs
    /// none); and the scaled segment is read back from cache, not from
    /// memory. Each segment is a call of its own (a sequence number, a
    /// deadline), the same number of them on every rank that passes the
    /// same count: the count depends only on the length, the type and the
    /// world size. Ranks passing different counts fail with a mismatch:
    /// every segment's signature carries the whole call's count
    /// ([`segment_tag`](Communicator::segment_tag)). An empty input still
    /// makes one (empty) call, as the unsegmented call did.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the system will not allocate the
    /// scratch (the communicator then fails: the peers have entered the
    /// call and this rank cannot follow them); else the first failing
    /// segment's error. A failure after the first segment leaves the
    /// output partly written, as any failed call may.
    fn avg_by_segments<T: Element>(
        &mut self,
        call: AvgCall,
        op: ReduceOp,
        mut bufs: AvgBufs<'_, T>,
    ) -> Result<()> {
        let (kind, parts) = match call {
            AvgCall::AllReduce => (OpKind::AllReduce, self.world),
            AvgCall::ReduceScatter { .. } => (OpKind::ReduceScatter, self.world),
            AvgCall::Reduce { .. } => (OpKind::Reduce, 1),
        };
        let whole_count = bufs.input().len();
        let layout = schedule::ChunkLayout::new(whole_count, parts, 1);
        // Part 0 is the longest (`ChunkLayout` gives the extra elements
        // to the first parts); it is cut into equal segments.
        let longest = layout.chunk(0).1;
        let count = longest.div_ceil(avg_segment_elements::<T>(parts)).max(1);
        let segments = schedule::ChunkLayout::new(longest, count, 1);
        for index in 0..count {
            let (start, len) = segments.chunk(index);
            let range = start..start + len;
            let pieces = (0..parts).map(|p| {
                let (offset, len) = layout.chunk(p);
                offset + range.start.min(len)..offset + range.end.min(len)
            });
            let mut scaled = self.scaled_segment(kind, bufs.input(), pieces.clone())?;
            self.segment_tag = segment_tag(whole_count, index);
            let result = match call {
                AvgCall::AllReduce => {
                    let result = self.all_reduce_in_place_as_given(scaled.elements_mut(), op);
                    if result.is_ok() {
                        let (output, mut from) = (bufs.output(), scaled.elements());
                        for piece in pieces {
                            let (this, rest) = from.split_at(piece.len());
                            output[piece].copy_from_slice(this);
                            from = rest;
                        }
                    }
                    result
                }
                AvgCall::ReduceScatter { at } => {
                    let out = &mut bufs.output()[at + range.start..at + range.end];
                    self.reduce_scatter_as_given(scaled.elements(), out, op)
                }
                AvgCall::Reduce { root } => {
                    let out: &mut [T] = if self.rank == root {
                        &mut bufs.output()[range.clone()]
                    } else {
                        &mut []
                    };
                    self.reduce_as_given(scaled.elements(), out, op, root)
                }
            };
            self.segment_tag = 0;
            self.keep_scratch(scaled);
            result?;
        }
        Ok(())
    }

    /// The `pieces` of `input` (ranges of it), scaled by `1/world` into
    /// the communicator's scratch one after another; the copy holds the
    /// scratch until [`keep_scratch`](Self::keep_scratch) gives it back.
    /// The scratch grows to one segment ([`AVG_SEGMENT_BYTES`]) and stays.
    fn scaled_segment<T: Element>(
        &mut self,
        call: OpKind,
        input: &[T],
        pieces: impl Iterator<Item = std::ops::Range<usize>> + Clone,
    ) -> Result<ScaledInput<T>> {
        let mut words = std::mem::take(&mut self.avg_scratch);
        let len: usize = pieces.clone().map(|piece| piece.len()).sum();
        let needed = (std::mem::size_of::<T>() * len).div_ceil(8);
        if words.len() < needed {
            if let Err(e) = words.try_reserve_exact(needed - words.len()) {
                self.avg_scratch = words;
                let error = Error::InvalidArgument {
                    op: call,
                    rank: self.rank,
                    arg: "len",
                    reason: format!(
                        "an Avg of {} elements of {} scales its input through a \
                         scratch of {len} elements, which could not be allocated: {e}",
                        input.len(),
                        T::DTYPE
                    ),
                };
                self.fail(&error);
                return Err(error);
            }
            words.resize(needed, 0);
        }
        let mut scaled: &mut [T] = &mut bytemuck::cast_slice_mut(&mut words[..needed])[..len];
        for piece in pieces {
            let (to, rest) = scaled.split_at_mut(piece.len());
            T::premultiply_avg(to, &input[piece], self.world);
            scaled = rest;
        }
        Ok(ScaledInput {
            words,
            len,
            _element: PhantomData,
        })
    }

    /// Gives the scratch that `scaled` holds back to the communicator.
    fn keep_scratch<T>(&mut self, scaled: ScaledInput<T>) {
        self.avg_scratch = scaled.words;
    }

    /// All-reduce: `recv[i]` = `op` over every rank's `send[i]`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `send.len() != recv.len()`; otherwise the
    /// communication errors ([`Error::Timeout`], [`Error::PeerLost`], ...).
    pub fn all_reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if self.premultiplies::<T>(op) && send.len() == recv.len() {
            let bufs = AvgBufs::OutOfPlace { send, recv };
            return self.avg_by_segments(AvgCall::AllReduce, op, bufs);
        }
        self.all_reduce_as_given(send, recv, op)
    }

    /// [`all_reduce`](Self::all_reduce) of `send` as it is (premultiplied
    /// already where the type's `Avg` premultiplies).
    fn all_reduce_as_given<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if send.len() == recv.len() {
            let bufs = Buffers {
                input: send.as_ptr(),
                output: recv.as_mut_ptr(),
                in_place: false,
            };
            match self.arena_fast(FastCall::AllReduce(op), bufs, send.len()) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        let desc = self
            .desc::<T>(OpKind::AllReduce)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv))
            .with_reduce_op(op);
        self.run(desc, Bufs::OutOfPlace { send, recv })
    }

    /// All-reduce in place: `buf[i]` becomes `op` over every rank's `buf[i]`.
    ///
    /// # Errors
    ///
    /// The communication errors, as [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_in_place<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if self.premultiplies::<T>(op) {
            // `buf` keeps its values until a segment's result is copied
            // in (a refused call leaves it).
            return self.avg_by_segments(AvgCall::AllReduce, op, AvgBufs::InPlace(buf));
        }
        self.all_reduce_in_place_as_given(buf, op)
    }

    /// [`all_reduce_in_place`](Self::all_reduce_in_place) of `buf` as it
    /// is (premultiplied already where the type's `Avg` premultiplies).
    fn all_reduce_in_place_as_given<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        // Both pointers come from one `as_mut_ptr`: a second reborrow of
        // `buf` would invalidate the first pointer, and the staged two-shot
        // reads the input after writing parts of the output.
        let base = buf.as_mut_ptr();
        let bufs = Buffers {
            input: base.cast_const(),
            output: base,
            in_place: true,
        };
        match self.arena_fast(FastCall::AllReduce(op), bufs, buf.len()) {
            Some(Ok(())) => return Ok(()),
            Some(Err(e)) => return Err(e),
            None => {}
        }
        let desc = self
            .desc::<T>(OpKind::AllReduce)
            .with_in_place(BufDesc::of(buf))
            .with_reduce_op(op);
        self.run(desc, Bufs::InPlace(buf))
    }

    /// Reduce-scatter: `send` holds `world_size()` blocks of `recv.len()`
    /// elements; `recv` = `op` over every rank's block `rank()`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `send.len() != recv.len() * world_size()`;
    /// otherwise the communication errors.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if self.premultiplies::<T>(op) && send.len() == recv.len() * self.world {
            let bufs = AvgBufs::OutOfPlace { send, recv };
            return self.avg_by_segments(AvgCall::ReduceScatter { at: 0 }, op, bufs);
        }
        self.reduce_scatter_as_given(send, recv, op)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) of `send` as it is.
    fn reduce_scatter_as_given<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if recv.len().checked_mul(self.world) == Some(send.len()) {
            let bufs = Buffers {
                input: send.as_ptr(),
                output: recv.as_mut_ptr(),
                in_place: false,
            };
            match self.arena_fast(FastCall::ReduceScatter(op), bufs, recv.len()) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        let desc = self
            .desc::<T>(OpKind::ReduceScatter)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv))
            .with_reduce_op(op);
        self.run(desc, Bufs::OutOfPlace { send, recv })
    }

    /// Reduce-scatter in place: with `c = buf.len() / world_size()`, the
    /// result lands in `buf[rank*c .. (rank+1)*c]` (NCCL's convention); the
    /// rest of `buf` is left unspecified.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `buf.len()` is not a multiple of the
    /// world size; otherwise the communication errors.
    pub fn reduce_scatter_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if self.premultiplies::<T>(op) && buf.len().is_multiple_of(self.world) {
            // A segment's result lands in this rank's block, where later
            // segments read only past it.
            let at = self.rank * (buf.len() / self.world);
            let call = AvgCall::ReduceScatter { at };
            return self.avg_by_segments(call, op, AvgBufs::InPlace(buf));
        }
        if buf.len().is_multiple_of(self.world) {
            let count = buf.len() / self.world;
            // SAFETY: buf holds world·count elements.
            let bufs = unsafe {
                in_place_buffers(OpKind::ReduceScatter, buf.as_mut_ptr(), self.rank, count)
            };
            match self.arena_fast(FastCall::ReduceScatter(op), bufs, count) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        let desc = self
            .desc::<T>(OpKind::ReduceScatter)
            .with_in_place(BufDesc::of(buf))
            .with_reduce_op(op);
        self.run(desc, Bufs::InPlace(buf))
    }

    /// All-gather: `recv` is every rank's `send`, concatenated in rank order.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `recv.len() != send.len() * world_size()`;
    /// otherwise the communication errors.
    pub fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        if send.len().checked_mul(self.world) == Some(recv.len()) {
            let bufs = Buffers {
                input: send.as_ptr(),
                output: recv.as_mut_ptr(),
                in_place: false,
            };
            match self.arena_fast(FastCall::AllGather, bufs, send.len()) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        let desc = self
            .desc::<T>(OpKind::AllGather)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv));
        self.run(desc, Bufs::OutOfPlace { send, recv })
    }

    /// All-gather in place: each rank's part is already at
    /// `buf[rank*c .. (rank+1)*c]` with `c = buf.len() / world_size()`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `buf.len()` is not a multiple of the
    /// world size; otherwise the communication errors.
    pub fn all_gather_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        if buf.len().is_multiple_of(self.world) {
            let count = buf.len() / self.world;
            // SAFETY: buf holds world·count elements.
            let bufs =
                unsafe { in_place_buffers(OpKind::AllGather, buf.as_mut_ptr(), self.rank, count) };
            match self.arena_fast(FastCall::AllGather, bufs, count) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        let desc = self
            .desc::<T>(OpKind::AllGather)
            .with_in_place(BufDesc::of(buf));
        self.run(desc, Bufs::InPlace(buf))
    }

    /// Broadcast: every rank's `recv` becomes the root's `send`. Off the root
    /// `send` is ignored and may be empty.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a root out of range or mismatched
    /// lengths; otherwise the communication errors.
    pub fn broadcast<T: Element>(&mut self, send: &[T], recv: &mut [T], root: Rank) -> Result<()> {
        let lengths_valid = if root == self.rank {
            send.len() == recv.len()
        } else {
            send.is_empty() || send.len() == recv.len()
        };
        if lengths_valid {
            let bufs = Buffers {
                input: send.as_ptr(),
                output: recv.as_mut_ptr(),
                in_place: false,
            };
            let call = FastCall::Broadcast { root };
            match self.arena_fast(call, bufs, recv.len()) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        let desc = self
            .desc::<T>(OpKind::Broadcast)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv))
            .with_root(root);
        self.run(desc, Bufs::OutOfPlace { send, recv })
    }

    /// Broadcast in place: every rank's `buf` becomes the root's.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a root out of range; otherwise the
    /// communication errors.
    pub fn broadcast_in_place<T: Element>(&mut self, buf: &mut [T], root: Rank) -> Result<()> {
        let base = buf.as_mut_ptr();
        let bufs = Buffers {
            input: base.cast_const(),
            output: base,
            in_place: true,
        };
        match self.arena_fast(FastCall::Broadcast { root }, bufs, buf.len()) {
            Some(Ok(())) => return Ok(()),
            Some(Err(e)) => return Err(e),
            None => {}
        }
        let desc = self
            .desc::<T>(OpKind::Broadcast)
            .with_in_place(BufDesc::of(buf))
            .with_root(root);
        self.run(desc, Bufs::InPlace(buf))
    }

    /// Reduce: the root's `recv` = `op` over every rank's `send`. Off the root
    /// `recv` is not touched and may be empty.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a root out of range or mismatched
    /// lengths; otherwise the communication errors.
    pub fn reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<()> {
        // A root out of range, or an output of the wrong length (off the
        // root: neither empty nor the input's), is refused by `run`,
        // before any scaling. Off the root `recv` is not touched: each
        // segment gets an empty one.
        if self.premultiplies::<T>(op)
            && root < self.world
            && (recv.len() == send.len() || (self.rank != root && recv.is_empty()))
        {
            let bufs = AvgBufs::OutOfPlace { send, recv };
            return self.avg_by_segments(AvgCall::Reduce { root }, op, bufs);
        }
        self.reduce_as_given(send, recv, op, root)
    }

    /// [`reduce`](Self::reduce) of `send` as it is.
    fn reduce_as_given<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<()> {
        // Lengths as `validate` checks them; the root is checked by
        // `arena_fast`.
        let lengths_valid = if root == self.rank {
            recv.len() == send.len()
        } else {
            recv.is_empty() || recv.len() == send.len()
        };
        if lengths_valid {
            let bufs = Buffers {
                input: send.as_ptr(),
                output: recv.as_mut_ptr(),
                in_place: false,
            };
            match self.arena_fast(FastCall::Reduce { op, root }, bufs, send.len()) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        let desc = self
            .desc::<T>(OpKind::Reduce)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv))
            .with_reduce_op(op)
            .with_root(root);
        self.run(desc, Bufs::OutOfPlace { send, recv })
    }

    /// Reduce in place: the root's `buf` becomes `op` over every rank's `buf`;
    /// other ranks' buffers are left unchanged.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a root out of range; otherwise the
    /// communication errors.
    pub fn reduce_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<()> {
        if self.premultiplies::<T>(op) && root < self.world {
            // Off the root `buf` stays as it is: an out-of-place reduce
            // leaves a non-root's output alone (it gets an empty one).
            return self.avg_by_segments(AvgCall::Reduce { root }, op, AvgBufs::InPlace(buf));
        }
        let base = buf.as_mut_ptr();
        let bufs = Buffers {
            input: base.cast_const(),
            output: base,
            in_place: true,
        };
        match self.arena_fast(FastCall::Reduce { op, root }, bufs, buf.len()) {
            Some(Ok(())) => return Ok(()),
            Some(Err(e)) => return Err(e),
            None => {}
        }
        let desc = self
            .desc::<T>(OpKind::Reduce)
            .with_in_place(BufDesc::of(buf))
            .with_reduce_op(op)
            .with_root(root);
        self.run(desc, Bufs::InPlace(buf))
    }

    /// Sends `buf` to `peer`, which must call [`recv`](Self::recv) with the
    /// same length. Messages between a pair arrive in the order sent.
    ///
    /// Returns once the whole message has left this rank: at once when it
    /// fits what the link buffers (a shared-memory ring, 1 MiB by default,
    /// `OXCCL_SHM_RING_BYTES`; socket buffers of up to 4 MiB), else as the
    /// peer reads it, which the peer does inside any call of its own on
    /// this job (reading up to 16 MiB ahead of its receives). So, like
    /// `MPI_Send` of a large message, a send larger than the link's buffer
    /// waits for the peer to enter a call, for at most the communicator's
    /// timeout: a peer still computing past that makes this send fail with
    /// [`Error::Timeout`], which fails the communicator. Ranks that send to
    /// each other before receiving complete too (each reads the others'
    /// messages while it waits), but far slower than with
    /// [`send_recv`](Self::send_recv), which is for exchanges.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a peer out of range or equal to this rank.
    pub fn send<T: Element>(&mut self, buf: &[T], peer: Rank) -> Result<()> {
        let desc = self
            .desc::<T>(OpKind::Send)
            .with_send(BufDesc::of(buf))
            .with_peer(peer);
        self.run(
            desc,
            Bufs::OutOfPlace {
                send: buf,
                recv: &mut [],
            },
        )
    }

    /// Sends `send` to `dst` and receives into `recv` the next message `src`
    /// sent to this rank, both at once (`MPI_Sendrecv`; NCCL's `ncclSend`
    /// and `ncclRecv` in one group). Use it whenever ranks exchange: each
    /// rank sending to the next of a ring and receiving from the previous
    /// (ring attention's key/value blocks), pipeline stages passing
    /// activations forward and gradients back, halo exchanges.
    ///
    /// Each half is exactly a lone [`send`](Self::send) or
    /// [`recv`](Self::recv): it meets the peer's `recv` or `send`, or the
    /// other half of the peer's `send_recv`, in the order of this pair's
    /// other messages; the peer may also receive its whole message before
    /// sending (`recv`, then `send`). Unlike a `send` followed by a `recv`,
    /// the receive is under way while the send leaves. Across processes,
    /// pieces of 64 KiB or more land straight in `recv` (posted when the
    /// call starts) and the send lends `send` to the link rather than
    /// copying it; with a `send` then a `recv` on both ranks, a `send`
    /// larger than the link's buffer waits for room while the peer, also
    /// sending, leaves this rank's message in the link and, once its wait
    /// stalls, reads it into buffers of its own to copy later. `dst` and
    /// `src` may be the same peer, or different.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a peer out of range or equal to this
    /// rank (naming the `send` or `recv` half); [`Error::Mismatch`] when the
    /// message received differs in length or type; the communication
    /// errors, naming the half that failed.
    pub fn send_recv<T: Element>(
        &mut self,
        send: &[T],
        dst: Rank,
        recv: &mut [T],
        src: Rank,
    ) -> Result<()> {
        let halves = self.exchange_descs::<T>((BufDesc::of(send), dst), (BufDesc::of(recv), src));
        self.run_exchange(halves, Bufs::OutOfPlace { send, recv })
    }

    /// [`send_recv`](Self::send_recv) with one buffer
    /// (`MPI_Sendrecv_replace`): sends `buf` to `dst` and replaces it with
    /// the message from `src`, of the same length. Across processes the
    /// sends lend `buf` to the links, and each piece received first copies
    /// the pieces still queued for `dst` that cover its span (whole, even
    /// one the link has partly taken) into frames of their own; the peer's
    /// pieces cannot be posted ahead into a buffer still being sent, so
    /// they land when their turn comes (`send_recv` with two buffers posts
    /// them all at once).
    ///
    /// # Errors
    ///
    /// As [`send_recv`](Self::send_recv).
    pub fn send_recv_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        dst: Rank,
        src: Rank,
    ) -> Result<()> {
        let halves = self.exchange_descs::<T>((BufDesc::of(buf), dst), (BufDesc::of(buf), src));
        self.run_exchange(halves, Bufs::InPlace(buf))
    }

    /// Receives into `buf` the next message `peer` sent to this rank.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad peer; [`Error::Mismatch`] when
    /// the message's length differs; the communication errors.
    pub fn recv<T: Element>(&mut self, buf: &mut [T], peer: Rank) -> Result<()> {
        let desc = self
            .desc::<T>(OpKind::Recv)
            .with_recv(BufDesc::of(buf))
            .with_peer(peer);
        self.run(
            desc,
            Bufs::OutOfPlace {
                send: &[],
                recv: buf,
            },
        )
    }

    /// All-to-all: block `p` of `send` goes to rank `p`; block `p` of `recv`
    /// comes from rank `p` (blocks of `len / world_size()` elements).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for unequal lengths or a length that is not
    /// a multiple of the world size; the communication errors.
    pub fn all_to_all<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        let desc = self
            .desc::<T>(OpKind::AllToAll)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv));
        self.run(desc, Bufs::OutOfPlace { send, recv })
    }

    /// Allocates `len` zeroed elements that every rank's collectives can
    /// reach directly — the CPU counterpart of NCCL's `ncclMemAlloc` and
    /// symmetric memory. Collective: every rank calls it with the same
    /// `len`, in the same order as its other collectives.
    ///
    /// Across processes of one host (shared-memory arena), each rank's
    /// buffer is a shared-memory segment every peer maps, and a collective
    /// whose buffers on every rank lie in one such allocation (e.g.
    /// `all_reduce_in_place(&mut buf, ..)` on every rank) runs zero-copy:
    /// ranks fold straight out of each other's buffers. Between threads, and
    /// over TCP or with `OXCCL_ALGO=ring` or `tree`, it is ordinary memory (threads
    /// already run zero-copy on any buffer). One exception across
    /// processes: an `f16` Avg reduces a scaled copy of its input (see
    /// [`ReduceOp::Avg`](crate::ReduceOp) in `types`), which no peer maps,
    /// so it runs staged. See `docs/performance.md`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `len` elements overflow `usize`
    /// bytes; [`Error::Bootstrap`] naming the rank whose segment could not be
    /// created or mapped (e.g. `/dev/shm` full); [`Error::Timeout`],
    /// [`Error::PeerLost`] or [`Error::Mismatch`] when the ranks do not all
    /// take part.
    pub fn alloc_shared<T: Element>(&mut self, len: usize) -> Result<SharedBuffer<T>> {
        // At most isize::MAX bytes (Rust's limit for one allocation), less
        // the page the segment header takes.
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b <= isize::MAX as usize - 4096)
            .ok_or_else(|| Error::InvalidArgument {
                op: OpKind::AllocShared,
                rank: self.rank,
                arg: "len",
                reason: format!("{len} elements are more than one allocation can hold"),
            })?;
        if let Some(first) = &self.failed {
            return Err(Error::Failed {
                op: OpKind::AllocShared,
                rank: self.rank,
                first_error: first.clone(),
            });
        }
        // As every call after an abort, this one fails (and takes the
        // communicator down): without the check a group of one, or the last
        // rank into the arena's agreement, would hand out a buffer.
        let Backend::Host(transport) = &self.backend;
        if transport.is_aborted() {
            let aborted = Error::Aborted {
                op: OpKind::AllocShared,
                seq: self.seq,
                rank: self.rank,
            };
            self.fail(&aborted);
            return Err(aborted);
        }
        let uses_arena = self.arena.is_some() && !self.config.algo.links_only();
        let region = match self.arena.as_mut() {
            Some(arena) if uses_arena => {
                self.seq += 1;
                let Backend::Host(transport) = &self.backend;
                let info = CallInfo {
                    op: OpKind::AllocShared,
                    seq: self.seq - 1,
                    space: Space::Collective,
                    ctx: transport.ctx(),
                    rank: self.rank,
                    world: self.world,
                    reduce_op: ReduceOp::Sum,
                    timeout: self.config.timeout,
                    digest: 0,
                };
                let sig = CallSig {
                    seq: info.seq,
                    signature: arena::signature(OpKind::AllocShared, 0, None, 0, bytes),
                };
                let region = arena.alloc_shared(&info, &sig, bytes);
                // A failed set-up (`Bootstrap`: a segment could not be made
                // or mapped) fails alike on every rank, which stay in step;
                // a broken round (timeout, lost peer) breaks the communicator.
                if let Err(e) = &region {
                    if !matches!(e, Error::Bootstrap { .. }) {
                        self.fail(e);
                    }
                }
                region?
            }
            _ => Arc::new(
                SharedRegion::heap(0, bytes).ok_or_else(|| Error::Bootstrap {
                    context: format!("rank {}: alloc_shared", self.rank),
                    detail: format!("the system would not allocate {bytes} bytes"),
                })?,
            ),
        };
        Ok(SharedBuffer::new(region, len))
    }

    /// Returns once every rank has entered the barrier.
    ///
    /// # Errors
    ///
    /// The communication errors.
    pub fn barrier(&mut self) -> Result<()> {
        let desc = self.desc::<u8>(OpKind::Barrier);
        self.run::<u8>(
            desc,
            Bufs::OutOfPlace {
                send: &[],
                recv: &mut [],
            },
        )
    }

    /// Splits into sub-communicators: ranks with the same `color` form one,
    /// ordered by `(key, parent rank)`. Collective over this communicator.
    ///
    /// Every color forms a group, `u32::MAX` included: code ported from
    /// NCCL that passes `NCCL_SPLIT_NOCOLOR` (-1, which is `u32::MAX` cast)
    /// to opt out should call [`split_or_none`](Self::split_or_none) with
    /// `None` instead.
    ///
    /// # Errors
    ///
    /// The communication errors.
    pub fn split(&mut self, color: u32, key: i64) -> Result<Communicator> {
        self.split_or_none(Some(color), key)?
            .ok_or_else(|| Error::Failed {
                op: OpKind::Split,
                rank: self.rank,
                first_error: "split with a color produced no group".into(),
            })
    }

    /// As [`split`](Self::split), where `None` (NCCL's `NCCL_SPLIT_NOCOLOR`)
    /// joins no group and returns `Ok(None)`.
    ///
    /// # Errors
    ///
    /// The communication errors. Every `Some` color, `u32::MAX` included, is
    /// an ordinary group; only `None` joins none.
    pub fn split_or_none(&mut self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let seq = self.seq;
        let mut table = vec![0u64; 2 * self.world];
        table[2 * self.rank] = color.map_or(NO_COLOR, u64::from);
        table[2 * self.rank + 1] = key as u64;
        let desc = CollectiveDesc::new(
            OpKind::Split,
            DType::U64,
            self.rank,
            self.world,
            MemoryKind::Host,
        )
        .with_in_place(BufDesc::of(&table[..]));
        let in_arena = self.uses_arena(&desc);
        self.run(desc, Bufs::InPlace(&mut table[..]))?;
        let members: Option<Vec<Rank>> = color.map(|color| {
            let mut members: Vec<(i64, Rank)> = (0..self.world)
                .filter(|&r| table[2 * r] == u64::from(color))
                .map(|r| (table[2 * r + 1] as i64, r))
                .collect();
            members.sort_unstable();
            members.into_iter().map(|(_, r)| r).collect()
        });
        let Backend::Host(transport) = &self.backend;
        let ctx = child_ctx(transport.ctx(), seq, color.unwrap_or(u32::MAX));
        // Every parent rank, in or out of a group, takes part in making the
        // groups' arenas (rounds of the parent's arena).
        let child_arena = match (in_arena, self.arena.as_mut()) {
            (true, Some(arena)) => {
                let info = CallInfo {
                    op: OpKind::Split,
                    seq,
                    space: Space::Collective,
                    ctx: transport.ctx(),
                    rank: self.rank,
                    world: self.world,
                    reduce_op: ReduceOp::Sum,
                    timeout: self.config.timeout,
                    digest: 0,
                };
                let made = arena.make_child(&info, seq, members.as_deref(), ctx);
                if let Err(e) = &made {
                    // `fail`, with the transport still borrowed.
                    record_failure(&mut self.failed, (transport, Some(&*arena)), e);
                }
                made?
            }
            _ => None,
        };
        let Some(members) = members else {
            return Ok(None);
        };
        let new_rank = members.iter().position(|&r| r == self.rank).unwrap_or(0);
        let child = transport.child(ctx, &members, new_rank);
        let mut comm = Communicator::new(new_rank, members.len(), self.config.clone(), child);
        comm.arena = child_arena;
        Ok(Some(comm))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte counts with and without suffixes, as `OXCCL_CHUNK_BYTES`,
    /// `OXCCL_SHM_RING_BYTES` and the tools' flags take them; anything else
    /// is refused, never misread or a panic.
    #[test]
    fn byte_sizes_take_k_m_g_suffixes() {
        assert_eq!(parse_byte_size("262144"), Some(262_144));
        assert_eq!(parse_byte_size(" 256K "), Some(262_144));
        assert_eq!(parse_byte_size("256k"), Some(262_144));
        assert_eq!(parse_byte_size("1M"), Some(1 << 20));
        assert_eq!(parse_byte_size("2g"), Some(2 << 30));
        assert_eq!(parse_byte_size("0"), Some(0));
        assert_eq!(
            parse_byte_size("+4K"),
            Some(4096),
            "as usize's parse allows"
        );
        for bad in [
            "5\u{FF2B}",
            "5\u{212A}",
            "",
            "K",
            "1.5M",
            "-1",
            "12X",
            "1 M",
            "64MiB",
            "١٢",
            "99999999999999999999G",
        ] {
            assert_eq!(parse_byte_size(bad), None, "{bad:?}");
        }
    }

    /// A premultiplied `Avg` far larger than a segment keeps a scratch of
    /// one segment, not of its input (it kept 6 MiB here before segments),
    /// for every call that scales, in and out of place.
    #[test]
    fn f16_avg_scratch_stays_one_segment() {
        let comms = Communicator::local_group(2).unwrap();
        let count = 3 << 20;
        std::thread::scope(|scope| {
            for mut comm in comms {
                scope.spawn(move || {
                    let input = vec![half::f16::ONE; count];
                    let mut out = vec![half::f16::ZERO; count];
                    comm.all_reduce(&input, &mut out, ReduceOp::Avg).unwrap();
                    assert!(out.iter().all(|v| *v == half::f16::ONE));
                    comm.all_reduce_in_place(&mut out, ReduceOp::Avg).unwrap();
                    comm.reduce_scatter_in_place(&mut out, ReduceOp::Avg)
                        .unwrap();
                    comm.reduce(&input, &mut out, ReduceOp::Avg, 1).unwrap();
                    let scratch_bytes = comm.avg_scratch.len() * 8;
                    assert!(
                        scratch_bytes > 0 && scratch_bytes <= AVG_SEGMENT_BYTES,
                        "{scratch_bytes} bytes of scratch"
                    );
                });
            }
        });
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("30"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("0"), None);
        assert_eq!(parse_duration("soon"), None);
        // Beyond a Duration: as long as allowed, not a panic.
        assert_eq!(parse_duration("1e20"), Some(Duration::MAX));
        assert_eq!(parse_duration("1e307m"), Some(Duration::MAX));
        assert_eq!(bounded_timeout(Duration::MAX), MAX_TIMEOUT);
        assert_eq!(bounded_timeout(Duration::ZERO), Duration::from_millis(1));
        assert_eq!(bounded_timeout(DEFAULT_TIMEOUT), DEFAULT_TIMEOUT);
    }

    #[test]
    fn a_world_past_the_most_ranks_is_an_error_before_anything_is_allocated() {
        let most = crate::bootstrap::MAX_WORLD_SIZE;
        assert!(check_rank(0, most).is_ok());
        let e = check_rank(0, most + 1).unwrap_err().to_string();
        assert!(e.contains("at most 65536"), "{e}");
        let e = Communicator::builder()
            .local_group(10_000_000_000_000)
            .err();
        assert!(e.is_some_and(|e| e.to_string().contains("at most")));
        // Named as the call that was made, not as a split.
        let e = check_rank(5, 4).unwrap_err().to_string();
        assert!(e.contains("init") && !e.contains("split"), "{e}");
    }

    #[test]
    fn slot_store_settings_parse() {
        let auto = |remeasure| Some(ShmStores::Auto { remeasure });
        assert_eq!(
            ShmStores::from_name("auto"),
            auto(Some(DEFAULT_SHM_STORES_REMEASURE))
        );
        assert_eq!(
            ShmStores::from_name(""),
            auto(Some(DEFAULT_SHM_STORES_REMEASURE))
        );
        assert_eq!(
            ShmStores::from_name("AUTO:10"),
            auto(Some(Duration::from_secs(10)))
        );
        assert_eq!(
            ShmStores::from_name("auto:500ms"),
            auto(Some(Duration::from_millis(500)))
        );
        // Zero in any unit the timeout takes: set-up only.
        for zero in ["auto:0", "auto:0s", "auto:0ms", "auto:0.0"] {
            assert_eq!(ShmStores::from_name(zero), auto(None), "{zero}");
        }
        assert_eq!(ShmStores::from_name(" cached "), Some(ShmStores::Cached));
        assert_eq!(
            ShmStores::from_name("streaming"),
            Some(ShmStores::Streaming)
        );
        for bad in ["auto:", "auto:soon", "auto:-1", "sideways", "cached:1"] {
            assert_eq!(ShmStores::from_name(bad), None, "{bad:?}");
        }
        assert_eq!(CommConfig::default().shm_stores, ShmStores::default());
    }

    #[test]
    fn communicator_is_send_not_sync() {
        fn assert_send<T: Send>() {}
        assert_send::<Communicator>();
        // !Sync is checked by the compile_fail doc test on `Communicator`.
    }
}
