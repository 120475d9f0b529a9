// Catch-side checks of an r2ccl_perf run (included by test files, which link Catch2).
#pragma once

#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <vector>

#include "net_harness.h"

namespace r2ccl::test {

// Runs r2ccl_perf with `env` and `args`; requires exit 0, exactly the table sizes
// `want_sizes`, 0 wrong elements everywhere, and `must_contain` (when not empty) in the output.
inline void check_perf(const std::map<std::string, std::string>& env, const std::string& args,
                       const std::vector<long long>& want_sizes,
                       const std::string& must_contain = "") {
  std::string out;
  const std::string cmd = perf_command(env, args);
  const int rc = run_command(cmd, &out);
  INFO(cmd << "\n" << out);
  CHECK(rc == 0);
  std::vector<long long> sizes;
  for (const auto& row : perf_rows(out)) {
    sizes.push_back(row.size);
    INFO("size " << row.size);
    CHECK(row.wrong == "0");
  }
  CHECK(sizes == want_sizes);
  CHECK(out.find("# wrong total: 0") != std::string::npos);
  if (!must_contain.empty()) CHECK(out.find(must_contain) != std::string::npos);
}

}  // namespace r2ccl::test
