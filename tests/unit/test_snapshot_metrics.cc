// Prometheus metrics of r2ccl_snapshotd (snapshot/include/r2ccl/snapshot/metrics.h,
// metrics_http.h): exact rendering of a small registry, escaping and value formatting, name
// validation, cumulative histogram buckets, counters incremented from 4 threads, the standard
// set, metrics from a health board (an in-memory view and a real board created here) and from
// shard store stats, every page checked against the exposition format's line grammar, and the
// /metrics HTTP server on 127.0.0.1 (status, content type, 404/405/400/431/500, a silent client
// neither blocks another nor outlives its deadline, the connection cap).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <asio.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/metrics.h"
#include "r2ccl/snapshot/metrics_http.h"
#include "r2ccl/snapshot/shard_store.h"

namespace {

using namespace r2ccl::snap::metrics;
namespace board = r2ccl::board;
using Catch::Matchers::Contains;

bool has_line(const std::string& page, const std::string& line) {
  return ("\n" + page).find("\n" + line + "\n") != std::string::npos;
}

// Checks a page against the text format's grammar: lines end in '\n'; comments are "# HELP
// name text" / "# TYPE name type", at most one of each per family, before its samples; a
// family's samples are contiguous and named after it (a histogram's _bucket with an le label,
// _sum, _count); label values are escaped; values parse as floats. Returns "" or the problem.
std::string check_page(const std::string& page) {
  if (!page.empty() && page.back() != '\n') return "no final newline";
  static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*))");
  static const std::regex type(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram))");
  static const std::string kLabel = R"([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\\\|\\"|\\n)*")";
  static const std::regex sample(std::string(R"(([a-zA-Z_:][a-zA-Z0-9_:]*))") +  // name
                                 R"((\{)" + kLabel + "(," + kLabel +
                                 R"()*\})?)" +  // {label="value",...}
                                 R"( (\S+))");  // value
  std::set<std::string> done;                   // families finished
  std::string fam, fam_type;
  std::set<std::string> series;
  std::istringstream in(page);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    const std::string where = "line " + std::to_string(n) + " '" + line + "': ";
    std::smatch m;
    if (std::regex_match(line, m, help) || std::regex_match(line, m, type)) {
      const std::string name = m[1];
      if (name != fam) {
        if (done.count(name)) return where + "family seen before";
        if (!fam.empty()) done.insert(fam);
        fam = name;
        fam_type.clear();
      }
      if (line.compare(2, 4, "TYPE") == 0) {
        if (!fam_type.empty()) return where + "second TYPE";
        fam_type = m[2];
      }
      continue;
    }
    if (!std::regex_match(line, m, sample)) return where + "not a sample";
    const std::string name = m[1];
    if (fam_type.empty()) return where + "sample before its TYPE";
    const std::string labels = m[2];
    if (fam_type == "histogram") {
      if (name == fam + "_bucket") {
        if (labels.find("le=\"") == std::string::npos) return where + "bucket without le";
      } else if (name != fam + "_sum" && name != fam + "_count") {
        return where + "not a sample of histogram " + fam;
      }
    } else if (name != fam) {
      return where + "not a sample of " + fam;
    }
    if (!series.insert(name + labels).second) return where + "series written twice";
    const std::string v = m[m.size() - 1];
    if (v != "NaN" && v != "+Inf" && v != "-Inf") {
      char* end = nullptr;
      std::strtod(v.c_str(), &end);
      if (*end != 0) return where + "value does not parse";
    }
  }
  return "";
}

}  // namespace

TEST_CASE("a small registry renders to the exact text", "[metrics]") {
  Registry r;
  r.add_counter("a_total", "A counter.");
  r.counter("a_total").inc(3);
  r.counter("a_total", {{"z", "1"}, {"b", "x"}}).inc(0.5);  // labels written sorted by name
  r.add_gauge("g", "Line one\nback\\slash \"quoted\"");
  r.gauge("g").set(-2.5);
  r.add_histogram("h_seconds", "H.", {0.25, 1, 10});
  Histogram& h = r.histogram("h_seconds", {{"op", "take"}});
  for (double v : {0.125, 0.25, 0.5, 100.0}) h.observe(v);
  r.counter("nohelp_total").inc();  // registered by use: no HELP line
  r.add_gauge("empty", "a family with no series writes nothing");
  r.gauge("big").set(1e6);
  r.gauge("small").set(0.1);
  CHECK(r.render() ==
        "# HELP a_total A counter.\n"
        "# TYPE a_total counter\n"
        "a_total 3\n"
        "a_total{b=\"x\",z=\"1\"} 0.5\n"
        "# HELP g Line one\\nback\\\\slash \"quoted\"\n"
        "# TYPE g gauge\n"
        "g -2.5\n"
        "# HELP h_seconds H.\n"
        "# TYPE h_seconds histogram\n"
        "h_seconds_bucket{op=\"take\",le=\"0.25\"} 2\n"
        "h_seconds_bucket{op=\"take\",le=\"1\"} 3\n"
        "h_seconds_bucket{op=\"take\",le=\"10\"} 3\n"
        "h_seconds_bucket{op=\"take\",le=\"+Inf\"} 4\n"
        "h_seconds_sum{op=\"take\"} 100.875\n"
        "h_seconds_count{op=\"take\"} 4\n"
        "# TYPE nohelp_total counter\n"
        "nohelp_total 1\n"
        "# TYPE big gauge\n"
        "big 1000000\n"
        "# TYPE small gauge\n"
        "small 0.1\n");
  CHECK(check_page(r.render()) == "");
  // The same label set in another order is the same series.
  r.counter("a_total", {{"b", "x"}, {"z", "1"}}).inc(0.5);
  CHECK(has_line(r.render(), "a_total{b=\"x\",z=\"1\"} 1"));
  CHECK(Registry().render().empty());
}

