// The exported NCCL net plugin tables ncclNetPlugin_v8 .. _v11 (name "R2CCL") and the
// r2cclExt_v1 extension. Each entry adapts its version's arguments to the version-neutral API
// in net_api.h and is an exception firewall: nothing is thrown across the C ABI.
// Layouts: common/include/r2ccl/nccl_abi.h, from ../shared/reference/nccl-plugin-abi.md §3-4.
// Visibility: the library is built with -fvisibility=hidden and a version script
// (r2ccl_net.map) that exports only these five symbols.
#include <climits>
#include <cstring>
#include <new>

#include "api/net_api.h"
#include "r2ccl/ext.h"
#include "r2ccl/log.h"

using namespace r2ccl;
using namespace r2ccl::net;

#define R2CCL_EXPORT extern "C" __attribute__((visibility("default")))

#define FIREWALL(expr)                                                 \
  try {                                                                \
    return to_nccl_result(expr);                                       \
  } catch (const std::bad_alloc&) {                                    \
    R2CCL_WARN("%s: out of memory", __func__);                         \
    return ncclSystemError;                                            \
  } catch (...) {                                                      \
    R2CCL_WARN("%s: internal error (unexpected exception)", __func__); \
    return ncclInternalError;                                          \
  }

namespace {

constexpr char kName[] = "R2CCL";

template <typename P>
void fill_common(const DeviceProps& d, P* p) {
  p->name = const_cast<char*>(d.name);
  p->pciPath = const_cast<char*>(d.pci_path);
  p->guid = d.guid;
  p->ptrSupport = d.ptr_support;
  p->regIsGlobal = 0;
  p->speed = d.speed_mbps;
  p->port = d.port;
  p->latency = 0;
  p->maxComms = d.max_comms;
  p->maxRecvs = d.max_recvs;
  p->netDeviceType = NCCL_NET_DEVICE_HOST;
  p->netDeviceVersion = 0;
}

template <typename P>
void fill_v9(const DeviceProps& d, int dev, P* p) {
  fill_common(d, p);
  p->forceFlush = 0;
  p->vProps.ndevs = 1;
  memset(p->vProps.devs, 0, sizeof(p->vProps.devs));
  p->vProps.devs[0] = dev;
  p->maxP2pBytes = d.max_p2p_bytes;
  p->maxCollBytes = d.max_coll_bytes;
}

Status props_v8(int dev, ncclNetProperties_v8_t* p) {
  DeviceProps d{};
  R2CCL_CHECK(api_get_properties(dev, &d));
  memset(p, 0, sizeof(*p));
  fill_common(d, p);
  return Status::kOk;
}

Status props_v9(int dev, ncclNetProperties_v9_t* p) {
  DeviceProps d{};
  R2CCL_CHECK(api_get_properties(dev, &d));
  memset(p, 0, sizeof(*p));
  fill_v9(d, dev, p);
  return Status::kOk;
}

Status props_v11(int dev, ncclNetProperties_v11_t* p) {
  DeviceProps d{};
  R2CCL_CHECK(api_get_properties(dev, &d));
  memset(p, 0, sizeof(*p));
  fill_v9(d, dev, p);
  p->maxMultiRequestSize = 1;
  return Status::kOk;
}

// v8 takes int sizes.
Status irecv_int_sizes(void* comm, int n, void** data, int* sizes, int* tags, void** mh,
                       void** req) {
  if (n < 1 || n > 64) {
    R2CCL_WARN("irecv: %d buffers (accepted: 1)", n);
    return Status::kInternal;
  }
  size_t s[64];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) {
      R2CCL_WARN("irecv: negative size %d", sizes[i]);
      return Status::kInternal;
    }
    s[i] = static_cast<size_t>(sizes[i]);
  }
  return api_irecv(comm, n, data, s, tags, mh, req);
}

Status isend_int_size(void* comm, void* data, int size, int tag, void* mh, void** req) {
  if (size < 0) {
    R2CCL_WARN("isend: negative size %d", size);
    return Status::kInternal;
  }
  return api_isend(comm, data, static_cast<size_t>(size), tag, mh, req);
}

