// GPUDirect reach of HCAs (transport/ib/gdr.h): NCCL_NET_GDR_LEVEL parsing (NCCL 2.30.7's
// names and legacy integers) and NCCL's GPU-to-NIC PCI path type from sysfs paths.
#include <catch2/catch.hpp>
#include <string>

#include "transport/ib/gdr.h"

using namespace r2ccl::net::ib;

namespace {

int level(const std::string& v) {
  int out = -1;
  std::string err;
  REQUIRE(parse_gdr_level(v, "NCCL_NET_GDR_LEVEL", &out, &err));
  return out;
}

const std::string kRoot = "/sys/devices/pci0000:00/";
const std::string kRoot2 = "/sys/devices/pci0000:80/";

}  // namespace

TEST_CASE("NCCL_NET_GDR_LEVEL: NCCL's names and legacy integers", "[unit][ib]") {
  CHECK(level("LOC") == kPathLoc);
  CHECK(level("NVL") == kPathNvl);
  CHECK(level("NVB") == kPathNvb);
  CHECK(level("C2C") == kPathC2c);
  CHECK(level("PIX") == kPathPix);
  CHECK(level("PXB") == kPathPxb);
  CHECK(level("P2C") == kPathP2c);
  CHECK(level("PXN") == kPathPxn);
  CHECK(level("PHB") == kPathPhb);
  CHECK(level("SYS") == kPathSys);
  // paths.cc levelsOldToNew: 0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 SYS, 5 SYS; larger: the last.
  CHECK(level("0") == kPathLoc);
  CHECK(level("1") == kPathPix);
  CHECK(level("2") == kPathPxb);
  CHECK(level("3") == kPathPhb);
  CHECK(level("4") == kPathSys);
  CHECK(level("5") == kPathSys);
  CHECK(level("17") == kPathSys);
  CHECK(std::string(gdr_path_name(kPathPhb)) == "PHB");
  CHECK(std::string(gdr_path_name(42)) == "?");
}

TEST_CASE("NCCL_NET_GDR_LEVEL: anything else is refused, naming the variable", "[unit][ib]") {
  // NCCL ignores these silently (and uses its default); r2ccl says so at init.
  for (const char* bad : {"", "pxb", "NET", "DIS", "-1", "2x", " PXB", "0x2"}) {
    int out = 7;
    std::string err;
    INFO(bad);
    CHECK_FALSE(parse_gdr_level(bad, "R2CCL_NET_GDR_LEVEL", &out, &err));
    CHECK(out == 7);  // untouched
    CHECK(err.find("R2CCL_NET_GDR_LEVEL='" + std::string(bad) + "': accepted: one of LOC") == 0);
    CHECK(err.find("legacy integer 0-5") != std::string::npos);
  }
}

TEST_CASE("GPU to NIC path type as NCCL's topology sees it", "[unit][ib]") {
  // A PCIe switch: root port 00:01.0, upstream port 0a:00.0, downstream ports 0b:0x.0.
  const std::string sw = kRoot + "0000:00:01.0/0000:0a:00.0/";
  const std::string gpu = sw + "0000:0b:00.0/0000:0c:00.0";
  SECTION("one switch is the parent of both: PIX") {
    CHECK(gpu_nic_path_type(gpu, 0, sw + "0000:0b:01.0/0000:0d:00.0", 0) == kPathPix);
    CHECK(gpu_nic_path_type(gpu, 0, sw + "0000:0b:00.0/0000:0c:00.1", 0) == kPathPix);
  }
  SECTION("a second level of switches between them: PXB") {
    // NIC below a switch that hangs off downstream port 0b:02.0 of the first one.
    const std::string nic = sw + "0000:0b:02.0/0000:10:00.0/0000:11:00.0/0000:12:00.0";
    CHECK(gpu_nic_path_type(gpu, 0, nic, 0) == kPathPxb);
    CHECK(gpu_nic_path_type(nic, 0, gpu, 0) == kPathPxb);
  }
  SECTION("meeting only at the CPU: PHB (same root complex, or another one on its NUMA node)") {
    CHECK(gpu_nic_path_type(gpu, 0, kRoot + "0000:00:03.0/0000:40:00.0", 0) == kPathPhb);
    // Directly below root ports, no switch: NCCL attaches both to the CPU.
    CHECK(gpu_nic_path_type(kRoot + "0000:00:01.0/0000:01:00.0", -1,
                            kRoot + "0000:00:01.0/0000:01:00.1", -1) == kPathPhb);
    CHECK(gpu_nic_path_type(gpu, 0, kRoot2 + "0000:80:01.0/0000:81:00.0", 0) == kPathPhb);
  }
  SECTION("across CPUs, or a device that is not on PCI: SYS") {
    CHECK(gpu_nic_path_type(gpu, 0, kRoot2 + "0000:80:01.0/0000:81:00.0", 1) == kPathSys);
    CHECK(gpu_nic_path_type(gpu, 0, "", 0) == kPathSys);
    CHECK(gpu_nic_path_type("", 0, gpu, 0) == kPathSys);
    CHECK(gpu_nic_path_type(gpu, 0, "/sys/devices/virtual/net/eth0", 0) == kPathSys);
  }
}
