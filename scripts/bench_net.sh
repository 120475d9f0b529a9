#!/usr/bin/env bash
# bench_net.sh - r2ccl net plugin benchmarks (not tests): throughput against iperf3, small-message
# latency against plain TCP, switchover latency under real faults, degraded throughput,
# spurious switchovers, and the same throughput rows unshaped. docs/BENCHMARKS.md explains
# every row. Run `bench_net.sh --help`.
# shellcheck disable=SC2054
# (SC2054: comma lists such as R2CCL_SOCKET_IFNAME=lo@A,lo@B are one word on purpose.)
set -uo pipefail

PROG=${0##*/}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

usage() {
  cat <<'EOF'
bench_net.sh - benchmarks of the r2ccl net plugin on the rail lab (docs/BENCHMARKS.md)

USAGE
  bench_net.sh [--smoke] [--build DIR] [--out DIR] [--faults N] [--fault-free-seconds S]
               [--prefix P] [--rate RATE] [--only LIST]

  Full run (default): needs root and network namespaces (scripts/railab.sh check). Builds a rail
  lab with 2 rails shaped to --rate (default 2gbit), runs every measurement one after the
  other (the machine is small: never two at once), then the throughput rows again on an
  unshaped lab, tears the lab down, and prints a Markdown table (also in OUT/results.md).
  Without root or namespaces the full run prints why and exits 77.

  --smoke  a tiny version of every measurement, well under a minute; what CI runs. On the lab
           when it can be built, else on loopback only (two rails lo@127.0.0.1,lo@127.0.0.2,
           faults from the plugin's in-process injector R2CCL_FAULT_INJECT).

OPTIONS
  --build DIR              build tree with bin/r2ccl_perf and lib/libnccl-net-*.so (default build)
  --out DIR                raw logs and results (default BUILD/bench/<timestamp>)
  --faults N               faults of each kind (link-down, far-down, blackhole) (default 20;
                           smoke 1)
  --fault-free-seconds S   length of the fault-free traffic run (default 600; smoke 5)
  --prefix P               rail lab prefix (default r2b, smoke r2bs); only this lab is touched
  --rate RATE              rail shaping for the shaped rows (default 2gbit)
  --only LIST              comma list of groups to run: tput, small, faults, degraded,
                           faultfree, unshaped, addr, shadow, unequal, ratedrop, spread
                           (default: all; addr, shadow, unequal, ratedrop, spread and
                           unshaped are not in --smoke unless named)
                           unequal: stripe over 2 rails shaped 2gbit and 500mbit against
                           iperf3 on both at once and the fast rail alone; ratedrop: rail 0 of
                           that lab drops to 250mbit mid-run, time until the split follows;
                           spread: 4 rails at 500mbit, 4 channels, rail 0 down for good,
                           R2CCL_FAILOVER_SPREAD=1 against 0 (move to one backup)
  -h, --help               this text

  R2CCL_BENCH_LOOPBACK=1 forces the loopback-only smoke run (to test that path as root).
  R2CCL_BENCH_SPREAD_RATE=RATE shapes the spread group's 4 rails (default 500mbit).
  R2CCL_BENCH_UNEQ_RATES=R0,R1 the unequal and ratedrop groups' 2 rails (default 2gbit,500mbit;
  ratedrop drops rail 0 to 1/8 of its rate). R2CCL_BENCH_SIZE=S their message size (64M).
  (Lower rates keep a busy machine's CPUs from being the limit.)

EXIT STATUS
  0 every run completed with 0 wrong bytes (speed targets never change the exit status);
  1 something broke (a run failed or hung, wrong bytes, a tool missing mid-run);
  2 usage error; 77 full run impossible here (no root / namespaces).

OUTPUT
  OUT/results.md (the table), OUT/results.tsv, OUT/<row>/... raw logs: cmd.txt (exact
  commands), rank0.out (r2ccl_perf table, each line prefixed with CLOCK_MONOTONIC),
  rank0.err/rank1.out, plugin.r0.log/plugin.r1.log (R2CCL_LOG_FILE), iperf3 JSON, faults.tsv.
EOF
}

# ------------------------------------------------------------------------------- options
SMOKE=0
BUILD=build
OUT=
FAULTS=
FF_SECS=
PREFIX=
RATE=2gbit
ONLY=all
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --build) BUILD=${2:?--build needs a directory}; shift ;;
    --out) OUT=${2:?--out needs a directory}; shift ;;
    --faults) FAULTS=${2:?--faults needs a number}; shift ;;
    --fault-free-seconds) FF_SECS=${2:?--fault-free-seconds needs a number}; shift ;;
    --prefix) PREFIX=${2:?--prefix needs a value}; shift ;;
    --rate) RATE=${2:?--rate needs a value}; shift ;;
    --only) ONLY=${2:?--only needs a list}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "$PROG: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ $SMOKE -eq 1 ]; then
  : "${FAULTS:=1}" "${FF_SECS:=5}" "${PREFIX:=r2bs}"
else
  : "${FAULTS:=20}" "${FF_SECS:=600}" "${PREFIX:=r2b}"
fi
case $FAULTS in ''|*[!0-9]*) echo "$PROG: --faults wants a number" >&2; exit 2 ;; esac
case $FF_SECS in ''|*[!0-9]*) echo "$PROG: --fault-free-seconds wants a number" >&2; exit 2 ;; esac
[ "$FAULTS" -ge 1 ] || { echo "$PROG: --faults must be >= 1" >&2; exit 2; }

