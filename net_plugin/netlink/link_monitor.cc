// Netlink link monitor over a dlopen'ed libnl-3 / libnl-route-3 (see link_monitor.h).
//
// The libnl API is used as documented (cache-free notification path): nl_socket_alloc,
// nl_connect(NETLINK_ROUTE), nl_socket_add_membership(RTNLGRP_LINK), nl_socket_disable_seq_check,
// nl_socket_modify_cb(NL_CB_VALID) -> nl_msg_parse -> rtnl_link_get_*, nl_socket_set_nonblocking,
// nl_recvmsgs_default. libnl is never linked and its headers are not needed: the opaque structs,
// the function signatures and the few enum values are declared below. Building with
// -DR2CCL_LINK_MONITOR_CHECK_LIBNL_ABI -I/usr/include/libnl3 (libnl-3-dev, libnl-route-3-dev)
// checks every declaration against libnl's own headers at compile time.
// Netlink, rtnetlink and interface-flag constants come from the kernel UAPI headers.

#include "link_monitor.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <linux/if.h>       // IFF_UP, IFF_RUNNING, IFF_LOWER_UP (no <net/if.h>: they clash)
#include <linux/if_addr.h>  // struct ifaddrmsg
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>

#include "r2ccl/log.h"

// libnl's opaque types (global namespace, as libnl declares them). struct nl_sock is declared in
// link_monitor.h.
struct nl_msg;
struct nl_object;
struct rtnl_link;

#if defined(R2CCL_LINK_MONITOR_CHECK_LIBNL_ABI)
#include <netlink/errno.h>
#include <netlink/handlers.h>
#include <netlink/msg.h>
#include <netlink/netlink.h>
#include <netlink/object.h>
#include <netlink/route/link.h>
#include <netlink/socket.h>

#include <type_traits>
#endif

