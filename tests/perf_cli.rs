//! `oxccl-perf`'s command line: bad input is a usage error (never a hang),
//! and the ranks of a launched run report the job's world size once.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const PERF: &str = env!("CARGO_BIN_EXE_oxccl-perf");

/// `cmd` outside any launcher this test runs under (oxccl-perf would act
/// as one rank of that job) and without NCCL_TESTS_MIN_BW.
fn outside_launchers(cmd: &mut Command) -> &mut Command {
    cmd.env_remove("RANK")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("PMI_RANK")
        .env_remove("SLURM_PROCID")
        .env_remove("NCCL_TESTS_MIN_BW")
}

/// oxccl-perf with `args`, [`outside_launchers`].
fn perf_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(PERF);
    outside_launchers(cmd.args(args));
    cmd
}

/// Runs `cmd` with its output captured, killed after `limit` (a hang
/// fails the test).
fn output_within(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the command starts");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{cmd:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// Runs oxccl-perf with `args`, killed after 60 s.
fn perf(args: &[&str]) -> Output {
    output_within(perf_command(args), Duration::from_secs(60))
}

/// A JSON file for `-J`, as a path and as an argument.
fn json_path(tag: &str) -> (std::path::PathBuf, String) {
    let path = std::env::temp_dir().join(format!("oxccl-perf-{tag}-{}.json", std::process::id()));
    let arg = path.to_string_lossy().to_string();
    (path, arg)
}

/// What a run wrote with `-J`, the file removed.
fn take_json(path: &std::path::Path) -> String {
    let written = std::fs::read_to_string(path).expect("JSON written");
    let _ = std::fs::remove_file(path);
    written
}

#[test]
fn sizes_that_never_end_or_overflow_are_usage_errors() {
    for (args, says) in [
        (&["-b", "0", "-e", "64"][..], "-b >= 1"),
        (&["--sizes", "17179869184G"][..], "bad size"),
        (&["-e", "17179869200G"][..], "bad size"),
        (&["-n", "10", "--samples", "3"][..], "divide -n"),
        (&["-n", "10", "--samples", "0"][..], "divide -n"),
        (&["-i", "0"][..], "-i >= 1"),
        (&["-f", "0"][..], "-f >= 1"),
        (&["-T", "-1"][..], "-T: seconds, 0 or more"),
        (&["-T", "soon"][..], "-T: seconds, 0 or more"),
        (&["--offset", "64"][..], "--offset takes bytes below 64"),
        (&["--offset", "6"][..], "a multiple of the element size (4)"),
        (
            &["--offset", "4", "-d", "half,double"][..],
            "a multiple of the element size (the largest 8)",
        ),
        (&["--offset", "16", "--shared"][..], "not with --shared"),
    ] {
        let out = perf(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// `-np` is not passed on to the ranks: the world size (for the root's
/// range, the JSON and the label) is the communicator's, and only rank 0
/// prints the footer.
#[test]
fn a_launched_run_knows_its_world_size() {
    let (json, json_arg) = json_path("cli");
    let out = perf(&[
        "-np",
        "3",
        "--collective",
        "broadcast",
        "-r",
        "2",
        "-b",
        "8",
        "-e",
        "64",
        "-n",
        "2",
        "-w",
        "1",
        "-J",
        &json_arg,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("Avg bus bandwidth").count(), 1, "{stdout}");
    let written = take_json(&json);
    assert!(written.contains("\"ranks\": 3"), "{written}");
    assert!(written.contains("3xproc"), "{written}");
}

/// `--samples`: the timed calls run as batches, each after a barrier; the
/// header says which statistic the time column holds, and the JSON keeps
/// it, so runs with different statistics are not mistaken for each other.
#[test]
fn samples_are_named_in_the_header_and_the_json() {
    let (json, json_arg) = json_path("samples");
    let out = perf(&[
        "-t",
        "2",
        "-b",
        "8",
        "-e",
        "1K",
        "-f",
        "128",
        "-n",
        "12",
        "--samples",
        "4",
        "-w",
        "1",
        "-J",
        &json_arg,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("iters: 12 (median of 4 samples)"),
        "{stdout}"
    );
    assert!(stdout.contains("Out of bounds values : 0 OK"), "{stdout}");
    let written = take_json(&json);
    assert!(
        written.contains("\"iters\": 12, \"samples\": 4"),
        "{written}"
    );
}

/// The sizes of the table's rows, in order.
fn row_sizes(stdout: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

/// `-i` steps by bytes, as nccl-tests does when `-f` is not above 1 (`-f 1`
/// alone: by 1 MiB); a factor above 1 wins over it. The header says which.
#[test]
fn sizes_step_by_bytes_or_by_a_factor_as_in_nccl_tests() {
    for (args, sizes, step) in [
        (
            &["-b", "1K", "-e", "4K", "-i", "1K"][..],
            vec![1024, 2048, 3072, 4096],
            "step: 1024(bytes)",
        ),
        (
            &["-b", "0", "-e", "2M", "-f", "1"][..],
            vec![0, 1 << 20, 2 << 20],
            "step: 1048576(bytes)",
        ),
        (
            &["-b", "1K", "-e", "16K", "-f", "4", "-i", "1K"][..],
            vec![1024, 4096, 16384],
            "step: 4(factor)",
        ),
    ] {
        let mut all = vec!["-t", "2", "-n", "1", "-w", "0"];
        all.extend_from_slice(args);
        let out = perf(&all);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{args:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(row_sizes(&stdout), sizes, "{args:?}: {stdout}");
        assert!(stdout.contains(step), "{args:?}: {stdout}");
    }
}

/// nccl-tests' health check: with `NCCL_TESTS_MIN_BW` set, an average bus
/// bandwidth below 90 % of it is marked FAILED and the run exits 1; a
/// value that is not a bandwidth is a usage error, not a check that always
/// passes.
#[test]
fn a_minimum_bus_bandwidth_fails_a_slower_run() {
    let run = |min: &str| {
        perf_command(&[
            "-t", "2", "-b", "1K", "-e", "4K", "-n", "2", "-w", "1", "-T", "60",
        ])
        .env("NCCL_TESTS_MIN_BW", min)
        .output()
        .expect("oxccl-perf runs")
    };
    let slow = run("100000");
    let stdout = String::from_utf8_lossy(&slow.stdout);
    assert_eq!(slow.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("Out of bounds values : 0 OK"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("# Avg bus bandwidth") && l.ends_with(" FAILED")),
        "{stdout}"
    );
    let fast = run("0.000001");
    let stdout = String::from_utf8_lossy(&fast.stdout);
    assert!(fast.status.success(), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("# Avg bus bandwidth") && l.ends_with(" OK")),
        "{stdout}"
    );
    let bad = run("fast");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("NCCL_TESTS_MIN_BW"));
}

/// The header shows the arena's slot stores as set up; when they were
/// measured again during the run (here on a 1 ms interval; in practice
/// after the ranks' cores moved) the footer says what they ended as, so
/// a table that ran partly in another mode says so. A run in which
/// nothing changed has no such line. The checks come by rounds (many
/// small calls) and by bytes (a few large calls, fewer rounds than a
/// check waits for).
#[test]
fn the_footer_shows_the_arena_when_it_was_measured_again() {
    let run = |stores: &str, size: &str, iters: &str| {
        let mut cmd = perf_command(&[
            "-np",
            "2",
            "-b",
            size,
            "-e",
            size,
            "-n",
            iters,
            "-w",
            "1",
            "-c",
            "0",
            "-T",
            "60",
            "--collective",
            "broadcast",
        ]);
        cmd.env("OXCCL_SHM_STORES", stores)
            .env("OXCCL_TRANSPORT", "shm")
            .env_remove("OXCCL_ALGO");
        let out = cmd.output().expect("oxccl-perf runs");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{stdout}");
        stdout
    };
    // 8 KiB broadcasts run one staged round each (from 16 KiB they may
    // read by CMA, which runs no rounds): 2 × 5000 calls pass the check
    // interval (4096 rounds) twice. 16 MiB ones, 2 × 11 calls of at most
    // 64 rounds (256 KiB pieces), pass it only by bytes (128 MiB).
    for (size, iters) in [("8K", "5000"), ("16M", "10")] {
        let stdout = run("auto:1ms", size, iters);
        let header = stdout
            .lines()
            .find(|l| l.starts_with("# oxccl-perf:"))
            .unwrap_or_else(|| panic!("no header\n{stdout}"));
        assert!(header.contains("(measured 1 time,"), "{stdout}");
        let footer = stdout
            .lines()
            .find(|l| l.starts_with("# Transport at the end : shm; arena: "))
            .unwrap_or_else(|| panic!("{size}: no footer line for the arena\n{stdout}"));
        assert!(footer.contains(" times, "), "{footer}");
    }
    let stdout = run("cached", "8K", "5000");
    assert!(!stdout.contains("Transport at the end"), "{stdout}");
}

/// `--offset` moves the buffers off a cache line, and the results stay
/// right on every path: lanes, zero copy between threads, staging between
/// processes (1 MiB), with sizes that leave odd tails.
#[test]
fn buffers_off_a_cache_line_give_right_results() {
    for (offset, dtype, ranks) in [
        ("16", "float", "-t"),
        ("4", "float", "-np"),
        ("3", "int8", "-np"),
    ] {
        let out = perf(&[
            ranks,
            "2",
            "-d",
            dtype,
            "--offset",
            offset,
            "--sizes",
            "100,65540,1048580",
            "-n",
            "2",
            "-w",
            "1",
            "-c",
            "1",
            "--collective",
            "all_gather",
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "offset {offset} {dtype} {ranks}: {stdout}{stderr}"
        );
        assert!(
            stdout.contains("Out of bounds values : 0 OK"),
            "offset {offset}: {stdout}"
        );
    }
}

/// The first CPU this process may run on (`Cpus_allowed_list` in
/// `/proc/self/status`, e.g. `0-1` or `2,5`).
fn first_allowed_cpu() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    let first = list.trim().split([',', '-']).next()?;
    first.parse::<usize>().ok().map(|cpu| cpu.to_string())
}

/// The first allowed CPU, where `taskset` can pin a command to it; `None`
/// (the calling test skips, named `test`) where it cannot, except under CI.
fn pinning_cpu(test: &str) -> Option<String> {
    let cpu = first_allowed_cpu();
    let taskset_works = cpu.as_ref().is_some_and(|cpu| {
        Command::new("taskset")
            .args(["-c", cpu, "true"])
            .status()
            .is_ok_and(|s| s.success())
    });
    if !taskset_works {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run {test}: `taskset -c <first allowed CPU> true` failed \
             (install util-linux; allow sched_setaffinity)"
        );
        eprintln!("{test}: skipped, taskset cannot pin");
    }
    cpu.filter(|_| taskset_works)
}

/// Ranks that outnumber the CPUs they may run on together (two ranks
/// pinned to one CPU with `taskset`) find that out at rendezvous and say
/// so with `OXCCL_DEBUG=INFO` (their waits on the links then yield at
/// once: a speed-up, measured by `oxccl-perf`, not here); the run
/// completes and checks clean. Ranks that each have a CPU do not say so.
#[test]
fn crowded_ranks_say_so_and_check_clean() {
    let Some(cpu) = pinning_cpu("crowded_ranks_say_so_and_check_clean") else {
        return;
    };
    let run = |pinned: bool| {
        let args = [
            "-np", "2", "--sizes", "8,64K,1M", "-n", "20", "-w", "2", "-T", "60",
        ];
        let mut cmd = if pinned {
            let mut cmd = Command::new("taskset");
            outside_launchers(cmd.args(["-c", &cpu, PERF]).args(args));
            cmd
        } else {
            perf_command(&args)
        };
        cmd.env_remove("OXCCL_ALGO")
            .env("OXCCL_TRANSPORT", "tcp")
            .env("OXCCL_DEBUG", "INFO");
        let out = output_within(cmd, Duration::from_secs(90));
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(
            stdout.contains("Out of bounds values : 0 OK"),
            "{stdout}{stderr}"
        );
        let info: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("oxccl INFO rank "))
            .collect();
        assert!(info.len() >= 2, "{stderr}");
        let saying = info.iter().filter(|l| l.contains("waits yield")).count();
        (saying, info.len())
    };
    // Both ranks on one CPU: every INFO line says so.
    let (saying, lines) = run(true);
    assert_eq!(saying, lines);
    // Two CPUs or more for two ranks: none does.
    if std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2) {
        assert_eq!(run(false).0, 0);
    }
}

/// Three ranks over TCP pinned to one CPU (a crowded host): small
/// broadcasts and all-gathers run the trees (`binomial`, `doubling`),
/// reductions stay direct, and every result checks clean. Unpinned on a
/// machine with a CPU for each of them, they stay direct.
#[test]
fn crowded_hosts_broadcast_and_gather_through_trees() {
    let Some(cpu) = pinning_cpu("crowded_hosts_broadcast_and_gather_through_trees") else {
        return;
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let uncrowded = (cpus >= 3).then_some(["direct", "direct"]);
    for (collective, sizes, algos, pinned) in [
        ("broadcast", "8,64K", ["binomial", "binomial"], true),
        ("all_gather", "48,64K", ["doubling", "doubling"], true),
        ("all_reduce", "8,1K", ["oneshot", "oneshot"], true),
    ]
    .into_iter()
    .chain(uncrowded.map(|direct| ("broadcast", "8,64K", direct, false)))
    .chain(uncrowded.map(|direct| ("all_gather", "48,64K", direct, false)))
    {
        let args = [
            "-np",
            "3",
            "--collective",
            collective,
            "--sizes",
            sizes,
            "-n",
            "20",
            "-w",
            "2",
        ];
        let mut cmd = if pinned {
            let mut cmd = Command::new("taskset");
            outside_launchers(cmd.args(["-c", &cpu, PERF]).args(args));
            cmd
        } else {
            perf_command(&args)
        };
        cmd.env_remove("OXCCL_ALGO").env("OXCCL_TRANSPORT", "tcp");
        let out = output_within(cmd, Duration::from_secs(90));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{collective}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("Out of bounds values : 0 OK"), "{stdout}");
        let ran: Vec<&str> = stdout
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_whitespace().last())
            .collect();
        assert_eq!(ran, algos, "{collective}: {stdout}");
    }
}

/// The type, redop and root columns of the table's rows, in order.
fn row_sweeps(stdout: &str) -> Vec<(String, String, i64)> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            Some((
                cols.get(2)?.to_string(),
                cols.get(3)?.to_string(),
                cols.get(4)?.parse().ok()?,
            ))
        })
        .collect()
}

