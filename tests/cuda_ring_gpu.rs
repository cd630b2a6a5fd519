//! The cuda-ring backend on a real GPU: ranks as threads, several per GPU
//! (2, 3, 4 and 8 ranks on however many GPUs there are), every collective,
//! dtype and operator; results bit for bit equal to the host backend
//! running the same ring schedules (`Algo::Ring`) on the same inputs, and
//! all-reduce equal to all-gather ∘ reduce-scatter bit for bit.
//!
//! Ignored by default (`needs a CUDA device`); `scripts/device-check.sh`
//! runs them twice: as they are, and with `OXCCL_P2P_DISABLE=1` (every pair
//! host-staged), which must give the same bits.
#![cfg(feature = "cuda")]

use std::time::Duration;

use cudarc::driver::DeviceRepr;
use oxccl::{
    bf16, f16, Algo, Communicator, DeviceBackend, DeviceCommunicator, Element, Error, ReduceOp,
};

const WORLDS: [usize; 4] = [2, 3, 4, 8];

fn ring_group(n: usize) -> Vec<DeviceCommunicator> {
    DeviceCommunicator::builder()
        .backend(DeviceBackend::CudaRing)
        .timeout(Duration::from_secs(60))
        .local_group(n)
        .unwrap()
}

fn host_group(n: usize) -> Vec<Communicator> {
    Communicator::builder()
        .algo(Algo::Ring)
        .timeout(Duration::from_secs(60))
        .local_group(n)
        .unwrap()
}

/// Inputs whose sums and products stay in range and whose float sums
/// depend on the order of addition (so a different order shows).
fn input<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_i64_wrapping(((rank * 131 + i * 17) % 23) as i64 - 7))
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Case {
    AllReduce(ReduceOp, bool),
    ReduceScatter(ReduceOp, bool),
    AllGather(bool),
    Broadcast(usize, bool),
    Reduce(ReduceOp, usize, bool),
    AllToAll,
}

fn cases(world: usize) -> Vec<Case> {
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

/// One case on a paired host and device rank; returns (host, device) bits
/// of the part of the output the collective defines.
fn run_case<T: Element + DeviceRepr>(
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
            host.all_reduce(&send, &mut h, op).unwrap();
            dev.all_reduce(&d_send, &mut d_recv, op).unwrap();
        }
        Case::AllReduce(op, true) => {
            host.all_reduce_in_place(&mut h, op).unwrap();
            dev.all_reduce_in_place(&mut d_recv, op).unwrap();
        }
        Case::ReduceScatter(op, false) => {
            host.reduce_scatter(&send, &mut h, op).unwrap();
            dev.reduce_scatter(&d_send, &mut d_recv, op).unwrap();
        }
        Case::ReduceScatter(op, true) => {
            host.reduce_scatter_in_place(&mut h, op).unwrap();
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
            host.reduce(&send, &mut h, op, root).unwrap();
            dev.reduce(&d_send, &mut d_recv, op, root).unwrap();
        }
        Case::Reduce(op, root, true) => {
            host.reduce_in_place(&mut h, op, root).unwrap();
            dev.reduce_in_place(&mut d_recv, op, root).unwrap();
        }
        Case::AllToAll => {
            host.all_to_all(&send, &mut h).unwrap();
            dev.all_to_all(&d_send, &mut d_recv).unwrap();
        }
    }
    dev.synchronize().unwrap();
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

fn every_case<T: Element + DeviceRepr>(
    host: &mut Communicator,
    dev: &mut DeviceCommunicator,
    block: usize,
) -> Vec<String> {
    let mut bad = Vec::new();
    for case in cases(host.world_size()) {
        let (h, d) = run_case::<T>(host, dev, case, block);
        let hb: &[u8] = bytemuck::cast_slice(&h);
        let db: &[u8] = bytemuck::cast_slice(&d);
        if hb != db {
            bad.push(format!("{} {case:?} block {block}", T::DTYPE.name()));
        }
    }
    bad
}

fn every_dtype(host: &mut Communicator, dev: &mut DeviceCommunicator) -> Vec<String> {
    let mut bad = Vec::new();
    // A block that is not a multiple of 16 bytes (the kernels' scalar
    // tails) and one large enough for several pipeline pieces.
    for block in [1001, 1 << 20] {
        bad.extend(every_case::<f32>(host, dev, block));
        bad.extend(every_case::<bf16>(host, dev, block));
    }
    let block = 1001;
    bad.extend(every_case::<i8>(host, dev, block));
    bad.extend(every_case::<u8>(host, dev, block));
    bad.extend(every_case::<i32>(host, dev, block));
    bad.extend(every_case::<u32>(host, dev, block));
    bad.extend(every_case::<i64>(host, dev, block));
    bad.extend(every_case::<u64>(host, dev, block));
    bad.extend(every_case::<f16>(host, dev, block));
    bad.extend(every_case::<f64>(host, dev, block));
    bad
}

