// Chunk scheduler: which path carries the next chunk. Pure logic.
//  - stripe off: the first path that carries data, in path order (primary, then backups in
//    preference order). Backups stay idle and probed until the primary fails.
//  - stripe on: earliest finish. Each path that carries data would finish the chunk after
//    (in-flight bytes + chunk) / weight, where the weight is the path's goodput (the
//    connection's estimate, engine/goodput.h, Mbps; any consistent unit works). The path
//    with the earliest finish gets the chunk; when that path's window is full the chunk
//    waits for it rather than go to a slower path that would deliver it later (the tail of a
//    message on a slow rail). Exception, so no path starves and a path that got faster is
//    noticed: a path marked `starving` (empty, unused for a while) with room takes it.
//    Ties go to the lower index (the primary first).
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
  bool starving = false;    // stripe on: empty and given nothing for a while (see above)
};

// `earliest_finish` false: the rule before goodput weights (test hook no_goodput): among the
// paths with room, the least in-flight bytes per unit of weight; never waits for a full one.
int pick_path(const std::vector<PathLoad>& paths, bool stripe, uint32_t next_len,
              uint32_t allowed = ~0u, bool earliest_finish = true);

}  // namespace r2ccl::net
