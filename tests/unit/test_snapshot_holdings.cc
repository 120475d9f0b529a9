// What a daemon holds, by chain (Holdings): held in full only with every buffer's whole chain;
// the chain served for a restore; shard descriptions validated; topology and replica placement.
#include <catch2/catch.hpp>

#include "r2ccl/snapshot/holdings.h"

using namespace r2ccl;
using namespace r2ccl::snap;

namespace {

// Rank `rank`'s shard of `buffer` at `step`, in a chain whose base is at base_step/base_seq.
ShardMeta shard(uint32_t rank, uint32_t buffer, uint64_t step, uint64_t base_step, uint64_t seq,
                uint64_t base_seq, uint32_t n_buffers = 2, uint32_t world = 4, uint32_t home = 1) {
  ShardMeta m{};
  m.rank = rank;
  m.buffer = buffer;
  m.n_buffers = n_buffers;
  m.world = world;
  m.home_node = home;
  m.step = step;
  m.base_step = base_step;
  m.seq = seq;
  m.base_seq = base_seq;
  m.payload_bytes = 100;
  return m;
}

}  // namespace

TEST_CASE("holdings: held in full needs every buffer and each buffer's whole chain", "[snapshot]") {
  Holdings h;
  // Snapshots every 10 steps; base at step 10 (seq 0), deltas at 20 (seq 1), 30 (seq 2).
  CHECK_FALSE(h.add(shard(0, 0, 10, 10, 0, 0)));  // buffer 1 still missing
  CHECK_FALSE(h.held_in_full(0, 10));
  CHECK(h.add(shard(0, 1, 10, 10, 0, 0)));  // now every buffer: newly held in full
  CHECK(h.held_in_full(0, 10));
  CHECK_FALSE(h.add(shard(0, 1, 10, 10, 0, 0)));  // again: not "newly"
  // Step 30 arrives without step 20: its chain has a hole.
  h.add(shard(0, 0, 30, 10, 2, 0));
  h.add(shard(0, 1, 30, 10, 2, 0));
  CHECK_FALSE(h.held_in_full(0, 30));
  CHECK(h.chain(0, 0, 30).empty());
  h.add(shard(0, 0, 20, 10, 1, 0));
  CHECK_FALSE(h.held_in_full(0, 30));  // buffer 1's chain still has the hole
  h.add(shard(0, 1, 20, 10, 1, 0));
  CHECK(h.held_in_full(0, 30));
  CHECK(h.held_in_full(0, 20));
  CHECK(h.chain(0, 1, 30) == std::vector<uint64_t>{10, 20, 30});
  CHECK(h.chain(0, 1, 20) == std::vector<uint64_t>{10, 20});
  CHECK(h.newest_step() == 30);
  // Losing the base breaks every step of the chain.
  h.remove(ShardKey{0, 10, 0});
  CHECK_FALSE(h.held_in_full(0, 10));
  CHECK_FALSE(h.held_in_full(0, 30));
  CHECK(h.chain(0, 0, 30).empty());
  CHECK(h.chain(0, 1, 30) == std::vector<uint64_t>{10, 20, 30});
}

TEST_CASE("holdings: a new base starts a new chain; older chains do not count", "[snapshot]") {
  Holdings h;
  h.add(shard(2, 0, 10, 10, 0, 0, 1));
  h.add(shard(2, 0, 20, 10, 1, 0, 1));
  h.add(shard(2, 0, 30, 30, 2, 2, 1));  // a base (K reached)
  h.add(shard(2, 0, 40, 30, 3, 2, 1));
  CHECK(h.chain(2, 0, 40) == std::vector<uint64_t>{30, 40});
  CHECK(h.chain(2, 0, 20) == std::vector<uint64_t>{10, 20});
  // Only the last chain left (after a prune): still held.
  h.retain({ShardInfo{ShardKey{2, 30, 0}}, ShardInfo{ShardKey{2, 40, 0}}});
  CHECK(h.held_in_full(2, 40));
  CHECK_FALSE(h.held_in_full(2, 20));
  CHECK(h.size() == 2);
  const auto full = h.full_steps();
  REQUIRE(full.size() == 2);
  CHECK(full[0].step == 30);
  CHECK(full[1].step == 40);
  CHECK(full[1].world == 4);
  CHECK(h.full_steps(40).size() == 1);
  ShardMeta d;
  REQUIRE(h.describe(ShardKey{2, 40, 0}, &d));
  CHECK(d.seq == 3);
  CHECK(d.base_seq == 2);
  CHECK(d.base_step == 30);
  CHECK(d.home_node == 1);
  CHECK_FALSE(h.describe(ShardKey{2, 20, 0}, &d));
  CHECK(h.all().size() == 2);
}

