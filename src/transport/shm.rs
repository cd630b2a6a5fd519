//! Shared-memory links between ranks on the same host.
//!
//! Every rank that has local peers owns one segment, its *inbox*: a header
//! and one single-producer single-consumer byte ring per local peer. Peer `s`
//! writes into ring `slot(s)` of rank `r`'s segment; only `r` reads it. A
//! ring is a byte stream (frames are laid on it by [`super::net`]), so a
//! frame larger than the ring simply streams through it.
//!
//! # Lifetime (nothing is left in `/dev/shm`)
//!
//! A segment is created with `O_EXCL`, sized with `posix_fallocate` (so a
//! full `/dev/shm` is an error at set-up, not a `SIGBUS` later), mapped, and
//! announced through the store. Once every local peer has mapped it, its
//! owner unlinks the name: the memory lives on while mapped and vanishes when
//! the last process that maps it exits, however it exits. A set-up that fails
//! part way unlinks in `Drop`; `oxccl-run` also removes `oxccl-<job>-*`
//! names after its ranks exit, for ranks killed inside that window.
//!
//! # Ring protocol
//!
//! `head` and `tail` are byte counters that only grow (wrapping at 2^64,
//! never reached). The producer writes bytes at `tail % cap`, then publishes
//! them with a release store of `tail`; the consumer reads up to `tail`
//! (acquire) and releases space with a release store of `head`. Each counter
//! has one writer and sits on its own cache line.
//!
//! Beside each counter, on the second line of its pair, the same side
//! publishes what the other needs to choose how large writes store
//! ([`StoreChoice`]): after `tail`, the writer's log of where its writes
//! changed between cached and streaming stores ([`WayLog`]); after
//! `head`, the reader's speeds reading each ([`ReadTimings`]).

use crate::host::stream::{copy_cached, copy_streaming_unfenced, fence};
use std::ffi::CString;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

/// Written at the start of every segment; a mapping without it is not ours.
const SEGMENT_MAGIC: u64 = 0x6f78_6363_6c73_686d; // "oxcclshm"
/// Owner states in the segment header.
pub(crate) const STATE_ALIVE: u64 = 1;
pub(crate) const STATE_DEPARTED: u64 = 2;

const LINE: usize = 128; // two cache lines: no false sharing with prefetch pairs
const HEADER_BYTES: usize = 4096;

/// The segment header, at offset 0.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    owner_pid: AtomicU64,
    state: AtomicU64,
    slots: AtomicU64,
    ring_bytes: AtomicU64,
    /// The owner's start time ([`ProcessStamp::start`]).
    owner_start: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// Where a ring's control words and data live within the segment.
fn ring_offset(slot: usize, ring_bytes: usize) -> usize {
    HEADER_BYTES + slot * (2 * LINE + ring_bytes)
}

fn segment_bytes(slots: usize, ring_bytes: usize) -> usize {
    ring_offset(slots, ring_bytes)
}

/// Whether rings of `ring_bytes` can lay out `slots` of them: a power of
/// two, and at least 8 bytes when there are any, so that every ring's
/// counters (`AtomicU64`) after the first stay 8-byte aligned.
fn ring_size_valid(slots: usize, ring_bytes: usize) -> bool {
    ring_bytes.is_power_of_two() && (slots == 0 || ring_bytes >= 8)
}

/// [`segment_bytes`] for sizes read from a header another process wrote:
/// `None` where it overflows (the product would wrap in a release build
/// and pass the size check with rings beyond the mapping).
fn segment_bytes_checked(slots: usize, ring_bytes: usize) -> Option<usize> {
    ring_bytes
        .checked_add(2 * LINE)?
        .checked_mul(slots)?
        .checked_add(HEADER_BYTES)
}

/// Keeps a job id usable in a segment name: the one mapping from
/// `OXCCL_JOB_ID` to names, shared with `oxccl-run`'s clean-up.
pub(crate) fn sanitize_job_id(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect()
}

/// The name of rank `rank`'s segment (POSIX shm names start with one `/`).
/// `oxccl-run` removes leftovers by the `oxccl-<job>-` prefix.
pub(crate) fn segment_name(job: &str, nonce: &str, rank: usize) -> String {
    format!("/oxccl-{job}-{nonce}-{rank}")
}

/// A mapped segment. The creator unlinks the name in `Drop` if it has not
/// done so already; every holder unmaps.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    slots: usize,
    ring_bytes: usize,
    /// `Some(name)` while this process still has to unlink the name.
    unlink_on_drop: Option<CString>,
    /// Set once [`unlink_now`](Segment::unlink_now) removed the name
    /// through a shared handle: the drop must not remove it again (by then
    /// the name could be another segment's).
    unlinked: std::sync::atomic::AtomicBool,
    /// The name it was created or opened under.
    name: String,
}

// SAFETY: the mapping is plain shared memory; all access to it goes through
// atomics (control words) or through the ring protocol, which gives each byte
// range a single writer at a time. Moving the handle between threads is fine.
unsafe impl Send for Segment {}

fn os_error(what: &str, name: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what} {name}: {e}"))
}

/// `posix_fallocate(fd, 0, len)` with this thread's signals blocked. A
/// signal arriving while tmpfs reserves pages interrupts it with EINTR
/// (not restarted by SA_RESTART) and the kernel gives back every page that
/// call reserved: under a signal that comes more often than a reservation
/// takes (a profiler's timer, a runtime's preemption signal) retrying
/// never finished (PostgreSQL blocks signals around the same call for the
/// same reason). Recent kernels abort only on fatal signals (this
/// machine's 6.18 did not return EINTR once for a 1 GiB reservation under
/// a signal every 100 µs, so no test here can show it); the older ones
/// PostgreSQL met abort on any. Blocked signals stay pending and are
/// delivered when the mask is restored; SIGKILL and SIGSTOP cannot be
/// blocked.
fn fallocate_without_signals(fd: libc::c_int, len: usize) -> libc::c_int {
    // SAFETY: sigset_t is plain data; sigfillset/pthread_sigmask write the
    // sets given and change only this thread's mask, restored below.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut before: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        let masked = libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut before) == 0;
        let rc = loop {
            // posix_fallocate returns an errno value. EINTR can still come
            // when the mask could not be set: retry, as before.
            let rc = libc::posix_fallocate(fd, 0, len as libc::off_t);
            if rc != libc::EINTR {
                break rc;
            }
        };
        if masked {
            libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
        }
        rc
    }
}

impl Segment {
    /// Creates, sizes and maps a new segment with `slots` rings of
    /// `ring_bytes` each (`ring_bytes` a power of two).
    pub fn create(name: &str, slots: usize, ring_bytes: usize) -> io::Result<Segment> {
        Segment::create_with_region(name, slots, ring_bytes, 0)
    }

