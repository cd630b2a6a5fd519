#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and no Rust toolchain.
#
# Build the binaries here (any x86-64 Linux with Rust; no CUDA needed):
#     scripts/build-device-bundle.sh            # -> carry/device/
# carry that folder to the GPU machine and run, from the repository root:
#     bash scripts/device-check.sh [carry/device]
#
# It finds NCCL (OXCCL_NCCL_LIBRARY, else the loader path, else the
# nvidia-nccl-cu12/cu13 package that PyTorch's pip install brings), runs the
# NCCL GPU tests and the library-loading tests, oxccl-perf --backend nccl
# over the collectives, then the cuda-ring's GPU tests (ranks as threads
# and as processes joined by CUDA IPC; also host-staged, OXCCL_P2P_DISABLE=1)
# and oxccl-perf --backend cuda-ring beside the GPU's
# copy bandwidth, and prints a short summary table last. Exit status:
# non-zero when any step failed. STEP_TIMEOUT (seconds, default 300) bounds
# each step, so that a hang costs one step, not the session's device time.
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE="${1:-carry/device}"
[ -x "$BUNDLE/oxccl-perf" ] || { echo "no $BUNDLE/oxccl-perf: run scripts/build-device-bundle.sh first"; exit 2; }
LOG="${OUT:-/tmp}/device-check.log"
: > "$LOG"
SUMMARY=()
FAILED=0

# step NAME COMMAND...: runs one step with its output teed to the log, and
# records a summary line with its status and duration.
step() {
    local name="$1"; shift
    echo; echo "=== $name: $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "${STEP_TIMEOUT:-300}" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local status=ok
    [ "$rc" -eq 0 ] || { status="FAILED (rc $rc)"; FAILED=1; }
    SUMMARY+=("$(printf '%-44s %-16s %4ss' "$name" "$status" $((SECONDS - t0)))")
}

find_nccl() {
    [ -n "${OXCCL_NCCL_LIBRARY:-}" ] && { echo "$OXCCL_NCCL_LIBRARY"; return; }
    if ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 '; then echo libnccl.so.2; return; fi
    # pip's nvidia-nccl-cu12/13 (PyTorch's dependency): <site-packages>/nvidia/nccl/lib.
    local py
    for py in python3 python; do
        command -v "$py" >/dev/null || continue
        "$py" - <<'PY' 2>/dev/null && return
import glob, os, site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for d in dirs:
    for lib in sorted(glob.glob(os.path.join(d, "nvidia", "nccl", "lib", "libnccl.so.2"))):
        print(lib)
        sys.exit(0)
sys.exit(1)
PY
    done
    return 1
}

echo "=== machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
GPUS=${GPUS:-0}
if NCCL=$(find_nccl); then
    export OXCCL_NCCL_LIBRARY="$NCCL"
    echo "NCCL: $OXCCL_NCCL_LIBRARY" | tee -a "$LOG"
else
    echo "NCCL: not found on the loader path or in Python's site-packages" | tee -a "$LOG"
fi
if [ "$GPUS" -le 1 ]; then
    echo "NOTE: $GPUS GPU: NCCL can only form world size 1, which exercises no communication" | tee -a "$LOG"
fi

export OXCCL_TEST_NCCL_LIBRARY="${OXCCL_NCCL_LIBRARY:-}"
step "loader tests (nccl_loader)" "$BUNDLE/nccl_loader" --test-threads=1
step "GPU tests (nccl_gpu --ignored)" "$BUNDLE/nccl_gpu" --ignored --test-threads=1 --nocapture
PERF_RANKS=$(( GPUS > 0 ? GPUS : 1 ))
step "oxccl-perf nccl all_reduce -t $PERF_RANKS" \
    "$BUNDLE/oxccl-perf" --backend nccl -t "$PERF_RANKS" -b 8 -e 256M -f 4 -n 20 -w 5
for coll in all_gather reduce_scatter broadcast reduce all_to_all; do
    step "oxccl-perf nccl $coll -t $PERF_RANKS" \
        "$BUNDLE/oxccl-perf" --backend nccl -t "$PERF_RANKS" --collective "$coll" -b 8 -e 64M -f 16 -n 10 -w 2
done
step "oxccl-perf nccl bfloat16 avg" \
    "$BUNDLE/oxccl-perf" --backend nccl -t "$PERF_RANKS" -d bfloat16 -o avg -b 1K -e 16M -f 16 -n 10 -w 2

# The cuda-ring: oxccl's own kernels, several ranks per GPU allowed.
step "cuda-ring GPU tests (threads, processes)" \
    "$BUNDLE/cuda_ring_gpu" --ignored --test-threads=1 --nocapture
# Threads on one GPU run all-reduce, reduce-scatter and all-gather
# peer-direct by default; this step keeps them on the ring, with pieces far
# smaller than the default, so that every collective runs through many
# pipeline pieces per chunk.
step "cuda-ring GPU tests, OXCCL_ALGO=ring OXCCL_CHUNK_BYTES=64K" \
    env OXCCL_ALGO=ring OXCCL_CHUNK_BYTES=65536 "$BUNDLE/cuda_ring_gpu" --ignored --test-threads=1 \
    every_collective_dtype_and_op_matches_the_host_bit_for_bit \
    all_reduce_is_all_gather_of_reduce_scatter_bit_for_bit
step "cuda-ring GPU tests, OXCCL_P2P_DISABLE=1" \
    env OXCCL_P2P_DISABLE=1 OXCCL_DEBUG=INFO "$BUNDLE/cuda_ring_gpu" --ignored --test-threads=1 \
    every_collective_dtype_and_op_matches_the_host_bit_for_bit
step "cuda-ring processes, OXCCL_P2P_DISABLE=1" \
    env OXCCL_P2P_DISABLE=1 "$BUNDLE/cuda_ring_gpu" --ignored --test-threads=1 --nocapture \
    processes_on_one_gpu_match_the_host_bit_for_bit
RING_RANKS=$(( GPUS > 1 ? GPUS : 2 ))
step "oxccl-perf cuda-ring all_reduce -t $RING_RANKS" \
    env OXCCL_DEBUG=INFO "$BUNDLE/oxccl-perf" --backend cuda-ring -t "$RING_RANKS" -b 8 -e 256M -f 4 -n 20 -w 5
step "oxccl-perf cuda-ring all_reduce -t $RING_RANKS, OXCCL_ALGO=ring" \
    env OXCCL_ALGO=ring "$BUNDLE/oxccl-perf" --backend cuda-ring -t "$RING_RANKS" -b 8 -e 256M -f 4 -n 20 -w 5
for ranks in 4 8; do
    step "oxccl-perf cuda-ring all_reduce -t $ranks" \
        "$BUNDLE/oxccl-perf" --backend cuda-ring -t "$ranks" -b 8 -e 256M -f 16 -n 10 -w 2
done
for coll in all_gather reduce_scatter broadcast; do
    step "oxccl-perf cuda-ring $coll -t $RING_RANKS" \
        "$BUNDLE/oxccl-perf" --backend cuda-ring -t "$RING_RANKS" --collective "$coll" -b 1M -e 256M -f 16 -n 10 -w 2
done

echo
echo "=== summary (log: $LOG)"
grep -E '^# (oxccl-perf|world size|device copy|Avg bus|Out of bounds)|^ +(67108864|268435456) ' "$LOG" | sed 's/^/  /' | tail -n 60
printf '%-44s %-16s %5s\n' "step" "status" "time"
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
