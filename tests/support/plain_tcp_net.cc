// PlainTCP: a small baseline NCCL net plugin for tests and side-by-side benchmarks with r2ccl.
// It is a test tool, not the product: no multipath, no failover, no tuning.
//
//  - One device, "lo", 127.0.0.1. One TCP socket per connection.
//  - listen/connect/accept never block: connect returns a NULL comm (call again) while the TCP
//    handshake is in progress. The connect state (stage, fd) lives in the spare bytes of the
//    caller's handle, so the caller must pass the same handle buffer on every retry (NCCL does).
//  - isend/irecv/test never block (non-blocking sockets). Wire format per message: 8-byte
//    little-endian payload size, then the payload. Sender pushes; the receiver reads messages
//    into its posted buffers in post order. Receive sizes are upper bounds; test reports the
//    actual size. A message larger than the posted buffer fails with ncclInternalError.
//  - maxRecvs 1, 32 requests per comm (a full pool returns a NULL request: call again).
//  - Exports ncclNetPlugin_v8 .. _v11, name "PlainTCP". iflush returns a NULL request.
//  - Test hook: PLAINTCP_FAIL_SEND_AFTER=N makes every isend after the first N of the process
//    fail with ncclSystemError, so tools can test their error paths. PLAINTCP_NULL_EVERY=N
//    makes every Nth isend/irecv return success with a NULL request (busy: call again).
//  - Exports r2cclExt_v1 (r2ccl/ext.h) with one rail that never fails: chunks_sent counts
//    messages, replays stay 0. Lets tools test their --stats path without r2ccl.
// Thread-safety: each comm has a mutex (regMr may run beside test on another thread).
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>

#include "r2ccl/ext.h"
#include "r2ccl/nccl_abi.h"

namespace {

constexpr uint32_t kMagic = 0x50544350;  // "PTCP"
constexpr int kMaxRequests = NCCL_NET_MAX_REQUESTS;
constexpr size_t kMaxMsg = 1ull << 30;

ncclDebugLogger_t g_log = nullptr;
#define PT_WARN(...)                                                                            \
  do {                                                                                          \
    if (g_log) g_log(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, "NET/PlainTCP " __VA_ARGS__); \
  } while (0)
#define PT_INFO(...)                                                                            \
  do {                                                                                          \
    if (g_log) g_log(NCCL_LOG_INFO, NCCL_NET, __func__, __LINE__, "NET/PlainTCP " __VA_ARGS__); \
  } while (0)

struct Handle {
  uint32_t magic;
  int32_t stage;  // connect state: 0 fresh, 1 handshake in progress
  int32_t fd;     // socket while stage == 1
  sockaddr_in addr;
};
static_assert(sizeof(Handle) <= NCCL_NET_HANDLE_MAXSIZE, "handle too large");

struct ListenComm {
  int fd;
};

struct Comm;
struct Request {
  Comm* comm = nullptr;
  bool used = false;
  bool done = false;
  char* data = nullptr;
  size_t size = 0;  // send: payload size; recv: capacity, then the actual size
  size_t off = 0;   // bytes moved, header included
  unsigned char hdr[8] = {};
};

struct Comm {
  int fd = -1;
  bool is_send = false;
  std::mutex mu;
  Request reqs[kMaxRequests];
  std::deque<Request*> queue;  // posted, not yet complete, in post order
  ncclResult_t err = ncclSuccess;
};

std::atomic<uint64_t> g_msgs_sent{0}, g_bytes_sent{0};
long g_fail_send_after = -1;  // PLAINTCP_FAIL_SEND_AFTER, read at init
std::atomic<long> g_isends{0};
long g_null_every = 0;  // PLAINTCP_NULL_EVERY, read at init
std::atomic<long> g_posts{0};

bool fake_busy() { return g_null_every > 0 && ++g_posts % g_null_every == 0; }
int g_mr_token;  // regMr hands out its address: nothing needs registering

ncclResult_t set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return ncclSystemError;
  return ncclSuccess;
}

