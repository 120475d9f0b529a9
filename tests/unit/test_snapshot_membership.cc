// Snapshot daemon membership: peer lists, heartbeat failure detection (3 missed periods), the
// coordinator rule (lowest live id, acts only with a strict majority) and the agreed record.
#include <catch2/catch.hpp>

#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/membership.h"

using namespace r2ccl;
using namespace r2ccl::snap;

namespace {
constexpr TimeUs kPeriod = 100 * kUsPerMs;
}

TEST_CASE("peer list: parsed, and every malformed line named", "[snapshot]") {
  std::vector<PeerSpec> p;
  std::string err;
  REQUIRE(parse_peers("# job 7\n0 10.0.0.1:7000\n 2 node-b:7000  # comment\n\n5 [fe80::1]:7001\n",
                      &p, &err));
  REQUIRE(p.size() == 3);
  CHECK((p[0].id == 0 && p[0].host == "10.0.0.1" && p[0].port == 7000));
  CHECK((p[1].id == 2 && p[1].host == "node-b"));
  CHECK((p[2].id == 5 && p[2].host == "fe80::1" && p[2].port == 7001));
  struct Bad {
    const char* text;
    const char* needle;
  } bad[] = {
      {"0 10.0.0.1\n", "line 1"},
      {"0 10.0.0.1:0\n", "malformed"},
      {"0 10.0.0.1:70000\n", "malformed"},
      {"x 10.0.0.1:7000\n", "malformed"},
      {"1024 10.0.0.1:7000\n", "malformed"},
      {"0 a:1\n0 b:1\n", "node id 0 appears twice"},
      {"0 a:1\n1 a:1\n", "address a:1 appears twice"},
      {"0 fe80::1:7000\n", "needs brackets"},
      {"0\n", "no address"},
      {"# nothing\n", "no node"},
  };
  for (const auto& b : bad) {
    INFO(b.text);
    CHECK_FALSE(parse_peers(b.text, &p, &err));
    CHECK_THAT(err, Catch::Contains(b.needle));
  }
}

TEST_CASE("membership: 3 missed heartbeats fail a node; the lowest live id coordinates",
          "[snapshot]") {
  TimeUs now = 1000 * kUsPerSec;
  Membership m(2, {0, 1, 2, 3}, kPeriod, now);
  // Alone at the start: its own coordinator, but without a majority it does not act.
  CHECK(m.live() == std::vector<uint32_t>{2});
  CHECK(m.coordinator() == 2);
  CHECK_FALSE(m.acts_as_coordinator());
  CHECK(m.tick(now + 10 * kPeriod).empty());  // never-heard peers are not "failed"
  for (uint32_t id : {0u, 1u, 3u}) m.on_heard(id, now);
  CHECK(m.coordinator() == 0);
  CHECK_FALSE(m.acts_as_coordinator());
  const uint64_t e0 = m.epoch();
  // Nodes 1 and 3 keep talking, node 0 goes silent.
  for (int i = 1; i <= 3; ++i) {
    now += kPeriod;
    m.on_heard(1, now);
    m.on_heard(3, now);
    CHECK(m.tick(now).empty());  // at most 3 periods of silence: still live
  }
  now += kPeriod / 2;
  m.on_heard(1, now);
  m.on_heard(3, now);
  auto failed = m.tick(now);
  REQUIRE(failed == std::vector<uint32_t>{0});
  CHECK(m.epoch() == e0 + 1);
  CHECK(m.live() == std::vector<uint32_t>{1, 2, 3});
  CHECK(m.coordinator() == 1);
  CHECK(m.has_majority());
  // Declared once, not at every tick.
  CHECK(m.tick(now + 1).empty());
  // Node 0 comes back (restarted daemon): live again, new epoch, coordinator again.
  m.on_heard(0, now + 2);
  CHECK(m.alive(0));
  CHECK(m.epoch() == e0 + 2);
  CHECK(m.coordinator() == 0);
  CHECK_FALSE(m.on_heard(9, now));  // not in the job
}

