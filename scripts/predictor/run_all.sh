#!/usr/bin/env bash
# The whole, reproducible predictor pipeline (docs/PREDICTOR.md "Training"):
#   1. training traces  (seed 1, --params train)
#   2. held-out traces  (seed 2, --params heldout: other parameter ranges, not just a seed)
#   3. train the LSTM, tune the baseline (its false-drain budget checked on the held-out
#      traces) -> predictor/model/r2ccl_lstm.bin, baseline_defaults.h
#   4. evaluate both on the held-out traces from the exported file (numpy inference), and the
#      drain policy's operating points there, R2CCL_PREDICT_LSTM_CAP's too (tune_policy.py:
#      a report; the defaults in params.h are set by hand from it)
#   5. C++ test fixtures -> tests/predictor/fixtures/
#   6. refresh the generated blocks of docs/PREDICTOR.md ("Failure models", "Results")
# About 68 minutes on a 2-core machine (train.py ~34, tune_policy.py ~27); traces and
# logs go to the work directory, not the repo.
#
# Usage: scripts/predictor/run_all.sh [--work DIR] [--features-from auto|cpp|python] [--quick]
#   --quick   a smoke run: small traces, 2 epochs, every output under the work directory (the
#             shipped model, fixtures and docs are left alone)
# Environment: PYTHON (default /usr/bin/python3: Debian's python3-torch and python3-numpy).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE="$ROOT/scripts/predictor"
PY=${PYTHON:-/usr/bin/python3}
WORK=${TMPDIR:-/tmp}/r2ccl-predictor
FEATURES_FROM=auto
QUICK=0

usage() {  # the comment block at the top of this file
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --work) WORK=$2; shift 2 ;;
    --features-from) FEATURES_FROM=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "run_all.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

"$PY" -c 'import torch, numpy' 2>/dev/null || {
  echo "run_all.sh: $PY cannot import torch and numpy (Debian: apt-get install python3-torch" \
       "python3-numpy; or set PYTHON)" >&2
  exit 1
}

# Sizes: rails x 1.5 h at 5 s. 4,800 held-out rails (about 4,200 healthy rail-hours): the
# baseline's false-drain target (1 per rail-week) is checked on them. 800 held too few false
# drains to tell 0.5 per rail-week from 3, and 2,400 (about 8 false drains at the target's
# 0.7) too few to choose between thresholds that a larger sample tells apart
# (docs/PREDICTOR.md "Training").
TRAIN_RAILS=800 HELDOUT_RAILS=4800 DURATION_S=5400 EPOCHS=""
MODEL="$ROOT/predictor/model/r2ccl_lstm.bin"
HEADER="$ROOT/predictor/model/baseline_defaults.h"
FIXTURES="$ROOT/tests/predictor/fixtures"
if [[ $QUICK == 1 ]]; then
  TRAIN_RAILS=48 HELDOUT_RAILS=24 DURATION_S=1800 EPOCHS="--epochs 2"
  MODEL="$WORK/r2ccl_lstm.bin" HEADER="$WORK/baseline_defaults.h" FIXTURES="$WORK/fixtures"
fi
mkdir -p "$WORK"
SRC=(--features-from "$FEATURES_FROM")

T0=$SECONDS
step() { echo; echo "== $* ($((SECONDS - T0)) s)"; }

step "1/6 training traces"
"$PY" "$HERE/gen_traces.py" --seed 1 --rails "$TRAIN_RAILS" --duration-s "$DURATION_S" \
  --interval-s 5 --params train --out "$WORK/train.csv"

step "2/6 held-out traces"
"$PY" "$HERE/gen_traces.py" --seed 2 --rails "$HELDOUT_RAILS" --duration-s "$DURATION_S" \
  --interval-s 5 --params heldout --out "$WORK/heldout.csv"

step "3/6 training"
T_TRAIN=$SECONDS
# shellcheck disable=SC2086  # EPOCHS is empty or two words
"$PY" "$HERE/train.py" --train "$WORK/train.csv" "${SRC[@]}" --seed 1 --window 24 $EPOCHS \
  --heldout "$WORK/heldout.csv" --out "$MODEL" --baseline-header "$HEADER" --summary-json "$WORK/train_summary.json" \
  | tee "$WORK/train.log"
T_TRAIN=$((SECONDS - T_TRAIN))

step "4/6 evaluation on the held-out traces"
"$PY" "$HERE/evaluate.py" --model "$MODEL" --heldout "$WORK/heldout.csv" "${SRC[@]}" \
  --markdown-out "$WORK/results.md" --json-out "$WORK/results.json"

step "4b/6 drain policy on the held-out traces (event level; a report, nothing is changed)"
"$PY" "$HERE/tune_policy.py" --model "$MODEL" --heldout "$WORK/heldout.csv" "${SRC[@]}" \
  --json-out "$WORK/policy.json" | tail -n 3

step "5/6 C++ test fixtures"
"$PY" "$HERE/export_fixtures.py" --model "$MODEL" --heldout "$WORK/heldout.csv" "${SRC[@]}" \
  --out-dir "$FIXTURES"

step "6/6 docs"
if [[ $QUICK == 1 ]]; then
  echo "(--quick: docs/PREDICTOR.md left alone)"
else
  "$PY" "$HERE/gen_traces.py" --describe > "$WORK/params.md"
  "$PY" "$HERE/update_docs.py" --doc "$ROOT/docs/PREDICTOR.md" \
    --params-md "$WORK/params.md" --results-md "$WORK/results.md" \
    --train-summary "$WORK/train_summary.json" --pipeline-s "$((SECONDS - T0))"
fi

echo
echo "run_all.sh: done in $((SECONDS - T0)) s (train.py: ${T_TRAIN} s); model $MODEL" \
     "($(stat -c %s "$MODEL") bytes); work files in $WORK"
