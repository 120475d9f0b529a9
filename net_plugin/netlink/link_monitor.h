// Netlink link monitor: tells the background thread within milliseconds that a rail's interface
// went down (admin down, carrier loss, removal) or came back, and that an interface's IPv4 or
// IPv6 addresses changed (RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV6_IFADDR: an address added, removed,
// or its flags changed, such as the end of IPv6 duplicate address detection).
//
// libnl is NOT linked. libnl-3.so.200 and libnl-route-3.so.200 are dlopen'ed (RTLD_NOW |
// RTLD_LOCAL) the first time a monitor is opened, and the handful of functions used are looked up
// with dlsym into a process-wide table. Without them the plugin still loads and runs: open()
// returns false and one WARN per process says that link notifications are disabled, why, and that
// failures are then detected by socket errors, heartbeats and the acknowledgement watchdog.
// The libnl types are declared here and in link_monitor.cc as opaque structs, so building needs
// no libnl-3-dev either (see link_monitor.cc for how the declarations are checked against it).
//
// Events are level-triggered: each one is the interface's state when the monitor read it, and the
// same state may be repeated (the kernel sends RTM_NEWLINK for many changes that do not touch
// up/down). Consumers compare with the rail's current state. If the kernel drops notifications
// (socket receive buffer overflow), drain() re-reads every interface from /sys/class/net and
// reports its state, so a missed transition is never silent.
//
// Use: open(), then read each rail's initial state with link_is_up() (in that order, so no change
// falls between the two), then poll(fd()) and drain() on POLLIN.
//
// Kernel timing: admin down/up (ip link set DEV down/up) and removal are notified synchronously.
// Carrier changes go through the kernel's linkwatch (net/core/link_watch.c): immediate for
// stacked and LAG devices (veth, vlan, bond ports), but for a physical NIC a carrier LOSS is not
// "urgent" and waits for the next linkwatch run, up to ~1 s after the previous one. So a first
// carrier loss is seen in milliseconds, a loss shortly after another link event may take ~1 s.
//
// Thread-safety: a LinkMonitor is used by one thread (the plugin's background thread): open(),
// fd(), drain(), close() and the destructor must not run concurrently. library_available(),
// link_is_up() and set_library_names_for_testing() may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "r2ccl/clock.h"

struct nl_sock;  // libnl's opaque socket

namespace r2ccl::net {

namespace detail {
struct NlApi;  // the dlsym'ed libnl function table (link_monitor.cc)
}

class LinkMonitor {
 public:
  struct Event {
    int ifindex = 0;
    std::string ifname;  // may be empty only if the kernel sent no name
    // Admin up AND carrier: IFF_UP && (IFF_LOWER_UP || IFF_RUNNING). False for a removed link.
    bool up = false;
    bool removed = false;  // RTM_DELLINK: the interface is gone (and up is false)
    TimeUs when = 0;       // now_us() when the monitor read the notification
    // An address notification (RTM_NEWADDR/RTM_DELADDR) for `ifindex`: `up`, `removed` and
    // `ifname` mean nothing; the consumer re-reads the interface's addresses. After lost
    // notifications every interface gets one.
    bool address = false;
  };

  // Requested receive-buffer size of the netlink socket (the kernel caps it at rmem_max).
  static constexpr int kDefaultRcvbufBytes = 1 << 20;

  LinkMonitor() = default;
  ~LinkMonitor();  // closes
  LinkMonitor(const LinkMonitor&) = delete;
  LinkMonitor& operator=(const LinkMonitor&) = delete;

  // Opens a non-blocking, close-on-exec netlink socket subscribed to RTNLGRP_LINK (and the two
  // address groups; a kernel without IPv6 refuses that group, which is then left out) in the
  // calling thread's network namespace (the fd is owned by libnl's socket: never close it
  // yourself). Returns true if already open. Returns false if libnl or the socket is unavailable;
  // the first such failure in the process logs the one WARN, later ones are INFO. rcvbuf_bytes:
  // tests pass a tiny value to provoke an overflow.
  bool open(int rcvbuf_bytes = kDefaultRcvbufBytes);

  // For poll(POLLIN); -1 when not open.
  int fd() const { return fd_; }

  // Reads every pending notification without blocking (at most kMaxReadsPerDrain datagrams per
  // call; the fd stays readable if more are left) and appends one Event per link or address
  // notification (bridge-family notifications are ignored). After lost notifications (ENOBUFS)
  // or an unparsable one it appends the current state of every interface in /sys/class/net,
  // and an address event for each, all with the same `when`. No-op when not open or out is
  // null.
  static constexpr int kMaxReadsPerDrain = 256;
  void drain(std::vector<Event>* out);

  // Idempotent.
  void close();

  // Number of times notifications were lost and a sysfs resync was done, since open().
  uint64_t resyncs() const { return resyncs_; }

  // Loads libnl on first use (without logging). False, with the reason in *why (may be null),
  // if a library cannot be loaded or lacks a symbol.
  static bool library_available(std::string* why);

  // Test hook: use these sonames instead of libnl-3.so.200 / libnl-route-3.so.200 (empty string:
  // the default), forget the earlier load result and re-arm the one-WARN latch. Only while no
  // LinkMonitor is open.
  static void set_library_names_for_testing(const std::string& nl, const std::string& nl_route);

 private:
  struct Callbacks;  // libnl callbacks, defined in link_monitor.cc

  nl_sock* sock_ = nullptr;
  int fd_ = -1;
  const detail::NlApi* api_ = nullptr;
  uint64_t resyncs_ = 0;
  // Valid only inside drain(): where the callbacks append, and whether to resync afterwards.
  std::vector<Event>* sink_ = nullptr;
  bool need_resync_ = false;
};

// Current state of IFNAME from /sys/class/net/IFNAME: true if IFF_UP is set in "flags" and
// "operstate" is "up", or "operstate" is "unknown" (lo, many virtual devices) and "carrier" is 1.
// False for an unknown or malformed name. Reads the sysfs mounted in the caller's mount
// namespace, which normally shows the caller's network namespace. Thread-safe.
bool link_is_up(const std::string& ifname);

}  // namespace r2ccl::net
