// Rail-lab fault tests: two network namespaces joined by veth rails (scripts/railab.sh), real
// kernel faults (link down, flaps), the plugin in one process per namespace. Each fault test
// also shows that its protection matters where that can be shown end to end (replay off ->
// the transfer fails). The dedup and stale-guard hooks are proven by test_bad_input.cc, where
// a fake peer makes duplicates and lying headers deterministic.
// Timing assertions keep a 5x margin over the real targets (those are benchmarks).
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "net_harness.h"
#include "r2ccl/ext.h"

using namespace r2ccl::test;

namespace {

// A rail lab for one test case; torn down on destruction.
class Lab {
 public:
  Lab(int rails, const std::string& rate) {
    prefix_ = "rt" + std::to_string(getpid() % 100000);
    std::string cmd = railab() + " up --rails " + std::to_string(rails) + " --prefix " + prefix_;
    if (!rate.empty()) cmd += " --rate " + rate;
    std::string out;
    ok_ = run_command(cmd, &out) == 0;
    if (!ok_) FAIL("railab up failed: " << out);
  }
  ~Lab() { run_command(railab() + " down --prefix " + prefix_); }
  std::string a() const { return prefix_ + "a"; }
  std::string b() const { return prefix_ + "b"; }
  // Runs a railab fault; returns its output (with the [SEC.USEC] stamp).
  std::string fault(const std::string& args) const {
    std::string out;
    run_command(railab() + " fault " + args + " --prefix " + prefix_, &out);
    return out;
  }
  std::string exec(const std::string& side, const std::string& cmd) const {
    std::string out;
    run_command(railab() + " --prefix " + prefix_ + " exec " + side + " " + cmd, &out);
    return out;
  }
  static std::string railab() {
    return "bash " + env_or("R2CCL_TEST_RAILAB", R2CCL_SOURCE_DIR "/scripts/railab.sh");
  }

