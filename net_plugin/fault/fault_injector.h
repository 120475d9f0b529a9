// In-process fault injector (R2CCL_FAULT_INJECT), for machines without network namespaces.
// It acts at the socket layer only (shutdown of the rail's sockets, silent discard, added
// send delay), never by calling the engine, so the log names the detector that really fired.
//
// Syntax: entries separated by ';', each "rank=R,rail=N,at=MS,kind=K[,for=MS]" with
//   K = reset | blackhole | delay:MS.  `at` counts from the first chunk, CTS or
//   acknowledgement this process sends (a receiver's CTS comes before its sender's first chunk;
//   a receiver of eager messages only, which sends no CTS, starts at its first acknowledgement);
//   `for` (default: forever) ends the fault. rank=-1 or a missing rank matches every process.
//   Ranges (anything else, or a key given twice, is an error naming the accepted form): rank
//   [-1, 2^31-1], rail [0, 15], at [0, 86400000] ms, for [1, 86400000] ms, delay [1, 60000] ms.
//   reset: each connection shuts its sockets on the rail down at the first moment at or after
//   `at` when it has a message in flight (so the fault always hits traffic), and no new
//   connection on the rail succeeds until `for` has passed. blackhole: nothing is written
//   or read, the frames queued meanwhile wait, and the kernel's TCP connection stays up: a
//   real black hole delays a live connection's bytes, never loses them (the kernel resends
//   them once it closes, RAIL-LAB.md). Detection takes the heartbeat/watchdog's slow path
//   (0.1-0.5 s); a path that fails meanwhile drops its queued frames with its sockets.
//   delay: every frame is held MS before it is written.
// Thread-safety: configure() once at init; the queries are lock-free (atomics) from any thread.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "r2ccl/clock.h"

namespace r2ccl::net {

struct FaultSpec {
  enum class Kind { kReset, kBlackhole, kDelay };
  int rank = -1;
  int rail = 0;
  TimeUs at = 0;
  Kind kind = Kind::kReset;
  TimeUs delay = 0;     // kDelay: added to every send on the rail
  TimeUs duration = 0;  // 0: until the process ends
};

bool parse_fault_specs(const std::string& s, std::vector<FaultSpec>* out, std::string* err);

class FaultInjector {
 public:
  static FaultInjector& instance();

  void configure(const std::vector<FaultSpec>& specs, int my_rank);
  bool enabled() const { return !specs_.empty(); }
  // Starts the schedule at the first call (the process's first chunk, CTS or acknowledgement).
  void arm();
  // Replaces the schedule with `specs` (filtered by rank) and starts it now.
  void arm_now(const std::vector<FaultSpec>& specs, int my_rank);

  struct RailFault {
    bool blackhole = false;
    bool down = false;  // reset in effect: connects on the rail fail
    TimeUs delay = 0;
    uint32_t reset_epoch = 0;  // number of reset faults started so far on the rail
  };
  RailFault query(int rail, TimeUs now) const;
  // Time the most recent fault on the rail started (0 if none), for "detected after" logs.
  TimeUs last_start(int rail, TimeUs now) const;

 private:
  // Written only by configure/arm_now; arm_now publishes through t0_ (release), and readers
  // load t0_ (acquire) before reading specs_. A schedule is armed once per process.
  std::vector<FaultSpec> specs_;
  std::atomic<TimeUs> t0_{0};
};

}  // namespace r2ccl::net
