#!/usr/bin/python3
"""Independent evaluation traces for the r2ccl NIC-failure predictor (frozen).

Writes one trace CSV in the format of docs/PREDICTOR.md "Trace format": raw cumulative counter
readings of InfiniBand rails (ib*) and Ethernet / RoCE rails (eth*), 5 s samples with timer
jitter, one scenario per rail.  IB rails read with the IB widths (the file-wide "# widths:"
line), Ethernet rails with Linux netdev widths (a "# widths for eth:" line).  Written without
reference to the training-side generator: its failure and healthy models are its own (see
--describe and scripts/predictor/README.md, "Evaluation traces (frozen)").

    /usr/bin/python3 scripts/predictor/eval_traces.py --out eval.csv            # full file
    /usr/bin/python3 scripts/predictor/eval_traces.py --scale 0.05 --out s.csv --self-check
    /usr/bin/python3 scripts/predictor/eval_traces.py --describe
    /usr/bin/python3 scripts/predictor/eval_traces.py --check eval.csv          # verify a file

Python 3 + numpy only.  Deterministic for a seed (numpy default_rng).
"""

import argparse
import math
import sys
import time

import numpy as np

DEFAULT_SEED = 90210
DEFAULT_OUT = "eval_traces.csv"
DT = 5.0  # nominal sampling interval, s

# Documented columns (docs/PREDICTOR.md "Trace format"): the core header + the optional
# Ethernet / RoCE physical-layer counters.
CORE_COLUMNS = ["t_s", "rail", "link", "speed_mbps", "retrans", "tx_packets", "rx_packets",
                "tx_bytes", "rx_bytes", "symbol_err", "rcv_err", "link_recovery", "link_downed",
                "integrity", "buf_overrun", "scenario"]
OPTIONAL_COLUMNS = ["fec_corr_blocks", "fec_uncorr_blocks", "fec_corr_bits", "crc_err"]
COUNTERS = ["retrans", "tx_packets", "rx_packets", "tx_bytes", "rx_bytes", "symbol_err",
            "rcv_err", "link_recovery", "link_downed", "integrity", "buf_overrun",
            "fec_corr_blocks", "fec_uncorr_blocks", "fec_corr_bits", "crc_err"]
HEADER = CORE_COLUMNS[:-1] + OPTIONAL_COLUMNS + ["scenario"]

# Widths (docs/PREDICTOR.md "Trace format"): the file-wide "# widths:" line holds for IB rails;
# a "# widths for eth:" line gives Ethernet rails (names start with ETH_PREFIX) their own.
# IB: the PortCounters widths of shared/reference/03_ib_counter_widths.tsv, the mlx5
# hw_counters as wrap32; fec_* and crc_err (empty on IB rails) undeclared = wrap64.
WIDTHS = {
    "retrans": ("wrap", 32),        # mlx5 hw_counters (32-bit Q counters)
    "tx_packets": ("wrap", 64),     # PortCountersExtended
    "rx_packets": ("wrap", 64),
    "tx_bytes": ("wrap", 64),       # port_xmit_data (64-bit words) x 4
    "rx_bytes": ("wrap", 64),
    "symbol_err": ("sat", 16),      # symbol_error
    "rcv_err": ("sat", 16),         # port_rcv_errors
    "link_recovery": ("sat", 8),    # link_error_recovery
    "link_downed": ("sat", 8),      # link_downed
    "integrity": ("sat", 4),        # local_link_integrity_errors
    "buf_overrun": ("wrap", 32),    # hw_counters/out_of_buffer (dominant part)
}
# Ethernet / RoCE netdev: Linux's rtnl_link_stats64 and ethtool FEC statistics are 64-bit and
# wrap; carrier_changes / carrier_down_count are 32-bit counters (atomic_t), wrap32.  Every
# counter an Ethernet rail reports is declared (symbol_err and integrity are empty there).
ETH_PREFIX = "eth"
ETH_WIDTHS = {
    "retrans": ("wrap", 64),        # TCP_INFO / running sum (0 or constant on 40% of rails)
    "tx_packets": ("wrap", 64),     # statistics/tx_packets
    "rx_packets": ("wrap", 64),
    "tx_bytes": ("wrap", 64),
    "rx_bytes": ("wrap", 64),
    "rcv_err": ("wrap", 64),        # statistics/rx_errors
    "link_recovery": ("wrap", 32),  # carrier_changes
    "link_downed": ("wrap", 32),    # carrier_down_count
    "buf_overrun": ("wrap", 64),    # rx_over + rx_fifo + rx_missed errors + tx_dropped
    "crc_err": ("wrap", 64),        # statistics/rx_crc_errors
    "fec_corr_blocks": ("wrap", 64),
    "fec_uncorr_blocks": ("wrap", 64),
    "fec_corr_bits": ("wrap", 64),
}
WIDTHS_LINE = "# widths: " + " ".join(f"{k}={b}{n}" for k, (b, n) in WIDTHS.items())
ETH_WIDTHS_LINE = (f"# widths for {ETH_PREFIX}: " +
                   " ".join(f"{k}={b}{n}" for k, (b, n) in ETH_WIDTHS.items()))
WIDTHS_LINES = [WIDTHS_LINE, ETH_WIDTHS_LINE]


def width_of(col, kind="ib"):
    """(behaviour, bits) of a counter on a rail of this kind, as the file declares it."""
    if kind == "eth" and col in ETH_WIDTHS:
        return ETH_WIDTHS[col]
    return WIDTHS.get(col, ("wrap", 64))


def rail_kind(name):
    """'ib' / 'eth' from the rail name; '?' when the name does not tell (or tells both)."""
    is_eth, is_ib = name.startswith(ETH_PREFIX), name.startswith("ib")
    return "?" if is_eth == is_ib else ("eth" if is_eth else "ib")


IB_ONLY = ("symbol_err", "integrity")
ETH_ONLY = ("fec_corr_blocks", "fec_uncorr_blocks", "fec_corr_bits", "crc_err")
FEC_COLS = ("fec_corr_blocks", "fec_uncorr_blocks", "fec_corr_bits")

