#!/usr/bin/python3
"""Synthetic per-rail NIC counter traces for training and evaluating the failure predictor.

Writes a trace CSV in the docs/PREDICTOR.md format: raw cumulative counters as a sampler would
read them every ``--interval-s`` seconds (with +-2% timer jitter), for two kinds of rail:

- InfiniBand ports (a fraction 1 - ``--eth-frac`` of the nodes): rails ``nNNN-mlx5_K:1``, IB
  counter widths in the ``# widths:`` line (symbol_err and rcv_err sat16, link_recovery and
  link_downed sat8, integrity and buf_overrun sat4 - the small ones saturate within minutes of
  trouble, as on real HCAs -, retrans wrap32, packets and bytes wrap64); the Ethernet columns
  (crc_err, fec_*) are empty.
- Ethernet / RoCE interfaces (``--eth-frac`` of the nodes, default 0.4): rails ``eNNN-ethK``,
  Linux netdev widths in a ``# widths for e:`` line (rcv_err = rx_errors, buf_overrun,
  packets, bytes, crc_err, fec_* wrap64; link_recovery = carrier_changes and link_downed =
  carrier_down_count wrap32; retrans wrap64: TCP retransmits on some nodes, constant 0 on the
  others). symbol_err and integrity are empty. crc_err counts bad-FCS frames and rcv_err
  includes them. fec_corr_bits / fec_corr_blocks / fec_uncorr_blocks model an RS-FEC (PAM4)
  link: corrected bits and blocks at a steady floor whatever the traffic, uncorrectable blocks
  ~0 while healthy, each uncorrectable block inside a frame is also a CRC error. Some Ethernet
  nodes report no FEC statistics (fec_* empty). A carrier loss ticks
  carrier_down_count once and carrier_changes at the down and at the up.

Some rails start with retrans near 2^32 or packet/byte counters near 2^64 so that wraps
happen, and some sat counters start at their maximum (a port nobody has cleared).

Every rail carries traffic: the rails of a node (8 per node) share the node's job-phase
utilisation (AR(1) noise around a per-rail level, pauses between jobs), bytes = utilisation x
speed_mbps x dt, packets = bytes / a per-rail mean packet size plus a management floor. Every
rail, whatever its scenario, has its own error floors over orders of magnitude (a fraction
floor_zero_prob exactly 0), steady apart from Poisson noise on some rails and wandering slowly
on others (one AR(1) factor on every floor, floor_wander_*): IB symbol errors 0 .. hundreds
per second (plus receive errors a few % of that, retransmits and rare link retrains that do
not down the link), Ethernet corrected FEC bits 0 .. hundreds per second
(corrected blocks = bits / 1-3 bits per block), CRC errors 0 .. ~1/s while frames flow,
uncorrectable blocks ~0. Each rail then follows ONE scenario (the ``scenario`` column):

Failure models (each link loss is a failure event):
  optical     a degrading optic/cable: the error rate grows exponentially (with AR(1)
              wobble) from ~0.02/s to r_fail over a precursor of P seconds on top of the
              floor, then the link drops. IB: symbol errors; rcv_err = c_rcv x symbol rate x
              (0.2 + 0.8 utilisation), retransmits follow the rcv errors, link_error_recovery
              ticks in the last minute. Ethernet: the same curve scaled to corrected FEC bits
              (and blocks) at the failure; uncorrectable blocks follow the curve to a steep
              power (eth_uncorr_exponent), so they and the CRC errors they cause appear only
              close to the failure. The link stays down for 1-10 samples, then the rows end.
  creep       the same error counters rise from the rail's own floor (which may be high) as
              excess(t) = e_fail (2^((t - t_fail)/T2) - 2^(-P/T2)) / (1 - 2^(-P/T2)) over a
              precursor of P = 2-15 min with a doubling time T2 of ~30 s to a few minutes
              (T2 <= P/1.5), AR(1) wobble; e_fail >= 10 x the floor. IB and Ethernet as in
              optical; then the link drops for good.
  flap        repeated short link-downs (link 0 for 1..D samples, link_downed +1, a few
              symbol errors - Ethernet: FEC-corrected bits and the odd CRC error - as the link
              trains again), each a failure event; before each, over Pf seconds, IB
              link_error_recovery and local_link_integrity errors tick at a rising rate with a
              few symbol errors (Ethernet: FEC and CRC error bursts), plus micro-flaps (down
              and up between two samples: link_downed ticks, Ethernet carrier_changes +2, the
              sampler never reads link 0). With probability flap_cluster_prob a follow-up flap
              comes 30-100 s after the link is back. The rail keeps running after each flap.
  sudden      the link drops with no precursor at all (power, a pulled cable, a dead
              switch port); no model can predict these, the evaluation counts them apart.
Not failures (must not trigger a drain):
  congestion  bursts of 20-600 s at utilisation ~0.93-0.99 with buffer overruns (Ethernet:
              dropped packets, eth_drop_scale times more) and retransmits (a fraction p_cong
              of the packets).
  incast      short (1-4 samples) receive bursts at line rate with buffer-overrun and
              retransmit spikes, every few minutes.
  reset       all counters drop to the count since the reset at 1-3 samples (perfquery -R,
              a driver reload); where retrans was above 2^31 the spec's rule alone would read
              the reset as a wrap (one huge retransmit step); the other counters' reset in
              the same step tells them apart (features.py, settle_resets in counters.h).
  idle        near-zero traffic; stale QPs still log the odd retransmit, so the retransmit
              *ratio* of an idle link can be large.
  healthy     normal traffic and the rail's steady floor (from 0 to a marginal-but-stable
              link's few IB symbol errors or hundreds of corrected FEC bits per second); some
              idle, some busy (utilisation ~0.85-0.97); some with a counter reset mid-trace;
              some IB ones with symbol_err stuck at 65535 from the start or from mid-trace;
              half of them also see isolated error bursts (a cable touched; healthy_bursts of
              healthy_burst_samples each) that do not grow; some see one isolated micro-flap
              (healthy_micro_flap_prob: down and up between two samples, a few errors at
              the retraining; a link renegotiation, a transceiver blip) that nothing follows.

``--params train`` and ``--params heldout`` draw every model's parameters from DIFFERENT
ranges (PARAMS below, heldout wider; ``--describe`` prints them as a markdown table): faster
and slower degradation, other error floors and levels, precursor lengths, traffic levels and
link speeds, so the held-out set tests generalisation, not memorisation of one parameter
setting. The output depends only on the arguments (seeded numpy Generator).

Example:
  gen_traces.py --seed 1 --rails 400 --duration-s 5400 --params train --out train.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

import tracefile
from tracefile import Width

# IB ports: the file-wide "# widths:" line.
WIDTHS: Dict[str, Width] = {
    "retrans": Width(32, False),
    "tx_packets": Width(64, False), "rx_packets": Width(64, False),
    "tx_bytes": Width(64, False), "rx_bytes": Width(64, False),
    "symbol_err": Width(16, True), "rcv_err": Width(16, True),
    "link_recovery": Width(8, True), "link_downed": Width(8, True),
    "integrity": Width(4, True), "buf_overrun": Width(4, True),
}
# Ethernet / RoCE interfaces (Linux netdev statistics): the "# widths for e:" line.
ETH_PREFIX = "e"
ETH_WIDTHS: Dict[str, Width] = {
    "retrans": Width(64, False),
    "tx_packets": Width(64, False), "rx_packets": Width(64, False),
    "tx_bytes": Width(64, False), "rx_bytes": Width(64, False),
    "rcv_err": Width(64, False), "buf_overrun": Width(64, False),
    "link_recovery": Width(32, False), "link_downed": Width(32, False),
    "crc_err": Width(64, False), "fec_corr_blocks": Width(64, False),
    "fec_uncorr_blocks": Width(64, False), "fec_corr_bits": Width(64, False),
}
FEC_COUNTERS = ("fec_corr_blocks", "fec_uncorr_blocks", "fec_corr_bits")
IB_ABSENT = tracefile.PHY_COUNTERS          # empty cells on IB rails
ETH_ABSENT = ("symbol_err", "integrity")    # empty cells on Ethernet rails
SCENARIOS = ("optical", "creep", "flap", "sudden", "congestion", "incast", "reset", "idle",
             "healthy")
DEFAULT_MIX = "optical=0.12,creep=0.14,flap=0.10,sudden=0.06,congestion=0.12,incast=0.10," \
              "reset=0.08,idle=0.08,healthy=0.20"
DEFAULT_ETH_FRAC = 0.4
RAILS_PER_NODE = 8

# Parameter ranges per set. (lo, hi) pairs are drawn uniformly unless the name says log
# (log-uniform); *_speeds_mbps are choices; a single number is a probability. Units in the key
# names: _s seconds, _per_s events per second, _frac fraction of packets, _mbps Mb/s.
PARAMS: Dict[str, Dict[str, object]] = {
    "train": {
        "speeds_mbps": (200000, 400000),
        "eth_speeds_mbps": (100000, 200000, 400000),
        "util_level": (0.25, 0.85),
        "pkt_size_bytes": (2500, 4200),
        "floor_zero_prob": 0.2,
        "floor_symbol_per_s_log": (1e-4, 300.0),
        "floor_wander_prob": 0.5,
        "floor_wander_sigma": (0.05, 0.5),
        "floor_wander_corr_s": (300, 1800),
        "bg_retrans_frac_log": (1e-10, 1e-8),
        "bg_link_events_per_s_log": (1e-6, 1e-4),
        "eth_no_fec_prob": 0.25,
        "eth_tcp_retrans_prob": 0.5,
        "eth_tcp_retrans_frac_log": (1e-7, 1e-5),
        "eth_floor_corr_bits_per_s_log": (0.1, 300.0),
        "eth_fec_bits_per_block": (1.0, 3.0),
        "eth_floor_crc_per_s_log": (1e-4, 1.0),
        "eth_floor_uncorr_per_s_log": (1e-6, 1e-3),
        "eth_burst_bits_per_symbol_log": (20, 300),
        "eth_burst_uncorr_per_symbol_log": (0.01, 0.1),
        "eth_drop_scale_log": (10, 200),
        "optical_precursor_s": (150, 420),
        "optical_r_fail_per_s_log": (300, 3000),
        "optical_c_rcv": (0.05, 0.3),
        "creep_precursor_s": (120, 600),
        "creep_doubling_s_log": (30, 180),
        "creep_fail_symbol_per_s_log": (30, 3000),
        "eth_fail_corr_bits_per_s_log": (1e4, 3e6),
        "eth_fail_uncorr_per_s_log": (0.5, 50),
        "eth_uncorr_exponent": (3.0, 6.0),
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
        "healthy_idle_prob": 0.2,
        "healthy_busy_prob": 0.3,
        "healthy_reset_prob": 0.25,
        "healthy_saturated_prob": 0.25,
        "healthy_micro_flap_prob": 0.25,
        "healthy_burst_errors_log": (20, 3000),
        "healthy_bursts": (1, 4),
        "healthy_burst_samples": (1, 5),
    },
    "heldout": {
        "speeds_mbps": (100000, 200000, 400000),
        "eth_speeds_mbps": (50000, 100000, 200000, 400000, 800000),
        "util_level": (0.1, 0.95),
        "pkt_size_bytes": (1500, 4300),
        "floor_zero_prob": 0.3,
        "floor_symbol_per_s_log": (3e-5, 1000.0),
        "floor_wander_prob": 0.6,
        "floor_wander_sigma": (0.03, 0.8),
        "floor_wander_corr_s": (200, 3600),
        "bg_retrans_frac_log": (3e-11, 3e-8),
        "bg_link_events_per_s_log": (3e-7, 3e-4),
        "eth_no_fec_prob": 0.35,
        "eth_tcp_retrans_prob": 0.4,
        "eth_tcp_retrans_frac_log": (3e-8, 3e-5),
        "eth_floor_corr_bits_per_s_log": (0.03, 1000.0),
        "eth_fec_bits_per_block": (1.0, 6.0),
        "eth_floor_crc_per_s_log": (3e-5, 3.0),
        "eth_floor_uncorr_per_s_log": (3e-7, 3e-3),
        "eth_burst_bits_per_symbol_log": (10, 1000),
        "eth_burst_uncorr_per_symbol_log": (0.003, 0.3),
        "eth_drop_scale_log": (3, 1000),
        "optical_precursor_s": (100, 600),
        "optical_r_fail_per_s_log": (150, 8000),
        "optical_c_rcv": (0.02, 0.5),
        "creep_precursor_s": (90, 900),
        "creep_doubling_s_log": (20, 300),
        "creep_fail_symbol_per_s_log": (10, 8000),
        "eth_fail_corr_bits_per_s_log": (3e3, 1e7),
        "eth_fail_uncorr_per_s_log": (0.2, 200),
        "eth_uncorr_exponent": (2.0, 8.0),
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
        "healthy_idle_prob": 0.25,
        "healthy_busy_prob": 0.3,
        "healthy_reset_prob": 0.3,
        "healthy_saturated_prob": 0.3,
        "healthy_micro_flap_prob": 0.3,
        "healthy_burst_errors_log": (10, 6000),
        "healthy_bursts": (1, 5),
        "healthy_burst_samples": (1, 6),
    },
}

PARAM_DOCS: Dict[str, str] = {
    "speeds_mbps": "IB link speeds, Mb/s (one per rail)",
    "eth_speeds_mbps": "Ethernet link speeds, Mb/s (one per rail)",
    "util_level": "mean utilisation of a busy rail (fraction of line rate)",
    "pkt_size_bytes": "mean packet size, bytes",
    "floor_zero_prob": "probability that one of a rail's error floors is exactly 0",
    "floor_symbol_per_s_log": "IB: steady symbol errors per second (floor), every rail",
    "floor_wander_prob": "probability that a rail's floors wander (temperature, traffic)",
    "floor_wander_sigma": "wandering floor: std of its log (a slow AR(1) factor on every floor)",
    "floor_wander_corr_s": "wandering floor: correlation time of that factor, s",
    "bg_retrans_frac_log": "IB: background retransmits, fraction of packets",
    "bg_link_events_per_s_log": "IB: link retrains without a link loss, per second",
    "eth_no_fec_prob": "Ethernet: probability that a node reports no FEC statistics",
    "eth_tcp_retrans_prob": "Ethernet: probability that a node's rails count TCP retransmits "
                            "(else retrans stays 0)",
    "eth_tcp_retrans_frac_log": "Ethernet: background TCP retransmits, fraction of packets",
    "eth_floor_corr_bits_per_s_log": "Ethernet: steady FEC-corrected bits per second (floor)",
    "eth_fec_bits_per_block": "Ethernet: corrected bits per corrected block",
    "eth_floor_crc_per_s_log": "Ethernet: steady CRC errors per second while frames flow (floor)",
    "eth_floor_uncorr_per_s_log": "Ethernet: steady uncorrectable FEC blocks per second (floor)",
    "eth_burst_bits_per_symbol_log": "Ethernet: corrected bits per IB-symbol-error equivalent "
                                     "in bursts (flap, retraining, healthy bursts)",
    "eth_burst_uncorr_per_symbol_log": "Ethernet: uncorrectable blocks per IB-symbol-error "
                                    "equivalent in bursts",
    "eth_drop_scale_log": "Ethernet: dropped packets per IB buffer-overrun event",
    "optical_precursor_s": "optical: precursor length P, s",
    "optical_r_fail_per_s_log": "optical (IB): symbol error rate at the failure, per second",
    "optical_c_rcv": "optical, creep (IB): receive errors per symbol error (at full load)",
    "creep_precursor_s": "creep: precursor length P, s",
    "creep_doubling_s_log": "creep: doubling time T2 of the excess error rate, s",
    "creep_fail_symbol_per_s_log": "creep (IB): excess symbol errors per second at the failure",
    "eth_fail_corr_bits_per_s_log": "optical, creep (Ethernet): excess corrected bits per "
                                    "second at the failure",
    "eth_fail_uncorr_per_s_log": "optical, creep (Ethernet): uncorrectable blocks per second "
                                 "at the failure",
    "eth_uncorr_exponent": "optical, creep (Ethernet): uncorrectable rate = at-failure rate x "
                           "(excess / excess at failure) ^ this",
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
    "healthy_idle_prob": "healthy: probability of an idle rail",
    "healthy_busy_prob": "healthy: probability of a busy rail (utilisation 0.85-0.97)",
    "healthy_reset_prob": "healthy: probability of a counter reset mid-trace",
    "healthy_saturated_prob": "healthy (IB): probability that symbol_err is stuck at 65535 "
                              "(from the start or from mid-trace)",
    "healthy_micro_flap_prob": "healthy: probability of one isolated micro-flap (down and "
                               "up between two samples) that nothing follows",
    "healthy_bursts": "healthy: isolated error bursts on a rail that has them",
    "healthy_burst_samples": "healthy: samples one burst lasts",
    "healthy_burst_errors_log": "healthy: symbol errors per isolated burst sample",
}

_ORDER = tracefile.COUNTERS
HEADER = tracefile.HEADER


class RailSim:
    """The per-sample counter increments of one rail; turned into cumulative readings later.

    Arrays have one entry per sample; entry i is the increment over (t[i-1], t[i]] (entry 0
    is unused: the first reading is the starting value). ``kind`` is "ib" or "eth".
    """

    def __init__(self, rng: np.random.Generator, t: np.ndarray, p: Dict[str, object],
                 speed_mbps: int, node_phase: np.ndarray, kind: str = "ib",
                 tcp_retrans: bool = True):
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
        self.start_override: Dict[str, int] = {}
        self.sat_at: Optional[int] = None  # symbol_err reaches its maximum at this sample
        level = rng.uniform(*p["util_level"])
        ar = _ar1(rng, self.n, rho=0.9, sigma=0.12)
        self.phase = node_phase
        self.util = np.clip(level * node_phase * np.exp(ar), 0.0, 0.98)
        self.pkt_size = rng.uniform(*p["pkt_size_bytes"])
        self.eth = kind == "eth"
        self.tcp_retrans = tcp_retrans
        # The rail's steady error floors (every scenario has them).
        if self.eth:
            self.floor_bits = self.floor("eth_floor_corr_bits_per_s_log")
            self.floor_crc = self.floor("eth_floor_crc_per_s_log")
            self.floor_uncorr = self.floor("eth_floor_uncorr_per_s_log")
            self.bpb = self.u("eth_fec_bits_per_block")
            self.burst_bits = self.logu("eth_burst_bits_per_symbol_log")
            self.burst_unc = self.logu("eth_burst_uncorr_per_symbol_log")
            self.drop_scale = self.logu("eth_drop_scale_log")
        else:
            self.floor_sym = self.floor("floor_symbol_per_s_log")
            self.drop_scale = 1.0
        # Floors are steady on some rails and wander slowly on others (one factor on all).
        self.wander = np.ones(self.n)
        if rng.random() < p["floor_wander_prob"]:
            rho = math.exp(-(t[1] - t[0]) / self.u("floor_wander_corr_s"))
            self.wander = np.exp(_ar1(rng, self.n, rho=rho, sigma=self.u("floor_wander_sigma")))

    # --- helpers -------------------------------------------------------------------------
    def u(self, key: str) -> float:
        lo, hi = self.p[key]
        return float(self.rng.uniform(lo, hi))

    def logu(self, key: str) -> float:
        lo, hi = self.p[key]
        return float(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))

    def floor(self, key: str) -> float:
        """A steady error floor: 0 with probability floor_zero_prob, else log-uniform."""
        if self.rng.random() < self.p["floor_zero_prob"]:
            return 0.0
        return self.logu(key)

    def poisson(self, mean: np.ndarray) -> np.ndarray:
        return self.rng.poisson(np.maximum(mean, 0.0)).astype(np.float64)

    def idx(self, t_s: float) -> int:
        return int(np.searchsorted(self.t, t_s))

    def pad(self, a: np.ndarray) -> np.ndarray:
        """A prefix array extended with zeros to the rail's length."""
        out = np.zeros(self.n)
        out[:a.size] = a
        return out

    def frame_frac(self) -> np.ndarray:
        """Fraction of FEC codewords that carry frame data (an uncorrectable one there is a
        CRC error); the rest carry idles."""
        return np.clip(0.05 + self.util, 0.0, 1.0)

    def add_fec(self, blocks_mean: np.ndarray) -> None:
        """Corrected blocks ~ Poisson; each has at least one corrected bit."""
        blocks = self.poisson(blocks_mean)
        self.inc["fec_corr_blocks"] += blocks
        self.inc["fec_corr_bits"] += blocks + self.poisson(blocks * (self.bpb - 1.0))

    def add_uncorr(self, uncorr: np.ndarray) -> None:
        """Uncorrectable blocks; those inside a frame are CRC errors."""
        self.inc["fec_uncorr_blocks"] += uncorr
        self.add_crc(self.rng.binomial(uncorr.astype(np.int64), self.frame_frac())
                     .astype(np.float64))

    def add_crc(self, crc: np.ndarray) -> None:
        """Bad-FCS frames: crc_err, and rx_errors includes them; TCP resends what was lost."""
        self.inc["crc_err"] += crc
        self.inc["rcv_err"] += crc
        if self.tcp_retrans:
            self.inc["retrans"] += self.poisson(crc * self.rng.uniform(0.5, 1.5))

    def add_errs(self, mean_sym: np.ndarray) -> None:
        """A physical-layer error burst given in IB symbol errors (expected per sample): IB
        symbol errors, or Ethernet corrected FEC bits/blocks and a few uncorrectable blocks."""
        if not self.eth:
            self.inc["symbol_err"] += self.poisson(mean_sym)
            return
        self.add_fec(mean_sym * self.burst_bits / self.bpb)
        self.add_uncorr(self.poisson(mean_sym * self.burst_unc))

    def degrade(self, s: np.ndarray, ib_fail: float) -> None:
        """A failing link's excess error rate over samples [0, s.size): ``s`` is the excess
        relative to its value at the failure (0 .. ~1, noisy); ``ib_fail`` the IB symbol
        error rate at the failure. Ethernet draws its own levels."""
        i_f = s.size
        dt = self.dt[:i_f]
        if not self.eth:
            rate = s * ib_fail
            self.inc["symbol_err"][:i_f] += self.poisson(rate * dt)
            c_rcv = self.u("optical_c_rcv")
            rcv = self.poisson(rate * c_rcv * (0.2 + 0.8 * self.util[:i_f]) * dt)
            self.inc["rcv_err"][:i_f] += rcv
            self.inc["retrans"][:i_f] += self.poisson(rcv * self.rng.uniform(0.6, 1.5))
            self.inc["link_recovery"][:i_f] += self.poisson(0.03 * s * dt)
            return
        # RS-FEC: corrected bits follow the pre-FEC error rate; uncorrectable blocks follow its
        # tail (a steep power of it), so they appear only close to the failure.
        bits_fail = max(self.logu("eth_fail_corr_bits_per_s_log"), 10.0 * self.floor_bits)
        self.add_fec(self.pad(s * bits_fail / self.bpb * dt))
        u_fail = self.logu("eth_fail_uncorr_per_s_log")
        gamma = self.u("eth_uncorr_exponent")
        self.add_uncorr(self.pad(self.poisson(u_fail * np.power(s, gamma) * dt)))

    # --- traffic and background ----------------------------------------------------------
    def finish_traffic(self) -> None:
        """Bytes, packets and the steady error floors from the utilisation; zero while down."""
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
        if self.eth:
            # FEC works on every codeword, idles too: a constant floor whatever the traffic.
            up = up * self.wander
            self.add_fec(self.floor_bits / self.bpb * self.dt * up)
            self.add_uncorr(self.poisson(self.floor_uncorr * self.dt * up))
            # CRC errors need frames: the floor holds while any traffic flows.
            flowing = np.minimum(1.0, self.util / 0.02 + 0.05)
            self.add_crc(self.poisson(self.floor_crc * flowing * self.dt * up))
            if self.tcp_retrans:
                self.inc["retrans"] += self.poisson(self.logu("eth_tcp_retrans_frac_log") *
                                                    self.inc["tx_packets"])
            return
        up = up * self.wander
        self.inc["symbol_err"] += self.poisson(self.floor_sym * self.dt * up)
        self.inc["rcv_err"] += self.poisson(self.floor_sym * self.rng.uniform(0, 0.05) *
                                            (0.2 + 0.8 * self.util) * self.dt * up)
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
        if self.eth:
            self.inc["link_recovery"][i0] += 1  # carrier_changes: the down ...
        if final:
            self.end = i1
        elif i1 < self.n:
            # Link training after the outage logs a few errors at the up step. (IB's
            # link_error_recovery counts successful recoveries that did NOT down the link, so
            # it does not tick here; Ethernet's carrier_changes does: ... and the up.)
            if self.eth:
                self.inc["link_recovery"][i1] += 1
            e = np.zeros(self.n)
            e[i1] = self.rng.uniform(0, 20)
            self.add_errs(e)

    # --- scenarios -----------------------------------------------------------------------
    def _t_fail(self, P: float) -> float:
        hi = 0.95 * self.t[-1]
        return float(self.rng.uniform(min(max(P + 300, 0.35 * self.t[-1]), 0.9 * hi), hi))

    def optical(self) -> None:
        P = self.u("optical_precursor_s")
        r_fail = self.logu("optical_r_fail_per_s_log")
        r0 = 0.02
        tau = P / math.log(r_fail / r0)
        t_fail = self._t_fail(P)
        i_f = self.idx(t_fail)
        tt = self.t[:i_f]
        # Rate at the end of each interval integrated over it: r(t) dt, noisy.
        rate = r0 * np.exp((tt - (t_fail - P)) / tau)
        wobble = _ar1(self.rng, i_f, rho=0.8, sigma=0.35)  # the error rate is not a clean curve
        rate = np.where(tt > t_fail - P, rate, 0.0) * np.exp(wobble)
        self.degrade(rate / r_fail, r_fail)
        self.go_down(i_f, int(self.rng.integers(1, 11)), final=True)

    def creep(self) -> None:
        P = self.u("creep_precursor_s")
        T2 = min(self.logu("creep_doubling_s_log"), P / 1.5)
        n_d = P / T2
        t_fail = self._t_fail(P)
        i_f = self.idx(t_fail)
        tt = self.t[:i_f]
        # Excess over the floor: 0 at t_fail - P, doubling every T2, 1 at t_fail.
        s = (np.exp2((tt - t_fail) / T2) - 2.0 ** -n_d) / (1.0 - 2.0 ** -n_d)
        s = np.where(tt > t_fail - P, s, 0.0) * np.exp(_ar1(self.rng, i_f, rho=0.8, sigma=0.25))
        floor = 0.0 if self.eth else self.floor_sym
        self.degrade(s, max(self.logu("creep_fail_symbol_per_s_log"), 10.0 * floor))
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
            if not self.eth:
                self.inc["link_recovery"] += self.poisson(n_ev * w * 0.6)
                self.inc["integrity"] += self.poisson(n_ev * w * 0.6)
            self.add_errs(n_ev * w * self.rng.uniform(2, 30))
            # Micro-flaps: down and back up between two samples, so the sampler never reads
            # link 0, but link_downed ticks (and Ethernet's carrier_changes twice).
            micro = self.poisson(self.u("flap_micro_flaps") * w)
            self.inc["link_downed"] += micro
            if self.eth:
                self.inc["link_recovery"] += 2 * micro
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
            ov = self.u("congestion_overrun_per_s") * self.drop_scale
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
                                                             self.drop_scale * self.dt, 0.0))
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
        r = self.rng.random()
        if r < self.p["healthy_idle_prob"]:
            self.util[:] = self.logu("idle_util_log") * np.exp(_ar1(self.rng, self.n, 0.9, 0.3))
        elif r < self.p["healthy_idle_prob"] + self.p["healthy_busy_prob"]:
            self.util[:] = np.clip(self.rng.uniform(0.85, 0.97) * self.phase *
                                   np.exp(_ar1(self.rng, self.n, 0.9, 0.03)), 0.0, 0.98)
        if self.rng.random() < 0.5:
            lo_b, hi_b = self.p["healthy_bursts"]
            lo_m, hi_m = self.p["healthy_burst_samples"]
            for _ in range(int(self.rng.integers(lo_b, hi_b + 1))):
                m = int(self.rng.integers(lo_m, hi_m + 1))
                i = int(self.rng.integers(1, max(2, self.n - m - 1)))
                errs = self.logu("healthy_burst_errors_log")
                e = np.zeros(self.n)
                e[i:i + m] = errs
                self.add_errs(e)
                if not self.eth:
                    self.inc["rcv_err"][i:i + m] += self.rng.poisson(errs * 0.1, m)
                    self.inc["retrans"][i:i + m] += self.rng.poisson(errs * 0.1, m)
        if self.rng.random() < self.p["healthy_reset_prob"]:
            self.resets.append((int(self.rng.integers(self.n // 4, 3 * self.n // 4)),
                                float(self.rng.uniform(0, 1))))
        if self.rng.random() < self.p["healthy_micro_flap_prob"]:
            # One micro-flap, as in a flap's precursor (link_downed +1, Ethernet's
            # carrier_changes +2, link 0 never read), alone: a renegotiation or a blip.
            i = int(self.rng.integers(1, self.n - 1))
            self.inc["link_downed"][i] += 1
            if self.eth:
                self.inc["link_recovery"][i] += 2
            e = np.zeros(self.n)
            e[i] = self.rng.uniform(0, 20)
            self.add_errs(e)
        if not self.eth and self.rng.random() < self.p["healthy_saturated_prob"]:
            if self.rng.random() < 0.5:
                self.start_override["symbol_err"] = WIDTHS["symbol_err"].max_value
            else:
                self.sat_at = int(self.rng.integers(self.n // 5, 4 * self.n // 5))

    def run(self, scenario: str) -> None:
        self._after_traffic: List[Tuple[str, np.ndarray, float]] = []
        getattr(self, scenario)()
        self.finish_traffic()
        for kind, sel, frac in self._after_traffic:
            self.inc["retrans"] += self.poisson(np.where(sel, frac * self.inc["tx_packets"], 0.0))
        if self.eth and not self.tcp_retrans:
            self.inc["retrans"][:] = 0.0  # an interface without a retransmit counter
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


_DATA = ("tx_packets", "rx_packets", "tx_bytes", "rx_bytes")


def start_value(rng: np.random.Generator, name: str, w: Width, eth: bool = False) -> int:
    """A realistic starting reading: recently cleared, part-way, or (sat) stuck at max; some
    retrans near 2^32 and packets/bytes near 2^64 so that they wrap. Ethernet error counters
    count since the driver loaded; carrier counters are small."""
    if eth and name not in _DATA:
        if name in ("link_recovery", "link_downed"):
            return int(rng.integers(1, 40))
        if name == "retrans":
            return int(rng.integers(0, 1 << 24))
        top = 1e12 if name in ("fec_corr_bits", "fec_corr_blocks") else 1e5
        return int(math.exp(rng.uniform(0.0, math.log(top)))) - 1
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
                  starts: Optional[Dict[str, int]] = None, kind: str = "ib", fec: bool = True,
                  tcp_retrans: bool = True) -> Tuple[np.ndarray, List[List[str]]]:
    """One rail's rows: (times, rows of [link, speed, counters...]) as strings, the counters
    in tracefile.COUNTERS order (empty where the rail kind has no such counter).
    ``kind``: "ib" or "eth"; ``fec``: an Ethernet rail reports FEC statistics;
    ``tcp_retrans``: an Ethernet rail counts TCP retransmits (else retrans reads 0).
    ``starts`` overrides the starting reading of some counters (fixtures)."""
    eth = kind == "eth"
    speed = int(rng.choice(params["eth_speeds_mbps" if eth else "speeds_mbps"]))
    sim = RailSim(rng, t, params, speed, phase, kind, tcp_retrans)
    sim.run(scenario)
    widths = ETH_WIDTHS if eth else WIDTHS
    absent = set(ETH_ABSENT if eth else IB_ABSENT)
    if eth and not fec:
        absent |= set(FEC_COUNTERS)
    cols: List[Optional[List[str]]] = []
    for c in _ORDER:
        if c in absent:
            cols.append(None)
            continue
        w = widths[c]
        start = start_value(rng, c, w, eth)
        if eth and c == "retrans" and not tcp_retrans:
            start = 0
        start = sim.start_override.get(c, start)
        if c == "symbol_err" and sim.sat_at is not None:
            done = int(np.round(sim.inc[c][:sim.sat_at + 1]).astype(np.int64).sum())
            start = max(0, w.max_value - done)
        if starts and c in starts:
            start = starts[c]
        vals = cumulate(sim.inc[c], start, w, sim.resets)
        cols.append([str(v) for v in vals])
    if p_missing > 0:
        miss = rng.random((len(_ORDER), sim.n)) < p_missing
        for ci, i in zip(*np.nonzero(miss)):
            if cols[ci] is not None:
                cols[ci][i] = "N/A"
    empty = [""] * sim.n
    full = [col if col is not None else empty for col in cols]
    link = ["1" if x else "0" for x in sim.link]
    rows = [[link[i], str(speed)] + [col[i] for col in full] for i in range(sim.end)]
    return t[:sim.end], rows


def generate(seed: int, n_rails: int, duration_s: float, interval_s: float, params_name: str,
             mix: Dict[str, float], p_missing: float = 2e-4,
             eth_frac: float = DEFAULT_ETH_FRAC
             ) -> Tuple[List[Tuple[float, str, List[str], str]], Dict[str, int]]:
    """All rows of all rails as (t, rail, [link, speed, counters...], scenario), time-ordered,
    plus the number of rails per scenario. round(eth_frac x nodes) nodes, picked at random,
    are Ethernet nodes (rails eNNN-ethK); the others IB (nNNN-mlx5_K:1)."""
    rng = np.random.default_rng(seed)
    params = PARAMS[params_name]
    names = list(mix)
    probs = np.array([mix[k] for k in names])
    n = int(round(duration_s / interval_s)) + 1
    n_nodes = -(-n_rails // RAILS_PER_NODE)
    eth_nodes = set(rng.permutation(n_nodes)[:int(round(eth_frac * n_nodes))].tolist())
    out: List[Tuple[float, str, List[str], str]] = []
    counts: Dict[str, int] = {k: 0 for k in SCENARIOS}
    phase = None
    eth, fec, tcp = False, True, True
    for r in range(n_rails):
        node, port = divmod(r, RAILS_PER_NODE)
        if port == 0:
            phase = node_phase(rng, n, interval_s)
            eth = node in eth_nodes
            # One NIC model and driver per node: FEC statistics and TCP rails are per node.
            fec = not eth or rng.random() >= params["eth_no_fec_prob"]
            tcp = eth and rng.random() < params["eth_tcp_retrans_prob"]
        scenario = str(rng.choice(names, p=probs))
        counts[scenario] += 1
        t0 = rng.uniform(0, interval_s)
        t = t0 + np.arange(n) * interval_s + rng.uniform(-0.02, 0.02, n) * interval_s
        name = f"{ETH_PREFIX}{node:03d}-eth{port}" if eth else f"n{node:03d}-mlx5_{port}:1"
        tt, rows = simulate_rail(rng, scenario, params, t, phase, p_missing,
                                 kind="eth" if eth else "ib", fec=fec, tcp_retrans=tcp)
        out.extend((float(ti), name, row, scenario) for ti, row in zip(tt, rows))
    out.sort(key=lambda x: (x[0], x[1]))
    return out, counts


def write_trace(path: str, comments: List[str],
                rows: List[Tuple[float, str, List[str], str]]) -> None:
    """Writes generate()'s rows: comments, the IB ``# widths:`` line, the Ethernet
    ``# widths for e:`` line, the full header (tracefile.HEADER), the rows."""
    eth_line = tracefile.widths_line(ETH_WIDTHS).replace(
        "# widths:", f"# widths for {ETH_PREFIX}:", 1)
    with open(path, "w", encoding="utf-8", newline="") as f:
        for c in comments:
            f.write(f"# {c}\n")
        f.write(tracefile.widths_line(WIDTHS) + "\n")
        f.write(eth_line + "\n")
        f.write(",".join(HEADER) + "\n")
        csv.writer(f, lineterminator="\n").writerows(
            [f"{t:.3f}", rail] + row + [sc] for t, rail, row, sc in rows)


def describe_params() -> str:
    """PARAMS as a markdown table (train vs heldout)."""
    lines = ["| parameter | meaning | train | heldout |", "|---|---|---|---|"]
    for key in PARAMS["train"]:
        def fmt(v):
            if key.endswith("speeds_mbps"):
                return ", ".join(f"{x:g}" for x in v)
            if not isinstance(v, tuple):
                return f"{v:g}"
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
    ap.add_argument("--eth-frac", type=float, default=DEFAULT_ETH_FRAC,
                    help="fraction of the nodes (8 rails each) that are Ethernet / RoCE "
                         f"(default {DEFAULT_ETH_FRAC:g}); 0 = IB only")
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
    if not 0.0 <= args.eth_frac <= 1.0:
        ap.error("--eth-frac must be between 0 and 1")
    t0 = time.time()
    rows, counts = generate(args.seed, args.rails, args.duration_s, args.interval_s,
                            args.params, mix, args.missing, args.eth_frac)
    n_eth = len({rail for _, rail, _, _ in rows if rail.startswith(ETH_PREFIX)})
    comments = [
        "r2ccl synthetic NIC counter trace (scripts/predictor/gen_traces.py)",
        f"seed={args.seed} rails={args.rails} duration_s={args.duration_s:g} "
        f"interval_s={args.interval_s:g} params={args.params} missing={args.missing:g} "
        f"eth_frac={args.eth_frac:g}",
        "mix=" + ",".join(f"{k}={v:.3f}" for k, v in mix.items()),
    ]
    write_trace(args.out, comments, rows)
    print(f"gen_traces.py: {len(rows)} rows, {args.rails} rails, {n_eth} Ethernet "
          f"({', '.join(f'{k} {v}' for k, v in counts.items() if v)}) -> {args.out} "
          f"in {time.time() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
