//! Transports move framed bytes between ranks and nothing else: they know
//! peers and frame headers, never a dtype or an operator.

pub(crate) mod iface;
pub(crate) mod local;

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
    PeerLost,
    Aborted,
    Mismatch(String),
}

/// The transports a host communicator can use (static dispatch).
pub(crate) enum Transport {
    Local(local::LocalEndpoint),
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
        }
    }
}
