#!/usr/bin/python3
"""Cross-checks the C++ features (r2ccl_predict --features) against features.py on a trace.

Compares row by row: the rows present (rail, t), the labels, the scenarios, the failure
events, and the eight features (float32; a difference above --atol + --rtol x |value| is a
mismatch). Prints a summary per feature and the first mismatches with the trace's rail and
time; exits 0 when the two agree, 1 when they do not, 2 on bad input.

Example:
  check_features.py --trace tests/predictor/fixtures/trace_small.csv
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import features
import tracefile


def compare(py: features.FeatureSet, cpp: features.FeatureSet, atol: float, rtol: float,
            show: int = 10) -> int:
    """Prints the differences; returns the number of problems found."""
    problems = 0
    if len(py) != len(cpp) or not np.array_equal(py.rail, cpp.rail) or \
            not np.allclose(py.t, cpp.t, rtol=0, atol=1e-9):
        print(f"rows differ: python {len(py)}, cpp {len(cpp)}")
        n = min(len(py), len(cpp))
        bad = np.flatnonzero((py.rail[:n] != cpp.rail[:n]) | (np.abs(py.t[:n] - cpp.t[:n]) > 1e-9))
        if bad.size:
            i = int(bad[0])
            print(f"  first difference at row {i}: python rail {py.rail[i]} t {py.t[i]}, "
                  f"cpp rail {cpp.rail[i]} t {cpp.t[i]}")
        return 1
    names = py.rails or [str(i) for i in range(int(py.rail.max()) + 1)]
    if not np.array_equal(py.label, cpp.label):
        bad = np.flatnonzero(py.label != cpp.label)
        print(f"labels differ on {bad.size} rows, e.g. rail {names[py.rail[bad[0]]]} "
              f"t {py.t[bad[0]]:.3f}: python {py.label[bad[0]]}, cpp {cpp.label[bad[0]]}")
        problems += 1
    sc_py = [py.scenarios[s] if s >= 0 else "" for s in py.scenario]
    sc_cpp = [cpp.scenarios[s] if 0 <= s < len(cpp.scenarios) else "" for s in cpp.scenario]
    if cpp.scenarios and sc_py != sc_cpp:
        print("scenario labels differ")
        problems += 1
    ev_py = sorted(zip(py.event_rail.tolist(), py.event_t.tolist()))
    ev_cpp = sorted(zip(cpp.event_rail.tolist(), cpp.event_t.tolist()))
    if ev_py != ev_cpp:
        only_cpp = sorted(set(ev_cpp) - set(ev_py))
        only_py = sorted(set(ev_py) - set(ev_cpp))
        print(f"failure events differ: {len(ev_py)} python, {len(ev_cpp)} cpp; only cpp: "
              f"{[(names[r], t) for r, t in only_cpp[:show]]}; only python: "
              f"{[(names[r], t) for r, t in only_py[:show]]}")
        problems += 1
    diff = np.abs(py.x.astype(np.float64) - cpp.x.astype(np.float64))
    tol = atol + rtol * np.abs(py.x.astype(np.float64))
    bad_rows = np.flatnonzero((diff > tol).any(axis=1))
    print(f"{len(py)} rows, {py.event_t.size} failure events; per feature max |python - cpp|: "
          + ", ".join(f"f{f} {diff[:, f].max():.3g}" for f in range(features.N_FEATURES)))
    if bad_rows.size:
        problems += 1
        print(f"features differ beyond atol {atol:g} + rtol {rtol:g} on {bad_rows.size} rows:")
        np.set_printoptions(precision=9, linewidth=160)
        for i in bad_rows[:show]:
            print(f"  rail {names[py.rail[i]]} t {py.t[i]:.3f}\n    python {py.x[i]}\n"
                  f"    cpp    {cpp.x[i]}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="trace CSV")
    ap.add_argument("--cpp-tool", default=features.DEFAULT_CPP_TOOL,
                    help=f"r2ccl_predict (default {features.DEFAULT_CPP_TOOL})")
    ap.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (1e-6)")
    ap.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance (1e-6)")
    args = ap.parse_args(argv)
    try:
        py = features.compute_features(tracefile.read_trace(args.trace))
        cpp = features.load_features(args.trace, "cpp", args.cpp_tool)
    except (tracefile.TraceError, ValueError, OSError, RuntimeError) as e:
        print(f"check_features.py: {e}", file=sys.stderr)
        return 2
    problems = compare(py, cpp, args.atol, args.rtol)
    print("check_features.py: " + ("python and cpp agree" if not problems else
                                   f"{problems} kind(s) of difference"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
