#!/usr/bin/env bash
# Hosts made of network namespaces on this machine, each with a NIC of a
# chosen speed, for measuring what crosses between hosts (root, `ip`,
# `tc`, `nsenter`).
#
#   scripts/netns-hosts.sh setup                 # namespaces oxnh-0..H-1, a bridge in oxnh-hub
#   scripts/netns-hosts.sh run BIN ARGS...       # one rank per process, BIN ARGS on every rank
#   scripts/netns-hosts.sh teardown
#
# Host i has the veth `nv<i>` (10.216.0.<i+1>/24) whose other end is on a
# bridge. Variables:
#   HOSTS=2        hosts (setup, run)
#   PER_HOST=2     ranks per host (run)
#   WORLD=HOSTS*PER_HOST   ranks in all (run; round-robin placement only):
#                  another count places them unevenly (the first hosts
#                  get one more)
#   RATE=1gbit     each host's egress, shaped with `tc tbf` (setup); empty: unshaped
#   PLACEMENT=round-robin   rank r on host r % HOSTS (mpirun --map-by node,
#                  Slurm's cyclic distribution); `block`: host r / PER_HOST
#   PORT=29555     MASTER_PORT (run)
#
# `run` starts the ranks with the launchers' variables (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the caller's
# OXCCL_* variables (OXCCL_ALGO=ring, OXCCL_DEBUG=INFO, ...) through
# `nsenter --net`, not `ip netns exec`: each `ip netns exec` gets a mount
# namespace of its own, which makes every rank a host of its own to oxccl.
# Rank r's output goes to target/netns-hosts/rank<r>.out; rank 0's is
# printed. Example, the measurement of docs/performance.md's stop 46:
#
#   cargo build --release --bin oxccl-perf
#   scripts/netns-hosts.sh setup
#   scripts/netns-hosts.sh run target/release/oxccl-perf -np 4 --sizes 1M,4M -n 4 -w 1
#   scripts/netns-hosts.sh teardown
set -euo pipefail
HOSTS=${HOSTS:-2}
PER_HOST=${PER_HOST:-2}
RATE=${RATE-1gbit}
PLACEMENT=${PLACEMENT:-round-robin}
PORT=${PORT:-29555}
OUT=target/netns-hosts

setup() {
    ip netns add oxnh-hub
    ip -n oxnh-hub link add br0 type bridge
    ip -n oxnh-hub link set br0 up
    for ((i = 0; i < HOSTS; i++)); do
        ip netns add "oxnh-$i"
        ip link add "nv$i" netns "oxnh-$i" type veth peer name "hub$i" netns oxnh-hub
        ip -n oxnh-hub link set "hub$i" master br0
        ip -n oxnh-hub link set "hub$i" up
        ip -n "oxnh-$i" addr add "10.216.0.$((i + 1))/24" dev "nv$i"
        ip -n "oxnh-$i" link set "nv$i" up
        ip -n "oxnh-$i" link set lo up
        if [ -n "$RATE" ]; then
            ip netns exec "oxnh-$i" tc qdisc add dev "nv$i" root tbf rate "$RATE" \
                burst 512k latency 100ms
        fi
    done
}

teardown() {
    for ns in $(ip netns list | awk '/^oxnh-/{print $1}'); do
        ip netns del "$ns" || true
    done
}

run() {
    local world=${WORLD:-$((HOSTS * PER_HOST))} pids=() failed=0
    # The caller's OXCCL_* settings (OXCCL_ALGO, OXCCL_DEBUG, ...) reach
    # every rank; nothing else of its environment does.
    local settings=()
    mapfile -t settings < <(env | grep '^OXCCL_' || true)
    mkdir -p "$OUT"
    for ((r = 0; r < world; r++)); do
        local host local_rank
        local on_host=$PER_HOST
        if [ "$PLACEMENT" = block ]; then
            host=$((r / PER_HOST)) local_rank=$((r % PER_HOST))
        else
            host=$((r % HOSTS)) local_rank=$((r / HOSTS))
            on_host=$(((world - host + HOSTS - 1) / HOSTS))
        fi
        env -i PATH="$PATH" RANK="$r" WORLD_SIZE="$world" LOCAL_RANK="$local_rank" \
            LOCAL_WORLD_SIZE="$on_host" MASTER_ADDR=10.216.0.1 MASTER_PORT="$PORT" \
            OXCCL_SOCKET_IFNAME=nv OXCCL_JOB_ID="netns$$" "${settings[@]}" \
            nsenter --net="/run/netns/oxnh-$host" "$@" >"$OUT/rank$r.out" 2>&1 &
        pids+=($!)
    done
    for ((r = 0; r < world; r++)); do
        wait "${pids[$r]}" || { echo "rank $r failed: $OUT/rank$r.out"; failed=1; }
    done
    cat "$OUT/rank0.out"
    return $failed
}

cmd=${1:-}
shift || true
case "$cmd" in
setup | teardown) "$cmd" ;;
run) run "$@" ;;
*)
    sed -n '2,30p' "$0"
    exit 2
    ;;
esac
