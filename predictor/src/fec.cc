// FEC statistics over ethtool netlink through a dlopen'ed libnl-3 / libnl-genl-3 (see fec.h).
//
// libnl's documented generic netlink path: nl_socket_alloc, genl_connect, genl_ctrl_resolve,
// nl_socket_disable_auto_ack, nlmsg_alloc + genlmsg_put + nla_nest_start/nla_put_*/nla_nest_end,
// nl_send_auto, nl_recvmsgs_default with a NL_CB_VALID callback (genlmsg_parse,
// nla_parse_nested) and an error callback that keeps the kernel's errno. libnl is never linked
// and its headers are not needed: its opaque structs and the function signatures are declared
// below. Building with -DR2CCL_FEC_CHECK_LIBNL_ABI -I/usr/include/libnl3 (libnl-3-dev,
// libnl-genl-3-dev) checks each declaration against libnl's own headers.
// Netlink, generic netlink and ethtool constants come from the kernel UAPI headers.

#include "r2ccl/predict/fec.h"

#include <dlfcn.h>
#include <linux/ethtool_netlink.h>
#include <linux/genetlink.h>
#include <linux/netlink.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <type_traits>

struct nl_sock;
struct nl_msg;
struct nla_policy;

#if defined(R2CCL_FEC_CHECK_LIBNL_ABI)
#include <netlink/attr.h>
#include <netlink/errno.h>
#include <netlink/genl/ctrl.h>
#include <netlink/genl/genl.h>
#include <netlink/handlers.h>
#include <netlink/msg.h>
#include <netlink/netlink.h>
#include <netlink/socket.h>

#include <type_traits>
#endif

