// The snapshot sidecar's log lines: common's facade (r2ccl/log.h) as Component::kSnapshot,
// for r2ccl_snapshotd, the client library and the core they share.
//   client library (a training process; INFO only with NCCL_DEBUG=INFO):
//     SNAPSHOT/R2CCL WARN snapshot rebuild: ncclCommShrink failed ...
//   r2ccl_snapshotd (set_stderr_options(true, NCCL_LOG_INFO): stamped, INFO always shown):
//     [12345.678901] SNAPSHOT/R2CCL INFO node 1 is up (membership epoch 2)
//   the recovery line, an event (r2ccl_snap_log_recovered):
//     [12345.678901] [R2CCL] Successfully recovered in 1.887 s (node loss: 3; ...)
// No NCCL logger: NCCL hands none to the sidecar. Thread-safety: as the facade's.
#pragma once

#include "r2ccl/log.h"

#define SNAP_WARN(...)                                                                          \
  ::r2ccl::log_from(::r2ccl::Component::kSnapshot, nullptr, NCCL_LOG_WARN, NCCL_INIT, __FILE__, \
                    __LINE__, __VA_ARGS__)
#define SNAP_INFO(...)                                                                          \
  ::r2ccl::log_from(::r2ccl::Component::kSnapshot, nullptr, NCCL_LOG_INFO, NCCL_INIT, __func__, \
                    __LINE__, __VA_ARGS__)
