#!/usr/bin/env bash
# bench_snapshot.sh - the snapshot sidecar's benchmarks (docs/BENCHMARKS.md, "Snapshot sidecar"):
#   1. take(): blocking time per step next to one memcpy of the state (same run), the overwrite
#      right after a take() (copy-on-write), the background encode/send, ratio and lossy error, for
#      FP16 weights with sparse steps (1 % changed) and for a dense FP16 Adam moment
#   2. restore(): from the home copy, from a replica on the rank's new node, over TCP from the
#      replicas (a replacement daemon)
#   3. node loss by phase (detection, agreement, rebuild, restore; p50/p99 over repeated SIGKILLs)
#      on N-node loopback clusters, for the suspicion path (heartbeat 100 ms, lease TTL 3 s) and
#      the lease path (heartbeat 2000 ms, so the 3 s lease runs out before any suspicion)
#   4. the scaling model to 4096 ranks (scripts/snapshot_model.py) fed with the measured values
# Every run is a loopback cluster of r2ccl_snapshotd, with a one-member etcd for the control
# plane, started by bin/r2ccl_snapshot_bench; one benchmark at a time (2 cores here). Numbers are
# reported, not judged.
#
# USAGE
#   bench_snapshot.sh [--quick] [BUILD_DIR]
#     BUILD_DIR   build tree with bin/r2ccl_snapshot_bench and bin/r2ccl_snapshotd (default
#                 $R2CCL_BUILD_DIR, else build); configured and built only when they are missing
#     --quick     CI smoke: 64 MiB, 4 takes, sparse only, 2 kills on 4 nodes, suspicion path only
#                 (a lease-path kill costs ~30 s, see BENCHMARKS.md) (~30-40 s here)
# ENVIRONMENT
#   R2CCL_BENCH_SNAPSHOT_BYTES    state size per rank for take/restore; default 1G (--quick: 64M)
#   R2CCL_BENCH_SNAPSHOT_RECOVERY_BYTES  state in total for recovery, split across the ranks;
#                                 default 256M (--quick: 32M)
#   R2CCL_BENCH_SNAPSHOT_NODES    recovery cluster sizes, 3..8 (default "4 8"; --quick "4")
#   R2CCL_BENCH_SNAPSHOT_PATHS    recovery eviction paths (default "suspicion lease"; --quick
#                                 "suspicion")
#   R2CCL_BENCH_SNAPSHOT_KILLS    kills per recovery run (default 10; --quick 2)
#   R2CCL_BENCH_SNAPSHOT_ETCD     an etcd URL to use (default: the tool starts one per run)
#   R2CCL_BENCH_SNAPSHOT_BUFFERS  buffers each rank's state is registered as (default 8: a shard
#                                 of 1 GiB blocks the daemon's heartbeats, see BENCHMARKS.md)
#   R2CCL_BENCH_SNAPSHOT_PERIOD   heartbeat period of the take and restore runs (default 500, the
#                                 daemon's default)
#   R2CCL_BENCH_SNAPSHOT_OUT      where logs and results go (default BUILD/bench/snapshot-<time>)
# Exit status: 0 when every measurement ran; 1 otherwise (what failed is listed); 2 usage.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
QUICK=0
BUILD=${R2CCL_BUILD_DIR:-build}
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    -*) echo "bench_snapshot.sh: unknown option '$1'" >&2; exit 2 ;;
    *) BUILD=$1; shift ;;
  esac
done
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
BENCH=$BUILD/bin/r2ccl_snapshot_bench
if [ ! -x "$BENCH" ] || [ ! -x "$BUILD/bin/r2ccl_snapshotd" ]; then
  source "$ROOT/scripts/build_config.sh"  # build/'s options, as test.sh and demo.sh
  cmake -S "$ROOT" -B "$BUILD" "${R2CCL_BUILD_OPTS[@]}" >/dev/null &&
    cmake --build "$BUILD" -j"$(nproc)" --target r2ccl_snapshot_bench r2ccl_snapshotd >/dev/null || exit 1
fi
if [ $QUICK = 1 ]; then
  BYTES=${R2CCL_BENCH_SNAPSHOT_BYTES:-64M}
  RBYTES=${R2CCL_BENCH_SNAPSHOT_RECOVERY_BYTES:-32M}
  NODES=${R2CCL_BENCH_SNAPSHOT_NODES:-4}
  PATHS=${R2CCL_BENCH_SNAPSHOT_PATHS:-suspicion}
  KILLS=${R2CCL_BENCH_SNAPSHOT_KILLS:-2}
  TAKE_STEPS=4
else
  BYTES=${R2CCL_BENCH_SNAPSHOT_BYTES:-1G}
  RBYTES=${R2CCL_BENCH_SNAPSHOT_RECOVERY_BYTES:-256M}
  NODES=${R2CCL_BENCH_SNAPSHOT_NODES:-4 8}
  PATHS=${R2CCL_BENCH_SNAPSHOT_PATHS:-suspicion lease}
  KILLS=${R2CCL_BENCH_SNAPSHOT_KILLS:-10}
  TAKE_STEPS=10
