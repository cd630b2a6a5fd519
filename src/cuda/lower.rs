//! From a schedule [`Plan`] to the operations a GPU stream runs: the
//! cuda-ring executor's launch plan, pure data, checked on the CPU.
//!
//! The transport is *eager staging through the receiver's inbox*, the GPU
//! form of the host transports' eager sends: rank `r` owns one inbox per
//! peer `p`, sized for everything `p` sends it in the call. A `Send` is a
//! copy into the receiver's inbox at the pair's running offset, then a
//! *post* (an event recorded on the sender's stream, handed to the
//! receiver); a receive *awaits* the next post from that peer (its stream
//! waits on the event) and reads the inbox at the pair's running offset.
//! The k-th send of a pair matches its k-th receive with the same length —
//! the invariant the schedule simulator checks for every plan — so both
//! sides compute the same offsets without talking.
//!
//! Before its first message to a peer in a call (with data or not), a
//! sender waits for that peer's *ready* of the call, which the peer publishes
//! once it has enqueued everything of its previous calls. On the GPU this
//! orders the writes after the peer's reads of its inboxes in earlier calls:
//! no write lands in an inbox still being read. On the host it bounds how
//! far a sender runs ahead: every message of the pair's earlier calls has
//! been awaited when the next call's first message is posted, which lets
//! ranks in separate processes reuse one interprocess event per message
//! slot of a call ([`super::ring`]).
//!
//! Step by step (⊕ is the call's combining operator, arguments in the
//! host executor's order, so the bits match the host backend's):
//!
//! | step | operations |
//! |---|---|
//! | `Send{peer, src}` | copy `src` → outbox(peer); post(peer) |
//! | `Recv{peer, dst}` | await(peer); copy inbox(peer) → `dst` |
//! | `RecvReduce{peer, local, dst}` | await(peer); `dst = local ⊕ inbox(peer)` |
//! | `RecvReduceSend{from, to, local}` | await(from); `outbox(to) = local ⊕ inbox(from)` — fused: one kernel reads both and writes the next rank's inbox; post(to) |
//! | `RecvCopySend{from, to, dst}` | await(from); copy inbox(from) → `dst`; copy inbox(from) → outbox(to); post(to) |
//! | `Copy{src, dst}` | copy |
//! | `ReduceLocal{src, dst}` | `dst = dst ⊕ src` |
//! | `DivideByWorld{span}` | divide |
//!
//! Ranks that can address each other's buffers (threads of one process,
//! no host-staged pair) skip the inboxes for all-reduce, reduce-scatter,
//! all-gather and broadcast: [`lower_peer_direct`] emits readies, one
//! kernel or a few copies straight between the ranks' buffers, and empty
//! "done" messages, folding in the ring's order so the bits stay the
//! ring's.

use crate::desc::CollectiveDesc;
use crate::schedule::{BufId, ChunkLayout, Plan, Span, Step};
use crate::types::{DType, OpKind, Rank, ReduceOp};

/// A memory a device operation reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mem {
    /// A buffer of the call (`Send`, `Recv`) or the executor's scratch.
    Buf(BufId),
    /// A buffer of part `i` of a grouped call ([`concat`]).
    Part(usize, BufId),
    /// This rank's inbox for messages from `peer`.
    Inbox(Rank),
    /// `peer`'s inbox for messages from this rank.
    Outbox(Rank),
}

/// An element offset in a [`Mem`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct At {
    /// Which memory.
    pub mem: Mem,
    /// Element offset in it.
    pub offset: usize,
}

/// One operation on the rank's stream (or, for `Await`/`AwaitReady`, a
/// host-side wait for a peer's event followed by a stream wait on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DevOp {
    /// Copy `len` elements.
    Copy { src: At, dst: At, len: usize },
    /// `dst[i] = a[i] ⊕ b[i]` for `len` elements (`a` may be `dst`).
    Combine { dst: At, a: At, b: At, len: usize },
    /// Divide `len` elements by the world size (the end of `Avg`).
    Divide { dst: At, len: usize },
    /// Wait until `to`'s inbox for this rank is free for this call.
    AwaitReady { to: Rank },
    /// The message just written into `to`'s inbox is complete: record an
    /// event and hand it to `to`.
    Post { to: Rank },
    /// Wait for the next message from `from`.
    Await { from: Rank },
    /// Peer-direct reduction of this rank's chunk: reads `len` elements at
    /// element offset `input` of *every* rank's input (its send buffer,
    /// which an in-place call passes as its one buffer: ranks choose in
    /// place each for themselves), folds them in the ring's order for the
    /// chunk this rank owns (`rank+1, rank+2, …, rank`: `acc = x ⊕ acc`),
    /// divides by the world size when `divide` (`Avg`), and writes the
    /// result at element offset `output` of every rank's output (receive
    /// buffer; `to_all`, all-reduce) or of this rank's only
    /// (reduce-scatter).
    ReducePeers {
        input: usize,
        output: usize,
        len: usize,
        to_all: bool,
        divide: bool,
    },
    /// Peer-direct all-gather: copies `len` elements at `src` of this rank
    /// to `dst` of every other rank's buffer, and of this rank's own when
    /// `include_self`.
    CopyToPeers {
        src: At,
        dst: At,
        len: usize,
        include_self: bool,
    },
}

