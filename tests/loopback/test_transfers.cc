// Real traffic between two processes over two rails on lo (lo@127.0.0.1, lo@127.0.0.2):
// message sizes from 0 B to 1 GiB with every byte checked, receive buffers larger than the
// send, 32 requests in flight, many connections in one pair of processes, and r2ccl_perf
// collectives across several processes.
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
#define EP_REQUIRE(cond, code, ...)                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "[%s:%d] check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                       \
      fprintf(stderr, "\n");                                              \
      return code;                                                        \
    }                                                                     \
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
  EP_REQUIRE(bad < 0, 21, "message of %zu bytes (seed %llu): first wrong byte at offset %lld",
             sent, static_cast<unsigned long long>(seed), bad);
  for (size_t i = sent; i < cap + tail; ++i)
    EP_REQUIRE(static_cast<uint8_t>(buf[i]) == kCanary, 22,
               "message of %zu bytes into %zu: byte %zu past the end was overwritten", sent, cap, i);
  return 0;
}

}  // namespace

TEST_CASE("message sizes 0 B .. 64 MiB arrive intact with their exact size", "[loopback]") {
  const std::vector<size_t> sizes = {0,           1,           4095,     4096,
                                     512 * KiB - 1, 512 * KiB + 1, 4 * MiB, 64 * MiB};
  constexpr size_t kTail = 4096;
  PairResult r = run_pair(
      two_rails(),
      [&](Endpoint& ep) {
        auto buf = raw(64 * MiB);
        for (size_t i = 0; i < sizes.size(); ++i) {
          fill_pattern(buf.get(), sizes[i], 100 + i);
          int sz = -1;
          ncclResult_t res = ep.send(buf.get(), sizes[i], kOpTimeoutMs, &sz);
          EP_REQUIRE(res == ncclSuccess, 10, "send of %zu bytes: result %d", sizes[i], res);
          EP_REQUIRE(sz == static_cast<int>(sizes[i]), 11, "send of %zu reported %d", sizes[i], sz);
        }
        return 0;
      },
      [&](Endpoint& ep) {
        auto buf = raw(64 * MiB + kTail);
        for (size_t i = 0; i < sizes.size(); ++i) {
          memset(buf.get(), kCanary, sizes[i] + kTail);
          int sz = -1;
          ncclResult_t res = ep.recv(buf.get(), sizes[i], kOpTimeoutMs, &sz);
          EP_REQUIRE(res == ncclSuccess, 10, "recv of %zu bytes: result %d", sizes[i], res);
          if (int rc = check_received(buf.get(), sizes[i], sizes[i], kTail, sz, 100 + i)) return rc;
        }
        return 0;
      });
  INFO("took " << r.seconds << " s");
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
}

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

TEST_CASE("a receive buffer larger than the send reports the send size", "[loopback]") {
  struct Case {
    size_t sent, cap;
  };
  const std::vector<Case> cases = {{0, 64 * KiB},          {1, 1 * MiB},
                                   {1000, 1 * MiB},        {700 * KiB, 1 * MiB},
                                   {1 * MiB - 1, 1 * MiB}, {5 * MiB + 3, 8 * MiB}};
  PairResult r = run_pair(
      two_rails(),
      [&](Endpoint& ep) {
        auto buf = raw(8 * MiB);
        for (size_t i = 0; i < cases.size(); ++i) {
          fill_pattern(buf.get(), cases[i].sent, 200 + i);
          int sz = -1;
          ncclResult_t res = ep.send(buf.get(), cases[i].sent, kOpTimeoutMs, &sz);
          EP_REQUIRE(res == ncclSuccess, 10, "send of %zu bytes: result %d", cases[i].sent, res);
          EP_REQUIRE(sz == static_cast<int>(cases[i].sent), 11, "send reported %d", sz);
        }
        return 0;
      },
      [&](Endpoint& ep) {
        auto buf = raw(8 * MiB);
        for (size_t i = 0; i < cases.size(); ++i) {
          memset(buf.get(), kCanary, cases[i].cap);
          int sz = -1;
          ncclResult_t res = ep.recv(buf.get(), cases[i].cap, kOpTimeoutMs, &sz);
          EP_REQUIRE(res == ncclSuccess, 10, "recv into %zu bytes: result %d", cases[i].cap, res);
          if (int rc = check_received(buf.get(), cases[i].sent, cases[i].cap, 0, sz, 200 + i))
            return rc;
        }
        return 0;
      });
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
}

