#include "r2ccl/predict/counters.h"

#include <linux/if.h>  // IFNAMSIZ

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "r2ccl/predict/fec.h"

namespace r2ccl::predict {

namespace {

const char* const kNames[kNumCounters] = {
    "retrans",     "tx_packets", "rx_packets",      "tx_bytes",          "rx_bytes",
    "symbol_err",  "rcv_err",    "link_recovery",   "link_downed",       "integrity",
    "buf_overrun", "crc_err",    "fec_corr_blocks", "fec_uncorr_blocks", "fec_corr_bits"};

// Reads at most `cap` bytes of a small sysfs-like file. False when it cannot be opened/read or
// is not a regular file: opened non-blocking and checked with fstat, so a FIFO, a device or a
// socket planted in the tree can never block the background thread (sysfs attributes are
// regular files).
bool read_small(const std::string& path, std::string* out, size_t cap = 128) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return false;
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return false;
  }
  char buf[256];
  cap = std::min(cap, sizeof(buf));
  ssize_t n;
  do {
    n = ::read(fd, buf, cap);
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n < 0) return false;
  out->assign(buf, static_cast<size_t>(n));
  return true;
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

// An interface name as Linux accepts one (net/core/dev.c dev_valid_name): 1-15 bytes, not "."
// or "..", no '/', ':' or whitespace; and here, printable bytes only (no NUL, no control).
bool valid_ifname(const std::string& n) {
  if (n.empty() || n.size() >= IFNAMSIZ || n == "." || n == "..") return false;
  for (char ch : n)
    if (!std::isgraph(static_cast<unsigned char>(ch)) || ch == '/' || ch == ':') return false;
  return true;
}

uint64_t width_max(Width w) { return w.bits >= 64 ? ~0ULL : (1ULL << w.bits) - 1; }

}  // namespace

const char* counter_name(int c) { return c >= 0 && c < kNumCounters ? kNames[c] : nullptr; }

int counter_by_name(const std::string& name) {
  for (int c = 0; c < kNumCounters; ++c)
    if (name == kNames[c]) return c;
  return -1;
}

bool parse_width(const std::string& s, Width* out) {
  bool sat;
  size_t p;
  if (s.rfind("sat", 0) == 0) {
    sat = true;
    p = 3;
  } else if (s.rfind("wrap", 0) == 0) {
    sat = false;
    p = 4;
  } else {
    return false;
  }
  if (p >= s.size() || s.size() - p > 2) return false;
  int bits = 0;
  for (size_t i = p; i < s.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
    bits = bits * 10 + (s[i] - '0');
  }
  if (bits < 1 || bits > 64) return false;
  out->bits = static_cast<uint8_t>(bits);
  out->saturating = sat;
  return true;
}

std::string width_name(Width w) {
  return std::string(w.saturating ? "sat" : "wrap") + std::to_string(w.bits);
}

Delta counter_delta(Reading prev, Reading cur, Width w) {
  Delta d;
  if (!prev.present || !cur.present) return d;  // kMissing, 0
  const uint64_t max = width_max(w);
  if (cur.value >= prev.value) {
    d.value = cur.value - prev.value;
    d.kind = w.saturating && cur.value >= max ? DeltaKind::kSaturated : DeltaKind::kNormal;
    return d;
  }
  const uint64_t drop = prev.value - cur.value;
  const uint64_t half = w.bits >= 64 ? (1ULL << 63) : (1ULL << (w.bits - 1));
  if (!w.saturating && drop > half && prev.value <= max) {
    // Wrapped: prev -> max -> 0 -> cur. Unsigned arithmetic modulo 2^bits.
    d.value = (cur.value - prev.value) & max;
    d.kind = DeltaKind::kWrapped;
    return d;
  }
  d.value = cur.value;
  d.kind = DeltaKind::kReset;
  return d;
}

void settle_resets(Delta* d, const Reading* cur, size_t n) {
  bool reset = false;
  for (size_t i = 0; i < n; ++i) reset |= d[i].kind == DeltaKind::kReset;
  if (!reset) return;
  for (size_t i = 0; i < n; ++i)
    if (d[i].kind == DeltaKind::kWrapped) d[i] = Delta{cur[i].value, DeltaKind::kReset};
}

Reading parse_reading(const std::string& text) {
  Reading r;
  std::string t = trim(text);
  if (t.empty() || t.size() > 20) return r;
  uint64_t v = 0;
  for (char ch : t) {
    if (!std::isdigit(static_cast<unsigned char>(ch))) return r;
    const uint64_t digit = static_cast<uint64_t>(ch - '0');
    if (v > (~0ULL - digit) / 10) return r;  // overflow
    v = v * 10 + digit;
  }
  r.present = true;
  r.value = v;
  return r;
}

