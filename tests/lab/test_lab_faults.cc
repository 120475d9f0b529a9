// Rail-lab fault tests: two network namespaces joined by veth rails (scripts/railab.sh), real
// kernel faults (link down, flaps), the plugin in one process per namespace. Each fault test
// also shows that its protection matters where that can be shown end to end (replay off ->
// the transfer fails). The dedup and stale-guard hooks are proven by test_bad_input.cc, where
// a fake peer makes duplicates and lying headers deterministic.
// Timing assertions keep a 5x margin over the real targets (those are benchmarks).
#include <atomic>
#include <fstream>

#include "lab_util.h"
#include "r2ccl/ext.h"

using namespace r2ccl::test;

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
      // Replay off: a link-down that met nothing in flight ("0 chunks to replay": every chunk
      // had been acknowledged), or whose chunks in flight had all landed, loses nothing, so
      // that run says nothing about replay; it is repeated, at most 3 runs (the first seen
      // about 1 run in 3 on a loaded 2-core machine).
      PairResult r;
      std::string slog, fault_out, why;
      for (int attempt = 1; attempt <= (replay ? 1 : 3); ++attempt) {
        Stream s{1ull << 30, 1, replay ? 120000 : 15000, temp_path("gib-started")};
        unlink(o.sender_env["R2CCL_LOG_FILE"].c_str());  // this run's lines only
        {
          Later fault(0, [&] {
            after_start(s.started, 1000);
            fault_out = lab.fault("link-down 1");
          });
          r = run_pair(
              o, [&](Endpoint& ep) { return send_stream(ep, s); },
              [&](Endpoint& ep) { return recv_stream(ep, s); });
        }
        lab.fault("link-up 1");
        slog = read_file(o.sender_env["R2CCL_LOG_FILE"]);
        why = "sender log:\n" + slog + "\nsender stderr:\n" + read_file(o.sender_stderr) +
              "\nreceiver stderr:\n" + read_file(o.receiver_stderr) + "\nfault: " + fault_out;
        const bool intact = r.sender_status == 0 && r.receiver_status == 0;
        const bool met_nothing = intact && slog.find(" 0 chunks to replay") != std::string::npos;
        // Replay off, chunks in flight, yet every byte arrived: they had landed before the
        // link went down and only their acknowledgements were lost (the receiver's landed
        // state told the sender); that run says nothing about replay either (seen once in a
        // fresh-clone run).
        const bool only_acks_lost = intact && !met_nothing;
        if (replay || !(met_nothing || only_acks_lost)) break;
        WARN("attempt " << attempt
                        << (met_nothing ? ": the link-down met nothing in flight; again"
                                        : ": only acknowledgements were lost; again"));
      }
      INFO(why);
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
  // 4.8 GB over 4 rails shaped to 1 Gbit/s: at least ~10 s of traffic, so the stream outlasts
  // the 4 s of flaps and rail 2 is seen carrying chunks again after its last probe pass.
  Stream s{8u << 20, 600, 60000, temp_path("flap-started")};
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

TEST_CASE("lab: a rail toggled at random for 10 s: no errors and hold-down engages", "[lab]") {
  // Toggles every 0.1-1.5 s: a link-down at least every 3 s, so 10 s of them hold 3 within
  // 10 s and the hold-down (R2CCL_HOLDDOWN_FLAPS 3 in 10 s) engages whatever the seed. The
  // long label toggles for 60 s.
  random_toggle_scenario(10, 1);
}

TEST_CASE("lab: 3 rails against 2: the common rails are used and the missing one is named",
          "[lab]") {
  Lab lab(3, "");
  PairOptions o = lab_pair(lab, "3v2");
  o.receiver_env["R2CCL_SOCKET_IFNAME"] = "rail0,rail1";
  Stream s{4u << 20, 20, 30000, ""};
  PairResult r = run_pair(
      o, [&](Endpoint& ep) { return send_stream(ep, s); },
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
    r = run_pair(
        o, [&](Endpoint& ep) { return send_stream(ep, s); },
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
  PairResult r = run_pair(
      o, [](Endpoint&) { return 0; }, [](Endpoint&) { return 0; });
  double secs = (mono_us() - t0) / 1e6;
  std::string serr = read_file(o.sender_stderr);
  INFO(serr);
  CHECK(r.sender_status == 91);  // init failed
  CHECK(secs < 5);
  CHECK(serr.find("R2CCL_SOCKET_IFNAME='nosuchif' matches no usable interface") !=
        std::string::npos);
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
              ep.comm = nullptr;
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
            ep.comm = nullptr;
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
