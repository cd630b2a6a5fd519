//! Real processes: every collective across ranks launched by `oxccl-run`
//! over shared memory and TCP (world sizes 2, 3, 4), and the fault drills —
//! a rank killed mid-collective, a rank that never starts, a stranger with
//! the wrong token, a taken port, and bad launcher variables.
//!
//! Every child process runs under a wall-clock deadline: a hang fails the
//! test instead of stalling CI.

mod common;
use common::free_port;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_oxccl-run");
const CHECK: &str = env!("CARGO_BIN_EXE_oxccl-check");

/// Launcher and rank variables a test must not inherit from its own
/// environment (CI could itself run under a launcher).
const LAUNCH_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "NODE_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
    "SLURM_NNODES",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OXCCL_JOB_ID",
    "OXCCL_STORE",
    "OXCCL_TRANSPORT",
    "OXCCL_SOCKET_IFNAME",
    "OXCCL_TIMEOUT",
    "OXCCL_SHM_STORES",
];

fn clean(cmd: &mut Command) -> &mut Command {
    for var in LAUNCH_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// Held by the tests whose ranks spin for many seconds (the kill drills)
/// and by the one that times the cores' round trip: a third busy process
/// on a 2-CPU machine would stretch that test's rounds to scheduler ticks.
static BUSY_CPUS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn busy_cpus() -> std::sync::MutexGuard<'static, ()> {
    BUSY_CPUS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A running child whose output lines arrive on a channel.
struct Running {
    child: Child,
    lines: mpsc::Receiver<(bool, String)>,
    stdout: String,
    stderr: String,
}

impl Running {
    fn spawn(cmd: &mut Command) -> Running {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().expect("stdout");
        let err = child.stderr.take().expect("stderr");
        for (is_err, stream) in [
            (false, Box::new(out) as Box<dyn Read + Send>),
            (true, Box::new(err)),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send((is_err, line));
                }
            });
        }
        Running {
            child,
            lines,
            stdout: String::new(),
            stderr: String::new(),
        }
    }

    fn take_lines(&mut self, wait: Duration) -> bool {
        match self.lines.recv_timeout(wait) {
            Ok((is_err, line)) => {
                let text = if is_err {
                    &mut self.stderr
                } else {
                    &mut self.stdout
                };
                text.push_str(&line);
                text.push('\n');
                true
            }
            Err(_) => false,
        }
    }

    /// Waits until stdout contains `needle`, or panics at the deadline.
    fn wait_for(&mut self, needle: &str, deadline: Instant) {
        while !self.stdout.contains(needle) {
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!(
                    "no {needle:?} in time\nstdout:\n{}\nstderr:\n{}",
                    self.stdout, self.stderr
                );
            }
            self.take_lines(Duration::from_millis(20));
        }
    }

    /// Waits for exit (killing the child at the deadline, which fails the
    /// test) and returns the exit code with all output.
    fn finish(mut self, deadline: Instant) -> (Option<i32>, String, String) {
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Drain what the reader threads still hold.
                while self.take_lines(Duration::from_millis(200)) {}
                return (status.code(), self.stdout, self.stderr);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                while self.take_lines(Duration::from_millis(100)) {}
                panic!(
                    "still running at the deadline\nstdout:\n{}\nstderr:\n{}",
                    self.stdout, self.stderr
                );
            }
            self.take_lines(Duration::from_millis(10));
        }
    }
}

/// One rank of a `world`-rank job, started directly (no launcher).
fn rank_cmd(rank: usize, world: usize, port: u16, transport: &str) -> Command {
    let mut cmd = Command::new(CHECK);
    rank_env(&mut cmd, rank, world, port, transport);
    cmd
}

/// Gives `cmd` the environment of rank `rank` of a `world`-rank job on
/// `port` (and nothing inherited from a launcher around the tests).
fn rank_env<'a>(
    cmd: &'a mut Command,
    rank: usize,
    world: usize,
    port: u16,
    transport: &str,
) -> &'a mut Command {
    clean(cmd)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OXCCL_TRANSPORT", transport)
        .env("OXCCL_TIMEOUT", "30s")
        .env("OXCCL_JOB_ID", job_id(port))
}

