// Features of the failure predictor (docs/PREDICTOR.md "Features"): one row of eleven floats
// per sampling step with the link up, and the sliding window of rows the model looks at.
// Pure; thread-safety: none (one object per rail, owned by one thread).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "r2ccl/predict/counters.h"

namespace r2ccl::predict {

constexpr int kNumFeatures = 11;
using FeatureRow = std::array<float, kNumFeatures>;

// The features judge each counter against the rail's own history (a trend), not its level:
// a steady error floor, whatever its height, reads as 0. Indices:
enum Feature : int {
  kErrExcess = 0,      // max over the error counters of (short-term level - the rail's floor)
  kErrSlope = 1,       // max over the error counters of the level's rise, per minute
  kLinkEvents = 2,     // link_recovery + link_downed + integrity, smoothed log rate
  kRetransExcess = 3,  // retrans: short-term level - the rail's floor
  kErrAccel = 4,       // max over the error counters of the slope's change, per minute
  kUtil = 5,           // max(tx, rx) bytes / (dt x speed), 0..1.5
  kOverrun = 6,        // buf_overrun, smoothed log rate (congestion, not a failure sign)
  kRetransSlope = 7,   // retrans: the level's rise, per minute
  kErrUnknown = 8,     // 1: none of the error counters the rail has shown is readable now
  kWarm = 9,           // 0..1: how much of the first 5 minutes the floors have seen
  kRecentDowns = 10,   // log1p(the rail's link-downs, each decaying with kDownsTauS)
};

// Feature names, for reports: "err_excess", "err_slope", ...
const char* feature_name(int f);
// The canonical counters a feature is computed from, for "top contributing counters" lines:
// "phy errors (symbol_err, rcv_err, crc_err, fec_*)", ...; "-" for kWarm (not a counter).
const char* feature_counters(int f);

// Per error counter (and retrans): the log rate x = log1p(count / dt), the median of it and
// the two before it (an isolated one-sample burst, or the one step a counter reset reads as a
// wrap, does not pass; two in a row do), smoothed twice
// (kFastTauS, kSlowTauS); the floor follows the fast level up slowly (kFloorUpTauS) and down
// quickly (kFloorDownTauS), so a burst barely moves it and a lower floor (after a reset, a
// quieter phase) is taken within minutes. excess = fast - floor; slope = (fast - slow) /
// (kSlowTauS - kFastTauS), per minute (for a steady rise of k per second, k x 60); accel =
// slope - its own smoothed value (kSlowTauS), per minute. A counter with no usable delta this
// step (missing, saturated) keeps its state and is left out of this row's max. A counter reset
// this step (Step::reset: its delta is the count since the reset, over an unknown part of the
// step, not a rate) keeps its state too and counts in the max where it stands (its excess,
// slope and accel from that state); one not seen before starts at its next step, so a floor
// never starts from such a partial count; feature
// kErrUnknown is 1 while every error counter the rail has shown is unreadable (0 while any
// is readable, or before any has been).
// The times are those of the trained sampling interval (kTrainedIntervalS); a sampler that
// runs at another interval scales them by interval / kTrainedIntervalS, so a window of rows
// means the same number of samples (the lab tests sample every 100 ms to fit a failure into
// seconds).
// Link-downs (kRecentDowns): a link that has gone down and come back is likely to go down
// again (a flapping link), so each down the rail has had counts 1, decaying by e every
// kDownsTauS, down steps included. A down is the link state going from up to down between
// two steps, or a link_downed increment beyond the one that down explains (a link that went
// down and up between two samples, which the state never shows).
constexpr double kFastTauS = 30, kSlowTauS = 120, kFloorUpTauS = 1800, kFloorDownTauS = 120,
                 kWarmS = 300, kDownsTauS = 600, kTrainedIntervalS = 5;

// Step deltas -> feature rows, for one rail.
class FeatureExtractor {
 public:
  // `interval_s`: the sampling interval rows come at (the times above scale with it).
  explicit FeatureExtractor(double interval_s = kTrainedIntervalS)
      : scale_(interval_s > 0 ? interval_s / kTrainedIntervalS : 1.0) {}
  // Returns false (no row) when the link is down or the step is unusable (dt <= 0 or not
  // finite). A down step counts the down (kRecentDowns) and otherwise keeps the state for
  // the next row; an unusable step changes nothing.
  bool push(const Step& s, FeatureRow* out);
  void reset() { *this = FeatureExtractor(scale_ * kTrainedIntervalS); }

  struct Track {  // one counter's history (public for tests)
    bool seen = false;
    double fast = 0, slow = 0, floor = 0, slope_avg = 0;
    double last[2] = {};  // the two log rates before this one (the median of 3)
    int n = 0;            // usable steps so far
  };

 private:
  static constexpr int kErrCounters = 6;  // symbol_err, rcv_err, crc_err, fec_*
  double scale_ = 1;
  Track err_[kErrCounters], retrans_;
  double link_ = 0, overrun_ = 0, seen_s_ = 0;
  double downs_ = 0;       // decayed count of link-downs
  int up_ = -1;            // link state at the last usable step: 1 up, 0 down, -1 none yet
  double down_ticks_ = 0;  // link_downed increments seen while the link is down
};

// The last `capacity` raw rows, oldest first, plus the window's retransmit totals.
class FeatureWindow {
 public:
  explicit FeatureWindow(int capacity);
  void push(const FeatureRow& row, double retrans, double tx_packets);
  int size() const { return static_cast<int>(n_); }
  int capacity() const { return static_cast<int>(rows_.size()); }
  // Row i, 0 = oldest kept.
  const FeatureRow& row(int i) const;
  // Total retrans / total tx packets over the window (ccl_retransmit_ratio, 0..1); -1 when
  // the window has no packets.
  double retransmit_ratio() const;

 private:
  std::vector<FeatureRow> rows_;
  std::vector<double> retrans_, packets_;
  size_t head_ = 0;  // next write position
  size_t n_ = 0;
};

}  // namespace r2ccl::predict
