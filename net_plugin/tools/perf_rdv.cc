#include "perf_rdv.h"

#include <arpa/inet.h>
#include <errno.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "perf_net.h"  // PerfError

namespace r2perf {
namespace {

bool write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool read_blob(int fd, std::string* out) {
  uint32_t len = 0;
  if (!read_all(fd, &len, sizeof(len))) return false;
  out->resize(len);
  return len == 0 || read_all(fd, &(*out)[0], len);
}

bool write_blob(int fd, const std::string& s) {
  uint32_t len = static_cast<uint32_t>(s.size());
  return write_all(fd, &len, sizeof(len)) && (len == 0 || write_all(fd, s.data(), len));
}

void nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void serve_fd(int lfd, int nranks) {
  std::vector<int> fds(static_cast<size_t>(nranks), -1);
  auto close_all = [&] {
    for (int& f : fds) {
      if (f >= 0) close(f);
      f = -1;
    }
  };
  int joined = 0;
  while (joined < nranks) {
    int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      break;
    }
    nodelay(fd);
    uint32_t rank = 0;
    if (!read_all(fd, &rank, sizeof(rank)) || rank >= static_cast<uint32_t>(nranks) ||
        fds[rank] >= 0) {
      close(fd);  // a stray or duplicate client: ignore it
      continue;
    }
    fds[rank] = fd;
    joined++;
  }
  close(lfd);
  if (joined < nranks) {
    close_all();
    return;
  }
  // Rounds. Every connection is polled all the time, so a rank that dies while the others
  // are busy (or waiting for their answer) releases everybody at once.
  struct In {
    std::string blob;
    unsigned char len_bytes[4];
    size_t got;
    bool done;
  };
  std::vector<In> in(static_cast<size_t>(nranks));
  std::vector<pollfd> pf(static_cast<size_t>(nranks));
  for (;;) {
    for (In& i : in) {
      i.blob.clear();
      i.got = 0;
      i.done = false;
    }
    int pending = nranks;
    while (pending > 0) {
      for (int r = 0; r < nranks; r++)
        pf[r] = {fds[r], static_cast<short>(in[r].done ? POLLRDHUP : (POLLIN | POLLRDHUP)), 0};
      if (poll(pf.data(), pf.size(), -1) < 0) {
        if (errno == EINTR) continue;
        close_all();
        return;
      }
      for (int r = 0; r < nranks; r++) {
        In& i = in[r];
        if (!pf[r].revents) continue;
        if (i.done) {  // answered its part and hung up: it is gone
          close_all();
          return;
        }
        ssize_t n;
        if (i.got < 4) {
          n = recv(fds[r], i.len_bytes + i.got, 4 - i.got, MSG_DONTWAIT);
        } else {
          uint32_t len;
          memcpy(&len, i.len_bytes, 4);
          i.blob.resize(len);
          n = recv(fds[r], &i.blob[i.got - 4], len - (i.got - 4), MSG_DONTWAIT);  // len > 0
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (n <= 0) {
          close_all();  // a rank left (normally: the end): release everybody
          return;
        }
        i.got += static_cast<size_t>(n);
        if (i.got >= 4) {
          uint32_t len;
          memcpy(&len, i.len_bytes, 4);
          if (i.got == 4 + static_cast<size_t>(len)) {
            i.blob.resize(len);
            i.done = true;
            pending--;
          }
        }
      }
    }
    std::string all;
    for (const In& i : in) {
      uint32_t len = static_cast<uint32_t>(i.blob.size());
      all.append(reinterpret_cast<const char*>(&len), sizeof(len));
      all += i.blob;
    }
    for (int r = 0; r < nranks; r++) {
      if (!write_all(fds[r], all.data(), all.size())) {
        close_all();
        return;
      }
    }
  }
}

// One socket address (what getaddrinfo returned, or built from one).
struct SockAddr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family() const { return ss.ss_family; }
  const sockaddr* sa() const { return reinterpret_cast<const sockaddr*>(&ss); }
};

// getaddrinfo(host, port) with these hints, every result appended to *out. Returns 0 or the
// resolver's error code.
int lookup(const char* host, int port, int family, int flags, std::vector<SockAddr>* out) {
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  addrinfo* res = nullptr;
  const std::string ps = std::to_string(port);
  int g = getaddrinfo(host, ps.c_str(), &hints, &res);
  if (g != 0) return g;
  for (addrinfo* a = res; a; a = a->ai_next) {
    if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SockAddr s;
    memcpy(&s.ss, a->ai_addr, a->ai_addrlen);
    s.len = a->ai_addrlen;
    out->push_back(s);
  }
  freeaddrinfo(res);
  return 0;
}

std::string gai_text(int g) {
  return g == EAI_SYSTEM ? std::string(strerror(errno)) : std::string(gai_strerror(g));
}

// The addresses a client connects to, in order (for an IPv6 address: that address with its
// scope). Empty with *err where a host name no longer resolves (it did at parse time).
std::vector<SockAddr> connect_addrs(const RdvAddress& a, std::string* err) {
  std::vector<SockAddr> v;
  int g = 0;
  switch (a.kind) {
    case RdvAddress::Kind::kIPv6:
      g = lookup(a.host.c_str(), a.port, AF_INET6, AI_NUMERICHOST, &v);
      for (SockAddr& s : v) reinterpret_cast<sockaddr_in6*>(&s.ss)->sin6_scope_id = a.scope_id;
      break;
    case RdvAddress::Kind::kIPv4:
      g = lookup(a.host.c_str(), a.port, AF_INET, AI_NUMERICHOST, &v);
      break;
    case RdvAddress::Kind::kName: g = lookup(a.host.c_str(), a.port, AF_UNSPEC, 0, &v); break;
  }
  if (g != 0) *err = "cannot resolve '" + a.host + "': " + gai_text(g);
  return v;
}

// A listening socket on `addr` (v6only = 0: a dual-stack [::] that takes IPv4 clients too).
// Returns the descriptor, or -1 with *err (the errno text of the call that failed).
int listen_on(const SockAddr& addr, bool dual_stack, std::string* err) {
  int fd = socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = std::string("socket: ") + strerror(errno);
    return -1;
  }
  int one = 1, zero = 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (dual_stack) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  if (bind(fd, addr.sa(), addr.len) != 0) {
    *err = std::string("bind: ") + strerror(errno);
  } else if (::listen(fd, 1024) != 0) {
    *err = std::string("listen: ") + strerror(errno);
  } else {
    return fd;
  }
  close(fd);
  return -1;
}

