//! Rings, and direct calls (at the end), in two levels, for ranks on
//! several hosts with the same number on each ([`RingOrder::hosts`]):
//! within each host, then across hosts along *rails*, the ranks with the
//! same place on their hosts (as NCCL's and Horovod's hierarchical
//! all-reduce).
//!
//! With `H` hosts of `k` ranks, `N = H·k`: the one ring in host order sends
//! `2(N-1)/N · M` bytes of an all-reduce of `M` bytes over each host's
//! network link; the rails send `k` streams of `2(H-1)/H · M/k`, together
//! `2(H-1)/H · M`: with two hosts `M` instead of `(2 - 2/N) · M`. A rank
//! takes as many steps per piece as in the one ring (`H` passes of `k-1`
//! each way within the host and `H-1` each way along the rail:
//! `2H(k-1) + 2(H-1) = 2(N-1)`), only `2(H-1)` of them across hosts.
//!
//! Chunks are the one ring's: the buffer is cut into `N` chunks, chunk `r`
//! rank `r`'s (a reduce-scatter's output is still block `rank`), each into
//! the same pieces. Write `R(h, l)` for the `l`-th rank of host `h`
//! (position `h·k + l` of the order). For each piece:
//!
//! 1. Within the host, `H` ring reduce-scatters: pass `h'` reduces the
//!    chunks of host `h'`'s ranks over this host's ranks, and `R(h, l)` ends
//!    with the host's partial sum of chunk `R(h', l)`, for every `h'`.
//! 2. Along the rail `R(0..H, l)`, a ring reduce-scatter of those partials:
//!    `R(h, l)` ends with its own chunk reduced over all `N` ranks (then
//!    divided, for `Avg`). Reduce-scatter ends here.
//! 3. Along the rail, a ring all-gather of the rail's chunks.
//! 4. Within the host, `H` ring all-gathers: pass `h'` circulates the
//!    chunks of host `h'`'s ranks. All-gather is steps 3 and 4.
//!
//! A rank emits step 2's first send of piece `j` before step 1 of piece
//! `j + 1`, and the rest of step 2 after it: the network carries the send
//! while the host's passes run (eight ranks on two shaped namespace hosts,
//! 16 MiB: 177–190 → 150 ms, `docs/performance.md` stop 46). Likewise step
//! 3's first send of a piece goes before step 4 of the piece before it
//! (stop 47).
//!
//! All-reduce is steps 1–4 and reduce-scatter steps 1–2, on
//! the same chunks, so all-reduce is all-gather ∘ reduce-scatter bit for
//! bit here too; each element is the host sums (each grouped by its host's
//! ring) grouped by the rail's ring, alike on every rank. Every step's peer
//! is on this rank's host (steps 1, 4) or on its rail (2, 3): the two sets
//! share no pair, and every rank of a host runs the passes in the same
//! order, so the per-pair order of messages is each ring's own.
//!
//! Where step 1 leaves its partial sums: an all-reduce's output holds them
//! at their chunks (which steps 2–3 then overwrite with the final chunks;
//! in place, each pass overwrites a chunk only with its last step, after
//! every read of it); a reduce-scatter's output has room for one chunk, so
//! its partials go to scratch, one slot per host.

use super::ring::{
    all_gather_piece, all_gather_piece_rest, all_gather_piece_start, reduce_scatter_piece,
    reduce_scatter_piece_rest, reduce_scatter_piece_start,
};
use super::{direct, BufId, ChunkLayout, Place, Plan, RingOrder, Span, Step};
use crate::desc::CollectiveDesc;
use crate::types::{OpKind, Rank, ReduceOp};

/// This rank's host ring and rail, in a [`RingOrder`] with
/// [`hosts`](RingOrder::hosts).
struct Grid<'a> {
    order: &'a RingOrder,
    /// Hosts, ranks per host.
    hosts: usize,
    per_host: usize,
    /// This rank's host and place on it.
    host: usize,
    local: usize,
    /// `R(host, 0..per_host)`, `R(0..hosts, local)`.
    host_ring: Vec<Rank>,
    rail: Vec<Rank>,
}