/// The job id tests give the ranks of the job on `port`, which names its
/// shared-memory segments (`/dev/shm/oxccl-<job>-...`).
fn job_id(port: u16) -> String {
    format!("test{}p{port}", std::process::id())
}

/// This job's segments still in `/dev/shm`.
fn leftover_segments(port: u16) -> Vec<String> {
    let prefix = format!("oxccl-{}-", job_id(port));
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

fn launched(world: usize, transport: &str) {
    launched_with(world, transport, &[]);
}

fn launched_with(world: usize, transport: &str, extra: &[&str]) -> String {
    launched_with_env(world, transport, extra, &[])
}

/// Runs `oxccl-check` in `world` processes and returns its output.
fn launched_with_env(
    world: usize,
    transport: &str,
    extra: &[&str],
    vars: &[(&str, &str)],
) -> String {
    let mut cmd = Command::new(RUN);
    clean(&mut cmd)
        .args(["--nproc-per-node", &world.to_string()])
        .args(["--master-port", &free_port().to_string()])
        .args(["--", CHECK, "--quick"])
        .args(extra)
        .env("OXCCL_TRANSPORT", transport)
        .env("OXCCL_TIMEOUT", "30s")
        .envs(vars.iter().copied());
    let deadline = Instant::now() + Duration::from_secs(120);
    let (code, out, err) = Running::spawn(&mut cmd).finish(deadline);
    assert_eq!(
        code,
        Some(0),
        "world {world} over {transport}\n{out}\n{err}"
    );
    for rank in 0..world {
        let line = format!(
            "[rank {rank}] oxccl-check: rank {rank}/{world}: every collective correct over {transport}"
        );
        assert!(out.contains(&line), "missing {line:?}\n{out}\n{err}");
    }
    out
}

#[test]
fn every_collective_across_processes_over_shared_memory() {
    for world in [2, 3, 4] {
        launched(world, "shm");
    }
}

/// Outputs of 16 MiB and more are written with non-temporal stores: the
/// staged two-shot all-reduce, reduce-scatter, reduce, and the copies of
/// all-gather and broadcast, with part boundaries off the 16-byte grid.
#[test]
fn large_outputs_across_processes_are_correct() {
    for world in [2, 3] {
        launched_with(world, "shm", &["--counts", "4194311"]);
    }
}

/// Each slot-store mode, forced on every rank (the set-up picks one by
/// measuring, so a run would otherwise test only what this machine's
/// placement chose): streaming covers the non-temporal staging of the
/// one-shot (4 KiB and more) and two-shot all-reduce (over 512 KiB),
/// reduce-scatter, and all-gather and broadcast, which then always stage;
/// cached runs their CMA paths (with no more ranks than CPUs: the two
/// cached runs use 2; more ranks stage), and (4194311 elements, outputs
/// from 16 MiB) the cached staging that replaces CMA there on AMD CPUs.
#[test]
fn both_slot_store_modes_across_processes_are_correct() {
    const COUNTS: &str = "1,1029,20011,70001,300007";
    for (mode, world, counts) in [
        ("streaming", 2, COUNTS),
        ("streaming", 3, COUNTS),
        ("cached", 2, COUNTS),
        ("cached", 2, "4194311"),
    ] {
        let out = launched_with_env(
            world,
            "shm",
            &["--counts", counts],
            &[("OXCCL_SHM_STORES", mode)],
        );
        let told = format!("arena: {mode} slot stores");
        assert!(
            out.contains(&told),
            "{mode}, world {world}: expected {told:?} in\n{out}"
        );
    }
}

/// `auto:SECONDS` measures the slot stores again while calls run: every
/// rank joins each measurement at the same call, and every all-reduce of
/// the checked loop around them stays correct.
#[test]
fn slot_stores_are_measured_again_between_calls() {
    let out = launched_with_env(
        2,
        "shm",
        // 16 KiB: above the lanes, so every call runs a slot round (the
        // checks count rounds).
        &["--counts", "1,1029", "--loop-seconds", "2", "--size", "16K"],
        &[("OXCCL_SHM_STORES", "auto:0.001")],
    );
    let times = |rank: usize| -> u32 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("[rank {rank}] oxccl-check: rank {rank}/2: every")))
            .unwrap_or_else(|| panic!("no result line for rank {rank}\n{out}"));
        let after = line
            .split("slot stores (measured ")
            .nth(1)
            .unwrap_or_else(|| panic!("no measurement count in {line:?}"));
        after
            .split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("bad measurement count in {line:?}"))
    };
    let (zero, one) = (times(0), times(1));
    assert_eq!(
        zero, one,
        "ranks measured a different number of times\n{out}"
    );
    assert!(zero >= 2, "measured only {zero} time(s)\n{out}");
}

