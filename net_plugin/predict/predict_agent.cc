#include "predict/predict_agent.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "r2ccl/log.h"

namespace r2ccl::net {

void PredictAgent::init(const Config& cfg, std::vector<Rail> rails, board::Publisher* board,
                        const std::string& board_name) {
  cfg_ = &cfg;
  enabled_ = cfg.predict && !rails.empty();
  if (!enabled_) {
    if (!cfg.predict) R2CCL_INFO(NCCL_NET | NCCL_INIT, "failure predictor off (R2CCL_PREDICT=0)");
    return;
  }
  pcfg_ = predict::predictor_config_from(cfg);
  rails_ = std::move(rails);
  board_ = board && board->is_open() ? board : nullptr;
  board_name_ = board_name;
  interval_ = cfg.predict_interval;
  drained_.assign(rails_.size(), 0);
  inherit_.assign(rails_.size(), 0);
  inherit_until_.assign(rails_.size(), 0);
  hold_until_.assign(rails_.size(), 0);
  top_.assign(rails_.size(), "");
  board_top_.assign(rails_.size(), "");
  R2CCL_INFO(NCCL_NET | NCCL_INIT,
             "failure predictor: %zu rails, every %.1f s over %d samples, drain at risk >= %.2f, "
             "counters under %s%s",
             rails_.size(), interval_ / 1e6, pcfg_.window_steps, pcfg_.threshold,
             cfg.sysfs_root.c_str(), board_ ? "" : " (no health board: this process samples)");
}

void PredictAgent::tick(TimeUs now) {
  if (!enabled_ || now < next_) return;
  next_ = now + interval_;
  const bool was = sampler_;
  sampler_ = board_ ? board_->claim_sampler(interval_) : true;
  if (sampler_ && !was && board_)
    R2CCL_INFO(NCCL_NET, "failure predictor: this process (pid %d) samples for the node",
               static_cast<int>(getpid()));
  if (!sampler_ && was) sampler_state_.reset();  // taken over: start afresh if it comes back
  if (sampler_ && !was) {
    // A new sampler starts with an empty window, which would read as "all quiet" and return a
    // degrading rail to service. The rails the previous sampler drained stay drained until
    // this process has a full window of its own, and at least as long as the previous sampler
    // would have kept them (its least drain time or flap hold, as it last published them).
    inherit_ = drained_;
    inherit_until_ = hold_until_;
  }
  if (sampler_)
    sample_and_publish(now);
  else
    follow_board(now);
}

void PredictAgent::sample_and_publish(TimeUs now) {
  if (!model_tried_ && cfg_->predict_decider == "baseline") {
    model_tried_ = true;
    // A weights file named explicitly (a retrained model) carries its own baseline thresholds,
    // as r2ccl_predict --replay/--evaluate read them; the shipped file's are compiled in.
    std::string from = "built in";
    if (!cfg_->predict_model.empty()) {
      predict::Model m;
      std::string path, err;
      if (predict::load_configured_model(*cfg_, &m, &path, &err)) {
        baseline_ = m.baseline;
        from = path;
      } else {
        log_event("r2ccl predict: %s; the built-in baseline thresholds are used", err.c_str());
      }
    }
    R2CCL_INFO(NCCL_NET,
               "failure predictor: the threshold baseline decides (R2CCL_PREDICT_DECIDER="
               "baseline), thresholds %s",
               from.c_str());
  }
  if (!model_tried_) {
    model_tried_ = true;
    auto m = std::make_unique<predict::Model>();
    std::string path, err;
    if (predict::load_configured_model(*cfg_, m.get(), &path, &err)) {
      if (m->window != static_cast<uint32_t>(pcfg_.window_steps))
        log_event(
            "r2ccl predict: %s was trained on %u-sample windows; R2CCL_PREDICT_WINDOW / "
            "R2CCL_PREDICT_INTERVAL gives %d: its risks may be off",
            path.c_str(), m->window, pcfg_.window_steps);
      if (std::fabs(m->interval_s - pcfg_.interval_s) > 0.01 * m->interval_s)
        log_event(
            "r2ccl predict: %s was trained on samples %.1f s apart; R2CCL_PREDICT_INTERVAL "
            "is %.1f s: the same rates per second, but trends per sample differ and its "
            "risks may be off",
            path.c_str(), m->interval_s, pcfg_.interval_s);
      if (pcfg_.lstm_cap > 0)
        R2CCL_INFO(NCCL_NET,
                   "failure predictor: the threshold baseline, raised by the LSTM up to %.3g x "
                   "its risk, decides (R2CCL_PREDICT_DECIDER=both); LSTM weights %s (%zu bytes, "
                   "hidden %u)",
                   pcfg_.lstm_cap, path.c_str(), m->file_bytes, m->hidden);
      else
        R2CCL_INFO(NCCL_NET,
                   "failure predictor: the LSTM decides (R2CCL_PREDICT_DECIDER=lstm); weights %s "
                   "(%zu bytes, hidden %u)",
                   path.c_str(), m->file_bytes, m->hidden);
      baseline_ = m->baseline;
      model_ = std::move(m);
    } else {
      // An event line too: visible without NCCL_DEBUG (stderr or R2CCL_LOG_FILE).
      log_event("r2ccl predict: %s; the threshold baseline decides instead", err.c_str());
    }
  }
  // Wherever the baseline takes part (alone, or under "both"): its thresholds apply to the mean
  // of its last `steps` samples and its rise rule to its last 2 lag + 1, at most a window's.
  if ((!model_ || pcfg_.lstm_cap > 0) && !window_noted_) {
    window_noted_ = true;
    const std::string note = predict::baseline_window_note(
        baseline_, pcfg_.window_steps, "R2CCL_PREDICT_WINDOW / R2CCL_PREDICT_INTERVAL");
    if (!note.empty()) log_event("r2ccl predict: %s", note.c_str());
  }
  if (!sampler_state_) {
    std::vector<predict::RailSpec> specs;
    for (const auto& r : rails_) specs.push_back(r.spec);
    sampler_state_ = std::make_unique<predict::NodeSampler>(cfg_->sysfs_root, specs, pcfg_,
                                                            model_.get(), baseline_);
  }
  // TCP rails: the retransmits of every r2ccl process on the node, from the board's slots
  // (this process's own counters when there is no board).
  std::vector<predict::ExtraCounters> extra(rails_.size());
  std::map<std::string, predict::ExtraCounters> by_name;
  if (board_) {
    board::BoardView v;
    std::string err;
    if (board::read_board(board_name_, &v, &err)) {
      for (const auto& s : v.rails) {
        if (s.f.transport != board::Transport::kTcp) continue;
        auto& e = by_name[s.f.name];
        e.present = true;
        e.retrans += s.f.tcp_retrans;
        e.segs_out += s.f.tcp_segs_out;
      }
    }
  }
  for (size_t i = 0; i < rails_.size(); ++i) {
    if (rails_[i].spec.kind != predict::RailSpec::Kind::kEth) continue;
    auto it = by_name.find(rails_[i].spec.name);
    if (it != by_name.end()) {
      extra[i] = it->second;
    } else if (!board_) {
      extra[i].present = true;
      extra[i].retrans = rails_[i].live->tcp_retrans.load(std::memory_order_relaxed);
      extra[i].segs_out = rails_[i].live->tcp_segs_out.load(std::memory_order_relaxed);
    }
  }
  notes_.clear();
  sampler_state_->sample(static_cast<double>(now) / 1e6, extra, &risks_, &notes_);
  for (const auto& n : notes_) R2CCL_INFO(NCCL_NET, "failure predictor: %s", n.c_str());
  entries_.resize(rails_.size());
  for (size_t i = 0; i < rails_.size(); ++i) {
    const predict::RailRisk& r = risks_[i];
    if (r.a.hold_new)
      R2CCL_WARN("r2ccl predict: %s", predict::hold_message(r.name, r.a, pcfg_).c_str());
    board::RiskEntry& e = entries_[i];
    e = board::RiskEntry{};
    board::set_text(e.rail, sizeof(e.rail), r.name);
    e.risk = r.a.risk;
    e.retransmit_ratio = static_cast<float>(r.a.retransmit_ratio);
    e.source = r.a.source == predict::Source::kLstm       ? board::RiskSource::kLstm
               : r.a.source == predict::Source::kBaseline ? board::RiskSource::kBaseline
               : r.a.source == predict::Source::kBoth     ? board::RiskSource::kBoth
                                                          : board::RiskSource::kNone;
    bool drain = r.a.drain;
    // Until when the rail stays drained at least, whatever the risk (CLOCK_MONOTONIC us).
    TimeUs until = r.a.drain ? now + static_cast<TimeUs>(std::ceil(r.a.hold_left_s * 1e6)) : 0;
    if (inherit_[i]) {
      if (sampler_state_->predictor(i).window().size() >= pcfg_.window_steps &&
          now >= inherit_until_[i]) {
        inherit_[i] = 0;
      } else {
        drain = true;
        until = std::max(until, inherit_until_[i]);
      }
    }
    e.drain = drain ? 1 : 0;
    // What is left of the hold, handed to a sampler that takes over (whole seconds, rounded up).
    e.hold_s = drain && until > now
                   ? static_cast<uint16_t>(std::min<TimeUs>(
                         board::kMaxHoldS, (until - now + kUsPerSec - 1) / kUsPerSec))
                   : 0;
    // The top counters are worked out at a transition (occlusion costs 9 inferences) and
    // kept while the rail stays drained.
    if (r.a.transition != 0) {
      top_[i] = r.a.drain ? r.top : "";
      // The board's cause field is 47 characters: a flap hold goes there in its short form.
      board_top_[i] =
          r.a.drain && r.a.down_hold_s > 0 ? predict::down_hold_short_text(r.a) : top_[i];
    }
    if (drain && !r.a.drain && top_[i].empty())
      board_top_[i] = top_[i] = "kept drained: inherited from the last sampler";
    board::set_text(e.top, sizeof(e.top), board_top_[i]);
    apply(i, drain, r.a.risk, predict::source_name(r.a.source), top_[i], 0);
  }
  if (board_) board_->publish_risks(entries_, now);
}

void PredictAgent::follow_board(TimeUs now) {
  board::SamplerView v;
  std::string err;
  if (!board::read_sampler(board_name_, &v, &err)) v = board::SamplerView{};
  if (v.rails.empty()) {
    // No live sampler right now (it died or hung, and no process has taken over yet): keep the
    // last decisions for kSamplerStaleIntervals intervals (a takeover is normally one interval
    // away), then return the drained rails.
    if (no_sampler_since_ == 0) no_sampler_since_ = now;
    if (now - no_sampler_since_ < board::kSamplerStaleIntervals * interval_) return;
    for (size_t i = 0; i < rails_.size(); ++i) {
      hold_until_[i] = 0;
      apply(i, false, -1, "none", "", v.owner);
    }
    return;
  }
  no_sampler_since_ = 0;
  for (size_t i = 0; i < rails_.size(); ++i) {
    const board::RiskEntry* e = board::find_risk(v, rails_[i].spec.name);
    if (!e) {
      hold_until_[i] = 0;
      apply(i, false, -1, "none", "", v.owner);
      continue;
    }
    hold_until_[i] = e->drain && e->hold_s > 0 ? v.publish_us + e->hold_s * kUsPerSec : 0;
    apply(i, e->drain != 0, e->risk, board::risk_source_name(e->source), e->top, v.owner);
  }
}

void PredictAgent::apply(size_t i, bool drain, float risk, const char* source,
                         const std::string& top, int sampler_pid) {
  if (static_cast<bool>(drained_[i]) == drain) return;
  drained_[i] = drain;
  rails_[i].live->predict_drain.store(drain, std::memory_order_relaxed);
  const std::string& name = rails_[i].spec.name;
  char who[48] = "";
  if (sampler_pid > 0) snprintf(who, sizeof(who), ", node sampler pid %d", sampler_pid);
  if (drain && risk < pcfg_.threshold && !top.empty()) {
    // Not the risk: a flapping link held out (R2CCL_PREDICT_DOWN_HOLD), or a rail inherited
    // drained; `top` says which.
    rails_[i].live->predict_drains.fetch_add(1, std::memory_order_relaxed);
    log_event(
        "r2ccl predict: rail %s risk %.2f (%s%s): draining it, no new chunks, in-flight ones "
        "finish: %s",
        name.c_str(), risk, source, who, top.c_str());
  } else if (drain) {
    rails_[i].live->predict_drains.fetch_add(1, std::memory_order_relaxed);
    log_event(
        "r2ccl predict: rail %s risk %.2f >= %.2f (%s%s): draining it, no new chunks, "
        "in-flight ones finish; top counters: %s",
        name.c_str(), risk, pcfg_.threshold, source, who, top.empty() ? "-" : top.c_str());
  } else if (risk >= 0) {
    log_event(
        "r2ccl predict: rail %s risk %.2f below %.2f for %d samples (%s%s): carrying data "
        "again",
        name.c_str(), risk, pcfg_.return_threshold, pcfg_.return_samples, source, who);
  } else {
    log_event(
        "r2ccl predict: rail %s: no live risk from the node's sampler for %d intervals: "
        "carrying data again",
        name.c_str(), static_cast<int>(board::kSamplerStaleIntervals));
  }
}

}  // namespace r2ccl::net
