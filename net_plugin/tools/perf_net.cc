#include "perf_net.h"

#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <strings.h>
#include <unistd.h>

#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifndef R2PERF_LIBDIR
#define R2PERF_LIBDIR "lib"
#endif

namespace r2perf {

const char* nccl_result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
  }
  return "unknown ncclResult_t";
}

// ---------------------------------------------------------------- logger

namespace {

int g_log_rank = -1;

int debug_threshold() {
  static const int level = [] {
    const char* v = getenv("NCCL_DEBUG");
    if (!v) return static_cast<int>(NCCL_LOG_WARN);
    if (strcasecmp(v, "NONE") == 0) return static_cast<int>(NCCL_LOG_NONE);
    if (strcasecmp(v, "INFO") == 0) return static_cast<int>(NCCL_LOG_INFO);
    if (strcasecmp(v, "TRACE") == 0) return static_cast<int>(NCCL_LOG_TRACE);
    return static_cast<int>(NCCL_LOG_WARN);
  }();
  return level;
}

const char* host_name() {
  static char host[256] = "";
  if (!host[0]) {
    if (gethostname(host, sizeof(host) - 1) != 0) snprintf(host, sizeof(host), "unknown");
    char* dot = strchr(host, '.');
    if (dot) *dot = 0;
  }
  return host;
}

}  // namespace

void set_log_rank(int rank) { g_log_rank = rank; }

void perf_logger(ncclDebugLogLevel level, unsigned long /*flags*/, const char* /*file*/,
                 int /*line*/, const char* fmt, ...) {
  const char* tag;
  int need;
  switch (level) {
    case NCCL_LOG_WARN:
    case NCCL_LOG_ABORT:
      tag = "WARN";
      need = NCCL_LOG_WARN;
      break;
    case NCCL_LOG_INFO:
      tag = "INFO";
      need = NCCL_LOG_INFO;
      break;
    case NCCL_LOG_TRACE:
      tag = "TRACE";
      need = NCCL_LOG_TRACE;
      break;
    default: return;  // NONE, VERSION: nothing to say
  }
  if (debug_threshold() < need) return;
  char line[2048];
  int n = snprintf(line, sizeof(line), "%s:%d:%d [%d] NCCL %s ", host_name(),
                   static_cast<int>(getpid()), static_cast<int>(gettid()), g_log_rank, tag);
  if (n < 0) return;
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(line + n, sizeof(line) - static_cast<size_t>(n) - 1, fmt, ap);
  va_end(ap);
  size_t len = static_cast<size_t>(n) + (m < 0 ? 0 : static_cast<size_t>(m));
  if (len > sizeof(line) - 2) len = sizeof(line) - 2;
  if (len == 0 || line[len - 1] != '\n') line[len++] = '\n';
  // One write so that lines of concurrent ranks do not interleave.
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w;
}

// ---------------------------------------------------------------- loading

namespace {

bool starts_with(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }
bool ends_with(const std::string& s, const char* p) {
  size_t n = strlen(p);
  return s.size() >= n && s.compare(s.size() - n, n, p) == 0;
}

std::string exe_dir() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  buf[n] = 0;
  std::string p(buf);
  size_t slash = p.rfind('/');
  return slash == std::string::npos ? "" : p.substr(0, slash);
}

// Lexically removes "." and "dir/.." from an absolute path.
std::string normalize(const std::string& path) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    std::string part = path.substr(i, j - i);
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
    } else if (!part.empty() && part != ".") {
      parts.push_back(part);
    }
    i = j + 1;
  }
  std::string out;
  for (const std::string& part : parts) out += "/" + part;
  return out.empty() ? "/" : out;
}

// NCCL's two attempts, then the places a build tree or an install tree keep the library,
// relative to the executable's directory: BUILD/bin/r2ccl_perf next to BUILD/lib/ (the build
// tree mirrors the install tree), PREFIX/bin/r2ccl_perf next to PREFIX/lib/ or
// PREFIX/$LIBDIR/, and ../net_plugin/ for a build tree that keeps per-directory outputs.
std::vector<std::string> candidates(const std::string& spec) {
  std::vector<std::string> out{spec};
  bool has_slash = spec.find('/') != std::string::npos;
  bool lib_so = starts_with(spec, "lib") && ends_with(spec, ".so");
  std::string file = lib_so ? spec : "libnccl-net-" + spec + ".so";
  if (!has_slash && !lib_so) out.push_back(file);
  if (!has_slash) {
    std::string dir = exe_dir();
    if (!dir.empty()) {
      for (const char* rel : {"../lib", "../" R2PERF_LIBDIR, "../net_plugin"}) {
        std::string p = normalize(dir + "/" + rel + "/" + file);
        bool dup = false;
        for (const std::string& q : out) dup = dup || q == p;
        if (!dup) out.push_back(p);
      }
    }
  }
  return out;
}

}  // namespace

