#!/usr/bin/env bash
# bench_ib_fake.sh - the verbs transport on the fake verbs provider (tests/fakeverbs): how long
# a switchover takes, and what the fake carries. These numbers describe the plugin's protocol
# plus the fake's emulation (Unix sockets, one memcpy per write), NOT InfiniBand hardware:
# there the same run needs scripts/ib_two_node.sh.
#
# USAGE
#   bench_ib_fake.sh [--build DIR] [--faults N] [--out DIR]
#     --build DIR   build tree (default build; configured and built when missing)
#     --faults N    port-down runs of each kind (default 10)
#     --out DIR     raw logs (default BUILD/bench-ib-fake/<timestamp>)
# Rows:
#   1. r2ccl_perf AllReduce 8 B .. 64 MiB over the fake, checked (busbw per size).
#   2. "Successfully recovered in X s" of N runs where both ranks' mlx5_0 port goes down
#      after 256 MiB (port-error event + retry-exceeded), p50 and max, and #wrong. Each run
#      has two send connections (a ring of 2), so up to 2 recoveries per run.
#   3. The same when only rank 1's mlx5_0 goes down (far end: rank 0 learns from completions).
#   4. Black-hole detection: rank 0's mlx5_0 QPs fall silent after 256 MiB (link up, no error,
#      the fake never completes them), at R2CCL_IB_TIMEOUT 14 and 16: the "detected after N ms"
#      of the recovery lines, p50 and max. The watchdog waits two QP retransmissions
#      (2 x 4.096 us x 2^timeout: 134 ms and 537 ms) before failing the path over; the fake's
#      retry-exceeded comes after the QP's whole budget (8 tries: 537 ms and 2.1 s), not the
#      50 ms the other rows use.
# Exit status: 0 when every run completed with 0 wrong elements.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build FAULTS=10 OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --faults) FAULTS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "bench_ib_fake.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
if [ ! -x "$BUILD/bin/r2ccl_perf" ] || [ ! -f "$BUILD/lib/libr2ccl-fakeverbs.so" ]; then
  source "$ROOT/scripts/build_config.sh"  # build/'s options, as test.sh and demo.sh
  cmake -S "$ROOT" -B "$BUILD" "${R2CCL_BUILD_OPTS[@]}" >/dev/null &&
    cmake --build "$BUILD" -j"$(nproc)" --target nccl-net-r2ccl r2ccl_perf r2ccl_fakeverbs >/dev/null || exit 1
