// Prometheus text exposition (0.0.4) for r2ccl_snapshotd: registry, rendering, and the metrics
// read at scrape time from the health board and the shard store. See metrics.h.
#include "r2ccl/snapshot/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <set>
#include <stdexcept>

#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/shard_store.h"

namespace r2ccl::snap::metrics {

namespace {

bool name_char(char c, bool first, bool colon) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') return true;
  if (colon && c == ':') return true;
  return !first && c >= '0' && c <= '9';
}

// Adds `v` to an atomic double (C++17 has no fetch_add for floating types).
void atomic_add(std::atomic<double>* a, double v) {
  double cur = a->load(std::memory_order_relaxed);
  while (!a->compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

// Writes one sample line. `labels` must be sorted by name; `le` (histogram buckets) goes last.
void write_sample(std::string* out, const std::string& name, const Labels& labels, double v,
                  const std::string* le = nullptr) {
  *out += name;
  if (!labels.empty() || le) {
    *out += '{';
    bool first = true;
    for (const auto& [k, val] : labels) {
      if (!first) *out += ',';
      first = false;
      *out += k;
      *out += "=\"";
      *out += escape_label_value(val);
      *out += '"';
    }
    if (le) {
      if (!first) *out += ',';
      *out += "le=\"";
      *out += *le;
      *out += '"';
    }
    *out += '}';
  }
  *out += ' ';
  *out += format_value(v);
  *out += '\n';
}

void write_header(std::string* out, const std::string& name, const std::string& help, Type t) {
  if (!help.empty()) {
    *out += "# HELP ";
    *out += name;
    *out += ' ';
    *out += escape_help(help);
    *out += '\n';
  }
  *out += "# TYPE ";
  *out += name;
  *out += ' ';
  *out += type_name(t);
  *out += '\n';
}

// Checks and sorts a label set; throws std::invalid_argument naming the problem.
Labels normalise(const std::string& metric, const Labels& in, Type t) {
  Labels l = in;
  std::sort(l.begin(), l.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < l.size(); ++i) {
    const std::string& k = l[i].first;
    if (!valid_label_name(k))
      throw std::invalid_argument("metric " + metric + ": invalid label name '" + k +
                                  "' (accepted: [a-zA-Z_][a-zA-Z0-9_]*, not starting with __)");
    if (i > 0 && l[i - 1].first == k)
      throw std::invalid_argument("metric " + metric + ": label '" + k + "' given twice");
    if (t == Type::kHistogram && k == "le")
      throw std::invalid_argument("metric " + metric +
                                  ": a histogram may not have a label named 'le' (its buckets')");
  }
  return l;
}

// Names a family writes: its own and, for a histogram, its three sample names.
std::vector<std::string> written_names(const std::string& name, Type t) {
  if (t != Type::kHistogram) return {name};
  return {name, name + "_bucket", name + "_sum", name + "_count"};
}

// Board strings come from shared memory: keep printable ASCII only (a corrupt board must not
// make the page invalid UTF-8).
std::string board_text(const char* s) {
  std::string r(s);
  for (char& c : r)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  return r;
}

// One family appended at scrape time: header at the first sample, so an empty family writes
// nothing (as the registry does).
class AppendFamily {
 public:
  AppendFamily(std::string* out, const char* name, const char* help, Type t)
      : out_(out), name_(name), help_(help), type_(t) {}
  void sample(Labels labels, double v) {
    if (!started_) {
      write_header(out_, name_, help_, type_);
      started_ = true;
    }
    std::sort(labels.begin(), labels.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    write_sample(out_, name_, labels, v);
  }

 private:
  std::string* out_;
  std::string name_, help_;
  Type type_;
  bool started_ = false;
};

}  // namespace

// ---- helpers ---------------------------------------------------------------------------------

bool valid_metric_name(const std::string& s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i)
    if (!name_char(s[i], i == 0, true)) return false;
  return true;
}

bool valid_label_name(const std::string& s) {
  if (s.empty() || s.compare(0, 2, "__") == 0) return false;
  for (size_t i = 0; i < s.size(); ++i)
    if (!name_char(s[i], i == 0, false)) return false;
  return true;
}

std::string escape_label_value(const std::string& s) {
  std::string r;
  r.reserve(s.size());
  for (char c : s) {
    if (c == '\\')
      r += "\\\\";
    else if (c == '"')
      r += "\\\"";
    else if (c == '\n')
      r += "\\n";
    else
      r += c;
  }
  return r;
}

std::string escape_help(const std::string& s) {
  std::string r;
  r.reserve(s.size());
  for (char c : s) {
    if (c == '\\')
      r += "\\\\";
    else if (c == '\n')
      r += "\\n";
    else
      r += c;
  }
  return r;
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  std::to_chars_result r;
  // Integers below 2^53 (exact in a double) as integers: "1000000", not "1e+06".
  if (v == std::trunc(v) && std::fabs(v) < 9007199254740992.0)
    r = std::to_chars(buf, buf + sizeof(buf), static_cast<long long>(v));
  else
    r = std::to_chars(buf, buf + sizeof(buf), v);  // shortest round-trip form
  return std::string(buf, r.ptr);
}

const char* type_name(Type t) {
  switch (t) {
    case Type::kCounter: return "counter";
    case Type::kGauge: return "gauge";
    case Type::kHistogram: return "histogram";
  }
  return "untyped";
}

// ---- series ----------------------------------------------------------------------------------

void Counter::inc(double v) {
  if (!(v >= 0)) return;  // negative or NaN: a counter never goes down
  atomic_add(&v_, v);
}

void Gauge::inc(double v) { atomic_add(&v_, v); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}

void Histogram::observe(double v) {
  if (std::isnan(v)) return;
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) -
                                       bounds_.begin());  // first b >= v
  std::lock_guard<std::mutex> g(mu_);
  if (i < counts_.size()) ++counts_[i];
  ++count_;
  sum_ += v;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  s.cumulative.resize(bounds_.size());
  std::lock_guard<std::mutex> g(mu_);
  uint64_t acc = 0;
  for (size_t i = 0; i < counts_.size(); ++i) s.cumulative[i] = acc += counts_[i];
  s.count = count_;
  s.sum = sum_;
  return s;
}

