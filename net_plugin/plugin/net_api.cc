#include "net_api.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

#include "../ib/ib_api.h"
#include "../ib/ib_runtime.h"
#include "../tcp/conn.h"
#include "../tcp/runtime.h"
#include "r2ccl/connect_state.h"
#include "r2ccl/log.h"
#include "r2ccl/version.h"

namespace r2ccl::net {
namespace {

// The transport of this process, decided once at the first init (R2CCL_TRANSPORT): the
// data-path entry points read it without a lock.
enum : int { kUndecided = 0, kTcp = 1, kIb = 2 };
std::atomic<int> g_transport{kUndecided};
std::string g_transport_why;

Status decide_transport() {
  static std::once_flag once;
  static Status st = Status::kOk;
  std::call_once(once, [] {
    bool use_ib = false;
    std::string err;
    st = ib::IbRuntime::choose(&use_ib, &g_transport_why, &err);
    if (st != Status::kOk) {
      R2CCL_WARN("init failed: %s", err.c_str());
      return;
    }
    g_transport.store(use_ib ? kIb : kTcp);
  });
  return st;
}

bool is_ib() { return g_transport.load(std::memory_order_relaxed) == kIb; }

constexpr uint64_t kConnectStateMagic = 0x52324343434f4e4eull;  // "R2CCCONN"
using ConnectState = HandleConnectState<Conn>;
static_assert(sizeof(WireHandle) <= ConnectState::kOffset, "handle has no room for connect state");

struct Mr {
  void* data;
  size_t size;
};

void banner(Runtime* rt, int api_version) {
  static std::once_flag once;
  std::call_once(once, [&] {
    std::string rails;
    for (const auto& r : rt->rails())
      rails += (rails.empty() ? "" : ", ") + r.name + " (" + std::to_string(r.speed_mbps) + " Mbps)";
    const Config& c = rt->cfg();
    R2CCL_INFO(NCCL_INIT | NCCL_NET,
               "r2ccl %s (git %s), NCCL net API v%d, transport TCP (%s), %zu rails: %s; %lld backup "
               "paths, chunk %lld KiB, %lld streams per path, stripe %s",
               R2CCL_VERSION_STRING, R2CCL_GIT_HASH, api_version, g_transport_why.c_str(),
               rt->rails().size(), rails.c_str(),
               static_cast<long long>(c.backup_paths), static_cast<long long>(c.chunk_size / 1024),
               static_cast<long long>(c.nsocks_per_path), c.stripe ? "on" : "off");
    for (const auto& s : c.sources) R2CCL_INFO(NCCL_ENV, "%s", s.c_str());
    if (rt->rails().size() < 2)
      R2CCL_WARN("only one rail (%s): connections have no backup path",
                 rt->rails()[0].name.c_str());
  });
}

Status runtime(Runtime** rt) {
  std::string err;
  Status s = Runtime::get(rt, &err);
  if (s != Status::kOk) {
    static std::once_flag once;
    std::call_once(once, [&] { R2CCL_WARN("init failed: %s", err.c_str()); });
  }
  return s;
}


// Runs fn with the connection's progress token, or reports "busy" (the caller retries).
template <typename F>
Status with_token(Conn* c, bool* busy, F&& fn) {
  if (!c->try_enter()) {
    *busy = true;
    return Status::kOk;
  }
  *busy = false;
  Status s = fn();
  c->leave();
  return s;
}

}  // namespace

Status api_init(NetContext** ctx, uint64_t comm_id, int traffic_class, ncclDebugLogger_t logger,
                int api_version) {
  if (logger) set_nccl_logger(logger);
  R2CCL_CHECK(decide_transport());
  if (is_ib()) {
    static std::once_flag once;
    std::call_once(once, [&] {
      R2CCL_INFO(NCCL_INIT | NCCL_NET, "r2ccl %s (git %s), NCCL net API v%d, transport IB (verbs; %s), %d HCA ports: %s",
                 R2CCL_VERSION_STRING, R2CCL_GIT_HASH, api_version, g_transport_why.c_str(),
                 ib::device_count(), ib::banner_text().c_str());
      for (const auto& s : ib::IbRuntime::peek()->cfg().sources) R2CCL_INFO(NCCL_ENV, "%s", s.c_str());
    });
  } else {
    Runtime* rt = nullptr;
    R2CCL_CHECK(runtime(&rt));
    banner(rt, api_version);
  }
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
  R2CCL_CHECK(decide_transport());
  if (is_ib()) {
    *ndev = ib::device_count();
    return Status::kOk;
  }
  Runtime* rt = nullptr;
  R2CCL_CHECK(runtime(&rt));
  *ndev = static_cast<int>(rt->rails().size());
  return Status::kOk;
}

Status api_get_properties(int dev, DeviceProps* p) {
  R2CCL_CHECK(decide_transport());
  if (is_ib()) {
    ib::IbDeviceProps q{};
    R2CCL_CHECK(ib::get_properties(dev, &q));
    p->name = q.name;
    p->pci_path = q.pci_path;
    p->guid = q.guid;
    p->speed_mbps = q.speed_mbps;
    p->max_comms = 65536;
    p->max_recvs = 1;
    p->max_p2p_bytes = 1ull << 30;
    p->max_coll_bytes = 1ull << 30;
    p->ptr_support = q.ptr_support;
    p->port = q.port;
    return Status::kOk;
  }
  Runtime* rt = nullptr;
  R2CCL_CHECK(runtime(&rt));
  if (dev < 0 || dev >= static_cast<int>(rt->rails().size())) {
    R2CCL_WARN("getProperties: device %d does not exist (%zu devices)", dev, rt->rails().size());
    return Status::kInternal;
  }
  const Rail& r = rt->rails()[dev];
  p->name = r.name.c_str();
  p->pci_path = r.pci_path.empty() ? nullptr : r.pci_path.c_str();
  p->guid = static_cast<uint64_t>(dev);
  p->speed_mbps = r.speed_mbps;
  p->max_comms = 65536;
  // One buffer per irecv: our receiver-driven CTS flow matches one send to one receive.
  // maxRecvs > 1 would also turn on NCCL's shared comms and multiply the send-side request
  // budget (reference §4.6) for no gain on a host-memory TCP transport.
  p->max_recvs = 1;
  // NCCL (2.28) never posts more than 1 GiB in one call; the test() sizes are ints.
  p->max_p2p_bytes = 1ull << 30;
  p->max_coll_bytes = 1ull << 30;
  p->ptr_support = NCCL_PTR_HOST;
  p->port = 0;
  return Status::kOk;
}

Status api_listen(NetContext* ctx, int dev, void* handle, void** listen_comm) {
  (void)ctx;
  *listen_comm = nullptr;
  if (is_ib()) return ib::listen(dev, handle, listen_comm);
  Runtime* rt = nullptr;
  R2CCL_CHECK(runtime(&rt));
  const int n = static_cast<int>(rt->rails().size());
  if (dev < 0 || dev >= n) {
    R2CCL_WARN("listen: device %d does not exist (%d devices)", dev, n);
    return Status::kInternal;
  }
  auto* l = new ListenComm(rt, dev);
  WireHandle h{};
  h.magic = kHandleMagic;
  h.version = kWireVersion;
  memcpy(h.secret, l->secret, 16);
  h.listen_id = l->listen_id;
  for (int k = 0; k < n && h.n_endpoints < kMaxHandleEndpoints; ++k) {
    int r = (dev + k) % n;
    const Rail& rail = rt->rails()[r];
    WireEndpoint& e = h.endpoints[h.n_endpoints++];
    e.family = static_cast<uint8_t>(rail.family);
    e.rail = static_cast<uint8_t>(r);
    e.port = rt->listener_port(r);
    memcpy(e.addr, addr_bytes(rail.addr), rail.family == AF_INET ? 4 : 16);
  }
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(handle, &h, sizeof(h));
  *listen_comm = l;
  return Status::kOk;
}

Status api_connect(NetContext* ctx, int dev, void* handle, void** send_comm) {
  *send_comm = nullptr;
  if (is_ib())
    return ib::connect(dev, ctx ? ctx->traffic_class : NCCL_NET_TRAFFIC_CLASS_UNDEF, handle, send_comm);
  (void)ctx;
  Runtime* rt = nullptr;
  R2CCL_CHECK(runtime(&rt));
  if (dev < 0 || dev >= static_cast<int>(rt->rails().size())) {
    R2CCL_WARN("connect: device %d does not exist", dev);
    return Status::kInternal;
  }
  Conn* conn = ConnectState::get(handle, kConnectStateMagic);
  if (!conn) {
    WireHandle h;
    memcpy(&h, handle, sizeof(h));
    if (h.magic != kHandleMagic || h.version != kWireVersion || h.n_endpoints == 0 ||
        h.n_endpoints > kMaxHandleEndpoints) {
      R2CCL_WARN("connect: the handle is not an r2ccl v%u handle (magic %08x, version %u, %u "
                 "endpoints); was it made by another net plugin?",
                 kWireVersion, h.magic, h.version, h.n_endpoints);
      return Status::kInternal;
    }
    for (int i = 0; i < h.n_endpoints; ++i)
      if (h.endpoints[i].family != AF_INET && h.endpoints[i].family != AF_INET6) {
        R2CCL_WARN("connect: handle endpoint %d has address family %u", i, h.endpoints[i].family);
        return Status::kInternal;
      }
    conn = new Conn(rt, Role::kSend, dev);
    ConnectState::set(handle, kConnectStateMagic, conn);
  }
  WireHandle h;
  memcpy(&h, handle, sizeof(h));
  return ConnectState::step(handle, conn, send_comm,
                            [&](Conn* c, bool* done) { return c->connect_step(h, done); });
}

Status api_accept(void* listen_comm, void** recv_comm) {
  *recv_comm = nullptr;
  if (is_ib()) return ib::accept(listen_comm, recv_comm);
  auto* l = static_cast<ListenComm*>(listen_comm);
  if (!l->building) l->building.reset(new Conn(l->rt, Role::kRecv, l->dev));
  bool done = false;
  Status s = l->building->accept_step(l, &done);
  if (s != Status::kOk) {
    l->building.reset();
    return s;
  }
  if (done) *recv_comm = l->building.release();
  return Status::kOk;
}

Status api_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  *mhandle = nullptr;
  if (is_ib()) return ib::reg_mr(comm, data, size, type, mhandle);
  (void)comm;
  if (type != NCCL_PTR_HOST) {
    R2CCL_WARN("regMr: buffer type %d is not supported; r2ccl's TCP transport advertises host "
               "memory only (NCCL_PTR_HOST)", type);
    return Status::kInternal;
  }
  *mhandle = new Mr{data, size};
  return Status::kOk;
}

