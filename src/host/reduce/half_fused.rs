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
//! blocked way. Where the CPU has AVX-512 with BF16 (`has_avx512_bf16`),
//! `bf16` runs thirty-two elements a step in 512-bit registers and narrows
//! with `vcvtne2ps2bf16` (`bf16_step32`): twice the 256-bit kernels'
//! speed on data in cache, the same bits.

use std::arch::x86_64::*;

use crate::types::ReduceOp;

/// The operator as a constant, so each one is its own loop.
pub(super) const SUM: u8 = 0;
pub(super) const PROD: u8 = 1;
pub(super) const MIN: u8 = 2;
pub(super) const MAX: u8 = 3;
/// Not an operator: for [`zip_both_bf16`] and [`zip_both_bf16_512`], the
/// sum rounded to `bf16`, then halved and rounded again, as a two-rank
/// `Avg` folds and divides (`Kernels::average_two_into_both`).
pub(super) const HALVED_SUM: u8 = 4;

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

/// Sixteen `bf16` widened exactly to `f32` by interleaving them with zeros:
/// elements 0–3 and 8–11 in the first vector, 4–7 and 12–15 in the second
/// (the unpacks work within each 128-bit half).
#[inline(always)]
unsafe fn widen_bf16(x: __m256i) -> (__m256, __m256) {
    // SAFETY: the callers enable AVX2.
    unsafe {
        let zero = _mm256_setzero_si256();
        (
            _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)),
        )
    }
}

/// The inverse of [`widen_bf16`]: both halves narrowed by [`narrow_bf16`]
/// and joined by a saturating pack (every lane 0..=0xffff, so exact),
/// which puts the sixteen back in order, also half by half.
#[inline(always)]
unsafe fn narrow_bf16_pair(low: __m256, high: __m256) -> __m256i {
    // SAFETY: the callers enable AVX2.
    unsafe { _mm256_packus_epi32(narrow_bf16(low), narrow_bf16(high)) }
}

/// Sixteen `bf16` at `a` and `b` combined (widened, [`apply`], narrowed).
#[inline(always)]
unsafe fn bf16_step<const OP: u8>(a: *const u16, b: *const u16) -> __m256i {
    // SAFETY: the callers enable AVX2 and pass sixteen readable elements
    // at each pointer.
    unsafe {
        let (x_low, x_high) = widen_bf16(_mm256_loadu_si256(a.cast()));
        let (y_low, y_high) = widen_bf16(_mm256_loadu_si256(b.cast()));
        narrow_bf16_pair(apply::<OP>(x_low, y_low), apply::<OP>(x_high, y_high))
    }
}

/// Sixteen `bf16` at `a` times `scalar` (an `f32` product, rounded once).
#[inline(always)]
unsafe fn bf16_scale_step(a: *const u16, scalar: __m256) -> __m256i {
    // SAFETY: the callers enable AVX2 and pass sixteen readable elements.
    unsafe {
        let (low, high) = widen_bf16(_mm256_loadu_si256(a.cast()));
        narrow_bf16_pair(_mm256_mul_ps(low, scalar), _mm256_mul_ps(high, scalar))
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

/// Whether the CPU has what the 512-bit `bf16` kernels use: AVX-512 F,
/// BW (16-bit unpacks), DQ (`vfpclassps`) and BF16 (`vcvtne2ps2bf16`).
/// Detected once, then cached loads.
pub(super) fn has_avx512_bf16() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512bf16")
}

/// [`apply`] over sixteen lanes, its picks made with AVX-512 masks.
#[inline(always)]
unsafe fn apply512<const OP: u8>(a: __m512, b: __m512) -> __m512 {
    // SAFETY (every intrinsic here): the callers enable AVX-512 F.
    unsafe {
        let a_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, a);
        // `b`, or `a` itself where `a` is NaN.
        let first = _mm512_mask_blend_ps(a_nan, b, a);
        match OP {
            SUM => _mm512_add_ps(a, first),
            PROD => _mm512_mul_ps(a, first),
            _ => {
                let any_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, b);
                let quieted = _mm512_add_ps(first, first);
                let take_b = if OP == MIN {
                    _mm512_cmp_ps_mask::<_CMP_LT_OQ>(b, a)
                } else {
                    _mm512_cmp_ps_mask::<_CMP_GT_OQ>(b, a)
                };
                let ordered = _mm512_mask_blend_ps(take_b, a, b);
                _mm512_mask_blend_ps(any_nan, ordered, quieted)
            }
        }
    }
}

