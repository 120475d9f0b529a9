#!/usr/bin/env python3
"""Log checks and the result table of scripts/gpu_e2e.sh, as functions of log text.

No GPU needed: tests/scripts/test_gpu_e2e_checks.py feeds these functions synthetic logs.

  check_log.py check --kind r2ccl|fault|socket [--no-tuner] RANK0_LOG RANK1_LOG ...
      prints one "PASS|FAIL|NOTE|SKIP  <kind>: <check> - <detail>" line per check; exit 0 when
      no check failed, 1 otherwise
  check_log.py table --run r2ccl=DIR --run fault=DIR --run socket=DIR
      prints the Markdown result table from DIR/rank0.log of each run

Each rank log is one process's stdout and stderr: NCCL's log (NCCL_DEBUG=INFO), r2ccl's own
"[R2CCL]" event lines, worker.py's WORKER/RESULT/DONE lines, and the "GPU_E2E_EXIT rc=N" line
gpu_e2e.sh appends after the process ended.

The NCCL log phrases relied on (NVIDIA/nccl, format strings unchanged from 2.19 to 2.29 unless
a range is given):
  "NET/Plugin: Loaded net plugin %s (v%d)"       src/net.cc (<= 2.25), src/plugin/net/net_vN.cc
  "Using network %s"                              src/init.cc
  "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d..."   src/transport/net.cc
  "Channel %02d : ... via SHM/%s/%s"              src/transport/shm.cc
  "Channel %02d/%01d : ... via P2P/%s..."         src/transport/p2p.cc
  "TUNER/Plugin: Using tuner plugin %s"           2.21-2.25 (src/misc/tuner.cc, tuner_vN.cc)
  "TUNER/Plugin: Using %s (v%d)"                  2.26+ (src/plugin/tuner/tuner_vN.cc)
  "Successfully loaded external tuner plugin %s"  2.28+ (src/plugin/tuner.cc), informative only
  "Failed to initialize any NET plugin"           2.26+ (src/plugin/net.cc): NCCL_NET matched nothing
  "Error: network %s not found."                  2.19-2.25 (src/net.cc): the same
and r2ccl's own (through NCCL's logger, so prefixed "NCCL INFO"/"NCCL WARN"):
  "NET/R2CCL r2ccl V (git H), NCCL net API vN, transport TCP (...), K rails: ..."  api/net_api.cc
  "TUNER/R2CCL r2ccl V (git H), NCCL tuner API vN, rules file: ..."             abi_tuner.cc
  "[T] [R2CCL] switchover: rail ..." / "[T] [R2CCL] Successfully recovered in X s (...)"
      (event sink, stderr; T is CLOCK_MONOTONIC, the clock of worker.py's t=)   engine/connection.cc
"""
import argparse
import os
import re
import sys

NET_NAME = "R2CCL"  # ncclNet_t.name of libnccl-net-r2ccl.so (net_plugin/abi/abi_nccl.cc)
TUNER_NAME = "R2CCL"  # ncclTuner_t.name of libnccl-tuner-r2ccl.so (tuner_plugin/src/abi_tuner.cc)

RE_NCCL = re.compile(r"NCCL (INFO|WARN) (.*)$")
RE_NET_LOADED = re.compile(r"^NET/Plugin: Loaded net plugin (.+?) \(v(\d+)\)")
RE_USING_NET = re.compile(r"^Using network (.+?)\s*$")
RE_CHANNEL = re.compile(r"^Channel \d+(?:/\d+)? : .* via (\S+)")
RE_TUNER_USING = re.compile(r"^TUNER/Plugin: Using (?:tuner plugin )?(\S+?)(?: \(v(\d+)\))?\s*$")
RE_TUNER_LOADED_PATH = re.compile(r"^Successfully loaded external tuner plugin (\S+)")
RE_NET_BANNER = re.compile(r"^NET/R2CCL r2ccl (\S+) \(git (\S+)\), NCCL net API v(\d+), "
                           r"transport (\w+) .*?, (\d+) rails: (.*?); ")
