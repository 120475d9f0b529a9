// CutTracker: the coordinator's bookkeeping of consistent cuts (snapshot/README.md, "Shard
// store and consistent cuts").
//
// For each snapshot step the coordinator runs a marker round (Chandy-Lamport style): every
// rank's shards of that step are replicated to up to R other nodes, and nodes report which
// (rank, step) they hold in full (every buffer of that rank). A step is COMPLETE when every
// rank of that step has its shard held by at least one live replica node; it is FULLY
// REPLICATED when, in addition, every rank has its target of min(R, eligible live nodes)
// replicas (eligible: every live node but the rank's home node, when known). Restore uses
// newest_complete(), never a partial step.
//
// Decisions (tested in tests/unit/test_snapshot_cut.cc):
//  - Completeness is computed from the live replicas now, not latched: when a node is lost its
//    reports stop counting, and a step whose only replica of some rank was on it becomes
//    incomplete again (newest_complete() falls back to an older step). A node that comes back
//    (add_node) starts with nothing: it must report again.
//  - The ranks of a step are fixed when the tracker first hears of the step (begin_round or the
//    first report): set_ranks(n) applies to steps not seen yet. A shrink does not make an older
//    step's missing ranks disappear.
//  - A copy held by the rank's own home node (set_home) is not a replica: it dies with the rank.
//  - Reports may arrive before the round's marker, out of order, and more than once; a step can
//    be complete without a round (begin_round only opens the round, fixes the ranks and orders
//    markers). round_done() closes the round and says where it stands; an incomplete step
//    stays tracked, and late reports can still complete it (every shard of it exists).
//  - Reports from nodes not live, for ranks outside the step, or for forgotten steps are
//    refused (ReportResult says which) and change nothing.
//
// Pure logic: no threads, no clock, no I/O. Thread-safety: none; the caller serialises (the
// coordinator's event loop owns it).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

namespace r2ccl::snap {

using NodeId = uint32_t;

enum class ReportResult : int {
  kRecorded = 0,  // a new (node, rank, step)
  kDuplicate,     // already known: nothing changed
  kUnknownNode,   // the node is not live (never added, or lost): refused
  kUnknownRank,   // rank >= the step's rank count: refused
  kForgotten,     // the step is below forget_before(): refused
};
// "recorded", "duplicate", "unknown-node", "unknown-rank", "forgotten".
const char* report_result_name(ReportResult r);

// Where one step stands.
struct StepStatus {
  bool known = false;             // the tracker has a record of the step
  uint32_t ranks = 0;             // ranks that take this snapshot
  uint32_t ranks_held = 0;        // ranks with >= 1 live replica
  uint32_t ranks_at_target = 0;   // ranks with their target replica count (see target_for)
  bool complete = false;          // ranks_held == ranks (and ranks > 0)
  bool fully_replicated = false;  // complete and ranks_at_target == ranks
  bool round_open = false;        // begin_round(step) without round_done(step)
};

class CutTracker {
 public:
  // target_replicas: R, the replicas wanted per shard (>= 1; 0 is taken as 1).
  explicit CutTracker(uint32_t target_replicas = 3);

  // Ranks 0..n-1 take the snapshots of steps first seen from now on.
  void set_ranks(uint32_t n);
  uint32_t ranks() const { return ranks_; }
  // The node a rank runs on (optional): its copies on that node are not replicas. A replacement
  // node taking a rank over is set here too.
  void set_home(uint32_t rank, NodeId node);

  // Membership. add_node: false when already live. on_node_lost: forgets every report of the
  // node (its replicas no longer count); false when it was not live.
  bool add_node(NodeId node);
  bool on_node_lost(NodeId node);
  bool is_live(NodeId node) const { return live_.count(node) != 0; }
  std::vector<NodeId> live_nodes() const { return {live_.begin(), live_.end()}; }

  // Markers. begin_round: opens the round of `step`, fixing its ranks if the step is new.
  // False (and nothing changes) when `step` is not newer than the last round begun, or is
  // forgotten. round_done: closes the round (if open) and returns the step's status.
  bool begin_round(uint64_t step);
  StepStatus round_done(uint64_t step);
  std::optional<uint64_t> last_round() const { return last_round_; }

  // `node` holds every buffer of `rank`'s shard of `step`.
  ReportResult on_held(NodeId node, uint32_t rank, uint64_t step);
  // `node` no longer holds (rank, step) in full (it pruned it, or a shard failed its
  // checksum): its report stops counting. Returns whether it had counted.
  bool on_retracted(NodeId node, uint32_t rank, uint64_t step);

  bool complete(uint64_t step) const;
  // The newest complete step, or nullopt when none is.
  std::optional<uint64_t> newest_complete() const;
  StepStatus status(uint64_t step) const;
  // Live replica nodes holding (rank, step), ascending (the home node excluded).
  std::vector<NodeId> replicas(uint32_t rank, uint64_t step) const;
  // min(R, live nodes other than the rank's live home node).
  uint32_t target_for(uint32_t rank) const;
  // Ranks of `step` without a live replica (for logging), ascending; empty for an unknown step.
  std::vector<uint32_t> missing(uint64_t step) const;
  // Ranks of `step` below their replica target, ascending.
  std::vector<uint32_t> under_replicated(uint64_t step) const;

  // Drops the records of steps older than `step` (after the stores pruned them): reports for
  // them are refused from now on. Returns how many steps were dropped.
  size_t forget_before(uint64_t step);

 private:
  struct StepRecord {
    uint32_t ranks = 0;
    std::vector<std::set<NodeId>> holders;  // per rank: live nodes that reported it
    bool round_open = false;
  };
  StepRecord& record(uint64_t step);
  uint32_t live_replicas(const StepRecord& r, uint32_t rank) const;

  uint32_t target_;
  uint32_t ranks_ = 0;
  std::map<uint32_t, NodeId> home_;
  std::set<NodeId> live_;
  std::map<uint64_t, StepRecord> steps_;
  std::optional<uint64_t> last_round_;
  uint64_t floor_ = 0;  // steps below it are forgotten
};

}  // namespace r2ccl::snap
