//! The multi-process transport: ranks in separate processes, linked pairwise
//! by shared memory (same host) or TCP (different hosts), in NCCL's probe
//! order. One [`Fabric`] per process holds the links of a job; the
//! communicators made from it (and their splits) share it, each with its own
//! context id, exactly as the in-process transport's endpoints share a group.
//!
//! # Frames on a link
//!
//! A link is a byte stream. Each frame is a 40-byte header (magic, kind,
//! space, operation, step, call digest, context, sequence number, byte
//! count) followed by
//! the payload. The receiver checks the magic and bounds of every header: a
//! malformed one marks the link broken (an error naming the peer), never a
//! panic or a wild allocation. A frame whose sequence number is below what
//! this rank has already consumed from that peer is *stale* and is reported,
//! not consumed.
//!
//! # Progress without threads
//!
//! Sends are eager: a send queues its frame on the peer's link and writes
//! what fits at once (over TCP, frames of 64 KiB and more wait until 1 MiB
//! is queued or the next progress pass, to go out several per `sendmsg`);
//! the rest goes out whenever this rank next makes progress. Every wait (for a frame, or for queued bytes to drain at the end
//! of a call) makes progress on *every* link: it writes what is queued and
//! reads everything that has arrived into a table keyed like the in-process
//! mailboxes. A rank waiting to send therefore always drains what others
//! send it, so no cycle of full buffers can deadlock, whatever the plan.
//!
//! A data frame whose receive has posted a destination (the receive is
//! waiting, or its call posted it ahead when it started) is read straight
//! into it. A large data frame with no destination yet is *held*: header
//! read, payload left in the link, until a destination is posted, its
//! receive waits for it, or a wait stalls — so a sender running ahead waits
//! in the link's flow control and its frames land in place later, while a
//! frame queued behind a held one is still reached.
//!
//! # Failure
//!
//! A rank that drops its communicator says goodbye (a goodbye frame, and a
//! flag in its shared-memory header), so its peers can tell a clean exit from
//! a crash. A crash shows as end-of-stream on TCP, or as a dead process id on
//! shared memory (checked every few milliseconds while waiting). A crashed
//! member fails every collective of every communicator it belongs to, on
//! every surviving rank, with `PeerLost` naming it — not only on its ring
//! neighbours. A rank that drops one communicator while its process stays
//! (a split), or whose communicator fails, sends its members a leave frame
//! for that context ([`KIND_LEAVE`]). Every wait also has the call's
//! deadline, and
//! [`NetShared::abort`] wakes it within a few milliseconds.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::shm::{self, Segment, ShmLink};
use super::tcp::{self, TcpLink, Token};
use super::{
    CollectiveArrivals, FailureCause, FrameHeader, FrameMap, Payload, Space, TransportError,
};
use crate::bootstrap::Store;
use crate::error::{as_ranks_store_error, Error, RendezvousStage, Result};
use crate::host::cpus;
use crate::schedule::RingOrder;
use crate::types::{OpKind, Rank};

const FRAME_MAGIC: u32 = 0x4652_584f; // "OXRF"
pub(crate) const FRAME_HEADER_BYTES: usize = 40;
/// Larger byte counts are taken as corruption rather than allocated; no
/// plan sends a larger piece.
const MAX_FRAME_BYTES: u64 = crate::schedule::MAX_PIECE_BYTES as u64;
/// A frame read into a buffer of its own gets at most this much at first,
/// and its buffer doubles as its bytes arrive: memory follows what came,
/// not what a header claims (a corrupt one may claim up to
/// [`MAX_FRAME_BYTES`]). Frames up to this size (the pipeline's pieces)
/// are allocated once.
const PAYLOAD_FIRST_BYTES: usize = 16 << 20;
/// A goodbye carries 16 bytes per context; longer ones are corrupt.
const MAX_GOODBYE_BYTES: u64 = 1 << 20;
const KIND_DATA: u8 = 0;
const KIND_GOODBYE: u8 = 1;
/// This rank takes no further part in one communicator (`ctx`), its
/// process and links staying: it dropped that communicator (a split), or
/// the communicator failed. The header's `seq` is how many collectives it
/// had entered there, its `step` one of [`LEAVE_DROPPED`] or
/// [`LEAVE_FAILED`], its `call` the global rank + 1 whose loss made it
/// fail (0: none known); no payload.
const KIND_LEAVE: u8 = 2;
const LEAVE_DROPPED: u32 = 0;
const LEAVE_FAILED: u32 = 1;
/// Failed because it timed out waiting for the global rank in `call`.
const LEAVE_TIMED_OUT: u32 = 2;

/// How often a waiting rank checks that its shared-memory peers still run.
const LIVENESS_INTERVAL: Duration = Duration::from_millis(10);
/// How long a departing rank tries to hand over what it still has queued.
const GOODBYE_FLUSH: Duration = Duration::from_secs(2);

fn encode(kind: u8, h: &FrameHeader) -> [u8; FRAME_HEADER_BYTES] {
    let mut b = [0u8; FRAME_HEADER_BYTES];
    b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    b[4] = kind;
    b[5] = match h.space {
        Space::Collective => 0,
        Space::PointToPoint => 1,
    };
    b[6] = h.op.code();
    b[8..12].copy_from_slice(&h.step.to_le_bytes());
    b[12..16].copy_from_slice(&h.call.to_le_bytes());
    b[16..24].copy_from_slice(&h.ctx.to_le_bytes());
    b[24..32].copy_from_slice(&h.seq.to_le_bytes());
    b[32..40].copy_from_slice(&(h.bytes as u64).to_le_bytes());
    b
}

/// Parses a header; `Err` says what is malformed.
fn decode(b: &[u8; FRAME_HEADER_BYTES]) -> std::result::Result<(u8, FrameHeader), String> {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u64_at = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(w)
    };
    if u32_at(0) != FRAME_MAGIC {
        return Err(format!("bad frame magic {:#010x}", u32_at(0)));
    }
    let kind = b[4];
    if kind != KIND_DATA && kind != KIND_GOODBYE && kind != KIND_LEAVE {
        return Err(format!("unknown frame kind {kind}"));
    }
    let space = match b[5] {
        0 => Space::Collective,
        1 => Space::PointToPoint,
        other => return Err(format!("unknown frame space {other}")),
    };
    let op = OpKind::from_code(b[6]).ok_or_else(|| format!("unknown operation code {}", b[6]))?;
    let bytes = u64_at(32);
    if bytes > MAX_FRAME_BYTES {
        return Err(format!("frame of {bytes} bytes is beyond any real frame"));
    }
    if kind == KIND_GOODBYE && (bytes > MAX_GOODBYE_BYTES || bytes % 16 != 0) {
        return Err(format!("goodbye of {bytes} bytes (16 per context)"));
    }
    let step = u32_at(8);
    if kind == KIND_LEAVE
        && (bytes != 0 || !matches!(step, LEAVE_DROPPED | LEAVE_FAILED | LEAVE_TIMED_OUT))
    {
        return Err(format!("leave frame of {bytes} bytes, reason {step}"));
    }
    Ok((
        kind,
        FrameHeader {
            ctx: u64_at(16),
            space,
            seq: u64_at(24),
            step,
            op,
            bytes: bytes as usize,
            call: u32_at(12),
        },
    ))
}

/// What a link's error says of its peer: a shared-memory ring whose
/// counters the peer corrupted (`InvalidData`) is a protocol violation,
/// anything else a link that broke (`what`: how it showed).
fn gone_after(e: std::io::Error, what: &str) -> Gone {
    if e.kind() == std::io::ErrorKind::InvalidData {
        Gone::Corrupt(e.to_string())
    } else {
        Gone::Died(format!("{what}: {e}"))
    }
}

/// A byte stream to one peer.
enum Link {
    Shm(ShmLink),
    Tcp(TcpLink),
}

impl Link {
    /// Writes a prefix of `a ++ b`; returns how many bytes went out.
    fn write_two(&mut self, a: &[u8], b: &[u8]) -> std::io::Result<usize> {
        match self {
            Link::Shm(link) => {
                let n = link.write_some(a)?;
                if n < a.len() {
                    return Ok(n);
                }
                Ok(n + link.write_some(b)?)
            }
            Link::Tcp(link) => {
                if a.is_empty() {
                    link.write_some(b)
                } else if b.is_empty() {
                    link.write_some(a)
                } else {
                    link.write_two(a, b)
                }
            }
        }
    }

    fn read_some(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Shm(link) => link.read_some(buf),
            Link::Tcp(link) => link.read_some(buf),
        }
    }

    /// A frame header carrying `payload_bytes` was just read.
    fn saw_frame(&mut self, payload_bytes: usize) {
        if let Link::Tcp(link) = self {
            link.saw_frame(payload_bytes);
        }
    }
}

/// A frame waiting to be written, with how much of it already went out.
struct Outgoing {
    header: [u8; FRAME_HEADER_BYTES],
    payload: Payload,
    written: usize,
}

/// The read side of a link: part of a header, or part of a payload.
enum Incoming {
    Header {
        buf: [u8; FRAME_HEADER_BYTES],
        filled: usize,
    },
    Payload {
        kind: u8,
        header: FrameHeader,
        payload: Payload,
        filled: usize,
    },
    /// A large data frame whose header is read and whose payload is left
    /// in the link until a receive posts a destination for it, waits for
    /// it, or the wait stalls (see [`HOLD_MIN_BYTES`]).
    Held { header: FrameHeader, key: Key },
    /// A data frame a receive is waiting for, read straight into that
    /// receive's buffer (see [`Posted`]).
    Direct {
        header: FrameHeader,
        key: Key,
        to: Posted,
        filled: usize,
    },
}

/// A receive's destination, registered while the receive waits: a frame
/// for its key that starts arriving meanwhile is read into it directly
/// instead of into a frame buffer copied later.
#[derive(Clone, Copy, Debug)]
struct Posted {
    ptr: *mut u8,
    len: usize,
    /// The operation and call digest the receive expects: a frame of
    /// another call (ranks that disagree on the element type, reduce
    /// operation or root, with equal byte counts) is read into a buffer of
    /// its own and refused, never into the caller's output.
    op: OpKind,
    call: u32,
}

impl Posted {
    /// `len` bytes at `ptr`, for the frame `expect`.
    fn new(ptr: *mut u8, len: usize, expect: &FrameHeader) -> Posted {
        Posted {
            ptr,
            len,
            op: expect.op,
            call: expect.call,
        }
    }

    /// Whether the frame `header` may be read straight into this buffer.
    fn takes(&self, header: &FrameHeader) -> bool {
        self.len > 0 && self.len == header.bytes && self.op == header.op && self.call == header.call
    }
}

// SAFETY: the pointer is used only under the fabric's lock, and only while
// the receive that posted it is inside `recv_into` (it unposts, under the
// lock, before returning — converting a half-read frame into an owned one),
// or between `post_ahead` and that receive or `withdraw` (whose callers
// keep the destination alive and untouched meanwhile).
unsafe impl Send for Posted {}

/// A delivered frame: its body in a buffer, or already in the posted
/// receive's destination (`landed`).
struct Arrived {
    header: FrameHeader,
    payload: Payload,
    landed: bool,
}

impl Incoming {
    fn new() -> Incoming {
        Incoming::Header {
            buf: [0; FRAME_HEADER_BYTES],
            filled: 0,
        }
    }
}

/// Why a peer can no longer be counted on.
#[derive(Clone, Debug)]
enum Gone {
    /// It dropped its communicators: fine for the collectives it finished.
    /// Per context: the number of collectives it had entered when it left
    /// (absent: it never used that context).
    Departed(HashMap<u64, u64>),
    /// It crashed or its link broke: fatal to every group it is in.
    Died(String),
    /// It sent something malformed or stale.
    Corrupt(String),
}

/// A communicator a peer left while its process stayed (see [`KIND_LEAVE`]).
#[derive(Clone, Copy, Debug)]
struct Left {
    /// How many collectives it had entered there: it sent every frame of
    /// those it was to send, and sends nothing for later ones.
    entered: u64,
    /// Its communicator failed: frames it had yet to send in the calls it
    /// entered will not come either.
    failed: bool,
    /// What made it fail, when it said (the rank global).
    cause: Option<FailureCause>,
}

struct Peer {
    link: Link,
    out: VecDeque<Outgoing>,
    incoming: Incoming,
    gone: Option<Gone>,
    /// Per context: the communicators it left (dropped or failed), its
    /// process staying. Frames on one link arrive in order, so what it sent
    /// there before leaving has arrived by the time this is read.
    left: HashMap<u64, Left>,
    /// Whether the loss was reported on stderr already.
    logged: bool,
}

type Key = (usize, u64, Space, u64, u32);

/// How far this process reads ahead of its receives, per source. A sender
/// that runs ahead (eager sends: a broadcast's root, back to back) would
/// otherwise have its frames read into ever more buffers — measured here:
/// a thousand 256 KiB frames, each a fresh page-faulting allocation once
/// the recycling pool ran dry, which slowed the receiver four-fold and so
/// let the root run further ahead. Past this much, what is unread stays in
/// the socket or ring and holds the sender back (TCP's own flow control).
/// Past it a link is still read, a frame per pass: by a receive waiting
/// for a frame from that source, up to it; and by any wait that has
/// stalled (a spin phase without progress), so no program that completes
/// with unbounded buffering (ranks sending to each other before receiving;
/// a receive waiting on one rank whose frame depends on another's send
/// draining into this one) hangs on the limit, and a peer's end of stream
/// or goodbye is always reached.
const READ_AHEAD_BYTES: usize = 16 << 20;

