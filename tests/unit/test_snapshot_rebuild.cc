// Communicator rebuild and the recovery hint: plan decisions across NCCL versions (2.26 vs
// 2.27, ncclCommShrink missing, a replacement joining), the driver over a fake NCCL (shrink,
// re-init with the id made by the lowest surviving rank, the id wait timing out, a failed
// shrink falling back to abort + re-init), NcclLibrary's loading (missing library, missing
// symbols, a resolver table of fake functions), the learning-rate hint's variables and the
// "Successfully recovered" line.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/snapshot/comm_rebuild.h"
#include "r2ccl/snapshot/recovery.h"

using namespace r2ccl;
using namespace r2ccl::snap;

namespace {

NcclUniqueId id_filled(unsigned char b) {
  NcclUniqueId id;
  std::memset(id.internal, b, sizeof(id.internal));
  return id;
}

bool same_id(const NcclUniqueId& a, const NcclUniqueId& b) {
  return std::memcmp(a.internal, b.internal, sizeof(a.internal)) == 0;
}

// A fake NCCL for one rank: records every call in order and fails on request.
class FakeCommOps final : public CommOps {
 public:
  explicit FakeCommOps(int old_rank, bool shrink = true) : old_rank_(old_rank), shrink_(shrink) {}

  ncclResult_t get_version(int* v) override {
    calls.push_back("version");
    *v = nccl_version_code(2, 27, 5);
    return ncclSuccess;
  }
  ncclResult_t get_unique_id(NcclUniqueId* id) override {
    calls.push_back("unique_id");
    if (fail_unique_id != ncclSuccess) return fail_unique_id;
    *id = id_filled(static_cast<unsigned char>(0xA0 + old_rank_));  // says who made it
    return ncclSuccess;
  }
  ncclResult_t comm_init_rank(void** comm, int nranks, const NcclUniqueId& id, int rank) override {
    calls.push_back("init " + std::to_string(rank) + "/" + std::to_string(nranks));
    init_id = id;
    if (fail_init != ncclSuccess) return fail_init;
    *comm = &new_comm;
    return ncclSuccess;
  }
  bool has_shrink() const override { return shrink_; }
  ncclResult_t comm_shrink(void* comm, const std::vector<int>& exclude, void** newcomm,
                           int flags) override {
    std::string s = "shrink";
    for (int r : exclude) s += " " + std::to_string(r);
    s += " flags " + std::to_string(flags);
    calls.push_back(s);
    shrunk_parent = comm;
    if (fail_shrink != ncclSuccess) return fail_shrink;
    *newcomm = &new_comm;
    return ncclSuccess;
  }
  ncclResult_t comm_abort(void* comm) override {
    calls.push_back(comm == &old_comm ? "abort old" : "abort other");
    return fail_abort;
  }
  ncclResult_t comm_destroy(void* comm) override {
    calls.push_back(comm == &old_comm ? "destroy old" : "destroy other");
    return ncclSuccess;
  }
  std::string error_string(ncclResult_t r) override {
    return "fake error " + std::to_string(static_cast<int>(r));
  }

  int old_comm = 0;  // its address is this rank's old communicator
  int new_comm = 0;  // its address is the new one
  std::vector<std::string> calls;
  NcclUniqueId init_id{};
  void* shrunk_parent = nullptr;
  ncclResult_t fail_unique_id = ncclSuccess;
  ncclResult_t fail_init = ncclSuccess;
  ncclResult_t fail_shrink = ncclSuccess;
  ncclResult_t fail_abort = ncclSuccess;

 private:
  int old_rank_;
  bool shrink_;
};

// In-memory id exchange shared by the ranks (threads) of a test.
class MemExchange final : public UniqueIdExchange {
 public:
  bool publish(const std::string& key, const NcclUniqueId& id, std::string* err) override {
    std::lock_guard<std::mutex> lk(mu_);
    ++publishes;
    if (refuse_publish) {
      *err = "store refused";
      return false;
    }
    ids_[key] = id;
    cv_.notify_all();
    return true;
  }
  Wait wait(const std::string& key, TimeUs timeout_us, NcclUniqueId* id,
            std::string* err) override {
    std::unique_lock<std::mutex> lk(mu_);
    ++waits;
    last_timeout_us = timeout_us;
    if (!cv_.wait_for(lk, std::chrono::microseconds(timeout_us),
                      [&] { return ids_.count(key) > 0; })) {
      *err = "nothing under " + key;
      return Wait::kTimeout;
    }
    *id = ids_[key];
    return Wait::kOk;
  }
  std::vector<std::string> keys() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::string> k;
    for (auto& e : ids_) k.push_back(e.first);
    return k;
  }

  int publishes = 0;
  int waits = 0;
  TimeUs last_timeout_us = 0;
  bool refuse_publish = false;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, NcclUniqueId> ids_;
};

RebuildPlan must_plan(int version, bool sym, int n, std::vector<int> lost,
                      std::vector<int> replaced = {}) {
  RebuildPlan p;
  std::string err;
  if (!plan_rebuild(version, sym, n, lost, replaced, &p, &err)) FAIL(err);
  return p;
}

