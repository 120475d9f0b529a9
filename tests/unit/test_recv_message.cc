// RecvMessage: the stale-data guard (a lying header is a protocol error, never a write) and
// the duplicate filter; both proven to matter through their test hooks.
#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/recv_message.h"

using Catch::Matchers::Contains;
using r2ccl::net::ChunkVerdict;
using r2ccl::net::GuardOptions;
using r2ccl::net::RecvMessage;

namespace {

constexpr uint64_t kChunk = 4096;
constexpr uint32_t kN = 10;
constexpr uint64_t kTotal = kN * kChunk;

const GuardOptions kGuarded{};
const GuardOptions kNoDedup{false, true};
const GuardOptions kNoStaleGuard{true, false};

// A receive posted with room for exactly kTotal bytes.
struct Posted {
  std::vector<char> buf = std::vector<char>(kTotal);
  RecvMessage m;
  Posted() { m.reset(5, buf.data(), buf.size()); }

  ChunkVerdict check(uint32_t idx, const GuardOptions& opt = kGuarded, const char** why = nullptr) {
    const char* w = nullptr;
    ChunkVerdict v =
        m.check(kTotal, kN, idx, idx * kChunk, static_cast<uint32_t>(kChunk), opt, why ? why : &w);
    return v;
  }
  // check + mark_landed, as the connection does for a chunk whose payload was read.
  ChunkVerdict land(uint32_t idx, const GuardOptions& opt = kGuarded) {
    ChunkVerdict v = check(idx, opt);
    if (v == ChunkVerdict::kWrite) m.mark_landed(idx, opt);
    return v;
  }
};

// Checks one header and expects a protocol error with a reason; returns the reason.
std::string expect_protocol_error(RecvMessage& m, uint64_t total, uint32_t nchunks, uint32_t idx,
                                  uint64_t off, uint32_t len) {
  const char* why = nullptr;
  CHECK(m.check(total, nchunks, idx, off, len, kGuarded, &why) == ChunkVerdict::kProtocolError);
  REQUIRE(why != nullptr);
  CHECK(std::string(why).size() > 0);
  return why;
}

}  // namespace

TEST_CASE("a fresh receive knows nothing until the first chunk header", "[recv_message]") {
  Posted p;
  CHECK(p.m.seq() == 5);
  CHECK(p.m.buffer() == p.buf.data());
  CHECK(p.m.capacity() == kTotal);
  CHECK(p.m.nchunks() == 0);
  CHECK(p.m.total() == 0);
  CHECK_FALSE(p.m.complete());
  CHECK_FALSE(p.m.wants(0));
  CHECK(p.m.prefix() == 0);
  CHECK(p.m.window_bitmap(0) == 0);
}

TEST_CASE("the first chunk sets total and chunk count", "[recv_message]") {
  Posted p;
  CHECK(p.check(3) == ChunkVerdict::kWrite);  // any chunk may arrive first
  CHECK(p.m.total() == kTotal);
  CHECK(p.m.nchunks() == kN);
  for (uint32_t i = 0; i < kN; ++i) CHECK(p.m.wants(i));
  CHECK_FALSE(p.m.wants(kN));
}

TEST_CASE("a smaller message than the posted buffer is accepted", "[recv_message]") {
  Posted p;
  const char* why = nullptr;
  CHECK(p.m.check(100, 1, 0, 0, 100, kGuarded, &why) == ChunkVerdict::kWrite);
  p.m.mark_landed(0, kGuarded);
  CHECK(p.m.complete());
  CHECK(p.m.total() == 100);
}

TEST_CASE("a 0-byte message is one empty chunk", "[recv_message]") {
  RecvMessage m;
  m.reset(1, nullptr, 0);
  const char* why = nullptr;
  CHECK(m.check(0, 1, 0, 0, 0, kGuarded, &why) == ChunkVerdict::kWrite);
  m.mark_landed(0, kGuarded);
  CHECK(m.complete());
}