case $BUILD in /*) ;; *) BUILD=$PWD/$BUILD ;; esac
PERF=$BUILD/bin/r2ccl_perf
PLUGIN_SO=$BUILD/lib/libnccl-net-r2ccl.so
PLAIN_SO=$BUILD/lib/libnccl-net-plaintcp.so
RAILAB=$ROOT/scripts/railab.sh
command -v python3 >/dev/null || { echo "$PROG: python3 is needed" >&2; exit 1; }

want() { [ "$ONLY" = all ] || [[ ",$ONLY," == *",$1,"* ]]; }
# The issue 16 groups (unequal, ratedrop, spread) build labs of their own: in a full run and
# when named, never in the default smoke run (it stays short).
want16() { [[ ",$ONLY," == *",$1,"* ]] || { [ "$ONLY" = all ] && [ $SMOKE -eq 0 ]; }; }
# What the chosen groups run (the plaintcp plugin only for the small-message group, the lab
# test executable only for addr and shadow), each named with its make target.
need=("$PERF:r2ccl_perf" "$PLUGIN_SO:nccl-net-r2ccl")
want small && need+=("$PLAIN_SO:nccl-net-plaintcp")
{ want16 addr || want16 shadow; } && need+=("$BUILD/bin/r2ccl_lab_tests:r2ccl_lab_tests")
for e in "${need[@]}"; do
  f=${e%:*}
  if [ ! -e "$f" ]; then
    echo "$PROG: $f is missing; build first: cmake -S $ROOT -B $BUILD -DCMAKE_BUILD_TYPE=Release -DR2CCL_WERROR=ON && make -C $BUILD -j2 ${e##*:} (or run scripts/test.sh)" >&2
    exit 1
  fi
done

# ------------------------------------------------------------------------------- lab or loopback
MODE=lab
if [ "${R2CCL_BENCH_LOOPBACK:-0}" = 1 ]; then
  WHY="R2CCL_BENCH_LOOPBACK=1"
  MODE=lo
elif [ "$(id -u)" -ne 0 ]; then
  WHY="not root (the rail lab needs CAP_SYS_ADMIN + CAP_NET_ADMIN)"
  MODE=lo
elif ! WHY=$(bash "$RAILAB" check 2>&1); then
  MODE=lo
fi
if [ $MODE = lo ]; then
  if [ $SMOKE -eq 0 ]; then
    echo "$PROG: the full benchmark needs the rail lab: $WHY" >&2
    echo "$PROG: (bench_net.sh --smoke runs a loopback-only smoke test instead)" >&2
    exit 77
  fi
  echo "$PROG: rail lab not available ($WHY); loopback-only smoke run"
fi
for t in iperf3 nft tc; do
  if [ $MODE = lab ] && ! command -v $t >/dev/null; then
    if [ $SMOKE -eq 1 ]; then
      echo "$PROG: $t missing (railab.sh deps installs it); loopback-only smoke run"
      MODE=lo
    else
      echo "$PROG: $t missing; run: bash scripts/railab.sh deps" >&2
      exit 77
    fi
  fi
done

STAMP=$(date +%Y%m%d-%H%M%S)
[ -n "$OUT" ] || OUT=$BUILD/bench/$STAMP$([ $SMOKE -eq 1 ] && echo -smoke)
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT" || exit 1
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$COMMIT" != unknown ] && ! git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null; then
  COMMIT="$COMMIT-dirty"
  git -C "$ROOT" diff --stat HEAD >"$OUT/git-diff-stat.txt" 2>&1
  git -C "$ROOT" diff HEAD >"$OUT/git-diff.patch" 2>&1
fi
HELPER=$OUT/bench_helper.py
ROWS=$OUT/results.tsv
: >"$ROWS"
BROKEN=0
T_START=$SECONDS
NA=${PREFIX}a
NB=${PREFIX}b
RDV_HOST=10.210.250.1
PORT=$((30000 + RANDOM % 20000))

log() { printf '[bench %4ss] %s\n' $((SECONDS - T_START)) "$*"; }
broke() { log "BROKEN: $*"; echo "$*" >>"$OUT/broken.txt"; BROKEN=1; }
# add_row NAME TARGET MEASURED RESULT COMMAND LOG   (RESULT: ok, MISS, info, BROKEN, n/a)
add_row() {
  local f=("$@")
  local i
  for i in "${!f[@]}"; do f[$i]=${f[$i]//$'\t'/ }; f[$i]=${f[$i]//|/\\|}; done
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "${f[0]}" "${f[1]}" "${f[2]}" "${f[3]}" "${f[4]}" "${f[5]#"$OUT"/}" >>"$ROWS"
  log "row: ${f[0]} | target ${f[1]} | ${f[2]} | ${f[3]}"
}
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
slug() { local s=${1// /-}; s=${s//[()]/}; echo "$s"; }   # a directory name without blanks

cleanup() {
  # Background processes this script started (pids in OUT/.pids); a pid is only signalled if
  # it still runs one of our commands (never a reused pid).
  local p c
  if [ -f "$OUT/.pids" ]; then
    while read -r p; do
      c=$( { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null) || continue
      case $c in *r2ccl_perf*|*iperf3*|*pingpong*|*bench_net*|*bench_helper*) kill "$p" 2>/dev/null ;; esac
    done <"$OUT/.pids"
    rm -f "$OUT/.pids"
  fi
  if [ $MODE = lab ] && [ "${LAB_UP:-0}" = 1 ]; then
    bash "$RAILAB" down --prefix "$PREFIX" >/dev/null 2>&1
    LAB_UP=0
  fi
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# ------------------------------------------------------------------------------- helper (python)
cat >"$HELPER" <<'PYEOF'
#!/usr/bin/env python3
"""bench_net.sh helper: log parsing and statistics. Subcommands are documented inline."""
import glob, json, math, os, re, sys, time

TS = r'^\[(\d+\.\d+)\]'

def pct(vals, q):
    """Nearest-rank percentile (q in 0..100). With n samples, p99 is the max when n < 100."""
    v = sorted(vals)
    if not v:
        return None
    k = max(1, int(math.ceil(q / 100.0 * len(v))))
    return v[k - 1]

def fmt(x, nd=1):
    return 'n/a' if x is None else ('%.*f' % (nd, x))

def perf_rows(path):
    """Data rows of an r2ccl_perf table (lines optionally prefixed with [monotonic])."""
    rows = []
    for line in open(path, errors='replace'):
        ts = None
        m = re.match(TS + r' (.*)$', line)
        if m:
            ts, line = float(m.group(1)), m.group(2)
        f = line.split()
        if len(f) == 9 and f[0].isdigit() and f[2] == 'float':
            r = dict(ts=ts, size=int(f[0]), us=float(f[5]), algbw=float(f[6]),
                     busbw=float(f[7]), wrong=None if f[8] == 'N/A' else int(f[8]))
            # Gbit/s of bus bandwidth from the size and the time: the table prints GB/s with
            # 2 decimals (0.28 = 2.24 Gbit/s, 0.29 = 2.32: 3.5 % steps). Where busbw is not
            # algbw (collectives), its printed factor is used.
            factor = r['busbw'] / r['algbw'] if r['algbw'] > 0 and r['busbw'] != r['algbw'] else 1.0
            r['gbps'] = r['size'] * 8 / (r['us'] * 1e3) * factor if r['us'] > 0 else 0.0
            rows.append(r)
    return rows

def cmd_tsfilter(_):
    out = sys.stdout
    for line in sys.stdin:
        out.write('[%.6f] %s' % (time.monotonic(), line))
        out.flush()

def cmd_iperf(args):
    """iperf FILE...: receiver Gbit/s of each iperf3 -J file, then the sum (one per line).
    --bidir runs: the mean of the two directions (a per-direction rate)."""
    tot = 0.0
    for f in args:
        try:
            j = json.load(open(f))
            g = j['end']['sum_received']['bits_per_second'] / 1e9
            if 'sum_received_bidir_reverse' in j['end']:
                g = (g + j['end']['sum_received_bidir_reverse']['bits_per_second'] / 1e9) / 2
        except Exception:
            print('nan')
            return
        tot += g
        print('%.3f' % g)
    print('%.3f' % tot)

def cmd_perf(args):
    """perf FILE [SIZE]: 'rows N mean_gbps X mean_us Y wrong W' over the rows (of SIZE)."""
    rows = perf_rows(args[0])
    if len(args) > 1:
        rows = [r for r in rows if r['size'] == int(args[1])]
    if not rows:
        print('rows 0 mean_gbps nan mean_us nan wrong 0')
        return
    g = sum(r['gbps'] for r in rows) / len(rows)
    us = sum(r['us'] for r in rows) / len(rows)
    w = sum(r['wrong'] or 0 for r in rows)
    print('rows %d mean_gbps %.3f mean_us %.2f wrong %d' % (len(rows), g, us, w))

def cmd_sizes(args):
    """sizes FILE: 'size us' per row (first occurrence of each size)."""
    seen = set()
    for r in perf_rows(args[0]):
        if r['size'] not in seen:
            seen.add(r['size'])
            print(r['size'], r['us'])

def cmd_flowing(args):
    """flowing DIR NEED_S: 1 if the current job of a traffic loop is running, has printed two
    rows, and its remaining passes (at its pace so far) last at least NEED_S seconds; else 0."""
    d, need = args[0], float(args[1])
    try:
        cur = open(os.path.join(d, 'current')).read().strip()
        rd = os.path.join(d, 'run' + cur)
        if os.path.exists(os.path.join(rd, 'rc')):
            print(0); return
        rep = int(open(os.path.join(rd, 'repeat')).read())
        lines = open(os.path.join(rd, 'rank0.out'), errors='replace').read().splitlines()
    except (OSError, ValueError):
        print(0); return
    rows = perf_rows(os.path.join(rd, 'rank0.out'))
    if len(rows) < 2:
        print(0); return
    # pace from the first row to now (rows can arrive in bursts; 'now' keeps it honest)
    pace = (time.monotonic() - rows[0]['ts']) / (len(rows) - 1)
    left = (rep - len(rows)) * pace
    print(1 if left >= need else 0)

def job_windows(d):
    """[start, end] of every job of a traffic loop: first line of rank0.out to its
    '# Out of bounds' line (teardown comes after it)."""
    w = []
    for rd in sorted(glob.glob(os.path.join(d, 'run*'))):
        try:
            lines = open(os.path.join(rd, 'rank0.out'), errors='replace').read().splitlines()
        except OSError:
            continue
        ts = [float(re.match(TS, l).group(1)) for l in lines if re.match(TS, l)]
        if not ts:
            continue
        end = [float(re.match(TS, l).group(1)) for l in lines if 'Out of bounds' in l]
        w.append((ts[0], end[0] if end else 1e18))   # a failed job: everything after counts
    return w

def cmd_pace(args):
    """pace FILE: seconds per data row of a finished job (first line to last row), or 0."""
    try:
        lines = open(args[0], errors='replace').read().splitlines()
        rows = perf_rows(args[0])
        t0 = float(re.match(TS, lines[0]).group(1))
        print('%.3f' % ((rows[-1]['ts'] - t0) / len(rows)) if rows else 0)
    except (OSError, AttributeError, IndexError):
        print(0)

def cmd_rows(args):
    """rows FILE: number of data rows so far."""
    try:
        print(len(perf_rows(args[0])))
    except OSError:
        print(0)

def cmd_degraded(args):
    """degraded FILE FAULT_TS SETTLE_S: mean Gbit/s of the rows whose pass started (previous
    row printed) at least SETTLE_S after FAULT_TS; and of the rows before the fault."""
    rows = perf_rows(args[0])
    t = float(args[1]) + float(args[2])
    after = [r for i, r in enumerate(rows) if i > 0 and rows[i - 1]['ts'] >= t]
    before = [r for r in rows if r['ts'] < float(args[1])]
    m = lambda rs: sum(r['gbps'] for r in rs) / len(rs) if rs else float('nan')
    print('after_rows %d after_gbps %.3f before_rows %d before_gbps %.3f' %
          (len(after), m(after), len(before), m(before)))

def cmd_txsample(args):
    """txsample OUT RAILS STOPFILE: every 20 ms a line 'monotonic tx_bytes(rail0) ...' of
    this namespace's rails until STOPFILE exists (run it inside side a)."""
    out = open(args[0], 'w')
    n = int(args[1])
    while not os.path.exists(args[2]):
        v = []
        for i in range(n):
            try:
                v.append(open('/sys/class/net/rail%d/statistics/tx_bytes' % i).read().strip())
            except OSError:
                v.append('nan')
        out.write('%.6f %s\n' % (time.monotonic(), ' '.join(v)))
        out.flush()
        time.sleep(0.02)

def cmd_follow(args):
    """follow TX.tsv FAULT_TS TARGET_GBPS WIN_S DROP_GBPS: the rails' send rates over sliding
    windows of WIN_S. 'effect_s E follow_s S before_gbps B after_gbps A share0_before X
    share0_after Y': E = seconds from FAULT_TS (when the tc command started) until rail 0's
    rate is down to 1.2x DROP_GBPS (the drop in effect); S = seconds from then until the
    summed rate over a window reaches TARGET_GBPS again (0 if it never fell below); nan:
    never. B = the mean summed rate over the 2 s before FAULT_TS, A = from E + S + 0.5 s to
    the end; share0 = rail 0's part of the bytes in those spans."""
    rows = []
    for line in open(args[0]):
        f = line.split()
        try:
            rows.append((float(f[0]), [int(x) for x in f[1:]]))
        except ValueError:
            pass
    t0, target, win, drop = float(args[1]), float(args[2]), float(args[3]), float(args[4])
    def span(a, b):
        r = [x for x in rows if a <= x[0] <= b]
        if len(r) < 2:
            return float('nan'), float('nan'), float('nan')
        dt = r[-1][0] - r[0][0]
        d = [r[-1][1][i] - r[0][1][i] for i in range(len(r[0][1]))]
        tot = sum(d)
        return tot * 8 / dt / 1e9, (d[0] / tot if tot else float('nan')), d[0] * 8 / dt / 1e9
    nan = float('nan')
    effect = nan
    for t, _ in rows:
        if t < t0 + win:
            continue
        if span(t - win, t)[2] <= 1.2 * drop:
            effect = t
            break
    follow = nan
    if not math.isnan(effect):
        follow = 0.0
        dipped = False
        for t, _ in rows:
            if t < effect:
                continue
            g = span(t - win, t)[0]
            if g < target:
                dipped = True
            elif dipped:
                follow = t - effect
                break
        if dipped and follow == 0.0:
            follow = nan
    b, sb, _ = span(t0 - 2, t0)
    a, sa = nan, nan
    if not math.isnan(follow):
        a, sa, _ = span(effect + follow + 0.5, rows[-1][0] - 0.2)
    print('effect_s %.3f follow_s %.3f before_gbps %.3f after_gbps %.3f share0_before %.3f share0_after %.3f' %
          ((effect - t0) if not math.isnan(effect) else nan, follow, b, a, sb, sa))

def cmd_perfcpu(args):
    """perfcpu OUT STOPFILE: every 0.2 s, the CPU seconds (user + system) of every r2ccl_perf
    process so far, until STOPFILE exists; then writes 'cpu_s S wall_s W cores C' to OUT: the
    ranks' own CPU (the most seen per process, summed) over the sampling time."""
    hz = os.sysconf('SC_CLK_TCK')
    seen = {}
    t0 = time.monotonic()
    while not os.path.exists(args[1]):
        for d in os.listdir('/proc'):
            if not d.isdigit():
                continue
            try:
                st = open('/proc/%s/stat' % d).read()
            except OSError:
                continue
            if '(r2ccl_perf)' not in st:
                continue
            f = st.rsplit(')', 1)[1].split()
            seen[d] = max(seen.get(d, 0), (int(f[11]) + int(f[12])) / hz)
        time.sleep(0.2)
    wall = time.monotonic() - t0
    cpu = sum(seen.values())
    open(args[0], 'w').write('cpu_s %.1f wall_s %.1f cores %.2f\n' % (cpu, wall, cpu / wall if wall else 0))

def cmd_cpu(_):
    """cpu: 'total idle' jiffies of /proc/stat (all CPUs)."""
    f = open('/proc/stat').readline().split()[1:]
    v = [int(x) for x in f]
    print(sum(v), v[3] + v[4])

def cmd_now(_):
    print('%.6f' % time.monotonic())

EV = re.compile(TS + r' \[R2CCL\] (.*)$')
def events(path):
    out = []
    try:
        for line in open(path, errors='replace'):
            m = EV.match(line)
            if m:
                out.append((float(m.group(1)), m.group(2)))
    except OSError:
        pass
    return out

def is_send_failure(msg, rail):
    return (msg.startswith('switchover: rail %s failed' % rail) or
            msg.startswith('backup path on rail %s failed' % rail))

def cmd_pending(args):
    """pending DIR RAIL TS: send-side path failures on RAIL since TS (both ranks) that have no
    failback yet; 0 = the rail is back everywhere."""
    d, rail, ts = args[0], args[1], float(args[2])
    pend = 0
    for r in ('r0', 'r1'):
        ev = [(t, m) for t, m in events(os.path.join(d, 'plugin.%s.log' % r)) if t >= ts]
        fails = sum(1 for t, m in ev if is_send_failure(m, rail))
        backs = sum(1 for t, m in ev if m.startswith('failback: rail %s is back' % rail))
        pend += max(0, fails - backs)
    print(pend)

def cmd_count(args):
    """count [--jobs DIR] FILE...: event lines by kind, one 'kind N' per line (and 'first_ts
    T'). With --jobs DIR only lines inside a job's window (see job_windows) count; the others
    (connection setup, teardown) are counted as 'outside N'. Teardown: when one rank closes
    its connections first, the other logs 'peer closed the connection' failures and give-ups
    in the last moments of the job; those (within 1 s of the job's end) count as outside too."""
    win = None
    if args and args[0] == '--jobs':
        win = job_windows(args[1])
        args = args[2:]
    kinds = [('switchover', r'^switchover:'), ('shadow', r'^shadow routing:'),
             ('backup_failed', r'^backup path on rail'), ('recv_path_failed', r'^path on rail'),
             ('holddown', r'^hold-down:'), ('giveup', r'^give-up:'), ('failback', r'^failback:'),
             ('recovered', r'^Successfully recovered')]
    n = {k: 0 for k, _ in kinds}
    n['outside'] = 0
    first = None
    for f in args:
        for t, m in events(f):
            if win is not None:
                inside = [(a, b) for a, b in win if a <= t <= b]
                teardown = inside and t >= inside[0][1] - 1.0 and (
                    'peer closed' in m or (m.startswith('give-up') and ' 0 pending' in m))
                if not inside or teardown:
                    n['outside'] += 1
                    continue
            for k, rx in kinds:
                if re.match(rx, m):
                    n[k] += 1
                    if k in ('switchover', 'shadow', 'backup_failed', 'recv_path_failed') and \
                            (first is None or t < first):
                        first = t
    for k in n:
        print(k, n[k])
    print('first_ts', first if first is not None else 'none')

REC = re.compile(r'^Successfully recovered in ([0-9.]+) s \(rail (\S+): (.*), detected after '
                 r'([0-9.]+) ms, (\d+) chunks replayed\)')
SW = re.compile(r'^switchover: rail (\S+) failed \(([^;:)]*)')

def cmd_faults(args):
    """faults DIR KIND: switchover latency per fault of DIR/faults.tsv (lines: kind rail ts
    took_us undo_ts), from DIR/plugin.r0.log and plugin.r1.log. Writes DIR/latency.tsv and
    prints key=value lines."""
    d, kind = args[0], args[1]
    faults = []
    for line in open(os.path.join(d, 'faults.tsv')):
        f = line.split()
        if len(f) >= 5 and f[0] == kind:
            faults.append(dict(rail='rail' + f[1], ts=float(f[2]), took=int(f[3]), undo=float(f[4])))
    ev = {r: events(os.path.join(d, 'plugin.%s.log' % r)) for r in ('r0', 'r1')}
    allf = []
    for line in open(os.path.join(d, 'faults.tsv')):
        f = line.split()
        if len(f) >= 3:
            allf.append(float(f[2]))
    allf.sort()
    lat0, lat1, first, last, recov, replays, causes = [], [], [], [], [], 0, {}
    # rank 0's line minus the fault command's run time: from the fault in place (the command
    # done) instead of its stamp (taken before it starts); negative when detected meanwhile.
    after_cmd = []
    miss0 = miss_any = with_replay = 0
    with open(os.path.join(d, 'latency-%s.tsv' % kind), 'w') as out:
        out.write('rail\tfault_ts\ttook_us\trank0_ms\trank1_ms\trank0_cause\trank1_cause\trecovered_s\treplayed\n')
        for fl in faults:
            nxt = [t for t in allf if t > fl['ts']]
            end = min(nxt[0] if nxt else 1e18, fl['ts'] + 30)
            row = {}
            for r in ('r0', 'r1'):
                for t, m in ev[r]:
                    if fl['ts'] <= t < end:
                        s = SW.match(m)
                        if s and s.group(1) == fl['rail']:
                            row[r] = ((t - fl['ts']) * 1e3, s.group(2).strip())
                            break
            rs, rp = [], 0
            for r in ('r0', 'r1'):
                for t, m in ev[r]:
                    if fl['ts'] <= t < end:
                        s = REC.match(m)
                        if s and s.group(2) == fl['rail']:
                            rs.append(float(s.group(1)))
                            rp += int(s.group(5))
            recov += rs
            replays += rp
            with_replay += 1 if rp > 0 else 0
            l0 = row.get('r0', (None, ''))[0]
            l1 = row.get('r1', (None, ''))[0]
            if l0 is None:
                miss0 += 1
            else:
                lat0.append(l0)
                after_cmd.append(l0 - fl['took'] / 1e3)
            if l1 is not None:
                lat1.append(l1)
            got = [x for x in (l0, l1) if x is not None]
            if not got:
                miss_any += 1
            else:
                first.append(min(got))
            if l0 is not None and l1 is not None:
                last.append(max(got))
            for r in ('r0', 'r1'):
                if r in row:
                    c = row[r][1]
                    causes['%s:%s' % (r, c)] = causes.get('%s:%s' % (r, c), 0) + 1
            out.write('%s\t%.6f\t%d\t%s\t%s\t%s\t%s\t%s\t%d\n' % (
                fl['rail'], fl['ts'], fl['took'], fmt(l0, 2), fmt(l1, 2),
                row.get('r0', (0, '-'))[1], row.get('r1', (0, '-'))[1],
                ','.join('%.3f' % x for x in rs) or '-', rp))
    tooks = [fl['took'] / 1e3 for fl in faults]
    print('n=%d' % len(faults))
    print('missed_rank0=%d' % miss0)
    print('missed_both=%d' % miss_any)
    for name, v in (('rank0', lat0), ('rank1', lat1), ('first', first), ('last', last),
                    ('recovery_s', recov), ('took_ms', tooks), ('rank0_after_cmd', after_cmd)):
        nd = 3 if name == 'recovery_s' else 1
        print('%s_n=%d %s_p50=%s %s_p99=%s %s_max=%s' % (name, len(v), name, fmt(pct(v, 50), nd),
              name, fmt(pct(v, 99), nd), name, fmt(max(v) if v else None, nd)))
    print('replayed=%d' % replays)
    print('faults_replayed=%d' % with_replay)
    print('causes=%s' % ','.join('%s=%d' % kv for kv in sorted(causes.items())))

def cmd_lofaults(args):
    """lofaults FILE...: in-process injector runs: 'detected after D ms' of the recovery lines
    (the injector knows the fault start) and recovery seconds."""
    det, rec, rep = [], [], 0
    for f in args:
        for t, m in events(f):
            s = REC.match(m)
            if s:
                rec.append(float(s.group(1)))
                det.append(float(s.group(4)))
                rep += int(s.group(5))
    print('n=%d det_p50=%s det_max=%s rec_p50=%s rec_max=%s replayed=%d' % (
        len(det), fmt(pct(det, 50)), fmt(max(det) if det else None), fmt(pct(rec, 50), 3),
        fmt(max(rec) if rec else None, 3), rep))

def cmd_pingpong(args):
    """pingpong FILE: 'mode size us' lines -> per size: rtt and xchg."""
    for line in open(args[0]):
        print(line.rstrip())

def cmd_small(args):
    """small R2CCL_ROWS PINGPONG_OUT [PLAIN_ROWS R2CCL_LO_ROWS]: per-size table; prints the
    worst ratios last as 'worst_rtt=X@SIZE worst_xchg=Y@SIZE [worst_plain=Z@SIZE]'."""
    def best(rows):   # the best (lowest) mean time per size over the passes
        b = {}
        for r in rows:
            b[r['size']] = min(b.get(r['size'], 1e18), r['us'])
        return b
    r2 = best(perf_rows(args[0]))
    pp = {}
    try:
        for line in open(args[1]):
            f = line.split()
            if len(f) == 3:
                d = pp.setdefault(int(f[1]), {})
                d[f[0]] = min(d.get(f[0], 1e18), float(f[2]))
    except OSError:
        pass
    plain = lo = {}
    if len(args) > 3:
        plain = best(perf_rows(args[2]))
        lo = best(perf_rows(args[3]))
    wr = wx = wp = (0, None)
    print('| size (B) | r2ccl sendrecv (us) | TCP ping-pong RTT (us) | r2ccl / RTT | TCP exchange (us) '
          '| r2ccl / exchange | loopback: r2ccl (us) | loopback: plaintcp (us) | r2ccl / plaintcp |')
    print('|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    for s in sorted(r2):
        if s not in pp or 'rtt' not in pp[s]:
            continue
        a, rtt, x = r2[s], pp[s]['rtt'], pp[s].get('xchg')
        q1 = a / rtt if rtt else None
        q2 = a / x if x else None
        q3 = lo[s] / plain[s] if s in lo and s in plain and plain[s] else None
        if q1 is not None and q1 > wr[0]:
            wr = (q1, s)
        if q2 is not None and q2 > wx[0]:
            wx = (q2, s)
        if q3 is not None and q3 > wp[0]:
            wp = (q3, s)
        print('| %d | %.1f | %.1f | %s | %s | %s | %s | %s | %s |' % (
            s, a, rtt, fmt(q1, 2), fmt(x), fmt(q2, 2), fmt(lo.get(s)), fmt(plain.get(s)), fmt(q3, 2)))
    print('worst_rtt=%s@%s worst_xchg=%s@%s worst_plain=%s@%s' % (
        fmt(wr[0] or None, 2), wr[1], fmt(wx[0] or None, 2), wx[1], fmt(wp[0] or None, 2), wp[1]))

def cmd_table(args):
    """table TSV COMMIT: the Markdown results table."""
    print('| # | measurement | target | measured | result | commit | command | raw log |')
    print('|---|---|---|---|---|---|---|---|')
    for i, line in enumerate(open(args[0]), 1):
        f = line.rstrip('\n').split('\t')
        if len(f) < 6:
            continue
        print('| %d | %s | %s | %s | %s | %s | `%s` | %s |' % (i, f[0], f[1], f[2], f[3], args[1],
                                                             f[4].replace('`', "'"), f[5]))

# A python ping-pong, used only when no C compiler is around.
def cmd_pypp(args):
    import socket
    role = args[0]
    if role == 'server':
        ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((args[1], int(args[2]))); ls.listen(1)
        c, _ = ls.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            h = b''
            while len(h) < 12:
                x = c.recv(12 - len(h))
                if not x:
                    return
                h += x
            mode, size, n = int.from_bytes(h[:4], 'little'), int.from_bytes(h[4:8], 'little'), int.from_bytes(h[8:], 'little')
            buf = b'x' * size
            for _ in range(n):
                if mode == 1:
                    c.sendall(buf)
                got = 0
                while got < size:
                    got += len(c.recv(size - got))
                if mode == 0:
                    c.sendall(buf)
    else:
        host, port, iters, warm = args[1], int(args[2]), int(args[3]), int(args[4])
        sizes = [int(s) for s in args[5].split(',')]
        c = socket.create_connection((host, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for mode, name in ((0, 'rtt'), (1, 'xchg')) * int(args[6]):
            for size in sizes:
                buf = b'x' * size
                c.sendall(mode.to_bytes(4, 'little') + size.to_bytes(4, 'little') + (iters + warm).to_bytes(4, 'little'))
                for i in range(iters + warm):
                    if i == warm:
                        t0 = time.monotonic()
                    c.sendall(buf)
                    got = 0
                    while got < size:
                        got += len(c.recv(size - got))
                print(name, size, '%.2f' % ((time.monotonic() - t0) / iters * 1e6))
                sys.stdout.flush()

if __name__ == '__main__':
    globals()['cmd_' + sys.argv[1]](sys.argv[2:])
PYEOF
H() { python3 "$HELPER" "$@"; }

# ------------------------------------------------------------------------------- ping-pong (C)
# A plain TCP reference for small messages, the best a single socket does: TCP_NODELAY,
# non-blocking socket, busy polling (r2ccl_perf polls too). Two modes per size:
#   rtt   the client sends SIZE bytes, the server sends SIZE bytes back: one round trip.
#   xchg  both ends send SIZE bytes and receive SIZE bytes at once, as a sendrecv between two
#         ranks does over a bare socket: about a one-way time per iteration.
PP_SRC=$OUT/pingpong.c
cat >"$PP_SRC" <<'CEOF'
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static void die(const char* w) { perror(w); exit(1); }
/* send and receive `size` bytes each, concurrently (either may be 0), busy polling */
static void xfer(int fd, char* sb, size_t ss, char* rb, size_t rs) {
  size_t s = 0, r = 0;
  while (s < ss || r < rs) {
    if (s < ss) {
      ssize_t n = send(fd, sb + s, ss - s, MSG_NOSIGNAL);
      if (n > 0) s += (size_t)n;
      else if (n < 0 && errno != EAGAIN && errno != EINTR) die("send");
    }
    if (r < rs) {
      ssize_t n = recv(fd, rb + r, rs - r, 0);
      if (n > 0) r += (size_t)n;
      else if (n == 0) exit(0);
      else if (errno != EAGAIN && errno != EINTR) die("recv");
    }
  }
}
static void hdr(int fd, uint32_t* h, int out) {
  if (out) xfer(fd, (char*)h, 12, NULL, 0);
  else xfer(fd, NULL, 0, (char*)h, 12);
}
int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "pingpong server ADDR PORT | client ADDR PORT ITERS WARMUP SIZES PASSES\n");
    return 2;
  }
  struct sockaddr_in a;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)atoi(argv[3]));
  if (inet_pton(AF_INET, argv[2], &a.sin_addr) != 1) die("address");
  int one = 1, fd;
  char* sb = calloc(1, 1 << 24);
  char* rb = calloc(1, 1 << 24);
  if (!strcmp(argv[1], "server")) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(l, (struct sockaddr*)&a, sizeof(a)) || listen(l, 1)) die("bind/listen");
    fd = accept(l, NULL, NULL);
    if (fd < 0) die("accept");
  } else {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr*)&a, sizeof(a))) die("connect");
  }
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  if (!strcmp(argv[1], "server")) {
    for (;;) {
      uint32_t h[3];
      hdr(fd, h, 0);
      for (uint32_t i = 0; i < h[2]; i++) {
        if (h[0] == 0) {
          xfer(fd, NULL, 0, rb, h[1]);
          xfer(fd, sb, h[1], NULL, 0);
        } else {
          xfer(fd, sb, h[1], rb, h[1]);
        }
      }
    }
  }
  if (argc < 8) return 2;
  int iters = atoi(argv[4]), warm = atoi(argv[5]), passes = atoi(argv[7]);
  const char* modes[2] = {"rtt", "xchg"};
  for (int pass = 0; pass < passes; pass++)
  for (uint32_t m = 0; m < 2; m++) {
    char* list = strdup(argv[6]);
    for (char* t = strtok(list, ","); t; t = strtok(NULL, ",")) {
      uint32_t size = (uint32_t)atol(t);
      uint32_t h[3] = {m, size, (uint32_t)(iters + warm)};
      hdr(fd, h, 1);
      double t0 = 0;
      for (int i = 0; i < iters + warm; i++) {
        if (i == warm) t0 = now_us();
        if (m == 0) {
          xfer(fd, sb, size, NULL, 0);
          xfer(fd, NULL, 0, rb, size);
        } else {
          xfer(fd, sb, size, rb, size);
        }
      }
      printf("%s %u %.2f\n", modes[m], size, (now_us() - t0) / iters);
      fflush(stdout);
    }
    free(list);
  }
  return 0;
}
CEOF
PINGPONG=
if command -v cc >/dev/null && cc -O2 -o "$OUT/pingpong" "$PP_SRC" 2>"$OUT/pingpong.build.log"; then
  PINGPONG=$OUT/pingpong
