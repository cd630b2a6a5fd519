//! Transports move framed bytes between ranks and nothing else: they know
//! peers and frame headers, never a dtype or an operator.

pub(crate) mod iface;
pub(crate) mod local;
pub(crate) mod net;
pub(crate) mod shm;
pub(crate) mod tcp;

use std::time::Duration;

use crate::schedule::RingOrder;
use crate::types::{OpKind, Rank};

/// A map keyed by frame keys and other small integer tuples, looked up
/// several times per frame. It hashes with a multiply-rotate (as rustc's
/// own maps do) instead of `HashMap`'s SipHash, which took 8 % of a
/// spinning receiver's user time in an 8-byte broadcast over TCP. SipHash
/// resists keys chosen to collide; here every key comes from a peer that
/// presented the job's token, and such a peer can already stall or fail
/// the job outright, so that resistance protects nothing.
pub(crate) type FrameMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<FrameKeyHasher>>;

/// The hasher of [`FrameMap`].
#[derive(Default, Clone, Copy)]
pub(crate) struct FrameKeyHasher(u64);

impl FrameKeyHasher {
    fn add(&mut self, word: u64) {
        // FxHash's step: the multiply spreads each word into the high bits
        // (see `finish`).
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl std::hash::Hasher for FrameKeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }
    fn write_u16(&mut self, n: u16) {
        self.add(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
    fn write_isize(&mut self, n: isize) {
        self.add(n as u64);
    }
    fn finish(&self) -> u64 {
        // A product's high bits depend on all of its factors' bits, its
        // low bits only on their low bits; the table indexes its buckets by
        // the low bits, so the well-mixed high ones go there (as rustc-hash
        // 2 does).
        self.0.rotate_left(26)
    }
}

/// What a receive over the links also watches while it waits (see
/// [`Transport::recv_into`]): `true` once its message is known to have come
/// another way, a pair lane of the arena (sent small to a receive too large
/// for the lane, a length mismatch the caller reports).
pub(crate) type Elsewhere<'a> = Option<&'a mut dyn FnMut() -> bool>;

/// The error a receive ends with when [`Elsewhere`] said so; its caller
/// words the mismatch.
pub(crate) fn came_elsewhere() -> TransportError {
    TransportError::Mismatch("the message came through a pair lane".into())
}

/// Which numbering a frame's sequence number belongs to: collectives are
/// numbered per communicator, point-to-point calls per ordered pair of ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Space {
    Collective,
    PointToPoint,
}

/// Per `(ctx, seq)`, how many collective frames wait in a transport's
/// buffer of arrived frames, kept beside it: the end-of-call check for
/// frames no receive took ([`Transport::unclaimed`]) is then a range lookup,
/// not a walk over every frame buffered (a rank running ahead leaves
/// thousands of later calls' frames there).
#[derive(Default)]
pub(crate) struct CollectiveArrivals(std::collections::BTreeMap<(u64, u64), usize>);

impl CollectiveArrivals {
    /// A frame of `(ctx, space, seq)` was filed.
    pub(crate) fn filed(&mut self, ctx: u64, space: Space, seq: u64) {
        if space == Space::Collective {
            *self.0.entry((ctx, seq)).or_default() += 1;
        }
    }

    /// A frame of `(ctx, space, seq)` was taken out.
    pub(crate) fn taken(&mut self, ctx: u64, space: Space, seq: u64) {
        if space != Space::Collective {
            return;
        }
        if let Some(count) = self.0.get_mut(&(ctx, seq)) {
            *count -= 1;
            if *count == 0 {
                self.0.remove(&(ctx, seq));
            }
        }
    }

