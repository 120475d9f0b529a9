#include "transport/ib/runtime.h"

#include <fcntl.h>
#include <ifaddrs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "engine/path_plan.h"
#include "r2ccl/log.h"
#include "sock/socket_util.h"
#include "transport/ib/caps.h"
#include "transport/ib/conn.h"
#include "transport/ib/gdr.h"
#include "transport/ib/pairing.h"

namespace r2ccl::net::ib {
namespace {

// The side channel's address: the first rail of R2CCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME /
// auto-detection (NCCL's bootstrap interface rule), else loopback for a single host.
bool pick_side_rail(const Config& cfg, Rail* out, std::string* err) {
  std::string var = getenv("R2CCL_SOCKET_IFNAME")  ? "R2CCL_SOCKET_IFNAME"
                    : getenv("NCCL_SOCKET_IFNAME") ? "NCCL_SOCKET_IFNAME"
                                                   : "auto-detection";
  std::vector<Rail> rails;
  std::string e;
  if (select_rails(cfg.socket_ifname, var, system_interfaces(), 0, &rails, &e) && !rails.empty()) {
    *out = rails[0];
    return true;
  }
  if (!cfg.socket_ifname.empty()) {
    *err = "verbs side channel: " + e;
    return false;
  }
  if (!select_rails("=lo", "loopback fallback", system_interfaces(), 0, &rails, &e) ||
      rails.empty()) {
    *err = "verbs side channel: no interface with an address (set R2CCL_SOCKET_IFNAME): " + e;
    return false;
  }
  R2CCL_WARN(
      "verbs side channel on loopback (%s): no other interface has an address; set "
      "R2CCL_SOCKET_IFNAME for multi-node jobs",
      rails[0].name.c_str());
  *out = rails[0];
  return true;
}

std::string port_name(const HcaInfo& h) { return h.name + ":" + std::to_string(h.port); }

// Before Linux 5.13 a fork() in the training process (DataLoader workers, subprocess) makes
// registered pages copy-on-write: the parent's next write to one gives it a private copy while
// the HCA goes on writing the old page, now the child's, so a sender polling its CTS FIFO would
// wait for records that never arrive. ibv_fork_init (before any registration) marks the pages
// MADV_DONTFORK; rdma-core >= 35 says when the kernel needs none (IBV_FORK_UNNEEDED). NCCL's
// own IB transport calls it too. A failure is warned, not fatal: a job that never forks works.
void prepare_for_fork(const VerbsApi& v) {
  if (v.is_fork_initialized && v.is_fork_initialized() == IBV_FORK_UNNEEDED) return;
  if (!v.fork_init) return;
  if (const int e = v.fork_init(); e != 0)
    R2CCL_WARN(
        "ibv_fork_init: %s: on this kernel a fork() in the training process (DataLoader "
        "workers) can leave RDMA buffers stale and hang the job",
        strerror(e));
}

}  // namespace

Status Runtime::create(const Config* cfg, bool required, std::unique_ptr<Runtime>* out,
                       std::string* why, std::string* err) {
  out->reset();
  std::string e;
  const VerbsApi* v = VerbsApi::load(cfg->ibverbs_lib, &e);
  if (!v) {
    if (required) {
      *err = "R2CCL_TRANSPORT=ib: " + e;
      return Status::kSystem;
    }
    if (getenv("R2CCL_IBVERBS_LIB"))  // set on purpose: its failure must not pass unnoticed
      R2CCL_WARN("R2CCL_TRANSPORT=auto: %s; using the TCP transport", e.c_str());
    *why = "no verbs library (" + e + ")";
    return Status::kOk;
  }
  prepare_for_fork(*v);
  std::unique_ptr<HcaSet> set;
  if (!HcaSet::discover(v, *cfg, &set, err)) return Status::kInvalidUsage;
  if (!set->any_active()) {
    if (required) {
      *err = "R2CCL_TRANSPORT=ib: no active HCA port" +
             std::string(cfg->ib_hca.empty() ? "" : " selected by R2CCL_IB_HCA=" + cfg->ib_hca) +
             " (" + std::to_string(set->hcas().size()) + " ports found)";
      return Status::kSystem;
    }
    *why = std::to_string(set->hcas().size()) + " HCA ports, none active";
    return Status::kOk;
  }
  std::unique_ptr<Runtime> rt(new Runtime());
  R2CCL_CHECK(rt->init(cfg, v, std::move(set), err));
  *why = required ? "verbs; R2CCL_TRANSPORT=ib" : "verbs; auto: an HCA port is active";
  *out = std::move(rt);
  return Status::kOk;
}

std::shared_ptr<MrCache> Runtime::make_mr_cache(ibv_pd* pd) {
  const VerbsApi* vv = v_;
  return std::make_shared<MrCache>(
      [vv, pd](uintptr_t start, size_t len, std::string* e) -> void* {
        // Data buffers with PCIe relaxed ordering where the library takes it (as NCCL does
        // by default): the HCA's writes into GPU memory then need the iflush READ to be
        // visible, which they need anyway. The connection area stays strictly ordered.
        constexpr int kAccess =
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
        void* addr = reinterpret_cast<void*>(start);
        ibv_mr* mr = vv->reg_mr_iova2 ? vv->reg_mr_iova2(pd, addr, len, start,
                                                         kAccess | IBV_ACCESS_RELAXED_ORDERING)
                                      : vv->reg_mr(pd, addr, len, kAccess);
        if (!mr) {
          const int reg_errno = errno;  // MrCache's callers read it (EIO: a dead device)
          *e = std::string("ibv_reg_mr: ") + strerror(reg_errno);
          errno = reg_errno;
        }
        return mr;
      },
      [vv](void* mr) { vv->dereg_mr(static_cast<ibv_mr*>(mr)); },
      static_cast<size_t>(sysconf(_SC_PAGESIZE)));
}

std::shared_ptr<MrCache> Runtime::mr_cache(int hca, uint32_t* epoch) {
  std::lock_guard<std::mutex> g(hca_mu_);
  if (epoch) *epoch = hcas()[hca].epoch;
  return mr_caches_[mr_cache_of_[hca]];
}

uint32_t Runtime::hca_epoch(int i) {
  std::lock_guard<std::mutex> g(hca_mu_);
  return hcas()[i].epoch;
}

std::vector<Runtime::QpEvent> Runtime::qp_events_after(uint64_t seq, bool* lost) {
  std::lock_guard<std::mutex> g(qp_event_mu_);
  const uint64_t last = qp_event_seq_.load(std::memory_order_relaxed);
  *lost = last - seq > kQpEventRing;
  std::vector<QpEvent> out;
  for (uint64_t k = std::max(seq + 1, last >= kQpEventRing ? last - kQpEventRing + 1 : 1);
       k <= last; ++k)
    out.push_back(qp_events_[k % kQpEventRing]);
  return out;
}

Status Runtime::init(const Config* cfg, const VerbsApi* v, std::unique_ptr<HcaSet> set,
                     std::string* err) {
  v_ = v;
  set_ = std::move(set);
  if (!pick_side_rail(*cfg, &side_rail_, err)) return Status::kInvalidUsage;
  if (!gdr_level_of(*cfg, &gdr_level_, &gdr_level_text_, err)) return Status::kInvalidUsage;
  const auto& h = set_->hcas();
  std::vector<RailInfo> info;
  for (size_t i = 0; i < h.size(); ++i) {
    RailInfo r;
    r.name = port_name(h[i]);  // as on the board
    r.speed_mbps = h[i].speed_mbps;
    r.link_up = h[i].active;
    r.predict.name = r.name;
    r.predict.kind = predict::RailSpec::Kind::kIb;
    r.predict.device = h[i].name;
    r.predict.port = h[i].port;
    info.push_back(std::move(r));
    if (h[i].active && h[i].gid_index >= 0) usable_.push_back(static_cast<int>(i));
    ibv_pd* pd = h[i].pd;
    size_t same = i;
    for (size_t j = 0; j < i; ++j)
      if (h[j].pd == pd) same = j;
    if (same != i) {  // another port of the same device: its PD, its cache
      mr_cache_of_.push_back(mr_cache_of_[same]);
      continue;
    }
    mr_cache_of_.push_back(mr_caches_.size());
    mr_caches_.push_back(make_mr_cache(pd));
  }
  dead_.assign(h.size(), false);
  subnet_bits_.assign(h.size(), 0);
  for (size_t i = 0; i < h.size(); ++i) {
    load_subnet(static_cast<int>(i));
    PairEnd e;
    e.link_layer = h[i].link_layer;
    memcpy(e.gid, h[i].gid, 16);
    e.subnet_bits = subnet_bits_[i];
    R2CCL_INFO(NCCL_INIT | NCCL_NET, "%s subnet %s", port_name(h[i]).c_str(),
               subnet_text(e).c_str());
  }
  if (usable_.empty()) {
    *err =
        "no active HCA port has a usable GID (check R2CCL_IB_GID_INDEX / "
        "R2CCL_IB_ADDR_FAMILY / R2CCL_IB_ADDR_RANGE)";
    return Status::kSystem;
  }
  std::vector<Device> devices;  // one NCCL device per active port
  for (int i : usable_)
    devices.push_back(Device{i, h[i].name, h[i].pci_path, h[i].guid, h[i].port, describe(h[i])});
#ifdef R2CCL_USE_CUDA
  constexpr bool kGpuBuild = true;
#else
  constexpr bool kGpuBuild = false;
#endif
  std::vector<ibv_pd*> pds;
  for (int i : usable_)
    if (std::find(pds.begin(), pds.end(), h[i].pd) == pds.end()) pds.push_back(h[i].pd);
  const PtrSupport ptr = probe_ptr_support(*v_, pds, kGpuBuild, "/sys");
  int types = ptr.types;
  // R2CCL_TEST_HOOKS=gpu_pci=PATH: host memory stands in for GPU buffers (tests).
  TestHooks hooks;
  std::string herr;
  if (parse_test_hooks(cfg->test_hooks, &hooks, &herr) && !hooks.gpu_pci.empty())
    types |= NCCL_PTR_CUDA;
  R2CCL_INFO(
      NCCL_INIT | NCCL_NET,
      "NET/R2CCL verbs: GPU buffers (NCCL_PTR_CUDA) %s: %s; dma-buf (NCCL_PTR_DMABUF) %s: %s",
      (types & NCCL_PTR_CUDA) ? "advertised" : "not advertised", ptr.cuda.c_str(),
      (types & NCCL_PTR_DMABUF) ? "advertised" : "not advertised", ptr.dmabuf.c_str());
  // NCCL_IB_TIMEOUT is often raised (20-22) for NCCL's own QPs, which have no other failure
  // detection; read as the fallback of R2CCL_IB_TIMEOUT it also sets how long r2ccl must let
  // a silent path be (two QP retransmissions) before failing it over.
  if (std::find(cfg->sources.begin(), cfg->sources.end(),
                "R2CCL_IB_TIMEOUT from NCCL_IB_TIMEOUT") != cfg->sources.end()) {
    const TimeUs per_try =
        ib_retry_timeout_us(static_cast<int>(cfg->ib_timeout)) / cfg->test_time_scale;
    R2CCL_WARN(
        "NCCL_IB_TIMEOUT=%lld is used for r2ccl's QPs too (R2CCL_IB_TIMEOUT is unset): a QP "
        "waits %.3f s per retransmission, so a silent (black-holed) verbs path is failed over "
        "after %.3f s at the earliest instead of 0.134 s; set R2CCL_IB_TIMEOUT (14 by default) "
        "for r2ccl's own QPs%s",
        static_cast<long long>(cfg->ib_timeout), per_try / 1e6, 2 * per_try / 1e6,
        cfg->test_time_scale > 1 ? " (times divided by R2CCL_TEST_TIME_SCALE: a test run)" : "");
  }
  char knobs[256];
  snprintf(knobs, sizeof(knobs),
           "%lld backup paths, %lld QPs per path, chunk %lld KiB, stripe %s, QP timeout %lld "
           "retry %lld, side channel %s",
           static_cast<long long>(cfg->backup_paths), static_cast<long long>(cfg->ib_qps_per_path),
           static_cast<long long>(cfg->chunk_size / 1024), cfg->stripe ? "on" : "off",
           static_cast<long long>(cfg->ib_timeout), static_cast<long long>(cfg->ib_retry_cnt),
           side_rail_.name.c_str());
  const Traits traits{"IB",          board::Transport::kIb, 0x52324942434f4e4eull /* "R2IBCONN" */,
                      "port error",  "port error event",    5,
                      10 * kUsPerMs, TransportKind::kIb,    kIbWireVersion};
  R2CCL_CHECK(init_base(cfg, traits, std::move(info), std::move(devices), types, knobs, err));
  // Async events are read without blocking by the background thread, one descriptor per
  // device (its first port).
  for (size_t i = 0; i < h.size(); ++i) {
    bool seen = false;
    for (int o : async_owner_) seen |= h[o].ctx == h[i].ctx;
    if (seen) continue;
    const int fl = fcntl(h[i].ctx->async_fd, F_GETFL);
    if (fl >= 0) fcntl(h[i].ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
    async_owner_.push_back(static_cast<int>(i));
  }
  keep_spare_descriptor();  // a starved listen comm refuses its connector with it
  start_background();
  return Status::kOk;
}

Status Runtime::listen(int dev, void* handle, Listener** out) {
  *out = nullptr;
  if (dev < 0 || dev >= device_count()) {
    R2CCL_WARN("listen: device %d does not exist (%d devices)", dev, device_count());
    return Status::kInternal;
  }
  auto* l = new Listen(this, dev);
  if (l->fd < 0) {
    delete l;
    return Status::kSystem;
  }
  IbWireHandle h{};
  h.magic = kHandleMagic;
  h.version = kIbWireVersion;
  h.kind = static_cast<uint8_t>(TransportKind::kIb);
  h.listener.family = static_cast<uint8_t>(side_rail_.family);
  h.listener.port = local_port(l->fd);  // network order
  memcpy(h.listener.addr, addr_bytes(side_rail_.addr), side_rail_.family == AF_INET ? 4 : 16);
  memcpy(h.secret, l->secret, 16);
  h.listen_id = l->listen_id;
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(handle, &h, sizeof(h));
  *out = l;
  return Status::kOk;
}

std::unique_ptr<ConnIo> Runtime::new_conn_io(int dev, int traffic_class, const void* handle,
                                             Listener* accept, Status* st) {
  if (accept) return std::unique_ptr<ConnIo>(new Conn(this, static_cast<Listen*>(accept)));
  IbWireHandle h;
  memcpy(&h, handle, sizeof(h));
  if (h.magic != kHandleMagic || h.version != kIbWireVersion ||
      h.kind != static_cast<uint8_t>(TransportKind::kIb) ||
      (h.listener.family != AF_INET && h.listener.family != AF_INET6)) {
    R2CCL_WARN(
        "connect: the handle is not an r2ccl verbs v%u handle (magic %08x, version %u, "
        "family %u); do both ends use the same R2CCL_TRANSPORT?",
        kIbWireVersion, h.magic, h.version, h.listener.family);
    *st = Status::kInternal;
    return nullptr;
  }
  return std::unique_ptr<ConnIo>(new Conn(this, h, dev, traffic_class));
}

std::vector<int> Runtime::path_set(int primary) const {
  const auto& h = hcas();
  const std::vector<int> near = backup_order(h, primary);
  return order_rails(
      primary, static_cast<int>(h.size()), 1 + static_cast<int>(cfg().backup_paths), [&](int i) {
        if (h[i].link_layer != h[primary].link_layer || h[i].gid_index < 0) return -1;
        if (std::find(usable_.begin(), usable_.end(), i) == usable_.end()) return -1;
        return static_cast<int>(std::find(near.begin(), near.end(), i) - near.begin());
      });
}

int Runtime::subnet_bits(int i) {
  std::lock_guard<std::mutex> g(hca_mu_);
  return i >= 0 && i < static_cast<int>(subnet_bits_.size()) ? subnet_bits_[i] : 0;
}

void Runtime::load_subnet(int i) {
  const HcaInfo& h = hcas()[i];
  int bits = 0;
  if (h.gid_index >= 0 && h.link_layer != IBV_LINK_LAYER_ETHERNET) {
    bits = 64;  // the GID's subnet prefix
  } else if (h.gid_index >= 0) {
    // The kernel names the GID's netdev (rdma-core's sysfs ABI, gid_attrs/ndevs/<index>).
    std::string ndev;
    std::ifstream f(std::string(h.ctx->device->ibdev_path) + "/ports/" + std::to_string(h.port) +
                    "/gid_attrs/ndevs/" + std::to_string(h.gid_index));
    if (!(f >> ndev)) ndev.clear();
    ifaddrs* list = nullptr;
    const bool fake = v_->netdev_getifaddrs && v_->netdev_freeifaddrs;
    if ((fake ? v_->netdev_getifaddrs(&list) : getifaddrs(&list)) == 0) {
      bits = roce_subnet_bits(h.gid, ndev, interfaces_from(list));
      if (fake)
        v_->netdev_freeifaddrs(list);
      else
        freeifaddrs(list);
    }
  }
  subnet_bits_[i] = bits;
}

HcaInfo Runtime::hca_snapshot(int i) {
  std::lock_guard<std::mutex> g(hca_mu_);
  return hcas()[i];
}

// ------------------------------------------------------------------------------------------
// Background thread: async events.

void Runtime::bg_add_fds(std::vector<pollfd>* fds) {
  for (int o : async_owner_) fds->push_back({hcas()[o].ctx->async_fd, POLLIN, 0});
}

void Runtime::bg_on_fds(const pollfd* fds, size_t n, TimeUs now) {
  for (size_t k = 0; k < n && k < async_owner_.size(); ++k)
    if (fds[k].revents & POLLIN) handle_async(async_owner_[k]);
  reopen_dead(now);
}

void Runtime::device_fatal(int i) {
  const auto& h = hcas();
  ibv_context* ctx = h[i].ctx;
  for (size_t j = 0; j < h.size(); ++j) {
    if (h[j].ctx != ctx || dead_[j]) continue;
    dead_[j] = true;
    RailLive& l = live(static_cast<int>(j));
    if (l.link_up.exchange(false)) l.down_events++;
    log_event(
        "%s device fatal error (IBV_EVENT_DEVICE_FATAL: the HCA resets): its paths fail over; "
        "the device is reopened once its reset is done",
        port_name(h[j]).c_str());
  }
  next_reopen_ = 0;  // the first try at the next pass: a quick reset may be done already
}

void Runtime::reopen_dead(TimeUs now) {
  if (now < next_reopen_ || std::find(dead_.begin(), dead_.end(), true) == dead_.end()) return;
  next_reopen_ = now + kReopenPeriod;
  const auto& h = hcas();
  for (size_t i = 0; i < h.size(); ++i) {
    if (!dead_[i]) continue;
    std::string why;
    bool ok;
    {
      std::lock_guard<std::mutex> g(hca_mu_);
      ok = set_->reopen(static_cast<int>(i), &why);
      if (ok) {
        // One new MR cache for the new PD; holders of the old one release into it.
        const size_t slot = mr_cache_of_[i];
        mr_caches_[slot] = make_mr_cache(h[i].pd);
      }
    }
    if (!ok) {
      R2CCL_INFO(NCCL_NET, "%s: not reopened yet: %s", port_name(h[i]).c_str(), why.c_str());
      continue;
    }
    const int fl = fcntl(h[i].ctx->async_fd, F_GETFL);
    if (fl >= 0) fcntl(h[i].ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
    for (size_t j = 0; j < h.size(); ++j) {
      if (!dead_[j] || h[j].ctx != h[i].ctx) continue;
      dead_[j] = false;
      RailLive& l = live(static_cast<int>(j));
      const bool active = hca_snapshot(static_cast<int>(j)).active;
      log_event("%s device reopened after its fatal error (incarnation %u), port %s",
                port_name(h[j]).c_str(), h[j].epoch, active ? "active" : "down");
      if (active && !l.link_up.exchange(true)) l.up_events++;
    }
  }
}

void Runtime::handle_async(int i) {
  const auto& h = hcas();
  ibv_context* ctx = h[i].ctx;
  for (int k = 0; k < 64; ++k) {
    ibv_async_event ev;
    if (v_->get_async_event(ctx, &ev) != 0) return;  // EAGAIN: drained
    const ibv_event_type t = ev.event_type;
    const int port = (t == IBV_EVENT_PORT_ERR || t == IBV_EVENT_PORT_ACTIVE ||
                      t == IBV_EVENT_GID_CHANGE || t == IBV_EVENT_LID_CHANGE)
                         ? ev.element.port_num
                         : 0;
    if (t == IBV_EVENT_QP_FATAL || t == IBV_EVENT_QP_REQ_ERR || t == IBV_EVENT_QP_ACCESS_ERR ||
        t == IBV_EVENT_CQ_ERR) {
      // Recorded before the ack: ibv_destroy_qp waits for the acks of its QP's events, so
      // the QP is still alive here (rdma-core, ibv_get_async_event(3)).
      std::lock_guard<std::mutex> g(qp_event_mu_);
      const uint64_t seq = qp_event_seq_.load(std::memory_order_relaxed) + 1;
      QpEvent& e = qp_events_[seq % kQpEventRing];
      e = QpEvent{};
      e.seq = seq;
      e.ctx = ctx;
      e.type = t;
      if (t == IBV_EVENT_CQ_ERR)
        e.cq = ev.element.cq;
      else
        e.qp_num = ev.element.qp->qp_num;
      qp_event_seq_.store(seq, std::memory_order_release);
      v_->ack_async_event(&ev);
      R2CCL_WARN("%s: async event %s on %s %u: its path fails", h[i].name.c_str(),
                 v_->event_type_str(t), t == IBV_EVENT_CQ_ERR ? "a CQ" : "QP", e.qp_num);
      continue;
    }
    v_->ack_async_event(&ev);
    if (t == IBV_EVENT_DEVICE_FATAL) {
      device_fatal(i);
      return;  // the context is dead: nothing more comes from it
    }
    for (size_t j = 0; j < h.size(); ++j) {
      if (h[j].ctx != ctx || (port != 0 && h[j].port != port)) continue;
      RailLive& l = live(static_cast<int>(j));
      if (t == IBV_EVENT_PORT_ERR) {
        if (l.link_up.exchange(false)) l.down_events++;
        log_event("%s port error event (port down)", port_name(h[j]).c_str());
      } else if (t == IBV_EVENT_PORT_ACTIVE) {
        // RoCE: the netdev's return re-adds its IP GIDs, possibly at other indices than
        // before the flap (GID_CHANGE may have been read already, or come later): the
        // failback's QPs use what this refresh selects, so say so when it changed.
        bool changed = false;
        {
          std::lock_guard<std::mutex> g(hca_mu_);
          changed = set_->refresh_port(static_cast<int>(j), nullptr);
          load_subnet(static_cast<int>(j));
        }
        if (!l.link_up.exchange(true)) l.up_events++;
        log_event("%s port active event", port_name(h[j]).c_str());
        if (changed)
          log_event("%s address change: GID re-selected, now %s", port_name(h[j]).c_str(),
                    describe(hca_snapshot(static_cast<int>(j))).c_str());
      } else if (t == IBV_EVENT_GID_CHANGE || t == IBV_EVENT_LID_CHANGE) {
        bool active = false, changed = false;
        {
          std::lock_guard<std::mutex> g(hca_mu_);
          changed = set_->refresh_port(static_cast<int>(j), &active);
          load_subnet(static_cast<int>(j));
        }
        if (changed)
          log_event("%s address change: GID re-selected, now %s", port_name(h[j]).c_str(),
                    describe(hca_snapshot(static_cast<int>(j))).c_str());
      } else {
        R2CCL_WARN("%s: async event %s", h[j].name.c_str(), v_->event_type_str(t));
      }
      if (port == 0) break;
    }
  }
}

}  // namespace r2ccl::net::ib
