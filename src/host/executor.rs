//! Runs a [`Plan`] over a [`Transport`] on host buffers.
//!
//! The combine order is fixed everywhere: `local ⊕ incoming`, so the same plan
//! gives the same bits whatever buffers (in place or not) it runs on.

use std::time::Duration;

use super::reduce::finish_avg;
use crate::error::{Error, Result};
use crate::schedule::{BufId, Plan, Span, Step};
use crate::transport::{Elsewhere, FrameHeader, Payload, Space, Transport, TransportError};
use crate::types::{Element, OpKind, Rank, ReduceOp};

/// The call's buffers as the plan sees them.
pub(crate) enum Bufs<'a, T> {
    /// One buffer; plans refer only to [`BufId::Recv`].
    InPlace(&'a mut [T]),
    /// Separate input and output (either may be empty).
    OutOfPlace { send: &'a [T], recv: &'a mut [T] },
}

/// The call's buffers as raw parts, taken once from [`Bufs`]: each step
/// makes short-lived slices of exactly the spans it touches. A pointer the
/// transport keeps into one span (a lent send, a receive posted ahead)
/// then stays valid while steps write other spans, which a fresh `&mut`
/// of the whole buffer per step would not allow.
struct RawBufs<'a, T> {
    send: *const T,
    send_len: usize,
    /// The written buffer: the output, in place the one buffer.
    recv: *mut T,
    recv_len: usize,
    /// The plan's scratch ([`Plan::scratch_len`] elements, the executor's).
    scratch: *mut T,
    scratch_len: usize,
    in_place: bool,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

/// The memory a span names: the send buffer (out of place), the written
/// buffer (the output; in place also what `BufId::Send` names) or scratch.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Memory {
    Send,
    Written,
    Scratch,
}

/// Whether `len` elements at `offset` lie within a buffer of `buf_len`
/// (no overflow, unlike `offset + len <= buf_len`).
fn within(offset: usize, len: usize, buf_len: usize) -> bool {
    len <= buf_len && offset <= buf_len - len
}

impl<'a, T: Element> RawBufs<'a, T> {
    /// The call's buffers and the plan's `scratch` (which lives as long).
    fn new(bufs: Bufs<'a, T>, scratch: &'a mut [T]) -> Self {
        let (scratch, scratch_len) = (scratch.as_mut_ptr(), scratch.len());
        match bufs {
            Bufs::InPlace(buf) => {
                let (recv, recv_len) = (buf.as_mut_ptr(), buf.len());
                RawBufs {
                    send: recv.cast_const(),
                    send_len: recv_len,
                    recv,
                    recv_len,
                    scratch,
                    scratch_len,
                    in_place: true,
                    _borrow: std::marker::PhantomData,
                }
            }
            Bufs::OutOfPlace { send, recv } => RawBufs {
                send: send.as_ptr(),
                send_len: send.len(),
                recv: recv.as_mut_ptr(),
                recv_len: recv.len(),
                scratch,
                scratch_len,
                in_place: false,
                _borrow: std::marker::PhantomData,
            },
        }
    }

    /// The memory `buf` names in this call.
    fn memory(&self, buf: BufId) -> Memory {
        match buf {
            BufId::Send if !self.in_place => Memory::Send,
            BufId::Send | BufId::Recv => Memory::Written,
            BufId::Scratch => Memory::Scratch,
        }
    }

    /// Base and length of `memory`.
    fn base(&self, memory: Memory) -> (*mut T, usize) {
        match memory {
            Memory::Send => (self.send.cast_mut(), self.send_len),
            Memory::Written => (self.recv, self.recv_len),
            Memory::Scratch => (self.scratch, self.scratch_len),
        }
    }

    /// `span` of the buffer it names. Panics out of bounds, as slicing would.
    fn read(&self, span: Span) -> &[T] {
        let (base, len) = self.base(self.memory(span.buf));
        assert!(
            within(span.offset, span.len, len),
            "span outside its buffer"
        );
        // SAFETY: in bounds of a buffer borrowed for 'a (scratch: the
        // executor's, alive as long); no `&mut` to these elements lives
        // while the returned slice does (steps write only through `write`,
        // whose slices end with the step, and never read and write one
        // range at once: see `execute_as`).
        unsafe { std::slice::from_raw_parts(base.cast_const().add(span.offset), span.len) }
    }

    /// `span` of the written buffer or of scratch, the only memory a plan
    /// writes. Panics out of bounds.
    #[allow(clippy::mut_from_ref)]
    fn write(&self, span: Span) -> &mut [T] {
        let memory = self.memory(span.buf);
        // A plan never writes the caller's input (its pointer came from a
        // shared borrow): checked always, since writing it would be UB.
        assert!(memory != Memory::Send, "span {:?} written", span.buf);
        if memory == Memory::Scratch {
            assert!(
                within(span.offset, span.len, self.scratch_len),
                "span outside the scratch"
            );
            // SAFETY: in bounds of the executor's scratch, which nothing
            // else borrows and no send lends (`Lending::lends`).
            return unsafe {
                std::slice::from_raw_parts_mut(self.scratch.add(span.offset), span.len)
            };
        }
        assert!(
            within(span.offset, span.len, self.recv_len),
            "span outside the output"
        );
        // SAFETY: in bounds of the written buffer, borrowed mutably for
        // 'a. No other step's live slice or lent send covers the span
        // ([`Lending::lends`]; with `reclaims`, the receive writing it
        // first had the transport copy every queued frame borrowing it,
        // under the transport's lock); a receive posted ahead into it
        // (`receives_to_post_ahead`) is written only by that receive's own
        // step, whose `recv_into` replaces the posted pointer with this
        // slice under the transport's lock before reading into it.
        unsafe { std::slice::from_raw_parts_mut(self.recv.add(span.offset), span.len) }
    }

