// r2ccl_perf's rendezvous (net_plugin/tools/perf_rdv.h): the --rendezvous address parser (every
// accepted form, every refusal with the value, the problem and the accepted forms), and a
// server and clients over the IPv6 loopback (skipped with a WARN where this host has no ::1).
#include <arpa/inet.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tools/perf_net.h"
#include "tools/perf_rdv.h"

using r2perf::parse_rdv_address;
using r2perf::RdvAddress;
using Kind = r2perf::RdvAddress::Kind;

namespace {

const char* const kForms = "HOST:PORT, [IPV6]:PORT or [IPV6%SCOPE]:PORT";

RdvAddress parsed(const std::string& s) {
  RdvAddress a;
  std::string err;
  INFO(s);
  REQUIRE(parse_rdv_address(s, &a, &err));
  CHECK(err.empty());
  return a;
}

// The refusal of `s` names it, says `problem` and lists the accepted forms; *out untouched.
void refused(const std::string& s, const std::string& problem) {
  RdvAddress a;
  a.port = 4242;
  std::string err;
  INFO(s);
  REQUIRE_FALSE(parse_rdv_address(s, &a, &err));
  INFO(err);
  CHECK(err.find("'" + s + "'") == 0);
  CHECK(err.find(problem) != std::string::npos);
  CHECK(err.find(kForms) != std::string::npos);
  CHECK(a.port == 4242);
}

// A TCP connect to addr:port (numeric), true when it was accepted.
bool tcp_connects(int family, const char* addr, int port) {
  int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_storage ss{};
  socklen_t len;
  if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET6, addr, &a->sin6_addr);
    len = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, addr, &a->sin_addr);
    len = sizeof(*a);
  }
  bool ok = connect(fd, reinterpret_cast<sockaddr*>(&ss), len) == 0;
  close(fd);
  return ok;
}

// Where this host has no IPv6 loopback, says why (for the WARN of a skipped case).
std::string no_ipv6_loopback() {
  int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::string("socket(AF_INET6): ") + strerror(errno);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  std::string why;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0)
    why = std::string("bind [::1]:0: ") + strerror(errno);
  close(fd);
  return why;
}

}  // namespace

TEST_CASE("rendezvous address: HOST:PORT, [IPV6]:PORT and [IPV6%SCOPE]:PORT are accepted",
          "[perf_rdv]") {
  RdvAddress a = parsed("127.0.0.1:29500");
  CHECK(a.kind == Kind::kIPv4);
  CHECK(a.host == "127.0.0.1");
  CHECK(a.port == 29500);
  CHECK(a.text() == "127.0.0.1:29500");

  a = parsed("localhost:1");  // a name (/etc/hosts)
  CHECK(a.kind == Kind::kName);
  CHECK(a.host == "localhost");
  CHECK(a.port == 1);

  a = parsed("[::1]:65535");
  CHECK(a.kind == Kind::kIPv6);
  CHECK(a.host == "::1");
  CHECK(a.scope.empty());
  CHECK(a.scope_id == 0);
  CHECK(a.port == 65535);
  CHECK(a.text() == "[::1]:65535");

  a = parsed("[fd00:1::2]:00080");  // leading zeros
  CHECK(a.host == "fd00:1::2");
  CHECK(a.port == 80);
  CHECK(parsed("[::ffff:10.0.0.1]:7").kind == Kind::kIPv6);

  // Link-local: the scope by interface name or index (lo exists everywhere).
  const unsigned lo = if_nametoindex("lo");
  REQUIRE(lo != 0);
  a = parsed("[fe80::1%lo]:29500");
  CHECK(a.kind == Kind::kIPv6);
  CHECK(a.host == "fe80::1");
  CHECK(a.scope == "lo");
  CHECK(a.scope_id == lo);
  CHECK(a.text() == "[fe80::1%lo]:29500");
  a = parsed("[fe80::a:b:c:d%" + std::to_string(lo) + "]:2");
  CHECK(a.scope_id == lo);
  CHECK(a.scope == std::to_string(lo));
  CHECK(parsed("[FEBF::1%lo]:3").scope_id == lo);  // fe80::/10 ends at febf::
}

