// TCP-only transfers over two rails on lo (lo@127.0.0.1, lo@127.0.0.2): a 1 GiB message and
// r2ccl_perf with 4 ranks over 2 channels; r2ccl_perf's refusals of --rendezvous values. The
// transfer cases both transports share (sizes 0 B .. 64 MiB, larger receive buffers, 32 requests in
// flight, 8 connections, every collective and API version) are in test_shared.cc.
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

TEST_CASE("r2ccl_perf --rendezvous refuses what it cannot use at once, naming the value",
          "[loopback][perf]") {
  // Each at parse time: exit 2 with "--rendezvous: 'VALUE': problem; accepted: forms", not a
  // rank retrying a connect until --timeout. (Every form in detail: tests/unit/test_perf_rdv.)
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"127.0.0.1", "missing port"},
      {"127.0.0.1:70000", "port 70000 is out of range (1..65535)"},
      {"[::1:29500", "unbalanced brackets"},
      {"::1:29500", "an IPv6 address needs brackets"},
      {"[fe80::1%r2ccl-no-if9]:29500", "no interface named 'r2ccl-no-if9' on this host"},
      {"[fe80::1]:29500", "the link-local address fe80::1 needs a scope"},
      {":29500", "empty host"},
      {"r2ccl-no-such-host.invalid:29500", "cannot resolve 'r2ccl-no-such-host.invalid': "}};
  for (const auto& c : cases) {
    std::string out;
    const std::string cmd =
        perf_command({}, "--rendezvous " + shell_quote(c.first) + " --rank 1 --nranks 2", 20);
    const int rc = run_command(cmd, &out);
    INFO(cmd << "\n" << out);
    CHECK(rc == 2);
    CHECK(out.find("--rendezvous: '" + c.first + "': " + c.second) != std::string::npos);
    CHECK(out.find("accepted: HOST:PORT, [IPV6]:PORT or [IPV6%SCOPE]:PORT") != std::string::npos);
  }
  // --help documents the forms.
  std::string help;
  REQUIRE(run_command(perf_command({}, "--help"), &help) == 0);
  for (const char* form : {"HOST:PORT", "[IPV6]:PORT", "[IPV6%SCOPE]:PORT", "fe80::/10"})
    CHECK(help.find(form) != std::string::npos);
}

TEST_CASE("r2ccl_perf --inject: a schedule the plugin refuses fails the run, saying so",
          "[loopback][perf]") {
  // Rail 7 of 2: the plugin's armFaults refuses it with a WARN naming the rail, and
  // r2ccl_perf says the plugin refused (not "has no armFaults").
  std::string out;
  const std::string cmd = perf_command({{"R2CCL_SOCKET_IFNAME", kTwoRails}},
                                       "--ranks 2 --op sendrecv -b 1K -e 1K -n 1 -w 0 "
                                       "--inject 'rail=7,at=10,kind=blackhole'");
  const int rc = run_command(cmd, &out);
  INFO(cmd << "\n" << out);
  CHECK(rc != 0);
  CHECK(out.find("--inject 'rail=7,at=10,kind=blackhole': the plugin refused it") !=
        std::string::npos);
  CHECK(out.find("armFaults: rail 7 does not exist (2 rails)") != std::string::npos);
}

TEST_CASE(
    "eager: a threshold above the chunk size is lowered to it, said once, shown in the banner",
    "[loopback][eager]") {
  // An eager message is one chunk: R2CCL_EAGER_THRESHOLD=1M with 256 KiB chunks means 256 KiB.
  std::string out;
  const std::string cmd = perf_command({{"R2CCL_SOCKET_IFNAME", kTwoRails},
                                        {"R2CCL_EAGER_THRESHOLD", "1M"},
                                        {"R2CCL_CHUNK_SIZE", "256K"},
                                        {"NCCL_DEBUG", "INFO"}},
                                       "--ranks 2 --op sendrecv -b 64K -e 1M -f 4 -n 2 --check");
  const int rc = run_command(cmd, &out);
  INFO(cmd << "\n" << out);
  CHECK(rc == 0);
  const std::string warn =
      "R2CCL_EAGER_THRESHOLD=1048576 is above R2CCL_CHUNK_SIZE=262144: messages of at most "
      "262144 bytes go eagerly";
  CHECK(count_lines_containing(out, warn) == 2);  // once per rank (process)
  CHECK(count_lines_containing(out, "stripe off, eager up to 262144 bytes") == 2);
}

namespace {

// Eager messages (R2CCL_EAGER_THRESHOLD, here 64 KiB, set explicitly so the cases do not
// depend on the default): every size 8 B .. 64 KiB, 0 B and one byte below the threshold,
// with every irecv posted before the data, or only after every isend completed (which
// proves the isends went without a CTS), then sizes around the threshold one by one.
constexpr size_t kEagerThr = 64 * KiB;

std::vector<size_t> eager_sizes() {
  std::vector<size_t> v = {0, kEagerThr - 1};
  for (size_t s = 8; s <= kEagerThr; s *= 2) v.push_back(s);
  return v;  // 16 messages: their credit (bytes + 256 each) fits the 256 KiB area
}

uint64_t eager_seed(size_t i, size_t size) { return 0xe9e0 + 131 * i + size; }

PairOptions eager_pair() {
  PairOptions o = two_rails();
  o.env["R2CCL_EAGER_THRESHOLD"] = std::to_string(kEagerThr);
  o.timeout_s = 120;
  return o;
}

}  // namespace

