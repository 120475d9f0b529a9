// The failure predictor under traffic in the rail lab: one rail's (fake) NIC counters degrade
// like a failing optic, the predictor's default decider (the threshold baseline,
// R2CCL_PREDICT_DECIDER) drains the rail before its scheduled link-down, and the
// link-down then costs no replay. The counters come from a fake sysfs tree per side
// (R2CCL_SYSFS_ROOT; veth has no PHY counters), sampled every 100 ms over a 2.4 s window (24
// samples, as the model was trained at 5 s over 120 s: the features are per-second rates, so the
// model sees the same numbers). The link-down itself is real (ip link set down).
#include <catch2/catch.hpp>
#include <cmath>
#include <regex>

#include "fake_counters.h"
#include "lab_util.h"
#include "stream.h"

using namespace r2ccl::test;

namespace {

// Per-second rates of the degrading NIC, `t` seconds after the degradation began: the optical
// failure model of scripts/predictor/gen_traces.py (CRC/symbol and receive errors climbing
// roughly exponentially, with link error recoveries, ahead of the loss of the link).
// At 100 ms samples the 4 s ramp is 40 samples (200 s at the model's 5 s), from 0.05 to about
// 5000 errors a second.
NicRates degrading(double t) {
  NicRates r;
  r.crc = 0.05 * std::exp(2.9 * t);
  r.rx_err = 0.5 * r.crc;
  r.carrier = t > 2.0 ? 0.5 : 0.0;
  return r;
}

struct Scenario {
  bool degrade_receiver = false;  // whose counters degrade: the data sender's or the receiver's
  bool predictor = true;          // R2CCL_PREDICT
};

struct Outcome {
  PairResult r;
  std::string slog, rlog, fault_out, why;
  double drain_t = -1, down_t = -1;
};

Outcome run(const Lab& lab, const Scenario& sc, const std::string& tag) {
  Outcome out;
  PairOptions o = lab_pair(lab, tag);
  o.finish_together = true;
  const std::string root_a = temp_path(tag + "-sysfs-a"), root_b = temp_path(tag + "-sysfs-b");
  run_command("rm -rf " + root_a + " " + root_b);
  FakeNic a0(root_a, "rail0", 100000), a1(root_a, "rail1", 100000);
  FakeNic b0(root_b, "rail0", 100000), b1(root_b, "rail1", 100000);
  o.env["R2CCL_PREDICT"] = sc.predictor ? "1" : "0";
  o.env["R2CCL_TEST_VERBOSE"] = "1";
  o.env["R2CCL_PREDICT_INTERVAL"] = "100ms";
  o.env["R2CCL_PREDICT_WINDOW"] = "2400ms";
  o.env["R2CCL_PREDICT_MODEL"] = R2CCL_SOURCE_DIR "/predictor/model/r2ccl_lstm.bin";
  // What this test proves is the predictor's drain ahead of the link-down (found by netlink),
  // counted as replays that did not happen. The acknowledgement watchdog's 100 ms is not part
  // of it: on this 2-core machine a peer process not scheduled for 100 ms while TCP recovers a
  // loss fires it now and then (1 run in 6 here), a replay this test would count against the
  // predictor. False watchdog failures are measured by scripts/bench_net.sh instead.
  o.env["R2CCL_ACK_TIMEOUT"] = "1s";
  o.sender_env["R2CCL_SYSFS_ROOT"] = root_a;
  o.receiver_env["R2CCL_SYSFS_ROOT"] = root_b;
  // Two nodes: each side its own health board, so each has its own sampler.
  o.sender_env["R2CCL_HEALTH_BOARD"] = tag + "-a-" + std::to_string(getpid());
  o.receiver_env["R2CCL_HEALTH_BOARD"] = tag + "-b-" + std::to_string(getpid());
  // 4 MiB messages at 1 Gbit/s (one rail at a time: no striping): about 30 a second; 330
  // (11 s) outlast the 3 s of health, the 4 s of degradation, the link-down and the second
  // after it.
  Stream s{4u << 20, 330, 60000, temp_path(tag + "-started")};
  FakeNic& sick = sc.degrade_receiver ? b0 : a0;
  {
    Later driver(0, [&] {
      after_start(s.started, 0);
      const double healthy_s = 3.0, degrade_s = 4.0;
      const auto t0 = std::chrono::steady_clock::now();
      bool down = false;
      double prev = 0;
      for (;;) {
        // Counters follow real time (like a NIC's), refreshed every 10 ms: a 100 ms sample
        // sees the rate it should whatever the writer's scheduling on a loaded machine.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        const double t =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        for (FakeNic* n : {&a0, &a1, &b0, &b1})
          n->advance(t - prev, n == &sick && t > healthy_s ? degrading(t - healthy_s) : NicRates{});
        prev = t;
        if (!down && t > healthy_s + degrade_s) {
          down = true;
          sick.set_link(false);
          out.fault_out = lab.fault("link-down 0");
        }
        if (t > healthy_s + degrade_s + 1.0) break;
      }
    });
    out.r = run_pair(
        o, [&](Endpoint& ep) { return send_stream(ep, s); },
        [&](Endpoint& ep) { return recv_stream(ep, s); });
  }
  lab.fault("link-up 0");
  out.slog = read_file(o.sender_env["R2CCL_LOG_FILE"]);
  out.rlog = read_file(o.receiver_env["R2CCL_LOG_FILE"]);
  out.why = "sender log:\n" + out.slog + "\nreceiver log:\n" + out.rlog + "\nsender stderr:\n" +
            read_file(o.sender_stderr) + "\nreceiver stderr:\n" + read_file(o.receiver_stderr) +
            "\nfault: " + out.fault_out;
  const auto downs = stamps_of(out.fault_out, "fault link-down");
  if (!downs.empty()) out.down_t = downs[0];
  const auto& drain_log = sc.degrade_receiver ? out.rlog : out.slog;
  const auto drains = stamps_of(drain_log, "r2ccl predict: rail rail0 risk");
  if (!drains.empty()) out.drain_t = drains[0];
  run_command("rm -rf " + root_a + " " + root_b);
  return out;
}

int chunks_replayed(const std::string& log) {
  int n = 0;
  for (int c : replayed_counts(log)) n += c;
  for (int c : to_replay_counts(log)) n += c;
  return n;
}

}  // namespace