TEST_CASE("rendezvous address: what cannot be used is refused, naming the value and the forms",
          "[perf_rdv]") {
  // Missing port.
  refused("127.0.0.1", "missing port");
  refused("node1:", "missing port");
  refused("[::1]", "missing port");
  refused("[::1]:", "missing port");
  // Port out of range or not a number.
  refused("node1:0", "port 0 is out of range (1..65535)");
  refused("node1:65536", "port 65536 is out of range (1..65535)");
  refused("node1:99999999999999999999", "out of range (1..65535)");
  refused("node1:-1", "port '-1' is not a decimal number");
  refused("node1:29500x", "port '29500x' is not a decimal number");
  refused("[::1]:+1", "port '+1' is not a decimal number");
  // Unbalanced brackets.
  refused("[::1:29500", "unbalanced brackets");
  refused("::1]:29500", "unbalanced brackets");
  refused("[[::1]]:29500", "unbalanced brackets");
  refused("[::1]:29500]", "unbalanced brackets");
  refused("[::1]29500", "expected ':PORT' after ']'");
  // IPv6 without brackets.
  refused("::1:29500", "an IPv6 address needs brackets");
  refused("fe80::1%lo:29500", "an IPv6 address needs brackets");
  refused("::1", "an IPv6 address needs brackets");
  // Empty host.
  refused(":29500", "empty host");
  refused("", "empty host");
  refused("[]:29500", "empty host");
  refused("[%lo]:29500", "empty host");
  // Brackets around what is not an IPv6 address; a multicast address.
  refused("[127.0.0.1]:29500", "brackets are for IPv6 addresses only");
  refused("[node1]:29500", "'node1' is not a numeric IPv6 address");
  refused("[ff02::1%lo]:29500", "multicast");
  // Scopes: required for link-local, refused elsewhere, unknown interfaces refused.
  refused("[fe80::1]:29500",
          "the link-local address fe80::1 needs a scope: [fe80::1%IFNAME]:29500");
  refused("[::1%lo]:29500", "a scope (%lo) is only for a link-local fe80::/10 address");
  refused("[fd00::1%lo]:29500", "fd00::1 is not one");
  refused("[fe80::1%]:29500", "empty scope after '%'");
  refused("[fe80::1%r2ccl-no-if9]:29500", "no interface named 'r2ccl-no-if9' on this host");
  refused("[fe80::1%999999]:29500", "no interface with index 999999 on this host");
  refused("[fe80::1%0]:29500", "no interface with index 0 on this host");
}

TEST_CASE("rendezvous address: a host name that does not resolve prints the resolver's error",
          "[perf_rdv]") {
  const char* name = "r2ccl-no-such-host.invalid";  // .invalid never resolves (RFC 6761)
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int g = getaddrinfo(name, "29500", &hints, &res);
  if (res) freeaddrinfo(res);
  REQUIRE(g != 0);
  refused(std::string(name) + ":29500",
          std::string("cannot resolve '") + name + "': " + gai_strerror(g));
}

TEST_CASE("rendezvous: rank 0 listens on the IPv6 address given, clients meet over IPv6",
          "[perf_rdv]") {
  const std::string why = no_ipv6_loopback();
  if (!why.empty()) {
    WARN("SKIPPED: no IPv6 loopback (::1) on this host (" << why << ")");
    return;
  }
  RdvAddress a = parsed("[::1]:29500");
  a.port = 0;  // any free port (the parser refuses 0: ranks on other hosts must know it)
  r2perf::RdvServer server;
  server.listen(a);
  REQUIRE(server.port() > 0);
  a.port = server.port();
  // The listener is an IPv6 socket on ::1 itself: not 0.0.0.0, not [::].
  sockaddr_in6 bound{};
  socklen_t len = sizeof(bound);
  REQUIRE(getsockname(server.fd(), reinterpret_cast<sockaddr*>(&bound), &len) == 0);
  CHECK(bound.sin6_family == AF_INET6);
  CHECK(memcmp(&bound.sin6_addr, &in6addr_loopback, sizeof(in6_addr)) == 0);
  CHECK_FALSE(tcp_connects(AF_INET, "127.0.0.1", a.port));
  server.start(2);

  std::vector<std::string> got0, got1;
  std::string err1;
  std::thread t1([&] {
    try {
      r2perf::RdvClient c;
      c.connect(a, 1, 2, 30);
      got1 = c.allgather("one");
      c.close();
    } catch (const std::exception& e) {
      err1 = e.what();
    }
  });
  r2perf::RdvClient c0;
  c0.connect(a, 0, 2, 30);
  got0 = c0.allgather("zero");
  t1.join();
  c0.close();
  CHECK(err1.empty());
  CHECK(got0 == std::vector<std::string>{"zero", "one"});
  CHECK(got1 == got0);
  CHECK(server.wait(30));
}

TEST_CASE("rendezvous: a host name with an IPv6 address is served on both families", "[perf_rdv]") {
  const std::string why = no_ipv6_loopback();
  if (!why.empty()) {
    WARN("SKIPPED: no IPv6 loopback (::1) on this host (" << why << ")");
    return;
  }
  // "ip6-localhost" or "localhost" resolve to ::1 on most hosts; either will do.
  std::string name;
  for (const char* n : {"localhost", "ip6-localhost", "ip6-loopback"}) {
    addrinfo hints{};
    hints.ai_family = AF_INET6;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(n, "1", &hints, &res) == 0) {
      freeaddrinfo(res);
      name = n;
      break;
    }
  }
  if (name.empty()) {
    WARN("SKIPPED: no host name resolves to ::1 here (/etc/hosts)");
    return;
  }
  RdvAddress a = parsed(name + ":29500");
  CHECK(a.kind == Kind::kName);
  a.port = 0;
  r2perf::RdvServer server;
  server.listen(a);
  INFO(name << " port " << server.port());
  CHECK(tcp_connects(AF_INET6, "::1", server.port()));
  CHECK(tcp_connects(AF_INET, "127.0.0.1", server.port()));
}

TEST_CASE("rendezvous: an IPv4 address is served on every IPv4 address", "[perf_rdv]") {
  RdvAddress a = parsed("127.0.0.2:29500");
  a.port = 0;
  r2perf::RdvServer server;
  server.listen(a);
  CHECK(tcp_connects(AF_INET, "127.0.0.1", server.port()));
  CHECK(tcp_connects(AF_INET, "127.0.0.2", server.port()));
}