TEST_CASE("label values and help texts are escaped; values formatted", "[metrics]") {
  CHECK(escape_label_value("a\\b\"c\nd") == "a\\\\b\\\"c\\nd");
  CHECK(escape_label_value("plain:eth0 mlx5_0:1") == "plain:eth0 mlx5_0:1");
  CHECK(escape_help("a\\b\"c\nd") == "a\\\\b\"c\\nd");  // quotes are not escaped in HELP
  Registry r;
  r.gauge("x", {{"path", "C:\\dir\n\"q\""}}).set(1);
  CHECK(r.render() == "# TYPE x gauge\nx{path=\"C:\\\\dir\\n\\\"q\\\"\"} 1\n");
  CHECK(check_page(r.render()) == "");

  CHECK(format_value(0) == "0");
  CHECK(format_value(-0.0) == "0");
  CHECK(format_value(42) == "42");
  CHECK(format_value(-7) == "-7");
  CHECK(format_value(1e6) == "1000000");
  CHECK(format_value(9007199254740991.0) == "9007199254740991");
  CHECK(format_value(0.1) == "0.1");
  CHECK(format_value(1.0 / 3) == "0.3333333333333333");
  CHECK(format_value(2.5e-7) == "2.5e-07");
  CHECK(format_value(1e300) == "1e+300");
  CHECK(format_value(NAN) == "NaN");
  CHECK(format_value(INFINITY) == "+Inf");
  CHECK(format_value(-INFINITY) == "-Inf");
  for (double v : {0.1, 1.0 / 3, 2.5e-7, 123456.789, 1e300, 9007199254740993.0})
    CHECK(std::strtod(format_value(v).c_str(), nullptr) == v);  // reads back exactly
}

TEST_CASE("invalid names, label names and registrations are refused with clear errors",
          "[metrics]") {
  CHECK(valid_metric_name("r2ccl_snapshot_x_total"));
  CHECK(valid_metric_name("job:rate5m"));
  CHECK(valid_metric_name("_x"));
  CHECK(valid_metric_name(":x"));
  for (const char* bad : {"", "1abc", "a-b", "a b", "a.b", "é"})
    CHECK_FALSE(valid_metric_name(bad));
  CHECK(valid_label_name("rail"));
  CHECK(valid_label_name("_x1"));
  for (const char* bad : {"", "1a", "a:b", "a-b", "__name__", "__x"})
    CHECK_FALSE(valid_label_name(bad));

  Registry r;
  CHECK_THROWS_WITH(r.add_counter("1abc", ""),
                    Contains("invalid metric name '1abc'") && Contains("[a-zA-Z_:][a-zA-Z0-9_:]*"));
  CHECK_THROWS_WITH(r.counter("a-b"), Contains("invalid metric name 'a-b'"));
  CHECK_THROWS_WITH(r.gauge("g", {{"a:b", "v"}}), Contains("metric g: invalid label name 'a:b'") &&
                                                      Contains("[a-zA-Z_][a-zA-Z0-9_]*"));
  CHECK_THROWS_WITH(r.gauge("g", {{"__name__", "v"}}), Contains("not starting with __"));
  CHECK_THROWS_WITH(r.gauge("g", {{"a", "1"}, {"a", "2"}}), Contains("label 'a' given twice"));
  r.add_counter("c_total", "");
  CHECK_THROWS_WITH(r.gauge("c_total"),
                    Contains("c_total is registered as a counter, not a gauge"));
  CHECK_THROWS_WITH(r.add_histogram("c_total", "", {1}), Contains("registered as a counter"));
  CHECK_THROWS_WITH(r.histogram("nope"), Contains("histogram nope is not registered"));
  CHECK_THROWS_WITH(r.add_histogram("h", "", {1, 1}),
                    Contains("bucket bounds must increase (1 then 1)"));
  CHECK_THROWS_WITH(r.add_histogram("h", "", {2, 1}), Contains("must increase"));
  CHECK_THROWS_WITH(r.add_histogram("h", "", {1, NAN}), Contains("not finite"));
  CHECK_THROWS_WITH(r.add_histogram("h", "", {-INFINITY, 1}), Contains("not finite"));
  r.add_histogram("h", "", {1, 2, INFINITY});  // a trailing +Inf is implicit
  r.add_histogram("h", "again", {1, 2});       // same buckets: fine
  CHECK_THROWS_WITH(r.add_histogram("h", "", {1, 3}),
                    Contains("histogram h is registered already with other buckets"));
  CHECK_THROWS_WITH(r.histogram("h", {{"le", "1"}}), Contains("may not have a label named 'le'"));
  // A histogram's sample names may not clash with another family, either way round.
  CHECK_THROWS_WITH(r.add_counter("h_count", ""), Contains("clashes with histogram h"));
  CHECK_THROWS_WITH(r.gauge("h_bucket"), Contains("clashes"));
  r.add_gauge("q_sum", "");
  CHECK_THROWS_WITH(r.add_histogram("q", "", {1}), Contains("clashes with gauge q_sum"));
  // Nothing refused was registered.
  r.histogram("h").observe(1);
  const std::string page = r.render();
  CHECK(page.find("1abc") == std::string::npos);
  CHECK(page.find("h_count 1\n") != std::string::npos);
  CHECK(page.find("# HELP h again\n") != std::string::npos);  // help added by the second call
  CHECK(check_page(page) == "");
}