SysfsRail::SysfsRail(const std::string& root, const RailSpec& spec) : spec_(spec) {
  const Width sat4{4, true}, sat8{8, true}, sat16{16, true}, wrap32{32, false}, wrap64{64, false};
  if (spec.kind == RailSpec::Kind::kIb) {
    dir_ = root + "/class/infiniband/" + spec.device + "/ports/" + std::to_string(spec.port);
    add("hw_counters/local_ack_timeout_err", kRetrans, wrap32);
    add("hw_counters/packet_seq_err", kRetrans, wrap32);
    add("hw_counters/implied_nak_seq_err", kRetrans, wrap32);
    add("hw_counters/out_of_sequence", kRetrans, wrap32);
    add("counters/port_xmit_packets", kTxPackets, wrap64);
    add("counters/port_rcv_packets", kRxPackets, wrap64);
    add("counters/port_xmit_data", kTxBytes, wrap64, 4);
    add("counters/port_rcv_data", kRxBytes, wrap64, 4);
    add("counters/symbol_error", kSymbolErr, sat16);
    add("counters/port_rcv_errors", kRcvErr, sat16);
    add("counters/link_error_recovery", kLinkRecovery, sat8);
    add("counters/link_downed", kLinkDowned, sat8);
    add("counters/local_link_integrity_errors", kIntegrity, sat4);
    add("counters/excessive_buffer_overrun_errors", kBufOverrun, sat4);
    add("hw_counters/out_of_buffer", kBufOverrun, wrap32);
    // A RoCE port (link_layer "Ethernet") has no physical-layer counter of its own that means
    // anything: its netdev has them (the netdev of GID 0, the default GID of every RoCE port;
    // Linux drivers/infiniband/core/sysfs.c, gid_attrs/ndevs). Its CRC errors and FEC
    // statistics are read there.
    std::string text;
    if (read_small(dir_ + "/link_layer", &text) && trim(text) == "Ethernet" &&
        read_small(dir_ + "/gid_attrs/ndevs/0", &text)) {
      const std::string ndev = trim(text);
      if (!valid_ifname(ndev)) {
        setup_note_ = dir_ +
                      "/gid_attrs/ndevs/0 names no valid interface; the RoCE port's "
                      "rx_crc_errors and FEC statistics are not read";
      } else {
        fec_ifname_ = ndev;
        add_at(root + "/class/net/" + ndev + "/statistics/rx_crc_errors", kCrcErr, wrap64);
      }
    }
  } else {
    // Linux exposes these as unsigned long (64-bit here); they wrap.
    dir_ = root + "/class/net/" + spec.device;
    add("statistics/tx_packets", kTxPackets, wrap64);
    add("statistics/rx_packets", kRxPackets, wrap64);
    add("statistics/tx_bytes", kTxBytes, wrap64);
    add("statistics/rx_bytes", kRxBytes, wrap64);
    add("statistics/rx_crc_errors", kCrcErr, wrap64);
    add("statistics/rx_errors", kRcvErr, wrap64);
    add("carrier_changes", kLinkRecovery, wrap64);
    add("carrier_down_count", kLinkDowned, wrap64);
    add("statistics/rx_over_errors", kBufOverrun, wrap64);
    add("statistics/rx_fifo_errors", kBufOverrun, wrap64);
    add("statistics/rx_missed_errors", kBufOverrun, wrap64);
    add("statistics/tx_dropped", kBufOverrun, wrap64);
    // FEC from the kernel, except for a loopback interface (type 772, ARPHRD_LOOPBACK in
    // <linux/if_arp.h>), which has none: nothing is asked for it at all.
    std::string type;
    const bool loopback = read_small(dir_ + "/type", &type) && trim(type) == "772";
    if (valid_ifname(spec.device) && !loopback) fec_ifname_ = spec.device;
  }
}

void SysfsRail::add(const char* rel, int counter, Width w, uint64_t scale) {
  add_at(dir_ + "/" + rel, counter, w, scale);
}

void SysfsRail::add_at(const std::string& path, int counter, Width w, uint64_t scale) {
  File f;
  f.path = path;
  f.counter = counter;
  f.width = w;
  f.scale = scale;
  files_.push_back(std::move(f));
}

