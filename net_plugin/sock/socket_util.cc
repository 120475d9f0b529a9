#include "socket_util.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "r2ccl/log.h"

namespace r2ccl::net {
namespace {

bool bind_to_device(int fd, const Rail& rail) {
  if (setsockopt(fd, SOL_SOCKET, SO_BINDTODEVICE, rail.ifname.c_str(),
                 static_cast<socklen_t>(rail.ifname.size())) == 0)
    return true;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    R2CCL_WARN(
        "SO_BINDTODEVICE(%s) failed: %s; sockets are bound to the rail's source address "
        "only, so a dead rail may be rerouted by the kernel (needs CAP_NET_RAW)",
        rail.ifname.c_str(), strerror(errno));
  return false;
}

// IP_BIND_ADDRESS_NO_PORT (Linux 4.2+, IPv4 and IPv6 sockets): bind() fixes the source
// address only and connect() picks the port per 4-tuple, so a rail address is not limited to
// one ephemeral range per host whatever the peer. Refused: bind takes a port as before.
void bind_address_no_port(int fd) {
#ifdef IP_BIND_ADDRESS_NO_PORT
  const int one = 1;
  if (setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one)) == 0) return;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    R2CCL_WARN(
        "IP_BIND_ADDRESS_NO_PORT refused (%s): every outgoing rail socket holds an ephemeral "
        "port from bind on, so ports run out sooner (net.ipv4.ip_local_port_range)",
        strerror(errno));
#else
  (void)fd;
#endif
}

}  // namespace

void set_user_timeout(int fd, TimeUs user_timeout) {
  const unsigned int ms =
      user_timeout > 0 ? static_cast<unsigned int>((user_timeout + kUsPerMs - 1) / kUsPerMs) : 0;
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
}

void set_socket_options(int fd, TimeUs user_timeout) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (user_timeout > 0) set_user_timeout(fd, user_timeout);
}

int open_rail_socket(const Rail& rail, TimeUs user_timeout, SockFailure* why) {
  int fd = socket(rail.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    why->err = errno;
    why->op = SockOp::kSocket;
    why->text = "socket() on rail " + rail.name + ": " + describe_errno(why->err, why->op);
    return -1;
  }
  bind_to_device(fd, rail);
  bind_address_no_port(fd);
  sockaddr_storage a = rail.addr;
  if (a.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in*>(&a)->sin_port = 0;
  else
    reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), rail.addrlen) != 0) {
    why->err = errno;
    why->op = SockOp::kBind;
    why->text = "bind(" + addr_to_string(a) + ") on rail " + rail.name + ": " +
                describe_errno(why->err, why->op);
    close(fd);
    return -1;
  }
  set_socket_options(fd, user_timeout);
  return fd;
}

int start_connect(int fd, const sockaddr_storage& peer) {
  socklen_t len = peer.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&peer), len) == 0) return 0;
  if (errno == EINPROGRESS) return 0;
  return -errno;
}

int finish_connect(int fd) {
  int e = 0;
  socklen_t l = sizeof(e);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &l) != 0) return -errno;
  if (e != 0) return -e;
  sockaddr_storage peer;
  socklen_t pl = sizeof(peer);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0)
    return errno == ENOTCONN ? -EINPROGRESS : -errno;
  return 0;
}

// Connects a rail listener queues before they are accepted. NCCL opens its channels'
// connections to a peer at once (512 send connections with 2 streams per path put 1,024
// connects on each rail listener), and a SYN that finds the queue full is dropped and sent
// again only after the kernel's 1 s SYN timeout. The kernel caps it at net.core.somaxconn
// (4096 by default since Linux 5.4).
constexpr int kListenBacklog = 16384;

int open_rail_listener(const Rail& rail, std::string* err, uint16_t port) {
  int fd = socket(rail.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = std::string("socket(): ") + strerror(errno);
    return -1;
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  bind_to_device(fd, rail);
  bind_address_no_port(fd);
  sockaddr_storage a = rail.addr;
  if (a.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in*>(&a)->sin_port = port;
  else
    reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = port;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), rail.addrlen) != 0 ||
      listen(fd, kListenBacklog) != 0) {
    *err = "listen on " + addr_to_string(a) + " (rail " + rail.name + "): " + strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

uint16_t local_port(int fd) {
  sockaddr_storage a;
  socklen_t l = sizeof(a);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &l) != 0) return 0;
  if (a.ss_family == AF_INET) return reinterpret_cast<sockaddr_in*>(&a)->sin_port;
  return reinterpret_cast<sockaddr_in6*>(&a)->sin6_port;
}

}  // namespace r2ccl::net
