//! Direct calls in two levels through one *leader* per host (its first
//! rank in the [`RingOrder`]), for ranks on hosts of unequal size
//! ([`RingOrder::host_spans`] without [`RingOrder::hosts`]); hosts of the
//! same size use the rails of [`super::two_level`] instead, which spread
//! the work over every rank.
//!
//! In one level ([`super::direct`]) every rank sends its whole buffer to
//! every rank of the other hosts: a host of `k` ranks puts `k·(N-k)`
//! copies on its link. Here the host's ranks meet at their leader, the
//! leaders exchange what crosses (each host's sum once per other host:
//! `(H-1)·M` of an all-reduce of `M` bytes on each link), and each leader
//! hands the result back to its host. Three steps where one level takes
//! one; the leaders fold and forward the host's whole traffic, which for
//! the small calls the direct family runs costs less than what it saves.
//!
//! Each element is folded host by host, each host's terms in the order's
//! order and then the host sums in host order, alike in all-reduce,
//! reduce-scatter and reduce, as on hosts of the same size: all-reduce is
//! all-gather ∘ reduce-scatter bit for bit, and every rank holds the same
//! bits.

use super::{direct, BufId, Plan, RingOrder, Span, Step};
use crate::desc::CollectiveDesc;
use crate::types::{OpKind, Rank, ReduceOp};

/// This rank's host and the leaders, in an order with host spans.
struct Hosts {
    /// Every host's ranks, hosts in order.
    members: Vec<Vec<Rank>>,
    /// This rank's host.
    host: usize,
}

impl Hosts {
    fn new(order: &RingOrder, rank: Rank) -> Hosts {
        let members: Vec<Vec<Rank>> = order
            .host_spans()
            .map(|span| span.map(|q| order.rank_at(q)).collect())
            .collect();
        let position = order.position_of(rank);
        let host = order
            .host_spans()
            .position(|span| span.contains(&position))
            .expect("every rank stands on a host");
        Hosts { members, host }
    }

    fn leader_of(&self, host: usize) -> Rank {
        self.members[host][0]
    }

    fn my_leader(&self) -> Rank {
        self.leader_of(self.host)
    }

    /// This rank's host's ranks, the leader first.
    fn mine(&self) -> &[Rank] {
        &self.members[self.host]
    }

    /// The leaders, in host order.
    fn leaders(&self) -> impl Iterator<Item = Rank> + '_ {
        (0..self.members.len()).map(|h| self.leader_of(h))
    }

    /// The other hosts' leaders.
    fn other_leaders(&self) -> impl Iterator<Item = Rank> + '_ {
        let me = self.my_leader();
        self.leaders().filter(move |&l| l != me)
    }

    /// This rank's host mates.
    fn mates(&self, rank: Rank) -> impl Iterator<Item = Rank> + '_ {
        self.mine().iter().copied().filter(move |&m| m != rank)
    }
}

/// Leader-based all-reduce of `count` elements: the host's terms folded
/// at its leader into the output, the host sums exchanged among the
/// leaders and folded in host order, the result sent back. Scratch: at a
/// leader not first in host order, a copy of its host sum.
pub fn all_reduce(
    order: &RingOrder,
    rank: Rank,
    count: usize,
    in_place: bool,
    avg: bool,
    plan: &mut Plan,
) {
    if count == 0 {
        return;
    }
    let hosts = Hosts::new(order, rank);
    let input = Span::new(if in_place { BufId::Recv } else { BufId::Send }, 0, count);
    let out = Span::new(BufId::Recv, 0, count);
    let leader = hosts.my_leader();
    if rank != leader {
        plan.steps.push(Step::Send {
            peer: leader,
            src: input,
        });
        plan.steps.push(Step::Recv {
            peer: leader,
            dst: out,
        });
        return;
    }
    // The leader's own term is first in its host's order: folded in place
    // without a copy.
    direct::fold_in_order(
        hosts.mine().iter().copied(),
        rank,
        input,
        out,
        &mut plan.steps,
    );
    for peer in hosts.other_leaders() {
        plan.steps.push(Step::Send { peer, src: out });
    }
    let own = direct::keep_own(hosts.host == 0, out, out, plan);
    direct::fold_in_order(hosts.leaders(), rank, own, out, &mut plan.steps);
    if avg {
        plan.steps.push(Step::DivideByWorld { span: out });
    }
    for peer in hosts.mates(rank) {
        plan.steps.push(Step::Send { peer, src: out });
    }
}

