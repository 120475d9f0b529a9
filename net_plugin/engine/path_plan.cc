#include "path_plan.h"

#include <algorithm>
#include <tuple>

namespace r2ccl::net {

std::vector<int> order_rails(int primary, int n, int want,
                             const std::function<int(int)>& distance) {
  std::vector<int> out;
  if (n <= 0 || primary < 0 || primary >= n || want <= 0) return out;
  out.push_back(primary);
  std::vector<std::tuple<int, int, int>> keys;  // distance, offset from primary, rail
  for (int k = 1; k < n; ++k) {
    const int r = (primary + k) % n;
    const int d = distance(r);
    if (d >= 0) keys.emplace_back(d, k, r);
  }
  std::sort(keys.begin(), keys.end());
  for (const auto& k : keys) {
    if (static_cast<int>(out.size()) >= want) break;
    out.push_back(std::get<2>(k));
  }
  return out;
}

std::vector<RailPair> pair_rails(int n_local, int n_peer, bool allow_reuse,
                                 const std::function<int(int, int)>& score) {
  std::vector<RailPair> out;
  std::vector<int> used(static_cast<size_t>(n_peer > 0 ? n_peer : 0), 0);
  for (int i = 0; i < n_local; ++i) {
    int best = -1, best_score = 0;
    bool best_used = true;
    for (int p = 0; p < n_peer; ++p) {
      const int s = score(i, p);
      if (s <= 0 || (used[p] && !allow_reuse)) continue;
      const bool u = used[p] != 0;
      // An unused rail beats a used one; then the higher score; then the lower index.
      if (best < 0 || (best_used && !u) || (best_used == u && s > best_score)) {
        best = p;
        best_score = s;
        best_used = u;
      }
    }
    if (best < 0) continue;
    used[best]++;
    out.push_back({i, best});
  }
  return out;
}

}  // namespace r2ccl::net
