//! The in-process transport: one mailbox per rank, frames keyed by
//! `(source, ctx, space, seq, step)` so receives match exactly and frames of
//! unrelated calls (a point-to-point send racing a collective) never mix.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{CollectiveArrivals, FrameHeader, Payload, Space, TransportError};

type Key = (usize, u64, Space, u64, u32);

#[derive(Default)]
struct Mailbox {
    frames: Mutex<Frames>,
    arrived: Condvar,
}

/// A mailbox's frames, counted per call ([`CollectiveArrivals`]).
#[derive(Default)]
struct Frames {
    map: HashMap<Key, (FrameHeader, Payload)>,
    collective: CollectiveArrivals,
}

impl Frames {
    fn insert(&mut self, key: Key, frame: (FrameHeader, Payload)) {
        if self.map.insert(key, frame).is_none() {
            self.collective.filed(key.1, key.2, key.3);
        }
    }

    fn remove(&mut self, key: &Key) -> Option<(FrameHeader, Payload)> {
        let frame = self.map.remove(key)?;
        self.collective.taken(key.1, key.2, key.3);
        Some(frame)
    }
}

/// State shared by every communicator of one `local_group` (and its splits).
pub(crate) struct LocalGroup {
    mailboxes: Vec<Mailbox>,
    /// Set by `abort()`; shared with the group's arenas.
    aborted: Arc<AtomicBool>,
    /// `(ctx, global rank)` of endpoints that were dropped.
    departed: Mutex<HashSet<(u64, usize)>>,
    /// `(ctx, global rank)` of endpoints whose communicator failed: they
    /// take part in no further call of it (see
    /// [`LocalEndpoint::mark_failed`]).
    failed: Mutex<HashSet<(u64, usize)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the maps
    // inconsistent (each critical section is a single insert or remove).
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl LocalGroup {
    pub fn new(world: usize) -> Arc<LocalGroup> {
        Arc::new(LocalGroup {
            mailboxes: (0..world).map(|_| Mailbox::default()).collect(),
            aborted: Arc::new(AtomicBool::new(false)),
            departed: Mutex::new(HashSet::new()),
            failed: Mutex::new(HashSet::new()),
        })
    }

    fn wake_all(&self) {
        for mailbox in &self.mailboxes {
            let _guard = lock(&mailbox.frames);
            mailbox.arrived.notify_all();
        }
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
}

impl LocalEndpoint {
    pub fn new(group: Arc<LocalGroup>, ctx: u64, members: Vec<usize>, rank: usize) -> Self {
        LocalEndpoint {
            group,
            ctx,
            members,
            rank,
        }
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
            .and_then(|(k, (header, _))| {
                let member = self.members.iter().position(|&g| g == k.0)?;
                Some((member, *header))
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
    pub fn mark_failed(&self) {
        lock(&self.group.failed).insert((self.ctx, self.members[self.rank]));
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
        lock(&mailbox.frames).insert(key, (header, payload));
        mailbox.arrived.notify_all();
        Ok(())
    }

    pub fn recv(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
    ) -> Result<Payload, TransportError> {
        let source = self.members[peer];
        let key = (source, expect.ctx, expect.space, expect.seq, expect.step);
        let mailbox = &self.group.mailboxes[self.members[self.rank]];
        let start = Instant::now();
        let deadline = start + timeout;
        let mut frames = lock(&mailbox.frames);
        loop {
            if let Some((header, payload)) = frames.remove(&key) {
                return header.check_matches(expect).map(|()| payload);
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
                let me = self.members[self.rank];
                let lost = std::iter::once(peer)
                    .chain(0..self.members.len())
                    .find(|&r| {
                        self.members[r] != me && failed.contains(&(self.ctx, self.members[r]))
                    });
                if let Some(rank) = lost {
                    return Err(TransportError::PeerLost { rank: Some(rank) });
                }
            }
            drop(failed);
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout(now - start));
            }
            frames = mailbox
                .arrived
                .wait_timeout(frames, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
    }
}

impl Drop for LocalEndpoint {
    fn drop(&mut self) {
        lock(&self.group.departed).insert((self.ctx, self.members[self.rank]));
        self.group.wake_all();
    }
}
