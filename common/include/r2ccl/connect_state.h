// NCCL calls connect() again and again with the same handle buffer until it returns a comm
// (reference §4: a NULL comm means "call again"). The connection being built is remembered in
// the handle's last 16 bytes: NCCL keeps the buffer per connection, and the peer's listen()
// left those bytes zeroed. A magic number tells "in progress" from a fresh handle.
// Thread-safety: the handle belongs to the one thread calling connect() for it.
#pragma once

#include <cstdint>
#include <cstring>

#include "r2ccl/nccl_abi.h"
#include "r2ccl/status.h"

namespace r2ccl {

template <typename T>
class HandleConnectState {
 public:
  struct Slot {
    uint64_t magic;
    T* obj;
  };
  static constexpr size_t kOffset = NCCL_NET_HANDLE_MAXSIZE - sizeof(Slot);

  // The object stored with `magic`, or nullptr for a fresh handle.
  static T* get(const void* handle, uint64_t magic) {
    Slot s;
    memcpy(&s, static_cast<const char*>(handle) + kOffset, sizeof(s));
    return s.magic == magic ? s.obj : nullptr;
  }
  static void set(void* handle, uint64_t magic, T* obj) {
    Slot s{magic, obj};
    memcpy(static_cast<char*>(handle) + kOffset, &s, sizeof(s));
  }
  static void clear(void* handle) { memset(static_cast<char*>(handle) + kOffset, 0, sizeof(Slot)); }

  // One connect() call: runs step_fn(obj, &done). When the connection is complete it goes to
  // *out; on an error it is deleted. Either way the slot is cleared.
  template <typename StepFn>
  static Status step(void* handle, T* obj, void** out, StepFn&& step_fn) {
    bool done = false;
    Status s = step_fn(obj, &done);
    if (s != Status::kOk || done) {
      clear(handle);
      if (s != Status::kOk) {
        delete obj;
        return s;
      }
      *out = obj;
    }
    return Status::kOk;
  }
};

}  // namespace r2ccl
