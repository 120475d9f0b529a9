// r2ccl_predict: the failure predictor from the command line (docs/PREDICTOR.md).
//
//   r2ccl_predict --replay TRACE [--rail NAME] [--model FILE] [--window-steps N]
//       the risk over time of every rail in a trace (LSTM and baseline side by side), the
//       drain decisions, and per rail how long before each failure the drain came
//   r2ccl_predict --live [--sysfs-root DIR] [--interval SEC] [--count N] [--model FILE]
//                        [--record TRACE]
//       samples this node's rails and prints each rail's risk every interval; --record also
//       writes the samples as a trace (to retrain on real fleet counters)
//   r2ccl_predict --features TRACE --out DIR [--horizon SEC]
//       the feature rows, labels and failure events of a trace as .npy files, for training
//   r2ccl_predict --evaluate TRACE [--model FILE] [--min-lead SEC] [--lead-window SEC]
//                            [--events-out CSV]
//       event level, for each decider (the LSTM alone, the baseline alone, both): failures
//       warned (and lead times), false drains per healthy rail-week (also by error floor),
//       early drains and the share of rail-time drained; then sample-level precision, recall
//       and F1. --events-out lists every failure and every drain no failure followed
//   r2ccl_predict --info [--model FILE]      the weights file's shape and metadata
//   r2ccl_predict --bench [--model FILE]     inference cost per rail-sample
//
// Exit status: 0 ok, 1 bad input (trace, weights), 3 usage.
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/params.h"
#include "r2ccl/predict/counters.h"
#include "r2ccl/predict/features.h"
#include "r2ccl/predict/model.h"
#include "r2ccl/predict/predictor.h"
#include "r2ccl/predict/trace.h"

using namespace r2ccl::predict;

namespace {

struct Options {
  std::string replay, features, evaluate, out, model, rail, rails, record, sysfs_root = "/sys";
  std::string decider;  // as R2CCL_PREDICT_DECIDER (the table's default, set in main)
  double lstm_cap = 0;  // as R2CCL_PREDICT_LSTM_CAP
  bool live = false, info = false, bench = false, quiet = false, bench_sysfs = false;
  double interval_s = 5, horizon_s = 30;
  int count = 0, window_steps = 0;
  // The drain policy: the R2CCL_PREDICT_* parameters' defaults (set in main from the table).
  float threshold = 0, return_threshold = 0;
  int return_samples = 0, enter_samples = 0, max_drains_per_hour = 0, down_hold_after = 0;
  double down_hold_s = 0, min_drain_s = 0;
  double min_lead_s = 30, lead_window_s = 1800;
  std::string events_out;  // --evaluate: the per-event CSV
};

// "(default V, the plugin's NAME default; ...)" for an option's help.
std::string as_param(const std::string& value, const char* name) {
  return "(default " + value + ", the plugin's " + name + " default; the tool does not read " +
         "the variable)";
}
std::string fmt(const char* f, double v) {
  char buf[32];
  snprintf(buf, sizeof(buf), f, v);
  return buf;
}

// A real-valued option in [lo, hi]. CLI::Range lets "nan" through (every comparison with NaN
// is false), so --lstm-cap nan silently turned "both" into the LSTM alone; this refuses it,
// "inf", and text that is not a number, naming the accepted form.
CLI::Validator number_in(double lo, double hi) {
  const std::string range = "[" + fmt("%g", lo) + ", " + fmt("%g", hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end == text.c_str() || *end != '\0' || !std::isfinite(v))
          return "'" + text + "' is not a number: expected a number in " + range;
        if (v < lo || v > hi)
          return "'" + text + "' is out of range: expected a number in " + range;
        return {};
      },
      "NUMBER in " + range);
}

double mono_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

// Loads --model, else the configured/shipped one. Returns false and prints why when a model
// was asked for explicitly and cannot be used; with no explicit model, a missing file means
// the baseline (printed).
bool get_model(const Options& o, Model* m, bool* have, bool required = false,
               std::string* used = nullptr) {
  std::string err, path;
  *have = false;
  if (!o.model.empty()) {
    path = o.model;
    if (!load_model(path, m, &err)) {
      fprintf(stderr, "r2ccl_predict: weights %s %s\n", path.c_str(), err.c_str());
      return false;
    }
  } else {
    r2ccl::Config cfg;  // only predict_model is read: the environment's or the shipped one
    const char* env = getenv("R2CCL_PREDICT_MODEL");
    cfg.predict_model = env ? env : "";
    if (!load_configured_model(cfg, m, &path, &err)) {
      fprintf(stderr, "r2ccl_predict: %s%s\n", err.c_str(),
              required ? "" : "; the threshold baseline decides");
      return !required;
    }
  }
  *have = true;
  if (used) *used = path;
  if (!o.quiet)
    fprintf(stderr, "r2ccl_predict: weights %s (%zu bytes, hidden %u, window %u)\n", path.c_str(),
            m->file_bytes, m->hidden, m->window);
  return true;
}

PredictorConfig config_of(const Options& o, const Model* m) {
  PredictorConfig c;
  c.interval_s = o.interval_s;
  c.window_steps = o.window_steps > 0 ? o.window_steps : m ? static_cast<int>(m->window) : 24;
  c.threshold = o.threshold;
  c.return_threshold = o.return_threshold;
  c.return_samples = o.return_samples;
  c.enter_samples = o.enter_samples;
  c.max_drains_per_hour = o.max_drains_per_hour;
  c.min_drain_s = o.min_drain_s;
  c.down_hold_s = o.down_hold_s;
  c.down_hold_after = o.down_hold_after;
  c.lstm_cap = o.decider == "both" ? static_cast<float>(o.lstm_cap) : 0.0f;
  return c;
}

// The baseline's thresholds apply to the mean of its last `steps` samples, and its rise rule to
// its last 2 lag + 1, at most a window's (model.cc, baseline_risk): a shorter --window-steps
// changes what it decides. Said on stderr.
void note_short_window(const PredictorConfig& c, const BaselineParams& b) {
  const std::string note =
      baseline_window_note(b, c.window_steps, "--window-steps " + std::to_string(c.window_steps));
  if (!note.empty()) fprintf(stderr, "r2ccl_predict: %s\n", note.c_str());
}

// A trace sampled at another interval than the model's: its per-second rates read the same,
// but the window, the rise rule's lag and the drain's hold count samples, so they span another
// time than they were tuned for. Said once (stderr: --replay's table stays as it is), from the
// median of a trace's first steps, when it is more than 1.5 x off.
class IntervalNote {
 public:
  IntervalNote(std::string path, double trained_s) : path_(std::move(path)), trained_(trained_s) {}
  void see(const TraceRow& row) {
    if (done_ || !row.has_step || !(row.step.dt_s > 0)) return;
    dts_.push_back(row.step.dt_s);
    if (dts_.size() >= kSteps) finish();
  }
  void finish() {
    if (done_ || dts_.size() < 3 || !(trained_ > 0)) return;
    done_ = true;
    std::nth_element(dts_.begin(), dts_.begin() + dts_.size() / 2, dts_.end());
    const double dt = dts_[dts_.size() / 2], x = dt / trained_;
    if (x > 1.5 || x < 1 / 1.5)
      fprintf(
          stderr,
          "r2ccl_predict: note: %s's samples are about %.3g s apart; the model was trained "
          "at %.3g s, and its window, the rise rule and the drain's hold count samples, so "
          "they span %.2g x the time they were tuned for (docs/PREDICTOR.md, \"In the plugin\", "
          "Interval)\n",
          path_.c_str(), dt, trained_, x);
  }

