#include "r2ccl/predict/predictor.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace r2ccl::predict {

PredictorConfig predictor_config_from(const Config& cfg) {
  PredictorConfig p;
  p.interval_s = static_cast<double>(cfg.predict_interval) / 1e6;
  p.window_steps =
      static_cast<int>(std::max<int64_t>(2, cfg.predict_window / cfg.predict_interval));
  p.threshold = static_cast<float>(cfg.predict_threshold);
  p.return_threshold = static_cast<float>(cfg.predict_return_threshold);
  p.return_samples = static_cast<int>(cfg.predict_return_samples);
  p.enter_samples = static_cast<int>(cfg.predict_enter_samples);
  p.max_drains_per_hour = static_cast<int>(cfg.predict_max_drains_per_hour);
  p.min_drain_s = static_cast<double>(cfg.predict_min_drain) / 1e6;
  p.down_hold_s = static_cast<double>(cfg.predict_down_hold) / 1e6;
  p.down_hold_after = static_cast<int>(cfg.predict_down_hold_after);
  p.lstm_cap = cfg.predict_decider == "both" ? static_cast<float>(cfg.predict_lstm_cap) : 0.0f;
  return p;
}

const char* hold_text(Hold h) {
  switch (h) {
    case Hold::kHourLimit: return "the hourly drain limit";
    case Hold::kLastRail: return "the last usable rail";
    default: return "";
  }
}

std::string hold_message(const std::string& rail, const Assessment& a, const PredictorConfig& c) {
  char buf[320];
  if (a.hold == Hold::kHourLimit)
    snprintf(buf, sizeof(buf),
             "rail %s risk %.2f >= %.2f for %d samples, but not drained: %d drains began within "
             "the last hour (R2CCL_PREDICT_MAX_DRAINS_PER_HOUR=%d)",
             rail.c_str(), a.risk, c.threshold, c.enter_samples, a.drains_last_hour,
             c.max_drains_per_hour);
  else if (a.hold == Hold::kLastRail)
    snprintf(buf, sizeof(buf),
             "rail %s risk %.2f >= %.2f for %d samples, but not drained: it is the last usable "
             "rail (every other one is down or drained)",
             rail.c_str(), a.risk, c.threshold, c.enter_samples);
  else
    buf[0] = 0;
  return buf;
}

std::string down_hold_text(const Assessment& a) {
  if (!(a.down_hold_s > 0)) return "";
  char buf[160];
  snprintf(buf, sizeof(buf),
           "back up after %d link-down%s within an hour: held out for %.0f s "
           "(R2CCL_PREDICT_DOWN_HOLD)",
           a.downs_last_hour, a.downs_last_hour == 1 ? "" : "s", a.down_hold_s);
  return buf;
}

const char* source_name(Source s) {
  switch (s) {
    case Source::kLstm: return "lstm";
    case Source::kBaseline: return "baseline";
    case Source::kBoth: return "both";
    default: return "none";
  }
}

RailPredictor::RailPredictor(const PredictorConfig& cfg, const Model* model,
                             const BaselineParams& baseline)
    : cfg_(cfg),
      model_(model),
      baseline_(baseline),
      fx_(cfg.interval_s),
      window_(cfg.window_steps) {
  norm_.assign(static_cast<size_t>(window_.capacity()) * kNumFeatures, 0.0f);
  raw_.resize(static_cast<size_t>(window_.capacity()));
}

