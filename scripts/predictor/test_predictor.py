#!/usr/bin/python3
"""Unit tests of the predictor's Python side (run: /usr/bin/python3 -m unittest discover -s
scripts/predictor -p 'test_*.py'). Torch-dependent tests skip without torch."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import struct
import subprocess
import tempfile
import unittest
import zlib

import numpy as np

import baseline
import features
import gen_traces
import issue_scenarios
import lstm_ref
import metrics
import tracefile
import weights
import windows
from tracefile import Width

HEADER = ",".join(tracefile.BASE_HEADER)  # the optional Ethernet / RoCE columns left out
W32, W64, S16, S4 = Width(32, False), Width(64, False), Width(16, True), Width(4, True)


def deltas(prev, cur, w, prev_ok=True, cur_ok=True):
    u = lambda v: np.array([v], dtype=np.uint64)
    b = lambda v: np.array([v])
    return int(features.counter_deltas(u(prev), b(prev_ok), u(cur), b(cur_ok), w)[0])


def row(t, rail="r0", link=1, speed=100000, retrans=0, tx_packets=0, rx_packets=0, tx_bytes=0,
        rx_bytes=0, symbol_err=0, rcv_err=0, link_recovery=0, link_downed=0, integrity=0,
        buf_overrun=0, scenario="s"):
    vals = [t, rail, link, speed, retrans, tx_packets, rx_packets, tx_bytes, rx_bytes,
            symbol_err, rcv_err, link_recovery, link_downed, integrity, buf_overrun, scenario]
    return ",".join(str(v) for v in vals)


class TempTrace:
    """Writes a trace to a temporary file; ``with TempTrace(lines) as path``."""

    def __init__(self, lines, widths="# widths: retrans=wrap32 symbol_err=sat16 integrity=sat4"):
        self.text = "\n".join(([widths] if widths else []) + [HEADER] + list(lines)) + "\n"

    def __enter__(self):
        fd, self.path = tempfile.mkstemp(suffix=".csv")
        with os.fdopen(fd, "w") as f:
            f.write(self.text)
        return self.path

    def __exit__(self, *exc):
        os.unlink(self.path)


class DeltaRules(unittest.TestCase):
    def test_normal_and_wrap(self):
        self.assertEqual(deltas(10, 15, W32), 5)
        self.assertEqual(deltas((1 << 32) - 3, 4, W32), 7)  # wrapped
        self.assertEqual(deltas((1 << 64) - 1, 0, W64), 1)

    def test_reset_when_drop_is_under_half_the_range(self):
        self.assertEqual(deltas(1000, 7, W32), 7)
        self.assertEqual(deltas(1 << 40, 3, W64), 3)

    def test_wrap_needs_previous_value_within_width(self):
        self.assertEqual(deltas(1 << 33, 5, W32), 5)  # prev > 2^32 - 1: a reset, not a wrap

    def test_saturating(self):
        self.assertEqual(deltas(65000, 65535, S16), 535)
        self.assertEqual(deltas(65535, 65535, S16), 0)  # stuck at max: reads 0
        self.assertEqual(deltas(15, 2, S4), 2)  # any decrease of a sat counter is a reset

    def test_a_rail_reset_is_not_a_wrap(self):
        # retrans (wrap32) 6 below 2^32 and tx_packets reset together: the count since the
        # reset (3), not a wrap (9), as counters.h's settle_resets. Alone, a wrap stays a wrap.
        lines = [row(0, retrans=(1 << 32) - 6, tx_packets=5000000),
                 row(5, retrans=3, tx_packets=100),
                 row(10, retrans=(1 << 32) - 1, tx_packets=200),
                 row(15, retrans=4, tx_packets=300)]
        with TempTrace(lines) as path:
            tr = tracefile.read_trace(path)
        d, _, rs = features.trace_deltas(tr, features.previous_row_index(tr.rail))
        self.assertEqual(list(d[[1, 3], features._C["retrans"]]), [3, 5])
        self.assertEqual(list(d[[1, 3], features._C["tx_packets"]]), [100, 100])
        # The reset row marks both as counts since a reset (counters.h Step::reset); the wrap
        # and the ordinary steps are not.
        self.assertEqual(list(rs[:, features._C["retrans"]]), [False, True, False, False])
        self.assertEqual(list(rs[:, features._C["tx_packets"]]), [False, True, False, False])

    def test_missing(self):
        self.assertEqual(deltas(5, 9, W32, prev_ok=False), 0)
        self.assertEqual(deltas(5, 9, W32, cur_ok=False), 0)


class TraceParsing(unittest.TestCase):
    def assertTraceError(self, lines, *fragments, widths=None):
        kw = {} if widths is None else {"widths": widths}
        with TempTrace(lines, **kw) as p:
            with self.assertRaises(tracefile.TraceError) as cm:
                tracefile.read_trace(p)
        for frag in fragments:
            self.assertIn(frag, str(cm.exception))

    def test_errors_name_line_and_column(self):
        self.assertTraceError([row(0), row(5, link=2)], "line 4", "column link", "1 up, 0 down")
        self.assertTraceError([row(0, retrans="x1")], "line 3", "column retrans",
                              "unsigned integer")
        self.assertTraceError([row(0, retrans=-1)], "column retrans")
        self.assertTraceError([row(0, retrans=1 << 64)], "column retrans")
        self.assertTraceError([row(5), row(5)], "line 4", "does not increase")
        self.assertTraceError([row(0, speed="fast")], "column speed_mbps")
        self.assertTraceError([row(0) + ",extra"], "17 fields")
        self.assertTraceError([row(0)], "bad width", widths="# widths: retrans=sat99")
        self.assertTraceError([row(0)], "bad width", widths="# widths: bogus=wrap32")
        self.assertTraceError([row(0)], "declared twice in one widths line",
                              widths="# widths: symbol_err=sat16 symbol_err=wrap32")

    def test_unknown_column(self):
        with TempTrace([], widths="") as p:
            with open(p, "w") as f:
                f.write("t_s,rail,colour\n")
            with self.assertRaises(tracefile.TraceError) as cm:
                tracefile.read_trace(p)
            self.assertIn("unknown column 'colour'", str(cm.exception))

    def test_missing_tokens_and_widths(self):
        with TempTrace([row(0, retrans=""), row(5, retrans="N/A"), row(10, retrans=" 7 ")]) as p:
            tr = tracefile.read_trace(p)
        c = tracefile.COUNTERS.index("retrans")
        self.assertEqual(tr.present[:, c].tolist(), [False, False, True])
        self.assertEqual(int(tr.values[2, c]), 7)
        self.assertEqual(tr.widths[c], W32)
        self.assertEqual(tr.widths[tracefile.COUNTERS.index("tx_bytes")], W64)


    def test_widths_for_a_rail_prefix(self):
        # IB ports and Ethernet interfaces in one file: rcv_err is a 16-bit saturating IB
        # counter but Linux's 64-bit rx_errors on Ethernet.
        text = ("# widths: rcv_err=sat16\n# widths for eth: rcv_err=wrap64\n"
                "t_s,rail,rcv_err,crc_err\n"
                "0,ib0,65500,\n0,eth0,65500,3\n5,ib0,65534,\n5,eth0,65534,9\n"
                "10,ib0,65535,\n10,eth0,70000,9\n")
        fd, p = tempfile.mkstemp(suffix=".csv")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            tr = tracefile.read_trace(p)
            fs = features.compute_features(tr)
        finally:
            os.unlink(p)
        c = tracefile.COUNTERS.index("rcv_err")
        self.assertEqual(tr.rail_widths[0][c], tracefile.Width(16, True))
        self.assertEqual(tr.rail_widths[1][c], W64)
        # ib0's rcv_err reached 65535 (sat16): unusable, its only error counter, so the row has
        # none (err_unknown 1); eth0's went on past it (wrap64): usable.
        self.assertEqual(float(fs.x[2, 8]), 1.0)
        self.assertEqual(float(fs.x[3, 8]), 0.0)
        for bad, needle in (("# widths for : rcv_err=wrap64\n", "bad widths line"),
                            ("t_s,rail\n# widths: rcv_err=wrap64\n", "after the header")):
            fd, p = tempfile.mkstemp(suffix=".csv")
            with os.fdopen(fd, "w") as f:
                f.write(bad + ("t_s,rail\n" if not bad.startswith("t_s") else ""))
            try:
                with self.assertRaises(tracefile.TraceError) as cm:
                    tracefile.read_trace(p)
                self.assertIn(needle, str(cm.exception))
            finally:
                os.unlink(p)


class Features(unittest.TestCase):
    def compute(self, lines):
        with TempTrace(lines) as p:
            return features.compute_features(tracefile.read_trace(p))

    def test_values_of_one_step(self):
        fs = self.compute([
            row(0, retrans=(1 << 32) - 5, tx_packets=100, tx_bytes=0, symbol_err=65530),
            row(5, retrans=5, tx_packets=300, tx_bytes=125_000_000 * 5 // 2, rx_bytes=10,
                symbol_err=65535, rcv_err=5, link_recovery=1, link_downed=1, integrity=3,
                buf_overrun=10),
        ])
        self.assertEqual(len(fs), 1)  # the first row only primes
        x = fs.x[0]
        g = 1 - math.exp(-5 / 30)
        # A counter's first usable step is its own floor: no excess, slope or acceleration.
        self.assertEqual((x[0], x[1], x[3], x[4], x[7]), (0, 0, 0, 0, 0))
        self.assertAlmostEqual(x[2], g * math.log1p(5 / 5), places=6)   # link events
        self.assertAlmostEqual(x[5], 312.5e6 * 8 / 5 / 100000e6, places=6)  # 0.005
        self.assertAlmostEqual(x[6], g * math.log1p(10 / 5), places=6)  # buf_overrun
        # symbol_err reached 65535 (sat16): unusable, but never seen before, so not "unknown".
        self.assertEqual(x[8], 0.0)
        self.assertAlmostEqual(x[9], 5 / 300, places=6)
        self.assertEqual(fs.x.dtype, np.float32)

    def test_a_steady_floor_reads_zero_whatever_its_level(self):
        for per_s in (0, 0.4, 12, 900):
            fs = self.compute([row(5 * i, rcv_err=int(per_s * 5 * i)) for i in range(80)])
            np.testing.assert_array_equal(fs.x[:, [0, 1, 4]], 0, err_msg=f"{per_s}/s")
            self.assertEqual(fs.x[-1, 9], 1.0)  # warm after 300 s

    def test_a_rising_rate_shows_in_excess_slope_and_accel(self):
        lines, total = [], 0.0
        for i in range(120):
            rate = 2.0 if i < 60 else 2.0 * 2 ** ((i - 60) * 5 / 60)  # doubles every minute
            total += rate * 5
            lines.append(row(5 * i, rcv_err=int(total)))
        fs = self.compute(lines)
        self.assertLess(abs(float(fs.x[55, 0])), 0.05)
        self.assertGreater(float(fs.x[-1, 0]), 2.0)        # far above the floor
        self.assertGreater(float(fs.x[-1, 1]), 0.4)        # ~ln 2 per minute
        self.assertLess(float(fs.x[-1, 1]), 0.8)
        self.assertGreater(float(fs.x[70, 4]), 0.0)        # accelerating at the onset

    def test_saturated_counter_is_unknown_not_quiet(self):
        fs = self.compute([row(0, symbol_err=65000), row(5, symbol_err=65100),
                           row(10, symbol_err=65535), row(15, symbol_err=65535)])
        np.testing.assert_array_equal(fs.x[:, 8], [0, 0, 0])  # rcv_err still readable
        fs = self.compute([row(0, symbol_err=65000, rcv_err="N/A"),
                           row(5, symbol_err=65100, rcv_err="N/A"),
                           row(10, symbol_err=65535, rcv_err="N/A")])
        np.testing.assert_array_equal(fs.x[:, 8], [0, 1])  # all it had is unknown now

    def test_a_count_since_a_reset_is_not_a_rate(self):
        # symbol_err (sat16) saturated from the start, then the port's counters reset: the
        # first count (30) is over part of the step. The counter's floor starts at the next
        # step's 30/s, so a steady 30/s stands at 0 (as the C++ test of the same name).
        lines = [row(5 * i, symbol_err=65535, rcv_err=100) for i in range(60)]
        total = 30
        lines.append(row(300, symbol_err=total, rcv_err=0))
        for i in range(1, 120):
            total += 150
            lines.append(row(300 + 5 * i, symbol_err=total, rcv_err=0))
        fs = self.compute(lines)
        self.assertLess(float(fs.x[59:, 0].max()), 0.01)
        # A counter with a history, reset while rising: that row stands where the previous
        # row stood (excess and slope).
        lines, total = [], 0.0
        for i in range(108):
            rate = 2.0 if i < 60 else 2.0 * 2 ** ((i - 60) * 5 / 60)
            total += rate * 5
            lines.append(row(5 * i, rcv_err=int(total)))
        lines.append(row(540, rcv_err=1))
        fs = self.compute(lines)
        self.assertGreater(float(fs.x[-2, 0]), 1.0)
        self.assertEqual(float(fs.x[-1, 0]), float(fs.x[-2, 0]))
        self.assertEqual(float(fs.x[-1, 1]), float(fs.x[-2, 1]))

    def test_link_down_rows_events_labels_and_state(self):
        fs = self.compute([
            row(0, symbol_err=0), row(5, symbol_err=5), row(10, symbol_err=20),
            row(15, link=0, symbol_err=20), row(20, link=0, symbol_err=20),
            row(25, symbol_err=70), row(30, symbol_err=70),
            row(0.5, rail="r1", link=0), row(5.5, rail="r1"),
        ])
        r0 = fs.rail == 0
        np.testing.assert_allclose(fs.t[r0], [5, 10, 25, 30])
        # One event (r0 at t=15); r1 starting down is no event.
        np.testing.assert_allclose(fs.event_t, [15])
        np.testing.assert_array_equal(fs.event_rail, [0])
        np.testing.assert_array_equal(fs.label[r0], [1, 1, 0, 0])  # t < 15 <= t + 30
        # The link-down steps change no state: the step after them continues the history
        # (its delta is against the row before it, t=20: 50 errors in 5 s).
        g = lambda dt, tau: 1 - math.exp(-dt / tau)
        x1, x2, x3 = math.log1p(5 / 5), math.log1p(15 / 5), math.log1p(50 / 5)
        fast = floor = x1
        # the median of the last three log rates (of the first two, the lower)
        for x in (min(x1, x2), sorted((x1, x2, x3))[1]):
            fast += g(5, 30) * (x - fast)
            floor += g(5, 1800 if fast > floor else 120) * (fast - floor)
        self.assertAlmostEqual(float(fs.x[np.flatnonzero(r0)[2], 0]), fast - floor, places=5)

    def test_recent_downs_counts_downs_once_and_fades(self):
        d = math.exp(-5 / features.DOWNS_TAU_S)
        fs = self.compute([
            row(0), row(5),
            # down for two steps, link_downed ticking once: one down
            row(10, link=0, link_downed=1), row(15, link=0, link_downed=1), row(20, link_downed=1),
            # a tick seen only on the way back up is that down's; a second one is another
            row(25, link=0, link_downed=1), row(30, link_downed=3),
            # down and up between two samples: link_downed alone
            row(35, link_downed=4),
            row(0, rail="r1", link=0), row(5, rail="r1", link=0), row(10, rail="r1"),
        ])
        r0 = fs.x[fs.rail == 0, 10]
        downs = [0.0]
        downs.append(1 * d * d)                       # t=20
        downs.append((downs[-1] * d + 1) * d + 1)     # t=30
        downs.append(downs[-1] * d + 1)               # t=35
        np.testing.assert_allclose(r0, np.log1p(downs), rtol=1e-6)
        # a rail down from its first rows shows no down
        np.testing.assert_array_equal(fs.x[fs.rail == 1, 10], [0])

    def test_missing_reading_reprimes(self):
        # retrans: 0, N/A, 100 (re-primes: unusable), 110 (usable: its first step).
        fs = self.compute([row(0, retrans=0), row(5, retrans="N/A"), row(10, retrans=100),
                           row(15, retrans=110), row(20, retrans=300), row(25, retrans=490)])
        self.assertEqual(float(fs.x[2, 3]), 0.0)  # the first usable step is the floor
        self.assertEqual(float(fs.x[3, 3]), 0.0)  # one step at 38/s: the median filters it
        self.assertGreater(float(fs.x[4, 3]), 0.0)  # two in a row: above the floor

    def test_npz_round_trip(self):
        fs = self.compute([row(0), row(5, retrans=3), row(10, link=0)])
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "f.npz")
            fs.save_npz(p)
            with np.load(p) as z:
                self.assertEqual(set(z.files), {"x", "rail", "t", "label", "scenario",
                                                "scenarios", "event_t", "event_rail"})
                self.assertEqual(z["x"].dtype, np.float32)
                self.assertEqual(z["rail"].dtype, np.int32)
                self.assertEqual(z["label"].dtype, np.int8)
            back = features.load_feature_file(p)
            np.testing.assert_array_equal(back.x, fs.x)


class Windows(unittest.TestCase):
    def test_padding_and_rail_order(self):
        rail = np.array([0, 1, 0, 0, 1])
        idx = windows.window_index(rail, 3)
        np.testing.assert_array_equal(idx, [[-1, -1, 0], [-1, -1, 1], [-1, 0, 2], [0, 2, 3],
                                            [-1, 1, 4]])
        xn = np.arange(10, dtype=np.float32).reshape(5, 2) + 1
        g = windows.gather(xn, idx[2:3])
        np.testing.assert_array_equal(g[0], [[0, 0], [1, 2], [5, 6]])

    def test_normaliser_floors_std(self):
        n = windows.Normaliser.fit(np.array([[1, 2], [1, 4]], dtype=np.float32))
        np.testing.assert_allclose(n.std, [windows.STD_FLOOR, 1.0])


class Baseline(unittest.TestCase):
    def test_smoothing_and_risk(self):
        x = np.zeros((4, 8), dtype=np.float32)
        x[:, 2] = [1, 3, 5, 7]
        rail = np.zeros(4, dtype=np.int32)
        sm = baseline.smoothed(x, rail, 2)
        np.testing.assert_allclose(sm[:, 2], [1, 2, 4, 6])
        p = baseline.BaselineParams(np.array([np.inf, np.inf, 4.0, np.inf], np.float32), 2)
        r = baseline.risk(x, rail, p)
        np.testing.assert_allclose(r, [0.175, 0.35, 0.7, 1.0], rtol=1e-6)

    def test_err_excess_judged_where_it_stands(self):
        # err_excess (feature 0) on two interleaved rails: a burst falling back and a rise.
        burst, rise = [0, 0, 5, 5, 3, 1], [1, 2, 2.5, 3, 3, 3]
        x = np.zeros((12, features.N_FEATURES), dtype=np.float32)
        x[0::2, 0], x[1::2, 0] = burst, rise
        x[0::2, 2] = [6, 0, 0, 0, 0, 0]  # link events: the mean, whatever the last row is
        rail = np.tile(np.array([0, 1], np.int32), 6)
        lv = baseline.levels(x, rail, 6)
        sm = baseline.smoothed(x, rail, 6)
        self.assertAlmostEqual(float(sm[10, 0]), 14 / 6, places=5)  # the burst's mean ...
        self.assertEqual(float(lv[10, 0]), 1.0)                     # ... capped at its last row
        self.assertAlmostEqual(float(lv[11, 0]), 14.5 / 6, places=5)  # rising: the mean
        np.testing.assert_array_equal(lv[:, 1:], sm[:, 1:])
        self.assertEqual(float(lv[10, 2]), 1.0)
        p = baseline.BaselineParams(np.array([2.0, np.inf, np.inf, np.inf], np.float32), 6)
        r = baseline.risk(x, rail, p)
        self.assertAlmostEqual(float(r[10]), 0.35, places=6)
        self.assertAlmostEqual(float(r[11]), 0.7 * (14.5 / 6) / 2, places=6)

    def test_err_slope_judged_where_it_stands_while_falling(self):
        # Two interleaved rails with the same err_slope (feature 1): a rise, then level.
        # On rail 0 err_excess falls back at the end (below its mean); on rail 1 it keeps
        # rising (above its mean).
        slope = [0, 4, 4, 1, 0, 0]
        x = np.zeros((12, features.N_FEATURES), dtype=np.float32)
        x[0::2, 0], x[1::2, 0] = [0, 2, 4, 4, 3, 1], [0, 1, 2, 3, 4, 5]
        x[0::2, 1], x[1::2, 1] = slope, slope
        rail = np.tile(np.array([0, 1], np.int32), 6)
        lv = baseline.levels(x, rail, 6)
        sm = baseline.smoothed(x, rail, 6)
        self.assertAlmostEqual(float(sm[10, 1]), 1.5, places=6)  # the slope's mean, rail 0 ...
        self.assertEqual(float(lv[10, 1]), 0.0)                  # ... falling: where it stands
        self.assertAlmostEqual(float(lv[11, 1]), 1.5, places=6)  # rail 1, rising: the mean
        # Rail 0 at row 6 (its 4th row, err_excess 4 over a mean of 2.5): not falling.
        self.assertAlmostEqual(float(lv[6, 1]), float(sm[6, 1]), places=6)
        p = baseline.BaselineParams(np.array([np.inf, 1.0, np.inf, np.inf], np.float32), 6)
        r = baseline.risk(x, rail, p)
        self.assertEqual(float(r[10]), 0.0)
        self.assertEqual(float(r[11]), 1.0)

    def test_fall_rule(self):
        # Two rails interleaved: a burst's tail (4 -> 3.1 -> 3, a fall of 1.0 over 4 rows) and
        # a slow fall to the same level (0.15 a row: 0.6 over 4 rows).
        tail = [0, 0, 4, 4, 4, 4, 3.1, 3]
        slow = [3.9, 3.75, 3.6, 3.45, 3.3, 3.15, 3.0, 3.0]
        x = np.zeros((16, features.N_FEATURES), dtype=np.float32)
        x[0::2, 0], x[1::2, 0] = tail, slow
        x[:, 1] = 2.0  # err_slope
        rail = np.tile(np.array([0, 1], np.int32), 8)
        fell = baseline.fall_fires(x, rail)
        self.assertEqual(np.flatnonzero(fell).tolist(), [12, 14])  # the tail's rows 6 and 7
        lv = baseline.levels(x, rail, 8)
        np.testing.assert_array_equal(lv[[12, 14], :2], np.zeros((2, 2), np.float32))
        self.assertAlmostEqual(float(lv[15, 0]), 3.0, places=6)  # the slow one: where it is
        self.assertAlmostEqual(float(lv[15, 1]), 2.0, places=6)
        # Without the rule the tail's last row would count min(mean 26.1 / 8, 3) = 3.
        p = baseline.BaselineParams(np.array([1.0, 1.0, np.inf, np.inf], np.float32), 8)
        r = baseline.risk(x, rail, p)
        self.assertEqual((float(r[14]), float(r[15])), (0.0, 1.0))
        # A rail's first FALL_LAG rows never fire: the same fall 3 rows into a rail does not.
        short = np.zeros((4, features.N_FEATURES), np.float32)
        short[:, 0] = [4, 4, 3.1, 3]
        self.assertFalse(baseline.fall_fires(short, np.zeros(4, np.int32)).any())

    def test_rise_rule(self):
        # Two rails interleaved row by row: the rule looks at each rail's own rows.
        creep = [0.125 * i for i in range(13)]              # rises 0.5 and 0.5 at row 12
        step = [0, 0, 0, 0, .25, .5, .75, 1, 1, 1.075, 1.15, 1.225, 1.3]  # rises 0.75, 0.3
        x = np.zeros((26, features.N_FEATURES), dtype=np.float32)
        x[0::2, 0], x[1::2, 0] = creep, step
        rail = np.tile(np.array([0, 1], np.int32), 13)
        rule = np.array([4, 0.3, 1.0, 1.2], np.float32)  # lag, least, ratio, level
        fires = baseline.rise_fires(x, rail, rule)
        # The creep fires from the row its level reaches 1.2 (row 10: 1.25) and 2 x 4 rows
        # are there; the step (shrinking rises) never does.
        self.assertEqual(np.flatnonzero(fires).tolist(), [20, 22, 24])
        p = baseline.BaselineParams(np.array([np.inf] * 4, np.float32), 2, rule)
        r = baseline.risk(x, rail, p)
        np.testing.assert_array_equal(r, np.where(fires, 1, 0).astype(np.float32))
        # A burst: the raw rate at 4 for 6 rows, then quiet; err_excess is its 30 s average
        # (gain 1 - e^(-5/30) a row). Its window straddles the burst's start for 2 rows, fewer
        # than R2CCL_PREDICT_ENTER_SAMPLES (3): no drain.
        g, f, burst = 1 - math.exp(-5 / 30), 0.0, [0.0] * 4
        for k in range(30):
            f += g * ((4.0 if k < 6 else 0.0) - f)
            burst.append(f)
        xb = np.zeros((len(burst), features.N_FEATURES), np.float32)
        xb[:, 0] = burst
        fired = baseline.rise_fires(xb, np.zeros(len(burst), np.int32), rule)
        self.assertEqual(np.flatnonzero(fired).tolist(), [8, 9])
        self.assertFalse(baseline.rise_fires(x, rail, np.zeros(4, np.float32)).any())
        self.assertFalse(baseline.rise_fires(x, rail, np.zeros(4, np.float32)).any())
        self.assertEqual(p.rise_dict(), {"lag": 4, "least": 0.3, "ratio": 1.0, "level": 1.2})

    def test_tune_finds_a_separating_threshold(self):
        rng = np.random.default_rng(0)
        x = np.zeros((2000, 8), dtype=np.float32)
        y = np.zeros(2000, dtype=np.int8)
        y[::50] = 1
        x[:, 3] = np.where(y == 1, 2.0, rng.uniform(0, 1, 2000))
        x[:, 0] = rng.uniform(0, 5, 2000)  # noise: must stay unused
        p, f1 = baseline.tune(x, np.arange(2000) % 1, y, ks=(1, 2), log=lambda m: None)
        self.assertEqual(f1, 1.0)
        self.assertEqual(p.steps, 1)
        self.assertTrue(1.0 < p.thresholds[3] <= 2.0)


def tiny_weights(hidden=4, seed=0):
    rng = np.random.default_rng(seed)
    H, F = hidden, 8
    f = lambda *s: rng.normal(0, 0.5, s).astype(np.float32)
    return weights.LstmWeights(
        n_features=F, hidden=H, window=6, horizon_s=30, interval_s=5.0, mean=f(F),
        std=np.abs(f(F)) + 0.5, thresholds=np.array([1, np.inf, 2, 0.5], np.float32), steps=3,
        weight_ih=f(4 * H, F), weight_hh=f(4 * H, H), bias_ih=f(4 * H), bias_hh=f(4 * H),
        dense_w=f(H), dense_b=0.25, metadata={"seed": 1, "note": "test"})


class WeightsFile(unittest.TestCase):
    def test_round_trip_layout_and_crc(self):
        w = tiny_weights()
        data = weights.to_bytes(w)
        self.assertEqual(data[:8], b"R2PRDLST")
        self.assertEqual(struct.unpack_from("<6I", data, 8)[:5], (weights.VERSION, 8, 4, 6, 30))
        H, F = 4, 8
        n_floats = 1 + 2 * F + 5 + 4 + 4 * H * F + 4 * H * H + 8 * H + H + 1
        meta_len = struct.unpack_from("<I", data, 8 + 4 * 5 + 4 * (n_floats))[0]
        self.assertEqual(len(data), 8 + 20 + 4 * n_floats + 4 + meta_len + 4)
        back = weights.from_bytes(data)
        np.testing.assert_array_equal(back.weight_hh, w.weight_hh)
        self.assertTrue(np.isinf(back.thresholds[1]))
        self.assertEqual(back.steps, 3)
        np.testing.assert_array_equal(back.rise, w.rise)
        self.assertEqual(back.metadata["note"], "test")
        bad = bytearray(data)
        bad[100] ^= 1
        with self.assertRaisesRegex(weights.WeightsError, "checksum mismatch"):
            weights.from_bytes(bytes(bad), "x.bin")

    def test_rise_rule_checked_both_ways(self):
        w = tiny_weights()
        for bad, why in (([1.5, 0.3, 1, 1], "whole number"), ([-1, 0.3, 1, 1], "whole number"),
                         ([2000, 0.3, 1, 1], "whole number"), ([4, -0.1, 1, 1], "negative"),
                         ([4, 0.3, 1, np.nan], "NaN")):
            w.rise = np.array(bad, np.float32)
            with self.assertRaisesRegex(ValueError, why):
                weights.to_bytes(w)
        # A file written with a bad rule (as another writer might): the reader refuses it.
        w.rise = np.array([4, 0.3, 1, 1], np.float32)
        data = bytearray(weights.to_bytes(w))
        at = 8 + 20 + 4 * (1 + 2 * 8 + 4 + 1)  # rise[0], after k
        self.assertEqual(struct.unpack_from("<f", data, at)[0], 4.0)
        struct.pack_into("<f", data, at, 2.5)
        body = bytes(data[:-4])
        data = body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)
        with self.assertRaisesRegex(weights.WeightsError, "x.bin: the baseline's rise lag 2.5"):
            weights.from_bytes(data, "x.bin")

    def test_rejects_bad_shapes(self):
        w = tiny_weights()
        w.dense_w = w.dense_w[:2]
        with self.assertRaisesRegex(ValueError, "dense_w"):
            weights.to_bytes(w)


class NumpyVsTorch(unittest.TestCase):
    def test_reference_matches_torch(self):
        try:
            import torch
        except ImportError:
            self.skipTest("torch not installed")
        import torch_model
        w = tiny_weights(hidden=8, seed=3)
        x = np.random.default_rng(1).normal(0, 2, (64, 6, 8)).astype(np.float32)
        x[:5, :4] = 0  # padded windows
        m = torch_model.from_weights(torch, w)
        with torch.no_grad():
            ref = torch.sigmoid(m(torch.from_numpy(x))).numpy()
        np.testing.assert_allclose(lstm_ref.infer(w, x), ref, atol=2e-6)


class EventMetrics(unittest.TestCase):
    def test_warned_early_false_and_sudden(self):
        t = np.arange(0, 400, 5.0)
        n = t.size
        # rail 0 fails at 200 (alarm from 160: warned, lead 40), rail 1 alarms 300..310 with
        # no failure (false alarm), rail 2 "sudden" fails at 100 with no alarm.
        fs = features.FeatureSet(
            x=np.zeros((3 * n, 8), np.float32), rail=np.repeat([0, 1, 2], n).astype(np.int32),
            t=np.tile(t, 3), label=np.zeros(3 * n, np.int8),
            scenario=np.repeat([0, 0, 1], n).astype(np.int32), scenarios=["optical", "sudden"],
            event_t=np.array([200.0, 100.0]), event_rail=np.array([0, 2], np.int32))
        keep = ~(((fs.rail == 0) & (fs.t >= 200)) | ((fs.rail == 2) & (fs.t >= 100)))
        for k in ("x", "rail", "t", "label", "scenario"):
            setattr(fs, k, getattr(fs, k)[keep])
        risk = np.zeros(len(fs), np.float32)
        risk[(fs.rail == 0) & (fs.t >= 160)] = 0.9
        risk[(fs.rail == 1) & (fs.t >= 300) & (fs.t <= 310)] = 0.8
        m = metrics.event_metrics(fs, risk, 5.0)
        self.assertEqual((m["predictable_events"], m["warned"]), (1, 1))
        self.assertEqual(m["lead_median_s"], 40.0)
        self.assertEqual((m["sudden_events"], m["sudden_warned"]), (1, 0))
        self.assertEqual(m["false_alarms"], 1)
        self.assertEqual(m["false_alarms_by_scenario"], {"optical": 1})
        risk[(fs.rail == 0)] = 0.9  # on for 200 s before the failure: early, not warned
        m = metrics.event_metrics(fs, risk, 5.0)
        self.assertEqual((m["warned"], m["early"]), (0, 1))


class DrainOutcomes(unittest.TestCase):
    """metrics.drain_outcomes: the plugin's drain policy and guard (predictor.cc)."""

    @staticmethod
    def rails(n_rows, risks, events=()):
        """One rail per entry of ``risks`` (a function of t), a row every 5 s; ``events``:
        (rail, t) link-downs, the rail down for 10 s from t."""
        xs, rl, ts = [], [], []
        for r, f in enumerate(risks):
            for i in range(n_rows):
                t = 5.0 * (i + 1)
                if any(er == r and et <= t < et + 10 for er, et in events):
                    continue
                rl.append(r)
                ts.append(t)
        rail = np.array(rl, np.int32)
        t = np.array(ts)
        risk = np.array([risks[r](tt) for r, tt in zip(rl, ts)], np.float32)
        fs = features.FeatureSet(
            x=np.zeros((t.size, features.N_FEATURES), np.float32), rail=rail, t=t,
            label=np.zeros(t.size, np.int8), scenario=np.zeros(t.size, np.int32),
            scenarios=["s"], event_t=np.array([et for _, et in events], float),
            event_rail=np.array([er for er, _ in events], np.int32))
        return fs, risk

    def test_both_risk_is_the_baseline_raised_by_the_lstm_up_to_the_cap(self):
        lstm = np.array([1.0, 1.0, 0.2, 0.95], dtype=np.float32)
        base = np.array([0.0, 0.5, 0.7, 0.7], dtype=np.float32)
        np.testing.assert_allclose(metrics.both_risk(lstm, base, 1.6), [0.0, 0.8, 0.7, 0.95],
                                   rtol=1e-6)
        np.testing.assert_array_equal(metrics.both_risk(lstm, base, 1.0), base)
        self.assertEqual(metrics.both_risk(lstm, base, 1.6).dtype, np.float32)

    def test_the_cap_adds_warnings_not_false_drains(self):
        import tune_policy
        rows = [{"lstm_cap": c, "warned": w, "false_drains": f}
                for c, w, f in ((1.2, 10, 3), (1.4, 12, 3), (1.6, 14, 4), (2.0, 14, 3))]
        self.assertEqual(tune_policy.choose_cap(rows, 3)["lstm_cap"], 2.0)
        self.assertEqual(tune_policy.choose_cap(rows[:3], 3)["lstm_cap"], 1.4)
        # None keeps the baseline's count: the fewest false drains.
        self.assertEqual(tune_policy.choose_cap(rows[:3], 1)["lstm_cap"], 1.4)

    def test_enter_samples_and_the_hourly_limit(self):
        # Rail 0: high for 2 samples every 100 s (never 3 in a row); rail 1: high for 3 samples
        # every 300 s, low in between: 2 drains in its first hour, then the limit.
        fs, risk = self.rails(1440, [lambda t: 0.95 if t % 100 < 10 else 0.0,
                                     lambda t: 0.95 if t % 300 < 15 else 0.0])
        o = metrics.drain_outcomes(fs, risk, metrics.Policy(threshold=0.9, enter_samples=3))
        self.assertEqual(o["false_drains"], 2 + 2)  # 2 h: two per hour on rail 1
        self.assertAlmostEqual(o["healthy_s"], 2 * 7200.0)
        o = metrics.drain_outcomes(fs, risk, metrics.Policy(threshold=0.9, enter_samples=2))
        self.assertGreater(o["false_drains"], 4)
        # Without the limit (and with no least drain time, which would hold each drain
        # through the next three highs) every high run drains.
        o = metrics.drain_outcomes(fs, risk, metrics.Policy(threshold=0.9, enter_samples=3,
                                                            max_drains_per_hour=100,
                                                            min_drain_s=0))
        self.assertEqual(o["false_drains"], 7200 // 300 - 1)  # not at t=0: no row there

    def test_least_drain_time(self):
        # Rail 0: high 400-420 s (drained at 410), quiet, then down at 900 s: by the return rule
        # alone (6 low samples) it is back 440 s before the down; R2CCL_PREDICT_MIN_DRAIN (1200 s
        # by default) keeps it drained: warned 490 s ahead.
        fs, risk = self.rails(200, [lambda t: 0.95 if 400 <= t < 420 else 0.0],
                              events=[(0, 900.0)])
        o = metrics.drain_outcomes(fs, risk, metrics.Policy(min_drain_s=0))
        self.assertEqual((o["precursor"], o["warned"], o["late"]), (1, 0, 0))
        o = metrics.drain_outcomes(fs, risk, metrics.Policy())
        self.assertEqual(o["leads"], [900.0 - 410.0])
        o = metrics.drain_outcomes(fs, risk, metrics.Policy(min_drain_s=300))
        self.assertEqual(o["warned"], 0)  # back at 710 s (300 s on, 6 lows long counted)
        # Each drain holds 1200 s, so of high runs 300 s apart (the first row is at 5 s: the
        # first run drains at 310 s) one in five drains: a least drain time never adds drains.
        fs, risk = self.rails(1440, [lambda t: 0.95 if t % 300 < 15 else 0.0])
        st, starts, _ = metrics.rail_policy(fs.t, risk, np.zeros(0),
                                            metrics.Policy(max_drains_per_hour=100))
        self.assertEqual(starts, [310.0, 1810.0, 3310.0, 4810.0, 6310.0])
        self.assertTrue(st[(fs.t >= 310) & (fs.t < 1510)].all())
        self.assertFalse(st[(fs.t >= 1540) & (fs.t < 1810)].any())  # 6 lows after 1510

    def test_warned_lead_and_the_flap_hold(self):
        quiet = lambda t: 0.0
        # One failure warned 60 s ahead (drained at the third high sample).
        fs, risk = self.rails(200, [lambda t: 0.95 if 400 <= t < 800 else 0.0],
                              events=[(0, 475.0)])
        o = metrics.drain_outcomes(fs, risk, metrics.Policy())
        self.assertEqual((o["precursor"], o["warned"]), (1, 1))
        self.assertEqual(o["leads"], [475.0 - 410.0])
        # A link that goes down 3 times, 200 s apart, with a quiet risk. By default
        # (R2CCL_PREDICT_DOWN_HOLD_AFTER=1) it is held out (600 s) from the first down, so the
        # second and third are warned; holding from the second down, only the third is.
        ev = [(0, 1000.0), (0, 1200.0), (0, 1400.0)]
        fs, risk = self.rails(600, [quiet], events=ev)
        o = metrics.drain_outcomes(fs, risk, metrics.Policy())
        self.assertEqual((o["precursor"], o["warned"]), (3, 2))
        self.assertEqual(o["leads"], [1200.0 - 1010.0, 1400.0 - 1010.0])
        o = metrics.drain_outcomes(fs, risk, metrics.Policy(down_hold_after=2))
        self.assertEqual((o["precursor"], o["warned"]), (3, 1))
        self.assertEqual(o["leads"], [1400.0 - 1210.0])
        o = metrics.drain_outcomes(fs, risk, metrics.Policy(down_hold_s=0))
        self.assertEqual(o["warned"], 0)


class BaselineBudget(unittest.TestCase):
    """train.tune_baseline_budget: the baseline's training false-drain budget is the largest
    that keeps OUR held-out traces at or under the target."""

    @staticmethod
    def fs(n_healthy, bursts, failing):
        """Rails of 2 h, a row a minute, feature 0 (err_excess) only. ``bursts``: healthy rails
        with 3 rows at 5.0; ``failing``: rails at 6.0 for 30 min, then down."""
        xs, rl, ts, ev_t, ev_r = [], [], [], [], []
        for r in range(n_healthy + failing):
            fail = r >= n_healthy
            for i in range(120):
                t = 60.0 * (i + 1)
                x = np.zeros(features.N_FEATURES, np.float32)
                if fail and 1800 <= t < 3600:
                    x[0] = 6.0
                if not fail and r < bursts and 3000 <= t < 3180:
                    x[0] = 5.0
                if fail and 3600 <= t < 3720:
                    continue  # link down
                xs.append(x)
                rl.append(r)
                ts.append(t)
            if fail:
                ev_t.append(3600.0)
                ev_r.append(r)
        n = len(ts)
        return features.FeatureSet(
            x=np.array(xs), rail=np.array(rl, np.int32), t=np.array(ts),
            label=np.zeros(n, np.int8), scenario=np.zeros(n, np.int32), scenarios=["s"],
            event_t=np.array(ev_t), event_rail=np.array(ev_r, np.int32))

    def test_k_for_drains_tells_a_sustained_rise_from_a_burst(self):
        import train
        # Bursts of 3 rows at 9.0 on 3 of 90 healthy rails (2.8 per rail-week if drained); the
        # failing rail's rise holds 6.0 for 30 rows. At k = 1 any threshold that drains the
        # rise drains the bursts too; the mean of 12 rows keeps the bursts at 2.25.
        rows = self.fs(90, 0, 1)
        burst = (rows.rail < 3) & (rows.t >= 3000) & (rows.t < 3180)
        rows.x[burst, 0] = 9.0
        start = baseline.BaselineParams(np.array([3.0, np.inf, np.inf, np.inf], np.float32), 1)
        policy = metrics.Policy(threshold=0.9, enter_samples=3)
        lines = []
        chosen = train.choose_event_k(rows, start, policy, 1.0, ks=(1, 12), log=lines.append)
        self.assertEqual(chosen.steps, 12)
        self.assertEqual(len(lines), 2)
        bl, ev, _ = train.tune_baseline_budget(rows, chosen, policy, 1.0, [1.0],
                                               log=lambda *a: None)
        self.assertEqual((bl.steps, ev["warned"], ev["false_drains"]), (12, 1, 0))
        # Without the bursts both warn it with no false drain: a tie keeps the smaller k.
        rows.x[burst, 0] = 0.0
        self.assertEqual(train.choose_event_k(rows, start, policy, 1.0, ks=(1, 12),
                                              log=lambda *a: None).steps, 1)

    def test_rise_rule_chosen_on_held_out_traces(self):
        # Rows every 5 s for 2 h. The failing rail's err_excess climbs 0.1 a row over the last
        # 10 minutes before its link-down; two healthy rails climb 0.02 a row for 10 minutes
        # and stay (a wander); the thresholds (100) see none of it.
        def rails():
            xs, rl, ts = [], [], []
            for r in range(92):
                for i in range(1440):
                    t = 5.0 * (i + 1)
                    if r == 91 and 3600 <= t < 3720:
                        continue  # the failing rail's link is down
                    x = np.zeros(features.N_FEATURES, np.float32)
                    if r == 91 and 3000 <= t < 3600:
                        x[0] = 0.1 * (t - 3000) / 5
                    if r < 2 and t >= 3000:
                        x[0] = 0.02 * min(t - 3000, 600) / 5
                    xs.append(x)
                    rl.append(r)
                    ts.append(t)
            n = len(ts)
            return features.FeatureSet(
                x=np.array(xs), rail=np.array(rl, np.int32), t=np.array(ts),
                label=np.zeros(n, np.int8), scenario=np.zeros(n, np.int32), scenarios=["s"],
                event_t=np.array([3600.0]), event_rail=np.array([91], np.int32))
        ho = rails()
        start = baseline.BaselineParams(np.array([100, np.inf, np.inf, np.inf], np.float32), 1)
        policy = metrics.Policy(threshold=0.9, enter_samples=3)
        lines = []
        # The first rule of the grid that warns it without a false drain: lag 4, least 0.2
        # (0.05 a row: the wander's 4 x 0.02 = 0.08 stays under).
        bl, info = baseline.choose_rise(ho, start, policy, 1.0, log=lines.append)
        self.assertEqual(info["rise"], {"lag": 4, "least": 0.2, "ratio": 1.0, "level": 0.5})
        self.assertEqual((info["warned"], info["off_warned"]), (1, 0))
        self.assertEqual(info["false_per_rail_week"], 0.0)
        np.testing.assert_array_equal(bl.thresholds, start.thresholds)
        self.assertIn("rise rule", lines[0])
        # A rule that also drains both wanderers (1.86 per rail-week, over the target 1) is
        # refused: nothing is left but no rule.
        bl, info = baseline.choose_rise(ho, start, policy, 1.0, grid=[(8, 0.1, 1.0, 0.5)],
                                        log=lambda *a: None)
        self.assertEqual(info["rise"]["lag"], 0)
        self.assertEqual(info["warned"], 0)
        # Allowed as many false drains as that, it is taken.
        bl, info = baseline.choose_rise(ho, start, policy, 2.0, grid=[(8, 0.1, 1.0, 0.5)],
                                        log=lambda *a: None)
        self.assertEqual((info["rise"]["lag"], info["warned"]), (8, 1))

    def test_held_out_margins_raise_only_the_threshold_that_drains(self):
        import train
        # Two kinds of failure: rail 90's err_excess at 6.0, rail 91's retrans_excess (3) at 1.4
        # (1.4 >= 1.0 x 0.9 / 0.7 = 1.29). The held-out bursts (err_excess 5.0 on 3 healthy
        # rails, 2.8 per rail-week) are cleared by err_excess's threshold x1.35; the same
        # factor on retrans_excess' would stop warning rail 91 (1.4 < 1.35 x 1.29 = 1.74).
        def two_kinds(bursts):
            rows = self.fs(90, bursts, 2)
            rise = (rows.rail == 91) & (rows.x[:, 0] == 6.0)
            rows.x[rise, 0] = 0.0
            rows.x[rise, 3] = 1.4
            return rows
        tr, ho = two_kinds(1), two_kinds(3)
        start = baseline.BaselineParams(np.array([3.0, np.inf, np.inf, 1.0], np.float32), 1)
        policy = metrics.Policy(threshold=0.9, enter_samples=3)
        lines = []
        bl, ev, b = train.tune_baseline_budget(tr, start, policy, 1.0, [1.0], ho, "ho.csv",
                                               log=lines.append)
        self.assertEqual(b["margin"], [1.35, 1.0, 1.0, 1.0])
        self.assertTrue(b["heldout"]["met"])
        self.assertEqual((b["heldout"]["warned"], b["heldout"]["false_per_rail_week"]), (2, 0.0))
        self.assertAlmostEqual(float(bl.thresholds[0]), 3.0 * 1.35, places=5)
        self.assertEqual(float(bl.thresholds[3]), 1.0)
        self.assertEqual((ev["warned"], ev["false_drains"]), (2, 0))
        # Raised together (the rule before), both thresholds x1.35 warn one failure of two.
        both = baseline.BaselineParams(start.thresholds * np.float32(1.35), 1)
        o = metrics.drain_outcomes(ho, baseline.risk(ho.x, ho.rail, both), policy)
        self.assertEqual(o["warned"], 1)
        # Bursts in retrans_excess instead: its threshold is raised, err_excess's kept.
        ho2 = two_kinds(0)
        burst = (ho2.rail < 3) & (ho2.t >= 3000) & (ho2.t < 3180)
        ho2.x[burst, 3] = 1.5
        bl, ev, b = train.tune_baseline_budget(tr, start, policy, 1.0, [1.0], ho2, "ho2.csv",
                                               log=lambda *a: None)
        self.assertEqual(b["margin"][:3], [1.0, 1.0, 1.0])
        self.assertGreater(b["margin"][3], 1.0)
        self.assertEqual(b["heldout"]["false_per_rail_week"], 0.0)

    def test_drain_tuning_can_switch_on_a_feature_the_f1_search_left_unused(self):
        # Rail 90 fails with err_excess (feature 0) at 6.0, rail 91 with retrans_excess (3) at 1.4; the
        # F1 start uses feature 3 only. Labels: each failing rail's last 2 rows (120 s).
        rows = BaselineBudget.fs(90, 0, 2)
        rise = (rows.rail == 91) & (rows.x[:, 0] == 6.0)
        rows.x[rise, 0] = 0.0
        rows.x[rise, 3] = 1.4
        rows.label[(rows.rail >= 90) & (rows.t >= 3480) & (rows.t < 3600)] = 1
        start = baseline.BaselineParams(np.array([np.inf, np.inf, np.inf, 1.0], np.float32), 1)
        policy = metrics.Policy(threshold=0.9, enter_samples=3)
        cuts = baseline.switch_on_cuts(baseline.levels(rows.x, rows.rail, 1), rows.label,
                                       start.thresholds)
        self.assertTrue(np.isfinite(cuts[0]) and 0 < cuts[0] <= 6.0)
        self.assertTrue(np.isinf(cuts[3]))  # used already
        self.assertTrue(np.isinf(cuts[1]))  # never positive: no cut
        bl, ev = baseline.tune_events(rows, start, policy, 1.0, log=lambda *a: None)
        self.assertEqual((ev["warned"], ev["false_drains"]), (2, 0))
        self.assertTrue(np.isfinite(bl.thresholds[0]))
        self.assertLessEqual(float(bl.thresholds[0]) * 0.9 / 0.7, 6.0)
        self.assertEqual(float(bl.thresholds[3]), 1.0)
        self.assertTrue(np.isinf(bl.thresholds[1]) and np.isinf(bl.thresholds[2]))
        # Healthy rails that burst as high for as long (3 of 90, 2.8 per rail-week): switching
        # err_excess on would cost more than the budget, so it stays off.
        burst = (rows.rail < 3) & (rows.t >= 3000) & (rows.t < 3180)
        rows.x[burst, 0] = 6.0
        bl, ev = baseline.tune_events(rows, start, policy, 1.0, log=lambda *a: None)
        self.assertTrue(np.isinf(bl.thresholds[0]))
        self.assertEqual((ev["warned"], ev["false_drains"]), (1, 0))

    def test_a_budget_the_held_out_traces_keep(self):
        import train
        # 90 healthy rails x 2 h = 1.07 rail-weeks: one training burst is 0.93 per rail-week.
        tr = self.fs(90, 1, 1)
        ho = self.fs(90, 3, 1)
        start = baseline.BaselineParams(np.array([3.0, np.inf, np.inf, np.inf], np.float32), 1)
        policy = metrics.Policy(threshold=0.9, enter_samples=3)
        quiet = lambda *a: None
        # Training only: 3.0 drains the burst (5.0 >= 3.0 x 0.9 / 0.7) and still meets 1/week.
        bl, ev, b = train.tune_baseline_budget(tr, start, policy, 1.0, [1.0], log=quiet)
        self.assertEqual((ev["warned"], ev["false_drains"], b["budget"]), (1, 1, 1.0))
        self.assertIsNone(b["heldout"])
        # With the held-out set (3 bursts: 2.8 per week at 3.0) budget 1 is refused; 0.5 raises
        # the threshold over the bursts and still warns the failure.
        bl, ev, b = train.tune_baseline_budget(tr, start, policy, 1.0, [1.0, 0.5, 0.0], ho,
                                               "ho.csv", log=quiet)
        self.assertEqual(b["budget"], 0.5)
        self.assertEqual((ev["warned"], ev["false_drains"]), (1, 0))
        self.assertGreater(float(bl.thresholds[0]), 5.0 * 0.7 / 0.9)
        self.assertEqual((b["heldout"]["warned"], b["heldout"]["false_per_rail_week"]), (1, 0.0))
        self.assertEqual(b["heldout"]["trace"], "ho.csv")
        self.assertTrue(b["heldout"]["met"])
        text = train.header_text(bl, ev, policy, b)
        self.assertIn("Training budget 0.5 false drains per rail-week", text)
        self.assertIn("the largest that kept them at or under\n// 1 per rail-week "
                      "(--heldout-max-false-per-week)", text)
        self.assertIn("constexpr float kBaselineThreshold[4] = {", text)
        self.assertNotRegex(text, r"[{ ]\d+f")  # every literal a valid float: 4.0f, not 4f
        # No budget meets it (only 1 tried): the thresholds are raised one by one by the least
        # factor that does; x1.35 lifts 3.0 over the bursts (4.05 x 0.9 / 0.7 = 5.2 > 5.0)
        # and still warns the failure (6.0).
        lines = []
        bl, ev, b = train.tune_baseline_budget(tr, start, policy, 1.0, [1.0], ho, "ho.csv",
                                               log=lines.append)
        self.assertEqual((b["budget"], b["margin"]), (1.0, [1.35, 1.0, 1.0, 1.0]))
        self.assertTrue(b["heldout"]["met"])
        self.assertEqual((b["heldout"]["warned"], b["heldout"]["false_per_rail_week"]), (1, 0.0))
        self.assertAlmostEqual(float(bl.thresholds[0]), 3.0 * 1.35, places=5)
        self.assertEqual((ev["warned"], ev["false_drains"]), (1, 0))  # training, re-counted
        self.assertEqual(sum("(kept)" in line for line in lines), 1)
        text = train.header_text(bl, ev, policy, b)
        self.assertIn("whose thresholds x[1.35, 1, 1, 1] (raised one\n// by one, the least that "
                      "do) keep them", text)
        # A held-out set without a healthy rail cannot check a false-drain budget.
        with self.assertRaisesRegex(ValueError, "ho0.csv: no healthy rail"):
            train.tune_baseline_budget(tr, start, policy, 1.0, [1.0], self.fs(0, 0, 2),
                                       "ho0.csv", log=quiet)
        # A factor that clears the bursts but warns too few of the failures the unraised
        # thresholds warned (here none: the failure at 4.5 is under the bursts) is not a
        # margin: the smallest budget's thresholds are kept.
        ho_low = self.fs(90, 3, 1)
        ho_low.x[ho_low.x[:, 0] == 6.0, 0] = 4.5
        lines = []
        bl, ev, b = train.tune_baseline_budget(tr, start, policy, 1.0, [1.0], ho_low, "ho.csv",
                                               log=lines.append)
        self.assertEqual(b["margin"], [1.0] * 4)
        self.assertFalse(b["heldout"]["met"])
        self.assertEqual(float(bl.thresholds[0]), 3.0)
        self.assertTrue(any("x[1.35, 1, 1, 1]" in line and "(warns too few)" in line
                            for line in lines), lines)
        # Bursts no factor tried can clear (20.0 needs x5.2): the smallest budget's thresholds
        # are kept as they are, and the header says so.
        ho.x[ho.x[:, 0] == 5.0, 0] = 20.0
        bl, ev, b = train.tune_baseline_budget(tr, start, policy, 1.0, [1.0], ho, "ho.csv",
                                               log=quiet)
        self.assertFalse(b["heldout"]["met"])
        self.assertEqual(b["margin"], [1.0] * 4)
        self.assertEqual(float(bl.thresholds[0]), 3.0)
        text = train.header_text(bl, ev, policy, b)
        self.assertIn("none kept them at or under", text)
        self.assertIn("{3.0f, kBaselineUnused", text)
        with self.assertRaises(ValueError):
            train.parse_budgets("1,x")
        self.assertEqual(train.parse_budgets("0, 1,0.5"), [1.0, 0.5, 0.0])
        # The false-drain limits are refused, naming the option, unless finite and >= 0;
        # checked before any trace is read.
        for opt, bad in (("--heldout-max-false-per-week", "nan"),
                         ("--heldout-max-false-per-week", "-0.5"),
                         ("--max-false-per-week", "inf")):
            err = io.StringIO()
            with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
                train.main(["--train", "/nonexistent.csv", opt, bad])
            self.assertEqual(cm.exception.code, 2)
            self.assertIn(f"{opt} ", err.getvalue())
            self.assertIn("need a finite number >= 0", err.getvalue())
        # tune_policy.py chooses at the same limit by default, and refuses the same values.
        import tune_policy
        self.assertEqual(train.HELDOUT_MAX_FALSE, metrics.HELDOUT_MAX_FALSE)
        err = io.StringIO()
        with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
            tune_policy.main(["--model", "/nonexistent.bin", "--heldout", "/nonexistent.csv",
                              "--max-false-per-week", "-1"])
        self.assertEqual(cm.exception.code, 2)
        self.assertIn("--max-false-per-week -1: need a finite number >= 0", err.getvalue())
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = tune_policy.main(["--model", "/nonexistent.bin", "--heldout", "/x.csv"])
        self.assertEqual(rc, 1)
        self.assertIn("--model /nonexistent.bin: ", err.getvalue())


class IssueScenarios(unittest.TestCase):
    def test_the_issues_scenarios_as_a_trace(self):
        # issue_scenarios.py writes a trace the reader takes: 10 rails of each of 6 kinds, one
        # failure (a link 1 -> 0) on each creep, storm and sudden rail and none elsewhere, and
        # the creep's rate doubling each minute before it.
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "issue.csv")
            with contextlib.redirect_stderr(io.StringIO()):
                self.assertEqual(issue_scenarios.main(["--out", path, "--seed", "3"]), 0)
            tr = tracefile.read_trace(path)
        self.assertEqual(len(tr.rails), 60)
        sym = tracefile.COUNTERS.index("symbol_err")
        for r, name in enumerate(tr.rails):
            rows = np.flatnonzero(tr.rail == r)
            link = tr.link[rows]
            downs = int(np.sum(link[:-1] & ~link[1:]))
            kind = name.split("-", 1)[1]
            self.assertEqual(downs, 1 if kind in ("creep", "storm", "sudden") else 0, name)
            self.assertEqual(tr.scenarios[int(tr.scenario[rows[0]])], kind)
            if kind == "creep":
                up = rows[link]
                d = np.diff(tr.values[up, sym].astype(np.float64))
                self.assertGreater(d[-12:].mean(), 50 * d[:60].mean(), name)


