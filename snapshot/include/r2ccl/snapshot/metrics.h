// Prometheus metrics of r2ccl_snapshotd (issue 6). prometheus-cpp is not packaged in Debian 12,
// so the daemon serves the text exposition format (version 0.0.4) itself: this registry renders
// it, and metrics_http.h serves it over HTTP.
//
// Format written (exposition format 0.0.4):
//   - per metric family, in registration order: "# HELP name text" (only when the family has
//     a help text; backslash -> \\ and newline -> \n), "# TYPE name counter|gauge|histogram",
//     then its samples, all lines of a family together; every line ends with '\n';
//   - a sample is `name{label="value",...} value`, no timestamp; labels are sorted by name
//     (histograms' `le` last); a label value escapes backslash (\\), double quote (\") and
//     newline (\n); an empty label set writes no braces;
//   - values: integers as integers ("42"), others in the shortest form that reads back to the
//     same double ("0.25", "1e+21"), "NaN", "+Inf", "-Inf";
//   - a histogram writes `name_bucket{...,le="B"}` cumulatively for every bucket bound B and
//     le="+Inf" (== count), then `name_sum` and `name_count`;
//   - a family with no series yet writes nothing.
//
// Names: metric names match [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]* and do
// not start with "__" (reserved by Prometheus); a histogram may not have an `le` label. The
// registry refuses anything else with std::invalid_argument naming the name and the rule
// (registration is a setup path; use the k* constants below so a typo is a compile error).
//
// Thread-safety: every method may be called from any thread. The registry's mutex guards the
// families and their series; Counter and Gauge are lock-free atomics; a Histogram has its own
// mutex (render reads bucket counts, sum and count consistently). References returned by
// counter()/gauge()/histogram() stay valid as long as the Registry lives (series are never
// removed): keep them for hot paths instead of looking the name up on every event.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace r2ccl::board {
struct BoardView;  // r2ccl/health_board.h
}

namespace r2ccl::snap {
struct StoreStats;  // r2ccl/snapshot/shard_store.h

namespace metrics {

// A label set: (name, value) pairs in any order (the registry sorts them by name; a name may
// appear once).
using Labels = std::vector<std::pair<std::string, std::string>>;

// Monotonic. inc() of a negative or NaN amount is ignored (a counter never goes down).
class Counter {
 public:
  void inc(double v = 1);
  double value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

class Gauge {
 public:
  void set(double v) { v_.store(v, std::memory_order_relaxed); }
  void inc(double v = 1);
  void dec(double v = 1) { inc(-v); }
  double value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

// Fixed buckets (upper bounds, given at registration). observe(v) counts v in the first bucket
// with v <= bound (or only in +Inf); NaN observations are ignored.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  struct Snapshot {
    std::vector<double> bounds;        // without +Inf
    std::vector<uint64_t> cumulative;  // per bound, cumulative; size() == bounds.size()
    uint64_t count = 0;                // == the +Inf bucket
    double sum = 0;
  };
  Snapshot snapshot() const;

 private:
  const std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bound, not cumulative; mu_
  uint64_t count_ = 0;            // mu_
  double sum_ = 0;                // mu_
};

enum class Type { kCounter, kGauge, kHistogram };

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registers a family (no series yet). Registering a name again with the same type (and, for
  // histograms, the same buckets) is a no-op that may set a missing help text. Throws
  // std::invalid_argument: a name not matching the rule, a name already registered with
  // another type or other buckets, a histogram's name_bucket/_sum/_count clashing with another
  // family (either way round), bucket bounds not finite and strictly increasing (a trailing
  // +Inf is accepted and dropped).
  void add_counter(const std::string& name, const std::string& help);
  void add_gauge(const std::string& name, const std::string& help);
  void add_histogram(const std::string& name, const std::string& help,
                     const std::vector<double>& bounds);

  // The series of `name` with `labels`, created at the first call. A counter or gauge family
  // not registered yet is registered (without help); a histogram must be registered first
  // (its buckets). Throws std::invalid_argument for an invalid or duplicate label name, a
  // name registered with another type, or an unregistered histogram.
  Counter& counter(const std::string& name, const Labels& labels = {});
  Gauge& gauge(const std::string& name, const Labels& labels = {});
  Histogram& histogram(const std::string& name, const Labels& labels = {});

  // The whole registry in the text exposition format (see the top of this file).
  std::string render() const;

 private:
  struct Family;
  Family& family_locked(const std::string& name, Type type, const std::string& help,
                        const std::vector<double>* bounds, bool create);
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Family>> families_;  // registration order
  std::map<std::string, Family*> by_name_;
};

// ---- helpers shared with append_board_metrics (and usable by the daemon) --------------------
bool valid_metric_name(const std::string& s);
bool valid_label_name(const std::string& s);
std::string escape_label_value(const std::string& s);  // \ " newline
std::string escape_help(const std::string& s);         // \ newline
std::string format_value(double v);                    // "42", "0.25", "NaN", "+Inf", "-Inf"
const char* type_name(Type t);                         // "counter", "gauge", "histogram"

// ---- the daemon's standard metrics ------------------------------------------------------------
// Counters end in _total; sizes are bytes, times seconds (Prometheus base units).
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

// ---- metrics rendered at scrape time from other state ------------------------------------------
// These append complete families (HELP, TYPE, samples) to *out; their names must not be
// registered in a Registry rendered into the same page.
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
// A slot or sampler rail whose (name, pid) / name was already written is skipped (a series is
// never written twice).
void append_board_metrics(const board::BoardView& v, std::string* out);
// Reads the board `board_name` and appends the above, plus r2ccl_snapshot_board_readable
// (gauge: 1 when the board was read, 0 when absent or unusable; nothing else then).
void append_board_metrics(const std::string& board_name, std::string* out);

// From the shard store (ShardStore::stats()):
//   r2ccl_snapshot_store_memory_bytes, _spilled_bytes, _memory_shards, _spilled_shards  gauges
//   r2ccl_snapshot_store_spills_total, _spill_failures_total, _files_skipped_total,
//   r2ccl_snapshot_store_pruned_total                                                    counters
//   r2ccl_snapshot_store_crc_failures_total{when="put"|"get"}                            counter
void append_store_metrics(const StoreStats& s, std::string* out);

}  // namespace metrics
}  // namespace r2ccl::snap
