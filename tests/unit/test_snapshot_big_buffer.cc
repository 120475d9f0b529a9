// big_buffer.h: the data plane's large buffers (shards, staging, receive buffers): sizes on both
// sides of the 2 MiB line, alignment, zeroed prefaulted memory, the no-zeroing vector allocator,
// and alloc_shard_bytes() on top of it.
#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <vector>

#include "r2ccl/snapshot/big_buffer.h"
#include "r2ccl/snapshot/shard_store.h"

using namespace r2ccl::snap;

TEST_CASE("big buffers: every size is usable, large ones 2 MiB-aligned, prefault zeroes") {
  for (size_t n : {size_t(0), size_t(1), size_t(4095), kBigBufferMin - 1, kBigBufferMin,
                   kBigBufferMin + 1, size_t(5) * kBigBufferMin + 12345}) {
    INFO("bytes " << n);
    for (bool prefault : {false, true}) {
      uint8_t* p = big_alloc(n, prefault);
      REQUIRE(p != nullptr);
      if (n >= kBigBufferMin) CHECK(reinterpret_cast<uintptr_t>(p) % kBigBufferMin == 0);
      if (prefault) {
        bool zero = true;
        for (size_t i = 0; i < n; ++i) zero = zero && p[i] == 0;
        CHECK(zero);
      }
      // Every byte is ours: written and read back (AddressSanitizer checks the small path).
      for (size_t i = 0; i < n; ++i) p[i] = uint8_t(i * 7 + 1);
      bool same = true;
      for (size_t i = 0; i < n; ++i) same = same && p[i] == uint8_t(i * 7 + 1);
      CHECK(same);
      if (n >= kBigBufferMin) {
        // The mapping ends at the size rounded up to a 4 KiB page, not to 2 MiB: a buffer just
        // over a huge page does not hold two of them.
        const size_t len = (n + 4095) / 4096 * 4096;
        unsigned char vec = 0;
        CHECK(mincore(p + len - 4096, 4096, &vec) == 0);
        CHECK(mincore(p + len, 4096, &vec) == -1);
      }
      big_free(p, n);
    }
  }
  big_free(nullptr, 123);  // ignored
  CHECK(big_alloc(size_t(-1), false) == nullptr);
}

TEST_CASE("big buffers: the vector allocator keeps contents across growth, no zeroing needed") {
  std::vector<uint8_t, BigAlloc<uint8_t>> v;
  v.resize(100);
  std::memset(v.data(), 0x5a, v.size());
  v.resize(3 * kBigBufferMin);  // from malloc to a mapping: the first 100 bytes move along
  CHECK(reinterpret_cast<uintptr_t>(v.data()) % kBigBufferMin == 0);
  bool kept = true;
  for (size_t i = 0; i < 100; ++i) kept = kept && v[i] == 0x5a;
  CHECK(kept);
  v[v.size() - 1] = 7;
  std::vector<uint8_t, BigAlloc<uint8_t>> w(std::move(v));
  CHECK(w.back() == 7);
  BigBytes b = make_big(kBigBufferMin * 2, true);
  REQUIRE(b);
  CHECK(b[kBigBufferMin * 2 - 1] == 0);
  std::shared_ptr<uint8_t> s = alloc_shard_bytes(kBigBufferMin + 3);
  REQUIRE(s);
  s.get()[kBigBufferMin + 2] = 9;
  CHECK(s.get()[kBigBufferMin + 2] == 9);
}