/// [`widen_bf16`] of thirty-two: elements 0–3, 8–11, 16–19 and 24–27 in
/// the first vector, the others in the second.
#[inline(always)]
unsafe fn widen_bf16_512(x: __m512i) -> (__m512, __m512) {
    // SAFETY: the callers enable AVX-512 F and BW.
    unsafe {
        let zero = _mm512_setzero_si512();
        (
            _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x)),
            _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x)),
        )
    }
}

/// The inverse of [`widen_bf16_512`] by `vcvtne2ps2bf16`, one instruction
/// where [`narrow_bf16`] takes ten per eight. Its rounding (nearest even)
/// and NaNs (the top bits, quieted) are `bf16_bits`', but it flushes
/// subnormal `f32` to zero where `bf16_bits` rounds them: `None` when a
/// lane holds one, and the caller narrows those thirty-two the 256-bit way.
#[inline(always)]
unsafe fn narrow_bf16_512(low: __m512, high: __m512) -> Option<__m512i> {
    // SAFETY: the callers enable AVX-512 F, DQ and BF16.
    unsafe {
        const SUBNORMAL: i32 = 0x20;
        if _mm512_fpclass_ps_mask::<SUBNORMAL>(low) | _mm512_fpclass_ps_mask::<SUBNORMAL>(high) != 0
        {
            return None;
        }
        // Words 0–15 come from `low`, 16–31 from `high` (not lane by lane),
        // so the 64-bit quarters hold elements 0–3, 8–11, 16–19, 24–27,
        // 4–7, 12–15, 20–23, 28–31: quarters 0, 4, 1, 5, 2, 6, 3, 7 are
        // the elements in order.
        let words: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(high, low));
        Some(_mm512_permutexvar_epi64(
            _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0),
            words,
        ))
    }
}

/// Two sixteen-element results as one vector, in order.
#[inline(always)]
unsafe fn join_256(first: __m256i, second: __m256i) -> __m512i {
    // SAFETY: the callers enable AVX-512 F.
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second) }
}

/// Thirty-two `bf16` at `a` and `b` combined, as two [`bf16_step`]s give
/// them: widened, combined by [`apply512`], narrowed by
/// [`narrow_bf16_512`] (or as two [`bf16_step`]s where a result is
/// subnormal).
#[inline(always)]
unsafe fn bf16_step32<const OP: u8>(a: *const u16, b: *const u16) -> __m512i {
    // SAFETY: the callers enable AVX2 and what `has_avx512_bf16` checks,
    // and pass thirty-two readable elements at each pointer.
    unsafe {
        let (x_low, x_high) = widen_bf16_512(_mm512_loadu_si512(a.cast()));
        let (y_low, y_high) = widen_bf16_512(_mm512_loadu_si512(b.cast()));
        let low = apply512::<OP>(x_low, y_low);
        let high = apply512::<OP>(x_high, y_high);
        narrow_bf16_512(low, high).unwrap_or_else(|| {
            join_256(bf16_step::<OP>(a, b), bf16_step::<OP>(a.add(16), b.add(16)))
        })
    }
}

/// Thirty-two `bf16` at `a` times `scalar`, as two [`bf16_scale_step`]s.
#[inline(always)]
unsafe fn bf16_scale_step32(a: *const u16, scalar: __m512) -> __m512i {
    // SAFETY: as `bf16_step32`, for `a` alone.
    unsafe {
        let (low, high) = widen_bf16_512(_mm512_loadu_si512(a.cast()));
        let low = _mm512_mul_ps(low, scalar);
        let high = _mm512_mul_ps(high, scalar);
        narrow_bf16_512(low, high).unwrap_or_else(|| {
            let scalar = _mm512_castps512_ps256(scalar);
            join_256(
                bf16_scale_step(a, scalar),
                bf16_scale_step(a.add(16), scalar),
            )
        })
    }
}

