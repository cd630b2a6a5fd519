#!/usr/bin/env bash
# compare-mpi.sh — oxccl against Open MPI and against this machine's ceiling,
# side by side in one run.
#
# Builds ../shared/anchors/mpi_coll_bench.c (Open MPI's collectives) and
# ../shared/anchors/shm_ceiling.c (the limit for a 2-process shared-memory
# all-reduce), builds oxccl-perf, then runs all three over the same sizes,
# alternating, REPS times, and prints medians and ratios:
#
#   oxccl / Open MPI   (≥ 1 is ahead)
#   oxccl / ceiling    (zero-copy variant (a), staging-copy variant (b),
#                       one-line flag protocol (d) for the small sizes)
#   oxccl's main column is the placement of Open MPI's call (out of
#   place; broadcast in place, as MPI_Bcast), the other placement beside it;
#   the ceiling's variants run in place, so oxccl's in-place figures are
#   set against them; the core-to-core latency before and after each
#   repetition shows the VM's vCPU placement, which moves all figures
#
# Usage: scripts/compare-mpi.sh [options]
#   --reps N            alternating repetitions (default 3)
#   --max-bytes SIZE    largest size in bytes, K/M/G allowed (default 256M)
#   --colls LIST        allreduce,allgather,reduce_scatter,broadcast (default: all four)
#   --ranks N           ranks (default 2; the ceiling exists for 2 only)
#   --transport shm|tcp oxccl's OXCCL_TRANSPORT and Open MPI's btl (default shm)
#   --transport threads oxccl's ranks as threads of one process (oxccl-perf -t)
#                       against the ceiling alone: Open MPI does not run
#   --anchors DIR       where the C programs are (default ../shared/anchors)
#   --out DIR           raw outputs and the table (default target/compare-mpi)
#   --budget SECONDS    Open MPI's timed seconds per size (default 0.3)
#   --stat median|mean  oxccl's statistic (default median: batches of calls,
#                       each after a barrier, the slowest rank's time per
#                       batch, the median batch, as mpi_coll_bench takes
#                       Open MPI's; mean: nccl-tests' mean over all calls)
#   --paired-budget S   seconds per size and collective of the paired run
#                       (default 0.5; 0: no paired run). After the repetitions, Open MPI and
#                       oxccl run in the same two processes
#                       (examples/mpi_side_by_side.rs), a batch of each in
#                       turn, milliseconds apart, so every pair shares the
#                       vCPU placement; the table's second part is the median
#                       of those pairs' ratios (shm and tcp only)
#   --offset BYTES      where the paired run's buffers start within a cache
#                       line (default 0, as oxccl-perf's and PyTorch's; 16 is
#                       where malloc puts a large Vec or mpi_coll_bench's)
#
# Needs gcc, Open MPI (mpicc, mpirun; installed with apt-get when missing and
# run as root; not with --transport threads), python3 and cargo. Takes about REPS × 1–3 minutes at 256 MiB.
set -euo pipefail

REPS=3
MAX_BYTES=268435456
COLLS=allreduce,allgather,reduce_scatter,broadcast
RANKS=2
TRANSPORT=shm
BUDGET=0.3
STAT=median
PAIRED_BUDGET=0.5
OFFSET=0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ANCHORS="$ROOT/../shared/anchors"
OUT="$ROOT/target/compare-mpi"

while [ $# -gt 0 ]; do
    case "$1" in
    --reps) REPS="$2"; shift 2 ;;
    --max-bytes) MAX_BYTES="$2"; shift 2 ;;
    --colls) COLLS="$2"; shift 2 ;;
    --ranks) RANKS="$2"; shift 2 ;;
    --transport) TRANSPORT="$2"; shift 2 ;;
    --anchors) ANCHORS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --stat) STAT="$2"; shift 2 ;;
    --paired-budget) PAIRED_BUDGET="$2"; shift 2 ;;
    --offset) OFFSET="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare-mpi.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$TRANSPORT" in shm|tcp|threads) ;; *) echo "compare-mpi.sh: --transport shm, tcp or threads" >&2; exit 2 ;; esac
case "$STAT" in median|mean) ;; *) echo "compare-mpi.sh: --stat median or mean" >&2; exit 2 ;; esac
# A number of seconds (0 skips the paired run, whatever way it is written).
if ! awk -v b="$PAIRED_BUDGET" 'BEGIN { exit !(b ~ /^[0-9]*\.?[0-9]+$|^[0-9]+\.$/) }'; then
    echo "compare-mpi.sh: --paired-budget takes seconds (0: no paired run)" >&2
    exit 2
fi
PAIRED=$(awk -v b="$PAIRED_BUDGET" 'BEGIN { print (b + 0 > 0) ? 1 : 0 }')
# A size with a K/M/G suffix in bytes; mpi_coll_bench reads digits only
# (strtoull: "64M" was 64 bytes, and its buffers overflowed at 1 KiB).
case "$MAX_BYTES" in
*[kK]) MAX_BYTES=$((${MAX_BYTES%?} << 10)) ;;
*[mM]) MAX_BYTES=$((${MAX_BYTES%?} << 20)) ;;
*[gG]) MAX_BYTES=$((${MAX_BYTES%?} << 30)) ;;
esac
case "$MAX_BYTES" in
'' | *[!0-9]*) echo "compare-mpi.sh: --max-bytes takes bytes, optionally with K, M or G" >&2; exit 2 ;;
esac
# Both programs always run 8 B, 1 KiB and 4 KiB, and mpi_coll_bench sizes
# its buffers by the largest: below 4 KiB it would write past them.
if [ "$MAX_BYTES" -lt 4096 ]; then
    echo "compare-mpi.sh: --max-bytes must be at least 4K (the sizes start at 8 B, 1 KiB, 4 KiB)" >&2
    exit 2
