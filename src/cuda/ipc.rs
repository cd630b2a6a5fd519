//! The cuda-ring between processes: CUDA IPC memory and event handles,
//! exchanged over a host [`Communicator`] (the control channel), which the
//! ranks make through the job's [`Store`](crate::bootstrap::Store).
//!
//! The executor's protocol is the one threads of a process use
//! ([`super::ring`]): per call, a receiver publishes to each sender a
//! *ready* (its inbox for that sender and an event recorded after its
//! earlier reads); a sender waits for it before its first message, writes
//! the inbox and *posts* an event per message. Between processes these are
//! [`Frame`]s on the control channel, and the memory and events travel as
//! IPC handles, opened once by the peer and cached:
//!
//! - an inbox is device memory (`cuIpcGetMemHandle`; opened with
//!   `cuIpcOpenMemHandle`, peer access enabled lazily for another GPU), or
//!   for the host-staged path a shared-memory segment both processes map
//!   and register as pinned memory (`cuMemHostRegister`);
//! - the ready event is one interprocess event per rank, recorded every
//!   call; a message event is one interprocess event per (peer, message
//!   slot of a call), recorded again in later calls.
//!
//! Re-recording an event is safe only if the peer has already queued its
//! wait on the earlier record (`cuStreamWaitEvent` waits for the *latest*
//! record; waiting for a later one could wait on work that waits on the
//! waiter). The lowering guarantees it: a sender's first message of a call,
//! empty or not, follows the receiver's ready of that call, and a receiver
//! publishes its ready only after enqueuing all of its earlier calls, so
//! every wait on slot `i` of a pair's earlier call is queued before the
//! sender records slot `i` again. The ready event is recorded again only
//! at the receiver's next call, which it starts after all messages of the
//! current one arrived, i.e. after every sender queued its wait on it.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};

use cudarc::driver::sys::{self, CUdeviceptr, CUevent};

use super::ring::{check, Path};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::transport::shm::Segment;
use crate::types::{OpKind, Rank};

/// Bytes of every control frame (the host channel matches lengths).
pub(crate) const FRAME_BYTES: usize = 160;
const MAGIC: &[u8; 4] = b"OXCR";
const KIND_READY: u8 = 1;
const KIND_POST: u8 = 2;
const KIND_ABORT: u8 = 3;
const KIND_BYE: u8 = 4;
/// An IPC handle's size (`CUipcMemHandle`, `CUipcEventHandle`).
pub(crate) const HANDLE_BYTES: usize = 64;
pub(crate) type Handle = [u8; HANDLE_BYTES];

/// Where a receiver's inbox for one sender lies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum InboxDesc {
    /// No inbox: the sender's messages of the call are empty.
    None,
    /// Device memory, exported with `cuIpcGetMemHandle`.
    Device { generation: u64, handle: Handle },
    /// A shared-memory segment (host-staged path), by name.
    Host { generation: u64, name: String },
}

/// One control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// The receiver is ready for the sender's messages of a call.
    Ready {
        /// Bytes it expects from the sender in the call.
        bytes: u64,
        /// Messages it expects (the sender checks its own count: equal
        /// bytes in a different number of messages would desynchronise
        /// the pair).
        messages: u32,
        /// The sizes of those messages, in order
        /// ([`super::lower::layout_digest`]).
        layout: u32,
        inbox: InboxDesc,
        /// Its ready event.
        event: Handle,
    },
    /// A message of the call is complete once `event` (slot `slot`) is.
    Post { slot: u32, event: Handle },
    /// The sender's group failed or was aborted: stop waiting for it.
    Abort,
    /// The sender is dropping its communicator and its GPU waits on this
    /// rank's events are complete.
    Bye,
}

