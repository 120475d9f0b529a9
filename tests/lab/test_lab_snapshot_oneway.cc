// B2 of issue 15 with real packet drops: nft drops every packet to node 0's peer port on
// loopback (its TCP listener and its UDP heartbeat socket: it hears nobody, everyone hears it).
// Node 0 suspects everyone alone, so nobody is evicted; a node then killed with SIGKILL is
// published in a new record. Root only (lab suite); the table is removed however the test ends.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "snapd_cluster.h"

using namespace r2ccl;
using namespace r2ccl::test::snapd;

namespace {
struct NftTable {
  std::string name;
  explicit NftTable(std::string n) : name(std::move(n)) {}
  bool add_drop_dport(int port) {
    const std::string t = "inet " + name;
    const std::string cmd = "nft add table " + t + " && nft add chain " + t +
                            " in '{ type filter hook input priority -10 ; }' && nft add rule " + t +
                            " in iif lo tcp dport " + std::to_string(port) +
                            " drop && nft add rule " + t + " in iif lo udp dport " +
                            std::to_string(port) + " drop";
    return system(cmd.c_str()) == 0;
  }
  ~NftTable() {
    const std::string cmd = "nft delete table inet " + name + " 2>/dev/null";
    if (system(cmd.c_str()) != 0) {
    }
  }
};
int port_of(const Cluster& c, int node) {
  std::istringstream in(test::read_file(c.peers));
  int id, port;
  std::string hp;
  while (in >> id >> hp)
    if (id == node) {
      port = std::atoi(hp.c_str() + hp.rfind(':') + 1);
      return port;
    }
  return -1;
}
}  // namespace

TEST_CASE("lab: snapshot daemons, node 0's port dropped by nft: nobody evicted, a kill published",
          "[lab][snapshot]") {
  if (system("nft --version >/dev/null 2>&1") != 0) {
    WARN("nft not installed: skipped");
    return;
  }
  constexpr int kNodes = 5;
  Cluster c(kNodes, "snapnft", false, 10);
  for (int i = 0; i < kNodes; ++i) c.start(i);
  for (int i = 0; i < kNodes; ++i) REQUIRE(c.wait_socket(i));
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, 10000));
  }
  uint64_t epoch = 0;
  board_members(c.boards[1], &epoch);
  NftTable nft("r2ccl_snap_" + std::to_string(getpid()));
  REQUIRE(nft.add_drop_dport(port_of(c, 0)));
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  {
    uint64_t e = 0;
    INFO(c.all_logs());
    CHECK(board_members(c.boards[1], &e).size() == kNodes);
    CHECK(e == epoch);
    CHECK(test::read_file(c.logs[0]).find("no heartbeat for") != std::string::npos);
  }
  c.stop(3, SIGKILL);
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, {0, 1, 2, 4}, {0, 1, 2, 4}, 10000, epoch));
  }
  check_invariants(c, 1);
  c.check_clean();
}
