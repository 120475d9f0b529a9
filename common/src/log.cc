#include "r2ccl/log.h"

#include <strings.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "r2ccl/clock.h"

namespace r2ccl {
namespace {

std::atomic<ncclDebugLogger_t> g_logger[kNumComponents] = {};
std::atomic<bool> g_stderr_stamp{false};
std::atomic<int> g_stderr_level{-1};  // -1: from NCCL_DEBUG
std::mutex g_sink_mu;
FILE* g_sink = stderr;      // guarded by g_sink_mu
bool g_sink_owned = false;  // guarded by g_sink_mu

int index_of(Component c) {
  const int i = static_cast<int>(c);
  return i >= 0 && i < kNumComponents ? i : 0;
}

int nccl_debug_level() {
  static const int level = [] {
    const char* v = getenv("NCCL_DEBUG");
    if (!v) return static_cast<int>(NCCL_LOG_WARN);
    if (strcasecmp(v, "INFO") == 0) return static_cast<int>(NCCL_LOG_INFO);
    if (strcasecmp(v, "TRACE") == 0) return static_cast<int>(NCCL_LOG_TRACE);
    return static_cast<int>(NCCL_LOG_WARN);  // WARN, VERSION, anything else
  }();
  return level;
}

int stderr_level() {
  const int set = g_stderr_level.load(std::memory_order_relaxed);
  return set >= 0 ? set : nccl_debug_level();
}

// "[SEC.USEC]" of CLOCK_MONOTONIC, the stamp of event lines and of a daemon's stderr lines.
void format_stamp(char* buf, size_t n) {
  const TimeUs t = now_us();
  snprintf(buf, n, "[%lld.%06lld]", static_cast<long long>(t / kUsPerSec),
           static_cast<long long>(t % kUsPerSec));
}

void vlog(Component c, ncclDebugLogger_t logger, ncclDebugLogLevel level, unsigned long flags,
          const char* file, int line, const char* fmt, va_list ap) {
  char msg[1024];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  const char* prefix = component_prefix(c);
  if (!logger) logger = g_logger[index_of(c)].load();
  if (logger) {
    logger(level, flags, file, line, "%s %s", prefix, msg);
    return;
  }
  if (level == NCCL_LOG_NONE || static_cast<int>(level) > stderr_level()) return;
  const char* tag = level == NCCL_LOG_WARN ? "WARN" : level == NCCL_LOG_INFO ? "INFO" : "TRACE";
  if (g_stderr_stamp.load(std::memory_order_relaxed)) {
    char stamp[48];
    format_stamp(stamp, sizeof(stamp));
    fprintf(stderr, "%s %s %s %s\n", stamp, prefix, tag, msg);
  } else {
    fprintf(stderr, "%s %s %s\n", prefix, tag, msg);
  }
}

void vevent(Component c, const char* fmt, va_list ap) {
  char msg[1024];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  ncclDebugLogger_t logger = g_logger[index_of(c)].load();
  if (logger)
    logger(NCCL_LOG_WARN, c == Component::kTuner ? NCCL_TUNING : NCCL_NET, __FILE__, __LINE__,
           "%s %s", component_prefix(c), msg);
  std::lock_guard<std::mutex> lk(g_sink_mu);
  if (g_sink) {
    char stamp[48];
    format_stamp(stamp, sizeof(stamp));
    fprintf(g_sink, "%s [R2CCL] %s\n", stamp, msg);
    fflush(g_sink);
  }
}

}  // namespace

const char* component_prefix(Component c) {
  switch (c) {
    case Component::kNet: return "NET/R2CCL";
    case Component::kTuner: return "TUNER/R2CCL";
    case Component::kSnapshot: return "SNAPSHOT/R2CCL";
  }
  return "R2CCL";
}

void set_nccl_logger(ncclDebugLogger_t logger) { set_nccl_logger(Component::kNet, logger); }
ncclDebugLogger_t nccl_logger() { return nccl_logger(Component::kNet); }
void set_nccl_logger(Component c, ncclDebugLogger_t logger) { g_logger[index_of(c)].store(logger); }
ncclDebugLogger_t nccl_logger(Component c) { return g_logger[index_of(c)].load(); }

void set_stderr_options(bool timestamps, ncclDebugLogLevel level) {
  g_stderr_stamp.store(timestamps);
  g_stderr_level.store(static_cast<int>(level));
}

bool set_event_sink(const std::string& spec, std::string* err) {
  FILE* f = nullptr;
  bool owned = false;
  if (spec.empty() || spec == "stderr") {
    f = stderr;
  } else if (spec == "none") {
    f = nullptr;
  } else {
    f = fopen(spec.c_str(), "a");
    if (!f) {
      if (err) *err = "cannot open R2CCL_LOG_FILE '" + spec + "': " + strerror(errno);
      return false;
    }
    setvbuf(f, nullptr, _IOLBF, 0);
    owned = true;
  }
  std::lock_guard<std::mutex> lk(g_sink_mu);
  if (g_sink_owned && g_sink) fclose(g_sink);
  g_sink = f;
  g_sink_owned = owned;
  return true;
}

void log_from(Component c, ncclDebugLogger_t logger, ncclDebugLogLevel level, unsigned long flags,
              const char* file, int line, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(c, logger, level, flags, file, line, fmt, ap);
  va_end(ap);
}

void log_msg(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
             const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(Component::kNet, nullptr, level, flags, file, line, fmt, ap);
  va_end(ap);
}

void log_event(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vevent(Component::kNet, fmt, ap);
  va_end(ap);
}

void log_event(Component c, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vevent(c, fmt, ap);
  va_end(ap);
}

}  // namespace r2ccl
