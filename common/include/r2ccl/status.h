// Internal status codes and the check macro. Mapped to ncclResult_t only at the ABI edge
// (net_plugin/abi/abi_nccl.cc); see to_nccl_result().
// Thread-safety: plain values.
#pragma once

#include "r2ccl/nccl_abi.h"

namespace r2ccl {

enum class [[nodiscard]] Status : int{
    kOk = 0,
    kInvalidUsage,  // bad configuration (env, handle from a user) -> ncclInvalidUsage
    kInternal,      // NCCL misused the API or a bug of ours -> ncclInternalError
    kSystem,        // no local rail works, OS failure -> ncclSystemError
    kRemote,        // the peer is gone or broke the protocol -> ncclRemoteError
};

const char* status_name(Status s);
ncclResult_t to_nccl_result(Status s);

}  // namespace r2ccl

// Propagate a non-OK status, leaving one breadcrumb per frame at TRACE level.
#define R2CCL_CHECK(expr)                                                  \
  do {                                                                     \
    ::r2ccl::Status r2ccl_st_ = (expr);                                    \
    if (r2ccl_st_ != ::r2ccl::Status::kOk) {                               \
      ::r2ccl::log_trace_breadcrumb(__FILE__, __LINE__, #expr, r2ccl_st_); \
      return r2ccl_st_;                                                    \
    }                                                                      \
  } while (0)

namespace r2ccl {
void log_trace_breadcrumb(const char* file, int line, const char* expr, Status s);
}
