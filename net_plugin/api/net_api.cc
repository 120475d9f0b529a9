#include "api/net_api.h"

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "r2ccl/log.h"
#include "r2ccl/version.h"
#include "transport/factory.h"

namespace r2ccl::net {
namespace {

// The process's transport, or an error (WARNed once, with the reason).
Status transport(Transport** t) {
  std::string why, err;
  const Status s = get_transport(t, &why, &err);
  if (s != Status::kOk) {
    static std::once_flag once;
    std::call_once(once, [&] { R2CCL_WARN("init failed: %s", err.c_str()); });
  }
  return s;
}

void banner(Transport* t, int api_version) {
  static std::once_flag once;
  std::call_once(once, [&] {
    std::string why, err;
    Transport* ignored = nullptr;
    (void)get_transport(&ignored, &why, &err);
    R2CCL_INFO(NCCL_INIT | NCCL_NET, "r2ccl %s (git %s), NCCL net API v%d, transport %s (%s), %s",
               R2CCL_VERSION_STRING, R2CCL_GIT_HASH, api_version, t->name(), why.c_str(),
               t->banner().c_str());
    const Config* cfg = nullptr;
    if (process_config(&cfg, &err))
      for (const auto& s : cfg->sources) R2CCL_INFO(NCCL_ENV, "%s", s.c_str());
    if (t->device_count() < 2) {
      DeviceProps p;
      if (t->device_count() == 1 && t->properties(0, &p) == Status::kOk)
        R2CCL_WARN("only one rail (%s): connections have no backup path", p.name);
    }
  });
}

// Runs fn with the connection's progress token, or reports "busy" (NCCL calls again).
template <typename F>
Status with_token(Connection* c, F&& fn) {
  if (!c->try_enter()) return Status::kOk;
  const TimeUs now = now_us();
  const Status s = fn(now);
  c->leave(now_us());
  return s;
}

// An isend/irecv above the advertised maxP2pBytes: the caller's error, nothing is posted.
Status too_large(const char* op, size_t size) {
  R2CCL_WARN(
      "%s of %zu bytes: larger than maxP2pBytes (%zu bytes, advertised by getProperties); "
      "NCCL splits larger transfers",
      op, size, kMaxP2pBytes);
  return Status::kInvalidUsage;
}

}  // namespace

Status api_init(NetContext** ctx, uint64_t comm_id, int traffic_class, ncclDebugLogger_t logger,
                int api_version) {
  if (logger) set_nccl_logger(logger);
  Transport* t = nullptr;
  R2CCL_CHECK(transport(&t));
  banner(t, api_version);
  if (ctx) {
    auto* c = new NetContext();
    c->comm_id = comm_id;
    c->traffic_class = traffic_class;
    *ctx = c;
  }
  return Status::kOk;
}

Status api_finalize(NetContext* ctx) {
  delete ctx;  // NULL (a failed init) is fine
  return Status::kOk;
}

Status api_devices(int* ndev) {
  Transport* t = nullptr;
  R2CCL_CHECK(transport(&t));
  *ndev = t->device_count();
  return Status::kOk;
}

Status api_get_properties(int dev, DeviceProps* p) {
  Transport* t = nullptr;
  R2CCL_CHECK(transport(&t));
  return t->properties(dev, p);
}

Status api_listen(NetContext* ctx, int dev, void* handle, void** listen_comm) {
  (void)ctx;
  *listen_comm = nullptr;
  Transport* t = nullptr;
  R2CCL_CHECK(transport(&t));
  Listener* l = nullptr;
  R2CCL_CHECK(t->listen(dev, handle, &l));
  *listen_comm = l;
  return Status::kOk;
}

Status api_connect(NetContext* ctx, int dev, void* handle, void** send_comm) {
  *send_comm = nullptr;
  Transport* t = nullptr;
  R2CCL_CHECK(transport(&t));
  Connection* c = nullptr;
  R2CCL_CHECK(t->connect(dev, ctx ? ctx->traffic_class : NCCL_NET_TRAFFIC_CLASS_UNDEF, handle, &c));
  *send_comm = c;
  return Status::kOk;
}

Status api_accept(void* listen_comm, void** recv_comm) {
  *recv_comm = nullptr;
  Transport* t = nullptr;
  R2CCL_CHECK(transport(&t));
  Connection* c = nullptr;
  R2CCL_CHECK(t->accept(static_cast<Listener*>(listen_comm), &c));
  *recv_comm = c;
  return Status::kOk;
}

Status api_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  *mhandle = nullptr;
  Transport* t = nullptr;
  R2CCL_CHECK(transport(&t));
  if ((t->mr_types() & type) != type || type == 0) {
    R2CCL_WARN(
        "regMr: buffer type %d is not supported by the %s transport of this build "
        "(supported: 0x%x; GPU buffers need the verbs transport built with USE_CUDA=ON)",
        type, t->name(), t->mr_types());
    return Status::kInternal;
  }
  return static_cast<Connection*>(comm)->io().reg_mr(data, size, type, mhandle);
}

