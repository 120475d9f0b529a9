#!/usr/bin/env bash
# gpu_e2e.sh - the r2ccl net and tuner plugins inside an unmodified NCCL job (PyTorch and the
# NCCL it brought) on a machine with one NVIDIA GPU: 2 ranks on the one GPU as two "nodes",
# torch.distributed all_reduce sweeps with every result checked, a rail killed mid-run by the
# in-process injector, and NCCL's own socket transport as the baseline. Checks in NCCL's log
# that NCCL loaded the r2ccl plugins and used nothing else. docs/BENCHMARKS.md, "Real NCCL end
# to end", says what it records. Run `gpu_e2e.sh --help`.
# shellcheck disable=SC2054
# (SC2054: comma lists such as R2CCL_SOCKET_IFNAME=lo@A,lo@B are one word on purpose.)
set -euo pipefail

PROG=${0##*/}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HERE=$ROOT/scripts/gpu_e2e

usage() {
  cat <<'EOF'
gpu_e2e.sh - r2ccl inside a real NCCL job on one GPU (docs/BENCHMARKS.md, "Real NCCL end to end")

USAGE
  gpu_e2e.sh [--build DIR] [--out DIR] [--pack DIR] [--python PATH] [--fault-rail N|auto]
             [--preflight-only]
  gpu_e2e.sh --stage-to DIR [--build DIR]

  Needs an NVIDIA GPU (nvidia-smi), a python with PyTorch built for CUDA (its own NCCL, 2.20
  or newer), and a prebuilt r2ccl tree: nothing is built or installed. Whole run <= 4 min.
  (a) preflight: GPU, torch + CUDA, torch.cuda.nccl.version(), `ldd` of both plugins
  (b) three jobs of 2 processes (plain `python worker.py`, RANK 0/1, both on CUDA device 0,
      a distinct NCCL_HOSTID each, NCCL_SHM_DISABLE=1, NCCL_P2P_DISABLE=1):
        r2ccl   NCCL_NET_PLUGIN=<abs path of libnccl-net-r2ccl.so> NCCL_NET=R2CCL
                NCCL_TUNER_PLUGIN=<abs path of libnccl-tuner-r2ccl.so>, two rails on lo
                (R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2)
        fault   the same, R2CCL_FAULT_INJECT resets one rail of rank 1 4 s into the traffic
                (for 3 s), while the job keeps sweeping for at least 12 s
        socket  NCCL's own socket transport (NCCL_NET=Socket, no plugins, lo), the baseline
  (c) the log checks (scripts/gpu_e2e/check_log.py), one PASS/FAIL line each
  (d) the result table, OUT/results.md

OPTIONS
  --build DIR        prebuilt tree with lib/libnccl-net-r2ccl.so and lib/libnccl-tuner-r2ccl.so
                     (default build)
  --out DIR          logs and results (default $OUT, else ./gpu_e2e_out)
  --pack DIR         on exit (any exit), also put into DIR: gpu_e2e.tar.gz (all of --out) and
                     copies of results.md, checks.txt, preflight.txt, gpu_e2e.log; 5 files,
                     within what the device tool brings back from its $OUT (8 files)
  --python PATH      the python with torch (default python3)
  --fault-rail N     rail the fault kills (default auto: 1 when NCCL used net device 1 in the
                     fault-free job, else 0; in TCP mode r2ccl's device N is rail N)
  --preflight-only   stop after the preflight
  --stage-to DIR     copy the two plugins of --build into DIR/lib, without debug info (a
                     small tree for the device tool's `carry`), and exit
  -h, --help         this text

EXIT STATUS
  0 every check passed; 1 a check failed or a job failed/hung; 2 usage;
  3 no NVIDIA GPU here (nvidia-smi missing or failing, or torch sees no CUDA device);
  4 the machine is unusable otherwise (no torch with CUDA, NCCL older than 2.20, a plugin
    missing or with a library `ldd` cannot find).

OUTPUT (OUT)
  gpu_e2e.log (everything printed), preflight.txt, checks.txt, results.md,
  r2ccl/ fault/ socket/: cmd.txt (environment and command), rank0.log, rank1.log (NCCL's
  INFO log from NCCL_DEBUG_FILE appended at the end, r2ccl's [R2CCL] lines, worker.py's
  RESULT lines, the exit status)
EOF
}

# ------------------------------------------------------------------------------- options
BUILD=build
OUT_DIR=${OUT:-$PWD/gpu_e2e_out}
PY=python3
FAULT_RAIL=auto
PREFLIGHT_ONLY=0
STAGE_TO=
PACK=
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=${2:?--build needs a directory}; shift ;;
    --out) OUT_DIR=${2:?--out needs a directory}; shift ;;
    --pack) PACK=${2:?--pack needs a directory}; shift ;;
    --python) PY=${2:?--python needs a path}; shift ;;
    --fault-rail) FAULT_RAIL=${2:?--fault-rail needs 0, 1 or auto}; shift ;;
    --preflight-only) PREFLIGHT_ONLY=1 ;;
    --stage-to) STAGE_TO=${2:?--stage-to needs a directory}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "$PROG: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case $FAULT_RAIL in auto|0|1) ;; *) echo "$PROG: --fault-rail must be 0, 1 or auto" >&2; exit 2 ;; esac