fi

# ------------------------------------------------------------------------------- runners
PERF_TIMEOUT=300
# short_cmd ENV... -- ARGS...: the command as shown in the table
short_cmd() {
  local s=""
  while [ $# -gt 0 ] && [ "$1" != -- ]; do s+="$1 "; shift; done
  shift
  echo "${s}r2ccl_perf $*"
}
# run_pair DIR ENV... -- ARGS...: one r2ccl_perf job of 2 ranks. Lab: rank 0 in side a, rank 1
# in side b, rendezvous over oob; loopback: --ranks 2 (forked). rank0.out gets rank 0's table
# with a CLOCK_MONOTONIC prefix per line. Plugin lines go to $PLUGIN_LOG_DIR (default DIR)
# plugin.r0.log / plugin.r1.log (loopback: plugin.lo.log). Returns the worst exit status.
run_pair() {
  local dir=$1; shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  mkdir -p "$dir"
  local pl=${PLUGIN_LOG_DIR:-$dir}
  local rc0 rc1=0
  if [ $MODE = lab ]; then
    PORT=$((PORT + 1))
    local common=(--timeout "$PERF_TIMEOUT" --rendezvous "$RDV_HOST:$PORT" --nranks 2)
    {
      echo "# $(date -Is) load $(loadavg) commit $COMMIT"
      echo "ip netns exec $NB env ${envs[*]} R2CCL_LOG_FILE=$pl/plugin.r1.log $PERF ${common[*]} --rank 1 $*"
      echo "ip netns exec $NA env ${envs[*]} R2CCL_LOG_FILE=$pl/plugin.r0.log $PERF ${common[*]} --rank 0 $*"
    } >>"$dir/cmd.txt"
    ip netns exec "$NB" env "${envs[@]}" R2CCL_LOG_FILE="$pl/plugin.r1.log" "$PERF" "${common[@]}" \
      --rank 1 "$@" >>"$dir/rank1.out" 2>&1 &
    local p1=$!
    echo $p1 >>"$OUT/.pids"
    ip netns exec "$NA" env "${envs[@]}" R2CCL_LOG_FILE="$pl/plugin.r0.log" "$PERF" "${common[@]}" \
      --rank 0 "$@" 2>>"$dir/rank0.err" | python3 -u "$HELPER" tsfilter >>"$dir/rank0.out"
    rc0=${PIPESTATUS[0]}
    wait $p1
    rc1=$?
  else
    {
      echo "# $(date -Is) load $(loadavg) commit $COMMIT"
      echo "env ${envs[*]} R2CCL_LOG_FILE=$pl/plugin.lo.log $PERF --timeout $PERF_TIMEOUT --ranks 2 $*"
    } >>"$dir/cmd.txt"
    env "${envs[@]}" R2CCL_LOG_FILE="$pl/plugin.lo.log" "$PERF" --timeout "$PERF_TIMEOUT" --ranks 2 "$@" \
      2>>"$dir/rank0.err" | python3 -u "$HELPER" tsfilter >>"$dir/rank0.out"
    rc0=${PIPESTATUS[0]}
  fi
  local rc=$((rc0 > rc1 ? rc0 : rc1))
  echo "rc $rc (rank0 $rc0, rank1 $rc1)" >>"$dir/cmd.txt"
  return $rc
}
# check_run DIR RC WHAT: a run that failed or has wrong elements is "broken"
check_run() {
  local dir=$1 rc=$2 what=$3
  local w
  w=$(grep -h '# wrong total:' "$dir/rank0.out" 2>/dev/null | tail -1 | awk '{print $5}')
  if [ "$rc" -ne 0 ]; then
    broke "$what: r2ccl_perf exited $rc (see ${dir#"$OUT"/}/rank0.err, rank0.out, rank1.out)"
    return 1
  fi
  if [ -n "$w" ] && [ "$w" != 0 ]; then
    broke "$what: $w wrong elements"
    return 1
  fi
  return 0
}

# iperf_run DIR SECS RAIL...: iperf3 from side a to side b on each RAIL at once (one stream
# each), receiver Gbit/s. Prints "g1 g2 ... sum" (nan when a run failed).
IPERF_OMIT=1
[ $SMOKE -eq 1 ] && IPERF_OMIT=0
iperf_run() {
  local dir=$1 secs=$2; shift 2
  mkdir -p "$dir"
  local r pids=() files=() tag
  tag=$(date +%H%M%S)-$RANDOM
  if [ $MODE = lab ]; then
    for r in "$@"; do
      ip netns exec "$NB" iperf3 -s -1 -B "10.210.$r.2" -p $((5300 + r)) >"$dir/iperf-server-rail$r-$tag.log" 2>&1 &
      pids+=($!)
      echo $! >>"$OUT/.pids"
    done
    sleep 0.5
    local cpids=()
    for r in "$@"; do
      echo "ip netns exec $NA iperf3 -c 10.210.$r.2 -B 10.210.$r.1 -p $((5300 + r)) -t $secs -O $IPERF_OMIT -J ${IPERF_BIDIR:+--bidir}" >>"$dir/cmd.txt"
      ip netns exec "$NA" iperf3 -c "10.210.$r.2" -B "10.210.$r.1" -p $((5300 + r)) -t "$secs" \
        -O "$IPERF_OMIT" -J ${IPERF_BIDIR:+--bidir} >"$dir/iperf-rail$r-$tag.json" 2>"$dir/iperf-rail$r-$tag.err" &
      cpids+=($!)
      files+=("$dir/iperf-rail$r-$tag.json")
    done
    for r in "${cpids[@]}"; do wait "$r"; done
    for r in "${pids[@]}"; do wait "$r" 2>/dev/null; done
  else
    local port=$((5300 + RANDOM % 1000))
    iperf3 -s -1 -B 127.0.0.1 -p $port >"$dir/iperf-server-lo-$tag.log" 2>&1 &
    pids+=($!)
    echo $! >>"$OUT/.pids"
    sleep 0.5
    echo "iperf3 -c 127.0.0.1 -p $port -t $secs -O $IPERF_OMIT -J" >>"$dir/cmd.txt"
    iperf3 -c 127.0.0.1 -p $port -t "$secs" -O "$IPERF_OMIT" -J >"$dir/iperf-lo-$tag.json" 2>"$dir/iperf-lo-$tag.err"
    files+=("$dir/iperf-lo-$tag.json")
    wait "${pids[0]}" 2>/dev/null
  fi
  H iperf "${files[@]}" | tr '\n' ' '
}
ratio() { python3 -c "import sys,math; a,b=float(sys.argv[1]),float(sys.argv[2]); print('nan' if (b==0 or math.isnan(a) or math.isnan(b)) else '%.3f'%(a/b))" "$1" "$2"; }
ge() { python3 -c "import sys,math; a,b=float(sys.argv[1]),float(sys.argv[2]); sys.exit(0 if not math.isnan(a) and a>=b else 1)" "$1" "$2"; }
le() { python3 -c "import sys,math; a,b=float(sys.argv[1]),float(sys.argv[2]); sys.exit(0 if not math.isnan(a) and a<=b else 1)" "$1" "$2"; }
verdict_ge() { if [ "$1" = nan ]; then echo n/a; elif ge "$1" "$2"; then echo ok; else echo MISS; fi; }
verdict_le() { if [ "$1" = nan ] || [ "$1" = n/a ]; then echo n/a; elif le "$1" "$2"; then echo ok; else echo MISS; fi; }
kv() { sed -n "s/.*\\b$1=\\([^ ]*\\).*/\\1/p" | head -1; }   # kv KEY < "a=1 b=2"

lab_up() {  # lab_up [RATE[,RATE...]] [RAILS]
  local n=${2:-2}
  local args=(up --rails "$n" --prefix "$PREFIX")
  [ -n "${1:-}" ] && args+=(--rate "$1")
  if ! bash "$RAILAB" "${args[@]}" >>"$OUT/railab.log" 2>&1; then
    broke "railab.sh ${args[*]} failed (see railab.log)"
    return 1
  fi
  LAB_UP=1
  log "lab $PREFIX up: $n rails${1:+, $1}"
}
# fault KIND RAIL: prints "TS TOOK_US" from railab.sh's fault line (side a)
fault() {
  local line
  line=$(bash "$RAILAB" fault "$1" "$2" --prefix "$PREFIX" 2>&1)
  echo "$line" >>"$OUT/railab.log"
  sed -n 's/^\[\([0-9.]*\)\] \[railab\].* took_us=\([0-9]*\).*/\1 \2/p' <<<"$line" | head -1
}
undo_kind() { case $1 in link-down) echo link-up ;; far-down) echo far-up ;; blackhole) echo unblackhole ;; esac; }

