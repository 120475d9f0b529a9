#!/usr/bin/env bash
# Self-test of r2ccl_perf against the PlainTCP baseline plugin: every op, net API v8..v11, 1-4
# ranks, 1-2 channels, 0 B .. 1 MiB, every element checked; plus the failure paths (a plugin
# error, --expect-replay without replays, a bad option) and the multi-host rendezvous mode.
# Usage: perf_selftest.sh PATH/r2ccl_perf PATH/libnccl-net-plaintcp.so
set -u
perf=${1:?usage: perf_selftest.sh R2CCL_PERF PLAINTCP_SO}
plugin=${2:?usage: perf_selftest.sh R2CCL_PERF PLAINTCP_SO}
fails=0
log=$(mktemp)
trap 'rm -f "$log" "$log".*' EXIT

ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; sed 's/^/     | /' "$log" | tail -20; fails=$((fails + 1)); }

# expect_ok DESCRIPTION ARGS...: exit 0 and "# wrong total: 0"
expect_ok() {
  local what=$1; shift
  if "$perf" --plugin "$plugin" --timeout 120 "$@" >"$log" 2>&1 && grep -q '^# wrong total: 0$' "$log"; then
    ok "$what"
  else
    bad "$what"
  fi
}

for op in allreduce allgather broadcast sendrecv; do
  for api in 8 9 10 11; do
    for ranks in 2 3; do
      expect_ok "$op v$api ranks=$ranks channels=2" --op "$op" --net-api "$api" --ranks "$ranks" \
        --channels 2 -b 0 -e 1M -n 2 -w 1 --check
    done
  done
  expect_ok "$op ranks=1" --op "$op" --ranks 1 -b 0 -e 64K -n 2 -w 1 --check
  expect_ok "$op ranks=4 slice=4K inflight=8" --op "$op" --ranks 4 -b 0 -e 256K -n 2 -w 1 \
    --check --slice 4K --inflight 8
  PLAINTCP_NULL_EVERY=3 expect_ok "$op with NULL requests (call again)" --op "$op" --ranks 3 \
    -b 0 -e 256K -n 2 -w 1 --check --slice 16K
done
expect_ok "repeat 2, odd sizes by steps" --op allgather --ranks 3 -b 5 -e 200 -i 37 -n 2 --check --repeat 2

# Multi-host mode, on loopback (another port if the random one is taken).
rendezvous_run() {
  local port=$((20000 + RANDOM % 20000))
  "$perf" --plugin "$plugin" --rendezvous 127.0.0.1:$port --rank 1 --nranks 2 -b 0 -e 64K -n 2 \
    --check --timeout 60 >"$log.1" 2>&1 &
  local pid=$!
  "$perf" --plugin "$plugin" --rendezvous 127.0.0.1:$port --rank 0 --nranks 2 -b 0 -e 64K -n 2 \
    --check --timeout 60 >"$log" 2>&1
  local rc0=$?
  wait $pid
  local rc1=$?
  cat "$log.1" >>"$log"
  [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && grep -q '^# wrong total: 0$' "$log"
}
if rendezvous_run || { grep -q 'cannot listen' "$log" && rendezvous_run; }; then
  ok "rendezvous mode"
else
  bad "rendezvous mode"
fi

# Failure paths must fail, and say why.
if PLAINTCP_FAIL_SEND_AFTER=20 "$perf" --plugin "$plugin" -b 0 -e 64K >"$log" 2>&1; then
  bad "plugin error exits non-zero"
elif grep -q 'rank [01]: isend(channel 0) failed: ncclSystemError (2)' "$log"; then
  ok "plugin error exits non-zero and names the call"
else
  bad "plugin error message"
fi
if "$perf" --plugin "$plugin" -b 0 -e 64K -n 2 --expect-replay >"$log" 2>&1; then
  bad "--expect-replay without replays exits non-zero"
elif grep -q 'expect-replay: 0 replayed chunk(s) over all ranks: FAILED' "$log"; then
  ok "--expect-replay without replays exits non-zero"
else
  bad "--expect-replay message"
fi
"$perf" --no-such-option >"$log" 2>&1
if [ $? -eq 2 ]; then ok "usage error exits 2"; else bad "usage error exits 2"; fi
if "$perf" --plugin "$plugin" --help | grep -q -- '--expect-replay'; then ok "--help"; else bad "--help"; fi

if [ $fails -ne 0 ]; then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all checks passed"
