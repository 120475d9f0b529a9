// r2ccl_tune on small synthetic sweeps: labelled runs in r2ccl_perf's and nccl-tests' table
// formats -> a rules file that picks the fastest algorithm/protocol per size range.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <string>

#include "rules.h"
#include "support/net_harness.h"

using namespace r2ccl::tuner;
using namespace r2ccl::test;

namespace {

std::string tmp_file(const std::string& text) {
  char path[] = "/tmp/r2ccl-tune-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  close(fd);
  return path;
}

// An r2ccl_perf-style table: size count type redop root time algbw busbw #wrong.
std::string perf_run(const char* op, const std::vector<std::pair<uint64_t, double>>& rows) {
  std::ostringstream o;
  o << "# r2ccl_perf  op: " << op << "  ranks: 16  channels: 2  minBytes: 8  maxBytes: 1048576\n"
    << "#\n#       size         count      type   redop    root     time   algbw   busbw  #wrong\n";
  for (auto& [size, us] : rows)
    o << "  " << size << "  " << size / 4 << "  float  sum  -1  " << us << "  1.00  1.00  0\n";
  o << "# Avg bus bandwidth    : 1.0\n";
  return o.str();
}

}  // namespace

TEST_CASE("r2ccl_tune picks the fastest label per size range", "[unit][tuner]") {
  const std::string tool = env_or("R2CCL_TEST_TUNE", "");
  REQUIRE_FALSE(tool.empty());
  const std::string ring_simple =
      tmp_file(perf_run("allreduce", {{8, 20}, {1024, 22}, {65536, 40}, {1048576, 200}}));
  const std::string ring_ll128 =
      tmp_file(perf_run("allreduce", {{8, 10}, {1024, 12}, {65536, 30}, {1048576, 300}}));
  // One nccl-tests file holding two labelled runs (out-of-place and in-place columns); the
  // second run is measured twice (rows averaged).
  const std::string combined = tmp_file(
      "# Collective test starting: all_reduce_perf\n"
      "# r2ccl_tune: tree/ll\n"
      "           8             2     float     sum      -1    5.00    0.00    0.00      0     5.0 "
      "   0.00    0.00      0\n"
      "        1024           256     float     sum      -1    7.00    0.00    0.00      0     7.0 "
      "   0.00    0.00      0\n"
      "       65536         16384     float     sum      -1   80.00    0.00    0.00      0    80.0 "
      "   0.00    0.00      0\n"
      "     1048576        262144     float     sum      -1  900.00    0.00    0.00      0   900.0 "
      "   0.00    0.00      0\n"
      "# r2ccl_tune: ring/ll\n"
      "           8             2     float     sum      -1    4.00    0.00    0.00      0     4.0 "
      "   0.00    0.00      0\n"
      "           8             2     float     sum      -1   12.00    0.00    0.00      0    12.0 "
      "   0.00    0.00      0\n"
      "        1024           256     float     sum      -1   50.00    0.00    0.00      0    50.0 "
      "   0.00    0.00      0\n"
      "# Out of bounds values : 0 OK\n");
  const std::string out = tmp_file("");
  const std::string cmd = shell_quote(tool) + " -o " + shell_quote(out) +
                          " --nodes 2 ring/simple=" + shell_quote(ring_simple) +
                          " ring/ll128=" + shell_quote(ring_ll128) + " " + shell_quote(combined);
  std::string log;
  INFO(cmd);
  REQUIRE(run_command(cmd + " 2>&1", &log) == 0);
  INFO(log);
  RuleSet rs;
  std::string err;
  REQUIRE(load_rules_file(out, &rs, &err));
  INFO(err);
  std::ifstream f(out);
  std::stringstream text;
  text << f.rdbuf();
  INFO("rules:\n" << text.str());
  // 8 B: ring/ll averages 8 us > tree/ll 5 us; 1 KiB: tree/ll; 64 KiB: ring/ll128; 1 MiB:
  // ring/simple.
  REQUIRE(rs.rules.size() == 3);
  CHECK(rs.rules[0].coll == 4);
  CHECK(rs.rules[0].algo == 0);
  CHECK(rs.rules[0].proto == 0);
  CHECK(rs.rules[0].bytes.lo == 0);
  CHECK(rs.rules[0].bytes.hi == 1024);
  CHECK(rs.rules[0].nodes.lo == 2);
  CHECK(rs.rules[0].ranks.lo == 16);
  CHECK(rs.rules[1].algo == 1);
  CHECK(rs.rules[1].proto == 1);
  CHECK(rs.rules[1].bytes.lo == 1025);
  CHECK(rs.rules[1].bytes.hi == 65536);
  CHECK(rs.rules[2].algo == 1);
  CHECK(rs.rules[2].proto == 2);
  CHECK(rs.rules[2].bytes.lo == 65537);
  CHECK(rs.rules[2].bytes.hi == UINT64_MAX);

  // Errors: a bad label, a missing file.
  CHECK(run_command(shell_quote(tool) + " warp/ll=" + shell_quote(ring_simple) + " 2>&1", &log) !=
        0);
  CHECK(run_command(shell_quote(tool) + " ring/ll=/nonexistent 2>&1", &log) != 0);
  for (const auto& p : {ring_simple, ring_ll128, combined, out}) unlink(p.c_str());
}
