#include "r2ccl/predict/features.h"

#include <algorithm>
#include <cmath>

namespace r2ccl::predict {

namespace {
const char* const kFeatureNames[kNumFeatures] = {
    "err_excess",  "err_slope",     "link_events", "retrans_excess", "err_accel",   "utilisation",
    "buf_overrun", "retrans_slope", "err_unknown", "warm",           "recent_downs"};
constexpr const char* kPhy = "phy errors (symbol_err, rcv_err, crc_err, fec_*)";
const char* const kFeatureCounters[kNumFeatures] = {kPhy,
                                                    kPhy,
                                                    "link_recovery+link_downed+integrity",
                                                    "retrans",
                                                    kPhy,
                                                    "tx_bytes/rx_bytes",
                                                    "buf_overrun",
                                                    "retrans",
                                                    kPhy,
                                                    "-",
                                                    "link state+link_downed"};
constexpr int kErrCounterIds[] = {kSymbolErr,     kRcvErr,          kCrcErr,
                                  kFecCorrBlocks, kFecUncorrBlocks, kFecCorrBits};

double log_rate(double count, double dt) { return std::log1p(std::max(0.0, count) / dt); }
double gain(double dt, double tau) { return 1.0 - std::exp(-dt / tau); }

// Where a counter's history stands: {excess, slope, accel}.
struct Trend {
  double excess, slope, accel;
};
// From the history's state, nothing updated; also what a step whose delta is the count since
// a reset reads (that count is not a rate, so it does not step the history).
Trend hold_track(const FeatureExtractor::Track& t) {
  Trend r;
  r.excess = t.fast - t.floor;
  r.slope = (t.fast - t.slow) / (kSlowTauS - kFastTauS) * 60.0;
  r.accel = r.slope - t.slope_avg;
  return r;
}
// One step of a counter's history, then where it stands.
// `dt` is already divided by the interval scale (seconds at the trained interval).
Trend step_track(FeatureExtractor::Track& t, double raw, double dt) {
  // The median of this log rate and the two before it (fewer at the start: what there is).
  double x = raw;
  if (t.n == 1) {
    x = std::min(raw, t.last[0]);  // of two, the lower: a first burst does not pass either
  } else if (t.n >= 2) {
    const double a = t.last[0], b = t.last[1];
    x = std::max(std::min(a, b), std::min(std::max(a, b), raw));
  }
  t.last[1] = t.last[0];
  t.last[0] = raw;
  ++t.n;
  if (!t.seen) {
    t.seen = true;
    t.fast = t.slow = t.floor = x;
    t.slope_avg = 0;
  } else {
    t.fast += gain(dt, kFastTauS) * (x - t.fast);
    t.slow += gain(dt, kSlowTauS) * (x - t.slow);
    t.floor += gain(dt, t.fast > t.floor ? kFloorUpTauS : kFloorDownTauS) * (t.fast - t.floor);
  }
  const Trend r = hold_track(t);
  t.slope_avg += gain(dt, kSlowTauS) * (r.slope - t.slope_avg);
  return r;
}
}  // namespace

const char* feature_name(int f) { return f >= 0 && f < kNumFeatures ? kFeatureNames[f] : "?"; }
const char* feature_counters(int f) {
  return f >= 0 && f < kNumFeatures ? kFeatureCounters[f] : "?";
}

bool FeatureExtractor::push(const Step& s, FeatureRow* out) {
  if (!(s.dt_s > 0) || !std::isfinite(s.dt_s)) return false;
  const double dt = s.dt_s;        // for rates: per second
  const double dts = dt / scale_;  // for the smoothing times: seconds at the trained interval
  downs_ *= std::exp(-dts / kDownsTauS);
  const double ticks = (s.missing & (1u << kLinkDowned)) ? 0.0 : std::max(0.0, s.d[kLinkDowned]);
  if (!s.link_up) {
    if (up_ == 1) downs_ += 1;  // the down the state shows (a first step down shows none)
    up_ = 0;
    down_ticks_ += ticks;
    return false;
  }
  if (up_ == 0) {
    // Back up: the first link_downed increment is the down already counted.
    downs_ += std::max(0.0, down_ticks_ + ticks - 1);
    down_ticks_ = 0;
  } else {
    downs_ += ticks;
  }
  up_ = 1;
  FeatureRow r{};
  double excess = 0, slope = 0, accel = 0;
  int known = 0, unknown = 0;
  for (int k = 0; k < kErrCounters; ++k) {
    const int c = kErrCounterIds[k];
    if (s.missing & (1u << c)) {
      unknown += err_[k].seen;  // a counter the rail had, unreadable now
      continue;
    }
    // A count since a reset covers an unknown part of the step: not a rate. The counter
    // stands where it stood (and a counter not yet seen starts at its next step).
    const bool was_reset = (s.reset & (1u << c)) != 0;
    if (was_reset && !err_[k].seen) continue;
    const Trend t =
        was_reset ? hold_track(err_[k]) : step_track(err_[k], log_rate(s.d[c], dt), dts);
    excess = known ? std::max(excess, t.excess) : t.excess;
    slope = known ? std::max(slope, t.slope) : t.slope;
    accel = known ? std::max(accel, t.accel) : t.accel;
    ++known;
  }
  r[kErrExcess] = static_cast<float>(excess);
  r[kErrSlope] = static_cast<float>(slope);
  r[kErrAccel] = static_cast<float>(accel);
  r[kErrUnknown] = known == 0 && unknown > 0 ? 1.0f : 0.0f;
  const bool retrans_reset = (s.reset & (1u << kRetrans)) != 0;
  if (!(s.missing & (1u << kRetrans)) && (!retrans_reset || retrans_.seen)) {
    const Trend t = retrans_reset ? hold_track(retrans_)
                                  : step_track(retrans_, log_rate(s.d[kRetrans], dt), dts);
    r[kRetransExcess] = static_cast<float>(t.excess);
    r[kRetransSlope] = static_cast<float>(t.slope);
  }
  link_ += gain(dts, kFastTauS) *
           (log_rate(s.d[kLinkRecovery] + s.d[kLinkDowned] + s.d[kIntegrity], dt) - link_);
  overrun_ += gain(dts, kFastTauS) * (log_rate(s.d[kBufOverrun], dt) - overrun_);
  r[kLinkEvents] = static_cast<float>(link_);
  r[kOverrun] = static_cast<float>(overrun_);
  double util = 0;
  if (s.speed_mbps > 0) {
    const double bytes = std::max(s.d[kTxBytes], s.d[kRxBytes]);
    util = std::clamp(bytes * 8.0 / dt / (s.speed_mbps * 1e6), 0.0, 1.5);
  }
  r[kUtil] = static_cast<float>(util);
  seen_s_ += dts;
  r[kWarm] = static_cast<float>(std::min(1.0, seen_s_ / kWarmS));
  r[kRecentDowns] = static_cast<float>(std::log1p(downs_));
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