float RailPredictor::lstm_risk(uint32_t quiet) const {
  // Left-pad with zero rows (the training mean) to the full window, as in training. Features
  // in `quiet` are replaced over the whole window by what a quiet counter gives (raw 0: no
  // errors, no retransmits), utilisation by its training mean.
  const int W = window_.capacity(), n = window_.size();
  std::fill(norm_.begin(), norm_.end(), 0.0f);
  FeatureRow zero{};
  float quiet_norm[kNumFeatures];
  model_->normalise(zero, quiet_norm);
  quiet_norm[kUtil] = 0.0f;
  quiet_norm[kWarm] = 0.0f;
  for (int i = 0; i < n; ++i) {
    float* dst = &norm_[static_cast<size_t>(W - n + i) * kNumFeatures];
    model_->normalise(window_.row(i), dst);
    for (int f = 0; f < kNumFeatures; ++f)
      if (quiet & (1u << f)) dst[f] = quiet_norm[f];
  }
  return model_->infer(norm_.data(), W, &scratch_);
}

bool RailPredictor::update(const Step& s, Assessment* out, bool last_usable) {
  constexpr double kHourS = 3600;
  if (!(s.dt_s > 0) && link_ < 0) {
    // The rail's first reading (no deltas): the link state a later down is judged against.
    link_ = s.link_up ? 1 : 0;
    if (out) *out = last_;
    return false;
  }
  if (s.dt_s > 0) t_s_ += s.dt_s;
  bool back_up = false;
  if (s.dt_s > 0 && std::isfinite(s.dt_s)) {
    if (!s.link_up && link_ == 1) down_at_.push_back(t_s_);
    back_up = s.link_up && link_ == 0;
    link_ = s.link_up ? 1 : 0;
  }
  FeatureRow row;
  if (!fx_.push(s, &row)) {
    if (out) *out = last_;
    return false;
  }
  window_.push(row, s.d[kRetrans], s.d[kTxPackets]);
  Assessment a;
  const int n = window_.size();
  for (int i = 0; i < n; ++i) raw_[static_cast<size_t>(i)] = window_.row(i);
  a.baseline_risk = baseline_risk(raw_.data(), n, baseline_);
  if (model_ && cfg_.lstm_cap > 0) {
    // The LSTM raises the baseline's risk, to at most lstm_cap times it: it drains a rail only
    // where the baseline's risk is already at least threshold / lstm_cap (docs/PREDICTOR.md
    // "Deciders").
    a.risk = std::max(a.baseline_risk, std::min(lstm_risk(0), cfg_.lstm_cap * a.baseline_risk));
    a.source = Source::kBoth;
  } else if (model_) {
    a.risk = lstm_risk(0);
    a.source = Source::kLstm;
  } else {
    a.risk = a.baseline_risk;
    a.source = Source::kBaseline;
  }
  a.retransmit_ratio = window_.retransmit_ratio();
  a.drain = last_.drain;
  auto within_hour = [&](std::vector<double>* v) {
    v->erase(std::remove_if(v->begin(), v->end(), [&](double t) { return t <= t_s_ - kHourS; }),
             v->end());
  };
  within_hour(&drain_at_);
  within_hour(&down_at_);
  a.downs_last_hour = static_cast<int>(down_at_.size());
  if (back_up && cfg_.down_hold_s > 0 && a.downs_last_hour >= std::max(1, cfg_.down_hold_after)) {
    const double hold = std::min(
        kHourS, cfg_.down_hold_s * std::ldexp(1.0, a.downs_last_hour - cfg_.down_hold_after));
    if (a.drain || !last_usable) {
      hold_until_ = std::max(hold_until_, t_s_ + hold);  // a longer min_drain_s stands
      a.down_hold_s = hold;
      if (!a.drain) {
        a.drain = true;
        a.transition = +1;
        low_run_ = 0;
        high_run_ = 0;
      }
    }
  }
  if (a.drain && t_s_ < hold_until_) {
    // Held out: the return waits for the hold's end (low samples still count).
    low_run_ = a.risk < cfg_.return_threshold ? low_run_ + 1 : 0;
  } else if (!a.drain) {
    high_run_ = a.risk >= cfg_.threshold ? high_run_ + 1 : 0;
    if (high_run_ >= std::max(1, cfg_.enter_samples)) {
      if (last_usable)
        a.hold = Hold::kLastRail;
      else if (static_cast<int>(drain_at_.size()) >= cfg_.max_drains_per_hour)
        a.hold = Hold::kHourLimit;
      if (a.hold == Hold::kNone) {
        a.drain = true;
        a.transition = +1;
        low_run_ = 0;
        high_run_ = 0;
        drain_at_.push_back(t_s_);
        // The return waits at least min_drain_s (a flap hold already running may be longer).
        if (cfg_.min_drain_s > 0) hold_until_ = std::max(hold_until_, t_s_ + cfg_.min_drain_s);
      } else {
        a.hold_new = a.hold != last_.hold;  // once per run of high samples and cause
      }
    }
  } else {
    low_run_ = a.risk < cfg_.return_threshold ? low_run_ + 1 : 0;
    if (low_run_ >= cfg_.return_samples) {
      a.drain = false;
      a.transition = -1;
      low_run_ = 0;
    }
  }
  a.drains_last_hour = static_cast<int>(drain_at_.size());
  a.hold_left_s = a.drain && hold_until_ > t_s_ ? hold_until_ - t_s_ : 0;
  last_ = a;
  if (out) *out = a;
  return true;
}

