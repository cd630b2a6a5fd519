//! The cuda-ring executor: runs lowered plans ([`super::lower`]) on GPU
//! streams, for ranks that are threads of one process or processes of one
//! host — several per GPU allowed (single-GPU machines, tests) or one per
//! GPU.
//!
//! Each rank owns a stream, its inboxes (one per sending peer, grown to the
//! largest call seen) and its [`Links`] to the others. Between processes
//! the links are CUDA IPC handles over a host control channel
//! ([`super::ipc`]); between threads the [`RingGroup`] is the host-side
//! meeting point: per ordered pair of ranks a mailbox in which the receiver
//! publishes its inbox and *ready* event for each call, and the sender posts
//! one event per message. Every host-side wait has the communicator's
//! deadline and notices an aborted group or a departed peer; GPU-side
//! ordering is by events only (`cuStreamWaitEvent`), so the CPU threads
//! enqueue and move on.
//!
//! A receiver's ready also carries its call buffers: a peer-direct call
//! ([`super::lower::lower_peer_direct`], threads only) reads and writes
//! them straight, with no inbox.
//!
//! Paths between a pair (printed with `OXCCL_DEBUG=INFO`):
//! - *same GPU*: the inbox is device memory, copies and kernels use it
//!   directly;
//! - *peer access*: ranks on different GPUs with peer access enabled both
//!   ways: the inbox is on the receiver's GPU, the sender's copies and fused
//!   kernels write it directly;
//! - *host-staged*: no peer access, or `OXCCL_P2P_DISABLE=1`: the inbox is
//!   pinned host memory mapped into both GPUs' address space; the sender
//!   writes it, the receiver reads it (over PCIe).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};

use super::ipc::{Handle, InboxDesc, RemoteLinks, SharedInbox};
use super::lower::{layout_digest, At, DevOp, Lowered, Mem, PeerDirectCall};
use crate::error::{Error, Result};
use crate::schedule::BufId;
use crate::types::{DType, OpKind, Rank, ReduceOp};

/// Up to [`super::lower::PEER_DIRECT_MAX_WORLD`] device addresses, passed
/// to a kernel by value (`struct Ptrs` in `kernels.cu`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KernelPtrs([u64; super::lower::PEER_DIRECT_MAX_WORLD]);

// SAFETY: plain old data with the kernel parameter's C layout.
unsafe impl cudarc::driver::DeviceRepr for KernelPtrs {}

/// Whether `OXCCL_P2P_DISABLE` forces the host-staged path (NCCL's
/// `NCCL_P2P_DISABLE`).
pub(crate) fn p2p_disabled() -> bool {
    std::env::var("OXCCL_P2P_DISABLE").is_ok_and(|v| v.trim() == "1")
}

/// How one ordered pair of ranks moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Path {
    /// Both ranks on one GPU.
    SameGpu,
    /// Different GPUs with peer access.
    PeerAccess,
    /// Through pinned host memory.
    HostStaged,
}

impl Path {
    /// The inverse of `path as u8` (ranks in separate processes exchange
    /// their decisions as bytes).
    pub(crate) fn from_u8(code: u8) -> Option<Path> {
        [Path::SameGpu, Path::PeerAccess, Path::HostStaged]
            .into_iter()
            .find(|&p| p as u8 == code)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Path::SameGpu => "same GPU",
            Path::PeerAccess => "peer access",
            Path::HostStaged => "host-staged (pinned memory)",
        }
    }
}

/// What the receiver publishes to one sender for one call in which it
/// expects data from it.
struct Ready {
    inbox: CUdeviceptr,
    /// Bytes the receiver expects from this sender in the call.
    bytes: usize,
    /// Messages it expects (equal bytes in another number of messages
    /// would desynchronise the pair), and their sizes in order
    /// ([`super::lower::layout_digest`]).
    messages: usize,
    layout: u32,
    event: Arc<CudaEvent>,
    /// The receiver's buffers of the call, which a peer-direct call
    /// ([`super::lower::lower_peer_direct`]) reads and writes.
    bufs: CallBufs,
    /// The receiver's peer-direct call, which the sender's must match
    /// before it touches those buffers.
    peer_direct: Option<PeerDirectCall>,
}

/// One ordered pair's mailbox, written under its mutex. Both queues are
/// FIFO: the k-th call in which the sender writes to the receiver uses the
/// receiver's k-th ready inbox, and the k-th message is the k-th receive —
/// the same pairing as the host transports' (calls in the same order on
/// every rank; point-to-point matched in order per pair).
#[derive(Default)]
struct PairState {
    readies: VecDeque<Ready>,
    messages: VecDeque<Arc<CudaEvent>>,
    /// Waiters asleep on `changed` (a push wakes them; with none asleep it
    /// skips the futex call).
    sleepers: usize,
}

#[derive(Default)]
struct Pair {
    state: Mutex<PairState>,
    changed: Condvar,
    /// Bumped, under the lock, by every push: what a spinning waiter
    /// watches without taking the lock.
    version: AtomicU64,
}

impl Pair {
    /// Pushes with `push` and wakes the waiter if it sleeps.
    fn publish(&self, push: impl FnOnce(&mut PairState)) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        push(&mut state);
        self.version.fetch_add(1, Ordering::Release);
        if state.sleepers > 0 {
            self.changed.notify_all();
        }
    }
}

/// How long a host thread waiting for a peer's ready or message spins
/// before it sleeps on the pair's condvar. Handoffs between the ranks'
/// threads are on every call's critical path (the next step needs the
/// peer's event), and on the H200 a 2-rank call waited 5–9 µs per handoff
/// while a sleeping waiter's wake-up and the poster's futex call cost
/// several µs more; past this the waiter sleeps, so idle ranks do not burn
/// a core.
const HANDOFF_SPIN: Duration = Duration::from_micros(50);

/// The host-side meeting point of a group of ranks in one process.
pub(crate) struct RingGroup {
    world: usize,
    /// `pairs[from * world + to]`.
    pairs: Vec<Pair>,
    paths: Vec<Path>,
    aborted: AtomicBool,
    departed: Vec<AtomicBool>,
    /// The kernels, loaded once per GPU (shared with groups split from
    /// this one, so a split does not JIT-compile them again).
    modules: Arc<Mutex<HashMap<usize, Arc<CudaModule>>>>,
    /// Splits in progress, keyed by the parent's call number.
    splits: Mutex<HashMap<u64, SplitTable>>,
    splits_changed: Condvar,
}

/// What a rank brings to a split: its color, key and GPU.
type SplitEntry = (Option<u32>, i64, Arc<CudaContext>);

