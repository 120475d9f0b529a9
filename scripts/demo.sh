#!/usr/bin/env bash
# The demo (README command 1): one r2ccl_perf run of a checked AllReduce sweep across 2 ranks
# on 2 rails, three passes over the same connections; while pass 2 is in flight the rail
# carrying traffic is killed. The output shows the table before, during and after, the
# switchover lines and "[R2CCL] Successfully recovered in X s". Exit 0 only if every byte
# checked out and at least one chunk was replayed.
#   scripts/demo.sh            rail lab (2 namespaces, 2 veth rails at 2 Gbit/s, `ip link set
#                              down` on rail 0) when this machine can create namespaces (root);
#                              else the in-process injector on two rails on lo
#   scripts/demo.sh --inproc   always the in-process injector
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=auto
[ "${1:-}" = "--inproc" ] && MODE=inproc

bash scripts/setup.sh
echo "[demo] building (cmake, build/)..."
source scripts/build_config.sh  # build/'s options, the same as test.sh's (no reconfiguring)
cmake -S . -B build "${R2CCL_BUILD_OPTS[@]}" >/dev/null
cmake --build build -j "$(nproc)" --target r2ccl_perf nccl-net-r2ccl >/dev/null
PERF=$PWD/build/bin/r2ccl_perf
# Like NCCL, show no NCCL-logger output unless NCCL_DEBUG is set: the switchover, failback and
# recovery lines still appear once each, as r2ccl's own "[R2CCL]" lines on stderr.
export NCCL_DEBUG=${NCCL_DEBUG:-NONE}
SWEEP=(--op allreduce -b 1M -e 32M -f 2 -n 8 -w 1 --check --repeat 3 --expect-replay)

if [ $MODE = auto ] && bash scripts/railab.sh check >/dev/null 2>&1; then
  P=r2demo
  OUT=$(mktemp -d)
  cleanup() { bash scripts/railab.sh down --prefix $P >/dev/null 2>&1 || true; rm -rf "$OUT"; }
  trap cleanup EXIT
  echo "[demo] rail lab: namespaces ${P}a / ${P}b, rails rail0 rail1 shaped to 2 Gbit/s"
  bash scripts/railab.sh up --rails 2 --rate 2gbit --prefix $P | sed 's/^/[demo] /'
  export R2CCL_SOCKET_IFNAME=rail
  PORT=$((20000 + RANDOM % 20000))
  RDV=(--rendezvous 10.210.250.1:$PORT --nranks 2)
  ip netns exec ${P}b "$PERF" "${RDV[@]}" --rank 1 "${SWEEP[@]}" >"$OUT/rank1.log" 2>&1 &
  R1=$!
  # Kill rail 0 (it carries the traffic: device 0's primary path) in pass 2, during a message
  # of 16 MiB or more, at a moment when it is busy: then chunks are in flight when it dies (the checks between collectives leave
  # the rail idle part of the time, and a fault timed from the log alone could fall into such
  # a gap). Busy: its transmit counter grew at >= 800 Mbit/s over the last few ms, measured by
  # one shell inside the namespace that reads the counter and the clock without starting a
  # process per look (on a loaded machine each `ip netns exec cat` took tens of ms, so a
  # fixed "2 MB in 20 ms" was really over 100 ms or more, and a mostly idle rail passed: a
  # newcomer's demo then killed the rail with nothing in flight and failed), and that then
  # takes the link down at once.
  # Pass 2 and its 8 MiB row done: the sizes still to come are 16 and 32 MiB, whose two ring
  # phases each move 8 or 16 MiB (34-67 ms on a 2 Gbit/s rail), far more than the time from a
  # busy look to the link going down. (Armed from pass 2's start, a busy look could fall at the
  # end of a 1 or 2 MiB message, 4-8 ms long, that finished before the link went down: nothing
  # in flight, nothing replayed, and the demo failed in about 1 run of 6; armed after the
  # 4 MiB row, in 1 run of 14.)
  (
    for _ in $(seq 1 1800); do
      awk '/# pass 2\/3/ { p = 1 } p && $1 == "8388608" { found = 1 } END { exit !found }' \
        "$OUT/rank0.log" 2>/dev/null && break
      sleep 0.1
    done
    ip netns exec ${P}a bash -c '
      f=/sys/class/net/rail0/statistics/tx_bytes
      # ip started now, reading commands from a pipe: the link goes down the moment the line is
      # written, not after a fork and exec (several ms: a message could end meanwhile, and
      # between messages the data checks leave the rail idle).
      coproc IPB { exec ip -batch -; }
      exec {nap}<> <(:)                          # a pipe that stays empty: read -t naps on it
      read -r prev <"$f"; tp=${EPOCHREALTIME/./}
      for ((i = 0; i < 20000; i++)); do
        read -r -t 0.002 -u $nap _
        read -r cur <"$f"; t=${EPOCHREALTIME/./}
        # bits / us = Mbit/s, over at most 10 ms
        if ((10#$t > 10#$tp && 10#$t - 10#$tp <= 10000 &&
              (cur - prev) * 8 >= 800 * (10#$t - 10#$tp))); then break; fi
        prev=$cur; tp=$t
      done
      echo "link set rail0 down" >&"${IPB[1]}"
      echo "[demo] >>> rail0 is busy: taking it down now (ip link set rail0 down in the namespace)"
      eval "exec ${IPB[1]}>&-"                   # end of commands: ip exits
      wait "$IPB_PID"' 
    sleep 3
    echo "[demo] >>> bringing rail0 back up"
    bash scripts/railab.sh fault link-up 0 --prefix $P | sed 's/^/[demo] /'
  ) &
  set +e
  ip netns exec ${P}a "$PERF" "${RDV[@]}" --rank 0 "${SWEEP[@]}" 2>&1 | tee "$OUT/rank0.log"
  rc0=${PIPESTATUS[0]}
  wait $R1
  rc1=$?
  set -e
  echo "[demo] rank 1's switchover lines:"
  grep -E "\[R2CCL\] (switchover|Successfully|failback|path on)" "$OUT/rank1.log" | sed 's/^/[demo]   /' || true
  rc=$(( rc0 != 0 ? rc0 : rc1 ))
else
  echo "[demo] no network namespaces here: two rails on lo (lo@127.0.0.1, lo@127.0.0.2) and the"
  echo "[demo] in-process fault injector resetting rail 0 of rank 0 as pass 2 starts (the reset"
  echo "[demo] fires at the first moment a message is in flight on it)"
  export R2CCL_SOCKET_IFNAME=lo@127.0.0.1,lo@127.0.0.2
  unset R2CCL_FAULT_INJECT
  set +e
  "$PERF" --ranks 2 "${SWEEP[@]}" --inject "rank=0,rail=0,at=50,kind=reset,for=1000" --inject-pass 2
  rc=$?
  set -e
fi
if [ "$rc" -eq 0 ]; then
  echo "[demo] OK: every byte checked out and chunks were replayed through the rail failure"
else
  echo "[demo] FAILED (exit $rc)"
fi
exit "$rc"
