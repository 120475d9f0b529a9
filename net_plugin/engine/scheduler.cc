#include "scheduler.h"

namespace r2ccl::net {

static bool has_room(const PathLoad& p, uint32_t len) {
  // An empty path always takes one chunk, so a chunk larger than the window still moves.
  if (!p.room) return false;
  return p.inflight_bytes == 0 || p.inflight_bytes + len <= p.window_bytes;
}

int pick_path(const std::vector<PathLoad>& paths, bool stripe, uint32_t next_len, uint32_t allowed,
              bool earliest_finish) {
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
  if (!earliest_finish) {
    int best = -1;
    double best_load = 0;
    for (size_t i = 0; i < paths.size(); ++i) {
      const PathLoad& p = paths[i];
      if (!eligible(i) || !has_room(p, next_len)) continue;
      const double load = static_cast<double>(p.inflight_bytes) / (p.weight > 0 ? p.weight : 1.0);
      if (best < 0 || load < best_load) {
        best = static_cast<int>(i);
        best_load = load;
      }
    }
    return best;
  }
  // Earliest finish among every eligible path, full or not; and among those with room.
  int best = -1;
  double best_t = 0;
  int best_room = -1;
  double best_room_t = 0;
  int starving = -1;
  double starving_t = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    const PathLoad& p = paths[i];
    if (!eligible(i)) continue;
    const double w = p.weight > 0 ? p.weight : 1.0;
    const double t = static_cast<double>(p.inflight_bytes + next_len) / w;
    if (best < 0 || t < best_t) {
      best = static_cast<int>(i);
      best_t = t;
    }
    if (!has_room(p, next_len)) continue;
    if (best_room < 0 || t < best_room_t) {
      best_room = static_cast<int>(i);
      best_room_t = t;
    }
    if (p.starving && (starving < 0 || t < starving_t)) {
      starving = static_cast<int>(i);
      starving_t = t;
    }
  }
  if (best_room >= 0 && best_room_t <= best_t) return best_room;  // the earliest has room
  return starving;  // the earliest is full: wait for it, unless a path starves
}

}  // namespace r2ccl::net
