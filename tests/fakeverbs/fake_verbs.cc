// Fake verbs provider: devices, contexts, PDs, MRs, CQs, async events and the fakeverbs_*
// control functions. QPs and the data path are in qp.cc, the cross-process transport in
// nic.cc, fault injection in faults.cc; fake_internal.h describes the emulation model.
//
// Devices come from FAKEVERBS_DEVICES, read once per process at the first
// ibv_get_device_list (and again in a fork child: a child starts with a fresh, empty state,
// like a real process whose parent's verbs objects are unusable after fork).
//
// Every exported function is thread-safe (one process-wide mutex).

#include <arpa/inet.h>
#include <endian.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "fake_internal.h"

#undef ibv_query_port
#undef ibv_reg_mr

namespace fv {

State* g = new State();  // never destroyed: the NIC thread may outlive static destructors

namespace {

bool mkdir_p(const std::string& p) {
  if (p.empty()) return false;
  std::string cur;
  for (const auto& part : split(p, '/')) {
    if (part.empty()) {
      if (cur.empty()) cur = "/";
      continue;
    }
    if (!cur.empty() && cur.back() != '/') cur += '/';
    cur += part;
    if (mkdir(cur.c_str(), 0777) != 0 && errno != EEXIST) return false;
  }
  return true;
}

bool parse_ll(const std::string& s, long long* v, int base = 10) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long x = strtoll(s.c_str(), &end, base);
  if (errno || *end) return false;
  *v = x;
  return true;
}

// IB encodings: active_speed codes with their per-lane Mbps, active_width codes with lanes.
void encode_speed(int mbps, uint8_t* speed, uint8_t* width) {
  static const struct {
    uint8_t code;
    int lane;
  } speeds[] = {{1, 2500},   {2, 5000},   {4, 10000},   {16, 14000},
                {32, 25000}, {64, 50000}, {128, 100000}};
  static const struct {
    uint8_t code;
    int lanes;
  } widths[] = {{1, 1}, {16, 2}, {2, 4}, {4, 8}, {8, 12}};
  long long best = -1;
  for (const auto& w : widths) {
    for (const auto& s : speeds) {
      long long d = llabs(static_cast<long long>(s.lane) * w.lanes - mbps);
      // Ties: prefer 4x (the common HCA width), then fewer, faster lanes.
      bool better = best < 0 || d < best || (d == best && w.lanes == 4 && *width != 2);
      if (better) {
        best = d;
        *speed = s.code;
        *width = w.code;
      }
    }
  }
}

// The VLAN id of a netdev name "<dev>.<vid>" (the kernel's default VLAN naming), 0 = none.
int vlan_of(const std::string& ndev) {
  size_t dot = ndev.rfind('.');
  if (dot == std::string::npos || dot + 1 >= ndev.size()) return 0;
  long long v;
  return parse_ll(ndev.substr(dot + 1), &v) && v > 0 && v < 4095 ? static_cast<int>(v) : 0;
}

GidEntry make_gid(const uint8_t raw[16], uint32_t type, bool ip_based, const std::string& ndev) {
  GidEntry e;
  memcpy(e.gid.raw, raw, 16);
  e.type = type;
  e.valid = true;
  e.ip_based = ip_based;
  e.ndev = ndev;
  return e;
}

void fill_gids(Device* d) {
  d->gids.assign(d->big_gids > 0 ? d->big_gids : kGidTableLen, GidEntry{});
  if (!d->eth) {
    uint8_t raw[16] = {0xfe, 0x80};
    uint64_t be = htobe64(d->guid);
    memcpy(raw + 8, &be, 8);
    d->gids[0] = make_gid(raw, IBV_GID_TYPE_IB, false, "");
    return;
  }
  // Link-local GIDs: the EUI-64 interface id of the port's MAC (U/L bit flipped); the
  // kernel's default GIDs, always at indices 0 and 1.
  uint8_t ll[16] = {0xfe, 0x80};
  uint64_t iid = htobe64(d->guid ^ (2ull << 56));
  memcpy(ll + 8, &iid, 8);
  d->gids[0] = make_gid(ll, IBV_GID_TYPE_ROCE_V1, false, d->netdev);
  d->gids[1] = make_gid(ll, IBV_GID_TYPE_ROCE_V2, false, d->netdev);
  if (d->big_gids == 0) {
    set_ipv4_locked(d, d->ipv4);
    return;
  }
  // A full table (gids=N): after the default GIDs, v1/v2 pairs of: the port's IPv4 address
  // (::ffff:a.b.c.d), its global IPv6 address 2001:db8:<a.b>:<c>::<d>, then for VLAN
  // v = 100, 101, ... on netdev <netdev>.<v>: the VLAN netdev's link-local address, its
  // IPv4 address 10.<v>.<c>.<d> and its IPv6 address 2001:db8:<v>:<c>::<d>. Entry p of that
  // list sits at index 2 + (p + gid_rotate) % (N - 2).
  const uint8_t* ip = reinterpret_cast<const uint8_t*>(&d->ipv4);
  std::vector<GidEntry> list;
  auto pair = [&](const uint8_t raw[16], const std::string& ndev) {
    list.push_back(make_gid(raw, IBV_GID_TYPE_ROCE_V1, true, ndev));
    list.push_back(make_gid(raw, IBV_GID_TYPE_ROCE_V2, true, ndev));
  };
  auto v4 = [&](uint8_t a, uint8_t b) {
    uint8_t raw[16] = {};
    raw[10] = raw[11] = 0xff;
    raw[12] = a;
    raw[13] = b;
    raw[14] = ip[2];
    raw[15] = ip[3];
    return std::vector<uint8_t>(raw, raw + 16);
  };
  auto v6 = [&](uint8_t hi, uint8_t lo) {
    uint8_t raw[16] = {0x20, 0x01, 0x0d, 0xb8, hi, lo, 0, ip[2]};
    raw[15] = ip[3];
    return std::vector<uint8_t>(raw, raw + 16);
  };
  pair(v4(ip[0], ip[1]).data(), d->netdev);
  pair(v6(ip[0], ip[1]).data(), d->netdev);
  for (int v = 100; static_cast<int>(list.size()) < d->big_gids - 2 && v < 4095; ++v) {
    const std::string ndev = d->netdev + "." + std::to_string(v);
    uint8_t vll[16] = {0xfe, 0x80};
    uint64_t viid = htobe64((d->guid ^ (2ull << 56)) + static_cast<uint64_t>(v));
    memcpy(vll + 8, &viid, 8);
    pair(vll, ndev);
    pair(v4(10, static_cast<uint8_t>(v)).data(), ndev);
    pair(v6(static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v)).data(), ndev);
  }
  const int n = d->big_gids - 2;
  for (int p = 0; p < n && p < static_cast<int>(list.size()); ++p)
    d->gids[2 + (p + d->gid_rotate) % n] = list[p];
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
}

}  // namespace

