// The pure parts of HCA handling: R2CCL_IB_HCA parsing and matching, GID preferences and
// selection over made-up GID tables, IB speed encodings, PCI distance, backup-rail order,
// the banner line. Discovery through verbs is tested against the fake verbs provider.
#include <arpa/inet.h>
#include <endian.h>
#include <infiniband/verbs.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "transport/ib/devices.h"

using Catch::Matchers::Contains;
using namespace r2ccl::net::ib;

namespace {

HcaSpec spec(const std::string& s) {
  HcaSpec out;
  std::string err;
  INFO(s);
  REQUIRE(parse_hca_spec(s, &out, &err));
  return out;
}

std::string spec_err(const std::string& s) {
  HcaSpec out;
  std::string err;
  INFO(s);
  CHECK_FALSE(parse_hca_spec(s, &out, &err));
  return err;
}

GidEntry gid(int index, const char* text, int type) {
  GidEntry e;
  e.index = index;
  e.type = type;
  std::memset(e.raw, 0, 16);
  if (text) {
    in_addr a4;
    if (inet_pton(AF_INET, text, &a4) == 1) {
      e.raw[10] = 0xff;
      e.raw[11] = 0xff;
      std::memcpy(e.raw + 12, &a4, 4);
    } else {
      REQUIRE(inet_pton(AF_INET6, text, e.raw) == 1);
    }
  }
  return e;
}

GidPrefs prefs(int version = 2, const char* family = "AF_INET", const char* range = "",
               int forced = -1) {
  r2ccl::Config c;
  c.ib_gid_index = forced;
  c.ib_roce_version = version;
  c.ib_addr_family = family;
  c.ib_addr_range = range;
  GidPrefs p;
  std::string err;
  INFO(range);
  REQUIRE(parse_gid_prefs(c, &p, &err));
  return p;
}

std::string prefs_err(int version, const char* family, const char* range, int forced = -1) {
  r2ccl::Config c;
  c.ib_gid_index = forced;
  c.ib_roce_version = version;
  c.ib_addr_family = family;
  c.ib_addr_range = range;
  GidPrefs p;
  std::string err;
  CHECK_FALSE(parse_gid_prefs(c, &p, &err));
  return err;
}

HcaInfo hca(const char* name, const char* pci, int numa) {
  HcaInfo h;
  h.name = name;
  h.port = 1;
  h.pci_path = pci;
  h.numa = numa;
  return h;
}

}  // namespace

// ---------------------------------------------------------------------------------------
TEST_CASE("hca spec: empty selects everything") {
  for (const char* s : {"", "^", "=", "^="}) {
    HcaSpec sp = spec(s);
    CHECK(sp.entries.empty());
    CHECK(hca_spec_selects(sp, "mlx5_0", 1));
    CHECK(hca_spec_selects(sp, "rxe0", 2));
  }
}

TEST_CASE("hca spec: prefixes, ports, exact, exclude") {
  HcaSpec p = spec("mlx5");
  CHECK_FALSE(p.exclude);
  CHECK_FALSE(p.exact);
  REQUIRE(p.entries.size() == 1);
  CHECK(p.entries[0].port == -1);
  CHECK(hca_spec_selects(p, "mlx5_0", 1));
  CHECK(hca_spec_selects(p, "mlx5_11", 2));
  CHECK_FALSE(hca_spec_selects(p, "mlx4_0", 1));
  CHECK_FALSE(hca_spec_selects(p, "mlx", 1));

  HcaSpec ports = spec("mlx5_0:1,mlx5_1");
  REQUIRE(ports.entries.size() == 2);
  CHECK(ports.entries[0].name == "mlx5_0");
  CHECK(ports.entries[0].port == 1);
  CHECK(hca_spec_selects(ports, "mlx5_0", 1));
  CHECK_FALSE(hca_spec_selects(ports, "mlx5_0", 2));
  CHECK(hca_spec_selects(ports, "mlx5_1", 2));
  CHECK(hca_spec_selects(ports, "mlx5_10", 1));  // prefix of mlx5_1
  CHECK_FALSE(hca_spec_selects(ports, "mlx5_2", 1));

  HcaSpec exact = spec("=mlx5_1,mlx5_2:2");
  CHECK(exact.exact);
  CHECK(hca_spec_selects(exact, "mlx5_1", 1));
  CHECK_FALSE(hca_spec_selects(exact, "mlx5_10", 1));
  CHECK(hca_spec_selects(exact, "mlx5_2", 2));
  CHECK_FALSE(hca_spec_selects(exact, "mlx5_2", 1));

  HcaSpec excl = spec("^mlx5_0:1,mlx4");
  CHECK(excl.exclude);
  CHECK_FALSE(excl.exact);
  CHECK_FALSE(hca_spec_selects(excl, "mlx5_0", 1));
  CHECK(hca_spec_selects(excl, "mlx5_0", 2));
  CHECK_FALSE(hca_spec_selects(excl, "mlx4_3", 1));
  CHECK(hca_spec_selects(excl, "mlx5_1", 1));

  HcaSpec exex = spec("^=mlx5_1");
  CHECK(exex.exclude);
  CHECK(exex.exact);
  CHECK_FALSE(hca_spec_selects(exex, "mlx5_1", 1));
  CHECK(hca_spec_selects(exex, "mlx5_10", 1));

  HcaSpec gaps = spec("mlx5_0,,mlx5_1,");
  CHECK(gaps.entries.size() == 2);
  CHECK(spec("mlx5_0:255").entries[0].port == 255);
}

