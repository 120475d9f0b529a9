// The verbs transport end to end against the fake verbs provider (tests/fakeverbs), loaded in
// place of libibverbs with R2CCL_IBVERBS_LIB. Each process is one "host" with two RoCE HCAs
// (mlx5_0 on 10.210.1.0/24, mlx5_1 on 10.210.2.0/24); the TCP side channel runs on lo.
//
// What only verbs has (the cases both transports share, transfers of every size, a dead or
// black-holed primary rail, no replay, every rail down, a killed peer, every API version, are
// in test_shared.cc and run here on the fake too):
//   far-end failure  -> port_down on the receiver: retry-exceeded with the local port active,
//                       exactly once
//   flaps            -> port down/up trains (failback by re-created QPs, hold-down)
// plus the late write (bilateral ERR transition), fatal completion errors, GID change,
// adaptive-routing writes with several QPs and striping, the predictor's DRAIN, a link-layer
// mismatch refused at both ends, transport/device selection, GPU buffers kept off backups
// beyond NCCL_NET_GDR_LEVEL, and backups paired by real subnets. Each protection switched
// off through R2CCL_TEST_HOOKS makes its test fail.
#include <dlfcn.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/ext.h"
#include "r2ccl/nccl_abi.h"
#include "support/data_shapes.h"
#include "support/fake_counters.h"
#include "support/net_harness.h"
#include "support/stream.h"
#include "support/transports.h"
#include "transport/handshake.h"
#include "transport/ib/wire.h"

using namespace r2ccl::test;

namespace {

const char* const kSenderHcas = kFakeSenderHcas;
const char* const kReceiverHcas = kFakeReceiverHcas;
std::string fake_lib() { return fake_verbs_lib(); }
std::string fresh_dir() { return fresh_fake_dir(); }

// Both processes on the fake (support/transports.h: verbs transport, side channel on lo, a
// fast retry-exceeded), with these faults.
PairOptions ib_pair(const std::string& sender_faults = "",
                    const std::string& receiver_faults = "") {
  PairOptions o = ib_fake().pair();
  o.sender_env["FAKEVERBS_FAULTS"] = sender_faults;
  o.receiver_env["FAKEVERBS_FAULTS"] = receiver_faults;
  o.timeout_s = 120;
  return o;
}

StreamSpec short_stream(double seconds = 1.0) {
  StreamSpec s;
  s.msg = 4 * 1024 * 1024;
  s.min_messages = 32;
  s.min_seconds = seconds;
  s.stall_ms = 20000;
  return s;
}

std::vector<int> to_replay(const std::string& log) { return to_replay_counts(log); }
std::vector<int> replayed(const std::string& log) { return replayed_counts(log); }

#define SKIP_WITHOUT_FAKE()                                        \
  do {                                                             \
    if (fake_lib().empty()) {                                      \
      WARN("R2CCL_TEST_FAKEVERBS is not set (run through ctest)"); \
      return;                                                      \
    }                                                              \
  } while (0)

}  // namespace

TEST_CASE(
    "r2ccl_perf over the fake: adaptive-routing writes, 4 QPs per path, striping, odd chunk size",
    "[loopback][ib]") {
  SKIP_WITHOUT_FAKE();
  // The other data-path shapes: adaptive-routing writes, several QPs per path, striping over
  // both HCAs, a chunk size that is not a power of two.
  std::map<std::string, std::string> env = {{"R2CCL_TRANSPORT", "ib"},
                                            {"R2CCL_IBVERBS_LIB", fake_lib()},
                                            {"R2CCL_SOCKET_IFNAME", "lo"},
                                            {"FAKEVERBS_DIR", fresh_dir()},
                                            {"FAKEVERBS_DEVICES", kSenderHcas},
                                            {"R2CCL_LOG_FILE", "none"},
                                            {"R2CCL_IB_ADAPTIVE_ROUTING", "1"},
                                            {"R2CCL_IB_QPS_PER_PATH", "4"},
                                            {"R2CCL_STRIPE", "1"},
                                            {"R2CCL_CHUNK_SIZE", "100000"}};
  std::string out;
  int rc = run_command(
      perf_command(env, "--ranks 2 --check --channels 2 -b 1 -e 16M -f 16 -n 3 --stats"), &out);
  INFO("AR + 4 QPs + stripe\n" << out);
  REQUIRE(rc == 0);
  std::vector<PerfRow> rows = perf_rows(out);
  REQUIRE(rows.size() == 7);  // 1 B .. 16 MiB by 16 (allreduce rounds tiny sizes up)
  for (const auto& row : rows) CHECK(row.wrong == "0");
}

TEST_CASE("verbs: liveness is shared per link: 8 connections per process probe at most 4 links",
          "[loopback][ib][link]") {
  SKIP_WITHOUT_FAKE();
  // 4 channels = 4 send + 4 receive connections per process, each with a primary and a
  // backup path over 2 HCAs per end: 16 paths per process, over at most 2 x 2 HCA pairs to
  // the one peer process. Every path over the same pair shares one liveness (one prober), as
  // on TCP (engine/link_live.h): the process's getStats counts the shared links.
  std::map<std::string, std::string> env = {
      {"R2CCL_TRANSPORT", "ib"},          {"R2CCL_IBVERBS_LIB", fake_lib()},
      {"R2CCL_SOCKET_IFNAME", "lo"},      {"FAKEVERBS_DIR", fresh_dir()},
      {"FAKEVERBS_DEVICES", kSenderHcas}, {"R2CCL_LOG_FILE", "none"},
      {"R2CCL_BACKUP_PATHS", "1"}};
  std::string out;
  const int rc = run_command(
      perf_command(env, "--ranks 2 --check --channels 4 -b 1M -e 1M -n 3 --stats"), &out);
  INFO(out);
  REQUIRE(rc == 0);
  std::regex re("# rank ([01]) total: switchovers [0-9]+ replays [0-9]+ links ([0-9]+)");
  int ranks = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    const int links = std::stoi((*it)[2]);
    INFO("rank " << (*it)[1]);
    CHECK(links >= 1);  // 0: every path probes on its own
    CHECK(links <= 4);
    ranks++;
  }
  CHECK(ranks == 2);
}

TEST_CASE(
    "verbs: chunk sizes 4 KiB .. 64 MiB (powers of 4) with 1, 4 and 16 QPs per path, adaptive "
    "routing on and off: no path fails, every byte right",
    "[loopback][ib]") {
  SKIP_WITHOUT_FAKE();
  // Each size once, the QP counts and routing modes spread over them (the full matrix is
  // tests/long/test_long_ib_shapes.cc); 16 and 32 KiB with adaptive routing filled the send
  // queue and failed every path before per-QP credits.
  constexpr size_t K = 1024;
  const DataShape shapes[] = {{4 * K, 1, true},     {16 * K, 4, true},     {32 * K, 1, true},
                              {64 * K, 16, false},  {256 * K, 1, true},    {1024 * K, 4, false},
                              {4096 * K, 16, true}, {16384 * K, 1, false}, {65536 * K, 4, true}};
  for (const DataShape& s : shapes) {
    SECTION(shape_text(s)) { check_shape_clean(s); }
  }
}