    /// Whether a collective frame of context `ctx`, call `seq` or earlier,
    /// is filed.
    pub(crate) fn any_up_to(&self, ctx: u64, seq: u64) -> bool {
        self.0.range((ctx, 0)..=(ctx, seq)).next().is_some()
    }
}

/// What identifies and describes a frame. `(source, ctx, space, seq, step)`
/// identifies it; `op`, `bytes` and `call` are checked on arrival so that
/// ranks running different calls are told so instead of corrupting data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    /// The communicator's context id (distinct for every split).
    pub ctx: u64,
    pub space: Space,
    pub seq: u64,
    /// Index of this frame among the frames of this call between this pair.
    pub step: u32,
    pub op: OpKind,
    pub bytes: usize,
    /// A digest of the call the frame belongs to ([`CallInfo::digest`]):
    /// element type, reduce operation, root and element count, which the
    /// ranks of one call agree on and which `op` and a piece's `bytes` do
    /// not show (an `f32` sum against an `i32` one, or a send of twice
    /// what the receive takes, whose first piece matches). 0 for frames
    /// that are not a call's (goodbye, leave).
    ///
    /// [`CallInfo::digest`]: crate::host::executor::CallInfo::digest
    pub call: u32,
}

impl FrameHeader {
    /// Checks an arrived frame (found under the expected key) against what
    /// this rank expects: ranks running different operations or sizes are
    /// told so instead of corrupting data.
    pub fn check_matches(&self, expect: &FrameHeader) -> Result<(), TransportError> {
        if self.op != expect.op {
            return Err(TransportError::Mismatch(format!(
                "peer is running {} but this rank is running {}",
                self.op, expect.op
            )));
        }
        if self.bytes != expect.bytes {
            return Err(TransportError::Mismatch(format!(
                "peer sent {} bytes where {} were expected (counts differ between ranks?)",
                self.bytes, expect.bytes
            )));
        }
        if self.call != expect.call {
            return Err(TransportError::Mismatch(format!(
                "peer runs another {} (call digest {:#010x} against this rank's {:#010x}): \
                 element type, reduce operation, root or element count differ between ranks",
                self.op, self.call, expect.call
            )));
        }
        Ok(())
    }
}

/// Owned frame bytes, 8-byte aligned so they can be viewed as any element type.
///
/// Large buffers come from and return to [`pool`]: a fresh allocation of a
/// pipeline piece (256 KiB, or 1 MiB for a ring over TCP) is an `mmap` whose pages fault in one by one as
/// they are first written — on this VM about as long as copying the piece
/// twice — and every frame of a large call needs one on each side.
///
/// A payload may instead *borrow* the caller's bytes ([`Payload::borrowed`]):
/// a send straight from the user's buffer, without the copy into a frame.
#[derive(Debug, Default)]
pub(crate) struct Payload {
    words: Vec<u64>,
    bytes: usize,
    /// The borrowed bytes, or null for owned ones.
    external: Option<std::ptr::NonNull<u8>>,
}

// SAFETY: owned payloads are plain vectors; a borrowed one points at bytes
// its creator keeps valid and unmodified until the payload is dropped or
// made owned (the contract of `Payload::borrowed`), and is only read.
unsafe impl Send for Payload {}

impl Payload {
    /// A payload that reads `data` in place instead of copying it.
    ///
    /// # Safety
    ///
    /// `data` must stay valid and unmodified until the payload is dropped
    /// or [`make_owned`](Self::make_owned) was called on it (a call that
    /// queues one runs [`Transport::own_borrowed`] before it returns).
    pub unsafe fn borrowed(data: &[u8]) -> Payload {
        Payload {
            words: Vec::new(),
            bytes: data.len(),
            external: std::ptr::NonNull::new(data.as_ptr().cast_mut()),
        }
    }

    /// Whether this payload borrows its creator's bytes.
    pub fn is_borrowed(&self) -> bool {
        self.external.is_some()
    }

    /// How many of the bytes at the addresses `range` this payload borrows.
    pub fn borrowed_within(&self, range: &std::ops::Range<usize>) -> usize {
        self.external.map_or(0, |p| {
            let start = p.as_ptr() as usize;
            let end = start + self.bytes;
            end.min(range.end).saturating_sub(start.max(range.start))
        })
    }

    /// Copies borrowed bytes into a buffer of its own (no-op when owned).
    pub fn make_owned(&mut self) {
        if self.external.is_some() {
            let owned = Payload::from_bytes(self.as_bytes());
            *self = owned;
        }
    }

