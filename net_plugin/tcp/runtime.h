// The per-process r2ccl TCP runtime: configuration, rails and their live state, the
// per-process listener on every rail (authenticated by each connection's secret; it lets
// failed paths reconnect after NCCL closed its listen comm), the link monitor, the fault
// injector, statistics, and the ONE background thread.
//
// Thread ownership (who may touch what):
//  - Rail state and statistics: atomics, written by any thread.
//  - The registry of listen comms and connections: registry_mu_, taken by the service thread
//    (register/unregister in listen/connect/accept/close) and the background thread; never
//    by isend/irecv/test.
//  - A connection's sockets: owned by whichever thread holds that connection's progress
//    token (Conn::try_enter). The proxy thread takes it inside isend/irecv/test; the
//    background thread takes it only for connections the proxy thread has left alone for a
//    while (heartbeats, failure detection and failback on idle connections). So no two
//    threads ever write one socket, and test() never waits on a lock.
//  - Listener sockets and half-open incoming connections (until the hello is checked): the
//    background thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../engine/path_health.h"
#include "../engine/recv_message.h"
#include "fault_injector.h"
#include "predict/predict_agent.h"
#include "r2ccl/health_board.h"
#include "r2ccl/params.h"
#include "r2ccl/rail_stats.h"
#include "r2ccl/random.h"
#include "r2ccl/status.h"
#include "../sock/rails.h"
#include "wire.h"

namespace r2ccl::net {

class Conn;
class ListenComm;

struct RailLive : RailCounters {
  std::atomic<bool> link_up{true};
  std::atomic<uint32_t> down_events{0};  // link-down notifications seen
  std::atomic<uint32_t> up_events{0};
};

// An authenticated incoming connection, handed from the background thread to its owner.
struct Incoming {
  int fd = -1;
  int local_rail = 0;
  HelloBody hello{};
};

class Runtime {
 public:
  // The process-wide runtime, created at the first call (parses the configuration, finds the
  // rails, opens the listeners, starts the background thread). Every later call returns the
  // same object or the same error. Thread: any (init thread in practice).
  static Status get(Runtime** out, std::string* err);
  // Already created (for getStats and tools), else nullptr.
  static Runtime* peek();

  const Config& cfg() const { return *cfg_; }
  const std::vector<Rail>& rails() const { return rails_; }
  RailLive& live(int rail) { return live_[rail]; }
  const HealthParams& health_params() const { return health_; }
  const GuardOptions& guard() const { return guard_; }
  bool replay_enabled() const { return replay_; }
  bool link_events_active() const { return link_events_active_.load(); }
  int rank() const { return rank_; }

  // Listener endpoint of rail r (port in network order).
  uint16_t listener_port(int r) const { return listen_ports_[r]; }
  void fill_wire_rails(HelloBody* h) const;

  void register_listen(ListenComm* l);
  void unregister_listen(ListenComm* l);
  void register_conn(Conn* c);
  void unregister_conn(Conn* c);

  void random_bytes(void* out, size_t n);
  uint64_t random_u64();

  // JSON statistics for r2cclExt_v1.getStats.
  std::string stats_json();

 private:
  Runtime() = default;
  Status init(std::string* err);
  void bg_loop();
  void accept_new(int rail);
  void service_handshakes();
  void progress_idle_conns();
  void publish_board(TimeUs now);  // background thread, at most every 100 ms

  const Config* cfg_ = nullptr;
  std::vector<Rail> rails_;
  std::unique_ptr<RailLive[]> live_;
  HealthParams health_;
  GuardOptions guard_;
  bool replay_ = true;
  int rank_ = -1;
  std::vector<int> listen_fds_;
  std::vector<uint16_t> listen_ports_;
  std::atomic<bool> link_events_active_{false};

  std::mutex registry_mu_;
  std::vector<ListenComm*> listens_;  // guarded by registry_mu_
  std::vector<Conn*> conns_;          // guarded by registry_mu_

  struct Pending {
    int fd;
    int rail;
    TimeUs deadline;
    size_t got;
    char buf[sizeof(FrameHeader) + sizeof(HelloBody)];
  };
  std::vector<Pending> pending_;  // background thread only
  struct Refusals {
    TimeUs last_warn = 0;
    uint64_t suppressed = 0;
  };
  std::map<std::string, Refusals> refusals_;  // background thread only

  // Health board (docs/HEALTH-BOARD.md): opened at init unless R2CCL_HEALTH_BOARD=none;
  // published by the background thread.
  board::Publisher board_;
  PredictAgent predict_;  // the failure predictor (background thread)
  std::vector<board::RailPublishState> board_rails_;  // background thread only
  TimeUs board_next_ = 0;                             // background thread only

  Rng rng_;
  std::thread bg_;
};

}  // namespace r2ccl::net