# ------------------------------------------------------------------------------- traffic loop
# traffic_loop DIR RUNSECS ENV... -- ARGS...: r2ccl_perf jobs back to back (each with --repeat
# sized to about RUNSECS, from the previous job's pace) until DIR/stop exists. Every job ends
# by itself, so every one of them reports its #wrong count. Plugin lines of all jobs go to
# DIR/plugin.r0.log / plugin.r1.log. Job k: DIR/run<k>/{repeat,rc,rank0.out,...}.
traffic_loop() {
  local dir=$1 runsecs=$2; shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local n=0 R=${TRAFFIC_R0:-4} rc pace=0 to
  while [ ! -e "$dir/stop" ]; do
    while [ -e "$dir/hold" ] && [ ! -e "$dir/stop" ]; do sleep 0.1; done   # no new job mid-fault
    [ -e "$dir/stop" ] && break
    n=$((n + 1))
    mkdir -p "$dir/run$n"
    echo "$R" >"$dir/run$n/repeat"
    echo "$n" >"$dir/current"
    # --timeout: 3x the expected length (from the last good job's pace) + 2 min: only a hang hits it
    to=$(python3 -c "import sys; p=float(sys.argv[1]); print(int(3 * int(sys.argv[2]) * p + 120) if p > 0 else int(sys.argv[3]) * 3 + 120)" "$pace" "$R" "$runsecs")
    echo "$to" >"$dir/run$n/timeout"
    PLUGIN_LOG_DIR=$dir PERF_TIMEOUT=$to run_pair "$dir/run$n" "${envs[@]}" -- "$@" --repeat "$R"
    rc=$?
    echo "$rc" >"$dir/run$n/rc"
    if [ "$rc" -eq 0 ]; then   # size the next job from this one's pace (a failed job says nothing)
      pace=$(H pace "$dir/run$n/rank0.out")
      R=$(python3 -c "import sys; p=float(sys.argv[1]); print(max(4, int(float(sys.argv[2]) / p)) if p > 0 else int(sys.argv[3]))" "$pace" "$runsecs" "$R")
    else
      sleep 1   # a failed job: do not spin
    fi
  done
}
# traffic_check DIR WHAT: every job of a traffic loop: exit status and wrong elements.
# Sets TRAFFIC_SUMMARY ("K jobs, P passes, W wrong, F failed").
traffic_check() {
  local dir=$1 what=$2 d rc jobs=0 passes=0 wrong=0 failed=0 r
  for d in "$dir"/run*; do
    [ -d "$d" ] || continue
    jobs=$((jobs + 1))
    rc=$(cat "$d/rc" 2>/dev/null || echo 1)
    r=$(H perf "$d/rank0.out")
    passes=$((passes + $(awk '{print $2}' <<<"$r")))
    wrong=$((wrong + $(awk '{print $8}' <<<"$r")))
    if [ "$rc" -ne 0 ]; then
      failed=$((failed + 1))
      check_run "$d" "$rc" "$what (${d#"$OUT"/})"
    elif [ "$(awk '{print $8}' <<<"$r")" != 0 ]; then
      check_run "$d" 0 "$what (${d#"$OUT"/})"
    fi
  done
  TRAFFIC_SUMMARY="$jobs jobs, $passes passes, $wrong wrong, $failed failed"
}
# wait_flowing DIR NEED_S: the current job has printed 2 rows and, at its pace, runs NEED_S more
# seconds (so the fault and the recovery happen inside one job). Gives up after WAIT_S (a
# hung job ends at its --timeout, then the loop starts the next one).
wait_flowing() {
  local dir=$1 need=$2 end=$((SECONDS + ${3:-240}))
  while [ $SECONDS -lt $end ]; do
    [ "$(H flowing "$dir" "$need")" = 1 ] && return 0
    sleep 0.2
  done
  return 1
}

