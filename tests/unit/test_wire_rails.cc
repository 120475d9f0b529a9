// Wire layout facts, rail selection (parse_rail_spec, select_rails on made-up interface
// lists, same_subnet) and the fault-injection schedule (parse_fault_specs, FaultInjector).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "fault/fault_injector.h"
#include "r2ccl/clock.h"
#include "sock/rails.h"
#include "sock/socket_util.h"
#include "transport/tcp/wire.h"

using Catch::Matchers::Contains;
using r2ccl::kUsPerMs;
using r2ccl::kUsPerSec;
using r2ccl::TimeUs;
using namespace r2ccl::net;
using namespace r2ccl::net::tcp;

namespace {

sockaddr_storage make_addr(const char* text) {
  sockaddr_storage ss;
  std::memset(&ss, 0, sizeof(ss));
  auto* a4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, text, &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
  } else {
    REQUIRE(inet_pton(AF_INET6, text, &a6->sin6_addr) == 1);
    a6->sin6_family = AF_INET6;
  }
  return ss;
}

IfAddr iface(const char* name, int index, bool up, const char* addr, int prefix) {
  IfAddr a;
  a.ifname = name;
  a.ifindex = index;
  a.up = up;
  a.addr = make_addr(addr);
  a.family = a.addr.ss_family;
  a.prefix_len = prefix;
  return a;
}

// A host as system_interfaces() would report it (sorted by name, IPv4 first).
std::vector<IfAddr> host() {
  return {
      iface("docker0", 5, true, "172.17.0.1", 16),
      iface("eth0", 2, true, "10.0.0.1", 24),
      iface("eth01", 9, true, "10.9.0.1", 24),
      iface("eth1", 3, false, "10.0.1.1", 24),  // down
      iface("eth2", 4, true, "10.0.2.1", 24),
      iface("eth2", 4, true, "fd00::2", 64),
      iface("ib0", 6, true, "192.168.0.1", 16),
      iface("lo", 1, true, "127.0.0.1", 8),
      iface("virbr0", 7, true, "192.168.122.1", 24),
  };
}

std::vector<std::string> names(const std::vector<Rail>& rails) {
  std::vector<std::string> v;
  for (const auto& r : rails) v.push_back(r.name);
  return v;
}

constexpr int kSpeed = 25000;  // override: keeps the tests independent of this host's sysfs

std::vector<Rail> select_ok(const std::string& spec) {
  std::vector<Rail> rails;
  std::string err;
  INFO("spec '" << spec << "'");
  REQUIRE(select_rails(spec, "R2CCL_SOCKET_IFNAME", host(), kSpeed, &rails, &err));
  for (size_t i = 0; i < rails.size(); ++i) {
    CHECK(rails[i].index == static_cast<int>(i));
    CHECK(rails[i].speed_mbps == kSpeed);
  }
  return rails;
}

RailSpec parse_ok(const std::string& spec) {
  RailSpec s;
  std::string err;
  INFO("spec '" << spec << "'");
  REQUIRE(parse_rail_spec(spec, &s, &err));
  return s;
}