RE_TUNER_BANNER = re.compile(r"^TUNER/R2CCL r2ccl (\S+) \(git (\S+)\), NCCL tuner API v(\d+)")
RE_NO_NET = re.compile(r"Failed to initialize any NET plugin|Failed to initialize NET plugin "
                       + NET_NAME + r"|Error: network \S* ?not found")
RE_EVENT = re.compile(r"^\[(\d+\.\d+)\] \[R2CCL\] (.*)$")
RE_RECOVERED = re.compile(r"^Successfully recovered in ([\d.]+) s \(rail (.+?): (.+?), detected "
                          r"after (\d+) ms, (\d+) chunks replayed\)")
RE_RESULT = re.compile(r"^RESULT (.*)$")
RE_DONE = re.compile(r"^DONE (.*)$")
RE_EXIT = re.compile(r"^GPU_E2E_EXIT .*rc=(-?\d+)")
RE_PY_ERROR = re.compile(r"^(Traceback \(most recent call last\)|\S*(Error|Exception): )")

# r2ccl events that mean a path failed (never expected in the fault-free run)
FAILOVER_EVENTS = ("switchover:", "path on rail", "backup path on rail", "give-up:", "hold-down:")


def kv(s):
    return dict(f.split("=", 1) for f in s.split() if "=" in f)


class RankLog:
    """What one rank's log says, parsed once."""

    def __init__(self, text, index):
        self.index = index
        self.rank = index
        self.nccl_info, self.nccl_warn = [], []
        self.events = []  # (t, text) of "[T] [R2CCL] text"
        self.results, self.done, self.exit_rc, self.py_errors = [], None, None, []
        for line in text.splitlines():
            m = RE_NCCL.search(line)
            if m:
                (self.nccl_info if m.group(1) == "INFO" else self.nccl_warn).append(m.group(2))
                continue
            m = RE_EVENT.match(line)
            if m:
                self.events.append((float(m.group(1)), m.group(2)))
                continue
            if line.startswith("WORKER "):
                self.rank = int(kv(line).get("rank", index))
            elif RE_RESULT.match(line):
                d = kv(line)
                self.results.append(d)
            elif RE_DONE.match(line):
                self.done = kv(line)
            elif RE_EXIT.match(line):
                self.exit_rc = int(RE_EXIT.match(line).group(1))
            elif RE_PY_ERROR.match(line):
                self.py_errors.append(line.strip())

    def grep(self, regex, lines=None):
        return [m for m in (regex.search(x) for x in (self.nccl_info if lines is None else lines))
                if m]

    def channels(self):
        return [m.group(1) for m in self.grep(RE_CHANNEL)]


class Checks:
    def __init__(self, kind):
        self.kind, self.rows = kind, []

    def add(self, status, name, detail=""):
        self.rows.append((status, name, detail))

    def ok(self, cond, name, detail_pass, detail_fail):
        self.add("PASS" if cond else "FAIL", name, detail_pass if cond else detail_fail)

    def failed(self):
        return any(r[0] == "FAIL" for r in self.rows)

    def lines(self):
        return [f"{s:<4}  {self.kind}: {n}" + (f" - {d}" if d else "") for s, n, d in self.rows]


def _per_rank(logs, fn):
    """fn(rank_log) -> (ok, text); returns (all ok, '; '.join(rank texts))."""
    oks, texts = [], []
    for lg in logs:
        ok, text = fn(lg)
        oks.append(ok)
        texts.append(f"rank {lg.rank}: {text}")
    return all(oks) and bool(logs), "; ".join(texts) if texts else "no rank logs"


