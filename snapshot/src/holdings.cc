#include "r2ccl/snapshot/holdings.h"

#include <algorithm>
#include <cctype>
#include <limits>
#include <set>
#include <sstream>

#include "text.h"

namespace r2ccl::snap {

using text::trim;

bool Holdings::valid(const ShardMeta& m, std::string* err) {
  const std::string who = "shard of rank " + std::to_string(m.rank) + " step " +
                          std::to_string(m.step) + " buffer " + std::to_string(m.buffer);
  if (m.world == 0 || m.world > 65536 || m.rank >= m.world) {
    *err = who + ": rank " + std::to_string(m.rank) + " of world " + std::to_string(m.world) +
           " (accepted: world 1..65536, rank < world)";
    return false;
  }
  if (m.n_buffers == 0 || m.n_buffers > 65536 || m.buffer >= m.n_buffers) {
    *err = who + ": buffer " + std::to_string(m.buffer) + " of n_buffers " +
           std::to_string(m.n_buffers) + " (accepted: n_buffers 1..65536, buffer < n_buffers)";
    return false;
  }
  if (m.base_step > m.step || m.base_seq > m.seq ||
      (m.step == m.base_step) != (m.seq == m.base_seq)) {
    *err =
        who + ": base step " + std::to_string(m.base_step) + ", seq " + std::to_string(m.seq) +
        ", base seq " + std::to_string(m.base_seq) +
        " (accepted: a base has step == base_step and seq == base_seq; a delta has both greater)";
    return false;
  }
  if (m.home_node >= static_cast<uint32_t>(board::kMaxNodes)) {
    *err = who + ": home node " + std::to_string(m.home_node) + " (accepted: 0.." +
           std::to_string(board::kMaxNodes - 1) + ")";
    return false;
  }
  return true;
}

bool Holdings::add(const ShardMeta& m) {
  const bool before = held_in_full(m.rank, m.step);
  entries_[ShardKey{m.rank, m.step, m.buffer}] =
      ChainEntry{m.base_step, m.seq, m.base_seq, m.payload_bytes};
  StepInfo& s = steps_[{m.rank, m.step}];
  s.n_buffers = m.n_buffers;
  s.world = m.world;
  s.home_node = m.home_node;
  s.generation = m.generation;
  newest_ = std::max(newest_, m.step);
  return !before && held_in_full(m.rank, m.step);
}

void Holdings::remove(const ShardKey& k) {
  entries_.erase(k);
  // The step's description stays while any buffer of it remains.
  auto lo = entries_.lower_bound(ShardKey{k.rank, 0, 0});
  bool any = false;
  for (auto it = lo; it != entries_.end() && it->first.rank == k.rank; ++it)
    if (it->first.step == k.step) {
      any = true;
      break;
    }
  if (!any) steps_.erase({k.rank, k.step});
}

void Holdings::retain(const std::vector<ShardInfo>& listed) {
  std::set<ShardKey> keep;
  for (const auto& i : listed) keep.insert(i.key);
  std::vector<ShardKey> gone;
  for (const auto& [k, e] : entries_)
    if (!keep.count(k)) gone.push_back(k);
  for (const auto& k : gone) remove(k);
}

bool Holdings::chain_ok(uint32_t rank, uint32_t buffer, uint64_t step) const {
  auto it = entries_.find(ShardKey{rank, step, buffer});
  if (it == entries_.end()) return false;
  const ChainEntry& end = it->second;
  const uint64_t want = end.seq - end.base_seq + 1;
  uint64_t have = 0;
  bool base = false;
  // Entries of (rank, buffer) are contiguous in ShardKey order, oldest step first.
  for (auto b = entries_.lower_bound(ShardKey{rank, end.base_step, buffer});
       b != entries_.end() && b->first.rank == rank && b->first.buffer == buffer &&
       b->first.step <= step;
       ++b) {
    if (b->second.base_step != end.base_step || b->second.base_seq != end.base_seq) continue;
    ++have;
    if (b->first.step == end.base_step && b->second.seq == end.base_seq) base = true;
  }
  return base && have == want;
}

bool Holdings::held_in_full(uint32_t rank, uint64_t step) const {
  auto s = steps_.find({rank, step});
  if (s == steps_.end() || s->second.n_buffers == 0) return false;
  for (uint32_t b = 0; b < s->second.n_buffers; ++b)
    if (!chain_ok(rank, b, step)) return false;
  return true;
}

std::vector<HeldStep> Holdings::full_steps(std::optional<uint64_t> only_step) const {
  std::vector<HeldStep> out;
  for (const auto& [rs, info] : steps_) {
    if (only_step && rs.second != *only_step) continue;
    if (held_in_full(rs.first, rs.second))
      out.push_back(HeldStep{rs.first, rs.second, info.world, info.home_node, info.generation});
  }
  return out;
}

std::vector<uint64_t> Holdings::chain(uint32_t rank, uint32_t buffer, uint64_t step) const {
  if (!chain_ok(rank, buffer, step)) return {};
  const ChainEntry& end = entries_.at(ShardKey{rank, step, buffer});
  std::vector<uint64_t> steps;
  for (auto b = entries_.lower_bound(ShardKey{rank, end.base_step, buffer});
       b != entries_.end() && b->first.rank == rank && b->first.buffer == buffer &&
       b->first.step <= step;
       ++b)
    if (b->second.base_step == end.base_step && b->second.base_seq == end.base_seq)
      steps.push_back(b->first.step);
  return steps;
}

bool Holdings::describe(const ShardKey& k, ShardMeta* out) const {
  auto e = entries_.find(k);
  auto s = steps_.find({k.rank, k.step});
  if (e == entries_.end() || s == steps_.end()) return false;
  ShardMeta m{};
  m.rank = k.rank;
  m.buffer = k.buffer;
  m.step = k.step;
  m.n_buffers = s->second.n_buffers;
  m.world = s->second.world;
  m.home_node = s->second.home_node;
  m.generation = s->second.generation;
  m.base_step = e->second.base_step;
  m.seq = e->second.seq;
  m.base_seq = e->second.base_seq;
  m.payload_bytes = e->second.bytes;
  *out = m;
  return true;
}

std::vector<ShardMeta> Holdings::all() const {
  std::vector<ShardMeta> out;
  for (const auto& [k, e] : entries_) {
    ShardMeta m;
    if (describe(k, &m)) out.push_back(m);
  }
  return out;
}

bool parse_topology(const std::string& text, std::map<uint32_t, std::vector<std::string>>* out,
                    std::string* err) {
  std::map<uint32_t, std::vector<std::string>> topo;
  std::istringstream in(text);
  std::string line;
  int no = 0;
  const std::string form = "accepted: 'ID PATH', ID 0.." + std::to_string(board::kMaxNodes - 1) +
                           ", PATH switch names from the top joined by '/', e.g. '3 spine0/leaf2'";
  while (std::getline(in, line)) {
    ++no;
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    line = trim(line);
    if (line.empty()) continue;
    const std::string where = "topology line " + std::to_string(no) + " '" + line + "'";
    const size_t sp = line.find_first_of(" \t");
    if (sp == std::string::npos) {
      *err = where + ": no path (" + form + ")";
      return false;
    }
    const std::string id_s = line.substr(0, sp), path = trim(line.substr(sp));
    uint64_t id = 0;
    bool ok = !id_s.empty() && id_s.size() <= 5;
    for (char c : id_s) {
      ok = ok && std::isdigit(static_cast<unsigned char>(c));
      if (ok) id = id * 10 + static_cast<uint64_t>(c - '0');
    }
    if (!ok || id >= static_cast<uint64_t>(board::kMaxNodes) ||
        path.find_first_of(" \t") != std::string::npos) {
      *err = where + ": malformed (" + form + ")";
      return false;
    }
    std::vector<std::string> parts;
    std::string part;
    std::istringstream ps(path);
    while (std::getline(ps, part, '/')) {
      if (part.empty()) {
        *err = where + ": empty switch name in '" + path + "' (" + form + ")";
        return false;
      }
      parts.push_back(part);
    }
    if (parts.empty()) {
      *err = where + ": no path (" + form + ")";
      return false;
    }
    if (!topo.emplace(static_cast<uint32_t>(id), parts).second) {
      *err = where + ": node id " + std::to_string(id) + " appears twice";
      return false;
    }
  }
  *out = std::move(topo);
  return true;
}

int topology_hops(const std::map<uint32_t, std::vector<std::string>>& topo, uint32_t a,
                  uint32_t b) {
  auto ia = topo.find(a), ib = topo.find(b);
  if (ia == topo.end() || ib == topo.end()) return std::numeric_limits<int>::max();
  const auto& pa = ia->second;
  const auto& pb = ib->second;
  size_t common = 0;
  while (common < pa.size() && common < pb.size() && pa[common] == pb[common]) ++common;
  const size_t below = std::max(pa.size(), pb.size()) - common;
  return static_cast<int>(2 * below + 2);
}

std::vector<uint32_t> choose_replicas(uint32_t home, const std::vector<uint32_t>& live,
                                      const std::map<uint32_t, std::vector<std::string>>& topo,
                                      const std::map<uint32_t, int64_t>& rtt_us, size_t want) {
  std::vector<std::tuple<int, int64_t, uint32_t>> c;
  for (uint32_t n : live) {
    if (n == home) continue;
    const int hops = topo.empty() ? 0 : topology_hops(topo, home, n);
    auto r = rtt_us.find(n);
    const int64_t rtt = r == rtt_us.end() ? std::numeric_limits<int64_t>::max() : r->second;
    c.emplace_back(hops, rtt, n);
  }
  std::sort(c.begin(), c.end());
  std::vector<uint32_t> out;
  for (size_t i = 0; i < c.size() && i < want; ++i) out.push_back(std::get<2>(c[i]));
  return out;
}

}  // namespace r2ccl::snap