    /// Where `span` of the written buffer starts, for a receive posted
    /// ahead: derived from the buffer's base pointer, not from a slice, so
    /// that the slices later steps make of other spans leave it valid.
    /// Panics out of bounds.
    fn write_ptr(&self, span: Span) -> *mut T {
        assert!(
            within(span.offset, span.len, self.recv_len),
            "span outside the output"
        );
        // SAFETY: in bounds (or one past the end for an empty span).
        unsafe { self.recv.add(span.offset) }
    }

    /// Moves `len` elements within `memory`, written buffer or scratch
    /// (ranges may overlap).
    fn move_in(&self, memory: Memory, from: usize, to: usize, len: usize) {
        assert!(memory != Memory::Send, "the send buffer is never written");
        let (base, buf_len) = self.base(memory);
        assert!(
            within(from, len, buf_len) && within(to, len, buf_len),
            "span outside its buffer"
        );
        // SAFETY: both ranges in bounds; `copy` allows overlap.
        unsafe { std::ptr::copy(base.add(from), base.add(to), len) }
    }

    /// Copies `src` into `dst`, wherever each lies (they may overlap only
    /// within one buffer, where the copy is a move).
    fn copy(&self, src: Span, dst: Span) {
        let (from, to) = (self.memory(src.buf), self.memory(dst.buf));
        if from == to {
            assert_eq!(src.len, dst.len, "copy between spans of different lengths");
            self.move_in(to, src.offset, dst.offset, src.len);
        } else {
            self.write(dst).copy_from_slice(self.read(src));
        }
    }
}

/// What the executor needs to know about the call besides its plan.
pub(crate) struct CallInfo {
    pub op: OpKind,
    pub seq: u64,
    pub space: Space,
    pub ctx: u64,
    pub rank: Rank,
    pub world: usize,
    pub reduce_op: ReduceOp,
    pub timeout: Duration,
    /// What every rank of this call agrees on, folded into 32 bits and
    /// carried by its frames ([`FrameHeader::call`]): see
    /// [`CallInfo::digest_of`].
    pub digest: u32,
}

impl CallInfo {
    /// The digest of a call described by `desc`: element type, reduce
    /// operation, root and element count (for point-to-point, where a send
    /// meets a receive, element type and count only).
    pub(crate) fn digest_of(desc: &crate::desc::CollectiveDesc) -> u32 {
        let word = match desc.op {
            OpKind::Send | OpKind::Recv => {
                crate::host::arena::signature(OpKind::Send, desc.dtype as u8, None, 0, desc.count())
            }
            op => crate::host::arena::signature(
                op,
                desc.dtype as u8,
                desc.reduce_op,
                desc.root.unwrap_or(0),
                desc.count(),
            ),
        };
        (word ^ (word >> 32)) as u32
    }

    pub(crate) fn error(&self, peer: Rank, e: TransportError) -> Error {
        let (op, seq, rank) = (self.op, self.seq, self.rank);
        match e {
            TransportError::Timeout(waited) => Error::Timeout {
                op,
                seq,
                rank,
                peer,
                waited,
            },
            TransportError::PeerLost { rank: lost } => Error::PeerLost {
                op,
                seq,
                rank,
                peer: lost.unwrap_or(peer),
            },
            TransportError::PeerTimedOut { rank: failed, late } => Error::PeerTimedOut {
                op,
                seq,
                rank,
                peer: failed,
                late,
            },
            TransportError::Aborted => Error::Aborted { op, seq, rank },
            TransportError::Mismatch(detail) => Error::Mismatch {
                op,
                seq,
                rank,
                peer,
                detail,
            },
            TransportError::Refused(detail) => Error::Refused {
                op,
                seq,
                rank,
                peer,
                detail,
            },
        }
    }
}

/// Per-peer frame counters: the n-th frame of this call from/to a peer.
/// They live on the stack up to [`INLINE_COUNTER_WORLD`] ranks: a small
/// collective over TCP spends a few hundred nanoseconds of its root's
/// time in user space, and allocations were a fifth of it.
struct Counters<'a> {
    sent: &'a mut [u32],
    received: &'a mut [u32],
}

/// Worlds up to this size keep [`Counters`] on the stack.
const INLINE_COUNTER_WORLD: usize = 64;

pub(crate) fn header<T: Element>(info: &CallInfo, step: u32, len: usize) -> FrameHeader {
    FrameHeader {
        ctx: info.ctx,
        space: info.space,
        seq: info.seq,
        step,
        // A send is matched by a recv: point-to-point frames carry `Send`.
        op: match info.space {
            Space::PointToPoint => OpKind::Send,
            Space::Collective => info.op,
        },
        bytes: len * std::mem::size_of::<T>(),
        call: info.digest,
    }
}