class DrainOutcomesMatchTheTool(unittest.TestCase):
    """metrics.drain_outcomes (what tune_policy.py and train.py tune with) counts what
    r2ccl_predict --evaluate counts, on a generated trace."""

    MODEL = os.path.join(features.REPO_ROOT, "predictor", "model", "r2ccl_lstm.bin")

    @unittest.skipUnless(os.access(features.DEFAULT_CPP_TOOL, os.X_OK),
                         "r2ccl_predict not built")
    def test_same_counts_as_the_cpp_evaluate(self):
        import evaluate  # numpy LSTM inference from the weights file
        fd, path = tempfile.mkstemp(suffix=".csv")
        os.close(fd)
        try:
            rows, _ = gen_traces.generate(14, 24, 3600, 5.0, "heldout",
                                          gen_traces.parse_mix(gen_traces.DEFAULT_MIX))
            # A copy of a healthy rail whose link goes down at its second row: the flap hold
            # counts that down in both (an early drain: nothing follows it).
            first = next(r for r in rows if r[3] == "healthy" and
                         not r[1].startswith(gen_traces.ETH_PREFIX))[1]  # IB widths
            own = [r for r in rows if r[1] == first]
            for i, (t, _, row, _) in enumerate(own):
                row = list(row)
                row[0] = "0" if i == 1 else row[0]
                rows.append((t, "primed-down", row, "flap"))
            gen_traces.write_trace(path, [], rows)
            out = subprocess.run([features.DEFAULT_CPP_TOOL, "--quiet", "--evaluate", path,
                                  "--model", self.MODEL], capture_output=True, text=True,
                                 check=True).stdout
            w = weights.read(self.MODEL)
            fs = features.load_features(path, "cpp", features.DEFAULT_CPP_TOOL,
                                        float(w.horizon_s))
        finally:
            os.unlink(path)
        # The rise rule is on in the shipped weights and fires in this trace: its rows count.
        self.assertGreater(int(w.rise[0]), 0)
        self.assertTrue(baseline.rise_fires(fs.x, fs.rail, w.rise).any())
        risks = {"lstm": evaluate.lstm_risk(w, fs),
                 "baseline": baseline.risk(fs.x, fs.rail,
                                           baseline.BaselineParams.of(w))}
        cap = re.search(r"raised by the LSTM up to ([0-9.]+) x its own risk", out)
        self.assertIsNotNone(cap, out)
        risks["both"] = metrics.both_risk(risks["lstm"], risks["baseline"], float(cap.group(1)))
        for name, risk in risks.items():
            m = re.search(r"^%s +(\d+) +(\d+) +[0-9.]+ +(\d+) +(\d+ s|-) +(\d+)/(\d+) +(\d+) "
                          r"+[0-9.]+ +(\d+) +[0-9.]+$" % name, out, re.M)
            self.assertIsNotNone(m, out)
            o = metrics.drain_outcomes(fs, risk, metrics.Policy())
            self.assertGreater(o["precursor"], 5)
            self.assertGreaterEqual(o["early_drains"], 1)  # the primed-down rail's hold at least
            lead = o["lead_median_s"]
            self.assertEqual((o["precursor"], o["warned"], o["late"],
                              "-" if lead is None else f"{lead:.0f} s", o["sudden_warned"],
                              o["sudden"], o["false_drains"], o["early_drains"]),
                             tuple(g if i == 3 else int(g) for i, g in enumerate(m.groups())),
                             f"{name}:\n{out}")


