// PathHealth: the per-path state machine (failure, backoff, probing, hold-down, RTT shadow
// routing). Pure logic driven with explicit timestamps; no sleeps.
#include <catch2/catch.hpp>
#include <vector>

#include "engine/path_health.h"
#include "r2ccl/clock.h"

using r2ccl::kUsPerMs;
using r2ccl::kUsPerSec;
using r2ccl::TimeUs;
using r2ccl::net::FailCause;
using r2ccl::net::HealthParams;
using r2ccl::net::PathHealth;
using r2ccl::net::PathState;
using r2ccl::net::RttBaseline;

namespace {

constexpr TimeUs kT0 = 1000 * kUsPerSec;

// Reconnects a failed path at `now` (which must be allowed) and passes every probe.
void recover(PathHealth& h, const HealthParams& p, TimeUs now) {
  REQUIRE(h.should_reconnect(now));
  h.on_reconnected(now);
  for (int i = 0; i < p.probe_count; ++i) h.on_probe_pass(now);
  REQUIRE(h.state() == PathState::kHealthy);
}

// Earliest time >= from at which a failed path may reconnect (searched in 1 ms steps).
TimeUs first_reconnect_time(const PathHealth& h, TimeUs from, TimeUs limit) {
  for (TimeUs t = from; t <= limit; t += kUsPerMs)
    if (h.should_reconnect(t)) return t;
  return -1;
}

// Shadow routing as the engine runs it (engine/link_live.h): the link's RttBaseline judges
// the probe RTTs, the path drains and returns with it (PathHealth::set_draining).
struct ShadowedPath {
  ShadowedPath(const HealthParams& p, PathState s, TimeUs now) : h(p, s, now), b(p) {}
  // The RttBaseline's verdict (+1 outliers start, -1 they end, 0), applied to the path.
  // Probes 150 ms apart (the tests' `now` stays put), so 3 outliers span 300 ms.
  int on_rtt_sample(TimeUs rtt, TimeUs now) {
    (void)now;
    const int d = b.sample(rtt, clock += 150 * kUsPerMs);
    if (d != 0) h.set_draining(d > 0);
    return d;
  }
  TimeUs clock = 0;
  PathState state() const { return h.state(); }
  bool carries_data() const { return h.carries_data(); }
  bool connected() const { return h.connected(); }
  bool on_failure(FailCause c, TimeUs now) { return h.on_failure(c, now); }
  bool take_holddown_started() { return h.take_holddown_started(); }
  double rtt_mean_us() const { return b.mean_us(); }
  double rtt_std_us() const { return b.std_us(); }
  PathHealth h;
  RttBaseline b;
};

// Feeds the baseline: 8 samples around 100 us (mean exactly 100 us).
void feed_baseline(ShadowedPath& h, TimeUs now) {
  const TimeUs s[] = {100, 110, 90, 100, 105, 95, 100, 100};
  for (TimeUs x : s) REQUIRE(h.on_rtt_sample(x, now) == 0);
}

}  // namespace

TEST_CASE("failure, reconnect and probe_count passing probes restore a path", "[path_health]") {
  HealthParams p;
  p.probe_count = 3;
  PathHealth h(p, PathState::kHealthy, kT0);
  REQUIRE(h.state() == PathState::kHealthy);
  REQUIRE(h.carries_data());
  REQUIRE(h.connected());
  REQUIRE(h.last_cause() == FailCause::kNone);

  REQUIRE(h.on_failure(FailCause::kLinkDown, kT0 + kUsPerSec));
  CHECK(h.state() == PathState::kFailed);
  CHECK_FALSE(h.carries_data());
  CHECK_FALSE(h.connected());
  CHECK(h.last_cause() == FailCause::kLinkDown);

  h.on_reconnected(kT0 + 2 * kUsPerSec);
  CHECK(h.state() == PathState::kProbing);
  CHECK(h.connected());
  CHECK_FALSE(h.carries_data());

  // Not healthy before the probe_count-th pass.
  CHECK_FALSE(h.on_probe_pass(kT0 + 2 * kUsPerSec));
  CHECK(h.state() == PathState::kProbing);
  CHECK_FALSE(h.on_probe_pass(kT0 + 2 * kUsPerSec));
  CHECK(h.state() == PathState::kProbing);
  CHECK_FALSE(h.carries_data());
  CHECK(h.on_probe_pass(kT0 + 2 * kUsPerSec));
  CHECK(h.state() == PathState::kHealthy);
  CHECK(h.carries_data());
  // A further probe pass on a healthy path is not another failback.
  CHECK_FALSE(h.on_probe_pass(kT0 + 3 * kUsPerSec));
}

