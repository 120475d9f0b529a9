// Catch2 v2 main for the lab suite: exits 77 (ctest SKIP_RETURN_CODE) when this machine cannot
// build the rail lab (not root, or network namespaces unavailable), before running anything.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "catch_run.h"

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
  return r2ccl_catch_run(argc, argv);
}
