//! Ring reduce-scatter, all-gather and all-reduce.
//!
//! # The ring's invariant
//!
//! (Stated in the manner of the comment in Gloo's `allreduce.cc`.) The buffer
//! of `count` elements is cut into `N` chunks, one per rank, and every chunk into
//! the same number of pipeline pieces. Ranks form a ring, `r → r+1 (mod N)`
//! (written here in rank order: the ring follows any
//! [`RingOrder`](super::RingOrder), positions standing for ranks, and the
//! chunk at a position is its rank's block).
//! Reduce-scatter runs `N-1` steps: at step `k` (0-based) rank `r` sends its
//! partial result for chunk `r-k-1` to `r+1` and receives from `r-1` the partial
//! result for chunk `r-k-2`, which it combines with its own contribution. So at
//! the end of step `k` the partial result rank `r` holds for chunk `r-k-2`
//! covers exactly the `k+2` ranks `r-k-1 .. r`, and after step `N-2` rank `r`
//! holds chunk `r` reduced over all `N` ranks, combined exactly `N-1` times.
//! All-gather then runs `N-1` steps that copy instead of reduce: at step `k`
//! rank `r` forwards the final chunk `r-k` and receives the final chunk
//! `r-k-1`. Each rank sends and receives `(N-1)/N · count` elements per phase,
//! so all-reduce moves `2(N-1)/N · count` per rank, independent of `N`.
//!
//! All-reduce *is* reduce-scatter followed by all-gather on the same chunk
//! boundaries: [`all_reduce`] emits exactly the steps of [`reduce_scatter`] and
//! [`all_gather`] (interleaved per piece, which changes no element's
//! reduction order), so `all_reduce(x) == all_gather(reduce_scatter(x))` bit
//! for bit. The `Avg` division happens once, on the owned chunk, between the
//! two phases.

use super::{BufId, ChunkLayout, Place, Span, Step};

/// Ring neighbours of a place: `(prev, next)`.
fn neighbours(place: Place<'_>) -> (usize, usize) {
    (place.after(place.world() - 1), place.after(1))
}

/// The reduce-scatter steps for one piece. `input(c)` is this rank's
/// contribution to the piece of the chunk that rank `c` (one of `place`'s
/// ring) ends with, empty where that chunk has no such piece (every rank
/// of the ring sees the same lengths); `own_output` is where the fully
/// reduced piece of this rank's chunk goes.
pub(super) fn reduce_scatter_piece(
    place: Place<'_>,
    input: impl Fn(usize) -> Span,
    own_output: Span,
    avg: bool,
    steps: &mut Vec<Step>,
) {
    reduce_scatter_piece_start(place, &input, steps);
    reduce_scatter_piece_rest(place, input, own_output, avg, steps);
}

/// The first step of [`reduce_scatter_piece`]: its one send that needs no
/// receive before it. A plan may put other steps between it and
/// [`reduce_scatter_piece_rest`] (work to do while the send travels),
/// provided every rank of the ring does.
pub(super) fn reduce_scatter_piece_start(
    place: Place<'_>,
    input: impl Fn(usize) -> Span,
    steps: &mut Vec<Step>,
) {
    let first = place.after(place.world() - 1);
    if input(first).len > 0 {
        steps.push(Step::Send {
            peer: place.after(1),
            src: input(first),
        });
    }
}

/// The steps of [`reduce_scatter_piece`] after
/// [`reduce_scatter_piece_start`]'s.
pub(super) fn reduce_scatter_piece_rest(
    place: Place<'_>,
    input: impl Fn(usize) -> Span,
    own_output: Span,
    avg: bool,
    steps: &mut Vec<Step>,
) {
    let (world, rank) = (place.world(), place.rank());
    let (prev, next) = neighbours(place);
    let nonempty = |c: usize| input(c).len > 0;
    for k in 0..world - 2 {
        let c = place.after(2 * world - k - 2);
        if nonempty(c) {
            steps.push(Step::RecvReduceSend {
                from: prev,
                to: next,
                local: input(c),
            });
        }
    }
    if nonempty(rank) {
        steps.push(Step::RecvReduce {
            peer: prev,
            local: input(rank),
            dst: own_output,
        });
        if avg {
            steps.push(Step::DivideByWorld { span: own_output });
        }
    }
}

/// The all-gather steps for one piece. `output(c)` is where the piece of
/// the chunk rank `c` (one of `place`'s ring) holds lands, empty where that
/// chunk has no such piece; this rank's own piece is already there, or is
/// first copied from `own_input`.
pub(super) fn all_gather_piece(
    place: Place<'_>,
    own_input: Option<Span>,
    output: impl Fn(usize) -> Span,
    steps: &mut Vec<Step>,
) {
    all_gather_piece_start(place, own_input, &output, steps);
    all_gather_piece_rest(place, output, steps);
}

