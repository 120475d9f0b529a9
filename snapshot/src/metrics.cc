// Prometheus metrics of r2ccl_snapshotd on prometheus-cpp: the registry facade, the standard
// set, and the families collected at scrape time from the health board and the shard store.
// See metrics.h.
#include "r2ccl/snapshot/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/shard_store.h"

namespace r2ccl::snap::metrics {

namespace {

using prometheus::MetricType;

const char* type_name(MetricType t) {
  switch (t) {
    case MetricType::Counter: return "counter";
    case MetricType::Gauge: return "gauge";
    case MetricType::Histogram: return "histogram";
    default: return "other type";
  }
}

// prometheus-cpp's public builders, by type.
template <typename T>
prometheus::detail::Builder<T> build();
template <>
prometheus::detail::Builder<prometheus::Counter> build() {
  return prometheus::BuildCounter();
}
template <>
prometheus::detail::Builder<prometheus::Gauge> build() {
  return prometheus::BuildGauge();
}
template <>
prometheus::detail::Builder<prometheus::Histogram> build() {
  return prometheus::BuildHistogram();
}

// prometheus-cpp's messages do not name the metric ("Invalid metric name"): add it.
[[noreturn]] void rethrow_named(const std::string& name, const std::exception& e) {
  throw std::invalid_argument("metric '" + name + "': " + e.what() +
                              " (metric names: [a-zA-Z_:][a-zA-Z0-9_:]*; label names: "
                              "[a-zA-Z_][a-zA-Z0-9_]*, not starting with __)");
}

// Board strings come from shared memory: keep printable ASCII only (a corrupt board must not
// make the page invalid UTF-8).
std::string board_text(const char* s) {
  std::string r(s);
  for (char& c : r)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  return r;
}

// One family appended at scrape time; added to the page at the end of its scope, and only when
// it has a sample (as a registry's family without series is not collected).
class AppendFamily {
 public:
  AppendFamily(Page* out, const char* name, const char* help, MetricType t) : out_(out) {
    f_.name = name;
    f_.help = help;
    f_.type = t;
  }
  ~AppendFamily() {
    if (!f_.metric.empty()) out_->push_back(std::move(f_));
  }
  AppendFamily(const AppendFamily&) = delete;
  AppendFamily& operator=(const AppendFamily&) = delete;

  AppendFamily& sample(const Labels& labels, double v) {
    prometheus::ClientMetric m;
    for (const auto& [k, val] : labels) m.label.push_back({k, val});  // sorted (std::map)
    if (f_.type == MetricType::Counter)
      m.counter.value = v;
    else
      m.gauge.value = v;
    f_.metric.push_back(std::move(m));
    return *this;
  }