bool subnet(const char* a, int pa, const char* b, int pb) {
  sockaddr_storage x = make_addr(a), y = make_addr(b);
  return same_subnet(x.ss_family, addr_bytes(x), pa, y.ss_family, addr_bytes(y), pb);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Wire layout.

TEST_CASE("wire structures have their fixed layout", "[wire]") {
  STATIC_REQUIRE(sizeof(WireHandle) <= 128);
  STATIC_REQUIRE(sizeof(WireHandle) <= NCCL_NET_HANDLE_MAXSIZE);
  STATIC_REQUIRE(sizeof(FrameHeader) == 40);
  STATIC_REQUIRE(sizeof(WireEndpoint) == 20);
  STATIC_REQUIRE(sizeof(WireRail) == 48);
  STATIC_REQUIRE(sizeof(HelloBody) == 80 + 48 * kMaxRails);
  STATIC_REQUIRE(offsetof(FrameHeader, len) == 4);
  STATIC_REQUIRE(offsetof(FrameHeader, seq) == 8);
  STATIC_REQUIRE(offsetof(FrameHeader, b) == 36);
  STATIC_REQUIRE(kMaxPaths == 4);
  // The largest chunk (R2CCL_CHUNK_SIZE max) fits a frame.
  STATIC_REQUIRE(kMaxFramePayload == 64u * 1024 * 1024);
}

// ---------------------------------------------------------------------------------------
// parse_rail_spec.

TEST_CASE("rail specs in NCCL syntax parse", "[rails]") {
  RailSpec s = parse_ok("eth");
  CHECK_FALSE(s.exclude);
  CHECK_FALSE(s.exact);
  REQUIRE(s.entries.size() == 1);
  CHECK(s.entries[0].name == "eth");
  CHECK(s.entries[0].addr.empty());

  s = parse_ok("^docker,lo");
  CHECK(s.exclude);
  CHECK_FALSE(s.exact);
  REQUIRE(s.entries.size() == 2);
  CHECK(s.entries[0].name == "docker");
  CHECK(s.entries[1].name == "lo");

  s = parse_ok("=eth0");
  CHECK(s.exact);
  CHECK_FALSE(s.exclude);
  REQUIRE(s.entries.size() == 1);
  CHECK(s.entries[0].name == "eth0");

  s = parse_ok("lo@127.0.0.1,lo@127.0.0.2");
  REQUIRE(s.entries.size() == 2);
  CHECK(s.entries[0].name == "lo");
  CHECK(s.entries[0].addr == "127.0.0.1");
  CHECK(s.entries[1].addr == "127.0.0.2");

  s = parse_ok("eth0@fe80::1");
  REQUIRE(s.entries.size() == 1);
  CHECK(s.entries[0].name == "eth0");
  CHECK(s.entries[0].addr == "fe80::1");

  CHECK(parse_ok("").entries.empty());
  CHECK(parse_ok("eth,,ib").entries.size() == 2);  // empty entries are skipped
}

TEST_CASE("bad rail specs fail with a message", "[rails]") {
  for (const char* bad : {"@1.2.3.4", "lo@", "lo@notanip", "^lo@1.2.3.4", "eth0@1.2.3.4.5",
                          "averyveryverylongifname"}) {
    INFO("spec '" << bad << "'");
    RailSpec s;
    std::string err;
    CHECK_FALSE(parse_rail_spec(bad, &s, &err));
    CHECK_FALSE(err.empty());
  }
  RailSpec s;
  std::string err;
  REQUIRE_FALSE(parse_rail_spec("lo@", &s, &err));
  CHECK_THAT(err, Contains("accepted"));
  REQUIRE_FALSE(parse_rail_spec("lo@notanip", &s, &err));
  CHECK_THAT(err, Contains("notanip"));
}

// ---------------------------------------------------------------------------------------
// select_rails.

TEST_CASE("auto-detection skips lo, docker*, virbr* and down interfaces", "[rails]") {
  auto rails = select_ok("");
  CHECK(names(rails) == std::vector<std::string>{"eth0", "eth01", "eth2", "ib0"});
  // One rail per interface: eth2's first (IPv4) address.
  const Rail& eth2 = rails[2];
  CHECK(eth2.ifname == "eth2");
  CHECK(eth2.ifindex == 4);
  CHECK(eth2.family == AF_INET);
  CHECK(addr_to_string(eth2.addr) == "10.0.2.1");
  CHECK(eth2.addrlen == sizeof(sockaddr_in));
  CHECK(eth2.prefix_len == 24);
}

TEST_CASE("a prefix spec selects matching interfaces that are up, in spec order", "[rails]") {
  CHECK(names(select_ok("eth")) == std::vector<std::string>{"eth0", "eth01", "eth2"});
  CHECK(names(select_ok("ib,eth2")) == std::vector<std::string>{"ib0", "eth2"});
  // A prefix spec may select lo and docker explicitly.
  CHECK(names(select_ok("lo,docker")) == std::vector<std::string>{"lo", "docker0"});
  // Naming an interface twice gives it once.
  CHECK(names(select_ok("eth0,eth0")) == std::vector<std::string>{"eth0", "eth01"});
}

TEST_CASE("a '^' spec excludes prefixes from the auto-detected set", "[rails]") {
  CHECK(names(select_ok("^eth")) == std::vector<std::string>{"ib0"});
  CHECK(names(select_ok("^ib,eth0")) == std::vector<std::string>{"eth2"});
  // "^=" excludes exact names only: eth01 stays.
  CHECK(names(select_ok("^=eth0,ib")) == std::vector<std::string>{"eth01", "eth2", "ib0"});
}

TEST_CASE("a '=' spec matches names exactly", "[rails]") {
  CHECK(names(select_ok("=eth0")) == std::vector<std::string>{"eth0"});
  CHECK(names(select_ok("=eth2,ib0")) == std::vector<std::string>{"eth2", "ib0"});
  std::vector<Rail> rails;
  std::string err;
  CHECK_FALSE(select_rails("=eth", "R2CCL_SOCKET_IFNAME", host(), kSpeed, &rails, &err));
}

TEST_CASE("IFNAME@ADDR rails bind to the given address", "[rails]") {
  auto rails = select_ok("lo@127.0.0.1,lo@127.0.0.2");
  REQUIRE(names(rails) == std::vector<std::string>{"lo@127.0.0.1", "lo@127.0.0.2"});
  for (const Rail& r : rails) {
    CHECK(r.ifname == "lo");
    CHECK(r.ifindex == 1);
    CHECK(r.family == AF_INET);
    CHECK(r.prefix_len == 8);  // inside lo's 127.0.0.0/8
  }
  CHECK(addr_to_string(rails[1].addr) == "127.0.0.2");

  SECTION("an address outside the interface's subnets gets a host prefix") {
    auto r = select_ok("eth0@192.168.77.5");
    REQUIRE(r.size() == 1);
    CHECK(r[0].name == "eth0@192.168.77.5");
    CHECK(r[0].prefix_len == 32);
  }
  SECTION("IPv6 address rail") {
    auto r = select_ok("eth2@fd00::77");
    REQUIRE(r.size() == 1);
    CHECK(r[0].family == AF_INET6);
    CHECK(r[0].addrlen == sizeof(sockaddr_in6));
    CHECK(r[0].prefix_len == 64);
    CHECK(addr_to_string(r[0].addr) == "fd00::77");
  }
}

TEST_CASE("a spec that matches nothing fails naming the variable and the interfaces", "[rails]") {
  std::vector<Rail> rails;
  std::string err;
  CHECK_FALSE(select_rails("mlx", "NCCL_SOCKET_IFNAME", host(), kSpeed, &rails, &err));
  CHECK(rails.empty());
  CHECK_THAT(err, Contains("NCCL_SOCKET_IFNAME='mlx'"));
  CHECK_THAT(err, Contains("eth0"));
  CHECK_THAT(err, Contains("eth1 (down)"));
  CHECK_THAT(err, Contains("virbr0"));

  // Only a down interface matches.
  err.clear();
  CHECK_FALSE(select_rails("eth1", "R2CCL_SOCKET_IFNAME", host(), kSpeed, &rails, &err));
  CHECK_THAT(err, Contains("R2CCL_SOCKET_IFNAME"));

  // Auto-detection on a host with only lo and docker.
  std::vector<IfAddr> bare = {iface("docker0", 2, true, "172.17.0.1", 16),
                              iface("lo", 1, true, "127.0.0.1", 8)};
  err.clear();
  CHECK_FALSE(select_rails("", "R2CCL_SOCKET_IFNAME", bare, kSpeed, &rails, &err));
  CHECK_THAT(err, Contains("R2CCL_SOCKET_IFNAME"));
  CHECK_THAT(err, Contains("docker0"));
  CHECK_THAT(err, Contains("lo"));

  // A malformed spec is reported with the variable too.
  err.clear();
  CHECK_FALSE(select_rails("lo@bad", "R2CCL_SOCKET_IFNAME", host(), kSpeed, &rails, &err));
  CHECK_THAT(err, Contains("R2CCL_SOCKET_IFNAME='lo@bad'"));
}

TEST_CASE("an IFNAME@ADDR rail whose address does not parse is rejected with the accepted form",
          "[rails]") {
  // The address is checked before any interface is matched: a matching interface (eth0, lo,
  // eth2) must not turn a bad address into a rail bound to an unset address, and a good entry
  // before the bad one does not make the spec pass.
  for (const char* var : {"R2CCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}) {
    for (const char* spec : {"eth0@10.0.0.300", "lo@127.0.0.1,lo@127.0.0.x", "eth2@fd00::zz",
                             "=eth0@eth0", "eth2@fd00::2%eth2"}) {
      INFO(var << "='" << spec << "'");
      std::vector<Rail> rails;
      std::string err;
      CHECK_FALSE(select_rails(spec, var, host(), kSpeed, &rails, &err));
      CHECK(rails.empty());
      CHECK_THAT(err, Contains(std::string(var) + "='" + spec + "'"));
      CHECK_THAT(err, Contains("bad address"));
      CHECK_THAT(err, Contains("IFNAME@ADDR with an IPv4 or IPv6 address"));
    }
  }
  // The address that failed is named.
  std::vector<Rail> rails;
  std::string err;
  CHECK_FALSE(select_rails("lo@127.0.0.1,lo@127.0.0.x", "NCCL_SOCKET_IFNAME", host(), kSpeed,
                           &rails, &err));
  CHECK_THAT(err, Contains("'127.0.0.x'"));
  CHECK_THAT(err, !Contains("'127.0.0.1'"));
}

TEST_CASE("same_subnet compares under the shorter prefix", "[rails]") {
  CHECK(subnet("10.0.0.1", 24, "10.0.0.200", 24));
  CHECK_FALSE(subnet("10.0.0.1", 24, "10.0.1.1", 24));
  CHECK(subnet("10.0.0.1", 24, "10.0.1.1", 16));  // /16 decides
  CHECK(subnet("10.0.1.1", 16, "10.0.0.1", 24));  // symmetric
  CHECK(subnet("10.0.0.1", 23, "10.0.1.1", 24));  // bit-level prefix
  CHECK_FALSE(subnet("10.0.0.1", 25, "10.0.0.129", 25));
  CHECK(subnet("1.2.3.4", 0, "200.1.1.1", 0));
  CHECK_FALSE(subnet("10.0.0.1", 32, "10.0.0.2", 32));

  CHECK(subnet("2001:db8::1", 64, "2001:db8::ffff", 64));
  CHECK_FALSE(subnet("2001:db8::1", 64, "2001:db8:0:1::1", 64));
  CHECK(subnet("2001:db8::1", 48, "2001:db8:0:1::1", 64));
  CHECK_FALSE(subnet("2001:db8::1", 128, "2001:db8::2", 128));

  CHECK_FALSE(subnet("10.0.0.1", 0, "::1", 0));  // families differ
}

// ---------------------------------------------------------------------------------------
// Fault injection.

TEST_CASE("fault specs parse", "[fault]") {
  std::vector<FaultSpec> v;
  std::string err;
  REQUIRE(parse_fault_specs("rail=0,at=100,kind=reset", &v, &err));
  REQUIRE(v.size() == 1);
  CHECK(v[0].rank == -1);
  CHECK(v[0].rail == 0);
  CHECK(v[0].at == 100 * kUsPerMs);
  CHECK(v[0].kind == FaultSpec::Kind::kReset);
  CHECK(v[0].duration == 0);

  REQUIRE(parse_fault_specs("rank=1,rail=2,at=0,kind=delay:5,for=300;rail=15,at=7,kind=blackhole;",
                            &v, &err));
  REQUIRE(v.size() == 2);
  CHECK(v[0].rank == 1);
  CHECK(v[0].rail == 2);
  CHECK(v[0].at == 0);
  CHECK(v[0].kind == FaultSpec::Kind::kDelay);
  CHECK(v[0].delay == 5 * kUsPerMs);
  CHECK(v[0].duration == 300 * kUsPerMs);
  CHECK(v[1].rail == 15);
  CHECK(v[1].kind == FaultSpec::Kind::kBlackhole);

  REQUIRE(parse_fault_specs("", &v, &err));
  CHECK(v.empty());
}

TEST_CASE("bad fault specs fail with the accepted form", "[fault]") {
  const char* bad[] = {
      "at=0,kind=reset",                    // no rail
      "rail=0,kind=reset",                  // no at
      "rail=0,at=0",                        // no kind
      "rail=0,at=0,kind=explode",           // unknown kind
      "rail=0,at=0,kind=delay:",            // delay without value
      "rail=0,at=0,kind=delay:0",           // zero delay
      "rail=0,at=-5,kind=reset",            // negative time
      "rail=-1,at=0,kind=reset",            // negative rail
      "rail=16,at=0,kind=reset",            // beyond the rail limit
      "rank=-2,rail=0,at=0,kind=reset",     // bad rank
      "rail=0,at=0,kind=reset,for=0",       // zero duration
      "rail=0,at=0,kind=reset,for=-10",     // negative duration
      "rail=0,at=10ms,kind=reset",          // units are not accepted
      "rail=0,at=0,kind=reset,color=blue",  // unknown key
      "rail=0 at=0 kind=reset",             // not key=value pairs
      "rail=0,at=0,kind=reset;rail=1",      // second entry incomplete
      // Numbers beyond the accepted ranges, which a bare strtoll would wrap or truncate:
      "rail=0,at=99999999999999999999,kind=reset",            // overflows long long
      "rail=0,at=9300000000000000,kind=reset",                // at * 1000 overflows
      "rank=4294967296,rail=0,at=0,kind=reset",               // truncated to rank 0
      "rail=0,at=0,kind=blackhole,for=99999999999999999999",  // overflows
      "rail=0,at=0,kind=delay:99999999999999,for=10",         // delay overflows
      "rail=0,rail=1,at=0,kind=reset",                        // a key twice
  };
  for (const char* s : bad) {
    INFO("spec '" << s << "'");
    std::vector<FaultSpec> v;
    std::string err;
    CHECK_FALSE(parse_fault_specs(s, &v, &err));
    CHECK_THAT(err, Contains("accepted"));
    CHECK_THAT(err, Contains("R2CCL_FAULT_INJECT"));
  }
}

TEST_CASE("a fault spec's error names what is missing, and the accepted ranges", "[fault]") {
  std::vector<FaultSpec> v;
  std::string err;
  CHECK_FALSE(parse_fault_specs("rank=0,rail=0,at=10", &v, &err));
  CHECK_THAT(err, Contains("needs kind"));
  CHECK_FALSE(parse_fault_specs("kind=reset", &v, &err));
  CHECK_THAT(err, Contains("needs rail and at"));
  CHECK_FALSE(parse_fault_specs("rail=0,at=86400001,kind=reset", &v, &err));
  CHECK_THAT(err, Contains("at=86400001"));
  CHECK_THAT(err, Contains("[0, 86400000]"));
  CHECK_FALSE(parse_fault_specs("rail=0,rail=1,at=0,kind=reset", &v, &err));
  CHECK_THAT(err, Contains("'rail' given twice"));
  // The largest accepted values parse exactly.
  REQUIRE(parse_fault_specs("rank=2147483647,rail=15,at=86400000,kind=delay:60000,for=86400000", &v,
                            &err));
  CHECK(v[0].rank == 2147483647);
  CHECK(v[0].at == 86400000LL * kUsPerMs);
  CHECK(v[0].delay == 60000LL * kUsPerMs);
  CHECK(v[0].duration == 86400000LL * kUsPerMs);
}

// FaultInjector is a process singleton whose schedule starts once (arm() is one-shot), so the
// whole story is one test case. Times are bracketed around the real arm() instead of waited.
TEST_CASE("the fault injector is inactive before arm and follows its schedule after", "[fault]") {
  FaultInjector& inj = FaultInjector::instance();
  std::vector<FaultSpec> specs;
  std::string err;
  REQUIRE(
      parse_fault_specs("rank=0,rail=0,at=0,kind=reset;"
                        "rank=1,rail=1,at=0,kind=blackhole;"  // another rank
                        "rail=2,at=0,kind=blackhole,for=3600000;"
                        "rail=3,at=0,kind=delay:5;rail=3,at=0,kind=delay:7;"
                        "rail=4,at=1000,kind=reset,for=500",
                        &specs, &err));
  inj.configure(specs, /*my_rank=*/0);
  REQUIRE(inj.enabled());

  // Before arm(): nothing is in effect, whatever the time.
  const TimeUs far = r2ccl::now_us() + 3600 * kUsPerSec;
  for (int rail = 0; rail < 5; ++rail) {
    auto f = inj.query(rail, far);
    CHECK_FALSE(f.down);
    CHECK_FALSE(f.blackhole);
    CHECK(f.delay == 0);
    CHECK(f.reset_epoch == 0);
    CHECK(inj.last_start(rail, far) == 0);
  }

  const TimeUs before = r2ccl::now_us();
  inj.arm();
  const TimeUs after = r2ccl::now_us();
  REQUIRE(after - before < 400 * kUsPerMs);
  // A second arm does not restart the schedule. (Spin until the microsecond clock moves past
  // `after`, so a restarted schedule would begin after it and show below.)
  while (r2ccl::now_us() <= after) {
  }
  inj.arm();

  auto f0 = inj.query(0, after);
  CHECK(f0.down);
  CHECK(f0.reset_epoch == 1);
  CHECK_FALSE(f0.blackhole);
  CHECK(inj.last_start(0, after) >= before);
  CHECK(inj.last_start(0, after) <= after);

  CHECK_FALSE(inj.query(1, after).blackhole);  // rank 1's entry was filtered out

  CHECK(inj.query(2, after).blackhole);
  CHECK_FALSE(inj.query(2, after).down);
  CHECK(inj.query(3, after).delay == 12 * kUsPerMs);  // delays add up
  CHECK_FALSE(inj.query(5, after).down);

  // Rail 4: reset from t0 + 1 s to t0 + 1.5 s, with t0 in [before, after].
  CHECK_FALSE(inj.query(4, before + kUsPerSec - 1).down);
  CHECK(inj.query(4, before + kUsPerSec - 1).reset_epoch == 0);
  CHECK(inj.query(4, after + kUsPerSec).down);
  CHECK(inj.query(4, after + kUsPerSec).reset_epoch == 1);
  CHECK_FALSE(inj.query(4, after + 1500 * kUsPerMs).down);        // over...
  CHECK(inj.query(4, after + 1500 * kUsPerMs).reset_epoch == 1);  // ...but it happened

  // A configuration for another rank only: disabled.
  std::vector<FaultSpec> other;
  REQUIRE(parse_fault_specs("rank=3,rail=0,at=0,kind=reset", &other, &err));
  inj.configure(other, 0);
  CHECK_FALSE(inj.enabled());
  CHECK_FALSE(inj.query(0, after).down);
  inj.configure({}, 0);
}

namespace {
// lo as a rail at 127.0.0.1.
Rail loopback_rail() {
  Rail rail;
  rail.ifname = "lo";
  rail.name = "lo@127.0.0.1";
  rail.family = AF_INET;
  rail.addr = make_addr("127.0.0.1");
  rail.addrlen = sizeof(sockaddr_in);
  return rail;
}
}  // namespace

TEST_CASE("rail sockets bind their address without taking a port until connect", "[sock]") {
  // IP_BIND_ADDRESS_NO_PORT: the kernel picks the source port per 4-tuple at connect, so one
  // rail address is not limited to one ephemeral port range per host whatever the peer
  // (1,600 communicators to 4 peers stopped at 994 of a 1,000-port range without it).
  const Rail rail = loopback_rail();
  SockFailure why;
  const int fd = open_rail_socket(rail, 0, &why);
  INFO(why.text);
  REQUIRE(fd >= 0);
  int on = 0;
  socklen_t len = sizeof(on);
  REQUIRE(getsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &on, &len) == 0);
  CHECK(on == 1);
  sockaddr_storage local{};
  socklen_t ll = sizeof(local);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) == 0);
  CHECK(ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port) == 0);  // no port held yet
  // A connect still gets a port from the rail's address.
  std::string err;
  const int lfd = open_rail_listener(rail, &err);
  REQUIRE(lfd >= 0);
  sockaddr_storage la{};
  socklen_t lal = sizeof(la);
  REQUIRE(getsockname(lfd, reinterpret_cast<sockaddr*>(&la), &lal) == 0);
  REQUIRE(start_connect(fd, la) == 0);
  ll = sizeof(local);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) == 0);
  CHECK(ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port) != 0);
  CHECK(reinterpret_cast<sockaddr_in*>(&local)->sin_addr.s_addr == htonl(INADDR_LOOPBACK));
  close(fd);
  close(lfd);
}