TEST_CASE("hca spec: errors name the variable and the form") {
  std::string e = spec_err("mlx5_0:x");
  CHECK_THAT(e, Contains("R2CCL_IB_HCA"));
  CHECK_THAT(e, Contains("bad port 'x'"));
  CHECK_THAT(e, Contains("NAME[:PORT]"));
  CHECK_THAT(spec_err("mlx5_0:"), Contains("bad port ''"));
  CHECK_THAT(spec_err("mlx5_0:0"), Contains("bad port '0'"));
  CHECK_THAT(spec_err("mlx5_0:256"), Contains("bad port"));
  CHECK_THAT(spec_err("mlx5_0:1:2"), Contains("bad port"));
  CHECK_THAT(spec_err("mlx5_0:-1"), Contains("bad port"));
  CHECK_THAT(spec_err(":1"), Contains("empty device name"));
  CHECK_THAT(spec_err("=^mlx5"), Contains("may only start"));
  CHECK_THAT(spec_err("mlx5_0,^mlx5_1"), Contains("may only start"));
}

// ---------------------------------------------------------------------------------------
TEST_CASE("gid prefs: parsing") {
  GidPrefs d = prefs();
  CHECK(d.forced_index == -1);
  CHECK(d.roce_version == 2);
  CHECK(d.family == AF_INET);
  CHECK_FALSE(d.has_range);

  CHECK(prefs(2, "").family == AF_INET);  // unset in a default-constructed Config
  CHECK(prefs(1, "AF_INET6").family == AF_INET6);
  CHECK(prefs(1, "AF_INET6").roce_version == 1);
  CHECK(prefs(2, "AF_INET", "", 3).forced_index == 3);

  GidPrefs r4 = prefs(2, "AF_INET", "10.1.0.0/16");
  CHECK(r4.has_range);
  CHECK(r4.range_family == AF_INET);
  CHECK(r4.range_prefix == 16);
  CHECK(gid_to_string(r4.range_addr) == "::ffff:10.1.0.0");

  GidPrefs r6 = prefs(2, "AF_INET6", "fd00:1::/64");
  CHECK(r6.range_family == AF_INET6);
  CHECK(r6.range_prefix == 64);
  CHECK(gid_to_string(r6.range_addr) == "fd00:1::");
  CHECK(prefs(2, "AF_INET", "0.0.0.0/0").range_prefix == 0);
  CHECK(prefs(2, "AF_INET6", "::/128").range_prefix == 128);
}

TEST_CASE("gid prefs: errors name the variable and the accepted form") {
  std::string e = prefs_err(2, "inet", "");
  CHECK_THAT(e, Contains("R2CCL_IB_ADDR_FAMILY"));
  CHECK_THAT(e, Contains("AF_INET or AF_INET6"));
  CHECK_THAT(prefs_err(2, "af_inet6", ""), Contains("R2CCL_IB_ADDR_FAMILY"));
  for (const char* bad : {"10.1.0.0", "10.1.0.0/33", "10.1.0.0/", "10.1.0.0/x", "10.1.0/16",
                          "fd00::/129", "fd00::/-1", "host/8", "/8", "10.1.0.0/16/2"}) {
    INFO(bad);
    std::string m = prefs_err(2, "AF_INET", bad);
    CHECK_THAT(m, Contains("R2CCL_IB_ADDR_RANGE"));
    CHECK_THAT(m, Contains("ADDR/PREFIX"));
  }
  CHECK_THAT(prefs_err(3, "AF_INET", ""), Contains("R2CCL_IB_ROCE_VERSION_NUM"));
  CHECK_THAT(prefs_err(2, "AF_INET", "", -2), Contains("R2CCL_IB_GID_INDEX"));
}

