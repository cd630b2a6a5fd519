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

#[path = "gpu_common/mod.rs"]
mod gpu_common;

use cudarc::driver::CudaContext;
use gpu_common::every_case;
use oxccl::bootstrap::MemoryStore;
use oxccl::{bf16, f16, Communicator, DeviceBackend, DeviceCommunicator, Error, ReduceOp};

fn every_dtype(host: &mut Communicator, dev: &mut DeviceCommunicator) -> Vec<String> {
    let mut bad = Vec::new();
    bad.extend(every_case::<i8>(host, dev, 257));
    bad.extend(every_case::<u8>(host, dev, 257));
    bad.extend(every_case::<i32>(host, dev, 257));
    bad.extend(every_case::<u32>(host, dev, 257));
    bad.extend(every_case::<i64>(host, dev, 257));
    bad.extend(every_case::<u64>(host, dev, 257));
    bad.extend(every_case::<f16>(host, dev, 257));
    bad.extend(every_case::<f32>(host, dev, 257));
    bad.extend(every_case::<f64>(host, dev, 257));
    bad.extend(every_case::<bf16>(host, dev, 257));
    bad
}

/// NCCL explicitly: `auto` would fall back to the cuda-ring when NCCL does
/// not load, and these tests are about NCCL.
fn nccl_group(n: usize) -> Vec<DeviceCommunicator> {
    DeviceCommunicator::builder()
        .backend(DeviceBackend::Nccl)
        .local_group(n)
        .unwrap()
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
    let mut dev = nccl_group(1).remove(0);
    assert_eq!(dev.backend_name(), "nccl");
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
    let devs = nccl_group(n);
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
    let mut dev = DeviceCommunicator::builder()
        .backend(DeviceBackend::Nccl)
        .init(0, 1, store)
        .unwrap();
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
