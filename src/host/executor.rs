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

/// Receives of at least this many bytes whose destination no earlier step
/// touches are posted when the call starts ([`Transport::post_ahead`]):
/// frames that arrive before their step runs (a broadcast's later pieces,
/// an all-gather's chunks) land in place instead of in buffers copied
/// later.
const POST_AHEAD_MIN_BYTES: usize = 64 << 10;

/// The spans a step reads or writes.
fn spans(step: &Step) -> [Option<Span>; 2] {
    match *step {
        Step::Send { src, .. } => [Some(src), None],
        Step::Recv { dst, .. } | Step::RecvCopySend { dst, .. } => [Some(dst), None],
        Step::RecvReduce { local, dst, .. } => [Some(local), Some(dst)],
        Step::RecvReduceSend { local, .. } => [Some(local), None],
        Step::Copy { src, dst } | Step::ReduceLocal { src, dst } => [Some(src), Some(dst)],
        Step::DivideByWorld { span } => [Some(span), None],
    }
}

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
    // Ranges of the written buffer touched so far: start → end, disjoint.
    let mut touched = std::collections::BTreeMap::<usize, usize>::new();
    let overlaps = |touched: &std::collections::BTreeMap<usize, usize>, span: Span| {
        let end = span.offset + span.len;
        touched
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| e > span.offset)
    };
    let mut frames = vec![0u32; world];
    let mut ahead = Vec::new();
    for step in &plan.steps {
        if let Step::Recv { peer, dst } = *step {
            if big(step) && in_written(dst) && !overlaps(&touched, dst) {
                ahead.push((peer, frames[peer], dst));
            }
        }
        if let Some(peer) = receives_from(step) {
            frames[peer] += 1;
        }
        for span in spans(step).into_iter().flatten() {
            if in_written(span) && span.len > 0 {
                // Merge with every range it overlaps or touches.
                let (mut start, mut end) = (span.offset, span.offset + span.len);
                let joined: Vec<(usize, usize)> = touched
                    .range(..=end)
                    .rev()
                    .take_while(|&(_, &e)| e >= start)
                    .map(|(&s, &e)| (s, e))
                    .collect();
                for (s, e) in joined {
                    touched.remove(&s);
                    start = start.min(s);
                    end = end.max(e);
                }
                touched.insert(start, end);
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
    let mut posted_ahead = PostedAhead {
        transport,
        recvs: Vec::new(),
    };
    if transport.receives_ahead() {
        let elem = std::mem::size_of::<T>();
        let out = bufs.recv_mut().as_mut_ptr();
        for (peer, frame, dst) in receives_to_post_ahead(plan, info.world, elem, !out_of_place) {
            // SAFETY: dst lies in the written buffer (the plan's spans are
            // validated against the buffers' lengths).
            let at = unsafe { out.add(dst.offset) }.cast::<u8>();
            posted_ahead
                .recvs
                .push((peer, header::<T>(info, frame, dst.len), at));
        }
        // SAFETY: no step before a posted receive's reads or writes its
        // destination (`receives_to_post_ahead`), that receive's own
        // `recv_into` names the same destination, and `posted_ahead`
        // withdraws whatever is left before the buffers' borrow ends.
        unsafe { transport.post_ahead(&posted_ahead.recvs) };
    }
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
    drop(posted_ahead);
    flushed
}

#[cfg(test)]
mod tests {
    use super::*;

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
