#!/usr/bin/python3
"""Trains the failure predictor's LSTM and tunes the threshold baseline; exports both.

Pipeline (docs/PREDICTOR.md "Training"):
  1. features of the training trace (the C++ r2ccl_predict, or features.py);
  2. the rails are split (seeded) into a fitting part and a validation part (--val-frac);
  3. normalisation mean/std from the fitting rows; windows of the last W rows ending at each
     scored row, left-padded with zero rows after normalisation;
  4. torch.nn.LSTM(11, H, batch_first) -> Linear(H, 1) -> sigmoid, trained with class-weighted
     BCE and Adam on every positive plus a fresh random sample of --neg-per-epoch negatives
     each epoch (the negatives are ~99.7% of the rows; sampling keeps an epoch short), CPU,
     fixed seeds; the epoch with the best F1 on the validation rails is kept;
  5. the decision point is calibrated on the validation rails: the dense bias is shifted by
     logit(0.7) - logit(p*), where p* is the validation's best-F1 threshold, so that risk
     0.7 is the sample-level operating point (the ranking is unchanged). The plugin drains
     at R2CCL_PREDICT_THRESHOLD (0.9), chosen at event level on held-out traces
     (tune_policy.py);
  6. the baseline's thresholds and k are grid-searched for the best F1 on ALL training rows,
     then k is chosen again for the drain decisions (choose_event_k: 1, 3, 6, 12 or 24 rows,
     the most failures warned within the largest budget) and each threshold is scaled
     (baseline.tune_events) for the drain decisions at --policy-threshold / --policy-enter:
     the most failures warned with at most B false drains per healthy training rail-week.
     B is --max-false-per-week; with --heldout, B is the largest of --baseline-budgets whose
     thresholds keep the HELD-OUT traces at or under --heldout-max-false-per-week (0.7:
     under the target, HELDOUT_MAX_FALSE; thresholds that just meet the target on the
     training traces exceed it on wider ones); when none does, the smallest budget's
     thresholds raised one by one (raise_thresholds: each by its own factor of
     HELDOUT_MARGINS, 1.1 to 3, the step that removes the most held-out false drains per
     warning lost first) until they do, while still warning at least MARGIN_MIN_WARNED (half)
     of the held-out failures the unraised ones warned;
     then, with --heldout, the baseline's rise rule (baseline.choose_rise, RISE_GRID): the
     one that warns the most held-out failures at no more than --heldout-max-false-per-week
     false drains per rail-week there (or no more than the thresholds alone where they already
     exceed it); without --heldout, no rise rule;
  7. the weights file (docs/PREDICTOR.md layout) and predictor/model/baseline_defaults.h are
     written, read back, CRC-checked and the numpy re-implementation is compared to torch.

Example:
  train.py --train train.csv --out predictor/model/r2ccl_lstm.bin
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

import baseline
import features
import lstm_ref
import metrics
import torch_model
import weights
import windows

REPO_ROOT = features.REPO_ROOT
DEFAULT_OUT = os.path.join(REPO_ROOT, "predictor", "model", "r2ccl_lstm.bin")
DEFAULT_HEADER = os.path.join(REPO_ROOT, "predictor", "model", "baseline_defaults.h")


def log(msg: str) -> None:
    print(msg, flush=True)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def trace_comments(path: str) -> List[str]:
    """The comment lines at the top of a trace (the generator records its parameters there)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            if not line.startswith("# widths:"):
                out.append(line[1:].strip())
    return out


def sampling_interval(fs: features.FeatureSet) -> float:
    """Median step between consecutive rows of a rail, seconds (rounded to 0.1 s)."""
    order = np.lexsort((fs.t, fs.rail))
    same = fs.rail[order][1:] == fs.rail[order][:-1]
    d = np.diff(fs.t[order])[same]
    return round(float(np.median(d)), 1) if d.size else 5.0