TEST_CASE("probe passes while failed do not count towards failback", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  h.on_failure(FailCause::kSocketError, kT0);
  for (int i = 0; i < 5; ++i) CHECK_FALSE(h.on_probe_pass(kT0));
  h.on_reconnected(kT0 + kUsPerSec);
  CHECK_FALSE(h.on_probe_pass(kT0 + kUsPerSec));
  CHECK(h.state() == PathState::kProbing);
}

TEST_CASE("a failure on an already failed path is not a new failure", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  REQUIRE(h.on_failure(FailCause::kAckTimeout, kT0));
  CHECK_FALSE(h.on_failure(FailCause::kLinkDown, kT0 + 1));
  CHECK_FALSE(h.on_failure(FailCause::kHeartbeatMiss, kT0 + 2));
  // The first cause is kept.
  CHECK(h.last_cause() == FailCause::kAckTimeout);
}

TEST_CASE("a path created failed (setup) may be reconnected and probed", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kFailed, kT0);
  CHECK_FALSE(h.carries_data());
  CHECK_FALSE(h.connected());
  CHECK(h.should_reconnect(kT0));
  h.on_reconnected(kT0);
  for (int i = 0; i < p.probe_count - 1; ++i) CHECK_FALSE(h.on_probe_pass(kT0));
  CHECK(h.on_probe_pass(kT0));
  CHECK(h.carries_data());
}

TEST_CASE("reconnect backoff doubles from reconnect_min up to reconnect_max", "[path_health]") {
  HealthParams p;
  p.reconnect_min = 50 * kUsPerMs;
  p.reconnect_max = 2 * kUsPerSec;
  PathHealth h(p, PathState::kHealthy, kT0);
  TimeUs now = kT0 + kUsPerSec;
  REQUIRE(h.on_failure(FailCause::kSocketError, now));

  // First attempt after reconnect_min.
  CHECK_FALSE(h.should_reconnect(now));
  CHECK_FALSE(h.should_reconnect(now + p.reconnect_min - 1));
  CHECK(h.should_reconnect(now + p.reconnect_min));
  now += p.reconnect_min;

  const std::vector<TimeUs> expected = {100 * kUsPerMs,  200 * kUsPerMs,  400 * kUsPerMs,
                                        800 * kUsPerMs,  1600 * kUsPerMs, 2000 * kUsPerMs,
                                        2000 * kUsPerMs, 2000 * kUsPerMs};
  for (TimeUs delay : expected) {
    INFO("expected delay " << delay << " us");
    h.on_reconnect_failed(now);
    CHECK(h.state() == PathState::kFailed);
    CHECK_FALSE(h.should_reconnect(now));
    CHECK_FALSE(h.should_reconnect(now + delay - 1));
    CHECK(h.should_reconnect(now + delay));
    now += delay;
  }
}

TEST_CASE("a reconnect that fails while probing goes back to failed and backs off",
          "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  h.on_failure(FailCause::kSocketError, kT0);
  h.on_reconnected(kT0 + p.reconnect_min);
  REQUIRE(h.state() == PathState::kProbing);
  CHECK_FALSE(h.should_reconnect(kT0 + 10 * kUsPerSec));  // only FAILED paths reconnect
  const TimeUs now = kT0 + p.reconnect_min;
  h.on_reconnect_failed(now);
  CHECK(h.state() == PathState::kFailed);
  CHECK_FALSE(h.should_reconnect(now + 2 * p.reconnect_min - 1));
  CHECK(h.should_reconnect(now + 2 * p.reconnect_min));
}