/// Leader-based reduce-scatter, `recv_count` elements per rank: the
/// host's whole inputs folded at its leader into scratch, each host's
/// blocks' sums sent to that host's leader, which folds them in host order
/// and sends each of its ranks its block. Scratch at a leader: the host
/// sum of every block (none when it is alone on its host), then room for
/// one block.
pub fn reduce_scatter(
    order: &RingOrder,
    rank: Rank,
    recv_count: usize,
    in_place: bool,
    avg: bool,
    plan: &mut Plan,
) {
    if recv_count == 0 {
        return;
    }
    let hosts = Hosts::new(order, rank);
    let world = hosts.members.iter().map(Vec::len).sum::<usize>();
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    let output = if in_place {
        Span::new(BufId::Recv, rank * recv_count, recv_count)
    } else {
        Span::new(BufId::Recv, 0, recv_count)
    };
    let leader = hosts.my_leader();
    if rank != leader {
        plan.steps.push(Step::Send {
            peer: leader,
            src: Span::new(input_buf, 0, world * recv_count),
        });
        plan.steps.push(Step::Recv {
            peer: leader,
            dst: output,
        });
        return;
    }
    // 1. The host's sum of every block, in scratch; a leader alone on its
    //    host has it in its input already.
    let alone = hosts.mine().len() == 1;
    let sums_buf = if alone { input_buf } else { BufId::Scratch };
    let sums = |block: Rank| Span::new(sums_buf, block * recv_count, recv_count);
    let spare_at = if alone { 0 } else { world * recv_count };
    let spare = Span::new(BufId::Scratch, spare_at, recv_count);
    plan.scratch_len = plan.scratch_len.max(spare_at + recv_count);
    if !alone {
        let everything = Span::new(BufId::Scratch, 0, world * recv_count);
        let input = Span::new(input_buf, 0, world * recv_count);
        direct::fold_in_order(
            hosts.mine().iter().copied(),
            rank,
            input,
            everything,
            &mut plan.steps,
        );
    }
    // 2. Each other host's blocks to its leader; this host's folded here.
    for (h, members) in hosts.members.iter().enumerate() {
        if h == hosts.host {
            continue;
        }
        for &block in members {
            plan.steps.push(Step::Send {
                peer: hosts.leader_of(h),
                src: sums(block),
            });
        }
    }
    for &block in hosts.mine() {
        // This host's sum, kept where the fold cannot overwrite it first.
        let own = if hosts.host == 0 {
            sums(block)
        } else {
            plan.steps.push(Step::Copy {
                src: sums(block),
                dst: spare,
            });
            spare
        };
        let dst = if block == rank { output } else { sums(block) };
        direct::fold_in_order(hosts.leaders(), rank, own, dst, &mut plan.steps);
        if avg {
            plan.steps.push(Step::DivideByWorld { span: dst });
        }
        // 3. Each of the host's other ranks gets its block.
        if block != rank {
            plan.steps.push(Step::Send {
                peer: block,
                src: dst,
            });
        }
    }
}

/// Leader-based all-gather, `send_count` elements per rank: the host's
/// blocks gathered at its leader, exchanged among the leaders, and the
/// whole output sent to each of the host's ranks.
pub fn all_gather(
    order: &RingOrder,
    rank: Rank,
    send_count: usize,
    in_place: bool,
    plan: &mut Plan,
) {
    if send_count == 0 {
        return;
    }
    let hosts = Hosts::new(order, rank);
    let world = hosts.members.iter().map(Vec::len).sum::<usize>();
    let block = |r: Rank| Span::new(BufId::Recv, r * send_count, send_count);
    let whole = Span::new(BufId::Recv, 0, world * send_count);
    let own = if in_place {
        block(rank)
    } else {
        Span::new(BufId::Send, 0, send_count)
    };
    let leader = hosts.my_leader();
    if rank != leader {
        plan.steps.push(Step::Send {
            peer: leader,
            src: own,
        });
        // The leader sends every block, this rank's own among them.
        plan.steps.push(Step::Recv {
            peer: leader,
            dst: whole,
        });
        return;
    }
    if !in_place {
        plan.steps.push(Step::Copy {
            src: own,
            dst: block(rank),
        });
    }
    for mate in hosts.mates(rank) {
        plan.steps.push(Step::Recv {
            peer: mate,
            dst: block(mate),
        });
    }
    for peer in hosts.other_leaders() {
        for &r in hosts.mine() {
            plan.steps.push(Step::Send {
                peer,
                src: block(r),
            });
        }
    }
    for (h, members) in hosts.members.iter().enumerate() {
        if h != hosts.host {
            for &r in members {
                plan.steps.push(Step::Recv {
                    peer: hosts.leader_of(h),
                    dst: block(r),
                });
            }
        }
    }
    for peer in hosts.mates(rank) {
        plan.steps.push(Step::Send { peer, src: whole });
    }
}

