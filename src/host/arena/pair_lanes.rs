//! Pair lanes: small point-to-point messages between the ranks of an
//! arena, without the links.
//!
//! Through the links an 8-byte `send_recv` between two processes took
//! 0.51 µs against Open MPI's 0.20: the fabric's lock, its frame tables,
//! a plan and a payload allocation per message. A pair lane moves such a
//! message as a lane call does: one copy into shared memory beside a
//! release store, one copy out after the acquire load that sees it.
//!
//! Every ordered pair of ranks (sender `s`, receiver `d`) has a ring of
//! [`SLOTS`] entries of up to [`MAX_BYTES`], written only by `s` and read
//! only by `d`, and a `taken` word, written only by `d`. Both ends count
//! positions privately ([`Positions`]); entry `p % SLOTS` holds position
//! `p` once its `filled` word reads `p + 1` (stored last, release), and
//! the sender writes position `p` only once `taken` (stored by the
//! receiver after copying out, release) reaches `p + 1 - SLOTS`.
//!
//! **Which way a message goes.** A send of at most [`MAX_BYTES`] goes into
//! the lane when the lane has room and the peer has not left; otherwise
//! (and every larger send) over the links, as before. The sender never
//! waits for the lane, so a lane adds no way to deadlock: a rank may send
//! any number of small messages before its peer receives one, as over the
//! links. Each entry carries the message's number in the pair's
//! point-to-point numbering, the one the links' frames carry, so the
//! receiver of message `k` looks at its lane's oldest unread entry:
//! number `k` is the message; a later number means `k` went over the links
//! (the lane was full when it was sent); an empty lane is waited on,
//! looking at the links now and then (after the first spin), where `k`
//! may also arrive. Both ends pick the lane by their own message size, so
//! a length mismatch across [`MAX_BYTES`] is still found: a small receive
//! meets the large message on the links and compares lengths there, and a
//! large receive looks at the lane (`pair_lane_holds`) before, while and
//! after (when it failed) it waits over the links.
//!
//! Lanes exist for groups of 2 to [`MAX_WORLD`] ranks (`world²` rings of
//! 16.6 KiB, 4.2 MiB at 16 ranks, reserved in `/dev/shm` with the rest of
//! the arena: `docs/launching.md` has the sizes); `OXCCL_ALGO=ring` or
//! `tree` makes no arena, so no lanes, and everything goes over the links.

use super::*;
use crate::transport::FrameHeader;

/// The largest message a pair lane carries, as for the collectives'
/// lanes. Measured with lanes of 8 KiB (a `send_recv` of two processes,
/// three alternating rounds): 4 KiB took 0.80 µs through a lane against
/// 1.31 over the links near, 2.9–3.0 against 4.0–4.4 far; 8 KiB about
/// the same either way (1.70 against 1.77 µs near), so the lanes stop at
/// 4 KiB and keep their memory to 16.6 KiB a pair.
pub(crate) const MAX_BYTES: usize = 4096;
/// Entries per lane: how many small messages a sender may run ahead of
/// its receiver before the rest go over the links.
const SLOTS: u64 = 4;
/// The largest group with pair lanes.
const MAX_WORLD: usize = 16;
/// One entry: a header line, then the payload.
const ENTRY_BYTES: usize = LINE + MAX_BYTES;
/// One lane: the receiver's `taken` line, then the entries.
const RING_BYTES: usize = LINE + SLOTS as usize * ENTRY_BYTES;
const _: () = assert!(RING_BYTES.is_multiple_of(LINE));

/// The header line of an entry.
#[repr(C)]
struct EntryHeader {
    /// `p + 1` once the entry holds position `p` (stored last, release).
    filled: AtomicU64,
    /// The message's number in the pair's point-to-point numbering.
    seq: AtomicU64,
    /// Payload bytes.
    bytes: AtomicU64,
    /// The sending call's digest (type, count: see `CallInfo::digest_of`).
    digest: AtomicU64,
}

/// Bytes the pair lanes of a `world`-rank arena take.
pub(crate) fn region_bytes(world: usize) -> usize {
    if enabled_for(world) {
        // A ring per ordered pair, the unused diagonal included (16.6 KiB
        // per rank) for plain indexing.
        world * world * RING_BYTES
    } else {
        0
    }
}

fn enabled_for(world: usize) -> bool {
    (2..=MAX_WORLD).contains(&world)
}

/// One rank's private positions in its lanes.
pub(crate) struct Positions {
    /// Per receiver, the positions this rank has written to its lane.
    written: Vec<u64>,
    /// Per sender, the positions this rank has taken from its lane.
    taken: Vec<u64>,
}

impl Positions {
    pub(crate) fn new(geometry: Geometry) -> Positions {
        let ranks = if enabled_for(geometry.world) {
            geometry.world
        } else {
            0
        };
        Positions {
            written: vec![0; ranks],
            taken: vec![0; ranks],
        }
    }
}

impl Arena {
    /// Whether this arena has pair lanes (see the module's notes).
    pub(crate) fn has_pair_lanes(&self) -> bool {
        !self.pairs.written.is_empty()
    }

    /// The lane from `from` to `to`.
    fn pair_lane(&self, from: Rank, to: Rank) -> *mut u8 {
        let g = &self.geometry;
        debug_assert!(from < g.world && to < g.world && self.has_pair_lanes());
        // SAFETY: in the region (`region_bytes` counts world² lanes).
        unsafe {
            self.base
                .add(g.pair_lanes_offset() + (from * g.world + to) * RING_BYTES)
        }
    }