    pub fn from_bytes(data: &[u8]) -> Payload {
        let mut words = pool::take(data.len().div_ceil(8));
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..data.len()].copy_from_slice(data);
        Payload {
            words,
            bytes: data.len(),
            external: None,
        }
    }

    /// `bytes` bytes to be filled by a receive (zero, or a recycled
    /// buffer's old contents: a receive overwrites all of them).
    pub fn zeroed(bytes: usize) -> Payload {
        Payload {
            words: pool::take(bytes.div_ceil(8)),
            bytes,
            external: None,
        }
    }

    /// Makes an owned payload `bytes` long, keeping its contents (the
    /// bytes added are zero or recycled, as in [`zeroed`](Self::zeroed)).
    pub fn grow_to(&mut self, bytes: usize) {
        self.make_owned();
        let words = bytes.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.bytes = self.bytes.max(bytes);
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self.external {
            // SAFETY: valid for `bytes` bytes (the contract of `borrowed`).
            Some(p) => unsafe { std::slice::from_raw_parts(p.as_ptr(), self.bytes) },
            None => &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.bytes],
        }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // Borrowed bytes are never written: take a copy first.
        self.make_owned();
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.bytes]
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        pool::give(std::mem::take(&mut self.words));
    }
}

/// Recycled payload buffers, shared by every communicator of the process
/// (frames are made on one thread and dropped on another).
mod pool {
    use std::sync::Mutex;

    /// Buffers below this many words are left to `malloc` (fast, no mmap).
    const MIN_WORDS: usize = 16 * 1024 / 8;
    /// Buffers above this are not kept (a pool for pipeline pieces, not for
    /// whole messages of a large eager send).
    const MAX_WORDS: usize = 8 * 1024 * 1024 / 8;
    /// At most this many bytes wait in the pool: the frames a receiver may
    /// hold read ahead (`net::READ_AHEAD_BYTES`) and those in flight, so
    /// steady streams never allocate.
    const MAX_POOLED_WORDS: usize = 32 * 1024 * 1024 / 8;

    static POOL: Mutex<Vec<Vec<u64>>> = Mutex::new(Vec::new());

    /// A buffer of at least `words` initialised words: a recycled one (not
    /// more than 4× longer), or a new zeroed one. A recycled buffer keeps
    /// its whole length, so it can serve a larger request again later
    /// ([`Payload`] remembers how many bytes it uses): truncating it would
    /// shrink the pool's buffers until every large frame took a fresh,
    /// page-faulting allocation.
    pub(super) fn take(words: usize) -> Vec<u64> {
        if words >= MIN_WORDS {
            let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = pool
                .iter()
                .position(|v| v.len() >= words && v.len() / 4 <= words)
            {
                return pool.swap_remove(i);
            }
        }
        vec![0u64; words]
    }

    /// Keeps `v` for a later `take` when it is worth keeping.
    pub(super) fn give(v: Vec<u64>) {
        if v.len() < MIN_WORDS || v.len() > MAX_WORDS {
            return;
        }
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let pooled: usize = pool.iter().map(Vec::len).sum();
        if pooled + v.len() <= MAX_POOLED_WORDS {
            pool.push(v);
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn borrowed_payloads_read_in_place_and_copy_before_writing() {
            let data = vec![1u8, 2, 3, 4];
            // SAFETY: `data` outlives the payload and is not written.
            let mut p = unsafe { super::super::Payload::borrowed(&data) };
            assert_eq!(p.as_bytes().as_ptr(), data.as_ptr());
            p.as_bytes_mut()[0] = 9;
            assert_eq!(p.as_bytes(), &[9, 2, 3, 4]);
            assert_eq!(data, [1, 2, 3, 4]);
        }

        #[test]
        fn large_buffers_are_recycled_whole() {
            // The pool is the process's: other tests' buffers may serve.
            let v = take(40_000);
            assert!(v.len() >= 40_000);
            let ptr = v.as_ptr();
            give(v);
            // A slightly smaller request reuses it (whole, same memory)...
            let w = take(39_000);
            assert!(w.len() >= 39_000);
            let reused = w.as_ptr() == ptr;
            give(w);
            // ...unless another test thread took it first; but a tiny one
            // never takes a large buffer, and small ones are never pooled.
            assert_eq!(take(10).len(), 10);
            assert!(
                reused
                    || POOL.lock().unwrap().iter().map(Vec::len).sum::<usize>() <= MAX_POOLED_WORDS
            );
            let big = take(MAX_WORDS + 1);
            give(big);
            assert!(POOL
                .lock()
                .unwrap()
                .iter()
                .all(|v| v.len() <= MAX_WORDS && v.len() >= MIN_WORDS));
        }
    }
}

/// Why a rank's communicator failed, as it tells the others (so that they
/// name the rank at the root of a failure rather than the messenger):
/// the communicator rank it lost or timed out waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FailureCause {
    /// That rank was gone (left, died, failed).
    Lost(usize),
    /// That rank did not answer within the timeout.
    Late(usize),
}