fi
NEEDED=(mpi_coll_bench.c shm_ceiling.c)
[ "$TRANSPORT" != threads ] || NEEDED=(shm_ceiling.c)
for f in "${NEEDED[@]}"; do
    [ -f "$ANCHORS/$f" ] || { echo "compare-mpi.sh: $ANCHORS/$f not found (use --anchors DIR)" >&2; exit 2; }
done

if [ "$TRANSPORT" != threads ] && { ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "# installing Open MPI (apt-get)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
    else
        echo "compare-mpi.sh: needs mpicc and mpirun (apt-get install openmpi-bin libopenmpi-dev)" >&2
        exit 2
    fi
fi

# Open MPI's benchmark gives every rank cnt / nranks elements of its
# all-gather and reduce-scatter and checks with that division: 8 B (two
# floats) over more than two ranks is a division by zero there, and a rank
# count that does not divide a size moves fewer bytes than it reports.
case ",$COLLS," in
    *,allgather,*|*,reduce_scatter,*)
        if [ "$RANKS" -gt 2 ] && [ "$TRANSPORT" != threads ]; then
            echo "compare-mpi.sh: --ranks $RANKS with allgather or reduce_scatter: Open MPI's benchmark" \
                "cannot split 8 B over more than 2 ranks; use --colls allreduce,broadcast," \
                "or oxccl-perf alone (docs/performance.md, 4 ranks on 2 cores)" >&2
            exit 2
        fi ;;
esac

