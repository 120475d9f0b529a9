// Which NCCL pointer types the verbs transport advertises (ncclNetProperties.ptrSupport),
// probed the way NCCL's own IB transport decides rather than assumed from the build:
//  - NCCL_PTR_CUDA (GPUDirect RDMA: ibv_reg_mr on device memory) needs a peer-memory kernel
//    module: nvidia_peermem (/sys/module/nvidia_peermem/version) or the older nv_peer_mem
//    (/sys/kernel/mm/memory_peers/nv_mem/version or .../nv_mem_nc/version);
//  - NCCL_PTR_DMABUF needs ibv_reg_dmabuf_mr (rdma-core >= 34) and a kernel and HCA that take
//    dma-buf registrations: a probe registration of fd -1 fails with EBADF where they do, and
//    with EOPNOTSUPP or EPROTONOSUPPORT where they do not (any other errno: taken as support,
//    the real registration then reports its own error).
// A missing capability falls back (host memory always works: NCCL then stages GPU data through
// host buffers) with the reason in the result for the log; communicator init never fails for
// it. Thread: the init path (once per process).
#pragma once

#include <string>
#include <vector>

#include "transport/ib/verbs_api.h"

namespace r2ccl::net::ib {

struct PtrSupport {
  int types = 0;       // NCCL_PTR_HOST | (NCCL_PTR_CUDA) | (NCCL_PTR_DMABUF)
  std::string cuda;    // why NCCL_PTR_CUDA is or is not advertised, for the INFO line
  std::string dmabuf;  // the same for NCCL_PTR_DMABUF
};

// gpu_build: false (a build without CUDA) advertises host memory only. sysfs_root: "/sys", or
// a made-up tree in tests. pds: one PD per HCA the transport uses; DMABUF only when every one
// takes the probe.
PtrSupport probe_ptr_support(const VerbsApi& v, const std::vector<ibv_pd*>& pds, bool gpu_build,
                             const std::string& sysfs_root);

}  // namespace r2ccl::net::ib
