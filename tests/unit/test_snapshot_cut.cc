// CutTracker: consistent cuts in pure form. A node killed mid-round leaves the previous step as
// the newest complete one; lost replicas stop counting (a step can become incomplete again);
// 3 replicas when possible, 1 enough for completeness; home copies are not replicas;
// out-of-order and duplicate reports; unknown nodes, ranks and forgotten steps refused.
#include <catch2/catch.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "r2ccl/snapshot/cut.h"

using namespace r2ccl::snap;

namespace {

using Nodes = std::vector<NodeId>;
using Ranks = std::vector<uint32_t>;

// n nodes 0..n-1, rank r on node r (its home), R = 3.
CutTracker cluster(uint32_t n, uint32_t replicas = 3) {
  CutTracker t(replicas);
  t.set_ranks(n);
  for (NodeId i = 0; i < n; ++i) {
    REQUIRE(t.add_node(i));
    t.set_home(i, i);
  }
  return t;
}

// Replicates every rank's shard of `step` to the `count` next nodes (r+1, r+2, ...).
void replicate_all(CutTracker& t, uint32_t n, uint64_t step, uint32_t count = 3) {
  for (uint32_t r = 0; r < n; ++r)
    for (uint32_t k = 1; k <= count; ++k)
      REQUIRE(t.on_held((r + k) % n, r, step) == ReportResult::kRecorded);
}

}  // namespace

TEST_CASE("a step is complete when every rank has one live replica", "[snapshot][cut]") {
  CutTracker t = cluster(4);
  CHECK_FALSE(t.newest_complete().has_value());
  REQUIRE(t.begin_round(10));
  CHECK(t.status(10).round_open);
  CHECK(t.missing(10) == Ranks{0, 1, 2, 3});
  CHECK(t.on_held(1, 0, 10) == ReportResult::kRecorded);
  CHECK(t.on_held(2, 1, 10) == ReportResult::kRecorded);
  CHECK(t.on_held(3, 2, 10) == ReportResult::kRecorded);
  CHECK_FALSE(t.complete(10));
  CHECK(t.missing(10) == Ranks{3});
  CHECK(t.on_held(0, 3, 10) == ReportResult::kRecorded);
  CHECK(t.complete(10));
  CHECK(t.newest_complete() == std::optional<uint64_t>(10));
  StepStatus s = t.round_done(10);
  CHECK(s.known);
  CHECK(s.complete);
  CHECK_FALSE(s.round_open);
  CHECK(s.ranks == 4);
  CHECK(s.ranks_held == 4);
  // One replica is enough to be complete, not to be fully replicated (4 nodes: 3 others each).
  CHECK_FALSE(s.fully_replicated);
  CHECK(s.ranks_at_target == 0);
  CHECK(t.under_replicated(10) == Ranks{0, 1, 2, 3});
  CHECK(t.target_for(0) == 3);
}

TEST_CASE("3 replicas when possible: the target follows the live nodes", "[snapshot][cut]") {
  SECTION("5 nodes: 3 replicas each") {
    CutTracker t = cluster(5);
    replicate_all(t, 5, 1, 2);
    CHECK(t.complete(1));
    CHECK_FALSE(t.status(1).fully_replicated);
    for (uint32_t r = 0; r < 5; ++r)
      REQUIRE(t.on_held((r + 3) % 5, r, 1) == ReportResult::kRecorded);
    CHECK(t.status(1).fully_replicated);
    CHECK(t.replicas(0, 1) == Nodes{1, 2, 3});
    CHECK(t.replicas(4, 1) == Nodes{0, 1, 2});
  }
  SECTION("2 nodes: 1 replica is all there can be") {
    CutTracker t = cluster(2);
    CHECK(t.target_for(0) == 1);
    replicate_all(t, 2, 1, 1);
    StepStatus s = t.status(1);
    CHECK(s.complete);
    CHECK(s.fully_replicated);
  }
  SECTION("no home known: every live node can hold a rank") {
    CutTracker t(3);
    t.set_ranks(1);
    for (NodeId n : {7, 8}) REQUIRE(t.add_node(n));
    CHECK(t.target_for(0) == 2);
    CHECK(t.on_held(7, 0, 1) == ReportResult::kRecorded);
    CHECK(t.complete(1));
    CHECK_FALSE(t.status(1).fully_replicated);
    CHECK(t.on_held(8, 0, 1) == ReportResult::kRecorded);
    CHECK(t.status(1).fully_replicated);
  }
}