mkdir -p "$OUT/bin" "$OUT/raw"
# Earlier runs' curves must not reappear in this run's plots.
rm -rf "$OUT"/raw/* "$OUT/plot"
[ "$TRANSPORT" = threads ] || mpicc -O2 -o "$OUT/bin/mpi_coll_bench" "$ANCHORS/mpi_coll_bench.c" -lm
gcc -O3 -march=native -Wall -o "$OUT/bin/shm_ceiling" "$ANCHORS/shm_ceiling.c" -lpthread -lm
(cd "$ROOT" && cargo build --release --quiet --bin oxccl-perf)
PERF="$ROOT/target/release/oxccl-perf"
[ "$TRANSPORT" != tcp ] || (cd "$ROOT" && cargo build --release --quiet --example tcp_stream_probe)

# The sizes of mpi_coll_bench: 8 B, 1 KiB, then 4 KiB × 4^k up to MAX_BYTES.
SIZES="8,1024"
s=4096
while [ "$s" -le "$MAX_BYTES" ]; do SIZES="$SIZES,$s"; s=$((s * 4)); done
# oxccl-perf times a fixed number of iterations per size, so the sizes run
# in three groups, each with enough iterations to last milliseconds (Open
# MPI's benchmark times batches of at least 2 ms for --budget seconds).
# The table below reads the same bounds (its group_of).
SMALL_MAX_BYTES=65536
MEDIUM_MAX_BYTES=4194304
SMALL=$(echo "$SIZES" | tr , '\n' | awk -v s=$SMALL_MAX_BYTES '$1 <= s' | paste -sd,)
MEDIUM=$(echo "$SIZES" | tr , '\n' |
    awk -v s=$SMALL_MAX_BYTES -v m=$MEDIUM_MAX_BYTES '$1 > s && $1 <= m' | paste -sd,)
LARGE=$(echo "$SIZES" | tr , '\n' | awk -v m=$MEDIUM_MAX_BYTES '$1 > m' | paste -sd,)
# Iterations (-n), samples (--samples) and warm-up (-w) per group. 20000
# small calls last 2–200 ms (2000 lasted 0.2 ms at 8 B, short enough for
# one scheduler tick or placement change to move the median). With
# --stat median the calls run in batches (small: 10 of 2000 calls; medium:
# 20 of 10; large: one call each, as mpi_coll_bench's batch of 1 beyond
# 2 ms), and the median batch is reported, as Open MPI's figure is; with
# --stat mean one batch of all of them (nccl-tests' mean).
samples() { if [ "$STAT" = median ]; then echo "$1"; else echo 1; fi; }
SMALL_ITERS=(-n 20000 --samples "$(samples 10)" -w 2000)
MEDIUM_ITERS=(-n 200 --samples "$(samples 20)" -w 10)
LARGE_ITERS=(-n 10 --samples "$(samples 10)" -w 3)
# alloc_shared up to 4 MiB: zero copy takes 1–2 µs at 64 KiB, so 100
# calls lasted 0.1–0.2 ms and one repetition's 64 KiB figure ranged over
# 0.83–1.97 µs (stop 23's run); 2000 last 2–100 ms.
SHARED_MEDIUM_ITERS=(-n 2000 --samples "$(samples 10)" -w 200)
# Threads run the same batches: at 256 KiB and 1 MiB in place, five
# alternating rounds of batches of 10 calls (as here) read 62–77 and
# 59–88 GB/s, of 400 calls 61–95 and 57–76 (stop 38), so the barrier
# before each batch does not weigh.
# alloc_shared runs from 64 KiB, where the targets against (a) start.
SHARED=$(echo "$SIZES" | tr , '\n' | awk '$1 >= 65536' | paste -sd,)

# One core per rank, as oxccl-perf -np's ranks run where there are as many
# CPUs as ranks (its --bind-to auto gives each rank its share of the CPUs:
# one each on the 2-CPU VM of docs/performance.md); with more ranks than
# cores mpirun refuses to bind unless told it may overload them.
BIND=core
if [ "$RANKS" -gt "$(nproc)" ]; then BIND=core:overload-allowed; fi
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to "$BIND" -np "$RANKS")
if [ "$TRANSPORT" = tcp ]; then
    MPIRUN+=(--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo)
fi

oxccl_name() {  # mpi_coll_bench's collective name -> oxccl-perf's
    case "$1" in allreduce) echo all_reduce ;; allgather) echo all_gather ;; *) echo "$1" ;; esac
}

# Open MPI's benchmark for one size group: run_mpi REP COLLECTIVE GROUP.
# It always starts at 8 B, so it runs every size up to the group's largest
# (the smaller groups' sizes again, about a second each group); the table
# takes from raw/mpi-REP-COLL-GROUP.txt only the group's own sizes.
run_mpi() {
    local sizes=${GROUP_SIZES[$3]} max
    [ -n "$sizes" ] && [ "$TRANSPORT" != threads ] || return 0
    max=${sizes##*,}
    # Its largest size must be at least its first step (4 KiB).
    [ "$max" -ge 4096 ] || max=4096
    COLLS="$2" "${MPIRUN[@]}" "$OUT/bin/mpi_coll_bench" "ompi-$TRANSPORT" "$max" "$BUDGET" \
        >"$OUT/raw/mpi-$1-$2-$3.txt" 2>"$OUT/raw/mpi-$1-$2-$3.err" || {
        echo "compare-mpi.sh: Open MPI's benchmark failed (repetition $1, $2, $3 sizes); its errors:" >&2
        tail -n 15 "$OUT/raw/mpi-$1-$2-$3.err" >&2
        exit 1
    }
}

# The ceiling's buffers are sized by its first argument (MiB). Its
# zero-copy variant (a) ran at 13-14 GB/s at every size with 256 MiB ones
# on the Zen 4 VM of docs/performance.md, against 87-90 GB/s at 64 KiB,
# 76-86 at 1 MiB and 38-40 at 16 MiB with 64 or 128 MiB ones ((b) alike
# either way): sizes up to 128 MiB run with buffers of 128 MiB (or the
# largest size, if smaller), larger ones with buffers of MAX_BYTES.
CEILING_SPLIT=$((128 << 20))
run_ceiling() {
    if [ "$TRANSPORT" != tcp ] && [ "$RANKS" = 2 ]; then
        local low high low_max
        low=$(echo "$SIZES" | tr , '\n' | awk -v s=$CEILING_SPLIT '$1 <= s' | paste -sd,)
        high=$(echo "$SIZES" | tr , '\n' | awk -v s=$CEILING_SPLIT '$1 > s' | paste -sd,)
        low_max=$((MAX_BYTES < CEILING_SPLIT ? MAX_BYTES : CEILING_SPLIT))
        : >"$OUT/raw/ceiling-$1.txt"
        if [ -n "$low" ]; then
            "$OUT/bin/shm_ceiling" $(((low_max + (1 << 20) - 1) >> 20)) 0.3 a,b,d "$low" \
                >>"$OUT/raw/ceiling-$1.txt" 2>"$OUT/raw/ceiling-$1.err" || true
        fi
        if [ -n "$high" ]; then
            "$OUT/bin/shm_ceiling" $(((MAX_BYTES + (1 << 20) - 1) >> 20)) 0.3 a,b,d "$high" \
                >>"$OUT/raw/ceiling-$1.txt" 2>>"$OUT/raw/ceiling-$1.err" || true
        fi
    fi
}

# One oxccl-perf run per size group: run_perf REP NAME SIZES ITERS... -- ARGS...
run_perf() {
    local rep=$1 label=$2 sizes=$3
    shift 3
    [ -n "$sizes" ] || return 0
    local iters=()
    while [ "$1" != -- ]; do iters+=("$1"); shift; done
    shift
    # -a 3: the slowest rank's time, as mpi_coll_bench takes it (oxccl-perf's
    # default is nccl-tests' mean over the ranks). With --stat median (the
    # default) per batch, the median batch reported, as mpi_coll_bench does;
    # with --stat mean, the mean over all -n calls (nccl-tests'), which keeps
    # every preemption that a median drops: it leans against oxccl, most
    # where calls are short.
    # The placement before and after each group goes to
    # raw/groups-REP.txt: a group lasts seconds where a collective's runs
    # last minutes, so the ratios against the ceiling pair by group.
    echo "$label before $(placement)" >>"$OUT/raw/groups-$rep.txt"
    # Threads: oxccl-perf -t, with no OXCCL_TRANSPORT (it names the links
    # between processes; an empty one is refused).
    local ranks=(-np "$RANKS") transport=OXCCL_TRANSPORT=$TRANSPORT
    if [ "$TRANSPORT" = threads ]; then ranks=(-t "$RANKS"); transport=-uOXCCL_TRANSPORT; fi
    env "$transport" "$PERF" "${ranks[@]}" "$@" --sizes "$sizes" "${iters[@]}" -c 1 -a 3 \
        -J "$OUT/raw/oxccl-$rep-$label.json" >"$OUT/raw/oxccl-$rep-$label.txt" 2>&1 || {
        echo "compare-mpi.sh: oxccl-perf failed (repetition $rep, $label); its output:" >&2
        tail -n 15 "$OUT/raw/oxccl-$rep-$label.txt" >&2
        exit 1
    }
    echo "$label after $(placement)" >>"$OUT/raw/groups-$rep.txt"
}

# oxccl-perf for one size group: run_oxccl REP COLLECTIVE GROUP
run_oxccl() {
    local name
    name=$(oxccl_name "$2")
    case "$3" in
    small) run_perf "$1" "$2-small" "$SMALL" "${SMALL_ITERS[@]}" -- --collective "$name" ;;
    medium) run_perf "$1" "$2-medium" "$MEDIUM" "${MEDIUM_ITERS[@]}" -- --collective "$name" ;;
    large) run_perf "$1" "$2-large" "$LARGE" "${LARGE_ITERS[@]}" -- --collective "$name" ;;
    esac
}

# All-reduce on buffers from Communicator::alloc_shared (zero copy across
# processes), the counterpart of the ceiling's variant (a): run_shared REP
run_shared() {
    if [ "$TRANSPORT" = shm ] && [ -n "$SHARED" ]; then
        local mid big
        mid=$(echo "$SHARED" | tr , '\n' | awk -v m=$MEDIUM_MAX_BYTES '$1 <= m' | paste -sd,)
        big=$(echo "$SHARED" | tr , '\n' | awk -v m=$MEDIUM_MAX_BYTES '$1 > m' | paste -sd,)
        run_perf "$1" allreduce_shared-medium "$mid" "${SHARED_MEDIUM_ITERS[@]}" -- --shared
        run_perf "$1" allreduce_shared-large "$big" "${LARGE_ITERS[@]}" -- --shared
    fi
}

# The three size groups, each run by both sides before the next: a pair
# lasts seconds (a large group at 256 MiB, under a minute), not the
# minutes of a whole collective, so fewer pairs straddle a placement move.
declare -A GROUP_SIZES=([small]="$SMALL" [medium]="$MEDIUM" [large]="$LARGE")

# The placement of the two vCPUs: the ceiling's one-way cache-line latency
# between its two processes (≈ 40–60 ns "near", ≈ 200 ns "far" on the VMs
# of docs/performance.md, where cross-core copies also run several times
# slower). It moves while a run goes on; printed before and after every
# repetition so a reader can tell which figures share a placement.
placement() {
    "$OUT/bin/shm_ceiling" 1 0.01 d 8 2>/dev/null | awk '/C2C/ {print $6 " ns"}' || true
}

# Loopback TCP runs in two regimes on the VM of docs/performance.md (stop
# 40): every bulk transfer, a plain program's as much as oxccl's or Open
# MPI's, takes about twice as long in the slow one, which comes and goes
# every few seconds: it is the far vCPU placement, where the socket
# buffers' lines cross between dies (stop 41). A plain stream's time per
# 8 MiB message
# (examples/tcp_stream_probe.rs: about 2-3 ms fast, 4.5-6 ms slow there),
# read before and after each repetition and the paired run, tells which
# regime TCP figures came from.
tcp_stream_us() {  # "?" if the probe failed (its errors: raw/tcp_stream.err)
    "$ROOT/target/release/examples/tcp_stream_probe" 8388608 10 3 2>>"$OUT/raw/tcp_stream.err" |
        awk -F, '/^TCP_STREAM,/ {printf "%.0f", $5; ok = 1} END {if (!ok) printf "?"}' || true
}
tcp_regime() {
    [ "$TRANSPORT" = tcp ] || return 0
    echo "; plain TCP stream $(tcp_stream_us) µs per 8 MiB message"
}

echo "# compare-mpi: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "# ranks $RANKS, transport $TRANSPORT, sizes $SIZES, $REPS alternating repetitions"
for rep in $(seq 1 "$REPS"); do
    echo "# repetition $rep: core-to-core latency before: $(placement)$(tcp_regime)"
    # Alternate the order between repetitions, so drift hits everyone alike.
    # Collective by collective and size group by size group, so oxccl and
    # Open MPI run seconds apart (the vCPU placement can change between).
    # The placement before, between and after each pair goes to
    # raw/placement-REP-COLL-GROUP.txt: the per-repetition ratios leave
    # out pairs whose placement changed on the way.
    [ $((rep % 2)) = 1 ] || run_ceiling "$rep"
    for c in ${COLLS//,/ }; do
        for group in small medium large; do
            [ -n "${GROUP_SIZES[$group]}" ] || continue
            p1=$(placement)
            if [ $((rep % 2)) = 1 ]; then
                run_oxccl "$rep" "$c" "$group"; p2=$(placement); run_mpi "$rep" "$c" "$group"
            else
                run_mpi "$rep" "$c" "$group"; p2=$(placement); run_oxccl "$rep" "$c" "$group"
            fi
            echo "$p1 $p2 $(placement)" | tr -d 'ns' >"$OUT/raw/placement-$rep-$c-$group.txt"
        done
        [ "$c" != allreduce ] || run_shared "$rep"
    done
    [ $((rep % 2)) = 0 ] || run_ceiling "$rep"
    echo "# repetition $rep done; core-to-core latency after: $(placement)$(tcp_regime)"
    # Which slot stores oxccl's arena chose at each run's set-up (they
    # follow the placement; oxccl-perf's header has the measurement), and
    # in how many runs it measured again because the cores moved (the
    # footer's "Transport at the end", printed when the arena changed).
    stores=$(grep -h '^# oxccl-perf:' "$OUT"/raw/oxccl-"$rep"-*.txt 2>/dev/null |
        sed -n 's/.*arena: \([a-z]*\) slot stores.*/\1/p' | sort | uniq -c |
        awk '{printf "%s%s ×%s", sep, $2, $1; sep=", "}')
    # (grep -l finds none in most repetitions: its status 1 must not end
    # the script under pipefail.)
    moved=$({ grep -l '^# Transport at the end.*after the round trip changed' \
        "$OUT"/raw/oxccl-"$rep"-*.txt 2>/dev/null || true; } | wc -l)
    [ -z "$stores" ] || echo "# repetition $rep: oxccl's slot stores: $stores; runs that measured again after a move: $moved"
