// The net plugin's side of the failure predictor (docs/PREDICTOR.md "In the plugin"): run on
// the transport runtime's one background thread, shared by the TCP and the verbs runtimes.
//
// Every R2CCL_PREDICT_INTERVAL: if this process is (or becomes) the node's sampler on the
// health board, it reads every rail's NIC counters under R2CCL_SYSFS_ROOT, runs the predictor
// (the LSTM, or the threshold baseline when the weights are missing or corrupt) and publishes
// each rail's risk and drain decision; otherwise it reads the sampler's decisions from the
// board. Either way it sets each rail's RailCounters::predict_drain, which the connections'
// schedulers read: a drained rail gets no new chunks, in-flight ones finish. Every drain and
// return is one WARN event line with the risk and the top contributing counters.
//
// Without a board (R2CCL_HEALTH_BOARD=none, or it cannot be opened) every process samples for
// itself. When the sampler dies or hangs, followers keep its last decisions for
// board::kSamplerStaleIntervals intervals; a process that takes over keeps the rails drained
// that were drained until its own window is full and what was left of their least drain time
// or flap hold (RiskEntry::hold_s, as last published) has run; only then can they return.
// Thread-safety: init() on the init thread before the background thread starts; tick() only
// on the background thread. The drain flags are atomics read by any thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/health_board.h"
#include "r2ccl/params.h"
#include "r2ccl/predict/predictor.h"
#include "r2ccl/rail_stats.h"

namespace r2ccl::net {

class PredictAgent {
 public:
  struct Rail {
    predict::RailSpec spec;  // name as published on the board, and where its counters are
    RailCounters* live;      // the transport's counters of this rail (drain flag, TCP_INFO)
  };

  // `board` may be null or not open (no board). Does nothing when R2CCL_PREDICT=0.
  void init(const Config& cfg, std::vector<Rail> rails, board::Publisher* board,
            const std::string& board_name);
  // Background thread, every loop iteration; works at most once per interval.
  void tick(TimeUs now);
  bool enabled() const { return enabled_; }

 private:
  void sample_and_publish(TimeUs now);
  void follow_board(TimeUs now);
  void apply(size_t i, bool drain, float risk, const char* source, const std::string& top,
             int sampler_pid);

  bool enabled_ = false;
  const Config* cfg_ = nullptr;
  predict::PredictorConfig pcfg_;
  std::vector<Rail> rails_;
  board::Publisher* board_ = nullptr;
  std::string board_name_;
  TimeUs interval_ = 0;
  TimeUs next_ = 0;
  bool sampler_ = false;
  bool model_tried_ = false;
  bool window_noted_ = false;              // the short-window note on the baseline was logged
  std::unique_ptr<predict::Model> model_;  // null: the baseline decides
  // The baseline's thresholds: the weights file's when one was read (R2CCL_PREDICT_MODEL set,
  // or the LSTM deciding), else the compiled-in ones (the shipped file's, by construction).
  predict::BaselineParams baseline_ = predict::default_baseline();
  std::unique_ptr<predict::NodeSampler> sampler_state_;
  std::vector<predict::RailRisk> risks_;
  std::vector<std::string> notes_;
  std::vector<board::RiskEntry> entries_;
  std::vector<char> drained_;  // last applied decision per rail
  std::vector<char> inherit_;  // new sampler: drained by the previous one, until the window fills
  std::vector<TimeUs> inherit_until_;   // new sampler: and until the previous one's hold ends
  std::vector<TimeUs> hold_until_;      // follower: when the sampler's hold on a rail ends, 0 none
  TimeUs no_sampler_since_ = 0;         // follower: when the board last had no live sampler
  std::vector<std::string> top_;        // sampler: top counters of each drained rail
  std::vector<std::string> board_top_;  // sampler: the same as published (<= 47 characters)
};

}  // namespace r2ccl::net