TEST_CASE("link up allows an immediate reconnect attempt and resets the backoff", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  TimeUs now = kT0;
  h.on_failure(FailCause::kLinkDown, now);
  for (int i = 0; i < 5; ++i) {  // backoff grows to 1.6 s
    now += kUsPerMs;
    h.on_reconnect_failed(now);
  }
  REQUIRE_FALSE(h.should_reconnect(now + kUsPerSec));

  now += 10 * kUsPerMs;
  h.on_link_up(now);
  CHECK(h.should_reconnect(now));

  // The ladder starts over: the next failed attempt waits 2 * reconnect_min, not 3.2 s.
  h.on_reconnect_failed(now);
  CHECK_FALSE(h.should_reconnect(now + 2 * p.reconnect_min - 1));
  CHECK(h.should_reconnect(now + 2 * p.reconnect_min));
}

TEST_CASE("link up on a healthy path changes nothing", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  h.on_link_up(kT0);
  CHECK(h.state() == PathState::kHealthy);
  CHECK_FALSE(h.should_reconnect(kT0));
}

TEST_CASE("the third down-up within the window starts a hold-down of holddown_min",
          "[path_health]") {
  HealthParams p;  // 3 flaps in 10 s, 1 s .. 60 s
  PathHealth h(p, PathState::kHealthy, kT0);
  TimeUs now = kT0 + 100 * kUsPerSec;

  // Flaps 1 and 2: plain backoff, no hold-down.
  for (int flap = 1; flap <= 2; ++flap) {
    REQUIRE(h.on_failure(FailCause::kLinkDown, now));
    CHECK_FALSE(h.take_holddown_started());
    CHECK_FALSE(h.held_down(now));
    now += p.reconnect_min;
    recover(h, p, now);
    now += kUsPerSec;
  }
  // Flap 3 (inside 10 s): hold-down of exactly holddown_min.
  const TimeUs third = now;
  REQUIRE(h.on_failure(FailCause::kLinkDown, third));
  CHECK(h.take_holddown_started());
  CHECK_FALSE(h.take_holddown_started());  // fires exactly once
  CHECK(h.current_holddown() == p.holddown_min);
  CHECK(h.holddown_until() == third + p.holddown_min);
  CHECK(h.held_down(third));
  CHECK(h.held_down(third + p.holddown_min - 1));
  CHECK_FALSE(h.held_down(third + p.holddown_min));

  // No reconnect during the hold-down, although the backoff (50 ms) has long passed...
  CHECK_FALSE(h.should_reconnect(third + p.reconnect_min));
  CHECK_FALSE(h.should_reconnect(third + p.holddown_min - 1));
  // ...not even when the link comes back or an attempt fails.
  h.on_link_up(third + 100 * kUsPerMs);
  CHECK_FALSE(h.should_reconnect(third + 100 * kUsPerMs));
  h.on_reconnect_failed(third + 200 * kUsPerMs);
  CHECK_FALSE(h.should_reconnect(third + p.holddown_min - 1));
  CHECK(h.should_reconnect(third + p.holddown_min));
}

TEST_CASE("flaps spread wider than the window do not start a hold-down", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  TimeUs now = kT0;
  for (int flap = 0; flap < 6; ++flap) {
    REQUIRE(h.on_failure(FailCause::kLinkDown, now));
    CHECK_FALSE(h.take_holddown_started());
    now += p.reconnect_min;
    recover(h, p, now);
    now += 6 * kUsPerSec;  // 3 failures span > 10 s
  }
  CHECK(h.current_holddown() == 0);
}