Status api_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                         void** mhandle) {
  (void)type;
  *mhandle = nullptr;
  return static_cast<Connection*>(comm)->io().reg_mr_dmabuf(data, size, offset, fd, mhandle);
}

Status api_dereg_mr(void* comm, void* mhandle) {
  static_cast<Connection*>(comm)->io().dereg_mr(mhandle);
  return Status::kOk;
}

Status api_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  *request = nullptr;
  if (size > kMaxP2pBytes) return too_large("isend", size);
  auto* c = static_cast<Connection*>(send_comm);
  Request* r = nullptr;
  const Status s =
      with_token(c, [&](TimeUs now) { return c->isend(data, size, tag, mhandle, &r, now); });
  *request = r;
  return s;
}

Status api_irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
                 void** mhandles, void** request) {
  *request = nullptr;  // also clears NCCL's 0x1 optional-completion sentinel (v9+)
  if (n != 1) {
    R2CCL_WARN("irecv with %d buffers: r2ccl advertises maxRecvs=1", n);
    return Status::kInternal;
  }
  if (sizes[0] > kMaxP2pBytes) return too_large("irecv", sizes[0]);
  auto* c = static_cast<Connection*>(recv_comm);
  Request* r = nullptr;
  const Status s = with_token(c, [&](TimeUs now) {
    return c->irecv(data[0], sizes[0], tags ? tags[0] : 0, mhandles ? mhandles[0] : nullptr, &r,
                    now);
  });
  *request = r;
  return s;
}

Status api_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                  void** request) {
  *request = nullptr;
  auto* c = static_cast<Connection*>(recv_comm);
  std::vector<void*> mh(static_cast<size_t>(n > 0 ? n : 0), nullptr);
  for (int i = 0; i < n && mhandles; ++i) mh[i] = mhandles[i];
  Request* r = nullptr;
  const Status s =
      with_token(c, [&](TimeUs now) { return c->iflush(n, data, sizes, mh.data(), &r, now); });
  *request = r;
  return s;
}

Status api_test(void* request, int* done, int* sizes) {
  *done = 0;
  auto* r = static_cast<Request*>(request);
  if (!r || !r->used) {
    R2CCL_WARN("test: request %p is not a live r2ccl request", request);
    return Status::kInternal;
  }
  Connection* c = r->conn;
  return with_token(c, [&](TimeUs now) { return c->test(r, done, sizes, now); });
}

Status api_close_send(void* send_comm) {
  if (Transport* t = peek_transport()) t->close(static_cast<Connection*>(send_comm));
  return Status::kOk;
}

Status api_close_recv(void* recv_comm) {
  if (Transport* t = peek_transport()) t->close(static_cast<Connection*>(recv_comm));
  return Status::kOk;
}

Status api_close_listen(void* listen_comm) {
  if (Transport* t = peek_transport()) t->close_listen(static_cast<Listener*>(listen_comm));
  return Status::kOk;
}

int api_arm_faults(const char* spec) {
  Transport* t = peek_transport();
  if (!t) {
    R2CCL_WARN("armFaults: the plugin is not initialised");
    return -1;
  }
  return t->arm_faults(spec);
}

size_t api_get_stats(char* buf, size_t len) {
  Transport* t = peek_transport();
  const std::string s =
      t ? t->stats_json() : std::string("{\"rails\":[],\"switchovers\":0,\"replays\":0}");
  if (buf && len > 0) {
    const size_t n = std::min(len - 1, s.size());
    memcpy(buf, s.data(), n);
    buf[n] = '\0';
  }
  return s.size();
}

}  // namespace r2ccl::net