void Net::load(const std::string& spec, int force_api) {
  std::string errors;
  std::string opened;
  for (const std::string& c : candidates(spec)) {
    dl_ = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (dl_) {
      opened = c;
      break;
    }
    const char* e = dlerror();  // names the file already
    errors += "\n  " + (e ? std::string(e) : c + ": dlopen failed");
  }
  if (!dl_) throw PerfError("cannot load net plugin '" + spec + "':" + errors);

  path_ = opened;
  struct link_map* lm = nullptr;
  if (dlinfo(dl_, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0]) {
    char real[PATH_MAX];
    path_ = realpath(lm->l_name, real) ? real : lm->l_name;
  }

  for (int v : {11, 10, 9, 8}) {
    if (force_api && v != force_api) continue;
    std::string sym = "ncclNetPlugin_v" + std::to_string(v);
    void* p = dlsym(dl_, sym.c_str());
    if (!p) continue;
    api_ = v;
    switch (v) {
      case 11:
        v11_ = static_cast<const ncclNet_v11_t*>(p);
        name_ = v11_->name ? v11_->name : "";
        break;
      case 10:
        v10_ = static_cast<const ncclNet_v10_t*>(p);
        name_ = v10_->name ? v10_->name : "";
        break;
      case 9:
        v9_ = static_cast<const ncclNet_v9_t*>(p);
        name_ = v9_->name ? v9_->name : "";
        break;
      default:
        v8_ = static_cast<const ncclNet_v8_t*>(p);
        name_ = v8_->name ? v8_->name : "";
        break;
    }
    return;
  }
  if (force_api)
    throw PerfError(path_ + " has no ncclNetPlugin_v" + std::to_string(force_api) + " symbol");
  throw PerfError(path_ + " exports none of ncclNetPlugin_v11, _v10, _v9, _v8");
}

void* Net::symbol(const char* name) const { return dl_ ? dlsym(dl_, name) : nullptr; }

#define R2PERF_DISPATCH(call11, call10, call9, call8) \
  switch (api_) {                                     \
    case 11: return v11_->call11;                     \
    case 10: return v10_->call10;                     \
    case 9: return v9_->call9;                        \
    default: return v8_->call8;                       \
  }

void Net::init_process() {
  ncclResult_t r = ncclSuccess;
  switch (api_) {
    case 11: return;
    case 10: r = v10_->init(perf_logger, nullptr); break;
    case 9: r = v9_->init(perf_logger); break;
    default: r = v8_->init(perf_logger); break;
  }
  if (r != ncclSuccess) throw PerfError(std::string("init failed: ") + nccl_result_name(r));
}

void* Net::init_comm(uint64_t comm_id) {
  if (api_ != 11) return nullptr;
  void* ctx = nullptr;
  ncclNetCommConfig_v11_t config{NCCL_NET_TRAFFIC_CLASS_UNDEF};  // NCCL's stack copy
  ncclResult_t r = v11_->init(&ctx, comm_id, &config, perf_logger, nullptr);
  if (r != ncclSuccess) {
    v11_->finalize(ctx);  // NCCL finalizes even a failed init
    throw PerfError(std::string("init(v11) failed: ") + nccl_result_name(r));
  }
  return ctx;
}

void Net::finalize_comm(void* ctx) {
  if (api_ != 11) return;
  ncclResult_t r = v11_->finalize(ctx);
  if (r != ncclSuccess) throw PerfError(std::string("finalize failed: ") + nccl_result_name(r));
}

int Net::devices() {
  int n = 0;
  ncclResult_t r;
  switch (api_) {
    case 11: r = v11_->devices(&n); break;
    case 10: r = v10_->devices(&n); break;
    case 9: r = v9_->devices(&n); break;
    default: r = v8_->devices(&n); break;
  }
  if (r != ncclSuccess) throw PerfError(std::string("devices failed: ") + nccl_result_name(r));
  if (n <= 0) throw PerfError("devices reported " + std::to_string(n) + " devices");
  return n;
}

DevInfo Net::properties(int dev) {
  DevInfo d;
  ncclResult_t r;
  auto take = [&d](const auto& p) {
    d.name = p.name ? p.name : "?";
    d.ptr_support = p.ptrSupport;
    d.max_recvs = p.maxRecvs;
    d.speed = p.speed;
  };
  if (api_ == 11) {
    ncclNetProperties_v11_t p{};
    r = v11_->getProperties(dev, &p);
    if (r == ncclSuccess) {
      take(p);
      d.max_p2p_bytes = p.maxP2pBytes;
    }
  } else if (api_ == 10 || api_ == 9) {
    ncclNetProperties_v9_t p{};
    r = api_ == 10 ? v10_->getProperties(dev, &p) : v9_->getProperties(dev, &p);
    if (r == ncclSuccess) {
      take(p);
      d.max_p2p_bytes = p.maxP2pBytes;
    }
  } else {
    ncclNetProperties_v8_t p{};
    r = v8_->getProperties(dev, &p);
    if (r == ncclSuccess) take(p);
  }
  if (r != ncclSuccess)
    throw PerfError("getProperties(dev " + std::to_string(dev) +
                    ") failed: " + nccl_result_name(r));
  return d;
}

ncclResult_t Net::listen(void* ctx, int dev, void* handle, void** lc) {
  R2PERF_DISPATCH(listen(ctx, dev, handle, lc), listen(dev, handle, lc), listen(dev, handle, lc),
                  listen(dev, handle, lc));
}