 private:
  Page* out_;
  prometheus::MetricFamily f_;
};

}  // namespace

std::string render(const Page& page) { return prometheus::TextSerializer().Serialize(page); }

// ---- series ----------------------------------------------------------------------------------

void Counter::inc(double v) {
  if (!(v >= 0)) return;  // negative or NaN: a counter never goes down
  c_->Increment(v);
}
double Counter::value() const { return c_->Value(); }

void Gauge::set(double v) { g_->Set(v); }
void Gauge::inc(double v) { g_->Increment(v); }
double Gauge::value() const { return g_->Value(); }

void Histogram::observe(double v) {
  if (std::isnan(v)) return;
  h_->Observe(v);
}

// ---- registry --------------------------------------------------------------------------------

Registry::Registry() : reg_(std::make_shared<prometheus::Registry>()) {}
Registry::~Registry() = default;

// The family of `name` and type T: the registered one, or (create) a new one. mu_ held.
template <typename T>
prometheus::Family<T>& Registry::family(const std::string& name, const std::string& help,
                                        bool create) {
  auto it = families_.find(name);
  if (it != families_.end()) {
    if (auto* f = std::get_if<prometheus::Family<T>*>(&it->second.family)) return **f;
    static const char* const kinds[] = {"counter", "gauge", "histogram"};  // FamilyPtr's order
    throw std::invalid_argument("metric '" + name + "' is registered as a " +
                                kinds[it->second.family.index()] + ", not a " +
                                type_name(T::metric_type));
  }
  if (!create)
    throw std::invalid_argument("histogram '" + name +
                                "' is not registered (add_histogram names its buckets)");
  try {
    auto& f = build<T>().Name(name).Help(help).Register(*reg_);
    families_[name].family = &f;
    return f;
  } catch (const std::exception& e) {
    rethrow_named(name, e);
  }
}

void Registry::add_counter(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> g(mu_);
  family<prometheus::Counter>(name, help, true);
}

void Registry::add_gauge(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> g(mu_);
  family<prometheus::Gauge>(name, help, true);
}

void Registry::add_histogram(const std::string& name, const std::string& help,
                             const std::vector<double>& bounds) {
  std::vector<double> b = bounds;
  if (!b.empty() && std::isinf(b.back()) && b.back() > 0) b.pop_back();  // +Inf is implicit
  for (double v : b)
    if (!std::isfinite(v))
      throw std::invalid_argument("histogram '" + name +
                                  "': bucket bounds must be finite (+Inf is implicit, and "
                                  "accepted last)");
  try {
    prometheus::Histogram check(b);  // strictly increasing, or std::invalid_argument
  } catch (const std::exception& e) {
    throw std::invalid_argument("histogram '" + name + "': " + e.what());
  }
  std::lock_guard<std::mutex> g(mu_);
  auto it = families_.find(name);
  if (it != families_.end() &&
      std::holds_alternative<prometheus::Family<prometheus::Histogram>*>(it->second.family) &&
      it->second.bounds != b)
    throw std::invalid_argument("histogram '" + name +
                                "' is registered already with other buckets");
  family<prometheus::Histogram>(name, help, true);
  families_[name].bounds = b;
}

Counter Registry::counter(const std::string& name, const Labels& labels) {
  std::lock_guard<std::mutex> g(mu_);
  auto& f = family<prometheus::Counter>(name, "", true);
  try {
    return Counter(&f.Add(labels));
  } catch (const std::exception& e) {
    rethrow_named(name, e);
  }
}

Gauge Registry::gauge(const std::string& name, const Labels& labels) {
  std::lock_guard<std::mutex> g(mu_);
  auto& f = family<prometheus::Gauge>(name, "", true);
  try {
    return Gauge(&f.Add(labels));
  } catch (const std::exception& e) {
    rethrow_named(name, e);
  }
}

Histogram Registry::histogram(const std::string& name, const Labels& labels) {
  std::lock_guard<std::mutex> g(mu_);
  auto& f = family<prometheus::Histogram>(name, "", false);
  try {
    return Histogram(&f.Add(labels, families_[name].bounds));
  } catch (const std::exception& e) {
    rethrow_named(name, e);
  }
}

Page Registry::collect() const { return reg_->Collect(); }

std::string Registry::render() const { return metrics::render(collect()); }

std::shared_ptr<prometheus::Collectable> Registry::collectable() const { return reg_; }

// ---- the daemon's standard set ---------------------------------------------------------------

std::vector<double> take_bytes_buckets() {
  std::vector<double> b;
  for (double v = 1 << 20; v <= 64.0 * (1ull << 30); v *= 4) b.push_back(v);  // 1 MiB..64 GiB
  return b;
}

std::vector<double> take_seconds_buckets() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
}

void register_standard(Registry* r) {
  struct Def {
    const char* name;
    MetricType type;
    const char* help;
    bool precreate = true;  // the unlabelled series exists (at 0) from the first scrape
  };
  static const Def defs[] = {
      {kShardBytesReceived, MetricType::Counter,
       "Snapshot shard payload bytes received from peers."},
      {kShardBytesSent, MetricType::Counter, "Snapshot shard payload bytes sent to peers."},
      {kShardsReceived, MetricType::Counter, "Snapshot shards received from peers."},
      {kShardsSent, MetricType::Counter, "Snapshot shards sent to peers."},
      {kTakes, MetricType::Counter, "Snapshots taken (take() calls completed)."},
      {kTakeFailures, MetricType::Counter, "Snapshots that failed."},
      {kReplicationLag, MetricType::Gauge,
       "Seconds since the newest fully replicated snapshot step was taken (absent until one "
       "is).",
       false},
      {kNewestCompleteStep, MetricType::Gauge,
       "The newest complete (restorable) snapshot step (absent until one is).", false},
      {kHeartbeatsSent, MetricType::Counter, "Heartbeats sent to peers."},
      {kHeartbeatsReceived, MetricType::Counter, "Heartbeats received from peers."},
      {kHeartbeatsMissed, MetricType::Counter,
       "Heartbeat periods in which a live peer was not heard."},
      {kNodesFailed, MetricType::Counter, "Peers declared failed (3 missed heartbeat periods)."},
      {kNodesRejoined, MetricType::Counter, "Failed peers heard again (rejoined)."},
      {kRecoveries, MetricType::Counter, "Recoveries (communicator rebuild and restore) run."},
      {kPeersRefused, MetricType::Counter,
       "Peer connections refused (wrong token, unknown node, bad protocol)."},
      {kMembershipEpoch, MetricType::Gauge, "The highest membership (agreed record) epoch seen."},
      {kLiveNodes, MetricType::Gauge, "Nodes this daemon sees live, itself included."},
      {kConfiguredNodes, MetricType::Gauge, "Nodes in the peer list."},
      {kCoordinator, MetricType::Gauge,
       "1 while this daemon acts as coordinator (lowest live id with a majority), else 0."},
  };
  for (const Def& d : defs) {
    if (d.type == MetricType::Counter) {
      r->add_counter(d.name, d.help);
      if (d.precreate) r->counter(d.name);
    } else {
      r->add_gauge(d.name, d.help);
      if (d.precreate) r->gauge(d.name);
    }
  }
  r->add_histogram(kTakeBytes, "Encoded bytes of one snapshot (all buffers of this rank).",
                   take_bytes_buckets());
  r->histogram(kTakeBytes);
  r->add_histogram(kTakeSeconds, "Seconds one take() ran (encode and hand-off).",
                   take_seconds_buckets());
  r->histogram(kTakeSeconds);
}

