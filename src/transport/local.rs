//! The in-process transport: one mailbox per rank, frames keyed by
//! `(source, ctx, space, seq, step)` so receives match exactly and frames of
//! unrelated calls (a point-to-point send racing a collective) never mix.
//!
//! A frame may borrow the sender's buffer ([`Payload::borrowed`], when the
//! executor's `Lending` allows): its receive copies straight out of that
//! buffer (counted in the sending endpoint's `lent_reads` meanwhile), and
//! the sender, before its call returns ([`LocalEndpoint::own_borrowed`]),
//! copies whatever of its lent frames is still waiting and waits for those
//! being read. A message then crosses in one copy when its receive takes it
//! during the sender's call (an exchange, a receive already waiting), in
//! two otherwise, as when every send copied. The receiver copies rather
//! than the sender writing into a posted destination: storing into lines
//! another core holds cost 4–5× (a 128 KiB exchange, near: 33 µs against
//! 7.6 for two copies). Nothing is copied under a mailbox's lock: a lock
//! held that long sends its other takers to sleep in the kernel (a 2 MiB
//! exchange: 180–220 µs against 120–166 for two copies). Only
//! point-to-point calls lend (`Transport::takes_borrowed`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{CollectiveArrivals, FailureCause, FrameHeader, Payload, Space, TransportError};

type Key = (usize, u64, Space, u64, u32);

#[derive(Default)]
struct Mailbox {
    frames: Mutex<Frames>,
    arrived: Condvar,
    /// Frames ever filed here, bumped after each (under the lock): a
    /// receive spins on it without the lock before it sleeps.
    filed: AtomicU64,
}

/// A frame in a mailbox.
struct Filed {
    header: FrameHeader,
    payload: Payload,
    /// For a payload that borrows its sender's buffer: the sending
    /// endpoint's [`lent_reads`](LocalEndpoint::lent_reads).
    lender_reads: Option<Arc<AtomicUsize>>,
}

/// A mailbox's frames, counted per call ([`CollectiveArrivals`]).
#[derive(Default)]
struct Frames {
    map: HashMap<Key, Filed>,
    collective: CollectiveArrivals,
    /// Receives asleep on `arrived`: a send wakes them only if there are
    /// any (a wake is a system call even when nobody sleeps).
    sleepers: usize,
}

impl Frames {
    fn insert(&mut self, key: Key, frame: Filed) {
        if self.map.insert(key, frame).is_none() {
            self.collective.filed(key.1, key.2, key.3);
        }
    }

    fn remove(&mut self, key: &Key) -> Option<Filed> {
        let frame = self.map.remove(key)?;
        self.collective.taken(key.1, key.2, key.3);
        Some(frame)
    }

    /// Drops every frame of context `ctx` (its receiver has gone).
    fn discard_ctx(&mut self, ctx: u64) {
        let keys: Vec<Key> = self.map.keys().filter(|k| k.1 == ctx).copied().collect();
        for key in keys {
            self.remove(&key);
        }
    }
}

/// State shared by every communicator of one `local_group` (and its splits).
pub(crate) struct LocalGroup {
    mailboxes: Vec<Mailbox>,
    /// Set by `abort()`; shared with the group's arenas.
    aborted: Arc<AtomicBool>,
    /// `(ctx, global rank)` of endpoints that were dropped.
    departed: Mutex<HashSet<(u64, usize)>>,
    /// `(ctx, global rank)` of endpoints whose communicator failed, with
    /// the cause they gave (its rank global): they take part in no
    /// further call of it (see [`LocalEndpoint::mark_failed`]).
    failed: Mutex<HashMap<(u64, usize), Option<FailureCause>>>,
    /// [`LocalGroup::outnumbers_cpus`].
    outnumber_cpus: bool,
}

