#!/usr/bin/env bash
# shellcheck disable=SC2015,SC2013
# (SC2015: "A && B || die" validation is intended. SC2013: pid files hold words.)
# railab.sh - the r2ccl rail lab: two network namespaces joined by N veth "rails" (through a
# bridge namespace) plus an out-of-band link, with real kernel-level faults on any rail.
# Run `railab.sh --help` for the commands; docs/RAIL-LAB.md for the topology and fault details.
set -euo pipefail

PROG=${0##*/}
PREFIX=${R2CCL_RAILAB_PREFIX:-r2l}
MAX_RAILS=8
QUEUE_PORT_BASE=5250   # queue-start uses iperf3 port QUEUE_PORT_BASE + rail

usage() {
  cat <<'EOF'
railab.sh - rail lab for r2ccl: real multi-rail faults with network namespaces (needs root)

USAGE
  railab.sh up     [--rails N] [--rate RATE[,RATE...]] [--latency MS] [--burst BYTES] [--mtu N] [--prefix P]
  railab.sh down   [--prefix P]
  railab.sh fault  KIND RAIL [ARGS] [--side a|b] [--prefix P]
  railab.sh status [--prefix P]
  railab.sh exec   a|b|br CMD [ARGS...]        (options such as --prefix go before a|b|br)
  railab.sh check                             exit 0 if namespaces work here, else 77 (skip)
  railab.sh deps                              apt-get install the tools the lab uses, if missing
  railab.sh --help

TOPOLOGY (prefix P, default r2l; env R2CCL_RAILAB_PREFIX also sets it)
  namespaces  Pa (side a), Pb (side b), Pbr (bridge in the middle of every rail)
  rail i      Pa:rail<i> 10.210.<i>.1/24 --veth-- Pbr:a<i> [bridge br<i>] Pbr:b<i> --veth-- Pb:rail<i> 10.210.<i>.2/24
  oob         Pa:oob 10.210.250.1/24 ----------- direct veth ------------- Pb:oob 10.210.250.2/24
  Every rail goes through the bridge namespace, so every fault kind works on every rail:
  downing a device on one side leaves the other side's carrier up (a far-end failure seen
  from there). The oob link is never faulted. IPv6 is disabled in the lab namespaces.
  TSO/GSO are off on every lab veth, so loss and shaping act per 1500-byte segment.

UP OPTIONS
  --rails N      number of rails, 1..8 (default 2)
  --rate RATE[,RATE...]
                 shape every rail, both directions, with tc tbf (e.g. 2gbit, 200mbit, 500kbit;
                 units are bits: bit, kbit, mbit, gbit, or k/m/g). Default: unshaped.
                 A comma list gives each rail its own rate, rail 0 first (one per rail:
                 --rails 2 --rate 2gbit,500mbit); unequal rails for the scheduler's tests.
                 Shape test rails: unshaped veth is CPU-bound and noisy on small machines.
  --latency MS   tbf queue size expressed as time at RATE (default 20): the most queueing delay
                 a saturated rail can add
  --burst BYTES  tbf bucket (default: 1 ms worth of RATE; never below 128 KiB, see the docs)
  --mtu N        MTU of rails and oob (default 1500)
  `up` on an existing lab with the same prefix tears it down first. Prints a summary.

FAULT KINDS  (RAIL is the rail index; --side defaults to a)
  link-down | link-up       ip link set rail<RAIL> down/up in the side's namespace; that side
                            loses carrier, the other side keeps carrier (bridge in between)
  far-down  | far-up        down/up the bridge's leg towards the OTHER side (side a: the br<->b
                            leg); the side's own carrier stays up, traffic stops
  blackhole [--local] | unblackhole
                            silent black hole, both directions, link and carrier stay up:
                            nft drops every frame (ARP too) arriving at the side's rail<RAIL>
                            (netdev ingress hook) and every frame the side sends, on the wire
                            (bridge ingress), so no TCP stack sees a local error. --local drops
                            the side's outgoing frames on its own egress hook instead (its TCP
                            then sees local drops and retries every ~0.5 s without backoff)
  loss PERMILLE | noloss    random drop of single segments on the wire (bridge ingress):
                            numgen random mod 1000 < PERMILLE (10 = 1 %); both directions
                            unless --side X is given (then only frames sent by X)
  rate RATE | rate restore  rate collapse: tbf rate on rail<RAIL> becomes RATE (both directions
                            unless --side is given); `restore` (alias kind: rate-restore) puts
                            back the lab's --rate (the rail's own with a per-rail list), or
                            removes shaping on an unshaped lab
  queue-start [--streams N] | queue-stop
                            queueing delay: N (default 4) competing iperf3 TCP (cubic) streams
                            saturate the rail from the side towards the other side (pids kept
                            under /run/r2ccl-railab-P/); queue-stop ends them (SIGKILL). Delay
                            measured at 2gbit: 1 stream 2.5 ms, 4: 3.5, 16: 8.7, 64: ~20 (the
                            --latency bound)
  flap [--for SEC] [--seed S] [--min-ms A] [--max-ms B] [--far]
                            toggle the link down/up for SEC seconds (default 10), each state held
                            a random A..B ms (default 50..500) drawn from seed S (default:
                            random, always printed); starts with down, always ends up.
                            --far flaps the far leg instead of the side's own device.

  Every action prints one line:  [SEC.USEC] [railab] P fault KIND rail=R side=S ... took_us=N
  SEC.USEC is CLOCK_MONOTONIC (same clock and format as the plugin's log lines), read just
  BEFORE the kernel command, so the fault never looks later than it was; took_us is how long
  the command took. A test subtracts it from the plugin's switchover time.

OTHER
  status   per rail and side: admin state, carrier, tbf rate, nft faults (with drop counters),
           running queue flows; also the bridge legs.
  exec     ip netns exec Pa|Pb|Pbr CMD...
  check    exit 0 when root and namespaces + veth can be created here; otherwise prints why
           and exits 77 (what test suites treat as "skipped").
  down     kills processes left in the lab namespaces (queue flows, forgotten servers),
           deletes the namespaces (which deletes every lab veth); never fails.

EXAMPLES
  railab.sh up --rails 4 --rate 2gbit
  railab.sh exec b iperf3 -s -B 10.210.0.2 -1 -D
  railab.sh exec a iperf3 -c 10.210.0.2 -B 10.210.0.1 -t 3
  railab.sh fault link-down 1
  railab.sh fault far-down 0
  railab.sh fault blackhole 2 --side b
  railab.sh fault loss 0 10          # 1 % loss on rail 0
  railab.sh fault rate 3 200mbit ; railab.sh fault rate 3 restore
  railab.sh fault queue-start 0 --streams 8 ; railab.sh fault queue-stop 0
  railab.sh fault flap 1 --for 5 --seed 42 --min-ms 100 --max-ms 300
  railab.sh status
  railab.sh down

NOT POSSIBLE HERE
  No netem: no fixed added delay, reordering or corruption. Use the plugin's in-process
  injector (R2CCL_FAULT_INJECT, see r2ccl_fault_inject --help) for a fixed delay.
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 1; }
warn() { echo "$PROG: warning: $*" >&2; }

