//! What the GPU tests of both device backends share: the cases, the
//! inputs, and one case run on a host and a device rank side by side.
//! Included with `#[path]` by `tests/nccl_gpu.rs` and `tests/cuda_ring_gpu.rs`.

use cudarc::driver::DeviceRepr;
use oxccl::{Communicator, DeviceCommunicator, Element, ReduceOp};

/// Inputs whose float sums and products depend on the order of the fold
/// (floats get a fraction of a third, which no binary format holds
/// exactly), so a reduction in another order than the host's shows. Sums
/// stay in range; products of 8 ranks overflow f16 (15^8 > 65504), which
/// exercises infinities and NaNs (inf · 0).
pub fn input<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| {
            let whole = ((rank * 131 + i * 17) % 23) as i64 - 7;
            if T::DTYPE.is_float() {
                T::from_f64(whole as f64 + (rank as f64 + 1.0) / 3.0)
            } else {
                T::from_i64_wrapping(whole)
            }
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
pub enum Case {
    AllReduce(ReduceOp, bool),
    ReduceScatter(ReduceOp, bool),
    AllGather(bool),
    Broadcast(usize, bool),
    Reduce(ReduceOp, usize, bool),
    AllToAll,
}

pub fn cases(world: usize) -> Vec<Case> {
    let mut out = Vec::new();
    for op in ReduceOp::ALL {
        for in_place in [false, true] {
            out.push(Case::AllReduce(op, in_place));
            out.push(Case::ReduceScatter(op, in_place));
            out.push(Case::Reduce(op, world - 1, in_place));
        }
    }
    for in_place in [false, true] {
        out.push(Case::AllGather(in_place));
        out.push(Case::Broadcast(world / 2, in_place));
    }
    out.push(Case::AllToAll);
    out
}

/// The host operator whose result is `dev`'s for `op`: the cuda-ring sums
/// and then divides an `Avg` for every type, while the host premultiplies
/// an `f16` Avg (as NCCL does; `src/types.rs`), so for those types against
/// the cuda-ring the host runs `Sum` and [`run_case`] divides once after.
fn host_op<T: Element>(dev: &DeviceCommunicator, op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg && T::AVG_PREMULTIPLIES && dev.backend_name() == "cuda-ring" {
        ReduceOp::Sum
    } else {
        op
    }
}

/// One case on a paired host and device rank; returns (host, device) bits
/// of the part of the output the collective defines.
pub fn run_case<T: Element + DeviceRepr>(
    host: &mut Communicator,
    dev: &mut DeviceCommunicator,
    case: Case,
    block: usize,
) -> (Vec<T>, Vec<T>) {
    let (rank, n) = (host.rank(), host.world_size());
    let full = block * n;
    let (send_len, recv_len) = match case {
        Case::ReduceScatter(_, false) => (full, block),
        Case::AllGather(false) => (block, full),
        Case::AllGather(true) | Case::ReduceScatter(_, true) => (full, full),
        _ => (full, full),
    };
    let send = input::<T>(rank, send_len);
    let recv0 = if matches!(
        case,
        Case::AllReduce(_, true)
            | Case::ReduceScatter(_, true)
            | Case::AllGather(true)
            | Case::Broadcast(_, true)
            | Case::Reduce(_, _, true)
    ) {
        input::<T>(rank, recv_len)
    } else {
        vec![T::zeroed(); recv_len]
    };
    let stream = dev.stream().clone();
    let d_send = stream.clone_htod(&send).unwrap();
    let mut d_recv = stream.clone_htod(&recv0).unwrap();
    let mut h = recv0.clone();
    match case {
        Case::AllReduce(op, false) => {
            host.all_reduce(&send, &mut h, host_op::<T>(dev, op))
                .unwrap();
            dev.all_reduce(&d_send, &mut d_recv, op).unwrap();
        }
        Case::AllReduce(op, true) => {
            host.all_reduce_in_place(&mut h, host_op::<T>(dev, op))
                .unwrap();
            dev.all_reduce_in_place(&mut d_recv, op).unwrap();
        }
        Case::ReduceScatter(op, false) => {
            host.reduce_scatter(&send, &mut h, host_op::<T>(dev, op))
                .unwrap();
            dev.reduce_scatter(&d_send, &mut d_recv, op).unwrap();
        }
        Case::ReduceScatter(op, true) => {
            host.reduce_scatter_in_place(&mut h, host_op::<T>(dev, op))
                .unwrap();
            dev.reduce_scatter_in_place(&mut d_recv, op).unwrap();
        }
        Case::AllGather(false) => {
            host.all_gather(&send, &mut h).unwrap();
            dev.all_gather(&d_send, &mut d_recv).unwrap();
        }
        Case::AllGather(true) => {
            host.all_gather_in_place(&mut h).unwrap();
            dev.all_gather_in_place(&mut d_recv).unwrap();
        }
        Case::Broadcast(root, false) => {
            host.broadcast(&send, &mut h, root).unwrap();
            dev.broadcast(&d_send, &mut d_recv, root).unwrap();
        }
        Case::Broadcast(root, true) => {
            host.broadcast_in_place(&mut h, root).unwrap();
            dev.broadcast_in_place(&mut d_recv, root).unwrap();
        }
        Case::Reduce(op, root, false) => {
            host.reduce(&send, &mut h, host_op::<T>(dev, op), root)
                .unwrap();
            dev.reduce(&d_send, &mut d_recv, op, root).unwrap();
        }
        Case::Reduce(op, root, true) => {
            host.reduce_in_place(&mut h, host_op::<T>(dev, op), root)
                .unwrap();
            dev.reduce_in_place(&mut d_recv, op, root).unwrap();
        }
        Case::AllToAll => {
            host.all_to_all(&send, &mut h).unwrap();
            dev.all_to_all(&d_send, &mut d_recv).unwrap();
        }
    }
    dev.synchronize().unwrap();
    // Where the host ran Sum for the device's Avg (`host_op`), the
    // device's result is that sum divided once, on the ranks that hold one.
    let reduced = match case {
        Case::AllReduce(op, _) | Case::ReduceScatter(op, _) => Some(op),
        Case::Reduce(op, root, _) if root == rank => Some(op),
        _ => None,
    };
    if reduced.is_some_and(|op| host_op::<T>(dev, op) != op) {
        T::divide_by(&mut h, n);
    }
    let mut d = stream.clone_dtoh(&d_recv).unwrap();
    match case {
        Case::ReduceScatter(_, true) => {
            h = h[rank * block..(rank + 1) * block].to_vec();
            d = d[rank * block..(rank + 1) * block].to_vec();
        }
        Case::Reduce(_, root, false) if root != rank => {
            h.clear();
            d.clear();
        }
        _ => {}
    }
    (h, d)
}

pub fn every_case<T: Element + DeviceRepr>(
    host: &mut Communicator,
    dev: &mut DeviceCommunicator,
    block: usize,
) -> Vec<String> {
    let mut bad = Vec::new();
    for case in cases(host.world_size()) {
        let (h, d) = run_case::<T>(host, dev, case, block);
        if !same_bits_or_both_nan(&h, &d) {
            bad.push(format!("{} {case:?} block {block}", T::DTYPE.name()));
        }
    }
    bad
}

/// Whether host and device results agree bit for bit, except that a NaN
/// matches any NaN: IEEE 754 leaves the sign and payload of a NaN made by an
/// invalid operation to the hardware (x86 gives a negative quiet NaN, the
/// GPU a positive one; see `src/cuda/kernels.cu`). The inputs reach such
/// NaNs: at world 8, f16 products overflow to infinity and meet a zero.
pub fn same_bits_or_both_nan<T: Element>(host: &[T], device: &[T]) -> bool {
    host.len() == device.len()
        && host.iter().zip(device).all(|(&h, &d)| {
            bytemuck::bytes_of(&h) == bytemuck::bytes_of(&d)
                || (h.to_f64().is_nan() && d.to_f64().is_nan())
        })
}
