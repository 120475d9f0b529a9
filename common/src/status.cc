#include "r2ccl/status.h"

#include "r2ccl/log.h"

namespace r2ccl {

const char* status_name(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kInvalidUsage: return "invalid usage";
    case Status::kInternal: return "internal error";
    case Status::kSystem: return "system error";
    case Status::kRemote: return "remote error";
  }
  return "unknown";
}

ncclResult_t to_nccl_result(Status s) {
  switch (s) {
    case Status::kOk: return ncclSuccess;
    case Status::kInvalidUsage: return ncclInvalidUsage;
    case Status::kInternal: return ncclInternalError;
    case Status::kSystem: return ncclSystemError;
    case Status::kRemote: return ncclRemoteError;
  }
  return ncclInternalError;
}

void log_trace_breadcrumb(const char* file, int line, const char* expr, Status s) {
#ifdef R2CCL_ENABLE_TRACE
  R2CCL_TRACE("%s:%d %s -> %s", file, line, expr, status_name(s));
#else
  (void)file;
  (void)line;
  (void)expr;
  (void)s;
#endif
}

}  // namespace r2ccl
