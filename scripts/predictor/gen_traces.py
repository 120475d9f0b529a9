#!/usr/bin/python3
"""Synthetic per-rail NIC counter traces for training and evaluating the failure predictor.

Writes a trace CSV in the docs/PREDICTOR.md format: raw cumulative counters as a sampler would
read them every ``--interval-s`` seconds (with +-2% timer jitter), IB-like counter widths
declared in the ``# widths:`` line (symbol_err and rcv_err sat16, link_recovery and
link_downed sat8, integrity and buf_overrun sat4 - the small ones saturate within minutes of
trouble, as on real HCAs -, retrans wrap32, packets and bytes wrap64). Some rails start with
retrans near 2^32 or packet/byte counters near 2^64 so that wraps happen, and some sat
counters start at their maximum (a port nobody has cleared).

Every rail carries traffic: the rails of a node (8 per node) share the node's job-phase
utilisation (AR(1) noise around a per-rail level, pauses between jobs), bytes = utilisation x
speed_mbps x dt, packets = bytes / a per-rail mean packet size plus a management floor, and a
low background rate of symbol errors, retransmits and link retrains that do not down the
link. Each rail then follows ONE scenario (the ``scenario`` column):

Failure models (each link loss is a failure event):
  optical     a degrading optic/cable: the symbol error rate grows exponentially (with AR(1)
              wobble) from ~0.02/s to r_fail over a precursor of P seconds, then the link
              drops; rcv_err = c_rcv x symbol rate x (0.2 + 0.8 utilisation), retransmits
              follow the rcv errors, link_error_recovery ticks in the last minute. The link
              stays down for 1-10 samples, then the rail's rows end.
  flap        repeated short link-downs (link 0 for 1..D samples, link_downed +1, a few
              symbol errors as the link trains again), each a failure event; before each,
              over Pf seconds, link_error_recovery and local_link_integrity errors tick at a
              rising rate with a few symbol errors, plus micro-flaps (down and up between two
              samples: link_downed ticks, the sampler never reads link 0). With probability
              flap_cluster_prob a follow-up flap comes 30-100 s after the link is back. The
              rail keeps running after each flap.
  sudden      the link drops with no precursor at all (power, a pulled cable, a dead
              switch port); no model can predict these, the evaluation counts them apart.
Not failures (must not trigger a drain):
  congestion  bursts of 20-600 s at utilisation ~0.93-0.99 with buffer overruns and
              retransmits (a fraction p_cong of the packets).
  incast      short (1-4 samples) receive bursts at line rate with buffer-overrun and
              retransmit spikes, every few minutes.
  reset       all counters drop to the count since the reset at 1-3 samples (perfquery -R,
              a driver reload); where retrans was above 2^31 the reset reads as a wrap (the
              spec's rule cannot tell them apart) and gives one huge retransmit step.
  idle        near-zero traffic; stale QPs still log the odd retransmit, so the retransmit
              *ratio* of an idle link can be large.
  healthy     normal traffic and a steady background error rate, from negligible to a
              marginal-but-stable link's few errors per second; half of them also see 1-3
              isolated error bursts (a cable touched) that do not grow.

``--params train`` and ``--params heldout`` draw every model's parameters from DIFFERENT
ranges (PARAMS below; ``--describe`` prints them as a markdown table): faster and slower
degradation, other error levels, precursor lengths, traffic levels and link speeds, so the
held-out set tests generalisation, not memorisation of one parameter setting.

Example:
  gen_traces.py --seed 1 --rails 400 --duration-s 5400 --params train --out train.csv
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

import tracefile
from tracefile import Width

WIDTHS: Dict[str, Width] = {
    "retrans": Width(32, False),
    "tx_packets": Width(64, False), "rx_packets": Width(64, False),
    "tx_bytes": Width(64, False), "rx_bytes": Width(64, False),
    "symbol_err": Width(16, True), "rcv_err": Width(16, True),
    "link_recovery": Width(8, True), "link_downed": Width(8, True),
    "integrity": Width(4, True), "buf_overrun": Width(4, True),
}
SCENARIOS = ("optical", "flap", "sudden", "congestion", "incast", "reset", "idle", "healthy")
DEFAULT_MIX = "optical=0.18,flap=0.10,sudden=0.06,congestion=0.14,incast=0.12,reset=0.10," \
              "idle=0.10,healthy=0.20"
RAILS_PER_NODE = 8

# Parameter ranges per set. (lo, hi) pairs are drawn uniformly unless the name says log
# (log-uniform). Units in the key names: _s seconds, _per_s events per second, _frac fraction
# of packets, _mbps Mb/s.
PARAMS: Dict[str, Dict[str, object]] = {
    "train": {
        "speeds_mbps": (200000, 400000),
        "util_level": (0.25, 0.85),
        "pkt_size_bytes": (2500, 4200),
        "bg_symbol_per_s_log": (1e-4, 1e-2),
        "bg_retrans_frac_log": (1e-10, 1e-8),
        "bg_link_events_per_s_log": (1e-6, 1e-4),
        "optical_precursor_s": (150, 420),
        "optical_r_fail_per_s_log": (300, 3000),
        "optical_c_rcv": (0.05, 0.3),
        "flap_count": (2, 5),
        "flap_precursor_s": (40, 120),
        "flap_precursor_events": (3, 8),
        "flap_down_samples": (1, 3),
        "flap_cluster_prob": (0.2, 0.4),
        "flap_micro_flaps": (0.0, 1.5),
        "congestion_retrans_frac_log": (1e-7, 1e-5),
        "congestion_burst_s": (30, 300),
        "congestion_overrun_per_s": (0.05, 1.0),
        "incast_retrans_frac_log": (1e-6, 3e-5),
        "incast_every_s": (120, 600),
        "idle_util_log": (1e-5, 1e-3),
        "idle_retrans_per_s": (0.0005, 0.005),
        "healthy_bg_symbol_per_s_log": (1e-3, 5.0),
        "healthy_burst_errors_log": (20, 3000),
    },
    "heldout": {
        "speeds_mbps": (100000, 200000, 400000),
        "util_level": (0.1, 0.95),
        "pkt_size_bytes": (1500, 4300),
        "bg_symbol_per_s_log": (3e-5, 3e-2),
        "bg_retrans_frac_log": (3e-11, 3e-8),
        "bg_link_events_per_s_log": (3e-7, 3e-4),
        "optical_precursor_s": (100, 600),
        "optical_r_fail_per_s_log": (150, 8000),
        "optical_c_rcv": (0.02, 0.5),
        "flap_count": (1, 7),
        "flap_precursor_s": (25, 200),
        "flap_precursor_events": (2, 10),
        "flap_down_samples": (1, 5),
        "flap_cluster_prob": (0.3, 0.6),
        "flap_micro_flaps": (0.0, 2.5),
        "congestion_retrans_frac_log": (3e-8, 3e-5),
        "congestion_burst_s": (20, 600),
        "congestion_overrun_per_s": (0.02, 2.0),
        "incast_retrans_frac_log": (3e-7, 1e-4),
        "incast_every_s": (60, 900),
        "idle_util_log": (3e-6, 3e-3),
        "idle_retrans_per_s": (0.0002, 0.01),
        "healthy_bg_symbol_per_s_log": (3e-4, 15.0),
        "healthy_burst_errors_log": (10, 6000),
    },
}

PARAM_DOCS: Dict[str, str] = {
    "speeds_mbps": "link speeds, Mb/s (one per rail)",
    "util_level": "mean utilisation of a busy rail (fraction of line rate)",
    "pkt_size_bytes": "mean packet size, bytes",
    "bg_symbol_per_s_log": "background symbol errors per second, every rail",
    "bg_retrans_frac_log": "background retransmits, fraction of packets",
    "bg_link_events_per_s_log": "link retrains without a link loss, per second",
    "optical_precursor_s": "optical: precursor length P, s",
    "optical_r_fail_per_s_log": "optical: symbol error rate at the failure, per second",
    "optical_c_rcv": "optical: receive errors per symbol error (at full load)",
    "flap_count": "flap: flaps per rail (before clusters)",
    "flap_precursor_s": "flap: precursor length Pf, s",
    "flap_precursor_events": "flap: expected recovery + integrity events in a precursor",
    "flap_down_samples": "flap: samples the link stays down",
    "flap_cluster_prob": "flap: probability of a follow-up flap 30-100 s later",
    "flap_micro_flaps": "flap: expected micro-flaps in a precursor",
    "congestion_retrans_frac_log": "congestion: retransmits, fraction of packets in a burst",
    "congestion_burst_s": "congestion: burst length, s",
    "congestion_overrun_per_s": "congestion: buffer overruns per second in a burst",
    "incast_retrans_frac_log": "incast: retransmits, fraction of packets in a burst",
    "incast_every_s": "incast: mean time between bursts, s",
    "idle_util_log": "idle: utilisation",
    "idle_retrans_per_s": "idle: stale-QP retransmits per second",
    "healthy_bg_symbol_per_s_log": "healthy: steady symbol errors per second",
    "healthy_burst_errors_log": "healthy: symbol errors per isolated burst sample",
}

# IB-like rails: the IB counters only (the Ethernet / RoCE columns are left out of the file).
_ORDER = tracefile.BASE_COUNTERS
_HEADER = tracefile.BASE_HEADER


class RailSim:
    """The per-sample counter increments of one rail; turned into cumulative readings later.

    Arrays have one entry per sample; entry i is the increment over (t[i-1], t[i]] (entry 0
    is unused: the first reading is the starting value).
    """

    def __init__(self, rng: np.random.Generator, t: np.ndarray, p: Dict[str, object],
                 speed_mbps: int, node_phase: np.ndarray):
        self.rng = rng
        self.t = t
        self.n = t.size
        self.p = p
        self.speed = speed_mbps
        self.dt = np.diff(t, prepend=t[0] - (t[1] - t[0]))
        self.link = np.ones(self.n, dtype=bool)
        self.end = self.n  # rows [0, end) are written
        self.inc = {c: np.zeros(self.n) for c in _ORDER}
        self.resets: List[Tuple[int, float]] = []  # (sample, fraction of its step after reset)
        level = rng.uniform(*p["util_level"])
        ar = _ar1(rng, self.n, rho=0.9, sigma=0.12)
        self.util = np.clip(level * node_phase * np.exp(ar), 0.0, 0.98)
        self.pkt_size = rng.uniform(*p["pkt_size_bytes"])

    # --- helpers -------------------------------------------------------------------------
    def u(self, key: str) -> float:
        lo, hi = self.p[key]
        return float(self.rng.uniform(lo, hi))

    def logu(self, key: str) -> float:
        lo, hi = self.p[key]
        return float(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))

    def poisson(self, mean: np.ndarray) -> np.ndarray:
        return self.rng.poisson(np.maximum(mean, 0.0)).astype(np.float64)

    def idx(self, t_s: float) -> int:
        return int(np.searchsorted(self.t, t_s))

    # --- traffic and background ----------------------------------------------------------
    def finish_traffic(self) -> None:
        """Bytes, packets and background errors from the utilisation; zero while down."""
        bps = self.speed * 1e6 / 8.0
        up = self.link.astype(np.float64)
        tx_b = self.util * bps * self.dt * up
        rx_b = np.clip(self.util * self.rng.uniform(0.9, 1.1) *
                       np.exp(self.rng.normal(0, 0.03, self.n)), 0, 0.99) * bps * self.dt * up
        mgmt = self.rng.uniform(5, 50)  # management/keepalive packets per second
        self.inc["tx_bytes"] += np.round(tx_b)
        self.inc["rx_bytes"] += np.round(rx_b)
        self.inc["tx_packets"] += np.round(tx_b / self.pkt_size) + self.poisson(mgmt * self.dt * up)
        self.inc["rx_packets"] += np.round(rx_b / self.pkt_size) + self.poisson(mgmt * self.dt * up)
        bg_sym = self.logu("bg_symbol_per_s_log")
        self.inc["symbol_err"] += self.poisson(bg_sym * self.dt * up)
        bg_rt = self.logu("bg_retrans_frac_log")
        self.inc["retrans"] += self.poisson(bg_rt * self.inc["tx_packets"])
        # A link retrains now and then without going down (marginal but working links).
        bg_le = self.logu("bg_link_events_per_s_log")
        self.inc["link_recovery"] += self.poisson(bg_le * self.dt * up)
        self.inc["integrity"] += self.poisson(0.5 * bg_le * self.dt * up)

    def go_down(self, i0: int, n_down: int, final: bool) -> None:
        """Link down for samples [i0, i0 + n_down); final: the rail's rows end after that."""
        i1 = min(self.n, i0 + n_down)
        self.link[i0:i1] = False
        self.inc["link_downed"][i0] += 1
        if final:
            self.end = i1
        elif i1 < self.n:
            # Link training after the outage logs a few symbol errors at the up step. (IB's
            # link_error_recovery counts successful recoveries that did NOT down the link, so
            # it does not tick here; Ethernet's carrier_changes would.)
            self.inc["symbol_err"][i1] += self.rng.poisson(self.rng.uniform(0, 20))

    # --- scenarios -----------------------------------------------------------------------
    def optical(self) -> None:
        P = self.u("optical_precursor_s")
        r_fail = self.logu("optical_r_fail_per_s_log")
        r0 = 0.02
        tau = P / math.log(r_fail / r0)
        hi = 0.95 * self.t[-1]
        t_fail = self.rng.uniform(min(max(P + 300, 0.35 * self.t[-1]), 0.9 * hi), hi)
        i_f = self.idx(t_fail)
        tt = self.t[:i_f]
        # Rate at the end of each interval integrated over it: r(t) dt, noisy.
        rate = r0 * np.exp((tt - (t_fail - P)) / tau)
        wobble = _ar1(self.rng, i_f, rho=0.8, sigma=0.35)  # the error rate is not a clean curve
        rate = np.where(tt > t_fail - P, rate, 0.0) * np.exp(wobble)
        sym = self.poisson(rate * self.dt[:i_f])
        c_rcv = self.u("optical_c_rcv")
        rcv = self.poisson(rate * c_rcv * (0.2 + 0.8 * self.util[:i_f]) * self.dt[:i_f])
        self.inc["symbol_err"][:i_f] += sym
        self.inc["rcv_err"][:i_f] += rcv
        self.inc["retrans"][:i_f] += self.poisson(rcv * self.rng.uniform(0.6, 1.5))
        self.inc["link_recovery"][:i_f] += self.poisson(0.03 * (rate / r_fail) * self.dt[:i_f])
        self.go_down(i_f, int(self.rng.integers(1, 11)), final=True)

    def flap(self) -> None:
        lo, hi = self.p["flap_count"]
        k = int(self.rng.integers(lo, hi + 1))
        t_end = self.t[-1]
        times: List[float] = []
        for _ in range(50 * k):
            if len(times) == k:
                break
            c = self.rng.uniform(0.08 * t_end, 0.97 * t_end)
            if all(abs(c - x) > 250 for x in times):
                times.append(c)
        p_cluster = self.u("flap_cluster_prob")
        lo_d, hi_d = self.p["flap_down_samples"]
        flaps = []  # (time, precursor s, down samples)
        for t_flap in sorted(times):
            n_down = int(self.rng.integers(lo_d, hi_d + 1))
            flaps.append((t_flap, self.u("flap_precursor_s"), n_down))
            if self.rng.random() < p_cluster:
                # A flapping link flaps again soon: a follow-up 30-100 s after it is back up,
                # with a precursor that starts once it is up.
                back = t_flap + n_down * (self.t[1] - self.t[0])
                gap = self.rng.uniform(30, 100)
                flaps.append((back + gap, gap * 0.9, int(self.rng.integers(lo_d, hi_d + 1))))
        for t_flap, Pf, n_down in flaps:
            if t_flap >= self.t[-2]:
                continue
            i_f = self.idx(t_flap)
            n_ev = self.u("flap_precursor_events")
            sel = (self.t > t_flap - Pf) & (self.t <= self.t[i_f - 1])
            # Rising (quadratic) intensity over the precursor; expected n_ev events in all.
            ramp = np.where(sel, ((self.t - (t_flap - Pf)) / Pf).clip(0, 1) ** 2, 0.0)
            w = ramp * self.dt
            w = w / max(w.sum(), 1e-9)
            self.inc["link_recovery"] += self.poisson(n_ev * w * 0.6)
            self.inc["integrity"] += self.poisson(n_ev * w * 0.6)
            self.inc["symbol_err"] += self.poisson(n_ev * w * self.rng.uniform(2, 30))
            # Micro-flaps: down and back up between two samples, so the sampler never reads
            # link 0, but link_downed ticks.
            self.inc["link_downed"] += self.poisson(self.u("flap_micro_flaps") * w)
            self.go_down(i_f, n_down, final=False)

    def sudden(self) -> None:
        i_f = self.idx(self.rng.uniform(0.2 * self.t[-1], 0.95 * self.t[-1]))
        self.go_down(i_f, int(self.rng.integers(1, 11)), final=True)

    def congestion(self) -> None:
        n_b = int(self.rng.integers(2, 7))
        for _ in range(n_b):
            d = self.u("congestion_burst_s")
            t0 = self.rng.uniform(0, max(1.0, self.t[-1] - d))
            sel = (self.t > t0) & (self.t <= t0 + d)
            self.util[sel] = self.rng.uniform(0.93, 0.99, int(sel.sum()))
            frac = self.logu("congestion_retrans_frac_log")
            self._after_traffic.append(("retrans_frac", sel, frac))
            ov = self.u("congestion_overrun_per_s")
            self.inc["buf_overrun"] += self.poisson(np.where(sel, ov * self.dt, 0.0))

    def incast(self) -> None:
        every = self.u("incast_every_s")
        t0 = self.rng.uniform(0, every)
        while t0 < self.t[-1]:
            i0 = self.idx(t0)
            i1 = min(self.n, i0 + int(self.rng.integers(1, 5)))
            sel = np.zeros(self.n, dtype=bool)
            sel[i0:i1] = True
            self.util[sel] = np.maximum(self.util[sel], self.rng.uniform(0.9, 0.98))
            self.inc["buf_overrun"] += self.poisson(np.where(sel, self.rng.uniform(1, 5) *
                                                             self.dt, 0.0))
            self._after_traffic.append(("retrans_frac", sel,
                                        self.logu("incast_retrans_frac_log")))
            t0 += self.rng.exponential(every)

    def reset(self) -> None:
        for _ in range(int(self.rng.integers(1, 4))):
            self.resets.append((int(self.rng.integers(10, self.n - 1)),
                                float(self.rng.uniform(0, 1))))
        self.resets.sort()

    def idle(self) -> None:
        self.util[:] = self.logu("idle_util_log") * np.exp(_ar1(self.rng, self.n, 0.9, 0.3))
        self.inc["retrans"] += self.poisson(self.u("idle_retrans_per_s") * self.dt)

    def healthy(self) -> None:
        self.inc["symbol_err"] += self.poisson(self.logu("healthy_bg_symbol_per_s_log") *
                                               self.dt)
        if self.rng.random() < 0.5:
            for _ in range(int(self.rng.integers(1, 4))):
                i = int(self.rng.integers(1, self.n - 2))
                m = int(self.rng.integers(1, 4))
                errs = self.logu("healthy_burst_errors_log")
                self.inc["symbol_err"][i:i + m] += self.rng.poisson(errs, m)
                self.inc["rcv_err"][i:i + m] += self.rng.poisson(errs * 0.1, m)
                self.inc["retrans"][i:i + m] += self.rng.poisson(errs * 0.1, m)

    def run(self, scenario: str) -> None:
        self._after_traffic: List[Tuple[str, np.ndarray, float]] = []
        getattr(self, scenario)()
        self.finish_traffic()
        for kind, sel, frac in self._after_traffic:
            self.inc["retrans"] += self.poisson(np.where(sel, frac * self.inc["tx_packets"], 0.0))
        for c in _ORDER:
            self.inc[c][0] = 0.0


