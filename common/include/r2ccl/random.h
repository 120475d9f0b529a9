// Random numbers for connection ids and handle secrets: values another host must not be able
// to guess. Bytes come from getrandom(); if the kernel cannot supply them, an xorshift128+
// generator seeded once from getrandom() (or the clock and pid) fills in. Not meant to be
// cryptographically strong against a local attacker.
// Thread-safety: every method may be called from any thread (internally locked).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

namespace r2ccl {

class Rng {
 public:
  Rng();
  uint64_t next();
  void bytes(void* out, size_t n);

 private:
  std::mutex mu_;
  uint64_t state_[2] = {0, 0};
};

// Compares two secrets of n bytes in time independent of where they differ (a peer probing
// a listener learns nothing from the time a refusal takes).
bool secrets_equal(const void* a, const void* b, size_t n);

}  // namespace r2ccl