constexpr int k2265 = nccl_version_code(2, 26, 5);
constexpr int k2270 = nccl_version_code(2, 27, 0);
constexpr int k2289 = nccl_version_code(2, 28, 9);

}  // namespace

// ---------------------------------------------------------------------------------------------
// Plan

TEST_CASE("rebuild plan: NCCL versions, the shrink symbol and replacements decide the mode",
          "[snapshot][rebuild]") {
  CHECK(nccl_version_code(2, 27, 0) == 22700);
  CHECK(nccl_version_string(22705) == "2.27.5");
  CHECK(nccl_version_string(2804) == "2.8.4");  // the pre-2.9 encoding
  CHECK(nccl_version_string(0) == "unknown");

  SECTION("2.27 with the symbol and no replacement: shrink, renumbered like NCCL does") {
    RebuildPlan p = must_plan(k2270, true, 8, {5, 2});
    CHECK(p.mode == RebuildMode::kShrink);
    CHECK(p.lost == std::vector<int>{2, 5});
    CHECK(p.new_rank == std::vector<int>{0, 1, -1, 2, 3, -1, 4, 5});
    CHECK(p.new_nranks == 6);
    CHECK(p.id_root == 0);
    CHECK(p.shrink_flags == kNcclShrinkAbort);
    CHECK_THAT(p.reason, Catch::Contains("2.27.0"));
  }
  SECTION("2.26 has no shrink even if a symbol of that name were found") {
    RebuildPlan p = must_plan(k2265, true, 8, {2});
    CHECK(p.mode == RebuildMode::kReinit);
    CHECK_THAT(p.reason, Catch::Contains("2.26.5") && Catch::Contains("2.27 or later"));
    CHECK(p.new_rank == std::vector<int>{0, 1, -1, 2, 3, 4, 5, 6});
  }
  SECTION("2.27 without the symbol: re-init") {
    RebuildPlan p = must_plan(k2289, false, 4, {3});
    CHECK(p.mode == RebuildMode::kReinit);
    CHECK_THAT(p.reason, Catch::Contains("does not export ncclCommShrink"));
  }
  SECTION("unknown version: re-init") {
    CHECK(must_plan(0, true, 4, {3}).mode == RebuildMode::kReinit);
    CHECK(must_plan(2804, true, 4, {3}).mode == RebuildMode::kReinit);
  }
  SECTION("a replacement joining forces a re-init and takes the lost rank's place") {
    RebuildPlan p = must_plan(k2289, true, 8, {2, 5}, {2});
    CHECK(p.mode == RebuildMode::kReinit);
    CHECK_THAT(p.reason, Catch::Contains("replacement"));
    CHECK(p.replaced == std::vector<int>{2});
    CHECK(p.new_rank == std::vector<int>{0, 1, 2, 3, 4, -1, 5, 6});
    CHECK(p.new_nranks == 7);
    // Every lost rank replaced: every rank keeps its number.
    RebuildPlan q = must_plan(k2289, true, 4, {0, 3}, {3, 0});
    CHECK(q.new_rank == std::vector<int>{0, 1, 2, 3});
    CHECK(q.new_nranks == 4);
    CHECK(q.id_root == 1);  // the lowest SURVIVING rank, not the replacement of rank 0
  }
  SECTION("rank 0 lost: the id root is the lowest survivor") {
    RebuildPlan p = must_plan(k2265, false, 5, {0, 1});
    CHECK(p.id_root == 2);
    CHECK(p.new_rank[2] == 0);
  }
}

TEST_CASE("rebuild plan: bad inputs are refused, naming the rank", "[snapshot][rebuild]") {
  RebuildPlan p;
  p.reason = "untouched";
  std::string err;
  struct Bad {
    int n;
    std::vector<int> lost, replaced;
    const char* needle;
  } bad[] = {
      {0, {0}, {}, "0 ranks"},
      {4, {4}, {}, "lost rank 4 is outside the old communicator (ranks 0..3)"},
      {4, {-1}, {}, "lost rank -1 is outside"},
      {4, {1, 1}, {}, "lost rank 1 is listed twice"},
      {4, {1}, {2}, "replaced rank 2 was not lost"},
      {4, {1}, {1, 1}, "replaced rank 1 is listed twice"},
      {4, {}, {}, "no rank was lost"},
      {3, {0, 1, 2}, {0}, "every rank of the old communicator was lost"},
  };
  for (const Bad& b : bad) {
    INFO(b.needle);
    CHECK_FALSE(plan_rebuild(k2289, true, b.n, b.lost, b.replaced, &p, &err));
    CHECK_THAT(err, Catch::Contains(b.needle));
    CHECK(p.reason == "untouched");
  }
}

// ---------------------------------------------------------------------------------------------
// Driver

