#include "transport/ib/caps.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "r2ccl/nccl_abi.h"

namespace r2ccl::net::ib {
namespace {

// The peer-memory module's sysfs file, "" when none is loaded.
std::string peer_memory_module(const std::string& root) {
  for (const char* f : {"/module/nvidia_peermem/version", "/kernel/mm/memory_peers/nv_mem/version",
                        "/kernel/mm/memory_peers/nv_mem_nc/version"})
    if (access((root + f).c_str(), F_OK) == 0) return root + f;
  return "";
}

// "" when `pd` takes dma-buf registrations, else why not.
std::string dmabuf_refusal(const VerbsApi& v, ibv_pd* pd) {
  if (!v.reg_dmabuf_mr) return "the verbs library has no ibv_reg_dmabuf_mr (rdma-core < 34)";
  errno = 0;
  ibv_mr* mr = v.reg_dmabuf_mr(pd, 0, 0, 0, -1, 0);
  const int e = errno;
  if (mr) {  // nothing registers fd -1; a provider that says it did is not trusted either
    v.dereg_mr(mr);
    return "the probe registration of fd -1 succeeded, which no kernel does";
  }
  if (e == EOPNOTSUPP || e == EPROTONOSUPPORT)
    return std::string("the kernel or HCA refuses dma-buf registration (") + strerror(e) + ")";
  return "";
}

}  // namespace

PtrSupport probe_ptr_support(const VerbsApi& v, const std::vector<ibv_pd*>& pds, bool gpu_build,
                             const std::string& sysfs_root) {
  PtrSupport s;
  s.types = NCCL_PTR_HOST;
  if (!gpu_build) {
    s.cuda = s.dmabuf = "built without CUDA (R2CCL_USE_CUDA off)";
    return s;
  }
  const std::string module = peer_memory_module(sysfs_root);
  if (!module.empty()) {
    s.types |= NCCL_PTR_CUDA;
    s.cuda = "peer-memory module loaded (" + module + ")";
  } else {
    s.cuda = "no peer-memory module (nvidia_peermem or nv_peer_mem) is loaded under " + sysfs_root +
             ": GPU buffers are staged through host memory";
  }
  std::string refusal = pds.empty() ? "no HCA to probe" : "";
  for (ibv_pd* pd : pds)
    if (refusal.empty()) refusal = dmabuf_refusal(v, pd);
  if (refusal.empty()) {
    s.types |= NCCL_PTR_DMABUF;
    s.dmabuf = "the probe registration (fd -1) failed with EBADF: dma-buf supported";
  } else {
    s.dmabuf = refusal;
  }
  return s;
}

}  // namespace r2ccl::net::ib