/// A lowered plan: the operations, and the inbox sizes they need.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Lowered {
    /// In stream order.
    pub ops: Vec<DevOp>,
    /// Elements this rank receives from each peer in the call (its inbox
    /// sizes).
    pub incoming: Vec<usize>,
    /// Whether this rank receives any message (even an empty one) from each
    /// peer in the call: the peers it publishes a ready to.
    pub receives_from: Vec<bool>,
    /// Elements this rank sends to each peer (the peers' inbox sizes for it).
    pub outgoing: Vec<usize>,
    /// Each message's length (elements) to each peer, and from each peer,
    /// in order: a matching call on the other side must cut its messages
    /// alike, not just agree on the totals (10 then 20 elements sent
    /// against 20 then 10 received would split one message across two),
    /// see [`layout_digest`].
    pub outgoing_lens: Vec<Vec<usize>>,
    pub incoming_lens: Vec<Vec<usize>>,
    /// Elements of scratch the plan uses.
    pub scratch_len: usize,
    /// For a peer-direct call, what every rank's matching call must agree
    /// on: ranks read and write each other's buffers by these counts, so a
    /// rank checks each peer's (carried by its ready) before touching them.
    /// `None` for the ring, whose inbox sizes are checked instead.
    pub peer_direct: Option<PeerDirectCall>,
}

/// What the ranks of a peer-direct call must agree on (see
/// [`Lowered::peer_direct`]); the in-place choice may differ per rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerDirectCall {
    pub op: OpKind,
    pub dtype: DType,
    pub count: usize,
    pub root: Option<Rank>,
    /// Each rank folds its own chunk with its own operator: ranks that
    /// disagree would leave chunks reduced differently.
    pub reduce_op: Option<ReduceOp>,
}

/// A digest of a sequence of message sizes (`lens` elements of `elem`
/// bytes each): what a sender and a receiver compare, through the ready,
/// before any message of the call moves (see [`Lowered::outgoing_lens`]).
/// FNV-1a over each message's byte count.
pub(crate) fn layout_digest(lens: &[usize], elem: usize) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &len in lens {
        for byte in ((len as u64).wrapping_mul(elem as u64)).to_le_bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    (hash ^ (hash >> 32)) as u32
}

fn at(span: Span) -> At {
    At {
        mem: Mem::Buf(span.buf),
        offset: span.offset,
    }
}

/// Lowers `plan` for a rank of a `world`-rank call.
pub(crate) fn lower(plan: &Plan, world: usize) -> Lowered {
    let mut out = Lowered {
        ops: Vec::with_capacity(plan.steps.len() * 2),
        incoming: vec![0; world],
        receives_from: vec![false; world],
        outgoing: vec![0; world],
        outgoing_lens: vec![Vec::new(); world],
        incoming_lens: vec![Vec::new(); world],
        scratch_len: plan.scratch_len,
        peer_direct: None,
    };
    let mut readied = vec![false; world];
    // Cursors are the running totals themselves. Zero-length messages
    // (barriers) write no inbox but still await the ready: see the module
    // comment.
    let mut send_to = |out: &mut Lowered, to: Rank, len: usize| -> At {
        if !readied[to] {
            readied[to] = true;
            out.ops.push(DevOp::AwaitReady { to });
        }
        let dst = At {
            mem: Mem::Outbox(to),
            offset: out.outgoing[to],
        };
        out.outgoing[to] += len;
        out.outgoing_lens[to].push(len);
        dst
    };
    let recv_from = |out: &mut Lowered, from: Rank, len: usize| -> At {
        out.ops.push(DevOp::Await { from });
        out.receives_from[from] = true;
        let src = At {
            mem: Mem::Inbox(from),
            offset: out.incoming[from],
        };
        out.incoming[from] += len;
        out.incoming_lens[from].push(len);
        src
    };
    for step in &plan.steps {
        match *step {
            Step::Send { peer, src } => {
                let dst = send_to(&mut out, peer, src.len);
                out.ops.push(DevOp::Copy {
                    src: at(src),
                    dst,
                    len: src.len,
                });
                out.ops.push(DevOp::Post { to: peer });
            }
            Step::Recv { peer, dst } => {
                let src = recv_from(&mut out, peer, dst.len);
                out.ops.push(DevOp::Copy {
                    src,
                    dst: at(dst),
                    len: dst.len,
                });
            }
            Step::RecvReduce { peer, local, dst } => {
                let incoming = recv_from(&mut out, peer, dst.len);
                out.ops.push(DevOp::Combine {
                    dst: at(dst),
                    a: at(local),
                    b: incoming,
                    len: dst.len,
                });
            }
            Step::RecvReduceSend { from, to, local } => {
                let incoming = recv_from(&mut out, from, local.len);
                let dst = send_to(&mut out, to, local.len);
                out.ops.push(DevOp::Combine {
                    dst,
                    a: at(local),
                    b: incoming,
                    len: local.len,
                });
                out.ops.push(DevOp::Post { to });
            }
            Step::RecvCopySend { from, to, dst } => {
                let incoming = recv_from(&mut out, from, dst.len);
                out.ops.push(DevOp::Copy {
                    src: incoming,
                    dst: at(dst),
                    len: dst.len,
                });
                let forward = send_to(&mut out, to, dst.len);
                out.ops.push(DevOp::Copy {
                    src: incoming,
                    dst: forward,
                    len: dst.len,
                });
                out.ops.push(DevOp::Post { to });
            }
            Step::Copy { src, dst } => out.ops.push(DevOp::Copy {
                src: at(src),
                dst: at(dst),
                len: src.len,
            }),
            Step::ReduceLocal { src, dst } => out.ops.push(DevOp::Combine {
                dst: at(dst),
                a: at(dst),
                b: at(src),
                len: dst.len,
            }),
            Step::DivideByWorld { span } => out.ops.push(DevOp::Divide {
                dst: at(span),
                len: span.len,
            }),
        }
    }
    out
}