int vlan_of_gid(const GidEntry& e) { return vlan_of(e.ndev); }

void write_gid_sysfs(Device* d) {
  std::string ports = std::string(d->box.pub.ibdev_path) + "/ports/1";
  if (!mkdir_p(ports + "/gids") || !mkdir_p(ports + "/gid_attrs/types") ||
      !mkdir_p(ports + "/gid_attrs/ndevs") || !mkdir_p(ports + "/pkeys"))
    return;
  for (size_t i = 0; i < d->gids.size(); ++i) {
    char buf[64];
    const uint8_t* r = d->gids[i].gid.raw;
    snprintf(buf, sizeof buf,
             "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x\n", r[0],
             r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], r[13],
             r[14], r[15]);
    const std::string idx = std::to_string(i);
    write_file(ports + "/gids/" + idx, buf);
    std::string type = !d->gids[i].valid                         ? ""
                       : d->gids[i].type == IBV_GID_TYPE_ROCE_V2 ? "RoCE v2\n"
                                                                 : "IB/RoCE v1\n";
    write_file(ports + "/gid_attrs/types/" + idx, type);
    // The kernel's file reads EINVAL for an empty slot; an empty file stands for it here.
    write_file(ports + "/gid_attrs/ndevs/" + idx,
               d->gids[i].valid && !d->gids[i].ndev.empty() ? d->gids[i].ndev + "\n" : "");
  }
  for (size_t i = 0; i < d->pkeys.size(); ++i) {
    char buf[16];
    snprintf(buf, sizeof buf, "0x%04x\n", d->pkeys[i]);
    write_file(ports + "/pkeys/" + std::to_string(i), buf);
  }
}

