//! oxccl-check: is this job's communication healthy?
//!
//! Run one per rank under a launcher (`oxccl-run`, torchrun, mpirun, srun):
//!
//! ```text
//! oxccl-run --nproc-per-node 4 -- oxccl-check
//! ```
//!
//! Every rank joins through `Communicator::from_env`, then runs every
//! collective (both variants), every dtype and op, every root, point-to-point
//! around the ring, and a split, and checks every element against its closed
//! form (`oxccl::check`). Each rank prints one line; the exit status is 0
//! only if every check passed. World size 1 exercises no communication, and
//! the output says so (the lesson of every "bare python passed" self-test).
//!
//! `--loop-seconds S` keeps all-reducing `--size` bytes afterwards, for
//! fault drills: kill a rank meanwhile and the survivors must fail within
//! the timeout, naming it. `--links` measures every link between two ranks
//! and names the slow ones (`check/links.rs`).

use std::process::ExitCode;
use std::time::{Duration, Instant};

#[path = "check/links.rs"]
mod links;

use oxccl::check::{
    broadcast_burst, edge_counts, every_collective, every_collective_every_dtype, lane_burst,
};
use oxccl::{Communicator, ReduceOp};

const USAGE: &str = "\
usage: oxccl-check [options]      (one process per rank, under a launcher)
  --quick               f32, i32 and bf16 only, fewer counts
  --shared              also check the collectives on Communicator::alloc_shared buffers
  --counts a,b,c        element counts to check (default: 0, 1, N-1, N+1, 10007)
  --chunk-bytes n|auto  pipeline piece size (default OXCCL_CHUNK_BYTES, else auto: chosen per call)
  --loop-seconds s      afterwards, all-reduce --size bytes repeatedly for s seconds,
                        checking every result
  --size bytes          message size of the loop (default 64M; suffixes K M G)
  --links               afterwards, measure every link between two ranks, one pair at a
                        time (an 8-byte round trip, --link-bytes one way each direction);
                        rank 0 prints them and warns of links below half the speed of
                        their kind's upper quartile, and of ranks all of whose links out
                        (or in) are slow where a third rank clears the other end
  --link-bytes bytes    bytes sent one way per link measurement (default 1M; implies --links)
  -h, --help            this text";

struct Args {
    quick: bool,
    /// `--shared`: also the collectives on `alloc_shared` buffers.
    shared: bool,
    counts: Option<Vec<usize>>,
    chunk_bytes: Option<usize>,
    loop_seconds: f64,
    loop_bytes: usize,
    /// `--links`: measure every link afterwards, sending this many bytes.
    link_bytes: Option<usize>,
}

/// The longest `--loop-seconds`: a year.
const MAX_LOOP_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        shared: false,
        counts: None,
        chunk_bytes: None,
        loop_seconds: 0.0,
        loop_bytes: 64 << 20,
        link_bytes: None,
    };
    let mut links = false;
    let mut link_bytes = 1 << 20;
    // `args_os`: `args` panics on an argument that is not UTF-8.
    let argv: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("argument {a:?} is not UTF-8"))
        })
        .collect::<Result<_, _>>()?;
    let mut i = 0;
    while i < argv.len() {
        let flag = argv[i].as_str();
        let mut value = || {
            i += 1;
            argv.get(i)
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag {
            "-h" | "--help" => return Err(String::new()),
            "--quick" => a.quick = true,
            "--shared" => a.shared = true,
            "--counts" => {
                let v = value()?;
                let counts: Option<Vec<usize>> =
                    v.split(',').map(|c| c.trim().parse().ok()).collect();
                a.counts = Some(counts.ok_or_else(|| format!("--counts: bad list {v:?}"))?);
            }
            "--chunk-bytes" => {
                let v = value()?;
                // `auto`: the communicator chooses per call, as by default.
                a.chunk_bytes = if v.eq_ignore_ascii_case("auto") {
                    None
                } else {
                    Some(
                        oxccl::parse_byte_size(&v)
                            .ok_or_else(|| format!("--chunk-bytes: bad size {v:?}"))?,
                    )
                };
            }
            "--loop-seconds" => {
                let v = value()?;
                // At most a year: `Instant + Duration` panics past what the
                // clock holds (1e19 s did).
                a.loop_seconds = v
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && (0.0..=MAX_LOOP_SECONDS).contains(s))
                    .ok_or_else(|| {
                        format!("--loop-seconds: {v:?} is not a number of 0 to {MAX_LOOP_SECONDS} seconds")
                    })?;
            }
            "--size" => {
                let v = value()?;
                a.loop_bytes =
                    oxccl::parse_byte_size(&v).ok_or_else(|| format!("--size: bad size {v:?}"))?;
            }
            "--links" => links = true,
            "--link-bytes" => {
                links = true;
                let v = value()?;
                link_bytes = oxccl::parse_byte_size(&v)
                    .filter(|&b| b > 0)
                    .ok_or_else(|| format!("--link-bytes: bad size {v:?} (1 byte or more)"))?;
            }
            other => return Err(format!("unknown option {other}")),
        }
        i += 1;
    }
    a.link_bytes = links.then_some(link_bytes);
    Ok(a)
}