TEST_CASE("a header disagreeing with earlier chunks is a protocol error", "[recv_message]") {
  Posted p;
  REQUIRE(p.check(0) == ChunkVerdict::kWrite);
  SECTION("different total") {
    auto why = expect_protocol_error(p.m, kTotal - 1, kN, 1, kChunk, kChunk);
    CHECK_THAT(why, Contains("disagrees"));
  }
  SECTION("different chunk count") {
    auto why = expect_protocol_error(p.m, kTotal, kN - 1, 1, kChunk, kChunk);
    CHECK_THAT(why, Contains("disagrees"));
  }
  // The receive keeps the first header's view.
  CHECK(p.m.total() == kTotal);
  CHECK(p.m.nchunks() == kN);
}

TEST_CASE("a rejected first header does not decide the message's size", "[recv_message]") {
  // The first header to arrive lies about its chunk (index or offset); it is refused, and the
  // genuine chunks that follow (replayed on another path) must still be accepted.
  Posted p;
  SECTION("bad index") { expect_protocol_error(p.m, kTotal / 2, kN / 2, kN, 0, kChunk); }
  SECTION("bad offset") { expect_protocol_error(p.m, kTotal / 2, kN / 2, 0, kTotal, kChunk); }
  CHECK(p.m.nchunks() == 0);
  CHECK(p.m.total() == 0);
  CHECK_FALSE(p.m.wants(0));
  for (uint32_t i = 0; i < kN; ++i) REQUIRE(p.land(i) == ChunkVerdict::kWrite);
  CHECK(p.m.complete());
}

TEST_CASE("a message larger than the posted receive is a protocol error", "[recv_message]") {
  Posted p;
  auto why = expect_protocol_error(p.m, kTotal + 1, kN + 1, 0, 0, kChunk);
  CHECK_THAT(why, Contains("larger"));
  CHECK(p.m.nchunks() == 0);  // nothing was adopted
  // A correct header afterwards is still accepted.
  CHECK(p.check(0) == ChunkVerdict::kWrite);
}

TEST_CASE("a chunk index beyond the chunk count is a protocol error", "[recv_message]") {
  Posted p;
  SECTION("on the first chunk") {
    auto why = expect_protocol_error(p.m, kTotal, kN, kN, 0, kChunk);
    CHECK_THAT(why, Contains("index"));
  }
  SECTION("on a later chunk") {
    REQUIRE(p.check(0) == ChunkVerdict::kWrite);
    auto why = expect_protocol_error(p.m, kTotal, kN, UINT32_MAX, 0, kChunk);
    CHECK_THAT(why, Contains("index"));
  }
}

TEST_CASE("a chunk outside the message is a protocol error", "[recv_message]") {
  Posted p;
  REQUIRE(p.check(0) == ChunkVerdict::kWrite);
  SECTION("offset + len one byte past the end") {
    auto why = expect_protocol_error(p.m, kTotal, kN, kN - 1, kTotal - kChunk + 1, kChunk);
    CHECK_THAT(why, Contains("outside"));
  }
  SECTION("offset past the end") { expect_protocol_error(p.m, kTotal, kN, 1, kTotal + 1, 0); }
  SECTION("offset + len wrapping around 64 bits") {
    expect_protocol_error(p.m, kTotal, kN, 1, UINT64_MAX - 10, kChunk);
  }
  SECTION("the last byte exactly is fine") {
    const char* why = nullptr;
    CHECK(p.m.check(kTotal, kN, kN - 1, kTotal - kChunk, kChunk, kGuarded, &why) ==
          ChunkVerdict::kWrite);
  }
}

TEST_CASE("an absurd chunk count is a protocol error", "[recv_message]") {
  // At most total / 4096 + 1 chunks (the smallest chunk size), and at least one.
  Posted p;
  SECTION("one too many") {
    auto why = expect_protocol_error(p.m, kTotal, kTotal / 4096 + 2, 0, 0, kChunk);
    CHECK_THAT(why, Contains("chunk count"));
  }
  SECTION("huge") { expect_protocol_error(p.m, kTotal, UINT32_MAX, 0, 0, kChunk); }
  SECTION("zero") {
    auto why = expect_protocol_error(p.m, kTotal, 0, 0, 0, kChunk);
    CHECK_THAT(why, Contains("chunk count"));
  }
  SECTION("the largest plausible count is accepted") {
    const char* why = nullptr;
    CHECK(p.m.check(kTotal, kTotal / 4096 + 1, 0, 0, 4096, kGuarded, &why) == ChunkVerdict::kWrite);
  }
  CHECK(p.m.nchunks() <= kTotal / 4096 + 1);
}