TEST_CASE("holdings: shard descriptions are validated with the field named", "[snapshot]") {
  std::string err;
  CHECK(Holdings::valid(shard(0, 0, 10, 10, 0, 0), &err));
  CHECK(Holdings::valid(shard(0, 1, 20, 10, 5, 4), &err));
  struct Bad {
    ShardMeta m;
    const char* needle;
  };
  const Bad bad[] = {
      {shard(4, 0, 10, 10, 0, 0), "rank 4 of world 4"},
      {shard(0, 0, 10, 10, 0, 0, 2, 0), "world 0"},
      {shard(0, 2, 10, 10, 0, 0), "buffer 2 of n_buffers 2"},
      {shard(0, 0, 10, 11, 0, 0), "base step 11"},
      {shard(0, 0, 10, 10, 1, 0), "a base has step == base_step and seq == base_seq"},
      {shard(0, 0, 20, 10, 0, 0), "a base has step == base_step"},
      {shard(0, 0, 10, 10, 0, 0, 2, 4, 5000), "home node 5000"},
  };
  for (const auto& b : bad) {
    INFO(b.needle);
    err.clear();
    CHECK_FALSE(Holdings::valid(b.m, &err));
    CHECK_THAT(err, Catch::Contains(b.needle));
  }
}

TEST_CASE("topology: hops by the deepest common switch; malformed lines named", "[snapshot]") {
  std::map<uint32_t, std::vector<std::string>> t;
  std::string err;
  REQUIRE(
      parse_topology("# pods\n0 spine0/leaf0\n1 spine0/leaf0\n2 spine0/leaf1  # other leaf\n"
                     "3 spine1/leaf2\n\n",
                     &t, &err));
  CHECK(topology_hops(t, 0, 1) == 2);  // one leaf
  CHECK(topology_hops(t, 0, 2) == 4);  // leaf, spine, leaf
  CHECK(topology_hops(t, 0, 3) == 6);  // across the top
  CHECK(topology_hops(t, 0, 9) > 6);   // not in the file: farthest
  for (const char* bad : {"0\n", "x spine/leaf\n", "0 a//b\n", "0 a\n0 b\n", "2000 a\n"}) {
    INFO(bad);
    CHECK_FALSE(parse_topology(bad, &t, &err));
    CHECK_THAT(err, Catch::Contains("topology line"));
  }
}

TEST_CASE("replicas: nearest by hops, then round trip, then id; never the home node",
          "[snapshot]") {
  std::map<uint32_t, std::vector<std::string>> t;
  std::string err;
  REQUIRE(parse_topology("0 s0/l0\n1 s0/l0\n2 s0/l1\n3 s1/l2\n4 s0/l0\n", &t, &err));
  const std::vector<uint32_t> live{0, 1, 2, 3, 4};
  std::map<uint32_t, int64_t> rtt{{1, 900}, {2, 50}, {3, 10}, {4, 100}};
  CHECK(choose_replicas(0, live, t, rtt, 3) == std::vector<uint32_t>{4, 1, 2});
  CHECK(choose_replicas(0, live, {}, rtt, 3) == std::vector<uint32_t>{3, 2, 4});  // by RTT
  CHECK(choose_replicas(0, live, {}, {}, 3) == std::vector<uint32_t>{1, 2, 3});   // by id
  CHECK(choose_replicas(0, {0, 2}, t, rtt, 3) == std::vector<uint32_t>{2});       // fewer live
  CHECK(choose_replicas(0, {0}, t, rtt, 3).empty());
}