case $BUILD in /*) ;; *) BUILD=$PWD/$BUILD ;; esac
LIB=$BUILD/lib
NET_SO=$LIB/libnccl-net-r2ccl.so
TUNER_SO=$LIB/libnccl-tuner-r2ccl.so

if [ -n "$STAGE_TO" ]; then
  mkdir -p "$STAGE_TO/lib"
  for f in "$NET_SO" "$TUNER_SO"; do
    [ -f "$f" ] || { echo "$PROG: $f not found (build it first)" >&2; exit 4; }
    if command -v strip >/dev/null; then
      strip --strip-debug -o "$STAGE_TO/lib/${f##*/}" "$f"
    else
      cp "$f" "$STAGE_TO/lib/"
    fi
  done
  ls -l "$STAGE_TO/lib"
  du -sh "$STAGE_TO"
  exit 0
fi

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
if [ -n "$PACK" ]; then
  mkdir -p "$PACK"
  PACK=$(cd "$PACK" && pwd)
  case $PACK/ in "$OUT_DIR"/*) echo "$PROG: --pack must be outside --out" >&2; exit 2 ;; esac
fi
exec > >(tee -a "$OUT_DIR/gpu_e2e.log") 2>&1

# --pack: on every exit (3 and 4 too), the whole --out as one tarball plus the short files.
# shellcheck disable=SC2317  # (called by the EXIT trap)
pack() {
  local rc=$? f
  if [ -n "$PACK" ]; then
    for f in results.md checks.txt preflight.txt gpu_e2e.log; do
      if [ -f "$OUT_DIR/$f" ]; then cp "$OUT_DIR/$f" "$PACK/" || true; fi
    done
    timeout 60 tar czf "$PACK/gpu_e2e.tar.gz" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" ||
      echo "[gpu_e2e] --pack: tar failed" >&2
  fi
  exit "$rc"
}
trap pack EXIT

BUDGET_S=235   # the whole run, preflight included (the issue allows 4 minutes)
T0=$SECONDS
say() { echo "[gpu_e2e] $*"; }
# A phase's timeout: WANT seconds, or what is left of the budget (at least 5).
phase_timeout() {
  local left=$((BUDGET_S - (SECONDS - T0)))
  [ "$left" -lt 5 ] && left=5
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

say "out: $OUT_DIR"
say "build: $BUILD"

# ------------------------------------------------------------------------ (a) preflight
NO_GPU=0
BAD_ENV=0
PF=$OUT_DIR/preflight.txt
: >"$PF"
pf() { echo "$1  preflight: $2" | tee -a "$PF"; }

if ! command -v nvidia-smi >/dev/null 2>&1; then
  pf FAIL "nvidia-smi not found: no NVIDIA GPU or driver on this machine"
  NO_GPU=1
elif ! GPUS=$(timeout 15 nvidia-smi --query-gpu=index,name,driver_version,memory.total \
                --format=csv,noheader 2>&1); then
  pf FAIL "nvidia-smi failed: ${GPUS//$'\n'/ }"
  NO_GPU=1
else
  pf PASS "GPU: ${GPUS//$'\n'/; }"
fi

PROBE=$OUT_DIR/preflight-python.txt
if ! command -v "$PY" >/dev/null 2>&1; then
  pf FAIL "python '$PY' not found (--python PATH)"
  BAD_ENV=1
elif ! timeout "$(phase_timeout 45)" "$PY" - >"$PROBE" 2>&1 <<'EOF'
import sys
print("python=%s" % sys.version.split()[0])
try:
    import torch
except Exception as e:
    print("torch=none (%s)" % e)
    sys.exit(0)
print("torch=%s" % torch.__version__)
print("torch_cuda=%s" % torch.version.cuda)
ok = torch.cuda.is_available()
print("cuda_available=%d" % ok)
if ok:
    print("device=%s" % torch.cuda.get_device_name(0).replace(" ", "_"))
try:
    v = torch.cuda.nccl.version()
    if not isinstance(v, tuple):  # older torch: NCCL_VERSION_CODE
        v = (v // 10000, v // 100 % 100, v % 100) if v >= 10000 else (v // 1000, v // 100 % 10, v % 100)
    print("nccl=%s" % ".".join(map(str, v)))
except Exception as e:
    print("nccl=none (%s)" % str(e).replace("\n", " "))
with open("/proc/self/maps") as f:
    libs = sorted({l.split()[-1] for l in f if "libnccl" in l})
print("nccl_lib=%s" % (",".join(libs) or "not mapped (static, or loaded later)"))
EOF
then
  pf FAIL "python probe failed or timed out: $(tail -n 3 "$PROBE" | tr '\n' ' ')"
  BAD_ENV=1
fi
probe() { sed -n "s/^$1=//p" "$PROBE" 2>/dev/null | head -n 1; }
TORCH=$(probe torch)
NCCL_VER=$(probe nccl)
if [ "$BAD_ENV" = 0 ]; then
  if [ -z "$TORCH" ] || [ "${TORCH%% *}" = none ]; then
    pf FAIL "$PY has no torch: ${TORCH:-?}"
    BAD_ENV=1
  elif [ "$(probe cuda_available)" != 1 ]; then
    if [ "$(probe torch_cuda)" = None ]; then
      pf FAIL "torch $TORCH is a CPU-only build (torch.version.cuda is None)"
      BAD_ENV=1
    else
      pf FAIL "torch $TORCH (CUDA $(probe torch_cuda)) sees no CUDA device"
      NO_GPU=1
    fi
  else
    pf PASS "torch $TORCH, CUDA $(probe torch_cuda), device $(probe device), python $(probe python)"
  fi
fi

# NCCL_NET_PLUGIN: an absolute path from NCCL 2.21 on; 2.20 only tries libnccl-net-<NAME>.so,
# so it gets the name and LD_LIBRARY_PATH. 2.19 and older do not know ncclNetPlugin_v8+.
NET_PLUGIN=$NET_SO
TUNER_PLUGIN=$TUNER_SO
TUNER_ARGS=()
EXTRA_LD=
if [ "$BAD_ENV" = 0 ] && [ -n "$TORCH" ]; then
  if [[ ! $NCCL_VER =~ ^([0-9]+)\.([0-9]+)\.([0-9]+) ]]; then
    if [ "$NO_GPU" = 1 ]; then
      pf NOTE "NCCL version unknown without a CUDA torch: ${NCCL_VER:-?}"
    else
      pf FAIL "cannot tell PyTorch's NCCL version: ${NCCL_VER:-?}"
      BAD_ENV=1
    fi
  else
    NCCL_NUM=$((BASH_REMATCH[1] * 10000 + BASH_REMATCH[2] * 100 + BASH_REMATCH[3]))
    if [ "$NCCL_NUM" -ge 22100 ]; then
      pf PASS "PyTorch's NCCL $NCCL_VER ($(probe nccl_lib)): NCCL_NET_PLUGIN and NCCL_TUNER_PLUGIN as absolute paths"
    elif [ "$NCCL_NUM" -ge 22000 ]; then
      NET_PLUGIN=r2ccl
      EXTRA_LD=$LIB
      TUNER_ARGS=(--no-tuner)
      pf NOTE "PyTorch's NCCL $NCCL_VER < 2.21: NCCL_NET_PLUGIN=r2ccl with LD_LIBRARY_PATH=$LIB; its tuner loader probes only ncclTunerPlugin_v1 (the tuner check is skipped)"
    else
      pf FAIL "PyTorch's NCCL $NCCL_VER is older than 2.20: r2ccl exports ncclNetPlugin_v8..v11 only"
      BAD_ENV=1
    fi
  fi
fi

for so in "$NET_SO" "$TUNER_SO"; do
  if [ ! -f "$so" ]; then
    pf FAIL "$so not found (--build DIR: a prebuilt tree; see --stage-to)"
    BAD_ENV=1
  elif ! command -v ldd >/dev/null 2>&1; then
    pf FAIL "ldd not found: cannot check ${so##*/}'s libraries"
    BAD_ENV=1
  elif ! LDD=$(timeout 10 ldd "$so" 2>&1) || grep -q "not found" <<<"$LDD"; then
    pf FAIL "ldd ${so##*/}: $(grep "not found" <<<"$LDD" | tr -s ' \t\n' ' ')"
    BAD_ENV=1
  else
    pf PASS "ldd ${so##*/}: every library found ($(awk '/=>/{print $1}' <<<"$LDD" | tr '\n' ' '))"
  fi