def _ar1(rng: np.random.Generator, n: int, rho: float, sigma: float) -> np.ndarray:
    """A stationary AR(1) series with marginal std ``sigma``."""
    e = rng.normal(0, sigma * math.sqrt(1 - rho * rho), n)
    out = np.empty(n)
    acc = rng.normal(0, sigma)
    for i in range(n):
        acc = rho * acc + e[i]
        out[i] = acc
    return out


def node_phase(rng: np.random.Generator, n: int, dt: float) -> np.ndarray:
    """A node's job phases: 1 while a job runs, ~0.001 in the pauses between jobs."""
    phase = np.ones(n)
    i = 0
    while i < n:
        run = int(rng.exponential(3600 / dt))
        i += run
        if i >= n:
            break
        pause = int(rng.uniform(60, 600) / dt)
        phase[i:i + pause] = 0.001
        i += pause
    return phase


def start_value(rng: np.random.Generator, name: str, w: Width) -> int:
    """A realistic starting reading: recently cleared, part-way, or (sat) stuck at max; some
    retrans near 2^32 and packets/bytes near 2^64 so that they wrap."""
    if w.saturating:
        r = rng.random()
        if r < 0.6:
            return int(rng.integers(0, min(50, w.max_value) + 1))
        if r < 0.85:
            return int(rng.integers(0, w.max_value + 1))
        return w.max_value
    if name == "retrans":
        if rng.random() < 0.25:
            return (1 << 32) - int(math.exp(rng.uniform(math.log(10), math.log(1e5))))
        return int(rng.integers(0, 1 << 30))
    if rng.random() < 0.1:
        return (1 << 64) - int(rng.uniform(1e11, 3e14))
    return int(rng.integers(0, 1 << 50))