/// The #wrong columns of the table's rows.
fn row_wrongs(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .flat_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            [cols.get(8), cols.get(12)].map(|c| c.map_or("missing", |c| *c).to_string())
        })
        .collect()
}

/// As nccl-tests: `-d all`, `-o all` and `-r all` (or `-r -1`, nccl-tests'
/// spelling) sweep every type, within
/// it every reduction, within that every root, in one table, one footer
/// and one JSON file (rows naming their type, reduction and root), every
/// row checked. Reductions apply only to collectives that reduce and roots
/// only to rooted ones; a list of names runs those in its order.
#[test]
fn every_type_reduction_and_root_in_one_run() {
    const TYPES: [&str; 10] = [
        "int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
        "bfloat16",
    ];
    const OPS: [&str; 5] = ["sum", "prod", "max", "min", "avg"];
    let (json, json_arg) = json_path("sweeps");
    let out = perf(&[
        "-t",
        "3",
        "--collective",
        "reduce",
        "-d",
        "all",
        "-o",
        "all",
        "-r",
        "-1",
        "--sizes",
        "48,6K",
        "-n",
        "1",
        "-w",
        "0",
        "-J",
        &json_arg,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut expected = Vec::new();
    for dtype in TYPES {
        for op in OPS {
            for root in 0..3 {
                // Two sizes each.
                let sweep = (dtype.to_string(), op.to_string(), root);
                expected.extend([sweep.clone(), sweep]);
            }
        }
    }
    assert_eq!(row_sweeps(&stdout), expected, "{stdout}");
    // The header names --sizes' list, not -b's and -e's defaults.
    assert!(stdout.contains("#  sizes: 48,6144 warmup"), "{stdout}");
    let wrongs = row_wrongs(&stdout);
    assert!(wrongs.iter().all(|w| w == "0"), "{wrongs:?}\n{stdout}");
    assert_eq!(
        stdout.matches("Out of bounds values : 0 OK").count(),
        1,
        "{stdout}"
    );
    // The footer averages every sweep's rows, both placements (the rows
    // print two decimals, the footer four).
    let busbw: Vec<f64> = stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .flat_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            [7, 11].map(|c| cols[c].parse::<f64>().expect("a busbw column"))
        })
        .collect();
    let mean = busbw.iter().sum::<f64>() / busbw.len() as f64;
    let footer: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("# Avg bus bandwidth    : "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the footer's average");
    assert!(
        (footer - mean).abs() <= 0.006,
        "footer {footer}, rows {mean}"
    );
    let written = take_json(&json);
    assert!(
        written.contains("\"dtype\": \"all\", \"op\": \"all\""),
        "{written}"
    );
    assert_eq!(written.matches("\"bytes\":").count(), expected.len());
    assert!(
        written.contains("\"dtype\": \"bfloat16\", \"redop\": \"avg\", \"root\": 2,"),
        "{written}"
    );

    // A collective that neither reduces nor has a root sweeps the types
    // alone; lists run in their order, as processes too.
    let out = perf(&[
        "-np",
        "2",
        "--collective",
        "all_gather",
        "-d",
        "bf16,int8",
        "-o",
        "all",
        "-r",
        "all",
        "--sizes",
        "64",
        "-n",
        "1",
        "-w",
        "0",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let none = |dtype: &str| (dtype.to_string(), "none".to_string(), -1);
    assert_eq!(
        row_sweeps(&stdout),
        [none("bfloat16"), none("int8")],
        "{stdout}"
    );
    assert!(row_wrongs(&stdout).iter().all(|w| w == "0"), "{stdout}");

    // Names it does not know, or names twice, are usage errors.
    for bad in [
        &["-d", "float,fp8"][..],
        &["-d", "half,f16"],
        &["-o", "sum,"],
        &["-r", "every"],
    ] {
        let out = perf(bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("usage"),
            "{bad:?}"
        );
    }
}