/// How long a receive that also watches another way sleeps at most: at
/// first, doubling up to [`ELSEWHERE_MAX`] while it waits (a rank that
/// waits seconds for a large message then wakes some 30 times a second,
/// not a thousand).
const ELSEWHERE_EVERY: Duration = Duration::from_millis(1);
const ELSEWHERE_MAX: Duration = Duration::from_millis(32);

/// A receive whose frame is not there spins this long (without the lock,
/// on [`Mailbox::filed`]), then yields between looks until
/// [`SLEEP_AFTER`], then sleeps on the mailbox's condition variable: a
/// sleeping receive took 15–29 µs to wake for an 8-byte frame between two
/// threads (condition variable and futex), however small the frame.
const SPIN: Duration = Duration::from_micros(5);
const SLEEP_AFTER: Duration = Duration::from_millis(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the maps
    // inconsistent (each critical section is a single insert or remove).
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl LocalGroup {
    pub fn new(world: usize) -> Arc<LocalGroup> {
        Arc::new(LocalGroup {
            outnumber_cpus: crate::host::cpus::threads_outnumber_cpus(world),
            mailboxes: (0..world).map(|_| Mailbox::default()).collect(),
            aborted: Arc::new(AtomicBool::new(false)),
            departed: Mutex::new(HashSet::new()),
            failed: Mutex::new(HashMap::new()),
        })
    }

    fn wake_all(&self) {
        for mailbox in &self.mailboxes {
            let _guard = lock(&mailbox.frames);
            mailbox.arrived.notify_all();
        }
    }

    /// Whether the group's threads outnumbered this process's CPUs when
    /// it was made (splits share the answer).
    pub fn outnumbers_cpus(&self) -> bool {
        self.outnumber_cpus
    }

    /// The abort flag, for waits outside the mailboxes (the arena).
    pub fn abort_flag(&self) -> Arc<AtomicBool> {
        self.aborted.clone()
    }

    /// Makes every wait of every communicator in the group return `Aborted`.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.wake_all();
    }
}

/// One rank's end of a local communicator.
pub(crate) struct LocalEndpoint {
    group: Arc<LocalGroup>,
    ctx: u64,
    /// Communicator rank → index in the group.
    members: Vec<usize>,
    rank: usize,
    /// Frames this endpoint filed that borrow its caller's buffer: the
    /// receiving mailbox (group index) and the frame's key, until
    /// [`own_borrowed`](Self::own_borrowed) runs.
    lent: Mutex<Vec<(usize, Key)>>,
    /// Receives copying, outside any lock, out of frames this endpoint
    /// lent: counted up under the receiving mailbox's lock as such a frame
    /// leaves it, down once copied (a [`ReadingLent`] guard).
    /// [`own_borrowed`](Self::own_borrowed) waits for none before the
    /// lending call returns. Per endpoint, so a lender never waits on reads
    /// of another communicator's frames.
    lent_reads: Arc<AtomicUsize>,
}

/// A receive copying out of a lent frame, counted in its lender's
/// `lent_reads` until dropped (also when the copy unwinds: a count left
/// behind would hold the lender's every later call).
struct ReadingLent(Arc<AtomicUsize>);

impl ReadingLent {
    /// Counts a read of a frame lent with `reads`: under the lock of the
    /// mailbox the frame leaves, which the lender's `own_borrowed` takes
    /// before it looks at the count, so Relaxed suffices here.
    fn start(reads: Arc<AtomicUsize>) -> ReadingLent {
        reads.fetch_add(1, Ordering::Relaxed);
        ReadingLent(reads)
    }
}

impl Drop for ReadingLent {
    fn drop(&mut self) {
        // Release: the copy happens-before the lender's Acquire load that
        // sees the count fall, and so before it reuses its buffer.
        self.0.fetch_sub(1, Ordering::Release);
    }
}