TEST_CASE("further flaps double the hold-down up to holddown_max", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  TimeUs now = kT0;
  std::vector<TimeUs> holddowns;
  // Flap quickly: every failure 10 ms after the path became healthy again.
  for (int i = 0; i < 40 && holddowns.size() < 9; ++i) {
    REQUIRE(h.on_failure(FailCause::kPeerClosed, now));
    if (h.take_holddown_started()) {
      holddowns.push_back(h.current_holddown());
      CHECK(h.holddown_until() == now + h.current_holddown());
    }
    now = first_reconnect_time(h, now, now + 120 * kUsPerSec);
    REQUIRE(now > 0);
    recover(h, p, now);
    now += 10 * kUsPerMs;
  }
  const std::vector<TimeUs> expected = {1 * kUsPerSec,  2 * kUsPerSec,  4 * kUsPerSec,
                                        8 * kUsPerSec,  16 * kUsPerSec, 32 * kUsPerSec,
                                        60 * kUsPerSec, 60 * kUsPerSec, 60 * kUsPerSec};
  CHECK(holddowns == expected);
}

TEST_CASE("hold-down returns to the minimum after holddown_reset of stable health",
          "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  TimeUs now = kT0;
  // Three quick flaps then two more: hold-downs of 1 s and 2 s (4 s next).
  auto flap_until_holddown = [&](TimeUs* len) {
    for (int i = 0; i < 10; ++i) {
      REQUIRE(h.on_failure(FailCause::kLinkDown, now));
      const bool started = h.take_holddown_started();
      now = first_reconnect_time(h, now, now + 120 * kUsPerSec);
      REQUIRE(now > 0);
      recover(h, p, now);
      if (started) {
        *len = h.current_holddown();
        return;
      }
      now += 10 * kUsPerMs;
    }
    FAIL("no hold-down started");
  };
  TimeUs len = 0;
  flap_until_holddown(&len);
  CHECK(len == 1 * kUsPerSec);
  now += 10 * kUsPerMs;
  flap_until_holddown(&len);
  CHECK(len == 2 * kUsPerSec);

  SECTION("just under holddown_reset of health: the ladder continues") {
    now += p.holddown_reset - 1;
    flap_until_holddown(&len);
    CHECK(len == 4 * kUsPerSec);
  }
  SECTION("holddown_reset of health: back to holddown_min") {
    now += p.holddown_reset;
    flap_until_holddown(&len);
    CHECK(len == p.holddown_min);
  }
}

TEST_CASE("failures while probing do not count as flaps", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  TimeUs now = kT0;
  REQUIRE(h.on_failure(FailCause::kLinkDown, now));  // flap 1 (from HEALTHY)
  // Reconnects that fail during probing (the path never came up), all inside the 10 s window
  // (the backoff grows 50, 100, ... 800 ms).
  for (int i = 0; i < 5; ++i) {
    // The backoff grows with each failed probe; the next attempt comes within reconnect_max.
    const TimeUs limit = now + p.reconnect_max + kUsPerMs;
    while (!h.should_reconnect(now) && now < limit) now += kUsPerMs;
    REQUIRE(h.should_reconnect(now));
    h.on_reconnected(now);
    REQUIRE(h.on_failure(FailCause::kPeerClosed, now + kUsPerMs));  // new failure, not a flap
    CHECK_FALSE(h.take_holddown_started());
    CHECK_FALSE(h.held_down(now + kUsPerMs));
  }
  now = first_reconnect_time(h, now, now + p.reconnect_max + kUsPerMs);
  recover(h, p, now);
  // Flap 2 does not start a hold-down either (only two down-ups from HEALTHY so far).
  now += 100 * kUsPerMs;
  REQUIRE(h.on_failure(FailCause::kLinkDown, now));
  CHECK_FALSE(h.take_holddown_started());
  now += p.reconnect_min;
  recover(h, p, now);
  // Flap 3 does.
  now += 100 * kUsPerMs;
  REQUIRE(h.on_failure(FailCause::kLinkDown, now));
  CHECK(h.take_holddown_started());
}

