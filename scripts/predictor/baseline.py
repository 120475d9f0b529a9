"""The threshold baseline (docs/PREDICTOR.md "Baseline") and its tuning.

Risk of a rail at a scored row: over the mean of the last k raw (unnormalised) feature rows
of features 0..3 (fewer rows so far: the mean of those there are),

    risk = min(1, 0.7 * max_i(mean_i / threshold_i))

so crossing any threshold is risk 0.7, the drain threshold. A threshold that is +inf (or
<= 0, as the C++ reads it) is unused. Arithmetic mirrors predictor/src/model.cc: the sum in
float64, mean and ratios in float32.

Tuning (:func:`tune`): for each k in a grid, coordinate ascent over the four thresholds where
each step is an EXACT one-dimensional search (every distinct value of the feature is a
candidate cut, plus +inf = unused) of the sample-level F1 on the training rows, started from
every single-feature detector; the best (k, thresholds) wins. Cuts sit halfway between
adjacent distinct values.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

DRAIN = np.float32(0.7)


@dataclasses.dataclass
class BaselineParams:
    thresholds: np.ndarray  # float32 [4], +inf = unused
    steps: int              # k

    def as_list(self) -> List[Optional[float]]:
        """Thresholds for JSON (None = unused)."""
        return [float(t) if np.isfinite(t) else None for t in self.thresholds]


def smoothed(x: np.ndarray, rail: np.ndarray, k: int) -> np.ndarray:
    """float32 [N, 4]: mean of the last min(k, rows so far) rows of features 0..3, per rail,
    rows of a rail in array order."""
    n = x.shape[0]
    order = np.lexsort((np.arange(n), rail))
    xs = x[order, :4].astype(np.float64)
    r = rail[order]
    starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    pos = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    c = np.cumsum(np.vstack([np.zeros((1, 4)), xs]), axis=0)
    kk = np.minimum(pos + 1, k)
    i = np.arange(n)
    sums = c[i + 1] - c[i + 1 - kk]
    out = np.empty((n, 4), dtype=np.float32)
    out[order] = (sums / kk[:, None]).astype(np.float32)
    return out


def risk_from_smoothed(sm: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """float32 [N] risk from smoothed features [N, 4]."""
    t = np.asarray(thresholds, dtype=np.float32)
    used = np.isfinite(t) & (t > 0)
    ratio = np.where(used, sm / np.where(used, t, np.float32(1)), np.float32(0))
    worst = ratio.max(axis=1).astype(np.float32)
    return np.minimum(np.float32(1), DRAIN * worst).astype(np.float32)


def risk(x: np.ndarray, rail: np.ndarray, params: BaselineParams) -> np.ndarray:
    return risk_from_smoothed(smoothed(x, rail, params.steps), params.thresholds)


def f1_score(tp: float, fp: float, fn: float) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp > 0 else 0.0


def _best_cut(v: np.ndarray, y: np.ndarray, base: np.ndarray) -> Tuple[float, float]:
    """Best threshold T for feature values ``v`` given the alarm mask ``base`` of the other
    features: alarm = base | (v >= T). Returns (T, F1); T = inf when adding nothing is best."""
    P = float(y.sum())
    tp0 = float((y & base).sum())
    fp0 = float((~y & base).sum())
    best_t, best_f1 = np.inf, f1_score(tp0, fp0, P - tp0)
    rest = ~base
    vr, yr = v[rest], y[rest]
    keep = vr > 0  # a cut at or below 0 would alarm on every quiet row
    vr, yr = vr[keep], yr[keep]
    if vr.size == 0:
        return best_t, best_f1
    o = np.argsort(-vr, kind="stable")
    vs, ys = vr[o], yr[o]
    tp = tp0 + np.cumsum(ys)
    fp = fp0 + np.cumsum(~ys)
    last = np.r_[vs[1:] != vs[:-1], True]  # last index of each run of equal values
    f1 = np.where(tp > 0, 2 * tp / (2 * tp + fp + (P - tp)), 0.0)
    f1 = np.where(last, f1, -1.0)
    j = int(np.argmax(f1))
    if f1[j] > best_f1:
        nxt = vs[j + 1] if j + 1 < vs.size else 0.0
        best_t, best_f1 = float((vs[j] + nxt) / 2.0), float(f1[j])
    return best_t, best_f1


def tune(x: np.ndarray, rail: np.ndarray, label: np.ndarray,
         ks: Iterable[int] = (1, 2, 3, 4, 6, 8, 12), passes: int = 6,
         log=print) -> Tuple[BaselineParams, float]:
    """Grid over k x coordinate ascent over thresholds, for the best sample-level F1."""
    y = label.astype(bool)
    best: Tuple[float, Optional[BaselineParams]] = (-1.0, None)
    for k in ks:
        sm = smoothed(x, rail, k)
        for start in range(4):
            th = np.full(4, np.inf)
            th[start], _ = _best_cut(sm[:, start], y, np.zeros_like(y))
            f1 = -1.0
            for _ in range(passes):
                improved = False
                for i in range(4):
                    others = np.zeros_like(y)
                    for j in range(4):
                        if j != i and np.isfinite(th[j]):
                            others |= sm[:, j] >= np.float32(th[j])
                    t, f = _best_cut(sm[:, i], y, others)
                    if f > f1 + 1e-12:
                        th[i], f1, improved = t, f, True
                if not improved:
                    break
            # Score exactly as deployed (float32 risk >= 0.7).
            p = BaselineParams(th.astype(np.float32), k)
            alarm = risk_from_smoothed(sm, p.thresholds) >= DRAIN
            tp = float((alarm & y).sum())
            f = f1_score(tp, float((alarm & ~y).sum()), float(y.sum()) - tp)
            if f > best[0]:
                best = (f, p)
        log(f"  baseline k={k}: best F1 so far {best[0]:.4f} "
            f"(thresholds {np.round(best[1].thresholds, 3).tolist()}, k={best[1].steps})")
    return best[1], best[0]


def tune_events(fs, start: BaselineParams, policy, max_false_per_week: float = 1.0,
                factors: Iterable[float] = (0.5, 0.7, 1.4, 2.0, 3.0, 5.0, np.inf),
                passes: int = 2, log=print) -> Tuple[BaselineParams, Dict[str, object]]:
    """Re-tunes the thresholds for the drain decisions rather than for sample F1: coordinate
    search over a factor on each threshold (+inf: that feature unused) of the event-level
    outcome of the plugin's drain policy ``policy`` (metrics.drain_outcomes) on the rows of
    ``fs``: the most failures warned with at most ``max_false_per_week`` false drains per
    healthy rail-week; while none qualifies, the fewest false drains. Starts from ``start``
    (the F1-tuned thresholds) and keeps its k."""
    import metrics  # here: metrics imports features, which this module does not need

    sm = smoothed(fs.x, fs.rail, start.steps)

    def score(th: np.ndarray) -> Tuple[Tuple[float, float], Dict[str, object]]:
        o = metrics.drain_outcomes(fs, risk_from_smoothed(sm, th), policy)
        ok = o["false_per_rail_week"] <= max_false_per_week
        key = (1.0, o["warned"]) if ok else (0.0, -o["false_per_rail_week"])
        return key, o

    th = np.array(start.thresholds, dtype=np.float32)
    best_key, best_o = score(th)
    for _ in range(passes):
        improved = False
        for i in range(th.size):
            if not (np.isfinite(th[i]) and th[i] > 0):
                continue
            for f in factors:
                cand = th.copy()
                cand[i] = np.float32(th[i] * f) if np.isfinite(f) else np.float32(np.inf)
                key, o = score(cand)
                if key > best_key:
                    th_best, best_key, best_o, improved = cand, key, o, True
            if improved:
                th = th_best
        log(f"  baseline (drain decisions): thresholds {np.round(th, 4).tolist()}: warned "
            f"{best_o['warned']}/{best_o['precursor']}, "
            f"{best_o['false_per_rail_week']:.2f} false drains per rail-week")
        if not improved:
            break
    return BaselineParams(th.astype(np.float32), start.steps), best_o
