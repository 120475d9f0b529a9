#!/usr/bin/env bash
# Where build time goes: configures a NEW build directory, builds it with every compile and
# link run through this script (CMAKE_<LANG>_COMPILER_LAUNCHER, CMAKE_CXX_LINKER_LAUNCHER),
# and prints the wall time, the CPU time (user + sys of the whole build), the load average
# before and after, the CPU seconds by kind (libraries and tools, tests, links) and the
# costliest commands. docs/BENCHMARKS.md ("Build time") was measured with it.
#   scripts/build_time.sh [--jobs N] [--top N] [--target T] BUILD_DIR [cmake options...]
#   e.g. scripts/build_time.sh /tmp/bt-plain -DCMAKE_BUILD_TYPE=Release -DR2CCL_WERROR=ON
# Other processes compiling at the same time inflate both times: compare runs at the same load.
set -uo pipefail

if [ -n "${R2CCL_BUILD_TIME_LOG:-}" ] && [ $# -gt 0 ] && [ "${1#-}" = "$1" ] && [ ! -d "$1" ]; then
  # Launcher mode (called by the build): run the command, log "cpu_s wall_s output".
  t=$(mktemp /tmp/r2ccl-bt.XXXXXX)
  /usr/bin/time -f "%U %S %e" -o "$t" "$@"
  rc=$?
  out="" prev=""
  for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
  read -r u s w < <(tail -1 "$t")
  rm -f "$t"
  echo "$u $s $w ${out:-$1}" | awk '{printf "%.2f %.2f %s\n", $1 + $2, $3, $4}' >>"$R2CCL_BUILD_TIME_LOG"
  exit $rc
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SELF=$ROOT/scripts/build_time.sh
JOBS=$(nproc) TOP=15 TARGET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) JOBS=$2; shift 2 ;;
    --top) TOP=$2; shift 2 ;;
    --target) TARGET=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
BUILD=$1; shift
if [ -e "$BUILD" ]; then
  echo "build_time.sh: $BUILD exists; give a new directory (a clean build is what is measured)" >&2
  exit 2
fi
[ -x /usr/bin/time ] || { echo "build_time.sh: needs /usr/bin/time (Debian: time)" >&2; exit 2; }
mkdir -p "$BUILD"
BUILD=$(cd "$BUILD" && pwd)
LOG=$BUILD/build-time.log
: >"$LOG"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_C_COMPILER_LAUNCHER="$SELF" -DCMAKE_CXX_COMPILER_LAUNCHER="$SELF" \
  -DCMAKE_CXX_LINKER_LAUNCHER="$SELF" "$@" >"$BUILD/build-time.configure.log" 2>&1 || {
  cat "$BUILD/build-time.configure.log" >&2; exit 1; }
export R2CCL_BUILD_TIME_LOG=$LOG  # from here on, the launcher logs
load0=$(cut -d' ' -f1-3 /proc/loadavg)
t0=$(date +%s.%N)
/usr/bin/time -f "%U %S" -o "$BUILD/build-time.cpu" \
  cmake --build "$BUILD" -j "$JOBS" ${TARGET:+--target "$TARGET"} >"$BUILD/build-time.build.log" 2>&1
rc=$?
t1=$(date +%s.%N)
load1=$(cut -d' ' -f1-3 /proc/loadavg)
read -r cu cs <"$BUILD/build-time.cpu"
echo "build: rc $rc, wall $(echo "$t1 - $t0" | bc | xargs printf '%.0f') s, CPU $(echo "$cu + $cs" | bc | xargs printf '%.0f') s (user $cu, sys $cs), -j$JOBS"
echo "load average (1, 5, 15 min): before $load0, after $load1"
echo "output: $(du -sh "$BUILD" | cut -f1)"
awk '{o=$3; k="libraries and tools"
      if (o ~ /tests?[_\/.]|catch|lab_main|hw_main|fake_snapd|fakeverbs|plaintcp|pch/) k="tests"
      if (o !~ /\.o$/ && o !~ /\.gch$/) k="links"
      c[k]+=$1; n[k]++}
     END {for (k in c) printf "  %-20s %7.1f s CPU  %3d commands\n", k, c[k], n[k]}' "$LOG"
echo "costliest commands (CPU s, wall s, output):"
sort -rn "$LOG" | head -n "$TOP" | sed 's/^/  /'
[ $rc -eq 0 ] || echo "build failed: $BUILD/build-time.build.log" >&2
exit $rc