namespace {

// One device entry `name,linklayer,addr[,key=value...]`.
bool parse_device(const std::string& entry, Device* d, std::string* err) {
  auto f = split(entry, ',');
  const char* form =
      "name,ib,<lid>|name,eth,<ipv4>[,prefix=<0..32>][,speed=<Mbps>][,pci=<path>][,numa=<node>]"
      "[,state=down][,guid=<hex>][,pkeys=<P_Key>[:<P_Key>...]][,grh_required]"
      "[,mtu=1024|2048|4096][,gids=<4..255>][,gid_rotate=<K>][,netdev=<name>]";
  auto fail = [&](const std::string& why) {
    *err = "fakeverbs: bad FAKEVERBS_DEVICES entry '" + entry + "': " + why +
           " (accepted: " + form + ")";
    return false;
  };
  if (f.size() < 3) return fail("needs name, link layer and address");
  d->name = trim(f[0]);
  if (d->name.empty() || d->name.size() >= IBV_SYSFS_NAME_MAX) return fail("bad name");
  std::string ll = trim(f[1]), addr = trim(f[2]);
  if (ll == "ib") {
    long long lid;
    if (!parse_ll(addr, &lid) || lid <= 0 || lid >= 0xc000) return fail("bad LID");
    d->lid = static_cast<uint16_t>(lid);
  } else if (ll == "eth") {
    in_addr a;
    if (inet_pton(AF_INET, addr.c_str(), &a) != 1) return fail("bad IPv4 address");
    d->eth = true;
    d->ipv4 = a.s_addr;
  } else {
    return fail("link layer must be ib or eth");
  }
  bool have_guid = false;
  for (size_t i = 3; i < f.size(); ++i) {
    std::string kv = trim(f[i]);
    if (kv == "grh_required") kv = "grh_required=1";
    size_t eq = kv.find('=');
    if (eq == std::string::npos) return fail("option '" + kv + "' is not key=value");
    std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    long long x;
    if (k == "speed") {
      if (!parse_ll(v, &x) || x <= 0 || x > 10000000) return fail("bad speed");
      d->speed_mbps = static_cast<int>(x);
    } else if (k == "pci") {
      if (v.empty() || v.front() == '/' || v.find("..") != std::string::npos)
        return fail("bad pci path");
      d->pci = v;
    } else if (k == "prefix") {
      if (!d->eth) return fail("prefix is for eth devices (their netdev's address)");
      if (!parse_ll(v, &x) || x < 0 || x > 32) return fail("bad prefix length");
      d->prefix = static_cast<int>(x);
    } else if (k == "numa") {
      if (!parse_ll(v, &x) || x < -1 || x > 1024) return fail("bad numa node");
      d->numa = static_cast<int>(x);
    } else if (k == "state") {
      if (v != "down" && v != "up") return fail("state must be down or up");
      d->active = v == "up";
    } else if (k == "guid") {
      if (v.rfind("0x", 0) == 0) v = v.substr(2);
      char* end = nullptr;
      errno = 0;
      unsigned long long gv = strtoull(v.c_str(), &end, 16);
      if (v.empty() || errno || *end) return fail("bad guid");
      d->guid = gv;
      have_guid = true;
    } else if (k == "pkeys") {
      d->pkeys.clear();
      for (const auto& pk : split(v, ':')) {
        long long pv;
        // P_Keys with no partition bits (0x0000, 0x8000) are invalid (IBA vol. 1 10.9.1).
        if (!parse_ll(pk, &pv, 0) || pv <= 0 || pv > 0xffff || (pv & 0x7fff) == 0)
          return fail("bad pkeys '" + v +
                      "': ':'-separated P_Keys 0x0001..0xffff (bit 15 = "
                      "full member; low 15 bits not 0)");
        d->pkeys.push_back(static_cast<uint16_t>(pv));
      }
      if (d->pkeys.empty() || d->pkeys.size() > kMaxPkeys)
        return fail("pkeys needs 1.." + std::to_string(kMaxPkeys) + " entries");
    } else if (k == "grh_required") {
      if (v != "1" && v != "0") return fail("grh_required takes no value (or 1/0)");
      d->grh_required = v == "1";
    } else if (k == "mtu") {
      if (v == "1024") {
        d->active_mtu = IBV_MTU_1024;
      } else if (v == "2048") {
        d->active_mtu = IBV_MTU_2048;
      } else if (v == "4096") {
        d->active_mtu = IBV_MTU_4096;
      } else {
        return fail("mtu must be 1024, 2048 or 4096");
      }
    } else if (k == "gids") {
      if (!parse_ll(v, &x) || x < 4 || x > kMaxGidTableLen)
        return fail("gids must be 4.." + std::to_string(kMaxGidTableLen));
      d->big_gids = static_cast<int>(x);
    } else if (k == "gid_rotate") {
      if (!parse_ll(v, &x) || x < 0 || x > 100000) return fail("bad gid_rotate");
      d->gid_rotate = static_cast<int>(x);
    } else if (k == "netdev") {
      if (v.empty() || v.size() >= 16 || v.find_first_of("/ .") != std::string::npos)
        return fail("bad netdev name (1..15 characters, no '/', ' ' or '.')");
      d->netdev = v;
    } else {
      return fail("unknown option '" + k + "'");
    }
  }
  if ((d->big_gids || d->gid_rotate) && !d->eth) return fail("gids= needs an eth device");
  if (d->gid_rotate && !d->big_gids) return fail("gid_rotate needs gids=N");
  if (!have_guid) {
    if (d->eth) {
      const uint8_t* ip = reinterpret_cast<const uint8_t*>(&d->ipv4);
      d->guid = (0x02ull << 56) | (uint64_t(ip[0]) << 40) | (0xfffeull << 24) |
                (uint64_t(ip[1]) << 16) | (uint64_t(ip[2]) << 8) | ip[3];
    } else {
      uint32_t h = 2166136261u;
      for (char c : d->name) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
      d->guid = 0xfa4e000000000000ull | (uint64_t(d->lid) << 24) | (h & 0xffffff);
    }
  }
  encode_speed(d->speed_mbps, &d->active_speed, &d->active_width);
  return true;
}

bool build_sysfs(Device* d, int index, std::string* err) {
  std::string base = g->dir + "/sys-" + std::to_string(getpid());
  std::string cls = base + "/class/infiniband/" + d->name;
  std::string uverbs = base + "/class/infiniband_verbs/uverbs" + std::to_string(index);
  if (cls.size() >= IBV_SYSFS_PATH_MAX || uverbs.size() >= IBV_SYSFS_PATH_MAX) {
    *err = "fakeverbs: FAKEVERBS_DIR '" + g->dir + "' is too long for sysfs paths";
    return false;
  }
  if (!mkdir_p(cls) || !mkdir_p(uverbs)) {
    *err = "fakeverbs: cannot create " + cls + ": " + strerror(errno);
    return false;
  }
  ibv_device& p = d->box.pub;
  memset(&p, 0, sizeof p);
  p.node_type = IBV_NODE_CA;
  p.transport_type = IBV_TRANSPORT_IB;
  snprintf(p.name, sizeof p.name, "%s", d->name.c_str());
  snprintf(p.dev_name, sizeof p.dev_name, "uverbs%d", index);
  snprintf(p.dev_path, sizeof p.dev_path, "%s", uverbs.c_str());
  snprintf(p.ibdev_path, sizeof p.ibdev_path, "%s", cls.c_str());
  d->box.impl = d;
  std::string link = cls + "/device";
  unlink(link.c_str());
  if (!d->pci.empty()) {
    std::string dev = base + "/devices/pci0000:00/" + d->pci;
    if (!mkdir_p(dev)) {
      *err = "fakeverbs: cannot create " + dev + ": " + strerror(errno);
      return false;
    }
    write_file(dev + "/numa_node", std::to_string(d->numa) + "\n");
    if (symlink(dev.c_str(), link.c_str()) != 0) {
      *err = "fakeverbs: cannot link " + link + ": " + strerror(errno);
      return false;
    }
  }
  char guid[32];
  snprintf(guid, sizeof guid, "%04x:%04x:%04x:%04x\n", unsigned(d->guid >> 48) & 0xffff,
           unsigned(d->guid >> 32) & 0xffff, unsigned(d->guid >> 16) & 0xffff,
           unsigned(d->guid) & 0xffff);
  write_file(cls + "/node_guid", guid);
  write_gid_sysfs(d);
  return true;
}

void atfork_prepare() { g->mu.lock(); }
void atfork_parent() {
  if (g->fork_copies)
    for (auto& kv : g->mrs)
      if (!kv.second->dontfork) kv.second->cow_lost = true;
  g->mu.unlock();
}
// The child starts over: the parent's threads are gone and its objects unusable. Close the
// parent's transport fds so that the parent's peers still see it die when it dies.
void atfork_child() {
  for (int fd : g->owned_fds) close(fd);
  for (auto& kv : g->conns) close(kv.first);
  g = new State();  // the old state (and its locked mutex) is abandoned
}

struct AtFork {
  AtFork() { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }
} at_fork;

}  // namespace