// ---- scrape-time metrics ---------------------------------------------------------------------

void append_board_metrics(const board::BoardView& v, Page* out) {
  using board::RailState;
  // Per slot, deduplicated by (name, pid).
  std::vector<const board::RailSlot*> slots;
  {
    std::set<std::pair<std::string, int32_t>> seen;
    for (const auto& s : v.rails)
      if (seen.insert({board_text(s.f.name), s.pid}).second) slots.push_back(&s);
  }
  auto ids = [](const board::RailSlot& s) {
    return Labels{{"rail", board_text(s.f.name)}, {"pid", std::to_string(s.pid)}};
  };
  {
    AppendFamily f(out, "r2ccl_rail_up",
                   "1 when the rail is up, else 0 (failed, down, draining, "
                   "unknown); one series per net plugin process and rail.",
                   MetricType::Gauge);
    for (const auto* s : slots) {
      Labels l = ids(*s);
      l.emplace("transport", board::transport_name(s->f.transport));
      f.sample(l, s->f.state == RailState::kUp ? 1 : 0);
    }
  }
  {
    AppendFamily f(out, "r2ccl_rail_state",
                   "The rail's state as published by its process: 1 for the current state, 0 "
                   "for the others.",
                   MetricType::Gauge);
    const RailState all[] = {RailState::kUp, RailState::kFailed, RailState::kDown,
                             RailState::kDraining, RailState::kUnknown};
    for (const auto* s : slots)
      for (RailState st : all) {
        Labels l = ids(*s);
        l.emplace("state", board::state_name(st));
        f.sample(l, s->f.state == st ? 1 : 0);
      }
  }
  {
    AppendFamily f(out, "r2ccl_rail_usable_bandwidth_bytes_per_second",
                   "Usable bandwidth of the rail now (0 while down).", MetricType::Gauge);
    for (const auto* s : slots) f.sample(ids(*s), s->f.usable_mbps * 125000.0);
  }
  struct CounterDef {
    const char* name;
    const char* help;
    uint64_t board::RailFields::*field;
  };
  static const CounterDef counters[] = {
      {"r2ccl_rail_bytes_sent_total", "Bytes sent on the rail by this process.",
       &board::RailFields::bytes_sent},
      {"r2ccl_rail_switchovers_total", "Switchovers away from the rail in this process.",
       &board::RailFields::switchovers},
      {"r2ccl_rail_failbacks_total", "Failbacks to the rail in this process.",
       &board::RailFields::failbacks},
      {"r2ccl_rail_chunks_replayed_total", "Chunks replayed on another rail after a failure.",
       &board::RailFields::chunks_replayed},
  };
  for (const CounterDef& d : counters) {
    AppendFamily f(out, d.name, d.help, MetricType::Counter);
    for (const auto* s : slots) f.sample(ids(*s), static_cast<double>(s->f.*d.field));
  }

  // The failure predictor's sampler: node-wide, one entry per rail name.
  std::vector<const board::RiskEntry*> risks;
  if (v.has_sampler) {
    std::set<std::string> seen;
    for (const auto& e : v.sampler.rails)
      if (seen.insert(board_text(e.rail)).second) risks.push_back(&e);
  }
  {
    AppendFamily f(out, "r2ccl_rail_failure_risk",
                   "Predicted probability that the rail fails within the predictor's horizon.",
                   MetricType::Gauge);
    for (const auto* e : risks)
      if (e->risk >= 0)
        f.sample({{"rail", board_text(e->rail)}, {"source", board::risk_source_name(e->source)}},
                 e->risk);
  }
  {
    AppendFamily f(out, "r2ccl_rail_ccl_retransmit_ratio",
                   "ccl_retransmit_ratio of the rail over the predictor's window (0..1).",
                   MetricType::Gauge);
    for (const auto* e : risks)
      if (e->retransmit_ratio >= 0) f.sample({{"rail", board_text(e->rail)}}, e->retransmit_ratio);
  }
  {
    AppendFamily f(out, "r2ccl_rail_drain",
                   "1 while the failure predictor drains the rail, else 0.", MetricType::Gauge);
    for (const auto* e : risks) f.sample({{"rail", board_text(e->rail)}}, e->drain ? 1 : 0);
  }

  // The agreed record.
  if (v.has_agreed) {
    const board::AgreedRecord& r = v.agreed;
    AppendFamily(out, "r2ccl_snapshot_agreed_epoch",
                 "Epoch of the agreed cluster record on this node's health board.",
                 MetricType::Gauge)
        .sample({}, static_cast<double>(r.epoch));
    AppendFamily(out, "r2ccl_snapshot_agreed_members",
                 "Live nodes (members) in the agreed cluster record.", MetricType::Gauge)
        .sample({}, board::member_count(r));
    AppendFamily(out, "r2ccl_snapshot_agreed_nodes", "Nodes in the job (agreed cluster record).",
                 MetricType::Gauge)
        .sample({}, r.n_nodes);
    AppendFamily f(out, "r2ccl_snapshot_agreed_node_usable_bandwidth_bytes_per_second",
                   "Usable network bandwidth per member node in the agreed record (0 unknown).",
                   MetricType::Gauge);
    const uint32_t n = std::min<uint32_t>(r.n_nodes, board::kMaxNodes);
    for (uint32_t id = 0; id < n; ++id)
      if (r.members[id / 64] & (1ULL << (id % 64))) {
        const double gbps = r.node_usable_gbps[id];
        f.sample({{"node", std::to_string(id)}}, std::isfinite(gbps) ? gbps * 1e9 : 0.0);
      }
  }
}

