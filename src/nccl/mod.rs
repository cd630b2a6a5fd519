//! The NCCL backend: NCCL loaded at run time through our own FFI
//! (`sys.rs`), communicators that cannot hang at start-up, and the mapping
//! from a validated [`CollectiveDesc`] to NCCL calls.
//!
//! Every communicator is made non-blocking (`ncclConfig_t.blocking = 0`):
//! each NCCL call returns at once, possibly with `ncclInProgress`, and oxccl
//! polls `ncclCommGetAsyncError` against its own deadline. On expiry the
//! communicator is aborted (`ncclCommAbort`) and the error names what was
//! awaited — so a rank that never arrives is a
//! [`Error::DeviceTimeout`] after `OXCCL_TIMEOUT`, not a hang.
//!
//! The user-facing type is [`DeviceCommunicator`](crate::device::DeviceCommunicator);
//! this module also answers "which NCCL would be used" without a GPU:
//! [`library_info`] and [`UniqueId::new`] work on any machine NCCL loads on.

pub(crate) mod sys;

use std::ffi::c_int;
use std::time::{Duration, Instant};

use crate::desc::CollectiveDesc;
use crate::error::{Error, Result};
use crate::types::{DType, OpKind, Rank, ReduceOp};

pub use sys::{NcclVersion, MIN_VERSION};

/// Which NCCL was loaded, from where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibraryInfo {
    /// The name or path it was loaded from (`OXCCL_NCCL_LIBRARY`, `libnccl.so.2`, ...).
    pub path: String,
    /// Its version.
    pub version: NcclVersion,
}

/// Loads the process's NCCL (`OXCCL_NCCL_LIBRARY`, then `libnccl.so.2`, then
/// `libnccl.so`) if not loaded yet, and says which one it is.
///
/// # Errors
///
/// [`Error::LibraryNotFound`] listing each name tried and why it failed, with
/// how to install NCCL; [`Error::LibraryUnsupported`] for NCCL older than
/// [`MIN_VERSION`].
pub fn library_info() -> Result<LibraryInfo> {
    let library = sys::library()?;
    Ok(LibraryInfo {
        path: library.path.clone(),
        version: library.version,
    })
}

/// Loads NCCL from exactly these names or paths, in order, without touching
/// the process's NCCL: for tools and tests that check an installation.
///
/// # Errors
///
/// As [`library_info`].
pub fn probe_library(candidates: &[String]) -> Result<LibraryInfo> {
    let library = sys::load_from(candidates)?;
    Ok(LibraryInfo {
        path: library.path.clone(),
        version: library.version,
    })
}

/// An `ncclUniqueId`: made by rank 0, copied to every rank, names one
/// communicator. Its bytes travel through the [`Store`](crate::bootstrap::Store).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; sys::UNIQUE_ID_BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id holds rank 0's address and a secret-ish magic: show its size only.
        write!(f, "UniqueId({} bytes)", self.0.len())
    }
}