// --- entries shared by several versions ---
ncclResult_t e_devices(int* ndev) { FIREWALL(api_devices(ndev)); }
ncclResult_t e_accept(void* l, void** r, ncclNetDeviceHandle_v8_t** dev) {
  (void)dev;
  FIREWALL(api_accept(l, r));
}
ncclResult_t e_reg_mr(void* c, void* d, size_t s, int t, void** m) {
  FIREWALL(api_reg_mr(c, d, s, t, m));
}
#ifdef R2CCL_USE_CUDA
ncclResult_t e_reg_mr_dmabuf(void* c, void* d, size_t s, int t, uint64_t o, int fd, void** m) {
  FIREWALL(api_reg_mr_dmabuf(c, d, s, t, o, fd, m));
}
#define R2CCL_REG_MR_DMABUF e_reg_mr_dmabuf
#else
// No DMA-BUF without CUDA support: NCCL never calls it (NCCL_PTR_DMABUF is not advertised).
#define R2CCL_REG_MR_DMABUF nullptr
#endif
ncclResult_t e_dereg_mr(void* c, void* m) { FIREWALL(api_dereg_mr(c, m)); }
ncclResult_t e_iflush(void* c, int n, void** d, int* s, void** m, void** r) {
  FIREWALL(api_iflush(c, n, d, s, m, r));
}
ncclResult_t e_test(void* r, int* done, int* sizes) { FIREWALL(api_test(r, done, sizes)); }
ncclResult_t e_close_send(void* c) { FIREWALL(api_close_send(c)); }
ncclResult_t e_close_recv(void* c) { FIREWALL(api_close_recv(c)); }
ncclResult_t e_close_listen(void* c) { FIREWALL(api_close_listen(c)); }
ncclResult_t e_listen_noctx(int dev, void* h, void** l) {
  FIREWALL(api_listen(nullptr, dev, h, l));
}
ncclResult_t e_isend_sz(void* c, void* d, size_t s, int t, void* m, void** r) {
  FIREWALL(api_isend(c, d, s, t, m, r));
}
ncclResult_t e_irecv_sz(void* c, int n, void** d, size_t* s, int* t, void** m, void** r) {
  FIREWALL(api_irecv(c, n, d, s, t, m, r));
}

// --- v8 (NCCL 2.20-2.23) ---
ncclResult_t v8_init(ncclDebugLogger_t log) { FIREWALL(api_init(nullptr, 0, -1, log, 8)); }
ncclResult_t v8_props(int dev, ncclNetProperties_v8_t* p) { FIREWALL(props_v8(dev, p)); }
ncclResult_t v8_connect(int dev, void* h, void** s, ncclNetDeviceHandle_v8_t** dc) {
  (void)dc;
  FIREWALL(api_connect(nullptr, dev, h, s));
}
ncclResult_t v8_isend(void* c, void* d, int s, int t, void* m, void** r) {
  FIREWALL(isend_int_size(c, d, s, t, m, r));
}
ncclResult_t v8_irecv(void* c, int n, void** d, int* s, int* t, void** m, void** r) {
  FIREWALL(irecv_int_sizes(c, n, d, s, t, m, r));
}

// --- v9 (NCCL 2.24-2.25) ---
ncclResult_t v9_init(ncclDebugLogger_t log) { FIREWALL(api_init(nullptr, 0, -1, log, 9)); }
ncclResult_t v9_props(int dev, ncclNetProperties_v9_t* p) { FIREWALL(props_v9(dev, p)); }

// --- v10 (NCCL 2.26-2.27) ---
ncclResult_t v10_init(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  (void)prof;
  FIREWALL(api_init(nullptr, 0, -1, log, 10));
}
ncclResult_t v10_connect(int dev, ncclNetCommConfig_v10_t* cfg, void* h, void** s,
                         ncclNetDeviceHandle_v10_t** dc) {
  (void)cfg;
  (void)dc;
  FIREWALL(api_connect(nullptr, dev, h, s));
}
ncclResult_t v10_isend(void* c, void* d, size_t s, int t, void* m, void* ph, void** r) {
  (void)ph;
  FIREWALL(api_isend(c, d, s, t, m, r));
}
ncclResult_t v10_irecv(void* c, int n, void** d, size_t* s, int* t, void** m, void** ph, void** r) {
  (void)ph;
  FIREWALL(api_irecv(c, n, d, s, t, m, r));
}

