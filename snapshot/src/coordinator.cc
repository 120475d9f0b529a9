#include "r2ccl/snapshot/coordinator.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace r2ccl::snap {

using nlohmann::json;

bool Record::has(uint32_t id) const { return find(id) != nullptr; }
const MemberInfo* Record::find(uint32_t id) const {
  for (const auto& m : members)
    if (m.id == id) return &m;
  return nullptr;
}
bool Record::same_members(const std::vector<MemberInfo>& m) const {
  if (m.size() != members.size()) return false;
  for (const auto& x : m) {
    const MemberInfo* y = find(x.id);
    if (!y || !(*y == x)) return false;
  }
  return true;
}

std::string encode_member(const MemberInfo& m) {
  return json{{"id", m.id},
              {"incarnation", std::to_string(m.incarnation)},
              {"lease", std::to_string(m.lease)},
              {"gbps", m.usable_gbps},
              {"job", m.job}}
      .dump();
}

namespace {
bool u64_of(const json& j, const char* k, uint64_t* out) {
  auto it = j.find(k);
  if (it == j.end()) return false;
  try {
    if (it->is_string()) {
      const std::string s = it->get<std::string>();
      if (s.empty() || s.size() > 20 || s.find_first_not_of("0123456789") != std::string::npos)
        return false;
      *out = std::stoull(s);
      return true;
    }
    if (it->is_number_unsigned()) {
      *out = it->get<uint64_t>();
      return true;
    }
  } catch (const std::exception&) {
  }
  return false;
}
bool member_of(const json& j, MemberInfo* m, std::string* err) {
  uint64_t id = 0, inc = 0, lease = 0;
  if (!j.is_object() || !u64_of(j, "id", &id) || id >= uint64_t(board::kMaxNodes) ||
      !u64_of(j, "incarnation", &inc)) {
    *err = "a member needs \"id\" (0.." + std::to_string(board::kMaxNodes - 1) +
           ") and \"incarnation\" (a decimal string)";
    return false;
  }
  u64_of(j, "lease", &lease);
  m->job = j.contains("job") && j["job"].is_string() ? j["job"].get<std::string>() : "";
  m->id = uint32_t(id);
  m->incarnation = inc;
  m->lease = int64_t(lease);
  m->usable_gbps = 0;
  if (j.contains("gbps") && j["gbps"].is_number()) {
    const double g = j["gbps"].get<double>();
    if (g >= 0 && g < 1e6) m->usable_gbps = float(g);
  }
  return true;
}
}  // namespace

bool decode_member(const std::string& text, MemberInfo* m, std::string* err) {
  try {
    return member_of(json::parse(text), m, err);
  } catch (const std::exception& e) {
    *err = std::string("not JSON: ") + e.what();
    return false;
  }
}

std::string encode_record(const Record& r) {
  json ms = json::array();
  for (const auto& m : r.members)
    ms.push_back(
        {{"id", m.id}, {"incarnation", std::to_string(m.incarnation)}, {"gbps", m.usable_gbps}});
  json j = {
      {"epoch", r.epoch},
      {"generation", r.generation},
      {"restore_step", r.restore_step ? json(*r.restore_step) : json(nullptr)},
      {"restore_points", r.restore_points},
      {"generation_step", r.restore_points.empty() ? json(nullptr) : json(r.restore_points.back())},
      {"leader", r.leader},
      {"leader_revision", r.leader_revision},
      {"members", ms}};
  return j.dump();
}

bool decode_record(const std::string& text, Record* r, std::string* err) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    *err = std::string("not JSON: ") + e.what();
    return false;
  }
  Record out;
  uint64_t leader = 0, lrev = 0;
  if (!j.is_object() || !u64_of(j, "epoch", &out.epoch) || out.epoch == 0 ||
      !u64_of(j, "generation", &out.generation) || !u64_of(j, "leader", &leader) ||
      !u64_of(j, "leader_revision", &lrev) || !j.contains("members") || !j["members"].is_array() ||
      !j.contains("restore_step")) {
    *err =
        "a record needs epoch (>= 1), generation, restore_step (a step or null), leader, "
        "leader_revision and members";
    return false;
  }
  if (!j["restore_step"].is_null()) {
    uint64_t s = 0;
    if (!u64_of(j, "restore_step", &s)) {
      *err = "restore_step is neither a step nor null";
      return false;
    }
    out.restore_step = s;
  }
  if (out.generation > kMaxGenerations) {
    *err = "generation " + std::to_string(out.generation) + " is above " +
           std::to_string(kMaxGenerations);
    return false;
  }
  if (j.contains("restore_points")) {
    const json& rp = j["restore_points"];
    bool ok = rp.is_array() && rp.size() == out.generation;
    for (size_t k = 0; ok && k < rp.size(); ++k) {
      ok = rp[k].is_number_unsigned();
      if (ok) out.restore_points.push_back(rp[k].get<uint64_t>());
    }
    if (!ok) {
      *err = "restore_points must be an array of " + std::to_string(out.generation) +
             " steps, one per generation";
      return false;
    }
  } else if (j.contains("generation_step") && !j["generation_step"].is_null()) {
    // The older form: only the newest restore point. Used for every generation, it decides
    // as that form did.
    uint64_t g = 0;
    if (!u64_of(j, "generation_step", &g)) {
      *err = "generation_step is neither a step nor null";
      return false;
    }
    out.restore_points.assign(out.generation, g);
  }
  out.leader = uint32_t(leader);
  out.leader_revision = int64_t(lrev);
  std::set<uint32_t> seen;
  for (const auto& mj : j["members"]) {
    MemberInfo m;
    if (!member_of(mj, &m, err)) return false;
    if (!seen.insert(m.id).second) {
      *err = "member " + std::to_string(m.id) + " appears twice";
      return false;
    }
    out.members.push_back(m);
  }
  std::sort(out.members.begin(), out.members.end(),
            [](const MemberInfo& a, const MemberInfo& b) { return a.id < b.id; });
  *r = std::move(out);
  return true;
}