impl<'a> Grid<'a> {
    fn new(order: &'a RingOrder, rank: Rank) -> Grid<'a> {
        let (hosts, per_host) = order.hosts().expect("two levels need hosts");
        let position = order.position_of(rank);
        let (host, local) = (position / per_host, position % per_host);
        Grid {
            order,
            hosts,
            per_host,
            host,
            local,
            host_ring: (0..per_host)
                .map(|l| order.rank_at(host * per_host + l))
                .collect(),
            rail: (0..hosts)
                .map(|h| order.rank_at(h * per_host + local))
                .collect(),
        }
    }

    fn world(&self) -> usize {
        self.hosts * self.per_host
    }

    /// The rank of host `h` at the place that `rank` (of any host) has on
    /// its own.
    fn on_host(&self, rank: Rank, h: usize) -> Rank {
        let local = self.order.position_of(rank) % self.per_host;
        self.order.rank_at(h * self.per_host + local)
    }

    /// The host of `rank`.
    fn host_of(&self, rank: Rank) -> usize {
        self.order.position_of(rank) / self.per_host
    }

    fn in_host(&self) -> Place<'_> {
        Place::among(&self.host_ring, self.local)
    }

    fn on_rail(&self) -> Place<'_> {
        Place::among(&self.rail, self.host)
    }

    /// Steps 1 and 2 for the `pieces` pieces: `input(j, c)` is this rank's
    /// contribution to piece `j` of chunk `c`, `partial(j, h')` where the
    /// host's partial of piece `j` of chunk `R(h', local)` goes,
    /// `own_output(j)` where piece `j` of this rank's chunk ends. The
    /// rail's first send of piece `j` goes before the host's passes of
    /// piece `j + 1`, so the network carries it while they run (every
    /// rank of a host and of a rail does the same, so each ring's messages
    /// keep their order). `then(j, steps)` adds what follows piece `j`'s
    /// rail steps (an all-reduce's steps 3 and 4).
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        pieces: usize,
        input: impl Fn(usize, Rank) -> Span,
        partial: impl Fn(usize, usize) -> Span,
        own_output: impl Fn(usize) -> Span,
        avg: bool,
        mut then: impl FnMut(usize, &mut Vec<Step>),
        steps: &mut Vec<Step>,
    ) {
        let host_passes = |j: usize, steps: &mut Vec<Step>| {
            for h in 0..self.hosts {
                reduce_scatter_piece(
                    self.in_host(),
                    |c| input(j, self.on_host(c, h)),
                    partial(j, h),
                    false,
                    steps,
                );
            }
        };
        if pieces > 0 {
            host_passes(0, steps);
        }
        for j in 0..pieces {
            let rail_input = |c: Rank| partial(j, self.host_of(c));
            reduce_scatter_piece_start(self.on_rail(), rail_input, steps);
            if j + 1 < pieces {
                host_passes(j + 1, steps);
            }
            reduce_scatter_piece_rest(self.on_rail(), rail_input, own_output(j), avg, steps);
            then(j, steps);
        }
    }

    /// Step 3's steps that need no receive, for one piece: `output(c)` is
    /// where chunk `c`'s piece lands; this rank's own is there already, or
    /// first copied from `own_input`.
    fn rail_gather_start(
        &self,
        own_input: Option<Span>,
        output: impl Fn(Rank) -> Span,
        steps: &mut Vec<Step>,
    ) {
        all_gather_piece_start(self.on_rail(), own_input, output, steps);
    }

    /// The rest of step 3 for one piece.
    fn rail_gather_rest(&self, output: impl Fn(Rank) -> Span, steps: &mut Vec<Step>) {
        all_gather_piece_rest(self.on_rail(), output, steps);
    }

    /// Step 4 for one piece.
    fn host_gathers(&self, output: impl Fn(Rank) -> Span, steps: &mut Vec<Step>) {
        for h in 0..self.hosts {
            all_gather_piece(self.in_host(), None, |c| output(self.on_host(c, h)), steps);
        }
    }
}

/// Two-level all-reduce of `count` elements (steps 1–4); its partial sums
/// wait in the output. `rank`'s order must have [`RingOrder::hosts`].
pub fn all_reduce(
    order: &RingOrder,
    rank: Rank,
    count: usize,
    piece_elems: usize,
    in_place: bool,
    avg: bool,
    steps: &mut Vec<Step>,
) {
    let grid = Grid::new(order, rank);
    let layout = ChunkLayout::new(count, grid.world(), piece_elems);
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    let at = |buf: BufId, j: usize, c: Rank| {
        let (offset, len) = layout.piece(c, j);
        Span::new(buf, offset, len)
    };
    // After piece `j`'s reduce-scatter, its rail all-gather; the host's
    // all-gather passes of piece `j - 1` run while its first send travels.
    let output = |j: usize| move |c: Rank| at(BufId::Recv, j, c);
    grid.reduce_scatter(
        layout.pieces(),
        |j, c| at(input_buf, j, c),
        |j, h| at(BufId::Recv, j, grid.rail[h]),
        |j| at(BufId::Recv, j, rank),
        avg,
        |j, steps| {
            grid.rail_gather_start(None, output(j), steps);
            if j > 0 {
                grid.host_gathers(output(j - 1), steps);
            }
            grid.rail_gather_rest(output(j), steps);
        },
        steps,
    );
    if let Some(last) = layout.pieces().checked_sub(1) {
        grid.host_gathers(output(last), steps);
    }
}

