//! One-step ("direct") schedules for small messages over point-to-point
//! links: every rank sends what each peer needs straight to it, so a call
//! costs one message latency instead of the ring's `2(N-1)` steps, at the
//! price of `N-1` copies of the data per rank — the right trade up to a few
//! tens of KiB (see the table in [`super::choose`]).
//!
//! Every reduction folds the contributions **in rank order**,
//! `((x0 ⊕ x1) ⊕ x2) ⊕ …`, exactly as the shared arena does
//! ([`crate::host`]'s intra-node path), so all ranks hold the same bits,
//! all-reduce equals all-gather of reduce-scatter bit for bit, and the
//! result does not depend on whether the arena or the links carried it
//! (a ring, for larger calls, starts each chunk at another rank and may
//! round floats differently: see [`crate::types`]). Across hosts the plans
//! run in two levels instead ([`super::two_level::plan_direct`] on hosts
//! of the same size, [`super::host_leaders`] on others), folding host by
//! host.
//! In place, a rank whose own contribution is not first keeps a copy of it
//! in the plan's scratch buffer before the fold overwrites it.

use super::{BufId, Plan, Span, Step};
use crate::types::Rank;

/// Folds every rank's `len` elements into `dst` in rank order. `own` is
/// where this rank's contribution is (read before `dst` is written, or a
/// scratch copy). Contributions of other ranks arrive as frames.
fn fold_in_rank_order(rank: Rank, world: usize, own: Span, dst: Span, steps: &mut Vec<Step>) {
    fold_in_order(0..world, rank, own, dst, steps);
}

/// Folds the contributions of `members` into `dst` in the order given,
/// `((x_m0 ⊕ x_m1) ⊕ x_m2) ⊕ …`: this rank's (`me`, one of them) from
/// `own` (read before `dst` is written, or a scratch copy), every other
/// member's as one frame from it.
pub(super) fn fold_in_order(
    members: impl IntoIterator<Item = Rank>,
    me: Rank,
    own: Span,
    dst: Span,
    steps: &mut Vec<Step>,
) {
    for (index, p) in members.into_iter().enumerate() {
        match (index == 0, p == me) {
            (true, true) => {
                if own != dst {
                    steps.push(Step::Copy { src: own, dst });
                }
            }
            (true, false) => steps.push(Step::Recv { peer: p, dst }),
            (false, true) => steps.push(Step::ReduceLocal { src: own, dst }),
            (false, false) => steps.push(Step::RecvReduce {
                peer: p,
                local: dst,
                dst,
            }),
        }
    }
}

/// Sends `src` to every rank but this one.
fn send_to_others(rank: Rank, world: usize, src: Span, plan: &mut Plan) {
    for peer in (0..world).filter(|&p| p != rank) {
        plan.steps.push(Step::Send { peer, src });
    }
}

/// Where this rank's contribution is kept during a fold into `dst`: in
/// place and not first in the fold's order (`first`: it is), a scratch copy
/// at the start of scratch (recorded in the plan).
pub(super) fn keep_own(first: bool, input: Span, dst: Span, plan: &mut Plan) -> Span {
    if first
        || input.buf != dst.buf
        || input.range().end <= dst.offset
        || dst.range().end <= input.offset
    {
        return input;
    }
    let scratch = Span::new(BufId::Scratch, 0, input.len);
    plan.scratch_len = plan.scratch_len.max(input.len);
    plan.steps.push(Step::Copy {
        src: input,
        dst: scratch,
    });
    scratch
}

/// All-reduce of `count` elements: send everything to everyone, fold all.
pub fn all_reduce(
    rank: Rank,
    world: usize,
    count: usize,
    in_place: bool,
    avg: bool,
    plan: &mut Plan,
) {
    if count == 0 {
        return;
    }
    let input = Span::new(if in_place { BufId::Recv } else { BufId::Send }, 0, count);
    let dst = Span::new(BufId::Recv, 0, count);
    send_to_others(rank, world, input, plan);
    let own = keep_own(rank == 0, input, dst, plan);
    fold_in_rank_order(rank, world, own, dst, &mut plan.steps);
    if avg && world > 1 {
        plan.steps.push(Step::DivideByWorld { span: dst });
    }
}

/// Reduce-scatter of `count` elements per rank: part `p` of every input
/// goes straight to rank `p`, which folds them.
pub fn reduce_scatter(
    rank: Rank,
    world: usize,
    count: usize,
    in_place: bool,
    avg: bool,
    plan: &mut Plan,
) {
    if count == 0 {
        return;
    }
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    for p in (0..world).filter(|&p| p != rank) {
        plan.steps.push(Step::Send {
            peer: p,
            src: Span::new(input_buf, p * count, count),
        });
    }
    let input = Span::new(input_buf, rank * count, count);
    let dst = Span::new(BufId::Recv, if in_place { rank * count } else { 0 }, count);
    let own = keep_own(rank == 0, input, dst, plan);
    fold_in_rank_order(rank, world, own, dst, &mut plan.steps);
    if avg && world > 1 {
        plan.steps.push(Step::DivideByWorld { span: dst });
    }
}

/// All-gather of `count` elements per rank: everyone sends its part to
/// everyone.
pub fn all_gather(rank: Rank, world: usize, count: usize, in_place: bool, plan: &mut Plan) {
    if count == 0 {
        return;
    }
    let mine = Span::new(BufId::Recv, rank * count, count);
    let src = if in_place {
        mine
    } else {
        Span::new(BufId::Send, 0, count)
    };
    send_to_others(rank, world, src, plan);
    if !in_place {
        plan.steps.push(Step::Copy { src, dst: mine });
    }
    for p in (0..world).filter(|&p| p != rank) {
        plan.steps.push(Step::Recv {
            peer: p,
            dst: Span::new(BufId::Recv, p * count, count),
        });
    }
}

/// Broadcast of `count` elements: the root sends to every rank.
pub fn broadcast(
    rank: Rank,
    world: usize,
    root: Rank,
    count: usize,
    in_place: bool,
    plan: &mut Plan,
) {
    if count == 0 {
        return;
    }
    let out = Span::new(BufId::Recv, 0, count);
    if rank == root {
        let src = if in_place {
            out
        } else {
            Span::new(BufId::Send, 0, count)
        };
        send_to_others(rank, world, src, plan);
        if !in_place {
            plan.steps.push(Step::Copy { src, dst: out });
        }
    } else {
        plan.steps.push(Step::Recv {
            peer: root,
            dst: out,
        });
    }
}

/// Reduce of `count` elements to `root`: every rank sends to the root,
/// which folds in rank order. Non-root buffers are only read.
#[allow(clippy::too_many_arguments)]
pub fn reduce(
    rank: Rank,
    world: usize,
    root: Rank,
    count: usize,
    in_place: bool,
    avg: bool,
    plan: &mut Plan,
) {
    if count == 0 {
        return;
    }
    let input = Span::new(if in_place { BufId::Recv } else { BufId::Send }, 0, count);
    if rank != root {
        plan.steps.push(Step::Send {
            peer: root,
            src: input,
        });
        return;
    }
    let dst = Span::new(BufId::Recv, 0, count);
    let own = keep_own(rank == 0, input, dst, plan);
    fold_in_rank_order(rank, world, own, dst, &mut plan.steps);
    if avg && world > 1 {
        plan.steps.push(Step::DivideByWorld { span: dst });
    }
}