def cumulate(inc: np.ndarray, start: int, w: Width, resets: List[Tuple[int, float]]) -> List[int]:
    """Cumulative readings (Python ints) from per-sample increments, with the counter's width
    behaviour and the resets (at sample i the reading is the count since the reset)."""
    mx = w.max_value
    out: List[int] = []
    cur = start
    rs = dict(resets)
    incs = np.round(inc).astype(np.int64).tolist()
    for i, d in enumerate(incs):
        if i in rs:
            cur = int(d * rs[i])
        elif w.saturating:
            cur = min(mx, cur + d)
        else:
            cur = (cur + d) & mx
        out.append(cur)
    return out


def parse_mix(text: str) -> Dict[str, float]:
    """'optical=0.2,flap=0.1,...' -> normalised weights; ValueError naming the bad item."""
    mix: Dict[str, float] = {}
    for item in text.split(","):
        name, _, val = item.partition("=")
        name = name.strip()
        try:
            w = float(val)
        except ValueError:
            w = -1.0
        if name not in SCENARIOS or not w >= 0:
            raise ValueError(f"--mix: bad item '{item}' (accepted: NAME=WEIGHT, NAME one of "
                             f"{', '.join(SCENARIOS)}, WEIGHT >= 0)")
        mix[name] = w
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("--mix: the weights sum to 0")
    return {k: v / total for k, v in mix.items()}