impl LocalEndpoint {
    pub fn new(group: Arc<LocalGroup>, ctx: u64, members: Vec<usize>, rank: usize) -> Self {
        LocalEndpoint {
            group,
            ctx,
            members,
            rank,
            lent: Mutex::new(Vec::new()),
            lent_reads: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// This endpoint's communicator rank, and how many ranks it has.
    pub fn rank_and_world(&self) -> (usize, usize) {
        (self.rank, self.members.len())
    }

    pub fn group(&self) -> &Arc<LocalGroup> {
        &self.group
    }

    pub fn ctx(&self) -> u64 {
        self.ctx
    }

    /// See [`Transport::unclaimed`](super::Transport::unclaimed).
    pub fn unclaimed(&self, seq: u64) -> Option<(usize, FrameHeader)> {
        let mailbox = &self.group.mailboxes[self.members[self.rank]];
        let frames = lock(&mailbox.frames);
        if !frames.collective.any_up_to(self.ctx, seq) {
            return None;
        }
        frames
            .map
            .iter()
            .find(|(k, _)| k.1 == self.ctx && k.2 == Space::Collective && k.3 <= seq)
            .and_then(|(k, frame)| {
                let member = self.members.iter().position(|&g| g == k.0)?;
                Some((member, frame.header))
            })
    }

    /// An endpoint for a sub-communicator of `members` (ranks of this one).
    pub fn child(&self, ctx: u64, members: &[usize], rank: usize) -> LocalEndpoint {
        let members = members.iter().map(|&r| self.members[r]).collect();
        LocalEndpoint::new(self.group.clone(), ctx, members, rank)
    }

    /// Tells every rank of the group that this rank's communicator failed:
    /// their receives fail at once naming it, wherever in the schedule
    /// they wait (a ring's rank two hops after a lost one waits on a rank
    /// that will not send, not on the lost one), instead of waiting out
    /// their timeout.
    /// `cause` (communicator ranks) is what the others then report.
    pub fn mark_failed(&self, cause: Option<FailureCause>) {
        let cause = cause.and_then(|c| c.map(|r| self.members.get(r).copied()));
        lock(&self.group.failed).insert((self.ctx, self.members[self.rank]), cause);
        self.group.wake_all();
    }

    pub fn send(
        &self,
        peer: usize,
        header: FrameHeader,
        payload: Payload,
    ) -> Result<(), TransportError> {
        if self.group.aborted.load(Ordering::SeqCst) {
            return Err(TransportError::Aborted);
        }
        let key = (
            self.members[self.rank],
            header.ctx,
            header.space,
            header.seq,
            header.step,
        );
        let mailbox = &self.group.mailboxes[self.members[peer]];
        let mut frames = lock(&mailbox.frames);
        // A receiver that has dropped this communicator never takes it: kept,
        // the payload would stay in memory as long as the group.
        if lock(&self.group.departed).contains(&(header.ctx, self.members[peer])) {
            return Ok(());
        }
        let lent = payload.is_borrowed();
        frames.insert(
            key,
            Filed {
                header,
                payload,
                lender_reads: lent.then(|| self.lent_reads.clone()),
            },
        );
        mailbox.filed.fetch_add(1, Ordering::Release);
        let sleepers = frames.sleepers > 0;
        drop(frames);
        if lent {
            // After the mailbox's lock is let go (`own_borrowed` takes the
            // two the other way round); a frame taken meanwhile is one its
            // wait for readers covers.
            lock(&self.lent).push((self.members[peer], key));
        }
        if sleepers {
            mailbox.arrived.notify_all();
        }
        Ok(())
    }

    /// See [`Transport::own_borrowed`](super::Transport::own_borrowed):
    /// each lent frame still waiting in its receiver's mailbox gets a
    /// copy of its own (made outside that mailbox's lock, swapped in under
    /// it), then this waits until no receive copies out of a frame this
    /// endpoint lent.
    pub fn own_borrowed(&self) {
        self.own_borrowed_where(|_| true);
    }

    /// See [`Transport::own_borrowed_within`](super::Transport::own_borrowed_within);
    /// it waits for every receive reading a lent frame, not only those in
    /// `range`. (No call reaches it through `Transport` today: in process
    /// an exchange in place copies its sends, `takes_back_cheaply`.)
    pub fn own_borrowed_within(&self, range: std::ops::Range<usize>) {
        self.own_borrowed_where(|payload| payload.borrowed_within(&range) > 0);
    }

    /// Makes the waiting lent frames whose payload `takes_back` owned, and
    /// forgets them and those already received.
    fn own_borrowed_where(&self, mut takes_back: impl FnMut(&Payload) -> bool) {
        let mut lent = lock(&self.lent);
        if lent.is_empty() {
            return;
        }
        lent.retain(|(mailbox, key)| {
            let frames = &self.group.mailboxes[*mailbox].frames;
            let lent_bytes = match lock(frames).map.get(key) {
                None => return false,
                Some(frame) if !takes_back(&frame.payload) => return true,
                Some(frame) => {
                    let bytes = frame.payload.as_bytes();
                    (bytes.as_ptr(), bytes.len())
                }
            };
            // Copied without the lock, which the receiver may want meanwhile:
            // a copy under it sent the receiver to sleep in the kernel (a
            // trial that lent collectives' sends too: a ring broadcast's
            // root then ran ahead by tens of megabytes, 512 KiB in place
            // taking 190–400 µs against 33–58). The receiver may take the
            // frame meanwhile and read the same bytes: both only read them.
            // SAFETY: the lent bytes are this caller's buffer, valid and
            // unmodified until this call returns (`Payload::borrowed`).
            let own = Payload::from_bytes(unsafe {
                std::slice::from_raw_parts(lent_bytes.0, lent_bytes.1)
            });
            if let Some(frame) = lock(frames).map.get_mut(key) {
                frame.payload = own;
                frame.lender_reads = None;
            }
            false
        });
        // A receive that took a lent frame counted itself under the lock
        // taken above, so it is seen here; it copies for as long as a
        // copy takes, and this yields to it when it is not running.
        let mut looks = 0u32;
        while self.lent_reads.load(Ordering::Acquire) != 0 {
            looks += 1;
            if looks < 1024 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// See [`Transport::has_frame`](super::Transport::has_frame).
    pub fn has_frame(&self, peer: usize, expect: &FrameHeader) -> bool {
        let key = (
            self.members[peer],
            expect.ctx,
            expect.space,
            expect.seq,
            expect.step,
        );
        let mailbox = &self.group.mailboxes[self.members[self.rank]];
        lock(&mailbox.frames).map.contains_key(&key)
    }

    pub fn recv(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
    ) -> Result<Payload, TransportError> {
        let payload = self.receive(peer, expect, timeout, None, None)?;
        Ok(payload.unwrap_or_default())
    }

    /// See [`Transport::recv_into`](super::Transport::recv_into).
    pub fn recv_into(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
        dst: &mut [u8],
        elsewhere: super::Elsewhere<'_>,
    ) -> Result<(), TransportError> {
        self.receive(peer, expect, timeout, elsewhere, Some(dst))
            .map(drop)
    }

    /// Waits for the frame `expect` from `peer`, asking `elsewhere` (if
    /// any) at each wake-up, asleep at most [`ELSEWHERE_EVERY`] at first.
    /// With `into`, copies the frame there and returns `None`; else returns
    /// its payload, owned. A payload that borrows its sender's buffer is
    /// read after the lock is let go, counted in the sending endpoint's
    /// `lent_reads`, for which its [`own_borrowed`](Self::own_borrowed)
    /// waits before the sending call returns.
    fn receive(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
        mut elsewhere: super::Elsewhere<'_>,
        into: Option<&mut [u8]>,
    ) -> Result<Option<Payload>, TransportError> {
        let source = self.members[peer];
        let key = (source, expect.ctx, expect.space, expect.seq, expect.step);
        let mailbox = &self.group.mailboxes[self.members[self.rank]];
        let start = Instant::now();
        let deadline = start + timeout;
        let mut frames = lock(&mailbox.frames);
        let mut elsewhere_nap = ELSEWHERE_EVERY;
        loop {
            if let Some(frame) = frames.remove(&key) {
                frame.header.check_matches(expect)?;
                let mut payload = frame.payload;
                // Counted before the lock is let go: the lender's
                // `own_borrowed` then waits for this copy.
                let reading = frame.lender_reads.map(ReadingLent::start);
                drop(frames);
                let received = match into {
                    Some(dst) => {
                        dst.copy_from_slice(payload.as_bytes());
                        None
                    }
                    None => {
                        payload.make_owned();
                        Some(payload)
                    }
                };
                drop(reading);
                return Ok(received);
            }
            if self.group.aborted.load(Ordering::SeqCst) {
                return Err(TransportError::Aborted);
            }
            if lock(&self.group.departed).contains(&(self.ctx, source)) {
                return Err(TransportError::PeerLost { rank: None });
            }
            let failed = lock(&self.group.failed);
            if !failed.is_empty() {
                // The awaited peer first: it is the one that will not send.
                // A collective's receive also fails with any other rank (a
                // ring's rank two hops after a lost one waits on a rank
                // that will not send either); a point-to-point one only
                // with its peer, as over the processes' links.
                let me = self.members[self.rank];
                let others = match expect.space {
                    Space::PointToPoint => 0..0,
                    _ => 0..self.members.len(),
                };
                let lost = std::iter::once(peer).chain(others).find_map(|r| {
                    let cause = failed.get(&(self.ctx, self.members[r]))?;
                    (self.members[r] != me).then_some((r, *cause))
                });
                if let Some((rank, cause)) = lost {
                    // Named by its cause where it gave one (global ranks
                    // back to this communicator's).
                    let member = |g: usize| self.members.iter().position(|&m| m == g);
                    return Err(cause
                        .and_then(|c| c.map(member))
                        .map_or(TransportError::PeerLost { rank: Some(rank) }, |c| {
                            c.error_for(rank, self.rank)
                        }));
                }
            }
            drop(failed);
            if elsewhere.as_mut().is_some_and(|came| came()) {
                return Err(super::came_elsewhere());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout(now - start));
            }
            if now < start + SLEEP_AFTER {
                // Spin (then yield) until a frame is filed here: read under
                // the lock, after the look above, so none filed since is
                // missed.
                let seen = mailbox.filed.load(Ordering::Acquire);
                drop(frames);
                let spin_until = now + SPIN;
                'look: while mailbox.filed.load(Ordering::Acquire) == seen {
                    for _ in 0..64 {
                        std::hint::spin_loop();
                        if mailbox.filed.load(Ordering::Acquire) != seen {
                            break 'look;
                        }
                    }
                    let now = Instant::now();
                    if now >= (start + SLEEP_AFTER).min(deadline)
                        || self.group.aborted.load(Ordering::Relaxed)
                    {
                        break;
                    }
                    if now >= spin_until {
                        std::thread::yield_now();
                    }
                }
                frames = lock(&mailbox.frames);
                continue;
            }
            let nap = if elsewhere.is_some() {
                let nap = elsewhere_nap.min(deadline - now);
                elsewhere_nap = (elsewhere_nap * 2).min(ELSEWHERE_MAX);
                nap
            } else {
                deadline - now
            };
            frames.sleepers += 1;
            frames = mailbox
                .arrived
                .wait_timeout(frames, nap)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
            frames.sleepers -= 1;
        }
    }
}

impl Drop for LocalEndpoint {
    fn drop(&mut self) {
        let me = self.members[self.rank];
        // Under the mailbox's lock, so that a send either lands before the
        // purge or sees the departure (it checks under the same lock).
        let mut frames = lock(&self.group.mailboxes[me].frames);
        lock(&self.group.departed).insert((self.ctx, me));
        frames.discard_ctx(self.ctx);
        drop(frames);
        self.group.wake_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::OpKind;

    fn frame(ctx: u64, seq: u64) -> FrameHeader {
        FrameHeader {
            ctx,
            space: Space::PointToPoint,
            seq,
            step: 0,
            op: OpKind::Send,
            bytes: 4096,
            call: 1,
        }
    }

    /// Frames for a receiver that dropped its communicator are not kept
    /// for the group's lifetime: those waiting are dropped with it, later
    /// ones are not stored; other contexts' frames stay.
    #[test]
    fn frames_for_a_departed_receiver_are_not_kept() {
        let group = LocalGroup::new(2);
        let sender = LocalEndpoint::new(group.clone(), 7, vec![0, 1], 0);
        let receiver = LocalEndpoint::new(group.clone(), 7, vec![0, 1], 1);
        let other = LocalEndpoint::new(group.clone(), 8, vec![0, 1], 0);
        sender.send(1, frame(7, 0), Payload::zeroed(4096)).unwrap();
        other.send(1, frame(8, 0), Payload::zeroed(4096)).unwrap();
        let held = || lock(&group.mailboxes[1].frames).map.len();
        assert_eq!(held(), 2);
        drop(receiver);
        assert_eq!(held(), 1, "the departed context's frame is dropped");
        sender.send(1, frame(7, 1), Payload::zeroed(4096)).unwrap();
        assert_eq!(held(), 1, "and later ones are not stored");
    }

    /// Frames lent from one buffer: a take-back of a range copies only the
    /// frames borrowing it; `own_borrowed` copies the rest; the receiver
    /// then gets what was sent whatever the buffer holds by then, and the
    /// lender forgets every frame it took back or that was received.
    #[test]
    fn lent_frames_are_taken_back_by_range_and_whole() {
        let group = LocalGroup::new(2);
        let sender = LocalEndpoint::new(group.clone(), 7, vec![0, 1], 0);
        let receiver = LocalEndpoint::new(group.clone(), 7, vec![0, 1], 1);
        let borrowed = |seq: u64| {
            let frames = lock(&group.mailboxes[1].frames);
            frames.map[&(0, 7, Space::PointToPoint, seq, 0)]
                .payload
                .is_borrowed()
        };
        let mut buf: Vec<u8> = (0..8192).map(|i| i as u8).collect();
        let sent = buf.clone();
        let (low, high) = buf.split_at(4096);
        // SAFETY: `buf` is neither written nor dropped until the lender
        // took back every frame (`own_borrowed`, below).
        sender
            .send(1, frame(7, 0), unsafe { Payload::borrowed(low) })
            .unwrap();
        sender
            .send(1, frame(7, 1), unsafe { Payload::borrowed(high) })
            .unwrap();
        sender
            .send(1, frame(7, 2), unsafe { Payload::borrowed(low) })
            .unwrap();
        assert!(borrowed(0) && borrowed(1) && borrowed(2));
        let at = high.as_ptr() as usize;
        sender.own_borrowed_within(at..at + 1);
        assert!(
            borrowed(0) && !borrowed(1) && borrowed(2),
            "only the high half"
        );
        assert_eq!(lock(&sender.lent).len(), 2);
        let mut got = vec![0u8; 4096];
        let wait = Duration::from_secs(5);
        receiver
            .recv_into(0, &frame(7, 0), wait, &mut got, None)
            .unwrap();
        assert_eq!(got, sent[..4096]);
        sender.own_borrowed();
        assert!(!borrowed(2), "the waiting one is copied");
        assert!(
            lock(&sender.lent).is_empty(),
            "and the received one forgotten"
        );
        buf.fill(0xee);
        receiver
            .recv_into(0, &frame(7, 1), wait, &mut got, None)
            .unwrap();
        assert_eq!(got, sent[4096..]);
        let payload = receiver.recv(0, &frame(7, 2), wait).unwrap();
        assert_eq!(payload.as_bytes(), &sent[..4096]);
    }
}
