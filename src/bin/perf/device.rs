//! `oxccl-perf --backend nccl|cuda-ring`: the same table on GPU buffers
//! through [`DeviceCommunicator`] (`-t` ranks as threads of this process —
//! one GPU each for NCCL, several per GPU allowed for the cuda-ring — or,
//! for NCCL, one rank per process under a launcher). Inputs and expected
//! outputs are the host benchmark's (`prepare`), copied to the GPU; each
//! size is timed with CUDA events around `-n` back-to-back calls on the
//! communicator's stream, and reported over the ranks as `-a` asks (default:
//! their mean, as nccl-tests). The self-check runs after the timed calls.

use cudarc::driver::{sys::CUevent_flags, CudaSlice, DeviceRepr};
use oxccl::{DeviceBackend, DeviceCommunicator, Element, ReduceOp};

use super::{
    combinations, count_for, new_row, prepare, print_header, print_row, size_list, under_launcher,
    with_element_type, Args, Coll, RunResult,
};
use oxccl::{bf16, f16, DType};

/// Device copies of one size's buffers.
struct DeviceBufs<T> {
    send: CudaSlice<T>,
    recv: CudaSlice<T>,
}

fn run_once<T: Element>(
    comm: &mut DeviceCommunicator,
    a: &Args,
    b: &mut DeviceBufs<T>,
    in_place: bool,
) -> oxccl::Result<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let next = (rank + 1) % n;
    let prev = (rank + n - 1) % n;
    match (a.coll, in_place) {
        (Coll::AllReduce, false) => comm.all_reduce(&b.send, &mut b.recv, a.op),
        (Coll::AllReduce, true) => comm.all_reduce_in_place(&mut b.recv, a.op),
        (Coll::AllGather, false) => comm.all_gather(&b.send, &mut b.recv),
        (Coll::AllGather, true) => comm.all_gather_in_place(&mut b.recv),
        (Coll::ReduceScatter, false) => comm.reduce_scatter(&b.send, &mut b.recv, a.op),
        (Coll::ReduceScatter, true) => comm.reduce_scatter_in_place(&mut b.recv, a.op),
        (Coll::Broadcast, false) => comm.broadcast(&b.send, &mut b.recv, a.root),
        (Coll::Broadcast, true) => comm.broadcast_in_place(&mut b.recv, a.root),
        (Coll::Reduce, false) => comm.reduce(&b.send, &mut b.recv, a.op, a.root),
        (Coll::Reduce, true) => comm.reduce_in_place(&mut b.recv, a.op, a.root),
        (Coll::SendRecv, _) => {
            // Both directions in one group, as nccl-tests' sendrecv does
            // (out of place only: `Coll::variants`).
            let mut group = comm.group()?;
            group.send(&b.send, next)?;
            group.recv(&mut b.recv, prev)?;
            group.end()
        }
        (Coll::AllToAll, _) => comm.all_to_all(&b.send, &mut b.recv),
    }
}

fn upload<T: Element + DeviceRepr>(
    comm: &DeviceCommunicator,
    host: &[T],
) -> Result<CudaSlice<T>, String> {
    comm.stream()
        .clone_htod(host)
        .map_err(|e| format!("rank {}: copying to the GPU: {e}", comm.rank()))
}

