// SendMessage: chunking, send order (replays first), acknowledgements (prefix and window
// bitmap), and the replay of a failed path's unacknowledged chunks.
#include <catch2/catch.hpp>
#include <cstdint>
#include <utility>
#include <vector>

#include "engine/send_message.h"

using r2ccl::net::SendMessage;

namespace {

constexpr uint64_t kChunk = 4096;

struct Acked {
  int path;
  uint32_t len;
  bool operator==(const Acked& o) const { return path == o.path && len == o.len; }
};

// apply_ack that records every callback.
std::vector<Acked> ack(SendMessage& m, uint32_t prefix, uint32_t base, uint64_t bitmap,
                       int* returned = nullptr) {
  std::vector<Acked> v;
  int n = m.apply_ack(prefix, base, bitmap, [&](int path, uint32_t len) {
    v.push_back({path, len});
  });
  if (returned) *returned = n;
  return v;
}

// Takes the next chunk onto `path`; returns its index.
uint32_t send_one(SendMessage& m, int path) {
  uint32_t idx = 0;
  REQUIRE(m.peek_next(&idx));
  m.take_next(path);
  return idx;
}

uint64_t bit(uint32_t b) { return uint64_t{1} << b; }

}  // namespace

TEST_CASE("chunking covers the message with ceil(size / chunk) chunks", "[send_message]") {
  struct Case {
    uint64_t size;
    uint32_t nchunks;
    uint32_t last_len;
  };
  const Case cases[] = {
      {1, 1, 1},          {kChunk - 1, 1, kChunk - 1}, {kChunk, 1, kChunk},
      {kChunk + 1, 2, 1}, {10 * kChunk, 10, kChunk},   {1000 * kChunk + 17, 1001, 17},
  };
  for (const auto& c : cases) {
    INFO("size " << c.size);
    SendMessage m;
    m.reset(7, c.size, kChunk);
    CHECK(m.seq() == 7);
    CHECK(m.size() == c.size);
    REQUIRE(m.nchunks() == c.nchunks);
    uint64_t covered = 0;
    for (uint32_t i = 0; i < m.nchunks(); ++i) {
      CHECK(m.chunk_offset(i) == covered);  // contiguous, no gap, no overlap
      const uint32_t expect = i + 1 == m.nchunks() ? c.last_len : static_cast<uint32_t>(kChunk);
      CHECK(m.chunk_len(i) == expect);
      covered += m.chunk_len(i);
    }
    CHECK(covered == c.size);
    CHECK_FALSE(m.complete());
    CHECK(m.has_unsent());
  }
}

TEST_CASE("a 0-byte message has exactly one empty chunk", "[send_message]") {
  SendMessage m;
  m.reset(1, 0, kChunk);
  REQUIRE(m.nchunks() == 1);
  CHECK(m.chunk_offset(0) == 0);
  CHECK(m.chunk_len(0) == 0);
  CHECK_FALSE(m.complete());
  CHECK(send_one(m, 0) == 0);
  CHECK_FALSE(m.has_unsent());
  CHECK(ack(m, 1, 1, 0) == std::vector<Acked>{{0, 0}});
  CHECK(m.complete());
}

TEST_CASE("large messages with the default chunk size", "[send_message]") {
  SendMessage m;
  const uint64_t chunk = 512 * 1024;
  const uint64_t size = (uint64_t{3} << 30) + 5;  // 3 GiB + 5 bytes
  m.reset(2, size, chunk);
  REQUIRE(m.nchunks() == 6145);
  CHECK(m.chunk_offset(6144) == (uint64_t{3} << 30));
  CHECK(m.chunk_len(6144) == 5);
  CHECK(m.chunk_len(6143) == chunk);
}

TEST_CASE("reset reuses the object for a new message", "[send_message]") {
  SendMessage m;
  m.reset(1, 4 * kChunk, kChunk);
  send_one(m, 0);
  send_one(m, 0);
  m.fail_path(0, true);
  ack(m, 1, 0, 0);
  m.reset(2, 2 * kChunk, kChunk);
  CHECK(m.nchunks() == 2);
  CHECK(m.acked() == 0);
  CHECK(m.replay_outstanding() == 0);
  CHECK(m.inflight_on(0) == 0);
  CHECK(send_one(m, 1) == 0);  // no leftover replay
  CHECK(send_one(m, 1) == 1);
}

TEST_CASE("take_next sends never-sent chunks in order", "[send_message]") {
  SendMessage m;
  m.reset(1, 3 * kChunk, kChunk);
  for (uint32_t i = 0; i < 3; ++i) {
    uint32_t idx = 99;
    REQUIRE(m.peek_next(&idx));
    CHECK(idx == i);
    CHECK_FALSE(m.take_next(static_cast<int>(i % 2)));  // not a replay
  }
  uint32_t idx;
  CHECK_FALSE(m.peek_next(&idx));
  CHECK_FALSE(m.has_unsent());
  CHECK(m.inflight_on(0) == 2);
  CHECK(m.inflight_on(1) == 1);
}