    /// As [`create`](Self::create), followed by `region_bytes` of zeroed
    /// memory for the owner's own layout (see [`region`](Self::region)).
    pub fn create_with_region(
        name: &str,
        slots: usize,
        ring_bytes: usize,
        region_bytes: usize,
    ) -> io::Result<Segment> {
        if !ring_size_valid(slots, ring_bytes) {
            return Err(io::Error::other(format!(
                "{name}: rings of {ring_bytes} bytes (must be a power of two, at least 8)"
            )));
        }
        let cname = CString::new(name).map_err(|_| io::Error::other("bad segment name"))?;
        let len = segment_bytes_checked(slots, ring_bytes)
            .and_then(|bytes| bytes.checked_add(region_bytes))
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(|| {
                io::Error::other(format!(
                    "{name}: {slots} rings of {ring_bytes} bytes and {region_bytes} more \
                     bytes are too large"
                ))
            })?;
        // SAFETY: plain FFI calls with a valid C string; the fd is closed below.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_error("shm_open", name));
        }
        // From here on, failure must unlink the name.
        let unlink = |e: io::Error| {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(cname.as_ptr()) };
            e
        };
        // SAFETY: fd is a valid descriptor we own.
        let rc = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        if rc != 0 {
            let e = os_error("ftruncate", name);
            unsafe { libc::close(fd) };
            return Err(unlink(e));
        }
        // Reserve the pages now: on a tmpfs too small for the segment this
        // fails with ENOSPC here instead of raising SIGBUS on first touch.
        let rc = fallocate_without_signals(fd, len);
        if rc != 0 {
            let e = io::Error::from_raw_os_error(rc);
            unsafe { libc::close(fd) };
            let advice = if rc == libc::ENOSPC {
                " (is /dev/shm too small? containers often default to 64 MiB: enlarge it, \
                 e.g. docker --shm-size, lower OXCCL_SHM_RING_BYTES, or use \
                 OXCCL_TRANSPORT=tcp)"
            } else {
                ""
            };
            return Err(unlink(io::Error::new(
                e.kind(),
                format!("cannot reserve {len} bytes for {name} in /dev/shm: {e}{advice}"),
            )));
        }
        let base = map(fd, len, name).map_err(unlink)?;
        let segment = Segment {
            base,
            len,
            slots,
            ring_bytes,
            unlink_on_drop: Some(cname),
            unlinked: false.into(),
            name: name.to_string(),
        };
        let header = segment.header();
        let me = ProcessStamp::own();
        header.owner_pid.store(me.pid.into(), Ordering::Relaxed);
        header.owner_start.store(me.start, Ordering::Relaxed);
        header.slots.store(slots as u64, Ordering::Relaxed);
        header
            .ring_bytes
            .store(ring_bytes as u64, Ordering::Relaxed);
        header.state.store(STATE_ALIVE, Ordering::Relaxed);
        header.magic.store(SEGMENT_MAGIC, Ordering::Release);
        Ok(segment)
    }

    /// Maps a peer's existing segment and checks its header.
    pub fn open(name: &str) -> io::Result<Segment> {
        let cname = CString::new(name).map_err(|_| io::Error::other("bad segment name"))?;
        // SAFETY: FFI with a valid C string.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(os_error("shm_open", name));
        }
        // SAFETY: zeroed stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            let e = os_error("fstat", name);
            unsafe { libc::close(fd) };
            return Err(e);
        }
        let len = st.st_size as usize;
        if len < HEADER_BYTES {
            unsafe { libc::close(fd) };
            return Err(io::Error::other(format!(
                "{name} is {len} bytes, too small"
            )));
        }
        let base = map(fd, len, name)?;
        let mut segment = Segment {
            base,
            len,
            slots: 0,
            ring_bytes: 0,
            unlink_on_drop: None,
            unlinked: false.into(),
            name: name.to_string(),
        };
        let header = segment.header();
        // The magic first (Acquire): the sizes read after it are the ones
        // its creator stored before publishing it.
        let magic = header.magic.load(Ordering::Acquire);
        let (slots, ring_bytes) = (
            header.slots.load(Ordering::Relaxed) as usize,
            header.ring_bytes.load(Ordering::Relaxed) as usize,
        );
        if magic != SEGMENT_MAGIC
            || !ring_size_valid(slots, ring_bytes)
            || segment_bytes_checked(slots, ring_bytes).is_none_or(|bytes| bytes > len)
        {
            return Err(io::Error::other(format!(
                "{name} is not an oxccl segment (bad header)"
            )));
        }
        segment.slots = slots;
        segment.ring_bytes = ring_bytes;
        Ok(segment)
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_BYTES long and page aligned.
        unsafe { &*(self.base as *const Header) }
    }

    /// The memory after the rings: `(start, bytes)`, page aligned when the
    /// ring size is a multiple of the page size.
    pub fn region(&self) -> (*mut u8, usize) {
        let offset = segment_bytes(self.slots, self.ring_bytes);
        // SAFETY: open/create checked that the rings fit in the mapping.
        (unsafe { self.base.add(offset) }, self.len - offset)
    }

    /// The name it was created or opened under (possibly unlinked since).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Removes the name now, through a shared handle (the mapping stays
    /// valid; a later `unlink` or drop does not remove the name again).
    pub fn unlink_now(&self) {
        if self.unlinked.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Ok(name) = CString::new(self.name.as_str()) {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(name.as_ptr()) };
        }
    }

    /// Removes the name now (the mapping stays valid).
    pub fn unlink(&mut self) {
        let name = self.unlink_on_drop.take();
        if let Some(name) = name.filter(|_| !self.unlinked.swap(true, Ordering::AcqRel)) {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(name.as_ptr()) };
        }
    }

    /// Marks the owner as gone, so peers stop waiting for it at once.
    pub fn set_departed(&self) {
        self.header().state.store(STATE_DEPARTED, Ordering::Release);
    }

    /// Whether the owner has left (dropped its communicator).
    pub fn departed(&self) -> bool {
        self.header().state.load(Ordering::Acquire) == STATE_DEPARTED
    }

    /// The owner's process, for liveness checks.
    pub fn owner(&self) -> ProcessStamp {
        let header = self.header();
        ProcessStamp {
            pid: header.owner_pid.load(Ordering::Relaxed) as u32,
            start: header.owner_start.load(Ordering::Relaxed),
        }
    }

    /// The ring in `slot`, or `None` if the segment has no such slot.
    fn ring(&self, slot: usize) -> Option<RingPtr> {
        if slot >= self.slots {
            return None;
        }
        let offset = ring_offset(slot, self.ring_bytes);
        // SAFETY: slot < slots, so the ring lies within the mapping.
        unsafe {
            Some(RingPtr {
                head: self.base.add(offset) as *const AtomicU64,
                tail: self.base.add(offset + LINE) as *const AtomicU64,
                read_speeds: self.base.add(offset + LINE / 2) as *const AtomicU64,
                ways: self.base.add(offset + LINE + LINE / 2) as *const AtomicU64,
                data: self.base.add(offset + 2 * LINE),
                cap: self.ring_bytes,
            })
        }
    }
}