std::string RailPredictor::top_contributors(int n) const {
  if (window_.size() == 0) return "-";
  // The features computed from the same counters (a rate and its delta) form one group.
  struct Group {
    std::string name;
    uint32_t mask = 0;
    float share = 0;
    bool rising = false;  // the baseline's rise rule fired on these counters
  };
  std::vector<Group> groups;
  // Whose view explains the last assessment: the LSTM's when it decided alone, or under "both"
  // when its (capped) risk was above the baseline's; else the baseline's.
  const bool lstm_view = model_ && (cfg_.lstm_cap <= 0 || last_.risk > last_.baseline_risk);
  for (int f = 0; f < kNumFeatures; ++f) {
    if (!lstm_view && f >= 4) break;  // the baseline looks at features 0..3 only
    const std::string name = feature_counters(f);
    if (name == "-") continue;  // not a counter (kWarm)
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.name == name; });
    if (it == groups.end())
      groups.push_back({name, 1u << f, 0});
    else
      it->mask |= 1u << f;
  }
  if (lstm_view) {
    // The risk this rail would lose if those counters had been quiet over the whole window.
    const float base = lstm_risk(0);
    for (auto& g : groups) g.share = base - lstm_risk(g.mask);
  } else {
    const int rows = window_.size();
    for (int i = 0; i < rows; ++i) raw_[static_cast<size_t>(i)] = window_.row(i);
    float ratio[4];
    bool rising = false;
    baseline_risk(raw_.data(), rows, baseline_, ratio, &rising);
    for (auto& g : groups) {
      for (int f = 0; f < 4; ++f)
        if (g.mask & (1u << f)) g.share = std::max(g.share, ratio[f]);
      // The rise rule decided: the error counters come first, named as rising.
      if (rising && (g.mask & (1u << kErrExcess))) g.rising = true;
    }
  }
  std::sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    return a.rising != b.rising ? a.rising : a.share > b.share;
  });
  std::string out;
  int k = 0;
  for (const auto& g : groups) {
    if (k == n || !(g.share > 0.005f || g.rising)) break;
    char buf[128];
    if (g.rising)
      snprintf(buf, sizeof(buf), "%s%s (rising, x%.2f of threshold)", k ? ", " : "", g.name.c_str(),
               g.share);
    else
      snprintf(buf, sizeof(buf), lstm_view ? "%s%s (-%.2f if quiet)" : "%s%s (x%.2f of threshold)",
               k ? ", " : "", g.name.c_str(), g.share);
    out += buf;
    ++k;
  }
  return out.empty() ? "-" : out;
}