/// Leader-based broadcast of `count` elements from `root`: the root sends
/// to its host mates and to the other hosts' leaders, which pass it on to
/// their hosts.
pub fn broadcast(
    order: &RingOrder,
    rank: Rank,
    root: Rank,
    count: usize,
    in_place: bool,
    plan: &mut Plan,
) {
    if count == 0 {
        return;
    }
    let hosts = Hosts::new(order, rank);
    let out = Span::new(BufId::Recv, 0, count);
    let root_host = hosts
        .members
        .iter()
        .position(|m| m.contains(&root))
        .expect("the root stands on a host");
    if rank == root {
        let src = if in_place {
            out
        } else {
            Span::new(BufId::Send, 0, count)
        };
        let leaders = (0..hosts.members.len())
            .filter(|&h| h != root_host)
            .map(|h| hosts.leader_of(h));
        for peer in leaders.chain(hosts.mates(rank)) {
            plan.steps.push(Step::Send { peer, src });
        }
        if !in_place {
            plan.steps.push(Step::Copy { src, dst: out });
        }
        return;
    }
    let relay = if hosts.host == root_host {
        root
    } else {
        hosts.my_leader()
    };
    if rank == relay {
        plan.steps.push(Step::Recv {
            peer: root,
            dst: out,
        });
        for peer in hosts.mates(rank) {
            plan.steps.push(Step::Send { peer, src: out });
        }
    } else {
        plan.steps.push(Step::Recv {
            peer: relay,
            dst: out,
        });
    }
}

/// Leader-based reduce of `count` elements to `root`: each host's ranks
/// send to its leader (the root, on the root's host), which folds them in
/// the host's order into scratch; the leaders send those to the root,
/// which folds them in host order. Off the root only the input is read.
#[allow(clippy::too_many_arguments)]
pub fn reduce(
    order: &RingOrder,
    rank: Rank,
    root: Rank,
    count: usize,
    in_place: bool,
    avg: bool,
    plan: &mut Plan,
) {
    if count == 0 {
        return;
    }
    let hosts = Hosts::new(order, rank);
    let input = Span::new(if in_place { BufId::Recv } else { BufId::Send }, 0, count);
    let root_host = hosts
        .members
        .iter()
        .position(|m| m.contains(&root))
        .expect("the root stands on a host");
    let relay_of = |h: usize| {
        if h == root_host {
            root
        } else {
            hosts.leader_of(h)
        }
    };
    let relay = relay_of(hosts.host);
    if rank != relay {
        plan.steps.push(Step::Send {
            peer: relay,
            src: input,
        });
        return;
    }
    let host_sum = Span::new(BufId::Scratch, 0, count);
    plan.scratch_len = plan.scratch_len.max(count);
    direct::fold_in_order(
        hosts.mine().iter().copied(),
        rank,
        input,
        host_sum,
        &mut plan.steps,
    );
    if rank != root {
        plan.steps.push(Step::Send {
            peer: root,
            src: host_sum,
        });
        return;
    }
    let relays = (0..hosts.members.len()).map(relay_of);
    let dst = Span::new(BufId::Recv, 0, count);
    direct::fold_in_order(relays, rank, host_sum, dst, &mut plan.steps);
    if avg {
        plan.steps.push(Step::DivideByWorld { span: dst });
    }
}

/// The leader-based plan of `desc` (all-reduce, reduce-scatter,
/// all-gather, broadcast, reduce), `None` for other operations. `desc`'s
/// world must be `order`'s, with [`RingOrder::host_spans`].
pub fn plan(desc: &CollectiveDesc, order: &RingOrder) -> Option<Plan> {
    let (rank, count, in_place) = (desc.rank, desc.count(), desc.in_place);
    let avg = desc.reduce_op == Some(ReduceOp::Avg);
    let root = desc.root.unwrap_or(0);
    let mut plan = Plan::default();
    match desc.op {
        OpKind::AllReduce => all_reduce(order, rank, count, in_place, avg, &mut plan),
        OpKind::ReduceScatter => reduce_scatter(order, rank, count, in_place, avg, &mut plan),
        OpKind::AllGather => all_gather(order, rank, count, in_place, &mut plan),
        OpKind::Broadcast => broadcast(order, rank, root, count, in_place, &mut plan),
        OpKind::Reduce => reduce(order, rank, root, count, in_place, avg, &mut plan),
        _ => return None,
    }
    Some(plan)
}
