// Forward error correction (FEC) statistics of an Ethernet interface, for the failure predictor's
// RoCE and Ethernet rails (a RoCE port has no InfiniBand symbol counter; its physical-layer
// health is in its netdev's FEC and CRC counters, docs/PREDICTOR.md).
//
// Source of the protocol facts: Linux Documentation/networking/ethtool-netlink.rst and the UAPI
// header <linux/ethtool_netlink.h> (Linux 5.13 and later): generic netlink family "ethtool",
// request ETHTOOL_MSG_FEC_GET with the request header's ETHTOOL_FLAG_STATS set; the reply's
// ETHTOOL_A_FEC_STATS nest holds ETHTOOL_A_FEC_STAT_CORRECTED (IEEE 802.3 30.5.1.1.17
// aFECCorrectedBlocks), ETHTOOL_A_FEC_STAT_UNCORR (30.5.1.1.18 aFECUncorrectableBlocks) and
// ETHTOOL_A_FEC_STAT_CORR_BITS (corrected bits, non-standard; mlx5 reports it), each an array of
// u64: the port's total, then one value per lane. An attribute of length 0 means the driver does
// not report that statistic. A driver without FEC (veth, lo) answers EOPNOTSUPP.
//
// libnl is NOT linked: libnl-3.so.200 and libnl-genl-3.so.200 (Debian libnl-genl-3-200) are
// dlopen'ed the first time an EthtoolFec is opened. Without them the reader is unavailable and
// the fec_* counters stay missing, as on a driver without FEC.
//
// The kernel handles an ethtool netlink GET in the requesting thread, under rtnl_lock, with the
// driver's firmware query inside (mlx5: the PPCNT register). So the plugin never asks from its
// background thread, which also runs failover: AsyncFecSource runs an EthtoolFec on a thread of
// its own and hands back each reading at the next sample.
//
// Thread-safety: an EthtoolFec or an AsyncFecSource belongs to one calling thread (the plugin's
// background thread, a tool's main thread); AsyncFecSource's worker is its own business.
// parse_fec_reply() may be called from any thread once libnl is loaded.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "r2ccl/predict/counters.h"

struct nlmsghdr;

namespace r2ccl::predict {

// One FEC reading: each total is absent when the driver does not report it.
struct FecReading {
  Reading corrected_blocks;      // codewords corrected (cumulative, 64-bit, wraps)
  Reading uncorrectable_blocks;  // codewords FEC could not correct (cumulative)
  Reading corrected_bits;        // bits corrected (cumulative)
  double t_s = 0;                // CLOCK_MONOTONIC seconds when it was read; 0: unknown
};

// Where a rail's FEC readings come from: the kernel (EthtoolFec) or a test double.
class FecSource {
 public:
  virtual ~FecSource() = default;
  // Reads interface `ifname`'s FEC totals into *out. Returns 0, or a positive errno with *why
  // saying what failed: EOPNOTSUPP (the driver has no FEC statistics), ENODEV (no such
  // interface), ENOENT (libnl or the ethtool netlink family unavailable), EAGAIN (no reading
  // yet, ask again next sample), ETIMEDOUT (an earlier request is overdue), others from the
  // kernel or the socket.
  virtual int read(const std::string& ifname, FecReading* out, std::string* why) = 0;
};

// The kernel's FEC statistics over ethtool netlink, in the calling thread's network namespace.
// One netlink round trip per read(), in the calling thread: the kernel does the work inside the
// send (under rtnl_lock), so a read blocks as long as rtnl_lock is held elsewhere; a 1 s receive
// timeout bounds only the wait after it. Only the reply to this request is taken (sequence
// number, family, command, device name). No privilege is needed (a GET request).
class EthtoolFec : public FecSource {
 public:
  EthtoolFec();
  ~EthtoolFec() override;
  EthtoolFec(const EthtoolFec&) = delete;
  EthtoolFec& operator=(const EthtoolFec&) = delete;

  // Loads libnl (once per process), connects a generic netlink socket and resolves the "ethtool"
  // family. Returns 0 (also when already open) or ENOENT with *why naming the library or
  // family that is missing, or another errno from the socket.
  int open(std::string* why);
  // Opens on first use. See FecSource::read.
  int read(const std::string& ifname, FecReading* out, std::string* why) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs another FecSource's reads on a worker thread of its own (started at the first read), so
// neither read() nor the destructor ever waits for the kernel. One worker serves every
// interface in turn. Each read() returns the answer to the request made at the previous read()
// of that interface (readings lag one sample; FecReading::t_s says when each was taken) and, if
// it was a reading, asks for the next one: EAGAIN for the first read of a name, after a failure
// (asked again now), and while the request is pending; ETIMEDOUT once it is older than
// `overdue_ms`; ENOMEM if the thread cannot start. The destructor leaves a worker that is inside
// a read to finish on its own, with the state it owns; an idle one is joined.
class AsyncFecSource : public FecSource {
 public:
  explicit AsyncFecSource(std::unique_ptr<FecSource> inner, int overdue_ms = 5000);
  ~AsyncFecSource() override;
  AsyncFecSource(const AsyncFecSource&) = delete;
  AsyncFecSource& operator=(const AsyncFecSource&) = delete;
  int read(const std::string& ifname, FecReading* out, std::string* why) override;

 private:
  struct State;
  std::shared_ptr<State> state_;
  std::thread worker_;
};

// Parses an ETHTOOL_MSG_FEC_GET reply (a whole netlink message: nlmsghdr, genlmsghdr,
// attributes) into *out. Returns false with *why when the message is malformed or has no
// ETHTOOL_A_FEC_STATS nest (the kernel sends one whenever ETHTOOL_FLAG_STATS was asked, empty
// of readable totals when the driver reports none). Needs libnl loaded: false with *why if it
// cannot be. `len` is the number of readable bytes at `msg` (at least msg->nlmsg_len). With
// `ifname`, a reply whose header names another device is refused too.
bool parse_fec_reply(const nlmsghdr* msg, size_t len, FecReading* out, std::string* why,
                     const std::string& ifname = "");

}  // namespace r2ccl::predict