fn map(fd: libc::c_int, len: usize, name: &str) -> io::Result<*mut u8> {
    // SAFETY: fd is valid and len > 0; the result is checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    // The mapping keeps the memory alive; the descriptor is no longer needed.
    unsafe { libc::close(fd) };
    if base == libc::MAP_FAILED {
        return Err(os_error("mmap", name));
    }
    Ok(base as *mut u8)
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: base/len are the mapping made in create/open.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// The error for ring counters further apart than the ring holds.
fn corrupt_counters(head: u64, tail: u64, cap: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "shared-memory ring counters are corrupt (head {head}, tail {tail}, ring of {cap} \
             bytes): something other than this job's protocol wrote them"
        ),
    )
}

/// Raw pointers to one ring inside a segment; valid while the segment is.
#[derive(Clone, Copy)]
struct RingPtr {
    head: *const AtomicU64,
    tail: *const AtomicU64,
    /// The reader's speeds (`f64` bits, bytes per ns), cached then
    /// streamed: [`READ_SPEEDS`] words on the head's second line.
    read_speeds: *const AtomicU64,
    /// The writer's [`WayLog`]: a count, then [`WAY_LOG_LEN`] entries, on
    /// the tail's second line.
    ways: *const AtomicU64,
    data: *mut u8,
    cap: usize,
}

/// Words of [`RingPtr::read_speeds`]: one per way.
const READ_SPEEDS: usize = 2;
/// Entries of the writer's way log. Streaming, each frame makes two
/// changes (its header cached, its payload streamed), so the log places
/// the last three frames' payloads: a reader keeping up reads them; one
/// further behind skips its timing.
const WAY_LOG_LEN: usize = 6;
const _: () = assert!(READ_SPEEDS * 8 <= LINE / 2 && (1 + WAY_LOG_LEN) * 8 <= LINE / 2);

/// The writer's log of the ring positions where its writes changed way
/// (small writes are cached): entry `k` (in slot `k % WAY_LOG_LEN`) is
/// `position << 1 | streamed` of the `k`-th change, the first write
/// counting as one; the count is published (release) after its entry and
/// before the write's `tail`. Only an adapting writer logs.
struct WayLog;

impl WayLog {
    /// Logs that the write at `position` stores `streamed`, if that changes
    /// the way (`last`: this writer's last logged way).
    ///
    /// # Safety
    /// `ways` must be a ring's log, written by this side alone.
    unsafe fn note(ways: *const AtomicU64, last: &mut Option<bool>, position: u64, streamed: bool) {
        if *last == Some(streamed) {
            return;
        }
        *last = Some(streamed);
        // SAFETY: the log's words (the caller's contract).
        let count = unsafe { &*ways };
        let k = count.load(Ordering::Relaxed);
        let slot = unsafe { &*ways.add(1 + (k as usize) % WAY_LOG_LEN) };
        // Release: a reader whose entry load sees this one, after its
        // fence, sees the count past it (`way_of`'s re-check).
        slot.store(position << 1 | u64::from(streamed), Ordering::Release);
        // Wrapping: the count lies in memory the peer can write.
        count.store(k.wrapping_add(1), Ordering::Release);
    }

    /// How the bytes at positions `from..to` were stored, when the log
    /// tells: `Some(true)` streamed. `None` when they straddle a change, or
    /// lie before the first logged write or the oldest change kept, or the
    /// log moved while it was read.
    ///
    /// # Safety
    /// `ways` must be a ring's log; `to` at most the `tail` this side read.
    unsafe fn way_of(ways: *const AtomicU64, from: u64, to: u64) -> Option<bool> {
        // SAFETY: the log's words (the caller's contract).
        let count = unsafe { &*ways };
        let k = count.load(Ordering::Acquire);
        let kept = usize::try_from(k).unwrap_or(usize::MAX).min(WAY_LOG_LEN);
        let mut entries = [0u64; WAY_LOG_LEN];
        for (i, entry) in entries.iter_mut().enumerate().take(kept) {
            let change = k as usize - kept + i;
            *entry = unsafe { &*ways.add(1 + change % WAY_LOG_LEN) }.load(Ordering::Relaxed);
        }
        // An entry overwritten meanwhile (its change at or past `to`) may
        // have replaced the one that places `from`: a count moved since
        // says so. An entry stored but not yet counted lies at or past
        // `to` too and only makes `way_at` refuse.
        std::sync::atomic::fence(Ordering::Acquire);
        if count.load(Ordering::Relaxed) != k {
            return None;
        }
        way_at(&entries[..kept], from, to)
    }
}

/// [`WayLog::way_of`] over a snapshot of its entries, oldest first.
fn way_at(entries: &[u64], from: u64, to: u64) -> Option<bool> {
    let at = entries.iter().rposition(|&e| e >> 1 <= from)?;
    if entries[at + 1..].iter().any(|&e| e >> 1 < to) {
        return None;
    }
    Some(entries[at] & 1 == 1)
}

/// The reader's side of [`StoreChoice`]: it times its copies out of large
/// writes whose way the [`WayLog`] tells, and publishes a running average
/// per way for the writer, whose own timings do not see what its stores
/// cost the reader. Near, cached writes into the ring timed 15–27 GB/s
/// and streamed ones 17, but the reader then read 27–34 against 13 (from
/// memory), and the cached link was the faster (a 32 KiB exchange 3.8–4.7
/// against 5.7–7.3 µs); far, cached writes time 2.1–2.4 GB/s.
#[derive(Default)]
struct ReadTimings {
    /// Bytes per ns, cached then streamed; 0: not yet timed.
    speed: [f64; READ_SPEEDS],
}

impl ReadTimings {
    /// Records a read of `bytes` in `ns` of data stored `streamed` and
    /// publishes the way's new figure.
    ///
    /// # Safety
    /// `published` must be a ring's read speeds, written by this side alone.
    unsafe fn record(
        &mut self,
        published: *const AtomicU64,
        streamed: bool,
        bytes: usize,
        ns: u64,
    ) {
        let sample = bytes as f64 / ns.max(1) as f64;
        let figure = &mut self.speed[usize::from(streamed)];
        *figure = if *figure == 0.0 {
            sample
        } else {
            0.5 * (*figure + sample)
        };
        // SAFETY: the caller's contract.
        unsafe { &*published.add(usize::from(streamed)) }
            .store(figure.to_bits(), Ordering::Relaxed);
    }
}

/// How a link stores what it writes into its peer's ring, for writes of
/// at least [`CHOSEN_WRITE_MIN_BYTES`] (smaller ones are always cached):
/// from [`crate::ShmStores`], `auto` adapting ([`StoreChoice`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkStores {
    Cached,
    Streaming,
    Adaptive,
}

