// The failure predictor's pure parts: counter deltas (wraps, saturation, resets, missing
// values), the sysfs reader on fake counter trees, features, the weights file parser, the
// LSTM equations, the baseline and the drain hysteresis, and the trace reader.
#include <linux/ethtool_netlink.h>
#include <linux/genetlink.h>
#include <linux/netlink.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "r2ccl/predict/counters.h"
#include "r2ccl/predict/features.h"
#include "r2ccl/predict/fec.h"
#include "r2ccl/predict/model.h"
#include "r2ccl/predict/predictor.h"
#include "r2ccl/predict/trace.h"

using namespace r2ccl::predict;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/r2ccl-predict-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

void write_file(const std::string& path, const std::string& text) {
  // mkdir -p of the parent
  for (size_t p = 1; (p = path.find('/', p)) != std::string::npos; ++p)
    ::mkdir(path.substr(0, p).c_str(), 0755);
  std::ofstream f(path);
  f << text;
  REQUIRE(f.good());
}

// A weights file in the documented layout, from explicit parameters.
struct ModelSpec {
  uint32_t F = kNumFeatures, H = 2, W = 4, horizon = 30, version = kModelVersion;
  float interval = 5;
  std::vector<float> mean = std::vector<float>(kNumFeatures, 0.0f);
  std::vector<float> stdev = std::vector<float>(kNumFeatures, 1.0f);
  float thr[4] = {1, 2, 3, 4};
  float steps = 2;
  float rise[4] = {0, 0, 0, 0};  // lag, least, ratio, level: off
  std::vector<float> w_ih, w_hh, b_ih, b_hh, w_out;
  float b_out = 0;
  std::string meta = "{\"seed\": 7}";
};

void put_u32(std::vector<uint8_t>* b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_f32(std::vector<uint8_t>* b, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  put_u32(b, u);
}
std::vector<uint8_t> build_model(ModelSpec s) {
  const size_t G = 4 * s.H;
  auto fill = [](std::vector<float>* v, size_t n, float scale) {
    if (v->empty())
      for (size_t i = 0; i < n; ++i) v->push_back(scale * std::sin(static_cast<float>(i) + 1));
  };
  fill(&s.w_ih, G * s.F, 0.3f);
  fill(&s.w_hh, G * s.H, 0.2f);
  fill(&s.b_ih, G, 0.1f);
  fill(&s.b_hh, G, -0.05f);
  fill(&s.w_out, s.H, 0.7f);
  std::vector<uint8_t> b(kModelMagic, kModelMagic + 8);
  put_u32(&b, s.version);
  put_u32(&b, s.F);
  put_u32(&b, s.H);
  put_u32(&b, s.W);
  put_u32(&b, s.horizon);
  put_f32(&b, s.interval);
  for (float v : s.mean) put_f32(&b, v);
  for (float v : s.stdev) put_f32(&b, v);
  for (float v : s.thr) put_f32(&b, v);
  put_f32(&b, s.steps);
  for (float v : s.rise) put_f32(&b, v);
  for (auto* v : {&s.w_ih, &s.w_hh, &s.b_ih, &s.b_hh, &s.w_out})
    for (float x : *v) put_f32(&b, x);
  put_f32(&b, s.b_out);
  put_u32(&b, static_cast<uint32_t>(s.meta.size()));
  b.insert(b.end(), s.meta.begin(), s.meta.end());
  put_u32(&b, static_cast<uint32_t>(crc32(0L, b.data(), static_cast<uInt>(b.size()))));
  return b;
}

// A model that says "failure" whatever it sees.
void always_failing_model(Model* m) {
  ModelSpec always;
  always.w_out = {0.0f, 0.0f};
  always.b_out = 10.0f;
  auto bytes = build_model(always);
  std::string err;
  REQUIRE(parse_model(bytes.data(), bytes.size(), m, &err));
}

float sig(double x) { return static_cast<float>(1 / (1 + std::exp(-x))); }

// A baseline that watches link events alone (feature 2: their log rate, smoothed over 30 s),
// over one sample.
BaselineParams link_events_only(float threshold) {
  BaselineParams b;
  b.threshold[kLinkEvents] = threshold;
  b.steps = 1;
  return b;
}

}  // namespace

TEST_CASE("counter deltas: normal, wrap, reset, saturation, missing", "[predictor]") {
  const Width wrap32{32, false}, wrap64{64, false}, sat4{4, true};
  Delta d = counter_delta({true, 100}, {true, 130}, wrap32);
  CHECK(d.kind == DeltaKind::kNormal);
  CHECK(d.value == 30);
  d = counter_delta({true, 4294967290ULL}, {true, 5}, wrap32);  // 2^32 - 6 -> 5
  CHECK(d.kind == DeltaKind::kWrapped);
  CHECK(d.value == 11);
  d = counter_delta({true, ~0ULL}, {true, 1}, wrap64);
  CHECK(d.kind == DeltaKind::kWrapped);
  CHECK(d.value == 2);
  // A small decrease is a reset, not a wrap: the delta is the count since the reset.
  d = counter_delta({true, 1000}, {true, 3}, wrap32);
  CHECK(d.kind == DeltaKind::kReset);
  CHECK(d.value == 3);
  // Saturating counters never wrap: any decrease is a reset.
  d = counter_delta({true, 15}, {true, 2}, sat4);
  CHECK(d.kind == DeltaKind::kReset);
  CHECK(d.value == 2);
  d = counter_delta({true, 12}, {true, 15}, sat4);
  CHECK(d.kind == DeltaKind::kSaturated);
  CHECK(d.value == 3);
  d = counter_delta({true, 15}, {true, 15}, sat4);
  CHECK(d.kind == DeltaKind::kSaturated);
  CHECK(d.value == 0);
  CHECK(counter_delta({false, 0}, {true, 5}, wrap32).kind == DeltaKind::kMissing);
  CHECK(counter_delta({true, 5}, {false, 0}, wrap32).value == 0);
}

TEST_CASE("a reset of a rail's counters is not read as a wrap of its 32-bit ones", "[predictor]") {
  const Width wrap32{32, false}, wrap64{64, false};
  // A reset (perfquery -R, a driver reload) takes every counter of the port to 0 in one step:
  // tx_packets (64-bit: a drop of 3.5e9 cannot be a wrap) and a 32-bit link_downed that stood
  // 12 below 2^32, which alone would read as a wrap (12 link-downs).
  const Reading prev[3] = {{true, 3558441037ULL}, {true, 4294967284ULL}, {true, 4294967290ULL}};
  const Reading cur[3] = {{true, 871417}, {true, 0}, {true, 1}};
  Delta d[3];
  for (int i = 0; i < 3; ++i) d[i] = counter_delta(prev[i], cur[i], i == 0 ? wrap64 : wrap32);
  REQUIRE(d[1].kind == DeltaKind::kWrapped);
  REQUIRE(d[1].value == 12);
  settle_resets(d, cur, 3);
  CHECK(d[0].kind == DeltaKind::kReset);
  CHECK(d[0].value == 871417);
  CHECK(d[1].kind == DeltaKind::kReset);
  CHECK(d[1].value == 0);  // the count since the reset
  CHECK(d[2].value == 1);
  // Without a reset in the step, a wrap stays a wrap.
  Delta w[2] = {counter_delta({true, 4294967290ULL}, {true, 5}, wrap32),
                counter_delta({true, 100}, {true, 130}, wrap32)};
  const Reading wc[2] = {{true, 5}, {true, 130}};
  settle_resets(w, wc, 2);
  CHECK(w[0].kind == DeltaKind::kWrapped);
  CHECK(w[0].value == 11);
  CHECK(w[1].value == 30);
}

TEST_CASE("counter readings and widths parse strictly", "[predictor]") {
  CHECK(parse_reading("123\n").present);
  CHECK(parse_reading(" 18446744073709551615 ").value == ~0ULL);
  CHECK_FALSE(parse_reading("18446744073709551616").present);  // overflow
  CHECK_FALSE(parse_reading("N/A").present);
  CHECK_FALSE(parse_reading("-1").present);
  CHECK_FALSE(parse_reading("12abc").present);
  CHECK_FALSE(parse_reading("").present);
  Width w;
  REQUIRE(parse_width("sat16", &w));
  CHECK((w.saturating && w.bits == 16));
  REQUIRE(parse_width("wrap64", &w));
  CHECK((!w.saturating && w.bits == 64));
  CHECK_FALSE(parse_width("wrap65", &w));
  CHECK_FALSE(parse_width("sat0", &w));
  CHECK_FALSE(parse_width("wrap", &w));
  CHECK_FALSE(parse_width("16", &w));
  CHECK(counter_by_name("symbol_err") == kSymbolErr);
  CHECK(counter_by_name("nope") == -1);
}

