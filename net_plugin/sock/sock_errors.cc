#include "sock/sock_errors.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>

#include "r2ccl/log.h"

namespace r2ccl::net {
namespace {

constexpr int kAnyOp = -1;

// One row per (errno, operation); kAnyOp matches every operation, and the first row that
// matches decides. The operations a row names are the ones whose meaning differs.
struct ErrnoRule {
  int err;
  int op;  // SockOp, or kAnyOp
  ErrClass cls;
  const char* why;  // what it means here (docs/ARCHITECTURE.md, "Errors at setup")
};

constexpr ErrnoRule kErrnoRules[] = {
    // Nothing listens at the address: the peer is starting or, after kRefusedGrace, gone.
    {ECONNREFUSED, kAnyOp, ErrClass::kBounded, "nothing listens there"},
    // The network: a flap, a route being re-established, a slow or lost answer.
    {EHOSTUNREACH, kAnyOp, ErrClass::kTransient, "no route to the host now"},
    {ENETUNREACH, kAnyOp, ErrClass::kTransient, "no route to the network now"},
    {ENETDOWN, kAnyOp, ErrClass::kTransient, "the interface is down"},
    {EHOSTDOWN, kAnyOp, ErrClass::kTransient, "the host is down"},
    {ETIMEDOUT, kAnyOp, ErrClass::kTransient, "no answer in time"},
    {ECONNRESET, kAnyOp, ErrClass::kTransient, "reset by the peer or the network"},
    {EPIPE, kAnyOp, ErrClass::kTransient, "the connection is closed"},
    {ECONNABORTED, kAnyOp, ErrClass::kTransient, "the connection was aborted"},
    {ENOBUFS, kAnyOp, ErrClass::kTransient, "kernel memory pressure"},
    {ENOMEM, kAnyOp, ErrClass::kTransient, "kernel memory pressure"},
    {EINTR, kAnyOp, ErrClass::kTransient, "interrupted"},
    {EAGAIN, kAnyOp, ErrClass::kTransient, "try again"},
    {EINPROGRESS, kAnyOp, ErrClass::kTransient, "in progress"},
    {EALREADY, kAnyOp, ErrClass::kTransient, "in progress"},
    // An address: at bind the rail's own address is not assigned (being renumbered); at
    // connect no local port is free towards that destination (the ephemeral range).
    {EADDRNOTAVAIL, static_cast<int>(SockOp::kBind), ErrClass::kTransient,
     "the rail's address is not assigned"},
    {EADDRNOTAVAIL, kAnyOp, ErrClass::kPermanent, "no free local port"},
    {EADDRINUSE, kAnyOp, ErrClass::kPermanent, "no free local port"},
    // Local limits: they free up only when this process (or the host) closes descriptors.
    {EMFILE, kAnyOp, ErrClass::kPermanent, "the process's descriptor limit"},
    {ENFILE, kAnyOp, ErrClass::kPermanent, "the system's descriptor limit"},
    // Permissions and configuration.
    {EACCES, kAnyOp, ErrClass::kPermanent, "not permitted"},
    {EPERM, kAnyOp, ErrClass::kPermanent, "not permitted"},
    {EAFNOSUPPORT, kAnyOp, ErrClass::kPermanent, "address family not supported"},
    {EPROTONOSUPPORT, kAnyOp, ErrClass::kPermanent, "protocol not supported"},
    {EINVAL, kAnyOp, ErrClass::kPermanent, "invalid argument"},
    {ENODEV, kAnyOp, ErrClass::kPermanent, "no such device (SO_BINDTODEVICE)"},
    {EPROTO, kAnyOp, ErrClass::kPermanent, "protocol error"},
};

const ErrnoRule* find_rule(int err, SockOp op) {
  for (const auto& r : kErrnoRules)
    if (r.err == err && (r.op == kAnyOp || r.op == static_cast<int>(op))) return &r;
  return nullptr;
}

std::string read_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  for (char& c : s)
    if (c == '\t') c = ' ';
  return s;
}

}  // namespace

const char* sock_op_name(SockOp op) {
  switch (op) {
    case SockOp::kSocket: return "socket";
    case SockOp::kBind: return "bind";
    case SockOp::kListen: return "listen";
    case SockOp::kConnect: return "connect";
    case SockOp::kAccept: return "accept";
    case SockOp::kIo: return "I/O";
  }
  return "?";
}

const char* err_class_name(ErrClass c) {
  switch (c) {
    case ErrClass::kTransient: return "transient";
    case ErrClass::kBounded: return "transient (bounded)";
    case ErrClass::kPermanent: return "permanent";
  }
  return "?";
}

ErrClass classify_errno(int err, SockOp op) {
  const ErrnoRule* r = find_rule(err, op);
  return r ? r->cls : ErrClass::kTransient;
}

const char* errno_meaning(int err, SockOp op) {
  const ErrnoRule* r = find_rule(err, op);
  return r ? r->why : "";
}