/// Writes into a ring of at least this many bytes may use non-temporal
/// stores, and are the ones [`StoreChoice`] times: a timing of a smaller
/// copy is mostly the clock's, and small frames (latency) keep their lines
/// in the cache.
const CHOSEN_WRITE_MIN_BYTES: usize = 32 * 1024;
/// After this many chosen writes one goes the other way, timed, so a move
/// of the cores is noticed; the spacing doubles, up to [`EXPLORE_MAX`],
/// while such writes find nothing to change, and starts again here after
/// a switch. An exploration costs: far, a 256 KiB cached write takes
/// about 130 µs against 15 streamed, so at a fixed 32 (8 MiB) it made a
/// 1 MiB exchange about 1.5× slower than forced streaming (136–161
/// against 90–100 µs).
const EXPLORE_MIN: u32 = 32;
/// Writes the other way per exploration, the last one timed: the first
/// write after a change of way times unlike the way's steady writes (near,
/// a cached 32 KiB write after streamed ones 2–8 GB/s against 15–27 in a
/// run of cached ones).
const EXPLORE_WRITES: u32 = 2;
/// The widest spacing of explorations: at 256 KiB per write, 64 MiB (a
/// few milliseconds of writing) before a move back to a shared cache is
/// noticed. (A move away from it shows in the current way's own timings.)
const EXPLORE_MAX: u32 = 256;
/// One chosen write in this many is timed in the current way.
const TIME_EVERY: u32 = 4;
/// Streaming is taken when it writes at least this many times as fast as
/// cached stores, and cached stores again once they write at least
/// [`CACHED_AGAIN`] as fast as streaming. The writer's timing does not see
/// the reader's cost, and that favours cached stores: where the cores share
/// a cache the reader takes cached lines from it and streamed ones from
/// memory (near, 32–42 against 11–18 GB/s on the VM below). Where the
/// writer reads its source from memory too (a 16 MiB exchange), cached and
/// streaming writes run alike near (12–18 and 11–17 GB/s), so an even
/// timing must keep cached stores; far they differ eightfold.
const STREAMING_GAIN: f64 = 2.0;
const CACHED_AGAIN: f64 = 0.8;

/// With the reader's cost counted ([`ReadTimings`]): streaming is taken
/// when a byte goes through (written, then read) this many times as fast,
/// and cached stores again once they go through at least as fast.
const THROUGH_STREAMING_GAIN: f64 = 1.25;
const THROUGH_CACHED_AGAIN: f64 = 1.0;

/// Which stores a link's large writes use, when adapting. The ring's lines
/// were last read by the peer: where the two cores share a cache, ordinary
/// stores take them back through it; where they do not (two dies, or a VM's
/// virtual CPUs on such cores), every line is taken back across the dies
/// one at a time, and non-temporal stores, which write around the caches,
/// are several times faster. So is the writer's own copy: on the VM of
/// `docs/performance.md`, cached writes into the ring ran 28–36 GB/s near
/// and 2 GB/s in the far placement, non-temporal ones 16–20 and 17; a 1 MiB
/// exchange took 58 µs cached against 130–185 non-temporal near, 440–510
/// against 90–100 far. Each writer decides for itself: the reader reads
/// whatever landed. It times one chosen write in [`TIME_EVERY`] (a running
/// average, bytes per ns) and, now and then ([`EXPLORE_MIN`]), writes
/// [`EXPLORE_WRITES`] the other way (the last one's timing is that way's
/// figure). It switches by the bytes through the ring, its time and its
/// reader's ([`ReadTimings`]) per byte added, at
/// [`THROUGH_STREAMING_GAIN`] and [`THROUGH_CACHED_AGAIN`], once the reader
/// has timed both ways; until then by its own speeds, at
/// [`STREAMING_GAIN`] and [`CACHED_AGAIN`].
#[derive(Debug)]
struct StoreChoice {
    policy: LinkStores,
    streaming: bool,
    /// Chosen writes since the last exploration.
    writes: u32,
    /// Writes the other way still to come in the exploration under way.
    exploring: u32,
    /// The reader's speeds (bytes per ns, cached then streamed) as it last
    /// published them; 0: not yet.
    reader: [f64; READ_SPEEDS],
    /// The way this writer last logged ([`WayLog`]).
    logged: Option<bool>,
    /// Chosen writes between explorations now.
    explore_every: u32,
    /// Bytes per ns of each way (`[cached, streaming]`); 0: not yet timed.
    speed: [f64; 2],
}

impl StoreChoice {
    fn new(policy: LinkStores) -> StoreChoice {
        StoreChoice {
            policy,
            streaming: policy == LinkStores::Streaming,
            writes: 0,
            exploring: 0,
            reader: [0.0; READ_SPEEDS],
            logged: None,
            explore_every: EXPLORE_MIN,
            speed: [0.0; 2],
        }
    }

    /// How the next chosen write stores (`true`: non-temporal), and
    /// whether it is timed.
    fn next(&mut self) -> (bool, bool) {
        if self.policy != LinkStores::Adaptive {
            return (self.streaming, false);
        }
        if self.exploring > 0 {
            self.exploring -= 1;
            return (!self.streaming, self.exploring == 0);
        }
        self.writes += 1;
        if self.writes >= self.explore_every {
            self.writes = 0;
            self.exploring = EXPLORE_WRITES - 1;
            (!self.streaming, self.exploring == 0)
        } else {
            (self.streaming, self.writes.is_multiple_of(TIME_EVERY))
        }
    }

    /// The speeds to compare, cached then streamed, with the thresholds
    /// for them: through the ring (the writer's and the reader's time per
    /// byte added) once the reader has timed both ways, else the writer's
    /// alone, which must then favour cached stores (the reader's cost,
    /// unseen, favours them near).
    fn through(&self) -> (f64, f64, f64, f64) {
        let [cached, streamed] = self.speed;
        let [read_cached, read_streamed] = self.reader;
        if cached > 0.0 && streamed > 0.0 && read_cached > 0.0 && read_streamed > 0.0 {
            let through = |write: f64, read: f64| 1.0 / (1.0 / write + 1.0 / read);
            (
                through(cached, read_cached),
                through(streamed, read_streamed),
                THROUGH_STREAMING_GAIN,
                THROUGH_CACHED_AGAIN,
            )
        } else {
            (cached, streamed, STREAMING_GAIN, CACHED_AGAIN)
        }
    }

    /// Takes the reader's published speeds (see [`ReadTimings`]).
    ///
    /// # Safety
    /// `published` must be a ring's read speeds.
    unsafe fn reader_published(&mut self, published: *const AtomicU64) {
        for (way, figure) in self.reader.iter_mut().enumerate() {
            // SAFETY: the caller's contract.
            let bits = unsafe { &*published.add(way) }.load(Ordering::Relaxed);
            let speed = f64::from_bits(bits);
            // Memory the peer writes: only a plausible figure counts.
            *figure = if speed.is_finite() && speed > 0.0 {
                speed
            } else {
                0.0
            };
        }
    }

