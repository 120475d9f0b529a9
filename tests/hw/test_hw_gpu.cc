// GPU buffers over a real HCA of this host (ctest label rdma; skipped without an HCA): two
// processes connected through the HCA's ports move messages of every size from GPU memory to
// GPU memory, registered the way NCCL registers them (NCCL_PTR_CUDA through regMr, NCCL_PTR_DMABUF
// through regMrDmaBuf with a dma-buf of the allocation), the receiver calling iflush before it
// reads a message back, as NCCL does for GPU buffers. Each pointer type the plugin advertises
// is one section.
//
// Skipped, saying why, where the plugin advertises neither (a build without USE_CUDA, no
// peer-memory module and no dma-buf support: the plugin's "GPU buffers (NCCL_PTR_CUDA)" line
// gives its reason) or where there is no GPU (no libcuda.so.1, cuInit fails, no device). CUDA
// is reached through the driver library (dlopen, no build dependency) and only in the forked
// processes: a CUDA context does not survive fork(), so the test process itself never makes
// one. This case has not run yet: the development machines have no HCA.
#include <dlfcn.h>
#include <stdarg.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "hw/hw_checks.h"
#include "r2ccl/nccl_abi.h"
#include "support/net_harness.h"

using namespace r2ccl::test;

namespace {

// The few CUDA driver API entry points the case uses (cuda.h's types: CUresult is an int enum,
// CUdevice an int, CUdeviceptr an unsigned 64-bit integer, CUcontext a pointer).
using CuPtr = unsigned long long;
struct Cuda {
  void* dl = nullptr;
  int (*init)(unsigned) = nullptr;
  int (*device_count)(int*) = nullptr;
  int (*device_get)(int*, int) = nullptr;
  int (*primary_ctx_retain)(void**, int) = nullptr;
  int (*ctx_set_current)(void*) = nullptr;
  int (*mem_alloc)(CuPtr*, size_t) = nullptr;
  int (*mem_free)(CuPtr) = nullptr;
  int (*htod)(CuPtr, const void*, size_t) = nullptr;
  int (*dtoh)(void*, CuPtr, size_t) = nullptr;
  int (*pointer_set_attribute)(const void*, int, CuPtr) = nullptr;
  // CUDA 11.7+; null on older drivers (then no dma-buf section).
  int (*get_handle_for_range)(void*, CuPtr, size_t, int, unsigned long long) = nullptr;
};
constexpr int kCuPointerAttributeSyncMemops = 6;  // CU_POINTER_ATTRIBUTE_SYNC_MEMOPS
constexpr int kCuMemRangeHandleDmaBufFd = 1;      // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
constexpr size_t kGpuPage = 2 * 1024 * 1024;      // cuMemAlloc's granularity

// Loads libcuda.so.1 and makes device 0's primary context current. False with *why.
bool open_cuda(Cuda* c, std::string* why) {
  c->dl = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!c->dl) {
    *why = std::string("no CUDA driver library: ") + dlerror();
    return false;
  }
  auto sym = [&](const char* name, auto* fn) {
    *reinterpret_cast<void**>(fn) = dlsym(c->dl, name);
    return *fn != nullptr;
  };
  if (!sym("cuInit", &c->init) || !sym("cuDeviceGetCount", &c->device_count) ||
      !sym("cuDeviceGet", &c->device_get) ||
      !sym("cuDevicePrimaryCtxRetain", &c->primary_ctx_retain) ||
      !sym("cuCtxSetCurrent", &c->ctx_set_current) || !sym("cuMemAlloc_v2", &c->mem_alloc) ||
      !sym("cuMemFree_v2", &c->mem_free) || !sym("cuMemcpyHtoD_v2", &c->htod) ||
      !sym("cuMemcpyDtoH_v2", &c->dtoh) ||
      !sym("cuPointerSetAttribute", &c->pointer_set_attribute)) {
    *why = "libcuda.so.1 lacks a driver API entry point this case uses";
    return false;
  }
  sym("cuMemGetHandleForAddressRange", &c->get_handle_for_range);
  int rc = c->init(0), n = 0;
  if (rc != 0) {
    *why = "cuInit failed (CUresult " + std::to_string(rc) + "; 100: no CUDA device)";
    return false;
  }
  if ((rc = c->device_count(&n)) != 0 || n < 1) {
    *why = "no CUDA device (cuDeviceGetCount: CUresult " + std::to_string(rc) + ", " +
           std::to_string(n) + " devices)";
    return false;
  }
  int dev = -1;
  void* ctx = nullptr;
  if ((rc = c->device_get(&dev, 0)) != 0 || (rc = c->primary_ctx_retain(&ctx, dev)) != 0 ||
      (rc = c->ctx_set_current(ctx)) != 0) {
    *why = "no context on CUDA device 0 (CUresult " + std::to_string(rc) + ")";
    return false;
  }
  return true;
}