TEST_CASE("rebuild: shrink path excludes the lost ranks, then aborts the parent",
          "[snapshot][rebuild]") {
  RebuildPlan plan = must_plan(k2270, true, 4, {1});
  MemExchange ids;
  RebuildOptions opt;
  opt.epoch = 9;
  for (int old_rank : {0, 2, 3}) {
    INFO("old rank " << old_rank);
    FakeCommOps ops(old_rank);
    RebuildOutcome out;
    std::string err;
    REQUIRE(rebuild_communicator(ops, plan, old_rank, &ops.old_comm, ids, opt, &out, &err) ==
            RebuildStatus::kOk);
    CHECK(ops.calls == std::vector<std::string>{"shrink 1 flags 1", "abort old"});
    CHECK(ops.shrunk_parent == &ops.old_comm);
    CHECK(out.comm == &ops.new_comm);
    CHECK(out.mode == RebuildMode::kShrink);
    CHECK_FALSE(out.fell_back);
    CHECK(out.rank == (old_rank == 0 ? 0 : old_rank - 1));
    CHECK(out.nranks == 3);
    CHECK(out.note.empty());
  }
  CHECK(ids.publishes == 0);
  CHECK(ids.waits == 0);

  SECTION("NCCL_SHRINK_DEFAULT (nothing outstanding): the parent is destroyed, not aborted") {
    plan.shrink_flags = kNcclShrinkDefault;
    FakeCommOps ops(0);
    RebuildOutcome out;
    std::string err;
    REQUIRE(rebuild_communicator(ops, plan, 0, &ops.old_comm, ids, opt, &out, &err) ==
            RebuildStatus::kOk);
    CHECK(ops.calls == std::vector<std::string>{"shrink 1 flags 0", "destroy old"});
  }
  SECTION("a failed release of the parent is noted, the new communicator kept") {
    FakeCommOps ops(0);
    ops.fail_abort = ncclInternalError;
    RebuildOutcome out;
    std::string err;
    REQUIRE(rebuild_communicator(ops, plan, 0, &ops.old_comm, ids, opt, &out, &err) ==
            RebuildStatus::kOk);
    CHECK(out.comm == &ops.new_comm);
    CHECK_THAT(out.note, Catch::Contains("ncclCommAbort failed: fake error 3"));
  }
}

