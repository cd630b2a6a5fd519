//! Schedules as data: each collective is compiled, per rank, into a [`Plan`],
//! a list of [`Step`]s built from NCCL's primitive verbs (`Send`, `Recv`,
//! `RecvReduce`, `RecvReduceSend`, `RecvCopySend`, plus a local `Copy` and
//! the final `Avg` division).
//!
//! Plans do no I/O and know no element type: offsets and lengths are in
//! elements. All chunk arithmetic lives in this module and nowhere else; the
//! host executor ([`crate::host`]) and, later, the CUDA executor run the same
//! plans, so every backend reduces the same chunk in the same order.
//!
//! # Invariants every plan keeps (checked by the simulator in the tests)
//!
//! - Between any ordered pair of ranks, the n-th `Send`-like step of the
//!   sender matches the n-th `Recv`-like step of the receiver, with the same
//!   length. Sends are eager (they never wait for the receiver), so a plan in
//!   which every send has its receive cannot deadlock.
//! - Every element of a reduced result is combined exactly `N-1` times and
//!   contains each rank's contribution exactly once.
//! - A plan for an in-place call refers only to [`BufId::Recv`].
//! - Zero-length pieces are never sent; both sides skip them because both
//!   derive lengths from the same [`ChunkLayout`].

pub mod direct;
pub mod doubling;
pub mod host_leaders;
pub mod ring;
pub mod tree;
pub mod two_level;

use crate::desc::CollectiveDesc;
use crate::types::{OpKind, Rank, ReduceOp};

/// Which of the call's buffers a [`Span`] refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufId {
    /// The send (input) buffer of an out-of-place call. Read only.
    Send,
    /// The receive (output) buffer; the only buffer of an in-place call.
    Recv,
    /// Scratch memory of [`Plan::scratch_len`] elements the executor
    /// provides (a direct fold keeps a rank's own contribution there).
    Scratch,
}

/// A range of elements in one of the call's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The buffer.
    pub buf: BufId,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl Span {
    /// A span of `len` elements at `offset` in `buf`.
    pub fn new(buf: BufId, offset: usize, len: usize) -> Span {
        Span { buf, offset, len }
    }

    /// The element range, for slicing.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// One primitive operation of a plan.
///
/// "Incoming" is the next frame from the named peer; `⊕` is the call's
/// combining operator (`Sum` for `Avg`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send `src` to `peer`.
    Send {
        /// Destination rank.
        peer: Rank,
        /// What to send.
        src: Span,
    },
    /// Receive from `peer` into `dst`.
    Recv {
        /// Source rank.
        peer: Rank,
        /// Where the data lands.
        dst: Span,
    },
    /// Receive from `peer` and store `local ⊕ incoming` into `dst`.
    RecvReduce {
        /// Source rank.
        peer: Rank,
        /// This rank's contribution.
        local: Span,
        /// Where the result lands (may equal `local`).
        dst: Span,
    },
    /// Receive from `from`, combine as `local ⊕ incoming`, forward the result
    /// to `to` without storing it.
    RecvReduceSend {
        /// Source rank.
        from: Rank,
        /// Destination rank.
        to: Rank,
        /// This rank's contribution.
        local: Span,
    },
    /// Receive from `from` into `dst` and forward the same data to `to`.
    RecvCopySend {
        /// Source rank.
        from: Rank,
        /// Destination rank.
        to: Rank,
        /// Where the data lands.
        dst: Span,
    },
    /// Copy `src` to `dst` locally.
    Copy {
        /// Source.
        src: Span,
        /// Destination.
        dst: Span,
    },
    /// Store `dst ⊕ src` into `dst`, both local.
    ReduceLocal {
        /// The contribution folded in.
        src: Span,
        /// The accumulator.
        dst: Span,
    },
    /// Divide `span` by the world size: the last step of `Avg`.
    DivideByWorld {
        /// The span to divide.
        span: Span,
    },
}

impl Step {
    /// The spans this step reads or writes (`None`: no second one).
    pub fn spans(&self) -> [Option<Span>; 2] {
        match *self {
            Step::Send { src, .. } => [Some(src), None],
            Step::Recv { dst, .. } | Step::RecvCopySend { dst, .. } => [Some(dst), None],
            Step::RecvReduce { local, dst, .. } => [Some(local), Some(dst)],
            Step::RecvReduceSend { local, .. } => [Some(local), None],
            Step::Copy { src, dst } | Step::ReduceLocal { src, dst } => [Some(src), Some(dst)],
            Step::DivideByWorld { span } => [Some(span), None],
        }
    }
}

/// The steps one rank runs for one collective.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The steps, in order.
    pub steps: Vec<Step>,
    /// Elements of [`BufId::Scratch`] the steps use (0: none).
    pub scratch_len: usize,
}

/// Where each rank stands around the ring, which the ring schedules
/// (all-reduce, reduce-scatter, all-gather) and the chains of broadcast and
/// reduce follow: rank [`rank_at`](Self::rank_at)`(q)` stands at position
/// `q` and sends to the rank at `q + 1`.
///
/// Ranks that share a host stand next to each other
/// ([`grouping_hosts`](Self::grouping_hosts)), so a ring over `H` hosts
/// crosses between hosts `H` times, whatever the launcher's placement: in
/// rank order, ranks placed round-robin (`mpirun --map-by node`, Slurm's
/// cyclic distribution) would send every step across hosts, each host's
/// network carrying `k` streams for its `k` ranks instead of one. NCCL
/// orders its rings by topology for the same reason.
///
/// Every rank must plan with the same order (it decides which rank owns
/// which chunk and in what order each chunk is reduced); it is computed
/// alike on every rank from what all ranks published at rendezvous. The
/// chunk a rank owns stays its own block (a reduce-scatter's output is
/// block `rank`), so only the order of the steps and the grouping of
/// each reduction depend on it, the same way in all-reduce and in
/// reduce-scatter (all-reduce stays all-gather ∘ reduce-scatter bit for
/// bit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingOrder {
    /// Position → rank; empty for rank order (nothing to look up).
    ranks: Vec<Rank>,
    /// Rank → position, the inverse of `ranks`.
    positions: Vec<usize>,
    /// `(hosts, ranks per host)` when the ranks stand on two hosts or more
    /// with the same number, two or more, on each: position `h·k + l` is
    /// then the `l`-th rank of the `h`-th host ([`two_level`](super::two_level)).
    hosts: Option<(usize, usize)>,
    /// Where each host's ranks start, then the world size (`[0, 3, 5]`:
    /// hosts of 3 and 2 ranks), when the ranks stand on two hosts or more
    /// and some host has two or more; empty otherwise.
    host_starts: Vec<usize>,
}

/// [`RingOrder::by_rank`], for plans made with no order at hand.
static BY_RANK: RingOrder = RingOrder::by_rank();