impl UniqueId {
    /// `ncclGetUniqueId`. Works without a GPU (NCCL only picks a network
    /// interface and a port for its bootstrap).
    ///
    /// # Errors
    ///
    /// As [`library_info`]; [`Error::Nccl`] when NCCL finds no usable network interface.
    pub fn new() -> Result<UniqueId> {
        let library = sys::library()?;
        let mut raw = sys::RawUniqueId {
            internal: [0; sys::UNIQUE_ID_BYTES],
        };
        // SAFETY: `raw` is a valid, writable ncclUniqueId.
        let rc = unsafe { (library.get_unique_id)(&mut raw) };
        check(library, 0, "ncclGetUniqueId", rc, std::ptr::null_mut())?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// The id's bytes, to publish.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// An id from published bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`] when `bytes` is not an id's length.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let id: [u8; sys::UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| Error::Bootstrap {
            context: "reading the NCCL unique id from the store".into(),
            detail: format!(
                "got {} bytes, an ncclUniqueId has {}",
                bytes.len(),
                sys::UNIQUE_ID_BYTES
            ),
        })?;
        Ok(UniqueId(id))
    }

    fn raw(&self) -> sys::RawUniqueId {
        sys::RawUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

/// Turns an NCCL return code into our error, with NCCL's own text.
fn check(
    library: &sys::NcclLibrary,
    rank: Rank,
    call: &'static str,
    rc: sys::NcclResult,
    comm: sys::RawComm,
) -> Result<()> {
    if rc == sys::NCCL_SUCCESS || rc == sys::NCCL_IN_PROGRESS {
        return Ok(());
    }
    let last = library.last_error(comm);
    let detail = if last.is_empty() {
        library.error_string(rc)
    } else {
        last
    };
    Err(Error::Nccl {
        rank,
        call,
        code: rc,
        name: sys::result_name(rc),
        detail,
    })
}

/// NCCL's code for an element type.
pub(crate) fn nccl_dtype(dtype: DType) -> sys::NcclDataType {
    match dtype {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

/// NCCL's code for a reduction operator.
pub(crate) fn nccl_op(op: ReduceOp) -> sys::NcclRedOp {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// What one validated call becomes in NCCL: counts in elements, and for the
/// in-place forms the element offset of this rank's block in the one buffer
/// (NCCL's in-place convention: `recvbuff == sendbuff + rank*count` for
/// reduce-scatter, `sendbuff == recvbuff + rank*count` for all-gather).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NcclCall {
    /// `ncclAllReduce(send, recv, count)`.
    AllReduce {
        /// Elements per rank.
        count: usize,
    },
    /// `ncclReduceScatter(send, recv + recv_offset, recv_count)`.
    ReduceScatter {
        /// Elements each rank receives.
        recv_count: usize,
        /// Where the result goes in the receive buffer (non-zero only in place).
        recv_offset: usize,
    },
    /// `ncclAllGather(send + send_offset, recv, send_count)`.
    AllGather {
        /// Elements each rank contributes.
        send_count: usize,
        /// Where this rank's block is in the send buffer (non-zero only in place).
        send_offset: usize,
    },
    /// `ncclBroadcast(send, recv, count, root)`; off the root the send
    /// buffer is not read and the receive buffer stands in for it.
    Broadcast {
        /// Elements.
        count: usize,
        /// The root.
        root: Rank,
    },
    /// `ncclReduce(send, recv, count, root)`; off the root the receive
    /// buffer is not written and the send buffer stands in for it.
    Reduce {
        /// Elements.
        count: usize,
        /// The root.
        root: Rank,
    },
    /// `ncclSend(buf, count, peer)`.
    Send {
        /// Elements.
        count: usize,
        /// The receiver.
        peer: Rank,
    },
    /// `ncclRecv(buf, count, peer)`.
    Recv {
        /// Elements.
        count: usize,
        /// The sender.
        peer: Rank,
    },
    /// One group of `ncclSend(send + p*block)` / `ncclRecv(recv + p*block)`
    /// for every rank `p` (how PyTorch runs all-to-all on every NCCL version).
    AllToAll {
        /// Elements per block.
        block: usize,
    },
    /// A one-element all-reduce on the communicator's own scratch buffer,
    /// followed by a wait for the stream: NCCL has no barrier.
    Barrier,
}

impl NcclCall {
    /// The call a validated description becomes.
    pub(crate) fn plan(desc: &CollectiveDesc) -> NcclCall {
        let world = desc.world_size.max(1);
        let recv_len = desc.recv.map_or(0, |b| b.len);
        let send_len = desc.send.map_or(0, |b| b.len);
        let is_root = desc.root == Some(desc.rank);
        match desc.op {
            OpKind::AllReduce => NcclCall::AllReduce { count: recv_len },
            OpKind::ReduceScatter if desc.in_place => NcclCall::ReduceScatter {
                recv_count: recv_len / world,
                recv_offset: desc.rank * (recv_len / world),
            },
            OpKind::ReduceScatter => NcclCall::ReduceScatter {
                recv_count: recv_len,
                recv_offset: 0,
            },
            OpKind::AllGather if desc.in_place => NcclCall::AllGather {
                send_count: recv_len / world,
                send_offset: desc.rank * (recv_len / world),
            },
            OpKind::AllGather => NcclCall::AllGather {
                send_count: send_len,
                send_offset: 0,
            },
            OpKind::Broadcast => NcclCall::Broadcast {
                count: recv_len,
                root: desc.root.unwrap_or(0),
            },
            OpKind::Reduce => NcclCall::Reduce {
                count: if desc.in_place || is_root {
                    recv_len
                } else {
                    send_len
                },
                root: desc.root.unwrap_or(0),
            },
            OpKind::Send => NcclCall::Send {
                count: send_len,
                peer: desc.peer.unwrap_or(0),
            },
            OpKind::Recv => NcclCall::Recv {
                count: recv_len,
                peer: desc.peer.unwrap_or(0),
            },
            OpKind::AllToAll => NcclCall::AllToAll {
                block: recv_len / world,
            },
            OpKind::Barrier | OpKind::Split | OpKind::AllocShared | OpKind::Init => {
                NcclCall::Barrier
            }
        }
    }
}

/// How often a wait polls NCCL's asynchronous state. NCCL's own examples
/// spin on `ncclCommGetAsyncError`; a short sleep keeps a waiting rank off a
/// core it may share with NCCL's proxy thread.
/// The longest [`NcclComm::abort`] waits for `ncclCommAbort` (less when the
/// communicator's timeout is shorter): a healthy abort returns in well
/// under a second; one that hangs (see there) is left behind.
const ABORT_GRACE: Duration = Duration::from_secs(10);

const POLL_INTERVAL: Duration = Duration::from_micros(50);

/// An NCCL communicator (non-blocking), owned: finalized and destroyed on
/// drop, or aborted when it failed.
pub(crate) struct NcclComm {
    raw: sys::RawComm,
    library: &'static sys::NcclLibrary,
    rank: Rank,
    world: usize,
    timeout: Duration,
    /// Set once a call failed, timed out or aborted: drop then aborts
    /// instead of finalizing (a broken communicator cannot finalize).
    broken: bool,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time
// (NCCL's rule); `NcclComm` is not `Sync`, and `&mut self` on every call
// keeps it to one thread at a time.
unsafe impl Send for NcclComm {}

/// A communicator handed to the thread that aborts it.
struct RawCommToAbort(sys::RawComm);

// SAFETY: moved to exactly one thread, which makes the handle's last call;
// the `NcclComm` it came from forgets it (NCCL's one-thread-at-a-time rule).
unsafe impl Send for RawCommToAbort {}

/// Runs `work` on a thread of its own and waits for it at most `bound`:
/// whether it finished. Past the bound it keeps running, detached. Where
/// no thread can be started it runs here, unbounded.
fn call_bounded(bound: Duration, work: impl FnOnce() + Send + 'static) -> bool {
    // Kept here too, so that it still runs when no thread starts (a failed
    // spawn drops its closure, and with it the thread's reference).
    let slot = std::sync::Arc::new(std::sync::Mutex::new(Some(work)));
    let theirs = std::sync::Arc::clone(&slot);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("oxccl-nccl-abort".into())
        .spawn(move || {
            take_and_run(&theirs);
            let _ = done_tx.send(());
        });
    if spawned.is_ok() {
        return done_rx.recv_timeout(bound).is_ok();
    }
    take_and_run(&slot);
    true
}

/// Runs the work in `slot` if it is still there (once, whoever comes first).
fn take_and_run(slot: &std::sync::Mutex<Option<impl FnOnce()>>) {
    let work = slot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(work) = work {
        work();
    }
}

impl NcclComm {
    /// Starts `ncclCommInitRankConfig` for `rank` of `world` (non-blocking)
    /// on the calling thread's current CUDA device. Call
    /// [`wait_ready`](Self::wait_ready) before use; within a group (see
    /// [`local_group`](crate::device::DeviceCommunicator::local_group)) after
    /// `ncclGroupEnd`.
    pub(crate) fn start_init(
        library: &'static sys::NcclLibrary,
        id: &UniqueId,
        rank: Rank,
        world: usize,
        timeout: Duration,
    ) -> Result<NcclComm> {
        let mut raw: sys::RawComm = std::ptr::null_mut();
        let mut config = sys::RawConfig::non_blocking();
        let (Ok(nranks), Ok(r)) = (c_int::try_from(world), c_int::try_from(rank)) else {
            return Err(Error::InvalidArgument {
                op: OpKind::Split,
                rank,
                arg: "world_size",
                reason: format!("world size {world} does not fit NCCL's int"),
            });
        };
        // SAFETY: `raw` and `config` are valid for writing/reading; the id is
        // passed by value as nccl.h declares.
        let rc =
            unsafe { (library.comm_init_rank_config)(&mut raw, nranks, id.raw(), r, &mut config) };
        let comm = NcclComm {
            raw,
            library,
            rank,
            world,
            timeout,
            broken: false,
        };
        if let Err(e) = check(library, rank, "ncclCommInitRankConfig", rc, raw) {
            let mut comm = comm;
            comm.broken = true;
            return Err(e);
        }
        if raw.is_null() {
            return Err(Error::Nccl {
                rank,
                call: "ncclCommInitRankConfig",
                code: rc,
                name: sys::result_name(rc),
                detail: "NCCL returned no communicator".into(),
            });
        }
        Ok(comm)
    }

    /// This communicator's rank.
    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    /// The world size.
    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// One look at the communicator's asynchronous state: `Ok(true)` when
    /// idle, `Ok(false)` while NCCL is still working, an error when a call
    /// failed (on this rank or, with `ncclRemoteError`, on a peer).
    pub(crate) fn poll(&mut self, what: &'static str) -> Result<bool> {
        if self.raw.is_null() {
            // Aborted (by `abort()` or a timeout): asking NCCL about a null
            // communicator would say `ncclInvalidArgument`, or nothing.
            const NCCL_INVALID_USAGE: sys::NcclResult = 5;
            self.broken = true;
            return Err(Error::Nccl {
                rank: self.rank,
                call: what,
                code: NCCL_INVALID_USAGE,
                name: sys::result_name(NCCL_INVALID_USAGE),
                detail: "the communicator was aborted (abort() or an earlier timeout); \
                         it takes no further calls"
                    .into(),
            });
        }
        let mut state: sys::NcclResult = sys::NCCL_SUCCESS;
        // SAFETY: `raw` is a live communicator; `state` is writable.
        let rc = unsafe { (self.library.comm_get_async_error)(self.raw, &mut state) };
        let checked = check(
            self.library,
            self.rank,
            "ncclCommGetAsyncError",
            rc,
            self.raw,
        )
        .and_then(|()| check(self.library, self.rank, what, state, self.raw));
        if checked.is_err() {
            self.broken = true;
        }
        checked.map(|()| state != sys::NCCL_IN_PROGRESS)
    }

    /// Polls until NCCL is idle; past the deadline aborts and returns
    /// [`Error::DeviceTimeout`] naming `what` and `detail`.
    pub(crate) fn wait_ready(&mut self, what: &'static str, detail: &str) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.poll(what)? {
                return Ok(());
            }
            if start.elapsed() >= self.timeout {
                self.abort();
                return Err(Error::DeviceTimeout {
                    rank: self.rank,
                    what: format!("{what} ({detail})"),
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Checks a call's return code, then waits out `ncclInProgress`.
    pub(crate) fn finish_call(
        &mut self,
        call: &'static str,
        rc: sys::NcclResult,
        detail: &str,
    ) -> Result<()> {
        if let Err(e) = check(self.library, self.rank, call, rc, self.raw) {
            self.broken = true;
            return Err(e);
        }
        if rc == sys::NCCL_IN_PROGRESS {
            self.wait_ready(call, detail)?;
        }
        Ok(())
    }

    /// The raw handle for an FFI call.
    pub(crate) fn raw(&self) -> sys::RawComm {
        self.raw
    }

    /// The library the communicator lives in.
    pub(crate) fn library(&self) -> &'static sys::NcclLibrary {
        self.library
    }

    /// `ncclCommAbort`: stops whatever runs on the device for this
    /// communicator and frees it. Later calls fail.
    ///
    /// Waits for it at most the communicator's timeout, and at most
    /// [`ABORT_GRACE`]: NCCL's abort joins its internal threads and has
    /// hung there while a peer on the node was stopped (NVIDIA/nccl#863,
    /// #1777); past the bound the abort is left running on its own thread
    /// (the communicator's resources leak, said on stderr) so the timeout
    /// that called it is still returned — after the wait that timed out
    /// plus this grace, not twice the timeout.
    pub(crate) fn abort(&mut self) {
        if !self.raw.is_null() {
            let raw = RawCommToAbort(self.raw);
            let comm_abort = self.library.comm_abort;
            let bound = self.timeout.min(ABORT_GRACE);
            // SAFETY: `raw` is a live communicator, freed here exactly once
            // (this handle forgets it below, whether or not the abort
            // returns in time).
            let finished = call_bounded(bound, move || unsafe {
                let raw = raw;
                comm_abort(raw.0);
            });
            if !finished {
                eprintln!(
                    "oxccl: rank {}: ncclCommAbort did not return within {:?}; left \
                     running on its own thread (this communicator's resources leak)",
                    self.rank, bound
                );
            }
            self.raw = std::ptr::null_mut();
        }
        self.broken = true;
    }

    /// `ncclCommSplit`: ranks of equal `color` form a communicator ordered
    /// by `key` (then by parent rank); `None` as color leaves this rank out
    /// (`NCCL_SPLIT_NOCOLOR`) and returns `None`. Collective over this
    /// communicator, with the deadline.
    /// Why this library cannot split (no `ncclCommSplit`).
    fn split_unsupported(&self) -> Error {
        Error::LibraryUnsupported {
            library: "NCCL",
            detail: format!(
                "split needs ncclCommSplit (NCCL {}), {} is NCCL {}",
                sys::SPLIT_VERSION,
                self.library.path,
                self.library.version
            ),
        }
    }

    /// Whether a split with these arguments can start: the library has
    /// `ncclCommSplit`, and the color and key fit NCCL's `int`. A refusal
    /// here starts nothing and leaves this communicator usable.
    pub(crate) fn check_split(&self, color: Option<u32>, key: i64) -> Result<()> {
        if self.library.comm_split.is_none() {
            return Err(self.split_unsupported());
        }
        split_args(self.rank, color, key).map(|_| ())
    }

    pub(crate) fn split(&mut self, color: Option<u32>, key: i64) -> Result<Option<NcclComm>> {
        let split = self
            .library
            .comm_split
            .ok_or_else(|| self.split_unsupported())?;
        let (color, key) = split_args(self.rank, color, key)?;
        // With a non-blocking parent NCCL returns at once (ncclSuccess, not
        // ncclInProgress) and a background job writes the new communicator
        // into `newcomm` later; the parent stays busy until it has. So the
        // out-slot and the config live on the heap, the parent is polled
        // before the slot is read, and on a timeout both are leaked rather
        // than freed under NCCL's feet.
        let slot: *mut sys::RawComm = Box::into_raw(Box::new(std::ptr::null_mut()));
        let config: *mut sys::RawConfig = Box::into_raw(Box::new(sys::RawConfig::non_blocking()));
        // SAFETY: live parent communicator; `slot`/`config` stay valid until
        // NCCL is done with them (freed below only once the parent is idle).
        let rc = unsafe { split(self.raw, color, key, slot, config) };
        let free = || {
            // SAFETY: both came from Box::into_raw above and NCCL no longer uses them.
            unsafe {
                drop(Box::from_raw(config));
                *Box::from_raw(slot)
            }
        };
        if let Err(e) = check(self.library, self.rank, "ncclCommSplit", rc, self.raw) {
            // Refused synchronously: no job was started.
            self.broken = true;
            free();
            return Err(e);
        }
        self.wait_ready("ncclCommSplit", "splitting the parent communicator")?;
        let raw = free();
        if raw.is_null() {
            return Ok(None);
        }
        // Until ncclCommUserRank answers, the child's errors (a set-up
        // timeout, the abort's stderr line) name this rank's parent rank.
        let mut child = NcclComm {
            raw,
            library: self.library,
            rank: self.rank,
            world: 0,
            timeout: self.timeout,
            broken: false,
        };
        child.wait_ready("ncclCommSplit", "the new communicator's set-up")?;
        let (mut count, mut rank): (c_int, c_int) = (0, 0);
        // SAFETY: live communicator; writable out-parameters.
        let rc = unsafe { (self.library.comm_count)(raw, &mut count) };
        check(self.library, self.rank, "ncclCommCount", rc, raw)?;
        // SAFETY: as above.
        let rc = unsafe { (self.library.comm_user_rank)(raw, &mut rank) };
        check(self.library, self.rank, "ncclCommUserRank", rc, raw)?;
        child.rank = rank.max(0) as Rank;
        child.world = count.max(0) as usize;
        Ok(Some(child))
    }
}

/// A split's color and key as NCCL's `int`s (`None`: `NCCL_SPLIT_NOCOLOR`),
/// or the argument that does not fit.
pub(crate) fn split_args(rank: Rank, color: Option<u32>, key: i64) -> Result<(c_int, c_int)> {
    let invalid = |arg: &'static str, value: i64| Error::InvalidArgument {
        op: OpKind::Split,
        rank,
        arg,
        reason: format!("{value} does not fit NCCL's int (0..=2147483647 for a color)"),
    };
    let color = match color {
        Some(c) => c_int::try_from(c).map_err(|_| invalid("color", i64::from(c)))?,
        None => -1, // NCCL_SPLIT_NOCOLOR
    };
    let key = c_int::try_from(key).map_err(|_| invalid("key", key))?;
    Ok((color, key))
}

impl Drop for NcclComm {
    /// Finalizes (flushes outstanding work, with the deadline) and destroys;
    /// aborts instead when the communicator failed or finalizing does not
    /// finish in time. Never panics, never blocks past the deadline.
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        if !self.broken {
            // SAFETY: live communicator.
            let rc = unsafe { (self.library.comm_finalize)(self.raw) };
            let finalized = check(self.library, self.rank, "ncclCommFinalize", rc, self.raw)
                .is_ok()
                && self
                    .wait_ready("ncclCommFinalize", "dropping the communicator")
                    .is_ok();
            if finalized && !self.raw.is_null() {
                // SAFETY: finalized, freed here exactly once.
                unsafe { (self.library.comm_destroy)(self.raw) };
                self.raw = std::ptr::null_mut();
                return;
            }
        }
        self.abort();
    }
}

/// `ncclGroupStart`/`ncclGroupEnd` as a guard: [`end`](Self::end) closes
/// the group and reports its result; dropping an unfinished guard (an early
/// return with `?`) still closes it, so no error path leaves NCCL's
/// thread-local group open.
pub(crate) struct GroupGuard {
    library: &'static sys::NcclLibrary,
    open: bool,
}

thread_local! {
    /// NCCL groups this thread holds open ([`GroupGuard`]s not yet ended).
    static OPEN_GROUPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether this thread holds an NCCL group open: NCCL's group state is the
/// thread's, so any NCCL call made now joins that group and is launched
/// only at its end.
pub(crate) fn group_open_on_this_thread() -> bool {
    OPEN_GROUPS.with(|open| open.get() > 0)
}

/// Refuses to set up an NCCL communicator while a `P2pGroup` is open on
/// this thread: NCCL would defer the set-up (`ncclCommInitRankConfig`, or
/// a `local_group`'s, whose own group would only nest) to the open
/// group's end, so the set-up would wait out its whole timeout and then
/// abort.
pub(crate) fn refuse_setup_inside_open_group(rank: Rank) -> Result<()> {
    if group_open_on_this_thread() {
        return Err(Error::InvalidArgument {
            op: OpKind::Init,
            rank,
            arg: "self",
            reason: "a P2pGroup is open on this thread, and NCCL would defer this \
                     communicator's set-up to the group's end (it would wait out its \
                     timeout); end the group first"
                .into(),
        });
    }
    Ok(())
}

fn count_group(opened: bool) {
    OPEN_GROUPS.with(|open| {
        open.set(if opened {
            open.get() + 1
        } else {
            open.get().saturating_sub(1)
        })
    });
}

impl GroupGuard {
    /// `ncclGroupStart`.
    pub(crate) fn start(library: &'static sys::NcclLibrary, rank: Rank) -> Result<GroupGuard> {
        // SAFETY: no arguments; opens this thread's group.
        let rc = unsafe { (library.group_start)() };
        check(library, rank, "ncclGroupStart", rc, std::ptr::null_mut())?;
        count_group(true);
        Ok(GroupGuard {
            library,
            open: true,
        })
    }

    /// `ncclGroupEnd`; the raw code, for the caller to finish per communicator.
    pub(crate) fn end(mut self) -> sys::NcclResult {
        self.open = false;
        count_group(false);
        // SAFETY: closes the group this guard opened.
        unsafe { (self.library.group_end)() }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if self.open {
            count_group(false);
            // SAFETY: closes the group this guard opened; the error (if any)
            // belongs to the call that is already failing.
            unsafe { (self.library.group_end)() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::{BufDesc, MemoryKind};

    #[test]
    fn no_communicator_is_set_up_inside_an_open_group() {
        assert!(refuse_setup_inside_open_group(2).is_ok());
        count_group(true);
        let refused = refuse_setup_inside_open_group(2);
        count_group(false);
        assert!(
            matches!(
                refused,
                Err(Error::InvalidArgument {
                    op: OpKind::Init,
                    rank: 2,
                    ..
                })
            ),
            "{refused:?}"
        );
        assert!(refuse_setup_inside_open_group(2).is_ok());
    }

    #[test]
    fn split_arguments_outside_nccls_int_are_refused_before_anything_starts() {
        assert_eq!(split_args(3, Some(7), -5).unwrap(), (7, -5));
        assert_eq!(split_args(3, None, 0).unwrap(), (-1, 0));
        assert_eq!(
            split_args(3, Some(i32::MAX as u32), i64::from(i32::MIN)).unwrap(),
            (i32::MAX, i32::MIN)
        );
        for (color, key, bad) in [
            (Some(1u32 << 31), 0, "color"),
            (Some(u32::MAX), 0, "color"),
            (Some(0), i64::from(i32::MAX) + 1, "key"),
            (None, i64::MIN, "key"),
        ] {
            match split_args(3, color, key) {
                Err(Error::InvalidArgument {
                    op: OpKind::Split,
                    rank: 3,
                    arg,
                    ..
                }) => assert_eq!(arg, bad),
                other => panic!("{color:?} {key}: {other:?}"),
            }
        }
    }

    fn desc(op: OpKind, rank: Rank, world: usize) -> CollectiveDesc {
        CollectiveDesc::new(op, DType::F32, rank, world, MemoryKind::Device)
    }

    /// The abort's wait: bounded by its deadline whatever the work does
    /// (NCCL's abort has hung joining its threads), and the work runs once.
    #[test]
    fn a_bounded_call_returns_at_its_bound_and_runs_once() {
        let start = Instant::now();
        assert!(!call_bounded(Duration::from_millis(50), || {
            std::thread::sleep(Duration::from_secs(30))
        }));
        assert!(start.elapsed() < Duration::from_secs(5));
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        assert!(call_bounded(Duration::from_secs(10), move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    fn dev(len: usize) -> BufDesc {
        BufDesc {
            len,
            memory: MemoryKind::Device,
        }
    }

    /// NCCL's own initialisation on a machine without a GPU (pip's NCCL,
    /// as `.ci/run` installs it): an error carrying NCCL's text, quickly —
    /// not a panic, not a hang. (`DeviceCommunicator` stops earlier, at the
    /// driver check; this is the path a broken driver or device would take.)
    #[test]
    fn nccl_init_without_a_device_is_an_error_not_a_hang() {
        let Ok(path) = std::env::var("OXCCL_TEST_NCCL_LIBRARY") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI sets OXCCL_TEST_NCCL_LIBRARY"
            );
            eprintln!("skipped: OXCCL_TEST_NCCL_LIBRARY is not set");
            return;
        };
        let library: &'static sys::NcclLibrary =
            Box::leak(Box::new(sys::load_from(&[path]).unwrap()));
        let mut raw = sys::RawUniqueId {
            internal: [0; sys::UNIQUE_ID_BYTES],
        };
        // SAFETY: a writable id.
        let rc = unsafe { (library.get_unique_id)(&mut raw) };
        assert_eq!(rc, sys::NCCL_SUCCESS);
        let id = UniqueId(raw.internal.map(|c| c as u8));
        let start = Instant::now();
        let result = NcclComm::start_init(library, &id, 0, 1, Duration::from_secs(10)).and_then(
            |mut comm| {
                comm.wait_ready("ncclCommInitRankConfig", "test")
                    .map(|()| comm)
            },
        );
        let e = result
            .err()
            .expect("no GPU here, so NCCL cannot make a communicator");
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{:?}",
            start.elapsed()
        );
        eprintln!("NCCL init without a device: {e}");
        assert!(
            matches!(e, Error::Nccl { .. } | Error::DeviceTimeout { .. }),
            "{e:?}"
        );
    }

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(NcclVersion::from_code(23203).to_string(), "2.32.3");
        assert_eq!(NcclVersion::from_code(21400), MIN_VERSION);
        assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
        assert!(NcclVersion::from_code(2708) < MIN_VERSION);
        assert!(NcclVersion::from_code(21803) >= sys::SPLIT_VERSION);
    }

    #[test]
    fn dtype_and_op_codes_follow_nccl_h() {
        // DType::ALL is in nccl.h's order.
        let codes: Vec<_> = DType::ALL.into_iter().map(nccl_dtype).collect();
        assert_eq!(codes, (0..10).collect::<Vec<_>>());
        let ops: Vec<_> = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
        ]
        .into_iter()
        .map(nccl_op)
        .collect();
        assert_eq!(ops, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn config_matches_the_2_17_layout() {
        // size_t size; uint magic; uint version; int blocking, cgaClusterSize,
        // minCTAs, maxCTAs; const char* netName; int splitShare (+ padding).
        assert_eq!(std::mem::size_of::<sys::RawConfig>(), 48);
        assert_eq!(std::mem::size_of::<sys::RawUniqueId>(), 128);
    }

    #[test]
    fn in_place_calls_point_at_this_ranks_block() {
        let rs = desc(OpKind::ReduceScatter, 2, 4).with_in_place(dev(40));
        assert_eq!(
            NcclCall::plan(&rs),
            NcclCall::ReduceScatter {
                recv_count: 10,
                recv_offset: 20
            }
        );
        let ag = desc(OpKind::AllGather, 3, 4).with_in_place(dev(40));
        assert_eq!(
            NcclCall::plan(&ag),
            NcclCall::AllGather {
                send_count: 10,
                send_offset: 30
            }
        );
        let ag = desc(OpKind::AllGather, 3, 4)
            .with_send(dev(10))
            .with_recv(dev(40));
        assert_eq!(
            NcclCall::plan(&ag),
            NcclCall::AllGather {
                send_count: 10,
                send_offset: 0
            }
        );
    }

    #[test]
    fn rooted_calls_count_the_buffer_that_exists_on_this_rank() {
        // Off the root, reduce's receive buffer may be empty.
        let r = desc(OpKind::Reduce, 1, 2)
            .with_send(dev(7))
            .with_recv(dev(0))
            .with_reduce_op(ReduceOp::Sum)
            .with_root(0);
        r.validate().unwrap();
        assert_eq!(NcclCall::plan(&r), NcclCall::Reduce { count: 7, root: 0 });
        let b = desc(OpKind::Broadcast, 1, 2)
            .with_send(dev(0))
            .with_recv(dev(5))
            .with_root(0);
        b.validate().unwrap();
        assert_eq!(
            NcclCall::plan(&b),
            NcclCall::Broadcast { count: 5, root: 0 }
        );
        let a = desc(OpKind::AllToAll, 0, 3)
            .with_send(dev(12))
            .with_recv(dev(12));
        assert_eq!(NcclCall::plan(&a), NcclCall::AllToAll { block: 4 });
    }
}
