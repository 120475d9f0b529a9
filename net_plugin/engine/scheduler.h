// Chunk scheduler: which path carries the next chunk. Pure logic.
//  - stripe off: the first path that carries data, in path order (primary, then backups in
//    preference order). Backups stay idle and probed until the primary fails.
//  - stripe on: among every path that carries data and has window room, the one with the
//    least in-flight bytes per unit of bandwidth (bandwidth-weighted least-loaded).
// When no path carries data but some are draining (every path's RTT is an outlier), the
// draining ones are picked by the same rules: the least bad still moves data.
// A path with a full window, or whose transport has no room, gets nothing; the chunk waits
// (returns -1). Only paths in `allowed` (bit i = paths[i]) are considered at all: a message
// whose buffer some paths may not carry (verbs: a GPU buffer and a backup HCA beyond
// NCCL_NET_GDR_LEVEL) waits rather than spill onto them.
// Thread-safety: stateless.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace r2ccl::net {

struct PathLoad {
  bool carries_data;        // HEALTHY
  uint64_t inflight_bytes;  // sent or queued, not yet acknowledged
  uint64_t window_bytes;    // R2CCL_PATH_WINDOW
  double weight;            // relative bandwidth (rail speed), > 0
  bool draining = false;    // connected but DRAINING: used only when no path carries data
  bool room = true;         // the transport can take another chunk now (send queue slots)
};

int pick_path(const std::vector<PathLoad>& paths, bool stripe, uint32_t next_len,
              uint32_t allowed = ~0u);

}  // namespace r2ccl::net