int ensure_init_locked() {
  if (g->inited) return g->init_errno;
  g->inited = true;
  const char* dir = getenv("FAKEVERBS_DIR");
  g->dir = dir && *dir ? dir : "/tmp/fakeverbs-" + std::to_string(getuid());
  while (g->dir.size() > 1 && g->dir.back() == '/') g->dir.pop_back();
  if (!mkdir_p(g->dir)) {
    fprintf(stderr, "fakeverbs: cannot create FAKEVERBS_DIR %s: %s\n", g->dir.c_str(),
            strerror(errno));
    return g->init_errno = EINVAL;
  }
  if (const char* r = getenv("FAKEVERBS_RETRY_US"); r && *r) {
    long long v;
    if (!parse_ll(r, &v) || v <= 0) {
      fprintf(stderr, "fakeverbs: bad FAKEVERBS_RETRY_US '%s' (microseconds, > 0)\n", r);
      return g->init_errno = EINVAL;
    }
    g->retry_us_env = v;
  }
  if (const char* r = getenv("FAKEVERBS_KERNEL_FORK"); r && *r) {
    if (strcmp(r, "safe") != 0 && strcmp(r, "copy") != 0) {
      fprintf(stderr, "fakeverbs: bad FAKEVERBS_KERNEL_FORK '%s' (safe or copy)\n", r);
      return g->init_errno = EINVAL;
    }
    g->fork_copies = strcmp(r, "copy") == 0;
  }
  if (const char* r = getenv("FAKEVERBS_FENCE"); r && *r) {
    if (strcmp(r, "0") != 0 && strcmp(r, "1") != 0) {
      fprintf(stderr, "fakeverbs: bad FAKEVERBS_FENCE '%s' (0 or 1)\n", r);
      return g->init_errno = EINVAL;
    }
    g->fence = r[0] == '1';
  }
  if (const char* r = getenv("R2CCL_TEST_TIME_SCALE"); r && *r) {
    long long v;
    if (!parse_ll(r, &v) || v < 1 || v > 1000000) {
      fprintf(stderr, "fakeverbs: bad R2CCL_TEST_TIME_SCALE '%s' (an integer 1-1000000)\n", r);
      return g->init_errno = EINVAL;
    }
    g->time_scale = v;
  }
  if (const char* r = getenv("FAKEVERBS_RECV_LAG_US"); r && *r) {
    long long v;
    if (!parse_ll(r, &v) || v < 0 || v > 1000000) {
      fprintf(stderr, "fakeverbs: bad FAKEVERBS_RECV_LAG_US '%s' (microseconds, 0-1000000)\n", r);
      return g->init_errno = EINVAL;
    }
    g->recv_lag_us = v;
  }
  if (const char* r = getenv("FAKEVERBS_DMABUF"); r && *r) {
    if (strcmp(r, "unsupported") != 0 && strcmp(r, "probe") != 0) {
      fprintf(stderr, "fakeverbs: bad FAKEVERBS_DMABUF '%s' (unsupported or probe)\n", r);
      return g->init_errno = EINVAL;
    }
    g->dmabuf_probe = strcmp(r, "probe") == 0;
  }
  if (const char* r = getenv("FAKEVERBS_DELAY_US"); r && *r) {
    long long v;
    if (!parse_ll(r, &v) || v < 0 || v > 1000000) {
      fprintf(stderr, "fakeverbs: bad FAKEVERBS_DELAY_US '%s' (microseconds, 0-1000000)\n", r);
      return g->init_errno = EINVAL;
    }
    g->delay_us = v;
  }
  if (const char* r = getenv("FAKEVERBS_SEED"); r && *r) {
    long long v;
    if (!parse_ll(r, &v) || v < 0) {
      fprintf(stderr, "fakeverbs: bad FAKEVERBS_SEED '%s' (an integer >= 0)\n", r);
      return g->init_errno = EINVAL;
    }
    g->seed = static_cast<uint64_t>(v);
  } else {
    g->seed = (static_cast<uint64_t>(getpid()) << 20) ^
              static_cast<uint64_t>(Clock::now().time_since_epoch().count() & 0xfffff);
  }
  g->lag_rng = g->seed * 0x9e3779b97f4a7c15ull + 1;
  if (g->recv_lag_us > 0 || g->delay_us > 0)
    fprintf(stderr,
            "fakeverbs[%d]: packets wait up to %lld us at the target, receive completions lag "
            "up to %lld us, FAKEVERBS_SEED=%llu (set it to repeat this run's delays)\n",
            static_cast<int>(getpid()), g->delay_us, g->recv_lag_us,
            static_cast<unsigned long long>(g->seed));
  g->key_rng = (static_cast<uint64_t>(getpid()) << 32) ^
               static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^
               0x9e3779b97f4a7c15ull;
  const char* devs = getenv("FAKEVERBS_DEVICES");
  std::vector<Device*> list;
  if (devs && *devs) {
    int i = 0;
    for (const auto& e : split(devs, ';')) {
      if (trim(e).empty()) continue;
      auto* d = new Device();
      d->netdev = "eth" + std::to_string(i);
      std::string err;
      if (!parse_device(e, d, &err) || find_device(d->name) || !build_sysfs(d, i, &err)) {
        if (err.empty()) err = "fakeverbs: duplicate device name '" + d->name + "'";
        fprintf(stderr, "%s\n", err.c_str());
        delete d;
        for (auto* x : g->devices) delete x;
        g->devices.clear();
        return g->init_errno = EINVAL;
      }
      fill_gids(d);
      write_gid_sysfs(d);
      g->devices.push_back(d);
      ++i;
    }
  }
  if (const char* f = getenv("FAKEVERBS_FAULTS"); f && *f) {
    std::vector<Fault> faults;
    std::string err;
    if (!parse_faults_locked(f, &faults, &err)) {
      fprintf(stderr, "%s (from FAKEVERBS_FAULTS)\n", err.c_str());
      return g->init_errno = EINVAL;
    }
    for (const auto& x : faults) arm_or_fire_locked(x);
  }
  return 0;
}

Device* find_device(const std::string& name) {
  for (auto* d : g->devices)
    if (d->name == name) return d;
  return nullptr;
}

long long random_us_locked(long long max_us) {
  if (max_us <= 0) return 0;
  uint64_t& x = g->lag_rng;  // xorshift64*
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  return static_cast<long long>((x * 0x2545f4914f6cdd1dull) % static_cast<uint64_t>(max_us + 1));
}

Context* ctx_of(ibv_context* c) {
  auto* v = reinterpret_cast<verbs_context*>(reinterpret_cast<char*>(c) -
                                             offsetof(verbs_context, context));
  return reinterpret_cast<CtxBox*>(v)->impl;
}

void push_event(Context* c, ibv_event_type t, Cq* cq, int port) {
  ibv_async_event ev{};
  ev.event_type = t;
  if (cq)
    ev.element.cq = &cq->box.pub;
  else
    ev.element.port_num = port;
  c->events.push_back(ev);
  char b = 1;
  if (write(c->async_wr, &b, 1) != 1) c->events.pop_back();  // pipe full: drop
}

void push_qp_event(Qp* qp, ibv_event_type t) {
  if (qp->ctx->dead) return;
  ibv_async_event ev{};
  ev.event_type = t;
  ev.element.qp = &qp->box.pub;
  qp->ctx->events.push_back(ev);
  char b = 1;
  if (write(qp->ctx->async_wr, &b, 1) != 1) qp->ctx->events.pop_back();
}

