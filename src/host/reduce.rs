//! CPU reduction loops for every element type and operator.
//!
//! Each loop is a plain `zip` over two or three slices with the operator
//! chosen *outside* the loop, so the compiler emits one branch-free,
//! auto-vectorised loop per (type, operator). `f16`/`bf16` are converted to
//! `f32` in blocks that stay in L1 (the slice conversions in `half` use F16C
//! where the CPU has it), combined in `f32`, and rounded back once per
//! reduction step — the semantics documented in [`crate::types`].
//!
//! Operand order is part of the contract: `combine_into(out, a, b)` computes
//! `a ⊕ b`, `combine_assign(acc, x)` computes `acc ⊕ x` and
//! `combine_assign_rev(acc, x)` computes `x ⊕ acc`. Every operator is
//! commutative for non-NaN values, but keeping the order fixed makes the
//! executors' results reproducible even in the NaN cases.

use convert::Half;

#[cfg(target_arch = "x86_64")]
mod half_fused;

use crate::types::ReduceOp;

/// The direction in which [`Kernels::combine_into_both`] walks its
/// elements. Two ranks that fold adjacent shares of the same buffers at
/// once walk away from their common boundary: a walk towards it lets the
/// L2 stream prefetcher run past it, into the lines the other rank is
/// writing, and that rank then takes each of them back (see
/// `Arena::zero_copy_all_reduce`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// From the first element to the last.
    Up,
    /// From the last element to the first.
    Down,
}

/// Per-type reduction kernels, a supertrait of [`crate::Element`]. Public
/// for the kernel benchmark (`benches/reduce.rs`); a type implementing it
/// reaches no collective, since `Element` is sealed.
pub trait Kernels: Sized + Copy {
    /// `out[i] = a[i] ⊕ b[i]`. `Avg` combines as `Sum`.
    fn combine_into(op: ReduceOp, out: &mut [Self], a: &[Self], b: &[Self]);
    /// `acc[i] = acc[i] ⊕ x[i]`. `Avg` combines as `Sum`.
    fn combine_assign(op: ReduceOp, acc: &mut [Self], x: &[Self]);
    /// `acc[i] = x[i] ⊕ acc[i]`. `Avg` combines as `Sum`.
    fn combine_assign_rev(op: ReduceOp, acc: &mut [Self], x: &[Self]);
    /// `acc[i] = acc[i] / n`: the final step of `Avg` (for the types
    /// whose `Avg` does not premultiply: see [`finish_avg`]).
    fn divide_by(acc: &mut [Self], n: usize);

    /// Whether this type's `Avg` scales every rank's input by `1/world`
    /// *before* the collective and then sums ([`premultiply_avg`]), as
    /// NCCL's `ncclAvg` does for floats, rather than summing and dividing
    /// once. True for `f16` alone: its sum passes 65504 (eight ranks of
    /// 10000) where its mean does not, and an `inf` mean is useless. The
    /// types with `f32`'s range (`bf16`, `f32`, `f64`) keep the one pass of
    /// sum-then-divide; with a power-of-two world both methods give the
    /// same bits (scaling by 2⁻ᵏ commutes with rounding, short of
    /// underflow), and with another world they differ by rounding only.
    ///
    /// [`premultiply_avg`]: Kernels::premultiply_avg
    const AVG_PREMULTIPLIES: bool = false;

    /// `dst[i] = src[i] × s` with `s = 1/world` rounded to the type, the
    /// product rounded once: NCCL's `PreMulSum` scaling (its scalar is
    /// `__float2half(float(1.0/nRanks))`). Called only for the types whose
    /// [`AVG_PREMULTIPLIES`](Kernels::AVG_PREMULTIPLIES) is true; the
    /// others copy.
    fn premultiply_avg(dst: &mut [Self], src: &[Self], world: usize) {
        let _ = world;
        dst.copy_from_slice(src);
    }

    /// `d0[i] = d1[i] = x0[i] ⊕ x1[i]` for `i < n`: a two-rank all-reduce
    /// writing its share into both outputs. `Avg` combines as `Sum`.
    /// `f32`, `f64` and the integers do it in one pass (C loops of both
    /// forms on one Zen 4 core, a 128 KiB share from L2, any relative
    /// alignment: 2.3 µs in one pass against 3.3–3.4 folding 8 KiB blocks
    /// and copying them); so do the 16-bit floats where AVX2 (and F16C)
    /// allow, in steps of eight or sixteen (`half_fused`), the rest folded
    /// and then copied (`fold_then_copy`).
    ///
    /// `walk` is the order in which the one-pass kernels visit the
    /// elements (the two-pass folds always walk up).
    ///
    /// # Safety
    /// Each pointer is valid for `n` elements; `d0` is `x0` or lies apart
    /// from all three others, and `d1` is `x1` or lies apart from all three
    /// others (a rank's output is its input in place, or its own buffer).
    unsafe fn combine_into_both(
        op: ReduceOp,
        d: (*mut Self, *mut Self),
        x: (*const Self, *const Self),
        n: usize,
        _walk: Walk,
    ) {
        // SAFETY: the caller's contract.
        unsafe { fold_then_copy(op, d, x, n) }
    }

    /// [`combine_into_both`](Kernels::combine_into_both) for the `Avg` of
    /// two ranks: both outputs get the terms' sum halved, the bits that
    /// `combine_into` and then [`finish_avg`] give, in one pass. Returns
    /// whether it did: where a type has no one-pass form (`bf16`, whose
    /// sum is rounded to `bf16` before it is halved, without AVX2 or below
    /// one sixteen-element step) it writes nothing, and the caller folds,
    /// finishes and copies.
    ///
    /// # Safety
    /// As [`combine_into_both`](Kernels::combine_into_both).
    unsafe fn average_two_into_both(
        _d: (*mut Self, *mut Self),
        _x: (*const Self, *const Self),
        _n: usize,
        _walk: Walk,
    ) -> bool {
        false
    }
}

/// [`Kernels::combine_into_both`] in two passes: the share folded into one
/// output (the one that is its own input, in place), then copied into the
/// other. The types without a one-pass form use it, and the 16-bit floats
/// for what their one-pass steps leave.
///
/// # Safety
/// As [`Kernels::combine_into_both`].
unsafe fn fold_then_copy<T: Kernels>(
    op: ReduceOp,
    (d0, d1): (*mut T, *mut T),
    (x0, x1): (*const T, *const T),
    n: usize,
) {
    // SAFETY: the caller's contract; each branch forms one mutable and
    // one shared slice that do not overlap.
    unsafe {
        let folded = if std::ptr::eq(d0, x0) {
            T::combine_assign(
                op,
                std::slice::from_raw_parts_mut(d0, n),
                std::slice::from_raw_parts(x1, n),
            );
            d0
        } else if std::ptr::eq(d1, x1) {
            T::combine_assign_rev(
                op,
                std::slice::from_raw_parts_mut(d1, n),
                std::slice::from_raw_parts(x0, n),
            );
            d1
        } else {
            T::combine_into(
                op,
                std::slice::from_raw_parts_mut(d0, n),
                std::slice::from_raw_parts(x0, n),
                std::slice::from_raw_parts(x1, n),
            );
            d0
        };
        for d in [d0, d1] {
            if !std::ptr::eq(d, folded) {
                super::stream::copy_cached(folded, d, n);
            }
        }
    }
}

// Every loop below is compiled twice on x86-64: for the baseline (SSE2)
// and with AVX2, picked at run time. Binaries are built for any x86-64,
// but a reduction that runs from L1/L2 is about twice as fast 256 bits
// wide, and the collectives spend their time in these loops and in memcpy
// (which glibc already dispatches the same way).

/// The end of an `Avg` fold, whose terms were combined as `Sum`: the
/// division by the world size, unless the type's inputs were scaled by
/// `1/world` before the collective ([`Kernels::AVG_PREMULTIPLIES`]). Every
/// host path ends its `Avg` folds here, so they agree bit for bit.
#[inline]
pub fn finish_avg<T: Kernels>(op: ReduceOp, acc: &mut [T], world: usize) {
    if op == ReduceOp::Avg && !T::AVG_PREMULTIPLIES {
        T::divide_by(acc, world);
    }
}

/// Two ranks' fold of `op` into both outputs in one pass
/// ([`Kernels::combine_into_both`], for `Avg`
/// [`Kernels::average_two_into_both`]). Returns false, having written
/// nothing, where the type has no one-pass `Avg` (bf16 without AVX2, or
/// below one sixteen-element step).
///
/// # Safety
/// As [`Kernels::combine_into_both`].
#[inline]
pub unsafe fn fold_two_into_both<T: Kernels>(
    op: ReduceOp,
    d: (*mut T, *mut T),
    x: (*const T, *const T),
    n: usize,
    walk: Walk,
) -> bool {
    // SAFETY: the caller's contract.
    unsafe {
        if op == ReduceOp::Avg {
            return T::average_two_into_both(d, x, n, walk);
        }
        T::combine_into_both(op, d, x, n, walk);
    }
    true
}

/// `1/n` where dividing by `n` is multiplying by it: `n` a power of two
/// above 1 (at most 2⁶³), so `1/n` is exact and normal in `f32` and `f64`
/// (where the callers use it; the 16-bit types scale in `f32`) and `x / n` and
/// `x · (1/n)` are the same exact value rounded once, the same bits for
/// every `x` (NaNs, zeros and subnormals included). A multiply pipelines
/// where a divide holds the divider for several cycles per vector: Avg's
/// division had made an f32 all-reduce of 1 MiB between threads take
/// 55–63 µs against its Sum's 16–30, and a bf16 one 144–188 against 25–30.
fn exact_reciprocal(n: usize) -> Option<f64> {
    (n > 1 && n.is_power_of_two()).then(|| 1.0 / n as f64)
}

