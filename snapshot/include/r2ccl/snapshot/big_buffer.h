// Large byte buffers of the snapshot data plane (shards, staging sets, receive buffers, the
// encoders' reconstructions): anonymous mappings advised for transparent huge pages, and,
// when asked, faulted in by stores from user mode.
//
// Why (docs/BENCHMARKS.md, "Restore: huge pages and first user access"): the first user-mode
// access to each 4 KiB page of fresh anonymous memory is what a restore of a gigabyte waited
// on. On the Firecracker VMs of this project's machines it costs about 5 us a page (1.4 s per
// GiB), even after MAP_POPULATE or MADV_POPULATE_WRITE (which fault the pages in from the
// kernel and leave that cost to the first user access), and a kernel's socket read into such
// memory leaves it there too (the first hash of a received shard ran at 0.5 GB/s, the second
// at 17 GB/s). With 2 MiB pages the same gigabyte is first touched in 0.08 s. On bare metal,
// huge pages also cut the faults 512-fold and the TLB misses of the decoders' passes.
//
// Below kBigBufferMin bytes, plain malloc. The kernel may give 4 KiB pages anyway
// (transparent_hugepage "never", or no free 2 MiB page): the buffers still work, at 4 KiB
// speed. Sizes are bytes. Thread-safe (no shared state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>

namespace r2ccl::snap {

constexpr size_t kBigBufferMin = size_t(2) << 20;  // one x86-64 huge page (2 MiB)

// n bytes (n == 0: a 1-byte allocation), 2 MiB-aligned and advised MADV_HUGEPAGE from
// kBigBufferMin on (huge pages for its whole 2 MiB ranges, small pages for the tail: it holds n
// bytes rounded up to 4 KiB, not to 2 MiB); null when the memory is not there. prefault: every page
// is written once from user mode now (contents then zero), so nobody pays for first touches later;
// else the contents are unspecified and pages are faulted in on first use.
uint8_t* big_alloc(size_t n, bool prefault);
// Frees what big_alloc(n, ...) returned (the same n). Null is ignored.
void big_free(uint8_t* p, size_t n) noexcept;

// A std::allocator-like allocator on big_alloc that does not initialise what resize() adds
// (a shard body of a gigabyte is filled by the socket, zeroing it first would be a wasted pass).
template <class T>
struct BigAlloc {
  using value_type = T;
  BigAlloc() = default;
  template <class U>
  BigAlloc(const BigAlloc<U>&) {}
  T* allocate(size_t n) {
    if (n > size_t(-1) / sizeof(T)) throw std::bad_array_new_length();
    void* p = big_alloc(n * sizeof(T), false);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) noexcept {
    big_free(reinterpret_cast<uint8_t*>(p), n * sizeof(T));
  }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-initialised: no zeroing
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
  template <class U>
  bool operator==(const BigAlloc<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const BigAlloc<U>&) const {
    return false;
  }
};

// n bytes from big_alloc owned by a unique_ptr (the deleter remembers n).
struct BigFree {
  size_t n = 0;
  void operator()(uint8_t* p) const noexcept { big_free(p, n); }
};
using BigBytes = std::unique_ptr<uint8_t[], BigFree>;
inline BigBytes make_big(size_t n, bool prefault) {
  return BigBytes(big_alloc(n, prefault), BigFree{n});
}

}  // namespace r2ccl::snap