/// Two-level reduce-scatter, `recv_count` elements per rank (steps 1–2);
/// its partial sums wait in scratch, one slot of `recv_count` per host.
/// In place the result lands at `rank · recv_count` and the other blocks
/// keep the input.
pub fn reduce_scatter(
    order: &RingOrder,
    rank: Rank,
    recv_count: usize,
    piece_elems: usize,
    in_place: bool,
    avg: bool,
    steps: &mut Vec<Step>,
) -> usize {
    let grid = Grid::new(order, rank);
    let layout = ChunkLayout::new(recv_count * grid.world(), grid.world(), piece_elems);
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    let input = |j: usize, c: Rank| {
        let (offset, len) = layout.piece(c, j);
        Span::new(input_buf, offset, len)
    };
    // Every chunk has `recv_count` elements: piece `j` sits at the same
    // place in each.
    let partial = |j: usize, h: usize| {
        let (in_chunk, len) = layout.piece_in_chunk(rank, j);
        Span::new(BufId::Scratch, h * recv_count + in_chunk, len)
    };
    let own_output = |j: usize| {
        if in_place {
            input(j, rank)
        } else {
            let (in_chunk, len) = layout.piece_in_chunk(rank, j);
            Span::new(BufId::Recv, in_chunk, len)
        }
    };
    let no_more = |_: usize, _: &mut Vec<Step>| {};
    grid.reduce_scatter(
        layout.pieces(),
        input,
        partial,
        own_output,
        avg,
        no_more,
        steps,
    );
    grid.hosts * recv_count
}

/// Two-level all-gather, `send_count` elements per rank (steps 3–4).
pub fn all_gather(
    order: &RingOrder,
    rank: Rank,
    send_count: usize,
    piece_elems: usize,
    in_place: bool,
    steps: &mut Vec<Step>,
) {
    let grid = Grid::new(order, rank);
    let layout = ChunkLayout::new(send_count * grid.world(), grid.world(), piece_elems);
    let own_input = |j: usize| {
        (!in_place).then(|| {
            let (offset, len) = layout.piece_in_chunk(rank, j);
            Span::new(BufId::Send, offset, len)
        })
    };
    let output = |j: usize| {
        move |c: Rank| {
            let (offset, len) = layout.piece(c, j);
            Span::new(BufId::Recv, offset, len)
        }
    };
    // Piece `j + 1`'s first rail send goes before piece `j`'s host
    // passes, so the network carries it while they run.
    let pieces = layout.pieces();
    if pieces > 0 {
        grid.rail_gather_start(own_input(0), output(0), steps);
        grid.rail_gather_rest(output(0), steps);
    }
    for j in 0..pieces {
        if j + 1 < pieces {
            grid.rail_gather_start(own_input(j + 1), output(j + 1), steps);
        }
        grid.host_gathers(output(j), steps);
        if j + 1 < pieces {
            grid.rail_gather_rest(output(j + 1), steps);
        }
    }
}

// Direct calls in two levels.
//
// Small calls across hosts: the one-level direct plans ([`super::direct`])
// send a rank's whole buffer to every peer, so each host's link carries
// `k·(N-k)` copies of it (16 with two hosts of four). In two levels a call
// takes three steps (reduce-scatter within the host, all-reduce along the
// rail, all-gather within the host), and each host's link carries
// `(H-1)·M` of an all-reduce of `M` bytes: `M` with two hosts.
//
// Every element is folded within each host in the host's order and then
// along the rail in host order, `((x_R(h,0) ⊕ x_R(h,1)) ⊕ …)` and
// `((P_0 ⊕ P_1) ⊕ …)`, alike in all-reduce and reduce-scatter: all-reduce
// is all-gather ∘ reduce-scatter bit for bit, and every rank holds the
// same bits. A reduce-scatter (and an all-gather) moves rank `c`'s block
// as chunk `c`: per pair every step sends a rail's chunks in host order
// and the receiver takes them in that order. An all-reduce, whose
// grouping does not depend on which rank folds an element, cuts its
// buffer into one region per place on a host instead, so each step sends
// one frame per peer. Empty chunks and regions are skipped at both ends.