/// Whether the AVX2 versions may run (detected once, then a cached load).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

#[inline(always)]
fn zip_into_portable<T: Copy>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

#[inline(always)]
fn zip_assign_portable<T: Copy>(acc: &mut [T], x: &[T], f: impl Fn(T, T) -> T) {
    debug_assert_eq!(acc.len(), x.len());
    for (a, &b) in acc.iter_mut().zip(x) {
        *a = f(*a, b);
    }
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn zip_into_avx2<T: Copy>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    zip_into_portable(out, a, b, f)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn zip_assign_avx2<T: Copy>(acc: &mut [T], x: &[T], f: impl Fn(T, T) -> T) {
    zip_assign_portable(acc, x, f)
}

/// Bytes to which the vector loops align the buffer they store to.
const STORE_ALIGN: usize = 32;

/// How many of `n` elements at `ptr` come before the first
/// [`STORE_ALIGN`]-byte boundary. The loops run those one by one, so their
/// 32-byte accesses to that buffer (and to any buffer equally misaligned,
/// as two `malloc`ed ones usually are) never straddle a cache line: on
/// this machine's Zen 4 a 32 KiB two-output fold from L1/L2 took
/// 0.80–0.94 µs with every buffer 16 bytes off against 0.58 µs aligned
/// (C loop).
#[inline(always)]
fn unaligned_head<T>(ptr: *const T, n: usize) -> usize {
    let size = std::mem::size_of::<T>();
    let misaligned = ptr as usize % STORE_ALIGN;
    if misaligned == 0 || !misaligned.is_multiple_of(size) {
        return 0;
    }
    ((STORE_ALIGN - misaligned) / size).min(n)
}

/// Bytes below which the kernels run their plain loop at once: the
/// alignment head and the AVX2 dispatch cost more than they save on a few
/// elements (an 8-byte all-reduce spent about 70 instructions per fold
/// there, `callgrind`).
const SMALL_ZIP_BYTES: usize = 64;

/// Whether `n` elements of `T` take the plain loop (see [`SMALL_ZIP_BYTES`]).
#[inline(always)]
fn small_zip<T>(n: usize) -> bool {
    n * std::mem::size_of::<T>() < SMALL_ZIP_BYTES
}

#[inline(always)]
fn zip_into<T: Copy>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    if small_zip::<T>(out.len()) {
        return zip_into_portable(out, a, b, f);
    }
    let h = unaligned_head(out.as_ptr(), out.len());
    let (out_head, out) = out.split_at_mut(h);
    let ((a_head, a), (b_head, b)) = (a.split_at(h), b.split_at(h));
    zip_into_portable(out_head, a_head, b_head, &f);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 is present (checked at run time).
        return unsafe { zip_into_avx2(out, a, b, f) };
    }
    zip_into_portable(out, a, b, f)
}

#[inline(always)]
fn zip_assign<T: Copy>(acc: &mut [T], x: &[T], f: impl Fn(T, T) -> T) {
    if small_zip::<T>(acc.len()) {
        return zip_assign_portable(acc, x, f);
    }
    let h = unaligned_head(acc.as_ptr(), acc.len());
    let (acc_head, acc) = acc.split_at_mut(h);
    let (x_head, x) = x.split_at(h);
    zip_assign_portable(acc_head, x_head, &f);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 is present (checked at run time).
        return unsafe { zip_assign_avx2(acc, x, f) };
    }
    zip_assign_portable(acc, x, f)
}

/// Elements per step of [`zip_into_both_portable`]: loaded whole before
/// either store, so an output that is its input (in place) reads every
/// element before writing it.
const BOTH_STEP: usize = 32;

/// One step of [`zip_into_both_portable`]: elements `i..i + BOTH_STEP`,
/// all loaded before either store. A function rather than a closure: the
/// loops calling a closure here compiled 2.5 times slower.
///
/// # Safety
/// As [`Kernels::combine_into_both`], for those elements.
#[inline(always)]
unsafe fn both_step<T: Copy>(
    (d0, d1): (*mut T, *mut T),
    (x0, x1): (*const T, *const T),
    i: usize,
    f: &impl Fn(T, T) -> T,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let a = x0.add(i).cast::<[T; BOTH_STEP]>().read_unaligned();
        let b = x1.add(i).cast::<[T; BOTH_STEP]>().read_unaligned();
        let mut r = a;
        for j in 0..BOTH_STEP {
            r[j] = f(a[j], b[j]);
        }
        d0.add(i).cast::<[T; BOTH_STEP]>().write_unaligned(r);
        d1.add(i).cast::<[T; BOTH_STEP]>().write_unaligned(r);
    }
}

/// Element `i` of [`zip_into_both_portable`].
///
/// # Safety
/// As [`Kernels::combine_into_both`], for that element.
#[inline(always)]
unsafe fn both_one<T: Copy>(
    (d0, d1): (*mut T, *mut T),
    (x0, x1): (*const T, *const T),
    i: usize,
    f: &impl Fn(T, T) -> T,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let v = f(x0.add(i).read(), x1.add(i).read());
        d0.add(i).write(v);
        d1.add(i).write(v);
    }
}

/// `d0[i] = d1[i] = f(x0[i], x1[i])`, one pass. Steps of [`BOTH_STEP`]
/// elements go through fixed-size arrays, which the compiler keeps in
/// vector registers: plain pointer loops would be versioned on an overlap
/// check that in-place calls fail, and run scalar.
///
/// # Safety
/// As [`Kernels::combine_into_both`].
#[inline(always)]
unsafe fn zip_into_both_portable<T: Copy>(
    (d0, d1): (*mut T, *mut T),
    (x0, x1): (*const T, *const T),
    n: usize,
    walk: Walk,
    f: impl Fn(T, T) -> T,
) {
    // SAFETY: every access is below n; within a step all loads precede
    // the stores, and steps are disjoint. Walking down, the `n %
    // BOTH_STEP` elements at the top go one by one first, so the steps
    // keep the alignment the caller gave `d0`.
    unsafe {
        match walk {
            Walk::Up => {
                let mut i = 0;
                while i + BOTH_STEP <= n {
                    both_step((d0, d1), (x0, x1), i, &f);
                    i += BOTH_STEP;
                }
                while i < n {
                    both_one((d0, d1), (x0, x1), i, &f);
                    i += 1;
                }
            }
            Walk::Down => {
                let mut i = n;
                while !i.is_multiple_of(BOTH_STEP) {
                    i -= 1;
                    both_one((d0, d1), (x0, x1), i, &f);
                }
                while i > 0 {
                    i -= BOTH_STEP;
                    both_step((d0, d1), (x0, x1), i, &f);
                }
            }
        }
    }
}

/// # Safety
/// The CPU must support AVX2; and as [`Kernels::combine_into_both`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn zip_into_both_avx2<T: Copy>(
    d: (*mut T, *mut T),
    x: (*const T, *const T),
    n: usize,
    walk: Walk,
    f: impl Fn(T, T) -> T,
) {
    // SAFETY: the caller's contract.
    unsafe { zip_into_both_portable(d, x, n, walk, f) }
}

/// # Safety
/// As [`Kernels::combine_into_both`].
#[inline(always)]
unsafe fn zip_into_both<T: Copy>(
    d: (*mut T, *mut T),
    x: (*const T, *const T),
    n: usize,
    walk: Walk,
    f: impl Fn(T, T) -> T,
) {
    // The head (elements before `d0`'s first aligned address) goes first
    // walking up and last walking down.
    let h = unaligned_head(d.0, n);
    // SAFETY: the caller's contract; the head and the rest split all four
    // buffers at the same element.
    let (rest_d, rest_x) = unsafe { ((d.0.add(h), d.1.add(h)), (x.0.add(h), x.1.add(h))) };
    if walk == Walk::Up {
        // SAFETY: as above.
        unsafe { zip_into_both_portable(d, x, h, walk, &f) };
    }
    // SAFETY: as above; AVX2 only where present (checked at run time).
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            zip_into_both_avx2(rest_d, rest_x, n - h, walk, &f);
        } else {
            zip_into_both_portable(rest_d, rest_x, n - h, walk, &f);
        }
        #[cfg(not(target_arch = "x86_64"))]
        zip_into_both_portable(rest_d, rest_x, n - h, walk, &f);
    }
    if walk == Walk::Down {
        // SAFETY: as above.
        unsafe { zip_into_both_portable(d, x, h, walk, &f) };
    }
}

/// Expands to a `match` on the operator that binds `$f` to the element-wise
/// closure for that operator and expands `$body` once per arm, so each arm is
/// its own monomorphised (and vectorised) loop.
macro_rules! dispatch_op {
    ($op:expr, |$f:ident| $body:expr, $sum:expr, $prod:expr, $min:expr, $max:expr) => {
        match $op.combining() {
            ReduceOp::Sum => {
                let $f = $sum;
                $body
            }
            ReduceOp::Prod => {
                let $f = $prod;
                $body
            }
            ReduceOp::Min => {
                let $f = $min;
                $body
            }
            // `combining()` never returns Avg; Max shares the last arm.
            ReduceOp::Max | ReduceOp::Avg => {
                let $f = $max;
                $body
            }
        }
    };
}

/// Division of integers by a power of two.
trait ShiftTowardZero: Sized {
    /// `a / 2^k` for `k` below the type's width, as `/` gives it (toward
    /// zero): a shift, a negative value biased by `2^k - 1` first, which
    /// cannot overflow. `/` by a divisor known only at run time is a
    /// hardware divide per element: an i32 Avg of 1 MiB took 16 times
    /// its Sum.
    fn shift_toward_zero(a: Self, k: u32) -> Self;
}

