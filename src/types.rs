//! Element types, reduction operators and operation names.
//!
//! # Reduction semantics
//!
//! These hold on every backend oxccl has. Every rank of a call receives the
//! same bits, and all-reduce equals reduce-scatter followed by all-gather bit
//! for bit. Floating-point results are bit-equal across backends and
//! algorithms only where they add the terms in one order and compute Avg
//! one way (an `f16` Avg premultiplies on the host and NCCL and divides at
//! the end on the cuda-ring: see the table): the shared arena
//! and the direct (one-step) schedules fold in rank order, `((x0 ⊕ x1) ⊕ x2)
//! ⊕ …` (across hosts the direct schedules fold each host's terms, then
//! the host sums in host order); a
//! ring starts each chunk at a different rank (as NCCL's does, and the
//! CUDA ring shares its plan), so the same call run as a ring (large calls
//! over TCP, `OXCCL_ALGO=ring`, the CUDA backends) or in two levels may
//! round differently, keep a different NaN payload, or give Min/Max a
//! different sign of zero. Integers, and Min/Max on other values, agree
//! everywhere.
//!
//! | op | integers (`i8 u8 i32 u32 i64 u64`) | floats (`f32 f64`) | `f16` / `bf16` |
//! |---|---|---|---|
//! | [`ReduceOp::Sum`] | wrapping (two's complement), as NCCL | IEEE addition | accumulate in `f32`, round to the type once per reduction step |
//! | [`ReduceOp::Prod`] | wrapping multiplication | IEEE multiplication | as `Sum`, with `*` |
//! | [`ReduceOp::Min`] / [`ReduceOp::Max`] | exact | exact; **NaN propagates**: if either operand is NaN the result is NaN | as floats (conversion to `f32` is exact) |
//! | [`ReduceOp::Avg`] | wrapping sum, then truncating division (toward zero) by the world size | sum, then one division by the world size | `f16`: each rank's input × `f16(1/N)`, rounded (NCCL's premultiplied sum), then summed as `Sum` (on the cuda-ring: as `bf16`); `bf16`: sum as above, then `f32` division, rounded once |
//!
//! Avg of `f16` scales every term by `1/N` before adding, as NCCL does, so
//! ranks whose mean fits the type never average to `inf`: eight ranks each
//! holding `10000` average to `10000`, though their sum passes 65504. On
//! the host this costs one pass over the input into a scratch copy that the
//! communicator keeps, as large as the largest such input so far (a copy
//! that cannot be allocated fails the call with
//! [`Error::InvalidArgument`](crate::Error) and the communicator with it,
//! since its peers are already in the call). Every `f16` Avg reduces from
//! that copy, in place or not, so across processes one on
//! [`alloc_shared`](crate::Communicator::alloc_shared) buffers does not run
//! zero-copy (between threads it still does). `bf16`, `f32` and `f64`,
//! whose range is at least `f32`'s, add in the element type and divide
//! once, in one pass: with a power-of-two world this gives NCCL's bits
//! (scaling by 2⁻ᵏ commutes with rounding, short of underflow); with
//! another world the two methods round differently (`oxccl-perf --backend
//! nccl -c` allows for it: `check::tolerance`).
//! The cuda-ring backend sums and then divides for every type.
//!
//! NaN propagation in Min/Max follows PyTorch's `torch.min`/`torch.max`
//! rather than C's `fmin`, so a diverged rank is visible in every rank's result
//! instead of being silently dropped. Which NaN payload survives two NaNs
//! meeting in one step is the backend's (on the host, in every float op: the
//! operand folded first, quieted); every rank still receives identical bits.

use std::fmt;

/// A rank: an index in `0..world_size` of a communicator.
///
/// Ranks are always `usize` in oxccl's API, never `i32`.
pub type Rank = usize;

/// The name of an operation, carried by errors and reported by tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpKind {
    /// [`Communicator::all_reduce`](crate::Communicator::all_reduce) and its in-place variant.
    AllReduce,
    /// [`Communicator::reduce_scatter`](crate::Communicator::reduce_scatter) and its in-place variant.
    ReduceScatter,
    /// [`Communicator::all_gather`](crate::Communicator::all_gather) and its in-place variant.
    AllGather,
    /// [`Communicator::broadcast`](crate::Communicator::broadcast) and its in-place variant.
    Broadcast,
    /// [`Communicator::reduce`](crate::Communicator::reduce) and its in-place variant.
    Reduce,
    /// [`Communicator::send`](crate::Communicator::send).
    Send,
    /// [`Communicator::recv`](crate::Communicator::recv).
    Recv,
    /// [`Communicator::all_to_all`](crate::Communicator::all_to_all).
    AllToAll,
    /// [`Communicator::barrier`](crate::Communicator::barrier).
    Barrier,
    /// [`Communicator::split`](crate::Communicator::split).
    Split,
    /// [`Communicator::alloc_shared`](crate::Communicator::alloc_shared).
    AllocShared,
    /// Making a communicator: [`CommBuilder::init`](crate::CommBuilder::init),
    /// [`CommBuilder::local_group`](crate::CommBuilder::local_group) and
    /// their kin (arguments checked before any rendezvous).
    Init,
}

