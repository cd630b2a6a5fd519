//! Collectives among ranks of one host through one shared region, the
//! *arena*: the intra-node fast path (the CPU counterpart of NCCL's
//! shared-memory/NVLink "direct" and one-shot/two-shot all-reduce).
//!
//! The arena is plain memory every rank maps: a heap allocation shared by
//! the threads of a `local_group`, or one shared-memory segment for ranks in
//! separate processes of one host. It holds, per rank, a control line and a
//! ring of `depth` *slots*. Collectives run in *rounds*, numbered the same on
//! every rank because every rank runs the same calls in the same order:
//!
//! 1. In round `g` a rank writes what its peers need into its slot
//!    `g % depth` and *posts* it: a release store of `g + 1` into the slot's
//!    header, beside the call's sequence number and signature (so a peer that
//!    runs a different call is reported as a mismatch, not misread).
//! 2. Peers wait for that header, then read (and reduce) straight out of the
//!    slot: no frames, no locks, no allocation, one copy on the way in.
//! 3. When it has read everything of round `g` a rank stores `done = g + 1`
//!    (progress for whoever inspects the arena). A rank reuses slot
//!    `g % depth` for round `g + depth` only once every peer has posted
//!    round `g + READ_LAG` (see `begin`): every rank posts every round, and
//!    posts round `r + READ_LAG` only after reading all it needs of round
//!    `r` (the pipelined two-shot all-reduce reads a round until three
//!    rounds later; every other collective until the next).
//!
//! Every reduction folds the ranks' contributions in rank order
//! (`((x0 ⊕ x1) ⊕ x2) ⊕ …`) whatever the algorithm, so all_reduce equals
//! all_gather ∘ reduce_scatter bit for bit and every rank holds the same bits.
//!
//! Waiting spins briefly (a small message costs one cache-line transfer),
//! then yields, then sleeps on a futex that posters wake only when someone
//! sleeps: idle ranks do not burn a core, and more ranks than cores still
//! progress. Every wait has the communicator's deadline and watches for an
//! abort, a peer that left (its communicator dropped) and, across
//! processes, a peer process that died.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::comm::ShmStores;
use crate::error::Result;
use crate::transport::shm::{process_alive, ProcessStamp, Segment};
use crate::transport::{FailureCause, TransportError};
use crate::types::{Element, OpKind, Rank, ReduceOp};

use super::cpus::{self, affinity_words};
use super::executor::CallInfo;
use super::reduce::{finish_avg, fold_two_into_both, Walk};
use super::shared::SharedRegion;
use super::stream;

pub(crate) mod pair_lanes;

/// Bytes of one control line (two cache lines: no false sharing with the
/// adjacent-line prefetcher).
const LINE: usize = 128;
/// Bytes of a slot's header; the payload follows, so a small message and its
/// header share the first cache line.
const SLOT_HEADER: usize = 32;
/// Default bytes per slot, header included (a page past 512 KiB, so slots
/// stay page aligned): the largest one-shot all-reduce, and the two-shot's
/// pipeline piece. Measured against 256 KiB slots, 2 processes: one-shot
/// at 256–512 KiB 7.3–10.4 GB/s against the two-shot's 6.7–8.5; two-shot
/// pieces of 512 KiB as fast or faster from 1 MiB to 64 MiB.
pub(crate) const DEFAULT_SLOT_BYTES: usize = 512 * 1024 + 4096;
/// The pipeline piece of the other staged collectives (reduce-scatter,
/// all-gather, broadcast, reduce, all-to-all): it stays in L2 while it is
/// reduced or copied (reduce-scatter measured slightly slower with 512 KiB).
const STAGED_PIECE_BYTES: usize = 256 * 1024;
/// Slots per rank: a rank may run `DEPTH - READ_LAG` rounds ahead of the
/// slowest. A constant, not a field of [`Geometry`]: `round % DEPTH` is
/// then a multiplication, not a division, in every slot address (several
/// per round; a round of an 8-byte all-reduce is about 0.1 µs).
pub(crate) const DEPTH: usize = 6;
/// Every rank has read all it needs of round `r` once it has posted round
/// `r + READ_LAG`: the pipelined two-shot all-reduce stages piece `t + 1`
/// and folds piece `t` before it copies piece `t − 1` out, so its reads of
/// a round end three rounds later (every other collective reads a round
/// before posting the next). `begin` relies on it to reuse a slot.
const READ_LAG: u64 = 3;

/// Broadcasts of at most this many bytes go through the root's *mailbox*
/// (see [`Arena::mailbox_broadcast`]) instead of a slot round. Measured, 2
/// processes: 8 bytes 0.12 → 0.045 µs, 16 bytes 0.12 → 0.065; 32 and 64
/// bytes (a line or two per message) as fast as a slot round; 4 ranks on
/// 2 cores, 8 bytes 12.9 → 0.17 µs (the root no longer waits).
const MAILBOX_MAX_BYTES: usize = 64;
/// Bytes of each rank's mailbox ring.
const MAILBOX_BYTES: usize = 8 * 1024;
/// One mailbox unit: a tag word, then a payload word.
const MAILBOX_UNIT: usize = 16;
/// Units per mailbox ring.
const MAILBOX_UNITS: u64 = (MAILBOX_BYTES / MAILBOX_UNIT) as u64;
/// A reader tells the root how far it has read each time it crosses a
/// multiple of this many units, not after every message: the root reads
/// that word only when its ring looks full, and a word written once per
/// message would cross between the cores once per message. The root can
/// always write again once a reader has caught up: a caught-up reader has
/// told it a position less than this many units behind.
const MAILBOX_TELL_EVERY: u64 = MAILBOX_UNITS / 4;

/// All-reduces of at most this many bytes run in the *lanes* (see
/// [`Arena::lane_all_reduce`]) where no zero-copy path competes: one
/// round trip, no slot reuse check, the header and the first 40 bytes in
/// one line. Measured against the one-shot (2 processes, near, 6–8
/// alternating pairs): 8 B 0.074 against 0.126 µs, 1 KiB 0.17 against
/// 0.19, 2 KiB 0.29–0.30 against 0.32, 4 KiB 0.48–0.51 against
/// 0.62–0.64; 8 KiB no faster (1.20–1.23 µs either), nor 16 KiB.
const LANE_MAX_BYTES: usize = 4 * 1024;
/// A lane slot's header: posted, seq, signature.
const LANE_HEADER: usize = 24;
/// Bytes of one lane slot: header and payload, in whole [`LINE`]s.
const LANE_SLOT_BYTES: usize = (LANE_HEADER + LANE_MAX_BYTES).next_multiple_of(LINE);
/// Lane slots per rank: a rank alternates between them call by call.
const LANES_PER_RANK: usize = 2;
// Lane call k + 1 reuses the slot of lane call k - 1 (`claim_next_lane`,
// and why no slot-free check is needed: `Arena::lane_all_reduce`).
const _: () = assert!(LANES_PER_RANK == 2);

/// Bytes of a rank's private scratch for the direct paths (in-place
/// prefixes of three ranks or more, streamed blocks): they fold through it
/// this many bytes at a time.
const DIRECT_SCRATCH_BYTES: usize = 256 * 1024;

/// In one process, calls of at least this many bytes (the largest buffer)
/// skip the slots: ranks exchange buffer addresses and read, reduce and
/// write each other's buffers directly (two synchronisations instead of a
/// copy per byte). Below it the one-round staged path is faster. Across
/// processes it runs on `alloc_shared` buffers from here. With more ranks
/// than CPUs it starts later ([`Arena::zero_copy_min_bytes`]).
const ZERO_COPY_MIN_BYTES: usize = 2 * 1024;
/// With more ranks than CPUs ([`Arena::oversubscribed`]), broadcasts of at
/// least this many bytes run zero copy, between threads and across
/// processes on `alloc_shared` buffers; the others from just above the
/// lanes (between threads [`LANE_MAX_BYTES`], across processes on shared
/// buffers [`ZERO_COPY_MIN_BYTES`]).
/// Zero copy ends with every rank waiting for every rank, and each of its
/// two synchronisations needs all of them running; a lane call needs one,
/// and a staged broadcast's root posts and returns. 4 threads on the
/// 2-vCPU Zen 4 VM, µs out of place / in place, zero copy against the
/// lanes or staging, three to six rounds (threads always use cached slot
/// stores):
/// broadcast 4 KiB 8.4–9.2 against 3.0–4.7, 8 KiB 8.3–14.1 against
/// 3.0–4.9, 16 KiB 8.8–14.8 against 4.1–6.4, 32 KiB even (9.5–21.3
/// against 6.3–23.9), zero copy ahead from 40 KiB (10.2–21.5 against
/// 9.7–29.5) to 60 KiB (10.9–13.2 against 10.5–16.3); all-reduce 2 KiB
/// 17.8–18.6 against 6.4–8.9 in the lanes, but 8 KiB 7.4–16.1 against
/// 6.5–11.8 staged, and zero copy ahead from 16 KiB in two rounds of
/// three; reduce-scatter 2 KiB 7.0–15.6 against 3.9–5.1 in the lanes,
/// from 8 KiB either way by round. So those (and reduce, not measured
/// apart) go from the lanes straight to zero copy, with no staged range.
/// 4 processes on `alloc_shared` buffers, four alternating rounds, algbw
/// GB/s out of place / in place, mapped zero copy against staging:
/// broadcast 2 KiB 0.14–0.22 / 0.13–0.22 against 0.49–0.82 / 0.47–0.85,
/// 8 KiB 0.45–0.83 / 0.80–0.87 against 1.65–2.41 / 1.75–2.61, 16 KiB
/// 1.53–1.76 / 1.60–1.76 against 2.67–3.55 / 2.86–4.02; stop 37 saw
/// all-reduce lose by staging (lanes and one-shot 14–27 µs against 12–23
/// zero copy).
const OVERSUBSCRIBED_BROADCAST_ZERO_COPY_MIN_BYTES: usize = 32 * 1024;
/// Across processes, all-gather and broadcast of at least this many bytes
/// read the peers' buffers with one `process_vm_readv` (Linux CMA, as Open
/// MPI's vader does) instead of staging through the slots: one copy and a
/// system call against two copies. Measured, 2 processes, alternating:
/// broadcast 16 KiB 1.70–1.82 → 1.18–1.27 µs out of place (in place
/// 1.58–1.64 → 1.40–1.67), 32 KiB 3.7 → 1.9–2.0; all-gather 16 KiB
/// 1.85–1.92 → 1.38–1.98, 32 KiB 3.4 → 1.8–2.4; at 8 KiB staging is
/// faster (0.85–1.33 against 1.1–1.7 µs).
const CMA_MIN_BYTES: usize = 16 * 1024;
/// With cached slot stores ([`ShmStores::Cached`]) on AMD CPUs, the
/// all-gather output sizes that read by CMA; the others stage, through the
/// cache the cores share. Zen 4 VM, near placement, 2 processes, 3
/// alternating pairs (staged against CMA): 16 KiB 1.42–1.45 against
/// 2.8–4.1 µs, 32 KiB 2.8–3.0 against 3.5–4.8, 64 KiB 5.5 against
/// 5.0–6.3, 128 KiB 10.3–10.4 against 7.9–9.8, 192 KiB 11.7–12.5 against
/// 10.6–13.7, 256 KiB 11.8–13.8 against 13.6–14.0, 512 KiB 18.4–22.6
/// against 27.4–27.8, 1 MiB 38 against 53–58, 4 MiB 160–175 against
/// 214–257. From 16 MiB (where outputs stream, [`stream::STREAM_MIN_BYTES`])
/// staging wins too (stop 29, same VM on kernel 6.18, near pairs, out of
/// place / in place): 16 MiB 1.49–1.89 / 0.85–1.09 ms against 1.42–2.18 /
/// 1.13–1.75, 32 MiB 3.32–3.84 / 2.16–2.84 against 4.2–5.1 / 3.0–4.5,
/// 64 MiB 6.6 / 4.2 against 8.4–8.7 / 6.5–8.0, 128 MiB 13.8–15.0 / 9.0–10.3
/// against 20.1 / 15.0. (Stop 19 had measured the pull ahead at 16 MiB,
/// 1.66–1.71 ms against 1.87 streamed: the pull costs more on this kernel.)
const CACHED_AMD_ALL_GATHER_CMA_BYTES: std::ops::Range<usize> = 64 * 1024..256 * 1024;
/// With cached slot stores on AMD CPUs, broadcasts of these sizes read by
/// CMA (staged outside). Same VM and method: 16 KiB 2.1–2.4 against
/// 3.2–3.4 µs, 24 KiB 3.3–3.4 against 3.6–3.8, 32 KiB even (4.3–4.5),
/// 48 KiB 6.5 against 5.2–5.6, 64 KiB 8.5–9.0 against 6.4–6.6; 256 KiB to
/// 4 MiB in place within each other's spread (stop 29: 4 MiB 144–227
/// against 172–187 µs), and CMA's does not grow when the placement moves
/// far. From 16 MiB staging wins (stop 29, near pairs, in place): 16 MiB
/// 1.07–1.34 against 1.05–1.27 ms (even), 32 MiB 2.36–2.52 against
/// 3.57–4.13, 64 MiB 4.1–4.5 against 6.5–7.6, 128 MiB 9.3 against
/// 13.9–14.8.
const CACHED_AMD_BROADCAST_CMA_BYTES: std::ops::Range<usize> = 32 * 1024..16 << 20;
/// With [`ShmStores::Streaming`], staged pieces of at least this many
/// bytes go into a slot with non-temporal stores; a few lines are not
/// worth a write-combining flush.
const STREAMED_STAGE_MIN_BYTES: usize = 4096;
/// [`ShmStores::Auto`]'s set-up measurement: bytes of one sample, and
/// samples of each kind of store (the fastest counts).
const STORES_PROBE_BYTES: usize = 128 * 1024;
const STORES_PROBE_SAMPLES: usize = 5;
/// With [`ShmStores::Auto`], a call starts with a check once this many
/// rounds, or [`STORES_CHECK_EVERY_BYTES`] of calls, passed since the last
/// one: [`ROUND_TRIP_ROUNDS`] empty rounds (when the ranks watch their
/// round trips) and one round in which each rank says whether its
/// re-measurement is due. A check costs about as much as 18 of the
/// cheapest one-round calls (staged broadcasts of 65 B–2 KiB, 0.12–0.2
/// µs), under 0.5 % of 4096 of them.
const STORES_CHECK_EVERY_ROUNDS: u64 = 4096;
/// Bytes of calls (each call's count times its element size, equal on
/// every rank) after which a call checks even before
/// [`STORES_CHECK_EVERY_ROUNDS`]: rounds alone came every few calls of
/// 64 MiB (16 calls, 0.5 s with cached stores run far), so a placement
/// that moved inside a 1–2 s benchmark process (cached stores set up
/// near, then run far, 3–6× slower) was seldom caught before the process
/// ended. Checks by bytes come every two 64 MiB calls, and at most every
/// few ms for calls of 1 MiB and up; below that rounds come first.
const STORES_CHECK_EVERY_BYTES: u64 = 128 << 20;
/// Empty rounds each check times (and each measurement, for the baseline):
/// the quickest after the first (which absorbs the ranks' arrival skew)
/// is this rank's round trip, one cache line each way plus the round's
/// own work: 80–150 ns with the VM's two vCPUs sharing a cache, 170–400
/// on two dies, microseconds on one CPU. Sixteen timed rounds, not four:
/// the quickest of four read 70–140 ns near, within one placement, so a
/// lucky 70 ns baseline took a later 120 for a move; the quickest of
/// sixteen read 60–100.
const ROUND_TRIP_ROUNDS: usize = 17;
/// A round trip this many times longer or shorter than at the last
/// measurement, at [`ROUND_TRIP_MOVED_CHECKS`] checks in a row, says the
/// ranks' cores moved: the slot stores are measured again at once (a
/// measurement costs 2–3 ms), at most every [`ROUND_TRIP_MIN_SPACING`]
/// after the last one; each move-triggered measurement that kept the mode
/// doubles that spacing, up to [`ROUND_TRIP_MAX_SPACING`] (round trips
/// that keep crossing the line without a move, such as unpinned ranks the
/// scheduler shuffles, cost at most one measurement per that much), and
/// one that changed it starts again from the minimum.
const ROUND_TRIP_CHANGE: f64 = 1.6;
const ROUND_TRIP_MOVED_CHECKS: u32 = 2;
const ROUND_TRIP_MIN_SPACING: Duration = Duration::from_millis(200);
const ROUND_TRIP_MAX_SPACING: Duration = Duration::from_millis(6400);
const _: () = assert!(STORES_PROBE_BYTES <= DEFAULT_SLOT_BYTES - SLOT_HEADER);
/// An in-place broadcast root pushes part of the others' outputs itself
/// from this many bytes: below it a second system call, on the root, costs
/// more than the copy it shares. Measured, 2 processes, in place: 16 KiB
/// 1.37–1.55 µs without the push against 1.43–1.81 with it; 64 KiB
/// 3.1 against 2.5–2.7, 256 KiB 10.2–10.6 against 5.8–6.6.
const BROADCAST_PUSH_MIN_BYTES: usize = 64 * 1024;
/// A zero-copy all-reduce folds and distributes its share in blocks of
/// this many bytes: the folded block stays in L1 (48 KiB here) beside the
/// operands' lines until it is copied to the other outputs. Measured,
/// threads in place: 8 KiB blocks against 32 KiB, 64 KiB–16 MiB
/// 29–42 → 35–47 GB/s (4–16 MiB 23 → 28, the zero-copy ceiling's figure);
/// 64 MiB within 5 %.
const ZERO_COPY_BLOCK_BYTES: usize = 8 * 1024;
/// A posted buffer's place in a shared allocation is one word: the
/// allocation's number + 1 above this many bits, the offset below (user
/// space addresses, and so offsets, stay under 2^47 on x86-64 and
/// aarch64).
const PLACE_OFFSET_BITS: u32 = 48;
const PLACE_OFFSET_MASK: u64 = (1 << PLACE_OFFSET_BITS) - 1;

/// The posted word for offset `at` in allocation `tag` (number + 1), or 0
/// ("not in a shared allocation") when either does not fit.
fn place_word(tag: u64, at: u64) -> u64 {
    if tag >> (64 - PLACE_OFFSET_BITS) != 0 || at > PLACE_OFFSET_MASK {
        return 0;
    }
    tag << PLACE_OFFSET_BITS | at
}

/// Part boundaries of a zero-copy split fall on cache lines, so two ranks
/// never write the same line.
const CACHE_LINE: usize = 64;

const STATE_ALIVE: u64 = 1;
/// Dropped after its calls completed: a rank that will touch the arena no
/// more, and whose part of every call it returned from is in place. Not a
/// failure unless someone still waits on it.
const STATE_DEPARTED: u64 = 2;
/// Its communicator failed (or it was dropped while its thread panicked):
/// it will not take part in any further call. Every rank waiting in the
/// arena reports it (`lost_member`), so one failure stops the whole group
/// with the rank that caused it named, not only its direct peers.
const STATE_FAILED: u64 = 3;

/// What a rank's lane header says in place of a post it took back (see
/// [`Arena::withdraw`]): never `k + 1` for a lane call `k`, so a peer that
/// has not looked yet waits, and finds the rank failed.
const REVOKED_POST: u64 = u64::MAX;

/// A waiter spins for `SPIN`, then keeps spinning but yields the core
/// every `SPIN` (so a peer that shares the core, on a crowded host, runs
/// within microseconds), and sleeps only after `SLEEP_AFTER`. Waking a
/// sleeper takes tens of microseconds on a VM: if waits slept sooner, a
/// woken rank would be late for its peer, which would then sleep too, and
/// the pair would stay in that slow regime. With more ranks than CPUs a
/// waiter yields at once instead (as Open MPI does when oversubscribed):
/// the rank it waits for may need this very core (4 ranks on 2 cores:
/// 8 B all-reduce 8.6 µs spinning, 3.8–4.6 µs yielding at once in most
/// runs; `Arena::probe_oversubscribed`).
const SPIN: Duration = Duration::from_micros(5);
const SLEEP_AFTER: Duration = Duration::from_millis(2);
/// Longest single sleep: liveness, abort and deadline are checked this often.
const SLEEP: Duration = Duration::from_millis(2);
/// How often a waiter checks that peer processes are alive.
const LIVENESS_INTERVAL: Duration = Duration::from_millis(10);

/// One rank's control line, written only by that rank (except `sleepers`).
#[repr(C)]
struct Control {
    /// Rounds this rank has finished reading.
    done: AtomicU64,
    /// Its process id (liveness checks across processes).
    pid: AtomicU64,
    /// [`STATE_ALIVE`] once attached, [`STATE_DEPARTED`] once dropped,
    /// [`STATE_FAILED`] once failed.
    state: AtomicU64,
    /// Bumped (and futex-woken) after a post or `done` store when
    /// `sleepers > 0`; waiters on this rank sleep on it.
    wake: AtomicU32,
    /// Ranks currently asleep waiting on this rank.
    sleepers: AtomicU32,
    /// Once failed: why, when it said ([`encode_cause`]), stored before
    /// the state; 0 otherwise.
    cause: AtomicU64,
    /// Its process's start time ([`ProcessStamp::start`]): with `pid`, what
    /// liveness checks compare, so a reused id is not taken for the rank.
    start: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<Control>() <= LINE);

/// A failure's cause as the word [`Control::cause`] holds: the rank + 1
/// (rank < 2^32), with the top bit set when it was late rather than lost.
fn encode_cause(cause: Option<FailureCause>) -> u64 {
    const LATE: u64 = 1 << 63;
    match cause {
        Some(FailureCause::Lost(r)) => u64::try_from(r).map_or(0, |r| r + 1),
        Some(FailureCause::Late(r)) => u64::try_from(r).map_or(0, |r| (r + 1) | LATE),
        None => 0,
    }
}

/// The cause [`encode_cause`] wrote (peer-written: a rank outside the
/// world reads as none).
fn decode_cause(word: u64, world: usize) -> Option<FailureCause> {
    const LATE: u64 = 1 << 63;
    let rank = usize::try_from((word & !LATE).checked_sub(1)?).ok()?;
    (rank < world).then_some(if word & LATE != 0 {
        FailureCause::Late(rank)
    } else {
        FailureCause::Lost(rank)
    })
}

/// The header at the start of every slot.
#[repr(C)]
struct SlotHeader {
    /// `g + 1` once round `g`'s contents are in place.
    posted: AtomicU64,
    /// The call's sequence number.
    seq: AtomicU64,
    /// The call's signature (operation, type, operator, root, count).
    signature: AtomicU64,
    _reserved: AtomicU64,
}

/// The header of a lane slot (see [`Arena::lane_all_reduce`]); the
/// payload follows it, 8-byte aligned.
#[repr(C)]
struct LaneHeader {
    /// `k + 1` once the rank's lane call `k` has its payload in place.
    posted: AtomicU64,
    /// The call's sequence number.
    seq: AtomicU64,
    /// The call's signature.
    signature: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<LaneHeader>() == LANE_HEADER);

/// The arena's geometry, equal on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub world: usize,
    pub slot_bytes: usize,
}