def _check_worker(c, logs, nranks):
    c.ok(len(logs) == nranks, "both ranks' logs present", f"{len(logs)} logs",
         f"{len(logs)} logs, want {nranks}")

    def one(lg):
        bad = [r for r in lg.results if r.get("check") != "OK"]
        if lg.exit_rc not in (None, 0):
            why = "timed out (killed by timeout)" if lg.exit_rc in (124, 137) else "failed"
            return False, f"process {why}, exit {lg.exit_rc}" + (
                f" ({lg.py_errors[-1]})" if lg.py_errors else "")
        if lg.done is None:
            return False, "no DONE line (the worker did not finish)" + (
                f": {lg.py_errors[-1]}" if lg.py_errors else "")
        if not lg.results:
            return False, "no RESULT lines"
        if bad or lg.done.get("wrong") != "0":
            sizes = ",".join(sorted({r.get("bytes", "?") for r in bad}, key=lambda x: int(x) if x.isdigit() else 0))
            return False, f"WRONG RESULTS: {len(bad)} of {len(lg.results)} sizes bad " \
                          f"(bytes {sizes}), DONE wrong={lg.done.get('wrong')}"
        return True, f"{len(lg.results)} sizes x passes checked, 0 wrong, exit {lg.exit_rc}"
    ok, d = _per_rank(logs, one)
    c.ok(ok, "every all_reduce correct, workers exited 0", d, d)


def _check_no_shm_p2p(c, logs):
    def one(lg):
        bad = [t for t in lg.channels() if t.startswith(("SHM", "P2P"))]
        return not bad, f"{len(bad)} SHM/P2P channels" + (f" (e.g. via {bad[0]})" if bad else "")
    ok, d = _per_rank(logs, one)
    c.ok(ok, "no channel via SHM or P2P", d, d)


def _check_network(c, logs, want):
    def using(lg):
        names = [m.group(1) for m in lg.grep(RE_USING_NET)]
        good = bool(names) and all(n.lower() == want.lower() for n in names)
        return good, f"'Using network {names[0]}'" + (f" (+{len(names) - 1})" if len(names) > 1 else "") \
            if names else "no 'Using network' line"
    ok, d = _per_rank(logs, using)
    c.ok(ok, f"NCCL selected network {want} ('Using network {want}')", d, d)

    def chans(lg):
        ts = lg.channels()
        if not ts:
            return False, "no 'Channel ... via' lines (NCCL_DEBUG_SUBSYS needs INIT)"
        other = [t for t in ts if t.split("/")[:2] != ["NET", want]]
        if other:
            return False, f"{len(other)} of {len(ts)} channel connections not via NET/{want} " \
                          f"(e.g. via {other[0]})"
        devs = sorted({t.split("/")[2].split("(")[0] for t in ts if len(t.split("/")) > 2})
        return True, f"{len(ts)} channel connections via NET/{want}, devices {','.join(devs)}"
    ok, d = _per_rank(logs, chans)
    c.ok(ok, f"every channel via NET/{want}", d, d)


