// Copy-on-write capture of host buffers for take() (snapshot_client.h, R2CCL_SNAPSHOT_TAKE).
//
// take() does not copy the registered buffers: it write-protects their whole pages
// (mprotect(PROT_READ)), copies only the partial first and last pages, and returns. The
// encoder thread then copies the protected part chunk by chunk into the staging set, making
// each chunk writable again once copied. A CPU store to a chunk not copied yet faults; the
// SIGSEGV handler installed here copies that chunk first (the bytes as they were at take()),
// makes it writable and returns, and the store goes ahead. Each chunk is claimed once (an
// atomic state per chunk: protected, being copied, copied), by the copier or by a faulting
// thread, so the staging set is bit-equal to the buffers at take() whatever is written after.
//
// Limits: only user-mode stores fault. The kernel writing into a protected buffer (read(2),
// recv(2) into it) fails with EFAULT, and device writes (DMA: RDMA, cudaMemcpy into pinned
// memory) are not seen at all: such buffers need R2CCL_SNAPSHOT_TAKE=copy. The pages must be
// ordinary read-write memory (they are made PROT_READ|PROT_WRITE again). A SIGSEGV handler
// installed later by someone else that does not chain to the previous one would break the
// capture: begin() checks that this one is still installed and copies synchronously if not.
//
// Units: bytes. Thread-safety: one CowBuffers per client handle; begin(), finish() and
// collapse_step() are serialised by the caller (Client::cow_mu_); the fault handler runs on
// any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace r2ccl::snap::client {

struct CowRegion;  // cow.cc

class CowBuffers {
 public:
  CowBuffers() = default;
  ~CowBuffers();  // finishes a capture in progress, then unregisters the buffers
  CowBuffers(const CowBuffers&) = delete;
  CowBuffers& operator=(const CowBuffers&) = delete;

  // Registers the host buffers (fixed for the handle's life) and installs the SIGSEGV handler
  // (once per process). False with *err when the handler cannot be installed or too many
  // buffers are registered process-wide (kMaxRegions): the caller copies instead.
  bool init(const std::vector<std::pair<uint8_t*, size_t>>& bufs, std::string* err);

  // Starts capturing every buffer i into dst[i] (bufs[i].second bytes each). Returns true when
  // the capture is under way (finish() completes it); false when it was done synchronously
  // (the handler was replaced, mprotect failed: *why says so, logged by the caller once): dst
  // then holds the copy already.
  bool begin(const std::vector<uint8_t*>& dst, std::string* why);
  // Copies every chunk not copied yet and makes the buffers writable again; returns when the
  // capture is complete. A no-op when none is in progress.
  void finish();
  bool active() const { return active_; }

  // Transparent huge pages for the buffers: write-protecting a 2 MiB huge page is one page
  // table entry instead of 512 (docs/BENCHMARKS.md, "Restore and take() at their targets":
  // take() of 1 GiB blocked 0.002 s instead of 0.05 s). collapse_step() turns the next whole
  // 2 MiB page of a buffer, if every 4 KiB of it was written by this process (not a range
  // never written or only read: collapsing would make it resident), into a huge page
  // (MADV_COLLAPSE, Linux
  // >= 6.1, whatever the THP sysfs setting; not where the caller advised MADV_NOHUGEPAGE or
  // disabled THP for the process; a few ms per page on a paravirtualised guest; the training
  // thread's stores meanwhile are safe). kMore: call again; kBusy: a capture is in progress,
  // call again after it; kDone: every page was tried once. Copy-on-write chunks start on 2 MiB
  // boundaries and are multiples of 2 MiB (the first and last cut to the buffer's pages), so
  // making a copied chunk writable again never splits a huge page.
  enum class Collapse { kMore, kBusy, kDone };
  Collapse collapse_step();

 private:
  // Takes this object's regions out of the process-wide table, waits for fault handlers still
  // inside them, and frees them. The caller holds the table's mutex.
  void release_regions();
  std::vector<CowRegion*> regions_;  // one per buffer (nullptr: under one page, always copied)
  std::vector<std::pair<uint8_t*, size_t>> bufs_;
  bool active_ = false;
  bool collapse_done_ = false;
  int pagemap_fd_ = -1;  // /proc/self/pagemap (-2: cannot be read)
  bool written_whole(uintptr_t at);
};

}  // namespace r2ccl::snap::client