impl Geometry {
    pub fn new(world: usize) -> Geometry {
        Geometry {
            world,
            slot_bytes: DEFAULT_SLOT_BYTES,
        }
    }

    /// Total bytes of the region.
    pub fn bytes(&self) -> usize {
        self.pair_lanes_offset() + pair_lanes::region_bytes(self.world)
    }

    /// Where the pair lanes start (page aligned, after the slots; see
    /// [`pair_lanes`]).
    fn pair_lanes_offset(&self) -> usize {
        (self.slots_offset() + self.world * DEPTH * self.slot_bytes).next_multiple_of(4096)
    }

    /// Where the mailbox read positions start: per reader, one line-aligned
    /// row of `world` words (how far it has read each root's mailbox),
    /// written only by that reader.
    fn read_positions_offset(&self) -> usize {
        self.world * LINE
    }

    /// Bytes of one reader's row of read positions.
    fn read_positions_stride(&self) -> usize {
        (self.world * 8).next_multiple_of(LINE)
    }

    /// Where the lanes start: per rank, [`LANES_PER_RANK`] lane slots of
    /// [`LANE_SLOT_BYTES`] (line aligned).
    fn lanes_offset(&self) -> usize {
        self.read_positions_offset() + self.world * self.read_positions_stride()
    }

    /// Where the mailbox rings start (one per rank, page aligned).
    fn mailboxes_offset(&self) -> usize {
        (self.lanes_offset() + self.world * LANES_PER_RANK * LANE_SLOT_BYTES).next_multiple_of(4096)
    }

    fn slots_offset(&self) -> usize {
        self.mailboxes_offset() + self.world * MAILBOX_BYTES
    }

    /// Payload bytes of one slot.
    fn payload_bytes(&self) -> usize {
        self.slot_bytes - SLOT_HEADER
    }
}

/// The memory behind an arena.
enum Memory {
    /// Threads of one process: a zeroed, page-aligned heap block.
    Heap {
        base: *mut u8,
        layout: std::alloc::Layout,
    },
    /// Processes of one host: a mapped shared-memory segment.
    Shm(Segment),
}

// SAFETY: the memory is only ever accessed through atomics (control words,
// slot headers) or under the round protocol, which gives every byte range
// one writer at a time and orders it before its readers.
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl Memory {
    fn base(&self) -> *mut u8 {
        match self {
            Memory::Heap { base, .. } => *base,
            Memory::Shm(segment) => segment.region().0,
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        if let Memory::Heap { base, layout } = self {
            // SAFETY: allocated in `Arena::local_group` with this layout.
            unsafe { std::alloc::dealloc(*base, *layout) };
        }
    }
}

/// A zeroed, page-aligned heap block for the arena of threads; `None` when
/// the system will not give that much (a group of very many threads).
fn heap_memory(geometry: Geometry) -> Option<Arc<Memory>> {
    let layout = std::alloc::Layout::from_size_align(geometry.bytes(), 4096).ok()?;
    // SAFETY: the layout has a non-zero size.
    let base = unsafe { std::alloc::alloc_zeroed(layout) };
    (!base.is_null()).then(|| Arc::new(Memory::Heap { base, layout }))
}

/// What a call told the arena about itself (for headers and errors).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallSig {
    pub seq: u64,
    pub signature: u64,
}

/// One rank's handle on an arena.
/// Every rank's input and output address for one zero-copy call, in lists
/// kept from call to call so that a call allocates nothing: refilled at
/// the start of each call, never read after it.
#[derive(Default)]
struct PeerBuffers {
    inputs: Vec<*const u8>,
    outputs: Vec<*mut u8>,
}

// SAFETY: plain addresses, dereferenced only inside the call that filled
// them, on the thread that runs it.
unsafe impl Send for PeerBuffers {}

/// One of this rank's shared allocations as the zero-copy path reads it:
/// its number and addresses, copied when it was allocated, so that a call
/// locates and translates buffers without touching the region's reference
/// counts (an upgrade of a `Weak` and its drop are two atomic
/// read-modify-writes; a two-rank call made four pairs, 5 % of a 64 KiB
/// call across processes).
///
/// The copies are plain numbers; using them as addresses needs the region
/// alive, and a call uses only a region that holds one of its own
/// buffers: the caller borrows that buffer, hence the region, for the
/// whole call. A dead region's address range may be reused by other
/// memory, so `locate` skips entries whose region died
/// ([`alive`](Self::alive), a relaxed load of the strong count, which
/// never rises from 0): the count reached 0 before the region was
/// unmapped, the unmapping (a system call) came before any reuse, and the
/// reuse before the caller made its slice.
struct SharedEntry {
    region: Weak<SharedRegion>,
    id: u64,
    own: usize,
    bytes: usize,
    maps: Vec<*mut u8>,
}

impl SharedEntry {
    fn of(region: &Arc<SharedRegion>) -> SharedEntry {
        SharedEntry {
            region: Arc::downgrade(region),
            id: region.id,
            own: region.own as usize,
            bytes: region.bytes,
            maps: region.maps.clone(),
        }
    }

    fn alive(&self) -> bool {
        self.region.strong_count() > 0
    }

    /// Whether `[ptr, ptr + len)` lies in this rank's block; its offset if so.
    fn offset_of(&self, ptr: *const u8, len: usize) -> Option<usize> {
        let at = ptr as usize;
        (at >= self.own && at + len <= self.own + self.bytes).then(|| at - self.own)
    }
}

impl PeerBuffers {
    /// The inputs as `T` pointers.
    fn inputs<T>(&self) -> &[*const T] {
        // SAFETY: `*const u8` and `*const T` have one size and alignment.
        unsafe { std::slice::from_raw_parts(self.inputs.as_ptr().cast(), self.inputs.len()) }
    }

    /// The outputs as `T` pointers.
    fn outputs<T>(&self) -> &[*mut T] {
        // SAFETY: as for `inputs`.
        unsafe { std::slice::from_raw_parts(self.outputs.as_ptr().cast(), self.outputs.len()) }
    }
}

pub(crate) struct Arena {
    memory: Arc<Memory>,
    /// `memory.base()`, kept: every address in the arena starts from it,
    /// and a segment computes it (a multiply and three loads).
    base: *mut u8,
    geometry: Geometry,
    /// `geometry.slots_offset()`, kept: every slot address needs it.
    slots_offset: usize,
    rank: Rank,
    /// The next round (identical on every rank between calls).
    round: u64,
    /// Rounds below this one have had every peer's header compared with
    /// this rank's (see [`compare_round`](Self::compare_round)): by
    /// `begin`, `READ_LAG` rounds after they ran, or by the next lane call
    /// (`compare_recent_rounds`) when no staged round followed.
    rounds_compared: u64,
    /// `geometry.lanes_offset()`, kept like `slots_offset`.
    lanes_offset: usize,
    /// The next lane call (identical on every rank between calls, like
    /// `round`).
    lane_calls: u64,
    /// The largest all-reduce (bytes) that runs in the lanes: below
    /// [`ZERO_COPY_MIN_BYTES`] where zero copy may run from there
    /// (threads, unless oversubscribed; processes once `alloc_shared`
    /// ran), else [`LANE_MAX_BYTES`]. Equal on every rank.
    lane_max_bytes: usize,
    /// Peer process ids to watch (`None` for threads of this process).
    watch_pids: bool,
    aborted: Arc<AtomicBool>,
    timeout: Duration,
    /// How long a wait spins before yielding, and between yields: [`SPIN`],
    /// or nothing when the ranks outnumber the CPUs they may run on (see
    /// [`oversubscribed`](Self::oversubscribed)).
    spin: Duration,
    /// Whether this rank may read peers' memory with `process_vm_readv`
    /// (probed at set-up; Linux CMA, which containers or Yama may forbid).
    cma: bool,
    /// Whether staged pieces go into the slots with non-temporal stores
    /// ([`ShmStores::Streaming`], decided at set-up and by each
    /// re-measurement; equal on every rank).
    streaming_slots: bool,
    /// What the last measurement for [`ShmStores::Auto`] found: the ranks'
    /// summed best times, in ns, to push a slot's worth through the slot
    /// ring with cached and with streaming stores (`None` when a mode was
    /// forced, or threads).
    stores_probe: Option<(u64, u64)>,
    /// Whether calls check, every [`STORES_CHECK_EVERY_ROUNDS`] or
    /// [`STORES_CHECK_EVERY_BYTES`], if the slot stores are due to be
    /// measured again (equal on every rank: no rank forced a mode).
    stores_checks: bool,
    /// The round from which the next call checks, and the bytes of calls
    /// since the last check (both equal on every rank).
    next_stores_check: u64,
    stores_unchecked_bytes: u64,
    /// Whether every rank keeps a round-trip baseline (agreed at each
    /// measurement): only then do checks time round trips.
    round_trips_watched: bool,
    /// How long after a measurement a changed round trip may ask for the
    /// next one (see [`ROUND_TRIP_MIN_SPACING`]).
    move_spacing: Duration,
    /// This rank's re-measurement interval; rank 0's rules.
    stores_remeasure: Option<Duration>,
    /// When the slot stores were last measured, and how many times.
    stores_measured_at: Instant,
    stores_measurements: u32,
    /// This rank's round trip (see [`ROUND_TRIP_ROUNDS`]) timed right
    /// after the last measurement, against which each check's is compared.
    round_trip_watch: RoundTripWatch,
    /// How many of the measurements a changed round trip caused.
    stores_moves: u32,
    /// This rank's shared allocations (`alloc_shared`), while they live.
    shared: Vec<SharedEntry>,
    /// Every allocation's bytes per rank, by number, those this rank has
    /// dropped too (`None`: its `alloc_shared` failed). Equal on every rank
    /// (allocation is collective), unlike `shared`, which each rank prunes
    /// as it drops its handles: the zero-copy decision checks peers' places
    /// against this, so that every rank decides alike (a root's reduce
    /// output may lie in an allocation the others dropped).
    allocation_bytes: Vec<Option<usize>>,
    /// Whether `alloc_shared` ever ran on this communicator: from then on
    /// large calls across processes first exchange where their buffers
    /// are, to run zero-copy when every rank's are in one allocation.
    /// Equal on every rank (allocation is collective).
    shared_ever: bool,
    /// The next allocation's number.
    next_shared: u64,
    /// The peers' buffer addresses of the current zero-copy call.
    peer_buffers: PeerBuffers,
    /// Whether the CPU has PREFETCHW (see `claim_next_lane`).
    #[cfg(target_arch = "x86_64")]
    prefetch_for_write: bool,
    /// This rank's scratch for the direct paths (see [`Arena::scratch`]);
    /// empty until a call needs it.
    direct_scratch: Vec<u64>,
    /// How the current direct call reaches the peers' buffers.
    direct: Direct,
    /// Whether the current zero-copy broadcast has its root write every
    /// other rank's whole output: some rank off the root posted no buffer
    /// in the allocation of the root's input, so it may not have it mapped
    /// (see [`Arena::all_in_one_allocation`]).
    root_pushes_all: bool,
    /// How the last call that could go direct went (`None`: staged).
    last_direct: Option<Direct>,
    /// Per root, the unit its next mailbox message starts at (identical
    /// on every rank between calls, like `round`).
    mailbox_next: RankWords,
    /// This rank's positions in its pair lanes (see [`pair_lanes`]).
    pairs: pair_lanes::Positions,
    /// As root: the unit up to which this rank's mailbox may be written
    /// without overwriting what a reader has not read, from the last look
    /// at the readers' positions.
    mailbox_room: u64,
}

// SAFETY: `base` points into `memory`, which the arena keeps alive and
// which may be used from any thread (see `Memory`); `shared` holds
// addresses of mappings that `SharedRegion`s own (Send and Sync) and that
// are used only while a caller's buffer keeps them alive (`SharedEntry`);
// the rest is owned data.
unsafe impl Send for Arena {}

/// Whose loss ends a wait (see [`Arena::wait_within`]).
#[derive(Clone, Copy)]
enum Watched {
    /// Any member's: a collective needs them all.
    Group,
    /// The awaited peer's.
    Peer,
}

/// One word per rank, in cache lines of their own: ranks that are threads
/// of one process allocate such small vectors next to each other, and a
/// line that two of them write on every call would cross between their
/// cores on every call (measured: an 8-byte broadcast between threads took
/// 0.12 µs with a plain `Vec`, 0.04–0.05 µs with this).
struct RankWords(Vec<WordLine>);

#[repr(C, align(128))]
#[derive(Clone, Copy)]
struct WordLine([u64; 16]);

impl RankWords {
    fn new(world: usize) -> RankWords {
        RankWords(vec![WordLine([0; 16]); world.div_ceil(16)])
    }
}

impl std::ops::Index<Rank> for RankWords {
    type Output = u64;
    fn index(&self, rank: Rank) -> &u64 {
        &self.0[rank / 16].0[rank % 16]
    }
}

impl std::ops::IndexMut<Rank> for RankWords {
    fn index_mut(&mut self, rank: Rank) -> &mut u64 {
        &mut self.0[rank / 16].0[rank % 16]
    }
}

/// How a direct (zero-copy / single-copy) call reaches peers' buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direct {
    /// Same address space (threads): posted addresses are used as they are.
    Local,
    /// Every rank's buffers lie in one `alloc_shared` allocation, which
    /// this process maps: posted (allocation, offset) pairs are translated.
    Mapped,
    /// Other processes' private memory: `process_vm_readv`/`writev` (CMA).
    Cma,
}

impl Arena {
    /// Arenas for `n` threads of one process (element `i` is rank `i`);
    /// `None` when their memory cannot be had. `oversubscribed`: whether
    /// the threads outnumber the CPUs they share (`local_group` decides,
    /// [`cpus::threads_outnumber_cpus`]).
    pub fn local_group(
        n: usize,
        aborted: Arc<AtomicBool>,
        timeout: Duration,
        oversubscribed: bool,
    ) -> Option<Vec<Arena>> {
        let geometry = Geometry::new(n);
        let memory = heap_memory(geometry)?;
        let arenas = (0..n)
            .map(|rank| {
                let mut arena = Arena::attach(
                    memory.clone(),
                    geometry,
                    rank,
                    false,
                    aborted.clone(),
                    timeout,
                );
                if oversubscribed {
                    arena.mark_oversubscribed();
                }
                arena
            })
            .collect();
        Some(arenas)
    }

    /// This process's handle on a shared segment made by
    /// [`crate::transport::net`] for an all-local world, once every rank
    /// has attached and probed whether it may read the others' memory
    /// directly (CMA). The segment's region must be at least
    /// `geometry.bytes()` long and zeroed.
    ///
    /// # Errors
    ///
    /// A timeout naming the rank that did not attach.
    pub fn shared(
        segment: Segment,
        geometry: Geometry,
        rank: Rank,
        aborted: Arc<AtomicBool>,
        timeout: Duration,
        stores: ShmStores,
    ) -> Result<Arena> {
        // Its header came from another process: a segment too small for
        // this world's arena (another build of oxccl on rank 0, a rewritten
        // header, a name that is not the arena) would be used past its end.
        if segment.region().1 < geometry.bytes() {
            return Err(crate::error::Error::Bootstrap {
                context: format!("rank {rank}: the shared arena {}", segment.name()),
                detail: format!(
                    "it holds {} bytes after its rings, and an arena of {} ranks needs {}; \
                     are all ranks the same build of oxccl?",
                    segment.region().1,
                    geometry.world,
                    geometry.bytes()
                ),
            });
        }
        let mut arena = Arena::attach(
            Arc::new(Memory::Shm(segment)),
            geometry,
            rank,
            true,
            aborted,
            timeout,
        );
        arena.cma = arena.probe_cma()?;
        if arena.probe_oversubscribed()? {
            arena.mark_oversubscribed();
        }
        arena.probe_stores(stores, None)?;
        Ok(arena)
    }

    /// The call and signature of the set-up rounds. Errors name the call
    /// `init #0` (the communicator's set-up, as the user called it; they
    /// named a "barrier #18446744073709551615" nobody called); the rounds'
    /// own sequence number stays out of the users' range.
    fn setup_call(&self, magic: u64) -> (CallInfo, CallSig) {
        let call = CallInfo {
            op: OpKind::Init,
            seq: 0,
            space: crate::transport::Space::Collective,
            ctx: 0,
            rank: self.rank,
            world: self.world(),
            reduce_op: ReduceOp::Sum,
            timeout: self.timeout,
            digest: 0,
        };
        let sig = CallSig {
            seq: u64::MAX,
            signature: magic,
        };
        (call, sig)
    }

    /// Decides [`streaming_slots`](Self::streaming_slots) with every rank.
    /// A first round shares every rank's setting: the lowest rank that
    /// forced a mode decides for all. Otherwise every rank measures (for
    /// [`ShmStores::Auto`]), samples alternating: every rank fills its slot
    /// with one kind of store and then (all at once, as a staged
    /// all-gather does) copies its successor's slot out, round after round
    /// around the slot ring, timing the second pass (a cold ring, whose
    /// lines no peer holds, is fast either way); a last round shares the
    /// best times, and all pick streaming when the summed streaming time
    /// is at least a fifth below the cached one.
    /// `during`: the user's call it runs in, when it measures again (see
    /// [`maybe_remeasure_stores`](Self::maybe_remeasure_stores)).
    fn probe_stores(&mut self, preference: ShmStores, during: Option<&CallInfo>) -> Result<()> {
        const MAGIC: u64 = 0x0cca_5707_0000_0000;
        let (call, sig) = self.stores_call(during, MAGIC);
        let world = self.world();
        let setting = match preference {
            ShmStores::Cached => 1,
            ShmStores::Streaming => 2,
            _ => 0,
        };
        let settings = self.share_words(&call, &sig, [setting])?;
        self.stores_remeasure = match preference {
            ShmStores::Auto { remeasure } => remeasure,
            _ => None,
        };
        if let Some([forced]) = settings.into_iter().find(|&[s]| s != 0) {
            self.streaming_slots = forced == 2;
            self.stores_probe = None;
            self.stores_checks = false;
            return Ok(());
        }
        if world == 1 {
            self.streaming_slots = false;
            return Ok(());
        }
        let mut best = [u64::MAX; 2];
        let pattern: Vec<u8> = (0..STORES_PROBE_BYTES).map(|i| i as u8).collect();
        let mut landing = vec![0u8; STORES_PROBE_BYTES];
        let successor = (self.rank + 1) % world;
        let depth = DEPTH;
        for _ in 0..STORES_PROBE_SAMPLES {
            for (kind, streaming) in [false, true].into_iter().enumerate() {
                // Two passes over the slot ring; the second is timed, when
                // every slot's lines were last read by a peer, as in a run
                // of staged calls.
                let mut start = Instant::now();
                for round in 0..2 * depth {
                    if round == depth {
                        start = Instant::now();
                    }
                    let g = self.begin(&call)?;
                    // SAFETY: the slot's payload holds more than the
                    // probe's bytes (asserted at compile time); the
                    // successor's slot of round g is posted when read.
                    unsafe {
                        copy_out(
                            streaming,
                            pattern.as_ptr(),
                            self.payload::<u8>(self.rank, g),
                            STORES_PROBE_BYTES,
                        );
                        self.post(g, &sig);
                        self.await_all(&call, &sig, g)?;
                        std::ptr::copy_nonoverlapping(
                            self.payload::<u8>(successor, g),
                            landing.as_mut_ptr(),
                            STORES_PROBE_BYTES,
                        );
                    }
                    self.finish(g);
                }
                let took = start.elapsed().as_nanos() / depth as u128;
                best[kind] = best[kind].min(took.min(u64::MAX as u128) as u64);
            }
        }
        std::hint::black_box(&landing);
        // With more local ranks than the host has CPUs online (not this
        // process's affinity: a launcher may pin each rank to one) round
        // trips wait for the scheduler and say nothing about placement.
        // Each rank says whether it could watch; all watch only if all can,
        // so every rank runs the same rounds in a check.
        // SAFETY: sysconf has no preconditions.
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        let can_watch = u64::from(world as libc::c_long <= cpus);
        let times = self.share_words(&call, &sig, [best[0], best[1], can_watch])?;
        let summed = |i: usize| times.iter().fold(0u64, |sum, t| sum.saturating_add(t[i]));
        let (cached, streaming) = (summed(0), summed(1));
        self.streaming_slots = streaming.saturating_mul(5) < cached.saturating_mul(4);
        self.stores_probe = Some((cached, streaming));
        self.stores_checks = true;
        self.round_trips_watched = times.iter().all(|t| t[2] == 1);
        self.round_trip_watch = if self.round_trips_watched {
            RoundTripWatch::from(Some(self.time_round_trip(&call, &sig)?))
        } else {
            RoundTripWatch::from(None)
        };
        self.next_stores_check = self.round + STORES_CHECK_EVERY_ROUNDS;
        self.stores_unchecked_bytes = 0;
        self.stores_measured_at = Instant::now();
        self.stores_measurements += 1;
        Ok(())
    }

    /// [`ROUND_TRIP_ROUNDS`] empty rounds; the quickest after the first,
    /// in ns.
    fn time_round_trip(&mut self, call: &CallInfo, sig: &CallSig) -> Result<u64> {
        let mut quickest = u64::MAX;
        for i in 0..ROUND_TRIP_ROUNDS {
            let start = Instant::now();
            let g = self.begin(call)?;
            self.post(g, sig);
            self.await_all(call, sig, g)?;
            self.finish(g);
            if i > 0 {
                let took = start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
                quickest = quickest.min(took);
            }
        }
        Ok(quickest)
    }

