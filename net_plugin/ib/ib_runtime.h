// The per-process verbs runtime: the verbs table, the HCA ports (one NCCL device per active
// port), their live state from async events, one MR cache per HCA, the side-channel rail,
// statistics, and the ONE background thread of the verbs transport.
//
// Thread ownership:
//  - HCA live state and statistics: atomics, written by the background thread (async events)
//    and the data path.
//  - HcaInfo GIDs: re-selected by the background thread after IBV_EVENT_GID_CHANGE under
//    hca_mu_; connection code copies them under the same lock (rebuild, never per chunk).
//  - The connection registry: registry_mu_, taken by the service thread (connect/accept/
//    close) and the background thread, never by isend/irecv/test.
//  - A connection's QPs and CQs: whoever holds its progress token (IbConn::try_enter): the
//    proxy thread inside isend/irecv/test, or the background thread for connections the
//    proxy thread left alone for a while (probes, failure detection and failback when idle).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/path_health.h"
#include "engine/test_hooks.h"
#include "ib/ib_devices.h"
#include "ib/mr_cache.h"
#include "ib/verbs_api.h"
#include "predict/predict_agent.h"
#include "r2ccl/health_board.h"
#include "r2ccl/params.h"
#include "r2ccl/rail_stats.h"
#include "r2ccl/random.h"
#include "r2ccl/status.h"
#include "sock/rails.h"

namespace r2ccl::net::ib {

class IbConn;

// Live state of one HCA port; discarded_chunks counts chunk immediates for no posted receive
// and duplicates.
struct HcaLive : RailCounters {
  std::atomic<bool> port_active{false};
  std::atomic<uint32_t> port_err_events{0};     // IBV_EVENT_PORT_ERR seen
  std::atomic<uint32_t> port_active_events{0};  // IBV_EVENT_PORT_ACTIVE seen
  std::atomic<uint32_t> gid_changes{0};         // the selected GID changed
};

class IbRuntime {
 public:
  // Chooses the transport for this process from R2CCL_TRANSPORT and, for auto/ib, creates
  // the verbs runtime. *use_ib = false means "use TCP" (auto without a verbs library or an
  // active port; or tcp). Errors: kInvalidUsage for a bad variable (message names it),
  // kSystem for R2CCL_TRANSPORT=ib without a loadable verbs library or an active port.
  // *why says what decided, for the init banner. Thread: init, once per process.
  static Status choose(bool* use_ib, std::string* why, std::string* err);
  // The runtime created by choose(), else nullptr.
  static IbRuntime* peek();

  const Config& cfg() const { return *cfg_; }
  const VerbsApi& v() const { return *v_; }
  const std::vector<HcaInfo>& hcas() const { return set_->hcas(); }
  // NCCL device d -> HCA index (the ports active at init, in discovery order).
  const std::vector<int>& devices() const { return devices_; }
  HcaLive& live(int hca) { return live_[hca]; }
  const HealthParams& health() const { return health_; }
  const TestHooks& hooks() const { return hooks_; }
  const Rail& side_rail() const { return side_rail_; }
  // The MR cache of HCA port `hca`'s protection domain (ports of one device share it).
  MrCache& mr_cache(int hca) { return *mr_caches_[mr_cache_of_[hca]]; }
  // Primary HCA then up to R2CCL_BACKUP_PATHS other ports with the same link layer, nearest
  // first (same PCIe switch, then NUMA node, then the rest).
  std::vector<int> path_set(int primary_hca) const;
  // A copy of HCA i's current addressing (GID may change at run time).
  HcaInfo hca_snapshot(int i);

  void register_conn(IbConn* c);
  void unregister_conn(IbConn* c);
  uint64_t random_u64();
  void random_bytes(void* out, size_t n);
  std::string stats_json();

 private:
  IbRuntime() = default;
  Status init(const Config* cfg, const VerbsApi* v, std::unique_ptr<HcaSet> set, std::string* err);
  void bg_loop();
  void handle_async(int hca_dev_ctx_index);
  void progress_idle_conns();
  void publish_board(TimeUs now);  // background thread, at most every 100 ms

  const Config* cfg_ = nullptr;
  const VerbsApi* v_ = nullptr;
  std::unique_ptr<HcaSet> set_;
  std::vector<int> devices_;
  std::unique_ptr<HcaLive[]> live_;
  std::vector<std::unique_ptr<MrCache>> mr_caches_;  // one per PD (device)
  std::vector<size_t> mr_cache_of_;                   // HCA port index -> mr_caches_ index
  HealthParams health_;
  TestHooks hooks_;
  Rail side_rail_;
  std::mutex hca_mu_;
  std::mutex registry_mu_;
  std::vector<IbConn*> conns_;  // guarded by registry_mu_
  // Health board (docs/HEALTH-BOARD.md): opened at init unless R2CCL_HEALTH_BOARD=none;
  // published by the background thread.
  board::Publisher board_;
  PredictAgent predict_;  // the failure predictor (background thread)
  std::vector<board::RailPublishState> board_rails_;  // background thread only
  TimeUs board_next_ = 0;                             // background thread only

  Rng rng_;
  std::thread bg_;
};

}  // namespace r2ccl::net::ib
