//! The NCCL backend on a real GPU: every collective, dtype and op, results
//! compared bit for bit with the host backend on the same inputs.
//!
//! Ignored by default (`needs a CUDA device`); `scripts/device-check.sh` runs
//! them with `--ignored`. On a machine with one GPU NCCL can only form world
//! size 1, which moves no data between GPUs: those tests check the typed API,
//! the argument mapping (counts, offsets, dtypes, ops) and the error paths,
//! not communication. With more GPUs, `every_collective_across_all_gpus`
//! runs world size = GPU count.
#![cfg(feature = "nccl")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, DeviceRepr};
use oxccl::bootstrap::MemoryStore;
use oxccl::{bf16, f16, Communicator, DeviceCommunicator, Element, Error, ReduceOp};

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

/// Small values, so products and sums stay exact in every dtype.
fn input<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_i64_wrapping(((rank * 7 + i * 3) % 5) as i64 + 1))
        .collect()
}

/// Runs `case` on the host communicator and on the device communicator of
/// the same rank with the same input; returns (host, device) outputs.
fn run_case<T: Element + DeviceRepr>(
    host: &mut Communicator,
    dev: &mut DeviceCommunicator,
    case: Case,
) -> (Vec<T>, Vec<T>) {
    let (rank, n) = (host.rank(), host.world_size());
    let block = 257;
    let full = block * n;
    let (send_len, recv_len) = match case {
        Case::AllReduce(..) | Case::Broadcast(..) | Case::Reduce(..) | Case::AllToAll => {
            (full, full)
        }
        Case::ReduceScatter(_, false) => (full, block),
        Case::ReduceScatter(_, true) => (full, full),
        Case::AllGather(false) => (block, full),
        Case::AllGather(true) => (block, full),
    };
    let send = input::<T>(rank, send_len);
    let mut recv = vec![T::zeroed(); recv_len];
    if let Case::AllGather(true) = case {
        recv[rank * block..(rank + 1) * block].copy_from_slice(&send);
    } else if recv_len == send_len {
        recv.copy_from_slice(&send);
    }
    let stream = dev.stream().clone();
    let d_send = stream.clone_htod(&send).unwrap();
    let mut d_recv = stream.clone_htod(&recv).unwrap();
    let mut h_recv = recv.clone();
    match case {
        Case::AllReduce(op, false) => {
            host.all_reduce(&send, &mut h_recv, op).unwrap();
            dev.all_reduce(&d_send, &mut d_recv, op).unwrap();
        }
        Case::AllReduce(op, true) => {
            host.all_reduce_in_place(&mut h_recv, op).unwrap();
            dev.all_reduce_in_place(&mut d_recv, op).unwrap();
        }
        Case::ReduceScatter(op, false) => {
            host.reduce_scatter(&send, &mut h_recv, op).unwrap();
            dev.reduce_scatter(&d_send, &mut d_recv, op).unwrap();
        }
        Case::ReduceScatter(op, true) => {
            host.reduce_scatter_in_place(&mut h_recv, op).unwrap();
            dev.reduce_scatter_in_place(&mut d_recv, op).unwrap();
        }
        Case::AllGather(false) => {
            host.all_gather(&send, &mut h_recv).unwrap();
            dev.all_gather(&d_send, &mut d_recv).unwrap();
        }
        Case::AllGather(true) => {
            host.all_gather_in_place(&mut h_recv).unwrap();
            dev.all_gather_in_place(&mut d_recv).unwrap();
        }
        Case::Broadcast(root, false) => {
            host.broadcast(&send, &mut h_recv, root).unwrap();
            dev.broadcast(&d_send, &mut d_recv, root).unwrap();
        }
        Case::Broadcast(root, true) => {
            host.broadcast_in_place(&mut h_recv, root).unwrap();
            dev.broadcast_in_place(&mut d_recv, root).unwrap();
        }
        Case::Reduce(op, root, false) => {
            host.reduce(&send, &mut h_recv, op, root).unwrap();
            dev.reduce(&d_send, &mut d_recv, op, root).unwrap();
        }
        Case::Reduce(op, root, true) => {
            host.reduce_in_place(&mut h_recv, op, root).unwrap();
            dev.reduce_in_place(&mut d_recv, op, root).unwrap();
        }
        Case::AllToAll => {
            host.all_to_all(&send, &mut h_recv).unwrap();
            dev.all_to_all(&d_send, &mut d_recv).unwrap();
        }
    }
    dev.synchronize().unwrap();
    let mut d_out = stream.clone_dtoh(&d_recv).unwrap();
    // Parts the collective leaves unspecified are not compared: in-place
    // reduce-scatter's other blocks, reduce's output off the root.
    match case {
        Case::ReduceScatter(_, true) => {
            h_recv = h_recv[rank * block..(rank + 1) * block].to_vec();
            d_out = d_out[rank * block..(rank + 1) * block].to_vec();
        }
        Case::Reduce(_, root, false) if root != rank => {
            h_recv.clear();
            d_out.clear();
        }
        _ => {}
    }
    (h_recv, d_out)
}