 private:
  static constexpr size_t kSteps = 15;
  std::string path_;
  double trained_;
  std::vector<double> dts_;
  bool done_ = false;
};

// The guard's rail sets in a trace file (the last-usable-rail rule, predictor.h): the rails of
// one node, i.e. those whose names share the part before the first '-' (n000-mlx5_0:1 and
// n000-mlx5_1:1; a name without '-' is a node of its own). A rail is usable while its link is
// up and it is not drained. As in the plugin, a node of one rail is exempt (there is no other
// rail to move to); in a file that lists one rail after another, a node's later rails are not
// known yet while its first is read.
struct RailSet {
  std::vector<int> node;             // per rail
  std::vector<char> up, drained;     // per rail
  std::vector<int> usable, members;  // per node
  std::map<std::string, int> node_index;
  void ensure(size_t r, const std::string& name) {
    while (node.size() <= r) {
      const std::string key = name.substr(0, name.find('-'));
      auto it = node_index.emplace(key, static_cast<int>(members.size())).first;
      if (it->second == static_cast<int>(members.size())) {
        members.push_back(0);
        usable.push_back(0);
      }
      node.push_back(it->second);
      up.push_back(1);
      drained.push_back(0);
      ++members[static_cast<size_t>(it->second)];
      ++usable[static_cast<size_t>(it->second)];
    }
  }
  bool usable_at(size_t r) const { return up[r] && !drained[r]; }
  // True when the rail's node has other rails and every one of them is down or drained.
  bool last_usable(size_t r) const {
    const size_t n = static_cast<size_t>(node[r]);
    return members[n] > 1 && usable[n] - (usable_at(r) ? 1 : 0) <= 0;
  }
  void set(size_t r, bool link, bool drain) {
    const bool before = usable_at(r);
    up[r] = link;
    drained[r] = drain;
    usable[static_cast<size_t>(node[r])] += (usable_at(r) ? 1 : 0) - (before ? 1 : 0);
  }
};

// ---- --replay ------------------------------------------------------------------------------
// A trace with no step to score (a header alone, one row per rail, the link never up): said
// by --replay and --evaluate alike, rather than an empty table or summary.
void nothing_to_score(const std::string& path) {
  fprintf(stderr,
          "r2ccl_predict: %s: no step with the link up to score (a trace needs at least two "
          "rows per rail, and the link up at some row after a rail's first)\n",
          path.c_str());
}

int run_replay(const Options& o) {
  Model model;
  bool have = false;
  if (!get_model(o, &model, &have)) return 1;
  const Model* mp = have && o.decider != "baseline" ? &model : nullptr;
  const BaselineParams base = have ? model.baseline : default_baseline();
  const PredictorConfig cfg = config_of(o, have ? &model : nullptr);
  note_short_window(cfg, base);
  TraceReader tr;
  std::string err;
  if (!tr.open(o.replay, &err)) {
    fprintf(stderr, "r2ccl_predict: %s\n", err.c_str());
    return 1;
  }
  struct RailRun {
    std::unique_ptr<RailPredictor> p;
    bool prev_link = true;
    double drain_since = -1;  // drain start while it lasts
    int failures = 0, warned = 0;
    std::vector<double> leads;
  };
  std::map<int, RailRun> runs;
  RailSet set;
  // The table's header goes out with its first row (or before the summary): a trace that
  // fails on its first rows prints its error alone.
  bool header = false;
  auto print_header = [&header] {
    if (header) return;
    header = true;
    printf("%-10s %-16s %-4s %-7s %-9s %-6s %s\n", "t_s", "rail", "link", "risk", "baseline",
           "drain", "event");
  };
  bool any_shown = false;  // a scored row or an event on a shown rail
  IntervalNote interval(o.replay,
                        have && model.interval_s > 0 ? model.interval_s : kTrainedIntervalS);
  TraceRow row;
  while (tr.next(&row, &err)) {
    interval.see(row);
    const std::string& name = tr.rail_names()[static_cast<size_t>(row.rail)];
    const size_t ri = static_cast<size_t>(row.rail);
    set.ensure(ri, name);
    RailRun& rr = runs[row.rail];
    if (!rr.p) rr.p = std::make_unique<RailPredictor>(cfg, mp, base);
    if (!o.rail.empty() && name != o.rail) {
      // Not shown, but part of the guard's set: its link and drain still count.
      const bool last = set.last_usable(ri);
      rr.p->update(row.step, nullptr, last);  // a first row primes the link state
      set.set(ri, row.link_up, rr.p->last().drain);
      continue;
    }
    std::string event;
    if (!row.has_step) rr.prev_link = row.link_up;  // a rail's first row: no transition
    if (rr.prev_link && !row.link_up) {
      ++rr.failures;
      char buf[96];
      if (rr.drain_since >= 0) {
        ++rr.warned;
        rr.leads.push_back(row.t_s - rr.drain_since);
        snprintf(buf, sizeof(buf), "LINK DOWN (drained %.1f s before)", row.t_s - rr.drain_since);
      } else {
        snprintf(buf, sizeof(buf), "LINK DOWN (not drained)");
      }
      event = buf;
    }
    rr.prev_link = row.link_up;
    Assessment a;
    const bool scored = rr.p->update(row.step, &a, set.last_usable(ri));
    set.set(ri, row.link_up, rr.p->last().drain);
    any_shown |= scored || !event.empty();
    if (scored && a.hold_new)  // stderr: the table's format stays as it is
      fprintf(stderr, "r2ccl_predict: t %.1f: %s\n", row.t_s, hold_message(name, a, cfg).c_str());
    if (scored && a.transition > 0) {
      rr.drain_since = row.t_s;
      event = "DRAIN: " + (a.down_hold_s > 0 ? down_hold_text(a) : rr.p->top_contributors(3));
    } else if (scored && a.transition < 0) {
      rr.drain_since = -1;
      event = "RETURN";
    }
    if (!scored && event.empty()) continue;
    if (o.quiet && event.empty()) continue;
    print_header();
    if (scored)
      printf("%-10.1f %-16s %-4d %-7.3f %-9.3f %-6s %s\n", row.t_s, name.c_str(), 1, a.risk,
             a.baseline_risk, a.drain ? "yes" : "no", event.c_str());
    else
      printf("%-10.1f %-16s %-4d %-7s %-9s %-6s %s\n", row.t_s, name.c_str(), row.link_up ? 1 : 0,
             "-", "-", "-", event.c_str());
  }
  if (!err.empty()) {
    fprintf(stderr, "r2ccl_predict: %s\n", err.c_str());
    return 1;
  }
  if (!o.rail.empty() &&
      std::find(tr.rail_names().begin(), tr.rail_names().end(), o.rail) == tr.rail_names().end()) {
    fprintf(stderr, "r2ccl_predict: no rail named '%s' in %s\n", o.rail.c_str(), o.replay.c_str());
    return 1;
  }
  interval.finish();
  if (!any_shown) {
    nothing_to_score(o.replay);
    return 1;
  }
  print_header();
  // The summary line's words for the LSTM and the baseline are as before "both" existed
  // (issue 17: --replay's output format stays as it is).
  const std::string who = !mp                ? "baseline"
                          : cfg.lstm_cap > 0 ? "both (the baseline raised by the LSTM up to " +
                                                   fmt("%.3g", cfg.lstm_cap) + " x its risk)"
                                             : "LSTM";
  printf("\nsummary (%s decides; drain at risk >= %.2f):\n", who.c_str(), cfg.threshold);
  for (const auto& [idx, rr] : runs) {
    if (!o.rail.empty() && tr.rail_names()[static_cast<size_t>(idx)] != o.rail) continue;
    std::string leads;
    for (double l : rr.leads)
      leads += (leads.empty() ? "" : ", ") + std::to_string(l).substr(0, 5) + " s";
    printf("  %-16s failures %d, drained before %d%s%s\n",
           tr.rail_names()[static_cast<size_t>(idx)].c_str(), rr.failures, rr.warned,
           leads.empty() ? "" : ", lead ", leads.c_str());
  }
  return 0;
}

