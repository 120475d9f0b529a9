// Per-rail counters every transport keeps (a TCP rail, an HCA port) and their JSON form in
// r2cclExt_v1.getStats (common/include/r2ccl/ext.h). Written by any thread (atomics), read
// by getStats.
#pragma once

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string>

namespace r2ccl {

struct RailCounters {
  std::atomic<int> failed_paths{0};          // paths on this rail currently failed
  std::atomic<uint64_t> chunks_sent{0};      // chunks first sent on this rail
  std::atomic<uint64_t> chunks_replayed{0};  // chunks replayed on this rail after a failure
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> switchovers{0};  // times traffic left this rail
  std::atomic<uint64_t> failbacks{0};
  std::atomic<uint64_t> paths_failed{0};      // path failures, all time
  std::atomic<uint64_t> discarded_chunks{0};  // stale or duplicate chunks dropped
  // The failure predictor (net_plugin/predict): set by the background thread when the node's
  // predictor drains this rail; the schedulers send no new chunks on it while set.
  std::atomic<bool> predict_drain{false};
  std::atomic<uint64_t> predict_drains{0};  // times the predictor drained this rail
  // TCP rails: TCP_INFO total_retrans and segs_out summed over this process's sockets on the
  // rail (cumulative), the predictor's retransmit counters. 0 on verbs rails.
  std::atomic<uint64_t> tcp_retrans{0};
  std::atomic<uint64_t> tcp_segs_out{0};
};

// Appends one rail object: {"name":...,"state":...,"chunks_sent":...,...}.
void append_rail_json(std::ostringstream& o, const std::string& name, const char* state,
                      const RailCounters& c);

}  // namespace r2ccl
