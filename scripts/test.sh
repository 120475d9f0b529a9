#!/usr/bin/env bash
# The test command (README command 2, and what .ci/run runs).
#   scripts/test.sh            everything but the long, rdma and gpu labels
#   scripts/test.sh --long     also the long tests
# Phases: setup, build, unit+abi, loopback (TCP on lo, verbs on the fake verbs provider), lab
# (root + namespaces), rdma (real HCAs; skipped without one), AddressSanitizer build with the
# bad-input, unit and verbs-on-the-fake tests, the USE_CUDA=ON build of the plugin (compiled
# only, where a CUDA toolkit is installed), benchmark smoke run, the predictor benchmark. The
# AddressSanitizer and USE_CUDA builds run in the background at the lowest priority behind the
# test phases before them (bg_build_start). Prints the time of each phase. When CI=true and running as root, a skipped lab test is a failure (the lab
# must really run in CI).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
LONG=0
[ "${1:-}" = "--long" ] && LONG=1

t_start=$(date +%s)
declare -a SUMMARY
fail=0
phase() {  # phase NAME CMD...
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== phase: $name"
  "$@"
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local verdict=ok
  [ $rc -ne 0 ] && verdict="FAILED (rc $rc)"
  [ $rc -eq 0 ] && [ -n "${PHASE_NOTE:-}" ] && verdict="ok ($PHASE_NOTE)"
  PHASE_NOTE=""
  SUMMARY+=("$(printf '%-58s %5ss  %s' "$name" "$dt" "$verdict")")
  [ $rc -ne 0 ] && fail=1
  return $rc
}

LOGDIR=$ROOT/build/test-logs
run_ctest() {  # run_ctest BUILD_DIR LOGNAME ARGS...
  local dir=$1 log=$2; shift 2
  mkdir -p "$LOGDIR"
  (cd "$dir" && ctest --output-on-failure "$@") 2>&1 | tee "$LOGDIR/$log.log"
  return "${PIPESTATUS[0]}"
}

check_lab_not_skipped() {
  if [ "${CI:-}" = "true" ] && [ "$(id -u)" -eq 0 ]; then
    if grep -E 'lab_.*(Skipped|Not Run)' "$LOGDIR/lab.log" >/dev/null 2>&1; then
      echo "lab tests were skipped although CI=true and running as root:" >&2
      grep -E 'lab_.*(Skipped|Not Run)' "$LOGDIR/lab.log" >&2
      return 1
    fi
  fi
  return 0
}

# Each build directory's cmake options (build/: Release with warnings as errors, shared with
# demo.sh and the benchmarks; build-asan/; build-cuda/).
source scripts/build_config.sh
configure_and_build() {  # configure_and_build DIR "CMAKE_OPTS..." [cmake --build args...]
  local dir=$1 opts=$2; shift 2
  local -n o=$opts
  cmake -S . -B "$dir" "${o[@]}" >/dev/null && cmake --build "$dir" -j "$JOBS" "$@"
}

# A build started in the background at the lowest CPU priority (and idle I/O priority, where
# the disk's scheduler has one), while the test phases run: those wait on sockets, timers and
# namespaces much of the time, and the build takes what they leave (a test process that wakes
# preempts it at once). Its output goes to $LOGDIR/NAME.log; bg_build_wait prints it and its
# exit status as a phase of its own.
declare -A BG_PID BG_T0
bg_build_start() {  # bg_build_start NAME DIR "CMAKE_OPTS..." [cmake --build args...]
  local name=$1; shift
  mkdir -p "$LOGDIR"
  BG_T0[$name]=$(date +%s)
  set -m  # its own process group, so that the trap below reaches make and the compilers
  (
    renice -n 19 -p "$BASHPID" >/dev/null  # the compilers it starts inherit both
    ionice -c 3 -p "$BASHPID" 2>/dev/null
    configure_and_build "$@"
  ) >"$LOGDIR/$name.log" 2>&1 &
  BG_PID[$name]=$!
  set +m
}
# A run that ends early (a failed phase's exit, ^C, a kill) takes its background builds with it.
trap 'for p in "${BG_PID[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
bg_build_wait() {  # bg_build_wait NAME: the build's exit status; its log on stdout
  local name=$1 rc
  wait "${BG_PID[$name]}"
  rc=$?
  unset 'BG_PID[$name]'  # waited for: its process group id may be reused
  cat "$LOGDIR/$name.log"
  PHASE_NOTE="started in the background $(( $(date +%s) - BG_T0[$name] ))s ago"
  return $rc
}

