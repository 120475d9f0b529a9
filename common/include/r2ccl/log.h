// One logging facade for every r2ccl component.
//  - Every message belongs to a component, whose prefix starts its line:
//      Component::kNet       "NET/R2CCL"       the net plugin (libnccl-net-r2ccl.so) and the
//                                               common code it runs (R2CCL_WARN/R2CCL_INFO)
//      Component::kTuner     "TUNER/R2CCL"     the tuner plugin (libnccl-tuner-r2ccl.so)
//      Component::kSnapshot  "SNAPSHOT/R2CCL"  the snapshot sidecar: r2ccl_snapshotd and the
//                                               client library libr2ccl-snapshot.so
//    The net plugin and the tuner are separate .so files, each with its own copy of this
//    facade (and a test binary may hold both in one copy), so the component travels with each
//    call, never as process-wide state.
//  - A message goes to the component's NCCL logger once init() hands one over
//    (set_nccl_logger), or to the logger a call names, as "PREFIX message" (NCCL adds level,
//    host and time). Without one (tools, tests, the sidecar) it goes to stderr as
//    "PREFIX LEVEL message": WARN always, INFO only when NCCL_DEBUG=INFO or TRACE, e.g.
//      NET/R2CCL WARN ...             TUNER/R2CCL INFO ...           SNAPSHOT/R2CCL WARN ...
//    A daemon (r2ccl_snapshotd) calls set_stderr_options(true, NCCL_LOG_INFO): its stderr is
//    its log, so every line is stamped with CLOCK_MONOTONIC seconds and INFO is always shown:
//      [12345.678901] SNAPSHOT/R2CCL INFO node 1 is up (membership epoch 2)
//  - Events (switchover, failback, give-up, recovery) are WARN *and* one line on the event
//    sink with a CLOCK_MONOTONIC timestamp, because a silent failover hides a broken rail:
//      [12345.678901] [R2CCL] switchover: rail ...
//    The event tag is "[R2CCL]" whatever the component (scripts look for "[R2CCL] Successfully
//    recovered in"); the WARN copy has the component's prefix. The sink is stderr unless
//    set_event_sink() names a file (the net plugin: R2CCL_LOG_FILE), or "none".
//  - TRACE is compiled out unless R2CCL_ENABLE_TRACE is defined (data-path messages).
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdarg>
#include <string>

#include "r2ccl/nccl_abi.h"

namespace r2ccl {

enum class Component : int { kNet = 0, kTuner, kSnapshot };
constexpr int kNumComponents = 3;
const char* component_prefix(Component c);  // "NET/R2CCL", "TUNER/R2CCL", "SNAPSHOT/R2CCL"

// The NCCL logger of a component (nullptr: none, stderr). The forms without a component are
// the net plugin's.
void set_nccl_logger(ncclDebugLogger_t logger);
ncclDebugLogger_t nccl_logger();
void set_nccl_logger(Component c, ncclDebugLogger_t logger);
ncclDebugLogger_t nccl_logger(Component c);

// stderr lines of this copy of the facade: `timestamps` puts "[SEC.USEC] " (CLOCK_MONOTONIC)
// before each; `level` (NCCL_LOG_WARN, _INFO or _TRACE) replaces NCCL_DEBUG's threshold. For
// processes that are not NCCL's (r2ccl_snapshotd); messages through an NCCL logger are
// unaffected.
void set_stderr_options(bool timestamps, ncclDebugLogLevel level);

// "stderr" (default), "none", or a file path (opened for append). Returns false and leaves the
// sink unchanged when the file cannot be opened.
bool set_event_sink(const std::string& spec, std::string* err);

// The call under every macro: component c, through `logger` when not nullptr, else through
// the component's logger, else stderr.
void log_from(Component c, ncclDebugLogger_t logger, ncclDebugLogLevel level, unsigned long flags,
              const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 7, 8)));

// The net plugin's (Component::kNet).
void log_msg(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
             const char* fmt, ...) __attribute__((format(printf, 5, 6)));

// WARN through the component's logger plus one timestamped line on the event sink. The form
// without a component is the net plugin's.
void log_event(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void log_event(Component c, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace r2ccl

// Component::kNet. Other components have their own macros over log_from(): TUNER_WARN and
// TUNER_INFO (tuner_plugin/src/tuner_core.h), SNAP_WARN and SNAP_INFO
// (snapshot/include/r2ccl/snapshot/log.h).
#define R2CCL_WARN(...) ::r2ccl::log_msg(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, __VA_ARGS__)
#define R2CCL_INFO(flags, ...) \
  ::r2ccl::log_msg(NCCL_LOG_INFO, (flags), __func__, __LINE__, __VA_ARGS__)
#ifdef R2CCL_ENABLE_TRACE
#define R2CCL_TRACE(...) ::r2ccl::log_msg(NCCL_LOG_TRACE, NCCL_NET, __func__, __LINE__, __VA_ARGS__)
#else
#define R2CCL_TRACE(...) \
  do {                   \
  } while (0)
#endif