board::AgreedRecord to_board(const Record& r, uint32_t configured) {
  board::AgreedRecord b{};
  b.epoch = r.epoch;
  uint32_t n = configured;
  for (const auto& m : r.members) n = std::max(n, m.id + 1);
  b.n_nodes = std::min<uint32_t>(n, board::kMaxNodes);
  for (const auto& m : r.members) {
    b.members[m.id / 64] |= 1ull << (m.id % 64);
    b.node_usable_gbps[m.id] = m.usable_gbps;
  }
  return b;
}

bool shard_current(const Record& record, uint64_t shard_generation, uint64_t step) {
  if (shard_generation >= record.generation) return true;
  if (record.restore_points.size() != record.generation) return false;
  for (uint64_t k = shard_generation; k < record.generation; ++k)
    if (step > record.restore_points[k]) return false;
  return true;
}

Planner::Planner(uint32_t self, TimeUs period, TimeUs grace)
    : self_(self), period_(period), grace_(grace) {}

void Planner::took_over(TimeUs now) {
  first_until_ = now + grace_;
  cut_deadline_ = now + 5 * period_;
}
void Planner::etcd_back(TimeUs now) { grace_until_ = std::max(grace_until_, now + grace_); }

Planner::Plan Planner::plan(const Input& in, std::vector<MemberInfo>* members_after) const {
  Plan p;
  std::map<uint32_t, MemberInfo> reg;
  for (const auto& m : in.registered) reg[m.id] = m;
  // Evictions: targets with >= 2 observers that are registered and not evicted themselves.
  // Most-suspected first, so of two nodes that suspect each other through one cut link the one
  // the rest of the cluster also lost goes.
  std::map<uint32_t, std::set<uint32_t>> observers;
  for (const auto& [t, o] : in.suspects)
    if (t != o && reg.count(t) && reg.count(o)) observers[t].insert(o);
  std::vector<uint32_t> order;
  for (const auto& [t, os] : observers) order.push_back(t);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return observers[a].size() > observers[b].size();
  });
  std::set<uint32_t> evicted;
  for (uint32_t t : order) {
    size_t agree = 0;
    for (uint32_t o : observers[t]) agree += evicted.count(o) ? 0 : 1;
    if (agree >= 2) evicted.insert(t);
  }
  p.evict.assign(evicted.begin(), evicted.end());
  for (uint32_t t : evicted) reg.erase(t);

  const bool in_grace = in.now < grace_until_;
  std::vector<MemberInfo> next;
  for (const auto& [id, m] : reg) next.push_back(m);
  std::string lost, joined;
  if (in.current) {
    for (const auto& m : in.current->members) {
      auto it = reg.find(m.id);
      const bool gone = it == reg.end() || !(it->second == m);
      if (!gone) continue;
      if (in_grace && it == reg.end() && !evicted.count(m.id)) {
        next.push_back(m);  // its lease may have run out in an etcd outage: wait for it
        continue;
      }
      lost += (lost.empty() ? "" : ", ") + std::to_string(m.id) +
              (evicted.count(m.id) ? " (evicted: suspected by 2)"
               : it == reg.end()   ? " (lease gone)"
                                   : " (restarted: new incarnation)");
    }
    for (const auto& [id, m] : reg) {
      const MemberInfo* c = in.current->find(id);
      if (!c || !(*c == m)) joined += (joined.empty() ? "" : ", ") + std::to_string(id);
    }
  }
  std::sort(next.begin(), next.end(),
            [](const MemberInfo& a, const MemberInfo& b) { return a.id < b.id; });
  if (members_after) *members_after = next;
  if (next.empty()) return p;
  if (!in.current) {
    if (in_grace || in.now < first_until_) return p;  // daemons started together: epoch 1
    Record r;
    r.epoch = 1;
    r.leader = self_;
    r.members = next;
    p.next = r;
    p.why = "first record";
    return p;
  }
  if (in.current->same_members(next)) return p;
  Record r;
  r.epoch = in.current->epoch + 1;
  r.leader = self_;
  r.members = next;
  r.generation = in.current->generation;
  r.restore_step = in.current->restore_step;
  // One point per generation, also when the current record has none for some (an older
  // daemon's form without them): those get step 0, so their generations' shards count only up
  // to step 0, which loses no consistency; a record written here always decodes.
  r.restore_points = in.current->restore_points;
  r.restore_points.resize(r.generation, 0);
  if (!lost.empty()) {
    if (!in.cut_ready && in.now < cut_deadline_) {
      p.waiting_for_cut = true;
      return p;
    }
    // A restore point when a step is complete without the lost members: every rank rolls back
    // to it, so what was taken after it belongs to an old timeline. With none, nobody can
    // restore and nobody rolls back: no new generation, and nothing is dropped (a node that
    // returns with its spilled shards can make a step complete again).
    if (in.newest_complete) {
      r.generation += 1;
      r.restore_points.push_back(*in.newest_complete);
    }
    r.restore_step = in.newest_complete;
  }
  p.next = r;
  p.why = (lost.empty() ? "" : "lost " + lost) + (!lost.empty() && !joined.empty() ? "; " : "") +
          (joined.empty() ? "" : "joined " + joined);
  return p;
}

}  // namespace r2ccl::snap