# ---- clock ---------------------------------------------------------------------------------
# CLOCK_MONOTONIC in nanoseconds. /proc/timer_list's "now at N nsecs" is ktime_get(), i.e.
# CLOCK_MONOTONIC, and reading it with bash builtins costs ~0.2 ms (no fork). Fallback: python3.
mono_now() { # sets MONO_NS (no subshell, so no fork on the fast path)
  local l n=0
  if [[ -r /proc/timer_list ]]; then
    while IFS= read -r l; do
      if [[ $l == "now at "* ]]; then
        l=${l#now at }
        MONO_NS=${l%% nsecs*}
        return 0
      fi
      n=$((n + 1))
      ((n > 8)) && break
    done </proc/timer_list
  fi
  local py=python3
  [[ -x /usr/bin/python3 ]] && py=/usr/bin/python3
  MONO_NS=$("$py" -c 'import time; print(time.monotonic_ns())')
}
mono_ns() {
  mono_now
  echo "$MONO_NS"
}
fmt_ns() { printf '%d.%06d' $(($1 / 1000000000)) $((($1 / 1000) % 1000000)); }
mono() { fmt_ns "$(mono_ns)"; }
event() { echo "[$(mono)] [railab] $PREFIX $*"; }
# A fault line is stamped with the time taken just BEFORE the kernel command (stamp), so the
# fault never looks later than it was; took_us says how long the command itself took.
T_FAULT=0
stamp() {
  mono_now
  T_FAULT=$MONO_NS
}
event_t() {
  mono_now
  echo "[$(fmt_ns "$T_FAULT")] [railab] $PREFIX $* took_us=$(((MONO_NS - T_FAULT) / 1000))"
}

# ---- helpers -------------------------------------------------------------------------------
ns_a() { echo "${PREFIX}a"; }
ns_b() { echo "${PREFIX}b"; }
ns_br() { echo "${PREFIX}br"; }
state_dir() { echo "/run/r2ccl-railab-$PREFIX"; }
ns_exists() { [[ -e /run/netns/$1 ]]; }
side_ns() {
  case $1 in
    a) ns_a ;;
    b) ns_b ;;
    br) ns_br ;;
    *) die "side must be a or b (got '$1')" ;;
  esac
}
join_c() { local IFS=,; echo "$*"; }
other_side() { if [[ $1 == a ]]; then echo b; else echo a; fi; }

check_prefix() {
  [[ $PREFIX =~ ^[A-Za-z0-9_-]{1,24}$ ]] || die "bad --prefix '$PREFIX' (letters, digits, _ and -, at most 24)"
}

# rate string -> bits per second (integer). Units are bits (tc's "bps" means bytes: refused).
parse_rate() {
  local r=${1,,} num unit mul
  if [[ $r =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit|k|m|g|t)?$ ]]; then
    num=${BASH_REMATCH[1]}
    unit=${BASH_REMATCH[3]}
  else
    die "bad rate '$1' (examples: 2gbit, 200mbit, 500kbit)"
  fi
  case $unit in
    '' | bit) mul=1 ;;
    k | kbit) mul=1000 ;;
    m | mbit) mul=1000000 ;;
    g | gbit) mul=1000000000 ;;
    t | tbit) mul=1000000000000 ;;
  esac
  local bps
  bps=$(awk -v n="$num" -v m="$mul" 'BEGIN { printf "%.0f", n * m }')
  ((bps >= 8000)) || die "rate '$1' is below 8kbit"
  echo "$bps"
}
human_rate() {
  awk -v b="$1" 'BEGIN { if (b >= 1e9) printf "%.3gGbit", b/1e9; else if (b >= 1e6) printf "%.4gMbit", b/1e6; else printf "%.4gKbit", b/1e3 }'
}

state_get() { # key [default]
  local f
  f="$(state_dir)/lab.conf"
  if [[ -r $f ]]; then
    local v
    v=$(sed -n "s/^$1=//p" "$f" | tail -n1)
    if [[ -n $v ]]; then
      echo "$v"
      return
    fi
  fi
  echo "${2:-}"
}

