//! Transports move framed bytes between ranks and nothing else: they know
//! peers and frame headers, never a dtype or an operator.

pub(crate) mod iface;
pub(crate) mod local;
pub(crate) mod net;
pub(crate) mod shm;
pub(crate) mod tcp;

use std::time::Duration;

use crate::types::OpKind;

/// Which numbering a frame's sequence number belongs to: collectives are
/// numbered per communicator, point-to-point calls per ordered pair of ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Space {
    Collective,
    PointToPoint,
}

/// What identifies and describes a frame. `(source, ctx, space, seq, step)`
/// identifies it; `op` and `bytes` are checked on arrival so that ranks
/// running different operations are told so instead of corrupting data.
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
        Ok(())
    }
}

/// Owned frame bytes, 8-byte aligned so they can be viewed as any element type.
///
/// Large buffers come from and return to [`pool`]: a fresh allocation of a
/// pipeline piece (256 KiB) is an `mmap` whose pages fault in one by one as
/// they are first written — on this VM about as long as copying the piece
/// twice — and every frame of a large call needs one on each side.
#[derive(Debug, Default)]
pub(crate) struct Payload {
    words: Vec<u64>,
    bytes: usize,
}

impl Payload {
    pub fn from_bytes(data: &[u8]) -> Payload {
        let mut words = pool::take(data.len().div_ceil(8));
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..data.len()].copy_from_slice(data);
        Payload {
            words,
            bytes: data.len(),
        }
    }

    /// `bytes` bytes to be filled by a receive (zero, or a recycled
    /// buffer's old contents: a receive overwrites all of them).
    pub fn zeroed(bytes: usize) -> Payload {
        Payload {
            words: pool::take(bytes.div_ceil(8)),
            bytes,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.bytes]
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
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
        fn large_buffers_are_recycled_whole() {
            let v = take(40_000);
            assert_eq!(v.len(), 40_000);
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

/// Why a transport call failed; the executor adds the op, rank and peer.
#[derive(Debug)]
pub(crate) enum TransportError {
    Timeout(Duration),
    /// A peer is gone: `rank` names it (a communicator rank) when it is not
    /// the peer the call was talking to.
    PeerLost {
        rank: Option<usize>,
    },
    Aborted,
    Mismatch(String),
}

/// The transports a host communicator can use (static dispatch).
pub(crate) enum Transport {
    Local(local::LocalEndpoint),
    /// Separate processes, over shared memory and TCP.
    Net(net::NetEndpoint),
}

impl Transport {
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

    /// [`recv`](Self::recv) into `dst`: the multi-process transport reads a
    /// frame that arrives while this waits straight into `dst`.
    pub fn recv_into(
        &self,
        peer: usize,
        expect: &FrameHeader,
        timeout: Duration,
        dst: &mut [u8],
    ) -> Result<(), TransportError> {
        match self {
            Transport::Local(t) => {
                let payload = t.recv(peer, expect, timeout)?;
                dst.copy_from_slice(payload.as_bytes());
                Ok(())
            }
            Transport::Net(t) => t.recv_into(peer, expect, timeout, dst),
        }
    }

    /// Waits until this rank's queued frames have left (sends are eager, so
    /// a call must not return while its last frames sit in a queue no one
    /// will drain). Returns the peer concerned on failure.
    pub fn flush(&self, timeout: Duration) -> Result<(), (usize, TransportError)> {
        match self {
            // In-process sends land in the peer's mailbox at once.
            Transport::Local(_) => Ok(()),
            Transport::Net(t) => t.flush(timeout),
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

    /// What carries the traffic, for reports: `in-process`, `shm`, `tcp (...)`.
    pub fn describe(&self) -> String {
        match self {
            Transport::Local(_) => "in-process".into(),
            Transport::Net(t) => t.describe(),
        }
    }
}