// ---- registry --------------------------------------------------------------------------------

struct Registry::Family {
  std::string name, help;
  Type type = Type::kCounter;
  std::vector<double> bounds;  // histograms
  std::map<Labels, std::unique_ptr<Counter>> counters;
  std::map<Labels, std::unique_ptr<Gauge>> gauges;
  std::map<Labels, std::unique_ptr<Histogram>> histograms;
  bool empty() const { return counters.empty() && gauges.empty() && histograms.empty(); }
};

Registry::Registry() = default;
Registry::~Registry() = default;

Registry::Family& Registry::family_locked(const std::string& name, Type type,
                                          const std::string& help,
                                          const std::vector<double>* bounds, bool create) {
  auto it = by_name_.find(name);
  if (it != by_name_.end()) {
    Family& f = *it->second;
    if (f.type != type)
      throw std::invalid_argument("metric " + name + " is registered as a " + type_name(f.type) +
                                  ", not a " + type_name(type));
    if (bounds && *bounds != f.bounds)
      throw std::invalid_argument("histogram " + name +
                                  " is registered already with other buckets");
    if (f.help.empty()) f.help = help;
    return f;
  }
  if (!create)
    throw std::invalid_argument("histogram " + name +
                                " is not registered (add_histogram names its buckets)");
  if (!valid_metric_name(name))
    throw std::invalid_argument("invalid metric name '" + name +
                                "' (accepted: [a-zA-Z_:][a-zA-Z0-9_:]*)");
  const std::vector<std::string> mine = written_names(name, type);
  for (const auto& f : families_)
    for (const std::string& theirs : written_names(f->name, f->type))
      if (std::find(mine.begin(), mine.end(), theirs) != mine.end())
        throw std::invalid_argument("metric " + name + " clashes with " + type_name(f->type) + " " +
                                    f->name + " (both write samples named " + theirs + ")");
  auto f = std::make_unique<Family>();
  f->name = name;
  f->help = help;
  f->type = type;
  if (bounds) f->bounds = *bounds;
  Family* p = f.get();
  families_.push_back(std::move(f));
  by_name_[name] = p;
  return *p;
}