std::string nofile_limit_text() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return "RLIMIT_NOFILE unreadable";
  auto v = [](rlim_t x) {
    return x == RLIM_INFINITY ? std::string("unlimited") : std::to_string(x);
  };
  return "RLIMIT_NOFILE soft " + v(rl.rlim_cur) + ", hard " + v(rl.rlim_max);
}

std::string port_range_text() {
  const std::string r = read_line("/proc/sys/net/ipv4/ip_local_port_range");
  return "net.ipv4.ip_local_port_range " + (r.empty() ? std::string("unreadable") : r);
}

std::string describe_errno(int err, SockOp op) {
  std::string s = strerror(err);
  switch (err) {
    case EMFILE: return s + " (" + nofile_limit_text() + ")";
    case ENFILE: {
      const std::string m = read_line("/proc/sys/fs/file-max");
      return s + " (fs.file-max " + (m.empty() ? std::string("unreadable") : m) + ")";
    }
    case EADDRINUSE: return s + " (no free local port: " + port_range_text() + ")";
    case EADDRNOTAVAIL:
      if (op == SockOp::kBind) return s + " (the rail's address is not assigned)";
      return s + " (no free local port: " + port_range_text() + ")";
    default: return s;
  }
}

bool first_time(const std::string& key) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lk(mu);
  return seen.insert(key).second;
}

bool AcceptGate::on_error(int err, const std::string& where, TimeUs now) {
  // EAGAIN and the like: nothing waits. That changes nothing (the process may still be out of
  // descriptors).
  if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM) return false;
  until_ = now + kAcceptPause;
  // One shortage is a run of failures less than kAcceptStarvedLimit apart (a connector whose
  // hello went unanswered retries within about a second; verbs tries only while an accept() is
  // in progress: a failure long ago belongs to an earlier shortage), unless accepts went on
  // succeeding for kAcceptRecovered in between.
  const TimeUs ok = ok_since_.exchange(0, std::memory_order_relaxed);
  if (since_.load(std::memory_order_relaxed) == 0 ||
      now - last_.load(std::memory_order_relaxed) > kAcceptStarvedLimit ||
      (ok != 0 && now - ok >= kAcceptRecovered)) {
    err_.store(err, std::memory_order_relaxed);
    since_.store(now, std::memory_order_relaxed);
  }
  last_.store(now, std::memory_order_relaxed);
  if (first_time("accept:" + std::to_string(err)))
    R2CCL_WARN(
        "accept on %s: %s; accepting pauses for %lld ms at a time until the process has "
        "descriptors again (connectors retry meanwhile; after %.1f s the accept and the "
        "connectors fail; warned once per process)",
        where.c_str(), describe_errno(err, SockOp::kAccept).c_str(),
        static_cast<long long>(kAcceptPause / kUsPerMs), kAcceptStarvedLimit / 1e6);
  return true;
}

void AcceptGate::on_accepted(TimeUs now) {
  if (ok_since_.load(std::memory_order_relaxed) == 0)
    ok_since_.store(std::max<TimeUs>(now, 1), std::memory_order_relaxed);
}

bool AcceptGate::starved(TimeUs now, TimeUs since) const {
  const TimeUs s = since_.load(std::memory_order_relaxed);
  return s != 0 && ok_since_.load(std::memory_order_relaxed) == 0 &&
         now - s >= kAcceptStarvedLimit && last_.load(std::memory_order_relaxed) >= since;
}

std::string AcceptGate::starved_text(TimeUs now) const {
  const TimeUs s = since_.load(std::memory_order_relaxed);
  char t[32];
  snprintf(t, sizeof(t), " for %.1f s", s ? (now - s) / 1e6 : 0.0);
  return describe_errno(err_.load(std::memory_order_relaxed), SockOp::kAccept) + t;
}

namespace {
std::mutex g_spare_mu;
int g_spare_fd = -1;  // guarded by g_spare_mu
}  // namespace

void keep_spare_descriptor() {
  std::lock_guard<std::mutex> lk(g_spare_mu);
  if (g_spare_fd < 0) g_spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
}

bool refuse_with_spare(int listen_fd, const void* msg, size_t len) {
  std::lock_guard<std::mutex> lk(g_spare_mu);
  if (g_spare_fd < 0) return false;
  // Only when a connection waits: a blocking listener's accept4 would block here otherwise.
  pollfd p{listen_fd, POLLIN, 0};
  if (::poll(&p, 1, 0) != 1 || !(p.revents & POLLIN)) return false;
  ::close(g_spare_fd);
  g_spare_fd = -1;
  const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  bool refused = false;
  if (fd >= 0) {
    // Read what the connector sent first: closing a socket with unread data resets it, and
    // the reset may overtake the refusal.
    char sink[4096];
    while (::recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
    }
    (void)!::send(fd, msg, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(fd, SHUT_WR);
    ::close(fd);
    refused = true;
  }
  g_spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  return refused;
}

}  // namespace r2ccl::net