int bound_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  return ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

bool refuse(const std::string& s, const std::string& what, std::string* err) {
  *err = "'" + s + "': " + what + "; accepted: " + kRdvForms;
  return false;
}

// PORT text -> 1..65535; false with *why.
bool parse_port(const std::string& p, int* port, std::string* why) {
  if (p.empty()) {
    *why = "missing port";
    return false;
  }
  if (p.find_first_not_of("0123456789") != std::string::npos) {
    *why = "port '" + p + "' is not a decimal number";
    return false;
  }
  const size_t nz = p.find_first_not_of('0');
  if (nz == std::string::npos || p.size() - nz > 5 || std::stol(p.substr(nz)) > 65535) {
    *why = "port " + p + " is out of range (1..65535)";
    return false;
  }
  *port = static_cast<int>(std::stol(p.substr(nz)));
  return true;
}

}  // namespace

const char* const kRdvForms =
    "HOST:PORT, [IPV6]:PORT or [IPV6%SCOPE]:PORT (HOST: a host name or an IPv4 address; "
    "SCOPE: an interface name or index of this host, required for a link-local fe80::/10 "
    "address and refused for any other; PORT: 1..65535)";

std::string RdvAddress::text() const {
  if (kind != Kind::kIPv6) return host + ":" + std::to_string(port);
  return "[" + host + (scope.empty() ? "" : "%" + scope) + "]:" + std::to_string(port);
}