/// One split: every rank's entry, then the groups made.
struct SplitTable {
    entries: Vec<Option<SplitEntry>>,
    children: HashMap<u32, Arc<RingGroup>>,
    /// Ranks that have read the full table (the last one removes it).
    done: usize,
}

/// How long a host-side wait sleeps between checks of abort and departure.
const WAKE: Duration = Duration::from_millis(50);

impl RingGroup {
    /// A group of `devices.len()` ranks, rank `i` on GPU `devices[i]`,
    /// deciding each pair's path (enabling peer access where needed).
    pub(crate) fn new(contexts: &[Arc<CudaContext>]) -> Result<Arc<RingGroup>> {
        Self::with_modules(contexts, Arc::default())
    }

    fn with_modules(
        contexts: &[Arc<CudaContext>],
        modules: Arc<Mutex<HashMap<usize, Arc<CudaModule>>>>,
    ) -> Result<Arc<RingGroup>> {
        let world = contexts.len();
        let devices: Vec<usize> = contexts.iter().map(|c| c.ordinal()).collect();
        let disabled = p2p_disabled();
        let mut paths = vec![Path::SameGpu; world * world];
        for from in 0..world {
            for to in 0..world {
                let path = if disabled {
                    Path::HostStaged
                } else if devices[from] == devices[to] {
                    Path::SameGpu
                } else if peer_access(&contexts[from], &contexts[to])
                    && peer_access(&contexts[to], &contexts[from])
                {
                    Path::PeerAccess
                } else {
                    Path::HostStaged
                };
                paths[from * world + to] = path;
                if crate::comm::debug_info() && from != to {
                    crate::comm::info_line(format_args!(
                        "cuda-ring: rank {from} (GPU {}) -> rank {to} (GPU {}): {}{}",
                        devices[from],
                        devices[to],
                        path.name(),
                        if disabled {
                            " [OXCCL_P2P_DISABLE=1]"
                        } else {
                            ""
                        }
                    ));
                }
            }
        }
        Ok(Arc::new(RingGroup {
            world,
            pairs: (0..world * world).map(|_| Pair::default()).collect(),
            paths,
            aborted: AtomicBool::new(false),
            departed: (0..world).map(|_| AtomicBool::new(false)).collect(),
            modules,
            splits: Mutex::new(HashMap::new()),
            splits_changed: Condvar::new(),
        }))
    }

    fn pair(&self, from: Rank, to: Rank) -> &Pair {
        &self.pairs[from * self.world + to]
    }

    /// The path messages from `from` to `to` take.
    pub(crate) fn path(&self, from: Rank, to: Rank) -> Path {
        self.paths[from * self.world + to]
    }

    /// Marks the group aborted and wakes every waiter.
    pub(crate) fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.wake_all();
    }

    fn module(&self, ctx: &Arc<CudaContext>, rank: Rank) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = modules.get(&ctx.ordinal()) {
            return Ok(m.clone());
        }
        let module = load_kernels(ctx, rank)?;
        modules.insert(ctx.ordinal(), module.clone());
        Ok(module)
    }

    fn wake_all(&self) {
        for pair in &self.pairs {
            let _guard = pair.state.lock();
            pair.changed.notify_all();
        }
        let _guard = self.splits.lock();
        self.splits_changed.notify_all();
    }
}

/// Waits until `stream` has run everything queued so far, for at most
/// `timeout` (a peer process that died mid-call may leave an event this
/// stream waits on forever): `DeviceTimeout` naming `what` then.
fn drain(stream: &CudaStream, rank: Rank, timeout: Duration, what: &str) -> Result<()> {
    let done = stream
        .record_event(None)
        .map_err(cuda_error(rank, format!("{what}: recording an event")))?;
    let start = Instant::now();
    loop {
        if done
            .try_is_complete()
            .map_err(cuda_error(rank, format!("{what}: querying the stream")))?
        {
            return Ok(());
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(Error::DeviceTimeout {
                rank,
                what: what.to_owned(),
                waited,
            });
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// A control channel's error, in the terms of the cuda-ring call that
/// waited: a host timeout becomes the device one, naming the call.
fn remote_error(
    rank: Rank,
    seq: u64,
    op: OpKind,
    peer: Rank,
    what: &'static str,
) -> impl FnOnce(Error) -> Error {
    move |e| match e {
        Error::Timeout { waited, .. } => Error::DeviceTimeout {
            rank,
            what: format!("cuda-ring {op} #{seq}: {what} from rank {peer}"),
            waited,
        },
        Error::PeerLost { .. } => Error::PeerLost {
            op,
            seq,
            rank,
            peer,
        },
        Error::PeerTimedOut {
            peer: failed, late, ..
        } => Error::PeerTimedOut {
            op,
            seq,
            rank,
            peer: failed,
            late,
        },
        Error::Aborted { .. } => Error::Aborted { op, seq, rank },
        // The control channel's own calls are `recv #0`: name the
        // cuda-ring call instead.
        Error::Mismatch { detail, .. } => Error::Mismatch {
            op,
            seq,
            rank,
            peer,
            detail,
        },
        Error::Failed { first_error, .. } => Error::Failed {
            op,
            rank,
            first_error,
        },
        other => other,
    }
}

/// Loads the cuda-ring kernels on `ctx`'s GPU: the embedded PTX for its
/// compute capability, JIT-compiled by the driver.
fn load_kernels(ctx: &Arc<CudaContext>, rank: Rank) -> Result<Arc<CudaModule>> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(cuda_error(rank, "reading the GPU's compute capability"))?;
    let ptx = super::ptx_for(major, minor).ok_or_else(|| Error::Cuda {
        rank,
        context: format!("loading the cuda-ring kernels on GPU {}", ctx.ordinal()),
        detail: format!(
            "compute capability {major}.{minor}: the cuda-ring kernels need 8.0 or newer"
        ),
    })?;
    ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))
        .map_err(cuda_error(
            rank,
            format!(
                "loading the cuda-ring kernels (PTX JIT) on GPU {}",
                ctx.ordinal()
            ),
        ))
}

/// A split table gone before this rank read it: only a bug removes it
/// early (the last rank to read it does), but it is an error, not a panic.
fn split_lost(rank: Rank) -> Error {
    Error::Cuda {
        rank,
        context: "split".into(),
        detail: "the split's table disappeared before this rank read it".into(),
    }
}

