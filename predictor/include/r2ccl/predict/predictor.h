// Per-rail failure prediction with drain hysteresis, and the node sampler that runs it over
// every rail of a node. docs/PREDICTOR.md describes the features, models and decisions.
//
// Decisions: a rail drains when its risk stays at or above `threshold` for `enter_samples`
// consecutive samples; a drained rail returns once its risk stays below `return_threshold`
// for `return_samples` consecutive samples. While the link is down nothing is decided (the
// transport's failover handles a dead link). A guard holds whatever the model says: a rail
// drains at most `max_drains_per_hour` times within any hour of trace time (a drain beyond it
// is refused), and never while it is the last usable rail of its set (every other rail down or
// drained: the caller says so; NodeSampler's set is the node's rails, a node of one rail
// exempt). A refused drain is reported once per high run (Hold). A drain the risk began
// lasts at least `min_drain_s` (the return rule waits for it; low samples still count).
// A flapping link is held out (flap dampening): when the link comes back up after its
// `down_hold_after`-th down within an hour, the rail is drained for `down_hold_s`, doubled for
// each further down within the hour (at most an hour), whatever the risk; then the usual
// return rule applies. The hold needs no enter samples and is not counted against
// max_drains_per_hour (those limit what the model asks), but it never takes the last usable
// rail either.
// Thread-safety: none; a RailPredictor/NodeSampler belongs to one thread (the net plugin's
// background thread, or a tool's main thread). The Model it points to must outlive it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "r2ccl/params.h"
#include "r2ccl/predict/counters.h"
#include "r2ccl/predict/features.h"
#include "r2ccl/predict/fec.h"
#include "r2ccl/predict/model.h"

namespace r2ccl::predict {

struct PredictorConfig {
  double interval_s = 5;          // R2CCL_PREDICT_INTERVAL
  int window_steps = 24;          // R2CCL_PREDICT_WINDOW / R2CCL_PREDICT_INTERVAL
  float threshold = 0.9f;         // R2CCL_PREDICT_THRESHOLD
  float return_threshold = 0.4f;  // R2CCL_PREDICT_RETURN_THRESHOLD
  int return_samples = 6;         // R2CCL_PREDICT_RETURN_SAMPLES
  int enter_samples = 3;          // R2CCL_PREDICT_ENTER_SAMPLES
  int max_drains_per_hour = 2;    // R2CCL_PREDICT_MAX_DRAINS_PER_HOUR
  double min_drain_s = 1200;      // R2CCL_PREDICT_MIN_DRAIN, seconds; 0 off
  double down_hold_s = 600;       // R2CCL_PREDICT_DOWN_HOLD, seconds; 0 off
  int down_hold_after = 1;        // R2CCL_PREDICT_DOWN_HOLD_AFTER
  // > 0: with a model, the decider is "both" (R2CCL_PREDICT_DECIDER=both): the risk is the
  // baseline's, or the LSTM's where it is higher, but at most lstm_cap times the baseline's
  // (R2CCL_PREDICT_LSTM_CAP). So the LSTM drains a rail only where the baseline's own risk is
  // at least threshold / lstm_cap. 0: the model alone decides.
  float lstm_cap = 0;
};
PredictorConfig predictor_config_from(const Config& cfg);

enum class Source : uint8_t { kNone = 0, kLstm = 1, kBaseline = 2, kBoth = 3 };
const char* source_name(Source s);  // "none", "lstm", "baseline", "both"

// Why a rail whose risk asks for a drain is not drained.
enum class Hold : uint8_t {
  kNone = 0,
  kHourLimit = 1,  // max_drains_per_hour drains already began within the last hour
  kLastRail = 2,   // every other rail of its set is down or drained
};
const char* hold_text(Hold h);  // "", "the hourly drain limit", "the last usable rail"

struct Assessment {
  float risk = -1;                // the deciding model's risk, 0..1
  float baseline_risk = -1;       // the baseline's risk (always computed)
  Source source = Source::kNone;  // which model decided
  double retransmit_ratio = -1;   // ccl_retransmit_ratio over the window, 0..1; -1 unknown
  bool drain = false;             // the decision after this sample
  int transition = 0;             // +1: started draining at this sample; -1: returned
  Hold hold = Hold::kNone;        // the guard refused a drain at this sample
  bool hold_new = false;          // first refusal of this run of high samples: report it
  int drains_last_hour = 0;       // drains this rail began within the last hour
  double down_hold_s = 0;         // > 0: a flap hold of this many seconds began at this sample
  int downs_last_hour = 0;        // link-downs of this rail within the last hour
  // With drain: seconds of trace time the rail stays drained at least from this sample (what
  // is left of min_drain_s or a flap hold; the return rule waits for it), 0 when none.
  double hold_left_s = 0;
};
// "back up after 3 link-downs within an hour: held out for 1200 s (R2CCL_PREDICT_DOWN_HOLD)"
// for an assessment whose down_hold_s > 0; "" otherwise.
std::string down_hold_text(const Assessment& a);
// The same in under 48 characters, for the health board's cause field (board::kCauseLen):
// "flap hold 1200 s (3 downs in 1 h)"; "" when down_hold_s is 0.
std::string down_hold_short_text(const Assessment& a);

// The line a refused drain is reported with (a WARN in the plugin, stderr in the tools):
// "rail NAME risk R >= T for N samples, but not drained: WHY". "" when a.hold is kNone.
std::string hold_message(const std::string& rail, const Assessment& a, const PredictorConfig& c);

class RailPredictor {
 public:
  // `model` may be null: the baseline decides (with `baseline`). With a model, the LSTM decides,
  // or both do (cfg.lstm_cap > 0).
  RailPredictor(const PredictorConfig& cfg, const Model* model, const BaselineParams& baseline);

