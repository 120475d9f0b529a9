// Memory-registration cache of one HCA (one protection domain).
//
// NCCL registers the same buffers again and again (regMr per communicator, per buffer
// pool), and a verbs registration pins pages and costs milliseconds, so registrations are
// shared: a request whose page range lies inside an existing registration reuses it and
// takes a reference; the last release deregisters. A range that only partly overlaps
// existing registrations gets its own (no merging or growing: simpler, and an MR handed out
// never changes its bounds or keys). Generic over the registration call so it unit-tests
// without verbs; in production RegFn wraps VerbsApi::reg_mr (or reg_dmabuf_mr) on the PD.
//
// Thread-safety: every method is internally locked (regMr runs on NCCL's service thread
// concurrently with other threads). RegFn and DeregFn run under the cache's lock, so two
// threads asking for the same range share one registration; they must not call back into
// the cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

namespace r2ccl::net::ib {

class MrCache {
 public:
  // Registers [page_start, page_start + len) (whole pages); returns an opaque MR (ibv_mr*)
  // or nullptr with *err set and errno the registration's (callers tell a dead device, EIO,
  // from other failures by it).
  using RegFn = std::function<void*(uintptr_t page_start, size_t len, std::string* err)>;
  using DeregFn = std::function<void(void* mr)>;

  // page_size: bytes, > 0 (normally the system page size).
  MrCache(RegFn reg, DeregFn dereg, size_t page_size = 4096);
  // Deregisters whatever is still registered (a leak by the caller; logged). The PD must
  // still exist.
  ~MrCache();
  MrCache(const MrCache&) = delete;
  MrCache& operator=(const MrCache&) = delete;

  // Registers [addr, addr+len) rounded out to whole pages (len 0 = the page holding addr),
  // reusing an existing registration that covers the whole page range (reference + 1; when
  // several do, the one with the lowest start, the oldest among equal starts). Returns the
  // MR, or nullptr with *err (the registration's own error, errno as RegFn left it; or a
  // range that overflows the address space, errno EINVAL).
  void* acquire(const void* addr, size_t len, std::string* err);

  // Drops one reference to `mr`; deregisters it when none is left. Returns false (and does
  // nothing) for nullptr or an MR this cache did not hand out / already deregistered.
  bool release(void* mr);

  // Number of live registrations.
  size_t entries() const;
  // References held on `mr` (0 if unknown). For tests and diagnostics.
  size_t refs(void* mr) const;

 private:
  struct Entry {
    uintptr_t start;
    uintptr_t end;  // exclusive
    void* mr;
    size_t refs;
  };
  using Map = std::multimap<uintptr_t, Entry>;  // by start

  RegFn reg_;
  DeregFn dereg_;
  size_t page_;
  mutable std::mutex mu_;
  Map by_start_;
  std::unordered_map<void*, Map::iterator> by_mr_;
};

}  // namespace r2ccl::net::ib
