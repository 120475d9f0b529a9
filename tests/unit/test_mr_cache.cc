// MrCache over a recording fake registration: reuse of covering ranges, reference counts,
// deregistration at zero, partial overlaps, error propagation, unknown releases, threads.
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "transport/ib/mr_cache.h"

using r2ccl::net::ib::MrCache;

namespace {

struct FakeReg {
  struct Mr {
    uintptr_t start;
    size_t len;
    bool live;
  };
  std::vector<Mr*> regs;  // every registration ever made
  int deregs = 0;
  bool fail = false;

  MrCache make(size_t page = 4096) {
    return MrCache(
        [this](uintptr_t s, size_t l, std::string* err) -> void* {
          if (fail) {
            *err = "ibv_reg_mr failed: Input/output error";
            errno = EIO;
            return nullptr;
          }
          regs.push_back(new Mr{s, l, true});
          return regs.back();
        },
        [this](void* mr) {
          static_cast<Mr*>(mr)->live = false;
          deregs++;
        },
        page);
  }
  ~FakeReg() {
    for (auto* m : regs) delete m;
  }
};

const void* at(uintptr_t a) { return reinterpret_cast<const void*>(a); }

// Drops every reference, so the destructor has nothing to warn about.
void drain(MrCache& c, std::initializer_list<void*> mrs) {
  for (void* mr : mrs)
    while (c.refs(mr) > 0) c.release(mr);
}

}  // namespace

TEST_CASE("mr_cache: registers whole pages") {
  FakeReg f;
  MrCache c = f.make();
  std::string err;
  void* mr = c.acquire(at(0x10010), 0x2000, &err);
  REQUIRE(mr);
  auto* m = static_cast<FakeReg::Mr*>(mr);
  CHECK(m->start == 0x10000);
  CHECK(m->len == 0x3000);  // 0x10010..0x1200f spans pages 0x10000, 0x11000, 0x12000
  CHECK(c.entries() == 1);
  CHECK(c.refs(mr) == 1);

  SECTION("len 0 registers one page") {
    void* z = c.acquire(at(0x80123), 0, &err);
    REQUIRE(z);
    CHECK(static_cast<FakeReg::Mr*>(z)->start == 0x80000);
    CHECK(static_cast<FakeReg::Mr*>(z)->len == 0x1000);
    drain(c, {z});
  }
  SECTION("exact page end") {
    void* e = c.acquire(at(0x90000), 0x1000, &err);
    REQUIRE(e);
    CHECK(static_cast<FakeReg::Mr*>(e)->len == 0x1000);
    drain(c, {e});
  }
  drain(c, {mr});
  CHECK(c.entries() == 0);
}

TEST_CASE("mr_cache: a covered range reuses the registration") {
  FakeReg f;
  MrCache c = f.make();
  std::string err;
  void* a = c.acquire(at(0x10000), 0x4000, &err);
  void* b = c.acquire(at(0x11008), 0x100, &err);   // inside
  void* d = c.acquire(at(0x10000), 0x4000, &err);  // identical
  void* e = c.acquire(at(0x13fff), 1, &err);       // last byte
  CHECK(a == b);
  CHECK(a == d);
  CHECK(a == e);
  CHECK(f.regs.size() == 1);
  CHECK(c.entries() == 1);
  CHECK(c.refs(a) == 4);

  // Reference counts: deregistered only at zero.
  CHECK(c.release(a));
  CHECK(c.release(a));
  CHECK(c.release(a));
  CHECK(f.deregs == 0);
  CHECK(static_cast<FakeReg::Mr*>(a)->live);
  CHECK(c.release(a));
  CHECK(f.deregs == 1);
  CHECK_FALSE(static_cast<FakeReg::Mr*>(a)->live);
  CHECK(c.entries() == 0);
  CHECK_FALSE(c.release(a));  // already gone
  CHECK(f.deregs == 1);

  // After deregistration a new request registers again.
  void* again = c.acquire(at(0x10000), 0x10, &err);
  REQUIRE(again);
  CHECK(again != a);
  CHECK(f.regs.size() == 2);
  drain(c, {again});
}