void append_board_metrics(const std::string& board_name, Page* out) {
  board::BoardView v;
  std::string err;
  const bool ok = board::read_board(board_name, &v, &err);
  AppendFamily(out, "r2ccl_snapshot_board_readable",
               "1 when this node's health board was read, 0 when it is absent or unusable.",
               MetricType::Gauge)
      .sample({}, ok ? 1 : 0);
  if (ok) append_board_metrics(v, out);
}

void append_store_metrics(const StoreStats& s, Page* out) {
  AppendFamily(out, "r2ccl_snapshot_store_memory_bytes", "Peer shard bytes held in memory.",
               MetricType::Gauge)
      .sample({}, static_cast<double>(s.memory_bytes));
  AppendFamily(out, "r2ccl_snapshot_store_spilled_bytes",
               "Peer shard bytes in the spill directory.", MetricType::Gauge)
      .sample({}, static_cast<double>(s.spilled_bytes));
  AppendFamily(out, "r2ccl_snapshot_store_memory_shards", "Peer shards held in memory.",
               MetricType::Gauge)
      .sample({}, static_cast<double>(s.shards_in_memory));
  AppendFamily(out, "r2ccl_snapshot_store_spilled_shards", "Peer shards in the spill directory.",
               MetricType::Gauge)
      .sample({}, static_cast<double>(s.shards_spilled));
  AppendFamily(out, "r2ccl_snapshot_store_spills_total", "Shards written to the spill directory.",
               MetricType::Counter)
      .sample({}, static_cast<double>(s.spills));
  AppendFamily(out, "r2ccl_snapshot_store_spill_failures_total",
               "Spill writes that failed (the shard stayed in memory).", MetricType::Counter)
      .sample({}, static_cast<double>(s.spill_failures));
  {
    AppendFamily f(out, "r2ccl_snapshot_store_crc_failures_total",
                   "Shards failing their CRC-32: refused at put, or found corrupt when served.",
                   MetricType::Counter);
    f.sample({{"when", "put"}}, static_cast<double>(s.crc_failures_put));
    f.sample({{"when", "get"}}, static_cast<double>(s.crc_failures_get));
  }
  AppendFamily(out, "r2ccl_snapshot_store_files_skipped_total",
               "Spill files not indexed at open (bad, truncated, foreign, temporary).",
               MetricType::Counter)
      .sample({}, static_cast<double>(s.files_skipped));
  AppendFamily(out, "r2ccl_snapshot_store_pruned_total", "Shards dropped by prune and erase.",
               MetricType::Counter)
      .sample({}, static_cast<double>(s.pruned));
}

// ---- collectables -------------------------------------------------------------------------------

Page BoardCollectable::Collect() const {
  Page p;
  try {
    append_board_metrics(board_, &p);
  } catch (...) {  // an Exposer worker thread: never throw (bad_alloc at most)
    p.clear();
  }
  return p;
}

Page StoreCollectable::Collect() const {
  Page p;
  try {
    if (stats_) append_store_metrics(stats_(), &p);
  } catch (...) {
    p.clear();
  }
  return p;
}

}  // namespace r2ccl::snap::metrics