TEST_CASE("histogram buckets are cumulative; counters never go down", "[metrics]") {
  Histogram h({1, 2, 4, 8});
  for (double v : {0.5, 1.0, 1.5, 3.0, 3.0, 7.9, 8.0, 8.1, 1e9, -5.0, std::nan("")}) h.observe(v);
  const Histogram::Snapshot s = h.snapshot();
  CHECK(s.cumulative == std::vector<uint64_t>{3, 4, 6, 8});  // -5, 0.5, 1 | 1.5 | 3, 3 | 7.9, 8
  CHECK(s.count == 10);                                      // NaN ignored
  CHECK(s.sum == Approx(0.5 + 1 + 1.5 + 3 + 3 + 7.9 + 8 + 8.1 + 1e9 - 5));
  for (size_t i = 1; i < s.cumulative.size(); ++i) CHECK(s.cumulative[i] >= s.cumulative[i - 1]);
  CHECK(s.cumulative.back() <= s.count);

  Counter c;
  c.inc(2);
  c.inc(-1);
  c.inc(NAN);
  c.inc(0);
  CHECK(c.value() == 2);
  Gauge g;
  g.inc(3);
  g.dec(5);
  CHECK(g.value() == -2);
}

TEST_CASE("4 threads incrementing: totals are exact, renders run concurrently", "[metrics]") {
  Registry r;
  register_standard(&r);
  r.add_histogram("t_seconds", "", {0.5});
  constexpr int kThreads = 4, kN = 50000;
  std::atomic<bool> stop{false};
  std::string render_problem;  // Catch2 assertions are for the main thread only
  int renders = 0;
  std::thread renderer([&] {
    for (; !stop && render_problem.empty(); ++renders) render_problem = check_page(r.render());
  });
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      Counter& cached = r.counter(kHeartbeatsReceived);
      for (int i = 0; i < kN; ++i) {
        cached.inc();
        r.counter(kShardBytesReceived).inc(3);  // looked up every time
        r.counter("per_thread_total", {{"t", std::to_string(t)}}).inc();
        r.gauge(kLiveNodes).inc();
        r.histogram("t_seconds").observe(i % 2 ? 1.0 : 0.25);
      }
    });
  for (auto& t : ts) t.join();
  stop = true;
  renderer.join();
  CHECK(render_problem == "");
  CHECK(renders > 0);
  CHECK(r.counter(kHeartbeatsReceived).value() == kThreads * kN);
  CHECK(r.counter(kShardBytesReceived).value() == 3.0 * kThreads * kN);
  CHECK(r.gauge(kLiveNodes).value() == kThreads * kN);
  for (int t = 0; t < kThreads; ++t)
    CHECK(r.counter("per_thread_total", {{"t", std::to_string(t)}}).value() == kN);
  const Histogram::Snapshot s = r.histogram("t_seconds").snapshot();
  CHECK(s.count == static_cast<uint64_t>(kThreads) * kN);
  CHECK(s.cumulative[0] == static_cast<uint64_t>(kThreads) * kN / 2);
  const std::string page = r.render();
  CHECK(has_line(page, "r2ccl_snapshot_heartbeats_received_total 200000"));
  CHECK(has_line(page, "t_seconds_bucket{le=\"0.5\"} 100000"));
  CHECK(has_line(page, "t_seconds_bucket{le=\"+Inf\"} 200000"));
}