macro_rules! int_kernels {
    ($($t:ty),*) => {$(
        impl ShiftTowardZero for $t {
            #[inline(always)]
            fn shift_toward_zero(a: Self, k: u32) -> Self {
                #[allow(unused_comparisons)]
                let signed = <$t>::MIN < 0;
                // All ones for a negative value, else zero.
                let negative = if signed { a >> (<$t>::BITS - 1) } else { 0 };
                let below = ((1 as $t) << k).wrapping_sub(1);
                a.wrapping_add(negative & below) >> k
            }
        }
        impl Kernels for $t {
            fn combine_into(op: ReduceOp, out: &mut [Self], a: &[Self], b: &[Self]) {
                dispatch_op!(op, |f| zip_into(out, a, b, f), <$t>::wrapping_add, <$t>::wrapping_mul, <$t>::min, <$t>::max)
            }
            fn combine_assign(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                dispatch_op!(op, |f| zip_assign(acc, x, f), <$t>::wrapping_add, <$t>::wrapping_mul, <$t>::min, <$t>::max)
            }
            fn combine_assign_rev(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                // Integer operators are exactly commutative.
                Self::combine_assign(op, acc, x)
            }
            unsafe fn combine_into_both(op: ReduceOp, d: (*mut Self, *mut Self), x: (*const Self, *const Self), n: usize, walk: Walk) {
                // SAFETY: the caller's contract.
                dispatch_op!(op, |f| unsafe { zip_into_both(d, x, n, walk, f) }, <$t>::wrapping_add, <$t>::wrapping_mul, <$t>::min, <$t>::max)
            }
            unsafe fn average_two_into_both(d: (*mut Self, *mut Self), x: (*const Self, *const Self), n: usize, walk: Walk) -> bool {
                // The wrapped sum halved as `divide_by(2)` halves it.
                // SAFETY: the caller's contract.
                unsafe { zip_into_both(d, x, n, walk, |a: $t, b: $t| Self::shift_toward_zero(a.wrapping_add(b), 1)) };
                true
            }
            fn divide_by(acc: &mut [Self], n: usize) {
                debug_assert!(n > 0);
                match <$t>::try_from(n) {
                    // By 2^k (below the type's range), a shift.
                    Ok(_) if n.is_power_of_two() => {
                        let k = n.trailing_zeros();
                        acc.iter_mut().for_each(|a| *a = Self::shift_toward_zero(*a, k))
                    }
                    Ok(divisor) => acc.iter_mut().for_each(|a| *a /= divisor),
                    // A world larger than the type's range: divide exactly in
                    // a wider type (the quotient then always fits).
                    Err(_) => acc.iter_mut().for_each(|a| *a = (*a as i128 / n as i128) as $t),
                }
            }
        }
    )*};
}
int_kernels!(i8, u8, i32, u32, i64, u64);

macro_rules! float_kernels {
    ($($t:ty),*) => {$(
        impl Kernels for $t {
            fn combine_into(op: ReduceOp, out: &mut [Self], a: &[Self], b: &[Self]) {
                dispatch_op!(op, |f| zip_into(out, a, b, f), nan_sum::<$t>, nan_prod::<$t>, nan_min::<$t>, nan_max::<$t>)
            }
            fn combine_assign(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                dispatch_op!(op, |f| zip_assign(acc, x, f), nan_sum::<$t>, nan_prod::<$t>, nan_min::<$t>, nan_max::<$t>)
            }
            fn combine_assign_rev(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                dispatch_op!(
                    op,
                    |f| zip_assign(acc, x, f),
                    |a: $t, x: $t| nan_sum(x, a),
                    |a: $t, x: $t| nan_prod(x, a),
                    |a: $t, x: $t| nan_min(x, a),
                    |a: $t, x: $t| nan_max(x, a)
                )
            }
            unsafe fn combine_into_both(op: ReduceOp, d: (*mut Self, *mut Self), x: (*const Self, *const Self), n: usize, walk: Walk) {
                // SAFETY: the caller's contract.
                dispatch_op!(op, |f| unsafe { zip_into_both(d, x, n, walk, f) }, nan_sum::<$t>, nan_prod::<$t>, nan_min::<$t>, nan_max::<$t>)
            }
            unsafe fn average_two_into_both(d: (*mut Self, *mut Self), x: (*const Self, *const Self), n: usize, walk: Walk) -> bool {
                // The sum times 1/2, exactly what `divide_by(2)` computes
                // (see `exact_reciprocal`).
                // SAFETY: the caller's contract.
                unsafe { zip_into_both(d, x, n, walk, |a: $t, b: $t| nan_sum(a, b) * 0.5) };
                true
            }
            fn divide_by(acc: &mut [Self], n: usize) {
                // By one: the values as they are (x / 1 would quiet a
                // signalling NaN, which the plans that skip the division
                // for one rank keep).
                if n == 1 {
                    return;
                }
                if let Some(reciprocal) = exact_reciprocal(n) {
                    let reciprocal = reciprocal as $t;
                    return acc.iter_mut().for_each(|a| *a *= reciprocal);
                }
                let divisor = n as $t;
                acc.iter_mut().for_each(|a| *a /= divisor);
            }
        }
    )*};
}
float_kernels!(f32, f64);

/// `a + b`, and of two NaNs the first, quieted (x + x keeps x's payload
/// and sign). A bare `a + b` leaves that pick to the compiler, which
/// commutes the operands in one loop and not in another (`combine_assign`
/// gave `b`'s NaN where `combine_into` gave `a`'s), so ranks folding
/// through different kernels got different NaNs. With one NaN, or none,
/// the sum is the same whichever operand comes first.
#[inline(always)]
fn nan_sum<T: num_like::Float>(a: T, b: T) -> T {
    // One addition of a picked operand (a compare and a blend more than
    // `a + b`), not two additions and a pick.
    a.add_(if a.is_nan_() { a } else { b })
}

/// `a · b`, and of two NaNs the first, quieted: see [`nan_sum`].
#[inline(always)]
fn nan_prod<T: num_like::Float>(a: T, b: T) -> T {
    // a · a keeps a NaN's payload and sign as a + a does.
    a.mul_(if a.is_nan_() { a } else { b })
}

/// Minimum that propagates NaN (unlike `f32::min`, which drops it).
#[inline(always)]
fn nan_min<T: num_like::Float>(a: T, b: T) -> T {
    // The first NaN, quieted (x + x keeps x's payload and sign): `a + b`
    // leaves the pick to the compiler, which may commute the operands in
    // one loop and not in another (a rank's scalar head against another's
    // vector body gave ranks different NaNs).
    if a.is_nan_() || b.is_nan_() {
        let first = if a.is_nan_() { a } else { b };
        first.add_(first)
    } else if b < a {
        b
    } else {
        a
    }
}

/// Maximum that propagates NaN (unlike `f32::max`, which drops it).
#[inline(always)]
fn nan_max<T: num_like::Float>(a: T, b: T) -> T {
    // The first NaN, quieted (x + x keeps x's payload and sign): `a + b`
    // leaves the pick to the compiler, which may commute the operands in
    // one loop and not in another (a rank's scalar head against another's
    // vector body gave ranks different NaNs).
    if a.is_nan_() || b.is_nan_() {
        let first = if a.is_nan_() { a } else { b };
        first.add_(first)
    } else if b > a {
        b
    } else {
        a
    }
}

mod num_like {
    /// The float operations the NaN-picking folds need, for `f32` and `f64`.
    pub trait Float: Copy + PartialOrd {
        fn is_nan_(self) -> bool;
        fn add_(self, other: Self) -> Self;
        fn mul_(self, other: Self) -> Self;
    }
    impl Float for f32 {
        fn is_nan_(self) -> bool {
            self.is_nan()
        }
        fn add_(self, other: Self) -> Self {
            self + other
        }
        fn mul_(self, other: Self) -> Self {
            self * other
        }
    }
    impl Float for f64 {
        fn is_nan_(self) -> bool {
            self.is_nan()
        }
        fn add_(self, other: Self) -> Self {
            self + other
        }
        fn mul_(self, other: Self) -> Self {
            self * other
        }
    }
}

/// Bulk conversions between the 16-bit floats and `f32`, bit-identical to
/// `half`'s scalar ones (round to nearest even, NaN kept quiet) but
/// vectorised: `bf16` is integer arithmetic the compiler widens to AVX2,
/// `f16` uses the F16C instructions when the CPU has them. `half`'s own
/// slice conversions run at a few GB/s, a fifth of a plain `f32` sum.
mod convert {
    use crate::types::ReduceOp;
    use half::slice::HalfFloatSliceExt;
    use half::{bf16, f16};

    /// `f32` bits to `bf16` bits, as `bf16::from_f32`.
    #[inline(always)]
    fn bf16_bits(x: u32) -> u16 {
        let nan = (x & 0x7fff_ffff) > 0x7f80_0000;
        // Adding 0x7fff plus the lowest kept bit carries into bit 16 exactly
        // when rounding to nearest even rounds up.
        let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
        let quiet_nan = (x >> 16) | 0x0040;
        // Branch-free select, so the loop vectorises.
        let nan_mask = 0u32.wrapping_sub(u32::from(nan));
        ((quiet_nan & nan_mask) | (rounded & !nan_mask)) as u16
    }

    #[inline(always)]
    fn bf16_to_f32_portable(src: &[bf16], dst: &mut [f32]) {
        let src: &[u16] = bytemuck::cast_slice(src);
        for (d, &s) in dst.iter_mut().zip(src) {
            // A NaN comes out quiet, as in `bf16::to_f32` (branch-free, so
            // the loop vectorises).
            let v = u32::from(s) << 16;
            let quiet = u32::from((v & 0x7fff_ffff) > 0x7f80_0000) << 22;
            *d = f32::from_bits(v | quiet);
        }
    }

