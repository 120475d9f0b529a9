#include "ib/ib_api.h"

#include <cstring>
#include <vector>

#include "ib/ib_conn.h"
#include "r2ccl/connect_state.h"
#include "r2ccl/log.h"
#include "sock/socket_util.h"

namespace r2ccl::net::ib {
namespace {

constexpr uint64_t kConnectStateMagic = 0x52324942434f4e4eull;  // "R2IBCONN"
using ConnectState = HandleConnectState<IbConn>;
static_assert(sizeof(IbWireHandle) <= ConnectState::kOffset, "handle has no room for connect state");

IbRuntime* rt() { return IbRuntime::peek(); }

template <typename F>
Status with_token(IbConn* c, F&& fn) {
  if (!c->try_enter()) return Status::kOk;  // another thread progresses it: call again
  Status s = fn();
  c->leave();
  return s;
}

}  // namespace

std::string banner_text() {
  IbRuntime* r = rt();
  std::string s;
  for (int h : r->devices()) s += (s.empty() ? "" : "; ") + describe(r->hcas()[h]);
  const Config& c = r->cfg();
  char tail[256];
  snprintf(tail, sizeof(tail),
           "; %lld backup paths, %lld QPs per path, chunk %lld KiB, stripe %s, QP timeout %lld "
           "retry %lld, side channel %s",
           static_cast<long long>(c.backup_paths), static_cast<long long>(c.ib_qps_per_path),
           static_cast<long long>(c.chunk_size / 1024), c.stripe ? "on" : "off",
           static_cast<long long>(c.ib_timeout), static_cast<long long>(c.ib_retry_cnt),
           r->side_rail().name.c_str());
  return s + tail;
}

int device_count() { return static_cast<int>(rt()->devices().size()); }

Status get_properties(int dev, IbDeviceProps* p) {
  IbRuntime* r = rt();
  if (dev < 0 || dev >= device_count()) {
    R2CCL_WARN("getProperties: device %d does not exist (%d HCA ports)", dev, device_count());
    return Status::kInternal;
  }
  const HcaInfo& h = r->hcas()[r->devices()[dev]];
  p->name = h.name.c_str();
  p->pci_path = h.pci_path.empty() ? nullptr : h.pci_path.c_str();
  p->guid = h.guid;
  p->speed_mbps = h.speed_mbps;
  p->port = h.port;
  p->ptr_support = NCCL_PTR_HOST;
#ifdef R2CCL_USE_CUDA
  p->ptr_support |= NCCL_PTR_CUDA;
  if (r->v().reg_dmabuf_mr) p->ptr_support |= NCCL_PTR_DMABUF;
#endif
  return Status::kOk;
}

Status listen(int dev, void* handle, void** listen_comm) {
  *listen_comm = nullptr;
  if (dev < 0 || dev >= device_count()) {
    R2CCL_WARN("listen: device %d does not exist (%d HCA ports)", dev, device_count());
    return Status::kInternal;
  }
  auto* l = new IbListen(rt(), dev);
  if (l->fd < 0) {
    delete l;
    return Status::kSystem;
  }
  IbWireHandle h{};
  h.magic = kIbHandleMagic;
  h.version = kIbWireVersion;
  const Rail& side = rt()->side_rail();
  h.family = static_cast<uint8_t>(side.family);
  h.port = local_port(l->fd);  // network order
  memcpy(h.addr, addr_bytes(side.addr), side.family == AF_INET ? 4 : 16);
  memcpy(h.secret, l->secret, 16);
  h.listen_id = l->listen_id;
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(handle, &h, sizeof(h));
  *listen_comm = l;
  return Status::kOk;
}

Status connect(int dev, int traffic_class, void* handle, void** send_comm) {
  *send_comm = nullptr;
  if (dev < 0 || dev >= device_count()) {
    R2CCL_WARN("connect: device %d does not exist (%d HCA ports)", dev, device_count());
    return Status::kInternal;
  }
  IbWireHandle h;
  memcpy(&h, handle, sizeof(h));
  IbConn* conn = ConnectState::get(handle, kConnectStateMagic);
  if (!conn) {
    if (h.magic != kIbHandleMagic || h.version != kIbWireVersion ||
        (h.family != AF_INET && h.family != AF_INET6)) {
      R2CCL_WARN("connect: the handle is not an r2ccl verbs v%u handle (magic %08x, version %u, "
                 "family %u); do both ends use the same R2CCL_TRANSPORT?",
                 kIbWireVersion, h.magic, h.version, h.family);
      return Status::kInternal;
    }
    conn = new IbConn(rt(), IbRole::kSend, dev, traffic_class);
    ConnectState::set(handle, kConnectStateMagic, conn);
  }
  return ConnectState::step(handle, conn, send_comm,
                            [&](IbConn* c, bool* done) { return c->connect_step(h, done); });
}

Status accept(void* listen_comm, void** recv_comm) {
  *recv_comm = nullptr;
  auto* l = static_cast<IbListen*>(listen_comm);
  if (!l->building)
    l->building.reset(new IbConn(l->rt, IbRole::kRecv, l->dev, NCCL_NET_TRAFFIC_CLASS_UNDEF));
  bool done = false;
  Status s = l->building->accept_step(l, &done);
  if (s != Status::kOk) {
    l->building.reset();
    return s;
  }
  if (done) *recv_comm = l->building.release();
  return Status::kOk;
}

Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  *mhandle = nullptr;
  if (type != NCCL_PTR_HOST) {
#ifndef R2CCL_USE_CUDA
    R2CCL_WARN("regMr: buffer type %d is not supported; this build advertises host memory only "
               "(NCCL_PTR_HOST; build with USE_CUDA=ON for GPU buffers)", type);
    return Status::kInternal;
#endif
  }
  IbMr* m = nullptr;
  R2CCL_CHECK(static_cast<IbConn*>(comm)->reg_mr(data, size, type, &m));
  *mhandle = m;
  return Status::kOk;
}