Comm* new_comm(int fd, bool is_send) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  Comm* c = new Comm;
  c->fd = fd;
  c->is_send = is_send;
  for (Request& r : c->reqs) r.comm = c;
  return c;
}

ncclResult_t fail(Comm* c, ncclResult_t r, const char* what, int e) {
  if (c->err == ncclSuccess) {
    PT_WARN("%s on fd %d failed: %s", what, c->fd, e ? strerror(e) : "connection closed by peer");
    c->err = r;
  }
  return c->err;
}

// Moves bytes for the requests at the head of the queue until the socket would block.
ncclResult_t progress(Comm* c) {
  if (c->err != ncclSuccess) return c->err;
  while (!c->queue.empty()) {
    Request* r = c->queue.front();
    while (r->off < 8 + r->size) {
      bool in_hdr = r->off < 8;
      char* p = in_hdr ? reinterpret_cast<char*>(r->hdr) + r->off : r->data + (r->off - 8);
      size_t len = in_hdr ? 8 - r->off : r->size - (r->off - 8);
      ssize_t n = c->is_send ? send(c->fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                             : recv(c->fd, p, len, MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return ncclSuccess;
        if (errno == EINTR) continue;
        int e = errno;
        bool remote = e == ECONNRESET || e == EPIPE;
        return fail(c, remote ? ncclRemoteError : ncclSystemError, c->is_send ? "send" : "recv", e);
      }
      if (n == 0) return fail(c, ncclRemoteError, "recv", 0);
      r->off += static_cast<size_t>(n);
      if (!c->is_send && r->off == 8) {
        uint64_t sz = 0;
        for (int i = 7; i >= 0; i--) sz = (sz << 8) | r->hdr[i];
        if (sz > r->size) {
          PT_WARN("message of %lu bytes does not fit the posted %zu-byte buffer",
                  static_cast<unsigned long>(sz), r->size);
          c->err = ncclInternalError;
          return c->err;
        }
        r->size = sz;
      }
    }
    r->done = true;
    if (c->is_send) {
      g_msgs_sent++;
      g_bytes_sent += r->size;
    }
    c->queue.pop_front();
  }
  return ncclSuccess;
}

Request* get_request(Comm* c) {
  for (Request& r : c->reqs) {
    if (!r.used) {
      r.used = true;
      r.done = false;
      r.off = 0;
      return &r;
    }
  }
  return nullptr;
}

// ---- version-neutral implementation ----

ncclResult_t pt_init(ncclDebugLogger_t log) {
  if (log) g_log = log;
  const char* fail = getenv("PLAINTCP_FAIL_SEND_AFTER");
  if (fail) g_fail_send_after = strtol(fail, nullptr, 10);
  const char* busy = getenv("PLAINTCP_NULL_EVERY");
  if (busy) g_null_every = strtol(busy, nullptr, 10);
  PT_INFO("PlainTCP baseline plugin, 1 device (lo 127.0.0.1)");
  return ncclSuccess;
}

ncclResult_t pt_devices(int* ndev) {
  *ndev = 1;
  return ncclSuccess;
}

template <typename P>
void fill_common(P* p) {
  static char name[] = "lo";
  p->name = name;
  p->pciPath = nullptr;
  p->guid = 0;
  p->ptrSupport = NCCL_PTR_HOST;
  p->regIsGlobal = 0;
  p->speed = 10000;
  p->port = 0;
  p->latency = 0;
  p->maxComms = 65536;
  p->maxRecvs = 1;
  p->netDeviceType = NCCL_NET_DEVICE_HOST;
  p->netDeviceVersion = 0;
}
template <typename P>
void fill_v9(P* p) {
  fill_common(p);
  p->forceFlush = 0;
  p->vProps.ndevs = 1;
  p->vProps.devs[0] = 0;
  p->maxP2pBytes = kMaxMsg;
  p->maxCollBytes = kMaxMsg;
}

ncclResult_t pt_listen(int dev, void* handle, void** listenComm) {
  if (dev != 0) return ncclInvalidArgument;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ncclSystemError;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0 || listen(fd, 16) < 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &alen) < 0 || set_nonblock(fd)) {
    PT_WARN("listen: %s", strerror(errno));
    close(fd);
    return ncclSystemError;
  }
  Handle h{};
  h.magic = kMagic;
  h.fd = -1;
  h.addr = a;
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(handle, &h, sizeof(h));
  *listenComm = new ListenComm{fd};
  return ncclSuccess;
}

