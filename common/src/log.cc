#include "r2ccl/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "r2ccl/clock.h"

namespace r2ccl {
namespace {

std::atomic<ncclDebugLogger_t> g_logger{nullptr};
std::mutex g_sink_mu;
FILE* g_sink = stderr;       // guarded by g_sink_mu
bool g_sink_owned = false;   // guarded by g_sink_mu

int stderr_level() {
  static const int level = [] {
    const char* v = getenv("NCCL_DEBUG");
    if (!v) return static_cast<int>(NCCL_LOG_WARN);
    if (strcasecmp(v, "INFO") == 0) return static_cast<int>(NCCL_LOG_INFO);
    if (strcasecmp(v, "TRACE") == 0) return static_cast<int>(NCCL_LOG_TRACE);
    if (strcasecmp(v, "VERSION") == 0 || strcasecmp(v, "WARN") == 0)
      return static_cast<int>(NCCL_LOG_WARN);
    return static_cast<int>(NCCL_LOG_WARN);
  }();
  return level;
}

}  // namespace

void set_nccl_logger(ncclDebugLogger_t logger) { g_logger.store(logger); }
ncclDebugLogger_t nccl_logger() { return g_logger.load(); }

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

static void vlog(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                 const char* fmt, va_list ap) {
  char msg[1024];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  ncclDebugLogger_t logger = g_logger.load();
  if (logger) {
    logger(level, flags, file, line, "NET/R2CCL %s", msg);
    return;
  }
  if (static_cast<int>(level) <= stderr_level() && level != NCCL_LOG_NONE) {
    const char* tag = level == NCCL_LOG_WARN ? "WARN" : level == NCCL_LOG_INFO ? "INFO" : "TRACE";
    fprintf(stderr, "NET/R2CCL %s %s\n", tag, msg);
  }
}

void log_msg(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
             const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(level, flags, file, line, fmt, ap);
  va_end(ap);
}

void log_event(const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  ncclDebugLogger_t logger = g_logger.load();
  if (logger) logger(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, "NET/R2CCL %s", msg);
  std::lock_guard<std::mutex> lk(g_sink_mu);
  if (g_sink) {
    TimeUs t = now_us();
    fprintf(g_sink, "[%lld.%06lld] [R2CCL] %s\n", static_cast<long long>(t / kUsPerSec),
            static_cast<long long>(t % kUsPerSec), msg);
    fflush(g_sink);
  }
}

}  // namespace r2ccl