    /// One round in which every rank posts `words` and reads everyone's
    /// (element `p` is rank `p`'s): how set-up rounds agree.
    fn share_words<const N: usize>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        words: [u64; N],
    ) -> Result<Vec<[u64; N]>> {
        let g = self.begin(call)?;
        let slot = self.payload::<u64>(self.rank, g);
        // SAFETY: the payload holds far more than N words (N is small).
        unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), slot, N) };
        self.post(g, sig);
        self.await_all(call, sig, g)?;
        let all = (0..self.world())
            .map(|p| {
                let mut theirs = [0u64; N];
                // SAFETY: every slot of round g is posted.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.payload::<u64>(p, g), theirs.as_mut_ptr(), N)
                };
                theirs
            })
            .collect();
        self.finish(g);
        Ok(all)
    }

    /// The call and signature of rounds that measure the slot stores: the
    /// set-up's, or, inside a user's call, that call (so that an error
    /// names it) under the measurement's own signature.
    fn stores_call(&self, during: Option<&CallInfo>, magic: u64) -> (CallInfo, CallSig) {
        match during {
            None => self.setup_call(magic),
            Some(c) => (
                CallInfo {
                    op: c.op,
                    seq: c.seq,
                    space: c.space,
                    ctx: c.ctx,
                    rank: c.rank,
                    world: c.world,
                    reduce_op: c.reduce_op,
                    timeout: c.timeout,
                    digest: c.digest,
                },
                CallSig {
                    seq: c.seq,
                    signature: magic,
                },
            ),
        }
    }

    /// Called before every call in the arena, with the call's `bytes`
    /// (its count times its element size): once
    /// [`STORES_CHECK_EVERY_ROUNDS`] rounds or [`STORES_CHECK_EVERY_BYTES`]
    /// of calls passed (when the slot stores are measured, not forced),
    /// every rank times its round trip ([`ROUND_TRIP_ROUNDS`] empty rounds,
    /// when all watch them), and one round shares whether rank 0's
    /// re-measurement interval has passed and whether any rank's round
    /// trip changed by [`ROUND_TRIP_CHANGE`] since the last measurement,
    /// at [`ROUND_TRIP_MOVED_CHECKS`] checks in a row (its cores moved:
    /// which mode wins may have changed, and a 30 s interval would run
    /// whole benchmarks in the wrong one); if either, every rank measures
    /// again ([`probe_stores`](Self::probe_stores)). Every rank reaches the
    /// same rounds and the same calls, so all check at the same call and
    /// decide alike from the shared words. A rank with `auto:0` never asks.
    pub fn maybe_remeasure_stores(&mut self, during: &CallInfo, bytes: usize) -> Result<()> {
        if !self.stores_checks {
            return Ok(());
        }
        self.stores_unchecked_bytes = self.stores_unchecked_bytes.saturating_add(bytes as u64);
        if self.round < self.next_stores_check
            && self.stores_unchecked_bytes < STORES_CHECK_EVERY_BYTES
        {
            return Ok(());
        }
        const MAGIC: u64 = 0x0cca_5707_c4ec_0000;
        const INTERVAL: u64 = 1;
        const MOVED: u64 = 2;
        self.next_stores_check = self.round + STORES_CHECK_EVERY_ROUNDS;
        self.stores_unchecked_bytes = 0;
        let (call, sig) = self.stores_call(Some(during), MAGIC);
        let since = self.stores_measured_at.elapsed();
        let moved = if self.round_trips_watched {
            let round_trip = self.time_round_trip(&call, &sig)?;
            self.stores_remeasure.is_some()
                && self.round_trip_watch.moved(round_trip)
                && since >= self.move_spacing
        } else {
            false
        };
        let interval = self.rank == 0 && self.stores_remeasure.is_some_and(|every| since >= every);
        let mine = if interval { INTERVAL } else { 0 } | if moved { MOVED } else { 0 };
        let words = self.share_words(&call, &sig, [mine])?;
        let asked = words.iter().fold(0, |all, [w]| all | w);
        if asked != 0 {
            let preference = ShmStores::Auto {
                remeasure: self.stores_remeasure,
            };
            let before = self.streaming_slots;
            self.probe_stores(preference, Some(during))?;
            if asked & MOVED != 0 {
                self.stores_moves += 1;
                self.move_spacing =
                    next_move_spacing(self.move_spacing, self.streaming_slots == before);
            }
        }
        Ok(())
    }

    /// Whether the ranks are processes (not threads of one process).
    pub fn across_processes(&self) -> bool {
        self.watch_pids
    }

    /// How this arena writes staged data, for reports: `cached` or
    /// `streaming`, and how often it measured and what it found the last
    /// time; and whether its waits yield at once (more ranks than CPUs).
    pub fn stores_description(&self) -> String {
        let stores = self.slot_stores_description();
        if self.oversubscribed() {
            format!(
                "{stores}; waits yield at once ({} ranks, fewer CPUs)",
                self.world()
            )
        } else {
            stores
        }
    }

    fn slot_stores_description(&self) -> String {
        let mode = if self.streaming_slots {
            "streaming"
        } else {
            "cached"
        };
        match self.stores_probe {
            Some((cached, streaming)) => format!(
                "{mode} slot stores (measured {} time{}{}, last: {} KiB through a slot in {:.1} µs cached, {:.1} µs streamed)",
                self.stores_measurements,
                if self.stores_measurements == 1 { "" } else { "s" },
                match self.stores_moves {
                    0 => String::new(),
                    moves => format!(", {moves} after the round trip changed"),
                },
                STORES_PROBE_BYTES / 1024,
                cached as f64 / 1e3 / self.world() as f64,
                streaming as f64 / 1e3 / self.world() as f64,
            ),
            None => format!("{mode} slot stores"),
        }
    }

    /// Two set-up rounds: each rank publishes the address of a word of
    /// its slot, tries to read every peer's with `process_vm_readv`, then
    /// all learn whether every rank could. The same answer on every rank.
    fn probe_cma(&mut self) -> Result<bool> {
        const MAGIC: u64 = 0x0cca_0000_0000_0000;
        let (call, sig) = self.setup_call(MAGIC);
        let g = self.begin(&call)?;
        let slot = self.payload::<u64>(self.rank, g);
        // SAFETY: the payload holds far more than two words.
        unsafe {
            slot.write(slot.add(1) as usize as u64);
            slot.add(1).write(MAGIC + self.rank as u64);
        }
        self.post(g, &sig);
        self.await_all(&call, &sig, g)?;
        let mut ok = true;
        for p in (0..self.world()).filter(|&p| p != self.rank) {
            // SAFETY: posted in round g.
            let remote = unsafe { self.payload::<u64>(p, g).read() } as usize as *const u8;
            let mut word = 0u64;
            let read = cma_read(self.peer_pid(p), remote, (&mut word as *mut u64).cast(), 8);
            ok &= read.is_ok() && word == MAGIC + p as u64;
        }
        self.finish(g);
        let all = self.share_words(&call, &sig, [u64::from(ok)])?;
        Ok(all.iter().all(|&[ok]| ok == 1))
    }

    /// Whether the ranks outnumber the CPUs they may run on together (the
    /// union of every rank's affinity, shared in a set-up round: a rank
    /// pinned to one core sees one CPU whatever the others have).
    fn probe_oversubscribed(&mut self) -> Result<bool> {
        const MAGIC: u64 = 0x0cca_c905_0000_0000;
        let (call, sig) = self.setup_call(MAGIC);
        let all = self.share_words(&call, &sig, affinity_words())?;
        Ok(self.world() > cpus::union_count(&all))
    }

    /// Whether the ranks outnumber the CPUs they may run on, which `spin`
    /// records (waits then yield at once): across processes from
    /// [`probe_oversubscribed`](Self::probe_oversubscribed), between
    /// threads from `local_group`'s count of this process's CPUs; split
    /// children inherit it. Equal on every rank.
    fn oversubscribed(&self) -> bool {
        self.spin.is_zero()
    }

    /// Records that the ranks outnumber their CPUs (every rank alike):
    /// waits yield at once, and threads' lanes reach [`LANE_MAX_BYTES`] as
    /// processes' do (see [`OVERSUBSCRIBED_BROADCAST_ZERO_COPY_MIN_BYTES`]).
    fn mark_oversubscribed(&mut self) {
        self.spin = Duration::ZERO;
        if !self.watch_pids {
            self.lane_max_bytes = LANE_MAX_BYTES;
        }
    }

    /// The smallest call of `op` (bytes in its largest buffer) that runs
    /// zero copy: between threads on any buffers, across processes on
    /// `alloc_shared` ones. [`ZERO_COPY_MIN_BYTES`], or with more ranks
    /// than CPUs what [`OVERSUBSCRIBED_BROADCAST_ZERO_COPY_MIN_BYTES`]
    /// says. Equal on every rank.
    pub(crate) fn zero_copy_min_bytes(&self, op: OpKind) -> usize {
        match op {
            _ if !self.oversubscribed() => ZERO_COPY_MIN_BYTES,
            OpKind::Broadcast => OVERSUBSCRIBED_BROADCAST_ZERO_COPY_MIN_BYTES,
            // Right above the lanes, with no staged range between: threads'
            // reach LANE_MAX_BYTES (`mark_oversubscribed`), processes'
            // stop below ZERO_COPY_MIN_BYTES once they allocate shared
            // buffers (`alloc_shared`), the only ones they reach directly.
            _ => self.lane_max_bytes + 1,
        }
    }

    fn peer_pid(&self, rank: Rank) -> libc::pid_t {
        self.control(rank).pid.load(Ordering::Relaxed) as libc::pid_t
    }

    /// Whether `rank`'s process still runs (its id and start time, as it
    /// published them; an id of 0, not published, counts as not running).
    fn peer_process_alive(&self, rank: Rank) -> bool {
        let control = self.control(rank);
        process_alive(ProcessStamp {
            pid: control.pid.load(Ordering::Relaxed) as u32,
            start: control.start.load(Ordering::Relaxed),
        })
    }

    fn attach(
        memory: Arc<Memory>,
        geometry: Geometry,
        rank: Rank,
        watch_pids: bool,
        aborted: Arc<AtomicBool>,
        timeout: Duration,
    ) -> Arena {
        let arena = Arena {
            base: memory.base(),
            memory,
            geometry,
            slots_offset: geometry.slots_offset(),
            rank,
            round: 0,
            rounds_compared: 0,
            lanes_offset: geometry.lanes_offset(),
            lane_calls: 0,
            lane_max_bytes: if watch_pids {
                LANE_MAX_BYTES
            } else {
                ZERO_COPY_MIN_BYTES - 1
            },
            watch_pids,
            aborted,
            timeout,
            spin: SPIN,
            cma: false,
            streaming_slots: false,
            stores_probe: None,
            stores_checks: false,
            next_stores_check: 0,
            stores_unchecked_bytes: 0,
            round_trips_watched: false,
            move_spacing: ROUND_TRIP_MIN_SPACING,
            stores_remeasure: None,
            stores_measured_at: Instant::now(),
            stores_measurements: 0,
            round_trip_watch: RoundTripWatch::default(),
            stores_moves: 0,
            shared: Vec::new(),
            allocation_bytes: Vec::new(),
            shared_ever: false,
            next_shared: 0,
            peer_buffers: PeerBuffers::default(),
            #[cfg(target_arch = "x86_64")]
            prefetch_for_write: stream::cpu_has_prefetchw(),
            direct_scratch: Vec::new(),
            direct: Direct::Local,
            root_pushes_all: false,
            last_direct: None,
            mailbox_next: RankWords::new(geometry.world),
            mailbox_room: 0,
            pairs: pair_lanes::Positions::new(geometry),
        };
        let me = arena.control(rank);
        let stamp = ProcessStamp::own();
        me.pid.store(u64::from(stamp.pid), Ordering::Relaxed);
        me.start.store(stamp.start, Ordering::Relaxed);
        me.state.store(STATE_ALIVE, Ordering::Release);
        arena
    }

    /// Bytes a shared segment's region needs for `world` ranks.
    pub fn region_bytes(world: usize) -> usize {
        Geometry::new(world).bytes()
    }

    pub fn world(&self) -> usize {
        self.geometry.world
    }

    fn control(&self, rank: Rank) -> &Control {
        // SAFETY: rank < world, so the line lies in the region; the region is
        // page aligned and Control is made of atomics.
        unsafe { &*(self.base.add(rank * LINE) as *const Control) }
    }

    fn slot(&self, rank: Rank, round: u64) -> *mut u8 {
        let g = &self.geometry;
        let index = rank * DEPTH + (round % DEPTH as u64) as usize;
        // SAFETY: index < world·depth, so the slot lies in the region.
        unsafe { self.base.add(self.slots_offset + index * g.slot_bytes) }
    }

    fn header(&self, rank: Rank, round: u64) -> &SlotHeader {
        // SAFETY: slots are 4096-aligned multiples; the header is atomics.
        unsafe { &*(self.slot(rank, round) as *const SlotHeader) }
    }

    /// The payload of `rank`'s slot for `round`, as elements of `T`.
    fn payload<T>(&self, rank: Rank, round: u64) -> *mut T {
        // SAFETY: within the slot; SLOT_HEADER keeps 8-byte alignment.
        unsafe { self.slot(rank, round).add(SLOT_HEADER) as *mut T }
    }

    /// Payload capacity of a slot in elements of `T`.
    fn capacity<T>(&self) -> usize {
        self.geometry.payload_bytes() / std::mem::size_of::<T>()
    }

    /// Elements of `T` per round of the staged collectives other than
    /// all-reduce: [`STAGED_PIECE_BYTES`] within a slot.
    fn staged_piece<T>(&self) -> usize {
        self.capacity::<T>()
            .min(STAGED_PIECE_BYTES / std::mem::size_of::<T>())
            .max(1)
    }

    /// Wakes ranks asleep on this rank, if any (a system call only then).
    ///
    /// Called after the store that a sleeper waits for (a post, `done`, a
    /// mailbox tag). The fence keeps the load of `sleepers` after that
    /// store: without it the CPU may read `sleepers` while the store still
    /// sits in its store buffer, and a waiter registering at that moment
    /// (see `wait_watching`, which fences the other way) finds neither the
    /// store nor a wake, and sleeps a whole [`SLEEP`]. A store-buffer test
    /// with these two orderings, on this project's Zen 4 VM, saw that
    /// outcome in 2 729 of 2 million forced races without the fence and
    /// in none with it. It costs nothing measurable after an 8-byte lane
    /// post (medians of ten alternating pairs, near: 0.0670 against
    /// 0.0688 µs without it).
    fn notify(&self) {
        let me = self.control(self.rank);
        std::sync::atomic::fence(Ordering::SeqCst);
        if me.sleepers.load(Ordering::SeqCst) > 0 {
            me.wake.fetch_add(1, Ordering::SeqCst);
            futex_wake(&me.wake);
        }
    }

    /// Waits until `ready()` holds, where `peer` is the rank that makes it
    /// hold. `peer_left_ok` says that the peer having left satisfies the
    /// wait (it will never read again).
    fn wait(
        &self,
        call: &CallInfo,
        peer: Rank,
        peer_left_ok: bool,
        ready: impl FnMut() -> bool,
    ) -> Result<()> {
        self.wait_watching(call, peer, peer_left_ok, ready, || false)
    }

    /// As [`wait`](Self::wait), and ends the wait (with `Ok`) also when
    /// `astray()` holds: a sign, looked at only once the first spin is
    /// over, that the peer runs another call (the caller reports it).
    fn wait_watching(
        &self,
        call: &CallInfo,
        peer: Rank,
        peer_left_ok: bool,
        ready: impl FnMut() -> bool,
        astray: impl FnMut() -> bool,
    ) -> Result<()> {
        self.wait_within(call, (peer, peer_left_ok), Watched::Group, ready, astray)
    }

    /// The wait of [`wait_watching`](Self::wait_watching), watching the
    /// members `watched` says for a loss (a collective fails with any
    /// member; a point-to-point receive only with its peer, as over the
    /// links).
    fn wait_within(
        &self,
        call: &CallInfo,
        (peer, peer_left_ok): (Rank, bool),
        watched: Watched,
        mut ready: impl FnMut() -> bool,
        mut astray: impl FnMut() -> bool,
    ) -> Result<()> {
        if ready() {
            return Ok(());
        }
        let start = Instant::now();
        let deadline = start + self.timeout;
        let mut spin_until = start + self.spin;
        let sleep_after = start + SLEEP_AFTER;
        // Peer processes are looked up (`/proc`, several system calls) only
        // once a wait has lasted a whole interval: checked at its first
        // pass, every wait over 5 µs paid for it (1–4 MiB collectives wait
        // that long several times per call). Departures are a load.
        let mut next_liveness = start + LIVENESS_INTERVAL;
        let control = self.control(peer);
        loop {
            for _ in 0..64 {
                if ready() {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            let now = Instant::now();
            if now < spin_until {
                continue;
            }
            if astray() {
                return Ok(());
            }
            if self.aborted.load(Ordering::Relaxed) {
                return Err(call.error(peer, TransportError::Aborted));
            }
            let check_pids = now >= next_liveness;
            if check_pids {
                next_liveness = now + LIVENESS_INTERVAL;
            }
            let lost = match watched {
                Watched::Group => self.lost_member(peer, check_pids),
                Watched::Peer => self.lost_peer(peer, check_pids),
            };
            if let Some(lost) = lost {
                if ready() {
                    return Ok(());
                }
                if lost == peer && peer_left_ok && self.departed(peer) {
                    return Ok(());
                }
                return Err(call.error(lost, self.lost_error(lost)));
            }
            if now >= deadline {
                return Err(call.error(peer, TransportError::Timeout(now - start)));
            }
            if now < sleep_after {
                std::thread::yield_now();
                spin_until = Instant::now() + self.spin;
                continue;
            }
            // Sleep on the peer's wake word: register, re-check, sleep.
            // The fence pairs with `notify`'s: either the peer's notify
            // sees this registration, or the re-check sees its store.
            control.sleepers.fetch_add(1, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            let seen = control.wake.load(Ordering::SeqCst);
            // Leaving or failing bumps the wake word after the state store:
            // if that bump came before `seen`, the state shows it here, and
            // the loop reports it now rather than after a whole sleep. A
            // peer that has not attached yet (state 0) is slept on too (the
            // sleep is bounded): waiting for it spun a core for the whole
            // timeout.
            if !ready() && !matches!(self.state(peer), STATE_DEPARTED | STATE_FAILED) {
                futex_wait(&control.wake, seen, SLEEP.min(deadline - now));
            }
            control.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn state(&self, rank: Rank) -> u64 {
        self.control(rank).state.load(Ordering::Acquire)
    }

    /// Whether `rank` left cleanly (see [`STATE_DEPARTED`]).
    fn departed(&self, rank: Rank) -> bool {
        self.state(rank) == STATE_DEPARTED
    }

    /// A member that will never do what a wait on `first` needs: `first`
    /// itself if it left or failed, or any member whose process ended
    /// without leaving (a crash) or whose communicator failed (a crash
    /// or failure elsewhere is usually why `first` went quiet, and naming
    /// it saves every rank a timeout). A member that left cleanly is not
    /// lost to a wait on another: it returned from its last call with its
    /// part in place (a reduce's non-root leaves while the root still
    /// waits for a late rank).
    ///
    /// Before naming a member that left or failed, the pids are looked at
    /// whatever `check_pids` says: a rank usually fails because another
    /// crashed, and the crash is what to name, not the messenger.
    fn lost_member(&self, first: Rank, check_pids: bool) -> Option<Rank> {
        let others = (0..self.world()).filter(|&r| r != self.rank);
        let crashed = |look: bool| {
            others.clone().find(|&r| {
                look && self.watch_pids && !self.departed(r) && {
                    let pid = self.control(r).pid.load(Ordering::Relaxed);
                    pid != 0 && !self.peer_process_alive(r)
                }
            })
        };
        if let Some(r) = crashed(check_pids) {
            return Some(r);
        }
        let left_or_failed = if matches!(self.state(first), STATE_DEPARTED | STATE_FAILED) {
            Some(first)
        } else {
            others.clone().find(|&r| self.state(r) == STATE_FAILED)
        };
        left_or_failed.map(|r| {
            if check_pids {
                r
            } else {
                crashed(true).unwrap_or(r)
            }
        })
    }

    /// [`lost_member`](Self::lost_member) for a wait that concerns `peer`
    /// alone: it left, failed or (when `check_pids`) its process died.
    fn lost_peer(&self, peer: Rank, check_pids: bool) -> Option<Rank> {
        let crashed = || {
            self.watch_pids && !self.departed(peer) && {
                let pid = self.control(peer).pid.load(Ordering::Relaxed);
                pid != 0 && !self.peer_process_alive(peer)
            }
        };
        (matches!(self.state(peer), STATE_DEPARTED | STATE_FAILED) || check_pids && crashed())
            .then_some(peer)
    }

    /// Whether the group was aborted (see `Communicator::abort`): a call
    /// looks before it starts, since its waits look only once they wait.
    pub fn aborted(&self) -> bool {
        self.aborted.load(Ordering::Relaxed)
    }

    /// Tells the other ranks that this rank's communicator failed and
    /// that it takes part in no further call (see [`STATE_FAILED`]).
    /// `cause`: the rank whose loss or lateness made this one fail, when
    /// known; the others then name it rather than this rank.
    pub fn mark_failed(&self, cause: Option<FailureCause>) {
        let me = self.control(self.rank);
        me.cause.store(encode_cause(cause), Ordering::Relaxed);
        me.state.store(STATE_FAILED, Ordering::Release);
        self.notify();
    }

    /// The error a wait reports for `lost`, which
    /// [`lost_member`](Self::lost_member) found gone or failed: its cause
    /// where it failed and gave one.
    fn lost_error(&self, lost: Rank) -> TransportError {
        let cause = (self.state(lost) == STATE_FAILED)
            .then(|| {
                decode_cause(
                    self.control(lost).cause.load(Ordering::Relaxed),
                    self.world(),
                )
            })
            .flatten();
        match cause {
            Some(cause) => cause.error_for(lost, self.rank),
            None => TransportError::PeerLost { rank: Some(lost) },
        }
    }

    /// Starts the next round: waits until this rank's slot for it is free
    /// again, and returns the round number.
    fn begin(&mut self, call: &CallInfo) -> Result<u64> {
        let g = self.round;
        self.round += 1;
        let depth = DEPTH as u64;
        // From round DEPTH − READ_LAG on (not only once slots are reused):
        // the same wait, earlier, so that the first rounds of a
        // communicator get the comparison below too.
        if g >= depth - READ_LAG {
            // Slot g % depth last held round g − depth. Every rank posts
            // every round, and posts round r + READ_LAG only after it has
            // read all it needs of round r, so a peer that has posted
            // `prev` (or a later round into that slot) no longer reads our
            // old one. This rank read that header when it awaited round
            // `prev`, so it is usually still in cache: no cross-core
            // traffic per round.
            let prev = g + READ_LAG - depth;
            for r in 0..self.world() {
                if r == self.rank {
                    continue;
                }
                let free = || self.header(r, prev).posted.load(Ordering::Acquire) > prev;
                // Almost always free already: no wait set up then.
                if !free() {
                    self.wait(call, r, true, free)?;
                }
                // The peer's slot holds exactly its round `prev` (reusing
                // it would need this rank's post of round g, not made yet),
                // as this rank's holds its own.
                self.compare_round(call, r, prev)?;
            }
            self.rounds_compared = self.rounds_compared.max(prev + 1);
        }
        Ok(g)
    }

    /// Compares `peer`'s header of round `g` with this rank's, both
    /// posted and still holding round `g`. Every rank posts the same call
    /// in the same round, so a difference is a call the ranks ran
    /// differently where nobody read the other's header: a broadcast's root
    /// or a reduce's followers only post (a root differing between ranks).
    /// This rank read its own header when it last posted, and usually the
    /// peer's when it awaited that round: no cross-core traffic then.
    fn compare_round(&self, call: &CallInfo, peer: Rank, g: u64) -> Result<()> {
        let own = self.header(self.rank, g);
        let mine = (
            own.seq.load(Ordering::Relaxed),
            own.signature.load(Ordering::Relaxed),
        );
        let header = self.header(peer, g);
        let theirs = (
            header.seq.load(Ordering::Relaxed),
            header.signature.load(Ordering::Relaxed),
        );
        if theirs != mine && !self.departed(peer) {
            return Err(call.error(
                peer,
                TransportError::Mismatch(format!(
                    "rank {peer} ran call #{} (signature {:#x}) in round {g}, where this \
                     rank ran call #{} (signature {:#x}): the ranks ran different calls \
                     (a different root on each rank?)",
                    theirs.0, theirs.1, mine.0, mine.1
                )),
            ));
        }
        Ok(())
    }

    /// Compares the rounds that `begin` has not compared yet (the last
    /// `DEPTH − READ_LAG` at most) where every peer has posted them, without
    /// waiting: called from a lane call, whose peers have finished every
    /// earlier call once their lane posts are seen. A communicator whose
    /// staged calls stop (a first broadcast of 1 KiB, then only 8-byte
    /// all-reduces) has its last staged rounds compared here, at its next
    /// lane call, rather than never.
    #[cold]
    #[inline(never)]
    fn compare_recent_rounds(&mut self, call: &CallInfo) -> Result<()> {
        while self.rounds_compared < self.round {
            let g = self.rounds_compared;
            // Slots still hold round g on every rank: a rank reuses slot
            // g % DEPTH only after this rank has posted round
            // g + DEPTH − READ_LAG ≥ self.round (`begin` compared every
            // round below self.round − (DEPTH − READ_LAG)).
            let posted = |r: Rank| self.header(r, g).posted.load(Ordering::Acquire) > g;
            if !(0..self.world()).all(posted) {
                // A round a call left unposted (it failed), or a peer still
                // behind: compared by `begin` later, or at a later lane call.
                return Ok(());
            }
            for r in (0..self.world()).filter(|&r| r != self.rank) {
                self.compare_round(call, r, g)?;
            }
            self.rounds_compared = g + 1;
        }
        Ok(())
    }

    /// Publishes this rank's slot for round `g`.
    fn post(&self, g: u64, sig: &CallSig) {
        let header = self.header(self.rank, g);
        header.seq.store(sig.seq, Ordering::Relaxed);
        header.signature.store(sig.signature, Ordering::Relaxed);
        header.posted.store(g + 1, Ordering::Release);
        self.notify();
    }

    /// Waits for `peer`'s slot of round `g` and checks it belongs to the
    /// same call.
    fn await_peer(&self, call: &CallInfo, sig: &CallSig, peer: Rank, g: u64) -> Result<()> {
        let header = self.header(peer, g);
        // A peer that broadcast this call through its mailbox runs another
        // call than this staged one: it will not post. (Looked up only when
        // needed: most rounds find the post at the first look.)
        let next = self.mailbox_next[peer];
        let mailbox_tag = || self.mailbox_unit(peer, next).0;
        let mailboxed = || {
            let tag = mailbox_tag().load(Ordering::Acquire);
            mailbox_tag_current(tag, next) && (tag >> 32) as u32 == sig.seq as u32
        };
        let posted = || header.posted.load(Ordering::Acquire) == g + 1;
        if !posted() {
            // A peer that posted its next lane call runs a small
            // all-reduce where this rank runs a staged call: it will not
            // post either.
            self.wait_watching(call, peer, false, posted, || {
                mailboxed() || self.posted_in_lanes(peer)
            })?;
        }
        if !posted() {
            let theirs = if self.posted_in_lanes(peer) {
                let lane = self.lane_header(peer, self.lane_calls);
                format!(
                    "call #{} with signature {:#x}, in the lanes",
                    lane.seq.load(Ordering::Relaxed),
                    lane.signature.load(Ordering::Relaxed)
                )
            } else {
                let tag = mailbox_tag().load(Ordering::Acquire);
                format!("a broadcast through its mailbox (tag {tag:#x})")
            };
            return Err(mismatch(call, sig, peer, &theirs));
        }
        same_call(call, sig, peer, (&header.seq, &header.signature))
    }

    /// Waits for every peer's slot of round `g`.
    fn await_all(&self, call: &CallInfo, sig: &CallSig, g: u64) -> Result<()> {
        for p in 0..self.world() {
            if p != self.rank {
                self.await_peer(call, sig, p, g)?;
            }
        }
        Ok(())
    }

    /// Ends round `g`: this rank has read everything it needs of it (and
    /// of every earlier round).
    fn finish(&mut self, g: u64) {
        // Nobody waits on `done` (see `begin`); it records progress for
        // whoever inspects the arena.
        self.control(self.rank).done.store(g + 1, Ordering::Release);
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // A failed rank stays failed; one whose thread panics mid-call
        // leaves as failed too (its calls may not be complete).
        let failed = self.state(self.rank) == STATE_FAILED || std::thread::panicking();
        self.control(self.rank).state.store(
            if failed { STATE_FAILED } else { STATE_DEPARTED },
            Ordering::Release,
        );
        self.notify();
        let me = self.control(self.rank);
        me.wake.fetch_add(1, Ordering::SeqCst);
        futex_wake(&me.wake);
    }
}

/// Whether a round trip of `now` ns against `base` at the last
/// measurement says the cores moved (by [`ROUND_TRIP_CHANGE`] either way).
fn round_trip_moved(base: u64, now: u64) -> bool {
    let (base, now) = (base.max(1) as f64, now.max(1) as f64);
    now >= base * ROUND_TRIP_CHANGE || base >= now * ROUND_TRIP_CHANGE
}

/// The spacing after a move-triggered measurement (see
/// [`ROUND_TRIP_MIN_SPACING`]): doubled when it kept the mode (the move
/// changed nothing, or was noise), back to the minimum when it did not.
fn next_move_spacing(spacing: Duration, kept_mode: bool) -> Duration {
    if kept_mode {
        (spacing * 2).min(ROUND_TRIP_MAX_SPACING)
    } else {
        ROUND_TRIP_MIN_SPACING
    }
}

/// A rank's round trip at the last slot-store measurement (its baseline)
/// and how many checks in a row since then timed one that differs from it
/// by [`ROUND_TRIP_CHANGE`].
#[derive(Debug, Default)]
struct RoundTripWatch {
    /// `None` where round trips say nothing about placement (more ranks
    /// than CPUs: rounds wait for the scheduler) or the mode was forced.
    base: Option<u64>,
    differing: u32,
}

impl From<Option<u64>> for RoundTripWatch {
    fn from(base: Option<u64>) -> RoundTripWatch {
        RoundTripWatch { base, differing: 0 }
    }
}

impl RoundTripWatch {
    /// Takes one check's round trip (ns); whether the cores moved: the
    /// last [`ROUND_TRIP_MOVED_CHECKS`] checks all differed from the
    /// baseline (one reading may be noise, a move persists).
    fn moved(&mut self, now: u64) -> bool {
        let differs = self.base.is_some_and(|base| round_trip_moved(base, now));
        self.differing = if differs {
            self.differing.saturating_add(1)
        } else {
            0
        };
        self.differing >= ROUND_TRIP_MOVED_CHECKS
    }
}

/// The error for a peer found running another call than this one
/// (`theirs` describes what it runs).
/// Checks that a post `peer` made (its sequence number and signature
/// words, slot or lane header) belongs to this call.
fn same_call(
    call: &CallInfo,
    sig: &CallSig,
    peer: Rank,
    (seq, signature): (&AtomicU64, &AtomicU64),
) -> Result<()> {
    let (seq, signature) = (
        seq.load(Ordering::Relaxed),
        signature.load(Ordering::Relaxed),
    );
    if seq != sig.seq || signature != sig.signature {
        return Err(mismatch(
            call,
            sig,
            peer,
            &format!("call #{seq} with signature {signature:#x}"),
        ));
    }
    Ok(())
}

fn mismatch(call: &CallInfo, sig: &CallSig, peer: Rank, theirs: &str) -> crate::error::Error {
    call.error(
        peer,
        TransportError::Mismatch(format!(
            "rank {peer} runs a different call: {theirs}, here #{} with signature {:#x} \
             (same collectives, in the same order, with the same counts, types, operators \
             and roots on every rank?)",
            sig.seq, sig.signature
        )),
    )
}

/// A call's signature: what every rank must agree on.
#[inline]
pub(crate) fn signature(
    op: OpKind,
    dtype: u8,
    reduce: Option<ReduceOp>,
    root: Rank,
    count: usize,
) -> u64 {
    let mut z = u64::from(op.code()) | u64::from(dtype) << 8;
    z |= u64::from(reduce.map_or(0xff, |r| r as u8)) << 16;
    z ^= (root as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z ^= (count as u64)
        .rotate_left(24)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z
}

/// The call's buffers, as raw pointers: in-place calls alias `input` and
/// `output`, and the algorithms below never form overlapping references.
#[derive(Clone, Copy)]
pub(crate) struct Buffers<T> {
    pub input: *const T,
    pub output: *mut T,
    pub in_place: bool,
}

/// `len` elements at `ptr + offset` as a shared slice.
///
/// # Safety
/// The range must be inside an allocation and not written during the
/// returned borrow.
unsafe fn view<'a, T>(ptr: *const T, offset: usize, len: usize) -> &'a [T] {
    std::slice::from_raw_parts(ptr.add(offset), len)
}

/// As [`view`], mutable; the range must not be read through another
/// reference during the borrow.
unsafe fn view_mut<'a, T>(ptr: *mut T, offset: usize, len: usize) -> &'a mut [T] {
    std::slice::from_raw_parts_mut(ptr.add(offset), len)
}

/// Whether a call whose largest buffer holds `elements` of `T` writes its
/// outputs with non-temporal stores (see [`stream`]).
fn streams<T>(elements: usize) -> bool {
    elements * std::mem::size_of::<T>() >= stream::STREAM_MIN_BYTES
}

/// Copies `len` elements into a caller's output: with non-temporal stores
/// when `stream`.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`.
unsafe fn copy_out<T: Copy>(stream: bool, src: *const T, dst: *mut T, len: usize) {
    if stream {
        stream::copy_streaming(src, dst, len);
    } else {
        stream::copy_cached(src, dst, len);
    }
}

/// Writes a result into a caller's output: `compute(block, offset)` fills
/// `block` with elements `offset..` of it, directly in `out`, or through a
/// cache-resident block streamed into `out` when `stream`.
fn write_out<T: Element>(stream: bool, out: &mut [T], mut compute: impl FnMut(&mut [T], usize)) {
    if stream {
        stream::fold_streaming(out, compute);
    } else {
        compute(out, 0);
    }
}

/// `out = s(0) ⊕ s(1) ⊕ … ⊕ s(n-1)` in rank order; `out` overlaps none of
/// the sources.
fn fold<'a, T: Element + 'a>(
    op: ReduceOp,
    out: &mut [T],
    n: usize,
    source: impl Fn(usize) -> &'a [T],
) {
    match n {
        0 => {}
        1 => out.copy_from_slice(source(0)),
        _ => {
            T::combine_into(op, out, source(0), source(1));
            for p in 2..n {
                T::combine_assign(op, out, source(p));
            }
        }
    }
}

/// Whether [`fold_with_own`] reads this rank's (`me`) own term from its
/// slot, so the rank must stage it there.
fn own_term_from_slot(me: Rank, in_place: bool) -> bool {
    in_place && me >= 2
}

/// [`fold`] of every rank's contribution into `out`, where this rank's
/// (`me`) is `own` out of place and already in `out` in place (`own` is
/// `None`), and the others' are `staged(p)`.
///
/// This rank's contribution is never read back from its own slot (except
/// in place on ranks ≥ 2, whose prefix must be folded before it): a load
/// right behind the stores that staged it waits for them to commit, and
/// they wait for the slot's line to come back from the peer that read it
/// a round earlier. Measured: 8-byte all-reduce 0.27 → 0.19 µs, 64 KiB
/// 6.5 → 8.5 GB/s, 2 processes.
fn fold_with_own<'a, T: Element + 'a>(
    op: ReduceOp,
    out: &mut [T],
    (me, world): (Rank, usize),
    own: Option<&'a [T]>,
    staged: impl Fn(usize) -> &'a [T],
) {
    match own {
        Some(own) => fold(op, out, world, |p| if p == me { own } else { staged(p) }),
        None if !own_term_from_slot(me, true) => {
            // Rank order: rank 1 puts x0 in front of its own first.
            if me == 1 {
                T::combine_assign_rev(op, out, staged(0));
            }
            for p in me + 1..world {
                T::combine_assign(op, out, staged(p));
            }
        }
        None => fold(op, out, world, staged),
    }
}

/// PREFETCHW: asks for `line` in exclusive state, invalidating other
/// cores' copies, without waiting for it.
///
/// # Safety
/// The CPU must support PREFETCHW ([`stream::cpu_has_prefetchw`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_for_write(line: *mut u8) {
    // `_mm_prefetch::<_MM_HINT_ET0>` compiles to PREFETCHT0 unless the
    // (unstable) `prfchw` target feature is on, hence the instruction.
    // SAFETY: a prefetch never faults and changes no memory.
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) line, options(nostack, preserves_flags, readonly));
    }
}

/// Near-equal split of `total` into `parts` (the first `total % parts`
/// parts one longer), as in the schedules.
fn part(total: usize, parts: usize, i: usize) -> (usize, usize) {
    let base = total / parts;
    let extra = total % parts;
    (i * base + i.min(extra), base + usize::from(i < extra))
}

impl Arena {
    /// All-reduce of `count` elements.
    pub fn all_reduce<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        // `Communicator::arena_fast` sends small calls to the lanes
        // itself; this keeps every other caller on the same choice, which
        // must agree across ranks.
        if self.lane_fits(count * std::mem::size_of::<T>()) {
            return self.lane_all_reduce(call, sig, bufs, count, op);
        }
        if let Some(g) = self.enter_direct(
            call,
            sig,
            &bufs,
            (count, count),
            count,
            (false, Touches::All),
        )? {
            let result = self.zero_copy_all_reduce(call, sig, bufs, g, count, op);
            return self.finish_direct(call, g, result);
        }
        let world = self.world();
        let me = self.rank;
        let capacity = self.capacity::<T>();
        if count <= capacity {
            // One-shot: everyone posts all of it and everyone folds all of
            // it (see `fold_with_own` for where its own term is read).
            let g = self.begin(call)?;
            // SAFETY: input has count elements; the slot holds capacity ≥ count.
            unsafe {
                copy_out(
                    self.streams_stage::<T>(count),
                    bufs.input,
                    self.payload::<T>(me, g),
                    count,
                );
            }
            self.post(g, sig);
            self.await_all(call, sig, g)?;
            {
                // SAFETY: every slot of round g is posted and not rewritten
                // before everyone's done passes g; output is ours alone;
                // out of place the input is apart from it.
                let out = unsafe { view_mut(bufs.output, 0, count) };
                let own = (!bufs.in_place).then(|| unsafe { view(bufs.input, 0, count) });
                fold_with_own(op, out, (me, world), own, |p| unsafe {
                    view(self.payload::<T>(p, g), 0, count)
                });
                finish_avg(op, out, world);
            }
            self.finish(g);
            return Ok(());
        }
        // Two-shot, pipelined by pieces of one slot: a piece's round A posts
        // the parts the other ranks own; each owner folds its part into its
        // round-B slot; round B posts the folded parts and everyone copies
        // them out. Step s stages piece s, folds piece s − 1 and copies
        // piece s − 2 out, as the reference's one-staging-copy pipeline
        // does: a rank that is late in one phase does not hold its peers
        // at every phase of every piece (lock-step pieces spent a fifth of
        // a 4 MiB call waiting, `perf`). Rounds begin in the order A0 | A1
        // B0 | A2 B1 | …, and a piece's A round is read until its B round
        // is posted, its B round until the second step after: READ_LAG.
        // In place the output's lines were just read (staged, folded) and
        // sit in cache: only out of place does streaming them out pay.
        let stream = !bufs.in_place && streams::<T>(count);
        let piece = |t: usize| (t * capacity, capacity.min(count - t * capacity));
        let pieces = count.div_ceil(capacity);
        // (round, piece) staged and not yet folded; folded, not copied out.
        let mut staged: Option<(u64, usize)> = None;
        let mut folded: Option<(u64, usize)> = None;
        for step in 0..pieces + 2 {
            let next_staged = if step < pieces {
                let (offset, len) = piece(step);
                let a = self.begin(call)?;
                for q in (0..world).filter(|&q| q != me) {
                    let (o, l) = part(len, world, q);
                    // SAFETY: input range in bounds; slot range within
                    // capacity. In place, piece `step` of the output is
                    // written only by its fold and copy-out, later.
                    unsafe {
                        copy_out(
                            self.streams_stage::<T>(l),
                            bufs.input.add(offset + o),
                            self.payload::<T>(me, a).add(o),
                            l,
                        );
                    }
                }
                self.post(a, sig);
                Some((a, step))
            } else {
                None
            };
            let next_folded = match staged {
                Some((a, t)) => {
                    let (offset, len) = piece(t);
                    self.await_all(call, sig, a)?;
                    let b = self.begin(call)?;
                    self.two_shot_fold(op, &bufs, (a, b), offset, len, stream);
                    self.finish(a);
                    self.post(b, sig);
                    Some((b, t))
                }
                None => None,
            };
            if let Some((b, t)) = folded {
                let (offset, len) = piece(t);
                self.await_all(call, sig, b)?;
                for p in (0..world).filter(|&p| p != me) {
                    let (o, l) = part(len, world, p);
                    // SAFETY: posted B slots; output range in bounds and,
                    // for in-place calls, no longer read (piece t is
                    // staged and folded everywhere: its B rounds are
                    // posted).
                    unsafe {
                        copy_out(
                            stream,
                            self.payload::<T>(p, b).add(o),
                            bufs.output.add(offset + o),
                            l,
                        );
                    }
                }
                self.finish(b);
            }
            staged = next_staged;
            folded = next_folded;
        }
        Ok(())
    }

    /// The two-shot's fold of one piece (`offset`, `len` elements): this
    /// rank's part, from its input and the peers' slots of round `a`,
    /// goes block by block from L1 both into its slot of round `b` (for
    /// the peers) and into its output: one pass, instead of reading it
    /// back out of the slot afterwards. With streaming slot stores the
    /// slot's copy of each block is non-temporal (two ranks then take the
    /// block path too: its kernel stores into both with ordinary stores).
    fn two_shot_fold<T: Element>(
        &self,
        op: ReduceOp,
        bufs: &Buffers<T>,
        (a, b): (u64, u64),
        offset: usize,
        len: usize,
        stream: bool,
    ) {
        let (world, me) = (self.world(), self.rank);
        let (mine_o, mine_l) = part(len, world, me);
        // SAFETY: the B slot is this rank's until posted; the output part
        // is this rank's to write (no peer reads it).
        let slot_part = unsafe { self.payload::<T>(me, b).add(mine_o) };
        let out_part = unsafe { bufs.output.add(offset + mine_o) };
        let stream_slot = self.streams_stage::<T>(mine_l);
        if world == 2 && !stream && !stream_slot {
            // Two ranks: one pass stores the sum (an Avg's halved, where
            // the type allows) into the slot and the output (as the
            // zero-copy path does), instead of folding into an L1 block
            // and copying it twice. The output takes the place of this
            // rank's own term, which it is in place.
            // SAFETY: round A slots are posted and valid (see below); the
            // slot part is apart from every other buffer, and the output
            // part is this rank's own input part (in place) or apart.
            let done = unsafe {
                let own = bufs.input.add(offset + mine_o);
                let theirs = self.payload::<T>(1 - me, a).add(mine_o).cast_const();
                if me == 0 {
                    fold_two_into_both(op, (out_part, slot_part), (own, theirs), mine_l, Walk::Up)
                } else {
                    fold_two_into_both(op, (slot_part, out_part), (theirs, own), mine_l, Walk::Up)
                }
            };
            if done {
                return;
            }
        }
        stream::in_blocks(
            mine_l,
            |block: &mut [T], at| {
                let n = block.len();
                // SAFETY: round A slots are posted and stay valid until
                // every rank has posted round A + READ_LAG, after this
                // rank posts round B. In place, the output part is this
                // rank's own input part: each block is read here before
                // it is written below.
                fold(op, block, world, |p| unsafe {
                    if p == me {
                        view(bufs.input, offset + mine_o + at, n)
                    } else {
                        view(self.payload::<T>(p, a), mine_o + at, n)
                    }
                });
                finish_avg(op, block, world);
            },
            |block, at| unsafe {
                // SAFETY: as above.
                if stream_slot {
                    stream::copy_streaming_unfenced(block.as_ptr(), slot_part.add(at), block.len());
                } else {
                    stream::copy_cached(block.as_ptr(), slot_part.add(at), block.len());
                }
                if stream {
                    stream::copy_streaming_unfenced(block.as_ptr(), out_part.add(at), block.len());
                } else {
                    stream::copy_cached(block.as_ptr(), out_part.add(at), block.len());
                }
            },
        );
        if stream || stream_slot {
            stream::fence();
        }
    }
}