namespace r2ccl::net {
namespace detail {

// Values from libnl's <netlink/handlers.h> and <netlink/errno.h> (stable ABI since libnl 3.0).
constexpr int kNlCbValid = 0;   // enum nl_cb_type NL_CB_VALID
constexpr int kNlCbCustom = 3;  // enum nl_cb_kind NL_CB_CUSTOM
constexpr int kNlOk = 0;        // enum nl_cb_action NL_OK
constexpr int kNleIntr = 2;     // NLE_INTR
constexpr int kNleAgain = 4;    // NLE_AGAIN
constexpr int kNleNomem = 5;    // NLE_NOMEM (also what recvmsg's ENOBUFS, lost messages, maps to)

using NlMsgCb = int (*)(nl_msg*, void*);
using NlParseCb = void (*)(nl_object*, void*);

// The libnl functions used. The enum parameters of nl_socket_modify_cb are passed as int (same
// size and register class as libnl's unsigned enums on every Linux ABI).
struct NlApi {
  nl_sock* (*nl_socket_alloc)(void);
  void (*nl_socket_free)(nl_sock*);
  int (*nl_connect)(nl_sock*, int);
  int (*nl_socket_add_membership)(nl_sock*, int);
  void (*nl_socket_disable_seq_check)(nl_sock*);
  int (*nl_socket_modify_cb)(nl_sock*, int, int, NlMsgCb, void*);
  int (*nl_socket_set_nonblocking)(const nl_sock*);
  int (*nl_socket_get_fd)(const nl_sock*);
  int (*nl_socket_set_buffer_size)(nl_sock*, int, int);
  int (*nl_recvmsgs_default)(nl_sock*);
  int (*nl_msg_parse)(nl_msg*, NlParseCb, void*);
  nlmsghdr* (*nlmsg_hdr)(nl_msg*);
  const char* (*nl_geterror)(int);
  const char* (*nl_object_get_type)(const nl_object*);
  // libnl-route-3
  int (*rtnl_link_get_ifindex)(rtnl_link*);
  char* (*rtnl_link_get_name)(rtnl_link*);
  unsigned int (*rtnl_link_get_flags)(rtnl_link*);
  int (*rtnl_link_get_family)(rtnl_link*);
};

#if defined(R2CCL_LINK_MONITOR_CHECK_LIBNL_ABI)
#define R2CCL_CHECK_FN(name) \
  static_assert(std::is_same_v<decltype(NlApi::name), decltype(&::name)>, #name)
R2CCL_CHECK_FN(nl_socket_alloc);
R2CCL_CHECK_FN(nl_socket_free);
R2CCL_CHECK_FN(nl_connect);
R2CCL_CHECK_FN(nl_socket_add_membership);
R2CCL_CHECK_FN(nl_socket_disable_seq_check);
R2CCL_CHECK_FN(nl_socket_set_nonblocking);
R2CCL_CHECK_FN(nl_socket_get_fd);
R2CCL_CHECK_FN(nl_socket_set_buffer_size);
R2CCL_CHECK_FN(nl_recvmsgs_default);
R2CCL_CHECK_FN(nl_msg_parse);
R2CCL_CHECK_FN(nlmsg_hdr);
R2CCL_CHECK_FN(nl_geterror);
R2CCL_CHECK_FN(nl_object_get_type);
R2CCL_CHECK_FN(rtnl_link_get_ifindex);
R2CCL_CHECK_FN(rtnl_link_get_name);
R2CCL_CHECK_FN(rtnl_link_get_flags);
R2CCL_CHECK_FN(rtnl_link_get_family);
#undef R2CCL_CHECK_FN
static_assert(std::is_same_v<NlMsgCb, nl_recvmsg_msg_cb_t>);
static_assert(std::is_same_v<decltype(&::nl_socket_modify_cb),
                             int (*)(nl_sock*, nl_cb_type, nl_cb_kind, NlMsgCb, void*)>);
static_assert(sizeof(nl_cb_type) == sizeof(int) && sizeof(nl_cb_kind) == sizeof(int));
static_assert(kNlCbValid == NL_CB_VALID && kNlCbCustom == NL_CB_CUSTOM && kNlOk == NL_OK);
static_assert(kNleIntr == NLE_INTR && kNleAgain == NLE_AGAIN && kNleNomem == NLE_NOMEM);
#endif

}  // namespace detail

namespace {

using detail::NlApi;

constexpr const char* kDefaultNlLib = "libnl-3.so.200";
constexpr const char* kDefaultNlRouteLib = "libnl-route-3.so.200";

// Process-wide load state. Allocated once and never freed, so it outlives every static
// destructor (a monitor may be closed late in process exit).
struct LoadState {
  std::mutex mu;
  std::string nl_name = kDefaultNlLib;          // guarded by mu
  std::string route_name = kDefaultNlRouteLib;  // guarded by mu
  bool attempted = false;                       // guarded by mu
  NlApi* api = nullptr;                         // guarded by mu; immutable once published
  std::string why;                              // guarded by mu; why api is null
  void* h_nl = nullptr;                         // guarded by mu
  void* h_route = nullptr;                      // guarded by mu
};

LoadState& load_state() {
  static LoadState* s = new LoadState;
  return *s;
}

std::atomic<bool> g_disabled_warned{false};

template <typename Fn>
bool bind_sym(void* handle, const char* lib, const char* name, Fn* out, std::string* why) {
  dlerror();
  void* p = dlsym(handle, name);
  if (!p) {
    *why = std::string("symbol ") + name + " missing from " + lib;
    return false;
  }
  *out = reinterpret_cast<Fn>(p);
  return true;
}

void* open_lib(const std::string& name, std::string* why) {
  dlerror();
  void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    *why = name + " not found or not loadable (" + (e ? e : "dlopen failed") + ")";
  }
  return h;
}

// Returns the table, or null with the reason in *why. Caller holds s.mu.
const NlApi* load_locked(LoadState& s, std::string* why) {
  if (s.attempted) {
    *why = s.why;
    return s.api;
  }
  s.attempted = true;
  std::string err;
  auto* api = new (std::nothrow) NlApi{};
  bool ok = api != nullptr;
  if (!ok) err = "out of memory";
  if (ok) {
    s.h_nl = open_lib(s.nl_name, &err);
    ok = s.h_nl != nullptr;
  }
  if (ok) {
    s.h_route = open_lib(s.route_name, &err);
    ok = s.h_route != nullptr;
  }
  const char* nl = s.nl_name.c_str();
  const char* rt = s.route_name.c_str();
#define R2CCL_BIND(handle, lib, name) ok = ok && bind_sym(handle, lib, #name, &api->name, &err)
  R2CCL_BIND(s.h_nl, nl, nl_socket_alloc);
  R2CCL_BIND(s.h_nl, nl, nl_socket_free);
  R2CCL_BIND(s.h_nl, nl, nl_connect);
  R2CCL_BIND(s.h_nl, nl, nl_socket_add_membership);
  R2CCL_BIND(s.h_nl, nl, nl_socket_disable_seq_check);
  R2CCL_BIND(s.h_nl, nl, nl_socket_modify_cb);
  R2CCL_BIND(s.h_nl, nl, nl_socket_set_nonblocking);
  R2CCL_BIND(s.h_nl, nl, nl_socket_get_fd);
  R2CCL_BIND(s.h_nl, nl, nl_socket_set_buffer_size);
  R2CCL_BIND(s.h_nl, nl, nl_recvmsgs_default);
  R2CCL_BIND(s.h_nl, nl, nl_msg_parse);
  R2CCL_BIND(s.h_nl, nl, nlmsg_hdr);
  R2CCL_BIND(s.h_nl, nl, nl_geterror);
  R2CCL_BIND(s.h_nl, nl, nl_object_get_type);
  R2CCL_BIND(s.h_route, rt, rtnl_link_get_ifindex);
  R2CCL_BIND(s.h_route, rt, rtnl_link_get_name);
  R2CCL_BIND(s.h_route, rt, rtnl_link_get_flags);
  R2CCL_BIND(s.h_route, rt, rtnl_link_get_family);
#undef R2CCL_BIND
  if (!ok) {
    delete api;
    if (s.h_route) dlclose(s.h_route);
    if (s.h_nl) dlclose(s.h_nl);
    s.h_route = s.h_nl = nullptr;
    s.why = err;
    *why = err;
    return nullptr;
  }
  s.api = api;
  s.why.clear();
  why->clear();
  R2CCL_INFO(NCCL_INIT | NCCL_NET, "link monitor: loaded %s and %s", nl, rt);
  return api;
}

const NlApi* load_api(std::string* why) {
  LoadState& s = load_state();
  std::lock_guard<std::mutex> lk(s.mu);
  return load_locked(s, why);
}

// One WARN per process; later failures are INFO.
void report_disabled(const std::string& why) {
  if (!g_disabled_warned.exchange(true)) {
    R2CCL_WARN(
        "link notifications disabled: %s; link failures will be detected by socket errors, "
        "heartbeats and the acknowledgement watchdog instead",
        why.c_str());
  } else {
    R2CCL_INFO(NCCL_NET, "link monitor unavailable: %s", why.c_str());
  }
}

// Reads a small sysfs file; trailing newline stripped. False if it cannot be read.
bool read_sysfs(const std::string& path, std::string* out) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[128];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf) - 1);
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n < 0) return false;  // e.g. "carrier" of a down interface: EINVAL
  out->assign(buf, static_cast<size_t>(n));
  while (!out->empty() && (out->back() == '\n' || out->back() == ' ')) out->pop_back();
  return true;
}