# ------------------------------------------------------------------------------- measurements
# Throughput rows: r2ccl sendrecv of SIZE on one rail, and striped over 2 rails, against iperf3
# run just before and just after (mean of the two).
# mean_of X...: the mean of the values that are not "nan" (3 decimals), or nan.
mean_of() {
  python3 -c "import sys; v=[float(x) for x in sys.argv[1:] if x!='nan']; print('%.3f'%(sum(v)/len(v)) if v else 'nan')" "$@"
}

# iperf_text FULL SMOKE: what a throughput row says of its iperf3 runs: FULL, or in a smoke run
# (one iperf3 run before, none after and no --bidir) SMOKE and that.
iperf_text() {
  if [ $SMOKE -eq 1 ]; then echo "$2; smoke: iperf3 once, before, and no --bidir"; else echo "$1"; fi
}

tput_rows() {  # tput_rows TAG TARGETED(1|0)
  local tag=$1 targeted=$2 d cmd r g before after ref q t1 t2
  local size=64M iters=20 secs=8 twice=1
  if [ $SMOKE -eq 1 ]; then size=16M; iters=3; secs=1; twice=0; fi
  # one rail
  d=$OUT/tput-1rail-$(slug "$tag")
  local env1=(R2CCL_SOCKET_IFNAME=rail0)
  [ $MODE = lo ] && env1=(R2CCL_SOCKET_IFNAME=lo@127.0.0.1)
  # Timed iterations back to back (--check 0, as nccl-tests times them); a short --check run
  # of the same shape before each timed one verifies the data.
  local args=(--op sendrecv -b "$size" -e "$size" -n "$iters" -w 2 --check 0)
  local cargs=(--op sendrecv -b "$size" -e "$size" -n 2 -w 1 --check)
  log "throughput, one rail ($tag): r2ccl --check, iperf3, r2ccl, iperf3"
  run_pair "$d/check" "${env1[@]}" -- "${cargs[@]}"
  check_run "$d/check" $? "1-rail data check ($tag)"
  before=$(iperf_run "$d" $secs 0 | awk '{print $NF}')
  local bidir=nan bq=n/a
  [ $twice = 1 ] && [ $MODE = lab ] && bidir=$(IPERF_BIDIR=1 iperf_run "$d" $secs 0 | awk '{print $NF}')
  run_pair "$d" "${env1[@]}" -- "${args[@]}"
  check_run "$d" $? "1-rail throughput ($tag)"
  after=nan
  [ $twice = 1 ] && after=$(iperf_run "$d" $secs 0 | awk '{print $NF}')
  r=$(H perf "$d/rank0.out")
  g=$(awk '{print $4}' <<<"$r")
  ref=$(mean_of "$before" "$after")
  q=$(ratio "$g" "$ref")
  [ "$bidir" != nan ] && bq=$(ratio "$g" "$bidir")
  cmd="$(short_cmd "${env1[@]}" -- "${args[@]}") (after the same with -n 2 --check); iperf3 -t $secs -O $IPERF_OMIT on rail0 before+after (and --bidir)"
  if [ "$targeted" = 1 ] && [ $MODE = lab ]; then t1=">= 0.99x iperf3"; r=$(verdict_ge "$q" 0.99); else t1="(info: CPU limits)"; r=info; fi
  [ $MODE = lo ] && t1="(loopback: info only)"
  add_row "SendRecv $size, one rail ($tag): r2ccl vs iperf3" "$t1" \
    "${q}x: r2ccl $g Gbit/s, iperf3 $ref Gbit/s ($(iperf_text "before $before, after $after; iperf3 --bidir $bidir Gbit/s per direction (r2ccl ${bq}x)" "before $before"))" "$r" "$cmd" "${d}/"
  # one direction, 1 MiB messages (issue 16: the transport's CPU cost per byte against one
  # iperf3 stream in the same run; unshaped, both are CPU-bound on 2 cores)
  d=$OUT/tput-1way-$(slug "$tag")
  # A stream of 1 MiB messages, as iperf3 streams: the timed run's iterations go back to back
  # (--check 0, as nccl-tests times them) for 2 GiB, a few seconds like iperf3's; a short
  # --check run before it verifies the data. (Timing one verified iteration at a time adds a
  # barrier and an idle pipe per message, and lets a tbf bucket refill between messages; a
  # run of 200 MiB lasted 0.3 s, within reach of the processes' start-up.)
  local n1=2000 nc=20
  [ $SMOKE -eq 1 ] && n1=50 && nc=5
  local args1=(--op send -b 1M -e 1M -n $n1 -w 20 --check 0)
  log "throughput, one direction, one rail ($tag): r2ccl --check, iperf3, r2ccl, iperf3"
  run_pair "$d/check" "${env1[@]}" -- --op send -b 1M -e 1M -n $nc -w 2 --check
  check_run "$d/check" $? "1-rail one-direction data check ($tag)"
  before=$(iperf_run "$d" $secs 0 | awk '{print $NF}')
  run_pair "$d" "${env1[@]}" -- "${args1[@]}"
  check_run "$d" $? "1-rail one-direction throughput ($tag)"
  after=nan
  [ $twice = 1 ] && after=$(iperf_run "$d" $secs 0 | awk '{print $NF}')
  g=$(H perf "$d/rank0.out" | awk '{print $4}')
  ref=$(mean_of "$before" "$after")
  q=$(ratio "$g" "$ref")
  cmd="$(short_cmd "${env1[@]}" -- "${args1[@]}") (after the same with -n $nc --check); iperf3 -t $secs -O $IPERF_OMIT on rail0 before+after"
  if [ $MODE = lab ]; then t1=">= 0.9x iperf3"; r=$(verdict_ge "$q" 0.9); else t1="(loopback: info only)"; r=info; fi
  add_row "Send 1M, one direction, one rail ($tag): r2ccl vs one iperf3 stream" "$t1" \
    "${q}x: r2ccl $g Gbit/s, iperf3 $ref Gbit/s ($(iperf_text "before $before, after $after" "before $before"))" "$r" "$cmd" "${d}/"
  # stripe over 2 rails
  d=$OUT/tput-stripe-$(slug "$tag")
  local env2=(R2CCL_SOCKET_IFNAME=rail R2CCL_STRIPE=1)
  [ $MODE = lo ] && env2=(R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2 R2CCL_STRIPE=1)
  log "throughput, stripe over 2 rails ($tag): r2ccl --check, iperf3, iperf3 --bidir, r2ccl, iperf3"
  run_pair "$d/check" "${env2[@]}" -- "${cargs[@]}"
  check_run "$d/check" $? "stripe data check ($tag)"
  if [ $MODE = lab ]; then before=$(iperf_run "$d" $secs 0 1 | sed 's/ *$//'); else before="n/a n/a nan"; fi
  bidir="n/a n/a nan"; bq=n/a
  [ $twice = 1 ] && [ $MODE = lab ] && bidir=$(IPERF_BIDIR=1 iperf_run "$d" $secs 0 1 | sed 's/ *$//')
  run_pair "$d" "${env2[@]}" -- "${args[@]}"
  check_run "$d" $? "stripe throughput ($tag)"
  after="n/a n/a nan"
  if [ $MODE = lab ] && [ $twice = 1 ]; then after=$(iperf_run "$d" $secs 0 1 | sed 's/ *$//'); fi
  r=$(H perf "$d/rank0.out")
  g=$(awk '{print $4}' <<<"$r")
  ref=$(mean_of "$(awk '{print $NF}' <<<"$before")" "$(awk '{print $NF}' <<<"$after")")
  q=$(ratio "$g" "$ref")
  [ "${bidir##* }" != nan ] && bq=$(ratio "$g" "${bidir##* }")
  cmd="$(short_cmd "${env2[@]}" -- "${args[@]}") (after the same with -n 2 --check); iperf3 on rail0 and rail1 at once, before+after (and --bidir)"
  if [ "$targeted" = 1 ] && [ $MODE = lab ]; then t2=">= 0.9x iperf3 sum"; r=$(verdict_ge "$q" 0.9); else t2="(info: CPU limits)"; r=info; fi
  [ $MODE = lo ] && { t2="(loopback: info only)"; q=n/a; }
  add_row "SendRecv $size, stripe 2 rails ($tag): r2ccl vs iperf3 on both" "$t2" \
    "${q}x: r2ccl $g Gbit/s, iperf3 sum $ref Gbit/s ($(iperf_text "per rail before: ${before% *}; after: ${after% *}; iperf3 --bidir sum ${bidir##* } Gbit/s per direction (r2ccl ${bq}x)" "per rail: ${before% *}"))" "$r" "$cmd" "${d}/"
  # Issue 16 part 4: the same sendrecv (both directions at once) against iperf3 --bidir on
  # both rails at once, per direction, in the same run.
  if [ $MODE = lab ] && [ $twice = 1 ]; then
    if [ "$targeted" = 1 ]; then t2=">= 0.95x iperf3 --bidir"; r=$(verdict_ge "$bq" 0.95); else t2="(info: CPU limits)"; r=info; fi
    add_row "SendRecv $size, stripe 2 rails, both directions ($tag): r2ccl vs iperf3 --bidir on both" "$t2" \
      "${bq}x: r2ccl $g Gbit/s per direction, iperf3 --bidir on rail0 and rail1 at once ${bidir##* } Gbit/s per direction (per rail: ${bidir% *})" "$r" "$cmd" "${d}/"
  fi
}

small_rows() {
  local d=$OUT/small iters=500 warm=50 ppiters=1000 passes=3
  [ $SMOKE -eq 1 ] && { iters=20; warm=2; ppiters=50; passes=1; }
  local sizes
  sizes=$(python3 -c "print(','.join(str(8<<i) for i in range(14)))")   # 8 B .. 64 KiB
  local args=(--op sendrecv -b 8 -e 64K -f 2 -n "$iters" -w "$warm" --repeat "$passes")
  local env=(R2CCL_SOCKET_IFNAME=rail)
  [ $MODE = lo ] && env=(R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2)
  mkdir -p "$d"
  log "small messages: r2ccl sendrecv, plain TCP ping-pong/exchange, loopback r2ccl vs plaintcp"
  run_pair "$d/r2ccl" "${env[@]}" -- "${args[@]}"
  check_run "$d/r2ccl" $? "small messages"
  run_pair "$d/r2ccl-check" "${env[@]}" -- --op sendrecv -b 8 -e 64K -f 2 -n 5 -w 1 --check
  check_run "$d/r2ccl-check" $? "small messages (--check)"
  # plain TCP reference over the same rail (lab: rail0, side a -> side b)
  local srv_ns=() cli_ns=() addr=127.0.0.1 pport=$((5400 + RANDOM % 500))
  if [ $MODE = lab ]; then srv_ns=(ip netns exec "$NB"); cli_ns=(ip netns exec "$NA"); addr=10.210.0.2; fi
  local pp=("$PINGPONG") ppname="C ping-pong ($PINGPONG)"
  [ -n "$PINGPONG" ] || { pp=(python3 "$HELPER" pypp); ppname="python3 ping-pong (no C compiler)"; }
  echo "${srv_ns[*]} ${pp[*]} server $addr $pport & ${cli_ns[*]} ${pp[*]} client $addr $pport $ppiters $((ppiters / 10)) $sizes $passes" >"$d/pingpong.cmd"
  "${srv_ns[@]}" "${pp[@]}" server $addr $pport >"$d/pingpong.server.log" 2>&1 &
  local spid=$!
  echo $spid >>"$OUT/.pids"
  sleep 0.3
  "${cli_ns[@]}" "${pp[@]}" client $addr $pport $ppiters $((ppiters / 10)) "$sizes" $passes >"$d/pingpong.out" 2>"$d/pingpong.err"
  local prc=$?
  kill $spid 2>/dev/null; wait $spid 2>/dev/null
  [ $prc -ne 0 ] && log "ping-pong failed (rc $prc, see small/pingpong.err): small-message row is n/a"
  # same driver, loopback: r2ccl (2 rails on lo) vs the plaintcp baseline plugin
  local lo_ns=()
  [ $MODE = lab ] && lo_ns=(ip netns exec "$NA")
  echo "${lo_ns[*]} $PERF --plugin $PLAIN_SO --ranks 2 ${args[*]}" >"$d/loopback.cmd"
  echo "${lo_ns[*]} env R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2 $PERF --ranks 2 ${args[*]}" >>"$d/loopback.cmd"
  "${lo_ns[@]}" "$PERF" --plugin "$PLAIN_SO" --timeout 120 --ranks 2 "${args[@]}" >"$d/plaintcp-lo.out" 2>&1 ||
    broke "plaintcp loopback run failed (small/plaintcp-lo.out)"
  "${lo_ns[@]}" env R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2 R2CCL_LOG_FILE="$d/plugin.lo.log" \
    "$PERF" --timeout 120 --ranks 2 "${args[@]}" >"$d/r2ccl-lo.out" 2>&1 ||
    broke "r2ccl loopback small-message run failed (small/r2ccl-lo.out)"
  H small "$d/r2ccl/rank0.out" "$d/pingpong.out" "$d/plaintcp-lo.out" "$d/r2ccl-lo.out" >"$d/table.md"
  local w wr wx wp
  w=$(tail -1 "$d/table.md")
  wr=$(kv worst_rtt <<<"$w"); wx=$(kv worst_xchg <<<"$w"); wp=$(kv worst_plain <<<"$w")
  local where="rail0"
  [ $MODE = lo ] && where="loopback"
  add_row "Small messages 8 B-64 KiB over $where: r2ccl sendrecv time / plain TCP ping-pong RTT, worst size" \
    "<= 1.2x" "${wr%@*}x at ${wr#*@} B (per-size table: small/table.md)" \
    "$([ $MODE = lo ] && echo info || verdict_le "${wr%@*}" 1.2)" \
    "$(short_cmd "${env[@]}" -- "${args[@]}") vs $ppname" "small/table.md"
  add_row "Small messages: r2ccl sendrecv time / plain TCP exchange (both ends send+recv at once, ~one-way), worst size" \
    "(info)" "${wx%@*}x at ${wx#*@} B" info "same runs as the row above" "small/table.md"
  add_row "Small messages, loopback, same driver: r2ccl / plaintcp baseline plugin sendrecv time, worst size" \
    "(info)" "${wp%@*}x at ${wp#*@} B" info "r2ccl_perf [--plugin plaintcp] --ranks 2 ${args[*]}" "small/table.md"
}

# Traffic for the fault series and the fault-free run: the default r2ccl configuration
# (primary path + preheated backup, no striping) with 2 channels, so that channel 0's primary
# is rail0 and channel 1's is rail1: a fault on either rail hits a primary (a switchover) and
# a backup (no switchover). 64 MiB sendrecv, every element checked.
TRAFFIC_ENV=(R2CCL_SOCKET_IFNAME=rail)
TRAFFIC_ARGS=(--op sendrecv --channels 2 -b 64M -e 64M -n 4 -w 1 --check)
if [ $SMOKE -eq 1 ]; then TRAFFIC_ARGS=(--op sendrecv --channels 2 -b 16M -e 16M -n 2 -w 1 --check); fi
if [ $MODE = lo ]; then TRAFFIC_ENV=(R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2); fi

pending() { H pending "$1" "$2" "$3"; }
sleep_until() {  # sleep_until EPOCHREALTIME
  local s
  s=$(python3 -c "import sys; print(max(0.0, float(sys.argv[1]) - float(sys.argv[2])))" "$1" "$EPOCHREALTIME")
  sleep "$s"
}

fault_rows_lab() {
  local d=$OUT/faults hold=1.0 spacing=6 runsecs=60 need=6 recmax=30
  [ $SMOKE -eq 1 ] && { hold=0.5; spacing=0; runsecs=8; need=3; recmax=10; }
  mkdir -p "$d"
  : >"$d/faults.tsv"
  log "fault series: $FAULTS x (link-down far-down blackhole), rails alternating, side a, hold ${hold}s, >= ${spacing}s apart, each after the previous rail is back"
  TRAFFIC_R0=$([ $SMOKE -eq 1 ] && echo 25 || echo 4) traffic_loop "$d" $runsecs "${TRAFFIC_ENV[@]}" -- "${TRAFFIC_ARGS[@]}" &
  local lp=$!
  echo $lp >>"$OUT/.pids"
  local last=0 kind i rail ts took uts end p
  for kind in link-down far-down blackhole; do
    for ((i = 0; i < FAULTS; i++)); do
      rail=$((i % 2))
      if ! wait_flowing "$d" $need; then
        broke "fault series: no traffic job running for 240 s (faults/run*/)"
        break 2
      fi
      sleep_until "$(python3 -c "import sys; print(float(sys.argv[1]) + $spacing)" "$last")"
      touch "$d/hold"
      read -r ts took < <(fault "$kind" $rail)
      last=$EPOCHREALTIME
      sleep $hold
      read -r uts _ < <(fault "$(undo_kind "$kind")" $rail)
      if [ -z "$ts" ] || [ -z "$uts" ]; then
        broke "railab.sh fault $kind/$(undo_kind "$kind") $rail failed (railab.log)"
        continue
      fi
      echo "$kind $rail $ts $took $uts" >>"$d/faults.tsv"
      end=$((SECONDS + recmax))
      while p=$(pending "$d" rail$rail "$ts") && [ "$p" -gt 0 ] && [ $SECONDS -lt $end ]; do sleep 0.25; done
      if [ "$p" -gt 0 ]; then
        log "rail$rail: $p path(s) not back $recmax s after $kind at $ts"
        echo "$kind rail$rail $ts: $p send path(s) without failback after ${recmax}s" >>"$d/not-back.txt"
      fi
      rm -f "$d/hold"
      [ $SMOKE -eq 1 ] || sleep 1
      log "  $kind rail$rail at $ts done ($((i + 1))/$FAULTS)"
    done
  done
  touch "$d/stop"
  wait $lp
  traffic_check "$d" "fault series"
  local target lim res r notback
  notback=0  # the file exists only when some rail did not come back
  [ -f "$d/not-back.txt" ] && notback=$(wc -l <"$d/not-back.txt")
  local rec=""
  for kind in link-down far-down blackhole; do
    r=$(H faults "$d" "$kind" | tr '\n' ' ')
    echo "$kind: $r" >>"$d/summary.txt"
    # The black hole (issue 16): timed from the drop rule in place, i.e. nft's own run time
    # excluded (the command's end); the other kinds from railab's stamp, as before.
    local key=rank0 since="railab fault stamp" extra=""
    case $kind in link-down) lim=20 ;; far-down) lim=200 ;; blackhole)
      lim=150 key=rank0_after_cmd since="end of the fault command (drop rule in place)"
      extra="; from the stamp: p50 $(kv rank0_p50 <<<"$r") / p99 $(kv rank0_p99 <<<"$r") ms" ;;
    esac
    target="p99 <= $lim ms"
    res=$(verdict_le "$(kv ${key}_p99 <<<"$r")" $lim)
    [ "$(kv missed_rank0 <<<"$r")" != 0 ] && res=MISS
    add_row "Switchover latency, $kind (side a), rank 0's switchover line - $since" "$target" \
      "p50 $(kv ${key}_p50 <<<"$r") / p99 $(kv ${key}_p99 <<<"$r") ms (n=$(kv rank0_n <<<"$r"), missed $(kv missed_rank0 <<<"$r"))$extra; rank 1 (side b, from the stamp): p50 $(kv rank1_p50 <<<"$r") / p99 $(kv rank1_p99 <<<"$r") ms (n=$(kv rank1_n <<<"$r")); fault command took p50 $(kv took_ms_p50 <<<"$r") ms; faults with replayed chunks $(kv faults_replayed <<<"$r")/$(kv n <<<"$r")" \
      "$res" "railab.sh fault $kind RAIL (rail 0,1,0,...), $(undo_kind "$kind") after ${hold}s; traffic: $(short_cmd "${TRAFFIC_ENV[@]}" -- "${TRAFFIC_ARGS[@]}") --repeat R" \
      "faults/latency-$kind.tsv"
    rec+="$kind p50 $(kv recovery_s_p50 <<<"$r") / p99 $(kv recovery_s_p99 <<<"$r") s (n=$(kv recovery_s_n <<<"$r"), $(kv replayed <<<"$r") chunks replayed); "
  done
  add_row "Recovery time ('Successfully recovered in X s', switchover to last replayed chunk acked)" "(info)" \
    "${rec% }" info "same fault series" "faults/summary.txt"
  add_row "Wrong bytes / failed jobs during the fault series; rails not back within ${recmax}s" "0 / 0 / 0" \
    "$TRAFFIC_SUMMARY; $notback not back" \
    "$([ "$(grep -c . "$OUT/broken.txt" 2>/dev/null || echo 0)" = 0 ] && [ "$notback" = 0 ] && echo ok || echo MISS)" \
    "same fault series" "faults/"
}

