// r2ccl_perf --stats: reads the optional r2cclExt_v1 statistics of a plugin (r2ccl/ext.h) and
// prints them per rank and rail.
// Thread-safety: call from one thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "perf_net.h"

namespace r2perf {

// This rank's statistics as a rendezvous blob: "0" when the plugin has no r2cclExt_v1,
// "1<json>" otherwise, "E<message>" when calling it failed.
std::string read_plugin_stats(const Net& net);

struct StatsSummary {
  uint64_t replays = 0;      // over all ranks
  uint64_t switchovers = 0;  // over all ranks
  bool bad = false;          // a rank's JSON did not parse or getStats misbehaved
};

// Prints the blobs of every rank (indexed by rank) to `out` (nullptr: print nothing) and sums
// them.
StatsSummary summarize_stats(const std::vector<std::string>& blobs, FILE* out);

}  // namespace r2perf