// ---------------------------------------------------------------------------------------
TEST_CASE("gid selection: typical RoCE table") {
  // What a mlx5 RoCE port shows with one IPv4 and one global IPv6 address.
  std::vector<GidEntry> t = {
      gid(0, "fe80::a288:c2ff:fe10:2030", kGidTypeRoceV1),
      gid(1, "fe80::a288:c2ff:fe10:2030", kGidTypeRoceV2),
      gid(2, "10.1.0.1", kGidTypeRoceV1),
      gid(3, "10.1.0.1", kGidTypeRoceV2),
      gid(4, "2001:db8::1", kGidTypeRoceV1),
      gid(5, "2001:db8::1", kGidTypeRoceV2),
      gid(6, nullptr, kGidTypeRoceV1),  // empty slot
  };
  CHECK(select_gid(t, prefs()) == 3);
  CHECK(select_gid(t, prefs(1)) == 2);
  CHECK(select_gid(t, prefs(2, "AF_INET6")) == 5);
  CHECK(select_gid(t, prefs(1, "AF_INET6")) == 4);

  SECTION("forced index wins") {
    CHECK(select_gid(t, prefs(2, "AF_INET", "", 0)) == 0);
    CHECK(select_gid(t, prefs(2, "AF_INET", "", 4)) == 4);
    CHECK(select_gid(t, prefs(2, "AF_INET", "192.168.0.0/16", 2)) == 2);  // nothing else checked
  }
  SECTION("forced index missing or empty: automatic selection") {
    CHECK(select_gid(t, prefs(2, "AF_INET", "", 6)) == 3);
    CHECK(select_gid(t, prefs(2, "AF_INET", "", 99)) == 3);
  }
  SECTION("range is a filter") {
    CHECK(select_gid(t, prefs(2, "AF_INET", "10.1.0.0/16")) == 3);
    CHECK(select_gid(t, prefs(2, "AF_INET", "10.2.0.0/16")) == -1);
    CHECK(select_gid(t, prefs(2, "AF_INET", "2001:db8::/32")) == 5);  // range beats family
    CHECK(select_gid(t, prefs(1, "AF_INET6", "10.0.0.0/8")) == 2);
    CHECK(select_gid(t, prefs(2, "AF_INET", "fe80::/10")) == 1);  // link-local asked for
    CHECK(select_gid(t, prefs(2, "AF_INET", "10.1.0.1/32")) == 3);
    CHECK(select_gid(t, prefs(2, "AF_INET", "10.1.0.0/31")) == 3);
    CHECK(select_gid(t, prefs(2, "AF_INET", "10.1.0.2/31")) == -1);
    CHECK(select_gid(t, prefs(2, "AF_INET", "0.0.0.0/0")) == 3);       // any IPv4
    CHECK(select_gid(t, prefs(2, "AF_INET6", "::ffff:0:0/96")) == 3);  // v6 form of any IPv4
  }
}

TEST_CASE("gid selection: the port's own netdev before VLAN netdevs, whatever the order") {
  // A big mlx5 table: VLAN netdevs' GIDs may sit below the port's own (they are added as
  // addresses appear). Two hosts must not end on different VLANs.
  auto vlan = [](GidEntry e) {
    e.other_netdev = true;
    return e;
  };
  std::vector<GidEntry> t = {
      gid(0, "fe80::a288:c2ff:fe10:2030", kGidTypeRoceV1),
      gid(1, "fe80::a288:c2ff:fe10:2030", kGidTypeRoceV2),
      vlan(gid(2, "fe80::a288:c2ff:fe10:2031", kGidTypeRoceV2)),
      vlan(gid(3, "10.100.0.1", kGidTypeRoceV1)),
      vlan(gid(4, "10.100.0.1", kGidTypeRoceV2)),
      vlan(gid(5, "2001:db8:100::1", kGidTypeRoceV2)),
      gid(6, "2001:db8::1", kGidTypeRoceV1),
      gid(7, "2001:db8::1", kGidTypeRoceV2),
      gid(8, "10.1.0.1", kGidTypeRoceV1),
      gid(9, "10.1.0.1", kGidTypeRoceV2),
  };
  CHECK(select_gid(t, prefs()) == 9);
  CHECK(select_gid(t, prefs(2, "AF_INET6")) == 7);
  CHECK(select_gid(t, prefs(1)) == 8);
  // The version still comes first: a v2 GID on a VLAN beats v1 on the port's netdev.
  std::vector<GidEntry> v1own = {t[0], t[1], t[3], t[4], t[8]};
  CHECK(select_gid(v1own, prefs()) == 4);
  // A range picks the VLAN; so does the forced index.
  CHECK(select_gid(t, prefs(2, "AF_INET", "10.100.0.0/16")) == 4);
  CHECK(select_gid(t, prefs(2, "AF_INET6", "2001:db8:100::/48")) == 5);
  CHECK(select_gid(t, prefs(2, "AF_INET", "", 3)) == 3);
  // Only VLAN GIDs (the port's own netdev has no address): one of them.
  std::vector<GidEntry> only_vlan = {t[0], t[1], t[3], t[4]};
  CHECK(select_gid(only_vlan, prefs()) == 4);
}