/// Small all-reduces (see [`LANE_MAX_BYTES`]) run in the *lanes*, the
/// counterpart of the reference's one-line flag protocol (its variant d)
/// and of NCCL's low-latency protocol: no round, no slot to free, no
/// wait set up when the peers are already there.
///
/// Each rank owns [`LANES_PER_RANK`] lane slots and uses them in turn,
/// one per lane call: it copies its input into the slot, posts it (a
/// release store of `k + 1` beside the call's sequence number and
/// signature; the first 40 bytes of payload share the header's cache
/// line, so an 8-byte call moves one line each way), waits for every
/// peer's post of the same lane call, and folds every term in rank order
/// as the other all-reduces do (bit-equal results whichever path ran).
///
/// Nothing is checked before a slot is rewritten: a rank writes slot
/// `k % 2` again at lane call `k + 2`, which it reaches only after every
/// peer posted lane call `k + 1`, and each peer posts that only after it
/// finished reading lane call `k` (every lane call waits for every peer).
/// Every rank takes the lanes for the same calls: the choice depends only
/// on what the signature holds (operation, size), so `lane_calls` stays
/// equal on every rank between calls, like `round`.
impl Arena {
    fn lane_slot(&self, rank: Rank, k: u64) -> *mut u8 {
        let index = rank * LANES_PER_RANK + (k % LANES_PER_RANK as u64) as usize;
        // SAFETY: index < world·LANES_PER_RANK: the slot lies in the region.
        unsafe { self.base.add(self.lanes_offset + index * LANE_SLOT_BYTES) }
    }

    fn lane_header(&self, rank: Rank, k: u64) -> &LaneHeader {
        // SAFETY: lane slots are line aligned; the header is atomics.
        unsafe { &*(self.lane_slot(rank, k) as *const LaneHeader) }
    }

    /// The payload of `rank`'s lane slot for lane call `k`, as `T`s.
    fn lane_payload<T>(&self, rank: Rank, k: u64) -> *mut T {
        // SAFETY: within the slot; LANE_HEADER keeps 8-byte alignment.
        unsafe { self.lane_slot(rank, k).add(LANE_HEADER) as *mut T }
    }

    /// Whether an all-reduce of `bytes` runs in the lanes.
    #[inline]
    pub fn lane_fits(&self, bytes: usize) -> bool {
        bytes > 0 && bytes <= self.lane_max_bytes
    }

