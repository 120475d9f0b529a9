// The net plugin's failure-predictor agent (net_plugin/predict): counters from a fake sysfs
// tree, an injected clock (tick(now)), the drain flag the schedulers read, the WARN event
// lines, the node's one sampler on the health board and a follower process reading it.
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fake_counters.h"
#include "net_harness.h"
#include "predict/predict_agent.h"
#include "r2ccl/health_board.h"
#include "r2ccl/log.h"
#include "r2ccl/params.h"

using namespace r2ccl;
using r2ccl::test::FakeNic;
using r2ccl::test::NicRates;

namespace {

// The configuration `env` gives. No Catch2 macro: forked children call it too.
bool load_env(const std::map<std::string, std::string>& env, Config* cfg) {
  std::string err;
  return load_config(
      [&](const char* n) -> const char* {
        auto it = env.find(n);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      {}, cfg, &err, nullptr);
}

Config config_with(const std::map<std::string, std::string>& env) {
  Config cfg;
  REQUIRE(load_env(env, &cfg));
  return cfg;
}

std::string temp_root(const char* tag) {
  std::string d = test::temp_path(tag);
  REQUIRE(system(("rm -rf " + d + " && mkdir -p " + d).c_str()) == 0);
  return d;
}

struct Rig {
  std::string root;
  FakeNic eth0, eth1;
  RailCounters live[2];
  net::PredictAgent agent;
  Rig(const std::string& r) : root(r), eth0(r, "eth0", 100000), eth1(r, "eth1", 100000) {}
  std::vector<net::PredictAgent::Rail> rails() {
    std::vector<net::PredictAgent::Rail> v(2);
    v[0].spec = predict::RailSpec{"eth0", predict::RailSpec::Kind::kEth, "eth0", 1};
    v[0].live = &live[0];
    v[1].spec = predict::RailSpec{"eth1", predict::RailSpec::Kind::kEth, "eth1", 1};
    v[1].live = &live[1];
    return v;
  }
  // One 100 ms interval: both NICs advance, eth0 with `bad`, then the agent runs.
  void step(TimeUs now, const NicRates& bad) {
    eth0.advance(0.1, bad);
    eth1.advance(0.1, NicRates{});
    agent.tick(now);
  }
};

const std::map<std::string, std::string> kFast = {
    {"R2CCL_PREDICT_INTERVAL", "100ms"},
    {"R2CCL_PREDICT_WINDOW", "2400ms"},
    {"R2CCL_PREDICT_RETURN_SAMPLES", "5"},
    {"R2CCL_PREDICT_MIN_DRAIN", "0"},  // the return rule alone (the 20-minute least drain: below)
    {"R2CCL_PREDICT_MODEL", "/nonexistent/weights.bin"}};

// In a forked child: another process of the node, on the same board, with its own quiet
// counter tree under `root`; its first sample taken. No Catch2 macro (a child): `status` is 0
// when ready, else the exit code saying what failed (2 configuration, 3 board).
struct Follower {
  Config cfg;
  std::unique_ptr<Rig> rig;
  board::Publisher pub;
  int status = 0;
  Follower(std::map<std::string, std::string> env, const std::string& root,
           const std::string& board) {
    env["R2CCL_SYSFS_ROOT"] = root;
    std::string err;
    if (!load_env(env, &cfg)) {
      status = 2;
      return;
    }
    rig = std::make_unique<Rig>(root);
    if (!pub.open(board, &err)) {
      status = 3;
      return;
    }
    rig->agent.init(cfg, rig->rails(), &pub, board);
    rig->step(now_us(), NicRates{});
  }
};

// The node's sampler on a fresh board named `tag`-PID, eth0 and eth1 counters under a fresh
// tree. Real time: other processes judge the sampler's liveness by CLOCK_MONOTONIC.
struct BoardSampler {
  std::string board;
  std::map<std::string, std::string> env;
  Config cfg;
  std::unique_ptr<Rig> rig;
  board::Publisher pub;
  BoardSampler(const std::string& tag, std::map<std::string, std::string> e) : env(std::move(e)) {
    board = tag + "-" + std::to_string(getpid());
    board::remove_board(board);
    env["R2CCL_SYSFS_ROOT"] = temp_root(tag.c_str());
    env["R2CCL_HEALTH_BOARD"] = board;
    cfg = config_with(env);
    rig = std::make_unique<Rig>(env["R2CCL_SYSFS_ROOT"]);
    std::string err;
    REQUIRE(pub.open(board, &err));
    rig->agent.init(cfg, rig->rails(), &pub, board);
  }
  ~BoardSampler() { board::remove_board(board); }
  // eth0's CRC errors climb (100 ms samples) until the agent drains it; the rates it ended at.
  NicRates drain_eth0() {
    NicRates bad;
    bool drained = false;
    for (int i = 0; i < 80 && !drained; ++i) {
      if (i >= 25) bad.crc = 5 * std::pow(1.5, i - 25);
      rig->step(now_us(), bad);
      drained = rig->live[0].predict_drain.load();
      usleep(100 * 1000);
    }
    REQUIRE(drained);
    return bad;
  }
  // Forks another process of the node (a Follower on `root`, the same board), which must be
  // following this sampler's drain of eth0 (else exit 4), runs `child(its Rig)` there and exits
  // with what it returns. `go`: the pipe hand_over signals through, or null.
  template <typename F>
  pid_t fork_follower(const std::string& root, int* go, F child) {
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      if (go) ::close(go[1]);
      Follower f(env, root, board);
      if (f.status) _exit(f.status);
      if (!f.rig->live[0].predict_drain.load()) _exit(4);
      _exit(child(*f.rig));
    }
    return pid;
  }
  // Stops sampling (as on exit) once the child `pid` reads on `go`, signals it through `go`,
  // and returns the child's exit status (-1: it did not exit normally).
  int hand_over(pid_t pid, int go[2]) {
    ::close(go[0]);
    usleep(300 * 1000);
    pub.close();
    REQUIRE(write(go[1], "x", 1) == 1);
    ::close(go[1]);
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
};

}  // namespace

TEST_CASE("agent: the baseline drains a rail whose errors climb, and returns it after",
          "[predict]") {
  const std::string log = test::temp_path("agent-events.log");
  std::string err;
  REQUIRE(set_event_sink(log, &err));
  auto env = kFast;
  env["R2CCL_SYSFS_ROOT"] = temp_root("agent-sysfs");
  env["R2CCL_PREDICT_DECIDER"] = "baseline";
  const Config cfg = config_with(env);
  Rig rig(env["R2CCL_SYSFS_ROOT"]);
  rig.agent.init(cfg, rig.rails(), nullptr, "none");  // no board: this process samples
  REQUIRE(rig.agent.enabled());
  TimeUs now = 1000 * kUsPerSec;
  for (int i = 0; i < 30; ++i, now += 100 * kUsPerMs) rig.step(now, NicRates{});
  CHECK_FALSE(rig.live[0].predict_drain.load());
  // A tick before the interval is up does nothing (the background thread loops faster).
  rig.agent.tick(now - 50 * kUsPerMs);
  int drained_at = -1;
  NicRates bad;
  for (int i = 0; i < 40 && drained_at < 0; ++i, now += 100 * kUsPerMs) {
    bad.crc = 5 * std::pow(1.5, i);  // CRC errors per second, growing
    rig.step(now, bad);
    if (rig.live[0].predict_drain.load()) drained_at = i;
  }
  REQUIRE(drained_at >= 0);
  CHECK_FALSE(rig.live[1].predict_drain.load());
  CHECK(rig.live[0].predict_drains.load() == 1);
  // Healthy again: back after R2CCL_PREDICT_RETURN_SAMPLES low samples, not at the first.
  int returned_at = -1;
  for (int i = 0; i < 60 && returned_at < 0; ++i, now += 100 * kUsPerMs) {
    rig.step(now, NicRates{});
    if (!rig.live[0].predict_drain.load()) returned_at = i;
  }
  CHECK(returned_at >= 4);
  REQUIRE(set_event_sink("stderr", &err));
  const std::string events = test::read_file(log);
  INFO(events);
  CHECK(test::count_lines_containing(events, "rail eth0 risk") == 2);
  CHECK(test::count_lines_containing(events, "draining it") == 1);
  CHECK(test::count_lines_containing(events, "(baseline)") == 2);
  CHECK(test::count_lines_containing(events, "top counters: phy errors") == 1);
  CHECK(test::count_lines_containing(events, "carrying data again") == 1);
  CHECK(test::count_lines_containing(events, "eth1") == 0);
  // The baseline decider reads a weights file only when one is named (for its thresholds); this
  // one cannot be read: said once, and the built-in thresholds decide.
  CHECK(test::count_lines_containing(events, "/nonexistent/weights.bin") == 1);
  CHECK(test::count_lines_containing(events, "the built-in baseline thresholds are used") == 1);
  CHECK(test::count_lines_containing(events, "tuned on the mean of") == 0);  // a 24-sample window
}

TEST_CASE("agent: a window shorter than the baseline's mean is said once", "[predict]") {
  auto env = kFast;
  env["R2CCL_PREDICT_WINDOW"] = "600ms";  // 6 samples of 100 ms
  env["R2CCL_SYSFS_ROOT"] = temp_root("agent-window-sysfs");
  TimeUs now = 1000 * kUsPerSec;
  // The event lines of an agent run for 10 samples with `env`.
  auto events_of = [&](const std::string& tag) {
    const std::string log = test::temp_path(tag);
    std::string err;
    REQUIRE(set_event_sink(log, &err));
    const Config cfg = config_with(env);
    Rig rig(env["R2CCL_SYSFS_ROOT"]);
    rig.agent.init(cfg, rig.rails(), nullptr, "none");
    for (int i = 0; i < 10; ++i, now += 100 * kUsPerMs) rig.step(now, NicRates{});
    REQUIRE(set_event_sink("stderr", &err));
    return test::read_file(log);
  };
  const std::string events = events_of("agent-window.log");
  INFO(events);
  REQUIRE(predict::default_baseline().steps > 6);
  CHECK_THAT(events, Catch::Contains("tuned on the mean of " +
                                     std::to_string(predict::default_baseline().steps) +
                                     " samples; R2CCL_PREDICT_WINDOW / R2CCL_PREDICT_INTERVAL "
                                     "keeps 6, so it averages 6"));
  // The same when the LSTM was asked for (both asks for it too) and its weights cannot be
  // read: the baseline decides.
  env["R2CCL_PREDICT_DECIDER"] = "lstm";
  const std::string events2 = events_of("agent-window-lstm.log");
  INFO(events2);
  CHECK(test::count_lines_containing(events2, "the threshold baseline decides instead") == 1);
  CHECK(test::count_lines_containing(events2, "tuned on the mean of") == 1);
  CHECK(test::count_lines_containing(events, "tuned on the mean of") == 1);
  // With readable weights under the decider both, the baseline still takes part: said too,
  // with its rise rule (the shipped one needs 9 samples; 6 kept).
  env["R2CCL_PREDICT_DECIDER"] = "both";
  env["R2CCL_PREDICT_MODEL"] = R2CCL_SOURCE_DIR "/predictor/model/r2ccl_lstm.bin";
  const std::string events3 = events_of("agent-window-both.log");
  INFO(events3);
  CHECK(test::count_lines_containing(events3, "decides instead") == 0);
  CHECK(test::count_lines_containing(events3, "tuned on the mean of") == 1);
  REQUIRE(predict::default_baseline().rise_lag > 0);
  CHECK(test::count_lines_containing(
            events3, "its rise rule compares " +
                         std::to_string(2 * predict::default_baseline().rise_lag + 1) +
                         " samples; R2CCL_PREDICT_WINDOW / R2CCL_PREDICT_INTERVAL keeps 6, so "
                         "it never fires") == 1);
}

TEST_CASE("agent: a link back up after its second down within the hour is held out", "[predict]") {
  const std::string log = test::temp_path("agent-flap.log");
  std::string err;
  REQUIRE(set_event_sink(log, &err));
  auto env = kFast;
  env["R2CCL_SYSFS_ROOT"] = temp_root("agent-flap-sysfs");
  env["R2CCL_PREDICT_DOWN_HOLD"] = "2s";       // 20 samples at 100 ms
  env["R2CCL_PREDICT_DOWN_HOLD_AFTER"] = "2";  // (the default, 1, holds from the first down)
  const Config cfg = config_with(env);
  Rig rig(env["R2CCL_SYSFS_ROOT"]);
  rig.agent.init(cfg, rig.rails(), nullptr, "none");
  TimeUs now = 1000 * kUsPerSec;
  auto run = [&](int n) {  // n quiet samples; how many of them had eth0 drained
    int drained = 0;
    for (int i = 0; i < n; ++i, now += 100 * kUsPerMs) {
      rig.step(now, NicRates{});
      drained += rig.live[0].predict_drain.load();
    }
    return drained;
  };
  auto flap = [&]() {  // down for 3 samples, then up
    rig.eth0.set_link(false);
    run(3);
    rig.eth0.set_link(true);
  };
  run(30);
  flap();  // the first down: eth0 carries data again as soon as it is up
  CHECK(run(10) == 0);
  flap();  // the second within the hour: held out for 2 s, then back
  CHECK(run(10) == 10);
  CHECK(run(40) >= 10);  // until 20 samples after it came up
  CHECK_FALSE(rig.live[0].predict_drain.load());
  CHECK_FALSE(rig.live[1].predict_drain.load());
  REQUIRE(set_event_sink("stderr", &err));
  const std::string events = test::read_file(log);
  INFO(events);
  CHECK(test::count_lines_containing(events,
                                     "back up after 2 link-downs within an hour: held out for 2 s "
                                     "(R2CCL_PREDICT_DOWN_HOLD)") == 1);
  CHECK(test::count_lines_containing(events, "rail eth0 risk 0.") >= 1);
  CHECK(test::count_lines_containing(events, "carrying data again") == 1);
  CHECK(test::count_lines_containing(events, "eth1") == 0);
}

TEST_CASE("agent: R2CCL_PREDICT=0 never drains", "[predict]") {
  auto env = kFast;
  env["R2CCL_PREDICT"] = "0";
  env["R2CCL_SYSFS_ROOT"] = temp_root("agent-off");
  Rig rig(env["R2CCL_SYSFS_ROOT"]);
  const Config cfg = config_with(env);
  rig.agent.init(cfg, rig.rails(), nullptr, "none");
  CHECK_FALSE(rig.agent.enabled());
  TimeUs now = 1000 * kUsPerSec;
  NicRates bad;
  bad.crc = 1e6;
  for (int i = 0; i < 30; ++i, now += 100 * kUsPerMs) rig.step(now, bad);
  CHECK_FALSE(rig.live[0].predict_drain.load());
}

TEST_CASE("agent: one sampler per node on the board; another process follows its decisions",
          "[predict]") {
  BoardSampler bs("agent-board", kFast);
  const NicRates bad = bs.drain_eth0();
  const std::string& board = bs.board;
  std::string err;
  board::SamplerView v;
  REQUIRE(board::read_sampler(board, &v, &err));
  CHECK(v.owner == getpid());
  const board::RiskEntry* e = board::find_risk(v, "eth0");
  REQUIRE(e != nullptr);
  CHECK(e->drain == 1);
  CHECK(e->risk >= 0.7f);
  CHECK(e->source == board::RiskSource::kBaseline);
  CHECK(std::string(e->top).find("symbol_err") != std::string::npos);
  REQUIRE(board::find_risk(v, "eth1") != nullptr);
  CHECK(board::find_risk(v, "eth1")->drain == 0);

  // Another process of the node: it cannot become the sampler while this one lives, so it
  // follows the board (its own counter tree says nothing is wrong).
  const std::string other_root = temp_root("agent-board-other");
  pid_t pid = bs.fork_follower(other_root, nullptr,
                               [](Rig& r2) { return r2.live[1].predict_drain.load() ? 1 : 0; });
  bs.rig->step(now_us(), bad);  // keep publishing while the follower reads
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);

