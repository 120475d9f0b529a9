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
//    only for connections idle for Traits::idle_progress_after, when one of their
//    descriptors is ready or a timer is due (idle_pass). No two threads ever drive one
//    connection, and test() never waits on a lock.
#pragma once

#include <poll.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/connection.h"
#include "engine/rail_env.h"
#include "predict/predict_agent.h"
#include "r2ccl/connect_state.h"
#include "r2ccl/health_board.h"
#include "r2ccl/params.h"
#include "r2ccl/random.h"
#include "transport/handshake.h"
#include "transport/transport.h"

namespace r2ccl::net {

class RuntimeBase : public Transport, public RailTable {
 public:
  ~RuntimeBase() override = default;
  // An idle connection whose transport says what it waits for (PathIo::wait_fds) is
  // progressed when that is ready, and otherwise this often: its timers (probes, the
  // watchdog, notices, reconnects) run at most this late while nothing arrives.
  static constexpr TimeUs kIdleTick = 25 * kUsPerMs;
  // The background thread's longest sleep while every connection is watched
  // (Connection::idle_due): the health board's and the predictor's own periods.
  static constexpr TimeUs kIdleWaitMax = 100 * kUsPerMs;

  // --- RailTable ---
  int rail_count() const override { return static_cast<int>(rails_.size()); }
  RailLive& live(int rail) override { return live_[rail]; }
  const std::string& rail_name(int rail) const override { return rails_[rail].name; }
  int rail_speed_mbps(int rail) const override { return rails_[rail].speed_mbps; }

  const Config& cfg() const { return *cfg_; }
  const ConnEnv& env() const { return env_; }
  uint64_t random_u64() { return rng_.next(); }
  // This process's identity on the wire where a transport has no other (verbs setup
  // messages: IbSetupMsg::proc_id): random, drawn at init, never 0. Any thread.
  uint64_t process_id() const { return process_id_; }
  void random_bytes(void* out, size_t n) { rng_.bytes(out, n); }

  // --- RailTable ---
  const char* link_event_source() const final { return traits_.link_event_source; }

  // --- Transport: the generic parts ---
  const char* name() const final { return traits_.name; }
  std::string banner() const final;
  int device_count() const final { return static_cast<int>(devices_.size()); }
  Status properties(int dev, DeviceProps* p) const final;
  int mr_types() const final { return mr_types_; }
  Status connect(int dev, int traffic_class, void* handle, Connection** out) final;
  Status accept(Listener* l, Connection** out) final;
  void close(Connection* c) final;
  void close_listen(Listener* l) override { delete l; }
  std::string stats_json() final;
  // Default: this transport has no in-process fault injector (WARN, -1).
  int arm_faults(const char* spec) override;

  // The rail of NCCL device `dev` (0 <= dev < device_count()).
  int device_rail(int dev) const { return devices_[dev].rail; }
  // A new listen comm's id and secret (random).
  void new_identity(Listener* l);

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
  // What tells the transports apart in the shared code.
  struct Traits {
    const char* name;             // "TCP", "IB" (banner, messages)
    board::Transport board_kind;  // on the health board and in getStats
    uint64_t connect_magic;       // tells an in-progress connect in NCCL's handle (connect_state.h)
    const char* down_cause;       // board text for a rail that is down ("link down")
    const char* link_event_source;  // log text of a link-down notification ("netlink")
    // The background thread's period and how long the proxy thread must have left a
    // connection alone before the background thread progresses it. TCP: 2 ms / 2 ms. Verbs:
    // 5 ms / 10 ms: each pass polls every CQ, and on a 2-core host more frequent passes
    // cost the fake verbs provider 20 % of its throughput (docs/BENCHMARKS.md).
    int bg_poll_ms;
    TimeUs idle_progress_after;
    TransportKind kind;     // in the handle head (transport/handshake.h)
    uint16_t wire_version;  // the transport's wire version, in the handle head
  };
  struct RailInfo {
    std::string name;  // display name (logs, board, stats)
    int speed_mbps = 0;
    std::string ifname;  // netlink interface of the rail, "" when none is known
    bool link_up = true;
    predict::RailSpec predict;
  };
  // One NCCL device: a rail, as NCCL's getProperties reports it.
  struct Device {
    int rail = 0;
    std::string name;      // "eth0", "mlx5_0" (the port in `port`)
    std::string pci_path;  // "" for a virtual NIC
    uint64_t guid = 0;
    int port = 0;             // verbs port number, 0 for TCP
    std::string description;  // its part of the init banner
  };

  // Configuration, rails and devices, test hooks, the event sink, the health board and the
  // predictor. `mr_types`: NCCL_PTR_* bits regMr accepts; `knobs`: the banner's tail.
  // Errors: kInvalidUsage with *err naming the variable.
  Status init_base(const Config* cfg, const Traits& traits, std::vector<RailInfo> rails,
                   std::vector<Device> devices, int mr_types, std::string knobs, std::string* err);
  // Starts the background thread (once, at the end of the transport's init).
  void start_background();