/// The largest world the peer-direct lowering serves: the reduction
/// kernel takes every rank's address by value (`MAX_PEERS` in
/// `kernels.cu`).
pub(crate) const PEER_DIRECT_MAX_WORLD: usize = 8;

/// The *peer-direct* form of all-reduce, reduce-scatter, all-gather and
/// broadcast, for
/// ranks that can address each other's buffers (threads of one process on
/// one GPU, or on GPUs with peer access): no inboxes, no staging copies.
///
/// Rank `r` owns chunk `r` of the ring's [`ChunkLayout`] and folds it from
/// every rank's input in the ring's order, so the bits are the ring's
/// (all-reduce, reduce-scatter); all-gather copies this rank's part into
/// every output, broadcast the root's input (see
/// [`peer_direct_broadcast`], whose ops differ from the rest below). Per rank, an all-reduce reads `M` and writes `M` bytes,
/// where the ring's staging reads `2.5·M` and writes `2·M` (two ranks).
///
/// The ops, identical on every rank: await every peer's *ready* (its stream
/// has reached the call: its input is final, its output no longer used by
/// earlier work), the one kernel or the copies, then post an empty message
/// to every peer ("done with your buffers") and await every peer's. A
/// rank's call therefore ends on its stream only after every peer has
/// finished reading and writing its buffers. Chunks are disjoint, so ranks
/// never touch the same elements (in place included: a rank reads and
/// writes only its own chunk of each buffer).
///
/// `None` for other operations, one rank, or more than
/// [`PEER_DIRECT_MAX_WORLD`] ranks: those run the ring.
pub(crate) fn lower_peer_direct(desc: &CollectiveDesc) -> Option<Lowered> {
    let (rank, world) = (desc.rank, desc.world_size);
    if !(2..=PEER_DIRECT_MAX_WORLD).contains(&world) {
        return None;
    }
    let buf = |b: BufId, offset: usize| At {
        mem: Mem::Buf(b),
        offset,
    };
    let count = desc.count();
    let main = match desc.op {
        OpKind::AllReduce => {
            let (offset, len) = ChunkLayout::new(count, world, 1).chunk(rank);
            DevOp::ReducePeers {
                input: offset,
                output: offset,
                len,
                to_all: true,
                divide: desc.reduce_op == Some(ReduceOp::Avg),
            }
        }
        OpKind::ReduceScatter => {
            let offset = rank * count;
            DevOp::ReducePeers {
                input: offset,
                output: if desc.in_place { offset } else { 0 },
                len: count,
                to_all: false,
                divide: desc.reduce_op == Some(ReduceOp::Avg),
            }
        }
        OpKind::AllGather => DevOp::CopyToPeers {
            src: if desc.in_place {
                buf(BufId::Recv, rank * count)
            } else {
                buf(BufId::Send, 0)
            },
            dst: buf(BufId::Recv, rank * count),
            len: count,
            include_self: !desc.in_place,
        },
        OpKind::Broadcast => return Some(peer_direct_broadcast(desc)),
        _ => return None,
    };
    let peers = || (0..world).filter(move |&p| p != rank);
    let mut ops: Vec<DevOp> = peers().map(|to| DevOp::AwaitReady { to }).collect();
    ops.push(main);
    ops.extend(peers().map(|to| DevOp::Post { to }));
    ops.extend(peers().map(|from| DevOp::Await { from }));
    Some(with_empty_messages(Lowered {
        ops,
        incoming: vec![0; world],
        receives_from: (0..world).map(|p| p != rank).collect(),
        outgoing: vec![0; world],
        outgoing_lens: Vec::new(),
        incoming_lens: Vec::new(),
        scratch_len: 0,
        peer_direct: Some(peer_direct_call(desc)),
    }))
}

/// A peer-direct lowering's message lengths: every message it posts or
/// awaits is an empty "done" or "ready to go".
fn with_empty_messages(mut out: Lowered) -> Lowered {
    let world = out.incoming.len();
    out.outgoing_lens = vec![Vec::new(); world];
    out.incoming_lens = vec![Vec::new(); world];
    for op in &out.ops {
        match *op {
            DevOp::Post { to } => out.outgoing_lens[to].push(0),
            DevOp::Await { from } => out.incoming_lens[from].push(0),
            _ => {}
        }
    }
    out
}

fn peer_direct_call(desc: &CollectiveDesc) -> PeerDirectCall {
    PeerDirectCall {
        op: desc.op,
        dtype: desc.dtype,
        count: desc.count(),
        root: desc.root,
        reduce_op: desc.reduce_op,
    }
}

