// NIC counters for the failure predictor: the fifteen canonical counters, the delta of one
// counter reading against the previous one (wraps, saturation, resets, missing values), and
// the live reader of one rail's counter files under a sysfs root.
//
// Sources of the counter facts: the InfiniBand Architecture spec's PortCounters (error
// counters saturate at 4, 8 or 16 bits) and PortCountersExtended (64-bit data and packet
// counters, which wrap; port_xmit_data/port_rcv_data count 4-octet words), as served by Linux
// drivers/infiniband/core/sysfs.c; the mlx5 Q counters in hw_counters (32-bit in firmware,
// wrap at 2^32; drivers/infiniband/hw/mlx5/counters.c). Linux
// Documentation/ABI/testing/sysfs-class-net-statistics (Ethernet statistics, carrier_changes,
// carrier_down_count). docs/PREDICTOR.md maps the files onto the canonical counters.
//
// Thread-safety: none; a SysfsRail belongs to one thread (the net plugin's background thread
// or a tool's main thread). The free functions are pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace r2ccl::predict {

// The canonical counters. Each is a count of events, packets or bytes.
enum Counter : int {
  kRetrans = 0,   // retransmission events (IB: ack timeouts + sequence errors + OOS; TCP)
  kTxPackets,     // packets (TCP rails: segments) sent
  kRxPackets,     // packets received
  kTxBytes,       // bytes sent
  kRxBytes,       // bytes received
  kSymbolErr,     // IB symbol errors (16-bit, saturating)
  kRcvErr,        // IB port receive errors / Ethernet rx errors
  kLinkRecovery,  // IB link error recovery / Ethernet carrier changes
  kLinkDowned,    // IB link downed / Ethernet carrier down count
  kIntegrity,     // IB local link integrity errors (no Ethernet equivalent)
  kBufOverrun,    // IB excessive buffer overrun + out_of_buffer / Ethernet rx over, fifo,
                  // missed, tx dropped
  // Ethernet / RoCE physical layer (a RoCE port has no IB symbol counter; docs/PREDICTOR.md):
  kCrcErr,           // Ethernet rx CRC (FCS) errors
  kFecCorrBlocks,    // RS-FEC corrected codewords (IEEE 802.3 30.5.1.1.17)
  kFecUncorrBlocks,  // RS-FEC uncorrectable codewords (IEEE 802.3 30.5.1.1.18)
  kFecCorrBits,      // FEC corrected bits (vendor counter, e.g. mlx5)
  kNumCounters
};

// "retrans", "tx_packets", ... (the trace CSV's column names). nullptr when out of range.
const char* counter_name(int c);
// -1 when the name is not a canonical counter.
int counter_by_name(const std::string& name);

// How a counter behaves at its maximum.
struct Width {
  uint8_t bits = 64;        // 1..64
  bool saturating = false;  // true: stops at 2^bits - 1; false: wraps to 0
};
// "sat16", "wrap32", "wrap64". Returns false (and leaves *out) on anything else.
bool parse_width(const std::string& s, Width* out);
std::string width_name(Width w);

enum class DeltaKind : uint8_t {
  kNormal,     // cur >= prev
  kMissing,    // no previous or no current reading: the delta counts as 0
  kWrapped,    // a wrapping counter went past 2^bits - 1
  kReset,      // the counter went down without wrapping (perfquery -R, driver reload): the
               // delta is the new value, the count since the reset
  kSaturated,  // a saturating counter reads its maximum: increments from here on are lost
};
struct Delta {
  uint64_t value = 0;
  DeltaKind kind = DeltaKind::kMissing;
};

// One counter reading: `present` false for a missing file, "N/A" or a non-number.
struct Reading {
  bool present = false;
  uint64_t value = 0;
};

// The delta from `prev` to `cur` for a counter of width `w`. A wrapping counter that went down
// by more than half its range wrapped; any other decrease is a reset. Pure.
Delta counter_delta(Reading prev, Reading cur, Width w);

// A port's counters are reset together (perfquery -R, a driver reload, a reboot), so within
// one rail's step, a wrapping counter that seems to have wrapped while another counter of the
// rail went down without being able to wrap (a kReset) was reset too: its delta becomes its
// new value, the count since the reset, not the distance to 2^bits. (A 32-bit link_downed at
// 2^32 - 12 that reads 0 after a reset is not 12 link-downs.) d[i] is the delta of the
// reading cur[i]; n entries. Pure.
void settle_resets(Delta* d, const Reading* cur, size_t n);

// Parses a counter file's text: leading/trailing whitespace allowed, decimal digits, at most
// 2^64 - 1. "N/A", empty text, signs, overflow or trailing junk -> not present.
Reading parse_reading(const std::string& text);

