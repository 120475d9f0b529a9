#include "rails.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "r2ccl/log.h"

namespace r2ccl::net {
namespace {

constexpr const char* kAddrForm = "accepted: IFNAME@ADDR with an IPv4 or IPv6 address";

int netmask_prefix(const sockaddr* mask) {
  if (!mask) return 32;
  int n = 0;
  const uint8_t* b = nullptr;
  int len = 0;
  if (mask->sa_family == AF_INET) {
    b = reinterpret_cast<const uint8_t*>(&reinterpret_cast<const sockaddr_in*>(mask)->sin_addr);
    len = 4;
  } else if (mask->sa_family == AF_INET6) {
    b = reinterpret_cast<const uint8_t*>(&reinterpret_cast<const sockaddr_in6*>(mask)->sin6_addr);
    len = 16;
  } else {
    return 32;
  }
  for (int i = 0; i < len; ++i) n += __builtin_popcount(b[i]);
  return n;
}

int read_speed(const std::string& ifname) {
  std::ifstream f("/sys/class/net/" + ifname + "/speed");
  long v = -1;
  if (f >> v && v > 0 && v < INT_MAX) return static_cast<int>(v);
  return 10000;  // unknown (lo, some virtual NICs): NCCL's own default
}

std::string read_pci_path(const std::string& ifname) {
  std::string link = "/sys/class/net/" + ifname + "/device";
  char buf[PATH_MAX];
  if (!realpath(link.c_str(), buf)) return {};
  std::string p(buf);
  if (p.find("/pci") == std::string::npos) return {};
  return p;
}

bool matches(const RailSpec& s, const std::string& ifname, const RailSpec::Entry** which) {
  for (const auto& e : s.entries) {
    bool m = s.exact ? ifname == e.name : ifname.rfind(e.name, 0) == 0;
    if (m) {
      *which = &e;
      return true;
    }
  }
  return false;
}

bool parse_addr(const std::string& s, sockaddr_storage* out, int* family) {
  memset(out, 0, sizeof(*out));
  auto* a4 = reinterpret_cast<sockaddr_in*>(out);
  if (inet_pton(AF_INET, s.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    *family = AF_INET;
    return true;
  }
  auto* a6 = reinterpret_cast<sockaddr_in6*>(out);
  if (inet_pton(AF_INET6, s.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    *family = AF_INET6;
    return true;
  }
  return false;
}

Rail make_rail(const IfAddr& ifa, const std::string& display, const sockaddr_storage& addr,
               int family, int prefix, int speed_override) {
  Rail r;
  r.ifname = ifa.ifname;
  r.name = display;
  r.ifindex = ifa.ifindex;
  r.family = family;
  r.addr = addr;
  r.addrlen = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  r.prefix_len = prefix;
  r.speed_mbps = speed_override > 0 ? speed_override : read_speed(ifa.ifname);
  r.pci_path = read_pci_path(ifa.ifname);
  return r;
}

// IPv6 addresses of the calling thread's network namespace that are in duplicate address
// detection or failed it: "ADDR32HEX IFINDEX PLEN SCOPE FLAGS IFNAME" lines of
// /proc/net/if_inet6 (flags: IFA_F_TENTATIVE 0x40, IFA_F_DADFAILED 0x08, linux/if_addr.h).
std::vector<in6_addr> tentative_ipv6() {
  std::vector<in6_addr> out;
  FILE* f = fopen("/proc/net/if_inet6", "re");
  if (!f) return out;
  char hex[33];
  unsigned ifindex, plen, scope, flags;
  char name[IFNAMSIZ + 1];
  while (fscanf(f, "%32s %x %x %x %x %16s", hex, &ifindex, &plen, &scope, &flags, name) == 6) {
    if ((flags & (0x40u | 0x08u)) == 0 || strlen(hex) != 32) continue;
    in6_addr a{};
    for (int i = 0; i < 16; ++i) {
      char b[3] = {hex[2 * i], hex[2 * i + 1], 0};
      a.s6_addr[i] = static_cast<uint8_t>(strtoul(b, nullptr, 16));
    }
    out.push_back(a);
  }
  fclose(f);
  return out;
}

}  // namespace

const uint8_t* addr_bytes(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET6)
    return reinterpret_cast<const uint8_t*>(&reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr);
  return reinterpret_cast<const uint8_t*>(&reinterpret_cast<const sockaddr_in*>(&a)->sin_addr);
}

std::string addr_to_string(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = "?";
  inet_ntop(a.ss_family, addr_bytes(a), buf, sizeof(buf));
  return buf;
}

std::string addr_port_string(const sockaddr_storage& a) {
  const uint16_t port = a.ss_family == AF_INET6
                            ? reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port
                            : reinterpret_cast<const sockaddr_in*>(&a)->sin_port;
  const std::string host =
      a.ss_family == AF_INET6 ? "[" + addr_to_string(a) + "]" : addr_to_string(a);
  return host + ":" + std::to_string(ntohs(port));
}

bool same_subnet(int fam_a, const uint8_t* a, int plen_a, int fam_b, const uint8_t* b, int plen_b) {
  if (fam_a != fam_b) return false;
  int bits = std::min(plen_a, plen_b);
  int len = fam_a == AF_INET ? 4 : 16;
  bits = std::min(bits, len * 8);
  for (int i = 0; i < len && bits > 0; ++i, bits -= 8) {
    uint8_t mask = bits >= 8 ? 0xff : static_cast<uint8_t>(0xff << (8 - bits));
    if ((a[i] & mask) != (b[i] & mask)) return false;
  }
  return true;
}

bool parse_rail_spec(const std::string& spec_in, RailSpec* out, std::string* err) {
  RailSpec s;
  std::string spec = spec_in;
  if (!spec.empty() && spec[0] == '^') {
    s.exclude = true;
    spec = spec.substr(1);
  }
  if (!spec.empty() && spec[0] == '=') {
    s.exact = true;
    spec = spec.substr(1);
  }
  size_t start = 0;
  while (start <= spec.size()) {
    size_t comma = spec.find(',', start);
    std::string tok =
        spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!tok.empty()) {
      RailSpec::Entry e;
      size_t at = tok.find('@');
      e.name = tok.substr(0, at);
      if (at != std::string::npos) e.addr = tok.substr(at + 1);
      if (e.name.empty() || e.name.size() >= IFNAMSIZ ||
          (at != std::string::npos && e.addr.empty())) {
        *err = "bad entry '" + tok +
               "'; accepted: IFNAME or IFNAME@ADDR, comma-separated, "
               "optionally starting with '^' (exclude) or '=' (exact names)";
        return false;
      }
      if (!e.addr.empty()) {
        sockaddr_storage tmp;
        int fam;
        if (!parse_addr(e.addr, &tmp, &fam)) {
          *err = "bad address '" + e.addr + "' in entry '" + tok + "'; " + kAddrForm;
          return false;
        }
        if (s.exclude) {
          *err = "'^' (exclude) entries take no @ADDR";
          return false;
        }
      }
      s.entries.push_back(e);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  *out = s;
  return true;
}

std::vector<IfAddr> system_interfaces() {
  std::vector<IfAddr> v;
  read_system_interfaces(&v);
  return v;
}

bool read_system_interfaces(std::vector<IfAddr>* out) {
  out->clear();
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  std::vector<IfAddr> v = interfaces_from(list);
  freeifaddrs(list);
  bool any6 = false;
  for (const auto& i : v) any6 |= i.family == AF_INET6;
  if (any6) {
    const std::vector<in6_addr> tent = tentative_ipv6();
    for (auto& i : v) {
      if (i.family != AF_INET6) continue;
      const auto& a6 = reinterpret_cast<const sockaddr_in6*>(&i.addr)->sin6_addr;
      for (const auto& t : tent)
        if (memcmp(&t, &a6, sizeof(t)) == 0) i.tentative = true;
    }
  }
  *out = std::move(v);
  return true;
}

bool same_address(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  return memcmp(addr_bytes(a), addr_bytes(b), a.ss_family == AF_INET6 ? 16 : 4) == 0;
}

bool resolve_rail_address(const Rail& r, const std::vector<IfAddr>& ifs, sockaddr_storage* addr,
                          int* prefix_len) {
  if (r.fixed_addr) {
    bool covered = !r.fixed_covered;
    for (const auto& i : ifs)
      covered |=
          i.ifname == r.ifname && !i.tentative &&
          (same_address(i.addr, r.addr) || same_subnet(i.family, addr_bytes(i.addr), i.prefix_len,
                                                       r.family, addr_bytes(r.addr), i.prefix_len));
    if (!covered) return false;
    *addr = r.addr;
    *prefix_len = r.prefix_len;
    return true;
  }
  const IfAddr* same_fam = nullptr;
  const IfAddr* other_fam = nullptr;
  for (const auto& i : ifs) {
    if (i.ifname != r.ifname || i.tentative) continue;
    if (same_address(i.addr, r.addr)) {
      *addr = i.addr;
      *prefix_len = r.fixed_addr ? r.prefix_len : i.prefix_len;
      return true;
    }
    if (r.fixed_addr) continue;
    if (i.family == r.family && !same_fam) same_fam = &i;
    if (i.family != r.family && !other_fam) other_fam = &i;
  }
  const IfAddr* pick = same_fam ? same_fam : other_fam;
  if (!pick) return false;
  *addr = pick->addr;
  *prefix_len = pick->prefix_len;
  return true;
}

std::vector<IfAddr> interfaces_from(const ifaddrs* list) {
  std::vector<IfAddr> v;
  for (const ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    int fam = i->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    IfAddr a;
    a.ifname = i->ifa_name;
    a.ifindex = static_cast<int>(if_nametoindex(i->ifa_name));
    a.up = (i->ifa_flags & IFF_UP) != 0;
    a.running = (i->ifa_flags & IFF_RUNNING) != 0;
    a.family = fam;
    memset(&a.addr, 0, sizeof(a.addr));
    memcpy(&a.addr, i->ifa_addr, fam == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    if (fam == AF_INET6) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&a.addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) continue;
    }
    a.prefix_len = netmask_prefix(i->ifa_netmask);
    v.push_back(a);
  }
  // Deterministic order: by name, IPv4 before IPv6.
  std::stable_sort(v.begin(), v.end(), [](const IfAddr& x, const IfAddr& y) {
    if (x.ifname != y.ifname) return x.ifname < y.ifname;
    return x.family == AF_INET && y.family != AF_INET;
  });
  return v;
}

bool interface_running(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return true;  // cannot tell: assume up, detection still works
  bool up = false;
  for (ifaddrs* i = list; i; i = i->ifa_next)
    if (ifname == i->ifa_name && (i->ifa_flags & IFF_UP) && (i->ifa_flags & IFF_RUNNING)) up = true;
  freeifaddrs(list);
  return up;
}

bool select_rails(const std::string& spec_str, const std::string& spec_var,
                  const std::vector<IfAddr>& ifs, int speed_override, std::vector<Rail>* out,
                  std::string* err, std::vector<std::string>* left_out) {
  std::vector<Rail> rails;
  RailSpec spec;
  if (!parse_rail_spec(spec_str, &spec, err)) {
    *err = spec_var + "='" + spec_str + "': " + *err;
    return false;
  }
  auto auto_excluded = [](const std::string& n) {
    return n == "lo" || n.rfind("docker", 0) == 0 || n.rfind("virbr", 0) == 0;
  };
  if (spec.entries.empty() || spec.exclude) {
    std::vector<std::string> seen;
    for (const auto& i : ifs) {
      if (!i.up || std::find(seen.begin(), seen.end(), i.ifname) != seen.end()) continue;
      const RailSpec::Entry* e = nullptr;
      if (spec.exclude && matches(spec, i.ifname, &e)) continue;
      if (auto_excluded(i.ifname)) continue;
      seen.push_back(i.ifname);
      rails.push_back(make_rail(i, i.ifname, i.addr, i.family, i.prefix_len, speed_override));
    }
  } else {
    // Spec order first, interface-name order within a prefix entry.
    for (const auto& e : spec.entries) {
      std::vector<std::string> seen;
      for (const auto& i : ifs) {
        bool m = spec.exact ? i.ifname == e.name : i.ifname.rfind(e.name, 0) == 0;
        if (!m || std::find(seen.begin(), seen.end(), i.ifname) != seen.end()) continue;
        if (!e.addr.empty()) {
          sockaddr_storage a;
          int fam = AF_UNSPEC;
          // parse_rail_spec above already rejected an unparsable address; checked again here
          // so a spec that reaches this point some other way still fails instead of binding
          // the rail to an uninitialised address.
          if (!parse_addr(e.addr, &a, &fam)) {
            *err = spec_var + "='" + spec_str + "': bad address '" + e.addr + "' in entry '" +
                   e.name + "@" + e.addr + "'; " + kAddrForm;
            return false;
          }
          // The interface's own prefix when the address is inside one of its subnets.
          int plen = fam == AF_INET ? 32 : 128;
          bool covered = false;
          for (const auto& j : ifs)
            if (j.ifname == i.ifname && j.family == fam &&
                same_subnet(fam, addr_bytes(a), j.prefix_len, fam, addr_bytes(j.addr),
                            j.prefix_len)) {
              plen = j.prefix_len;
              covered = true;
            }
          seen.push_back(i.ifname);
          rails.push_back(make_rail(i, i.ifname + "@" + e.addr, a, fam, plen, speed_override));
          rails.back().fixed_addr = true;
          rails.back().fixed_covered = covered;
          break;
        }
        if (!i.up) continue;
        seen.push_back(i.ifname);
        rails.push_back(make_rail(i, i.ifname, i.addr, i.family, i.prefix_len, speed_override));
      }
    }
  }
  // Unique display names (an interface named twice keeps its first entry).
  std::vector<Rail> unique;
  for (auto& r : rails) {
    bool dup = false;
    for (const auto& u : unique) dup |= u.name == r.name;
    if (!dup) unique.push_back(std::move(r));
  }
  if (unique.empty()) {
    std::string names;
    std::vector<std::string> seen;
    for (const auto& i : ifs) {
      if (std::find(seen.begin(), seen.end(), i.ifname) != seen.end()) continue;
      seen.push_back(i.ifname);
      names += (names.empty() ? "" : ", ") + i.ifname + (i.up ? "" : " (down)");
    }
    if (spec.entries.empty())
      *err =
          "no usable interface found (up, with an IPv4/IPv6 address, not lo/docker*/virbr*); "
          "set R2CCL_SOCKET_IFNAME. Interfaces here: " +
          names;
    else
      *err = spec_var + "='" + spec_str +
             "' matches no usable interface (up, with an address). "
             "Interfaces here: " +
             names;
    return false;
  }
  if (unique.size() > kMaxRailsPerProcess) {
    std::vector<std::string> dropped;
    for (size_t k = kMaxRailsPerProcess; k < unique.size(); ++k) dropped.push_back(unique[k].name);
    if (left_out) {
      *left_out = dropped;
    } else {
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true)) {
        std::string names;
        for (const auto& n : dropped) names += (names.empty() ? "" : ", ") + n;
        R2CCL_WARN(
            "%s selects %zu rails; r2ccl carries at most %zu (the first in name order): "
            "%s left out",
            spec_var.c_str(), unique.size(), kMaxRailsPerProcess, names.c_str());
      }
    }
    unique.resize(kMaxRailsPerProcess);
  }
  for (size_t k = 0; k < unique.size(); ++k) unique[k].index = static_cast<int>(k);
  *out = std::move(unique);
  return true;
}

}  // namespace r2ccl::net