fault_rows_lo() {
  local d=$OUT/faults-lo
  local inj='rank=0,rail=0,at=300,kind=reset,for=700;rank=0,rail=1,at=2000,kind=blackhole,for=700'
  log "fault smoke (loopback, in-process injector): $inj"
  run_pair "$d" "${TRAFFIC_ENV[@]}" "R2CCL_FAULT_INJECT=$inj" -- --op sendrecv --channels 2 -b 4M -e 4M -n 10 -w 1 --check --repeat 30
  check_run "$d" $? "injector fault run"
  local r
  r=$(H lofaults "$d/plugin.lo.log")
  add_row "Switchover detection under the in-process injector (reset, blackhole), 'detected after' of the recovery lines" \
    "(loopback: info only)" "$r" info "R2CCL_FAULT_INJECT='$inj' r2ccl_perf --ranks 2 --op sendrecv --channels 2 -b 4M -e 4M -n 10 -w 1 --check --repeat 30" "faults-lo/"
}

# degraded_row TAG NAME DOWN_RAIL SURVIVOR TARGETED ENV... : throughput of the passes that started
# >= 1.5 s after rail DOWN_RAIL went down (link-down on side a, kept down to the end of the job)
# against iperf3 alone on the surviving rail.
degraded_row() {
  local tag=$1 name=$2 down=$3 surv=$4 targeted=$5; shift 5
  local envs=("$@") d
  d=$OUT/degraded-$(slug "$name-$tag")
  local size=64M rep=12 secs=6 settle=1.5
  [ $SMOKE -eq 1 ] && { size=16M; rep=9; secs=1; settle=0.5; }
  local args=(--op sendrecv -b "$size" -e "$size" -n 3 -w 1 --check --repeat "$rep")
  mkdir -p "$d"
  log "degraded throughput ($name, $tag): rail$down down mid-run"
  local ref
  ref=$(iperf_run "$d" $secs $surv | awk '{print $NF}')
  run_pair "$d" "${envs[@]}" -- "${args[@]}" &
  local p=$! end=$((SECONDS + 90)) ts took
  while [ "$(H rows "$d/rank0.out")" -lt 2 ] && [ $SECONDS -lt $end ] && kill -0 $p 2>/dev/null; do sleep 0.2; done
  read -r ts took < <(fault link-down "$down")
  echo "link-down $down $ts $took" >"$d/fault.txt"
  wait $p
  local rc=$?
  fault link-up "$down" >/dev/null
  check_run "$d" $rc "degraded throughput ($name, $tag)"
  local r g
  r=$(H degraded "$d/rank0.out" "${ts:-0}" "$settle")
  g=$(awk '{print $4}' <<<"$r")
  local q t res
  q=$(ratio "$g" "$ref")
  if [ "$targeted" = 1 ]; then t=">= 0.95x iperf3 on one rail"; res=$(verdict_ge "$q" 0.95); else t="(info: CPU limits)"; res=info; fi
  add_row "Throughput with 1 of 2 rails down, $name ($tag)" "$t" \
    "${q}x: r2ccl $g Gbit/s over $(awk '{print $2}' <<<"$r") passes after the fault (before: $(awk '{print $8}' <<<"$r") Gbit/s), iperf3 rail$surv $ref Gbit/s" \
    "$res" "$(short_cmd "${envs[@]}" -- "${args[@]}"); railab.sh fault link-down $down after 2 passes" "${d}/"
  sleep 2   # let the rail come back before the next measurement
}

degraded_lo() {
  local d=$OUT/degraded-lo
  local env=(R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2 R2CCL_STRIPE=1 "R2CCL_FAULT_INJECT=rank=-1,rail=1,at=500,kind=reset")
  local args=(--op sendrecv -b 16M -e 16M -n 4 -w 1 --check --repeat 20)
  log "degraded throughput smoke (loopback, injector reset of rail 1 at 0.5 s)"
  run_pair "$d" "${env[@]}" -- "${args[@]}"
  check_run "$d" $? "degraded smoke"
  local ts r
  ts=$(H count "$d/plugin.lo.log" | awk '$1=="first_ts"{print $2}')
  [ "$ts" = none ] && ts=0
  r=$(H degraded "$d/rank0.out" "$ts" 0.5)
  add_row "Throughput with 1 of 2 rails down (stripe, loopback, injector)" "(loopback: info only)" \
    "after the fault $(awk '{print $4}' <<<"$r") Gbit/s ($(awk '{print $2}' <<<"$r") passes), before $(awk '{print $8}' <<<"$r") Gbit/s" \
    info "$(short_cmd "${env[@]}" -- "${args[@]}")" "degraded-lo/"
}

