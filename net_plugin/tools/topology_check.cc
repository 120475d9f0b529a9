#include "topology_check.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "r2ccl/file_util.h"

namespace r2ccl::topo {

using nlohmann::json;

namespace {

nlohmann::ordered_json port_to_json(const Port& p, bool hca) {
  nlohmann::ordered_json j = {{"name", p.name},     {"link_layer", p.link_layer},
                              {"state", p.state},   {"speed_mbps", p.speed_mbps},
                              {"mtu", p.mtu},       {"address", p.address},
                              {"subnet", p.subnet}, {"pci_bus", p.pci_bus},
                              {"numa", p.numa},     {"pfc", p.pfc}};
  if (hca) {
    j["gid"] = p.gid;
    j["gid_type"] = p.gid_type;
    j["gid_index"] = p.gid_index;
  }
  return j;
}

// Strict field readers: a missing field or a wrong type is an error naming the field path.
class Reader {
 public:
  explicit Reader(std::string* err) : err_(err) {}
  // A field of the right type whose value cannot be.
  bool bad_value(const std::string& path, const char* key, const std::string& why) {
    *err_ = "field " + name(path, key) + ": " + why;
    return false;
  }
  bool str(const json& o, const std::string& path, const char* key, std::string* out) {
    const json* v = field(o, path, key);
    if (!v) return false;
    if (!v->is_string()) return type_error(path, key, "a string", *v);
    *out = v->get<std::string>();
    return true;
  }
  bool integer(const json& o, const std::string& path, const char* key, int* out) {
    const json* v = field(o, path, key);
    if (!v) return false;
    if (!v->is_number_integer()) return type_error(path, key, "an integer", *v);
    int64_t x = v->get<int64_t>();
    if (x < INT32_MIN || x > INT32_MAX) return type_error(path, key, "a 32-bit integer", *v);
    *out = static_cast<int>(x);
    return true;
  }
  const json* array(const json& o, const std::string& path, const char* key) {
    const json* v = field(o, path, key);
    if (!v) return nullptr;
    if (!v->is_array()) {
      type_error(path, key, "an array", *v);
      return nullptr;
    }
    return v;
  }