def simulate_rail(rng: np.random.Generator, scenario: str, params: Dict[str, object],
                  t: np.ndarray, phase: np.ndarray, p_missing: float = 0.0,
                  starts: Optional[Dict[str, int]] = None) -> Tuple[
                      np.ndarray, List[List[str]]]:
    """One rail's rows: (times, rows of [link, speed, counters...]) as strings.
    ``starts`` overrides the starting reading of some counters (fixtures)."""
    speed = int(rng.choice(params["speeds_mbps"]))
    sim = RailSim(rng, t, params, speed, phase)
    sim.run(scenario)
    cols = []
    for c in _ORDER:
        w = WIDTHS[c]
        start = start_value(rng, c, w)
        if starts and c in starts:
            start = starts[c]
        vals = cumulate(sim.inc[c], start, w, sim.resets)
        cols.append([str(v) for v in vals])
    if p_missing > 0:
        miss = rng.random((len(_ORDER), sim.n)) < p_missing
        for ci, i in zip(*np.nonzero(miss)):
            cols[ci][i] = "N/A"
    link = ["1" if x else "0" for x in sim.link]
    rows = [[link[i], str(speed)] + [col[i] for col in cols] for i in range(sim.end)]
    return t[:sim.end], rows


def generate(seed: int, n_rails: int, duration_s: float, interval_s: float, params_name: str,
             mix: Dict[str, float], p_missing: float = 2e-4
             ) -> Tuple[List[Tuple[float, str, List[str], str]], Dict[str, int]]:
    """All rows of all rails as (t, rail, [link, speed, counters...], scenario), time-ordered,
    plus the number of rails per scenario."""
    rng = np.random.default_rng(seed)
    params = PARAMS[params_name]
    names = list(mix)
    probs = np.array([mix[k] for k in names])
    n = int(round(duration_s / interval_s)) + 1
    out: List[Tuple[float, str, List[str], str]] = []
    counts: Dict[str, int] = {k: 0 for k in SCENARIOS}
    phase = None
    for r in range(n_rails):
        node, port = divmod(r, RAILS_PER_NODE)
        if port == 0:
            phase = node_phase(rng, n, interval_s)
        scenario = str(rng.choice(names, p=probs))
        counts[scenario] += 1
        t0 = rng.uniform(0, interval_s)
        t = t0 + np.arange(n) * interval_s + rng.uniform(-0.02, 0.02, n) * interval_s
        name = f"n{node:03d}-mlx5_{port}:1"
        tt, rows = simulate_rail(rng, scenario, params, t, phase, p_missing)
        out.extend((float(ti), name, row, scenario) for ti, row in zip(tt, rows))
    out.sort(key=lambda x: (x[0], x[1]))
    return out, counts