/// Peer-direct broadcast: the root waits for every peer's ready, copies its
/// input into every output (its own too, out of place) and posts "done";
/// the others only publish their ready to the root and await its done
/// (nobody else touches the root's buffers, so it awaits nothing after).
fn peer_direct_broadcast(desc: &CollectiveDesc) -> Lowered {
    let (rank, world, root) = (desc.rank, desc.world_size, desc.root.unwrap_or(0));
    let mut out = Lowered {
        ops: Vec::new(),
        incoming: vec![0; world],
        receives_from: vec![false; world],
        outgoing: vec![0; world],
        outgoing_lens: Vec::new(),
        incoming_lens: Vec::new(),
        scratch_len: 0,
        peer_direct: Some(peer_direct_call(desc)),
    };
    if rank != root {
        out.receives_from[root] = true;
        out.ops.push(DevOp::Await { from: root });
        return with_empty_messages(out);
    }
    let peers = || (0..world).filter(move |&p| p != rank);
    out.ops.extend(peers().map(|to| DevOp::AwaitReady { to }));
    let buf = |b: BufId| At {
        mem: Mem::Buf(b),
        offset: 0,
    };
    out.ops.push(DevOp::CopyToPeers {
        src: buf(if desc.in_place {
            BufId::Recv
        } else {
            BufId::Send
        }),
        dst: buf(BufId::Recv),
        len: desc.count(),
        include_self: !desc.in_place,
    });
    out.ops.extend(peers().map(|to| DevOp::Post { to }));
    with_empty_messages(out)
}

/// One call made of several lowered parts (a group of point-to-point
/// calls): part `i`'s buffers become [`Mem::Part`]`(i, ..)`, its inbox and
/// outbox offsets follow the earlier parts', and each peer's inbox is made
/// ready once.
pub(crate) fn concat(parts: &[Lowered]) -> Lowered {
    let world = parts.first().map_or(0, |p| p.incoming.len());
    let mut out = Lowered {
        ops: Vec::new(),
        incoming: vec![0; world],
        receives_from: vec![false; world],
        outgoing: vec![0; world],
        outgoing_lens: vec![Vec::new(); world],
        incoming_lens: vec![Vec::new(); world],
        scratch_len: parts.iter().map(|p| p.scratch_len).max().unwrap_or(0),
        peer_direct: None,
    };
    let mut readied = vec![false; world];
    for (i, part) in parts.iter().enumerate() {
        let (inbox_base, outbox_base) = (out.incoming.clone(), out.outgoing.clone());
        let place = |at: At| -> At {
            match at.mem {
                Mem::Buf(b) => At {
                    mem: Mem::Part(i, b),
                    offset: at.offset,
                },
                Mem::Inbox(p) => At {
                    mem: at.mem,
                    offset: at.offset + inbox_base[p],
                },
                Mem::Outbox(p) => At {
                    mem: at.mem,
                    offset: at.offset + outbox_base[p],
                },
                Mem::Part(..) => at,
            }
        };
        for op in &part.ops {
            out.ops.push(match *op {
                DevOp::AwaitReady { to } => {
                    if std::mem::replace(&mut readied[to], true) {
                        continue;
                    }
                    DevOp::AwaitReady { to }
                }
                DevOp::Copy { src, dst, len } => DevOp::Copy {
                    src: place(src),
                    dst: place(dst),
                    len,
                },
                DevOp::Combine { dst, a, b, len } => DevOp::Combine {
                    dst: place(dst),
                    a: place(a),
                    b: place(b),
                    len,
                },
                DevOp::Divide { dst, len } => DevOp::Divide {
                    dst: place(dst),
                    len,
                },
                // Grouped calls are point-to-point: never peer-direct.
                DevOp::ReducePeers { .. } | DevOp::CopyToPeers { .. } => {
                    unreachable!("peer-direct ops in a group")
                }
                other => other,
            });
        }
        for p in 0..world {
            out.incoming[p] += part.incoming[p];
            out.receives_from[p] |= part.receives_from[p];
            out.outgoing[p] += part.outgoing[p];
            out.outgoing_lens[p].extend_from_slice(&part.outgoing_lens[p]);
            out.incoming_lens[p].extend_from_slice(&part.incoming_lens[p]);
        }
    }
    // Every ready an op awaits must come before the first write: a part
    // that writes a peer's inbox after an earlier part readied it is fine,
    // since readies were moved to the first part that needs them.
    out
}

#[cfg(test)]
mod tests {
    //! The launch plans, run on the CPU by an interpreter that plays every
    //! rank's stream over host memory with the host's own reduction code,
    //! against the host backend itself: same inputs, same plans, and the
    //! bits must match. (The kernels' arithmetic against the host's is the
    //! GPU tests' part.)

    use std::collections::VecDeque;
    use std::time::Duration;

    use super::*;
    use crate::comm::{Algo, Communicator};
    use crate::desc::{BufDesc, CollectiveDesc, MemoryKind};
    use crate::schedule::{plan_with, Family};
    use crate::types::{Element, OpKind, ReduceOp};

    /// Each rank's memories in the interpreter.
    struct Rank_<T> {
        send: Vec<T>,
        recv: Vec<T>,
        scratch: Vec<T>,
        /// inbox[p]: what p sent this rank.
        inbox: Vec<Vec<T>>,
        pc: usize,
        /// Messages posted to this rank by each peer, not yet awaited.
        posted: Vec<usize>,
        /// Whether this rank's call is in place: its input is then `recv`
        /// (the executor passes the one buffer as both).
        in_place: bool,
    }

    /// `len` elements at `offset` of rank `p`'s input.
    fn read_input<T: Element>(ranks: &[Rank_<T>], p: usize, offset: usize, len: usize) -> Vec<T> {
        let r = &ranks[p];
        let v = if r.in_place { &r.recv } else { &r.send };
        v[offset..offset + len].to_vec()
    }