done
# dlopen'ed at run time, so ldd does not list them: optional (the link monitor; verbs unused here)
LDCACHE=$( (command -v ldconfig >/dev/null 2>&1 && timeout 10 ldconfig -p) 2>/dev/null || true)
for opt in libnl-3.so.200 libnl-route-3.so.200; do
  if [ -n "$LDCACHE" ] && ! grep -qF "$opt" <<<"$LDCACHE"; then
    pf NOTE "$opt not installed: r2ccl's link monitor is off (a WARN); detection by socket errors and heartbeats"
  fi
done
if [ -n "$LDCACHE" ] && ! grep -qF libnl-genl-3.so.200 <<<"$LDCACHE"; then
  pf NOTE "libnl-genl-3.so.200 not installed: the failure predictor reads no FEC statistics (an INFO per rail)"
fi

if [ "$NO_GPU" = 1 ]; then
  say "NO GPU: cannot run NCCL here (exit 3). Run this on a machine with an NVIDIA GPU."
  exit 3
fi
if [ "$BAD_ENV" = 1 ]; then
  say "preflight failed (exit 4): $(grep -c '^FAIL' "$PF") problem(s), listed above and in $PF"
  exit 4
fi
if [ "$PREFLIGHT_ONLY" = 1 ]; then
  say "preflight passed (--preflight-only)"
  exit 0