// --- v11 (NCCL 2.28-2.29) ---
ncclResult_t v11_init(void** ctx, uint64_t comm_id, ncclNetCommConfig_v11_t* cfg,
                      ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  (void)prof;
  // NCCL's config lives on its stack: copy the traffic class now.
  int tc = cfg ? cfg->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  FIREWALL(api_init(reinterpret_cast<NetContext**>(ctx), comm_id, tc, log, 11));
}
ncclResult_t v11_props(int dev, ncclNetProperties_v11_t* p) { FIREWALL(props_v11(dev, p)); }
ncclResult_t v11_listen(void* ctx, int dev, void* h, void** l) {
  FIREWALL(api_listen(static_cast<NetContext*>(ctx), dev, h, l));
}
ncclResult_t v11_connect(void* ctx, int dev, void* h, void** s, ncclNetDeviceHandle_v11_t** dc) {
  (void)dc;
  FIREWALL(api_connect(static_cast<NetContext*>(ctx), dev, h, s));
}
ncclResult_t v11_finalize(void* ctx) { FIREWALL(api_finalize(static_cast<NetContext*>(ctx))); }

size_t ext_get_stats(char* buf, size_t len) {
  try {
    return api_get_stats(buf, len);
  } catch (...) {
    if (buf && len) buf[0] = '\0';
    return 0;
  }
}

int ext_arm_faults(const char* spec) {
  try {
    return api_arm_faults(spec);
  } catch (...) {
    return -1;
  }
}

}  // namespace

R2CCL_EXPORT const ncclNet_v8_t ncclNetPlugin_v8 = {
    kName,        v8_init,        e_devices,
    v8_props,     e_listen_noctx, v8_connect,
    e_accept,     e_reg_mr,       R2CCL_REG_MR_DMABUF,
    e_dereg_mr,   v8_isend,       v8_irecv,
    e_iflush,     e_test,         e_close_send,
    e_close_recv, e_close_listen, nullptr /* getDeviceMr */,
    nullptr /* irecvConsumed */};

R2CCL_EXPORT const ncclNet_v9_t ncclNetPlugin_v9 = {
    kName,    v9_init,  e_devices,           v9_props,     e_listen_noctx, v8_connect,
    e_accept, e_reg_mr, R2CCL_REG_MR_DMABUF, e_dereg_mr,   e_isend_sz,     e_irecv_sz,
    e_iflush, e_test,   e_close_send,        e_close_recv, e_close_listen, nullptr,
    nullptr,  nullptr /* makeVDevice: no NIC fusion */};

R2CCL_EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {
    kName,    v10_init, e_devices,           v9_props,     e_listen_noctx, v10_connect,
    e_accept, e_reg_mr, R2CCL_REG_MR_DMABUF, e_dereg_mr,   v10_isend,      v10_irecv,
    e_iflush, e_test,   e_close_send,        e_close_recv, e_close_listen, nullptr,
    nullptr,  nullptr};

R2CCL_EXPORT const ncclNet_v11_t ncclNetPlugin_v11 = {
    kName,    v11_init, e_devices,           v11_props,    v11_listen,     v11_connect,
    e_accept, e_reg_mr, R2CCL_REG_MR_DMABUF, e_dereg_mr,   v10_isend,      v10_irecv,
    e_iflush, e_test,   e_close_send,        e_close_recv, e_close_listen, nullptr,
    nullptr,  nullptr,  v11_finalize,        nullptr /* setNetAttr: hints unused */};

R2CCL_EXPORT const r2cclExt_v1_t r2cclExt_v1 = {1, ext_get_stats, ext_arm_faults};
