// SendMessage: the sender's checkpoint of one message: which chunks are unsent, in flight on
// which path, or acknowledged. Replay after a path failure re-queues exactly the chunks that
// path had in flight and that are not acknowledged; they are sent again straight from the
// caller's buffer. Pure logic. Thread-safety: none; the owning connection serialises calls.
//
// Chunking: a message of `size` bytes is cut into ceil(size / chunk) chunks (one empty chunk
// for a 0-byte message). Chunk i covers [i*chunk, min(size, (i+1)*chunk)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace r2ccl::net {

class SendMessage {
 public:
  static constexpr int8_t kNoPath = -1;

  void reset(uint64_t seq, uint64_t size, uint64_t chunk_size);

  uint64_t seq() const { return seq_; }
  uint64_t size() const { return size_; }
  uint32_t nchunks() const { return nchunks_; }
  uint64_t chunk_offset(uint32_t i) const { return static_cast<uint64_t>(i) * chunk_; }
  uint32_t chunk_len(uint32_t i) const;

  // The next chunk to put on the wire: replays first, then never-sent chunks.
  bool peek_next(uint32_t* idx) const;
  bool has_unsent() const { return !replay_.empty() || next_new_ < nchunks_; }
  // Assigns the chunk returned by peek_next to `path`. Returns true if it was a replay.
  bool take_next(int path);

  // Applies an acknowledgement: every chunk < prefix, plus bit b of `bitmap` for chunk
  // base+b. For each chunk newly acknowledged, calls on_acked(path, len).
  template <typename F>
  int apply_ack(uint32_t prefix, uint32_t base, uint64_t bitmap, F&& on_acked);

  // The path failed: its unacknowledged chunks return to the replay queue (unless `replay`
  // is false, the test hook that proves replay matters). Returns how many.
  int fail_path(int path, bool replay);

  uint32_t acked() const { return acked_count_; }
  // Replayed chunks not yet acknowledged (a recovery is over when this reaches 0).
  uint32_t replay_outstanding() const { return replay_outstanding_; }
  bool complete() const { return acked_count_ == nchunks_; }
  int inflight_on(int path) const;

 private:
  void ack_one(uint32_t i, int* n);
  uint64_t seq_ = 0;
  uint64_t size_ = 0;
  uint64_t chunk_ = 1;
  uint32_t nchunks_ = 0;
  uint32_t next_new_ = 0;
  uint32_t acked_count_ = 0;
  uint32_t acked_prefix_ = 0;  // every chunk below is acknowledged
  std::vector<int8_t> path_;   // kNoPath: unsent or queued for replay
  std::vector<uint8_t> acked_;
  std::vector<uint8_t> replayed_;
  uint32_t replay_outstanding_ = 0;
  std::deque<uint32_t> replay_;
  // Per-ack callback plumbing (set during apply_ack only).
  int8_t last_acked_path_ = kNoPath;
};

template <typename F>
int SendMessage::apply_ack(uint32_t prefix, uint32_t base, uint64_t bitmap, F&& on_acked) {
  int n = 0;
  prefix = prefix > nchunks_ ? nchunks_ : prefix;
  for (uint32_t i = acked_prefix_; i < prefix; ++i) {
    if (!acked_[i]) {
      ack_one(i, &n);
      on_acked(last_acked_path_, chunk_len(i));
    }
  }
  if (prefix > acked_prefix_) acked_prefix_ = prefix;
  for (int b = 0; b < 64 && bitmap; ++b, bitmap >>= 1) {
    if (!(bitmap & 1)) continue;
    uint64_t i = static_cast<uint64_t>(base) + b;
    if (i >= nchunks_ || acked_[i]) continue;
    ack_one(static_cast<uint32_t>(i), &n);
    on_acked(last_acked_path_, chunk_len(static_cast<uint32_t>(i)));
  }
  while (acked_prefix_ < nchunks_ && acked_[acked_prefix_]) ++acked_prefix_;
  return n;
}

}  // namespace r2ccl::net