impl RingOrder {
    /// Rank order: rank `q` at position `q`, and nothing known of hosts.
    pub const fn by_rank() -> RingOrder {
        RingOrder {
            ranks: Vec::new(),
            positions: Vec::new(),
            hosts: None,
            host_starts: Vec::new(),
        }
    }

    /// The order of the ranks `0..host_of.len()` whose hosts are
    /// `host_of[rank]` (any labels): hosts in the order of their lowest
    /// rank, and within a host its ranks ascending. Ranks already grouped
    /// by host (one launcher per host numbering its ranks in turn, as
    /// `torchrun` and `oxccl-run` do) keep rank order. With two hosts or
    /// more and two ranks or more on some, the order knows its hosts'
    /// spans ([`host_spans`](Self::host_spans)); when every host has the
    /// same number of ranks, two or more, it knows that too
    /// ([`hosts`](Self::hosts)).
    pub fn grouping_hosts<H: Eq + std::hash::Hash>(host_of: &[H]) -> RingOrder {
        // The lowest rank of each rank's host: the sort key, then the rank.
        let mut first_of = std::collections::HashMap::new();
        let first_of_host: Vec<Rank> = host_of
            .iter()
            .enumerate()
            .map(|(r, host)| *first_of.entry(host).or_insert(r))
            .collect();
        let mut ranks: Vec<Rank> = (0..host_of.len()).collect();
        ranks.sort_by_key(|&r| (first_of_host[r], r));
        let hosts = first_of.len();
        let per_host = host_of.len() / hosts.max(1);
        // Ranks per host, counted at each host's lowest rank.
        let mut on_host = vec![0usize; host_of.len()];
        for &first in &first_of_host {
            on_host[first] += 1;
        }
        let uniform = first_of.values().all(|&first| on_host[first] == per_host);
        // Each host's first position: where the sorted ranks change host.
        let mut host_starts: Vec<usize> = (0..ranks.len())
            .filter(|&q| q == 0 || first_of_host[ranks[q]] != first_of_host[ranks[q - 1]])
            .collect();
        host_starts.push(ranks.len());
        let mut order = RingOrder::from_ranks(ranks);
        if uniform && hosts >= 2 && per_host >= 2 {
            order.hosts = Some((hosts, per_host));
        }
        if hosts >= 2 && hosts < host_of.len() {
            order.host_starts = host_starts;
        }
        order
    }

    /// The order that puts `ranks[q]` at position `q`, nothing known of
    /// hosts.
    ///
    /// # Panics
    ///
    /// If `ranks` is not a permutation of `0..ranks.len()`.
    pub fn from_ranks(ranks: Vec<Rank>) -> RingOrder {
        let mut positions = vec![usize::MAX; ranks.len()];
        for (q, &r) in ranks.iter().enumerate() {
            assert!(
                r < ranks.len() && positions[r] == usize::MAX,
                "a ring order is a permutation of the ranks: {ranks:?}"
            );
            positions[r] = q;
        }
        if ranks.iter().enumerate().all(|(q, &r)| q == r) {
            return RingOrder::by_rank();
        }
        RingOrder {
            ranks,
            positions,
            hosts: None,
            host_starts: Vec::new(),
        }
    }

    /// Whether ranks stand in rank order.
    pub fn is_by_rank(&self) -> bool {
        self.ranks.is_empty()
    }

    /// `(hosts, ranks per host)` when every host of two or more has the
    /// same number of ranks, two or more: position `h·k + l` is the `l`-th
    /// rank of host `h`.
    pub fn hosts(&self) -> Option<(usize, usize)> {
        self.hosts
    }

    /// The positions of each host's ranks, hosts in order, when the ranks
    /// stand on two hosts or more and some host has two or more (of any
    /// sizes: [`hosts`](Self::hosts) says whether they are equal); none
    /// otherwise.
    pub fn host_spans(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        self.host_starts.windows(2).map(|w| w[0]..w[1])
    }

    /// Whether [`host_spans`](Self::host_spans) has any.
    pub fn knows_hosts(&self) -> bool {
        !self.host_starts.is_empty()
    }

    /// The rank at `position` (below the world size).
    pub fn rank_at(&self, position: usize) -> Rank {
        self.ranks.get(position).copied().unwrap_or(position)
    }

    /// Where `rank` stands.
    pub fn position_of(&self, rank: Rank) -> usize {
        self.positions.get(rank).copied().unwrap_or(rank)
    }

    /// `rank`'s place around a ring of `world` ranks in this order.
    ///
    /// # Panics
    ///
    /// If the order is of another world size.
    pub fn place(&self, rank: Rank, world: usize) -> Place<'_> {
        assert!(
            self.is_by_rank() || self.ranks.len() == world,
            "a ring order of {} ranks planning for {world}",
            self.ranks.len()
        );
        assert!(
            self.hosts.is_none_or(|(h, k)| h * k == world),
            "a ring order of {:?} hosts × ranks planning for {world}",
            self.hosts
        );
        assert!(
            self.host_starts.last().is_none_or(|&end| end == world),
            "a ring order of hosts of {:?} ranks planning for {world}",
            self.host_spans().map(|s| s.len()).collect::<Vec<_>>()
        );
        Place {
            world,
            position: self.position_of(rank),
            ranks: &self.ranks,
            positions: &self.positions,
        }
    }
}

/// One rank's place around a ring: who stands any number of places after
/// it. The ring schedules name peers and chunks through it only, so they
/// follow any [`RingOrder`], and run on rings of some of the ranks
/// ([`Place::among`]) as well.
#[derive(Clone, Copy, Debug)]
pub struct Place<'a> {
    world: usize,
    position: usize,
    /// Position → rank; empty: rank order.
    ranks: &'a [Rank],
    /// Rank → position; empty: rank order, or a ring of some ranks
    /// (searched).
    positions: &'a [usize],
}

impl Place<'static> {
    /// `rank`'s place in rank order.
    pub fn by_rank(rank: Rank, world: usize) -> Place<'static> {
        BY_RANK.place(rank, world)
    }
}

impl<'a> Place<'a> {
    /// The place at `position` of a ring of `members` (ranks of the call,
    /// in ring order): the ring of one host's ranks, say.
    pub fn among(members: &'a [Rank], position: usize) -> Place<'a> {
        debug_assert!(position < members.len());
        Place {
            world: members.len(),
            position,
            ranks: members,
            positions: &[],
        }
    }
}

impl Place<'_> {
    /// The number of ranks around this ring.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The rank `steps` places after this one (`world - s`: `s` before it).
    pub fn after(&self, steps: usize) -> Rank {
        let position = (self.position + steps % self.world) % self.world;
        self.ranks.get(position).copied().unwrap_or(position)
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.after(0)
    }

    /// How many places after `rank` (one of this ring's) this one stands.
    pub fn steps_after(&self, rank: Rank) -> usize {
        let position = if self.ranks.is_empty() {
            rank
        } else if let Some(&q) = self.positions.get(rank) {
            q
        } else {
            self.ranks.iter().position(|&r| r == rank).unwrap_or(0)
        };
        (self.position + self.world - position) % self.world
    }
}