bool parse_long(const std::string& s, int base, long* v) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long x = strtol(s.c_str(), &end, base);
  if (errno != 0 || end == s.c_str() || *end != '\0') return false;
  *v = x;
  return true;
}

bool valid_ifname(const std::string& n) {
  return !n.empty() && n.size() < IFNAMSIZ && n != "." && n != ".." &&
         n.find('/') == std::string::npos;
}

bool flags_up(unsigned int flags) {
  return (flags & IFF_UP) != 0 && (flags & (IFF_LOWER_UP | IFF_RUNNING)) != 0;
}

}  // namespace

bool link_is_up(const std::string& ifname) {
  if (!valid_ifname(ifname)) return false;
  const std::string dir = "/sys/class/net/" + ifname + "/";
  std::string v;
  long flags = 0;
  if (!read_sysfs(dir + "flags", &v) || !parse_long(v, 16, &flags)) return false;
  if ((flags & IFF_UP) == 0) return false;
  if (!read_sysfs(dir + "operstate", &v)) return false;
  if (v == "up") return true;
  if (v != "unknown") return false;  // down, lowerlayerdown, dormant, testing, notpresent
  // Devices without operstate reporting (lo, dummy, tun): trust the carrier bit.
  long carrier = 0;
  return read_sysfs(dir + "carrier", &v) && parse_long(v, 10, &carrier) && carrier == 1;
}

// Static trampolines that libnl calls; nested in LinkMonitor so they may touch its members.
struct LinkMonitor::Callbacks {
  struct ParseCtx {
    LinkMonitor* mon;
    bool removed;
  };