TEST_CASE("the standard set: every name registered, series at 0, idempotent", "[metrics]") {
  Registry r;
  register_standard(&r);
  r.counter(kRecoveries).inc();
  register_standard(&r);  // again: nothing lost
  const std::string page = r.render();
  CHECK(check_page(page) == "");
  for (const char* n : {kShardBytesReceived, kShardBytesSent, kShardsReceived, kShardsSent, kTakes,
                        kTakeFailures, kHeartbeatsSent, kHeartbeatsReceived, kHeartbeatsMissed,
                        kNodesFailed, kNodesRejoined, kPeersRefused}) {
    INFO(n);
    CHECK(std::string(n).size() > 6);
    CHECK(std::string(n).compare(0, 15, "r2ccl_snapshot_") == 0);
    CHECK(std::string(n).compare(std::string(n).size() - 6, 6, "_total") == 0);
    CHECK(has_line(page, "# TYPE " + std::string(n) + " counter"));
    CHECK(has_line(page, std::string(n) + " 0"));
  }
  CHECK(has_line(page, "r2ccl_snapshot_recoveries_total 1"));
  for (const char* n : {kMembershipEpoch, kLiveNodes, kConfiguredNodes, kCoordinator}) {
    INFO(n);
    CHECK(has_line(page, "# TYPE " + std::string(n) + " gauge"));
    CHECK(has_line(page, std::string(n) + " 0"));
  }
  // Absent until set.
  CHECK(page.find(kReplicationLag) == std::string::npos);
  CHECK(page.find(kNewestCompleteStep) == std::string::npos);
  r.gauge(kReplicationLag).set(0.75);
  CHECK(has_line(r.render(), "r2ccl_snapshot_replication_lag_seconds 0.75"));
  CHECK(has_line(r.render(), "# TYPE r2ccl_snapshot_replication_lag_seconds gauge"));
  // Histograms: bytes and seconds, with their buckets.
  CHECK(has_line(page, "# TYPE r2ccl_snapshot_take_bytes histogram"));
  CHECK(has_line(page, "r2ccl_snapshot_take_bytes_bucket{le=\"1048576\"} 0"));
  CHECK(has_line(page, "r2ccl_snapshot_take_bytes_bucket{le=\"68719476736\"} 0"));
  CHECK(has_line(page, "# TYPE r2ccl_snapshot_take_seconds histogram"));
  CHECK(has_line(page, "r2ccl_snapshot_take_seconds_bucket{le=\"0.01\"} 0"));
  CHECK(has_line(page, "r2ccl_snapshot_take_seconds_bucket{le=\"+Inf\"} 0"));
  r.histogram(kTakeSeconds).observe(0.3);
  CHECK(has_line(r.render(), "r2ccl_snapshot_take_seconds_bucket{le=\"0.5\"} 1"));
  CHECK(has_line(r.render(), "r2ccl_snapshot_take_seconds_bucket{le=\"0.25\"} 0"));
}

namespace {

const std::string kNodeBw = "r2ccl_snapshot_agreed_node_usable_bandwidth_bytes_per_second";

board::RailSlot slot(const char* name, int32_t pid, board::RailState st, uint32_t mbps,
                     board::Transport tr = board::Transport::kTcp) {
  board::RailSlot s;
  s.pid = pid;
  board::set_text(s.f.name, sizeof(s.f.name), name);
  s.f.state = st;
  s.f.transport = tr;
  s.f.usable_mbps = mbps;
  s.f.bytes_sent = 1234;
  s.f.switchovers = 2;
  return s;
}

board::RiskEntry risk(const char* rail, float r, float ratio, bool drain) {
  board::RiskEntry e;
  board::set_text(e.rail, sizeof(e.rail), rail);
  e.risk = r;
  e.retransmit_ratio = ratio;
  e.source = board::RiskSource::kLstm;
  e.drain = drain ? 1 : 0;
  return e;
}

}  // namespace

