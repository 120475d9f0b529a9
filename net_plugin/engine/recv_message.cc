#include "recv_message.h"

namespace r2ccl::net {

// The smallest chunk a sender may use (R2CCL_CHUNK_SIZE's minimum): bounds the chunk count
// a header may announce for a given buffer, so a lying header cannot make us allocate much.
static constexpr uint64_t kMinChunk = 4096;

void RecvMessage::reset(uint64_t seq, char* buf, uint64_t capacity) {
  seq_ = seq;
  buf_ = buf;
  cap_ = capacity;
  total_ = 0;
  nchunks_ = 0;
  landed_count_ = 0;
  prefix_ = 0;
  landed_.clear();
}

ChunkVerdict RecvMessage::check(uint64_t total, uint32_t nchunks, uint32_t idx, uint64_t offset,
                                uint32_t len, const GuardOptions& opt, const char** why) {
  // The first header fixes the message's total and chunk count, but only once the whole
  // header has passed the checks: a refused header must not decide the size the genuine
  // chunks (replayed on another path) are then held to.
  const bool first = nchunks_ == 0;
  if (first) {
    if (opt.stale_guard) {
      if (total > cap_) {
        *why = "message larger than the posted receive";
        return ChunkVerdict::kProtocolError;
      }
      const uint64_t max_chunks = total / kMinChunk + 1;
      if (nchunks == 0 || nchunks > max_chunks) {
        *why = "chunk count does not fit the message size";
        return ChunkVerdict::kProtocolError;
      }
    } else if (nchunks == 0) {
      nchunks = 1;
    }
  } else if (opt.stale_guard && (total != total_ || nchunks != nchunks_)) {
    *why = "chunk header disagrees with earlier chunks of the message";
    return ChunkVerdict::kProtocolError;
  }
  const uint64_t msg_total = first ? total : total_;
  const uint32_t msg_chunks = first ? nchunks : nchunks_;
  if (opt.stale_guard) {
    if (idx >= msg_chunks) {
      *why = "chunk index out of range";
      return ChunkVerdict::kProtocolError;
    }
    if (offset > msg_total || len > msg_total - offset) {
      *why = "chunk offset/length outside the message";
      return ChunkVerdict::kProtocolError;
    }
  }
  if (first) {
    total_ = total;
    nchunks_ = nchunks;
    landed_.assign(nchunks_, 0);
  }
  if (idx < nchunks_ && landed_[idx] && opt.dedup) return ChunkVerdict::kDuplicate;
  return ChunkVerdict::kWrite;
}

ChunkVerdict RecvMessage::check_placed(uint32_t idx, uint32_t len, bool last, uint64_t chunk,
                                       const GuardOptions& opt, const char** why) {
  if (chunk == 0) chunk = 1;
  const uint64_t max_chunks = cap_ / chunk + 1;
  const uint64_t off = static_cast<uint64_t>(idx) * chunk;
  if (opt.stale_guard) {
    if (idx >= max_chunks || len > chunk || off + len > cap_) {
      *why = "chunk outside the posted receive";
      return ChunkVerdict::kProtocolError;
    }
    if (!last && len != chunk) {
      *why = "a chunk other than the last is shorter than the chunk size";
      return ChunkVerdict::kProtocolError;
    }
    if (last && nchunks_ == 0 && landed_count_ > 0 && prefix_ > idx + 1) {
      *why = "last chunk index below chunks already landed";
      return ChunkVerdict::kProtocolError;
    }
    if (nchunks_ != 0 && (idx >= nchunks_ || (last && idx + 1 != nchunks_))) {
      *why = "chunk index disagrees with the message's last chunk";
      return ChunkVerdict::kProtocolError;
    }
  }
  if (idx >= max_chunks) {
    *why = "chunk index beyond the posted receive";
    return ChunkVerdict::kProtocolError;  // never index past what the buffer can hold
  }
  if (last && nchunks_ == 0) {
    nchunks_ = idx + 1;
    total_ = off + len;
  }
  if (landed_.size() <= idx) landed_.resize(static_cast<size_t>(idx) + 1, 0);
  if (landed_[idx] && opt.dedup) return ChunkVerdict::kDuplicate;
  return ChunkVerdict::kWrite;
}

void RecvMessage::mark_landed(uint32_t idx, const GuardOptions& opt) {
  if (idx >= landed_.size()) return;
  if (landed_[idx] && opt.dedup) return;
  landed_[idx] = 1;
  ++landed_count_;
  while (prefix_ < landed_.size() && landed_[prefix_]) ++prefix_;
}

uint64_t RecvMessage::window_bitmap(uint32_t base) const {
  uint64_t bm = 0;
  for (uint32_t b = 0; b < 64; ++b) {
    uint64_t i = static_cast<uint64_t>(base) + b;
    if (i >= landed_.size()) break;
    if (landed_[i]) bm |= 1ull << b;
  }
  return bm;
}

}  // namespace r2ccl::net
