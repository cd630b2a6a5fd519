#!/usr/bin/env bash
# Builds what scripts/device-check.sh runs on a GPU machine that has no Rust
# toolchain, and copies it into one folder to carry there (default
# carry/device, which .gitignore ignores):
#   oxccl-perf     the benchmark, built with every feature (--backend nccl)
#   nccl_gpu       the GPU tests (#[ignore = "needs a CUDA device"])
#   nccl_loader    the library-loading tests (also run here, in CI)
#   cuda_ring_gpu  the cuda-ring GPU tests (several ranks per GPU)
#   device-check.sh
# Both machines are x86-64 Linux; the binaries load libcuda and NCCL at run
# time, so nothing CUDA is needed to build them. Stripped, the folder is a
# few MiB (the device tool carries at most 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-carry/device}"
mkdir -p "$OUT"
cargo build --release --all-features --bin oxccl-perf
cp target/release/oxccl-perf "$OUT/"
# The test binaries' paths, from cargo's own report of what it built.
cargo test --release --all-features --no-run --message-format=json \
    --test nccl_gpu --test nccl_loader --test cuda_ring_gpu 2>/dev/null |
    python3 -c '
import json, shutil, sys
out = sys.argv[1]
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    exe = msg.get("executable")
    name = msg.get("target", {}).get("name")
    if exe and name in ("nccl_gpu", "nccl_loader", "cuda_ring_gpu"):
        shutil.copy(exe, f"{out}/{name}")
        print(f"{name}: {exe}")
' "$OUT"
cp scripts/device-check.sh "$OUT/"
strip "$OUT/oxccl-perf" "$OUT/nccl_gpu" "$OUT/nccl_loader" "$OUT/cuda_ring_gpu" 2>/dev/null || true
du -sh "$OUT"