 private:
  static std::string name(const std::string& path, const char* key) {
    return path.empty() ? key : path + "." + key;
  }
  const json* field(const json& o, const std::string& path, const char* key) {
    auto it = o.find(key);
    if (it == o.end()) {
      *err_ = "missing field " + name(path, key);
      return nullptr;
    }
    return &*it;
  }
  bool type_error(const std::string& path, const char* key, const char* want, const json& v) {
    *err_ = "field " + name(path, key) + ": expected " + want + ", got " + v.type_name();
    return false;
  }
  std::string* err_;
};

bool port_from_json(Reader& r, const json& j, const std::string& path, bool hca, Port* p) {
  if (!j.is_object()) return false;
  if (!r.str(j, path, "name", &p->name) || !r.str(j, path, "link_layer", &p->link_layer) ||
      !r.str(j, path, "state", &p->state) || !r.integer(j, path, "speed_mbps", &p->speed_mbps) ||
      !r.integer(j, path, "mtu", &p->mtu) || !r.str(j, path, "address", &p->address) ||
      !r.str(j, path, "subnet", &p->subnet) || !r.str(j, path, "pci_bus", &p->pci_bus) ||
      !r.integer(j, path, "numa", &p->numa) || !r.str(j, path, "pfc", &p->pfc))
    return false;
  if (hca && (!r.str(j, path, "gid", &p->gid) || !r.str(j, path, "gid_type", &p->gid_type) ||
              !r.integer(j, path, "gid_index", &p->gid_index)))
    return false;
  // 0 means unknown; a negative speed or MTU is not a value a dump can hold.
  if (p->speed_mbps < 0 || p->mtu < 0)
    return r.bad_value(path, p->mtu < 0 ? "mtu" : "speed_mbps",
                       "negative; expected 0 (unknown) or a positive integer");
  return true;
}

bool ports_from_json(Reader& r, const json& o, const char* key, bool hca, std::vector<Port>* out,
                     std::string* err) {
  const json* a = r.array(o, "", key);
  if (!a) return false;
  out->clear();
  for (size_t i = 0; i < a->size(); ++i) {
    std::string path = std::string(key) + "[" + std::to_string(i) + "]";
    const json& e = (*a)[i];
    if (!e.is_object()) {
      *err = "field " + path + ": expected an object, got " + e.type_name();
      return false;
    }
    Port p;
    if (!port_from_json(r, e, path, hca, &p)) return false;
    out->push_back(p);
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// Comparison.

struct Ctx {
  const std::vector<NamedDump>& nodes;
  std::vector<Finding>* out;
};

const std::vector<Port>& ports_of(const NodeDump& d, const std::string& group) {
  return group == "rail" ? d.rails : d.hcas;
}

// The reference ("peers'") value among `vals` (known values only, in node order): the value
// held by most nodes; a tie goes to `prefer_high` ? the highest : the earliest node's value.
template <typename T>
T reference(const std::vector<T>& vals, bool prefer_high) {
  std::map<T, int> count;
  for (const auto& v : vals) ++count[v];
  int best = 0;
  for (const auto& kv : count) best = std::max(best, kv.second);
  if (prefer_high) {
    T r{};
    bool have = false;
    for (const auto& kv : count)
      if (kv.second == best && (!have || r < kv.first)) r = kv.first, have = true;
    return r;
  }
  for (const auto& v : vals)
    if (count[v] == best) return v;
  return T{};
}

std::string plural(size_t n, const char* word) {
  return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
}

std::string mbps_text(int m) {
  if (m >= 1000 && m % 1000 == 0) return std::to_string(m / 1000) + " Gbps";
  return std::to_string(m) + " Mbps";
}

void add(Ctx& c, Severity s, const std::string& kind, size_t node, const std::string& group,
         int index, const std::string& port, const std::string& msg) {
  c.out->push_back(Finding{s, kind, c.nodes[node].label, group, index, port, msg});
}

// One attribute of port `k` across the nodes that have it. `get` returns false for an unknown
// value (not compared). `report(value, ref)` returns true when the node must be reported.
template <typename T>
void check_attr(Ctx& c, const std::string& group, size_t k, const std::vector<size_t>& have,
                const std::string& kind, Severity sev, bool prefer_high,
                const std::function<bool(const Port&, T*)>& get,
                const std::function<std::string(const T&)>& text,
                const std::function<bool(const T&, const T&)>& report, const std::string& what) {
  std::vector<T> vals;
  std::vector<std::pair<size_t, T>> known;
  for (size_t n : have) {
    T v;
    if (get(ports_of(c.nodes[n].dump, group)[k], &v)) {
      vals.push_back(v);
      known.emplace_back(n, v);
    }
  }
  if (known.size() < 2) return;
  T ref = reference(vals, prefer_high);
  for (const auto& nv : known) {
    if (!report(nv.second, ref)) continue;
    const Port& p = ports_of(c.nodes[nv.first].dump, group)[k];
    add(c, sev, kind, nv.first, group, static_cast<int>(k), p.name,
        what + text(nv.second) + ", peers " + text(ref));
  }
}

void compare_group(Ctx& c, const std::string& group) {
  const std::string noun = group == "rail" ? "rail" : "HCA port";
  size_t n_max = 0;
  for (const auto& n : c.nodes) n_max = std::max(n_max, ports_of(n.dump, group).size());

  // Is the fabric "shared L2" for this group: does any subnet appear on two nodes?
  std::map<std::string, std::set<size_t>> subnet_nodes;
  for (size_t n = 0; n < c.nodes.size(); ++n)
    for (const auto& p : ports_of(c.nodes[n].dump, group))
      if (!p.subnet.empty()) subnet_nodes[p.subnet].insert(n);
  bool shared_l2 = false;
  for (const auto& kv : subnet_nodes) shared_l2 |= kv.second.size() > 1;

  auto differs = [](const auto& v, const auto& ref) { return v != ref; };
  for (size_t k = 0; k < n_max; ++k) {
    std::vector<size_t> have;
    std::vector<std::string> names;
    for (size_t n = 0; n < c.nodes.size(); ++n) {
      const auto& ps = ports_of(c.nodes[n].dump, group);
      if (k < ps.size()) {
        have.push_back(n);
        if (std::find(names.begin(), names.end(), ps[k].name) == names.end())
          names.push_back(ps[k].name);
      }
    }
    std::string peer_names;
    for (const auto& nm : names) peer_names += (peer_names.empty() ? "" : ", ") + nm;
    for (size_t n = 0; n < c.nodes.size(); ++n) {
      size_t cnt = ports_of(c.nodes[n].dump, group).size();
      if (k < cnt) continue;
      add(c, Severity::kError, "missing_rail", n, group, static_cast<int>(k), "",
          "missing (" + plural(cnt, noun.c_str()) + ", peers have " + noun + " " +
              std::to_string(k) + ": " + peer_names + ")");
    }
    using S = std::string;
    auto str_text = [](const S& s) { return s; };
    check_attr<S>(
        c, group, k, have, "name", Severity::kWarning, false,
        [](const Port& p, S* v) { return *v = p.name, true; }, str_text, differs,
        noun + " " + std::to_string(k) + " is ");
    check_attr<S>(
        c, group, k, have, "link_layer", Severity::kError, false,
        [](const Port& p, S* v) { return *v = p.link_layer, !v->empty(); }, str_text, differs,
        "link layer ");
    check_attr<S>(
        c, group, k, have, "state", Severity::kWarning, false,
        [](const Port& p, S* v) { return *v = p.state, !v->empty(); }, str_text, differs, "state ");
    check_attr<int>(
        c, group, k, have, "speed", Severity::kWarning, true,
        [](const Port& p, int* v) { return *v = p.speed_mbps, *v > 0; }, mbps_text,
        [](const int& v, const int& ref) { return v < ref; }, "speed ");
    check_attr<int>(
        c, group, k, have, "mtu", Severity::kError, false,
        [](const Port& p, int* v) { return *v = p.mtu, *v > 0; },
        [](const int& v) { return std::to_string(v); }, differs, "MTU ");
    if (shared_l2)
      check_attr<S>(
          c, group, k, have, "subnet", Severity::kError, false,
          [](const Port& p, S* v) { return *v = p.subnet, !v->empty(); }, str_text, differs,
          "subnet ");
    check_attr<int>(
        c, group, k, have, "numa", Severity::kWarning, false,
        [](const Port& p, int* v) { return *v = p.numa, *v >= 0; },
        [](const int& v) { return std::to_string(v); }, differs, "NUMA node ");
    check_attr<S>(
        c, group, k, have, "gid_type", Severity::kWarning, false,
        [](const Port& p, S* v) { return *v = p.gid_type, !v->empty(); }, str_text, differs,
        "GID type ");
    check_attr<S>(
        c, group, k, have, "pfc", Severity::kWarning, false,
        [](const Port& p, S* v) { return *v = p.pfc, *v == "on" || *v == "off"; }, str_text,
        differs, "PFC ");
  }

  // Two ports of one node on one subnet.
  for (size_t n = 0; n < c.nodes.size(); ++n) {
    const auto& ps = ports_of(c.nodes[n].dump, group);
    for (size_t i = 0; i < ps.size(); ++i)
      for (size_t j = i + 1; j < ps.size(); ++j)
        if (!ps[i].subnet.empty() && ps[i].subnet == ps[j].subnet)
          add(c, Severity::kWarning, "shared_subnet", n, group, static_cast<int>(i), ps[i].name,
              "same subnet " + ps[i].subnet + " as " + noun + " " + ps[j].name);
  }
}

}  // namespace

std::string to_json(const NodeDump& d) {
  nlohmann::ordered_json j;
  j["schema_version"] = d.schema_version;
  j["tool"] = "r2ccl_topology_check";
  j["hostname"] = d.hostname;
  j["r2ccl_version"] = d.r2ccl_version;
  j["rails"] = nlohmann::ordered_json::array();
  for (const auto& p : d.rails) j["rails"].push_back(port_to_json(p, false));
  j["hcas"] = nlohmann::ordered_json::array();
  for (const auto& p : d.hcas) j["hcas"].push_back(port_to_json(p, true));
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

bool from_json(const std::string& text, const std::string& source, NodeDump* out,
               std::string* err) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 3, column 1: ..." -> after "] "
    auto pos = what.find("] ");
    *err = source + ": not valid JSON (truncated or corrupt): " +
           (pos == std::string::npos ? what : what.substr(pos + 2));
    return false;
  }
  if (!j.is_object()) {
    *err = source + ": expected a JSON object (an r2ccl_topology_check --dump), got " +
           std::string(j.type_name());
    return false;
  }
  std::string e;
  Reader r(&e);
  NodeDump d;
  if (!r.integer(j, "", "schema_version", &d.schema_version)) {
    *err = source + ": " + e;
    return false;
  }
  if (d.schema_version != kSchemaVersion) {
    *err = source + ": field schema_version: " + std::to_string(d.schema_version) +
           " is not supported (this tool reads version " + std::to_string(kSchemaVersion) + ")";
    return false;
  }
  if (!r.str(j, "", "hostname", &d.hostname) || !r.str(j, "", "r2ccl_version", &d.r2ccl_version) ||
      !ports_from_json(r, j, "rails", false, &d.rails, &e) ||
      !ports_from_json(r, j, "hcas", true, &d.hcas, &e)) {
    *err = source + ": " + e;
    return false;
  }
  *out = std::move(d);
  return true;
}

bool load_dump_file(const std::string& path, NodeDump* out, std::string* err) {
  // A dump is a few KiB; anything past this bound (or not a regular file: a directory,
  // /dev/zero, a FIFO) is not one.
  constexpr size_t kMaxDumpBytes = 16u << 20;
  std::string text, why;
  if (!read_regular_file(path, kMaxDumpBytes, &text, &why)) {
    if (why == "not a regular file")
      *err = path + ": not a regular file (expected an r2ccl_topology_check --dump)";
    else if (why.rfind("larger than", 0) == 0)
      *err = path + ": larger than 16 MiB: not an r2ccl_topology_check --dump";
    else
      *err = path + ": cannot read: " + why;
    return false;
  }
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    *err = path + ": empty file (expected an r2ccl_topology_check --dump)";
    return false;
  }
  return from_json(text, path, out, err);
}

