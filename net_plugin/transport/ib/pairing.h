// Backup pairing across the two ends of a verbs connection: which of the peer's HCAs a local
// backup HCA should talk to, from facts instead of a guess (it was the same IPv4 /24).
//
// A RoCE GID's subnet is its netdev's address with the netdev's real prefix length (the
// kernel's sysfs ports/<p>/gid_attrs/ndevs/<i> names the netdev of GID i; getifaddrs(3) gives
// its addresses and netmasks). An InfiniBand GID's subnet is its upper 64 bits, the subnet
// prefix (IBA vol. 1, 4.1.1: GID = subnet prefix + port GUID). Both ends carry their subnet
// length in the setup messages (IbWireHca::subnet_bits), so each pair is judged under both
// ends' prefixes.
//
// Pure functions. Thread-safety: stateless.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sock/rails.h"

namespace r2ccl::net::ib {

// One end of a candidate pair.
struct PairEnd {
  int link_layer = 0;  // IBV_LINK_LAYER_INFINIBAND or IBV_LINK_LAYER_ETHERNET
  int gid_type = -1;   // kGidTypeIb / kGidTypeRoceV1 / kGidTypeRoceV2 (devices.h), -1 unknown
  uint8_t gid[16] = {};
  int subnet_bits = 0;  // leading bits of gid that name its subnet (IB 64; RoCE IPv4-mapped
                        // 96 + the IPv4 prefix; IPv6 its prefix); 0 = unknown
};

// Scores, higher is better; pair_rails (engine/path_plan.h) takes > 0 as allowed.
constexpr int kPairNone = 0;        // another link layer, or RoCE v1 across subnets (v1 is
                                    // not routed)
constexpr int kPairRouted = 1;      // same link layer, other subnet (RoCE v2, IB routers)
                                    // or subnets unknown: usable, preferred last
constexpr int kPairOneSubnet = 2;   // same subnet under the one prefix known
constexpr int kPairSameSubnet = 3;  // same subnet under both ends' prefixes

int pair_score(const PairEnd& a, const PairEnd& b);

// "10.211.0.0/16", "fd00:1::/64", "fe80::/64 (IB subnet prefix)"; "unknown" when
// subnet_bits is 0.
std::string subnet_text(const PairEnd& e);

// The subnet length (in GID bits, as PairEnd::subnet_bits) of a RoCE GID: the prefix length
// of the interface address equal to the GID's (IPv4-mapped GIDs: the IPv4 address) on the
// netdev `ndev`, else on any interface; 0 when none has it.
int roce_subnet_bits(const uint8_t gid[16], const std::string& ndev,
                     const std::vector<IfAddr>& ifs);

}  // namespace r2ccl::net::ib