def best_f1_threshold(label: np.ndarray, prob: np.ndarray,
                      neg_weight: float = 1.0) -> Tuple[float, float]:
    """(threshold, F1) maximising F1 of prob >= threshold; threshold halfway between scores.
    ``neg_weight``: how many negatives each negative row stands for (a subsample)."""
    y = label.astype(bool)
    o = np.argsort(-prob, kind="stable")
    ps, ys = prob[o], y[o]
    tp = np.cumsum(ys)
    fp = np.cumsum(~ys) * neg_weight
    P = y.sum()
    last = np.r_[ps[1:] != ps[:-1], True]
    f1 = np.where(last & (tp > 0), 2 * tp / (2 * tp + fp + (P - tp)), -1.0)
    j = int(np.argmax(f1))
    nxt = ps[j + 1] if j + 1 < ps.size else 0.0
    return float((ps[j] + nxt) / 2), float(max(f1[j], 0.0))


def split_rails(rail: np.ndarray, val_frac: float, seed: int) -> np.ndarray:
    """bool [N]: True for rows of the validation rails."""
    rails = np.unique(rail)
    rng = np.random.default_rng(seed + 1000)
    n_val = max(1, int(round(val_frac * rails.size)))
    val = rng.choice(rails, size=n_val, replace=False)
    return np.isin(rail, val)


def threshold_line(vals: str) -> str:
    """The thresholds' declaration as clang-format writes it (the project's 100 columns)."""
    one = f"constexpr float kBaselineThreshold[4] = {{{vals}}};"
    if len(one) <= 100:
        return one + "\n"
    return f"constexpr float kBaselineThreshold[4] = {{\n    {vals}}};\n"


def parse_budgets(text: str) -> List[float]:
    try:
        budgets = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        budgets = []
    if not budgets or any(not (b >= 0 and math.isfinite(b)) for b in budgets):
        raise ValueError(f"--baseline-budgets '{text}': expected a comma list of numbers >= 0 "
                         "(false drains per rail-week)")
    return sorted(set(budgets), reverse=True)


# Rows the baseline averages (k) that step 6 tries for the drain decisions.
EVENT_KS = (1, 3, 6, 12, 24)
# Factors on each threshold that step 6 tries, smallest first, when no training budget keeps
# the held-out traces at the target (raise_thresholds).
HELDOUT_MARGINS = (1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0)
# The false drains per held-out rail-week step 6 chooses at (the reason: metrics.py).
HELDOUT_MAX_FALSE = metrics.HELDOUT_MAX_FALSE
# A factor must keep this share of the held-out warnings of the unraised thresholds: a margin
# trades some warnings for false drains, it does not turn the baseline off.
MARGIN_MIN_WARNED = 0.5


def choose_event_k(fs, start: baseline.BaselineParams, policy, budget: float,
                   ks=EVENT_KS, log=print) -> baseline.BaselineParams:
    """The k (from ``start``'s thresholds, each scaled by baseline.tune_events) whose drain
    decisions warn the most training failures within ``budget`` false drains per healthy
    rail-week (else the fewest false drains). Sample-level F1 favours k = 1 (its labels are the
    last 30 s); for drains a longer mean tells a creeping rise from a burst of a few samples."""
    best = None
    for k in ks:
        bl, ev = baseline.tune_events(fs, baseline.BaselineParams(start.thresholds, k), policy,
                                      max_false_per_week=budget, log=lambda *a: None)
        ok = ev["false_per_rail_week"] <= budget
        key = (1.0, ev["warned"], -ev["false_per_rail_week"]) if ok else \
            (0.0, -ev["false_per_rail_week"], ev["warned"])
        log(f"  baseline k={k} at {budget:g} false drains per training rail-week: thresholds "
            f"{np.round(bl.thresholds, 4).tolist()}, warned {ev['warned']}/{ev['precursor']} at "
            f"{ev['false_per_rail_week']:.2f}")
        if best is None or key > best[0]:
            best = (key, k)
    return baseline.BaselineParams(start.thresholds, best[1])


def fmt_margin(m) -> str:
    """Per-threshold factors for logs and the header: "[1.5, 1, 1, 1]"."""
    return "[" + ", ".join(f"{float(v):g}" for v in m) + "]"