void Registry::add_counter(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> g(mu_);
  family_locked(name, Type::kCounter, help, nullptr, true);
}

void Registry::add_gauge(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> g(mu_);
  family_locked(name, Type::kGauge, help, nullptr, true);
}

void Registry::add_histogram(const std::string& name, const std::string& help,
                             const std::vector<double>& bounds) {
  std::vector<double> b = bounds;
  if (!b.empty() && std::isinf(b.back()) && b.back() > 0) b.pop_back();  // +Inf is implicit
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(b[i]))
      throw std::invalid_argument("histogram " + name + ": bucket bound " + format_value(b[i]) +
                                  " is not finite (+Inf is implicit, and accepted last)");
    if (i > 0 && !(b[i] > b[i - 1]))
      throw std::invalid_argument("histogram " + name + ": bucket bounds must increase (" +
                                  format_value(b[i - 1]) + " then " + format_value(b[i]) + ")");
  }
  std::lock_guard<std::mutex> g(mu_);
  family_locked(name, Type::kHistogram, help, &b, true);
}

Counter& Registry::counter(const std::string& name, const Labels& labels) {
  Labels l = normalise(name, labels, Type::kCounter);
  std::lock_guard<std::mutex> g(mu_);
  auto& slot = family_locked(name, Type::kCounter, "", nullptr, true).counters[l];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& Registry::gauge(const std::string& name, const Labels& labels) {
  Labels l = normalise(name, labels, Type::kGauge);
  std::lock_guard<std::mutex> g(mu_);
  auto& slot = family_locked(name, Type::kGauge, "", nullptr, true).gauges[l];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& Registry::histogram(const std::string& name, const Labels& labels) {
  Labels l = normalise(name, labels, Type::kHistogram);
  std::lock_guard<std::mutex> g(mu_);
  Family& f = family_locked(name, Type::kHistogram, "", nullptr, false);
  auto& slot = f.histograms[l];
  if (!slot) slot = std::make_unique<Histogram>(f.bounds);
  return *slot;
}

std::string Registry::render() const {
  std::string out;
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& fp : families_) {
    const Family& f = *fp;
    if (f.empty()) continue;
    write_header(&out, f.name, f.help, f.type);
    switch (f.type) {
      case Type::kCounter:
        for (const auto& [l, c] : f.counters) write_sample(&out, f.name, l, c->value());
        break;
      case Type::kGauge:
        for (const auto& [l, c] : f.gauges) write_sample(&out, f.name, l, c->value());
        break;
      case Type::kHistogram: {
        const std::string bucket = f.name + "_bucket";
        const std::string inf = "+Inf";
        for (const auto& [l, h] : f.histograms) {
          const Histogram::Snapshot s = h->snapshot();
          for (size_t i = 0; i < s.bounds.size(); ++i) {
            const std::string le = format_value(s.bounds[i]);
            write_sample(&out, bucket, l, static_cast<double>(s.cumulative[i]), &le);
          }
          write_sample(&out, bucket, l, static_cast<double>(s.count), &inf);
          write_sample(&out, f.name + "_sum", l, s.sum);
          write_sample(&out, f.name + "_count", l, static_cast<double>(s.count));
        }
        break;
      }
    }
  }
  return out;
}

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
    Type type;
    const char* help;
    bool precreate = true;  // the unlabelled series exists (at 0) from the first scrape
  };
  static const Def defs[] = {
      {kShardBytesReceived, Type::kCounter, "Snapshot shard payload bytes received from peers."},
      {kShardBytesSent, Type::kCounter, "Snapshot shard payload bytes sent to peers."},
      {kShardsReceived, Type::kCounter, "Snapshot shards received from peers."},
      {kShardsSent, Type::kCounter, "Snapshot shards sent to peers."},
      {kTakes, Type::kCounter, "Snapshots taken (take() calls completed)."},
      {kTakeFailures, Type::kCounter, "Snapshots that failed."},
      {kReplicationLag, Type::kGauge,
       "Seconds since the newest fully replicated snapshot step was taken (absent until one "
       "is).",
       false},
      {kNewestCompleteStep, Type::kGauge,
       "The newest complete (restorable) snapshot step (absent until one is).", false},
      {kHeartbeatsSent, Type::kCounter, "Heartbeats sent to peers."},
      {kHeartbeatsReceived, Type::kCounter, "Heartbeats received from peers."},
      {kHeartbeatsMissed, Type::kCounter, "Heartbeat periods in which a live peer was not heard."},
      {kNodesFailed, Type::kCounter, "Peers declared failed (3 missed heartbeat periods)."},
      {kNodesRejoined, Type::kCounter, "Failed peers heard again (rejoined)."},
      {kRecoveries, Type::kCounter, "Recoveries (communicator rebuild and restore) run."},
      {kPeersRefused, Type::kCounter,
       "Peer connections refused (wrong token, unknown node, bad protocol)."},
      {kMembershipEpoch, Type::kGauge, "The highest membership (agreed record) epoch seen."},
      {kLiveNodes, Type::kGauge, "Nodes this daemon sees live, itself included."},
      {kConfiguredNodes, Type::kGauge, "Nodes in the peer list."},
      {kCoordinator, Type::kGauge,
       "1 while this daemon acts as coordinator (lowest live id with a majority), else 0."},
  };
  for (const Def& d : defs) {
    if (d.type == Type::kCounter) {
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

void append_board_metrics(const board::BoardView& v, std::string* out) {
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
                   Type::kGauge);
    for (const auto* s : slots) {
      Labels l = ids(*s);
      l.emplace_back("transport", board::transport_name(s->f.transport));
      f.sample(l, s->f.state == RailState::kUp ? 1 : 0);
    }
  }
  {
    AppendFamily f(out, "r2ccl_rail_state",
                   "The rail's state as published by its process: 1 for the current state, 0 "
                   "for the others.",
                   Type::kGauge);
    const RailState all[] = {RailState::kUp, RailState::kFailed, RailState::kDown,
                             RailState::kDraining, RailState::kUnknown};
    for (const auto* s : slots)
      for (RailState st : all) {
        Labels l = ids(*s);
        l.emplace_back("state", board::state_name(st));
        f.sample(l, s->f.state == st ? 1 : 0);
      }
  }
  {
    AppendFamily f(out, "r2ccl_rail_usable_bandwidth_bytes_per_second",
                   "Usable bandwidth of the rail now (0 while down).", Type::kGauge);
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
    AppendFamily f(out, d.name, d.help, Type::kCounter);
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
                   Type::kGauge);
    for (const auto* e : risks)
      if (e->risk >= 0)
        f.sample({{"rail", board_text(e->rail)}, {"source", board::risk_source_name(e->source)}},
                 e->risk);
  }
  {
    AppendFamily f(out, "r2ccl_rail_ccl_retransmit_ratio",
                   "ccl_retransmit_ratio of the rail over the predictor's window (0..1).",
                   Type::kGauge);
    for (const auto* e : risks)
      if (e->retransmit_ratio >= 0) f.sample({{"rail", board_text(e->rail)}}, e->retransmit_ratio);
  }
  {
    AppendFamily f(out, "r2ccl_rail_drain",
                   "1 while the failure predictor drains the rail, else 0.", Type::kGauge);
    for (const auto* e : risks) f.sample({{"rail", board_text(e->rail)}}, e->drain ? 1 : 0);
  }

  // The agreed record.
  if (v.has_agreed) {
    const board::AgreedRecord& r = v.agreed;
    AppendFamily(out, "r2ccl_snapshot_agreed_epoch",
                 "Epoch of the agreed cluster record on this node's health board.", Type::kGauge)
        .sample({}, static_cast<double>(r.epoch));
    AppendFamily(out, "r2ccl_snapshot_agreed_members",
                 "Live nodes (members) in the agreed cluster record.", Type::kGauge)
        .sample({}, board::member_count(r));
    AppendFamily(out, "r2ccl_snapshot_agreed_nodes", "Nodes in the job (agreed cluster record).",
                 Type::kGauge)
        .sample({}, r.n_nodes);
    AppendFamily f(out, "r2ccl_snapshot_agreed_node_usable_bandwidth_bytes_per_second",
                   "Usable network bandwidth per member node in the agreed record (0 unknown).",
                   Type::kGauge);
    const uint32_t n = std::min<uint32_t>(r.n_nodes, board::kMaxNodes);
    for (uint32_t id = 0; id < n; ++id)
      if (r.members[id / 64] & (1ULL << (id % 64))) {
        const double gbps = r.node_usable_gbps[id];
        f.sample({{"node", std::to_string(id)}}, std::isfinite(gbps) ? gbps * 1e9 : 0.0);
      }
  }
}

