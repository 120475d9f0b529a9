// Fake NIC counter trees for the failure predictor's tests: the files the predictor
// reads under R2CCL_SYSFS_ROOT (class/net/IF/statistics/..., carrier_changes, operstate, speed),
// advanced step by step with chosen per-second rates. Each file is replaced atomically
// (written to a temporary name, then renamed), so a reader never sees a half-written number.
// Header-only. Thread-safety: one writer thread per object.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace r2ccl::test {

struct NicRates {            // per second
  double utilisation = 0.5;  // of the link speed, both directions
  double crc = 0;            // rx CRC errors
  double rx_err = 0;         // rx errors
  double carrier = 0;        // carrier changes
  double overrun = 0;        // rx over/fifo/missed + tx drops
};

// A directory of counter files, each replaced atomically.
class FakeCounterDir {
 protected:
  explicit FakeCounterDir(std::string dir) : dir_(std::move(dir)) { mkdir_p(dir_); }
  static void mkdir_p(const std::string& path) {
    for (size_t p = 1; (p = path.find('/', p)) != std::string::npos; ++p)
      ::mkdir(path.substr(0, p).c_str(), 0755);
    ::mkdir(path.c_str(), 0755);
  }
  void put(const std::string& rel, double v) {  // the whole part of v, as the kernel prints
    char buf[32];
    snprintf(buf, sizeof(buf), "%.0f\n", std::floor(v));
    put_text(rel, buf);
  }
  void put_text(const std::string& rel, const std::string& text) {
    const std::string path = dir_ + "/" + rel, tmp = path + ".tmp";
    if (FILE* f = fopen(tmp.c_str(), "w")) {
      fputs(text.c_str(), f);
      fclose(f);
      ::rename(tmp.c_str(), path.c_str());
    }
  }
  std::string dir_;
};

class FakeNic : public FakeCounterDir {
 public:
  FakeNic(const std::string& root, const std::string& ifname, double speed_mbps)
      : FakeCounterDir(root + "/class/net/" + ifname), speed_(speed_mbps) {
    mkdir_p(dir_ + "/statistics");
    put("speed", static_cast<double>(static_cast<long long>(speed_mbps)));
    set_link(true);
    advance(0, NicRates{});
  }
  // Advances every counter by rate x dt_s (fractions carried to the next step).
  void advance(double dt_s, const NicRates& r) {
    const double bytes = r.utilisation * speed_ * 1e6 / 8 * dt_s;
    add(bytes_tx_, bytes);
    add(bytes_rx_, bytes);
    add(pk_tx_, bytes / 4096);
    add(pk_rx_, bytes / 4096);
    add(crc_, r.crc * dt_s);
    add(rx_err_, r.rx_err * dt_s + r.crc * dt_s);  // rx_errors includes CRC errors
    add(carrier_, r.carrier * dt_s);
    add(overrun_, r.overrun * dt_s);
    put("statistics/tx_bytes", bytes_tx_.whole);
    put("statistics/rx_bytes", bytes_rx_.whole);
    put("statistics/tx_packets", pk_tx_.whole);
    put("statistics/rx_packets", pk_rx_.whole);
    put("statistics/rx_crc_errors", crc_.whole);
    put("statistics/rx_errors", rx_err_.whole);
    put("statistics/rx_missed_errors", overrun_.whole);
    put("carrier_changes", carrier_.whole);
  }
  void set_link(bool up) { put_text("operstate", up ? "up" : "down"); }
  const std::string& dir() const { return dir_; }

 private:
  struct Acc {
    double whole = 0, frac = 0;
  };
  static void add(Acc& a, double v) {
    a.frac += v;
    const double w = std::floor(a.frac);
    a.whole += w;
    a.frac -= w;
  }
  double speed_;
  Acc bytes_tx_, bytes_rx_, pk_tx_, pk_rx_, crc_, rx_err_, carrier_, overrun_;
};

// The same for one InfiniBand/RoCE HCA port (class/infiniband/DEV/ports/P/: counters/,
// hw_counters/, state, rate). NicRates::crc drives symbol_error, rx_err port_rcv_errors,
// carrier link_error_recovery. Real widths (symbol_error saturates at 65535).
class FakeHcaPort : public FakeCounterDir {
 public:
  FakeHcaPort(const std::string& root, const std::string& dev, int port, double gbps)
      : FakeCounterDir(root + "/class/infiniband/" + dev + "/ports/" + std::to_string(port)) {
    for (const char* sub : {"/counters", "/hw_counters"}) mkdir_p(dir_ + sub);
    put_text("rate", std::to_string(static_cast<int>(gbps)) + " Gb/sec (4X)\n");
    gbps_ = gbps;
    set_active(true);
    advance(0, NicRates{});
  }
  void advance(double dt_s, const NicRates& r) {
    const double words = r.utilisation * gbps_ * 1e9 / 8 / 4 * dt_s;
    sym_ = std::min(65535.0, sym_ + r.crc * dt_s);
    rcv_ = std::min(65535.0, rcv_ + r.rx_err * dt_s);
    rec_ = std::min(255.0, rec_ + r.carrier * dt_s);
    data_ += words;
    put("counters/port_xmit_data", data_);
    put("counters/port_rcv_data", data_);
    put("counters/port_xmit_packets", data_ / 1024);
    put("counters/port_rcv_packets", data_ / 1024);
    put("counters/symbol_error", std::floor(sym_));
    put("counters/port_rcv_errors", std::floor(rcv_));
    put("counters/link_error_recovery", std::floor(rec_));
    put("hw_counters/local_ack_timeout_err", 0);
  }
  void set_active(bool up) { put_text("state", up ? "4: ACTIVE\n" : "1: DOWN\n"); }

 private:
  double gbps_ = 0, sym_ = 0, rcv_ = 0, rec_ = 0, data_ = 0;
};

}  // namespace r2ccl::test
