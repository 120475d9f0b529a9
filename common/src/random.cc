#include "r2ccl/random.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "r2ccl/clock.h"

namespace r2ccl {

Rng::Rng() {
  if (getrandom(state_, sizeof(state_), 0) != sizeof(state_)) {
    state_[0] = static_cast<uint64_t>(now_us()) ^ (static_cast<uint64_t>(getpid()) << 32);
    state_[1] = 0x9e3779b97f4a7c15ull;
  }
}

uint64_t Rng::next() {
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t s1 = state_[0];
  const uint64_t s0 = state_[1];
  state_[0] = s0;
  s1 ^= s1 << 23;
  state_[1] = s1 ^ s0 ^ (s1 >> 17) ^ (s0 >> 26);
  return state_[1] + s0;
}

void Rng::bytes(void* out, size_t n) {
  if (getrandom(out, n, 0) == static_cast<ssize_t>(n)) return;
  auto* p = static_cast<uint8_t*>(out);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = next();
    memcpy(p + i, &x, std::min<size_t>(8, n - i));
  }
}

bool secrets_equal(const void* a, const void* b, size_t n) {
  const auto* x = static_cast<const volatile uint8_t*>(a);
  const auto* y = static_cast<const volatile uint8_t*>(b);
  uint8_t d = 0;
  for (size_t i = 0; i < n; ++i) d |= x[i] ^ y[i];
  return d == 0;
}

}  // namespace r2ccl
