//! How oxccl finds NCCL and the CUDA driver, on a machine with no GPU:
//! a missing library is a clear error listing what was tried; a library too
//! old or not NCCL at all is refused; pip's `nvidia-nccl-cu12` (installed by
//! `.ci/run` and named by `OXCCL_TEST_NCCL_LIBRARY`) loads, reports its
//! version and makes a unique id; and a device communicator on a machine
//! without a GPU fails with an error, not a panic or a hang.
#![cfg(feature = "nccl")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl::bootstrap::MemoryStore;
use oxccl::nccl::{probe_library, MIN_VERSION};
use oxccl::{DeviceCommunicator, Error};

#[test]
fn a_missing_library_names_every_candidate_and_the_fix() {
    let tried = vec![
        "/nonexistent/oxccl-test/libnccl.so.2".to_owned(),
        "libnccl-oxccl-test-missing.so".to_owned(),
    ];
    let e = probe_library(&tried).unwrap_err();
    let Error::LibraryNotFound {
        library,
        tried: listed,
        hint,
    } = &e
    else {
        panic!("expected LibraryNotFound, got {e:?}");
    };
    assert_eq!(*library, "NCCL");
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed[0].starts_with("/nonexistent/oxccl-test/libnccl.so.2 ("));
    assert!(listed[1].starts_with("libnccl-oxccl-test-missing.so ("));
    assert!(hint.contains("pip install nvidia-nccl-cu12"), "{hint}");
    assert!(hint.contains("OXCCL_NCCL_LIBRARY"), "{hint}");
    let text = e.to_string();
    assert!(
        text.starts_with("NCCL could not be loaded; tried: /nonexistent"),
        "{text}"
    );
}

