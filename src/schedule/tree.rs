//! Rooted and point-to-point schedules: pipelined chains for broadcast and
//! reduce, pairwise exchange for all-to-all, dissemination barrier.
//!
//! A chain visits the ranks in ring order ([`RingOrder`](super::RingOrder))
//! starting after (reduce) or at (broadcast) the root, piece by piece, so for large messages every link is
//! busy at once and each rank moves the message once: bus bandwidth equals
//! link bandwidth, as for NCCL's ring broadcast.

use super::{for_each_piece, BufId, Place, Span, Step};
use crate::types::Rank;

/// Pipelined chain broadcast from `root` of `count` elements.
pub fn broadcast_chain(
    place: Place<'_>,
    root: Rank,
    count: usize,
    piece_elems: usize,
    in_place: bool,
    steps: &mut Vec<Step>,
) {
    let world = place.world();
    let position = place.steps_after(root);
    let (prev, next) = (place.after(world - 1), place.after(1));
    for_each_piece(0, count, piece_elems, |offset, len| {
        let out = Span::new(BufId::Recv, offset, len);
        if position == 0 {
            let src = if in_place {
                out
            } else {
                Span::new(BufId::Send, offset, len)
            };
            if world > 1 {
                steps.push(Step::Send { peer: next, src });
            }
            if !in_place {
                steps.push(Step::Copy { src, dst: out });
            }
        } else if position == world - 1 {
            steps.push(Step::Recv {
                peer: prev,
                dst: out,
            });
        } else {
            steps.push(Step::RecvCopySend {
                from: prev,
                to: next,
                dst: out,
            });
        }
    });
}

/// Pipelined chain reduce to `root`: partial results flow `root+1 → root+2 →
/// … → root` (places after the root's), so `root+1`'s value is the first
/// operand. Non-root buffers are
/// only read, also in place.
#[allow(clippy::too_many_arguments)]
pub fn reduce_chain(
    place: Place<'_>,
    root: Rank,
    count: usize,
    piece_elems: usize,
    in_place: bool,
    avg: bool,
    steps: &mut Vec<Step>,
) {
    let world = place.world();
    let position = (place.steps_after(root) + world - 1) % world;
    let (prev, next) = (place.after(world - 1), place.after(1));
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    for_each_piece(0, count, piece_elems, |offset, len| {
        let local = Span::new(input_buf, offset, len);
        let out = Span::new(BufId::Recv, offset, len);
        if world == 1 {
            if !in_place {
                steps.push(Step::Copy {
                    src: local,
                    dst: out,
                });
            }
        } else if position == 0 {
            steps.push(Step::Send {
                peer: next,
                src: local,
            });
        } else if position < world - 1 {
            steps.push(Step::RecvReduceSend {
                from: prev,
                to: next,
                local,
            });
        } else {
            steps.push(Step::RecvReduce {
                peer: prev,
                local,
                dst: out,
            });
            if avg {
                steps.push(Step::DivideByWorld { span: out });
            }
        }
    });
}

/// Point-to-point send of `count` elements to `peer`.
pub fn send(peer: Rank, count: usize, piece_elems: usize, steps: &mut Vec<Step>) {
    if count == 0 {
        // An empty message is still one frame: its header carries the
        // call's digest, so the receive it meets is matched (a non-empty
        // receive gets a mismatch, not a silent pass or a timeout).
        steps.push(Step::Send {
            peer,
            src: Span::new(BufId::Send, 0, 0),
        });
    }
    for_each_piece(0, count, piece_elems, |offset, len| {
        steps.push(Step::Send {
            peer,
            src: Span::new(BufId::Send, offset, len),
        });
    });
}

/// Point-to-point receive of `count` elements from `peer` (one empty frame
/// when `count` is 0, as [`send`] sends).
pub fn recv(peer: Rank, count: usize, piece_elems: usize, steps: &mut Vec<Step>) {
    if count == 0 {
        steps.push(Step::Recv {
            peer,
            dst: Span::new(BufId::Recv, 0, 0),
        });
    }
    for_each_piece(0, count, piece_elems, |offset, len| {
        steps.push(Step::Recv {
            peer,
            dst: Span::new(BufId::Recv, offset, len),
        });
    });
}

/// All-to-all of `count` elements per peer: block `p` of the input goes to
/// rank `p`, block `p` of the output comes from rank `p`. Pairwise exchange:
/// at round `k` send to `rank+k`, receive from `rank-k`.
pub fn all_to_all(
    rank: Rank,
    world: usize,
    count: usize,
    piece_elems: usize,
    steps: &mut Vec<Step>,
) {
    for_each_piece(rank * count, count, piece_elems, |offset, len| {
        steps.push(Step::Copy {
            src: Span::new(BufId::Send, offset, len),
            dst: Span::new(BufId::Recv, offset, len),
        });
    });
    for k in 1..world {
        let to = (rank + k) % world;
        let from = (rank + world - k) % world;
        for_each_piece(to * count, count, piece_elems, |offset, len| {
            steps.push(Step::Send {
                peer: to,
                src: Span::new(BufId::Send, offset, len),
            });
        });
        for_each_piece(from * count, count, piece_elems, |offset, len| {
            steps.push(Step::Recv {
                peer: from,
                dst: Span::new(BufId::Recv, offset, len),
            });
        });
    }
}

/// Dissemination barrier: `⌈log2 N⌉` rounds; in round `i` send an empty frame
/// to `rank + 2^i` and wait for one from `rank - 2^i`. No rank leaves before
/// every rank has entered.
pub fn barrier(rank: Rank, world: usize, steps: &mut Vec<Step>) {
    let empty = Span::new(BufId::Recv, 0, 0);
    let mut distance = 1;
    while distance < world {
        steps.push(Step::Send {
            peer: (rank + distance) % world,
            src: empty,
        });
        steps.push(Step::Recv {
            peer: (rank + world - distance) % world,
            dst: empty,
        });
        distance *= 2;
    }
}
