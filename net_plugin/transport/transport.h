// A transport as the version-neutral API (api/net_api.h) sees it: devices and their
// properties, listen/connect/accept, and the per-process parts (statistics, the fault
// injector). Connections themselves are engine::Connection objects over the transport's
// PathIo (path_io.h); the API calls them directly for isend/irecv/test/flush.
//
// transport/factory.cc is the one place that knows the concrete transports (tcp, ib) and
// picks one per process (R2CCL_TRANSPORT).
//
// Semantics (../shared/reference/nccl-plugin-abi.md §4, NCCL 2.20-2.29): connect/accept
// never block (OK with a NULL comm means "call again"); sizes in bytes, speeds in Mbps.
// Threads: device_count/properties on NCCL's init thread; listen/connect/accept/close on its
// service thread; any of them concurrently with the data path of other comms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "engine/connection.h"
#include "r2ccl/status.h"
#include "transport/path_io.h"

namespace r2ccl::net {

// Device properties, version-neutral (speed in Mbps, latency in microseconds).
// The largest isend/irecv, bytes: getProperties' maxP2pBytes (v9+; reference §2, field 15,
// must be in (0, 2^40]).
constexpr size_t kMaxP2pBytes = size_t{1} << 30;

struct DeviceProps {
  const char* name = nullptr;
  const char* pci_path = nullptr;  // nullptr for virtual NICs
  uint64_t guid = 0;
  int speed_mbps = 0;
  int max_comms = 65536;
  // One buffer per irecv: the receiver-driven CTS flow matches one send to one receive.
  // maxRecvs > 1 would also turn on NCCL's shared comms and multiply the send-side request
  // budget (reference §4.6) for no gain.
  int max_recvs = 1;
  // NCCL (2.28) never posts more than 1 GiB in one call; test() reports sizes as ints. The
  // API refuses a larger isend/irecv (ncclInvalidUsage), whatever the API version.
  size_t max_p2p_bytes = kMaxP2pBytes;
  size_t max_coll_bytes = 1ull << 30;
  int ptr_support = NCCL_PTR_HOST;  // NCCL_PTR_* bits
  int port = 0;                     // verbs port number, 0 for TCP rails
};

// A transport's connection while connect/accept are in progress, then its PathIo.
class ConnIo : public PathIo {
 public:
  // One non-blocking step of connect or accept: *done once every path is set up or known
  // down (a path that is down at setup is retried in the background). Errors end the
  // connect/accept with that status (the message names the cause).
  virtual Status setup_step(bool* done, TimeUs now) = 0;
};

// NCCL's listen comm. Its secret and id go into the handle; a peer must present both.
class Listener {
 public:
  virtual ~Listener() = default;
  int dev = 0;
  uint64_t listen_id = 0;
  uint8_t secret[16] = {};
  std::unique_ptr<ConnIo> building;  // the accept in progress
  bool refusal_logged = false;       // the refusal below was warned about (service thread)

  // The peer that holds this listen comm's handle refused it (transport/handshake.h: a
  // transport or version mismatch told by the connector): every accept() from now on fails
  // with `st` and the message, at once. Any thread (TCP: the background thread).
  void refuse(Status st, const std::string& why) {
    std::lock_guard<std::mutex> lk(refusal_mu_);
    if (refusal_st_ != Status::kOk) return;  // the first cause stays
    refusal_st_ = st;
    refusal_ = why;
  }
  // kOk, or the refusal's status with *why.
  Status refusal(std::string* why) {
    std::lock_guard<std::mutex> lk(refusal_mu_);
    *why = refusal_;
    return refusal_st_;
  }

 private:
  std::mutex refusal_mu_;
  Status refusal_st_ = Status::kOk;  // guarded by refusal_mu_
  std::string refusal_;              // guarded by refusal_mu_
};

class Transport {
 public:
  virtual ~Transport() = default;
  // "TCP" or "IB", for the banner and messages.
  virtual const char* name() const = 0;
  // The init banner's text after "transport NAME (...)": devices and knobs.
  virtual std::string banner() const = 0;
  virtual int device_count() const = 0;
  // Errors: kInternal for a device that does not exist.
  virtual Status properties(int dev, DeviceProps* p) const = 0;
  // Fills NCCL's 128-byte handle. Errors: kInternal (bad device), kSystem (no listener).
  virtual Status listen(int dev, void* handle, Listener** out) = 0;
  // Non-blocking: *out = the connection once set up, NULL while in progress. Errors:
  // kInternal for a foreign handle, kRemote when the peer never answers.
  virtual Status connect(int dev, int traffic_class, void* handle, Connection** out) = 0;
  virtual Status accept(Listener* l, Connection** out) = 0;
  virtual void close_listen(Listener* l) = 0;
  // Unregisters, tells the peer (best effort) and frees the connection. Never waits on the
  // network.
  virtual void close(Connection* c) = 0;
  // Memory types regMr accepts (NCCL_PTR_* bits); anything else is refused with a WARN.
  virtual int mr_types() const = 0;
  // JSON statistics for r2cclExt_v1.getStats (common/include/r2ccl/ext.h).
  virtual std::string stats_json() = 0;
  // r2cclExt_v1.armFaults: 0, or -1 with a WARN naming why.
  virtual int arm_faults(const char* spec) = 0;
};

}  // namespace r2ccl::net
