#!/usr/bin/python3
"""Deltas, the eleven features and the labels of a trace (docs/PREDICTOR.md), in numpy.

The single source of truth for features is the C++ tool (``r2ccl_predict --features``); this
module is its reference re-implementation and cross-check, and the fallback while the tool is
not built. It follows the C++ code (predictor/src/counters.cc, features.cc, trace.cc) rule for
rule:

Deltas (per counter column, against the previous row of the same rail, whatever its link
state):
  - previous or current reading missing: delta 0. The missing reading becomes the "previous"
    one, so the next reading only re-primes the counter (its delta is 0 as well);
  - current >= previous: current - previous;
  - a wrapping counter that went down by more than half its range (and whose previous value
    fits the width): wrapped, delta = (current - previous) mod 2^bits;
  - any other decrease: a reset, delta = current (the count since the reset);
  - a row in which any counter of the rail was reset: the counters that seem to have wrapped
    in it were reset too (a port's counters are reset together), delta = current
    (counters.h, settle_resets).
A rail's first row only primes the deltas and produces no step.

Usable deltas: a delta is usable when both readings are present and the counter is not
saturated (a saturating counter reading its maximum counts nothing more: unknown, not 0).

Features (one float32 row per step whose row has link up; dt = t - t_prev in seconds; rates
per second; computed in float64 and rounded to float32 like the C++), each counter judged
against the rail's own history (predictor/include/r2ccl/predict/features.h):
  per error counter (symbol_err, rcv_err, crc_err, fec_corr_blocks, fec_uncorr_blocks,
  fec_corr_bits) and for retrans, over its usable steps: x = the median of log1p(delta / dt)
  and the two before it (of the first two, the lower; the first alone);
  fast += g(30 s) (x - fast); slow += g(120 s) (x - slow); floor += g(1800 s if fast > floor
  else 120 s) (fast - floor), with g(tau) = 1 - exp(-dt / tau) and all three = x at the
  counter's first usable step; excess = fast - floor; slope = (fast - slow) / 90 * 60;
  accel = slope - slope_avg, then slope_avg += g(120 s) (slope - slope_avg).
  A usable delta that is a count since a reset (a reset or a settled wrap) covers an unknown
  part of the step, so it is not a rate: the counter's history is not stepped, and the row
  takes excess, slope and accel from where it stands (accel = slope - slope_avg); a counter
  with no history yet is left out of the row and starts at its next usable step.
  0 err_excess      max over the error counters usable this step (0 if none)
  1 err_slope       max over them of slope
  2 link_events     EWMA g(30 s) of log1p((link_recovery + link_downed + integrity) / dt)
  3 retrans_excess  retrans's excess (0 when unusable this step)
  4 err_accel       max over the error counters of accel
  5 utilisation     clip(max(tx_bytes, rx_bytes) * 8 / dt / (speed_mbps * 1e6), 0, 1.5)
  6 buf_overrun     EWMA g(30 s) of log1p(buf_overrun / dt)
  7 retrans_slope   retrans's slope
  8 err_unknown     1 when none of the error counters is usable this step but the rail has had
                    a usable step of one (0 otherwise)
  9 warm            min(1, seconds of feature rows so far / 300)
 10 recent_downs    log1p(downs), downs decaying by exp(-dt / 600 s) at every step with
                    dt > 0 (down steps too): +1 at a step with link 0 whose previous usable
                    step had link 1 (a rail's first step shows no down), and + the usable
                    link_downed increments, except that the first one after such a down (over
                    the down steps and the step back up) is that down's.
Link-down steps produce no row and change no other state.

Failure events: a row with link 0 whose previous row of the same rail has link 1 (a rail whose
first row is down has no event there). Label of a feature row at time t: 1 when a failure
event of its rail has t < t_fail <= t + horizon (30 s).

Output (``--out FILE.npz``; the same arrays ``r2ccl_predict --features`` writes):
  x        float32 [N, 11] unnormalised feature rows, trace order
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
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional

import numpy as np

import tracefile

N_FEATURES = 11
HORIZON_S = 30.0
FEATURE_NAMES = ("err_excess", "err_slope", "link_events", "retrans_excess", "err_accel",
                 "utilisation", "buf_overrun", "retrans_slope", "err_unknown", "warm",
                 "recent_downs")
ERR_COUNTERS = ("symbol_err", "rcv_err", "crc_err", "fec_corr_blocks", "fec_uncorr_blocks",
                "fec_corr_bits")
FAST_TAU_S, SLOW_TAU_S, FLOOR_UP_TAU_S, FLOOR_DOWN_TAU_S, WARM_S = 30.0, 120.0, 1800.0, 120.0, 300.0
DOWNS_TAU_S = 600.0
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
            (self.x.shape == (n, N_FEATURES),
             f"x has shape {self.x.shape}, expected ({n}, {N_FEATURES})"),
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


def counter_kinds(prev_v: np.ndarray, prev_ok: np.ndarray, cur_v: np.ndarray,
                  cur_ok: np.ndarray, width: tracefile.Width):
    """(wrapped, reset): where a counter column's delta is a wrap, where a reset (both
    readings present; the rules in the module docstring)."""
    mx = np.uint64(width.max_value)
    half = np.uint64(1 << (width.bits - 1))
    with np.errstate(over="ignore"):
        down = (cur_v < prev_v) & prev_ok & cur_ok
        wrapped = down & (prev_v - cur_v > half) & (prev_v <= mx) if not width.saturating else \
            np.zeros_like(down)
    return wrapped, down & ~wrapped


def counter_deltas(prev_v: np.ndarray, prev_ok: np.ndarray, cur_v: np.ndarray,
                   cur_ok: np.ndarray, width: tracefile.Width) -> np.ndarray:
    """Deltas (uint64) of one counter column, by the rules in the module docstring (before
    settle_resets, which needs the whole row)."""
    mx = np.uint64(width.max_value)
    wrapped, _ = counter_kinds(prev_v, prev_ok, cur_v, cur_ok, width)
    with np.errstate(over="ignore"):
        up = cur_v >= prev_v
        d = np.where(up, cur_v - prev_v, np.where(wrapped, (cur_v - prev_v) & mx, cur_v))
    return np.where(prev_ok & cur_ok, d, np.uint64(0)).astype(np.uint64)


def counter_usable(prev_v: np.ndarray, prev_ok: np.ndarray, cur_v: np.ndarray,
                   cur_ok: np.ndarray, width: tracefile.Width) -> np.ndarray:
    """Where a delta is usable: both readings present, and not a saturated counter at its
    maximum."""
    ok = prev_ok & cur_ok
    if width.saturating:
        ok &= ~((cur_v >= prev_v) & (cur_v >= np.uint64(width.max_value)))
    return ok


class _Track:
    """One counter's history (features.h, FeatureExtractor::Track)."""

    __slots__ = ("seen", "fast", "slow", "floor", "slope_avg", "last", "n")

    def __init__(self):
        self.seen = False
        self.fast = self.slow = self.floor = self.slope_avg = 0.0
        self.last = [0.0, 0.0]
        self.n = 0

    def step(self, raw: float, dt: float):
        x = raw
        if self.n == 1:
            x = min(raw, self.last[0])
        elif self.n >= 2:
            a, b = self.last
            x = max(min(a, b), min(max(a, b), raw))
        self.last = [raw, self.last[0]]
        self.n += 1
        if not self.seen:
            self.seen = True
            self.fast = self.slow = self.floor = x
            self.slope_avg = 0.0
        else:
            self.fast += _gain(dt, FAST_TAU_S) * (x - self.fast)
            self.slow += _gain(dt, SLOW_TAU_S) * (x - self.slow)
            tau = FLOOR_UP_TAU_S if self.fast > self.floor else FLOOR_DOWN_TAU_S
            self.floor += _gain(dt, tau) * (self.fast - self.floor)
        excess, slope, accel = self.hold()
        self.slope_avg += _gain(dt, SLOW_TAU_S) * (slope - self.slope_avg)
        return excess, slope, accel

    def hold(self):
        """(excess, slope, accel) where the history stands, nothing updated (a step whose
        delta is a count since a reset)."""
        slope = (self.fast - self.slow) / (SLOW_TAU_S - FAST_TAU_S) * 60.0
        return self.fast - self.floor, slope, slope - self.slope_avg