/// A data frame of at least this many bytes that no receive has posted a
/// destination for yet stays in its link (header read, payload not) until
/// one is posted, its receive waits for it, or a wait stalls. A sender
/// running ahead (a broadcast's root, back to back) then waits in the
/// link's flow control, and its frames land in place once their call
/// posts them, instead of being read into buffers and copied again.
const HOLD_MIN_BYTES: usize = 64 << 10;

/// At most this many buffers (a header and a payload per frame) per TCP
/// `sendmsg` (well under `IOV_MAX`, 1024 on Linux).
const TCP_WRITE_SLICES: usize = 64;
/// A TCP `sendmsg` gathers frames until it holds at least this many bytes.
const TCP_WRITE_BYTES: usize = 4 << 20;
/// Frames of at least this many bytes are not written when sent over TCP
/// but by the next progress pass, together with those queued after them.
const TCP_DEFER_MIN_BYTES: usize = 64 << 10;
/// Deferred frames are written as soon as this many bytes are queued.
const TCP_BATCH_BYTES: usize = 1 << 20;

/// The buffer a frame of `bytes` bytes is first read into (see
/// [`PAYLOAD_FIRST_BYTES`]).
fn first_payload(bytes: usize) -> Payload {
    Payload::zeroed(bytes.min(PAYLOAD_FIRST_BYTES))
}

/// What a pass may read of a data frame no receive has posted (see
/// [`HOLD_MIN_BYTES`]).
#[derive(Clone, Copy)]
struct Hold {
    /// The frame the reading wait is for: read whatever its size.
    want: Option<Key>,
    /// Read held frames into buffers (a stalled wait, a departing peer).
    release: bool,
}

impl Hold {
    /// How to read the data frame `header` (for `key`) now: into its
    /// posted destination, into a buffer of its own, or (`None`) not yet.
    fn reading(
        self,
        posted: &FrameMap<Key, Posted>,
        key: Key,
        header: &FrameHeader,
    ) -> Option<Incoming> {
        match posted.get(&key) {
            Some(&to) if to.takes(header) => Some(Incoming::Direct {
                header: *header,
                key,
                to,
                filled: 0,
            }),
            _ if header.bytes < HOLD_MIN_BYTES || self.release || self.want == Some(key) => {
                Some(Incoming::Payload {
                    kind: KIND_DATA,
                    header: *header,
                    payload: first_payload(header.bytes),
                    filled: 0,
                })
            }
            _ => None,
        }
    }
}

/// Every link of this process in one job, and the frames that have arrived.
pub(crate) struct Fabric {
    rank: usize,
    /// Per global rank; `None` for this rank.
    peers: Vec<Option<Peer>>,
    arrived: FrameMap<Key, Arrived>,
    /// The collective frames in `arrived`, per call (kept with it by
    /// [`arrive`](Self::arrive) and [`take_arrived`](Self::take_arrived)).
    collective_arrivals: CollectiveArrivals,
    /// The contexts some peer has left (a leave frame arrived): a wait on
    /// any other context looks up no peer's leave at all (see `failure`,
    /// which runs at every pass of a wait).
    left_contexts: HashSet<u64>,
    /// Receives waiting with a destination (see [`Posted`]).
    posted: FrameMap<Key, Posted>,
    /// Per source: payload bytes arrived and not yet taken by a receive
    /// (frames read straight into a posted destination excluded). Above
    /// [`READ_AHEAD_BYTES`] a link is read only a frame at a time.
    buffered: Vec<usize>,
    /// Per `(ctx, space, source)`: the sequence number of the last frame
    /// consumed; anything older arriving later is stale.
    consumed: FrameMap<(u64, Space, usize), u64>,
    /// Per context: how many collectives this rank has entered (told to
    /// peers in the goodbye frame).
    entered: FrameMap<u64, u64>,
    next_liveness_check: Instant,
    /// Our own shared-memory inbox. Declared after `peers`, so the links
    /// that point into it are dropped first.
    own_segment: Option<Segment>,
    /// Keeps the store (rank 0 serves it) alive as long as the job.
    _store: Arc<dyn Store>,
    /// This rank's claim on the store, live while the fabric is
    /// (`None` in unit tests that build a fabric by hand).
    _claim: Option<LiveClaim>,
    /// The TCP interface, for descriptions.
    interface: Option<String>,
}

/// What the communicators of one process share.
pub(crate) struct NetShared {
    fabric: Mutex<Fabric>,
    /// Set by `abort()`; shared with the arena, which waits outside the fabric.
    aborted: Arc<AtomicBool>,
    /// Live endpoints (communicators) on this fabric. Not the `Arc`'s count:
    /// an `AbortHandle` holds the fabric too, and is no communicator.
    endpoints: AtomicUsize,
    /// Which ranks a TCP link joins, known alike on every rank (from the
    /// store's entries, not from this rank's own links): see
    /// [`NetEndpoint::links_all_tcp`].
    links: LinkMap,
    /// Whether the job's ranks on this rank's machine (its kernel: this
    /// host and any containers or network namespaces beside it) outnumber
    /// the CPUs they may run on together (the union of their affinities,
    /// from the store's entries):
    /// then a wait yields its core from the first pass instead of spinning
    /// (`Backoff::wait`), as the arena's waits do.
    crowded: bool,
}

/// What decides the link between two global ranks, the same on every rank:
/// TCP when the job forced it or the two run on different hosts, shared
/// memory otherwise (`connect_rank`'s `use_shm`).
#[derive(Clone, Debug)]
pub(crate) struct LinkMap {
    /// `OXCCL_TRANSPORT=tcp`: every link is TCP.
    tcp_forced: bool,
    /// Global rank → its host, as an index among the job's hosts.
    host_of: Vec<usize>,
    /// Global rank → its kernel (machine), as an index among the job's;
    /// and for each kernel, whether the job's ranks on it outnumber the
    /// CPUs they may run on together.
    kernel_of: Vec<usize>,
    crowded_kernel: Vec<bool>,
}

impl LinkMap {
    /// Whether the links among `members` (global ranks) are all TCP: the
    /// job forced TCP, or there are two members or more and no two share
    /// a host. A lone member on its own has no link, TCP or not (its
    /// choice cuts nothing).
    fn all_tcp(&self, members: &[usize]) -> bool {
        let mut hosts = HashSet::with_capacity(members.len());
        self.tcp_forced
            || (members.len() >= 2 && members.iter().all(|&m| hosts.insert(self.host_of[m])))
    }

    /// Whether `members` (global ranks) all run on one host, of one
    /// machine (kernel) whose job ranks outnumber its CPUs: alike on every
    /// rank, from the entries every rank read. (Hosts of one machine, such
    /// as network namespaces, each keep their own schedules across hosts.)
    fn crowded_together(&self, members: &[usize]) -> bool {
        let Some(&first) = members.first() else {
            return false;
        };
        let (host, kernel) = (self.host_of[first], self.kernel_of[first]);
        self.crowded_kernel[kernel]
            && members
                .iter()
                .all(|&m| self.host_of[m] == host && self.kernel_of[m] == kernel)
    }

    /// The ring order of `members` (global ranks; position `i` in it is
    /// communicator rank `i`): each host's members next to each other
    /// ([`RingOrder::grouping_hosts`]), also when TCP is forced (loopback
    /// within a host is still cheaper than the network between hosts).
    fn ring_order(&self, members: &[usize]) -> RingOrder {
        let hosts: Vec<usize> = members.iter().map(|&m| self.host_of[m]).collect();
        RingOrder::grouping_hosts(&hosts)
    }
}

impl NetShared {
    fn lock(&self) -> MutexGuard<'_, Fabric> {
        // A panic inside the fabric's critical sections can only come from a
        // bug; the data stays structurally valid, so keep going.
        self.fabric.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

impl Fabric {
    /// Files a frame in `arrived`, counted in `collective_arrivals`;
    /// returns the frame it replaced (same key), as `HashMap::insert`.
    fn arrive(&mut self, key: Key, arrived: Arrived) -> Option<Arrived> {
        let replaced = self.arrived.insert(key, arrived);
        if replaced.is_none() {
            self.collective_arrivals.filed(key.1, key.2, key.3);
        }
        replaced
    }

    /// Takes a frame out of `arrived`, uncounting it.
    fn take_arrived(&mut self, key: &Key) -> Option<Arrived> {
        let taken = self.arrived.remove(key)?;
        self.collective_arrivals.taken(key.1, key.2, key.3);
        Some(taken)
    }

    /// Writes what is queued and reads what has arrived, on every link
    /// (a frame per pass from one past the read-ahead). Returns whether any
    /// byte moved.
    fn progress(&mut self) -> bool {
        self.progress_for(None, true)
    }

    /// [`progress`](Self::progress) for a wait for `want` (if any): a
    /// source read [`READ_AHEAD_BYTES`] ahead is read further, a frame per
    /// pass, only while the frame wanted from it has not arrived or when
    /// the wait has `stalled`.
    fn progress_for(&mut self, want: Option<Key>, stalled: bool) -> bool {
        let mut moved = false;
        for source in 0..self.peers.len() {
            let wanted_here = want.is_some_and(|k| k.0 == source && !self.arrived.contains_key(&k));
            let Some(peer) = self.peers[source].as_mut() else {
                continue;
            };
            if matches!(peer.gone, Some(Gone::Died(_)) | Some(Gone::Corrupt(_))) {
                continue;
            }
            moved |= Self::write_queued(peer);
            let budget = READ_AHEAD_BYTES.saturating_sub(self.buffered[source]);
            if budget == 0 && !wanted_here && !stalled {
                continue;
            }
            let mut delivered = Vec::new();
            let hold = Hold {
                want,
                release: stalled,
            };
            moved |= Self::read_arrived(peer, source, &self.posted, hold, budget, &mut delivered);
            for (kind, header, payload, landed) in delivered {
                self.deliver(source, kind, header, payload, landed);
            }
            self.log_if_lost(source);
        }
        moved
    }

    /// One line on stderr the moment a peer is found dead or corrupt: in a
    /// hung job, the first question is which rank went first.
    fn log_if_lost(&mut self, source: usize) {
        let Some(peer) = self.peers[source].as_mut() else {
            return;
        };
        if peer.logged {
            return;
        }
        let why = match &peer.gone {
            Some(Gone::Died(why)) | Some(Gone::Corrupt(why)) => why,
            _ => return,
        };
        peer.logged = true;
        eprintln!("oxccl: rank {}: lost rank {source}: {why}", self.rank);
    }

    fn write_queued(peer: &mut Peer) -> bool {
        if let Link::Tcp(link) = &mut peer.link {
            return Self::write_queued_tcp(link, &mut peer.out, &mut peer.gone);
        }
        let mut moved = false;
        while let Some(front) = peer.out.front_mut() {
            let total = FRAME_HEADER_BYTES + front.payload.as_bytes().len();
            let (a, b) = if front.written < FRAME_HEADER_BYTES {
                (&front.header[front.written..], front.payload.as_bytes())
            } else {
                (
                    &[][..],
                    &front.payload.as_bytes()[front.written - FRAME_HEADER_BYTES..],
                )
            };
            match peer.link.write_two(a, b) {
                Ok(0) => break,
                Ok(n) => {
                    moved = true;
                    front.written += n;
                    if front.written == total {
                        peer.out.pop_front();
                    }
                }
                Err(e) => {
                    peer.gone.get_or_insert(gone_after(e, "link failed"));
                    break;
                }
            }
        }
        moved
    }

    /// [`write_queued`](Self::write_queued) over TCP: the queued frames
    /// go out several at a time, up to [`TCP_WRITE_SLICES`] buffers and
    /// [`TCP_WRITE_BYTES`] per `sendmsg` (see `send`).
    fn write_queued_tcp(
        link: &mut TcpLink,
        out: &mut VecDeque<Outgoing>,
        gone: &mut Option<Gone>,
    ) -> bool {
        let mut moved = false;
        while !out.is_empty() {
            // On the stack: a small send writes once per call, and an
            // allocation would be a good part of its time in user space.
            let mut slices = [std::io::IoSlice::new(&[]); TCP_WRITE_SLICES];
            let (mut used, mut bytes) = (0, 0);
            for frame in out.iter() {
                if used + 2 > TCP_WRITE_SLICES || bytes >= TCP_WRITE_BYTES {
                    break;
                }
                let header = &frame.header[frame.written.min(FRAME_HEADER_BYTES)..];
                let payload =
                    &frame.payload.as_bytes()[frame.written.saturating_sub(FRAME_HEADER_BYTES)..];
                for part in [header, payload] {
                    if !part.is_empty() {
                        bytes += part.len();
                        slices[used] = std::io::IoSlice::new(part);
                        used += 1;
                    }
                }
            }
            let mut n = match link.write_slices(&slices[..used]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    gone.get_or_insert(Gone::Died(format!("link failed: {e}")));
                    break;
                }
            };
            moved = true;
            while n > 0 {
                let Some(front) = out.front_mut() else { break };
                let left = FRAME_HEADER_BYTES + front.payload.as_bytes().len() - front.written;
                let took = left.min(n);
                front.written += took;
                n -= took;
                if took == left {
                    out.pop_front();
                }
            }
        }
        moved
    }