TEST_CASE("P_Key preference and lookup") {
  auto pref = [](const char* v, bool from_nccl, PkeyPref* out) {
    r2ccl::Config c;
    c.ib_pkey = v;
    if (from_nccl) c.sources.push_back("R2CCL_IB_PKEY from NCCL_IB_PKEY");
    std::string err;
    const bool ok = parse_pkey_pref(c, out, &err);
    return ok ? std::string() : err;
  };
  PkeyPref p;
  CHECK(pref("", false, &p).empty());
  CHECK(p.kind == PkeyPref::kDefault);
  CHECK(pref("0x8001", false, &p).empty());
  CHECK(p.kind == PkeyPref::kValue);
  CHECK(p.value == 0x8001);
  CHECK(pref("32769", false, &p).empty());
  CHECK(p.value == 0x8001);
  CHECK(pref("1", true, &p).empty());
  CHECK(p.kind == PkeyPref::kIndex);
  CHECK(p.value == 1);
  CHECK_THAT(pref("0x8000", false, &p), Contains("R2CCL_IB_PKEY='0x8000'"));
  CHECK_THAT(pref("0x10000", false, &p), Contains("0x0001..0xffff"));
  CHECK_THAT(pref("x", false, &p), Contains("R2CCL_IB_PKEY='x'"));
  CHECK_THAT(pref("-1", true, &p), Contains("NCCL_IB_PKEY='-1'"));
  CHECK_THAT(pref("70000", true, &p), Contains("a P_Key index 0..65535"));

  const std::vector<uint16_t> table = {0x7fff, 0x0001, 0x8001, 0x8002};
  CHECK(find_pkey_index(table, 0x8001) == 2);  // the exact value first
  CHECK(find_pkey_index(table, 0x0001) == 1);
  CHECK(find_pkey_index(table, 0xffff) == 0);  // same partition, other membership
  CHECK(find_pkey_index(table, 0x0002) == 3);
  CHECK(find_pkey_index(table, 0x8003) == -1);
  CHECK(pkey_table_text(table) == "(0x7fff, 0x0001, 0x8001, 0x8002)");
}

TEST_CASE("gid selection: version fallback") {
  std::vector<GidEntry> v1only = {
      gid(0, "fe80::1", kGidTypeRoceV1),
      gid(1, "10.1.0.1", kGidTypeRoceV1),
  };
  CHECK(select_gid(v1only, prefs(2)) == 1);
  std::vector<GidEntry> v2only = {
      gid(0, "fe80::1", kGidTypeRoceV2),
      gid(1, "2001:db8::7", kGidTypeRoceV2),
      gid(2, "10.1.0.1", kGidTypeRoceV2),
  };
  CHECK(select_gid(v2only, prefs(1)) == 2);
  CHECK(select_gid(v2only, prefs(1, "AF_INET6")) == 1);
  // Version outranks family: a v2 IPv6 GID beats a v1 IPv4 GID when v2 is asked for.
  std::vector<GidEntry> mix = {
      gid(0, "fe80::1", kGidTypeRoceV1),
      gid(1, "10.1.0.1", kGidTypeRoceV1),
      gid(2, "2001:db8::7", kGidTypeRoceV2),
  };
  CHECK(select_gid(mix, prefs(2)) == 2);
  CHECK(select_gid(mix, prefs(1, "AF_INET6")) == 1);
}

TEST_CASE("gid selection: link-local only when nothing else") {
  std::vector<GidEntry> ll = {
      gid(0, "fe80::a288:c2ff:fe10:2030", kGidTypeRoceV1),
      gid(1, "fe80::a288:c2ff:fe10:2030", kGidTypeRoceV2),
  };
  CHECK(select_gid(ll, prefs(2)) == 1);
  CHECK(select_gid(ll, prefs(1)) == 0);
  CHECK(select_gid(ll, prefs(2, "AF_INET6")) == 1);
  // Link-local is avoided even at the cost of the requested version.
  std::vector<GidEntry> t = {
      gid(0, "fe80::1", kGidTypeRoceV1),
      gid(1, "fe80::1", kGidTypeRoceV2),
      gid(2, "10.1.0.1", kGidTypeRoceV1),
  };
  CHECK(select_gid(t, prefs(2)) == 2);
  // febf:: is still fe80::/10, fec0:: is not.
  std::vector<GidEntry> edge = {gid(0, "febf::1", kGidTypeRoceV2),
                                gid(1, "fec0::1", kGidTypeRoceV2)};
  CHECK(select_gid(edge, prefs(2, "AF_INET6")) == 1);
}

TEST_CASE("gid selection: lowest index breaks ties, empty tables") {
  std::vector<GidEntry> t = {
      gid(7, "10.1.0.2", kGidTypeRoceV2),
      gid(3, "10.1.0.1", kGidTypeRoceV2),
  };
  CHECK(select_gid(t, prefs()) == 3);
  CHECK(select_gid({}, prefs()) == -1);
  CHECK(select_gid({gid(0, nullptr, kGidTypeRoceV2)}, prefs()) == -1);
  CHECK(select_gid({gid(0, nullptr, kGidTypeRoceV2)}, prefs(2, "AF_INET", "", 0)) == -1);
}

TEST_CASE("gid_to_string") {
  CHECK(gid_to_string(gid(0, "10.1.0.1", 2).raw) == "::ffff:10.1.0.1");
  CHECK(gid_to_string(gid(0, "fe80::248a:703:49:d4f0", 2).raw) == "fe80::248a:703:49:d4f0");
  CHECK(gid_to_string(gid(0, nullptr, 2).raw) == "::");
}

