#include "r2ccl/predict/features.h"

#include <algorithm>
#include <cmath>

namespace r2ccl::predict {

namespace {
const char* const kFeatureNames[kNumFeatures] = {
    "retrans_rate",     "retrans_pct", "phy_err_rate",  "link_instability",
    "buf_overrun_rate", "utilisation", "phy_err_delta", "retrans_delta"};
const char* const kFeatureCounters[kNumFeatures] = {"retrans",
                                                    "retrans/tx_packets",
                                                    "symbol_err+rcv_err+crc_err",
                                                    "link_recovery+link_downed+integrity",
                                                    "buf_overrun",
                                                    "tx_bytes/rx_bytes",
                                                    "symbol_err+rcv_err+crc_err",
                                                    "retrans"};

float log_rate(double count, double dt) {
  return static_cast<float>(std::log1p(std::max(0.0, count) / dt));
}
}  // namespace

const char* feature_name(int f) { return f >= 0 && f < kNumFeatures ? kFeatureNames[f] : "?"; }
const char* feature_counters(int f) {
  return f >= 0 && f < kNumFeatures ? kFeatureCounters[f] : "?";
}

bool FeatureExtractor::push(const Step& s, FeatureRow* out) {
  if (!s.link_up || !(s.dt_s > 0) || !std::isfinite(s.dt_s)) return false;
  const double dt = s.dt_s;
  FeatureRow r;
  r[0] = log_rate(s.d[kRetrans], dt);
  r[1] = static_cast<float>(
      std::min(100.0, 100.0 * std::max(0.0, s.d[kRetrans]) / std::max(1.0, s.d[kTxPackets])));
  r[2] = log_rate(s.d[kSymbolErr] + s.d[kRcvErr] + s.d[kCrcErr], dt);
  r[3] = log_rate(s.d[kLinkRecovery] + s.d[kLinkDowned] + s.d[kIntegrity], dt);
  r[4] = log_rate(s.d[kBufOverrun], dt);
  double util = 0;
  if (s.speed_mbps > 0) {
    const double bytes = std::max(s.d[kTxBytes], s.d[kRxBytes]);
    util = std::clamp(bytes * 8.0 / dt / (s.speed_mbps * 1e6), 0.0, 1.5);
  }
  r[5] = static_cast<float>(util);
  r[6] = have_prev_ ? r[2] - prev_f2_ : 0.0f;
  r[7] = have_prev_ ? r[0] - prev_f0_ : 0.0f;
  prev_f0_ = r[0];
  prev_f2_ = r[2];
  have_prev_ = true;
  *out = r;
  return true;
}

FeatureWindow::FeatureWindow(int capacity)
    : rows_(static_cast<size_t>(std::max(1, capacity))),
      retrans_(rows_.size()),
      packets_(rows_.size()) {}

void FeatureWindow::push(const FeatureRow& row, double retrans, double tx_packets) {
  rows_[head_] = row;
  retrans_[head_] = std::max(0.0, retrans);
  packets_[head_] = std::max(0.0, tx_packets);
  head_ = (head_ + 1) % rows_.size();
  n_ = std::min(n_ + 1, rows_.size());
}

const FeatureRow& FeatureWindow::row(int i) const {
  const size_t cap = rows_.size();
  return rows_[(head_ + cap - n_ + static_cast<size_t>(i)) % cap];
}

double FeatureWindow::retransmit_ratio() const {
  double r = 0, p = 0;
  for (size_t i = 0; i < rows_.size() && i < n_; ++i) {
    const size_t k = (head_ + rows_.size() - n_ + i) % rows_.size();
    r += retrans_[k];
    p += packets_[k];
  }
  if (p <= 0) return -1;
  return std::min(1.0, r / p);
}

}  // namespace r2ccl::predict