TEST_CASE("SysfsRail reads an InfiniBand port's counters from a fake tree", "[predictor]") {
  const std::string root = temp_dir();
  const std::string port = root + "/class/infiniband/mlx5_0/ports/1";
  auto set = [&](const char* rel, const std::string& v) { write_file(port + "/" + rel, v + "\n"); };
  set("state", "4: ACTIVE");
  set("rate", "400 Gb/sec (4X NDR)");
  set("counters/symbol_error", "10");
  set("counters/port_rcv_errors", "N/A");
  set("counters/port_xmit_data", "1000");
  set("counters/port_xmit_packets", "50");
  set("counters/link_downed", "255");
  set("counters/excessive_buffer_overrun_errors", "14");
  set("hw_counters/local_ack_timeout_err", "4294967295");
  set("hw_counters/packet_seq_err", "7");
  RailSpec spec{"mlx5_0:1", RailSpec::Kind::kIb, "mlx5_0", 1};
  SysfsRail rail(root, spec);
  Step s;
  std::vector<std::string> notes;
  CHECK_FALSE(rail.read(100.0, {}, &s, &notes));  // primes
  set("counters/symbol_error", "25");
  set("counters/port_xmit_data", "3000");  // 2000 words = 8000 bytes
  set("counters/port_xmit_packets", "70");
  set("counters/excessive_buffer_overrun_errors", "15");  // saturates now
  set("hw_counters/local_ack_timeout_err", "3");          // wrapped: 4 more
  set("hw_counters/packet_seq_err", "9");
  REQUIRE(rail.read(105.0, {}, &s, &notes));
  CHECK(s.dt_s == Approx(5.0));
  CHECK(s.link_up);
  CHECK(s.speed_mbps == Approx(400000));
  CHECK(s.d[kSymbolErr] == 15);
  CHECK(s.d[kRcvErr] == 0);
  CHECK((s.missing & (1u << kRcvErr)) != 0);  // N/A
  CHECK(s.d[kTxBytes] == 8000);
  CHECK(s.d[kTxPackets] == 20);
  CHECK(s.d[kRetrans] == 6);  // 4 (wrapped) + 2
  // Its only file (no out_of_buffer here) reached 15 (sat4): unknown, not its last step.
  CHECK(s.d[kBufOverrun] == 0);
  CHECK((s.missing & (1u << kBufOverrun)) != 0);
  CHECK(s.d[kLinkDowned] == 0);
  int saturated = 0;
  for (const auto& n : notes) saturated += n.find("saturated") != std::string::npos;
  CHECK(saturated == 2);  // link_downed (255) and the buffer overrun counter (15), once each
  // Reset of one counter (perfquery -R) and a port going down.
  notes.clear();
  set("counters/symbol_error", "2");
  set("state", "1: DOWN");
  REQUIRE(rail.read(110.0, {}, &s, &notes));
  CHECK_FALSE(s.link_up);
  CHECK(s.d[kSymbolErr] == 2);
  CHECK(s.reset == 1u << kSymbolErr);  // the count since the reset, not a rate
  bool reset_noted = false, saturated_again = false;
  for (const auto& n : notes) {
    reset_noted |=
        n.find("symbol_error") != std::string::npos && n.find("reset") != std::string::npos;
    saturated_again |= n.find("saturated") != std::string::npos;
  }
  CHECK(reset_noted);
  CHECK_FALSE(saturated_again);  // warned once per file
  // A FIFO (or any non-regular file) where a counter should be is not read: it can never block.
  REQUIRE(::unlink((port + "/counters/port_rcv_errors").c_str()) == 0);
  REQUIRE(::mkfifo((port + "/counters/port_rcv_errors").c_str(), 0600) == 0);
  REQUIRE(rail.read(112.0, {}, &s, &notes));
  CHECK((s.missing & (1u << kRcvErr)) != 0);
  // Every file gone: no crash, all deltas missing.
  REQUIRE(system(("rm -rf " + root + "/class").c_str()) == 0);
  REQUIRE(rail.read(115.0, {}, &s, &notes));
  CHECK(s.missing == (1u << kNumCounters) - 1);
  CHECK(s.link_up);  // no state file: unknown, taken as up
  CHECK(rail.files_present() == 0);
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

TEST_CASE("SysfsRail reads an Ethernet interface and a TCP rail's own retransmits", "[predictor]") {
  const std::string root = temp_dir();
  const std::string dev = root + "/class/net/eth1";
  auto set = [&](const char* rel, const std::string& v) { write_file(dev + "/" + rel, v + "\n"); };
  set("operstate", "up");
  set("speed", "-1");
  set("statistics/rx_crc_errors", "0");
  set("statistics/rx_bytes", "0");
  set("statistics/tx_dropped", "1");
  set("statistics/rx_missed_errors", "1");
  set("carrier_changes", "2");
  SysfsRail rail(root, RailSpec{"eth1", RailSpec::Kind::kEth, "eth1", 1});
  Step s;
  ExtraCounters ex{true, 100, 1000};
  CHECK_FALSE(rail.read(1.0, ex, &s, nullptr));
  set("statistics/rx_crc_errors", "3");
  set("statistics/rx_bytes", "1250000");
  set("statistics/tx_dropped", "4");
  set("statistics/rx_missed_errors", "2");
  set("carrier_changes", "4");
  ex.retrans = 110;
  ex.segs_out = 2000;
  REQUIRE(rail.read(1.5, ex, &s, nullptr));
  CHECK(s.speed_mbps == 0);  // "-1": unknown
  CHECK(s.d[kCrcErr] == 3);
  CHECK((s.missing & (1u << kSymbolErr)) != 0);  // no IB symbol counter on Ethernet
  CHECK(s.d[kRxBytes] == 1250000);
  CHECK(s.d[kBufOverrun] == 4);  // 3 tx drops + 1 missed
  CHECK(s.d[kLinkRecovery] == 2);
  CHECK(s.d[kRetrans] == 10);
  CHECK(s.d[kTxPackets] == 1000);
  set("operstate", "down");
  REQUIRE(rail.read(2.0, ex, &s, nullptr));
  CHECK_FALSE(s.link_up);
  // The counters are reset together (a driver reload) while carrier_down_count stood 2 below
  // 2^32 (a 32-bit counter on some drivers, read as 64-bit here: no wrap possible) and
  // carrier_changes just under 2^64: its drop alone would read as a wrap of 5.
  set("operstate", "up");
  set("carrier_changes", "18446744073709551613");
  REQUIRE(rail.read(2.5, ex, &s, nullptr));
  set("carrier_changes", "2");
  set("statistics/rx_bytes", "1000");
  std::vector<std::string> notes;
  REQUIRE(rail.read(3.0, ex, &s, &notes));
  CHECK(s.d[kLinkRecovery] == 2);  // not 5: reset with rx_bytes, the count since
  CHECK(s.d[kRxBytes] == 1000);
  CHECK((s.reset & (1u << kLinkRecovery)) != 0);
  CHECK((s.reset & (1u << kRxBytes)) != 0);
  CHECK((s.reset & (1u << kRetrans)) == 0);  // the TCP rail's own count went on
  CHECK(std::count_if(notes.begin(), notes.end(), [](const std::string& n) {
          return n.find("(counter reset)") != std::string::npos;
        }) == 2);
  auto rails = discover_rails(root);
  REQUIRE(rails.size() == 1);
  CHECK(rails[0].name == "eth1");
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

namespace {

// A netlink message built byte by byte as the kernel lays it out (include/uapi/linux/netlink.h:
// 4-byte aligned attributes, a nest's length covering its children; the kernel sets
// NLA_F_NESTED on nests), so the parser is checked against the wire format, not against libnl.
struct NlBuilder {
  std::vector<uint8_t> b;
  std::vector<size_t> open;
  NlBuilder() {
    b.resize(NLMSG_HDRLEN + GENL_HDRLEN);
    auto* g = reinterpret_cast<genlmsghdr*>(b.data() + NLMSG_HDRLEN);
    g->cmd = ETHTOOL_MSG_FEC_GET_REPLY;
    g->version = ETHTOOL_GENL_VERSION;
  }
  void attr(uint16_t type, const void* data, size_t len) {
    const size_t at = b.size();
    b.resize(at + NLA_ALIGN(NLA_HDRLEN + len));
    nlattr h{static_cast<uint16_t>(NLA_HDRLEN + len), type};
    std::memcpy(b.data() + at, &h, sizeof(h));
    if (len) std::memcpy(b.data() + at + NLA_HDRLEN, data, len);
  }
  void u64s(uint16_t type, std::vector<uint64_t> v) { attr(type, v.data(), v.size() * 8); }
  void begin(uint16_t type) {
    open.push_back(b.size());
    attr(type | NLA_F_NESTED, nullptr, 0);
  }
  void end() {
    const size_t at = open.back();
    open.pop_back();
    const uint16_t len = static_cast<uint16_t>(b.size() - at);
    std::memcpy(b.data() + at, &len, sizeof(len));
  }
  const nlmsghdr* msg() {
    auto* h = reinterpret_cast<nlmsghdr*>(b.data());
    h->nlmsg_len = static_cast<uint32_t>(b.size());
    h->nlmsg_type = 0x1c;  // the family id genl_ctrl_resolve returned
    return h;
  }
};

// The reply of a 4-lane RS-FEC port, as net/ethtool/fec.c writes it: the request header back,
// the active mode, then the stats nest with a pad before each 64-bit array (nla_put_64bit).
NlBuilder fec_reply(std::vector<uint64_t> corrected, std::vector<uint64_t> uncorr,
                    std::vector<uint64_t> bits) {
  NlBuilder m;
  m.begin(ETHTOOL_A_FEC_HEADER);
  const uint32_t ifindex = 7;
  m.attr(ETHTOOL_A_HEADER_DEV_INDEX, &ifindex, 4);
  m.attr(ETHTOOL_A_HEADER_DEV_NAME, "eth9", 5);
  m.end();
  const uint32_t active = 50;  // ETHTOOL_LINK_MODE_FEC_RS_BIT
  m.attr(ETHTOOL_A_FEC_ACTIVE, &active, 4);
  m.begin(ETHTOOL_A_FEC_STATS);
  m.attr(ETHTOOL_A_FEC_STAT_PAD, nullptr, 0);
  m.u64s(ETHTOOL_A_FEC_STAT_CORRECTED, corrected);
  m.attr(ETHTOOL_A_FEC_STAT_PAD, nullptr, 0);
  m.u64s(ETHTOOL_A_FEC_STAT_UNCORR, uncorr);
  m.attr(ETHTOOL_A_FEC_STAT_PAD, nullptr, 0);
  m.u64s(ETHTOOL_A_FEC_STAT_CORR_BITS, bits);
  m.end();
  return m;
}

// A FecSource double: scripted totals or errors, counting the requests per interface.
struct FakeFec : FecSource {
  int rc = 0;
  FecReading next;
  std::vector<std::string> asked;
  int read(const std::string& ifname, FecReading* out, std::string* why) override {
    asked.push_back(ifname);
    if (rc) {
      *why = std::string("ethtool netlink FEC_GET: ") + std::strerror(rc);
      return rc;
    }
    *out = next;
    return 0;
  }
};

Reading rd(uint64_t v) { return Reading{true, v}; }

// A sysfs tree with one Ethernet interface, eth1, up (no counter files).
const RailSpec kEth1{"eth1", RailSpec::Kind::kEth, "eth1", 1};
std::string eth1_tree() {
  const std::string root = temp_dir();
  write_file(root + "/class/net/eth1/operstate", "up\n");
  return root;
}

}  // namespace

TEST_CASE("parse_fec_reply reads the totals of the kernel's FEC_GET reply", "[predictor]") {
  FecReading r;
  std::string why;
  NlBuilder m = fec_reply({1234, 600, 634, 0, 0}, {}, {99999});
  const bool parsed = parse_fec_reply(m.msg(), m.b.size(), &r, &why);
  INFO(why);  // without libnl-genl-3-200 (scripts/setup.sh installs it): says so
  REQUIRE(parsed);
  CHECK(r.corrected_blocks.present);
  CHECK(r.corrected_blocks.value == 1234);      // the total, not a lane
  CHECK_FALSE(r.uncorrectable_blocks.present);  // length 0: the driver does not report it
  CHECK(r.corrected_bits.present);
  CHECK(r.corrected_bits.value == 99999);
  // The reply names its device: another one's is refused.
  CHECK(parse_fec_reply(m.msg(), m.b.size(), &r, &why, "eth9"));
  CHECK_FALSE(parse_fec_reply(m.msg(), m.b.size(), &r, &why, "eth8"));
  CHECK(why.find("is for \"eth9\", not \"eth8\"") != std::string::npos);
  // Largest values survive.
  m = fec_reply({~0ULL}, {1ULL << 40}, {});
  REQUIRE(parse_fec_reply(m.msg(), m.b.size(), &r, &why));
  CHECK(r.corrected_blocks.value == ~0ULL);
  CHECK(r.uncorrectable_blocks.value == (1ULL << 40));
  CHECK_FALSE(r.corrected_bits.present);

  // Malformed replies are refused with a reason, and nothing is read past the buffer.
  m = fec_reply({5}, {6}, {7});
  const nlmsghdr* h = m.msg();
  CHECK_FALSE(parse_fec_reply(h, m.b.size() - 4, &r, &why));  // claims more than there is
  CHECK(why.find("shorter") != std::string::npos);
  CHECK_FALSE(parse_fec_reply(h, 8, &r, &why));
  NlBuilder odd;
  odd.begin(ETHTOOL_A_FEC_STATS);
  const uint8_t twelve[12] = {};
  odd.attr(ETHTOOL_A_FEC_STAT_CORRECTED, twelve, sizeof(twelve));  // not whole u64s
  odd.end();
  CHECK_FALSE(parse_fec_reply(odd.msg(), odd.b.size(), &r, &why));
  CHECK(why.find("array of u64") != std::string::npos);
  NlBuilder none;  // no stats nest (a kernel that ignored ETHTOOL_FLAG_STATS)
  const uint32_t active = 50;
  none.attr(ETHTOOL_A_FEC_ACTIVE, &active, 4);
  CHECK_FALSE(parse_fec_reply(none.msg(), none.b.size(), &r, &why));
  CHECK(why.find("ETHTOOL_A_FEC_STATS") != std::string::npos);
  // An attribute inside the nest that claims to run past it is not read: no total appears.
  NlBuilder over;
  over.begin(ETHTOOL_A_FEC_STATS);
  over.u64s(ETHTOOL_A_FEC_STAT_CORRECTED, {42});
  over.end();
  over.b.resize(over.b.size() + 8);  // room the nest does not own
  uint16_t bad = NLA_HDRLEN + 16;    // the array claims 16 bytes inside a 12-byte nest payload
  std::memcpy(over.b.data() + NLMSG_HDRLEN + GENL_HDRLEN + NLA_HDRLEN, &bad, 2);
  r = FecReading{};
  r.corrected_blocks = rd(1);
  const bool ok = parse_fec_reply(over.msg(), over.b.size(), &r, &why);
  if (ok) CHECK_FALSE(r.corrected_blocks.present);
}

TEST_CASE("EthtoolFec asks the running kernel and reports why it got nothing", "[predictor]") {
  // The kernel's ethtool netlink, for real: lo has no FEC (EOPNOTSUPP), an unknown name is
  // ENODEV, a name longer than IFNAMSIZ is refused before asking. Needs libnl-genl-3-200
  // (scripts/setup.sh) and a kernel with CONFIG_ETHTOOL_NETLINK (5.6+).
  EthtoolFec fec;
  std::string why;
  const int opened = fec.open(&why);
  INFO(why);  // without libnl-genl-3-200 (scripts/setup.sh installs it): says so
  REQUIRE(opened == 0);
  FecReading r;
  CHECK(fec.read("lo", &r, &why) == EOPNOTSUPP);
  CHECK(why.find("not supported") != std::string::npos);
  CHECK(fec.read("r2cclnodev0", &r, &why) == ENODEV);
  CHECK(fec.read("a-name-of-twenty-chars", &r, &why) == EINVAL);
  CHECK(why.find("1-15 characters") != std::string::npos);
  CHECK(fec.read("lo", &r, &why) == EOPNOTSUPP);  // the socket is still in step
}

TEST_CASE("SysfsRail takes an Ethernet rail's FEC counters from its FecSource", "[predictor]") {
  const std::string root = temp_dir();
  write_file(root + "/class/net/eth1/operstate", "up\n");
  write_file(root + "/class/net/eth1/statistics/rx_crc_errors", "0\n");
  SysfsRail rail(root, RailSpec{"eth1", RailSpec::Kind::kEth, "eth1", 1});
  CHECK(rail.fec_ifname() == "eth1");
  write_file(root + "/class/net/lo/type", "772\n");  // ARPHRD_LOOPBACK: no FEC to ask for
  CHECK(SysfsRail(root, RailSpec{"lo", RailSpec::Kind::kEth, "lo", 1}).fec_ifname().empty());
  FakeFec fec;
  rail.set_fec_source(&fec);
  fec.next = FecReading{rd(100), Reading{}, rd(5000)};
  Step s;
  std::vector<std::string> notes;
  CHECK_FALSE(rail.read(1.0, {}, &s, &notes));
  fec.next = FecReading{rd(160), Reading{}, rd(5900)};
  REQUIRE(rail.read(6.0, {}, &s, &notes));
  CHECK(s.d[kFecCorrBlocks] == 60);
  CHECK(s.d[kFecCorrBits] == 900);
  CHECK((s.missing & (1u << kFecCorrBlocks)) == 0);
  CHECK((s.missing & (1u << kFecUncorrBlocks)) != 0);  // not reported by this driver
  CHECK(notes.empty());
  // A reset (driver reload): the new value is the count since, and it is noted.
  fec.next = FecReading{rd(7), Reading{}, rd(6000)};
  REQUIRE(rail.read(11.0, {}, &s, &notes));
  CHECK(s.d[kFecCorrBlocks] == 7);
  CHECK(s.d[kFecCorrBits] == 100);
  CHECK(s.reset == 1u << kFecCorrBlocks);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].find("fec_corr_blocks went from 160 to 7") != std::string::npos);
  // A transient failure: missing, noted once, asked again; the next reading starts afresh.
  notes.clear();
  fec.rc = EIO;
  REQUIRE(rail.read(16.0, {}, &s, &notes));
  REQUIRE(rail.read(21.0, {}, &s, &notes));
  CHECK((s.missing & (1u << kFecCorrBlocks)) != 0);
  CHECK(notes.size() == 1);
  CHECK(fec.asked.size() == 5);
  fec.rc = 0;
  fec.next = FecReading{rd(50), Reading{}, rd(7000)};
  REQUIRE(rail.read(26.0, {}, &s, &notes));
  CHECK((s.missing & (1u << kFecCorrBlocks)) != 0);  // no previous reading to subtract
  fec.next = FecReading{rd(51), Reading{}, rd(7000)};
  REQUIRE(rail.read(31.0, {}, &s, &notes));
  CHECK(s.d[kFecCorrBlocks] == 1);
  // A driver without FEC statistics: noted once, then never asked again.
  notes.clear();
  fec.rc = EOPNOTSUPP;
  const size_t before = fec.asked.size();
  for (int i = 0; i < 3; ++i) REQUIRE(rail.read(36.0 + i, {}, &s, &notes));
  CHECK(fec.asked.size() == before + 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].find("eth1: FEC statistics unavailable") != std::string::npos);
  CHECK(notes[0].find("stay missing") != std::string::npos);
  CHECK((s.missing & (1u << kFecCorrBits)) != 0);
  CHECK(s.d[kCrcErr] == 0);  // the sysfs counters go on
  CHECK((s.missing & (1u << kCrcErr)) == 0);
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

