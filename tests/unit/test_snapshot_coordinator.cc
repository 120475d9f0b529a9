// The coordinator's decisions (coordinator.h), the agreed record's JSON form, the accrual
// detector (accrual.h) and etcd endpoint parsing, on a manual clock: no etcd, no sockets.
#include <catch2/catch.hpp>

#include "r2ccl/clock.h"
#include "r2ccl/snapshot/accrual.h"
#include "r2ccl/snapshot/coordinator.h"

using namespace r2ccl;
using namespace r2ccl::snap;

namespace {
constexpr TimeUs kPeriod = 100 * kUsPerMs, kGrace = kUsPerSec;
MemberInfo mem(uint32_t id, uint64_t inc = 0) {
  return MemberInfo{id, inc ? inc : 100 + id, 1, 0, ""};
}
std::vector<MemberInfo> mems(std::initializer_list<uint32_t> ids) {
  std::vector<MemberInfo> v;
  for (uint32_t i : ids) v.push_back(mem(i));
  return v;
}
// Node 0's planner, coordinator for 10 periods (past the first record's wait) at clk's now.
Planner settled(ManualClock& clk) {
  Planner p(0, kPeriod, kGrace);
  p.took_over(clk.now());
  clk.advance(10 * kPeriod);
  return p;
}
std::vector<uint32_t> ids_of(const Record& r) {
  std::vector<uint32_t> v;
  for (const auto& m : r.members) v.push_back(m.id);
  return v;
}
Record rec(uint64_t epoch, std::initializer_list<uint32_t> ids, uint64_t gen = 0,
           std::optional<uint64_t> restore = std::nullopt) {
  Record r;
  r.epoch = epoch;
  r.generation = gen;
  r.restore_step = restore;
  if (gen) r.restore_points.assign(gen, restore.value_or(0));
  r.members = mems(ids);
  return r;
}
}  // namespace

TEST_CASE("coordinator: the first record waits out the start, then has every registered member",
          "[snapshot][coordinator]") {
  ManualClock clk;
  Planner p(0, kPeriod, kGrace);
  p.took_over(clk.now());
  Planner::Input in;
  in.registered = mems({0, 1});
  in.now = clk.now();
  CHECK_FALSE(p.plan(in).next);  // a third daemon may still be starting
  clk.advance(kGrace);
  in.registered = mems({0, 1, 2});
  in.now = clk.now();
  const auto plan = p.plan(in);
  REQUIRE(plan.next);
  CHECK(plan.next->epoch == 1);
  CHECK(plan.next->generation == 0);
  CHECK_FALSE(plan.next->restore_step);
  CHECK(ids_of(*plan.next) == std::vector<uint32_t>{0, 1, 2});
}

TEST_CASE("coordinator: a lost lease is a restore point; a join is not; nothing changes, no record",
          "[snapshot][coordinator]") {
  ManualClock clk;
  Planner p = settled(clk);
  Planner::Input in;
  in.current = rec(4, {0, 1, 2}, 2, 7);
  in.registered = mems({0, 1, 2});
  in.now = clk.now();
  in.cut_ready = true;
  in.newest_complete = 9;
  CHECK_FALSE(p.plan(in).next);  // the same members: no new epoch
  in.registered = mems({0, 2});  // node 1's lease is gone
  auto plan = p.plan(in);
  REQUIRE(plan.next);
  CHECK(plan.next->epoch == 5);
  CHECK(plan.next->generation == 3);
  CHECK(plan.next->restore_step == std::optional<uint64_t>(9));
  CHECK(plan.next->restore_points == std::vector<uint64_t>{7, 7, 9});
  CHECK(ids_of(*plan.next) == std::vector<uint32_t>{0, 2});
  CHECK_THAT(plan.why, Catch::Contains("lost 1 (lease gone)"));
  // A join alone keeps the generation and the restore step.
  in.current = *plan.next;
  in.registered = mems({0, 1, 2, 3});
  in.newest_complete = 12;
  plan = p.plan(in);
  REQUIRE(plan.next);
  CHECK(plan.next->epoch == 6);
  CHECK(plan.next->generation == 3);
  CHECK(plan.next->restore_step == std::optional<uint64_t>(9));
  CHECK_THAT(plan.why, Catch::Contains("joined 1, 3"));
}

