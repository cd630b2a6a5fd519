//! `oxccl-perf`'s command line: bad input is a usage error (never a hang),
//! and the ranks of a launched run report the job's world size once.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const PERF: &str = env!("CARGO_BIN_EXE_oxccl-perf");

/// Runs oxccl-perf with `args`, killed after 60 s (a hang fails the test).
fn perf(args: &[&str]) -> Output {
    let mut child = Command::new(PERF)
        .args(args)
        .env_remove("RANK")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("PMI_RANK")
        .env_remove("SLURM_PROCID")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("oxccl-perf starts");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("oxccl-perf {args:?} still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
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