impl FailureCause {
    /// What `error`, a failure of this rank's call, tells the others: a
    /// lost peer (they may meet this rank's departure before they find
    /// that peer gone themselves), or a late one, so that they name it
    /// rather than this rank that gave up on it; not where this rank is
    /// the late one (a peer gave up waiting on it while it waited on
    /// another: naming itself would mislead).
    pub fn of(error: &crate::error::Error) -> Option<FailureCause> {
        use crate::error::Error;
        match *error {
            Error::PeerLost { peer, .. } => Some(FailureCause::Lost(peer)),
            Error::Timeout { peer, .. } => Some(FailureCause::Late(peer)),
            Error::PeerTimedOut { late, rank, .. } if late != rank => {
                Some(FailureCause::Late(late))
            }
            _ => None,
        }
    }

    /// The same cause with its rank mapped (`f`: communicator rank to
    /// global, or back); `None` where `f` has none.
    pub fn map(self, f: impl FnOnce(usize) -> Option<usize>) -> Option<FailureCause> {
        match self {
            FailureCause::Lost(r) => f(r).map(FailureCause::Lost),
            FailureCause::Late(r) => f(r).map(FailureCause::Late),
        }
    }

    /// The error a rank reports for member `failed`, which failed for this
    /// cause (its rank a communicator rank); `me`, the reporting rank, is
    /// never named as lost.
    pub fn error_for(self, failed: usize, me: usize) -> TransportError {
        match self {
            FailureCause::Late(late) => TransportError::PeerTimedOut { rank: failed, late },
            FailureCause::Lost(lost) if lost != me => TransportError::PeerLost { rank: Some(lost) },
            FailureCause::Lost(_) => TransportError::PeerLost { rank: Some(failed) },
        }
    }
}

/// Why a transport call failed; the executor adds the op, rank and peer.
#[derive(Debug)]
pub(crate) enum TransportError {
    Timeout(Duration),
    /// A peer is gone: `rank` names it (a communicator rank) when it is not
    /// the peer the call was talking to.
    PeerLost {
        rank: Option<usize>,
    },
    /// Rank `rank` (a communicator rank) failed because it timed out
    /// waiting for rank `late`: this call cannot finish either.
    PeerTimedOut {
        rank: usize,
        late: usize,
    },
    Aborted,
    Mismatch(String),
    /// The operating system refused a transfer with the peer (what, why).
    Refused(String),
}

/// The transports a host communicator can use (static dispatch).
pub(crate) enum Transport {
    Local(local::LocalEndpoint),
    /// Separate processes, over shared memory and TCP.
    Net(net::NetEndpoint),
}

impl Transport {
    /// Whether the group was aborted. A call looks before it starts, so
    /// one that moves nothing over the links (no elements, one rank) fails
    /// after an abort as every other call does.
    pub fn is_aborted(&self) -> bool {
        match self {
            Transport::Local(t) => t.group().is_aborted(),
            Transport::Net(t) => t.shared().is_aborted(),
        }
    }