Status api_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                         void** mhandle) {
  *mhandle = nullptr;
  if (is_ib()) return ib::reg_mr_dmabuf(comm, data, size, type, offset, fd, mhandle);
  R2CCL_WARN("regMrDmaBuf: the TCP transport does not advertise NCCL_PTR_DMABUF");
  return Status::kInternal;
}

Status api_dereg_mr(void* comm, void* mhandle) {
  if (is_ib()) return ib::dereg_mr(comm, mhandle);
  (void)comm;
  delete static_cast<Mr*>(mhandle);
  return Status::kOk;
}

Status api_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  (void)tag;
  *request = nullptr;
  if (is_ib()) return ib::isend(send_comm, data, size, mhandle, request);
  (void)mhandle;
  auto* c = static_cast<Conn*>(send_comm);
  bool busy = false;
  Request* r = nullptr;
  Status s = with_token(c, &busy, [&] { return c->isend(data, size, &r); });
  *request = r;
  return s;
}

Status api_irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
                 void** mhandles, void** request) {
  (void)tags;
  (void)mhandles;
  *request = nullptr;  // also clears NCCL's 0x1 optional-completion sentinel (v9+)
  if (n != 1) {
    R2CCL_WARN("irecv with %d buffers: r2ccl advertises maxRecvs=1", n);
    return Status::kInternal;
  }
  if (is_ib())
    return ib::irecv(recv_comm, data[0], sizes[0], tags ? tags[0] : 0, mhandles ? mhandles[0] : nullptr,
                     request);
  auto* c = static_cast<Conn*>(recv_comm);
  bool busy = false;
  Request* r = nullptr;
  Status s = with_token(c, &busy, [&] { return c->irecv(data[0], sizes[0], &r); });
  *request = r;
  return s;
}