TEST_CASE("a node killed mid-round: the newest complete step stays N-1, never N",
          "[snapshot][cut]") {
  // 4 nodes, rank r on node r. Step 9 (N-1) complete and fully replicated.
  CutTracker t = cluster(4);
  REQUIRE(t.begin_round(9));
  replicate_all(t, 4, 9);
  REQUIRE(t.round_done(9).fully_replicated);

  REQUIRE(t.begin_round(10));
  SECTION("a rank's shard had not left its node") {
    // Ranks 0 and 1 replicated (some of their shards only), then node 3 dies before rank 3's
    // shard of step 10 left it.
    REQUIRE(t.on_held(1, 0, 10) == ReportResult::kRecorded);
    REQUIRE(t.on_held(2, 1, 10) == ReportResult::kRecorded);
    REQUIRE(t.on_node_lost(3));
    CHECK(t.newest_complete() == std::optional<uint64_t>(9));
    // The rest of the round's reports arrive from the survivors: rank 3 is still missing.
    REQUIRE(t.on_held(0, 2, 10) == ReportResult::kRecorded);
    StepStatus s = t.round_done(10);
    CHECK_FALSE(s.complete);
    CHECK(s.ranks_held == 3);
    CHECK(t.missing(10) == Ranks{3});
    CHECK(t.newest_complete() == std::optional<uint64_t>(9));
    // Step 9 survives the loss: every rank (rank 3 included) has replicas on live nodes.
    CHECK(t.complete(9));
    CHECK(t.replicas(3, 9) == Nodes{0, 1, 2});
    // A late report from the dead node is refused.
    CHECK(t.on_held(3, 3, 10) == ReportResult::kUnknownNode);
    CHECK(t.newest_complete() == std::optional<uint64_t>(9));
  }
  SECTION("the only replica of a shard was on the lost node") {
    // Every rank reported, rank 0's shard only on node 3 so far.
    REQUIRE(t.on_held(3, 0, 10) == ReportResult::kRecorded);
    REQUIRE(t.on_held(2, 1, 10) == ReportResult::kRecorded);
    REQUIRE(t.on_held(0, 2, 10) == ReportResult::kRecorded);
    REQUIRE(t.on_held(1, 3, 10) == ReportResult::kRecorded);
    REQUIRE(t.complete(10));  // complete for an instant...
    REQUIRE(t.on_node_lost(3));
    // ...and no more: rank 0's only replica is gone.
    CHECK_FALSE(t.complete(10));
    CHECK(t.missing(10) == Ranks{0});
    CHECK(t.newest_complete() == std::optional<uint64_t>(9));
    // Rank 0 (alive on node 0) re-replicates to a survivor: step 10 is complete again.
    REQUIRE(t.on_held(1, 0, 10) == ReportResult::kRecorded);
    CHECK(t.newest_complete() == std::optional<uint64_t>(10));
  }
}

TEST_CASE("a lost replica node: counts drop; a step can become incomplete again",
          "[snapshot][cut]") {
  CutTracker t = cluster(5);
  replicate_all(t, 5, 1);     // rank r on r+1, r+2, r+3
  replicate_all(t, 5, 2, 1);  // rank r on r+1 only
  CHECK(t.newest_complete() == std::optional<uint64_t>(2));
  CHECK(t.replicas(0, 1) == Nodes{1, 2, 3});
  REQUIRE(t.on_node_lost(2));
  CHECK_FALSE(t.on_node_lost(2));  // already gone
  CHECK(t.replicas(0, 1) == Nodes{1, 3});
  CHECK(t.replicas(4, 1) == Nodes{0, 1});
  CHECK(t.status(1).complete);
  CHECK(t.status(1).ranks_at_target == 2);  // ranks 2 and 3 still have 3 (target stays 3)
  CHECK(t.under_replicated(1) == Ranks{0, 1, 4});
  // Step 2's rank 1 was only on node 2.
  CHECK_FALSE(t.complete(2));
  CHECK(t.missing(2) == Ranks{1});
  CHECK(t.newest_complete() == std::optional<uint64_t>(1));
  // Node 2 comes back empty: its old reports do not count until it reports again.
  REQUIRE(t.add_node(2));
  CHECK_FALSE(t.add_node(2));
  CHECK_FALSE(t.complete(2));
  CHECK(t.on_held(2, 1, 2) == ReportResult::kRecorded);
  CHECK(t.newest_complete() == std::optional<uint64_t>(2));
}

TEST_CASE("ranks on the lost node: their home copies are not replicas", "[snapshot][cut]") {
  CutTracker t = cluster(3);
  // Node 2 holds its own rank's shard: that does not make step 1 complete.
  REQUIRE(t.on_held(1, 0, 1) == ReportResult::kRecorded);
  REQUIRE(t.on_held(2, 1, 1) == ReportResult::kRecorded);
  CHECK(t.on_held(2, 2, 1) == ReportResult::kRecorded);  // recorded, not counted
  CHECK_FALSE(t.complete(1));
  CHECK(t.missing(1) == Ranks{2});
  CHECK(t.replicas(2, 1).empty());
  REQUIRE(t.on_held(0, 2, 1) == ReportResult::kRecorded);
  CHECK(t.complete(1));
  REQUIRE(t.on_held(0, 1, 1) == ReportResult::kRecorded);  // rank 1: nodes 0 and 2
  // Node 2 (rank 2's home) dies: rank 2's state lives on in its replica on node 0, and rank 1
  // keeps the replica on node 0: step 1 stays complete, and restorable for the dead rank.
  REQUIRE(t.on_node_lost(2));
  CHECK(t.complete(1));
  CHECK(t.replicas(2, 1) == Nodes{0});
  CHECK(t.replicas(1, 1) == Nodes{0});
  CHECK(t.missing(1).empty());
  // A replacement node 5 takes rank 2 over; its target now excludes node 5.
  REQUIRE(t.add_node(5));
  t.set_home(2, 5);
  CHECK(t.target_for(2) == 2);  // nodes 0 and 1
  CHECK(t.target_for(0) == 2);  // nodes 1 and 5
}

