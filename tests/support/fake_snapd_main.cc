// fake_snapd SOCKET [--complete-limit N]: the tests' fake r2ccl_snapshotd (fake_snapd.h) as a
// process, for the Python binding's tests. Prints "ready" once listening; reads commands from
// stdin, one per line ("epoch N": push a STATE with that epoch); exits at EOF on stdin.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "fake_snapd.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: fake_snapd SOCKET [--complete-limit N]\n");
    return 2;
  }
  r2ccl::test::FakeSnapdOptions opt;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--complete-limit") == 0) {
      opt.complete_limit = std::strtoull(argv[i + 1], nullptr, 10);
    } else {
      std::fprintf(stderr, "fake_snapd: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  r2ccl::test::FakeSnapd d(argv[1], opt);
  std::string err;
  if (!d.start(&err)) {
    std::fprintf(stderr, "fake_snapd: %s\n", err.c_str());
    return 1;
  }
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.rfind("epoch ", 0) == 0) d.set_epoch(std::strtoull(line.c_str() + 6, nullptr, 10));
  }
  d.stop();
  return 0;
}