// ---- --features ----------------------------------------------------------------------------
// Writes a NumPy .npy file (format version 1.0) of a 1-D or 2-D little-endian array.
bool write_npy(const std::string& path, const char* descr, const void* data, size_t elem,
               size_t rows, size_t cols) {
  std::string shape = cols ? "(" + std::to_string(rows) + ", " + std::to_string(cols) + ")"
                           : "(" + std::to_string(rows) + ",)";
  std::string hdr =
      std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t base = 10;  // magic(6) + version(2) + header length(2)
  size_t total = base + hdr.size() + 1;
  hdr.append((64 - total % 64) % 64, ' ');
  hdr += '\n';
  std::ofstream f(path, std::ios::binary);
  if (!f) return false;
  const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  f.write(reinterpret_cast<const char*>(magic), 8);
  const uint16_t len = static_cast<uint16_t>(hdr.size());
  const unsigned char l2[2] = {static_cast<unsigned char>(len & 0xff),
                               static_cast<unsigned char>(len >> 8)};
  f.write(reinterpret_cast<const char*>(l2), 2);
  f.write(hdr.data(), static_cast<std::streamsize>(hdr.size()));
  f.write(static_cast<const char*>(data),
          static_cast<std::streamsize>(elem * rows * (cols ? cols : 1)));
  return static_cast<bool>(f);
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) continue;
    o += ch;
  }
  return o + "\"";
}

int run_features(const Options& o) {
  TraceReader tr;
  std::string err;
  if (!tr.open(o.features, &err)) {
    fprintf(stderr, "r2ccl_predict: %s\n", err.c_str());
    return 1;
  }
  std::vector<float> x;
  std::vector<int32_t> rail, scen;
  std::vector<double> t;
  std::vector<double> ev_t;
  std::vector<int32_t> ev_rail;
  std::vector<FeatureExtractor> fx;
  std::vector<char> prev_link;
  TraceRow row;
  while (tr.next(&row, &err)) {
    const size_t r = static_cast<size_t>(row.rail);
    if (r >= fx.size()) {
      fx.resize(r + 1);
      prev_link.resize(r + 1, 1);
    }
    // Only a 1 -> 0 transition is a failure: a rail whose first row is down starts down.
    if (!row.has_step) prev_link[r] = row.link_up;
    if (prev_link[r] && !row.link_up) {
      ev_t.push_back(row.t_s);
      ev_rail.push_back(row.rail);
    }
    prev_link[r] = row.link_up;
    FeatureRow f;
    if (!row.has_step || !fx[r].push(row.step, &f)) continue;
    x.insert(x.end(), f.begin(), f.end());
    rail.push_back(row.rail);
    t.push_back(row.t_s);
    scen.push_back(row.scenario);
  }
  if (!err.empty()) {
    fprintf(stderr, "r2ccl_predict: %s\n", err.c_str());
    return 1;
  }
  // Labels: a failure of the same rail within (t, t + horizon]. Events per rail are in time
  // order, so a binary search per row.
  std::vector<std::vector<double>> events(tr.rail_names().size());
  for (size_t i = 0; i < ev_t.size(); ++i)
    events[static_cast<size_t>(ev_rail[i])].push_back(ev_t[i]);
  std::vector<int8_t> label(t.size(), 0);
  for (size_t i = 0; i < t.size(); ++i) {
    const auto& e = events[static_cast<size_t>(rail[i])];
    auto it = std::upper_bound(e.begin(), e.end(), t[i]);
    label[i] = it != e.end() && *it <= t[i] + o.horizon_s ? 1 : 0;
  }
  ::mkdir(o.out.c_str(), 0755);
  const size_t n = t.size();
  bool ok = write_npy(o.out + "/x.npy", "<f4", x.data(), 4, n, kNumFeatures) &&
            write_npy(o.out + "/rail.npy", "<i4", rail.data(), 4, n, 0) &&
            write_npy(o.out + "/t.npy", "<f8", t.data(), 8, n, 0) &&
            write_npy(o.out + "/label.npy", "|i1", label.data(), 1, n, 0) &&
            write_npy(o.out + "/scenario.npy", "<i4", scen.data(), 4, n, 0) &&
            write_npy(o.out + "/event_t.npy", "<f8", ev_t.data(), 8, ev_t.size(), 0) &&
            write_npy(o.out + "/event_rail.npy", "<i4", ev_rail.data(), 4, ev_rail.size(), 0);
  std::ofstream meta(o.out + "/meta.json");
  meta << "{\"trace\": " << json_str(o.features) << ", \"horizon_s\": " << o.horizon_s
       << ", \"features\": [";
  for (int f = 0; f < kNumFeatures; ++f) meta << (f ? ", " : "") << json_str(feature_name(f));
  meta << "], \"rails\": [";
  for (size_t i = 0; i < tr.rail_names().size(); ++i)
    meta << (i ? ", " : "") << json_str(tr.rail_names()[i]);
  meta << "], \"scenarios\": [";
  for (size_t i = 0; i < tr.scenarios().size(); ++i)
    meta << (i ? ", " : "") << json_str(tr.scenarios()[i]);
  meta << "]}\n";
  if (!ok || !meta) {
    fprintf(stderr, "r2ccl_predict: cannot write the feature files in %s\n", o.out.c_str());
    return 1;
  }
  size_t pos = 0;
  for (int8_t l : label) pos += static_cast<size_t>(l);
  fprintf(stderr, "r2ccl_predict: %zu rows (%zu positive), %zu rails, %zu failure events -> %s\n",
          n, pos, tr.rail_names().size(), ev_t.size(), o.out.c_str());
  return 0;
}