    pub fn send(
        &self,
        peer: usize,
        header: FrameHeader,
        payload: Payload,
    ) -> Result<(), TransportError> {
        match self {
            Transport::Local(t) => t.send(peer, header, payload),
            Transport::Net(t) => t.send(peer, header, payload),
        }
    }

    pub fn recv(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
    ) -> Result<Payload, TransportError> {
        match self {
            Transport::Local(t) => t.recv(peer, expect, timeout),
            Transport::Net(t) => t.recv(peer, expect, timeout),
        }
    }

    /// Whether the frame `expect` from `peer` has arrived or started to.
    /// The multi-process transport first reads what its links hold, past
    /// the read-ahead limit when the asking wait has `stalled` (as its own
    /// receives do): a peer whose send waits for room in a link may be
    /// the one that sends what the asker waits for. A receive waiting for
    /// a message that may come another way (a pair lane of the arena)
    /// asks, now and then.
    pub fn has_frame(&self, peer: usize, expect: &FrameHeader, stalled: bool) -> bool {
        match self {
            Transport::Local(t) => t.has_frame(peer, expect),
            Transport::Net(t) => t.has_frame(peer, expect, stalled),
        }
    }

    /// [`recv`](Self::recv) into `dst`: the multi-process transport reads a
    /// frame that arrives while this waits straight into `dst`. While it
    /// waits it also asks `elsewhere` (if any) now and then, and ends with
    /// a `Mismatch` once that says the message came another way.
    pub fn recv_into(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
        dst: &mut [u8],
        elsewhere: Elsewhere<'_>,
    ) -> Result<(), TransportError> {
        match self {
            Transport::Local(t) => t.recv_into(peer, expect, timeout, dst, elsewhere),
            Transport::Net(t) => t.recv_into(peer, expect, timeout, dst, elsewhere),
        }
    }

    /// Tells the ranks of this transport that this rank's communicator
    /// failed: their waits on it in this communicator fail at once.
    /// `cause`: the (communicator) rank whose loss or lateness made this
    /// one fail, when known; they name it.
    pub fn mark_failed(&self, cause: Option<FailureCause>) {
        match self {
            Transport::Local(t) => t.mark_failed(cause),
            Transport::Net(t) => t.mark_failed(cause),
        }
    }

    /// Posts destinations for receives that `recv_into` will run later
    /// (`(peer, expected header, destination)`), so that their frames, if
    /// they arrive first, land in place rather than in buffers copied
    /// later: the multi-process transport's receive-ahead. The in-process
    /// transport has no use for it.
    ///
    /// # Safety
    /// Each destination (`expect.bytes` long) must stay valid and untouched
    /// by anything else until its `recv_into` returns, or until
    /// [`withdraw`](Self::withdraw) names it.
    pub unsafe fn post_ahead(&self, recvs: &[(usize, FrameHeader, *mut u8)]) {
        if let Transport::Net(t) = self {
            t.post_ahead(recvs);
        }
    }

    /// Whether [`post_ahead`](Self::post_ahead) does anything.
    pub fn receives_ahead(&self) -> bool {
        matches!(self, Transport::Net(_))
    }

    /// Withdraws destinations posted by [`post_ahead`](Self::post_ahead)
    /// (those whose receive already returned are gone already): a frame
    /// being read into one moves into a buffer of its own.
    pub fn withdraw(&self, recvs: &[(usize, FrameHeader, *mut u8)]) {
        if let Transport::Net(t) = self {
            t.withdraw(recvs);
        }
    }

    /// Turns every queued payload that borrows a caller's buffer into an
    /// owned copy (of all its bytes, a frame partly written included,
    /// which goes on from where it was): what a call that queued
    /// borrowed payloads runs before returning, so nothing reads its
    /// buffers afterwards. In process it also waits for receives copying
    /// out of lent frames they took.
    pub fn own_borrowed(&self) {
        match self {
            Transport::Local(t) => t.own_borrowed(),
            Transport::Net(t) => t.own_borrowed(),
        }
    }