TEST_CASE("RTT outliers drain a path and normal samples bring it back", "[path_health]") {
  HealthParams p;  // sigma 3, 8 baseline samples, run of 3, floor 5 ms
  ShadowedPath h(p, PathState::kHealthy, kT0);
  feed_baseline(h, kT0);
  CHECK(h.rtt_mean_us() == Approx(100.0));
  CHECK(h.rtt_std_us() > 0.0);
  // limit = 100 us + max(3 * ~6 us, 5 ms) = 5.1 ms.
  const TimeUs outlier = 20 * kUsPerMs;
  const TimeUs normal = 120;

  CHECK(h.on_rtt_sample(outlier, kT0) == 0);
  CHECK(h.on_rtt_sample(outlier, kT0) == 0);
  CHECK(h.state() == PathState::kHealthy);
  CHECK(h.on_rtt_sample(outlier, kT0) == +1);
  CHECK(h.state() == PathState::kDraining);
  CHECK_FALSE(h.carries_data());
  CHECK(h.connected());
  // Still an outlier: stays draining, no second +1.
  CHECK(h.on_rtt_sample(outlier, kT0) == 0);
  CHECK(h.state() == PathState::kDraining);

  CHECK(h.on_rtt_sample(normal, kT0) == 0);
  CHECK(h.on_rtt_sample(normal, kT0) == 0);
  CHECK(h.state() == PathState::kDraining);
  CHECK(h.on_rtt_sample(normal, kT0) == -1);
  CHECK(h.state() == PathState::kHealthy);
  CHECK(h.carries_data());
}

TEST_CASE("RTT outliers must span rtt_outlier_span: a short stall of the host drains nothing",
          "[path_health]") {
  HealthParams p;  // run of 3, span 300 ms
  RttBaseline b(p);
  TimeUs t = kT0;
  for (int i = 0; i < p.rtt_baseline_samples; ++i) b.sample(100, t += 30 * kUsPerMs);
  // Probes every 30 ms: 3 outliers within 60 ms (one 100 ms stall) start nothing...
  for (int i = 0; i < 3; ++i) CHECK(b.sample(20 * kUsPerMs, t += 30 * kUsPerMs) == 0);
  CHECK_FALSE(b.outlier());
  // ...an outlier run that lasts 300 ms does.
  int d = 0;
  for (int i = 0; i < 10 && d == 0; ++i) d = b.sample(20 * kUsPerMs, t += 30 * kUsPerMs);
  CHECK(d == +1);
  CHECK(b.outlier());
  // A normal sample in between starts the span again.
  RttBaseline c(p);
  for (int i = 0; i < p.rtt_baseline_samples; ++i) c.sample(100, t += 30 * kUsPerMs);
  for (int k = 0; k < 5; ++k) {
    for (int i = 0; i < 5; ++i) CHECK(c.sample(20 * kUsPerMs, t += 30 * kUsPerMs) == 0);
    CHECK(c.sample(100, t += 30 * kUsPerMs) == 0);
  }
  CHECK_FALSE(c.outlier());
}

TEST_CASE("the RTT baseline absorbs the first samples whatever they are", "[path_health]") {
  HealthParams p;
  REQUIRE(p.rtt_baseline_samples == 8);
  ShadowedPath h(p, PathState::kHealthy, kT0);
  // Two fast samples, then six slow ones: all eight form the baseline, none is an outlier.
  CHECK(h.on_rtt_sample(100, kT0) == 0);
  CHECK(h.on_rtt_sample(100, kT0) == 0);
  for (int i = 0; i < 6; ++i) CHECK(h.on_rtt_sample(20 * kUsPerMs, kT0) == 0);
  CHECK(h.state() == PathState::kHealthy);
  CHECK(h.rtt_mean_us() == Approx((2 * 100 + 6 * 20000) / 8.0));
}

