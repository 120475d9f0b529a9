// A phi accrual failure detector (Hayashibara et al., "The phi accrual failure detector", SRDS
// 2004) for the snapshot daemons' heartbeats (issue 15), as pure logic with an injected clock.
//
// phi = -log10(P(the next heartbeat arrives later than now)), with the heartbeat inter-arrival
// times modelled as a normal distribution of the mean and standard deviation of the last
// `window` intervals (the standard deviation floored at `min_stddev`, and the mean at the
// nominal period, so a quiet, regular stream does not make phi explode at the first late
// packet). Under load the intervals spread, the deviation grows, and the detector waits longer
// before suspecting: the load that delays heartbeats also widens the margin.
// A peer is suspected when phi >= `threshold` AND it has been silent for more than `min_silence`
// (3 periods by default: the floor the old fixed rule had); the suspicion clears at the next
// heartbeat. Suspicion is only a trigger (coordinator.h): nobody is evicted on one observer.
// Thread-safety: none; one thread (the heartbeat thread) owns a detector.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>

#include "r2ccl/clock.h"

namespace r2ccl::snap {

class AccrualDetector {
 public:
  struct Config {
    TimeUs period = 500 * kUsPerMs;  // nominal heartbeat period
    double threshold = 8.0;          // phi at which a silent peer is suspected
    TimeUs min_stddev = 0;           // 0: a quarter of the period
    TimeUs min_silence = 0;          // 0: 3 periods
    size_t window = 100;             // intervals kept
  };
  explicit AccrualDetector(Config c);

  void heard(TimeUs now);
  double phi(TimeUs now) const;  // 0 before the first heartbeat
  bool suspected(TimeUs now) const;
  bool ever_heard() const { return last_ >= 0; }
  TimeUs last_heard() const { return last_; }
  TimeUs silence(TimeUs now) const { return last_ < 0 ? 0 : now - last_; }

 private:
  Config c_;
  TimeUs last_ = -1;
  std::deque<double> intervals_;
  double sum_ = 0, sum_sq_ = 0;
};

}  // namespace r2ccl::snap