bool parse_rdv_address(const std::string& s, RdvAddress* out, std::string* err) {
  RdvAddress a;
  std::string why, port_text;
  if (!s.empty() && s[0] == '[') {
    const size_t close = s.find(']');
    if (close == std::string::npos) return refuse(s, "unbalanced brackets (no ']')", err);
    std::string inner = s.substr(1, close - 1);
    if (inner.find('[') != std::string::npos ||
        s.find_first_of("[]", close + 1) != std::string::npos)
      return refuse(s, "unbalanced brackets", err);
    if (inner.empty()) return refuse(s, "empty host", err);
    const std::string rest = s.substr(close + 1);
    if (rest.empty()) return refuse(s, "missing port", err);
    if (rest[0] != ':') return refuse(s, "expected ':PORT' after ']'", err);
    port_text = rest.substr(1);
    const size_t pct = inner.find('%');
    if (pct != std::string::npos) {
      a.scope = inner.substr(pct + 1);
      inner = inner.substr(0, pct);
      if (a.scope.empty()) return refuse(s, "empty scope after '%'", err);
      if (inner.empty()) return refuse(s, "empty host", err);
    }
    if (!parse_port(port_text, &a.port, &why)) return refuse(s, why, err);
    std::vector<SockAddr> v;
    if (lookup(inner.c_str(), a.port, AF_INET6, AI_NUMERICHOST, &v) != 0 || v.empty()) {
      std::vector<SockAddr> v4;
      if (lookup(inner.c_str(), a.port, AF_INET, AI_NUMERICHOST, &v4) == 0)
        return refuse(s,
                      "brackets are for IPv6 addresses only; write an IPv4 address as " + inner +
                          ":" + port_text,
                      err);
      return refuse(s, "'" + inner + "' is not a numeric IPv6 address", err);
    }
    const in6_addr& ip = reinterpret_cast<const sockaddr_in6*>(&v[0].ss)->sin6_addr;
    if (IN6_IS_ADDR_MULTICAST(&ip))
      return refuse(s, "'" + inner + "' is a multicast address (a TCP rendezvous needs unicast)",
                    err);
    const bool link_local = IN6_IS_ADDR_LINKLOCAL(&ip);
    if (link_local && a.scope.empty())
      return refuse(
          s,
          "the link-local address " + inner + " needs a scope: [" + inner + "%IFNAME]:" + port_text,
          err);
    if (!link_local && !a.scope.empty())
      return refuse(s,
                    "a scope (%" + a.scope + ") is only for a link-local fe80::/10 address; " +
                        inner + " is not one",
                    err);
    if (!a.scope.empty()) {
      if (a.scope.find_first_not_of("0123456789") == std::string::npos) {
        char name[IF_NAMESIZE] = {};
        const unsigned long idx = a.scope.size() <= 9 ? std::stoul(a.scope) : 0;
        if (idx == 0 || !if_indextoname(static_cast<unsigned>(idx), name))
          return refuse(s, "no interface with index " + a.scope + " on this host", err);
        a.scope_id = static_cast<unsigned>(idx);
      } else {
        a.scope_id = if_nametoindex(a.scope.c_str());
        if (a.scope_id == 0)
          return refuse(s, "no interface named '" + a.scope + "' on this host", err);
      }
    }
    a.kind = RdvAddress::Kind::kIPv6;
    a.host = inner;
  } else {
    if (s.find_first_of("[]") != std::string::npos) return refuse(s, "unbalanced brackets", err);
    const size_t colon = s.rfind(':');
    const std::string host = colon == std::string::npos ? s : s.substr(0, colon);
    if (host.find(':') != std::string::npos)
      return refuse(s, "an IPv6 address needs brackets: [ADDR]:PORT", err);
    if (host.empty()) return refuse(s, "empty host", err);
    if (colon == std::string::npos) return refuse(s, "missing port", err);
    if (!parse_port(s.substr(colon + 1), &a.port, &why)) return refuse(s, why, err);
    std::vector<SockAddr> v;
    if (lookup(host.c_str(), a.port, AF_INET, AI_NUMERICHOST, &v) == 0) {
      a.kind = RdvAddress::Kind::kIPv4;
    } else {
      const int g = lookup(host.c_str(), a.port, AF_UNSPEC, 0, &v);
      if (g != 0) return refuse(s, "cannot resolve '" + host + "': " + gai_text(g), err);
      a.kind = RdvAddress::Kind::kName;
    }
    a.host = host;
  }
  *out = a;
  return true;
}

RdvServer::~RdvServer() {
  close_listen();
  if (thread_.joinable()) thread_.detach();  // it owns everything it touches
}