fn run(a: &Args) -> Result<String, String> {
    let mut builder = Communicator::builder();
    if let Some(chunk) = a.chunk_bytes {
        builder = builder.chunk_bytes(chunk);
    }
    let mut comm = builder.from_env().map_err(|e| e.to_string())?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let counts = a.counts.clone().unwrap_or_else(|| {
        if a.quick {
            vec![0, 1, world + 1, 4099]
        } else {
            edge_counts(world)
        }
    });
    let checked = if a.quick {
        every_collective::<f32>(&mut comm, &counts)
            .and_then(|()| every_collective::<i32>(&mut comm, &counts))
            .and_then(|()| every_collective::<oxccl::bf16>(&mut comm, &counts))
    } else {
        every_collective_every_dtype(&mut comm, &counts)
    };
    checked
        .and_then(|()| broadcast_burst(&mut comm, 2000))
        .and_then(|()| lane_burst(&mut comm, 2000))
        .map_err(|e| e.to_string())?;
    if a.shared {
        oxccl::check::every_collective_shared::<f32>(&mut comm, &counts)
            .and_then(|()| oxccl::check::every_collective_shared::<oxccl::bf16>(&mut comm, &counts))
            // f16: its Avg reduces a scaled copy, not the allocation.
            .and_then(|()| oxccl::check::every_collective_shared::<oxccl::f16>(&mut comm, &counts))
            .map_err(|e| e.to_string())?;
    }

    // A split into two halves, used side by side with the parent.
    let color = u32::from(rank >= world.div_ceil(2));
    let mut half = comm.split(color, rank as i64).map_err(|e| e.to_string())?;
    let mut v = vec![1u64; 1000];
    half.all_reduce_in_place(&mut v, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if v.iter().any(|&x| x != half.world_size() as u64) {
        return Err(format!(
            "split: all_reduce gave {} not {}",
            v[0],
            half.world_size()
        ));
    }
    comm.barrier().map_err(|e| e.to_string())?;

    if a.loop_seconds > 0.0 {
        // Out of place, each result checked: rank r sends r + 1 (small
        // integers, so every order of summation gives the same f32).
        let floats = a.loop_bytes / 4;
        let filled = |value: f32| -> Result<Vec<f32>, String> {
            let mut v = Vec::new();
            v.try_reserve_exact(floats)
                .map_err(|e| format!("--size {}: {e}", a.loop_bytes))?;
            v.resize(floats, value);
            Ok(v)
        };
        let send = filled((rank + 1) as f32)?;
        let mut recv = filled(0.0)?;
        let expect = (world * (world + 1) / 2) as f32;
        println!("rank {rank}: pid {} looping", std::process::id());
        let until = Instant::now() + Duration::from_secs_f64(a.loop_seconds);
        let mut rounds = 0u64;
        loop {
            // Every rank stops after the same call: every 64 calls the
            // ranks agree (a max over "my time is up") whether to go on.
            if rounds.is_multiple_of(64) {
                let mut up = [u8::from(Instant::now() >= until)];
                comm.all_reduce_in_place(&mut up, ReduceOp::Max)
                    .map_err(|e| e.to_string())?;
                if up[0] == 1 {
                    break;
                }
            }
            recv.fill(0.0);
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if let Some(i) = recv.iter().position(|&x| x != expect) {
                return Err(format!(
                    "loop: all_reduce #{rounds} gave {} at {i}, not {expect}",
                    recv[i]
                ));
            }
            rounds += 1;
        }
        println!("rank {rank}: looped {rounds} all-reduces");
    }
    if let Some(bytes) = a.link_bytes {
        let all = links::measure(&mut comm, bytes)?;
        if rank == 0 {
            print!("{}", links::report(&all, bytes));
        }
    }
    // After the checks: it also tells how often the arena measured.
    let transport = comm.transport_description();
    let note = if world == 1 {
        " (world size 1: no communication was exercised)"
    } else {
        ""
    };
    Ok(format!(
        "rank {rank}/{world}: every collective correct over {transport}, counts {counts:?}{note}"
    ))
}

fn main() -> ExitCode {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("oxccl-check: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&a) {
        Ok(line) => {
            println!("oxccl-check: {line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("oxccl-check: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