# --------------------------------------------------------------------------------------------
# Parameter table: every random range the generator draws from (printed by --describe).
# dist: u (uniform), logu (log-uniform), int (uniform integer, inclusive), p (probability),
#       zlogu (0 with probability z, else log-uniform), choice.
# --------------------------------------------------------------------------------------------
PARAMS = [
    # clock and layout
    ("node_hours", "u", (1.0, 2.0), "trace length of a node, h (its rails share the sampler clock)"),
    ("node_rails", "int", (2, 8), "rails per node (a node's rows interleave, sample by sample)"),
    ("node_t0_s", "u", (0.0, 86400.0), "first t_s of a node"),
    ("jitter_sd_s", "logu", (0.002, 0.03), "timer jitter s.d. per node: dt = 5 s + N(0, sd)"),
    ("late_p", "p", 0.002, "probability a sample is late"),
    ("late_s", "u", (0.05, 1.0), "lateness of a late sample, s"),
    # link speed and reading quality
    ("speed_ib", "choice", ((100000, 200000, 400000), (0.2, 0.4, 0.4)), "IB speed_mbps (EDR/HDR/NDR)"),
    ("speed_eth", "choice", ((100000, 200000, 400000), (0.3, 0.3, 0.4)), "Ethernet speed_mbps"),
    ("speed_na_rail_p", "p", 0.04, "rail whose speed reads N/A throughout"),
    ("speed_na_rows_p", "p", 0.08, "rail with sporadic N/A speed rows"),
    ("speed_na_row_p", "logu", (0.002, 0.02), "  ... fraction of its rows"),
    ("cell_na_rail_p", "p", 0.08, "rail with sporadic N/A counter cells"),
    ("cell_na_p", "logu", (1e-4, 3e-3), "  ... fraction of its counter cells"),
    ("ib_no_hw_p", "p", 0.05, "IB rail without hw_counters (retrans N/A throughout)"),
    ("eth_nofec_p", "p", 0.12, "Ethernet rail without FEC statistics (fec_* empty; healthy/other scenarios)"),
    ("eth_retrans_zero_p", "p", 0.4, "Ethernet rail whose retrans stays 0 (no RoCE hw counters)"),
    # traffic
    ("profile_healthy", "choice", (("light", "moderate", "busy"), (0.3, 0.35, 0.35)), "traffic of most rails"),
    ("seg_s", "logu", (10.0, 600.0), "length of a constant-traffic segment, s"),
    ("util_light", "logu", (1e-4, 0.05), "light utilisation (fraction of line rate)"),
    ("util_moderate", "u", (0.02, 0.5), "moderate utilisation"),
    ("util_busy_on", "u", (0.6, 0.98), "busy: line-rate phase utilisation"),
    ("util_busy_off", "u", (0.0, 0.05), "busy: gap utilisation"),
    ("busy_on_s", "logu", (5.0, 600.0), "busy: line-rate phase length, s"),
    ("busy_off_s", "logu", (5.0, 300.0), "busy: gap length, s"),
    ("util_noise", "u", (0.02, 0.15), "per-sample utilisation noise (log s.d.)"),
    ("rx_asym", "u", (0.7, 1.3), "rx/tx utilisation ratio"),
    ("mgmt_pps", "logu", (0.05, 50.0), "management packets/s (all rails; idle rails: only these)"),
    ("pkt_ib_B", "u", (1024.0, 4200.0), "IB mean packet size, bytes"),
    ("pkt_eth_B", "logu", (300.0, 9000.0), "Ethernet mean frame size, bytes"),
    # healthy floors (mean rates per second), each counter on its own scale
    ("floor_sym_ib", "bins", ("0", "1e-4..1e-3", "1e-3..1e-2", "1e-2..0.1", "0.1..1", "1..5"),
     "IB symbol_err floor /s: stratified over these bins (log-uniform inside)"),
    ("floor_bits_eth", "bins", ("0", "1e-2..0.1", "0.1..1", "1..10", "10..100", "100..1000", "1000..3000"),
     "Ethernet fec_corr_bits floor /s: stratified over these bins"),
    ("floor_crc_nofec", "bins", ("0", "1e-4..1e-3", "1e-3..1e-2", "1e-2..0.1", "0.1..1"),
     "crc_err floor /s of Ethernet rails without FEC statistics: stratified"),
    ("rcv_per_sym", "logu", (0.005, 0.5), "IB: port_rcv_errors per symbol error at full load"),
    ("rcv_other", "zlogu", (0.6, 1e-4, 0.1), "IB rcv_err floor not from symbol errors /s"),
    ("retrans_floor_ib", "zlogu", (0.2, 1e-3, 1e3), "IB retrans floor /s (adaptive routing, congestion)"),
    ("retrans_per_err", "logu", (0.3, 5.0), "retrans per received packet error"),
    ("integ_floor", "zlogu", (0.7, 1e-5, 1e-3), "IB local_link_integrity_errors floor /s"),
    ("lrec_floor", "zlogu", (0.7, 1e-5, 1e-4), "IB link_error_recovery floor /s"),
    ("bufo_floor_ib", "zlogu", (0.5, 1e-3, 10.0), "IB buf_overrun floor /s"),
    ("bits_per_block", "u", (1.0, 1.6), "Ethernet corrected bits per corrected codeword (low BER)"),
    ("uncorr_floor", "zlogu", (0.85, 1e-5, 1e-2), "Ethernet fec_uncorr_blocks floor /s"),
    ("crc_per_uncorr", "u", (0.2, 1.0), "crc errors per uncorrectable codeword (under load)"),
    ("crc_other", "zlogu", (0.7, 1e-4, 0.5), "Ethernet crc_err floor /s (FEC rails)"),
    ("rx_other", "zlogu", (0.7, 1e-4, 1.0), "Ethernet rx_errors not CRC /s"),
    ("retrans_floor_eth", "logu", (1e-3, 5.0), "Ethernet (RoCE) retrans floor /s"),
    ("bufo_floor_eth", "zlogu", (0.4, 1e-3, 100.0), "Ethernet buf_overrun floor /s"),
    # starting readings
    ("start_pkts", "logu", (1e5, 1e13), "packet counters at the first row"),
    ("start_err16", "zlogu", (0.25, 1.0, 60000.0), "IB symbol_err / rcv_err at the first row"),
    ("start_sat16_p", "p", 0.05, "IB rcv_err already saturated (65535)"),
    ("start_sat8_p", "p", 0.04, "IB link_recovery / link_downed already 255"),
    ("start_lrec_ib", "zlogu", (0.3, 1.0, 40.0), "IB link_recovery at the first row"),
    ("start_ldown_ib", "zlogu", (0.3, 1.0, 60.0), "IB link_downed at the first row"),
    ("start_integ", "int", (0, 15), "IB integrity at the first row (20% at 15)"),
    ("start_carrier", "int", (1, 30), "Ethernet carrier_changes at the first row"),
    ("start_wrap32", "zlogu", (0.2, 1.0, 3e9), "retrans / buf_overrun at the first row"),
    ("start_fec_bits", "logu", (1e3, 1e14), "fec_corr_bits at the first row"),
    ("start_small64", "zlogu", (0.3, 1.0, 1e5), "fec_uncorr_blocks / crc_err / Eth rcv_err at the first row"),
    ("near_wrap_p", "p", 0.06, "a wrapping counter starts near its wrap (wraps mid-trace)"),
    # Ethernet starting readings beyond IB widths (drawn from a per-rail side stream, so that
    # every other reading of the file is the same as with file-wide IB widths)
    ("eth_carrier_near_wrap_p", "p", 0.2,
     "Ethernet carrier_down_count / carrier_changes start just below 2^32 (wrap if the rail has carrier events)"),
    ("eth_carrier_gap", "logu", (1.0, 1e4), "  ... distance below 2^32 on rails without carrier events"),
    ("eth_rx_other_large_p", "p", 0.2, "Ethernet rx_errors starts with a large non-CRC part"),
    ("eth_rx_other_large", "logu", (1e5, 1e10), "  ... that non-CRC part (rx_errors > 65535)"),
    # healthy scenario details
    ("reset_periodic_p", "p", 0.3, "healthy-reset: periodic clearing (else once)"),
    ("reset_period_s", "logu", (300.0, 1800.0), "healthy-reset: clearing period, s"),
    ("reset_pma_only_p", "p", 0.5, "IB reset clears only PortCounters errors (perfquery -R), else all"),
    ("sat_start_p", "p", 0.5, "healthy-saturated: symbol_err 65535 from the first row (else reaches it)"),
    ("sat_floor", "logu", (0.05, 5.0), "healthy-saturated: symbol_err floor /s"),
    ("burst_per_h", "logu", (0.5, 6.0), "healthy-burst: isolated one-sample bursts per hour"),
    ("burst_sym", "logu", (5.0, 5000.0), "  ... IB symbol errors in a burst"),
    ("burst_bits", "logu", (1e2, 1e7), "  ... Ethernet corrected bits in a burst"),
    ("burst_uncorr", "zlogu", (0.5, 1.0, 100.0), "  ... uncorrectable blocks in a burst"),
    ("burst_pkt_err", "logu", (1.0, 100.0), "  ... rcv / crc errors in a burst (under load)"),
    ("burst_lrec_p", "p", 0.2, "  ... burst with a link recovery (IB) / carrier blip (Eth)"),
    ("wander_amp", "u", (0.3, 1.0), "healthy-wander: bound of the floor's slow wander, log2 units"),
    ("wander_tau_s", "logu", (300.0, 1800.0), "healthy-wander: wander time scale, s"),
    ("overrun_p", "u", (0.05, 0.6), "busy-overrun: probability of an overrun burst per line-rate sample"),
    ("overrun_n", "logu", (10.0, 1e5), "busy-overrun: overruns in a burst"),
    # failures
    ("lead_in_s", "logu", (30.0, 3600.0), "healthy time before the precursor starts, s"),
    ("precursor_s", "logu", (60.0, 1800.0), "precursor length (onset -> link down), s"),
    ("doubling_s", "logu", (20.0, 300.0), "doubling time of the error rate, s"),
    ("log2_ratio", "u", (2.0, 24.0), "accepted log2(failure level / onset level)"),
    ("onset_sym", "logu", (0.02, 1.0), "IB: symbol errors /s at the onset (or the floor if higher)"),
    ("fail_sym", "logu", (10.0, 1e5), "IB: accepted symbol errors /s at link down"),
    ("onset_bits", "logu", (0.5, 50.0), "Eth: corrected bits /s at the onset (or the floor)"),
    ("fail_bits", "logu", (1e3, 1e8), "Eth: accepted corrected bits /s at link down"),
    ("onset_crc", "logu", (0.002, 0.2), "Eth without FEC stats: crc errors /s at the onset"),
    ("fail_crc", "logu", (1.0, 1e4), "Eth without FEC stats: accepted crc errors /s at link down"),
    ("shape", "choice", (("exp", "stair", "convex", "concave", "bursty"), (0.55, 0.15, 0.1, 0.1, 0.1)),
     "rise shape (log-rate: linear, steps, late, early, intermittent)"),
    ("stair_steps", "int", (2, 8), "stair: number of steps"),
    ("convex_g", "u", (1.5, 3.0), "convex: log-rate ~ u^g"),
    ("concave_g", "u", (0.4, 0.75), "concave: log-rate ~ u^g"),
    ("bursty_p0", "u", (0.05, 0.3), "bursty: on-probability at the onset (rises to 1)"),
    ("wobble", "u", (0.0, 0.4), "per-sample wobble of the rising rate, log2 s.d."),
    ("uncorr_at_fail", "logu", (0.5, 1e4), "Eth: uncorrectable blocks /s at link down"),
    ("uncorr_exp", "u", (1.5, 6.0), "Eth: uncorrectable ~ (excess / failure level)^m"),
    ("bits_per_block_fail", "u", (1.5, 4.0), "Eth: corrected bits per codeword at link down"),
    ("integ_thr", "logu", (5.0, 500.0), "IB: symbol rate where integrity errors start, /s"),
    ("integ_rate", "logu", (0.002, 0.05), "IB: integrity errors /s at 10x that rate"),
    ("lrec_at_fail_p", "p", 0.6, "creep with link recoveries / carrier blips near the end"),
    ("lrec_at_fail", "logu", (0.005, 0.5), "  ... their rate at link down /s"),
    ("lrec_exp", "u", (1.0, 4.0), "  ... rate ~ (excess / failure level)^m"),
    ("downshift_p", "p", 0.15, "creep: speed halves during the precursor (retrain to lower width)"),
    ("storm_rate0", "logu", (1.0 / 3600, 1.0 / 120), "storm: link recoveries /s at the onset"),
    ("storm_rate_fail", "logu", (0.03, 1.0), "storm: accepted link recoveries /s at link down (precursor and doubling drawn as for creep)"),
    ("storm_phys_p", "p", 0.5, "storm: physical errors also rise (log2 ratio 1..5)"),
    ("storm_sym", "logu", (1.0, 2000.0), "storm: IB symbol errors per recovery"),
    ("storm_bits", "logu", (1e2, 1e6), "storm: Eth corrected bits per carrier blip"),
    ("storm_pkt_loss", "logu", (1.0, 5000.0), "storm: retrans per recovery (under load)"),
    ("flap_precursor_s", "logu", (60.0, 900.0), "flap: precursor before the first drop, s"),
    ("flap_n", "int", (2, 8), "flap: link downs"),
    ("flap_down_samples", "int", (1, 6), "flap: samples down per flap"),
    ("flap_up_s", "logu", (15.0, 600.0), "flap: up time between flaps, s"),
    ("flap_level", "logu", (0.02, 0.5), "flap: error / recovery level between flaps, x failure level"),
    ("down_s", "logu", (10.0, 1200.0), "down time before a failed rail comes back, s"),
    ("outcome", "choice", (("down", "healthy", "again"), (0.45, 0.25, 0.30)),
     "creep/storm after link down: stays down / back healthy / back and fails again"),
    ("again_speedup", "u", (0.2, 1.0), "fails again: precursor and doubling time x this"),
    ("sudden_outcome", "choice", (("down", "healthy", "again"), (0.6, 0.28, 0.12)),
     "sudden after link down: stays down / back healthy / back and drops suddenly again"),
    ("sudden_burst_p", "p", 0.5, "sudden: error burst counted in the down row (not before)"),
]
PARAM = {name: (dist, args) for name, dist, args, _ in PARAMS}

