// r2ccl_topology_check end to end in the rail lab: --dump inside each namespace (rails
// selected by R2CCL_SOCKET_IFNAME=rail, fake RoCE HCAs through the fake verbs provider), then
// --compare: symmetric -> exit 0; one rail with another MTU -> exit 1 and the MTU finding;
// another RoCE version on one side -> a GID-type warning, exit 0; a truncated dump -> exit 2.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>

#include "lab_util.h"
#include "net_harness.h"

using namespace r2ccl::test;

namespace {

std::string tool() {
  return env_or("R2CCL_TEST_TOPOLOGY_CHECK", R2CCL_BINARY_DIR "/bin/r2ccl_topology_check");
}

std::string fakeverbs() {
  return env_or("R2CCL_TEST_FAKEVERBS", R2CCL_BINARY_DIR "/lib/libr2ccl-fakeverbs.so");
}

// Fake RoCE HCAs whose GIDs are the side's rail addresses (10.210.i.<host>).
std::string devices(int host) {
  std::string d;
  for (int i = 0; i < 2; ++i) {
    d += (i ? ";" : "") + std::string("mlx5_") + std::to_string(i) + ",eth,10.210." +
         std::to_string(i) + "." + std::to_string(host) + ",speed=100000,pci=0000:00:0" +
         std::to_string(i + 1) + ".0/0000:0" + std::to_string(i + 1) + ":00.0,numa=0";
  }
  return d;
}

// Runs --dump in namespace `ns` into `out`; returns the exit status.
int dump(const std::string& ns, int host, const std::string& dir, const std::string& out,
         const std::string& extra_env = "") {
  std::string cmd = "ip netns exec " + ns +
                    " env R2CCL_SOCKET_IFNAME=rail R2CCL_IBVERBS_LIB=" + shell_quote(fakeverbs()) +
                    " FAKEVERBS_DIR=" + shell_quote(dir) +
                    " FAKEVERBS_DEVICES=" + shell_quote(devices(host)) + " " + extra_env + " " +
                    shell_quote(tool()) + " --dump --out " + shell_quote(out);
  std::string o;
  int rc = run_command(cmd, &o);
  INFO(cmd << "\n" << o);
  CHECK(rc == 0);
  return rc;
}

int compare(const std::string& args, std::string* out) {
  return run_command(shell_quote(tool()) + " --compare " + args, out);
}

}  // namespace

TEST_CASE("topology check: dumps in the rail lab, symmetric then one MTU changed") {
  REQUIRE(access(tool().c_str(), X_OK) == 0);
  REQUIRE(access(fakeverbs().c_str(), R_OK) == 0);
  Lab lab(2, "");
  std::string dir = temp_path("topo-lab");
  mkdir(dir.c_str(), 0700);
  std::string a = dir + "/a.json", b = dir + "/b.json";

  REQUIRE(dump(lab.a(), 1, dir, a) == 0);
  REQUIRE(dump(lab.b(), 2, dir, b) == 0);
  std::string ja = read_file(a);
  INFO("a.json:\n" << ja);
  CHECK(ja.find("\"name\": \"rail0\"") != std::string::npos);
  CHECK(ja.find("\"name\": \"rail1\"") != std::string::npos);
  CHECK(ja.find("\"subnet\": \"10.210.1.0/24\"") != std::string::npos);
  CHECK(ja.find("\"mtu\": 1500") != std::string::npos);
  CHECK(ja.find("\"name\": \"oob\"") == std::string::npos);
  // Fake HCAs: RoCE v2 GIDs on the rail addresses, PCI bus and NUMA from the fake sysfs.
  CHECK(ja.find("\"name\": \"mlx5_1:1\"") != std::string::npos);
  CHECK(ja.find("\"gid\": \"::ffff:10.210.1.1\"") != std::string::npos);
  CHECK(ja.find("\"gid_type\": \"RoCEv2\"") != std::string::npos);
  CHECK(ja.find("\"pci_bus\": \"0000:02:00.0\"") != std::string::npos);
  CHECK(ja.find("\"mtu\": 4096") != std::string::npos);

  std::string out;
  int rc = compare(a + " " + b, &out);
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("2 nodes, 0 errors, 0 warnings") != std::string::npos);

  // Side b's rail1 at MTU 1400.
  REQUIRE(run_command("ip netns exec " + lab.b() + " ip link set dev rail1 mtu 1400") == 0);
  REQUIRE(dump(lab.b(), 2, dir, b) == 0);
  rc = compare(a + " " + b, &out);
  INFO(out);
  CHECK(rc == 1);
  CHECK(out.find("error: node " + b + " rail rail1: MTU 1400, peers 1500") != std::string::npos);
  CHECK(out.find("2 nodes, 1 error, 0 warnings") != std::string::npos);
  rc = compare("--json " + a + " " + b, &out);
  CHECK(rc == 1);
  CHECK(out.find("\"kind\": \"mtu\"") != std::string::npos);

  // RoCE v1 on side b (and rail1 back to 1500): a warning only, exit 0.
  REQUIRE(run_command("ip netns exec " + lab.b() + " ip link set dev rail1 mtu 1500") == 0);
  REQUIRE(dump(lab.b(), 2, dir, b, "R2CCL_IB_ROCE_VERSION_NUM=1") == 0);
  rc = compare(a + " " + b, &out);
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("warning: node " + b + " HCA port mlx5_0:1: GID type RoCEv1, peers RoCEv2") !=
        std::string::npos);
  CHECK(out.find("2 nodes, 0 errors, 2 warnings") != std::string::npos);

  // A truncated dump: exit 2, the message names the file.
  std::string t = dir + "/trunc.json";
  REQUIRE(run_command("head -c 200 " + shell_quote(a) + " > " + shell_quote(t)) == 0);
  rc = compare(a + " " + t, &out);
  INFO(out);
  CHECK(rc == 2);
  CHECK(out.find(t + ": not valid JSON") != std::string::npos);
  // Fewer than two files: exit 2.
  CHECK(compare(a, &out) == 2);

  run_command("rm -rf " + shell_quote(dir));
}
