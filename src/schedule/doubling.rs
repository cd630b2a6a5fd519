//! Latency-optimal schedules for large worlds ("tree" family): recursive
//! doubling for all-reduce and all-gather, binomial trees for broadcast and
//! reduce. A call takes `⌈log2 N⌉` rounds where the direct schedules post
//! `N-1` messages per rank and the ring takes `2(N-1)` steps (when `N` is
//! no power of two, all-reduce, reduce-scatter and all-gather take
//! `⌊log2 N⌋` rounds and two hand-offs, one before and one after).
//!
//! **The power-of-two core.** With `p` the largest power of two not above
//! `N` and `rem = N - p`, ranks `2i` and `2i+1` (`i < rem`) pair up first:
//! the even one hands its part to the odd one and sits the rounds out; the
//! odd one and the ranks from `2·rem` on are the `p` *virtual* ranks of the
//! rounds (virtual `v` is rank `2v+1` for `v < rem`, else `v + rem`), and
//! virtual rank `v` stands for the consecutive ranks
//! [`first_rank(v)`, `first_rank(v+1)`). In round `k` virtual rank `v`
//! exchanges with `v ^ 2^k`.
//!
//! **Folding order.** Every combination puts the lower ranks' terms first:
//! `x_2i ⊕ x_2i+1` for a pair, then in round `k` (lower group) ⊕ (higher
//! group). So every rank of an all-reduce holds the same bits, and the
//! reduce-scatter, which runs the same rounds on the whole buffer in its
//! scratch and keeps its own block, holds each block as all-reduce does:
//! all-reduce equals all-gather ∘ reduce-scatter bit for bit within the
//! family. (Its folding order is not the direct schedules' rank order, so
//! the family is chosen by world size and buffer size alike on every rank:
//! see [`super::choose`].) Reduce folds along a binomial tree of ranks
//! counted from the root, lower first.
//!
//! A reduce-scatter moves its whole buffer in every round: the family is
//! for small messages, where rounds cost more than bytes.

use super::{BufId, Plan, Span, Step};
use crate::types::Rank;

/// The power-of-two core of a world (see the module's documentation).
#[derive(Clone, Copy, Debug)]
struct Core {
    /// The largest power of two not above `world`.
    p: usize,
    /// `world - p`: the pairs folded before the rounds.
    rem: usize,
}

impl Core {
    fn new(world: usize) -> Core {
        let world = world.max(1);
        let p = 1usize << (usize::BITS - 1 - world.leading_zeros());
        Core { p, rem: world - p }
    }

    /// The rounds among the virtual ranks.
    fn rounds(&self) -> u32 {
        self.p.trailing_zeros()
    }

    /// `rank`'s virtual rank, or `None` for a rank that sits the rounds out
    /// (the even one of a pair).
    fn virtual_of(&self, rank: Rank) -> Option<usize> {
        if rank < 2 * self.rem {
            (rank % 2 == 1).then_some(rank / 2)
        } else {
            Some(rank - self.rem)
        }
    }

    /// The rank that plays virtual rank `v`.
    fn rank_of(&self, v: usize) -> Rank {
        if v < self.rem {
            2 * v + 1
        } else {
            v + self.rem
        }
    }

    /// The first of the ranks virtual rank `v` stands for; `world` for
    /// `v = p`.
    fn first_rank(&self, v: usize) -> Rank {
        if v < self.rem {
            2 * v
        } else {
            v + self.rem
        }
    }

    /// Whether `rank` is the odd rank of a pair: it folds its partner's part
    /// in before the rounds and hands it the result after them.
    fn takes_a_partner(&self, rank: Rank) -> bool {
        rank < 2 * self.rem && rank % 2 == 1
    }
}

/// Folds `theirs` (the lower ranks' terms, arriving from `peer`) before
/// `acc` (this rank's), `theirs ⊕ acc`, into `into` (writable, apart from
/// `acc`): the higher side of a pair or a round.
fn fold_after(peer: Rank, acc: Span, into: Span, steps: &mut Vec<Step>) -> Span {
    steps.push(Step::Recv { peer, dst: into });
    steps.push(Step::ReduceLocal {
        src: acc,
        dst: into,
    });
    into
}

/// Folds `acc ⊕ theirs` (`theirs` from `peer`, the higher ranks' terms)
/// into `into`: the lower side of a round.
fn fold_before(peer: Rank, acc: Span, into: Span, steps: &mut Vec<Step>) -> Span {
    steps.push(Step::RecvReduce {
        peer,
        local: acc,
        dst: into,
    });
    into
}

