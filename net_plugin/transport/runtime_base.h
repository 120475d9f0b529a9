// RuntimeBase: the per-process part every transport shares, written once. A transport's
// runtime (transport/tcp/runtime.h, transport/ib/runtime.h) derives from it and adds only
// what is its own (TCP: listeners and hello checks; verbs: the verbs table, HCAs, async
// events, MR caches).
//
// It owns: the configuration and the connections' environment (health parameters, test
// hooks), the rails' names, speeds and live state (RailTable), the registry of
// connections, the ONE background thread (the transport's own file descriptors, netlink
// link events, progress of connections the proxy thread left idle, the failure predictor's
// agent, health-board publishing), statistics, and the generic connect/accept/close.
//
// Thread ownership:
//  - Rail live state and statistics: atomics, written by any thread.
//  - The registry: registry_mu_, taken by the service thread (register/unregister in
//    connect/accept/close) and the background thread; never by isend/irecv/test.
//  - A connection and its transport: whoever holds its progress token (Connection::
//    try_enter). The proxy thread takes it inside isend/irecv/test; the background thread
//    only for connections idle for kIdleProgressAfter. No two threads ever drive one
//    connection, and test() never waits on a lock.
#pragma once

#include <poll.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/connection.h"
#include "engine/rail_env.h"
#include "predict/predict_agent.h"
#include "r2ccl/connect_state.h"
#include "r2ccl/health_board.h"
#include "r2ccl/params.h"
#include "r2ccl/random.h"
#include "transport/transport.h"

namespace r2ccl::net {

class RuntimeBase : public Transport, public RailTable {
 public:
  ~RuntimeBase() override = default;

  // --- RailTable ---
  int rail_count() const override { return static_cast<int>(rails_.size()); }
  RailLive& live(int rail) override { return live_[rail]; }
  const std::string& rail_name(int rail) const override { return rails_[rail].name; }
  int rail_speed_mbps(int rail) const override { return rails_[rail].speed_mbps; }

  const Config& cfg() const { return *cfg_; }
  const ConnEnv& env() const { return env_; }
  uint64_t random_u64() { return rng_.next(); }
  void random_bytes(void* out, size_t n) { rng_.bytes(out, n); }

  // --- Transport: the generic parts ---
  Status connect(int dev, int traffic_class, void* handle, Connection** out) final;
  Status accept(Listener* l, Connection** out) final;
  void close(Connection* c) final;
  void close_listen(Listener* l) override { delete l; }
  std::string stats_json() override;

  // Runs fn(conn) for every registered connection, under the registry lock (a connection
  // cannot be closed meanwhile); stops at the first fn returning true. Background thread.
  template <typename F>
  bool find_conn(F&& fn) {
    std::lock_guard<std::mutex> lk(registry_mu_);
    for (Connection* c : conns_)
      if (fn(c)) return true;
    return false;
  }

 protected:
  struct RailInfo {
    std::string name;    // display name (logs, board, stats)
    int speed_mbps = 0;
    std::string ifname;  // netlink interface of the rail, "" when none is known
    bool link_up = true;
    predict::RailSpec predict;
  };

  // Configuration, rails, test hooks, the event sink, the health board and the predictor.
  // Errors: kInvalidUsage with *err naming the variable.
  Status init_base(const Config* cfg, std::vector<RailInfo> rails, board::Transport kind,
                   std::string* err);
  // Starts the background thread (once, at the end of the transport's init).
  void start_background();

  // A connector for NCCL's handle, or nullptr with *st set (a foreign handle: kInternal,
  // with a WARN naming what is wrong). Service thread.
  virtual std::unique_ptr<ConnIo> new_connector(int dev, int traffic_class, const void* handle,
                                                Status* st) = 0;
  virtual std::unique_ptr<ConnIo> new_acceptor(Listener* l) = 0;
  // Tells an in-progress connect in NCCL's handle from a fresh one (connect_state.h).
  virtual uint64_t connect_magic() const = 0;
  // The transport's own descriptors for the background thread's poll, and their events.
  virtual void bg_add_fds(std::vector<pollfd>* fds) { (void)fds; }
  virtual void bg_on_fds(const pollfd* fds, size_t n, TimeUs now) {
    (void)fds;
    (void)n;
    (void)now;
  }
  // The board's cause text for a rail that is down ("link down", "port error").
  virtual const char* down_cause() const = 0;

  void register_conn(Connection* c);
  void unregister_conn(Connection* c);

 private:
  void bg_loop();
  void progress_idle_conns();
  void publish_board(TimeUs now);

  const Config* cfg_ = nullptr;
  ConnEnv env_;
  std::vector<RailInfo> rails_;
  std::unique_ptr<RailLive[]> live_;
  board::Transport board_kind_ = board::Transport::kUnknown;

  std::mutex registry_mu_;
  std::vector<Connection*> conns_;  // guarded by registry_mu_

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