TEST_CASE("coordinator: a restarted member (new incarnation) is a loss and a join",
          "[snapshot][coordinator]") {
  ManualClock clk;
  Planner p = settled(clk);
  Planner::Input in;
  in.current = rec(2, {0, 1, 2});
  in.registered = mems({0, 1});
  in.registered.push_back(mem(2, 999));
  in.now = clk.now();
  in.cut_ready = true;
  in.newest_complete = 5;
  const auto plan = p.plan(in);
  REQUIRE(plan.next);
  CHECK(plan.next->epoch == 3);
  CHECK(plan.next->generation == 1);
  CHECK(plan.next->find(2)->incarnation == 999);
  CHECK_THAT(plan.why, Catch::Contains("2 (restarted: new incarnation)"));
}

TEST_CASE("coordinator: eviction needs two observers; one cut link evicts nobody",
          "[snapshot][coordinator]") {
  ManualClock clk;
  Planner p = settled(clk);
  Planner::Input in;
  in.current = rec(1, {0, 1, 2});
  in.registered = mems({0, 1, 2});
  in.now = clk.now();
  in.cut_ready = true;
  // 0 and 1 cannot hear each other; 2 hears both.
  in.suspects = {{1, 0}, {0, 1}};
  auto plan = p.plan(in);
  CHECK(plan.evict.empty());
  CHECK_FALSE(plan.next);
  // Node 2 is silent to both others: evicted, and the record leaves it out.
  in.suspects = {{2, 0}, {2, 1}};
  plan = p.plan(in);
  CHECK(plan.evict == std::vector<uint32_t>{2});
  REQUIRE(plan.next);
  CHECK(ids_of(*plan.next) == std::vector<uint32_t>{0, 1});
  CHECK_THAT(plan.why, Catch::Contains("evicted: suspected by 2"));
  // A suspicion by an unregistered node, or of itself, does not count.
  in.suspects = {{2, 0}, {2, 7}, {2, 2}};
  CHECK(p.plan(in).evict.empty());
  // Two nodes each suspected by two: one that is evicted no longer counts as an observer.
  in.current = rec(1, {0, 1, 2, 3});
  in.registered = mems({0, 1, 2, 3});
  in.suspects = {{3, 0}, {3, 1}, {3, 2}, {2, 3}, {2, 0}};
  plan = p.plan(in);
  CHECK(plan.evict == std::vector<uint32_t>{3});  // 3 by 0, 1, 2; 2 only by 0 and 3 (evicted)
}

TEST_CASE("coordinator: after etcd comes back, missing members keep their place for the grace",
          "[snapshot][coordinator]") {
  ManualClock clk;
  Planner p(1, kPeriod, kGrace);
  p.took_over(clk.now());
  clk.advance(10 * kPeriod);
  p.etcd_back(clk.now());
  Planner::Input in;
  in.current = rec(3, {0, 1, 2});
  in.registered = mems({1});  // the others have not registered again yet
  in.now = clk.now();
  in.cut_ready = true;
  std::vector<MemberInfo> after;
  CHECK_FALSE(p.plan(in, &after).next);
  CHECK(after.size() == 3);  // the cut view keeps following them
  in.registered = mems({0, 1, 2});
  CHECK_FALSE(p.plan(in).next);  // back with their incarnations: no new epoch
  in.registered = mems({0, 1});
  clk.advance(kGrace);
  in.now = clk.now();
  const auto plan = p.plan(in);
  REQUIRE(plan.next);
  CHECK(ids_of(*plan.next) == std::vector<uint32_t>{0, 1});
}