impl Frame {
    pub(crate) fn encode(&self) -> [u8; FRAME_BYTES] {
        let mut out = [0u8; FRAME_BYTES];
        out[..4].copy_from_slice(MAGIC);
        match self {
            Frame::Ready {
                bytes,
                messages,
                layout,
                inbox,
                event,
            } => {
                out[4] = KIND_READY;
                out[8..16].copy_from_slice(&bytes.to_le_bytes());
                out[152..156].copy_from_slice(&messages.to_le_bytes());
                out[156..160].copy_from_slice(&layout.to_le_bytes());
                out[24..88].copy_from_slice(event);
                match inbox {
                    InboxDesc::None => {}
                    InboxDesc::Device { generation, handle } => {
                        out[5] = 1;
                        out[16..24].copy_from_slice(&generation.to_le_bytes());
                        out[88..152].copy_from_slice(handle);
                    }
                    InboxDesc::Host { generation, name } => {
                        out[5] = 2;
                        out[16..24].copy_from_slice(&generation.to_le_bytes());
                        // Names are made by `SharedInbox::create`, well
                        // under 64 bytes; the last byte stays NUL.
                        let n = name.len().min(HANDLE_BYTES - 1);
                        out[88..88 + n].copy_from_slice(&name.as_bytes()[..n]);
                    }
                }
            }
            Frame::Post { slot, event } => {
                out[4] = KIND_POST;
                out[8..12].copy_from_slice(&slot.to_le_bytes());
                out[24..88].copy_from_slice(event);
            }
            Frame::Abort => out[4] = KIND_ABORT,
            Frame::Bye => out[4] = KIND_BYE,
        }
        out
    }

    /// Parses a frame, saying what is wrong with a malformed one.
    pub(crate) fn decode(raw: &[u8]) -> std::result::Result<Frame, String> {
        if raw.len() != FRAME_BYTES {
            return Err(format!("{} bytes, not {FRAME_BYTES}", raw.len()));
        }
        if &raw[..4] != MAGIC {
            return Err("not a cuda-ring control frame (bad magic)".into());
        }
        let u64_at = |at: usize| u64::from_le_bytes(raw[at..at + 8].try_into().unwrap_or([0; 8]));
        let handle_at = |at: usize| -> Handle { raw[at..at + 64].try_into().unwrap_or([0; 64]) };
        match raw[4] {
            KIND_READY => {
                let generation = u64_at(16);
                let inbox = match raw[5] {
                    0 => InboxDesc::None,
                    1 => InboxDesc::Device {
                        generation,
                        handle: handle_at(88),
                    },
                    2 => {
                        let field = &raw[88..152];
                        let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
                        let name = std::str::from_utf8(&field[..end])
                            .map_err(|_| "a shared inbox name is not UTF-8".to_string())?;
                        if end == 0 || end == field.len() || !name.starts_with('/') {
                            return Err(format!("bad shared inbox name {name:?}"));
                        }
                        InboxDesc::Host {
                            generation,
                            name: name.to_owned(),
                        }
                    }
                    k => return Err(format!("unknown inbox kind {k}")),
                };
                let bytes = u64_at(8);
                if bytes > 0 && inbox == InboxDesc::None {
                    return Err(format!("a ready for {bytes} bytes names no inbox"));
                }
                Ok(Frame::Ready {
                    bytes,
                    messages: u32::from_le_bytes(raw[152..156].try_into().unwrap_or([0; 4])),
                    layout: u32::from_le_bytes(raw[156..160].try_into().unwrap_or([0; 4])),
                    inbox,
                    event: handle_at(24),
                })
            }
            KIND_POST => Ok(Frame::Post {
                slot: u32::from_le_bytes(raw[8..12].try_into().unwrap_or([0; 4])),
                event: handle_at(24),
            }),
            KIND_ABORT => Ok(Frame::Abort),
            KIND_BYE => Ok(Frame::Bye),
            k => Err(format!("unknown frame kind {k}")),
        }
    }
}

fn to_bytes(reserved: &[std::ffi::c_char; 64]) -> Handle {
    reserved.map(|c| c as u8)
}

fn from_bytes(handle: &Handle) -> [std::ffi::c_char; 64] {
    handle.map(|b| b as std::ffi::c_char)
}

/// A CUDA event of this process, with the flags an interprocess event
/// needs, and its handle. Destroyed on drop (with its context current:
/// the owner binds it before dropping).
pub(crate) struct ExportedEvent {
    pub event: CUevent,
    pub handle: Handle,
}

impl ExportedEvent {
    pub(crate) fn new(rank: Rank) -> Result<ExportedEvent> {
        let mut event: CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        // SAFETY: out-parameter; the caller's context is current.
        check(rank, "creating an interprocess event", unsafe {
            sys::cuEventCreate(&mut event, flags)
        })?;
        let mut handle = sys::CUipcEventHandle { reserved: [0; 64] };
        // SAFETY: `event` is a live interprocess event.
        let rc = unsafe { sys::cuIpcGetEventHandle(&mut handle, event) };
        if let Err(e) = check(rank, "exporting an event (cuIpcGetEventHandle)", rc) {
            // SAFETY: created above, used by nothing.
            unsafe { sys::cuEventDestroy_v2(event) };
            return Err(e);
        }
        Ok(ExportedEvent {
            event,
            handle: to_bytes(&handle.reserved),
        })
    }
}