TEST_CASE("replays are sent before never-sent chunks", "[send_message]") {
  SendMessage m;
  m.reset(1, 6 * kChunk, kChunk);
  send_one(m, 0);  // 0
  send_one(m, 1);  // 1
  send_one(m, 0);  // 2
  REQUIRE(m.fail_path(0, true) == 2);
  CHECK(m.has_unsent());

  uint32_t idx;
  REQUIRE(m.peek_next(&idx));
  CHECK(idx == 0);
  CHECK(m.take_next(1));  // a replay
  REQUIRE(m.peek_next(&idx));
  CHECK(idx == 2);
  CHECK(m.take_next(1));
  REQUIRE(m.peek_next(&idx));
  CHECK(idx == 3);
  CHECK_FALSE(m.take_next(1));  // new again
  CHECK(m.inflight_on(0) == 0);
  CHECK(m.inflight_on(1) == 4);
}

TEST_CASE("a prefix ack acknowledges every chunk below it once", "[send_message]") {
  SendMessage m;
  m.reset(1, 3 * kChunk + 100, kChunk);  // 4 chunks, last one 100 bytes
  send_one(m, 0);
  send_one(m, 1);
  send_one(m, 0);
  send_one(m, 2);

  int n = 0;
  CHECK(ack(m, 2, 2, 0, &n) == std::vector<Acked>{{0, kChunk}, {1, kChunk}});
  CHECK(n == 2);
  CHECK(m.acked() == 2);
  CHECK(m.inflight_on(0) == 1);
  CHECK(m.inflight_on(1) == 0);

  // Duplicate and stale (lower) prefixes change nothing.
  CHECK(ack(m, 2, 2, 0, &n).empty());
  CHECK(n == 0);
  CHECK(ack(m, 1, 1, 0).empty());
  CHECK(m.acked() == 2);

  // A prefix beyond nchunks is clamped.
  CHECK(ack(m, 1000, 1000, 0) == std::vector<Acked>{{0, kChunk}, {2, 100}});
  CHECK(m.acked() == 4);
  CHECK(m.complete());
}

TEST_CASE("window bitmaps acknowledge out of order", "[send_message]") {
  SendMessage m;
  m.reset(1, 6 * kChunk, kChunk);
  for (int i = 0; i < 6; ++i) send_one(m, i % 3);  // chunk i on path i % 3

  // Chunks 2 and 4 landed, 0 and 1 not yet.
  CHECK(ack(m, 0, 2, bit(0) | bit(2)) == std::vector<Acked>{{2, kChunk}, {1, kChunk}});
  CHECK(m.acked() == 2);
  CHECK_FALSE(m.complete());

  // The same window again, and a window that overlaps it: only the new chunk 5.
  CHECK(ack(m, 0, 2, bit(0) | bit(2)).empty());
  CHECK(ack(m, 0, 3, bit(1) | bit(2)) == std::vector<Acked>{{2, kChunk}});
  CHECK(m.acked() == 3);

  // Prefix 3 covers 0, 1 (new) and 2 (already acknowledged: no second callback).
  CHECK(ack(m, 3, 3, 0) == std::vector<Acked>{{0, kChunk}, {1, kChunk}});
  CHECK(m.acked() == 5);
  CHECK(ack(m, 3, 3, bit(0)) == std::vector<Acked>{{0, kChunk}});
  CHECK(m.complete());
  CHECK(m.acked() == 6);
}

TEST_CASE("bitmap bits beyond the last chunk are ignored", "[send_message]") {
  SendMessage m;
  m.reset(1, 3 * kChunk, kChunk);
  for (int i = 0; i < 3; ++i) send_one(m, 0);
  int n = 0;
  auto v = ack(m, 0, 0, ~uint64_t{0}, &n);  // all 64 bits, only 3 chunks
  CHECK(v.size() == 3);
  CHECK(n == 3);
  CHECK(m.acked() == 3);
  CHECK(m.complete());
  // A window entirely beyond the message.
  SendMessage m2;
  m2.reset(2, 3 * kChunk, kChunk);
  for (int i = 0; i < 3; ++i) send_one(m2, 0);
  CHECK(ack(m2, 0, 3, ~uint64_t{0}).empty());
  CHECK(ack(m2, 0, UINT32_MAX - 10, ~uint64_t{0}).empty());  // base + bit overflows 32 bits
  CHECK(m2.acked() == 0);
}

TEST_CASE("fail_path requeues exactly the failed path's unacknowledged chunks", "[send_message]") {
  SendMessage m;
  m.reset(1, 8 * kChunk, kChunk);
  // Chunks 0..5 sent: even ones on path 0, odd ones on path 1; 6, 7 unsent.
  for (int i = 0; i < 6; ++i) send_one(m, i % 2);
  // Chunk 2 (path 0) and chunk 1 (path 1) acknowledged.
  ack(m, 0, 0, bit(1) | bit(2));
  REQUIRE(m.inflight_on(0) == 2);  // 0, 4
  REQUIRE(m.inflight_on(1) == 2);  // 3, 5

  CHECK(m.fail_path(0, true) == 2);
  CHECK(m.inflight_on(0) == 0);
  CHECK(m.inflight_on(1) == 2);  // other paths untouched
  CHECK(m.replay_outstanding() == 2);

  std::vector<uint32_t> order;
  uint32_t idx;
  while (m.peek_next(&idx)) {
    order.push_back(idx);
    m.take_next(1);
  }
  // The replays 0 and 4 (not the acknowledged 2), then the never-sent 6 and 7.
  CHECK(order == std::vector<uint32_t>{0, 4, 6, 7});

  // Failing the path again finds nothing; failing an unused path finds nothing.
  CHECK(m.fail_path(0, true) == 0);
  CHECK(m.fail_path(3, true) == 0);
}

