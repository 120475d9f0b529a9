// Fault-free verbs data-path shapes on the fake verbs provider (issue 14): chunk size x QPs per
// path x adaptive routing. Every shape must stream intact with no path failure, no switchover
// and no give-up: a full send queue (ENOMEM from ibv_post_send; a slot is free again only once
// a completion is polled, as on mlx5) is back-pressure, never a dead path. Header-only: it uses
// Catch2's macros, which the support library does not link.
// Used by tests/loopback/test_ib_fake.cc (a CI subset) and tests/long (the full matrix).
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/net_harness.h"
#include "support/stream.h"
#include "support/transports.h"

namespace r2ccl::test {

struct DataShape {
  size_t chunk;  // R2CCL_CHUNK_SIZE, bytes
  int qps;       // R2CCL_IB_QPS_PER_PATH
  bool ar;       // R2CCL_IB_ADAPTIVE_ROUTING
};

inline std::string shape_text(const DataShape& s) {
  return "chunk " + std::to_string(s.chunk) + " B, " + std::to_string(s.qps) + " QPs per path, " +
         (s.ar ? "adaptive routing" : "plain writes");
}

// `extra`: more environment for both processes (e.g. the fake's FAKEVERBS_DELAY_US).
inline void check_shape_clean(const DataShape& s,
                              const std::map<std::string, std::string>& extra = {}) {
  constexpr size_t kMiB = 1024 * 1024;
  PairOptions o = ib_fake().pair(extra);
  o.timeout_s = 240;
  o.env["R2CCL_CHUNK_SIZE"] = std::to_string(s.chunk);
  o.env["R2CCL_IB_QPS_PER_PATH"] = std::to_string(s.qps);
  o.env["R2CCL_IB_ADAPTIVE_ROUTING"] = s.ar ? "1" : "0";
  // The path window must hold a chunk (init refuses less): 4 MiB, or two chunks.
  o.env["R2CCL_PATH_WINDOW"] = std::to_string(std::max<size_t>(4 * kMiB, 2 * s.chunk));
  if (s.chunk >= 4 * kMiB) {
    // The fake's one NIC thread per process copies a 64 MiB write in ~50 ms (more on a loaded
    // machine) and answers nothing meanwhile, which a real HCA does not: heartbeats and the
    // watchdog get 1 s here, so what is measured is the queues, not the fake's speed.
    o.env["R2CCL_HEARTBEAT_INTERVAL"] = "1s";
    o.env["R2CCL_ACK_TIMEOUT"] = "1s";
  }
  StreamSpec sp;
  sp.msg = s.chunk >= 4 * kMiB ? 16 * kMiB : 4 * kMiB;
  sp.min_messages = s.chunk < 64 * 1024 ? 8 : 16;  // the fake moves ~100k small WRs a second
  sp.min_seconds = 0.3;
  sp.stall_ms = 30000;
  const StreamRun r = run_stream(o, sp);
  INFO(shape_text(s) << "\nsender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  // RNR NAKs the fake's targets sent (each one costs a real HCA min_rnr_timer, 0.64 ms): the
  // sender must never write more immediates to a QP than the receiver has receives posted.
  long long naks = 0;
  const std::string dir = o.env.count("FAKEVERBS_DIR") ? o.env.at("FAKEVERBS_DIR") : "";
  if (!dir.empty())
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.path().filename().string().rfind("rnr-naks-", 0) == 0) {
        std::ifstream f(e.path());
        long long v = 0;
        f >> v;
        naks += v;
      }
  CHECK(naks == 0);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);  // every byte checked
  for (const std::string* log : {&r.sender_log, &r.receiver_log}) {
    CHECK(count_lines_containing(*log, "failed (") == 0);
    CHECK(count_lines_containing(*log, "switchover") == 0);
    CHECK(count_lines_containing(*log, "give-up") == 0);
  }
}

}  // namespace r2ccl::test