// What the probe child prints (stderr): the "GPU buffers" INFO line of the plugin's (why a type is
// or is not advertised), kept by this logger.
void probe_logger(ncclDebugLogLevel, unsigned long, const char*, int, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (strstr(msg, "GPU buffers")) fprintf(stderr, "%s\n", msg);
}

// Exit codes of the probe child: 0 with "types N" printed (the pointer types device 0
// advertises), 3 no GPU (reason printed), 4 the plugin did not load or init.
constexpr int kProbeNoGpu = 3;

int probe() {
  Plugin p;
  std::string err;
  if (!load_plugin(&p, &err)) {
    fprintf(stderr, "%s\n", err.c_str());
    return 4;
  }
  void* ctx = nullptr;
  ncclNetCommConfig_v11_t cfg{-1};
  ncclNetProperties_v11_t props{};
  if (p.net->init(&ctx, 0x1234, &cfg, probe_logger, nullptr) != ncclSuccess ||
      p.net->getProperties(0, &props) != ncclSuccess) {
    fprintf(stderr, "plugin init or getProperties(0) failed\n");
    return 4;
  }
  fprintf(stderr, "types %d\n", props.ptrSupport);
  Cuda c;
  if (!open_cuda(&c, &err)) {
    fprintf(stderr, "%s\n", err.c_str());
    return kProbeNoGpu;
  }
  return 0;
}

// One GPU allocation of an endpoint, registered with the plugin as `type`.
struct GpuBuffer {
  CuPtr ptr = 0;
  size_t size = 0;
  void* mh = nullptr;
};

bool gpu_buffer(Cuda& c, Endpoint& ep, int type, size_t bytes, GpuBuffer* b) {
  b->size = (bytes + kGpuPage - 1) / kGpuPage * kGpuPage;
  int rc = c.mem_alloc(&b->ptr, b->size);
  if (rc != 0) {
    fprintf(stderr, "cuMemAlloc(%zu): CUresult %d\n", b->size, rc);
    return false;
  }
  // As NCCL does for GPU buffers an HCA reads or writes: copies to and from them synchronise.
  const unsigned one = 1;
  c.pointer_set_attribute(&one, kCuPointerAttributeSyncMemops, b->ptr);
  void* data = reinterpret_cast<void*>(b->ptr);
  ncclResult_t r;
  if (type == NCCL_PTR_DMABUF) {
    int fd = -1;
    rc = c.get_handle_for_range(&fd, b->ptr, b->size, kCuMemRangeHandleDmaBufFd, 0);
    if (rc != 0 || fd < 0) {
      fprintf(stderr, "cuMemGetHandleForAddressRange: CUresult %d\n", rc);
      return false;
    }
    r = ep.plugin.net->regMrDmaBuf(ep.comm, data, b->size, NCCL_PTR_DMABUF, 0, fd, &b->mh);
    close(fd);  // the registration holds its own reference, as NCCL assumes
  } else {
    r = ep.plugin.net->regMr(ep.comm, data, b->size, NCCL_PTR_CUDA, &b->mh);
  }
  if (r != ncclSuccess || !b->mh) {
    fprintf(stderr, "%s of %zu bytes of GPU memory: result %d\n",
            type == NCCL_PTR_DMABUF ? "regMrDmaBuf" : "regMr", b->size, r);
    return false;
  }
  return true;
}

// The sender: each size from GPU memory (pattern i + 1, copied in from the host).
int gpu_send(Endpoint& ep, int type) {
  Cuda c;
  std::string why;
  if (!open_cuda(&c, &why)) {
    fprintf(stderr, "sender: %s\n", why.c_str());
    return 3;
  }
  const std::vector<size_t>& sizes = hw::every_size();
  GpuBuffer b;
  if (!gpu_buffer(c, ep, type, sizes.back() + 1, &b)) return 4;
  std::vector<char> host(sizes.back() + 1);
  for (size_t i = 0; i < sizes.size(); ++i) {
    fill_pattern(host.data(), sizes[i], i + 1);
    if (sizes[i] && c.htod(b.ptr, host.data(), sizes[i]) != 0) return 5;
    void* req = nullptr;
    ncclResult_t r = ncclSuccess;
    for (int tries = 0; !req && r == ncclSuccess && tries < 1000000; ++tries)
      r = ep.plugin.net->isend(ep.comm, reinterpret_cast<void*>(b.ptr), sizes[i], 0, b.mh, nullptr,
                               &req);
    if (r != ncclSuccess || !req || ep.wait(req, 30000) != ncclSuccess) {
      fprintf(stderr, "sender: message %zu (%zu bytes) from GPU memory failed\n", i, sizes[i]);
      return 1;
    }
  }
  ep.plugin.net->deregMr(ep.comm, b.mh);
  c.mem_free(b.ptr);
  return 0;
}

