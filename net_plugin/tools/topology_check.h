// r2ccl_topology_check's pure logic: the dump model (one node's rails and HCA ports), its JSON
// form (schema kSchemaVersion) with strict parsing, and the cross-node comparison that lists
// every asymmetry with a severity. No sockets, sysfs or verbs here: the tool's main()
// (r2ccl_topology_check.cc) probes the node and fills the model; tests feed hand-written dumps.
// docs/TOPOLOGY-CHECK.md describes the schema, the findings and their severities.
// Thread-safety: every function is pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace r2ccl::topo {

constexpr int kSchemaVersion = 1;

// One TCP rail or one HCA port. Unknown values: numbers 0 (mtu, speed) or -1 (numa,
// gid_index), strings "" (address, subnet, pci_bus, gid, gid_type) or "unknown" (pfc).
struct Port {
  std::string name;        // "eth0", "lo@127.0.0.2", "mlx5_0:1"
  std::string link_layer;  // "ethernet", "infiniband", "loopback", "other"
  std::string state;       // "up" / "down" (TCP carrier; HCA port ACTIVE or not)
  int speed_mbps = 0;
  int mtu = 0;          // bytes (HCAs: the port's active MTU)
  std::string address;  // "10.0.0.1/24" (TCP rails, RoCE IPv4 GIDs)
  std::string subnet;   // "10.0.0.0/24"
  std::string pci_bus;  // "0000:0b:00.0"
  int numa = -1;
  std::string pfc = "unknown";  // "on", "off", "unknown"
  // HCA ports only (empty / -1 for TCP rails).
  std::string gid;       // "::ffff:10.0.0.1", "fe80::..."
  std::string gid_type;  // "IB", "RoCEv1", "RoCEv2"
  int gid_index = -1;
};

struct NodeDump {
  int schema_version = kSchemaVersion;
  std::string hostname;
  std::string r2ccl_version;
  std::vector<Port> rails;  // TCP rails, in the plugin's order (NCCL device order)
  std::vector<Port> hcas;   // HCA ports, in the plugin's order
};

// Pretty-printed JSON of `d` (ends with a newline).
std::string to_json(const NodeDump& d);

// Parses a dump. `source` (a file name) starts every error message, e.g.
// "b.json: field rails[1].mtu: expected an integer". Fails on bad JSON (with the parser's
// position), a schema_version other than kSchemaVersion, a missing field or a wrong type.
// *out is set only on success.
bool from_json(const std::string& text, const std::string& source, NodeDump* out, std::string* err);
// Reads and parses `path` (an unreadable or empty file is an error naming it).
bool load_dump_file(const std::string& path, NodeDump* out, std::string* err);

enum class Severity { kWarning, kError };

struct Finding {
  Severity severity = Severity::kWarning;
  std::string kind;     // missing_rail, name, link_layer, state, speed, mtu, subnet,
                        // shared_subnet, numa, gid_type, pfc
  std::string node;     // the node's label
  std::string group;    // "rail" (TCP) or "hca"
  int index = -1;       // position in the node's list
  std::string port;     // the port's name on that node ("" when missing)
  std::string message;  // "MTU 1500, peers 9000"
};

struct NamedDump {
  std::string label;  // how findings name the node (see node_labels)
  NodeDump dump;
};

// Labels for the nodes: the hostname when it is unique among the dumps, else the file name.
std::vector<std::string> node_labels(const std::vector<NodeDump>& dumps,
                                     const std::vector<std::string>& files);

// Every asymmetry among `nodes` (at least 2), errors and warnings, in a stable order (group,
// index, kind, node order).
std::vector<Finding> compare(const std::vector<NamedDump>& nodes);

const char* severity_name(Severity s);
// "error: node B rail eth2: MTU 1500, peers 9000"
std::string format_finding(const Finding& f);
// "3 nodes, 2 errors, 1 warning"
std::string format_summary(size_t nodes, const std::vector<Finding>& findings);
// {"nodes": [...], "errors": N, "warnings": M, "findings": [{...}, ...]}
std::string findings_to_json(const std::vector<NamedDump>& nodes,
                             const std::vector<Finding>& findings);

// Helpers for the probing side, pure and unit-tested.
// Network address of addr/prefix ("10.1.2.3", 24 -> "10.1.2.0/24"); IPv6 too. "" if invalid.
std::string subnet_of(const std::string& addr, int prefix_len);
// "0000:0b:00.0" from a realpath'd sysfs PCI device path; "" if the last component is not a
// PCI function.
std::string pci_bus_of(const std::string& pci_path);
// enum ibv_mtu (1..5) to bytes (256..4096); 0 for anything else.
int ib_mtu_bytes(int ibv_mtu);
// kGidTypeIb/RoceV1/RoceV2 (0/1/2) to "IB"/"RoCEv1"/"RoCEv2"; "" otherwise.
const char* gid_type_name(int t);

}  // namespace r2ccl::topo
