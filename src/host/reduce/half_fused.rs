//! One-pass reductions of `f16` and `bf16` on x86-64: eight elements per
//! step are widened to `f32` in registers, combined, and rounded back,
//! where the blocked kernels (`half_kernels!`) convert whole blocks into
//! `f32` arrays in L1 and back, four passes over them. Same arithmetic,
//! same bits: each `f32` operation here is the one `nan_sum`, `nan_prod`,
//! `nan_min` and `nan_max` perform (the same compares and picks), and the
//! conversions are the exact widening and the round-to-nearest-even
//! narrowing of `convert` (F16C's `vcvtps2ph` with rounding 0; for `bf16`
//! the integer rounding of `bf16_bits`, NaNs quieted). The test
//! `fused_half_kernels_give_the_blocked_bits` holds them to it bit for bit.
//!
//! Each function runs whole steps (eight elements, sixteen for `bf16`) and
//! returns how many elements it did; the caller finishes the rest the
//! blocked way.

use std::arch::x86_64::*;

use crate::types::ReduceOp;

/// The operator as a constant, so each one is its own loop.
pub(super) const SUM: u8 = 0;
pub(super) const PROD: u8 = 1;
pub(super) const MIN: u8 = 2;
pub(super) const MAX: u8 = 3;

/// [`SUM`], [`PROD`], [`MIN`] or [`MAX`] for `op` (`Avg` combines as `Sum`).
pub(super) fn code(op: ReduceOp) -> u8 {
    match op.combining() {
        ReduceOp::Sum | ReduceOp::Avg => SUM,
        ReduceOp::Prod => PROD,
        ReduceOp::Min => MIN,
        ReduceOp::Max => MAX,
    }
}

/// Lane-wise `a ⊕ b` with the NaN rules of the scalar folds: a sum or a
/// product of a picked operand (`a` itself where `a` is NaN), and for
/// min/max the first NaN quieted (`x + x`), else the scalar compare.
#[inline(always)]
unsafe fn apply<const OP: u8>(a: __m256, b: __m256) -> __m256 {
    // SAFETY (every intrinsic here): the callers enable AVX2.
    unsafe {
        let a_nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a);
        match OP {
            SUM => _mm256_add_ps(a, _mm256_blendv_ps(b, a, a_nan)),
            PROD => _mm256_mul_ps(a, _mm256_blendv_ps(b, a, a_nan)),
            _ => {
                let any_nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, b);
                let first = _mm256_blendv_ps(b, a, a_nan);
                let quieted = _mm256_add_ps(first, first);
                // nan_min: `if b < a { b } else { a }`; nan_max: `b > a`.
                let take_b = if OP == MIN {
                    _mm256_cmp_ps::<_CMP_LT_OQ>(b, a)
                } else {
                    _mm256_cmp_ps::<_CMP_GT_OQ>(b, a)
                };
                let ordered = _mm256_blendv_ps(a, b, take_b);
                _mm256_blendv_ps(ordered, quieted, any_nan)
            }
        }
    }
}

/// Eight `f16` at `a` and `b` widened, combined and narrowed (nearest
/// even): the eight results' bits.
#[inline(always)]
unsafe fn f16_step<const OP: u8>(a: *const u16, b: *const u16) -> __m128i {
    // SAFETY: the callers enable AVX2 and F16C and pass eight readable
    // elements at each pointer.
    unsafe {
        let x = _mm256_cvtph_ps(_mm_loadu_si128(a.cast()));
        let y = _mm256_cvtph_ps(_mm_loadu_si128(b.cast()));
        _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(apply::<OP>(x, y))
    }
}

/// `out[i] = a[i] ⊕ b[i]` over `f16` bits, whole steps of eight; `out`
/// may be `a` or `b` (each step loads before it stores).
///
/// # Safety
/// The CPU must support AVX2 and F16C; each pointer is valid for `n`
/// elements, and `out` is `a`, `b`, or apart from both.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn zip_f16<const OP: u8>(
    out: *mut u16,
    a: *const u16,
    b: *const u16,
    n: usize,
) -> usize {
    let mut i = 0;
    // SAFETY: i + 8 ≤ n for every access; the caller's contract.
    unsafe {
        while i + 8 <= n {
            _mm_storeu_si128(out.add(i).cast(), f16_step::<OP>(a.add(i), b.add(i)));
            i += 8;
        }
    }
    i
}

/// Eight `f32` rounded to `bf16` as `convert::bf16_bits` rounds one
/// (nearest even; a NaN keeps its top bits, quieted), each in the low half
/// of its 32-bit lane.
#[inline(always)]
unsafe fn narrow_bf16(r: __m256) -> __m256i {
    // SAFETY: the callers enable AVX2.
    unsafe {
        let x = _mm256_castps_si256(r);
        let magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff));
        let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f80_0000));
        let high = _mm256_srli_epi32::<16>(x);
        let lowest_kept = _mm256_and_si256(high, _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lowest_kept);
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
        let quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x0040));
        _mm256_blendv_epi8(rounded, quiet_nan, nan)
    }
}