TEST_CASE("an RTT within the floor is never an outlier", "[path_health]") {
  HealthParams p;
  ShadowedPath h(p, PathState::kHealthy, kT0);
  feed_baseline(h, kT0);
  // 4.9 ms above a 100 us mean with a tiny std: inside the 5 ms floor.
  for (int i = 0; i < 10; ++i) CHECK(h.on_rtt_sample(100 + 4900, kT0) == 0);
  CHECK(h.state() == PathState::kHealthy);
}

TEST_CASE("the RTT limit uses sigma * std when that exceeds the floor", "[path_health]") {
  HealthParams p;
  ShadowedPath h(p, PathState::kHealthy, kT0);
  // Mean 20 ms, sample std ~10.7 ms: limit ~52 ms.
  for (int i = 0; i < 4; ++i) {
    h.on_rtt_sample(10 * kUsPerMs, kT0);
    h.on_rtt_sample(30 * kUsPerMs, kT0);
  }
  REQUIRE(h.rtt_mean_us() == Approx(20.0 * kUsPerMs));
  REQUIRE(h.rtt_std_us() == Approx(10690.0).epsilon(0.01));
  // 40 ms is above mean + floor (25 ms) but within mean + 3 sigma.
  for (int i = 0; i < 5; ++i) CHECK(h.on_rtt_sample(40 * kUsPerMs, kT0) == 0);
  CHECK(h.state() == PathState::kHealthy);
  // 100 ms is an outlier.
  CHECK(h.on_rtt_sample(100 * kUsPerMs, kT0) == 0);
  CHECK(h.on_rtt_sample(100 * kUsPerMs, kT0) == 0);
  CHECK(h.on_rtt_sample(100 * kUsPerMs, kT0) == +1);
}

TEST_CASE("outliers must be consecutive to drain, normals consecutive to return", "[path_health]") {
  HealthParams p;
  ShadowedPath h(p, PathState::kHealthy, kT0);
  feed_baseline(h, kT0);
  const TimeUs bad = 20 * kUsPerMs, good = 100;
  for (int i = 0; i < 5; ++i) {
    CHECK(h.on_rtt_sample(bad, kT0) == 0);
    CHECK(h.on_rtt_sample(bad, kT0) == 0);
    CHECK(h.on_rtt_sample(good, kT0) == 0);  // breaks the run
  }
  CHECK(h.state() == PathState::kHealthy);
  for (int i = 0; i < 2; ++i) CHECK(h.on_rtt_sample(bad, kT0) == 0);
  REQUIRE(h.on_rtt_sample(bad, kT0) == +1);
  for (int i = 0; i < 5; ++i) {
    CHECK(h.on_rtt_sample(good, kT0) == 0);
    CHECK(h.on_rtt_sample(good, kT0) == 0);
    CHECK(h.on_rtt_sample(bad, kT0) == 0);  // breaks the run
  }
  CHECK(h.state() == PathState::kDraining);
  CHECK(h.on_rtt_sample(good, kT0) == 0);
  CHECK(h.on_rtt_sample(good, kT0) == 0);
  CHECK(h.on_rtt_sample(good, kT0) == -1);
}

TEST_CASE("latency_sigma = 0 disables shadow routing", "[path_health]") {
  HealthParams p;
  p.latency_sigma = 0;
  ShadowedPath h(p, PathState::kHealthy, kT0);
  for (int i = 0; i < 8; ++i) h.on_rtt_sample(100, kT0);
  for (int i = 0; i < 20; ++i) CHECK(h.on_rtt_sample(500 * kUsPerMs, kT0) == 0);
  CHECK(h.state() == PathState::kHealthy);
  CHECK(h.carries_data());
}