# ------------------------------------------------------------------ issue 16: unequal rails
# unequal_rows: the lab is 2 rails shaped 2gbit and 500mbit. r2ccl striped over both against
# iperf3 on both at once (before and after), and r2ccl on the fast rail alone.
UNEQ_RATES=${R2CCL_BENCH_UNEQ_RATES:-2gbit,500mbit}
unequal_rows() {
  local d=$OUT/unequal size=$BIG iters=10 secs=8
  [ $SMOKE -eq 1 ] && { size=16M; iters=3; secs=1; }
  # timed iterations back to back (as in tput_rows), after a short --check run
  local args=(--op sendrecv -b "$size" -e "$size" -n "$iters" -w 2 --check 0)
  local env2=(R2CCL_SOCKET_IFNAME=rail R2CCL_STRIPE=1)
  mkdir -p "$d"
  log "stripe over unequal rails ($UNEQ_RATES): r2ccl --check, iperf3 both, r2ccl stripe, r2ccl rail0 alone, iperf3 both"
  local before after ref g gf q qf l0
  run_pair "$d/check" "${env2[@]}" -- --op sendrecv -b "$size" -e "$size" -n 2 -w 1 --check
  check_run "$d/check" $? "unequal rails stripe, data check"
  l0=$(loadavg)
  before=$(iperf_run "$d/iperf" $secs 0 1 | sed 's/ *$//')
  run_pair "$d/stripe" "${env2[@]}" -- "${args[@]}"
  check_run "$d/stripe" $? "unequal rails stripe"
  run_pair "$d/fast" R2CCL_SOCKET_IFNAME=rail0 -- "${args[@]}"
  check_run "$d/fast" $? "unequal rails, fast rail alone"
  run_pair "$d/before" "${env2[@]}" R2CCL_TEST_HOOKS=no_goodput -- "${args[@]}"
  check_run "$d/before" $? "unequal rails stripe, no_goodput"
  # Two connections (NCCL's channels): one connection has at most --inflight 4 x 1 MiB in
  # flight (NCCL's 4 MiB per channel), and with both directions busy each rail's reverse
  # tbf queue delays the acknowledgements, so one connection's window bounds the sum.
  run_pair "$d/stripe2" "${env2[@]}" -- "${args[@]}" --channels 2
  check_run "$d/stripe2" $? "unequal rails stripe, 2 channels"
  after=$(iperf_run "$d/iperf" $secs 0 1 | sed 's/ *$//')
  ref=$(mean_of "$(awk '{print $NF}' <<<"$before")" "$(awk '{print $NF}' <<<"$after")")
  g=$(H perf "$d/stripe/rank0.out" | awk '{print $4}')
  gf=$(H perf "$d/fast/rank0.out" | awk '{print $4}')
  local gb qb
  gb=$(H perf "$d/before/rank0.out" | awk '{print $4}')
  qb=$(ratio "$gb" "$ref")
  local g2 q2
  g2=$(H perf "$d/stripe2/rank0.out" | awk '{print $4}')
  q2=$(ratio "$g2" "$ref")
  q=$(ratio "$g" "$ref")
  qf=$(ratio "$g" "$gf")
  local res
  res=$(verdict_ge "$q" 0.95)
  [ "$res" = ok ] && ! ge "$qf" 1.0 && res=MISS
  add_row "Stripe over unequal rails ($UNEQ_RATES): r2ccl vs iperf3 on both rails at once" \
    ">= 0.95x the sum; >= the fast rail alone" \
    "${q}x the sum: r2ccl $g Gbit/s, iperf3 both at once $ref Gbit/s (before: $before, after: $after, per rail and sum); r2ccl on rail0 alone $gf Gbit/s (stripe ${qf}x of it); the scheduler before (R2CCL_TEST_HOOKS=no_goodput) $gb Gbit/s = ${qb}x the sum; 2 channels (connections) $g2 Gbit/s = ${q2}x the sum; load $l0 -> $(loadavg)" \
    "$res" "$(short_cmd "${env2[@]}" -- "${args[@]}") (after the same with -n 2 --check); the same with R2CCL_SOCKET_IFNAME=rail0, with R2CCL_TEST_HOOKS=no_goodput, and with --channels 2; iperf3 -t $secs on rail0+rail1 at once before+after" "unequal/"
}

# ratedrop_row: on the unequal lab, a striped run; after a few passes rail 0's tbf (side a,
# the data direction) drops to 250mbit. The rails' send counters (side a, every 20 ms) give
# the time until their summed rate over 100 ms reaches 0.9x the new sum (250 + 500 Mbit/s):
# while the scheduler still believes rail 0 fast, the chunks queued on it hold every message
# back and the sum stays near 0.3 Gbit/s.
# rate_gbps RATE: tc-style rate (2gbit, 500mbit) in Gbit/s
rate_gbps() { python3 -c "import re,sys; m=re.match(r'^([0-9.]+)([kmg]?)(bit)?$', sys.argv[1].lower()); print(float(m.group(1)) * {'':1e-9,'k':1e-6,'m':1e-3,'g':1.0}[m.group(2)])" "$1"; }
ratedrop_row() {  # ratedrop_row [HOOKS]: HOOKS=no_goodput is the scheduler before (reference)
  local hooks=${1:-}
  # rail 0 drops to 1/8 of its rate; target: 0.9x the new sum
  local r0 r1 dropg drop target
  r0=$(rate_gbps "${UNEQ_RATES%%,*}")
  r1=$(rate_gbps "${UNEQ_RATES##*,}")
  dropg=$(python3 -c "import sys; print('%g' % (float(sys.argv[1]) / 8))" "$r0")
  drop="$(python3 -c "import sys; print(int(float(sys.argv[1]) * 1000))" "$dropg")mbit"
  target=$(python3 -c "import sys; print('%.3f' % (0.9 * (float(sys.argv[1]) + float(sys.argv[2]))))" "$dropg" "$r1")
  local d=$OUT/ratedrop${hooks:+-$hooks}
  local rep=14 wait_rows=6
  [ $SMOKE -eq 1 ] && { rep=5; wait_rows=2; }
  local args=(--op sendrecv -b "$BIG" -e "$BIG" -n 2 -w 1 --check --repeat "$rep")
  local env2=(R2CCL_SOCKET_IFNAME=rail R2CCL_STRIPE=1)
  [ -n "$hooks" ] && env2+=("R2CCL_TEST_HOOKS=$hooks")
  mkdir -p "$d"
  log "live rate drop: rail0 2gbit -> $drop mid-run (stripe${hooks:+, $hooks})"
  local l0
  l0=$(loadavg)
  rm -f "$d/stop"
  ip netns exec "$NA" python3 "$HELPER" txsample "$d/tx.tsv" 2 "$d/stop" &
  local sp=$!
  echo $sp >>"$OUT/.pids"
  run_pair "$d" "${env2[@]}" -- "${args[@]}" &
  local p=$! end=$((SECONDS + 120)) t0 t1
  while [ "$(H rows "$d/rank0.out")" -lt $wait_rows ] && [ $SECONDS -lt $end ] && kill -0 $p 2>/dev/null; do sleep 0.1; done
  t0=$(H now)
  bash "$RAILAB" fault rate 0 "$drop" --side a --prefix "$PREFIX" >>"$OUT/railab.log" 2>&1
  t1=$(H now)
  wait $p
  local rc=$?
  touch "$d/stop"
  wait $sp 2>/dev/null
  bash "$RAILAB" fault rate 0 restore --side a --prefix "$PREFIX" >>"$OUT/railab.log" 2>&1
  check_run "$d" $rc "live rate drop"
  local r f
  r=$(H follow "$d/tx.tsv" "$t0" "$target" 0.1 "$dropg")
  echo "$r" >"$d/follow.txt"
  f=$(awk '{print $4}' <<<"$r")
  local name="Live rate drop on one rail (rail0 ${UNEQ_RATES%%,*} -> $drop mid-run, rail1 ${UNEQ_RATES##*,}, stripe): time until the split follows" t="<= 1 s" res
  res=$(verdict_le "$f" 1.0)
  if [ -n "$hooks" ]; then name="$name; the scheduler before (R2CCL_TEST_HOOKS=$hooks, reference)"; t="(reference)"; res=info; fi
  add_row "$name" "$t" \
    "${f} s from the drop taking effect (rail0 under 1.2x $dropg Gbit/s over 100 ms, $(awk '{print $2}' <<<"$r") s after the tc command started; the command took $(python3 -c "print('%.2f' % ($t1 - $t0))") s) until the rails' summed send rate over 100 ms is back to >= $target Gbit/s (0.9x the new sum; 0: it never fell below); before $(awk '{print $6}' <<<"$r") Gbit/s (rail0 share $(awk '{print $10}' <<<"$r")), after $(awk '{print $8}' <<<"$r") Gbit/s (rail0 share $(awk '{print $12}' <<<"$r")); load $l0 -> $(loadavg)" \
    "$res" "$(short_cmd "${env2[@]}" -- "${args[@]}"); railab.sh fault rate 0 $drop --side a after $wait_rows passes" "${d#"$OUT"/}/"
}

# spread_rows: 4 rails at 500mbit (the 2 cores are not the limit), 4 channels (channel c's
# primary on rail c), R2CCL_BACKUP_PATHS=3, rail 0 down for good after 3 passes. The channels
# of one op move equal bytes and the op ends with the slowest, so bytes per channel / op time
# is the slowest channel's rate. R2CCL_FAILOVER_SPREAD=1 (spread over every survivor) against
# 0 (move to one backup). CPU from /proc/stat over the run.
SPREAD_RATE=${R2CCL_BENCH_SPREAD_RATE:-500mbit}
BIG=${R2CCL_BENCH_SIZE:-64M}   # message size of the issue 16 rows
spread_rows() {
  local sp
  for sp in 1 0; do
    local d=$OUT/spread-$sp rep=14 wait_rows=3 settle=1.5
    [ $SMOKE -eq 1 ] && { rep=6; wait_rows=2; settle=0.5; }
    local args=(--op sendrecv --channels 4 -b "$BIG" -e "$BIG" -n 2 -w 1 --check --repeat "$rep")
    local env=(R2CCL_SOCKET_IFNAME=rail R2CCL_BACKUP_PATHS=3 R2CCL_FAILOVER_SPREAD=$sp)
    mkdir -p "$d"
    log "failed rail's load: 4 rails, 4 channels, rail0 down, R2CCL_FAILOVER_SPREAD=$sp"
    local l0 c0 c1
    l0=$(loadavg)
    c0=$(H cpu)
    rm -f "$d/cpu.stop"
    H perfcpu "$d/cpu.txt" "$d/cpu.stop" &
    local cp=$!
    echo $cp >>"$OUT/.pids"
    run_pair "$d" "${env[@]}" -- "${args[@]}" &
    local p=$! end=$((SECONDS + 120)) ts took
    while [ "$(H rows "$d/rank0.out")" -lt $wait_rows ] && [ $SECONDS -lt $end ] && kill -0 $p 2>/dev/null; do sleep 0.2; done
    read -r ts took < <(fault link-down 0)
    wait $p
    local rc=$?
    c1=$(H cpu)
    touch "$d/cpu.stop"
    wait $cp 2>/dev/null
    fault link-up 0 >/dev/null
    check_run "$d" $rc "failed rail's load (spread=$sp)"
    local r before after q busy
    r=$(H degraded "$d/rank0.out" "${ts:-0}" "$settle")
    after=$(awk '{print $4}' <<<"$r")
    before=$(awk '{print $8}' <<<"$r")
    q=$(ratio "$after" "$before")
    busy=$(python3 -c "import sys; a=sys.argv[1].split(); b=sys.argv[2].split(); t=int(b[0])-int(a[0]); i=int(b[1])-int(a[1]); print('%.0f' % (100.0*(t-i)/t if t else float('nan')))" "$c0" "$c1")
    local name target res
    if [ "$sp" = 1 ]; then name="spread over every survivor (R2CCL_FAILOVER_SPREAD=1)"; target=">= 0.7125x (0.95 x 3/4)"; res=$(verdict_ge "$q" 0.7125)
    else name="moved to one backup (R2CCL_FAILOVER_SPREAD=0, reference)"; target="(reference: 1/2 expected)"; res=info; fi
    add_row "Failed rail's load, 4 rails at $SPREAD_RATE, 4 channels, rail0 down for good: $name; slowest channel after/before" \
      "$target" \
      "${q}x: per channel $(python3 -c "import sys; print('%.3f' % (float(sys.argv[1]) / 4))" "$after") Gbit/s after ($(awk '{print $2}' <<<"$r") passes), $(python3 -c "import sys; print('%.3f' % (float(sys.argv[1]) / 4))" "$before") before (sum over channels $after / $before); r2ccl_perf ranks used $(awk '{print $6}' "$d/cpu.txt" 2>/dev/null) of $(nproc) cores, the whole machine was ${busy} % busy during the run; load $l0 -> $(loadavg)" \
      "$res" "$(short_cmd "${env[@]}" -- "${args[@]}"); railab.sh fault link-down 0 after $wait_rows passes" "spread-$sp/"
    sleep 2
  done
}