Status api_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request) {
  if (is_ib()) return ib::iflush(recv_comm, n, data, sizes, mhandles, request);
  (void)recv_comm;
  (void)n;
  (void)data;
  (void)sizes;
  (void)mhandles;
  *request = nullptr;  // host memory: nothing to flush; NCCL treats NULL as done
  return Status::kOk;
}

Status api_test(void* request, int* done, int* sizes) {
  *done = 0;
  if (is_ib()) return ib::test(request, done, sizes);
  auto* r = static_cast<Request*>(request);
  if (!r || !r->used) {
    R2CCL_WARN("test: request %p is not a live r2ccl request", request);
    return Status::kInternal;
  }
  Conn* c = r->conn;
  bool busy = false;
  return with_token(c, &busy, [&] { return c->test(r, done, sizes); });
}

static Status close_conn(Conn* c) {
  if (!c) return Status::kOk;
  Runtime* rt = Runtime::peek();
  if (rt) rt->unregister_conn(c);
  // After unregistering, the background thread can no longer pick the connection; NCCL has
  // stopped its proxy thread before closing. The token is free or freed within one pass.
  while (!c->try_enter()) {
  }
  c->say_goodbye();
  delete c;
  return Status::kOk;
}

Status api_close_send(void* send_comm) {
  if (is_ib()) return ib::close_conn(send_comm);
  return close_conn(static_cast<Conn*>(send_comm));
}
Status api_close_recv(void* recv_comm) {
  if (is_ib()) return ib::close_conn(recv_comm);
  return close_conn(static_cast<Conn*>(recv_comm));
}

