#!/usr/bin/python3
"""Chooses the drain policy's operating point at event level on OUR held-out traces.

For every drain threshold and R2CCL_PREDICT_ENTER_SAMPLES value in a grid, replays the drain
policy with its guard (metrics.drain_outcomes, the rules of r2ccl_predict --evaluate) over the
LSTM's risk and over the baseline's, and counts failures warned >= 30 s ahead and false drains
per healthy rail-week. The operating point of each decider is the one that warns the most
failures while keeping false drains at or under --max-false-per-week (ties: fewer false
drains, then the higher threshold); with none under it, the fewest false drains.

Then, at the default threshold and enter samples, the decider "both" (the baseline's risk
raised by the LSTM's, up to R2CCL_PREDICT_LSTM_CAP times it) for each cap in --caps. Its
choice is the cap that warns the most without more false drains than the baseline alone at
the same policy (the LSTM is there to add warnings, not false drains): what the parameter
table's default should be after a retrain.

For the baseline the threshold is a scale on its tuned thresholds (a drain at risk >= T means
mean_i >= threshold_i x T / 0.7), so the chosen scale can be folded into the thresholds and the
baseline drains at the shared R2CCL_PREDICT_THRESHOLD.

Never run this on the frozen evaluation traces (eval_traces.py): they measure, they do not
tune.

Example:
  tune_policy.py --model predictor/model/r2ccl_lstm.bin --heldout heldout.csv --json-out p.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

import baseline
import evaluate
import features
import metrics
import weights

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
ENTER = (1, 2, 3, 4, 6)
CAPS = (1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0)


def choose_cap(rows, baseline_false_drains: int):
    """The decider both's cap: of ``rows`` (one per cap: lstm_cap, warned, false_drains), the
    one that warns the most without more false drains than the baseline alone (ties: the
    smaller cap); with none, the fewest false drains."""
    ok = [r for r in rows if r["false_drains"] <= baseline_false_drains]
    if ok:
        return max(ok, key=lambda r: (r["warned"], -r["lstm_cap"]))
    return min(rows, key=lambda r: (r["false_drains"], -r["warned"]))


def choose(rows, max_false: float):
    ok = [r for r in rows if r["false_per_rail_week"] <= max_false]
    if ok:
        return max(ok, key=lambda r: (r["warned"], -r["false_per_rail_week"], r["threshold"]))
    return min(rows, key=lambda r: (r["false_per_rail_week"], -r["warned"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="weights file (r2ccl_lstm.bin)")
    ap.add_argument("--heldout", required=True, help="held-out trace CSV (ours, not the frozen "
                                                     "evaluation set)")
    ap.add_argument("--max-false-per-week", type=float, default=metrics.HELDOUT_MAX_FALSE,
                    help="false drains per healthy rail-week allowed, a finite number >= 0 "
                         "(default %(default)g: train.py's choice on these traces, under the 1 "
                         "aimed at; metrics.HELDOUT_MAX_FALSE)")
    ap.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)),
                    help="drain thresholds to try, comma list (default %(default)s)")
    ap.add_argument("--enter", default=",".join(map(str, ENTER)),
                    help="R2CCL_PREDICT_ENTER_SAMPLES values to try, comma list (default "
                         "%(default)s)")
    ap.add_argument("--caps", default=",".join(map(str, CAPS)),
                    help="R2CCL_PREDICT_LSTM_CAP values to try for the decider both, comma list "
                         "(default %(default)s)")
    ap.add_argument("--json-out", help="also write the grid and the choices here")
    features.add_source_args(ap)
    args = ap.parse_args(argv)
    if not (math.isfinite(args.max_false_per_week) and args.max_false_per_week >= 0):
        ap.error(f"--max-false-per-week {args.max_false_per_week:g}: need a finite number >= 0 "
                 "(false drains per healthy rail-week)")
    try:
        thresholds = [float(v) for v in args.thresholds.split(",")]
        enters = [int(v) for v in args.enter.split(",")]
        caps = [float(v) for v in args.caps.split(",")]
    except ValueError:
        print("tune_policy.py: --thresholds, --enter and --caps take comma lists of numbers",
              file=sys.stderr)
        return 2
    if not all(1 <= c <= 100 for c in caps):
        print("tune_policy.py: --caps values must lie in [1, 100] (R2CCL_PREDICT_LSTM_CAP's "
              "range)", file=sys.stderr)
        return 2
    if not all(0.01 <= t <= 1 for t in thresholds) or not all(k >= 1 for k in enters):
        print("tune_policy.py: --thresholds must lie in [0.01, 1] (R2CCL_PREDICT_THRESHOLD's "
              "range) and --enter values be >= 1", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        w = weights.read(args.model)
    except (weights.WeightsError, ValueError, OSError) as e:
        print(f"tune_policy.py: --model {args.model}: {e}", file=sys.stderr)
        return 1
    try:
        fs = features.load_features(args.heldout, args.features_from, args.cpp_tool,
                                    float(w.horizon_s))
    except (ValueError, OSError, RuntimeError) as e:
        print(f"tune_policy.py: --heldout {args.heldout}: {e}", file=sys.stderr)
        return 1
    if len(fs) == 0:
        print(f"tune_policy.py: {args.heldout}: no scored rows", file=sys.stderr)
        return 1
    risks = {"lstm": evaluate.lstm_risk(w, fs),
             "baseline": baseline.risk(fs.x, fs.rail, baseline.BaselineParams.of(w))}
    grid = {}
    print(f"{'decider':9} {'thr':>5} {'enter':>5} {'warned':>11} {'median-lead':>11} "
          f"{'false/wk':>9} {'early':>6}")
    for name, risk in risks.items():
        grid[name] = []
        for thr in thresholds:
            for k in enters:
                o = metrics.drain_outcomes(fs, risk, metrics.Policy(threshold=thr,
                                                                    enter_samples=k),
                                           interval_s=w.interval_s)
                row = {"threshold": thr, "enter_samples": k, "warned": o["warned"],
                       "precursor": o["precursor"], "warned_frac": o["warned_frac"],
                       "false_drains": o["false_drains"],
                       "false_per_rail_week": o["false_per_rail_week"],
                       "early_drains": o["early_drains"], "lead_median_s": o["lead_median_s"]}
                grid[name].append(row)
                lead = "-" if row["lead_median_s"] is None else f"{row['lead_median_s']:.0f} s"
                print(f"{name:9} {thr:5.2f} {k:5d} {o['warned']:5d}/{o['precursor']:<5d} "
                      f"{lead:>11} {row['false_per_rail_week']:9.2f} {o['early_drains']:6d}")
    # The decider both, at the default policy, per cap. "threshold" holds the cap here (the
    # key choose() breaks ties on: the larger cap).
    pol = metrics.Policy()
    grid["both"] = []
    for cap in caps:
        o = metrics.drain_outcomes(fs, metrics.both_risk(risks["lstm"], risks["baseline"], cap),
                                   pol, interval_s=w.interval_s)
        row = {"threshold": pol.threshold, "enter_samples": pol.enter_samples, "lstm_cap": cap,
               "warned": o["warned"], "precursor": o["precursor"],
               "warned_frac": o["warned_frac"], "false_drains": o["false_drains"],
               "false_per_rail_week": o["false_per_rail_week"],
               "early_drains": o["early_drains"], "lead_median_s": o["lead_median_s"]}
        grid["both"].append(row)
        lead = "-" if row["lead_median_s"] is None else f"{row['lead_median_s']:.0f} s"
        print(f"both cap {cap:<4g} {pol.threshold:5.2f} {pol.enter_samples:5d} "
              f"{o['warned']:5d}/{o['precursor']:<5d} {lead:>11} "
              f"{row['false_per_rail_week']:9.2f} {o['early_drains']:6d}")
    healthy_h = metrics.drain_outcomes(fs, risks["lstm"], metrics.Policy(),
                                       interval_s=w.interval_s)["healthy_s"] / 3600
    choice = {n: choose(g, args.max_false_per_week) for n, g in grid.items() if n != "both"}
    alone = metrics.drain_outcomes(fs, risks["baseline"], pol, interval_s=w.interval_s)
    choice["both"] = choose_cap(grid["both"], alone["false_drains"])
    for n, c in choice.items():
        cap = f", R2CCL_PREDICT_LSTM_CAP {c['lstm_cap']:g}" if "lstm_cap" in c else ""
        print(f"choice {n}: threshold {c['threshold']}, enter samples {c['enter_samples']}{cap}: "
              f"warned {c['warned']}/{c['precursor']}, {c['false_per_rail_week']:.2f} false "
              f"drains per rail-week ({healthy_h:.0f} healthy rail-hours)")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"grid": grid, "choice": choice, "healthy_rail_hours": healthy_h,
                       "max_false_per_week": args.max_false_per_week}, f, indent=1)
    print(f"tune_policy.py: {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