/// Which sends read the caller's buffer in place (no copy into a frame):
/// when the transport lets the call's sends borrow (`allowed`,
/// [`Transport::takes_borrowed`]) and no *later* step of the call writes
/// those elements. The
/// input of an out-of-place call is never written; elsewhere (in place, or
/// the output out of place) that holds for a broadcast root's buffer, an
/// all-gather's own part, the parts a reduce-scatter sends, and an
/// all-reduce's chunks in its all-gather phase (reduced or received before
/// they are sent, never written after), but not for the chunks its
/// reduce-scatter phase sends, which its all-gather phase overwrites while
/// a queued frame might still read them. Steps before the send are done
/// when it is queued, and a receive posted ahead into the span would be a
/// later step's, so it is counted there. Empty sends (a barrier's) are
/// copied: there is nothing to save, and a lent frame makes the call walk
/// the queues when it ends. An exchange in place lends even what its
/// receives overwrite: each takes its span back first (`reclaims`).
struct Lending {
    allowed: bool,
    in_place: bool,
    /// Per step: whether no later step writes what it sends
    /// ([`sends_clear_of_later_writes`]), found by the first send that
    /// needs it.
    clear: Option<Vec<bool>>,
    /// The index past the plan's last writing step (0: none writes), found
    /// by the first send that needs it: a send at or after it lends without
    /// the table, which a small broadcast's root would build on every call.
    after_last_write: Option<usize>,
    /// Sends lend even what later steps write, and each receive first
    /// takes back (copies) what is still queued of the span it writes
    /// ([`Transport::own_borrowed_within`]): an exchange in place, whose
    /// plan is sends, then receives into the spans sent.
    reclaims: bool,
}

impl Lending {
    /// Whether the send at `index` in `plan`, of `src`, lends its bytes.
    fn lends(&mut self, plan: &Plan, index: usize, src: Span) -> bool {
        self.allowed
            && src.len > 0
            && match src.buf {
                BufId::Send if !self.in_place => true,
                BufId::Scratch => false,
                _ if self.reclaims => true,
                // In place, "send" names the one buffer the plan may write.
                // No later step writes at all (a broadcast root's sends, the
                // last steps of many plans): clear without the table.
                _ if index
                    >= *self.after_last_write.get_or_insert_with(|| {
                        plan.steps
                            .iter()
                            .rposition(|step| written_by(step).is_some())
                            .map_or(0, |last| last + 1)
                    }) =>
                {
                    true
                }
                _ => self
                    .clear
                    .get_or_insert_with(|| sends_clear_of_later_writes(plan))[index],
            }
    }
}

/// Ranges of the written buffer, merged: start → end, disjoint, with no two
/// touching.
#[derive(Default)]
struct SpanSet(std::collections::BTreeMap<usize, usize>);

impl SpanSet {
    fn overlaps(&self, span: Span) -> bool {
        let end = span.offset + span.len;
        span.len > 0
            && self
                .0
                .range(..end)
                .next_back()
                .is_some_and(|(_, &e)| e > span.offset)
    }

    fn insert(&mut self, span: Span) {
        if span.len == 0 {
            return;
        }
        // Merge with every range it overlaps or touches.
        let (mut start, mut end) = (span.offset, span.offset + span.len);
        let joined: Vec<(usize, usize)> = self
            .0
            .range(..=end)
            .rev()
            .take_while(|&(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in joined {
            self.0.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        self.0.insert(start, end);
    }
}

/// What `step` writes in the written buffer (the output; in place the one
/// buffer): every destination lies there in `execute`, whatever its
/// `BufId`, except one in scratch.
fn written_by(step: &Step) -> Option<Span> {
    match *step {
        Step::Send { .. } | Step::RecvReduceSend { .. } => None,
        Step::Recv { dst, .. }
        | Step::RecvCopySend { dst, .. }
        | Step::RecvReduce { dst, .. }
        | Step::Copy { dst, .. }
        | Step::ReduceLocal { dst, .. }
        | Step::DivideByWorld { span: dst } => Some(dst),
    }
    .filter(|dst| dst.buf != BufId::Scratch)
}

/// Per step of `plan`: for a send from the written buffer, whether no later
/// step writes any of its span (false for every other step). One walk from
/// the end, collecting what the steps after each one write.
fn sends_clear_of_later_writes(plan: &Plan) -> Vec<bool> {
    let mut later = SpanSet::default();
    let mut clear = vec![false; plan.steps.len()];
    for (index, step) in plan.steps.iter().enumerate().rev() {
        match *step {
            Step::Send { src, .. } if src.buf != BufId::Scratch => {
                clear[index] = !later.overlaps(src);
            }
            _ => {}
        }
        if let Some(dst) = written_by(step) {
            later.insert(dst);
        }
    }
    clear
}

/// Withdraws the caller's buffers from the transport's queues when a call
/// that sent from them in place ends: frames still queued get copies of
/// their own (over the links, those of a call that failed before its
/// flush; in process, those no receive has taken yet, after which it waits
/// for the receives still copying out of the buffers).
struct BorrowGuard<'a> {
    transport: &'a Transport,
    lent: bool,
}

impl Drop for BorrowGuard<'_> {
    fn drop(&mut self) {
        if self.lent {
            self.transport.own_borrowed();
        }
    }
}

/// Receives of at least this many bytes whose destination no earlier step
/// touches are posted when the call starts ([`Transport::post_ahead`]):
/// frames that arrive before their step runs (a broadcast's later pieces,
/// an all-gather's chunks) land in place instead of in buffers copied
/// later.
const POST_AHEAD_MIN_BYTES: usize = 64 << 10;

/// The peer a step receives from, if it receives.
fn receives_from(step: &Step) -> Option<Rank> {
    match *step {
        Step::Recv { peer, .. } | Step::RecvReduce { peer, .. } => Some(peer),
        Step::RecvReduceSend { from, .. } | Step::RecvCopySend { from, .. } => Some(from),
        _ => None,
    }
}

/// The plain receives of `plan` to post ahead: `(peer, frame number from
/// that peer, destination)` of each [`Step::Recv`] of at least
/// [`POST_AHEAD_MIN_BYTES`] into a range of the written buffer (the output;
/// in place the one buffer) that no step before it reads or writes, so
/// nothing sees the range change before that step.
fn receives_to_post_ahead(
    plan: &Plan,
    world: usize,
    elem: usize,
    in_place: bool,
) -> Vec<(Rank, u32, Span)> {
    let big =
        |s: &Step| matches!(*s, Step::Recv { dst, .. } if dst.len * elem >= POST_AHEAD_MIN_BYTES);
    if !plan.steps.iter().any(big) {
        return Vec::new();
    }
    let in_written = |span: Span| match span.buf {
        BufId::Recv => true,
        BufId::Send => in_place,
        BufId::Scratch => false,
    };
    // Ranges of the written buffer touched so far.
    let mut touched = SpanSet::default();
    let mut frames = vec![0u32; world];
    let mut ahead = Vec::new();
    for step in &plan.steps {
        if let Step::Recv { peer, dst } = *step {
            if big(step) && in_written(dst) && !touched.overlaps(dst) {
                ahead.push((peer, frames[peer], dst));
            }
        }
        if let Some(peer) = receives_from(step) {
            frames[peer] += 1;
        }
        for span in step.spans().into_iter().flatten() {
            if in_written(span) {
                touched.insert(span);
            }
        }
    }
    ahead
}

/// Withdraws the receives a call posted ahead when it ends, so nothing
/// lands in its buffers after it returned (on success each receive has
/// withdrawn its own already).
struct PostedAhead<'a> {
    transport: &'a Transport,
    recvs: Vec<(usize, FrameHeader, *mut u8)>,
}