void push_cqe(Cq* cq, const ibv_wc& wc, uint64_t sq_slot_end) {
  if (cq->overrun) return;  // a CQ in error takes no completion
  if (static_cast<int>(cq->wcs.size()) >= cq->capacity) {
    // Overrun (IBA 11.4.2.1: the CQ enters the error state; its QPs' next completion makes
    // them fatal). Every QP on the CQ goes to ERR at the NIC thread's next pass.
    cq->overrun = true;
    if (!cq->ctx->dead) push_event(cq->ctx, IBV_EVENT_CQ_ERR, cq, 0);
    for (auto& kv : g->qps)
      if (kv.second->scq == cq || kv.second->rcq == cq) g->fatal_qpns.push_back(kv.first);
    wake_nic();
    return;
  }
  cq->wcs.push_back(wc);
  cq->slot_ends.push_back(sq_slot_end);
}

void set_port_locked(Device* d, bool up, int gids) {
  if (d->active == up) return;
  d->active = up;
  for (auto* c : d->contexts)
    if (!c->dead) push_event(c, up ? IBV_EVENT_PORT_ACTIVE : IBV_EVENT_PORT_ERR, nullptr, 1);
  if (gids == kGidsKeep || !d->eth) return;
  bool changed = false;
  if (!up) {
    // The netdev went down: the kernel deletes the GIDs of its IP addresses.
    for (size_t i = 0; i < d->gids.size(); ++i) {
      if (!d->gids[i].valid || !d->gids[i].ip_based) continue;
      d->removed_gids.emplace_back(static_cast<int>(i), d->gids[i]);
      d->gids[i] = GidEntry{};
      changed = true;
    }
  } else if (!d->removed_gids.empty()) {
    // Back up: re-added, at the same slots or at the first free ones after the highest used
    // index (a slot still referenced by an old QP is not reused at once).
    size_t next = 0;
    for (size_t i = 0; i < d->gids.size(); ++i)
      if (d->gids[i].valid) next = i + 1;
    for (const auto& r : d->removed_gids) next = std::max(next, static_cast<size_t>(r.first) + 1);
    for (const auto& [index, e] : d->removed_gids) {
      size_t at = static_cast<size_t>(index);
      if (gids == kGidsMove) {
        for (size_t tries = 0; tries < d->gids.size(); ++tries, ++next) {
          if (next >= d->gids.size()) next = 2;
          if (!d->gids[next].valid) break;
        }
        at = next++;
      }
      if (at < d->gids.size() && !d->gids[at].valid) d->gids[at] = e;
    }
    d->removed_gids.clear();
    changed = true;
  }
  if (!changed) return;
  if (d->box.pub.ibdev_path[0]) write_gid_sysfs(d);
  for (auto* c : d->contexts)
    if (!c->dead) push_event(c, IBV_EVENT_GID_CHANGE, nullptr, 1);
}

void apply_fatal_locked() {
  std::vector<uint32_t> qpns;
  qpns.swap(g->fatal_qpns);
  for (uint32_t n : qpns) {
    auto it = g->qps.find(n);
    if (it == g->qps.end() || it->second->state == IBV_QPS_ERR) continue;
    qp_to_error_locked(it->second);
    push_qp_event(it->second, IBV_EVENT_QP_FATAL);
  }
  std::vector<Device*> devs;
  devs.swap(g->fatal_devices);
  for (Device* d : devs) {
    // mlx5 in internal-error state: the driver flushes every QP in software, raises
    // IBV_EVENT_DEVICE_FATAL on each open context and then answers only destroy commands;
    // the device is unregistered and appears again after its reset (a new ibv_device).
    for (auto& kv : g->qps)
      if (kv.second->dev == d && !kv.second->ctx->dead && kv.second->state != IBV_QPS_ERR)
        qp_to_error_locked(kv.second);
    for (Context* c : d->contexts) {
      if (c->dead) continue;
      push_event(c, IBV_EVENT_DEVICE_FATAL, nullptr, 0);
      c->dead = true;
    }
    d->fenced.clear();  // what the dead HCA had not made visible is gone with it
    d->active = false;
    d->removed = true;
  }
}

void device_back_locked(Device* d) {
  if (!d->removed) return;
  d->removed = false;
  d->active = true;
  d->incarnation++;
}

void set_ipv4_locked(Device* d, uint32_t addr_be) {
  d->ipv4 = addr_be;
  if (!d->eth) return;
  // The port's own IPv4 GIDs: 2/3 in the classic table, wherever they sit in a full one.
  bool found = false;
  for (auto& e : d->gids) {
    const uint8_t* r = e.gid.raw;
    bool mapped = e.valid && e.ip_based && e.ndev == d->netdev && r[10] == 0xff && r[11] == 0xff;
    for (int b = 0; b < 10 && mapped; ++b) mapped = r[b] == 0;
    if (!mapped) continue;
    memcpy(e.gid.raw + 12, &addr_be, 4);
    found = true;
  }
  if (!found && d->big_gids == 0) {
    for (int i = 2; i < 4; ++i) {
      auto& e = d->gids[i];
      e = GidEntry{};
      e.gid.raw[10] = e.gid.raw[11] = 0xff;
      memcpy(e.gid.raw + 12, &addr_be, 4);
      e.type = i == 2 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
      e.valid = true;
      e.ip_based = true;
      e.ndev = d->netdev;
    }
  }
  if (d->box.pub.ibdev_path[0]) write_gid_sysfs(d);
  for (auto* c : d->contexts) push_event(c, IBV_EVENT_GID_CHANGE, nullptr, 1);
}

Mr* find_mr(uint32_t key) {
  auto it = g->mrs.find(key);
  return it == g->mrs.end() ? nullptr : it->second;
}

}  // namespace fv

using namespace fv;

// ---------------------------------------------------------------------------------------
// Exported verbs API (prototypes from <infiniband/verbs.h>).

namespace {
int fv_poll_cq(ibv_cq* cq, int n, ibv_wc* wc);
int fv_req_notify_cq(ibv_cq*, int) { return 0; }
}  // namespace
int fv_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);  // qp.cc
int fv_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad);  // qp.cc

FV_API ibv_device** ibv_get_device_list(int* num) {
  std::lock_guard<std::mutex> l(g->mu);
  if (int e = ensure_init_locked()) {
    errno = e;
    if (num) *num = 0;
    return nullptr;
  }
  auto** list = static_cast<ibv_device**>(calloc(g->devices.size() + 1, sizeof(ibv_device*)));
  if (!list) {
    errno = ENOMEM;
    return nullptr;
  }
  int n = 0;
  for (Device* d : g->devices)
    if (!d->removed) list[n++] = &d->box.pub;  // a device in reset is not registered
  if (num) *num = n;
  return list;
}