TEST_CASE("eager: every size 8 B .. 64 KiB arrives intact, irecv posted first or after the isend",
          "[loopback][eager]") {
  for (bool irecv_first : {true, false}) {
    INFO((irecv_first ? "every irecv posted first" : "every isend completed first"));
    const std::vector<size_t> sizes = eager_sizes();
    PairResult r = run_pair(
        eager_pair(),
        [&](Endpoint& ep) {
          char note[Endpoint::kNoteBytes] = {};
          if (irecv_first) EP_REQUIRE(ep.hear(note, 30000), 30, "no word from the receiver");
          std::vector<std::unique_ptr<char[]>> bufs;
          for (size_t i = 0; i < sizes.size(); ++i) {
            bufs.push_back(raw_buffer(sizes[i]));
            fill_pattern(bufs.back().get(), sizes[i], eager_seed(i, sizes[i]));
            void* req = nullptr;
            ncclResult_t res = ep.post_send(bufs.back().get(), sizes[i], &req, 10000);
            EP_REQUIRE(res == ncclSuccess && req, 10, "isend %zu: result %d", sizes[i], res);
            int sz = -1;
            // Eager: the isend completes although (isend first) no irecv is posted yet.
            res = ep.wait(req, 10000, &sz);
            EP_REQUIRE(res == ncclSuccess, 11, "send %zu: result %d", sizes[i], res);
            EP_REQUIRE(sz == static_cast<int>(sizes[i]), 12, "send reported %d", sz);
          }
          if (!irecv_first) EP_REQUIRE(ep.say_text("sent"), 31, "cannot tell the receiver");
          return 0;
        },
        [&](Endpoint& ep) {
          char note[Endpoint::kNoteBytes] = {};
          if (!irecv_first) EP_REQUIRE(ep.hear(note, 30000), 30, "no word from the sender");
          constexpr size_t kTail = 64;
          std::vector<std::unique_ptr<char[]>> bufs;
          std::vector<void*> reqs;
          for (size_t i = 0; i < sizes.size(); ++i) {
            // A receive buffer larger than the message: NCCL's irecv size is a capacity.
            bufs.push_back(raw_buffer(sizes[i] + 100 + kTail));
            memset(bufs.back().get(), kCanary, sizes[i] + 100 + kTail);
            void* req = nullptr;
            ncclResult_t res = ep.post_recv(bufs.back().get(), sizes[i] + 100, &req, 10000);
            EP_REQUIRE(res == ncclSuccess && req, 10, "irecv %zu: result %d", sizes[i], res);
            reqs.push_back(req);
          }
          if (irecv_first) EP_REQUIRE(ep.say_text("posted"), 31, "cannot tell the sender");
          for (size_t i = 0; i < sizes.size(); ++i) {
            int sz = -1;
            ncclResult_t res = ep.wait(reqs[i], 30000, &sz);
            EP_REQUIRE(res == ncclSuccess, 11, "recv %zu: result %d", sizes[i], res);
            const int rc = check_received(bufs[i].get(), sizes[i], sizes[i] + 100, kTail, sz,
                                          eager_seed(i, sizes[i]));
            if (rc != 0) return rc;
          }
          return 0;
        });
    CHECK(r.sender_status == 0);
    CHECK(r.receiver_status == 0);
  }
}

TEST_CASE("eager: sizes around the threshold, eager and rendezvous in turn, arrive intact",
          "[loopback][eager]") {
  const std::vector<size_t> sizes = {
      kEagerThr - 1, kEagerThr, kEagerThr + 1, 8, 2 * kEagerThr, kEagerThr, kEagerThr + 1, 0, 1};
  PairResult r = run_pair(
      eager_pair(),
      [&](Endpoint& ep) {
        for (int pass = 0; pass < 20; ++pass)
          for (size_t i = 0; i < sizes.size(); ++i) {
            auto buf = raw_buffer(sizes[i]);
            fill_pattern(buf.get(), sizes[i], eager_seed(i + 100 * pass, sizes[i]));
            int sz = -1;
            ncclResult_t res = ep.send(buf.get(), sizes[i], 20000, &sz);
            EP_REQUIRE(res == ncclSuccess, 10, "send %zu: result %d", sizes[i], res);
          }
        return 0;
      },
      [&](Endpoint& ep) {
        for (int pass = 0; pass < 20; ++pass)
          for (size_t i = 0; i < sizes.size(); ++i) {
            auto buf = raw_buffer(sizes[i] + 16);
            memset(buf.get(), kCanary, sizes[i] + 16);
            int sz = -1;
            ncclResult_t res = ep.recv(buf.get(), sizes[i], 20000, &sz);
            EP_REQUIRE(res == ncclSuccess, 10, "recv %zu: result %d", sizes[i], res);
            const int rc = check_received(buf.get(), sizes[i], sizes[i], 16, sz,
                                          eager_seed(i + 100 * pass, sizes[i]));
            if (rc != 0) return rc;
          }
        return 0;
      });
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
}