impl Grid<'_> {
    /// This rank's host mates, in the host's order.
    fn host_mates(&self) -> impl Iterator<Item = Rank> + '_ {
        let me = self.host_ring[self.local];
        self.host_ring.iter().copied().filter(move |&m| m != me)
    }

    /// This rank's rail mates, in host order.
    fn rail_mates(&self) -> impl Iterator<Item = Rank> + '_ {
        let me = self.rail[self.host];
        self.rail.iter().copied().filter(move |&m| m != me)
    }

    /// The ranks of `rank`'s rail (of any host), in host order.
    fn rail_of(&self, rank: Rank) -> impl Iterator<Item = Rank> + '_ {
        (0..self.hosts).map(move |h| self.on_host(rank, h))
    }

    /// Sends every host mate the chunks of its rail, `at(c)` (empty ones
    /// skipped).
    fn send_rails_to_host_mates(&self, at: impl Fn(Rank) -> Span, plan: &mut Plan) {
        for mate in self.host_mates() {
            for c in self.rail_of(mate) {
                let src = at(c);
                if src.len > 0 {
                    plan.steps.push(Step::Send { peer: mate, src });
                }
            }
        }
    }

    /// Within the host: folds each chunk `c` of this rank's rail from
    /// `input(c)` (this rank's term) and the host mates' frames into
    /// `partial(c)`, in the host's order.
    fn fold_rail_over_host(
        &self,
        input: impl Fn(Rank) -> Span,
        partial: impl Fn(Rank) -> Span,
        plan: &mut Plan,
    ) {
        let me = self.host_ring[self.local];
        for &c in &self.rail {
            let dst = partial(c);
            if dst.len == 0 {
                continue;
            }
            let own = direct::keep_own(self.local == 0, input(c), dst, plan);
            direct::fold_in_order(
                self.host_ring.iter().copied(),
                me,
                own,
                dst,
                &mut plan.steps,
            );
        }
    }

    /// Within the host, an all-gather of the rails' chunks: every host
    /// mate gets this rank's rail's chunks `at(c)`, and this rank each
    /// mate's, into `at(c)` (empty ones skipped).
    fn share_rails_with_host_mates(&self, at: impl Fn(Rank) -> Span, plan: &mut Plan) {
        for mate in self.host_mates() {
            for &c in &self.rail {
                let src = at(c);
                if src.len > 0 {
                    plan.steps.push(Step::Send { peer: mate, src });
                }
            }
        }
        for mate in self.host_mates() {
            for c in self.rail_of(mate) {
                let dst = at(c);
                if dst.len > 0 {
                    plan.steps.push(Step::Recv { peer: mate, dst });
                }
            }
        }
    }
}

/// Two-level direct all-reduce of `count` elements. The buffer is cut
/// into `k` regions, region `l` the `l`-th rank's of every host and so its
/// rail's: step 1 sends each host mate its region of this rank's input
/// (one frame), step 2 sends this rank's region, summed over its host, to
/// each rail mate, and step 3 sends each host mate the finished region.
/// An element's terms are grouped as in [`direct_reduce_scatter`] (each
/// host's in the host's order, then the host sums in host order), which
/// does not depend on which rank folds it, so all-reduce is still
/// all-gather ∘ reduce-scatter bit for bit; it takes a frame per peer per
/// step where the ring's chunks took one per chunk of a rail. Scratch: a
/// copy of the region (in place, this rank's term when it is not first on
/// its host; then its host sum, when its host is not first).
pub fn direct_all_reduce(
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
    let grid = Grid::new(order, rank);
    let regions = ChunkLayout::new(count, grid.per_host, count);
    let region = |buf: BufId, local: usize| {
        let (offset, len) = regions.chunk(local);
        Span::new(buf, offset, len)
    };
    let local_of = |r: Rank| order.position_of(r) % grid.per_host;
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    let mine = region(BufId::Recv, grid.local);
    if mine.len == 0 {
        // Fewer elements than ranks on a host: this rank's region is empty,
        // but it still sends the others theirs and takes them back.
        for mate in grid.host_mates() {
            let src = region(input_buf, local_of(mate));
            if src.len > 0 {
                plan.steps.push(Step::Send { peer: mate, src });
            }
        }
        for mate in grid.host_mates() {
            let dst = region(BufId::Recv, local_of(mate));
            if dst.len > 0 {
                plan.steps.push(Step::Recv { peer: mate, dst });
            }
        }
        return;
    }
    // 1. This rank's region summed over its host, in the output: in place,
    //    every send of the input goes before any fold writes it.
    for mate in grid.host_mates() {
        let src = region(input_buf, local_of(mate));
        if src.len > 0 {
            plan.steps.push(Step::Send { peer: mate, src });
        }
    }
    let own = direct::keep_own(grid.local == 0, region(input_buf, grid.local), mine, plan);
    direct::fold_in_order(
        grid.host_ring.iter().copied(),
        rank,
        own,
        mine,
        &mut plan.steps,
    );
    // 2. Along the rail, every rank folds the region from every host's
    //    sum, in host order.
    for mate in grid.rail_mates() {
        plan.steps.push(Step::Send {
            peer: mate,
            src: mine,
        });
    }
    let own = direct::keep_own(grid.host == 0, mine, mine, plan);
    direct::fold_in_order(grid.rail.iter().copied(), rank, own, mine, &mut plan.steps);
    if avg {
        plan.steps.push(Step::DivideByWorld { span: mine });
    }
    // 3. Within the host, the finished regions.
    for mate in grid.host_mates() {
        plan.steps.push(Step::Send {
            peer: mate,
            src: mine,
        });
    }
    for mate in grid.host_mates() {
        let dst = region(BufId::Recv, local_of(mate));
        if dst.len > 0 {
            plan.steps.push(Step::Recv { peer: mate, dst });
        }
    }
}