  static int on_valid(nl_msg* msg, void* arg) {
    auto* mon = static_cast<LinkMonitor*>(arg);
    if (!mon->sink_) return detail::kNlOk;  // not inside drain(): nothing to deliver to
    const nlmsghdr* hdr = mon->api_->nlmsg_hdr(msg);
    if (hdr && (hdr->nlmsg_type == RTM_NEWADDR || hdr->nlmsg_type == RTM_DELADDR)) {
      // Only which interface: the consumer re-reads its addresses (and their flags).
      if (hdr->nlmsg_len < NLMSG_LENGTH(sizeof(ifaddrmsg))) {
        mon->need_resync_ = true;
        return detail::kNlOk;
      }
      const auto* ifa = static_cast<const ifaddrmsg*>(NLMSG_DATA(hdr));
      try {
        Event ev;
        ev.ifindex = static_cast<int>(ifa->ifa_index);
        ev.address = true;
        ev.when = now_us();
        R2CCL_TRACE("link monitor: ifindex %d address %s", ev.ifindex,
                    hdr->nlmsg_type == RTM_NEWADDR ? "added or changed" : "removed");
        mon->sink_->push_back(ev);
      } catch (...) {
        mon->need_resync_ = true;
      }
      return detail::kNlOk;
    }
    if (!hdr || (hdr->nlmsg_type != RTM_NEWLINK && hdr->nlmsg_type != RTM_DELLINK))
      return detail::kNlOk;
    ParseCtx ctx{mon, hdr->nlmsg_type == RTM_DELLINK};
    int err = mon->api_->nl_msg_parse(msg, &on_object, &ctx);
    if (err < 0) {
      // The state of some link is now unknown: re-read everything after this drain.
      R2CCL_INFO(NCCL_NET, "link monitor: cannot parse a link notification: %s",
                 mon->api_->nl_geterror(err));
      mon->need_resync_ = true;
    }
    return detail::kNlOk;
  }

  static void on_object(nl_object* obj, void* arg) {
    auto* ctx = static_cast<ParseCtx*>(arg);
    LinkMonitor* mon = ctx->mon;
    const NlApi* api = mon->api_;
    const char* type = api->nl_object_get_type(obj);
    if (!type || strcmp(type, "route/link") != 0) return;
    auto* link = reinterpret_cast<rtnl_link*>(obj);
    // AF_BRIDGE (and other family-specific) notifications describe bridge-port membership;
    // a bridge-family RTM_DELLINK only means the port left the bridge.
    if (api->rtnl_link_get_family(link) != AF_UNSPEC) return;
    Event ev;
    ev.ifindex = api->rtnl_link_get_ifindex(link);
    ev.removed = ctx->removed;
    ev.up = !ev.removed && flags_up(api->rtnl_link_get_flags(link));
    ev.when = now_us();
    // No exception may cross libnl's C frames.
    try {
      if (const char* name = api->rtnl_link_get_name(link)) ev.ifname = name;
      R2CCL_TRACE("link monitor: %s ifindex %d %s", ev.ifname.c_str(), ev.ifindex,
                  ev.removed ? "removed"
                  : ev.up    ? "up"
                             : "down");
      mon->sink_->push_back(std::move(ev));
    } catch (...) {
      mon->need_resync_ = true;
    }
  }
};

LinkMonitor::~LinkMonitor() { close(); }

bool LinkMonitor::library_available(std::string* why) {
  std::string err;
  bool ok = load_api(&err) != nullptr;
  if (why) *why = ok ? std::string() : err;
  return ok;
}

void LinkMonitor::set_library_names_for_testing(const std::string& nl,
                                                const std::string& nl_route) {
  LoadState& s = load_state();
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.h_route) dlclose(s.h_route);
  if (s.h_nl) dlclose(s.h_nl);
  delete s.api;
  s.api = nullptr;
  s.h_route = s.h_nl = nullptr;
  s.attempted = false;
  s.why.clear();
  s.nl_name = nl.empty() ? kDefaultNlLib : nl;
  s.route_name = nl_route.empty() ? kDefaultNlRouteLib : nl_route;
  g_disabled_warned.store(false);
}