    /// Reads what `peer`'s link holds, delivering complete frames, until
    /// the link is empty or the frames delivered into buffers pass `budget`
    /// bytes (at least one frame is read: with a budget of 0, exactly one).
    /// The budget matters: a sender that keeps writing would otherwise keep
    /// this loop reading for as long as it sends.
    fn read_arrived(
        peer: &mut Peer,
        source: usize,
        posted: &FrameMap<Key, Posted>,
        hold: Hold,
        budget: usize,
        delivered: &mut Vec<(u8, FrameHeader, Payload, bool)>,
    ) -> bool {
        let mut buffered = 0usize;
        let mut moved = false;
        loop {
            if let Incoming::Held { header, key } = peer.incoming {
                match hold.reading(posted, key, &header) {
                    Some(next) => peer.incoming = next,
                    None => break,
                }
            }
            let result = match &mut peer.incoming {
                Incoming::Header { buf, filled } => {
                    match peer.link.read_some(&mut buf[*filled..]) {
                        Ok(0) => break,
                        Ok(n) => {
                            *filled += n;
                            if *filled == FRAME_HEADER_BYTES {
                                match decode(buf) {
                                    Ok((kind, header)) => {
                                        peer.link.saw_frame(header.bytes);
                                        let key = (
                                            source,
                                            header.ctx,
                                            header.space,
                                            header.seq,
                                            header.step,
                                        );
                                        peer.incoming = if kind == KIND_DATA {
                                            hold.reading(posted, key, &header)
                                                .unwrap_or(Incoming::Held { header, key })
                                        } else {
                                            Incoming::Payload {
                                                kind,
                                                header,
                                                payload: first_payload(header.bytes),
                                                filled: 0,
                                            }
                                        };
                                    }
                                    Err(why) => {
                                        peer.gone =
                                            Some(Gone::Corrupt(format!("malformed frame: {why}")));
                                        return true;
                                    }
                                }
                            }
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                }
                Incoming::Payload {
                    header,
                    payload,
                    filled,
                    ..
                } => {
                    if *filled == payload.as_bytes().len() && *filled < header.bytes {
                        // Full so far: double it, up to the frame's size.
                        payload.grow_to(header.bytes.min(filled.saturating_mul(2)));
                    }
                    let bytes = payload.as_bytes_mut();
                    if *filled < bytes.len() {
                        match peer.link.read_some(&mut bytes[*filled..]) {
                            Ok(0) => break,
                            Ok(n) => {
                                *filled += n;
                                Ok(())
                            }
                            Err(e) => Err(e),
                        }
                    } else {
                        Ok(())
                    }
                }
                // Left in the link: nothing to read now.
                Incoming::Held { .. } => break,
                Incoming::Direct { to, filled, .. } => {
                    // SAFETY: the receive that posted `to` is waiting (see
                    // `Posted`), and `filled < to.len`.
                    let rest = unsafe {
                        std::slice::from_raw_parts_mut(to.ptr.add(*filled), to.len - *filled)
                    };
                    match peer.link.read_some(rest) {
                        Ok(0) => break,
                        Ok(n) => {
                            *filled += n;
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                }
            };
            if let Err(e) = result {
                // Frames that arrived before the end of the stream are kept.
                // After a goodbye (perhaps read in this very pass, and
                // delivered by the caller) the end of the stream is expected.
                if e.kind() == std::io::ErrorKind::InvalidData
                    || !delivered.iter().any(|(kind, ..)| *kind == KIND_GOODBYE)
                {
                    peer.gone.get_or_insert(gone_after(e, "connection lost"));
                }
                return moved;
            }
            moved = true;
            let complete = match &peer.incoming {
                Incoming::Payload { header, filled, .. } => *filled == header.bytes,
                Incoming::Direct { to, filled, .. } => *filled == to.len,
                Incoming::Header { .. } | Incoming::Held { .. } => false,
            };
            if complete {
                match std::mem::replace(&mut peer.incoming, Incoming::new()) {
                    Incoming::Payload {
                        kind,
                        header,
                        payload,
                        ..
                    } => delivered.push((kind, header, payload, false)),
                    Incoming::Direct { header, .. } => {
                        delivered.push((KIND_DATA, header, Payload::default(), true))
                    }
                    Incoming::Header { .. } | Incoming::Held { .. } => {}
                }
                buffered += delivered.last().map_or(0, |d| d.2.as_bytes().len());
                if buffered >= budget {
                    break;
                }
            }
        }
        moved
    }

    fn deliver(
        &mut self,
        source: usize,
        kind: u8,
        header: FrameHeader,
        payload: Payload,
        landed: bool,
    ) {
        let Some(peer) = self.peers[source].as_mut() else {
            return;
        };
        if kind == KIND_GOODBYE {
            let entered = payload
                .as_bytes()
                .chunks_exact(16)
                .map(|pair| {
                    let (ctx, next) = pair.split_at(8);
                    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
                    (word(ctx), word(next))
                })
                .collect();
            peer.gone.get_or_insert(Gone::Departed(entered));
            return;
        }
        if kind == KIND_LEAVE {
            let left = peer.left.entry(header.ctx).or_insert(Left {
                entered: 0,
                failed: false,
                cause: None,
            });
            left.entered = left.entered.max(header.seq);
            left.failed |= matches!(header.step, LEAVE_FAILED | LEAVE_TIMED_OUT);
            if header.call != 0 {
                let global = header.call as usize - 1;
                left.cause = Some(if header.step == LEAVE_TIMED_OUT {
                    FailureCause::Late(global)
                } else {
                    FailureCause::Lost(global)
                });
            }
            self.left_contexts.insert(header.ctx);
            return;
        }
        let consumed = self.consumed.get(&(header.ctx, header.space, source));
        if consumed.is_some_and(|&last| header.seq < last) {
            peer.gone = Some(Gone::Corrupt(format!(
                "stale frame: {} #{} step {} arrived after #{} was consumed",
                header.op,
                header.seq,
                header.step,
                consumed.copied().unwrap_or_default()
            )));
            return;
        }
        let key = (source, header.ctx, header.space, header.seq, header.step);
        self.buffered[source] += payload.as_bytes().len();
        let arrived = Arrived {
            header,
            payload,
            landed,
        };
        if let Some(replaced) = self.arrive(key, arrived) {
            self.buffered[source] -= replaced.payload.as_bytes().len();
            if let Some(peer) = self.peers[source].as_mut() {
                peer.gone = Some(Gone::Corrupt(format!(
                    "duplicate frame: {} #{} step {}",
                    header.op, header.seq, header.step
                )));
            }
        }
    }

    /// Withdraws the destination posted for `key`. A frame for it already
    /// being read into the destination is moved into a buffer of its own
    /// (what arrived so far copied over), so nothing writes the
    /// destination once its receive has returned.
    fn unpost(&mut self, key: Key) {
        if self.posted.remove(&key).is_none() {
            return;
        }
        for peer in self.peers.iter_mut().flatten() {
            let Incoming::Direct {
                header,
                key: k,
                to,
                filled,
            } = peer.incoming
            else {
                continue;
            };
            if k != key {
                continue;
            }
            let mut payload = first_payload(header.bytes.max(filled));
            payload.grow_to(filled);
            // SAFETY: `to` is still valid (its receive is returning now) and
            // holds `filled` bytes of the frame.
            let so_far = unsafe { std::slice::from_raw_parts(to.ptr, filled) };
            payload.as_bytes_mut()[..filled].copy_from_slice(so_far);
            peer.incoming = Incoming::Payload {
                kind: KIND_DATA,
                header,
                payload,
                filled,
            };
        }
    }

    /// Records that this rank has entered collective `h.seq` of `h.ctx`.
    fn note_entered(&mut self, h: &FrameHeader) {
        if h.space == Space::Collective {
            let next = self.entered.entry(h.ctx).or_insert(0);
            *next = (*next).max(h.seq + 1);
        }
    }

    /// Marks shared-memory peers whose process died or left.
    fn check_liveness(&mut self) {
        self.check_liveness_at(Instant::now());
    }

    /// [`check_liveness`](Self::check_liveness) with the time already
    /// read (a wait's pass reads the clock once).
    fn check_liveness_at(&mut self, now: Instant) {
        if now < self.next_liveness_check {
            return;
        }
        self.next_liveness_check = now + LIVENESS_INTERVAL;
        for source in 0..self.peers.len() {
            let Some(peer) = self.peers[source].as_mut() else {
                continue;
            };
            if let (Link::Shm(link), None) = (&peer.link, &peer.gone) {
                if link.peer_departed() {
                    // Its goodbye frame, with how far it got, is in the ring
                    // before the flag was set; read it first.
                    let mut delivered = Vec::new();
                    let everything = Hold {
                        want: None,
                        release: true,
                    };
                    Self::read_arrived(
                        peer,
                        source,
                        &self.posted,
                        everything,
                        usize::MAX,
                        &mut delivered,
                    );
                    for (kind, header, payload, landed) in delivered {
                        self.deliver(source, kind, header, payload, landed);
                    }
                    let Some(peer) = self.peers[source].as_mut() else {
                        continue;
                    };
                    peer.gone.get_or_insert(Gone::Departed(HashMap::new()));
                } else if !link.peer_alive() {
                    peer.gone = Some(Gone::Died(format!(
                        "process {} is gone (killed or crashed)",
                        link.peer_pid()
                    )));
                }
            }
            self.log_if_lost(source);
        }
    }

    /// How `global` left the communicator `ctx`, if it did (its process
    /// staying; see [`KIND_LEAVE`]).
    fn left(&self, global: usize, ctx: u64) -> Option<Left> {
        self.peers
            .get(global)
            .and_then(|p| p.as_ref())
            .and_then(|p| p.left.get(&ctx).copied())
    }

    fn gone(&self, global: usize) -> Option<&Gone> {
        self.peers
            .get(global)
            .and_then(|p| p.as_ref())
            .and_then(|p| p.gone.as_ref())
    }

    fn has_queued(&self, global: usize) -> bool {
        self.peers
            .get(global)
            .and_then(|p| p.as_ref())
            .is_some_and(|p| !p.out.is_empty())
    }

    /// The descriptors to sleep on when nothing moves, and whether some
    /// link cannot be polled (then sleep only briefly): a shared-memory
    /// link (no fd), or a TCP link with bytes in its own read buffer.
    fn poll_set(&self, fds: &mut Vec<libc::pollfd>) -> bool {
        fds.clear();
        let mut unpollable = false;
        for peer in self.peers.iter().flatten() {
            match &peer.link {
                // Bytes already read into the link's buffer: the socket may
                // show nothing more, so do not block on it.
                Link::Tcp(link) if peer.gone.is_none() && link.has_buffered() => unpollable = true,
                Link::Tcp(link) if peer.gone.is_none() => fds.push(libc::pollfd {
                    fd: link.fd(),
                    events: libc::POLLIN
                        | if peer.out.is_empty() {
                            0
                        } else {
                            libc::POLLOUT
                        },
                    revents: 0,
                }),
                Link::Tcp(_) => {}
                Link::Shm(_) => unpollable = true,
            }
        }
        unpollable
    }
}

/// Idles a waiting rank: spin briefly (a frame is usually microseconds
/// away), then sleep on the sockets or for short, growing intervals, so an
/// idle rank does not burn a core.
/// Passes a wait spins before yielding (and before it counts as stalled);
/// on a crowded host it yields through them instead (`NetShared::crowded`).
const SPIN_PASSES: u32 = 200;

struct Backoff {
    idle: u32,
    fds: Vec<libc::pollfd>,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff {
            idle: 0,
            fds: Vec::new(),
        }
    }

    fn reset(&mut self) {
        self.idle = 0;
    }

    /// Whether the wait has gone a whole spin phase without progress (then
    /// links are read past the read-ahead limit).
    fn stalled(&self) -> bool {
        self.idle >= SPIN_PASSES
    }

    fn wait(&mut self, shared: &NetShared, deadline: Instant) {
        self.idle = self.idle.saturating_add(1);
        if self.idle < SPIN_PASSES {
            // Crowded, the peer this rank waits for may need this core:
            // four ranks over loopback TCP on two CPUs, 8 B all-reduce
            // 456–607 µs spinning, 49–74 µs yielding (`docs/performance.md`,
            // stop 47).
            if shared.crowded {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return;
        }
        if self.idle < 400 {
            std::thread::yield_now();
            return;
        }
        let unpollable = shared.lock().poll_set(&mut self.fds);
        let left = deadline.saturating_duration_since(Instant::now());
        // Short sleeps keep shared memory responsive and `abort` prompt.
        let cap = if unpollable {
            Duration::from_micros(50 * u64::from((self.idle - 400).min(20)) + 50)
        } else {
            Duration::from_millis(10)
        };
        let nap = left.min(cap);
        if self.fds.is_empty() {
            std::thread::sleep(nap);
        } else {
            let ms = if unpollable {
                0
            } else {
                nap.as_millis().max(1) as libc::c_int
            };
            // SAFETY: fds is a valid array of pollfd for the call's duration.
            unsafe { libc::poll(self.fds.as_mut_ptr(), self.fds.len() as libc::nfds_t, ms) };
            if unpollable {
                std::thread::sleep(nap);
            }
        }
    }
}

/// One communicator's view of a fabric.
pub(crate) struct NetEndpoint {
    shared: Arc<NetShared>,
    ctx: u64,
    /// Communicator rank → global rank.
    members: Vec<usize>,
    /// [`links_all_tcp`](Self::links_all_tcp), decided once.
    links_all_tcp: bool,
    /// [`crowded_host`](Self::crowded_host), decided once.
    crowded_host: bool,
    /// [`ring_order`](Self::ring_order), decided once.
    ring_order: RingOrder,
}

impl NetEndpoint {
    pub fn ctx(&self) -> u64 {
        self.ctx
    }

    /// The abort flag: set, it makes every wait of every communicator on
    /// this fabric (and the arena's) return `Aborted`; every wait polls it.
    pub fn abort_flag(&self) -> Arc<AtomicBool> {
        self.shared.aborted.clone()
    }

    pub fn shared(&self) -> &Arc<NetShared> {
        &self.shared
    }

    /// Whether every link among this endpoint's members is TCP
    /// ([`LinkMap::all_tcp`]). Every member answers alike, so plans may
    /// depend on it.
    pub fn links_all_tcp(&self) -> bool {
        self.links_all_tcp
    }

    /// Whether this endpoint's members all run on one host of a machine
    /// (kernel) whose job ranks outnumber its CPUs
    /// ([`LinkMap::crowded_together`]):
    /// every member answers alike, so plans may depend on it
    /// (`schedule::choose_for`).
    pub fn crowded_host(&self) -> bool {
        self.crowded_host
    }

    /// The order of this endpoint's members around the ring
    /// ([`LinkMap::ring_order`]); the same on every member.
    pub fn ring_order(&self) -> &RingOrder {
        &self.ring_order
    }

    /// Whether this machine's ranks outnumber their CPUs
    /// ([`NetShared`]'s `crowded`).
    pub fn crowded(&self) -> bool {
        self.shared.crowded
    }

    /// An endpoint for a sub-communicator of `members` (ranks of this one).
    pub fn child(&self, ctx: u64, members: &[usize]) -> NetEndpoint {
        self.shared.endpoints.fetch_add(1, Ordering::SeqCst);
        let members: Vec<usize> = members.iter().map(|&r| self.members[r]).collect();
        NetEndpoint {
            links_all_tcp: self.shared.links.all_tcp(&members),
            crowded_host: self.shared.links.crowded_together(&members),
            ring_order: self.shared.links.ring_order(&members),
            shared: self.shared.clone(),
            ctx,
            members,
        }
    }

    /// What carries messages to communicator rank `peer`; `None` for this
    /// rank itself and for ranks outside the communicator.
    pub fn link_kind(&self, peer: Rank) -> Option<super::LinkKind> {
        let global = *self.members.get(peer)?;
        let fabric = self.shared.lock();
        match &fabric.peers.get(global)?.as_ref()?.link {
            Link::Shm(_) => Some(super::LinkKind::SharedMemory),
            Link::Tcp(_) => Some(super::LinkKind::Tcp),
        }
    }

    /// Which links carry this communicator's traffic: `shm`, `tcp` (with the
    /// interface), `shm+tcp`, or `none` for a world of one.
    pub fn describe(&self) -> String {
        let fabric = self.shared.lock();
        let (mut shm, mut tcp) = (false, false);
        for &g in &self.members {
            match fabric
                .peers
                .get(g)
                .and_then(|p| p.as_ref())
                .map(|p| &p.link)
            {
                Some(Link::Shm(_)) => shm = true,
                Some(Link::Tcp(_)) => tcp = true,
                None => {}
            }
        }
        let tcp_text = match &fabric.interface {
            Some(iface) => format!("tcp ({iface})"),
            None => "tcp".into(),
        };
        match (shm, tcp) {
            (true, true) => format!("shm+{tcp_text}"),
            (true, false) => "shm".into(),
            (false, true) => tcp_text,
            (false, false) => "none (one rank)".into(),
        }
    }

    /// The first reason this call cannot complete, if any: a member
    /// crashed or sent garbage (fatal to every collective), a member left
    /// before entering this collective, or the peer it needs has left.
    /// `expect` is `None` when only queued sends to `peer` are at stake.
    fn failure(
        &self,
        fabric: &Fabric,
        peer: usize,
        expect: Option<&FrameHeader>,
    ) -> Option<TransportError> {
        let lost = |member: usize| TransportError::PeerLost { rank: Some(member) };
        let fatal = |member: usize, gone: &Gone| match gone {
            Gone::Died(_) => Some(lost(member)),
            Gone::Corrupt(why) => Some(TransportError::Mismatch(format!(
                "rank {member} sent {why}"
            ))),
            Gone::Departed(_) => None,
        };
        let collective = expect.filter(|h| h.space == Space::Collective);
        // A range, not a list: this runs at every pass of a wait.
        let involved = match collective {
            Some(_) => 0..self.members.len(),
            None => peer..peer + 1,
        };
        for member in involved.clone() {
            if let Some(e) = fabric
                .gone(self.members[member])
                .and_then(|g| fatal(member, g))
            {
                return Some(e);
            }
        }
        let any_left = fabric.left_contexts.contains(&self.ctx);
        let left = |member: usize| {
            any_left
                .then(|| fabric.left(self.members[member], self.ctx))
                .flatten()
        };
        // A member that failed because another was lost names that one:
        // its leave (and its process's goodbye) may reach this rank before
        // this rank finds the loss itself (reading through what the lost
        // rank sent before it died).
        let me = self.members.iter().position(|&g| g == fabric.rank);
        let lost = |member: usize| {
            left(member)
                .and_then(|l| l.cause)
                .and_then(|c| c.map(|g| self.members.iter().position(|&m| m == g)))
                .map_or(lost(member), |c| {
                    c.error_for(member, me.unwrap_or(usize::MAX))
                })
        };
        if let Some(h) = collective {
            for member in involved.clone() {
                if let Some(Gone::Departed(entered)) = fabric.gone(self.members[member]) {
                    if entered.get(&h.ctx).is_none_or(|&n| n <= h.seq) {
                        return Some(lost(member));
                    }
                }
                if left(member).is_some_and(|l| l.entered <= h.seq) {
                    return Some(lost(member));
                }
            }
        }
        if matches!(fabric.gone(self.members[peer]), Some(Gone::Departed(_)))
            || left(peer).is_some_and(|l| !l.failed)
        {
            return Some(lost(peer));
        }
        // Last, as a rank usually fails because another left or died, and
        // that one is what to name: a member whose communicator failed
        // sends nothing more in it (the awaited peer first, as it is the
        // one that will not send).
        std::iter::once(peer)
            .chain(involved)
            .find(|&m| left(m).is_some_and(|l| l.failed))
            .map(lost)
    }

    /// Tells the other members that this rank takes no further part in
    /// this communicator (see [`KIND_LEAVE`]): they fail the calls it will
    /// not serve at once instead of waiting out their timeout. The frame
    /// goes behind whatever this rank still has queued for them, so what
    /// it sent before leaving arrives first; what is not written now is
    /// written by the next progress pass of any call, or the goodbye.
    fn leave(&self, reason: u32) {
        self.leave_because(reason, None);
    }

    /// [`leave`](Self::leave), naming the global rank whose loss caused it.
    fn leave_because(&self, reason: u32, cause: Option<usize>) {
        if reason == LEAVE_DROPPED && self.shared.endpoints.load(Ordering::SeqCst) == 0 {
            // The last endpoint of the fabric: the goodbye that follows at
            // once says it for every context. (Writing both to a peer that
            // already closed its end would fail the second write and read
            // as a lost peer.)
            return;
        }
        let mut fabric = self.shared.lock();
        // Read what has arrived first: a peer whose goodbye is here already
        // is skipped below.
        fabric.progress();
        let header = FrameHeader {
            ctx: self.ctx,
            space: Space::Collective,
            seq: fabric.entered.get(&self.ctx).copied().unwrap_or(0),
            step: reason,
            op: OpKind::Barrier,
            bytes: 0,
            call: cause.and_then(|g| u32::try_from(g + 1).ok()).unwrap_or(0),
        };
        let me = fabric.rank;
        for &global in self.members.iter().filter(|&&g| g != me) {
            let Some(p) = fabric.peers.get_mut(global).and_then(|p| p.as_mut()) else {
                continue;
            };
            // A peer that left, died or broke reads nothing more (and a
            // write to one that closed its end fails, to no purpose).
            if p.gone.is_some() {
                continue;
            }
            p.out.push_back(Outgoing {
                header: encode(KIND_LEAVE, &header),
                payload: Payload::from_bytes(&[]),
                written: 0,
            });
            Fabric::write_queued(p);
        }
    }

    /// Tells the other members that this rank's communicator failed.
    /// `cause`: the member whose loss made it fail, told to the others.
    pub fn mark_failed(&self, cause: Option<FailureCause>) {
        let cause = cause.and_then(|c| c.map(|m| self.members.get(m).copied()));
        match cause {
            Some(FailureCause::Late(global)) => self.leave_because(LEAVE_TIMED_OUT, Some(global)),
            Some(FailureCause::Lost(global)) => self.leave_because(LEAVE_FAILED, Some(global)),
            None => self.leave_because(LEAVE_FAILED, None),
        }
    }

    pub fn send(
        &self,
        peer: usize,
        header: FrameHeader,
        payload: Payload,
    ) -> std::result::Result<(), TransportError> {
        if self.shared.aborted.load(Ordering::SeqCst) {
            return Err(TransportError::Aborted);
        }
        let mut fabric = self.shared.lock();
        fabric.note_entered(&header);
        if self.failure(&fabric, peer, None).is_some() {
            // Before blaming the destination, read what has arrived: a
            // member that left before this collective is the real cause.
            fabric.progress();
            if let Some(e) = self.failure(&fabric, peer, Some(&header)) {
                return Err(e);
            }
        }
        let global = self.members[peer];
        let Some(p) = fabric.peers.get_mut(global).and_then(|p| p.as_mut()) else {
            return Err(TransportError::PeerLost { rank: Some(peer) });
        };
        // A large frame over TCP waits until the queue holds
        // [`TCP_BATCH_BYTES`] or the next progress pass (at the latest the
        // call's flush), which writes what is queued with as few `sendmsg` calls
        // as it can: a loopback stream here moves 3.1 GB/s in 256 KiB
        // writes and 6.4 GB/s in 1 MiB ones (iperf3). Writing once a batch
        // is full keeps a sender that does local work between its sends (a
        // broadcast root copying into its own output) from holding every
        // byte back until its flush. Small frames go at once, for latency.
        let queued = p
            .out
            .iter()
            .map(|o| o.payload.as_bytes().len())
            .sum::<usize>()
            + payload.as_bytes().len();
        let defer = matches!(p.link, Link::Tcp(_))
            && payload.as_bytes().len() >= TCP_DEFER_MIN_BYTES
            && queued < TCP_BATCH_BYTES;
        p.out.push_back(Outgoing {
            header: encode(KIND_DATA, &header),
            payload,
            written: 0,
        });
        if !defer {
            Fabric::write_queued(p);
        }
        Ok(())
    }

    pub fn recv(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
    ) -> std::result::Result<Payload, TransportError> {
        // Without a destination the frame always comes back as a buffer.
        self.receive(peer, expect, timeout, None, None)?
            .ok_or_else(|| {
                TransportError::Mismatch("a frame landed in another receive's buffer".into())
            })
    }

    /// [`recv`](Self::recv) into `dst` (`expect.bytes` long): while this
    /// waits, a matching frame that starts arriving is read straight into
    /// `dst`; one that arrived earlier is copied from its buffer. Each pass
    /// of the wait also asks `elsewhere` (see
    /// [`Transport::recv_into`](super::Transport::recv_into)).
    pub fn recv_into(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
        dst: &mut [u8],
        elsewhere: super::Elsewhere<'_>,
    ) -> std::result::Result<(), TransportError> {
        // The destination's own length bounds what is read into it; a frame
        // of another length is refused (`Posted::takes`).
        let to = Posted::new(dst.as_mut_ptr(), dst.len(), expect);
        if let Some(payload) = self.receive(peer, expect, timeout, Some(to), elsewhere)? {
            dst.copy_from_slice(payload.as_bytes());
        }
        Ok(())
    }

    /// The fabric's key for the frame `expect` from communicator rank `peer`.
    fn key(&self, peer: usize, expect: &FrameHeader) -> Key {
        let source = self.members[peer];
        (source, expect.ctx, expect.space, expect.seq, expect.step)
    }

    /// See [`Transport::post_ahead`](super::Transport::post_ahead).
    pub fn post_ahead(&self, recvs: &[(usize, FrameHeader, *mut u8)]) {
        let mut fabric = self.shared.lock();
        for (peer, expect, ptr) in recvs {
            if expect.bytes > 0 {
                fabric.posted.insert(
                    self.key(*peer, expect),
                    Posted::new(*ptr, expect.bytes, expect),
                );
            }
        }
    }

    /// See [`Transport::has_frame`](super::Transport::has_frame).
    pub fn has_frame(&self, peer: usize, expect: &FrameHeader, stalled: bool) -> bool {
        let key = self.key(peer, expect);
        let mut fabric = self.shared.lock();
        fabric.progress_for(Some(key), stalled);
        fabric.arrived.contains_key(&key)
            || fabric.peers[key.0]
                .as_ref()
                .is_some_and(|p| match &p.incoming {
                    Incoming::Held { key: k, .. } | Incoming::Direct { key: k, .. } => *k == key,
                    Incoming::Payload { kind, header, .. } => {
                        *kind == KIND_DATA
                            && (key.1, key.2, key.3, key.4)
                                == (header.ctx, header.space, header.seq, header.step)
                    }
                    Incoming::Header { .. } => false,
                })
    }

    /// See [`Transport::unclaimed`](super::Transport::unclaimed).
    pub fn unclaimed(&self, seq: u64) -> Option<(usize, FrameHeader)> {
        let fabric = self.shared.lock();
        if !fabric.collective_arrivals.any_up_to(self.ctx, seq) {
            return None;
        }
        // Found one: which (rare, and the call fails).
        fabric
            .arrived
            .iter()
            .find(|(k, _)| k.1 == self.ctx && k.2 == Space::Collective && k.3 <= seq)
            .and_then(|(k, arrived)| {
                let member = self.members.iter().position(|&g| g == k.0)?;
                Some((member, arrived.header))
            })
    }

    /// See [`Transport::withdraw`](super::Transport::withdraw).
    pub fn withdraw(&self, recvs: &[(usize, FrameHeader, *mut u8)]) {
        let mut fabric = self.shared.lock();
        for (peer, expect, _) in recvs {
            fabric.unpost(self.key(*peer, expect));
        }
    }

    /// The receive loop: `Ok(None)` when the frame landed in `to`.
    fn receive(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
        to: Option<Posted>,
        mut elsewhere: super::Elsewhere<'_>,
    ) -> std::result::Result<Option<Payload>, TransportError> {
        let key = self.key(peer, expect);
        let source = key.0;
        // The clock is read once a pass, from the first pass that does
        // not find the frame: a frame already there costs no clock read
        // (two of them were a tenth of an 8-byte receive's samples).
        let mut started: Option<(Instant, Instant)> = None;
        let mut backoff = Backoff::new();
        if let Some(to) = to.filter(|t| t.len > 0) {
            self.shared.lock().posted.insert(key, to);
        }
        loop {
            let deadline = {
                let mut fabric = self.shared.lock();
                fabric.note_entered(expect);
                if fabric.progress_for(Some(key), backoff.stalled()) {
                    backoff.reset();
                }
                let mut arrived = fabric.take_arrived(&key);
                let now = if arrived.is_none() {
                    // The liveness check reads what a departing peer left
                    // in its ring (its last frames, then its goodbye), so
                    // it runs before the frame is looked for again: a
                    // frame that arrived just before its sender left is
                    // delivered, not reported as lost.
                    let now = Instant::now();
                    fabric.check_liveness_at(now);
                    arrived = fabric.take_arrived(&key);
                    Some(now)
                } else {
                    None
                };
                if let Some(arrived) = arrived {
                    fabric.buffered[source] -= arrived.payload.as_bytes().len();
                    fabric.unpost(key);
                    fabric
                        .consumed
                        .insert((expect.ctx, expect.space, source), expect.seq);
                    return arrived
                        .header
                        .check_matches(expect)
                        .map(|()| (!arrived.landed).then_some(arrived.payload));
                }
                if self.shared.aborted.load(Ordering::SeqCst) {
                    fabric.unpost(key);
                    return Err(TransportError::Aborted);
                }
                if elsewhere.as_mut().is_some_and(|came| came()) {
                    fabric.unpost(key);
                    return Err(super::came_elsewhere());
                }
                if let Some(e) = self.failure(&fabric, peer, Some(expect)) {
                    // A peer that left in the middle of a call usually left
                    // because another rank died: look again now, and blame
                    // the dead rank rather than the messenger.
                    fabric.next_liveness_check = Instant::now();
                    fabric.progress();
                    fabric.check_liveness();
                    if fabric.arrived.contains_key(&key) {
                        continue; // it came after all: take it above
                    }
                    fabric.unpost(key);
                    return Err(self.failure(&fabric, peer, Some(expect)).unwrap_or(e));
                }
                // The deadline is checked under the same lock as the
                // arrivals and the withdrawal: a frame landing between a
                // check outside it and the withdrawal would be reported as
                // a timeout and left behind. (`now` is set: the frame was
                // not found.)
                let now = now.unwrap_or_else(Instant::now);
                let (start, deadline) = *started.get_or_insert((now, now + timeout));
                if now >= deadline {
                    fabric.unpost(key);
                    return Err(TransportError::Timeout(now - start));
                }
                deadline
            };
            backoff.wait(&self.shared, deadline);
        }
    }

    /// See [`Transport::own_borrowed`](super::Transport::own_borrowed).
    pub fn own_borrowed(&self) {
        let mut fabric = self.shared.lock();
        for peer in fabric.peers.iter_mut().flatten() {
            for outgoing in &mut peer.out {
                outgoing.payload.make_owned();
            }
        }
    }

    /// See [`Transport::own_borrowed_within`](super::Transport::own_borrowed_within).
    pub fn own_borrowed_within(&self, range: std::ops::Range<usize>) {
        // Queued frames borrow disjoint bytes (each call's pieces are
        // disjoint, and its sends are flushed before it returns), so the
        // walk ends once the range is covered: the frame an exchange's
        // receive overwrites is near the front of its peer's queue, and a
        // call of many small pieces does not walk the whole queue per piece.
        let mut uncovered = range.len();
        let mut fabric = self.shared.lock();
        for peer in fabric.peers.iter_mut().flatten() {
            for outgoing in &mut peer.out {
                if uncovered == 0 {
                    return;
                }
                let borrowed = outgoing.payload.borrowed_within(&range);
                if borrowed > 0 {
                    outgoing.payload.make_owned();
                    uncovered = uncovered.saturating_sub(borrowed);
                }
            }
        }
    }

    /// Waits until everything this communicator queued for its members has
    /// been handed to the links, still receiving meanwhile. On failure
    /// returns the communicator rank concerned.
    pub fn flush(&self, timeout: Duration) -> std::result::Result<(), (usize, TransportError)> {
        // Read from the first pass that finds something still queued.
        let mut started: Option<(Instant, Instant)> = None;
        let mut backoff = Backoff::new();
        let queued =
            |fabric: &Fabric| (0..self.members.len()).find(|&m| fabric.has_queued(self.members[m]));
        loop {
            let waiting_for = {
                let mut fabric = self.shared.lock();
                // Usually the sends went out at once: then return without
                // a progress pass (its read of every link is a system call
                // that finds nothing, about 1 µs over TCP here).
                if queued(&fabric).is_none() {
                    return Ok(());
                }
                if fabric.progress_for(None, backoff.stalled()) {
                    backoff.reset();
                }
                let Some(peer) = queued(&fabric) else {
                    return Ok(());
                };
                if self.shared.aborted.load(Ordering::SeqCst) {
                    return Err((peer, TransportError::Aborted));
                }
                let now = Instant::now();
                fabric.check_liveness_at(now);
                if let Some(e) = self.failure(&fabric, peer, None) {
                    return Err((peer, e));
                }
                (peer, now)
            };
            let (waiting_for, now) = waiting_for;
            let (start, deadline) = *started.get_or_insert((now, now + timeout));
            if now >= deadline {
                return Err((waiting_for, TransportError::Timeout(now - start)));
            }
            backoff.wait(&self.shared, deadline);
        }
    }
}

impl Drop for NetEndpoint {
    /// A dropped communicator leaves its group (see [`NetEndpoint::leave`]).
    fn drop(&mut self) {
        self.shared.endpoints.fetch_sub(1, Ordering::SeqCst);
        self.leave(LEAVE_DROPPED);
    }
}

impl Drop for Fabric {
    /// Says goodbye: queues a goodbye frame to every peer, hands over what is
    /// still queued (briefly, still reading so nobody blocks on us), and
    /// flags the shared-memory inbox as departed.
    fn drop(&mut self) {
        let mut entered = Vec::with_capacity(16 * self.entered.len());
        for (ctx, next) in &self.entered {
            entered.extend_from_slice(&ctx.to_le_bytes());
            entered.extend_from_slice(&next.to_le_bytes());
        }
        let goodbye = FrameHeader {
            ctx: 0,
            space: Space::Collective,
            seq: 0,
            step: 0,
            op: OpKind::Barrier,
            bytes: entered.len(),
            call: 0,
        };
        // To peers still here, and to those whose goodbye this rank read: a
        // departed peer may still be in this same loop, reading, and
        // without a goodbye before this side's end of stream it would
        // count this rank as lost ("lost rank R" at exit, seen once in
        // about 45 four-rank runs on two CPUs). Not to a dead or corrupt
        // one, which reads nothing more. The loop below waits only for
        // peers still here (what is queued for a departed one, such as a
        // large send it left behind, is written while the loop lasts, not
        // waited for).
        for peer in self.peers.iter_mut().flatten() {
            if !matches!(peer.gone, Some(Gone::Died(_) | Gone::Corrupt(_))) {
                peer.out.push_back(Outgoing {
                    header: encode(KIND_GOODBYE, &goodbye),
                    payload: Payload::from_bytes(&entered),
                    written: 0,
                });
            }
        }
        let deadline = Instant::now() + GOODBYE_FLUSH;
        loop {
            self.progress();
            self.check_liveness();
            let pending = self
                .peers
                .iter()
                .flatten()
                .any(|p| !p.out.is_empty() && p.gone.is_none());
            if !pending || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        if let Some(segment) = &self.own_segment {
            segment.set_departed();
        }
    }
}

/// Which links to use between pairs of ranks (`OXCCL_TRANSPORT`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// Shared memory between ranks on the same host, TCP between hosts.
    #[default]
    Auto,
    /// Shared memory for every pair (an error if ranks span hosts).
    Shm,
    /// TCP for every pair, also on one host.
    Tcp,
}

impl TransportKind {
    /// Parses `auto`, `shm` or `tcp`.
    pub fn from_name(name: &str) -> Option<TransportKind> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(TransportKind::Auto),
            "shm" => Some(TransportKind::Shm),
            "tcp" | "socket" => Some(TransportKind::Tcp),
            _ => None,
        }
    }
}

/// Everything [`connect`] needs to join a job.
pub(crate) struct Setup {
    pub rank: Rank,
    pub world: usize,
    pub store: Arc<dyn Store>,
    pub timeout: Duration,
    pub transport: TransportKind,
    pub socket_ifname: Option<String>,
    /// The master's address, to pick the interface that reaches it.
    pub toward: Option<IpAddr>,
    pub job_id: Option<String>,
    pub shm_ring_bytes: usize,
    /// How shared-memory links store their large writes.
    pub shm_link_stores: shm::LinkStores,
    /// Bytes of the arena an all-local world shares (0: none).
    pub arena_bytes: usize,
    /// Settings every rank must share, as `(name the user sets it by,
    /// value)`: ranks that plan a call differently (another algorithm
    /// family or pipeline piece) exchange frames that fit each other's
    /// shapes and fold them into wrong results, and ranks that pick other
    /// links wait for connections that never come. Published in the rank's
    /// entry and compared at rendezvous. Values hold no newline.
    pub settings: Vec<(&'static str, String)>,
    /// Connects to the job's store again (by the deadline given), for a
    /// store that still holds this process's claim from a communicator
    /// already dropped: the previous job's store, whose host (rank 0) has
    /// not dropped its communicator yet. `None` when the caller gave the
    /// store itself.
    pub reconnect: Option<Reconnect>,
}

/// See [`Setup::reconnect`].
pub(crate) type Reconnect = Box<dyn Fn(Instant) -> Result<Arc<dyn Store>> + Send>;

/// How long a rank that found the previous job's store waits before
/// connecting again.
const STALE_STORE_RETRY: Duration = Duration::from_millis(50);

/// The ranks this process holds through a live communicator, per store
/// (`Store::describe`), counted: a claim the store refuses because this
/// process made it is a live communicator's only if it is here.
static LIVE_CLAIMS: Mutex<Vec<(String, usize)>> = Mutex::new(Vec::new());

/// One entry of [`LIVE_CLAIMS`], removed when the fabric that made the
/// claim drops.
struct LiveClaim {
    store: String,
    rank: usize,
}

impl LiveClaim {
    fn new(store: String, rank: usize) -> LiveClaim {
        lock_claims().push((store.clone(), rank));
        LiveClaim { store, rank }
    }

    fn is_live(store: &str, rank: usize) -> bool {
        lock_claims().iter().any(|(s, r)| s == store && *r == rank)
    }
}

impl Drop for LiveClaim {
    fn drop(&mut self) {
        let mut claims = lock_claims();
        if let Some(i) = claims
            .iter()
            .position(|(s, r)| *s == self.store && *r == self.rank)
        {
            claims.swap_remove(i);
        }
    }
}

fn lock_claims() -> std::sync::MutexGuard<'static, Vec<(String, usize)>> {
    // Each critical section is one push, scan or removal.
    LIVE_CLAIMS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why [`claim_rank`] did not claim.
enum Refused {
    /// This process claimed the rank before, through a communicator that
    /// has been dropped: the store is the previous job's.
    StaleStore(Error),
    /// Another holder has it (another process, or a live communicator of
    /// this one): never retried.
    Taken(Error),
    /// The store failed to answer.
    Store(Error),
}

impl From<Error> for Refused {
    fn from(e: Error) -> Refused {
        Refused::Store(e)
    }
}

/// What each rank publishes at rendezvous.
struct RankInfo {
    host: String,
    addr: SocketAddr,
    /// The kernel it runs on (`shm::kernel_identity`): ranks of one kernel
    /// share its CPUs, in whatever namespaces or containers.
    kernel: String,
    /// The CPUs its process may run on.
    cpus: cpus::CpuWords,
}

fn rank_key(r: usize) -> String {
    format!("oxccl/rank/{r}")
}

/// The value of `name=` in a rank's entry (`host=…`, `pid=…`, `addr=…`,
/// `world=…`, `kernel=…`, `cpus=…`, one per line).
fn entry_field(entry: &str, name: &str) -> Option<String> {
    entry
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        .map(str::to_string)
}

/// Returns `error`, found in the rank entries once every rank had joined,
/// after a second on rank 0: it usually hosts the store, and its exit takes
/// the store down, so the other ranks, still reading the entries, would
/// report "lost the store" instead of the same cause. (Every rank reads
/// every entry, so each finds the disagreement itself.)
fn after_peers_read(rank: usize, error: Error) -> Error {
    if rank == 0 {
        std::thread::sleep(Duration::from_secs(1));
    }
    error
}

/// The field of a rank's entry that holds the setting `name`.
fn setting_field(name: &str) -> String {
    format!("setting {name}")
}

/// Where rank `r`'s entry (its fields by `field`) holds one of `settings`
/// with another value than this rank's (`me`), or lacks it (another
/// build): the configuration error to return.
fn disagreeing_setting(
    settings: &[(&'static str, String)],
    (me, r): (usize, usize),
    field: impl Fn(&str) -> Option<String>,
) -> Option<Error> {
    settings.iter().find_map(|(name, mine)| {
        let theirs = field(&setting_field(name));
        (theirs.as_deref() != Some(mine.as_str())).then(|| Error::Config {
            name: (*name).to_string(),
            value: mine.clone(),
            reason: format!(
                "rank {me} runs with it, rank {r} with {}: every rank must use the same \
                 setting (set it for the whole job, or alike on every rank's builder)",
                theirs
                    .map(|v| format!("{name}={v}"))
                    .unwrap_or_else(|| "an oxccl without this setting".into())
            ),
        })
    })
}

/// Claims `rank` in the store before this process announces itself there:
/// the first claimer of each rank wins, and a second one — a rank of
/// another job that found this job's store on a shared MASTER_PORT, or a
/// second process given the same RANK — is refused here, before it could
/// overwrite the entry the peers read. The error names the holder when
/// its entry is there.
fn claim_rank(store: &dyn Store, rank: usize) -> std::result::Result<LiveClaim, Refused> {
    if store.add(&format!("oxccl/claim/{rank}"), 1)? == 1 {
        return Ok(LiveClaim::new(store.describe(), rank));
    }
    let holder = store.try_get(&rank_key(rank))?.map(|entry| {
        let entry = String::from_utf8_lossy(&entry);
        let pid = entry_field(&entry, "pid").unwrap_or_else(|| "?".into());
        let host = entry_field(&entry, "host").unwrap_or_else(|| "?".into());
        (pid, host)
    });
    if let Some((pid, host)) = &holder {
        if *pid == std::process::id().to_string() && *host == shm::host_identity() {
            if !LiveClaim::is_live(&store.describe(), rank) {
                // The communicator that claimed it is gone: this is its
                // job's store, still up until its rank 0 drops its own.
                return Err(Refused::StaleStore(bootstrap_error(
                    rank,
                    "rendezvous",
                    format!(
                        "the store at {} still belongs to this process's previous \
                         communicator from the same rendezvous (dropped): its rank 0 has \
                         not dropped its own yet",
                        store.describe()
                    ),
                )));
            }
            // Not another job: this process made a communicator from the
            // same rendezvous before and it is still alive (its store, on
            // rank 0, still answers).
            return Err(Refused::Taken(bootstrap_error(
                rank,
                "rendezvous",
                format!(
                    "rank {rank} of the job at {} is already taken by this same process \
                     (pid {pid}): a communicator it made from the same rendezvous is still \
                     alive. Make one communicator per job and split it, drop the first \
                     before making another, or give the second its own MASTER_PORT",
                    store.describe()
                ),
            )));
        }
    }
    let holder = holder
        .map(|(pid, host)| format!("by pid {pid} on host {host}"))
        .unwrap_or_else(|| "by a process that has not announced itself yet".into());
    Err(Refused::Taken(bootstrap_error(
        rank,
        "rendezvous",
        format!(
            "rank {rank} of the job at {} is already taken ({holder}): another job \
             shares this rendezvous address (MASTER_ADDR:MASTER_PORT), or two \
             processes were given RANK={rank}",
            store.describe()
        ),
    )))
}

fn random_token() -> Token {
    use std::io::Read;
    let mut token = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut token));
    if read.is_err() {
        // No /dev/urandom: time and pid still separate concurrent jobs.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        token[..8].copy_from_slice(&(nanos as u64).to_le_bytes());
        token[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    token
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn bootstrap_error(rank: usize, what: &str, detail: impl Into<String>) -> Error {
    Error::Bootstrap {
        context: format!("rank {rank}: {what}"),
        detail: detail.into(),
    }
}

/// Waits for `keys` (one per rank in `ranks`) and turns missing keys into
/// the error that names this rank, the ranks and the `stage` they missed.
fn wait_for_ranks(
    store: &dyn Store,
    (rank, stage): (usize, RendezvousStage),
    ranks: &[usize],
    key: impl Fn(usize) -> String,
    deadline: Instant,
) -> Result<()> {
    let keys: Vec<String> = ranks.iter().map(|&r| key(r)).collect();
    let start = Instant::now();
    let missing = store.wait(&keys, deadline.saturating_duration_since(start))?;
    if missing.is_empty() {
        return Ok(());
    }
    let missing: Vec<usize> = ranks
        .iter()
        .zip(&keys)
        .filter(|(_, k)| missing.contains(k))
        .map(|(&r, _)| r)
        .collect();
    Err(Error::RendezvousTimeout {
        rank,
        store: store.describe(),
        waited: start.elapsed(),
        stage,
        missing,
    })
}

/// Joins the job: rendezvous through the store, then one link per peer.
/// Connects this rank to every other. When every rank is on this host and
/// linked by shared memory, also returns the job's arena segment (mapped by
/// every rank, its name already removed) of `arena_bytes`.
pub(crate) fn connect(setup: Setup) -> Result<(NetEndpoint, Option<Segment>)> {
    let rank = setup.rank;
    connect_rank(setup).map_err(|e| as_ranks_store_error(e, rank, "rendezvous"))
}

fn connect_rank(setup: Setup) -> Result<(NetEndpoint, Option<Segment>)> {
    let Setup {
        rank,
        world,
        mut store,
        timeout,
        transport,
        socket_ifname,
        toward,
        job_id,
        shm_ring_bytes,
        shm_link_stores,
        arena_bytes,
        settings,
        reconnect,
    } = setup;
    let deadline = Instant::now() + timeout;
    let all: Vec<usize> = (0..world).collect();

    // 1. Rank 0 makes the job's token before announcing itself, so the token
    //    exists once rank 0's key does.
    if rank == 0 {
        store.set("oxccl/token", &random_token())?;
    }
    let need_tcp_listener = world > 1;
    let (listener, interface) = if need_tcp_listener {
        let iface = super::iface::select_interface(socket_ifname.as_deref(), toward)?;
        let listener = TcpListener::bind((iface.addr, 0)).map_err(|e| {
            bootstrap_error(
                rank,
                "listening for peers",
                format!("{} ({}): {e}", iface.addr, iface.name),
            )
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| bootstrap_error(rank, "listening for peers", e.to_string()))?;
        (
            Some((listener, addr)),
            Some(format!("{} {}", iface.name, iface.addr)),
        )
    } else {
        (None, None)
    };
    let my_addr = listener
        .as_ref()
        .map(|(_, a)| a.to_string())
        .unwrap_or_else(|| "-".into());
    let host = shm::host_identity();
    // A process that dropped a communicator and makes the next one from the
    // same rendezvous may reach the previous job's store while its rank 0
    // is still dropping: connect again until that store is gone.
    let mut previous_store_seen = false;
    let claim = loop {
        let mut error = match claim_rank(&*store, rank) {
            Ok(claim) => break claim,
            Err(Refused::StaleStore(e)) => {
                previous_store_seen = true;
                e
            }
            // Once the previous store was seen, a store that fails to
            // answer is likelier that one going down (a reset connection)
            // than anything else; a rank another holder has is not.
            Err(Refused::Store(e)) if previous_store_seen => e,
            Err(Refused::Store(e) | Refused::Taken(e)) => return Err(e),
        };
        let Some(reconnect) = &reconnect else {
            return Err(error);
        };
        // Reaching the store may fail too while the previous one closes
        // (a connection accepted into its backlog, then reset).
        store = loop {
            if Instant::now() + STALE_STORE_RETRY >= deadline {
                return Err(error);
            }
            std::thread::sleep(STALE_STORE_RETRY);
            match reconnect(deadline) {
                Ok(store) => break store,
                Err(e) => error = e,
            }
        };
    };
    let mut entry = format!(
        "host={host}\npid={}\naddr={my_addr}\nworld={world}\nkernel={}\ncpus={}\n",
        std::process::id(),
        shm::kernel_identity(),
        cpus::to_field(&cpus::affinity_words())
    );
    for (name, value) in &settings {
        entry.push_str(&format!("{}={value}\n", setting_field(name)));
    }
    store.set(&rank_key(rank), entry.as_bytes())?;

    // 2. Rendezvous: every rank's key, or the list of those that never came.
    //    Rank 0 usually hosts the store, and its exit takes the store down:
    //    it waits a little longer, so that ranks which started with it time
    //    out first and print the list themselves, instead of "lost the store".
    let rendezvous_deadline = if rank == 0 {
        deadline + Duration::from_secs(1)
    } else {
        deadline
    };
    wait_for_ranks(
        &*store,
        (rank, RendezvousStage::Join),
        &all,
        rank_key,
        rendezvous_deadline,
    )?;
    let token: Token = {
        let bytes = store.get(
            "oxccl/token",
            deadline.saturating_duration_since(Instant::now()),
        )?;
        bytes.try_into().map_err(|_| {
            bootstrap_error(
                rank,
                "rendezvous",
                "the job token in the store is malformed",
            )
        })?
    };
    let mut infos = Vec::with_capacity(world);
    for r in 0..world {
        let text = store.try_get(&rank_key(r))?.unwrap_or_default();
        let text = String::from_utf8_lossy(&text);
        let field = |name: &str| entry_field(&text, name);
        // A rank started for another world size belongs to another job
        // (or was started wrongly): say so instead of failing later.
        if let Some(theirs) = field("world").filter(|w| *w != world.to_string()) {
            return Err(after_peers_read(
                rank,
                bootstrap_error(
                    rank,
                    "rendezvous",
                    format!(
                        "rank {r} in the store at {} was started for world size {theirs}, \
                     this rank for {world}: two jobs share this rendezvous address \
                     (MASTER_ADDR:MASTER_PORT), or their WORLD_SIZE differs",
                        store.describe()
                    ),
                ),
            ));
        }
        if let Some(e) = disagreeing_setting(&settings, (rank, r), field) {
            return Err(after_peers_read(rank, e));
        }
        let host = field("host");
        let addr = field("addr");
        let (Some(host), Some(addr)) = (host, addr) else {
            return Err(bootstrap_error(
                rank,
                "rendezvous",
                format!("rank {r}'s entry in the store is malformed"),
            ));
        };
        let addr = if addr == "-" {
            SocketAddr::from(([0, 0, 0, 0], 0))
        } else {
            addr.parse().map_err(|_| {
                bootstrap_error(
                    rank,
                    "rendezvous",
                    format!("rank {r} published a bad address {addr:?}"),
                )
            })?
        };
        // The CPUs it may run on: a hint for waiting, not a contract. An
        // entry without a set this build can read (another build's, with
        // more words) counts as every CPU, which makes nothing look
        // crowded.
        let cpus = field("cpus")
            .and_then(|text| cpus::from_field(&text))
            .unwrap_or([u64::MAX; cpus::AFFINITY_WORDS]);
        // An entry without it (another build's) counts as a kernel of its
        // own host.
        let kernel = field("kernel").unwrap_or_else(|| host.clone());
        infos.push(RankInfo {
            host,
            addr,
            kernel,
            cpus,
        });
    }

    // 3. Which link for each pair.
    let local: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&r| infos[r].host == infos[rank].host)
        .collect();
    let use_shm = |peer: usize| transport != TransportKind::Tcp && local.contains(&peer);
    // More ranks on this rank's kernel (this host, and any containers or
    // namespaces beside it) than the CPUs they may run on together: waits
    // give the core away at once (see `Backoff`).
    // Every kernel's answer, from entries every rank holds alike, so
    // that plans may depend on it (`LinkMap::crowded_together`).
    let index_of = |names: Vec<&str>| -> Vec<usize> {
        let mut seen = HashMap::new();
        names
            .into_iter()
            .map(|name| {
                let next = seen.len();
                *seen.entry(name).or_insert(next)
            })
            .collect()
    };
    let kernel_of = index_of(infos.iter().map(|info| info.kernel.as_str()).collect());
    let kernels = kernel_of.iter().max().map_or(0, |&k| k + 1);
    let crowded_kernel: Vec<bool> = (0..kernels)
        .map(|k| {
            let on_it: Vec<usize> = all.iter().copied().filter(|&r| kernel_of[r] == k).collect();
            on_it.len() > cpus::union_count(on_it.iter().map(|&r| &infos[r].cpus))
        })
        .collect();
    let crowded = crowded_kernel[kernel_of[rank]];
    let links = LinkMap {
        tcp_forced: transport == TransportKind::Tcp,
        host_of: index_of(infos.iter().map(|info| info.host.as_str()).collect()),
        kernel_of,
        crowded_kernel,
    };
    if transport == TransportKind::Shm {
        if let Some(far) = all.iter().find(|&&r| !local.contains(&r)) {
            return Err(Error::Config {
                name: "OXCCL_TRANSPORT".into(),
                value: "shm".into(),
                reason: format!(
                    "rank {far} runs on another host than rank {rank}; shared memory \
                     only links ranks of one host (use auto or tcp)"
                ),
            });
        }
    }
    let mut peers: Vec<Option<Peer>> = (0..world).map(|_| None).collect();
    let new_peer = |link| Peer {
        link,
        out: VecDeque::new(),
        incoming: Incoming::new(),
        gone: None,
        left: HashMap::new(),
        logged: false,
    };

    // 4. Shared memory among local ranks.
    let shm_peers: Vec<usize> = local
        .iter()
        .copied()
        .filter(|&r| r != rank && use_shm(r))
        .collect();
    let mut own_segment = None;
    let mut arena_segment = None;
    if !shm_peers.is_empty() {
        // Names are published through the store, so each rank draws its
        // own: built from the job's token they showed 10 of its 16 bytes to
        // anyone who lists /dev/shm (the token admits connections).
        let naming = random_token();
        let job = job_id
            .as_deref()
            .map(shm::sanitize_job_id)
            .unwrap_or_else(|| hex(&naming[..6]));
        let nonce = hex(&naming[12..16]);
        // Ring `slot(sender, owner)` of `owner`'s inbox carries sender →
        // owner: one ring per *other* local rank, L·(L-1) rings per host.
        let slot = |sender: usize, owner: usize| {
            local
                .iter()
                .filter(|&&x| x != owner)
                .position(|&x| x == sender)
                .unwrap_or(0)
        };
        let name = shm::segment_name(&job, &nonce, rank);
        let mut segment = Segment::create(&name, local.len() - 1, shm_ring_bytes).map_err(|e| {
            bootstrap_error(rank, "creating its shared-memory inbox", e.to_string())
        })?;
        // The arena: rank 0 makes it before announcing its inbox, so it
        // exists once rank 0's key does; it is unlinked with the inboxes.
        let all_on_shm = arena_bytes > 0 && shm_peers.len() + 1 == world;
        let arena_name = format!("{}-arena", shm::segment_name(&job, &nonce, 0));
        // Without one (a full /dev/shm), collectives run over the rings.
        if all_on_shm && rank == 0 {
            match Segment::create_with_region(&arena_name, 0, 4096, arena_bytes) {
                Ok(arena) => {
                    store.set("oxccl/arena", arena_name.as_bytes())?;
                    arena_segment = Some(arena);
                }
                Err(e) => {
                    eprintln!("oxccl: rank 0: no shared arena ({e}); collectives use the rings");
                    store.set("oxccl/arena", b"")?;
                }
            }
        }
        let shm_key = |r: usize| format!("oxccl/shm/{r}");
        store.set(&shm_key(rank), name.as_bytes())?;
        wait_for_ranks(
            &*store,
            (rank, RendezvousStage::ShmInbox),
            &shm_peers,
            shm_key,
            deadline,
        )?;
        if all_on_shm && rank != 0 {
            // Rank 0's name, not ours: job ids may differ between ranks.
            let published = store.try_get("oxccl/arena")?.unwrap_or_default();
            let published = String::from_utf8_lossy(&published).into_owned();
            if !published.is_empty() {
                let arena = Segment::open(&published).map_err(|e| {
                    bootstrap_error(rank, "mapping the shared arena", e.to_string())
                })?;
                arena_segment = Some(arena);
            }
        }
        for &p in &shm_peers {
            let peer_name = store.try_get(&shm_key(p))?.unwrap_or_default();
            let peer_name = String::from_utf8_lossy(&peer_name).into_owned();
            let peer_segment = Segment::open(&peer_name).map_err(|e| {
                bootstrap_error(
                    rank,
                    &format!("mapping rank {p}'s shared-memory inbox"),
                    e.to_string(),
                )
            })?;
            let link = ShmLink::new(
                peer_segment,
                slot(rank, p),
                &segment,
                slot(p, rank),
                shm_link_stores,
            )
            .map_err(|e| bootstrap_error(rank, &format!("linking to rank {p}"), e.to_string()))?;
            peers[p] = Some(new_peer(Link::Shm(link)));
        }
        let mapped_key = |r: usize| format!("oxccl/shm-mapped/{r}");
        store.set(&mapped_key(rank), b"1")?;
        wait_for_ranks(
            &*store,
            (rank, RendezvousStage::ShmMapped),
            &shm_peers,
            mapped_key,
            deadline,
        )?;
        // Every local peer has mapped our inbox: remove its name now, so
        // nothing is left in /dev/shm however this process ends.
        segment.unlink();
        if let Some(arena) = &mut arena_segment {
            arena.unlink();
        }
        own_segment = Some(segment);
    }

    // 5. TCP for the other pairs: connect to lower ranks, accept higher ones.
    let tcp_peers: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&r| r != rank && !use_shm(r))
        .collect();
    if let Some((listener, _)) = &listener {
        for &p in tcp_peers.iter().filter(|&&p| p < rank) {
            let stream = tcp::connect(infos[p].addr, &token, rank, p, deadline)
                .map_err(|e| bootstrap_error(rank, &format!("connecting to rank {p}"), e))?;
            peers[p] = Some(new_peer(Link::Tcp(TcpLink::new(stream))));
        }
        let higher: Vec<usize> = tcp_peers.iter().copied().filter(|&p| p > rank).collect();
        let accepted =
            tcp::accept(listener, &token, rank, &higher, deadline).map_err(|missing| {
                Error::RendezvousTimeout {
                    rank,
                    store: format!("{} (accepting peer connections)", infos[rank].addr),
                    // Since the set-up began (its deadline is `timeout` on).
                    waited: timeout
                        .saturating_sub(deadline.saturating_duration_since(Instant::now())),
                    stage: RendezvousStage::Connect,
                    missing,
                }
            })?;
        for (p, stream) in accepted {
            peers[p] = Some(new_peer(Link::Tcp(TcpLink::new(stream))));
        }
    }
    let interface = if tcp_peers.is_empty() {
        None
    } else {
        interface
    };
    let fabric = Fabric {
        rank,
        buffered: vec![0; peers.len()],
        peers,
        arrived: FrameMap::default(),
        collective_arrivals: CollectiveArrivals::default(),
        left_contexts: HashSet::new(),
        posted: FrameMap::default(),
        consumed: FrameMap::default(),
        entered: FrameMap::default(),
        next_liveness_check: Instant::now(),
        own_segment,
        _store: store,
        _claim: Some(claim),
        interface,
    };
    let endpoint = NetEndpoint {
        links_all_tcp: links.all_tcp(&all),
        crowded_host: links.crowded_together(&all),
        ring_order: links.ring_order(&all),
        shared: Arc::new(NetShared {
            fabric: Mutex::new(fabric),
            aborted: Arc::new(AtomicBool::new(false)),
            endpoints: AtomicUsize::new(1),
            links,
            crowded,
        }),
        ctx: 0,
        members: all,
    };
    Ok((endpoint, arena_segment))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// An endpoint (rank 0 of 2) whose link to rank 1 is a raw socket the
    /// test writes into, as a confused or hostile peer would.
    fn endpoint_with_raw_peer() -> (NetEndpoint, std::net::TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let raw = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        ours.set_nonblocking(true).unwrap();
        let fabric = Fabric {
            rank: 0,
            peers: vec![
                None,
                Some(Peer {
                    link: Link::Tcp(TcpLink::new(ours)),
                    out: VecDeque::new(),
                    incoming: Incoming::new(),
                    gone: None,
                    left: HashMap::new(),
                    logged: false,
                }),
            ],
            arrived: FrameMap::default(),
            collective_arrivals: CollectiveArrivals::default(),
            left_contexts: HashSet::new(),
            posted: FrameMap::default(),
            buffered: vec![0; 2],
            consumed: FrameMap::default(),
            entered: FrameMap::default(),
            next_liveness_check: Instant::now(),
            own_segment: None,
            _store: Arc::new(crate::bootstrap::MemoryStore::new()),
            _claim: None,
            interface: None,
        };
        let endpoint = NetEndpoint {
            shared: Arc::new(NetShared {
                fabric: Mutex::new(fabric),
                aborted: Arc::new(AtomicBool::new(false)),
                endpoints: AtomicUsize::new(1),
                links: LinkMap {
                    tcp_forced: true,
                    host_of: vec![0, 0],
                    kernel_of: vec![0, 0],
                    crowded_kernel: vec![false],
                },
                crowded: false,
            }),
            ctx: 0,
            members: vec![0, 1],
            links_all_tcp: true,
            crowded_host: false,
            ring_order: RingOrder::by_rank(),
        };
        (endpoint, raw)
    }

    impl LinkMap {
        /// A map of ranks on `host_of`'s hosts, one machine each, none
        /// crowded.
        fn on_hosts(tcp_forced: bool, host_of: Vec<usize>) -> LinkMap {
            let machines = host_of.iter().max().map_or(0, |&h| h + 1);
            LinkMap {
                tcp_forced,
                kernel_of: host_of.clone(),
                crowded_kernel: vec![false; machines],
                host_of,
            }
        }
    }

    /// A group is crowded together when all its members run on one crowded
    /// machine: the same answer for every member, whatever its host.
    #[test]
    fn a_group_is_crowded_together_on_one_crowded_machine() {
        let map = LinkMap {
            crowded_kernel: vec![true, false],
            // Ranks 0 and 1 on one host, rank 2 on another of the same
            // crowded machine (a network namespace, say), rank 3 on
            // another machine that reads as the same host (a hostname
            // both share).
            kernel_of: vec![0, 0, 0, 1],
            ..LinkMap::on_hosts(false, vec![0, 0, 1, 0])
        };
        assert!(map.crowded_together(&[0, 1]));
        assert!(map.crowded_together(&[2]));
        assert!(!map.crowded_together(&[0, 2]), "two hosts");
        assert!(!map.crowded_together(&[0, 3]), "two machines");
        assert!(!map.crowded_together(&[3]));
        assert!(!map.crowded_together(&[]));
    }

    /// Which groups of ranks are linked by TCP only, as every rank decides
    /// it from the hosts published at rendezvous: ranks 0 and 1 share a
    /// host, rank 2 has its own.
    #[test]
    fn a_group_is_all_tcp_when_no_two_members_share_a_host() {
        let map = LinkMap::on_hosts(false, vec![0, 0, 1]);
        assert!(map.all_tcp(&[0, 2]));
        assert!(map.all_tcp(&[2, 1]));
        assert!(!map.all_tcp(&[0, 1]));
        assert!(!map.all_tcp(&[0, 1, 2]));
        assert!(!map.all_tcp(&[2]), "one member has no link");
        let forced = LinkMap {
            tcp_forced: true,
            ..map
        };
        assert!(forced.all_tcp(&[0, 1, 2]));
        assert!(forced.all_tcp(&[1]));
    }

    /// The ring stands each host's members together, in the communicator's
    /// own ranks: ranks placed round-robin over two hosts (0, 2, 4 on one,
    /// 1, 3, 5 on the other), the whole job and a sub-group of it.
    #[test]
    fn the_ring_stands_each_hosts_members_together() {
        let map = LinkMap::on_hosts(false, vec![0, 1, 0, 1, 0, 1]);
        let order = map.ring_order(&[0, 1, 2, 3, 4, 5]);
        let ranks: Vec<usize> = (0..6).map(|q| order.rank_at(q)).collect();
        assert_eq!(ranks, [0, 2, 4, 1, 3, 5]);
        assert_eq!(order.position_of(1), 3);
        // Members 5, 2, 1 and 4 (communicator ranks 0–3): hosts 1, 0, 1, 0.
        let sub = map.ring_order(&[5, 2, 1, 4]);
        let ranks: Vec<usize> = (0..4).map(|q| sub.rank_at(q)).collect();
        assert_eq!(ranks, [0, 2, 1, 3]);
        // Already grouped (a launcher per host), or forced onto TCP within
        // one host: rank order.
        let grouped = LinkMap::on_hosts(false, vec![0, 0, 0, 1, 1, 1]);
        assert!(grouped.ring_order(&[0, 1, 2, 3, 4, 5]).is_by_rank());
        let one_host = LinkMap::on_hosts(true, vec![0; 4]);
        assert!(one_host.ring_order(&[3, 1, 0, 2]).is_by_rank());
    }

    fn frame(ctx: u64, seq: u64) -> FrameHeader {
        FrameHeader {
            ctx,
            space: Space::Collective,
            seq,
            step: 0,
            op: OpKind::AllReduce,
            bytes: 8,
            call: 0,
        }
    }

    #[test]
    fn a_sender_running_ahead_is_read_only_so_far_and_every_frame_still_arrives() {
        let (endpoint, raw) = endpoint_with_raw_peer();
        let wait = Duration::from_secs(20);
        // A peer streams 48 MiB of 1 MiB frames, far beyond the read-ahead.
        const FRAMES: u64 = 48;
        let header = |seq: u64| FrameHeader {
            bytes: 1 << 20,
            ..frame(0, seq)
        };
        let writer = {
            let mut raw = raw.try_clone().unwrap();
            std::thread::spawn(move || {
                for seq in 0..FRAMES {
                    raw.write_all(&encode(KIND_DATA, &header(seq))).unwrap();
                    raw.write_all(&vec![seq as u8; 1 << 20]).unwrap();
                }
            })
        };
        let mut seen_most = 0;
        for seq in 0..FRAMES {
            let payload = endpoint.recv(1, &header(seq), wait).unwrap();
            assert!(payload.as_bytes().iter().all(|&b| b == seq as u8));
            // Give the writer time to push more than the read-ahead.
            if seq == 0 {
                std::thread::sleep(Duration::from_millis(300));
            }
            let fabric = endpoint.shared.lock();
            seen_most = seen_most.max(fabric.buffered[1]);
            assert_eq!(
                fabric.buffered[1],
                fabric
                    .arrived
                    .values()
                    .map(|a| a.payload.as_bytes().len())
                    .sum::<usize>()
            );
        }
        writer.join().unwrap();
        // At most the read-ahead plus the frame that crossed it.
        assert!(seen_most <= READ_AHEAD_BYTES + (1 << 20), "{seen_most}");
        drop(raw);
    }

    #[test]
    fn borrowed_frames_still_queued_are_copied_before_their_buffer_goes() {
        let (endpoint, mut raw) = endpoint_with_raw_peer();
        // Far more than the socket takes at once: most of it stays queued.
        let mut data = vec![3u8; 32 << 20];
        let header = FrameHeader {
            bytes: data.len(),
            ..frame(0, 0)
        };
        // SAFETY: `data` is neither written nor dropped before
        // `own_borrowed` below.
        let payload = unsafe { Payload::borrowed(&data) };
        endpoint.send(1, header, payload).unwrap();
        assert!(endpoint.shared.lock().has_queued(1));
        endpoint.own_borrowed();
        // The caller may now reuse its buffer: what goes out is unchanged.
        data.fill(9);
        drop(data);
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; FRAME_HEADER_BYTES + (32 << 20)];
            raw.read_exact(&mut got).unwrap();
            got
        });
        endpoint.flush(Duration::from_secs(20)).unwrap();
        let got = reader.join().unwrap();
        assert!(got[FRAME_HEADER_BYTES..].iter().all(|&b| b == 3));
    }

    /// An exchange in place takes back only the span it is about to
    /// overwrite: the frame borrowing it (queued, perhaps partly written)
    /// becomes an owned copy, the others keep borrowing, and what goes out
    /// is what the buffer held when each frame was sent.
    #[test]
    fn taking_back_a_span_copies_only_the_frames_that_borrow_it() {
        let (endpoint, mut raw) = endpoint_with_raw_peer();
        let half = 16 << 20;
        let mut data = vec![3u8; 2 * half];
        let (first, second) = data.split_at(half);
        for (seq, part) in [first, second].into_iter().enumerate() {
            let header = FrameHeader {
                bytes: half,
                ..frame(0, seq as u64)
            };
            // SAFETY: neither half is written before its frame is owned
            // or written out (below), nor dropped before the flush.
            endpoint
                .send(1, header, unsafe { Payload::borrowed(part) })
                .unwrap();
        }
        let borrowing = |endpoint: &NetEndpoint| {
            let fabric = endpoint.shared.lock();
            let peer = fabric.peers[1].as_ref().unwrap();
            peer.out
                .iter()
                .filter(|o| o.payload.external.is_some())
                .count()
        };
        assert_eq!(borrowing(&endpoint), 2, "both frames still queued, lent");
        let at = data.as_ptr() as usize + half;
        endpoint.own_borrowed_within(at..at + half);
        assert_eq!(borrowing(&endpoint), 1, "only the second half taken back");
        data[half..].fill(9);
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; 2 * (FRAME_HEADER_BYTES + half)];
            raw.read_exact(&mut got).unwrap();
            got
        });
        endpoint.flush(Duration::from_secs(20)).unwrap();
        drop(data);
        let got = reader.join().unwrap();
        let payloads = [
            &got[FRAME_HEADER_BYTES..FRAME_HEADER_BYTES + half],
            &got[2 * FRAME_HEADER_BYTES + half..],
        ];
        assert!(payloads.iter().all(|p| p.iter().all(|&b| b == 3)));
    }

    #[test]
    fn receives_land_in_place_and_a_withdrawn_one_keeps_its_half_frame() {
        let (endpoint, mut raw) = endpoint_with_raw_peer();
        let wait = Duration::from_secs(5);
        let mut header = frame(0, 0);
        header.bytes = 64;
        // A frame that arrives while the receive waits lands in its buffer.
        let writer = {
            let mut raw = raw.try_clone().unwrap();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                raw.write_all(&encode(KIND_DATA, &header)).unwrap();
                raw.write_all(&[5u8; 64]).unwrap();
            })
        };
        let mut dst = [0u8; 64];
        endpoint
            .recv_into(1, &header, wait, &mut dst, None)
            .unwrap();
        writer.join().unwrap();
        assert_eq!(dst, [5u8; 64]);
        // Half a frame, then the receive gives up: what was read moves into
        // a buffer of the fabric's, and the rest completes it later.
        let mut second = frame(0, 1);
        second.bytes = 64;
        raw.write_all(&encode(KIND_DATA, &second)).unwrap();
        raw.write_all(&[9u8; 32]).unwrap();
        let mut gone = [0u8; 64];
        let short = Duration::from_millis(100);
        assert!(matches!(
            endpoint.recv_into(1, &second, short, &mut gone, None),
            Err(TransportError::Timeout(_))
        ));
        assert!(endpoint.shared.lock().posted.is_empty());
        raw.write_all(&[9u8; 32]).unwrap();
        let got = endpoint.recv(1, &second, wait).unwrap();
        assert_eq!(got.as_bytes(), &[9u8; 64]);
    }

    /// A header may claim up to `MAX_FRAME_BYTES`; what the receiver
    /// allocates follows the bytes that came, so a frame claiming 40 GiB
    /// with 100 bytes behind it costs a wait that ends in a timeout, not
    /// an allocation of 40 GiB (which aborts the process where it fails).
    /// A store that refuses everything, as a store server gone wrong would.
    struct RefusingStore;

    impl Store for RefusingStore {
        fn set(&self, key: &str, _: &[u8]) -> Result<()> {
            Err(self.refuse(key))
        }
        fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
            Err(self.refuse(key))
        }
        fn add(&self, key: &str, _: i64) -> Result<i64> {
            Err(self.refuse(key))
        }
        fn wait(&self, keys: &[String], _: Duration) -> Result<Vec<String>> {
            Err(self.refuse(&keys.join(",")))
        }
        fn describe(&self) -> String {
            "refusing".into()
        }
    }

    impl RefusingStore {
        fn refuse(&self, key: &str) -> Error {
            Error::Bootstrap {
                context: "store refusing".into(),
                detail: format!("key {key:?} refused"),
            }
        }
    }

    /// Every rank reports its own rendezvous errors: the store's message
    /// names the store and the key, and the rank is added to it.
    #[test]
    fn a_store_error_at_rendezvous_names_the_rank() {
        let setup = |rank| Setup {
            rank,
            world: 4,
            store: Arc::new(RefusingStore),
            timeout: Duration::from_secs(1),
            transport: TransportKind::Tcp,
            socket_ifname: None,
            toward: None,
            job_id: None,
            shm_ring_bytes: 1 << 16,
            shm_link_stores: shm::LinkStores::Adaptive,
            arena_bytes: 0,
            settings: Vec::new(),
            reconnect: None,
        };
        for rank in [0, 3] {
            let e = connect(setup(rank)).err().unwrap().to_string();
            assert!(
                e.contains(&format!("rank {rank}: rendezvous through store refusing")),
                "{e}"
            );
            assert!(e.contains("refused"), "{e}");
        }
    }

    #[test]
    fn a_frame_claiming_more_than_came_allocates_only_what_came() {
        let (endpoint, mut raw) = endpoint_with_raw_peer();
        let claimed = FrameHeader {
            bytes: 40 << 30,
            ..frame(0, 0)
        };
        raw.write_all(&encode(KIND_DATA, &claimed)).unwrap();
        raw.write_all(&[7u8; 100]).unwrap();
        let expected = frame(0, 0);
        let got = endpoint.recv(1, &expected, Duration::from_millis(300));
        assert!(matches!(got, Err(TransportError::Timeout(_))), "{got:?}");
        let fabric = endpoint.shared.lock();
        let Some(Peer {
            incoming: Incoming::Payload {
                payload, filled, ..
            },
            ..
        }) = &fabric.peers[1]
        else {
            panic!("the frame's payload is being read");
        };
        assert_eq!(*filled, 100);
        assert!(payload.as_bytes().len() <= PAYLOAD_FIRST_BYTES);
    }

    /// A goodbye's length is 16 bytes per context: another is corrupt.
    #[test]
    fn a_goodbye_of_an_impossible_length_is_a_malformed_frame() {
        let mut header = frame(0, 0);
        for bytes in [17, (1 << 20) + 16, 40 << 30] {
            header.bytes = bytes;
            let why = decode(&encode(KIND_GOODBYE, &header)).unwrap_err();
            assert!(why.contains("goodbye"), "{why}");
        }
        header.bytes = 32;
        assert!(decode(&encode(KIND_GOODBYE, &header)).is_ok());
    }

    #[test]
    fn stale_frames_are_reported_not_consumed() {
        let (endpoint, mut raw) = endpoint_with_raw_peer();
        let wait = Duration::from_secs(5);
        raw.write_all(&encode(KIND_DATA, &frame(0, 5))).unwrap();
        raw.write_all(&[7u8; 8]).unwrap();
        let got = endpoint.recv(1, &frame(0, 5), wait).unwrap();
        assert_eq!(got.as_bytes(), &[7u8; 8]);
        // A frame of another context (a split this rank has not made yet)
        // waits unclaimed; a receive in this context does not take it.
        raw.write_all(&encode(KIND_DATA, &frame(99, 0))).unwrap();
        raw.write_all(&[1u8; 8]).unwrap();
        let short = Duration::from_millis(100);
        assert!(matches!(
            endpoint.recv(1, &frame(0, 6), short),
            Err(TransportError::Timeout(_))
        ));
        // A frame older than one already consumed is stale.
        raw.write_all(&encode(KIND_DATA, &frame(0, 3))).unwrap();
        raw.write_all(&[0u8; 8]).unwrap();
        match endpoint.recv(1, &frame(0, 6), wait) {
            Err(TransportError::Mismatch(why)) => {
                assert!(why.contains("stale frame") && why.contains("#3"), "{why}")
            }
            other => panic!("{other:?}"),
        }
        // The foreign-context frame is still there for its own receiver.
        let fabric = endpoint.shared.lock();
        assert!(fabric
            .arrived
            .contains_key(&(1, 99, Space::Collective, 0, 0)));
    }

    #[test]
    fn malformed_frames_mark_the_peer_corrupt() {
        let (endpoint, mut raw) = endpoint_with_raw_peer();
        raw.write_all(&[0xEE; FRAME_HEADER_BYTES]).unwrap();
        match endpoint.recv(1, &frame(0, 0), Duration::from_secs(5)) {
            Err(TransportError::Mismatch(why)) => {
                assert!(why.contains("rank 1 sent malformed frame"), "{why}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_peer_that_closes_without_goodbye_is_lost() {
        let (endpoint, raw) = endpoint_with_raw_peer();
        drop(raw);
        assert!(matches!(
            endpoint.recv(1, &frame(0, 0), Duration::from_secs(5)),
            Err(TransportError::PeerLost { rank: Some(1) })
        ));
    }

    #[test]
    fn headers_round_trip_and_garbage_is_rejected() {
        let h = FrameHeader {
            ctx: 0xdead_beef_0123,
            space: Space::PointToPoint,
            seq: 77,
            step: 5,
            op: OpKind::ReduceScatter,
            bytes: 4096,
            call: 0x5eed_cafe,
        };
        let (kind, back) = decode(&encode(KIND_DATA, &h)).unwrap();
        assert_eq!(kind, KIND_DATA);
        assert_eq!(back, h);
        let mut bad = encode(KIND_DATA, &h);
        bad[0] ^= 1;
        assert!(decode(&bad).unwrap_err().contains("magic"));
        let mut huge = encode(KIND_DATA, &h);
        huge[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode(&huge).is_err());
        let mut op = encode(KIND_DATA, &h);
        op[6] = 200;
        assert!(decode(&op).is_err());
    }

    #[test]
    fn transport_names_parse() {
        assert_eq!(TransportKind::from_name("SHM"), Some(TransportKind::Shm));
        assert_eq!(TransportKind::from_name("tcp"), Some(TransportKind::Tcp));
        assert_eq!(TransportKind::from_name("auto"), Some(TransportKind::Auto));
        assert_eq!(TransportKind::from_name("ib"), None);
    }
}