TEST_CASE("duplicates are recognised and do not count twice", "[recv_message]") {
  Posted p;
  REQUIRE(p.land(0) == ChunkVerdict::kWrite);
  CHECK_FALSE(p.m.wants(0));
  CHECK(p.check(0) == ChunkVerdict::kDuplicate);
  // Even if the connection marked it again, the count does not move.
  p.m.mark_landed(0, kGuarded);
  for (uint32_t i = 1; i < kN - 1; ++i) REQUIRE(p.land(i) == ChunkVerdict::kWrite);
  for (uint32_t i = 0; i < kN - 1; ++i) CHECK(p.land(i) == ChunkVerdict::kDuplicate);
  CHECK_FALSE(p.m.complete());
  CHECK(p.m.wants(kN - 1));
  REQUIRE(p.land(kN - 1) == ChunkVerdict::kWrite);
  CHECK(p.m.complete());
}

TEST_CASE("complete only when every chunk landed, in any order", "[recv_message]") {
  Posted p;
  const uint32_t order[] = {9, 3, 0, 7, 1, 2, 8, 4, 6, 5};
  for (uint32_t k = 0; k < kN; ++k) {
    CHECK_FALSE(p.m.complete());
    REQUIRE(p.land(order[k]) == ChunkVerdict::kWrite);
  }
  CHECK(p.m.complete());
  CHECK(p.m.prefix() == kN);
}

TEST_CASE("a checked chunk is not landed until mark_landed", "[recv_message]") {
  Posted p;
  REQUIRE(p.check(2) == ChunkVerdict::kWrite);
  CHECK(p.m.wants(2));
  CHECK(p.check(2) == ChunkVerdict::kWrite);  // e.g. the replay crossing a partial read
  p.m.mark_landed(2, kGuarded);
  CHECK_FALSE(p.m.wants(2));
  CHECK(p.check(2) == ChunkVerdict::kDuplicate);
}

TEST_CASE("prefix and window bitmap report what landed", "[recv_message]") {
  Posted p;
  p.land(0);
  p.land(1);
  p.land(3);
  p.land(9);
  CHECK(p.m.prefix() == 2);
  CHECK(p.m.window_bitmap(0) == ((1u << 0) | (1u << 1) | (1u << 3) | (1u << 9)));
  CHECK(p.m.window_bitmap(2) == ((1u << 1) | (1u << 7)));
  CHECK(p.m.window_bitmap(kN) == 0);
  CHECK(p.m.window_bitmap(UINT32_MAX) == 0);
  p.land(2);
  CHECK(p.m.prefix() == 4);
}

TEST_CASE("the window bitmap covers 64 chunks from its base", "[recv_message]") {
  const uint64_t total = 200 * 4096;
  std::vector<char> buf(total);
  RecvMessage m;
  m.reset(1, buf.data(), total);
  const char* why = nullptr;
  for (uint32_t i : {10u, 73u, 74u, 150u}) {
    REQUIRE(m.check(total, 200, i, i * 4096ull, 4096, kGuarded, &why) == ChunkVerdict::kWrite);
    m.mark_landed(i, kGuarded);
  }
  CHECK(m.window_bitmap(10) == ((1ull << 0) | (1ull << 63)));
  CHECK(m.window_bitmap(11) == ((1ull << 62) | (1ull << 63)));
  CHECK(m.window_bitmap(100) == (1ull << 50));
  CHECK(m.prefix() == 0);
}

TEST_CASE("without dedup a duplicate completes a message that misses a chunk", "[recv_message]") {
  // The same arrivals with the guard on and off: chunk 9 never arrives, chunk 0 twice.
  auto run = [](const GuardOptions& opt, Posted& p) {
    for (uint32_t i = 0; i < kN - 1; ++i) p.land(i, opt);
    return p.land(0, opt);
  };
  Posted with, without;
  CHECK(run(kGuarded, with) == ChunkVerdict::kDuplicate);
  CHECK_FALSE(with.m.complete());

  CHECK(run(kNoDedup, without) == ChunkVerdict::kWrite);
  CHECK(without.m.complete());     // wrongly: the receive would finish...
  CHECK(without.m.wants(kN - 1));  // ...with chunk 9 still missing
  CHECK(without.m.prefix() == kN - 1);
}

