#!/usr/bin/python3
"""Evaluates the exported LSTM and the threshold baseline side by side on held-out traces.

The LSTM runs from the weights FILE through a numpy re-implementation of the inference
(lstm_ref.py; no torch), so a wrong exporter or a damaged file shows here: the file is read
back and its CRC-32 verified first. The baseline uses the thresholds and k stored in the same
file. Both are scored at the drain threshold 0.7 with the definitions of metrics.py
(sample-level precision/recall/F1/accuracy; failures warned within 120 s, lead times, false
alarms per rail-day; sudden deaths apart).

Example:
  evaluate.py --model predictor/model/r2ccl_lstm.bin --heldout heldout.csv \\
              --markdown-out results.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Dict, List, Optional

import numpy as np

import baseline
import features
import lstm_ref
import metrics
import weights
import windows


def lstm_risk(w: weights.LstmWeights, fs: features.FeatureSet, chunk: int = 32768) -> np.ndarray:
    """Risk of every scored row from the weights file (numpy inference)."""
    xn = windows.Normaliser(w.mean, w.std).apply(fs.x)
    widx = windows.window_index(fs.rail, w.window)
    out = np.empty(len(fs), dtype=np.float32)
    for s in range(0, len(fs), chunk):
        out[s:s + chunk] = lstm_ref.infer(w, windows.gather(xn, widx[s:s + chunk]))
    return out


def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100.0 * a / b:.1f}%)" if b else "0/0"


def _s(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0f}"


def markdown(res: Dict[str, Dict[str, object]], info: Dict[str, object]) -> str:
    """The results as markdown tables (LSTM vs baseline)."""
    L, B = res["lstm"], res["baseline"]
    ls, bs = L["sample"], B["sample"]
    le, be = L["event"], B["event"]
    rows = [
        ("sample precision", f"{ls['precision']:.3f}", f"{bs['precision']:.3f}"),
        ("sample recall", f"{ls['recall']:.3f}", f"{bs['recall']:.3f}"),
        ("**sample F1**", f"**{ls['f1']:.3f}**", f"**{bs['f1']:.3f}**"),
        ("sample accuracy", f"{ls['accuracy']:.5f}", f"{bs['accuracy']:.5f}"),
        ("predictable failures warned (alarm on until the failure, onset <= 120 s before)",
         _pct(le["warned"], le["predictable_events"]),
         _pct(be["warned"], be["predictable_events"])),
        ("alarm on until the failure but onset > 120 s before (not counted as warned)",
         str(le["early"]), str(be["early"])),
        ("sudden deaths warned (no precursor; excluded above)",
         _pct(le["sudden_warned"], le["sudden_events"]),
         _pct(be["sudden_warned"], be["sudden_events"])),
        ("lead time of warned failures, median / p10 (s)",
         f"{_s(le['lead_median_s'])} / {_s(le['lead_p10_s'])}",
         f"{_s(be['lead_median_s'])} / {_s(be['lead_p10_s'])}"),
        ("false alarms (episodes not followed by a failure within 30 s)",
         str(le["false_alarms"]), str(be["false_alarms"])),
        ("**false alarms per rail-day**", f"**{le['false_alarms_per_rail_day']:.2f}**",
         f"**{be['false_alarms_per_rail_day']:.2f}**"),
    ]
    ld, bd = L["drain"], B["drain"]
    rows += [
        ("with the plugin's drain hysteresis (return below 0.4 for 6 samples): failures "
         "drained", _pct(ld["warned"], ld["predictable_events"]),
         _pct(bd["warned"], bd["predictable_events"])),
        ("with the drain hysteresis: false drains per rail-day",
         f"{ld['false_alarms_per_rail_day']:.2f}", f"{bd['false_alarms_per_rail_day']:.2f}"),
    ]
    out = [f"Held-out set: {info['rows']} scored rows ({info['positives']} positive) on "
           f"{info['rails']} rails, {info['rail_days']:.2f} link-up rail-days, "
           f"{info['events']} failure events. Drain threshold 0.7.", "",
           "| metric | LSTM | baseline |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    out += ["", "Per scenario (events warned; false alarms by the scenario of the rail):", "",
            "| scenario | failure events | LSTM warned | baseline warned | LSTM false alarms | "
            "baseline false alarms |", "|---|---|---|---|---|---|"]
    names: List[str] = sorted(set(le["per_scenario"]) | set(le["false_alarms_by_scenario"]) |
                              set(be["false_alarms_by_scenario"]) | set(info["scenarios"]))
    for n in names:
        lp = le["per_scenario"].get(n, {"events": 0, "warned": 0})
        bp = be["per_scenario"].get(n, {"events": 0, "warned": 0})
        out.append(f"| {n} | {lp['events']} | {lp['warned']} | {bp['warned']} | "
                   f"{le['false_alarms_by_scenario'].get(n, 0)} | "
                   f"{be['false_alarms_by_scenario'].get(n, 0)} |")
    return "\n".join(out) + "\n"


def evaluate(model_path: str, heldout: str, source: str, tool: str) -> Dict[str, object]:
    w = weights.read(model_path)
    fs = features.load_features(heldout, source, tool, float(w.horizon_s))
    t0 = time.time()
    r_lstm = lstm_risk(w, fs)
    t_lstm = time.time() - t0
    r_base = baseline.risk(fs.x, fs.rail, baseline.BaselineParams.of(w))
    res: Dict[str, object] = {}
    for name, r in (("lstm", r_lstm), ("baseline", r_base)):
        res[name] = {"sample": metrics.sample_metrics(fs.label, r >= metrics.DRAIN),
                     "event": metrics.event_metrics(fs, r, w.interval_s),
                     "drain": metrics.event_metrics(fs, r, w.interval_s,
                                                    on=metrics.drain_state(fs, r))}
    info = {"rows": len(fs), "positives": int(fs.label.sum()),
            "rails": int(np.unique(fs.rail).size), "events": int(fs.event_t.size),
            "rail_days": res["lstm"]["event"]["rail_days"], "scenarios": fs.scenarios,
            "features_from": fs.source, "model": model_path, "heldout": heldout,
            "numpy_inference_s": round(t_lstm, 1),
            "model_metadata": w.metadata}
    return {"results": res, "info": info}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="weights file (r2ccl_lstm.bin)")
    ap.add_argument("--heldout", required=True, help="held-out trace CSV")
    features.add_source_args(ap)
    ap.add_argument("--markdown-out", help="also write the markdown tables here")
    ap.add_argument("--json-out", help="also write every number as JSON here")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        out = evaluate(args.model, args.heldout, args.features_from, args.cpp_tool)
    except (weights.WeightsError, ValueError, OSError, RuntimeError) as e:
        print(f"evaluate.py: {e}", file=sys.stderr)
        return 1
    md = markdown(out["results"], out["info"])
    print(md)
    if args.markdown_out:
        with open(args.markdown_out, "w", encoding="utf-8") as f:
            f.write(md)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, default=float)
    print(f"evaluate.py: {time.time() - t0:.1f} s (features from {out['info']['features_from']})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
