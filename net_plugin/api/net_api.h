// The version-neutral r2ccl net API. The exported ncclNetPlugin_v8..v11 tables
// (abi/abi_nccl.cc) are thin adapters over these functions; nothing here knows an NCCL
// version, and nothing here knows a concrete transport: the process's transport comes from
// transport/factory.h, connections are engine::Connection objects.
// Semantics follow ../shared/reference/nccl-plugin-abi.md §4 (NCCL 2.20-2.29):
//  - connect/accept never block: OK with a NULL comm means "call again";
//  - isend/irecv never block: OK with a NULL request means "call again";
//  - sizes in bytes; message sizes are reported exactly by test().
// Threads: init/devices/getProperties on NCCL's init thread; listen/connect/accept/regMr/
// close on its service thread; isend/irecv/test/iflush on its proxy thread. Any function may
// run concurrently with others on different comms.
#pragma once

#include <cstddef>
#include <cstdint>

#include "r2ccl/nccl_abi.h"
#include "r2ccl/status.h"
#include "transport/transport.h"  // DeviceProps

namespace r2ccl::net {

struct NetContext {
  uint64_t comm_id = 0;
  int traffic_class = NCCL_NET_TRAFFIC_CLASS_UNDEF;
};

// Errors: kInvalidUsage for a bad configuration (the message names the variable).
Status api_init(NetContext** ctx, uint64_t comm_id, int traffic_class, ncclDebugLogger_t logger,
                int api_version);
Status api_finalize(NetContext* ctx);
Status api_devices(int* ndev);
Status api_get_properties(int dev, DeviceProps* props);
Status api_listen(NetContext* ctx, int dev, void* handle, void** listen_comm);
Status api_connect(NetContext* ctx, int dev, void* handle, void** send_comm);
Status api_accept(void* listen_comm, void** recv_comm);
Status api_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
// regMrDmaBuf; only the verbs transport in a USE_CUDA build advertises NCCL_PTR_DMABUF.
Status api_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                         void** mhandle);
Status api_dereg_mr(void* comm, void* mhandle);
Status api_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request);
Status api_irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
                 void** mhandles, void** request);
Status api_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
Status api_test(void* request, int* done, int* sizes);
Status api_close_send(void* send_comm);
Status api_close_recv(void* recv_comm);
Status api_close_listen(void* listen_comm);
// r2cclExt_v1.getStats (common/include/r2ccl/ext.h).
size_t api_get_stats(char* buf, size_t len);
// r2cclExt_v1.armFaults: 0, or -1 with a WARN.
int api_arm_faults(const char* spec);

}  // namespace r2ccl::net
