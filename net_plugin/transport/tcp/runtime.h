// The TCP transport's per-process runtime: its rails (interfaces chosen by
// R2CCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), one listener per rail (the background thread
// accepts and checks every HELLO: magic, size, secret, a known listen comm or connection,
// before the socket is handed to its owner; so reconnects work after NCCL closed its listen
// comm and a peer without the secret is refused and logged), the devices and handles NCCL
// sees, and the in-process fault injector's configuration. Everything else per process is
// RuntimeBase's.
//
// Thread ownership, on top of RuntimeBase's: listener sockets and half-open incoming
// connections (until the hello is checked) belong to the background thread; the listen
// comm registry is guarded by listens_mu_.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sock/rails.h"
#include "sock/sock_errors.h"
#include "transport/runtime_base.h"
#include "transport/tcp/wire.h"

namespace r2ccl::net::tcp {

class Listen;
struct Incoming;

class Runtime final : public RuntimeBase {
 public:
  // Finds the rails, opens the listeners and starts the background thread. Errors:
  // kInvalidUsage (a bad variable, named), kSystem (a listener could not be opened).
  // Thread: init, once per process.
  static Status create(const Config* cfg, std::unique_ptr<Runtime>* out, std::string* err);

  const std::vector<Rail>& rails() const { return rails_; }
  // Listener endpoint of rail r (port in network order).
  uint16_t listener_port(int r) const { return listen_ports_[r]; }
  void fill_wire_rails(HelloBody* h) const;
  // This process's knobs (R2CCL_CHUNK_SIZE, _BACKUP_PATHS, _NSOCKS_PER_PATH, _STRIPE), as the
  // HELLO and its answer carry them.
  WireKnobs knobs() const;
  void register_listen(Listen* l);
  void unregister_listen(Listen* l);
  // A rail's listener has been out of descriptors with a connection waiting for
  // kAcceptStarvedLimit and failed again since `since` (sock/sock_errors.h): true with *why
  // naming the rail and the limit. An accept() that has no stream of its connection yet
  // fails then. Any thread.
  bool accept_starved(TimeUs now, TimeUs since, std::string* why) const;

  // --- Transport ---
  Status listen(int dev, void* handle, Listener** out) override;
  int arm_faults(const char* spec) override;  // R2CCL_FAULT_INJECT's syntax

 private:
  // Connector: a TCP handle (magic, version 2, 1-4 IPv4/IPv6 endpoints) is checked first.
  // Acceptor: takes the streams the background thread checked into the listen's inbox.
  std::unique_ptr<ConnIo> new_conn_io(int dev, int traffic_class, const void* handle,
                                      Listener* accept, Status* st) override;
  Runtime() = default;
  Status init(const Config* cfg, std::string* err);
  // Background thread: accepts on every rail's listener, then reads and checks the hello of
  // each incoming stream (bounded by kIncomingHelloTimeout).
  void bg_add_fds(std::vector<pollfd>* fds) override;
  void accept_new(int rail, TimeUs now);
  void refuse_waiting(int rail, TimeUs now);
  void bg_on_fds(const pollfd* fds, size_t n, TimeUs now) override;
  void service_handshakes(TimeUs now);
  // Routes a checked hello to its listen comm or connection; false with *why (and the
  // refusal to answer, kAborted for none) when refused.
  bool route_hello(const Incoming& in, const char** why, Refusal* refusal);
  bool answer_hello(const Incoming& in) const;
  bool take_refusal(const WireRefusal& r, const char** why);
  void send_refusal(int fd, Refusal r, const Incoming& in, const std::string& text) const;

  std::vector<Rail> rails_;
  int rank_ = -1;
  std::vector<int> listen_fds_;
  std::vector<uint16_t> listen_ports_;
  // Per listener; the background thread owns them (accept_starved() only reads).
  std::vector<AcceptGate> accept_gates_;

  std::mutex listens_mu_;
  std::vector<Listen*> listens_;  // guarded by listens_mu_

  struct Pending {
    int fd;
    int rail;
    std::string from;  // the connector's address, read at accept (it may be gone later)
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
};

}  // namespace r2ccl::net::tcp