done

python3 - "$OUT" "$COLLS" "$TRANSPORT" "$STAT" "$SMALL_MAX_BYTES" "$MEDIUM_MAX_BYTES" <<'PY' | tee "$OUT/table.md"
import glob, json, os, re, statistics, sys
out, colls, transport, stat = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
ox, mpi, ceil = {}, {}, {}
# (rep, coll, bytes) -> the label of the oxccl-perf run (size group) that
# measured it; (rep, label) -> the latencies read before and after that run.
ox_group, group_lat = {}, {}
# Per repetition, for ratios of runs made side by side: (coll, bytes) ->
# {rep: figures}.
ox_rep, mpi_rep = {}, {}
for path in glob.glob(os.path.join(out, "raw", "oxccl-*.json")):
    name = re.match(r"oxccl-(\d+)-(\w+)-(small|medium|large)\.json", os.path.basename(path))
    rep, coll = int(name.group(1)), name.group(2)
    run = json.load(open(path))
    for row in run["rows"]:
        ox_group[(rep, coll, row["bytes"])] = f"{coll}-{name.group(3)}"
        ox_rep.setdefault((coll, row["bytes"]), {})[rep] = {
            "oop": row["busbw"], "ip": row["busbw_ip"],
            "time_oop": row["time_us"], "time_ip": row["time_us_ip"]}
        # Both placements count as samples; nccl-tests reports both columns.
        key = (coll, row["bytes"])
        ox.setdefault(key, {"busbw": [], "time": [], "algo": row["algo"], "oop": [], "ip": [],
                            "time_ip": [], "time_oop": []})
        ox[key]["busbw"] += [row["busbw"], row["busbw_ip"]]
        ox[key]["oop"].append(row["busbw"])
        ox[key]["ip"].append(row["busbw_ip"])
        ox[key]["time"] += [row["time_us"], row["time_us_ip"]]
        ox[key]["time_ip"].append(row["time_us_ip"])
        ox[key]["time_oop"].append(row["time_us"])
        if row["wrong"] or row["wrong_ip"]:
            sys.exit(f"oxccl-perf reported wrong values in {path}")