namespace r2ccl::predict {
namespace {

// Values from libnl's <netlink/handlers.h> (stable ABI since libnl 3.0).
constexpr int kNlCbValid = 0;   // enum nl_cb_type NL_CB_VALID
constexpr int kNlCbCustom = 3;  // enum nl_cb_kind NL_CB_CUSTOM
constexpr int kNlOk = 0;        // enum nl_cb_action NL_OK
constexpr int kNlSkip = 1;      // NL_SKIP
constexpr int kNlStop = 2;      // NL_STOP

using NlMsgCb = int (*)(nl_msg*, void*);
using NlErrCb = int (*)(sockaddr_nl*, nlmsgerr*, void*);

// The libnl functions used. Enum parameters are passed as int (same size and register class as
// libnl's unsigned enums on every Linux ABI).
struct Api {
  nl_sock* (*nl_socket_alloc)(void);
  void (*nl_socket_free)(nl_sock*);
  void (*nl_socket_disable_auto_ack)(nl_sock*);
  int (*nl_socket_get_fd)(const nl_sock*);
  int (*nl_socket_modify_cb)(nl_sock*, int, int, NlMsgCb, void*);
  int (*nl_socket_modify_err_cb)(nl_sock*, int, NlErrCb, void*);
  int (*nl_send_auto)(nl_sock*, nl_msg*);
  int (*nl_recvmsgs_default)(nl_sock*);
  const char* (*nl_geterror)(int);
  nl_msg* (*nlmsg_alloc)(void);
  void (*nlmsg_free)(nl_msg*);
  nlmsghdr* (*nlmsg_hdr)(nl_msg*);
  nlattr* (*nla_nest_start)(nl_msg*, int);
  int (*nla_nest_end)(nl_msg*, nlattr*);
  int (*nla_put_string)(nl_msg*, int, const char*);
  int (*nla_put_u32)(nl_msg*, int, uint32_t);
  int (*nla_parse_nested)(nlattr**, int, nlattr*, const nla_policy*);
  void* (*nla_data)(const nlattr*);
  int (*nla_len)(const nlattr*);
  // libnl-genl-3
  int (*genl_connect)(nl_sock*);
  int (*genl_ctrl_resolve)(nl_sock*, const char*);
  void* (*genlmsg_put)(nl_msg*, uint32_t, uint32_t, int, int, int, uint8_t, uint8_t);
  int (*genlmsg_parse)(nlmsghdr*, int, nlattr**, int, const nla_policy*);
};

// The two callback setters take libnl's enums; the table passes them as int (checked against
// libnl's own declarations below, with the enums' size).
static_assert(std::is_same_v<decltype(Api::nl_socket_modify_cb),
                             int (*)(nl_sock*, int, int, NlMsgCb, void*)>);
static_assert(
    std::is_same_v<decltype(Api::nl_socket_modify_err_cb), int (*)(nl_sock*, int, NlErrCb, void*)>);

#if defined(R2CCL_FEC_CHECK_LIBNL_ABI)
#define R2CCL_CHECK_FN(name) \
  static_assert(std::is_same_v<decltype(Api::name), decltype(&::name)>, #name)
R2CCL_CHECK_FN(nl_socket_alloc);
R2CCL_CHECK_FN(nl_socket_free);
R2CCL_CHECK_FN(nl_socket_disable_auto_ack);
R2CCL_CHECK_FN(nl_socket_get_fd);
R2CCL_CHECK_FN(nl_send_auto);
R2CCL_CHECK_FN(nl_recvmsgs_default);
R2CCL_CHECK_FN(nl_geterror);
R2CCL_CHECK_FN(nlmsg_alloc);
R2CCL_CHECK_FN(nlmsg_free);
R2CCL_CHECK_FN(nlmsg_hdr);
R2CCL_CHECK_FN(nla_nest_start);
R2CCL_CHECK_FN(nla_nest_end);
R2CCL_CHECK_FN(nla_put_string);
R2CCL_CHECK_FN(nla_put_u32);
R2CCL_CHECK_FN(nla_parse_nested);
R2CCL_CHECK_FN(nla_data);
R2CCL_CHECK_FN(nla_len);
R2CCL_CHECK_FN(genl_connect);
R2CCL_CHECK_FN(genl_ctrl_resolve);
R2CCL_CHECK_FN(genlmsg_put);
R2CCL_CHECK_FN(genlmsg_parse);
#undef R2CCL_CHECK_FN
static_assert(std::is_same_v<NlMsgCb, nl_recvmsg_msg_cb_t>);
static_assert(std::is_same_v<NlErrCb, nl_recvmsg_err_cb_t>);
static_assert(std::is_same_v<decltype(&::nl_socket_modify_cb),
                             int (*)(nl_sock*, nl_cb_type, nl_cb_kind, NlMsgCb, void*)>);
static_assert(std::is_same_v<decltype(&::nl_socket_modify_err_cb),
                             int (*)(nl_sock*, nl_cb_kind, NlErrCb, void*)>);
static_assert(sizeof(nl_cb_type) == sizeof(int) && sizeof(nl_cb_kind) == sizeof(int));
static_assert(kNlCbValid == NL_CB_VALID && kNlCbCustom == NL_CB_CUSTOM && kNlOk == NL_OK &&
              kNlSkip == NL_SKIP && kNlStop == NL_STOP);
#endif

constexpr const char* kNlLib = "libnl-3.so.200";
constexpr const char* kGenlLib = "libnl-genl-3.so.200";

template <typename Fn>
bool bind(void* h, const char* lib, const char* name, Fn* out, std::string* why) {
  void* p = h ? dlsym(h, name) : nullptr;
  if (!p) {
    *why = std::string("symbol ") + name + " missing from " + lib;
    return false;
  }
  *out = reinterpret_cast<Fn>(p);
  return true;
}

// The process-wide table, loaded once; null with *why when libnl is not there. Never freed.
const Api* api(std::string* why) {
  static std::mutex mu;
  static const Api* table = nullptr;
  static std::string failure;
  static bool attempted = false;
  std::lock_guard<std::mutex> lk(mu);
  if (!attempted) {
    attempted = true;
    void* nl = dlopen(kNlLib, RTLD_NOW | RTLD_LOCAL);
    void* genl = nl ? dlopen(kGenlLib, RTLD_NOW | RTLD_LOCAL) : nullptr;
    auto* a = new Api{};
    std::string err;
    bool ok = nl && genl;
    if (!ok) {
      const char* e = dlerror();
      err = std::string(nl ? kGenlLib : kNlLib) + " not found or not loadable (" +
            (e ? e : "dlopen failed") + "; Debian: libnl-3-200, libnl-genl-3-200)";
    }
#define R2CCL_BIND(h, lib, name) ok = ok && bind(h, lib, #name, &a->name, &err)
    R2CCL_BIND(nl, kNlLib, nl_socket_alloc);
    R2CCL_BIND(nl, kNlLib, nl_socket_free);
    R2CCL_BIND(nl, kNlLib, nl_socket_disable_auto_ack);
    R2CCL_BIND(nl, kNlLib, nl_socket_get_fd);
    R2CCL_BIND(nl, kNlLib, nl_socket_modify_cb);
    R2CCL_BIND(nl, kNlLib, nl_socket_modify_err_cb);
    R2CCL_BIND(nl, kNlLib, nl_send_auto);
    R2CCL_BIND(nl, kNlLib, nl_recvmsgs_default);
    R2CCL_BIND(nl, kNlLib, nl_geterror);
    R2CCL_BIND(nl, kNlLib, nlmsg_alloc);
    R2CCL_BIND(nl, kNlLib, nlmsg_free);
    R2CCL_BIND(nl, kNlLib, nlmsg_hdr);
    R2CCL_BIND(nl, kNlLib, nla_nest_start);
    R2CCL_BIND(nl, kNlLib, nla_nest_end);
    R2CCL_BIND(nl, kNlLib, nla_put_string);
    R2CCL_BIND(nl, kNlLib, nla_put_u32);
    R2CCL_BIND(nl, kNlLib, nla_parse_nested);
    R2CCL_BIND(nl, kNlLib, nla_data);
    R2CCL_BIND(nl, kNlLib, nla_len);
    R2CCL_BIND(genl, kGenlLib, genl_connect);
    R2CCL_BIND(genl, kGenlLib, genl_ctrl_resolve);
    R2CCL_BIND(genl, kGenlLib, genlmsg_put);
    R2CCL_BIND(genl, kGenlLib, genlmsg_parse);
#undef R2CCL_BIND
    if (ok) {
      table = a;
    } else {
      delete a;
      failure = err;
      if (genl) dlclose(genl);
      if (nl) dlclose(nl);
    }
  }
  if (!table) *why = failure;
  return table;
}

// The total (first u64) of one statistic array; absent for an attribute of length 0 (the driver
// does not report it). A length that is not a whole number of u64 is malformed.
bool stat_total(const Api& a, nlattr* attr, Reading* out) {
  *out = Reading{};
  if (!attr) return true;
  const int len = a.nla_len(attr);
  if (len < 0 || len % 8 != 0) return false;
  if (len == 0) return true;
  std::memcpy(&out->value, a.nla_data(attr), sizeof(uint64_t));
  out->present = true;
  return true;
}

bool parse_with(const Api& a, const nlmsghdr* msg, size_t len, FecReading* out, std::string* why,
                const std::string& ifname = "") {
  if (len < sizeof(nlmsghdr) || msg->nlmsg_len < NLMSG_HDRLEN + GENL_HDRLEN ||
      msg->nlmsg_len > len) {
    *why = "FEC_GET reply shorter than its netlink and generic netlink headers";
    return false;
  }
  nlattr* tb[ETHTOOL_A_FEC_MAX + 1] = {};
  auto* hdr = const_cast<nlmsghdr*>(msg);
  if (a.genlmsg_parse(hdr, 0, tb, ETHTOOL_A_FEC_MAX, nullptr) < 0) {
    *why = "FEC_GET reply's attributes are malformed";
    return false;
  }
  if (!ifname.empty() && tb[ETHTOOL_A_FEC_HEADER]) {
    // The reply's header names its device: it must be the one asked for.
    nlattr* h[ETHTOOL_A_HEADER_MAX + 1] = {};
    if (a.nla_parse_nested(h, ETHTOOL_A_HEADER_MAX, tb[ETHTOOL_A_FEC_HEADER], nullptr) < 0) {
      *why = "FEC_GET reply's header is malformed";
      return false;
    }
    if (nlattr* name = h[ETHTOOL_A_HEADER_DEV_NAME]) {
      const int n = a.nla_len(name);
      const char* d = static_cast<const char*>(a.nla_data(name));
      const std::string got(d, n > 0 ? strnlen(d, static_cast<size_t>(n)) : 0);
      if (got != ifname) {
        *why = "FEC_GET reply is for \"" + got + "\", not \"" + ifname + "\"";
        return false;
      }
    }
  }
  if (!tb[ETHTOOL_A_FEC_STATS]) {
    *why = "FEC_GET reply has no ETHTOOL_A_FEC_STATS (kernel older than 5.13?)";
    return false;
  }
  nlattr* st[ETHTOOL_A_FEC_STAT_MAX + 1] = {};
  if (a.nla_parse_nested(st, ETHTOOL_A_FEC_STAT_MAX, tb[ETHTOOL_A_FEC_STATS], nullptr) < 0) {
    *why = "FEC_GET reply's ETHTOOL_A_FEC_STATS nest is malformed";
    return false;
  }
  FecReading r;
  if (!stat_total(a, st[ETHTOOL_A_FEC_STAT_CORRECTED], &r.corrected_blocks) ||
      !stat_total(a, st[ETHTOOL_A_FEC_STAT_UNCORR], &r.uncorrectable_blocks) ||
      !stat_total(a, st[ETHTOOL_A_FEC_STAT_CORR_BITS], &r.corrected_bits)) {
    *why = "FEC_GET reply has a statistic that is not an array of u64";
    return false;
  }
  *out = r;
  return true;
}

}  // namespace

bool parse_fec_reply(const nlmsghdr* msg, size_t len, FecReading* out, std::string* why,
                     const std::string& ifname) {
  const Api* a = api(why);
  return a && parse_with(*a, msg, len, out, why, ifname);
}

struct EthtoolFec::Impl {
  const Api* a = nullptr;
  nl_sock* sk = nullptr;
  int family = -1;
  // One request's outcome, filled by the callbacks.
  struct Pending {
    const Api* a = nullptr;
    int family = -1;
    uint32_t seq = 0;  // the request's sequence number
    std::string ifname;
    bool got = false;
    int err = 0;  // positive errno from an NLMSG_ERROR
    std::string why;
    FecReading r;
  };