impl Drop for ExportedEvent {
    fn drop(&mut self) {
        // SAFETY: created by `new`; the owner synchronised its stream.
        unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

/// A peer's event opened in this process.
pub(crate) struct OpenedEvent {
    pub event: CUevent,
    handle: Handle,
}

impl OpenedEvent {
    fn open(rank: Rank, handle: &Handle) -> Result<OpenedEvent> {
        let mut event: CUevent = std::ptr::null_mut();
        let raw = sys::CUipcEventHandle {
            reserved: from_bytes(handle),
        };
        // SAFETY: out-parameter; a handle from a peer's `ExportedEvent`.
        let rc = unsafe { sys::cuIpcOpenEventHandle(&mut event, raw) };
        check(rank, "opening a peer's event (cuIpcOpenEventHandle)", rc)?;
        Ok(OpenedEvent {
            event,
            handle: *handle,
        })
    }
}

impl Drop for OpenedEvent {
    fn drop(&mut self) {
        // SAFETY: opened by `open`; nothing queued waits on it any more
        // (the owner synchronised its stream).
        unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

/// A host-staged inbox between processes: a shared-memory segment the
/// receiver creates and both sides register as pinned memory mapped into
/// their GPU's address space.
pub(crate) struct SharedInbox {
    segment: Segment,
    host: *mut std::ffi::c_void,
    pub device: CUdeviceptr,
    /// Bytes of the mapped region.
    capacity: usize,
}

// SAFETY: the mapping is process memory owned by `segment`; one thread uses
// the inbox at a time (its RingComm's).
unsafe impl Send for SharedInbox {}

impl SharedInbox {
    /// A new segment of `bytes` (the receiver's side).
    pub(crate) fn create(rank: Rank, bytes: usize) -> Result<SharedInbox> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = format!(
            "/oxccl-cr-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let segment = Segment::create_with_region(&name, 0, 1, bytes).map_err(|e| Error::Cuda {
            rank,
            context: "creating a shared host inbox".into(),
            detail: e.to_string(),
        })?;
        Self::register(rank, segment, bytes)
    }

    /// Maps a peer's segment (the sender's side).
    fn open(rank: Rank, name: &str, bytes: usize) -> Result<SharedInbox> {
        let segment = Segment::open(name).map_err(|e| Error::Cuda {
            rank,
            context: "opening a peer's shared host inbox".into(),
            detail: e.to_string(),
        })?;
        Self::register(rank, segment, bytes)
    }

    fn register(rank: Rank, segment: Segment, bytes: usize) -> Result<SharedInbox> {
        let (host, len) = segment.region();
        if len < bytes {
            return Err(Error::Cuda {
                rank,
                context: "mapping a shared host inbox".into(),
                detail: format!("{} holds {len} bytes, {bytes} expected", segment.name()),
            });
        }
        let host = host as *mut std::ffi::c_void;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the region is mapped for `len` bytes and page aligned
        // (it follows the segment's 4 KiB header).
        let rc = unsafe { sys::cuMemHostRegister_v2(host, len, flags) };
        check(
            rank,
            "registering a shared host inbox (cuMemHostRegister)",
            rc,
        )?;
        let mut device: CUdeviceptr = 0;
        // SAFETY: registered just above with DEVICEMAP.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
        if let Err(e) = check(rank, "mapping a shared host inbox into the GPU", rc) {
            // SAFETY: registered above.
            unsafe { sys::cuMemHostUnregister(host) };
            return Err(e);
        }
        Ok(SharedInbox {
            segment,
            host,
            device,
            capacity: len,
        })
    }

    pub(crate) fn name(&self) -> &str {
        self.segment.name()
    }

    /// Removes the name (the peer has mapped it); the memory stays.
    pub(crate) fn unlink_name(&mut self) {
        self.segment.unlink();
    }
}

impl Drop for SharedInbox {
    fn drop(&mut self) {
        // SAFETY: registered in `register`; the owner synchronised its
        // stream. The segment unmaps after this.
        unsafe { sys::cuMemHostUnregister(self.host) };
    }
}

/// A peer's inbox mapped into this process.
enum MappedInbox {
    /// `capacity`: the allocation's size, from the driver.
    Device {
        generation: u64,
        ptr: CUdeviceptr,
        capacity: usize,
    },
    Host {
        generation: u64,
        inbox: SharedInbox,
    },
}

impl InboxDesc {
    fn generation(&self) -> Option<u64> {
        match self {
            InboxDesc::None => None,
            InboxDesc::Device { generation, .. } | InboxDesc::Host { generation, .. } => {
                Some(*generation)
            }
        }
    }
}

impl MappedInbox {
    /// Maps a peer's inbox of at least `bytes`.
    fn open(rank: Rank, desc: InboxDesc, bytes: usize) -> Result<MappedInbox> {
        match desc {
            InboxDesc::Device { generation, handle } => {
                let mut ptr: CUdeviceptr = 0;
                let raw = sys::CUipcMemHandle {
                    reserved: from_bytes(&handle),
                };
                let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
                // SAFETY: out-parameter; the handle is the peer's live inbox
                // (it keeps replaced inboxes until it exits).
                let rc = unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, raw, flags) };
                check(rank, "opening a peer's inbox (cuIpcOpenMemHandle)", rc)?;
                let (mut base, mut capacity): (CUdeviceptr, usize) = (0, 0);
                // SAFETY: out-parameters; `ptr` was just mapped.
                let rc = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut capacity, ptr) };
                let mapped = MappedInbox::Device {
                    generation,
                    ptr,
                    capacity: capacity.saturating_sub((ptr - base) as usize),
                };
                check(rank, "sizing a peer's inbox (cuMemGetAddressRange)", rc)?;
                Ok(mapped)
            }
            InboxDesc::Host { generation, name } => Ok(MappedInbox::Host {
                generation,
                inbox: SharedInbox::open(rank, &name, bytes)?,
            }),
            InboxDesc::None => Err(Error::Cuda {
                rank,
                context: "mapping a peer's inbox".into(),
                detail: "the peer sent no inbox".into(),
            }),
        }
    }

    fn generation(&self) -> Option<u64> {
        match self {
            MappedInbox::Device { generation, .. } | MappedInbox::Host { generation, .. } => {
                Some(*generation)
            }
        }
    }

    /// Bytes writable at [`ptr`](Self::ptr).
    fn capacity(&self) -> usize {
        match self {
            MappedInbox::Device { capacity, .. } => *capacity,
            MappedInbox::Host { inbox, .. } => inbox.capacity,
        }
    }

    fn ptr(&self) -> CUdeviceptr {
        match self {
            MappedInbox::Device { ptr, .. } => *ptr,
            MappedInbox::Host { inbox, .. } => inbox.device,
        }
    }
}