TEST_CASE("mr_cache: partial overlap gets its own registration") {
  FakeReg f;
  MrCache c = f.make();
  std::string err;
  void* a = c.acquire(at(0x10000), 0x2000, &err);    // pages 0x10000-0x11fff
  void* b = c.acquire(at(0x11000), 0x2000, &err);    // 0x11000-0x12fff: overlaps, not covered
  void* d = c.acquire(at(0x0f000), 0x2000, &err);    // 0x0f000-0x10fff: overlaps from below
  void* big = c.acquire(at(0x0f000), 0x8000, &err);  // covers all of them
  REQUIRE(a);
  REQUIRE(b);
  REQUIRE(d);
  REQUIRE(big);
  CHECK(a != b);
  CHECK(a != d);
  CHECK(big != a);
  CHECK(c.entries() == 4);
  CHECK(static_cast<FakeReg::Mr*>(b)->start == 0x11000);
  CHECK(static_cast<FakeReg::Mr*>(b)->len == 0x2000);

  // A range inside `a`, `d` and `big` reuses the covering registration with the lowest
  // start, the oldest among equal starts: `d`.
  void* in = c.acquire(at(0x10100), 0x10, &err);
  CHECK(in == d);
  CHECK(c.refs(d) == 2);
  // Releasing one does not disturb the others.
  CHECK(c.release(b));
  CHECK(c.entries() == 3);
  CHECK(c.refs(a) == 1);
  CHECK(c.refs(big) == 1);
  drain(c, {a, d, big});
  CHECK(c.entries() == 0);
  CHECK(f.deregs == 4);
}

TEST_CASE("mr_cache: registration errors propagate and leave nothing behind") {
  FakeReg f;
  MrCache c = f.make();
  std::string err;
  f.fail = true;
  errno = 0;
  CHECK(c.acquire(at(0x10000), 0x100, &err) == nullptr);
  // errno is the registration's: the verbs transport defers a registration on a dead
  // device (EIO) instead of failing regMr.
  CHECK(errno == EIO);
  CHECK(err == "ibv_reg_mr failed: Input/output error");
  CHECK(c.entries() == 0);
  f.fail = false;
  err.clear();
  void* mr = c.acquire(at(0x10000), 0x100, &err);
  CHECK(mr);
  CHECK(err.empty());
  drain(c, {mr});
}

TEST_CASE("mr_cache: range overflowing the address space") {
  FakeReg f;
  MrCache c = f.make();
  std::string err;
  CHECK(c.acquire(at(UINTPTR_MAX - 10), 100, &err) == nullptr);
  CHECK_THAT(err, Catch::Matchers::Contains("overflows"));
  CHECK(c.acquire(at(UINTPTR_MAX - 10), 1, &err) == nullptr);  // the last page cannot end
  CHECK(f.regs.empty());
}

TEST_CASE("mr_cache: release of unknown MRs") {
  FakeReg f;
  MrCache c = f.make();
  int x = 0;
  CHECK_FALSE(c.release(nullptr));
  CHECK_FALSE(c.release(&x));
  CHECK(f.deregs == 0);
  CHECK(c.refs(&x) == 0);
}

TEST_CASE("mr_cache: other page sizes") {
  FakeReg f;
  MrCache c = f.make(65536);
  std::string err;
  void* mr = c.acquire(at(0x12345), 10, &err);
  REQUIRE(mr);
  CHECK(static_cast<FakeReg::Mr*>(mr)->start == 0x10000);
  CHECK(static_cast<FakeReg::Mr*>(mr)->len == 0x10000);
  CHECK(c.acquire(at(0x1ffff), 1, &err) == mr);
  void* next = c.acquire(at(0x20000), 1, &err);
  CHECK(next != mr);
  drain(c, {mr, next});
}

// Expected WARN: "2 memory registrations still referenced at teardown".
TEST_CASE("mr_cache: destructor deregisters what is left") {
  FakeReg f;
  {
    MrCache c = f.make();
    std::string err;
    c.acquire(at(0x10000), 1, &err);
    c.acquire(at(0x20000), 1, &err);
  }
  CHECK(f.deregs == 2);
}

TEST_CASE("mr_cache: concurrent acquire and release") {
  FakeReg f;
  MrCache c = f.make();
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; t++) {
    ts.emplace_back([&c, t] {
      std::string err;
      for (int i = 0; i < 2000; i++) {
        uintptr_t base = 0x100000 + static_cast<uintptr_t>((i + t) % 8) * 0x10000;
        void* mr = c.acquire(at(base + 16), 64, &err);
        if (mr) c.release(mr);
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK(c.entries() == 0);
  CHECK(f.deregs == static_cast<int>(f.regs.size()));
}
