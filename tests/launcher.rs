//! `oxccl-run` end to end: environment, output prefixes, failure handling,
//! signal forwarding, the port pre-check and shared-memory cleanup.
//!
//! Every test runs the launcher as a child with a deadline, and uses its own
//! `--master-port` so the tests can run in parallel.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const LAUNCHER: &str = env!("CARGO_BIN_EXE_oxccl-run");
const DEADLINE: Duration = Duration::from_secs(30);

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

fn launcher(args: &[&str]) -> Command {
    let mut cmd = Command::new(LAUNCHER);
    cmd.args(args)
        .env_remove("OXCCL_JOB_ID")
        .env_remove("OMP_NUM_THREADS")
        .env_remove("OMP_THREAD_LIMIT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn collect(mut pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        let _ = tx.send(String::from_utf8_lossy(&bytes).into_owned());
    });
    rx
}

/// Waits for the launcher, killing it and failing past the deadline.
fn finish(mut child: Child, started: Instant) -> Run {
    let out = collect(child.stdout.take().unwrap());
    let err = collect(child.stderr.take().unwrap());
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("oxccl-run still running after {DEADLINE:?}; killed it");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let elapsed = started.elapsed();
    let grace = Duration::from_secs(5);
    let run = Run {
        code: status.code(),
        stdout: out.recv_timeout(grace).expect("launcher stdout still open"),
        stderr: err.recv_timeout(grace).expect("launcher stderr still open"),
        elapsed,
    };
    eprintln!(
        "--- exit {:?} after {:?}\n--- stdout\n{}--- stderr\n{}",
        run.code, run.elapsed, run.stdout, run.stderr
    );
    run
}

fn run(args: &[&str]) -> Run {
    let started = Instant::now();
    finish(launcher(args).spawn().unwrap(), started)
}