// ---- --evaluate ----------------------------------------------------------------------------
// Event level, for the LSTM and for the baseline, each deciding alone with the same drain
// policy and guard (predictor.h): per failure, whether its rail was drained when the link went
// down and for how long before (warned when at least --min-lead); per healthy rail (one with no
// failure in the file), the drains and the monitored hours, also by the rail's error floor.
// Then the sample-level precision, recall and F1 of earlier versions.
namespace eval {

// The error counters whose steady level is a rail's "error floor".
constexpr int kFloorCounters[] = {kSymbolErr,     kRcvErr,          kCrcErr,
                                  kFecCorrBlocks, kFecUncorrBlocks, kFecCorrBits};
constexpr int kFloorRows = 60;  // the floor is read over a rail's first 60 scored rows (5 min)
// Floor buckets, errors per second (the highest counter's median rate): 0, <= 0.1, <= 1, ...
constexpr double kFloorEdges[] = {0, 0.1, 1, 10, 100, 1000};
constexpr int kBuckets = 7;
const char* const kBucketNames[kBuckets] = {"0",      "0-0.1",    "0.1-1", "1-10",
                                            "10-100", "100-1000", "> 1000"};

int bucket_of(double rate) {
  int b = 0;
  while (b < 6 && rate > kFloorEdges[b]) ++b;
  return b;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

struct Rail {
  std::vector<double> fails;                             // link 1 -> 0 times
  std::vector<int> fail_scenario;                        // the rail's scenario at each
  double up_s = 0;                                       // scored (link up) seconds
  std::vector<double> rates[std::size(kFloorCounters)];  // first kFloorRows rates per counter
  int scenario = -1;                                     // the last scenario seen
  bool prev_link = true;
  int floor_bucket() const {
    double hi = 0;
    for (const auto& r : rates) hi = std::max(hi, median(r));
    return bucket_of(hi);
  }
};

struct Decider {
  std::vector<std::unique_ptr<RailPredictor>> p;
  RailSet set;
  std::vector<std::vector<double>> drain_at;  // per rail: when each drain began
  std::vector<std::vector<std::string>> why;  // per rail, per drain: its DRAIN line's reason
  std::vector<double> drain_since;            // per rail: start of the drain in progress, or -1
  std::vector<std::vector<double>> lead;      // per rail, per failure: lead, or -1 (not drained)
  std::vector<std::vector<std::string>> lead_why;  // per rail, per failure: that drain's reason
  double drained_s = 0;                            // link-up rail-time spent drained, all rails
};

// --evaluate's deciders, in its tables' order.
constexpr int kDeciders = 3;
const char* const kDeciderNames[kDeciders] = {"lstm", "baseline", "both"};

struct Tally {
  int precursor = 0, warned = 0, late = 0, sudden = 0, sudden_warned = 0;
  std::vector<double> leads;
  int false_drains = 0, bucket_drains[kBuckets] = {};
  int early_drains = 0;  // on failing rails, not followed by a failure within --lead-window
};

// --events-out: a CSV field, quoted (RFC 4180) where it holds a comma, a quote or a newline.
std::string csv_field(const std::string& v) {
  if (v.find_first_of(",\"\n\r") == std::string::npos) return v;
  std::string q = "\"";
  for (char c : v) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}
constexpr const char* kEventsHeader = "decider,event,outcome,rail,scenario,t_s,lead_s,floor,reason";

// --events-out's file. A regular file (or a new one) is written to a temporary file beside
// its name and renamed over it once complete, so that the name holds either what it held
// before or the whole list: a failed write, a trace that turns out bad or a second run at the
// same time never leaves part of one there, and a symlink or hard link at that name is
// replaced, never written through. Anything else (a device such as /dev/null, a FIFO) is
// written in place. One thread.
class EventsFile {
 public:
  EventsFile() = default;
  EventsFile(const EventsFile&) = delete;
  EventsFile& operator=(const EventsFile&) = delete;
  ~EventsFile() { discard(); }
  // false, with *err the cause (strerror), when `path` cannot be written.
  bool open(const std::string& path, std::string* err) {
    struct stat st {};
    const bool exists = stat(path.c_str(), &st) == 0;
    if (exists && S_ISDIR(st.st_mode)) {
      *err = strerror(EISDIR);
      return false;
    }
    if (exists && !S_ISREG(st.st_mode)) {
      f_ = fopen(path.c_str(), "w");
      if (!f_) *err = strerror(errno);
      return f_ != nullptr;
    }
    std::string tmpl = path + ".tmp-XXXXXX";
    const int fd = mkstemp(tmpl.data());
    if (fd < 0) {
      *err = strerror(errno);
      return false;
    }
    const mode_t mask = umask(0);  // mkstemp makes 0600; a new file gets what fopen would
    umask(mask);
    fchmod(fd, 0666 & ~mask);
    f_ = fdopen(fd, "w");
    if (!f_) {
      *err = strerror(errno);
      close(fd);
      unlink(tmpl.c_str());
      return false;
    }
    tmp_ = tmpl;
    path_ = path;
    return true;
  }
  FILE* get() const { return f_; }
  explicit operator bool() const { return f_ != nullptr; }
  // Flushes, closes and renames the list into place; false, with *err the cause, when any
  // write failed (the name keeps what it held).
  bool commit(std::string* err) {
    errno = 0;
    bool bad = fflush(f_) != 0 || ferror(f_) != 0;
    int e = errno;
    if (fclose(f_) != 0 && !bad) {
      bad = true;
      e = errno;
    }
    f_ = nullptr;
    if (!bad && !tmp_.empty() && rename(tmp_.c_str(), path_.c_str()) != 0) {
      bad = true;
      e = errno;
    }
    if (bad) {
      *err = e ? strerror(e) : "a write failed";
      discard();
      return false;
    }
    tmp_.clear();
    return true;
  }
  // Closes and removes the temporary file; the name keeps what it held.
  void discard() {
    if (f_) fclose(f_);
    f_ = nullptr;
    if (!tmp_.empty()) unlink(tmp_.c_str());
    tmp_.clear();
  }

 private:
  std::string path_, tmp_;  // tmp_: the temporary file while one is open or unrenamed
  FILE* f_ = nullptr;
};

}  // namespace eval

int run_evaluate(const Options& o) {
  using namespace eval;
  Model model;
  bool have = false;
  std::string model_path;
  if (!get_model(o, &model, &have, true, &model_path))
    return 1;  // it compares the LSTM with the baseline
  const PredictorConfig cfg = config_of(o, &model);
  PredictorConfig cfgs[kDeciders] = {cfg, cfg, cfg};
  cfgs[0].lstm_cap = 0;                               // the LSTM alone
  cfgs[2].lstm_cap = static_cast<float>(o.lstm_cap);  // both
  note_short_window(cfg, model.baseline);
  TraceReader tr;
  std::string err;
  if (!tr.open(o.evaluate, &err)) {
    fprintf(stderr, "r2ccl_predict: %s\n", err.c_str());
    return 1;
  }
  // Opened before the trace is read, so that a path that cannot be written fails at once;
  // never over the trace or the weights file read (--model, $R2CCL_PREDICT_MODEL or the
  // shipped one): the list would replace it.
  EventsFile events;
  if (!o.events_out.empty()) {
    const std::string* inputs[] = {&o.evaluate, &model_path};
    for (const std::string* in : inputs) {
      struct stat a {
      }, b{};
      if (!in->empty() && stat(o.events_out.c_str(), &a) == 0 && stat(in->c_str(), &b) == 0 &&
          a.st_dev == b.st_dev && a.st_ino == b.st_ino) {
        fprintf(stderr, "r2ccl_predict: --events-out %s is the %s; name another file\n",
                o.events_out.c_str(),
                in == &o.evaluate ? "trace being evaluated (--evaluate)" : "weights file read");
        return 1;
      }
    }
    std::string why;
    if (!events.open(o.events_out, &why)) {
      fprintf(stderr, "r2ccl_predict: --events-out %s: cannot write it: %s\n", o.events_out.c_str(),
              why.c_str());
      return 1;
    }
    fprintf(events.get(), "%s\n", kEventsHeader);
  }
  struct Scored {
    int rail;
    double t;
    bool alarm[kDeciders];
  };
  std::vector<Scored> rows;
  std::vector<Rail> rails;
  Decider dec[kDeciders];
  const Model* models[kDeciders] = {&model, nullptr, &model};
  Scored cur{};
  IntervalNote interval(o.evaluate, model.interval_s > 0 ? model.interval_s : kTrainedIntervalS);
  TraceRow row;
  while (tr.next(&row, &err)) {
    interval.see(row);
    const size_t r = static_cast<size_t>(row.rail);
    if (r >= rails.size()) {
      rails.resize(r + 1);
      for (Decider& d : dec) {
        d.p.resize(r + 1);
        d.drain_at.resize(r + 1);
        d.why.resize(r + 1);
        d.drain_since.resize(r + 1, -1);
        d.lead.resize(r + 1);
        d.lead_why.resize(r + 1);
      }
    }
    Rail& rl = rails[r];
    rl.scenario = row.scenario;
    if (!row.has_step) rl.prev_link = row.link_up;
    const bool failed = rl.prev_link && !row.link_up;
    rl.prev_link = row.link_up;
    if (failed) {
      rl.fails.push_back(row.t_s);
      rl.fail_scenario.push_back(row.scenario);
    }
    if (row.has_step && row.link_up && row.step.dt_s > 0) {
      rl.up_s += row.step.dt_s;
      for (size_t k = 0; k < std::size(kFloorCounters); ++k) {
        const int c = kFloorCounters[k];
        if (!((row.step.missing | row.step.reset) & (1u << c)) && rl.rates[k].size() < kFloorRows)
          rl.rates[k].push_back(row.step.d[c] / row.step.dt_s);
      }
    }
    bool scored_row = false;
    for (int m = 0; m < kDeciders; ++m) {
      Decider& d = dec[m];
      d.set.ensure(r, tr.rail_names()[r]);
      if (!d.p[r]) d.p[r] = std::make_unique<RailPredictor>(cfgs[m], models[m], model.baseline);
      if (failed) {
        const bool drained = d.drain_since[r] >= 0;
        d.lead[r].push_back(drained ? row.t_s - d.drain_since[r] : -1);
        d.lead_why[r].push_back(drained && !d.why[r].empty() ? d.why[r].back() : std::string());
      }
      Assessment a;
      const bool scored = d.p[r]->update(row.step, &a, d.set.last_usable(r));
      d.set.set(r, row.link_up, d.p[r]->last().drain);
      if (row.has_step && row.link_up && row.step.dt_s > 0 && d.p[r]->last().drain)
        d.drained_s += row.step.dt_s;
      if (!scored) continue;
      if (a.transition > 0) {
        d.drain_since[r] = row.t_s;
        d.drain_at[r].push_back(row.t_s);
        if (events)
          d.why[r].push_back(a.down_hold_s > 0 ? down_hold_text(a) : d.p[r]->top_contributors(3));
      } else if (a.transition < 0) {
        d.drain_since[r] = -1;
      }
      scored_row = true;
      cur.alarm[m] = a.risk >= cfg.threshold;
    }
    if (scored_row) {
      cur.rail = row.rail;
      cur.t = row.t_s;
      rows.push_back(cur);
    }
  }
  if (!err.empty()) {
    fprintf(stderr, "r2ccl_predict: %s\n", err.c_str());
    return 1;  // the events file is discarded
  }
  interval.finish();
  if (rows.empty()) {
    nothing_to_score(o.evaluate);
    return 1;  // the events file is discarded
  }
  auto is_sudden = [&](int sc) {
    return sc >= 0 && tr.scenarios()[static_cast<size_t>(sc)].rfind("sudden", 0) == 0;
  };
  auto sc_name = [&](int sc) {
    return sc >= 0 ? tr.scenarios()[static_cast<size_t>(sc)] : std::string("-");
  };
  Tally tally[kDeciders];
  double healthy_s = 0, up_s = 0, bucket_s[kBuckets] = {};
  int healthy_rails = 0, bucket_rails[kBuckets] = {};
  for (size_t r = 0; r < rails.size(); ++r) {
    const Rail& rl = rails[r];
    const bool healthy = rl.fails.empty();
    const int b = rl.floor_bucket();
    up_s += rl.up_s;
    if (healthy) {
      healthy_s += rl.up_s;
      bucket_s[b] += rl.up_s;
      ++healthy_rails;
      ++bucket_rails[b];
    }
    for (int m = 0; m < kDeciders; ++m) {
      Tally& t = tally[m];
      const Decider& d = dec[m];
      // One --events-out line: the rail's name, floor and (for a drain) scenario are its own.
      auto event = [&](const char* what, const char* outcome, int sc, double at, double lead,
                       const std::string& reason) {
        if (!events) return;
        char num[64];
        snprintf(num, sizeof(num), "%.3f,", at);
        std::string line = std::string(kDeciderNames[m]) + "," + what + "," + outcome + "," +
                           csv_field(tr.rail_names()[r]) + "," + csv_field(sc_name(sc)) + "," + num;
        if (lead >= 0) {
          snprintf(num, sizeof(num), "%.3f", lead);
          line += num;
        }
        line += "," + csv_field(kBucketNames[b]) + "," + csv_field(reason) + "\n";
        fputs(line.c_str(), events.get());
      };
      for (size_t f = 0; f < rl.fails.size(); ++f) {
        const double lead = d.lead[r][f];
        const char* outcome = lead >= o.min_lead_s ? "warned" : lead >= 0 ? "late" : "missed";
        event(is_sudden(rl.fail_scenario[f]) ? "sudden_failure" : "failure", outcome,
              rl.fail_scenario[f], rl.fails[f], lead, d.lead_why[r][f]);
        if (is_sudden(rl.fail_scenario[f])) {
          ++t.sudden;
          t.sudden_warned += lead >= o.min_lead_s;
          continue;
        }
        ++t.precursor;
        if (lead >= o.min_lead_s) {
          ++t.warned;
          t.leads.push_back(lead);
        } else if (lead >= 0) {
          ++t.late;
        }
      }
      for (size_t i = 0; i < d.drain_at[r].size(); ++i) {
        const double s = d.drain_at[r][i];
        const std::string& reason = i < d.why[r].size() ? d.why[r][i] : std::string();
        if (healthy) {
          ++t.false_drains;
          ++t.bucket_drains[b];
          event("false_drain", "", rl.scenario, s, -1, reason);
          continue;
        }
        const bool explained = std::any_of(rl.fails.begin(), rl.fails.end(), [&](double tf) {
          return tf > s && tf <= s + o.lead_window_s;
        });
        t.early_drains += !explained;
        if (!explained) event("early_drain", "", rl.scenario, s, -1, reason);
      }
    }
  }
  // Every line or none: a short write (a full disk) is an error, not a shorter list.
  if (events) {
    std::string why;
    if (!events.commit(&why)) {
      fprintf(stderr, "r2ccl_predict: --events-out %s: could not write it all: %s\n",
              o.events_out.c_str(), why.c_str());
      return 1;
    }
  }
  const double week_s = 7 * 24 * 3600.0;
  auto per_week = [&](int n, double secs) { return secs > 0 ? n * week_s / secs : 0.0; };
  char hold_buf[96] = "no flap hold";
  if (cfg.down_hold_s > 0)
    snprintf(hold_buf, sizeof(hold_buf), "held out %.0f s after %d link-down%s within an hour",
             cfg.down_hold_s, cfg.down_hold_after, cfg.down_hold_after == 1 ? "" : "s");
  const std::string hold_text = hold_buf;
  printf(
      "event level: %zu rails (%d healthy, %.1f rail-hours), drain at risk >= %.2f for %d "
      "samples, kept at least %.0f s, return below %.2f for %d, at most %d drains per rail within "
      "an hour, %s; warned = drained >= %.0f s before the link went down\n",
      rails.size(), healthy_rails, healthy_s / 3600, cfg.threshold, cfg.enter_samples,
      cfg.min_drain_s, cfg.return_threshold, cfg.return_samples, cfg.max_drains_per_hour,
      hold_text.c_str(), o.min_lead_s);
  printf(
      "deciders: lstm (the LSTM alone), baseline (the thresholds alone), both (the baseline, "
      "raised by the LSTM up to %.3g x its own risk; --lstm-cap)\n",
      o.lstm_cap);
  printf("%-9s %10s %9s %6s %6s %11s %8s %12s %13s %12s %9s\n", "model", "precursor", "warned",
         "frac", "late", "median-lead", "sudden", "false-drains", "per-rail-week", "early-drains",
         "drained-%");
  for (int m = 0; m < kDeciders; ++m) {
    const Tally& t = tally[m];
    char lead[32] = "-";
    if (!t.leads.empty()) snprintf(lead, sizeof(lead), "%.0f s", median(t.leads));
    char sud[32];
    snprintf(sud, sizeof(sud), "%d/%d", t.sudden_warned, t.sudden);
    printf("%-9s %10d %9d %6.3f %6d %11s %8s %12d %13.2f %12d %9.2f\n", kDeciderNames[m],
           t.precursor, t.warned, t.precursor ? static_cast<double>(t.warned) / t.precursor : 0.0,
           t.late, lead, sud, t.false_drains, per_week(t.false_drains, healthy_s), t.early_drains,
           up_s > 0 ? 100.0 * dec[m].drained_s / up_s : 0.0);
  }
  printf(
      "false drains per rail-week on healthy rails, by error floor (the highest error "
      "counter's median rate over a rail's first %d samples, per second), the number of "
      "drains in parentheses:\n",
      kFloorRows);
  printf("%-10s %6s %10s %12s %12s %12s\n", "floor", "rails", "rail-hours", "lstm", "baseline",
         "both");
  for (int b = 0; b < kBuckets; ++b) {
    if (bucket_rails[b] == 0) continue;
    printf("%-10s %6d %10.1f", kBucketNames[b], bucket_rails[b], bucket_s[b] / 3600);
    for (int d = 0; d < kDeciders; ++d) {
      const int n = tally[d].bucket_drains[b];
      char cell[32];
      snprintf(cell, sizeof(cell), "%.2f (%d)", per_week(n, bucket_s[b]), n);
      printf(" %12s", cell);
    }
    printf("\n");
  }

  // Per scenario: failures (with a precursor or sudden) warned, and drains on rails of that
  // scenario that no failure followed (false on healthy rails, early on failing ones).
  struct PerScenario {
    int fails = 0, warned[kDeciders] = {}, rails = 0, drains[kDeciders] = {};
    double up_s = 0;
  };
  std::map<std::string, PerScenario> by_sc;
  for (size_t r = 0; r < rails.size(); ++r) {
    const Rail& rl = rails[r];
    PerScenario& ps = by_sc[sc_name(rl.scenario)];
    ++ps.rails;
    ps.up_s += rl.up_s;
    for (size_t f = 0; f < rl.fails.size(); ++f) {
      PerScenario& pf = by_sc[sc_name(rl.fail_scenario[f])];
      ++pf.fails;
      for (int m = 0; m < kDeciders; ++m) pf.warned[m] += dec[m].lead[r][f] >= o.min_lead_s;
    }
    for (int m = 0; m < kDeciders; ++m)
      for (double s0 : dec[m].drain_at[r])
        ps.drains[m] += !std::any_of(rl.fails.begin(), rl.fails.end(), [&](double tf) {
          return tf > s0 && tf <= s0 + o.lead_window_s;
        });
  }
  printf("by scenario (failures warned; drains no failure followed):\n");
  printf("%-22s %6s %10s %9s %15s %10s %10s %10s\n", "scenario", "rails", "rail-hours", "failures",
         "warned", "drains", "", "");
  printf("%-22s %6s %10s %9s %15s %10s %10s %10s\n", "", "", "", "", "lstm/base/both", "lstm",
         "baseline", "both");
  for (const auto& [name, ps] : by_sc) {
    char w[48];
    snprintf(w, sizeof(w), "%d/%d/%d", ps.warned[0], ps.warned[1], ps.warned[2]);
    printf("%-22s %6d %10.1f %9d %15s %10d %10d %10d\n", name.c_str(), ps.rails, ps.up_s / 3600,
           ps.fails, w, ps.drains[0], ps.drains[1], ps.drains[2]);
  }

  struct Confusion {
    double tp = 0, fp = 0, fn = 0, tn = 0;
    void add(bool alarm, bool label) { (alarm ? (label ? tp : fp) : (label ? fn : tn)) += 1; }
    double precision() const { return tp + fp > 0 ? tp / (tp + fp) : 0; }
    double recall() const { return tp + fn > 0 ? tp / (tp + fn) : 0; }
    double f1() const {
      const double p = precision(), r = recall();
      return p + r > 0 ? 2 * p * r / (p + r) : 0;
    }
    double accuracy() const { return (tp + tn) / std::max(1.0, tp + fp + fn + tn); }
  } conf[kDeciders];
  size_t positives = 0;
  for (const Scored& x : rows) {
    const auto& e = rails[static_cast<size_t>(x.rail)].fails;
    auto it = std::upper_bound(e.begin(), e.end(), x.t);
    const bool label = it != e.end() && *it <= x.t + o.horizon_s;
    positives += label;
    for (int m = 0; m < kDeciders; ++m) conf[m].add(x.alarm[m], label);
  }
  printf(
      "\nsample level: %zu scored rows, %zu positive (failure within %.0f s), alarm at risk "
      ">= %.2f\n",
      rows.size(), positives, o.horizon_s, cfg.threshold);
  printf("%-9s %9s %9s %9s %9s\n", "model", "precision", "recall", "F1", "accuracy");
  for (int m = 0; m < kDeciders; ++m) {
    const Confusion& c = conf[m];
    printf("%-9s %9.4f %9.4f %9.4f %9.5f\n", kDeciderNames[m], c.precision(), c.recall(), c.f1(),
           c.accuracy());
  }
  return 0;
}

// ---- --live --------------------------------------------------------------------------------
int run_live(const Options& o) {
  Model model;
  bool have = false;
  if (!get_model(o, &model, &have)) return 1;
  const Model* mp = have && o.decider != "baseline" ? &model : nullptr;
  std::vector<RailSpec> rails = discover_rails(o.sysfs_root);
  if (!o.rails.empty()) {  // --rails mlx5_0:1,eth2
    std::vector<RailSpec> keep;
    std::string list = "," + o.rails + ",";
    for (const auto& r : rails)
      if (list.find("," + r.name + ",") != std::string::npos) keep.push_back(r);
    rails = keep;
  }
  if (rails.empty()) {
    fprintf(stderr,
            "r2ccl_predict: no rails under %s (class/infiniband/*/ports/*, class/net/*)%s\n",
            o.sysfs_root.c_str(), o.rails.empty() ? "" : (" matching --rails " + o.rails).c_str());
    return 1;
  }
  const PredictorConfig cfg = config_of(o, have ? &model : nullptr);
  const BaselineParams base = have ? model.baseline : default_baseline();
  note_short_window(cfg, base);
  NodeSampler ns(o.sysfs_root, rails, cfg, mp, base);
  std::vector<RailRisk> out;
  std::vector<std::string> notes;
  // --record: a trace of what was sampled (docs/PREDICTOR.md "Trace format"). Each counter
  // column is the running sum of that canonical counter's deltas since the start (so wraps,
  // resets and saturation were already handled per file: undeclared columns are wrap64).
  std::ofstream rec;
  std::vector<std::array<double, kNumCounters>> total(rails.size());
  if (!o.record.empty()) {
    rec.open(o.record);
    if (!rec) {
      fprintf(stderr, "r2ccl_predict: cannot write %s\n", o.record.c_str());
      return 1;
    }
    rec << "# r2ccl trace recorded by r2ccl_predict --live --record from " << o.sysfs_root
        << " every " << o.interval_s << " s; counters are running sums of deltas\n";
    rec << "t_s,rail,link,speed_mbps";
    for (int c = 0; c < kNumCounters; ++c) rec << "," << counter_name(c);
    rec << ",scenario\n";
  }
  const double start = mono_s();
  for (int i = 0; o.count <= 0 || i <= o.count; ++i) {
    notes.clear();
    const double now = mono_s();
    ns.sample(now, {}, &out, &notes);
    for (const auto& n : notes) fprintf(stderr, "r2ccl_predict: %s\n", n.c_str());
    if (rec.is_open()) {
      for (size_t r = 0; r < rails.size(); ++r) {
        // A counter with no usable delta this step (not read, or saturated: unknown) is
        // written empty, as the trace format has it, so that replay reads it as unknown too
        // rather than as a quiet 0. The priming round writes the sums' start, 0. A counter
        // reset this step restarts its sum at the count since the reset, so that replay reads
        // the reset too (unless that count is not below the old sum: then replay reads it as an
        // ordinary count over the step).
        Step st;
        const bool stepped = ns.last_step(r, &st);
        if (stepped)
          for (int c = 0; c < kNumCounters; ++c) {
            double& sum = total[r][static_cast<size_t>(c)];
            sum = (st.reset & (1u << c)) ? st.d[c] : sum + st.d[c];
          }
        char t[32];
        snprintf(t, sizeof(t), "%.3f", now - start);
        rec << t << "," << rails[r].name << "," << (st.link_up ? 1 : 0) << "," << st.speed_mbps;
        for (int c = 0; c < kNumCounters; ++c) {
          char v[32] = "";
          if (!stepped || !(st.missing & (1u << c)))
            snprintf(v, sizeof(v), "%.0f", total[r][static_cast<size_t>(c)]);
          rec << "," << v;
        }
        rec << ",live\n";
      }
      rec.flush();
    }
    if (i > 0) {
      printf("%-16s %-7s %-9s %-8s %-6s %s\n", "rail", "risk", "baseline", "retrans", "drain",
             "source");
      for (size_t k = 0; k < out.size(); ++k) {
        const RailRisk& r = out[k];
        char rt[16] = "-";
        if (r.a.retransmit_ratio >= 0)
          snprintf(rt, sizeof(rt), "%.3f%%", 100 * r.a.retransmit_ratio);
        if (ns.blind(k))
          printf("%-16s %-7s %-9s %-8s %-6s %s\n", r.name.c_str(), "-", "-", rt, "-",
                 "no counters readable: not predicted");
        else if (r.a.risk < 0)
          printf("%-16s %-7s %-9s %-8s %-6s %s\n", r.name.c_str(), "-", "-", rt, "-", "link down");
        else
          printf("%-16s %-7.3f %-9.3f %-8s %-6s %s%s%s\n", r.name.c_str(), r.a.risk,
                 r.a.baseline_risk, rt, r.a.drain ? "yes" : "no", source_name(r.a.source),
                 r.top.empty() ? "" : "  ", r.top.c_str());
      }
      printf("\n");
      fflush(stdout);
    }
    if (o.count > 0 && i == o.count) break;
    std::this_thread::sleep_for(std::chrono::duration<double>(o.interval_s));
  }
  return 0;
}

// ---- --info, --bench -----------------------------------------------------------------------
int run_info(const Options& o) {
  Model m;
  bool have = false;
  if (!get_model(o, &m, &have, true)) return 1;
  printf(
      "weights file version %u, features %u, hidden %u, window %u steps, horizon %u s, trained "
      "at %.1f s intervals\n",
      kModelVersion, m.n_features, m.hidden, m.window, m.horizon_s, m.interval_s);
  printf("size %zu bytes (limit %zu); baseline thresholds %.3g %.3g %.3g %.3g over %d steps\n",
         m.file_bytes, kModelMaxBytes, m.baseline.threshold[0], m.baseline.threshold[1],
         m.baseline.threshold[2], m.baseline.threshold[3], m.baseline.steps);
  if (m.baseline.rise_lag > 0)
    printf(
        "baseline rise rule: err_excess up >= %.3g over each of the last two %d-step intervals, "
        "the later rise >= %.3g x the earlier, at >= %.3g\n",
        m.baseline.rise_least, m.baseline.rise_lag, m.baseline.rise_ratio, m.baseline.rise_level);
  else
    printf("baseline rise rule: off\n");
  printf(
      "baseline fall rule (built in): err_excess and err_slope count 0 where err_excess fell by "
      ">= %.3g over the last %d steps\n",
      kFallLeast, kFallLag);
  const std::string note =
      baseline_window_note(m.baseline, static_cast<int>(m.window),
                           "the file's window of " + std::to_string(m.window) + " samples");
  if (!note.empty()) printf("note: %s\n", note.c_str());
  printf("metadata: %s\n", m.metadata.c_str());
  return 0;
}

int run_bench(const Options& o) {
  Model m;
  bool have = false;
  if (!get_model(o, &m, &have, true)) return 1;
  PredictorConfig cfg = config_of(o, &m);
  // What --decider runs at every sample: the baseline alone skips the LSTM.
  const Model* mp = o.decider == "baseline" ? nullptr : &m;
  RailPredictor p(cfg, mp, m.baseline);
  Step s;
  s.dt_s = cfg.interval_s;
  s.speed_mbps = 400000;
  s.d[kTxPackets] = 1e6;
  s.d[kTxBytes] = 1e9;
  const int warm = 64, iters = 20000;
  Assessment a;
  for (int i = 0; i < warm; ++i) {
    s.d[kSymbolErr] = i % 7;
    p.update(s, &a);
  }
  const auto t0 = std::chrono::steady_clock::now();
  double sink = 0;
  for (int i = 0; i < iters; ++i) {
    s.d[kSymbolErr] = i % 7;
    s.d[kRetrans] = i % 3;
    p.update(s, &a);
    sink += a.risk;
  }
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  printf(
      "inference: %.2f us per rail-sample (decider %s, window %d steps, hidden %u; %d samples; "
      "features + %s + decision; checksum %.3f)\n",
      us / iters, o.decider.c_str(), cfg.window_steps, m.hidden, iters,
      mp ? "LSTM + baseline" : "baseline", sink / iters);
  if (o.sysfs_root == "/sys" && !o.bench_sysfs) return 0;
  // A whole sampling round over the rails of a (fake) sysfs tree: file reads + inference.
  const std::vector<RailSpec> rails = discover_rails(o.sysfs_root);
  if (rails.empty()) {
    fprintf(stderr, "r2ccl_predict: no rails under %s\n", o.sysfs_root.c_str());
    return 1;
  }
  NodeSampler ns(o.sysfs_root, rails, cfg, mp, m.baseline);
  std::vector<RailRisk> out;
  const int rounds = 2000;
  double t = 1000;
  ns.sample(t, {}, &out, nullptr);
  const auto r0 = std::chrono::steady_clock::now();
  for (int i = 0; i < rounds; ++i) ns.sample(t += cfg.interval_s, {}, &out, nullptr);
  const double rus =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - r0).count();
  printf(
      "sampling round: %.1f us for %zu rails (%.1f us per rail: counter files + inference; "
      "%d rounds over %s)\n",
      rus / rounds, rails.size(), rus / rounds / static_cast<double>(rails.size()), rounds,
      o.sysfs_root.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const r2ccl::Config table = r2ccl::default_config();  // what the plugin runs with
  const PredictorConfig d = predictor_config_from(table);
  o.decider = table.predict_decider;
  o.lstm_cap = table.predict_lstm_cap;
  o.threshold = d.threshold;
  o.return_threshold = d.return_threshold;
  o.return_samples = d.return_samples;
  o.enter_samples = d.enter_samples;
  o.max_drains_per_hour = d.max_drains_per_hour;
  o.min_drain_s = d.min_drain_s;
  o.down_hold_s = d.down_hold_s;
  o.down_hold_after = d.down_hold_after;
  CLI::App app{"r2ccl failure predictor: replay traces, show live risk, extract features",
               "r2ccl_predict"};
  auto* modes = app.add_option_group("mode", "what the tool does");
  modes->add_option("--replay", o.replay, "print the risk over time of a trace (CSV)")
      ->type_name("TRACE");
  modes->add_flag("--live", o.live, "sample this node's rails and print their risk");
  modes->add_option("--features", o.features, "write a trace's features and labels (.npy) to --out")
      ->type_name("TRACE");
  modes
      ->add_option("--evaluate", o.evaluate,
                   "per decider (lstm, baseline, both): failures warned, false drains per "
                   "rail-week, early drains and the share of rail-time drained on a trace, then "
                   "sample-level precision, recall and F1")
      ->type_name("TRACE");
  modes->add_flag("--info", o.info, "describe the weights file");
  modes->add_flag("--bench", o.bench, "time the inference per rail-sample");
  modes->require_option(1);
  app.add_option("--out", o.out, "output directory for --features")->type_name("DIR");
  app.add_option("--model", o.model,
                 "weights file (default: $R2CCL_PREDICT_MODEL, else the shipped one)")
      ->type_name("FILE");
  app.add_option("--rail", o.rail, "--replay: only this rail")->type_name("NAME");
  app.add_option("--rails", o.rails,
                 "--live: only these rails, comma list of names (mlx5_0:1,eth2; default all)")
      ->type_name("LIST");
  app.add_option("--record", o.record,
                 "--live: also write what was sampled as a trace (for retraining on real "
                 "counters; label failures by the link column)")
      ->type_name("FILE");
  app.add_option("--sysfs-root", o.sysfs_root,
                 "--live, --bench: where the counters are (default /sys; --bench times a "
                 "sampling round over it when given)")
      ->type_name("DIR")
      ->each([&o](const std::string&) { o.bench_sysfs = true; });
  app.add_option("--interval", o.interval_s, "--live: seconds between samples (default 5)")
      ->check(number_in(0.01, 3600.0));
  app.add_option("--count", o.count, "--live: stop after N samples (default: run until killed)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--horizon", o.horizon_s,
                 "--features, --evaluate: label horizon, seconds (default 30)")
      ->check(number_in(0.001, 86400.0));
  app.add_option("--window-steps", o.window_steps, "samples the model sees (default: the model's)")
      ->check(CLI::Range(2, 4096));
  app.add_option(
         "--threshold", o.threshold,
         "drain at risk >= this " + as_param(fmt("%.2g", d.threshold), "R2CCL_PREDICT_THRESHOLD"))
      ->check(number_in(0.01, 1.0));
  app.add_option("--return-threshold", o.return_threshold,
                 "return below this " +
                     as_param(fmt("%.2g", d.return_threshold), "R2CCL_PREDICT_RETURN_THRESHOLD"))
      ->check(number_in(0.0, 1.0));
  app.add_option("--return-samples", o.return_samples,
                 "low samples before returning " +
                     as_param(std::to_string(d.return_samples), "R2CCL_PREDICT_RETURN_SAMPLES"))
      ->check(CLI::Range(1, 100000));
  app.add_option("--enter-samples", o.enter_samples,
                 "high samples before draining " +
                     as_param(std::to_string(d.enter_samples), "R2CCL_PREDICT_ENTER_SAMPLES"))
      ->check(CLI::Range(1, 100000));
  app.add_option(
         "--max-drains-per-hour", o.max_drains_per_hour,
         "drains allowed per rail within an hour " +
             as_param(std::to_string(d.max_drains_per_hour), "R2CCL_PREDICT_MAX_DRAINS_PER_HOUR"))
      ->check(CLI::Range(0, 100000));
  app.add_option("--decider", o.decider,
                 "--replay, --live: whose risk drains, both, baseline or lstm " +
                     as_param(table.predict_decider, "R2CCL_PREDICT_DECIDER"))
      ->check(CLI::IsMember({"both", "lstm", "baseline"}));
  app.add_option("--lstm-cap", o.lstm_cap,
                 "decider both (and --evaluate's both row): the LSTM's risk counts up to this "
                 "many times the baseline's " +
                     as_param(fmt("%.3g", table.predict_lstm_cap), "R2CCL_PREDICT_LSTM_CAP"))
      ->check(number_in(1.0, 100.0));
  app.add_option("--min-drain", o.min_drain_s,
                 "seconds a rail the risk drained stays drained at least, 0 off " +
                     as_param(fmt("%.0f", d.min_drain_s), "R2CCL_PREDICT_MIN_DRAIN"))
      ->check(number_in(0.0, 3600.0));
  app.add_option("--down-hold", o.down_hold_s,
                 "seconds a link that went down stays drained once back up, 0 off " +
                     as_param(fmt("%.0f", d.down_hold_s), "R2CCL_PREDICT_DOWN_HOLD"))
      ->check(number_in(0.0, 3600.0));
  app.add_option("--down-hold-after", o.down_hold_after,
                 "link-downs within an hour after which it is held out " +
                     as_param(std::to_string(d.down_hold_after), "R2CCL_PREDICT_DOWN_HOLD_AFTER"))
      ->check(CLI::Range(1, 1000));
  app.add_option("--min-lead", o.min_lead_s,
                 "--evaluate: a failure counts as warned when its rail was drained at least this "
                 "many seconds before (default 30)")
      ->check(number_in(0.0, 86400.0));
  app.add_option("--lead-window", o.lead_window_s,
                 "--evaluate: a drain on a failing rail not followed by its failure within this "
                 "many seconds is early (default 1800)")
      ->check(number_in(1.0, 864000.0));
  app.add_flag("--quiet", o.quiet, "--replay: print only drains, returns and failures");
  CLI::Option* events_opt =
      app.add_option(
             "--events-out", o.events_out,
             "--evaluate: also write one CSV line per decider for every failure (warned, "
             "late or missed, the lead in seconds, the drain's reason) and every drain no "
             "failure followed (false on a healthy rail, early on a failing one; its reason "
             "and the rail's error floor); docs/PREDICTOR.md \"Event-level evaluation\"")
          ->type_name("CSV");
  try {
    app.parse(argc, argv);
    if (!o.features.empty() && o.out.empty())
      throw CLI::ValidationError("--out", "--features needs --out DIR");
    if (events_opt->count() > 0 && o.events_out.empty())
      throw CLI::ValidationError("--events-out", "needs a file name");
    if (events_opt->count() > 0 && o.evaluate.empty())
      throw CLI::ValidationError("--events-out", "only with --evaluate");
    if (o.return_threshold > o.threshold)
      throw CLI::ValidationError("--return-threshold", "must be <= --threshold");
  } catch (const CLI::CallForHelp&) {
    printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    // With no arguments at all, the whole help; otherwise the error, where it stays visible.
    // A misspelt option is named first: without a mode the parser only says that one is
    // missing.
    if (argc <= 1) {
      fprintf(stderr, "%s", app.help().c_str());
      return 3;
    }
    std::string unknown;
    for (int i = 1; i < argc && unknown.empty(); ++i) {
      const std::string a = argv[i];
      if (a.size() > 2 && a.compare(0, 2, "--") == 0 &&
          !app.get_option_no_throw(a.substr(0, a.find('='))) && a != "--help")
        unknown = a.substr(0, a.find('='));
    }
    if (!unknown.empty())
      fprintf(stderr, "r2ccl_predict: unknown option %s\n", unknown.c_str());
    else
      fprintf(stderr, "r2ccl_predict: %s\n", e.what());
    fprintf(stderr, "(r2ccl_predict --help lists the options)\n");
    return 3;
  }
  if (!o.replay.empty()) return run_replay(o);
  if (!o.features.empty()) return run_features(o);
  if (!o.evaluate.empty()) return run_evaluate(o);
  if (o.live) return run_live(o);
  if (o.info) return run_info(o);
  return run_bench(o);
}
