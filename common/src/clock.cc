#include "r2ccl/clock.h"

#include <time.h>

namespace r2ccl {

TimeUs now_us() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<TimeUs>(ts.tv_sec) * kUsPerSec + ts.tv_nsec / 1000;
}

const SystemClock& SystemClock::instance() {
  static const SystemClock c;
  return c;
}

}  // namespace r2ccl
