// Rails: the NICs r2ccl uses, one NCCL device each. Chosen by R2CCL_SOCKET_IFNAME (else
// NCCL_SOCKET_IFNAME, else auto-detection) with NCCL's syntax plus IFNAME@ADDR.
// Thread-safety: parse_rail_spec/discover_rails are pure apart from reading the system's
// interfaces; call them from init.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <vector>

struct ifaddrs;  // <ifaddrs.h>

namespace r2ccl::net {

struct Rail {
  int index = 0;
  std::string ifname;  // kernel interface name
  std::string name;    // unique display name: "eth0", or "lo@127.0.0.2" for an address rail
  int ifindex = 0;
  int family = AF_INET;
  sockaddr_storage addr{};  // source address the rail's sockets bind to (port 0)
  socklen_t addrlen = 0;
  int prefix_len = 32;
  int speed_mbps = 10000;
  std::string pci_path;  // sysfs PCI path, empty for virtual NICs
};

// One entry of an interface spec: NCCL syntax. The whole list may start with '^' (exclude
// the listed prefixes) or '=' (exact names). An entry may carry "@ADDR" (IPv4 or IPv6).
struct RailSpec {
  bool exclude = false;
  bool exact = false;
  struct Entry {
    std::string name;
    std::string addr;  // empty: the interface's first address
  };
  std::vector<Entry> entries;
};
bool parse_rail_spec(const std::string& spec, RailSpec* out, std::string* err);

// An interface as the system reports it (for tests, the list can be made up).
struct IfAddr {
  std::string ifname;
  int ifindex;
  bool up;
  bool running;  // IFF_RUNNING: operational (carrier), as the kernel reports it
  int family;
  sockaddr_storage addr;
  int prefix_len;
};
std::vector<IfAddr> system_interfaces();
// The same from a getifaddrs(3)-style list (another source of it: the fake verbs provider's
// netdevs). Pure.
std::vector<IfAddr> interfaces_from(const ::ifaddrs* list);
// Link state of an interface from getifaddrs (IFF_UP && IFF_RUNNING). Unlike sysfs, this is
// always the calling thread's network namespace. Unknown interfaces are reported down.
bool interface_running(const std::string& ifname);

// The most rails one process carries (TCP's HELLO rail table, the health board's rows).
constexpr size_t kMaxRailsPerProcess = 16;

// Chooses rails from `ifs` by `spec` (empty = auto). `spec_var` names the variable the spec
// came from, for messages. speed_override_mbps > 0 replaces the link speed. At most
// kMaxRailsPerProcess rails, the first in name order: the names of the rest go to *left_out
// when given, else into one WARN per process naming them. Any thread; no state but that WARN.
bool select_rails(const std::string& spec, const std::string& spec_var,
                  const std::vector<IfAddr>& ifs, int speed_override_mbps, std::vector<Rail>* out,
                  std::string* err, std::vector<std::string>* left_out = nullptr);

std::string addr_to_string(const sockaddr_storage& a);
// "127.0.0.1:5000", "[fe80::1]:5000".
std::string addr_port_string(const sockaddr_storage& a);
// Same subnet under the shorter of the two prefixes.
bool same_subnet(int fam_a, const uint8_t* a, int plen_a, int fam_b, const uint8_t* b, int plen_b);
// Raw address bytes (4 or 16) of a sockaddr_storage.
const uint8_t* addr_bytes(const sockaddr_storage& a);

}  // namespace r2ccl::net
