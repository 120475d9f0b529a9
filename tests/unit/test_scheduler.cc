// pick_path: primary-only (stripe off) and earliest-finish (stripe on) chunk scheduling,
// with per-path windows; the goodput estimates that weight it (engine/goodput.h): per path
// (measured, smoothed, following a rate change, idle time not counted) and per rail across
// the process (spare capacity). The simulations run on simulated time (no clock is read).
#include <catch2/catch.hpp>
#include <cstdint>
#include <deque>
#include <functional>
#include <utility>
#include <vector>

#include "engine/goodput.h"
#include "engine/scheduler.h"

using r2ccl::kUsPerMs;
using r2ccl::kUsPerSec;
using r2ccl::TimeUs;
using r2ccl::net::PathGoodput;
using r2ccl::net::PathLoad;
using r2ccl::net::pick_path;
using r2ccl::net::RailLive;

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

TEST_CASE("stripe on: a full path that finishes first makes the chunk wait; all full waits",
          "[scheduler]") {
  // Path 0's window is full, but at 100x the bandwidth it still delivers the chunk long before
  // path 1 would: the chunk waits for it (no tail on the slow path).
  PathLoad fast{true, kWindow, kWindow, 100.0};
  CHECK(pick_path({fast, up(2 * kChunk)}, true, kChunk) == -1);
  // At the same bandwidth the full path finishes later: path 1 takes the chunk.
  PathLoad full{true, kWindow, kWindow, 1.0};
  CHECK(pick_path({full, up(2 * kChunk)}, true, kChunk) == 1);
  CHECK(pick_path({fast, up(kWindow)}, true, kChunk) == -1);
}