/// Lets process `pid` run on `cpu` only.
fn pin(pid: u32, cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; `pid` is a child of
    // this test.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(
            pid as libc::pid_t,
            std::mem::size_of::<libc::cpu_set_t>(),
            &set,
        )
    };
    assert_eq!(
        rc,
        0,
        "pinning {pid} to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
}

/// With `auto` (a 30 s interval) the slot stores are measured again as
/// soon as the ranks' cores move, which the round trip timed at each check
/// shows: two ranks pinned to two CPUs, then one moved onto the other's
/// mid-loop. Both join the measurement, and the checked loop stays right.
#[test]
fn slot_stores_are_measured_again_when_the_cores_move() {
    let cpus = oxccl::launch::allowed_cpus();
    if cpus.len() < 2 {
        eprintln!("skipped: needs 2 CPUs, this process may use {cpus:?}");
        return;
    }
    let _cpus = busy_cpus();
    let port = free_port();
    let mut ranks: Vec<Running> = (0..2)
        .map(|r| {
            let mut cmd = rank_cmd(r, 2, port, "shm");
            cmd.env("OXCCL_SHM_STORES", "auto").args([
                "--counts",
                "1,1029",
                "--loop-seconds",
                "6",
                // Above the lanes: every call runs a slot round.
                "--size",
                "16K",
            ]);
            let rank = Running::spawn(&mut cmd);
            pin(rank.child.id(), cpus[r]);
            rank
        })
        .collect();
    // Set up (the baseline is timed there) and looping, then past
    // ROUND_TRIP_MIN_SPACING (200 ms) before the move; the loop then has
    // about 4.5 s left for two checks in a row (every 4096 rounds).
    let deadline = Instant::now() + Duration::from_secs(30);
    for rank in &mut ranks {
        rank.wait_for("looping", deadline);
    }
    std::thread::sleep(Duration::from_millis(1500));
    pin(ranks[1].child.id(), cpus[0]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut counts = Vec::new();
    for (r, rank) in ranks.into_iter().enumerate() {
        let (code, out, err) = rank.finish(deadline);
        assert_eq!(code, Some(0), "rank {r}\n{out}\n{err}");
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("oxccl-check: rank {r}/2: every")))
            .unwrap_or_else(|| panic!("no result line for rank {r}\n{out}\n{err}"));
        let count = |after: &str| -> u32 {
            line.split(after)
                .nth(1)
                .and_then(|rest| rest.split(' ').next()?.parse().ok())
                .unwrap_or(0)
        };
        counts.push((count("slot stores (measured "), count("times, ")));
        assert!(
            line.contains("after the round trip changed"),
            "rank {r} never measured again after the move:\n{line}"
        );
    }
    assert_eq!(
        counts[0], counts[1],
        "ranks measured differently: {counts:?}"
    );
}