TEST_CASE("membership: a partition never has two acting coordinators", "[snapshot]") {
  const std::vector<uint32_t> ids{0, 1, 2, 3, 4};
  for (uint32_t cut = 1; cut < 5; ++cut) {
    // Nodes below `cut` on one side, the rest on the other; everyone hears only its side.
    TimeUs now = 1000 * kUsPerSec;
    std::vector<Membership> ms;
    for (uint32_t id : ids) ms.emplace_back(id, ids, kPeriod, now);
    for (int i = 0; i < 6; ++i) {
      now += kPeriod;
      for (auto& m : ms)
        for (uint32_t id : ids)
          if ((id < cut) == (m.self() < cut)) m.on_heard(id, now);
      for (auto& m : ms) m.tick(now);
    }
    int acting = 0;
    for (auto& m : ms) acting += m.acts_as_coordinator();
    INFO("partition at " << cut);
    CHECK(acting == 1);  // 5 nodes: exactly one side has a majority
    for (auto& m : ms)
      if (m.acts_as_coordinator()) CHECK(m.self() == (cut >= 3 ? 0u : cut));
  }
  // 4 nodes split 2 | 2: no side has a strict majority, nobody acts.
  TimeUs now = 1000 * kUsPerSec;
  std::vector<Membership> ms;
  for (uint32_t id = 0; id < 4; ++id)
    ms.emplace_back(id, std::vector<uint32_t>{0, 1, 2, 3}, kPeriod, now);
  for (int i = 0; i < 6; ++i) {
    now += kPeriod;
    for (auto& m : ms)
      for (uint32_t id = 0; id < 4; ++id)
        if ((id < 2) == (m.self() < 2)) m.on_heard(id, now);
    for (auto& m : ms) m.tick(now);
  }
  for (auto& m : ms) CHECK_FALSE(m.acts_as_coordinator());
}

TEST_CASE("membership: the agreed record carries epoch, members and bandwidth", "[snapshot]") {
  TimeUs now = 1000 * kUsPerSec;
  Membership m(0, {0, 1, 70}, kPeriod, now);
  m.on_heard(1, now);
  m.on_heard(70, now);
  now += 4 * kPeriod;
  m.on_heard(70, now);
  m.tick(now);  // node 1 failed
  const board::AgreedRecord r = m.agreed_record({25.0f, 12.5f});
  CHECK(r.epoch == m.epoch());
  CHECK(r.n_nodes == 71);
  CHECK(board::member_count(r) == 2);
  CHECK((r.members[0] & 1ULL) != 0);
  CHECK((r.members[0] & 2ULL) == 0);
  CHECK((r.members[1] & (1ULL << 6)) != 0);
  CHECK(r.node_usable_gbps[0] == 25.0f);
  CHECK(r.node_usable_gbps[1] == 0.0f);   // not a member
  CHECK(r.node_usable_gbps[70] == 0.0f);  // unknown
  CHECK(board::agreed_record_consistent(r));
}

TEST_CASE("membership: a starting node listens 3 periods before it acts", "[snapshot]") {
  // Three daemons started together; node 0's first heartbeat reaches node 1 late (after node
  // 2's). Node 1 must not act for {1, 2} in the meantime: two records of one epoch would race.
  TimeUs now = 1000 * kUsPerSec;
  Membership m(1, {0, 1, 2}, kPeriod, now);
  m.on_heard(2, now + kPeriod / 10);
  m.tick(now + kPeriod);
  CHECK(m.coordinator() == 1);
  CHECK(m.has_majority());
  CHECK_FALSE(m.settled());
  CHECK_FALSE(m.acts_as_coordinator());  // a majority, but still listening
  m.on_heard(0, now + 2 * kPeriod);      // late, within the listening time
  m.on_heard(2, now + 2 * kPeriod);
  m.tick(now + 2 * kPeriod);
  CHECK_FALSE(m.acts_as_coordinator());
  m.on_heard(0, now + 3 * kPeriod);
  m.on_heard(2, now + 3 * kPeriod);
  m.tick(now + 3 * kPeriod);
  CHECK(m.settled());
  CHECK(m.coordinator() == 0);
  CHECK_FALSE(m.acts_as_coordinator());  // node 0 coordinates
  // Node 0, started at the same time, acts once settled.
  Membership z(0, {0, 1, 2}, kPeriod, now);
  z.on_heard(1, now + kPeriod);
  z.tick(now + 2 * kPeriod);
  CHECK_FALSE(z.acts_as_coordinator());
  z.on_heard(1, now + 3 * kPeriod);
  z.tick(now + 3 * kPeriod);
  CHECK(z.acts_as_coordinator());
  // A peer that never spoke during the listening time is simply not a member: node 1 alone
  // with node 2 acts after 3 periods.
  Membership w(1, {0, 1, 2}, kPeriod, now);
  for (int i = 1; i <= 3; ++i) {
    w.on_heard(2, now + i * kPeriod);
    w.tick(now + i * kPeriod);
  }
  CHECK(w.acts_as_coordinator());
  CHECK(w.live() == std::vector<uint32_t>{1, 2});
}