Status reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                     void** mhandle) {
  *mhandle = nullptr;
  (void)type;
  IbMr* m = nullptr;
  R2CCL_CHECK(static_cast<IbConn*>(comm)->reg_mr_dmabuf(data, size, offset, fd, &m));
  *mhandle = m;
  return Status::kOk;
}

Status dereg_mr(void* comm, void* mhandle) {
  static_cast<IbConn*>(comm)->dereg_mr(static_cast<IbMr*>(mhandle));
  return Status::kOk;
}

Status isend(void* send_comm, void* data, size_t size, void* mhandle, void** request) {
  *request = nullptr;
  auto* c = static_cast<IbConn*>(send_comm);
  IbRequest* r = nullptr;
  Status s = with_token(c, [&] { return c->isend(data, size, static_cast<IbMr*>(mhandle), &r); });
  *request = r;
  return s;
}

Status irecv(void* recv_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  *request = nullptr;
  auto* c = static_cast<IbConn*>(recv_comm);
  IbRequest* r = nullptr;
  Status s = with_token(c, [&] { return c->irecv(data, size, tag, static_cast<IbMr*>(mhandle), &r); });
  *request = r;
  return s;
}

Status iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request) {
  *request = nullptr;
  auto* c = static_cast<IbConn*>(recv_comm);
  std::vector<IbMr*> mrs(static_cast<size_t>(n > 0 ? n : 0), nullptr);
  for (int i = 0; i < n && mhandles; ++i) mrs[i] = static_cast<IbMr*>(mhandles[i]);
  IbRequest* r = nullptr;
  Status s = with_token(c, [&] { return c->iflush(n, data, sizes, mrs.data(), &r); });
  *request = r;
  return s;
}

Status test(void* request, int* done, int* sizes) {
  *done = 0;
  auto* r = static_cast<IbRequest*>(request);
  if (!r || !r->used) {
    R2CCL_WARN("test: request %p is not a live r2ccl request", request);
    return Status::kInternal;
  }
  IbConn* c = r->conn;
  return with_token(c, [&] { return c->test(r, done, sizes); });
}

Status close_conn(void* comm) {
  auto* c = static_cast<IbConn*>(comm);
  if (!c) return Status::kOk;
  rt()->unregister_conn(c);
  while (!c->try_enter()) {
  }
  c->say_goodbye();
  delete c;
  return Status::kOk;
}

Status close_listen(void* listen_comm) {
  delete static_cast<IbListen*>(listen_comm);
  return Status::kOk;
}

std::string stats_json() { return rt() ? rt()->stats_json() : std::string(); }

}  // namespace r2ccl::net::ib