    /// A timed write of `bytes` in `ns`, the way `streaming` says.
    fn timed(&mut self, streaming: bool, bytes: usize, ns: u64) {
        let sample = bytes as f64 / ns.max(1) as f64;
        let explored = streaming != self.streaming;
        let figure = &mut self.speed[usize::from(streaming)];
        *figure = if explored || *figure == 0.0 {
            sample
        } else {
            0.5 * (*figure + sample)
        };
        let was = self.streaming;
        let (cached, streamed, gain, again) = self.through();
        if cached > 0.0 && streamed > 0.0 {
            if !self.streaming && streamed >= cached * gain {
                self.streaming = true;
            } else if self.streaming && cached >= streamed * again {
                self.streaming = false;
            }
        }
        if self.streaming != was {
            self.explore_every = EXPLORE_MIN;
        } else if explored {
            self.explore_every = (self.explore_every * 2).min(EXPLORE_MAX);
        }
    }
}

/// One direction of a shared-memory link: this rank writes into ring `slot`
/// of the peer's segment and reads ring `slot` of its own segment.
pub(crate) struct ShmLink {
    /// The peer's inbox (mapped here); we produce into it.
    peer: Segment,
    out: RingPtr,
    /// Our own inbox's ring for this peer; we consume from it. The segment
    /// itself is owned by the fabric (shared by all links).
    inp: RingPtr,
    /// How large writes into `out` store.
    stores: StoreChoice,
    /// This side's timings of large reads from `inp`, for its writer.
    reads: ReadTimings,
}

// SAFETY: see `Segment`; the raw ring pointers point into mappings that the
// link (peer segment) or the fabric (own segment, dropped after every link)
// keeps alive.
unsafe impl Send for ShmLink {}

impl ShmLink {
    /// A link that writes into `peer`'s ring `slot_in_peer` (large writes
    /// as `stores` says) and reads `own`'s ring `slot_in_own`. `own` must
    /// outlive the link.
    pub fn new(
        peer: Segment,
        slot_in_peer: usize,
        own: &Segment,
        slot_in_own: usize,
        stores: LinkStores,
    ) -> io::Result<ShmLink> {
        let bad = || io::Error::other("segment has too few rings for this job");
        let out = peer.ring(slot_in_peer).ok_or_else(bad)?;
        let inp = own.ring(slot_in_own).ok_or_else(bad)?;
        Ok(ShmLink {
            peer,
            out,
            inp,
            stores: StoreChoice::new(stores),
            reads: ReadTimings::default(),
        })
    }

    /// Copies as much of `data` as fits into the peer's ring.
    ///
    /// # Errors
    ///
    /// `InvalidData` when the ring's counters hold more than a ring's worth
    /// between them: the counters live in memory the peer can write, and
    /// copying by them would run past the ring.
    pub fn write_some(&mut self, data: &[u8]) -> io::Result<usize> {
        let r = self.out;
        // SAFETY: the control words are valid atomics for the ring's lifetime.
        let (head, tail) = unsafe { (&*r.head, &*r.tail) };
        let t = tail.load(Ordering::Relaxed); // we are the only writer of tail
        let h = head.load(Ordering::Acquire);
        let used = t.wrapping_sub(h);
        if used > r.cap as u64 {
            return Err(corrupt_counters(h, t, r.cap));
        }
        let free = r.cap - used as usize;
        let n = free.min(data.len());
        if n == 0 {
            return Ok(0);
        }
        let at = (t as usize) & (r.cap - 1);
        let first = n.min(r.cap - at);
        let chosen = n >= CHOSEN_WRITE_MIN_BYTES;
        let (streaming, timed) = if chosen {
            self.stores.next()
        } else {
            (false, false)
        };
        if self.stores.policy == LinkStores::Adaptive {
            // Small writes (a frame's header) too: a large read of them
            // must not count as one of the streamed write before.
            // SAFETY: this side alone writes the ring's way log.
            unsafe { WayLog::note(r.ways, &mut self.stores.logged, t, streaming) };
        }
        let start = timed.then(std::time::Instant::now);
        // SAFETY: [at, at+first) and [0, n-first) lie in the ring's data
        // (n <= cap, checked above), and the consumer does not read them
        // until `tail` is published below (after the streaming copies'
        // store fence).
        unsafe {
            if streaming {
                copy_streaming_unfenced(data.as_ptr(), r.data.add(at), first);
                copy_streaming_unfenced(data.as_ptr().add(first), r.data, n - first);
                fence();
            } else {
                copy_cached(data.as_ptr(), r.data.add(at), first);
                copy_cached(data.as_ptr().add(first), r.data, n - first);
            }
        }
        if let Some(start) = start {
            let ns = start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
            // SAFETY: the ring's read speeds are valid atomics.
            unsafe { self.stores.reader_published(r.read_speeds) };
            self.stores.timed(streaming, n, ns);
        }
        tail.store(t.wrapping_add(n as u64), Ordering::Release);
        Ok(n)
    }

    /// Copies as many available bytes as fit into `buf`.
    ///
    /// # Errors
    ///
    /// As [`write_some`](Self::write_some).
    pub fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let r = self.inp;
        // SAFETY: as in write_some.
        let (head, tail) = unsafe { (&*r.head, &*r.tail) };
        let h = head.load(Ordering::Relaxed); // we are the only writer of head
        let t = tail.load(Ordering::Acquire);
        let avail = t.wrapping_sub(h);
        if avail > r.cap as u64 {
            return Err(corrupt_counters(h, t, r.cap));
        }
        let n = (avail as usize).min(buf.len());
        if n == 0 {
            return Ok(0);
        }
        let at = (h as usize) & (r.cap - 1);
        let first = n.min(r.cap - at);
        // A large read of bytes one way stored is timed for the writer.
        let way = if n >= CHOSEN_WRITE_MIN_BYTES {
            // SAFETY: the ring's way log; h + n ≤ the tail read above.
            unsafe { WayLog::way_of(r.ways, h, h.wrapping_add(n as u64)) }
        } else {
            None
        };
        let start = way.map(|_| std::time::Instant::now());
        // SAFETY: the producer published these bytes (acquire above) and
        // will not overwrite them until `head` moves past them; n <= cap
        // (checked above), so both ranges lie in the ring's data.
        unsafe {
            copy_cached(r.data.add(at), buf.as_mut_ptr(), first);
            copy_cached(r.data, buf.as_mut_ptr().add(first), n - first);
        }
        if let (Some(streamed), Some(start)) = (way, start) {
            let ns = start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
            // SAFETY: this side alone writes the ring's read speeds.
            unsafe { self.reads.record(r.read_speeds, streamed, n, ns) };
        }
        head.store(h.wrapping_add(n as u64), Ordering::Release);
        Ok(n)
    }

    /// Whether the peer dropped its communicator (a clean exit).
    pub fn peer_departed(&self) -> bool {
        self.peer.departed()
    }

    /// Whether the peer's process still runs.
    pub fn peer_alive(&self) -> bool {
        process_alive(self.peer.owner())
    }

    /// The peer's process id.
    pub fn peer_pid(&self) -> u32 {
        self.peer.owner().pid
    }
}