phase "setup" bash scripts/setup.sh || exit 1
phase "build" configure_and_build build R2CCL_BUILD_OPTS || {
  printf '%s\n' "${SUMMARY[@]}"; exit 1; }
# Only what the AddressSanitizer phase runs (target r2ccl_asan_phase, tests/CMakeLists.txt:
# keep the two in step), built behind the unit, loopback and lab phases.
bg_build_start asan-build build-asan R2CCL_ASAN_BUILD_OPTS --target r2ccl_asan_phase
phase "unit + abi" run_ctest build unit_abi -j "$JOBS" -L 'unit|abi'
# Loopback and AddressSanitizer tests run two at a time ($JOBS): they wait on sockets and timers
# more than they compute, and their timing bounds hold on 2 busy cores (they must: the failure
# detectors' whole point is not to be fooled by load), except the verbs tests on the fake
# provider (RUN_SERIAL, tests/CMakeLists.txt: its NIC is a thread of the starved process). The
# lab runs alone: its tests share one set of namespaces.
phase "loopback" run_ctest build loopback -j "$JOBS" -L loopback
phase "lab" run_ctest build lab -L lab
phase "lab tests really ran" check_lab_not_skipped
rdma_tests() {  # the rdma label; notes in the summary when it was skipped (no HCA here)
  run_ctest build rdma -L rdma || return $?
  grep -q "Skipped" "$LOGDIR/rdma.log" && PHASE_NOTE="skipped: no active HCA"
  return 0
}
phase "rdma (real HCAs)" rdma_tests
if [ $LONG -eq 1 ]; then
  phase "long" run_ctest build long -L long
fi
phase "asan build (background)" bg_build_wait asan-build
HAVE_CUDA=0
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  HAVE_CUDA=1  # compiled behind the AddressSanitizer tests
  bg_build_start cuda-build build-cuda R2CCL_CUDA_BUILD_OPTS --target nccl-net-r2ccl r2ccl_snapshot
fi
# unit_test_fakeverbs (the fake provider's own timing-based scenarios) is left out here: under
# ASan on 2 cores its cross-process throughput scenario has missed its deadline; it runs in
# the plain build above, and the plugin's verbs code runs under ASan through ib_fake. The
# shared suite runs only for TCP here (tests/CMakeLists.txt: the build-asan tree has no
# loopback_test_shared_ib).
phase "bad input, unit, shared suite, verbs, snapshotd under asan" run_ctest build-asan asan -j "$JOBS" -R 'bad_input|unit_|shared|ib_fake|snapshotd' -E 'unit_test_fakeverbs'
if [ $HAVE_CUDA -eq 1 ]; then
  phase "USE_CUDA build (compile only, background)" bg_build_wait cuda-build
else
  echo "=== no CUDA toolkit: the USE_CUDA=ON build is not compiled here"
fi
phase "benchmark smoke" bash scripts/bench_net.sh --smoke --build build
phase "predictor benchmark" bash scripts/bench_predict.sh --build build
phase "snapshot benchmark smoke" bash scripts/bench_snapshot.sh --quick build

echo
echo "=== summary ($(( $(date +%s) - t_start ))s total)"
printf '%s\n' "${SUMMARY[@]}"
exit $fail
