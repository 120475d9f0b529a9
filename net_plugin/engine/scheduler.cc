#include "scheduler.h"

namespace r2ccl::net {

static bool has_room(const PathLoad& p, uint32_t len) {
  // An empty path always takes one chunk, so a chunk larger than the window still moves.
  if (!p.room) return false;
  return p.inflight_bytes == 0 || p.inflight_bytes + len <= p.window_bytes;
}

int pick_path(const std::vector<PathLoad>& paths, bool stripe, uint32_t next_len) {
  bool any = false;
  for (const auto& p : paths) any |= p.carries_data;
  auto eligible = [any](const PathLoad& p) { return any ? p.carries_data : p.draining; };
  if (!stripe) {
    for (size_t i = 0; i < paths.size(); ++i) {
      if (!eligible(paths[i])) continue;
      return has_room(paths[i], next_len) ? static_cast<int>(i) : -1;
    }
    return -1;
  }
  int best = -1;
  double best_load = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    const PathLoad& p = paths[i];
    if (!eligible(p) || !has_room(p, next_len)) continue;
    double w = p.weight > 0 ? p.weight : 1.0;
    double load = static_cast<double>(p.inflight_bytes) / w;
    if (best < 0 || load < best_load) {
      best = static_cast<int>(i);
      best_load = load;
    }
  }
  return best;
}

}  // namespace r2ccl::net
