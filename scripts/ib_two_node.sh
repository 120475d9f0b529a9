#!/usr/bin/env bash
# Two-node check of the verbs transport on real InfiniBand/RoCE hardware: what the fake verbs
# provider cannot prove (real HCAs, real QP timeouts, a real port going down). NOT RUN YET:
# the development machines have no HCA; this is ready for the first two nodes that have them.
#
# Run the same command on both nodes, rank 0 first:
#   node A:  scripts/ib_two_node.sh --rank 0 --peer nodeA:29500 [--suite] [--fault ...]
#   node B:  scripts/ib_two_node.sh --rank 1 --peer nodeA:29500 [--suite] [--fault peer]
# --peer is rank 0's address for the rendezvous (r2ccl_perf --rendezvous); the side channel
# uses R2CCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME like NCCL's bootstrap.
#
# Options:
#   --rank R             0 or 1
#   --peer HOST:PORT     rank 0's rendezvous address (HOST, [IPV6]; PORT 1..65535, and with
#                        --suite PORT+3 at most 65535: check k meets on PORT+k)
#   --suite              run the matrix below, in order, instead of the one AllReduce loop
#   --hca SPEC           R2CCL_IB_HCA (default: every active port; use two or more)
#   --bytes N            message size of the AllReduce loop, and the largest size of the
#                        suite's sweeps (default 64M)
#   --iters N            iterations per size of the loop (default 200)
#   --fault KIND:TARGET  rank 0 only: at --at seconds into the loop, take one rail down for
#                        --for seconds:
#                          netdev:IFNAME   RoCE: ip link set IFNAME down (the HCA's netdev)
#                          port:HCA:PORT   InfiniBand: ibportstate -D 0 PORT disable on the
#                                          local port (needs infiniband-diags, root)
#   --fault peer         rank 1 with --suite: run the port-pull check too (rank 0 pulls)
#   --at SEC             when the fault starts (default 5)
#   --for SEC            how long it lasts (default 10)
#   --gpu                refused: r2ccl_perf moves host memory only (it has no GPU-buffer
#                        option), so no port pull during GPU-buffer traffic is run here. GPU
#                        buffers over a real HCA: tests/hw/test_hw_gpu.cc (one host, ctest -L
#                        rdma, no fault); a fault inside a real NCCL job: scripts/gpu_e2e.sh.
#   --build DIR          build tree (default build; configured and built if missing)
#   --no-setup           do not run scripts/setup.sh --rdma (the host's packages are in place)
#   --dry-run            print the checks and the commands they would run; run nothing
# Suite, in order (every check: r2ccl_perf AllReduce 8 B .. --bytes, x4, --check):
#   1 default        every knob at its default
#   2 ib-timeout-22  NCCL_IB_TIMEOUT=22 (the plugin must say it took it for its own QPs)
#   3 qps16-chunk4k  R2CCL_IB_QPS_PER_PATH=16, R2CCL_CHUNK_SIZE=4096
#   4 port-pull      with --fault: the AllReduce loop (--bytes, --iters) with the fault
# Checks: ibv_devinfo lists an active port; r2ccl_perf exits 0 (with --check: no rank saw a
# wrong element) and rank 0's table has rows, each with #wrong 0; without a fault, no
# "failed (", "switchover" or "give-up" event line; with a fault, rank 0's log has a "switchover:" and a "Successfully recovered" line, and (when the fault
# ends before the run) a "failback:" line (a note if not). One summary line per check; exit
# status 0 only if every check passed, 1 if one failed, 2 for a usage error.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "ib_two_node.sh: $*" >&2; exit 2; }
need() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"; }
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