Status api_close_listen(void* listen_comm) {
  if (is_ib()) return ib::close_listen(listen_comm);
  delete static_cast<ListenComm*>(listen_comm);
  return Status::kOk;
}

int api_arm_faults(const char* spec) {
  if (is_ib()) {
    R2CCL_WARN("armFaults: the in-process injector acts on TCP sockets; the verbs transport is "
               "tested with the fake verbs provider's faults (tests/fakeverbs)");
    return -1;
  }
  Runtime* rt = Runtime::peek();
  if (!rt || !spec) {
    R2CCL_WARN("armFaults: the plugin is not initialised");
    return -1;
  }
  std::vector<FaultSpec> specs;
  std::string err;
  if (!parse_fault_specs(spec, &specs, &err)) {
    R2CCL_WARN("armFaults: %s", err.c_str());
    return -1;
  }
  for (const auto& f : specs)
    if (f.rail >= static_cast<int>(rt->rails().size())) {
      R2CCL_WARN("armFaults: rail %d does not exist (%zu rails)", f.rail, rt->rails().size());
      return -1;
    }
  FaultInjector::instance().arm_now(specs, rt->rank());
  R2CCL_WARN("fault injection armed for rank %d: %s", rt->rank(), spec);
  return 0;
}

size_t api_get_stats(char* buf, size_t len) {
  Runtime* rt = Runtime::peek();
  std::string s = is_ib() ? ib::stats_json() : rt ? rt->stats_json() : std::string("{\"rails\":[],\"switchovers\":0,\"replays\":0}");
  if (buf && len > 0) {
    size_t n = std::min(len - 1, s.size());
    memcpy(buf, s.data(), n);
    buf[n] = '\0';
  }
  return s.size();
}

}  // namespace r2ccl::net