NodeSampler::NodeSampler(const std::string& sysfs_root, const std::vector<RailSpec>& rails,
                         const PredictorConfig& cfg, const Model* model,
                         const BaselineParams& baseline) {
  // FEC statistics are the running kernel's, not a file under the root: asked only when the
  // root is the real /sys (a fake tree's interface names may not exist, or be other ones).
  // The kernel answers in the asking thread under rtnl_lock: never on the caller's thread.
  char* real = ::realpath(sysfs_root.c_str(), nullptr);
  if (real && std::string(real) == "/sys")
    fec_ = std::make_unique<AsyncFecSource>(std::make_unique<EthtoolFec>());
  std::free(real);
  for (const auto& r : rails) {
    rails_.emplace_back(sysfs_root, r);
    rails_.back().set_fec_source(fec_.get());
    preds_.push_back(std::make_unique<RailPredictor>(cfg, model, baseline));
  }
  blind_.assign(rails_.size(), 0);
  steps_.resize(rails_.size());
  stepped_.assign(rails_.size(), 0);
}

void NodeSampler::sample(double now_s, const std::vector<ExtraCounters>& extra,
                         std::vector<RailRisk>* out, std::vector<std::string>* notes) {
  out->resize(rails_.size());
  for (size_t i = 0; i < rails_.size(); ++i) {
    RailRisk& rr = (*out)[i];
    rr.name = rails_[i].spec().name;
    rr.top.clear();
    Step s;
    const ExtraCounters ex = i < extra.size() ? extra[i] : ExtraCounters{};
    const bool stepped = rails_[i].read(now_s, ex, &s, notes);
    steps_[i] = s;
    stepped_[i] = stepped;
    if (!stepped) {
      preds_[i]->update(s, &rr.a);  // the priming read: its link state only
      continue;
    }
    if (rails_[i].files_present() == 0) {
      // Nothing to predict from (no such device under the sysfs root, or no permission):
      // risk unknown, never a drain. Said once.
      if (!blind_[i] && notes)
        notes->push_back(rails_[i].dir() + ": no counter file readable; rail " + rr.name +
                         " is not predicted");
      blind_[i] = true;
      rr.a = Assessment{};
      continue;
    }
    blind_[i] = false;
    // The guard's set is the node's rails: is any other one usable (link up, not drained)? A
    // node of one rail is exempt: there is no other rail to keep (the engine still uses a
    // drained path when it has nothing else).
    bool other_usable = false;
    for (size_t j = 0; j < rails_.size() && !other_usable; ++j)
      other_usable = j != i && steps_[j].link_up && !preds_[j]->last().drain;
    preds_[i]->update(s, &rr.a, !other_usable && rails_.size() > 1);
    if (rr.a.transition != 0)
      rr.top = rr.a.down_hold_s > 0 ? down_hold_text(rr.a) : preds_[i]->top_contributors(3);
  }
}

std::string down_hold_short_text(const Assessment& a) {
  if (!(a.down_hold_s > 0)) return "";
  char buf[64];
  snprintf(buf, sizeof(buf), "flap hold %.0f s (%d down%s in 1 h)", a.down_hold_s,
           a.downs_last_hour, a.downs_last_hour == 1 ? "" : "s");
  return buf;
}

bool load_configured_model(const Config& cfg, Model* out, std::string* path, std::string* err) {
  std::string p = cfg.predict_model;
  if (p.empty()) {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&load_configured_model), &info) && info.dli_fname) {
      std::string bin = info.dli_fname;
      const size_t slash = bin.rfind('/');
      const std::string dir = slash == std::string::npos ? "." : bin.substr(0, slash);
      p = dir + "/../share/r2ccl/r2ccl_lstm.bin";
    } else {
      p = "r2ccl_lstm.bin";
    }
  }
  *path = p;
  std::string why;
  if (!load_model(p, out, &why)) {
    *err = "predictor weights " + p + " " + why;
    return false;
  }
  return true;
}

}  // namespace r2ccl::predict
