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

#include <atomic>
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

  // The rails. Names, interfaces, speeds and indices never change; a rail's address and
  // listener port can (DHCP, NetworkManager, container re-plumbing): read those with
  // rail_now() / wire_rail(), never from here.
  const std::vector<Rail>& rails() const { return rails_; }
  // Rail r with its current address (a copy; any thread). *has_addr (may be null): whether the
  // rail has a usable address now.
  Rail rail_now(int r, bool* has_addr = nullptr) const;
  // Rail r as the wire carries it: current address, prefix, listener port (any thread).
  WireRail wire_rail(int r) const;
  void fill_wire_rails(HelloBody* h) const;
  // A connection found rail r's address on the system differ from rail_now() (it resolves
  // the address again before every reconnect): the background thread re-reads every rail's
  // address at its next pass, as on a netlink address event. Any thread.
  void recheck_addresses() { addr_recheck_.store(true, std::memory_order_relaxed); }
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
  // Address changes (background thread): re-reads the addresses of the rails on `ifindex`
  // (-1: every rail); for a rail whose address changed it opens the listener on the new one
  // (the same port when free), then bumps RailLive::addr_events so the connections see it.
  void on_address_event(int ifindex, TimeUs now) override;
  void refresh_addresses(int ifindex, TimeUs now);
  void service_handshakes(TimeUs now);
  // Routes a checked hello to its listen comm or connection; false with *why (and the
  // refusal to answer, kAborted for none) when refused.
  bool route_hello(const Incoming& in, const char** why, Refusal* refusal);
  bool answer_hello(const Incoming& in) const;
  bool take_refusal(const WireRefusal& r, const char** why);
  void send_refusal(int fd, Refusal r, const Incoming& in, const std::string& text) const;

  std::vector<Rail> rails_;  // addr, addrlen, family, prefix_len guarded by addr_mu_
  int rank_ = -1;
  std::vector<int> listen_fds_;         // background thread (after init)
  std::vector<uint16_t> listen_ports_;  // guarded by addr_mu_
  std::vector<char> rail_has_addr_;     // guarded by addr_mu_
  mutable std::mutex addr_mu_;
  std::atomic<bool> addr_recheck_{false};
  static constexpr TimeUs kAddrCheckPeriod = kUsPerSec;
  TimeUs next_addr_check_ = 0;  // background thread
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