/// The schedule families over point-to-point links.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Pipelined ring (all-reduce, reduce-scatter, all-gather), chain
    /// (broadcast, reduce): bandwidth-optimal.
    Ring,
    /// One step, straight to every peer, folds in rank order:
    /// latency-optimal for small messages among few ranks.
    Direct,
    /// Recursive doubling (all-reduce, reduce-scatter, all-gather) and
    /// binomial trees (broadcast, reduce), [`doubling`]: `⌈log2 N⌉` rounds,
    /// latency-optimal for small messages among many ranks.
    Tree,
}

/// Largest number of bytes a rank sends in one direct call: up to here one
/// message latency beats the ring's `2(N-1)` steps. Measured on the 2-vCPU
/// VM of `docs/performance.md` (stop 41), 2 processes over loopback TCP,
/// the direct family against the ring paired batch by batch in one
/// process: all-reduce 0.83–0.88 of the ring's time at 128 KiB, 0.86–0.94
/// at 256 KiB, 0.85–0.95 at 512 KiB, even at 1 MiB, 1.05× from 2 MiB and
/// 1.2–3.4× from 4 MiB; all-gather, reduce-scatter and broadcast even from
/// 32 KiB to 1 MiB. (It stays below half a premultiplied `Avg`'s segment,
/// `comm::AVG_SEGMENT_BYTES`, so segments plan as their whole call.)
pub const DIRECT_MAX_BYTES_SENT: usize = 256 * 1024;

/// Worlds from this size run small calls over the links as trees
/// ([`Family::Tree`]) rather than direct. A model, not a measurement: this
/// project's machine has two cores and one host, where 8 and 16 ranks over
/// loopback TCP share the cores and every round waits for a wake-up (trees
/// ran up to 1.7× slower than direct there, even at 32 KiB among 8 ranks;
/// `docs/performance.md`, stop 45).
/// With a per-message cost `o` (a system call and the stack's work, 2–5 µs
/// over TCP) and a latency `L` (10–50 µs between hosts), a direct call
/// costs about `2(N-1)·o + L` and a tree `⌈log2 N⌉·(2o + L)`: at `o = 3`,
/// `L = 20` µs, 62 against 78 µs at 8 ranks, 110 against 104 at 16, 206
/// against 130 at 32. The trees start where the model puts them well
/// ahead. (Within one host the shared arena runs small calls, whatever the
/// world.)
pub const TREE_MIN_WORLD: usize = 32;

/// Largest number of bytes a rank sends in one tree call, counted as the
/// largest buffer once per round (`⌈log2 N⌉` times): the same bound as
/// [`DIRECT_MAX_BYTES_SENT`], above which the ring's bandwidth wins.
pub const TREE_MAX_BYTES_SENT: usize = DIRECT_MAX_BYTES_SENT;

/// The table: which family a call of `desc` uses when nothing forces one.
/// Below [`TREE_MIN_WORLD`] ranks a direct call sends at most
/// `bytes · (N-1)` per rank; it is chosen while that stays within
/// [`DIRECT_MAX_BYTES_SENT`]. From [`TREE_MIN_WORLD`] ranks a tree call
/// sends `bytes` in each of `⌈log2 N⌉` rounds; it is chosen while that stays
/// within [`TREE_MAX_BYTES_SENT`]. Larger calls take the ring. Reduce-scatter and
/// all-reduce of the same buffer size always get the same family (the table
/// looks at the largest buffer), which keeps all-reduce equal to
/// all-gather ∘ reduce-scatter bit for bit.
pub fn choose(desc: &CollectiveDesc) -> Family {
    let peers = desc.world_size.saturating_sub(1).max(1);
    let direct_ops = matches!(
        desc.op,
        OpKind::AllReduce
            | OpKind::ReduceScatter
            | OpKind::AllGather
            | OpKind::Broadcast
            | OpKind::Reduce
    );
    if !direct_ops {
        return Family::Ring;
    }
    if desc.world_size >= TREE_MIN_WORLD {
        let rounds = desc.world_size.next_power_of_two().trailing_zeros() as usize;
        if desc.bytes().saturating_mul(rounds) <= TREE_MAX_BYTES_SENT {
            return Family::Tree;
        }
    } else if desc.bytes().saturating_mul(peers) <= DIRECT_MAX_BYTES_SENT {
        return Family::Direct;
    }
    Family::Ring
}

/// [`choose`] for a communicator whose ranks all run on one host, of a
/// machine where the job's ranks outnumber the CPUs they may run on (`crowded_host`,
/// the same on every rank): there
/// broadcasts and all-gathers among 3 to [`TREE_MIN_WORLD`] ranks take the
/// trees (binomial, recursive doubling) while they fit
/// [`TREE_MAX_BYTES_SENT`], because each rank's messages wait for it to be
/// scheduled, and the trees send fewer per rank than the direct calls
/// (the root's `N−1`, or every rank's `N−1`). Four ranks over loopback TCP
/// on the two vCPUs of `docs/performance.md` (stop 48), µs, direct →
/// tree: broadcast 8 B 17–21 → 9–17, 4 KiB 22–23 → 7–25, 64 KiB 51–76 →
/// 39–71; all-gather 4 KiB 63–124 → 39–42, 64 KiB 83–143 → 56–84.
/// These two only move data, so the family changes no bit of a result;
/// reductions keep the table's choice (all-reduce and reduce-scatter must
/// stay alike, and the trees' reduce-scatter and reduce measured slower
/// there, stop 47).
pub fn choose_for(desc: &CollectiveDesc, crowded_host: bool) -> Family {
    let moves_only = matches!(desc.op, OpKind::Broadcast | OpKind::AllGather);
    if crowded_host && moves_only && (3..TREE_MIN_WORLD).contains(&desc.world_size) {
        let rounds = desc.world_size.next_power_of_two().trailing_zeros() as usize;
        if desc.bytes().saturating_mul(rounds) <= TREE_MAX_BYTES_SENT {
            return Family::Tree;
        }
    }
    choose(desc)
}

/// The family whose plan runs `desc` when `family` is asked for: the
/// ring for a direct or tree call above [`MAX_PIECE_BYTES`] (a direct
/// step moves a whole buffer in one frame, all-gather's and
/// reduce-scatter's a rank's block, and `bytes()` bounds them all; a tree
/// step moves a whole buffer too, a reduce-scatter's whole input).
/// [`plan_in_order`] plans with it and the reports name it.
pub fn family_that_runs(desc: &CollectiveDesc, family: Family) -> Family {
    match family {
        Family::Direct | Family::Tree if desc.bytes() > MAX_PIECE_BYTES => Family::Ring,
        _ => family,
    }
}