    #[inline(always)]
    fn f32_to_bf16_portable(src: &[f32], dst: &mut [bf16]) {
        let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16_bits(s.to_bits());
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn bf16_to_f32_avx2(src: &[bf16], dst: &mut [f32]) {
        bf16_to_f32_portable(src, dst)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn f32_to_bf16_avx2(src: &[f32], dst: &mut [bf16]) {
        f32_to_bf16_portable(src, dst)
    }

    pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2() {
            // SAFETY: AVX2 is present.
            return unsafe { bf16_to_f32_avx2(src, dst) };
        }
        bf16_to_f32_portable(src, dst)
    }

    pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
        debug_assert_eq!(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2() {
            // SAFETY: AVX2 is present.
            return unsafe { f32_to_bf16_avx2(src, dst) };
        }
        f32_to_bf16_portable(src, dst)
    }

    #[cfg(target_arch = "x86_64")]
    fn has_f16c() -> bool {
        std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
    }

    /// # Safety
    /// The CPU must support F16C and AVX.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx,f16c")]
    unsafe fn f16_to_f32_f16c(src: &[f16], dst: &mut [f32]) {
        use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n for both slices; unaligned loads/stores.
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const _);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
        src[i..n].convert_to_f32_slice(&mut dst[i..n]);
    }

    /// # Safety
    /// The CPU must support F16C and AVX.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx,f16c")]
    unsafe fn f32_to_f16_f16c(src: &[f32], dst: &mut [f16]) {
        use std::arch::x86_64::{_mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128};
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: as above; imm 0 = round to nearest even.
            let h = _mm256_cvtps_ph::<0>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut _, h);
            i += 8;
        }
        dst[i..n].convert_from_f32_slice(&src[i..n]);
    }

    pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if has_f16c() {
            // SAFETY: F16C and AVX are present.
            return unsafe { f16_to_f32_f16c(src, dst) };
        }
        src.convert_to_f32_slice(dst)
    }

    pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
        debug_assert_eq!(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if has_f16c() {
            // SAFETY: F16C and AVX are present.
            return unsafe { f32_to_f16_f16c(src, dst) };
        }
        dst.convert_from_f32_slice(src)
    }

    /// The conversions of one 16-bit type, for the shared kernels below.
    pub trait Half: Copy {
        fn to_f32s(src: &[Self], dst: &mut [f32]);
        fn from_f32s(src: &[f32], dst: &mut [Self]);
        /// `out[i] = a[i] ⊕ b[i]` in one pass where the CPU allows
        /// (`half_fused`), whole steps of eight: returns how many elements
        /// it did (0 without the instructions), the same bits as the
        /// blocked kernels give.
        ///
        /// # Safety
        /// Each pointer is valid for `n` elements; `out` is `a`, `b`, or
        /// apart from both.
        unsafe fn zip_fused(
            op: ReduceOp,
            out: *mut Self,
            a: *const Self,
            b: *const Self,
            n: usize,
        ) -> usize;
        /// `d0[i] = d1[i] = x0[i] ⊕ x1[i]` in one pass where the CPU
        /// allows, whole steps walking up or `down`: returns how many
        /// elements it did (the first that many walking up, the last
        /// walking down).
        ///
        /// # Safety
        /// As [`Kernels::combine_into_both`](super::Kernels::combine_into_both).
        unsafe fn zip_both_fused(
            op: ReduceOp,
            d: (*mut Self, *mut Self),
            x: (*const Self, *const Self),
            n: usize,
            down: bool,
        ) -> usize;
        /// `out[i] = a[i] × scalar` (an `f32` product, rounded once) in one
        /// pass where the CPU allows, as [`zip_fused`](Half::zip_fused):
        /// returns how many elements it did.
        ///
        /// # Safety
        /// Each pointer is valid for `n` elements; `out` is `a` or apart.
        unsafe fn scale_fused(out: *mut Self, a: *const Self, scalar: f32, n: usize) -> usize;
        /// `d0[i] = d1[i] = (x0[i] + x1[i]) / 2`, the sum rounded to the
        /// type and then halved (a two-rank `Avg` that does not
        /// premultiply), in one pass where the CPU allows, as
        /// [`zip_both_fused`](Half::zip_both_fused): returns how many
        /// elements it did. None by default.
        ///
        /// # Safety
        /// As [`Kernels::combine_into_both`](super::Kernels::combine_into_both).
        unsafe fn average_two_fused(
            _d: (*mut Self, *mut Self),
            _x: (*const Self, *const Self),
            _n: usize,
            _down: bool,
        ) -> usize {
            0
        }
        /// `out[i] = a[i] × scalar` for every `i < n`: [`scale_fused`](Half::scale_fused),
        /// then the rest through `f32` blocks in L1, the same bits.
        ///
        /// # Safety
        /// As [`scale_fused`](Half::scale_fused).
        unsafe fn scale(out: *mut Self, a: *const Self, scalar: f32, n: usize) {
            // SAFETY: the caller's contract.
            let mut i = unsafe { Self::scale_fused(out, a, scalar, n) };
            let mut fa = [0f32; super::HALF_BLOCK];
            while i < n {
                let len = (n - i).min(super::HALF_BLOCK);
                // SAFETY: `i..i + len` lies within both buffers; the input
                // slice ends before the output slice (perhaps the same
                // memory) is made.
                Self::to_f32s(
                    unsafe { std::slice::from_raw_parts(a.add(i), len) },
                    &mut fa[..len],
                );
                fa[..len].iter_mut().for_each(|v| *v *= scalar);
                Self::from_f32s(&fa[..len], unsafe {
                    std::slice::from_raw_parts_mut(out.add(i), len)
                });
                i += len;
            }
        }
    }

    /// Calls `$f::<OP>(args…)` (a `half_fused` kernel) with `OP` the code
    /// of the reduction operator `$op`.
    #[cfg(target_arch = "x86_64")]
    macro_rules! for_op {
        ($f:ident, $op:expr, ($($arg:expr),*)) => {{
            use super::half_fused::{code, $f, MAX, MIN, PROD, SUM};
            match code($op) {
                SUM => $f::<SUM>($($arg),*),
                PROD => $f::<PROD>($($arg),*),
                MIN => $f::<MIN>($($arg),*),
                _ => $f::<MAX>($($arg),*),
            }
        }};
    }

    impl Half for f16 {
        #[allow(unused_variables)]
        unsafe fn zip_fused(
            op: ReduceOp,
            out: *mut Self,
            a: *const Self,
            b: *const Self,
            n: usize,
        ) -> usize {
            #[cfg(target_arch = "x86_64")]
            if has_f16c() && super::has_avx2() {
                // SAFETY: AVX2 and F16C are present; the caller's contract.
                return unsafe { for_op!(zip_f16, op, (out.cast(), a.cast(), b.cast(), n)) };
            }
            0
        }
        #[allow(unused_variables)]
        unsafe fn zip_both_fused(
            op: ReduceOp,
            d: (*mut Self, *mut Self),
            x: (*const Self, *const Self),
            n: usize,
            down: bool,
        ) -> usize {
            #[cfg(target_arch = "x86_64")]
            if has_f16c() && super::has_avx2() {
                let (d, x) = ((d.0.cast(), d.1.cast()), (x.0.cast(), x.1.cast()));
                // SAFETY: AVX2 and F16C are present; the caller's contract.
                return unsafe { for_op!(zip_both_f16, op, (d, x, n, down)) };
            }
            0
        }
        #[allow(unused_variables)]
        unsafe fn scale_fused(out: *mut Self, a: *const Self, scalar: f32, n: usize) -> usize {
            #[cfg(target_arch = "x86_64")]
            if has_f16c() && super::has_avx2() {
                // SAFETY: AVX2 and F16C are present; the caller's contract.
                return unsafe { super::half_fused::scale_f16(out.cast(), a.cast(), scalar, n) };
            }
            0
        }
        fn to_f32s(src: &[Self], dst: &mut [f32]) {
            f16_to_f32(src, dst)
        }
        fn from_f32s(src: &[f32], dst: &mut [Self]) {
            f32_to_f16(src, dst)
        }
    }
    impl Half for bf16 {
        #[allow(unused_variables)]
        unsafe fn zip_fused(
            op: ReduceOp,
            out: *mut Self,
            a: *const Self,
            b: *const Self,
            n: usize,
        ) -> usize {
            #[cfg(target_arch = "x86_64")]
            if super::has_avx2() {
                let (out, a, b) = (out.cast(), a.cast(), b.cast());
                if super::half_fused::has_avx512_bf16() {
                    // SAFETY: AVX2 and AVX-512 BF16 are present; the
                    // caller's contract.
                    return unsafe { for_op!(zip_bf16_512, op, (out, a, b, n)) };
                }
                // SAFETY: AVX2 is present; the caller's contract.
                return unsafe { for_op!(zip_bf16, op, (out, a, b, n)) };
            }
            0
        }
        #[allow(unused_variables)]
        unsafe fn zip_both_fused(
            op: ReduceOp,
            d: (*mut Self, *mut Self),
            x: (*const Self, *const Self),
            n: usize,
            down: bool,
        ) -> usize {
            #[cfg(target_arch = "x86_64")]
            if super::has_avx2() {
                let (d, x) = ((d.0.cast(), d.1.cast()), (x.0.cast(), x.1.cast()));
                if super::half_fused::has_avx512_bf16() {
                    // SAFETY: AVX2 and AVX-512 BF16 are present; the
                    // caller's contract.
                    return unsafe { for_op!(zip_both_bf16_512, op, (d, x, n, down)) };
                }
                // SAFETY: AVX2 is present; the caller's contract.
                return unsafe { for_op!(zip_both_bf16, op, (d, x, n, down)) };
            }
            0
        }
        #[allow(unused_variables)]
        unsafe fn scale_fused(out: *mut Self, a: *const Self, scalar: f32, n: usize) -> usize {
            #[cfg(target_arch = "x86_64")]
            if super::has_avx2() {
                let (out, a) = (out.cast(), a.cast());
                if super::half_fused::has_avx512_bf16() {
                    // SAFETY: AVX2 and AVX-512 BF16 are present; the
                    // caller's contract.
                    return unsafe { super::half_fused::scale_bf16_512(out, a, scalar, n) };
                }
                // SAFETY: AVX2 is present; the caller's contract.
                return unsafe { super::half_fused::scale_bf16(out, a, scalar, n) };
            }
            0
        }
        #[allow(unused_variables)]
        unsafe fn average_two_fused(
            d: (*mut Self, *mut Self),
            x: (*const Self, *const Self),
            n: usize,
            down: bool,
        ) -> usize {
            #[cfg(target_arch = "x86_64")]
            if super::has_avx2() {
                let (d, x) = ((d.0.cast(), d.1.cast()), (x.0.cast(), x.1.cast()));
                if super::half_fused::has_avx512_bf16() {
                    // SAFETY: AVX2 and AVX-512 BF16 are present; the
                    // caller's contract.
                    return unsafe {
                        super::half_fused::zip_both_bf16_512::<{ super::half_fused::HALVED_SUM }>(
                            d, x, n, down,
                        )
                    };
                }
                // SAFETY: AVX2 is present; the caller's contract.
                return unsafe {
                    super::half_fused::zip_both_bf16::<{ super::half_fused::HALVED_SUM }>(
                        d, x, n, down,
                    )
                };
            }
            0
        }
        fn to_f32s(src: &[Self], dst: &mut [f32]) {
            bf16_to_f32(src, dst)
        }
        fn from_f32s(src: &[f32], dst: &mut [Self]) {
            f32_to_bf16(src, dst)
        }
    }
}