TEST_CASE("a chunk replayed twice is outstanding once", "[send_message]") {
  SendMessage m;
  m.reset(1, 2 * kChunk, kChunk);
  send_one(m, 0);
  send_one(m, 0);
  REQUIRE(m.fail_path(0, true) == 2);
  send_one(m, 1);  // chunk 0 on path 1
  send_one(m, 1);  // chunk 1 on path 1
  REQUIRE(m.fail_path(1, true) == 2);
  CHECK(m.replay_outstanding() == 2);
  send_one(m, 2);
  send_one(m, 2);
  CHECK(ack(m, 2, 2, 0) == std::vector<Acked>{{2, kChunk}, {2, kChunk}});
  CHECK(m.replay_outstanding() == 0);
  CHECK(m.complete());
}

TEST_CASE("replay_outstanding counts down as replayed chunks are acknowledged", "[send_message]") {
  SendMessage m;
  m.reset(1, 5 * kChunk, kChunk);
  for (int i = 0; i < 5; ++i) send_one(m, 0);
  ack(m, 1, 1, 0);  // chunk 0 landed before the failure
  REQUIRE(m.fail_path(0, true) == 4);
  CHECK(m.replay_outstanding() == 4);
  for (int i = 0; i < 4; ++i) send_one(m, 1);

  CHECK(ack(m, 0, 3, bit(0)) == std::vector<Acked>{{1, kChunk}});  // chunk 3
  CHECK(m.replay_outstanding() == 3);
  ack(m, 3, 3, 0);  // chunks 1, 2
  CHECK(m.replay_outstanding() == 1);
  CHECK_FALSE(m.complete());
  ack(m, 5, 5, 0);
  CHECK(m.replay_outstanding() == 0);
  CHECK(m.complete());
}

TEST_CASE("a chunk acknowledged while queued for replay is not sent again", "[send_message]") {
  SendMessage m;
  m.reset(1, 3 * kChunk, kChunk);
  for (int i = 0; i < 3; ++i) send_one(m, 0);
  REQUIRE(m.fail_path(0, true) == 3);
  // The original copy of chunk 1 did land: its (late) acknowledgement arrives now. It is no
  // longer on any path, so the callback reports kNoPath.
  CHECK(ack(m, 0, 0, bit(1)) == std::vector<Acked>{{SendMessage::kNoPath, kChunk}});
  CHECK(m.replay_outstanding() == 2);

  std::vector<uint32_t> sent;
  uint32_t idx;
  while (m.peek_next(&idx)) {
    sent.push_back(idx);
    CHECK(m.take_next(1));
  }
  CHECK(sent == std::vector<uint32_t>{0, 2});
  ack(m, 3, 3, 0);
  CHECK(m.complete());
  CHECK(m.replay_outstanding() == 0);
}

TEST_CASE("without replay a failed path's chunks are lost and the message never completes",
          "[send_message]") {
  SendMessage m;
  m.reset(1, 4 * kChunk, kChunk);
  for (int i = 0; i < 4; ++i) send_one(m, i % 2);  // 0, 2 on path 0; 1, 3 on path 1
  // Still counted as failed, but nothing is queued again.
  CHECK(m.fail_path(0, false) == 2);
  CHECK(m.replay_outstanding() == 0);
  CHECK_FALSE(m.has_unsent());
  uint32_t idx;
  CHECK_FALSE(m.peek_next(&idx));

  // Drive it like the connection would: send whatever it offers on the surviving path and
  // acknowledge everything the receiver got (the chunks of path 1).
  for (int round = 0; round < 10; ++round) {
    while (m.peek_next(&idx)) m.take_next(1);
    ack(m, 0, 0, bit(1) | bit(3));
  }
  CHECK(m.acked() == 2);
  CHECK_FALSE(m.complete());

  // The same story with replay completes.
  SendMessage r;
  r.reset(1, 4 * kChunk, kChunk);
  for (int i = 0; i < 4; ++i) send_one(r, i % 2);
  CHECK(r.fail_path(0, true) == 2);
  std::vector<uint32_t> on_path1 = {1, 3};
  while (r.peek_next(&idx)) {
    on_path1.push_back(idx);
    r.take_next(1);
  }
  uint64_t bm = 0;
  for (uint32_t i : on_path1) bm |= bit(i);
  ack(r, 0, 0, bm);
  CHECK(r.complete());
}
