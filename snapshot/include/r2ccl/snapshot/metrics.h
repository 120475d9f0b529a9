// Prometheus metrics of r2ccl_snapshotd (issue 6), on prometheus-cpp (Debian 12:
// prometheus-cpp-dev 1.0.1; CMake package prometheus-cpp). This header is a thin facade over
// prometheus::Registry and its Family<Counter|Gauge|Histogram>, so that the daemon looks a
// metric up by name (the k* constants below) and increments it in one line; metrics_http.h
// serves the page with prometheus::Exposer.
//
// Format: prometheus-cpp's TextSerializer (text exposition format 0.0.4): per family "# HELP"
// (when the family has a help text), "# TYPE", then its samples; labels sorted by name
// (a histogram's `le` last); label values escaped (backslash, double quote, newline);
// a histogram writes _count, _sum, then its cumulative _bucket series up to le="+Inf". A family
// with no series writes nothing. Help texts are written as given: keep them on one line,
// without backslashes (prometheus-cpp 1.0.1 does not escape them).
//
// Units: counters end in _total; sizes are bytes, times seconds (Prometheus base units).
//
// Errors: a metric name not matching [a-zA-Z_:][a-zA-Z0-9_:]*, a label name not matching
// [a-zA-Z_][a-zA-Z0-9_]* or starting with "__" (prometheus-cpp's CheckMetricName and
// CheckLabelName), a name registered already with another type or other buckets, histogram
// bounds not finite and strictly increasing: std::invalid_argument naming the metric
// (registration is a setup path; use the k* constants so that a typo is a compile error).
// Nothing checks that one family's sample names (a histogram's name_count...) do not clash
// with another's: the standard set and the scrape-time families below are tested not to.
//
// Thread-safety: every function and method may be called from any thread (prometheus-cpp's
// registry, families and histograms have their own mutexes; counters and gauges are atomics).
// The handles returned by counter()/gauge()/histogram() stay valid as long as the Registry
// lives (series are never removed): keep one for a hot path instead of looking the name up
// on every event.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/labels.h>
#include <prometheus/metric_family.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace r2ccl::board {
struct BoardView;  // r2ccl/health_board.h
}

namespace r2ccl::snap {
struct StoreStats;  // r2ccl/snapshot/shard_store.h

namespace metrics {

// A label set: name -> value (std::map: sorted, a name once).
using Labels = prometheus::Labels;
// Metric families, as collected for one page (prometheus::Collectable::Collect's result).
using Page = std::vector<prometheus::MetricFamily>;

// The page in the text exposition format (prometheus::TextSerializer).
std::string render(const Page& page);

// Monotonic. inc() of a negative or NaN amount is ignored (a counter never goes down).
class Counter {
 public:
  void inc(double v = 1);
  double value() const;

 private:
  friend class Registry;
  explicit Counter(prometheus::Counter* c) : c_(c) {}
  prometheus::Counter* c_;
};

class Gauge {
 public:
  void set(double v);
  void inc(double v = 1);
  void dec(double v = 1) { inc(-v); }
  double value() const;

 private:
  friend class Registry;
  explicit Gauge(prometheus::Gauge* g) : g_(g) {}
  prometheus::Gauge* g_;
};

// Fixed buckets (upper bounds, given at registration). observe(v) counts v in the first bucket
// with v <= bound (or only in +Inf); NaN observations are ignored.
class Histogram {
 public:
  void observe(double v);

