#!/usr/bin/env bash
# bench_ib_fake.sh - the verbs transport on the fake verbs provider (tests/fakeverbs): how long
# a switchover takes, and what the fake carries. These numbers describe the plugin's protocol
# plus the fake's emulation (Unix sockets, one memcpy per write), NOT InfiniBand hardware:
# there the same run needs scripts/ib_two_node.sh.
#
# USAGE
#   bench_ib_fake.sh [--build DIR] [--faults N] [--out DIR] [--shapes [--no-16m]]
#     --build DIR   build tree (default build; configured and built when missing)
#     --faults N    port-down runs of each kind (default 10; with --shapes: per shape, default 5)
#     --out DIR     raw logs (default BUILD/bench-ib-fake/<timestamp>)
#     --shapes      instead of the rows below: the data-path shapes under one fault. Chunk sizes
#                   4K, 64K, 1M, 16M x 1, 4 and 16 QPs per path (R2CCL_CHUNK_SIZE,
#                   R2CCL_IB_QPS_PER_PATH), each N runs of r2ccl_perf sendrecv 16 MiB messages
#                   (--slice 16M: one isend per message, cut into chunks by the plugin, 10
#                   iterations) where rank 0's primary port (mlx5_0) goes down after 32 MiB.
#                   Per shape: recoveries and their p50/max ("Successfully recovered in X s"),
#                   chunks replayed (summed "N chunks replayed"), and spurious switchovers:
#                   every "switchover:" line but the first of each connection for mlx5_0:1
#                   (each of the ring's 2 connections is expected to leave the dead port once).
#                   16M chunks get R2CCL_PATH_WINDOW 32M and 1 s heartbeat/ACK bounds (the
#                   fake's one NIC thread copies a 16 MiB write in tens of ms, answering nothing
#                   meanwhile, as tests/support/data_shapes.h explains).
#     --no-16m      with --shapes: leave out the 16M chunk rows
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
# Exit status: 0 when every run completed with 0 wrong elements (and, with --shapes, every run
# logged a recovery).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build FAULTS="" OUT="" SHAPES=0 BIG=1
need() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "bench_ib_fake.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --build) need "$@"; BUILD=$2; shift 2 ;;
    --faults) need "$@"; FAULTS=$2; shift 2 ;;
    --out) need "$@"; OUT=$2; shift 2 ;;
    --shapes) SHAPES=1; shift ;;
    --no-16m) BIG=0; shift ;;
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
    *) echo "bench_ib_fake.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$FAULTS" ] && ! [[ $FAULTS =~ ^[1-9][0-9]*$ ]]; then
  echo "bench_ib_fake.sh: --faults '$FAULTS' is not an integer >= 1" >&2; exit 2
fi
[ $BIG = 1 ] || [ $SHAPES = 1 ] || { echo "bench_ib_fake.sh: --no-16m goes with --shapes" >&2; exit 2; }
[ -n "$FAULTS" ] || { [ $SHAPES = 1 ] && FAULTS=5 || FAULTS=10; }
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

shape_row() {  # shape_row CHUNK QPS: N runs, rank 0's mlx5_0 down after 32 MiB
  local chunk=$1 qps=$2 i name="shape-$1-$2q"
  local bytes; bytes=$(numfmt --from=iec "$chunk")
  local window=$((bytes * 2 > 4194304 ? bytes * 2 : 4194304))
  local extra="R2CCL_CHUNK_SIZE=$bytes R2CCL_IB_QPS_PER_PATH=$qps R2CCL_PATH_WINDOW=$window"
  [ "$bytes" -ge 4194304 ] && extra="$extra R2CCL_HEARTBEAT_INTERVAL=1s R2CCL_ACK_TIMEOUT=1s"
  : >"$OUT/$name.times"; : >"$OUT/$name.counts"
  for i in $(seq 1 "$FAULTS"); do
    local log="$OUT/$name-$i.log"
    PERF_ENV="$extra" perf "$log" "port_down,dev=mlx5_0,after_bytes=33554432" "" \
      --op sendrecv -b 16M -e 16M --slice 16M -n 10
    # The event sink's lines ("[R2CCL] ..."), not their NCCL WARN copies.
    grep -o "\[R2CCL\] Successfully recovered in [0-9.]* s" "$log" | awk '{print $5}' >>"$OUT/$name.times"
    grep "\[R2CCL\] " "$log" | awk '
      /\] Successfully recovered in/ { rec++; if (match($0, /[0-9]+ chunks replayed/)) rep += substr($0, RSTART, RLENGTH) + 0 }
      /\] switchover: rail / {
        rail = $0; sub(/.*switchover: rail /, "", rail); sub(/ .*/, "", rail)
        conn = $0; sub(/.* of conn /, "", conn); sub(/ .*/, "", conn)
        if (rail == "mlx5_0:1" && !seen[conn]++) expd++; else spur++ }
      END { printf "%d %d %d %d\n", rec, rep, expd, spur }' >>"$OUT/$name.counts"
    if ! grep -q "\[R2CCL\] Successfully recovered in" "$log"; then
      echo "bench_ib_fake.sh: no recovery logged: $log" >&2
      fail=1
    fi
  done
  sort -n "$OUT/$name.times" | awk -v chunk="$chunk" -v qps="$qps" -v runs="$FAULTS" -v counts="$OUT/$name.counts" '
    {v[NR]=$1} END {
      while ((getline line < counts) > 0) { split(line, c, " "); rec += c[1]; rep += c[2]; expd += c[3]; spur += c[4] }
      if (NR == 0) { printf "| %s | %d | %d | none logged | - | - | %d | %d |\n", chunk, qps, runs, expd, spur; exit }
      printf "| %s | %d | %d | %d | %.0f ms | %.0f ms | %d | %d of %d |\n", chunk, qps, runs, NR,
             v[int((NR+1)/2)]*1000, v[NR]*1000, rep, spur, expd + spur }'
}

echo "# r2ccl verbs transport on the fake verbs provider (commit $(git -C "$ROOT" rev-parse --short HEAD))"
echo
if [ $SHAPES = 1 ]; then
  chunks=(4K 64K 1M)
  [ $BIG = 1 ] && chunks+=(16M)
  echo "| chunk | QPs per path | runs | recoveries | recovery p50 | recovery max | chunks replayed | spurious switchovers (of all) |"
  echo "|---|---|---|---|---|---|---|---|"
  for c in "${chunks[@]}"; do
    for q in 1 4 16; do shape_row "$c" "$q"; done
  done
  exit $fail
fi
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
