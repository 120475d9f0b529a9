// Rail-lab tests of rails whose address changes under a running connection (issue 16, part
// 1): the far or near end renumbers, an address is added before the old one goes, a rail gets
// its old address back, both ends come back seconds apart, an address in another subnet, and
// IPv6 with duplicate address detection. Each step is timed from the moment both ends are
// usable again (railab's `ip addr` done; for IPv6 the end of DAD) to the sender's failback
// line of rail0, and the receiver's view of the rail must follow the sender's within 2 s.
// The targets (2 s) are checked with a 2x margin here; the measured times are printed.
#include <atomic>
#include <fstream>

#include "lab_util.h"
#include "r2ccl/ext.h"

using namespace r2ccl::test;

namespace {

constexpr size_t kMsg = 8u << 20;  // per message of the stream

double now_s() { return mono_us() / 1e6; }

// The first stamp in `v` after `t`, or -1.
double first_after(const std::vector<double>& v, double t) {
  for (double x : v)
    if (x > t) return x;
  return -1;
}

// Waits until the sender's log has a failback of rail0 after `t` (at most `max_s`); returns
// its stamp, or -1.
double wait_failback(const std::string& log_path, double t, double max_s) {
  const double end = now_s() + max_s;
  while (now_s() < end) {
    const double f = first_after(stamps_of(read_file(log_path), "failback: rail rail0"), t);
    if (f > 0) return f;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

struct Step {
  std::string name;
  double usable = 0;    // both ends usable again
  double failback = 0;  // the sender's failback line of rail0 (-1: none)
};

}  // namespace

TEST_CASE("lab: a rail whose address changes comes back (IPv4)", "[lab]") {
  Lab lab(2, "2gbit");
  PairOptions o = lab_pair(lab, "renumber");
  o.finish_together = true;
  const std::string slog_path = o.sender_env["R2CCL_LOG_FILE"];
  const std::string rlog_path = o.receiver_env["R2CCL_LOG_FILE"];
  const std::string started = temp_path("renumber-started");
  const std::string stop = temp_path("renumber-stop");
  unlink(started.c_str());
  unlink(stop.c_str());
  std::vector<Step> steps;
  double subnet_from = 0, subnet_to = 0;
  auto ip = [&](const std::string& side, const std::string& cmd) { lab.exec(side, "ip " + cmd); };
  // `prep` breaks the rail, `last` is the command after which both ends are usable: the
  // clock starts before it (so railab's own run time counts against us).
  auto step = [&](const std::string& name, const std::function<void()>& prep,
                  const std::function<void()>& last) {
    prep();
    Step s{name, now_s(), 0};
    last();
    s.failback = wait_failback(slog_path, s.usable, 6.0);
    steps.push_back(s);
    std::this_thread::sleep_for(std::chrono::milliseconds(700));  // traffic on it again
  };
  // Deleting a primary IPv4 address deletes its subnet's secondaries unless they are promoted
  // (systemd-networkd and NetworkManager turn promotion on; the kernel default is off).
  lab.exec("b", "sysctl -qw net.ipv4.conf.rail0.promote_secondaries=1");
  PairResult r;
  {
    Later events(0, [&] {
      after_start(started, 1500);
      // 1. The far end renumbers: flush, then a new address in the same subnet.
      step(
          "far end renumbers", [&] { ip("b", "addr flush dev rail0"); },
          [&] { ip("b", "addr add 10.210.0.12/24 dev rail0"); });
      // 2. The near end renumbers.
      step(
          "near end renumbers", [&] { ip("a", "addr flush dev rail0"); },
          [&] { ip("a", "addr add 10.210.0.11/24 dev rail0"); });
      // 3. The far end gets its next address before the old one goes.
      step(
          "address added before the old one is removed",
          [&] {
            ip("b", "addr add 10.210.0.22/24 dev rail0");
            std::this_thread::sleep_for(std::chrono::milliseconds(500));
          },
          [&] { ip("b", "addr del 10.210.0.12/24 dev rail0"); });
      // 4. The far end loses its address for a second, then gets its old one back.
      step(
          "old address given back",
          [&] {
            ip("b", "addr flush dev rail0");
            std::this_thread::sleep_for(std::chrono::milliseconds(1000));
          },
          [&] { ip("b", "addr add 10.210.0.22/24 dev rail0"); });
      // 5. Both ends lose their address; the near end's comes back 3 s before the far end's.
      step(
          "each end back at a different time (3 s skew)",
          [&] {
            ip("a", "addr flush dev rail0");
            ip("b", "addr flush dev rail0");
            std::this_thread::sleep_for(std::chrono::milliseconds(500));
            ip("a", "addr add 10.210.0.1/24 dev rail0");
            std::this_thread::sleep_for(std::chrono::milliseconds(3000));
          },
          [&] { ip("b", "addr add 10.210.0.2/24 dev rail0"); });
      // 6. The far end's new address is in another subnet: reported, not used; then fixed.
      ip("b", "addr flush dev rail0");
      ip("b", "addr add 10.211.0.2/24 dev rail0");
      subnet_from = now_s();
      std::this_thread::sleep_for(std::chrono::milliseconds(3000));
      subnet_to = now_s();
      step(
          "back in the subnet", [&] { ip("b", "addr flush dev rail0"); },
          [&] { ip("b", "addr add 10.210.0.2/24 dev rail0"); });
      std::ofstream(stop) << 1;
    });
    r = run_pair(
        o, [&](Endpoint& ep) { return send_until_stop(ep, kMsg, started, stop); },
        [&](Endpoint& ep) { return recv_until_marker(ep, kMsg); });
  }
  const std::string slog = read_file(slog_path);
  const std::string rlog = read_file(rlog_path);
  INFO("sender log:\n"
       << slog << "\nreceiver log:\n"
       << rlog << "\nsender stderr:\n"
       << read_file(o.sender_stderr));
  REQUIRE(r.sender_status == 0);
  REQUIRE(r.receiver_status == 0);
  REQUIRE(steps.size() == 6);
  for (const auto& s : steps) {
    const double took = s.failback > 0 ? s.failback - s.usable : -1;
    WARN(s.name << ": rail0 carries traffic again " << took << " s after both ends are usable");
    CAPTURE(s.name, took);
    CHECK(s.failback > 0);
    CHECK(took <= 4.0);  // target 2 s (docs/BENCHMARKS.md); 2x margin here
  }
  // Another subnet: no failback meanwhile, one clear WARN.
  const auto fb = stamps_of(slog, "failback: rail rail0");
  CHECK(first_after(fb, subnet_from) > subnet_to);
  CHECK(count_lines_containing(read_file(o.sender_stderr), "are not in one subnet") == 1);
  // Both ends take the path out of service together: every failure of rail0 the sender logs
  // has the receiver's within 2 s.
  const auto sf = stamps_of(slog, "path on rail rail0 failed");
  const auto rf = stamps_of(rlog, "path on rail rail0 failed");
  CHECK(sf.size() >= 6);
  for (double t : sf) {
    double best = 1e9;
    for (double u : rf) best = std::min(best, std::abs(u - t));
    CAPTURE(t, best);
    CHECK(best <= 2.0);
  }
  CHECK(count_lines_containing(slog, "give-up") == 0);
  CHECK(count_lines_containing(slog, "hold-down") == 0);  // renumbering is not flapping
}

TEST_CASE("lab: a rail whose IPv6 address changes comes back after DAD", "[lab]") {
  Lab lab(2, "2gbit");
  // IPv6 on the rails only (the lab turns it off): each rail gets a /64 and loses its IPv4
  // address, so R2CCL_SOCKET_IFNAME=rail picks the IPv6 one.
  for (const char* side : {"a", "b"}) {
    lab.exec(side, "sysctl -qw net.ipv6.conf.all.disable_ipv6=0");
    for (int i = 0; i < 2; ++i) {
      const std::string dev = "rail" + std::to_string(i);
      lab.exec(side, "sysctl -qw net.ipv6.conf." + dev + ".disable_ipv6=0");
      lab.exec(side, "ip -4 addr flush dev " + dev);
      lab.exec(side, "ip addr add fd00:210:" + std::to_string(i) +
                         "::" + (side[0] == 'a' ? "1" : "2") + "/64 dev " + dev);
    }
  }
  // Waits (in the namespace, polling every 10 ms, at most 10 s) until no address is tentative.
  auto dad_done = [&](const std::string& side) {
    return lab.exec(side,
                    "sh -c 'for i in $(seq 1000); do ip -6 addr show tentative | grep -q inet6 "
                    "|| { echo dad-done; exit 0; }; sleep 0.01; done'")
               .find("dad-done") != std::string::npos;
  };
  REQUIRE(dad_done("a"));
  REQUIRE(dad_done("b"));
  PairOptions o = lab_pair(lab, "renumber6");
  o.finish_together = true;
  const std::string slog_path = o.sender_env["R2CCL_LOG_FILE"];
  const std::string started = temp_path("renumber6-started");
  const std::string stop = temp_path("renumber6-stop");
  unlink(started.c_str());
  unlink(stop.c_str());
  double usable = 0, failback = -1, changed = 0;
  bool dad_ok = false;
  PairResult r;
  {
    Later events(0, [&] {
      after_start(started, 1500);
      lab.exec("b", "ip addr del fd00:210:0::2/64 dev rail0");
      changed = now_s();
      lab.exec("b", "ip addr add fd00:210:0::12/64 dev rail0");
      dad_ok = dad_done("b");
      usable = now_s();
      failback = wait_failback(slog_path, changed, 8.0);
      std::this_thread::sleep_for(std::chrono::milliseconds(700));
      std::ofstream(stop) << 1;
    });
    r = run_pair(
        o, [&](Endpoint& ep) { return send_until_stop(ep, kMsg, started, stop); },
        [&](Endpoint& ep) { return recv_until_marker(ep, kMsg); });
  }
  const std::string slog = read_file(slog_path);
  INFO("sender log:\n" << slog << "\nsender stderr:\n" << read_file(o.sender_stderr));
  REQUIRE(r.sender_status == 0);
  REQUIRE(r.receiver_status == 0);
  // The rails really were IPv6, and the far end took its new address once DAD was done.
  CHECK(read_file(o.receiver_stderr).find("-> fd00:210::12/64") != std::string::npos);
  REQUIRE(dad_ok);
  WARN("IPv6: DAD took " << usable - changed << " s; rail0 carries traffic again "
                         << failback - usable << " s after it");
  CHECK(failback > 0);
  CHECK(failback - usable <= 4.0);  // target 2 s after DAD; 2x margin here
}