impl Drop for PostedAhead<'_> {
    fn drop(&mut self) {
        if !self.recvs.is_empty() {
            self.transport.withdraw(&self.recvs);
        }
    }
}

/// Runs `plan` for one call.
pub(crate) fn execute<T: Element>(
    transport: &Transport,
    info: &CallInfo,
    plan: &Plan,
    bufs: Bufs<'_, T>,
) -> Result<()> {
    execute_as(transport, (info, info), plan, bufs, (None, false))
}

/// [`execute`] for a point-to-point receive whose receives also watch
/// `elsewhere` (see [`Transport::recv_into`]).
pub(crate) fn execute_watching<T: Element>(
    transport: &Transport,
    info: &CallInfo,
    plan: &Plan,
    bufs: Bufs<'_, T>,
    elsewhere: Elsewhere<'_>,
) -> Result<()> {
    execute_as(transport, (info, info), plan, bufs, (elsewhere, false))
}

/// Runs the plan of one `send_recv` (`schedule::exchange`): its sends
/// carry `sending`'s headers and errors (a `send` call's), its receives
/// `receiving`'s (a `recv` call's), so each half meets a peer's lone
/// `recv` or `send`, or the other half of the peer's own `send_recv`.
pub(crate) fn execute_exchange<T: Element>(
    transport: &Transport,
    (sending, receiving): (&CallInfo, &CallInfo),
    plan: &Plan,
    bufs: Bufs<'_, T>,
    elsewhere: Elsewhere<'_>,
) -> Result<()> {
    debug_assert!(
        sending.space == Space::PointToPoint && receiving.space == Space::PointToPoint,
        "an exchange is two point-to-point calls"
    );
    // In place, the sends lend the buffer and each receive takes back what
    // is still queued of its span before writing it (`Lending::reclaims`),
    // instead of every send copying its span into a frame, where the
    // transport takes spans back cheaply.
    let reclaims = matches!(bufs, Bufs::InPlace(_)) && transport.takes_back_cheaply();
    execute_as(
        transport,
        (sending, receiving),
        plan,
        bufs,
        (elsewhere, reclaims),
    )
}

/// Scratch for the plans' [`BufId::Scratch`], kept between the calls of
/// this thread: a two-level reduce-scatter's scratch is `1/k` of its input
/// (`k` ranks a host), and a fresh allocation of that per call would fault
/// in every page again (what makes Open MPI's large reductions slow on
/// this project's machine, `docs/performance.md`). Taken out for a call
/// and put back after it, so a call that finds it taken (none does today:
/// calls do not nest) allocates its own. The largest scratch any call of
/// this thread used, up to [`KEPT_SCRATCH_MAX_BYTES`], stays allocated
/// until the thread ends (a larger one is freed when its call ends). Plans
/// write their scratch before they read it, so what an earlier call left
/// there is never read (the simulator starts scratch with unset symbols).
struct PlanScratch {
    /// 8-byte words: every element type's alignment divides 8.
    words: Vec<u64>,
}

/// The most scratch a thread keeps between calls: enough for a two-level
/// reduce-scatter of 128 MiB on two ranks a host (its scratch is half its
/// input) or the direct and tree plans' scratch of the calls the table
/// gives them, while a thread that once ran a huge call under a forced
/// `OXCCL_ALGO` does not hold its scratch for good (the thread outlives
/// the communicator).
const KEPT_SCRATCH_MAX_BYTES: usize = 64 << 20;

thread_local! {
    static KEPT_SCRATCH: std::cell::Cell<Vec<u64>> = const { std::cell::Cell::new(Vec::new()) };
}

impl PlanScratch {
    /// At least `bytes` of scratch.
    fn take(bytes: usize) -> PlanScratch {
        // (`try_with`: a call while the thread's locals are torn down
        // allocates its own; so does one above the cap, which leaves the
        // kept scratch as it is.)
        let mut words = if bytes == 0 || bytes > KEPT_SCRATCH_MAX_BYTES {
            Vec::new()
        } else {
            KEPT_SCRATCH
                .try_with(|kept| kept.take())
                .unwrap_or_default()
        };
        let needed = bytes.div_ceil(8);
        if words.len() < needed {
            // Exactly what the call needs: growth by doubling could pass
            // the cap for a call below it, and the kept scratch be freed.
            words.reserve_exact(needed - words.len());
            words.resize(needed, 0);
        }
        PlanScratch { words }
    }