faultfree_row() {
  local d=$OUT/fault-free runsecs=120
  [ "$FF_SECS" -lt $runsecs ] && runsecs=$((FF_SECS / 2 > 2 ? FF_SECS / 2 : 2))
  mkdir -p "$d"
  log "fault-free traffic for $FF_SECS s: counting switchover / shadow-routing lines"
  local t0=$SECONDS
  traffic_loop "$d" $runsecs "${TRAFFIC_ENV[@]}" -- "${TRAFFIC_ARGS[@]}" &
  local lp=$!
  echo $lp >>"$OUT/.pids"
  sleep "$FF_SECS"
  touch "$d/stop"
  wait $lp
  local secs=$((SECONDS - t0))
  traffic_check "$d" "fault-free run"
  local logs=("$d"/plugin.*.log) c
  c=$(H count --jobs "$d" "${logs[@]}" | tr '\n' ' ')
  echo "$c" >"$d/summary.txt"
  local sw sh bf rf gu hd
  sw=$(awk '{for(i=1;i<NF;i++) if($i=="switchover") print $(i+1)}' <<<"$c")
  sh=$(awk '{for(i=1;i<NF;i++) if($i=="shadow") print $(i+1)}' <<<"$c")
  bf=$(awk '{for(i=1;i<NF;i++) if($i=="backup_failed") print $(i+1)}' <<<"$c")
  rf=$(awk '{for(i=1;i<NF;i++) if($i=="recv_path_failed") print $(i+1)}' <<<"$c")
  gu=$(awk '{for(i=1;i<NF;i++) if($i=="giveup") print $(i+1)}' <<<"$c")
  hd=$(awk '{for(i=1;i<NF;i++) if($i=="holddown") print $(i+1)}' <<<"$c")
  local ou
  ou=$(awk '{for(i=1;i<NF;i++) if($i=="outside") print $(i+1)}' <<<"$c")
  add_row "Spurious switchovers in $FF_SECS s without faults (switchover + shadow-routing lines, both ranks)" "0" \
    "$((sw + sh)) ($sw switchover, $sh shadow routing; also $bf backup-path and $rf receive-side path failures, $gu give-ups, $hd hold-downs) in ${secs} s; $TRAFFIC_SUMMARY; $ou lines at job setup/teardown not counted" \
    "$([ $((sw + sh)) -eq 0 ] && echo ok || echo MISS)" \
    "$(short_cmd "${TRAFFIC_ENV[@]}" -- "${TRAFFIC_ARGS[@]}") --repeat R, jobs back to back" "fault-free/"
}

# run_lab_test DIR FILE: runs the lab test file tests/lab/FILE.cc (its own lab) from the build
# tree into DIR/out.txt, the command and load in DIR/cmd.txt; returns its exit status.
run_lab_test() {
  local dir=$1 file=$2 rc=0
  mkdir -p "$dir"
  local cmd=("$BUILD/bin/r2ccl_lab_tests" "[#$file]" --filenames-as-tags)
  if [ ! -x "${cmd[0]}" ]; then
    echo "${cmd[0]} is missing: make -C $BUILD r2ccl_lab_tests" | tee "$dir/out.txt" >&2
    return 127
  fi
  echo "R2CCL_TEST_PLUGIN=$PLUGIN_SO R2CCL_TEST_RAILAB=$RAILAB ${cmd[*]}; load $(loadavg)" >"$dir/cmd.txt"
  R2CCL_HEALTH_BOARD=none R2CCL_TEST_PLUGIN=$PLUGIN_SO R2CCL_TEST_PERF=$PERF R2CCL_TEST_RAILAB=$RAILAB \
    timeout 300 "${cmd[@]}" >"$dir/out.txt" 2>&1 || rc=$?
  echo "exit $rc; load $(loadavg)" >>"$dir/cmd.txt"
  return $rc
}

# Rails whose address changes (issue 16): the rail lab scenarios of tests/lab/
# test_lab_addresses.cc (far/near end renumbers, address added before the old one goes, old
# address back, both ends back 3 s apart, back from another subnet; IPv6 after DAD), run by the
# lab test executable on its own lab; each prints how long after both ends were usable the
# rail carried traffic again (the sender's failback line).
addr_rows() {
  local dir=$OUT/addr rc=0
  local cmd="r2ccl_lab_tests [#test_lab_addresses] --filenames-as-tags"
  run_lab_test "$dir" test_lab_addresses || rc=$?
  # "NAME: rail0 carries traffic again X s after both ends are usable" (Catch wraps lines)
  python3 - "$dir/out.txt" >"$dir/times.tsv" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
text = re.sub(r"\n  ", " ", text)
# a number Catch wrapped reads "0. 120844" once joined
num = r"(-?[0-9.e-]+(?: [0-9e-]+)?)"
val = lambda t: float(t.replace(" ", ""))
for m in re.finditer(r"warning:\s+(.+?): rail0 carries traffic again " + num + " s after", text):
    print(f"{m.group(1)}\t{val(m.group(2)):.3f}")
m = re.search(r"IPv6: DAD took " + num + " s; rail0 carries traffic again " + num + " s after", text)
if m:
    print(f"IPv6 (after DAD, which took {val(m.group(1)):.2f} s)\t{val(m.group(2)):.3f}")
PY
  local n worst cases
  n=$(wc -l <"$dir/times.tsv")
  worst=$(cut -f2 "$dir/times.tsv" | sort -g | tail -1)
  cases=$(awk -F'\t' '{printf "%s%s %s s", (NR>1?"; ":""), $1, $2}' "$dir/times.tsv")
  if [ "$rc" -ne 0 ] || [ "$n" -lt 7 ]; then
    echo "addr: the lab scenarios failed (exit $rc, $n of 7 cases timed; $dir/out.txt)" >>"$OUT/broken.txt"
    BROKEN=1
    add_row "Address change: rail back after both ends are usable, worst of 7 cases" "<= 2 s" "failed: exit $rc, $n cases timed" BROKEN "$cmd" "addr/"
    return
  fi
  add_row "Address change: rail carries traffic again after both ends are usable (IPv6: after DAD), worst of 7 cases" "<= 2 s" \
    "$worst s ($cases)" "$(awk -v w="$worst" 'BEGIN{print (w <= 2.0) ? "ok" : "MISS"}')" "$cmd" "addr/"
}

# Shadow routing (issue 16): tests/lab/test_lab_shadow.cc on its own lab (2 rails at 500 Mbit/s,
# 60 ms tbf queue): 16 competing iperf3 streams fill rail0's queue while a paced r2ccl stream
# runs; the row is the time from `railab.sh fault queue-start` (its own run time and the
# streams' ramp-up included) to the sender's drain line, the time from queue-stop to the return
# line, and the message rate kept while drained. False drains without faults: the fault-free
# row counts every "shadow routing:" line.
shadow_rows() {
  local dir=$OUT/shadow rc=0
  local cmd="r2ccl_lab_tests [#test_lab_shadow] --filenames-as-tags"
  run_lab_test "$dir" test_lab_shadow || rc=$?
  local m
  m=$(python3 - "$dir/out.txt" <<'PY'
import re, sys
t = re.sub(r"\n  ", " ", open(sys.argv[1]).read())
num = r"(-?[0-9.e-]+(?: [0-9e-]+)?)"
m = re.search(r"rail0 drained " + num + r" s after the queue filled; back " + num +
              r" s after it emptied; messages/s before " + num + r", while drained " + num, t)
if m:
    d, b, r0, r1 = (float(g.replace(" ", "")) for g in m.groups())
    print(f"{d:.2f} {b:.2f} {r1 / r0:.2f}")
PY
)
  if [ "$rc" -ne 0 ] || [ -z "$m" ]; then
    echo "shadow: the lab scenario failed (exit $rc; $dir/out.txt)" >>"$OUT/broken.txt"
    BROKEN=1
    add_row "Shadow routing: queued rail drained" "(info)" "failed: exit $rc" BROKEN "$cmd" "shadow/"
    return
  fi
  read -r d b k <<<"$m"
  add_row "Shadow routing: rail0 queued behind 16 competing streams (500 Mbit/s, 60 ms queue): drained after / back after queue-stop / message rate kept" "(info: no target set)" \
    "drained $d s after queue-start; back $b s after queue-stop; rate kept ${k}x; no path failed" info "$cmd" "shadow/"
}

# ------------------------------------------------------------------------------- main
{
  echo "bench_net.sh $([ $SMOKE -eq 1 ] && echo --smoke) mode=$MODE prefix=$PREFIX rate=$RATE faults=$FAULTS fault-free-seconds=$FF_SECS"
  echo "commit $COMMIT; $(uname -srm); $(nproc) CPUs; load at start $(loadavg)"
  echo "perf $PERF; plugin $PLUGIN_SO"
  "$PERF" --params 2>/dev/null | grep -E '^R2CCL_' || true
} >"$OUT/env.txt"
log "out: $OUT (commit $COMMIT, mode $MODE, load $(loadavg))"

if [ $MODE = lab ]; then
  lab_up "$RATE" || exit 1
  want tput && tput_rows "$RATE shaped" 1
  want small && small_rows
  want faults && fault_rows_lab
  if want degraded; then
    degraded_row "$RATE shaped" stripe 1 0 1 R2CCL_SOCKET_IFNAME=rail R2CCL_STRIPE=1
    [ $SMOKE -eq 1 ] || degraded_row "$RATE shaped" "failover to the backup (no stripe)" 0 1 1 R2CCL_SOCKET_IFNAME=rail
  fi
  want faultfree && faultfree_row
  want16 addr && addr_rows
  want16 shadow && shadow_rows
  if want16 unequal || want16 ratedrop; then
    lab_up "$UNEQ_RATES" 2 && {
      want16 unequal && unequal_rows
      want16 ratedrop && { ratedrop_row; [ $SMOKE -eq 1 ] || ratedrop_row no_goodput; }
    }
  fi
  want16 spread && lab_up "$SPREAD_RATE" 4 && spread_rows
  # Unshaped: the throughput rows again on an unshaped lab; the smoke run (CI) has run their
  # code on the shaped lab already, so only when named there.
  if want16 unshaped; then
    lab_up "" && {
      tput_rows unshaped 0
      [ $SMOKE -eq 1 ] || degraded_row unshaped stripe 1 0 0 R2CCL_SOCKET_IFNAME=rail R2CCL_STRIPE=1
    }
  fi
  bash "$RAILAB" down --prefix "$PREFIX" >>"$OUT/railab.log" 2>&1
  LAB_UP=0
else
  want tput && tput_rows loopback 0
  want small && small_rows
  want faults && fault_rows_lo
  want degraded && degraded_lo
  want faultfree && faultfree_row
fi

echo "load at end $(loadavg); wall time $((SECONDS - T_START)) s" >>"$OUT/env.txt"
{
  echo "Commit $COMMIT, $(date -Is), mode $MODE$([ $SMOKE -eq 1 ] && echo ', smoke'), $(nproc) CPUs, load average at start/end: $(sed -n 's/.*load at start //p' "$OUT/env.txt") / $(loadavg), wall time $((SECONDS - T_START)) s."
  echo "Command: scripts/bench_net.sh $([ $SMOKE -eq 1 ] && echo '--smoke ')$([ "$ONLY" = all ] || echo "--only $ONLY ")--faults $FAULTS --fault-free-seconds $FF_SECS --rate $RATE; raw logs relative to $OUT"
  echo
  H table "$ROWS" "$COMMIT"
} >"$OUT/results.md"
echo
cat "$OUT/results.md"
echo
if [ $BROKEN -ne 0 ]; then
  echo "$PROG: something broke:"
  sed 's/^/  /' "$OUT/broken.txt"
  exit 1
fi
log "done: every run completed, 0 wrong bytes (speed targets do not change the exit status)"
exit 0
