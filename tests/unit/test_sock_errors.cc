// The errno classification (net_plugin/sock/sock_errors.h): which socket errors setup retries,
// which it retries only briefly, which fail it at once, and the limits the messages name.
#include <catch2/catch.hpp>

#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
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

using namespace r2ccl;
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

// Takes every descriptor the process may open: the soft RLIMIT_NOFILE is lowered to just
// above the highest open descriptor and the rest is filled with dup(0). release() (or the
// destructor) gives them back and restores the limit.
struct NoFreeDescriptors {
  NoFreeDescriptors() {
    int top = 0;
    DIR* d = opendir("/proc/self/fd");
    REQUIRE(d);
    while (dirent* e = readdir(d)) top = std::max(top, atoi(e->d_name) + 1);
    closedir(d);
    REQUIRE(getrlimit(RLIMIT_NOFILE, &saved) == 0);
    rlimit low = saved;
    soft = top + 2;
    low.rlim_cur = static_cast<rlim_t>(soft);
    REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
    for (int fd; (fd = dup(0)) >= 0;) filler.push_back(fd);
  }
  ~NoFreeDescriptors() { release(); }
  void release() {
    for (int f : filler) close(f);
    filler.clear();
    if (soft) setrlimit(RLIMIT_NOFILE, &saved);
    soft = 0;
  }
  int soft = 0;  // the soft limit while they are taken
  rlimit saved{};
  std::vector<int> filler;
};

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
  // Every descriptor below the new soft limit is taken: the next socket() fails.
  NoFreeDescriptors none;
  const int soft = none.soft;
  SockFailure why;
  const int fd = open_rail_socket(rail, 0, &why);
  none.release();
  if (fd >= 0) close(fd);
  INFO(why.text);
  CHECK(fd < 0);
  CHECK(why.err == EMFILE);
  CHECK(why.op == SockOp::kSocket);
  CHECK(classify_errno(why.err, why.op) == ErrClass::kPermanent);
  CHECK(why.text.find("lo@127.0.0.1") != std::string::npos);
  CHECK(why.text.find("RLIMIT_NOFILE soft " + std::to_string(soft)) != std::string::npos);
}

