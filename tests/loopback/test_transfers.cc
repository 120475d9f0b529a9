// TCP-only transfers over two rails on lo (lo@127.0.0.1, lo@127.0.0.2): a 1 GiB message and
// r2ccl_perf with 4 ranks over 2 channels. The transfer cases both transports share (sizes
// 0 B .. 64 MiB, larger receive buffers, 32 requests in flight, 8 connections, every
// collective and API version) are in test_shared.cc.
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "r2ccl/nccl_abi.h"
#include "support/endpoint_checks.h"
#include "support/net_harness.h"
#include "support/perf_checks.h"

using namespace r2ccl::test;

namespace {

const char* kTwoRails = "lo@127.0.0.1,lo@127.0.0.2";
constexpr size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;
constexpr int kOpTimeoutMs = 120000;  // one message; generous for 2 busy cores

PairOptions two_rails() {
  PairOptions o;
  o.env = {{"R2CCL_SOCKET_IFNAME", kTwoRails}};
  o.timeout_s = 400;
  o.finish_together = true;  // nobody's exit shows up as a rail failure in the other's log
  return o;
}

}  // namespace

TEST_CASE("a 1 GiB message arrives intact", "[loopback][big]") {
  // One 1 GiB send buffer in the sender, one 1 GiB receive buffer in the receiver.
  constexpr size_t kSize = 1 * GiB;
  constexpr uint64_t kSeed = 0x1f1f;
  PairResult r = run_pair(
      two_rails(),
      [&](Endpoint& ep) {
        auto buf = raw_buffer(kSize);
        fill_pattern(buf.get(), kSize, kSeed);
        int sz = -1;
        ncclResult_t res = ep.send(buf.get(), kSize, 300000, &sz);
        EP_REQUIRE(res == ncclSuccess, 10, "send: result %d", res);
        EP_REQUIRE(sz == static_cast<int>(kSize), 11, "send reported %d", sz);
        return 0;
      },
      [&](Endpoint& ep) {
        auto buf = raw_buffer(kSize);
        int sz = -1;
        ncclResult_t res = ep.recv(buf.get(), kSize, 300000, &sz);
        EP_REQUIRE(res == ncclSuccess, 10, "recv: result %d", res);
        return check_received(buf.get(), kSize, kSize, 0, sz, kSeed);
      });
  INFO("took " << r.seconds << " s");
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
}

namespace {

void check_perf(const std::string& args, const std::vector<long long>& want_sizes) {
  r2ccl::test::check_perf({{"R2CCL_SOCKET_IFNAME", kTwoRails}}, args, want_sizes);
}

}  // namespace

TEST_CASE("r2ccl_perf: 4 ranks, 2 channels, checked AllReduce", "[loopback][perf]") {
  check_perf("--ranks 4 --channels 2 -b 1K -e 16M -f 16 --check", {1024, 16384, 262144, 4194304});
}