// ---------------------------------------------------------------------------------------
TEST_CASE("port speeds (IB PortInfo encodings)") {
  CHECK(port_speed_mbps(1, 1) == 2500);      // SDR 1x
  CHECK(port_speed_mbps(1, 2) == 10000);     // SDR 4x
  CHECK(port_speed_mbps(2, 2) == 20000);     // DDR 4x
  CHECK(port_speed_mbps(4, 2) == 40000);     // QDR 4x
  CHECK(port_speed_mbps(8, 2) == 40000);     // FDR10 4x
  CHECK(port_speed_mbps(16, 2) == 56000);    // FDR 4x
  CHECK(port_speed_mbps(32, 2) == 100000);   // EDR 4x
  CHECK(port_speed_mbps(32, 1) == 25000);    // EDR 1x (25GbE)
  CHECK(port_speed_mbps(64, 2) == 200000);   // HDR 4x
  CHECK(port_speed_mbps(64, 16) == 100000);  // HDR 2x
  CHECK(port_speed_mbps(128, 2) == 400000);  // NDR 4x
  CHECK(port_speed_mbps(128, 4) == 800000);  // NDR 8x
  CHECK(port_speed_mbps(4, 8) == 120000);    // QDR 12x
  CHECK(port_speed_mbps(256, 2) == 800000);  // XDR 4x (extended field only)
  CHECK(port_speed_mbps(0, 2) == 0);
  CHECK(port_speed_mbps(3, 2) == 0);
  CHECK(port_speed_mbps(32, 0) == 0);
  CHECK(port_speed_mbps(32, 3) == 0);
  uint8_t classic = 32;
  CHECK(port_speed_mbps(classic, 2) == 100000);
}

// ---------------------------------------------------------------------------------------
TEST_CASE("pci distance") {
  const std::string root0 = "/sys/devices/pci0000:00";
  const std::string nic_a = root0 + "/0000:00:01.0/0000:0b:00.0";
  const std::string nic_a1 = root0 + "/0000:00:01.0/0000:0b:00.1";
  const std::string sw = root0 + "/0000:00:03.0/0000:10:00.0";  // switch upstream port
  const std::string sw_a = sw + "/0000:11:01.0/0000:12:00.0";
  const std::string sw_b = sw + "/0000:11:02.0/0000:13:00.0";
  const std::string other_port = root0 + "/0000:00:02.0/0000:0c:00.0";
  const std::string root1 = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0";

  CHECK(pci_distance(nic_a, nic_a) == 0);
  CHECK(pci_distance(nic_a + "/", nic_a) == 0);
  CHECK(pci_distance(nic_a, nic_a1) == 1);      // two functions of one card
  CHECK(pci_distance(sw_a, sw_b) == 1);         // same switch, different downstream ports
  CHECK(pci_distance(nic_a, other_port) == 2);  // same root complex only
  CHECK(pci_distance(nic_a, sw_a) == 2);
  CHECK(pci_distance(nic_a, root1) == 3);  // different root complexes
  CHECK(pci_distance(nic_a, "") == 3);
  CHECK(pci_distance("", "") == 3);
  CHECK(pci_distance(nic_a, "/sys/devices/virtual/net/rxe0") == 3);
  // Devices directly on the root bus (VMs): functions of one device, or separate devices.
  CHECK(pci_distance(root0 + "/0000:00:05.0", root0 + "/0000:00:05.1") == 1);
  CHECK(pci_distance(root0 + "/0000:00:05.0", root0 + "/0000:00:06.0") == 2);
  CHECK(pci_distance(root0 + "/0000:00:05.0", nic_a) == 2);
}

TEST_CASE("backup order: same switch, then same NUMA, then the rest") {
  const std::string sw = "/sys/devices/pci0000:00/0000:00:03.0/0000:10:00.0";
  std::vector<HcaInfo> h = {
      hca("mlx5_0", (sw + "/0000:11:01.0/0000:12:00.0").c_str(), 0),          // primary
      hca("mlx5_1", "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0", 1),  // other socket
      hca("mlx5_2", "/sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0", 0),  // same NUMA
      hca("mlx5_3", (sw + "/0000:11:02.0/0000:13:00.0").c_str(), 0),          // same switch
      hca("mlx5_4", "/sys/devices/pci0000:c0/0000:c0:01.0/0000:c1:00.0", 1),  // other socket
      hca("mlx5_5", "/sys/devices/pci0000:00/0000:00:01.0/0000:0b:00.0", 0),  // same root
  };
  CHECK(backup_order(h, 0) == std::vector<int>{3, 5, 2, 1, 4});
  CHECK(backup_order(h, 1) == std::vector<int>{4, 0, 2, 3, 5});

  SECTION("second port of the primary's card comes first") {
    h.push_back(h[0]);
    h.back().port = 2;
    CHECK(backup_order(h, 0) == std::vector<int>{6, 3, 5, 2, 1, 4});
  }
  SECTION("unknown topology: by index") {
    std::vector<HcaInfo> v = {hca("rxe0", "", -1), hca("rxe1", "", -1), hca("rxe2", "", -1)};
    CHECK(backup_order(v, 1) == std::vector<int>{0, 2});
    CHECK(backup_order(v, 0) == std::vector<int>{1, 2});
  }
  CHECK(backup_order({h[0]}, 0).empty());
}