/// [`zip_bf16`] thirty-two elements a step ([`bf16_step32`]), then
/// sixteen.
///
/// # Safety
/// The CPU must support AVX2 and [`has_avx512_bf16`]; as [`zip_f16`]
/// otherwise.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512dq,avx512bf16")]
pub(super) unsafe fn zip_bf16_512<const OP: u8>(
    out: *mut u16,
    a: *const u16,
    b: *const u16,
    n: usize,
) -> usize {
    let mut i = 0;
    // SAFETY: i + 32 (then 16) ≤ n for every access; the caller's contract.
    unsafe {
        while i + 32 <= n {
            _mm512_storeu_si512(out.add(i).cast(), bf16_step32::<OP>(a.add(i), b.add(i)));
            i += 32;
        }
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

/// `out[i] = a[i] × scalar` over `bf16` bits, whole steps of sixteen: the
/// division of a `bf16` `Avg` by a power of two (`Kernels::divide_by`),
/// one `f32` product rounded once, as its blocked loop computes it.
///
/// # Safety
/// The CPU must support AVX2; each pointer is valid for `n` elements, and
/// `out` is `a` or apart from it.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn scale_bf16(out: *mut u16, a: *const u16, scalar: f32, n: usize) -> usize {
    let s = _mm256_set1_ps(scalar);
    let mut i = 0;
    // SAFETY: i + 16 ≤ n for every access; the caller's contract.
    unsafe {
        while i + 16 <= n {
            _mm256_storeu_si256(out.add(i).cast(), bf16_scale_step(a.add(i), s));
            i += 16;
        }
    }
    i
}

/// [`scale_bf16`] thirty-two elements a step ([`bf16_scale_step32`]),
/// then sixteen.
///
/// # Safety
/// The CPU must support AVX2 and [`has_avx512_bf16`]; as [`scale_bf16`]
/// otherwise.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512dq,avx512bf16")]
pub(super) unsafe fn scale_bf16_512(out: *mut u16, a: *const u16, scalar: f32, n: usize) -> usize {
    let s = _mm512_set1_ps(scalar);
    let mut i = 0;
    // SAFETY: i + 32 (then 16) ≤ n for every access; the caller's contract.
    unsafe {
        while i + 32 <= n {
            _mm512_storeu_si512(out.add(i).cast(), bf16_scale_step32(a.add(i), s));
            i += 32;
        }
        let s = _mm512_castps512_ps256(s);
        while i + 16 <= n {
            _mm256_storeu_si256(out.add(i).cast(), bf16_scale_step(a.add(i), s));
            i += 16;
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
            let r = if OP == HALVED_SUM {
                bf16_halve(bf16_step::<SUM>(x0.add(i), x1.add(i)))
            } else {
                bf16_step::<OP>(x0.add(i), x1.add(i))
            };
            _mm256_storeu_si256(d0.add(i).cast(), r);
            _mm256_storeu_si256(d1.add(i).cast(), r);
        }
    })
}

/// [`zip_both_bf16`] thirty-two elements a step ([`bf16_step32`]), then
/// sixteen, in the walk's order.
///
/// # Safety
/// The CPU must support AVX2 and [`has_avx512_bf16`]; as [`zip_both_f16`]
/// otherwise.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512dq,avx512bf16")]
pub(super) unsafe fn zip_both_bf16_512<const OP: u8>(
    (d0, d1): (*mut u16, *mut u16),
    (x0, x1): (*const u16, *const u16),
    n: usize,
    down: bool,
) -> usize {
    let wide = both_steps(n, 32, down, |i| {
        // SAFETY: i + 32 ≤ n; both loads precede both stores.
        unsafe {
            let r = if OP == HALVED_SUM {
                bf16_halve32(bf16_step32::<SUM>(x0.add(i), x1.add(i)))
            } else {
                bf16_step32::<OP>(x0.add(i), x1.add(i))
            };
            _mm512_storeu_si512(d0.add(i).cast(), r);
            _mm512_storeu_si512(d1.add(i).cast(), r);
        }
    });
    // What is left lies after the wide steps walking up, before them
    // walking down: sixteen-element steps there continue the walk, and
    // the two runs together are the first (last) elements.
    let at = if down { 0 } else { wide };
    // SAFETY: `at..at + n - wide` lies within the n elements; AVX2 is on.
    let rest = unsafe {
        zip_both_bf16::<OP>(
            (d0.add(at), d1.add(at)),
            (x0.add(at), x1.add(at)),
            n - wide,
            down,
        )
    };
    wide + rest
}