TEST_CASE("SysfsRail: FEC answers that are late, pending or empty", "[predictor]") {
  const std::string root = eth1_tree();
  SysfsRail rail(root, kEth1);
  FakeFec fec;
  rail.set_fec_source(&fec);
  Step s;
  std::vector<std::string> notes;
  fec.rc = EAGAIN;  // not answered yet: silent, missing
  CHECK_FALSE(rail.read(1.0, {}, &s, &notes));
  REQUIRE(rail.read(2.0, {}, &s, &notes));
  CHECK(notes.empty());
  CHECK((s.missing & (1u << kFecCorrBits)) != 0);
  fec.rc = ETIMEDOUT;  // overdue: said once, asked again
  for (int i = 0; i < 3; ++i) REQUIRE(rail.read(3.0 + i, {}, &s, &notes));
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].find("eth1: FEC statistics late") != std::string::npos);
  fec.rc = 0;  // answered with no statistic in it, three times: not asked again
  fec.next = FecReading{};
  const size_t before = fec.asked.size();
  for (int i = 0; i < 5; ++i) REQUIRE(rail.read(10.0 + i, {}, &s, &notes));
  CHECK(fec.asked.size() == before + 3);
  REQUIRE(notes.size() == 2);
  CHECK(notes[1].find("the driver reports no FEC statistics") != std::string::npos);
  // A failure that comes back after a success is not noted again.
  SysfsRail again(root, kEth1);
  again.set_fec_source(&fec);
  notes.clear();
  for (int i = 0; i < 6; ++i) {
    fec.rc = i % 2 ? EIO : 0;
    fec.next = FecReading{rd(10 + i), Reading{}, Reading{}};
    again.read(20.0 + i, {}, &s, &notes);
  }
  CHECK(notes.size() == 1);
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

namespace {
// A FecSource whose reads block while its gate is shut; thread-safe (the worker calls it).
struct GateFec : FecSource {
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;
  uint64_t count = 0;
  int read(const std::string&, FecReading* out, std::string*) override {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return open; });
    *out = FecReading{rd(++count), Reading{}, Reading{}};
    return 0;
  }
  void set(bool o) {
    std::lock_guard<std::mutex> lk(mu);
    open = o;
    cv.notify_all();
  }
};
// Hands the reads to a gate that outlives the AsyncFecSource.
struct GateRef : FecSource {
  std::shared_ptr<GateFec> g;
  int read(const std::string& n, FecReading* o, std::string* w) override {
    return g->read(n, o, w);
  }
};
}  // namespace

TEST_CASE("AsyncFecSource: failures, exceptions, and readings' own times", "[predictor]") {
  struct Scripted : FecSource {
    std::mutex mu;
    int calls = 0;
    int read(const std::string&, FecReading* out, std::string* why) override {
      std::lock_guard<std::mutex> lk(mu);
      ++calls;
      if (calls == 2) {
        *why = "no such device";
        return ENODEV;
      }
      if (calls == 3) throw 42;  // not a std::exception: must not escape the worker
      *out = FecReading{rd(static_cast<uint64_t>(calls)), Reading{}, Reading{}, 100.0 + calls};
      return 0;
    }
  };
  AsyncFecSource src(std::make_unique<Scripted>());
  FecReading r;
  std::string why;
  auto next = [&] {  // the next answer that is not "pending"
    int rc = EAGAIN;
    for (int i = 0; i < 1000 && rc == EAGAIN; ++i) {
      rc = src.read("eth1", &r, &why);
      if (rc == EAGAIN) usleep(1000);
    }
    return rc;
  };
  CHECK(next() == 0);  // call 1
  CHECK(r.corrected_blocks.value == 1);
  CHECK(r.t_s == 101.0);
  CHECK(next() == ENODEV);  // call 2; not asked again until read again
  CHECK(why == "no such device");
  CHECK(next() == EIO);  // call 3 threw
  CHECK(why.find("unknown exception") != std::string::npos);
  CHECK(next() == 0);  // call 4: the worker survived
  CHECK(r.corrected_blocks.value == 4);
}

TEST_CASE("SysfsRail: a late FEC reading counts its rate over the step", "[predictor]") {
  const std::string root = eth1_tree();
  SysfsRail rail(root, kEth1);
  FakeFec fec;
  rail.set_fec_source(&fec);
  Step s;
  fec.next = FecReading{rd(1000), Reading{}, Reading{}, 500.0};
  CHECK_FALSE(rail.read(10.0, {}, &s, nullptr));
  fec.rc = EAGAIN;  // the next request is late: this step has no FEC delta
  REQUIRE(rail.read(15.0, {}, &s, nullptr));
  CHECK((s.missing & (1u << kFecCorrBlocks)) != 0);
  fec.rc = 0;  // read at 510.0: 200 blocks in 10 s, 100 in this 5 s step
  fec.next = FecReading{rd(1200), Reading{}, Reading{}, 510.0};
  REQUIRE(rail.read(20.0, {}, &s, nullptr));
  CHECK(s.d[kFecCorrBlocks] == Approx(100.0));
  fec.next = FecReading{rd(1250), Reading{}, Reading{}, 515.0};  // on time: as read
  REQUIRE(rail.read(25.0, {}, &s, nullptr));
  CHECK(s.d[kFecCorrBlocks] == Approx(50.0));
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

TEST_CASE("AsyncFecSource never makes its caller wait for the kernel", "[predictor]") {
  auto gate = std::make_shared<GateFec>();
  auto ref = std::make_unique<GateRef>();
  ref->g = gate;
  FecReading r;
  std::string why;
  uint64_t stuck_at = 0;
  std::chrono::steady_clock::time_point destroying;
  {
    AsyncFecSource src(std::move(ref), 50);
    CHECK(src.read("eth1", &r, &why) == EAGAIN);  // the first reading is asked for
    int rc = EAGAIN;
    for (int i = 0; i < 500 && rc == EAGAIN; ++i) {
      usleep(2000);
      rc = src.read("eth1", &r, &why);
    }
    REQUIRE(rc == 0);  // the reading asked for before; the next one is asked for now
    CHECK(r.corrected_blocks.value == 1);
    // The kernel stops answering (rtnl_lock held): the caller gets EAGAIN at once, then
    // ETIMEDOUT once the pending request is older than 50 ms.
    gate->set(false);
    for (int i = 0; i < 500 && rc != ETIMEDOUT; ++i) {
      usleep(2000);
      rc = src.read("eth1", &r, &why);
      if (rc == 0) CHECK(r.corrected_blocks.value == 2);  // asked for before the gate shut
    }
    CHECK(rc == ETIMEDOUT);
    CHECK(why.find("has not answered") != std::string::npos);
    {
      std::lock_guard<std::mutex> lk(gate->mu);
      stuck_at = gate->count;  // the worker waits inside a read that has not counted yet
    }
    // Leaving with a read stuck: the destructor does not wait for it (it leaves the worker
    // with what it owns), so a sampler handover never stalls the background thread.
    destroying = std::chrono::steady_clock::now();
  }
  const auto destroy_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - destroying).count();
  CHECK(destroy_s < 1.0);  // no wait at all (it was 2 s); 1 s leaves room for a loaded machine
  gate->set(true);         // the stuck read returns into the worker's own state; then it exits
  uint64_t count = 0;
  for (int i = 0; i < 500 && count <= stuck_at; ++i) {
    usleep(2000);
    std::lock_guard<std::mutex> lk(gate->mu);
    count = gate->count;
  }
  CHECK(count == stuck_at + 1);
}