def raise_thresholds(heldout, bl: baseline.BaselineParams, policy, max_false: float,
                     min_warned: float, log=print):
    """Per-threshold held-out margins: from ``bl``, raises one threshold at a time to its
    next factor of HELDOUT_MARGINS (each threshold's own factor, starting at 1) until the
    held-out false drains per rail-week are at or under ``max_false``. Each round, for every
    used threshold, the least next factor that lowers the held-out false drains is a
    candidate; a candidate that meets ``max_false`` ends the search (of several, the one that
    warns the most), else the one that removes the most false drains per held-out failure it
    stops warning (false drains removed / (warnings lost + 1)) is taken. A threshold that does
    not drain healthy rails is thus left where the training traces put it (raising every
    threshold together cost warnings for nothing: docs/PREDICTOR.md "Training"). Returns
    (factors float32 [4], held-out outcome), or None when no step lowers the false drains, or
    when the steps warn fewer than ``min_warned`` (or no) failures."""
    sm = baseline.levels(heldout.x, heldout.rail, bl.steps)
    fires = baseline.rise_fires(heldout.x, heldout.rail, bl.rise)
    seen: Dict[Tuple[float, ...], Dict[str, object]] = {}

    def outcome(f: np.ndarray) -> Dict[str, object]:
        key = tuple(float(v) for v in f)
        if key not in seen:
            th = (bl.thresholds * f).astype(np.float32)
            r = np.where(fires, np.float32(1), baseline.risk_from_smoothed(sm, th))
            seen[key] = metrics.drain_outcomes(heldout, r.astype(np.float32), policy)
        return seen[key]

    used = [i for i in range(4) if np.isfinite(bl.thresholds[i]) and bl.thresholds[i] > 0]
    f = np.ones(4, dtype=np.float32)
    cur = outcome(f)
    while True:
        cands = []
        for i in used:
            for m in (m for m in HELDOUT_MARGINS if m > f[i]):
                c = f.copy()
                c[i] = np.float32(m)
                o = outcome(c)
                if o["false_per_rail_week"] < cur["false_per_rail_week"]:
                    cands.append((c, o))
                    break
        if not cands:
            log(f"  baseline thresholds x{fmt_margin(f)}: no larger factor lowers the held-out "
                "false drains")
            return None
        met = [c for c in cands if c[1]["false_per_rail_week"] <= max_false]
        if met:
            c, o = max(met, key=lambda c: (c[1]["warned"], -c[1]["false_per_rail_week"]))
        else:
            def gain(c):
                drop = cur["false_per_rail_week"] - c[1]["false_per_rail_week"]
                lost = max(0, cur["warned"] - c[1]["warned"])
                return (drop / (lost + 1), drop, c[1]["warned"])
            c, o = max(cands, key=gain)
        enough = o["warned"] >= min_warned and o["warned"] > 0
        ok = bool(met) and enough
        log(f"  baseline thresholds x{fmt_margin(c)}: held-out warned {o['warned']}/"
            f"{o['precursor']} at {o['false_per_rail_week']:.2f} false drains per rail-week"
            f"{' (kept)' if ok else '' if enough else ' (warns too few)'}")
        if not enough:
            return None  # larger factors warn fewer still
        if ok:
            return c, o
        f, cur = c, o