FV_API void ibv_free_device_list(ibv_device** list) { free(list); }

FV_API const char* ibv_get_device_name(ibv_device* dev) { return dev->name; }

FV_API __be64 ibv_get_device_guid(ibv_device* dev) {
  return htobe64(reinterpret_cast<DevBox*>(dev)->impl->guid);
}

FV_API ibv_context* ibv_open_device(ibv_device* dev) {
  std::lock_guard<std::mutex> l(g->mu);
  Device* d = reinterpret_cast<DevBox*>(dev)->impl;
  if (d->removed) {
    errno = ENODEV;
    return nullptr;
  }
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return nullptr;
  fcntl(p[1], F_SETFL, O_NONBLOCK);
  start_nic_locked();
  if (!g->nic_started) {
    close(p[0]);
    close(p[1]);
    errno = EIO;
    return nullptr;
  }
  auto* c = new Context();
  c->dev = d;
  c->async_wr = p[1];
  g->owned_fds.push_back(p[0]);
  g->owned_fds.push_back(p[1]);
  verbs_context& v = c->box.vctx;
  memset(&v, 0, sizeof v);  // sz = 0: verbs_get_ctx_op() finds no extended op
  c->box.impl = c;
  ibv_context& x = v.context;
  x.device = dev;
  x.cmd_fd = -1;
  x.async_fd = p[0];
  x.num_comp_vectors = 1;
  x.abi_compat = __VERBS_ABI_IS_EXTENDED;
  pthread_mutex_init(&x.mutex, nullptr);
  x.ops.poll_cq = fv_poll_cq;
  x.ops.req_notify_cq = fv_req_notify_cq;
  x.ops.post_send = fv_post_send;
  x.ops.post_recv = fv_post_recv;
  d->contexts.push_back(c);
  return &x;
}

FV_API int ibv_close_device(ibv_context* ctx) {
  std::lock_guard<std::mutex> l(g->mu);
  Context* c = ctx_of(ctx);
  auto& v = c->dev->contexts;
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] == c) v.erase(v.begin() + static_cast<long>(i)), --i;
  for (int fd : {ctx->async_fd, c->async_wr}) {
    close(fd);
    for (size_t i = 0; i < g->owned_fds.size(); ++i)
      if (g->owned_fds[i] == fd)
        g->owned_fds.erase(g->owned_fds.begin() + static_cast<long>(i)), --i;
  }
  delete c;
  return 0;
}

FV_API int ibv_query_device(ibv_context* ctx, ibv_device_attr* a) {
  std::lock_guard<std::mutex> l(g->mu);
  if (ctx_of(ctx)->dead) return EIO;
  Device* d = ctx_of(ctx)->dev;
  memset(a, 0, sizeof *a);
  snprintf(a->fw_ver, sizeof a->fw_ver, "fakeverbs-1.0");
  a->node_guid = htobe64(d->guid);
  a->sys_image_guid = htobe64(d->guid);
  a->max_mr_size = 1ull << 40;
  a->page_size_cap = 0xfffff000;
  a->vendor_id = 0xfa4e;  // not a real vendor: nothing should take a vendor-specific path
  a->vendor_part_id = 1;
  a->hw_ver = 1;
  a->max_qp = 1 << 16;
  a->max_qp_wr = kMaxWr;
  a->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_PORT_ACTIVE_EVENT;
  a->max_sge = kMaxSge;
  a->max_sge_rd = kMaxSge;
  a->max_cq = 1 << 16;
  a->max_cqe = kMaxCqe;
  a->max_mr = 1 << 20;
  a->max_pd = 1 << 16;
  a->max_qp_rd_atom = 16;
  a->max_qp_init_rd_atom = 16;
  a->max_res_rd_atom = 1 << 20;
  a->atomic_cap = IBV_ATOMIC_NONE;
  a->max_pkeys = static_cast<uint16_t>(d->pkeys.size());
  a->local_ca_ack_delay = 16;
  a->phys_port_cnt = 1;
  return 0;
}

FV_API int ibv_query_port(ibv_context* ctx, uint8_t port, _compat_ibv_port_attr* out) {
  std::lock_guard<std::mutex> l(g->mu);
  if (port != 1) return EINVAL;
  if (ctx_of(ctx)->dead) return EIO;
  Device* d = ctx_of(ctx)->dev;
  ibv_port_attr a{};
  a.state = d->active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  a.max_mtu = IBV_MTU_4096;
  a.active_mtu = static_cast<ibv_mtu>(d->active_mtu);
  a.gid_tbl_len = static_cast<int>(d->gids.size());
  a.port_cap_flags = d->eth ? 0 : IBV_PORT_SM;
  a.max_msg_sz = kMaxMsg;
  a.pkey_tbl_len = static_cast<uint16_t>(d->pkeys.size());
  a.flags = d->grh_required ? IBV_QPF_GRH_REQUIRED : 0;
  a.lid = d->eth ? 0 : d->lid;
  a.sm_lid = d->eth ? 0 : 1;
  a.max_vl_num = 4;
  a.active_width = d->active_width;
  a.active_speed = d->active_speed;
  a.phys_state = d->active ? 5 /* LinkUp */ : 3 /* Disabled */;
  a.link_layer = d->eth ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
  // The classic struct ends before port_cap_flags2.
  memcpy(out, &a, offsetof(ibv_port_attr, port_cap_flags2));
  return 0;
}

FV_API int ibv_query_gid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) {
  std::lock_guard<std::mutex> l(g->mu);
  const Device* d = ctx_of(ctx)->dev;
  if (port != 1 || index < 0 || index >= static_cast<int>(d->gids.size())) {
    errno = EINVAL;
    return -1;
  }
  if (ctx_of(ctx)->dead) {
    errno = EIO;
    return -1;
  }
  *gid = d->gids[index].gid;
  return 0;
}

// rdma-core's ibv_query_pkey(3): the P_Key at `index` in network byte order; 0, or -1 with
// errno (EINVAL: no such port or index).
FV_API int ibv_query_pkey(ibv_context* ctx, uint8_t port, int index, __be16* pkey) {
  std::lock_guard<std::mutex> l(g->mu);
  const Device* d = ctx_of(ctx)->dev;
  if (port != 1 || index < 0 || index >= static_cast<int>(d->pkeys.size()) || !pkey) {
    errno = EINVAL;
    return -1;
  }
  *pkey = htobe16(d->pkeys[index]);
  return 0;
}

