// The verbs transport on a real HCA of this host (ctest label rdma; skipped without one):
// two processes connect through the HCA's ports (loopback through the NIC) and move
// messages of every size, then r2ccl_perf runs every collective checked. Failover on real
// hardware needs two nodes and a fault that only root on the fabric can cause:
// scripts/ib_two_node.sh.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "support/net_harness.h"

using namespace r2ccl::test;

TEST_CASE("real HCA: messages of every size arrive exact over verbs", "[rdma]") {
  PairOptions o;
  o.env = {{"R2CCL_TRANSPORT", "ib"}};
  const std::vector<size_t> sizes = {0, 1, 4096, 512 * 1024 + 1, 64 * 1024 * 1024};
  PairResult r = run_pair(
      o,
      [&](Endpoint& ep) {
        std::vector<std::vector<char>> bufs;
        for (size_t n : sizes) bufs.emplace_back(n + 1);
        for (size_t i = 0; i < sizes.size(); ++i) {
          fill_pattern(bufs[i].data(), sizes[i], i + 1);
          if (ep.send(bufs[i].data(), sizes[i], 30000) != ncclSuccess) return 1;
        }
        return 0;
      },
      [&](Endpoint& ep) {
        std::vector<std::vector<char>> bufs;
        for (size_t n : sizes) bufs.emplace_back(n + 1);
        for (size_t i = 0; i < sizes.size(); ++i) {
          int got = -1;
          if (ep.recv(bufs[i].data(), bufs[i].size(), 30000, &got) != ncclSuccess) return 1;
          if (got != static_cast<int>(sizes[i]) ||
              check_pattern(bufs[i].data(), sizes[i], i + 1) >= 0) {
            fprintf(stderr, "message %zu: %d bytes or wrong bytes\n", i, got);
            return 2;
          }
        }
        return 0;
      });
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
}

TEST_CASE("real HCA: r2ccl_perf, every op, checked", "[rdma]") {
  for (const char* op : {"allreduce", "allgather", "broadcast", "sendrecv"}) {
    std::string out;
    int rc =
        run_command(perf_command({{"R2CCL_TRANSPORT", "ib"}},
                                 std::string("--ranks 2 --check --op ") + op + " -b 8 -e 64M -f 4"),
                    &out);
    INFO(op << "\n" << out);
    REQUIRE(rc == 0);
    for (const auto& row : perf_rows(out)) CHECK(row.wrong == "0");
  }
}
