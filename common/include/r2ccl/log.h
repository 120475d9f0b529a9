// One logging facade for every r2ccl component.
//  - Messages go to NCCL's logger once init() hands one over (set_nccl_logger), with the
//    prefix of the component ("NET/R2CCL"). Without one (tools, tests), WARN goes to stderr
//    and INFO only when NCCL_DEBUG=INFO or TRACE.
//  - Events (switchover, failback, give-up, recovery) are WARN *and* one line on the event
//    sink with a CLOCK_MONOTONIC timestamp, because a silent failover hides a broken rail.
//    The sink is stderr unless R2CCL_LOG_FILE names a file, or "none".
//  - TRACE is compiled out unless R2CCL_ENABLE_TRACE is defined (data-path messages).
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdarg>
#include <string>

#include "r2ccl/nccl_abi.h"

namespace r2ccl {

void set_nccl_logger(ncclDebugLogger_t logger);
ncclDebugLogger_t nccl_logger();

// "stderr" (default), "none", or a file path (opened for append). Returns false and leaves the
// sink unchanged when the file cannot be opened.
bool set_event_sink(const std::string& spec, std::string* err);

void log_msg(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
             const char* fmt, ...) __attribute__((format(printf, 5, 6)));

// WARN through the logger plus one timestamped line on the event sink.
void log_event(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace r2ccl

#define R2CCL_WARN(...) ::r2ccl::log_msg(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, __VA_ARGS__)
#define R2CCL_INFO(flags, ...) ::r2ccl::log_msg(NCCL_LOG_INFO, (flags), __func__, __LINE__, __VA_ARGS__)
#ifdef R2CCL_ENABLE_TRACE
#define R2CCL_TRACE(...) ::r2ccl::log_msg(NCCL_LOG_TRACE, NCCL_NET, __func__, __LINE__, __VA_ARGS__)
#else
#define R2CCL_TRACE(...) \
  do {                   \
  } while (0)
#endif