/// Whether `from`'s context may access `to`'s memory, enabling it if so.
fn peer_access(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> bool {
    let mut can = 0;
    // SAFETY: plain driver queries on live devices.
    let rc = unsafe { sys::cuDeviceCanAccessPeer(&mut can, from.cu_device(), to.cu_device()) };
    if rc != sys::CUresult::CUDA_SUCCESS || can == 0 {
        return false;
    }
    if from.bind_to_thread().is_err() {
        return false;
    }
    // SAFETY: `from` is current; enabling twice returns
    // CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, which is success for us.
    let rc = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
    matches!(
        rc,
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    )
}

/// A driver error, for `rank` doing `context`.
pub(crate) fn cuda_error(
    rank: Rank,
    context: impl Into<String>,
) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    let context = context.into();
    move |e| Error::Cuda {
        rank,
        context,
        detail: e.to_string(),
    }
}

/// `Ok` for `CUDA_SUCCESS`, else `Error::Cuda` naming `what` and the code.
pub(crate) fn check(rank: Rank, what: &str, rc: sys::CUresult) -> Result<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            rank,
            context: what.to_owned(),
            detail: format!("{rc:?}"),
        })
    }
}

/// What a peer's ready of the call says ([`RingComm::await_ready`]).
struct PeerReady {
    /// Its inbox for this rank, as this rank addresses it.
    inbox: CUdeviceptr,
    /// Bytes and messages it expects from this rank, and the messages'
    /// sizes in order.
    bytes: usize,
    messages: usize,
    layout: u32,
    /// Its call buffers and peer-direct call (threads only).
    bufs: CallBufs,
    peer_direct: Option<PeerDirectCall>,
}

/// An inbox: device memory of the receiver, pinned host memory (threads of
/// one process), or a shared segment registered as pinned memory (ranks in
/// separate processes, host-staged path).
#[derive(Default)]
struct Inbox {
    ptr: CUdeviceptr,
    bytes: usize,
    host: bool,
    /// The segment behind a host-staged inbox between processes.
    shared: Option<SharedInbox>,
    /// The device inbox's IPC handle (ranks in separate processes).
    export: Option<Handle>,
    /// Numbers allocations, so a peer maps each once.
    generation: u64,
}

impl Inbox {
    fn free(&mut self) {
        if self.bytes == 0 {
            return;
        }
        if self.shared.take().is_none() {
            // SAFETY: allocated by `ensure` with the matching call; the
            // caller synchronised the stream so nothing uses it any more.
            unsafe {
                if self.host {
                    sys::cuMemFreeHost(self.ptr as *mut std::ffi::c_void);
                } else {
                    sys::cuMemFree_v2(self.ptr);
                }
            }
        }
        *self = Inbox::default();
    }

    /// What a sender needs to reach it.
    fn describe(&self) -> InboxDesc {
        match (&self.shared, &self.export) {
            _ if self.bytes == 0 => InboxDesc::None,
            (Some(shared), _) => InboxDesc::Host {
                generation: self.generation,
                name: shared.name().to_owned(),
            },
            (None, Some(handle)) => InboxDesc::Device {
                generation: self.generation,
                handle: *handle,
            },
            (None, None) => InboxDesc::None,
        }
    }
}

/// One call's buffers as device addresses (0 where absent).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CallBufs {
    pub send: CUdeviceptr,
    pub recv: CUdeviceptr,
}

/// How a rank meets the others of its group.
pub(crate) enum Links {
    /// Threads of this process: the shared [`RingGroup`].
    Local(Arc<RingGroup>),
    /// Separate processes of one host: CUDA IPC over a control channel.
    Remote(Box<RemoteLinks>),
}

/// One rank of a cuda-ring group.
pub(crate) struct RingComm {
    rank: Rank,
    world: usize,
    links: Links,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
    inboxes: Vec<Inbox>,
    /// Inboxes replaced by larger ones while peers in other processes may
    /// still have them mapped: freed when the rank goes.
    retired: Vec<Inbox>,
    scratch: Inbox,
    timeout: Duration,
    /// Calls made (for errors).
    seq: u64,
    /// Splits made: numbers the split tables (splits are collective, so
    /// equal on every rank, unlike `seq`, which counts point-to-point calls).
    splits: u64,
    sms: u32,
    /// The event of the last post, while nothing was enqueued after it: the
    /// next post records nothing new and hands the same event on (a
    /// peer-direct call posts to every peer in a row).
    last_post: Option<Arc<CudaEvent>>,
    /// Events this rank recorded for peers in this process (readies,
    /// posts), recorded again once no peer holds them: see
    /// [`RingComm::record_pooled`].
    event_pool: Vec<Arc<CudaEvent>>,
}

// SAFETY: the raw device addresses are owned allocations; everything else
// is Send. One thread drives a RingComm at a time (`&mut self`).
unsafe impl Send for RingComm {}

