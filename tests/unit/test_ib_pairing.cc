// Backup pairing across the two ends (transport/ib/pairing.h): the score of a pair under both
// ends' real subnet prefixes, the subnet text, and a RoCE GID's subnet from interface lists.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "transport/ib/devices.h"
#include "transport/ib/pairing.h"

using namespace r2ccl::net;
using namespace r2ccl::net::ib;

namespace {

// A RoCE v2 end at the IPv4-mapped GID of `ip` with an IPv4 prefix (-1: unknown).
PairEnd roce(const char* ip, int prefix, int type = kGidTypeRoceV2) {
  PairEnd e;
  e.link_layer = IBV_LINK_LAYER_ETHERNET;
  e.gid_type = type;
  e.gid[10] = e.gid[11] = 0xff;
  REQUIRE(inet_pton(AF_INET, ip, e.gid + 12) == 1);
  e.subnet_bits = prefix < 0 ? 0 : 96 + prefix;
  return e;
}

PairEnd ibend(uint64_t subnet_prefix, uint64_t guid) {
  PairEnd e;
  e.link_layer = IBV_LINK_LAYER_INFINIBAND;
  e.gid_type = kGidTypeIb;
  for (int i = 0; i < 8; ++i) {
    e.gid[i] = static_cast<uint8_t>(subnet_prefix >> (56 - 8 * i));
    e.gid[8 + i] = static_cast<uint8_t>(guid >> (56 - 8 * i));
  }
  e.subnet_bits = 64;
  return e;
}

IfAddr v4(const char* name, const char* ip, int prefix) {
  IfAddr a{};
  a.ifname = name;
  a.family = AF_INET;
  auto* s = reinterpret_cast<sockaddr_in*>(&a.addr);
  s->sin_family = AF_INET;
  inet_pton(AF_INET, ip, &s->sin_addr);
  a.prefix_len = prefix;
  return a;
}

}  // namespace

TEST_CASE("pair_score: the same subnet under both ends' prefixes first", "[unit][ib]") {
  // The listener's 10.211.7.2/16 and two candidates: 10.211.5.1/16 (the same /16 at both
  // ends) and 10.211.7.129/25 (the same /24, but under its /25 the listener is elsewhere).
  const PairEnd me = roce("10.211.7.2", 16);
  CHECK(pair_score(me, roce("10.211.5.1", 16)) == kPairSameSubnet);
  CHECK(pair_score(me, roce("10.211.7.129", 25)) == kPairRouted);
  CHECK(pair_score(roce("10.211.7.130", 25), roce("10.211.7.129", 25)) == kPairSameSubnet);
  // Symmetric.
  CHECK(pair_score(roce("10.211.5.1", 16), me) == kPairSameSubnet);
  CHECK(pair_score(roce("10.211.7.129", 25), me) == kPairRouted);
  // Another subnet: routed RoCE v2 is usable, RoCE v1 (not routed) is not.
  CHECK(pair_score(roce("10.212.0.2", 16), roce("10.213.0.1", 16)) == kPairRouted);
  CHECK(pair_score(roce("10.212.0.2", 16, kGidTypeRoceV1), roce("10.213.0.1", 16)) == kPairNone);
  CHECK(pair_score(roce("10.212.0.2", 16, kGidTypeRoceV1),
                   roce("10.212.9.1", 16, kGidTypeRoceV1)) == kPairSameSubnet);
  // One prefix unknown: that end's address judged under the known one.
  CHECK(pair_score(roce("10.1.2.3", 16), roce("10.1.9.9", -1)) == kPairOneSubnet);
  CHECK(pair_score(roce("10.1.2.3", -1), roce("10.1.9.9", 16)) == kPairOneSubnet);
  CHECK(pair_score(roce("10.1.2.3", 24), roce("10.1.9.9", -1)) == kPairRouted);
  CHECK(pair_score(roce("10.1.2.3", -1), roce("10.1.2.4", -1)) == kPairRouted);  // no guess
  // Another link layer: never.
  CHECK(pair_score(roce("10.1.2.3", 16), ibend(0xfe80000000000000ull, 1)) == kPairNone);
}

TEST_CASE("pair_score: InfiniBand by the GID's subnet prefix", "[unit][ib]") {
  CHECK(pair_score(ibend(0xfe80000000000000ull, 1), ibend(0xfe80000000000000ull, 2)) ==
        kPairSameSubnet);
  CHECK(pair_score(ibend(0xfec0000000000001ull, 1), ibend(0xfec0000000000002ull, 2)) ==
        kPairRouted);
}

TEST_CASE("subnet_text", "[unit][ib]") {
  CHECK(subnet_text(roce("10.211.7.130", 25)) == "10.211.7.128/25");
  CHECK(subnet_text(roce("10.211.7.2", 16)) == "10.211.0.0/16");
  CHECK(subnet_text(roce("10.211.7.2", 0)) == "0.0.0.0/0");
  CHECK(subnet_text(roce("10.211.7.2", -1)) == "unknown");
  CHECK(subnet_text(ibend(0xfe80000000000000ull, 7)) == "fe80::/64 (IB subnet prefix)");
}

TEST_CASE("roce_subnet_bits: the GID's netdev address and its prefix", "[unit][ib]") {
  const PairEnd g = roce("10.211.7.2", -1);
  // The netdev named by gid_attrs/ndevs wins; another interface with the address (a stale
  // or secondary one) only without it; nothing: unknown.
  std::vector<IfAddr> ifs = {v4("eth9", "10.211.7.2", 24), v4("ens1f0", "10.211.7.2", 16),
                             v4("ens1f1", "10.211.8.2", 25)};
  CHECK(roce_subnet_bits(g.gid, "ens1f0", ifs) == 96 + 16);
  CHECK(roce_subnet_bits(g.gid, "", ifs) == 96 + 24);
  CHECK(roce_subnet_bits(g.gid, "ens1f1", ifs) == 96 + 24);
  CHECK(roce_subnet_bits(g.gid, "ens1f0", {v4("ens1f0", "10.211.7.3", 16)}) == 0);
}