// Deltas of one sampling step of one rail: what the features are computed from.
struct Step {
  double dt_s = 0;              // seconds since the previous reading (> 0 for a usable step)
  bool link_up = true;          // link state at this reading
  double speed_mbps = 0;        // link speed, Mb/s; 0 unknown
  double d[kNumCounters] = {};  // deltas; a missing reading counts 0
  uint32_t missing = 0;         // bit c set: counter c had no usable delta this step (no
                                // reading, or saturated: it counts nothing more, unknown)
  // Bit c set: counter c (one of its files) was reset this step (DeltaKind::kReset,
  // settle_resets included): its delta is the count since the reset, over an unknown part of
  // dt_s, so not a rate.
  uint32_t reset = 0;
};

// What a rail is, for the live reader.
struct RailSpec {
  enum class Kind : uint8_t { kIb, kEth };
  std::string name;  // the rail's name as the transports publish it: "mlx5_0:1", "eth0"
  Kind kind = Kind::kEth;
  std::string device;  // IB device ("mlx5_0") or interface ("eth0")
  int port = 1;        // IB port number
};

// Counters a transport keeps itself and adds to a rail's readings (TCP rails: TCP_INFO
// total_retrans and segs_out summed over the plugin's sockets on the rail). Cumulative 64-bit.
struct ExtraCounters {
  bool present = false;
  uint64_t retrans = 0;
  uint64_t segs_out = 0;
};

class FecSource;  // fec.h

// Reads one rail's counter files under `root` (R2CCL_SYSFS_ROOT) and turns consecutive
// readings into Steps. Each file keeps its own previous value and width, so a wrap or reset
// of one file never disturbs the others.
//
// An Ethernet rail's FEC statistics, and a RoCE port's (an IB port whose link_layer reads
// "Ethernet": its netdev, named by gid_attrs/ndevs/0, gives rx_crc_errors and the FEC counters),
// are not in sysfs: they come from a FecSource (fec.h; the kernel's ethtool netlink for the
// real /sys) when one is set, else they stay missing.
class SysfsRail {
 public:
  SysfsRail(const std::string& root, const RailSpec& spec);

  // Where fec_corr_blocks, fec_uncorr_blocks and fec_corr_bits come from; null (the default):
  // nowhere. Not owned; must outlive the rail. A failure is noted once per kind (errno) through
  // read()'s notes. Not asked again after EOPNOTSUPP, EINVAL or ENOENT (a driver without FEC
  // statistics, a kernel that does not know the request, no libnl) or three answers in a row
  // with no statistic in them; asked again after anything else. EAGAIN (not answered yet) is
  // silent: that step has no FEC delta, and the next reading's delta is its rate since the
  // previous reading times the step's length (when both readings carry their times).
  void set_fec_source(FecSource* src) { fec_ = src; }
  // The interface whose FEC statistics this rail reads: the Ethernet rail's own, a RoCE port's
  // netdev, or "" (an InfiniBand port).
  const std::string& fec_ifname() const { return fec_ifname_; }

  // Reads every file. The first call primes: it fills *out with the link state and speed only
  // (no deltas, dt 0) and returns false; later calls fill *out with the deltas since the
  // previous call and return true (also while the link is down, with out->link_up false).
  // Only regular files are read (non-blocking open): nothing under the root can block. `now_s` is a
  // monotonic time in seconds. Notes about the counters (a saturated counter, once per file; a
  // reset; a file that disappeared) are appended to *notes when non-null, one line each, naming the
  // file.
  bool read(double now_s, const ExtraCounters& extra, Step* out, std::vector<std::string>* notes);

  const RailSpec& spec() const { return spec_; }
  // The directory the files are read from (for messages).
  const std::string& dir() const { return dir_; }
  // Number of counter files that were readable at the last read (0: nothing to predict from).
  int files_present() const { return present_; }

 private:
  struct File {
    std::string path;  // the file
    int counter;       // canonical counter
    Width width;
    uint64_t scale;  // 4 for the IB data counters (4-octet words)
    Reading prev;
    bool warned_saturated = false;
    bool was_present = false;
  };
  void add(const char* rel, int counter, Width w, uint64_t scale = 1);  // under dir_
  void add_at(const std::string& path, int counter, Width w, uint64_t scale = 1);
  void read_fec(double now_s, Step* s, uint32_t* counting, std::vector<std::string>* notes);

  RailSpec spec_;
  std::string dir_;
  std::vector<File> files_;
  Reading extra_prev_[2];
  double prev_s_ = -1;
  int present_ = 0;
  FecSource* fec_ = nullptr;
  std::string fec_ifname_;
  Reading fec_prev_[3];         // corrected blocks, uncorrectable blocks, corrected bits
  double fec_prev_t_ = 0;       // when fec_prev_ was read (FecReading::t_s; 0 unknown)
  std::string setup_note_;      // said at the first read (a RoCE netdev name refused)
  std::vector<int> fec_noted_;  // the kinds of FEC failure already noted (errno; 0: no stats)
  int fec_empty_ = 0;           // successive answers without any FEC statistic
  bool fec_off_ = false;
};

// Every rail under `root`: each port of class/infiniband/*, and each class/net/* interface
// with a statistics directory except lo. For r2ccl_predict --live.
std::vector<RailSpec> discover_rails(const std::string& root);

}  // namespace r2ccl::predict