TEST_CASE("board metrics from a view: states, risks, retransmit ratio, drain, agreed record",
          "[metrics][board]") {
  board::BoardView v;
  v.rails.push_back(slot("eth0", 100, board::RailState::kUp, 25000));
  v.rails.push_back(slot("mlx5_0:1", 100, board::RailState::kDraining, 0, board::Transport::kIb));
  v.rails.push_back(slot("eth0", 200, board::RailState::kFailed, 0));
  v.rails.push_back(slot("eth0", 100, board::RailState::kDown, 0));  // duplicate (name, pid)
  v.rails.push_back(slot("we\"ird\\", 300, board::RailState::kUnknown, 0));
  v.has_sampler = true;
  v.sampler.owner = 100;
  v.sampler.rails = {risk("eth0", 0.25f, 0.125f, false), risk("mlx5_0:1", 0.875f, -1, true),
                     risk("eth1", -1, 0.5f, false), risk("eth0", 0.5f, 0.5f, true)};
  v.has_agreed = true;
  v.agreed.epoch = 7;
  v.agreed.n_nodes = 4;
  v.agreed.members[0] = 0b1011;  // nodes 0, 1, 3
  v.agreed.node_usable_gbps[0] = 12.5f;
  v.agreed.node_usable_gbps[1] = 0.25f;
  v.agreed.node_usable_gbps[2] = 99;  // not a member: not written
  std::string page;
  append_board_metrics(v, &page);
  INFO(page);
  CHECK(check_page(page) == "");
  CHECK(has_line(page, "r2ccl_rail_up{pid=\"100\",rail=\"eth0\",transport=\"tcp\"} 1"));
  CHECK(has_line(page, "r2ccl_rail_up{pid=\"100\",rail=\"mlx5_0:1\",transport=\"ib\"} 0"));
  CHECK(has_line(page, "r2ccl_rail_up{pid=\"200\",rail=\"eth0\",transport=\"tcp\"} 0"));
  CHECK(has_line(page, "r2ccl_rail_up{pid=\"300\",rail=\"we\\\"ird\\\\\",transport=\"tcp\"} 0"));
  CHECK(has_line(page, "r2ccl_rail_state{pid=\"100\",rail=\"eth0\",state=\"up\"} 1"));
  CHECK(has_line(page, "r2ccl_rail_state{pid=\"100\",rail=\"eth0\",state=\"down\"} 0"));
  CHECK(has_line(page, "r2ccl_rail_state{pid=\"100\",rail=\"mlx5_0:1\",state=\"draining\"} 1"));
  CHECK(has_line(page, "r2ccl_rail_state{pid=\"100\",rail=\"mlx5_0:1\",state=\"up\"} 0"));
  CHECK(has_line(page, "r2ccl_rail_state{pid=\"200\",rail=\"eth0\",state=\"failed\"} 1"));
  CHECK(has_line(page, "r2ccl_rail_state{pid=\"300\",rail=\"we\\\"ird\\\\\",state=\"unknown\"} 1"));
  CHECK(has_line(page,
                 "r2ccl_rail_usable_bandwidth_bytes_per_second{pid=\"100\",rail=\"eth0\"} "
                 "3125000000"));
  CHECK(has_line(page, "r2ccl_rail_bytes_sent_total{pid=\"100\",rail=\"eth0\"} 1234"));
  CHECK(has_line(page, "r2ccl_rail_switchovers_total{pid=\"200\",rail=\"eth0\"} 2"));
  CHECK(has_line(page, "# TYPE r2ccl_rail_bytes_sent_total counter"));
  // Per slot 1 up + 5 state series; the duplicate (eth0, 100) written once.
  size_t states = 0;
  for (size_t p = 0; (p = page.find("\nr2ccl_rail_state{", p)) != std::string::npos; ++p) ++states;
  CHECK(states == 4 * 5);
  // Sampler: the first entry of a name wins; unknown (-1) risk and ratio are skipped.
  CHECK(has_line(page, "r2ccl_rail_failure_risk{rail=\"eth0\",source=\"lstm\"} 0.25"));
  CHECK(has_line(page, "r2ccl_rail_failure_risk{rail=\"mlx5_0:1\",source=\"lstm\"} 0.875"));
  CHECK(page.find("r2ccl_rail_failure_risk{rail=\"eth1\"") == std::string::npos);
  CHECK(has_line(page, "r2ccl_rail_ccl_retransmit_ratio{rail=\"eth0\"} 0.125"));
  CHECK(has_line(page, "r2ccl_rail_ccl_retransmit_ratio{rail=\"eth1\"} 0.5"));
  CHECK(page.find("r2ccl_rail_ccl_retransmit_ratio{rail=\"mlx5_0:1\"}") == std::string::npos);
  CHECK(has_line(page, "r2ccl_rail_drain{rail=\"eth0\"} 0"));
  CHECK(has_line(page, "r2ccl_rail_drain{rail=\"mlx5_0:1\"} 1"));
  CHECK(has_line(page, "r2ccl_rail_drain{rail=\"eth1\"} 0"));
  // The agreed record.
  CHECK(has_line(page, "r2ccl_snapshot_agreed_epoch 7"));
  CHECK(has_line(page, "r2ccl_snapshot_agreed_members 3"));
  CHECK(has_line(page, "r2ccl_snapshot_agreed_nodes 4"));
  CHECK(has_line(page, kNodeBw + "{node=\"0\"} 12500000000"));
  CHECK(has_line(page, kNodeBw + "{node=\"1\"} 250000000"));
  CHECK(has_line(page, kNodeBw + "{node=\"3\"} 0"));
  CHECK(page.find("{node=\"2\"}") == std::string::npos);

  // An empty view (no sampler, nothing agreed) writes nothing.
  std::string empty;
  append_board_metrics(board::BoardView(), &empty);
  CHECK(empty.empty());
  // Strings from a corrupt board stay printable ASCII.
  board::BoardView bad;
  bad.rails.push_back(slot("a\x01\xff", 1, board::RailState::kUp, 0));
  std::string junk;
  append_board_metrics(bad, &junk);
  CHECK(has_line(junk, "r2ccl_rail_up{pid=\"1\",rail=\"a??\",transport=\"tcp\"} 1"));
}

