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
  // IFNAME@ADDR: the rail is that address, not "the interface's address" (which may change).
  bool fixed_addr = false;
  // IFNAME@ADDR whose address was the interface's own, or inside one of its subnets (lo@127.0.0.2
  // on lo's 127.0.0.1/8), when the rail was selected: it is usable while that still holds. One
  // that was neither is taken as the user gave it and never judged.
  bool fixed_covered = false;
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
  int ifindex = 0;
  bool up = false;
  bool running = false;  // IFF_RUNNING: operational (carrier), as the kernel reports it
  int family = 0;        // AF_INET or AF_INET6
  sockaddr_storage addr{};
  int prefix_len = 0;
  // IPv6 duplicate address detection not done yet, or failed (/proc/net/if_inet6 flags
  // IFA_F_TENTATIVE, IFA_F_DADFAILED): the kernel refuses to bind it.
  bool tentative = false;
};
// The system's interfaces (getifaddrs(3)), with IPv6 addresses in duplicate address
// detection marked tentative. Any thread. read_system_interfaces: false when getifaddrs
// failed (out of descriptors or memory: the addresses are unknown, not gone).
std::vector<IfAddr> system_interfaces();
bool read_system_interfaces(std::vector<IfAddr>* out);
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

// The address rail `r` uses now, given the interfaces `ifs` (system_interfaces()): an
// IFNAME@ADDR rail, its address while the interface has it or an address whose subnet holds
// it (when it was so at selection: Rail::fixed_covered, else always); any other rail, its current
// address while the interface still has it (an address added beside it changes nothing),
// else the interface's first address of the same family, else of the other family. Never a
// tentative address. False when the interface has no usable address (removed, or all in
// duplicate address detection): *addr/*prefix_len untouched. Pure.
bool resolve_rail_address(const Rail& r, const std::vector<IfAddr>& ifs, sockaddr_storage* addr,
                          int* prefix_len);
// The same address (family and bytes; ports are not compared).
bool same_address(const sockaddr_storage& a, const sockaddr_storage& b);

std::string addr_to_string(const sockaddr_storage& a);
// "127.0.0.1:5000", "[fe80::1]:5000".
std::string addr_port_string(const sockaddr_storage& a);
// Same subnet under the shorter of the two prefixes.
bool same_subnet(int fam_a, const uint8_t* a, int plen_a, int fam_b, const uint8_t* b, int plen_b);
// Raw address bytes (4 or 16) of a sockaddr_storage.
const uint8_t* addr_bytes(const sockaddr_storage& a);

}  // namespace r2ccl::net