impl OpKind {
    /// Every operation, in the order of their wire codes.
    const ALL: [OpKind; 12] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::Send,
        OpKind::Recv,
        OpKind::AllToAll,
        OpKind::Barrier,
        OpKind::Split,
        OpKind::AllocShared,
        OpKind::Init,
    ];

    /// The operation's code in frame headers: its index in [`Self::ALL`]
    /// (a test checks the two agree). A match, not a search: every lane
    /// call computes it for its signature.
    #[inline]
    pub(crate) fn code(self) -> u8 {
        match self {
            OpKind::AllReduce => 0,
            OpKind::ReduceScatter => 1,
            OpKind::AllGather => 2,
            OpKind::Broadcast => 3,
            OpKind::Reduce => 4,
            OpKind::Send => 5,
            OpKind::Recv => 6,
            OpKind::AllToAll => 7,
            OpKind::Barrier => 8,
            OpKind::Split => 9,
            OpKind::AllocShared => 10,
            OpKind::Init => 11,
        }
    }

    /// The operation with wire code `code`.
    pub(crate) fn from_code(code: u8) -> Option<OpKind> {
        Self::ALL.get(usize::from(code)).copied()
    }

    /// The snake_case name used in messages and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
            OpKind::AllocShared => "alloc_shared",
            OpKind::Init => "init",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A reduction operator.
///
/// See the [module documentation](self) for the exact semantics per type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum; integers wrap.
    Sum,
    /// Product; integers wrap.
    Prod,
    /// Minimum; NaN propagates.
    Min,
    /// Maximum; NaN propagates.
    Max,
    /// Sum, then divide by the world size. Integers: the sum wraps in the
    /// type first, then divides truncating toward zero (two `i8` ranks
    /// holding 100 average to -28: 200 wraps to -56).
    Avg,
}

impl ReduceOp {
    /// All operators, in the order nccl-tests lists them.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The name nccl-tests prints (`sum`, `prod`, `max`, `min`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Parses a name as printed by [`ReduceOp::name`].
    pub fn from_name(name: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|op| op.name() == name)
    }

    /// The operator applied at each pairwise reduction step: `Avg` combines as
    /// `Sum` and divides once at the end.
    pub(crate) fn combining(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The run-time tag of an [`Element`] type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// `i8`
    I8,
    /// `u8`
    U8,
    /// `i32`
    I32,
    /// `u32`
    U32,
    /// `i64`
    I64,
    /// `u64`
    U64,
    /// [`half::f16`]
    F16,
    /// `f32`
    F32,
    /// `f64`
    F64,
    /// [`half::bf16`]
    BF16,
}

impl DType {
    /// Whether the host backend's [`ReduceOp::Avg`] of this type scales each
    /// rank's input by `1/N` before summing (`f16`: see the module docs),
    /// the run-time face of the element type's
    /// [`Kernels::AVG_PREMULTIPLIES`](crate::host::reduce::Kernels::AVG_PREMULTIPLIES).
    pub fn avg_premultiplies_on_host(self) -> bool {
        use crate::host::reduce::Kernels;
        match self {
            DType::I8 => i8::AVG_PREMULTIPLIES,
            DType::U8 => u8::AVG_PREMULTIPLIES,
            DType::I32 => i32::AVG_PREMULTIPLIES,
            DType::U32 => u32::AVG_PREMULTIPLIES,
            DType::I64 => i64::AVG_PREMULTIPLIES,
            DType::U64 => u64::AVG_PREMULTIPLIES,
            DType::F16 => half::f16::AVG_PREMULTIPLIES,
            DType::F32 => f32::AVG_PREMULTIPLIES,
            DType::F64 => f64::AVG_PREMULTIPLIES,
            DType::BF16 => half::bf16::AVG_PREMULTIPLIES,
        }
    }