/// The lowest rank that forces a mode decides for all, whatever the
/// others were told (another mode, or to measure), so that every rank
/// stages the same way and no rank measures alone.
#[test]
fn slot_store_modes_agree_when_ranks_disagree() {
    // (rank 0's setting, rank 1's, the mode every rank must run)
    let cases = [
        ("streaming", "cached", "streaming"),
        ("auto", "streaming", "streaming"),
        ("cached", "auto", "cached"),
    ];
    for (zero, one, expect) in cases {
        let mut cmd = Command::new(RUN);
        clean(&mut cmd)
            .args(["--nproc-per-node", "2"])
            .args(["--master-port", &free_port().to_string()])
            .args([
                "--",
                "sh",
                "-c",
                &format!(
                    "if [ \"$RANK\" = 0 ]; then export OXCCL_SHM_STORES={zero}; \
                     else export OXCCL_SHM_STORES={one}; fi; \
                     exec {CHECK} --quick --counts 1,300007"
                ),
            ])
            .env("OXCCL_TRANSPORT", "shm")
            .env("OXCCL_TIMEOUT", "30s");
        let deadline = Instant::now() + Duration::from_secs(120);
        let (code, out, err) = Running::spawn(&mut cmd).finish(deadline);
        assert_eq!(code, Some(0), "{zero}/{one}\n{out}\n{err}");
        for rank in 0..2 {
            let line = format!(
                "[rank {rank}] oxccl-check: rank {rank}/2: every collective correct over shm; \
                 arena: {expect} slot stores,"
            );
            assert!(
                out.contains(&line),
                "{zero}/{one}: missing {line:?}\n{out}\n{err}"
            );
        }
    }
}

/// Buffers from `alloc_shared`: every rank maps every peer's, and the
/// collectives run zero-copy across processes (`oxccl-check --shared`
/// fails when a large call did not); over TCP they are ordinary memory.
/// 300 f32: an all-gather whose whole output passes 2 KiB while each
/// part stays in the lanes.
#[test]
fn collectives_on_alloc_shared_buffers_across_processes() {
    for world in [2, 3] {
        launched_with(world, "shm", &["--shared", "--counts", "0,1,5,300,4099"]);
    }
    launched_with(2, "tcp", &["--shared", "--counts", "1,4099"]);
}

/// With more processes than CPUs, broadcasts on `alloc_shared` buffers
/// stage below 32 KiB instead of running zero copy (each of whose two
/// synchronisations needs every rank running), and run zero copy from
/// there; the other collectives run zero copy from 2 KiB as before. The
/// ranks inherit this test thread's mask of one CPU, so two of them are
/// crowded on any host; `oxccl-check --shared` fails a call that ran zero
/// copy on the wrong side of its bound.
#[test]
fn crowded_processes_stage_small_broadcasts_on_alloc_shared_buffers() {
    // f32: 16 KiB (staged), 32 KiB + 16 B (zero copy).
    let out =
        common::on_one_cpu(|| launched_with(2, "shm", &["--shared", "--counts", "1,4099,8196"]));
    // The ranks knew they were crowded (the transport line says so), so
    // the check held them to the crowded bound.
    assert!(out.contains("waits yield at once"), "not crowded:\n{out}");
}

#[test]
fn every_collective_across_processes_over_tcp() {
    for world in [2, 3, 4] {
        launched(world, "tcp");
    }
}

/// Counts the TCP links run as rings pipelined in 256 KiB pieces, several
/// per chunk (150 001 f32 per rank): the in-place all-gather and
/// reduce-scatter send straight from the caller's buffer while receives
/// land in other parts of it.
#[test]
fn ring_collectives_across_processes_over_tcp() {
    for world in [2, 3] {
        launched_with(world, "tcp", &["--counts", "1,150001"]);
    }
}

