#include "send_message.h"

#include <algorithm>

namespace r2ccl::net {

void SendMessage::reset(uint64_t seq, uint64_t size, uint64_t chunk_size) {
  seq_ = seq;
  size_ = size;
  chunk_ = chunk_size ? chunk_size : 1;
  nchunks_ = size == 0 ? 1 : static_cast<uint32_t>((size + chunk_ - 1) / chunk_);
  next_new_ = 0;
  acked_count_ = 0;
  acked_prefix_ = 0;
  path_.assign(nchunks_, kNoPath);
  acked_.assign(nchunks_, 0);
  replayed_.assign(nchunks_, 0);
  replay_outstanding_ = 0;
  replay_.clear();
}

uint32_t SendMessage::chunk_len(uint32_t i) const {
  uint64_t off = chunk_offset(i);
  if (off >= size_) return 0;
  return static_cast<uint32_t>(std::min<uint64_t>(chunk_, size_ - off));
}

bool SendMessage::peek_next(uint32_t* idx) const {
  if (!replay_.empty()) {
    *idx = replay_.front();
    return true;
  }
  if (next_new_ < nchunks_) {
    *idx = next_new_;
    return true;
  }
  return false;
}

bool SendMessage::take_next(int path) {
  if (!replay_.empty()) {
    path_[replay_.front()] = static_cast<int8_t>(path);
    replay_.pop_front();
    return true;
  }
  path_[next_new_++] = static_cast<int8_t>(path);
  return false;
}

void SendMessage::ack_one(uint32_t i, int* n) {
  acked_[i] = 1;
  ++acked_count_;
  if (replayed_[i]) {
    replayed_[i] = 0;
    --replay_outstanding_;
  }
  ++*n;
  last_acked_path_ = path_[i];
  // An acknowledged chunk still waiting in the replay queue must not go out again.
  if (path_[i] == kNoPath) {
    auto it = std::find(replay_.begin(), replay_.end(), i);
    if (it != replay_.end()) replay_.erase(it);
  }
}

int SendMessage::fail_path(int path, bool replay) {
  int n = 0;
  for (uint32_t i = acked_prefix_; i < next_new_; ++i) {
    if (acked_[i] || path_[i] != path) continue;
    path_[i] = kNoPath;
    if (replay) {
      replay_.push_back(i);
      if (!replayed_[i]) {
        replayed_[i] = 1;
        ++replay_outstanding_;
      }
    }
    ++n;
  }
  return n;
}

int SendMessage::inflight_on(int path) const {
  int n = 0;
  for (uint32_t i = acked_prefix_; i < next_new_; ++i)
    if (!acked_[i] && path_[i] == path) ++n;
  return n;
}

}  // namespace r2ccl::net