    fn read<T: Element>(ranks: &[Rank_<T>], me: usize, a: At, len: usize) -> Vec<T> {
        let r = &ranks[me];
        let v = match a.mem {
            Mem::Buf(BufId::Send) => &r.send,
            Mem::Buf(BufId::Recv) => &r.recv,
            Mem::Buf(BufId::Scratch) => &r.scratch,
            Mem::Inbox(p) => &r.inbox[p],
            Mem::Outbox(p) => &ranks[p].inbox[me],
            Mem::Part(..) => panic!("the interpreter runs single calls"),
        };
        v[a.offset..a.offset + len].to_vec()
    }

    fn write<T: Element>(ranks: &mut [Rank_<T>], me: usize, a: At, data: &[T]) {
        let v = match a.mem {
            Mem::Buf(BufId::Send) => panic!("rank {me} writes its send buffer"),
            Mem::Buf(BufId::Recv) => &mut ranks[me].recv,
            Mem::Buf(BufId::Scratch) => &mut ranks[me].scratch,
            Mem::Inbox(p) => panic!("rank {me} writes its own inbox from {p}"),
            Mem::Outbox(p) => &mut ranks[p].inbox[me],
            Mem::Part(..) => panic!("the interpreter runs single calls"),
        };
        v[a.offset..a.offset + data.len()].copy_from_slice(data);
    }

    /// Runs every rank's lowered ops until all finish; a rank blocks at an
    /// `Await` until the peer has posted. Returns each rank's receive buffer.
    fn interpret<T: Element>(
        lowered: &[Lowered],
        mut ranks: Vec<Rank_<T>>,
        op: ReduceOp,
        world: usize,
    ) -> Vec<Vec<T>> {
        // The inbox sizes each side computed must agree.
        for (r, low) in lowered.iter().enumerate() {
            for (p, sender) in lowered.iter().enumerate() {
                assert_eq!(low.incoming[p], sender.outgoing[r], "inbox {p}->{r}");
            }
            ranks[r].inbox = (0..world)
                .map(|p| vec![T::zeroed(); low.incoming[p]])
                .collect();
        }
        let mut pending: VecDeque<usize> = (0..world).collect();
        let mut stalls = 0;
        while let Some(me) = pending.pop_front() {
            let mut progressed = false;
            while ranks[me].pc < lowered[me].ops.len() {
                match lowered[me].ops[ranks[me].pc] {
                    DevOp::Await { from } => {
                        if ranks[me].posted[from] == 0 {
                            break;
                        }
                        ranks[me].posted[from] -= 1;
                    }
                    DevOp::AwaitReady { to } => assert!(
                        lowered[to].receives_from[me],
                        "rank {me} awaits a ready that rank {to} never publishes"
                    ),
                    DevOp::Post { to } => {
                        // Every message, empty ones included, follows the
                        // receiver's ready of the call.
                        assert!(
                            lowered[me].ops[..ranks[me].pc].contains(&DevOp::AwaitReady { to }),
                            "rank {me} posts to {to} before its ready"
                        );
                        ranks[to].posted[me] += 1
                    }
                    DevOp::Copy { src, dst, len } => {
                        let data = read(&ranks, me, src, len);
                        write(&mut ranks, me, dst, &data);
                    }
                    DevOp::Combine { dst, a, b, len } => {
                        let (x, y) = (read(&ranks, me, a, len), read(&ranks, me, b, len));
                        let mut out = vec![T::zeroed(); len];
                        T::combine_into(op, &mut out, &x, &y);
                        write(&mut ranks, me, dst, &out);
                    }
                    DevOp::Divide { dst, len } => {
                        let mut x = read(&ranks, me, dst, len);
                        T::divide_by(&mut x, world);
                        write(&mut ranks, me, dst, &x);
                    }
                    DevOp::ReducePeers {
                        input,
                        output,
                        len,
                        to_all,
                        divide,
                    } => {
                        for p in (0..world).filter(|&p| p != me) {
                            assert!(
                                lowered[me].ops[..ranks[me].pc]
                                    .contains(&DevOp::AwaitReady { to: p }),
                                "rank {me} reads rank {p}'s buffer before its ready"
                            );
                        }
                        // The ring's order for chunk `me`: me+1, …, me.
                        let mut acc = read_input(&ranks, (me + 1) % world, input, len);
                        for k in 2..=world {
                            let x = read_input(&ranks, (me + k) % world, input, len);
                            let mut out = vec![T::zeroed(); len];
                            T::combine_into(op, &mut out, &x, &acc);
                            acc = out;
                        }
                        if divide {
                            T::divide_by(&mut acc, world);
                        }
                        let targets: Vec<usize> = if to_all {
                            (0..world).collect()
                        } else {
                            vec![me]
                        };
                        let output = At {
                            mem: Mem::Buf(BufId::Recv),
                            offset: output,
                        };
                        for p in targets {
                            write(&mut ranks, p, output, &acc);
                        }
                    }
                    DevOp::CopyToPeers {
                        src,
                        dst,
                        len,
                        include_self,
                    } => {
                        let data = read(&ranks, me, src, len);
                        for p in (0..world).filter(|&p| include_self || p != me) {
                            write(&mut ranks, p, dst, &data);
                        }
                    }
                }
                ranks[me].pc += 1;
                progressed = true;
            }
            if ranks[me].pc < lowered[me].ops.len() {
                pending.push_back(me);
                stalls = if progressed { 0 } else { stalls + 1 };
                assert!(stalls <= world, "deadlock: every rank awaits a message");
            }
        }
        for r in &ranks {
            assert!(
                r.posted.iter().all(|&n| n == 0),
                "a message was never received"
            );
        }
        ranks.into_iter().map(|r| r.recv).collect()
    }