TEST_CASE("coordinator: a restore record waits for the cut view, at most 5 periods",
          "[snapshot][coordinator]") {
  ManualClock clk;
  Planner p(0, kPeriod, kGrace);
  p.took_over(clk.now());
  Planner::Input in;
  in.current = rec(2, {0, 1, 2}, 0, std::nullopt);
  in.registered = mems({0, 1});
  in.now = clk.now();
  in.cut_ready = false;  // a new coordinator's view: not every member answered yet
  in.newest_complete = std::nullopt;
  auto plan = p.plan(in);
  CHECK_FALSE(plan.next);
  CHECK(plan.waiting_for_cut);
  in.cut_ready = true;
  in.newest_complete = 3;
  plan = p.plan(in);
  REQUIRE(plan.next);
  CHECK(plan.next->restore_step == std::optional<uint64_t>(3));
  in.cut_ready = false;
  clk.advance(5 * kPeriod);
  in.now = clk.now();
  in.newest_complete = std::nullopt;
  plan = p.plan(in);
  REQUIRE(plan.next);  // the deadline passed: what the view says
  CHECK_FALSE(plan.next->restore_step);
  CHECK(plan.next->generation == 0);  // nothing to roll back to: no new timeline
}

TEST_CASE("coordinator: generations decide which shards belong to the timeline",
          "[snapshot][coordinator]") {
  const Record r = rec(5, {0}, 2, 10);
  CHECK(shard_current(r, 2, 50));        // its own generation
  CHECK(shard_current(r, 1, 10));        // older, at the restore point
  CHECK_FALSE(shard_current(r, 1, 11));  // older, after it: rolled back
  CHECK(shard_current(rec(1, {0}), 0, 7));
  // A later loss with nothing restorable keeps the generation and its start: the older
  // generation's shards up to step 10 still belong.
  Record later = r;
  later.epoch = 6;
  later.restore_step.reset();
  CHECK(shard_current(later, 1, 10));
  CHECK_FALSE(shard_current(later, 1, 11));
}

TEST_CASE("coordinator: a step rolled back at one restore point stays rolled back after the next",
          "[snapshot][coordinator]") {
  // Generation 0 ran to step 20; a loss restored step 10 (generation 1, which ran to 30); a
  // second loss restored step 15 (generation 2). Generation 0's step 12 was rolled back at the
  // first restore point: a node away across both, returning with it spilled, must not count
  // it, although 12 <= 15.
  ManualClock clk;
  Planner p = settled(clk);
  Planner::Input in;
  in.current = rec(3, {0, 1, 2, 3});
  in.registered = mems({0, 1, 2});  // node 3 is lost
  in.now = clk.now();
  in.cut_ready = true;
  in.newest_complete = 10;
  auto plan = p.plan(in);
  REQUIRE(plan.next);
  REQUIRE(plan.next->generation == 1);
  in.current = *plan.next;
  in.registered = mems({0, 1});  // node 2 is lost
  in.newest_complete = 15;
  plan = p.plan(in);
  REQUIRE(plan.next);
  REQUIRE(plan.next->generation == 2);
  const Record& r = *plan.next;
  CHECK(shard_current(r, 0, 10));        // before both restore points
  CHECK_FALSE(shard_current(r, 0, 12));  // rolled back at step 10
  CHECK_FALSE(shard_current(r, 0, 16));
  CHECK(shard_current(r, 1, 12));  // generation 1's step 12, before step 15
  CHECK(shard_current(r, 1, 15));
  CHECK_FALSE(shard_current(r, 1, 16));  // rolled back at step 15
  CHECK(shard_current(r, 2, 16));
  // The same through the record's JSON (what every daemon reads from etcd).
  Record back;
  std::string err;
  REQUIRE(decode_record(encode_record(r), &back, &err));
  CHECK_FALSE(shard_current(back, 0, 12));
  CHECK(shard_current(back, 1, 12));
}

