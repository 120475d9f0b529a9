// Large buffers on transparent huge pages (big_buffer.h says why).
#include "r2ccl/snapshot/big_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

namespace r2ccl::snap {
namespace {

constexpr size_t kHuge = kBigBufferMin;
constexpr size_t kSmallPage = 4096;

// The mapping's length: whole small pages only. Huge pages back the aligned 2 MiB ranges inside
// it, small pages the tail, so a shard of 2.1 MB holds 2.1 MB, not 4 MiB.
size_t map_len(size_t n) { return (n + kSmallPage - 1) / kSmallPage * kSmallPage; }

}  // namespace

uint8_t* big_alloc(size_t n, bool prefault) {
  if (n < kBigBufferMin) {
    auto* p = static_cast<uint8_t*>(std::malloc(n ? n : 1));
    if (p && prefault) std::memset(p, 0, n);
    return p;
  }
  if (n > size_t(-1) - 2 * kHuge) return nullptr;
  const size_t len = map_len(n);
  // Over-map by one huge page and trim, so the buffer starts on a 2 MiB boundary (a huge page
  // can only back an aligned 2 MiB range).
  void* m =
      ::mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t start = (base + kHuge - 1) & ~uintptr_t(kHuge - 1);
  if (start > base) ::munmap(m, start - base);
  const size_t tail = (base + len + kHuge) - (start + len);
  if (tail) ::munmap(reinterpret_cast<void*>(start + len), tail);
  auto* p = reinterpret_cast<uint8_t*>(start);
  // Advice only: without it (transparent_hugepage "never", an old kernel) the buffer still
  // works, on 4 KiB pages.
  (void)::madvise(p, len, MADV_HUGEPAGE);
  if (prefault) {
    // Stores from user mode, not MAP_POPULATE: see big_buffer.h. One per 4 KiB page, in case
    // the kernel fell back to small pages for part of the range.
    volatile uint8_t* v = p;
    for (size_t i = 0; i < len; i += kSmallPage) v[i] = 0;
  }
  return p;
}

void big_free(uint8_t* p, size_t n) noexcept {
  if (!p) return;
  if (n < kBigBufferMin)
    std::free(p);
  else
    ::munmap(p, map_len(n));
}

}  // namespace r2ccl::snap
