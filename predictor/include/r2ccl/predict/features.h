// Features of the failure predictor (docs/PREDICTOR.md "Features"): one row of eight floats
// per sampling step with the link up, and the sliding window of rows the model looks at.
// Pure; thread-safety: none (one object per rail, owned by one thread).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "r2ccl/predict/counters.h"

namespace r2ccl::predict {

constexpr int kNumFeatures = 8;
using FeatureRow = std::array<float, kNumFeatures>;

// Feature names, for reports: "retrans_rate", "retrans_pct", "phy_err_rate",
// "link_instability", "buf_overrun_rate", "utilisation", "phy_err_delta", "retrans_delta".
const char* feature_name(int f);
// The canonical counters a feature is computed from, for "top contributing counters" lines:
// "symbol_err+rcv_err", ...
const char* feature_counters(int f);

// Step deltas -> feature rows, for one rail. Features 6 and 7 are differences against the
// rail's previous row.
class FeatureExtractor {
 public:
  // Returns false (no row) when the link is down or the step is unusable (dt <= 0 or not
  // finite); the previous row is then kept for the next difference.
  bool push(const Step& s, FeatureRow* out);
  void reset() { have_prev_ = false; }

 private:
  bool have_prev_ = false;
  float prev_f0_ = 0, prev_f2_ = 0;
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