/// The rounds of a recursive-doubling all-reduce of `input` (`len`
/// elements), alternating between the writable spans `a` and `b` (neither
/// overlapping `input` unless `input` is one of them). Returns where the
/// whole result lies on this rank, or `None` for a rank that sits out
/// (the caller has its partner hand it what it needs).
fn reduce_rounds(
    core: Core,
    rank: Rank,
    input: Span,
    (a, b): (Span, Span),
    steps: &mut Vec<Step>,
) -> Option<Span> {
    let other = |acc: Span| if acc == a { b } else { a };
    let Some(v) = core.virtual_of(rank) else {
        steps.push(Step::Send {
            peer: rank + 1,
            src: input,
        });
        return None;
    };
    let mut acc = input;
    if core.takes_a_partner(rank) {
        acc = fold_after(rank - 1, acc, other(acc), steps);
    }
    for k in 0..core.rounds() {
        let partner = v ^ (1 << k);
        let peer = core.rank_of(partner);
        steps.push(Step::Send { peer, src: acc });
        acc = if v < partner {
            fold_before(peer, acc, other(acc), steps)
        } else {
            fold_after(peer, acc, other(acc), steps)
        };
    }
    Some(acc)
}

/// Recursive-doubling all-reduce of `count` elements.
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
    let core = Core::new(world);
    let out = Span::new(BufId::Recv, 0, count);
    let input = if in_place {
        out
    } else {
        Span::new(BufId::Send, 0, count)
    };
    let scratch = Span::new(BufId::Scratch, 0, count);
    let steps = &mut plan.steps;
    match reduce_rounds(core, rank, input, (out, scratch), steps) {
        None => steps.push(Step::Recv {
            peer: rank + 1,
            dst: out,
        }),
        Some(acc) => {
            if acc != out {
                steps.push(Step::Copy { src: acc, dst: out });
            }
            if core.takes_a_partner(rank) {
                steps.push(Step::Send {
                    peer: rank - 1,
                    src: out,
                });
            }
        }
    }
    reserve_scratch(plan, count);
    if avg && world > 1 {
        plan.steps.push(Step::DivideByWorld { span: out });
    }
}

/// Reduce-scatter of `count` elements per rank: the all-reduce rounds on
/// the whole input, in scratch, then this rank's block (a rank that sat
/// out gets its block from its partner).
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
    let core = Core::new(world);
    let total = count * world;
    let input = Span::new(if in_place { BufId::Recv } else { BufId::Send }, 0, total);
    let own = Span::new(BufId::Recv, if in_place { rank * count } else { 0 }, count);
    let halves = (
        Span::new(BufId::Scratch, 0, total),
        Span::new(BufId::Scratch, total, total),
    );
    let block = |within: Span, r: Rank| Span::new(within.buf, within.offset + r * count, count);
    let steps = &mut plan.steps;
    match reduce_rounds(core, rank, input, halves, steps) {
        None => steps.push(Step::Recv {
            peer: rank + 1,
            dst: own,
        }),
        Some(acc) => {
            if core.takes_a_partner(rank) {
                steps.push(Step::Send {
                    peer: rank - 1,
                    src: block(acc, rank - 1),
                });
            }
            steps.push(Step::Copy {
                src: block(acc, rank),
                dst: own,
            });
        }
    }
    reserve_scratch(plan, 2 * total);
    if avg && world > 1 {
        plan.steps.push(Step::DivideByWorld { span: own });
    }
}

/// Recursive-doubling all-gather of `count` elements per rank: in round `k`
/// each virtual rank swaps the blocks of its group of `2^k` with its
/// partner's group (consecutive ranks, so one span each way).
pub fn all_gather(rank: Rank, world: usize, count: usize, in_place: bool, plan: &mut Plan) {
    if count == 0 {
        return;
    }
    let core = Core::new(world);
    let blocks =
        |first: Rank, end: Rank| Span::new(BufId::Recv, first * count, (end - first) * count);
    let own = blocks(rank, rank + 1);
    let input = if in_place {
        own
    } else {
        Span::new(BufId::Send, 0, count)
    };
    let steps = &mut plan.steps;
    let Some(v) = core.virtual_of(rank) else {
        // Hand the part over first (the partner waits for it), then take
        // every other block back, below and above this rank's.
        steps.push(Step::Send {
            peer: rank + 1,
            src: input,
        });
        if !in_place {
            steps.push(Step::Copy {
                src: input,
                dst: own,
            });
        }
        if rank > 0 {
            steps.push(Step::Recv {
                peer: rank + 1,
                dst: blocks(0, rank),
            });
        }
        steps.push(Step::Recv {
            peer: rank + 1,
            dst: blocks(rank + 1, world),
        });
        return;
    };
    if !in_place {
        steps.push(Step::Copy {
            src: input,
            dst: own,
        });
    }
    if core.takes_a_partner(rank) {
        steps.push(Step::Recv {
            peer: rank - 1,
            dst: blocks(rank - 1, rank),
        });
    }
    for k in 0..core.rounds() {
        let size = 1usize << k;
        let group = v & !(size - 1);
        let theirs = (v ^ size) & !(size - 1);
        let peer = core.rank_of(v ^ size);
        steps.push(Step::Send {
            peer,
            src: blocks(core.first_rank(group), core.first_rank(group + size)),
        });
        steps.push(Step::Recv {
            peer,
            dst: blocks(core.first_rank(theirs), core.first_rank(theirs + size)),
        });
    }
    if core.takes_a_partner(rank) {
        let partner = rank - 1;
        if partner > 0 {
            steps.push(Step::Send {
                peer: partner,
                src: blocks(0, partner),
            });
        }
        steps.push(Step::Send {
            peer: partner,
            src: blocks(rank, world),
        });
    }
}