/// Numbers inbox allocations process-wide.
static INBOX_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl RingComm {
    /// Rank `rank` of `group`, on `ctx`'s GPU, with a stream of its own.
    pub(crate) fn new(
        group: Arc<RingGroup>,
        rank: Rank,
        ctx: Arc<CudaContext>,
        timeout: Duration,
    ) -> Result<RingComm> {
        let module = group.module(&ctx, rank)?;
        Self::with_links(Links::Local(group), rank, ctx, module, timeout)
    }

    /// This process's rank of a group of processes: `control` (a host
    /// communicator of the same ranks) carries the IPC handles.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for peers on other hosts or in this process;
    /// [`Error::Cuda`] when the kernels do not load; the control channel's.
    pub(crate) fn new_remote(
        control: crate::comm::Communicator,
        ctx: Arc<CudaContext>,
        timeout: Duration,
    ) -> Result<RingComm> {
        let rank = control.rank();
        ctx.bind_to_thread()
            .map_err(cuda_error(rank, "binding the GPU to this thread"))?;
        let module = load_kernels(&ctx, rank)?;
        let links = RemoteLinks::new(control, ctx.cu_device())?;
        Self::with_links(Links::Remote(Box::new(links)), rank, ctx, module, timeout)
    }

    fn with_links(
        links: Links,
        rank: Rank,
        ctx: Arc<CudaContext>,
        module: Arc<CudaModule>,
        timeout: Duration,
    ) -> Result<RingComm> {
        let stream = ctx
            .new_stream()
            .map_err(cuda_error(rank, "creating the rank's stream"))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_error(rank, "reading the GPU's multiprocessor count"))?
            .max(1) as u32;
        let world = match &links {
            Links::Local(group) => group.world,
            Links::Remote(remote) => remote.world(),
        };
        Ok(RingComm {
            rank,
            world,
            links,
            ctx,
            stream,
            module,
            functions: HashMap::new(),
            inboxes: (0..world).map(|_| Inbox::default()).collect(),
            retired: Vec::new(),
            scratch: Inbox::default(),
            timeout,
            seq: 0,
            splits: 0,
            sms,
            last_post: None,
            event_pool: Vec::new(),
        })
    }

    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Whether the ranks are separate processes (CUDA IPC).
    pub(crate) fn is_remote(&self) -> bool {
        matches!(self.links, Links::Remote(_))
    }

    /// Whether calls may run peer-direct
    /// ([`super::lower::lower_peer_direct`]): ranks are threads of this
    /// process (their buffers' addresses are usable by every rank), all on
    /// one GPU, and the world fits the kernel. The same answer on every
    /// rank, since each sees the group's whole path table.
    ///
    /// Not across GPUs, even with peer access: cudarc allocates from the
    /// device's default memory pool where the GPU has one (A100, H100,
    /// H200), and pool memory does not follow `cuCtxEnablePeerAccess` (it
    /// needs `cuMemPoolSetAccess`): a kernel on one GPU dereferencing a
    /// peer's buffer on another would fault and poison the context. Until
    /// that is granted and checked on a machine with several GPUs (those
    /// lent to this project have one), groups spanning GPUs take the ring.
    pub(crate) fn peer_direct_available(&self) -> bool {
        match &self.links {
            Links::Local(group) => {
                (2..=super::lower::PEER_DIRECT_MAX_WORLD).contains(&self.world)
                    && group.paths.iter().all(|&p| p == Path::SameGpu)
            }
            Links::Remote(_) => false,
        }
    }

    /// Records an event on the stream for peers in this process, reusing a
    /// pooled one no peer holds any more. A peer drops its handle only
    /// after enqueuing its stream's wait on it, and a wait is for the
    /// record current when it was enqueued, so recording the event again
    /// cannot move a wait already queued. Creating and destroying an event
    /// per ready and per post was two more driver calls each, contending
    /// with the other ranks' threads for the GPU's context. The pool stays
    /// small: ranks move in step (a call waits for every peer's ready), so
    /// only a few events are ever held by peers at once.
    fn record_pooled(&mut self, what: &str) -> Result<Arc<CudaEvent>> {
        let rank = self.rank;
        // `get_mut` succeeds only on the sole handle, with acquire ordering
        // against the peer's release of its clone.
        let index = match self
            .event_pool
            .iter_mut()
            .position(|e| Arc::get_mut(e).is_some())
        {
            Some(i) => i,
            None => {
                let event = self
                    .ctx
                    .new_event(None)
                    .map_err(cuda_error(rank, "creating an event"))?;
                self.event_pool.push(Arc::new(event));
                self.event_pool.len() - 1
            }
        };
        let event = &self.event_pool[index];
        event.record(&self.stream).map_err(cuda_error(rank, what))?;
        Ok(event.clone())
    }

    /// The path messages from `from` to `to` take.
    fn path(&self, from: Rank, to: Rank) -> Path {
        match &self.links {
            Links::Local(group) => group.path(from, to),
            Links::Remote(remote) => remote.path(from, to),
        }
    }

    /// Stops the group: with threads, every rank stops waiting and fails;
    /// with processes, every peer is sent an abort frame and fails its
    /// waits on this rank with `Aborted`.
    pub(crate) fn abort(&mut self) {
        match &mut self.links {
            Links::Local(group) => group.abort(),
            Links::Remote(remote) => remote.abort(),
        }
    }

    fn aborted(&self) -> bool {
        match &self.links {
            Links::Local(group) => group.aborted.load(Ordering::SeqCst),
            Links::Remote(remote) => remote.aborted(),
        }
    }

    /// The distinct paths this rank's pairs use, for reports.
    pub(crate) fn paths_summary(&self) -> String {
        let mut names: Vec<&str> = (0..self.world)
            .filter(|&p| p != self.rank)
            .flat_map(|p| [self.path(self.rank, p), self.path(p, self.rank)])
            .map(Path::name)
            .collect();
        names.sort_unstable();
        names.dedup();
        let joined = if names.is_empty() {
            "one rank".into()
        } else {
            names.join(", ")
        };
        if self.is_remote() {
            format!("{joined}; processes, CUDA IPC")
        } else {
            joined
        }
    }

    /// Grows `inbox` to `bytes`: on this GPU, in pinned host memory, or
    /// (`remote`) exported for peers in other processes.
    fn ensure(
        &mut self,
        op: OpKind,
        which: Option<Rank>,
        bytes: usize,
        host: bool,
        remote: bool,
    ) -> Result<()> {
        let rank = self.rank;
        let current = self.inbox_mut(which);
        if current.bytes >= bytes && current.host == host {
            return Ok(());
        }
        // The old inbox may still be read by work queued earlier.
        self.drain_stream(&format!(
            "cuda-ring {op} #{}: draining the stream before growing an inbox",
            self.seq
        ))?;
        let old = std::mem::take(self.inbox_mut(which));
        if remote && which.is_some() {
            // A peer in another process may still have it mapped.
            self.retired.push(old);
        } else {
            let mut old = old;
            old.free();
        }
        let bytes = inbox_capacity(bytes);
        let generation = INBOX_GENERATION.fetch_add(1, Ordering::Relaxed);
        let fresh = if host && remote {
            let shared = SharedInbox::create(rank, bytes)?;
            Inbox {
                ptr: shared.device,
                bytes,
                host,
                shared: Some(shared),
                export: None,
                generation,
            }
        } else if host {
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: a plain allocation; PORTABLE|DEVICEMAP makes it usable
            // from every context, at the same address (UVA).
            let rc = unsafe {
                sys::cuMemHostAlloc(
                    &mut p,
                    bytes,
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                )
            };
            check(rank, "allocating a pinned host inbox", rc)?;
            Inbox {
                ptr: p as CUdeviceptr,
                bytes,
                host,
                generation,
                ..Inbox::default()
            }
        } else {
            let mut ptr: CUdeviceptr = 0;
            // SAFETY: a plain allocation on the current context.
            let rc = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) };
            check(rank, "allocating a device inbox", rc)?;
            let mut fresh = Inbox {
                ptr,
                bytes,
                host,
                generation,
                ..Inbox::default()
            };
            if remote && which.is_some() {
                let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
                // SAFETY: `ptr` is a live cuMemAlloc allocation.
                let rc = unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) };
                if let Err(e) = check(rank, "exporting an inbox (cuIpcGetMemHandle)", rc) {
                    fresh.free();
                    return Err(e);
                }
                fresh.export = Some(handle.reserved.map(|c| c as u8));
            }
            fresh
        };
        *self.inbox_mut(which) = fresh;
        Ok(())
    }

    /// The inbox for messages from `which`, or the scratch buffer.
    fn inbox_mut(&mut self, which: Option<Rank>) -> &mut Inbox {
        match which {
            Some(p) => &mut self.inboxes[p],
            None => &mut self.scratch,
        }
    }

    /// Waits until the stream has run everything queued, with the deadline.
    fn drain_stream(&self, what: &str) -> Result<()> {
        drain(&self.stream, self.rank, self.timeout, what)
    }

    fn function(&mut self, name: &str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.get(name) {
            return Ok(f.clone());
        }
        let f = self
            .module
            .load_function(name)
            .map_err(cuda_error(self.rank, format!("finding kernel {name}")))?;
        self.functions.insert(name.to_owned(), f.clone());
        Ok(f)
    }

    fn lost(&self, op: OpKind, peer: Rank) -> Option<Error> {
        if self.aborted() {
            return Some(Error::Aborted {
                op,
                seq: self.seq,
                rank: self.rank,
            });
        }
        if let Links::Local(group) = &self.links {
            if group.departed[peer].load(Ordering::SeqCst) {
                return Some(Error::PeerLost {
                    op,
                    seq: self.seq,
                    rank: self.rank,
                    peer,
                });
            }
        }
        None
    }

    /// Waits on `pair` until `ready` yields, with the deadline.
    fn wait_pair<R>(
        &self,
        op: OpKind,
        peer: Rank,
        pair: &Pair,
        what: &str,
        mut ready: impl FnMut(&mut PairState) -> Option<R>,
    ) -> Result<R> {
        let start = Instant::now();
        let lock = || pair.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut state = lock();
        loop {
            // An aborted group hands nothing out, not even what is queued:
            // a ready taken after its rank's call failed would let a
            // peer-direct kernel write buffers that call no longer holds.
            // (A peer that merely left may still have posted what this
            // wait needs, so departure is checked after.)
            if self.aborted() {
                return Err(Error::Aborted {
                    op,
                    seq: self.seq,
                    rank: self.rank,
                });
            }
            if let Some(r) = ready(&mut state) {
                return Ok(r);
            }
            if let Some(e) = self.lost(op, peer) {
                return Err(e);
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                return Err(Error::DeviceTimeout {
                    rank: self.rank,
                    what: format!("cuda-ring {op} #{}: {what} from rank {peer}", self.seq),
                    waited,
                });
            }
            if waited < HANDOFF_SPIN {
                // Read under the lock: any push after this bumps it.
                let seen = pair.version.load(Ordering::Acquire);
                drop(state);
                while pair.version.load(Ordering::Acquire) == seen && start.elapsed() < HANDOFF_SPIN
                {
                    std::hint::spin_loop();
                }
                state = lock();
                continue;
            }
            state.sleepers += 1;
            let (next, _) = pair
                .changed
                .wait_timeout(state, WAKE.min(self.timeout - waited))
                .unwrap_or_else(|e| e.into_inner());
            state = next;
            state.sleepers -= 1;
        }
    }

    /// Waits for `to`'s ready of this call and orders the stream after it;
    /// returns what the ready says (`to`'s inbox as this rank addresses it,
    /// what it expects, its buffers and peer-direct call).
    fn await_ready(&mut self, op: OpKind, to: Rank) -> Result<PeerReady> {
        let (rank, seq) = (self.rank, self.seq);
        match &mut self.links {
            Links::Local(group) => {
                let group = group.clone();
                let ready =
                    self.wait_pair(op, to, group.pair(rank, to), "waiting for the inbox", |s| {
                        s.readies.pop_front()
                    })?;
                self.stream
                    .wait(&ready.event)
                    .map_err(cuda_error(rank, "ordering after a peer's ready event"))?;
                Ok(PeerReady {
                    inbox: ready.inbox,
                    bytes: ready.bytes,
                    messages: ready.messages,
                    layout: ready.layout,
                    bufs: ready.bufs,
                    peer_direct: ready.peer_direct,
                })
            }
            Links::Remote(links) => {
                let (stream, timeout) = (&self.stream, self.timeout);
                let ready = links
                    .await_ready(to, || {
                        drain(
                            stream,
                            rank,
                            timeout,
                            "draining the stream before remapping a peer's inbox",
                        )
                    })
                    .map_err(remote_error(rank, seq, op, to, "waiting for the inbox"))?;
                // SAFETY: a live stream; an event opened in this context.
                let rc = unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), ready.event, 0) };
                check(rank, "ordering after a peer's ready event", rc)?;
                // Peers in other processes never run peer-direct.
                Ok(PeerReady {
                    inbox: ready.inbox,
                    bytes: ready.bytes,
                    messages: ready.messages,
                    layout: ready.layout,
                    bufs: CallBufs::default(),
                    peer_direct: None,
                })
            }
        }
    }

    /// The message just written into `to`'s inbox is complete: records an
    /// event after it and hands it to `to`.
    fn post(&mut self, op: OpKind, to: Rank) -> Result<()> {
        let (rank, seq) = (self.rank, self.seq);
        match &mut self.links {
            Links::Local(group) => {
                let group = group.clone();
                let event = match &self.last_post {
                    Some(event) => event.clone(),
                    None => self.record_pooled("recording a message event")?,
                };
                self.last_post = Some(event.clone());
                group
                    .pair(rank, to)
                    .publish(|state| state.messages.push_back(event));
                Ok(())
            }
            Links::Remote(links) => links
                .post(to, self.stream.cu_stream())
                .map_err(remote_error(rank, seq, op, to, "posting a message")),
        }
    }

    /// Waits for the next message from `from` and orders the stream after it.
    fn await_message(&mut self, op: OpKind, from: Rank) -> Result<()> {
        let (rank, seq) = (self.rank, self.seq);
        match &mut self.links {
            Links::Local(group) => {
                let group = group.clone();
                let event = self.wait_pair(
                    op,
                    from,
                    group.pair(from, rank),
                    "waiting for a message",
                    |s| s.messages.pop_front(),
                )?;
                self.stream
                    .wait(&event)
                    .map_err(cuda_error(rank, "ordering after a peer's message"))
            }
            Links::Remote(links) => {
                let event = links.await_message(from).map_err(remote_error(
                    rank,
                    seq,
                    op,
                    from,
                    "waiting for a message",
                ))?;
                // SAFETY: a live stream; an event opened in this context.
                let rc = unsafe { sys::cuStreamWaitEvent(self.stream.cu_stream(), event, 0) };
                check(rank, "ordering after a peer's message", rc)?;
                // The sender maps a shared inbox before its first message
                // into it: the name is no longer needed.
                if let Some(shared) = &mut self.inboxes[from].shared {
                    shared.unlink_name();
                }
                Ok(())
            }
        }
    }

    /// Runs one lowered call: enqueues everything on the stream; returns
    /// once enqueued (peers' posts are awaited on the host, their data on
    /// the GPU).
    pub(crate) fn run(
        &mut self,
        op: OpKind,
        dtype: DType,
        reduce: ReduceOp,
        lowered: &Lowered,
        bufs: &[CallBufs],
    ) -> Result<()> {
        let result = self.run_inner(op, dtype, reduce, lowered, bufs);
        self.seq += 1;
        if result.is_err() {
            // Peers may have queued writes into this rank's inboxes, or
            // wait for its messages: a failed call poisons the group (as
            // NCCL's communicators after an error) and they get `Aborted`.
            self.abort();
        }
        result
    }

    fn run_inner(
        &mut self,
        op: OpKind,
        dtype: DType,
        reduce: ReduceOp,
        lowered: &Lowered,
        bufs: &[CallBufs],
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        let elem = dtype.size();
        let remote = self.is_remote();
        self.ctx
            .bind_to_thread()
            .map_err(cuda_error(rank, "binding the GPU to this thread"))?;
        // Inboxes for this call, then "ready" to every sender: the event
        // orders their writes after everything this stream did before
        // (including reading the previous call's messages).
        for from in 0..world {
            let host = self.path(from, rank) == Path::HostStaged;
            let bytes = lowered.incoming[from] * elem;
            if bytes > 0 {
                self.ensure(op, Some(from), bytes, host, remote)?;
            }
        }
        if lowered.scratch_len > 0 {
            self.ensure(op, None, lowered.scratch_len * elem, false, remote)?;
        }
        // Messages per peer, each way, for the pairing check.
        let (mut expected, mut sending_msgs) = (vec![0usize; world], vec![0usize; world]);
        for op in &lowered.ops {
            match *op {
                DevOp::Await { from } => expected[from] += 1,
                DevOp::Post { to } => sending_msgs[to] += 1,
                _ => {}
            }
        }
        let senders = (0..world).filter(|&p| p != rank && lowered.receives_from[p]);
        match &mut self.links {
            Links::Local(group) => {
                let group = group.clone();
                let ready = self.record_pooled("recording the ready event")?;
                for from in senders {
                    group.pair(from, rank).publish(|state| {
                        state.readies.push_back(Ready {
                            inbox: self.inboxes[from].ptr,
                            bytes: lowered.incoming[from] * elem,
                            messages: expected[from],
                            layout: layout_digest(&lowered.incoming_lens[from], elem),
                            event: ready.clone(),
                            bufs: bufs.first().copied().unwrap_or_default(),
                            peer_direct: lowered.peer_direct,
                        })
                    });
                }
            }
            Links::Remote(links) => {
                links.begin_call();
                links.record_ready(self.stream.cu_stream())?;
                for from in senders {
                    let inbox = self.inboxes[from].describe();
                    let bytes = lowered.incoming[from] * elem;
                    let layout = layout_digest(&lowered.incoming_lens[from], elem);
                    links
                        .send_ready(from, bytes, (expected[from], layout), inbox)
                        .map_err(remote_error(
                            rank,
                            self.seq,
                            op,
                            from,
                            "publishing the inbox",
                        ))?;
                }
            }
        }
        let mut outboxes: Vec<CUdeviceptr> = vec![0; world];
        let combine = self.function(&super::combine_kernel(dtype, reduce))?;
        let divide = self.function(&super::divide_kernel(dtype))?;
        let part = |at: At| -> CallBufs {
            let i = match at.mem {
                Mem::Part(i, _) => i,
                _ => 0,
            };
            bufs.get(i)
                .copied()
                .unwrap_or(CallBufs { send: 0, recv: 0 })
        };
        let reduce_peers = self.function(&super::reduce_peers_kernel(dtype, reduce))?;
        // Peers' buffers of this call, learnt from their readies.
        let mut peer_bufs = vec![CallBufs::default(); world];
        peer_bufs[rank] = bufs.first().copied().unwrap_or_default();
        self.last_post = None;
        for dev_op in &lowered.ops {
            // A post may reuse the previous post's event only while nothing
            // else reached the stream since.
            if !matches!(dev_op, DevOp::Post { .. }) {
                self.last_post = None;
            }
            let addr = |at: At, outboxes: &[CUdeviceptr]| -> CUdeviceptr {
                let base = match at.mem {
                    Mem::Buf(BufId::Send) | Mem::Part(_, BufId::Send) => part(at).send,
                    Mem::Buf(BufId::Recv) | Mem::Part(_, BufId::Recv) => part(at).recv,
                    Mem::Buf(BufId::Scratch) | Mem::Part(_, BufId::Scratch) => self.scratch.ptr,
                    Mem::Inbox(p) => self.inboxes[p].ptr,
                    Mem::Outbox(p) => outboxes[p],
                };
                base + (at.offset * elem) as u64
            };
            match *dev_op {
                DevOp::AwaitReady { to } => {
                    let PeerReady {
                        inbox,
                        bytes,
                        messages,
                        layout,
                        bufs: their_bufs,
                        peer_direct,
                    } = self.await_ready(op, to)?;
                    peer_bufs[to] = their_bufs;
                    let seq = self.seq;
                    let mismatch = |detail: String| Error::Mismatch {
                        op,
                        seq,
                        rank,
                        peer: to,
                        detail,
                    };
                    // Peer-direct ranks read and write each other's buffers
                    // by their own counts: unequal calls would reach past a
                    // peer's buffers.
                    if peer_direct != lowered.peer_direct {
                        let show = |c: Option<PeerDirectCall>| match c {
                            Some(c) => format!(
                                "{} of {} {} element(s){}{}",
                                c.op,
                                c.count,
                                c.dtype.name(),
                                c.reduce_op.map(|o| format!(", {o:?}")).unwrap_or_default(),
                                c.root.map(|r| format!(", root {r}")).unwrap_or_default()
                            ),
                            None => "a ring call".to_owned(),
                        };
                        return Err(mismatch(format!(
                            "this call is {}, rank {to}'s matching call is {}",
                            show(lowered.peer_direct),
                            show(peer_direct)
                        )));
                    }
                    // The pairing is per call: a call that sends more than
                    // the receiver's matching call expects (one side groups
                    // point-to-point calls, the other does not) would write
                    // past its inbox.
                    let sending = lowered.outgoing[to] * elem;
                    if sending != bytes || sending_msgs[to] != messages {
                        return Err(mismatch(format!(
                            "this call sends {sending} bytes in {} message(s) to rank {to}, \
                                 whose matching call expects {bytes} in {messages} (on the \
                                 cuda-ring, point-to-point calls that are grouped on one side \
                                 must be grouped alike on the other)",
                            sending_msgs[to]
                        )));
                    }
                    // Equal totals cut into other pieces (grouped sends of
                    // 10 then 20 elements against receives of 20 then 10)
                    // would land each message across the receiver's two.
                    if layout_digest(&lowered.outgoing_lens[to], elem) != layout {
                        return Err(mismatch(format!(
                            "this call's {messages} message(s) to rank {to} differ in size, \
                                 one by one, from those its matching call expects (on the \
                                 cuda-ring, grouped sends and receives must pair in order, \
                                 with equal counts)"
                        )));
                    }
                    outboxes[to] = inbox;
                }
                DevOp::Post { to } => self.post(op, to)?,
                DevOp::Await { from } => self.await_message(op, from)?,
                DevOp::Copy { src, dst, len } => {
                    if len > 0 {
                        let (d, s) = (addr(dst, &outboxes), addr(src, &outboxes));
                        // Dropping a peer's event may have made its context
                        // current on this thread (cudarc binds to destroy).
                        self.ctx
                            .bind_to_thread()
                            .map_err(cuda_error(rank, "binding the GPU to this thread"))?;
                        // SAFETY: both ranges lie in live allocations of at
                        // least `len` elements (buffers validated; inboxes
                        // sized by the lowering's totals).
                        let rc = unsafe {
                            sys::cuMemcpyAsync(d, s, len * elem, self.stream.cu_stream())
                        };
                        check(rank, "enqueueing a copy", rc)?;
                    }
                }
                DevOp::Combine { dst, a, b, len } => {
                    if len > 0 {
                        let (d, x, y) =
                            (addr(dst, &outboxes), addr(a, &outboxes), addr(b, &outboxes));
                        let n = len as u64;
                        let cfg = self.launch_config(len, elem);
                        let mut launch = self.stream.launch_builder(&combine);
                        launch.arg(&d).arg(&x).arg(&y).arg(&n);
                        // SAFETY: the kernel's signature is (T*, const T*,
                        // const T*, u64) and the ranges are live.
                        unsafe { launch.launch(cfg) }
                            .map_err(cuda_error(rank, "launching a reduction kernel"))?;
                    }
                }
                DevOp::ReducePeers {
                    input,
                    output,
                    len,
                    to_all,
                    divide,
                } if len > 0 => {
                    // Inputs are send buffers (an in-place call passes its
                    // one buffer as both), outputs receive buffers.
                    let input_of = |p: Rank| peer_bufs[p].send + (input * elem) as u64;
                    let output_of = |p: Rank| peer_bufs[p].recv + (output * elem) as u64;
                    // The ring's order for the chunk this rank owns.
                    let mut srcs = KernelPtrs::default();
                    for k in 1..=world {
                        srcs.0[k - 1] = input_of((rank + k) % world);
                    }
                    let mut dsts = KernelPtrs::default();
                    let ndst = if to_all {
                        for p in 0..world {
                            dsts.0[p] = output_of(p);
                        }
                        world
                    } else {
                        dsts.0[0] = output_of(rank);
                        1
                    };
                    let (nsrc, ndst) = (world as u32, ndst as u32);
                    let (n, divide_by) = (len as u64, if divide { world as u64 } else { 0 });
                    let cfg = self.launch_config(len, elem);
                    let mut launch = self.stream.launch_builder(&reduce_peers);
                    launch
                        .arg(&srcs)
                        .arg(&nsrc)
                        .arg(&dsts)
                        .arg(&ndst)
                        .arg(&n)
                        .arg(&divide_by);
                    // SAFETY: the kernel's signature is (Ptrs, u32, Ptrs,
                    // u32, u64, u64); every address is a live buffer of the
                    // call, published with its owner's ready, whose call was
                    // checked to match this one (op, type, count, root) at
                    // that ready; lengths were validated on each rank; and
                    // the owner's stream waits for this rank's done message
                    // before anything after the call touches it.
                    unsafe { launch.launch(cfg) }
                        .map_err(cuda_error(rank, "launching a peer-direct reduction"))?;
                }
                DevOp::CopyToPeers {
                    src,
                    dst,
                    len,
                    include_self,
                } if len > 0 => {
                    let from = addr(src, &outboxes);
                    self.ctx
                        .bind_to_thread()
                        .map_err(cuda_error(rank, "binding the GPU to this thread"))?;
                    for p in (0..world).filter(|&p| include_self || p != rank) {
                        let to = peer_bufs[p].recv + (dst.offset * elem) as u64;
                        // SAFETY: as for the reduction above: live buffers
                        // of the call, ordered by readies and done messages.
                        let rc = unsafe {
                            sys::cuMemcpyAsync(to, from, len * elem, self.stream.cu_stream())
                        };
                        check(rank, "enqueueing a peer-direct copy", rc)?;
                    }
                }
                DevOp::ReducePeers { .. } | DevOp::CopyToPeers { .. } => {}
                DevOp::Divide { dst, len } => {
                    if len > 0 {
                        let d = addr(dst, &outboxes);
                        let (n, w) = (len as u64, world as u64);
                        let cfg = self.launch_config(len, elem);
                        let mut launch = self.stream.launch_builder(&divide);
                        launch.arg(&d).arg(&n).arg(&w);
                        // SAFETY: (T*, u64, u64) on a live range.
                        unsafe { launch.launch(cfg) }
                            .map_err(cuda_error(rank, "launching the divide kernel"))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Enough 256-thread blocks for one 16-byte vector per thread, at most
    /// four per multiprocessor (the grid-stride loops cover the rest).
    fn launch_config(&self, len: usize, elem: usize) -> LaunchConfig {
        let vectors = (len * elem).div_ceil(16).max(1);
        let blocks = vectors.div_ceil(256).min(self.sms as usize * 4).max(1) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `Aborted` once the group was aborted (an abort or a failed call):
    /// what a wait for this rank's own stream checks. A peer that merely
    /// left is no reason to fail it: every event this stream waits on was
    /// recorded before the wait was queued.
    pub(crate) fn check_aborted(&self, op: OpKind) -> Result<()> {
        if self.aborted() {
            return Err(Error::Aborted {
                op,
                seq: self.seq,
                rank: self.rank,
            });
        }
        Ok(())
    }

    /// Whether the group can still run calls: `Aborted` after an abort or
    /// a failed call, `PeerLost` once a rank left.
    pub(crate) fn check_group(&self, op: OpKind) -> Result<()> {
        match (0..self.world).find_map(|p| self.lost(op, p)) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Splits the group: every rank deposits (color, key, GPU) in the
    /// group's table for this split (numbered alike on every rank); once
    /// all have, ranks of one color form a new group ordered by (key,
    /// rank), made by the first of them to look. `None` leaves this rank out.
    ///
    /// Between processes, the control channel splits (the host
    /// communicator's split) and the children link over their part of it.
    pub(crate) fn split(&mut self, color: Option<u32>, key: i64) -> Result<Option<RingComm>> {
        match &mut self.links {
            Links::Local(group) => {
                let group = group.clone();
                self.split_local(group, color, key)
            }
            Links::Remote(links) => match links.control_mut().split_or_none(color, key)? {
                None => Ok(None),
                Some(control) => {
                    let rank = control.rank();
                    let links = RemoteLinks::new(control, self.ctx.cu_device())?;
                    Self::with_links(
                        Links::Remote(Box::new(links)),
                        rank,
                        self.ctx.clone(),
                        self.module.clone(),
                        self.timeout,
                    )
                    .map(Some)
                }
            },
        }
    }

    fn split_local(
        &mut self,
        group: Arc<RingGroup>,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<RingComm>> {
        let (rank, world) = (self.rank, self.world);
        let seq = self.splits;
        self.splits += 1;
        let start = Instant::now();
        let mut splits = group.splits.lock().unwrap_or_else(|e| e.into_inner());
        splits
            .entry(seq)
            .or_insert_with(|| SplitTable {
                entries: vec![None; world],
                children: HashMap::new(),
                done: 0,
            })
            .entries[rank] = Some((color, key, self.ctx.clone()));
        group.splits_changed.notify_all();
        let entries = loop {
            let Some(table) = splits.get(&seq) else {
                return Err(split_lost(rank));
            };
            if table.entries.iter().all(Option::is_some) {
                break table.entries.iter().flatten().cloned().collect::<Vec<_>>();
            }
            if let Some(e) = self.check_group(OpKind::Split).err() {
                return Err(e);
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                let missing: Vec<Rank> =
                    (0..world).filter(|&p| table.entries[p].is_none()).collect();
                return Err(Error::DeviceTimeout {
                    rank,
                    what: format!("cuda-ring split #{seq}: waiting for ranks {missing:?} to join"),
                    waited,
                });
            }
            splits = group
                .splits_changed
                .wait_timeout(splits, WAKE.min(self.timeout - waited))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        let Some(table) = splits.get_mut(&seq) else {
            return Err(split_lost(rank));
        };
        let child = match color {
            None => None,
            Some(c) => {
                let mut members: Vec<(i64, Rank)> = entries
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.0 == Some(c))
                    .map(|(r, e)| (e.1, r))
                    .collect();
                members.sort();
                let new_rank = members.iter().position(|&(_, r)| r == rank).unwrap_or(0);
                let made = match table.children.get(&c) {
                    Some(g) => Ok(g.clone()),
                    None => {
                        let contexts: Vec<Arc<CudaContext>> =
                            members.iter().map(|&(_, r)| entries[r].2.clone()).collect();
                        RingGroup::with_modules(&contexts, group.modules.clone()).inspect(|g| {
                            table.children.insert(c, g.clone());
                        })
                    }
                };
                Some((made, new_rank))
            }
        };
        table.done += 1;
        if table.done == world {
            splits.remove(&seq);
        }
        drop(splits);
        match child {
            None => Ok(None),
            Some((made, new_rank)) => {
                let made = made?;
                RingComm::new(made, new_rank, self.ctx.clone(), self.timeout).map(Some)
            }
        }
    }
}

/// How long dropping an aborted communicator waits for its stream (see
/// `Drop for RingComm`).
const ABORTED_DRAIN: Duration = Duration::from_millis(100);

impl Drop for RingComm {
    fn drop(&mut self) {
        if let Links::Local(group) = &self.links {
            group.departed[self.rank].store(true, Ordering::SeqCst);
            group.wake_all();
        }
        // Nothing queued may still use the inboxes when they are freed. In
        // an aborted group a peer may still have writes queued into them:
        // those inboxes are leaked rather than freed under its feet. (The
        // context stays bound for the events and mappings the links
        // release after this.)
        let _ = self.ctx.bind_to_thread();
        // Aborted, the stream may wait for good on a dead peer's event:
        // drain it briefly only (its inboxes and mappings are kept either
        // way), not for the whole timeout.
        let within = if self.aborted() {
            self.timeout.min(ABORTED_DRAIN)
        } else {
            self.timeout
        };
        let drained = drain(
            &self.stream,
            self.rank,
            within,
            "dropping the communicator: draining its stream",
        )
        .is_ok();
        match (drained, &mut self.links) {
            // Peers' GPUs may still wait on this rank's events and write
            // its inboxes until they, too, are done (collective, bounded).
            (true, Links::Remote(links)) => links.farewell(),
            // Work still queued may write the peers' inboxes: their
            // mappings outlive the links.
            (false, Links::Remote(links)) => links.keep_mappings(),
            _ => {}
        }
        if drained && !self.aborted() {
            for inbox in self.inboxes.iter_mut().chain(&mut self.retired) {
                inbox.free();
            }
            self.scratch.free();
        }
    }
}

/// The bytes to allocate for an inbox that must hold `bytes`: rounded up
/// to an eighth of the next power of two (at least 4 KiB), so an inbox is
/// at most a quarter larger than it must be, and a size that creeps up
/// call by call reallocates at most eight times per doubling. (It was the
/// next power of two: a 20 GiB call's inbox took 32 GiB of the GPU.)
fn inbox_capacity(bytes: usize) -> usize {
    let step = (bytes.checked_next_power_of_two().unwrap_or(bytes) / 8).max(4096);
    bytes.div_ceil(step).saturating_mul(step).max(4096)
}

#[cfg(test)]
mod tests {
    use super::inbox_capacity;

    #[test]
    fn an_inbox_is_at_most_a_quarter_larger_than_it_must_be() {
        assert_eq!(inbox_capacity(0), 4096);
        assert_eq!(inbox_capacity(1), 4096);
        assert_eq!(inbox_capacity(4096), 4096);
        assert_eq!(inbox_capacity(20 << 30), 20 << 30);
        assert_eq!(inbox_capacity((16 << 20) + 1), 20 << 20);
        assert_eq!(inbox_capacity(31 << 20), 32 << 20);
        for bytes in (1..200_000)
            .step_by(977)
            .chain([usize::MAX / 2, usize::MAX - 7])
        {
            let got = inbox_capacity(bytes);
            assert!(got >= bytes, "{bytes}: {got}");
            assert!(got - bytes <= (bytes / 4).max(4096), "{bytes}: {got}");
        }
    }
}