    /// All-reduce of `count` elements in the lanes (they fit: see
    /// [`lane_fits`](Self::lane_fits)).
    pub fn lane_all_reduce<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        debug_assert!(self.lane_fits(count * std::mem::size_of::<T>()));
        let k = self.lane_exchange(call, sig, bufs.input, count)?;
        self.lane_fold(op, &bufs, k, 0, count);
        Ok(())
    }

    /// Folds elements `offset..offset + count` of every rank's posts of
    /// lane call `k`, in rank order, into the output (`count` elements),
    /// dividing for `Avg`. This rank's own term comes from its input at
    /// `offset` out of place, and is the output already in place.
    fn lane_fold<T: Element>(
        &self,
        op: ReduceOp,
        bufs: &Buffers<T>,
        k: u64,
        offset: usize,
        count: usize,
    ) {
        let (me, world) = (self.rank, self.world());
        // SAFETY (this and the two views below): every lane slot of call k
        // is posted (awaited) and not rewritten before this rank posts its
        // next lane call, and holds offset + count elements; the output is
        // ours alone; out of place the input holds offset + count elements
        // apart from it.
        let out = unsafe { view_mut(bufs.output, 0, count) };
        let own = (!bufs.in_place).then(|| unsafe { view(bufs.input, offset, count) });
        let staged = |p| unsafe { view(self.lane_payload::<T>(p, k), offset, count) };
        if world == 2 {
            // Two ranks, the same rank-order fold as `fold_with_own` written
            // out: what runs between seeing the peer's post and posting the
            // next lane call sets the lane's period (8-byte all-reduce,
            // near placement, medians of eight pairs: 0.0887 → 0.0756 µs
            // together with `lane_await_all`'s two-rank case).
            let theirs = staged(1 - me);
            match (own, me) {
                (Some(mine), 0) => T::combine_into(op, out, mine, theirs),
                (Some(mine), _) => T::combine_into(op, out, theirs, mine),
                (None, 0) => T::combine_assign(op, out, theirs),
                (None, _) => T::combine_assign_rev(op, out, theirs),
            }
        } else {
            fold_with_own(op, out, (me, world), own, staged);
        }
        finish_avg(op, out, world);
    }

    /// One lane call of a collective: posts `count` elements from `input`
    /// (they fit: [`lane_fits`](Self::lane_fits)) and waits for every
    /// peer's post. Returns the lane call's number.
    fn lane_exchange<T>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        input: *const T,
        count: usize,
    ) -> Result<u64> {
        self.lane_exchange_except(call, sig, input, count, 0..0)
    }

    /// [`lane_exchange`](Self::lane_exchange) that leaves `unread` (a range
    /// of the `count` elements no peer reads: a reduce-scatter's own part)
    /// out of the post; the slot keeps the layout, with stale bytes there.
    fn lane_exchange_except<T>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        input: *const T,
        count: usize,
        unread: std::ops::Range<usize>,
    ) -> Result<u64> {
        self.last_direct = None;
        debug_assert!(unread.start <= unread.end && unread.end <= count);
        // SAFETY: the input holds count elements, and the payload room for
        // them (the caller checked `lane_fits`); both pieces lie inside.
        let k = self.lane_post(sig, |payload| unsafe {
            let payload = payload.cast::<T>();
            std::ptr::copy_nonoverlapping(input, payload, unread.start);
            std::ptr::copy_nonoverlapping(
                input.add(unread.end),
                payload.add(unread.end),
                count - unread.end,
            );
        });
        self.lane_await_all(call, sig, k)?;
        if self.rounds_compared < self.round {
            self.compare_recent_rounds(call)?;
        }
        if count * std::mem::size_of::<T>() <= CACHE_LINE - LANE_HEADER {
            self.claim_next_lane(k);
        }
        Ok(k)
    }

    /// All-gather of `count` elements per rank in the lanes
    /// (`lane_fits(count · size)`): each rank posts its part and copies the
    /// others' out of their lane slots.
    fn lane_all_gather<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
    ) -> Result<()> {
        let k = self.lane_exchange(call, sig, bufs.input, count)?;
        for p in 0..self.world() {
            // SAFETY: the output holds world·count elements; posted lane
            // slots of call k hold count each; in place this rank's part is
            // its input, already in place.
            unsafe {
                let to = bufs.output.add(p * count);
                if p != self.rank {
                    std::ptr::copy_nonoverlapping(self.lane_payload::<T>(p, k), to, count);
                } else if !bufs.in_place {
                    std::ptr::copy_nonoverlapping(bufs.input, to, count);
                }
            }
        }
        Ok(())
    }

    /// Reduce-scatter of `count` elements per rank in the lanes
    /// (`lane_fits(world · count · size)`): each rank posts its whole input
    /// and folds part `rank` of every rank's, in rank order.
    fn lane_reduce_scatter<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        // This rank's own part is read by no peer, and this rank folds it
        // from its input (in place: the output, part `rank` of it) unless
        // `own_term_from_slot`: then, from a cache line up, it is not
        // posted. 4 KiB, 2 processes, far placement: 32 lines to claim back
        // from the peer's cache per call instead of 64, 1.29–1.35 µs
        // against 1.45–1.48 (three pairs); near 0.38–0.55 against 0.46–0.66
        // (six). Smaller parts share their lines with the rest: one copy.
        let skip_own = !own_term_from_slot(self.rank, bufs.in_place)
            && count * std::mem::size_of::<T>() >= CACHE_LINE;
        let own = if skip_own {
            self.rank * count..(self.rank + 1) * count
        } else {
            0..0
        };
        let k = self.lane_exchange_except(call, sig, bufs.input, self.world() * count, own)?;
        self.lane_fold(op, &bufs, k, self.rank * count, count);
        Ok(())
    }

    /// Reduce of `count` elements to `root` in the lanes: every rank posts
    /// and waits for every post (a lane slot is rewritten two lane calls
    /// later only because every lane call waits for every peer), the root
    /// folds.
    fn lane_reduce<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
        (op, root): (ReduceOp, Rank),
    ) -> Result<()> {
        let k = self.lane_exchange(call, sig, bufs.input, count)?;
        if self.rank == root {
            self.lane_fold(op, &bufs, k, 0, count);
        }
        Ok(())
    }

    /// Starts this rank's next lane call: `fill` writes the payload (up to
    /// [`LANE_MAX_BYTES`]; no peer reads it before the post), then the
    /// header is posted. Returns the lane call's number.
    #[inline]
    fn lane_post(&mut self, sig: &CallSig, fill: impl FnOnce(*mut u8)) -> u64 {
        let k = self.lane_calls;
        self.lane_calls += 1;
        fill(self.lane_payload::<u8>(self.rank, k));
        let header = self.lane_header(self.rank, k);
        header.seq.store(sig.seq, Ordering::Relaxed);
        header.signature.store(sig.signature, Ordering::Relaxed);
        header.posted.store(k + 1, Ordering::Release);
        self.notify();
        k
    }

    /// Waits for every peer's post of lane call `k`.
    #[inline]
    fn lane_await_all(&self, call: &CallInfo, sig: &CallSig, k: u64) -> Result<()> {
        if self.world() == 2 {
            // The common tensor-parallel pair: no peer loop between the
            // post and the first look (see `lane_fold`).
            self.lane_await(call, sig, 1 - self.rank, k)?;
        } else {
            for p in (0..self.world()).filter(|&p| p != self.rank) {
                self.lane_await(call, sig, p, k)?;
            }
        }
        Ok(())
    }

    /// Asks for this rank's lane slot of lane call `k + 1` in exclusive
    /// state, once every peer has posted lane call `k`: every peer is then
    /// done with the contents lane call `k - 1` left in that slot (two
    /// slots per rank), so the peers' copies are invalidated while this
    /// rank folds and returns, rather than when its next post's stores
    /// wait for them. A peer may already be polling the line (waiting for
    /// `k + 1`, or watching the lanes from a staged round or a mailbox);
    /// the prefetch then costs it one more transfer, never a wrong value:
    /// it changes no data. 8-byte all-reduce, 2 processes, eight
    /// alternating pairs each: far 0.267 → 0.207 µs ((d) 0.19–0.20), near
    /// 0.068 → 0.061 and 0.074 → 0.058. Only lane calls whose payload
    /// shares the header's line claim (the lane collectives up to 40 bytes,
    /// the barrier): a 1 KiB lane all-reduce ran 0.15 → 0.19 µs near and
    /// 0.55 → 0.60 far with the claim (the post writes the header's line
    /// twice, around the rest of the payload, and the peer's polls take it
    /// in between), and claiming every line of the payload made it 0.85;
    /// zero copy's `enter`/`leave` ran 2 KiB between threads 5–9 % slower
    /// with it (near, two sets of pairs). The test is the payload's fit in
    /// the header's cache line (`CACHE_LINE`), not in the two-line
    /// control `LINE` it had been until stop 29: 64 and 96-byte all-reduces
    /// (which claimed then) ran 0.11–0.14 / 0.12–0.14 µs against
    /// 0.09–0.11 / 0.09–0.13 without the claim (near, five alternating
    /// pairs).
    #[inline]
    fn claim_next_lane(&self, k: u64) {
        #[cfg(target_arch = "x86_64")]
        if self.prefetch_for_write {
            // SAFETY: PREFETCHW is present (checked); a prefetch of an
            // address inside the arena changes no memory.
            unsafe { prefetch_for_write(self.lane_slot(self.rank, k + 1)) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = k;
    }

    /// Waits for `peer`'s post of lane call `k` and checks that it is this
    /// call.
    #[inline]
    fn lane_await(&self, call: &CallInfo, sig: &CallSig, peer: Rank, k: u64) -> Result<()> {
        let header = self.lane_header(peer, k);
        let posted = header.posted.load(Ordering::Acquire) == k + 1;
        if posted
            && header.seq.load(Ordering::Relaxed) == sig.seq
            && header.signature.load(Ordering::Relaxed) == sig.signature
        {
            return Ok(());
        }
        self.lane_await_slowly(call, sig, peer, k)
    }

    /// [`lane_await`](Self::lane_await) when the post is not there at the
    /// first look, or is another call's: out of line, so that the first
    /// look stays a few instructions.
    #[cold]
    #[inline(never)]
    fn lane_await_slowly(&self, call: &CallInfo, sig: &CallSig, peer: Rank, k: u64) -> Result<()> {
        let header = self.lane_header(peer, k);
        let posted = || header.posted.load(Ordering::Acquire) == k + 1;
        self.wait_watching(call, peer, false, posted, || {
            self.posted_outside_lanes(peer, sig).is_some()
        })?;
        if !posted() {
            // The watch saw a post outside the lanes; it may be gone by now
            // (the peer failed and left), so say so rather than print nothing.
            let theirs = self
                .posted_outside_lanes(peer, sig)
                .unwrap_or_else(|| "a call outside the lanes".to_string());
            return Err(mismatch(call, sig, peer, &theirs));
        }
        same_call(call, sig, peer, (&header.seq, &header.signature))
    }

    /// What `peer` posted outside the lanes where this rank awaits its lane
    /// call (described), if anything: this call's slot round (a staged
    /// call) or a message in its mailbox for this call or a later one.
    fn posted_outside_lanes(&self, peer: Rank, sig: &CallSig) -> Option<String> {
        let round = self.round;
        let header = self.header(peer, round);
        if header.posted.load(Ordering::Acquire) == round + 1 {
            let seq = header.seq.load(Ordering::Relaxed);
            let signature = header.signature.load(Ordering::Relaxed);
            return Some(format!(
                "call #{seq} with signature {signature:#x}, outside the lanes"
            ));
        }
        let next = self.mailbox_next[peer];
        let tag = self.mailbox_unit(peer, next).0.load(Ordering::Acquire);
        mailbox_tag_foreign(tag, sig, next)
            .then(|| format!("a broadcast through its mailbox (tag {tag:#x})"))
    }

    /// Whether `peer` posted its next lane call, where this rank runs a
    /// call outside the lanes (a mismatch).
    fn posted_in_lanes(&self, peer: Rank) -> bool {
        let k = self.lane_calls;
        self.lane_header(peer, k).posted.load(Ordering::Acquire) == k + 1
    }
}

impl Arena {
    /// Runs `body(arena, round, offset, len)` once per piece of at most
    /// `per` elements of `count`, each in a round of its own: the piece loop
    /// of every single-round collective.
    fn in_rounds(
        &mut self,
        call: &CallInfo,
        count: usize,
        per: usize,
        mut body: impl FnMut(&mut Arena, u64, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let mut offset = 0;
        while offset < count {
            let len = per.min(count - offset);
            let g = self.begin(call)?;
            body(self, g, offset, len)?;
            self.finish(g);
            offset += len;
        }
        Ok(())
    }

    /// Copies `len` elements from `src + src_offset` into this rank's slot of
    /// round `g` at `slot_offset`.
    ///
    /// # Safety
    /// The source range must be valid; `slot_offset + len` ≤ the capacity.
    unsafe fn stage<T: Copy>(
        &self,
        g: u64,
        slot_offset: usize,
        src: *const T,
        src_offset: usize,
        len: usize,
    ) {
        copy_out(
            self.streams_stage::<T>(len),
            src.add(src_offset),
            self.payload::<T>(self.rank, g).add(slot_offset),
            len,
        );
    }

    /// Whether a staged piece of `len` elements goes into the slot with
    /// non-temporal stores (fenced before the post that publishes it).
    fn streams_stage<T>(&self, len: usize) -> bool {
        self.streaming_slots && len * std::mem::size_of::<T>() >= STREAMED_STAGE_MIN_BYTES
    }

    /// Copies `len` elements out of `peer`'s slot of round `g`.
    ///
    /// # Safety
    /// The slot must be posted; the destination range valid and unaliased.
    #[allow(clippy::too_many_arguments)]
    unsafe fn unstage<T: Copy>(
        &self,
        peer: Rank,
        g: u64,
        slot_offset: usize,
        dst: *mut T,
        dst_offset: usize,
        len: usize,
        stream: bool,
    ) {
        copy_out(
            stream,
            self.payload::<T>(peer, g).add(slot_offset),
            dst.add(dst_offset),
            len,
        );
    }

    /// Reduce-scatter: `count` elements per rank. `bufs.output` points at
    /// this rank's result (inside the input for in-place calls).
    pub fn reduce_scatter<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let full = count * self.world();
        if self.lane_fits(full * std::mem::size_of::<T>()) {
            return self.lane_reduce_scatter(call, sig, bufs, count, op);
        }
        if let Some(g) =
            self.enter_direct(call, sig, &bufs, (full, count), full, (false, Touches::All))?
        {
            let result = self.zero_copy_reduce_scatter(call, sig, bufs, g, count, op);
            return self.finish_direct(call, g, result);
        }
        let (world, me) = (self.world(), self.rank);
        // In place the output is part of the input, staged (read) just before.
        let stream = !bufs.in_place && streams::<T>(full);
        // Slot region q (at q·per) carries the piece destined for rank q.
        let per = (self.staged_piece::<T>() / world).max(1);
        self.in_rounds(call, count, per, |arena, g, offset, len| {
            for q in (0..world).filter(|&q| q != me || own_term_from_slot(me, bufs.in_place)) {
                // SAFETY: input holds world·count elements; q·per + len ≤ capacity.
                unsafe { arena.stage(g, q * per, bufs.input, q * count + offset, len) };
            }
            arena.post(g, sig);
            arena.await_all(call, sig, g)?;
            {
                // SAFETY: posted slots; out of place the output overlaps no
                // source; in place it holds this rank's own part, folded in
                // place or read from its slot (`fold_with_own`).
                let out = unsafe { view_mut(bufs.output, offset, len) };
                write_out(stream, out, |block, at| {
                    let n = block.len();
                    let own = (!bufs.in_place)
                        .then(|| unsafe { view(bufs.input, me * count + offset + at, n) });
                    fold_with_own(op, block, (me, world), own, |p| unsafe {
                        view(arena.payload::<T>(p, g), me * per + at, n)
                    });
                    finish_avg(op, block, world);
                });
            }
            Ok(())
        })
    }

    /// All-gather: `count` elements per rank. For in-place calls
    /// `bufs.input` points at this rank's part of the output.
    pub fn all_gather<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
    ) -> Result<()> {
        if self.lane_fits(count * std::mem::size_of::<T>()) {
            return self.lane_all_gather(call, sig, bufs, count);
        }
        let full = count * self.world();
        let cma_ok = self.cma_suits(OpKind::AllGather, full * std::mem::size_of::<T>());
        if let Some(g) = self.enter_direct(
            call,
            sig,
            &bufs,
            (count, full),
            full,
            (cma_ok, Touches::All),
        )? {
            let result = self.zero_copy_copies(call, sig, bufs, g, count, None);
            return self.finish_direct(call, g, result);
        }
        let (world, me) = (self.world(), self.rank);
        let piece = self.staged_piece::<T>();
        let stream = streams::<T>(full);
        self.in_rounds(call, count, piece, |arena, g, offset, len| {
            // SAFETY: input holds count elements; len ≤ capacity.
            unsafe { arena.stage(g, 0, bufs.input, offset, len) };
            arena.post(g, sig);
            if !bufs.in_place {
                // SAFETY: output holds world·count elements.
                unsafe {
                    let dst = bufs.output.add(me * count + offset);
                    copy_out(stream, bufs.input.add(offset), dst, len);
                }
            }
            arena.await_all(call, sig, g)?;
            for p in (0..world).filter(|&p| p != me) {
                // SAFETY: posted slots; output holds world·count elements.
                unsafe {
                    let dst = bufs.output.add(p * count + offset);
                    copy_out(stream, arena.payload::<T>(p, g), dst, len);
                }
            }
            Ok(())
        })
    }

    /// Broadcast of `count` elements from `root`.
    pub fn broadcast<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
        root: Rank,
    ) -> Result<()> {
        let bytes = count * std::mem::size_of::<T>();
        if bytes > 0 && bytes <= MAILBOX_MAX_BYTES && self.world() > 1 {
            return self.mailbox_broadcast(call, sig, bufs, count, root);
        }
        let cma_ok = self.cma_suits(OpKind::Broadcast, bytes);
        if let Some(g) = self.enter_direct(
            call,
            sig,
            &bufs,
            (count, count),
            count,
            (cma_ok, Touches::InputOfRoot(root)),
        )? {
            let result = self.zero_copy_copies(call, sig, bufs, g, count, Some(root));
            return self.finish_direct(call, g, result);
        }
        let me = self.rank;
        let piece = self.staged_piece::<T>();
        let stream = streams::<T>(count);
        self.in_rounds(call, count, piece, |arena, g, offset, len| {
            if me == root {
                // SAFETY: the root's input holds count elements.
                unsafe { arena.stage(g, 0, bufs.input, offset, len) };
            }
            arena.post(g, sig);
            if me == root {
                if !bufs.in_place {
                    // SAFETY: distinct buffers of count elements each.
                    unsafe {
                        copy_out(stream, bufs.input.add(offset), bufs.output.add(offset), len)
                    };
                }
            } else {
                arena.await_peer(call, sig, root, g)?;
                // SAFETY: the root's slot is posted; output holds count elements.
                unsafe { arena.unstage(root, g, 0, bufs.output, offset, len, stream) };
            }
            Ok(())
        })
    }

    /// Reduce of `count` elements to `root`.
    pub fn reduce<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
        op: ReduceOp,
        root: Rank,
    ) -> Result<()> {
        if self.lane_fits(count * std::mem::size_of::<T>()) {
            return self.lane_reduce(call, sig, bufs, count, (op, root));
        }
        if let Some(g) = self.enter_direct(
            call,
            sig,
            &bufs,
            (count, count),
            count,
            (false, Touches::OutputOfRoot(root)),
        )? {
            let result = self.zero_copy_reduce(call, sig, bufs, g, count, (op, root));
            return self.finish_direct(call, g, result);
        }
        let (world, me) = (self.world(), self.rank);
        let piece = self.staged_piece::<T>();
        let stream = !bufs.in_place && streams::<T>(count);
        self.in_rounds(call, count, piece, |arena, g, offset, len| {
            if me != root || own_term_from_slot(me, bufs.in_place) {
                // SAFETY: input holds count elements.
                unsafe { arena.stage(g, 0, bufs.input, offset, len) };
            }
            arena.post(g, sig);
            if me == root {
                arena.await_all(call, sig, g)?;
                // SAFETY: posted slots; out of place the output is distinct
                // from the input; in place it holds the root's own term,
                // folded in place or read from its slot (`fold_with_own`).
                let out = unsafe { view_mut(bufs.output, offset, len) };
                write_out(stream, out, |block, at| {
                    let n = block.len();
                    let own = (!bufs.in_place).then(|| unsafe { view(bufs.input, offset + at, n) });
                    fold_with_own(op, block, (me, world), own, |p| unsafe {
                        view(arena.payload::<T>(p, g), at, n)
                    });
                    finish_avg(op, block, world);
                });
            }
            Ok(())
        })
    }

    /// All-to-all: block `q` of this rank's input goes to rank `q`.
    pub fn all_to_all<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
    ) -> Result<()> {
        let (world, me) = (self.world(), self.rank);
        let per = (self.staged_piece::<T>() / world).max(1);
        let stream = streams::<T>(world * count);
        self.in_rounds(call, count, per, |arena, g, offset, len| {
            for q in (0..world).filter(|&q| q != me) {
                // SAFETY: input holds world·count elements.
                unsafe { arena.stage(g, q * per, bufs.input, q * count + offset, len) };
            }
            arena.post(g, sig);
            arena.await_all(call, sig, g)?;
            for p in 0..world {
                // SAFETY: posted slots; distinct input and output buffers.
                unsafe {
                    if p == me {
                        copy_out(
                            stream,
                            bufs.input.add(me * count + offset),
                            bufs.output.add(me * count + offset),
                            len,
                        );
                    } else {
                        let at = p * count + offset;
                        arena.unstage(p, g, me * per, bufs.output, at, len, stream);
                    }
                }
            }
            Ok(())
        })
    }

    /// Barrier: one lane call with nothing in it.
    pub fn barrier(&mut self, call: &CallInfo, sig: &CallSig) -> Result<()> {
        self.last_direct = None;
        let k = self.lane_post(sig, |_| {});
        self.lane_await_all(call, sig, k)?;
        // As in `lane_exchange`: staged rounds no later round compared.
        if self.rounds_compared < self.round {
            self.compare_recent_rounds(call)?;
        }
        self.claim_next_lane(k);
        Ok(())
    }
}

/// The tag of a mailbox message: the call's sequence number (its low 32
/// bits) above its signature folded to 32 bits, made odd so that no tag is
/// 0, the tag of a unit that continues a message and of one never written.
fn mailbox_tag(sig: &CallSig, start: u64) -> u64 {
    let folded = (sig.signature ^ (sig.signature >> 32)) as u32 & !MAILBOX_TAG_LAP;
    let lap = if mailbox_lap_is_odd(start) {
        MAILBOX_TAG_LAP
    } else {
        0
    };
    u64::from(sig.seq as u32) << 32 | u64::from(folded | lap | MAILBOX_TAG_SET)
}

