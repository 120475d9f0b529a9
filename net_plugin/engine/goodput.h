// Goodput estimates for the chunk scheduler (docs/ARCHITECTURE.md, "Scheduling"). Pure logic
// over the caller's clock (microseconds); no sockets, threads or clocks of its own.
//
//  - PathGoodput: one path of one connection. Bytes acknowledged per microsecond of busy time
//    (time with data in flight), smoothed by an EWMA with a time constant of kTauUs, so a
//    live rate change is followed within a few hundred milliseconds. Idle time never counts
//    as slowness: the clock runs only while bytes are in flight. A sample closes after
//    kMinSampleUs of busy time and at least `min_bytes` acknowledged (the connection passes
//    a few chunks, so one acknowledgement more or less does not swing the estimate), or after
//    kMaxSampleUs of busy time whatever was acknowledged. Thread-safety: none; the owning
//    connection serialises calls.
//  - The rail's process-wide view (RailLive::goodput_load_kbps / goodput_cap_kbps, shared by
//    every connection of the process, atomics, any thread, lock-free): each busy path
//    publishes its own estimate into the rail's load (rail_publish); the rail's capacity
//    estimate is the highest load seen, decaying towards the current load with a time
//    constant of kCapTauUs when the load is lower (a rail that got slower). Spare capacity
//    for one path = capacity - the load of every other path of the process on the rail.
//  - path_weight: what pick_path gets as a path's weight (Mbps).
#pragma once

#include <cstdint>

#include "engine/rail_env.h"
#include "r2ccl/clock.h"

namespace r2ccl::net {

class PathGoodput {
 public:
  static constexpr TimeUs kTauUs = 100 * kUsPerMs;
  static constexpr TimeUs kMinSampleUs = 25 * kUsPerMs;
  static constexpr TimeUs kMaxSampleUs = 200 * kUsPerMs;

  // A chunk was posted on the path; `inflight_before` bytes were in flight before it (0:
  // the path turns busy now and its busy clock starts).
  void on_send(uint64_t inflight_before, TimeUs now);
  // `len` bytes were acknowledged; `inflight_after` bytes remain in flight (0: the busy clock
  // stops). Returns true when a sample closed and the estimate changed.
  bool on_ack(uint64_t len, uint64_t inflight_after, uint64_t min_bytes, TimeUs now);
  // The path's in-flight bytes were dropped (failure, reconnect): the busy clock stops and
  // the open sample is discarded; the estimate is kept (the rail's speed did not change).
  void on_stop();
  bool measured() const { return measured_; }
  // The smoothed goodput, Mbps (0 until measured()).
  double mbps() const { return mbps_; }

 private:
  double mbps_ = 0;
  bool measured_ = false;
  bool busy_ = false;
  TimeUs busy_since_ = 0;  // start of the current busy period
  TimeUs busy_acc_ = 0;    // busy microseconds of the open sample before busy_since_
  uint64_t bytes_ = 0;     // bytes acknowledged in the open sample
};

constexpr TimeUs kCapTauUs = 1000 * kUsPerMs;

// Adds `delta_kbps` (the change of one path's published goodput, kbit/s, negative when it
// drops or withdraws) to the rail's load. With `sample` (a new measurement, not a
// withdrawal) the rail's capacity estimate is updated too: raised to the load at once, or
// decayed towards it (kCapTauUs) when the load is lower. Any thread; lock-free.
void rail_publish(RailLive& rail, int64_t delta_kbps, bool sample, TimeUs now);

// Spare capacity of the rail for a path that itself publishes `mine_kbps` there, Mbps:
// capacity - (load - mine), at least 1/16 of the capacity (no path starves on a busy rail).
// 0 when the rail has not been measured yet. Any thread.
double rail_spare_mbps(const RailLive& rail, uint64_t mine_kbps);

// A path's scheduling weight, Mbps: its own measured goodput, capped by the rail's spare
// capacity when both are known; the spare capacity while the path itself is unmeasured
// (a backup that starts carrying after a failure); the configured rail speed while neither
// is known. Always > 0.
double path_weight(bool measured, double own_mbps, double spare_mbps, int speed_mbps);

}  // namespace r2ccl::net
