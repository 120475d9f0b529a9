#!/usr/bin/python3
"""Deltas, the eight features and the labels of a trace (docs/PREDICTOR.md), in numpy.

The single source of truth for features is the C++ tool (``r2ccl_predict --features``); this
module is its reference re-implementation and cross-check, and the fallback while the tool is
not built. It follows the C++ code (predictor/src/counters.cc, features.cc, trace.cc) rule for
rule:

Deltas (per counter column, against the previous row of the same rail, whatever its link
state):
  - previous or current reading missing: delta 0. The missing reading becomes the "previous"
    one, so the next reading only re-primes the counter (its delta is 0 as well);
  - current >= previous: current - previous (a saturated counter stuck at its maximum
    therefore reads 0 until it is reset);
  - a wrapping counter that went down by more than half its range (and whose previous value
    fits the width): wrapped, delta = (current - previous) mod 2^bits;
  - any other decrease: a reset, delta = current (the count since the reset).
A rail's first row only primes the deltas and produces no step.

Features (one float32 row per step whose row has link up; dt = t - t_prev in seconds; rates
per second; computed in float64 and rounded to float32 like the C++):
  0 log1p(retrans / dt)
  1 min(100, 100 * retrans / max(1, tx_packets))            percent
  2 log1p((symbol_err + rcv_err + crc_err) / dt)
  3 log1p((link_recovery + link_downed + integrity) / dt)
  4 log1p(buf_overrun / dt)
  5 clip(max(tx_bytes, rx_bytes) * 8 / dt / (speed_mbps * 1e6), 0, 1.5); 0 with no speed
  6 f2 - f2 of the rail's previous feature row (float32; 0 at the rail's first row)
  7 f0 - f0 of the rail's previous feature row (float32; 0 at the rail's first row)
Link-down steps produce no row and do not reset the previous row used by 6 and 7.

Failure events: a row with link 0 whose previous row of the same rail has link 1 (a rail whose
first row is down has no event there). Label of a feature row at time t: 1 when a failure
event of its rail has t < t_fail <= t + horizon (30 s).

Output (``--out FILE.npz``; the same arrays ``r2ccl_predict --features`` writes):
  x        float32 [N, 8]  unnormalised feature rows, trace order
  rail     int32   [N]     rail index (order of first appearance in the trace)
  t        float64 [N]     seconds
  label    int8    [N]     1 = failure within the horizon
  scenario int32   [N]     index into ``scenarios`` (-1 without a scenario column)
  scenarios str    [S]
  event_t  float64 [E]     failure event times (trace order)
  event_rail int32 [E]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional

import numpy as np

import tracefile

N_FEATURES = 8
HORIZON_S = 30.0
FEATURE_NAMES = ("retrans_rate", "retrans_pct", "phy_err_rate", "link_instability",
                 "buf_overrun_rate", "utilisation", "phy_err_delta", "retrans_delta")
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_CPP_TOOL = os.path.join(REPO_ROOT, "build", "bin", "r2ccl_predict")
_C = {name: i for i, name in enumerate(tracefile.COUNTERS)}


@dataclasses.dataclass
class FeatureSet:
    """The features, labels and failure events of one trace (see the module docstring)."""

    x: np.ndarray
    rail: np.ndarray
    t: np.ndarray
    label: np.ndarray
    scenario: np.ndarray
    scenarios: List[str]
    event_t: np.ndarray
    event_rail: np.ndarray
    rails: Optional[List[str]] = None  # names, when the source knows them
    source: str = "python"

    def __len__(self) -> int:
        return int(self.t.shape[0])

    def save_npz(self, path: str) -> None:
        np.savez(path, x=self.x, rail=self.rail, t=self.t, label=self.label,
                 scenario=self.scenario, scenarios=np.array(self.scenarios, dtype=str),
                 event_t=self.event_t, event_rail=self.event_rail)

    def event_scenarios(self) -> List[str]:
        """The scenario of each failure event: that of its rail's last feature row before it
        ("?" when the rail has none)."""
        out = []
        for et, er in zip(self.event_t, self.event_rail):
            rows = np.flatnonzero((self.rail == er) & (self.t < et))
            s = int(self.scenario[rows[-1]]) if rows.size else -1
            out.append(self.scenarios[s] if 0 <= s < len(self.scenarios) else "?")
        return out

    def validate(self, what: str) -> None:
        """Checks shapes and dtypes; raises ValueError naming ``what``."""
        n = len(self)
        checks = [
            (self.x.shape == (n, N_FEATURES), f"x has shape {self.x.shape}, expected ({n}, 8)"),
            (self.rail.shape == (n,) and self.label.shape == (n,) and self.scenario.shape == (n,),
             "rail/label/scenario lengths differ from t"),
            (self.event_t.shape == self.event_rail.shape, "event_t and event_rail differ"),
            (bool(np.all(np.isfinite(self.x))), "x holds NaN or infinite values"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"{what}: {msg}")


def previous_row_index(rail: np.ndarray) -> np.ndarray:
    """For each row, the index of the previous row of the same rail (-1 for a rail's first)."""
    n = rail.shape[0]
    order = np.lexsort((np.arange(n), rail))
    prev = np.full(n, -1, dtype=np.int64)
    same = rail[order][1:] == rail[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def counter_deltas(prev_v: np.ndarray, prev_ok: np.ndarray, cur_v: np.ndarray,
                   cur_ok: np.ndarray, width: tracefile.Width) -> np.ndarray:
    """Deltas (uint64) of one counter column, by the rules in the module docstring."""
    mx = np.uint64(width.max_value)
    half = np.uint64(1 << (width.bits - 1))
    with np.errstate(over="ignore"):
        up = cur_v >= prev_v
        drop = prev_v - cur_v  # only meaningful where not up
        wrapped = (~up) & (drop > half) & (prev_v <= mx) if not width.saturating else \
            np.zeros_like(up)
        d = np.where(up, cur_v - prev_v, np.where(wrapped, (cur_v - prev_v) & mx, cur_v))
    return np.where(prev_ok & cur_ok, d, np.uint64(0)).astype(np.uint64)


def compute_features(tr: tracefile.Trace, horizon_s: float = HORIZON_S) -> FeatureSet:
    """The feature rows, labels and failure events of a parsed trace."""
    prev = previous_row_index(tr.rail)
    has_step = prev >= 0
    p = np.where(has_step, prev, 0)
    deltas = np.zeros(tr.values.shape, dtype=np.float64)
    rail_widths = tr.rail_widths or [list(tr.widths)] * len(tr.rails)
    for c, name in enumerate(tracefile.COUNTERS):
        # Rails may read a counter with different widths ("# widths for PREFIX:").
        per_rail = [w[c] for w in rail_widths]
        for width in set(per_rail):
            rails_w = [i for i, w in enumerate(per_rail) if w == width]
            rows_w = np.isin(tr.rail, rails_w)
            d = counter_deltas(tr.values[p, c], tr.present[p, c] & has_step, tr.values[:, c],
                               tr.present[:, c], width)
            deltas[rows_w, c] = d[rows_w].astype(np.float64)

    rows = np.flatnonzero(has_step & tr.link)
    d = deltas[rows]
    dt = (tr.t[rows] - tr.t[p[rows]])
    speed = tr.speed_mbps[rows]
    x64 = np.zeros((rows.size, N_FEATURES), dtype=np.float64)
    x64[:, 0] = np.log1p(d[:, _C["retrans"]] / dt)
    x64[:, 1] = np.minimum(100.0, 100.0 * d[:, _C["retrans"]] /
                           np.maximum(1.0, d[:, _C["tx_packets"]]))
    x64[:, 2] = np.log1p((d[:, _C["symbol_err"]] + d[:, _C["rcv_err"]] + d[:, _C["crc_err"]]) / dt)
    x64[:, 3] = np.log1p((d[:, _C["link_recovery"]] + d[:, _C["link_downed"]] +
                          d[:, _C["integrity"]]) / dt)
    x64[:, 4] = np.log1p(d[:, _C["buf_overrun"]] / dt)
    with np.errstate(divide="ignore", invalid="ignore"):
        util = np.maximum(d[:, _C["tx_bytes"]], d[:, _C["rx_bytes"]]) * 8.0 / dt / \
            (speed * 1e6)
    x64[:, 5] = np.where(speed > 0, np.clip(np.nan_to_num(util), 0.0, 1.5), 0.0)
    x = x64.astype(np.float32)

    # Features 6 and 7: differences against the rail's previous feature row.
    rail = tr.rail[rows]
    prev_row = previous_row_index(rail)
    first = prev_row < 0
    pr = np.where(first, 0, prev_row)
    x[:, 6] = np.where(first, np.float32(0), x[:, 2] - x[pr, 2])
    x[:, 7] = np.where(first, np.float32(0), x[:, 0] - x[pr, 0])

    # Failure events and labels.
    ev = np.flatnonzero(has_step & ~tr.link & tr.link[p])
    event_t = tr.t[ev]
    event_rail = tr.rail[ev].astype(np.int32)
    t = tr.t[rows]
    label = np.zeros(rows.size, dtype=np.int8)
    for r in np.unique(event_rail):
        et = np.sort(event_t[event_rail == r])
        sel = np.flatnonzero(rail == r)
        k = np.searchsorted(et, t[sel], side="right")  # first event > t
        nxt = np.where(k < et.size, et[np.minimum(k, et.size - 1)], np.inf)
        label[sel] = (nxt <= t[sel] + horizon_s).astype(np.int8)
    return FeatureSet(x=x, rail=rail.astype(np.int32), t=t, label=label,
                      scenario=tr.scenario[rows].astype(np.int32), scenarios=list(tr.scenarios),
                      event_t=event_t, event_rail=event_rail, rails=list(tr.rails),
                      source="python")


def load_feature_file(path: str) -> FeatureSet:
    """Reads features written by this module (.npz) or by r2ccl_predict (.npz, or a
    directory of .npy files plus meta.json)."""
    if os.path.isdir(path):
        def arr(name):
            f = os.path.join(path, name + ".npy")
            if not os.path.exists(f):
                raise ValueError(f"{path}: no {name}.npy (expected x, rail, t, label, scenario, "
                                 "event_t, event_rail .npy files and meta.json)")
            return np.load(f, allow_pickle=False)
        meta = {}
        if os.path.exists(os.path.join(path, "meta.json")):
            with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
                meta = json.load(f)
        fs = FeatureSet(x=arr("x"), rail=arr("rail"), t=arr("t"), label=arr("label"),
                        scenario=arr("scenario"), scenarios=list(meta.get("scenarios", [])),
                        event_t=arr("event_t"), event_rail=arr("event_rail"),
                        rails=meta.get("rails"), source="cpp")
    else:
        with np.load(path, allow_pickle=False) as z:
            missing = {"x", "rail", "t", "label", "scenario", "scenarios", "event_t",
                       "event_rail"} - set(z.files)
            if missing:
                raise ValueError(f"{path}: missing arrays {sorted(missing)}")
            fs = FeatureSet(x=z["x"], rail=z["rail"], t=z["t"], label=z["label"],
                            scenario=z["scenario"], scenarios=[str(s) for s in z["scenarios"]],
                            event_t=z["event_t"], event_rail=z["event_rail"],
                            rails=[str(s) for s in z["rails"]] if "rails" in z.files else None,
                            source="file")
    fs.x = fs.x.astype(np.float32, copy=False)
    fs.validate(path)
    return fs


def cpp_features(trace_path: str, tool: str = DEFAULT_CPP_TOOL,
                 horizon_s: float = HORIZON_S) -> FeatureSet:
    """Runs ``r2ccl_predict --features`` and reads its output."""
    tmp = tempfile.mkdtemp(prefix="r2ccl-feats-")
    try:
        out = os.path.join(tmp, "feats.npz")
        cmd = [tool, "--features", trace_path, "--out", out, "--horizon", str(horizon_s)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {res.returncode}): "
                               f"{res.stderr.strip()}")
        fs = load_feature_file(out)
        fs.source = "cpp"
        return fs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_source(source: str, tool: str = DEFAULT_CPP_TOOL) -> str:
    """'auto' -> 'cpp' when the C++ tool exists, else 'python'."""
    if source == "auto":
        return "cpp" if os.access(tool, os.X_OK) else "python"
    if source == "cpp" and not os.access(tool, os.X_OK):
        raise FileNotFoundError(f"--features-from cpp: {tool} does not exist or is not "
                                "executable (build it: cmake --build build --target r2ccl_predict)")
    return source


def load_features(trace_path: str, source: str = "auto", tool: str = DEFAULT_CPP_TOOL,
                  horizon_s: float = HORIZON_S) -> FeatureSet:
    """Features of a trace from the C++ tool or from this module (``source``: auto, cpp,
    python). The rail names always come from the trace itself."""
    src = resolve_source(source, tool)
    if src == "cpp":
        fs = cpp_features(trace_path, tool, horizon_s)
        if fs.rails is None:
            fs.rails = tracefile.read_trace(trace_path).rails
        return fs
    return compute_features(tracefile.read_trace(trace_path), horizon_s)


def add_source_args(p: argparse.ArgumentParser) -> None:
    """The --features-from / --cpp-tool options shared by the CLIs."""
    p.add_argument("--features-from", choices=("auto", "cpp", "python"), default="auto",
                   help="who computes the features: the C++ tool r2ccl_predict (the source of "
                        "truth) or features.py; auto = cpp when the tool exists (default)")
    p.add_argument("--cpp-tool", default=DEFAULT_CPP_TOOL,
                   help=f"path of r2ccl_predict (default {DEFAULT_CPP_TOOL})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Rules: see the module docstring and docs/PREDICTOR.md.")
    p.add_argument("--trace", required=True, help="trace CSV (docs/PREDICTOR.md format)")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--horizon", type=float, default=HORIZON_S,
                   help="label horizon in seconds (default 30)")
    args = p.parse_args(argv)
    try:
        fs = compute_features(tracefile.read_trace(args.trace), args.horizon)
    except (tracefile.TraceError, OSError) as e:
        print(f"features.py: {e}", file=sys.stderr)
        return 1
    fs.save_npz(args.out)
    print(f"features.py: {len(fs)} rows ({int(fs.label.sum())} positive), "
          f"{len(fs.rails or [])} rails, {fs.event_t.size} failure events -> {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