/// Builds a shared library exporting every NCCL entry point oxccl resolves
/// (all returning success) whose `ncclGetVersion` reports `version_code`,
/// but for the symbols in `omit`.
fn fake_nccl(dir: &Path, version_code: u32, omit: &[&str]) -> Option<PathBuf> {
    if Command::new("cc").arg("--version").output().is_err() {
        // CI always has one (Rust links with it); a bare GPU machine may not.
        assert!(
            std::env::var_os("CI").is_none(),
            "CI needs a C compiler (cc)"
        );
        eprintln!("skipped: no C compiler (cc) to build a fake NCCL");
        return None;
    }
    let symbols = [
        "ncclGetErrorString",
        "ncclGetLastError",
        "ncclGetUniqueId",
        "ncclCommInitRankConfig",
        "ncclCommGetAsyncError",
        "ncclCommFinalize",
        "ncclCommDestroy",
        "ncclCommAbort",
        "ncclCommCount",
        "ncclCommUserRank",
        "ncclCommCuDevice",
        "ncclAllReduce",
        "ncclReduceScatter",
        "ncclAllGather",
        "ncclBroadcast",
        "ncclReduce",
        "ncclSend",
        "ncclRecv",
        "ncclGroupStart",
        "ncclGroupEnd",
    ];
    let mut c = format!("int ncclGetVersion(int* v) {{ *v = {version_code}; return 0; }}\n");
    for s in symbols.iter().filter(|s| !omit.contains(s)) {
        c.push_str(&format!("int {s}(void) {{ return 0; }}\n"));
    }
    let name = format!(
        "fake-{version_code}-{}",
        if omit.is_empty() {
            "full".to_owned()
        } else {
            omit.join("-")
        }
    );
    let source = dir.join(format!("{name}.c"));
    let library = dir.join(format!("lib{name}.so"));
    std::fs::write(&source, c).unwrap();
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .status()
        .expect("a C compiler (cc) builds the fake NCCL");
    assert!(status.success());
    Some(library)
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("oxccl-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn an_nccl_older_than_the_minimum_is_refused_with_both_versions() {
    let dir = scratch_dir("old-nccl");
    let Some(old) = fake_nccl(&dir, 2708, &[]) else {
        return;
    };
    let e = probe_library(&[old.display().to_string()]).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(e, Error::LibraryUnsupported { .. }),
        "expected LibraryUnsupported, got {e:?}"
    );
    assert!(text.contains("is NCCL 2.7.8"), "{text}");
    assert!(
        text.contains(&format!("needs NCCL {MIN_VERSION} or newer")),
        "{text}"
    );

    // A real NCCL 2.12 lacks what came in 2.13 and 2.14: still told as
    // too old, not as "not NCCL".
    let older = fake_nccl(
        &dir,
        21212,
        &[
            "ncclGetLastError",
            "ncclCommInitRankConfig",
            "ncclCommFinalize",
        ],
    )
    .unwrap();
    let e = probe_library(&[older.display().to_string()]).unwrap_err();
    assert!(
        matches!(&e, Error::LibraryUnsupported { detail, .. } if detail.contains("is NCCL 2.12.12")),
        "expected LibraryUnsupported naming 2.12.12, got {e:?}"
    );

    // The same stub claiming a supported version loads.
    let new = fake_nccl(&dir, 22005, &[]).unwrap();
    let info = probe_library(&[new.display().to_string()]).unwrap();
    assert_eq!(info.version.to_string(), "2.20.5");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_library_missing_an_entry_point_is_not_taken_for_nccl() {
    let dir = scratch_dir("partial-nccl");
    let Some(partial) = fake_nccl(&dir, 22005, &["ncclAllReduce"]) else {
        return;
    };
    let e = probe_library(&[partial.display().to_string()]).unwrap_err();
    let Error::LibraryNotFound { tried, .. } = &e else {
        panic!("expected LibraryNotFound, got {e:?}");
    };
    assert!(tried[0].contains("no symbol ncclAllReduce"), "{tried:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// pip's NCCL, as `.ci/run` installs it. Outside CI without the variable the
/// test says it skipped; in CI (`CI` set) a missing variable fails it.
fn pip_nccl() -> Option<String> {
    match std::env::var("OXCCL_TEST_NCCL_LIBRARY") {
        Ok(path) if !path.is_empty() => Some(path),
        _ if std::env::var_os("CI").is_some() => {
            panic!("CI must set OXCCL_TEST_NCCL_LIBRARY to pip's libnccl.so.2 (.ci/run does)")
        }
        _ => {
            eprintln!(
                "skipped: set OXCCL_TEST_NCCL_LIBRARY to a libnccl.so.2 (pip install \
                 nvidia-nccl-cu12) to run this test"
            );
            None
        }
    }
}

#[test]
fn pips_nccl_loads_and_reports_its_version() {
    let Some(path) = pip_nccl() else { return };
    let info = probe_library(std::slice::from_ref(&path)).unwrap();
    assert!(info.version >= MIN_VERSION, "{info:?}");
    assert_eq!(info.path, path);
}

/// Runs `child` (an ignored test of this file) in a fresh process with
/// `OXCCL_NCCL_LIBRARY` set, so the process-wide loader sees the variable
/// from its first call and no other test shares the process.
fn run_child(child: &str, nccl: Option<&str>) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        child,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    match nccl {
        Some(path) => cmd.env("OXCCL_NCCL_LIBRARY", path),
        None => cmd.env("OXCCL_NCCL_LIBRARY", "/nonexistent/oxccl-test/libnccl.so.2"),
    };
    let out = cmd.env("OXCCL_TIMEOUT", "20").output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{child} failed:\n{text}");
    assert!(text.contains("1 passed"), "{child} did not run:\n{text}");
}

#[test]
fn the_process_loader_makes_a_unique_id_and_device_init_fails_cleanly() {
    let Some(path) = pip_nccl() else { return };
    run_child("child_unique_id_and_init_without_a_device", Some(&path));
}

#[test]
fn a_named_library_that_is_missing_is_not_replaced_by_another() {
    run_child("child_named_library_missing", None);
}

#[test]
#[ignore = "run by the_process_loader_makes_a_unique_id_and_device_init_fails_cleanly"]
fn child_unique_id_and_init_without_a_device() {
    let info = oxccl::nccl::library_info().unwrap();
    assert_eq!(
        info.path,
        std::env::var("OXCCL_NCCL_LIBRARY").unwrap(),
        "OXCCL_NCCL_LIBRARY is what loads"
    );
    let a = oxccl::nccl::UniqueId::new().unwrap();
    let b = oxccl::nccl::UniqueId::new().unwrap();
    assert_ne!(a.as_bytes(), b.as_bytes(), "each id is fresh");
    assert_eq!(oxccl::nccl::UniqueId::from_bytes(a.as_bytes()).unwrap(), a);
    assert!(oxccl::nccl::UniqueId::from_bytes(&[0; 3]).is_err());

    // A device communicator on this machine: an error, quickly, no panic.
    // SAFETY: only tries to dlopen the driver library.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("this machine has a CUDA driver: the no-device case is covered elsewhere");
        return;
    }
    let start = Instant::now();
    let e = DeviceCommunicator::init(0, 1, Arc::new(MemoryStore::new())).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    let text = e.to_string();
    assert!(
        matches!(
            e,
            Error::LibraryNotFound {
                library: "CUDA driver",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(text.contains("no NVIDIA driver"), "{text}");
    let e = DeviceCommunicator::local_group(2).unwrap_err();
    assert!(matches!(e, Error::LibraryNotFound { .. }), "{e:?}");
}

#[test]
#[ignore = "run by a_named_library_that_is_missing_is_not_replaced_by_another"]
fn child_named_library_missing() {
    let e = oxccl::nccl::library_info().unwrap_err();
    let Error::LibraryNotFound { tried, .. } = &e else {
        panic!("expected LibraryNotFound, got {e:?}");
    };
    assert_eq!(tried.len(), 1, "only the named library is tried: {tried:?}");
    assert!(tried[0].starts_with("/nonexistent/oxccl-test/libnccl.so.2"));
    // A device communicator reports the same, before touching the driver.
    let e = DeviceCommunicator::init(0, 1, Arc::new(MemoryStore::new())).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LibraryNotFound {
                library: "NCCL",
                ..
            }
        ),
        "{e:?}"
    );
}

/// A rank told another backend than the one rank 0 runs is refused at once,
/// naming both, instead of starting a set-up nobody joins. Rank 0 (told
/// cuda-ring) publishes its choice in a file store, then fails here for
/// want of a GPU; rank 1 (told nccl) then reads the choice.
#[test]
fn a_rank_told_another_backend_than_rank_0_is_refused() {
    let dir = scratch_dir("backend-mismatch");
    let rank = |r: usize, backend: &str| {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_backend_rank", "--ignored", "--nocapture"])
            .args(["--test-threads=1"])
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", "2")
            .env("LOCAL_WORLD_SIZE", "2")
            .env("OXCCL_STORE", format!("file:{}", dir.display()))
            .env("OXCCL_JOB_ID", "backend-mismatch")
            .env("OXCCL_TEST_BACKEND", backend)
            .env("OXCCL_TIMEOUT", "10")
            .env("OXCCL_NCCL_LIBRARY", "/nonexistent/oxccl-test/libnccl.so.2")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let rank0 = rank(0, "cuda-ring");
    let rank1 = rank(1, "nccl");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(rank0.contains("result: "), "{rank0}");
    assert!(
        rank1.contains("rank 1 was told nccl but rank 0 runs cuda-ring"),
        "{rank1}"
    );
}

#[test]
#[ignore = "run by a_rank_told_another_backend_than_rank_0_is_refused"]
fn child_backend_rank() {
    let backend = std::env::var("OXCCL_TEST_BACKEND").unwrap();
    let backend = oxccl::DeviceBackend::from_name(&backend).unwrap();
    // An explicit device: nothing asks the (absent) driver how many GPUs
    // there are before the backends are compared.
    match DeviceCommunicator::builder()
        .backend(backend)
        .device(0)
        .from_env()
    {
        Ok(_) => println!("result: made"),
        Err(e) => println!("result: {e}"),
    }
}
