// Heartbeats of the snapshot daemons (issue 15) on their own thread and their own socket: UDP
// datagrams on the node's peer port number, so they never queue behind bulk shard frames on the
// TCP connections, and nothing the event loop does (stores, serving, checksums) delays them.
// Each period every peer gets one datagram; an accrual detector (accrual.h) per peer turns
// silence into suspicion, which the daemon publishes through etcd (control_plane.h) as a
// trigger for the coordinator, never as an eviction by itself.
//
// Datagram (little-endian, 120 bytes): magic "R2HB", version 1, node id, incarnation, usable
// GB/s, the sender's send time and an echo of the receiver's last heartbeat (send time and how
// long it was held) so the receiver measures the round trip on its own clock, and the job
// token (compared in constant time). A datagram of another size, magic, version or token, or
// from an id not in the peer list, is dropped and counted (logged once per address).
//
// Thread-safety: start/stop from the owning thread; snapshot(), set_*() from any thread.
// The callbacks run on the heartbeat thread (post them to your loop).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/snapshot/accrual.h"
#include "r2ccl/snapshot/membership.h"

namespace r2ccl::snap {

constexpr uint32_t kHeartbeatMagic = 0x42483252;  // "R2HB" little-endian
constexpr uint16_t kHeartbeatVersion = 1;

struct HeartbeatDatagram {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved;
  uint32_t node_id;
  float usable_gbps;     // 0 = unknown
  uint64_t incarnation;  // the sender's registration (control_plane.h)
  int64_t sent_us;       // the sender's CLOCK_MONOTONIC at sending
  int64_t echo_us;       // sent_us of the receiver's latest heartbeat the sender got; 0: none
  int64_t echo_held_us;  // how long the sender held that echo
  uint32_t token_len;
  uint8_t token[64];
  uint32_t pad;
};
static_assert(sizeof(HeartbeatDatagram) == 120, "heartbeat datagram layout");

class HeartbeatService {
 public:
  struct Config {
    uint32_t self = 0;
    std::vector<PeerSpec> peers;  // the peer list (UDP on the same port numbers)
    std::string token;
    TimeUs period = 500 * kUsPerMs;
    double phi_threshold = 8.0;
    // Test hook (R2CCL_SNAPD_TEST_BLOCK_FILE): node ids, one per line, whose heartbeats are
    // neither sent to nor accepted from; "in:ID" drops only what comes from ID.
    std::string block_file;
  };
  struct Peer {
    bool ever_heard = false;
    bool suspected = false;
    TimeUs last_heard = 0;
    int64_t rtt_us = -1;  // smoothed round trip, -1 until measured
    float usable_gbps = 0;
    uint64_t incarnation = 0;
    double phi = 0;
  };
  // on_suspect(id, suspected): a change of this node's suspicion of a peer.
  HeartbeatService(Config c, std::function<void(uint32_t, bool)> on_suspect);
  ~HeartbeatService();
  // Binds the UDP socket on this node's own address (peer list) and starts the thread.
  // Returns false with *err naming the address and the reason.
  bool start(std::string* err);
  void stop();
  void set_incarnation(uint64_t v) { incarnation_ = v; }
  void set_gbps(float g) { gbps_ = g; }
  std::map<uint32_t, Peer> snapshot() const;
  uint64_t received() const { return received_.load(); }
  uint64_t sent() const { return sent_.load(); }
  uint64_t dropped() const { return dropped_.load(); }

 private:
  void run();
  void send_all(TimeUs now);
  void receive(TimeUs now);
  void read_block_file();
  Config c_;
  std::function<void(uint32_t, bool)> on_suspect_;
  int fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> incarnation_{0};
  std::atomic<float> gbps_{0};
  std::atomic<uint64_t> received_{0}, sent_{0}, dropped_{0};
  mutable std::mutex mu_;
  std::map<uint32_t, Peer> peers_;
  std::map<uint32_t, AccrualDetector> det_;
  std::map<uint32_t, std::pair<int64_t, TimeUs>> last_;  // peer -> (its sent_us, received at)
  std::set<uint32_t> blocked_out_, blocked_in_;
  std::set<std::string> logged_;
};

}  // namespace r2ccl::snap
