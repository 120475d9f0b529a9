// Unix-socket framing for the snapshot client (client_wire.h): connect, one frame out
// (header + up to two parts, non-blocking writes with a stall bound), one frame in (blocking,
// length checked with client_payload_ok before the payload is allocated).
// Thread-safety: none inside; the caller serialises writers (Client::send_mu_) and has one
// reader thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace r2ccl::snap::client {

// A write making no progress for this long fails (the daemon is wedged).
constexpr int kWriteStallMs = 120000;

// Connects a stream socket to `path`. Returns the fd, or -1 with *err naming the path, the
// errno text and what to do; *enoent tells "no daemon there" cases apart (ENOENT,
// ECONNREFUSED).
int connect_unix(const std::string& path, std::string* err);

// Writes one frame: header(type, na + nb) + a[na] + b[nb]. False with *err on an error
// (EPIPE: the daemon closed) or a stall longer than kWriteStallMs.
bool write_frame(int fd, uint16_t type, const void* a, size_t na, const void* b, size_t nb,
                 std::string* err);

// Reads one frame. False with *err at EOF (err "closed") or on a bad header (magic, version,
// type/length refused by client_payload_ok(type, len, max_shard_bytes)).
bool read_frame(int fd, uint64_t max_shard_bytes, uint16_t* type, std::vector<uint8_t>* payload,
                std::string* err);

// A byte buffer for frames and staging: big_alloc() memory (r2ccl/snapshot/big_buffer.h: from
// 2 MiB on, a mapping on transparent huge pages; below, malloc), faulted in from user mode when
// allocated with populate. Contents are unspecified. Move-only; not thread-safe.
class PageBuf {
 public:
  PageBuf() = default;
  ~PageBuf() { reset(); }
  PageBuf(PageBuf&& o) noexcept : p_(o.p_), n_(o.n_), cap_(o.cap_) {
    o.p_ = nullptr;
    o.n_ = 0;
    o.cap_ = 0;
  }
  PageBuf& operator=(PageBuf&& o) noexcept;
  PageBuf(const PageBuf&) = delete;
  PageBuf& operator=(const PageBuf&) = delete;
  // Replaces the buffer with one of n bytes and room for max(n, capacity); false (and empty)
  // when the memory is not there. populate false: a mapping faulted in on first touch instead.
  bool alloc(size_t n, bool populate = true, size_t capacity = 0);
  void reset();
  // Makes the buffer n bytes long within its capacity (no allocation, contents kept); false
  // when n is over the capacity.
  bool resize(size_t n) {
    if (n > cap_) return false;
    n_ = n;
    return true;
  }
  uint8_t* data() const { return p_; }
  size_t size() const { return n_; }
  size_t capacity() const { return cap_; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
  size_t cap_ = 0;
};

// Reads one frame like read_frame(), its payload into the memory `alloc(length)` returns
// (length > 0; null: the allocation failed, reported as an error).
bool read_frame_into(int fd, uint64_t max_shard_bytes, uint16_t* type,
                     const std::function<uint8_t*(size_t)>& alloc, std::string* err);

}  // namespace r2ccl::snap::client
