// r2ccl_topology_check: dumps this node's rails and HCA ports as JSON (--dump), and compares
// the dumps of several nodes (--compare), reporting every asymmetry with a severity.
// The probing (interfaces, sysfs, DCB netlink, verbs) lives here; the model, JSON and the
// comparison are in topology_check.{h,cc}. See docs/TOPOLOGY-CHECK.md.
//
// Exit status: 0 no errors (warnings allowed), 1 errors found (--compare) or the dump could
// not be written, 2 bad usage, bad configuration or bad input (unreadable/malformed dump).
#include <arpa/inet.h>
#include <linux/dcbnl.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <net/if_arp.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "r2ccl/params.h"
#include "r2ccl/version.h"
#include "sock/rails.h"
#include "tools/topology_check.h"
#include "transport/ib/devices.h"
#include "transport/ib/verbs_api.h"

namespace {

using r2ccl::topo::NodeDump;
using r2ccl::topo::Port;

const char* kUsage =
    "usage: r2ccl_topology_check --dump [--out FILE]\n"
    "       r2ccl_topology_check --compare FILE FILE... [--json]\n"
    "\n"
    "  --dump       print this node's rails (R2CCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / auto,\n"
    "               as the plugin selects them) and HCA ports (R2CCL_IBVERBS_LIB, R2CCL_IB_HCA)\n"
    "               as JSON\n"
    "  --out FILE   write the dump to FILE instead of stdout\n"
    "  --compare    compare the dumps of two or more nodes; one line per finding, then a\n"
    "               summary\n"
    "  --json       --compare prints JSON instead\n"
    "exit: 0 no errors (warnings allowed), 1 errors found, 2 bad usage or bad input\n";

// ---------------------------------------------------------------------------------------
// Interface facts, always of the calling thread's network namespace (ioctl, netlink).

struct IfSock {
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ~IfSock() {
    if (fd >= 0) close(fd);
  }
};

int if_mtu(const std::string& ifname) {
  IfSock s;
  ifreq ifr{};
  snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname.c_str());
  if (s.fd < 0 || ioctl(s.fd, SIOCGIFMTU, &ifr) != 0) return 0;
  return ifr.ifr_mtu;
}

std::string if_link_layer(const std::string& ifname) {
  IfSock s;
  ifreq ifr{};
  snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname.c_str());
  if (s.fd < 0 || ioctl(s.fd, SIOCGIFHWADDR, &ifr) != 0) return "ethernet";
  switch (ifr.ifr_hwaddr.sa_family) {
    case ARPHRD_ETHER: return "ethernet";
    case ARPHRD_INFINIBAND: return "infiniband";
    case ARPHRD_LOOPBACK: return "loopback";
    default: return "other";
  }
}

int read_numa(const std::string& pci_path) {
  if (pci_path.empty()) return -1;
  std::ifstream f(pci_path + "/numa_node");
  int n = -1;
  if (f >> n && n >= 0) return n;
  return -1;
}