TEST_CASE("out-of-order reports, duplicates, unknown nodes and ranks", "[snapshot][cut]") {
  CutTracker t = cluster(3);
  // Reports for step 20 before step 10, and before any marker.
  CHECK(t.on_held(1, 0, 20) == ReportResult::kRecorded);
  CHECK(t.on_held(2, 1, 20) == ReportResult::kRecorded);
  CHECK(t.on_held(0, 2, 20) == ReportResult::kRecorded);
  CHECK(t.complete(20));  // no round needed: every shard exists
  CHECK(t.on_held(1, 0, 10) == ReportResult::kRecorded);
  CHECK(t.newest_complete() == std::optional<uint64_t>(20));
  CHECK_FALSE(t.complete(10));
  // Duplicates change nothing.
  CHECK(t.on_held(1, 0, 20) == ReportResult::kDuplicate);
  CHECK(t.replicas(0, 20) == Nodes{1});
  // Unknown node, unknown rank: refused, nothing recorded.
  CHECK(t.on_held(9, 0, 10) == ReportResult::kUnknownNode);
  CHECK(t.on_held(1, 3, 10) == ReportResult::kUnknownRank);
  CHECK(t.on_held(1, 1000000, 30) == ReportResult::kUnknownRank);
  CHECK_FALSE(t.status(30).known);  // a refused report creates no step
  CHECK(t.replicas(3, 10).empty());
  CHECK(t.replicas(0, 10) == Nodes{1});
  CHECK(t.missing(10) == Ranks{1, 2});
  CHECK(t.missing(99).empty());
  CHECK_FALSE(t.status(99).known);
  CHECK(std::string(report_result_name(ReportResult::kUnknownRank)) == "unknown-rank");
}

TEST_CASE("markers are monotonic; a step's ranks are fixed when it is first seen",
          "[snapshot][cut]") {
  CutTracker t = cluster(4);
  REQUIRE(t.begin_round(5));
  CHECK_FALSE(t.begin_round(5));  // repeated marker
  CHECK_FALSE(t.begin_round(4));  // older marker
  CHECK(t.last_round() == std::optional<uint64_t>(5));
  // A shrink to 3 ranks: step 5 still needs its 4 ranks; step 6 needs 3.
  t.set_ranks(3);
  replicate_all(t, 3, 5, 1);
  CHECK_FALSE(t.complete(5));
  CHECK(t.missing(5) == Ranks{3});
  CHECK(t.on_held(1, 3, 5) == ReportResult::kRecorded);  // rank 3 is a rank of step 5
  CHECK(t.complete(5));
  REQUIRE(t.begin_round(6));
  CHECK(t.status(6).ranks == 3);
  CHECK(t.on_held(1, 3, 6) == ReportResult::kUnknownRank);
  replicate_all(t, 3, 6, 1);
  CHECK(t.round_done(6).complete);
  CHECK(t.newest_complete() == std::optional<uint64_t>(6));
  // round_done of an unknown step: nothing known.
  CHECK_FALSE(t.round_done(77).known);
  // No ranks set: nothing can be reported, nothing is complete.
  CutTracker empty;
  REQUIRE(empty.add_node(0));
  CHECK(empty.on_held(0, 0, 1) == ReportResult::kUnknownRank);
  REQUIRE(empty.begin_round(1));
  CHECK_FALSE(empty.round_done(1).complete);
  CHECK_FALSE(empty.newest_complete().has_value());
}

TEST_CASE("forget_before drops old steps; their reports are refused", "[snapshot][cut]") {
  CutTracker t = cluster(2);
  for (uint64_t step = 1; step <= 5; ++step) replicate_all(t, 2, step, 1);
  CHECK(t.forget_before(4) == 3);
  CHECK_FALSE(t.status(3).known);
  CHECK(t.status(4).known);
  CHECK(t.on_held(1, 0, 2) == ReportResult::kForgotten);
  CHECK_FALSE(t.begin_round(3));
  CHECK(t.newest_complete() == std::optional<uint64_t>(5));
  // Losing the replicas of 4 and 5 leaves nothing complete: the older steps were pruned.
  REQUIRE(t.on_node_lost(1));
  CHECK_FALSE(t.newest_complete().has_value());
  CHECK(t.forget_before(2) == 0);  // the floor never moves back
  CHECK(t.on_held(0, 1, 3) == ReportResult::kForgotten);
}