/// Sixteen `bf16` (a result of [`bf16_step`]) halved: widened, times 0.5
/// (exact in `f32`), rounded back once, as `divide_by(2)` computes it.
#[inline(always)]
unsafe fn bf16_halve(r: __m256i) -> __m256i {
    // SAFETY: the callers enable AVX2.
    unsafe {
        let half = _mm256_set1_ps(0.5);
        let (low, high) = widen_bf16(r);
        narrow_bf16_pair(_mm256_mul_ps(low, half), _mm256_mul_ps(high, half))
    }
}

/// [`bf16_halve`] of thirty-two (a result of [`bf16_step32`]), narrowed
/// the 256-bit way where a halved value is subnormal (see
/// [`narrow_bf16_512`]).
#[inline(always)]
unsafe fn bf16_halve32(sum: __m512i) -> __m512i {
    // SAFETY: the callers enable AVX2 and what `has_avx512_bf16` checks.
    unsafe {
        let half = _mm512_set1_ps(0.5);
        let (low, high) = widen_bf16_512(sum);
        narrow_bf16_512(_mm512_mul_ps(low, half), _mm512_mul_ps(high, half)).unwrap_or_else(|| {
            join_256(
                bf16_halve(_mm512_castsi512_si256(sum)),
                bf16_halve(_mm512_extracti64x4_epi64::<1>(sum)),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-rank `bf16` average kernels give what folding and then
    /// dividing by two gives (`combine_into`, then `divide_by`), the
    /// 512-bit one as the 256-bit one, both walks: over random bits with
    /// NaNs and infinities, and pairs whose sum is at most twice the
    /// smallest normal, so halving makes subnormals (which the 512-bit
    /// narrowing flushes: its steps must fall back) in some 32-element
    /// steps and not others.
    #[test]
    fn average_two_bf16_kernels_fold_then_halve() {
        use crate::host::reduce::Kernels;
        use half::bf16;
        let mut seed = 0x5851_F42D_4C95_7F2Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let n = 1024;
        let (mut a, mut b) = (vec![0u16; n], vec![0u16; n]);
        for i in 0..n {
            let (r, q) = (next(), next());
            (a[i], b[i]) = if (i / 32) % 3 == 1 && i % 5 == 2 {
                // Tiny sums: the smallest normal, or a subnormal, and a
                // subnormal of either sign.
                (0x0080 | (r as u16 & 0x807f), q as u16 & 0x807f)
            } else if i % 11 == 0 {
                (
                    [0x7f80, 0xff80, 0x7fc1, 0xff81, 0x0000, 0x8000][(r % 6) as usize],
                    q as u16,
                )
            } else {
                (r as u16 | 0x0080, q as u16 | 0x0080)
            };
        }
        let as_bf16 = |v: &[u16]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_bits(x)).collect() };
        let mut want = vec![bf16::ZERO; n];
        bf16::combine_into(ReduceOp::Sum, &mut want, &as_bf16(&a), &as_bf16(&b));
        bf16::divide_by(&mut want, 2);
        let want: Vec<u16> = want.iter().map(|v| v.to_bits()).collect();
        let subnormal_results = want
            .iter()
            .filter(|&&w| w & 0x7f80 == 0 && w & 0x7f != 0)
            .count();
        assert!(subnormal_results > 10, "{subnormal_results}");
        let wide = is_x86_feature_detected!("avx2") && has_avx512_bf16();
        if !is_x86_feature_detected!("avx2") {
            eprintln!("no AVX2 here: the bf16 average kernels are not run");
            return;
        }
        if !wide {
            eprintln!("no AVX-512 BF16 here: the 512-bit bf16 average kernel is not run");
        }
        // 48, 63, 1016: 512-bit steps, then a 256-bit one continuing the
        // walk; what no step covers must stay as it was.
        const UNTOUCHED: u16 = 0x5a5a;
        for len in [16, 31, 32, 47, 48, 63, 64, 1000, 1016] {
            for down in [false, true] {
                for kernel in [false, true].into_iter().filter(|&w| !w || wide) {
                    let (mut d0, mut d1) = (vec![UNTOUCHED; len], vec![UNTOUCHED; len]);
                    let d = (d0.as_mut_ptr(), d1.as_mut_ptr());
                    let x = (a.as_ptr(), b.as_ptr());
                    // SAFETY: AVX2 (and, for the wide kernel, the AVX-512
                    // features) are present; four buffers of `len`
                    // elements, the outputs apart.
                    let done = unsafe {
                        if kernel {
                            zip_both_bf16_512::<HALVED_SUM>(d, x, len, down)
                        } else {
                            zip_both_bf16::<HALVED_SUM>(d, x, len, down)
                        }
                    };
                    let what = format!("len {len}, down {down}, 512-bit {kernel}");
                    assert_eq!(done, len / 16 * 16, "{what}");
                    let covered = if down { len - done..len } else { 0..done };
                    assert_eq!(d0[covered.clone()], want[covered.clone()], "{what}");
                    assert_eq!(d1[covered.clone()], want[covered.clone()], "{what}");
                    let outside = |d: &[u16]| {
                        d.iter()
                            .enumerate()
                            .all(|(i, &v)| covered.contains(&i) || v == UNTOUCHED)
                    };
                    assert!(outside(&d0) && outside(&d1), "{what}: wrote past its steps");
                }
            }
        }
    }

    /// The 512-bit `bf16` kernels give the 256-bit ones' bits (which
    /// `fused_half_kernels_give_the_blocked_bits` and
    /// `float_division_by_powers_of_two_gives_the_quotient_bits` hold to
    /// the blocked kernels wherever dispatch picks them): every operator,
    /// one output and two walking either way, scaling in place and apart, over random bits with subnormals placed
    /// in some steps and not others (the wide step's fallback), NaNs with
    /// payloads, infinities and zeros, at lengths around both step sizes.
    #[test]
    fn wide_bf16_kernels_give_the_narrow_bits() {
        if !(is_x86_feature_detected!("avx2") && has_avx512_bf16()) {
            eprintln!("no AVX-512 BF16 here: the 512-bit bf16 kernels are not run");
            return;
        }
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let special: [u16; 10] = [
            0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc1, 0xff81, 0x0001, 0x807f, 0x0080, 0x3f80,
        ];
        let total = 1200;
        let mut make = |subnormal_steps: bool| -> Vec<u16> {
            (0..total)
                .map(|i| {
                    let r = next();
                    // Random bits rarely make a subnormal; plant them in
                    // every fourth 32-element step, nowhere else.
                    let planted = subnormal_steps && (i / 32) % 4 == 1 && i % 7 == 3;
                    match (planted, i % 5) {
                        (true, _) => (r as u16) & 0x807f,
                        (false, 0) => special[(r % 10) as usize],
                        // No subnormal outside the planted steps.
                        (false, _) if (r as u16) & 0x7f80 == 0 => (r as u16) | 0x0080,
                        _ => r as u16,
                    }
                })
                .collect()
        };
        let (a_all, b_all) = (make(true), make(false));
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            for (offset, n) in [
                (0, 15),
                (1, 16),
                (2, 31),
                (0, 32),
                (3, 48),
                (1, 63),
                (0, 1100),
            ] {
                let (a, b) = (
                    &a_all[offset..offset + n],
                    &b_all[offset + 3..offset + 3 + n],
                );
                let (mut narrow, mut wide) = (vec![0u16; n], vec![0u16; n]);
                // SAFETY: AVX2 and the AVX-512 features are present; every
                // buffer holds n elements, outputs apart from inputs.
                let (done_narrow, done_wide) = unsafe {
                    (
                        match code(op) {
                            SUM => zip_bf16::<SUM>(narrow.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n),
                            PROD => {
                                zip_bf16::<PROD>(narrow.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n)
                            }
                            MIN => zip_bf16::<MIN>(narrow.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n),
                            _ => zip_bf16::<MAX>(narrow.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n),
                        },
                        match code(op) {
                            SUM => {
                                zip_bf16_512::<SUM>(wide.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n)
                            }
                            PROD => {
                                zip_bf16_512::<PROD>(wide.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n)
                            }
                            MIN => {
                                zip_bf16_512::<MIN>(wide.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n)
                            }
                            _ => zip_bf16_512::<MAX>(wide.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n),
                        },
                    )
                };
                if op == ReduceOp::Sum {
                    // The scaling kernels likewise (Avg's division by a
                    // power of two), in place and apart.
                    for scalar in [0.5f32, 0.25, 1.0 / 1024.0, 3.0, 0.3] {
                        let (mut narrow, mut wide) = (vec![0u16; n], a.to_vec());
                        // SAFETY: as above; `wide` scales in place.
                        let done = unsafe {
                            (
                                scale_bf16(narrow.as_mut_ptr(), a.as_ptr(), scalar, n),
                                scale_bf16_512(wide.as_mut_ptr(), wide.as_ptr(), scalar, n),
                            )
                        };
                        assert_eq!(done, (n / 16 * 16, n / 16 * 16), "scale {scalar} n {n}");
                        assert_eq!(wide[..done.0], narrow[..done.0], "scale {scalar} n {n}");
                    }
                }
                assert_eq!(done_narrow, n / 16 * 16, "{op} n {n}");
                assert_eq!(done_wide, done_narrow, "{op} n {n}");
                assert_eq!(wide, narrow, "{op} into, n {n}");
                for down in [false, true] {
                    let both = |wide_kernel: bool| {
                        let (mut d0, mut d1) = (vec![0u16; n], vec![0u16; n]);
                        let d = (d0.as_mut_ptr(), d1.as_mut_ptr());
                        let x = (a.as_ptr(), b.as_ptr());
                        // SAFETY: as above; the two outputs apart.
                        let done = unsafe {
                            match (code(op), wide_kernel) {
                                (SUM, false) => zip_both_bf16::<SUM>(d, x, n, down),
                                (SUM, true) => zip_both_bf16_512::<SUM>(d, x, n, down),
                                (PROD, false) => zip_both_bf16::<PROD>(d, x, n, down),
                                (PROD, true) => zip_both_bf16_512::<PROD>(d, x, n, down),
                                (MIN, false) => zip_both_bf16::<MIN>(d, x, n, down),
                                (MIN, true) => zip_both_bf16_512::<MIN>(d, x, n, down),
                                (_, false) => zip_both_bf16::<MAX>(d, x, n, down),
                                (_, true) => zip_both_bf16_512::<MAX>(d, x, n, down),
                            }
                        };
                        (done, d0, d1)
                    };
                    let (done, n0, n1) = both(false);
                    let (done_w, w0, w1) = both(true);
                    let what = format!("{op} both, down {down}, n {n}");
                    assert_eq!(done, n / 16 * 16, "{what}");
                    assert_eq!(done_w, done, "{what}");
                    assert_eq!(w0, n0, "{what}: first output");
                    assert_eq!(w1, n1, "{what}: second output");
                    // The elements done are the first (last walking down)
                    // that many, with the one-output kernel's results.
                    let lo = if down { n - done } else { 0 };
                    let mut into = vec![0u16; done];
                    // SAFETY: as above, over `done` elements from `lo`.
                    let into_done = unsafe {
                        let (a, b) = (a[lo..].as_ptr(), b[lo..].as_ptr());
                        match code(op) {
                            SUM => zip_bf16::<SUM>(into.as_mut_ptr(), a, b, done),
                            PROD => zip_bf16::<PROD>(into.as_mut_ptr(), a, b, done),
                            MIN => zip_bf16::<MIN>(into.as_mut_ptr(), a, b, done),
                            _ => zip_bf16::<MAX>(into.as_mut_ptr(), a, b, done),
                        }
                    };
                    assert_eq!(into_done, done, "{what}");
                    assert_eq!(w0[lo..lo + done], into, "{what}: against into");
                }
            }
        }
    }
}