TEST_CASE("without the stale guard lying headers are written", "[recv_message]") {
  const char* why = nullptr;
  SECTION("larger than the posted receive") {
    Posted p;
    CHECK(p.m.check(kTotal * 2, 2 * kN, 0, 0, kChunk, kGuarded, &why) ==
          ChunkVerdict::kProtocolError);
    CHECK(p.m.check(kTotal * 2, 2 * kN, 0, 0, kChunk, kNoStaleGuard, &why) == ChunkVerdict::kWrite);
    CHECK(p.m.total() > p.m.capacity());
  }
  SECTION("absurd chunk count") {
    Posted p;
    CHECK(p.m.check(kTotal, 1000, 0, 0, kChunk, kNoStaleGuard, &why) == ChunkVerdict::kWrite);
  }
  SECTION("offset beyond the message") {
    Posted p;
    REQUIRE(p.check(0) == ChunkVerdict::kWrite);
    CHECK(p.m.check(kTotal, kN, 1, kTotal, kChunk, kGuarded, &why) == ChunkVerdict::kProtocolError);
    CHECK(p.m.check(kTotal, kN, 1, kTotal, kChunk, kNoStaleGuard, &why) == ChunkVerdict::kWrite);
  }
  SECTION("index beyond the chunk count") {
    Posted p;
    REQUIRE(p.check(0) == ChunkVerdict::kWrite);
    CHECK(p.m.check(kTotal, kN, kN + 5, 0, kChunk, kNoStaleGuard, &why) == ChunkVerdict::kWrite);
  }
  SECTION("disagreeing header") {
    Posted p;
    REQUIRE(p.check(0) == ChunkVerdict::kWrite);
    CHECK(p.m.check(kTotal * 4, kN * 4, 1, kChunk, kChunk, kNoStaleGuard, &why) ==
          ChunkVerdict::kWrite);
  }
}

TEST_CASE("RDMA placement: size known from the last chunk, duplicates and bad chunks refused") {
  using namespace r2ccl::net;
  std::vector<char> buf(10000);
  RecvMessage m;
  m.reset(7, buf.data(), buf.size());
  GuardOptions opt;
  const char* why = nullptr;
  // chunk 4096: 10000 bytes could be 3 chunks; the sender sends 2 (4096 + 100).
  REQUIRE(m.check_placed(1, 100, true, 4096, opt, &why) == ChunkVerdict::kWrite);
  m.mark_landed(1, opt);
  CHECK(m.total() == 4196);
  CHECK(m.nchunks() == 2);
  CHECK_FALSE(m.complete());
  CHECK(m.check_placed(1, 100, true, 4096, opt, &why) == ChunkVerdict::kDuplicate);
  CHECK(m.check_placed(2, 4096, false, 4096, opt, &why) == ChunkVerdict::kProtocolError);
  CHECK(m.check_placed(0, 10, false, 4096, opt, &why) == ChunkVerdict::kProtocolError);
  REQUIRE(m.check_placed(0, 4096, false, 4096, opt, &why) == ChunkVerdict::kWrite);
  m.mark_landed(0, opt);
  CHECK(m.complete());
  CHECK(m.window_bitmap(0) == 0x3);

  RecvMessage small;
  small.reset(8, buf.data(), 5000);
  CHECK(small.check_placed(1, 4096, true, 4096, opt, &why) == ChunkVerdict::kProtocolError);
  CHECK(small.check_placed(9, 4096, false, 4096, opt, &why) == ChunkVerdict::kProtocolError);
  RecvMessage empty;
  empty.reset(9, buf.data(), 0);
  REQUIRE(empty.check_placed(0, 0, true, 4096, opt, &why) == ChunkVerdict::kWrite);
  empty.mark_landed(0, opt);
  CHECK(empty.complete());
  CHECK(empty.total() == 0);
}
