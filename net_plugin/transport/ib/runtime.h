// The verbs transport's per-process runtime: the verbs table (dlopen'd), the HCA ports (one
// NCCL device per active port with a usable GID; every port is a rail), their async events
// (port error / active, GID change) on the background thread, one MR cache per protection
// domain, the side channel's rail, and the devices and handles NCCL sees. Everything else per
// process is RuntimeBase's.
//
// Thread ownership, on top of RuntimeBase's:
//  - HcaInfo GIDs: re-selected by the background thread after IBV_EVENT_GID_CHANGE or a port
//    coming up, under hca_mu_; connection code copies them under the same lock
//    (hca_snapshot, at setup and rebuild, never per chunk).
//  - A connection's QPs and CQs: whoever holds its progress token.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sock/rails.h"
#include "transport/ib/devices.h"
#include "transport/ib/mr_cache.h"
#include "transport/ib/verbs_api.h"
#include "transport/runtime_base.h"

namespace r2ccl::net::ib {

// An RC QP's local ACK timeout for the QP attribute `timeout` (0-31), microseconds:
// 4.096 us x 2^timeout (IBA spec, QP attribute "Local ACK Timeout"); 14 = 67 ms, 22 = 17.2 s.
// A lost packet is sent again after one such timeout, retry-exceeded after retry_cnt + 1.
constexpr TimeUs ib_retry_timeout_us(int timeout) {
  return static_cast<TimeUs>(4.096 * static_cast<double>(1ull << (timeout & 31)));
}

class Runtime final : public RuntimeBase {
 public:
  // Loads the verbs library and discovers the HCA ports. *out = nullptr (use TCP) when the
  // library is missing or no port is active and !required (R2CCL_TRANSPORT=auto), with *why
  // saying so. Errors: kInvalidUsage (a bad variable, named), kSystem when `required`
  // (R2CCL_TRANSPORT=ib) and no verbs library or no active port is found. Thread: init.
  static Status create(const Config* cfg, bool required, std::unique_ptr<Runtime>* out,
                       std::string* why, std::string* err);

  const VerbsApi& v() const { return *v_; }
  const std::vector<HcaInfo>& hcas() const { return set_->hcas(); }
  const Rail& side_rail() const { return side_rail_; }
  // The MR cache of HCA port `hca`'s protection domain (ports of one device share it).
  MrCache& mr_cache(int hca) { return *mr_caches_[mr_cache_of_[hca]]; }
  // Primary HCA then up to R2CCL_BACKUP_PATHS other ports with the same link layer, nearest
  // first (engine/path_plan.h with backup_order's PCIe/NUMA distance).
  std::vector<int> path_set(int primary_hca) const;
  // NCCL_NET_GDR_LEVEL as a GdrPathType (transport/ib/gdr.h): how far from its GPU a backup
  // HCA may carry a GPU buffer. Fixed at init.
  int gdr_level() const { return gdr_level_; }
  // "R2CCL_NET_GDR_LEVEL=PXB (default)", "NCCL_NET_GDR_LEVEL=PHB": the level and its source,
  // for log lines.
  const std::string& gdr_level_text() const { return gdr_level_text_; }
  // HCA i's subnet as PairEnd::subnet_bits (transport/ib/pairing.h): IB 64; RoCE its GID's
  // netdev address prefix (+96 for IPv4); 0 unknown. Re-read with the GID. Any thread.
  int subnet_bits(int i);
  // A copy of HCA i's current addressing (the GID may change at run time).
  HcaInfo hca_snapshot(int i);
  // This process's knobs as HELLO and REPLY carry them, with a connection's QPs per path and
  // adaptive-routing mode (transport/handshake.h).
  WireKnobs knobs(int qps_per_path, bool adaptive_routing) const {
    WireKnobs k = own_knobs(qps_per_path);
    k.adaptive_routing = adaptive_routing ? 1 : 0;
    return k;
  }

  // --- Transport ---
  Status listen(int dev, void* handle, Listener** out) override;

 private:
  Runtime() = default;
  // Connector: a verbs handle (magic, version 2, the side channel's family) is checked
  // first; the communicator's traffic class goes into the RoCE GRH. Acceptor: takes the next
  // side-channel connection of the listen comm.
  std::unique_ptr<ConnIo> new_conn_io(int dev, int traffic_class, const void* handle,
                                      Listener* accept, Status* st) override;
  Status init(const Config* cfg, const VerbsApi* v, std::unique_ptr<HcaSet> set, std::string* err);
  // Background thread: one async-event descriptor per device; port error / active and GID
  // change events update the ports' live state.
  void bg_add_fds(std::vector<pollfd>* fds) override;
  void bg_on_fds(const pollfd* fds, size_t n, TimeUs now) override;
  void handle_async(int hca);
  // Re-reads subnet_bits_[i] from the GID's netdev. Caller holds hca_mu_ (or init).
  void load_subnet(int i);

  const VerbsApi* v_ = nullptr;
  std::unique_ptr<HcaSet> set_;
  std::vector<int> usable_;  // HCA ports that are NCCL devices (active with a GID at init)
  std::vector<std::unique_ptr<MrCache>> mr_caches_;  // one per PD (device)
  std::vector<size_t> mr_cache_of_;                  // HCA port index -> mr_caches_ index
  Rail side_rail_;
  std::mutex hca_mu_;
  std::vector<int> async_owner_;  // background thread: bg fds[k] belongs to this HCA
  std::vector<int> subnet_bits_;  // by HCA, under hca_mu_
  int gdr_level_ = 5;             // kPathPxb
  std::string gdr_level_text_;
};

}  // namespace r2ccl::net::ib