/// Bit 0 of every message tag: a tag is never 0 (a unit where no message
/// starts).
const MAILBOX_TAG_SET: u32 = 1;
/// Bit 1 of a message tag: the parity of the lap of the ring it was
/// written in. Every lap rewrites every unit, so what a reader finds
/// where its message belongs is this lap's tag or the last lap's, and the
/// parity tells them apart however many calls lie between: the call
/// number in a tag has 32 bits, and a unit's last message can be any
/// number of calls old (small all-reduces in between never touch the
/// mailbox), so without the parity a tag 2³² calls old would read as
/// this call's, and one 2³¹ as a later call's (a false mismatch).
const MAILBOX_TAG_LAP: u32 = 2;

/// Whether unit `start` (counted from the ring's first use) lies in an odd
/// lap of the ring.
fn mailbox_lap_is_odd(start: u64) -> bool {
    (start / MAILBOX_UNITS) % 2 == 1
}

/// Whether `tag`, found at unit `start`, was written in the ring's current
/// lap there: the start of a message this rank has not read yet.
fn mailbox_tag_current(tag: u64, start: u64) -> bool {
    let lap = if mailbox_lap_is_odd(start) {
        MAILBOX_TAG_LAP
    } else {
        0
    };
    tag != 0 && tag as u32 & MAILBOX_TAG_LAP == lap
}

/// Whether mailbox tag `tag`, found at unit `start` where this call's
/// message belongs, is another call's message: one written in this lap
/// (the last lap's is stale, and 0 is no message) that is not this call's.
fn mailbox_tag_foreign(tag: u64, sig: &CallSig, start: u64) -> bool {
    mailbox_tag_current(tag, start) && tag != mailbox_tag(sig, start)
}

/// Broadcasts of at most [`MAILBOX_MAX_BYTES`] through the root's
/// *mailbox*, the counterpart of Open MPI's fast boxes: a ring of 16-byte
/// units, each a tag word and a payload word, written only by its owner.
/// A message of `n` bytes takes `⌈n / 8⌉` consecutive units (wrapping
/// around the ring). The root writes their payload words, a zero tag on
/// every unit but the first, then releases the first unit's tag, which
/// names the call ([`mailbox_tag`]); readers wait for that tag, copy the
/// payload out and move on. No slot round and no reply: the root returns
/// at once, and consecutive small messages share cache lines, so a reader
/// running behind takes several per line that crosses between the cores.
///
/// The root overwrites a unit only after every reader has told it (in its
/// row of read positions) that it read past it. Tags and payload have
/// words of their own, so a reader never mistakes payload for a tag; and
/// every lap rewrites every tag (zero where a message continues), so a
/// stale tag is less than a lap old and never matches a later call's.
impl Arena {
    /// Unit `unit` (counted from the ring's start, wrapping) of `root`'s
    /// mailbox: its tag word and its payload word.
    fn mailbox_unit(&self, root: Rank, unit: u64) -> (&AtomicU64, *mut u64) {
        let at = self.geometry.mailboxes_offset()
            + root * MAILBOX_BYTES
            + (unit % MAILBOX_UNITS) as usize * MAILBOX_UNIT;
        // SAFETY: root < world and the unit lies in its ring, which lies in
        // the region; units are 16-byte aligned and the tag is an atomic.
        unsafe {
            let unit = self.base.add(at);
            (&*(unit as *const AtomicU64), unit.add(8) as *mut u64)
        }
    }

    /// How far `reader` has told `root` it read `root`'s mailbox (units).
    fn read_position(&self, reader: Rank, root: Rank) -> &AtomicU64 {
        let g = &self.geometry;
        let at = g.read_positions_offset() + reader * g.read_positions_stride() + root * 8;
        // SAFETY: reader, root < world: the word lies in the reader's row.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    /// Broadcast of `count` elements, 0 < `count·size_of::<T>()` ≤
    /// [`MAILBOX_MAX_BYTES`], through `root`'s mailbox.
    fn mailbox_broadcast<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        count: usize,
        root: Rank,
    ) -> Result<()> {
        self.last_direct = None;
        let bytes = count * std::mem::size_of::<T>();
        let start = self.mailbox_next[root];
        let end = start + bytes.div_ceil(8) as u64;
        if self.rank == root {
            self.mailbox_reserve(call, end)?;
            // SAFETY: the input holds count elements, `bytes` bytes.
            let input = unsafe { std::slice::from_raw_parts(bufs.input.cast::<u8>(), bytes) };
            for (i, chunk) in input.chunks(8).enumerate() {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                let (tag, payload) = self.mailbox_unit(root, start + i as u64);
                if i > 0 {
                    tag.store(0, Ordering::Relaxed);
                }
                // SAFETY: every reader has read past this unit (reserved).
                unsafe { payload.write(u64::from_ne_bytes(word)) };
            }
            let (tag, _) = self.mailbox_unit(root, start);
            tag.store(mailbox_tag(sig, start), Ordering::Release);
            self.notify();
            self.mailbox_check_no_other_root(call, sig)?;
            if !bufs.in_place {
                // SAFETY: distinct buffers of count elements each.
                unsafe { std::ptr::copy_nonoverlapping(bufs.input, bufs.output, count) };
            }
        } else {
            self.mailbox_await(call, sig, root, start)?;
            let output = bufs.output.cast::<u8>();
            for (i, at) in (0..bytes).step_by(8).enumerate() {
                let (_, payload) = self.mailbox_unit(root, start + i as u64);
                // SAFETY: the message is released (awaited) and not
                // rewritten before this rank tells the root it read it; the
                // output holds `bytes` bytes.
                unsafe {
                    let word = payload.read().to_ne_bytes();
                    std::ptr::copy_nonoverlapping(
                        word.as_ptr(),
                        output.add(at),
                        (bytes - at).min(8),
                    );
                }
            }
            if start / MAILBOX_TELL_EVERY != end / MAILBOX_TELL_EVERY {
                self.read_position(self.rank, root)
                    .store(end, Ordering::Release);
                self.notify();
            }
        }
        self.mailbox_next[root] = end;
        // As in `lane_exchange`, without waiting, the staged rounds every
        // peer has posted by now: a rank that received has them all from
        // the root; the root, which waits for nobody, compares what its
        // peers have posted, here or at a later call.
        if self.rounds_compared < self.round {
            self.compare_recent_rounds(call)?;
        }
        Ok(())
    }

    /// As root of mailbox broadcast `sig`, after posting: no peer has a
    /// message in its mailbox, unread by this rank, for this call or an
    /// earlier one. When ranks agree, this rank has read every message of
    /// every earlier call a peer rooted, and no peer roots this one, so an
    /// unread message a peer posted is for a later call (a peer runs ahead
    /// by less than a ring of units and a few rounds: far from the 2^31
    /// calls where the 32-bit comparison would wrap). One there is a root
    /// that differs between ranks, each of which only writes. Both sides
    /// store (their tag; `notify`'s fence) and then load the other's, so of
    /// two ranks that each took themselves for the root at least one sees
    /// the other's message here in that call; the other, at its next
    /// mailbox root call (or its next wait, on the failed rank). The cost:
    /// a load per peer of a line the peer rarely writes.
    fn mailbox_check_no_other_root(&self, call: &CallInfo, sig: &CallSig) -> Result<()> {
        for p in (0..self.world()).filter(|&p| p != self.rank) {
            let at = self.mailbox_next[p];
            let tag = self.mailbox_unit(p, at).0.load(Ordering::Acquire);
            let their_seq = (tag >> 32) as u32;
            if mailbox_tag_current(tag, at) && (sig.seq as u32).wrapping_sub(their_seq) as i32 >= 0
            {
                return Err(call.error(
                    p,
                    TransportError::Mismatch(format!(
                        "rank {p} broadcast call #{their_seq} (modulo 2^32) from its own mailbox, \
                         which this rank never read; this rank is the root of call #{}: \
                         the ranks ran different calls (a different root on each rank?)",
                        sig.seq
                    )),
                ));
            }
        }
        Ok(())
    }

    /// As root, waits until this rank's mailbox may be written up to unit
    /// `end`: every reader has told it it read past `end - MAILBOX_UNITS`.
    fn mailbox_reserve(&mut self, call: &CallInfo, end: u64) -> Result<()> {
        if end <= self.mailbox_room {
            return Ok(());
        }
        let me = self.rank;
        let mut room = u64::MAX;
        for reader in (0..self.world()).filter(|&r| r != me) {
            let position = self.read_position(reader, me);
            // A reader that left reads no more: its units are free. The
            // position is in memory the reader writes: saturating, so that
            // a corrupt one cannot overflow (a panic in debug builds).
            self.wait(call, reader, true, || {
                position
                    .load(Ordering::Acquire)
                    .saturating_add(MAILBOX_UNITS)
                    >= end
            })?;
            room = room.min(
                position
                    .load(Ordering::Acquire)
                    .saturating_add(MAILBOX_UNITS),
            );
        }
        self.mailbox_room = room;
        Ok(())
    }

    /// Waits for `root`'s message of this call at unit `start`. A tag of
    /// another call there, or the root posting a slot round (it runs a
    /// staged call where this rank runs a broadcast), is a mismatch.
    fn mailbox_await(&self, call: &CallInfo, sig: &CallSig, root: Rank, start: u64) -> Result<()> {
        let expected = mailbox_tag(sig, start);
        let (tag, _) = self.mailbox_unit(root, start);
        let round = self.round;
        let header = self.header(root, round);
        self.wait_watching(
            call,
            root,
            false,
            || {
                let found = tag.load(Ordering::Acquire);
                found == expected || mailbox_tag_foreign(found, sig, start)
            },
            || header.posted.load(Ordering::Acquire) == round + 1 || self.posted_in_lanes(root),
        )?;
        // Read again: a root that posted a later round wrote this message
        // first, and the acquire load of the header made it visible.
        let found = tag.load(Ordering::Acquire);
        if found == expected {
            return Ok(());
        }
        let posted_round = header.posted.load(Ordering::Acquire) == round + 1;
        Err(if posted_round || self.posted_in_lanes(root) {
            let (seq, signature) = if posted_round {
                (&header.seq, &header.signature)
            } else {
                let lane = self.lane_header(root, self.lane_calls);
                (&lane.seq, &lane.signature)
            };
            let (seq, signature) = (
                seq.load(Ordering::Relaxed),
                signature.load(Ordering::Relaxed),
            );
            mismatch(
                call,
                sig,
                root,
                &format!("call #{seq} with signature {signature:#x}, where this rank awaits its broadcast"),
            )
        } else {
            mismatch(
                call,
                sig,
                root,
                &format!(
                    "a broadcast tagged {:#x} (call #{} modulo 2^32) where this call's tag is {expected:#x}",
                    found,
                    found >> 32
                ),
            )
        })
    }
}

/// Arenas for the groups of a split, made through the parent's arena, so
/// split groups (tensor-parallel groups, say) get the same fast path.
impl Arena {
    /// Called by every rank of the parent, in the same order as its other
    /// calls, right after the split's table exchange. `members` are the
    /// parent ranks of this rank's group in child-rank order (`None`: no
    /// group). Two rounds: each group's first member makes the child's
    /// memory and posts a handle (a heap block's address for threads, a
    /// success flag for a segment named after the parent's and `ctx` for
    /// processes); the others take it; then a barrier, after which the maker
    /// drops its extra reference or removes the segment's name.
    pub fn make_child(
        &mut self,
        call: &CallInfo,
        seq: u64,
        members: Option<&[Rank]>,
        ctx: u64,
    ) -> Result<Option<Arena>> {
        let sig = CallSig {
            seq,
            signature: signature(OpKind::Split, 0xff, None, 0, 0x5b11),
        };
        let group = members.filter(|m| m.len() > 1);
        let leads = group.is_some_and(|m| m[0] == self.rank);
        let geometry = group.map(|m| Geometry::new(m.len()));
        let shm_name = |parent: &str| format!("{parent}-{ctx:x}");
        let g = self.begin(call)?;
        let mut made_segment = None;
        let handle: u64 = match (leads, geometry, &*self.memory) {
            // Without the memory the group uses the links, as on shared
            // memory below.
            (true, Some(geometry), Memory::Heap { .. }) => {
                heap_memory(geometry).map_or(0, |m| Arc::into_raw(m) as usize as u64)
            }
            (true, Some(geometry), Memory::Shm(parent)) => {
                match Segment::create_with_region(
                    &shm_name(parent.name()),
                    0,
                    4096,
                    geometry.bytes(),
                ) {
                    Ok(segment) => {
                        made_segment = Some(segment);
                        1
                    }
                    Err(e) => {
                        eprintln!(
                            "oxccl: rank {}: no shared arena for a split group ({e}); it uses the rings",
                            self.rank
                        );
                        0
                    }
                }
            }
            _ => 0,
        };
        // SAFETY: the payload holds far more than one word.
        unsafe { self.payload::<u64>(self.rank, g).write(handle) };
        self.post(g, &sig);
        self.await_all(call, &sig, g)?;
        let mut memory = None;
        if let (Some(members), Some(_)) = (group, geometry) {
            // SAFETY: posted in round g.
            let posted = unsafe { self.payload::<u64>(members[0], g).read() };
            memory = match (&*self.memory, posted) {
                (_, 0) => None,
                (Memory::Heap { .. }, ptr) => {
                    let ptr = ptr as usize as *const Memory;
                    // SAFETY: the leader leaked one reference with
                    // `into_raw` and keeps it until after the barrier below.
                    unsafe {
                        Arc::increment_strong_count(ptr);
                        Some(Arc::from_raw(ptr))
                    }
                }
                (Memory::Shm(parent), _) => match made_segment.take() {
                    Some(own) => Some(Arc::new(Memory::Shm(own))),
                    // A member that cannot map it (out of descriptors or
                    // address space) says so below, and the whole group
                    // uses the links, as when the leader cannot make it;
                    // failing here would fail the parent on every rank.
                    None => match Segment::open(&shm_name(parent.name())) {
                        // Checked like the job's arena (`Arena::shared`).
                        Ok(segment) if segment.region().1 < geometry.map_or(0, |g| g.bytes()) => {
                            eprintln!(
                                "oxccl: rank {}: a split group's arena {} is too small for \
                                 the group; the group uses the rings",
                                self.rank,
                                segment.name()
                            );
                            None
                        }
                        Ok(segment) => Some(Arc::new(Memory::Shm(segment))),
                        Err(e) => {
                            eprintln!(
                                "oxccl: rank {}: cannot map a split group's arena ({e}); \
                                 the group uses the rings",
                                self.rank
                            );
                            None
                        }
                    },
                },
            };
        }
        self.finish(g);
        // The barrier after which the leader may let go of what it made;
        // each rank posts whether it holds the group's memory.
        let holds = memory.is_some() || geometry.is_none();
        let b = self.begin(call)?;
        // SAFETY: the payload holds far more than one word.
        unsafe { self.payload::<u64>(self.rank, b).write(u64::from(holds)) };
        self.post(b, &sig);
        self.await_all(call, &sig, b)?;
        // SAFETY: posted in round b.
        let all_hold = group.is_none_or(|members| {
            members
                .iter()
                .all(|&m| unsafe { self.payload::<u64>(m, b).read() } == 1)
        });
        self.finish(b);
        if leads {
            match (&memory, handle) {
                // SAFETY: the reference leaked above; every member took its own.
                (Some(m), h) if matches!(**m, Memory::Heap { .. }) && h != 0 => unsafe {
                    drop(Arc::from_raw(h as usize as *const Memory));
                },
                (Some(m), _) => {
                    if let Memory::Shm(segment) = &**m {
                        segment.unlink_now();
                    }
                }
                _ => {}
            }
        }
        if !all_hold {
            // A member could not map the group's memory: every member
            // drops its own and the group uses the links.
            memory = None;
        }
        let (Some(members), Some(geometry), Some(memory)) = (group, geometry, memory) else {
            return Ok(None);
        };
        let child_rank = members.iter().position(|&r| r == self.rank).unwrap_or(0);
        let mut child = Arena::attach(
            memory,
            geometry,
            child_rank,
            self.watch_pids,
            self.aborted.clone(),
            self.timeout,
        );
        child.cma = self.cma;
        if self.oversubscribed() {
            child.mark_oversubscribed();
        }
        child.streaming_slots = self.streaming_slots;
        Ok(Some(child))
    }
}

