// r2ccl_topology_check's pure logic (net_plugin/tools/topology_check.h) on hand-written dumps:
// JSON round trip, strict parsing with errors naming the file and the field, and one test per
// kind of asymmetry with its severity.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <string>
#include <vector>

#include "tools/topology_check.h"

using namespace r2ccl::topo;

namespace {

Port rail(int i) {
  Port p;
  p.name = "eth" + std::to_string(i);
  p.link_layer = "ethernet";
  p.state = "up";
  p.speed_mbps = 100000;
  p.mtu = 9000;
  p.address = "10.0." + std::to_string(i) + ".1/24";
  p.subnet = "10.0." + std::to_string(i) + ".0/24";
  p.pci_bus = "0000:0" + std::to_string(i) + ":00.0";
  p.numa = 0;
  p.pfc = "on";
  return p;
}

Port hca(int i) {
  Port p = rail(i);
  p.name = "mlx5_" + std::to_string(i) + ":1";
  p.mtu = 4096;
  p.address = "10.1." + std::to_string(i) + ".1/24";
  p.subnet = "10.1." + std::to_string(i) + ".0/24";
  p.gid = "::ffff:10.1." + std::to_string(i) + ".1";
  p.gid_type = "RoCEv2";
  p.gid_index = 3;
  return p;
}

NodeDump node(const std::string& host, int rails = 2, int hcas = 2) {
  NodeDump d;
  d.hostname = host;
  d.r2ccl_version = "0.1.0 (test)";
  for (int i = 0; i < rails; ++i) d.rails.push_back(rail(i));
  for (int i = 0; i < hcas; ++i) d.hcas.push_back(hca(i));
  return d;
}

std::vector<NamedDump> named(const std::vector<NodeDump>& ds) {
  std::vector<NamedDump> out;
  for (const auto& d : ds) out.push_back({d.hostname, d});
  return out;
}

std::vector<Finding> cmp(const std::vector<NodeDump>& ds) { return compare(named(ds)); }

std::string all_text(const std::vector<Finding>& fs) {
  std::string s;
  for (const auto& f : fs) s += format_finding(f) + "\n";
  return s;
}

std::string write_temp(const std::string& tag, const std::string& text) {
  std::string p = (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp") + std::string("/topo-") +
                  std::to_string(getpid()) + "-" + tag + ".json";
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

}  // namespace

TEST_CASE("topology: a dump survives the JSON round trip") {
  NodeDump d = node("A");
  d.rails[1].pfc = "unknown";
  d.hcas[0].numa = -1;
  NodeDump back;
  std::string err;
  REQUIRE(from_json(to_json(d), "a.json", &back, &err));
  CHECK(back.hostname == "A");
  CHECK(back.schema_version == kSchemaVersion);
  REQUIRE(back.rails.size() == 2);
  REQUIRE(back.hcas.size() == 2);
  CHECK(back.rails[1].pfc == "unknown");
  CHECK(back.rails[0].mtu == 9000);
  CHECK(back.hcas[0].numa == -1);
  CHECK(back.hcas[1].gid_type == "RoCEv2");
  CHECK(back.hcas[1].gid == "::ffff:10.1.1.1");
  CHECK(to_json(back) == to_json(d));
}

TEST_CASE("topology: identical dumps have no findings") {
  auto fs = cmp({node("A"), node("B"), node("C")});
  INFO(all_text(fs));
  CHECK(fs.empty());
  CHECK(format_summary(3, fs) == "3 nodes, 0 errors, 0 warnings");
}

TEST_CASE("topology: MTU mismatch is an error naming node, rail and values") {
  NodeDump b = node("B");
  b.rails[1].mtu = 1500;
  auto fs = cmp({node("A"), b});
  REQUIRE(fs.size() == 1);
  CHECK(fs[0].severity == Severity::kError);
  CHECK(fs[0].kind == "mtu");
  CHECK(format_finding(fs[0]) == "error: node B rail eth1: MTU 1500, peers 9000");
  CHECK(format_summary(2, fs) == "2 nodes, 1 error, 0 warnings");
}

TEST_CASE("topology: a missing rail is an error on the node that lacks it") {
  auto fs = cmp({node("A", 3), node("B", 2), node("C", 3)});
  REQUIRE(fs.size() == 1);
  CHECK(fs[0].severity == Severity::kError);
  CHECK(fs[0].kind == "missing_rail");
  CHECK(fs[0].node == "B");
  CHECK(fs[0].index == 2);
  CHECK(format_finding(fs[0]).find("eth2") != std::string::npos);

  // A node without any HCA while its peers have two: two missing HCA ports.
  fs = cmp({node("A"), node("B", 2, 0)});
  REQUIRE(fs.size() == 2);
  for (const auto& f : fs) {
    CHECK(f.kind == "missing_rail");
    CHECK(f.group == "hca");
    CHECK(f.severity == Severity::kError);
  }
}

TEST_CASE("topology: a slower rail is a warning; a faster one is not reported") {
  NodeDump b = node("B");
  b.rails[0].speed_mbps = 25000;
  auto fs = cmp({node("A"), b});
  REQUIRE(fs.size() == 1);
  CHECK(fs[0].severity == Severity::kWarning);
  CHECK(fs[0].kind == "speed");
  CHECK(format_finding(fs[0]) == "warning: node B rail eth0: speed 25 Gbps, peers 100 Gbps");
  // Tie between two nodes: the higher speed is the reference, whichever node comes first.
  fs = cmp({b, node("A")});
  REQUIRE(fs.size() == 1);
  CHECK(fs[0].node == "B");
  // The majority is slow, one node faster: nothing to report.
  NodeDump c = node("C");
  c.rails[0].speed_mbps = 25000;
  fs = cmp({node("A"), b, c});
  CHECK(fs.empty());
}

TEST_CASE("topology: subnet mapping") {
  SECTION("rail k on another subnet than on its peers is an error") {
    NodeDump c = node("C");
    c.rails[1].subnet = "10.0.9.0/24";
    auto fs = cmp({node("A"), node("B"), c});
    REQUIRE(fs.size() == 1);
    CHECK(fs[0].severity == Severity::kError);
    CHECK(fs[0].kind == "subnet");
    CHECK(format_finding(fs[0]) ==
          "error: node C rail eth1: subnet 10.0.9.0/24, peers 10.0.1.0/24");
  }
  SECTION("crossed rails (swapped subnets) are errors") {
    NodeDump b = node("B");
    std::swap(b.rails[0].subnet, b.rails[1].subnet);
    auto fs = cmp({node("A"), b});
    REQUIRE(fs.size() == 2);
    for (const auto& f : fs) {
      CHECK(f.kind == "subnet");
      CHECK(f.node == "B");
      CHECK(f.severity == Severity::kError);
    }
  }
  SECTION("a routed fabric (no subnet shared by two nodes) is not reported") {
    NodeDump a = node("A"), b = node("B");
    for (int i = 0; i < 2; ++i) {
      a.rails[i].subnet = "10.2." + std::to_string(i) + ".0/31";
      b.rails[i].subnet = "10.3." + std::to_string(i) + ".0/31";
      a.hcas[i].subnet = "10.4." + std::to_string(i) + ".0/31";
      b.hcas[i].subnet = "10.5." + std::to_string(i) + ".0/31";
    }
    auto fs = cmp({a, b});
    INFO(all_text(fs));
    CHECK(fs.empty());
  }
  SECTION("two rails of one node on one subnet is a warning") {
    NodeDump a = node("A"), b = node("B");
    a.rails[1].subnet = b.rails[1].subnet = "10.0.0.0/24";
    auto fs = cmp({a, b});
    REQUIRE(fs.size() == 2);
    for (const auto& f : fs) {
      CHECK(f.kind == "shared_subnet");
      CHECK(f.severity == Severity::kWarning);
    }
    CHECK(fs[0].node == "A");
    CHECK(fs[1].node == "B");
  }
}

TEST_CASE("topology: NUMA, link layer, GID type, PFC, state and name") {
  struct Case {
    const char* kind;
    Severity sev;
    void (*change)(NodeDump*);
    const char* text;
  };
  std::vector<Case> cases = {
      {"numa", Severity::kWarning, [](NodeDump* d) { d->rails[0].numa = 1; },
       "warning: node B rail eth0: NUMA node 1, peers 0"},
      {"link_layer", Severity::kError, [](NodeDump* d) { d->hcas[1].link_layer = "infiniband"; },
       "error: node B HCA port mlx5_1:1: link layer infiniband, peers ethernet"},
      {"gid_type", Severity::kWarning, [](NodeDump* d) { d->hcas[0].gid_type = "RoCEv1"; },
       "warning: node B HCA port mlx5_0:1: GID type RoCEv1, peers RoCEv2"},
      {"pfc", Severity::kWarning, [](NodeDump* d) { d->rails[1].pfc = "off"; },
       "warning: node B rail eth1: PFC off, peers on"},
      {"state", Severity::kWarning, [](NodeDump* d) { d->hcas[0].state = "down"; },
       "warning: node B HCA port mlx5_0:1: state down, peers up"},
      {"name", Severity::kWarning, [](NodeDump* d) { d->rails[1].name = "ens2"; },
       "warning: node B rail ens2: rail 1 is ens2, peers eth1"},
      {"mtu", Severity::kError, [](NodeDump* d) { d->hcas[1].mtu = 1024; },
       "error: node B HCA port mlx5_1:1: MTU 1024, peers 4096"},
  };
  for (const auto& c : cases) {
    NodeDump b = node("B");
    c.change(&b);
    auto fs = cmp({node("A"), b});
    INFO(c.kind << "\n" << all_text(fs));
    REQUIRE(fs.size() == 1);
    CHECK(fs[0].kind == c.kind);
    CHECK(fs[0].severity == c.sev);
    CHECK(format_finding(fs[0]) == c.text);
  }
}

TEST_CASE("topology: unknown values are not compared") {
  NodeDump a = node("A"), b = node("B");
  b.rails[0].pfc = "unknown";
  b.rails[0].numa = -1;
  b.rails[0].mtu = 0;
  b.hcas[0].subnet = "";
  b.hcas[1].gid_type = "";
  CHECK(cmp({a, b}).empty());
}

TEST_CASE("topology: 3+ nodes, one differs: only that node is named") {
  NodeDump c = node("C");
  c.rails[0].mtu = 1500;
  c.hcas[1].gid_type = "RoCEv1";
  auto fs = cmp({node("A"), node("B"), c, node("D")});
  INFO(all_text(fs));
  REQUIRE(fs.size() == 2);
  for (const auto& f : fs) CHECK(f.node == "C");
  CHECK(format_finding(fs[0]) == "error: node C rail eth0: MTU 1500, peers 9000");
  CHECK(format_finding(fs[1]) ==
        "warning: node C HCA port mlx5_1:1: GID type RoCEv1, peers RoCEv2");
  CHECK(format_summary(4, fs) == "4 nodes, 1 error, 1 warning");
  std::string j = findings_to_json(named({node("A"), node("B"), c, node("D")}), fs);
  CHECK(j.find("\"errors\": 1") != std::string::npos);
  CHECK(j.find("\"warnings\": 1") != std::string::npos);
  CHECK(j.find("\"kind\": \"mtu\"") != std::string::npos);
}

TEST_CASE("topology: node labels fall back to the file name for duplicate hostnames") {
  auto l = node_labels({node("h"), node("h"), node("x")}, {"a.json", "b.json", "c.json"});
  CHECK(l == std::vector<std::string>{"a.json", "b.json", "x"});
}

TEST_CASE("topology: malformed dumps give a clear error naming the file and the field") {
  std::string good = to_json(node("A"));
  NodeDump d;
  std::string err;
  auto fails = [&](const std::string& text, const std::string& want) {
    err.clear();
    bool ok = from_json(text, "b.json", &d, &err);
    INFO("error: " << err);
    CHECK(!ok);
    CHECK(err.rfind("b.json: ", 0) == 0);
    CHECK(err.find(want) != std::string::npos);
  };
  fails("{not json", "not valid JSON");
  fails(good.substr(0, good.size() / 2), "not valid JSON (truncated or corrupt)");
  fails("[1,2]", "expected a JSON object");
  fails("{}", "missing field schema_version");
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    auto p = s.find(from);
    REQUIRE(p != std::string::npos);
    return s.replace(p, from.size(), to);
  };
  fails(edit("\"schema_version\": 1", "\"schema_version\": 99"),
        "schema_version: 99 is not supported");
  fails(edit("\"schema_version\": 1", "\"schema_version\": \"1\""),
        "field schema_version: expected an integer, got string");
  fails(edit("\"mtu\": 9000", "\"mtu\": \"9000\""), "field rails[0].mtu: expected an integer");
  fails(edit("\"hostname\": \"A\",", ""), "missing field hostname");
  fails(edit("\"rails\": [", "\"rails\": {\"x\": ["), "");  // invalid JSON or wrong type
  fails(edit("\"gid_type\": \"RoCEv2\",", ""), "missing field hcas[0].gid_type");
  fails(edit("\"hcas\": [", "\"hcas\": [1, "), "field hcas[0]: expected an object, got number");
  {
    std::string s = good;
    auto p = s.find("\"rails\": [");
    s = s.substr(0, p) + "\"rails\": 5, \"x\": [" + s.substr(p + 10);
    fails(s, "field rails: expected an array, got number");
  }
  fails(edit("\"numa\": 0", "\"numa\": 1.5"),
        "field rails[0].numa: expected an integer, got number");
  fails(edit("\"numa\": 0", "\"numa\": null"),
        "field rails[0].numa: expected an integer, got null");
  CHECK(from_json(good, "b.json", &d, &err));

  // Files: missing, empty, truncated.
  CHECK(!load_dump_file("/nonexistent/dump.json", &d, &err));
  CHECK(err.find("/nonexistent/dump.json: cannot read") == 0);
  std::string empty = write_temp("empty", "  \n");
  CHECK(!load_dump_file(empty, &d, &err));
  CHECK(err == empty + ": empty file (expected an r2ccl_topology_check --dump)");
  std::string trunc = write_temp("trunc", good.substr(0, 100));
  CHECK(!load_dump_file(trunc, &d, &err));
  CHECK(err.find(trunc + ": not valid JSON") == 0);
  std::string ok = write_temp("ok", good);
  CHECK(load_dump_file(ok, &d, &err));
  unlink(empty.c_str());
  unlink(trunc.c_str());
  unlink(ok.c_str());
}

TEST_CASE("topology: probing helpers") {
  CHECK(subnet_of("10.1.2.3", 24) == "10.1.2.0/24");
  CHECK(subnet_of("10.1.2.3", 31) == "10.1.2.2/31");
  CHECK(subnet_of("10.1.2.3", 0) == "0.0.0.0/0");
  CHECK(subnet_of("10.1.2.3", 33) == "");
  CHECK(subnet_of("fd00:1:2:3::7", 64) == "fd00:1:2:3::/64");
  CHECK(subnet_of("bogus", 24) == "");
  CHECK(pci_bus_of("/sys/devices/pci0000:00/0000:00:01.0/0000:0b:00.0") == "0000:0b:00.0");
  CHECK(pci_bus_of("") == "");
  CHECK(pci_bus_of("/sys/devices/virtual/net/veth0") == "");
  CHECK(ib_mtu_bytes(1) == 256);
  CHECK(ib_mtu_bytes(5) == 4096);
  CHECK(ib_mtu_bytes(0) == 0);
  CHECK(std::string(gid_type_name(2)) == "RoCEv2");
  CHECK(std::string(gid_type_name(0)) == "IB");
  CHECK(std::string(gid_type_name(7)).empty());
}

TEST_CASE("topology: negative values, directories and huge files are refused") {
  std::string good = to_json(node("A"));
  NodeDump d;
  std::string err;
  std::string bad = good;
  const auto p = bad.find("\"mtu\": ");
  REQUIRE(p != std::string::npos);
  bad.replace(p, std::string("\"mtu\": ").size(), "\"mtu\": -5, \"was\": ");
  CHECK_FALSE(from_json(bad, "neg.json", &d, &err));
  CHECK(err.find("negative") != std::string::npos);
  err.clear();
  CHECK_FALSE(load_dump_file("/tmp", &d, &err));
  CHECK(err.find("not a regular file") != std::string::npos);
  const std::string big = write_temp("big", std::string((16u << 20) + 10, ' '));
  err.clear();
  CHECK_FALSE(load_dump_file(big, &d, &err));
  CHECK(err.find("larger than 16 MiB") != std::string::npos);
  unlink(big.c_str());
}