TEST_CASE(
    "coordinator: a record of the older form without restore points is planned on and "
    "written back in a form that decodes",
    "[snapshot][coordinator]") {
  // Written by a daemon from before generation_step: generation 1, no restore point at all.
  Record legacy;
  std::string err;
  REQUIRE(decode_record(R"({"epoch":3,"generation":1,"restore_step":7,"leader":0,
                            "leader_revision":1,"members":[{"id":0,"incarnation":"100"},
                            {"id":1,"incarnation":"101"}]})",
                        &legacy, &err));
  CHECK(legacy.restore_points.empty());
  CHECK_FALSE(shard_current(legacy, 0, 1));  // unknown: as that form decided
  ManualClock clk;
  Planner p = settled(clk);
  Planner::Input in;
  in.current = legacy;
  in.registered = mems({0, 1, 2});  // a join: no restore point
  in.now = clk.now();
  in.cut_ready = true;
  auto plan = p.plan(in);
  REQUIRE(plan.next);
  Record back;
  REQUIRE(decode_record(encode_record(*plan.next), &back, &err));
  CHECK(back.restore_points == std::vector<uint64_t>{0});
  in.current = back;  // then a loss: a second point
  in.registered = mems({0, 2});
  in.newest_complete = 9;
  plan = p.plan(in);
  REQUIRE(plan.next);
  REQUIRE(decode_record(encode_record(*plan.next), &back, &err));
  CHECK(back.restore_points == std::vector<uint64_t>{0, 9});
  CHECK(shard_current(back, 0, 0));
  CHECK_FALSE(shard_current(back, 0, 1));
  CHECK(shard_current(back, 1, 9));
}

