#!/usr/bin/env bash
# Two-node check of the verbs transport on real InfiniBand/RoCE hardware: what the fake verbs
# provider cannot prove (real HCAs, real QP timeouts, a real port going down).
#
# Run the same command on both nodes, rank 0 first:
#   node A:  scripts/ib_two_node.sh --rank 0 --peer nodeA:29500 [--fault ...]
#   node B:  scripts/ib_two_node.sh --rank 1 --peer nodeA:29500
# --peer is rank 0's address for the rendezvous (r2ccl_perf --rendezvous); the side channel
# uses R2CCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME like NCCL's bootstrap.
#
# Options:
#   --rank R             0 or 1
#   --peer HOST:PORT     rank 0's rendezvous address
#   --hca SPEC           R2CCL_IB_HCA (default: every active port; use two or more)
#   --bytes N            message size of the AllReduce loop (default 64M)
#   --iters N            iterations per pass (default 200)
#   --fault KIND:TARGET  rank 0 only: at --at seconds, take one rail down for --for seconds:
#                          netdev:IFNAME   RoCE: ip link set IFNAME down (the HCA's netdev)
#                          port:HCA:PORT   InfiniBand: ibportstate -D 0 PORT disable on the
#                                          local port (needs infiniband-diags, root)
#   --at SEC             when the fault starts (default 5)
#   --for SEC            how long it lasts (default 10)
#   --build DIR          build tree (default build; configured and built if missing)
# Checks: ibv_devinfo lists an active port; r2ccl_perf reports #wrong 0 for every row; with a
# fault, rank 0's log has a "switchover:" and a "Successfully recovered" line, and (when the
# fault ends before the run) a "failback:" line. Exit status 0 only if every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."

rank="" peer="" hca="" bytes=64M iters=200 fault="" at=5 dur=10 build=build
while [ $# -gt 0 ]; do
  case "$1" in
    --rank) rank=$2; shift 2 ;;
    --peer) peer=$2; shift 2 ;;
    --hca) hca=$2; shift 2 ;;
    --bytes) bytes=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --fault) fault=$2; shift 2 ;;
    --at) at=$2; shift 2 ;;
    --for) dur=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "ib_two_node.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ "$rank" = 0 ] || [ "$rank" = 1 ] || { echo "ib_two_node.sh: --rank must be 0 or 1" >&2; exit 2; }
[ -n "$peer" ] || { echo "ib_two_node.sh: --peer HOST:PORT is required" >&2; exit 2; }
if [ -n "$fault" ] && [ "$rank" != 0 ]; then
  echo "ib_two_node.sh: --fault is for rank 0 only" >&2; exit 2
fi

scripts/setup.sh --rdma
if ! ibv_devinfo 2>/dev/null | grep -q "PORT_ACTIVE"; then
  echo "ib_two_node.sh: ibv_devinfo shows no active HCA port on $(hostname)" >&2
  ibv_devinfo >&2 || true
  exit 1
fi
if [ ! -x "$build/bin/r2ccl_perf" ]; then
  source scripts/build_config.sh  # build/'s options, as test.sh, demo.sh and the benchmarks
  cmake -S . -B "$build" "${R2CCL_BUILD_OPTS[@]}" >/dev/null
  cmake --build "$build" -j"$(nproc)" --target nccl-net-r2ccl r2ccl_perf >/dev/null
fi

log=$(mktemp /tmp/r2ccl-ib-two-node.XXXXXX)
export R2CCL_TRANSPORT=ib R2CCL_LOG_FILE="$log"
[ -n "$hca" ] && export R2CCL_IB_HCA="$hca"

inject() {
  local kind=${fault%%:*} target=${fault#*:}
  sleep "$at"
  case "$kind" in
    netdev)
      echo "ib_two_node.sh: fault: ip link set $target down for ${dur}s" >&2
      ip link set "$target" down; sleep "$dur"; ip link set "$target" up ;;
    port)
      local port=${target##*:} dev=${target%%:*}
      echo "ib_two_node.sh: fault: $dev port $port disabled for ${dur}s" >&2
      ibportstate -C "$dev" -D 0 "$port" disable >/dev/null; sleep "$dur"
      ibportstate -C "$dev" -D 0 "$port" enable >/dev/null ;;
    *) echo "ib_two_node.sh: --fault must be netdev:IFNAME or port:HCA:PORT" >&2 ;;
  esac
}
[ -n "$fault" ] && inject &

out=$("$build/bin/r2ccl_perf" --rendezvous "$peer" --rank "$rank" --nranks 2 --check --stats \
      -b "$bytes" -e "$bytes" -n "$iters" --timeout 900 2>&1) || { echo "$out"; echo "r2ccl_perf failed" >&2; exit 1; }
wait
echo "$out"
fail=0
if echo "$out" | awk '/^ +[0-9]/ && $NF != "0" {bad=1} END {exit !bad}'; then
  echo "ib_two_node.sh: FAIL: rows with wrong elements" >&2; fail=1
fi
if [ -n "$fault" ]; then
  grep -q "switchover:" "$log" || { echo "ib_two_node.sh: FAIL: no switchover logged" >&2; fail=1; }
  grep -q "Successfully recovered" "$log" || { echo "ib_two_node.sh: FAIL: no recovery logged" >&2; fail=1; }
  grep -q "failback:" "$log" || echo "ib_two_node.sh: note: no failback logged (did the run end before the rail came back?)" >&2
fi
echo "--- r2ccl events ($log)"; cat "$log"
[ $fail = 0 ] && echo "ib_two_node.sh: PASS" || exit 1