/// The steps of [`all_gather_piece`] that need no receive: the own
/// piece's send (and its copy from `own_input`). A plan may put other
/// steps between them and [`all_gather_piece_rest`] (work to do while the
/// send travels), provided every rank of the ring does.
pub(super) fn all_gather_piece_start(
    place: Place<'_>,
    own_input: Option<Span>,
    output: impl Fn(usize) -> Span,
    steps: &mut Vec<Step>,
) {
    let (world, rank) = (place.world(), place.rank());
    let own_input = own_input.filter(|s| s.len > 0);
    // Out of place the own piece goes out from the input, before it is
    // copied into the output: the next rank's receive need not wait for
    // the copy.
    if world > 1 && output(rank).len > 0 {
        steps.push(Step::Send {
            peer: place.after(1),
            src: own_input.unwrap_or_else(|| output(rank)),
        });
    }
    if let Some(src) = own_input {
        steps.push(Step::Copy {
            src,
            dst: output(rank),
        });
    }
}

/// The steps of [`all_gather_piece`] after [`all_gather_piece_start`]'s.
pub(super) fn all_gather_piece_rest(
    place: Place<'_>,
    output: impl Fn(usize) -> Span,
    steps: &mut Vec<Step>,
) {
    let world = place.world();
    if world == 1 {
        return;
    }
    let (prev, next) = neighbours(place);
    let nonempty = |c: usize| output(c).len > 0;
    for k in 0..world - 2 {
        let c = place.after(world - k - 1);
        if nonempty(c) {
            steps.push(Step::RecvCopySend {
                from: prev,
                to: next,
                dst: output(c),
            });
        }
    }
    let last = place.after(1);
    if nonempty(last) {
        steps.push(Step::Recv {
            peer: prev,
            dst: output(last),
        });
    }
}

/// Ring all-reduce of `count` elements: reduce-scatter then all-gather on the
/// same chunks, piece by piece.
pub fn all_reduce(
    place: Place<'_>,
    count: usize,
    piece_elems: usize,
    in_place: bool,
    avg: bool,
    steps: &mut Vec<Step>,
) {
    let (world, rank) = (place.world(), place.rank());
    let layout = ChunkLayout::new(count, world, piece_elems);
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    let at = |buf: BufId, c: usize, j: usize| {
        let (offset, len) = layout.piece(c, j);
        Span::new(buf, offset, len)
    };
    for j in 0..layout.pieces() {
        if world == 1 {
            if !in_place {
                steps.push(Step::Copy {
                    src: at(BufId::Send, 0, j),
                    dst: at(BufId::Recv, 0, j),
                });
            }
            continue;
        }
        reduce_scatter_piece(
            place,
            |c| at(input_buf, c, j),
            at(BufId::Recv, rank, j),
            avg,
            steps,
        );
        all_gather_piece(place, None, |c| at(BufId::Recv, c, j), steps);
    }
}

/// Ring reduce-scatter: `recv_count` elements per rank, from an input of
/// `recv_count * world` elements. In place, the result lands at
/// `rank * recv_count` of the one buffer (NCCL's convention).
pub fn reduce_scatter(
    place: Place<'_>,
    recv_count: usize,
    piece_elems: usize,
    in_place: bool,
    avg: bool,
    steps: &mut Vec<Step>,
) {
    let (world, rank) = (place.world(), place.rank());
    let layout = ChunkLayout::new(recv_count * world, world, piece_elems);
    let input_buf = if in_place { BufId::Recv } else { BufId::Send };
    for j in 0..layout.pieces() {
        let own_output = if in_place {
            let (offset, len) = layout.piece(rank, j);
            Span::new(BufId::Recv, offset, len)
        } else {
            let (offset, len) = layout.piece_in_chunk(rank, j);
            Span::new(BufId::Recv, offset, len)
        };
        let input = |c: usize| {
            let (offset, len) = layout.piece(c, j);
            Span::new(input_buf, offset, len)
        };
        if world == 1 {
            if !in_place && own_output.len > 0 {
                steps.push(Step::Copy {
                    src: input(0),
                    dst: own_output,
                });
            }
            continue;
        }
        reduce_scatter_piece(place, input, own_output, avg, steps);
    }
}

/// Ring all-gather: `send_count` elements per rank into an output of
/// `send_count * world`. In place, this rank's part is already at
/// `rank * send_count` of the one buffer.
pub fn all_gather(
    place: Place<'_>,
    send_count: usize,
    piece_elems: usize,
    in_place: bool,
    steps: &mut Vec<Step>,
) {
    let (world, rank) = (place.world(), place.rank());
    let layout = ChunkLayout::new(send_count * world, world, piece_elems);
    for j in 0..layout.pieces() {
        let own_input = (!in_place).then(|| {
            let (offset, len) = layout.piece_in_chunk(rank, j);
            Span::new(BufId::Send, offset, len)
        });
        let output = |c: usize| {
            let (offset, len) = layout.piece(c, j);
            Span::new(BufId::Recv, offset, len)
        };
        all_gather_piece(place, own_input, output, steps);
    }
}