    /// [`own_borrowed`](Self::own_borrowed) for the queued payloads that
    /// borrow any byte at the addresses `range` only: what a call runs
    /// before it overwrites bytes it may have lent.
    pub fn own_borrowed_within(&self, range: std::ops::Range<usize>) {
        match self {
            Transport::Local(t) => t.own_borrowed_within(range),
            Transport::Net(t) => t.own_borrowed_within(range),
        }
    }

    /// Whether a call that lends a span and then overwrites it (an
    /// exchange in place) should take back the queued frames that borrow it
    /// ([`own_borrowed_within`](Self::own_borrowed_within)) rather than
    /// copy every send: over the links, yes. Between threads, no: both
    /// ranks take back at once what the other is about to read, and each
    /// then reads the other's copy, which the other core has just written
    /// (two threads, 128 KiB in place: 23.8–25.9 µs taking back, against
    /// 7.5–8.7 copying each send; 512 KiB 71.8–77.6 against 34.4–51.2).
    pub fn takes_back_cheaply(&self) -> bool {
        matches!(self, Transport::Net(_))
    }

    /// Whether sends of a call in `space` may borrow the caller's buffer
    /// ([`Payload::borrowed`]); both transports copy what is still queued
    /// at [`own_borrowed`](Self::own_borrowed). The multi-process transport
    /// writes queued frames to its links and drops them: always. In
    /// process, a plain receive copies straight out of the lent buffer into
    /// its destination, but a collective's receives that reduce or forward
    /// a frame need a buffer of their own and would copy it there first,
    /// moving the sender's copy onto the receiver's path: point-to-point
    /// calls only (`OXCCL_ALGO=ring` between two threads, lent against
    /// copied: an all-reduce of 32 KiB 4.6–5.8 µs against 3.5–3.7, of
    /// 128 KiB 12.9–16.2 against 8.7–9.4).
    pub fn takes_borrowed(&self, space: Space) -> bool {
        match self {
            Transport::Local(_) => space == Space::PointToPoint,
            Transport::Net(_) => true,
        }
    }

    /// Waits until this rank's queued frames have left (sends queue frames
    /// and write what they can, so a call must not return while its last
    /// frames sit in a queue no one will drain). Returns the peer concerned on failure.
    pub fn flush(&self, timeout: Duration) -> Result<(), (usize, TransportError)> {
        match self {
            // In-process sends land in the peer's mailbox at once.
            Transport::Local(_) => Ok(()),
            Transport::Net(t) => t.flush(timeout),
        }
    }

    /// A collective frame of this communicator, for call `seq` or an
    /// earlier one, that arrived and that no receive took: the ranks ran
    /// different schedules (a broadcast's or reduce's root differs between
    /// them; their roots then only send). When ranks agree, every frame of
    /// a call is received within it, so this is `None` at the end of each;
    /// a frame that arrives later is found at the end of a later call.
    /// Returns the sending communicator rank and the frame's header.
    pub fn unclaimed(&self, seq: u64) -> Option<(usize, FrameHeader)> {
        match self {
            Transport::Local(t) => t.unclaimed(seq),
            Transport::Net(t) => t.unclaimed(seq),
        }
    }

    /// This endpoint's context id.
    pub fn ctx(&self) -> u64 {
        match self {
            Transport::Local(t) => t.ctx(),
            Transport::Net(t) => t.ctx(),
        }
    }

    /// An endpoint for a sub-communicator: `members` are ranks of this one.
    pub fn child(&self, ctx: u64, members: &[usize], rank: usize) -> Transport {
        match self {
            Transport::Local(t) => Transport::Local(t.child(ctx, members, rank)),
            Transport::Net(t) => Transport::Net(t.child(ctx, members)),
        }
    }

    /// Whether every link among this communicator's ranks is TCP (ranks in
    /// one process have none). Every rank answers alike.
    pub fn links_all_tcp(&self) -> bool {
        match self {
            Transport::Local(_) => false,
            Transport::Net(t) => t.links_all_tcp(),
        }
    }