ncclResult_t pt_connect(int dev, void* handle, void** sendComm) {
  *sendComm = nullptr;
  Handle* h = static_cast<Handle*>(handle);
  if (dev != 0 || h->magic != kMagic) return ncclInvalidArgument;
  if (h->stage == 0) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return ncclSystemError;
    if (connect(fd, reinterpret_cast<sockaddr*>(&h->addr), sizeof(h->addr)) < 0 &&
        errno != EINPROGRESS) {
      PT_WARN("connect: %s", strerror(errno));
      close(fd);
      return ncclSystemError;
    }
    h->fd = fd;
    h->stage = 1;
    return ncclSuccess;  // NULL comm: call again
  }
  pollfd p{h->fd, POLLOUT, 0};
  if (poll(&p, 1, 0) <= 0) return ncclSuccess;
  int err = 0;
  socklen_t len = sizeof(err);
  getsockopt(h->fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err) {
    PT_WARN("connect: %s", strerror(err));
    close(h->fd);
    h->stage = 0;
    h->fd = -1;
    return ncclSystemError;
  }
  *sendComm = new_comm(h->fd, true);
  h->stage = 0;
  h->fd = -1;
  return ncclSuccess;
}

ncclResult_t pt_accept(void* listenComm, void** recvComm) {
  *recvComm = nullptr;
  int fd = accept4(static_cast<ListenComm*>(listenComm)->fd, nullptr, nullptr,
                   SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return ncclSuccess;
    PT_WARN("accept: %s", strerror(errno));
    return ncclSystemError;
  }
  *recvComm = new_comm(fd, false);
  return ncclSuccess;
}

ncclResult_t pt_regMr(void* comm, void*, size_t, int type, void** mhandle) {
  if (!comm || type != NCCL_PTR_HOST) return ncclInternalError;
  *mhandle = &g_mr_token;
  return ncclSuccess;
}
ncclResult_t pt_regMrDmaBuf(void*, void*, size_t, int, uint64_t, int, void**) {
  return ncclInternalError;
}
ncclResult_t pt_deregMr(void*, void* mhandle) {
  return mhandle == &g_mr_token ? ncclSuccess : ncclInternalError;
}

ncclResult_t pt_isend(void* sendComm, void* data, size_t size, void** request) {
  Comm* c = static_cast<Comm*>(sendComm);
  *request = nullptr;
  if (size > kMaxMsg) return ncclInternalError;
  if (g_fail_send_after >= 0 && g_isends++ >= g_fail_send_after) {
    PT_WARN("isend fails on purpose (PLAINTCP_FAIL_SEND_AFTER=%ld)", g_fail_send_after);
    return ncclSystemError;
  }
  if (fake_busy()) return ncclSuccess;
  std::lock_guard<std::mutex> lk(c->mu);
  if (c->err != ncclSuccess) return c->err;
  Request* r = get_request(c);
  if (!r) return ncclSuccess;  // pool full: call again
  r->data = static_cast<char*>(data);
  r->size = size;
  for (int i = 0; i < 8; i++) r->hdr[i] = static_cast<unsigned char>(size >> (8 * i));
  c->queue.push_back(r);
  *request = r;
  return progress(c);
}