/// One measurement: (µs per call, the ranks' as `-a` asks; wrong values on
/// every rank).
fn measure<T: Element + DeviceRepr>(
    comm: &mut DeviceCommunicator,
    a: &Args,
    count: usize,
    in_place: bool,
) -> Result<(f64, u64), String> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let err = |e: oxccl::Error| e.to_string();
    let (host, expected) = prepare::<T>(a, rank, n, count, in_place, a.check)
        .map_err(|e| format!("rank {rank}: the benchmark's buffers: {e}"))?;
    let mut b = DeviceBufs {
        send: upload(comm, &host.send)?,
        recv: upload(comm, &host.recv)?,
    };
    for _ in 0..a.warmup {
        run_once(comm, a, &mut b, in_place).map_err(err)?;
    }
    comm.barrier().map_err(err)?;
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let cuda = |e: cudarc::driver::DriverError| format!("rank {rank}: CUDA event: {e}");
    let start = comm.stream().record_event(timing).map_err(cuda)?;
    for _ in 0..a.iters {
        run_once(comm, a, &mut b, in_place).map_err(err)?;
    }
    let end = comm.stream().record_event(timing).map_err(cuda)?;
    comm.synchronize().map_err(err)?;
    let ms = start.elapsed_ms(&end).map_err(cuda)?;
    let mut time_us = f64::from(ms) * 1e3 / a.iters as f64;
    // Checked after the timed calls, on the same buffers filled afresh, as
    // nccl-tests does: the call checked takes the path the timed ones took
    // (whatever changes after a communicator's first calls), and the check
    // is not timed.
    let mut wrong = 0u64;
    if a.check {
        b = DeviceBufs {
            send: upload(comm, &host.send)?,
            recv: upload(comm, &host.recv)?,
        };
        run_once(comm, a, &mut b, in_place).map_err(err)?;
        comm.synchronize().map_err(err)?;
        let got = comm
            .stream()
            .clone_dtoh(&b.recv)
            .map_err(|e| format!("rank {rank}: copying from the GPU: {e}"))?;
        let checked = if a.coll == Coll::Reduce && !in_place && rank != a.root {
            &got[..0]
        } else {
            &got[..]
        };
        // NCCL's float Avg is a premultiplied sum (see `check::tolerance`);
        // the cuda-ring's is exact, and a tolerance costs it nothing.
        let tolerance = if a.coll.reduces() {
            oxccl::check::tolerance::<T>(a.op, n, true)
        } else {
            0.0
        };
        wrong = checked
            .iter()
            .zip(&expected)
            .filter(|(g, e)| e.is_some_and(|e| !oxccl::check::matches(**g, e, tolerance)))
            .count() as u64;
    }
    // The ranks' time as `-a` asks and every rank's wrong count, reduced
    // on the GPUs themselves (the only link device communicators have).
    let mut t = upload(comm, &[a.average.contribution(time_us, rank)])?;
    comm.all_reduce_in_place(&mut t, a.average.reduce_op())
        .map_err(err)?;
    let mut w = upload(comm, &[wrong])?;
    comm.all_reduce_in_place(&mut w, ReduceOp::Sum)
        .map_err(err)?;
    comm.synchronize().map_err(err)?;
    let copy = |e: cudarc::driver::DriverError| format!("rank {rank}: copying from the GPU: {e}");
    time_us = comm.stream().clone_dtoh(&t).map_err(copy)?[0] / a.average.divisor(n);
    wrong = comm.stream().clone_dtoh(&w).map_err(copy)?[0];
    Ok((time_us, wrong))
}

/// Sweeps the sizes for `a`'s type, reduction and root, adding the rows
/// to `result`.
fn bench<T: Element + DeviceRepr>(
    comm: &mut DeviceCommunicator,
    a: &Args,
    result: &mut RunResult,
) -> Result<(), String> {
    let n = comm.world_size();
    let elem = std::mem::size_of::<T>();
    let mut last_count = usize::MAX;
    for size in size_list(a) {
        let count = count_for(a, size, elem, n);
        // A zero-element device buffer cannot be allocated; nccl-tests skips these too.
        if count == last_count || count == 0 {
            continue;
        }
        last_count = count;
        let bytes = count * elem;
        let algo = comm.algorithm_for(super::op_kind(a.coll)).into();
        let mut row = new_row(a, bytes, count, algo);
        let variants = a.coll.variants(&a.backend);
        for (k, &in_place) in variants.iter().enumerate() {
            let (time_us, wrong) = measure::<T>(comm, a, count, in_place)?;
            let algbw = bytes as f64 / time_us / 1e3;
            let busbw = algbw * a.coll.bus_factor(n);
            (row.time_us[k], row.algbw[k], row.busbw[k], row.wrong[k]) =
                (time_us, algbw, busbw, wrong);
        }
        if comm.rank() == 0 {
            print_row(a, &row, n);
        }
        result.push(row, variants.len());
    }
    Ok(())
}

