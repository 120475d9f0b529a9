// Catch2 v2 main for the lab suite: exits 77 (ctest SKIP_RETURN_CODE) when this machine cannot
// build the rail lab (not root, or network namespaces unavailable), before running anything.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (geteuid() != 0) {
    fprintf(stderr, "lab tests need root (network namespaces, veth, tc, nft): skipped\n");
    return 77;
  }
  std::string probe = "ip netns add r2ccl-probe-" + std::to_string(getpid()) +
                      " 2>/dev/null && ip netns del r2ccl-probe-" + std::to_string(getpid());
  if (system(probe.c_str()) != 0) {
    fprintf(stderr, "lab tests need network namespaces ('ip netns add' failed): skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