/// The rank `v` places from `root` (ranks counted from the root, as the
/// binomial trees do).
fn from_root(v: usize, root: Rank, world: usize) -> Rank {
    (v + root) % world
}

/// Binomial-tree broadcast from `root`: counted from the root, rank `v > 0`
/// receives from `v - 2^⌊log2 v⌋`, then every rank sends to `v + 2^j` for
/// each `2^j` above `v` (the root: every power of two) while that is a rank.
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
    let v = (rank + world - root) % world;
    let out = Span::new(BufId::Recv, 0, count);
    let src = if v == 0 && !in_place {
        Span::new(BufId::Send, 0, count)
    } else {
        out
    };
    let steps = &mut plan.steps;
    let mut distance = 1;
    if v > 0 {
        let below = 1usize << (usize::BITS - 1 - v.leading_zeros());
        steps.push(Step::Recv {
            peer: from_root(v - below, root, world),
            dst: out,
        });
        distance = below << 1;
    }
    while v + distance < world {
        steps.push(Step::Send {
            peer: from_root(v + distance, root, world),
            src,
        });
        distance <<= 1;
    }
    if v == 0 && !in_place {
        steps.push(Step::Copy { src, dst: out });
    }
}

/// Binomial-tree reduce to `root`: counted from the root, rank `v` folds in
/// what `v + 2^j` sends for each `2^j` below `v`'s lowest set bit (its own
/// terms first), then sends the result to `v` minus that bit. Ranks off the
/// root fold in scratch: their output may be empty.
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
    let v = (rank + world - root) % world;
    let out = Span::new(BufId::Recv, 0, count);
    let input = if in_place {
        out
    } else {
        Span::new(BufId::Send, 0, count)
    };
    let into = if v == 0 {
        out
    } else {
        Span::new(BufId::Scratch, 0, count)
    };
    let steps = &mut plan.steps;
    let mut acc = input;
    let mut distance = 1;
    while distance < world {
        if v & distance != 0 {
            steps.push(Step::Send {
                peer: from_root(v - distance, root, world),
                src: acc,
            });
            break;
        }
        if v + distance < world {
            acc = fold_before(from_root(v + distance, root, world), acc, into, steps);
        }
        distance <<= 1;
    }
    if v == 0 {
        if acc != out {
            steps.push(Step::Copy { src: acc, dst: out });
        }
        if avg && world > 1 {
            steps.push(Step::DivideByWorld { span: out });
        }
    }
    reserve_scratch(plan, count);
}

/// Makes `plan`'s scratch at least `len` elements if a step names it (a
/// rank that sits the rounds out, or a leaf of a reduce, needs none: the
/// executor allocates it per call).
fn reserve_scratch(plan: &mut Plan, len: usize) {
    let names_scratch = |step: &Step| {
        step.spans()
            .into_iter()
            .flatten()
            .any(|span| span.buf == BufId::Scratch)
    };
    if plan.steps.iter().any(names_scratch) {
        plan.scratch_len = plan.scratch_len.max(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_core_pairs_the_first_ranks_and_numbers_the_rest() {
        let core = Core::new(6);
        assert_eq!((core.p, core.rem, core.rounds()), (4, 2, 2));
        let virtual_ranks: Vec<_> = (0..6).map(|r| core.virtual_of(r)).collect();
        assert_eq!(
            virtual_ranks,
            [None, Some(0), None, Some(1), Some(2), Some(3)]
        );
        assert_eq!(
            (0..4).map(|v| core.rank_of(v)).collect::<Vec<_>>(),
            [1, 3, 4, 5]
        );
        assert_eq!(
            (0..=4).map(|v| core.first_rank(v)).collect::<Vec<_>>(),
            [0, 2, 4, 5, 6]
        );
        let power = Core::new(8);
        assert_eq!((power.p, power.rem, power.rounds()), (8, 0, 3));
        assert!((0..8).all(|r| power.virtual_of(r) == Some(r)));
    }

    /// `⌈log2 N⌉` rounds: counted from the root, rank `v` receives in round
    /// `⌊log2 v⌋` from a rank that had the data by the round before, and
    /// the root sends once per round.
    #[test]
    fn a_binomial_broadcast_takes_log_n_rounds() {
        let world = 13;
        let round = |v: usize| (usize::BITS - 1 - v.leading_zeros()) as usize;
        for v in 1..world {
            let parent = v - (1 << round(v));
            assert!(parent == 0 || round(parent) < round(v), "rank {v}");
        }
        assert_eq!((1..world).map(round).max(), Some(3), "rounds 0 to 3: four");
        let mut plan = Plan::default();
        broadcast(0, world, 0, 5, false, &mut plan);
        let sends = plan
            .steps
            .iter()
            .filter(|s| matches!(s, Step::Send { .. }))
            .count();
        assert_eq!(sends, 4);
    }
}
