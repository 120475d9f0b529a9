// R2CCL_TEST_HOOKS: protections the test suite switches off to prove each one matters.
// Parsed the same way by every transport; a hook a transport does not have is accepted and
// has no effect there (no_bilateral_err, force_flush and gpu_pci are verbs-only). Thread-safety:
// pure.
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
  // gpu_pci=PATH (verbs): regMr accepts NCCL_PTR_CUDA in every build (host memory stands in
  // for GPU memory) and every such buffer's GPU is the PCI function at this sysfs path (e.g.
  // /sys/devices/pci0000:00/0000:00:01.0/0000:0d:00.0; it need not exist), instead of the
  // CUDA driver's answer. "" = off.
  std::string gpu_pci;
  // no_goodput: the scheduler as before issue 16: weights are the configured rail speed and
  // striping is least-loaded among the paths with room (no waiting for a full faster path).
  // The A/B reference of docs/BENCHMARKS.md; R2CCL_FAILOVER_SPREAD is separate.
  bool goodput = true;
};

// Returns false with *err naming R2CCL_TEST_HOOKS and the accepted hooks.
bool parse_test_hooks(const std::string& s, TestHooks* out, std::string* err);

}  // namespace r2ccl::net
