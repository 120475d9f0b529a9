// common's log facade (r2ccl/log.h): every component's prefix on stderr and through NCCL's
// logger, one NCCL logger per component (the net plugin's never receives the tuner's lines),
// event lines, and the daemon's stamped stderr lines.
#include <stdlib.h>
#include <strings.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "r2ccl/log.h"

using r2ccl::Component;

namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// What f writes to file descriptor 2.
std::string capture_stderr(const std::function<void()>& f) {
  fflush(stderr);
  char path[] = "/tmp/r2ccl-unit-log-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  const int saved = dup(2);
  REQUIRE(saved >= 0);
  dup2(fd, 2);
  f();
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  std::string out = read_all(path);
  unlink(path);
  return out;
}

std::vector<std::string> g_net, g_tuner;

void format_into(std::vector<std::string>* to, ncclDebugLogLevel level, const char* fmt,
                 va_list ap) {
  char msg[2048];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  to->push_back(std::string(level == NCCL_LOG_WARN ? "WARN " : "INFO ") + msg);
}
void net_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  format_into(&g_net, level, fmt, ap);
  va_end(ap);
}
void tuner_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  format_into(&g_tuner, level, fmt, ap);
  va_end(ap);
}

bool info_shown() {
  const char* v = getenv("NCCL_DEBUG");
  return v && (strcasecmp(v, "INFO") == 0 || strcasecmp(v, "TRACE") == 0);
}

}  // namespace

TEST_CASE("log: component prefixes", "[unit][log]") {
  CHECK(std::string(r2ccl::component_prefix(Component::kNet)) == "NET/R2CCL");
  CHECK(std::string(r2ccl::component_prefix(Component::kTuner)) == "TUNER/R2CCL");
  CHECK(std::string(r2ccl::component_prefix(Component::kSnapshot)) == "SNAPSHOT/R2CCL");
}

TEST_CASE("log: without a logger, stderr lines are PREFIX LEVEL message", "[unit][log]") {
  const std::string out = capture_stderr([] {
    R2CCL_WARN("net %d", 1);
    r2ccl::log_from(Component::kTuner, nullptr, NCCL_LOG_WARN, NCCL_TUNING, "f", 1, "tuner %d", 2);
    r2ccl::log_from(Component::kSnapshot, nullptr, NCCL_LOG_WARN, NCCL_INIT, "f", 1, "snap %d", 3);
    r2ccl::log_from(Component::kSnapshot, nullptr, NCCL_LOG_INFO, NCCL_INIT, "f", 1, "info");
  });
  std::string want = "NET/R2CCL WARN net 1\nTUNER/R2CCL WARN tuner 2\nSNAPSHOT/R2CCL WARN snap 3\n";
  if (info_shown()) want += "SNAPSHOT/R2CCL INFO info\n";  // NCCL_DEBUG=INFO in this environment
  CHECK(out == want);
}

TEST_CASE("log: each component has its own NCCL logger", "[unit][log]") {
  g_net.clear();
  g_tuner.clear();
  r2ccl::set_nccl_logger(net_logger);  // the net plugin's form
  r2ccl::set_nccl_logger(Component::kTuner, tuner_logger);
  CHECK(r2ccl::nccl_logger() == &net_logger);
  CHECK(r2ccl::nccl_logger(Component::kNet) == &net_logger);
  CHECK(r2ccl::nccl_logger(Component::kTuner) == &tuner_logger);
  CHECK(r2ccl::nccl_logger(Component::kSnapshot) == nullptr);
  const std::string out = capture_stderr([] {
    R2CCL_WARN("a %s", "net line");
    R2CCL_INFO(NCCL_INIT, "an info line");
    r2ccl::log_from(Component::kTuner, nullptr, NCCL_LOG_WARN, NCCL_TUNING, "f", 1, "a tuner line");
    // A logger named by the call (a tuner context's) wins over the component's.
    r2ccl::log_from(Component::kTuner, net_logger, NCCL_LOG_INFO, NCCL_TUNING, "f", 1, "ctx");
    r2ccl::log_from(Component::kSnapshot, nullptr, NCCL_LOG_WARN, NCCL_INIT, "f", 1, "no logger");
  });
  CHECK(g_net == std::vector<std::string>{"WARN NET/R2CCL a net line",
                                          "INFO NET/R2CCL an info line", "INFO TUNER/R2CCL ctx"});
  CHECK(g_tuner == std::vector<std::string>{"WARN TUNER/R2CCL a tuner line"});
  CHECK(out == "SNAPSHOT/R2CCL WARN no logger\n");
  r2ccl::set_nccl_logger(nullptr);
  r2ccl::set_nccl_logger(Component::kTuner, nullptr);
}

