#include "cow.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

namespace r2ccl::snap::client {

// One registered buffer's whole pages [lo, hi), in chunks of `chunk` bytes (a multiple of
// 2 MiB) counted from `base` (lo rounded down to 2 MiB): chunk i is [base + i*chunk,
// base + (i+1)*chunk) within [lo, hi), so making a copied chunk writable again never splits a
// huge page. Read by the fault handler without locks: lo, hi, base, chunk, n and state are
// fixed from init() on; dst is written before `armed` is set (release) and read after it
// (acquire). collapse_next is the worker's alone (under the caller's mutex).
struct CowRegion {
  uintptr_t lo = 0, hi = 0, base = 0;
  uintptr_t collapse_next = 0, collapse_end = 0;  // the whole 2 MiB pages inside [lo, hi)
  size_t chunk = 0, n = 0;
  std::unique_ptr<std::atomic<uint8_t>[]> state;  // kProtected, kCopying, kCopied per chunk
  std::atomic<uint8_t*> dst{nullptr};             // staging for byte lo
  std::atomic<int> releasing{0};                  // copy_all_and_release() calls not done yet
  std::atomic<bool> armed{false};
};

namespace {

constexpr uint8_t kProtected = 0, kCopying = 1, kCopied = 2;
constexpr size_t kMaxRegions = 4096;          // registered buffers, process-wide
constexpr size_t kMinChunk = 2u << 20;        // 2 MiB: a transparent huge page
constexpr size_t kMaxChunksPerRegion = 1024;  // bounds the mappings mprotect splits off
constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE (Linux 6.1 uapi); older glibc headers lack it

std::atomic<CowRegion*> g_regions[kMaxRegions];
std::atomic<int> g_inside{0};  // handlers running (unregistering waits for 0)
std::mutex g_mu;               // installation and slot allocation (never in the handler)
struct sigaction g_prev {};
bool g_installed = false;

// Chunk i's bytes: [*at, *at + *len), inside [lo, hi).
void chunk_range(const CowRegion& r, size_t i, uintptr_t* at, size_t* len) {
  const uintptr_t a = std::max(r.lo, r.base + i * r.chunk);
  const uintptr_t b = std::min(r.hi, r.base + (i + 1) * r.chunk);
  *at = a;
  *len = b - a;
}

void spin_until_copied(const CowRegion& r, size_t i) {
  while (r.state[i].load(std::memory_order_acquire) != kCopied) sched_yield();
}

// Copies the rest of the region and makes all of it writable: when mprotect cannot split a
// mapping any more (ENOMEM, too many mappings), the whole range goes back at once, which
// always merges. Async-signal-safe (memcpy, mprotect, sched_yield).
void copy_all_and_release(CowRegion& r) {
  uint8_t* dst = r.dst.load(std::memory_order_acquire);
  for (size_t i = 0; i < r.n; ++i) {
    uint8_t expect = kProtected;
    if (r.state[i].compare_exchange_strong(expect, kCopying, std::memory_order_acq_rel)) {
      uintptr_t at;
      size_t len;
      chunk_range(r, i, &at, &len);
      std::memcpy(dst + (at - r.lo), reinterpret_cast<const void*>(at), len);
      r.state[i].store(kCopied, std::memory_order_release);
    }
  }
  for (size_t i = 0; i < r.n; ++i) spin_until_copied(r, i);
  ::mprotect(reinterpret_cast<void*>(r.lo), r.hi - r.lo, PROT_READ | PROT_WRITE);
}

// Claims chunk i and copies it (or waits for whoever claimed it), then it is writable.
void capture_chunk(CowRegion& r, size_t i) {
  uint8_t expect = kProtected;
  if (r.state[i].compare_exchange_strong(expect, kCopying, std::memory_order_acq_rel)) {
    uintptr_t at;
    size_t len;
    chunk_range(r, i, &at, &len);
    uint8_t* dst = r.dst.load(std::memory_order_acquire);
    std::memcpy(dst + (at - r.lo), reinterpret_cast<const void*>(at), len);
    if (::mprotect(reinterpret_cast<void*>(at), len, PROT_READ | PROT_WRITE) != 0) {
      // Counted before chunk i shows copied: finish() then waits for this release, so the
      // next take cannot protect the region again before its mprotect makes it writable.
      r.releasing.fetch_add(1, std::memory_order_acq_rel);
      r.state[i].store(kCopied, std::memory_order_release);
      copy_all_and_release(r);
      r.releasing.fetch_sub(1, std::memory_order_acq_rel);
      return;
    }
    r.state[i].store(kCopied, std::memory_order_release);
    return;
  }
  spin_until_copied(r, i);
}

// Set while this thread runs the previous handler from ours: a handler that chains back to
// ours (installed between two of our installations) would otherwise recurse for ever.
__attribute__((tls_model("initial-exec"))) thread_local bool t_chaining = false;

void on_segv(int sig, siginfo_t* si, void* uc) {
  if (t_chaining) {
    signal(sig, SIG_DFL);
    return;
  }
  const int saved = errno;
  const uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
  bool ours = false;
  g_inside.fetch_add(1);
  if (si->si_code > 0) {  // a fault of the kernel's, not a kill()/raise()
    for (size_t k = 0; k < kMaxRegions && !ours; ++k) {
      CowRegion* r = g_regions[k].load();
      if (!r || a < r->lo || a >= r->hi) continue;
      ours = true;
      // Not armed: the capture ended after this fault was raised; the page is writable now.
      if (r->armed.load(std::memory_order_acquire)) capture_chunk(*r, (a - r->base) / r->chunk);
    }
  }
  g_inside.fetch_sub(1);
  errno = saved;
  if (ours) return;  // the store is retried
  // Not ours: whoever handled SIGSEGV before.
  if (g_prev.sa_flags & SA_SIGINFO) {
    if (g_prev.sa_sigaction) {
      t_chaining = true;
      g_prev.sa_sigaction(sig, si, uc);
      t_chaining = false;
      return;
    }
  } else if (g_prev.sa_handler != SIG_DFL && g_prev.sa_handler != SIG_IGN) {
    t_chaining = true;
    g_prev.sa_handler(sig);
    t_chaining = false;
    return;
  }
  // Default action: reinstall it; returning re-runs the faulting instruction, which kills.
  signal(sig, SIG_DFL);
}

bool handler_in_place() {
  struct sigaction cur {};
  if (sigaction(SIGSEGV, nullptr, &cur) != 0) return false;
  return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_segv;
}

}  // namespace

bool CowBuffers::init(const std::vector<std::pair<uint8_t*, size_t>>& bufs, std::string* err) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  std::lock_guard<std::mutex> l(g_mu);
  // Installed once, and again when someone replaced it meanwhile (a test framework restoring
  // its saved handler): the one found is chained to.
  if (!g_installed || !handler_in_place()) {
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, &g_prev) != 0) {
      *err = std::string("sigaction(SIGSEGV): ") + std::strerror(errno);
      return false;
    }
    g_installed = true;
  }
  bufs_ = bufs;
  for (const auto& [p, n] : bufs) {
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
    if (hi <= lo) {
      regions_.push_back(nullptr);
      continue;
    }
    auto* r = new CowRegion;
    r->lo = lo;
    r->hi = hi;
    r->base = lo / kMinChunk * kMinChunk;
    const size_t len = hi - r->base;
    size_t chunk = std::max(kMinChunk, (len + kMaxChunksPerRegion - 1) / kMaxChunksPerRegion);
    chunk = (chunk + kMinChunk - 1) / kMinChunk * kMinChunk;
    r->chunk = chunk;
    r->n = (len + chunk - 1) / chunk;
    // Its whole 2 MiB pages, which the worker turns into huge pages (collapse_step()).
    r->collapse_next = (lo + kMinChunk - 1) / kMinChunk * kMinChunk;
    r->collapse_end = std::max(r->collapse_next, hi / kMinChunk * kMinChunk);
    r->state.reset(new std::atomic<uint8_t>[r->n]);
    for (size_t i = 0; i < r->n; ++i) r->state[i].store(kCopied);
    size_t k = 0;
    while (k < kMaxRegions && g_regions[k].load() != nullptr) ++k;
    if (k == kMaxRegions) {
      delete r;
      release_regions();
      *err = "more than " + std::to_string(kMaxRegions) + " buffers registered in the process";
      return false;
    }
    g_regions[k].store(r);
    regions_.push_back(r);
  }
  return true;
}

