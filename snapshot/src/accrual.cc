#include "r2ccl/snapshot/accrual.h"

#include <algorithm>
#include <cmath>

namespace r2ccl::snap {

AccrualDetector::AccrualDetector(Config c) : c_(c) {
  if (c_.min_stddev <= 0) c_.min_stddev = std::max<TimeUs>(1, c_.period / 4);
  if (c_.min_silence <= 0) c_.min_silence = 3 * c_.period;
  if (c_.window == 0) c_.window = 1;
}

void AccrualDetector::heard(TimeUs now) {
  if (last_ >= 0 && now > last_) {
    const double d = double(now - last_);
    intervals_.push_back(d);
    sum_ += d;
    sum_sq_ += d * d;
    if (intervals_.size() > c_.window) {
      const double o = intervals_.front();
      intervals_.pop_front();
      sum_ -= o;
      sum_sq_ -= o * o;
    }
  }
  last_ = std::max(last_, now);
}

double AccrualDetector::phi(TimeUs now) const {
  if (last_ < 0) return 0;
  const double n = double(intervals_.size());
  double mean = double(c_.period), var = 0;
  if (n > 0) {
    mean = std::max(mean, sum_ / n);
    var = std::max(0.0, sum_sq_ / n - (sum_ / n) * (sum_ / n));
  }
  const double sd = std::max(std::sqrt(var), double(c_.min_stddev));
  const double t = double(now - last_);
  // P(an interval longer than t) under N(mean, sd): 0.5 * erfc((t - mean) / (sd * sqrt 2)).
  const double p = 0.5 * std::erfc((t - mean) / (sd * std::sqrt(2.0)));
  if (p <= 1e-300) return 300;
  return -std::log10(p);
}

bool AccrualDetector::suspected(TimeUs now) const {
  return last_ >= 0 && now - last_ > c_.min_silence && phi(now) >= c_.threshold;
}

}  // namespace r2ccl::snap