require_lab() {
  ns_exists "$(ns_a)" && ns_exists "$(ns_b)" && ns_exists "$(ns_br)" ||
    die "no rail lab with prefix '$PREFIX' (run: $PROG up --prefix $PREFIX)"
}
require_rail() {
  [[ $1 =~ ^[0-9]+$ ]] || die "RAIL must be a rail index, got '$1'"
  local n
  n=$(state_get rails "$MAX_RAILS")
  (($1 < n)) || die "rail $1 does not exist (lab has $n rails: 0..$((n - 1)))"
}

# tbf on one device; $1 ns, $2 dev, $3 bits/s, $4 latency ms, $5 burst bytes (0 = auto)
tbf_set() {
  local ns=$1 dev=$2 bps=$3 lat=$4 burst=$5 mtu
  mtu=$(state_get mtu 1500)
  # The bucket must hold the largest packet the qdisc can ever hold: TCP hands the qdisc GSO
  # packets of up to 64 KB even with GSO off on the device (software segmentation happens
  # after the qdisc). tbf splits an oversized GSO packet only when it is enqueued, so after a
  # rate change to a smaller bucket, a queued 64 KB packet bigger than the new bucket never
  # leaves and the rail stalls for good. Hence a floor of 128 KiB on every bucket.
  ((burst <= 0)) && burst=$((bps / 8 / 1000)) # default: 1 ms of rate
  ((burst < 131072)) && burst=131072
  ((burst < 2 * (mtu + 100))) && burst=$((2 * (mtu + 100)))
  tc -n "$ns" qdisc replace dev "$dev" root tbf rate "${bps}bit" burst "$burst" latency "${lat}ms"
}
tbf_rate_of() { # prints the tbf rate on ns/dev, or "unshaped"
  local out
  out=$(tc -n "$1" qdisc show dev "$2" 2>/dev/null | sed -n 's/.*qdisc tbf .* rate \([^ ]*\).*/\1/p' | head -n1)
  echo "${out:-unshaped}"
}