/// `[rank R] rest` lines of `text`, as (R, rest), sorted by rank.
fn rank_lines(text: &str) -> Vec<(usize, String)> {
    let mut lines: Vec<(usize, String)> = text
        .lines()
        .map(|line| {
            let rest = line
                .strip_prefix("[rank ")
                .unwrap_or_else(|| panic!("unprefixed line {line:?}"));
            let (rank, rest) = rest.split_once("] ").unwrap();
            (rank.parse().unwrap(), rest.to_string())
        })
        .collect();
    lines.sort();
    lines
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("oxccl-launcher-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn wait_for_files(dir: &Path, names: &[&str]) {
    let start = Instant::now();
    while !names.iter().all(|n| dir.join(n).exists()) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "ranks never became ready"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

const PRINT_ENV: &str = "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK \
                         $NODE_RANK $MASTER_ADDR $MASTER_PORT $OXCCL_JOB_ID";

fn is_job_id(id: &str) -> bool {
    id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit())
}

#[test]
fn three_ranks_get_torchrun_environment() {
    let r = run(&[
        "--nproc-per-node",
        "3",
        "--master-port",
        "29601",
        "--",
        "/bin/sh",
        "-c",
        PRINT_ENV,
    ]);
    assert_eq!(r.code, Some(0));
    let lines = rank_lines(&r.stdout);
    assert_eq!(lines.len(), 3);
    let job_id = lines[0].1.split(' ').next_back().unwrap().to_string();
    assert!(is_job_id(&job_id), "{job_id:?}");
    for (i, (rank, rest)) in lines.iter().enumerate() {
        assert_eq!(*rank, i);
        assert_eq!(*rest, format!("{i} 3 {i} 3 0 0 127.0.0.1 29601 {job_id}"));
    }
}

#[test]
fn second_node_of_two_gets_its_ranks_and_a_shared_job_id() {
    let args = [
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=2",
        "--master_addr=10.1.2.3",
        "--master_port=29602",
        "--",
        "/bin/sh",
        "-c",
        PRINT_ENV,
    ];
    let first = run(&args);
    assert_eq!(first.code, Some(0));
    let lines = rank_lines(&first.stdout);
    assert_eq!(lines.len(), 2);
    let job_id = lines[0].1.split(' ').next_back().unwrap().to_string();
    assert!(is_job_id(&job_id), "{job_id:?}");
    assert_eq!(
        lines[0],
        (2, format!("2 4 0 2 1 1 10.1.2.3 29602 {job_id}"))
    );
    assert_eq!(
        lines[1],
        (3, format!("3 4 1 2 1 1 10.1.2.3 29602 {job_id}"))
    );
    // Every node derives the same id from the master address and port.
    let again = run(&args);
    assert_eq!(rank_lines(&again.stdout), lines);
}

#[test]
fn inherited_job_id_is_passed_on() {
    let started = Instant::now();
    let child = launcher(&[
        "-np",
        "2",
        "--master-port",
        "29603",
        "--",
        "/bin/sh",
        "-c",
        "echo $OXCCL_JOB_ID",
    ])
    .env("OXCCL_JOB_ID", "myjob42")
    .spawn()
    .unwrap();
    let r = finish(child, started);
    assert_eq!(r.code, Some(0));
    assert_eq!(
        rank_lines(&r.stdout),
        vec![(0, "myjob42".to_string()), (1, "myjob42".to_string())]
    );
}

#[test]
fn output_lines_are_prefixed_on_stdout_and_stderr() {
    let r = run(&[
        "--nproc-per-node",
        "2",
        "--master-port",
        "29604",
        "--",
        "/bin/sh",
        "-c",
        "echo out one; echo err one >&2; echo out two; printf 'no newline' >&2",
    ]);
    assert_eq!(r.code, Some(0));
    let out = rank_lines(&r.stdout);
    assert_eq!(
        out,
        vec![
            (0, "out one".into()),
            (0, "out two".into()),
            (1, "out one".into()),
            (1, "out two".into()),
        ]
    );
    let err = rank_lines(&r.stderr);
    assert_eq!(
        err,
        vec![
            (0, "err one".into()),
            (0, "no newline".into()),
            (1, "err one".into()),
            (1, "no newline".into()),
        ]
    );
}

#[test]
fn no_prefix_passes_output_through() {
    let r = run(&[
        "--no-prefix",
        "--master-port",
        "29605",
        "--",
        "/bin/sh",
        "-c",
        "echo plain",
    ]);
    assert_eq!(r.code, Some(0));
    assert_eq!(r.stdout, "plain\n");
}

#[test]
fn failing_rank_stops_the_others_and_sets_the_exit_code() {
    let r = run(&[
        "--nproc-per-node",
        "3",
        "--master-port",
        "29606",
        "--kill-grace",
        "2",
        "--",
        "/bin/sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; exec sleep 30",
    ]);
    assert_eq!(r.code, Some(3));
    assert!(r.elapsed < Duration::from_secs(2 + 5), "{:?}", r.elapsed);
    assert!(
        r.stderr.contains("oxccl-run: rank 1 (pid ") && r.stderr.contains(") exited with status 3"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("oxccl-run: stopping the other 2 ranks"),
        "{}",
        r.stderr
    );
}

#[test]
fn ranks_that_ignore_sigterm_are_killed_after_the_grace() {
    let dir = scratch_dir("ignore-term");
    // Rank 0 fails only once rank 1 ignores SIGTERM.
    let script = format!(
        "if [ \"$RANK\" = 0 ]; then while [ ! -e {0}/ready ]; do sleep 0.01; done; exit 5; fi; \
         trap '' TERM; touch {0}/ready; exec sleep 30",
        dir.display()
    );
    let r = run(&[
        "-np",
        "2",
        "--master-port",
        "29607",
        "--kill-grace=1",
        "--",
        "/bin/sh",
        "-c",
        &script,
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.code, Some(5));
    assert!(r.elapsed >= Duration::from_millis(900), "{:?}", r.elapsed);
    assert!(r.elapsed < Duration::from_secs(1 + 5), "{:?}", r.elapsed);
    assert!(r.stderr.contains("killing it"), "{}", r.stderr);
}

#[test]
fn rank_killed_by_a_signal_is_reported_by_name() {
    let r = run(&[
        "--nproc-per-node",
        "2",
        "--master-port",
        "29608",
        "--kill-grace",
        "2",
        "--",
        "/bin/sh",
        "-c",
        "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; exec sleep 30",
    ]);
    assert_eq!(r.code, Some(128 + 9));
    assert!(
        r.stderr.contains("oxccl-run: rank 0 (pid ")
            && r.stderr.contains(") was killed by signal 9 (SIGKILL)"),
        "{}",
        r.stderr
    );
}

#[test]
fn sigterm_to_the_launcher_is_forwarded() {
    let dir = scratch_dir("sigterm");
    let script = format!(
        "trap 'echo got TERM; exit 0' TERM; touch {}/ready.$RANK; \
         while :; do sleep 0.05; done",
        dir.display()
    );
    let started = Instant::now();
    let child = launcher(&[
        "-np",
        "2",
        "--master-port",
        "29609",
        "--kill-grace",
        "5",
        "--",
        "/bin/sh",
        "-c",
        &script,
    ])
    .spawn()
    .unwrap();
    wait_for_files(&dir, &["ready.0", "ready.1"]);
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let r = finish(child, started);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.code, Some(128 + libc::SIGTERM));
    assert_eq!(
        rank_lines(&r.stdout),
        vec![(0, "got TERM".into()), (1, "got TERM".into())]
    );
    assert!(r.stderr.contains("interrupted by SIGTERM"), "{}", r.stderr);
    assert!(r.elapsed < Duration::from_secs(5), "{:?}", r.elapsed);
}

/// Starts `oxccl-run -np 2` with `script` as each rank, on a new
/// pseudo-terminal that the launcher leads as its session's controlling
/// terminal, as a login shell's job (or `ssh -t host oxccl-run …`) would.
/// Returns the launcher and the terminal's master end, which neither the
/// launcher nor its ranks inherit: closing it hangs the terminal up.
fn launch_on_a_terminal(port: &str, script: &str) -> (Child, i32) {
    use std::os::fd::FromRawFd;
    use std::os::unix::process::CommandExt;
    // Every descriptor close-on-exec from its creation: a launcher another
    // test starts meanwhile must not inherit the master end, or closing
    // ours would never hang the terminal up.
    // SAFETY: plain system calls on descriptors this test owns; `name` is
    // a live buffer of the length given.
    let (master, slave) = unsafe {
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        assert!(
            master >= 0,
            "posix_openpt: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(libc::grantpt(master), 0);
        assert_eq!(libc::unlockpt(master), 0);
        let mut name = [0 as libc::c_char; 128];
        assert_eq!(libc::ptsname_r(master, name.as_mut_ptr(), name.len()), 0);
        let slave = libc::open(
            name.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        );
        assert!(
            slave >= 0,
            "opening the pty: {}",
            std::io::Error::last_os_error()
        );
        (master, slave)
    };
    let tty = |fd: i32| {
        // SAFETY: a close-on-exec copy of a descriptor this test owns;
        // Stdio takes it (the child's stdio gets it without the flag).
        Stdio::from(unsafe {
            std::os::fd::OwnedFd::from_raw_fd(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0))
        })
    };
    let mut cmd = launcher(&[
        "-np",
        "2",
        "--master-port",
        port,
        "--kill-grace",
        "5",
        "--",
        "/bin/sh",
        "-c",
        script,
    ]);
    // The terminal in place of the pipes.
    cmd.stdin(tty(slave)).stdout(tty(slave)).stderr(tty(slave));
    // SAFETY: setsid, ioctl and signal are async-signal-safe; the child
    // makes the terminal its controlling one, and takes the terminal's
    // signals as a launcher started there does, whatever this test process
    // inherited: under `nohup` (SIGHUP ignored) or a shell's `&` (SIGINT
    // ignored) the launcher rightly keeps an ignored signal ignored, and
    // the tests on a terminal would see no signal reach the ranks.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    // SAFETY: closing the test's copy of the slave end.
    unsafe { libc::close(slave) };
    (child, master)
}

/// Waits for the launcher, then counts the lines each rank's trap wrote
/// to `dir/{name}.RANK`, and removes `dir`.
fn trap_counts(mut child: Child, dir: &Path, name: &str) -> (Vec<usize>, std::process::ExitStatus) {
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < DEADLINE, "the launcher did not finish");
        thread::sleep(Duration::from_millis(20));
    };
    let counts = (0..2)
        .map(|rank| {
            std::fs::read_to_string(dir.join(format!("{name}.{rank}")))
                .map_or(0, |t| t.lines().count())
        })
        .collect();
    let _ = std::fs::remove_dir_all(dir);
    (counts, status)
}

