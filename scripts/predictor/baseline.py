"""The threshold baseline (docs/PREDICTOR.md "Baseline") and its tuning.

Risk of a rail at a scored row: over the mean of the last k raw (unnormalised) feature rows
of features 0..3 (fewer rows so far: the mean of those there are), err_excess's mean capped
at its value at the row, and err_slope's too where err_excess stands below its mean
(:func:`levels`), both counted 0 where err_excess has just fallen hard (the fall rule:
by FALL_LEAST or more over the last FALL_LAG rows, a burst's decaying tail),

    risk = min(1, 0.7 * max_i(mean_i / threshold_i))

so crossing any threshold is risk 0.7, the drain threshold. A threshold that is +inf (or
<= 0, as the C++ reads it) is unused. Arithmetic mirrors predictor/src/model.cc: the sum in
float64, mean and ratios in float32.

The rise rule (``rise`` = lag L in rows, least rise, ratio, level; L = 0 turns it off): risk 1
at a row whose err_excess (feature 0, a log-rate over the rail's own floor) rose over each of
the last two L-row intervals by at least the least rise, the later rise at least ``ratio``
times the earlier, and stands at ``level`` or more. A creep's rate keeps growing: its rises
go on, and the rule sees it minutes before the mean over k rows catches up with a fast one. A
floor that steps up and stays gives rises that shrink (the feature's 30 s average catches
up), and a burst is a step up and back: either fires the rule only while its window
straddles the step, at most 2 rows with ratio >= 1, fewer than the 3 samples a drain must
hold for (R2CCL_PREDICT_ENTER_SAMPLES). It needs the rail's last 2L + 1 rows (fewer so far:
it does not fire), in float32 like the C++.

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
# The fall rule (model.h kFallLag, kFallLeast): where err_excess (feature 0) stands at least
# FALL_LEAST below its value FALL_LAG rows back, err_excess and err_slope count 0.
FALL_LAG = 4
FALL_LEAST = np.float32(0.8)
# The rise rule off: lag 0 (weights file version 4, "rise"; model.h BaselineParams).
RISE_OFF = (0.0, 0.0, 0.0, 0.0)


@dataclasses.dataclass
class BaselineParams:
    thresholds: np.ndarray  # float32 [4], +inf = unused
    steps: int              # k
    # float32 [4]: lag L (rows; 0 = off), least rise and level (err_excess units), ratio
    rise: np.ndarray = dataclasses.field(
        default_factory=lambda: np.array(RISE_OFF, dtype=np.float32))

    def as_list(self) -> List[Optional[float]]:
        """Thresholds for JSON (None = unused)."""
        return [float(t) if np.isfinite(t) else None for t in self.thresholds]

    def rise_dict(self) -> Dict[str, float]:
        """The rise rule for JSON and logs."""
        lag, least, ratio, level = (float(v) for v in self.rise)
        return {"lag": int(lag), "least": round(least, 6), "ratio": round(ratio, 6),
                "level": round(level, 6)}

    @staticmethod
    def of(w) -> "BaselineParams":
        """The baseline a weights file (weights.LstmWeights) carries."""
        return BaselineParams(np.asarray(w.thresholds, dtype=np.float32), int(w.steps),
                              np.asarray(w.rise, dtype=np.float32))


def rail_order(rail: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(order, pos): the rows grouped by rail, each rail's in array order, and each sorted
    row's position within its rail (0 for a rail's first row)."""
    n = rail.shape[0]
    order = np.lexsort((np.arange(n), rail))
    r = rail[order]
    starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    pos = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    return order, pos


def smoothed(x: np.ndarray, rail: np.ndarray, k: int) -> np.ndarray:
    """float32 [N, 4]: mean of the last min(k, rows so far) rows of features 0..3, per rail,
    rows of a rail in array order."""
    n = x.shape[0]
    order, pos = rail_order(rail)
    xs = x[order, :4].astype(np.float64)
    c = np.cumsum(np.vstack([np.zeros((1, 4)), xs]), axis=0)
    kk = np.minimum(pos + 1, k)
    i = np.arange(n)
    sums = c[i + 1] - c[i + 1 - kk]
    out = np.empty((n, 4), dtype=np.float32)
    out[order] = (sums / kk[:, None]).astype(np.float32)
    return out


def fall_fires(x: np.ndarray, rail: np.ndarray) -> np.ndarray:
    """bool [N]: the rows at which the fall rule fires: err_excess (feature 0) stands at least
    FALL_LEAST below its value FALL_LAG rows back in its rail (rows of a rail in array order;
    a rail's first FALL_LAG rows never fire), in float32 like the C++."""
    n = x.shape[0]
    out = np.zeros(n, dtype=bool)
    if n == 0:
        return out
    order, pos = rail_order(rail)
    v = np.asarray(x[order, 0], dtype=np.float32)
    i = np.flatnonzero(pos >= FALL_LAG)
    sel = np.zeros(n, dtype=bool)
    sel[i] = (v[i - FALL_LAG] - v[i]) >= FALL_LEAST
    out[order] = sel
    return out