// The receiver: each size into GPU memory (cleared first), iflush, then read back and checked.
int gpu_recv(Endpoint& ep, int type) {
  Cuda c;
  std::string why;
  if (!open_cuda(&c, &why)) {
    fprintf(stderr, "receiver: %s\n", why.c_str());
    return 3;
  }
  const std::vector<size_t>& sizes = hw::every_size();
  GpuBuffer b;
  if (!gpu_buffer(c, ep, type, sizes.back() + 1, &b)) return 4;
  std::vector<char> host(b.size), zeros(b.size, 0);
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (c.htod(b.ptr, zeros.data(), b.size) != 0) return 5;
    void* data = reinterpret_cast<void*>(b.ptr);
    size_t cap = b.size;
    int tag = 0;
    void* req = nullptr;
    ncclResult_t r = ncclSuccess;
    for (int tries = 0; !req && r == ncclSuccess && tries < 1000000; ++tries)
      r = ep.plugin.net->irecv(ep.comm, 1, &data, &cap, &tag, &b.mh, nullptr, &req);
    int got = -1;
    if (r != ncclSuccess || !req || ep.wait(req, 30000, &got) != ncclSuccess) {
      fprintf(stderr, "receiver: message %zu into GPU memory failed\n", i);
      return 1;
    }
    if (got > 0) {  // NCCL flushes a GPU receive before the GPU reads it
      void* freq = nullptr;
      r = ep.plugin.net->iflush(ep.comm, 1, &data, &got, &b.mh, &freq);
      if (r != ncclSuccess || (freq && ep.wait(freq, 30000) != ncclSuccess)) {
        fprintf(stderr, "receiver: iflush of message %zu failed\n", i);
        return 1;
      }
    }
    if (sizes[i] && c.dtoh(host.data(), b.ptr, sizes[i]) != 0) return 5;
    const long long bad = check_pattern(host.data(), sizes[i], i + 1);
    if (got != static_cast<int>(sizes[i]) || bad >= 0) {
      fprintf(stderr, "receiver: message %zu: %d bytes (expected %zu), first bad byte %lld\n", i,
              got, sizes[i], bad);
      return 2;
    }
  }
  ep.plugin.net->deregMr(ep.comm, b.mh);
  c.mem_free(b.ptr);
  return 0;
}

}  // namespace

TEST_CASE("real HCA: GPU buffers (NCCL_PTR_CUDA, NCCL_PTR_DMABUF): every size exact, flushed",
          "[rdma]") {
  const std::map<std::string, std::string> env = {{"R2CCL_TRANSPORT", "ib"}};
  const ChildResult pr = run_child(env, probe, 60);
  INFO("probe:\n" << pr.output);
  // The probe prints the pointer types first, then tries CUDA: a plugin that advertises host
  // memory only is the first reason to skip, no GPU the second.
  const size_t at = pr.output.find("types ");
  REQUIRE(at != std::string::npos);  // the plugin loaded and answered getProperties
  const int types = std::stoi(pr.output.substr(at + 6));
  if (!(types & (NCCL_PTR_CUDA | NCCL_PTR_DMABUF))) {
    WARN("GPU buffer case skipped: the plugin advertises host memory only here (ptrSupport "
         << types << "); its reason:\n"
         << pr.output);
    return;
  }
  if (pr.status == kProbeNoGpu) {
    WARN("GPU buffer case skipped: no usable GPU on this host:\n" << pr.output);
    return;
  }
  REQUIRE(pr.status == 0);
  for (const int type : {NCCL_PTR_CUDA, NCCL_PTR_DMABUF}) {
    if (!(types & type)) continue;
    DYNAMIC_SECTION(
        (type == NCCL_PTR_CUDA ? "NCCL_PTR_CUDA (regMr)" : "NCCL_PTR_DMABUF (regMrDmaBuf)")) {
      PairOptions o;
      o.env = env;
      const std::string slog = temp_path("hw-gpu-sender.log"), rlog = temp_path("hw-gpu-recv.log");
      o.sender_env["R2CCL_LOG_FILE"] = slog;
      o.receiver_env["R2CCL_LOG_FILE"] = rlog;
      o.finish_together = true;
      const PairResult r = run_pair(
          o,
          [&](Endpoint& ep) {
            const int rc = gpu_send(ep, type);
            hw::snapshot_log(slog);
            return rc;
          },
          [&](Endpoint& ep) {
            const int rc = gpu_recv(ep, type);
            hw::snapshot_log(rlog);
            return rc;
          });
      const std::string sl = read_file(slog + ".end"), rl = read_file(rlog + ".end");
      INFO("sender log:\n" << sl << "receiver log:\n" << rl);
      CHECK(r.sender_status == 0);
      CHECK(r.receiver_status == 0);
      CHECK(hw::path_failure_lines(sl) == 0);
      CHECK(hw::path_failure_lines(rl) == 0);
    }
  }
}