 private:
  friend class Registry;
  explicit Histogram(prometheus::Histogram* h) : h_(h) {}
  prometheus::Histogram* h_;
};

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registers a family (no series yet). Registering a name again with the same type (and, for
  // histograms, the same buckets) is a no-op (the first help text stays). A trailing +Inf
  // bound is accepted and dropped (it is implicit). Throws std::invalid_argument (see the top).
  void add_counter(const std::string& name, const std::string& help);
  void add_gauge(const std::string& name, const std::string& help);
  void add_histogram(const std::string& name, const std::string& help,
                     const std::vector<double>& bounds);

  // The series of `name` with `labels`, created at the first call. A counter or gauge family
  // not registered yet is registered (without help); a histogram must be registered first
  // (its buckets). Throws std::invalid_argument for an invalid label name, a name registered
  // with another type, or an unregistered histogram.
  Counter counter(const std::string& name, const Labels& labels = {});
  Gauge gauge(const std::string& name, const Labels& labels = {});
  Histogram histogram(const std::string& name, const Labels& labels = {});

  // Every family with at least one series: counters, then gauges, then histograms, each in
  // registration order (prometheus::Registry::Collect).
  Page collect() const;
  // render(collect()).
  std::string render() const;
  // The prometheus::Registry itself, for an Exposer (HttpServer::add). Shares its ownership.
  std::shared_ptr<prometheus::Collectable> collectable() const;

 private:
  using FamilyPtr =
      std::variant<prometheus::Family<prometheus::Counter>*, prometheus::Family<prometheus::Gauge>*,
                   prometheus::Family<prometheus::Histogram>*>;
  struct Entry {
    FamilyPtr family;
    std::vector<double> bounds;  // histograms
  };
  template <typename T>
  prometheus::Family<T>& family(const std::string& name, const std::string& help, bool create);

  std::shared_ptr<prometheus::Registry> reg_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> families_;  // mu_
};

// ---- the daemon's standard metrics ------------------------------------------------------------
inline constexpr const char* kShardBytesReceived = "r2ccl_snapshot_shard_bytes_received_total";
inline constexpr const char* kShardBytesSent = "r2ccl_snapshot_shard_bytes_sent_total";
inline constexpr const char* kShardsReceived = "r2ccl_snapshot_shards_received_total";
inline constexpr const char* kShardsSent = "r2ccl_snapshot_shards_sent_total";
inline constexpr const char* kTakeBytes = "r2ccl_snapshot_take_bytes";      // histogram
inline constexpr const char* kTakeSeconds = "r2ccl_snapshot_take_seconds";  // histogram
inline constexpr const char* kTakes = "r2ccl_snapshot_takes_total";
inline constexpr const char* kTakeFailures = "r2ccl_snapshot_take_failures_total";
inline constexpr const char* kReplicationLag = "r2ccl_snapshot_replication_lag_seconds";
inline constexpr const char* kNewestCompleteStep = "r2ccl_snapshot_newest_complete_step";
inline constexpr const char* kHeartbeatsSent = "r2ccl_snapshot_heartbeats_sent_total";
inline constexpr const char* kHeartbeatsReceived = "r2ccl_snapshot_heartbeats_received_total";
inline constexpr const char* kHeartbeatsMissed = "r2ccl_snapshot_heartbeats_missed_total";
inline constexpr const char* kNodesFailed = "r2ccl_snapshot_nodes_failed_total";
inline constexpr const char* kNodesRejoined = "r2ccl_snapshot_nodes_rejoined_total";
inline constexpr const char* kRecoveries = "r2ccl_snapshot_recoveries_total";
inline constexpr const char* kPeersRefused = "r2ccl_snapshot_peer_connections_refused_total";
inline constexpr const char* kMembershipEpoch = "r2ccl_snapshot_membership_epoch";
inline constexpr const char* kLiveNodes = "r2ccl_snapshot_live_nodes";
inline constexpr const char* kConfiguredNodes = "r2ccl_snapshot_configured_nodes";
inline constexpr const char* kCoordinator = "r2ccl_snapshot_coordinator";  // 1 while acting

// Bucket bounds of the standard histograms.
std::vector<double> take_bytes_buckets();    // 1 MiB, 4 MiB, ... 64 GiB (powers of 4)
std::vector<double> take_seconds_buckets();  // 0.01 s .. 120 s

// Registers the standard families above with their help texts and creates each one's series
// without labels at 0 (so that rate() and absent() work from the first scrape), except
// kReplicationLag and kNewestCompleteStep, absent until the daemon first sets them. Idempotent
// (values already set are kept).
void register_standard(Registry* r);

// ---- metrics collected at scrape time from other state -----------------------------------------
// These append complete families to *out (only families with at least one sample); their names
// must not be registered in a Registry served on the same page. Strings from the board are
// kept to printable ASCII ('?' for other bytes: a corrupt board must not make the page invalid
// UTF-8).
//
// From a node's health board (read_board()):
//   per live slot (one net plugin process's rail), labels rail=<name>, pid=<owner pid>:
//     r2ccl_rail_up{rail,pid,transport}   gauge  1 when the state is up, else 0
//     r2ccl_rail_state{rail,pid,state}    gauge  one series per state (up, failed, down,
//                                                draining, unknown): 1 for the rail's state, 0
//                                                for the others ("state set")
//     r2ccl_rail_usable_bandwidth_bytes_per_second{rail,pid}  gauge (usable_mbps * 125000)
//     r2ccl_rail_bytes_sent_total, _switchovers_total, _failbacks_total,
//     r2ccl_rail_chunks_replayed_total{rail,pid}              counters (per process)
//   per rail of the live failure-predictor sampler (node-wide, one per rail name; no pid:
//   the sampler process may change), label rail=<name>:
//     r2ccl_rail_failure_risk{rail,source}  gauge 0..1 (skipped while unknown, -1)
//     r2ccl_rail_ccl_retransmit_ratio{rail} gauge 0..1 (skipped while unknown, -1)
//     r2ccl_rail_drain{rail}                gauge 1 while the sampler drains the rail, else 0
//   the agreed record (only when one was read: has_agreed):
//     r2ccl_snapshot_agreed_epoch           gauge
//     r2ccl_snapshot_agreed_members         gauge (member_count)
//     r2ccl_snapshot_agreed_nodes           gauge (n_nodes, the nodes in the job)
//     r2ccl_snapshot_agreed_node_usable_bandwidth_bytes_per_second{node}  gauge, per member
// A slot or sampler rail whose (name, pid) / name was already appended is skipped (a series is
// never written twice).
void append_board_metrics(const board::BoardView& v, Page* out);
// Reads the board `board_name` and appends the above, plus r2ccl_snapshot_board_readable
// (gauge: 1 when the board was read, 0 when absent or unusable; nothing else then).
void append_board_metrics(const std::string& board_name, Page* out);

// From the shard store (ShardStore::stats()):
//   r2ccl_snapshot_store_memory_bytes, _spilled_bytes, _memory_shards, _spilled_shards  gauges
//   r2ccl_snapshot_store_spills_total, _spill_failures_total, _files_skipped_total,
//   r2ccl_snapshot_store_pruned_total                                                    counters
//   r2ccl_snapshot_store_crc_failures_total{when="put"|"get"}                            counter
void append_store_metrics(const StoreStats& s, Page* out);

// The same as collectables, read at every scrape (on the scraping thread: read_board() and
// ShardStore::stats() may be called from any thread). Collect() never throws (an Exposer's
// worker thread calls it): on an exception it returns nothing.
class BoardCollectable : public prometheus::Collectable {
 public:
  explicit BoardCollectable(std::string board_name) : board_(std::move(board_name)) {}
  Page Collect() const override;

 private:
  const std::string board_;
};

class StoreCollectable : public prometheus::Collectable {
 public:
  using StatsFn = std::function<StoreStats()>;  // called from the scraping thread
  explicit StoreCollectable(StatsFn stats) : stats_(std::move(stats)) {}
  Page Collect() const override;

 private:
  const StatsFn stats_;
};

}  // namespace metrics
}  // namespace r2ccl::snap
