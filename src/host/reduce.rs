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

use half::slice::HalfFloatSliceExt;

use crate::types::ReduceOp;

/// Per-type reduction kernels. Sealed: a supertrait of [`crate::Element`]
/// that users can neither name nor implement.
pub trait Kernels: Sized + Copy {
    /// `out[i] = a[i] ⊕ b[i]`. `Avg` combines as `Sum`.
    fn combine_into(op: ReduceOp, out: &mut [Self], a: &[Self], b: &[Self]);
    /// `acc[i] = acc[i] ⊕ x[i]`. `Avg` combines as `Sum`.
    fn combine_assign(op: ReduceOp, acc: &mut [Self], x: &[Self]);
    /// `acc[i] = x[i] ⊕ acc[i]`. `Avg` combines as `Sum`.
    fn combine_assign_rev(op: ReduceOp, acc: &mut [Self], x: &[Self]);
    /// `acc[i] = acc[i] / n`: the final step of `Avg`.
    fn divide_by(acc: &mut [Self], n: usize);
}

#[inline(always)]
fn zip_into<T: Copy>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

#[inline(always)]
fn zip_assign<T: Copy>(acc: &mut [T], x: &[T], f: impl Fn(T, T) -> T) {
    debug_assert_eq!(acc.len(), x.len());
    for (a, &b) in acc.iter_mut().zip(x) {
        *a = f(*a, b);
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

macro_rules! int_kernels {
    ($($t:ty),*) => {$(
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
            fn divide_by(acc: &mut [Self], n: usize) {
                debug_assert!(n > 0);
                match <$t>::try_from(n) {
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
                dispatch_op!(op, |f| zip_into(out, a, b, f), |x: $t, y: $t| x + y, |x: $t, y: $t| x * y, nan_min::<$t>, nan_max::<$t>)
            }
            fn combine_assign(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                dispatch_op!(op, |f| zip_assign(acc, x, f), |x: $t, y: $t| x + y, |x: $t, y: $t| x * y, nan_min::<$t>, nan_max::<$t>)
            }
            fn combine_assign_rev(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                dispatch_op!(
                    op,
                    |f| zip_assign(acc, x, f),
                    |a: $t, x: $t| x + a,
                    |a: $t, x: $t| x * a,
                    |a: $t, x: $t| nan_min(x, a),
                    |a: $t, x: $t| nan_max(x, a)
                )
            }
            fn divide_by(acc: &mut [Self], n: usize) {
                let divisor = n as $t;
                acc.iter_mut().for_each(|a| *a /= divisor);
            }
        }
    )*};
}
float_kernels!(f32, f64);

/// Minimum that propagates NaN (unlike `f32::min`, which drops it).
#[inline(always)]
fn nan_min<T: num_like::Float>(a: T, b: T) -> T {
    if a.is_nan_() || b.is_nan_() {
        a.add_(b)
    } else if b < a {
        b
    } else {
        a
    }
}

/// Maximum that propagates NaN (unlike `f32::max`, which drops it).
#[inline(always)]
fn nan_max<T: num_like::Float>(a: T, b: T) -> T {
    if a.is_nan_() || b.is_nan_() {
        a.add_(b)
    } else if b > a {
        b
    } else {
        a
    }
}

mod num_like {
    /// The two float operations `nan_min`/`nan_max` need, for `f32` and `f64`.
    pub trait Float: Copy + PartialOrd {
        fn is_nan_(self) -> bool;
        fn add_(self, other: Self) -> Self;
    }
    impl Float for f32 {
        fn is_nan_(self) -> bool {
            self.is_nan()
        }
        fn add_(self, other: Self) -> Self {
            self + other
        }
    }
    impl Float for f64 {
        fn is_nan_(self) -> bool {
            self.is_nan()
        }
        fn add_(self, other: Self) -> Self {
            self + other
        }
    }
}

/// Elements per conversion block for `f16`/`bf16`: two `f32` blocks of this
/// size (8 KiB) stay in L1 beside the operands.
const HALF_BLOCK: usize = 1024;

macro_rules! half_kernels {
    ($($t:ty),*) => {$(
        impl Kernels for $t {
            fn combine_into(op: ReduceOp, out: &mut [Self], a: &[Self], b: &[Self]) {
                debug_assert!(out.len() == a.len() && a.len() == b.len());
                let mut fa = [0f32; HALF_BLOCK];
                let mut fb = [0f32; HALF_BLOCK];
                for ((o, a), b) in out.chunks_mut(HALF_BLOCK).zip(a.chunks(HALF_BLOCK)).zip(b.chunks(HALF_BLOCK)) {
                    let n = o.len();
                    a.convert_to_f32_slice(&mut fa[..n]);
                    b.convert_to_f32_slice(&mut fb[..n]);
                    f32::combine_assign(op, &mut fa[..n], &fb[..n]);
                    o.convert_from_f32_slice(&fa[..n]);
                }
            }
            fn combine_assign(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                debug_assert_eq!(acc.len(), x.len());
                let mut fa = [0f32; HALF_BLOCK];
                let mut fb = [0f32; HALF_BLOCK];
                for (a, x) in acc.chunks_mut(HALF_BLOCK).zip(x.chunks(HALF_BLOCK)) {
                    let n = a.len();
                    a.convert_to_f32_slice(&mut fa[..n]);
                    x.convert_to_f32_slice(&mut fb[..n]);
                    f32::combine_assign(op, &mut fa[..n], &fb[..n]);
                    a.convert_from_f32_slice(&fa[..n]);
                }
            }
            fn combine_assign_rev(op: ReduceOp, acc: &mut [Self], x: &[Self]) {
                debug_assert_eq!(acc.len(), x.len());
                let mut fa = [0f32; HALF_BLOCK];
                let mut fb = [0f32; HALF_BLOCK];
                for (a, x) in acc.chunks_mut(HALF_BLOCK).zip(x.chunks(HALF_BLOCK)) {
                    let n = a.len();
                    a.convert_to_f32_slice(&mut fa[..n]);
                    x.convert_to_f32_slice(&mut fb[..n]);
                    f32::combine_assign_rev(op, &mut fa[..n], &fb[..n]);
                    a.convert_from_f32_slice(&fa[..n]);
                }
            }
            fn divide_by(acc: &mut [Self], n: usize) {
                let divisor = n as f32;
                let mut fa = [0f32; HALF_BLOCK];
                for a in acc.chunks_mut(HALF_BLOCK) {
                    let len = a.len();
                    a.convert_to_f32_slice(&mut fa[..len]);
                    fa[..len].iter_mut().for_each(|v| *v /= divisor);
                    a.convert_from_f32_slice(&fa[..len]);
                }
            }
        }
    )*};
}
half_kernels!(half::f16, half::bf16);

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

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