TEST_CASE(
    "lab: a degrading rail is drained by the predictor before its link goes down; the link-down "
    "costs no replay",
    "[lab]") {
  Lab lab(2, "1gbit");
  for (bool at_receiver : {false, true}) {
    DYNAMIC_SECTION((at_receiver ? "the receiver's NIC degrades" : "the sender's NIC degrades")) {
      Outcome out = run(lab, Scenario{at_receiver, true}, at_receiver ? "pred-r" : "pred-s");
      INFO(out.why);
      REQUIRE(out.r.sender_status == 0);
      REQUIRE(out.r.receiver_status == 0);
      REQUIRE(out.down_t > 0);
      // The drain came from the default decider, the baseline (R2CCL_PREDICT_DECIDER), before
      // the link went down.
      const std::string& dlog = at_receiver ? out.rlog : out.slog;
      CHECK(count_lines_containing(dlog, "r2ccl predict: rail rail0 risk") >= 1);
      CHECK(count_lines_containing(dlog, "(baseline") >= 1);
      CHECK(count_lines_containing(dlog, "(both") + count_lines_containing(dlog, "(lstm") == 0);
      REQUIRE(out.drain_t > 0);
      CHECK(out.drain_t < out.down_t);
      if (at_receiver)
        CHECK(count_lines_containing(out.slog, "the peer drains its end of path") >= 1);
      // The healthy rail was never drained.
      CHECK(count_lines_containing(out.slog + out.rlog, "rail rail1 risk") == 0);
      // Nothing was in flight on the drained rail when it died.
      CHECK(chunks_replayed(out.slog) == 0);
    }
  }
}

TEST_CASE("lab: without the predictor the same link-down costs replays", "[lab]") {
  // A link-down that meets a moment with nothing unacknowledged on rail 0 (the stream paused
  // on a loaded machine: seen once in a CI-like run) proves nothing about replay: such a run
  // is repeated, at most 3 runs; every run must be right in every other respect.
  Lab lab(2, "1gbit");
  bool replayed = false;
  for (int attempt = 1; attempt <= 3 && !replayed; ++attempt) {
    Outcome out = run(lab, Scenario{false, false}, "pred-off");
    INFO("attempt " << attempt << "\n" << out.why);
    REQUIRE(out.r.sender_status == 0);
    REQUIRE(out.r.receiver_status == 0);
    CHECK(count_lines_containing(out.slog, "r2ccl predict:") == 0);
    CHECK(count_lines_containing(out.slog, "switchover: rail rail0") == 1);
    replayed = chunks_replayed(out.slog) > 0;
    if (!replayed) WARN("attempt " << attempt << ": the link-down met nothing in flight; again");
  }
  CHECK(replayed);
}
