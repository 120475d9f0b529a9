// RecvMessage: the receiver's side of one posted receive: the stale-data guard and the
// duplicate filter. A chunk's payload may be written into the posted buffer only when
//   - its message is posted and not yet completed,
//   - its index has not landed yet, and
//   - offset + length fits the posted buffer and the header agrees with earlier chunks.
// Anything else is read into a discard buffer and counted; a header that lies about
// offset/length/total is a protocol error on the path that carried it, never a write.
// Pure logic. Thread-safety: none; the owning connection serialises calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace r2ccl::net {

enum class ChunkVerdict : uint8_t {
  kWrite,          // read the payload into buffer + offset
  kDuplicate,      // already landed (a replay crossed the original): discard, count
  kProtocolError,  // lying header: fail the path, discard
};

struct GuardOptions {
  bool dedup = true;        // test hook: false counts duplicates as new chunks
  bool stale_guard = true;  // test hook: false skips the bounds/consistency checks
};

class RecvMessage {
 public:
  void reset(uint64_t seq, char* buf, uint64_t capacity);

  uint64_t seq() const { return seq_; }
  char* buffer() const { return buf_; }
  uint64_t capacity() const { return cap_; }

  // Checks a DATA header. `total` is the message size the sender announced, `nchunks` its
  // chunk count. Sets *why on a protocol error.
  ChunkVerdict check(uint64_t total, uint32_t nchunks, uint32_t idx, uint64_t offset, uint32_t len,
                     const GuardOptions& opt, const char** why);
  // RDMA: the NIC has already placed chunk `idx` (len bytes at idx * chunk) into the buffer;
  // the write-with-immediate names the chunk and whether it is the message's last. The
  // message's size becomes known with its last chunk (total = idx * chunk + len). Checks:
  // every chunk but the last is exactly `chunk` bytes, the last fits the posted capacity,
  // indices stay below the last. A chunk already landed is a duplicate. Call mark_landed on
  // kWrite. (The RDMA stale-data guard proper is the bilateral QP error transition.)
  ChunkVerdict check_placed(uint32_t idx, uint32_t len, bool last, uint64_t chunk,
                            const GuardOptions& opt, const char** why);
  // True while the chunk may still be written (re-checked before every partial read, so a
  // chunk that lands on another path meanwhile sends the rest of this one to discard).
  // dedup=false (test hook no_dedup): a landed chunk is written, and counted, again.
  bool wants(uint32_t idx, bool dedup = true) const {
    return nchunks_ != 0 && idx < nchunks_ && (!dedup || !landed_[idx]);
  }
  // The whole payload of chunk idx is in the buffer.
  void mark_landed(uint32_t idx, const GuardOptions& opt);

  bool complete() const { return nchunks_ != 0 && landed_count_ >= nchunks_; }
  // Chunks landed so far (for an RDMA message whose size is not known yet).
  uint32_t landed_count() const { return landed_count_; }
  bool landed(uint32_t idx) const { return idx < landed_.size() && landed_[idx]; }
  // One past the highest chunk index seen so far (the message's chunk count once known).
  uint32_t span() const { return static_cast<uint32_t>(landed_.size()); }
  uint64_t total() const { return total_; }
  uint32_t nchunks() const { return nchunks_; }
  // Lowest index not landed (every chunk below has landed).
  uint32_t prefix() const { return prefix_; }
  // Bitmap of landed chunks in [base, base+64).
  uint64_t window_bitmap(uint32_t base) const;

 private:
  uint64_t seq_ = 0;
  char* buf_ = nullptr;
  uint64_t cap_ = 0;
  uint64_t total_ = 0;
  uint32_t nchunks_ = 0;  // 0 until the first chunk header is accepted
  uint32_t landed_count_ = 0;
  uint32_t prefix_ = 0;
  std::vector<uint8_t> landed_;
};

}  // namespace r2ccl::net