TEST_CASE("coordinator: the record and member JSON round-trip; bad input is named",
          "[snapshot][coordinator]") {
  Record r = rec(7, {3, 0, 1}, 2, 41);
  r.members[0].incarnation = 18446744073709551615ull;  // 64-bit, as a string
  r.members[1].usable_gbps = 12.5f;
  r.leader = 3;
  r.leader_revision = 17;
  Record back;
  std::string err;
  r.restore_points = {30, 40};
  REQUIRE(decode_record(encode_record(r), &back, &err));
  CHECK(back.restore_points == std::vector<uint64_t>{30, 40});
  CHECK(back.epoch == 7);
  CHECK(back.generation == 2);
  CHECK(back.restore_step == std::optional<uint64_t>(41));
  CHECK(back.leader == 3);
  CHECK(back.leader_revision == 17);
  CHECK(ids_of(back) == std::vector<uint32_t>{0, 1, 3});  // sorted
  CHECK(back.find(3)->incarnation == 18446744073709551615ull);
  CHECK(back.find(0)->usable_gbps == 12.5f);
  r.restore_step.reset();
  REQUIRE(decode_record(encode_record(r), &back, &err));
  CHECK_FALSE(back.restore_step);
  CHECK_FALSE(decode_record("{", &back, &err));
  CHECK_THAT(err, Catch::Contains("not JSON"));
  CHECK_FALSE(decode_record(R"({"epoch":0,"generation":0,"restore_step":null,"leader":0,
                               "leader_revision":0,"members":[]})",
                            &back, &err));
  CHECK_THAT(err, Catch::Contains("epoch (>= 1)"));
  CHECK_FALSE(decode_record(R"({"epoch":1,"generation":0,"restore_step":"x","leader":0,
                               "leader_revision":0,"members":[]})",
                            &back, &err));
  CHECK_THAT(err, Catch::Contains("restore_step"));
  CHECK_FALSE(decode_record(R"({"epoch":1,"generation":0,"restore_step":null,"leader":0,
                               "leader_revision":0,"members":[{"id":5000,"incarnation":"1"}]})",
                            &back, &err));
  CHECK_THAT(err, Catch::Contains("\"id\" (0..1023)"));
  CHECK_FALSE(decode_record(R"({"epoch":1,"generation":0,"restore_step":null,"leader":0,
                               "leader_revision":0,"members":[{"id":1,"incarnation":"1"},
                               {"id":1,"incarnation":"2"}]})",
                            &back, &err));
  CHECK_THAT(err, Catch::Contains("appears twice"));
  Record old;  // `back` is checked again below
  // restore_points: one step per generation; a record of the older form (only
  // generation_step) decides as that form did; a generation beyond the bound is refused.
  for (const char* bad :
       {R"("generation":2,"restore_points":[5])", R"("generation":1,"restore_points":[-5])",
        R"("generation":1,"restore_points":"5")"}) {
    INFO(bad);
    CHECK_FALSE(decode_record(std::string(R"({"epoch":1,"restore_step":null,"leader":0,)") +
                                  R"("leader_revision":0,"members":[],)" + bad + "}",
                              &old, &err));
    CHECK_THAT(err, Catch::Contains("restore_points must be an array of"));
  }
  REQUIRE(decode_record(R"({"epoch":1,"generation":2,"restore_step":9,"generation_step":9,
                            "leader":0,"leader_revision":0,"members":[]})",
                        &old, &err));
  CHECK(old.restore_points == std::vector<uint64_t>{9, 9});
  CHECK_FALSE(decode_record(R"({"epoch":1,"generation":4097,"restore_step":9,
                                "generation_step":9,"leader":0,"leader_revision":0,
                                "members":[]})",
                            &old, &err));
  CHECK_THAT(err, Catch::Contains("generation 4097 is above 4096"));
  MemberInfo m{4, 99, 1234, 3.5f, "abcd"}, mb;
  REQUIRE(decode_member(encode_member(m), &mb, &err));
  CHECK(mb.id == 4);
  CHECK(mb.incarnation == 99);
  CHECK(mb.lease == 1234);
  CHECK(mb.job == "abcd");
  const board::AgreedRecord b = to_board(back, 4);
  CHECK(b.epoch == 7);
  CHECK(b.n_nodes == 4);
  CHECK(board::member_count(b) == 3);
}

TEST_CASE("accrual: a regular stream is never suspected; silence is; load widens the margin",
          "[snapshot][accrual]") {
  AccrualDetector::Config c;
  c.period = kPeriod;
  AccrualDetector d(c);
  ManualClock clk;
  CHECK_FALSE(d.suspected(clk.now()));  // never heard: not suspected
  for (int i = 0; i < 50; ++i) {
    d.heard(clk.now());
    clk.advance(kPeriod);
  }
  CHECK(d.phi(clk.now()) < 1);
  clk.advance(2 * kPeriod);  // 3 periods of silence in all: not yet (the floor)
  CHECK_FALSE(d.suspected(clk.now()));
  clk.advance(2 * kPeriod);
  CHECK(d.suspected(clk.now()));
  d.heard(clk.now());
  CHECK_FALSE(d.suspected(clk.now()));
  // A loaded stream (intervals 50..350 ms): a 500 ms gap is not enough to suspect it, where it
  // is for the regular stream.
  AccrualDetector loaded(c), regular(c);
  ManualClock a, b;
  for (int i = 0; i < 100; ++i) {
    loaded.heard(a.now());
    a.advance((i % 2 ? 350 : 50) * kUsPerMs);
    regular.heard(b.now());
    b.advance(kPeriod);
  }
  a.advance(500 * kUsPerMs - 50 * kUsPerMs);
  b.advance(500 * kUsPerMs - kPeriod);
  CHECK(loaded.phi(a.now()) < regular.phi(b.now()));
  CHECK_FALSE(loaded.suspected(a.now()));
  CHECK(regular.suspected(b.now()));
}