ncclResult_t pt_irecv(void* recvComm, int n, void** data, size_t size, void** request) {
  Comm* c = static_cast<Comm*>(recvComm);
  *request = nullptr;  // overwrites NCCL_NET_OPTIONAL_RECV_COMPLETION too
  if (n != 1) return ncclInternalError;
  if (fake_busy()) return ncclSuccess;
  std::lock_guard<std::mutex> lk(c->mu);
  if (c->err != ncclSuccess) return c->err;
  Request* r = get_request(c);
  if (!r) return ncclSuccess;
  r->data = static_cast<char*>(data[0]);
  r->size = size;
  c->queue.push_back(r);
  *request = r;
  return progress(c);
}

ncclResult_t pt_iflush(void*, int, void**, int*, void**, void** request) {
  *request = nullptr;  // host memory: nothing to flush
  return ncclSuccess;
}

ncclResult_t pt_test(void* request, int* done, int* sizes) {
  Request* r = static_cast<Request*>(request);
  Comm* c = r->comm;
  std::lock_guard<std::mutex> lk(c->mu);
  *done = 0;
  if (!r->used) return ncclInternalError;
  ncclResult_t res = progress(c);
  if (res != ncclSuccess) return res;
  if (r->done) {
    *done = 1;
    if (sizes) sizes[0] = static_cast<int>(r->size);
    r->used = false;
  }
  return ncclSuccess;
}

ncclResult_t pt_close(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  if (!c) return ncclSuccess;
  close(c->fd);
  delete c;
  return ncclSuccess;
}
ncclResult_t pt_closeListen(void* listenComm) {
  ListenComm* l = static_cast<ListenComm*>(listenComm);
  if (!l) return ncclSuccess;
  close(l->fd);
  delete l;
  return ncclSuccess;
}

// ---- per-version entry points ----

ncclResult_t v8_getProperties(int dev, ncclNetProperties_v8_t* p) {
  if (dev != 0) return ncclInvalidArgument;
  fill_common(p);
  return ncclSuccess;
}
ncclResult_t v9_getProperties(int dev, ncclNetProperties_v9_t* p) {
  if (dev != 0) return ncclInvalidArgument;
  fill_v9(p);
  return ncclSuccess;
}
ncclResult_t v11_getProperties(int dev, ncclNetProperties_v11_t* p) {
  if (dev != 0) return ncclInvalidArgument;
  fill_v9(p);
  p->maxMultiRequestSize = 1;
  return ncclSuccess;
}

ncclResult_t v8_connect(int dev, void* handle, void** sendComm, ncclNetDeviceHandle_v8_t**) {
  return pt_connect(dev, handle, sendComm);
}
ncclResult_t v10_connect(int dev, ncclNetCommConfig_v10_t*, void* handle, void** sendComm,
                         ncclNetDeviceHandle_v10_t**) {
  return pt_connect(dev, handle, sendComm);
}
ncclResult_t v11_connect(void*, int dev, void* handle, void** sendComm,
                         ncclNetDeviceHandle_v11_t**) {
  return pt_connect(dev, handle, sendComm);
}
ncclResult_t v8_accept(void* listenComm, void** recvComm, ncclNetDeviceHandle_v8_t**) {
  return pt_accept(listenComm, recvComm);
}
ncclResult_t v11_listen(void*, int dev, void* handle, void** listenComm) {
  return pt_listen(dev, handle, listenComm);
}