TEST_CASE("stripe on: a starving path with room takes the chunk while the fastest is full",
          "[scheduler]") {
  PathLoad fast{true, kWindow, kWindow, 100.0};
  PathLoad slow = up(0, 1.0);
  CHECK(pick_path({fast, slow}, true, kChunk) == -1);
  slow.starving = true;  // empty and given nothing for a while: never starved for good
  CHECK(pick_path({fast, slow}, true, kChunk) == 1);
  // Starving changes nothing while the earliest path has room.
  fast.inflight_bytes = 0;
  CHECK(pick_path({fast, slow}, true, kChunk) == 0);
  // Nor does it pick a path that cannot carry data.
  fast.inflight_bytes = kWindow;
  slow.carries_data = false;
  CHECK(pick_path({fast, slow}, true, kChunk) == -1);
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

// ------------------------------------------------------------------------------------------
// Goodput-weighted striping, simulated: each path is a FIFO link of `mbps` (changeable in the
// middle of a run); a chunk posted at t is acknowledged when the link has sent it (plus
// 50 us). The sender loop is the connection's: weights from PathGoodput (configured speed
// until measured), a path starves after 100 ms without a chunk, windows of 4 MiB.

namespace {

constexpr TimeUs kAckDelay = 50;
constexpr TimeUs kSimStep = 20;

struct SimPath {
  double mbps;                                   // the link's real rate
  TimeUs link_free = 0;                          // when the link has sent everything queued
  std::deque<std::pair<TimeUs, uint32_t>> acks;  // (ack time, bytes)
  PathGoodput goodput;
  uint64_t inflight = 0;
  uint64_t bytes_sent = 0;
  TimeUs last_send = -kUsPerSec;
};

struct Sim {
  std::vector<SimPath> paths;
  // false: the scheduler before goodput weights (test hook no_goodput): the configured speed
  // (the same for every rail) and least-loaded among the paths with room
  bool measured_weights = true;
  TimeUs now = 0;
  // Sends `chunks` chunks (0: unlimited) until `until`; returns when the last chunk is
  // acknowledged (or `until`). `on_step` runs every step (rate changes, sampling).
  TimeUs run(uint64_t chunks, TimeUs until, const std::function<void(Sim&)>& on_step = {}) {
    uint64_t left = chunks;
    std::vector<PathLoad> loads(paths.size());
    for (; now < until; now += kSimStep) {
      if (on_step) on_step(*this);
      for (auto& p : paths) {
        while (!p.acks.empty() && p.acks.front().first <= now) {
          const uint32_t len = p.acks.front().second;
          p.acks.pop_front();
          p.inflight -= len;
          p.goodput.on_ack(len, p.inflight, 4 * kChunk, now);
        }
      }
      bool busy = false;
      for (auto& p : paths) busy |= p.inflight > 0;
      if (chunks != 0 && left == 0 && !busy) return now;
      for (size_t i = 0; i < paths.size(); ++i) {
        SimPath& p = paths[i];
        const double w = measured_weights ? r2ccl::net::path_weight(p.goodput.measured(),
                                                                    p.goodput.mbps(), 0, 10000)
                                          : 10000.0;
        loads[i] = PathLoad{true,
                            p.inflight,
                            kWindow,
                            w,
                            false,
                            true,
                            p.inflight == 0 && now - p.last_send > 100 * kUsPerMs};
      }
      while (chunks == 0 || left > 0) {
        const int i = pick_path(loads, true, kChunk, ~0u, measured_weights);
        if (i < 0) break;
        SimPath& p = paths[static_cast<size_t>(i)];
        p.goodput.on_send(p.inflight, now);
        const TimeUs wire = static_cast<TimeUs>(kChunk * 8.0 / p.mbps);
        p.link_free = std::max(p.link_free, now) + wire;
        p.acks.emplace_back(p.link_free + kAckDelay, kChunk);
        p.inflight += kChunk;
        p.bytes_sent += kChunk;
        p.last_send = now;
        loads[static_cast<size_t>(i)].inflight_bytes += kChunk;
        loads[static_cast<size_t>(i)].starving = false;
        if (left > 0) --left;
      }
    }
    return now;
  }
};

Sim two_rails(double a_mbps, double b_mbps) {
  Sim s;
  s.paths.resize(2);
  s.paths[0].mbps = a_mbps;
  s.paths[1].mbps = b_mbps;
  return s;
}

}  // namespace

TEST_CASE("goodput: a busy path's estimate converges to its rate", "[scheduler]") {
  Sim s = two_rails(2000, 500);
  s.run(0, 500 * kUsPerMs);
  REQUIRE(s.paths[0].goodput.measured());
  REQUIRE(s.paths[1].goodput.measured());
  CHECK(s.paths[0].goodput.mbps() == Approx(2000).epsilon(0.05));
  CHECK(s.paths[1].goodput.mbps() == Approx(500).epsilon(0.05));
}

TEST_CASE("goodput-weighted stripe: unequal rails finish a message near the sum of their rates",
          "[scheduler]") {
  // 2000 + 500 Mbps; 64 MiB. Ideal: 64 MiB at 2500 Mbps.
  const uint64_t n = (64u << 20) / kChunk;
  const double ideal_us = 64.0 * (1 << 20) * 8 / 2500;
  Sim s = two_rails(2000, 500);
  const TimeUs t = s.run(n, 10 * kUsPerSec);
  INFO("measured weights: " << t << " us, ideal " << ideal_us << " us");
  CHECK(t <= 1.05 * ideal_us);
  // Never slower than the fast rail alone.
  CHECK(t < 64.0 * (1 << 20) * 8 / 2000);
  // About 4:1 of the bytes.
  CHECK(static_cast<double>(s.paths[0].bytes_sent) / (n * kChunk) == Approx(0.8).margin(0.04));
  // The rule before (configured speed, the same for both veth rails; least-loaded) leaves the
  // slow rail a window's tail per message: 0.85x of the sum, what the issue measured.
  Sim old = two_rails(2000, 500);
  old.measured_weights = false;
  const TimeUs t_old = old.run(n, 10 * kUsPerSec);
  INFO("configured weights: " << t_old << " us");
  CHECK(t_old > 1.1 * ideal_us);
}

TEST_CASE("goodput-weighted stripe: a live rate drop is followed within 1 s", "[scheduler]") {
  Sim s = two_rails(2000, 500);
  s.run(0, 1 * kUsPerSec);
  const uint64_t before0 = s.paths[0].bytes_sent, before1 = s.paths[1].bytes_sent;
  CHECK(static_cast<double>(before0) / (before0 + before1) == Approx(0.8).margin(0.04));
  s.paths[0].mbps = 200;  // tbf changed live on rail 0
  s.run(0, 1500 * kUsPerMs);
  // 0.5 s later the estimate has followed...
  CHECK(s.paths[0].goodput.mbps() == Approx(200).epsilon(0.15));
  // ...and the split of the next 0.5 s is the new 200:500.
  const uint64_t mid0 = s.paths[0].bytes_sent, mid1 = s.paths[1].bytes_sent;
  s.run(0, 2 * kUsPerSec);
  const double share0 =
      static_cast<double>(s.paths[0].bytes_sent - mid0) /
      static_cast<double>(s.paths[0].bytes_sent - mid0 + s.paths[1].bytes_sent - mid1);
  CHECK(share0 == Approx(200.0 / 700).margin(0.05));
  // And back up: the faster rail is noticed again (it keeps getting chunks).
  s.paths[0].mbps = 2000;
  s.run(0, 3 * kUsPerSec);
  CHECK(s.paths[0].goodput.mbps() == Approx(2000).epsilon(0.15));
}

TEST_CASE("goodput-weighted stripe: a much slower rail is never starved", "[scheduler]") {
  // 40:1: with full windows the fast path always finishes first; the slow one still gets a
  // chunk every ~100 ms (starving), so its estimate stays current.
  Sim s = two_rails(2000, 50);
  s.run(0, 2 * kUsPerSec);
  CHECK(s.paths[1].bytes_sent > 0);
  CHECK(s.paths[1].goodput.measured());
  CHECK(s.paths[1].goodput.mbps() == Approx(50).epsilon(0.2));
  // The slow rail does not get more than its share plus the probes.
  CHECK(static_cast<double>(s.paths[1].bytes_sent) /
            static_cast<double>(s.paths[0].bytes_sent + s.paths[1].bytes_sent) <
        0.05);
}

TEST_CASE("goodput: idle time does not count as slowness", "[scheduler]") {
  PathGoodput g;
  TimeUs now = 1000 * kUsPerSec;
  // 500 Mbps for 200 ms: a chunk every 8.4 ms, one in flight at a time.
  const TimeUs per = static_cast<TimeUs>(kChunk * 8.0 / 500);
  for (int i = 0; i < 24; ++i) {
    g.on_send(0, now);
    now += per;
    g.on_ack(kChunk, 0, 4 * kChunk, now);
  }
  REQUIRE(g.measured());
  CHECK(g.mbps() == Approx(500).epsilon(0.02));
  // 5 s idle, then the same pace again: still 500.
  now += 5 * kUsPerSec;
  for (int i = 0; i < 8; ++i) {
    g.on_send(0, now);
    now += per;
    g.on_ack(kChunk, 0, 4 * kChunk, now);
  }
  CHECK(g.mbps() == Approx(500).epsilon(0.02));
  // A failure drops what is in flight; a late acknowledgement of it changes nothing.
  g.on_send(0, now);
  g.on_stop();
  CHECK_FALSE(g.on_ack(kChunk, 0, 4 * kChunk, now + 10 * kUsPerSec));
  CHECK(g.mbps() == Approx(500).epsilon(0.02));
}

TEST_CASE("rail goodput: spare capacity across the process's connections", "[scheduler]") {
  RailLive rail;
  TimeUs now = 1000 * kUsPerSec;
  // Not measured yet: no spare capacity known; the weight falls back to the configured speed.
  CHECK(r2ccl::net::rail_spare_mbps(rail, 0) == 0);
  CHECK(r2ccl::net::path_weight(false, 0, 0, 10000) == 10000);
  // Connection A's path measures 500 Mbps on the rail: capacity 500, A's own spare 500.
  r2ccl::net::rail_publish(rail, 500000, true, now);
  CHECK(r2ccl::net::rail_spare_mbps(rail, 500000) == Approx(500));
  // Connection B (a failed primary's traffic) sees a rail A fills: only the floor (1/16).
  CHECK(r2ccl::net::rail_spare_mbps(rail, 0) == Approx(500.0 / 16));
  // B, unmeasured, is weighted by that spare capacity, so an idle rail beside it wins.
  RailLive idle;
  r2ccl::net::rail_publish(idle, 500000, true, now);
  r2ccl::net::rail_publish(idle, -500000, false, now + 1);  // its user went idle: withdrawn
  CHECK(r2ccl::net::rail_spare_mbps(idle, 0) == Approx(500));
  const double w_busy =
      r2ccl::net::path_weight(false, 0, r2ccl::net::rail_spare_mbps(rail, 0), 10000);
  const double w_idle =
      r2ccl::net::path_weight(false, 0, r2ccl::net::rail_spare_mbps(idle, 0), 10000);
  CHECK(w_idle == Approx(16 * w_busy));
  CHECK(pick_path({up(kChunk, w_busy), up(kChunk, w_idle)}, true, kChunk) == 1);
  // A and B share the rail fairly: 250 each. The capacity stays 500 (the highest load seen,
  // decaying only towards a lower one); each one's spare = 500 - the other's 250.
  r2ccl::net::rail_publish(rail, -250000, true, now + 100 * kUsPerMs);  // A: 500 -> 250
  r2ccl::net::rail_publish(rail, 250000, true, now + 100 * kUsPerMs);   // B: 0 -> 250
  CHECK(rail.goodput_cap_kbps.load() == 500000);
  CHECK(r2ccl::net::rail_spare_mbps(rail, 250000) == Approx(250).epsilon(0.01));
  // A measured path's weight is its goodput, capped by the spare capacity.
  CHECK(r2ccl::net::path_weight(true, 400, 250, 10000) == Approx(250));
  CHECK(r2ccl::net::path_weight(true, 200, 250, 10000) == Approx(200));
  // The rail gets slower (tbf changed): the load stays lower, the capacity follows within ~1 s.
  for (int i = 1; i <= 20; ++i)
    r2ccl::net::rail_publish(rail, 0, true, now + 100 * kUsPerMs + i * 100 * kUsPerMs);
  // load 500 -> a capacity that rose to 500 stays; now drop the load to 200 and sample 2 s.
  r2ccl::net::rail_publish(rail, -300000, true, now + 3 * kUsPerSec);
  for (int i = 1; i <= 20; ++i)
    r2ccl::net::rail_publish(rail, 0, true, now + 3 * kUsPerSec + i * 100 * kUsPerMs);
  CHECK(rail.goodput_cap_kbps.load() == Approx(200000).epsilon(0.15));
}