def describe_params() -> str:
    """PARAMS as a markdown table (train vs heldout)."""
    lines = ["| parameter | meaning | train | heldout |", "|---|---|---|---|"]
    for key in PARAMS["train"]:
        def fmt(v):
            if key == "speeds_mbps":
                return ", ".join(f"{x:g}" for x in v)
            return f"{v[0]:g} .. {v[1]:g}" + (" (log-uniform)" if key.endswith("_log") else "")
        name = key[:-4] if key.endswith("_log") else key
        lines.append(f"| `{name}` | {PARAM_DOCS[key]} | {fmt(PARAMS['train'][key])} | "
                     f"{fmt(PARAMS['heldout'][key])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    ap.add_argument("--rails", type=int, default=400, help="number of rails (default 400)")
    ap.add_argument("--duration-s", type=float, default=5400.0,
                    help="seconds per rail (default 5400)")
    ap.add_argument("--interval-s", type=float, default=5.0,
                    help="sampling interval, seconds (default 5)")
    ap.add_argument("--params", choices=sorted(PARAMS), default="train",
                    help="parameter ranges: train or heldout (default train)")
    ap.add_argument("--mix", default=DEFAULT_MIX,
                    help=f"scenario weights per rail (default {DEFAULT_MIX})")
    ap.add_argument("--missing", type=float, default=2e-4,
                    help="probability that one counter cell reads N/A (default 2e-4)")
    ap.add_argument("--out", help="output trace CSV")
    ap.add_argument("--describe", action="store_true",
                    help="print the parameter ranges as a markdown table and exit")
    args = ap.parse_args(argv)
    if args.describe:
        print(describe_params())
        return 0
    if not args.out:
        ap.error("--out is required")
    try:
        mix = parse_mix(args.mix)
    except ValueError as e:
        ap.error(str(e))
    if args.rails < 1 or args.interval_s <= 0 or args.duration_s < 60 * args.interval_s:
        ap.error("need --rails >= 1, --interval-s > 0 and --duration-s >= 60 intervals")
    t0 = time.time()
    rows, counts = generate(args.seed, args.rails, args.duration_s, args.interval_s,
                            args.params, mix, args.missing)
    comments = [
        "r2ccl synthetic NIC counter trace (scripts/predictor/gen_traces.py)",
        f"seed={args.seed} rails={args.rails} duration_s={args.duration_s:g} "
        f"interval_s={args.interval_s:g} params={args.params} missing={args.missing:g}",
        "mix=" + ",".join(f"{k}={v:.3f}" for k, v in mix.items()),
    ]
    tracefile.write_trace(args.out, comments, WIDTHS,
                          ([f"{t:.3f}", rail] + row + [sc] for t, rail, row, sc in rows),
                          header=_HEADER)
    print(f"gen_traces.py: {len(rows)} rows, {args.rails} rails "
          f"({', '.join(f'{k} {v}' for k, v in counts.items() if v)}) -> {args.out} "
          f"in {time.time() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
