// Checks that run inside the forked endpoint processes of run_pair (they cannot use Catch):
// print what failed (stderr ends up in the ctest log) and fail the process with a distinct
// exit code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>

#define EP_REQUIRE(cond, code, ...)                                             \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fprintf(stderr, "[%s:%d] check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                             \
      fprintf(stderr, "\n");                                                    \
      return code;                                                              \
    }                                                                           \
  } while (0)

namespace r2ccl::test {

// The byte a receive buffer is filled with beyond what a message may write.
constexpr uint8_t kCanary = 0xA5;

// A buffer that is not zero-initialised (so a 1 GiB receive buffer costs nothing until used).
inline std::unique_ptr<char[]> raw_buffer(size_t n) {
  return std::unique_ptr<char[]>(new char[n ? n : 1]);
}

// The receive side of one message of `sent` bytes (pattern `seed`, fill_pattern) into a
// buffer of `cap` bytes plus a canary tail of `tail` bytes that must stay untouched: size
// reported exactly, every byte right. 0, or exit code 20 (size), 21 (bytes), 22 (overwrite).
int check_received(const char* buf, size_t sent, size_t cap, size_t tail, int reported,
                   uint64_t seed);

}  // namespace r2ccl::test