# The size groups of both sides' runs (oxccl-perf's -small, -medium,
# -large; the script's SMALL, MEDIUM and LARGE).
SMALL_MAX, MEDIUM_MAX = int(sys.argv[5]), int(sys.argv[6])
def group_of(b):
    return "small" if b <= SMALL_MAX else "medium" if b <= MEDIUM_MAX else "large"
for path in glob.glob(os.path.join(out, "raw", "mpi-*.txt")):
    name = re.match(r"mpi-(\d+)-\w+-(small|medium|large)\.txt", os.path.basename(path))
    rep, group = int(name.group(1)), name.group(2)
    for line in open(path):
        if line.startswith("RESULT,"):
            f = line.strip().split(",")
            # A group's run starts at 8 B: the smaller groups' sizes in it
            # belong to their own groups' runs.
            if group_of(int(f[3])) != group:
                continue
            # Field 11: the benchmark's own check of its first call.
            if f[11] != "ok":
                sys.exit(f"Open MPI's benchmark failed its check in {path}: {line.strip()}")
            key = (f[2], int(f[3]))
            mpi_rep.setdefault(key, {})[rep] = {"busbw": float(f[6]), "time": float(f[4])}
            mpi.setdefault(key, {"busbw": [], "time": []})
            mpi[key]["busbw"].append(float(f[6]))
            mpi[key]["time"].append(float(f[4]))
