//! Rings in two levels, for ranks on several hosts with the same number on
//! each ([`RingOrder::hosts`]): within each host, then across hosts along
//! *rails*, the ranks with the same place on their hosts (as NCCL's and
//! Horovod's hierarchical all-reduce).
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
//! 16 MiB: 177–190 → 150 ms, `docs/performance.md` stop 46).
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
    all_gather_piece, reduce_scatter_piece, reduce_scatter_piece_rest, reduce_scatter_piece_start,
};
use super::{BufId, ChunkLayout, Place, RingOrder, Span, Step};
use crate::types::Rank;

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

    /// Steps 3 and 4 for one piece: `output(c)` is where chunk `c`'s piece
    /// lands; this rank's own is there already, or first copied from
    /// `own_input`.
    fn all_gather_piece(
        &self,
        own_input: Option<Span>,
        output: impl Fn(Rank) -> Span,
        steps: &mut Vec<Step>,
    ) {
        all_gather_piece(self.on_rail(), own_input, &output, steps);
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
    grid.reduce_scatter(
        layout.pieces(),
        |j, c| at(input_buf, j, c),
        |j, h| at(BufId::Recv, j, grid.rail[h]),
        |j| at(BufId::Recv, j, rank),
        avg,
        |j, steps| grid.all_gather_piece(None, |c| at(BufId::Recv, j, c), steps),
        steps,
    );
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
    for j in 0..layout.pieces() {
        let own_input = (!in_place).then(|| {
            let (offset, len) = layout.piece_in_chunk(rank, j);
            Span::new(BufId::Send, offset, len)
        });
        let output = |c: Rank| {
            let (offset, len) = layout.piece(c, j);
            Span::new(BufId::Recv, offset, len)
        };
        grid.all_gather_piece(own_input, output, steps);
    }
}