/// Every sweep `-d`, `-o` and `-r` ask for, on one communicator, as one
/// run.
fn bench_all(comm: &mut DeviceCommunicator, a: &Args) -> Result<RunResult, String> {
    let transport = comm.backend_description();
    let mut result = RunResult::new(comm.rank(), comm.world_size(), transport);
    for one in combinations(a, comm.world_size()) {
        with_element_type!(
            one.dtype,
            Err(format!("unsupported datatype {}", one.dtype)),
            |T| bench::<T>(comm, &one, &mut result)
        )?;
    }
    Ok(result)
}

/// The header, with the GPU and the backend, a plain warning at world
/// size 1, and the GPU's own copy bandwidth measured now, to read busbw
/// against.
fn header(a: &Args, comm: &DeviceCommunicator, what: &str) {
    let name = comm
        .context()
        .name()
        .unwrap_or_else(|_| "unknown GPU".into());
    print_header(
        a,
        comm.world_size(),
        what,
        &format!("{} on {name}", comm.backend_description()),
    );
    if comm.world_size() == 1 {
        println!("# world size 1: no data moves between ranks; these figures are local copies");
    }
    match copy_bandwidth(comm, a.max_bytes) {
        Ok((bytes, gbs)) => println!(
            "# device copy bandwidth: {gbs:.1} GB/s (device-to-device memcpy of {} MiB on GPU {}, \
             bytes copied per second; each byte is read once and written once)",
            bytes >> 20,
            comm.device_ordinal()
        ),
        Err(e) => println!("# device copy bandwidth: not measured ({e})"),
    }
}

/// Median of 5 timed device-to-device copies of up to `max_bytes` (at least
/// 1 MiB, at most 1 GiB) on the communicator's stream, in GB/s.
fn copy_bandwidth(comm: &DeviceCommunicator, max_bytes: usize) -> Result<(usize, f64), String> {
    let bytes = max_bytes.clamp(1 << 20, 1 << 30);
    let stream = comm.stream();
    let e = |e: cudarc::driver::DriverError| e.to_string();
    let src = stream.alloc_zeros::<u8>(bytes).map_err(e)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(e)?;
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut samples = Vec::new();
    for _ in 0..6 {
        let start = stream.record_event(timing).map_err(e)?;
        stream.memcpy_dtod(&src, &mut dst).map_err(e)?;
        let end = stream.record_event(timing).map_err(e)?;
        end.synchronize().map_err(e)?;
        samples.push(f64::from(start.elapsed_ms(&end).map_err(e)?));
    }
    samples.remove(0); // warm-up
    samples.sort_by(f64::total_cmp);
    let ms = samples[samples.len() / 2];
    Ok((bytes, bytes as f64 / (ms * 1e-3) / 1e9))
}

fn backend(a: &Args) -> DeviceBackend {
    match a.backend.as_str() {
        "cuda-ring" => DeviceBackend::CudaRing,
        "nccl" => DeviceBackend::Nccl,
        _ => DeviceBackend::Auto,
    }
}

/// The device communicators' settings: `--backend`, and `-T`'s timeout.
fn device_builder(a: &Args) -> oxccl::DeviceCommBuilder {
    let builder = DeviceCommunicator::builder().backend(backend(a));
    match a.timeout {
        Some(timeout) => builder.timeout(timeout),
        None => builder,
    }
}

/// Runs the benchmark on GPUs.
pub(crate) fn run(a: &Args) -> Result<RunResult, String> {
    if under_launcher() {
        let mut comm = device_builder(a).from_env().map_err(|e| e.to_string())?;
        if comm.rank() == 0 {
            header(a, &comm, "processes");
        }
        return bench_all(&mut comm, a).map_err(|e| format!("rank {}: {e}", comm.rank()));
    }
    let comms = device_builder(a)
        .local_group(a.ranks)
        .map_err(|e| e.to_string())?;
    header(a, &comms[0], "threads");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            let a = a.clone();
            std::thread::spawn(move || bench_all(&mut comm, &a))
        })
        .collect();
    let mut out = Err("no ranks".to_string());
    for (rank, h) in handles.into_iter().enumerate() {
        let r = h.join().map_err(|_| format!("rank {rank} panicked"))?;
        if rank == 0 || r.is_err() {
            out = r;
        }
    }
    out
}
