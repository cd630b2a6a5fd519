//! Runs a [`Plan`] over a [`Transport`] on host buffers.
//!
//! The combine order is fixed everywhere: `local ⊕ incoming`, so the same plan
//! gives the same bits whatever buffers (in place or not) it runs on.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::schedule::{BufId, Plan, Span, Step};
use crate::transport::{FrameHeader, Payload, Space, Transport, TransportError};
use crate::types::{Element, OpKind, Rank, ReduceOp};

/// The call's buffers as the plan sees them.
pub(crate) enum Bufs<'a, T> {
    /// One buffer; plans refer only to [`BufId::Recv`].
    InPlace(&'a mut [T]),
    /// Separate input and output (either may be empty).
    OutOfPlace { send: &'a [T], recv: &'a mut [T] },
}

impl<T: Element> Bufs<'_, T> {
    /// `span` of the send or receive buffer (scratch is the executor's).
    fn read(&self, span: Span) -> &[T] {
        match (self, span.buf) {
            (Bufs::OutOfPlace { send, .. }, BufId::Send) => &send[span.range()],
            (Bufs::OutOfPlace { recv, .. }, _) => &recv[span.range()],
            (Bufs::InPlace(buf), _) => &buf[span.range()],
        }
    }

    fn recv_mut(&mut self) -> &mut [T] {
        match self {
            Bufs::OutOfPlace { recv, .. } => recv,
            Bufs::InPlace(buf) => buf,
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
}

impl CallInfo {
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
            TransportError::Aborted => Error::Aborted { op, seq, rank },
            TransportError::Mismatch(detail) => Error::Mismatch {
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
struct Counters {
    sent: Vec<u32>,
    received: Vec<u32>,
}

fn header<T: Element>(info: &CallInfo, step: u32, len: usize) -> FrameHeader {
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
    }
}

/// Whether a step may write the receive buffer (or the one in-place
/// buffer). Conservative: every step with a destination writes the receive
/// buffer in `execute` whatever the destination's `BufId`, except a copy
/// into scratch.
fn writes_recv(step: &Step) -> bool {
    match *step {
        Step::Send { .. } | Step::RecvReduceSend { .. } => false,
        Step::Copy { dst, .. } => dst.buf != BufId::Scratch,
        _ => true,
    }
}

/// Withdraws the caller's buffers from the transport's queues when a call
/// that sent from them in place ends: frames still queued (the call failed
/// before its flush) get copies of their own.
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

/// Runs `plan` for one call.
pub(crate) fn execute<T: Element>(
    transport: &Transport,
    info: &CallInfo,
    plan: &Plan,
    mut bufs: Bufs<'_, T>,
) -> Result<()> {
    let mut counters = Counters {
        sent: vec![0; info.world],
        received: vec![0; info.world],
    };
    let op = info.reduce_op;
    // Sends read the caller's buffer in place (no copy into a frame) when
    // the transport writes frames out before the call returns and nothing
    // in the call writes that buffer meanwhile: the input of an
    // out-of-place call, or a buffer the plan never writes (a broadcast's
    // root in place).
    let recv_is_read_only = !plan.steps.iter().any(writes_recv);
    let out_of_place = matches!(bufs, Bufs::OutOfPlace { .. });
    let lend = |src: Span| {
        transport.takes_borrowed()
            && match src.buf {
                // In place, "send" names the one buffer the plan may write.
                BufId::Send => out_of_place || recv_is_read_only,
                BufId::Recv => recv_is_read_only,
                BufId::Scratch => false,
            }
    };
    let mut guard = BorrowGuard {
        transport,
        lent: false,
    };
    // Only direct plans use scratch, and only for small messages.
    let mut scratch = vec![T::zeroed(); plan.scratch_len];
    let read = |bufs: &Bufs<'_, T>, scratch: &[T], span: Span| -> Vec<T> {
        match span.buf {
            BufId::Scratch => scratch[span.range()].to_vec(),
            _ => bufs.read(span).to_vec(),
        }
    };
    let send = |counters: &mut Counters, peer: Rank, payload: Payload, len: usize| -> Result<()> {
        let step = counters.sent[peer];
        counters.sent[peer] += 1;
        transport
            .send(peer, header::<T>(info, step, len), payload)
            .map_err(|e| info.error(peer, e))
    };
    let recv = |counters: &mut Counters, peer: Rank, len: usize| -> Result<Payload> {
        let step = counters.received[peer];
        counters.received[peer] += 1;
        transport
            .recv(peer, &header::<T>(info, step, len), info.timeout)
            .map_err(|e| info.error(peer, e))
    };
    for step in &plan.steps {
        match *step {
            Step::Send { peer, src } => {
                let data = match src.buf {
                    BufId::Scratch => &scratch[src.range()],
                    _ => bufs.read(src),
                };
                let bytes: &[u8] = bytemuck::cast_slice(data);
                let payload = if lend(src) {
                    guard.lent = true;
                    // SAFETY: `lend` holds: nothing writes these bytes during
                    // the call, and `guard` copies whatever is still queued
                    // before the call returns (the flush below leaves
                    // nothing queued on success).
                    unsafe { Payload::borrowed(bytes) }
                } else {
                    Payload::from_bytes(bytes)
                };
                send(&mut counters, peer, payload, src.len)?;
            }
            Step::Recv { peer, dst } => {
                let step = counters.received[peer];
                counters.received[peer] += 1;
                let out = bytemuck::cast_slice_mut(&mut bufs.recv_mut()[dst.range()]);
                transport
                    .recv_into(peer, &header::<T>(info, step, dst.len), info.timeout, out)
                    .map_err(|e| info.error(peer, e))?;
            }
            Step::RecvReduce { peer, local, dst } => {
                let payload = recv(&mut counters, peer, dst.len)?;
                let incoming: &[T] = bytemuck::cast_slice(payload.as_bytes());
                match &mut bufs {
                    Bufs::OutOfPlace { send, recv } if local.buf == BufId::Send => {
                        T::combine_into(op, &mut recv[dst.range()], &send[local.range()], incoming);
                    }
                    bufs => {
                        let out = bufs.recv_mut();
                        if local.offset != dst.offset {
                            out.copy_within(local.range(), dst.offset);
                        }
                        T::combine_assign(op, &mut out[dst.range()], incoming);
                    }
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
                bufs.recv_mut()[dst.range()]
                    .copy_from_slice(bytemuck::cast_slice(payload.as_bytes()));
                send(&mut counters, to, payload, dst.len)?;
            }
            Step::Copy { src, dst } => match (&mut bufs, src.buf, dst.buf) {
                (bufs, _, BufId::Scratch) => {
                    let data = bufs.read(src);
                    scratch[dst.range()].copy_from_slice(data);
                }
                (bufs, BufId::Scratch, _) => {
                    bufs.recv_mut()[dst.range()].copy_from_slice(&scratch[src.range()]);
                }
                (Bufs::OutOfPlace { send, recv }, BufId::Send, _) => {
                    recv[dst.range()].copy_from_slice(&send[src.range()]);
                }
                (bufs, _, _) => bufs.recv_mut().copy_within(src.range(), dst.offset),
            },
            Step::ReduceLocal { src, dst } => match (&mut bufs, src.buf) {
                (bufs, BufId::Scratch) => {
                    T::combine_assign(op, &mut bufs.recv_mut()[dst.range()], &scratch[src.range()]);
                }
                (Bufs::OutOfPlace { send, recv }, BufId::Send) => {
                    T::combine_assign(op, &mut recv[dst.range()], &send[src.range()]);
                }
                (bufs, _) => {
                    // Both in the receive buffer: the plans keep them apart.
                    let data = read(bufs, &scratch, src);
                    T::combine_assign(op, &mut bufs.recv_mut()[dst.range()], &data);
                }
            },
            Step::DivideByWorld { span } => {
                T::divide_by(&mut bufs.recv_mut()[span.range()], info.world)
            }
        }
    }
    let flushed = transport
        .flush(info.timeout)
        .map_err(|(peer, e)| info.error(peer, e));
    drop(guard);
    flushed
}