FV_API int _ibv_query_gid_ex(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* e,
                             uint32_t flags, size_t entry_size) {
  std::lock_guard<std::mutex> l(g->mu);
  const Device* d = ctx_of(ctx)->dev;
  if (port != 1 || index >= d->gids.size() || flags != 0 || entry_size < sizeof(*e)) return EINVAL;
  const GidEntry& x = d->gids[index];
  if (ctx_of(ctx)->dead) return EIO;
  if (!x.valid) return ENODATA;
  memset(e, 0, sizeof *e);
  e->gid = x.gid;
  e->gid_index = index;
  e->port_num = port;
  e->gid_type = x.type;
  e->ndev_ifindex = 0;
  return 0;
}

FV_API ibv_pd* ibv_alloc_pd(ibv_context* ctx) {
  std::lock_guard<std::mutex> l(g->mu);
  if (ctx_of(ctx)->dead) {
    errno = EIO;
    return nullptr;
  }
  auto* p = new Pd();
  p->ctx = ctx_of(ctx);
  p->box.impl = p;
  p->box.pub.context = ctx;
  p->box.pub.handle = 0;
  return &p->box.pub;
}

FV_API int ibv_dealloc_pd(ibv_pd* pd) {
  std::lock_guard<std::mutex> l(g->mu);
  Pd* p = reinterpret_cast<PdBox*>(pd)->impl;
  if (p->users) return EBUSY;
  delete p;
  return 0;
}

FV_API ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t len, uint64_t iova,
                                unsigned int access) {
  std::lock_guard<std::mutex> l(g->mu);
  // Remote write (and atomics) need local write, as on real HCAs.
  if ((!addr && len) || len > (1ull << 40) ||
      ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
       !(access & IBV_ACCESS_LOCAL_WRITE))) {
    errno = EINVAL;
    return nullptr;
  }
  if (reinterpret_cast<PdBox*>(pd)->impl->ctx->dead) {
    errno = EIO;
    return nullptr;
  }
  auto* m = new Mr();
  m->pd = reinterpret_cast<PdBox*>(pd)->impl;
  m->addr = static_cast<char*>(addr);
  m->len = len;
  m->iova = iova;
  m->access = static_cast<int>(access);
  m->dontfork = g->fork_inited;
  do {  // xorshift64: random-looking, unique, bit 31 clear
    g->key_rng ^= g->key_rng << 13;
    g->key_rng ^= g->key_rng >> 7;
    g->key_rng ^= g->key_rng << 17;
    m->key = static_cast<uint32_t>(g->key_rng) & 0x7fffffffu;
  } while (m->key < 0x100 || g->mrs.count(m->key));
  g->mrs[m->key] = m;
  m->pd->users++;
  m->box.impl = m;
  ibv_mr& x = m->box.pub;
  x.context = pd->context;
  x.pd = pd;
  x.addr = addr;
  x.length = len;
  x.handle = m->key;
  x.lkey = m->key;
  x.rkey = m->key;
  return &x;
}

FV_API ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t len, int access) {
  return ibv_reg_mr_iova2(pd, addr, len, reinterpret_cast<uintptr_t>(addr),
                          static_cast<unsigned>(access));
}

FV_API ibv_mr* ibv_reg_dmabuf_mr(ibv_pd*, uint64_t, size_t, uint64_t, int fd, int) {
  std::lock_guard<std::mutex> l(g->mu);
  errno = g->dmabuf_probe && fd < 0 ? EBADF : EOPNOTSUPP;
  return nullptr;
}

FV_API int ibv_dereg_mr(ibv_mr* mr) {
  std::lock_guard<std::mutex> l(g->mu);
  Mr* m = reinterpret_cast<MrBox*>(mr)->impl;
  for (Device* d : g->devices) apply_fenced_locked(d, m);  // the writes did happen
  g->mrs.erase(m->key);
  m->pd->users--;
  delete m;
  return 0;
}

FV_API ibv_cq* ibv_create_cq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* ch,
                             int comp_vector) {
  std::lock_guard<std::mutex> l(g->mu);
  if (cqe <= 0 || cqe > kMaxCqe || comp_vector < 0 || comp_vector > 0) {
    errno = EINVAL;
    return nullptr;
  }
  if (ctx_of(ctx)->dead) {
    errno = EIO;
    return nullptr;
  }
  auto* c = new Cq();
  c->ctx = ctx_of(ctx);
  c->capacity = cqe;
  c->box.impl = c;
  ibv_cq& x = c->box.pub;
  x.context = ctx;
  x.channel = ch;  // accepted, but no completion events are ever delivered to it
  x.cq_context = cq_context;
  x.cqe = cqe;
  pthread_mutex_init(&x.mutex, nullptr);
  pthread_cond_init(&x.cond, nullptr);
  return &x;
}

FV_API int ibv_destroy_cq(ibv_cq* cq) {
  std::lock_guard<std::mutex> l(g->mu);
  Cq* c = reinterpret_cast<CqBox*>(cq)->impl;
  if (c->users) return EBUSY;
  delete c;
  return 0;
}

namespace {
int fv_poll_cq(ibv_cq* cq, int n, ibv_wc* wc) {
  std::lock_guard<std::mutex> l(g->mu);
  Cq* c = reinterpret_cast<CqBox*>(cq)->impl;
  int i = 0;
  for (; i < n && !c->wcs.empty(); ++i) {
    wc[i] = c->wcs.front();
    c->wcs.pop_front();
    const uint64_t slot_end = c->slot_ends.front();
    c->slot_ends.pop_front();
    if (slot_end == 0) continue;
    auto q = g->qps.find(wc[i].qp_num);
    if (q != g->qps.end()) q->second->sq_freed = std::max(q->second->sq_freed, slot_end);
  }
  return i;
}
}  // namespace

FV_API int ibv_get_async_event(ibv_context* ctx, ibv_async_event* ev) {
  char b;
  for (;;) {
    ssize_t r = read(ctx->async_fd, &b, 1);  // blocks unless the user made the fd O_NONBLOCK
    if (r == 1) break;
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) errno = EIO;
    return -1;
  }
  std::lock_guard<std::mutex> l(g->mu);
  Context* c = ctx_of(ctx);
  if (c->events.empty()) {
    errno = EAGAIN;
    return -1;
  }
  *ev = c->events.front();
  c->events.pop_front();
  return 0;
}