TEST_CASE(
    "verbs: GPU-like buffers (the fake's visibility fence): every flush reads through each HCA "
    "that wrote, after a failover and with striping; every byte right",
    "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  // FAKEVERBS_FENCE=1 at the receiver: what an HCA writes into a relaxed-ordered (data) MR is
  // invisible until a READ through that HCA, as on a GPU; the receiver flushes each message
  // before checking it (force_flush: host buffers stand in for GPU ones). A flush through
  // the primary HCA only leaves what the backup HCA wrote stale.
  auto run = [](PairOptions o, const char* what) {
    o.receiver_env["FAKEVERBS_FENCE"] = "1";
    o.receiver_env["R2CCL_TEST_HOOKS"] = "force_flush";
    StreamSpec s = short_stream(1.5);
    s.flush = true;
    StreamRun r = run_stream(o, s);
    INFO(what << "\nsender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    CHECK(r.pair.sender_status == kStreamOk);
    CHECK(r.pair.receiver_status == kStreamOk);  // every byte checked after its flush
    return r;
  };
  SECTION("the sender's primary port goes down mid-stream") {
    PairOptions o = ib_pair("port_down,dev=mlx5_0,after_bytes=67108864");
    StreamRun r = run(o, "failover");
    CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
  }
  SECTION("striping over both HCAs") {
    PairOptions o = ib_pair();
    o.env["R2CCL_STRIPE"] = "1";
    run(o, "striping");
  }
}

TEST_CASE(
    "verbs: packets of each QP and HCA wait a random time at the target (seeded), so QPs "
    "and HCAs interleave: no path fails, every byte right",
    "[loopback][ib][timing]") {
  SKIP_WITHOUT_FAKE();
  // FAKEVERBS_DELAY_US: each packet executes 0-3 ms after it arrived, in order per QP only,
  // as independent QPs and HCAs do; the seed each process prints repeats a run. Shapes with
  // many QPs, small chunks and both write modes, and striping over both HCAs.
  constexpr size_t K = 1024;
  // (Every shape with delays: tests/long/test_long_ib_shapes.cc.)
  const DataShape shapes[] = {{16 * K, 16, true}, {1024 * K, 4, false}};
  for (const DataShape& s : shapes) {
    SECTION(shape_text(s)) { check_shape_clean(s, {{"FAKEVERBS_DELAY_US", "3000"}}); }
  }
  SECTION("striping over both HCAs, 4 QPs per path, 64 KiB chunks") {
    check_shape_clean({64 * K, 4, true}, {{"FAKEVERBS_DELAY_US", "3000"}, {"R2CCL_STRIPE", "1"}});
  }
}

TEST_CASE("verbs: a write that lands only in part (the link died mid-message) is replayed whole",
          "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  // The receiver's mlx5_0 takes half of one chunk's bytes, completes nothing, and drops what
  // follows on that QP (out of sequence): the sender's QP runs out of retries, and the chunk
  // goes again on the backup, whole. Message k carries pattern k, so a half-written chunk
  // that were counted as landed would show.
  PairOptions o = ib_pair("", "partial,dev=mlx5_0,after_ms=500");
  StreamSpec st = short_stream(1.5);
  st.pattern_per_message = true;
  StreamRun r = run_stream(o, st);
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
  std::vector<int> lost = to_replay(r.sender_log);
  REQUIRE(lost.size() == 1);
  CHECK(lost[0] >= 1);
}

TEST_CASE("verbs: a full send queue (ENOMEM from ibv_post_send) is back-pressure, not a dead path",
          "[loopback][ib]") {
  SKIP_WITHOUT_FAKE();
  // sq_full: 50 posts on the sender's mlx5_0 find the queue full, as when every slot waits
  // for its completion to be polled. The chunk, CTS or probe goes out later; nothing fails.
  StreamRun r =
      run_stream(ib_pair("sq_full,dev=mlx5_0,count=50,after_bytes=16777216"), short_stream(1.0));
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  for (const std::string* log : {&r.sender_log, &r.receiver_log}) {
    CHECK(count_lines_containing(*log, "failed (") == 0);
    CHECK(count_lines_containing(*log, "switchover") == 0);
  }
}

TEST_CASE("verbs: a fork() in the training process on a kernel before 5.13 breaks nothing",
          "[loopback][ib]") {
  SKIP_WITHOUT_FAKE();
  // FAKEVERBS_KERNEL_FORK=copy: after a fork the HCA's writes into pages registered before
  // ibv_fork_init reach the child's copy, never the parent (as on kernels before 5.13 once the
  // parent writes the page). Both processes fork a short-lived child (a DataLoader worker)
  // after connect, with the connection area and control slots registered: the CTS records,
  // control messages and chunks must still arrive.
  PairOptions o = ib_pair();
  o.env["FAKEVERBS_KERNEL_FORK"] = "copy";
  StreamSpec s = short_stream(1.0);
  s.stall_ms = 5000;
  StreamRun r = run_stream(o, s, [](Endpoint&, bool) {
    const pid_t c = fork();
    if (c == 0) _exit(0);
    int st = 0;
    waitpid(c, &st, 0);
  });
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
}

TEST_CASE("verbs: far-end port down: retry-exceeded with the local port active, exactly once",
          "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  // The receiver's mlx5_0 dies: the sender's own port stays active, so it learns from its
  // completions: one retry-exceeded, then a train of flushes. That must be one failure event
  // and one replay of each unacknowledged chunk.
  StreamRun r = run_stream(ib_pair("", "port_down,dev=mlx5_0,after_ms=400"), short_stream(1.5));
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  CHECK(count_lines_containing(r.sender_log, "path on rail mlx5_0:1 failed") == 1);
  CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
  CHECK(count_lines_containing(r.sender_log, "port error event") == 0);
  CHECK(count_lines_containing(r.receiver_log, "port error event") >= 1);
  std::vector<int> lost = to_replay(r.sender_log), rec = replayed(r.sender_log);
  REQUIRE(lost.size() == 1);
  REQUIRE(rec.size() == 1);
  CHECK(rec[0] == lost[0]);
}

TEST_CASE("verbs: port flaps: lossless, failback by re-created QPs", "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  PairOptions o = ib_pair("flap,dev=mlx5_0,down_ms=150,up_ms=500,count=3,after_bytes=33554432");
  o.env["R2CCL_PROBE_COUNT"] = "2";
  StreamRun r = run_stream(o, short_stream(3.0));
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") >= 2);
  CHECK(count_lines_containing(r.sender_log, "failback: rail mlx5_0:1 is back") >= 1);
  CHECK(count_lines_containing(r.sender_log, "give-up:") == 0);
}

TEST_CASE("verbs: one port down for 300 ms: failback, and the rail then stays in service",
          "[loopback][ib][failover][policy]") {
  SKIP_WITHOUT_FAKE();
  // After failback the primary path carries the stream again for ~2.5 s: a rebuilt path that
  // broke again (e.g. a write to a peer QP not yet connected) would log a second failure.
  PairOptions o = ib_pair("port_down,dev=mlx5_0,after_bytes=33554432,for_ms=300");
  o.env["R2CCL_PROBE_COUNT"] = "2";
  StreamRun r = run_stream(o, short_stream(3.0));
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  CHECK(count_lines_containing(r.sender_log, "path on rail mlx5_0:1 failed") == 1);
  CHECK(count_lines_containing(r.receiver_log, "path on rail mlx5_0:1 failed") == 1);
  CHECK(count_lines_containing(r.sender_log, "failback: rail mlx5_0:1 is back") == 1);
  CHECK(count_lines_containing(r.sender_log + r.receiver_log, "hold-down:") == 0);
}

namespace {

// The stream over a device-fatal error of mlx5_0 at one end: every byte right at both ends,
// the error and the device's reopening logged once at that end, failback, no give-up.
void check_reopened(const StreamRun& r, bool at_sender) {
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  const std::string& hit = at_sender ? r.sender_log : r.receiver_log;
  CHECK(count_lines_containing(hit, "mlx5_0:1 device fatal error") == 1);
  CHECK(count_lines_containing(hit, "mlx5_0:1 device reopened after its fatal error") == 1);
  CHECK(count_lines_containing(r.sender_log, "failback: rail mlx5_0:1 is back") >= 1);
  CHECK(count_lines_containing(r.sender_log + r.receiver_log, "give-up:") == 0);
}

}  // namespace

TEST_CASE("verbs: a device-fatal error (HCA reset): failover, the device is reopened, failback",
          "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  // device_fatal: every QP of mlx5_0 flushes, its context dies (every command but destroy
  // fails with EIO) and the device is unlisted for 500 ms, then listed again as a new
  // incarnation. Without a reopen, the rebuilt path's ibv_create_cq fails on the dead context
  // for ever and the rail never fails back.
  for (const bool at_sender : {true, false}) {
    DYNAMIC_SECTION((at_sender ? "the sender's" : "the receiver's") << " primary HCA") {
      // (The receiver posts hardly any bytes: its trigger is a time.)
      const std::string f = std::string("device_fatal,dev=mlx5_0,") +
                            (at_sender ? "after_bytes=33554432" : "after_ms=400") + ",for_ms=500";
      PairOptions o = at_sender ? ib_pair(f) : ib_pair("", f);
      o.env["R2CCL_PROBE_COUNT"] = "2";
      StreamRun r = run_stream(o, short_stream(2.0));
      check_reopened(r, at_sender);
      INFO("sender log:\n" << r.sender_log);
      CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") >= 1);
    }
  }
}

TEST_CASE(
    "verbs: buffers registered while the primary HCA is dead (device-fatal, reset not done): "
    "registered on the backup, on the primary once it is reopened; failover spread on and off",
    "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  // NCCL registers buffers at any time, so a regMr can come while an HCA's device is dead
  // (every command fails with EIO until its reset is done). Here each process's stream
  // registers its 8 buffers just after the fault (injected in its `before` hook, at once:
  // deterministic). Before, that regMr failed as a whole (as NCCL would, the harness now
  // fails the post); the harness then went on without a registration, so the receiver's CTS
  // carried rkey 0 for every path and the sender's first write on the surviving backup ended
  // the connection with a remote access error: the case above, when its fault at 400 ms came
  // before the receiver's stream had registered its buffers (a slow start on a loaded host;
  // seen mostly with R2CCL_FAILOVER_SPREAD=1).
  for (const bool at_sender : {true, false}) {
    for (const char* spread : {"0", "1"}) {
      DYNAMIC_SECTION((at_sender ? "the sender's" : "the receiver's")
                      << " primary HCA, R2CCL_FAILOVER_SPREAD=" << spread) {
        PairOptions o = ib_pair();
        o.env["R2CCL_PROBE_COUNT"] = "2";
        o.env["R2CCL_FAILOVER_SPREAD"] = spread;
        // (A failure in the hook shows as a missing "device fatal error" line below.)
        auto inject = [at_sender](Endpoint&, bool sender) {
          if (sender != at_sender) return;
          void* dl = dlopen(fake_lib().c_str(), RTLD_NOW | RTLD_NOLOAD);
          auto* f =
              dl ? reinterpret_cast<int (*)(const char*)>(dlsym(dl, "fakeverbs_inject")) : nullptr;
          if (f) f("device_fatal,dev=mlx5_0,for_ms=500");
        };
        check_reopened(run_stream(o, short_stream(2.0), inject), at_sender);
      }
    }
  }
}

TEST_CASE("verbs: a fatal QP (async event) on an idle backup path fails that path at once",
          "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  // The newest QP of the sender's mlx5_1 (QP 3 of the backup path, which carries neither
  // chunks nor probes: those go on QP 0 of the primary and of the backup) goes fatal. Its
  // WRs would complete with errors only once something is posted on it: until then the
  // backup looks healthy, and a failover onto it would find it broken. The event must fail
  // the backup path now, and it is rebuilt.
  PairOptions o = ib_pair("qp_fatal,dev=mlx5_1,after_ms=300");
  o.env["R2CCL_IB_QPS_PER_PATH"] = "4";
  o.env["R2CCL_PROBE_COUNT"] = "2";
  StreamRun r = run_stream(o, short_stream(1.2));
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  CHECK(count_lines_containing(r.sender_log, "async event local work queue catastrophic error") >=
        1);
  CHECK(count_lines_containing(r.sender_log, "backup path on rail mlx5_1:1 failed") == 1);
  CHECK(count_lines_containing(r.sender_log, "switchover:") == 0);
  CHECK(count_lines_containing(r.sender_log + r.receiver_log, "give-up:") == 0);
}

TEST_CASE(
    "verbs: the receiver reports what landed only after draining every completion of the "
    "failed path",
    "[loopback][ib][timing][failover]") {
  SKIP_WITHOUT_FAKE();
  // The receiver's completions lag its sender's by up to 30 ms (FAKEVERBS_RECV_LAG_US), as a
  // busy HCA's can: when its port goes down, hundreds of chunks have landed (the sender has
  // their RC acknowledgements) whose completions are not yet in the CQ. The QPs' move to ERR
  // puts them there, ahead of 16 x 128 receive flushes. A report of the landed state made
  // before all of them are read omits landed chunks, the sender replays them, and the
  // receiver counting them afterwards completes a message whose buffer the replay then
  // writes again, after NCCL got it back (pattern per message shows it).
  PairOptions o = ib_pair("", "ack_loss,dev=mlx5_0,after_ms=700");
  o.receiver_env["FAKEVERBS_RECV_LAG_US"] = "400000";
  o.env["R2CCL_IB_QPS_PER_PATH"] = "16";
  o.env["R2CCL_CHUNK_SIZE"] = "16K";
  StreamSpec st = short_stream(2.0);
  st.msg = 1024 * 1024;
  st.pattern_per_message = true;
  st.check_delay_ms = 50;
  StreamRun r = run_stream(o, st);
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
}

TEST_CASE(
    "verbs: NCCL_IB_TIMEOUT 14 and 22, time-scaled: dropped packets are resent by the QP without "
    "a failover, a black hole is caught within the scaled bound",
    "[loopback][ib][timing][failover]") {
  SKIP_WITHOUT_FAKE();
  // R2CCL_TEST_TIME_SCALE = 2^(timeout - 14) makes one QP try 67 ms in the fake and in the
  // plugin's bounds alike (unscaled: 67 ms at 14, 1.07 s at 18, 17.2 s at 22). The fake's
  // retry budget is the QP's own (FAKEVERBS_RETRY_US unset).
  for (const int t : {14, 22}) {  // the ends of the range users set (18 adds no new case)
    const std::string scale = std::to_string(1 << (t - 14));
    auto pair_at = [&](const std::string& faults) {
      PairOptions o = ib_pair(faults);
      o.env.erase("FAKEVERBS_RETRY_US");
      o.env["NCCL_IB_TIMEOUT"] = std::to_string(t);
      o.env["R2CCL_TEST_TIME_SCALE"] = scale;
      o.env["R2CCL_IB_QPS_PER_PATH"] = "4";
      return o;
    };
    DYNAMIC_SECTION("timeout " << t << ": a tail loss, then a burst of 8 drops lost twice each") {
      StreamRun r = run_stream(pair_at("drop,dev=mlx5_0,count=1,after_bytes=33554432;"
                                       "drop,dev=mlx5_0,count=8,tries=2,after_bytes=100663296"),
                               short_stream(1.0));
      INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
      CHECK(r.pair.sender_status == kStreamOk);
      CHECK(r.pair.receiver_status == kStreamOk);
      // What the drops could cause: the watchdog or retry-exceeded failing a path whose QP
      // was still resending. (A heartbeat miss of an overloaded 2-core host is not theirs.)
      const std::string both = r.sender_log + r.receiver_log;
      CHECK(count_lines_containing(both, "failed (acknowledgement timeout") == 0);
      CHECK(count_lines_containing(both, "failed (completion error") == 0);
      CHECK(count_lines_containing(both, "give-up:") == 0);
    }
    DYNAMIC_SECTION("timeout " << t << ": incast-like queueing, every packet up to 40 ms late") {
      // Congestion delays packets (FAKEVERBS_DELAY_US, seeded) far beyond a data chunk's
      // transfer time but within what the QP itself would wait: nothing may fail.
      PairOptions o = pair_at("");
      o.env["FAKEVERBS_DELAY_US"] = "40000";
      StreamRun r = run_stream(o, short_stream(1.0));
      INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
      CHECK(r.pair.sender_status == kStreamOk);
      CHECK(r.pair.receiver_status == kStreamOk);
      const std::string both = r.sender_log + r.receiver_log;
      CHECK(count_lines_containing(both, "failed (") == 0);
      CHECK(count_lines_containing(both, "give-up:") == 0);
    }
    DYNAMIC_SECTION("timeout " << t << ": a black hole on the sender's primary HCA") {
      // Caught by the sender's watchdog (600 ms over the scaled 134 ms floor) or by the
      // receiver's QPs running out of retries (8 scaled tries, 536 ms): no message may wait
      // 3 s, where unscaled timers would take 34 s (22) or 8.6 s (18) at the least.
      StreamSpec st = short_stream(1.5);
      st.stall_ms = 3000;
      StreamRun r = run_stream(pair_at("blackhole,dev=mlx5_0,after_bytes=33554432"), st);
      INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
      CHECK(r.pair.sender_status == kStreamOk);
      CHECK(r.pair.receiver_status == kStreamOk);
      CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
    }
  }
}

TEST_CASE("verbs: a late write of a failed path cannot land (bilateral ERR); without it, it does",
          "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  // The fake holds one write of mlx5_0 (the sender's watchdog then fails the path) and
  // delivers it after its chunk was replayed and the next message wrote the same buffer.
  // The receiver waits 50 ms after each message before checking it, so a late write has
  // landed by then.
  StreamSpec s = short_stream(0.5);
  s.depth = 1;  // one buffer: the next message reuses it at once
  s.min_messages = 24;
  s.check_delay_ms = 50;
  s.stall_ms = 10000;
  s.pattern_per_message = true;  // the stale write carries the previous message's bytes
  // No failback during the stream: the failed path's QPs must still exist (in ERR, or in RTS
  // without the protection) when the held write arrives.
  const std::map<std::string, std::string> no_failback = {{"R2CCL_RECONNECT_MIN", "10s"},
                                                          {"R2CCL_RECONNECT_MAX", "10s"}};
  {
    PairOptions o = ib_pair("hold_write,dev=mlx5_0,after_bytes=16777216,release_after=2");
    for (const auto& kv : no_failback) o.env[kv.first] = kv.second;
    StreamRun r = run_stream(o, s);
    INFO("protected run\nsender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    CHECK(r.pair.sender_status == kStreamOk);
    CHECK(r.pair.receiver_status == kStreamOk);
    CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
  }
  {
    PairOptions o = ib_pair("hold_write,dev=mlx5_0,after_bytes=16777216,release_after=2");
    for (const auto& kv : no_failback) o.env[kv.first] = kv.second;
    o.env["R2CCL_TEST_HOOKS"] = "no_bilateral_err";
    StreamRun r = run_stream(o, s);
    INFO("no_bilateral_err run\nsender log:\n"
         << r.sender_log << "receiver log:\n"
         << r.receiver_log);
    CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
    CHECK(r.pair.receiver_status == kStreamBadData);  // the late write corrupted a message
  }
}

TEST_CASE("verbs: remote access and local protection errors are fatal, not failed over",
          "[loopback][ib]") {
  SKIP_WITHOUT_FAKE();
  for (const char* kind : {"rkey_error", "lkey_error"}) {
    StreamSpec s = short_stream(10.0);
    s.stall_ms = 8000;
    StreamRun r = run_stream(ib_pair(std::string(kind) + ",dev=mlx5_0,after_bytes=16777216"), s);
    INFO(kind << "\nsender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    CHECK((r.pair.sender_status == kStreamTestFailed || r.pair.sender_status == kStreamPostFailed));
    CHECK(count_lines_containing(r.sender_log, "fatal, not failed over") == 1);
    CHECK(count_lines_containing(r.sender_log, "switchover:") == 0);
    CHECK(count_lines_containing(r.sender_log,
                                 kind[0] == 'r' ? "ncclRemoteError" : "ncclInternalError") == 1);
  }
  // Through r2ccl_perf: the run fails cleanly (exit 1), it does not crash while the peer still
  // writes into buffers the failing rank is about to free.
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::map<std::string, std::string> env = {
        {"R2CCL_TRANSPORT", "ib"},
        {"R2CCL_IBVERBS_LIB", fake_lib()},
        {"R2CCL_SOCKET_IFNAME", "lo"},
        {"FAKEVERBS_DIR", fresh_dir()},
        {"FAKEVERBS_DEVICES", kSenderHcas},
        {"FAKEVERBS_RETRY_US", "250000"},
        {"FAKEVERBS_FAULTS", "rkey_error,dev=mlx5_0,after_bytes=10000000"}};
    std::string out;
    int rc = run_command(perf_command(env, "--ranks 2 --check -b 4M -e 4M -n 50", 60), &out);
    INFO(out);
    CHECK(rc == 1);
    CHECK(out.find("fatal, not failed over") != std::string::npos);
    CHECK(out.find("signal") == std::string::npos);
  }
}

TEST_CASE("verbs: a GID change on the receiver: the path is rebuilt on the new GID",
          "[loopback][ib][failover]") {
  SKIP_WITHOUT_FAKE();
  PairOptions o = ib_pair("", "set_ipv4,dev=mlx5_0,addr=10.210.1.77,after_ms=400");
  o.env["R2CCL_PROBE_COUNT"] = "2";
  StreamRun r = run_stream(o, short_stream(2.5));
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  CHECK(count_lines_containing(r.receiver_log, "GID re-selected") >= 1);
  CHECK(count_lines_containing(r.sender_log, "failback: rail mlx5_0:1 is back") >= 1);
}

// ------------------------------------------------------------------------------------------
// Transport and device selection (one fresh process each).

namespace {

void quiet_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  if (level != NCCL_LOG_WARN && level != NCCL_LOG_INFO) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
}

// Loads the plugin, inits it and prints "ndev=N" and each device's properties.
int probe_devices() {
  void* dl = dlopen(env_or("R2CCL_TEST_PLUGIN", "").c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!dl) return 90;
  auto* t = static_cast<const ncclNet_v11_t*>(dlsym(dl, "ncclNetPlugin_v11"));
  void* ctx = nullptr;
  if (t->init(&ctx, 1, nullptr, quiet_logger, nullptr) != ncclSuccess) return 3;
  int n = 0;
  if (t->devices(&n) != ncclSuccess) return 4;
  fprintf(stderr, "ndev=%d\n", n);
  for (int d = 0; d < n; ++d) {
    ncclNetProperties_v11_t p;
    if (t->getProperties(d, &p) != ncclSuccess) return 5;
    fprintf(stderr, "dev %d name=%s port=%d speed=%d ptr=%d pci=%s\n", d, p.name, p.port, p.speed,
            p.ptrSupport, p.pciPath ? p.pciPath : "(null)");
  }
  t->finalize(ctx);
  return 0;
}

ChildResult probe(std::map<std::string, std::string> env) {
  env.emplace("R2CCL_IBVERBS_LIB", fake_lib());
  env.emplace("FAKEVERBS_DIR", fresh_dir());
  env.emplace("R2CCL_SOCKET_IFNAME", "lo");
  env.emplace("R2CCL_LOG_FILE", "none");
  return run_child(env, probe_devices, 60);
}

}  // namespace

TEST_CASE("transport selection: auto picks verbs only with an active HCA port", "[loopback][ib]") {
  SKIP_WITHOUT_FAKE();
  ChildResult a = probe({{"FAKEVERBS_DEVICES", kSenderHcas}});
  INFO(a.output);
  REQUIRE(a.status == 0);
  CHECK(a.output.find("transport IB") != std::string::npos);
  CHECK(a.output.find("ndev=2") != std::string::npos);
  CHECK(a.output.find("dev 0 name=mlx5_0 port=1 speed=100000 ptr=1 pci=") != std::string::npos);
  CHECK(a.output.find("0000:0b:00.0") != std::string::npos);

  ChildResult down = probe({{"FAKEVERBS_DEVICES", "mlx5_0,eth,10.210.1.1,state=down"}});
  INFO(down.output);
  REQUIRE(down.status == 0);
  CHECK(down.output.find("transport TCP") != std::string::npos);

  ChildResult none = probe({{"FAKEVERBS_DEVICES", ""}});
  REQUIRE(none.status == 0);
  CHECK(none.output.find("transport TCP") != std::string::npos);

  ChildResult nolib = probe({{"R2CCL_IBVERBS_LIB", "/nonexistent/libibverbs.so.1"}});
  REQUIRE(nolib.status == 0);
  CHECK(nolib.output.find("transport TCP") != std::string::npos);
}

TEST_CASE("R2CCL_IB_HCA selects HCAs with NCCL_IB_HCA's syntax", "[loopback][ib]") {
  SKIP_WITHOUT_FAKE();
  ChildResult one = probe({{"FAKEVERBS_DEVICES", kSenderHcas}, {"R2CCL_IB_HCA", "mlx5_1"}});
  INFO(one.output);
  CHECK(one.output.find("ndev=1") != std::string::npos);
  CHECK(one.output.find("dev 0 name=mlx5_1") != std::string::npos);
  ChildResult ex = probe({{"FAKEVERBS_DEVICES", kSenderHcas}, {"NCCL_IB_HCA", "^mlx5_0"}});
  INFO(ex.output);
  CHECK(ex.output.find("ndev=1") != std::string::npos);
  CHECK(ex.output.find("dev 0 name=mlx5_1") != std::string::npos);
  ChildResult exact = probe(
      {{"FAKEVERBS_DEVICES", kSenderHcas}, {"R2CCL_IB_HCA", "=mlx5"}, {"R2CCL_TRANSPORT", "ib"}});
  INFO(exact.output);
  CHECK(exact.status == 3);
  CHECK(exact.output.find("R2CCL_TRANSPORT=ib: no active HCA port") != std::string::npos);
}

TEST_CASE("bad verbs settings fail init with a message naming the variable", "[loopback][ib]") {
  SKIP_WITHOUT_FAKE();
  struct Case {
    std::map<std::string, std::string> env;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {{{"R2CCL_TRANSPORT", "rdma"}},
       "R2CCL_TRANSPORT='rdma': accepted values are auto, ib and tcp"},
      {{{"R2CCL_TRANSPORT", "ib"}, {"R2CCL_IBVERBS_LIB", "/nonexistent/libibverbs.so.1"}},
       "R2CCL_IBVERBS_LIB"},
      {{{"R2CCL_IB_HCA", "mlx5_0:x"}}, "R2CCL_IB_HCA"},
      {{{"R2CCL_IB_TIMEOUT", "40"}}, "R2CCL_IB_TIMEOUT"},
      {{{"NCCL_IB_RETRY_CNT", "9"}}, "NCCL_IB_RETRY_CNT"},
      {{{"R2CCL_IB_QPS_PER_PATH", "0"}}, "R2CCL_IB_QPS_PER_PATH"},
      {{{"R2CCL_IB_ADDR_FAMILY", "AF_UNIX"}}, "R2CCL_IB_ADDR_FAMILY"},
      {{{"R2CCL_IB_ADDR_RANGE", "10.0.0.0/99"}}, "R2CCL_IB_ADDR_RANGE"},
      {{{"R2CCL_NET_GDR_LEVEL", "pxb"}},
       "R2CCL_NET_GDR_LEVEL='pxb': accepted: one of LOC, NVL, NVB, C2C, PIX, PXB, P2C, PXN, PHB, "
       "SYS"},
      {{{"NCCL_NET_GDR_LEVEL", "-1"}}, "NCCL_NET_GDR_LEVEL='-1': accepted: one of LOC"},
  };
  for (const auto& c : cases) {
    std::map<std::string, std::string> env = c.env;
    env.emplace("FAKEVERBS_DEVICES", kSenderHcas);
    ChildResult r = probe(env);
    INFO("expecting '" << c.needle << "'\n" << r.output);
    CHECK(r.status == 3);
    CHECK(r.output.find(c.needle) != std::string::npos);
  }
}

TEST_CASE(
    "verbs: the receiver's predictor drains its port: the sender is told (DRAIN) and the "
    "port's later failure costs no replay",
    "[loopback][ib][predict][policy]") {
  SKIP_WITHOUT_FAKE();
  // The receiver's mlx5_0 port is quiet for a second, then shows thousands of CRC and receive
  // errors a second: a jump from its own floor (a steady level, however high, drains nothing:
  // issue 17), which its baseline (no weights: deterministic) drains within a few 100 ms
  // samples, before the port fails at 2.5 s.
  const std::string root = temp_path("ib-predict-sysfs");
  run_command("rm -rf " + root);
  FakeHcaPort sick(root, "mlx5_0", 1, 100), well(root, "mlx5_1", 1, 100);
  PairOptions o = ib_pair("", "port_down,dev=mlx5_0,after_ms=2500");
  o.env["R2CCL_PREDICT_INTERVAL"] = "100ms";
  o.env["R2CCL_PREDICT_WINDOW"] = "2400ms";
  o.env["R2CCL_PREDICT_MODEL"] = "/nonexistent/r2ccl_lstm.bin";
  o.sender_env["R2CCL_PREDICT"] = "0";  // only the receiving node sees the problem
  o.receiver_env["R2CCL_SYSFS_ROOT"] = root;
  // The counters move in a process of their own, forked before anything else: a thread of
  // this process would be running while run_stream forks the sender and receiver, and a
  // child forked while it held a lock (the allocator's, stdio's) waits on that lock forever
  // (a receiver stuck from its start, seen under AddressSanitizer).
  const pid_t writer = fork();
  REQUIRE(writer >= 0);
  if (writer == 0) {
    const auto start = std::chrono::steady_clock::now();
    auto prev = start;
    NicRates bad;
    bad.crc = 2000;
    bad.rx_err = 500;
    for (;;) {  // until SIGKILL
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const auto now = std::chrono::steady_clock::now();
      const double dt = std::chrono::duration<double>(now - prev).count();
      prev = now;
      const bool rising = std::chrono::duration<double>(now - start).count() > 1.0;
      sick.advance(dt, rising ? bad : NicRates{});
      well.advance(dt, NicRates{});
    }
  }
  StreamRun r = run_stream(o, short_stream(4.0));
  kill(writer, SIGKILL);
  waitpid(writer, nullptr, 0);
  run_command("rm -rf " + root);
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  CHECK(count_lines_containing(r.receiver_log, "r2ccl predict: rail mlx5_0:1 risk") == 1);
  CHECK(count_lines_containing(r.receiver_log, "(baseline)") == 1);
  CHECK(count_lines_containing(r.receiver_log, "rail mlx5_1:1 risk") == 0);
  CHECK(count_lines_containing(r.sender_log, "the peer drains its end of path 0") == 1);
  // The port then really fails: the sender had nothing in flight on it.
  CHECK(count_lines_containing(r.sender_log, "mlx5_0:1") >= 1);
  int lost = 0;
  for (int n : to_replay(r.sender_log)) lost += n;
  CHECK(lost == 0);
}

namespace {

// The listening end of a setup case: a listen comm on device 0, its handle told to the peer.
bool listen_and_say(Endpoint& ep, void** listen) {
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  return ep.plugin.net->listen(ep.ctx, 0, handle, listen) == ncclSuccess && ep.say(handle);
}

}  // namespace

TEST_CASE(
    "verbs: a link-layer mismatch (IB at one end, RoCE at the other) fails connect and "
    "accept within 2 s with one message",
    "[loopback][ib][setup]") {
  SKIP_WITHOUT_FAKE();
  // The two ends must agree on the primary HCA's link layer (docs/ARCHITECTURE.md, "What the
  // two ends negotiate"): the acceptor refuses and tells the connector, so neither waits
  // R2CCL_CONNECT_TIMEOUT (the connector did, for the REPLY), and both name both.
  PairOptions o = ib_pair();
  o.sender_env["FAKEVERBS_DEVICES"] = "mlx5_0,ib,7";
  o.skip_connect = true;
  o.finish_together = true;
  const std::string slog = temp_path("sender.err"), rlog = temp_path("receiver.err");
  o.sender_stderr = slog;
  o.receiver_stderr = rlog;
  PairResult r = run_pair(
      o,
      [&](Endpoint& ep) {
        char handle[NCCL_NET_HANDLE_MAXSIZE];
        if (!ep.hear(handle, 30000)) return 50;
        void* comm = nullptr;
        double secs = 0;
        const ncclResult_t res = connect_until(ep, 0, handle, 30, &comm, &secs);
        fprintf(stderr, "connect: result %d after %.3f s\n", res, secs);
        return res == ncclInvalidUsage && !comm && secs < 2.0 ? 0 : 51;
      },
      [&](Endpoint& ep) {
        void* listen = nullptr;
        if (!listen_and_say(ep, &listen)) return 50;
        void* comm = nullptr;
        double secs = 0;
        const ncclResult_t res = accept_until(ep, listen, 30, &comm, &secs);
        fprintf(stderr, "accept: result %d after %.3f s\n", res, secs);
        ep.plugin.net->closeListen(listen);
        return res == ncclInvalidUsage && !comm && secs < 2.0 ? 0 : 52;
      });
  const std::string s = read_file(slog), rv = read_file(rlog);
  unlink(slog.c_str());
  unlink(rlog.c_str());
  INFO("connector's log:\n" << s << "acceptor's log:\n" << rv);
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
  const std::string text =
      "link layer mismatch: the connecting process's primary HCA port is IB, the listening "
      "process's (mlx5_0) is RoCE";
  CHECK(s.find(text) != std::string::npos);
  CHECK(rv.find(text) != std::string::npos);
}

TEST_CASE(
    "verbs: an older peer's hello (wire version 6, 8 bytes shorter) is refused at once, naming "
    "both versions",
    "[loopback][ib][setup]") {
  SKIP_WITHOUT_FAKE();
  using namespace r2ccl::net;
  using namespace r2ccl::net::ib;
  // Wire version 7 made the setup messages 8 bytes longer (IbSetupMsg::proc_id). A listener
  // reading an older hello must take it at its own length and refuse the version, not wait
  // for 8 bytes that never come (the connector would then wait R2CCL_CONNECT_TIMEOUT).
  PairOptions o = ib_pair();
  o.skip_connect = true;
  o.finish_together = true;
  PairResult r = run_pair(
      o,
      [&](Endpoint& ep) {
        char handle[NCCL_NET_HANDLE_MAXSIZE];
        if (!ep.hear(handle, 30000)) return 50;
        HandleHead h;
        memcpy(&h, handle, sizeof(h));
        if (h.listener.family != AF_INET) return 51;
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = h.listener.port;
        memcpy(&a.sin_addr, h.listener.addr, 4);
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return 52;
        IbSetupMsg m{};
        m.magic = kIbMsgMagic;
        m.version = 6;
        m.type = static_cast<uint16_t>(SetupType::kHello);
        memcpy(m.secret, h.secret, sizeof(m.secret));
        m.listen_id = h.listen_id;
        if (send(fd, &m, kIbSetupMsgSizeV6, 0) != static_cast<ssize_t>(kIbSetupMsgSizeV6))
          return 53;
        const auto t0 = std::chrono::steady_clock::now();
        WireRefusal w{};
        size_t got = 0;
        pollfd p{fd, POLLIN, 0};
        while (got < sizeof(w) && poll(&p, 1, 3000) == 1) {
          const ssize_t n = recv(fd, reinterpret_cast<char*>(&w) + got, sizeof(w) - got, 0);
          if (n <= 0) break;
          got += static_cast<size_t>(n);
        }
        close(fd);
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        w.text[sizeof(w.text) - 1] = 0;
        fprintf(stderr, "refusal: %zu bytes after %.3f s, reason %d: %s\n", got, secs, w.reason,
                w.text);
        if (got != sizeof(w) || w.magic != kRefusalMagic) return 54;
        if (w.reason != static_cast<uint8_t>(Refusal::kVersion)) return 55;
        if (!strstr(w.text, "version 6") || !strstr(w.text, "version 7")) return 56;
        return secs < 2.0 ? 0 : 57;
      },
      [&](Endpoint& ep) {
        void* listen = nullptr;
        if (!listen_and_say(ep, &listen)) return 50;
        void* comm = nullptr;
        double secs = 0;
        accept_until(ep, listen, 3, &comm, &secs);  // the stranger never becomes a comm
        ep.plugin.net->closeListen(listen);
        return comm ? 58 : 0;
      });
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
}

// ------------------------------------------------------------------------------------------
// Addressing as strict as real HCAs (issue 14; tests/fakeverbs/README.md "Addressing"): P_Keys,
// a port that requires a GRH, unequal MTUs, big GID tables with VLAN entries, GIDs removed
// and re-added around a port flap.

namespace {

// Two IB HCAs per host (LIDs 1/3 at the sender, 2/4 at the receiver), each with `opts`.
PairOptions ib_link_pair(const std::string& sender_opts, const std::string& receiver_opts) {
  PairOptions o = ib_pair();
  o.sender_env["FAKEVERBS_DEVICES"] = "mlx5_0,ib,1" + sender_opts + ";mlx5_1,ib,3" + sender_opts;
  o.receiver_env["FAKEVERBS_DEVICES"] =
      "mlx5_0,ib,2" + receiver_opts + ";mlx5_1,ib,4" + receiver_opts;
  o.timeout_s = 40;
  return o;
}

// A stream whose addressing must be right: both ends OK, every byte intact, and no QP lost
// a packet (a dropped packet ends its WR in retry-exceeded, a "completion error"; a path that
// a loaded 2-core CI machine starves may still miss heartbeats, which says nothing here).
void check_clean(const StreamRun& r) {
  CHECK(r.pair.sender_status == kStreamOk);
  CHECK(r.pair.receiver_status == kStreamOk);
  for (const std::string* log : {&r.sender_log, &r.receiver_log}) {
    CHECK(count_lines_containing(*log, "completion error") == 0);
    CHECK(count_lines_containing(*log, "give-up:") == 0);
  }
}

StreamSpec quick_stream() {
  StreamSpec s = short_stream(0.5);
  s.min_messages = 16;
  s.stall_ms = 8000;
  return s;
}

}  // namespace

namespace {

// Three RoCE HCAs per host around one GPU (the fake's pci= paths below
// pci0000:00): the GPU and mlx5_0 (the primary) and mlx5_1 each sit on a downstream port of
// one PCIe switch (upstream port 0000:0a:00.0): PIX from the GPU; mlx5_2 hangs off another
// root port of the same root complex: PHB, beyond NCCL's default NCCL_NET_GDR_LEVEL (PXB).
std::string gdr_hcas(int host) {
  const std::string h = std::to_string(host);
  return "mlx5_0,eth,10.210.1." + h +
         ",pci=0000:00:01.0/0000:0a:00.0/0000:0b:01.0/0000:0d:00.0,numa=0;"
         "mlx5_1,eth,10.210.2." +
         h +
         ",pci=0000:00:01.0/0000:0a:00.0/0000:0b:02.0/0000:0e:00.0,numa=0;"
         "mlx5_2,eth,10.210.3." +
         h + ",pci=0000:00:03.0/0000:40:00.0,numa=0";
}
const char* const kGdrGpu =
    "/nonexistent/devices/pci0000:00/0000:00:01.0/0000:0a:00.0/0000:0b:00.0/0000:0c:00.0";

// Both ends: the three HCAs, two backups, every buffer registered as NCCL_PTR_CUDA with its
// GPU at kGdrGpu, the receiver's writes invisible until its flush (FAKEVERBS_FENCE=1).
PairOptions gdr_pair(const std::string& sender_faults) {
  PairOptions o = ib_pair(sender_faults);
  o.sender_env["FAKEVERBS_DEVICES"] = gdr_hcas(1);
  o.receiver_env["FAKEVERBS_DEVICES"] = gdr_hcas(2);
  o.receiver_env["FAKEVERBS_FENCE"] = "1";
  o.env["R2CCL_BACKUP_PATHS"] = "2";
  o.env["R2CCL_TEST_HOOKS"] = std::string("gpu_pci=") + kGdrGpu;
  o.env["R2CCL_TEST_VERBOSE"] = "1";  // INFO lines on stderr
  return o;
}

// payload bytes the sender put on each rail ("mlx5_2:1" -> N), from getStats.
std::map<std::string, long long> rail_bytes(const std::string& stats) {
  std::map<std::string, long long> out;
  std::regex re("\"name\":\"([^\"]+)\"[^}]*\"bytes_sent\":([0-9]+)");
  for (auto it = std::sregex_iterator(stats.begin(), stats.end(), re); it != std::sregex_iterator();
       ++it)
    out[(*it)[1]] = std::stoll((*it)[2]);
  return out;
}

struct GdrRun {
  StreamRun r;
  std::string sender_err, receiver_err;   // stderr (NCCL_DEBUG=INFO lines)
  std::map<std::string, long long> sent;  // the sender's bytes per rail
};

GdrRun run_gdr(PairOptions o, StreamSpec s) {
  GdrRun g;
  const std::string stats = temp_path("gdr-stats"), se = temp_path("gdr-s.err"),
                    re = temp_path("gdr-r.err");
  o.sender_stderr = se;
  o.receiver_stderr = re;
  s.flush = true;
  g.r = run_stream(
      o, s, [](Endpoint& ep, bool) { ep.mr_type = NCCL_PTR_CUDA; },
      [&](Endpoint& ep, bool sender) {
        if (!sender) return 0;
        auto* ext = static_cast<const r2cclExt_v1_t*>(dlsym(ep.plugin.dl, R2CCL_EXT_SYMBOL_V1));
        if (!ext) return 60;
        char buf[16384];
        ext->getStats(buf, sizeof(buf));
        FILE* f = fopen(stats.c_str(), "w");
        if (!f) return 61;
        fputs(buf, f);
        fclose(f);
        return 0;
      });
  g.sent = rail_bytes(read_file(stats));
  g.sender_err = read_file(se);
  g.receiver_err = read_file(re);
  for (const auto& p : {stats, se, re}) unlink(p.c_str());
  return g;
}

}  // namespace

TEST_CASE("verbs: IB ports that require a GRH (IBV_QPF_GRH_REQUIRED): every QP carries one",
          "[loopback][ib][addr]") {
  SKIP_WITHOUT_FAKE();
  // The kernel refuses modify_qp to RTR without a GRH on such a port (EINVAL), and the port
  // drops packets that arrive without one: both ends must address by GID (NCCL does so when
  // its own port requires it; r2ccl also when the peer's does, which the wire tells it).
  SECTION("both ends") {
    StreamRun r = run_stream(ib_link_pair(",grh_required", ",grh_required"), quick_stream());
    INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    check_clean(r);
  }
  SECTION("only the receiver's ports") {
    StreamRun r = run_stream(ib_link_pair("", ",grh_required"), quick_stream());
    INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    check_clean(r);
  }
}

TEST_CASE("verbs: R2CCL_IB_PKEY names the partition; its index is looked up per port",
          "[loopback][ib][addr]") {
  SKIP_WITHOUT_FAKE();
  // Hosts that are limited members (0x7fff) of the default partition cannot talk to each
  // other through it (IBA: a full member at one end at least), only through 0x8001, at
  // another index of each port's table.
  SECTION("0x8001 at index 1 at both ends") {
    PairOptions o = ib_link_pair(",pkeys=0x7fff:0x8001", ",pkeys=0x7fff:0x8001");
    o.env["R2CCL_IB_PKEY"] = "0x8001";
    StreamRun r = run_stream(o, quick_stream());
    INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    check_clean(r);
  }
  SECTION("tables in another order at the receiver") {
    PairOptions o = ib_link_pair(",pkeys=0x7fff:0x8001", ",pkeys=0x8001:0x7fff");
    o.env["R2CCL_IB_PKEY"] = "0x8001";
    StreamRun r = run_stream(o, quick_stream());
    INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    check_clean(r);
  }
  SECTION("NCCL_IB_PKEY is an index, as in NCCL") {
    PairOptions o = ib_link_pair(",pkeys=0x7fff:0x8001", ",pkeys=0x7fff:0x8001");
    o.env["NCCL_IB_PKEY"] = "1";
    StreamRun r = run_stream(o, quick_stream());
    INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    check_clean(r);
  }
}

TEST_CASE("verbs: a P_Key that is not in the table fails init naming it and the table",
          "[loopback][ib][addr]") {
  SKIP_WITHOUT_FAKE();
  ChildResult a = probe({{"FAKEVERBS_DEVICES", "mlx5_0,ib,1,pkeys=0xffff:0x8001"},
                         {"R2CCL_TRANSPORT", "ib"},
                         {"R2CCL_IB_PKEY", "0x8002"}});
  INFO(a.output);
  CHECK(a.status == 3);
  CHECK(
      a.output.find("R2CCL_IB_PKEY=0x8002: not in the P_Key table of mlx5_0:1 (0xffff, 0x8001)") !=
      std::string::npos);
  ChildResult b = probe({{"FAKEVERBS_DEVICES", "mlx5_0,ib,1,pkeys=0xffff:0x8001"},
                         {"R2CCL_TRANSPORT", "ib"},
                         {"NCCL_IB_PKEY", "2"}});
  INFO(b.output);
  CHECK(b.status == 3);
  CHECK(b.output.find("NCCL_IB_PKEY=2: no P_Key index 2 on mlx5_0:1 (0xffff, 0x8001)") !=
        std::string::npos);
  ChildResult c = probe({{"FAKEVERBS_DEVICES", "mlx5_0,ib,1"}, {"R2CCL_IB_PKEY", "0x18001"}});
  INFO(c.output);
  CHECK(c.status == 3);
  CHECK(c.output.find("R2CCL_IB_PKEY='0x18001'") != std::string::npos);
}

TEST_CASE("verbs: unequal MTUs at the two ends: the path MTU is the smaller, nothing is lost",
          "[loopback][ib][addr]") {
  SKIP_WITHOUT_FAKE();
  // A packet larger than either port's active MTU is dropped by the fabric (the fake drops
  // it too); the QP's path MTU must be the smaller of both ends' active MTUs.
  PairOptions o = ib_pair();
  o.sender_env["FAKEVERBS_DEVICES"] =
      "mlx5_0,eth,10.210.1.1,mtu=4096;mlx5_1,eth,10.210.2.1,mtu=2048";
  o.receiver_env["FAKEVERBS_DEVICES"] =
      "mlx5_0,eth,10.210.1.2,mtu=1024;mlx5_1,eth,10.210.2.2,mtu=4096";
  o.env["R2CCL_STRIPE"] = "1";  // both paths carry chunks
  o.timeout_s = 40;
  StreamRun r = run_stream(o, quick_stream());
  INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
  check_clean(r);
}
TEST_CASE(
    "verbs: a port flap removes the IP GIDs and re-adds them at other indices: failback uses "
    "the new index",
    "[loopback][ib][addr][failover]") {
  SKIP_WITHOUT_FAKE();
  // Real RoCE: the netdev going down deletes its IP-based GIDs (GID_CHANGE; the port is left
  // with its link-local ones), its return adds them again, here at 4/5 instead of 2/3 (the
  // fake's gids=move; the kernel does not reuse a slot an old QP still holds). A QP built on
  // the old index fails at RTR (the slot is empty, EINVAL) and one addressed to the old
  // index's GID loses its packets: the failback must run on the re-selected GID, and the
  // flapped end's log must say which (gid[5]).
  auto check = [](const StreamRun& r, const std::string& flapped_log) {
    INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
    CHECK(r.pair.sender_status == kStreamOk);
    CHECK(r.pair.receiver_status == kStreamOk);
    CHECK(count_lines_containing(r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
    CHECK(count_lines_containing(r.sender_log, "failback: rail mlx5_0:1 is back") == 1);
    CHECK(count_lines_containing(flapped_log,
                                 "GID re-selected, now mlx5_0:1 RoCEv2 "
                                 "gid[5]=::ffff:10.210.1.") >= 1);
    CHECK(count_lines_containing(r.sender_log + r.receiver_log, "give-up:") == 0);
  };
  SECTION("the sender's primary port") {
    PairOptions o = ib_pair("port_down,dev=mlx5_0,after_bytes=33554432,for_ms=300,gids=move");
    o.env["R2CCL_PROBE_COUNT"] = "2";
    StreamRun r = run_stream(o, short_stream(2.0));
    check(r, r.sender_log);
  }
  SECTION("the receiver's primary port") {
    PairOptions o = ib_pair("", "port_down,dev=mlx5_0,after_ms=300,for_ms=300,gids=move");
    o.env["R2CCL_PROBE_COUNT"] = "2";
    StreamRun r = run_stream(o, short_stream(2.0));
    check(r, r.receiver_log);
  }
}

TEST_CASE(
    "verbs: 255-entry GID tables with VLAN and IPv6 entries, in another order at each end: "
    "both ends pick the GID of the port's own netdev",
    "[loopback][ib][addr]") {
  SKIP_WITHOUT_FAKE();
  // gids=255: link-local, IPv4 and global IPv6 GIDs (RoCE v1 and v2) of the port's netdev,
  // then the same for VLAN netdevs eth<i>.100, .101, ...; gid_rotate moves them around, so
  // at the receiver VLAN GIDs come first. RoCE frames carry their source netdev's VLAN, so
  // two ends on different VLANs cannot talk (the fake drops such packets).
  auto devices = [](const char* host, int rotate) {
    const std::string r = ",gids=255,gid_rotate=" + std::to_string(rotate);
    return std::string("mlx5_0,eth,10.210.1.") + host + r + ";mlx5_1,eth,10.210.2." + host + r;
  };
  for (const char* family : {"AF_INET", "AF_INET6"}) {
    DYNAMIC_SECTION(family) {
      PairOptions o = ib_pair();
      o.sender_env["FAKEVERBS_DEVICES"] = devices("1", 0);
      o.receiver_env["FAKEVERBS_DEVICES"] = devices("2", 150);
      o.env["R2CCL_IB_ADDR_FAMILY"] = family;
      o.timeout_s = 40;
      StreamRun r = run_stream(o, quick_stream());
      INFO("sender log:\n" << r.sender_log << "receiver log:\n" << r.receiver_log);
      check_clean(r);
    }
  }
}

TEST_CASE(
    "verbs: GPU buffers stay off backup HCAs beyond NCCL_NET_GDR_LEVEL: no byte through them, "
    "failover to the allowed backup, a clear failure when none is left",
    "[loopback][ib][failover][gdr]") {
  SKIP_WITHOUT_FAKE();
  SECTION("default level PXB, striping, the primary's port goes down: mlx5_2 (PHB) carries none") {
    // Striping would spread every message over all three paths; the primary then dies and
    // its chunks are replayed. mlx5_2 must carry none of it, mlx5_1 (PIX) carries on.
    PairOptions o = gdr_pair("port_down,dev=mlx5_0,after_bytes=33554432");
    o.env["R2CCL_STRIPE"] = "1";
    GdrRun g = run_gdr(o, short_stream(1.0));
    INFO("sender log:\n"
         << g.r.sender_log << g.sender_err << "receiver log:\n"
         << g.r.receiver_log << g.receiver_err);
    CHECK(g.r.pair.sender_status == kStreamOk);
    CHECK(g.r.pair.receiver_status == kStreamOk);  // every byte checked after its flush
    CHECK(g.sent["mlx5_1:1"] > 0);
    CHECK(g.sent["mlx5_2:1"] == 0);
    CHECK(count_lines_containing(g.r.sender_log, "switchover: rail mlx5_0:1 failed") == 1);
    CHECK(count_lines_containing(g.r.sender_log, "-> rail mlx5_1:1;") == 1);
    const std::vector<int> lost = to_replay(g.r.sender_log), rec = replayed(g.r.sender_log);
    REQUIRE(lost.size() == 1);
    REQUIRE(rec.size() == 1);
    CHECK(rec[0] == lost[0]);  // every replayed chunk acknowledged, none through mlx5_2
    const std::string line =
        "GPU buffers (the GPU at " + std::string(kGdrGpu) +
        ") use backups mlx5_1:1 (PIX); excluded, beyond the level: mlx5_2:1 (PHB) (within "
        "R2CCL_NET_GDR_LEVEL=PXB (default))";
    CHECK(count_lines_containing(g.sender_err, line) == 1);  // once per connection
    CHECK(count_lines_containing(g.receiver_err, line) == 1);
  }
  SECTION("NCCL_NET_GDR_LEVEL=PHB (read as the fallback): every backup carries GPU buffers") {
    PairOptions o = gdr_pair("");
    o.env["R2CCL_STRIPE"] = "1";
    o.env["NCCL_NET_GDR_LEVEL"] = "PHB";
    GdrRun g = run_gdr(o, short_stream(0.5));
    INFO("sender log:\n" << g.r.sender_log << g.sender_err);
    CHECK(g.r.pair.sender_status == kStreamOk);
    CHECK(g.r.pair.receiver_status == kStreamOk);
    CHECK(g.sent["mlx5_1:1"] > 0);
    CHECK(g.sent["mlx5_2:1"] > 0);
    CHECK(count_lines_containing(g.sender_err, "(within NCCL_NET_GDR_LEVEL=PHB)") == 1);
  }
  SECTION("legacy level 0 (LOC): no backup; the primary's failure fails the stream, no spill") {
    PairOptions o = gdr_pair("port_down,dev=mlx5_0,after_bytes=33554432");
    o.env["R2CCL_NET_GDR_LEVEL"] = "0";
    o.env["R2CCL_FAILOVER_TIMEOUT"] = "500ms";
    StreamSpec s = short_stream(1.0);
    s.stall_ms = 8000;
    GdrRun g = run_gdr(o, s);
    INFO("sender log:\n"
         << g.r.sender_log << g.sender_err << "receiver log:\n"
         << g.r.receiver_log << g.receiver_err);
    CHECK(g.r.pair.sender_status != kStreamOk);
    CHECK(g.sent["mlx5_1:1"] == 0);
    CHECK(g.sent["mlx5_2:1"] == 0);
    CHECK(count_lines_containing(g.sender_err,
                                 "have no backup path: mlx5_1:1 (PIX), mlx5_2:1 (PHB) beyond "
                                 "R2CCL_NET_GDR_LEVEL=0") == 1);
    CHECK(count_lines_containing(g.r.sender_log, "give-up: send conn") == 1);
    CHECK(count_lines_containing(g.r.sender_log, "no usable path may carry message") == 1);
    CHECK(count_lines_containing(g.r.sender_log, "fail with ncclSystemError") == 1);
  }
}

TEST_CASE(
    "verbs: backups pair by each end's real subnet (the netdev's prefix), not an IPv4 /24 "
    "guess; a backup with partners only on other subnets is used routed, and said so",
    "[loopback][ib][setup]") {
  SKIP_WITHOUT_FAKE();
  // The listening end pairs its backups with the connector's candidates. Its mlx5_1 is
  // 10.211.7.2/16: the connector's mlx5_1 (10.211.5.1/16) shares that subnet under both
  // prefixes; the connector's mlx5_2 (10.211.7.129/25) shares only the /24, and under its own
  // /25 the listener's address is elsewhere. The listener's mlx5_2 (10.211.7.130/25) is the
  // connector's mlx5_2's partner.
  auto run = [](const std::string& sender_hcas, const std::string& receiver_hcas) {
    PairOptions o = ib_pair();
    o.sender_env["FAKEVERBS_DEVICES"] = sender_hcas;
    o.receiver_env["FAKEVERBS_DEVICES"] = receiver_hcas;
    o.env["R2CCL_BACKUP_PATHS"] = "2";
    o.env["R2CCL_STRIPE"] = "1";  // every path carries data
    o.env["R2CCL_TEST_VERBOSE"] = "1";
    const std::string se = temp_path("pair-s.err"), re = temp_path("pair-r.err");
    o.sender_stderr = se;
    o.receiver_stderr = re;
    StreamRun r = run_stream(o, short_stream(0.5));
    std::pair<std::string, std::string> err{read_file(se), read_file(re)};
    unlink(se.c_str());
    unlink(re.c_str());
    INFO("connector:\n" << err.first << "listener:\n" << err.second);
    CHECK(r.pair.sender_status == kStreamOk);
    CHECK(r.pair.receiver_status == kStreamOk);
    return err;
  };
  SECTION("/16 and /25 subnets that one /24 guess mixes up") {
    auto err = run(
        "mlx5_0,eth,10.210.1.1;mlx5_1,eth,10.211.5.1,prefix=16;mlx5_2,eth,10.211.7.129,prefix=25",
        "mlx5_0,eth,10.210.1.2;mlx5_1,eth,10.211.7.2,prefix=16;mlx5_2,eth,10.211.7.130,prefix=25");
    INFO("connector:\n" << err.first << "listener:\n" << err.second);
    CHECK(count_lines_containing(
              err.second,
              "recv connection on dev 0: 3 paths (mlx5_0:1 -> ::ffff:10.210.1.1, "
              "mlx5_1:1 -> ::ffff:10.211.5.1, mlx5_2:1 -> ::ffff:10.211.7.129)") == 1);
    CHECK(count_lines_containing(
              err.first,
              "send connection on dev 0: 3 paths (mlx5_0:1 -> ::ffff:10.210.1.2, "
              "mlx5_1:1 -> ::ffff:10.211.7.2, mlx5_2:1 -> ::ffff:10.211.7.130)") == 1);
    CHECK(count_lines_containing(err.first + err.second, "crosses subnets") == 0);
    CHECK(count_lines_containing(err.second, "mlx5_1:1 subnet 10.211.0.0/16") == 1);
    CHECK(count_lines_containing(err.second, "mlx5_2:1 subnet 10.211.7.128/25") == 1);
  }
  SECTION("no partner on the backup's subnet: paired across subnets, INFO at both ends") {
    auto err =
        run("mlx5_0,eth,10.210.1.1;mlx5_1,eth,10.211.5.1,prefix=16;mlx5_2,eth,10.213.0.1,"
            "prefix=16",
            "mlx5_0,eth,10.210.1.2;mlx5_1,eth,10.211.7.2,prefix=16;mlx5_2,eth,10.212.0.2,"
            "prefix=16");
    CHECK(count_lines_containing(err.second,
                                 "3 paths (mlx5_0:1 -> ::ffff:10.210.1.1, mlx5_1:1 -> "
                                 "::ffff:10.211.5.1, mlx5_2:1 -> ::ffff:10.213.0.1)") == 1);
    CHECK(count_lines_containing(err.second,
                                 "recv connection on dev 0: backup path 2 (mlx5_2:1 -> "
                                 "::ffff:10.213.0.1) crosses subnets (10.212.0.0/16 here, "
                                 "10.213.0.0/16 at the peer): usable where the fabric routes") ==
          1);
    CHECK(count_lines_containing(err.first,
                                 "send connection on dev 0: backup path 2 (mlx5_2:1 -> "
                                 "::ffff:10.212.0.2) crosses subnets (10.213.0.0/16 here, "
                                 "10.212.0.0/16 at the peer)") == 1);
  }
}
