#include "transports.h"

#include "endpoint_checks.h"

#include <sys/stat.h>
#include <unistd.h>

#include <vector>

namespace r2ccl::test {
namespace {

const char* kTwoLoRails = "lo@127.0.0.1,lo@127.0.0.2";

// FAKEVERBS_DIR of each run, removed when the test binary exits (only by the process that
// made them: forked children exit through the same static destructors).
struct TempDirs {
  pid_t owner = getpid();
  std::vector<std::string> dirs;
  ~TempDirs() {
    if (getpid() != owner) return;
    for (const auto& d : dirs) run_command("rm -rf " + shell_quote(d));
  }
};
TempDirs g_dirs;

}  // namespace

const char* const kFakeSenderHcas =
    "mlx5_0,eth,10.210.1.1,pci=0000:00:01.0/0000:0b:00.0,numa=0;"
    "mlx5_1,eth,10.210.2.1,pci=0000:00:01.0/0000:0c:00.0,numa=0";
const char* const kFakeReceiverHcas =
    "mlx5_0,eth,10.210.1.2,pci=0000:00:01.0/0000:0b:00.0,numa=0;"
    "mlx5_1,eth,10.210.2.2,pci=0000:00:01.0/0000:0c:00.0,numa=0";

std::string fake_verbs_lib() { return env_or("R2CCL_TEST_FAKEVERBS", ""); }

std::string fresh_fake_dir() {
  std::string d = temp_path("fakeverbs-" + std::to_string(g_dirs.dirs.size()));
  mkdir(d.c_str(), 0700);
  g_dirs.dirs.push_back(d);
  return d;
}

PairOptions TransportUnderTest::pair(const std::map<std::string, std::string>& extra) const {
  PairOptions o;
  if (name == "tcp") {
    o.env = {{"R2CCL_TRANSPORT", "tcp"}, {"R2CCL_SOCKET_IFNAME", kTwoLoRails}};
    // Ranks for R2CCL_FAULT_INJECT entries aimed at one side: sender 0, receiver 1.
    o.sender_env = {{"R2CCL_RANK", "0"}};
    o.receiver_env = {{"R2CCL_RANK", "1"}};
  } else {
    o.env = {{"R2CCL_TRANSPORT", "ib"},
             {"R2CCL_IBVERBS_LIB", fake_verbs_lib()},
             {"R2CCL_SOCKET_IFNAME", "lo"},
             {"FAKEVERBS_DIR", fresh_fake_dir()},
             // retry-exceeded 250 ms after a packet is lost (real QPs: R2CCL_IB_TIMEOUT x
             // retries), a 600 ms acknowledgement watchdog and a 600 ms heartbeat rule
             // (3 x 200 ms): a 2-core machine running these under AddressSanitizer, or beside
             // a parallel build, must not see a slow ACK as a dead path. The fake's NIC is a
             // thread of each test process, so a starved process stops answering for a while
             // (a real HCA would not); 300 ms of silence from both paths at once was seen.
             {"FAKEVERBS_RETRY_US", "250000"},
             {"R2CCL_ACK_TIMEOUT", "600ms"},
             {"R2CCL_HEARTBEAT_INTERVAL", "200ms"}};
    o.sender_env = {{"FAKEVERBS_DEVICES", kFakeSenderHcas}};
    o.receiver_env = {{"FAKEVERBS_DEVICES", kFakeReceiverHcas}};
  }
  for (const auto& kv : extra) o.env[kv.first] = kv.second;
  o.timeout_s = 300;
  return o;
}

std::map<std::string, std::string> TransportUnderTest::perf_env() const {
  if (name == "tcp") return {{"R2CCL_TRANSPORT", "tcp"}, {"R2CCL_SOCKET_IFNAME", kTwoLoRails}};
  return {{"R2CCL_TRANSPORT", "ib"},
          {"R2CCL_IBVERBS_LIB", fake_verbs_lib()},
          {"R2CCL_SOCKET_IFNAME", "lo"},
          {"FAKEVERBS_DIR", fresh_fake_dir()},
          {"FAKEVERBS_DEVICES", kFakeSenderHcas},
          {"R2CCL_LOG_FILE", "none"}};
}

void TransportUnderTest::primary_down(PairOptions* o) const {
  if (name == "tcp") {
    o->env["R2CCL_FAULT_INJECT"] = "rank=-1,rail=0,at=150,kind=reset";
    // Failure detection is not the subject: a reset is seen at once (the socket closes).
    // Generous heartbeat/ack timeouts keep a CPU-starved moment on a busy CI machine from
    // failing rail 1 as well. R2CCL_PATH_WINDOW=64M: the injector's reset is abortive, but
    // the kernel still delivers what it had queued, so only chunks the sender had not yet
    // handed to its socket are lost; a window larger than the socket buffers keeps such a
    // backlog while the stream runs.
    o->env["R2CCL_HEARTBEAT_INTERVAL"] = "500ms";
    o->env["R2CCL_ACK_TIMEOUT"] = "3s";
    o->env["R2CCL_TCP_USER_TIMEOUT"] = "5s";
    o->env["R2CCL_PATH_WINDOW"] = "64M";
  } else {
    o->sender_env["FAKEVERBS_FAULTS"] = "port_down,dev=mlx5_0,after_bytes=67108864";
  }
}

void TransportUnderTest::far_primary_lost(PairOptions* o) const {
  // TCP: an abortive reset of the receiver's rail 0 while a receive is partly landed (the
  // injector waits for one): what its socket had queued and not yet read is lost for sure (on
  // lo a sender-side fault often loses nothing: the chunks "in flight" have landed and only
  // their acknowledgements are lost; a receiver-side black hole also swallows its CTS, so the
  // sender may have nothing in flight). Verbs: the receiver's port dies, so writes in flight
  // towards it are lost.
  if (name == "tcp")
    o->env["R2CCL_FAULT_INJECT"] = "rank=1,rail=0,at=150,kind=reset";
  else
    o->receiver_env["FAKEVERBS_FAULTS"] = "port_down,dev=mlx5_0,after_ms=400";
}

void TransportUnderTest::primary_blackhole(PairOptions* o) const {
  if (name == "tcp") {
    // Default detectors: the acknowledgement watchdog (R2CCL_ACK_TIMEOUT) finds it.
    o->env["R2CCL_FAULT_INJECT"] = "rank=-1,rail=0,at=150,kind=blackhole";
  } else {
    // Real QP timeouts (retry-exceeded after seconds): the acknowledgement watchdog of one
    // end or the other must be what finds the silent QP.
    o->sender_env["FAKEVERBS_FAULTS"] = "blackhole,dev=mlx5_0,after_bytes=67108864";
    o->env["FAKEVERBS_RETRY_US"] = "5000000";
  }
}

void TransportUnderTest::all_down(PairOptions* o) const {
  if (name == "tcp") {
    o->env["R2CCL_FAULT_INJECT"] =
        "rank=-1,rail=0,at=150,kind=reset;rank=-1,rail=1,at=150,kind=reset";
  } else {
    o->sender_env["FAKEVERBS_FAULTS"] =
        "port_down,dev=mlx5_0,after_bytes=33554432;port_down,dev=mlx5_1,after_bytes=33554432";
  }
}

TransportUnderTest tcp_lo() {
  TransportUnderTest t;
  t.name = "tcp";
  t.rail0 = "lo@127.0.0.1";
  t.receiver_acks = true;
  return t;
}

TransportUnderTest ib_fake() {
  TransportUnderTest t;
  t.name = "ib";
  t.rail0 = "mlx5_0:1";
  t.receiver_acks = false;
  t.down_evidence = "port error event";
  return t;
}

}  // namespace r2ccl::test

namespace r2ccl::test {

int check_received(const char* buf, size_t sent, size_t cap, size_t tail, int reported,
                   uint64_t seed) {
  EP_REQUIRE(reported >= 0 && static_cast<size_t>(reported) == sent, 20,
             "reported size %d, sent %zu (capacity %zu)", reported, sent, cap);
  const long long bad = check_pattern(buf, sent, seed);
  EP_REQUIRE(bad < 0, 21, "message of %zu bytes (seed %llu): first wrong byte at offset %lld", sent,
             static_cast<unsigned long long>(seed), bad);
  for (size_t i = sent; i < cap + tail; ++i)
    EP_REQUIRE(static_cast<uint8_t>(buf[i]) == kCanary, 22,
               "message of %zu bytes into %zu: byte %zu past the end was overwritten", sent, cap,
               i);
  return 0;
}

}  // namespace r2ccl::test
