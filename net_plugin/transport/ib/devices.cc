#include "transport/ib/devices.h"

#include <arpa/inet.h>
#include <endian.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdlib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <tuple>

#include "r2ccl/log.h"

namespace r2ccl::net::ib {

namespace {

constexpr const char* kHcaForm =
    "accepted: NAME[:PORT] entries, comma-separated (PORT 1..255), optionally starting with "
    "'^' (exclude them) and/or '=' (exact names instead of prefixes), e.g. mlx5_0:1,mlx5_1";

bool parse_port(const std::string& s, int* out) {
  if (s.empty() || s.size() > 3) return false;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v < 1 || v > 255) return false;
  *out = v;
  return true;
}

bool is_zero(const uint8_t* g) {
  for (int i = 0; i < 16; i++)
    if (g[i]) return false;
  return true;
}

bool is_link_local(const uint8_t* g) { return g[0] == 0xfe && (g[1] & 0xc0) == 0x80; }

bool is_v4_mapped(const uint8_t* g) {
  for (int i = 0; i < 10; i++)
    if (g[i]) return false;
  return g[10] == 0xff && g[11] == 0xff;
}

// First `bits` bits of a and b are equal.
bool prefix_equal(const uint8_t* a, const uint8_t* b, int bits) {
  int full = bits / 8;
  if (std::memcmp(a, b, full) != 0) return false;
  int rest = bits % 8;
  if (rest == 0) return true;
  uint8_t mask = static_cast<uint8_t>(0xff << (8 - rest));
  return (a[full] & mask) == (b[full] & mask);
}

bool in_range(const uint8_t* g, const GidPrefs& p) {
  if (p.range_family == AF_INET) {
    return is_v4_mapped(g) && prefix_equal(g + 12, p.range_addr + 12, p.range_prefix);
  }
  return prefix_equal(g, p.range_addr, p.range_prefix);
}

// Components of a sysfs path after the PCI root complex ("pciDDDD:BB"). Returns false when
// the path has no such root. *root gets the root's name.
bool pci_components(const std::string& path, std::string* root, std::vector<std::string>* out) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= path.size()) {
    size_t slash = path.find('/', start);
    size_t n = slash == std::string::npos ? std::string::npos : slash - start;
    std::string c = path.substr(start, n);
    if (!c.empty()) parts.push_back(c);
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  for (size_t i = 0; i < parts.size(); i++) {
    if (parts[i].compare(0, 3, "pci") == 0 && parts[i].find(':') != std::string::npos) {
      *root = parts[i];
      out->assign(parts.begin() + static_cast<long>(i) + 1, parts.end());
      return true;
    }
  }
  return false;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Device names compared with digit runs as numbers: mlx5_2 < mlx5_10.
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (is_digit(a[i]) && is_digit(b[j])) {
      size_t ie = i, je = j;
      while (ie < a.size() && is_digit(a[ie])) ie++;
      while (je < b.size() && is_digit(b[je])) je++;
      std::string na = a.substr(i, ie - i), nb = b.substr(j, je - j);
      na.erase(0, std::min(na.find_first_not_of('0'), na.size()));
      nb.erase(0, std::min(nb.find_first_not_of('0'), nb.size()));
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      i++;
      j++;
    }
  }
  if ((a.size() - i) != (b.size() - j)) return (a.size() - i) < (b.size() - j);
  return a < b;
}

bool read_line(const std::string& path, std::string* out) {
  std::ifstream f(path);
  if (!f) return false;
  std::string s;
  if (!std::getline(f, s)) return false;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  *out = s;
  return true;
}

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  if (!realpath(p.c_str(), buf)) return "";
  return buf;
}

}  // namespace