/// A process as a rank publishes it for liveness checks: its id and its
/// start time, so that the id of a peer that died, handed by the kernel to
/// a later process, is not taken for the peer (a wait that ends when the
/// peer dies, such as `Arena::withdraw`'s, would then never end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ProcessStamp {
    pub pid: u32,
    /// Clock ticks from boot to the process's start (`/proc/PID/stat`,
    /// field 22); 0 where unknown (no `/proc`), then the id alone counts.
    pub start: u64,
}

impl ProcessStamp {
    /// This process's stamp, read when asked (once per attach: a child
    /// forked after a set-up must not publish its parent's start time).
    /// The start time is 0 where `/proc` belongs to another pid namespace
    /// (its `self` has another id than ours, so a peer reading
    /// `/proc/OUR_ID` would find another process): the id alone counts.
    pub fn own() -> ProcessStamp {
        let pid = std::process::id();
        let start = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .filter(|stat| stat.split_whitespace().next() == Some(pid.to_string().as_str()))
            .and_then(|stat| parse_stat(&stat))
            .map_or(0, |(_, start)| start);
        ProcessStamp { pid, start }
    }
}

/// The state letter and the start time (field 22) of a `/proc/PID/stat`
/// line. The fields are counted after the command name's closing
/// parenthesis: the name itself may hold spaces and parentheses.
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Fields 4 to 21 lie between the state (3) and the start time (22).
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Whether the process `stamp` names still runs: its id exists, is not a
/// zombie (a killed rank whose parent has not reaped it yet counts as
/// dead), and (where the stamp has a start time) started when the stamp
/// says, so a reused id is no longer the peer.
pub(crate) fn process_alive(stamp: ProcessStamp) -> bool {
    let pid = stamp.pid;
    // A pid a peer wrote: 0 and values past i32::MAX would name process
    // groups (0: our own, always "alive"), not a process.
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => match parse_stat(&stat) {
            Some(('Z' | 'X', _)) => false,
            Some((_, start)) => stamp.start == 0 || start == stamp.start,
            // Unreadable: trust kill(2).
            None => true,
        },
        Err(_) => true, // no /proc: trust kill(2)
    }
}

/// What makes two ranks "on the same host" for shared memory: the same
/// kernel boot, hostname, and the same IPC, mount, PID and network
/// namespaces (so containers and network-namespace test hosts sharing one
/// kernel count as different hosts, as they should). Compared as text.
pub(crate) fn host_identity() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let link = |path: &str| {
        std::fs::read_link(path)
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    };
    let boot_id = read("/proc/sys/kernel/random/boot_id");
    let ipc = link("/proc/self/ns/ipc");
    if boot_id.is_empty() || ipc.is_empty() {
        // Without /proc two hosts would both read "|||||" and try each
        // other's segments. The host name, from the kernel, still tells
        // hosts apart (and keeps one host's GPU ranks together); without
        // one this process shares memory with no one (a unique identity,
        // drawn once: it is compared across calls) and its peers are
        // reached over TCP.
        let mut name = [0u8; 256];
        // SAFETY: gethostname writes at most `name.len()` bytes into it.
        let ok = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } == 0;
        let end = name.iter().position(|&b| b == 0).unwrap_or(0);
        if ok && end > 0 {
            return format!("hostname-only|{}", String::from_utf8_lossy(&name[..end]));
        }
        static UNKNOWN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        return UNKNOWN
            .get_or_init(|| format!("unknown|{}|{:x}", std::process::id(), random_suffix()))
            .clone();
    }
    format!(
        "{}|{}|{}|{}|{}|{}",
        read("/proc/sys/kernel/hostname"),
        boot_id,
        ipc,
        link("/proc/self/ns/mnt"),
        link("/proc/self/ns/pid"),
        link("/proc/self/ns/net"),
    )
}

/// What makes two ranks share CPUs: the same running kernel (its boot id),
/// whatever their namespaces or containers; `host_identity` where the boot
/// id cannot be read.
pub(crate) fn kernel_identity() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        Ok(id) if !id.trim().is_empty() => format!("boot|{}", id.trim()),
        _ => host_identity(),
    }
}