 private:
  std::string prefix_;
  bool ok_ = false;
};

PairOptions lab_pair(const Lab& lab, const std::string& tag) {
  PairOptions o;
  o.sender_netns = lab.a();
  o.receiver_netns = lab.b();
  o.env["R2CCL_SOCKET_IFNAME"] = "rail";
  o.sender_env["R2CCL_LOG_FILE"] = temp_path(tag + "-send.log");
  o.receiver_env["R2CCL_LOG_FILE"] = temp_path(tag + "-recv.log");
  o.sender_stderr = temp_path(tag + "-send.err");
  o.receiver_stderr = temp_path(tag + "-recv.err");
  return o;
}

// Sender and receiver bodies for a stream of `count` messages of `bytes`, every byte checked.
struct Stream {
  size_t bytes;
  int count;
  int timeout_ms;
  std::string started;  // file created once the first send is posted
};

int send_stream(Endpoint& ep, const Stream& s) {
  std::vector<char> buf(s.bytes);
  for (int i = 0; i < s.count; ++i) {
    fill_pattern(buf.data(), buf.size(), static_cast<uint64_t>(i) + 1);
    void* req = nullptr;
    ncclResult_t r = ep.post_send(buf.data(), buf.size(), &req, s.timeout_ms);
    if (r == ncclSuccess && i == 0 && !s.started.empty()) std::ofstream(s.started) << mono_us();
    if (r == ncclSuccess) r = ep.wait(req, s.timeout_ms);
    if (r != ncclSuccess) {
      fprintf(stderr, "send %d failed: %d\n", i, r);
      return 10;
    }
  }
  return 0;
}

// Waits until `path` exists (the transfer started), then `ms` more. Bounded by 60 s.
void after_start(const std::string& path, int ms) {
  for (int i = 0; i < 6000 && access(path.c_str(), F_OK) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

int recv_stream(Endpoint& ep, const Stream& s) {
  std::vector<char> buf(s.bytes);
  for (int i = 0; i < s.count; ++i) {
    memset(buf.data(), 0xee, buf.size());
    int got = -1;
    ncclResult_t r = ep.recv(buf.data(), buf.size(), s.timeout_ms, &got);
    if (r != ncclSuccess) {
      fprintf(stderr, "recv %d failed: %d\n", i, r);
      return 10;
    }
    long long bad = check_pattern(buf.data(), buf.size(), static_cast<uint64_t>(i) + 1);
    if (got != static_cast<int>(s.bytes) || bad >= 0) {
      fprintf(stderr, "recv %d: size %d, first wrong byte at %lld\n", i, got, bad);
      return 11;
    }
  }
  return 0;
}

// Runs `fn` on a thread after `delay_ms`; join() waits for it.
class Later {
 public:
  Later(int delay_ms, std::function<void()> fn)
      : t_([=] {
          std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
          fn();
        }) {}
  ~Later() {
    if (t_.joinable()) t_.join();
  }

 private:
  std::thread t_;
};

}  // namespace

TEST_CASE("lab: device 1's rail downed mid-transfer of 1 GiB is replayed losslessly", "[lab]") {
  Lab lab(2, "2gbit");
  for (bool replay : {true, false}) {
    DYNAMIC_SECTION((replay ? "with replay" : "replay switched off: must fail")) {
      PairOptions o = lab_pair(lab, replay ? "gib" : "gib-noreplay");
      o.dev = 1;
      if (!replay) {
        o.env["R2CCL_TEST_HOOKS"] = "no_replay";
        o.env["R2CCL_FAILOVER_TIMEOUT"] = "2s";
      }
      Stream s{1ull << 30, 1, replay ? 120000 : 15000, temp_path("gib-started")};
      std::string fault_out;
      PairResult r;
      {
        Later fault(0, [&] {
          after_start(s.started, 1000);
          fault_out = lab.fault("link-down 1");
        });
        r = run_pair(o, [&](Endpoint& ep) { return send_stream(ep, s); },
                     [&](Endpoint& ep) { return recv_stream(ep, s); });
      }
      lab.fault("link-up 1");
      std::string slog = read_file(o.sender_env["R2CCL_LOG_FILE"]);
      INFO("sender log:\n" << slog << "\nsender stderr:\n" << read_file(o.sender_stderr)
                           << "\nreceiver stderr:\n" << read_file(o.receiver_stderr)
                           << "\nfault: " << fault_out);
      if (!replay) {
        CHECK((r.sender_status != 0 || r.receiver_status != 0));
        continue;
      }
      REQUIRE(r.sender_status == 0);
      REQUIRE(r.receiver_status == 0);
      CHECK(count_lines_containing(slog, "switchover:") == 1);
      CHECK(count_lines_containing(slog, "switchover: rail rail1") == 1);
      auto rec = stamps_of(slog, "Successfully recovered in");
      REQUIRE(rec.size() >= 1);
      CHECK(slog.find(" 0 chunks replayed") == std::string::npos);
      auto fault_t = stamps_of(fault_out, "fault link-down");
      auto sw_t = stamps_of(slog, "switchover:");
      REQUIRE(fault_t.size() == 1);
      REQUIRE(sw_t.size() == 1);
      CHECK(sw_t[0] - fault_t[0] >= 0.0);
      CHECK(sw_t[0] - fault_t[0] <= 1.0);  // target 200 ms: benchmark; 5x margin here
    }
  }
}

TEST_CASE("lab: a flapping rail carries no chunk between link-up and its probe pass", "[lab]") {
  Lab lab(4, "1gbit");
  PairOptions o = lab_pair(lab, "flap");
  o.env["R2CCL_STRIPE"] = "1";
  o.env["R2CCL_BACKUP_PATHS"] = "3";
  const std::string samples = temp_path("flap-samples");
  Stream s{8u << 20, 120, 60000, temp_path("flap-started")};
  std::string flap_out;
  PairResult r;
  {
    Later flap(0, [&] {
      after_start(s.started, 500);
      flap_out = lab.fault("flap 2 --for 4 --seed 7 --min-ms 300 --max-ms 700");
    });
    r = run_pair(
        o,
        [&](Endpoint& ep) {
          // Sample rail2's chunk counter every 1 ms from the plugin's own statistics.
          auto* ext = static_cast<const r2cclExt_v1_t*>(dlsym(ep.plugin.dl, "r2cclExt_v1"));
          if (!ext) return 20;
          std::atomic<bool> stop{false};
          std::vector<std::pair<long long, long long>> v;
          std::thread sampler([&] {
            std::vector<char> buf(8192);
            while (!stop) {
              ext->getStats(buf.data(), buf.size());
              std::string j(buf.data());
              size_t at = j.find("\"name\":\"rail2\"");
              size_t c = at == std::string::npos ? at : j.find("\"chunks_sent\":", at);
              if (c != std::string::npos) v.push_back({mono_us(), atoll(j.c_str() + c + 14)});
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
          });
          int rc = send_stream(ep, s);
          stop = true;
          sampler.join();
          std::ofstream f(samples);
          for (auto& e : v) f << e.first << " " << e.second << "\n";
          return rc;
        },
        [&](Endpoint& ep) { return recv_stream(ep, s); });
  }
  std::string slog = read_file(o.sender_env["R2CCL_LOG_FILE"]);
  INFO("sender log:\n" << slog << "\nflap:\n" << flap_out);
  REQUIRE(r.sender_status == 0);
  REQUIRE(r.receiver_status == 0);
  std::vector<std::pair<double, long long>> v;
  {
    std::ifstream f(samples);
    long long t, c;
    while (f >> t >> c) v.push_back({t / 1e6, c});
  }
  REQUIRE(v.size() > 100);
  auto chunks_at = [&](double t) {
    long long c = 0;
    for (auto& e : v)
      if (e.first <= t) c = e.second;
    return c;
  };
  auto ups = stamps_of(flap_out, "link-up dev=rail2");
  auto passes = stamps_of(slog, "failback: rail rail2");
  REQUIRE(!ups.empty());
  REQUIRE(!passes.empty());
  int checked = 0;
  for (double up : ups) {
    double pass = -1;
    for (double p : passes)
      if (p > up) {
        pass = p;
        break;
      }
    if (pass < 0) continue;
    // Bound the window by the next link-down, if it came first.
    CAPTURE(up, pass);
    CHECK(chunks_at(pass - 0.002) == chunks_at(up));
    ++checked;
  }
  CHECK(checked >= 1);
  CHECK(chunks_at(1e12) > chunks_at(passes.back()));  // and rail 2 is used again afterwards
}

TEST_CASE("lab: a rail toggled at random for 15 s: no errors and hold-down engages", "[lab]") {
  Lab lab(2, "2gbit");
  unsigned seed = static_cast<unsigned>(
      atoi(env_or("R2CCL_TEST_SEED", std::to_string(std::random_device{}() % 100000).c_str()).c_str()));
  WARN("random flap seed " << seed << " (set R2CCL_TEST_SEED to repeat)");
  PairOptions o = lab_pair(lab, "toggle");
  Stream s{16u << 20, 150, 60000, temp_path("toggle-started")};
  std::string flap_out;
  PairResult r;
  {
    Later flap(0, [&] {
      after_start(s.started, 300);
      flap_out = lab.fault("flap 0 --for 15 --seed " + std::to_string(seed) +
                           " --min-ms 100 --max-ms 1500");
    });
    r = run_pair(o, [&](Endpoint& ep) { return send_stream(ep, s); },
                 [&](Endpoint& ep) { return recv_stream(ep, s); });
  }
  std::string slog = read_file(o.sender_env["R2CCL_LOG_FILE"]);
  INFO("seed " << seed << "\nsender log:\n" << slog << "\nflap:\n" << flap_out);
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
  CHECK(count_lines_containing(slog, "hold-down: rail rail0") >= 1);
  CHECK(count_lines_containing(slog, "give-up") == 0);
}

TEST_CASE("lab: 3 rails against 2: the common rails are used and the missing one is named",
          "[lab]") {
  Lab lab(3, "");
  PairOptions o = lab_pair(lab, "3v2");
  o.receiver_env["R2CCL_SOCKET_IFNAME"] = "rail0,rail1";
  Stream s{4u << 20, 20, 30000, ""};
  PairResult r = run_pair(o, [&](Endpoint& ep) { return send_stream(ep, s); },
                          [&](Endpoint& ep) { return recv_stream(ep, s); });
  std::string serr = read_file(o.sender_stderr);
  INFO("sender stderr:\n" << serr);
  REQUIRE(r.sender_status == 0);
  REQUIRE(r.receiver_status == 0);
  CHECK(r.seconds < 60);
  CHECK(serr.find("rail rail2 has no peer rail on its subnet") != std::string::npos);
}

TEST_CASE("lab: two rails on one subnet: a downed rail's traffic moves, it is not rerouted",
          "[lab]") {
  Lab lab(2, "2gbit");
  // Put rail1 into rail0's subnet on both sides: without binding to the device, the kernel
  // would route rail1's connections through rail0 and hide the failure.
  lab.exec("a", "ip addr flush dev rail1");
  lab.exec("a", "ip addr add 10.210.0.3/24 dev rail1");
  lab.exec("b", "ip addr flush dev rail1");
  lab.exec("b", "ip addr add 10.210.0.4/24 dev rail1");
  PairOptions o = lab_pair(lab, "subnet");
  o.dev = 1;
  Stream s{64u << 20, 12, 60000, temp_path("subnet-started")};
  std::string fault_out;
  PairResult r;
  {
    Later fault(0, [&] {
      after_start(s.started, 800);
      fault_out = lab.fault("link-down 1");
    });
    r = run_pair(o, [&](Endpoint& ep) { return send_stream(ep, s); },
                 [&](Endpoint& ep) { return recv_stream(ep, s); });
  }
  std::string slog = read_file(o.sender_env["R2CCL_LOG_FILE"]);
  INFO("sender log:\n" << slog << "\nsender stderr:\n" << read_file(o.sender_stderr));
  REQUIRE(r.sender_status == 0);
  REQUIRE(r.receiver_status == 0);
  CHECK(count_lines_containing(slog, "switchover: rail rail1") == 1);
}

TEST_CASE("lab: a wrong interface name fails init fast with a clear message", "[lab]") {
  Lab lab(2, "");
  PairOptions o = lab_pair(lab, "badif");
  o.env["R2CCL_SOCKET_IFNAME"] = "nosuchif";
  long long t0 = mono_us();
  PairResult r = run_pair(o, [](Endpoint&) { return 0; }, [](Endpoint&) { return 0; });
  double secs = (mono_us() - t0) / 1e6;
  std::string serr = read_file(o.sender_stderr);
  INFO(serr);
  CHECK(r.sender_status == 91);  // init failed
  CHECK(secs < 5);
  CHECK(serr.find("R2CCL_SOCKET_IFNAME='nosuchif' matches no usable interface") != std::string::npos);
}

TEST_CASE("lab: both rails down: pending requests fail with ncclSystemError in time", "[lab]") {
  Lab lab(2, "2gbit");
  PairOptions o = lab_pair(lab, "bothdown");
  o.env["R2CCL_FAILOVER_TIMEOUT"] = "3s";
  const std::string result = temp_path("bothdown-result");
  std::string f0, f1;
  PairResult r;
  {
    Later fault(1500, [&] {
      f0 = lab.fault("link-down 0");
      f1 = lab.fault("link-down 1");
    });
    r = run_pair(
        o,
        [&](Endpoint& ep) {
          std::vector<char> buf(64u << 20);
          for (int i = 0; i < 1000; ++i) {
            ncclResult_t rc = ep.send(buf.data(), buf.size(), 20000);
            if (rc != ncclSuccess) {
              std::ofstream(result) << mono_us() << " " << rc << "\n";
              long long c0 = mono_us();
              ep.plugin.net->closeSend(ep.comm);
              std::ofstream(result, std::ios::app) << (mono_us() - c0) << "\n";
              return 0;
            }
          }
          return 30;  // never failed
        },
        [&](Endpoint& ep) {
          std::vector<char> buf(64u << 20);
          for (int i = 0; i < 1000; ++i)
            if (ep.recv(buf.data(), buf.size(), 20000) != ncclSuccess) return 0;
          return 30;
        });
  }
  lab.fault("link-up 0");
  lab.fault("link-up 1");
  INFO("sender log:\n" << read_file(o.sender_env["R2CCL_LOG_FILE"]));
  REQUIRE(r.sender_status == 0);
  REQUIRE(r.receiver_status == 0);
  std::ifstream f(result);
  long long at = 0, close_us = 0;
  int code = -1;
  f >> at >> code >> close_us;
  auto t1 = stamps_of(f1, "fault link-down");
  REQUIRE(t1.size() == 1);
  CHECK(code == ncclSystemError);
  CHECK(at / 1e6 - t1[0] <= 3.0 + 1.0);
  CHECK(close_us < 1000000);
}

TEST_CASE("lab: the peer killed with SIGKILL: ncclRemoteError, and close returns at once",
          "[lab]") {
  Lab lab(2, "2gbit");
  PairOptions o = lab_pair(lab, "kill");
  const std::string result = temp_path("kill-result");
  PairResult r = run_pair(
      o,
      [&](Endpoint& ep) {
        std::vector<char> buf(64u << 20);
        for (int i = 0; i < 1000; ++i) {
          if (i == 3) kill(ep.peer_pid, SIGKILL);
          ncclResult_t rc = ep.send(buf.data(), buf.size(), 20000);
          if (rc != ncclSuccess) {
            long long c0 = mono_us();
            ep.plugin.net->closeSend(ep.comm);
            std::ofstream(result) << rc << " " << (mono_us() - c0) << "\n";
            return 0;
          }
        }
        return 30;
      },
      [&](Endpoint& ep) {
        std::vector<char> buf(64u << 20);
        for (;;)
          if (ep.recv(buf.data(), buf.size(), 60000) != ncclSuccess) return 1;
      });
  INFO("sender log:\n" << read_file(o.sender_env["R2CCL_LOG_FILE"]));
  REQUIRE(r.sender_status == 0);
  CHECK(r.receiver_status == 128 + SIGKILL);
  std::ifstream f(result);
  int code = -1;
  long long close_us = -1;
  f >> code >> close_us;
  CHECK(code == ncclRemoteError);
  CHECK(close_us >= 0);
  CHECK(close_us < 1000000);
}
