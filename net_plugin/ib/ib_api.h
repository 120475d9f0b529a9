// The verbs transport behind the version-neutral net API (plugin/net_api.h forwards here
// when the process chose the verbs transport). Same semantics and threads as net_api.h:
// connect/accept and isend/irecv never block (OK with NULL = call again); sizes in bytes.
// Errors: kInternal for misuse (bad device, foreign handle, unsupported buffer type),
// kSystem/kRemote as the connection reports them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "r2ccl/status.h"

namespace r2ccl::net::ib {

struct IbDeviceProps {
  const char* name;      // "mlx5_0" (port in `port`)
  const char* pci_path;  // nullptr for a virtual NIC
  uint64_t guid;
  int speed_mbps;
  int port;
  int ptr_support;       // NCCL_PTR_HOST, plus CUDA/DMABUF in USE_CUDA builds
};

// The init banner's text (devices, knobs). Thread: init.
std::string banner_text();
int device_count();
Status get_properties(int dev, IbDeviceProps* p);
Status listen(int dev, void* handle, void** listen_comm);
Status connect(int dev, int traffic_class, void* handle, void** send_comm);
Status accept(void* listen_comm, void** recv_comm);
Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
Status reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                     void** mhandle);
Status dereg_mr(void* comm, void* mhandle);
Status isend(void* send_comm, void* data, size_t size, void* mhandle, void** request);
Status irecv(void* recv_comm, void* data, size_t size, int tag, void* mhandle, void** request);
Status iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
Status test(void* request, int* done, int* sizes);
Status close_conn(void* comm);
Status close_listen(void* listen_comm);
std::string stats_json();

}  // namespace r2ccl::net::ib