/// The zero-copy paths, for ranks that share one address space (threads).
///
/// A call is two rounds: in the first each rank posts the addresses of its
/// input and output; then every rank reads (and, for all-reduce, writes)
/// the others' buffers directly; in the second each rank says it is done,
/// and nobody returns before everyone is, so no buffer is touched after its
/// owner's call returned; a rank whose call fails after its post waits in
/// [`Arena::withdraw`] for the same. In all-reduce rank `r` alone reads and writes
/// share `r` of every buffer; elsewhere a rank writes only its own output.
impl Arena {
    /// Which algorithm a call of `op` with `bytes` in its largest buffer
    /// (elements of `elem` bytes) uses, for reports.
    pub fn algorithm_name(&self, op: OpKind, bytes: usize, elem: usize) -> &'static str {
        // A split exchanges its colours and keys as an all-gather (see
        // `comm.rs`'s arena dispatch), and takes the same path.
        let op = if op == OpKind::Split {
            OpKind::AllGather
        } else {
            op
        };
        let zero_copy_op = matches!(
            op,
            OpKind::AllReduce
                | OpKind::ReduceScatter
                | OpKind::AllGather
                | OpKind::Broadcast
                | OpKind::Reduce
        );
        let capacity = self.geometry.payload_bytes() / elem.max(1) * elem.max(1);
        // In the order the collectives decide: the lanes first (on what
        // each rank posts: an all-gather's part, the others' whole input).
        match op {
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::Reduce if self.lane_fits(bytes) => {
                "lane"
            }
            OpKind::AllGather if self.lane_fits(bytes / self.world()) => "lane",
            OpKind::Barrier => "lane",
            _ if zero_copy_op && !self.watch_pids && bytes >= self.zero_copy_min_bytes(op) => {
                "zerocopy"
            }
            OpKind::Broadcast if bytes > 0 && bytes <= MAILBOX_MAX_BYTES && self.world() > 1 => {
                "mailbox"
            }
            OpKind::AllGather | OpKind::Broadcast if self.cma_suits(op, bytes) => "cma",
            OpKind::AllReduce if bytes <= capacity => "oneshot",
            OpKind::AllReduce => "twoshot",
            _ => "direct",
        }
    }

    /// Whether an all-gather or a broadcast with `bytes` in its largest
    /// buffer reads the peers' buffers by CMA (when the set-up probe allowed
    /// it) instead of staging. With streaming slot stores never: a staged
    /// piece then moves through memory, which beat CMA at every size
    /// measured (Zen 4 VM, far placement, 2 processes, alternating):
    /// all-gather 16 KiB 1.6 against 3.6 µs, 64 KiB 4.2–4.7 against
    /// 5.5–5.8, 512 KiB 28–31 against 28–50, 16 MiB 1.10–1.13 against
    /// 1.42–1.75 ms, 64 MiB 4.9–5.2 against 5.7–7.0 ms; broadcast 16 KiB
    /// 1.27 against 3.5 µs, 256 KiB 14.7–15.5 against 20.7–23.5, 16 MiB
    /// 1.25–1.27 against 2.26–2.34 ms. With cached stores from
    /// [`CMA_MIN_BYTES`] on Intel CPUs (measured there); on AMD ones by
    /// [`CACHED_AMD_ALL_GATHER_CMA_BYTES`] and
    /// [`CACHED_AMD_BROADCAST_CMA_BYTES`].
    ///
    /// Never with more ranks than CPUs either: a CMA broadcast's root (and
    /// every all-gather rank) waits in `leave` until each reader has copied,
    /// and a reader that is not running holds it there, where staging lets
    /// the root post and return. 4 processes on the 2-vCPU Zen 4 VM,
    /// cached stores forced (CMA against staging, out of place / in place,
    /// three rounds, two far and one near): broadcast 64 KiB 21–34 / 23–38
    /// against 12–16 / 11–13 µs, 256 KiB 53–97 / 48–110 against 28–37 /
    /// 24–28, 1 MiB 195–323 / 170–334 against 106–148 / 90–98, 4 MiB
    /// 0.75–2.25 / 0.87–1.85 against 0.50–0.78 / 0.39–0.65 ms; all-gather
    /// 64 KiB 27–42 / 25–41 against 11–17 / 10–17 µs.
    fn cma_suits(&self, op: OpKind, bytes: usize) -> bool {
        if !self.cma || self.streaming_slots || self.oversubscribed() {
            return false;
        }
        let amd = stream::cpu_vendor_is_amd();
        match op {
            OpKind::AllGather if amd => CACHED_AMD_ALL_GATHER_CMA_BYTES.contains(&bytes),
            OpKind::Broadcast if amd => CACHED_AMD_BROADCAST_CMA_BYTES.contains(&bytes),
            _ => bytes >= CMA_MIN_BYTES,
        }
    }

    /// Decides whether a call of `elements` (its largest buffer) reaches
    /// the peers' buffers directly, and if so enters it (posting this
    /// rank's buffers, awaiting everyone's): threads from
    /// [`zero_copy_min_bytes`](Self::zero_copy_min_bytes);
    /// across processes, zero-copy from there too when the
    /// inputs and outputs the call touches (`touches`) lie
    /// in one shared allocation each
    /// ([`all_in_one_allocation`](Self::all_in_one_allocation)), else CMA
    /// when the caller says it suits (`cma_ok`: all-gather and broadcast,
    /// [`cma_suits`](Self::cma_suits)). Every rank takes the same decision:
    /// it depends only on the call, on `shared_ever`, on the slot stores,
    /// the CMA probe and [`oversubscribed`](Self::oversubscribed) (equal
    /// everywhere), on the allocations made (collective) and on what every
    /// rank posted. `lens` are the input's and output's lengths in
    /// elements.
    fn enter_direct<T>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: &Buffers<T>,
        lens: (usize, usize),
        elements: usize,
        (cma_ok, touches): (bool, Touches),
    ) -> Result<Option<u64>> {
        let entered = self.decide_direct(call, sig, bufs, lens, elements, (cma_ok, touches))?;
        self.last_direct = entered.map(|_| self.direct);
        Ok(entered)
    }

    /// The decision of [`enter_direct`](Self::enter_direct).
    fn decide_direct<T>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: &Buffers<T>,
        lens: (usize, usize),
        elements: usize,
        (cma_ok, touches): (bool, Touches),
    ) -> Result<Option<u64>> {
        let bytes = elements * std::mem::size_of::<T>();
        self.root_pushes_all = false;
        if !self.watch_pids {
            self.direct = Direct::Local;
            return if bytes >= self.zero_copy_min_bytes(call.op) {
                self.enter(call, sig, bufs, lens).map(Some)
            } else {
                Ok(None)
            };
        }
        let want_mapped = self.shared_ever && bytes >= self.zero_copy_min_bytes(call.op);
        let want_cma = cma_ok;
        if !want_mapped && !want_cma {
            return Ok(None);
        }
        let k = self.enter(call, sig, bufs, lens)?;
        let elem = std::mem::size_of::<T>();
        let span = (lens.0 * elem, lens.1 * elem);
        let mapped = want_mapped
            .then(|| self.all_in_one_allocation(k, span, std::mem::align_of::<T>(), touches))
            .flatten();
        if let Some(reach) = mapped {
            self.direct = Direct::Mapped;
            self.root_pushes_all = reach == Reach::RootPushesAll;
            Ok(Some(k))
        } else if want_cma {
            self.direct = Direct::Cma;
            Ok(Some(k))
        } else {
            // Every rank decided alike from the same posted words; the
            // lane call is complete, and the staged path follows.
            Ok(None)
        }
    }

    /// Where a buffer of `len` bytes lies, as one posted word:
    /// `(allocation number + 1) << PLACE_OFFSET_BITS | offset`, or 0 when
    /// it is not in a live shared allocation of this rank (or its number
    /// or offset does not fit the word: the call then takes another path).
    fn locate(&self, ptr: *const u8, len: usize) -> u64 {
        self.shared
            .iter()
            .filter(|e| !e.maps.is_empty() && e.alive())
            .find_map(|e| {
                e.offset_of(ptr, len)
                    .map(|at| place_word(e.id + 1, at as u64))
            })
            .unwrap_or(0)
    }

    /// Whether every buffer the call touches (`touches`), as posted in lane
    /// call `k`, lies in shared allocations: every input it reads in one
    /// and the same allocation, every output it writes in one and the same
    /// (maybe another). Buffers the call leaves alone (a broadcast's inputs
    /// off the root, which may be empty; a reduce's outputs off the root)
    /// may lie anywhere. Each rank must also hold alive every allocation in
    /// which it reaches a peer's buffer: one of its own posted buffers lies
    /// in it (the caller borrows that buffer for the call, so the region
    /// cannot be unmapped meanwhile; a rank that posted none there may have
    /// dropped its handle and its mapping). Returns how the ranks reach
    /// each other's buffers, or `None` when the call cannot go zero-copy.
    ///
    /// Every rank decides alike: only posted words and the allocations
    /// (collective, so the same everywhere) go into the answer.
    fn all_in_one_allocation(
        &self,
        k: u64,
        (in_bytes, out_bytes): (usize, usize),
        align: usize,
        touches: Touches,
    ) -> Option<Reach> {
        let places = |p: Rank| {
            let slot = self.lane_payload::<u64>(p, k);
            // SAFETY: posted in lane call k (awaited by `enter`).
            unsafe { (slot.add(2).read(), slot.add(3).read()) }
        };
        let tag = |place: u64| place >> PLACE_OFFSET_BITS;
        let fits = |place: u64, len: usize| place_fits(&self.allocation_bytes, place, len, align);
        // The allocation every touched input (output) lies in, once seen.
        let (mut inputs_in, mut outputs_in) = (None, None);
        let agrees = |want: &mut Option<u64>, place: u64, len: usize| {
            // `place_fits` refuses tag 0 ("not in a shared allocation").
            fits(place, len) && *want.get_or_insert(tag(place)) == tag(place)
        };
        let all_placed = (0..self.world()).all(|p| {
            let (input, output) = places(p);
            let (reads_input, writes_output) = touches.of(p);
            (!reads_input || agrees(&mut inputs_in, input, in_bytes))
                && (!writes_output || agrees(&mut outputs_in, output, out_bytes))
        });
        let all_hold = |reach: Reach| {
            (0..self.world()).all(|p| {
                let own = places(p);
                let holds = |used: Option<u64>, reached: bool| {
                    // A used tag is never 0 (`place_fits` refused it).
                    !reached || used.is_none_or(|t| tag(own.0) == t || tag(own.1) == t)
                };
                let (inputs, outputs) = touches.reached_by(p, reach);
                holds(inputs_in, inputs) && holds(outputs_in, outputs)
            })
        };
        if !all_placed {
            return None;
        }
        [Reach::Pull, Reach::RootPushesAll]
            .into_iter()
            .filter(|&reach| reach == Reach::Pull || matches!(touches, Touches::InputOfRoot(_)))
            .find(|&reach| all_hold(reach))
    }

    /// Posts this rank's buffer addresses (and where they lie in shared
    /// allocations) and waits for everyone's, in a lane call (no round:
    /// a direct call's two synchronisations cost what a small all-reduce
    /// costs). Returns the lane call, which names the posted words until
    /// [`leave`](Self::leave).
    fn enter<T>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: &Buffers<T>,
        (in_len, out_len): (usize, usize),
    ) -> Result<u64> {
        let elem = std::mem::size_of::<T>();
        let words = [
            bufs.input as usize as u64,
            bufs.output as usize as u64,
            self.locate(bufs.input.cast(), in_len * elem),
            self.locate(bufs.output.cast_const().cast(), out_len * elem),
        ];
        // Four words, in the lane header's cache line: a peer that sees the
        // post reads them without another line transfer.
        // SAFETY: the lane payload holds far more than four words.
        let k = self.lane_post(sig, |payload| unsafe {
            std::ptr::copy_nonoverlapping(words.as_ptr(), payload.cast::<u64>(), words.len())
        });
        if let Err(e) = self.lane_await_all(call, sig, k) {
            self.withdraw(call, k, &e);
            return Err(e);
        }
        // As every lane call: the staged rounds before this call are
        // compared here, or ranks that disagreed in a call that only posts
        // (a broadcast's root, a reduce's non-root) would never hear of it
        // while only direct calls follow.
        if self.rounds_compared < self.round {
            if let Err(e) = self.compare_recent_rounds(call) {
                self.withdraw(call, k, &e);
                return Err(e);
            }
        }
        Ok(k)
    }

    /// Ends a direct call that entered in lane call `k` with `result` (its
    /// body and [`leave`](Self::leave)): on an error, withdraws first.
    fn finish_direct(&self, call: &CallInfo, k: u64, result: Result<()>) -> Result<()> {
        if let Err(e) = &result {
            self.withdraw(call, k, e);
        }
        result
    }

    /// After a direct call that posted this rank's buffers in lane call `k`
    /// failed here: takes the post back and waits until no peer can touch
    /// the buffers any more, so that they are the caller's again when the
    /// call returns (it may free or reuse them).
    ///
    /// A peer touches them only after seeing the post and before posting
    /// lane call `k + 1` (its `leave`). So: this rank fails (peers that
    /// look stop waiting on it) and replaces the post with
    /// [`REVOKED_POST`]; then, for every peer that posted lane call `k`
    /// (it may have seen ours), waits until it posts `k + 1`, fails, leaves
    /// or dies. A peer that had not posted `k` when looked at will not see
    /// ours: both sides store (its post, our revocation), fence, then load
    /// the other's word, so at least one sees the other's store. The wait
    /// ends when the peer's work does (bounded CPU or CMA copies) or its
    /// own wait fails (its timeout, at the latest); only a peer stopped
    /// mid-call (a debugger, `SIGSTOP`) can hold it longer, and the rank
    /// then says on stderr what it waits for.
    fn withdraw(&self, call: &CallInfo, k: u64, error: &crate::error::Error) {
        // With the failure's cause, as `Communicator::fail` then writes
        // it: the peers this waits for read it first.
        self.mark_failed(FailureCause::of(error));
        let own = self.lane_header(self.rank, k);
        let mine = (
            own.seq.load(Ordering::Relaxed),
            own.signature.load(Ordering::Relaxed),
        );
        // A peer that posted another call in this lane call never uses
        // these buffers. When every peer did (the failure was a mismatch
        // with all of them), the post stays: a peer looking at it later
        // then reports the mismatch rather than a lost rank.
        let may_match = |p: Rank| {
            let h = self.lane_header(p, k);
            h.posted.load(Ordering::Acquire) != k + 1
                || (
                    h.seq.load(Ordering::Relaxed),
                    h.signature.load(Ordering::Relaxed),
                ) == mine
        };
        if !(0..self.world()).any(|p| p != self.rank && may_match(p)) {
            return;
        }
        own.posted.store(REVOKED_POST, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let start = Instant::now();
        for p in (0..self.world()).filter(|&p| p != self.rank) {
            let mut told = false;
            let mut next_liveness = Instant::now();
            loop {
                let using = self.lane_header(p, k).posted.load(Ordering::Acquire) == k + 1
                    && self.lane_header(p, k + 1).posted.load(Ordering::Acquire) != k + 2
                    && !matches!(self.state(p), STATE_DEPARTED | STATE_FAILED);
                if !using {
                    break;
                }
                let now = Instant::now();
                if self.watch_pids && now >= next_liveness {
                    next_liveness = now + LIVENESS_INTERVAL;
                    if self.peer_pid(p) != 0 && !self.peer_process_alive(p) {
                        break;
                    }
                }
                if !told && now >= start + self.timeout {
                    told = true;
                    eprintln!(
                        "oxccl: rank {}: {} #{} failed; waiting for rank {p}, which still \
                         works on this rank's buffers, before returning",
                        call.rank, call.op, call.seq
                    );
                }
                if now < start + SLEEP_AFTER {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
    }

    /// Rank `p`'s `(input, output)` addresses, posted in lane call `k`, as
    /// this process reaches them: as posted between threads and for CMA,
    /// translated into this process's mapping of `p`'s allocation when the
    /// call runs [`Direct::Mapped`].
    fn buffers_of<T>(&self, p: Rank, k: u64) -> (*const T, *mut T) {
        let slot = self.lane_payload::<u64>(p, k);
        // Only the words this path needs: a peer's are in another core's
        // cache.
        // SAFETY: posted in lane call k (awaited by `enter`).
        let word = |i: usize| unsafe { slot.add(i).read() };
        if self.direct != Direct::Mapped || p == self.rank {
            return (word(0) as usize as *const T, word(1) as usize as *mut T);
        }
        let translate = |place: u64| -> *mut T {
            let (tag, at) = (place >> PLACE_OFFSET_BITS, place & PLACE_OFFSET_MASK);
            self.shared
                .iter()
                .find(|e| e.id + 1 == tag)
                .and_then(|e| e.maps.get(p))
                // `all_in_one_allocation` checked, for every buffer the call
                // touches, that the allocation is alive (this rank's own
                // buffer in it is borrowed for the call) and that p's buffer
                // lies inside p's block. A buffer the call leaves alone was
                // not checked: its address is computed (wrapping, so that a
                // peer's stray word is no out-of-bounds `add`) but never used.
                .map(|&block| block.wrapping_add(at as usize).cast::<T>())
                .unwrap_or(std::ptr::null_mut())
        };
        (translate(word(2)).cast_const(), translate(word(3)))
    }

    /// Takes the reusable address lists, filled with every rank's buffers
    /// of round `g`, the inputs moved by `input_offset` elements; give them
    /// back with `self.peer_buffers = …` when the call is done with them.
    fn take_peer_buffers<T>(&mut self, k: u64, input_offset: usize) -> PeerBuffers {
        let mut lists = std::mem::take(&mut self.peer_buffers);
        lists.inputs.clear();
        lists.outputs.clear();
        for p in 0..self.world() {
            let (input, output) = self.buffers_of::<T>(p, k);
            lists.inputs.push(input.wrapping_add(input_offset).cast());
            lists.outputs.push(output.cast());
        }
        lists
    }

    /// A collective allocation of `bytes` per rank (see
    /// [`SharedBuffer`](crate::host::SharedBuffer)). Across processes: every
    /// rank creates a segment, then (one round later) maps every peer's,
    /// then (another round) unlinks its name; any rank's failure is every
    /// rank's error. Between threads: this process's heap.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`](crate::Error::Bootstrap) naming the rank whose
    /// segment could not be made or mapped; the round errors (timeout,
    /// lost peer, abort).
    pub fn alloc_shared(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bytes: usize,
    ) -> Result<Arc<SharedRegion>> {
        let id = self.next_shared;
        self.next_shared += 1;
        let region = if !self.watch_pids {
            // Every rank says whether it got its block, so that all fail
            // alike and stay in step.
            let mine = SharedRegion::heap(id, bytes);
            let mine_err = mine
                .is_none()
                .then(|| format!("the system would not allocate {bytes} bytes"));
            self.agree(call, sig, mine_err, "allocate its block")?;
            Arc::new(mine.ok_or_else(|| crate::error::Error::Bootstrap {
                context: format!("rank {}: alloc_shared", self.rank),
                detail: "a block is missing after set-up".into(),
            })?)
        } else {
            let prefix = match &*self.memory {
                Memory::Shm(arena_segment) => arena_segment.name().to_owned(),
                Memory::Heap { .. } => format!("/oxccl-{}-heap", std::process::id()),
            };
            let name = |rank: Rank| format!("{prefix}-s{id}-{rank}");
            let mine = Segment::create_with_region(&name(self.rank), 0, 4096, bytes.max(1));
            let mine_err = mine.as_ref().err().map(|e| e.to_string());
            self.agree(call, sig, mine_err, "create its block")?;
            let mut mine = mine.map_err(|e| crate::error::Error::Bootstrap {
                context: format!("rank {}: alloc_shared", self.rank),
                detail: e.to_string(),
            })?;
            let peers: std::io::Result<Vec<Option<Segment>>> = (0..self.world())
                .map(|p| {
                    if p == self.rank {
                        Ok(None)
                    } else {
                        Segment::open(&name(p)).and_then(|segment| {
                            // A peer's block smaller than this call's is
                            // not one of this allocation.
                            if segment.region().1 < bytes {
                                Err(std::io::Error::other(format!(
                                    "{} holds {} bytes, not {bytes}",
                                    segment.name(),
                                    segment.region().1
                                )))
                            } else {
                                Ok(Some(segment))
                            }
                        })
                    }
                })
                .collect();
            let peers_err = peers.as_ref().err().map(|e| e.to_string());
            self.agree(call, sig, peers_err, "map its peers' blocks")?;
            mine.unlink();
            let mut peers = peers.unwrap_or_default();
            let mut mine = Some(mine);
            let segments: Vec<Segment> = (0..self.world())
                .map(|p| {
                    if p == self.rank {
                        mine.take()
                    } else {
                        peers[p].take()
                    }
                })
                .collect::<Option<_>>()
                .ok_or_else(|| crate::error::Error::Bootstrap {
                    context: format!("rank {}: alloc_shared", self.rank),
                    detail: "a block is missing after set-up".into(),
                })?;
            Arc::new(SharedRegion::mapped(id, bytes, self.rank, segments))
        };
        self.shared.retain(SharedEntry::alive);
        self.shared.push(SharedEntry::of(&region));
        let number = usize::try_from(id).unwrap_or(usize::MAX);
        if self.allocation_bytes.len() <= number {
            self.allocation_bytes.resize(number.saturating_add(1), None);
        }
        self.allocation_bytes[number] = Some(bytes);
        self.shared_ever = true;
        // Across processes, calls on these buffers run zero copy from
        // ZERO_COPY_MIN_BYTES: the lanes stop below it. Between threads
        // any buffer already could, and the lanes keep their reach.
        if self.watch_pids {
            self.lane_max_bytes = self.lane_max_bytes.min(ZERO_COPY_MIN_BYTES - 1);
        }
        Ok(region)
    }

    /// One round in which every rank says whether its step (`what`)
    /// worked; an error on any rank is an error on every rank.
    fn agree(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        failure: Option<String>,
        what: &str,
    ) -> Result<()> {
        let g = self.begin(call)?;
        // SAFETY: the slot holds far more than one word.
        unsafe {
            self.payload::<u64>(self.rank, g)
                .write(u64::from(failure.is_none()))
        };
        self.post(g, sig);
        self.await_all(call, sig, g)?;
        // SAFETY: posted in round g.
        let failed: Vec<Rank> = (0..self.world())
            .filter(|&p| unsafe { self.payload::<u64>(p, g).read() } != 1)
            .collect();
        self.finish(g);
        if failed.is_empty() {
            return Ok(());
        }
        Err(crate::error::Error::Bootstrap {
            context: format!("rank {}: alloc_shared", self.rank),
            detail: match failure {
                Some(e) => format!("this rank could not {what}: {e}"),
                None => format!("rank(s) {failed:?} could not {what}"),
            },
        })
    }

    /// Says this rank is done with everyone's buffers and waits until
    /// everyone is done with its own.
    /// (Another lane call, with nothing in it: the lane call of `enter`
    /// stays unread from then on.)
    fn leave(&mut self, call: &CallInfo, sig: &CallSig) -> Result<()> {
        let k = self.lane_post(sig, |_| {});
        self.lane_await_all(call, sig, k)
    }

    /// This rank's share `[start, end)` of `count` elements, cut on cache
    /// lines.
    fn share<T>(&self, count: usize) -> (usize, usize) {
        let align = (CACHE_LINE / std::mem::size_of::<T>()).max(1);
        let (first, n) = part(count.div_ceil(align), self.world(), self.rank);
        ((first * align).min(count), ((first + n) * align).min(count))
    }

    /// This rank's private scratch for the direct paths, as `(start,
    /// elements)`: in-place folds' prefixes, and the block a streamed
    /// zero-copy all-reduce folds before copying it out. Allocated at the
    /// first call that needs it, kept from then on.
    fn scratch<T>(&mut self) -> (*mut T, usize) {
        if self.direct_scratch.is_empty() {
            self.direct_scratch = vec![0; DIRECT_SCRATCH_BYTES / 8];
        }
        (
            self.direct_scratch.as_mut_ptr().cast::<T>(),
            DIRECT_SCRATCH_BYTES / std::mem::size_of::<T>(),
        )
    }

    /// Folds `[offset, offset + out.len())` of every rank's input, in rank
    /// order, into `out`, this rank's output. In place `out` is also this
    /// rank's input: the prefix `x0 ⊕ … ⊕ x(me-1)` is then folded piece by
    /// piece in `scratch` and combined in front of it.
    ///
    /// # Safety
    /// The addresses are live buffers of the call, and no other rank
    /// touches this range of `out` or the scratch meanwhile.
    unsafe fn fold_inputs<T: Element>(
        &self,
        op: ReduceOp,
        inputs: &[*const T],
        offset: usize,
        out: &mut [T],
        in_place: bool,
        scratch: (*mut T, usize),
    ) {
        let me = self.rank;
        let len = out.len();
        if !in_place {
            fold(op, out, inputs.len(), |p| view(inputs[p], offset, len));
            return;
        }
        if me == 1 {
            // The prefix is x0 alone: out = x0 ⊕ out, read straight from it.
            T::combine_assign_rev(op, out, view(inputs[0], offset, len));
        } else if me > 1 {
            let (acc_ptr, cap) = scratch;
            let mut done = 0;
            while done < len {
                let n = cap.min(len - done);
                let at = offset + done;
                let acc = view_mut(acc_ptr, 0, n);
                acc.copy_from_slice(view(inputs[0], at, n));
                for &input in &inputs[1..me] {
                    T::combine_assign(op, acc, view(input, at, n));
                }
                T::combine_assign_rev(op, &mut out[done..done + n], acc);
                done += n;
            }
        }
        for &input in &inputs[me + 1..] {
            T::combine_assign(op, out, view(input, offset, len));
        }
    }

    /// How the last all-reduce, reduce-scatter, all-gather, broadcast or
    /// reduce reached its peers: `zerocopy` (threads, or every rank's
    /// buffers in one `alloc_shared` allocation), `cma`, or `None` (staged
    /// through the slots).
    pub fn last_direct_name(&self) -> Option<&'static str> {
        self.last_direct.map(|d| match d {
            Direct::Local | Direct::Mapped => "zerocopy",
            Direct::Cma => "cma",
        })
    }

    fn zero_copy_all_reduce<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        k: u64,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let world = self.world();
        let (start, end) = self.share::<T>(count);
        if end > start {
            let scratch = self.scratch::<T>();
            let lists = self.take_peer_buffers::<T>(k, 0);
            let (inputs, outputs) = (lists.inputs::<T>(), lists.outputs::<T>());
            // SAFETY: every rank stays in this call until `leave`; this rank
            // alone touches [start, end) of every buffer.
            // Block by block, so the copies to the other outputs read the
            // folded block from cache rather than from memory.
            // Out of place, large outputs are never read: the block is
            // folded into this rank's scratch and streamed into every
            // output (in place the outputs are the inputs just read, in
            // cache already).
            let stream = !bufs.in_place && streams::<T>(count);
            let block = (ZERO_COPY_BLOCK_BYTES / std::mem::size_of::<T>()).max(1);
            let mut at = start;
            if world == 2 && !stream {
                // Two ranks: the share's sum (an Avg's halved, where the
                // type allows) goes into both outputs in one pass (as the
                // ceiling's zero-copy variant (a) does) rather than folded
                // into one output and copied to the other.
                // Rank 0 walks down, away from rank 1's share: walking up,
                // the prefetcher ran past its end into the first lines of
                // rank 1's share, which rank 1 writes at the same time, so
                // rank 1 fetched them back every call (threads, 64 KiB in
                // place, near: rank 1's fold 0.79 → 0.69 µs, rank 0's
                // 0.65 → 0.62; the whole call 1.13 → 1.04 µs).
                let walk = if self.rank == 0 { Walk::Down } else { Walk::Up };
                // SAFETY: as above; each output is its rank's input (in
                // place) or a buffer of its own.
                let done = unsafe {
                    fold_two_into_both(
                        op,
                        (outputs[0].add(start), outputs[1].add(start)),
                        (inputs[0].add(start), inputs[1].add(start)),
                        end - start,
                        walk,
                    )
                };
                if done {
                    at = end;
                }
            }
            while at < end {
                let n = block.min(end - at);
                unsafe {
                    let out = if stream {
                        view_mut(scratch.0, 0, n)
                    } else {
                        view_mut(outputs[self.rank], at, n)
                    };
                    self.fold_inputs(op, inputs, at, out, bufs.in_place, scratch);
                    finish_avg(op, out, world);
                    for (p, &output) in outputs.iter().enumerate() {
                        if stream {
                            stream::copy_streaming_unfenced(out.as_ptr(), output.add(at), n);
                        } else if p != self.rank {
                            stream::copy_cached(out.as_ptr(), output.add(at), n);
                        }
                    }
                }
                at += n;
            }
            if stream {
                stream::fence();
            }
            self.peer_buffers = lists;
        }
        self.leave(call, sig)
    }

    fn zero_copy_reduce_scatter<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        k: u64,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let (world, me) = (self.world(), self.rank);
        if count > 0 {
            // Part `me` of every input.
            let scratch = self.scratch::<T>();
            let lists = self.take_peer_buffers::<T>(k, me * count);
            let shifted = lists.inputs::<T>();
            // Part `me` of every input folds into this rank's output (in
            // place: part `me` of its own input).
            // SAFETY: inputs live until `leave`; this rank writes only its
            // output and its scratch.
            unsafe {
                let out = view_mut(bufs.output, 0, count);
                // Out of place, a large output is streamed (never read);
                // in place it is this rank's input, read by the fold.
                let stream = !bufs.in_place && streams::<T>(world * count);
                write_out(stream, out, |block, at| {
                    self.fold_inputs(op, shifted, at, block, bufs.in_place, scratch);
                    finish_avg(op, block, world);
                });
            }
            self.peer_buffers = lists;
        }
        self.leave(call, sig)
    }

    /// All-gather (`root` None) or broadcast (`root` Some): each rank copies
    /// what it needs from the others' inputs into its own output — with
    /// `memcpy` in one process, with `process_vm_readv` across processes.
    fn zero_copy_copies<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        k: u64,
        count: usize,
        root: Option<Rank>,
    ) -> Result<()> {
        let (world, me) = (self.world(), self.rank);
        let bytes = count * std::mem::size_of::<T>();
        // Outputs are only written here: large ones bypass the cache.
        let stream = streams::<T>(if root.is_some() { count } else { world * count });
        let pull = |p: Rank, dst: *mut T| -> Result<()> {
            let (input, _) = self.buffers_of::<T>(p, k);
            if (self.direct == Direct::Cma) && p != me {
                cma_read(self.peer_pid(p), input.cast(), dst.cast(), bytes)
                    .map_err(|e| cma_error(call, p, "reading", e))
            } else {
                // SAFETY: the peer's input is live until `leave`; this rank
                // writes only its own output, which no peer reads here.
                unsafe { copy_out(stream, input, dst, count) };
                Ok(())
            }
        };
        // Broadcast: the root, otherwise idle, pushes the last 1/N of every
        // other rank's output while each pulls the rest, so two cores copy
        // at once (everyone then waits for everyone: the root writes into
        // the others' outputs).
        // Out of place the root copies its own input already: it pushes
        // only when in place (its posted input and output coincide), and
        // only from BROADCAST_PUSH_MIN_BYTES. When `root_pushes_all`, the
        // root writes every other output whole, and the others only wait.
        let root_in_place = root.is_some_and(|r| {
            let (input, output) = self.buffers_of::<T>(r, k);
            input == output.cast_const()
        });
        let pushes = root_in_place && count * std::mem::size_of::<T>() >= BROADCAST_PUSH_MIN_BYTES;
        let pushed = if self.root_pushes_all {
            count
        } else if pushes {
            count / world
        } else {
            0
        };
        let kept = count - pushed;
        let elem = std::mem::size_of::<T>();
        let result = match root {
            // The root writes this rank's whole output (`root_pushes_all`):
            // the root's input may not be mapped here.
            Some(root) if root != me && kept == 0 => Ok(()),
            Some(root) if root != me => {
                let (input, _) = self.buffers_of::<T>(root, k);
                if self.direct == Direct::Cma {
                    cma_read(
                        self.peer_pid(root),
                        input.cast(),
                        bufs.output.cast(),
                        kept * elem,
                    )
                    .map_err(|e| cma_error(call, root, "reading", e))
                } else {
                    // SAFETY: the root's input is live until `leave`; this
                    // rank writes only the part of its output the root
                    // does not.
                    unsafe { copy_out(stream, input, bufs.output, kept) };
                    Ok(())
                }
            }
            Some(_) => {
                if !bufs.in_place {
                    // SAFETY: distinct buffers of count elements.
                    unsafe { copy_out(stream, bufs.input, bufs.output, count) };
                }
                (0..world)
                    .filter(|&p| p != me && pushed > 0)
                    .try_for_each(|p| {
                        let (_, output) = self.buffers_of::<T>(p, k);
                        // SAFETY: in range of both buffers; rank p does not touch
                        // [kept, count) of its output during the call.
                        let (src, dst) = unsafe { (bufs.input.add(kept), output.add(kept)) };
                        if self.direct == Direct::Cma {
                            cma_write(self.peer_pid(p), src.cast(), dst.cast(), pushed * elem)
                                .map_err(|e| cma_error(call, p, "writing", e))
                        } else {
                            // SAFETY: as above.
                            unsafe { copy_out(stream, src, dst, pushed) };
                            Ok(())
                        }
                    })
            }
            None => {
                // Out of place from a size that depends on the CPU, this
                // rank's own part bypasses the cache (see there).
                let own_stream = stream || world * bytes >= stream::own_part_stream_min_bytes();
                // In rank order on every rank: rank p copies its own part
                // while the ranks after it pull the same lines, which
                // halves the memory reads for large buffers (pulls first,
                // then own parts, measured 5.5–5.7 → 4.7–5.2 GB/s at
                // 16 MiB over shared memory, 8.2 → 6.3 GB/s on threads).
                (0..world).try_for_each(|p| {
                    // SAFETY: output holds world·count elements.
                    let dst = unsafe { bufs.output.add(p * count) };
                    if p != me {
                        pull(p, dst)
                    } else {
                        if !bufs.in_place {
                            // SAFETY: distinct buffers of count elements.
                            unsafe { copy_out(own_stream, bufs.input, dst, count) };
                        }
                        Ok(())
                    }
                })
            }
        };
        result?;
        self.leave(call, sig)
    }

    fn zero_copy_reduce<T: Element>(
        &mut self,
        call: &CallInfo,
        sig: &CallSig,
        bufs: Buffers<T>,
        k: u64,
        count: usize,
        (op, root): (ReduceOp, Rank),
    ) -> Result<()> {
        let world = self.world();
        if self.rank == root && count > 0 {
            let scratch = self.scratch::<T>();
            let lists = self.take_peer_buffers::<T>(k, 0);
            let inputs = lists.inputs::<T>();
            // SAFETY: inputs live until `leave`; the root writes only its
            // output and its scratch.
            unsafe {
                let out = view_mut(bufs.output, 0, count);
                let stream = !bufs.in_place && streams::<T>(count);
                write_out(stream, out, |block, at| {
                    self.fold_inputs(op, inputs, at, block, bufs.in_place, scratch);
                    finish_avg(op, block, world);
                });
            }
            self.peer_buffers = lists;
        }
        self.leave(call, sig)
    }
}