  // Feeds one step. Returns true with *out filled when the step produced a feature row (link
  // up, dt > 0); false otherwise (the decision is unchanged; *out keeps the last values).
  // Feed the rail's first reading too (dt 0, no deltas): it sets the link state, so that a
  // down at the next reading counts for the flap hold, as the trace tools count failures.
  // `last_usable`: every other rail of this rail's set is down or drained now, so this one
  // may not drain (it keeps a drain it already has).
  bool update(const Step& s, Assessment* out, bool last_usable = false);

  const Assessment& last() const { return last_; }
  // The counters that push the risk up most, as "symbol_err+rcv_err (-0.42 if quiet), ...":
  // for the LSTM, the risk that would be lost had those counters been quiet over the whole
  // window (their features replaced by a quiet counter's; a rate and its delta together), so
  // no share exceeds the risk; for the baseline, each feature's ratio to its threshold. At most
  // `n` entries with a positive share; "-" when none.
  std::string top_contributors(int n) const;
  // Raw feature rows of the window, oldest first (for tools and tests).
  const FeatureWindow& window() const { return window_; }

 private:
  float lstm_risk(uint32_t quiet_features) const;  // bit f: feature f replaced by a quiet value

  PredictorConfig cfg_;
  const Model* model_;
  BaselineParams baseline_;
  FeatureExtractor fx_;
  FeatureWindow window_;
  Assessment last_;
  int low_run_ = 0;
  int high_run_ = 0;
  double t_s_ = 0;                       // trace time: the sum of every step's dt
  std::vector<double> drain_at_;         // when the drains within the last hour began (t_s_)
  std::vector<double> down_at_;          // when the link-downs within the last hour began
  int link_ = -1;                        // link state at the last step: 1 up, 0 down, -1 none
  double hold_until_ = -1;               // a flap hold lasts until this t_s_
  mutable std::vector<float> norm_;      // [window x F] scratch
  mutable std::vector<FeatureRow> raw_;  // scratch for the baseline
  mutable Model::Scratch scratch_;
};

// The live sampler of one node: reads every rail's counters under the sysfs root and runs a
// RailPredictor per rail.
struct RailRisk {
  std::string name;
  Assessment a;
  std::string top;  // top contributing counters at a transition, else ""
};

class NodeSampler {
 public:
  NodeSampler(const std::string& sysfs_root, const std::vector<RailSpec>& rails,
              const PredictorConfig& cfg, const Model* model, const BaselineParams& baseline);
  // One sampling round at monotonic time `now_s`. `extra` is indexed like the rails (may be
  // shorter: missing entries have no extra counters). Counter notes (saturation, resets) are
  // appended to *notes. The first call only primes the counters: *out gets risk -1 entries.
  // A rail none of whose counter files is readable gets risk -1 (never drained).
  void sample(double now_s, const std::vector<ExtraCounters>& extra, std::vector<RailRisk>* out,
              std::vector<std::string>* notes);
  size_t size() const { return rails_.size(); }
  const RailPredictor& predictor(size_t i) const { return *preds_[i]; }
  // Rail i's last reading: link state and speed always; deltas only when this returns true
  // (not on the priming round). For recording traces.
  bool last_step(size_t i, Step* out) const {
    *out = steps_[i];
    return stepped_[i];
  }
  // Rail i had no readable counter file at its last read (it is not predicted).
  bool blind(size_t i) const { return blind_[i]; }
  // Every rail's FEC statistics come from `src` (not owned; outlives the sampler; null: none).
  // By default they come from the kernel's ethtool netlink (EthtoolFec on its own thread,
  // AsyncFecSource: readings lag one sample) when the root resolves to the real /sys, and from
  // nowhere for any other root. For tests.
  void set_fec_source(FecSource* src) {
    for (auto& r : rails_) r.set_fec_source(src);
  }

 private:
  std::unique_ptr<FecSource> fec_;  // declared before rails_, which point at it
  std::vector<SysfsRail> rails_;
  std::vector<std::unique_ptr<RailPredictor>> preds_;
  std::vector<char> blind_;  // rail i had no readable counter file at its last read
  std::vector<Step> steps_;
  std::vector<char> stepped_;
};

// The weights file the plugin uses: R2CCL_PREDICT_MODEL when set, else r2ccl_lstm.bin in
// ../share/r2ccl/ next to the directory of the binary this code is linked into (the plugin's
// lib/ in an install or a build tree). Loads it; on failure returns false and *err says which
// file and why (the caller WARNs and runs the baseline).
bool load_configured_model(const Config& cfg, Model* out, std::string* path, std::string* err);

}  // namespace r2ccl::predict