def tune_baseline_budget(fs, start: baseline.BaselineParams, policy, max_false: float,
                         budgets: List[float], heldout=None, heldout_name: str = "",
                         log=print):
    """Step 6's event tuning. Without a held-out feature set: at ``max_false`` false drains
    per training rail-week. With one: the largest of ``budgets`` (training false drains per
    rail-week) whose thresholds keep the held-out set at or under ``max_false``. When none
    does, the smallest budget's thresholds, each raised by its own factor of HELDOUT_MARGINS
    (:func:`raise_thresholds`), while still warning at least MARGIN_MIN_WARNED of the held-out
    failures the unraised thresholds warned (when that fails: the smallest budget's, unraised).
    Both keep ``start``'s k (choose_event_k picks it). Returns (params, training outcome,
    {"budget", "margin": the factor on each threshold, "heldout": summary or None})."""
    if heldout is None:
        bl, ev = baseline.tune_events(fs, start, policy, max_false_per_week=max_false, log=log)
        return bl, ev, {"budget": max_false, "margin": [1.0] * 4, "heldout": None}
    chosen = None
    for b in sorted(budgets, reverse=True):
        bl, ev = baseline.tune_events(fs, start, policy, max_false_per_week=b,
                                      log=lambda *a: None)
        o = metrics.drain_outcomes(heldout, baseline.risk(heldout.x, heldout.rail, bl), policy)
        if not o["healthy_s"] > 0:
            raise ValueError(f"held-out traces {heldout_name or '(unnamed)'}: no healthy rail "
                             "(one without a failure) to count false drains on; the budget "
                             "check needs some")
        ok = o["false_per_rail_week"] <= max_false
        log(f"  baseline budget {b:g}/rail-week on training: thresholds "
            f"{np.round(bl.thresholds, 4).tolist()}; training warned {ev['warned']}/"
            f"{ev['precursor']} at {ev['false_per_rail_week']:.2f}; held-out warned "
            f"{o['warned']}/{o['precursor']} at {o['false_per_rail_week']:.2f} false drains "
            f"per rail-week{' (kept)' if ok else ''}")
        chosen = (bl, ev, {"budget": b, "margin": [1.0] * 4, "heldout": {
            "trace": heldout_name, "warned": o["warned"], "precursor": o["precursor"],
            "false_per_rail_week": round(o["false_per_rail_week"], 3), "target": max_false,
            "met": bool(ok)}})
        if ok:
            return chosen
    # No budget kept the held-out traces at the target; below the smallest the training
    # traces have nothing left to trade. Raise the smallest budget's thresholds, one by one.
    bl, ev, info = chosen
    raised = raise_thresholds(heldout, bl, policy, max_false,
                              MARGIN_MIN_WARNED * info["heldout"]["warned"], log)
    if raised is None:
        return chosen
    m, o = raised
    cand = baseline.BaselineParams((bl.thresholds * m).astype(np.float32), bl.steps,
                                   bl.rise.copy())
    ev = metrics.drain_outcomes(fs, baseline.risk(fs.x, fs.rail, cand), policy)
    info = {"budget": info["budget"], "margin": [round(float(v), 6) for v in m], "heldout": {
        **info["heldout"], "warned": o["warned"],
        "false_per_rail_week": round(o["false_per_rail_week"], 3), "met": True}}
    return cand, ev, info