fi
BUFFERS=${R2CCL_BENCH_SNAPSHOT_BUFFERS:-8}
PERIOD=${R2CCL_BENCH_SNAPSHOT_PERIOD:-500}
ETCD=()
[ -n "${R2CCL_BENCH_SNAPSHOT_ETCD:-}" ] && ETCD=(--etcd "$R2CCL_BENCH_SNAPSHOT_ETCD")
OUT=${R2CCL_BENCH_SNAPSHOT_OUT:-$BUILD/bench/snapshot-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" || exit 1
RESULTS=$OUT/results.txt
: > "$RESULTS"
broken=()
{
  echo "date: $(date -Is)"
  echo "commit: $(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (dirty tree)')"
  echo "machine: $(nproc) cores ($(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo | head -1)), $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
  echo "kernel: $(uname -r)"
  echo "bytes: $BYTES in $BUFFERS buffers, take/restore period $PERIOD ms; recovery: $RBYTES in total, nodes: $NODES, paths: $PATHS, $KILLS kills"
  echo "etcd: ${R2CCL_BENCH_SNAPSHOT_ETCD:-one member started by the tool ($(/usr/bin/etcd --version 2>/dev/null | head -1))}"
} | tee "$OUT/env.txt"

# run NAME ARGS...: one benchmark; stdout to OUT/NAME.out (and the key lines to results.txt).
run() {
  local name=$1; shift
  local cmd=("$BENCH" "$@" "${ETCD[@]}")
  echo
  echo "== $name: ${cmd[*]#$BUILD/}"
  echo "   load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  printf '%s\n' "${cmd[*]}" > "$OUT/$name.cmd"
  local t0=$SECONDS
  "${cmd[@]}" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  echo "   exit $rc after $((SECONDS - t0)) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -v '^[#|]' "$OUT/$name.out" | grep -v '^$' >> "$RESULTS"
  grep '^[#|]' "$OUT/$name.out"
  if [ $rc != 0 ]; then
    broken+=("$name (exit $rc)")
    tail -5 "$OUT/$name.err" | sed 's/^/   /'
  fi
}

common=(--bytes "$BYTES" --buffers "$BUFFERS")
run take-sparse --mode take "${common[@]}" --period-ms "$PERIOD" --steps "$TAKE_STEPS" --codec both
run restore --mode restore "${common[@]}" --period-ms "$PERIOD" --steps 3
for p in $PATHS; do
  for n in $NODES; do
    run "recovery-n$n-$p" --mode recovery --bytes "$RBYTES" --buffers "$BUFFERS" --nodes "$n" \
      --path "$p" --kills "$KILLS"
  done
done
if [ $QUICK = 0 ]; then
  run take-adam --mode take "${common[@]}" --period-ms "$PERIOD" --steps 3 --codec both --update adam
fi

# The model, fed with what was measured (the defaults where a value is missing).
val() { awk -v k="$1" '$1 == k {print $2; exit}' "$RESULTS"; }
margs=(--source "$RESULTS")
v=$(val take.sparse.lossless.delta.ratio.median); [ -n "$v" ] && [ "$v" != nan ] && margs+=(--delta-ratio "$v")
v=$(val take.sparse.lossless.base.ratio.median); [ -n "$v" ] && [ "$v" != nan ] && margs+=(--base-ratio "$v")
v=$(val restore.lossless.home.gb_per_s); [ -n "$v" ] && [ "$v" != nan ] && margs+=(--restore-local-gbps "$v")
c=$(val take.sparse.lossless.copy_seconds.median); b=$(val take.sparse.lossless.bytes)
if [ -n "$c" ] && [ -n "$b" ] && [ "$c" != nan ]; then
  margs+=(--take-copy-gbps "$(awk -v b="$b" -v c="$c" 'BEGIN {printf "%.3f", b / c / 1e9}')")
fi
a=$(awk '$1 ~ /^recovery\..*\.suspicion\.agreement_seconds\.p50$/ && $2 != "nan" {print $2}' "$RESULTS" | sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]}')
[ -n "$a" ] && margs+=(--agreement-s "$a")
echo
echo "== model: scripts/snapshot_model.py ${margs[*]}"
python3 "$ROOT/scripts/snapshot_model.py" "${margs[@]}" | tee "$OUT/model.txt" || broken+=("model")
python3 "$ROOT/scripts/snapshot_model.py" "${margs[@]}" --period-ms 100 | sed -n '/^| ranks/,/^$/p' > "$OUT/model-100ms.txt"
echo "(heartbeat 100 ms: $OUT/model-100ms.txt)"

echo
echo "results (key value unit): $RESULTS; logs: $OUT"
if [ ${#broken[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${broken[@]}"
  exit 1
fi
exit 0