TEST_CASE("an accept gate: a shortage that lasts 1.5 s is starved, one that ends is not",
          "[sock_errors]") {
  const TimeUs ms = kUsPerMs;
  const TimeUs t0 = 1000 * kUsPerSec;
  AcceptGate g;
  // Nothing waits (EAGAIN) or another error: no pause, no shortage.
  CHECK_FALSE(g.on_error(EAGAIN, "rail lo", t0));
  CHECK_FALSE(g.on_error(ECONNABORTED, "rail lo", t0));
  CHECK_FALSE(g.paused(t0));
  CHECK_FALSE(g.starved(t0 + 10 * kUsPerSec));
  // Out of descriptors: paused for kAcceptPause, starved only after kAcceptStarvedLimit.
  CHECK(g.on_error(EMFILE, "rail lo", t0));
  CHECK(g.paused(t0 + kAcceptPause - 1));
  CHECK_FALSE(g.paused(t0 + kAcceptPause));
  for (TimeUs t = t0 + 100 * ms; t < t0 + kAcceptStarvedLimit; t += 100 * ms) {
    CHECK_FALSE(g.starved(t));
    CHECK(g.on_error(EMFILE, "rail lo", t));
    // EAGAIN in between (the waiting connector gave up) does not end the shortage.
    CHECK_FALSE(g.on_error(EAGAIN, "rail lo", t + 50 * ms));
  }
  CHECK(g.starved(t0 + kAcceptStarvedLimit));
  CHECK(g.starved_text(t0 + kAcceptStarvedLimit).find("RLIMIT_NOFILE soft") != std::string::npos);
  CHECK(g.starved_text(t0 + kAcceptStarvedLimit).find("for 1.5 s") != std::string::npos);
  // An accept() that began after the latest failure has not seen the shortage yet.
  CHECK(g.starved(t0 + kAcceptStarvedLimit, t0 + 1400 * ms));
  CHECK_FALSE(g.starved(t0 + kAcceptStarvedLimit, t0 + 1450 * ms));
  // While the latest accept4 succeeded, nothing waits for a descriptor.
  g.on_accepted(t0 + kAcceptStarvedLimit);
  CHECK_FALSE(g.starved(t0 + kAcceptStarvedLimit));
  // Failures less than kAcceptStarvedLimit apart stay one shortage, with accepts that
  // succeed in between for less than kAcceptRecovered: a connector that gave up on a stream
  // closed it, the listener's end of it freed one descriptor, and the next waiting connection
  // took it. (Seen on loaded machines: each such accept restarted the clock, and the refusal
  // came 2-3 s late.)
  CHECK(g.on_error(EMFILE, "rail lo", t0 + kAcceptStarvedLimit + 50 * ms));
  CHECK(g.starved(t0 + kAcceptStarvedLimit + 50 * ms));
  CHECK(g.starved_text(t0 + kAcceptStarvedLimit + 50 * ms).find("for 1.6 s") != std::string::npos);
  // A failure more than kAcceptStarvedLimit after the previous one starts a new shortage.
  CHECK(g.on_error(ENFILE, "rail lo", t0 + 4 * kUsPerSec));
  CHECK_FALSE(g.starved(t0 + 5 * kUsPerSec));
  CHECK(g.starved(t0 + 4 * kUsPerSec + kAcceptStarvedLimit));
  // Accepts that succeed for longer than that end it too: the gap between failures counts.
  AcceptGate k;
  CHECK(k.on_error(EMFILE, "rail lo", t0));
  k.on_accepted(t0 + 50 * ms);
  CHECK(k.on_error(EMFILE, "rail lo", t0 + 100 * ms));
  CHECK(k.on_error(EMFILE, "rail lo", t0 + 1200 * ms));
  k.on_accepted(t0 + 1300 * ms);
  k.on_accepted(t0 + 1400 * ms);
  CHECK(k.on_error(EMFILE, "rail lo", t0 + 2800 * ms));  // 1.6 s after the last failure
  CHECK_FALSE(k.starved(t0 + 2800 * ms));
  CHECK(k.starved(t0 + 2800 * ms + kAcceptStarvedLimit));
  // A process that makes progress is not starved: one failure a second, each followed by
  // accepts that keep succeeding for kAcceptRecovered or longer (it frees descriptors as it
  // goes). Each failure starts a new shortage.
  AcceptGate p;
  for (int i = 0; i < 6; ++i) {
    const TimeUs f = t0 + i * kUsPerSec;
    CHECK(p.on_error(EMFILE, "rail lo", f));
    CHECK_FALSE(p.starved(f));
    for (int j = 1; j <= 9; ++j) p.on_accepted(f + j * 100 * ms);
  }
  // A success and a failure in the same pass (the queue still holds more) recover nothing.
  AcceptGate q;
  for (TimeUs t = t0; t <= t0 + kAcceptStarvedLimit; t += 200 * ms) {
    q.on_accepted(t);
    CHECK(q.on_error(EMFILE, "rail lo", t));
  }
  CHECK(q.starved(t0 + 1600 * ms));
  CHECK(g.starved_text(t0 + 2 * kUsPerSec + kAcceptStarvedLimit).find("fs.file-max") !=
        std::string::npos);
  // Failures further apart than the limit are separate shortages (verbs: one per accept()).
  AcceptGate h;
  CHECK(h.on_error(EMFILE, "rail lo", t0));
  CHECK(h.on_error(EMFILE, "rail lo", t0 + kAcceptStarvedLimit + 1));
  CHECK_FALSE(h.starved(t0 + kAcceptStarvedLimit + 2));
}

TEST_CASE("the spare descriptor lets a listener out of descriptors refuse a waiting connection",
          "[sock_errors]") {
  keep_spare_descriptor();
  const int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(lfd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(listen(lfd, 8) == 0);
  socklen_t al = sizeof(a);
  REQUIRE(getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &al) == 0);
  const int cfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(cfd >= 0);
  REQUIRE(connect(cfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  const char hello[] = "a hello the listener never reads";
  REQUIRE(send(cfd, hello, sizeof(hello), 0) == static_cast<ssize_t>(sizeof(hello)));
  // No descriptor is free: accept4 fails; the spare still takes the connection.
  NoFreeDescriptors none;
  const int direct = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
  const int direct_err = errno;
  const char refusal[] = "refused: out of descriptors";
  const bool refused = refuse_with_spare(lfd, refusal, sizeof(refusal));
  const bool again = refuse_with_spare(lfd, refusal, sizeof(refusal));  // nothing waits now
  const int after = dup(0);  // the spare was reopened: still no descriptor free
  const size_t filled = none.filler.size();
  none.release();
  if (after >= 0) close(after);
  INFO("filled " << filled << ", direct " << direct);
  CHECK(direct < 0);
  CHECK(direct_err == EMFILE);
  CHECK(refused);
  CHECK_FALSE(again);
  CHECK(after < 0);
  // The connector reads the refusal, then an orderly end (not a reset). Bounded: a refusal
  // that never came fails the checks instead of hanging.
  timeval tv{5, 0};
  setsockopt(cfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[64] = {};
  size_t got = 0;
  for (ssize_t n; got < sizeof(buf) && (n = recv(cfd, buf + got, sizeof(buf) - got, 0)) > 0;)
    got += static_cast<size_t>(n);
  CHECK(got == sizeof(refusal));
  CHECK(std::string(buf) == refusal);
  close(cfd);
  close(lfd);
}