class Generator(unittest.TestCase):
    def test_small_trace_parses_and_has_events(self):
        rows, counts = gen_traces.generate(3, 16, 1800, 5.0, "heldout",
                                           gen_traces.parse_mix(gen_traces.DEFAULT_MIX))
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "t.csv")
            gen_traces.write_trace(p, ["test"], rows)
            tr = tracefile.read_trace(p)
            fs = features.compute_features(tr)
        self.assertEqual(len(tr.rails), 16)
        self.assertEqual(sum(counts.values()), 16)
        self.assertTrue(np.all(np.isfinite(fs.x)))
        self.assertEqual(tr.widths[tracefile.COUNTERS.index("integrity")], S4)
        # 2 nodes, --eth-frac 0.4: one IB node and one Ethernet node, with their own widths.
        C = {c: i for i, c in enumerate(tracefile.COUNTERS)}
        eth = [i for i, r in enumerate(tr.rails) if r.startswith("e")]
        ib = [i for i, r in enumerate(tr.rails) if r.startswith("n")]
        self.assertEqual((len(eth), len(ib)), (8, 8))
        self.assertEqual(tr.rail_widths[eth[0]][C["rcv_err"]], W64)
        self.assertEqual(tr.rail_widths[ib[0]][C["rcv_err"]], Width(16, True))
        is_eth = np.isin(tr.rail, eth)
        self.assertFalse(tr.present[is_eth, C["symbol_err"]].any())
        self.assertFalse(tr.present[~is_eth, C["crc_err"]].any())
        self.assertGreater(tr.present[is_eth, C["crc_err"]].mean(), 0.99)
        # Only the failure scenarios ever lose the link.
        fail = [tr.scenarios.index(s) for s in ("optical", "creep", "flap", "sudden")
                if s in tr.scenarios]
        self.assertTrue(tr.link[~np.isin(tr.scenario, fail)].all())
        again, _ = gen_traces.generate(3, 16, 1800, 5.0, "heldout",
                                       gen_traces.parse_mix(gen_traces.DEFAULT_MIX))
        self.assertEqual(rows, again)  # deterministic per seed

    def test_mix_errors(self):
        with self.assertRaisesRegex(ValueError, "NAME=WEIGHT"):
            gen_traces.parse_mix("optical=0.5,meteor=0.5")


if __name__ == "__main__":
    unittest.main()
