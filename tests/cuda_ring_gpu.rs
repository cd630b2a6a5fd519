//! The cuda-ring backend on a real GPU: ranks as threads, several per GPU
//! (2, 3, 4 and 8 ranks on however many GPUs there are), every collective,
//! dtype and operator; results bit for bit equal to the host backend
//! running the same ring schedules (`Algo::Ring`) on the same inputs, and
//! all-reduce equal to all-gather ∘ reduce-scatter bit for bit.
//!
//! The same checks run with ranks as separate processes on one GPU (CUDA
//! IPC handles through the store): the test starts its own binary once per
//! rank.
//!
//! Ignored by default (`needs a CUDA device`); `scripts/device-check.sh`
//! runs them twice: as they are, and with `OXCCL_P2P_DISABLE=1` (every pair
//! host-staged), which must give the same bits.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "gpu_common/mod.rs"]
mod gpu_common;

use gpu_common::{every_case, input};
use oxccl::bootstrap::{FileStore, PrefixStore, Store};
use oxccl::{bf16, f16, Algo, Communicator, DeviceBackend, DeviceCommunicator, Error, ReduceOp};

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

/// Ranks choose in place each for themselves (as NCCL allows): odd ranks
/// in place, even ones out of place, every peer-direct collective against
/// the host with the same mix, bit for bit.
#[test]
#[ignore = "needs a CUDA device"]
fn ranks_may_mix_in_place_and_out_of_place() {
    for world in [2, 3, 4] {
        let bad = on_threads(world, |mut h, mut d| -> Vec<String> {
            let (rank, n) = (d.rank(), d.world_size());
            let mine_in_place = rank % 2 == 1;
            let block = 1001;
            let s = d.stream().clone();
            let mut bad = Vec::new();
            let mut check = |what: &str, host: Vec<f32>, dev: Vec<f32>| {
                let same = host.len() == dev.len()
                    && host
                        .iter()
                        .zip(&dev)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    bad.push(format!("rank {rank} {what}"));
                }
            };
            // All-reduce.
            let x = input::<f32>(rank, block * n);
            let mut want = vec![0f32; block * n];
            h.all_reduce(&x, &mut want, ReduceOp::Sum).unwrap();
            let got = if mine_in_place {
                let mut buf = s.clone_htod(&x).unwrap();
                d.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
                buf
            } else {
                let src = s.clone_htod(&x).unwrap();
                let mut out = s.alloc_zeros::<f32>(block * n).unwrap();
                d.all_reduce(&src, &mut out, ReduceOp::Sum).unwrap();
                out
            };
            d.synchronize().unwrap();
            check("all-reduce", want, s.clone_dtoh(&got).unwrap());
            // Reduce-scatter: the result is this rank's block.
            let mut want = vec![0f32; block];
            h.reduce_scatter(&x, &mut want, ReduceOp::Sum).unwrap();
            let got = if mine_in_place {
                let mut buf = s.clone_htod(&x).unwrap();
                d.reduce_scatter_in_place(&mut buf, ReduceOp::Sum).unwrap();
                d.synchronize().unwrap();
                s.clone_dtoh(&buf).unwrap()[rank * block..(rank + 1) * block].to_vec()
            } else {
                let src = s.clone_htod(&x).unwrap();
                let mut out = s.alloc_zeros::<f32>(block).unwrap();
                d.reduce_scatter(&src, &mut out, ReduceOp::Sum).unwrap();
                d.synchronize().unwrap();
                s.clone_dtoh(&out).unwrap()
            };
            check("reduce-scatter", want, got);
            // All-gather and broadcast (root 1).
            let part = input::<f32>(rank, block);
            let mut want = vec![0f32; block * n];
            h.all_gather(&part, &mut want).unwrap();
            let got = if mine_in_place {
                let mut whole = vec![0f32; block * n];
                whole[rank * block..(rank + 1) * block].copy_from_slice(&part);
                let mut buf = s.clone_htod(&whole).unwrap();
                d.all_gather_in_place(&mut buf).unwrap();
                buf
            } else {
                let src = s.clone_htod(&part).unwrap();
                let mut out = s.alloc_zeros::<f32>(block * n).unwrap();
                d.all_gather(&src, &mut out).unwrap();
                out
            };
            d.synchronize().unwrap();
            check("all-gather", want, s.clone_dtoh(&got).unwrap());
            let mut want = part.clone();
            h.broadcast_in_place(&mut want, 1).unwrap();
            let got = if mine_in_place {
                let mut buf = s.clone_htod(&part).unwrap();
                d.broadcast_in_place(&mut buf, 1).unwrap();
                buf
            } else {
                let src = s.clone_htod(&part).unwrap();
                let mut out = s.alloc_zeros::<f32>(block).unwrap();
                d.broadcast(&src, &mut out, 1).unwrap();
                out
            };
            d.synchronize().unwrap();
            check("broadcast", want, s.clone_dtoh(&got).unwrap());
            bad
        });
        for bad in bad {
            assert!(bad.is_empty(), "world {world}: {bad:?}");
        }
    }
}