void CowBuffers::release_regions() {
  for (CowRegion* q : regions_) {
    if (!q) continue;
    for (auto& s : g_regions)
      if (s.load() == q) s.store(nullptr);
  }
  while (g_inside.load() != 0) sched_yield();
  for (CowRegion* q : regions_) delete q;
  regions_.clear();
}

CowBuffers::~CowBuffers() {
  if (pagemap_fd_ >= 0) ::close(pagemap_fd_);
  finish();
  std::lock_guard<std::mutex> l(g_mu);
  release_regions();
}

bool CowBuffers::begin(const std::vector<uint8_t*>& dst, std::string* why) {
  finish();
  const bool handler = handler_in_place();
  if (!handler) *why = "another SIGSEGV handler replaced the library's: take() copies instead";
  for (size_t i = 0; i < bufs_.size(); ++i) {
    uint8_t* src = bufs_[i].first;
    const size_t n = bufs_[i].second;
    CowRegion* r = regions_[i];
    if (!r || !handler) {
      std::memcpy(dst[i], src, n);
      continue;
    }
    const size_t head = r->lo - reinterpret_cast<uintptr_t>(src);
    const size_t tail_from = r->hi - reinterpret_cast<uintptr_t>(src);
    std::memcpy(dst[i], src, head);
    std::memcpy(dst[i] + tail_from, src + tail_from, n - tail_from);
    for (size_t c = 0; c < r->n; ++c) r->state[c].store(kProtected, std::memory_order_relaxed);
    r->dst.store(dst[i] + head, std::memory_order_release);
    r->armed.store(true, std::memory_order_release);
    if (::mprotect(reinterpret_cast<void*>(r->lo), r->hi - r->lo, PROT_READ) != 0) {
      *why = std::string("mprotect: ") + std::strerror(errno) + ": take() copies instead";
      ::mprotect(reinterpret_cast<void*>(r->lo), r->hi - r->lo, PROT_READ | PROT_WRITE);
      r->armed.store(false, std::memory_order_release);
      for (size_t c = 0; c < r->n; ++c) r->state[c].store(kCopied, std::memory_order_relaxed);
      std::memcpy(dst[i] + head, reinterpret_cast<const void*>(r->lo), r->hi - r->lo);
      continue;
    }
    active_ = true;
  }
  return active_;
}