def _gain(dt: float, tau: float) -> float:
    return 1.0 - math.exp(-dt / tau)


def _log_rate(count: float, dt: float) -> float:
    return math.log1p(max(0.0, count) / dt)


def trace_deltas(tr: tracefile.Trace, prev: np.ndarray):
    """(deltas, usable, reset), float64, bool and bool, shaped like tr.values: each row's
    deltas against the previous row of its rail (``prev``, from previous_row_index), by the
    module docstring's rules; ``reset`` marks the usable deltas that are a count since a reset
    (settled wraps included; counters.h Step::reset)."""
    has_step = prev >= 0
    p = np.where(has_step, prev, 0)
    deltas = np.zeros(tr.values.shape, dtype=np.float64)
    usable = np.zeros(tr.values.shape, dtype=bool)
    wrapped = np.zeros(tr.values.shape, dtype=bool)
    reset = np.zeros(tr.values.shape, dtype=bool)
    rail_widths = tr.rail_widths or [list(tr.widths)] * len(tr.rails)
    for c, name in enumerate(tracefile.COUNTERS):
        # Rails may read a counter with different widths ("# widths for PREFIX:").
        per_rail = [w[c] for w in rail_widths]
        for width in set(per_rail):
            rails_w = [i for i, w in enumerate(per_rail) if w == width]
            rows_w = np.isin(tr.rail, rails_w)
            args = (tr.values[p, c], tr.present[p, c] & has_step, tr.values[:, c],
                    tr.present[:, c], width)
            ok = counter_usable(*args)
            d = np.where(ok, counter_deltas(*args), np.uint64(0))  # as the C++: 0 unless usable
            deltas[rows_w, c] = d[rows_w].astype(np.float64)
            usable[rows_w, c] = ok[rows_w]
            wr, rs = counter_kinds(*args)
            wrapped[rows_w, c] = wr[rows_w]
            reset[rows_w, c] = rs[rows_w]
    # settle_resets: a "wrap" in a row where another counter of the rail was reset is a reset.
    settle = wrapped & usable & reset.any(axis=1)[:, None]
    return (np.where(settle, tr.values.astype(np.float64), deltas), usable,
            (reset | settle) & usable)


