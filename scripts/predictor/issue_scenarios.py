#!/usr/bin/python3
"""The scenarios issue 17 was filed with, as a trace for `r2ccl_predict --evaluate`.

Ten IB rails of each kind, 1 hour each at 5 s samples, in the documented trace format
(docs/PREDICTOR.md "Trace format"), written from the issue's own description, not from
gen_traces.py or eval_traces.py:

  floor        a steady symbol-error rate of 0.5-5 per second for the hour (healthy)
  floor-reset  the same, the counters reset to 0 at 30 minutes (healthy)
  overrun      line-rate traffic with bursts of buffer overruns (healthy)
  creep        a 1/s floor, then a rate doubling every minute for 8 minutes, then link down
  storm        link error recoveries growing for 6 minutes, then link down
  sudden       link down at a random time with nothing before it

Usage: issue_scenarios.py --out FILE [--seed N]   (docs/BENCHMARKS.md, progress report 8)
"""

import argparse
import sys

import numpy as np

STEP_S, HOUR_S, RAILS = 5.0, 3600.0, 10
LINE_RATE_PPS = 4e6  # 400 Gb/s at about 12.5 KB per packet


def rail_rows(kind: str, name: str, rng: np.random.Generator):
    c = dict(tx_packets=0, rx_packets=0, tx_bytes=0, rx_bytes=0, symbol_err=0, rcv_err=0,
             link_recovery=0, link_downed=0, buf_overrun=0)
    floor = rng.uniform(0.5, 5.0)
    fail_t = {"creep": rng.uniform(1800, 3000), "storm": rng.uniform(1800, 3000),
              "sudden": rng.uniform(600, 3000)}.get(kind)
    burst_at = set(rng.choice(int(HOUR_S / STEP_S), 6, replace=False)) if kind == "overrun" else ()
    rows, link = [], 1
    for i in range(int(HOUR_S / STEP_S) + 1):
        t = i * STEP_S
        if i > 0 and link:
            pps = LINE_RATE_PPS if kind == "overrun" else 1e6
            sym = floor
            if kind == "creep" and t > fail_t - 480:
                sym = floor * 2 ** ((t - (fail_t - 480)) / 60)
            c["symbol_err"] = min(65535, c["symbol_err"] + rng.poisson(sym * STEP_S))
            c["rcv_err"] = min(65535, c["rcv_err"] + rng.poisson(sym * STEP_S / 10))
            if kind == "storm" and t > fail_t - 360:
                c["link_recovery"] += rng.poisson(0.02 * 2 ** ((t - (fail_t - 360)) / 60))
            if i in burst_at:
                c["buf_overrun"] += int(rng.integers(100, 5000))
            for k in ("tx_packets", "rx_packets"):
                c[k] += int(pps * STEP_S)
            for k in ("tx_bytes", "rx_bytes"):
                c[k] += int(pps * STEP_S * 12500)
        if kind == "floor-reset" and abs(t - 1800) < STEP_S / 2:
            c = {k: 0 for k in c}
        if fail_t is not None and link and t >= fail_t:
            link = 0
            c["link_downed"] += 1
        rows.append(f"{t:.1f},{name},{link},400000,,{c['tx_packets']},{c['rx_packets']},"
                    f"{c['tx_bytes']},{c['rx_bytes']},{c['symbol_err']},{c['rcv_err']},"
                    f"{c['link_recovery']},{c['link_downed']},0,{c['buf_overrun']},{kind}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="trace CSV to write")
    ap.add_argument("--seed", type=int, default=17, help="random seed (default 17)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    lines = ["# issue 17's scenarios (scripts/predictor/issue_scenarios.py)",
             "# widths: symbol_err=sat16 rcv_err=sat16 link_recovery=sat8 link_downed=sat8 "
             "buf_overrun=sat16",
             "t_s,rail,link,speed_mbps,retrans,tx_packets,rx_packets,tx_bytes,rx_bytes,"
             "symbol_err,rcv_err,link_recovery,link_downed,integrity,buf_overrun,scenario"]
    for kind in ("floor", "floor-reset", "overrun", "creep", "storm", "sudden"):
        for r in range(RAILS):
            lines += rail_rows(kind, f"n{r:02d}-{kind}", rng)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"issue_scenarios.py: {6 * RAILS} rails -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
