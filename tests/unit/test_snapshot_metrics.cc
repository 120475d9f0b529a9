// Prometheus metrics of r2ccl_snapshotd (snapshot/include/r2ccl/snapshot/metrics.h,
// metrics_http.h), on prometheus-cpp: the registry facade (series, labels, buckets, what it
// ignores, the errors it names), counters incremented from 4 threads, the standard set, the
// families read from a health board (an in-memory view and a real board created here) and from
// shard store stats, their collectables, every page checked against the exposition format's
// line grammar, and the /metrics endpoint (prometheus::Exposer) on 127.0.0.1 port 0 scraped
// over a socket: the page, the refresh on the event loop, a loop that does not answer, a
// collectable that throws, a port in use, a silent client, stop().
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <asio.hpp>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
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

std::string board_page(const board::BoardView& v) {
  Page p;
  append_board_metrics(v, &p);
  return render(p);
}
std::string board_page(const std::string& name) {
  Page p;
  append_board_metrics(name, &p);
  return render(p);
}
std::string store_page(const r2ccl::snap::StoreStats& s) {
  Page p;
  append_store_metrics(s, &p);
  return render(p);
}

// Checks a page against the text format's grammar: lines end in '\n'; comments are "# HELP
// name text" / "# TYPE name type", at most one of each per family, before its samples; a
// family's samples are contiguous and named after it (a histogram's _bucket with an le label,
// _sum, _count; a summary's quantiles, _sum, _count); label values are escaped; values parse as
// floats. Returns "" or the problem.
std::string check_page(const std::string& page) {
  if (!page.empty() && page.back() != '\n') return "no final newline";
  static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*))");
  static const std::regex type(
      R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary))");
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
    } else if (fam_type == "summary") {
      if (name != fam && name != fam + "_sum" && name != fam + "_count")
        return where + "not a sample of summary " + fam;
    } else if (name != fam) {
      return where + "not a sample of " + fam;
    }
    if (!series.insert(name + labels).second) return where + "series written twice";
    const std::string v = m[m.size() - 1];
    if (v != "Nan" && v != "NaN" && v != "+Inf" && v != "-Inf") {
      char* end = nullptr;
      std::strtod(v.c_str(), &end);
      if (*end != 0) return where + "value does not parse";
    }
  }
  return "";
}

}  // namespace

TEST_CASE("the facade: series by name and labels, help, buckets, rendered by prometheus-cpp",
          "[metrics]") {
  Registry r;
  r.add_counter("a_total", "A counter.");
  r.counter("a_total").inc(3);
  r.counter("a_total", {{"z", "1"}, {"b", "x"}}).inc(0.5);  // labels written sorted by name
  r.add_gauge("g", "A gauge.");
  r.gauge("g").set(-2.5);
  r.gauge("g", {{"path", "C:\\dir\n\"q\""}}).set(1);            // escaped by the serializer
  r.add_histogram("h_seconds", "H.", {0.25, 1, 10, INFINITY});  // a trailing +Inf is implicit
  Histogram h = r.histogram("h_seconds", {{"op", "take"}});
  for (double v : {0.125, 0.25, 0.5, 100.0, std::nan("")}) h.observe(v);  // NaN ignored
  r.counter("nohelp_total").inc();  // registered by use: no HELP line
  r.add_gauge("empty", "a family with no series writes nothing");
  r.gauge("big").set(1e6);
  r.gauge("small").set(0.1);
  const std::string page = r.render();
  INFO(page);
  CHECK(check_page(page) == "");
  CHECK(has_line(page, "# HELP a_total A counter."));
  CHECK(has_line(page, "# TYPE a_total counter"));
  CHECK(has_line(page, "a_total 3"));
  CHECK(has_line(page, "a_total{b=\"x\",z=\"1\"} 0.5"));
  CHECK(has_line(page, "g -2.5"));
  CHECK(has_line(page, "g{path=\"C:\\\\dir\\n\\\"q\\\"\"} 1"));
  CHECK(has_line(page, "# TYPE h_seconds histogram"));
  CHECK(has_line(page, "h_seconds_bucket{op=\"take\",le=\"0.25\"} 2"));
  CHECK(has_line(page, "h_seconds_bucket{op=\"take\",le=\"1\"} 3"));
  CHECK(has_line(page, "h_seconds_bucket{op=\"take\",le=\"10\"} 3"));
  CHECK(has_line(page, "h_seconds_bucket{op=\"take\",le=\"+Inf\"} 4"));
  CHECK(page.find("le=\"inf\"") == std::string::npos);
  size_t infs = 0;
  for (size_t p = 0; (p = page.find("le=\"+Inf\"", p)) != std::string::npos; ++p) ++infs;
  CHECK(infs == 1);  // the +Inf given was dropped, not written twice
  CHECK(has_line(page, "h_seconds_sum{op=\"take\"} 100.875"));
  CHECK(has_line(page, "h_seconds_count{op=\"take\"} 4"));
  CHECK(has_line(page, "# TYPE nohelp_total counter"));
  CHECK(page.find("# HELP nohelp_total") == std::string::npos);
  CHECK(has_line(page, "nohelp_total 1"));
  CHECK(page.find("empty") == std::string::npos);
  CHECK(has_line(page, "big 1000000"));
  CHECK(has_line(page, "small 0.1"));
  // The same label set in another order is the same series.
  r.counter("a_total", {{"b", "x"}, {"z", "1"}}).inc(0.5);
  CHECK(has_line(r.render(), "a_total{b=\"x\",z=\"1\"} 1"));
  CHECK(Registry().render().empty());
  // collect() is what render() serializes; collectable() is the same registry.
  CHECK(render(r.collect()) == r.render());
  CHECK(render(r.collectable()->Collect()) == r.render());
}

