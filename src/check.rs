//! Deterministic inputs with closed-form results, shared by the tests and by
//! `oxccl-perf`'s `-c` check.
//!
//! Rank `r`'s element `i` is `1 + (r + i) mod 3` (for `Prod`, `1 + (r + i) mod 2`,
//! so products are powers of two). Every partial result of every reduction of
//! up to 85 ranks is then an integer exactly representable in every type
//! (bf16 holds integers up to 256 exactly), so the expected value is exact:
//! integer types wrap, as the reductions do.

use crate::types::{Element, Rank, ReduceOp};

/// Rank `rank`'s input element at global index `index`.
pub fn input_value(rank: Rank, index: usize, op: ReduceOp) -> i64 {
    let modulus = if op == ReduceOp::Prod { 2 } else { 3 };
    1 + ((rank + index) % modulus) as i64
}

/// Fills `buf` with rank `rank`'s inputs, for global indices starting at `first_index`.
pub fn fill<T: Element>(buf: &mut [T], rank: Rank, first_index: usize, op: ReduceOp) {
    for (i, v) in buf.iter_mut().enumerate() {
        *v = T::from_i64_wrapping(input_value(rank, first_index + i, op));
    }
}

/// The reduction over `world` ranks of the inputs at `index`.
pub fn reduced_value<T: Element>(world: usize, index: usize, op: ReduceOp) -> T {
    let values = (0..world).map(|r| input_value(r, index, op));
    match op {
        ReduceOp::Sum => T::from_i64_wrapping(values.sum()),
        ReduceOp::Prod => T::from_i64_wrapping(values.fold(1i64, i64::wrapping_mul)),
        ReduceOp::Min => T::from_i64_wrapping(values.min().unwrap_or(0)),
        ReduceOp::Max => T::from_i64_wrapping(values.max().unwrap_or(0)),
        ReduceOp::Avg => {
            let sum: i64 = values.sum();
            if T::DTYPE.is_float() {
                T::from_f64(sum as f64 / world as f64)
            } else {
                // The sum is positive and small, so wrapping then truncating
                // equals truncating the exact quotient.
                T::from_i64_wrapping(sum / world as i64)
            }
        }
    }
}

/// Number of elements of `got` that differ from the expected reduction, for
/// global indices starting at `first_index`.
pub fn count_wrong_reduced<T: Element>(
    got: &[T],
    world: usize,
    first_index: usize,
    op: ReduceOp,
) -> usize {
    got.iter()
        .enumerate()
        .filter(|(i, v)| **v != reduced_value::<T>(world, first_index + i, op))
        .count()
}

/// Number of elements of `got` that differ from rank `rank`'s inputs.
pub fn count_wrong_input<T: Element>(
    got: &[T],
    rank: Rank,
    first_index: usize,
    op: ReduceOp,
) -> usize {
    got.iter()
        .enumerate()
        .filter(|(i, v)| **v != T::from_i64_wrapping(input_value(rank, first_index + i, op)))
        .count()
}
