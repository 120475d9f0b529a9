// The errno classification (net_plugin/sock/sock_errors.h): which socket errors setup retries,
// which it retries only briefly, which fail it at once, and the limits the messages name.
#include <catch2/catch.hpp>

#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "sock/sock_errors.h"
#include "sock/socket_util.h"

using namespace r2ccl::net;

TEST_CASE("transient errors: the network or the peer may heal them", "[sock_errors]") {
  // A link flap, a route coming back, a reset, a slow answer, kernel memory pressure.
  for (int e : {EHOSTUNREACH, ENETUNREACH, ENETDOWN, EHOSTDOWN, ETIMEDOUT, ECONNRESET, EPIPE,
                ECONNABORTED, ENOBUFS, ENOMEM, EINTR, EAGAIN}) {
    INFO(strerror(e));
    CHECK(classify_errno(e, SockOp::kConnect) == ErrClass::kTransient);
    CHECK(classify_errno(e, SockOp::kIo) == ErrClass::kTransient);
  }
  // The rail's address is not assigned (being renumbered): bind fails until it is back.
  CHECK(classify_errno(EADDRNOTAVAIL, SockOp::kBind) == ErrClass::kTransient);
}

TEST_CASE("a refused connect is transient only for a bounded time", "[sock_errors]") {
  CHECK(classify_errno(ECONNREFUSED, SockOp::kConnect) == ErrClass::kBounded);
  CHECK(kRefusedGrace > 0);
  CHECK(kRefusedGrace <= 1000 * r2ccl::kUsPerMs);  // a closed listen comm fails within 2 s
}

TEST_CASE("permanent errors: local limits, permissions, configuration", "[sock_errors]") {
  for (SockOp op : {SockOp::kSocket, SockOp::kBind, SockOp::kConnect, SockOp::kAccept}) {
    INFO(sock_op_name(op));
    CHECK(classify_errno(EMFILE, op) == ErrClass::kPermanent);
    CHECK(classify_errno(ENFILE, op) == ErrClass::kPermanent);
    CHECK(classify_errno(EACCES, op) == ErrClass::kPermanent);
    CHECK(classify_errno(EPERM, op) == ErrClass::kPermanent);
  }
  // No ephemeral port left: at bind (without IP_BIND_ADDRESS_NO_PORT) and at connect.
  CHECK(classify_errno(EADDRINUSE, SockOp::kBind) == ErrClass::kPermanent);
  CHECK(classify_errno(EADDRINUSE, SockOp::kConnect) == ErrClass::kPermanent);
  CHECK(classify_errno(EADDRNOTAVAIL, SockOp::kConnect) == ErrClass::kPermanent);
  CHECK(classify_errno(EAFNOSUPPORT, SockOp::kSocket) == ErrClass::kPermanent);
  CHECK(classify_errno(EPROTO, SockOp::kIo) == ErrClass::kPermanent);
}

TEST_CASE("an errno the table does not name is transient (bounded by the connect timeout)",
          "[sock_errors]") {
  CHECK(classify_errno(EXDEV, SockOp::kConnect) == ErrClass::kTransient);
  CHECK(classify_errno(0x7fff, SockOp::kIo) == ErrClass::kTransient);
}

TEST_CASE("messages name the limit involved, with its current values", "[sock_errors]") {
  rlimit rl{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  const std::string emfile = describe_errno(EMFILE, SockOp::kSocket);
  INFO(emfile);
  CHECK(emfile.find(strerror(EMFILE)) != std::string::npos);
  CHECK(emfile.find("RLIMIT_NOFILE soft " + std::to_string(rl.rlim_cur)) != std::string::npos);
  CHECK(nofile_limit_text().find("hard ") != std::string::npos);

  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  long lo = 0, hi = 0;
  if (f >> lo >> hi) {
    for (int e : {EADDRNOTAVAIL, EADDRINUSE}) {
      const std::string port = describe_errno(e, SockOp::kConnect);
      INFO(port);
      CHECK(port.find(strerror(e)) != std::string::npos);
      CHECK(port.find("net.ipv4.ip_local_port_range " + std::to_string(lo) + " " +
                      std::to_string(hi)) != std::string::npos);
    }
  }
  // No limit for an error that has none; and a renumbered address is not a port shortage.
  CHECK(describe_errno(EHOSTUNREACH, SockOp::kConnect) == strerror(EHOSTUNREACH));
  CHECK(describe_errno(EADDRNOTAVAIL, SockOp::kBind).find("port") == std::string::npos);
  CHECK(describe_errno(ENFILE, SockOp::kAccept).find("fs.file-max") != std::string::npos);
}

TEST_CASE("first_time says yes once per key", "[sock_errors]") {
  CHECK(first_time("test_sock_errors: a"));
  CHECK_FALSE(first_time("test_sock_errors: a"));
  CHECK(first_time("test_sock_errors: b"));
}

TEST_CASE("a rail socket that cannot be opened keeps its errno and names the limit",
          "[sock_errors]") {
  // EMFILE at socket() was reported as ENETDOWN ("Network is down") and retried until the
  // connect timeout; it must stay EMFILE, from socket(), with RLIMIT_NOFILE in the message.
  Rail rail;
  rail.ifname = "lo";
  rail.name = "lo@127.0.0.1";
  rail.family = AF_INET;
  auto* a = reinterpret_cast<sockaddr_in*>(&rail.addr);
  a->sin_family = AF_INET;
  a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  rail.addrlen = sizeof(sockaddr_in);
  int top = 0;
  DIR* d = opendir("/proc/self/fd");
  REQUIRE(d);
  while (dirent* e = readdir(d)) top = std::max(top, atoi(e->d_name) + 1);
  closedir(d);
  rlimit saved{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &saved) == 0);
  // Every descriptor below the new soft limit is taken: the next socket() fails.
  std::vector<int> filler;
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(top + 2);
  REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
  for (int fd; (fd = dup(0)) >= 0;) filler.push_back(fd);
  SockFailure why;
  const int fd = open_rail_socket(rail, 0, &why);
  for (int f : filler) close(f);
  REQUIRE(setrlimit(RLIMIT_NOFILE, &saved) == 0);
  if (fd >= 0) close(fd);
  INFO(why.text);
  CHECK(fd < 0);
  CHECK(why.err == EMFILE);
  CHECK(why.op == SockOp::kSocket);
  CHECK(classify_errno(why.err, why.op) == ErrClass::kPermanent);
  CHECK(why.text.find("lo@127.0.0.1") != std::string::npos);
  CHECK(why.text.find("RLIMIT_NOFILE soft " + std::to_string(top + 2)) != std::string::npos);
}