bool SysfsRail::read(double now_s, const ExtraCounters& extra, Step* out,
                     std::vector<std::string>* notes) {
  Step s;
  s.missing = (1u << kNumCounters) - 1;
  uint32_t saturated = 0, counting = 0;
  present_ = 0;
  std::string text;
  std::vector<Reading> curs(files_.size());
  std::vector<Delta> deltas(files_.size());
  for (size_t i = 0; i < files_.size(); ++i) {
    File& f = files_[i];
    Reading& cur = curs[i];
    cur = read_small(f.path, &text) ? parse_reading(text) : Reading{};
    if (cur.present) ++present_;
    if (!cur.present && f.was_present && notes)
      notes->push_back(f.path + ": no longer readable as a number; counted as 0");
    f.was_present = cur.present;
    deltas[i] = counter_delta(f.prev, cur, f.width);
  }
  settle_resets(deltas.data(), curs.data(), files_.size());
  for (size_t i = 0; i < files_.size(); ++i) {
    File& f = files_[i];
    const std::string& path = f.path;
    const Reading& cur = curs[i];
    const Delta& d = deltas[i];
    if (d.kind == DeltaKind::kSaturated) {
      if (!f.warned_saturated && notes)
        notes->push_back(path + ": saturated at " + std::to_string(cur.value) +
                         "; its increments are lost until it is reset (perfquery -R)");
      f.warned_saturated = true;
    } else if (d.kind == DeltaKind::kReset) {
      f.warned_saturated = false;
      if (notes)
        notes->push_back(path + ": went from " + std::to_string(f.prev.value) + " to " +
                         std::to_string(cur.value) + " (counter reset)");
    }
    if (d.kind == DeltaKind::kSaturated) {
      saturated |= 1u << f.counter;  // this file counts nothing more
    } else if (d.kind != DeltaKind::kMissing) {
      s.d[f.counter] += static_cast<double>(d.value) * static_cast<double>(f.scale);
      s.missing &= ~(1u << f.counter);
      counting |= 1u << f.counter;
      if (d.kind == DeltaKind::kReset) s.reset |= 1u << f.counter;
    }
    f.prev = cur;
  }
  if (!setup_note_.empty() && notes) notes->push_back(setup_note_);
  setup_note_.clear();
  read_fec(now_s, &s, &counting, notes);
  // A counter all of whose readable files are saturated counts nothing more: unknown. One with
  // a file still counting (IB buf_overrun: the 4-bit excessive_buffer_overrun_errors and the
  // 32-bit out_of_buffer) is what that file counts.
  s.missing |= saturated & ~counting;
  if (extra.present) {
    const Width wrap64{64, false};
    const Reading r{true, extra.retrans}, g{true, extra.segs_out};
    const Delta dr = counter_delta(extra_prev_[0], r, wrap64);
    const Delta dg = counter_delta(extra_prev_[1], g, wrap64);
    if (dr.kind != DeltaKind::kMissing) {
      s.d[kRetrans] += static_cast<double>(dr.value);
      s.missing &= ~(1u << kRetrans);
      if (dr.kind == DeltaKind::kReset) s.reset |= 1u << kRetrans;
    }
    // TCP rails: the retransmit ratio is over the plugin's own segments when it has them.
    if (dg.kind != DeltaKind::kMissing && dg.value > 0) {
      s.d[kTxPackets] = static_cast<double>(dg.value);
      s.missing &= ~(1u << kTxPackets);
    }
    extra_prev_[0] = r;
    extra_prev_[1] = g;
  }
  // Link state and speed.
  if (spec_.kind == RailSpec::Kind::kIb) {
    // "4: ACTIVE" (and "5: ACTIVE_DEFER") is up; "1: DOWN", "2: INIT", "3: ARMED" are not.
    // Missing or unrecognised text: unknown, taken as up (a dead link shows in the transport).
    if (read_small(dir_ + "/state", &text) && text.find("ACTIVE") == std::string::npos)
      s.link_up = text.find("DOWN") == std::string::npos &&
                  text.find("INIT") == std::string::npos && text.find("ARMED") == std::string::npos;
    if (read_small(dir_ + "/rate", &text)) {
      // "400 Gb/sec (4X NDR)"
      char* end = nullptr;
      const double gbps = std::strtod(text.c_str(), &end);
      if (end != text.c_str() && gbps > 0 && gbps < 1e6) s.speed_mbps = gbps * 1000;
    }
  } else {
    s.link_up = read_small(dir_ + "/operstate", &text) ? trim(text) != "down" : true;
    if (read_small(dir_ + "/speed", &text)) {
      const Reading sp = parse_reading(text);  // "-1" (unknown) is not a reading
      if (sp.present && sp.value > 0 && sp.value < 100000000) s.speed_mbps = sp.value;
    }
  }
  const double prev = prev_s_;
  prev_s_ = now_s;
  s.dt_s = prev < 0 ? 0 : now_s - prev;
  *out = s;  // the priming read too: link state and speed, no deltas
  return prev >= 0;
}

