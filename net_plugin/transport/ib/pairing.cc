#include "transport/ib/pairing.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <cstring>

#include "transport/ib/devices.h"

namespace r2ccl::net::ib {
namespace {

bool v4_mapped(const uint8_t* g) {
  static const uint8_t k[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g, k, 12) == 0;
}

bool prefix_equal(const uint8_t* a, const uint8_t* b, int bits) {
  const int full = bits / 8;
  if (memcmp(a, b, static_cast<size_t>(full)) != 0) return false;
  const int rest = bits % 8;
  if (rest == 0) return true;
  const uint8_t mask = static_cast<uint8_t>(0xff << (8 - rest));
  return (a[full] & mask) == (b[full] & mask);
}

}  // namespace

int pair_score(const PairEnd& a, const PairEnd& b) {
  if (a.link_layer != b.link_layer) return kPairNone;
  const bool ka = a.subnet_bits > 0 && a.subnet_bits <= 128;
  const bool kb = b.subnet_bits > 0 && b.subnet_bits <= 128;
  const bool in_a = ka && prefix_equal(a.gid, b.gid, a.subnet_bits);
  const bool in_b = kb && prefix_equal(a.gid, b.gid, b.subnet_bits);
  if (ka && kb) {
    if (in_a && in_b) return kPairSameSubnet;
    const bool v1 = a.gid_type == kGidTypeRoceV1 || b.gid_type == kGidTypeRoceV1;
    return v1 ? kPairNone : kPairRouted;
  }
  if (in_a || in_b) return kPairOneSubnet;
  return kPairRouted;
}

std::string subnet_text(const PairEnd& e) {
  if (e.subnet_bits <= 0 || e.subnet_bits > 128) return "unknown";
  uint8_t net[16];
  memcpy(net, e.gid, 16);
  for (int bit = e.subnet_bits; bit < 128; ++bit)
    net[bit / 8] &= static_cast<uint8_t>(~(0x80 >> (bit % 8)));
  char buf[INET6_ADDRSTRLEN];
  if (v4_mapped(net) && e.subnet_bits >= 96) {
    inet_ntop(AF_INET, net + 12, buf, sizeof(buf));
    return std::string(buf) + "/" + std::to_string(e.subnet_bits - 96);
  }
  inet_ntop(AF_INET6, net, buf, sizeof(buf));
  return std::string(buf) + "/" + std::to_string(e.subnet_bits) +
         (e.link_layer == IBV_LINK_LAYER_INFINIBAND ? " (IB subnet prefix)" : "");
}

int roce_subnet_bits(const uint8_t gid[16], const std::string& ndev,
                     const std::vector<IfAddr>& ifs) {
  const bool v4 = v4_mapped(gid);
  int any = 0;
  for (const IfAddr& i : ifs) {
    if (i.family != (v4 ? AF_INET : AF_INET6)) continue;
    const uint8_t* a = addr_bytes(i.addr);
    if (memcmp(a, v4 ? gid + 12 : gid, v4 ? 4 : 16) != 0) continue;
    const int bits = (v4 ? 96 : 0) + i.prefix_len;
    if (!ndev.empty() && i.ifname == ndev) return bits;
    if (any == 0) any = bits;
  }
  return any;
}

}  // namespace r2ccl::net::ib