def header_text(p: baseline.BaselineParams, ev: Dict[str, object], policy,
                budget: Dict[str, object], rise: Optional[Dict[str, object]] = None) -> str:
    def lit(v: float) -> str:
        if not np.isfinite(v):
            return "kBaselineUnused"
        text = f"{float(v):.9g}"
        return text + ("f" if any(ch in text for ch in ".e") else ".0f")  # 2f is not C++
    vals = ", ".join(lit(v) for v in p.thresholds)
    ho = budget.get("heldout")
    chosen = ""
    if ho:
        margin = budget.get("margin", [1.0] * 4)
        if not ho["met"]:
            how = "the smallest tried: none kept them at or under"
        elif any(float(v) != 1.0 for v in margin):
            how = (f"the smallest, whose thresholds x{fmt_margin(margin)} (raised one\n// "
                   "by one, the least that do) keep them at or under")
        else:
            how = "the largest that kept them at or under"
        chosen = (f"// Training budget {budget['budget']:g} false drains per rail-week, chosen on "
                  f"the held-out\n// traces ({ho['trace']}): {how}\n// "
                  f"{ho['target']:g} per rail-week (--heldout-max-false-per-week). There: "
                  f"warned {ho['warned']}/"
                  f"{ho['precursor']}, {ho['false_per_rail_week']:.2f} false\n"
                  "// drains per rail-week.\n")
    if rise:
        chosen += (f"// Rise rule chosen on the held-out traces: warned {rise['warned']}/"
                   f"{rise['precursor']} at\n// {rise['false_per_rail_week']:.2f} false drains "
                   f"per rail-week (without it {rise['off_warned']} at "
                   f"{rise['off_false_per_rail_week']:.2f}).\n")
    rise_vals = ", ".join(lit(v) for v in p.rise)
    return (
        "// Generated by scripts/predictor/train.py: the threshold baseline (docs/PREDICTOR.md\n"
        "// \"Baseline\"), tuned for drain decisions on the synthetic training traces (drain\n"
        f"// at {policy.threshold:g} for {policy.enter_samples} samples: warned "
        f"{ev['warned']}/{ev['precursor']}, {ev['false_per_rail_week']:.2f} false drains per\n"
        "// healthy rail-week).\n" + chosen +
        "// Do not edit by hand; re-run scripts/predictor/run_all.sh.\n"
        "// Thresholds apply to the mean of the last kBaselineSteps raw rows of features 0..3\n"
        "// (err_excess, err_slope, link_events, retrans_excess); kBaselineUnused (+inf)\n"
        "// turns one off. kBaselineRise: the rise rule (lag in rows, 0 = off; least rise;\n"
        "// ratio; level), model.h BaselineParams.\n"
        "#pragma once\n"
        "#include <limits>\n"
        "namespace r2ccl::predict {\n"
        "constexpr float kBaselineUnused = std::numeric_limits<float>::infinity();\n"
        + threshold_line(vals) +
        f"constexpr int kBaselineSteps = {int(p.steps)};\n"
        f"constexpr float kBaselineRise[4] = {{{rise_vals}}};\n"
        "}  // namespace r2ccl::predict\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="training trace CSV")
    features.add_source_args(ap)
    ap.add_argument("--epochs", type=int, default=30, help="epochs (default 30)")
    ap.add_argument("--horizon", type=float, default=120.0,
                    help="label horizon, seconds: a row is positive when its rail fails within "
                         "it (default 120: a drain must hold for R2CCL_PREDICT_ENTER_SAMPLES "
                         "samples and still come at least 30 s ahead)")
    ap.add_argument("--hidden", type=int, default=16,
                    help="LSTM hidden size H (default 16: as good as 32 on the validation rails "
                         "and a third of the inference cost)")
    ap.add_argument("--window", type=int, default=24, help="window W in rows (default 24)")
    ap.add_argument("--batch", type=int, default=256, help="minibatch size (default 256)")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    ap.add_argument("--neg-per-epoch", type=int, default=40000,
                    help="negative windows sampled per epoch (default 40000)")
    ap.add_argument("--pos-weight", type=float, default=0.0,
                    help="BCE weight of a positive; 0 = auto: (negatives per epoch / positives)"
                         " ** 0.5 (default 0)")
    ap.add_argument("--val-neg", type=int, default=0,
                    help="validation negatives scored after each epoch: a fixed sample of this "
                         "many, 0 = all (default 0; the final calibration always uses all)")
    ap.add_argument("--val-frac", type=float, default=0.2,
                    help="fraction of rails held out for epoch selection and calibration "
                         "(default 0.2)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="do not shift the dense bias to the validation's best-F1 point")
    ap.add_argument("--policy-threshold", type=float, default=metrics.Policy.threshold,
                    help="drain threshold the baseline is tuned for (default "
                         f"{metrics.Policy.threshold}, R2CCL_PREDICT_THRESHOLD's default)")
    ap.add_argument("--policy-enter", type=int, default=metrics.Policy.enter_samples,
                    help="enter samples the baseline is tuned for (default "
                         f"{metrics.Policy.enter_samples}, R2CCL_PREDICT_ENTER_SAMPLES's)")
    ap.add_argument("--max-false-per-week", type=float, default=1.0,
                    help="false drains per healthy rail-week the baseline may cost (default 1)")
    ap.add_argument("--heldout", help="held-out trace CSV (ours, never the frozen evaluation "
                                      "set): chooses the baseline's training budget (step 6)")
    ap.add_argument("--heldout-max-false-per-week", type=float, default=HELDOUT_MAX_FALSE,
                    help="with --heldout: the false drains per held-out rail-week the budget "
                         "and the rise rule are chosen at, a finite number >= 0 (default "
                         "%(default)g: under the 1 aimed at, see HELDOUT_MAX_FALSE)")
    ap.add_argument("--baseline-budgets", default="1,0.5,0.3,0.1,0",
                    help="with --heldout: training false drains per rail-week to try for the "
                         "baseline, comma list (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1, help="seed (default 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: faster than 2 for this model size on a "
                         "busy 2-core machine)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"weights file (default {DEFAULT_OUT})")
    ap.add_argument("--baseline-header", default=DEFAULT_HEADER,
                    help=f"generated C++ header (default {DEFAULT_HEADER}); '' = do not write")
    ap.add_argument("--summary-json", help="also write the run's numbers (times, sizes, metrics) "
                                           "here, for update_docs.py")
    ap.add_argument("--interval-s", type=float, default=0.0,
                    help="sampling interval recorded in the file; 0 = the trace's median step")
    args = ap.parse_args(argv)
    if args.hidden < 1 or args.hidden > 64 or args.window < 2 or args.epochs < 1:
        ap.error("need 1 <= --hidden <= 64, --window >= 2, --epochs >= 1")
    try:
        budgets = parse_budgets(args.baseline_budgets)
    except ValueError as e:
        ap.error(str(e))
    for name in ("max_false_per_week", "heldout_max_false_per_week"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0):
            ap.error(f"--{name.replace('_', '-')} {v:g}: need a finite number >= 0 (false "
                     "drains per healthy rail-week)")

    t_start = time.time()
    import torch  # imported late: --help works without torch
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)

    # 1-3: features, split, normalisation, windows
    try:
        fs = features.load_features(args.train, args.features_from, args.cpp_tool,
                                    args.horizon)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 1
    interval = args.interval_s or sampling_interval(fs)
    is_val = split_rails(fs.rail, args.val_frac, args.seed)
    fit_rows, val_rows = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    y = fs.label.astype(bool)
    log(f"train.py: {len(fs)} rows from {args.train} (features: {fs.source}), "
        f"{int(y.sum())} positive, {fs.event_t.size} failure events, interval {interval:g} s; "
        f"fit {fit_rows.size} rows, validation {val_rows.size} rows "
        f"({int(y[val_rows].sum())} positive)")
    norm = windows.Normaliser.fit(fs.x[fit_rows])
    xn = norm.apply(fs.x)
    widx = windows.window_index(fs.rail, args.window)
    t_feat = time.time()

    # 4: train
    model = torch_model.build_model(torch, args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs,
                                                       eta_min=args.lr / 20)
    pos = fit_rows[y[fit_rows]]
    neg = fit_rows[~y[fit_rows]]
    n_neg = min(args.neg_per_epoch, neg.size)
    pos_w = args.pos_weight or math.sqrt(n_neg / max(1, pos.size))
    log(f"training: H={args.hidden} W={args.window}, {pos.size} positives + {n_neg} sampled "
        f"negatives per epoch, positive weight {pos_w:.2f}, batch {args.batch}, "
        f"lr {args.lr:g}, {args.epochs} epochs, {args.threads} thread(s)")
    val_pos = val_rows[y[val_rows]]
    val_neg_all = val_rows[~y[val_rows]]
    n_val_neg = val_neg_all.size if args.val_neg <= 0 else min(args.val_neg, val_neg_all.size)
    val_neg = np.sort(rng.choice(val_neg_all, n_val_neg, replace=False))
    val_sub = np.concatenate([val_pos, val_neg])
    val_w = val_neg_all.size / max(1, val_neg.size)
    best = (-1.0, 0, None, 0.5)
    for epoch in range(1, args.epochs + 1):
        te = time.time()
        model.train()
        rows = np.concatenate([pos, rng.choice(neg, n_neg, replace=False)])
        rng.shuffle(rows)
        total = 0.0
        for s in range(0, rows.size, args.batch):
            b = rows[s:s + args.batch]
            xb = torch.from_numpy(windows.gather(xn, widx[b]))
            yb = torch.from_numpy(y[b].astype(np.float32))
            wb = torch.where(yb > 0, torch.tensor(pos_w), torch.tensor(1.0))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb, weight=wb,
                                                                        reduction="sum") / wb.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total += float(loss) * b.size
        sched.step()
        p_sub = torch_model.predict(torch, model, xn, widx, val_sub)
        thr, f1 = best_f1_threshold(fs.label[val_sub], p_sub, val_w)
        mark = ""
        if f1 > best[0]:
            best = (f1, epoch, {k: v.clone() for k, v in model.state_dict().items()}, thr)
            mark = " *"
        log(f"  epoch {epoch:3d}: loss {total / rows.size:.4f}, validation best F1 ~{f1:.4f} "
            f"at p >= {thr:.3f} ({time.time() - te:.1f} s){mark}")
    model.load_state_dict(best[2])
    t_train = time.time()
    log(f"kept epoch {best[1]} (validation F1 {best[0]:.4f}); training took "
        f"{t_train - t_feat:.1f} s")

    # 5: calibrate the decision point into the dense bias (on every validation row)
    p_val = torch_model.predict(torch, model, xn, widx, val_rows)
    p_star, f1_val = best_f1_threshold(fs.label[val_rows], p_val)
    p_star = min(max(p_star, 1e-6), 1 - 1e-6)
    shift = 0.0 if args.no_calibrate else \
        math.log(0.7 / 0.3) - math.log(p_star / (1 - p_star))
    with torch.no_grad():
        model.dense.bias += shift
    log(f"calibration: dense bias shifted by {shift:+.4f} (validation best-F1 threshold "
        f"{p_star:.4f} -> 0.7)")
    p_val = torch_model.predict(torch, model, xn, widx, val_rows)
    m_val = metrics.sample_metrics(fs.label[val_rows], p_val >= 0.7)

    # 6: the baseline, tuned on every training row
    tb = time.time()
    log("baseline: grid search over k and thresholds (all training rows)")
    bl, bl_f1 = baseline.tune(fs.x, fs.rail, fs.label, log=log)
    log(f"baseline: thresholds {bl.as_list()} for F1; now for drain decisions (threshold "
        f"{args.policy_threshold}, {args.policy_enter} samples, <= "
        f"{args.heldout_max_false_per_week if args.heldout else args.max_false_per_week} "
        f"false drains per healthy {'held-out' if args.heldout else 'training'} rail-week)")
    policy = metrics.Policy(threshold=args.policy_threshold, enter_samples=args.policy_enter)
    ho = None
    if args.heldout:
        ho = features.load_features(args.heldout, args.features_from, args.cpp_tool,
                                    args.horizon)
    # k is at most the window: the C++ averages min(k, rows in the window) (model.cc).
    bl = choose_event_k(fs, bl, policy, max(budgets) if ho is not None
                        else args.max_false_per_week,
                        ks=[k for k in EVENT_KS if k <= args.window], log=log)
    try:
        bl, bl_events, bl_budget = tune_baseline_budget(
            fs, bl, policy,
            args.heldout_max_false_per_week if ho is not None else args.max_false_per_week,
            budgets, ho,
            os.path.basename(args.heldout or ""), log)
    except ValueError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 1
    rise_info = None
    if ho is not None:
        # The rise rule needs its rail's last 2L + 1 rows in the C++ window (model.cc).
        grid = [g for g in baseline.RISE_GRID if 2 * g[0] + 1 <= args.window]
        bl, rise_info = baseline.choose_rise(ho, bl, policy, bl_budget["heldout"]["target"],
                                             grid, log=log)
        bl_events = metrics.drain_outcomes(fs, baseline.risk(fs.x, fs.rail, bl), policy)
    else:
        log("  rise rule: off (it is chosen on held-out traces: --heldout)")
    bl_alarm = baseline.risk(fs.x, fs.rail, bl) >= metrics.DRAIN
    m_bl_val = metrics.sample_metrics(fs.label[val_rows], bl_alarm[val_rows])
    log(f"baseline: thresholds {bl.as_list()}, k={bl.steps}, training F1 {bl_f1:.4f} "
        f"({time.time() - tb:.1f} s)")
    log(f"validation rails: LSTM F1 {m_val['f1']:.4f} (P {m_val['precision']:.3f} "
        f"R {m_val['recall']:.3f}); baseline F1 {m_bl_val['f1']:.4f} "
        f"(P {m_bl_val['precision']:.3f} R {m_bl_val['recall']:.3f})")

    # 7: export
    sd = model.state_dict()
    meta: Dict[str, object] = {
        "format": "r2ccl lstm v1",
        "git_commit": git_commit(),
        "seed": args.seed,
        "data": {"train_trace": os.path.basename(args.train),
                 "trace_header": trace_comments(args.train), "features_from": fs.source,
                 "rows": len(fs), "positives": int(y.sum()), "events": int(fs.event_t.size)},
        "training": {"epochs": args.epochs, "kept_epoch": best[1], "hidden": args.hidden,
                     "window": args.window, "batch": args.batch, "lr": args.lr,
                     "neg_per_epoch": n_neg, "pos_weight": round(pos_w, 4),
                     "val_frac": args.val_frac, "calibration_bias_shift": round(shift, 6),
                     "torch": torch.__version__},
        "metrics": {"val_f1": round(m_val["f1"], 4),
                    "val_precision": round(m_val["precision"], 4),
                    "val_recall": round(m_val["recall"], 4),
                    "baseline_train_f1": round(bl_f1, 4),
                    "baseline_val_f1": round(m_bl_val["f1"], 4)},
        "baseline": {"thresholds": bl.as_list(), "steps": bl.steps,
                     "tuned_for": {"threshold": args.policy_threshold,
                                   "enter_samples": args.policy_enter,
                                   "warned": bl_events["warned"],
                                   "precursor": bl_events["precursor"],
                                   "false_per_rail_week":
                                       round(bl_events["false_per_rail_week"], 3),
                                   "training_budget_per_rail_week": bl_budget["budget"],
                                   "heldout_margin": bl_budget["margin"],
                                   "heldout": bl_budget.get("heldout")},
                     "rise": bl.rise_dict(), "rise_choice": rise_info},
        "features": list(features.FEATURE_NAMES),
    }
    w = weights.LstmWeights(
        n_features=features.N_FEATURES, hidden=args.hidden, window=args.window,
        horizon_s=int(args.horizon), interval_s=interval, mean=norm.mean, std=norm.std,
        thresholds=bl.thresholds, steps=bl.steps, rise=bl.rise,
        weight_ih=sd["lstm.weight_ih_l0"].numpy(), weight_hh=sd["lstm.weight_hh_l0"].numpy(),
        bias_ih=sd["lstm.bias_ih_l0"].numpy(), bias_hh=sd["lstm.bias_hh_l0"].numpy(),
        dense_w=sd["dense.weight"].numpy().reshape(-1), dense_b=float(sd["dense.bias"][0]),
        metadata=meta)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    size = weights.write(args.out, w)
    back = weights.read(args.out)  # verifies the CRC and the layout
    check = val_rows[:4096]
    diff = float(np.max(np.abs(lstm_ref.infer(back, windows.gather(xn, widx[check])) -
                               p_val[:check.size])))
    log(f"wrote {args.out}: {size} bytes (limit {weights.MAX_BYTES}); read back, CRC ok; "
        f"numpy vs torch max |diff| {diff:.2e} over {check.size} windows")
    if size >= weights.MAX_BYTES or diff > 1e-4:
        print("train.py: export check failed", file=sys.stderr)
        return 1
    if args.baseline_header:
        with open(args.baseline_header, "w", encoding="utf-8") as f:
            f.write(header_text(bl, bl_events, policy, bl_budget, rise_info))
        log(f"wrote {args.baseline_header}")
    t_end = time.time()
    log(f"time: features {t_feat - t_start:.1f} s, LSTM training {t_train - t_feat:.1f} s, "
        f"baseline tuning + export {t_end - t_train:.1f} s, total {t_end - t_start:.1f} s")
    if args.summary_json:
        H, F = args.hidden, features.N_FEATURES
        summary = {
            "train_py_s": round(t_end - t_start, 1), "lstm_training_s": round(t_train - t_feat, 1),
            "epochs": args.epochs, "kept_epoch": best[1], "threads": args.threads,
            "features_from": fs.source, "hidden": H, "window": args.window,
            "n_params": int(sum(p.numel() for p in model.parameters())), "file_bytes": size,
            "macs_per_window": args.window * 4 * H * (F + H) + H,
            "rows": len(fs), "positives": int(y.sum()), "events": int(fs.event_t.size),
            "val_frac": args.val_frac, "metrics": meta["metrics"], "baseline": meta["baseline"]}
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