bool LinkMonitor::open(int rcvbuf_bytes) {
  if (sock_) return true;
  std::string why;
  const NlApi* api = load_api(&why);
  if (!api) {
    report_disabled(why);
    return false;
  }
  nl_sock* sk = api->nl_socket_alloc();
  if (!sk) {
    report_disabled("nl_socket_alloc failed (out of memory)");
    return false;
  }
  // Notifications carry sequence number 0: no sequence checking. Set before connecting so no
  // message can arrive with the default handlers.
  api->nl_socket_disable_seq_check(sk);
  int err = api->nl_socket_modify_cb(sk, detail::kNlCbValid, detail::kNlCbCustom,
                                     &Callbacks::on_valid, this);
  const char* step = "nl_socket_modify_cb";
  if (err >= 0) {
    step = "nl_connect(NETLINK_ROUTE)";
    err = api->nl_connect(sk, NETLINK_ROUTE);
  }
  if (err >= 0) {
    step = "nl_socket_add_membership(RTNLGRP_LINK)";
    err = api->nl_socket_add_membership(sk, RTNLGRP_LINK);
  }
  if (err >= 0) {
    step = "nl_socket_add_membership(RTNLGRP_IPV4_IFADDR)";
    err = api->nl_socket_add_membership(sk, RTNLGRP_IPV4_IFADDR);
  }
  if (err >= 0 && api->nl_socket_add_membership(sk, RTNLGRP_IPV6_IFADDR) < 0)
    R2CCL_INFO(NCCL_INIT | NCCL_NET, "link monitor: no IPv6 address notifications (no IPv6?)");
  if (err >= 0) {
    step = "nl_socket_set_nonblocking";
    err = api->nl_socket_set_nonblocking(sk);
  }
  int fd = err >= 0 ? api->nl_socket_get_fd(sk) : -1;
  if (err < 0 || fd < 0) {
    std::string msg = err < 0 ? std::string(step) + " failed: " + api->nl_geterror(err)
                              : std::string("nl_socket_get_fd returned no descriptor");
    api->nl_socket_free(sk);
    report_disabled(msg);
    return false;
  }
  // Recent libnl already opens with SOCK_CLOEXEC; make sure for older ones.
  int fdflags = fcntl(fd, F_GETFD);
  if (fdflags >= 0) (void)fcntl(fd, F_SETFD, fdflags | FD_CLOEXEC);
  // A bigger buffer survives a burst of notifications (many links flapping at once). Not fatal:
  // an overflow is detected and resynced.
  int berr = api->nl_socket_set_buffer_size(sk, rcvbuf_bytes, 0);
  if (berr < 0) {
    R2CCL_INFO(NCCL_NET, "link monitor: cannot set receive buffer to %d bytes: %s", rcvbuf_bytes,
               api->nl_geterror(berr));
  }
  sock_ = sk;
  fd_ = fd;
  api_ = api;
  resyncs_ = 0;
  need_resync_ = false;
  R2CCL_INFO(NCCL_INIT | NCCL_NET,
             "link monitor: netlink fd %d subscribed to link and address notifications", fd);
  return true;
}

void LinkMonitor::close() {
  if (!sock_) return;
  api_->nl_socket_free(sock_);  // closes the fd
  sock_ = nullptr;
  fd_ = -1;
  api_ = nullptr;
  sink_ = nullptr;
}

void LinkMonitor::drain(std::vector<Event>* out) {
  if (!sock_ || !out) return;
  sink_ = out;
  need_resync_ = false;
  for (int i = 0; i < kMaxReadsPerDrain; ++i) {
    // libnl returns 0 both for "nothing to read" and for a processed datagram, so poll first.
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    int err = api_->nl_recvmsgs_default(sock_);
    if (err >= 0 || err == -detail::kNleAgain || err == -detail::kNleIntr) continue;
    // -NLE_NOMEM is recvmsg's ENOBUFS: the kernel dropped notifications. Anything else is as bad
    // for what we know about the links.
    R2CCL_INFO(NCCL_NET, "link monitor: netlink receive failed (%s); rereading all links",
               api_->nl_geterror(err));
    need_resync_ = true;
    if (err != -detail::kNleNomem) break;  // do not spin on a persistent error
  }
  sink_ = nullptr;
  if (!need_resync_) return;
  need_resync_ = false;
  ++resyncs_;
  DIR* d = opendir("/sys/class/net");
  if (!d) {
    R2CCL_WARN("link monitor: notifications were lost and /sys/class/net is unreadable (%s)",
               strerror(errno));
    return;
  }
  const TimeUs t = now_us();
  size_t n = 0;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (!valid_ifname(name)) continue;
    std::string v;
    long ifindex = 0;
    if (!read_sysfs("/sys/class/net/" + name + "/ifindex", &v) || !parse_long(v, 10, &ifindex))
      continue;
    Event ev;
    ev.ifindex = static_cast<int>(ifindex);
    ev.ifname = std::move(name);
    ev.up = link_is_up(ev.ifname);
    ev.when = t;
    Event addr;
    addr.ifindex = ev.ifindex;
    addr.address = true;
    addr.when = t;
    out->push_back(std::move(ev));
    out->push_back(addr);
    ++n;
  }
  closedir(d);
  R2CCL_INFO(NCCL_NET, "link monitor: resynced %zu links from /sys/class/net", n);
}

}  // namespace r2ccl::net
