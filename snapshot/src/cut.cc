// CutTracker (r2ccl/snapshot/cut.h).
#include "r2ccl/snapshot/cut.h"

#include <algorithm>

namespace r2ccl::snap {

const char* report_result_name(ReportResult r) {
  switch (r) {
    case ReportResult::kRecorded: return "recorded";
    case ReportResult::kDuplicate: return "duplicate";
    case ReportResult::kUnknownNode: return "unknown-node";
    case ReportResult::kUnknownRank: return "unknown-rank";
    case ReportResult::kForgotten: return "forgotten";
  }
  return "unknown";
}

CutTracker::CutTracker(uint32_t target_replicas)
    : target_(std::max<uint32_t>(1, target_replicas)) {}

void CutTracker::set_ranks(uint32_t n) { ranks_ = n; }

void CutTracker::set_home(uint32_t rank, NodeId node) { home_[rank] = node; }

bool CutTracker::add_node(NodeId node) { return live_.insert(node).second; }

bool CutTracker::on_node_lost(NodeId node) {
  if (live_.erase(node) == 0) return false;
  for (auto& kv : steps_) {
    for (auto& h : kv.second.holders) h.erase(node);
  }
  return true;
}

CutTracker::StepRecord& CutTracker::record(uint64_t step) {
  auto it = steps_.find(step);
  if (it != steps_.end()) return it->second;
  StepRecord& r = steps_[step];
  r.ranks = ranks_;
  r.holders.resize(ranks_);
  return r;
}

bool CutTracker::begin_round(uint64_t step) {
  if (step < floor_ || (last_round_ && step <= *last_round_)) return false;
  record(step).round_open = true;
  last_round_ = step;
  return true;
}

StepStatus CutTracker::round_done(uint64_t step) {
  auto it = steps_.find(step);
  if (it != steps_.end()) it->second.round_open = false;
  return status(step);
}

ReportResult CutTracker::on_held(NodeId node, uint32_t rank, uint64_t step) {
  if (step < floor_) return ReportResult::kForgotten;
  if (!is_live(node)) return ReportResult::kUnknownNode;
  auto it = steps_.find(step);
  const uint32_t n = it != steps_.end() ? it->second.ranks : ranks_;
  if (rank >= n) return ReportResult::kUnknownRank;
  StepRecord& r = record(step);
  return r.holders[rank].insert(node).second ? ReportResult::kRecorded : ReportResult::kDuplicate;
}

bool CutTracker::on_retracted(NodeId node, uint32_t rank, uint64_t step) {
  auto it = steps_.find(step);
  if (it == steps_.end() || rank >= it->second.holders.size()) return false;
  return it->second.holders[rank].erase(node) != 0;
}

uint32_t CutTracker::live_replicas(const StepRecord& r, uint32_t rank) const {
  // Holders are live nodes only (on_node_lost removes a node's reports).
  auto h = home_.find(rank);
  uint32_t n = static_cast<uint32_t>(r.holders[rank].size());
  if (h != home_.end() && r.holders[rank].count(h->second)) --n;
  return n;
}

uint32_t CutTracker::target_for(uint32_t rank) const {
  uint32_t eligible = static_cast<uint32_t>(live_.size());
  auto h = home_.find(rank);
  if (h != home_.end() && is_live(h->second)) --eligible;
  return std::min(target_, eligible);
}

StepStatus CutTracker::status(uint64_t step) const {
  StepStatus s;
  auto it = steps_.find(step);
  if (it == steps_.end()) return s;
  const StepRecord& r = it->second;
  s.known = true;
  s.ranks = r.ranks;
  s.round_open = r.round_open;
  for (uint32_t rank = 0; rank < r.ranks; ++rank) {
    const uint32_t n = live_replicas(r, rank);
    if (n >= 1) ++s.ranks_held;
    if (n >= std::max<uint32_t>(1, target_for(rank))) ++s.ranks_at_target;
  }
  s.complete = s.ranks > 0 && s.ranks_held == s.ranks;
  s.fully_replicated = s.complete && s.ranks_at_target == s.ranks;
  return s;
}

bool CutTracker::complete(uint64_t step) const { return status(step).complete; }

std::optional<uint64_t> CutTracker::newest_complete() const {
  for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
    if (complete(it->first)) return it->first;
  }
  return std::nullopt;
}

std::vector<NodeId> CutTracker::replicas(uint32_t rank, uint64_t step) const {
  std::vector<NodeId> out;
  auto it = steps_.find(step);
  if (it == steps_.end() || rank >= it->second.ranks) return out;
  auto h = home_.find(rank);
  for (NodeId n : it->second.holders[rank]) {
    if (h == home_.end() || h->second != n) out.push_back(n);
  }
  return out;
}

std::vector<uint32_t> CutTracker::missing(uint64_t step) const {
  std::vector<uint32_t> out;
  auto it = steps_.find(step);
  if (it == steps_.end()) return out;
  for (uint32_t rank = 0; rank < it->second.ranks; ++rank) {
    if (live_replicas(it->second, rank) == 0) out.push_back(rank);
  }
  return out;
}

std::vector<uint32_t> CutTracker::under_replicated(uint64_t step) const {
  std::vector<uint32_t> out;
  auto it = steps_.find(step);
  if (it == steps_.end()) return out;
  for (uint32_t rank = 0; rank < it->second.ranks; ++rank) {
    if (live_replicas(it->second, rank) < std::max<uint32_t>(1, target_for(rank))) {
      out.push_back(rank);
    }
  }
  return out;
}

size_t CutTracker::forget_before(uint64_t step) {
  if (step > floor_) floor_ = step;
  size_t n = 0;
  while (!steps_.empty() && steps_.begin()->first < floor_) {
    steps_.erase(steps_.begin());
    ++n;
  }
  return n;
}

}  // namespace r2ccl::snap