def check_run(kind, texts, expect_tuner=True, nranks=2):
    """The checks of one run. kind: 'r2ccl' (fault-free), 'fault' (rail killed mid-run) or
    'socket' (NCCL's own socket transport). texts: the rank logs. Returns a Checks."""
    logs = [RankLog(t, i) for i, t in enumerate(texts)]
    c = Checks(kind)
    if kind == "socket":
        _check_network(c, logs, "Socket")
        _check_no_shm_p2p(c, logs)
        r2 = [lg.rank for lg in logs if any(x.startswith(("NET/R2CCL", "TUNER/R2CCL"))
                                            for x in lg.nccl_info + lg.nccl_warn)]
        c.ok(not r2, "r2ccl not loaded in the baseline", "no NET/R2CCL or TUNER/R2CCL lines",
             f"r2ccl lines in rank(s) {r2}")
        _check_worker(c, logs, nranks)
        return c

    # -- the r2ccl net plugin, loaded by NCCL itself
    def loaded(lg):
        v = [m.group(2) for m in lg.grep(RE_NET_LOADED) if m.group(1) == NET_NAME]
        return bool(v), f"'NET/Plugin: Loaded net plugin {NET_NAME} (v{v[0]})'" if v else \
            f"no 'NET/Plugin: Loaded net plugin {NET_NAME}' line"
    ok, d = _per_rank(logs, loaded)
    c.ok(ok, "NCCL loaded the r2ccl net plugin", d, d)

    def banner(lg):
        m = lg.grep(RE_NET_BANNER)
        if not m:
            return False, "no r2ccl net banner through NCCL's logger ('NCCL INFO NET/R2CCL r2ccl ...')"
        m = m[0]
        good = m.group(4) == "TCP" and int(m.group(5)) == 2
        return good, f"r2ccl {m.group(1)} (git {m.group(2)}), net API v{m.group(3)}, " \
                     f"transport {m.group(4)}, {m.group(5)} rails: {m.group(6)}" + \
                     ("" if good else " (want TCP, 2 rails)")
    ok, d = _per_rank(logs, banner)
    c.ok(ok, "r2ccl net banner in NCCL's log", d, d)

    _check_network(c, logs, NET_NAME)

    def no_fallback(lg):
        fail = [x for x in lg.nccl_info + lg.nccl_warn if RE_NO_NET.search(x)]
        internal = [t for t in lg.channels() if t.startswith(("NET/Socket", "NET/IB"))]
        if fail or internal:
            return False, (fail[0] if fail else f"channel via {internal[0]}")
        return True, "no NET/Socket or NET/IB channel, no plugin init failure"
    ok, d = _per_rank(logs, no_fallback)
    c.ok(ok, "no fallback to NCCL's internal Socket/IB nets", d, d)
    # NCCL 2.19-2.25 init every net before NCCL_NET's name check in some paths; their init lines
    # alone are not a fallback, so they are reported, not failed.
    inits = sorted({x.split(":")[0].strip() for lg in logs for x in lg.nccl_info
                    if x.startswith(("NET/Socket : Using", "NET/IB : Using"))})
    if inits:
        c.add("NOTE", "NCCL initialised an internal net (not used for any channel)", ", ".join(inits))

    _check_no_shm_p2p(c, logs)

    if expect_tuner:
        def tuner(lg):
            using = [m for m in lg.grep(RE_TUNER_USING) if m.group(1) == TUNER_NAME]
            b = lg.grep(RE_TUNER_BANNER)
            if not using:
                return False, f"no 'TUNER/Plugin: Using ... {TUNER_NAME}' line"
            if not b:
                return False, "NCCL took the tuner but no r2ccl tuner banner (its init never ran?)"
            return True, f"'{using[0].group(0).strip()}', banner: tuner API v{b[0].group(3)}"
        ok, d = _per_rank(logs, tuner)
        c.ok(ok, "NCCL loaded the r2ccl tuner plugin", d, d)
    else:
        c.add("SKIP", "NCCL loaded the r2ccl tuner plugin",
              "this NCCL probes only ncclTunerPlugin_v1, which r2ccl does not export")

    events = [(lg.rank, t, e) for lg in logs for t, e in lg.events]
    warns = [(lg.rank, w) for lg in logs for w in lg.nccl_warn]
    if kind == "r2ccl":
        bad = [(r, e) for r, _, e in events if e.startswith(FAILOVER_EVENTS)]
        c.ok(not bad, "no path failure in the fault-free run", "no switchover/give-up event",
             f"{len(bad)} events, first: rank {bad[0][0]}: {bad[0][1]}" if bad else "")
    elif kind == "fault":
        armed = [w for lg in logs for w in lg.nccl_warn
                 if w.startswith("NET/R2CCL fault injection armed")]
        c.ok(bool(armed), "R2CCL_FAULT_INJECT armed", armed[0][len("NET/R2CCL "):] if armed else "",
             "no 'fault injection armed' WARN (R2CCL_FAULT_INJECT not seen by the plugin)")
        sw = [(r, e) for r, _, e in events if e.startswith("switchover:")]
        rec = [(r, t, RE_RECOVERED.match(e)) for r, t, e in events if RE_RECOVERED.match(e)]
        gu = [(r, e) for r, _, e in events if e.startswith("give-up:")]
        c.ok(bool(sw), "the injected rail failure caused a switchover",
             f"{len(sw)} switchovers, first: rank {sw[0][0]}: {sw[0][1]}" if sw else "",
             "no '[R2CCL] switchover:' line (the fault never hit traffic?)")
        c.ok(bool(rec) and not gu, "r2ccl recovered ('Successfully recovered')",
             "; ".join(f"rank {r}: {m.group(0)}" for r, _, m in rec[:2]),
             f"give-up: rank {gu[0][0]}: {gu[0][1]}" if gu else "no 'Successfully recovered' line")
        if rec:
            t_rec = min(t for _, t, _ in rec)

            def after(lg):
                later = [r for r in lg.results if float(r.get("t", 0)) > t_rec]
                return bool(later), f"{len(later)} checked sizes finished after the recovery " \
                                    f"at t={t_rec:.3f}"
            ok, d = _per_rank(logs, after)
            c.ok(ok, "the job kept running after the recovery", d, d)
        else:
            c.add("FAIL", "the job kept running after the recovery", "no recovery to measure from")
    other = [(r, w) for r, w in warns if not any(w.startswith("NET/R2CCL " + e) for e in
                                                  ("switchover", "Successfully", "failback",
                                                   "path on rail", "backup path",
                                                   "fault injection armed"))]
    if other:
        c.add("NOTE", f"{len(other)} other NCCL WARN lines", f"rank {other[0][0]}: {other[0][1]}")
    _check_worker(c, logs, nranks)
    return c


