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

void fill_gids(Device* d) {
  for (auto& e : d->gids) e = GidEntry{};
  if (!d->eth) {
    auto& e = d->gids[0];
    e.gid.raw[0] = 0xfe;
    e.gid.raw[1] = 0x80;
    uint64_t be = htobe64(d->guid);
    memcpy(e.gid.raw + 8, &be, 8);
    e.type = IBV_GID_TYPE_IB;
    e.valid = true;
    return;
  }
  // Link-local GIDs: the EUI-64 interface id of the port's MAC (U/L bit flipped).
  uint64_t iid = htobe64(d->guid ^ (2ull << 56));
  for (int i = 0; i < 2; ++i) {
    auto& e = d->gids[i];
    e.gid.raw[0] = 0xfe;
    e.gid.raw[1] = 0x80;
    memcpy(e.gid.raw + 8, &iid, 8);
    e.type = i == 0 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
    e.valid = true;
  }
  set_ipv4_locked(d, d->ipv4);
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
}

void write_gid_sysfs(Device* d) {
  std::string ports = std::string(d->box.pub.ibdev_path) + "/ports/1";
  if (!mkdir_p(ports + "/gids") || !mkdir_p(ports + "/gid_attrs/types") ||
      !mkdir_p(ports + "/gid_attrs/ndevs"))
    return;
  for (int i = 0; i < kGidTableLen; ++i) {
    char buf[64];
    const uint8_t* r = d->gids[i].gid.raw;
    snprintf(buf, sizeof buf,
             "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x\n", r[0],
             r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], r[13],
             r[14], r[15]);
    write_file(ports + "/gids/" + std::to_string(i), buf);
    std::string type = !d->gids[i].valid                         ? ""
                       : d->gids[i].type == IBV_GID_TYPE_ROCE_V2 ? "RoCE v2\n"
                                                                 : "IB/RoCE v1\n";
    write_file(ports + "/gid_attrs/types/" + std::to_string(i), type);
    // The netdev a RoCE GID belongs to, as the kernel names it (IB and unused entries: none;
    // the kernel's read fails there, this file is empty).
    write_file(ports + "/gid_attrs/ndevs/" + std::to_string(i),
               d->eth && d->gids[i].valid ? d->ndev + "\n" : "");
  }
}

// One device entry `name,linklayer,addr[,key=value...]`.
bool parse_device(const std::string& entry, Device* d, std::string* err) {
  auto f = split(entry, ',');
  const char* form =
      "name,ib,<lid>|name,eth,<ipv4>[,prefix=<0..32>][,speed=<Mbps>][,pci=<path>][,numa=<node>]"
      "[,state=down][,guid=<hex>]";
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
    } else {
      return fail("unknown option '" + k + "'");
    }
  }
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
  if (d->eth) d->ndev = "fv_" + d->name;
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

void push_cqe(Cq* cq, const ibv_wc& wc, uint64_t sq_slot_end) {
  if (static_cast<int>(cq->wcs.size()) >= cq->capacity) {
    push_event(cq->ctx, IBV_EVENT_CQ_ERR, cq, 0);
    return;
  }
  cq->wcs.push_back(wc);
  cq->slot_ends.push_back(sq_slot_end);
}

void set_port_locked(Device* d, bool up) {
  if (d->active == up) return;
  d->active = up;
  for (auto* c : d->contexts)
    push_event(c, up ? IBV_EVENT_PORT_ACTIVE : IBV_EVENT_PORT_ERR, nullptr, 1);
}

void set_ipv4_locked(Device* d, uint32_t addr_be) {
  d->ipv4 = addr_be;
  if (!d->eth) return;
  for (int i = 2; i < 4; ++i) {
    auto& e = d->gids[i];
    memset(&e.gid, 0, sizeof e.gid);
    e.gid.raw[10] = e.gid.raw[11] = 0xff;
    memcpy(e.gid.raw + 12, &addr_be, 4);
    e.type = i == 2 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
    e.valid = true;
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
  for (size_t i = 0; i < g->devices.size(); ++i) list[i] = &g->devices[i]->box.pub;
  if (num) *num = static_cast<int>(g->devices.size());
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
  a->max_pkeys = 1;
  a->local_ca_ack_delay = 16;
  a->phys_port_cnt = 1;
  return 0;
}

FV_API int ibv_query_port(ibv_context* ctx, uint8_t port, _compat_ibv_port_attr* out) {
  std::lock_guard<std::mutex> l(g->mu);
  if (port != 1) return EINVAL;
  Device* d = ctx_of(ctx)->dev;
  ibv_port_attr a{};
  a.state = d->active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  a.max_mtu = IBV_MTU_4096;
  a.active_mtu = IBV_MTU_4096;
  a.gid_tbl_len = kGidTableLen;
  a.port_cap_flags = d->eth ? 0 : IBV_PORT_SM;
  a.max_msg_sz = kMaxMsg;
  a.pkey_tbl_len = 1;
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
  if (port != 1 || index < 0 || index >= kGidTableLen) {
    errno = EINVAL;
    return -1;
  }
  *gid = ctx_of(ctx)->dev->gids[index].gid;
  return 0;
}

FV_API int _ibv_query_gid_ex(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* e,
                             uint32_t flags, size_t entry_size) {
  std::lock_guard<std::mutex> l(g->mu);
  if (port != 1 || index >= kGidTableLen || flags != 0 || entry_size < sizeof(*e)) return EINVAL;
  const GidEntry& x = ctx_of(ctx)->dev->gids[index];
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

FV_API ibv_mr* ibv_reg_dmabuf_mr(ibv_pd*, uint64_t, size_t, uint64_t, int, int) {
  errno = EOPNOTSUPP;
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
    snprintf(n->name, sizeof n->name, "%s", d->ndev.c_str());
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