void append_board_metrics(const std::string& board_name, std::string* out) {
  board::BoardView v;
  std::string err;
  const bool ok = board::read_board(board_name, &v, &err);
  AppendFamily(out, "r2ccl_snapshot_board_readable",
               "1 when this node's health board was read, 0 when it is absent or unusable.",
               Type::kGauge)
      .sample({}, ok ? 1 : 0);
  if (ok) append_board_metrics(v, out);
}

void append_store_metrics(const StoreStats& s, std::string* out) {
  AppendFamily(out, "r2ccl_snapshot_store_memory_bytes", "Peer shard bytes held in memory.",
               Type::kGauge)
      .sample({}, static_cast<double>(s.memory_bytes));
  AppendFamily(out, "r2ccl_snapshot_store_spilled_bytes",
               "Peer shard bytes in the spill directory.", Type::kGauge)
      .sample({}, static_cast<double>(s.spilled_bytes));
  AppendFamily(out, "r2ccl_snapshot_store_memory_shards", "Peer shards held in memory.",
               Type::kGauge)
      .sample({}, static_cast<double>(s.shards_in_memory));
  AppendFamily(out, "r2ccl_snapshot_store_spilled_shards", "Peer shards in the spill directory.",
               Type::kGauge)
      .sample({}, static_cast<double>(s.shards_spilled));
  AppendFamily(out, "r2ccl_snapshot_store_spills_total", "Shards written to the spill directory.",
               Type::kCounter)
      .sample({}, static_cast<double>(s.spills));
  AppendFamily(out, "r2ccl_snapshot_store_spill_failures_total",
               "Spill writes that failed (the shard stayed in memory).", Type::kCounter)
      .sample({}, static_cast<double>(s.spill_failures));
  {
    AppendFamily f(out, "r2ccl_snapshot_store_crc_failures_total",
                   "Shards failing their CRC-32: refused at put, or found corrupt when served.",
                   Type::kCounter);
    f.sample({{"when", "put"}}, static_cast<double>(s.crc_failures_put));
    f.sample({{"when", "get"}}, static_cast<double>(s.crc_failures_get));
  }
  AppendFamily(out, "r2ccl_snapshot_store_files_skipped_total",
               "Spill files not indexed at open (bad, truncated, foreign, temporary).",
               Type::kCounter)
      .sample({}, static_cast<double>(s.files_skipped));
  AppendFamily(out, "r2ccl_snapshot_store_pruned_total", "Shards dropped by prune and erase.",
               Type::kCounter)
      .sample({}, static_cast<double>(s.pruned));
}

}  // namespace r2ccl::snap::metrics