// ---------------------------------------------------------------------------------------
bool parse_hca_spec(const std::string& s_in, HcaSpec* out, std::string* err) {
  HcaSpec spec;
  std::string s = s_in;
  if (!s.empty() && s[0] == '^') {
    spec.exclude = true;
    s.erase(0, 1);
  }
  if (!s.empty() && s[0] == '=') {
    spec.exact = true;
    s.erase(0, 1);
  }
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    size_t n = comma == std::string::npos ? std::string::npos : comma - start;
    std::string tok = s.substr(start, n);
    if (!tok.empty()) {
      HcaSpec::Entry e;
      size_t colon = tok.find(':');
      e.name = tok.substr(0, colon);
      std::string why;
      if (e.name.empty()) {
        why = "empty device name";
      } else if (e.name.find_first_of("^=") != std::string::npos) {
        why = "'^' and '=' may only start the whole list";
      } else if (colon != std::string::npos && !parse_port(tok.substr(colon + 1), &e.port)) {
        why = "bad port '" + tok.substr(colon + 1) + "'";
      }
      if (!why.empty()) {
        *err = "R2CCL_IB_HCA='" + s_in + "': " + why + " in entry '" + tok + "'; " + kHcaForm;
        return false;
      }
      spec.entries.push_back(e);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  *out = spec;
  return true;
}

bool hca_spec_selects(const HcaSpec& spec, const std::string& dev, int port) {
  if (spec.entries.empty()) return true;
  bool any = false;
  for (const auto& e : spec.entries) {
    bool name_ok = spec.exact ? dev == e.name : dev.compare(0, e.name.size(), e.name) == 0;
    if (name_ok && (e.port < 0 || e.port == port)) {
      any = true;
      break;
    }
  }
  return spec.exclude ? !any : any;
}

// ---------------------------------------------------------------------------------------
bool parse_gid_prefs(const Config& c, GidPrefs* out, std::string* err) {
  GidPrefs p;
  if (c.ib_gid_index < -1 || c.ib_gid_index > 1024) {
    *err = "R2CCL_IB_GID_INDEX=" + std::to_string(c.ib_gid_index) +
           ": accepted: -1 (select automatically) or a GID index 0..1024";
    return false;
  }
  p.forced_index = static_cast<int>(c.ib_gid_index);
  if (c.ib_roce_version != 1 && c.ib_roce_version != 2) {
    *err = "R2CCL_IB_ROCE_VERSION_NUM=" + std::to_string(c.ib_roce_version) + ": accepted: 1 or 2";
    return false;
  }
  p.roce_version = static_cast<int>(c.ib_roce_version);
  if (c.ib_addr_family.empty() || c.ib_addr_family == "AF_INET") {
    p.family = AF_INET;
  } else if (c.ib_addr_family == "AF_INET6") {
    p.family = AF_INET6;
  } else {
    *err = "R2CCL_IB_ADDR_FAMILY='" + c.ib_addr_family + "': accepted: AF_INET or AF_INET6";
    return false;
  }
  if (!c.ib_addr_range.empty()) {
    const std::string& r = c.ib_addr_range;
    auto bad = [&](const std::string& why) {
      *err = "R2CCL_IB_ADDR_RANGE='" + r + "': " + why +
             "; accepted: ADDR/PREFIX, an IPv4 address with PREFIX 0..32 or an IPv6 address "
             "with PREFIX 0..128 (e.g. 10.1.0.0/16)";
      return false;
    };
    size_t slash = r.find('/');
    if (slash == std::string::npos) return bad("no /PREFIX");
    std::string addr = r.substr(0, slash), plen = r.substr(slash + 1);
    in_addr a4;
    in6_addr a6;
    int max_prefix;
    if (inet_pton(AF_INET, addr.c_str(), &a4) == 1) {
      p.range_family = AF_INET;
      std::memset(p.range_addr, 0, 16);
      p.range_addr[10] = 0xff;
      p.range_addr[11] = 0xff;
      std::memcpy(p.range_addr + 12, &a4, 4);
      max_prefix = 32;
    } else if (inet_pton(AF_INET6, addr.c_str(), &a6) == 1) {
      p.range_family = AF_INET6;
      std::memcpy(p.range_addr, &a6, 16);
      max_prefix = 128;
    } else {
      return bad("'" + addr + "' is not an IPv4 or IPv6 address");
    }
    if (plen.empty() || plen.size() > 3 ||
        plen.find_first_not_of("0123456789") != std::string::npos || std::stoi(plen) > max_prefix) {
      return bad("bad prefix length '" + plen + "'");
    }
    p.range_prefix = std::stoi(plen);
    p.has_range = true;
  }
  *out = p;
  return true;
}

bool parse_pkey_pref(const Config& c, PkeyPref* out, std::string* err) {
  PkeyPref p;
  const bool from_nccl = std::find(c.sources.begin(), c.sources.end(),
                                   "R2CCL_IB_PKEY from NCCL_IB_PKEY") != c.sources.end();
  const std::string& v = c.ib_pkey;
  if (!v.empty()) {
    char* end = nullptr;
    errno = 0;
    const unsigned long x = std::strtoul(v.c_str(), &end, 0);
    const bool num = errno == 0 && end != v.c_str() && *end == '\0' && v[0] != '-';
    if (from_nccl) {
      if (!num || x > 0xffff) {
        *err = "NCCL_IB_PKEY='" + v +
               "' (the fallback of R2CCL_IB_PKEY): accepted: a P_Key index " +
               "0..65535, as NCCL reads it";
        return false;
      }
      p.kind = PkeyPref::kIndex;
    } else {
      if (!num || x == 0 || x > 0xffff || (x & 0x7fff) == 0) {
        *err = "R2CCL_IB_PKEY='" + v +
               "': accepted: a P_Key 0x0001..0xffff (hex with 0x, or decimal) whose low 15 bits "
               "are not 0, e.g. 0x8001; NCCL_IB_PKEY, its fallback, is an index instead";
        return false;
      }
      p.kind = PkeyPref::kValue;
    }
    p.value = static_cast<uint32_t>(x);
  }
  *out = p;
  return true;
}

int find_pkey_index(const std::vector<uint16_t>& table, uint16_t pkey) {
  for (size_t i = 0; i < table.size(); i++)
    if (table[i] == pkey) return static_cast<int>(i);
  for (size_t i = 0; i < table.size(); i++)
    if ((table[i] & 0x7fff) == (pkey & 0x7fff)) return static_cast<int>(i);
  return -1;
}

std::string pkey_table_text(const std::vector<uint16_t>& table) {
  std::string s = "(";
  for (size_t i = 0; i < table.size(); i++) {
    char b[16];
    snprintf(b, sizeof(b), "%s0x%04x", i ? ", " : "", table[i]);
    s += b;
  }
  return s + ")";
}

int select_gid(const std::vector<GidEntry>& table, const GidPrefs& p) {
  if (p.forced_index >= 0) {
    for (const auto& e : table)
      if (e.index == p.forced_index && !is_zero(e.raw)) return e.index;
  }
  // Rank: smaller tuple is better.
  using Key = std::tuple<int, int, int, int, int>;
  bool found = false;
  Key best{};
  int best_index = -1;
  for (const auto& e : table) {
    if (is_zero(e.raw)) continue;
    if (p.has_range && !in_range(e.raw, p)) continue;
    int fam = is_v4_mapped(e.raw) ? AF_INET : AF_INET6;
    Key k{is_link_local(e.raw) ? 1 : 0, e.type == p.roce_version ? 0 : 1, fam == p.family ? 0 : 1,
          e.other_netdev ? 1 : 0, e.index};
    if (!found || k < best) {
      found = true;
      best = k;
      best_index = e.index;
    }
  }
  return best_index;
}

std::string gid_to_string(const uint8_t raw[16]) {
  char buf[INET6_ADDRSTRLEN];
  if (!inet_ntop(AF_INET6, raw, buf, sizeof(buf))) return "?";
  return buf;
}

// ---------------------------------------------------------------------------------------
int port_speed_mbps(uint32_t active_speed, uint8_t active_width) {
  int lane;
  switch (active_speed) {
    case 1: lane = 2500; break;      // SDR
    case 2: lane = 5000; break;      // DDR
    case 4: lane = 10000; break;     // QDR
    case 8: lane = 10000; break;     // FDR10
    case 16: lane = 14000; break;    // FDR
    case 32: lane = 25000; break;    // EDR
    case 64: lane = 50000; break;    // HDR
    case 128: lane = 100000; break;  // NDR
    case 256: lane = 200000; break;  // XDR
    default: return 0;
  }
  int lanes;
  switch (active_width) {
    case 1: lanes = 1; break;
    case 2: lanes = 4; break;
    case 4: lanes = 8; break;
    case 8: lanes = 12; break;
    case 16: lanes = 2; break;
    default: return 0;
  }
  return lane * lanes;
}

// ---------------------------------------------------------------------------------------
int pci_distance(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return 3;
  if (a == b) return 0;
  std::string ra, rb;
  std::vector<std::string> ca, cb;
  if (!pci_components(a, &ra, &ca) || !pci_components(b, &rb, &cb) || ra != rb) return 3;
  if (ca == cb) return 0;  // same function, spelled differently ("//", trailing '/')
  // Both below the same first bridge of the root (the root port): one link leaves a root
  // port, so whatever hangs below it is one card or one PCIe switch tree.
  if (ca.size() > 1 && cb.size() > 1 && ca[0] == cb[0]) return 1;
  // Two functions of one device sitting directly on the root bus (0000:00:05.0, .1).
  if (ca.size() == 1 && cb.size() == 1) {
    size_t da = ca[0].rfind('.'), db = cb[0].rfind('.');
    if (da != std::string::npos && da == db && ca[0].compare(0, da, cb[0], 0, db) == 0) return 1;
  }
  return 2;
}

std::vector<int> backup_order(const std::vector<HcaInfo>& hcas, int primary) {
  std::vector<std::tuple<int, int, int>> keys;  // group, distance, index
  const bool valid = primary >= 0 && primary < static_cast<int>(hcas.size());
  const HcaInfo* p = valid ? &hcas[primary] : nullptr;
  for (int i = 0; i < static_cast<int>(hcas.size()); i++) {
    if (i == primary) continue;
    int d = p ? pci_distance(p->pci_path, hcas[i].pci_path) : 3;
    bool same_numa = p && p->numa >= 0 && p->numa == hcas[i].numa;
    int group = d <= 1 ? 0 : (d == 2 || same_numa) ? 1 : 2;
    keys.emplace_back(group, d, i);
  }
  std::sort(keys.begin(), keys.end());
  std::vector<int> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(std::get<2>(k));
  return out;
}

std::string describe(const HcaInfo& h) {
  std::string s = h.name + ":" + std::to_string(h.port) + " ";
  if (h.link_layer == IBV_LINK_LAYER_ETHERNET) {
    s += h.gid_type == kGidTypeRoceV1 ? "RoCEv1" : h.gid_type == kGidTypeRoceV2 ? "RoCEv2" : "RoCE";
  } else {
    s += "IB lid " + std::to_string(h.lid);
  }
  if (h.gid_index >= 0) {
    s += " gid[" + std::to_string(h.gid_index) + "]=" + gid_to_string(h.gid);
  } else {
    s += " no usable GID";
  }
  s += " " + std::to_string(h.speed_mbps) + " Mbps numa " + std::to_string(h.numa);
  if (!h.active) s += " (down)";
  return s;
}

// ---------------------------------------------------------------------------------------
HcaSet::~HcaSet() {
  devices_.insert(devices_.end(), retired_.begin(), retired_.end());
  for (auto& d : devices_) {
    if (d.pd) {
      int rc = v_->dealloc_pd(d.pd);
      if (rc) R2CCL_WARN("ibv_dealloc_pd failed: %s (a QP, CQ or MR is still alive)", strerror(rc));
    }
    if (d.ctx) v_->close_device(d.ctx);
  }
}

bool HcaSet::any_active() const {
  for (const auto& h : hcas_)
    if (h.active) return true;
  return false;
}

void HcaSet::load_gid(size_t i) {
  HcaInfo& h = hcas_[i];
  ibv_port_attr pa;
  int tbl_len = 0;
  if (v_->query_port(h.ctx, static_cast<uint8_t>(h.port), &pa) == 0) tbl_len = pa.gid_tbl_len;
  h.gid_index = -1;
  h.gid_type = -1;
  std::memset(h.gid, 0, sizeof(h.gid));
  if (h.link_layer != IBV_LINK_LAYER_ETHERNET) {
    // InfiniBand: GID 0 is the port GID (subnet prefix + port GUID).
    ibv_gid g;
    if (v_->query_gid(h.ctx, static_cast<uint8_t>(h.port), 0, &g) == 0 && !is_zero(g.raw)) {
      h.gid_index = 0;
      h.gid_type = kGidTypeIb;
      std::memcpy(h.gid, g.raw, 16);
    }
    return;
  }
  tbl_len = std::min(tbl_len, 4096);
  std::vector<GidEntry> table;
  const std::string types_dir =
      ibdev_paths_[i] + "/ports/" + std::to_string(h.port) + "/gid_attrs/types/";
  const std::string ndevs_dir =
      ibdev_paths_[i] + "/ports/" + std::to_string(h.port) + "/gid_attrs/ndevs/";
  std::string own_ndev;  // the netdev of GID 0 (the default GID): the port's own
  if (!read_line(ndevs_dir + "0", &own_ndev)) own_ndev.clear();
  for (int idx = 0; idx < tbl_len; idx++) {
    GidEntry e;
    e.index = idx;
    bool have = false;
    if (v_->query_gid_ex) {
      ibv_gid_entry ge;
      std::memset(&ge, 0, sizeof(ge));
      if (v_->query_gid_ex(h.ctx, static_cast<uint32_t>(h.port), static_cast<uint32_t>(idx), &ge, 0,
                           sizeof(ge)) == 0) {
        std::memcpy(e.raw, ge.gid.raw, 16);
        // On an Ethernet port the "IB/RoCE v1" type is RoCE v1.
        e.type = ge.gid_type == IBV_GID_TYPE_ROCE_V2 ? kGidTypeRoceV2 : kGidTypeRoceV1;
        have = true;
      }
    }
    if (!have) {
      ibv_gid g;
      if (v_->query_gid(h.ctx, static_cast<uint8_t>(h.port), idx, &g) != 0) continue;
      std::memcpy(e.raw, g.raw, 16);
      if (is_zero(e.raw)) continue;
      std::string t;
      // No readable type (kernels before gid_attrs had RoCE v1 only): RoCE v1.
      e.type = read_line(types_dir + std::to_string(idx), &t) && t.find("v2") != std::string::npos
                   ? kGidTypeRoceV2
                   : kGidTypeRoceV1;
    }
    if (is_zero(e.raw)) continue;
    std::string ndev;
    e.other_netdev = !own_ndev.empty() && read_line(ndevs_dir + std::to_string(idx), &ndev) &&
                     !ndev.empty() && ndev != own_ndev;
    table.push_back(e);
  }
  int sel = select_gid(table, prefs_);
  if (prefs_.forced_index >= 0 && sel != prefs_.forced_index) {
    R2CCL_WARN("%s:%d: R2CCL_IB_GID_INDEX=%d is not a valid GID of this port; selected %d instead",
               h.name.c_str(), h.port, prefs_.forced_index, sel);
  }
  for (const auto& e : table) {
    if (e.index != sel) continue;
    h.gid_index = e.index;
    h.gid_type = e.type;
    std::memcpy(h.gid, e.raw, 16);
  }
}

bool HcaSet::load_pkey(size_t i, std::string* err) {
  HcaInfo& h = hcas_[i];
  h.pkey_index = 0;
  h.pkey = 0;
  ibv_port_attr pa;
  int len = 0;
  if (v_->query_port(h.ctx, static_cast<uint8_t>(h.port), &pa) == 0) len = pa.pkey_tbl_len;
  std::vector<uint16_t> table;
  if (v_->query_pkey) {
    for (int k = 0; k < std::min(len, 1024); k++) {
      __be16 be = 0;
      if (v_->query_pkey(h.ctx, static_cast<uint8_t>(h.port), k, &be) != 0) break;
      table.push_back(be16toh(be));
    }
  }
  const std::string port = h.name + ":" + std::to_string(h.port);
  switch (pkey_pref_.kind) {
    case PkeyPref::kDefault:
      if (!table.empty()) h.pkey = table[0];
      return true;
    case PkeyPref::kIndex:
      if (static_cast<int>(pkey_pref_.value) >= len) {
        *err = "NCCL_IB_PKEY=" + std::to_string(pkey_pref_.value) + ": no P_Key index " +
               std::to_string(pkey_pref_.value) + " on " + port + " " + pkey_table_text(table) +
               " (NCCL_IB_PKEY is an index, as in NCCL; R2CCL_IB_PKEY names a P_Key value)";
        return false;
      }
      h.pkey_index = static_cast<uint16_t>(pkey_pref_.value);
      if (h.pkey_index < table.size()) h.pkey = table[h.pkey_index];
      return true;
    case PkeyPref::kValue: {
      char want[16];
      snprintf(want, sizeof(want), "0x%04x", pkey_pref_.value);
      if (!v_->query_pkey) {
        *err = std::string("R2CCL_IB_PKEY=") + want +
               ": the verbs library lacks ibv_query_pkey, so the P_Key's index on " + port +
               " is unknown; give NCCL_IB_PKEY=<index> instead";
        return false;
      }
      const int k = find_pkey_index(table, static_cast<uint16_t>(pkey_pref_.value));
      if (k < 0) {
        *err = std::string("R2CCL_IB_PKEY=") + want + ": not in the P_Key table of " + port + " " +
               pkey_table_text(table);
        return false;
      }
      h.pkey_index = static_cast<uint16_t>(k);
      h.pkey = table[static_cast<size_t>(k)];
      return true;
    }
  }
  return true;
}

bool HcaSet::discover(const VerbsApi* v, const Config& cfg, std::unique_ptr<HcaSet>* out,
                      std::string* err) {
  HcaSpec spec;
  if (!parse_hca_spec(cfg.ib_hca, &spec, err)) return false;
  std::unique_ptr<HcaSet> set(new HcaSet());
  set->v_ = v;
  if (!parse_gid_prefs(cfg, &set->prefs_, err)) return false;
  if (!parse_pkey_pref(cfg, &set->pkey_pref_, err)) return false;
  set->speed_override_ = cfg.speed_mbps > 0 ? static_cast<int>(cfg.speed_mbps) : 0;

  int n = 0;
  ibv_device** list = v->get_device_list(&n);
  if (!list) {
    R2CCL_INFO(NCCL_INIT | NCCL_NET, "NET/R2CCL: ibv_get_device_list: %s; no HCA", strerror(errno));
    *out = std::move(set);
    return true;
  }
  std::vector<std::pair<std::string, ibv_device*>> devs;
  for (int i = 0; i < n && list[i]; i++) {
    const char* name = v->get_device_name(list[i]);
    devs.emplace_back(name ? name : "", list[i]);
  }
  std::stable_sort(devs.begin(), devs.end(),
                   [](const auto& a, const auto& b) { return natural_less(a.first, b.first); });

  for (const auto& [name, dev] : devs) {
    if (name.empty()) continue;
    ibv_context* ctx = v->open_device(dev);
    if (!ctx) {
      R2CCL_WARN("NET/R2CCL: cannot open HCA %s: %s; skipped", name.c_str(), strerror(errno));
      continue;
    }
    ibv_device_attr da;
    std::memset(&da, 0, sizeof(da));
    int rc = v->query_device(ctx, &da);
    if (rc) {
      R2CCL_WARN("NET/R2CCL: ibv_query_device(%s) failed: %s; skipped", name.c_str(), strerror(rc));
      v->close_device(ctx);
      continue;
    }
    std::vector<HcaInfo> ports;
    for (int port = 1; port <= da.phys_port_cnt; port++) {
      if (!hca_spec_selects(spec, name, port)) continue;
      ibv_port_attr pa;
      rc = v->query_port(ctx, static_cast<uint8_t>(port), &pa);
      if (rc) {
        R2CCL_WARN("NET/R2CCL: ibv_query_port(%s:%d) failed: %s; skipped", name.c_str(), port,
                   strerror(rc));
        continue;
      }
      int ll = pa.link_layer;
      if (ll == IBV_LINK_LAYER_UNSPECIFIED) ll = IBV_LINK_LAYER_INFINIBAND;
      if (ll != IBV_LINK_LAYER_INFINIBAND && ll != IBV_LINK_LAYER_ETHERNET) continue;
      HcaInfo h;
      h.name = name;
      h.port = port;
      h.link_layer = ll;
      h.active = pa.state == IBV_PORT_ACTIVE;
      h.lid = pa.lid;
      int sp = port_speed_mbps(pa.active_speed, pa.active_width);
      h.speed_mbps = set->speed_override_ > 0 ? set->speed_override_ : sp > 0 ? sp : 10000;
      h.active_mtu = pa.active_mtu;
      h.port_flags = pa.flags;
      h.guid = be64toh(v->get_device_guid(dev));
      h.pci_path = real_path(std::string(dev->ibdev_path) + "/device");
      std::string numa;
      if (!h.pci_path.empty() && read_line(h.pci_path + "/numa_node", &numa)) {
        char* end = nullptr;
        long nv = std::strtol(numa.c_str(), &end, 10);
        if (end != numa.c_str() && *end == '\0' && nv >= -1 && nv < (1 << 20))
          h.numa = static_cast<int>(nv);
      }
      h.ctx = ctx;
      ports.push_back(h);
    }
    if (ports.empty()) {
      v->close_device(ctx);
      continue;
    }
    ibv_pd* pd = v->alloc_pd(ctx);
    if (!pd) {
      R2CCL_WARN("NET/R2CCL: ibv_alloc_pd(%s) failed: %s; skipped", name.c_str(), strerror(errno));
      v->close_device(ctx);
      continue;
    }
    set->devices_.push_back(Device{ctx, pd});
    for (auto& h : ports) {
      h.pd = pd;
      set->hcas_.push_back(h);
      set->ibdev_paths_.push_back(dev->ibdev_path);
      set->load_gid(set->hcas_.size() - 1);
      if (!set->load_pkey(set->hcas_.size() - 1, err)) {
        v->free_device_list(list);
        return false;
      }
    }
  }
  v->free_device_list(list);
  *out = std::move(set);
  return true;
}

bool HcaSet::refresh_port(int i, bool* active_now) {
  if (i < 0 || i >= static_cast<int>(hcas_.size())) {
    if (active_now) *active_now = false;
    return false;
  }
  HcaInfo& h = hcas_[i];
  ibv_port_attr pa;
  if (v_->query_port(h.ctx, static_cast<uint8_t>(h.port), &pa) != 0) {
    h.active = false;
    if (active_now) *active_now = false;
    return false;
  }
  h.active = pa.state == IBV_PORT_ACTIVE;
  h.lid = pa.lid;
  h.active_mtu = pa.active_mtu;
  h.port_flags = pa.flags;
  if (speed_override_ <= 0) {
    int sp = port_speed_mbps(pa.active_speed, pa.active_width);
    if (sp > 0) h.speed_mbps = sp;
  }
  if (active_now) *active_now = h.active;
  int old_index = h.gid_index;
  uint8_t old_gid[16];
  std::memcpy(old_gid, h.gid, 16);
  load_gid(static_cast<size_t>(i));
  return old_index != h.gid_index || std::memcmp(old_gid, h.gid, 16) != 0;
}

bool HcaSet::reopen(int i, std::string* why) {
  if (i < 0 || i >= static_cast<int>(hcas_.size())) {
    *why = "no such HCA port";
    return false;
  }
  ibv_context* old = hcas_[i].ctx;
  const std::string name = hcas_[i].name;
  int n = 0;
  ibv_device** list = v_->get_device_list(&n);
  if (!list) {
    *why = std::string("ibv_get_device_list: ") + strerror(errno);
    return false;
  }
  ibv_device* dev = nullptr;
  for (int k = 0; k < n && list[k]; ++k) {
    const char* nm = v_->get_device_name(list[k]);
    if (nm && name == nm && be64toh(v_->get_device_guid(list[k])) == hcas_[i].guid) dev = list[k];
  }
  ibv_context* ctx = dev ? v_->open_device(dev) : nullptr;
  const int open_errno = errno;
  v_->free_device_list(list);
  if (!dev) {
    *why = "not listed (still resetting)";
    return false;
  }
  if (!ctx) {
    *why = std::string("ibv_open_device: ") + strerror(open_errno);
    return false;
  }
  ibv_pd* pd = v_->alloc_pd(ctx);
  if (!pd) {
    *why = std::string("ibv_alloc_pd: ") + strerror(errno);
    v_->close_device(ctx);
    return false;
  }
  for (auto& d : devices_)
    if (d.ctx == old) {
      retired_.push_back(d);
      d = Device{ctx, pd};
    }
  for (size_t j = 0; j < hcas_.size(); ++j) {
    if (hcas_[j].ctx != old) continue;
    hcas_[j].ctx = ctx;
    hcas_[j].pd = pd;
    hcas_[j].epoch++;
    refresh_port(static_cast<int>(j), nullptr);
  }
  return true;
}

}  // namespace r2ccl::net::ib