TEST_CASE("SysfsRail reads a RoCE port's CRC and FEC counters from its netdev", "[predictor]") {
  const std::string root = temp_dir();
  const std::string roce = root + "/class/infiniband/mlx5_2/ports/1";
  const std::string ib = root + "/class/infiniband/mlx5_0/ports/1";
  write_file(roce + "/link_layer", "Ethernet\n");
  write_file(roce + "/state", "4: ACTIVE\n");
  write_file(roce + "/gid_attrs/ndevs/0", "enp65s0f0np0\n");
  write_file(roce + "/counters/port_rcv_data", "0\n");
  write_file(root + "/class/net/enp65s0f0np0/statistics/rx_crc_errors", "10\n");
  write_file(ib + "/link_layer", "InfiniBand\n");
  write_file(ib + "/counters/symbol_error", "0\n");
  write_file(ib + "/gid_attrs/ndevs/0", "ib0\n");  // IPoIB: not read for an IB port
  FakeFec fec;
  fec.next = FecReading{rd(1), rd(0), rd(10)};
  SysfsRail r(root, RailSpec{"mlx5_2:1", RailSpec::Kind::kIb, "mlx5_2", 1});
  SysfsRail i(root, RailSpec{"mlx5_0:1", RailSpec::Kind::kIb, "mlx5_0", 1});
  CHECK(r.fec_ifname() == "enp65s0f0np0");
  CHECK(i.fec_ifname().empty());
  r.set_fec_source(&fec);
  i.set_fec_source(&fec);
  Step s;
  CHECK_FALSE(r.read(1.0, {}, &s, nullptr));
  CHECK_FALSE(i.read(1.0, {}, &s, nullptr));
  write_file(root + "/class/net/enp65s0f0np0/statistics/rx_crc_errors", "14\n");
  fec.next = FecReading{rd(3), rd(1), rd(25)};
  REQUIRE(r.read(2.0, {}, &s, nullptr));
  CHECK(s.d[kCrcErr] == 4);
  CHECK(s.d[kFecCorrBlocks] == 2);
  CHECK(s.d[kFecUncorrBlocks] == 1);
  CHECK(s.d[kFecCorrBits] == 15);
  REQUIRE(i.read(2.0, {}, &s, nullptr));
  CHECK((s.missing & (1u << kCrcErr)) != 0);
  for (const auto& n : fec.asked) CHECK(n == "enp65s0f0np0");  // never for the IB port
  CHECK(fec.asked.size() == 2);
  // A netdev name that would leave class/net is not followed.
  write_file(root + "/class/infiniband/mlx5_3/ports/1/link_layer", "Ethernet\n");
  write_file(root + "/class/infiniband/mlx5_3/ports/1/gid_attrs/ndevs/0", "../../x\n");
  SysfsRail bad(root, RailSpec{"mlx5_3:1", RailSpec::Kind::kIb, "mlx5_3", 1});
  CHECK(bad.fec_ifname().empty());
  // Nor one Linux would refuse: an embedded NUL, a newline, a ':', 16 bytes.
  for (const std::string& name : {std::string("..\0zz", 5), std::string("eth9\nfoo"),
                                  std::string("eth0:1"), std::string("abcdefghijklmnop")}) {
    write_file(root + "/class/infiniband/mlx5_3/ports/1/gid_attrs/ndevs/0", name + "\n");
    SysfsRail odd(root, RailSpec{"mlx5_3:1", RailSpec::Kind::kIb, "mlx5_3", 1});
    CHECK(odd.fec_ifname().empty());
    std::vector<std::string> said;
    odd.read(1.0, {}, &s, &said);
    REQUIRE(said.size() == 1);  // said once, at the first read
    CHECK(said[0].find("gid_attrs/ndevs/0 names no valid interface") != std::string::npos);
  }
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

TEST_CASE("features follow docs/PREDICTOR.md: trends against the rail's own history",
          "[predictor]") {
  auto step = [](double rcv_per_s) {
    Step s;
    s.dt_s = 5;
    s.speed_mbps = 100000;
    s.missing = (1u << kNumCounters) - 1;
    for (int c : {kRetrans, kRcvErr, kLinkRecovery, kBufOverrun, kTxBytes, kRxBytes})
      s.missing &= ~(1u << c);
    s.d[kRcvErr] = rcv_per_s * 5;
    s.d[kTxBytes] = 31.25e9;  // 50 Gb/s over 5 s = half of 100 Gb/s
    return s;
  };
  const double g30 = 1 - std::exp(-5.0 / 30);
  FeatureExtractor fx;
  FeatureRow r;
  // A steady floor reads 0 whatever its level; link events and overruns are smoothed levels.
  for (double level : {0.0, 3.0, 800.0}) {
    FeatureExtractor f2;
    for (int i = 0; i < 100; ++i) {
      Step s = step(level);
      REQUIRE(f2.push(s, &r));
      CHECK(r[kErrExcess] == 0);
      CHECK(r[kErrSlope] == 0);
      CHECK(r[kErrAccel] == 0);
    }
    CHECK(r[kWarm] == 1);  // 500 s of rows
  }
  Step s = step(2);
  s.d[kLinkRecovery] = 5;
  s.d[kBufOverrun] = 10;
  REQUIRE(fx.push(s, &r));
  CHECK(r[kLinkEvents] == Approx(g30 * std::log1p(1.0)));
  CHECK(r[kOverrun] == Approx(g30 * std::log1p(2.0)));
  CHECK(r[kUtil] == Approx(0.5));
  CHECK(r[kErrUnknown] == 0);
  CHECK(r[kWarm] == Approx(5.0 / 300));
  // A rate that doubles every minute after 5 quiet minutes: excess, slope and acceleration.
  for (int i = 0; i < 60; ++i) REQUIRE(fx.push(step(2), &r));
  CHECK(std::abs(r[kErrExcess]) < 1e-6f);
  float accel_max = 0;
  for (int i = 1; i <= 60; ++i) {
    REQUIRE(fx.push(step(2 * std::pow(2.0, i * 5 / 60.0)), &r));
    accel_max = std::max(accel_max, r[kErrAccel]);
  }
  CHECK(r[kErrExcess] > 2.0f);
  CHECK(r[kErrSlope] > 0.4f);  // ~ln 2 per minute
  CHECK(r[kErrSlope] < 0.8f);
  CHECK(accel_max > 0);
  // The same counter unreadable now (saturated, missing): unknown, and out of the max.
  Step sat = step(0);
  sat.missing |= 1u << kRcvErr;
  REQUIRE(fx.push(sat, &r));
  CHECK(r[kErrUnknown] == 1);
  CHECK(r[kErrExcess] == 0);
  // Link down, or no time passed: no row.
  Step down = step(1);
  down.link_up = false;
  CHECK_FALSE(fx.push(down, &r));
  Step zero = step(1);
  zero.dt_s = 0;
  CHECK_FALSE(fx.push(zero, &r));

  FeatureWindow w(3);
  for (int i = 0; i < 5; ++i) {
    FeatureRow row{};
    row[0] = static_cast<float>(i);
    w.push(row, i, 100);
  }
  REQUIRE(w.size() == 3);
  CHECK(w.row(0)[0] == 2);
  CHECK(w.row(2)[0] == 4);
  CHECK(w.retransmit_ratio() == Approx(9.0 / 300));
}

TEST_CASE("features: a count since a reset is not a rate", "[predictor]") {
  // symbol_err at 30/s: saturated (unknown) from the start, then reset 1 s before a sample,
  // so the first count is 30 over a 5 s step. rcv_err steady at 0.
  auto step = [](double sym_per_s, bool sym_missing, bool reset) {
    Step s;
    s.dt_s = 5;
    s.missing = (1u << kNumCounters) - 1;
    s.missing &= ~(1u << kRcvErr);
    if (!sym_missing) s.missing &= ~(1u << kSymbolErr);
    s.d[kSymbolErr] = sym_per_s * 5;
    if (reset) s.reset = (1u << kSymbolErr) | (1u << kRcvErr);
    return s;
  };
  auto run = [&](bool mark_reset) {
    FeatureExtractor fx;
    FeatureRow r;
    for (int i = 0; i < 60; ++i) REQUIRE(fx.push(step(0, true, false), &r));
    Step first = step(30.0 / 5, false, mark_reset);  // 30 counts since the reset
    REQUIRE(fx.push(first, &r));
    float most = r[kErrExcess];
    for (int i = 0; i < 120; ++i) {
      REQUIRE(fx.push(step(30, false, false), &r));
      most = std::max(most, r[kErrExcess]);
    }
    return most;
  };
  // Marked as a reset, the partial count starts nothing: the floor starts at the next full
  // step, 30/s, and a steady 30/s never stands above it.
  CHECK(run(true) < 0.01f);
  // Read as a rate (what the features did before Step::reset), the floor starts at 6/s and
  // a steady 30/s stands more than 1 above it.
  CHECK(run(false) > 1.0f);

  // A counter with a history, reset while rising: the reset row stands where the previous
  // row stood (excess and slope), and the history is not stepped by the partial count.
  FeatureExtractor fx;
  FeatureRow prev{}, r;
  for (int i = 0; i < 60; ++i) REQUIRE(fx.push(step(2, false, false), &prev));
  for (int i = 1; i <= 48; ++i)
    REQUIRE(fx.push(step(2 * std::pow(2.0, i * 5 / 60.0), false, false), &prev));
  REQUIRE(prev[kErrExcess] > 1.0f);
  REQUIRE(fx.push(step(0.2, false, true), &r));
  CHECK(r[kErrExcess] == prev[kErrExcess]);
  CHECK(r[kErrSlope] == prev[kErrSlope]);
  CHECK(r[kErrUnknown] == 0);
  // retrans reset before its history starts: no retrans values in that row, and its floor
  // starts at the next step's rate (100/s), not at the partial count's (2/s).
  Step rs = step(2, false, false);
  rs.missing &= ~(1u << kRetrans);
  rs.d[kRetrans] = 10;
  rs.reset = 1u << kRetrans;
  FeatureExtractor fr;
  REQUIRE(fr.push(rs, &r));
  CHECK(r[kRetransExcess] == 0);
  CHECK(r[kRetransSlope] == 0);
  rs.d[kRetrans] = 500;
  rs.reset = 0;
  float most = 0;
  for (int i = 0; i < 20; ++i) {
    REQUIRE(fr.push(rs, &r));
    most = std::max(most, r[kRetransExcess]);
  }
  CHECK(most < 0.01f);
}

TEST_CASE("weights file: parsed, and every kind of damage refused", "[predictor]") {
  Model m;
  std::string err;
  auto good = build_model({});
  REQUIRE(parse_model(good.data(), good.size(), &m, &err));
  CHECK(m.hidden == 2);
  CHECK(m.window == 4);
  CHECK(m.baseline.threshold[2] == 3);
  CHECK(m.baseline.steps == 2);
  CHECK(m.baseline.rise_lag == 0);
  CHECK(m.metadata == "{\"seed\": 7}");
  ModelSpec rs;
  const float rule[4] = {6, 0.3f, 1.0f, 1.5f};
  std::copy(rule, rule + 4, rs.rise);
  auto br = build_model(rs);
  REQUIRE(parse_model(br.data(), br.size(), &m, &err));
  CHECK(m.baseline.rise_lag == 6);
  CHECK(m.baseline.rise_least == 0.3f);
  CHECK(m.baseline.rise_ratio == 1.0f);
  CHECK(m.baseline.rise_level == 1.5f);
  // A rise rule the baseline cannot apply: a lag that is not a whole number of rows in
  // 0..kRiseMaxLag, a negative least rise or ratio, NaN or infinity.
  const struct {
    float rise[4];
    const char* why;
  } bad_rules[] = {{{1.5f, 0.3f, 1, 1}, "whole number of rows"},
                   {{-1, 0.3f, 1, 1}, "whole number of rows"},
                   {{kRiseMaxLag + 1.0f, 0.3f, 1, 1}, "whole number of rows"},
                   {{6, -0.1f, 1, 1}, "negative"},
                   {{6, 0.3f, -1, 1}, "negative"},
                   {{6, 0.3f, 1, NAN}, "NaN or infinite"},
                   {{INFINITY, 0.3f, 1, 1}, "NaN or infinite"}};
  for (const auto& b : bad_rules) {
    ModelSpec x;
    std::copy(b.rise, b.rise + 4, x.rise);
    auto bytes = build_model(x);
    CHECK_FALSE(parse_model(bytes.data(), bytes.size(), &m, &err));
    CHECK_THAT(err, Catch::Contains(b.why) && Catch::Contains("rise"));
  }

  auto bad = good;
  bad[40] ^= 0x01;
  CHECK_FALSE(parse_model(bad.data(), bad.size(), &m, &err));
  CHECK_THAT(err, Catch::Contains("checksum"));
  bad = good;
  bad[0] = 'X';
  CHECK_FALSE(parse_model(bad.data(), bad.size(), &m, &err));
  CHECK_THAT(err, Catch::Contains("magic"));
  bad.assign(good.begin(), good.begin() + 30);
  CHECK_FALSE(parse_model(bad.data(), bad.size(), &m, &err));
  for (uint32_t other : {1u, kModelVersion + 1}) {  // 1: the eight level features of before
    ModelSpec v;
    v.version = other;
    auto b = build_model(v);
    CHECK_FALSE(parse_model(b.data(), b.size(), &m, &err));
    CHECK_THAT(err, Catch::Contains("version " + std::to_string(other)));
  }
  ModelSpec f7;
  f7.F = 7;
  f7.mean.resize(7);
  f7.stdev.resize(7, 1.0f);
  auto b7 = build_model(f7);
  CHECK_FALSE(parse_model(b7.data(), b7.size(), &m, &err));
  CHECK_THAT(err, Catch::Contains("features"));
  ModelSpec nan;
  nan.b_out = NAN;
  auto bn = build_model(nan);
  CHECK_FALSE(parse_model(bn.data(), bn.size(), &m, &err));
  CHECK_THAT(err, Catch::Contains("NaN"));
  ModelSpec zs;
  zs.stdev[3] = 0;
  auto bz = build_model(zs);
  CHECK_FALSE(parse_model(bz.data(), bz.size(), &m, &err));
  ModelSpec huge;
  huge.H = 512;  // 4*512*(8+512) floats: over 1 MB
  auto bh = build_model(huge);
  CHECK_FALSE(parse_model(bh.data(), bh.size(), &m, &err));
  CHECK_THAT(err, Catch::Contains("1 MB"));
  // A file that does not exist, through the configured path: the message names the file.
  r2ccl::Config cfg;
  cfg.predict_model = "/nonexistent/r2ccl_lstm.bin";
  std::string path;
  CHECK_FALSE(load_configured_model(cfg, &m, &path, &err));
  CHECK_THAT(err, Catch::Contains("/nonexistent/r2ccl_lstm.bin"));
}

TEST_CASE("LSTM inference follows the PyTorch equations", "[predictor]") {
  // One hidden unit, one step, computed here by hand.
  ModelSpec s;
  s.H = 1;
  s.w_ih.assign(4 * kNumFeatures, 0.0f);
  s.w_ih[0] = 0.5f;                     // i gate <- x0
  s.w_ih[kNumFeatures + 1] = -0.25f;    // f gate <- x1
  s.w_ih[2 * kNumFeatures] = 1.0f;      // g gate <- x0
  s.w_ih[3 * kNumFeatures + 2] = 2.0f;  // o gate <- x2
  s.w_hh = {0.3f, 0.1f, -0.2f, 0.4f};
  s.b_ih = {0.1f, 0.2f, 0.3f, 0.4f};
  s.b_hh = {0.0f, 0.0f, 0.0f, 0.0f};
  s.w_out = {1.5f};
  s.b_out = -0.5f;
  auto b = build_model(s);
  Model m;
  std::string err;
  REQUIRE(parse_model(b.data(), b.size(), &m, &err));
  float x[2 * kNumFeatures] = {};
  x[0] = 1.0f;
  x[1] = 2.0f;
  x[2] = -1.0f;
  x[kNumFeatures + 0] = 0.5f;
  Model::Scratch sc;
  // Step 1 from h = c = 0.
  const double i1 = sig(0.5 * 1 + 0.1), f1 = sig(-0.25 * 2 + 0.2), g1 = std::tanh(1.0 + 0.3),
               o1 = sig(2.0 * -1 + 0.4);
  const double c1 = i1 * g1, h1 = o1 * std::tanh(c1);
  CHECK(m.infer(x, 1, &sc) == Approx(sig(1.5 * h1 - 0.5)).epsilon(1e-6));
  (void)f1;
  // Step 2 uses h1 through w_hh and c1 through the forget gate.
  const double i2 = sig(0.5 * 0.5 + 0.1 + 0.3 * h1), f2 = sig(0.2 + 0.1 * h1),
               g2 = std::tanh(0.5 + 0.3 - 0.2 * h1), o2 = sig(0.4 + 0.4 * h1);
  const double c2 = f2 * c1 + i2 * g2, h2 = o2 * std::tanh(c2);
  CHECK(m.infer(x, 2, &sc) == Approx(sig(1.5 * h2 - 0.5)).epsilon(1e-6));
}

TEST_CASE("baseline risk and the drain hysteresis", "[predictor]") {
  BaselineParams bp;
  bp.threshold[0] = 0;  // unused
  bp.threshold[1] = 0;
  bp.threshold[2] = std::log1p(10.0f);  // 10 phy errors/s
  bp.threshold[3] = 0;
  bp.steps = 2;
  FeatureRow rows[3] = {};
  rows[1][2] = std::log1p(10.0f);
  rows[2][2] = std::log1p(10.0f);
  CHECK(baseline_risk(rows, 3, bp) == Approx(0.7));
  rows[1][2] = 0;
  CHECK(baseline_risk(rows, 3, bp) == Approx(0.35));  // mean over 2 steps
  CHECK(baseline_risk(rows, 0, bp) == 0);

  // The policy on link events (feature 2: their log rate, smoothed over 30 s): one sample a
  // minute, so a step's own rate dominates (gain 1 - e^-2 = 0.86).
  const BaselineParams lp = link_events_only(0.3f);
  PredictorConfig cfg;
  cfg.window_steps = 4;
  cfg.threshold = 0.7f;
  cfg.return_threshold = 0.4f;
  cfg.return_samples = 3;
  cfg.enter_samples = 1;  // the guard's own test below
  cfg.min_drain_s = 0;    // the return rule alone (the least drain time: its own test below)
  RailPredictor p(cfg, nullptr, lp);
  const double g = 1 - std::exp(-60.0 / 30);
  double ewma = 0;
  auto step = [&](double log_rate) {
    Step s;
    s.dt_s = 60;
    s.d[kLinkRecovery] = std::expm1(log_rate) * 60;
    ewma += g * (log_rate - ewma);
    return s;
  };
  auto risk = [&] { return std::min(1.0, 0.7 * ewma / 0.3); };
  Assessment a;
  REQUIRE(p.update(step(0), &a));
  CHECK(a.source == Source::kBaseline);
  CHECK_FALSE(a.drain);
  REQUIRE(p.update(step(std::log(2.0)), &a));  // one event a second
  CHECK(a.risk == Approx(risk()).epsilon(1e-4));
  CHECK(a.drain);
  CHECK(a.transition == 1);
  CHECK_THAT(p.top_contributors(3), Catch::Contains("link_recovery+link_downed+integrity"));
  // Between the return threshold and the drain threshold: stays drained.
  REQUIRE(p.update(step(0.2), &a));
  CHECK(a.risk == Approx(risk()).epsilon(1e-4));
  CHECK(a.risk > 0.4f);
  CHECK(a.risk < 0.7f);
  CHECK((a.drain && a.transition == 0));
  // Returns on the 3rd consecutive sample under 0.4, not before.
  int returned_at = -1;
  for (int i = 0; i < 6 && returned_at < 0; ++i) {
    REQUIRE(p.update(step(0), &a));
    if (a.transition == -1) returned_at = i;
    if (returned_at < 0) CHECK(a.drain);
  }
  CHECK(returned_at == 2);
  CHECK_FALSE(a.drain);
  // A link-down step changes nothing.
  Step down = step(5);
  down.link_up = false;
  CHECK_FALSE(p.update(down, &a));
  CHECK_FALSE(a.drain);
}

TEST_CASE("baseline: err_excess counts where it stands now, not the mean's memory of a burst",
          "[predictor]") {
  BaselineParams bp;
  bp.threshold[kErrExcess] = 2.0f;
  bp.threshold[kLinkEvents] = 1.0f;
  bp.steps = 6;
  FeatureRow rows[6] = {};
  // A burst that has fallen back: mean 14 / 6 = 2.33 (risk 0.82 on the mean), now 1.
  const float burst[6] = {0, 0, 5, 5, 3, 1};
  for (int i = 0; i < 6; ++i) rows[i][kErrExcess] = burst[i];
  float ratio[4];
  CHECK(baseline_risk(rows, 6, bp, ratio) == Approx(0.7 * 1.0 / 2.0));
  CHECK(ratio[kErrExcess] == Approx(0.5));
  // A rising rate, above its mean now: judged by the mean, (1 + 2 + 2.5 + 3 + 3 + 3) / 6.
  const float rising[6] = {1, 2, 2.5f, 3, 3, 3};
  for (int i = 0; i < 6; ++i) rows[i][kErrExcess] = rising[i];
  CHECK(baseline_risk(rows, 6, bp) == Approx(0.7 * (14.5 / 6) / 2.0));
  // Only err_excess: the link events' mean counts whatever the last row shows.
  for (auto& r : rows) r[kErrExcess] = 0;
  rows[0][kLinkEvents] = 6;
  CHECK(baseline_risk(rows, 6, bp) == Approx(0.7));

  // Through RailPredictor: symbol errors at 1/s (the floor) for 5 minutes, then at 2000/s.
  // Held for 25 s and back to 1/s, the mean over 2 minutes crosses the threshold only after
  // the rate fell: the rail is not drained. Held for 3 minutes, it is.
  BaselineParams rp;
  rp.threshold[kErrExcess] = 1.0f;
  rp.steps = 24;
  PredictorConfig cfg;
  cfg.window_steps = 24;
  auto drained = [&](int burst_samples) {
    RailPredictor p(cfg, nullptr, rp);
    Assessment a;
    bool any = false;
    for (int i = 0; i < 120; ++i) {
      Step st;
      st.dt_s = 5;
      st.d[kSymbolErr] = i >= 60 && i < 60 + burst_samples ? 10000 : 5;
      if (p.update(st, &a)) any = any || a.drain;
    }
    return any;
  };
  CHECK_FALSE(drained(5));  // on the 2-minute mean alone, drained from 5 samples on
  CHECK(drained(36));
}

TEST_CASE("baseline: err_slope counts where it stands while err_excess falls back", "[predictor]") {
  BaselineParams bp;
  bp.threshold[kErrSlope] = 1.0f;
  bp.steps = 6;
  FeatureRow rows[6] = {};
  // The same slope on both rails: a rise, then level. Mean 9 / 6 = 1.5 (risk 1 on the mean).
  const float slope[6] = {0, 4, 4, 1, 0, 0};
  for (int i = 0; i < 6; ++i) rows[i][kErrSlope] = slope[i];
  // err_excess fallen back below its mean (14.5 / 6): the slope counts at its latest row, 0.
  // (From 2 four rows back to 1.5: a fall of 0.5, under the fall rule's kFallLeast.)
  const float fell[6] = {0, 2, 4, 4, 3, 1.5f};
  for (int i = 0; i < 6; ++i) rows[i][kErrExcess] = fell[i];
  float ratio[4];
  CHECK(baseline_risk(rows, 6, bp, ratio) == 0.0f);
  CHECK(ratio[kErrSlope] == 0.0f);
  // err_excess still rising (above its mean): the slope's mean, as before.
  for (int i = 0; i < 6; ++i) rows[i][kErrExcess] = static_cast<float>(i);
  CHECK(baseline_risk(rows, 6, bp, ratio) == 1.0f);
  CHECK(ratio[kErrSlope] == Approx(1.5));
  // Falling back, but the slope's latest row above its mean: the mean (the lower of the two).
  for (int i = 0; i < 6; ++i) rows[i][kErrExcess] = fell[i];
  rows[5][kErrSlope] = 3;  // mean 12 / 6 = 2
  CHECK(baseline_risk(rows, 6, bp, ratio) == 1.0f);
  CHECK(ratio[kErrSlope] == Approx(2.0));
}

TEST_CASE("baseline fall rule: a rate that has just fallen hard is a burst's tail", "[predictor]") {
  BaselineParams bp;
  bp.threshold[kErrExcess] = 1.0f;
  bp.threshold[kErrSlope] = 1.0f;
  bp.threshold[kLinkEvents] = 1.0f;
  bp.steps = 8;
  FeatureRow rows[8] = {};
  // A burst decaying: 4 at rows 2-5, then 3.1 and 3. Four rows back from the last, 4: a fall
  // of 1.0 >= kFallLeast (0.8). Without the rule err_excess counts min(mean 26.1 / 8, 3) = 3.
  const float tail[8] = {0, 0, 4, 4, 4, 4, 3.1f, 3};
  for (int i = 0; i < 8; ++i) {
    rows[i][kErrExcess] = tail[i];
    rows[i][kErrSlope] = 2;  // its mean and latest row both 2
  }
  float ratio[4];
  CHECK(baseline_risk(rows, 8, bp, ratio) == 0.0f);
  CHECK(ratio[kErrExcess] == 0.0f);
  CHECK(ratio[kErrSlope] == 0.0f);
  // Only err_excess and err_slope: link events still count.
  rows[7][kLinkEvents] = 8;  // mean 1
  CHECK(baseline_risk(rows, 8, bp, ratio) == Approx(0.7f));
  rows[7][kLinkEvents] = 0;
  // The same level reached by a slow fall (0.15 a row, 0.6 over 4 rows): judged as before.
  const float slow[8] = {3.9f, 3.75f, 3.6f, 3.45f, 3.3f, 3.15f, 3.0f, 3.0f};
  for (int i = 0; i < 8; ++i) rows[i][kErrExcess] = slow[i];
  CHECK(baseline_risk(rows, 8, bp, ratio) == 1.0f);
  CHECK(ratio[kErrExcess] == Approx(3.0f));
  // A rate that rises is never a fall.
  for (int i = 0; i < 8; ++i) rows[i][kErrExcess] = 0.5f * static_cast<float>(i);
  CHECK(baseline_risk(rows, 8, bp, ratio) == 1.0f);
  // kFallLag + 1 rows are needed: with 4 rows (a fall of 4 -> 3.1 is 3 rows back), none.
  for (int i = 0; i < 4; ++i) rows[i][kErrExcess] = tail[i + 2];
  rows[3][kErrExcess] = 3.0f;
  CHECK(baseline_risk(rows, 4, bp, ratio) == 1.0f);
  CHECK(ratio[kErrExcess] == Approx(3.0f));
}

namespace {
// The baseline's rise rule: lag (rows), least rise, ratio, level (model.h BaselineParams).
void set_rise(BaselineParams* p, int lag, float least, float ratio, float level) {
  p->rise_lag = lag;
  p->rise_least = least;
  p->rise_ratio = ratio;
  p->rise_level = level;
}
}  // namespace

TEST_CASE("baseline rise rule: a rate that keeps growing, not a floor step or a burst",
          "[predictor]") {
  BaselineParams bp;
  for (float& t : bp.threshold) t = 0;  // only the rise rule
  bp.steps = 24;
  set_rise(&bp, 4, 0.3f, 1.0f, 1.2f);
  FeatureRow rows[24] = {};
  auto excess = [&](const std::vector<float>& v) {
    for (size_t i = 0; i < v.size(); ++i) rows[i][kErrExcess] = v[i];
    return static_cast<int>(v.size());
  };
  bool rising = false;
  float ratio[4];
  // A creep: err_excess rising 0.125 a row; rows 0..8: rises 0.5 and 0.5, but level 1 < 1.2.
  std::vector<float> creep;
  for (int i = 0; i < 13; ++i) creep.push_back(0.125f * static_cast<float>(i));
  CHECK_FALSE(baseline_rising(rows, excess({creep.begin(), creep.begin() + 9}), bp));
  // Rows 0..12: rises 0.5 and 0.5, level 1.5: fires, risk 1, and says so.
  int n = excess(creep);
  CHECK(baseline_rising(rows, n, bp));
  CHECK(baseline_risk(rows, n, bp, ratio, &rising) == 1.0f);
  CHECK(rising);
  // Fewer than 2 lag + 1 rows: not judged, whatever they show.
  CHECK_FALSE(baseline_rising(rows, 2 * bp.rise_lag, bp));
  // The same rise, but the later interval rose less than the earlier (ratio 1): a floor that
  // stepped up and whose fast average is catching up (0, 1.0, 1.3: rises 1.0 then 0.3).
  std::vector<float> step(13, 0.0f);
  for (int i = 4; i < 13; ++i)
    step[static_cast<size_t>(i)] = i < 8 ? 0.25f * (i - 3) : 1.0f + 0.075f * (i - 8);
  n = excess(step);
  CHECK(rows[12][kErrExcess] - rows[8][kErrExcess] < rows[8][kErrExcess] - rows[4][kErrExcess]);
  CHECK_FALSE(baseline_rising(rows, n, bp));
  CHECK(baseline_risk(rows, n, bp, ratio, &rising) < 0.7f);
  CHECK_FALSE(rising);
  // A burst falling back: the later rise is negative.
  std::vector<float> burst = {0, 0, 0, 0, 0, 1, 2, 3, 3.5f, 3, 2.5f, 2, 1.6f};
  CHECK_FALSE(baseline_rising(rows, excess(burst), bp));
  // Growing, but still under the level: not yet.
  bp.rise_level = 2.0f;
  CHECK_FALSE(baseline_rising(rows, excess(creep), bp));
  // Lag 0: the rule is off.
  bp.rise_level = 1.2f;
  bp.rise_lag = 0;
  CHECK_FALSE(baseline_rising(rows, excess(creep), bp));
  CHECK(baseline_risk(rows, 13, bp) == 0.0f);

  // A window too short for the rule (2 x 4 + 1 = 9 rows) or for k is said, once, by callers.
  bp.rise_lag = 4;
  bp.steps = 6;
  CHECK(baseline_window_note(bp, 9, "--window-steps 9").empty());
  CHECK(baseline_window_note(bp, 8, "--window-steps 8") ==
        "the baseline's rise rule compares 9 samples; --window-steps 8 keeps 8, so it never fires");
  CHECK(baseline_window_note(bp, 5, "W") ==
        "the baseline's thresholds were tuned on the mean of 6 samples; W keeps 5, so it averages "
        "5; its rise rule compares 9 samples; W keeps 5, so it never fires");

  // Through RailPredictor: symbol errors at 1/s for 5 minutes (the floor), then doubling every
  // 30 s. The thresholds alone (err_excess 5, a 150-fold rise) are still quiet when the rule
  // drains the rail, and the event line names the counters as rising.
  BaselineParams rp;
  rp.threshold[kErrExcess] = 5.0f;
  rp.steps = 24;
  set_rise(&rp, 6, 0.3f, 1.0f, 1.0f);
  PredictorConfig cfg;
  cfg.window_steps = 24;
  RailPredictor p(cfg, nullptr, rp);
  Assessment a;
  double rate = 1;
  int drained_at = -1, first_fire = -1;
  for (int i = 0; i < 120 && drained_at < 0; ++i) {
    if (i >= 60) rate *= std::exp2(5.0 / 30);
    Step st;
    st.dt_s = 5;
    st.d[kSymbolErr] = std::round(rate * 5);
    if (!p.update(st, &a)) continue;
    if (a.risk == 1.0f && first_fire < 0) first_fire = i;
    if (a.drain) drained_at = i;
  }
  REQUIRE(drained_at > 60);
  CHECK(drained_at == first_fire + cfg.enter_samples - 1);
  CHECK(a.baseline_risk == 1.0f);
  CHECK(rate < 150);  // drained before the rate was 150 times its floor
  CHECK_THAT(p.top_contributors(2),
             Catch::StartsWith("phy errors") && Catch::Contains("(rising, x0."));
}

TEST_CASE("a drain the risk began lasts at least min_drain_s (R2CCL_PREDICT_MIN_DRAIN)",
          "[predictor]") {
  const BaselineParams bp = link_events_only(0.3f);  // a link event a second: risk 1; none: 0
  PredictorConfig cfg;
  cfg.window_steps = 2;
  cfg.threshold = 0.7f;
  cfg.return_samples = 2;
  cfg.enter_samples = 1;
  cfg.min_drain_s = 300;  // 5 samples of 60 s; the return threshold: the default 0.4
  // A zero-floor rail: with no events the link_events EWMA decays by e^-2 a sample, so the
  // risk is under 0.4 from the second quiet sample on.
  auto step = [](bool events) {
    Step s;
    s.dt_s = 60;
    s.d[kLinkRecovery] = events ? 60 : 0;
    return s;
  };
  auto run = [&](const PredictorConfig& c) {  // the sample (1-based) at which it returned
    RailPredictor p(c, nullptr, bp);
    Assessment a;
    REQUIRE(p.update(step(false), &a));
    REQUIRE(p.update(step(true), &a));
    REQUIRE(a.transition == 1);
    CHECK(a.hold_left_s == Approx(c.min_drain_s));  // what a sampler taking over inherits
    for (int i = 1; i <= 20; ++i) {
      REQUIRE(p.update(step(false), &a));
      if (a.transition == -1) {
        CHECK(a.drains_last_hour == 1);
        CHECK(a.hold_left_s == 0);
        return i;
      }
      CHECK(a.drain);
      CHECK(a.hold_left_s == Approx(std::max(0.0, c.min_drain_s - 60.0 * i)));
    }
    return -1;
  };
  // Without it: back at the 2nd low sample (the 2nd quiet one, 120 s after the drain).
  PredictorConfig off = cfg;
  off.min_drain_s = 0;
  CHECK(run(off) == 2);
  // With it: still drained 4 samples (240 s) in, though low; at 300 s (the 5th) the hold
  // ends, and the low samples counted during it return the rail at once.
  CHECK(run(cfg) == 5);
  // Longer than the return rule's own wait, it is what decides.
  cfg.min_drain_s = 600;
  CHECK(run(cfg) == 10);
  // A drain that goes on high past the hold returns by the usual rule only.
  {
    RailPredictor p(cfg, nullptr, bp);
    Assessment a;
    REQUIRE(p.update(step(false), &a));
    for (int i = 0; i < 15; ++i) REQUIRE(p.update(step(true), &a));  // 900 s high
    CHECK(a.drain);
    REQUIRE(p.update(step(false), &a));
    CHECK(a.drain);  // one low sample
    REQUIRE(p.update(step(false), &a));
    CHECK(a.transition == -1);  // the second: 120 s after the last high one
  }
}

TEST_CASE("drain guard: enter samples, at most N drains per hour, never the last usable rail",
          "[predictor]") {
  BaselineParams bp;
  bp.threshold[kLinkEvents] = 0.3f;  // a link event a second: risk 1; none: under 0.2
  bp.steps = 1;
  PredictorConfig cfg;
  cfg.window_steps = 2;
  cfg.threshold = 0.7f;
  cfg.return_threshold = 0.4f;
  cfg.return_samples = 1;
  cfg.enter_samples = 3;
  cfg.max_drains_per_hour = 2;
  cfg.min_drain_s = 0;  // each drain returns at its first low sample
  auto step = [](double high) {
    Step s;
    s.dt_s = 60;  // one sample a minute: an hour passes in 60 samples
    s.d[kLinkRecovery] = high > 0 ? 60 : 0;
    return s;
  };
  RailPredictor p(cfg, nullptr, bp);
  Assessment a;
  // High, high, low: no drain; then 3 in a row: a drain at the third.
  for (double x : {30.0, 30.0, 0.0, 30.0, 30.0}) {
    REQUIRE(p.update(step(x), &a));
    CHECK_FALSE(a.drain);
    CHECK(a.hold == Hold::kNone);
  }
  REQUIRE(p.update(step(30), &a));
  CHECK((a.drain && a.transition == 1 && a.drains_last_hour == 1));
  REQUIRE(p.update(step(0), &a));  // minute 7
  CHECK((!a.drain && a.transition == -1));
  for (int i = 0; i < 3; ++i) REQUIRE(p.update(step(30), &a));  // minutes 8-10: drain 2
  CHECK((a.drain && a.drains_last_hour == 2));
  REQUIRE(p.update(step(0), &a));  // minute 11
  CHECK_FALSE(a.drain);
  // A third high run within the hour is refused, and said once per run.
  int said = 0;
  for (int i = 0; i < 10; ++i) {
    REQUIRE(p.update(step(30), &a));
    CHECK_FALSE(a.drain);
    if (i >= 2) CHECK(a.hold == Hold::kHourLimit);
    said += a.hold_new;
  }
  CHECK(said == 1);
  CHECK_THAT(hold_message("mlx5_0:1", a, cfg),
             Catch::Contains("2 drains began within the last hour") &&
                 Catch::Contains("R2CCL_PREDICT_MAX_DRAINS_PER_HOUR=2"));
  // Still high at minute 66 (the first drain, at minute 6, is an hour old): drained now.
  int drained_at = -1;
  for (int minute = 22; minute <= 70 && drained_at < 0; ++minute) {
    REQUIRE(p.update(step(30), &a));
    if (a.transition == 1) drained_at = minute;
  }
  CHECK(drained_at == 66);
  CHECK(a.drains_last_hour == 2);  // the one at minute 10, and this one

  // The last usable rail: held however long the risk stays high, then drained at once when
  // another rail is usable again.
  RailPredictor q(cfg, nullptr, bp);
  said = 0;
  for (int i = 0; i < 5; ++i) {
    REQUIRE(q.update(step(30), &a, true));
    CHECK_FALSE(a.drain);
    said += a.hold_new;
  }
  CHECK(said == 1);
  CHECK(a.hold == Hold::kLastRail);
  CHECK_THAT(hold_message("eth2", a, cfg), Catch::Contains("last usable rail"));
  REQUIRE(q.update(step(30), &a, false));
  CHECK((a.drain && a.transition == 1));
  // Zero drains per hour: predictions never drain.
  cfg.max_drains_per_hour = 0;
  RailPredictor z(cfg, nullptr, bp);
  for (int i = 0; i < 5; ++i) REQUIRE(z.update(step(30), &a));
  CHECK((!a.drain && a.hold == Hold::kHourLimit));
}

TEST_CASE("recent_downs counts the link-downs the state shows and those between samples",
          "[predictor]") {
  auto step = [](bool up, double downed) {
    Step s;
    s.dt_s = 5;
    s.link_up = up;
    s.d[kLinkDowned] = downed;
    return s;
  };
  const double decay = std::exp(-5.0 / kDownsTauS);
  FeatureExtractor fx;
  FeatureRow r;
  // A first step down shows no down (the state before it is unknown).
  CHECK_FALSE(fx.push(step(false, 0), &r));
  REQUIRE(fx.push(step(true, 0), &r));
  CHECK(r[kRecentDowns] == 0);
  // Down for two steps (link_downed ticks once, in the first): one down, not two.
  CHECK_FALSE(fx.push(step(false, 1), &r));
  CHECK_FALSE(fx.push(step(false, 0), &r));
  REQUIRE(fx.push(step(true, 0), &r));
  double downs = 1 * decay * decay;
  CHECK(r[kRecentDowns] == Approx(std::log1p(downs)));
  // A tick seen only on the step back up is the same down; a second tick is another one.
  CHECK_FALSE(fx.push(step(false, 0), &r));
  REQUIRE(fx.push(step(true, 2), &r));
  downs = (downs * decay + 1) * decay + 1;
  CHECK(r[kRecentDowns] == Approx(std::log1p(downs)));
  // Down and up between two samples (the state never shows it): link_downed alone counts.
  REQUIRE(fx.push(step(true, 1), &r));
  downs = downs * decay + 1;
  CHECK(r[kRecentDowns] == Approx(std::log1p(downs)));
  // Then it fades: e-fold per kDownsTauS.
  for (int i = 0; i < kDownsTauS / 5; ++i) REQUIRE(fx.push(step(true, 0), &r));
  CHECK(r[kRecentDowns] == Approx(std::log1p(downs / std::exp(1.0))).epsilon(1e-4));
}

TEST_CASE("flap hold: a link back up after its second down within an hour stays drained",
          "[predictor]") {
  BaselineParams bp;
  bp.threshold[kLinkEvents] = 1e6f;  // the risk stays ~0: only the hold drains
  PredictorConfig cfg;
  cfg.window_steps = 2;
  cfg.return_samples = 2;
  cfg.down_hold_s = 600;
  cfg.down_hold_after = 2;
  auto step = [](bool up) {
    Step s;
    s.dt_s = 5;
    s.link_up = up;
    return s;
  };
  RailPredictor p(cfg, nullptr, bp);
  Assessment a;
  double t = 0;
  auto run_up = [&](int n) {  // n steps up; returns the time the rail returned, or -1
    double back = -1;
    for (int i = 0; i < n; ++i) {
      t += 5;
      REQUIRE(p.update(step(true), &a));
      if (a.transition == -1) back = t;
    }
    return back;
  };
  auto go_down = [&]() {
    t += 5;
    CHECK_FALSE(p.update(step(false), &a));
  };
  run_up(10);
  go_down();  // the first down: back up, the rail carries data at once
  run_up(1);
  CHECK((!a.drain && a.downs_last_hour == 1 && a.down_hold_s == 0));
  run_up(20);
  go_down();  // the second, within the hour: held out for 600 s from the step back up
  run_up(1);
  const double up2 = t;
  CHECK((a.drain && a.transition == 1 && a.downs_last_hour == 2 && a.down_hold_s == 600));
  // The board's cause field holds 47 characters: the short form fits, whatever the numbers.
  CHECK(down_hold_short_text(a).find("flap hold ") == 0);
  {
    Assessment big = a;
    big.down_hold_s = 3600;
    big.downs_last_hour = 1000;
    CHECK(down_hold_short_text(big) == "flap hold 3600 s (1000 downs in 1 h)");
    CHECK(down_hold_short_text(big).size() < 48);
  }
  CHECK_THAT(down_hold_text(a), Catch::Contains("2 link-downs within an hour") &&
                                    Catch::Contains("600 s") &&
                                    Catch::Contains("R2CCL_PREDICT_DOWN_HOLD"));
  const double back = run_up(200);
  CHECK(back >= up2 + 600);
  CHECK(back <= up2 + 600 + 5 * cfg.return_samples);
  // A third down within the hour: twice as long.
  go_down();
  run_up(1);
  CHECK((a.drain && a.downs_last_hour == 3 && a.down_hold_s == 1200));
  // The last usable rail is never held out.
  RailPredictor q(cfg, nullptr, bp);
  for (int k = 0; k < 2; ++k) {
    REQUIRE(q.update(step(true), &a, true));
    CHECK_FALSE(q.update(step(false), &a, true));
  }
  REQUIRE(q.update(step(true), &a, true));
  CHECK((!a.drain && a.downs_last_hour == 2));
  // R2CCL_PREDICT_DOWN_HOLD=0: off.
  cfg.down_hold_s = 0;
  RailPredictor z(cfg, nullptr, bp);
  for (int k = 0; k < 3; ++k) {
    REQUIRE(z.update(step(true), &a));
    CHECK_FALSE(z.update(step(false), &a));
  }
  REQUIRE(z.update(step(true), &a));
  CHECK_FALSE(a.drain);
}

TEST_CASE("decider both: the LSTM raises the baseline's risk, at most lstm_cap times it",
          "[predictor]") {
  // The LSTM here says "failure" (risk ~1) at every sample; the baseline watches link events
  // (feature 2) with a threshold of 0.3, one sample a minute, so a step's own rate dominates.
  Model m;
  always_failing_model(&m);
  const BaselineParams lp = link_events_only(0.3f);
  PredictorConfig cfg;
  cfg.window_steps = 4;
  cfg.enter_samples = 1;
  cfg.lstm_cap = 1.6f;
  RailPredictor p(cfg, &m, lp);
  auto step = [](double events_per_s) {
    Step s;
    s.dt_s = 60;
    s.d[kLinkRecovery] = events_per_s * 60;
    return s;
  };
  Assessment a;
  // Quiet: the baseline's risk is 0, so the LSTM's 1.0 counts for nothing.
  REQUIRE(p.update(step(0), &a));
  CHECK(a.source == Source::kBoth);
  CHECK(a.baseline_risk == 0.0f);
  CHECK(a.risk == 0.0f);
  CHECK_FALSE(a.drain);
  // A little: the baseline's risk b < 0.9 / 1.6, so the risk is 1.6 b, under the threshold.
  double rate = 0.1;
  REQUIRE(p.update(step(rate), &a));
  CHECK(a.baseline_risk > 0.1f);
  CHECK(a.baseline_risk < 0.9f / 1.6f);
  CHECK(a.risk == Approx(1.6 * a.baseline_risk).epsilon(1e-5));
  CHECK_FALSE(a.drain);
  // More, still under the baseline's own drain level: the LSTM lifts it over the threshold.
  for (int i = 0; i < 40 && !(a.baseline_risk >= 0.9f / 1.6f); ++i) {
    rate *= 1.2;
    REQUIRE(p.update(step(rate), &a));
  }
  CHECK(a.baseline_risk >= 0.9f / 1.6f);
  CHECK(a.baseline_risk < 0.9f);
  CHECK(a.risk >= 0.9f);
  CHECK(a.drain);
  CHECK(a.transition == 1);
  // The LSTM's risk decided, so the event would name its counters ("(-X if quiet)"; this
  // model ignores its inputs, so none), not the baseline's ratios.
  CHECK_THAT(p.top_contributors(3), !Catch::Contains("of threshold"));
  // The same rows with the LSTM alone would have drained at the first quiet sample; with the
  // baseline alone, not yet.
  PredictorConfig alone = cfg;
  alone.lstm_cap = 0;
  RailPredictor lstm(alone, &m, lp), base(cfg, nullptr, lp);
  REQUIRE(lstm.update(step(0), &a));
  CHECK(a.source == Source::kLstm);
  CHECK(a.drain);
  REQUIRE(base.update(step(0.1), &a));
  CHECK(a.source == Source::kBaseline);
  CHECK_FALSE(a.drain);
  CHECK_THAT(base.top_contributors(3), Catch::Contains("of threshold"));
  CHECK(std::string(source_name(Source::kBoth)) == "both");
}

TEST_CASE("the baseline is the parameter table's default decider; both uses R2CCL_PREDICT_LSTM_CAP",
          "[predictor]") {
  r2ccl::Config c = r2ccl::default_config();
  CHECK(c.predict_decider == "baseline");
  CHECK(predictor_config_from(c).lstm_cap == 0);
  c.predict_decider = "both";
  CHECK(predictor_config_from(c).lstm_cap == Approx(1.4));
  c.predict_decider = "lstm";
  CHECK(predictor_config_from(c).lstm_cap == 0);
}

TEST_CASE("flap hold by default: a link back up after a single down stays drained", "[predictor]") {
  // The parameter table's defaults, as the plugin reads them with nothing set.
  r2ccl::Config c = r2ccl::default_config();
  const PredictorConfig cfg = predictor_config_from(c);
  CHECK(cfg.down_hold_after == 1);
  CHECK(cfg.down_hold_s == 600);
  BaselineParams bp;
  bp.threshold[kLinkEvents] = 1e6f;  // the risk stays ~0: only the hold drains
  RailPredictor p(cfg, nullptr, bp);
  Step s;
  s.dt_s = 5;
  Assessment a;
  for (int i = 0; i < 10; ++i) {
    s.link_up = true;
    REQUIRE(p.update(s, &a));
  }
  s.link_up = false;
  CHECK_FALSE(p.update(s, &a));
  s.link_up = true;
  REQUIRE(p.update(s, &a));
  CHECK((a.drain && a.transition == 1 && a.downs_last_hour == 1 && a.down_hold_s == 600));
  CHECK_THAT(down_hold_text(a), Catch::Contains("back up after 1 link-down within an hour"));
  // It returns once the 600 s are over and its risk is low, not before.
  int steps = 1;
  while (a.drain && steps < 1000) {
    REQUIRE(p.update(s, &a));
    ++steps;
  }
  CHECK(steps * 5 >= 600);
  CHECK(steps * 5 <= 600 + 5 * (cfg.return_samples + 1));
}

TEST_CASE("flap hold: a down right after the rail's first reading counts", "[predictor]") {
  // The first reading has no deltas (dt 0) but says the link was up: a down at the next one is
  // a link-down like any other, as the trace tools' failure events count it.
  PredictorConfig cfg;  // down_hold_after 1, down_hold_s 600
  BaselineParams bp;
  bp.threshold[kLinkEvents] = 1e6f;
  {
    RailPredictor p(cfg, nullptr, bp);
    Step s;
    Assessment a;
    CHECK_FALSE(p.update(s, &a));  // the priming reading: dt 0, link up
    s.dt_s = 5;
    s.link_up = false;
    CHECK_FALSE(p.update(s, &a));
    s.link_up = true;
    REQUIRE(p.update(s, &a));
    CHECK((a.drain && a.downs_last_hour == 1 && a.down_hold_s == 600));
  }
  {
    // A rail whose first reading is already down has shown no down (nothing to count).
    RailPredictor p(cfg, nullptr, bp);
    Step s;
    s.link_up = false;
    Assessment a;
    CHECK_FALSE(p.update(s, &a));
    s.dt_s = 5;
    CHECK_FALSE(p.update(s, &a));
    s.link_up = true;
    REQUIRE(p.update(s, &a));
    CHECK_FALSE(a.drain);
    CHECK(a.downs_last_hour == 0);
  }
  // The node sampler passes its priming read on.
  const std::string root = temp_dir();
  for (const char* dev : {"eth1", "eth2"}) {
    write_file(root + "/class/net/" + std::string(dev) + "/statistics/rx_crc_errors", "0\n");
    write_file(root + "/class/net/" + std::string(dev) + "/operstate", "up\n");
  }
  NodeSampler ns(
      root, {{"eth1", RailSpec::Kind::kEth, "eth1", 1}, {"eth2", RailSpec::Kind::kEth, "eth2", 1}},
      cfg, nullptr, bp);
  std::vector<RailRisk> out;
  std::vector<std::string> notes;
  ns.sample(10.0, {}, &out, &notes);
  write_file(root + "/class/net/eth1/operstate", "down\n");
  ns.sample(15.0, {}, &out, &notes);
  write_file(root + "/class/net/eth1/operstate", "up\n");
  ns.sample(20.0, {}, &out, &notes);
  REQUIRE(out.size() == 2);
  CHECK((out[0].a.drain && out[0].a.down_hold_s == 600));
  CHECK_THAT(out[0].top, Catch::Contains("back up after 1 link-down"));
  CHECK_FALSE(out[1].a.drain);
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

TEST_CASE("node sampler: the last usable rail of the node is not drained", "[predictor]") {
  const std::string root = temp_dir();
  for (const char* dev : {"eth1", "eth2"}) {
    write_file(root + "/class/net/" + std::string(dev) + "/statistics/rx_crc_errors", "0\n");
    write_file(root + "/class/net/" + std::string(dev) + "/operstate", "up\n");
  }
  Model m;  // "failure" whatever it sees
  always_failing_model(&m);
  PredictorConfig cfg;
  cfg.window_steps = 4;
  NodeSampler ns(
      root, {{"eth1", RailSpec::Kind::kEth, "eth1", 1}, {"eth2", RailSpec::Kind::kEth, "eth2", 1}},
      cfg, &m, m.baseline);
  std::vector<RailRisk> out;
  std::vector<std::string> notes;
  for (int i = 0; i < 4; ++i) ns.sample(10.0 + i, {}, &out, &notes);
  REQUIRE(out.size() == 2);
  // Both ask for a drain at the same sample: the first one gets it, the second is the last
  // usable rail and is held.
  CHECK(out[0].a.drain);
  CHECK_FALSE(out[1].a.drain);
  CHECK(out[1].a.hold == Hold::kLastRail);
  CHECK(out[1].a.hold_new);
  // eth1's link goes down: eth2 is still the last usable rail.
  write_file(root + "/class/net/eth1/operstate", "down\n");
  ns.sample(14.0, {}, &out, &notes);
  CHECK_FALSE(out[1].a.drain);
  CHECK_FALSE(out[1].a.hold_new);  // said once
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

TEST_CASE("node sampler: FEC from the kernel for the real /sys only", "[predictor]") {
  // An interface the kernel does not have: the sampler asks it and says why the FEC counters
  // stay missing (once). lo, a loopback interface, is never asked. Under a fake root the
  // kernel is never asked.
  Model m;
  always_failing_model(&m);
  PredictorConfig cfg;
  cfg.window_steps = 4;
  const RailSpec none{"r2cclnone0", RailSpec::Kind::kEth, "r2cclnone0", 1};
  const RailSpec lo{"lo", RailSpec::Kind::kEth, "lo", 1};
  std::vector<RailRisk> out;
  std::vector<std::string> notes;
  // The kernel is asked on a thread of the sampler's own; its answer comes at a later sample.
  NodeSampler real("/sys/.", {none, lo}, cfg, &m, m.baseline);  // resolves to /sys
  auto fec_notes = [&] {
    int k = 0;
    for (const auto& n : notes)
      k += n.find(
               "r2cclnone0: FEC statistics unavailable (ethtool netlink FEC_GET: No such "
               "device)") != std::string::npos;
    return k;
  };
  for (int i = 0; i < 500 && fec_notes() == 0; ++i) {
    real.sample(10.0 + i, {}, &out, &notes);
    usleep(10000);
  }
  for (int i = 0; i < 3; ++i) real.sample(20.0 + i, {}, &out, &notes);
  CHECK(fec_notes() == 1);
  for (const auto& n : notes) CHECK(n.find("lo: FEC") == std::string::npos);
  Step s;
  REQUIRE(real.last_step(1, &s));
  CHECK((s.missing & (1u << kFecCorrBlocks)) != 0);
  CHECK((s.missing & (1u << kRxBytes)) == 0);  // lo's own statistics are read
  // A fake tree with the same interface name: no kernel request, so no note.
  const std::string root = temp_dir();
  write_file(root + "/class/net/lo/statistics/rx_bytes", "0\n");
  NodeSampler fake(root, {lo}, cfg, &m, m.baseline);
  notes.clear();
  for (int i = 0; i < 3; ++i) fake.sample(10.0 + i, {}, &out, &notes);
  for (const auto& n : notes) CHECK(n.find("FEC") == std::string::npos);
  // A test's own source is used when set.
  FakeFec fec;
  fec.next = FecReading{rd(1), rd(2), rd(3)};
  fake.set_fec_source(&fec);
  fake.sample(14.0, {}, &out, &notes);
  CHECK(fec.asked == std::vector<std::string>{"lo"});
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}

TEST_CASE("trace reader: the Ethernet / RoCE physical-layer columns", "[predictor]") {
  const std::string dir = temp_dir();
  const std::string path = dir + "/t.csv";
  write_file(path,
             "t_s,rail,link,speed_mbps,symbol_err,crc_err,fec_corr_blocks,fec_uncorr_blocks,"
             "fec_corr_bits,scenario\n"
             "0,ib0,1,400000,3,,,,,healthy\n"
             "0,eth0,1,400000,,10,1000,0,50000,healthy\n"
             "5,ib0,1,400000,4,,,,,healthy\n"
             "5,eth0,1,400000,,12,1600,1,80000,healthy\n");
  TraceReader tr;
  std::string err;
  REQUIRE(tr.open(path, &err));
  TraceRow r;
  for (int i = 0; i < 3; ++i) REQUIRE(tr.next(&r, &err));
  CHECK(r.rail == 0);
  CHECK(r.step.d[kSymbolErr] == 1);
  for (int c : {kCrcErr, kFecCorrBlocks, kFecUncorrBlocks, kFecCorrBits})
    CHECK((r.step.missing & (1u << c)) != 0);  // an IB port has none of them
  REQUIRE(tr.next(&r, &err));
  CHECK(r.rail == 1);
  CHECK((r.step.missing & (1u << kSymbolErr)) != 0);  // RoCE: no IB symbol counter
  CHECK(r.step.d[kCrcErr] == 2);
  CHECK(r.step.d[kFecCorrBlocks] == 600);
  CHECK(r.step.d[kFecUncorrBlocks] == 1);
  CHECK(r.step.d[kFecCorrBits] == 30000);
  CHECK(counter_by_name("fec_corr_bits") == kFecCorrBits);
  CHECK(std::string(counter_name(kCrcErr)) == "crc_err");

  // Widths per rail prefix: rcv_err is IB's 16-bit saturating counter, Ethernet's 64-bit
  // rx_errors. Widths lines come before the header.
  write_file(path,
             "# widths: rcv_err=sat16\n# widths for eth: rcv_err=wrap64\n"
             "t_s,rail,rcv_err\n0,ib0,65534\n0,eth0,65534\n5,ib0,65535\n5,eth0,70000\n"
             "10,eth0,3\n");
  TraceReader t2;
  REQUIRE(t2.open(path, &err));
  for (int i = 0; i < 3; ++i) REQUIRE(t2.next(&r, &err));
  CHECK(t2.width_of(0, kRcvErr).saturating);
  CHECK_FALSE(t2.width_of(1, kRcvErr).saturating);
  CHECK(t2.width_of(1, kRcvErr).bits == 64);
  CHECK((r.step.missing & (1u << kRcvErr)) != 0);  // reached 65535 (sat16): unknown
  REQUIRE(t2.next(&r, &err));
  CHECK(r.step.d[kRcvErr] == 70000 - 65534);
  REQUIRE(t2.next(&r, &err));
  CHECK(r.step.d[kRcvErr] == 3);  // a reset of a 64-bit counter, not a wrap
  CHECK(r.step.reset == 1u << kRcvErr);
  for (const auto& [body, needle] :
       {std::pair<const char*, const char*>{"# widths for : rcv_err=wrap64\nt_s,rail\n",
                                            "bad widths line"},
        {"t_s,rail\n# widths: rcv_err=wrap64\n0,a\n", "after the header"}}) {
    write_file(path, body);
    TraceReader t3;
    std::string e;
    REQUIRE(t3.open(path, &e));
    while (t3.next(&r, &e)) {
    }
    CHECK_THAT(e, Catch::Contains(needle));
  }
  REQUIRE(system(("rm -rf " + dir).c_str()) == 0);
}

TEST_CASE("trace reader: widths, deltas, events, and errors naming line and column",
          "[predictor]") {
  const std::string dir = temp_dir();
  const std::string path = dir + "/t.csv";
  write_file(path,
             "# r2ccl trace\n"
             "# widths: retrans=wrap32 symbol_err=sat16\n"
             "t_s,rail,link,speed_mbps,retrans,tx_packets,symbol_err,scenario\n"
             "0,a,1,100000,4294967290,10,5,optical\n"
             "0,b,1,100000,0,0,,idle\n"
             "5,a,1,100000,4,20,65535,optical\n"
             "10,a,0,100000,1,30,65535,optical\n"
             "5,b,1,N/A,N/A,7,1,idle\n");
  TraceReader tr;
  std::string err;
  REQUIRE(tr.open(path, &err));
  TraceRow r;
  REQUIRE(tr.next(&r, &err));
  CHECK((r.rail == 0 && !r.has_step));
  REQUIRE(tr.next(&r, &err));
  CHECK((r.rail == 1 && !r.has_step));
  REQUIRE(tr.next(&r, &err));
  REQUIRE(r.has_step);
  CHECK(r.step.dt_s == 5);
  CHECK(r.step.d[kRetrans] == 10);                    // wrapped at 2^32
  CHECK((r.step.missing & (1u << kSymbolErr)) != 0);  // reached 65535 (sat16): unknown
  CHECK(r.step.speed_mbps == 100000);
  REQUIRE(tr.next(&r, &err));
  CHECK_FALSE(r.link_up);
  CHECK(r.step.d[kRetrans] == 1);  // 4 -> 1: a reset
  REQUIRE(tr.next(&r, &err));
  CHECK(r.rail == 1);
  CHECK((r.step.missing & (1u << kRetrans)) != 0);
  CHECK(r.step.d[kTxPackets] == 7);
  CHECK(tr.scenarios()[static_cast<size_t>(r.scenario)] == "idle");
  CHECK_FALSE(tr.next(&r, &err));
  CHECK(err.empty());

  // A reset of every counter of a rail, with retrans (32-bit) 6 below 2^32: not a wrap.
  write_file(path,
             "# widths: retrans=wrap32\n"
             "t_s,rail,link,retrans,tx_packets\n"
             "0,a,1,4294967290,5000000\n"
             "5,a,1,3,100\n"
             "10,a,1,4294967295,200\n"
             "15,a,1,4,300\n");
  TraceReader tr3;
  REQUIRE(tr3.open(path, &err));
  REQUIRE(tr3.next(&r, &err));
  REQUIRE(tr3.next(&r, &err));
  CHECK(r.step.d[kRetrans] == 3);  // reset with tx_packets: the count since, not 9
  CHECK(r.step.d[kTxPackets] == 100);
  CHECK(r.step.reset == ((1u << kRetrans) | (1u << kTxPackets)));
  REQUIRE(tr3.next(&r, &err));
  CHECK(r.step.reset == 0);
  REQUIRE(tr3.next(&r, &err));
  CHECK(r.step.d[kRetrans] == 5);  // wrapped alone: a wrap
  CHECK(r.step.d[kTxPackets] == 100);
  CHECK(r.step.reset == 0);

  auto expect_error = [&](const std::string& body, const char* needle) {
    write_file(path, body);
    TraceReader t2;
    std::string e;
    REQUIRE(t2.open(path, &e));
    TraceRow row;
    while (t2.next(&row, &e)) {
    }
    INFO(e);
    CHECK_THAT(e, Catch::Contains(needle));
  };
  expect_error("t_s,rail,symbol_err\n0,a,12x\n", "line 2 column symbol_err");
  expect_error("t_s,rail,symbol_err\n5,a,1\n5,a,2\n", "does not increase");
  expect_error("t_s,rail,bogus\n", "unknown column 'bogus'");
  expect_error("# widths: symbol_err=sat99\nt_s,rail\n", "bad width");
  expect_error("# widths: symbol_err=sat16 symbol_err=wrap32\nt_s,rail\n",
               "counter 'symbol_err' is declared twice in one widths line");
  expect_error("t_s,rail,link\n0,a,2\n", "accepted: 1 up, 0 down");
  expect_error("t_s,rail\n0,a,3\n", "3 fields");
  expect_error("", "no header");
  REQUIRE(system(("rm -rf " + dir).c_str()) == 0);
}

TEST_CASE("node sampler: a rail without readable counters is never assessed", "[predictor]") {
  const std::string root = temp_dir();
  write_file(root + "/class/net/eth1/statistics/rx_crc_errors", "0\n");
  write_file(root + "/class/net/eth1/operstate", "up\n");
  // A model that says "failure" whatever it sees: only the guard keeps eth9 undrained.
  Model m;
  always_failing_model(&m);
  PredictorConfig cfg;
  cfg.window_steps = 4;
  NodeSampler ns(
      root, {{"eth1", RailSpec::Kind::kEth, "eth1", 1}, {"eth9", RailSpec::Kind::kEth, "eth9", 1}},
      cfg, &m, m.baseline);
  std::vector<RailRisk> out;
  std::vector<std::string> notes;
  ns.sample(10.0, {}, &out, &notes);
  REQUIRE(out.size() == 2);
  CHECK(out[0].a.risk == -1);  // primed only
  ns.sample(10.5, {}, &out, &notes);
  ns.sample(11.0, {}, &out, &notes);
  CHECK(out[0].a.risk > 0.99f);
  CHECK_FALSE(out[0].a.drain);  // 2 high samples: R2CCL_PREDICT_ENTER_SAMPLES is 3
  ns.sample(11.5, {}, &out, &notes);
  CHECK(out[0].a.drain);
  CHECK(out[0].a.source == Source::kLstm);
  CHECK(out[1].a.risk == -1);
  CHECK_FALSE(out[1].a.drain);
  int said = 0;
  for (const auto& n : notes) said += n.find("rail eth9 is not predicted") != std::string::npos;
  CHECK(said == 1);  // once, not per sample
  REQUIRE(system(("rm -rf " + root).c_str()) == 0);
}