# Per repetition as well, with the core-to-core latencies the ceiling read
# before and after each figure: (variant, bytes) -> {rep: figures}.
ceil_rep = {}
for path in glob.glob(os.path.join(out, "raw", "ceiling-*.txt")):
    rep = int(re.match(r"ceiling-(\d+)\.txt", os.path.basename(path)).group(1))
    for line in open(path):
        m = re.match(r"AR (\w) +(\d+) +time_us +([\d.]+).*busbw_GBs +([\d.]+).*check (\w+)", line)
        if m and m.group(5) != "ok":
            sys.exit(f"the ceiling failed its check in {path}: {line.strip()}")
        if m:
            key = (m.group(1), int(m.group(2)))
            ceil.setdefault(key, {"busbw": [], "time": []})
            ceil[key]["busbw"].append(float(m.group(4)))
            ceil[key]["time"].append(float(m.group(3)))
            c2c = re.search(r"c2c_ns +([\d.]+) +([\d.]+)", line)
            ceil_rep.setdefault(key, {})[rep] = {
                "busbw": float(m.group(4)), "time": float(m.group(3)),
                "c2c": [float(c2c.group(1)), float(c2c.group(2))] if c2c else []}
# (rep, coll, group) -> whether the placement held through that pair of
# runs: the core-to-core latencies before, between and after it within
# 1.6× of each other ("near" and "far" differ 3-5× on the VMs measured).
steady = {}
for path in glob.glob(os.path.join(out, "raw", "groups-*.txt")):
    rep = int(re.match(r"groups-(\d+)\.txt", os.path.basename(path)).group(1))
    for line in open(path):
        f = line.split()
        try:
            group_lat.setdefault((rep, f[0]), {})[f[1]] = float(f[2])
        except (IndexError, ValueError):
            continue
for path in glob.glob(os.path.join(out, "raw", "placement-*.txt")):
    m = re.match(r"placement-(\d+)-(\w+)-(small|medium|large)\.txt", os.path.basename(path))
    try:
        lat = [float(x) for x in open(path).read().split()]
    except ValueError:
        continue
    if len(lat) == 3 and min(lat) > 0:
        steady[(int(m.group(1)), m.group(2), m.group(3))] = max(lat) / min(lat) < 1.6
med = lambda xs: statistics.median(xs) if xs else None
def size(b):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"
def fmt(x, unit=""):
    return "—" if x is None else f"{x:.2f}{unit}"
def ratio(a, b):
    return "—" if a is None or b in (None, 0) else f"{a / b:.2f}×"
print(f"\n## oxccl vs Open MPI ({transport}) and the shared-memory ceiling — busbw GB/s (time in µs up to 1 KiB), medians\n")
if transport == "threads":
    print("oxccl's ranks are threads of one process; Open MPI does not run (its columns stay empty).\n")
print("`oxccl` is the placement of Open MPI's call (out of place; broadcast in place, as")
print("`MPI_Bcast`), `other` the other placement. The ceiling's variants run in place.\n")
# Open MPI's benchmark calls MPI_Allreduce, MPI_Allgather and
# MPI_Reduce_scatter_block with separate buffers and MPI_Bcast in place.
def like_mpi(coll):
    return "ip" if coll == "broadcast" else "oop"
def figure(key, placement, small):
    entry = ox.get(key, {})
    if small:
        return med(entry.get("time_ip" if placement == "ip" else "time_oop", []))
    return med(entry.get(placement, []))
def faster(a, b, small):
    """a over b, above 1 when a is ahead (for times: b takes longer)."""
    return ratio(b, a) if small else ratio(a, b)
def paired(key, placement, small):
    """The median over repetitions of oxccl / Open MPI within each one:
    the two ran the size's group seconds apart there, so a vCPU placement
    that changed between repetitions does not pair one side's near figure
    with the other's far one. Pairs whose placement changed on the way
    (see `steady`) are left out while others remain; "(k/n)" says how
    many of the n pairs counted when some were left out."""
    # A placement not read (the probe printed nothing) is not known to
    # have held.
    return within_repetitions(key, placement, small, mpi_rep.get(key, {}),
                              lambda rep: steady.get((rep, key[0], group_of(key[1])), False))
def within_repetitions(key, placement, small, theirs, held_in):
    """oxccl's figures (`key`, `placement`) over `theirs` ({rep: figures})
    within each repetition, summarised by `held_median` over the
    repetitions where `held_in(rep)`: above 1 when oxccl is ahead (for
    times, `small`: when the other takes longer)."""
    o = ox_rep.get(key, {})
    values, held = [], []
    for rep in sorted(set(o) & set(theirs)):
        a = o[rep][("time_" if small else "") + placement]
        b = theirs[rep]["time" if small else "busbw"]
        if a and b:
            values.append(b / a if small else a / b)
            held.append(held_in(rep))
    return held_median(values, held)
def held_median(values, held):
    """The median of the `values` whose pair `held`, "(k/n)" beside it
    when some did not; every value, "(0/n, all used)", when none did."""
    if not values:
        return "—"
    kept = [v for v, h in zip(values, held) if h]
    if not kept:
        # No pair held its placement: every pair, and the table says so.
        return f"{statistics.median(values):.2f}× (0/{len(values)}, all used)"
    note = f" ({len(kept)}/{len(values)})" if len(kept) < len(values) else ""
    return f"{statistics.median(kept):.2f}×{note}"