TEST_CASE("shadow routing leaves a failed or probing path alone", "[path_health]") {
  HealthParams p;
  PathHealth h(p, PathState::kHealthy, kT0);
  h.on_failure(FailCause::kLinkDown, kT0);
  CHECK_FALSE(h.set_draining(true));
  CHECK(h.state() == PathState::kFailed);
  h.on_reconnected(kT0 + kUsPerSec);
  CHECK_FALSE(h.set_draining(true));
  CHECK(h.state() == PathState::kProbing);
  CHECK_FALSE(h.set_draining(false));
  CHECK(h.state() == PathState::kProbing);
  // Healthy <-> draining only, each once.
  PathHealth g(p, PathState::kHealthy, kT0);
  CHECK(g.set_draining(true));
  CHECK_FALSE(g.set_draining(true));
  CHECK(g.state() == PathState::kDraining);
  CHECK(g.set_draining(false));
  CHECK_FALSE(g.set_draining(false));
  CHECK(g.state() == PathState::kHealthy);
}

TEST_CASE("a draining path that fails is failed, and its failure counts as a flap",
          "[path_health]") {
  HealthParams p;
  p.holddown_flaps = 1;  // every down-up from an up state starts a hold-down
  ShadowedPath h(p, PathState::kHealthy, kT0);
  feed_baseline(h, kT0);
  for (int i = 0; i < 3; ++i) h.on_rtt_sample(20 * kUsPerMs, kT0);
  REQUIRE(h.state() == PathState::kDraining);
  CHECK(h.on_failure(FailCause::kAckTimeout, kT0));
  CHECK(h.state() == PathState::kFailed);
  CHECK(h.take_holddown_started());
}

TEST_CASE("a path that keeps failing its probes backs off towards reconnect_max",
          "[unit][path_health]") {
  using namespace r2ccl;
  using namespace r2ccl::net;
  HealthParams hp;
  hp.reconnect_min = 50 * kUsPerMs;
  hp.reconnect_max = 2 * kUsPerSec;
  TimeUs t = 1000 * kUsPerSec;
  PathHealth h(hp, PathState::kHealthy, t);
  REQUIRE(h.on_failure(FailCause::kLinkDown, t));
  TimeUs delay = hp.reconnect_min;
  for (int i = 0; i < 8; ++i) {
    // Reconnect as soon as allowed, then fail while probing.
    TimeUs at = t;
    while (!h.should_reconnect(at)) at += kUsPerMs;
    CHECK(at - t >= delay - kUsPerMs);
    t = at;
    h.on_reconnected(t);
    REQUIRE(h.state() == PathState::kProbing);
    REQUIRE(h.on_failure(FailCause::kHeartbeatMiss, t));
    delay = std::min(delay * 2, hp.reconnect_max);
  }
  TimeUs at = t;
  while (!h.should_reconnect(at)) at += kUsPerMs;
  CHECK(at - t >= hp.reconnect_max - kUsPerMs);
}

TEST_CASE("address changes are not flaps: renumbering never holds a rail down", "[path_health]") {
  HealthParams p;  // 3 flaps in 10 s
  PathHealth h(p, PathState::kHealthy, kT0);
  TimeUs now = kT0 + 100 * kUsPerSec;
  for (int change = 1; change <= 5; ++change) {
    REQUIRE(h.on_failure(FailCause::kAddressChanged, now));
    CHECK_FALSE(h.take_holddown_started());
    CHECK_FALSE(h.held_down(now));
    CHECK(h.should_reconnect(now + p.reconnect_min));
    now += p.reconnect_min;
    recover(h, p, now);
    now += 500 * kUsPerMs;
  }
  // The same rhythm of link failures does start one (so the test can fail).
  for (int flap = 1; flap <= 2; ++flap) {
    REQUIRE(h.on_failure(FailCause::kLinkDown, now));
    now += p.reconnect_min;
    recover(h, p, now);
    now += 500 * kUsPerMs;
  }
  REQUIRE(h.on_failure(FailCause::kLinkDown, now));
  CHECK(h.take_holddown_started());
  CHECK(h.current_holddown() == p.holddown_min);
}