/// Bits that differ between processes and calls, without /proc: the
/// clock's nanoseconds mixed with a stack address (randomised per process).
fn random_suffix() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let local = 0u8;
    nanos ^ (std::ptr::addr_of!(local) as u64).rotate_left(29)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unique(tag: &str) -> String {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        segment_name("test", &format!("{tag}{}", std::process::id()), n)
    }

    /// Rings too small to keep the next ring's counters aligned are refused
    /// on create, and on open when a header says so.
    #[test]
    fn rings_below_eight_bytes_are_refused() {
        let name = unique("tiny");
        assert!(Segment::create(&name, 2, 4).is_err());
        assert!(Segment::create_with_region(&name, 0, 1, 64).is_ok_and(|s| {
            drop(s);
            true
        }));
        let s = Segment::create(&name, 2, 4096).unwrap();
        assert_eq!(s.owner(), ProcessStamp::own());
        // Rewrite the header as a peer might.
        s.header().ring_bytes.store(4, Ordering::Relaxed);
        let opened = Segment::open(&name);
        assert!(opened.is_err());
        drop(s);
    }

    /// Two ranks' segments of one ring each, linked both ways: rank a's
    /// link `a_to_b` writes into `b`'s ring, which rank b's link `b_to_a`
    /// reads, and the other way round. Used whole (not destructured: a
    /// field left out of a pattern drops at once), so the links, declared
    /// first, drop before the segments they point into.
    struct Pair {
        a_to_b: ShmLink,
        b_to_a: ShmLink,
        b: Segment,
        _a: Segment,
    }

    fn linked_pair(tag: &str, ring_bytes: usize, stores: LinkStores) -> Pair {
        let (a_name, b_name) = (unique(&format!("{tag}a")), unique(&format!("{tag}b")));
        let a = Segment::create(&a_name, 1, ring_bytes).unwrap();
        let b = Segment::create(&b_name, 1, ring_bytes).unwrap();
        let a_to_b = ShmLink::new(Segment::open(&b_name).unwrap(), 0, &a, 0, stores).unwrap();
        let b_to_a = ShmLink::new(Segment::open(&a_name).unwrap(), 0, &b, 0, stores).unwrap();
        Pair {
            a_to_b,
            b_to_a,
            b,
            _a: a,
        }
    }

    #[test]
    fn bytes_stream_through_a_small_ring_in_order() {
        let mut p = linked_pair("s", 64, LinkStores::Adaptive);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let (mut sent, mut got) = (0, Vec::new());
        while got.len() < data.len() {
            sent += p.a_to_b.write_some(&data[sent..]).unwrap();
            let mut buf = [0u8; 37];
            let n = p.b_to_a.read_some(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, data);
        assert!(p.a_to_b.peer_alive() && !p.a_to_b.peer_departed());
        p.b.set_departed();
        assert!(p.a_to_b.peer_departed());
    }

    /// Feeds `writes` chosen writes of 256 KiB at `cached` and `streamed`
    /// GB/s (= bytes per ns) to `choice`; returns the mode after each and
    /// how many writes explored the other way.
    fn feed(choice: &mut StoreChoice, writes: u32, cached: f64, streamed: f64) -> (Vec<bool>, u32) {
        let mut explored = 0;
        let modes = (0..writes)
            .map(|_| {
                let (streaming, timed) = choice.next();
                explored += u32::from(streaming != choice.streaming);
                if timed {
                    let speed = if streaming { streamed } else { cached };
                    choice.timed(streaming, 256 << 10, ((256 << 10) as f64 / speed) as u64);
                }
                choice.streaming
            })
            .collect();
        (modes, explored)
    }

    /// A writer that times cached stores faster, alike, or up to a little
    /// under half as fast as streaming ones keeps them (near: the reader's
    /// cost, unseen here, favours them); one whose cached stores write
    /// several times slower (far) streams within a few chosen writes, keeps
    /// streaming while cached stores stay under 0.8 of its speed, and comes
    /// back once they reach it. Explorations space out while they change
    /// nothing. Forced modes never time.
    #[test]
    fn large_writes_stream_only_when_that_clearly_writes_faster() {
        let mut choice = StoreChoice::new(LinkStores::Adaptive);
        let all = |modes: &[bool], streaming: bool| modes.iter().all(|&s| s == streaming);
        // Near, source in cache: cached 30 against 18; source in memory
        // 15 against 13; streaming timed a third faster, or 1.9×, is not
        // enough.
        for (cached, streamed) in [(30.0, 18.0), (15.0, 13.0), (15.0, 20.0), (10.0, 19.0)] {
            assert!(
                all(&feed(&mut choice, 300, cached, streamed).0, false),
                "{cached} {streamed}"
            );
        }
        // Explorations spaced out to the widest: over 2560 steady writes,
        // 10 at EXPLORE_MAX (and never more than one per EXPLORE_MIN), each
        // of EXPLORE_WRITES writes the other way.
        let (_, explored) = feed(&mut choice, 2560, 30.0, 18.0);
        let explorations = explored / EXPLORE_WRITES;
        assert!(
            (9..=11).contains(&explorations),
            "{explorations} explorations"
        );
        // Far: cached stores collapse to 2 GB/s; streaming's last figure
        // (18) is over twice that after two timings of the current way.
        let (far, _) = feed(&mut choice, 300, 2.0, 17.0);
        let first = far.iter().position(|&s| s).expect("streams far");
        assert!(first <= 2 * TIME_EVERY as usize, "streamed after {first}");
        assert!(all(&far[first..], true), "steady once streaming");
        // Cached stores at 0.7 of streaming's speed: still streaming.
        assert!(all(&feed(&mut choice, 600, 12.0, 17.0).0, true));
        // At 0.85: cached again, within the widest spacing.
        let (back, _) = feed(&mut choice, 600, 14.5, 17.0);
        let at = back.iter().position(|&s| !s).expect("cached again");
        assert!(at <= EXPLORE_MAX as usize, "cached again after {at}");
        assert!(all(&back[at..], false));
        // Forced: no timing, no exploring.
        for (policy, streams) in [(LinkStores::Cached, false), (LinkStores::Streaming, true)] {
            let mut forced = StoreChoice::new(policy);
            for _ in 0..1000 {
                assert_eq!(forced.next(), (streams, false), "{policy:?}");
            }
        }
    }

    /// The way log places a read by the last change at or before its
    /// start, and refuses reads that straddle a change, start before the
    /// oldest change kept, or precede every write.
    #[test]
    fn the_way_log_places_reads_within_one_way() {
        let change = |position: u64, streamed: bool| position << 1 | u64::from(streamed);
        // Header cached at 0, payload streamed at 64, next header at 65 600.
        let log = [change(0, false), change(64, true), change(65_600, false)];
        assert_eq!(way_at(&log, 64, 65_600), Some(true));
        assert_eq!(way_at(&log, 100, 40_000), Some(true));
        assert_eq!(way_at(&log, 0, 64), Some(false));
        assert_eq!(way_at(&log, 65_600, 200_000), Some(false));
        assert_eq!(way_at(&log, 32, 40_000), None, "straddles a change");
        assert_eq!(way_at(&log[1..], 0, 64), None, "before the oldest kept");
        assert_eq!(way_at(&[], 0, 64), None);

        // Through shared words: a writer logging, wrapping the log.
        let words: Vec<AtomicU64> = (0..=WAY_LOG_LEN).map(|_| AtomicU64::new(0)).collect();
        let ways = words.as_ptr();
        let mut last = None;
        let mut position = 0;
        // Ten frames, header cached, payload streamed but for every third.
        for frame in 1..=10u64 {
            // SAFETY: `words` is a log's count and entries.
            unsafe {
                WayLog::note(ways, &mut last, position, false);
                WayLog::note(ways, &mut last, position + 64, frame % 3 != 0);
            }
            position += 64 + 32_768;
        }
        let count = words[0].load(Ordering::Relaxed);
        assert!(
            count > WAY_LOG_LEN as u64,
            "{count} changes, the log wrapped"
        );
        let last_payload = position - 32_768;
        // SAFETY: as above; the reads end at the last write's end.
        unsafe {
            assert_eq!(WayLog::way_of(ways, last_payload, position), Some(true));
            assert_eq!(WayLog::way_of(ways, 64, 32_832), None, "long overwritten");
        }
    }

    /// With the reader's timings, the choice compares bytes through the
    /// ring: near, cached writes that time no faster than streamed ones
    /// (the writer's view) stay cached because the reader reads them 2–3×
    /// faster; far, cached writes so slow that no read makes up for them
    /// stream; and a reader that reads streamed data slowly enough brings
    /// cached stores back.
    #[test]
    fn the_readers_timings_keep_cached_stores_near_and_stream_far() {
        let read = |choice: &mut StoreChoice, cached: f64, streamed: f64| {
            let words = [
                AtomicU64::new(cached.to_bits()),
                AtomicU64::new(streamed.to_bits()),
            ];
            // SAFETY: two speed words.
            unsafe { choice.reader_published(words.as_ptr()) };
        };
        // Near: writes 15 cached against 35 streamed (the writer alone
        // would stream: 2.3×), reads 30 against 12.
        let mut near = StoreChoice::new(LinkStores::Adaptive);
        read(&mut near, 30.0, 12.0);
        let (modes, _) = feed(&mut near, 600, 15.0, 35.0);
        assert!(modes.iter().all(|&s| !s), "near stays cached");
        // Far: writes 2.2 against 18, reads 13 against 10.7.
        let mut far = StoreChoice::new(LinkStores::Adaptive);
        read(&mut far, 13.0, 10.7);
        let (modes, _) = feed(&mut far, 300, 2.2, 18.0);
        let first = modes.iter().position(|&s| s).expect("streams far");
        assert!(modes[first..].iter().all(|&s| s), "steady once streaming");
        // The reader slows on streamed data: cached again.
        read(&mut far, 13.0, 2.0);
        let (back, _) = feed(&mut far, 600, 6.0, 18.0);
        assert!(
            back.iter().any(|&s| !s) && !back[back.len() - 1],
            "cached again"
        );
        // A garbage figure from the peer's memory is ignored.
        let mut odd = StoreChoice::new(LinkStores::Adaptive);
        read(&mut odd, f64::NAN, -1.0);
        assert_eq!(odd.reader, [0.0, 0.0]);
    }

    /// Writes of 32 KiB and more through a ring, streamed (forced), chosen
    /// (adaptive) and cached, wrapping around it: every byte arrives in
    /// order, and the adaptive writer counted its chosen writes.
    #[test]
    fn large_writes_arrive_whichever_stores_write_them() {
        for stores in [
            LinkStores::Streaming,
            LinkStores::Adaptive,
            LinkStores::Cached,
        ] {
            let mut p = linked_pair("l", 128 << 10, stores);
            // Odd sizes and offsets: unaligned heads and tails, and writes
            // that wrap the ring.
            let data: Vec<u8> = (0..5_000_017u32).map(|i| (i % 251) as u8).collect();
            let (mut sent, mut got) = (0, Vec::with_capacity(data.len()));
            let mut buf = vec![0u8; 77_777];
            while got.len() < data.len() {
                let end = (sent + 90_001).min(data.len());
                sent += p.a_to_b.write_some(&data[sent..end]).unwrap();
                let n = p.b_to_a.read_some(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            assert!(got == data, "{stores:?}");
            let counted = p.a_to_b.stores.writes > 0 || p.a_to_b.stores.speed != [0.0; 2];
            assert_eq!(counted, stores == LinkStores::Adaptive, "{stores:?}");
            // Only an adapting writer logs its ways, and only then does its
            // reader time reads (a 77 777-byte buffer takes whole payloads).
            // SAFETY: the ring's log count is a valid atomic while `b` lives.
            let logged = unsafe { (*p.a_to_b.out.ways).load(Ordering::Relaxed) } > 0;
            assert_eq!(logged, stores == LinkStores::Adaptive, "{stores:?}");
            let timed = p.b_to_a.reads.speed != [0.0; READ_SPEEDS];
            assert_eq!(timed, stores == LinkStores::Adaptive, "{stores:?}");
        }
    }

    /// Ring counters a peer set further apart than the ring holds are an
    /// error on both sides, not a copy by them past the ring (the writer
    /// would have written 4 KiB into a 64-byte ring, the reader read as
    /// much out of it).
    #[test]
    fn ring_counters_a_peer_corrupted_are_an_error() {
        let mut p = linked_pair("c", 64, LinkStores::Adaptive);
        assert_eq!(p.a_to_b.write_some(&[1; 10]).unwrap(), 10);
        // The peer moves the ring's head behind by far (a writer's "free"
        // would wrap), then its tail ahead by far (a reader's "available").
        let ring = p.a_to_b.out;
        // SAFETY: the ring's control words are valid atomics while `b` lives.
        unsafe { (*ring.head).store(u64::MAX - 5000, Ordering::Release) };
        let e = p.a_to_b.write_some(&[2; 4096]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("corrupt"), "{e}");
        unsafe { (*ring.head).store(0, Ordering::Release) };
        unsafe { (*ring.tail).store(1 << 40, Ordering::Release) };
        let mut buf = vec![0u8; 4096];
        let e = p.b_to_a.read_some(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    }

    /// A header whose ring sizes multiply past the address space is
    /// refused, not wrapped into a size that fits the mapping.
    #[test]
    fn a_header_whose_sizes_overflow_is_not_a_segment() {
        let name = unique("o");
        let s = Segment::create(&name, 1, 4096).unwrap();
        // 2^56 slots of 2^13 + 256 = 2^8 · 33 bytes: 33 · 2^64, which
        // wraps to 0, and the header alone fits any mapping.
        let (slots, ring_bytes) = (1usize << 56, 1usize << 13);
        assert_eq!(slots.wrapping_mul(ring_bytes + 2 * LINE), 0);
        s.header().slots.store(slots as u64, Ordering::Relaxed);
        s.header()
            .ring_bytes
            .store(ring_bytes as u64, Ordering::Relaxed);
        let err = Segment::open(&name).err().expect("refused");
        assert!(err.to_string().contains("bad header"), "{err}");
    }

    #[test]
    fn names_are_removed_on_unlink_and_drop() {
        let name = unique("c");
        let path = format!("/dev/shm{name}");
        let mut s = Segment::create(&name, 2, 4096).unwrap();
        assert!(std::path::Path::new(&path).exists());
        assert!(Segment::create(&name, 2, 4096).is_err(), "O_EXCL");
        let opened = Segment::open(&name).unwrap();
        s.unlink();
        assert!(!std::path::Path::new(&path).exists());
        drop(opened);
        drop(s);
        let name = unique("d");
        drop(Segment::create(&name, 1, 4096).unwrap());
        assert!(!std::path::Path::new(&format!("/dev/shm{name}")).exists());
    }

    #[test]
    fn job_ids_become_safe_names() {
        assert_eq!(sanitize_job_id("my-job/1 x"), "my_job_1_x");
        assert_eq!(sanitize_job_id(&"a".repeat(100)).len(), 64);
    }

    #[test]
    fn liveness() {
        let me = ProcessStamp::own();
        assert!(me.start > 0, "{me:?}");
        assert!(process_alive(me));
        // The same id with another start time: a later process that was
        // handed a dead peer's id.
        for start in [me.start - 1, me.start + 1] {
            assert!(!process_alive(ProcessStamp { start, ..me }));
        }
        // Without a start time the id alone counts.
        assert!(process_alive(ProcessStamp { start: 0, ..me }));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let child_stamp = ProcessStamp {
            pid: child.id(),
            start: 0,
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            !process_alive(child_stamp),
            "an unreaped zombie counts as dead"
        );
        child.wait().unwrap();
        assert!(!process_alive(child_stamp));
        assert!(host_identity().contains('|'));
    }

    /// The start time is field 22, counted after the command name, which
    /// may hold spaces and parentheses.
    #[test]
    fn stat_lines_parse_past_odd_command_names() {
        let tail = "S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 19 20";
        assert_eq!(
            parse_stat(&format!("42 (a) b) c) {tail}")),
            Some(('S', 987654))
        );
        assert_eq!(
            parse_stat(&format!("42 (plain) {tail}")),
            Some(('S', 987654))
        );
        assert_eq!(parse_stat("42 (short) S 1 2"), None);
        assert_eq!(parse_stat("no parenthesis"), None);
    }
}