/// Every case for one dtype on paired host/device communicators; returns
/// the cases whose bits differ.
fn every_case<T: Element + DeviceRepr>(
    host: &mut Communicator,
    dev: &mut DeviceCommunicator,
) -> Vec<String> {
    let mut bad = Vec::new();
    for case in cases(host.world_size()) {
        let (h, d) = run_case::<T>(host, dev, case);
        let hb: &[u8] = bytemuck::cast_slice(&h);
        let db: &[u8] = bytemuck::cast_slice(&d);
        if hb != db {
            bad.push(format!("{} {case:?}", T::DTYPE.name()));
        }
    }
    bad
}

fn every_dtype(host: &mut Communicator, dev: &mut DeviceCommunicator) -> Vec<String> {
    let mut bad = Vec::new();
    bad.extend(every_case::<i8>(host, dev));
    bad.extend(every_case::<u8>(host, dev));
    bad.extend(every_case::<i32>(host, dev));
    bad.extend(every_case::<u32>(host, dev));
    bad.extend(every_case::<i64>(host, dev));
    bad.extend(every_case::<u64>(host, dev));
    bad.extend(every_case::<f16>(host, dev));
    bad.extend(every_case::<f32>(host, dev));
    bad.extend(every_case::<f64>(host, dev));
    bad.extend(every_case::<bf16>(host, dev));
    bad
}

fn gpu_count() -> usize {
    // SAFETY: only tries to dlopen the driver; cudarc panics without it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().unwrap_or(0).max(0) as usize
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_collective_dtype_and_op_at_world_size_one_matches_the_host() {
    println!("world size 1: NCCL moves no data between GPUs here; this checks the API, not communication");
    let mut dev = DeviceCommunicator::local_group(1).unwrap().remove(0);
    let mut host = Communicator::local_group(1).unwrap().remove(0);
    let bad = every_dtype(&mut host, &mut dev);
    assert!(bad.is_empty(), "device differs from host: {bad:#?}");
    dev.barrier().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_collective_across_all_gpus() {
    let n = gpu_count();
    if n < 2 {
        println!("skipped: {n} GPU(s); world size = GPU count needs at least 2");
        return;
    }
    let devs = DeviceCommunicator::local_group(n).unwrap();
    let hosts = Communicator::local_group(n).unwrap();
    let handles: Vec<_> = devs
        .into_iter()
        .zip(hosts)
        .map(|(mut dev, mut host)| std::thread::spawn(move || every_dtype(&mut host, &mut dev)))
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let bad = h.join().unwrap();
        assert!(
            bad.is_empty(),
            "rank {rank}: device differs from host: {bad:#?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn init_from_a_store_split_and_bad_arguments() {
    let store = Arc::new(MemoryStore::new());
    let mut dev = DeviceCommunicator::init(0, 1, store).unwrap();
    assert_eq!((dev.rank(), dev.world_size()), (0, 1));
    // A bad length is rejected before NCCL, and the communicator stays usable.
    let stream = dev.stream().clone();
    let a = stream.alloc_zeros::<f32>(8).unwrap();
    let mut b = stream.alloc_zeros::<f32>(7).unwrap();
    let e = dev.all_reduce(&a, &mut b, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let e = dev.broadcast_in_place(&mut b, 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let mut c = stream.alloc_zeros::<f32>(8).unwrap();
    dev.all_reduce(&a, &mut c, ReduceOp::Sum).unwrap();
    dev.synchronize().unwrap();
    // Split (NCCL >= 2.18): one color, then no color.
    let child = dev.split(0, 0).unwrap();
    assert_eq!((child.rank(), child.world_size()), (0, 1));
    assert!(dev.split_or_none(None, 0).unwrap().is_none());
    // An empty point-to-point group opens and closes.
    dev.group().unwrap().end().unwrap();
    dev.barrier().unwrap();
    // A rejected call inside a group (self-send) poisons it: dropping the
    // group closes NCCL's group and leaves the communicator failed.
    {
        let mut group = dev.group().unwrap();
        let e = group.send(&a, 0).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    }
    let e = dev.barrier().unwrap_err();
    assert!(matches!(e, Error::Failed { .. }), "{e:?}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_rank_that_never_arrives_is_a_timeout_not_a_hang() {
    // Rank 0 of 2 alone: NCCL's bootstrap waits for rank 1 forever; ours
    // gives up at the deadline, aborts, and names what it waited for.
    let start = Instant::now();
    let e = DeviceCommunicator::builder()
        .timeout(Duration::from_secs(5))
        .init(0, 2, Arc::new(MemoryStore::new()))
        .unwrap_err();
    let waited = start.elapsed();
    assert!(matches!(e, Error::DeviceTimeout { .. }), "{e:?}");
    assert!(
        e.to_string().contains("waiting for every rank to join"),
        "{e}"
    );
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    println!("init of rank 0 of 2 without rank 1: {e} (after {waited:?})");
}