/// The name `oxccl-perf` prints for a plan family running `op`.
pub fn family_name(family: Family, op: OpKind) -> &'static str {
    match (family, op) {
        (Family::Direct, OpKind::AllReduce) => "oneshot",
        (Family::Direct, _) => "direct",
        (Family::Tree, OpKind::Broadcast | OpKind::Reduce) => "binomial",
        (Family::Tree, OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather) => "doubling",
        (Family::Tree, OpKind::Barrier) => "dissemination",
        (Family::Tree, _) => "direct",
        (Family::Ring, OpKind::Broadcast | OpKind::Reduce) => "chain",
        (Family::Ring, OpKind::Barrier) => "dissemination",
        (Family::Ring, OpKind::AllToAll | OpKind::Send | OpKind::Recv) => "direct",
        (Family::Ring, _) => "ring",
    }
}

/// [`family_name`] for plans in `order`: on hosts of the same size
/// ([`RingOrder::hosts`]) `ring2level` for the ring family's all-reduce,
/// reduce-scatter and all-gather ([`two_level`]); on hosts of any sizes
/// ([`RingOrder::knows_hosts`]) `direct2level` for the direct family's
/// collectives ([`two_level`], [`host_leaders`]).
pub fn family_name_in(family: Family, op: OpKind, order: &RingOrder) -> &'static str {
    use OpKind::{AllGather, AllReduce, Broadcast, Reduce, ReduceScatter};
    match (family, op) {
        (Family::Ring, AllReduce | ReduceScatter | AllGather) if order.hosts().is_some() => {
            "ring2level"
        }
        (Family::Direct, AllReduce | ReduceScatter | AllGather | Broadcast | Reduce)
            if order.knows_hosts() =>
        {
            "direct2level"
        }
        _ => family_name(family, op),
    }
}

/// How a count of elements is cut into one chunk per rank, and each chunk into
/// pipeline pieces of at most `piece_elems` elements.
///
/// Chunk `c` has `count / world` elements, plus one for the first
/// `count % world` chunks, so counts that do not divide by the world size and
/// counts below it (empty chunks) need no special case. Every chunk is cut into
/// the same number of pieces, [`ChunkLayout::pieces`], so that the ring's
/// step `j` touches piece `j` of whatever chunk each rank holds; a piece may be
/// empty (and is then skipped by every rank alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkLayout {
    count: usize,
    world: usize,
    pieces: usize,
}

impl ChunkLayout {
    /// Layout of `count` elements over `world` ranks with pieces of at most
    /// `piece_elems` elements (`piece_elems` ≥ 1).
    pub fn new(count: usize, world: usize, piece_elems: usize) -> ChunkLayout {
        // The world size is validated before planning; max(1) keeps this total.
        let world = world.max(1);
        let piece_elems = piece_elems.max(1);
        let largest = count.div_ceil(world);
        ChunkLayout {
            count,
            world,
            pieces: largest.div_ceil(piece_elems),
        }
    }

    /// Number of pieces per chunk (0 when `count` is 0).
    pub fn pieces(&self) -> usize {
        self.pieces
    }

    /// `(offset, len)` of chunk `c` within the whole buffer.
    pub fn chunk(&self, c: usize) -> (usize, usize) {
        split_even(self.count, self.world, c)
    }

    /// `(offset, len)` of piece `j` of chunk `c`, within the whole buffer.
    pub fn piece(&self, c: usize, j: usize) -> (usize, usize) {
        let (chunk_offset, chunk_len) = self.chunk(c);
        let (offset, len) = split_even(chunk_len, self.pieces, j);
        (chunk_offset + offset, len)
    }

    /// `(offset, len)` of piece `j` of chunk `c`, relative to the chunk's start.
    pub fn piece_in_chunk(&self, c: usize, j: usize) -> (usize, usize) {
        split_even(self.chunk(c).1, self.pieces, j)
    }
}

/// Part `i` of `total` split into `parts` near-equal parts: the first
/// `total % parts` parts are one longer. Nothing at all is split into no
/// parts (a [`ChunkLayout`] of 0 elements has none).
fn split_even(total: usize, parts: usize, i: usize) -> (usize, usize) {
    if parts == 0 {
        return (0, 0);
    }
    let base = total / parts;
    let extra = total % parts;
    let len = base + usize::from(i < extra);
    let offset = i * base + i.min(extra);
    (offset, len)
}

/// Builds the plan for one validated call on one rank.
///
/// `chunk_bytes` is the pipeline piece size in bytes (the communicator's
/// configuration); it becomes a piece size in elements of the call's type.
///
/// # Panics
///
/// On a descriptor that [`CollectiveDesc::validate`] refuses (a world size
/// of 0, a root or rank outside the world): the communicators validate
/// every call before planning it.
pub fn plan(desc: &CollectiveDesc, chunk_bytes: usize) -> Plan {
    plan_with(desc, chunk_bytes, choose(desc))
}

/// The plan of one `send_recv`: every step of a lone `send`'s plan, then
/// every step of a lone `recv`'s, so each half cuts exactly the frames its
/// lone call would and meets a peer's lone `recv` or `send`. All sends come
/// first because sends never wait, and a lone `send` queues all its pieces
/// before returning: a peer that receives the whole message before sending
/// (`recv` then `send`, or a cycle of such ranks) must get every piece
/// without this rank's receive having made progress (with the pieces
/// alternated, it waited for the peer's first piece after queueing only its
/// own first, and both waited until the deadline). While the receives wait,
/// every wait makes progress on every link: the queued sends drain and the
/// peer's frames arrive. In place (`in_place`: one buffer, which the
/// receives overwrite) the send steps name [`BufId::Recv`], as every
/// in-place plan does. Across processes the executor lends each piece to
/// the links and, before a receive overwrites a span, copies the frames
/// still queued that borrow it (`Lending::reclaims`); between threads it
/// copies each piece as it queues it, as `MPI_Sendrecv_replace` does.
///
/// # Panics
///
/// If either plan uses scratch: point-to-point plans do not, and the two
/// halves would share it.
pub fn exchange(send: Plan, recv: Plan, in_place: bool) -> Plan {
    assert!(
        send.scratch_len == 0 && recv.scratch_len == 0,
        "point-to-point plans use no scratch"
    );
    // The send plan's vector, extended: no second allocation (an 8-byte
    // exchange's plans were a tenth of its samples).
    let mut steps = send.steps;
    if in_place {
        for step in &mut steps {
            if let Step::Send { src, .. } = step {
                *src = Span::new(BufId::Recv, src.offset, src.len);
            }
        }
    }
    steps.extend(recv.steps);
    Plan {
        steps,
        scratch_len: 0,
    }
}

/// The most pipeline pieces a plan cuts a buffer into: with 256 KiB pieces
/// only a buffer of 256 GiB reaches it (1 TiB with 1 MiB ones); a tiny
/// `chunk_bytes` on a large buffer gets larger pieces instead.
pub const MAX_PIECES: usize = 1 << 20;

