#!/usr/bin/python3
"""Writes the C++ test fixtures for the shipped model (tests/predictor/fixtures/).

lstm_fixture.txt   20 normalised input windows [W=24 x F=8] taken from the held-out trace
                   (left-padded ones included) and PyTorch's float32 output for each.
trace_small.csv    a short trace: an optical failure (with symbol_err saturating), a counter
                   reset, wrapping retrans and tx_bytes counters, a flapping link and a healthy
                   link with missing (N/A) readings.
trace_small_golden.txt
                   per scored row of trace_small.csv: the raw features, the label, PyTorch's
                   risk of the window ending at the row and the baseline's risk.

Formats (all text, numbers printed with %.9g so float32 values round-trip exactly):

lstm_fixture.txt:
    # r2ccl lstm fixture v1
    # ... comment lines (model file, its CRC-32, how the cases were chosen) ...
    case 0
    <24 lines of 8 space-separated numbers: the normalised window, oldest row first;
     all-zero rows at the top are the left padding>
    out 0.0123456789
    case 1
    ...
  A '#' line may precede any case (it says where the window came from).

trace_small_golden.txt:
    # r2ccl trace golden v1
    # ... comment lines ...
    rail,t_s,f0,f1,f2,f3,f4,f5,f6,f7,label,lstm,baseline
    n000-mlx5_0:1,10.123,...
  one line per scored row (link-up step) in trace order; t_s as in the trace (%.3f); lstm =
  torch.sigmoid output for the window of the last 24 rows of the rail ending at that row,
  normalised with the file's mean/std and left-padded with zero rows; baseline = the
  baseline risk with the file's thresholds and k.

Example:
  export_fixtures.py --model predictor/model/r2ccl_lstm.bin --heldout heldout.csv
"""

from __future__ import annotations

import argparse
import os
import sys
import struct
from typing import Dict, List, Tuple

import numpy as np

import baseline
import features
import gen_traces
import torch_model
import tracefile
import weights
import windows

REPO_ROOT = features.REPO_ROOT
DEFAULT_DIR = os.path.join(REPO_ROOT, "tests", "predictor", "fixtures")
N_CASES = 20


def _g(v: float) -> str:
    return "%.9g" % float(v)


def file_crc(path: str) -> str:
    """The CRC-32 a weights file carries in its last 4 bytes (of every byte before them): it
    names the model. (The CRC-32 of the whole file, that CRC included, is the same constant,
    0x2144df1c, for every intact file.)"""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for a weights file")
    return "0x%08x" % struct.unpack("<I", data[-4:])[0]


def pick_cases(fs: features.FeatureSet, xn: np.ndarray, widx: np.ndarray, torch, model,
               seed: int) -> List[Tuple[int, str]]:
    """(row, why) for the fixture windows: padded ones, the riskiest positives, windows with
    extreme inputs, and random rows."""
    rng = np.random.default_rng(seed)
    pad = (widx < 0).sum(axis=1)
    cases: List[Tuple[int, str]] = []
    for p in (23, 22, 20, 16, 8, 1):  # rows of padding
        cand = np.flatnonzero(pad == p)
        if cand.size:
            cases.append((int(rng.choice(cand)), f"left-padded: {p} zero rows"))
    pos = np.flatnonzero(fs.label == 1)
    if pos.size:
        r = torch_model.predict(torch, model, xn, widx, pos)
        for i in pos[np.argsort(-r)[:5]]:
            cases.append((int(i), "a positive row (failure within 30 s), high risk"))
    extreme = np.abs(xn).max(axis=1)
    for i in np.argsort(-extreme)[:3]:
        cases.append((int(i), f"window ending at an extreme input (|x| {extreme[i]:.1f})"))
    taken = {c[0] for c in cases}
    while len(cases) < N_CASES:
        i = int(rng.integers(0, len(fs)))
        if i not in taken:
            taken.add(i)
            cases.append((i, "a random row"))
    return cases[:N_CASES]