void SysfsRail::read_fec(double now_s, Step* s, uint32_t* counting,
                         std::vector<std::string>* notes) {
  if (!fec_ || fec_ifname_.empty() || fec_off_) return;
  FecReading r;
  std::string why;
  const int rc = fec_->read(fec_ifname_, &r, &why);
  auto note_once = [&](int key, const std::string& text) {
    for (int k : fec_noted_)
      if (k == key) return;
    fec_noted_.push_back(key);
    if (notes) notes->push_back(fec_ifname_ + ": " + text);
  };
  const char* const kStay = "; fec_corr_blocks, fec_uncorr_blocks and fec_corr_bits stay missing";
  if (rc == EAGAIN) return;  // not answered yet (AsyncFecSource): missing now, next sample
  if (rc != 0) {
    // A failure: the next reading starts afresh (no delta across it).
    for (Reading& p : fec_prev_) p = Reading{};
    if (rc == ETIMEDOUT) {
      note_once(rc, "FEC statistics late (" + why + "); missing until the kernel answers");
      return;
    }
    // A driver without FEC statistics, a kernel that does not know the request, or no libnl
    // will not change: stop asking. Other failures are asked again; each kind noted once.
    fec_off_ = rc == EOPNOTSUPP || rc == EINVAL || rc == ENOENT;
    note_once(rc, "FEC statistics unavailable (" + why + ")" + kStay +
                      (fec_off_ ? "" : " while it lasts"));
    return;
  }
  const Reading cur[3] = {r.corrected_blocks, r.uncorrectable_blocks, r.corrected_bits};
  if (!cur[0].present && !cur[1].present && !cur[2].present) {
    // Answered, with no statistic in it: FEC off, or a driver that reports none. Three in a
    // row and it is not asked again.
    if (++fec_empty_ >= 3) {
      fec_off_ = true;
      note_once(0, std::string("the driver reports no FEC statistics (FEC off?)") + kStay);
    }
  } else {
    fec_empty_ = 0;
  }
  // Readings taken at known times (the kernel's, through AsyncFecSource) need not be one step
  // apart: a late one spans more. The delta is then the rate between the two readings times
  // this step's length, so that each step's count is over that step.
  double scale = 1.0;
  const double step_s = prev_s_ < 0 ? 0 : now_s - prev_s_;
  if (r.t_s > 0 && fec_prev_t_ > 0 && r.t_s > fec_prev_t_ && step_s > 0)
    scale = step_s / (r.t_s - fec_prev_t_);
  fec_prev_t_ = r.t_s;
  const int ids[3] = {kFecCorrBlocks, kFecUncorrBlocks, kFecCorrBits};
  const Width wrap64{64, false};
  for (int i = 0; i < 3; ++i) {
    if (cur[i].present) ++present_;
    const Delta d = counter_delta(fec_prev_[i], cur[i], wrap64);
    if (d.kind == DeltaKind::kReset && notes)
      notes->push_back(fec_ifname_ + ": FEC " + counter_name(ids[i]) + " went from " +
                       std::to_string(fec_prev_[i].value) + " to " + std::to_string(cur[i].value) +
                       " (counter reset)");
    if (d.kind != DeltaKind::kMissing) {
      s->d[ids[i]] += static_cast<double>(d.value) * scale;
      s->missing &= ~(1u << ids[i]);
      *counting |= 1u << ids[i];
      if (d.kind == DeltaKind::kReset) s->reset |= 1u << ids[i];
    }
    fec_prev_[i] = cur[i];
  }
}

std::vector<RailSpec> discover_rails(const std::string& root) {
  std::vector<RailSpec> out;
  auto list = [](const std::string& dir) {
    std::vector<std::string> names;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (dirent* e = ::readdir(d))
        if (e->d_name[0] != '.') names.push_back(e->d_name);
      ::closedir(d);
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  for (const auto& dev : list(root + "/class/infiniband")) {
    for (const auto& port : list(root + "/class/infiniband/" + dev + "/ports")) {
      const Reading p = parse_reading(port);
      if (!p.present || p.value > 255) continue;
      RailSpec r;
      r.kind = RailSpec::Kind::kIb;
      r.device = dev;
      r.port = static_cast<int>(p.value);
      r.name = dev + ":" + port;
      out.push_back(r);
    }
  }
  for (const auto& ifn : list(root + "/class/net")) {
    if (ifn == "lo") continue;
    if (DIR* d = ::opendir((root + "/class/net/" + ifn + "/statistics").c_str())) {
      ::closedir(d);
      RailSpec r;
      r.kind = RailSpec::Kind::kEth;
      r.device = ifn;
      r.name = ifn;
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace r2ccl::predict