/// The most bytes one step sends as one frame: a link's reader takes a
/// header claiming more for corruption (`transport::net`). Pieces are cut
/// to it whatever `chunk_bytes` says, and a direct plan, which sends a
/// whole buffer at once, gives way to the pipelined one above it.
pub const MAX_PIECE_BYTES: usize = 1 << 36;

/// [`plan`] with the family chosen by the caller, rings and chains in rank
/// order.
///
/// # Panics
///
/// As [`plan`].
pub fn plan_with(desc: &CollectiveDesc, chunk_bytes: usize, family: Family) -> Plan {
    plan_in_order(desc, chunk_bytes, family, &BY_RANK)
}

/// [`plan_with`], rings and chains in `order`; on hosts of the same size
/// ([`RingOrder::hosts`]) the ring family's all-reduce, reduce-scatter and
/// all-gather and the direct family's collectives run in two levels
/// ([`two_level`]), and on hosts of unequal size the direct family's
/// through a leader per host ([`host_leaders`]). The tree family,
/// all-to-all and the barrier go by rank whatever it says.
///
/// # Panics
///
/// As [`plan`], and if `order` is of another world size.
pub fn plan_in_order(
    desc: &CollectiveDesc,
    chunk_bytes: usize,
    family: Family,
    order: &RingOrder,
) -> Plan {
    // Checks that `order` is of this world, for every family.
    let place = order.place(desc.rank, desc.world_size);
    let whole = match family_that_runs(desc, family) {
        Family::Direct => Some(&DIRECT_SCHEDULES),
        Family::Tree => Some(&TREE_SCHEDULES),
        Family::Ring => None,
    };
    if let Some(schedules) = whole {
        // Across hosts direct calls run in two levels: along rails on hosts
        // of the same size, through a leader per host otherwise (and
        // broadcasts and reduces on any hosts).
        let two_level_direct = match family {
            Family::Direct if order.knows_hosts() => order
                .hosts()
                .and_then(|_| two_level::plan_direct(desc, order))
                .or_else(|| host_leaders::plan(desc, order)),
            _ => None,
        };
        if let Some(plan) = two_level_direct.or_else(|| plan_whole(desc, schedules)) {
            return plan;
        }
    }
    // At most MAX_PIECES pieces whatever the chunk size: frames are
    // numbered per call and peer in 32 bits (a wrapped number would reuse
    // one still unread), and the plan holds a step per piece. Counted over
    // the whole buffer: all-gather, reduce-scatter and all-to-all counts
    // are per rank, and their plans move (world - 1) blocks of them.
    let elements = match desc.op {
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => {
            desc.count().saturating_mul(desc.world_size)
        }
        _ => desc.count(),
    };
    // MAX_PIECES over 2^36-byte pieces is 2^56 bytes, past any buffer: the
    // two bounds never conflict.
    let piece_elems = (chunk_bytes / desc.dtype.size())
        .min(MAX_PIECE_BYTES / desc.dtype.size())
        .max(1)
        .max(elements.div_ceil(MAX_PIECES));
    let rank = desc.rank;
    let world = desc.world_size;
    let in_place = desc.in_place;
    let avg = desc.reduce_op == Some(ReduceOp::Avg);
    let mut steps = Vec::new();
    let mut scratch_len = 0;
    // Hosts of the same size: the rings run in two levels.
    let two_levels = order.hosts().is_some();
    match desc.op {
        OpKind::AllReduce if two_levels => two_level::all_reduce(
            order,
            rank,
            desc.count(),
            piece_elems,
            in_place,
            avg,
            &mut steps,
        ),
        OpKind::ReduceScatter if two_levels => {
            scratch_len = two_level::reduce_scatter(
                order,
                rank,
                desc.count(),
                piece_elems,
                in_place,
                avg,
                &mut steps,
            );
        }
        OpKind::AllGather if two_levels => {
            two_level::all_gather(order, rank, desc.count(), piece_elems, in_place, &mut steps)
        }
        OpKind::AllReduce => {
            ring::all_reduce(place, desc.count(), piece_elems, in_place, avg, &mut steps)
        }
        OpKind::ReduceScatter => {
            ring::reduce_scatter(place, desc.count(), piece_elems, in_place, avg, &mut steps)
        }
        OpKind::AllGather => {
            ring::all_gather(place, desc.count(), piece_elems, in_place, &mut steps)
        }
        OpKind::Broadcast => tree::broadcast_chain(
            place,
            desc.root.unwrap_or(0),
            desc.count(),
            piece_elems,
            in_place,
            &mut steps,
        ),
        OpKind::Reduce => tree::reduce_chain(
            place,
            desc.root.unwrap_or(0),
            desc.count(),
            piece_elems,
            in_place,
            avg,
            &mut steps,
        ),
        OpKind::Send => tree::send(
            desc.peer.unwrap_or(0),
            desc.count(),
            piece_elems,
            &mut steps,
        ),
        OpKind::Recv => tree::recv(
            desc.peer.unwrap_or(0),
            desc.count(),
            piece_elems,
            &mut steps,
        ),
        OpKind::AllToAll => tree::all_to_all(rank, world, desc.count(), piece_elems, &mut steps),
        // Split exchanges (color, key) pairs with an in-place all-gather.
        OpKind::Split => ring::all_gather(place, desc.count(), piece_elems, true, &mut steps),
        OpKind::Barrier => tree::barrier(rank, world, &mut steps),
        // Allocation and set-up move no data over the links.
        OpKind::AllocShared | OpKind::Init => {}
    }
    Plan { steps, scratch_len }
}

/// The one-frame-per-step schedules of a family: each moves a whole buffer
/// (or a rank's block) per step, with the same arguments in both families.
struct WholeBufferSchedules {
    all_reduce: fn(Rank, usize, usize, bool, bool, &mut Plan),
    reduce_scatter: fn(Rank, usize, usize, bool, bool, &mut Plan),
    all_gather: fn(Rank, usize, usize, bool, &mut Plan),
    broadcast: fn(Rank, usize, Rank, usize, bool, &mut Plan),
    reduce: fn(Rank, usize, Rank, usize, bool, bool, &mut Plan),
}

const DIRECT_SCHEDULES: WholeBufferSchedules = WholeBufferSchedules {
    all_reduce: direct::all_reduce,
    reduce_scatter: direct::reduce_scatter,
    all_gather: direct::all_gather,
    broadcast: direct::broadcast,
    reduce: direct::reduce,
};

const TREE_SCHEDULES: WholeBufferSchedules = WholeBufferSchedules {
    all_reduce: doubling::all_reduce,
    reduce_scatter: doubling::reduce_scatter,
    all_gather: doubling::all_gather,
    broadcast: doubling::broadcast,
    reduce: doubling::reduce,
};