/// Ctrl-C at a terminal reaches every process of its foreground group, the
/// ranks included: the launcher does not send them a second copy, which
/// would cut short their handling of the first.
#[test]
fn ctrl_c_at_the_terminal_reaches_each_rank_once() {
    let dir = scratch_dir("ctrl-c");
    let script = format!(
        "trap 'echo got >> {0}/int.$RANK' INT; touch {0}/ready.$RANK; \
         for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.2 & wait; done",
        dir.display()
    );
    let (child, master) = launch_on_a_terminal("29614", &script);
    // Drain the terminal so the ranks never block writing to it.
    let reader = thread::spawn(move || {
        use std::os::fd::FromRawFd;
        // SAFETY: the master descriptor stays open until this thread ends.
        let mut file = unsafe { std::fs::File::from_raw_fd(master) };
        let mut out = Vec::new();
        let _ = file.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    });
    wait_for_files(&dir, &["ready.0", "ready.1"]);
    // SAFETY: writes one byte from a live buffer to the master.
    assert_eq!(
        unsafe { libc::write(master, b"\x03".as_ptr().cast(), 1) },
        1
    );
    let (counts, status) = trap_counts(child, &dir, "int");
    drop(reader);
    assert_eq!(counts, vec![1, 1], "SIGINTs per rank ({status:?})");
}

