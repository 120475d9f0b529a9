#!/usr/bin/env bash
# Installs every Debian package r2ccl needs to build, test, run the demo and the benchmarks.
# Idempotent and quiet when everything is installed. Without root and with packages missing
# it prints the apt-get command to run and exits 2.
#   --rdma   also the tools of a real InfiniBand/RoCE host (scripts/ib_two_node.sh):
#            rdma-core, ibverbs-utils (ibv_devinfo), infiniband-diags (ibportstate)
#   --ccache also ccache, which CMake then uses (R2CCL_CCACHE): for developers rebuilding the
#            same tree; not installed by default because the test command on a fresh clone
#            (CI) compiles everything once and would only pay for filling the cache
#   --train  kept for scripts/predictor/run_all.sh (retraining the failure predictor); what it
#            needs, python3-torch, is now a base package
set -euo pipefail

PKGS=(
  g++ cmake make binutils git python3      # build; nm for the ABI test
  catch2                                   # tests (Catch2 v2)
  nlohmann-json3-dev                       # r2ccl_perf --stats; etcd bodies and the agreed record
  libcurl4-openssl-dev libssl-dev          # the snapshot daemon talks to etcd (JSON gateway; base64)
  etcd-server etcd-client                  # the snapshot control plane (tests start a local etcd)
  openssl                                  # certificates of the etcd TLS tests (made at test time)
  libcli11-dev                             # tools' command lines (CLI11)
  libibverbs-dev                           # verbs.h types (libibverbs is dlopen'ed at run time)
  zlib1g-dev                               # CRC-32 of the predictor's weights file
  python3-numpy                            # the predictor's trace generator (held-out test)
  libzstd-dev                              # snapshot deltas (zstd)
  libxxhash-dev pkg-config                 # snapshot shard checksums (XXH3-64)
  libasio-dev                              # snapshot daemon and client protocols (asio)
  prometheus-cpp-dev                       # snapshot daemon's Prometheus metrics (registry, /metrics)
  python3-torch                            # the snapshot example (CPU training, recovery)
  libnl-3-200 libnl-route-3-200            # link notifications (dlopen'ed at run time)
  libnl-genl-3-200                         # FEC statistics over ethtool netlink (dlopen'ed)
  iproute2 nftables ethtool iperf3         # rail lab, fault injection, benchmarks
  procps                                   # pgrep/pkill in scripts
)
for opt in "$@"; do
  case "$opt" in
    --rdma) PKGS+=(rdma-core ibverbs-utils infiniband-diags) ;;
    --ccache) PKGS+=(ccache) ;;
    --train) ;;
    *) echo "r2ccl setup: unknown option $opt (accepted: --rdma, --ccache, --train)" >&2; exit 3 ;;
  esac
done

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "r2ccl setup: missing packages: ${missing[*]}" >&2
  echo "run as root: apt-get update && apt-get install -y --no-install-recommends ${missing[*]}" >&2
  exit 2
fi
echo "r2ccl setup: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