std::vector<std::string> node_labels(const std::vector<NodeDump>& dumps,
                                     const std::vector<std::string>& files) {
  std::map<std::string, int> count;
  for (const auto& d : dumps) ++count[d.hostname];
  std::vector<std::string> out;
  for (size_t i = 0; i < dumps.size(); ++i) {
    bool unique = !dumps[i].hostname.empty() && count[dumps[i].hostname] == 1;
    out.push_back(unique || i >= files.size() ? dumps[i].hostname : files[i]);
  }
  return out;
}

std::vector<Finding> compare(const std::vector<NamedDump>& nodes) {
  std::vector<Finding> out;
  if (nodes.size() < 2) return out;
  Ctx c{nodes, &out};
  compare_group(c, "rail");
  compare_group(c, "hca");
  return out;
}

const char* severity_name(Severity s) { return s == Severity::kError ? "error" : "warning"; }

std::string format_finding(const Finding& f) {
  std::string where = f.group == "rail" ? "rail " : "HCA port ";
  where += f.port.empty() ? "#" + std::to_string(f.index) : f.port;
  return std::string(severity_name(f.severity)) + ": node " + f.node + " " + where + ": " +
         f.message;
}

std::string format_summary(size_t nodes, const std::vector<Finding>& findings) {
  size_t e = 0, w = 0;
  for (const auto& f : findings) (f.severity == Severity::kError ? e : w)++;
  return plural(nodes, "node") + ", " + plural(e, "error") + ", " + plural(w, "warning");
}