impl Drop for MappedInbox {
    fn drop(&mut self) {
        if let MappedInbox::Device { ptr, .. } = self {
            // SAFETY: opened by cuIpcOpenMemHandle; the owner synchronised
            // its stream, so no queued write uses it.
            unsafe { sys::cuIpcCloseMemHandle(*ptr) };
        }
    }
}

/// The ready a sender received: where to write, how much, what to wait on.
pub(crate) struct PeerReady {
    pub inbox: CUdeviceptr,
    pub bytes: usize,
    pub messages: usize,
    pub layout: u32,
    pub event: CUevent,
}

/// A ready frame's contents, queued.
struct ReadyMsg {
    bytes: usize,
    messages: usize,
    layout: u32,
    inbox: InboxDesc,
    event: Handle,
}

/// What this rank keeps per peer.
#[derive(Default)]
struct Peer {
    /// Frames from the peer not yet consumed, by kind (FIFO each).
    readies: VecDeque<ReadyMsg>,
    posts: VecDeque<(u32, Handle)>,
    /// The peer's inbox for this rank, mapped.
    inbox: Option<MappedInbox>,
    /// The peer's ready event, opened.
    ready_event: Option<OpenedEvent>,
    /// The peer's message events for this rank, by slot, opened.
    message_events: Vec<Option<OpenedEvent>>,
    /// This rank's message events for the peer, by slot.
    own_events: Vec<ExportedEvent>,
    /// Messages posted to the peer in the current call.
    posted_in_call: usize,
    /// The peer said it is dropping its communicator.
    bye: bool,
}