/// Peer-direct ranks read and write each other's buffers by their own
/// counts, so calls of unequal counts must be refused, not run.
#[test]
#[ignore = "needs a CUDA device"]
fn unequal_peer_direct_calls_are_a_mismatch_not_corruption() {
    let errors = on_threads(2, |_h, mut d| {
        let len = if d.rank() == 0 { 100 } else { 1000 };
        let s = d.stream().clone();
        let mut x = s.alloc_zeros::<f32>(len).unwrap();
        d.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap_err()
    });
    for e in errors {
        assert!(
            matches!(e, Error::Mismatch { .. } | Error::Aborted { .. }),
            "{e:?}"
        );
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

/// What a rank process runs (`OXCCL_TEST_PROCESS_RANK` set by the parent
/// test); run without it, as part of `--ignored`, it does nothing.
#[test]
#[ignore = "needs a CUDA device"]
fn process_rank_entry_point() {
    let Ok(rank) = std::env::var("OXCCL_TEST_PROCESS_RANK") else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let world: usize = std::env::var("OXCCL_TEST_PROCESS_WORLD")
        .unwrap()
        .parse()
        .unwrap();
    let dir = std::env::var("OXCCL_TEST_PROCESS_STORE").unwrap();
    let scenario = std::env::var("OXCCL_TEST_PROCESS_SCENARIO").unwrap_or_default();
    let store: Arc<dyn Store> = Arc::new(FileStore::new(dir).unwrap());
    let timeout = if scenario == "lonely" { 10 } else { 120 };
    let mut dev = DeviceCommunicator::builder()
        .backend(DeviceBackend::CudaRing)
        .timeout(Duration::from_secs(timeout))
        .init(rank, world, store.clone())
        .unwrap();
    println!("rank {rank}: {}", dev.backend_description());
    if scenario == "lonely" {
        // Rank 1 leaves without calling; rank 0's call must fail, not hang.
        if rank == 0 {
            let s = dev.stream().clone();
            let mut x = s.alloc_zeros::<f32>(1 << 16).unwrap();
            let e = dev.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap_err();
            assert!(
                matches!(e, Error::DeviceTimeout { .. } | Error::PeerLost { .. }),
                "{e:?}"
            );
            println!("rank 0: {e}");
        }
        return;
    }
    let mut host = Communicator::builder()
        .algo(Algo::Ring)
        .timeout(Duration::from_secs(120))
        .init(rank, world, Arc::new(PrefixStore::new("host", store)))
        .unwrap();
    let bad = every_dtype(&mut host, &mut dev);
    assert!(bad.is_empty(), "rank {rank} of {world}: {bad:#?}");
    // Point-to-point in one group, split, barrier.
    let s = dev.stream().clone();
    let mine = s.clone_htod(&vec![rank as u32; 777]).unwrap();
    let mut got = s.alloc_zeros::<u32>(777).unwrap();
    {
        let mut g = dev.group().unwrap();
        g.send(&mine, (rank + 1) % world).unwrap();
        g.recv(&mut got, (rank + world - 1) % world).unwrap();
        g.end().unwrap();
    }
    dev.synchronize().unwrap();
    let v = s.clone_dtoh(&got).unwrap();
    assert!(v.iter().all(|&x| x as usize == (rank + world - 1) % world));
    let mut half = dev.split((rank % 2) as u32, rank as i64).unwrap();
    let mut one = half.stream().clone_htod(&[1u64; 100]).unwrap();
    half.all_reduce_in_place(&mut one, ReduceOp::Sum).unwrap();
    half.synchronize().unwrap();
    let expected = (0..world).filter(|r| r % 2 == rank % 2).count() as u64;
    assert_eq!(half.stream().clone_dtoh(&one).unwrap()[0], expected);
    dev.barrier().unwrap();
    println!("rank {rank} of {world}: every case bit-identical to the host");
}

/// Starts `world` processes of this test binary as the ranks of one job
/// (their output goes straight to this one's) and waits for them, with a
/// deadline; returns whether each succeeded.
fn run_processes(world: usize, scenario: &str) -> Vec<bool> {
    let dir = std::env::temp_dir().join(format!(
        "oxccl-cuda-ring-{}-{world}-{scenario}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args([
                    "--ignored",
                    "--exact",
                    "process_rank_entry_point",
                    "--nocapture",
                ])
                .env("OXCCL_TEST_PROCESS_RANK", rank.to_string())
                .env("OXCCL_TEST_PROCESS_WORLD", world.to_string())
                .env("OXCCL_TEST_PROCESS_STORE", &dir)
                .env("OXCCL_TEST_PROCESS_SCENARIO", scenario)
                .env("OXCCL_DEBUG", "INFO")
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(300);
    let out = children
        .into_iter()
        .map(|mut child| loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.success();
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break false;
            }
            std::thread::sleep(Duration::from_millis(50));
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn processes_on_one_gpu_match_the_host_bit_for_bit() {
    for world in [2, 3] {
        for (rank, ok) in run_processes(world, "all").into_iter().enumerate() {
            assert!(ok, "world {world}: process of rank {rank} failed");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_process_that_leaves_is_an_error_not_a_hang() {
    for (rank, ok) in run_processes(2, "lonely").into_iter().enumerate() {
        assert!(ok, "process of rank {rank} failed");
    }
}