std::string findings_to_json(const std::vector<NamedDump>& nodes,
                             const std::vector<Finding>& findings) {
  nlohmann::ordered_json j;
  int e = 0, w = 0;
  for (const auto& f : findings) (f.severity == Severity::kError ? e : w)++;
  j["nodes"] = nlohmann::ordered_json::array();
  for (const auto& n : nodes) j["nodes"].push_back(n.label);
  j["errors"] = e;
  j["warnings"] = w;
  j["findings"] = nlohmann::ordered_json::array();
  for (const auto& f : findings) {
    nlohmann::ordered_json o;
    o["severity"] = severity_name(f.severity);
    o["kind"] = f.kind;
    o["node"] = f.node;
    o["group"] = f.group;
    o["index"] = f.index;
    o["port"] = f.port;
    o["message"] = f.message;
    o["text"] = format_finding(f);
    j["findings"].push_back(o);
  }
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string subnet_of(const std::string& addr, int prefix_len) {
  uint8_t b[16];
  int fam = addr.find(':') == std::string::npos ? AF_INET : AF_INET6;
  int len = fam == AF_INET ? 4 : 16;
  if (inet_pton(fam, addr.c_str(), b) != 1 || prefix_len < 0 || prefix_len > len * 8) return "";
  for (int i = 0; i < len; ++i) {
    int keep = std::min(8, std::max(0, prefix_len - 8 * i));
    b[i] &= static_cast<uint8_t>(keep == 0 ? 0 : 0xff << (8 - keep));
  }
  char s[INET6_ADDRSTRLEN];
  if (!inet_ntop(fam, b, s, sizeof(s))) return "";
  return std::string(s) + "/" + std::to_string(prefix_len);
}

std::string pci_bus_of(const std::string& pci_path) {
  auto pos = pci_path.find_last_of('/');
  std::string last = pos == std::string::npos ? pci_path : pci_path.substr(pos + 1);
  // DDDD:BB:DD.F
  if (last.size() != 12 || last[4] != ':' || last[7] != ':' || last[10] != '.') return "";
  for (size_t i = 0; i < last.size(); ++i)
    if (i != 4 && i != 7 && i != 10 && !isxdigit(static_cast<unsigned char>(last[i]))) return "";
  return last;
}

int ib_mtu_bytes(int ibv_mtu) { return ibv_mtu >= 1 && ibv_mtu <= 5 ? 128 << ibv_mtu : 0; }

const char* gid_type_name(int t) {
  switch (t) {
    case 0: return "IB";
    case 1: return "RoCEv1";
    case 2: return "RoCEv2";
    default: return "";
  }
}

}  // namespace r2ccl::topo