TEST_CASE("describe") {
  HcaInfo r = hca("mlx5_0", "", 0);
  r.link_layer = IBV_LINK_LAYER_ETHERNET;
  r.active = true;
  r.gid_index = 3;
  r.gid_type = kGidTypeRoceV2;
  std::memcpy(r.gid, gid(3, "10.1.0.1", 2).raw, 16);
  r.speed_mbps = 100000;
  CHECK(describe(r) == "mlx5_0:1 RoCEv2 gid[3]=::ffff:10.1.0.1 100000 Mbps numa 0");

  HcaInfo ib = hca("mlx5_1", "", 1);
  ib.link_layer = IBV_LINK_LAYER_INFINIBAND;
  ib.lid = 7;
  ib.gid_index = 0;
  ib.gid_type = kGidTypeIb;
  std::memcpy(ib.gid, gid(0, "fe80::248a:703:49:d4f0", 0).raw, 16);
  ib.speed_mbps = 200000;
  ib.active = false;
  CHECK(describe(ib) ==
        "mlx5_1:1 IB lid 7 gid[0]=fe80::248a:703:49:d4f0 200000 Mbps numa 1 (down)");

  r.gid_index = -1;
  CHECK_THAT(describe(r), Contains("no usable GID"));
}

// ---------------------------------------------------------------------------------------
// HcaSet::discover over a minimal in-test verbs table and a made-up sysfs tree (the full
// provider is tests/fakeverbs). Devices: mlx5_1 (IB, 2 ports, no PCI device: virtual) and
// mlx5_0 (RoCE, 1 port, PCI function with numa_node 1), listed out of order.
namespace {

struct StubPort {
  ibv_port_attr attr;
  std::vector<GidEntry> gids;  // by index; type used by query_gid_ex
};
struct StubDev {
  ibv_device dev;
  ibv_context ctx;
  ibv_pd pd;
  std::vector<StubPort> ports;
  bool open = false;
  bool pd_alloc = false;
};
std::vector<std::unique_ptr<StubDev>>* g_devs;

StubDev* by_ctx(ibv_context* c) {
  for (auto& d : *g_devs)
    if (&d->ctx == c) return d.get();
  return nullptr;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text << "\n";
}

void mkdirs(const std::string& path) {
  for (size_t i = 0; i <= path.size(); i++) {
    if (i == path.size() || (path[i] == '/' && i > 0)) {
      ::mkdir(path.substr(0, i).c_str(), 0755);
    }
  }
}

VerbsApi stub_api(bool with_gid_ex) {
  VerbsApi v{};
  v.get_device_list = [](int* n) -> ibv_device** {
    auto** l = new ibv_device*[g_devs->size() + 1];
    for (size_t i = 0; i < g_devs->size(); i++) l[i] = &(*g_devs)[i]->dev;
    l[g_devs->size()] = nullptr;
    *n = static_cast<int>(g_devs->size());
    return l;
  };
  v.free_device_list = [](ibv_device** l) { delete[] l; };
  v.get_device_name = [](ibv_device* d) -> const char* { return d->name; };
  v.get_device_guid = [](ibv_device*) -> __be64 { return htobe64(0x0102030405060708ull); };
  v.open_device = [](ibv_device* d) -> ibv_context* {
    for (auto& s : *g_devs)
      if (&s->dev == d) {
        s->open = true;
        return &s->ctx;
      }
    return nullptr;
  };
  v.close_device = [](ibv_context* c) -> int {
    by_ctx(c)->open = false;
    return 0;
  };
  v.query_device = [](ibv_context* c, ibv_device_attr* a) -> int {
    std::memset(a, 0, sizeof(*a));
    a->phys_port_cnt = static_cast<uint8_t>(by_ctx(c)->ports.size());
    return 0;
  };
  v.query_port_compat = [](ibv_context* c, uint8_t port, ibv_port_attr* a) -> int {
    StubDev* d = by_ctx(c);
    if (port < 1 || port > d->ports.size()) return EINVAL;
    *a = d->ports[port - 1].attr;
    return 0;
  };
  v.query_gid = [](ibv_context* c, uint8_t port, int index, ibv_gid* g) -> int {
    StubDev* d = by_ctx(c);
    const auto& t = d->ports[port - 1].gids;
    if (index < 0 || index >= static_cast<int>(t.size())) return EINVAL;
    std::memcpy(g->raw, t[index].raw, 16);
    return 0;
  };
  if (with_gid_ex) {
    v.query_gid_ex = [](ibv_context* c, uint32_t port, uint32_t index, ibv_gid_entry* e, uint32_t,
                        size_t) -> int {
      StubDev* d = by_ctx(c);
      const auto& t = d->ports[port - 1].gids;
      if (index >= t.size()) return EINVAL;
      bool empty = true;
      for (uint8_t b : t[index].raw) empty = empty && b == 0;
      if (empty) return ENODATA;
      std::memcpy(e->gid.raw, t[index].raw, 16);
      e->gid_index = index;
      e->port_num = port;
      e->gid_type = t[index].type == kGidTypeRoceV2 ? IBV_GID_TYPE_ROCE_V2 : IBV_GID_TYPE_IB;
      return 0;
    };
  }
  v.alloc_pd = [](ibv_context* c) -> ibv_pd* {
    StubDev* d = by_ctx(c);
    d->pd_alloc = true;
    return &d->pd;
  };
  v.dealloc_pd = [](ibv_pd* pd) -> int {
    for (auto& s : *g_devs)
      if (&s->pd == pd) s->pd_alloc = false;
    return 0;
  };
  return v;
}

ibv_port_attr port_attr(int ll, bool active, uint8_t speed, uint8_t width, int gid_len) {
  ibv_port_attr a;
  std::memset(&a, 0, sizeof(a));
  a.link_layer = static_cast<uint8_t>(ll);
  a.state = active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  a.active_speed = speed;
  a.active_width = width;
  a.gid_tbl_len = gid_len;
  a.active_mtu = IBV_MTU_4096;
  a.lid = active ? 7 : 0;
  return a;
}

}  // namespace