TEST_CASE("board metrics from a real health board; an absent board", "[metrics][board]") {
  const std::string name = "test-" + std::to_string(getpid()) + "-metrics";
  board::remove_board(name);
  std::string err;
  {
    board::Publisher p;
    REQUIRE(p.open(name, &err));
    REQUIRE(p.publish(0, slot("eth0", 0, board::RailState::kUp, 10000).f));
    REQUIRE(p.publish(1, slot("eth1", 0, board::RailState::kFailed, 0).f));
    REQUIRE(p.claim_sampler(100000));
    REQUIRE(p.publish_risks({risk("eth0", 0.5f, 0.03125f, false), risk("eth1", 1.0f, -1, true)},
                            r2ccl::now_us()));
    board::AgreedRecord rec;
    rec.epoch = 3;
    rec.n_nodes = 2;
    rec.members[0] = 0b11;
    rec.node_usable_gbps[0] = 2.5f;
    rec.node_usable_gbps[1] = 1.25f;
    REQUIRE(board::publish_agreed_record(name, rec, &err));

    std::string page;
    append_board_metrics(name, &page);
    INFO(page);
    CHECK(check_page(page) == "");
    const std::string pid = std::to_string(getpid());
    CHECK(has_line(page, "r2ccl_snapshot_board_readable 1"));
    CHECK(has_line(page, "r2ccl_rail_up{pid=\"" + pid + "\",rail=\"eth0\",transport=\"tcp\"} 1"));
    CHECK(has_line(page, "r2ccl_rail_up{pid=\"" + pid + "\",rail=\"eth1\",transport=\"tcp\"} 0"));
    CHECK(has_line(page, "r2ccl_rail_state{pid=\"" + pid + "\",rail=\"eth1\",state=\"failed\"} 1"));
    CHECK(has_line(page, "r2ccl_rail_failure_risk{rail=\"eth0\",source=\"lstm\"} 0.5"));
    CHECK(has_line(page, "r2ccl_rail_failure_risk{rail=\"eth1\",source=\"lstm\"} 1"));
    CHECK(has_line(page, "r2ccl_rail_ccl_retransmit_ratio{rail=\"eth0\"} 0.03125"));
    CHECK(page.find("r2ccl_rail_ccl_retransmit_ratio{rail=\"eth1\"}") == std::string::npos);
    CHECK(has_line(page, "r2ccl_rail_drain{rail=\"eth1\"} 1"));
    CHECK(has_line(page, "r2ccl_snapshot_agreed_epoch 3"));
    CHECK(has_line(page, "r2ccl_snapshot_agreed_members 2"));
    CHECK(has_line(page, kNodeBw + "{node=\"1\"} 1250000000"));

    // The registry's page and the board's together are one valid page.
    Registry r;
    register_standard(&r);
    CHECK(check_page(r.render() + page) == "");
  }
  board::remove_board(name);
  std::string page;
  append_board_metrics(name, &page);
  CHECK(page ==
        "# HELP r2ccl_snapshot_board_readable 1 when this node's health board was read, 0 when "
        "it is absent or unusable.\n"
        "# TYPE r2ccl_snapshot_board_readable gauge\n"
        "r2ccl_snapshot_board_readable 0\n");
}

TEST_CASE("shard store metrics", "[metrics]") {
  r2ccl::snap::StoreStats s;
  s.memory_bytes = 1 << 20;
  s.spilled_bytes = 3ull << 30;
  s.shards_in_memory = 4;
  s.shards_spilled = 5;
  s.spills = 6;
  s.spill_failures = 1;
  s.crc_failures_put = 2;
  s.crc_failures_get = 3;
  s.files_skipped = 7;
  s.pruned = 8;
  std::string page;
  append_store_metrics(s, &page);
  INFO(page);
  CHECK(check_page(page) == "");
  CHECK(has_line(page, "# TYPE r2ccl_snapshot_store_memory_bytes gauge"));
  CHECK(has_line(page, "r2ccl_snapshot_store_memory_bytes 1048576"));
  CHECK(has_line(page, "r2ccl_snapshot_store_spilled_bytes 3221225472"));
  CHECK(has_line(page, "r2ccl_snapshot_store_memory_shards 4"));
  CHECK(has_line(page, "r2ccl_snapshot_store_spilled_shards 5"));
  CHECK(has_line(page, "# TYPE r2ccl_snapshot_store_spills_total counter"));
  CHECK(has_line(page, "r2ccl_snapshot_store_spills_total 6"));
  CHECK(has_line(page, "r2ccl_snapshot_store_spill_failures_total 1"));
  CHECK(has_line(page, "r2ccl_snapshot_store_crc_failures_total{when=\"put\"} 2"));
  CHECK(has_line(page, "r2ccl_snapshot_store_crc_failures_total{when=\"get\"} 3"));
  CHECK(has_line(page, "r2ccl_snapshot_store_files_skipped_total 7"));
  CHECK(has_line(page, "r2ccl_snapshot_store_pruned_total 8"));
}

// ---- the HTTP server ------------------------------------------------------------------------

namespace {

// The server on its own event loop thread, as in the daemon.
struct Served {
  asio::io_context io;
  std::unique_ptr<HttpServer> srv;
  std::thread loop;
  uint16_t port = 0;
  explicit Served(HttpServer::BodyFn body, HttpServer::Options opt = HttpServer::Options()) {
    srv = std::make_unique<HttpServer>(io, std::move(body), opt);
    std::string err;
    REQUIRE(srv->listen("127.0.0.1:0", &err));
    port = srv->port();
    REQUIRE(port != 0);
    loop = std::thread([this] { io.run(); });
  }
  ~Served() {
    asio::post(io, [this] {
      srv->stop();
      io.stop();
    });
    loop.join();
    srv.reset();
  }
};

int connect_to(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  return fd;
}

void send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    REQUIRE(n > 0);
    off += static_cast<size_t>(n);
  }
}