/// One rank's links to the others of a cuda-ring group in separate
/// processes.
pub(crate) struct RemoteLinks {
    control: Communicator,
    rank: Rank,
    world: usize,
    /// `paths[from * world + to]`, as each receiver decided.
    paths: Vec<Path>,
    peers: Vec<Peer>,
    /// Recorded every call, shared by every sender. (ManuallyDrop: left
    /// alive when a peer may still wait on it, see `Drop`.)
    ready_event: std::mem::ManuallyDrop<ExportedEvent>,
    aborted: bool,
    /// Whether this rank's events must outlive it (a peer may still wait on
    /// them): set until the farewell completes.
    keep_events: bool,
    /// Whether this rank's stream may still hold copies or kernels that
    /// write the peers' mapped inboxes or wait on their events (its drain
    /// timed out): those mappings then stay open (see `Drop`).
    keep_mappings: bool,
}

// SAFETY: raw CUDA handles are process-wide; one thread drives the links
// at a time (`&mut self`).
unsafe impl Send for RemoteLinks {}

/// One rank's description for its peers: host, process, GPU.
const RECORD_BYTES: usize = 64;

fn host_hash() -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    crate::transport::shm::host_identity().hash(&mut h);
    h.finish()
}

impl RemoteLinks {
    /// Links `control`'s ranks, this one on `device` (the `CUdevice` of the
    /// current context): exchanges hosts, processes and GPUs, decides the
    /// path of each sender to this rank, and gathers every rank's decisions.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when a peer is on another host or in this process
    /// (CUDA IPC joins processes of one host); the control channel's errors.
    pub(crate) fn new(mut control: Communicator, device: sys::CUdevice) -> Result<RemoteLinks> {
        let (rank, world) = (control.rank(), control.world_size());
        let mut bus = [0 as std::ffi::c_char; 32];
        // SAFETY: a 32-byte out buffer for a live device.
        let rc = unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, device) };
        check(rank, "reading the GPU's PCI bus id", rc)?;
        let mut record = [0u8; RECORD_BYTES];
        record[..8].copy_from_slice(&host_hash().to_le_bytes());
        record[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        for (dst, &c) in record[16..48].iter_mut().zip(bus.iter()) {
            *dst = c as u8;
        }
        let mut records = vec![0u8; RECORD_BYTES * world];
        control.all_gather(&record, &mut records)?;
        let record_of = |r: Rank| &records[r * RECORD_BYTES..(r + 1) * RECORD_BYTES];
        let bus_of = |r: Rank| -> String {
            let field = &record_of(r)[16..48];
            let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
            String::from_utf8_lossy(&field[..end]).into_owned()
        };
        let disabled = super::ring::p2p_disabled();
        let mut incoming = vec![Path::SameGpu as u8; world];
        for from in (0..world).filter(|&p| p != rank) {
            if record_of(from)[..8] != record[..8] {
                return Err(cross_host(rank, from));
            }
            if record_of(from)[8..12] == record[8..12] {
                return Err(Error::Config {
                    name: "OXCCL_BACKEND".into(),
                    value: "cuda-ring".into(),
                    reason: format!(
                        "ranks {rank} and {from} are in one process: make ranks of one process \
                         with DeviceCommunicator::local_group, not one init per thread"
                    ),
                });
            }
            let path = if disabled {
                Path::HostStaged
            } else if bus_of(from) == bus_of(rank) {
                Path::SameGpu
            } else if can_access(device, &bus_of(from)) {
                Path::PeerAccess
            } else {
                Path::HostStaged
            };
            incoming[from] = path as u8;
        }
        let mut matrix = vec![0u8; world * world];
        control.all_gather(&incoming, &mut matrix)?;
        // matrix[to * world + from] is `to`'s decision for `from`.
        let paths: Vec<Path> = (0..world * world)
            .map(|i| {
                let (from, to) = (i / world, i % world);
                Path::from_u8(matrix[to * world + from]).ok_or_else(|| Error::Mismatch {
                    op: OpKind::AllGather,
                    seq: 0,
                    rank,
                    peer: to,
                    detail: format!("rank {to} sent an unknown path code"),
                })
            })
            .collect::<Result<_>>()?;
        if crate::comm::debug_info() {
            for from in (0..world).filter(|&p| p != rank) {
                crate::comm::info_line(format_args!(
                    "cuda-ring: rank {from} (GPU {}, pid {}) -> rank {rank} (GPU {}): \
                     {} via CUDA IPC{}",
                    bus_of(from),
                    u32::from_le_bytes(record_of(from)[8..12].try_into().unwrap_or([0; 4])),
                    bus_of(rank),
                    paths[from * world + rank].name(),
                    if disabled {
                        " [OXCCL_P2P_DISABLE=1]"
                    } else {
                        ""
                    }
                ));
            }
        }
        Ok(RemoteLinks {
            ready_event: std::mem::ManuallyDrop::new(ExportedEvent::new(rank)?),
            keep_events: true,
            keep_mappings: false,
            control,
            rank,
            world,
            paths,
            peers: (0..world).map(|_| Peer::default()).collect(),
            aborted: false,
        })
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    pub(crate) fn path(&self, from: Rank, to: Rank) -> Path {
        self.paths[from * self.world + to]
    }

    /// Marks the group failed here and tells every peer (best effort: a
    /// peer already gone is skipped), so they stop waiting for this rank
    /// instead of running into the deadline. The control channel itself is
    /// not aborted: communicators split from it in this process share its
    /// transport and are not concerned.
    pub(crate) fn abort(&mut self) {
        if std::mem::replace(&mut self.aborted, true) {
            return;
        }
        let (rank, world) = (self.rank, self.world);
        for peer in (0..world).filter(|&p| p != rank) {
            let _ = self.control.send(&Frame::Abort.encode(), peer);
        }
    }

    /// Says this rank's stream did not drain: work queued on it may still
    /// write the peers' inboxes (queued behind a peer's ready), so their
    /// mappings and events are left open when the links are dropped rather
    /// than closed under that work (which would then write unmapped memory).
    pub(crate) fn keep_mappings(&mut self) {
        self.keep_mappings = true;
    }

    /// The end of a rank whose stream is drained: tells every peer, and
    /// waits (with the control channel's deadline) until every peer said
    /// the same, i.e. no peer's GPU still waits on this rank's events;
    /// only then may they be destroyed. Dropping a communicator is thus
    /// collective, as NCCL's `ncclCommFinalize`.
    pub(crate) fn farewell(&mut self) {
        if self.aborted {
            return;
        }
        let (rank, world) = (self.rank, self.world);
        // Close our mappings of the peers' inboxes before saying goodbye
        // (the stream is drained: nothing queued writes to them). A peer
        // frees its inboxes once every Bye has come, and CUDA leaves freeing
        // an exported region that an importer still has open undefined.
        for peer in &mut self.peers {
            peer.inbox = None;
        }
        for peer in (0..world).filter(|&p| p != rank) {
            if self.control.send(&Frame::Bye.encode(), peer).is_err() {
                return;
            }
        }
        for peer in (0..world).filter(|&p| p != rank) {
            if self.pull_until(peer, |p| p.bye.then_some(())).is_err() {
                return;
            }
        }
        self.keep_events = false;
    }

    pub(crate) fn aborted(&self) -> bool {
        self.aborted
    }

    /// The control channel (splits make their children's from it).
    pub(crate) fn control_mut(&mut self) -> &mut Communicator {
        &mut self.control
    }

    /// Starts a call: message slots count from 0 again.
    pub(crate) fn begin_call(&mut self) {
        for peer in &mut self.peers {
            peer.posted_in_call = 0;
        }
    }

    /// Records the ready event on `stream` and tells `from` where its
    /// messages of the call go.
    pub(crate) fn record_ready(&mut self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: a live event of this context, a live stream.
        let rc = unsafe { sys::cuEventRecord(self.ready_event.event, stream) };
        check(self.rank, "recording the ready event", rc)
    }

    pub(crate) fn send_ready(
        &mut self,
        from: Rank,
        bytes: usize,
        (messages, layout): (usize, u32),
        inbox: InboxDesc,
    ) -> Result<()> {
        let frame = Frame::Ready {
            bytes: bytes as u64,
            messages: u32::try_from(messages).unwrap_or(u32::MAX),
            layout,
            inbox,
            event: self.ready_event.handle,
        };
        self.control.send(&frame.encode(), from)
    }

    /// Reads frames from `peer` until `found` takes one from the queues.
    /// A peer's abort ends the wait with `Aborted`, its farewell (while
    /// something else is awaited) with `PeerLost`.
    fn pull_until<R>(
        &mut self,
        peer: Rank,
        mut found: impl FnMut(&mut Peer) -> Option<R>,
    ) -> Result<R> {
        loop {
            if let Some(r) = found(&mut self.peers[peer]) {
                return Ok(r);
            }
            if self.peers[peer].bye {
                return Err(Error::PeerLost {
                    op: OpKind::Recv,
                    seq: 0,
                    rank: self.rank,
                    peer,
                });
            }
            let mut raw = [0u8; FRAME_BYTES];
            self.control.recv(&mut raw, peer)?;
            let frame = Frame::decode(&raw).map_err(|detail| Error::Mismatch {
                op: OpKind::Recv,
                seq: 0,
                rank: self.rank,
                peer,
                detail: format!("malformed cuda-ring control frame: {detail}"),
            })?;
            match frame {
                Frame::Post { slot, event } => self.peers[peer].posts.push_back((slot, event)),
                Frame::Ready {
                    bytes,
                    messages,
                    layout,
                    inbox,
                    event,
                } => self.peers[peer].readies.push_back(ReadyMsg {
                    bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
                    messages: messages as usize,
                    layout,
                    inbox,
                    event,
                }),
                Frame::Abort => {
                    self.aborted = true;
                    return Err(Error::Aborted {
                        op: OpKind::Recv,
                        seq: 0,
                        rank: self.rank,
                    });
                }
                Frame::Bye => self.peers[peer].bye = true,
            }
        }
    }

    /// Waits for `to`'s next ready; maps its inbox (once per generation,
    /// after `drain` empties this rank's stream when an older mapping goes)
    /// and opens its ready event (once).
    pub(crate) fn await_ready(
        &mut self,
        to: Rank,
        drain: impl FnOnce() -> Result<()>,
    ) -> Result<PeerReady> {
        let rank = self.rank;
        let ReadyMsg {
            bytes,
            messages,
            layout,
            inbox,
            event,
        } = self.pull_until(to, |p| p.readies.pop_front())?;
        let peer = &mut self.peers[to];
        let has_inbox = inbox.generation().is_some();
        if inbox.generation().is_some()
            && peer.inbox.as_ref().and_then(MappedInbox::generation) != inbox.generation()
        {
            if peer.inbox.is_some() {
                // Writes queued into the old mapping must land first.
                drain()?;
                peer.inbox = None;
            }
            peer.inbox = Some(MappedInbox::open(rank, inbox, bytes)?);
        }
        if has_inbox {
            let capacity = peer.inbox.as_ref().map_or(0, MappedInbox::capacity);
            if capacity < bytes {
                return Err(Error::Mismatch {
                    op: OpKind::Recv,
                    seq: 0,
                    rank,
                    peer: to,
                    detail: format!("its inbox holds {capacity} bytes, its ready says {bytes}"),
                });
            }
        }
        if peer.ready_event.as_ref().map(|e| e.handle) != Some(event) {
            peer.ready_event = Some(OpenedEvent::open(rank, &event)?);
        }
        Ok(PeerReady {
            inbox: if has_inbox {
                peer.inbox.as_ref().map_or(0, MappedInbox::ptr)
            } else {
                0
            },
            bytes,
            messages,
            layout,
            event: peer
                .ready_event
                .as_ref()
                .map_or(std::ptr::null_mut(), |e| e.event),
        })
    }

    /// Records the next message event for `to` on `stream` and posts it.
    pub(crate) fn post(&mut self, to: Rank, stream: sys::CUstream) -> Result<()> {
        let rank = self.rank;
        let peer = &mut self.peers[to];
        let slot = peer.posted_in_call;
        peer.posted_in_call += 1;
        if peer.own_events.len() <= slot {
            peer.own_events.push(ExportedEvent::new(rank)?);
        }
        let event = &peer.own_events[slot];
        // SAFETY: a live event of this context, a live stream.
        let rc = unsafe { sys::cuEventRecord(event.event, stream) };
        check(rank, "recording a message event", rc)?;
        let frame = Frame::Post {
            slot: slot as u32,
            event: event.handle,
        };
        self.control.send(&frame.encode(), to)
    }

    /// Waits for `from`'s next message and returns its event (opened once
    /// per slot).
    pub(crate) fn await_message(&mut self, from: Rank) -> Result<CUevent> {
        let rank = self.rank;
        let (slot, handle) = self.pull_until(from, |p| p.posts.pop_front())?;
        let peer = &mut self.peers[from];
        let slot = slot as usize;
        if slot > peer.message_events.len() + 1024 {
            return Err(Error::Mismatch {
                op: OpKind::Recv,
                seq: 0,
                rank,
                peer: from,
                detail: format!("message slot {slot} is far past the slots seen"),
            });
        }
        if peer.message_events.len() <= slot {
            peer.message_events.resize_with(slot + 1, || None);
        }
        let cached = &mut peer.message_events[slot];
        if cached.as_ref().map(|e| e.handle) != Some(handle) {
            *cached = Some(OpenedEvent::open(rank, &handle)?);
        }
        Ok(cached.as_ref().map_or(std::ptr::null_mut(), |e| e.event))
    }
}