  // Only the reply to this request counts: its sequence number, family and command. (libnl
  // checks sequence numbers only while auto-ACK is on, which is off here.)
  static int on_valid(nl_msg* m, void* arg) {
    auto* p = static_cast<Pending*>(arg);
    nlmsghdr* h = p->a->nlmsg_hdr(m);
    if (h->nlmsg_seq != p->seq || h->nlmsg_type != p->family ||
        h->nlmsg_len < NLMSG_HDRLEN + GENL_HDRLEN ||
        static_cast<const genlmsghdr*>(NLMSG_DATA(h))->cmd != ETHTOOL_MSG_FEC_GET_REPLY)
      return kNlSkip;
    if (parse_with(*p->a, h, h->nlmsg_len, &p->r, &p->why, p->ifname))
      p->got = true;
    else
      p->err = EPROTO;
    return kNlOk;
  }
  static int on_error(sockaddr_nl*, nlmsgerr* e, void* arg) {
    auto* p = static_cast<Pending*>(arg);
    if (e->msg.nlmsg_seq != p->seq) return kNlSkip;  // an error for another request
    p->err = e->error < 0 ? -e->error : EPROTO;
    return kNlStop;
  }
};

EthtoolFec::EthtoolFec() : impl_(new Impl) {}

EthtoolFec::~EthtoolFec() {
  if (impl_->sk) impl_->a->nl_socket_free(impl_->sk);
}

int EthtoolFec::open(std::string* why) {
  Impl& m = *impl_;
  if (m.sk) return 0;
  m.a = api(why);
  if (!m.a) return ENOENT;
  nl_sock* sk = m.a->nl_socket_alloc();
  if (!sk) {
    *why = "nl_socket_alloc failed";
    return ENOMEM;
  }
  int rc = m.a->genl_connect(sk);
  if (rc < 0) {
    *why = std::string("generic netlink socket: ") + m.a->nl_geterror(rc);
    m.a->nl_socket_free(sk);
    return EIO;
  }
  // A 1 s receive timeout, before the first request (the family lookup).
  const timeval tv{1, 0};
  if (setsockopt(m.a->nl_socket_get_fd(sk), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0) {
    const int e = errno;
    *why = std::string("generic netlink socket: SO_RCVTIMEO: ") + std::strerror(e);
    m.a->nl_socket_free(sk);
    return e;
  }
  const int family = m.a->genl_ctrl_resolve(sk, ETHTOOL_GENL_NAME);
  if (family < 0) {
    *why = std::string("generic netlink family \"" ETHTOOL_GENL_NAME "\" not found (") +
           m.a->nl_geterror(family) + "; kernel without CONFIG_ETHTOOL_NETLINK?)";
    m.a->nl_socket_free(sk);
    return ENOENT;
  }
  // The kernel answers a GET with its reply or an error; no separate ACK is asked for.
  m.a->nl_socket_disable_auto_ack(sk);
  m.sk = sk;
  m.family = family;
  return 0;
}

int EthtoolFec::read(const std::string& ifname, FecReading* out, std::string* why) {
  if (int rc = open(why)) return rc;
  if (ifname.empty() || ifname.size() >= 16) {  // IFNAMSIZ
    *why = "interface name \"" + ifname + "\" is not 1-15 characters";
    return EINVAL;
  }
  Impl& m = *impl_;
  const Api& a = *m.a;
  nl_msg* msg = a.nlmsg_alloc();
  if (!msg) {
    *why = "nlmsg_alloc failed";
    return ENOMEM;
  }
  bool built = a.genlmsg_put(msg, 0, 0, m.family, 0, 0, ETHTOOL_MSG_FEC_GET,
                             ETHTOOL_GENL_VERSION) != nullptr;
  nlattr* hdr = built ? a.nla_nest_start(msg, ETHTOOL_A_FEC_HEADER | NLA_F_NESTED) : nullptr;
  built = hdr && a.nla_put_string(msg, ETHTOOL_A_HEADER_DEV_NAME, ifname.c_str()) == 0 &&
          a.nla_put_u32(msg, ETHTOOL_A_HEADER_FLAGS, ETHTOOL_FLAG_STATS) == 0 &&
          a.nla_nest_end(msg, hdr) == 0;
  if (!built) {
    a.nlmsg_free(msg);
    *why = "could not build the ETHTOOL_MSG_FEC_GET request";
    return ENOMEM;
  }
  Impl::Pending p;
  p.a = m.a;
  p.family = m.family;
  p.ifname = ifname;
  a.nl_socket_modify_cb(m.sk, kNlCbValid, kNlCbCustom, &Impl::on_valid, &p);
  a.nl_socket_modify_err_cb(m.sk, kNlCbCustom, &Impl::on_error, &p);
  int rc = a.nl_send_auto(m.sk, msg);  // completes the header: its sequence number
  p.seq = a.nlmsg_hdr(msg)->nlmsg_seq;
  a.nlmsg_free(msg);
  if (rc >= 0) rc = a.nl_recvmsgs_default(m.sk);
  if (p.got) {
    *out = p.r;
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    out->t_s = static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
    return 0;
  }
  if (p.err) {
    *why = p.why.empty() ? std::string("ethtool netlink FEC_GET: ") + std::strerror(p.err) : p.why;
    return p.err;
  }
  // No reply (a receive timeout, a socket error): start over with a fresh socket next time, so
  // a late reply can never be taken for the next request's.
  *why = std::string("ethtool netlink FEC_GET: no reply (") + a.nl_geterror(rc < 0 ? rc : 0) + ")";
  a.nl_socket_free(m.sk);
  m.sk = nullptr;
  return EIO;
}

// The worker's state, shared with it: a worker left behind in the kernel at destruction keeps
// it alive until its read returns.
struct AsyncFecSource::State {
  enum class Slot : uint8_t { kIdle, kQueued, kRunning, kDone };
  struct Entry {
    Slot st = Slot::kIdle;
    int rc = 0;
    FecReading r;
    std::string why;
    std::chrono::steady_clock::time_point since;  // when the pending request was asked for
  };
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool busy = false;  // the worker is inside inner->read()
  std::map<std::string, Entry> slots;
  std::deque<std::string> queue;
  std::unique_ptr<FecSource> inner;
  std::chrono::milliseconds overdue;

  void run() noexcept {
    try {
      std::unique_lock<std::mutex> lk(mu);
      for (;;) {
        cv.wait(lk, [&] { return stop || !queue.empty(); });
        if (stop) return;
        const std::string name = queue.front();
        queue.pop_front();
        Entry& e = slots[name];
        e.st = Slot::kRunning;
        busy = true;
        lk.unlock();
        FecReading r;
        std::string why;
        int rc;
        try {
          rc = inner->read(name, &r, &why);
        } catch (const std::exception& ex) {
          rc = EIO;
          why = std::string("FEC reader: ") + ex.what();
        } catch (...) {
          rc = EIO;
          why = "FEC reader: unknown exception";
        }
        lk.lock();
        busy = false;
        e.st = Slot::kDone;  // map entries never move
        e.rc = rc;
        e.r = r;
        e.why = std::move(why);
      }
    } catch (...) {
      // Out of memory in the bookkeeping: the worker ends; the pending requests go overdue
      // (ETIMEDOUT) and say so. Nothing escapes the thread.
    }
  }
};

AsyncFecSource::AsyncFecSource(std::unique_ptr<FecSource> inner, int overdue_ms)
    : state_(std::make_shared<State>()) {
  state_->inner = std::move(inner);
  state_->overdue = std::chrono::milliseconds(overdue_ms);
}

AsyncFecSource::~AsyncFecSource() {
  if (!worker_.joinable()) return;
  bool busy;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->stop = true;
    busy = state_->busy;
    state_->cv.notify_all();
  }
  // Never waits for the kernel: a worker inside a read (rtnl_lock held elsewhere) is left to
  // finish on its own, with the state it owns; an idle one sees `stop` and returns at once.
  if (busy)
    worker_.detach();
  else
    worker_.join();
}

int AsyncFecSource::read(const std::string& ifname, FecReading* out, std::string* why) {
  if (!worker_.joinable()) {
    try {
      std::shared_ptr<State> st = state_;
      worker_ = std::thread([st] { st->run(); });
    } catch (const std::system_error& e) {
      *why = std::string("cannot start the FEC reader thread: ") + e.what();
      return ENOMEM;
    }
  }
  State& s = *state_;
  std::lock_guard<std::mutex> lk(s.mu);
  State::Entry& e = s.slots[ifname];
  const auto now = std::chrono::steady_clock::now();
  auto ask = [&] {
    e.st = State::Slot::kQueued;
    e.since = now;
    s.queue.push_back(ifname);
    s.cv.notify_all();
  };
  switch (e.st) {
    case State::Slot::kDone: {
      const int rc = e.rc;
      *out = e.r;
      *why = e.why;
      // The next reading is asked for now; after a failure, only when asked again.
      if (rc == 0)
        ask();
      else
        e.st = State::Slot::kIdle;
      return rc;
    }
    case State::Slot::kIdle:
      ask();
      *why = "reading requested";
      return EAGAIN;
    default:
      if (now - e.since >= s.overdue) {
        *why = "the kernel has not answered the FEC request for " +
               std::to_string(
                   std::chrono::duration_cast<std::chrono::milliseconds>(now - e.since).count()) +
               " ms (rtnl_lock held elsewhere, or the NIC's firmware slow)";
        return ETIMEDOUT;
      }
      *why = "the previous request has not returned yet";
      return EAGAIN;
  }
}

}  // namespace r2ccl::predict