def compute_features(tr: tracefile.Trace, horizon_s: float = HORIZON_S) -> FeatureSet:
    """The feature rows, labels and failure events of a parsed trace."""
    prev = previous_row_index(tr.rail)
    has_step = prev >= 0
    p = np.where(has_step, prev, 0)
    deltas, usable, was_reset = trace_deltas(tr, prev)

    rows = np.flatnonzero(has_step & tr.link)
    steps = np.flatnonzero(has_step)  # every step, down ones too (recent_downs)
    out_k = np.full(tr.t.shape[0], -1, dtype=np.int64)
    out_k[rows] = np.arange(rows.size)
    x64 = np.zeros((rows.size, N_FEATURES), dtype=np.float64)
    err_cols = [_C[c] for c in ERR_COUNTERS]
    cr, link_cols = _C["retrans"], [_C["link_recovery"], _C["link_downed"], _C["integrity"]]
    cd = _C["link_downed"]
    # rail -> [error tracks], retrans track, link, overrun, seen seconds, downs, up, ticks
    state = {}
    for i in steps:
        dt = float(tr.t[i] - tr.t[p[i]])
        if not dt > 0:
            continue
        r = int(tr.rail[i])
        st = state.get(r)
        if st is None:
            st = state[r] = [[_Track() for _ in err_cols], _Track(), 0.0, 0.0, 0.0, 0.0, -1, 0.0]
        d, ok, rs = deltas[i], usable[i], was_reset[i]
        st[5] *= math.exp(-dt / DOWNS_TAU_S)
        ticks = max(0.0, d[cd]) if ok[cd] else 0.0
        if not tr.link[i]:
            if st[6] == 1:
                st[5] += 1.0
            st[6] = 0
            st[7] += ticks
            continue
        if st[6] == 0:
            st[5] += max(0.0, st[7] + ticks - 1.0)
            st[7] = 0.0
        else:
            st[5] += ticks
        st[6] = 1
        k = int(out_k[i])
        excess = slope = accel = 0.0
        known = unknown = 0
        for tr_c, c in zip(st[0], err_cols):
            if not ok[c]:
                unknown += tr_c.seen
                continue
            if rs[c] and not tr_c.seen:
                continue  # a count since a reset: this counter starts at its next step
            e, sl, ac = tr_c.hold() if rs[c] else tr_c.step(_log_rate(d[c], dt), dt)
            excess, slope, accel = ((max(excess, e), max(slope, sl), max(accel, ac)) if known
                                    else (e, sl, ac))
            known += 1
        row = x64[k]
        row[0], row[1], row[4] = excess, slope, accel
        row[8] = 1.0 if known == 0 and unknown > 0 else 0.0
        if ok[cr] and (st[1].seen or not rs[cr]):
            e, sl, _ = st[1].hold() if rs[cr] else st[1].step(_log_rate(d[cr], dt), dt)
            row[3], row[7] = e, sl
        st[2] += _gain(dt, FAST_TAU_S) * (_log_rate(sum(d[c] for c in link_cols), dt) - st[2])
        st[3] += _gain(dt, FAST_TAU_S) * (_log_rate(d[_C["buf_overrun"]], dt) - st[3])
        row[2], row[6] = st[2], st[3]
        speed = float(tr.speed_mbps[i])
        if speed > 0:
            util = max(d[_C["tx_bytes"]], d[_C["rx_bytes"]]) * 8.0 / dt / (speed * 1e6)
            row[5] = min(max(util, 0.0), 1.5)
        st[4] += dt
        row[9] = min(1.0, st[4] / WARM_S)
        row[10] = math.log1p(st[5])
    x = x64.astype(np.float32)
    rail = tr.rail[rows]

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