/// SIGKILL one rank while all three all-reduce 16 MiB in a loop: both
/// survivors must fail fast (well inside the 30 s timeout) naming rank 1.
#[test]
fn a_rank_killed_mid_collective_is_named_by_every_survivor() {
    let _cpus = busy_cpus();
    for transport in ["shm", "tcp"] {
        let port = free_port();
        let mut ranks: Vec<Running> = (0..3)
            .map(|r| {
                let mut cmd = rank_cmd(r, 3, port, transport);
                cmd.args(["--quick", "--counts", "1", "--loop-seconds", "60"]);
                cmd.args(["--size", "16M"]);
                Running::spawn(&mut cmd)
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        for rank in &mut ranks {
            rank.wait_for("looping", deadline);
        }
        // Let them get well into the loop, then kill rank 1.
        std::thread::sleep(Duration::from_millis(300));
        let killed_at = Instant::now();
        ranks[1].child.kill().expect("SIGKILL rank 1");
        let survivors_deadline = killed_at + Duration::from_secs(20);
        let mut outcomes = Vec::new();
        for (r, rank) in ranks.into_iter().enumerate() {
            let (code, out, err) = rank.finish(survivors_deadline);
            outcomes.push((r, code, out, err, killed_at.elapsed()));
        }
        // The killed rank never cleaned up, yet nothing of the job is left:
        // each inbox was unlinked as soon as every local peer had mapped it.
        assert_eq!(leftover_segments(port), Vec::<String>::new());
        for (r, code, out, err, took) in &outcomes {
            if *r == 1 {
                assert_eq!(*code, None, "rank 1 was killed by a signal");
                continue;
            }
            assert_eq!(*code, Some(1), "{transport} rank {r}\n{out}\n{err}");
            assert!(
                err.contains("peer rank 1 is gone"),
                "{transport} rank {r} must name rank 1:\n{err}"
            );
            assert!(
                err.contains("all_reduce #"),
                "{transport} rank {r} must name the call:\n{err}"
            );
            assert!(
                *took < Duration::from_secs(10),
                "{transport}: took {took:?}"
            );
            eprintln!("{transport} rank {r} after {took:?}:\n{err}");
        }
    }
}

/// Under the launcher: the job stops, and the launcher says which rank died
/// and how, and exits non-zero.
#[test]
fn the_launcher_names_a_killed_rank_and_stops_the_job() {
    let _cpus = busy_cpus();
    let mut cmd = Command::new(RUN);
    clean(&mut cmd)
        .args(["--nproc-per-node", "3", "--kill-grace", "2"])
        .args(["--master-port", &free_port().to_string()])
        .args(["--", CHECK, "--quick", "--counts", "1"])
        .args(["--loop-seconds", "60", "--size", "4M"])
        .env("OXCCL_TIMEOUT", "30s");
    let mut job = Running::spawn(&mut cmd);
    let deadline = Instant::now() + Duration::from_secs(60);
    for rank in 0..3 {
        job.wait_for(&format!("[rank {rank}] rank {rank}: pid "), deadline);
    }
    let pid_line = job
        .stdout
        .lines()
        .find(|l| l.starts_with("[rank 1] rank 1: pid "))
        .expect("rank 1's pid line")
        .to_string();
    let pid: i32 = pid_line
        .split_whitespace()
        .nth(5)
        .and_then(|p| p.parse().ok())
        .expect("pid");
    // SAFETY: sending SIGKILL to the rank process the launcher started.
    assert_eq!(unsafe { libc_kill(pid, 9) }, 0);
    let (code, out, err) = job.finish(Instant::now() + Duration::from_secs(30));
    assert!(code.is_some_and(|c| c != 0), "{code:?}\n{out}\n{err}");
    let expected = format!("rank 1 (pid {pid}) was killed by signal 9 (SIGKILL)");
    assert!(err.contains(&expected), "missing {expected:?}:\n{err}");
    eprintln!("launcher output:\n{out}\n{err}");
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

#[test]
fn a_rank_that_never_starts_is_named_at_rendezvous() {
    let port = free_port();
    let ranks: Vec<Running> = (0..2)
        .map(|r| {
            let mut cmd = rank_cmd(r, 3, port, "auto");
            cmd.env("OXCCL_TIMEOUT", "2s").arg("--quick");
            Running::spawn(&mut cmd)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    for (r, rank) in ranks.into_iter().enumerate() {
        let (code, out, err) = rank.finish(deadline);
        assert_eq!(code, Some(1), "rank {r}\n{out}\n{err}");
        assert!(
            err.contains("timed out after") && err.contains("rank 2 never joined"),
            "rank {r}:\n{err}"
        );
    }
    // Rank 0 (the store's host) never starting: rank 1 says whom it needs.
    let mut cmd = rank_cmd(1, 2, free_port(), "auto");
    cmd.env("OXCCL_TIMEOUT", "1s");
    let (code, _, err) = Running::spawn(&mut cmd).finish(Instant::now() + Duration::from_secs(20));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("rank 0"), "must point at rank 0:\n{err}");
}

/// A stranger connects to rank 0's peer port before the real peers — once
/// with a wrong token, once with garbage, once saying nothing — and the job
/// still completes correctly, rank 0 logging each refusal.
#[test]
fn connections_without_the_job_token_are_refused() {
    let port = free_port();
    let start = |r: usize| {
        let mut cmd = rank_cmd(r, 3, port, "tcp");
        cmd.arg("--quick");
        Running::spawn(&mut cmd)
    };
    let rank0 = start(0);
    let rank1 = start(1);
    // Read rank 0's peer address from the store, as any process could.
    let store =
        oxccl::bootstrap::TcpStore::connect(&format!("127.0.0.1:{port}"), Duration::from_secs(20))
            .expect("store");
    let entry = oxccl::bootstrap::Store::get(&store, "oxccl/rank/0", Duration::from_secs(20))
        .expect("rank 0's entry");
    let entry = String::from_utf8_lossy(&entry).into_owned();
    let addr = entry
        .lines()
        .find_map(|l| l.strip_prefix("addr="))
        .expect("addr line")
        .to_string();
    // A well-formed handshake (magic "OXHS", version 1) with a wrong token.
    let mut hello = Vec::new();
    hello.extend_from_slice(&0x5348_584fu32.to_le_bytes());
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&[0xAB; 16]);
    hello.extend_from_slice(&2u32.to_le_bytes());
    hello.extend_from_slice(&0u32.to_le_bytes());
    let mut wrong = TcpStream::connect(&addr).expect("connect");
    wrong.write_all(&hello).expect("send");
    let mut garbage = TcpStream::connect(&addr).expect("connect");
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: stranger.example\r\n\r\n")
        .expect("send");
    let _silent = TcpStream::connect(&addr).expect("connect");
    std::thread::sleep(Duration::from_millis(200));
    let rank2 = start(2);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut rank0_err = String::new();
    for (r, rank) in [rank0, rank1, rank2].into_iter().enumerate() {
        let (code, out, err) = rank.finish(deadline);
        assert_eq!(code, Some(0), "rank {r}\n{out}\n{err}");
        assert!(out.contains("every collective correct over tcp"), "{out}");
        if r == 0 {
            rank0_err = err;
        }
    }
    // The wrong-token stranger got no acknowledgement: its socket is closed.
    wrong
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    assert!(matches!(wrong.read(&mut [0u8; 4]), Ok(0) | Err(_)));
    assert!(
        rank0_err.contains("refused a connection") && rank0_err.contains("wrong job token"),
        "rank 0 must log the refusal:\n{rank0_err}"
    );
    assert!(rank0_err.contains("not an oxccl handshake"), "{rank0_err}");
    assert!(
        rank0_err.contains("did not complete a handshake"),
        "{rank0_err}"
    );
}

/// `OXCCL_STORE=file:/dir`: rendezvous through a shared directory, no port.
#[test]
fn processes_rendezvous_through_a_file_store() {
    let dir = std::env::temp_dir().join(format!("oxccl-mp-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ranks: Vec<Running> = (0..2)
        .map(|r| {
            // MASTER_PORT points at nothing: the file store must not need it.
            let mut cmd = rank_cmd(r, 2, free_port(), "auto");
            cmd.env("OXCCL_STORE", format!("file:{}", dir.display()))
                .args(["--quick", "--counts", "0,5"]);
            Running::spawn(&mut cmd)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    for (r, rank) in ranks.into_iter().enumerate() {
        let (code, out, err) = rank.finish(deadline);
        assert_eq!(code, Some(0), "rank {r}\n{out}\n{err}");
        assert!(out.contains("every collective correct over shm"), "{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_taken_master_port_is_a_clear_error() {
    let holder = TcpListener::bind("0.0.0.0:0").expect("bind");
    let port = holder.local_addr().expect("addr").port();
    let mut cmd = rank_cmd(0, 2, port, "auto");
    let (code, _, err) = Running::spawn(&mut cmd).finish(Instant::now() + Duration::from_secs(20));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("already in use"), "{err}");
    assert!(err.contains(&port.to_string()), "{err}");
}

/// Variables to set, and what the error must contain.
type EnvCase<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);

#[test]
fn bad_launcher_variables_say_which() {
    let cases: &[EnvCase] = &[
        (&[], &["no launcher variables found", "RANK"]),
        (&[("RANK", "3"), ("WORLD_SIZE", "2")], &["RANK", "3"]),
        (&[("RANK", "1")], &["WORLD_SIZE"]),
        (&[("RANK", "x"), ("WORLD_SIZE", "2")], &["RANK", "\"x\""]),
        (
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "2"),
            ],
            &["RANK=1", "OMPI_COMM_WORLD_RANK=0"],
        ),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")],
            &["MASTER_PORT"],
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("OXCCL_TRANSPORT", "pigeon"),
            ],
            &["OXCCL_TRANSPORT", "pigeon"],
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("OXCCL_SHM_STORES", "sideways"),
            ],
            &["OXCCL_SHM_STORES", "sideways"],
        ),
    ];
    for (vars, needles) in cases {
        let mut cmd = Command::new(CHECK);
        clean(&mut cmd);
        for (k, v) in *vars {
            cmd.env(k, v);
        }
        let (code, _, err) =
            Running::spawn(&mut cmd).finish(Instant::now() + Duration::from_secs(20));
        assert_eq!(code, Some(1), "{vars:?}: {err}");
        for needle in *needles {
            assert!(
                err.contains(needle),
                "{vars:?}: expected {needle:?} in\n{err}"
            );
        }
    }
}

/// One rank of [`a_rank_that_leaves_after_its_last_call_fails_no_one`],
/// started by it in a process of its own (ignored otherwise): a rooted
/// collective of 64 KiB (staged, not in the lanes) where rank 1 leaves as
/// soon as its part is done and rank 2 arrives 200 ms late. Rank 1 leaving
/// is no failure: its part of the call is in place.
#[test]
#[ignore]
fn child_rank_leaving_early() {
    let (Ok(rank), Ok(op)) = (std::env::var("RANK"), std::env::var("OXCCL_TEST_ROOTED_OP")) else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let mut comm = oxccl::Communicator::from_env().unwrap();
    let count = 16 * 1024;
    let input: Vec<f32> = (0..count).map(|i| (i % 97) as f32 + rank as f32).collect();
    let mut output = vec![0f32; count];
    if rank == 2 {
        std::thread::sleep(Duration::from_millis(200));
    }
    match op.as_str() {
        "reduce" => comm
            .reduce(&input, &mut output, oxccl::ReduceOp::Sum, 0)
            .unwrap(),
        "broadcast" => comm.broadcast(&input, &mut output, 0).unwrap(),
        other => panic!("unknown OXCCL_TEST_ROOTED_OP {other}"),
    }
    let expected = |i: usize| match op.as_str() {
        // Ranks 0, 1, 2 add 0 + 1 + 2 to three copies of the pattern.
        "reduce" => 3.0 * (i % 97) as f32 + 3.0,
        _ => (i % 97) as f32,
    };
    if op == "broadcast" || rank == 0 {
        for (i, &v) in output.iter().enumerate() {
            assert_eq!(v, expected(i), "rank {rank} element {i}");
        }
    }
    drop(comm);
    println!("rank {rank} done with {op}");
}

/// A rank that returns from its last call and drops its communicator at
/// once (the end of a job, a freed split) while another rank is still
/// late for that call: the ranks still waiting must not report it lost.
#[test]
fn a_rank_that_leaves_after_its_last_call_fails_no_one() {
    let _cpus = busy_cpus();
    for op in ["reduce", "broadcast"] {
        let port = free_port();
        let ranks: Vec<Running> = (0..3)
            .map(|r| {
                let mut cmd = Command::new(std::env::current_exe().unwrap());
                rank_env(&mut cmd, r, 3, port, "shm")
                    .args(["--exact", "child_rank_leaving_early", "--ignored"])
                    .args(["--nocapture", "--test-threads", "1"])
                    .env("OXCCL_TEST_ROOTED_OP", op);
                Running::spawn(&mut cmd)
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        for (r, rank) in ranks.into_iter().enumerate() {
            let (code, out, err) = rank.finish(deadline);
            assert_eq!(code, Some(0), "{op}: rank {r}\n{out}\n{err}");
            assert!(
                out.contains(&format!("rank {r} done with {op}")),
                "{op}: rank {r}\n{out}\n{err}"
            );
        }
    }
}

/// One rank of [`a_second_communicator_from_the_same_variables_says_so`]
/// (ignored otherwise): makes a communicator from the launcher's variables,
/// then another from the same while the first lives.
#[test]
#[ignore]
fn child_second_from_env() {
    if std::env::var("OXCCL_TEST_SECOND_FROM_ENV").is_err() {
        return;
    }
    let mut first = oxccl::Communicator::from_env().unwrap();
    first.barrier().unwrap();
    match oxccl::Communicator::from_env() {
        Ok(_) => println!("second: made"),
        Err(e) => println!("second: {e}"),
    }
    // The first lives until the test has also tried a stranger on it.
    let go = std::path::PathBuf::from(std::env::var("OXCCL_TEST_GO").unwrap());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !go.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    first.barrier().unwrap();
}

/// A second communicator made from the same launcher variables while the
/// first still lives finds the first's store (rank 0: the port, the others:
/// their rank already claimed). Each rank is told that it is its own
/// process's communicator in the way, not "another job"; a process of
/// another job given the same rendezvous and rank is told that, with the
/// holder's pid.
#[test]
fn a_second_communicator_from_the_same_variables_says_so() {
    let port = free_port();
    let go = std::env::temp_dir().join(format!("oxccl-mp-second-{}-{port}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let mut ranks: Vec<Running> = (0..2)
        .map(|r| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            rank_env(&mut cmd, r, 2, port, "shm")
                .args(["--exact", "child_second_from_env", "--ignored"])
                .args(["--nocapture", "--test-threads", "1"])
                .env("OXCCL_TEST_SECOND_FROM_ENV", "1")
                .env("OXCCL_TEST_GO", &go)
                .env("OXCCL_TIMEOUT", "20");
            Running::spawn(&mut cmd)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    for rank in &mut ranks {
        rank.wait_for("second: ", deadline);
    }
    let holder = ranks[1].child.id();
    let stranger = Running::spawn(&mut rank_cmd(1, 2, port, "shm")).finish(deadline);
    std::fs::write(&go, b"").unwrap();
    let stranger_text = format!("{}{}", stranger.1, stranger.2);
    assert_ne!(stranger.0, Some(0), "{stranger_text}");
    assert!(
        stranger_text.contains(&format!("is already taken (by pid {holder} on host ")),
        "{stranger_text}"
    );
    for (r, rank) in ranks.into_iter().enumerate() {
        let (code, out, err) = rank.finish(deadline);
        assert_eq!(code, Some(0), "rank {r}\n{out}\n{err}");
        // The harness prints the test's name on the same line.
        let second = out
            .lines()
            .find_map(|l| l.split_once("second: ").map(|(_, rest)| rest))
            .unwrap_or_else(|| panic!("rank {r}\n{out}\n{err}"));
        let expected = if r == 0 {
            "by a store this process hosts"
        } else {
            "already taken by this same process"
        };
        assert!(second.contains(expected), "rank {r}: {second}");
    }
    let _ = std::fs::remove_file(&go);
}

/// An `OXCCL_*` value that is not UTF-8 is a configuration error naming
/// the variable, not taken for unset (it ran with the default the user
/// meant to change).
#[test]
fn a_setting_that_is_not_utf8_is_refused_not_ignored() {
    use std::os::unix::ffi::OsStrExt;
    let not_utf8 = std::ffi::OsStr::from_bytes(b"tc\xffp");
    for name in ["OXCCL_TRANSPORT", "OXCCL_TIMEOUT", "OXCCL_ALGO"] {
        let mut cmd = rank_cmd(0, 1, free_port(), "auto");
        cmd.env(name, not_utf8).arg("--quick");
        let (code, out, err) =
            Running::spawn(&mut cmd).finish(Instant::now() + Duration::from_secs(30));
        assert_eq!(code, Some(1), "{name}\n{out}\n{err}");
        assert!(
            err.contains(&format!(
                "invalid configuration {name}=\"tc\u{fffd}p\": not UTF-8"
            )),
            "{name}: {err}"
        );
    }
}