    /// Inputs with varied bits (and some negative values for the signed
    /// types). Floats get fractions no binary format holds exactly, so
    /// their sums depend on the order of the fold: a plan that reduces in
    /// another order than the host's fails the comparison.
    fn input<T: Element>(rank: usize, len: usize) -> Vec<T> {
        (0..len)
            .map(|i| {
                let whole = ((rank * 131 + i * 17) % 23) as i64 - 7;
                match T::DTYPE.is_float() {
                    true => T::from_f64(whole as f64 + (rank as f64 + 1.0) / 3.0),
                    false => T::from_i64_wrapping(whole),
                }
            })
            .collect()
    }

    #[derive(Clone, Copy, Debug)]
    struct Case {
        op: OpKind,
        reduce: Option<ReduceOp>,
        root: Option<usize>,
        in_place: bool,
        /// Odd ranks take the other placement (NCCL lets each rank choose).
        mixed: bool,
        count: usize,
    }

    /// Whether rank `r` calls in place.
    fn placed(case: &Case, r: usize) -> bool {
        case.in_place != (case.mixed && r % 2 == 1)
    }

    /// (send, recv) lengths of rank `r`'s call.
    fn lens(case: &Case, r: usize, world: usize) -> (usize, usize) {
        let c = case.count;
        match (case.op, placed(case, r)) {
            (OpKind::ReduceScatter, false) => (c * world, c),
            (OpKind::AllGather, false) => (c, c * world),
            (OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll, true) => {
                (c * world, c * world)
            }
            (OpKind::AllToAll, false) => (c * world, c * world),
            _ => (c, c),
        }
    }