/// The plan of `desc` from `schedules` (direct or tree), for the
/// operations that have one.
fn plan_whole(desc: &CollectiveDesc, schedules: &WholeBufferSchedules) -> Option<Plan> {
    let (rank, world, count) = (desc.rank, desc.world_size, desc.count());
    let in_place = desc.in_place;
    let avg = desc.reduce_op == Some(ReduceOp::Avg);
    let root = desc.root.unwrap_or(0);
    let mut plan = Plan::default();
    let p = &mut plan;
    match desc.op {
        OpKind::AllReduce => (schedules.all_reduce)(rank, world, count, in_place, avg, p),
        OpKind::ReduceScatter => (schedules.reduce_scatter)(rank, world, count, in_place, avg, p),
        OpKind::AllGather => (schedules.all_gather)(rank, world, count, in_place, p),
        OpKind::Broadcast => (schedules.broadcast)(rank, world, root, count, in_place, p),
        OpKind::Reduce => (schedules.reduce)(rank, world, root, count, in_place, avg, p),
        _ => return None,
    }
    Some(plan)
}

/// Splits `len` elements starting at `offset` into pieces of at most
/// `piece_elems`, calling `f(offset, len)` for each non-empty piece.
pub(crate) fn for_each_piece(
    offset: usize,
    len: usize,
    piece_elems: usize,
    mut f: impl FnMut(usize, usize),
) {
    let mut done = 0;
    while done < len {
        let n = piece_elems.min(len - done);
        f(offset + done, n);
        done += n;
    }
}

