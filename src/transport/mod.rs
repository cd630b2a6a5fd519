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
#[derive(Debug, Default)]
pub(crate) struct Payload {
    words: Vec<u64>,
    bytes: usize,
}

impl Payload {
    pub fn from_bytes(data: &[u8]) -> Payload {
        let mut words = vec![0u64; data.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..data.len()].copy_from_slice(data);
        Payload {
            words,
            bytes: data.len(),
        }
    }

    /// `bytes` zero bytes, to be filled by a receive.
    pub fn zeroed(bytes: usize) -> Payload {
        Payload {
            words: vec![0u64; bytes.div_ceil(8)],
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
