//! Tensor-parallel MLP layer on 4 in-process ranks: each rank holds a column
//! shard of W1 and a row shard of W2, computes its partial output and one
//! all-reduce sums the partials — the pattern inference engines run twice per
//! transformer layer. Checks the result against the unsharded computation.

use oxccl::{Communicator, ReduceOp};

const HIDDEN: usize = 8;
const FFN: usize = 16;
const TP: usize = 4;

fn w1(i: usize, j: usize) -> f32 {
    ((i * 3 + j) % 5) as f32 - 2.0
}
fn w2(j: usize, k: usize) -> f32 {
    ((j + 2 * k) % 3) as f32 - 1.0
}

fn main() -> oxccl::Result<()> {
    let x: Vec<f32> = (0..HIDDEN).map(|i| i as f32 * 0.5).collect();
    // Reference: y = relu(x W1) W2.
    let h: Vec<f32> = (0..FFN)
        .map(|j| (0..HIDDEN).map(|i| x[i] * w1(i, j)).sum::<f32>().max(0.0))
        .collect();
    let reference: Vec<f32> = (0..HIDDEN)
        .map(|k| (0..FFN).map(|j| h[j] * w2(j, k)).sum())
        .collect();

    let comms = Communicator::local_group(TP)?;
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            let x = x.clone();
            std::thread::spawn(move || -> oxccl::Result<Vec<f32>> {
                let shard = FFN / TP;
                let cols = comm.rank() * shard..(comm.rank() + 1) * shard;
                let h: Vec<f32> = cols
                    .clone()
                    .map(|j| (0..HIDDEN).map(|i| x[i] * w1(i, j)).sum::<f32>().max(0.0))
                    .collect();
                let mut y: Vec<f32> = (0..HIDDEN)
                    .map(|k| cols.clone().zip(&h).map(|(j, hj)| hj * w2(j, k)).sum())
                    .collect();
                comm.all_reduce_in_place(&mut y, ReduceOp::Sum)?;
                Ok(y)
            })
        })
        .collect();
    for h in handles {
        let y = h.join().expect("rank thread")?;
        for (a, b) in y.iter().zip(&reference) {
            assert!((a - b).abs() < 1e-4, "{y:?} vs {reference:?}");
        }
    }
    println!("tensor-parallel output matches the unsharded layer: {reference:?}");
    Ok(())
}