TEST_CASE("32 requests in flight per connection (NCCL_NET_MAX_REQUESTS)", "[loopback]") {
  struct Batch {
    size_t size;
    int count;
    int rounds;  // the second round reuses recycled requests
  };
  const std::vector<Batch> batches = {
      {1 * MiB, 32, 2}, {4 * MiB, 32, 1}, {16 * MiB, 8, 1}, {64 * MiB, 3, 1}};
  PairResult r = run_pair(
      two_rails(),
      [&](Endpoint& ep) {
        uint64_t seed = 1000;
        for (const auto& b : batches) {
          std::vector<std::unique_ptr<char[]>> bufs;
          for (int i = 0; i < b.count; ++i) bufs.push_back(raw(b.size));
          for (int round = 0; round < b.rounds; ++round) {
            std::vector<void*> reqs(b.count, nullptr);
            for (int i = 0; i < b.count; ++i) fill_pattern(bufs[i].get(), b.size, seed + i);
            for (int i = 0; i < b.count; ++i) {
              ncclResult_t res = ep.post_send(bufs[i].get(), b.size, &reqs[i], kOpTimeoutMs);
              EP_REQUIRE(res == ncclSuccess && reqs[i], 10, "isend %d of %d x %zu: result %d", i,
                         b.count, b.size, res);
            }
            std::vector<int> sizes;
            ncclResult_t res = wait_all(ep, reqs, kOpTimeoutMs, &sizes);
            EP_REQUIRE(res == ncclSuccess, 12, "%d sends of %zu: result %d", b.count, b.size, res);
            for (int i = 0; i < b.count; ++i)
              EP_REQUIRE(sizes[i] == static_cast<int>(b.size), 11, "send %d reported %d", i, sizes[i]);
            seed += b.count;
          }
        }
        return 0;
      },
      [&](Endpoint& ep) {
        uint64_t seed = 1000;
        for (const auto& b : batches) {
          std::vector<std::unique_ptr<char[]>> bufs;
          for (int i = 0; i < b.count; ++i) bufs.push_back(raw(b.size));
          for (int round = 0; round < b.rounds; ++round) {
            std::vector<void*> reqs(b.count, nullptr);
            for (int i = 0; i < b.count; ++i) memset(bufs[i].get(), kCanary, b.size);
            for (int i = 0; i < b.count; ++i) {
              ncclResult_t res = ep.post_recv(bufs[i].get(), b.size, &reqs[i], kOpTimeoutMs);
              EP_REQUIRE(res == ncclSuccess && reqs[i], 10, "irecv %d of %d x %zu: result %d", i,
                         b.count, b.size, res);
            }
            std::vector<int> sizes;
            ncclResult_t res = wait_all(ep, reqs, kOpTimeoutMs, &sizes);
            EP_REQUIRE(res == ncclSuccess, 12, "%d receives of %zu: result %d", b.count, b.size, res);
            for (int i = 0; i < b.count; ++i)
              if (int rc = check_received(bufs[i].get(), b.size, b.size, 0, sizes[i], seed + i))
                return rc;
            seed += b.count;
          }
        }
        return 0;
      });
  INFO("took " << r.seconds << " s");
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
}

TEST_CASE("8 connections on devices 0 and 1 in one pair of processes", "[loopback]") {
  PairOptions o = two_rails();
  o.devs = {0, 1, 0, 1, 0, 1, 0, 1};
  const int n = static_cast<int>(o.devs.size());
  constexpr int kRounds = 3;
  constexpr size_t kSize = 4 * MiB + 17;
  auto seed = [](int conn, int round) { return static_cast<uint64_t>(5000 + conn * 100 + round); };
  PairResult r = run_pair(
      o,
      [&](Endpoint& ep) {
        EP_REQUIRE(static_cast<int>(ep.conns.size()) == n, 13, "%zu connections", ep.conns.size());
        std::vector<std::unique_ptr<char[]>> bufs;
        for (int c = 0; c < n; ++c) bufs.push_back(raw(kSize));
        for (int round = 0; round < kRounds; ++round) {
          std::vector<void*> reqs(n, nullptr);
          for (int c = 0; c < n; ++c) fill_pattern(bufs[c].get(), kSize, seed(c, round));
          // Post in the opposite order to the receiver: every connection is independent.
          for (int c = n - 1; c >= 0; --c) {
            ncclResult_t res = ep.conns[c].post_send(bufs[c].get(), kSize, &reqs[c], kOpTimeoutMs);
            EP_REQUIRE(res == ncclSuccess && reqs[c], 10, "isend on connection %d: %d", c, res);
          }
          std::vector<int> sizes;
          ncclResult_t res = wait_all(ep, reqs, kOpTimeoutMs, &sizes);
          EP_REQUIRE(res == ncclSuccess, 12, "round %d: result %d", round, res);
        }
        return 0;
      },
      [&](Endpoint& ep) {
        EP_REQUIRE(static_cast<int>(ep.conns.size()) == n, 13, "%zu connections", ep.conns.size());
        std::vector<std::unique_ptr<char[]>> bufs;
        for (int c = 0; c < n; ++c) bufs.push_back(raw(kSize));
        for (int round = 0; round < kRounds; ++round) {
          std::vector<void*> reqs(n, nullptr);
          for (int c = 0; c < n; ++c) memset(bufs[c].get(), kCanary, kSize);
          for (int c = 0; c < n; ++c) {
            ncclResult_t res = ep.conns[c].post_recv(bufs[c].get(), kSize, &reqs[c], kOpTimeoutMs);
            EP_REQUIRE(res == ncclSuccess && reqs[c], 10, "irecv on connection %d: %d", c, res);
          }
          std::vector<int> sizes;
          ncclResult_t res = wait_all(ep, reqs, kOpTimeoutMs, &sizes);
          EP_REQUIRE(res == ncclSuccess, 12, "round %d: result %d", round, res);
          for (int c = 0; c < n; ++c) {
            if (int rc = check_received(bufs[c].get(), kSize, kSize, 0, sizes[c], seed(c, round))) {
              fprintf(stderr, "(connection %d on device %d, round %d)\n", c, ep.conns[c].dev, round);
              return rc;
            }
          }
        }
        return 0;
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

TEST_CASE("r2ccl_perf: every op, checked", "[loopback][perf]") {
  // 3 ranks: a ring that is not a power of two; allgather rounds sizes down to a multiple of
  // the rank count times the element size.
  for (const char* op : {"allreduce", "allgather", "broadcast", "sendrecv"}) {
    SECTION(op) {
      const bool ag = std::string(op) == "allgather";
      std::vector<long long> want = {0, 16, 256, 4096, 65536, 1048576, 16777216};
      if (ag)
        for (auto& s : want) s = s / 12 * 12;
      check_perf(std::string("--op ") + op + " --ranks 3 --channels 2 -b 0 -e 16M -f 16 --check",
                 want);
    }
  }
}