/// Sixteen `bf16` at `a` and `b` combined: interleaving a 256-bit load
/// with zeros widens elements 0–3 and 8–11 (and 4–7, 12–15) exactly to
/// `f32`, and the saturating pack of the two narrowed halves (every lane
/// 0..=0xffff, so exact) puts the results back in order, both working
/// within each 128-bit half.
#[inline(always)]
unsafe fn bf16_step<const OP: u8>(a: *const u16, b: *const u16) -> __m256i {
    // SAFETY: the callers enable AVX2 and pass sixteen readable elements
    // at each pointer.
    unsafe {
        let zero = _mm256_setzero_si256();
        let x = _mm256_loadu_si256(a.cast());
        let y = _mm256_loadu_si256(b.cast());
        let low = apply::<OP>(
            _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
            _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, y)),
        );
        let high = apply::<OP>(
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, y)),
        );
        _mm256_packus_epi32(narrow_bf16(low), narrow_bf16(high))
    }
}

/// As [`zip_f16`], over `bf16` bits, sixteen at a time ([`bf16_step`]).
///
/// # Safety
/// The CPU must support AVX2; as [`zip_f16`] otherwise.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn zip_bf16<const OP: u8>(
    out: *mut u16,
    a: *const u16,
    b: *const u16,
    n: usize,
) -> usize {
    let mut i = 0;
    // SAFETY: i + 16 ≤ n for every access; the caller's contract.
    unsafe {
        while i + 16 <= n {
            _mm256_storeu_si256(out.add(i).cast(), bf16_step::<OP>(a.add(i), b.add(i)));
            i += 16;
        }
    }
    i
}

/// `out[i] = a[i] × scalar` over `f16` bits, whole steps of eight: the
/// premultiplied `Avg`'s scaling (`Kernels::premultiply_avg`), one
/// `f32` product rounded once, as its blocked loop computes it.
///
/// # Safety
/// The CPU must support AVX2 and F16C; each pointer is valid for `n`
/// elements, and `out` is `a` or apart from it.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn scale_f16(out: *mut u16, a: *const u16, scalar: f32, n: usize) -> usize {
    let s = _mm256_set1_ps(scalar);
    let mut i = 0;
    // SAFETY: i + 8 ≤ n for every access; the caller's contract.
    unsafe {
        while i + 8 <= n {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(a.add(i).cast()));
            let r = _mm256_mul_ps(x, s);
            _mm_storeu_si128(
                out.add(i).cast(),
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r),
            );
            i += 8;
        }
    }
    i
}

/// The steps of a two-output fold (`Kernels::combine_into_both`): walking
/// up, steps at 0, `step`, … while whole; walking down, steps ending at
/// `n`, `n - step`, … Returns how many elements the steps cover: the
/// first that many walking up, the last that many walking down.
#[inline(always)]
fn both_steps(n: usize, step: usize, down: bool, mut each: impl FnMut(usize)) -> usize {
    let whole = n / step * step;
    if down {
        let mut i = n;
        while i >= step && i - step >= n - whole {
            i -= step;
            each(i);
        }
    } else {
        let mut i = 0;
        while i + step <= n {
            each(i);
            i += step;
        }
    }
    whole
}

/// `d0[i] = d1[i] = x0[i] ⊕ x1[i]` over `f16` bits in whole steps of
/// eight, walking up or `down` (see [`both_steps`]); returns how many
/// elements it did.
///
/// # Safety
/// The CPU must support AVX2 and F16C; each pointer is valid for `n`
/// elements; `d0` is `x0` or apart from all three others, `d1` is `x1` or
/// apart from all three others.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn zip_both_f16<const OP: u8>(
    (d0, d1): (*mut u16, *mut u16),
    (x0, x1): (*const u16, *const u16),
    n: usize,
    down: bool,
) -> usize {
    both_steps(n, 8, down, |i| {
        // SAFETY: i + 8 ≤ n; both loads precede both stores.
        unsafe {
            let r = f16_step::<OP>(x0.add(i), x1.add(i));
            _mm_storeu_si128(d0.add(i).cast(), r);
            _mm_storeu_si128(d1.add(i).cast(), r);
        }
    })
}

/// As [`zip_both_f16`], over `bf16` bits in steps of sixteen (widened and
/// packed as [`bf16_step`] does).
///
/// # Safety
/// The CPU must support AVX2; as [`zip_both_f16`] otherwise.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn zip_both_bf16<const OP: u8>(
    (d0, d1): (*mut u16, *mut u16),
    (x0, x1): (*const u16, *const u16),
    n: usize,
    down: bool,
) -> usize {
    both_steps(n, 16, down, |i| {
        // SAFETY: i + 16 ≤ n; both loads precede both stores.
        unsafe {
            let r = bf16_step::<OP>(x0.add(i), x1.add(i));
            _mm256_storeu_si256(d0.add(i).cast(), r);
            _mm256_storeu_si256(d1.add(i).cast(), r);
        }
    })
}