def write_lstm_fixture(path: str, model_path: str, w: weights.LstmWeights,
                       fs: features.FeatureSet, heldout: str, seed: int, torch) -> None:
    xn = windows.Normaliser(w.mean, w.std).apply(fs.x)
    widx = windows.window_index(fs.rail, w.window)
    model = torch_model.from_weights(torch, w)
    cases = pick_cases(fs, xn, widx, torch, model, seed)
    rows = np.array([c[0] for c in cases])
    wins = windows.gather(xn, widx[rows])
    with torch.no_grad():
        out = torch.sigmoid(model(torch.from_numpy(wins))).numpy()
    lines = ["# r2ccl lstm fixture v1",
             f"# model: {os.path.basename(model_path)} (file CRC-32 {file_crc(model_path)}), "
             f"features {w.n_features}, hidden {w.hidden}, window {w.window}",
             f"# windows from {os.path.basename(heldout)} (features: {fs.source}), already "
             "normalised with the file's mean/std; zero rows at the top are left padding",
             "# out: torch.sigmoid(dense(h_W)) in float32 (PyTorch "
             f"{torch.__version__}); compare with a tolerance of ~1e-5",
             "# format: 'case N', 24 lines of 8 numbers (oldest row first), 'out P'"]
    for k, ((row, why), win, p) in enumerate(zip(cases, wins, out)):
        rail = fs.rails[fs.rail[row]] if fs.rails else str(fs.rail[row])
        lines.append(f"# {why}; rail {rail}, t_s {fs.t[row]:.3f}, label {fs.label[row]}")
        lines.append(f"case {k}")
        lines += [" ".join(_g(v) for v in r) for r in win]
        lines.append(f"out {_g(p)}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


# The small trace's rails: (name, scenario, starting readings that force wraps/saturation).
SMALL_RAILS = (
    ("n000-mlx5_0:1", "optical", {"symbol_err": 64000}),
    ("n000-mlx5_1:1", "reset", {"retrans": 1000}),
    ("n000-mlx5_2:1", "congestion", {"retrans": (1 << 32) - 400,
                                     "tx_bytes": (1 << 64) - 2 * 10**12}),
    ("n000-mlx5_3:1", "flap", {}),
    ("n000-mlx5_4:1", "healthy", {}),
)
SMALL_DURATION_S = 900.0
SMALL_INTERVAL_S = 5.0


def small_trace_rows(seed: int) -> List[List[str]]:
    rng = np.random.default_rng(seed)
    n = int(SMALL_DURATION_S / SMALL_INTERVAL_S) + 1
    out = []
    for k, (name, scen, starts) in enumerate(SMALL_RAILS):
        t = k * 0.7 + np.arange(n) * SMALL_INTERVAL_S + rng.uniform(-0.1, 0.1, n)
        tt, rows = gen_traces.simulate_rail(rng, scen, gen_traces.PARAMS["train"], t,
                                            np.ones(n), 0.0, starts)
        if scen == "healthy":  # a few missing readings
            for i, c in ((40, 5), (41, 5), (90, 0), (120, 3)):
                rows[i][2 + c] = "N/A" if i != 41 else ""
        out += [[f"{ti:.3f}", name] + r + [scen] for ti, r in zip(tt, rows)]
    out.sort(key=lambda r: (float(r[0]), r[1]))
    return out


def small_trace_ok(path: str) -> List[str]:
    """What the small trace lacks of its purpose (empty when it has it all)."""
    tr = tracefile.read_trace(path)
    fs = features.compute_features(tr)
    missing = []
    C = {c: i for i, c in enumerate(tracefile.COUNTERS)}
    ev = [tr.rails[r] for r in fs.event_rail]
    if "n000-mlx5_0:1" not in ev:
        missing.append("an optical failure")
    if "n000-mlx5_3:1" not in ev:
        missing.append("a flap")
    def rail_vals(name, c):
        sel = tr.rail == tr.rails.index(name)
        return tr.values[sel, C[c]].astype(np.float64)
    if not np.any(rail_vals("n000-mlx5_0:1", "symbol_err") == 65535):
        missing.append("a saturated symbol_err")
    v = rail_vals("n000-mlx5_1:1", "tx_packets")
    if not np.any(np.diff(v) < 0):
        missing.append("a counter reset")
    for c in ("retrans", "tx_bytes"):
        v = rail_vals("n000-mlx5_2:1", c)
        if not np.any(np.diff(v) < -2.0 ** 31):
            missing.append(f"a {c} wrap")
    return missing


def write_small_trace(path: str, seed: int) -> int:
    """Writes trace_small.csv with the first seed >= ``seed`` that has every case."""
    for s in range(seed, seed + 200):
        tracefile.write_trace(path, [
            "r2ccl fixture trace (scripts/predictor/export_fixtures.py): an optical failure with "
            "symbol_err saturating, a counter reset, retrans and tx_bytes wrapping, a flapping "
            "link, a healthy link with N/A readings",
            f"seed={s} duration_s={SMALL_DURATION_S:g} interval_s={SMALL_INTERVAL_S:g} "
            "params=train"], gen_traces.WIDTHS, small_trace_rows(s))
        if not small_trace_ok(path):
            return s
    raise RuntimeError(f"no seed in {seed}..{seed + 199} gives a small trace with every case: "
                       f"{small_trace_ok(path)}")


def write_golden(path: str, trace: str, model_path: str, w: weights.LstmWeights,
                 fs: features.FeatureSet, torch) -> None:
    xn = windows.Normaliser(w.mean, w.std).apply(fs.x)
    widx = windows.window_index(fs.rail, w.window)
    model = torch_model.from_weights(torch, w)
    risk = torch_model.predict(torch, model, xn, widx, np.arange(len(fs)))
    base = baseline.risk(fs.x, fs.rail, baseline.BaselineParams.of(w))
    lines = ["# r2ccl trace golden v1",
             f"# trace: {os.path.basename(trace)}; model: {os.path.basename(model_path)} "
             f"(file CRC-32 {file_crc(model_path)}); features: {fs.source}",
             "# one line per scored row (link-up step after the rail's first row), trace order;",
             f"# f0..f{features.N_FEATURES - 1} raw features (float32), label 1 = failure "
             "within 30 s, lstm = PyTorch float32 risk, baseline = baseline risk",
             "rail,t_s," + ",".join(f"f{i}" for i in range(features.N_FEATURES)) +
             ",label,lstm,baseline"]
    for i in range(len(fs)):
        lines.append(",".join([fs.rails[fs.rail[i]], f"{fs.t[i]:.3f}"] +
                              [_g(v) for v in fs.x[i]] +
                              [str(int(fs.label[i])), _g(risk[i]), _g(base[i])]))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "predictor", "model",
                                                    "r2ccl_lstm.bin"),
                    help="the shipped weights file")
    ap.add_argument("--heldout", required=True, help="held-out trace the windows come from")
    features.add_source_args(ap)
    ap.add_argument("--out-dir", default=DEFAULT_DIR, help=f"default {DEFAULT_DIR}")
    ap.add_argument("--seed", type=int, default=7, help="seed (default 7)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    try:
        w = weights.read(args.model)
        fs = features.load_features(args.heldout, args.features_from, args.cpp_tool)
        os.makedirs(args.out_dir, exist_ok=True)
        fx = os.path.join(args.out_dir, "lstm_fixture.txt")
        write_lstm_fixture(fx, args.model, w, fs, args.heldout, args.seed, torch)
        small = os.path.join(args.out_dir, "trace_small.csv")
        used = write_small_trace(small, args.seed)
        fs_small = features.load_features(small, args.features_from, args.cpp_tool)
        golden = os.path.join(args.out_dir, "trace_small_golden.txt")
        write_golden(golden, small, args.model, w, fs_small, torch)
    except (weights.WeightsError, ValueError, OSError, RuntimeError) as e:
        print(f"export_fixtures.py: {e}", file=sys.stderr)
        return 1
    print(f"export_fixtures.py: wrote {fx} ({N_CASES} cases), {small} (seed {used}, "
          f"{len(fs_small)} scored rows, {fs_small.event_t.size} failure events), {golden}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
