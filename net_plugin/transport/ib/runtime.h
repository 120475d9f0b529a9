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

#include <atomic>
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
  // How often the background thread tries to reopen a device after its fatal error (an
  // mlx5 firmware reset takes seconds).
  static constexpr TimeUs kReopenPeriod = 200 * kUsPerMs;

  // Loads the verbs library and discovers the HCA ports. *out = nullptr (use TCP) when the
  // library is missing or no port is active and !required (R2CCL_TRANSPORT=auto), with *why
  // saying so. Errors: kInvalidUsage (a bad variable, named), kSystem when `required`
  // (R2CCL_TRANSPORT=ib) and no verbs library or no active port is found. Thread: init.
  static Status create(const Config* cfg, bool required, std::unique_ptr<Runtime>* out,
                       std::string* why, std::string* err);

  const VerbsApi& v() const { return *v_; }
  const std::vector<HcaInfo>& hcas() const { return set_->hcas(); }
  const Rail& side_rail() const { return side_rail_; }
  // The MR cache of HCA port `hca`'s current protection domain (ports of one device share
  // it; a device reopened after a fatal error gets a new one, and the old one lives on while
  // someone holds it, to release what it handed out). Any thread.
  std::shared_ptr<MrCache> mr_cache(int hca, uint32_t* epoch = nullptr);
  // HCA port i's current incarnation (HcaInfo::epoch). Any thread.
  uint32_t hca_epoch(int i);
  // Asynchronous QP and CQ errors (IBV_EVENT_QP_FATAL, _QP_REQ_ERR, _QP_ACCESS_ERR,
  // _CQ_ERR), numbered from 1 in arrival order and kept in a ring of kQpEventRing. The QP
  // (or CQ) has stopped: its WRs may never complete (a CQ in error takes no completion), so
  // the connection owning it fails its path at once. Connections compare
  // qp_event_seq() with the last number they handled (one atomic load per poll) and read the
  // events after it with qp_events_after; a connection that fell behind the ring by more
  // than kQpEventRing gets *lost = true and checks all its QPs' states. Any thread.
  struct QpEvent {
    uint64_t seq = 0;
    ibv_context* ctx = nullptr;
    uint32_t qp_num = 0;   // QP events
    ibv_cq* cq = nullptr;  // IBV_EVENT_CQ_ERR
    ibv_event_type type{};
  };
  static constexpr size_t kQpEventRing = 64;
  uint64_t qp_event_seq() const { return qp_event_seq_.load(std::memory_order_acquire); }
  std::vector<QpEvent> qp_events_after(uint64_t seq, bool* lost);
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
  // A device-fatal error on HCA port i's device: its ports go down (their paths fail over)
  // until reopen_dead reopens the device after its reset.
  void device_fatal(int i);
  // Background thread, every kReopenPeriod: tries to reopen each dead device.
  void reopen_dead(TimeUs now);
  std::shared_ptr<MrCache> make_mr_cache(ibv_pd* pd);
  // Re-reads subnet_bits_[i] from the GID's netdev. Caller holds hca_mu_ (or init).
  void load_subnet(int i);

  const VerbsApi* v_ = nullptr;
  std::unique_ptr<HcaSet> set_;
  std::vector<int> usable_;  // HCA ports that are NCCL devices (active with a GID at init)
  std::vector<std::shared_ptr<MrCache>> mr_caches_;  // one per PD (device), under hca_mu_
  std::vector<size_t> mr_cache_of_;                  // HCA port index -> mr_caches_ index
  std::vector<bool> dead_;  // by HCA port: its device had a fatal error (background thread)
  TimeUs next_reopen_ = 0;  // background thread
  std::mutex qp_event_mu_;
  QpEvent qp_events_[kQpEventRing];  // under qp_event_mu_, slot seq % kQpEventRing
  std::atomic<uint64_t> qp_event_seq_{0};
  Rail side_rail_;
  std::mutex hca_mu_;
  std::vector<int> async_owner_;  // background thread: bg fds[k] belongs to this HCA
  std::vector<int> subnet_bits_;  // by HCA, under hca_mu_
  int gdr_level_ = 5;             // kPathPxb
  std::string gdr_level_text_;
};

}  // namespace r2ccl::net::ib