TEST_CASE("a rail listener takes a burst of 1,024 connects without accepting any", "[sock]") {
  // NCCL opens its channels' connections to a peer at once: 512 send connections with 2
  // streams per path put 1,024 connects on each of the peer's rail listeners within
  // milliseconds, before its background thread accepts them. A SYN that finds the accept
  // queue full is dropped and retried only after the kernel's 1 s SYN timeout (a listen
  // backlog of 256 made 512 + 512 connections take 1.1 s and warn about paths not connected
  // at setup). The kernel caps the backlog at net.core.somaxconn (4096 by default since
  // Linux 5.4).
  constexpr int kConnects = 1024;
  long somaxconn = 0;
  if (FILE* f = fopen("/proc/sys/net/core/somaxconn", "r")) {
    if (fscanf(f, "%ld", &somaxconn) != 1) somaxconn = 0;
    fclose(f);
  }
  if (somaxconn < kConnects) {
    WARN("skipped: net.core.somaxconn is " << somaxconn << ", below " << kConnects);
    return;
  }
  rlimit rl{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  if (rl.rlim_cur < kConnects * 3 && rl.rlim_max >= kConnects * 3) {
    rl.rlim_cur = kConnects * 3;
    setrlimit(RLIMIT_NOFILE, &rl);
    REQUIRE(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  }
  if (rl.rlim_cur < kConnects * 3) {
    WARN("skipped: RLIMIT_NOFILE is " << rl.rlim_cur << ", below " << kConnects * 3);
    return;
  }
  const Rail rail = loopback_rail();
  std::string err;
  const int lfd = open_rail_listener(rail, &err);
  INFO(err);
  REQUIRE(lfd >= 0);
  sockaddr_storage la{};
  socklen_t lal = sizeof(la);
  REQUIRE(getsockname(lfd, reinterpret_cast<sockaddr*>(&la), &lal) == 0);
  std::vector<pollfd> fds;
  for (int i = 0; i < kConnects; ++i) {
    SockFailure why;
    const int fd = open_rail_socket(rail, 0, &why);
    INFO(why.text);
    REQUIRE(fd >= 0);
    REQUIRE(start_connect(fd, la) == 0);
    fds.push_back({fd, POLLOUT, 0});
  }
  // Well within the 1 s after which a dropped SYN is sent again.
  int connected = 0;
  const TimeUs deadline = r2ccl::now_us() + 500 * kUsPerMs;
  std::vector<bool> done(fds.size(), false);
  while (connected < kConnects && r2ccl::now_us() < deadline) {
    for (auto& p : fds) p.revents = 0;
    ::poll(fds.data(), fds.size(), 20);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (done[i] || !(fds[i].revents & (POLLOUT | POLLERR | POLLHUP))) continue;
      done[i] = true;
      if (finish_connect(fds[i].fd) == 0) ++connected;
    }
  }
  CHECK(connected == kConnects);
  for (auto& p : fds) close(p.fd);
  close(lfd);
}

TEST_CASE("more rails than one process carries: the first 16 in name order, the rest named",
          "[rails]") {
  std::vector<IfAddr> ifs;
  char name[16], addr[32];
  for (int i = 0; i < 20; ++i) {
    snprintf(name, sizeof(name), "eth%02d", i);
    snprintf(addr, sizeof(addr), "10.1.%d.1", i);
    ifs.push_back(iface(name, 10 + i, true, addr, 24));
  }
  std::vector<Rail> rails;
  std::string err;
  std::vector<std::string> left_out;
  REQUIRE(select_rails("eth", "R2CCL_SOCKET_IFNAME", ifs, 0, &rails, &err, &left_out));
  REQUIRE(rails.size() == kMaxRailsPerProcess);
  CHECK(rails.front().name == "eth00");
  CHECK(rails.back().name == "eth15");
  CHECK(rails.back().index == 15);
  CHECK(left_out == std::vector<std::string>{"eth16", "eth17", "eth18", "eth19"});
  // Exactly the limit: nothing left out.
  ifs.resize(kMaxRailsPerProcess);
  left_out.clear();
  REQUIRE(select_rails("eth", "R2CCL_SOCKET_IFNAME", ifs, 0, &rails, &err, &left_out));
  CHECK(rails.size() == kMaxRailsPerProcess);
  CHECK(left_out.empty());
}

TEST_CASE("a rail's address is resolved again after it changes", "[rails]") {
  std::vector<Rail> rails;
  std::string err;
  REQUIRE(select_rails("=eth0", "R2CCL_SOCKET_IFNAME", host(), 0, &rails, &err));
  REQUIRE(rails.size() == 1);
  const Rail r = rails[0];
  sockaddr_storage a{};
  int plen = 0;
  // Unchanged.
  REQUIRE(resolve_rail_address(r, host(), &a, &plen));
  CHECK(addr_to_string(a) == "10.0.0.1");
  // An address added beside the current one changes nothing, wherever it is listed.
  std::vector<IfAddr> two = {iface("eth0", 2, true, "10.0.0.7", 24),
                             iface("eth0", 2, true, "10.0.0.1", 24)};
  REQUIRE(resolve_rail_address(r, two, &a, &plen));
  CHECK(addr_to_string(a) == "10.0.0.1");
  // The old one gone: the new one, with its prefix.
  std::vector<IfAddr> renumbered = {iface("eth0", 2, true, "10.0.0.7", 16)};
  REQUIRE(resolve_rail_address(r, renumbered, &a, &plen));
  CHECK(addr_to_string(a) == "10.0.0.7");
  CHECK(plen == 16);
  // Same family first, else the other one.
  std::vector<IfAddr> both = {iface("eth0", 2, true, "fd00::7", 64),
                              iface("eth0", 2, true, "10.0.0.8", 24)};
  REQUIRE(resolve_rail_address(r, both, &a, &plen));
  CHECK(addr_to_string(a) == "10.0.0.8");
  std::vector<IfAddr> v6 = {iface("eth0", 2, true, "fd00::7", 64)};
  REQUIRE(resolve_rail_address(r, v6, &a, &plen));
  CHECK(addr_to_string(a) == "fd00::7");
  // An address in duplicate address detection is not usable; nor is another interface's.
  v6[0].tentative = true;
  plen = -1;
  CHECK_FALSE(resolve_rail_address(r, v6, &a, &plen));
  CHECK(plen == -1);  // untouched
  CHECK_FALSE(resolve_rail_address(r, {iface("eth2", 4, true, "10.0.0.9", 24)}, &a, &plen));
  CHECK_FALSE(resolve_rail_address(r, {}, &a, &plen));
}

TEST_CASE("an IFNAME@ADDR rail is only ever its address", "[rails]") {
  std::vector<Rail> rails;
  std::string err;
  std::vector<IfAddr> ifs = {iface("eth0", 2, true, "10.0.0.1", 24),
                             iface("eth0", 2, true, "10.0.0.2", 24)};
  REQUIRE(select_rails("eth0@10.0.0.2", "R2CCL_SOCKET_IFNAME", ifs, 0, &rails, &err));
  REQUIRE(rails.size() == 1);
  CHECK(rails[0].fixed_addr);
  sockaddr_storage a{};
  int plen = 0;
  REQUIRE(resolve_rail_address(rails[0], ifs, &a, &plen));
  CHECK(addr_to_string(a) == "10.0.0.2");
  CHECK(plen == 24);
  // Its address removed, but inside the subnet of the interface's other one: still usable
  // (as lo@127.0.0.2 is on lo's 127.0.0.1/8).
  ifs.pop_back();
  CHECK(resolve_rail_address(rails[0], ifs, &a, &plen));
  CHECK(addr_to_string(a) == "10.0.0.2");
  // No address of the interface holds it any more: not usable.
  ifs = {iface("eth0", 2, true, "10.1.0.1", 24)};
  CHECK_FALSE(resolve_rail_address(rails[0], ifs, &a, &plen));
  CHECK_FALSE(resolve_rail_address(rails[0], {}, &a, &plen));
  // Given outside every subnet of its interface: taken as given, never judged.
  REQUIRE(select_rails("eth0@192.168.9.9", "R2CCL_SOCKET_IFNAME", ifs, 0, &rails, &err));
  CHECK_FALSE(rails[0].fixed_covered);
  CHECK(resolve_rail_address(rails[0], {}, &a, &plen));
}

TEST_CASE("knobs: R2CCL_EAGER_THRESHOLD travels in the formerly reserved bytes and negotiates",
          "[wire]") {
  WireKnobs a{}, b{};
  a.chunk_size = b.chunk_size = 512 * 1024;
  a.streams = b.streams = 1;
  a.kind = b.kind = static_cast<uint8_t>(TransportKind::kTcp);
  // An older peer's knobs: those bytes are zero, so eager messages stay off.
  set_eager_threshold(&a, 64 * 1024);
  CHECK(eager_threshold_of(a) == 64 * 1024);
  CHECK(negotiate(a, b).eager_threshold == 0);
  CHECK(negotiate(b, a).eager_threshold == 0);
  // Both ends: the smaller, at most the chunk size.
  set_eager_threshold(&b, 4096);
  CHECK(negotiate(a, b).eager_threshold == 4096);
  CHECK(negotiate(b, a).eager_threshold == 4096);
  set_eager_threshold(&a, 1024 * 1024);
  set_eager_threshold(&b, 1024 * 1024);
  CHECK(negotiate(a, b).eager_threshold == 512 * 1024);
  // 24 bits: larger values are capped, and every bit of a value survives.
  set_eager_threshold(&a, uint64_t{1} << 30);
  CHECK(eager_threshold_of(a) == kMaxWireEagerThreshold);
  set_eager_threshold(&a, 0xabcdef);
  CHECK(eager_threshold_of(a) == 0xabcdef);
  std::string why;
  CHECK(knobs_valid(a, 8, &why));
}