def oxccl_window(rep, key):
    """The latencies read around oxccl's run that measured `key` in
    repetition `rep`: before and after its size group (raw/groups-REP.txt),
    only before it up to SMALL_MAX (those sizes run in its first
    seconds)."""
    group = group_lat.get((rep, ox_group.get((rep,) + key, "")), {})
    if "before" not in group:
        return []
    if key[1] <= SMALL_MAX or "after" not in group:
        return [group["before"]]
    return [group["before"], group["after"]]
def against_ceiling(key, variant, placement, small):
    """oxccl (`key`, `placement`) against the ceiling's `variant` at the
    same size, as the median over repetitions of the ratio within each
    one, over those where oxccl's run and the ceiling's figure saw the
    same placement (every latency read around both within 1.6× of each
    other): the ceiling runs minutes away from oxccl's all-reduce, and a
    near figure over a far one says nothing. "(k/n)" as in `paired`."""
    c = ceil_rep.get((variant, key[1]), {})
    def held_in(rep):
        # Readings missing on either side: not known to have held.
        window, own = oxccl_window(rep, key), c[rep]["c2c"]
        lat = window + own
        return bool(window) and bool(own) and min(lat) > 0 and max(lat) / min(lat) < 1.6
    return within_repetitions(key, placement, small, c, held_in)
for coll in colls:
    print(f"### {coll}\n")
    like = like_mpi(coll)
    other = "oop" if like == "ip" else "ip"
    names = {"ip": "in place", "oop": "out of place"}
    head = (f"| size | algo | oxccl ({names[like]}) | other ({names[other]}) | Open MPI"
            f" | oxccl / MPI | other / MPI | oxccl / MPI per repetition |")
    sep = "|---:|---|---:|---:|---:|---:|---:|---:|"
    with_ceiling = coll == "allreduce" and ceil
    if with_ceiling:
        head += " (a) zero copy | (b) staging | (d) flag | in place / (a) | in place / (b) |"
        head += " in place / (d) | alloc_shared in place | alloc_shared / (a) |"
        sep += "---:|---:|---:|---:|---:|---:|---:|---:|"
    print(head)
    print(sep)
    for b in sorted({k[1] for k in ox if k[0] == coll} | {k[1] for k in mpi if k[0] == coll}):
        small = b <= 1024
        u = " µs" if small else ""
        o = figure((coll, b), like, small)
        x = figure((coll, b), other, small)
        m = med(mpi.get((coll, b), {}).get("time" if small else "busbw", []))
        algo = ox.get((coll, b), {}).get("algo", "—")
        line = (f"| {size(b)} | {algo} | {fmt(o, u)} | {fmt(x, u)} | {fmt(m, u)} |"
                f" {faster(o, m, small)} | {faster(x, m, small)} | {paired((coll, b), like, small)} |")
        if with_ceiling:
            pick = "time" if small else "busbw"
            ca = med(ceil.get(("a", b), {}).get(pick, []))
            cb = med(ceil.get(("b", b), {}).get(pick, []))
            cd = med(ceil.get(("d", b), {}).get(pick, []))
            si = figure(("allreduce_shared", b), "ip", small)
            line += (f" {fmt(ca, u)} | {fmt(cb, u)} | {fmt(cd, u)}"
                     f" | {against_ceiling((coll, b), 'a', 'ip', small)}"
                     f" | {against_ceiling((coll, b), 'b', 'ip', small)}"
                     f" | {against_ceiling((coll, b), 'd', 'ip', small)} | {fmt(si, u)}"
                     f" | {against_ceiling(('allreduce_shared', b), 'a', 'ip', small)} |")
        print(line)
    print()
print("Ratios above 1× mean oxccl is ahead (for times: the other takes longer).")
print("`oxccl / MPI per repetition` is the median of the ratios taken within each")
print("repetition, where the two ran seconds apart (size group by size group:")
print("up to 64 KiB, 256 KiB–4 MiB, larger), over the pairs whose vCPU placement")
print("held (core-to-core latency before, between and after the pair within")
print("1.6×; \"(k/n)\": k of n pairs held); the columns before it divide medians")
print("taken over all repetitions.")
print("Within a repetition Open MPI's figure is the median over its samples")
print("(batches) of the slowest rank's time, and")
if stat == "median":
    print("oxccl's the same statistic (--stat median).")
else:
    print("oxccl's the slowest rank's mean over all its calls (--stat mean,")
    print("nccl-tests' statistic), which keeps the preemptions a median drops.")
if ceil_rep:
    print("The ratios against the ceiling (`in place / (a)`, `/ (b)`, `/ (d)` and")
    print("`alloc_shared / (a)`) are medians of ratios within each repetition too,")
    print("over those where the latencies read around oxccl's run of that size")
    print("(up to 64 KiB the one read as it started) and the two the ceiling")
    print("read around its figure agree within 1.6× (the ceiling runs minutes")
    print("away from oxccl, so only a shared placement makes a pair).")

# The medians as oxccl-perf JSON, one file per curve, for `--plot`.
def dump(name, label, rows):
    # A placement not measured (None) is left out, and not drawn.
    with open(os.path.join(out, "plot", name), "w") as f:
        json.dump({"tool": "compare-mpi", "label": label, "rows": [
            {k: v for k, v in (("bytes", b), ("busbw", oop), ("busbw_ip", ip)) if v is not None}
            for b, oop, ip in rows]}, f)