/// Which of the buffers every rank posts a direct call reads or writes
/// (see [`Arena::all_in_one_allocation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Touches {
    /// Every rank's input and output (all-reduce, all-gather,
    /// reduce-scatter).
    All,
    /// Every rank's output, and only the root's input (broadcast: off the
    /// root the input is not read and may be empty).
    InputOfRoot(Rank),
    /// Every rank's input, and only the root's output (reduce: off the root
    /// the output is not written and may be empty).
    OutputOfRoot(Rank),
}

impl Touches {
    /// Whether the call reads rank `p`'s input and writes its output.
    fn of(self, p: Rank) -> (bool, bool) {
        match self {
            Touches::All => (true, true),
            Touches::InputOfRoot(root) => (p == root, true),
            Touches::OutputOfRoot(root) => (true, p == root),
        }
    }

    /// Whether rank `p` reaches other ranks' inputs and outputs in the
    /// call, as the ranks `reach` each other: a broadcast's other ranks
    /// read the root's input (unless its root pushes all), and its root may
    /// write the others' outputs (`zero_copy_copies`); a reduce's root
    /// reads every input and writes only its own output, its other ranks
    /// reach nobody's buffers.
    fn reached_by(self, p: Rank, reach: Reach) -> (bool, bool) {
        match self {
            Touches::All => (true, true),
            Touches::InputOfRoot(root) => (p != root && reach == Reach::Pull, p == root),
            Touches::OutputOfRoot(root) => (p == root, false),
        }
    }
}

/// How the ranks of a zero-copy call reach each other's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    /// As each collective does by default (a broadcast's other ranks read
    /// the root's input).
    Pull,
    /// A broadcast's root writes every other rank's whole output, because
    /// some rank off the root posted no buffer in the allocation of the
    /// root's input (an empty input there, as `ncclBroadcast` allows) and
    /// so may not have that allocation mapped.
    RootPushesAll,
}

/// Whether a posted place word names one of the communicator's allocations
/// (`allocation_bytes`, by number) with `len` bytes from its offset inside
/// it. The word is a peer's: it must
/// leave the buffer inside the allocation, or this process would reach past
/// its mapping of the peer's block (a well-behaved peer's `locate` checked
/// it; a corrupt one is refused, and the call takes another path). The
/// offset must also keep the elements aligned (`align`; blocks start on a
/// page): a misaligned `*const T` is undefined behaviour.
fn place_fits(allocation_bytes: &[Option<usize>], place: u64, len: usize, align: usize) -> bool {
    let (tag, at) = (place >> PLACE_OFFSET_BITS, place & PLACE_OFFSET_MASK);
    let bytes = tag
        .checked_sub(1)
        .and_then(|number| usize::try_from(number).ok())
        .and_then(|number| allocation_bytes.get(number).copied().flatten());
    bytes.is_some_and(|bytes| {
        usize::try_from(at).ok().is_some_and(|at| {
            at % align.max(1) == 0 && at.checked_add(len).is_some_and(|end| end <= bytes)
        })
    })
}

/// A failed CMA transfer with rank `peer`: lost if its process is gone,
/// refused if the kernel no longer permits it (set-up's probe did), else
/// a buffer the peer posted that is not what this call expects.
fn cma_error(call: &CallInfo, peer: Rank, what: &str, e: std::io::Error) -> crate::error::Error {
    let transfer = format!(
        "{what} rank {peer}'s buffer with process_vm_{}: {e}",
        if what == "reading" { "readv" } else { "writev" }
    );
    call.error(
        peer,
        match e.raw_os_error() {
            Some(libc::ESRCH) => TransportError::PeerLost { rank: Some(peer) },
            Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => TransportError::Refused(format!(
                "{transfer} (allowed at set-up, refused now: did a process make itself \
                 undumpable or change its user, or was kernel.yama.ptrace_scope raised? \
                 OXCCL_ALGO=ring avoids direct reads)"
            )),
            _ => TransportError::Mismatch(transfer),
        },
    )
}

/// Writes `len` bytes from `local` to `remote` in process `pid`.
fn cma_write(
    pid: libc::pid_t,
    local: *const u8,
    remote: *mut u8,
    len: usize,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let local_iov = libc::iovec {
            iov_base: local.wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote_iov = libc::iovec {
            iov_base: remote.wrapping_add(done).cast(),
            iov_len: len - done,
        };
        // SAFETY: the local iovec is readable memory of `len - done` bytes;
        // the kernel checks the remote one.
        let n = unsafe { libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::other("process_vm_writev wrote nothing"));
        }
        done += n as usize;
    }
    Ok(())
}

/// Reads `len` bytes at `remote` in process `pid` into `local`.
fn cma_read(
    pid: libc::pid_t,
    remote: *const u8,
    local: *mut u8,
    len: usize,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let local_iov = libc::iovec {
            // SAFETY: within the caller's buffer.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let remote_iov = libc::iovec {
            iov_base: remote.wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the local iovec is writable memory of `len - done` bytes;
        // the kernel checks the remote one.
        let n = unsafe { libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::other("process_vm_readv read nothing"));
        }
        done += n as usize;
    }
    Ok(())
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a plain futex wait on a valid, aligned u32 with a timeout; the
    // word may live in shared memory, so the non-private variant is used.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: waking waiters on a valid u32 never touches memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// `Arena::shared` as rank `rank` of `geometry` on a fresh segment with
    /// `region` bytes after its rings, no peer attaching, a 200 ms timeout:
    /// its error.
    fn shared_arena_alone(
        tag: &str,
        region: usize,
        geometry: Geometry,
        rank: Rank,
    ) -> Option<Error> {
        let name =
            crate::transport::shm::segment_name("test", &format!("{tag}{}", std::process::id()), 0);
        let segment = Segment::create_with_region(&name, 0, 4096, region).unwrap();
        Arena::shared(
            segment,
            geometry,
            rank,
            Arc::new(AtomicBool::new(false)),
            Duration::from_millis(200),
            crate::ShmStores::Cached,
        )
        .err()
    }

    /// Every rank's control line carries its process's stamp (pid and
    /// start time), which liveness checks find alive; a start time one
    /// tick off (the pid reused by a later process) is found gone.
    #[test]
    fn control_lines_carry_the_process_stamp() {
        let arenas = Arena::local_group(
            2,
            Arc::new(AtomicBool::new(false)),
            Duration::from_secs(1),
            false,
        )
        .unwrap();
        let own = ProcessStamp::own();
        for rank in 0..2 {
            let control = arenas[0].control(rank);
            assert_eq!(control.pid.load(Ordering::Relaxed), u64::from(own.pid));
            assert_eq!(control.start.load(Ordering::Relaxed), own.start);
            assert!(arenas[0].peer_process_alive(rank));
            control.start.store(own.start + 1, Ordering::Relaxed);
            assert!(!arenas[0].peer_process_alive(rank));
        }
    }

    /// A peer that never attaches makes the set-up time out naming the
    /// communicator's set-up (`init`) and the peer, not a barrier with a
    /// sequence number nobody called.
    /// (The wait for that peer sleeps: it had spun a core for the whole
    /// timeout, as a peer not attached yet was never slept on.)
    #[test]
    fn a_set_up_timeout_names_init_and_the_peer() {
        let thread_cpu = || {
            let mut t = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `t` is a valid timespec to write.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
            Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
        };
        let cpu_before = thread_cpu();
        let err = shared_arena_alone("setup", Geometry::new(2).bytes(), Geometry::new(2), 0)
            .expect("no peer attached: a timeout");
        let cpu = thread_cpu() - cpu_before;
        assert!(
            cpu < Duration::from_millis(60),
            "the 200 ms wait used {cpu:?} of CPU"
        );
        let text = err.to_string();
        assert!(
            text.contains("init #0") && text.contains("rank 1"),
            "{text}"
        );
        assert!(!text.contains("18446744073709551615"), "{text}");
    }

    /// A segment whose region is smaller than this world's arena (another
    /// build on rank 0, a rewritten header) is refused before use, naming
    /// the sizes, instead of being used past its end.
    #[test]
    fn an_arena_segment_too_small_for_the_world_is_refused() {
        let err = shared_arena_alone("small", Geometry::new(2).bytes(), Geometry::new(4), 1)
            .expect("too small: refused");
        assert!(matches!(err, Error::Bootstrap { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("same build"), "{text}");
    }

    /// A peer's posted offset is used to reach into this process's mapping
    /// of the peer's block only when the buffer lies inside it.
    /// Threads that outnumber the CPUs they may run on yield at once in
    /// their waits; as many as the CPUs spin first. (Affinity is per
    /// thread: this test's pinning leaves the other tests alone.)
    #[test]
    fn waits_yield_at_once_with_more_ranks_than_cpus() {
        // SAFETY: cpu_set_t is plain data; the calls read or write this
        // thread's affinity only, restored before the asserts.
        unsafe {
            let mut before: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            assert_eq!(libc::sched_getaffinity(0, size, &mut before), 0);
            let first = (0..1024).find(|&c| libc::CPU_ISSET(c, &before)).unwrap();
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(first, &mut one);
            assert_eq!(libc::sched_setaffinity(0, size, &one), 0);
            let flag = Arc::new(AtomicBool::new(false));
            let local_group = |n| {
                let crowded = cpus::threads_outnumber_cpus(n);
                Arena::local_group(n, flag.clone(), Duration::from_secs(1), crowded).unwrap()
            };
            let (crowded, alone) = (local_group(2), local_group(1));
            libc::sched_setaffinity(0, size, &before);
            assert!(crowded.iter().all(|a| a.spin.is_zero()));
            assert!(crowded[0]
                .stores_description()
                .contains("waits yield at once"));
            assert_eq!(alone[0].spin, SPIN);
            // Crowded threads stay off zero copy's two synchronisations
            // where one does: the lanes up to LANE_MAX_BYTES, staged
            // broadcasts below OVERSUBSCRIBED_BROADCAST_ZERO_COPY_MIN_BYTES.
            let name = |op, bytes| crowded[0].algorithm_name(op, bytes, 4);
            assert_eq!(name(OpKind::AllReduce, LANE_MAX_BYTES), "lane");
            assert_eq!(name(OpKind::AllReduce, LANE_MAX_BYTES + 4), "zerocopy");
            assert_eq!(name(OpKind::ReduceScatter, LANE_MAX_BYTES), "lane");
            // A split is an all-gather of colours and keys.
            for bytes in [2 * LANE_MAX_BYTES, 2 * LANE_MAX_BYTES + 8] {
                assert_eq!(name(OpKind::Split, bytes), name(OpKind::AllGather, bytes));
            }
            assert_eq!(name(OpKind::Split, 2 * LANE_MAX_BYTES), "lane");
            assert_eq!(name(OpKind::Split, 2 * LANE_MAX_BYTES + 8), "zerocopy");
            let staged_broadcast = OVERSUBSCRIBED_BROADCAST_ZERO_COPY_MIN_BYTES - 4;
            assert_eq!(name(OpKind::Broadcast, staged_broadcast), "direct");
            assert_eq!(
                name(
                    OpKind::Broadcast,
                    OVERSUBSCRIBED_BROADCAST_ZERO_COPY_MIN_BYTES
                ),
                "zerocopy"
            );
        }
    }

    /// A CMA transfer the kernel refuses after set-up allowed it is told
    /// as refused (with what to look at), not as ranks that disagree.
    #[test]
    fn a_refused_cma_transfer_is_not_a_mismatch() {
        let call = CallInfo {
            op: OpKind::Broadcast,
            seq: 7,
            space: crate::transport::Space::Collective,
            ctx: 0,
            rank: 0,
            world: 2,
            reduce_op: ReduceOp::Sum,
            timeout: Duration::from_secs(1),
            digest: 0,
        };
        let refused = cma_error(
            &call,
            1,
            "reading",
            std::io::Error::from_raw_os_error(libc::EPERM),
        );
        assert!(
            matches!(refused, Error::Refused { peer: 1, .. }),
            "{refused:?}"
        );
        assert!(refused.to_string().contains("ptrace_scope"), "{refused}");
        let gone = cma_error(
            &call,
            1,
            "reading",
            std::io::Error::from_raw_os_error(libc::ESRCH),
        );
        assert!(matches!(gone, Error::PeerLost { peer: 1, .. }), "{gone:?}");
        let bad = cma_error(
            &call,
            1,
            "writing",
            std::io::Error::from_raw_os_error(libc::EFAULT),
        );
        assert!(matches!(bad, Error::Mismatch { .. }), "{bad:?}");
    }

    #[test]
    fn a_peer_place_is_trusted_only_inside_its_allocation() {
        let shared = [Some(4096)];
        assert!(place_fits(&shared, place_word(1, 4096 - 8), 8, 8));
        assert!(!place_fits(&shared, place_word(1, 4096 - 8), 16, 8));
        assert!(!place_fits(&shared, place_word(1, 8), usize::MAX, 8));
        assert!(!place_fits(&shared, place_word(1, 4), 8, 8), "misaligned");
        assert!(place_fits(&shared, place_word(1, 4), 8, 4));
        assert!(
            !place_fits(&shared, place_word(2, 0), 8, 8),
            "another allocation"
        );
    }

    #[test]
    fn a_place_word_holds_allocation_and_offset_or_says_nowhere() {
        let word = place_word(3, 0x1234_5678);
        assert_eq!(word >> PLACE_OFFSET_BITS, 3);
        assert_eq!(word & PLACE_OFFSET_MASK, 0x1234_5678);
        let largest = place_word(u16::MAX as u64, PLACE_OFFSET_MASK);
        assert_eq!(largest >> PLACE_OFFSET_BITS, u16::MAX as u64);
        assert_eq!(largest & PLACE_OFFSET_MASK, PLACE_OFFSET_MASK);
        // What does not fit is "not in a shared allocation" (another
        // path), never a wrong allocation or offset.
        assert_eq!(place_word(1 << 16, 0), 0);
        assert_eq!(place_word(1, PLACE_OFFSET_MASK + 1), 0);
    }

    /// A unit's last tag can be any number of calls old: 2³² calls (the
    /// tag's call number wraps) or 2³¹ (it looks later) must read neither
    /// as this call's message nor as another call's, and a tag of this lap
    /// that is not this call's is a mismatch.
    #[test]
    fn a_mailbox_tag_from_the_last_lap_is_neither_this_calls_nor_foreign() {
        let start = 3 * MAILBOX_UNITS + 7;
        let last_lap = start - MAILBOX_UNITS;
        let sig = CallSig {
            seq: 5 + (1 << 32),
            signature: 0xabc,
        };
        let same_low_bits = mailbox_tag(&CallSig { seq: 5, ..sig }, last_lap);
        let half_a_wrap = mailbox_tag(
            &CallSig {
                seq: 5 + (1 << 31) + 10,
                ..sig
            },
            last_lap,
        );
        for stale in [same_low_bits, half_a_wrap, 0] {
            assert_ne!(stale, mailbox_tag(&sig, start));
            assert!(!mailbox_tag_foreign(stale, &sig, start), "{stale:#x}");
            assert!(!mailbox_tag_current(stale, start), "{stale:#x}");
        }
        let other_call = mailbox_tag(
            &CallSig {
                seq: sig.seq + 1,
                ..sig
            },
            start,
        );
        // (The tag keeps bits 2–31 of the folded signature.)
        let other_signature = mailbox_tag(
            &CallSig {
                signature: 0xabc ^ 0x100,
                ..sig
            },
            start,
        );
        for foreign in [other_call, other_signature] {
            assert!(mailbox_tag_foreign(foreign, &sig, start), "{foreign:#x}");
        }
        assert!(!mailbox_tag_foreign(mailbox_tag(&sig, start), &sig, start));
        assert!(mailbox_tag_current(mailbox_tag(&sig, start), start));
    }

    #[test]
    fn a_round_trip_moved_when_it_changed_by_the_factor_either_way() {
        // The VM's placements: 130–150 ns near, 300–400 ns far.
        assert!(round_trip_moved(140, 330));
        assert!(round_trip_moved(330, 140));
        assert!(!round_trip_moved(140, 150));
        assert!(!round_trip_moved(330, 300));
        assert!(round_trip_moved(100, 160));
        assert!(!round_trip_moved(100, 159));
        // One CPU for two ranks: microseconds.
        assert!(round_trip_moved(140, 12_000));
        assert!(!round_trip_moved(0, 1));
    }

    #[test]
    fn a_move_is_a_changed_round_trip_at_checks_in_a_row() {
        let mut watch = RoundTripWatch::from(Some(70));
        // Near, one placement: quickest-of-sixteen readings of 60–100 ns,
        // one of them 1.6× a lucky baseline.
        assert!(!watch.moved(120));
        assert!(!watch.moved(80));
        assert!(!watch.moved(120));
        assert!(!watch.moved(90));
        // Far: every reading differs.
        assert!(!watch.moved(220));
        assert!(watch.moved(240));
        assert!(watch.moved(230), "a move stays a move until re-measured");
        // Back near, or a new baseline: nothing pending.
        assert!(!watch.moved(70));
        let mut fresh = RoundTripWatch::from(Some(230));
        assert!(!fresh.moved(70));
        assert!(fresh.moved(75));
        // No baseline (more ranks than CPUs, or a forced mode): never.
        let mut none = RoundTripWatch::from(None);
        assert!((0..5).all(|_| !none.moved(10_000)));
    }

    #[test]
    fn moves_that_keep_the_mode_space_the_next_measurement_out() {
        let mut spacing = ROUND_TRIP_MIN_SPACING;
        for _ in 0..3 {
            spacing = next_move_spacing(spacing, true);
        }
        assert_eq!(spacing, ROUND_TRIP_MIN_SPACING * 8);
        for _ in 0..10 {
            spacing = next_move_spacing(spacing, true);
        }
        assert_eq!(spacing, ROUND_TRIP_MAX_SPACING);
        assert_eq!(next_move_spacing(spacing, false), ROUND_TRIP_MIN_SPACING);
    }
}