TEST_CASE("log: events are stamped [R2CCL] lines; the WARN copy has the component's prefix",
          "[unit][log]") {
  char path[] = "/tmp/r2ccl-unit-events-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  std::string err;
  REQUIRE(r2ccl::set_event_sink(path, &err));
  g_net.clear();
  g_tuner.clear();
  r2ccl::set_nccl_logger(Component::kTuner, tuner_logger);
  const std::string out = capture_stderr([] {
    r2ccl::log_event("switchover: rail %s failed", "lo");
    r2ccl::log_event(Component::kSnapshot, "Successfully recovered in %.3f s (node loss: 3)", 1.0);
    r2ccl::log_event(Component::kTuner, "a tuner event");
  });
  REQUIRE(r2ccl::set_event_sink("stderr", &err));
  r2ccl::set_nccl_logger(Component::kTuner, nullptr);
  CHECK(out.empty());  // no logger: the event line is the only line
  CHECK(g_net.empty());
  CHECK(g_tuner == std::vector<std::string>{"WARN TUNER/R2CCL a tuner event"});
  const std::string lines = read_all(path);
  unlink(path);
  INFO(lines);
  CHECK(std::regex_match(
      lines, std::regex("\\[[0-9]+\\.[0-9]{6}\\] \\[R2CCL\\] switchover: rail lo failed\n"
                        "\\[[0-9]+\\.[0-9]{6}\\] \\[R2CCL\\] Successfully recovered in "
                        "1\\.000 s \\(node loss: 3\\)\n"
                        "\\[[0-9]+\\.[0-9]{6}\\] \\[R2CCL\\] a tuner event\n")));
}

// Last: the options stay set for the rest of this process.
TEST_CASE("log: a daemon's stderr lines are stamped and show INFO", "[unit][log]") {
  r2ccl::set_stderr_options(true, NCCL_LOG_INFO);
  g_net.clear();
  r2ccl::set_nccl_logger(net_logger);
  const std::string out = capture_stderr([] {
    r2ccl::log_from(Component::kSnapshot, nullptr, NCCL_LOG_INFO, NCCL_INIT, "f", 1,
                    "node %u is up", 1u);
    r2ccl::log_from(Component::kSnapshot, nullptr, NCCL_LOG_WARN, NCCL_INIT, "f", 1,
                    "declared failed");
    R2CCL_INFO(NCCL_INIT, "through the logger, unstamped");
  });
  r2ccl::set_nccl_logger(nullptr);
  INFO(out);
  CHECK(std::regex_match(
      out, std::regex("\\[[0-9]+\\.[0-9]{6}\\] SNAPSHOT/R2CCL INFO node 1 is up\n"
                      "\\[[0-9]+\\.[0-9]{6}\\] SNAPSHOT/R2CCL WARN declared failed\n")));
  CHECK(g_net == std::vector<std::string>{"INFO NET/R2CCL through the logger, unstamped"});
  r2ccl::set_stderr_options(false, NCCL_LOG_WARN);
  const std::string plain = capture_stderr([] {
    r2ccl::log_from(Component::kSnapshot, nullptr, NCCL_LOG_INFO, NCCL_INIT, "f", 1, "hidden");
    r2ccl::log_from(Component::kSnapshot, nullptr, NCCL_LOG_WARN, NCCL_INIT, "f", 1, "shown");
  });
  CHECK(plain == "SNAPSHOT/R2CCL WARN shown\n");
}