    /// The first `len` elements, as `T`.
    fn as_slice_of<T: Element>(&mut self, len: usize) -> &mut [T] {
        let bytes = len * std::mem::size_of::<T>();
        let raw: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words);
        // 8-aligned (a `Vec<u64>`'s start), so the cast cannot fail.
        bytemuck::cast_slice_mut(&mut raw[..bytes])
    }
}

impl Drop for PlanScratch {
    fn drop(&mut self) {
        let words = std::mem::take(&mut self.words);
        if words.capacity() > 0 && words.capacity() * 8 <= KEPT_SCRATCH_MAX_BYTES {
            // Dropped instead while the thread's locals are torn down.
            let _ = KEPT_SCRATCH.try_with(|kept| {
                let other = kept.take();
                kept.set(if other.capacity() > words.capacity() {
                    other
                } else {
                    words
                });
            });
        }
    }
}

/// Runs `plan`, its sends as `sending` and its receives as `receiving`
/// (the same call but in `send_recv`): frame headers, and the call an
/// error names, come from the half that sent or received. Its plain
/// receives ([`Step::Recv`], the only ones point-to-point plans have) also
/// watch `elsewhere`; `reclaims`: see [`Lending::reclaims`].
fn execute_as<T: Element>(
    transport: &Transport,
    (sending, receiving): (&CallInfo, &CallInfo),
    plan: &Plan,
    bufs: Bufs<'_, T>,
    (mut elsewhere, reclaims): (Elsewhere<'_>, bool),
) -> Result<()> {
    debug_assert!(
        !reclaims
            || plan
                .steps
                .iter()
                .all(|s| matches!(s, Step::Send { .. } | Step::Recv { .. })),
        "only receives take lent spans back"
    );
    // A lone call passes its one `CallInfo` twice; the two halves of an
    // exchange share the rest: world, operator, deadline, space.
    let info = receiving;
    let mut inline_counts = [0u32; 2 * INLINE_COUNTER_WORLD];
    let mut heap_counts = Vec::new();
    let counts: &mut [u32] = if info.world <= INLINE_COUNTER_WORLD {
        &mut inline_counts[..2 * info.world]
    } else {
        heap_counts.resize(2 * info.world, 0);
        &mut heap_counts
    };
    let (sent, received) = counts.split_at_mut(info.world);
    let mut counters = Counters { sent, received };
    let op = info.reduce_op;
    // The tree and direct plans use scratch for small messages (or under
    // `OXCCL_ALGO=tree`), a two-level reduce-scatter a slot per host.
    let mut scratch = PlanScratch::take(plan.scratch_len * std::mem::size_of::<T>());
    let bufs = RawBufs::new(bufs, scratch.as_slice_of(plan.scratch_len));
    let mut lending = Lending {
        allowed: transport.takes_borrowed(info.space),
        in_place: bufs.in_place,
        clear: None,
        after_last_write: None,
        reclaims,
    };
    let mut guard = BorrowGuard {
        transport,
        lent: false,
    };
    let mut posted_ahead = PostedAhead {
        transport,
        recvs: Vec::new(),
    };
    if transport.receives_ahead() {
        let elem = std::mem::size_of::<T>();
        for (peer, frame, dst) in receives_to_post_ahead(plan, info.world, elem, bufs.in_place) {
            let at = bufs.write_ptr(dst).cast::<u8>();
            posted_ahead
                .recvs
                .push((peer, header::<T>(receiving, frame, dst.len), at));
        }
        // SAFETY: no step before a posted receive's reads or writes its
        // destination (`receives_to_post_ahead`), that receive's own
        // `recv_into` names the same destination, and `posted_ahead`
        // withdraws whatever is left before the buffers' borrow ends.
        unsafe { transport.post_ahead(&posted_ahead.recvs) };
    }
    let send = |counters: &mut Counters, peer: Rank, payload: Payload, len: usize| -> Result<()> {
        let step = counters.sent[peer];
        counters.sent[peer] += 1;
        transport
            .send(peer, header::<T>(sending, step, len), payload)
            .map_err(|e| sending.error(peer, e))
    };
    let recv = |counters: &mut Counters, peer: Rank, len: usize| -> Result<Payload> {
        let step = counters.received[peer];
        counters.received[peer] += 1;
        transport
            .recv(peer, &header::<T>(receiving, step, len), info.timeout)
            .map_err(|e| receiving.error(peer, e))
    };
    for (index, step) in plan.steps.iter().enumerate() {
        match *step {
            Step::Send { peer, src } => {
                let bytes: &[u8] = bytemuck::cast_slice(bufs.read(src));
                let payload = if lending.lends(plan, index, src) {
                    guard.lent = true;
                    // SAFETY: `lends` holds: no later step writes these
                    // bytes during the call, or (`reclaims`) the receive
                    // that does first has the transport copy every queued
                    // frame borrowing them; and `guard` copies whatever is
                    // still queued before the call returns (over the links
                    // the flush below leaves nothing queued on success; in
                    // process it also waits for receives still copying).
                    unsafe { Payload::borrowed(bytes) }
                } else {
                    Payload::from_bytes(bytes)
                };
                send(&mut counters, peer, payload, src.len)?;
            }
            Step::Recv { peer, dst } => {
                let step = counters.received[peer];
                counters.received[peer] += 1;
                if lending.reclaims && guard.lent {
                    // Exchanges receive into the written buffer only.
                    debug_assert!(dst.buf != BufId::Scratch, "an exchange names no scratch");
                    let at = bufs.write_ptr(dst) as usize;
                    transport.own_borrowed_within(at..at + dst.len * std::mem::size_of::<T>());
                }
                let out = bytemuck::cast_slice_mut(bufs.write(dst));
                transport
                    .recv_into(
                        peer,
                        &header::<T>(receiving, step, dst.len),
                        info.timeout,
                        out,
                        elsewhere
                            .as_mut()
                            .map(|came| &mut **came as &mut dyn FnMut() -> bool),
                    )
                    .map_err(|e| receiving.error(peer, e))?;
            }
            Step::RecvReduce { peer, local, dst } => {
                let payload = recv(&mut counters, peer, dst.len)?;
                let incoming: &[T] = bytemuck::cast_slice(payload.as_bytes());
                let memory = bufs.memory(dst.buf);
                if bufs.memory(local.buf) != memory {
                    T::combine_into(op, bufs.write(dst), bufs.read(local), incoming);
                } else {
                    if local.offset != dst.offset {
                        bufs.move_in(memory, local.offset, dst.offset, local.len);
                    }
                    T::combine_assign(op, bufs.write(dst), incoming);
                }
            }
            Step::RecvReduceSend { from, to, local } => {
                let mut payload = recv(&mut counters, from, local.len)?;
                let incoming: &mut [T] = bytemuck::cast_slice_mut(payload.as_bytes_mut());
                T::combine_assign_rev(op, incoming, bufs.read(local));
                send(&mut counters, to, payload, local.len)?;
            }
            Step::RecvCopySend { from, to, dst } => {
                let payload = recv(&mut counters, from, dst.len)?;
                bufs.write(dst)
                    .copy_from_slice(bytemuck::cast_slice(payload.as_bytes()));
                send(&mut counters, to, payload, dst.len)?;
            }
            Step::Copy { src, dst } => bufs.copy(src, dst),
            Step::ReduceLocal { src, dst } => {
                if bufs.memory(src.buf) != bufs.memory(dst.buf) {
                    T::combine_assign(op, bufs.write(dst), bufs.read(src))
                } else {
                    // Both in one buffer: the plans keep them apart, but
                    // the source is copied out rather than relied on.
                    let data = bufs.read(src).to_vec();
                    T::combine_assign(op, bufs.write(dst), &data);
                }
            }
            // The plans' last step of `Avg`; a type whose inputs were
            // premultiplied skips it, as the arena's folds do.
            Step::DivideByWorld { span } => finish_avg(ReduceOp::Avg, bufs.write(span), info.world),
        }
    }
    // Waiting for this call's sends to leave: their half names it.
    let flushed = transport
        .flush(info.timeout)
        .map_err(|(peer, e)| sending.error(peer, e));
    drop(guard);
    drop(posted_ahead);
    flushed?;
    if info.space == Space::Collective {
        if let Some((peer, frame)) = transport.unclaimed(info.seq) {
            return Err(info.error(
                peer,
                TransportError::Mismatch(format!(
                    "rank {peer} sent step {} of its {} #{} (call digest {:#010x}), which this \
                     rank ran without receiving from it (a different root on each rank?)",
                    frame.step, frame.op, frame.seq, frame.call
                )),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exchange in place: its receives overwrite every span it sends,
    /// so its sends copy, unless the receives take back what is still
    /// queued (`reclaims`), when every non-empty send lends.
    #[test]
    fn an_exchange_in_place_lends_only_when_its_receives_take_spans_back() {
        let piece = |offset| Span::new(BufId::Send, offset, 4);
        let send = Plan {
            steps: vec![
                Step::Send {
                    peer: 1,
                    src: piece(0),
                },
                Step::Send {
                    peer: 1,
                    src: piece(4),
                },
            ],
            scratch_len: 0,
        };
        let recv = Plan {
            steps: vec![
                Step::Recv {
                    peer: 1,
                    dst: Span::new(BufId::Recv, 0, 4),
                },
                Step::Recv {
                    peer: 1,
                    dst: Span::new(BufId::Recv, 4, 4),
                },
            ],
            scratch_len: 0,
        };
        let plan = crate::schedule::exchange(send, recv, true);
        for reclaims in [false, true] {
            let mut lending = Lending {
                allowed: true,
                in_place: true,
                clear: None,
                after_last_write: None,
                reclaims,
            };
            let lent: Vec<bool> = (0..2)
                .map(|index| match plan.steps[index] {
                    Step::Send { src, .. } => lending.lends(&plan, index, src),
                    _ => unreachable!("the sends come first"),
                })
                .collect();
            assert_eq!(lent, [reclaims, reclaims]);
        }
    }

    /// A call's scratch is the thread's kept scratch when it is large
    /// enough (no allocation, no page faulted in again), and the largest
    /// goes back after a call.
    #[test]
    fn plan_scratch_is_kept_between_calls() {
        std::thread::spawn(|| {
            let first = {
                let mut scratch = PlanScratch::take(4000);
                let floats = scratch.as_slice_of::<f32>(1000);
                assert_eq!(floats.len(), 1000);
                floats.as_ptr() as usize
            };
            // Smaller, of another type: the same memory.
            let mut scratch = PlanScratch::take(800);
            assert_eq!(scratch.as_slice_of::<u64>(100).as_ptr() as usize, first);
            // A call that finds it taken gets its own.
            let mut other = PlanScratch::take(16);
            assert_ne!(other.as_slice_of::<u8>(16).as_ptr() as usize, first);
            drop(other);
            drop(scratch);
            let mut again = PlanScratch::take(4000);
            assert_eq!(again.as_slice_of::<f32>(1000).as_ptr() as usize, first);
            // No scratch takes nothing.
            let mut none = PlanScratch::take(0);
            assert!(none.as_slice_of::<f64>(0).is_empty());
            drop(none);
            drop(again);
            // Scratch above the cap is freed after its call: the kept one
            // stays what it was.
            let huge = PlanScratch::take(KEPT_SCRATCH_MAX_BYTES + 8);
            assert!(huge.words.capacity() * 8 > KEPT_SCRATCH_MAX_BYTES);
            drop(huge);
            let mut kept = PlanScratch::take(8);
            assert_eq!(kept.as_slice_of::<u8>(8).as_ptr() as usize, first);
            assert!(kept.words.capacity() * 8 <= KEPT_SCRATCH_MAX_BYTES);
            drop(kept);
            // Grown by a call below the cap (5/8, then 6/8 of it: doubling
            // would pass it), the scratch is still kept.
            drop(PlanScratch::take(KEPT_SCRATCH_MAX_BYTES / 8 * 5));
            let grown = PlanScratch::take(KEPT_SCRATCH_MAX_BYTES / 8 * 6);
            let at = grown.words.as_ptr() as usize;
            drop(grown);
            assert_eq!(PlanScratch::take(8).words.as_ptr() as usize, at);
        })
        .join()
        .unwrap();
    }

    /// Which ring sends may lend the caller's buffer: those of spans no
    /// later step writes. An all-gather's or reduce-scatter's sends all
    /// read parts the call never writes. An all-reduce's reduce-scatter
    /// phase sends chunks its all-gather phase overwrites (a queued frame
    /// would change), so in place only its all-gather phase lends; out of
    /// place the first phase sends the input, which is never written.
    #[test]
    fn sends_lend_only_what_no_later_step_writes() {
        use crate::schedule::{ring, Place};
        let lent = |steps: Vec<Step>, in_place: bool| {
            let plan = Plan {
                steps,
                scratch_len: 0,
            };
            let mut lending = Lending {
                allowed: true,
                in_place,
                clear: None,
                after_last_write: None,
                reclaims: false,
            };
            let sends: Vec<bool> = plan
                .steps
                .iter()
                .enumerate()
                .filter_map(|(index, s)| match *s {
                    Step::Send { src, .. } => Some(lending.lends(&plan, index, src)),
                    _ => None,
                })
                .collect();
            assert!(!sends.is_empty());
            sends
        };
        for (rank, world) in [(0, 2), (1, 2), (2, 3), (1, 4)] {
            let mut steps = Vec::new();
            ring::all_gather(Place::by_rank(rank, world), 1000, 64, true, &mut steps);
            assert!(
                lent(steps, true).iter().all(|&l| l),
                "all-gather {rank}/{world}"
            );
            let mut steps = Vec::new();
            ring::reduce_scatter(
                Place::by_rank(rank, world),
                1000,
                64,
                true,
                false,
                &mut steps,
            );
            assert!(
                lent(steps, true).iter().all(|&l| l),
                "reduce-scatter {rank}/{world}"
            );
            // Each piece sends once per phase: reduce-scatter, all-gather.
            let pieces = 4000usize.div_ceil(world).div_ceil(64);
            let mut steps = Vec::new();
            ring::all_reduce(
                Place::by_rank(rank, world),
                4000,
                64,
                true,
                false,
                &mut steps,
            );
            let phases: Vec<bool> = (0..pieces).flat_map(|_| [false, true]).collect();
            assert_eq!(lent(steps, true), phases, "all-reduce {rank}/{world}");
            let mut steps = Vec::new();
            ring::all_reduce(
                Place::by_rank(rank, world),
                4000,
                64,
                false,
                false,
                &mut steps,
            );
            assert!(
                lent(steps, false).iter().all(|&l| l),
                "all-reduce out of place {rank}/{world}"
            );
        }
        // Not allowed by the transport: nothing lends.
        let mut steps = Vec::new();
        ring::all_gather(Place::by_rank(0, 2), 1000, 64, true, &mut steps);
        let plan = Plan {
            steps,
            scratch_len: 0,
        };
        let mut lending = Lending {
            allowed: false,
            in_place: true,
            clear: None,
            after_last_write: None,
            reclaims: false,
        };
        assert!(plan.steps.iter().enumerate().all(|(index, s)| match *s {
            Step::Send { src, .. } => !lending.lends(&plan, index, src),
            _ => true,
        }));
    }

    #[test]
    fn lending_without_the_table_agrees_with_it() {
        // Every in-place send of every kind of plan: `lends` (which skips
        // the table for sends after the last writing step) says what the
        // table says. Chains whose rank only sends (an in-place broadcast's
        // root, a reduce's first rank) take the shortcut for every piece.
        use crate::schedule::{ring, tree, Place};
        let mut plans: Vec<Vec<Step>> = Vec::new();
        for (rank, world) in [(0, 2), (1, 2), (0, 3), (2, 3), (1, 4), (3, 4)] {
            for root in 0..world {
                let mut steps = Vec::new();
                tree::broadcast_chain(
                    Place::by_rank(rank, world),
                    root,
                    1000,
                    64,
                    true,
                    &mut steps,
                );
                plans.push(steps);
                let mut steps = Vec::new();
                tree::reduce_chain(
                    Place::by_rank(rank, world),
                    root,
                    1000,
                    64,
                    true,
                    false,
                    &mut steps,
                );
                plans.push(steps);
            }
            let mut steps = Vec::new();
            ring::all_reduce(
                Place::by_rank(rank, world),
                4000,
                64,
                true,
                false,
                &mut steps,
            );
            plans.push(steps);
            let mut steps = Vec::new();
            ring::all_gather(Place::by_rank(rank, world), 1000, 64, true, &mut steps);
            plans.push(steps);
        }
        let mut shortcuts = 0;
        for steps in plans {
            let plan = Plan {
                steps,
                scratch_len: 0,
            };
            let table = sends_clear_of_later_writes(&plan);
            let mut lending = Lending {
                allowed: true,
                in_place: true,
                clear: None,
                after_last_write: None,
                reclaims: false,
            };
            for (index, step) in plan.steps.iter().enumerate() {
                if let Step::Send { src, .. } = *step {
                    let lent = lending.lends(&plan, index, src);
                    assert_eq!(
                        lent,
                        src.len > 0 && table[index],
                        "step {index} of {plan:?}"
                    );
                    if lending.clear.is_none() && lent {
                        shortcuts += 1;
                    }
                }
            }
        }
        assert!(shortcuts > 0, "no send took the shortcut");
    }

    #[test]
    fn span_sets_merge_and_later_writes_bound_what_sends_lend() {
        let out = |offset, len| Span::new(BufId::Recv, offset, len);
        let mut set = SpanSet::default();
        for span in [out(10, 5), out(30, 3), out(15, 5), out(50, 0)] {
            set.insert(span);
        }
        let ranges: Vec<(usize, usize)> = set.0.iter().map(|(&s, &e)| (s, e)).collect();
        assert_eq!(ranges, vec![(10, 20), (30, 33)]);
        assert!(!set.overlaps(out(0, 10)));
        assert!(set.overlaps(out(0, 11)));
        assert!(set.overlaps(out(19, 1)));
        assert!(!set.overlaps(out(20, 10)));
        assert!(set.overlaps(out(25, 6)));
        assert!(!set.overlaps(out(33, 100)));
        assert!(!set.overlaps(out(12, 0)));
        // Spans are checked without overflow.
        assert!(within(0, 64, 64) && within(64, 0, 64) && !within(1, 64, 64));
        assert!(!within(usize::MAX, 2, 64) && !within(2, usize::MAX, 64));

        let send = |src| Step::Send { peer: 1, src };
        let plan = Plan {
            steps: vec![
                // 0: only read later (a copy into scratch writes no output).
                send(out(0, 4)),
                Step::Recv {
                    peer: 1,
                    dst: out(10, 5),
                },
                Step::Copy {
                    src: out(0, 4),
                    dst: Span::new(BufId::Scratch, 0, 4),
                },
                Step::DivideByWorld { span: out(15, 5) },
                // 4: the receive at 8 only touches its end.
                send(out(40, 8)),
                // 5: written before (step 1), never after.
                send(out(12, 2)),
                // 6: the copy at 7 writes 30..33.
                send(out(29, 2)),
                Step::Copy {
                    src: Span::new(BufId::Send, 0, 3),
                    dst: out(30, 3),
                },
                Step::Recv {
                    peer: 1,
                    dst: out(48, 2),
                },
                // 9: empty sends are copied.
                send(out(40, 0)),
                Step::Recv {
                    peer: 1,
                    dst: out(50, 0),
                },
                // 11: scratch is the executor's.
                send(Span::new(BufId::Scratch, 0, 4)),
            ],
            scratch_len: 4,
        };
        let mut lending = Lending {
            allowed: true,
            in_place: true,
            clear: None,
            after_last_write: None,
            reclaims: false,
        };
        let lends: Vec<(usize, bool)> = plan
            .steps
            .iter()
            .enumerate()
            .filter_map(|(index, s)| match *s {
                Step::Send { src, .. } => Some((index, lending.lends(&plan, index, src))),
                _ => None,
            })
            .collect();
        assert_eq!(
            lends,
            vec![
                (0, true),
                (4, true),
                (5, true),
                (6, false),
                (9, false),
                (11, false)
            ]
        );
    }

    /// Only plain receives of the written buffer that nothing earlier
    /// touches are posted ahead, numbered by their frame from that peer.
    #[test]
    fn receives_posted_ahead_are_those_into_untouched_output() {
        let k = 32 << 10; // 128 KiB of f32
        let out = |offset, len| Span::new(BufId::Recv, offset, len);
        let plan = Plan {
            steps: vec![
                Step::Send {
                    peer: 1,
                    src: out(0, k),
                },
                // Overlaps what was just sent: not ahead (frame 0 from 1).
                Step::Recv {
                    peer: 1,
                    dst: out(k / 2, k),
                },
                // Untouched: ahead, as frame 1 from rank 1.
                Step::Recv {
                    peer: 1,
                    dst: out(3 * k, k),
                },
                // Too small (frame 2).
                Step::Recv {
                    peer: 1,
                    dst: out(5 * k, 16),
                },
                // Input buffer, out of place: never written (frame 0 from 2).
                Step::Recv {
                    peer: 2,
                    dst: Span::new(BufId::Send, 0, k),
                },
                // Untouched, frame 1 from rank 2.
                Step::Recv {
                    peer: 2,
                    dst: out(6 * k, k),
                },
                Step::Copy {
                    src: out(8 * k, k),
                    dst: out(9 * k, k),
                },
                // Written by the copy above: not ahead.
                Step::Recv {
                    peer: 2,
                    dst: out(9 * k + 5, k),
                },
            ],
            scratch_len: 0,
        };
        let ahead = receives_to_post_ahead(&plan, 3, 4, false);
        assert_eq!(ahead, vec![(1, 1, out(3 * k, k)), (2, 1, out(6 * k, k))]);
        // In place the input is the output, offsets alike: its first k
        // elements are the span sent first, so that receive is not ahead.
        assert_eq!(receives_to_post_ahead(&plan, 3, 4, true), ahead);
        // A plan without a large plain receive posts nothing.
        let small = Plan {
            steps: vec![Step::Recv {
                peer: 1,
                dst: out(0, 16),
            }],
            scratch_len: 0,
        };
        assert!(receives_to_post_ahead(&small, 2, 4, false).is_empty());
    }
}
