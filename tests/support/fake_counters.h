// A fake Ethernet NIC counter tree for the failure predictor's tests: the files the predictor
// reads under R2CCL_SYSFS_ROOT (class/net/IF/statistics/..., carrier_changes, operstate, speed),
// advanced step by step with chosen per-second rates. Each file is replaced atomically
// (written to a temporary name, then renamed), so a reader never sees a half-written number.
// Header-only. Thread-safety: one writer thread per object.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <string>

namespace r2ccl::test {

struct NicRates {          // per second
  double utilisation = 0.5;  // of the link speed, both directions
  double crc = 0;            // rx CRC errors
  double rx_err = 0;         // rx errors
  double carrier = 0;        // carrier changes
  double overrun = 0;        // rx over/fifo/missed + tx drops
};

class FakeNic {
 public:
  FakeNic(const std::string& root, const std::string& ifname, double speed_mbps)
      : dir_(root + "/class/net/" + ifname), speed_(speed_mbps) {
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
  static void mkdir_p(const std::string& path) {
    for (size_t p = 1; (p = path.find('/', p)) != std::string::npos; ++p)
      ::mkdir(path.substr(0, p).c_str(), 0755);
    ::mkdir(path.c_str(), 0755);
  }
  void put(const std::string& rel, double v) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%.0f\n", v);
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
  double speed_;
  Acc bytes_tx_, bytes_rx_, pk_tx_, pk_rx_, crc_, rx_err_, carrier_, overrun_;
};

}  // namespace r2ccl::test
