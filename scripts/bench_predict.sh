#!/usr/bin/env bash
# bench_predict.sh - the failure predictor's costs (docs/BENCHMARKS.md, "Failure predictor"):
#   1. the shipped weights file's size (budget: under 1 MB)
#   2. inference per rail-sample with the LSTM (R2CCL_PREDICT_DECIDER both or lstm): features
#      + 24-step LSTM + baseline + decision, the median of 5 runs of
#      `r2ccl_predict --bench --decider both` (target: <= 50 us); and the same with the default
#      decider, the baseline alone (no LSTM), the median of 5 runs
#   3. one sampling round over 8 fake HCA ports (15 counter files each) + inference, each
#      decider: what the node's sampler spends every R2CCL_PREDICT_INTERVAL
#
# USAGE
#   bench_predict.sh [--build DIR]
#     --build DIR   build tree (default build; configured and built when missing)
# Exit status: 0 when every measurement ran; 1 otherwise (the numbers are reported, not judged).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "bench_predict.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
if [ ! -x "$BUILD/bin/r2ccl_predict" ]; then
  source "$ROOT/scripts/build_config.sh"  # build/'s options, as test.sh and demo.sh
  cmake -S "$ROOT" -B "$BUILD" "${R2CCL_BUILD_OPTS[@]}" >/dev/null &&
    cmake --build "$BUILD" -j"$(nproc)" --target r2ccl_predict >/dev/null || exit 1
fi
TOOL=$BUILD/bin/r2ccl_predict
MODEL=$ROOT/predictor/model/r2ccl_lstm.bin
TREE=$(mktemp -d /tmp/r2ccl-bench-predict.XXXXXX)
trap 'rm -rf "$TREE"' EXIT

echo "weights: $MODEL, $(stat -c %s "$MODEL") bytes (limit 1048576)"
"$TOOL" --info --model "$MODEL" --quiet | head -2
for dev in 0 1 2 3 4 5 6 7; do
  d=$TREE/class/infiniband/mlx5_$dev/ports/1
  mkdir -p "$d/counters" "$d/hw_counters"
  echo "4: ACTIVE" > "$d/state"
  echo "400 Gb/sec (4X NDR)" > "$d/rate"
  for c in port_xmit_packets port_rcv_packets port_xmit_data port_rcv_data symbol_error \
           port_rcv_errors link_error_recovery link_downed local_link_integrity_errors \
           excessive_buffer_overrun_errors; do echo 12345 > "$d/counters/$c"; done
  for c in local_ack_timeout_err packet_seq_err implied_nak_seq_err out_of_sequence \
           out_of_buffer; do echo 7 > "$d/hw_counters/$c"; done
done
fail=0
for decider in both baseline; do
  runs=()
  for i in 1 2 3 4 5; do
    us=$("$TOOL" --bench --decider $decider --model "$MODEL" --quiet |
         sed -n 's/^inference: \([0-9.]*\) us.*/\1/p')
    [ -n "$us" ] || fail=1
    runs+=("$us")
  done
  printf 'decider %s: inference per rail-sample, 5 runs (us): %s\n' $decider "${runs[*]}"
  printf 'decider %s: median: %s us\n' $decider \
         "$(printf '%s\n' "${runs[@]}" | sort -n | sed -n 3p)"
  "$TOOL" --bench --decider $decider --model "$MODEL" --quiet --sysfs-root "$TREE" |
    sed -n "s/^sampling round/decider $decider: sampling round/p" | grep . || fail=1
done
exit $fail
