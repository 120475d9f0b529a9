// The test harness's own promises (tests/support/net_harness.h) that other suites rely on.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <string>

#include "net_harness.h"

namespace {

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

TEST_CASE("temp_path: nothing is there, even what an earlier process of this pid left",
          "[harness]") {
  // Paths are <dir>/r2ccl-test-<pid>-<counter>-<tag>: the next one differs from this one only
  // in the counter. Leave a file and a directory where the next two will be, as an earlier
  // process with the same pid would have (its daemons' logs, appended to by ours).
  const std::string first = r2ccl::test::temp_path("x");
  const std::string head = first.substr(0, first.rfind('-', first.size() - 3) + 1);
  const int n = std::stoi(first.substr(head.size(), first.size() - head.size() - 2));
  const std::string next_file = head + std::to_string(n + 1) + "-x";
  const std::string next_dir = head + std::to_string(n + 2) + "-x";
  std::ofstream(next_file) << "a line of an earlier run\n";
  REQUIRE(::mkdir(next_dir.c_str(), 0755) == 0);
  std::ofstream(next_dir + "/inner.log") << "stale\n";
  REQUIRE(exists(next_file));
  CHECK(r2ccl::test::temp_path("x") == next_file);
  CHECK_FALSE(exists(next_file));
  CHECK(r2ccl::test::temp_path("x") == next_dir);
  CHECK_FALSE(exists(next_dir));
}