ncclResult_t Net::connect(void* ctx, int dev, void* handle, void** sc) {
  ncclNetDeviceHandle_v8_t* dev_handle = nullptr;  // host only: stays NULL
  R2PERF_DISPATCH(connect(ctx, dev, handle, sc, &dev_handle),
                  connect(dev, &config_, handle, sc, &dev_handle),
                  connect(dev, handle, sc, &dev_handle), connect(dev, handle, sc, &dev_handle));
}

ncclResult_t Net::accept(void* lc, void** rc) {
  ncclNetDeviceHandle_v8_t* dev_handle = nullptr;
  R2PERF_DISPATCH(accept(lc, rc, &dev_handle), accept(lc, rc, &dev_handle),
                  accept(lc, rc, &dev_handle), accept(lc, rc, &dev_handle));
}

ncclResult_t Net::reg_mr(void* comm, void* data, size_t size, void** mh) {
  R2PERF_DISPATCH(
      regMr(comm, data, size, NCCL_PTR_HOST, mh), regMr(comm, data, size, NCCL_PTR_HOST, mh),
      regMr(comm, data, size, NCCL_PTR_HOST, mh), regMr(comm, data, size, NCCL_PTR_HOST, mh));
}

ncclResult_t Net::dereg_mr(void* comm, void* mh) {
  R2PERF_DISPATCH(deregMr(comm, mh), deregMr(comm, mh), deregMr(comm, mh), deregMr(comm, mh));
}

ncclResult_t Net::isend(void* sc, void* data, size_t size, int tag, void* mh, void** req) {
  *req = nullptr;
  if (api_ == 8) {
    if (size > static_cast<size_t>(INT_MAX))
      throw PerfError("isend of " + std::to_string(size) + " bytes does not fit net API v8's int");
    return v8_->isend(sc, data, static_cast<int>(size), tag, mh, req);
  }
  switch (api_) {
    case 11: return v11_->isend(sc, data, size, tag, mh, nullptr, req);
    case 10: return v10_->isend(sc, data, size, tag, mh, nullptr, req);
    default: return v9_->isend(sc, data, size, tag, mh, req);
  }
}

ncclResult_t Net::irecv(void* rc, void* data, size_t size, int tag, void* mh, void** req) {
  void* bufs[1] = {data};
  int tags[1] = {tag};
  void* mhs[1] = {mh};
  void* sentinel =
      reinterpret_cast<void*>(static_cast<uintptr_t>(NCCL_NET_OPTIONAL_RECV_COMPLETION));
  ncclResult_t r;
  if (api_ == 8) {
    if (size > static_cast<size_t>(INT_MAX))
      throw PerfError("irecv of " + std::to_string(size) + " bytes does not fit net API v8's int");
    int sizes[1] = {static_cast<int>(size)};
    *req = nullptr;
    return v8_->irecv(rc, 1, bufs, sizes, tags, mhs, req);
  }
  size_t sizes[1] = {size};
  void* phandles[1] = {nullptr};
  *req = sentinel;  // NCCL 2.24+ (v9+) may store NCCL_NET_OPTIONAL_RECV_COMPLETION here
  switch (api_) {
    case 11: r = v11_->irecv(rc, 1, bufs, sizes, tags, mhs, phandles, req); break;
    case 10: r = v10_->irecv(rc, 1, bufs, sizes, tags, mhs, phandles, req); break;
    default: r = v9_->irecv(rc, 1, bufs, sizes, tags, mhs, req); break;
  }
  if (r == ncclSuccess && *req == sentinel)
    throw PerfError(
        "irecv returned success but left NCCL_NET_OPTIONAL_RECV_COMPLETION (0x1) in "
        "*request; it must store a request or NULL");
  if (r != ncclSuccess) *req = nullptr;
  return r;
}

ncclResult_t Net::iflush(void* rc, void* data, int size, void* mh, void** req) {
  void* bufs[1] = {data};
  int sizes[1] = {size};
  void* mhs[1] = {mh};
  *req = nullptr;
  R2PERF_DISPATCH(iflush(rc, 1, bufs, sizes, mhs, req), iflush(rc, 1, bufs, sizes, mhs, req),
                  iflush(rc, 1, bufs, sizes, mhs, req), iflush(rc, 1, bufs, sizes, mhs, req));
}

ncclResult_t Net::test(void* req, int* done, int* size) {
  R2PERF_DISPATCH(test(req, done, size), test(req, done, size), test(req, done, size),
                  test(req, done, size));
}

ncclResult_t Net::close_send(void* c) {
  R2PERF_DISPATCH(closeSend(c), closeSend(c), closeSend(c), closeSend(c));
}
ncclResult_t Net::close_recv(void* c) {
  R2PERF_DISPATCH(closeRecv(c), closeRecv(c), closeRecv(c), closeRecv(c));
}
ncclResult_t Net::close_listen(void* c) {
  R2PERF_DISPATCH(closeListen(c), closeListen(c), closeListen(c), closeListen(c));
}

}  // namespace r2perf