TEST_CASE("discover: stub verbs and sysfs") {
  char tmpl[] = "/tmp/r2ccl_ibdev.XXXXXX";
  REQUIRE(mkdtemp(tmpl));
  const std::string root = tmpl;
  const std::string pci = root + "/sys/devices/pci0000:00/0000:00:01.0/0000:0b:00.0";
  mkdirs(pci);
  write_file(pci + "/numa_node", "1");
  const std::string dev0 = root + "/class/infiniband/mlx5_0";
  const std::string dev1 = root + "/class/infiniband/mlx5_1";
  mkdirs(dev0 + "/ports/1/gid_attrs/types");
  mkdirs(dev1);
  REQUIRE(::symlink(pci.c_str(), (dev0 + "/device").c_str()) == 0);
  write_file(dev0 + "/ports/1/gid_attrs/types/0", "IB/RoCE v1");
  write_file(dev0 + "/ports/1/gid_attrs/types/1", "RoCE v2");
  write_file(dev0 + "/ports/1/gid_attrs/types/2", "IB/RoCE v1");
  write_file(dev0 + "/ports/1/gid_attrs/types/3", "RoCE v2");

  std::vector<std::unique_ptr<StubDev>> devs;
  g_devs = &devs;
  auto add = [&](const char* name, const std::string& path) {
    devs.push_back(std::make_unique<StubDev>());
    StubDev* d = devs.back().get();
    std::memset(&d->dev, 0, sizeof(d->dev));
    std::memset(&d->ctx, 0, sizeof(d->ctx));
    std::memset(&d->pd, 0, sizeof(d->pd));
    std::snprintf(d->dev.name, sizeof(d->dev.name), "%s", name);
    std::snprintf(d->dev.ibdev_path, sizeof(d->dev.ibdev_path), "%s", path.c_str());
    return d;
  };
  StubDev* ib = add("mlx5_1", dev1);
  ib->ports.push_back({port_attr(IBV_LINK_LAYER_INFINIBAND, true, 64, 2, 1),
                       {gid(0, "fe80::248a:703:49:d4f0", kGidTypeIb)}});
  ib->ports.push_back({port_attr(IBV_LINK_LAYER_UNSPECIFIED, false, 0, 0, 1),
                       {gid(0, "fe80::248a:703:49:d4f1", kGidTypeIb)}});
  StubDev* roce = add("mlx5_0", dev0);
  roce->ports.push_back({port_attr(IBV_LINK_LAYER_ETHERNET, true, 32, 2, 4),
                         {gid(0, "fe80::1", kGidTypeRoceV1), gid(1, "fe80::1", kGidTypeRoceV2),
                          gid(2, nullptr, kGidTypeRoceV1), gid(3, nullptr, kGidTypeRoceV2)}});

  for (bool gid_ex : {false, true}) {
    INFO("query_gid_ex " << gid_ex);
    VerbsApi v = stub_api(gid_ex);
    r2ccl::Config cfg;
    cfg.ib_gid_index = -1;
    cfg.ib_roce_version = 2;
    cfg.ib_addr_family = "AF_INET";
    std::unique_ptr<HcaSet> set;
    std::string err;
    REQUIRE(HcaSet::discover(&v, cfg, &set, &err));
    const auto& h = set->hcas();
    REQUIRE(h.size() == 3);
    CHECK(set->any_active());

    CHECK(h[0].name == "mlx5_0");  // sorted by name
    CHECK(h[0].port == 1);
    CHECK(h[0].link_layer == IBV_LINK_LAYER_ETHERNET);
    CHECK(h[0].active);
    CHECK(h[0].speed_mbps == 100000);
    CHECK(h[0].numa == 1);
    CHECK(h[0].pci_path == pci);
    CHECK(h[0].guid == 0x0102030405060708ull);
    CHECK(h[0].active_mtu == IBV_MTU_4096);
    CHECK(h[0].gid_index == 1);  // only link-local GIDs so far: the v2 one
    CHECK(h[0].gid_type == kGidTypeRoceV2);
    CHECK(h[0].ctx == &roce->ctx);
    CHECK(h[0].pd == &roce->pd);

    CHECK(h[1].name == "mlx5_1");
    CHECK(h[1].port == 1);
    CHECK(h[1].link_layer == IBV_LINK_LAYER_INFINIBAND);
    CHECK(h[1].lid == 7);
    CHECK(h[1].gid_index == 0);
    CHECK(h[1].gid_type == kGidTypeIb);
    CHECK(gid_to_string(h[1].gid) == "fe80::248a:703:49:d4f0");
    CHECK(h[1].speed_mbps == 200000);
    CHECK(h[1].pci_path.empty());
    CHECK(h[1].numa == -1);
    CHECK(h[2].port == 2);
    CHECK(h[2].link_layer == IBV_LINK_LAYER_INFINIBAND);  // UNSPECIFIED counts as IB
    CHECK_FALSE(h[2].active);
    CHECK(h[2].speed_mbps == 10000);
    CHECK(h[1].pd == h[2].pd);

    // An IPv4 address appears on the RoCE port: GID_CHANGE, refresh picks it.
    roce->ports[0].gids[2] = gid(2, "10.1.0.1", kGidTypeRoceV1);
    roce->ports[0].gids[3] = gid(3, "10.1.0.1", kGidTypeRoceV2);
    bool active = false;
    CHECK(set->refresh_port(0, &active));
    CHECK(active);
    CHECK(set->hcas()[0].gid_index == 3);
    CHECK(set->hcas()[0].gid_type == kGidTypeRoceV2);
    CHECK(describe(set->hcas()[0]) == "mlx5_0:1 RoCEv2 gid[3]=::ffff:10.1.0.1 100000 Mbps numa 1");
    CHECK_FALSE(set->refresh_port(0, &active));  // nothing changed
    // Port 2 of the IB HCA comes up.
    ib->ports[1].attr = port_attr(IBV_LINK_LAYER_INFINIBAND, true, 64, 2, 1);
    CHECK_FALSE(set->refresh_port(2, &active));
    CHECK(active);
    CHECK(set->hcas()[2].speed_mbps == 200000);
    roce->ports[0].gids[2] = gid(2, nullptr, kGidTypeRoceV1);
    roce->ports[0].gids[3] = gid(3, nullptr, kGidTypeRoceV2);
    ib->ports[1].attr = port_attr(IBV_LINK_LAYER_UNSPECIFIED, false, 0, 0, 1);
    set.reset();
    for (auto& d : devs) {
      CHECK_FALSE(d->open);
      CHECK_FALSE(d->pd_alloc);
    }
  }

  SECTION("spec, speed override, forced GID index") {
    VerbsApi v = stub_api(false);
    r2ccl::Config cfg;
    cfg.ib_roce_version = 2;
    cfg.ib_gid_index = 0;
    cfg.ib_hca = "=mlx5_1:2,mlx5_0";
    cfg.speed_mbps = 25000;
    std::unique_ptr<HcaSet> set;
    std::string err;
    REQUIRE(HcaSet::discover(&v, cfg, &set, &err));
    REQUIRE(set->hcas().size() == 2);
    CHECK(set->hcas()[0].name == "mlx5_0");
    CHECK(set->hcas()[0].gid_index == 0);
    CHECK(set->hcas()[0].gid_type == kGidTypeRoceV1);
    CHECK(set->hcas()[0].speed_mbps == 25000);
    CHECK(set->hcas()[1].name == "mlx5_1");
    CHECK(set->hcas()[1].port == 2);
    CHECK_FALSE(set->hcas()[1].active);
    CHECK(set->any_active());

    cfg.ib_hca = "^mlx5";
    REQUIRE(HcaSet::discover(&v, cfg, &set, &err));
    CHECK(set->hcas().empty());
    CHECK_FALSE(set->any_active());
    for (auto& d : devs) CHECK_FALSE(d->open);  // unused devices are closed again

    cfg.ib_hca = "mlx5_0:x";
    CHECK_FALSE(HcaSet::discover(&v, cfg, &set, &err));
    CHECK_THAT(err, Contains("R2CCL_IB_HCA"));
    cfg.ib_hca = "";
    cfg.ib_addr_family = "AF_UNIX";
    CHECK_FALSE(HcaSet::discover(&v, cfg, &set, &err));
    CHECK_THAT(err, Contains("R2CCL_IB_ADDR_FAMILY"));
  }
  g_devs = nullptr;
  std::string rm = "rm -rf '" + root + "'";
  CHECK(std::system(rm.c_str()) == 0);
}