# Scenarios: name -> (counts per kind at scale 1, healthy?, description)
SCENARIOS = [
    ("healthy-floor", {"ib": 110, "eth": 110}, True,
     "steady floors (Poisson), stratified over floor decades"),
    ("healthy-reset", {"ib": 25, "eth": 25}, True,
     "steady floors, counters cleared mid-trace (once or periodically)"),
    ("healthy-saturated", {"ib": 30}, True,
     "IB symbol_err at 65535 from the start or reaching it"),
    ("healthy-burst", {"ib": 20, "eth": 20}, True,
     "steady floors + isolated one-sample error bursts that do not grow"),
    ("healthy-wander", {"ib": 10, "eth": 10}, True,
     "floors wandering slowly within x0.5..x2 (temperature-like), never growing away"),
    ("idle", {"ib": 15, "eth": 15}, True,
     "near-zero traffic (management packets only), floors as healthy-floor"),
    ("busy-overrun", {"ib": 20, "eth": 20}, True,
     "line-rate phases with buffer-overrun bursts, floors as healthy-floor"),
    ("creep-ib", {"ib": 36}, False,
     "IB symbol errors rise from the floor to a failure level (+ rcv_err, retrans, integrity)"),
    ("creep-ib-sat", {"ib": 6}, False,
     "creep-ib with symbol_err saturated from the first row (signal only in other counters)"),
    ("creep-eth", {"eth": 34}, False,
     "corrected bits/blocks rise, later uncorrectable blocks, crc and rx errors"),
    ("creep-eth-nofec", {"eth": 8}, False,
     "Ethernet without FEC statistics: crc / rx errors rise"),
    ("storm", {"ib": 12, "eth": 12}, False,
     "link recoveries (IB) / carrier blips (Eth) at a rising rate, then link down"),
    ("flap", {"ib": 8, "eth": 8}, False,
     "precursor, then repeated short link downs (every 1 -> 0 is a failure)"),
    ("sudden", {"ib": 11, "eth": 11}, False,
     "link down without any precursor (reported apart)"),
]
SCEN = {s[0]: s for s in SCENARIOS}


def bin_range(label):
    if label == "0":
        return 0.0, 0.0
    lo, hi = label.split("..")
    return float(lo), float(hi)


class Draw:
    """Draws from the PARAMS table with one rng."""

    def __init__(self, rng):
        self.rng = rng

    def __call__(self, name):
        dist, a = PARAM[name]
        r = self.rng
        if dist == "u":
            return float(r.uniform(a[0], a[1]))
        if dist == "logu":
            return float(math.exp(r.uniform(math.log(a[0]), math.log(a[1]))))
        if dist == "int":
            return int(r.integers(a[0], a[1] + 1))
        if dist == "p":
            return bool(r.random() < a)
        if dist == "zlogu":
            if r.random() < a[0]:
                return 0.0
            return float(math.exp(r.uniform(math.log(a[1]), math.log(a[2]))))
        if dist == "choice":
            vals, w = a
            return vals[int(r.choice(len(vals), p=np.asarray(w) / sum(w)))]
        raise ValueError(name)

    def binned(self, name, k):
        labels = PARAM[name][1]
        lo, hi = bin_range(labels[k % len(labels)])
        if hi == 0:
            return 0.0
        return float(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))

    def logu(self, lo, hi):
        return float(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))


# --------------------------------------------------------------------------------------------
# One rail
# --------------------------------------------------------------------------------------------

def decade_label(x):
    if x <= 0:
        return "0"
    k = math.floor(math.log10(x) + 1e-12)
    return f"1e{k}..1e{k + 1}"


