"""Sample-level and event-level metrics of a risk series (docs/PREDICTOR.md "Results").

An *alarm* is a scored row (link-up step) with risk >= 0.7 (R2CCL_PREDICT_THRESHOLD).

Sample level: precision, recall, F1 and accuracy of the alarms against the labels (label 1 =
a failure of the rail within 30 s).

Event level:
  - an *alarm episode* is a maximal run of consecutive alarmed rows of one rail (a failure
    event between two rows ends the run); its onset is its first row;
  - a failure event is *warned* when the rail's last scored row before it (at most 120 s
    before) is alarmed and the episode containing that row began at most 120 s before the
    failure: the alarm started before the failure and stayed on until it. Lead time =
    t_fail - onset, seconds;
  - *early*: the alarm was on until the failure but began more than 120 s before it (not
    counted as warned);
  - a *false alarm* is an episode not followed by a failure of its rail within 30 s of its
    last row; the rate is per rail-day of link-up time observed (scored rows x interval);
  - *sudden* failures (scenario "sudden": no precursor by construction) are reported apart
    and excluded from the predictable recall.

The same event metrics are also computed for the plugin's *drain* decisions
(:func:`drain_state`): a rail drains when its risk reaches 0.7 and returns once the risk has
stayed below 0.4 for 6 consecutive samples; the drain persists across a link-down. It is
:func:`rail_policy` (RailPredictor::update's rules, predictor/src/predictor.cc) with the enter
samples, hourly limit and flap hold off; :func:`drain_outcomes` runs it with them on. A drain episode is false when no failure of its rail
happens during it or within 30 s after it ends.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np

from features import FeatureSet

DRAIN = np.float32(0.7)
WARN_WINDOW_S = 120.0
FALSE_ALARM_HORIZON_S = 30.0
UNPREDICTABLE = ("sudden",)
RETURN_THRESHOLD = np.float32(0.4)
RETURN_SAMPLES = 6
# The false drains per held-out rail-week the pipeline chooses at (train.py's budget and rise
# rule, tune_policy.py's operating points), under the 1 the issue aims at: the choice that
# warns the most of many candidates (budgets, 36 rise rules) at or under a limit on one sample
# reads low there. Chosen at 0.96 on the pipeline's held-out traces (then seed 2, 2,400 rails), the
# baseline read 1.19 and 1.35 per rail-week on seeds 3-5 (3,106 healthy rail-hours) in two
# retrainings (docs/PREDICTOR.md "Deciders"); 0.7 leaves that much room.
HELDOUT_MAX_FALSE = 0.7


def sample_metrics(label: np.ndarray, alarm: np.ndarray) -> Dict[str, float]:
    y = label.astype(bool)
    a = alarm.astype(bool)
    tp = int((a & y).sum())
    fp = int((a & ~y).sum())
    fn = int((~a & y).sum())
    tn = int((~a & ~y).sum())
    prec = tp / (tp + fp) if tp + fp else 0.0
    rec = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "precision": prec, "recall": rec, "f1": f1,
            "accuracy": (tp + tn) / max(1, tp + fp + fn + tn)}


def drain_state(fs: FeatureSet, risk: np.ndarray, threshold=DRAIN,
                return_threshold=RETURN_THRESHOLD, return_samples=RETURN_SAMPLES) -> np.ndarray:
    """bool [N]: the rail is drained after this row, by the drain hysteresis alone (no enter
    samples, hourly limit, least drain time or flap hold: rail_policy with those off)."""
    p = Policy(threshold=float(threshold), enter_samples=1,
               return_threshold=float(return_threshold), return_samples=return_samples,
               max_drains_per_hour=1 << 30, min_drain_s=0.0, down_hold_s=0.0)
    out = np.zeros(len(fs), dtype=bool)
    for r in np.unique(fs.rail):
        rows = np.flatnonzero(fs.rail == r)
        out[rows] = rail_policy(fs.t[rows], risk[rows], np.zeros(0), p)[0]
    return out


def event_metrics(fs: FeatureSet, risk: np.ndarray, interval_s: float,
                  on: Optional[np.ndarray] = None) -> Dict[str, object]:
    """Event-level metrics; see the module docstring for the definitions. ``on``: the
    per-row alarm state (default: risk >= 0.7, with episodes split at failure events);
    pass drain_state(...) for the drain view (episodes continue across a link-down)."""
    split_at_failures = on is None
    alarm = risk >= DRAIN if on is None else on
    ev_scen = fs.event_scenarios()
    row_scen = [fs.scenarios[s] if 0 <= s < len(fs.scenarios) else "?" for s in
                range(len(fs.scenarios))]
    events: List[Dict[str, object]] = []
    false_alarms: Dict[str, int] = {}
    n_episodes = 0
    for r in np.unique(np.r_[fs.rail, fs.event_rail]):
        rows = np.flatnonzero(fs.rail == r)
        t = fs.t[rows]
        a = alarm[rows]
        et = np.sort(fs.event_t[fs.event_rail == r])
        # Episode id per row: a new episode starts at an alarmed row whose predecessor is not
        # alarmed or is separated from it by a failure event.
        fail_between = np.zeros(rows.size, dtype=bool)
        if rows.size > 1 and et.size and split_at_failures:
            k_prev = np.searchsorted(et, t[:-1], side="right")
            k_cur = np.searchsorted(et, t[1:], side="right")
            fail_between[1:] = k_cur > k_prev
        starts = a & ~np.r_[False, a[:-1] & ~fail_between[1:]]
        ep_id = np.cumsum(starts) - 1
        onset = {}
        for j in np.flatnonzero(starts):
            onset[int(ep_id[j])] = t[j]
        # False alarms: episodes with no failure from their onset to 30 s after their last row.
        ends = a & ~np.r_[a[1:] & ~fail_between[1:], False]
        for j in np.flatnonzero(ends):
            n_episodes += 1
            k = np.searchsorted(et, onset[int(ep_id[j])], side="right")
            if not (k < et.size and et[k] <= t[j] + FALSE_ALARM_HORIZON_S):
                s = int(fs.scenario[rows[j]])
                name = row_scen[s] if 0 <= s < len(row_scen) else "?"
                false_alarms[name] = false_alarms.get(name, 0) + 1
        for e_t in et:
            e_idx = int(np.flatnonzero((fs.event_rail == r) & (fs.event_t == e_t))[0])
            j = int(np.searchsorted(t, e_t, side="left")) - 1  # last row before the failure
            status, lead = "missed", None
            if j >= 0 and e_t - t[j] <= WARN_WINDOW_S and a[j]:
                lead = float(e_t - onset[int(ep_id[j])])
                status = "warned" if lead <= WARN_WINDOW_S else "early"
            events.append({"t": float(e_t), "rail": int(r), "scenario": ev_scen[e_idx],
                           "status": status, "lead_s": lead})
    rail_days = len(fs) * interval_s / 86400.0
    pred = [e for e in events if e["scenario"] not in UNPREDICTABLE]
    sudden = [e for e in events if e["scenario"] in UNPREDICTABLE]
    leads = np.array([e["lead_s"] for e in pred if e["status"] == "warned"], dtype=np.float64)
    per_scenario: Dict[str, Dict[str, object]] = {}
    for e in events:
        d = per_scenario.setdefault(e["scenario"], {"events": 0, "warned": 0, "early": 0,
                                                    "leads": []})
        d["events"] += 1
        if e["status"] in ("warned", "early"):
            d[e["status"]] += 1
        if e["status"] == "warned":
            d["leads"].append(e["lead_s"])
    n_fa = sum(false_alarms.values())
    return {
        "events": len(events),
        "predictable_events": len(pred),
        "warned": sum(e["status"] == "warned" for e in pred),
        "early": sum(e["status"] == "early" for e in pred),
        "predictable_recall": (sum(e["status"] == "warned" for e in pred) / len(pred)
                               if pred else 0.0),
        "sudden_events": len(sudden),
        "sudden_warned": sum(e["status"] == "warned" for e in sudden),
        "lead_median_s": float(np.median(leads)) if leads.size else None,
        "lead_p10_s": float(np.percentile(leads, 10)) if leads.size else None,
        "alarm_episodes": n_episodes,
        "false_alarms": n_fa,
        "rail_days": rail_days,
        "false_alarms_per_rail_day": n_fa / rail_days if rail_days > 0 else 0.0,
        "false_alarms_by_scenario": false_alarms,
        "per_scenario": per_scenario,
    }


# --- the plugin's drain policy with its guard, and outcomes per failure -------------------
# Mirrors RailPredictor::update (predictor/src/predictor.cc) and r2ccl_predict --evaluate,
# except the last-usable-rail hold (it needs the node's other rails; --evaluate applies it).

@dataclasses.dataclass
class Policy:
    """Drain policy (R2CCL_PREDICT_THRESHOLD, _ENTER_SAMPLES, _RETURN_THRESHOLD,
    _RETURN_SAMPLES, _MAX_DRAINS_PER_HOUR, _MIN_DRAIN, _DOWN_HOLD, _DOWN_HOLD_AFTER)."""
    threshold: float = 0.9
    enter_samples: int = 3
    return_threshold: float = 0.4
    return_samples: int = 6
    max_drains_per_hour: int = 2
    min_drain_s: float = 1200.0   # R2CCL_PREDICT_MIN_DRAIN (seconds; 0 off)
    down_hold_s: float = 600.0    # R2CCL_PREDICT_DOWN_HOLD (seconds; 0 off)
    down_hold_after: int = 1      # R2CCL_PREDICT_DOWN_HOLD_AFTER: downs within an hour


def both_risk(lstm: np.ndarray, base: np.ndarray, cap: float) -> np.ndarray:
    """The risk of the decider "both" (R2CCL_PREDICT_DECIDER=both, RailPredictor::update): the
    baseline's risk, raised by the LSTM's up to ``cap`` (R2CCL_PREDICT_LSTM_CAP) times it, in
    float32 like the C++."""
    b = np.asarray(base, dtype=np.float32)
    return np.maximum(b, np.minimum(np.asarray(lstm, dtype=np.float32),
                                    np.float32(cap) * b)).astype(np.float32)


def rail_policy(t: np.ndarray, v: np.ndarray, et: np.ndarray, policy: Policy):
    """RailPredictor::update's decisions over one rail's scored rows (times ``t``, risks
    ``v``, in order) with its failure events at sorted times ``et``. Returns (drained after
    each row [bool], the times drains began, per failure its lead: how long the rail had been
    drained when it went down, or -1 when it was not)."""
    thr = np.float32(policy.threshold)
    ret = np.float32(policy.return_threshold)
    drain, high, low, since = False, 0, 0, -1.0
    state = np.zeros(t.size, dtype=bool)
    starts: List[float] = []     # every drain (for the counts)
    predicted: List[float] = []  # the model's drains (the hourly limit counts these)
    lead = [-1.0] * et.size
    e = 0
    hold_until = -np.inf
    for i, (ti, vi) in enumerate(zip(t, v)):
        back = False
        while e < et.size and et[e] <= ti:  # failures before this row
            lead[e] = et[e] - since if drain else -1.0
            e += 1
            back = True
        if back and policy.down_hold_s > 0:
            n = int(np.sum((et[:e] > ti - 3600.0)))
            if n >= policy.down_hold_after:
                hold = min(3600.0, policy.down_hold_s * 2.0 ** (n - policy.down_hold_after))
                hold_until = max(hold_until, ti + hold)
                if not drain:  # not counted against max_drains_per_hour
                    drain, since, low, high = True, float(ti), 0, 0
                    starts.append(float(ti))
        if drain and ti < hold_until:
            low = low + 1 if vi < ret else 0
        elif not drain:
            high = high + 1 if vi >= thr else 0
            if high >= max(1, policy.enter_samples):
                recent = sum(1 for s in predicted if s > ti - 3600.0)
                if recent < policy.max_drains_per_hour:
                    drain, since, low, high = True, float(ti), 0, 0
                    starts.append(float(ti))
                    predicted.append(float(ti))
                    if policy.min_drain_s > 0:  # the return waits at least min_drain_s
                        hold_until = max(hold_until, ti + policy.min_drain_s)
        else:
            low = low + 1 if vi < ret else 0
            if low >= policy.return_samples:
                drain, low, since = False, 0, -1.0
        state[i] = drain
    while e < et.size:
        lead[e] = et[e] - since if drain else -1.0
        e += 1
    return state, starts, lead


def drain_outcomes(fs: FeatureSet, risk: np.ndarray, policy: Policy, min_lead_s: float = 30.0,
                   lead_window_s: float = 1800.0, interval_s: float = 5.0) -> Dict[str, object]:
    """Failures warned (drained >= min_lead_s before the link went down; sudden ones apart)
    and drains on healthy rails (no failure at all) per rail-week of their link-up time, as
    r2ccl_predict --evaluate counts them. A drain persists across a link-down."""
    ev_scen = fs.event_scenarios()
    sudden_ev = np.array([s.startswith("sudden") for s in ev_scen], dtype=bool)
    out = {"precursor": 0, "warned": 0, "late": 0, "sudden": 0, "sudden_warned": 0,
           "false_drains": 0, "early_drains": 0, "healthy_s": 0.0, "leads": []}
    if len(fs) == 0:
        raise ValueError("no scored rows (a trace without steps with the link up)")
    order = np.argsort(fs.rail, kind="stable")
    bounds = np.flatnonzero(np.r_[True, fs.rail[order][1:] != fs.rail[order][:-1], True])
    for b0, b1 in zip(bounds[:-1], bounds[1:]):
        rows = order[b0:b1]
        r = int(fs.rail[rows[0]])
        t = fs.t[rows]
        sel = np.flatnonzero(fs.event_rail == r)
        ev_order = sel[np.argsort(fs.event_t[sel], kind="stable")]
        et = fs.event_t[ev_order]
        _, starts, lead = rail_policy(t, risk[rows], et, policy)
        if et.size == 0:
            dts = np.diff(t, prepend=t[0] - interval_s)
            out["healthy_s"] += float(dts.sum())
            out["false_drains"] += len(starts)
            continue
        for k, idx in enumerate(ev_order):
            if sudden_ev[idx]:
                out["sudden"] += 1
                out["sudden_warned"] += lead[k] >= min_lead_s
                continue
            out["precursor"] += 1
            if lead[k] >= min_lead_s:
                out["warned"] += 1
                out["leads"].append(float(lead[k]))
            elif lead[k] >= 0:
                out["late"] += 1
        out["early_drains"] += sum(1 for s in starts if not np.any((et > s) & (et <= s + lead_window_s)))
    week_s = 7 * 24 * 3600.0
    out["warned_frac"] = out["warned"] / out["precursor"] if out["precursor"] else 0.0
    out["false_per_rail_week"] = (out["false_drains"] * week_s / out["healthy_s"]
                                  if out["healthy_s"] > 0 else 0.0)
    # The upper middle of an even count, as r2ccl_predict --evaluate.
    out["lead_median_s"] = (float(sorted(out["leads"])[len(out["leads"]) // 2])
                            if out["leads"] else None)
    return out