// PFC through the kernel's DCB netlink interface (what lldptool/dcbtool and mlnx_qos use):
// RTM_GETDCB / DCB_CMD_IEEE_GET, attribute DCB_ATTR_IEEE_PFC (struct ieee_pfc). "on" when any
// priority has PFC enabled, "off" when none, "unknown" when the driver has no DCB support
// (veth, most virtual NICs) or the query fails.
std::string if_pfc(const std::string& ifname) {
  int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  if (fd < 0) return "unknown";
  struct FdCloser {
    int fd;
    ~FdCloser() { close(fd); }
  } closer{fd};
  timeval tv{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  alignas(nlmsghdr) char req[NLMSG_SPACE(sizeof(dcbmsg)) + RTA_SPACE(IFNAMSIZ)] = {};
  auto* nh = reinterpret_cast<nlmsghdr*>(req);
  nh->nlmsg_type = RTM_GETDCB;
  nh->nlmsg_flags = NLM_F_REQUEST;
  nh->nlmsg_seq = 1;
  auto* d = static_cast<dcbmsg*>(NLMSG_DATA(nh));
  d->dcb_family = AF_UNSPEC;
  d->cmd = DCB_CMD_IEEE_GET;
  auto* a = reinterpret_cast<rtattr*>(req + NLMSG_SPACE(sizeof(dcbmsg)));
  size_t n = std::min(ifname.size(), static_cast<size_t>(IFNAMSIZ - 1));
  a->rta_type = DCB_ATTR_IFNAME;
  a->rta_len = static_cast<unsigned short>(RTA_LENGTH(n + 1));
  memcpy(RTA_DATA(a), ifname.data(), n);
  nh->nlmsg_len = static_cast<uint32_t>(NLMSG_SPACE(sizeof(dcbmsg)) + RTA_ALIGN(a->rta_len));
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (sendto(fd, req, nh->nlmsg_len, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof(kernel)) < 0)
    return "unknown";
  alignas(nlmsghdr) char buf[16384];
  ssize_t got = recv(fd, buf, sizeof(buf), 0);
  if (got <= 0) return "unknown";
  for (auto* m = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(m, static_cast<unsigned>(got));
       m = NLMSG_NEXT(m, got)) {
    if (m->nlmsg_type != RTM_GETDCB) return "unknown";  // NLMSG_ERROR: no DCB here
    int len = static_cast<int>(m->nlmsg_len) - static_cast<int>(NLMSG_SPACE(sizeof(dcbmsg)));
    auto* at = reinterpret_cast<rtattr*>(reinterpret_cast<char*>(m) + NLMSG_SPACE(sizeof(dcbmsg)));
    for (; RTA_OK(at, len); at = RTA_NEXT(at, len)) {
      if (at->rta_type != DCB_ATTR_IEEE) continue;
      int ilen = static_cast<int>(RTA_PAYLOAD(at));
      for (auto* in = static_cast<rtattr*>(RTA_DATA(at)); RTA_OK(in, ilen);
           in = RTA_NEXT(in, ilen)) {
        if (in->rta_type != DCB_ATTR_IEEE_PFC || RTA_PAYLOAD(in) < sizeof(ieee_pfc)) continue;
        ieee_pfc pfc;
        memcpy(&pfc, RTA_DATA(in), sizeof(pfc));
        return pfc.pfc_en != 0 ? "on" : "off";
      }
    }
    return "unknown";
  }
  return "unknown";
}

bool dump_node(NodeDump* out, std::string* err) {
  const r2ccl::Config* cfg = nullptr;
  if (!r2ccl::process_config(&cfg, err)) return false;
  NodeDump d;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  d.hostname = host;
  d.r2ccl_version = std::string(R2CCL_VERSION_STRING) + " (" + R2CCL_GIT_HASH + ")";

  // TCP rails: the plugin's own selection (runtime.cc), real link speeds.
  std::string var = getenv("R2CCL_SOCKET_IFNAME")  ? "R2CCL_SOCKET_IFNAME"
                    : getenv("NCCL_SOCKET_IFNAME") ? "NCCL_SOCKET_IFNAME"
                                                   : "auto-detection";
  std::vector<r2ccl::net::IfAddr> ifs = r2ccl::net::system_interfaces();
  std::vector<r2ccl::net::Rail> rails;
  if (!r2ccl::net::select_rails(cfg->socket_ifname, var, ifs, 0, &rails, err)) return false;
  for (const auto& r : rails) {
    Port p;
    p.name = r.name;
    p.link_layer = if_link_layer(r.ifname);
    p.state = r2ccl::net::interface_running(r.ifname) ? "up" : "down";
    p.speed_mbps = r.speed_mbps;
    p.mtu = if_mtu(r.ifname);
    std::string a = r2ccl::net::addr_to_string(r.addr);
    p.address = a + "/" + std::to_string(r.prefix_len);
    p.subnet = r2ccl::topo::subnet_of(a, r.prefix_len);
    p.pci_bus = r2ccl::topo::pci_bus_of(r.pci_path);
    p.numa = read_numa(r.pci_path);
    p.pfc = if_pfc(r.ifname);
    d.rails.push_back(p);
  }

  // HCA ports: absent verbs library = no HCAs.
  std::string lerr;
  const r2ccl::net::ib::VerbsApi* v = r2ccl::net::ib::VerbsApi::load(cfg->ibverbs_lib, &lerr);
  if (!v && getenv("R2CCL_IBVERBS_LIB"))
    fprintf(stderr, "r2ccl_topology_check: %s; no HCA ports listed\n", lerr.c_str());
  std::unique_ptr<r2ccl::net::ib::HcaSet> set;
  if (v && !r2ccl::net::ib::HcaSet::discover(v, *cfg, &set, err)) return false;
  if (set) {
    for (const auto& h : set->hcas()) {
      Port p;
      p.name = h.name + ":" + std::to_string(h.port);
      bool eth = h.link_layer == IBV_LINK_LAYER_ETHERNET;
      p.link_layer = eth ? "ethernet" : "infiniband";
      p.state = h.active ? "up" : "down";
      p.speed_mbps = h.speed_mbps;
      p.mtu = r2ccl::topo::ib_mtu_bytes(h.active_mtu);
      p.pci_bus = r2ccl::topo::pci_bus_of(h.pci_path);
      p.numa = h.numa;
      if (h.gid_index >= 0) {
        p.gid = r2ccl::net::ib::gid_to_string(h.gid);
        p.gid_type = r2ccl::topo::gid_type_name(h.gid_type);
        p.gid_index = h.gid_index;
      }
      static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
      if (eth && h.gid_index >= 0 && memcmp(h.gid, kMapped, 12) == 0) {
        char a[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, h.gid + 12, a, sizeof(a));
        // The prefix of the interface holding the GID's address (and its PFC state); /24,
        // the plugin's own pairing rule, when no interface here holds it.
        int plen = 24;
        for (const auto& i : ifs)
          if (i.family == AF_INET && memcmp(r2ccl::net::addr_bytes(i.addr), h.gid + 12, 4) == 0) {
            plen = i.prefix_len;
            p.pfc = if_pfc(i.ifname);
          }
        p.address = std::string(a) + "/" + std::to_string(plen);
        p.subnet = r2ccl::topo::subnet_of(a, plen);
      }
      d.hcas.push_back(p);
    }
  }
  *out = std::move(d);
  return true;
}

int run_dump(const std::string& out_file) {
  NodeDump d;
  std::string err;
  if (!dump_node(&d, &err)) {
    fprintf(stderr, "r2ccl_topology_check: %s\n", err.c_str());
    return 2;
  }
  std::string text = r2ccl::topo::to_json(d);
  if (out_file.empty()) {
    fputs(text.c_str(), stdout);
    return fflush(stdout) == 0 ? 0 : 1;
  }
  std::ofstream f(out_file, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) {
    fprintf(stderr, "r2ccl_topology_check: cannot write %s: %s\n", out_file.c_str(),
            strerror(errno));
    return 1;
  }
  return 0;
}

int run_compare(const std::vector<std::string>& files, bool as_json) {
  std::vector<NodeDump> dumps;
  for (const auto& f : files) {
    NodeDump d;
    std::string err;
    if (!r2ccl::topo::load_dump_file(f, &d, &err)) {
      fprintf(stderr, "r2ccl_topology_check: %s\n", err.c_str());
      return 2;
    }
    dumps.push_back(std::move(d));
  }
  std::vector<std::string> labels = r2ccl::topo::node_labels(dumps, files);
  std::vector<r2ccl::topo::NamedDump> nodes;
  for (size_t i = 0; i < dumps.size(); ++i) nodes.push_back({labels[i], dumps[i]});
  std::vector<r2ccl::topo::Finding> findings = r2ccl::topo::compare(nodes);
  bool errors = false;
  for (const auto& f : findings) errors |= f.severity == r2ccl::topo::Severity::kError;
  if (as_json) {
    fputs(r2ccl::topo::findings_to_json(nodes, findings).c_str(), stdout);
  } else {
    for (const auto& f : findings) printf("%s\n", r2ccl::topo::format_finding(f).c_str());
    printf("r2ccl_topology_check: %s\n",
           r2ccl::topo::format_summary(nodes.size(), findings).c_str());
  }
  return errors ? 1 : 0;
}

}  // namespace

