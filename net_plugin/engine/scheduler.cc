#include "scheduler.h"

namespace r2ccl::net {

static bool has_room(const PathLoad& p, uint32_t len) {
  // An empty path always takes one chunk, so a chunk larger than the window still moves.
  if (!p.room) return false;
  return p.inflight_bytes == 0 || p.inflight_bytes + len <= p.window_bytes;
}

int pick_path(const std::vector<PathLoad>& paths, bool stripe, uint32_t next_len,
              uint32_t allowed) {
  auto in_mask = [allowed](size_t i) { return i < 32 && ((allowed >> i) & 1u) != 0; };
  bool any = false;
  for (size_t i = 0; i < paths.size(); ++i) any |= in_mask(i) && paths[i].carries_data;
  auto eligible = [any, &paths, &in_mask](size_t i) {
    return in_mask(i) && (any ? paths[i].carries_data : paths[i].draining);
  };
  if (!stripe) {
    for (size_t i = 0; i < paths.size(); ++i) {
      if (!eligible(i)) continue;
      return has_room(paths[i], next_len) ? static_cast<int>(i) : -1;
    }
    return -1;
  }
  int best = -1;
  double best_load = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    const PathLoad& p = paths[i];
    if (!eligible(i) || !has_room(p, next_len)) continue;
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