fn on_threads<R: Send + 'static>(
    n: usize,
    body: impl Fn(Communicator, DeviceCommunicator) -> R + Send + Sync + Copy + 'static,
) -> Vec<R> {
    let handles: Vec<_> = host_group(n)
        .into_iter()
        .zip(ring_group(n))
        .map(|(h, d)| std::thread::spawn(move || body(h, d)))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_collective_dtype_and_op_matches_the_host_bit_for_bit() {
    for world in WORLDS {
        let bad = on_threads(world, |mut h, mut d| every_dtype(&mut h, &mut d));
        for (rank, bad) in bad.into_iter().enumerate() {
            assert!(bad.is_empty(), "world {world} rank {rank}: {bad:#?}");
        }
        println!("world {world}: every case bit-identical to the host");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn all_reduce_is_all_gather_of_reduce_scatter_bit_for_bit() {
    for world in WORLDS {
        let ok = on_threads(world, |_h, mut d| {
            let block = 4099;
            let n = d.world_size();
            let x = input::<f32>(d.rank(), block * n);
            let s = d.stream().clone();
            let src = s.clone_htod(&x).unwrap();
            let mut ar = s.alloc_zeros::<f32>(block * n).unwrap();
            d.all_reduce(&src, &mut ar, ReduceOp::Sum).unwrap();
            let mut part = s.alloc_zeros::<f32>(block).unwrap();
            d.reduce_scatter(&src, &mut part, ReduceOp::Sum).unwrap();
            let mut ag = s.alloc_zeros::<f32>(block * n).unwrap();
            d.all_gather(&part, &mut ag).unwrap();
            d.synchronize().unwrap();
            let (a, b) = (s.clone_dtoh(&ar).unwrap(), s.clone_dtoh(&ag).unwrap());
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits())
        });
        assert!(ok.iter().all(|&o| o), "world {world}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn point_to_point_groups_split_barrier_and_errors() {
    let results = on_threads(4, |_h, mut d| -> Result<(), String> {
        let (rank, n) = (d.rank(), d.world_size());
        let s = d.stream().clone();
        // A ring exchange in one group (both directions at once).
        let mine = s.clone_htod(&vec![rank as u32; 777]).unwrap();
        let mut got = s.alloc_zeros::<u32>(777).unwrap();
        {
            let mut g = d.group().map_err(|e| e.to_string())?;
            g.send(&mine, (rank + 1) % n).map_err(|e| e.to_string())?;
            g.recv(&mut got, (rank + n - 1) % n)
                .map_err(|e| e.to_string())?;
            g.end().map_err(|e| e.to_string())?;
        }
        d.synchronize().map_err(|e| e.to_string())?;
        let v = s.clone_dtoh(&got).unwrap();
        if v.iter().any(|&x| x as usize != (rank + n - 1) % n) {
            return Err(format!("rank {rank}: group exchange gave {}", v[0]));
        }
        // Split into halves; all-reduce in each.
        let mut half = d
            .split(u32::from(rank >= 2), rank as i64)
            .map_err(|e| e.to_string())?;
        let mut one = s.clone_htod(&[1u64; 100]).unwrap();
        half.all_reduce_in_place(&mut one, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        half.synchronize().map_err(|e| e.to_string())?;
        let v = half.stream().clone_dtoh(&one).unwrap();
        if v[0] != 2 {
            return Err(format!("rank {rank}: split all-reduce gave {}", v[0]));
        }
        d.barrier().map_err(|e| e.to_string())?;
        // A bad length is rejected before anything is enqueued.
        let mut short = s.alloc_zeros::<u32>(3).unwrap();
        match d.all_reduce(&mine, &mut short, ReduceOp::Sum) {
            Err(Error::InvalidArgument { .. }) => {}
            other => return Err(format!("bad length accepted: {other:?}")),
        }
        d.barrier().map_err(|e| e.to_string())
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_rank_that_never_calls_is_a_timeout_not_a_hang() {
    let mut comms = DeviceCommunicator::builder()
        .backend(DeviceBackend::CudaRing)
        .timeout(Duration::from_secs(3))
        .local_group(2)
        .unwrap();
    let mut lonely = comms.remove(0);
    let s = lonely.stream().clone();
    let mut x = s.alloc_zeros::<f32>(1 << 16).unwrap();
    let e = lonely
        .all_reduce_in_place(&mut x, ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(e, Error::DeviceTimeout { .. }), "{e:?}");
    assert!(e.to_string().contains("from rank 1"), "{e}");
    drop(comms);
}