    /// Every dtype, in nccl-tests' order.
    pub const ALL: [DType; 10] = [
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::BF16,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// The name nccl-tests prints (`int8`, `float`, `bfloat16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F16 => "half",
            DType::F32 => "float",
            DType::F64 => "double",
            DType::BF16 => "bfloat16",
        }
    }

    /// Parses nccl-tests' names and the Rust type names (`float` or `f32`).
    pub fn from_name(name: &str) -> Option<DType> {
        let rust_name = match name {
            "i8" => "int8",
            "u8" => "uint8",
            "i32" | "int" => "int32",
            "u32" => "uint32",
            "i64" => "int64",
            "u64" => "uint64",
            "f16" => "half",
            "f32" => "float",
            "f64" => "double",
            "bf16" => "bfloat16",
            other => other,
        };
        DType::ALL.into_iter().find(|d| d.name() == rust_name)
    }

    /// Whether the type is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Seals [`Element`]: the trait is public but unnameable outside the crate.
mod sealed {
    pub trait Sealed {}
}

/// An element type that oxccl can reduce and move.
///
/// Sealed: implemented for `f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64` and nothing
/// else, because every backend must implement every reduction for every type,
/// and the device paths size transfers by [`DTYPE`](Element::DTYPE): a
/// foreign type tagged with a wider one would make them overrun its buffers.
pub trait Element:
    bytemuck::Pod
    + PartialEq
    + fmt::Debug
    + Send
    + Sync
    + 'static
    + crate::host::reduce::Kernels
    + sealed::Sealed
{
    /// The run-time tag of this type.
    const DTYPE: DType;

    /// The value as an `f64` (exact for every type but 64-bit integers beyond 2^53).
    fn to_f64(self) -> f64;

    /// The value in this type: integers saturate (NaN to 0), `f32` rounds
    /// to nearest, `f16`/`bf16` convert as the `half` crate does (which
    /// can round twice: `bf16::from_f64(1 + 2^-8 + 2^-40)` is 1, not the
    /// nearest, 1 + 2^-7).
    fn from_f64(value: f64) -> Self;

    /// `value` reduced modulo 2^bits for integers (two's complement wrap);
    /// for floats rounded as [`from_f64`](Self::from_f64) rounds (through
    /// `f64` for the 16-bit ones). Used to state closed-form expectations.
    fn from_i64_wrapping(value: i64) -> Self;
}

macro_rules! int_element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn to_f64(self) -> f64 { self as f64 }
            fn from_f64(value: f64) -> Self { value as $t }
            fn from_i64_wrapping(value: i64) -> Self { value as $t }
        }
    )*};
}

// Every element type's tag states its size: transfers are sized by it.
macro_rules! sealed_element {
    ($($t:ty),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        const _: () = assert!(std::mem::size_of::<$t>() == <$t as Element>::DTYPE.size());
    )*};
}
sealed_element!(i8, u8, i32, u32, i64, u64, f32, f64, half::f16, half::bf16);
int_element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64);

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(value: f64) -> Self {
        value as f32
    }
    fn from_i64_wrapping(value: i64) -> Self {
        value as f32
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(value: f64) -> Self {
        value
    }
    fn from_i64_wrapping(value: i64) -> Self {
        value as f64
    }
}

impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(value: f64) -> Self {
        half::f16::from_f64(value)
    }
    fn from_i64_wrapping(value: i64) -> Self {
        half::f16::from_f64(value as f64)
    }
}

impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(value: f64) -> Self {
        half::bf16::from_f64(value)
    }
    fn from_i64_wrapping(value: i64) -> Self {
        half::bf16::from_f64(value as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frame headers carry `code`; receivers decode with `from_code`, which
    /// indexes `ALL`: the two must agree for every operation.
    #[test]
    fn op_codes_are_their_index_in_all() {
        for (i, op) in OpKind::ALL.iter().enumerate() {
            assert_eq!(usize::from(op.code()), i, "{op:?}");
            assert_eq!(OpKind::from_code(op.code()), Some(*op));
        }
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_name(op.name()), Some(op));
        }
        assert_eq!(DType::from_name("f32"), Some(DType::F32));
        assert_eq!(DType::from_name("bf16"), Some(DType::BF16));
        assert_eq!(DType::from_name("float32"), None);
    }

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F16.size(), std::mem::size_of::<half::f16>());
        assert_eq!(DType::BF16.size(), std::mem::size_of::<half::bf16>());
        assert_eq!(DType::U64.size(), 8);
        assert_eq!(<i8 as Element>::DTYPE, DType::I8);
    }

    #[test]
    fn wrapping_conversion() {
        assert_eq!(i8::from_i64_wrapping(128), -128);
        assert_eq!(u8::from_i64_wrapping(256), 0);
        assert_eq!(u32::from_i64_wrapping(-1), u32::MAX);
    }
}