# ------------------------------------------------------------------------------ result table
def results_by_size(text, rank=0):
    """{bytes: [(pass, algbw, busbw), ...]} from one rank log's RESULT lines."""
    out = {}
    for r in RankLog(text, rank).results:
        out.setdefault(int(r["bytes"]), []).append(
            (int(r["pass"]), float(r["algbw_GBs"]), float(r["busbw_GBs"])))
    return out


def human(n):
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return f"{n} B"


def table(runs):
    """runs: {'r2ccl': text, 'fault': text, 'socket': text} (rank 0 logs; any may be missing).
    r2ccl and socket: the last pass of each size; fault: the slowest pass of each size (the
    one the rail failure hit, normally), with its pass number."""
    rs = {k: results_by_size(v) for k, v in runs.items() if v is not None}
    sizes = sorted(set().union(*[set(v) for v in rs.values()])) if rs else []

    def cell(kind, size, pick):
        rows = rs.get(kind, {}).get(size)
        if not rows:
            return None
        return pick(rows)

    last = lambda rows: max(rows)  # noqa: E731 (highest pass)
    worst = lambda rows: min(rows, key=lambda x: x[2])  # noqa: E731
    hdr = ("| size | r2ccl algbw | r2ccl busbw | r2ccl + rail fault busbw (slowest pass) | "
           "socket algbw | socket busbw | r2ccl / socket busbw |")
    lines = [hdr, "|" + "---|" * 7]
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for s in sizes:
        a = cell("r2ccl", s, last)
        fl = cell("fault", s, worst)
        so = cell("socket", s, last)
        ratio = f"{a[2] / so[2]:.2f}" if a and so and so[2] > 0 else "-"
        lines.append(f"| {human(s)} | {f(a and a[1])} | {f(a and a[2])} | "
                     f"{f(fl and fl[2])}{f' (pass {fl[0]})' if fl else ''} | "
                     f"{f(so and so[1])} | {f(so and so[2])} | {ratio} |")
    lines.append("")
    lines.append("GB/s (10^9 bytes/s), rank 0, float32 sum, 2 ranks; busbw = algbw x 2(n-1)/n. "
                 "r2ccl and socket: the last pass; fault: the slowest pass of each size.")
    return "\n".join(lines) + "\n"


def _read(path):
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description="gpu_e2e.sh log checks and result table")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("check")
    p.add_argument("--kind", required=True, choices=("r2ccl", "fault", "socket"))
    p.add_argument("--no-tuner", action="store_true", help="NCCL < 2.21: skip the tuner check")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("logs", nargs="+")
    t = sub.add_parser("table")
    t.add_argument("--run", action="append", default=[], help="KIND=DIR (DIR/rank0.log)")
    a = ap.parse_args(argv)
    if a.cmd == "check":
        texts = [x for x in (_read(p) for p in a.logs) if x is not None]
        c = check_run(a.kind, texts, expect_tuner=not a.no_tuner, nranks=a.ranks)
        print("\n".join(c.lines()))
        return 1 if c.failed() else 0
    runs = {}
    for r in a.run:
        k, _, d = r.partition("=")
        runs[k] = _read(os.path.join(d, "rank0.log"))
    sys.stdout.write(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