/// Elements per conversion block for `f16`/`bf16`: two `f32` blocks of this
/// size (8 KiB) stay in L1 beside the operands.
const HALF_BLOCK: usize = 1024;

macro_rules! half_kernels {
    ($($t:ty => premultiplied Avg: $premultiplies:expr),*) => {$(
        impl Kernels for $t {
            fn combine_into(op: ReduceOp, out: &mut [Self], a: &[Self], b: &[Self]) {
                debug_assert!(out.len() == a.len() && a.len() == b.len());
                // SAFETY: three slices of one length, `out` apart from both.
                let done = unsafe { Self::zip_fused(op, out.as_mut_ptr(), a.as_ptr(), b.as_ptr(), out.len()) };
                let (out, a, b) = (&mut out[done..], &a[done..], &b[done..]);
                let mut fa = [0f32; HALF_BLOCK];
                let mut fb = [0f32; HALF_BLOCK];
                for ((o, a), b) in out.chunks_mut(HALF_BLOCK).zip(a.chunks(HALF_BLOCK)).zip(b.chunks(HALF_BLOCK)) {
                    let n = o.len();
                    Self::to_f32s(a, &mut fa[..n]);
                    Self::to_f32s(b, &mut fb[..n]);
                    f32::combine_assign(op, &mut fa[..n], &fb[..n]);
                    Self::from_f32s(&fa[..n], o);
                }
            }
            fn combine_assign(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                debug_assert_eq!(acc.len(), x.len());
                let p = acc.as_mut_ptr();
                // SAFETY: two slices of one length; `out` is `a`.
                let done = unsafe { Self::zip_fused(op, p, p, x.as_ptr(), acc.len()) };
                let (acc, x) = (&mut acc[done..], &x[done..]);
                let mut fa = [0f32; HALF_BLOCK];
                let mut fb = [0f32; HALF_BLOCK];
                for (a, x) in acc.chunks_mut(HALF_BLOCK).zip(x.chunks(HALF_BLOCK)) {
                    let n = a.len();
                    Self::to_f32s(a, &mut fa[..n]);
                    Self::to_f32s(x, &mut fb[..n]);
                    f32::combine_assign(op, &mut fa[..n], &fb[..n]);
                    Self::from_f32s(&fa[..n], a);
                }
            }
            fn combine_assign_rev(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                debug_assert_eq!(acc.len(), x.len());
                let p = acc.as_mut_ptr();
                // SAFETY: two slices of one length; `out` is `b`.
                let done = unsafe { Self::zip_fused(op, p, x.as_ptr(), p, acc.len()) };
                let (acc, x) = (&mut acc[done..], &x[done..]);
                let mut fa = [0f32; HALF_BLOCK];
                let mut fb = [0f32; HALF_BLOCK];
                for (a, x) in acc.chunks_mut(HALF_BLOCK).zip(x.chunks(HALF_BLOCK)) {
                    let n = a.len();
                    Self::to_f32s(a, &mut fa[..n]);
                    Self::to_f32s(x, &mut fb[..n]);
                    f32::combine_assign_rev(op, &mut fa[..n], &fb[..n]);
                    Self::from_f32s(&fa[..n], a);
                }
            }
            unsafe fn combine_into_both(op: ReduceOp, d: (*mut Self, *mut Self), x: (*const Self, *const Self), n: usize, walk: Walk) {
                let down = walk == Walk::Down;
                // SAFETY: the caller's contract; the one-pass steps cover
                // the first `done` elements walking up, the last walking
                // down, and the two-pass fold takes the others.
                unsafe {
                    let done = Self::zip_both_fused(op, d, x, n, down);
                    let skip = if down { 0 } else { done };
                    fold_then_copy(op, (d.0.add(skip), d.1.add(skip)), (x.0.add(skip), x.1.add(skip)), n - done);
                }
            }
            unsafe fn average_two_into_both(d: (*mut Self, *mut Self), x: (*const Self, *const Self), n: usize, walk: Walk) -> bool {
                // A premultiplied Avg (f16) sums terms scaled already and
                // `finish_avg` leaves the sum: the Sum's one pass.
                if Self::AVG_PREMULTIPLIES {
                    // SAFETY: the caller's contract.
                    unsafe { Self::combine_into_both(ReduceOp::Sum, d, x, n, walk) };
                    return true;
                }
                // bf16 rounds its sum before halving it: `average_two_fused`
                // where the CPU allows, else none here (the caller folds,
                // divides and copies). What its steps leave (fewer than a
                // step) is folded, then halved in each output: the same
                // bits.
                let down = walk == Walk::Down;
                // SAFETY: the caller's contract; the one-pass steps cover
                // the first `done` elements walking up, the last walking
                // down. The two outputs lie apart (each is its own input
                // or apart from everything), and no other reference to
                // them lives while each is halved.
                unsafe {
                    let done = Self::average_two_fused(d, x, n, down);
                    if done == 0 && n > 0 {
                        return false;
                    }
                    let rest = n - done;
                    if rest > 0 {
                        let skip = if down { 0 } else { done };
                        let (d0, d1) = (d.0.add(skip), d.1.add(skip));
                        fold_then_copy(ReduceOp::Sum, (d0, d1), (x.0.add(skip), x.1.add(skip)), rest);
                        Self::divide_by(std::slice::from_raw_parts_mut(d0, rest), 2);
                        Self::divide_by(std::slice::from_raw_parts_mut(d1, rest), 2);
                    }
                }
                true
            }
            fn divide_by(acc: &mut [Self], n: usize) {
                if n == 1 {
                    return;
                }
                if let Some(reciprocal) = exact_reciprocal(n) {
                    // SAFETY: `acc` is both input and output, n elements.
                    return unsafe { Self::scale(acc.as_mut_ptr(), acc.as_ptr(), reciprocal as f32, acc.len()) };
                }
                let divisor = n as f32;
                let mut fa = [0f32; HALF_BLOCK];
                for a in acc.chunks_mut(HALF_BLOCK) {
                    let len = a.len();
                    Self::to_f32s(a, &mut fa[..len]);
                    fa[..len].iter_mut().for_each(|v| *v /= divisor);
                    Self::from_f32s(&fa[..len], a);
                }
            }
            const AVG_PREMULTIPLIES: bool = $premultiplies;
            fn premultiply_avg(dst: &mut [Self], src: &[Self], world: usize) {
                debug_assert_eq!(dst.len(), src.len());
                if !Self::AVG_PREMULTIPLIES {
                    return dst.copy_from_slice(src);
                }
                // The scalar as NCCL rounds it: 1/world in f64, then f32,
                // then the type. A product of two 11-bit significands is
                // exact in f32, so rounding it to the type once is the
                // type's own multiplication.
                let scalar = <$t>::from_f32((1.0 / world as f64) as f32).to_f32();
                // SAFETY: two slices of one length, apart.
                unsafe { Self::scale(dst.as_mut_ptr(), src.as_ptr(), scalar, dst.len()) }
            }
        }
    )*};
}
half_kernels!(half::f16 => premultiplied Avg: true, half::bf16 => premultiplied Avg: false);

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// `a ⊕ b` has the same bits by every kernel, at every alignment of
    /// the output, for two NaNs of different payloads (every rank of a
    /// collective must get the same bits, and ranks fold through different
    /// kernels at different alignments): the float ops pick `a`'s NaN as
    /// `combine_into` does, whatever operand order the compiler chose.
    fn same_bits_by_every_kernel<T: Kernels + PartialEq + std::fmt::Debug>(
        nan_a: T,
        nan_b: T,
        one: T,
        bits: fn(T) -> u64,
    ) {
        let n = 40;
        // NaN against NaN (every third element), NaN against a number, a
        // number against NaN, and numbers.
        let a: Vec<T> = (0..n)
            .map(|i| if i % 3 == 0 || i % 5 == 1 { nan_a } else { one })
            .collect();
        let b: Vec<T> = (0..n)
            .map(|i| if i % 3 == 0 || i % 7 == 2 { nan_b } else { one })
            .collect();
        let as_bits = |v: &[T]| v.iter().map(|&x| bits(x)).collect::<Vec<u64>>();
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            let mut want = vec![one; n];
            T::combine_into(op, &mut want, &a, &b);
            let want = as_bits(&want);
            for shift in 0..8 {
                let mut store = vec![one; n + 8];
                let out = &mut store[shift..shift + n];
                T::combine_into(op, out, &a, &b);
                assert_eq!(as_bits(out), want, "{op:?} combine_into, shift {shift}");
                out.copy_from_slice(&a);
                T::combine_assign(op, out, &b);
                assert_eq!(as_bits(out), want, "{op:?} combine_assign, shift {shift}");
                out.copy_from_slice(&b);
                T::combine_assign_rev(op, out, &a);
                assert_eq!(
                    as_bits(out),
                    want,
                    "{op:?} combine_assign_rev, shift {shift}"
                );
                for walk in [Walk::Up, Walk::Down] {
                    let mut d1 = vec![one; n + 8];
                    let (d0, d1) = (
                        &mut store[shift..shift + n],
                        &mut d1[8 - shift..8 - shift + n],
                    );
                    // SAFETY: four separate buffers of `n` elements.
                    unsafe {
                        T::combine_into_both(
                            op,
                            (d0.as_mut_ptr(), d1.as_mut_ptr()),
                            (a.as_ptr(), b.as_ptr()),
                            n,
                            walk,
                        )
                    };
                    assert_eq!(
                        as_bits(d0),
                        want,
                        "{op:?} both (d0), shift {shift}, {walk:?}"
                    );
                    assert_eq!(
                        as_bits(d1),
                        want,
                        "{op:?} both (d1), shift {shift}, {walk:?}"
                    );
                    // In place: d0 is x0, d1 is x1.
                    d0.copy_from_slice(&a);
                    d1.copy_from_slice(&b);
                    // SAFETY: each output is its own input; two buffers.
                    unsafe {
                        T::combine_into_both(
                            op,
                            (d0.as_mut_ptr(), d1.as_mut_ptr()),
                            (d0.as_ptr(), d1.as_ptr()),
                            n,
                            walk,
                        )
                    };
                    assert_eq!(
                        as_bits(d0),
                        want,
                        "{op:?} both in place (d0), shift {shift}, {walk:?}"
                    );
                    assert_eq!(
                        as_bits(d1),
                        want,
                        "{op:?} both in place (d1), shift {shift}, {walk:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn dividing_by_one_keeps_the_bits() {
        let signalling = f32::from_bits(0x7f80_0001);
        let mut v = [signalling, 1.5];
        f32::divide_by(&mut v, 1);
        assert_eq!(v[0].to_bits(), 0x7f80_0001);
        let mut h = [f16::from_bits(0x7c01)];
        f16::divide_by(&mut h, 1);
        assert_eq!(h[0].to_bits(), 0x7c01);
    }

    #[test]
    fn nan_payloads_are_chosen_alike_by_every_kernel() {
        same_bits_by_every_kernel(
            f32::from_bits(0x7fc0_0001),
            f32::from_bits(0xffc0_0002),
            1.5f32,
            |x| u64::from(x.to_bits()),
        );
        same_bits_by_every_kernel(
            f64::from_bits(0x7ff8_0000_0000_0001),
            f64::from_bits(0xfff8_0000_0000_0002),
            1.5f64,
            f64::to_bits,
        );
        same_bits_by_every_kernel(
            f16::from_bits(0x7e01),
            f16::from_bits(0xfe02),
            f16::from_f32(1.5),
            |x| u64::from(x.to_bits()),
        );
        same_bits_by_every_kernel(
            bf16::from_bits(0x7fc1),
            bf16::from_bits(0xffc2),
            bf16::from_f32(1.5),
            |x| u64::from(x.to_bits()),
        );
    }

    /// `Walk::Up` visits the elements from the first to the last and
    /// `Walk::Down` from the last to the first (step by step; a step's
    /// elements go up inside it), head and tail included: the
    /// order, not only the result, is what keeps two ranks' prefetchers
    /// out of each other's share.
    #[test]
    fn walks_visit_in_their_order() {
        for n in [5usize, 32, 33, 100, 300] {
            // `skip` 1 puts `d0` off the 32-byte alignment: a head.
            for skip in [0usize, 1] {
                for walk in [Walk::Up, Walk::Down] {
                    let x0: Vec<u32> = (0..(skip + n) as u32).collect();
                    let x1 = vec![0u32; skip + n];
                    let (mut d0, mut d1) = (vec![0u32; skip + n], vec![0u32; skip + n]);
                    let order = std::cell::RefCell::new(Vec::new());
                    // SAFETY: four distinct live buffers of skip + n elements.
                    unsafe {
                        zip_into_both(
                            (d0.as_mut_ptr().add(skip), d1.as_mut_ptr().add(skip)),
                            (x0.as_ptr().add(skip), x1.as_ptr().add(skip)),
                            n,
                            walk,
                            |a: u32, b: u32| {
                                order.borrow_mut().push(a);
                                a + b
                            },
                        );
                    }
                    let order = order.into_inner();
                    let what = format!("n={n} skip={skip} {walk:?}");
                    assert_eq!(&d0[skip..], &x0[skip..], "{what}");
                    assert_eq!(&d1[skip..], &x0[skip..], "{what}");
                    let mut each = order.clone();
                    each.sort_unstable();
                    assert_eq!(&each[..], &x0[skip..], "every element once: {what}");
                    // A step's elements go up inside it, so compare each
                    // visit with the one a step earlier: one step further
                    // along the walk, or (head, tail) beyond it.
                    let apart = order.iter().zip(&order[BOTH_STEP.min(order.len())..]);
                    let in_order = match walk {
                        Walk::Up => apart.clone().all(|(early, late)| late > early),
                        Walk::Down => apart.clone().all(|(early, late)| late < early),
                    };
                    assert!(in_order, "visit order {order:?}: {what}");
                    // The first visit lies in the first step's span at
                    // the walk's starting end.
                    let first = order[0] as usize - skip;
                    match walk {
                        Walk::Up => assert!(first < BOTH_STEP, "starts at the bottom: {what}"),
                        Walk::Down => assert!(first + BOTH_STEP >= n, "starts at the top: {what}"),
                    }
                }
            }
        }
    }

    /// f32 bit patterns that probe every rounding case of both 16-bit
    /// formats: each 16-bit prefix with low halves at and around the
    /// half-way points, plus a sweep of the whole space.
    fn probe_bits() -> Vec<u32> {
        let mut bits = Vec::new();
        for high in 0..=u16::MAX as u32 {
            for low in [
                0u32, 1, 0x0fff, 0x1000, 0x1001, 0x7fff, 0x8000, 0x8001, 0xffff,
            ] {
                bits.push(high << 16 | low);
            }
        }
        bits.extend((0..u32::MAX / 7919).map(|i| i.wrapping_mul(7919)));
        bits
    }

    #[test]
    fn vector_conversions_match_half_bit_for_bit() {
        let all16: Vec<u16> = (0..=u16::MAX).collect();
        let (h, b): (&[f16], &[bf16]) =
            (bytemuck::cast_slice(&all16), bytemuck::cast_slice(&all16));
        let mut out = vec![0f32; all16.len()];
        convert::f16_to_f32(h, &mut out);
        for (x, y) in h.iter().zip(&out) {
            assert_eq!(
                x.to_f32().to_bits(),
                y.to_bits(),
                "f16 {:#06x}",
                x.to_bits()
            );
        }
        convert::bf16_to_f32(b, &mut out);
        for (x, y) in b.iter().zip(&out) {
            assert_eq!(
                x.to_f32().to_bits(),
                y.to_bits(),
                "bf16 {:#06x}",
                x.to_bits()
            );
        }
        let floats: Vec<f32> = probe_bits().into_iter().map(f32::from_bits).collect();
        let mut h_out = vec![f16::ZERO; floats.len()];
        let mut b_out = vec![bf16::ZERO; floats.len()];
        convert::f32_to_f16(&floats, &mut h_out);
        convert::f32_to_bf16(&floats, &mut b_out);
        for ((x, hv), bv) in floats.iter().zip(&h_out).zip(&b_out) {
            assert_eq!(
                f16::from_f32(*x).to_bits(),
                hv.to_bits(),
                "f16 of {:#010x}",
                x.to_bits()
            );
            assert_eq!(
                bf16::from_f32(*x).to_bits(),
                bv.to_bits(),
                "bf16 of {:#010x}",
                x.to_bits()
            );
        }
    }

    fn assign<T: Kernels>(op: ReduceOp, a: T, b: T) -> T {
        let mut acc = [a];
        T::combine_assign(op, &mut acc, &[b]);
        acc[0]
    }

    #[test]
    fn integer_sum_and_prod_wrap() {
        assert_eq!(assign(ReduceOp::Sum, 127i8, 1), -128);
        assert_eq!(assign(ReduceOp::Sum, 255u8, 2), 1);
        assert_eq!(assign(ReduceOp::Prod, 16u8, 16), 0);
        assert_eq!(assign(ReduceOp::Prod, i32::MAX, 2), -2);
        assert_eq!(assign(ReduceOp::Sum, u64::MAX, 1), 0);
        assert_eq!(
            assign(ReduceOp::Avg, 100i8, 100),
            -56,
            "Avg combines as a wrapping Sum"
        );
    }

    #[test]
    fn integer_avg_truncates_toward_zero() {
        let mut v = [7i32, -7, 1, -1];
        i32::divide_by(&mut v, 2);
        assert_eq!(v, [3, -3, 0, 0]);
        let mut u = [255u8, 5];
        u8::divide_by(&mut u, 300);
        assert_eq!(u, [0, 0]);
        let mut s = [-128i8, 127];
        i8::divide_by(&mut s, 128);
        assert_eq!(
            s,
            [-1, 0],
            "a divisor beyond the type's range still divides exactly"
        );
    }

    /// Integer division by a power of two is a biased shift: what `/`
    /// gives, toward zero, at every extreme of every type, and for other
    /// divisors (`/` itself) alike.
    #[test]
    fn integer_division_by_powers_of_two_is_division() {
        /// `values` divided by each divisor against `/` in `i128`, which
        /// also covers divisors beyond the type's range.
        fn check<T>(values: &[T], divisors: &[usize])
        where
            T: Kernels + Copy + PartialEq + std::fmt::Debug + Into<i128> + TryFrom<i128>,
        {
            for &n in divisors {
                let mut got = values.to_vec();
                T::divide_by(&mut got, n);
                let want: Vec<T> = values
                    .iter()
                    .map(|&v| match T::try_from(v.into() / n as i128) {
                        Ok(q) => q,
                        Err(_) => unreachable!("a quotient by n ≥ 1 fits"),
                    })
                    .collect();
                assert_eq!(got, want, "divided by {n}");
            }
        }
        let divisors = [
            2,
            3,
            4,
            6,
            8,
            64,
            128,
            255,
            256,
            1 << 16,
            1 << 31,
            1 << 32,
            1 << 40,
            1 << 62,
            1 << 63,
            usize::MAX,
        ];
        check(
            &[
                i8::MIN,
                -127,
                -65,
                -64,
                -63,
                -9,
                -8,
                -7,
                -1,
                0,
                1,
                7,
                8,
                9,
                63,
                64,
                127,
            ],
            &divisors,
        );
        check(&[0u8, 1, 7, 8, 9, 127, 128, 200, 255], &divisors);
        let mut ints: Vec<i64> = vec![i64::MIN, i64::MIN + 1, -1, 0, 1, i64::MAX, i64::MAX - 1];
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ints.push(seed as i64 >> (seed % 60));
        }
        check(&ints, &divisors);
        check(
            &ints.iter().map(|&v| v as u64).collect::<Vec<_>>(),
            &divisors,
        );
        check(
            &ints.iter().map(|&v| v as i32).collect::<Vec<_>>(),
            &divisors,
        );
        check(
            &ints.iter().map(|&v| v as u32).collect::<Vec<_>>(),
            &divisors,
        );
    }

    /// Float division by a power of two is multiplication by its exact
    /// reciprocal: the same bits as `/` for every bit pattern (NaN
    /// payloads, infinities, zeros, subnormals and results that become
    /// subnormal), for f32 and f64 directly and for f16 and bf16 through
    /// f32, and other divisors still divide.
    #[test]
    fn float_division_by_powers_of_two_gives_the_quotient_bits() {
        let divisors = [2usize, 3, 4, 6, 8, 1024, 1 << 20, 1 << 40];
        let probes = probe_bits();
        let floats: Vec<f32> = probes.iter().map(|&b| f32::from_bits(b)).collect();
        let doubles: Vec<f64> = probes
            .iter()
            .map(|&b| f64::from_bits(u64::from(b) << 32 | u64::from(b.rotate_left(7))))
            .collect();
        let halves: Vec<u16> = (0..=u16::MAX).collect();
        for n in divisors {
            let mut got = floats.clone();
            f32::divide_by(&mut got, n);
            let want = floats.iter().map(|&v| (v / n as f32).to_bits());
            assert!(got.iter().map(|v| v.to_bits()).eq(want), "f32 by {n}");
            let mut got = doubles.clone();
            f64::divide_by(&mut got, n);
            let want = doubles.iter().map(|&v| (v / n as f64).to_bits());
            assert!(got.iter().map(|v| v.to_bits()).eq(want), "f64 by {n}");
            let mut got: Vec<bf16> = halves.iter().map(|&b| bf16::from_bits(b)).collect();
            bf16::divide_by(&mut got, n);
            for (&b, g) in halves.iter().zip(&got) {
                let want = bf16::from_f32(bf16::from_bits(b).to_f32() / n as f32);
                assert_eq!(g.to_bits(), want.to_bits(), "bf16 {b:#06x} by {n}");
            }
            let mut got: Vec<f16> = halves.iter().map(|&b| f16::from_bits(b)).collect();
            f16::divide_by(&mut got, n);
            for (&b, g) in halves.iter().zip(&got) {
                let want = f16::from_f32(f16::from_bits(b).to_f32() / n as f32);
                assert_eq!(g.to_bits(), want.to_bits(), "f16 {b:#06x} by {n}");
            }
        }
    }

    /// f16's Avg premultiplies as NCCL's `PreMulSum` (scalar
    /// `__float2half(float(1.0/n))`, each product rounded once to f16),
    /// over more than one conversion block; the other types copy, and
    /// `finish_avg` divides only for them.
    #[test]
    fn f16_avg_premultiplies_and_the_others_divide_at_the_end() {
        let n = HALF_BLOCK + 3;
        let src: Vec<f16> = (0..n)
            .map(|i| f16::from_f32(60000.0 - i as f32 * 7.0))
            .collect();
        for world in [2usize, 3, 7] {
            let scalar = f16::from_f32((1.0 / world as f64) as f32);
            let mut dst = vec![f16::ZERO; n];
            f16::premultiply_avg(&mut dst, &src, world);
            for (d, s) in dst.iter().zip(&src) {
                let want = f16::from_f64(s.to_f64() * scalar.to_f64());
                assert_eq!(d.to_bits(), want.to_bits(), "world {world}: {s} × {scalar}");
            }
        }
        // 1/3 rounds to f16 first: 0.33325195, not 0.33333334.
        let mut one = [f16::ZERO];
        f16::premultiply_avg(&mut one, &[f16::from_f32(3.0)], 3);
        assert_eq!(one[0], f16::from_f32(3.0 * 0.333_251_95));
        let b: Vec<bf16> = (0..5).map(|i| bf16::from_f32(i as f32 + 0.5)).collect();
        let mut copy = vec![bf16::ZERO; 5];
        bf16::premultiply_avg(&mut copy, &b, 4);
        assert_eq!(copy, b);

        let mut h = [f16::from_f32(3.0)];
        finish_avg(ReduceOp::Avg, &mut h, 2);
        assert_eq!(h[0], f16::from_f32(3.0), "premultiplied: no division");
        let mut g = [bf16::from_f32(3.0)];
        finish_avg(ReduceOp::Avg, &mut g, 2);
        assert_eq!(g[0], bf16::from_f32(1.5));
        let mut x = [3.0f32];
        finish_avg(ReduceOp::Sum, &mut x, 2);
        assert_eq!(x[0], 3.0, "only Avg divides");
    }

    #[test]
    fn float_min_max_propagate_nan() {
        for (a, b) in [(f32::NAN, 1.0), (1.0, f32::NAN), (f32::NAN, f32::NAN)] {
            assert!(assign(ReduceOp::Min, a, b).is_nan());
            assert!(assign(ReduceOp::Max, a, b).is_nan());
            let mut rev = [a];
            f32::combine_assign_rev(ReduceOp::Max, &mut rev, &[b]);
            assert!(rev[0].is_nan());
        }
        assert_eq!(assign(ReduceOp::Min, 2.0f64, -3.0), -3.0);
        assert_eq!(assign(ReduceOp::Max, 2.0f64, -3.0), 2.0);
        assert!(assign(ReduceOp::Max, f16::NAN, f16::ONE).is_nan());
        assert!(assign(ReduceOp::Min, bf16::ONE, bf16::NAN).is_nan());
        // -0.0 and 0.0 compare equal: the first operand is kept.
        assert!(assign(ReduceOp::Min, -0.0f32, 0.0).is_sign_negative());
    }

    #[test]
    fn half_rounds_once_per_step_through_f32() {
        // 2048 + 1 is not representable in f16 (spacing 2 there): one step
        // rounds to even, 2048. Summing in f16 pairs and in f32 agree here.
        let a = f16::from_f32(2048.0);
        assert_eq!(assign(ReduceOp::Sum, a, f16::ONE), f16::from_f32(2048.0));
        // 1 + 2^-11 (below f16's epsilon) is lost at each step: accumulation
        // is per step, not over the whole reduction.
        let tiny = f16::from_f32(2f32.powi(-11));
        let step1 = assign(ReduceOp::Sum, f16::ONE, tiny);
        assert_eq!(assign(ReduceOp::Sum, step1, tiny), f16::ONE);
        // bf16: 256 + 1 rounds to 256.
        assert_eq!(
            assign(ReduceOp::Sum, bf16::from_f32(256.0), bf16::ONE),
            bf16::from_f32(256.0)
        );
        // Avg divides in f32 and rounds once: 3 / 2 = 1.5 exactly.
        let mut v = [f16::from_f32(3.0)];
        f16::divide_by(&mut v, 2);
        assert_eq!(v[0], f16::from_f32(1.5));
    }

    /// The one-pass 16-bit kernels (`half_fused`) give the bits of the
    /// element-by-element model: both operands widened to `f32`, the `f32`
    /// fold's operator (its NaN picks included), rounded back by `half`.
    /// Every bit pattern kind (NaNs with payloads and signs, infinities,
    /// subnormals, zeros of both signs, overflow on rounding), every
    /// operator and kernel form, at lengths around the step of eight and
    /// at odd offsets.
    fn fused_half_kernels_give_the_model_bits<T>(to_f32: fn(T) -> f32, from_f32: fn(f32) -> T)
    where
        T: Kernels + bytemuck::Pod + PartialEq + std::fmt::Debug,
    {
        let bits = |v: &[T]| -> Vec<u16> { bytemuck::cast_slice(v).to_vec() };
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let special: [u16; 12] = [
            0x0000, 0x8000, 0x0001, 0x8001, 0x7c00, 0xfc00, 0x7e01, 0xfd55, 0x7f80, 0xff81, 0x7bff,
            0x3c00,
        ];
        let total = 1100;
        let make = |next: &mut dyn FnMut() -> u64| -> Vec<T> {
            (0..total)
                .map(|i| {
                    let r = next();
                    let b = if i % 5 == 0 {
                        special[(r % 12) as usize]
                    } else {
                        r as u16
                    };
                    bytemuck::cast::<u16, T>(b)
                })
                .collect()
        };
        let a_all = make(&mut next);
        let b_all = make(&mut next);
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            let model = |x: T, y: T| {
                let mut o = [0f32];
                f32::combine_into(op, &mut o, &[to_f32(x)], &[to_f32(y)]);
                from_f32(o[0])
            };
            for (offset, n) in [(0, 0), (0, 7), (1, 8), (3, 9), (0, 16), (2, 31), (1, 1050)] {
                let (a, b) = (
                    &a_all[offset..offset + n],
                    &b_all[offset + 5..offset + 5 + n],
                );
                let want: Vec<T> = a.iter().zip(b).map(|(&x, &y)| model(x, y)).collect();
                let want_rev: Vec<T> = a.iter().zip(b).map(|(&x, &y)| model(y, x)).collect();
                let mut out = vec![from_f32(0.0); n + 3];
                T::combine_into(op, &mut out[offset..offset + n], a, b);
                assert_eq!(
                    bits(&out[offset..offset + n]),
                    bits(&want),
                    "{op} into, n {n}"
                );
                let mut acc = a.to_vec();
                T::combine_assign(op, &mut acc, b);
                assert_eq!(bits(&acc), bits(&want), "{op} assign, n {n}");
                let mut acc = a.to_vec();
                T::combine_assign_rev(op, &mut acc, b);
                assert_eq!(bits(&acc), bits(&want_rev), "{op} assign_rev, n {n}");
                // Both outputs, walking either way: apart from the inputs,
                // and in place on either side.
                for walk in [Walk::Up, Walk::Down] {
                    for in_place in [None, Some(0), Some(1)] {
                        let (mut x0, mut x1) = (a.to_vec(), b.to_vec());
                        let (mut o0, mut o1) = (vec![from_f32(0.0); n], vec![from_f32(0.0); n]);
                        let d0 = if in_place == Some(0) {
                            x0.as_mut_ptr()
                        } else {
                            o0.as_mut_ptr()
                        };
                        let d1 = if in_place == Some(1) {
                            x1.as_mut_ptr()
                        } else {
                            o1.as_mut_ptr()
                        };
                        // SAFETY: every buffer holds n elements; an output
                        // is its own input or apart from the others.
                        unsafe {
                            T::combine_into_both(op, (d0, d1), (x0.as_ptr(), x1.as_ptr()), n, walk)
                        };
                        let out0 = if in_place == Some(0) { &x0 } else { &o0 };
                        let out1 = if in_place == Some(1) { &x1 } else { &o1 };
                        let what = format!("{op} both, {walk:?}, in place {in_place:?}, n {n}");
                        assert_eq!(bits(out0), bits(&want), "{what}: first output");
                        assert_eq!(bits(out1), bits(&want), "{what}: second output");
                    }
                }
            }
        }
    }

    #[test]
    fn fused_half_kernels_give_the_blocked_bits() {
        fused_half_kernels_give_the_model_bits::<f16>(f16::to_f32, f16::from_f32);
        fused_half_kernels_give_the_model_bits::<bf16>(bf16::to_f32, bf16::from_f32);
    }

    #[test]
    fn blocked_half_loops_cover_every_element() {
        let n = HALF_BLOCK * 2 + 7;
        let a: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i % 5) as f32)).collect();
        let b: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i % 3) as f32)).collect();
        let mut out = vec![bf16::ZERO; n];
        bf16::combine_into(ReduceOp::Sum, &mut out, &a, &b);
        for (i, v) in out.iter().enumerate() {
            assert_eq!(v.to_f32(), ((i % 5) + (i % 3)) as f32, "element {i}");
        }
        let mut acc = a.clone();
        bf16::combine_assign_rev(ReduceOp::Max, &mut acc, &b);
        for (i, v) in acc.iter().enumerate() {
            assert_eq!(v.to_f32(), (i % 5).max(i % 3) as f32, "element {i}");
        }
    }

    /// The two-output kernel against `combine_into`, bit for bit, over
    /// arbitrary bit patterns (NaN payloads, ±0, extremes), for every
    /// output placement a two-rank call may have: apart from its input or
    /// the input itself, independently on each side.
    /// Whether the AVX2 kernels may run here (none off x86-64).
    fn avx2_here() -> bool {
        #[cfg(target_arch = "x86_64")]
        return has_avx2();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    fn both_outputs_match<T: Kernels + bytemuck::Pod>() {
        let bytes_of = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
        // 48 and 63: a 512-bit step, then a 256-bit one continuing the walk.
        for n in [0usize, 1, 31, 32, 33, 48, 63, 64, 100, 1000] {
            let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ n as u64;
            let mut pattern = |len: usize| -> Vec<T> {
                let mut values = vec![T::zeroed(); len];
                for b in bytemuck::cast_slice_mut::<T, u8>(&mut values) {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    *b = (seed >> 24) as u8;
                }
                values
            };
            let (mut x0, mut x1) = (pattern(n), pattern(n));
            // Pairs of +0 and −0 in both orders (for the integers, 0 and
            // the top bit alone): min and max keep their first operand
            // there, so a swapped operand order shows.
            let size = std::mem::size_of::<T>();
            let (b0, b1) = (
                bytemuck::cast_slice_mut::<T, u8>(&mut x0),
                bytemuck::cast_slice_mut::<T, u8>(&mut x1),
            );
            for i in (0..n).filter(|i| i % 5 < 2) {
                let (lo, hi) = (i * size, (i + 1) * size);
                b0[lo..hi].fill(0);
                b1[lo..hi].fill(0);
                let negative = if i % 5 == 0 { &mut *b1 } else { &mut *b0 };
                negative[hi - 1] = 0x80;
            }
            for op in ReduceOp::ALL {
                // An Avg of two ranks ends as `finish_avg` ends it, which
                // `fold_two_into_both` does in its one pass.
                let mut want = x0.clone();
                T::combine_into(op, &mut want, &x0, &x1);
                finish_avg(op, &mut want, 2);
                // `skip` elements in: buffers off the vector loop's
                // alignment by 0, 1 and 3 elements.
                let placements = [(false, false), (true, false), (false, true), (true, true)];
                for (((in_place0, in_place1), skip), walk) in placements
                    .into_iter()
                    .flat_map(|p| [0usize, 1, 3].map(|skip| (p, skip)))
                    .flat_map(|ps| [Walk::Up, Walk::Down].map(|walk| (ps, walk)))
                {
                    let shifted = |x: &[T]| [vec![T::zeroed(); skip], x.to_vec()].concat();
                    let (mut a, mut b) = (shifted(&x0), shifted(&x1));
                    let (mut d0, mut d1) =
                        (vec![T::zeroed(); skip + n], vec![T::zeroed(); skip + n]);
                    // Every pointer into `a` and `b` from one `as_mut_ptr`
                    // each: a later reborrow would invalidate the earlier.
                    let (pa, pb) = (a.as_mut_ptr(), b.as_mut_ptr());
                    let dst0 = if in_place0 { pa } else { d0.as_mut_ptr() };
                    let dst1 = if in_place1 { pb } else { d1.as_mut_ptr() };
                    // SAFETY: four live buffers of skip + n elements; each
                    // output is its input or apart from everything else.
                    let done = unsafe {
                        fold_two_into_both(
                            op,
                            (dst0.add(skip), dst1.add(skip)),
                            (pa.add(skip).cast_const(), pb.add(skip).cast_const()),
                            n,
                            walk,
                        )
                    };
                    if !done {
                        // Only bf16's Avg has no one-pass form where its
                        // steps do nothing: without AVX2, or below a step.
                        assert!(
                            op == ReduceOp::Avg
                                && std::any::type_name::<T>().ends_with("bf16")
                                && (n < 16 || !avx2_here()),
                            "n {n}"
                        );
                        continue;
                    }
                    let got0 = if in_place0 { &a } else { &d0 };
                    let got1 = if in_place1 { &b } else { &d1 };
                    let what = format!(
                        "{} {op} n={n} skip={skip} in place {in_place0}/{in_place1} {walk:?}",
                        std::any::type_name::<T>()
                    );
                    assert!(
                        bytes_of(&got0[skip..]) == bytes_of(&want),
                        "output 0: {what}"
                    );
                    assert!(
                        bytes_of(&got1[skip..]) == bytes_of(&want),
                        "output 1: {what}"
                    );
                }
            }
        }
    }

    #[test]
    fn both_outputs_kernel_matches_combine_into_for_every_type() {
        both_outputs_match::<f32>();
        both_outputs_match::<f64>();
        both_outputs_match::<f16>();
        both_outputs_match::<bf16>();
        both_outputs_match::<i8>();
        both_outputs_match::<u8>();
        both_outputs_match::<i32>();
        both_outputs_match::<u32>();
        both_outputs_match::<i64>();
        both_outputs_match::<u64>();
    }

    #[test]
    fn three_operand_and_assign_agree() {
        let a: Vec<f32> = (0..100).map(|i| i as f32 * 0.37 - 9.0).collect();
        let b: Vec<f32> = (0..100).map(|i| (i as f32).sin()).collect();
        for op in ReduceOp::ALL {
            let mut out = vec![0f32; 100];
            f32::combine_into(op, &mut out, &a, &b);
            let mut acc = a.clone();
            f32::combine_assign(op, &mut acc, &b);
            let mut rev = b.clone();
            f32::combine_assign_rev(op, &mut rev, &a);
            assert_eq!(out, acc, "{op}");
            assert_eq!(out, rev, "{op}");
        }
    }
}