/// Two-level direct reduce-scatter, `recv_count` elements per rank. The
/// host sums of this rank's rail's blocks sit in scratch, one slot of
/// `recv_count` per host; in place the result lands at `rank · recv_count`
/// and the other blocks keep the input.
pub fn direct_reduce_scatter(
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
    let grid = Grid::new(order, rank);
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    let block = |c: Rank| Span::new(input_buf, c * recv_count, recv_count);
    let slot = |c: Rank| Span::new(BufId::Scratch, grid.host_of(c) * recv_count, recv_count);
    plan.scratch_len = plan.scratch_len.max(grid.hosts * recv_count);
    // 1. Host sums of this rank's rail's blocks, into scratch.
    grid.send_rails_to_host_mates(block, plan);
    grid.fold_rail_over_host(block, slot, plan);
    // 2. Along the rail, each rail mate's block to it; this rank's folded
    //    from every host's sum, in host order.
    for mate in grid.rail_mates() {
        plan.steps.push(Step::Send {
            peer: mate,
            src: slot(mate),
        });
    }
    let dst = if in_place {
        block(rank)
    } else {
        Span::new(BufId::Recv, 0, recv_count)
    };
    direct::fold_in_order(
        grid.rail.iter().copied(),
        rank,
        slot(rank),
        dst,
        &mut plan.steps,
    );
    if avg {
        plan.steps.push(Step::DivideByWorld { span: dst });
    }
}

/// Two-level direct all-gather, `send_count` elements per rank: along the
/// rail, then the rail's blocks within the host.
pub fn direct_all_gather(
    order: &RingOrder,
    rank: Rank,
    send_count: usize,
    in_place: bool,
    plan: &mut Plan,
) {
    if send_count == 0 {
        return;
    }
    let grid = Grid::new(order, rank);
    let block = |c: Rank| Span::new(BufId::Recv, c * send_count, send_count);
    let own = if in_place {
        block(rank)
    } else {
        Span::new(BufId::Send, 0, send_count)
    };
    for mate in grid.rail_mates() {
        plan.steps.push(Step::Send {
            peer: mate,
            src: own,
        });
    }
    if !in_place {
        plan.steps.push(Step::Copy {
            src: own,
            dst: block(rank),
        });
    }
    for mate in grid.rail_mates() {
        plan.steps.push(Step::Recv {
            peer: mate,
            dst: block(mate),
        });
    }
    grid.share_rails_with_host_mates(block, plan);
}

/// The two-level direct plan of `desc` (all-reduce, reduce-scatter,
/// all-gather), `None` for other operations (a broadcast or reduce goes
/// through a rank on each host on hosts of any sizes:
/// [`super::host_leaders`]). `desc`'s world must be `order`'s, with
/// [`RingOrder::hosts`].
pub fn plan_direct(desc: &CollectiveDesc, order: &RingOrder) -> Option<Plan> {
    let (rank, count, in_place) = (desc.rank, desc.count(), desc.in_place);
    let avg = desc.reduce_op == Some(ReduceOp::Avg);
    let mut plan = Plan::default();
    match desc.op {
        OpKind::AllReduce => direct_all_reduce(order, rank, count, in_place, avg, &mut plan),
        OpKind::ReduceScatter => {
            direct_reduce_scatter(order, rank, count, in_place, avg, &mut plan)
        }
        OpKind::AllGather => direct_all_gather(order, rank, count, in_place, &mut plan),
        _ => return None,
    }
    Some(plan)
}