/// A hang-up (the terminal closed: an `ssh -t` connection dropped) reaches
/// only the session leader while it lives: when the launcher leads its
/// session it forwards the SIGHUP, once, to every rank. It took it for a
/// terminal signal the ranks "got too", and they never saw it.
#[test]
fn a_hang_up_reaches_each_rank_once_when_the_launcher_leads_its_session() {
    let dir = scratch_dir("hang-up");
    let script = format!(
        "exec >/dev/null 2>&1; trap 'echo got >> {0}/hup.$RANK' HUP; touch {0}/ready.$RANK; \
         for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.2 & wait; done",
        dir.display()
    );
    let (child, master) = launch_on_a_terminal("29672", &script);
    wait_for_files(&dir, &["ready.0", "ready.1"]);
    // The last close of the master end hangs the terminal up.
    // SAFETY: the test's only copy of the master descriptor.
    unsafe { libc::close(master) };
    let (counts, status) = trap_counts(child, &dir, "hup");
    assert_eq!(counts, vec![1, 1], "SIGHUPs per rank ({status:?})");
}

/// A launcher started with SIGCHLD ignored (inherited) still waits for its
/// ranks and reports how they ended, instead of finding them gone.
#[test]
fn an_inherited_ignored_sigchld_does_not_lose_the_ranks() {
    let mut cmd = launcher(&[
        "-np",
        "2",
        "--master-port",
        "29615",
        "--",
        "/bin/sh",
        "-c",
        "sleep 0.2; exit 0",
    ]);
    use std::os::unix::process::CommandExt;
    // SAFETY: signal is async-signal-safe; an ignored disposition survives
    // the exec, as from a parent that ignored SIGCHLD.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGCHLD, libc::SIG_IGN);
            Ok(())
        });
    }
    let started = Instant::now();
    let r = finish(cmd.spawn().unwrap(), started);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(!r.stderr.contains("exited with status"), "{}", r.stderr);
}

/// A launcher started with SIGHUP ignored (`nohup oxccl-run … &`) keeps
/// it ignored, and so do its ranks: a hang-up sent to the job's whole
/// process group (the terminal closing) ends neither.
#[test]
fn a_hang_up_under_nohup_ends_neither_the_launcher_nor_the_ranks() {
    let dir = scratch_dir("nohup");
    let script = format!(
        "touch {}/ready.$RANK; sleep 0.5; echo still here",
        dir.display()
    );
    let mut cmd = launcher(&[
        "-np",
        "2",
        "--master-port",
        "29616",
        "--",
        "/bin/sh",
        "-c",
        &script,
    ]);
    use std::os::unix::process::CommandExt;
    // SAFETY: signal is async-signal-safe; an ignored disposition survives
    // the exec, as under nohup. The launcher leads a group of its own.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    cmd.process_group(0);
    let started = Instant::now();
    let child = cmd.spawn().unwrap();
    wait_for_files(&dir, &["ready.0", "ready.1"]);
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(-(child.id() as i32), libc::SIGHUP) }, 0);
    let r = finish(child, started);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(
        rank_lines(&r.stdout),
        vec![(0, "still here".into()), (1, "still here".into())]
    );
}

