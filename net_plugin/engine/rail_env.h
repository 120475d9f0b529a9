// What a connection needs to know of its process's rails (TCP interfaces, HCA ports): their
// names, speeds and live state. Implemented by the transport runtimes
// (transport/runtime_base.h); tests implement it in memory.
//
// RailLive is written by any thread (atomics): the background thread (link events, the
// failure predictor's drain flag) and the data path (counters).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "r2ccl/rail_stats.h"

namespace r2ccl::net {

struct RailLive : RailCounters {
  std::atomic<bool> link_up{true};       // netlink carrier/admin state, or the HCA port's
  std::atomic<uint32_t> down_events{0};  // link-down (port error) notifications seen
  std::atomic<uint32_t> up_events{0};    // link-up (port active) notifications seen
  // The rail's local address changed (removed, replaced, or one came back; TCP: netlink's
  // address groups, or a reconnect that found another address): the count, and whether the
  // rail has a usable address now (an IPv6 address still in duplicate address detection is
  // not usable). Written by the transport's runtime before it bumps addr_events, so a
  // connection that sees the new count also sees has_addr and the runtime's new address.
  std::atomic<uint32_t> addr_events{0};
  std::atomic<bool> has_addr{true};
  // The scheduler's process-wide view of the rail (engine/goodput.h; written by the data
  // path of every connection, lock-free): the sum of the goodput (kbit/s) this process's
  // busy paths on the rail measure, and the rail's capacity estimate (kbit/s; 0: not yet
  // measured) with the time it was last updated (microseconds, the callers' clock).
  std::atomic<uint64_t> goodput_load_kbps{0};
  std::atomic<uint64_t> goodput_cap_kbps{0};
  std::atomic<int64_t> goodput_cap_at{0};
};

class RailTable {
 public:
  virtual ~RailTable() = default;
  virtual int rail_count() const = 0;
  virtual RailLive& live(int rail) = 0;
  // Display name as in the logs and on the health board: "eth0", "lo@127.0.0.2", "mlx5_0:1".
  virtual const std::string& rail_name(int rail) const = 0;
  virtual int rail_speed_mbps(int rail) const = 0;
  // What a link-down notification on this transport is called in the logs ("netlink",
  // "port error event").
  virtual const char* link_event_source() const = 0;
};

}  // namespace r2ccl::net