ncclResult_t v8_isend(void* c, void* data, int size, int, void*, void** req) {
  if (size < 0) return ncclInternalError;
  return pt_isend(c, data, static_cast<size_t>(size), req);
}
ncclResult_t v9_isend(void* c, void* data, size_t size, int, void*, void** req) {
  return pt_isend(c, data, size, req);
}
ncclResult_t v10_isend(void* c, void* data, size_t size, int, void*, void*, void** req) {
  return pt_isend(c, data, size, req);
}
ncclResult_t v8_irecv(void* c, int n, void** data, int* sizes, int*, void**, void** req) {
  if (n != 1 || sizes[0] < 0) return ncclInternalError;
  return pt_irecv(c, n, data, static_cast<size_t>(sizes[0]), req);
}
ncclResult_t v9_irecv(void* c, int n, void** data, size_t* sizes, int*, void**, void** req) {
  if (n != 1) return ncclInternalError;
  return pt_irecv(c, n, data, sizes[0], req);
}
ncclResult_t v10_irecv(void* c, int n, void** data, size_t* sizes, int*, void**, void**,
                       void** req) {
  if (n != 1) return ncclInternalError;
  return pt_irecv(c, n, data, sizes[0], req);
}

ncclResult_t v10_init(ncclDebugLogger_t log, ncclProfilerCallback_t) { return pt_init(log); }

int g_ctx_token;
ncclResult_t v11_init(void** ctx, uint64_t, ncclNetCommConfig_v11_t*, ncclDebugLogger_t log,
                      ncclProfilerCallback_t) {
  *ctx = &g_ctx_token;
  return pt_init(log);
}
ncclResult_t v11_finalize(void*) { return ncclSuccess; }

size_t pt_getStats(char* buf, size_t len) {
  uint64_t m = g_msgs_sent.load(), b = g_bytes_sent.load();
  int n =
      snprintf(buf, len,
               "{\"rails\":[{\"name\":\"lo@127.0.0.1\",\"state\":\"up\",\"chunks_sent\":%" PRIu64
               ",\"chunks_replayed\":0,\"bytes_sent\":%" PRIu64
               ",\"switchovers\":0,\"failbacks\":0}],\"switchovers\":0,\"replays\":0}",
               m, b);
  return n < 0 ? 0 : static_cast<size_t>(n);
}

}  // namespace

#define PT_EXPORT extern "C" __attribute__((visibility("default")))

PT_EXPORT const ncclNet_v8_t ncclNetPlugin_v8 = {
    "PlainTCP", pt_init,        pt_devices,     v8_getProperties, pt_listen, v8_connect, v8_accept,
    pt_regMr,   pt_regMrDmaBuf, pt_deregMr,     v8_isend,         v8_irecv,  pt_iflush,  pt_test,
    pt_close,   pt_close,       pt_closeListen, nullptr,          nullptr};

PT_EXPORT const ncclNet_v9_t ncclNetPlugin_v9 = {
    "PlainTCP", pt_init,        pt_devices,     v9_getProperties, pt_listen, v8_connect, v8_accept,
    pt_regMr,   pt_regMrDmaBuf, pt_deregMr,     v9_isend,         v9_irecv,  pt_iflush,  pt_test,
    pt_close,   pt_close,       pt_closeListen, nullptr,          nullptr,   nullptr};

PT_EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {
    "PlainTCP", v10_init,       pt_devices,     v9_getProperties, pt_listen, v10_connect, v8_accept,
    pt_regMr,   pt_regMrDmaBuf, pt_deregMr,     v10_isend,        v10_irecv, pt_iflush,   pt_test,
    pt_close,   pt_close,       pt_closeListen, nullptr,          nullptr,   nullptr};

PT_EXPORT const ncclNet_v11_t ncclNetPlugin_v11 = {
    "PlainTCP",   v11_init,       pt_devices, v11_getProperties, v11_listen,
    v11_connect,  v8_accept,      pt_regMr,   pt_regMrDmaBuf,    pt_deregMr,
    v10_isend,    v10_irecv,      pt_iflush,  pt_test,           pt_close,
    pt_close,     pt_closeListen, nullptr,    nullptr,           nullptr,
    v11_finalize, nullptr};

PT_EXPORT const r2cclExt_v1_t r2cclExt_v1 = {1, pt_getStats, nullptr};