#[test]
fn port_in_use_on_node_0_is_a_clear_error_and_starts_nothing() {
    let dir = scratch_dir("port");
    let _holder = TcpListener::bind(("0.0.0.0", 29610)).unwrap();
    let script = format!("touch {}/ran.$RANK", dir.display());
    // A job of one rank hosts no store: the port may be anyone's.
    let alone = run(&["--master-port", "29610", "--", "/bin/sh", "-c", &script]);
    assert_eq!(alone.code, Some(0), "{}", alone.stderr);
    assert!(dir.join("ran.0").exists());
    let _ = std::fs::remove_file(dir.join("ran.0"));
    let r = run(&[
        "-np",
        "2",
        "--master-port",
        "29610",
        "--",
        "/bin/sh",
        "-c",
        &script,
    ]);
    let ran = dir.join("ran.0").exists() || dir.join("ran.1").exists();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr.contains(
            "oxccl-run: node 0 hosts the rendezvous store on port 29610: port 29610 is already in use"
        ) && r.stderr.contains("--master-port"),
        "{}",
        r.stderr
    );
    assert!(!ran, "a rank ran although the port check failed");
}

#[test]
fn missing_program_is_a_clear_error() {
    let r = run(&[
        "-np",
        "2",
        "--master-port",
        "29611",
        "--",
        "oxccl-no-such-program",
    ]);
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr.contains("oxccl-no-such-program") && r.stderr.contains("cannot run"),
        "{}",
        r.stderr
    );
}

#[test]
fn bad_usage_exits_2() {
    for args in [
        &["--nnodes", "2", "--node-rank", "2", "--", "true"][..],
        &["--nproc-per-node", "0", "--", "true"],
        &["--nproc-per-node", "65537", "--", "true"],
        &["--nproc-per-node", "100000000000000", "--", "true"],
        &["--nnodes", "2", "--nproc-per-node", "40000", "--", "true"],
        &["--master-port", "70000", "--", "true"],
        &["--bogus", "--", "true"],
        &["--master-port", "29612"],
    ] {
        let r = run(args);
        assert_eq!(r.code, Some(2), "{args:?}");
        assert!(r.stderr.starts_with("oxccl-run: "), "{}", r.stderr);
        assert!(r.stderr.contains("usage:"), "{}", r.stderr);
    }
    let help = run(&["--help"]);
    assert_eq!(help.code, Some(0));
    assert!(help.stdout.starts_with("usage: oxccl-run"));
}

#[test]
fn leftover_shared_memory_of_the_job_is_removed() {
    let job = format!("launchtest{}", std::process::id());
    let other = format!("/dev/shm/oxccl-{job}x-keep");
    std::fs::write(&other, b"").unwrap();
    let started = Instant::now();
    let child = launcher(&[
        "-np",
        "2",
        "--master-port",
        "29613",
        "--",
        "/bin/sh",
        "-c",
        "touch /dev/shm/oxccl-$OXCCL_JOB_ID-seg$RANK && echo made",
    ])
    .env("OXCCL_JOB_ID", &job)
    .spawn()
    .unwrap();
    let r = finish(child, started);
    let kept = Path::new(&other).exists();
    let _ = std::fs::remove_file(&other);
    assert_eq!(r.code, Some(0));
    assert_eq!(
        rank_lines(&r.stdout),
        vec![(0, "made".into()), (1, "made".into())]
    );
    for rank in 0..2 {
        let seg = format!("/dev/shm/oxccl-{job}-seg{rank}");
        assert!(!Path::new(&seg).exists(), "{seg} left behind");
    }
    assert!(kept, "a segment of another job was removed");
}