class Rail:
    def __init__(self, rng, name, kind, scenario, stratum, t, dt, side=None):
        self.rng = rng
        # side stream: draws added after the file was frozen (Ethernet widths), kept off the
        # main stream so that the rest of the file does not move
        self.side = side if side is not None else np.random.default_rng(0)
        self.d = Draw(rng)
        self.name, self.kind, self.scenario, self.stratum = name, kind, scenario, stratum
        self.t, self.dt = t, dt
        self.n = len(t)
        self.tm = t - dt / 2.0
        self.healthy = SCEN[scenario][2]
        self.events = []       # dicts: t_fail, kind, precursor_s, doubling_s, ...
        self.downs = []        # (i_down, i_up or n)
        self.resets = []       # (index, set of columns)
        n = self.n
        self.inc = {c: np.zeros(n, np.float64) for c in COUNTERS}  # per-interval counts
        self.rate = {}

    # ---------------------------------------------------------------- static properties
    def setup(self):
        d, n, kind = self.d, self.n, self.kind
        self.speed = d("speed_ib" if kind == "ib" else "speed_eth")
        self.speed_arr = np.full(n, float(self.speed))
        self.nofec = kind == "eth" and (self.scenario == "creep-eth-nofec" or
                                         (self.scenario not in ("creep-eth",) and d("eth_nofec_p")))
        self.no_hw = kind == "ib" and d("ib_no_hw_p")
        self.retrans_zero = kind == "eth" and d("eth_retrans_zero_p")
        # traffic profile
        if self.scenario == "idle":
            prof = "idle"
        elif self.scenario == "busy-overrun":
            prof = "busy"
        elif self.scenario in ("creep-ib-sat", "creep-eth-nofec"):
            prof = "moderate" if self.rng.random() < 0.4 else "busy"
        else:
            prof = d("profile_healthy")
            if not self.healthy and self.rng.random() < 0.08:
                prof = "idle"
        self.profile = prof
        self.traffic()
        self.floors()

    def segments(self, draw_len, draw_val):
        n, out, i = self.n, np.zeros(self.n), 0
        while i < n:
            L = max(1, int(round(draw_len() / DT)))
            out[i:i + L] = draw_val()
            i += L
        return out

    def traffic(self):
        d, n, rng = self.d, self.n, self.rng
        prof = self.profile
        if prof == "idle":
            u = np.zeros(n)
        elif prof == "light":
            u = self.segments(lambda: d("seg_s"), lambda: d("util_light"))
        elif prof == "moderate":
            u = self.segments(lambda: d("seg_s"), lambda: d("util_moderate"))
        else:
            u, i, on = np.zeros(n), 0, bool(rng.random() < 0.5)
            while i < n:
                L = max(1, int(round(d("busy_on_s" if on else "busy_off_s") / DT)))
                u[i:i + L] = d("util_busy_on") if on else d("util_busy_off")
                i += L
                on = not on
        self.busy_on = u >= 0.55
        sd = d("util_noise")
        tx = np.clip(u * np.exp(rng.normal(0, sd, n)), 0, 0.99)
        if rng.random() < 0.7:
            rx = np.clip(tx * d("rx_asym") * np.exp(rng.normal(0, sd, n)), 0, 0.99)
        else:
            rx = np.clip(np.roll(tx, int(rng.integers(0, n))) * d("rx_asym"), 0, 0.99)
        self.tx_u, self.rx_u = tx, rx
        self.mgmt = d("mgmt_pps")
        self.pkt = d("pkt_ib_B" if self.kind == "ib" else "pkt_eth_B")
        # activity: fraction of the link's time carrying packets (what packet errors need)
        mg = self.mgmt * 300.0 * 8 / (self.speed * 1e6)
        self.act_rx = np.clip(rx + mg, 0, 1)
        self.act_tx = np.clip(tx + mg, 0, 1)
        self.act_norm = max(float(self.act_rx.mean()), 1e-6)

    def floors(self):
        d, kind, k = self.d, self.kind, self.stratum
        f = {}
        if kind == "ib":
            f["symbol_err"] = d.binned("floor_sym_ib", k)
            f["rcv_per_sym"] = d("rcv_per_sym")
            f["rcv_other"] = d("rcv_other")
            f["retrans"] = 0.0 if self.no_hw else d("retrans_floor_ib")
            f["integrity"] = d("integ_floor")
            f["link_recovery"] = d("lrec_floor")
            f["buf_overrun"] = d("bufo_floor_ib")
            self.primary = "symbol_err"
            if self.scenario == "healthy-saturated":
                f["symbol_err"] = d("sat_floor")
        else:
            f["bits_per_block"] = d("bits_per_block")
            if self.nofec:
                f["fec_corr_bits"] = 0.0
                f["crc_other"] = d.binned("floor_crc_nofec", k)
                self.primary = "crc_err"
            else:
                f["fec_corr_bits"] = d.binned("floor_bits_eth", k)
                f["crc_other"] = d("crc_other")
                self.primary = "fec_corr_bits"
            f["fec_uncorr_blocks"] = d("uncorr_floor")
            f["crc_per_uncorr"] = d("crc_per_uncorr")
            f["rx_other"] = d("rx_other")
            f["retrans"] = 0.0 if self.retrans_zero else d("retrans_floor_eth")
            f["buf_overrun"] = d("bufo_floor_eth")
            f["link_recovery"] = 0.0
        f["retrans_per_err"] = d("retrans_per_err")
        self.f = f
        self.wander = np.ones(self.n)

    def primary_floor(self):
        return self.f["crc_other"] if self.primary == "crc_err" else self.f[self.primary]

    def max_floor(self):
        """Highest mean per-second floor over the rail's error counters."""
        f = self.f
        if self.kind == "ib":
            c = [f["symbol_err"], f["rcv_other"], f["retrans"], f["buf_overrun"]]
        else:
            c = [f["fec_corr_bits"], f["fec_uncorr_blocks"], f["crc_other"], f["rx_other"],
                 f["retrans"], f["buf_overrun"]]
        return max(c)

    # ---------------------------------------------------------------- link timeline
    def idx_at(self, t_abs):
        return int(np.searchsorted(self.t, t_abs, side="left"))

    def link(self):
        lk = np.ones(self.n, np.int8)
        for a, b in self.downs:
            lk[a:b] = 0
        return lk

    def add_down(self, t_fail, down_samples=None, down_s=None):
        """Link down from the first sample at/after t_fail; returns (i_down, i_up)."""
        i = max(2, self.idx_at(t_fail))
        if i >= self.n:
            return None
        if down_samples is not None:
            j = min(self.n, i + down_samples)
        elif down_s is None:
            j = self.n
        else:
            j = min(self.n, max(i + 1, self.idx_at(self.t[i] + down_s)))
        self.downs.append((i, j))
        return i, j

    # ---------------------------------------------------------------- rising curves
    def curve(self, t_on, t_fail, start, F, shape=None, t_lo=None):
        """Excess rate at the interval midpoints: start at t_on -> F at t_fail, 0 after."""
        d, rng, tm = self.d, self.rng, self.tm
        shape = shape or d("shape")
        P = max(t_fail - t_on, 1.0)
        R = math.log2(F / start)
        u = (tm - t_on) / P
        uc = np.clip(u, 0, 1)
        info = {"shape": shape}
        if shape == "exp" or shape == "bursty":
            lg = R * np.minimum(u, 1.0)
        elif shape == "stair":
            K = d("stair_steps")
            lg = R * np.ceil(uc * K) / K
            info["steps"] = K
        elif shape == "convex":
            lg = R * uc ** d("convex_g")
        else:
            lg = R * uc ** d("concave_g")
        wob = d("wobble")
        lg = lg + rng.normal(0, wob, self.n) * (u > 0)
        e = start * np.exp2(lg)
        if shape == "bursty":
            p0 = d("bursty_p0")
            p = p0 + (1 - p0) * uc ** 2
            on = rng.random(self.n) < p
            e = np.where(on, e / p, 0.0)
        if shape != "exp":
            e[u < 0] = 0.0
        e[tm > t_fail] = 0.0
        if t_lo is not None:
            e[tm < t_lo] = 0.0
        info["precursor_s"] = P
        info["doubling_s"] = P / R
        info["log2_ratio"] = R
        return e, info

    def plan_growth(self, start, fail_lo, fail_hi, speed=1.0, P_fixed=None):
        """Draw (precursor P, doubling T) with the failure level start*2^(P/T) in range."""
        d = self.d
        lo2, hi2 = PARAM["log2_ratio"][1]
        p_min, t_min = PARAM["precursor_s"][1][0], PARAM["doubling_s"][1][0]
        for _ in range(400):
            # a rail that fails again rises faster, within the same bounds
            P = P_fixed if P_fixed else max(p_min, d("precursor_s") * speed)
            T = max(t_min, d("doubling_s") * speed)
            R = P / T
            F = start * 2.0 ** R
            if lo2 <= R <= hi2 and fail_lo <= F <= fail_hi:
                return P, F
        # fallback (rare): the smallest admissible rise at the slowest doubling
        R = max(lo2, math.log2(max(fail_lo, 4 * start) / start))
        P = max(P_fixed, R * t_min) if P_fixed else max(p_min, min(1800.0, R * 300.0 * speed))
        return P, start * 2.0 ** R

    def place(self, P, t_from, min_lead=30.0, tail=None):
        """Onset time after a lead-in; returns t_on or None if it does not fit."""
        t_end = self.t[-1]
        tail = tail if tail is not None else self.d.logu(60.0, 900.0)
        latest_on = t_end - tail - P
        earliest_on = t_from + min_lead
        if latest_on <= earliest_on:
            return None
        lead = self.d("lead_in_s")
        t_on = t_from + lead
        if t_on > latest_on:
            t_on = self.rng.uniform(earliest_on, latest_on)
        return max(t_on, earliest_on)

    # ---------------------------------------------------------------- scenario builders
    def build(self):
        self.setup()
        s = self.scenario
        self.excess = np.zeros(self.n)      # excess of the primary physical counter
        self.ratio = np.zeros(self.n)       # excess / failure level (0..1)
        self.lrec_ev = np.zeros(self.n)     # extra link recovery / carrier blip events /s
        self.fail_pars = {}
        if s == "healthy-reset":
            self.plan_resets()
        elif s == "healthy-saturated":
            pass
        elif s == "healthy-wander":
            self.plan_wander()
        if s.startswith("creep"):
            self.plan_creep()
        elif s == "storm":
            self.plan_storm()
        elif s == "flap":
            self.plan_flap()
        elif s == "sudden":
            self.plan_sudden()
        self.counts()
        if s == "healthy-burst":
            self.add_bursts()
        if s == "busy-overrun":
            self.add_overruns()
        self.transitions()

    def plan_resets(self):
        d = self.d
        t0, t_end = self.t[0], self.t[-1]
        if d("reset_periodic_p"):
            per = d("reset_period_s")
            ts = list(np.arange(t0 + self.rng.uniform(0.2, 1.0) * per, t_end - 10, per))
        else:
            ts = [self.rng.uniform(t0 + 0.15 * (t_end - t0), t0 + 0.85 * (t_end - t0))]
        for tr in ts:
            i = self.idx_at(tr)
            if 2 <= i < self.n:
                if self.kind == "ib" and d("reset_pma_only_p"):
                    cols = {"symbol_err", "rcv_err", "link_recovery", "link_downed", "integrity"}
                else:
                    cols = set(COUNTERS)
                self.resets.append((i, cols))

    def plan_wander(self):
        d, rng, n = self.d, self.rng, self.n
        amp, tau = d("wander_amp"), d("wander_tau_s")
        a = math.exp(-DT / tau)
        x = np.zeros(n)
        x[0] = rng.normal(0, amp / 2)
        eps = rng.normal(0, amp / 2 * math.sqrt(1 - a * a), n)
        for i in range(1, n):
            x[i] = a * x[i - 1] + eps[i]
        self.wander = np.exp2(np.clip(x, -amp, amp))

    def physical_start(self):
        """Onset level of the primary counter's excess and its failure-level range."""
        d, f = self.d, self.f
        if self.kind == "ib":
            return max(d("onset_sym"), f["symbol_err"]), PARAM["fail_sym"][1]
        if self.nofec:
            return max(d("onset_crc"), f["crc_other"]), PARAM["fail_crc"][1]
        return max(d("onset_bits"), f["fec_corr_bits"]), PARAM["fail_bits"][1]

    def add_creep_episode(self, t_from, speed=1.0, tag="creep"):
        start, (flo, fhi) = self.physical_start()
        P, F = self.plan_growth(start, flo, fhi, speed)
        t_on = self.place(P, t_from)
        if t_on is None:
            return None
        t_fail = t_on + P
        e, info = self.curve(t_on, t_fail, start, F, t_lo=t_from)
        self.excess += e
        self.ratio = np.maximum(self.ratio, np.minimum(e / F, 1.0))
        d = self.d
        if d("lrec_at_fail_p"):
            self.lrec_ev += d("lrec_at_fail") * np.minimum(e / F, 1.0) ** d("lrec_exp")
        if self.rng.random() < PARAM["downshift_p"][1]:
            ts = t_on + self.rng.uniform(0.3, 0.9) * P
            i = self.idx_at(ts)
            self.speed_arr[i:] = self.speed_arr[i:] / 2
            self.inc["link_recovery"][min(i, self.n - 1)] += 1 if self.kind == "ib" else 2
            if self.kind == "eth":
                self.inc["link_downed"][min(i, self.n - 1)] += 1
            info["downshift"] = True
        info.update(kind=tag, onset=start, fail_level=F, floor=self.primary_floor())
        return t_fail, info

    def finish_failure(self, t_fail, info, outcome_name="outcome"):
        d = self.d
        outcome = d(outcome_name)
        r = self.add_down(t_fail, down_s=None if outcome == "down" else d("down_s"))
        if r is None:
            return None
        i, j = r
        info["t_fail"] = float(self.t[i])
        info["outcome"] = outcome if j < self.n else "down"
        if j < self.n:
            self.speed_arr[j:] = float(self.speed)  # retrained at full speed
        self.events.append(info)
        return outcome, j

    def plan_creep(self):
        t_from, speed = self.t[0], 1.0
        for _ in range(3):
            r = self.add_creep_episode(t_from, speed, tag=self.scenario)
            if r is None:
                break
            t_fail, info = r
            fin = self.finish_failure(t_fail, info)
            if fin is None:
                break
            outcome, j = fin
            if outcome != "again" or j >= self.n:
                break
            t_from = self.t[j]
            speed *= self.d("again_speedup")

    def add_storm_episode(self, t_from, speed=1.0):
        d = self.d
        r0 = d("storm_rate0")
        P, rF = self.plan_growth(r0, *PARAM["storm_rate_fail"][1], speed=speed)
        t_on = self.place(P, t_from)
        if t_on is None:
            return None
        t_fail = t_on + P
        e, info = self.curve(t_on, t_fail, r0, rF, shape="exp", t_lo=t_from)
        self.lrec_ev += e
        if d("storm_phys_p"):
            start, _ = self.physical_start()
            F = start * 2.0 ** self.rng.uniform(1.0, 5.0)
            ep, _ = self.curve(t_on, t_fail, start, F, t_lo=t_from)
            self.excess += ep
            self.ratio = np.maximum(self.ratio, 0.3 * np.minimum(ep / F, 1.0))
            info["phys"] = True
        info.update(kind="storm", onset=r0, fail_level=rF, floor=self.primary_floor())
        return t_fail, info

    def plan_storm(self):
        t_from, speed = self.t[0], 1.0
        for _ in range(3):
            r = self.add_storm_episode(t_from, speed)
            if r is None:
                break
            fin = self.finish_failure(*r)
            if fin is None:
                break
            outcome, j = fin
            if outcome != "again" or j >= self.n:
                break
            t_from = self.t[j]
            speed *= self.d("again_speedup")

    def plan_flap(self):
        d, rng = self.d, self.rng
        use_storm = rng.random() < 0.5
        P = d("flap_precursor_s")
        # precursor of the first drop
        if use_storm:
            r0 = d("storm_rate0")
            P, rF = self.plan_growth(r0, *PARAM["storm_rate_fail"][1], P_fixed=P)
            t_on = self.place(P, self.t[0], tail=1500.0)
            if t_on is None:
                t_on = self.t[0] + 60.0
            e, info = self.curve(t_on, t_on + P, r0, rF, shape="exp")
            self.lrec_ev += e
            level_l, level_x, F = rF, 0.0, rF
            info["onset"] = r0
        else:
            start, (flo, fhi) = self.physical_start()
            P, F = self.plan_growth(start, flo, fhi, P_fixed=P)
            t_on = self.place(P, self.t[0], tail=1500.0)
            if t_on is None:
                t_on = self.t[0] + 60.0
            e, info = self.curve(t_on, t_on + P, start, F)
            self.excess += e
            self.ratio = np.maximum(self.ratio, np.minimum(e / F, 1.0))
            level_l, level_x = d("lrec_at_fail") * 0.3, F
            info["onset"] = start
        t_fail = t_on + P
        info.update(kind="flap", onset=info.get("onset", 0), fail_level=F, floor=self.primary_floor())
        nfl = d("flap_n")
        permanent = rng.random() < 0.5
        t_cur, first, t_first_up = t_fail, True, None
        for k in range(nfl):
            last = k == nfl - 1
            ds = None if (last and permanent) else d("flap_down_samples")
            r = self.add_down(t_cur, down_samples=ds)
            if r is None:
                break
            i, j = r
            ev = dict(info) if first else {"kind": "flap", "shape": "flapping", "precursor_s": 0.0,
                                           "doubling_s": float("nan"), "fail_level": F,
                                           "floor": self.primary_floor()}
            ev["t_fail"] = float(self.t[i])
            ev["outcome"] = "down" if j >= self.n else "up"
            self.events.append(ev)
            first = False
            if j >= self.n:
                break
            if t_first_up is None:
                t_first_up = self.t[j]
            up_s = d("flap_up_s")
            t_cur = self.t[j] + up_s
            if last:
                break
            # elevated state while flapping
            sel = (self.tm >= self.t[j]) & (self.tm < t_cur)
            lvl = d("flap_level")
            if level_x > 0:
                self.excess[sel] += level_x * lvl
                self.ratio[sel] = np.maximum(self.ratio[sel], lvl)
            self.lrec_ev[sel] += level_l * lvl + d("lrec_at_fail") * 0.2

    def plan_sudden(self):
        d, t0, t_end = self.d, self.t[0], self.t[-1]
        t_from = t0
        for _ in range(3):
            lo, hi = t_from + 60.0, t_end - 60.0
            if hi <= lo:
                break
            t_fail = self.rng.uniform(lo, hi)
            info = {"kind": "sudden", "shape": "none", "precursor_s": 0.0,
                    "doubling_s": float("nan"), "fail_level": float("nan"),
                    "floor": self.primary_floor()}
            fin = self.finish_failure(t_fail, info, "sudden_outcome")
            if fin is None:
                break
            outcome, j = fin
            if d("sudden_burst_p"):
                i = self.downs[-1][0]
                self.sudden_burst_at = getattr(self, "sudden_burst_at", []) + [i]
            if outcome != "again" or j >= self.n:
                break
            t_from = self.t[j]

    # ---------------------------------------------------------------- counts
    def upfrac(self):
        lk = self.link().astype(bool)
        prev = np.concatenate([[False], lk[:-1]])
        u = (lk & prev).astype(float)
        trans = lk ^ prev
        trans[0] = False
        u[trans] = self.rng.uniform(0.05, 0.95, int(trans.sum()))
        return u, lk

    def counts(self):
        rng, f, n = self.rng, self.f, self.n
        dt = self.dt.copy()
        dt[0] = 0.0
        up, lk = self.upfrac()
        self.lk = lk
        live = dt * up
        sp = self.speed_arr * 1e6 / 8.0  # bytes/s at line rate
        P = lambda lam: rng.poisson(np.maximum(lam, 0.0)).astype(np.float64)
        # traffic
        txb = self.tx_u * sp * live
        rxb = self.rx_u * sp * live
        mtx, mrx = P(self.mgmt * live), P(self.mgmt * live * self.rng.uniform(0.8, 1.2))
        msize = self.rng.uniform(64, 300)
        psz_t = self.pkt * np.exp(rng.normal(0, 0.03, n))
        psz_r = self.pkt * np.exp(rng.normal(0, 0.03, n))
        self.inc["tx_packets"] = np.floor(txb / psz_t) + mtx
        self.inc["rx_packets"] = np.floor(rxb / psz_r) + mrx
        self.inc["tx_bytes"] = np.floor(txb + mtx * msize)
        self.inc["rx_bytes"] = np.floor(rxb + mrx * msize)
        rxp = self.inc["rx_packets"]
        act_rx, act_tx, an = self.act_rx, self.act_tx, self.act_norm
        w = self.wander
        R = self.ratio
        # recovery / carrier-blip events (storms, creep endings, flapping)
        lrec_rate = f["link_recovery"] + self.lrec_ev
        ev = P(lrec_rate * live)
        if self.kind == "ib":
            sym_rate = f["symbol_err"] * w + self.excess
            sym = P(sym_rate * live)
            # recoveries come with symbol-error bursts
            evn = ev > 0
            sym[evn] += np.round(ev[evn] * np.array([self.d("storm_sym") for _ in range(int(evn.sum()))]))
            rcv = P(((sym_rate * f["rcv_per_sym"]) * act_rx + f["rcv_other"] * act_rx / an) * live)
            rcv[evn] += P(ev[evn] * 3 * act_rx[evn])
            rcv = np.minimum(rcv, rxp)
            loss = np.zeros(n)
            loss[evn] = ev[evn] * np.array([self.d("storm_pkt_loss") for _ in range(int(evn.sum()))]) * act_tx[evn]
            retr = P(f["retrans"] * act_tx / an * live) + P(rcv * f["retrans_per_err"]) + np.round(loss)
            if self.no_hw:
                retr[:] = 0
            thr, ir = self.d("integ_thr"), self.d("integ_rate")
            integ_rate = f["integrity"] + ir * np.clip(sym_rate / thr - 1.0, 0, 20) / 9.0
            integ = P(integ_rate * live) + P(ev * 0.3)
            bufo = P(f["buf_overrun"] * act_rx / an * live)
            self.inc.update(symbol_err=sym, rcv_err=rcv, retrans=retr, integrity=integ,
                            buf_overrun=bufo, link_recovery=self.inc["link_recovery"] + ev)
        else:
            bits_rate = f["fec_corr_bits"] * w + (0 if self.nofec else self.excess)
            bits = P(bits_rate * live)
            evn = ev > 0
            bits[evn] += np.round(ev[evn] * np.array([self.d("storm_bits") for _ in range(int(evn.sum()))]))
            kfail = self.d("bits_per_block_fail")
            bpb = f["bits_per_block"] + (kfail - f["bits_per_block"]) * R
            blocks = np.floor(bits / np.maximum(bpb, 1.0))
            um = self.d("uncorr_at_fail") * R ** self.d("uncorr_exp")
            unc_rate = f["fec_uncorr_blocks"] * w + (0 if self.nofec else um)
            unc = P(unc_rate * live)
            unc[evn] += P(ev[evn] * 5)
            crc_rate = (unc_rate * f["crc_per_uncorr"] * act_rx +
                        (f["crc_other"] * w + (self.excess if self.nofec else 0)) * act_rx / an)
            crc = np.minimum(P(crc_rate * live) + P(ev * 2 * act_rx), rxp)
            oth = np.minimum(P(f["rx_other"] * act_rx / an * live), rxp)
            retr = np.zeros(n)
            if not self.retrans_zero:
                loss = np.zeros(n)
                loss[evn] = ev[evn] * np.array([self.d("storm_pkt_loss") for _ in range(int(evn.sum()))]) * act_tx[evn]
                retr = P(f["retrans"] * act_tx / an * live) + P(crc * f["retrans_per_err"]) + np.round(loss)
            bufo = P(f["buf_overrun"] * act_rx / an * live)
            self.inc.update(fec_corr_bits=bits, fec_corr_blocks=blocks, fec_uncorr_blocks=unc,
                            crc_err=crc, rcv_err=crc + oth, retrans=retr, buf_overrun=bufo)
            # carrier blip inside a sample interval: carrier_changes +2, carrier_down +1
            self.inc["link_recovery"] = self.inc["link_recovery"] + 2 * ev
            self.inc["link_downed"] = self.inc["link_downed"] + ev
        for i in getattr(self, "sudden_burst_at", []):
            if self.kind == "ib":
                self.inc["symbol_err"][i] += self.d("burst_sym")
            else:
                self.inc["fec_corr_bits"][i] += round(self.d("burst_bits"))
                self.inc["fec_uncorr_blocks"][i] += round(self.d("burst_uncorr"))

    def add_bursts(self):
        d, rng, n = self.d, self.rng, self.n
        hours = (self.t[-1] - self.t[0]) / 3600.0
        k = int(rng.poisson(d("burst_per_h") * hours))
        for i in rng.integers(2, n, k):
            a = self.act_rx[i]
            if self.kind == "ib":
                s = round(d("burst_sym"))
                self.inc["symbol_err"][i] += s
                r = min(round(d("burst_pkt_err") * a), self.inc["rx_packets"][i])
                self.inc["rcv_err"][i] += r
                if not self.no_hw:
                    self.inc["retrans"][i] += round(r * self.f["retrans_per_err"])
                if d("burst_lrec_p"):
                    self.inc["link_recovery"][i] += 1
            else:
                b = round(d("burst_bits"))
                if not self.nofec:
                    self.inc["fec_corr_bits"][i] += b
                    self.inc["fec_corr_blocks"][i] += math.floor(b / 1.5)
                    self.inc["fec_uncorr_blocks"][i] += round(d("burst_uncorr"))
                c = min(round(d("burst_pkt_err") * a), self.inc["rx_packets"][i])
                self.inc["crc_err"][i] += c
                self.inc["rcv_err"][i] += c
                if not self.retrans_zero:
                    self.inc["retrans"][i] += round(c * self.f["retrans_per_err"])
                if d("burst_lrec_p"):
                    self.inc["link_recovery"][i] += 2
                    self.inc["link_downed"][i] += 1
        self.n_bursts = k

    def add_overruns(self):
        d, rng = self.d, self.rng
        p = d("overrun_p")
        idx = np.nonzero(self.busy_on & (self.lk == 1) & (rng.random(self.n) < p))[0]
        for i in idx:
            self.inc["buf_overrun"][i] += min(round(d("overrun_n")), self.inc["rx_packets"][i] // 2)

    def transitions(self):
        lk = self.lk.astype(int)
        prev = np.concatenate([[1], lk[:-1]])
        for i in np.nonzero((prev == 1) & (lk == 0))[0]:
            self.inc["link_downed"][i] += 1
            if self.kind == "ib":
                self.inc["link_recovery"][i] += 1 if self.rng.random() < 0.5 else 0
            else:
                self.inc["link_recovery"][i] += 1
        for i in np.nonzero((prev == 0) & (lk == 1))[0]:
            if self.kind == "eth":
                self.inc["link_recovery"][i] += 1
        # Eth: link down rows read speed -1 (N/A)
        if self.kind == "eth":
            self.speed_arr[lk == 0] = np.nan

    # ---------------------------------------------------------------- readings
    def starts(self, expected):
        d, rng = self.d, self.rng
        s = {}
        near = lambda c, bits: (2 ** bits - max(1, int(expected[c] * rng.uniform(0.05, 0.9))))
        tp = d("start_pkts")
        rp = tp * rng.uniform(0.5, 2.0)
        s["tx_packets"], s["rx_packets"] = int(tp), int(rp)
        s["tx_bytes"], s["rx_bytes"] = int(tp * self.pkt), int(rp * self.pkt)
        for c in ("tx_packets", "rx_packets", "tx_bytes", "rx_bytes"):
            if d("near_wrap_p") and expected[c] > 0:
                s[c] = near(c, 64)
        for c in ("retrans", "buf_overrun"):
            s[c] = int(d("start_wrap32"))
            if d("near_wrap_p") and expected[c] > 0:
                s[c] = near(c, width_of(c, self.kind)[1])
        if self.kind == "ib":
            s["symbol_err"] = int(d("start_err16"))
            s["rcv_err"] = 65535 if d("start_sat16_p") else int(d("start_err16"))
            s["link_recovery"] = 255 if d("start_sat8_p") else int(d("start_lrec_ib"))
            s["link_downed"] = 255 if d("start_sat8_p") else int(d("start_ldown_ib"))
            s["integrity"] = 15 if rng.random() < 0.2 else d("start_integ")
            if self.scenario == "healthy-reset":
                s["link_downed"] = max(1, s["link_downed"])  # a PMA-only clear is visible
            if self.scenario == "creep-ib-sat":
                s["symbol_err"] = 65535
            elif self.scenario == "healthy-saturated":
                if d("sat_start_p"):
                    s["symbol_err"] = 65535
                else:
                    tot = max(1.0, expected["symbol_err"])
                    s["symbol_err"] = max(0, 65535 - int(tot * rng.uniform(0.1, 0.8)))
            elif self.scenario.startswith("creep") or self.scenario in ("storm", "flap"):
                # most failing IB rails keep a readable symbol counter for a while
                s["symbol_err"] = int(s["symbol_err"] * rng.uniform(0, 0.3))
        else:
            cc = d("start_carrier")
            s["link_recovery"] = cc
            s["link_downed"] = cc // 2
            s["rcv_err"] = int(d("start_small64"))
            bits = d("start_fec_bits")
            s["fec_corr_bits"] = int(bits)
            s["fec_corr_blocks"] = int(bits / self.f["bits_per_block"])
            s["fec_uncorr_blocks"] = int(d("start_small64"))
            s["crc_err"] = min(int(d("start_small64")), s["rcv_err"])
            s["rcv_err"] = max(s["rcv_err"], s["crc_err"])
            rx_other = s["rcv_err"] - s["crc_err"]  # rx_errors counts CRC errors and others
            for c in ETH_ONLY:
                if d("near_wrap_p") and expected[c] > 0:
                    s[c] = near(c, 64)
            # Linux widths: rx_errors is 64-bit, the carrier counters 32-bit.  Drawn from the
            # rail's side stream (the main stream, and so every other reading, is unchanged).
            x = Draw(self.side)
            if x("eth_rx_other_large_p"):
                rx_other = int(x("eth_rx_other_large"))
            s["rcv_err"] = (s["crc_err"] + rx_other) % 2 ** 64  # follows crc_err through a wrap
            if x("eth_carrier_near_wrap_p"):
                e_down = expected["link_downed"]
                gap = (max(1, int(e_down * self.side.uniform(0.05, 0.9))) if e_down > 0
                       else int(x("eth_carrier_gap")))
                down = 2 ** 32 - gap
                s["link_downed"] = down
                # carrier_changes = carrier_up_count + carrier_down_count (mod 2^32)
                s["link_recovery"] = (2 * down + cc % 2) % 2 ** 32
        return s

    def readings(self):
        """Cumulative readings per column as lists of str (widths honoured)."""
        n = self.n
        # IB data counters count 4-byte words: keep bytes multiples of 4
        if self.kind == "ib":
            for c in ("tx_bytes", "rx_bytes"):
                self.inc[c] = np.floor(self.inc[c] / 4.0) * 4.0
        expected = {c: float(self.inc[c].sum()) for c in COUNTERS}
        if self.scenario == "healthy-saturated":
            expected["symbol_err"] = self.f["symbol_err"] * (self.t[-1] - self.t[0])
        st = self.starts(expected)
        if self.kind == "ib":
            for c in ("tx_bytes", "rx_bytes"):
                st[c] = (st[c] // 4) * 4
        cols = {}
        cuts = {c: sorted(i for i, cs in self.resets if c in cs) for c in COUNTERS}
        for c in COUNTERS:
            if (self.kind == "ib" and c in ETH_ONLY) or (self.kind == "eth" and c in IB_ONLY):
                cols[c] = [""] * n
                continue
            if self.kind == "eth" and self.nofec and c in FEC_COLS:
                cols[c] = [""] * n
                continue
            if c == "retrans" and self.no_hw:
                cols[c] = ["N/A"] * n
                continue
            inc = np.asarray(self.inc[c], np.float64)
            inc[0] = 0.0
            incu = np.round(np.maximum(inc, 0)).astype(np.uint64)
            beh, bits = width_of(c, self.kind)
            out = np.empty(n, np.uint64)
            seg = [0] + [i for i in cuts[c] if 0 < i < n] + [n]
            for a, b in zip(seg[:-1], seg[1:]):
                cum = np.cumsum(incu[a:b], dtype=np.uint64)
                if beh == "sat":
                    base = st.get(c, 0) if a == 0 else 0
                    out[a:b] = np.minimum(cum + np.uint64(base), np.uint64(2 ** bits - 1))
                else:
                    base = np.uint64((st.get(c, 0) if a == 0 else 0) % (2 ** 64))
                    v = cum + base
                    if bits < 64:
                        v = v & np.uint64(2 ** bits - 1)
                    out[a:b] = v
            cols[c] = [str(v) for v in out.tolist()]
        return cols

    def render(self):
        """Rows of this rail (list of str), after readings and N/A injection."""
        d, rng, n = self.d, self.rng, self.n
        cols = self.readings()
        # sporadic N/A counter cells
        if d("cell_na_rail_p"):
            p = d("cell_na_p")
            for c in COUNTERS:
                if cols[c][0] == "" or cols[c][0] == "N/A":
                    continue
                for i in np.nonzero(rng.random(n) < p)[0]:
                    cols[c][i] = "N/A"
        # speed
        sp = [("N/A" if math.isnan(v) else str(int(v))) for v in self.speed_arr.tolist()]
        if d("speed_na_rail_p"):
            sp = ["N/A"] * n
        elif d("speed_na_rows_p"):
            p = d("speed_na_row_p")
            for i in np.nonzero(rng.random(n) < p)[0]:
                sp[i] = "N/A"
        ts = [f"{x:.3f}" for x in self.t.tolist()]
        lk = [str(int(x)) for x in self.lk.tolist()]
        rows = []
        name, scen = self.name, self.scenario
        order = [cols[c] for c in HEADER[4:-1]]
        for i in range(n):
            rows.append(",".join([ts[i], name, lk[i], sp[i]] + [o[i] for o in order] + [scen]))
        return rows


# --------------------------------------------------------------------------------------------
# The whole file
# --------------------------------------------------------------------------------------------

def plan(scale, rng):
    """Scenario list per kind: (scenario, stratum)."""
    per_kind = {"ib": [], "eth": []}
    for name, counts, healthy, _ in SCENARIOS:
        for kind, c in counts.items():
            m = max(1, int(round(c * scale)))
            off = int(rng.integers(0, 1000))
            per_kind[kind] += [(name, off + j) for j in range(m)]
    return per_kind


def node_clock(rng, d):
    hours = d("node_hours")
    n = int(hours * 3600.0 / DT) + 1
    sd = d("jitter_sd_s")
    dt = DT + rng.normal(0, sd, n)
    late = rng.random(n) < PARAM["late_p"][1]
    dt[late] += rng.uniform(*PARAM["late_s"][1], int(late.sum()))
    dt = np.clip(dt, DT - 5 * 0.03, None)
    dt[0] = 0.0
    t = d("node_t0_s") + np.cumsum(dt)
    dt[0] = DT
    return t, dt


def generate(out, seed, scale, quiet=False):
    t_start = time.time()
    root = np.random.default_rng(seed)
    per_kind = plan(scale, root)
    stats = []
    rows_total, nbytes = 0, 0
    counters = {"ib": 0, "eth": 0}
    with open(out, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(f"# r2ccl predictor evaluation traces: scripts/predictor/eval_traces.py "
                 f"--seed {seed} --scale {scale:g} (frozen; independent of the training generator)\n")
        for wl in WIDTHS_LINES:
            fh.write(wl + "\n")
        fh.write(",".join(HEADER) + "\n")
        nodes = []
        for kind in ("ib", "eth"):
            lst = per_kind[kind]
            order = root.permutation(len(lst))
            lst = [lst[i] for i in order]
            d = Draw(root)
            i = 0
            while i < len(lst):
                k = d("node_rails")
                nodes.append((kind, lst[i:i + k]))
                i += k
        node_order = root.permutation(len(nodes))
        child_seeds = root.integers(0, 2 ** 63, len(nodes))
        for ni, idx in enumerate(node_order):
            kind, members = nodes[idx]
            rng = np.random.default_rng(int(child_seeds[ni]))
            d = Draw(rng)
            t, dt = node_clock(rng, d)
            rails_rows = []
            for scen, stratum in members:
                counters[kind] += 1
                name = f"{ETH_PREFIX if kind == 'eth' else 'ib'}{counters[kind]:04d}"
                assert rail_kind(name) == kind, name  # its widths line must match its kind
                side = np.random.default_rng([int(child_seeds[ni]), counters[kind], 0xE7])
                r = Rail(rng, name, kind, scen, stratum, t, dt, side)
                r.build()
                rails_rows.append(r.render())
                stats.append({
                    "rail": name, "kind": kind, "scenario": scen, "healthy": r.healthy,
                    "hours": (t[-1] - t[0]) / 3600.0, "rows": len(t),
                    "primary": r.primary, "primary_floor": r.primary_floor(),
                    "max_floor": r.max_floor(), "profile": r.profile, "speed": r.speed,
                    "events": r.events, "resets": len(r.resets), "nofec": r.nofec,
                })
            lines = []
            for i in range(len(t)):
                for rr in rails_rows:
                    lines.append(rr[i])
            blob = "\n".join(lines) + "\n"
            fh.write(blob)
            rows_total += len(lines)
            nbytes += len(blob)
    el = time.time() - t_start
    if not quiet:
        report(stats, out, rows_total, el)
    return stats


def report(stats, out, rows, elapsed):
    import os
    size = os.path.getsize(out)
    print(f"wrote {out}: {size / 1e6:.1f} MB, {rows} rows, {len(stats)} rails, "
          f"{elapsed:.1f} s")
    healthy = [s for s in stats if s["healthy"]]
    hh = sum(s["hours"] for s in healthy)
    print(f"healthy rail-hours: {hh:.1f} ({len(healthy)} rails)")
    print("\nhealthy rail-hours by primary floor decade (IB symbol_err/s; Eth fec_corr_bits/s,"
          " crc_err/s without FEC stats):\n")
    tab = {}
    for s in healthy:
        key = (s["kind"], s["primary"], decade_label(s["primary_floor"]))
        tab[key] = tab.get(key, 0.0) + s["hours"]
    print("| kind | counter | floor /s | rail-hours |\n|---|---|---|---|")
    for key in sorted(tab, key=lambda k: (k[0], k[1], -1e9 if k[2] == "0" else float(k[2].split("..")[0]))):
        print(f"| {key[0]} | {key[1]} | {key[2]} | {tab[key]:.1f} |")
    print("\nhealthy rail-hours by the rail's noisiest error counter floor (any counter):\n")
    tab = {}
    for s in healthy:
        key = (s["kind"], decade_label(s["max_floor"]))
        tab[key] = tab.get(key, 0.0) + s["hours"]
    print("| kind | max floor /s | rail-hours |\n|---|---|---|")
    for key in sorted(tab, key=lambda k: (k[0], -1e9 if k[1] == "0" else float(k[1].split("..")[0]))):
        print(f"| {key[0]} | {key[1]} | {tab[key]:.1f} |")
    print("\nscenarios:\n")
    print("| scenario | kind | rails | rail-hours | failure events | rails failing |\n|---|---|---|---|---|---|")
    agg = {}
    for s in stats:
        k = (s["scenario"], s["kind"])
        a = agg.setdefault(k, [0, 0.0, 0, 0])
        a[0] += 1
        a[1] += s["hours"]
        a[2] += len(s["events"])
        a[3] += 1 if s["events"] else 0
    for name, *_ in SCENARIOS:
        for kind in ("ib", "eth"):
            if (name, kind) in agg:
                a = agg[(name, kind)]
                print(f"| {name} | {kind} | {a[0]} | {a[1]:.1f} | {a[2]} | {a[3]} |")
    ev = [e for s in stats for e in s["events"]]
    pre = [e for e in ev if e["kind"] != "sudden"]
    first_pre = [e for e in pre if e.get("precursor_s", 0) > 0]
    sud = [e for e in ev if e["kind"] == "sudden"]
    print(f"\nfailure events: {len(ev)} ({len(pre)} with a precursor or while flapping, "
          f"{len(first_pre)} after a rising precursor, {len(sud)} sudden)")
    if first_pre:
        P = np.array([e["precursor_s"] for e in first_pre])
        T = np.array([e["doubling_s"] for e in first_pre])
        print(f"precursor s: min {P.min():.0f} median {np.median(P):.0f} max {P.max():.0f}; "
              f"doubling s: min {T.min():.0f} median {np.median(T):.0f} max {T.max():.0f}")
        shapes = {}
        for e in first_pre:
            shapes[e["shape"]] = shapes.get(e["shape"], 0) + 1
        print("shapes:", ", ".join(f"{k} {v}" for k, v in sorted(shapes.items())))


# --------------------------------------------------------------------------------------------
# Self-check: re-read a file and verify it (independent of the generator's internals)
# --------------------------------------------------------------------------------------------

def check(path, expect_scale=None):
    problems = []

    def bad(msg):
        if len(problems) < 50:
            problems.append(msg)

    documented = set(CORE_COLUMNS) | set(OPTIONAL_COLUMNS)
    counter_cols = set(COUNTERS)
    widths = {}      # file-wide "# widths:"
    scoped = []      # ("# widths for PREFIX:", {name: (beh, bits)}), in file order
    header = None
    rails = {}
    nrows = 0
    with open(path, encoding="utf-8") as fh:
        for ln, line in enumerate(fh, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            if line.startswith("#"):
                if line.startswith("# widths:") or line.startswith("# widths for "):
                    if header is not None:
                        bad(f"line {ln}: widths line after the header")
                    head = line.split(":", 1)[0]
                    if head.startswith("# widths for "):
                        prefix = head[len("# widths for "):]
                        if not prefix or " " in prefix or "," in prefix:
                            bad(f"line {ln}: bad widths prefix '{prefix}'")
                        scoped.append((prefix, {}))
                        target = scoped[-1][1]
                    else:
                        target = widths
                    for item in line.split(":", 1)[1].split():
                        name, _, w = item.partition("=")
                        beh = w.rstrip("0123456789")
                        if (name not in counter_cols or beh not in ("sat", "wrap") or
                                not w[len(beh):].isdigit() or not 1 <= int(w[len(beh):]) <= 64):
                            bad(f"line {ln}: bad width {item}")
                            continue
                        target[name] = (beh, int(w[len(beh):]))
                continue
            if header is None:
                header = line.split(",")
                extra = [h for h in header if h not in documented]
                if extra:
                    bad(f"undocumented columns {extra}")
                if len(set(header)) != len(header):
                    bad("duplicate columns")
                for need in ("t_s", "rail", "link", "scenario"):
                    if need not in header:
                        bad(f"missing column {need}")
                ci = {h: i for i, h in enumerate(header)}
                cc = [(h, ci[h]) for h in header if h in counter_cols]
                continue
            f = line.split(",")
            nrows += 1
            if len(f) != len(header):
                bad(f"line {ln}: {len(f)} fields")
                continue
            t = float(f[ci["t_s"]])
            name = f[ci["rail"]]
            lk = f[ci["link"]]
            if lk not in ("0", "1"):
                bad(f"line {ln}: link {lk}")
            sp = f[ci["speed_mbps"]]
            if sp not in ("", "N/A") and not (float(sp) >= 0):
                bad(f"line {ln}: speed {sp}")
            r = rails.get(name)
            if r is None:
                kind = rail_kind(name)
                if kind == "?":
                    bad(f"rail {name}: kind not in the name (ib..., {ETH_PREFIX}...)")
                # this rail's widths: file-wide, then every matching prefix line (later wins)
                rw = {h: widths.get(h, ("wrap", 64)) for h in counter_cols}
                for prefix, decl in scoped:
                    if name.startswith(prefix):
                        rw.update(decl)
                for h in counter_cols:  # declared as a rail of its kind should read
                    if kind != "?" and not (h in (ETH_ONLY if kind == "ib" else IB_ONLY)) \
                            and rw[h] != width_of(h, kind):
                        bad(f"rail {name}: {h} declared {rw[h][0]}{rw[h][1]}, a {kind} rail's "
                            f"is {''.join(map(str, width_of(h, kind)))}")
                r = rails[name] = {"kind": kind, "scenario": f[ci["scenario"]], "t0": t, "t": None,
                                   "link": None, "events": 0, "prev": {}, "decreases": 0,
                                   "wraps": 0, "sat_seen": set(), "rows": 0, "up_s": 0.0,
                                   "prim": 0.0, "prim_s": 0.0, "first_link": lk, "w": rw,
                                   "wrapc": set(), "max": {}}
                if lk != "1":
                    bad(f"rail {name}: first row has link {lk}")
            if f[ci["scenario"]] != r["scenario"]:
                bad(f"rail {name}: scenario changes")
            if r["t"] is not None and not t > r["t"]:
                bad(f"line {ln}: time does not increase for {name}")
            dt = None if r["t"] is None else t - r["t"]
            if dt is not None and not (4.7 <= dt <= 6.5):
                bad(f"line {ln}: dt {dt:.3f} for {name}")
            if r["link"] == "1" and lk == "0":
                r["events"] += 1
            prim = "symbol_err" if r["kind"] == "ib" else "fec_corr_bits"
            for h, i in cc:
                beh, bits = r["w"][h]
                v = f[i]
                if v == "" or v == "N/A":
                    if h == prim and v == "" and r["kind"] == "eth":
                        prim = "crc_err"
                    r["prev"][h] = None
                    continue
                if r["kind"] == "ib" and h in ETH_ONLY:
                    bad(f"line {ln}: {h} on an IB rail")
                if r["kind"] == "eth" and h in IB_ONLY:
                    bad(f"line {ln}: {h} on an Ethernet rail")
                if not v.isdigit():
                    bad(f"line {ln}: {h}={v}")
                    continue
                x = int(v)
                top = 2 ** bits - 1
                if x > top:
                    bad(f"line {ln}: {h}={x} above its width {beh}{bits}")
                if x > r["max"].get(h, -1):
                    r["max"][h] = x
                if beh == "sat" and x == top:
                    r["sat_seen"].add(h)
                if r["kind"] == "ib" and h in ("tx_bytes", "rx_bytes") and x % 4:
                    bad(f"line {ln}: IB {h} not a multiple of 4")
                p = r["prev"].get(h)
                delta = None
                if p is not None:
                    if x < p:
                        if beh == "wrap" and p - x > 2 ** (bits - 1):
                            r["wraps"] += 1
                            r["wrapc"].add(h)
                            delta = x + 2 ** bits - p
                        else:
                            r["decreases"] += 1
                            delta = x
                    elif beh == "sat" and p == top:
                        delta = 0
                    else:
                        delta = x - p
                if h == prim and delta is not None and lk == "1" and r["link"] == "1":
                    if not (beh == "sat" and p == top):
                        r["prim"] += delta
                        r["prim_s"] += dt
                r["prev"][h] = x
            if lk == "1" and r["link"] == "1":
                r["up_s"] += dt
            r["t"], r["link"] = t, lk
            r["rows"] += 1
    # per-rail rules
    healthy_names = {s[0] for s in SCENARIOS if s[2]}
    known = {s[0] for s in SCENARIOS}
    agg = {}
    for name, r in rails.items():
        sc = r["scenario"]
        if sc not in known:
            bad(f"rail {name}: unknown scenario {sc}")
        hours = (r["t"] - r["t0"]) / 3600.0
        if not (0.95 <= hours <= 2.05):
            bad(f"rail {name}: {hours:.2f} h")
        if sc in healthy_names and r["events"]:
            bad(f"healthy rail {name} ({sc}) has {r['events']} link downs")
        if sc not in healthy_names and not r["events"]:
            bad(f"failure rail {name} ({sc}) never fails")
        if r["decreases"] and sc != "healthy-reset":
            bad(f"rail {name} ({sc}): {r['decreases']} counter decreases that are not wraps")
        if sc == "healthy-reset" and not r["decreases"]:
            bad(f"rail {name}: healthy-reset without a reset")
        if sc in ("healthy-saturated", "creep-ib-sat") and "symbol_err" not in r["sat_seen"]:
            bad(f"rail {name} ({sc}): symbol_err never 65535")
        a = agg.setdefault((sc, r["kind"]), {"rails": 0, "hours": 0.0, "events": 0, "wraps": 0,
                                             "resets": 0})
        a["rails"] += 1
        a["hours"] += hours
        a["events"] += r["events"]
        a["wraps"] += r["wraps"]
        a["resets"] += r["decreases"]
    hh = sum(a["hours"] for (sc, _), a in agg.items() if sc in healthy_names)
    ev_pre = sum(a["events"] for (sc, _), a in agg.items()
                 if sc not in healthy_names and not sc.startswith("sudden"))
    rails_pre = sum(a["rails"] for (sc, _), a in agg.items()
                    if sc not in healthy_names and not sc.startswith("sudden"))
    ev_sud = sum(a["events"] for (sc, _), a in agg.items() if sc.startswith("sudden"))
    fmt = lambda w: " ".join(f"{k}={b}{n}" for k, (b, n) in w.items())
    print(f"check {path}: {nrows} rows, {len(rails)} rails")
    print(f"widths (file-wide): {fmt(widths)}")
    for prefix, decl in scoped:
        print(f"widths for {prefix}: {fmt(decl)}")
    print(f"healthy rail-hours {hh:.1f}; failure events with precursor {ev_pre} on {rails_pre} "
          f"rails; sudden events {ev_sud}")
    print("\n| scenario | kind | rails | rail-hours | link downs | wraps seen | reset rows |\n|---|---|---|---|---|---|---|")
    for name, *_ in SCENARIOS:
        for kind in ("ib", "eth"):
            if (name, kind) in agg:
                a = agg[(name, kind)]
                print(f"| {name} | {kind} | {a['rails']} | {a['hours']:.1f} | {a['events']} | "
                      f"{a['wraps']} | {a['resets']} |")
    # wraps per counter, and Ethernet readings beyond what the IB widths could hold
    print("\n| kind | counter | width | rails that wrap | rails above the IB width |\n|---|---|---|---|---|")
    for kind in ("ib", "eth"):
        for h in COUNTERS:
            rs = [r for r in rails.values() if r["kind"] == kind and h in r["max"]]
            if not rs:
                continue
            beh, bits = rs[0]["w"][h]
            wr = sum(1 for r in rs if h in r["wrapc"])
            ib_beh, ib_bits = width_of(h, "ib")
            above = sum(1 for r in rs if r["max"][h] > 2 ** ib_bits - 1) if ib_bits < 64 else 0
            print(f"| {kind} | {h} | {beh}{bits} | {wr} | {above if kind == 'eth' else '-'} |")
    # empirical primary-counter rate of healthy rails, per decade
    tab = {}
    for name, r in rails.items():
        if r["scenario"] in healthy_names and r["prim_s"] > 0:
            rate = r["prim"] / r["prim_s"]
            key = (r["kind"], decade_label(rate) if rate > 0 else "0")
            tab[key] = tab.get(key, 0.0) + (r["t"] - r["t0"]) / 3600.0
    print("\nhealthy rail-hours by measured primary error rate (IB symbol_err, Eth fec_corr_bits"
          " or crc_err; deltas per the documented rules):\n")
    print("| kind | rate /s | rail-hours |\n|---|---|---|")
    for key in sorted(tab, key=lambda k: (k[0], -1e9 if k[1] == "0" else float(k[1].split("..")[0]))):
        print(f"| {key[0]} | {key[1]} | {tab[key]:.1f} |")
    if expect_scale is not None and expect_scale >= 1.0:
        if hh < 600:
            bad(f"healthy rail-hours {hh:.1f} < 600")
        if rails_pre < 120:
            bad(f"failure rails with a precursor {rails_pre} < 120")
    if problems:
        print("\nPROBLEMS:")
        for p in problems:
            print("  " + p)
        return False
    print("\ncheck: OK")
    return True


# --------------------------------------------------------------------------------------------

def describe(scale):
    print("## Scenarios (rails at scale %g)\n" % scale)
    print("| scenario | IB rails | Ethernet rails | healthy | models |\n|---|---|---|---|---|")
    for name, counts, healthy, desc in SCENARIOS:
        c = {k: max(1, int(round(v * scale))) for k, v in counts.items()}
        print(f"| {name} | {c.get('ib', 0)} | {c.get('eth', 0)} | {'yes' if healthy else 'no'} | {desc} |")
    print("\n## Parameter ranges\n")
    print("| parameter | distribution | range | meaning |\n|---|---|---|---|")
    for name, dist, a, meaning in PARAMS:
        if dist in ("u", "logu", "int"):
            rng = f"{a[0]:g} .. {a[1]:g}"
        elif dist == "p":
            rng = f"{a:g}"
        elif dist == "zlogu":
            rng = f"0 (p={a[0]:g}) or {a[1]:g} .. {a[2]:g}"
        elif dist == "choice":
            rng = ", ".join(f"{v} ({w:g})" for v, w in zip(*a))
        elif dist == "bins":
            rng = " / ".join(a)
            dist = "stratified"
        print(f"| {name} | {dist} | {rng} | {meaning} |")
    print("\nAccepted creep draws: precursor and doubling time are drawn independently and kept "
          "when log2(failure level / onset level) = precursor / doubling lies in the log2_ratio "
          "range and the failure level in its range (up to 400 draws).")
    print("\nWidths lines: `" + WIDTHS_LINE + "` (IB rails; fec_* and crc_err undeclared = "
          "wrap64) and `" + ETH_WIDTHS_LINE + f"` (rails whose names start with {ETH_PREFIX}).")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"default {DEFAULT_SEED}")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output CSV (default {DEFAULT_OUT})")
    ap.add_argument("--scale", type=float, default=1.0, help="scenario counts x F (0.05: smoke file)")
    ap.add_argument("--describe", action="store_true", help="print the parameter ranges and exit")
    ap.add_argument("--self-check", action="store_true", help="re-read and verify the written file")
    ap.add_argument("--check", metavar="CSV", help="verify an existing file and exit")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.describe:
        describe(a.scale)
        return 0
    if a.check:
        return 0 if check(a.check) else 1
    generate(a.out, a.seed, a.scale, a.quiet)
    if a.self_check:
        print()
        return 0 if check(a.out, a.scale) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