void RdvServer::close_listen() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void RdvServer::listen(const std::string& host, int port) {
  std::vector<SockAddr> v;
  int g = lookup(host.empty() ? nullptr : host.c_str(), port, AF_UNSPEC, AI_PASSIVE, &v);
  if (g != 0) throw PerfError("rendezvous: cannot resolve '" + host + "': " + gai_text(g));
  std::string err = "no address";
  for (const SockAddr& a : v) {
    fd_ = listen_on(a, false, &err);
    if (fd_ >= 0) break;
  }
  if (fd_ < 0)
    throw PerfError("rendezvous: cannot listen on " + (host.empty() ? std::string("*") : host) +
                    ":" + std::to_string(port) + ": " + err);
  port_ = bound_port(fd_);
}

void RdvServer::listen(const RdvAddress& a) {
  std::string err;
  std::vector<SockAddr> v;
  std::string where;
  if (a.kind == RdvAddress::Kind::kIPv6) {
    v = connect_addrs(a, &err);  // the address itself, with its scope
    where = a.text();
  } else {
    bool v6 = false;
    if (a.kind == RdvAddress::Kind::kName)
      for (const SockAddr& s : connect_addrs(a, &err)) v6 = v6 || s.family() == AF_INET6;
    // Every address of the family (a dual-stack [::] first where the name has IPv6), so
    // clients reach rank 0 whichever of the name's addresses they try.
    std::vector<SockAddr> any;
    if (v6) lookup(nullptr, a.port, AF_INET6, AI_PASSIVE, &any);
    lookup(nullptr, a.port, AF_INET, AI_PASSIVE, &any);
    v = any;
    where = std::string(v6 ? "[::]" : "0.0.0.0") + ":" + std::to_string(a.port) + " (for " +
            a.text() + ")";
  }
  if (v.empty() && err.empty()) err = "no address";
  for (const SockAddr& s : v) {
    fd_ = listen_on(s, s.family() == AF_INET6 && a.kind != RdvAddress::Kind::kIPv6, &err);
    if (fd_ >= 0) break;
  }
  if (fd_ < 0) {
    std::string hint = a.kind == RdvAddress::Kind::kIPv6
                           ? " (rank 0 listens on that address: it must be one of this host's)"
                           : "";
    throw PerfError("rendezvous: cannot listen on " + where + ": " + err + hint);
  }
  port_ = bound_port(fd_);
}

void RdvServer::start(int nranks) {
  int lfd = fd_;
  fd_ = -1;  // the thread owns it now
  done_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<bool>> done = done_;
  thread_ = std::thread([lfd, nranks, done] {
    serve_fd(lfd, nranks);
    done->store(true);
  });
}

bool RdvServer::wait(double timeout_s) {
  if (!thread_.joinable()) return true;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!done_->load()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  thread_.join();
  return true;
}

RdvClient::~RdvClient() { close(); }

void RdvClient::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void RdvClient::connect(const RdvAddress& a, int rank, int nranks, double timeout_s) {
  nranks_ = nranks;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::string err;
  for (;;) {
    bool any_socket = false;
    std::string sock_err;
    for (const SockAddr& s : connect_addrs(a, &err)) {
      int fd = socket(s.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        sock_err =
            std::string(s.family() == AF_INET6 ? "IPv6" : "IPv4") + " socket: " + strerror(errno);
        continue;
      }
      any_socket = true;
      if (::connect(fd, s.sa(), s.len) == 0) {
        fd_ = fd;
        break;
      }
      err = strerror(errno);
      ::close(fd);
    }
    if (fd_ >= 0) break;
    // No socket of the address's family can be made here (IPv6 disabled): retrying will not
    // change that.
    if (!any_socket && !sock_err.empty())
      throw PerfError("rendezvous: cannot connect to " + a.text() + ": " + sock_err);
    if (std::chrono::steady_clock::now() > deadline)
      throw PerfError("rendezvous: cannot connect to " + a.text() + " within " +
                      std::to_string(static_cast<int>(timeout_s)) + " s: " + err);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  nodelay(fd_);
  uint32_t r = static_cast<uint32_t>(rank);
  if (!write_all(fd_, &r, sizeof(r))) throw PerfError("rendezvous: hello failed");
}

std::vector<std::string> RdvClient::allgather(const std::string& mine) {
  const char* lost = "rendezvous connection lost (another rank failed or exited)";
  if (fd_ < 0 || !write_blob(fd_, mine)) throw PerfError(lost);
  std::vector<std::string> out(static_cast<size_t>(nranks_));
  for (auto& b : out)
    if (!read_blob(fd_, &b)) throw PerfError(lost);
  return out;
}

}  // namespace r2perf
