// Monotonic time in microseconds, and an injectable clock for the pure engine classes.
// Thread-safety: now_us() is safe from any thread. ManualClock is for single-threaded tests.
#pragma once

#include <cstdint>

namespace r2ccl {

using TimeUs = int64_t;  // microseconds on CLOCK_MONOTONIC
constexpr TimeUs kUsPerMs = 1000;
constexpr TimeUs kUsPerSec = 1000000;

// CLOCK_MONOTONIC in microseconds.
TimeUs now_us();

class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimeUs now() const = 0;
};

class SystemClock final : public Clock {
 public:
  TimeUs now() const override { return now_us(); }
  static const SystemClock& instance();
};

class ManualClock final : public Clock {
 public:
  explicit ManualClock(TimeUs start = 1000 * kUsPerSec) : t_(start) {}
  TimeUs now() const override { return t_; }
  void advance(TimeUs d) { t_ += d; }
  void set(TimeUs t) { t_ = t; }

 private:
  TimeUs t_;
};

}  // namespace r2ccl