TEST_CASE("counters never go down; gauges go both ways", "[metrics]") {
  Registry r;
  Counter c = r.counter("c_total");
  c.inc(2);
  c.inc(-1);
  c.inc(NAN);
  c.inc(0);
  CHECK(c.value() == 2);
  CHECK(r.counter("c_total").value() == 2);  // the same series
  Gauge g = r.gauge("g");
  g.inc(3);
  g.dec(5);
  CHECK(g.value() == -2);
  g.set(0.5);
  CHECK(r.gauge("g").value() == 0.5);
  CHECK(has_line(r.render(), "c_total 2"));
}

TEST_CASE("invalid names and registrations are refused with errors naming the metric",
          "[metrics]") {
  Registry r;
  // Names: prometheus-cpp's checks, the message names the metric and the rule.
  for (const char* bad : {"", "1abc", "a-b", "a b", "a.b", "__x"}) {
    INFO(bad);
    CHECK_THROWS_WITH(r.add_counter(bad, ""), Contains("metric '" + std::string(bad) + "'") &&
                                                  Contains("[a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  CHECK_THROWS_WITH(r.counter("a-b"), Contains("metric 'a-b'"));
  for (const char* bad : {"1a", "a:b", "a-b", "__name__"}) {
    INFO(bad);
    CHECK_THROWS_WITH(r.gauge("g", {{bad, "v"}}),
                      Contains("metric 'g'") && Contains("[a-zA-Z_][a-zA-Z0-9_]*"));
  }
  r.add_counter("job:rate5m", "");  // colons are fine in metric names
  r.add_counter("c_total", "");
  CHECK_THROWS_WITH(r.gauge("c_total"),
                    Contains("'c_total' is registered as a counter, not a gauge"));
  CHECK_THROWS_WITH(r.add_histogram("c_total", "", {1}), Contains("registered as a counter"));
  CHECK_THROWS_WITH(r.histogram("nope"), Contains("histogram 'nope' is not registered"));
  CHECK_THROWS_WITH(r.add_histogram("h", "", {1, 1}), Contains("histogram 'h'"));
  CHECK_THROWS_WITH(r.add_histogram("h", "", {2, 1}), Contains("histogram 'h'"));
  CHECK_THROWS_WITH(r.add_histogram("h", "", {1, NAN}), Contains("must be finite"));
  CHECK_THROWS_WITH(r.add_histogram("h", "", {-INFINITY, 1}), Contains("must be finite"));
  r.add_histogram("h", "", {1, 2, INFINITY});
  r.add_histogram("h", "again", {1, 2});  // same buckets: fine
  CHECK_THROWS_WITH(r.add_histogram("h", "", {1, 3}),
                    Contains("histogram 'h' is registered already with other buckets"));
  CHECK_THROWS_WITH(r.counter("h"), Contains("'h' is registered as a histogram, not a counter"));
  // Nothing refused was registered; what was is usable.
  r.histogram("h").observe(1);
  r.gauge("g", {{"ok", "v"}}).set(1);
  const std::string page = r.render();
  CHECK(page.find("1abc") == std::string::npos);
  CHECK(has_line(page, "h_count 1"));
  CHECK(has_line(page, "g{ok=\"v\"} 1"));
  CHECK(check_page(page) == "");
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
      Counter cached = r.counter(kHeartbeatsReceived);
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
  const std::string page = r.render();
  CHECK(has_line(page, "r2ccl_snapshot_heartbeats_received_total 200000"));
  CHECK(has_line(page, "t_seconds_bucket{le=\"0.5\"} 100000"));
  CHECK(has_line(page, "t_seconds_bucket{le=\"+Inf\"} 200000"));
  CHECK(has_line(page, "t_seconds_count 200000"));
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
  const std::string page = board_page(v);
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
  Page none;
  append_board_metrics(board::BoardView(), &none);
  CHECK(none.empty());
  // Strings from a corrupt board stay printable ASCII.
  board::BoardView bad;
  bad.rails.push_back(slot("a\x01\xff", 1, board::RailState::kUp, 0));
  const std::string junk = board_page(bad);
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

    const std::string page = board_page(name);
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
  const std::string page = board_page(name);
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
  const std::string page = store_page(s);
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

TEST_CASE("the board and store collectables read their source at every collection",
          "[metrics][board]") {
  const std::string name = "test-" + std::to_string(getpid()) + "-metcoll";
  board::remove_board(name);
  const auto board_coll = std::make_shared<BoardCollectable>(name);
  CHECK(render(board_coll->Collect()) == board_page(name));  // absent: readable 0
  CHECK(has_line(render(board_coll->Collect()), "r2ccl_snapshot_board_readable 0"));
  std::string err;
  {
    board::Publisher p;
    REQUIRE(p.open(name, &err));
    REQUIRE(p.publish(0, slot("eth0", 0, board::RailState::kUp, 10000).f));
    const std::string page = render(board_coll->Collect());
    INFO(page);
    CHECK(has_line(page, "r2ccl_snapshot_board_readable 1"));
    CHECK(has_line(page, "r2ccl_rail_up{pid=\"" + std::to_string(getpid()) +
                             "\",rail=\"eth0\",transport=\"tcp\"} 1"));
  }
  board::remove_board(name);

  r2ccl::snap::StoreStats s;
  int calls = 0;
  StoreCollectable store_coll([&] {
    ++calls;
    return s;
  });
  s.spills = 3;
  CHECK(has_line(render(store_coll.Collect()), "r2ccl_snapshot_store_spills_total 3"));
  s.spills = 4;
  CHECK(render(store_coll.Collect()) == store_page(s));
  CHECK(calls == 2);
  // Collect() never throws (an Exposer's worker thread calls it): nothing instead.
  StoreCollectable throwing([]() -> r2ccl::snap::StoreStats { throw std::runtime_error("x"); });
  CHECK(throwing.Collect().empty());
}

// ---- the /metrics endpoint ----------------------------------------------------------------------

namespace {

// The server with its event loop on a thread, as in the daemon.
struct Served {
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work = asio::make_work_guard(io);
  std::unique_ptr<HttpServer> srv;
  std::thread loop;
  uint16_t port = 0;
  explicit Served(HttpServer::RefreshFn refresh = {},
                  HttpServer::Options opt = HttpServer::Options()) {
    srv = std::make_unique<HttpServer>(io, std::move(refresh), opt);
  }
  void start(bool run_loop = true) {
    std::string err;
    REQUIRE(srv->listen("127.0.0.1:0", &err));
    port = srv->port();
    REQUIRE(port != 0);
    if (run_loop) loop = std::thread([this] { io.run(); });
  }
  ~Served() {
    if (loop.joinable()) {
      asio::post(io, [this] { srv->stop(); });
      work.reset();
      loop.join();
    }
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

// One HTTP/1.0 request (the server closes after the response).
Response http_get(uint16_t port, const std::string& path = "/metrics") {
  int fd = connect_to(port);
  send_all(fd, "GET " + path + " HTTP/1.0\r\nHost: x\r\n\r\n");
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

TEST_CASE("--metrics address parsing: numeric IPv4 and a port; errors name the accepted form",
          "[metrics][http]") {
  asio::ip::tcp::endpoint ep;
  std::string err;
  REQUIRE(parse_listen_address("127.0.0.1:9464", &ep, &err));
  CHECK(ep.address().to_string() == "127.0.0.1");
  CHECK(ep.port() == 9464);
  REQUIRE(parse_listen_address("0.0.0.0:0", &ep, &err));
  CHECK(ep.port() == 0);
  REQUIRE(parse_listen_address("10.1.2.3:65535", &ep, &err));
  CHECK(ep.port() == 65535);
  for (const char* bad :
       {"", "127.0.0.1", "127.0.0.1:", ":9464", "localhost:9464", "127.0.0.1:65536", "127.0.0.1:-1",
        "127.0.0.1:12a", "::1:80", "1.2.3:80", "256.0.0.1:80", "[::1]:9464", "[127.0.0.1]:80"}) {
    INFO(bad);
    err.clear();
    CHECK_FALSE(parse_listen_address(bad, &ep, &err));
    CHECK_THAT(err, Contains("'" + std::string(bad)) &&
                        Contains("accepted: ADDR:PORT with a numeric IPv4 address"));
  }
  CHECK_FALSE(parse_listen_address("[::1]:9464", &ep, &err));
  CHECK_THAT(err, Contains("IPv6 is not served"));
  CHECK_FALSE(parse_listen_address("localhost:9464", &ep, &err));
  CHECK_THAT(err, Contains("'localhost' is not a numeric IPv4 address"));
  CHECK_FALSE(parse_listen_address("127.0.0.1:70000", &ep, &err));
  CHECK_THAT(err, Contains("port '70000' is not 0-65535"));
}

TEST_CASE(
    "GET /metrics on 127.0.0.1 port 0: the registry, board and store collectables, refreshed "
    "on the loop thread at every scrape",
    "[metrics][http]") {
  Registry reg;
  register_standard(&reg);
  std::atomic<int> refreshes{0};
  std::thread::id refresh_thread;
  Served s([&] {
    refresh_thread = std::this_thread::get_id();
    reg.gauge(kLiveNodes).set(++refreshes);  // set at the scrape, seen by the same scrape
  });
  s.srv->add(reg.collectable());
  const std::string bname = "test-" + std::to_string(getpid()) + "-methttp";
  board::remove_board(bname);
  s.srv->add(std::make_shared<BoardCollectable>(bname));
  r2ccl::snap::StoreStats st;
  st.memory_bytes = 4096;
  s.srv->add(std::make_shared<StoreCollectable>([st] { return st; }));
  CHECK(s.srv->port() == 0);  // not listening yet
  s.start();
  CHECK(s.srv->endpoint().address().to_string() == "127.0.0.1");

  Response r = http_get(s.port);
  INFO(r.head << r.body);
  CHECK(r.status == "HTTP/1.1 200 OK");
  CHECK_THAT(r.header("Content-Type"), Contains("text/plain"));
  CHECK(r.header("Content-Length") == std::to_string(r.body.size()));
  CHECK(check_page(r.body) == "");
  CHECK(has_line(r.body, "r2ccl_snapshot_live_nodes 1"));
  CHECK(has_line(r.body, "# TYPE r2ccl_snapshot_heartbeats_sent_total counter"));
  CHECK(has_line(r.body, "r2ccl_snapshot_take_seconds_bucket{le=\"+Inf\"} 0"));
  CHECK(has_line(r.body, "r2ccl_snapshot_board_readable 0"));
  CHECK(has_line(r.body, "r2ccl_snapshot_store_memory_bytes 4096"));
  CHECK(has_line(r.body, "# TYPE exposer_scrapes_total counter"));  // prometheus-cpp's own
  CHECK(refresh_thread == s.loop.get_id());

  reg.counter(kHeartbeatsSent).inc(2);
  r = http_get(s.port);
  CHECK(r.status == "HTTP/1.1 200 OK");
  CHECK(has_line(r.body, "r2ccl_snapshot_live_nodes 2"));
  CHECK(has_line(r.body, "r2ccl_snapshot_heartbeats_sent_total 2"));

  // A collectable added while serving is on the next page; one that throws is left out and
  // counted, the rest of the page is served.
  struct Throws : prometheus::Collectable {
    Page Collect() const override { throw std::runtime_error("collectable exploded"); }
  };
  s.srv->add(std::make_shared<Throws>());
  Registry late;
  late.gauge("late_gauge").set(7);
  s.srv->add(late.collectable());
  r = http_get(s.port);
  CHECK(r.status == "HTTP/1.1 200 OK");
  CHECK(has_line(r.body, "late_gauge 7"));
  CHECK(has_line(r.body, "r2ccl_snapshot_live_nodes 3"));
  CHECK(check_page(r.body) == "");

  // Other paths are not the metrics.
  r = http_get(s.port, "/");
  CHECK_THAT(r.status, Contains(" 404 Not Found"));
  CHECK(r.body.find("r2ccl_snapshot") == std::string::npos);

  for (int i = 0; i < 20; ++i) CHECK(http_get(s.port).status == "HTTP/1.1 200 OK");
  const HttpServer::Stats stats = s.srv->stats();
  CHECK(stats.scrapes == 23);
  CHECK(stats.refresh_timeouts == 0);
  CHECK(stats.collect_errors == 21);
  CHECK(refreshes == 23);

  // Another server cannot take the same port: the error names the address and the reason.
  asio::io_context io2;
  HttpServer other(io2);
  std::string err;
  CHECK_FALSE(other.listen("127.0.0.1:" + std::to_string(s.port), &err));
  CHECK_THAT(err, Contains("cannot listen on 127.0.0.1:" + std::to_string(s.port) + ": ") &&
                      Contains("in use"));
  CHECK_FALSE(other.listen("[::1]:0", &err));
  CHECK_THAT(err, Contains("IPv6 is not served") && Contains("accepted: ADDR:PORT"));
  CHECK_FALSE(other.listen("203.0.113.1:9", &err));  // not an address of this host
  CHECK_THAT(err, Contains("cannot listen on 203.0.113.1:9: "));
  CHECK(other.port() == 0);
}

TEST_CASE("a loop that does not run its refresh delays a scrape by refresh_timeout only",
          "[metrics][http]") {
  Registry reg;
  reg.gauge("g").set(5);
  bool refreshed = false;
  HttpServer::Options opt;
  opt.refresh_timeout = std::chrono::milliseconds(300);
  Served s([&] { refreshed = true; }, opt);
  s.srv->add(reg.collectable());
  s.start(/*run_loop=*/false);  // nobody runs io
  const auto t0 = std::chrono::steady_clock::now();
  const Response r = http_get(s.port);
  CHECK(r.status == "HTTP/1.1 200 OK");
  CHECK(has_line(r.body, "g 5"));
  CHECK(seconds_since(t0) >= 0.29);
  CHECK(seconds_since(t0) < 3.0);
  CHECK(s.srv->stats().refresh_timeouts == 1);
  // stop() while the loop still holds the posted refreshes: they find the server stopped.
  s.srv->stop();
  CHECK(s.srv->port() == 0);
  s.io.poll();
  CHECK_FALSE(refreshed);
}

TEST_CASE("a silent client neither blocks a scrape nor outlives its deadline; stop() closes",
          "[metrics][http]") {
  HttpServer::Options opt;
  opt.timeout = std::chrono::milliseconds(1000);
  Registry reg;
  reg.gauge("up").set(1);
  Served s({}, opt);
  s.srv->add(reg.collectable());
  s.start();

  auto t0 = std::chrono::steady_clock::now();
  int silent = connect_to(s.port);      // connects, sends nothing
  const Response r = http_get(s.port);  // served by the other worker thread at once
  CHECK(r.status == "HTTP/1.1 200 OK");
  CHECK(has_line(r.body, "up 1"));
  CHECK(seconds_since(t0) < 0.9);
  // civetweb closes it at its deadline (recv sees EOF, not our 5 s timeout).
  CHECK(read_all(silent).find("200 OK") == std::string::npos);
  const double waited = seconds_since(t0);
  CHECK(waited >= 0.9);
  CHECK(waited < 4.0);
  close(silent);

  // stop(): the port is closed.
  asio::post(s.io, [&] { s.srv->stop(); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bool refused = false;
  while (!refused && std::chrono::steady_clock::now() < deadline) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(s.port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    refused = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0;
    close(fd);
    if (!refused) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(refused);
}
