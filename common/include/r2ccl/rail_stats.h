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
  std::atomic<int> failed_paths{0};        // paths on this rail currently failed
  std::atomic<uint64_t> chunks_sent{0};    // chunks first sent on this rail
  std::atomic<uint64_t> chunks_replayed{0};  // chunks replayed on this rail after a failure
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> switchovers{0};    // times traffic left this rail
  std::atomic<uint64_t> failbacks{0};
  std::atomic<uint64_t> paths_failed{0};   // path failures, all time
  std::atomic<uint64_t> discarded_chunks{0};  // stale or duplicate chunks dropped
};

// Appends one rail object: {"name":...,"state":...,"chunks_sent":...,...}.
void append_rail_json(std::ostringstream& o, const std::string& name, const char* state,
                      const RailCounters& c);

}  // namespace r2ccl