static int run(int argc, char** argv) {
  bool dump = false, cmp = false, as_json = false;
  std::string out_file;
  std::vector<std::string> files;
  CLI::App app{"dumps this node's rails and HCA ports; compares the dumps of several nodes",
               "r2ccl_topology_check"};
  app.add_flag("--dump", dump, "print this node's rails and HCA ports as JSON");
  app.add_option("--out", out_file, "write the dump to FILE instead of stdout")
      ->type_name("FILE")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_flag("--compare", cmp, "compare the dumps of two or more nodes");
  app.add_flag("--json", as_json, "--compare prints JSON instead");
  app.add_option("FILE", files, "dump files (--compare)");
  app.set_version_flag("--version", std::string("r2ccl_topology_check ") + R2CCL_VERSION_STRING +
                                        " (" + R2CCL_GIT_HASH + "), dump schema " +
                                        std::to_string(r2ccl::topo::kSchemaVersion));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    fputs(kUsage, stdout);
    return 0;
  } catch (const CLI::CallForVersion& e) {
    printf("%s\n", e.what());
    return 0;
  } catch (const CLI::ParseError& e) {
    fprintf(stderr, "r2ccl_topology_check: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (dump == cmp) {
    fprintf(stderr, "r2ccl_topology_check: give exactly one of --dump and --compare\n%s", kUsage);
    return 2;
  }
  if (dump) {
    if (!files.empty() || as_json) {
      fprintf(stderr, "r2ccl_topology_check: --dump takes no files (use --out FILE)\n%s", kUsage);
      return 2;
    }
    return run_dump(out_file);
  }
  if (files.size() < 2 || !out_file.empty()) {
    fprintf(stderr, "r2ccl_topology_check: --compare needs two or more dump files\n%s", kUsage);
    return 2;
  }
  return run_compare(files, as_json);
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // never an abort: a bad byte in a name, a full disk...
    fprintf(stderr, "%s: error: %s\n", argv[0], e.what());
    return 2;
  }
}