#[cfg(test)]
mod sim;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::BufDesc;
    use crate::types::DType;

    /// An empty layout has no pieces; asking for one anyway (the layout is
    /// public) is an empty range, not a division by zero.
    #[test]
    fn an_empty_layout_answers_without_dividing_by_zero() {
        let layout = ChunkLayout::new(0, 4, 8);
        assert_eq!(layout.pieces(), 0);
        assert_eq!(layout.piece(0, 0), (0, 0));
        assert_eq!(layout.piece_in_chunk(3, 0), (0, 0));
    }

    /// The bytes each step sends as one frame.
    fn frame_bytes(plan: &Plan, size: usize) -> impl Iterator<Item = usize> + '_ {
        plan.steps.iter().filter_map(move |step| match *step {
            Step::Send { src, .. } => Some(src.len * size),
            Step::RecvReduceSend { local, .. } => Some(local.len * size),
            Step::RecvCopySend { dst, .. } => Some(dst.len * size),
            _ => None,
        })
    }

    /// No plan sends a frame larger than a link's reader accepts (it takes
    /// such a header for corruption and fails every communicator on the
    /// link): neither a forced direct plan on a buffer past it nor a piece
    /// size past it.
    #[test]
    fn no_step_sends_more_than_one_frame_may_hold() {
        let buf = |len| BufDesc {
            len,
            memory: crate::desc::MemoryKind::Host,
        };
        let huge = (MAX_PIECE_BYTES / 4) + 1;
        let all_reduce = CollectiveDesc::new(
            OpKind::AllReduce,
            DType::F32,
            0,
            2,
            crate::desc::MemoryKind::Host,
        )
        .with_reduce_op(ReduceOp::Sum)
        .with_send(buf(huge))
        .with_recv(buf(huge));
        for family in [Family::Direct, Family::Tree] {
            let plan = plan_with(&all_reduce, 256 << 10, family);
            assert!(frame_bytes(&plan, 4).count() > 0);
            assert!(frame_bytes(&plan, 4).all(|b| b <= MAX_PIECE_BYTES));
            // And the reports name the ring that runs it.
            assert_eq!(family_that_runs(&all_reduce, family), Family::Ring);
        }

        let broadcast = CollectiveDesc::new(
            OpKind::Broadcast,
            DType::U8,
            0,
            2,
            crate::desc::MemoryKind::Host,
        )
        .with_root(0)
        .with_in_place(buf(MAX_PIECE_BYTES * 2));
        let plan = plan_with(&broadcast, 1 << 40, Family::Ring);
        assert_eq!(
            frame_bytes(&plan, 1).collect::<Vec<_>>(),
            vec![MAX_PIECE_BYTES; 2]
        );
    }

    /// A call of `op` over `world` ranks whose largest buffer holds
    /// `bytes` bytes (root 0, sums), for the table's tests.
    fn call_of(op: OpKind, world: usize, bytes: usize) -> CollectiveDesc {
        let host = |len| BufDesc {
            len,
            memory: crate::desc::MemoryKind::Host,
        };
        let desc = CollectiveDesc::new(op, DType::U8, 0, world, crate::desc::MemoryKind::Host);
        match op {
            OpKind::AllReduce => desc
                .with_reduce_op(ReduceOp::Sum)
                .with_send(host(bytes))
                .with_recv(host(bytes)),
            OpKind::ReduceScatter => desc
                .with_reduce_op(ReduceOp::Sum)
                .with_send(host(bytes))
                .with_recv(host(bytes / world)),
            OpKind::AllGather => desc.with_send(host(bytes / world)).with_recv(host(bytes)),
            OpKind::Reduce => desc
                .with_reduce_op(ReduceOp::Sum)
                .with_root(0)
                .with_in_place(host(bytes)),
            _ => desc.with_root(0).with_in_place(host(bytes)),
        }
    }

    /// The table by world size and buffer size: direct below
    /// [`TREE_MIN_WORLD`] ranks, trees from it, the ring past each one's
    /// bytes; all-reduce and reduce-scatter of one buffer size alike.
    #[test]
    fn the_table_chooses_trees_for_small_calls_among_many_ranks() {
        let family = |op, world, bytes| choose(&call_of(op, world, bytes));
        assert_eq!(family(OpKind::AllReduce, 8, 8), Family::Direct);
        assert_eq!(family(OpKind::AllReduce, 31, 8), Family::Direct);
        assert_eq!(family(OpKind::AllReduce, 32, 8), Family::Tree);
        assert_eq!(family(OpKind::Broadcast, 64, 4096), Family::Tree);
        // 32 ranks: five rounds of 51 KiB is the tree's bound; 33: six.
        assert_eq!(family(OpKind::AllReduce, 32, 51 << 10), Family::Tree);
        assert_eq!(family(OpKind::AllReduce, 33, 51 << 10), Family::Ring);
        assert_eq!(family(OpKind::AllReduce, 32, 1 << 20), Family::Ring);
        for (world, bytes) in [(8, 4096), (32, 4096), (32, 1 << 20), (64, 32 << 10)] {
            assert_eq!(
                family(OpKind::ReduceScatter, world, bytes),
                family(OpKind::AllReduce, world, bytes),
                "world {world}, {bytes} bytes"
            );
        }
    }

    /// On a crowded host, broadcasts and all-gathers among three ranks or
    /// more take the trees while they fit; nothing else changes.
    #[test]
    fn crowded_hosts_move_small_calls_through_trees() {
        let crowded = |op, world, bytes| choose_for(&call_of(op, world, bytes), true);
        assert_eq!(crowded(OpKind::Broadcast, 4, 8), Family::Tree);
        assert_eq!(crowded(OpKind::Broadcast, 3, 64 << 10), Family::Tree);
        assert_eq!(crowded(OpKind::AllGather, 4, 4 << 10), Family::Tree);
        assert_eq!(crowded(OpKind::AllGather, 4, 128 << 10), Family::Tree);
        // Two rounds of 1 MiB are past the trees' bound: the ring.
        assert_eq!(crowded(OpKind::AllGather, 4, 1 << 20), Family::Ring);
        // Two ranks: a tree is the direct call.
        assert_eq!(crowded(OpKind::Broadcast, 2, 8), Family::Direct);
        for op in [OpKind::AllReduce, OpKind::ReduceScatter, OpKind::Reduce] {
            assert_eq!(crowded(op, 4, 4096), Family::Direct, "{op:?}");
        }
        for op in [OpKind::Broadcast, OpKind::AllGather] {
            let call = call_of(op, 4, 4096);
            assert_eq!(choose_for(&call, false), Family::Direct);
            assert_eq!(choose_for(&call, false), choose(&call));
        }
    }

    #[test]
    fn chunks_cover_the_buffer_exactly() {
        for count in [0, 1, 2, 7, 8, 9, 100, 1001] {
            for world in 1..=9 {
                for piece in [1, 3, 64, 10_000] {
                    let layout = ChunkLayout::new(count, world, piece);
                    let mut next = 0;
                    for c in 0..world {
                        let (chunk_off, chunk_len) = layout.chunk(c);
                        assert_eq!(chunk_off, next);
                        let mut inner = chunk_off;
                        for j in 0..layout.pieces() {
                            let (off, len) = layout.piece(c, j);
                            assert_eq!(off, inner);
                            assert!(len <= piece, "piece {len} > {piece}");
                            inner += len;
                        }
                        assert_eq!(inner, chunk_off + chunk_len);
                        next += chunk_len;
                    }
                    assert_eq!(next, count, "count {count} world {world}");
                }
            }
        }
    }

    /// A tiny chunk size on a large buffer gets larger pieces, not more
    /// than MAX_PIECES of them (frame numbers are 32-bit, and the plan
    /// holds a step per piece).
    #[test]
    fn pieces_are_capped_whatever_the_chunk_size() {
        use crate::desc::{BufDesc, MemoryKind};
        use crate::types::DType;
        let count = 3 * MAX_PIECES + 5;
        let buf = BufDesc {
            len: count,
            memory: MemoryKind::Host,
        };
        let send = CollectiveDesc::new(OpKind::Send, DType::U8, 0, 2, MemoryKind::Host)
            .with_send(buf)
            .with_peer(1);
        let steps = plan_with(&send, 1, Family::Ring).steps.len();
        assert!(steps <= MAX_PIECES, "{steps} steps");
        assert!(steps >= MAX_PIECES / 2, "{steps} steps");
        // Below the cap, the chunk size rules.
        let small = CollectiveDesc::new(OpKind::Send, DType::U8, 0, 2, MemoryKind::Host)
            .with_send(BufDesc {
                len: 1000,
                memory: MemoryKind::Host,
            })
            .with_peer(1);
        assert_eq!(plan_with(&small, 10, Family::Ring).steps.len(), 100);
    }

    /// An exchange holds every step of the lone send's plan, in order,
    /// before every step of the lone receive's (5 sends to rank 1, then 2
    /// receives from rank 2); in place its sends name the one buffer.
    #[test]
    fn an_exchange_queues_the_lone_sends_before_the_lone_receives() {
        use crate::desc::{BufDesc, MemoryKind};
        use crate::types::DType;
        let host = |len| BufDesc {
            len,
            memory: MemoryKind::Host,
        };
        let send = CollectiveDesc::new(OpKind::Send, DType::F32, 0, 3, MemoryKind::Host)
            .with_send(host(50))
            .with_peer(1);
        let recv = CollectiveDesc::new(OpKind::Recv, DType::F32, 0, 3, MemoryKind::Host)
            .with_recv(host(15))
            .with_peer(2);
        let (lone_send, lone_recv) = (plan_with(&send, 40, Family::Ring), plan(&recv, 40));
        assert_eq!((lone_send.steps.len(), lone_recv.steps.len()), (5, 2));
        let both = exchange(lone_send.clone(), lone_recv.clone(), false);
        let expected: Vec<Step> = lone_send
            .steps
            .iter()
            .chain(&lone_recv.steps)
            .copied()
            .collect();
        assert_eq!(both.steps, expected);
        assert_eq!(both.scratch_len, 0);
        let in_place = exchange(lone_send.clone(), lone_recv.clone(), true);
        for (step, lone) in in_place.steps.iter().zip(&expected) {
            match (*step, *lone) {
                (Step::Send { peer, src }, Step::Send { peer: p, src: s }) => {
                    assert_eq!(
                        (peer, src.buf, src.offset, src.len),
                        (p, BufId::Recv, s.offset, s.len)
                    );
                }
                (step, lone) => assert_eq!(step, lone),
            }
        }
    }

    /// Hosts in the order of their lowest rank, each host's ranks
    /// ascending; places count around that order.
    #[test]
    fn a_ring_order_stands_each_hosts_ranks_together() {
        let order = RingOrder::grouping_hosts(&["b", "a", "b", "c", "a", "c", "b"]);
        let ranks: Vec<Rank> = (0..7).map(|q| order.rank_at(q)).collect();
        assert_eq!(ranks, [0, 2, 6, 1, 4, 3, 5]);
        for (q, &r) in ranks.iter().enumerate() {
            assert_eq!(order.position_of(r), q);
        }
        let place = order.place(6, 7);
        assert_eq!((place.rank(), place.after(1), place.after(6)), (6, 1, 2));
        assert_eq!(place.after(7 + 3), place.after(3));
        assert_eq!((place.steps_after(0), place.steps_after(5)), (2, 3));
        // Grouped already, or one host: rank order, which costs no lookup.
        assert!(RingOrder::grouping_hosts(&[0, 0, 1, 1, 2]).is_by_rank());
        assert!(RingOrder::grouping_hosts(&[7; 4]).is_by_rank());
        // Two levels only with two hosts or more, each of the same two
        // ranks or more.
        assert_eq!(order.hosts(), None);
        assert_eq!(RingOrder::grouping_hosts(&[0, 0, 1, 1, 2]).hosts(), None);
        assert_eq!(RingOrder::grouping_hosts(&[7; 4]).hosts(), None);
        assert_eq!(RingOrder::grouping_hosts(&[0, 1, 2]).hosts(), None);
        let grouped = RingOrder::grouping_hosts(&[0, 0, 1, 1]);
        assert!(grouped.is_by_rank());
        assert_eq!(grouped.hosts(), Some((2, 2)));
        assert_eq!(Place::by_rank(2, 5).after(4), 1);
        // Host spans, of any sizes: positions 0..3 (b), 3..5 (a), 5..7 (c);
        // none with one host, or with one rank on every host.
        let spans: Vec<_> = order.host_spans().collect();
        assert_eq!(spans, [0..3, 3..5, 5..7]);
        assert!(order.knows_hosts());
        let spans: Vec<_> = RingOrder::grouping_hosts(&[0, 0, 1, 1, 2])
            .host_spans()
            .collect();
        assert_eq!(spans, [0..2, 2..4, 4..5]);
        assert!(!RingOrder::grouping_hosts(&[7; 4]).knows_hosts());
        assert!(!RingOrder::grouping_hosts(&[0, 1, 2]).knows_hosts());
        assert!(!RingOrder::by_rank().knows_hosts());
    }

    /// The peers each rank's plan names: its ring neighbours in the order
    /// (one ring), or its host mates and rail mates only (two levels).
    #[test]
    fn plans_follow_the_ring_order() {
        let peers = |plan: &Plan| -> std::collections::BTreeSet<Rank> {
            plan.steps
                .iter()
                .flat_map(|s| match *s {
                    Step::Send { peer, .. }
                    | Step::Recv { peer, .. }
                    | Step::RecvReduce { peer, .. } => vec![peer],
                    Step::RecvReduceSend { from, to, .. } | Step::RecvCopySend { from, to, .. } => {
                        vec![from, to]
                    }
                    _ => vec![],
                })
                .collect()
        };
        let call = |op: OpKind, rank: Rank, world: usize| {
            let buf = BufDesc {
                len: 6 * world,
                memory: crate::desc::MemoryKind::Host,
            };
            let desc =
                CollectiveDesc::new(op, DType::F32, rank, world, crate::desc::MemoryKind::Host)
                    .with_send(buf)
                    .with_recv(buf);
            if op == OpKind::AllGather {
                desc.with_send(BufDesc { len: 6, ..buf })
            } else {
                desc.with_reduce_op(ReduceOp::Sum)
            }
        };
        // Five ranks, hosts of unequal size: one ring, 0 2 4 | 1 3.
        let order = RingOrder::grouping_hosts(&[0, 1, 0, 1, 0]);
        assert_eq!(order.hosts(), None);
        for (rank, want) in [
            (0, [3, 2]),
            (2, [0, 4]),
            (4, [2, 1]),
            (1, [4, 3]),
            (3, [1, 0]),
        ] {
            for op in [OpKind::AllReduce, OpKind::ReduceScatter, OpKind::AllGather] {
                let plan = plan_in_order(&call(op, rank, 5), 8, Family::Ring, &order);
                assert_eq!(peers(&plan), want.into(), "{op:?} rank {rank}");
            }
        }
        // Direct calls there go through the hosts' leaders, 0 and 1: the
        // others talk to their leader only, the leaders to their host
        // mates and to each other.
        for (rank, want) in [
            (0, vec![1, 2, 4]),
            (2, vec![0]),
            (4, vec![0]),
            (1, vec![0, 3]),
            (3, vec![1]),
        ] {
            for op in [OpKind::AllReduce, OpKind::ReduceScatter, OpKind::AllGather] {
                let plan = plan_in_order(&call(op, rank, 5), 8, Family::Direct, &order);
                let want: std::collections::BTreeSet<Rank> = want.iter().copied().collect();
                assert_eq!(peers(&plan), want, "direct {op:?} rank {rank}");
            }
        }
        assert_eq!(
            family_name_in(Family::Direct, OpKind::AllReduce, &order),
            "direct2level"
        );
        assert_eq!(
            family_name_in(Family::Ring, OpKind::AllReduce, &order),
            "ring"
        );
        // Six ranks round-robin on two hosts: 0 2 4 | 1 3 5, rails 0 1,
        // 2 3, 4 5.
        let order = RingOrder::grouping_hosts(&[0, 1, 0, 1, 0, 1]);
        assert_eq!(order.hosts(), Some((2, 3)));
        for rank in 0..6 {
            let host_mates: Vec<Rank> =
                (0..6).filter(|r| r % 2 == rank % 2 && *r != rank).collect();
            let rail_mate = rank ^ 1;
            // Rings and direct calls alike: only the rail mate is across.
            let mut host_and_rail: std::collections::BTreeSet<Rank> =
                host_mates.iter().copied().collect();
            host_and_rail.insert(rail_mate);
            for family in [Family::Ring, Family::Direct] {
                for op in [OpKind::AllReduce, OpKind::ReduceScatter, OpKind::AllGather] {
                    let plan = plan_in_order(&call(op, rank, 6), 8, family, &order);
                    assert_eq!(peers(&plan), host_and_rail, "{family:?} {op:?} rank {rank}");
                }
            }
            // A rooted direct call crosses once per other host: between the
            // root and that host's leader (0 and 1), or the root's host
            // mates and the root.
            for op in [OpKind::Broadcast, OpKind::Reduce] {
                for root in 0..6 {
                    let desc = call(op, rank, 6).with_root(root);
                    let plan = plan_in_order(&desc, 8, Family::Direct, &order);
                    let across: Vec<Rank> = peers(&plan)
                        .into_iter()
                        .filter(|p| p % 2 != rank % 2)
                        .collect();
                    let want = match () {
                        _ if rank == root => vec![1 - root % 2],
                        _ if rank < 2 && rank % 2 != root % 2 => vec![root],
                        _ => vec![],
                    };
                    assert_eq!(across, want, "{op:?} root {root} rank {rank}");
                }
            }
            assert_eq!(
                family_name_in(Family::Ring, OpKind::AllReduce, &order),
                "ring2level"
            );
            assert_eq!(
                family_name_in(Family::Ring, OpKind::Broadcast, &order),
                "chain"
            );
            assert_eq!(
                family_name_in(Family::Direct, OpKind::ReduceScatter, &order),
                "direct2level"
            );
            assert_eq!(
                family_name_in(Family::Direct, OpKind::Broadcast, &order),
                "direct2level"
            );
            assert_eq!(
                family_name_in(Family::Tree, OpKind::AllReduce, &order),
                "doubling"
            );
        }
    }

    #[test]
    #[should_panic(expected = "a permutation of the ranks")]
    fn a_ring_order_is_a_permutation() {
        RingOrder::from_ranks(vec![0, 2, 2]);
    }

    #[test]
    fn uneven_counts_differ_by_at_most_one() {
        let layout = ChunkLayout::new(10, 4, 100);
        let lens: Vec<usize> = (0..4).map(|c| layout.chunk(c).1).collect();
        assert_eq!(lens, [3, 3, 2, 2]);
        assert_eq!(ChunkLayout::new(0, 4, 8).pieces(), 0);
        assert_eq!(ChunkLayout::new(3, 5, 8).chunk(4), (3, 0));
    }
}