rank="" peer="" hca="" bytes=64M iters=200 fault="" at=5 dur=10 build=build
suite=0 setup=1 dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --rank) need "$@"; rank=$2; shift 2 ;;
    --peer) need "$@"; peer=$2; shift 2 ;;
    --hca) need "$@"; hca=$2; shift 2 ;;
    --bytes) need "$@"; bytes=$2; shift 2 ;;
    --iters) need "$@"; iters=$2; shift 2 ;;
    --fault) need "$@"; fault=$2; shift 2 ;;
    --at) need "$@"; at=$2; shift 2 ;;
    --for) need "$@"; dur=$2; shift 2 ;;
    --build) need "$@"; build=$2; shift 2 ;;
    --suite) suite=1; shift ;;
    --no-setup) setup=0; shift ;;
    --dry-run) dry=1; shift ;;
    --gpu)
      die "--gpu: r2ccl_perf has no GPU-buffer option (host memory only), so this script runs" \
        "no port pull during GPU-buffer traffic; GPU buffers over a real HCA:" \
        "tests/hw/test_hw_gpu.cc (ctest -L rdma); a fault in a real NCCL job: scripts/gpu_e2e.sh" ;;
    -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
[ "$rank" = 0 ] || [ "$rank" = 1 ] || die "--rank must be 0 or 1, not '$rank'"
[ -n "$peer" ] || die "--peer HOST:PORT is required"
port=${peer##*:} host=${peer%:*}
if [ "$host" = "$peer" ] || [ -z "$host" ] || ! is_uint "$port" || [ "$port" -lt 1 ] ||
   [ "$port" -gt 65535 ]; then
  die "--peer '$peer' is not HOST:PORT or [IPV6]:PORT with PORT 1..65535"
fi
[ $suite = 0 ] || [ "$port" -le 65532 ] || die "--peer: with --suite, PORT+3 must be <= 65535 (got $port)"
[[ $bytes =~ ^[0-9]+[KMG]?$ ]] || die "--bytes '$bytes' is not a size (N, NK, NM or NG)"
is_uint "$iters" && [ "$iters" -ge 1 ] || die "--iters '$iters' is not an integer >= 1"
is_uint "$at" || die "--at '$at' is not a whole number of seconds"
is_uint "$dur" || die "--for '$dur' is not a whole number of seconds"
if [ -n "$fault" ]; then
  if [ "$rank" = 1 ]; then
    [ "$fault" = peer ] || die "--fault KIND:TARGET is for rank 0 only; rank 1 takes --fault peer (with --suite)"
    [ $suite = 1 ] || die "--fault peer needs --suite (without it rank 1 needs no option for a fault)"
  else
    case "$fault" in
      netdev:?*) ;;
      port:?*:?*) is_uint "${fault##*:}" || die "--fault '$fault': PORT of port:HCA:PORT is a number" ;;
      *) die "--fault '$fault' must be netdev:IFNAME or port:HCA:PORT" ;;
    esac
  fi
fi

if [ $dry = 0 ]; then
  [ $setup = 0 ] || scripts/setup.sh --rdma
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
fi

export R2CCL_TRANSPORT=ib
[ -n "$hca" ] && export R2CCL_IB_HCA="$hca"

inject() {  # rank 0, in the background: the fault of --fault, --at s from now, for --for s
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
  esac
}
inject_text() {
  local kind=${fault%%:*} target=${fault#*:}
  case "$kind" in
    netdev) echo "sleep $at; ip link set $target down; sleep $dur; ip link set $target up" ;;
    port) echo "sleep $at; ibportstate -C ${target%%:*} -D 0 ${target##*:} disable; sleep $dur;" \
            "ibportstate -C ${target%%:*} -D 0 ${target##*:} enable" ;;
  esac
}

results=() fail=0
summary() {  # summary NAME PASS|FAIL|DRY-RUN DETAIL
  results+=("ib_two_node.sh: check $1: $2${3:+ ($3)}")
  [ "$2" != FAIL ] || fail=1
}

