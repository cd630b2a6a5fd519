//! The cuda-ring's peer-direct reduction kernels, run on the CPU: the CUDA
//! source (`src/cuda/kernels.cu`) compiled as C++ by the host compiler,
//! with every (block, thread) of a small grid played in turn, against a
//! plain fold with the same operators (`tests/kernels_on_cpu/harness.cpp`).
//! It checks the kernels' own logic without a GPU — the ring's fold order,
//! the scalar head that aligns pointers sharing a misalignment, the
//! two-vector body, the tail, every destination written and nothing
//! outside the range — for worlds 2 to 8 and several types and operators.
//! The arithmetic against the host backend is the GPU tests' part.

use std::path::Path;
use std::process::Command;

/// The host's C++ compiler: `CXX`, else `c++`, else `g++`.
fn cxx() -> Option<String> {
    std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["c++".to_owned(), "g++".to_owned()])
        .find(|cxx| {
            Command::new(cxx)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

#[test]
fn peer_direct_kernels_fold_in_the_rings_order_over_every_shape() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Some(cxx) = cxx() else {
        // CI installs one (.ci/run); elsewhere say so rather than pass silently.
        assert!(
            std::env::var_os("CI").is_none(),
            "no C++ compiler (CXX, c++, g++) to build the kernel harness"
        );
        eprintln!("SKIPPED: no C++ compiler (CXX, c++, g++) to build the kernel harness");
        return;
    };
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernels_on_cpu");
    let kernels = root.join("src/cuda/kernels.cu");
    let built = Command::new(&cxx)
        .args(["-std=c++14", "-O1", "-w"])
        .arg(format!("-DKERNELS_CU=\"{}\"", kernels.display()))
        .arg("-o")
        .arg(&exe)
        .arg(root.join("tests/kernels_on_cpu/harness.cpp"))
        .output()
        .expect("running the C++ compiler");
    assert!(
        built.status.success(),
        "{cxx} failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&exe).output().expect("running the harness");
    let stdout = String::from_utf8_lossy(&ran.stdout);
    assert!(ran.status.success(), "{stdout}");
    assert!(stdout.contains("0 mismatches"), "{stdout}");
}
