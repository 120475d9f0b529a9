// pick_path: primary-only (stripe off) and bandwidth-weighted least-loaded (stripe on)
// chunk scheduling, with per-path windows.
#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

#include "engine/scheduler.h"

using r2ccl::net::PathLoad;
using r2ccl::net::pick_path;

namespace {

constexpr uint64_t kWindow = 4 << 20;
constexpr uint32_t kChunk = 512 << 10;

PathLoad up(uint64_t inflight = 0, double weight = 1.0) {
  return {true, inflight, kWindow, weight};
}
PathLoad down(uint64_t inflight = 0, double weight = 1.0) {
  return {false, inflight, kWindow, weight};
}

}  // namespace

TEST_CASE("no paths, or no path carrying data: the chunk waits", "[scheduler]") {
  CHECK(pick_path({}, false, kChunk) == -1);
  CHECK(pick_path({}, true, kChunk) == -1);
  CHECK(pick_path({down(), down()}, false, kChunk) == -1);
  CHECK(pick_path({down(), down()}, true, kChunk) == -1);
}

TEST_CASE("stripe off: the first data-carrying path gets every chunk", "[scheduler]") {
  CHECK(pick_path({up(), up(), up()}, false, kChunk) == 0);
  // Even when the primary is busier than idle backups.
  CHECK(pick_path({up(kWindow - kChunk), up(0, 100.0), up()}, false, kChunk) == 0);
  // A failed (or draining, or probing) primary hands over to the next backup in order.
  CHECK(pick_path({down(), up(), up()}, false, kChunk) == 1);
  CHECK(pick_path({down(), down(), up()}, false, kChunk) == 2);
}

TEST_CASE("stripe off: a full primary window makes the chunk wait, no spill to backups",
          "[scheduler]") {
  CHECK(pick_path({up(kWindow), up(), up()}, false, kChunk) == -1);
  CHECK(pick_path({up(kWindow - kChunk + 1), up()}, false, kChunk) == -1);
  // Exactly filling the window is allowed.
  CHECK(pick_path({up(kWindow - kChunk), up()}, false, kChunk) == 0);
  // The first carrying path is full: a later one is not used either.
  CHECK(pick_path({down(), up(kWindow), up()}, false, kChunk) == -1);
}

TEST_CASE("stripe on: least in-flight bytes per unit of bandwidth wins", "[scheduler]") {
  CHECK(pick_path({up(3 * kChunk), up(kChunk), up(2 * kChunk)}, true, kChunk) == 1);
  // Path 1 has more bytes in flight but twice the bandwidth: 1.5 < 2 chunks per unit.
  CHECK(pick_path({up(2 * kChunk, 1.0), up(3 * kChunk, 2.0)}, true, kChunk) == 1);
  CHECK(pick_path({up(2 * kChunk, 1.0), up(5 * kChunk, 2.0)}, true, kChunk) == 0);
  // Ties go to the lower index (primary first).
  CHECK(pick_path({up(kChunk), up(kChunk), up(kChunk)}, true, kChunk) == 0);
  CHECK(pick_path({up(2 * kChunk), up(kChunk), up(kChunk)}, true, kChunk) == 1);
}

TEST_CASE("stripe on: paths that carry no data are skipped however idle", "[scheduler]") {
  CHECK(pick_path({down(), up(3 * kChunk)}, true, kChunk) == 1);
  CHECK(pick_path({up(3 * kChunk), down(0, 10.0), up(2 * kChunk)}, true, kChunk) == 2);
}

TEST_CASE("stripe on: full paths are skipped, all full means wait", "[scheduler]") {
  // Path 0 is the least loaded per bandwidth but its window is full.
  PathLoad fast{true, kWindow, kWindow, 100.0};
  CHECK(pick_path({fast, up(2 * kChunk)}, true, kChunk) == 1);
  CHECK(pick_path({fast, up(kWindow)}, true, kChunk) == -1);
}

TEST_CASE("spreading a message over striped paths follows the weights", "[scheduler]") {
  // Simulate the connection's send loop: pick, add the chunk to the path's load.
  std::vector<PathLoad> paths = {up(0, 1.0), up(0, 3.0)};
  paths[0].window_bytes = paths[1].window_bytes = 1ull << 40;
  int count[2] = {0, 0};
  for (int i = 0; i < 400; ++i) {
    int p = pick_path(paths, true, kChunk);
    REQUIRE(p >= 0);
    paths[p].inflight_bytes += kChunk;
    ++count[p];
  }
  CHECK(count[0] == 100);
  CHECK(count[1] == 300);
}

TEST_CASE("an empty path accepts a chunk larger than its window", "[scheduler]") {
  const uint32_t big = 64u << 20;  // larger than the 4 MiB window
  CHECK(pick_path({up()}, false, big) == 0);
  CHECK(pick_path({up()}, true, big) == 0);
  // But not a busy one.
  CHECK(pick_path({up(1)}, false, big) == -1);
  CHECK(pick_path({up(1), up()}, true, big) == 1);
}

TEST_CASE("every path draining: the draining ones carry; one healthy path wins over them",
          "[scheduler]") {
  PathLoad d1{false, 0, kWindow, 1.0, true};
  PathLoad d2{false, 0, kWindow, 1.0, true};
  CHECK(pick_path({down(), d1, d2}, false, kChunk) == 1);
  d1.inflight_bytes = 2 * kChunk;
  CHECK(pick_path({down(), d1, d2}, true, kChunk) == 2);  // least loaded among the draining
  CHECK(pick_path({d1, up(), d2}, false, kChunk) == 1);   // a healthy path: drainers get nothing
  CHECK(pick_path({d1, up(), d2}, true, kChunk) == 1);
  d1.inflight_bytes = kWindow;  // full window still waits
  CHECK(pick_path({down(), d1}, false, kChunk) == -1);
}

TEST_CASE("pick_path: only the paths a message may use", "[unit]") {
  // Bit i of `allowed`: paths[i] may carry the message (a GPU buffer's backups beyond
  // NCCL_NET_GDR_LEVEL may not). An excluded path is never picked, even when it is the only
  // one with room; with the allowed ones all down, the chunk waits (-1).
  std::vector<PathLoad> p = {up(), up(), up()};
  CHECK(pick_path(p, false, kChunk, 0b110) == 1);
  CHECK(pick_path(p, true, kChunk, 0b101) == 0);
  p[0].inflight_bytes = kWindow;  // full
  CHECK(pick_path(p, true, kChunk, 0b101) == 2);
  CHECK(pick_path(p, true, kChunk, 0b001) == -1);
  p = {down(), up(), up()};
  CHECK(pick_path(p, false, kChunk, 0b001) == -1);
  CHECK(pick_path(p, true, kChunk, 0b001) == -1);
  CHECK(pick_path(p, false, kChunk, 0b101) == 2);
  // Draining paths stand in only when no allowed path carries data.
  p = {down(), up(), down()};
  p[2].draining = true;
  CHECK(pick_path(p, false, kChunk, 0b101) == 2);
  CHECK(pick_path(p, false, kChunk) == 1);
}