FV_API void ibv_ack_async_event(ibv_async_event*) {}

FV_API int ibv_fork_init(void) {
  std::lock_guard<std::mutex> l(g->mu);
  ensure_init_locked();
  g->fork_inited = true;
  return 0;
}

FV_API ibv_fork_status ibv_is_fork_initialized(void) {
  std::lock_guard<std::mutex> l(g->mu);
  ensure_init_locked();
  if (!g->fork_copies) return IBV_FORK_UNNEEDED;
  return g->fork_inited ? IBV_FORK_ENABLED : IBV_FORK_DISABLED;
}

FV_API const char* ibv_event_type_str(ibv_event_type t) {
  static const char* const s[] = {"CQ error",
                                  "local work queue catastrophic error",
                                  "invalid request local work queue error",
                                  "local access violation work queue error",
                                  "communication established",
                                  "send queue drained",
                                  "path migrated",
                                  "path migration request error",
                                  "local catastrophic error",
                                  "port active",
                                  "port error",
                                  "LID change",
                                  "P_Key change",
                                  "SM change",
                                  "SRQ catastrophic error",
                                  "SRQ limit reached",
                                  "last WQE reached",
                                  "client reregistration",
                                  "GID table change",
                                  "WQ fatal"};
  unsigned i = static_cast<unsigned>(t);
  return i < sizeof s / sizeof s[0] ? s[i] : "unknown";
}

FV_API const char* ibv_wc_status_str(ibv_wc_status st) {
  static const char* const s[] = {"success",
                                  "local length error",
                                  "local QP operation error",
                                  "local EE context operation error",
                                  "local protection error",
                                  "Work Request Flushed Error",
                                  "memory management operation error",
                                  "bad response error",
                                  "local access error",
                                  "remote invalid request error",
                                  "remote access error",
                                  "remote operation error",
                                  "transport retry counter exceeded",
                                  "RNR retry counter exceeded",
                                  "local RDD violation error",
                                  "remote invalid RD request",
                                  "operation aborted",
                                  "invalid EE context number",
                                  "invalid EE context state",
                                  "fatal error",
                                  "response timeout error",
                                  "general error",
                                  "TM error",
                                  "TM software rendezvous"};
  unsigned i = static_cast<unsigned>(st);
  return i < sizeof s / sizeof s[0] ? s[i] : "unknown";
}

// ---------------------------------------------------------------------------------------
// Control functions for tests.

// Applies fault entries now (or arms their triggers). Returns 0, or -1 with a message on
// stderr (nothing applied). Thread: any.
// RNR NAKs this process's devices sent as targets (tests linked with the fake).
FV_API unsigned long long fakeverbs_rnr_naks(void) {
  std::lock_guard<std::mutex> l(g->mu);
  unsigned long long total = 0;
  for (const Device* d : g->devices) total += d->rnr_naks;
  return total;
}

FV_API int fakeverbs_inject(const char* spec) {
  std::lock_guard<std::mutex> l(g->mu);
  if (ensure_init_locked()) {
    fprintf(stderr, "fakeverbs_inject: the fake verbs environment is invalid\n");
    return -1;
  }
  std::vector<Fault> faults;
  std::string err;
  if (!parse_faults_locked(spec ? spec : "", &faults, &err)) {
    fprintf(stderr, "%s (from fakeverbs_inject)\n", err.c_str());
    return -1;
  }
  for (const auto& f : faults) arm_or_fire_locked(f);
  apply_fatal_locked();            // outside any post or poll: at once
  if (g->nic_started) wake_nic();  // new timers
  return 0;
}

// 1 = the device's port is ACTIVE, 0 = DOWN, -1 = no such device. Thread: any.
FV_API int fakeverbs_port_state(const char* dev) {
  std::lock_guard<std::mutex> l(g->mu);
  if (ensure_init_locked() || !dev) return -1;
  Device* d = find_device(dev);
  return d ? (d->active ? 1 : 0) : -1;
}

FV_API void fakeverbs_freeifaddrs(struct ifaddrs* list);

// getifaddrs(3) for the fake's netdevs: one AF_INET entry per eth device, named as its
// gid_attrs/ndevs files say, with its current IPv4 address (set_ipv4 faults included) and
// prefix=, IFF_UP | IFF_RUNNING while its port is active. Real netdevs do not exist for the
// fake's devices, so a process using the fake asks here instead of the kernel. Free the list
// with fakeverbs_freeifaddrs. Returns 0, or -1 with errno (EINVAL: the environment is invalid,
// ENOMEM). Thread: any.
FV_API int fakeverbs_getifaddrs(struct ifaddrs** out) {
  std::lock_guard<std::mutex> l(g->mu);
  *out = nullptr;
  if (ensure_init_locked()) {
    errno = EINVAL;
    return -1;
  }
  struct Node {
    ifaddrs ifa;
    sockaddr_in addr, mask;
    char name[IFNAMSIZ];
  };
  ifaddrs* head = nullptr;
  for (auto it = g->devices.rbegin(); it != g->devices.rend(); ++it) {
    const Device* d = *it;
    if (!d->eth) continue;
    auto* n = static_cast<Node*>(calloc(1, sizeof(Node)));
    if (!n) {
      fakeverbs_freeifaddrs(head);
      errno = ENOMEM;
      return -1;
    }
    snprintf(n->name, sizeof n->name, "%s", d->netdev.c_str());
    n->addr.sin_family = n->mask.sin_family = AF_INET;
    n->addr.sin_addr.s_addr = d->ipv4;
    n->mask.sin_addr.s_addr = d->prefix == 0 ? 0 : htonl(~0u << (32 - d->prefix));
    n->ifa.ifa_name = n->name;
    n->ifa.ifa_flags = IFF_UP | (d->active ? IFF_RUNNING : 0);
    n->ifa.ifa_addr = reinterpret_cast<sockaddr*>(&n->addr);
    n->ifa.ifa_netmask = reinterpret_cast<sockaddr*>(&n->mask);
    n->ifa.ifa_next = head;
    head = &n->ifa;
  }
  *out = head;
  return 0;
}

FV_API void fakeverbs_freeifaddrs(struct ifaddrs* list) {
  while (list) {
    ifaddrs* next = list->ifa_next;
    free(list);  // the Node starts with its ifaddrs
    list = next;
  }
}