// Whether every 4 KiB page of the 2 MiB page at `at` holds memory of this process's own
// (present and exclusively mapped, /proc/self/pagemap bits 63 and 56: no privilege needed).
// Collapsing fills what is not with real memory: a range never written, or only read (the
// shared zero page, as the take's copy maps it), would become resident for nothing. True when
// the pagemap cannot be read (the collapse then goes ahead).
bool CowBuffers::written_whole(uintptr_t at) {
  if (pagemap_fd_ == -1) pagemap_fd_ = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (pagemap_fd_ < 0) {
    pagemap_fd_ = -2;  // not again
    return true;
  }
  uint64_t e[kMinChunk / 4096];
  const off_t off = off_t(at / 4096 * sizeof(uint64_t));
  if (::pread(pagemap_fd_, e, sizeof(e), off) != ssize_t(sizeof(e))) return true;
  for (uint64_t x : e)
    if (!(x >> 63 & 1) || !(x >> 56 & 1)) return false;
  return true;
}

CowBuffers::Collapse CowBuffers::collapse_step() {
  if (collapse_done_) return Collapse::kDone;
  if (active_) return Collapse::kBusy;
  for (CowRegion* r : regions_) {
    if (!r || r->collapse_next >= r->collapse_end) continue;
    void* at = reinterpret_cast<void*>(r->collapse_next);
    r->collapse_next += kMinChunk;
    if (written_whole(r->collapse_next - kMinChunk)) (void)::madvise(at, kMinChunk, kMadvCollapse);
    // Errors leave that page as it is: EINVAL (a kernel before 6.1, THP off for the process,
    // a range advised MADV_NOHUGEPAGE), EAGAIN/ENOMEM (no huge page free, pages pinned for
    // DMA). One failed call per 2 MiB costs microseconds.
    return Collapse::kMore;
  }
  collapse_done_ = true;
  return Collapse::kDone;
}

void CowBuffers::finish() {
  if (!active_) return;
  for (CowRegion* r : regions_) {
    if (!r || !r->armed.load(std::memory_order_acquire)) continue;
    for (size_t i = 0; i < r->n; ++i) capture_chunk(*r, i);
    while (r->releasing.load(std::memory_order_acquire) != 0) sched_yield();
    r->armed.store(false, std::memory_order_release);
  }
  active_ = false;
}

}  // namespace r2ccl::snap::client