  // The transport's half of connect and accept: a connector for NCCL's `handle` (when
  // `accept` is null), or the acceptor of listen comm `accept`. A foreign handle: nullptr,
  // *st = kInternal, and a WARN naming what is wrong. Service thread. Handles of the other
  // transport or another wire version never get here (connect() refuses them, telling the
  // listener: transport/handshake.h).
  virtual std::unique_ptr<ConnIo> new_conn_io(int dev, int traffic_class, const void* handle,
                                              Listener* accept, Status* st) = 0;
  // The transport's own descriptors for the background thread's poll, and their events.
  virtual void bg_add_fds(std::vector<pollfd>* fds) { (void)fds; }
  virtual void bg_on_fds(const pollfd* fds, size_t n, TimeUs now) {
    (void)fds;
    (void)n;
    (void)now;
  }
  // Netlink: the addresses of interface `ifindex` changed (background thread). The transport
  // re-reads its rails' addresses (TCP); default: nothing (verbs follows GID events).
  virtual void on_address_event(int ifindex, TimeUs now) {
    (void)ifindex;
    (void)now;
  }
  void register_conn(Connection* c);
  void unregister_conn(Connection* c);
  // This process's knobs as the setup exchanges them (transport/handshake.h); the transport
  // fills in what only it knows (verbs: the adaptive-routing mode of a connection).
  WireKnobs own_knobs(int streams) const;

 private:
  // A handle of the other transport or another wire version (HandleHead): a connector that
  // tells the listening process why, then fails; nullptr (st untouched) for this transport's
  // own handles and for what is no r2ccl handle. Old handles without a head fail at once.
  std::unique_ptr<ConnIo> refuse_handle(int dev, const void* handle, Status* st);
  void bg_loop();
  // The connections the background thread looks after (docs/ARCHITECTURE.md, threads). Each
  // registered connection is either *watched* (the proxy thread left it idle and its
  // transport says what it waits for: its descriptors armed one-shot in the thread's epoll set,
  // its next timer, Connection::idle_due, in a heap) or *active* (driven by the proxy thread,
  // new, or unable to say what it waits for, like verbs: looked at on every pass). An event
  // or timer of a watched connection progresses it and watches it again; one found active
  // joins the active list; an active one idle for Traits::idle_progress_after is progressed
  // and watched. So an idle pass costs what is ready, not the number of connections.
  // Background thread, under registry_mu_. Returns the poll timeout to use (ms).
  int idle_pass(TimeUs now);
  // Progresses a watched connection woken by an event, a timer or a process-wide change, or
  // moves it to the active list when the proxy thread has it.
  void wake_conn(uint64_t serial, TimeUs now);
  // Token held: arms the connection's descriptors and its timer. False when its transport
  // cannot say what it waits for.
  bool watch(uint64_t serial, TimeUs now);
  // What every watched connection must look at when it changes: the rails' link and address
  // events, their predicted drains, the links' verdicts, shadow-routing changes and probers.
  uint64_t idle_signature();
  void publish_board(TimeUs now);

  const Config* cfg_ = nullptr;
  Traits traits_{};
  ConnEnv env_;
  std::unique_ptr<LinkTable> links_;  // env_.links: the process's links (engine/link_live.h)
  uint64_t process_id_ = 0;           // process_id(); set by init_base
  std::vector<RailInfo> rails_;
  std::vector<Device> devices_;
  int mr_types_ = NCCL_PTR_HOST;
  std::string knobs_;
  std::unique_ptr<RailLive[]> live_;

  std::mutex registry_mu_;
  std::vector<Connection*> conns_;  // guarded by registry_mu_
  // What the background thread knows of each connection, by serial (guarded by registry_mu_;
  // only the background thread reads the watch state).
  struct BgConn {
    Connection* c = nullptr;
    bool watched = false;  // descriptors armed, timer `due` in timers_
    bool active = false;   // in active_
    TimeUs due = 0;
  };
  std::unordered_map<uint64_t, BgConn> bg_conns_;        // guarded by registry_mu_
  std::unordered_map<Connection*, uint64_t> serial_of_;  // guarded by registry_mu_
  uint64_t next_serial_ = 1;                             // guarded by registry_mu_
  std::vector<uint64_t> new_conns_;                      // guarded by registry_mu_
  // Background thread only.
  int epfd_ = -1;
  std::vector<uint64_t> active_;
  std::priority_queue<std::pair<TimeUs, uint64_t>, std::vector<std::pair<TimeUs, uint64_t>>,
                      std::greater<>>
      timers_;
  std::vector<pollfd> scratch_fds_;
  uint64_t idle_sig_ = 0;  // idle_signature() at the last pass

  // Health board (docs/HEALTH-BOARD.md): opened at init unless R2CCL_HEALTH_BOARD=none;
  // published by the background thread.
  board::Publisher board_;
  PredictAgent predict_;                              // the failure predictor (background thread)
  std::vector<board::RailPublishState> board_rails_;  // background thread only
  TimeUs board_next_ = 0;                             // background thread only

  Rng rng_;
  std::thread bg_;
};

}  // namespace r2ccl::net