// Reads until the server closes (or the 5 s receive timeout).
std::string read_all(int fd) {
  std::string r;
  char buf[4096];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    r.append(buf, static_cast<size_t>(n));
  }
  return r;
}

struct Response {
  std::string status, head, body;
  std::string header(const std::string& name) const {
    const std::string key = "\r\n" + name + ": ";
    size_t p = head.find(key);
    if (p == std::string::npos) return "<none>";
    p += key.size();
    return head.substr(p, head.find("\r\n", p) - p);
  }
};

Response http_exchange(uint16_t port, const std::string& request) {
  int fd = connect_to(port);
  send_all(fd, request);
  const std::string raw = read_all(fd);
  close(fd);
  Response r;
  const size_t eol = raw.find("\r\n");
  const size_t end = raw.find("\r\n\r\n");
  if (eol == std::string::npos || end == std::string::npos) {
    r.status = "<no response: '" + raw + "'>";
    return r;
  }
  r.status = raw.substr(0, eol);
  r.head = raw.substr(0, end + 2);
  r.body = raw.substr(end + 4);
  return r;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TEST_CASE("metrics endpoint address parsing", "[metrics][http]") {
  asio::ip::tcp::endpoint ep;
  std::string err;
  REQUIRE(parse_listen_address("127.0.0.1:9464", &ep, &err));
  CHECK(ep.address().to_string() == "127.0.0.1");
  CHECK(ep.port() == 9464);
  REQUIRE(parse_listen_address("0.0.0.0:0", &ep, &err));
  CHECK(ep.port() == 0);
  REQUIRE(parse_listen_address("[::1]:65535", &ep, &err));
  CHECK(ep.address().is_v6());
  CHECK(ep.port() == 65535);
  for (const char* bad :
       {"", "127.0.0.1", "127.0.0.1:", ":9464", "localhost:9464", "127.0.0.1:65536", "127.0.0.1:-1",
        "127.0.0.1:12a", "::1:80", "[127.0.0.1]:80", "[::1]80", "[::1", "1.2.3:80"}) {
    INFO(bad);
    err.clear();
    CHECK_FALSE(parse_listen_address(bad, &ep, &err));
    CHECK(err.find("accepted: ADDR:PORT") != std::string::npos);
  }
}

TEST_CASE(
    "GET /metrics: 200 with the exposition content type and the callback's body; other "
    "paths 404, other methods 405, junk 400, a throwing callback 500",
    "[metrics][http]") {
  Registry reg;
  register_standard(&reg);
  std::atomic<int> fail{0};
  Served s([&] {
    if (fail) throw std::runtime_error("board exploded");
    reg.counter(kHeartbeatsSent).inc();  // the body is rendered per request
    return reg.render();
  });

  Response r = http_exchange(s.port, "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
  CHECK(r.status == "HTTP/1.0 200 OK");
  CHECK(r.header("Content-Type") == "text/plain; version=0.0.4; charset=utf-8");
  CHECK(r.header("Connection") == "close");
  CHECK(r.header("Content-Length") == std::to_string(r.body.size()));
  CHECK(has_line(r.body, "r2ccl_snapshot_heartbeats_sent_total 1"));
  CHECK(r.body == reg.render());  // nothing else changed it since
  CHECK(check_page(r.body) == "");

  r = http_exchange(s.port, "GET /metrics?name[]=x HTTP/1.0\n\n");  // query ignored; bare LF
  CHECK(r.status == "HTTP/1.0 200 OK");
  CHECK(has_line(r.body, "r2ccl_snapshot_heartbeats_sent_total 2"));

  r = http_exchange(s.port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  CHECK(r.status == "HTTP/1.0 200 OK");
  CHECK(r.body.empty());
  CHECK(std::stoul(r.header("Content-Length")) > 100);

  r = http_exchange(s.port, "GET / HTTP/1.1\r\n\r\n");
  CHECK(r.status == "HTTP/1.0 404 Not Found");
  r = http_exchange(s.port, "GET /metrics/x HTTP/1.1\r\n\r\n");
  CHECK(r.status == "HTTP/1.0 404 Not Found");
  CHECK(r.body.find("/metrics") != std::string::npos);
  r = http_exchange(s.port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  CHECK(r.status == "HTTP/1.0 405 Method Not Allowed");
  CHECK(r.header("Allow") == "GET, HEAD");
  for (const char* junk :
       {"\r\n\r\n", "GET\r\n\r\n", "GET /metrics\r\n\r\n", "GET  /metrics HTTP/1.1\r\n\r\n",
        "GET /metrics FTP/1\r\n\r\n", "GET /metrics HTTP/1.1 extra\r\n\r\n"}) {
    INFO(junk);
    CHECK(http_exchange(s.port, junk).status == "HTTP/1.0 400 Bad Request");
  }
  fail = 1;
  r = http_exchange(s.port, "GET /metrics HTTP/1.1\r\n\r\n");
  CHECK(r.status == "HTTP/1.0 500 Internal Server Error");
  CHECK(r.body.find("board exploded") != std::string::npos);
  fail = 0;
  // Many scrapes in a row.
  for (int i = 0; i < 50; ++i)
    CHECK(http_exchange(s.port, "GET /metrics HTTP/1.1\r\n\r\n").status == "HTTP/1.0 200 OK");
  const HttpServer::Stats st = s.srv->stats();
  CHECK(st.ok == 53);
  CHECK(st.not_found == 2);
  CHECK(st.refused == 8);
  CHECK(st.timeouts == 0);

  // Another server cannot take the same port.
  asio::io_context io2;
  HttpServer other(io2, [] { return std::string(); });
  std::string err;
  CHECK_FALSE(other.listen("127.0.0.1:" + std::to_string(s.port), &err));
  CHECK(err.find("cannot listen on 127.0.0.1:" + std::to_string(s.port)) != std::string::npos);
}

TEST_CASE("a request header over 8 KiB is refused with 431; one just under is served",
          "[metrics][http]") {
  Served s([] { return std::string("x 1\n"); });
  std::string big = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(9000, 'a');
  Response r = http_exchange(s.port, big);  // no end of header: refused at 8 KiB
  CHECK(r.status == "HTTP/1.0 431 Request Header Fields Too Large");
  r = http_exchange(s.port, big + "\r\n\r\n" + std::string(20000, 'b'));  // complete but too big
  CHECK(r.status == "HTTP/1.0 431 Request Header Fields Too Large");
  std::string fits = "GET /metrics HTTP/1.1\r\nX-Pad: ";
  fits += std::string(8192 - fits.size() - 4, 'a') + "\r\n\r\n";
  REQUIRE(fits.size() == 8192);
  r = http_exchange(s.port, fits);
  CHECK(r.status == "HTTP/1.0 200 OK");
  CHECK(r.body == "x 1\n");
  fits.insert(fits.size() - 4, "a");  // 8193 bytes
  CHECK(http_exchange(s.port, fits).status == "HTTP/1.0 431 Request Header Fields Too Large");
}

TEST_CASE("a silent client neither blocks another nor outlives its deadline; connection cap",
          "[metrics][http]") {
  HttpServer::Options opt;
  opt.timeout = std::chrono::milliseconds(1000);
  opt.max_connections = 3;
  Served s([] { return std::string("up 1\n"); }, opt);

  auto t0 = std::chrono::steady_clock::now();
  int silent = connect_to(s.port);   // connects, sends nothing
  int partial = connect_to(s.port);  // sends half a request line
  send_all(partial, "GET /met");
  Response r = http_exchange(s.port, "GET /metrics HTTP/1.1\r\n\r\n");  // a third, served at once
  CHECK(r.status == "HTTP/1.0 200 OK");
  CHECK(r.body == "up 1\n");
  CHECK(seconds_since(t0) < 0.9);  // not held up by the silent ones
  // The server closes both at their deadline (recv sees EOF, not our 5 s timeout).
  CHECK(read_all(silent).empty());
  CHECK(read_all(partial).empty());
  const double waited = seconds_since(t0);
  CHECK(waited >= 0.9);
  CHECK(waited < 3.0);
  close(silent);
  close(partial);
  CHECK(s.srv->stats().timeouts == 2);

  // max_connections = 3: a fourth concurrent connection is closed when accepted, while the
  // three go on.
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) held.push_back(connect_to(s.port));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // all three accepted
  t0 = std::chrono::steady_clock::now();
  int extra = connect_to(s.port);
  CHECK(read_all(extra).empty());
  CHECK(seconds_since(t0) < 0.9);  // closed at accept, not at the deadline
  close(extra);
  CHECK(s.srv->stats().busy == 1);
  send_all(held[0], "GET /metrics HTTP/1.0\r\n\r\n");
  const std::string raw = read_all(held[0]);
  CHECK(raw.compare(0, 15, "HTTP/1.0 200 OK") == 0);
  for (int fd : held) close(fd);
  // Once they are gone, new clients are served again.
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  CHECK(http_exchange(s.port, "GET /metrics HTTP/1.0\r\n\r\n").status == "HTTP/1.0 200 OK");
}

TEST_CASE("stop() closes open connections; the loop ends", "[metrics][http]") {
  asio::io_context io;
  auto srv = std::make_unique<HttpServer>(io, [] { return std::string("a 1\n"); });
  std::string err;
  REQUIRE(srv->listen("127.0.0.1:0", &err));
  const uint16_t port = srv->port();
  std::thread loop([&] { io.run(); });  // returns once the server holds no more work
  int fd = connect_to(port);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  asio::post(io, [&] { srv->stop(); });
  CHECK(read_all(fd).empty());  // closed by stop, well before the 5 s timeout
  close(fd);
  loop.join();
  srv.reset();
}