  // The sampler goes away while a follower runs: the follower takes over, and the rail the old
  // sampler drained stays drained until the new sampler's own window (24 samples) is full,
  // even though the new sampler's counters look quiet from its first sample.
  int go[2];
  REQUIRE(pipe(go) == 0);
  pid = bs.fork_follower(other_root, go, [&](Rig& r2) {
    char c;
    if (read(go[0], &c, 1) != 1) return 5;  // the old sampler has gone
    int drained_samples = 0;
    for (int i = 0; i < 60 && r2.live[0].predict_drain.load(); ++i) {
      usleep(100 * 1000);
      r2.step(now_us(), NicRates{});
      drained_samples += r2.live[0].predict_drain.load();
    }
    board::SamplerView sv;
    std::string e2;
    const bool sampler = board::read_sampler(board, &sv, &e2) && sv.owner == getpid();
    // Kept drained while its window filled (>= 20 samples), then returned.
    return sampler && drained_samples >= 20 && !r2.live[0].predict_drain.load() ? 0 : 6;
  });
  CHECK(bs.hand_over(pid, go) == 0);
}

TEST_CASE("agent: a sampler that takes over keeps what is left of the least drain time",
          "[predict]") {
  auto env = kFast;
  // 8 s here (20 minutes by default): far longer than the new sampler's window (2.4 s).
  env["R2CCL_PREDICT_MIN_DRAIN"] = "8s";
  BoardSampler bs("agent-hold", env);
  bs.drain_eth0();
  const std::string& board = bs.board;
  std::string err;
  board::SamplerView v;
  REQUIRE(board::read_sampler(board, &v, &err));
  const board::RiskEntry* e = board::find_risk(v, "eth0");
  REQUIRE(e != nullptr);
  CHECK(e->drain == 1);
  CHECK(e->hold_s >= 7);  // published with the drain: what is left of the 8 s, rounded up
  CHECK(e->hold_s <= 8);
  REQUIRE(board::find_risk(v, "eth1") != nullptr);
  CHECK(board::find_risk(v, "eth1")->hold_s == 0);

  // A follower takes over once this sampler goes, its own counters quiet from its first
  // sample: it keeps eth0 drained until the 8 s have run, not only until its window is full.
  const std::string other_root = temp_root("agent-hold-other");
  int go[2];
  REQUIRE(pipe(go) == 0);
  const pid_t pid = bs.fork_follower(other_root, go, [&](Rig& r2) {
    std::string e2;
    board::SamplerView sv;
    if (!board::read_sampler(board, &sv, &e2)) return 5;
    const board::RiskEntry* held = board::find_risk(sv, "eth0");
    if (!held || held->hold_s == 0) return 6;
    const TimeUs until = sv.publish_us + held->hold_s * kUsPerSec;  // at most 1 s late
    char c;
    if (read(go[0], &c, 1) != 1) return 7;  // the old sampler has gone
    const TimeUs taken = now_us();
    int republished = -1;  // the hold this sampler publishes for the next one
    TimeUs returned = 0;
    for (int i = 0; i < 150 && returned == 0; ++i) {
      usleep(100 * 1000);
      r2.step(now_us(), NicRates{});
      if (republished < 0 && board::read_sampler(board, &sv, &e2) && sv.owner == getpid()) {
        const board::RiskEntry* mine = board::find_risk(sv, "eth0");
        if (mine && mine->drain) republished = mine->hold_s;
      }
      if (!r2.live[0].predict_drain.load()) returned = now_us();
    }
    if (returned == 0) return 8;  // never returned
    // The old code returned it once the window was full, about 2.4 s after the takeover, some
    // 5 s before `until`.
    if (returned < until - 1500 * kUsPerMs) return 9;
    if (returned - taken < 2400 * kUsPerMs) return 10;
    return republished > 0 ? 0 : 11;
  });
  CHECK(bs.hand_over(pid, go) == 0);
}