TEST_CASE("rebuild: re-init with a replacement; the lowest survivor makes the id, all use it",
          "[snapshot][rebuild]") {
  // 4 ranks; ranks 0 and 2 lost, a replacement takes over rank 2. The id root is rank 1.
  RebuildPlan plan = must_plan(k2289, true, 4, {0, 2}, {2});
  REQUIRE(plan.id_root == 1);
  MemExchange ids;
  RebuildOptions opt;
  opt.epoch = 7;
  opt.id_timeout_us = 10 * kUsPerSec;
  FakeCommOps survivor1(1), replacement2(2), survivor3(3);
  RebuildOutcome out1, out2, out3;
  std::string err1, err2, err3;
  RebuildStatus s2 = RebuildStatus::kInvalidArgument, s3 = RebuildStatus::kInvalidArgument;
  // The waiting ranks start first and block in the exchange until the root publishes.
  std::thread t2(
      [&] { s2 = rebuild_communicator(replacement2, plan, 2, nullptr, ids, opt, &out2, &err2); });
  std::thread t3([&] {
    s3 = rebuild_communicator(survivor3, plan, 3, &survivor3.old_comm, ids, opt, &out3, &err3);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  RebuildStatus s1 =
      rebuild_communicator(survivor1, plan, 1, &survivor1.old_comm, ids, opt, &out1, &err1);
  t2.join();
  t3.join();
  INFO(err1 << " | " << err2 << " | " << err3);
  REQUIRE(s1 == RebuildStatus::kOk);
  REQUIRE(s2 == RebuildStatus::kOk);
  REQUIRE(s3 == RebuildStatus::kOk);

  CHECK(survivor1.calls == std::vector<std::string>{"abort old", "unique_id", "init 0/3"});
  CHECK(replacement2.calls == std::vector<std::string>{"init 1/3"});  // nothing to abort
  CHECK(survivor3.calls == std::vector<std::string>{"abort old", "init 2/3"});
  const NcclUniqueId root_id = id_filled(0xA1);  // made by old rank 1's NCCL
  CHECK(same_id(survivor1.init_id, root_id));
  CHECK(same_id(replacement2.init_id, root_id));
  CHECK(same_id(survivor3.init_id, root_id));
  CHECK(ids.publishes == 1);
  CHECK(ids.waits == 2);
  CHECK(ids.last_timeout_us == 10 * kUsPerSec);
  CHECK(ids.keys() == std::vector<std::string>{"r2ccl.rebuild.e7"});
  for (RebuildOutcome* o : {&out1, &out2, &out3}) {
    CHECK(o->mode == RebuildMode::kReinit);
    CHECK(o->nranks == 3);
    CHECK_FALSE(o->fell_back);
  }
  CHECK(out1.rank == 0);
  CHECK(out2.rank == 1);
  CHECK(out3.rank == 2);
  CHECK(out2.comm == &replacement2.new_comm);
}

TEST_CASE("rebuild: rank 0 replaced: the id comes from old rank 1, the replacement waits",
          "[snapshot][rebuild]") {
  RebuildPlan plan = must_plan(k2289, true, 3, {0}, {0});
  MemExchange ids;
  RebuildOptions opt;
  opt.epoch = 2;
  opt.id_timeout_us = 10 * kUsPerSec;
  FakeCommOps rep0(0), sur1(1), sur2(2);
  RebuildOutcome o0, o1, o2;
  std::string e0, e1, e2;
  RebuildStatus s0 = RebuildStatus::kInvalidArgument;
  std::thread t0([&] { s0 = rebuild_communicator(rep0, plan, 0, nullptr, ids, opt, &o0, &e0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  RebuildStatus s1 = rebuild_communicator(sur1, plan, 1, &sur1.old_comm, ids, opt, &o1, &e1);
  RebuildStatus s2 = rebuild_communicator(sur2, plan, 2, &sur2.old_comm, ids, opt, &o2, &e2);
  t0.join();
  INFO(e0 << " | " << e1 << " | " << e2);
  REQUIRE((s0 == RebuildStatus::kOk && s1 == RebuildStatus::kOk && s2 == RebuildStatus::kOk));
  CHECK(rep0.calls == std::vector<std::string>{"init 0/3"});
  CHECK(sur1.calls == std::vector<std::string>{"abort old", "unique_id", "init 1/3"});
  CHECK(sur2.calls == std::vector<std::string>{"abort old", "init 2/3"});
  CHECK(same_id(rep0.init_id, id_filled(0xA1)));
  CHECK(same_id(sur2.init_id, id_filled(0xA1)));
}

TEST_CASE("rebuild: the id wait is bounded by its timeout", "[snapshot][rebuild]") {
  RebuildPlan plan = must_plan(k2265, false, 4, {0});  // root = old rank 1, which never comes
  MemExchange ids;
  RebuildOptions opt;
  opt.epoch = 3;
  opt.id_timeout_us = 30 * kUsPerMs;
  FakeCommOps ops(2);
  RebuildOutcome out;
  out.rank = -42;
  std::string err;
  const TimeUs t0 = now_us();
  RebuildStatus s = rebuild_communicator(ops, plan, 2, &ops.old_comm, ids, opt, &out, &err);
  const TimeUs took = now_us() - t0;
  CHECK(s == RebuildStatus::kIdTimeout);
  CHECK_THAT(err,
             Catch::Contains("no unique id under r2ccl.rebuild.e3 from old rank 1 within 30 ms"));
  CHECK(took >= 30 * kUsPerMs);
  CHECK(took < 5 * kUsPerSec);
  CHECK(ops.calls == std::vector<std::string>{"abort old"});  // released, never initialised
  CHECK(out.rank == -42);                                     // untouched on failure
  CHECK(std::string(to_string(s)) == "unique id timeout");
}

TEST_CASE("rebuild: a failed shrink falls back to abort + re-init on every rank",
          "[snapshot][rebuild]") {
  RebuildPlan plan = must_plan(k2270, true, 4, {3});
  REQUIRE(plan.mode == RebuildMode::kShrink);
  MemExchange ids;
  RebuildOptions opt;
  opt.epoch = 11;
  opt.id_timeout_us = 10 * kUsPerSec;
  FakeCommOps r0(0), r1(1), r2(2);
  for (FakeCommOps* f : {&r0, &r1, &r2}) f->fail_shrink = ncclSystemError;
  RebuildOutcome o0, o1, o2;
  std::string e0, e1, e2;
  RebuildStatus s1 = RebuildStatus::kInvalidArgument, s2 = RebuildStatus::kInvalidArgument;
  std::thread t1([&] { s1 = rebuild_communicator(r1, plan, 1, &r1.old_comm, ids, opt, &o1, &e1); });
  std::thread t2([&] { s2 = rebuild_communicator(r2, plan, 2, &r2.old_comm, ids, opt, &o2, &e2); });
  RebuildStatus s0 = rebuild_communicator(r0, plan, 0, &r0.old_comm, ids, opt, &o0, &e0);
  t1.join();
  t2.join();
  INFO(e0 << " | " << e1 << " | " << e2);
  REQUIRE(s0 == RebuildStatus::kOk);
  REQUIRE(s1 == RebuildStatus::kOk);
  REQUIRE(s2 == RebuildStatus::kOk);
  CHECK(r0.calls ==
        std::vector<std::string>{"shrink 3 flags 1", "abort old", "unique_id", "init 0/3"});
  CHECK(r1.calls == std::vector<std::string>{"shrink 3 flags 1", "abort old", "init 1/3"});
  CHECK(r2.calls == std::vector<std::string>{"shrink 3 flags 1", "abort old", "init 2/3"});
  CHECK(same_id(r2.init_id, id_filled(0xA0)));
  CHECK(ids.keys() == std::vector<std::string>{"r2ccl.rebuild.e11.fallback"});
  for (RebuildOutcome* o : {&o0, &o1, &o2}) {
    CHECK(o->fell_back);
    CHECK(o->mode == RebuildMode::kReinit);
    CHECK_THAT(o->note, Catch::Contains("ncclCommShrink failed: fake error 2 (ncclResult_t 2)"));
  }

  SECTION("shrink planned but not available in the library at hand: same fallback") {
    FakeCommOps ops(0, /*shrink=*/false);
    MemExchange ids2;
    RebuildOutcome o;
    std::string e;
    REQUIRE(rebuild_communicator(ops, plan, 0, &ops.old_comm, ids2, opt, &o, &e) ==
            RebuildStatus::kOk);
    CHECK(ops.calls == std::vector<std::string>{"abort old", "unique_id", "init 0/3"});
    CHECK(o.fell_back);
    CHECK_THAT(o.note, Catch::Contains("not available"));
  }
  SECTION("a fallback whose id never comes times out and says what it fell back from") {
    FakeCommOps ops(1);
    ops.fail_shrink = ncclRemoteError;
    MemExchange empty;
    RebuildOptions quick = opt;
    quick.id_timeout_us = 10 * kUsPerMs;
    RebuildOutcome o;
    std::string e;
    CHECK(rebuild_communicator(ops, plan, 1, &ops.old_comm, empty, quick, &o, &e) ==
          RebuildStatus::kIdTimeout);
    CHECK_THAT(e, Catch::Contains("r2ccl.rebuild.e11.fallback") &&
                      Catch::Contains("after ncclCommShrink failed: fake error 6"));
  }
}

TEST_CASE("rebuild: NCCL and exchange failures are reported, bad calls refused untouched",
          "[snapshot][rebuild]") {
  RebuildPlan plan = must_plan(k2289, true, 4, {0, 2}, {2});  // re-init, root = old rank 1
  RebuildOptions opt;
  opt.id_timeout_us = 50 * kUsPerMs;
  RebuildOutcome out;
  std::string err;

  SECTION("ncclGetUniqueId fails on the root") {
    MemExchange ids;
    FakeCommOps ops(1);
    ops.fail_unique_id = ncclSystemError;
    CHECK(rebuild_communicator(ops, plan, 1, &ops.old_comm, ids, opt, &out, &err) ==
          RebuildStatus::kNcclError);
    CHECK_THAT(err, Catch::Contains("ncclGetUniqueId failed: fake error 2") &&
                        Catch::Contains("old rank 1"));
    CHECK(ids.publishes == 0);
  }
  SECTION("publishing fails") {
    MemExchange ids;
    ids.refuse_publish = true;
    FakeCommOps ops(1);
    CHECK(rebuild_communicator(ops, plan, 1, &ops.old_comm, ids, opt, &out, &err) ==
          RebuildStatus::kIdExchangeError);
    CHECK_THAT(err, Catch::Contains("store refused"));
  }
  SECTION("ncclCommInitRank fails") {
    MemExchange ids;
    FakeCommOps ops(1);
    ops.fail_init = ncclRemoteError;
    CHECK(rebuild_communicator(ops, plan, 1, &ops.old_comm, ids, opt, &out, &err) ==
          RebuildStatus::kNcclError);
    CHECK_THAT(err, Catch::Contains("ncclCommInitRank failed: fake error 6") &&
                        Catch::Contains("rank 0 of 3"));
  }
  SECTION("calls that do not fit the plan do nothing") {
    MemExchange ids;
    FakeCommOps ops(0);
    struct Bad {
      int old_rank;
      void* comm;
      TimeUs timeout;
      const char* needle;
    } bad[] = {
        {0, &ops.old_comm, opt.id_timeout_us, "was lost and is not replaced"},
        {2, &ops.old_comm, opt.id_timeout_us, "has no old communicator"},
        {3, nullptr, opt.id_timeout_us, "must pass its old communicator"},
        {4, &ops.old_comm, opt.id_timeout_us, "outside the old communicator"},
        {3, &ops.old_comm, 0, "timeout must be > 0"},
    };
    for (const Bad& b : bad) {
      INFO(b.needle);
      RebuildOptions o = opt;
      o.id_timeout_us = b.timeout;
      CHECK(rebuild_communicator(ops, plan, b.old_rank, b.comm, ids, o, &out, &err) ==
            RebuildStatus::kInvalidArgument);
      CHECK_THAT(err, Catch::Contains(b.needle));
    }
    RebuildPlan empty;
    CHECK(rebuild_communicator(ops, empty, 0, &ops.old_comm, ids, opt, &out, &err) ==
          RebuildStatus::kInvalidArgument);
    CHECK(ops.calls.empty());
    CHECK(ids.waits == 0);
    CHECK(out.comm == nullptr);
  }
}

// ---------------------------------------------------------------------------------------------
// NcclLibrary

// File-local (anonymous namespace): the unit suite's files share one executable, and another
// file has a fake_nccl of its own.
namespace {
namespace fake_nccl {
// A table of fake NCCL entry points with NCCL's C signatures, reached through the resolver.
int version = nccl_version_code(2, 27, 5);
ncclResult_t version_result = ncclSuccess;
int shrink_calls = 0;
std::vector<int> shrink_list;
void* shrink_config = reinterpret_cast<void*>(1);
int shrink_flags = -1;
NcclUniqueId init_id{};
int init_nranks = 0, init_rank_seen = -1;
int comm_obj = 0;

ncclResult_t get_version(int* v) {
  if (version_result != ncclSuccess) return version_result;
  *v = version;
  return ncclSuccess;
}
ncclResult_t get_unique_id(NcclUniqueId* id) {
  *id = id_filled(0x5A);
  return ncclSuccess;
}
ncclResult_t init_rank(void** comm, int nranks, NcclUniqueId id, int rank) {  // id by value
  init_id = id;
  init_nranks = nranks;
  init_rank_seen = rank;
  *comm = &comm_obj;
  return ncclSuccess;
}
ncclResult_t abort_comm(void*) { return ncclSuccess; }
ncclResult_t destroy_comm(void*) { return ncclSuccess; }
const char* error_string(ncclResult_t r) {
  return r == ncclSystemError ? "fake system error" : "fake";
}
ncclResult_t shrink(void* comm, int* list, int count, void** newcomm, void* config, int flags) {
  ++shrink_calls;
  shrink_list.assign(list, list + count);
  shrink_config = config;
  shrink_flags = flags;
  *newcomm = comm == &comm_obj ? &comm_obj + 1 : nullptr;
  return ncclSuccess;
}

NcclLibrary::Resolver table(std::vector<std::string> missing) {
  return [missing](const char* name) -> void* {
    for (const std::string& m : missing)
      if (m == name) return nullptr;
    const std::map<std::string, void*> t = {
        {"ncclGetVersion", reinterpret_cast<void*>(&get_version)},
        {"ncclGetUniqueId", reinterpret_cast<void*>(&get_unique_id)},
        {"ncclCommInitRank", reinterpret_cast<void*>(&init_rank)},
        {"ncclCommAbort", reinterpret_cast<void*>(&abort_comm)},
        {"ncclCommDestroy", reinterpret_cast<void*>(&destroy_comm)},
        {"ncclGetErrorString", reinterpret_cast<void*>(&error_string)},
        {"ncclCommShrink", reinterpret_cast<void*>(&shrink)},
    };
    auto it = t.find(name);
    return it == t.end() ? nullptr : it->second;
  };
}
}  // namespace fake_nccl
}  // namespace

TEST_CASE("NcclLibrary: a missing library or symbol is a clear error", "[snapshot][rebuild]") {
  std::string err;
  CHECK(NcclLibrary::open("/nonexistent/r2ccl/libnccl.so.2", &err) == nullptr);
  CHECK_THAT(err, Catch::Contains("cannot load the NCCL library /nonexistent/r2ccl/libnccl.so.2") &&
                      Catch::Contains("R2CCL_NCCL_LIBRARY"));

  // The variable names the library when no path is given.
  const char* saved = std::getenv(kNcclLibraryEnv);
  std::string saved_s = saved ? saved : "";
  setenv(kNcclLibraryEnv, "/nonexistent/r2ccl/from-env.so", 1);
  CHECK(NcclLibrary::open("", &err) == nullptr);
  CHECK_THAT(err, Catch::Contains("/nonexistent/r2ccl/from-env.so"));
  if (saved)
    setenv(kNcclLibraryEnv, saved_s.c_str(), 1);
  else
    unsetenv(kNcclLibraryEnv);

  // A real library that is not NCCL (zlib, which r2ccl_snapshot_core links): dlopen works,
  // the first required symbol is missing.
  CHECK(NcclLibrary::open("libz.so.1", &err) == nullptr);
  CHECK_THAT(err, Catch::Contains("the NCCL library libz.so.1 has no symbol ncclGetVersion"));

  // Each required symbol is named when it alone is missing.
  for (const char* sym : {"ncclGetUniqueId", "ncclCommInitRank", "ncclCommAbort", "ncclCommDestroy",
                          "ncclGetErrorString"}) {
    INFO(sym);
    CHECK(NcclLibrary::from_resolver(fake_nccl::table({sym}), "fake-nccl", &err) == nullptr);
    CHECK_THAT(err, Catch::Contains(std::string("fake-nccl has no symbol ") + sym));
  }
  // ncclGetVersion failing is reported with NCCL's text.
  fake_nccl::version_result = ncclSystemError;
  CHECK(NcclLibrary::from_resolver(fake_nccl::table({}), "fake-nccl", &err) == nullptr);
  CHECK_THAT(err, Catch::Contains("ncclGetVersion of fake-nccl failed: fake system error"));
  fake_nccl::version_result = ncclSuccess;
}

TEST_CASE("NcclLibrary: calls reach NCCL's entry points with NCCL's arguments",
          "[snapshot][rebuild]") {
  std::string err;
  fake_nccl::version = nccl_version_code(2, 27, 5);
  fake_nccl::shrink_calls = 0;
  auto lib = NcclLibrary::from_resolver(fake_nccl::table({}), "fake-nccl", &err);
  INFO(err);
  REQUIRE(lib);
  CHECK(lib->version() == 22705);
  CHECK(lib->shrink_symbol());
  CHECK(lib->has_shrink());
  CHECK(lib->error_string(ncclSystemError) == "fake system error");

  // The unique id goes by value through the function pointer, all 128 bytes intact.
  NcclUniqueId id;
  for (size_t i = 0; i < sizeof(id.internal); ++i) id.internal[i] = static_cast<char>(i * 7 + 1);
  void* comm = nullptr;
  REQUIRE(lib->comm_init_rank(&comm, 6, id, 4) == ncclSuccess);
  CHECK(comm == &fake_nccl::comm_obj);
  CHECK(same_id(fake_nccl::init_id, id));
  CHECK(fake_nccl::init_nranks == 6);
  CHECK(fake_nccl::init_rank_seen == 4);

  // A whole shrink through the driver and the library.
  RebuildPlan plan = must_plan(lib->version(), lib->has_shrink(), 6, {4, 1});
  REQUIRE(plan.mode == RebuildMode::kShrink);
  MemExchange ids;
  RebuildOutcome out;
  REQUIRE(rebuild_communicator(*lib, plan, 5, comm, ids, RebuildOptions{}, &out, &err) ==
          RebuildStatus::kOk);
  CHECK(fake_nccl::shrink_calls == 1);
  CHECK(fake_nccl::shrink_list == std::vector<int>{1, 4});
  CHECK(fake_nccl::shrink_config == nullptr);  // inherit the parent's configuration
  CHECK(fake_nccl::shrink_flags == kNcclShrinkAbort);
  CHECK(out.comm == &fake_nccl::comm_obj + 1);
  CHECK(out.rank == 3);

  SECTION("2.26 exporting a symbol of that name: no shrink, and comm_shrink calls nothing") {
    fake_nccl::version = nccl_version_code(2, 26, 5);
    auto old = NcclLibrary::from_resolver(fake_nccl::table({}), "fake-nccl", &err);
    REQUIRE(old);
    CHECK(old->shrink_symbol());
    CHECK_FALSE(old->has_shrink());
    void* nc = nullptr;
    CHECK(old->comm_shrink(comm, {1}, &nc, kNcclShrinkAbort) == ncclInvalidUsage);
    CHECK(fake_nccl::shrink_calls == 1);
    CHECK(nc == nullptr);
  }
  SECTION("no ncclCommShrink at all: loads, without shrink") {
    auto noshrink =
        NcclLibrary::from_resolver(fake_nccl::table({"ncclCommShrink"}), "fake-nccl", &err);
    REQUIRE(noshrink);
    CHECK_FALSE(noshrink->shrink_symbol());
    CHECK_FALSE(noshrink->has_shrink());
  }
  fake_nccl::version = nccl_version_code(2, 27, 5);
}

// ---------------------------------------------------------------------------------------------
// Recovery hint

namespace {
GetEnv env_of(std::map<std::string, std::string> m) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(m));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}
}  // namespace

TEST_CASE("recovery hint: defaults and the learning-rate factor per step", "[snapshot][recovery]") {
  RecoveryHint h;
  CHECK(h.lr_factor == 0.8);
  CHECK(h.lr_steps == 3);
  CHECK(h.active());
  CHECK(h.factor_for_step(-1) == 1.0);
  CHECK(h.factor_for_step(0) == 0.8);
  CHECK(h.factor_for_step(2) == 0.8);
  CHECK(h.factor_for_step(3) == 1.0);
  CHECK(h.factor_for_step(1000000) == 1.0);
  h.lr_steps = 0;
  CHECK_FALSE(h.active());
  CHECK(h.factor_for_step(0) == 1.0);
  h.lr_steps = 5;
  h.lr_factor = 1.0;
  CHECK_FALSE(h.active());
}

TEST_CASE("recovery hint: environment variables, good and bad", "[snapshot][recovery]") {
  std::vector<std::string> errors;
  RecoveryHint h = recovery_hint_from_env(&errors, env_of({}));
  CHECK(errors.empty());
  CHECK((h.lr_factor == 0.8 && h.lr_steps == 3));

  h = recovery_hint_from_env(
      &errors, env_of({{"R2CCL_RECOVERY_LR_FACTOR", "0.5"}, {"R2CCL_RECOVERY_LR_STEPS", "10"}}));
  CHECK(errors.empty());
  CHECK((h.lr_factor == 0.5 && h.lr_steps == 10));
  h = recovery_hint_from_env(
      &errors, env_of({{"R2CCL_RECOVERY_LR_FACTOR", " 1 "}, {"R2CCL_RECOVERY_LR_STEPS", "1000"}}));
  CHECK(errors.empty());
  CHECK((h.lr_factor == 1.0 && h.lr_steps == 1000));
  h = recovery_hint_from_env(
      &errors, env_of({{"R2CCL_RECOVERY_LR_FACTOR", "1e-3"}, {"R2CCL_RECOVERY_LR_STEPS", "0"}}));
  CHECK(errors.empty());
  CHECK((h.lr_factor == 0.001 && h.lr_steps == 0));
  // Empty counts as unset.
  h = recovery_hint_from_env(
      &errors, env_of({{"R2CCL_RECOVERY_LR_FACTOR", ""}, {"R2CCL_RECOVERY_LR_STEPS", ""}}));
  CHECK(errors.empty());
  CHECK((h.lr_factor == 0.8 && h.lr_steps == 3));

  for (const char* bad :
       {"0", "1.5", "-0.1", "abc", "0.8x", "nan", "inf", "1e400", "0,8", "1.0000001"}) {
    INFO(bad);
    errors.clear();
    h = recovery_hint_from_env(&errors, env_of({{"R2CCL_RECOVERY_LR_FACTOR", bad}}));
    CHECK(h.lr_factor == 0.8);
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains(std::string("R2CCL_RECOVERY_LR_FACTOR=\"") + bad +
                                          "\" is not accepted: expected a number in (0, 1]") &&
                              Catch::Contains("keeping the default 0.8"));
  }
  for (const char* bad : {"-1", "1001", "3.5", "x", "3 steps", "99999999999"}) {
    INFO(bad);
    errors.clear();
    h = recovery_hint_from_env(&errors, env_of({{"R2CCL_RECOVERY_LR_STEPS", bad}}));
    CHECK(h.lr_steps == 3);
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains(std::string("R2CCL_RECOVERY_LR_STEPS=\"") + bad +
                                          "\" is not accepted: expected an integer 0..1000") &&
                              Catch::Contains("keeping the default 3"));
  }
  // One bad, one good: the good one still applies.
  errors.clear();
  h = recovery_hint_from_env(
      &errors, env_of({{"R2CCL_RECOVERY_LR_FACTOR", "2"}, {"R2CCL_RECOVERY_LR_STEPS", "7"}}));
  CHECK(errors.size() == 1);
  CHECK((h.lr_factor == 0.8 && h.lr_steps == 7));

  // The process environment is the default source.
  setenv("R2CCL_RECOVERY_LR_STEPS", "4", 1);
  h = recovery_hint_from_env(nullptr);
  unsetenv("R2CCL_RECOVERY_LR_STEPS");
  CHECK(h.lr_steps == 4);
}

// ---------------------------------------------------------------------------------------------
// The recovered line

TEST_CASE("recovered line: exact format, told apart from a rail switchover",
          "[snapshot][recovery]") {
  const std::string line = format_recovered_line(
      12.3456, {"3", "5"},
      {{"detect", 1.5}, {"membership", 0.02}, {"comm rebuild", 2.3104}, {"restore", 8.5}});
  CHECK(line ==
        "[R2CCL] Successfully recovered in 12.346 s (node loss: 3,5; detect 1.500 s, membership "
        "0.020 s, comm rebuild 2.310 s, restore 8.500 s)");
  CHECK_THAT(line,
             Catch::Matches(
                 R"(\[R2CCL\] Successfully recovered in [0-9]+\.[0-9]{3} s \(node loss: .*\))"));
  // The regex the rail tests use for the net plugin's line does not match it.
  CHECK_FALSE(Catch::Matches(R"(.*Successfully recovered in [0-9.]+ s \(rail .*)").match(line));

  CHECK(format_recovered_line(0.5, {"node-7"}, {}) ==
        "[R2CCL] Successfully recovered in 0.500 s (node loss: node-7)");
  CHECK(format_recovered_line(0, {}, {{"detect", 0}}) ==
        "[R2CCL] Successfully recovered in 0.000 s (node loss: unknown; detect 0.000 s)");
  // Separators in names cannot break the line apart.
  CHECK(format_recovered_line(1, {"a,b (x)"}, {{"re;store)", 1}}) ==
        "[R2CCL] Successfully recovered in 1.000 s (node loss: a_b__x_; re_store_ 1.000 s)");
}

TEST_CASE("recovery timer: phases on a manual clock", "[snapshot][recovery]") {
  ManualClock clock;
  RecoveryTimer t(clock);
  CHECK_FALSE(t.started());
  CHECK(t.total_seconds() == 0);
  // Detection started when node 3 was last heard, 1.5 s ago.
  t.start_at(clock.now() - 1500 * kUsPerMs);
  t.begin(kPhaseMembership);
  clock.advance(20 * kUsPerMs);
  t.begin(kPhaseCommRebuild);
  clock.advance(2310 * kUsPerMs);
  t.begin(kPhaseRestore);
  clock.advance(4 * kUsPerSec);
  // Mid-phase: the running phase counts up to now.
  auto mid = t.phases();
  REQUIRE(mid.size() == 3);
  CHECK(mid[2].seconds == Approx(4.0));
  CHECK(t.total_seconds() == Approx(1.5 + 0.02 + 2.31 + 4.0));
  t.begin(kPhaseCommRebuild);  // a second rebuild attempt adds to the first entry
  clock.advance(100 * kUsPerMs);
  t.begin(kPhaseRestore);
  clock.advance(500 * kUsPerMs);
  t.finish();
  clock.advance(100 * kUsPerSec);  // after finish nothing moves
  auto ph = t.phases();
  REQUIRE(ph.size() == 3);
  CHECK(ph[0].name == "membership");
  CHECK(ph[1].name == "comm rebuild");
  CHECK(ph[1].seconds == Approx(2.41));
  CHECK(ph[2].seconds == Approx(4.5));
  CHECK(t.total_seconds() == Approx(8.43));
  CHECK(t.recovered_line({"3"}) ==
        "[R2CCL] Successfully recovered in 8.430 s (node loss: 3; membership 0.020 s, comm "
        "rebuild 2.410 s, restore 4.500 s)");
  // start() forgets the previous recovery.
  t.start();
  CHECK(t.phases().empty());
  clock.advance(kUsPerSec);
  CHECK(t.total_seconds() == Approx(1.0));
}