fi
OUT=${OUT:-$BUILD/bench-ib-fake/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
hcas() {  # hcas RANK: two RoCE HCAs per "host", on 10.210.1.0/24 and 10.210.2.0/24
  echo "mlx5_0,eth,10.210.1.$(($1 + 1)),pci=0000:00:01.0/0000:0b:00.0,numa=0;mlx5_1,eth,10.210.2.$(($1 + 1)),pci=0000:00:01.0/0000:0c:00.0,numa=0"
}
fail=0
port=$((20000 + RANDOM % 20000))

perf() {  # perf LOG RANK0_FAULTS RANK1_FAULTS ARGS...: two ranks, each its own "host"
  local log=$1 f0=$2 f1=$3; shift 3
  local dir; dir=$(mktemp -d /tmp/r2ccl-bench-fv.XXXXXX)
  port=$((port + 1))
  local r pids=()
  for r in 0 1; do
    local f=$f0; [ $r = 1 ] && f=$f1
    env ${PERF_ENV:-} R2CCL_TRANSPORT=ib R2CCL_IBVERBS_LIB="$BUILD/lib/libr2ccl-fakeverbs.so" R2CCL_SOCKET_IFNAME=lo \
    FAKEVERBS_DIR="$dir" FAKEVERBS_DEVICES="$(hcas $r)" FAKEVERBS_FAULTS="$f" FAKEVERBS_RETRY_US="${FV_RETRY_US-50000}" \
      "$BUILD/bin/r2ccl_perf" --rendezvous "127.0.0.1:$port" --rank $r --nranks 2 --check \
      --timeout 300 "$@" >"$log.rank$r" 2>&1 &
    pids+=($!)
  done
  wait "${pids[0]}"; local rc0=$?
  wait "${pids[1]}"; local rc1=$?
  cat "$log.rank0" "$log.rank1" >"$log"
  rm -rf "$dir"
  if [ $rc0 -ne 0 ] || [ $rc1 -ne 0 ] || awk '/^ +[0-9]/ && $NF != "0" {bad=1} END {exit !bad}' "$log"; then
    echo "bench_ib_fake.sh: run failed or had wrong elements: $log" >&2
    fail=1
  fi
}

recovery_row() {  # recovery_row NAME RANK0_FAULTS RANK1_FAULTS
  local name=$1 f0=$2 f1=$3 i
  : >"$OUT/$name.times"
  for i in $(seq 1 "$FAULTS"); do
    perf "$OUT/$name-$i.log" "$f0" "$f1" -b 64M -e 64M -n 12
    # the event sink's line (the NCCL WARN copy of each event is not counted twice)
    grep -o "\[R2CCL\] Successfully recovered in [0-9.]* s" "$OUT/$name-$i.log" | awk '{print $5}' >>"$OUT/$name.times"
  done
  sort -n "$OUT/$name.times" | awk -v name="$name" -v runs="$FAULTS" '
    {v[NR]=$1} END {
      if (NR == 0) { printf "| %s | no recovery logged in %d runs |\n", name, runs; exit }
      printf "| %s | %d recoveries in %d runs | p50 %.1f ms | max %.1f ms |\n", name, NR, runs,
             v[int((NR+1)/2)]*1000, v[NR]*1000 }'
}

detect_row() {  # detect_row IB_TIMEOUT: rank 0's mlx5_0 black-holed after 256 MiB
  local t=$1 i name="blackhole-ib-timeout-$1"
  : >"$OUT/$name.times"
  for i in $(seq 1 "$FAULTS"); do
    # FV_RETRY_US empty: the fake's retry-exceeded comes after the QP's own budget,
    # 4.096 us x 2^timeout x (retry_cnt + 1) (537 ms at 14), as on hardware.
    FV_RETRY_US="" PERF_ENV="R2CCL_IB_TIMEOUT=$t" perf "$OUT/$name-$i.log" "blackhole,dev=mlx5_0,after_bytes=268435456" "" \
      -b 64M -e 64M -n 12
    grep -o "\[R2CCL\] Successfully recovered in .*detected after [0-9]* ms" "$OUT/$name-$i.log" |
      grep -o "detected after [0-9]* ms" | awk '{print $3}' >>"$OUT/$name.times"
  done
  sort -n "$OUT/$name.times" | awk -v name="$name" -v runs="$FAULTS" -v t="$t" '
    {v[NR]=$1} END {
      floor = 2 * 4.096 * 2^t / 1000
      if (NR == 0) { printf "| %s | no detection logged in %d runs |\n", name, runs; exit }
      printf "| %s (floor %.0f ms) | %d detections in %d runs | p50 %d ms | max %d ms |\n", name,
             floor, NR, runs, v[int((NR+1)/2)], v[NR] }'
}

echo "# r2ccl verbs transport on the fake verbs provider (commit $(git -C "$ROOT" rev-parse --short HEAD))"
echo
perf "$OUT/allreduce.log" "" "" -b 8 -e 64M -f 8 -n 20
echo '```'
grep -E "^#  +size|^ +[0-9]" "$OUT/allreduce.log.rank0"
echo '```'
echo
echo "| fault | runs | recovery p50 | recovery max |"
echo "|---|---|---|---|"
recovery_row "port-down-both-ends" "port_down,dev=mlx5_0,after_bytes=268435456" \
  "port_down,dev=mlx5_0,after_bytes=268435456"
recovery_row "port-down-far-end" "" "port_down,dev=mlx5_0,after_ms=1000"
echo
echo "| black hole | runs | detected p50 | detected max |"
echo "|---|---|---|---|"
detect_row 14
detect_row 16
exit $fail