def levels(x: np.ndarray, rail: np.ndarray, k: int) -> np.ndarray:
    """float32 [N, 4]: what the thresholds judge, :func:`smoothed` with err_excess (feature 0)
    no higher than its value at the row itself: a burst that has fallen back under the
    threshold does not drain a rail on the mean's memory of it, and a rising rate (above its
    mean) is judged by the mean. At rows where err_excess stands below its mean (falling
    back), err_slope (feature 1) is no higher than its value at the row either: its mean still
    holds the burst's rise. Where the fall rule fires (:func:`fall_fires`: a rate that has
    just fallen hard, a burst's tail), both count 0 (model.cc, baseline_risk)."""
    sm = smoothed(x, rail, k)
    now = np.asarray(x[:, :2], dtype=np.float32)
    falling = now[:, 0] < sm[:, 0]
    sm[:, 0] = np.minimum(sm[:, 0], now[:, 0])
    sm[:, 1] = np.where(falling, np.minimum(sm[:, 1], now[:, 1]), sm[:, 1])
    fell = fall_fires(x, rail)
    sm[fell, 0] = 0
    sm[fell, 1] = 0
    return sm


def risk_from_smoothed(sm: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """float32 [N] risk from smoothed features [N, 4]."""
    t = np.asarray(thresholds, dtype=np.float32)
    used = np.isfinite(t) & (t > 0)
    ratio = np.where(used, sm / np.where(used, t, np.float32(1)), np.float32(0))
    worst = ratio.max(axis=1).astype(np.float32)
    return np.minimum(np.float32(1), DRAIN * worst).astype(np.float32)


def rise_fires(x: np.ndarray, rail: np.ndarray, rise) -> np.ndarray:
    """bool [N]: the rows at which the rise rule (module docstring) fires, per rail in array
    order."""
    lag, least, ratio, level = (np.float32(v) for v in np.asarray(rise, dtype=np.float32))
    n = x.shape[0]
    L = int(lag)
    out = np.zeros(n, dtype=bool)
    if L <= 0 or n == 0:
        return out
    order, pos = rail_order(rail)
    v = np.asarray(x[order, 0], dtype=np.float32)
    ok = pos >= 2 * L
    i = np.flatnonzero(ok)
    a, b, c = v[i], v[i - L], v[i - 2 * L]
    late, early = a - b, b - c  # float32, as the C++
    fire = (late >= least) & (early >= least) & (late >= ratio * early) & (a >= level)
    sel = np.zeros(n, dtype=bool)
    sel[i[fire]] = True
    out[order] = sel
    return out


def risk(x: np.ndarray, rail: np.ndarray, params: BaselineParams) -> np.ndarray:
    r = risk_from_smoothed(levels(x, rail, params.steps), params.thresholds)
    return np.where(rise_fires(x, rail, params.rise), np.float32(1), r).astype(np.float32)


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
        sm = levels(x, rail, k)
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


def switch_on_cuts(sm: np.ndarray, label: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """float32 [4]: for each feature ``thresholds`` leaves unused (+inf or <= 0), its best
    single-feature sample-F1 cut on the levels ``sm`` [N, 4] (what :func:`tune` starts from);
    +inf for a used feature, and for one whose positive values never raise the F1 (no cut
    helps, or no positive row)."""
    y = np.asarray(label).astype(bool)
    out = np.full(4, np.inf, dtype=np.float32)
    for i in range(4):
        t = thresholds[i]
        if np.isfinite(t) and t > 0:
            continue
        cut, _ = _best_cut(sm[:, i], y, np.zeros_like(y))
        out[i] = np.float32(cut)
    return out


def tune_events(fs, start: BaselineParams, policy, max_false_per_week: float = 1.0,
                factors: Iterable[float] = (0.5, 0.7, 1.4, 2.0, 3.0, 5.0, np.inf),
                passes: int = 2, log=print) -> Tuple[BaselineParams, Dict[str, object]]:
    """Re-tunes the thresholds for the drain decisions rather than for sample F1: coordinate
    search over a factor on each threshold (+inf: that feature unused) of the event-level
    outcome of the plugin's drain policy ``policy`` (metrics.drain_outcomes) on the rows of
    ``fs``: the most failures warned with at most ``max_false_per_week`` false drains per
    healthy rail-week; while none qualifies, the fewest false drains. Starts from ``start``
    (the F1-tuned thresholds) and keeps its k.

    A feature ``start`` leaves unused can be switched on: its candidates are the factors
    (the finite ones) on its own single-feature sample-F1 cut at this k (:func:`switch_on_cuts`).
    Without that, a training mix whose F1 optimum drops a feature (report 13: err_excess)
    also loses every failure that only that feature warns of in time (docs/PREDICTOR.md
    "Training", step 6)."""
    import metrics  # here: metrics imports features, which this module does not need

    sm = levels(fs.x, fs.rail, start.steps)
    fires = rise_fires(fs.x, fs.rail, start.rise)  # start's rise rule stays as it is
    base = switch_on_cuts(sm, fs.label, start.thresholds)

    def score(th: np.ndarray) -> Tuple[Tuple[float, float], Dict[str, object]]:
        r = np.where(fires, np.float32(1), risk_from_smoothed(sm, th)).astype(np.float32)
        o = metrics.drain_outcomes(fs, r, policy)
        ok = o["false_per_rail_week"] <= max_false_per_week
        key = (1.0, o["warned"]) if ok else (0.0, -o["false_per_rail_week"])
        return key, o

    th = np.array(start.thresholds, dtype=np.float32)
    best_key, best_o = score(th)
    for _ in range(passes):
        improved = False
        for i in range(th.size):
            used = bool(np.isfinite(th[i]) and th[i] > 0)
            if not used and not np.isfinite(base[i]):
                continue
            for f in factors:
                if not used and not np.isfinite(f):
                    continue  # already unused
                cand = th.copy()
                ref = th[i] if used else base[i]
                cand[i] = np.float32(ref * f) if np.isfinite(f) else np.float32(np.inf)
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
    return BaselineParams(th.astype(np.float32), start.steps, start.rise.copy()), best_o


# The rise rules choose_rise tries (lag rows, least rise, ratio, level): at the 5 s interval,
# rises over two 20-40 s intervals; ratio 1 or more keeps a floor step's shrinking rises out.
RISE_GRID: Tuple[Tuple[float, float, float, float], ...] = tuple(
    (float(lag), least, ratio, level)
    for lag in (4, 6, 8) for least in (0.2, 0.3, 0.4) for ratio in (1.0, 1.2)
    for level in (0.5, 1.0))


def choose_rise(heldout, params: BaselineParams, policy, max_false_per_week: float = 1.0,
                grid: Iterable[Tuple[float, float, float, float]] = RISE_GRID,
                log=print) -> Tuple[BaselineParams, Dict[str, object]]:
    """Chooses the rise rule on held-out traces (a FeatureSet): of the rules in ``grid`` and
    none, the one that warns the most failures under the drain policy ``policy`` while keeping
    the false drains per healthy rail-week at or under ``max_false_per_week``, or under the
    thresholds' own rate where that is higher (the rule never adds false drains then); ties go
    to fewer false drains, then to the earlier rule. ``params``' thresholds and k are kept.
    Returns the params and a summary (the chosen rule and both outcomes)."""
    import metrics  # here: metrics imports features, which this module does not need

    base = risk_from_smoothed(levels(heldout.x, heldout.rail, params.steps), params.thresholds)
    off = metrics.drain_outcomes(heldout, base, policy)
    limit = max(max_false_per_week, off["false_per_rail_week"])
    best = (off["warned"], -off["false_per_rail_week"])
    chosen, chosen_o = np.array(RISE_OFF, dtype=np.float32), off
    for rule in grid:
        rise = np.array(rule, dtype=np.float32)
        r = np.where(rise_fires(heldout.x, heldout.rail, rise), np.float32(1), base)
        o = metrics.drain_outcomes(heldout, r.astype(np.float32), policy)
        key = (o["warned"], -o["false_per_rail_week"])
        ok = o["false_per_rail_week"] <= limit
        if ok and key > best:
            best, chosen, chosen_o = key, rise, o
    out = BaselineParams(params.thresholds.copy(), params.steps, chosen)
    log(f"  rise rule {out.rise_dict()}: held-out warned {chosen_o['warned']}/"
        f"{chosen_o['precursor']} at {chosen_o['false_per_rail_week']:.2f} false drains per "
        f"rail-week (without it {off['warned']}, {off['false_per_rail_week']:.2f}; limit "
        f"{limit:.2f})")
    return out, {"rise": out.rise_dict(), "warned": chosen_o["warned"],
                 "precursor": chosen_o["precursor"],
                 "false_per_rail_week": round(chosen_o["false_per_rail_week"], 3),
                 "off_warned": off["warned"],
                 "off_false_per_rail_week": round(off["false_per_rail_week"], 3),
                 "limit": round(limit, 3)}