# ---- nftables: per side, a table with per-rail jump targets ---------------------------------
# Preferred: table netdev r2ccl_railab, base chains on the ingress and egress hooks of each rail
# device (drops every frame incl. ARP, before the qdisc on egress). Fallback for kernels without
# the egress hook: table inet r2ccl_railab on input/output (IP only).
NFT_TABLE=r2ccl_railab
nft_in() { ip netns exec "$1" nft "${@:2}"; }
# Side namespaces: table netdev r2ccl_railab, per rail a base chain on the ingress hook of
# rail<i> (jumps to rail<i>_bh_in) and one on the egress hook (jumps to rail<i>_bh_out; only
# used by `blackhole --local`; kernels without the netdev egress hook (< 5.16) get no egress
# chain and refuse --local).
nft_setup() { # ns rails
  local ns=$1 n=$2 i rules egress=1
  while :; do
    rules="table netdev $NFT_TABLE {"
    for ((i = 0; i < n; i++)); do
      rules+="
  chain rail${i}_bh_in { }
  chain rail${i}_bh_out { }
  chain rail${i}_in { type filter hook ingress device \"rail$i\" priority -500; jump rail${i}_bh_in; }"
      ((egress)) && rules+="
  chain rail${i}_out { type filter hook egress device \"rail$i\" priority -500; jump rail${i}_bh_out; }"
    done
    rules+="
}"
    if nft_in "$ns" -f - <<<"$rules" 2>/dev/null; then break; fi
    ((egress)) || die "nft setup (netdev ingress) failed in $ns"
    nft_in "$ns" delete table netdev $NFT_TABLE 2>/dev/null || true
    egress=0
    warn "$ns: no nft netdev egress hook here: 'blackhole --local' unavailable"
  done
}
nft_has_egress() { nft_in "$1" list chain netdev $NFT_TABLE rail0_out >/dev/null 2>&1; }
# Bridge namespace: the wire. On the ingress of each bridge leg (a<i>: frames sent by side a on
# rail i; b<i>: frames sent by side b), chain <leg>_bh (blackhole) then <leg>_loss (loss).
# Every frame there is one MTU-sized segment: the sending veth has already segmented TCP's GSO
# packets (on a sender's own egress hook they would still be up to 64 KB).
nft_setup_wire() { # ns rails
  local ns=$1 n=$2 i s rules
  rules="table netdev $NFT_TABLE {"
  for ((i = 0; i < n; i++)); do
    for s in a b; do
      rules+="
  chain $s${i}_bh { }
  chain $s${i}_loss { }
  chain $s${i}_in { type filter hook ingress device \"$s$i\" priority -500; jump $s${i}_bh; jump $s${i}_loss; }"
    done
  done
  rules+="
}"
  nft_in "$ns" -f - <<<"$rules" || die "nft setup (netdev ingress) failed in $ns"
}
nft_chain_set() { # ns "rule"|"" chain...  (one atomic transaction: flush the chains, add the rule)
  local ns=$1 rule=$2 fam cmds="" c
  shift 2
  fam=netdev
  for c in "$@"; do
    cmds+="flush chain $fam $NFT_TABLE $c"$'\n'
    [[ -n $rule ]] && cmds+="add rule $fam $NFT_TABLE $c $rule"$'\n'
  done
  stamp
  nft_in "$ns" -f - <<<"$cmds"
}
nft_chain_desc() { # ns chain -> rule text (without handles) or empty
  nft_in "$1" list chain netdev $NFT_TABLE "$2" 2>/dev/null |
    sed -n '/^[[:space:]]*chain /,/^[[:space:]]*}/p' | sed '1d;$d' | sed 's/^[[:space:]]*//' | grep -v '^$' | paste -sd';' - || true
}

# ---- down ----------------------------------------------------------------------------------
pid_alive() { # a zombie (exited, not yet reaped by its new parent) counts as gone
  local st
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [[ ${st:0:1} != Z ]]
}
kill_pids() { # pids... : TERM, wait up to 2 s, then KILL
  local p alive i
  (($# == 0)) && return 0
  kill -TERM "$@" 2>/dev/null || true
  for ((i = 0; i < 20; i++)); do
    alive=0
    for p in "$@"; do
      pid_alive "$p" && alive=1
    done
    ((alive == 0)) && return 0
    sleep 0.1
  done
  kill -KILL "$@" 2>/dev/null || true
}

cmd_down() {
  local quiet=${1:-} ns pids dir removed=()
  dir=$(state_dir)
  # 1. queue flows we started
  if [[ -d $dir ]]; then
    local f
    for f in "$dir"/queue-rail*.pids; do
      [[ -e $f ]] || continue
      f=${f##*/queue-rail}
      queue_stop "${f%.pids}" quiet
    done
  fi
  # 2. anything else still running inside the lab namespaces (a namespace with processes in it
  #    outlives `ip netns del`, and its veths with it)
  for ns in "$(ns_a)" "$(ns_b)" "$(ns_br)"; do
    ns_exists "$ns" || continue
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
    if [[ -n ${pids// /} ]]; then
      [[ -z $quiet ]] && echo "killing processes left in $ns: $pids"
      # shellcheck disable=SC2086
      kill_pids $pids || true
    fi
  done
  # 3. namespaces (deleting a namespace deletes the veths in it, and their peers)
  for ns in "$(ns_a)" "$(ns_b)" "$(ns_br)"; do
    if ns_exists "$ns"; then
      ip netns del "$ns" 2>/dev/null || warn "could not delete namespace $ns"
      removed+=("$ns")
    fi
  done
  rm -rf "$dir"
  if [[ -z $quiet ]]; then
    if ((${#removed[@]})); then
      event "down namespaces=${removed[*]}"
    else
      echo "railab $PREFIX: nothing to remove"
    fi
  fi
  return 0
}

# ---- up ------------------------------------------------------------------------------------
wait_oper_up() { # ns dev
  local i
  for ((i = 0; i < 50; i++)); do
    [[ $(ip netns exec "$1" cat "/sys/class/net/$2/operstate" 2>/dev/null) == up ]] && return 0
    sleep 0.05
  done
  warn "$1:$2 did not reach operstate up"
}

lab_if_setup() { # ns dev [addr/len]
  local ns=$1 dev=$2 addr=${3:-} mtu
  mtu=$(state_get mtu 1500)
  ip -n "$ns" link set dev "$dev" mtu "$mtu"
  ip netns exec "$ns" ethtool -K "$dev" tso off gso off >/dev/null 2>&1 ||
    warn "ethtool -K $dev tso off gso off failed in $ns"
  [[ -n $addr ]] && ip -n "$ns" addr add "$addr" dev "$dev"
  ip -n "$ns" link set dev "$dev" up
}

cmd_up() {
  local rails=$1 rate=$2 lat=$3 burst=$4 mtu=$5 bps=0 i
  [[ $rails =~ ^[0-9]+$ ]] && ((rails >= 1 && rails <= MAX_RAILS)) || die "--rails must be 1..$MAX_RAILS"
  [[ $lat =~ ^[0-9]+$ ]] && ((lat >= 1)) || die "--latency must be a positive number of ms"
  [[ $burst =~ ^[0-9]+$ ]] || die "--burst must be a number of bytes"
  [[ $mtu =~ ^[0-9]+$ ]] && ((mtu >= 576 && mtu <= 65535)) || die "--mtu must be 576..65535"
  # One rate for every rail, or a comma list with one per rail.
  local rates=() rail_bps=()
  [[ -n $rate ]] && IFS=, read -r -a rates <<<"$rate"
  if ((${#rates[@]} > 1)) && ((${#rates[@]} != rails)); then
    die "--rate: ${#rates[@]} rates for $rails rails (give one rate, or one per rail: RATE0,RATE1,...)"
  fi
  for ((i = 0; i < rails; i++)); do
    if ((${#rates[@]} == 0)); then
      rail_bps[i]=0
    elif ((${#rates[@]} == 1)); then
      rail_bps[i]=$(parse_rate "${rates[0]}")
    else
      rail_bps[i]=$(parse_rate "${rates[i]}")
    fi
  done
  bps=${rail_bps[0]}
  local A B BR
  A=$(ns_a) B=$(ns_b) BR=$(ns_br)

  cmd_down quiet
  mkdir -p "$(state_dir)"
  {
    echo "rails=$rails"
    echo "rate_bps=$bps"
    for ((i = 0; i < rails; i++)); do echo "rate_bps_$i=${rail_bps[i]}"; done
    echo "latency_ms=$lat"
    echo "burst=$burst"
    echo "mtu=$mtu"
  } >"$(state_dir)/lab.conf"

  # Any failure from here on: remove the half-built lab.
  trap 'echo "$PROG: up failed; removing the partial lab" >&2; cmd_down quiet' EXIT

  local ns
  for ns in "$A" "$B" "$BR"; do
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip netns exec "$ns" sh -c 'echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6' 2>/dev/null || true
  done
  for ((i = 0; i < rails; i++)); do
    # Devices are created directly inside the namespaces: nothing ever appears in the root one.
    ip link add "rail$i" netns "$A" type veth peer name "a$i" netns "$BR"
    ip link add "b$i" netns "$BR" type veth peer name "rail$i" netns "$B"
    ip -n "$BR" link add "br$i" type bridge stp_state 0 forward_delay 0
    ip -n "$BR" link set dev "a$i" master "br$i"
    ip -n "$BR" link set dev "b$i" master "br$i"
    lab_if_setup "$BR" "a$i"
    lab_if_setup "$BR" "b$i"
    ip -n "$BR" link set dev "br$i" mtu "$mtu" up
    lab_if_setup "$A" "rail$i" "10.210.$i.1/24"
    lab_if_setup "$B" "rail$i" "10.210.$i.2/24"
  done
  ip link add oob netns "$A" type veth peer name oob netns "$B"
  lab_if_setup "$A" oob 10.210.250.1/24
  lab_if_setup "$B" oob 10.210.250.2/24

  nft_setup "$A" "$rails"
  nft_setup "$B" "$rails"
  nft_setup_wire "$BR" "$rails"
  for ((i = 0; i < rails; i++)); do
    ((rail_bps[i] > 0)) || continue
    tbf_set "$A" "rail$i" "${rail_bps[i]}" "$lat" "$burst"
    tbf_set "$B" "rail$i" "${rail_bps[i]}" "$lat" "$burst"
  done
  for ((i = 0; i < rails; i++)); do
    wait_oper_up "$A" "rail$i"
    wait_oper_up "$B" "rail$i"
  done
  wait_oper_up "$A" oob
  trap - EXIT

  local ratetxt=unshaped
  local ratelist="" r
  for ((i = 0; i < rails; i++)); do
    r=unshaped
    ((rail_bps[i] > 0)) && r=$(human_rate "${rail_bps[i]}")
    ratelist+="${ratelist:+,}$r"
  done
  ((bps > 0)) && ratetxt="$(human_rate "$bps") tbf both directions (latency ${lat}ms, $(tbf_rate_of "$A" rail0) reported by tc)"
  ((${#rates[@]} > 1)) && ratetxt="per rail $ratelist, tbf both directions (latency ${lat}ms)"
  event "up rails=$rails rate=$( ((${#rates[@]} > 1)) && echo "$ratelist" || { ((bps > 0)) && human_rate "$bps" || echo unshaped; })"
  echo "  namespaces : $A (side a)  $B (side b)  $BR (bridge per rail)"
  for ((i = 0; i < rails; i++)); do
    printf '  rail%-2d     : %s:rail%d 10.210.%d.1/24 <-> %s:a%d [br%d] %s:b%d <-> %s:rail%d 10.210.%d.2/24\n' \
      "$i" "$A" "$i" "$i" "$BR" "$i" "$i" "$BR" "$i" "$B" "$i" "$i"
  done
  echo "  oob        : $A:oob 10.210.250.1/24 <-> $B:oob 10.210.250.2/24 (direct, never faulted)"
  echo "  rate       : $ratetxt"
  echo "  mtu        : $mtu, TSO/GSO off, IPv6 off"
  echo "  run in a ns: $PROG exec a|b CMD   (or: ip netns exec $A CMD)"
}

# ---- faults --------------------------------------------------------------------------------
fault_link() { # side rail up|down
  local ns
  ns=$(side_ns "$1")
  stamp
  ip -n "$ns" link set dev "rail$2" "$3"
  event_t "fault link-$3 rail=$2 side=$1 ns=$ns dev=rail$2"
}
fault_far() { # side rail up|down   (the bridge leg towards the other side)
  local other leg
  other=$(other_side "$1")
  leg="$other$2"
  stamp
  ip -n "$(ns_br)" link set dev "$leg" "$3"
  event_t "fault far-$3 rail=$2 side=$1 ns=$(ns_br) dev=$leg (leg to side $other; side $1 carrier stays up)"
}

# Default: a network black hole. Frames arriving at the side's rail<i> are dropped on its
# ingress hook, frames the side sends are dropped on the wire (bridge leg ingress), so neither
# TCP stack sees a local error. --local drops the side's outgoing frames on its own egress hook
# instead: the sending stack then gets NET_XMIT_DROP and TCP treats it as local congestion
# (it retries every ~0.5 s without backing off), like a NIC that stops transmitting.
fault_blackhole() { # side rail on|off local(0/1)
  local side=$1 r=$2 ns cs cb
  ns=$(side_ns "$side")
  cs="flush chain netdev $NFT_TABLE rail${r}_bh_in"$'\n'"flush chain netdev $NFT_TABLE rail${r}_bh_out"$'\n'
  cb="flush chain netdev $NFT_TABLE $side${r}_bh"$'\n'
  if [[ $3 == on ]]; then
    cs+="add rule netdev $NFT_TABLE rail${r}_bh_in counter drop"$'\n'
    if (($4)); then
      nft_has_egress "$ns" || die "blackhole --local needs the nft netdev egress hook (kernel >= 5.16)"
      cs+="add rule netdev $NFT_TABLE rail${r}_bh_out counter drop"$'\n'
    else
      cb+="add rule netdev $NFT_TABLE $side${r}_bh counter drop"$'\n'
    fi
  fi
  stamp
  nft_in "$(ns_br)" -f - <<<"$cb"
  nft_in "$ns" -f - <<<"$cs"
  if [[ $3 == off ]]; then
    event_t "fault unblackhole rail=$r side=$side ns=$ns dev=rail$r"
  elif (($4)); then
    event_t "fault blackhole rail=$r side=$side ns=$ns dev=rail$r mode=local (ingress+egress of rail$r)"
  else
    event_t "fault blackhole rail=$r side=$side ns=$ns dev=rail$r mode=wire (ingress of rail$r + frames it sends, at $(ns_br):$side$r)"
  fi
}

fault_loss() { # side|"" rail permille   (no side: both directions)
  local sides=(a b) s
  [[ -n $1 ]] && sides=("$1")
  [[ $3 =~ ^[0-9]+$ ]] && (($3 <= 1000)) || die "loss takes PERMILLE 0..1000 (10 = 1 %), got '$3'"
  local chains=()
  for s in "${sides[@]}"; do chains+=("$s$2_loss"); done
  if (($3 == 0)); then
    nft_chain_set "$(ns_br)" "" "${chains[@]}"
  else
    nft_chain_set "$(ns_br)" "numgen random mod 1000 < $3 counter drop" "${chains[@]}"
  fi
  if (($3 == 0)); then
    event_t "fault noloss rail=$2 sent_by=$(join_c "${sides[@]}")"
  else
    event_t "fault loss rail=$2 sent_by=$(join_c "${sides[@]}") permille=$3 ns=$(ns_br) (bridge ingress, per segment)"
  fi
}

fault_rate() { # side|"" rail RATE|restore
  local sides=(a b) s ns bps lat burst what
  [[ -n $1 ]] && sides=("$1")
  lat=$(state_get latency_ms 20)
  burst=$(state_get burst 0)
  if [[ $3 == restore ]]; then
    bps=$(state_get "rate_bps_$2" "$(state_get rate_bps 0)")
  else
    bps=$(parse_rate "$3")
  fi
  stamp
  for s in "${sides[@]}"; do
    ns=$(side_ns "$s")
    if ((bps > 0)); then
      tbf_set "$ns" "rail$2" "$bps" "$lat" "$burst"
    else
      tc -n "$ns" qdisc del dev "rail$2" root 2>/dev/null || true
    fi
  done
  what=unshaped
  ((bps > 0)) && what=$(human_rate "$bps")
  if [[ $3 == restore ]]; then
    event_t "fault rate-restore rail=$2 side=$(join_c "${sides[@]}") rate=$what"
  else
    event_t "fault rate rail=$2 side=$(join_c "${sides[@]}") rate=$what"
  fi
}

queue_file() { echo "$(state_dir)/queue-rail$1.pids"; }
queue_stop() { # rail [quiet]
  local f pids t
  f=$(queue_file "$1")
  if [[ -e $f ]]; then
    read -r -a pids <"$f"
    # SIGKILL: a terminated iperf3 would first try to report over its (congested) control
    # connection; the point is that the competing traffic stops now.
    kill -KILL "${pids[@]}" 2>/dev/null || true
    t=$(mono)
    kill_pids "${pids[@]}"
    rm -f "$f"
    [[ -z ${2:-} ]] && echo "[$t] [railab] $PREFIX fault queue-stop rail=$1 pids=$(join_c "${pids[@]}")"
  else
    [[ -z ${2:-} ]] && event "fault queue-stop rail=$1 (no queue flow was running)"
  fi
  return 0
}
fault_queue_start() { # side rail streams
  local side=$1 rail=$2 streams=$3 other src dst port sns dns srv cli i log
  command -v iperf3 >/dev/null || die "queue-start needs iperf3 (railab.sh deps)"
  [[ $streams =~ ^[0-9]+$ ]] && ((streams >= 1 && streams <= 128)) || die "--streams must be 1..128"
  other=$(other_side "$side")
  sns=$(side_ns "$side")
  dns=$(side_ns "$other")
  if [[ $side == a ]]; then src=10.210.$rail.1 dst=10.210.$rail.2; else src=10.210.$rail.2 dst=10.210.$rail.1; fi
  port=$((QUEUE_PORT_BASE + rail))
  queue_stop "$rail" quiet
  [[ $(state_get rate_bps 0) == 0 && $(tbf_rate_of "$sns" "rail$rail") == unshaped ]] &&
    warn "rail $rail is unshaped: the competing flow will load the CPUs rather than build a queue"
  log="$(state_dir)/queue-rail$rail.log"
  setsid ip netns exec "$dns" iperf3 -s -B "$dst" -p "$port" -i 0 </dev/null >"$log" 2>&1 &
  srv=$!
  echo "$srv" >"$(queue_file "$rail")"
  for ((i = 0; i < 50; i++)); do
    ip netns exec "$dns" ss -Htln "sport = :$port" 2>/dev/null | grep -q . && break
    sleep 0.05
  done
  stamp
  setsid ip netns exec "$sns" iperf3 -c "$dst" -B "$src" -p "$port" -P "$streams" -C cubic -t 86400 -i 0 \
    </dev/null >>"$log" 2>&1 &
  cli=$!
  echo "$srv $cli" >"$(queue_file "$rail")"
  sleep 0.2
  pid_alive "$cli" || {
    queue_stop "$rail" quiet
    die "queue flow on rail $rail did not start; see iperf3 output: $(tail -n3 "$log" 2>/dev/null)"
  }
  event_t "fault queue-start rail=$rail side=$side streams=$streams dir=$side->$other port=$port pids=$srv,$cli"
}

fault_flap() { # side rail for_s seed min_ms max_ms far(0/1)
  local side=$1 rail=$2 for_s=$3 seed=$4 minms=$5 maxms=$6 far=$7
  [[ $for_s =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--for takes seconds"
  [[ $minms =~ ^[0-9]+$ && $maxms =~ ^[0-9]+$ ]] && ((minms >= 1 && maxms >= minms)) ||
    die "--min-ms/--max-ms: need 1 <= min <= max"
  [[ -z $seed ]] && seed=$(((RANDOM << 15) | RANDOM))
  [[ $seed =~ ^[0-9]+$ ]] || die "--seed takes a non-negative integer"
  local ns dev what
  if ((far)); then
    ns=$(ns_br) dev="$(other_side "$side")$rail" what=far
  else
    ns=$(side_ns "$side") dev="rail$rail" what=link
  fi
  RANDOM=$seed
  local start end now hold n=0 state=down span=$((maxms - minms + 1))
  start=$(mono_ns)
  end=$((start + $(awk -v s="$for_s" 'BEGIN { printf "%.0f", s * 1e9 }')))
  event "fault flap rail=$rail side=$side kind=$what ns=$ns dev=$dev seed=$seed for=${for_s}s min_ms=$minms max_ms=$maxms"
  # sleep in the background and wait: a signal is then handled at once, not after the sleep
  local nap_pid=""
  nap() { sleep "$1" & nap_pid=$!; wait "$nap_pid" || true; nap_pid=""; }
  trap '[[ -n $nap_pid ]] && kill "$nap_pid" 2>/dev/null; ip -n "$ns" link set dev "$dev" up 2>/dev/null; event "fault flap rail=$rail interrupted, $what up"; exit 130' INT TERM
  while :; do
    stamp
    ip -n "$ns" link set dev "$dev" "$state"
    n=$((n + 1))
    hold=$((minms + ((RANDOM << 15) | RANDOM) % span))
    event_t "fault flap rail=$rail toggle=$n $what-$state dev=$dev hold_ms=$hold"
    now=$(mono_ns)
    if ((now + hold * 1000000 >= end)); then
      # Last state: hold what is left of the window, then finish with the link up.
      local left=$(((end - now) / 1000000))
      ((left > 0)) && nap "$(printf '%d.%03d' $((left / 1000)) $((left % 1000)))"
      break
    fi
    nap "$(printf '%d.%03d' $((hold / 1000)) $((hold % 1000)))"
    if [[ $state == down ]]; then state=up; else state=down; fi
  done
  if [[ $state == down ]]; then
    stamp
    ip -n "$ns" link set dev "$dev" up
    n=$((n + 1))
    event_t "fault flap rail=$rail toggle=$n $what-up dev=$dev"
  fi
  trap - INT TERM
  event "fault flap-end rail=$rail toggles=$n seed=$seed link=up"
}

cmd_fault() { # kind rail [arg]
  local kind=${1:-} rail=${2:-} arg=${3:-} side=${OPT_SIDE:-a}
  [[ -n $kind ]] || die "fault needs KIND RAIL (see --help)"
  [[ -n $rail ]] || die "fault $kind needs a RAIL index"
  [[ $side == a || $side == b ]] || die "--side must be a or b"
  require_lab
  require_rail "$rail"
  case $kind in
    link-down) fault_link "$side" "$rail" down ;;
    link-up) fault_link "$side" "$rail" up ;;
    far-down) fault_far "$side" "$rail" down ;;
    far-up) fault_far "$side" "$rail" up ;;
    blackhole) fault_blackhole "$side" "$rail" on "${OPT_LOCAL:-0}" ;;
    unblackhole) fault_blackhole "$side" "$rail" off 0 ;;
    loss)
      [[ -n $arg ]] || die "loss needs PERMILLE (e.g. 10 for 1 %)"
      fault_loss "${OPT_SIDE:-}" "$rail" "$arg"
      ;;
    noloss) fault_loss "${OPT_SIDE:-}" "$rail" 0 ;;
    rate)
      [[ -n $arg ]] || die "rate needs RATE (e.g. 200mbit) or 'restore'"
      fault_rate "${OPT_SIDE:-}" "$rail" "$arg"
      ;;
    rate-restore | norate) fault_rate "${OPT_SIDE:-}" "$rail" restore ;;
    queue-start) fault_queue_start "$side" "$rail" "${OPT_STREAMS:-4}" ;;
    queue-stop) queue_stop "$rail" ;;
    flap) fault_flap "$side" "$rail" "${OPT_FOR:-10}" "${OPT_SEED:-}" "${OPT_MINMS:-50}" "${OPT_MAXMS:-500}" "${OPT_FAR:-0}" ;;
    *) die "unknown fault kind '$kind' (see --help)" ;;
  esac
}

# ---- status --------------------------------------------------------------------------------
link_desc() { # ns dev -> "admin/carrier"
  local flags admin carrier
  flags=$(ip -n "$1" -o link show dev "$2" 2>/dev/null | sed -n 's/^[0-9]*: [^<]*<\([^>]*\)>.*/\1/p')
  [[ -z $flags ]] && {
    echo "missing"
    return
  }
  if [[ ,$flags, == *,UP,* ]]; then admin=up; else admin=DOWN; fi
  if [[ ,$flags, == *,LOWER_UP,* ]]; then carrier=carrier; else carrier=NO-CARRIER; fi
  echo "$admin/$carrier"
}
cmd_status() {
  require_lab
  local n i s ns bh loss q f
  n=$(state_get rails 0)
  echo "rail lab '$PREFIX': rails=$n rate=$(
    b=$(state_get rate_bps 0)
    ((b > 0)) && human_rate "$b" || echo unshaped
  ) state=$(state_dir)"
  printf '%-6s %-5s %-22s %-12s %-26s %s\n' RAIL SIDE LINK TBF-RATE BRIDGE-LEG NFT
  for ((i = 0; i < n; i++)); do
    for s in a b; do
      ns=$(side_ns "$s")
      f=""
      bh=$(nft_chain_desc "$ns" "rail${i}_bh_in")
      [[ -n $bh ]] && f+="bh-in[$bh] "
      bh=$(nft_chain_desc "$ns" "rail${i}_bh_out")
      [[ -n $bh ]] && f+="bh-out-local[$bh] "
      bh=$(nft_chain_desc "$(ns_br)" "$s${i}_bh")
      [[ -n $bh ]] && f+="bh-sent[$bh] "
      loss=$(nft_chain_desc "$(ns_br)" "$s${i}_loss")
      [[ -n $loss ]] && f+="loss-sent[$loss]"
      printf '%-6s %-5s %-22s %-12s %-26s %s\n' "rail$i" "$s" "$(link_desc "$ns" "rail$i")" \
        "$(tbf_rate_of "$ns" "rail$i")" "br:$s$i $(link_desc "$(ns_br)" "$s$i")" "${f:--}"
    done
    q=$(queue_file "$i")
    if [[ -e $q ]]; then
      local alive=0 p
      for p in $(cat "$q"); do pid_alive "$p" && alive=$((alive + 1)); done
      echo "       queue flow: pids $(cat "$q") ($alive alive)"
    fi
  done
  printf '%-6s %-5s %-22s\n' oob a "$(link_desc "$(ns_a)" oob)"
  printf '%-6s %-5s %-22s\n' oob b "$(link_desc "$(ns_b)" oob)"
}

# ---- check / deps / exec -------------------------------------------------------------------
cmd_check() {
  local why=() t
  [[ $(id -u) == 0 ]] || why+=("not root (uid $(id -u))")
  for t in ip tc nft ethtool awk; do
    command -v "$t" >/dev/null || why+=("missing tool: $t (railab.sh deps)")
  done
  if ((${#why[@]} == 0)); then
    t="r2ccl-chk-$$"
    if ! ip netns add "$t" 2>/dev/null; then
      why+=("ip netns add fails here (no CAP_SYS_ADMIN or no namespace support)")
    else
      if ! ip link add chk0 netns "$t" type veth peer name chk1 netns "$t" 2>/dev/null; then
        why+=("cannot create veth pairs inside a namespace")
      fi
      ip netns del "$t" 2>/dev/null || true
    fi
  fi
  if ((${#why[@]})); then
    printf '%s: rail lab unavailable here: %s\n' "$PROG" "${why[@]}" >&2
    exit 77
  fi
  command -v iperf3 >/dev/null || warn "iperf3 missing: queue-start and throughput checks unavailable"
  echo "railab: ok (root, network namespaces and veth work)"
}

cmd_deps() {
  local -A pkg=([ip]=iproute2 [tc]=iproute2 [nft]=nftables [ethtool]=ethtool [iperf3]=iperf3 [awk]=gawk)
  local t need=()
  for t in "${!pkg[@]}"; do command -v "$t" >/dev/null || need+=("${pkg[$t]}"); done
  if ((${#need[@]} == 0)); then
    echo "railab: all tools present (ip tc nft ethtool iperf3 awk)"
    return 0
  fi
  mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
  echo "railab: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends "${need[@]}"
}

cmd_exec() {
  (($# >= 2)) || die "exec needs a|b|br CMD..."
  local ns
  ns=$(side_ns "$1")
  ns_exists "$ns" || die "namespace $ns does not exist (railab.sh up)"
  shift
  exec ip netns exec "$ns" "$@"
}

# ---- argument parsing ----------------------------------------------------------------------
main() {
  local cmd="" pos=() rails=2 rate="" lat=20 burst=0 mtu=1500
  OPT_SIDE="" OPT_STREAMS="" OPT_FOR="" OPT_SEED="" OPT_MINMS="" OPT_MAXMS="" OPT_FAR=0 OPT_LOCAL=0
  need_val() { [[ $# -ge 2 && -n $2 ]] || die "option $1 needs a value"; }
  while (($#)); do
    case $1 in
      -h | --help | help)
        usage
        exit 0
        ;;
      --prefix) need_val "$@"; PREFIX=$2; shift 2 ;;
      --prefix=*) PREFIX=${1#*=}; shift ;;
      --side) need_val "$@"; OPT_SIDE=$2; shift 2 ;;
      --side=*) OPT_SIDE=${1#*=}; shift ;;
      --rails) need_val "$@"; rails=$2; shift 2 ;;
      --rate) need_val "$@"; rate=$2; shift 2 ;;
      --latency) need_val "$@"; lat=$2; shift 2 ;;
      --burst) need_val "$@"; burst=$2; shift 2 ;;
      --mtu) need_val "$@"; mtu=$2; shift 2 ;;
      --streams) need_val "$@"; OPT_STREAMS=$2; shift 2 ;;
      --for) need_val "$@"; OPT_FOR=$2; shift 2 ;;
      --seed) need_val "$@"; OPT_SEED=$2; shift 2 ;;
      --min-ms) need_val "$@"; OPT_MINMS=$2; shift 2 ;;
      --max-ms) need_val "$@"; OPT_MAXMS=$2; shift 2 ;;
      --far) OPT_FAR=1; shift ;;
      --local) OPT_LOCAL=1; shift ;;
      --) shift; pos+=("$@"); break ;;
      -*) die "unknown option '$1' (see --help)" ;;
      *)
        if [[ -z $cmd ]]; then
          cmd=$1
          shift
          if [[ $cmd == exec ]]; then
            # options (e.g. --prefix) may precede the side; the command after it is verbatim
            while (($#)) && [[ $1 == --prefix || $1 == --prefix=* ]]; do
              if [[ $1 == --prefix ]]; then need_val "$@"; PREFIX=$2; shift 2; else PREFIX=${1#*=}; shift; fi
            done
            check_prefix
            cmd_exec "$@"
          fi
        else
          pos+=("$1")
          shift
        fi
        ;;
    esac
  done
  check_prefix
  case $cmd in
    up) cmd_up "$rails" "$rate" "$lat" "$burst" "$mtu" ;;
    down) cmd_down ;;
    fault) cmd_fault "${pos[@]}" ;;
    status) cmd_status ;;
    check) cmd_check ;;
    deps) cmd_deps ;;
    "") usage >&2; exit 2 ;;
    *) die "unknown command '$cmd' (see --help)" ;;
  esac
}

if [[ $(id -u) != 0 && ${1:-} != check && ${1:-} != --help && ${1:-} != -h && ${1:-} != help && ${1:-} != "" ]]; then
  die "must run as root (namespaces, tc and nft need CAP_NET_ADMIN/CAP_SYS_ADMIN)"
fi
main "$@"
