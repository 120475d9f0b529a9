// R2CCL_TEST_HOOKS: protections the test suite switches off to prove each one matters.
// Parsed the same way by every transport; a hook a transport does not have is accepted and
// has no effect there (no_bilateral_err and force_flush are verbs-only). Thread-safety: pure.
#pragma once

#include <string>

#include "recv_message.h"

namespace r2ccl::net {

struct TestHooks {
  GuardOptions guard;         // no_dedup, no_stale_guard
  bool replay = true;         // no_replay: a failed path's chunks are not re-sent
  bool bilateral_err = true;  // no_bilateral_err (verbs): replay without moving the peer's
                              // QPs of the failed path to ERR first
  bool force_flush = false;   // force_flush (verbs): iflush reads back host buffers too, so
                              // the GPU flush path runs on machines without a GPU
};

// Returns false with *err naming R2CCL_TEST_HOOKS and the accepted hooks.
bool parse_test_hooks(const std::string& s, TestHooks* out, std::string* err);

}  // namespace r2ccl::net
