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
#include "support/net_harness.h"

using namespace r2ccl::test;

namespace {

const char* kTwoRails = "lo@127.0.0.1,lo@127.0.0.2";
constexpr size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;
constexpr int kOpTimeoutMs = 120000;  // one message; generous for 2 busy cores
constexpr uint8_t kCanary = 0xA5;

// Endpoint-side checks: print what failed (stderr ends up in the ctest log) and fail the
// process with a distinct exit code.
#define EP_REQUIRE(cond, code, ...)                                             \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fprintf(stderr, "[%s:%d] check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                             \
      fprintf(stderr, "\n");                                                    \
      return code;                                                              \
    }                                                                           \
  } while (0)

PairOptions two_rails() {
  PairOptions o;
  o.env = {{"R2CCL_SOCKET_IFNAME", kTwoRails}};
  o.timeout_s = 400;
  o.finish_together = true;  // nobody's exit shows up as a rail failure in the other's log
  return o;
}

// Buffers that are not zero-initialised (so a 1 GiB receive buffer costs nothing until used).
std::unique_ptr<char[]> raw(size_t n) { return std::unique_ptr<char[]>(new char[n ? n : 1]); }

// The receive side of one message of `sent` bytes into a buffer of `cap` bytes (+ a canary
// tail of `tail` bytes that must stay untouched): size reported exactly, every byte right.
int check_received(const char* buf, size_t sent, size_t cap, size_t tail, int reported,
                   uint64_t seed) {
  EP_REQUIRE(reported >= 0 && static_cast<size_t>(reported) == sent, 20,
             "reported size %d, sent %zu (capacity %zu)", reported, sent, cap);
  long long bad = check_pattern(buf, sent, seed);
  EP_REQUIRE(bad < 0, 21, "message of %zu bytes (seed %llu): first wrong byte at offset %lld", sent,
             static_cast<unsigned long long>(seed), bad);
  for (size_t i = sent; i < cap + tail; ++i)
    EP_REQUIRE(static_cast<uint8_t>(buf[i]) == kCanary, 22,
               "message of %zu bytes into %zu: byte %zu past the end was overwritten", sent, cap,
               i);
  return 0;
}

}  // namespace

TEST_CASE("a 1 GiB message arrives intact", "[loopback][big]") {
  // One 1 GiB send buffer in the sender, one 1 GiB receive buffer in the receiver.
  constexpr size_t kSize = 1 * GiB;
  constexpr uint64_t kSeed = 0x1f1f;
  PairResult r = run_pair(
      two_rails(),
      [&](Endpoint& ep) {
        auto buf = raw(kSize);
        fill_pattern(buf.get(), kSize, kSeed);
        int sz = -1;
        ncclResult_t res = ep.send(buf.get(), kSize, 300000, &sz);
        EP_REQUIRE(res == ncclSuccess, 10, "send: result %d", res);
        EP_REQUIRE(sz == static_cast<int>(kSize), 11, "send reported %d", sz);
        return 0;
      },
      [&](Endpoint& ep) {
        auto buf = raw(kSize);
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

// Runs r2ccl_perf with `args`; requires exit 0, the expected table sizes, 0 wrong everywhere.
void check_perf(const std::string& args, const std::vector<long long>& want_sizes) {
  std::string out;
  std::string cmd = perf_command({{"R2CCL_SOCKET_IFNAME", kTwoRails}}, args);
  int rc = run_command(cmd, &out);
  INFO(cmd << "\n" << out);
  CHECK(rc == 0);
  std::vector<long long> sizes;
  for (const auto& row : perf_rows(out)) {
    sizes.push_back(row.size);
    INFO("size " << row.size);
    CHECK(row.wrong == "0");
  }
  CHECK(sizes == want_sizes);
  CHECK(out.find("# wrong total: 0") != std::string::npos);
}

}  // namespace

TEST_CASE("r2ccl_perf: 4 ranks, 2 channels, checked AllReduce", "[loopback][perf]") {
  check_perf("--ranks 4 --channels 2 -b 1K -e 16M -f 16 --check", {1024, 16384, 262144, 4194304});
}
