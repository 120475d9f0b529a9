// r2ccl_perf: loading a net plugin by NCCL's rules and calling it the way one NCCL generation
// does (net API v8..v11), behind one version-neutral interface. Also the NCCL-style logger the
// driver hands to init.
// Thread-safety: one Net per process, used from one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "r2ccl/nccl_abi.h"

namespace r2perf {

// Any failure inside a rank: a failing plugin call, a protocol violation, a broken rendezvous.
struct PerfError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const char* nccl_result_name(ncclResult_t r);

// Logger passed to init. Prints "HOST:PID:TID [RANK] NCCL WARN|INFO|TRACE msg" on stderr,
// filtered by NCCL_DEBUG (unset/VERSION/WARN: WARN only; INFO: + INFO; TRACE: + TRACE; NONE:
// nothing).
void set_log_rank(int rank);
void perf_logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                 const char* fmt, ...) __attribute__((format(printf, 5, 6)));

struct DevInfo {
  std::string name;
  int ptr_support = 0;
  int max_recvs = 0;
  int speed = 0;
  size_t max_p2p_bytes = 0;  // 0 when the API version has no such field (v8)
};

class Net {
 public:
  Net() = default;
  Net(const Net&) = delete;
  Net& operator=(const Net&) = delete;

  // Opens `spec` by NCCL's rules (see r2ccl_perf --help) and picks the newest of
  // ncclNetPlugin_v11.._v8, or exactly v`force_api` when it is not 0. Throws PerfError.
  void load(const std::string& spec, int force_api);

  const std::string& path() const { return path_; }
  const std::string& name() const { return name_; }
  int api() const { return api_; }
  void* dl_handle() const { return dl_; }

  // v8..v10: init once per process. v11: init per communicator (returns its context).
  void init_process();
  void* init_comm(uint64_t comm_id);
  void finalize_comm(void* ctx);

  int devices();
  DevInfo properties(int dev);

  // Data-path wrappers. Each returns the plugin's result unchanged; the caller decides what
  // a failure means. NULL out-pointers mean "call again" where the ABI says so.
  ncclResult_t listen(void* ctx, int dev, void* handle, void** listen_comm);
  ncclResult_t connect(void* ctx, int dev, void* handle, void** send_comm);
  ncclResult_t accept(void* listen_comm, void** recv_comm);
  ncclResult_t reg_mr(void* comm, void* data, size_t size, void** mhandle);
  ncclResult_t dereg_mr(void* comm, void* mhandle);
  ncclResult_t isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                     void** request);
  // One buffer per call (n = 1). For v9+ stores NCCL_NET_OPTIONAL_RECV_COMPLETION in *request
  // first, like NCCL 2.24+, and throws if the plugin returns success leaving it there.
  ncclResult_t irecv(void* recv_comm, void* data, size_t size, int tag, void* mhandle,
                     void** request);
  ncclResult_t iflush(void* recv_comm, void* data, int size, void* mhandle, void** request);
  ncclResult_t test(void* request, int* done, int* size);
  ncclResult_t close_send(void* comm);
  ncclResult_t close_recv(void* comm);
  ncclResult_t close_listen(void* comm);

  // dlsym in the loaded library, or nullptr.
  void* symbol(const char* name) const;

 private:
  void* dl_ = nullptr;
  int api_ = 0;
  std::string path_, name_;
  const ncclNet_v8_t* v8_ = nullptr;
  const ncclNet_v9_t* v9_ = nullptr;
  const ncclNet_v10_t* v10_ = nullptr;
  const ncclNet_v11_t* v11_ = nullptr;
  ncclNetCommConfig_v10_t config_{NCCL_NET_TRAFFIC_CLASS_UNDEF};
};

}  // namespace r2perf