    /// The receiver's `taken` word of the lane from `from` to `to`.
    fn pair_taken(&self, from: Rank, to: Rank) -> &AtomicU64 {
        // SAFETY: the lane's first line, 8-byte aligned (page-aligned
        // region, line-sized lanes); only ever accessed atomically.
        unsafe { &*(self.pair_lane(from, to) as *const AtomicU64) }
    }

    /// Entry `position % SLOTS` of the lane from `from` to `to`: its
    /// header and its payload.
    fn pair_entry(&self, from: Rank, to: Rank, position: u64) -> (&EntryHeader, *mut u8) {
        let slot = (position % SLOTS) as usize;
        // SAFETY: within the lane; the header is line aligned and made of
        // atomics, the payload follows it.
        unsafe {
            let entry = self.pair_lane(from, to).add(LINE + slot * ENTRY_BYTES);
            (&*(entry as *const EntryHeader), entry.add(LINE))
        }
    }

    /// Puts message `seq` of the sending `call` (`payload`, at most
    /// [`MAX_BYTES`]) into the lane to `to` and returns `true`, or returns
    /// `false` at once when the lane is full or `to` has left: the caller
    /// sends it over the links.
    pub(crate) fn pair_send(&mut self, call: &CallInfo, to: Rank, payload: &[u8]) -> bool {
        debug_assert!(payload.len() <= MAX_BYTES);
        if matches!(self.state(to), STATE_DEPARTED | STATE_FAILED) {
            return false;
        }
        let position = self.pairs.written[to];
        let taken = self.pair_taken(self.rank, to).load(Ordering::Acquire);
        // Wrapping: `taken` is a peer's word, and a wrong one must not
        // panic a debug build (it only makes the lane look full).
        if position.wrapping_sub(taken) >= SLOTS {
            return false;
        }
        let (header, at) = self.pair_entry(self.rank, to, position);
        // SAFETY: the entry is this rank's to write: its receiver took
        // position `position - SLOTS` (the acquire load above orders its
        // reads of it before these writes) and reads it again only after
        // the release store below.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), at, payload.len()) };
        header.seq.store(call.seq, Ordering::Relaxed);
        header.bytes.store(payload.len() as u64, Ordering::Relaxed);
        header
            .digest
            .store(u64::from(call.digest), Ordering::Relaxed);
        header.filled.store(position + 1, Ordering::Release);
        self.pairs.written[to] = position + 1;
        self.notify();
        true
    }

    /// Receives message `call.seq` from `from` into `out` if it came
    /// through the lane (`Ok(true)`), or returns `Ok(false)` once it is
    /// known to come over the links: the lane's oldest unread entry is a
    /// later message, `on_links()` (asked after the first spin of the
    /// wait, then now and then) found its frame there, or `from` left (the
    /// links deliver what it sent before, or report it lost). The wait has
    /// the call's deadline and watches `from` alone, as a receive over the
    /// links does. `expect` is the frame the message would be over the
    /// links: a lane message is checked against it as a frame would be.
    ///
    /// # Errors
    ///
    /// `Mismatch` for a lane message whose length or digest differs from
    /// this receive's (it is taken all the same), and the wait's errors.
    pub(crate) fn pair_recv(
        &mut self,
        (call, expect): (&CallInfo, &FrameHeader),
        from: Rank,
        out: &mut [u8],
        on_links: impl FnMut() -> bool,
    ) -> Result<bool> {
        let position = self.pairs.taken[from];
        let (header, at) = self.pair_entry(from, self.rank, position);
        let ready = || header.filled.load(Ordering::Acquire) == position + 1;
        self.wait_within(call, (from, true), Watched::Peer, ready, on_links)?;
        if !ready() {
            return Ok(false);
        }
        let seq = header.seq.load(Ordering::Relaxed);
        if seq > call.seq {
            // Message `call.seq` went over the links: the lane was full.
            return Ok(false);
        }
        let sent = FrameHeader {
            bytes: header.bytes.load(Ordering::Relaxed) as usize,
            call: header.digest.load(Ordering::Relaxed) as u32,
            ..*expect
        };
        let checked = if seq != call.seq {
            Err(TransportError::Mismatch(format!(
                "its lane holds message #{seq} where #{} was due",
                call.seq
            )))
        } else {
            sent.check_matches(expect)
        };
        if checked.is_ok() {
            // SAFETY: the acquire load in `ready` saw the sender's release
            // store, after its payload; the sender rewrites this entry only
            // after the `taken` store below; `check_matches` compared the
            // lengths.
            unsafe { std::ptr::copy_nonoverlapping(at, out.as_mut_ptr(), out.len()) };
        }
        self.pairs.taken[from] = position + 1;
        self.pair_taken(from, self.rank)
            .store(position + 1, Ordering::Release);
        checked.map(|()| true).map_err(|e| call.error(from, e))
    }

    /// The length of message `seq` from `from` when it waits in the lane
    /// (not yet taken): a receive too large for the lane asks, to report a
    /// sender that sent it small.
    pub(crate) fn pair_lane_holds(&self, from: Rank, seq: u64) -> Option<usize> {
        let position = self.pairs.taken[from];
        let (header, _) = self.pair_entry(from, self.rank, position);
        (header.filled.load(Ordering::Acquire) == position + 1
            && header.seq.load(Ordering::Relaxed) == seq)
            .then(|| header.bytes.load(Ordering::Relaxed) as usize)
    }
}