# check NAME RDV FAULT(0/1) "ENV=V ..." PERF_ARGS...: one r2ccl_perf run between the two nodes.
check() {
  local name=$1 rdv=$2 with_fault=$3 envs=$4; shift 4
  local cmd=(env $envs "$build/bin/r2ccl_perf" --rendezvous "$rdv" --rank "$rank" --nranks 2
             --check --stats "$@" --timeout 900)
  echo "=== ib_two_node.sh: check $name: ${cmd[*]}"
  if [ $dry = 1 ]; then
    [ "$with_fault" = 1 ] && [ "$rank" = 0 ] && echo "    and in the background: $(inject_text)"
    summary "$name" DRY-RUN "not run"
    return
  fi
  local log; log=$(mktemp "/tmp/r2ccl-ib-two-node-$name.XXXXXX")
  local out rc=0 why=()
  [ "$with_fault" = 1 ] && [ "$rank" = 0 ] && { inject & }
  out=$(R2CCL_LOG_FILE="$log" "${cmd[@]}" 2>&1) || rc=$?
  wait
  echo "$out"
  echo "--- r2ccl events ($log)"; cat "$log"
  [ $rc = 0 ] || why+=("r2ccl_perf exit $rc")
  # Rank 0 prints the table; every rank's exit status counts its own wrong elements.
  if [ "$rank" = 0 ] && ! awk '/^ +[0-9]/ {n++} END {exit !(n > 0)}' <<<"$out"; then
    why+=("no result rows")
  fi
  if awk '/^ +[0-9]/ && $NF != "0" {bad=1} END {exit !bad}' <<<"$out"; then
    why+=("rows with wrong elements")
  fi
  if [ "$with_fault" = 1 ]; then
    if [ "$rank" = 0 ]; then
      grep -q "switchover:" "$log" || why+=("no switchover logged")
      grep -q "Successfully recovered" "$log" || why+=("no recovery logged")
      grep -q "failback:" "$log" ||
        echo "ib_two_node.sh: note: no failback logged (did the run end before the rail came back?)" >&2
    fi
  else
    local bad; bad=$(grep -cE "failed \(|switchover|give-up" "$log" || true)
    [ "$bad" = 0 ] || why+=("$bad path failure/switchover/give-up lines without a fault")
  fi
  # Rank 0 prints the plugin's WARN lines (other ranks' output is quiet).
  if [ "$rank" = 0 ] && [[ $envs == *NCCL_IB_TIMEOUT=22* ]] && ! grep -q "NCCL_IB_TIMEOUT=22 is used" <<<"$out"; then
    why+=("the plugin did not report taking NCCL_IB_TIMEOUT=22 (run with NCCL_DEBUG=WARN)")
  fi
  if [ ${#why[@]} = 0 ]; then
    summary "$name" PASS "log $log"
  else
    local IFS=';'
    summary "$name" FAIL "${why[*]}; log $log"
  fi
}

rdv_at() { echo "$host:$((port + $1))"; }
if [ $suite = 1 ]; then
  sweep=(-b 8 -e "$bytes" -f 4 -n 20)
  check default "$(rdv_at 0)" 0 "" "${sweep[@]}"
  check ib-timeout-22 "$(rdv_at 1)" 0 "NCCL_IB_TIMEOUT=22" "${sweep[@]}"
  check qps16-chunk4k "$(rdv_at 2)" 0 "R2CCL_IB_QPS_PER_PATH=16 R2CCL_CHUNK_SIZE=4096" "${sweep[@]}"
  if [ -n "$fault" ]; then
    check port-pull "$(rdv_at 3)" 1 "" -b "$bytes" -e "$bytes" -n "$iters"
  else
    summary port-pull SKIP "no --fault given"
  fi
else
  check allreduce-loop "$peer" "$([ -n "$fault" ] && echo 1 || echo 0)" "" -b "$bytes" -e "$bytes" -n "$iters"
fi

printf '%s\n' "${results[@]}"
if [ $fail = 0 ]; then
  [ $dry = 1 ] && echo "ib_two_node.sh: dry run, nothing ran" || echo "ib_two_node.sh: PASS"
else
  echo "ib_two_node.sh: FAIL" >&2
  exit 1
fi