/// A process the rank left behind that keeps writing to the rank's output
/// must not keep the launcher from ending once every rank has exited.
#[test]
fn output_of_a_process_left_behind_does_not_keep_the_launcher_running() {
    let started = Instant::now();
    let mut cmd = launcher(&[
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        "for i in 1 2 3 4; do (yes left-behind &); done; sleep 0.3; echo rank-done; exit 0",
    ]);
    let run = finish(cmd.spawn().unwrap(), started);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stdout.contains("rank-done"),
        "{}",
        &run.stdout[..run.stdout.len().min(2000)]
    );
    // The rank ends after 0.3 s, and the launcher copies its output for at
    // most 1 s more (before, it went on for as long as a writer kept the
    // pipe busy: 4–8 s in this test on a 2-core VM, unbounded in general).
    assert!(run.elapsed < Duration::from_secs(4), "{:?}", run.elapsed);
}

/// Whether process `pid` still runs (a zombie, ended but not yet reaped,
/// does not count).
fn still_runs(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => {
            let after = &stat[stat.rfind(')').unwrap() + 1..];
            after.split_whitespace().next() != Some("Z")
        }
    }
}

/// Stopping the job reaches the processes below the ranks: a rank that is
/// a shell running a program without `exec` (here a `sleep` that ignores
/// `SIGTERM`, so the shell dies first and the launcher adopts it) does not
/// leave that program running after the launcher ends.
#[test]
fn stopping_the_job_reaches_the_processes_below_the_ranks() {
    let dir = scratch_dir("below-ranks");
    let script = format!(
        "if [ \"$RANK\" = 0 ]; then while [ ! -e {0}/plain ] || [ ! -e {0}/stubborn ]; do \
         sleep 0.01; done; exit 4; fi; \
         if [ \"$RANK\" = 1 ]; then sleep 300 & echo $! > {0}/plain.tmp; mv {0}/plain.tmp {0}/plain; wait; fi; \
         sh -c \"trap '' TERM; echo \\$\\$ > {0}/stubborn.tmp; mv {0}/stubborn.tmp {0}/stubborn; \
         exec sleep 300\" & wait",
        dir.display()
    );
    let r = run(&[
        "-np",
        "3",
        "--master-port",
        "29624",
        "--kill-grace",
        "1",
        "--",
        "/bin/sh",
        "-c",
        &script,
    ]);
    let pid = |name: &str| -> u32 {
        std::fs::read_to_string(dir.join(name))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let (plain, stubborn) = (pid("plain"), pid("stubborn"));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.code, Some(4), "{}", r.stderr);
    let start = Instant::now();
    while (still_runs(plain) || still_runs(stubborn)) && start.elapsed() < Duration::from_secs(3) {
        thread::sleep(Duration::from_millis(20));
    }
    let left = [plain, stubborn].map(still_runs);
    for (pid, runs) in [plain, stubborn].iter().zip(left) {
        if runs {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
        }
    }
    assert_eq!(
        left,
        [false, false],
        "processes left running below the ranks"
    );
}

/// Processes a rank leaves behind are adopted by the launcher (a child
/// subreaper) and reaped once they end, not kept as zombies for the rest
/// of the job.
#[test]
fn orphans_the_ranks_leave_are_reaped_while_the_job_runs() {
    let script = "for i in 1 2 3 4 5 6 7 8 9 10; do (sleep 0.05 &); done; sleep 1; \
                  z=0; for c in $(cat /proc/$PPID/task/*/children); do \
                  s=$(cut -d')' -f2 /proc/$c/stat 2>/dev/null | cut -d' ' -f2); \
                  [ \"$s\" = Z ] && z=$((z+1)); done; echo zombies $z";
    let r = run(&[
        "--nproc-per-node",
        "1",
        "--master-port",
        "29626",
        "--",
        "/bin/sh",
        "-c",
        script,
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("[rank 0] zombies 0"), "{}", r.stdout);
}

/// A rank of a job with fewer ranks than CPUs may run on its whole share of
/// them, so its own threads (a framework's intra-op pool, data loaders)
/// are not all pinned to one core: here one rank gets every CPU the
/// launcher has. It got one.
#[test]
fn a_lone_rank_may_use_every_cpu_the_launcher_has() {
    // The CPUs this process may run on, as the launcher reads them (not
    // available_parallelism, which follows cgroup quotas; `nproc` below
    // runs without the OpenMP variables it would follow).
    let allowed = oxccl::launch::allowed_cpus().len();
    let out = run(&[
        "--nproc-per-node",
        "1",
        "--master-port",
        "29671",
        "--no-prefix",
        "--",
        "nproc",
    ]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(out.stdout.trim(), allowed.to_string());
}