os.makedirs(os.path.join(out, "plot"), exist_ok=True)
for coll in colls:
    sizes = sorted(b for c, b in ox if c == coll)
    dump(f"{coll}-oxccl.json", f"oxccl {coll} ({transport})",
         [(b, med(ox[(coll, b)]["oop"]), med(ox[(coll, b)]["ip"])) for b in sizes])
    msizes = sorted(b for c, b in mpi if c == coll)
    if msizes:  # none with --transport threads
        dump(f"{coll}-ompi.json", f"Open MPI {coll} ({transport})",
             # MPI_Bcast runs in place, the others out of place.
             [(b, None, med(mpi[(coll, b)]["busbw"])) if coll == "broadcast"
              else (b, med(mpi[(coll, b)]["busbw"]), None) for b in msizes])
    if coll == "allreduce":
        ssizes = sorted(b for c, b in ox if c == "allreduce_shared")
        if ssizes:
            dump(f"{coll}-oxccl-shared.json", f"oxccl {coll} (alloc_shared buffers)",
                 [(b, med(ox[("allreduce_shared", b)]["oop"]), med(ox[("allreduce_shared", b)]["ip"]))
                  for b in ssizes])
        for v, name in (("a", "zero copy"), ("b", "staging copy")):
            csizes = sorted(b for vv, b in ceil if vv == v)
            if csizes:
                dump(f"{coll}-ceiling-{v}.json", f"ceiling ({v}) {name}",
                     [(b, None, med(ceil[(v, b)]["busbw"])) for b in csizes])
PY
for c in ${COLLS//,/ }; do
    args=()
    for f in "$OUT/plot/$c"-*.json; do args+=(--compare "$f"); done
    "$PERF" --plot "$OUT/$c.svg" --plot-only "${args[@]}" >/dev/null
done
echo "# plots: $OUT/<collective>.svg (busbw against size, oxccl beside Open MPI and the ceiling)"

# Open MPI and oxccl in the same two processes, batch against batch: the
# pairs above run seconds apart and many straddle a placement move; these
# run milliseconds apart on the same buffers (examples/mpi_side_by_side.rs
# has the method).
if [ "$TRANSPORT" != threads ] && [ "$PAIRED" = 1 ]; then
    (cd "$ROOT" && cargo build --release --quiet --example mpi_side_by_side)
    # A port free on every address, where oxccl's store listens.
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
    [ "$TRANSPORT" != tcp ] || stream_before=$(tcp_stream_us)
    OXCCL_TRANSPORT=$TRANSPORT MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        "${MPIRUN[@]}" -x OXCCL_TRANSPORT -x MASTER_ADDR -x MASTER_PORT \
        "$ROOT/target/release/examples/mpi_side_by_side" --colls "$COLLS" --sizes "$SIZES" \
        --budget "$PAIRED_BUDGET" --offset "$OFFSET" >"$OUT/raw/paired.txt" 2>"$OUT/raw/paired.err" || {
        echo "compare-mpi.sh: the paired run failed; its errors:" >&2
        tail -n 15 "$OUT/raw/paired.err" >&2
        exit 1
    }
    # (A header line of the run, so the table lists it.)
    [ "$TRANSPORT" != tcp ] || echo "# a plain TCP stream's 8 MiB messages took" \
        "$stream_before µs before the run, $(tcp_stream_us) µs after it" >>"$OUT/raw/paired.txt"
    python3 - "$OUT/raw/paired.txt" "$COLLS" "$TRANSPORT" "$OFFSET" <<'PY' | tee -a "$OUT/table.md"
import sys
path, colls, transport, offset = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
cells, header = {}, []
for line in open(path):
    if line.startswith("# ") and not line.startswith("# PAIRED"):
        header.append(line[2:].strip())
    if not line.startswith("PAIRED,"):
        continue
    _, coll, size, batch, pairs, mpi_us, ox_us, ratio, q1, q3, check = line.strip().split(",")
    if check != "ok":
        sys.exit(f"compare-mpi.sh: the paired run reported wrong values ({check}): {line.strip()}")
    cells[(coll, int(size))] = (float(ratio), float(q1), float(q3), int(pairs), float(mpi_us), float(ox_us))
def size_name(b):
    for unit, s in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << s and b % (1 << s) == 0:
            return f"{b >> s} {unit}"
    return f"{b} B"
print(f"\n### Open MPI and oxccl in the same processes ({transport}, buffers {offset} bytes past a cache line)\n")
for h in header:
    print(f"- {h}")
print("\nOpen MPI's time / oxccl's per pair of batches run back to back on the same buffers,")
print("median over the pairs (quartiles); above 1× oxccl is ahead. oxccl out of place,")
print("broadcast in place (as MPI_Bcast).\n")
if not cells:
    print("(no size fits: all-gather and reduce-scatter need sizes the ranks divide)")
print("| size | " + " | ".join(colls) + " |")
print("|---:|" + "---:|" * len(colls))
for size in sorted({b for _, b in cells}):
    row = []
    for c in colls:
        v = cells.get((c, size))
        row.append("" if v is None else f"{v[0]:.2f}× ({v[1]:.2f}–{v[2]:.2f})")
    print(f"| {size_name(size)} | " + " | ".join(row) + " |")
PY
fi
echo "# table written to $OUT/table.md; raw outputs in $OUT/raw"
