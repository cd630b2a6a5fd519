//! Embeds the cuda-ring kernels' PTX (generated from src/cuda/kernels.cu by
//! scripts/gen-ptx.py and committed) into the crate, and re-runs when it
//! changes. Nothing here needs CUDA: the PTX is text, JIT-compiled by the
//! driver at run time.

use std::path::Path;

const TARGETS: [&str; 2] = ["sm80", "sm90"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/cuda/kernels.cu");
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    for target in TARGETS {
        let path = format!("src/cuda/kernels.{target}.ptx");
        println!("cargo:rerun-if-changed={path}");
        // Without the cuda feature nothing includes the PTX: a missing file
        // must not fail a host-only build.
        let ptx = std::fs::read_to_string(&path).unwrap_or_default();
        if std::env::var_os("CARGO_FEATURE_CUDA").is_some() && !ptx.contains(".visible .entry") {
            panic!("{path} is missing or holds no kernels: run `python3 scripts/gen-ptx.py`");
        }
        std::fs::write(Path::new(&out).join(format!("kernels.{target}.ptx")), ptx)
            .expect("OUT_DIR is writable");
    }
}