impl Drop for RemoteLinks {
    fn drop(&mut self) {
        if self.keep_mappings {
            for peer in &mut self.peers {
                std::mem::forget(peer.inbox.take());
                std::mem::forget(peer.ready_event.take());
                std::mem::forget(std::mem::take(&mut peer.message_events));
            }
        }
        if self.keep_events {
            // A peer's GPU may still wait on them: left to the process's
            // end (a few small objects) rather than destroyed under it.
            for peer in &mut self.peers {
                std::mem::forget(std::mem::take(&mut peer.own_events));
            }
        } else {
            // SAFETY: dropped once, here; never used after.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.ready_event) };
        }
    }
}

fn cross_host(rank: Rank, peer: Rank) -> Error {
    Error::Config {
        name: "OXCCL_BACKEND".into(),
        value: "cuda-ring".into(),
        reason: format!(
            "rank {peer} runs on another host than rank {rank}: the cuda-ring joins processes \
             of one host (CUDA IPC); between hosts use NCCL (OXCCL_BACKEND=nccl or auto)"
        ),
    }
}

/// Whether this rank's GPU (`device`) can be written by the GPU with PCI
/// bus id `bus`, if this process sees it.
fn can_access(device: sys::CUdevice, bus: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(bus) else {
        return false;
    };
    let mut other: sys::CUdevice = 0;
    // SAFETY: a C string and an out-parameter.
    if unsafe { sys::cuDeviceGetByPCIBusId(&mut other, c.as_ptr()) } != sys::CUresult::CUDA_SUCCESS
    {
        return false;
    }
    let mut can = 0;
    // SAFETY: plain query on live devices.
    let rc = unsafe { sys::cuDeviceCanAccessPeer(&mut can, other, device) };
    rc == sys::CUresult::CUDA_SUCCESS && can != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(seed: u8) -> Handle {
        std::array::from_fn(|i| seed.wrapping_add(i as u8))
    }

    #[test]
    fn frames_round_trip() {
        let frames = [
            Frame::Abort,
            Frame::Bye,
            Frame::Ready {
                bytes: 1 << 40,
                messages: 3,
                layout: 0x9e37_79b9,
                inbox: InboxDesc::Device {
                    generation: 7,
                    handle: handle(3),
                },
                event: handle(200),
            },
            Frame::Ready {
                bytes: 0,
                messages: 1,
                layout: 0x9e37_79b9,
                inbox: InboxDesc::None,
                event: handle(1),
            },
            Frame::Ready {
                bytes: 4096,
                messages: 70000,
                layout: 0x9e37_79b9,
                inbox: InboxDesc::Host {
                    generation: 2,
                    name: "/oxccl-cr-1234-5".into(),
                },
                event: handle(9),
            },
            Frame::Post {
                slot: 41,
                event: handle(77),
            },
        ];
        for frame in frames {
            assert_eq!(Frame::decode(&frame.encode()).unwrap(), frame);
        }
    }

    #[test]
    fn malformed_frames_are_errors() {
        let good = Frame::Post {
            slot: 1,
            event: handle(0),
        }
        .encode();
        assert!(Frame::decode(&good[..100]).unwrap_err().contains("bytes"));
        let mut bad = good;
        bad[0] = b'X';
        assert!(Frame::decode(&bad).unwrap_err().contains("magic"));
        let mut bad = good;
        bad[4] = 9;
        assert!(Frame::decode(&bad).unwrap_err().contains("kind"));
        let no_inbox = Frame::Ready {
            bytes: 8,
            messages: 1,
            layout: 0x9e37_79b9,
            inbox: InboxDesc::None,
            event: handle(0),
        }
        .encode();
        assert!(Frame::decode(&no_inbox).unwrap_err().contains("no inbox"));
        let mut bad = Frame::Ready {
            bytes: 1,
            messages: 1,
            layout: 0x9e37_79b9,
            inbox: InboxDesc::Host {
                generation: 1,
                name: "/x".into(),
            },
            event: handle(0),
        }
        .encode();
        bad[5] = 5;
        assert!(Frame::decode(&bad).unwrap_err().contains("inbox kind"));
        bad[5] = 2;
        bad[88] = b'x'; // a name must be absolute
        assert!(Frame::decode(&bad).unwrap_err().contains("name"));
        bad[88..152].fill(b'/'); // and NUL-terminated
        assert!(Frame::decode(&bad).unwrap_err().contains("name"));
    }
}