    /// The order of this communicator's ranks around the ring (and along
    /// the chains): each host's ranks together. Rank order between threads
    /// of one process. Every rank answers alike.
    pub fn ring_order(&self) -> &RingOrder {
        static BY_RANK: RingOrder = RingOrder::by_rank();
        match self {
            Transport::Local(_) => &BY_RANK,
            Transport::Net(t) => t.ring_order(),
        }
    }

    /// Whether the communicator's ranks all run on one host, of a machine
    /// where the job's ranks outnumber the CPUs ([`net::NetEndpoint::crowded_host`];
    /// threads: their group's decision, `LocalGroup::outnumbers_cpus`).
    /// The same on every rank: the schedule table reads it
    /// (`schedule::choose_for`).
    pub fn crowded_host(&self) -> bool {
        match self {
            Transport::Local(t) => t.group().outnumbers_cpus(),
            Transport::Net(t) => t.crowded_host(),
        }
    }

    /// Whether this rank's machine (its kernel) runs more ranks of the job
    /// than the CPUs they may run on together, so that waits on the links
    /// yield at once
    /// (see `net::NetShared`). Threads of one process: never (their
    /// arena decides for itself).
    pub fn crowded(&self) -> bool {
        match self {
            Transport::Local(_) => false,
            Transport::Net(t) => t.crowded(),
        }
    }

    /// What carries the traffic, for reports: `in-process`, `shm`, `tcp (...)`.
    pub fn describe(&self) -> String {
        match self {
            Transport::Local(_) => "in-process".into(),
            Transport::Net(t) => t.describe(),
        }
    }

    /// What carries messages to communicator rank `peer` (`None`: this
    /// rank, or no rank of the communicator).
    pub fn link_kind(&self, peer: Rank) -> Option<LinkKind> {
        match self {
            Transport::Local(t) => {
                let (rank, world) = t.rank_and_world();
                (peer < world && peer != rank).then_some(LinkKind::InProcess)
            }
            Transport::Net(t) => t.link_kind(peer),
        }
    }
}

/// What carries a communicator's messages to one peer
/// ([`Communicator::link_to`](crate::Communicator::link_to)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinkKind {
    /// Threads of one process (`local_group`): in-process mailboxes and
    /// the shared arena.
    InProcess,
    /// Processes of one host: shared-memory rings (and the arena).
    SharedMemory,
    /// TCP: between hosts, or on one with `OXCCL_TRANSPORT=tcp`.
    Tcp,
}

impl LinkKind {
    /// `in-process`, `shm` or `tcp`, as `transport_description` names them.
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::InProcess => "in-process",
            LinkKind::SharedMemory => "shm",
            LinkKind::Tcp => "tcp",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn frame_keys_spread_over_a_tables_buckets() {
        // A table indexes its buckets by a hash's low bits: the keys a
        // rank holds at once (one per peer, sequence number and step, in
        // a couple of contexts) must not pile into a few of them, as a
        // hasher that kept only its last word's bits would make them.
        let build = std::hash::BuildHasherDefault::<FrameKeyHasher>::default();
        let mut buckets = std::collections::HashSet::new();
        let mut keys = 0;
        for ctx in [0u64, 0x9e37_79b9_7f4a_7c15] {
            for source in 0..4usize {
                for seq in 0..64u64 {
                    for step in 0..4u32 {
                        let key = (source, ctx, Space::Collective, seq, step);
                        buckets.insert(build.hash_one(key) & 0xffff);
                        keys += 1;
                    }
                }
            }
        }
        // 2048 keys into 65 536 buckets: random placement leaves about 32
        // collisions.
        assert!(
            buckets.len() > keys * 95 / 100,
            "{} buckets for {keys} keys",
            buckets.len()
        );
        let map: FrameMap<(usize, u64), usize> =
            (0..1000).map(|i| ((i % 7, i as u64), i)).collect();
        assert!((0..1000).all(|i| map[&(i % 7, i as u64)] == i));
    }
}
