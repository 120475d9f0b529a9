#!/usr/bin/env bash
# unit_layers: the net plugin's layering check (net_plugin/check_layers.cmake) passes on the
# tree and fails, naming file and rule, on copies of it with one forbidden include each.
# Usage: test_layers.sh SOURCE_DIR
set -uo pipefail
src=${1:?usage: test_layers.sh SOURCE_DIR}
check="$src/net_plugin/check_layers.cmake"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

if ! out=$(cmake -DROOT="$src/net_plugin" -P "$check" 2>&1); then
  echo "FAIL: the tree itself violates its layering:"; echo "$out"; fail=1
fi

# violation FILE INCLUDE RULE-TEXT: a copy where FILE includes INCLUDE must fail with RULE-TEXT.
violation() {
  local file=$1 inc=$2 rule=$3
  rm -rf "$tmp/np"; cp -r "$src/net_plugin" "$tmp/np"
  printf '#include "%s"\n' "$inc" >> "$tmp/np/$file"
  if out=$(cmake -DROOT="$tmp/np" -P "$check" 2>&1); then
    echo "FAIL: $file including $inc was accepted"; fail=1
  elif ! grep -q "$file: #include \"$inc\": .*$rule" <<<"$out"; then
    echo "FAIL: $file including $inc: the message does not name the file and rule:"; echo "$out"; fail=1
  else
    echo "ok: $file including $inc is refused"
  fi
}
violation transport/tcp/conn.cc transport/ib/wire.h "must not include the other transport"
violation transport/ib/runtime.h transport/tcp/conn.h "must not include the other transport"
violation engine/connection.cc transport/tcp/conn.h "the engine knows only transport/path_io.h"
violation engine/scheduler.h transport/runtime_base.h "the engine knows only transport/path_io.h"
violation api/net_api.cc transport/ib/runtime.h "the API knows only the transport interface"
violation transport/runtime_base.cc transport/tcp/runtime.h "must not include a concrete transport"
violation sock/rails.cc engine/connection.h "below the engine and the transports"
exit $fail
