#include "net_harness.h"

#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

namespace r2ccl::test {
namespace {

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

void child_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  if (level > NCCL_LOG_WARN && !getenv("R2CCL_TEST_VERBOSE")) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "[pid %d] %s\n", getpid(), msg);
}

bool write_all(int fd, const void* p, size_t n) {
  auto* b = static_cast<const char*>(p);
  while (n) {
    ssize_t w = ::write(fd, b, n);
    if (w <= 0) return false;
    b += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n) {
  auto* b = static_cast<char*>(p);
  while (n) {
    ssize_t r = ::read(fd, b, n);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

int status_code(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return -1;
}

}  // namespace

std::string env_or(const char* name, const char* fallback) {
  const char* v = getenv(name);
  return v && *v ? v : fallback;
}

bool load_plugin(Plugin* p, std::string* err, const char* path) {
  std::string so = path ? path : env_or("R2CCL_TEST_PLUGIN", "libnccl-net-r2ccl.so");
  p->dl = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!p->dl) {
    *err = std::string("dlopen ") + so + ": " + dlerror();
    return false;
  }
  p->net = static_cast<const ncclNet_v11_t*>(dlsym(p->dl, "ncclNetPlugin_v11"));
  if (!p->net) {
    *err = "no ncclNetPlugin_v11 in " + so;
    return false;
  }
  return true;
}

void* Endpoint::mhandle_for(void* buf, size_t size) {
  for (auto& m : mrs)
    if (m.first == buf) return m.second;
  void* mh = nullptr;
  if (plugin.net->regMr(comm, buf, size, NCCL_PTR_HOST, &mh) != ncclSuccess) return nullptr;
  mrs.push_back({buf, mh});
  return mh;
}

ncclResult_t Endpoint::post_send(void* buf, size_t size, void** req, int timeout_ms) {
  *req = nullptr;
  void* mh = mhandle_for(buf, size ? size : 1);
  double end = now_s() + timeout_ms / 1e3;
  while (!*req) {
    ncclResult_t r = plugin.net->isend(comm, buf, size, 0, mh, nullptr, req);
    if (r != ncclSuccess) return r;
    if (!*req && now_s() > end) return ncclInProgress;  // timed out
  }
  return ncclSuccess;
}

ncclResult_t Endpoint::post_recv(void* buf, size_t size, void** req, int timeout_ms) {
  *req = nullptr;
  void* mh = mhandle_for(buf, size ? size : 1);
  double end = now_s() + timeout_ms / 1e3;
  int tag = 0;
  while (!*req) {
    ncclResult_t r = plugin.net->irecv(comm, 1, &buf, &size, &tag, &mh, nullptr, req);
    if (r != ncclSuccess) return r;
    if (!*req && now_s() > end) return ncclInProgress;
  }
  return ncclSuccess;
}

ncclResult_t Endpoint::wait(void* req, int timeout_ms, int* size_out) {
  double end = now_s() + timeout_ms / 1e3;
  for (;;) {
    int done = 0, size = 0;
    ncclResult_t r = plugin.net->test(req, &done, &size);
    if (r != ncclSuccess) return r;
    if (done) {
      if (size_out) *size_out = size;
      return ncclSuccess;
    }
    if (now_s() > end) return ncclInProgress;
  }
}

ncclResult_t Endpoint::send(void* buf, size_t size, int timeout_ms, int* size_out) {
  void* req = nullptr;
  ncclResult_t r = post_send(buf, size, &req, timeout_ms);
  if (r != ncclSuccess) return r;
  return wait(req, timeout_ms, size_out);
}

ncclResult_t Endpoint::recv(void* buf, size_t size, int timeout_ms, int* size_out) {
  void* req = nullptr;
  ncclResult_t r = post_recv(buf, size, &req, timeout_ms);
  if (r != ncclSuccess) return r;
  return wait(req, timeout_ms, size_out);
}

static int child_main(const PairOptions& o, bool is_sender, int handle_fd, int peer_pid,
                      const EndpointFn& fn) {
  for (const auto& kv : o.env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  for (const auto& kv : (is_sender ? o.sender_env : o.receiver_env))
    setenv(kv.first.c_str(), kv.second.c_str(), 1);
  Endpoint ep;
  ep.dev = o.dev;
  ep.peer_pid = peer_pid;
  std::string err;
  if (!load_plugin(&ep.plugin, &err)) {
    fprintf(stderr, "%s\n", err.c_str());
    return 90;
  }
  ncclNetCommConfig_v11_t cfg{-1};
  ncclResult_t r = ep.plugin.net->init(&ep.ctx, 0x1234, &cfg, child_logger, nullptr);
  if (r != ncclSuccess) {
    fprintf(stderr, "init failed: %d\n", r);
    return 91;
  }
  if (!o.skip_connect) {
    char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
    double end = now_s() + o.connect_timeout_ms / 1e3;
    if (!is_sender) {
      void* listen = nullptr;
      if (ep.plugin.net->listen(ep.ctx, o.dev, handle, &listen) != ncclSuccess) return 92;
      if (!write_all(handle_fd, handle, sizeof(handle))) return 93;
      while (!ep.comm) {
        if (ep.plugin.net->accept(listen, &ep.comm, nullptr) != ncclSuccess) return 94;
        if (now_s() > end) return 95;
      }
      ep.plugin.net->closeListen(listen);
    } else {
      if (!read_all(handle_fd, handle, sizeof(handle))) return 93;
      while (!ep.comm) {
        if (ep.plugin.net->connect(ep.ctx, o.dev, handle, &ep.comm, nullptr) != ncclSuccess) return 94;
        if (now_s() > end) return 95;
      }
    }
  }
  int rc = fn(ep);
  fflush(stdout);
  fflush(stderr);
  return rc;
}

PairResult run_pair(const PairOptions& o, const EndpointFn& sender, const EndpointFn& receiver) {
  PairResult res;
  int fds[2];
  if (pipe(fds) != 0) return res;
  double t0 = now_s();
  pid_t rpid = fork();
  if (rpid == 0) {
    close(fds[0]);
    _exit(child_main(o, false, fds[1], 0, receiver));
  }
  pid_t spid = fork();
  if (spid == 0) {
    close(fds[1]);
    _exit(child_main(o, true, fds[0], rpid, sender));
  }
  close(fds[0]);
  close(fds[1]);
  int sst = -1, rst = -1;
  bool s_done = false, r_done = false;
  while (!(s_done && r_done)) {
    int st;
    if (!s_done && waitpid(spid, &st, WNOHANG) == spid) {
      s_done = true;
      sst = status_code(st);
    }
    if (!r_done && waitpid(rpid, &st, WNOHANG) == rpid) {
      r_done = true;
      rst = status_code(st);
    }
    if (now_s() - t0 > o.timeout_s) {
      if (!s_done) kill(spid, SIGKILL);
      if (!r_done) kill(rpid, SIGKILL);
    }
    if (!(s_done && r_done)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  res.sender_status = sst;
  res.receiver_status = rst;
  res.seconds = now_s() - t0;
  return res;
}

void fill_pattern(void* buf, size_t n, uint64_t seed) {
  auto* b = static_cast<uint8_t*>(buf);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    memcpy(b + i, &x, 8);
  }
  for (; i < n; ++i) b[i] = static_cast<uint8_t>(i * 131 + seed);
}

long long check_pattern(const void* buf, size_t n, uint64_t seed) {
  auto* b = static_cast<const uint8_t*>(buf);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if (memcmp(b + i, &x, 8) != 0) return static_cast<long long>(i);
  }
  for (; i < n; ++i)
    if (b[i] != static_cast<uint8_t>(i * 131 + seed)) return static_cast<long long>(i);
  return -1;
}

std::string temp_path(const std::string& tag) {
  static int counter = 0;
  return env_or("TMPDIR", "/tmp") + "/r2ccl-test-" + std::to_string(getpid()) + "-" +
         std::to_string(counter++) + "-" + tag;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int count_lines_containing(const std::string& text, const std::string& needle) {
  int n = 0;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.find(needle) != std::string::npos) ++n;
  return n;
}

int run_command(const std::string& cmd, std::string* output) {
  std::string full = cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  std::string out;
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int st = pclose(p);
  if (output) *output = out;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace r2ccl::test