    /// The host backend with the ring schedules, on threads: the reference.
    fn host_results<T: Element>(case: Case, world: usize, chunk: usize) -> Vec<Vec<T>> {
        let comms = Communicator::builder()
            .timeout(Duration::from_secs(20))
            .chunk_bytes(chunk)
            .algo(Algo::Ring)
            .local_group(world)
            .unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                std::thread::spawn(move || {
                    let r = comm.rank();
                    let (send_len, recv_len) = lens(&case, r, world);
                    let send = input::<T>(r, send_len);
                    let mut recv = if placed(&case, r) {
                        input::<T>(r, recv_len)
                    } else {
                        vec![T::zeroed(); recv_len]
                    };
                    // The cuda-ring sums and then divides an Avg for every
                    // type; the host premultiplies an f16 Avg (as NCCL), so
                    // its reference here is its Sum, divided once below.
                    let requested = case.reduce.unwrap_or(ReduceOp::Sum);
                    let divide_after = requested == ReduceOp::Avg && T::AVG_PREMULTIPLIES;
                    let op = if divide_after {
                        ReduceOp::Sum
                    } else {
                        requested
                    };
                    let root = case.root.unwrap_or(0);
                    match (case.op, placed(&case, r)) {
                        (OpKind::AllReduce, false) => comm.all_reduce(&send, &mut recv, op),
                        (OpKind::AllReduce, true) => comm.all_reduce_in_place(&mut recv, op),
                        (OpKind::ReduceScatter, false) => comm.reduce_scatter(&send, &mut recv, op),
                        (OpKind::ReduceScatter, true) => {
                            comm.reduce_scatter_in_place(&mut recv, op)
                        }
                        (OpKind::AllGather, false) => comm.all_gather(&send, &mut recv),
                        (OpKind::AllGather, true) => {
                            // This rank's block is already in place.
                            comm.all_gather_in_place(&mut recv)
                        }
                        (OpKind::Broadcast, false) => comm.broadcast(&send, &mut recv, root),
                        (OpKind::Broadcast, true) => comm.broadcast_in_place(&mut recv, root),
                        (OpKind::Reduce, false) => comm.reduce(&send, &mut recv, op, root),
                        (OpKind::Reduce, true) => comm.reduce_in_place(&mut recv, op, root),
                        (OpKind::AllToAll, _) => comm.all_to_all(&send, &mut recv),
                        _ => unreachable!(),
                    }
                    .unwrap();
                    if divide_after {
                        T::divide_by(&mut recv, world);
                    }
                    recv
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn lowered_results<T: Element>(
        case: Case,
        world: usize,
        chunk: usize,
        peer_direct: bool,
    ) -> Vec<Vec<T>> {
        let host = |len| BufDesc {
            len,
            memory: MemoryKind::Host,
        };
        let mut lowered = Vec::new();
        let mut ranks = Vec::new();
        for r in 0..world {
            let (send_len, recv_len) = lens(&case, r, world);
            let mut desc = CollectiveDesc::new(case.op, T::DTYPE, r, world, MemoryKind::Host);
            desc = if placed(&case, r) {
                desc.with_in_place(host(recv_len))
            } else {
                desc.with_send(host(send_len)).with_recv(host(recv_len))
            };
            if let Some(op) = case.reduce {
                desc = desc.with_reduce_op(op);
            }
            if let Some(root) = case.root {
                desc = desc.with_root(root);
            }
            desc.validate().unwrap();
            let direct = peer_direct.then(|| lower_peer_direct(&desc)).flatten();
            assert_eq!(
                direct.is_some(),
                peer_direct
                    && world <= PEER_DIRECT_MAX_WORLD
                    && matches!(
                        case.op,
                        OpKind::AllReduce
                            | OpKind::ReduceScatter
                            | OpKind::AllGather
                            | OpKind::Broadcast
                    ),
                "{case:?}"
            );
            let low =
                direct.unwrap_or_else(|| lower(&plan_with(&desc, chunk, Family::Ring), world));
            ranks.push(Rank_ {
                send: input::<T>(r, send_len),
                recv: if placed(&case, r) {
                    input::<T>(r, recv_len)
                } else {
                    vec![T::zeroed(); recv_len]
                },
                scratch: vec![T::zeroed(); low.scratch_len],
                inbox: Vec::new(),
                pc: 0,
                posted: vec![0; world],
                in_place: placed(&case, r),
            });
            lowered.push(low);
        }
        // What the ring checks through each ready before a message moves:
        // every pair cuts its messages alike (else a false `Mismatch`),
        // and peer-direct ranks agree on their call.
        for (from, sender) in lowered.iter().enumerate() {
            for (to, receiver) in lowered.iter().enumerate() {
                assert_eq!(
                    sender.outgoing_lens[to], receiver.incoming_lens[from],
                    "{case:?}: messages {from} -> {to}"
                );
                assert_eq!(sender.peer_direct, receiver.peer_direct, "{case:?}");
            }
        }
        interpret(
            &lowered,
            ranks,
            case.reduce.unwrap_or(ReduceOp::Sum).combining(),
            world,
        )
    }

    fn cases(world: usize) -> Vec<Case> {
        let mut out = Vec::new();
        for count in [0, 1, world + 1, 1000] {
            // Odd ranks in place while even ones are not: the third pair.
            for (in_place, mixed) in [(false, false), (true, false), (false, true)] {
                for reduce in ReduceOp::ALL {
                    out.push(Case {
                        op: OpKind::AllReduce,
                        reduce: Some(reduce),
                        root: None,
                        in_place,
                        mixed,
                        count,
                    });
                    out.push(Case {
                        op: OpKind::ReduceScatter,
                        reduce: Some(reduce),
                        root: None,
                        in_place,
                        mixed,
                        count,
                    });
                    out.push(Case {
                        op: OpKind::Reduce,
                        reduce: Some(reduce),
                        root: Some(world - 1),
                        in_place,
                        mixed,
                        count,
                    });
                }
                out.push(Case {
                    op: OpKind::AllGather,
                    reduce: None,
                    root: None,
                    in_place,
                    mixed,
                    count,
                });
                out.push(Case {
                    op: OpKind::Broadcast,
                    reduce: None,
                    root: Some(world / 2),
                    in_place,
                    mixed,
                    count,
                });
            }
            out.push(Case {
                op: OpKind::AllToAll,
                reduce: None,
                root: None,
                in_place: false,
                mixed: false,
                count,
            });
        }
        out
    }

    fn compare<T: Element>(world: usize, chunk: usize, peer_direct: bool) {
        for case in cases(world) {
            let host = host_results::<T>(case, world, chunk);
            let gpu = lowered_results::<T>(case, world, chunk, peer_direct);
            for r in 0..world {
                // Off the root, reduce's output is unspecified; in-place
                // reduce-scatter leaves the other blocks unspecified.
                let (h, g) = match case.op {
                    OpKind::Reduce if Some(r) != case.root => continue,
                    OpKind::ReduceScatter if placed(&case, r) => {
                        let c = case.count;
                        (&host[r][r * c..(r + 1) * c], &gpu[r][r * c..(r + 1) * c])
                    }
                    _ => (&host[r][..], &gpu[r][..]),
                };
                let hb: &[u8] = bytemuck::cast_slice(h);
                let gb: &[u8] = bytemuck::cast_slice(g);
                assert!(hb == gb, "{} world {world} rank {r} {case:?}", T::DTYPE);
            }
        }
    }

    #[test]
    fn launch_plans_give_the_host_backends_bits() {
        for world in [2, 3, 4] {
            compare::<f32>(world, 64, false);
            compare::<crate::bf16>(world, 256 * 1024, false);
        }
        compare::<i8>(3, 16, false);
        compare::<f64>(5, 1 << 20, false);
    }

    /// The peer-direct all-reduce, reduce-scatter, all-gather and broadcast give the
    /// ring's bits (host `Algo::Ring`, with any piece size: the reduction
    /// order depends on the chunks only).
    #[test]
    fn peer_direct_plans_give_the_rings_bits() {
        for world in [2, 3, 4] {
            compare::<f32>(world, 64, true);
            compare::<crate::f16>(world, 1 << 20, true);
        }
        compare::<i8>(3, 16, true);
        compare::<f64>(5, 1 << 20, true);
        compare::<crate::bf16>(8, 1 << 20, true);
        // Past the kernel's pointer arrays: the ring.
        compare::<f32>(9, 1 << 20, true);
    }

    #[test]
    fn peer_direct_all_reduce_is_one_kernel_between_readies_and_done_messages() {
        let desc = CollectiveDesc::new(
            OpKind::AllReduce,
            crate::DType::F32,
            1,
            3,
            MemoryKind::Device,
        )
        .with_in_place(BufDesc {
            len: 10,
            memory: MemoryKind::Device,
        })
        .with_reduce_op(ReduceOp::Avg);
        let low = lower_peer_direct(&desc).unwrap();
        assert_eq!(
            low.ops,
            vec![
                DevOp::AwaitReady { to: 0 },
                DevOp::AwaitReady { to: 2 },
                DevOp::ReducePeers {
                    input: 4,
                    output: 4,
                    len: 3,
                    to_all: true,
                    divide: true,
                },
                DevOp::Post { to: 0 },
                DevOp::Post { to: 2 },
                DevOp::Await { from: 0 },
                DevOp::Await { from: 2 },
            ]
        );
        assert_eq!(low.receives_from, vec![true, false, true]);
        assert_eq!((low.incoming, low.outgoing), (vec![0; 3], vec![0; 3]));
        // One empty "done" each way with each peer.
        assert_eq!(low.outgoing_lens, vec![vec![0], vec![], vec![0]]);
        assert_eq!(low.incoming_lens, vec![vec![0], vec![], vec![0]]);
        // What the peers' readies must match before any buffer is touched.
        assert_eq!(
            low.peer_direct,
            Some(PeerDirectCall {
                op: OpKind::AllReduce,
                dtype: crate::DType::F32,
                count: 10,
                root: None,
                reduce_op: Some(ReduceOp::Avg),
            })
        );
    }

    /// Grouped point-to-point calls: a sender's parts against a receiver's
    /// must agree message by message, not only in their totals.
    #[test]
    fn grouped_messages_of_other_sizes_have_another_layout() {
        let part = |step: Step| {
            lower(
                &Plan {
                    steps: vec![step],
                    scratch_len: 0,
                },
                2,
            )
        };
        let send = |len| {
            part(Step::Send {
                peer: 1,
                src: Span {
                    buf: BufId::Send,
                    offset: 0,
                    len,
                },
            })
        };
        let recv = |len| {
            part(Step::Recv {
                peer: 0,
                dst: Span {
                    buf: BufId::Recv,
                    offset: 0,
                    len,
                },
            })
        };
        let sent = concat(&[send(10), send(20)]);
        assert_eq!(sent.outgoing_lens[1], [10, 20]);
        let in_order = concat(&[recv(10), recv(20)]);
        let swapped = concat(&[recv(20), recv(10)]);
        assert_eq!(in_order.incoming_lens[0], [10, 20]);
        // Equal totals and counts: what the ready compared before.
        assert_eq!(sent.outgoing[1], swapped.incoming[0]);
        let digest = |lens: &[usize]| layout_digest(lens, 4);
        assert_eq!(
            digest(&sent.outgoing_lens[1]),
            digest(&in_order.incoming_lens[0])
        );
        assert_ne!(
            digest(&sent.outgoing_lens[1]),
            digest(&swapped.incoming_lens[0])
        );
        // Sizes count in bytes: 10 f32 pair with 20 f16.
        assert_eq!(layout_digest(&[10], 4), layout_digest(&[20], 2));
        assert_ne!(layout_digest(&[10], 4), layout_digest(&[10], 2));
        // Empty messages count (a barrier's, peer-direct "done"s).
        assert_ne!(layout_digest(&[0], 4), layout_digest(&[0, 0], 4));
    }

    /// Peer-direct calls carry their reduction operator: each rank folds
    /// its own chunk with its own.
    #[test]
    fn peer_direct_calls_differ_by_reduction_operator() {
        let call = |op| {
            let desc = CollectiveDesc::new(OpKind::AllReduce, DType::F32, 0, 2, MemoryKind::Device)
                .with_reduce_op(op);
            peer_direct_call(&desc)
        };
        assert_ne!(call(ReduceOp::Sum), call(ReduceOp::Max));
        assert_eq!(call(ReduceOp::Sum), call(ReduceOp::Sum));
    }

    #[test]
    fn the_ring_all_reduce_fuses_receive_reduce_send() {
        let desc = CollectiveDesc::new(
            OpKind::AllReduce,
            crate::DType::F32,
            1,
            4,
            MemoryKind::Device,
        )
        .with_in_place(BufDesc {
            len: 4000,
            memory: MemoryKind::Device,
        })
        .with_reduce_op(ReduceOp::Sum);
        let low = lower(&plan_with(&desc, 1 << 20, Family::Ring), 4);
        // The ring sends 2(N-1)/N of the buffer to the next rank and
        // receives as much from the previous one.
        assert_eq!(low.outgoing, vec![0, 0, 6000, 0]);
        assert_eq!(low.incoming, vec![6000, 0, 0, 0]);
        // Middle reduce-scatter steps are one fused kernel writing the next
        // rank's inbox.
        let fused = low
            .ops
            .iter()
            .filter(|op| {
                matches!(
                    op,
                    DevOp::Combine {
                        dst: At {
                            mem: Mem::Outbox(2),
                            ..
                        },
                        ..
                    }
                )
            })
            .count();
        assert_eq!(fused, 2, "{:?}", low.ops);
        assert_eq!(
            low.ops
                .iter()
                .filter(|op| matches!(op, DevOp::AwaitReady { .. }))
                .count(),
            1
        );
    }
}