fi

# ---------------------------------------------------------------------------- (b) jobs
COMMON=(
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,NET,TUNING
  NCCL_SHM_DISABLE=1 NCCL_P2P_DISABLE=1 NCCL_SOCKET_IFNAME=lo
  MASTER_ADDR=127.0.0.1 WORLD_SIZE=2 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
)
R2CCL_ENV=(
  NCCL_NET_PLUGIN="$NET_PLUGIN" NCCL_NET=R2CCL NCCL_TUNER_PLUGIN="$TUNER_PLUGIN"
  R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2 R2CCL_TRANSPORT=tcp
)
[ -n "$EXTRA_LD" ] && R2CCL_ENV+=(LD_LIBRARY_PATH="$EXTRA_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
SOCKET_ENV=(NCCL_NET=Socket NCCL_NET_PLUGIN=none NCCL_TUNER_PLUGIN=none)
# Inherited settings that would change what is measured are dropped.
UNSET=(-u R2CCL_FAULT_INJECT -u NCCL_NET_PLUGIN -u NCCL_TUNER_PLUGIN -u NCCL_NET
       -u NCCL_DEBUG_FILE -u R2CCL_LOG_FILE -u NCCL_COLLNET_ENABLE)

# run_job NAME TIMEOUT_S: 2 ranks with JOB_ENV and JOB_ARGS; each rank's exit status is appended
# to its log ("GPU_E2E_EXIT rank=R rc=N"). Returns 0 when both exited 0. NCCL writes its log to
# NCCL_DEBUG_FILE (unbuffered there; on a redirected stdout it would be block-buffered, cut
# mid-line by stderr and lost when a hung rank is killed); it is appended to the rank's log.
run_job() {
  local name=$1 tmo=$2 dir=$OUT_DIR/$1 port r rc=0 one
  local -a pids=()
  mkdir -p "$dir"
  port=$((20000 + RANDOM % 20000))
  {
    echo "# $name, $(date -u +%FT%TZ), timeout ${tmo}s per rank"
    printf '%s\n' "${COMMON[@]}" "${JOB_ENV[@]}" "MASTER_PORT=$port" \
      "RANK=0|1 R2CCL_RANK=0|1 NCCL_HOSTID=r2ccl-e2e-node0|1 NCCL_DEBUG_FILE=$dir/rank0|1.nccl.log"
    echo "timeout -k 5 $tmo $PY $HERE/worker.py --tag $name ${JOB_ARGS[*]}"
  } >"$dir/cmd.txt"
  say "job $name: 2 ranks, timeout ${tmo}s (${JOB_ARGS[*]})"
  for r in 0 1; do
    env "${UNSET[@]}" "${COMMON[@]}" "${JOB_ENV[@]}" MASTER_PORT=$port RANK=$r LOCAL_RANK=0 \
      R2CCL_RANK=$r NCCL_HOSTID=r2ccl-e2e-node$r NCCL_DEBUG_FILE="$dir/rank$r.nccl.log" \
      timeout -k 5 "$tmo" "$PY" "$HERE/worker.py" --tag "$name" "${JOB_ARGS[@]}" \
      >"$dir/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do
    one=0
    wait "${pids[$r]}" || one=$?
    if [ -f "$dir/rank$r.nccl.log" ]; then
      { echo "# ---- NCCL_DEBUG_FILE of rank $r ----"; cat "$dir/rank$r.nccl.log"; } >>"$dir/rank$r.log"
      rm -f "$dir/rank$r.nccl.log"
    fi
    echo "GPU_E2E_EXIT rank=$r rc=$one" >>"$dir/rank$r.log"
    if [ "$one" -ne 0 ]; then
      rc=1
      say "job $name: rank $r exited $one$([ "$one" -ge 124 ] && echo " (timed out)")"
      tail -n 5 "$dir/rank$r.log" | sed "s/^/[gpu_e2e]   rank $r: /"
    fi
  done
  grep -h "^RESULT" "$dir/rank0.log" | tail -n 3 | sed 's/^/[gpu_e2e]   /' || true
  return $rc
}

JOBS_OK=1
JOB_ENV=("${R2CCL_ENV[@]}")
JOB_ARGS=(--passes 2)
run_job r2ccl "$(phase_timeout 55)" || JOBS_OK=0

if [ "$FAULT_RAIL" = auto ]; then
  if grep -q "via NET/R2CCL/1" "$OUT_DIR/r2ccl/rank0.log" "$OUT_DIR/r2ccl/rank1.log" 2>/dev/null; then
    FAULT_RAIL=1
  else
    FAULT_RAIL=0
  fi
  say "fault rail: $FAULT_RAIL (auto: NCCL $( [ $FAULT_RAIL = 1 ] && echo used || echo did not use) net device 1 in the fault-free job)"
fi
FAULT="rank=1,rail=$FAULT_RAIL,at=4000,kind=reset,for=3000"
JOB_ENV=("${R2CCL_ENV[@]}" R2CCL_FAULT_INJECT="$FAULT")
JOB_ARGS=(--passes 2 --min-seconds 12)
run_job fault "$(phase_timeout 65)" || JOBS_OK=0

JOB_ENV=("${SOCKET_ENV[@]}")
JOB_ARGS=(--passes 2)
run_job socket "$(phase_timeout 50)" || JOBS_OK=0

# ---------------------------------------------------------------------- (c) log checks
CHECKS=$OUT_DIR/checks.txt
: >"$CHECKS"
CHECKS_OK=1
for kind in r2ccl fault socket; do
  args=(check --kind "$kind")
  [ "$kind" != socket ] && args+=("${TUNER_ARGS[@]}")
  timeout "$(phase_timeout 30)" "$PY" "$HERE/check_log.py" "${args[@]}" \
    "$OUT_DIR/$kind/rank0.log" "$OUT_DIR/$kind/rank1.log" | tee -a "$CHECKS" || CHECKS_OK=0
done

# -------------------------------------------------------------------- (d) result table
{
  echo "# r2ccl inside PyTorch's NCCL $NCCL_VER (torch $TORCH), $(probe device)"
  echo
  echo "2 ranks on one GPU as two nodes, NCCL_SHM_DISABLE=1 NCCL_P2P_DISABLE=1; r2ccl on two rails"
  echo "lo@127.0.0.1,lo@127.0.0.2; fault: R2CCL_FAULT_INJECT=$FAULT; socket: NCCL_NET=Socket on lo."
  echo
  timeout 30 "$PY" "$HERE/check_log.py" table --run r2ccl="$OUT_DIR/r2ccl" \
    --run fault="$OUT_DIR/fault" --run socket="$OUT_DIR/socket"
  echo
  echo "Checks: $(grep -c '^PASS' "$CHECKS") passed, $(grep -c '^FAIL' "$CHECKS") failed"
  grep '^FAIL' "$CHECKS" || true
} >"$OUT_DIR/results.md"
cat "$OUT_DIR/results.md"

say "done in $((SECONDS - T0)) s; logs and results in $OUT_DIR"
if [ "$JOBS_OK" = 1 ] && [ "$CHECKS_OK" = 1 ]; then
  say "OK: NCCL loaded the r2ccl plugins, used nothing else, and kept every result correct through the rail failure"
  exit 0
fi
say "FAILED: $(grep -c '^FAIL' "$CHECKS") check(s) failed$([ "$JOBS_OK" = 0 ] && echo ", a job failed or timed out")"
exit 1
