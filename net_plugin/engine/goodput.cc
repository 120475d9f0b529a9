#include "engine/goodput.h"

#include <algorithm>
#include <cmath>

namespace r2ccl::net {

void PathGoodput::on_send(uint64_t inflight_before, TimeUs now) {
  if (busy_ && inflight_before > 0) return;
  busy_ = true;
  busy_since_ = now;
}

bool PathGoodput::on_ack(uint64_t len, uint64_t inflight_after, uint64_t min_bytes, TimeUs now) {
  if (!busy_) return false;  // an acknowledgement of bytes dropped by on_stop
  bytes_ += len;
  const TimeUs busy = busy_acc_ + std::max<TimeUs>(0, now - busy_since_);
  if (inflight_after == 0) {  // the path goes idle: its clock stops here
    busy_ = false;
    busy_acc_ = busy;
  }
  if (busy <= 0 || !((busy >= kMinSampleUs && bytes_ >= min_bytes) || busy >= kMaxSampleUs))
    return false;
  const double sample = static_cast<double>(bytes_) * 8.0 / static_cast<double>(busy);  // Mbps
  if (!measured_) {
    mbps_ = sample;
    measured_ = true;
  } else {
    const double a = 1.0 - std::exp(-static_cast<double>(busy) / static_cast<double>(kTauUs));
    mbps_ += a * (sample - mbps_);
  }
  bytes_ = 0;
  busy_acc_ = 0;
  busy_since_ = now;
  return true;
}

void PathGoodput::on_stop() {
  busy_ = false;
  busy_acc_ = 0;
  bytes_ = 0;
}

void rail_publish(RailLive& rail, int64_t delta_kbps, bool sample, TimeUs now) {
  const uint64_t load = rail.goodput_load_kbps.fetch_add(static_cast<uint64_t>(delta_kbps),
                                                         std::memory_order_relaxed) +
                        static_cast<uint64_t>(delta_kbps);
  if (!sample) return;
  const TimeUs at = rail.goodput_cap_at.exchange(now, std::memory_order_relaxed);
  uint64_t cap = rail.goodput_cap_kbps.load(std::memory_order_relaxed);
  for (;;) {
    uint64_t next = load;
    if (load < cap) {
      const double dt = static_cast<double>(std::max<TimeUs>(0, now - at));
      const double a = 1.0 - std::exp(-dt / static_cast<double>(kCapTauUs));
      next = cap - static_cast<uint64_t>(static_cast<double>(cap - load) * a);
    }
    if (rail.goodput_cap_kbps.compare_exchange_weak(cap, next, std::memory_order_relaxed)) return;
  }
}

double rail_spare_mbps(const RailLive& rail, uint64_t mine_kbps) {
  const uint64_t cap = rail.goodput_cap_kbps.load(std::memory_order_relaxed);
  if (cap == 0) return 0;
  const uint64_t load = rail.goodput_load_kbps.load(std::memory_order_relaxed);
  const uint64_t others = load > mine_kbps ? load - mine_kbps : 0;
  const uint64_t spare = cap > others ? cap - others : 0;
  return static_cast<double>(std::max(spare, cap / 16)) / 1000.0;
}

double path_weight(bool measured, double own_mbps, double spare_mbps, int speed_mbps) {
  double w;
  if (measured && own_mbps > 0)
    w = spare_mbps > 0 ? std::min(own_mbps, spare_mbps) : own_mbps;
  else if (spare_mbps > 0)
    w = spare_mbps;
  else
    w = static_cast<double>(std::max(1, speed_mbps));
  return std::max(w, 1e-3);
}

}  // namespace r2ccl::net
