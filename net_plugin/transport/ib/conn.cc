#include "transport/ib/conn.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "engine/link_live.h"
#include "engine/path_plan.h"
#include "r2ccl/log.h"
#include "r2ccl/random.h"
#include "sock/rails.h"
#include "sock/socket_util.h"
#include "transport/ib/gdr.h"
#include "transport/ib/gpu_locate.h"
#include "transport/ib/pairing.h"

namespace r2ccl::net::ib {
namespace {

constexpr int kSqDepth = 256;   // send WRs per QP
constexpr int kRqDepth = 128;   // posted receives per QP (control SENDs and chunk immediates)
constexpr int kSqFull = -2;     // submit(): ENOMEM, nothing posted
constexpr int kSqReserve = 24;  // send WRs per QP kept for CTS, probes and control messages
constexpr int kPollBatch = 32;
constexpr uint64_t kRecvWrFlag = 1ull << 63;

enum WrKind : uint8_t { kWrData = 1, kWrDataPart, kWrCts, kWrProbe, kWrCtrl, kWrCredit };

bool recoverable(ibv_wc_status s) {
  return s == IBV_WC_RETRY_EXC_ERR || s == IBV_WC_RNR_RETRY_EXC_ERR || s == IBV_WC_WR_FLUSH_ERR;
}

Status fatal_status(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_REM_ABORT_ERR:
    case IBV_WC_REM_INV_RD_REQ_ERR: return Status::kRemote;
    default: return Status::kInternal;
  }
}

const char* ll_name(int ll) { return ll == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB"; }

PairEnd wire_end(const IbWireHca& w) {
  PairEnd e;
  e.link_layer = w.link_layer;
  e.gid_type = w.gid_type == 0xff ? -1 : w.gid_type;
  memcpy(e.gid, w.gid, 16);
  e.subnet_bits = w.subnet_bits;
  return e;
}

size_t page_round(size_t n) { return (n + 4095) & ~size_t(4095); }

// An RC QP from INIT to RTR and RTS towards `dest_qpn` on `peer` (the peer's port, its GID).
int qp_to_rts(const VerbsApi& v, ibv_qp* qp, const HcaInfo& h, const IbWireHca& peer,
              uint32_t dest_qpn, const Config& cfg, int tc) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(
      std::min<int>(h.active_mtu ? h.active_mtu : static_cast<int>(IBV_MTU_1024),
                    peer.mtu ? peer.mtu : static_cast<int>(IBV_MTU_1024)));
  a.dest_qp_num = dest_qpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = static_cast<uint8_t>(h.port);
  a.ah_attr.sl = static_cast<uint8_t>(cfg.ib_sl);
  // A GRH on RoCE always; on IB when either port requires one (IBV_QPF_GRH_REQUIRED: the
  // kernel refuses an AV without it at RTR, EINVAL, and such a port drops packets without
  // it). NCCL 2.30.7 looks at its own port only; the peer's flag comes in IbWireHca.
  const bool eth = h.link_layer == IBV_LINK_LAYER_ETHERNET;
  if (eth || (h.port_flags & IBV_QPF_GRH_REQUIRED) || (peer.flags & kWireHcaGrhRequired)) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(h.gid_index < 0 ? 0 : h.gid_index);
    a.ah_attr.grh.hop_limit = 255;
    a.ah_attr.grh.traffic_class = static_cast<uint8_t>(tc);
  }
  if (!eth) a.ah_attr.dlid = peer.lid;
  int e = v.modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (e != 0) {
    R2CCL_WARN("QP %u on %s to RTR: %s", qp->qp_num, h.name.c_str(), strerror(e));
    return e;
  }
  ibv_qp_attr b{};
  b.qp_state = IBV_QPS_RTS;
  b.timeout = static_cast<uint8_t>(cfg.ib_timeout);
  b.retry_cnt = static_cast<uint8_t>(cfg.ib_retry_cnt);
  b.rnr_retry = 7;
  b.sq_psn = 0;
  b.max_rd_atomic = 1;
  e = v.modify_qp(qp, &b,
                  IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                      IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (e != 0) R2CCL_WARN("QP %u on %s to RTS: %s", qp->qp_num, h.name.c_str(), strerror(e));
  return e;
}

// A new RC QP in INIT on the HCA's port.
ibv_qp* make_qp(const VerbsApi& v, const HcaInfo& h, ibv_cq* cq, int send_wr, int recv_wr,
                int access) {
  ibv_qp_init_attr ia{};
  ia.send_cq = cq;
  ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = static_cast<uint32_t>(send_wr);
  ia.cap.max_recv_wr = static_cast<uint32_t>(recv_wr);
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  ibv_qp* qp = v.create_qp(h.pd, &ia);
  if (!qp) {
    R2CCL_WARN("ibv_create_qp on %s: %s", h.name.c_str(), strerror(errno));
    return nullptr;
  }
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = h.pkey_index;  // R2CCL_IB_PKEY's index in this port's table (0 by default)
  a.port_num = static_cast<uint8_t>(h.port);
  a.qp_access_flags = access;
  const int e =
      v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (e != 0) {
    R2CCL_WARN("QP %u on %s to INIT: %s", qp->qp_num, h.name.c_str(), strerror(e));
    v.destroy_qp(qp);
    return nullptr;
  }
  return qp;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Listen comm

Listen::Listen(Runtime* r, int d) : rt(r) {
  dev = d;
  rt->new_identity(this);
  std::string err;
  fd = open_rail_listener(rt->side_rail(), &err);
  if (fd < 0)
    R2CCL_WARN("listen: side-channel listener on %s: %s", rt->side_rail().name.c_str(),
               err.c_str());
}

Listen::~Listen() {
  if (fd >= 0) ::close(fd);
}

// ------------------------------------------------------------------------------------------
// Construction, teardown, memory

Conn::Conn(Runtime* rt, Role role, int dev, int traffic_class)
    : rt_(rt), cfg_(rt->cfg()), v_(rt->v()), role_(role), dev_(dev) {
  tc_ =
      traffic_class != NCCL_NET_TRAFFIC_CLASS_UNDEF ? traffic_class : static_cast<int>(cfg_.ib_tc);
  nqps_ = static_cast<int>(cfg_.ib_qps_per_path);
  const int primary = rt_->device_rail(dev);
  ar_ = cfg_.ib_ar < 0 ? rt_->hcas()[primary].link_layer == IBV_LINK_LAYER_INFINIBAND
                       : cfg_.ib_ar == 1;
  const size_t area_len = page_round(sizeof(IbArea));
  area_ = static_cast<IbArea*>(aligned_alloc(4096, area_len));
  memset(area_, 0, area_len);
  area_mr_.assign(rt_->hcas().size(), nullptr);
  slots_mr_.assign(rt_->hcas().size(), nullptr);
  area_epoch_.assign(rt_->hcas().size(), 0);
  qp_events_seen_ = rt_->qp_event_seq();
  ctrl_slot_busy_.assign(kFifoDepth, false);
}

Conn::Conn(Runtime* rt, const IbWireHandle& h, int dev, int traffic_class)
    : Conn(rt, Role::kSend, dev, traffic_class) {
  handle_ = h;
}

Conn::Conn(Runtime* rt, Listen* listen)
    : Conn(rt, Role::kRecv, listen->dev, NCCL_NET_TRAFFIC_CLASS_UNDEF) {
  listen_ = listen;
}

Conn::~Conn() {
  for (auto& p : paths_) destroy_path_qps(p);
  for (size_t h = 0; h < flushq_.size(); ++h) drop_flush_qp(static_cast<int>(h));
  for (auto* mr : area_mr_)
    if (mr) v_.dereg_mr(mr);
  for (auto* mr : slots_mr_)
    if (mr) v_.dereg_mr(mr);
  free(area_);
  free(slots_);
  if (sc_fd_ >= 0) ::close(sc_fd_);
}

Status Conn::register_area_on(int hca) {
  if (area_mr_[hca]) return Status::kOk;
  const HcaInfo h = rt_->hca_snapshot(hca);
  area_epoch_[hca] = h.epoch;
  area_mr_[hca] = v_.reg_mr(h.pd, area_, page_round(sizeof(IbArea)),
                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!area_mr_[hca]) {
    R2CCL_WARN("ibv_reg_mr of the connection area on %s: %s", rt_->hcas()[hca].name.c_str(),
               strerror(errno));
    return Status::kSystem;
  }
  return Status::kOk;
}

Status Conn::register_slots_on(int hca) {
  if (slots_mr_[hca]) return Status::kOk;
  slots_mr_[hca] = v_.reg_mr(rt_->hca_snapshot(hca).pd, slots_, slots_len_, IBV_ACCESS_LOCAL_WRITE);
  if (!slots_mr_[hca]) {
    R2CCL_WARN("ibv_reg_mr of the control slots on %s: %s", rt_->hcas()[hca].name.c_str(),
               strerror(errno));
    return Status::kSystem;
  }
  return Status::kOk;
}

Status Conn::refresh_area_mrs(const HcaInfo& h, int hca) {
  if (area_epoch_[hca] == h.epoch) return Status::kOk;
  // The device was reopened after a fatal error: the old MRs died with its context.
  for (auto* v : {&area_mr_, &slots_mr_}) {
    if ((*v)[hca]) v_.dereg_mr((*v)[hca]);
    (*v)[hca] = nullptr;
  }
  R2CCL_CHECK(register_area_on(hca));
  return register_slots_on(hca);
}

ibv_mr* Conn::mr_on(const IbMr* cm, int hca, uint32_t epoch) {
  if (!cm || (!cm->by_hca[hca] && !cm->deferred_by_hca[hca])) return nullptr;
  if (cm->by_hca[hca] && cm->epoch_by_hca[hca] == epoch) return cm->by_hca[hca];
  // A QP of the incarnation a deferred registration could not be made on (still dead), or
  // of one older than the registration: nothing to make. (Making it again here would
  // deregister an MR whose rkey a CTS may have given the sender.)
  if (epoch <= cm->epoch_by_hca[hca]) return nullptr;
  auto* m = const_cast<IbMr*>(cm);  // the handle is this connection's; only its progress uses it
  if (!m->cached) {
    R2CCL_WARN(
        "%s was reopened after a fatal error: the dma-buf buffer at %p (%zu bytes) cannot be "
        "registered on it again (its descriptor is NCCL's); its chunks use the other paths",
        rt_->rail_name(hca).c_str(), m->data, m->size);
    return nullptr;
  }
  if (m->by_hca[hca]) m->cache_by_hca[hca]->release(m->by_hca[hca]);
  m->by_hca[hca] = nullptr;
  m->cache_by_hca[hca].reset();
  std::string err;
  uint32_t now_epoch = 0;
  std::shared_ptr<MrCache> c = rt_->mr_cache(hca, &now_epoch);
  void* mr = c->acquire(m->data, m->size, &err);
  if (!mr) {
    R2CCL_WARN(
        "regMr of %zu bytes at %p on %s (device reopened after a fatal error): %s; its "
        "chunks use the other paths",
        m->size, m->data, rt_->rail_name(hca).c_str(), err.c_str());
    // Tried again on the device's next incarnation, not at every use of this one.
    m->deferred_by_hca[hca] = true;
    m->epoch_by_hca[hca] = now_epoch;
    return nullptr;
  }
  m->by_hca[hca] = static_cast<ibv_mr*>(mr);
  m->cache_by_hca[hca] = std::move(c);
  m->epoch_by_hca[hca] = now_epoch;
  m->deferred_by_hca[hca] = false;
  return now_epoch == epoch ? m->by_hca[hca] : nullptr;
}

uint32_t Conn::gpu_paths(const void* data) {
  std::string gpu, why;
  int numa = -1;
  bool known = false;
  if (!rt_->env().hooks.gpu_pci.empty()) {
    char real[PATH_MAX];
    gpu = realpath(rt_->env().hooks.gpu_pci.c_str(), real) ? real : rt_->env().hooks.gpu_pci;
    numa = pci_numa_node(gpu);
    known = true;
  } else {
    known = gpu_pci_of(data, &gpu, &numa, &why);
  }
  uint32_t allowed = 1u;  // the primary: NCCL checked its GPUDirect distance itself
  std::string kept, dropped;
  for (const auto& p : paths_) {
    if (p.index == 0) continue;
    const HcaInfo& h = rt_->hcas()[p.hca];
    const int t = known ? gpu_nic_path_type(gpu, numa, h.pci_path, h.numa) : kPathSys;
    std::string& list = known && t <= rt_->gdr_level() ? kept : dropped;
    list += (list.empty() ? "" : ", ") + rail_of(p) + " (" + (known ? gdr_path_name(t) : "?") + ")";
    if (known && t <= rt_->gdr_level()) allowed |= 1u << p.index;
  }
  if (paths_.size() > 1 && !gdr_logged_.exchange(true)) {
    const std::string where = known ? "the GPU at " + gpu : "an unknown GPU (" + why + ")";
    if (allowed == 1u)
      R2CCL_WARN(
          "%s conn %016llx on dev %d: GPU buffers (%s) have no backup path: %s beyond %s; a "
          "failure of the primary %s fails their messages",
          role_ == Role::kSend ? "send" : "recv", static_cast<unsigned long long>(conn_id_), dev_,
          where.c_str(), dropped.c_str(), rt_->gdr_level_text().c_str(),
          rail_of(paths_[0]).c_str());
    else
      R2CCL_INFO(NCCL_NET | NCCL_INIT,
                 "%s conn %016llx on dev %d: GPU buffers (%s) use backups %s%s%s (within %s)",
                 role_ == Role::kSend ? "send" : "recv", static_cast<unsigned long long>(conn_id_),
                 dev_, where.c_str(), kept.c_str(),
                 dropped.empty() ? "" : "; excluded, beyond the level: ", dropped.c_str(),
                 rt_->gdr_level_text().c_str());
  }
  return allowed;
}

uint32_t Conn::allowed_paths(const void* mhandle) const {
  return mhandle ? static_cast<const IbMr*>(mhandle)->allowed : kAllPaths;
}

Status Conn::reg_mr(void* data, size_t size, int type, void** mhandle) {
  *mhandle = nullptr;
  auto* m = new IbMr();
  m->data = data;
  m->size = size;
  m->type = type;
  m->by_hca.assign(rt_->hcas().size(), nullptr);
  m->cache_by_hca.assign(rt_->hcas().size(), nullptr);
  m->epoch_by_hca.assign(rt_->hcas().size(), 0);
  m->deferred_by_hca.assign(rt_->hcas().size(), false);
  if (type != NCCL_PTR_HOST) m->allowed = gpu_paths(data);
  // The path set is fixed at setup and failback re-creates QPs on the same HCAs, so one
  // registration per HCA of the set stays valid for the connection's life (or until the
  // device is reopened after a fatal error: mr_on registers it again).
  std::string dead;  // HCAs whose registration waits for their device's reset
  bool any = false;
  for (const auto& p : paths_) {
    if (m->by_hca[p.hca] || m->deferred_by_hca[p.hca] || !((m->allowed >> p.index) & 1u)) continue;
    std::string err;
    std::shared_ptr<MrCache> c = rt_->mr_cache(p.hca, &m->epoch_by_hca[p.hca]);
    void* mr = c->acquire(data, size, &err);
    if (!mr && errno == EIO) {
      // The device had a fatal error and its reset is not done (mlx5 in internal-error state
      // fails every command but the destroy ones with EIO; the runtime may not have read
      // IBV_EVENT_DEVICE_FATAL yet). NCCL registers buffers at any time and a failed regMr
      // fails its communicator, for a rail the connection fails over from: the buffer is
      // registered on the other HCAs now, on this one once its QPs are on the reopened
      // device (mr_on). Until then the CTS excludes the path (post_cts).
      m->deferred_by_hca[p.hca] = true;
      dead += (dead.empty() ? "" : ", ") + rt_->rail_name(p.hca);
      continue;
    }
    if (!mr) {
      R2CCL_WARN("regMr of %zu bytes at %p on %s: %s", size, data, rt_->hcas()[p.hca].name.c_str(),
                 err.c_str());
      dereg_mr(m);
      return Status::kSystem;
    }
    m->by_hca[p.hca] = static_cast<ibv_mr*>(mr);
    m->cache_by_hca[p.hca] = std::move(c);
    any = true;
  }
  if (!dead.empty() && !any) {
    R2CCL_WARN(
        "regMr of %zu bytes at %p: every HCA that may carry it is dead (%s: a fatal error, "
        "reset not done)",
        size, data, dead.c_str());
    dereg_mr(m);
    return Status::kSystem;
  }
  if (!dead.empty())
    R2CCL_INFO(NCCL_NET,
               "regMr of %zu bytes at %p: not on %s (device dead after a fatal error) until the "
               "device is reopened; the other paths carry it meanwhile",
               size, data, dead.c_str());
  *mhandle = m;
  return Status::kOk;
}

Status Conn::reg_mr_dmabuf(void* data, size_t size, uint64_t offset, int fd, void** mhandle) {
  *mhandle = nullptr;
  if (!v_.reg_dmabuf_mr) {
    R2CCL_WARN("regMrDmaBuf: the verbs library has no ibv_reg_dmabuf_mr (rdma-core < 34)");
    return Status::kInternal;
  }
  auto* m = new IbMr();
  m->data = data;
  m->size = size;
  m->type = NCCL_PTR_DMABUF;
  m->cached = false;
  m->by_hca.assign(rt_->hcas().size(), nullptr);
  m->cache_by_hca.assign(rt_->hcas().size(), nullptr);
  m->epoch_by_hca.assign(rt_->hcas().size(), 0);
  m->deferred_by_hca.assign(rt_->hcas().size(), false);
  m->allowed = gpu_paths(data);
  for (const auto& p : paths_) {
    if (m->by_hca[p.hca] || !((m->allowed >> p.index) & 1u)) continue;
    const HcaInfo h = rt_->hca_snapshot(p.hca);
    m->epoch_by_hca[p.hca] = h.epoch;
    m->by_hca[p.hca] =
        v_.reg_dmabuf_mr(h.pd, offset, size, reinterpret_cast<uintptr_t>(data), fd,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    if (!m->by_hca[p.hca]) {
      R2CCL_WARN("ibv_reg_dmabuf_mr of %zu bytes (fd %d, offset %llu) on %s: %s", size, fd,
                 static_cast<unsigned long long>(offset), rt_->hcas()[p.hca].name.c_str(),
                 strerror(errno));
      dereg_mr(m);
      return Status::kSystem;
    }
  }
  *mhandle = m;
  return Status::kOk;
}

void Conn::dereg_mr(void* mhandle) {
  auto* m = static_cast<IbMr*>(mhandle);
  if (!m) return;
  for (size_t h = 0; h < m->by_hca.size(); ++h) {
    if (!m->by_hca[h]) continue;
    if (m->cached)
      m->cache_by_hca[h]->release(m->by_hca[h]);
    else
      v_.dereg_mr(m->by_hca[h]);
  }
  delete m;
}

// ------------------------------------------------------------------------------------------
// QPs

void Conn::fill_wire_hca(int hca, IbWireHca* w) {
  HcaInfo h = rt_->hca_snapshot(hca);
  memset(w, 0, sizeof(*w));
  w->link_layer = static_cast<uint8_t>(h.link_layer);
  w->port = static_cast<uint8_t>(h.port);
  w->mtu = static_cast<uint8_t>(h.active_mtu);
  w->gid_index = static_cast<uint8_t>(h.gid_index < 0 ? 0 : h.gid_index);
  w->lid = h.lid;
  w->flags = (h.port_flags & IBV_QPF_GRH_REQUIRED) ? kWireHcaGrhRequired : 0;
  memcpy(w->gid, h.gid, 16);
  w->area_rkey = area_mr_[hca] ? area_mr_[hca]->rkey : 0;
  w->epoch = static_cast<uint8_t>(h.epoch);  // the low 8 bits, as CtsRecord::epochs
  w->subnet_bits = static_cast<uint8_t>(rt_->subnet_bits(hca));
  w->gid_type = h.gid_type < 0 ? 0xff : static_cast<uint8_t>(h.gid_type);
}

PairEnd Conn::local_end(int hca) {
  const HcaInfo h = rt_->hca_snapshot(hca);
  PairEnd e;
  e.link_layer = h.link_layer;
  e.gid_type = h.gid_type;
  memcpy(e.gid, h.gid, 16);
  e.subnet_bits = rt_->subnet_bits(hca);
  return e;
}

void Conn::post_recv_slot(Path& p, int q, int k) {
  if (q < static_cast<int>(p.rq_reposted.size())) p.rq_reposted[q]++;
  const size_t slot = (static_cast<size_t>(p.index) * nqps_ + q) * kRqDepth + k;
  ibv_sge sge{reinterpret_cast<uintptr_t>(slots_ + slot * kCtrlSlot),
              static_cast<uint32_t>(kCtrlSlot), slots_mr_[p.hca]->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = kRecvWrFlag | (static_cast<uint64_t>(desc(p).generation) << 32) | slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  ibv_post_recv(p.qps[q], &wr, &bad);
}

Status Conn::create_path_qps(Path& p) {
  const HcaInfo h = rt_->hca_snapshot(p.hca);
  R2CCL_CHECK(refresh_area_mrs(h, p.hca));
  p.epoch = h.epoch;
  p.cq = v_.create_cq(h.ctx, nqps_ * (kSqDepth + kRqDepth), nullptr, nullptr, 0);
  if (!p.cq) {
    R2CCL_WARN("ibv_create_cq on %s: %s", h.name.c_str(), strerror(errno));
    return Status::kSystem;
  }
  for (int q = 0; q < nqps_; ++q) {
    ibv_qp* qp = make_qp(v_, h, p.cq, kSqDepth, kRqDepth,
                         IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE);
    if (!qp) return Status::kSystem;
    p.qps.push_back(qp);
    for (int k = 0; k < kRqDepth; ++k) post_recv_slot(p, q, k);
  }
  p.q_out.assign(p.qps.size(), 0);
  p.rq_consumed.assign(p.qps.size(), 0);
  p.rq_reposted.assign(p.qps.size(), 0);  // counted from here: the initial kRqDepth are given
  p.rq_published.assign(p.qps.size(), 0);
  p.credit_in_flight = false;
  p.stopped = false;
  return Status::kOk;
}

Status Conn::connect_path_qps(Path& p, const uint32_t* peer_qpn, const IbWireHca& peer) {
  const HcaInfo h = rt_->hca_snapshot(p.hca);
  p.peer = peer;
  for (int q = 0; q < nqps_; ++q)
    if (qp_to_rts(v_, p.qps[q], h, peer, peer_qpn[q], cfg_, tc_) != 0) return Status::kSystem;
  return Status::kOk;
}

void Conn::destroy_path_qps(Path& p) {
  if (p.cq) {
    // Whatever completed is no longer of interest; free the work-request records.
    ibv_wc wc[kPollBatch];
    for (int k = 0; k < 64; ++k)
      if (ibv_poll_cq(p.cq, kPollBatch, wc) <= 0) break;
  }
  for (size_t i = 0; i < wrs_.size(); ++i) {
    WrRec& w = wrs_[i];
    if (!w.used || w.path != p.index) continue;
    if (w.kind == kWrCtrl && w.ctrl_slot >= 0) ctrl_slot_busy_[w.ctrl_slot] = false;
    w = WrRec{};
    free_wrs_.push_back(static_cast<int>(i));
  }
  for (auto* qp : p.qps) v_.destroy_qp(qp);
  p.qps.clear();
  if (p.cq) v_.destroy_cq(p.cq);
  p.cq = nullptr;
  p.outstanding = 0;
  p.q_out.clear();
  p.rq_consumed.clear();
  p.rq_reposted.clear();
  p.rq_published.clear();
  p.credit_in_flight = false;
  p.stopped = true;
}

void Conn::qps_to_err(Path& p) {
  for (auto* qp : p.qps) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    v_.modify_qp(qp, &a, IBV_QP_STATE);
  }
}

bool Conn::ready(int path) const {
  const Path& p = paths_[path];
  return !p.qps.empty() && !p.stopped && !p.awaiting_peer;
}

// Free send-queue slots of QP q of the path; QP 0 keeps kSqReserve for CTS, probes and
// control messages, which only it carries.
int Conn::chunk_room(const Path& p, int q) const {
  if (q >= static_cast<int>(p.q_out.size())) return 0;
  return kSqDepth - (q == 0 ? kSqReserve : 0) - p.q_out[q];
}

// A QP of the path with room for one chunk's work requests (1, or 3 with adaptive routing:
// payload, size, immediate), starting at the round-robin position; -1 when every QP is full.
int Conn::chunk_qp(const Path& p) const {
  const int n = static_cast<int>(p.qps.size());
  const int need = ar_ ? 3 : 1;
  for (int k = 0; k < n; ++k) {
    const int q = static_cast<int>((p.rr + static_cast<uint32_t>(k)) % static_cast<uint32_t>(n));
    if (chunk_room(p, q) >= need && rq_credits(p, q) >= 1) return q;
  }
  return -1;
}

bool Conn::has_room(int path) const { return chunk_qp(paths_[path]) >= 0; }

// Two local ACK timeouts of the path's QPs (4.096 us x 2^R2CCL_IB_TIMEOUT each): a lost
// packet is sent again after one, so before two have passed the QP may still recover it.
TimeUs Conn::stall_floor(int path) const {
  (void)path;
  return 2 * ib_retry_timeout_us(static_cast<int>(cfg_.ib_timeout)) / cfg_.test_time_scale;
}

// Sender: receives still posted at the peer's QP q for our immediates and SENDs, by the
// counts the receiver last wrote (a count of an earlier generation of the path is none).
int Conn::rq_credits(const Path& p, int q) const {
  if (q >= static_cast<int>(p.rq_consumed.size())) return 0;
  const uint64_t v = __atomic_load_n(&area_->credit_in[p.index][q], __ATOMIC_ACQUIRE);
  const uint32_t reposted = static_cast<uint32_t>(v >> 32) == paths_desc_[p.index].generation
                                ? static_cast<uint32_t>(v)
                                : 0;
  return kRqDepth - static_cast<int>(p.rq_consumed[q] - reposted);
}

// Receiver: writes the repost counts of the path's QPs into the sender's credit_in when they
// moved, one write in flight at a time (its completion lets the next go).
void Conn::publish_credits(Path& p, PathSink& sink, TimeUs now) {
  if (role_ != Role::kRecv || p.credit_in_flight || p.stopped || p.awaiting_peer || p.qps.empty() ||
      p.rq_reposted == p.rq_published || qp0_room(p) <= 8)
    return;
  const uint64_t gen = static_cast<uint64_t>(desc(p).generation) << 32;
  for (size_t q = 0; q < p.rq_reposted.size(); ++q)
    area_->credit_out[p.index][q] = gen | p.rq_reposted[q];
  const uint32_t len = static_cast<uint32_t>(p.rq_reposted.size() * sizeof(uint64_t));
  const uint64_t raddr = peer_area_ + offsetof(IbArea, credit_in) +
                         static_cast<uint64_t>(p.index) * kMaxQpsPerPath * sizeof(uint64_t);
  const int wi =
      post_write(p, 0, kWrCredit, &area_->credit_out[p.index][0], len, area_mr_[p.hca]->lkey, raddr,
                 p.peer.area_rkey, false, 0, 0, 0, sink, now);
  if (wi < 0) return;  // full: the next poll tries again; an error failed the path
  p.credit_in_flight = true;
  p.rq_published = p.rq_reposted;
}

// Free slots of QP 0 (CTS, probes, control messages).
int Conn::qp0_room(const Path& p) const {
  return p.q_out.empty() || p.qps.empty() ? 0 : kSqDepth - p.q_out[0];
}

std::string Conn::rail_of(const Path& p) const { return rt_->rail_name(p.hca); }

// ------------------------------------------------------------------------------------------
// Side channel

bool Conn::sc_write(const void* buf, size_t len) {
  if (sc_fd_ < 0) return false;
  const char* b = static_cast<const char*>(buf);
  sc_out_.insert(sc_out_.end(), b, b + len);
  while (!sc_out_.empty()) {
    const ssize_t n = ::send(sc_fd_, sc_out_.data(), sc_out_.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sc_out_.erase(sc_out_.begin(), sc_out_.begin() + n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    return false;
  }
  return true;
}

int Conn::read_setup(IbSetupMsg* m, WireRefusal* refusal) {
  // A setup message, or a WireRefusal (shorter: its magic says so after 4 bytes), or an
  // older version's setup message (shorter: its version says so after 6 bytes).
  for (;;) {
    size_t want = looks_like_refusal(sc_in_, sc_got_) ? sizeof(WireRefusal) : sizeof(IbSetupMsg);
    if (want == sizeof(IbSetupMsg) && sc_got_ >= offsetof(IbSetupMsg, type)) {
      uint32_t magic;
      uint16_t version;
      memcpy(&magic, sc_in_ + offsetof(IbSetupMsg, magic), sizeof(magic));
      memcpy(&version, sc_in_ + offsetof(IbSetupMsg, version), sizeof(version));
      if (magic == kIbMsgMagic && version < kIbWireVersion) want = kIbSetupMsgSizeV6;
    }
    if (sc_got_ >= want) break;
    const ssize_t n = ::recv(sc_fd_, sc_in_ + sc_got_, want - sc_got_, MSG_DONTWAIT);
    if (n > 0) {
      sc_got_ += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    return -1;
  }
  const bool refused = looks_like_refusal(sc_in_, sc_got_);
  const size_t got = sc_got_;
  sc_got_ = 0;
  if (refused) return read_refusal(sc_in_, got, refusal) ? 2 : -1;
  *m = IbSetupMsg{};
  memcpy(m, sc_in_, std::min(got, sizeof(*m)));
  return 1;
}

// The peer is told why this end ends the setup, then the side channel closes (best effort:
// the refusal fits an empty socket buffer).
void Conn::refuse_peer(Refusal r, const std::string& text) {
  if (sc_fd_ < 0) return;
  const WireRefusal w = make_refusal(r, TransportKind::kIb, role_ == Role::kSend, nullptr,
                                     listen_id_, conn_id_, text);
  sc_write(&w, sizeof(w));
  ::close(sc_fd_);
  sc_fd_ = -1;
  sc_out_.clear();
  peer_told_ = true;
}

uint64_t Conn::link_key(int path) const {
  if (peer_proc_ == 0 || path < 0 || path >= static_cast<int>(paths_.size())) return 0;
  const Path& p = paths_[path];
  // Local HCA (the rail), the peer's port and GID (its HCA; a new GID after a flap is
  // another link, as a TCP peer's new address is), the peer process.
  char key[4 + 1 + sizeof(p.peer.gid) + sizeof(peer_proc_)];
  const int32_t local = p.hca;
  memcpy(key, &local, 4);
  key[4] = static_cast<char>(p.peer.port);
  memcpy(key + 5, p.peer.gid, sizeof(p.peer.gid));
  memcpy(key + 5 + sizeof(p.peer.gid), &peer_proc_, sizeof(peer_proc_));
  return link_key_of(key, sizeof(key));
}

std::string Conn::side_peer() const {
  if (role_ == Role::kSend) return wire_addr_string(handle_.listener);
  sockaddr_storage a;
  socklen_t l = sizeof(a);
  if (sc_fd_ >= 0 && getpeername(sc_fd_, reinterpret_cast<sockaddr*>(&a), &l) == 0)
    return addr_port_string(a);
  return "?";
}

// 1: `len` bytes are in buf; 0: not yet; -1: end-of-file or error.
int Conn::sc_read_exact(void* buf, size_t len, size_t* got) {
  while (*got < len) {
    const ssize_t n = ::recv(sc_fd_, static_cast<char*>(buf) + *got, len - *got, MSG_DONTWAIT);
    if (n > 0) {
      *got += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    return -1;
  }
  return 1;
}

// ------------------------------------------------------------------------------------------
// Setup

IbSetupMsg Conn::setup_msg(SetupType t) const {
  IbSetupMsg m{};
  m.magic = kIbMsgMagic;
  m.version = kIbWireVersion;
  m.type = static_cast<uint16_t>(t);
  memcpy(m.secret, secret_, 16);
  m.conn_id = conn_id_;
  m.proc_id = rt_->process_id();
  return m;
}

bool Conn::is_setup(const IbSetupMsg& m, SetupType t, const uint8_t* secret) const {
  return m.magic == kIbMsgMagic && m.version == kIbWireVersion &&
         m.type == static_cast<uint16_t>(t) && secrets_equal(m.secret, secret, 16);
}

Status Conn::setup_step(bool* done, TimeUs now) {
  if (setup_start_ == 0) setup_start_ = now;
  const Status st = role_ == Role::kSend ? connect_step(done, now) : accept_step(done, now);
  // Once both ends are engaged (HELLO sent / a valid HELLO taken), a failure here must not
  // leave the peer waiting R2CCL_CONNECT_TIMEOUT: it is told (its setup fails at once too).
  if (st != Status::kOk && engaged_ && !peer_told_)
    refuse_peer(Refusal::kAborted, std::string("setup aborted: the ") +
                                       (role_ == Role::kSend ? "connecting" : "listening") +
                                       " process could not finish its half of the setup (" +
                                       status_name(st) + "; its log says why)");
  return st;
}

Status Conn::fail_connect(const std::string& why, Status st) {
  R2CCL_WARN("connect on device %d (side channel %s -> %s) failed: %s; not retried", dev_,
             rt_->side_rail().name.c_str(), side_peer().c_str(), why.c_str());
  return st;
}

// A side-channel connect that did not get through: permanent causes fail, refusals fail once
// they have lasted kRefusedGrace, others are retried from a fresh socket with backoff
// (sock/sock_errors.h).
Status Conn::connect_failed(int err, SockOp op, const std::string& text, TimeUs now) {
  if (sc_fd_ >= 0) ::close(sc_fd_);
  sc_fd_ = -1;
  stage_ = 0;
  const ErrClass cls = classify_errno(err, op);
  if (cls == ErrClass::kPermanent) return fail_connect(text, Status::kSystem);
  if (cls == ErrClass::kBounded) {
    if (refused_since_ == 0) refused_since_ = now;
    if (now - refused_since_ >= kRefusedGrace) {
      char t[128];
      snprintf(t, sizeof(t), " for %.1f s", (now - refused_since_) / 1e6);
      return fail_connect("nothing listens there (" + text + t +
                              "): the listen comm was closed or its process exited",
                          Status::kRemote);
    }
  } else {
    refused_since_ = 0;
  }
  backoff_ = std::min<TimeUs>(backoff_ == 0 ? 10 * kUsPerMs : backoff_ * 2, kUsPerSec);
  retry_at_ = now + backoff_;
  return Status::kOk;
}

Status Conn::connect_step(bool* done, TimeUs now) {
  *done = false;
  if (now - setup_start_ > cfg_.connect_timeout) {
    R2CCL_WARN(
        "connect: no answer from the peer's side channel within R2CCL_CONNECT_TIMEOUT "
        "(%.0f s)",
        cfg_.connect_timeout / 1e6);
    return Status::kRemote;
  }
  if (stage_ == 0) {
    if (now < retry_at_) return Status::kOk;
    memcpy(secret_, handle_.secret, 16);
    listen_id_ = handle_.listen_id;
    if (conn_id_ == 0) conn_id_ = rt_->random_u64();
    SockFailure why;
    sc_fd_ = open_rail_socket(rt_->side_rail(), cfg_.tcp_user_timeout, &why);
    if (sc_fd_ < 0) return connect_failed(why.err, why.op, why.text, now);
    sockaddr_storage peer{};
    if (handle_.listener.family == AF_INET) {
      auto* s = reinterpret_cast<sockaddr_in*>(&peer);
      s->sin_family = AF_INET;
      s->sin_port = handle_.listener.port;
      memcpy(&s->sin_addr, handle_.listener.addr, 4);
    } else {
      auto* s = reinterpret_cast<sockaddr_in6*>(&peer);
      s->sin6_family = AF_INET6;
      s->sin6_port = handle_.listener.port;
      memcpy(&s->sin6_addr, handle_.listener.addr, 16);
    }
    const int e = start_connect(sc_fd_, peer);
    if (e != 0)
      return connect_failed(-e, SockOp::kConnect, describe_errno(-e, SockOp::kConnect), now);
    stage_ = 1;
  }
  if (stage_ == 1) {
    const int e = finish_connect(sc_fd_);
    if (e == -EINPROGRESS) return Status::kOk;
    if (e != 0)
      return connect_failed(-e, SockOp::kConnect, describe_errno(-e, SockOp::kConnect), now);
    refused_since_ = 0;
    candidates_ = rt_->path_set(rt_->device_rail(dev_));
    IbSetupMsg m = setup_msg(SetupType::kHello);
    m.listen_id = listen_id_;
    m.chunk_size = static_cast<uint64_t>(cfg_.chunk_size);
    m.area_addr = reinterpret_cast<uintptr_t>(area_);
    m.qps_per_path = static_cast<uint32_t>(nqps_);
    m.knobs = rt_->knobs(nqps_, ar_);
    m.npaths = static_cast<uint32_t>(std::min<size_t>(candidates_.size(), kMaxIbPaths));
    for (uint32_t i = 0; i < m.npaths; ++i) {
      R2CCL_CHECK(register_area_on(candidates_[i]));
      fill_wire_hca(candidates_[i], &m.hca[i]);
    }
    chunk_size_ = m.chunk_size;
    if (!sc_write(&m, sizeof(m))) return Status::kRemote;
    engaged_ = true;
    stage_ = 2;
  }
  if (!sc_write(nullptr, 0)) return Status::kRemote;
  if (stage_ == 2) {
    IbSetupMsg m;
    WireRefusal refusal;
    const int r = read_setup(&m, &refusal);
    if (r == 0) return Status::kOk;
    if (r == 2) {
      peer_told_ = true;  // the peer ended it: nothing to tell back
      return fail_connect(std::string("refused by the peer: ") + refusal.text,
                          refusal_status(static_cast<Refusal>(refusal.reason)));
    }
    std::string bad;
    if (r < 0 || !is_setup(m, SetupType::kReply, secret_) || m.npaths == 0 ||
        m.npaths > kMaxIbPaths || !knobs_valid(m.knobs, kMaxQpsPerPath, &bad)) {
      R2CCL_WARN("connect: the peer's setup reply is missing or invalid (%s)",
                 r < 0         ? "side channel closed"
                 : bad.empty() ? "bad magic, version, secret or path count"
                               : bad.c_str());
      return Status::kRemote;
    }
    peer_proc_ = m.proc_id;
    // Both ends' knobs (transport/handshake.h); the acceptor chose the same from them.
    const Negotiated n = negotiate(rt_->knobs(nqps_, ar_), m.knobs);
    if (m.qps_per_path != static_cast<uint32_t>(n.streams) || m.chunk_size != n.chunk_size) {
      R2CCL_WARN(
          "connect: the peer's setup reply uses %u QPs per path and %llu-byte chunks; the "
          "negotiated values are %d and %llu",
          m.qps_per_path, static_cast<unsigned long long>(m.chunk_size), n.streams,
          static_cast<unsigned long long>(n.chunk_size));
      return Status::kRemote;
    }
    nqps_ = n.streams;
    chunk_size_ = n.chunk_size;
    peer_area_ = m.area_addr;
    slots_len_ = static_cast<size_t>(m.npaths) * nqps_ * kRqDepth * kCtrlSlot;
    slots_ = static_cast<char*>(aligned_alloc(4096, page_round(slots_len_)));
    for (uint32_t i = 0; i < m.npaths; ++i) {
      if (m.hca[i].pair >= candidates_.size()) {
        R2CCL_WARN("connect: the peer paired path %u with candidate %u of %zu", i, m.hca[i].pair,
                   candidates_.size());
        return Status::kRemote;
      }
      Path p;
      p.index = static_cast<int>(i);
      p.hca = candidates_[m.hca[i].pair];
      paths_.push_back(std::move(p));
      paths_desc_.push_back(PathDesc{paths_.back().hca, "", true, 0});
    }
    for (auto& p : paths_) {
      R2CCL_CHECK(register_slots_on(p.hca));
      R2CCL_CHECK(create_path_qps(p));
      R2CCL_CHECK(connect_path_qps(p, m.qpn[p.index], m.hca[p.index]));
    }
    IbSetupMsg ready = setup_msg(SetupType::kReady);
    ready.npaths = m.npaths;
    ready.qps_per_path = static_cast<uint32_t>(nqps_);
    for (auto& p : paths_)
      for (int q = 0; q < nqps_; ++q) ready.qpn[p.index][q] = p.qps[q]->qp_num;
    if (!sc_write(&ready, sizeof(ready))) return Status::kRemote;
    stage_ = 3;
  }
  if (stage_ == 3) {
    IbSetupMsg m;
    WireRefusal refusal;
    const int r = read_setup(&m, &refusal);
    if (r == 0) return Status::kOk;
    if (r == 2) {
      peer_told_ = true;
      return fail_connect(std::string("refused by the peer: ") + refusal.text,
                          refusal_status(static_cast<Refusal>(refusal.reason)));
    }
    if (r < 0 || !is_setup(m, SetupType::kDone, secret_)) {
      R2CCL_WARN("connect: the peer did not confirm the connection");
      return Status::kRemote;
    }
    finish_setup();
    *done = true;
  }
  return Status::kOk;
}

// A side-channel connection that is not this listen comm's peer: told why when it speaks our
// protocol, closed, and the listen comm waits for the next one.
void Conn::refuse_stranger(Refusal r, const std::string& text) {
  R2CCL_WARN("accept on device %d: refused a side-channel connection from %s: %s", dev_,
             side_peer().c_str(), text.c_str());
  if (r != Refusal::kAborted) {
    refuse_peer(r, text);
  } else if (sc_fd_ >= 0) {
    ::close(sc_fd_);
    sc_fd_ = -1;
  }
  sc_out_.clear();
  peer_told_ = false;
  stage_ = 0;
}

Status Conn::accept_step(bool* done, TimeUs now) {
  *done = false;
  Listen* l = listen_;
  if (stage_ == 0) {
    if (l->fd < 0) return Status::kSystem;
    // Out of descriptors: the connection waits in the accept queue; accept() does not spin
    // on it (sock/sock_errors.h).
    if (l->gate.paused(now)) return Status::kOk;
    const int fd = ::accept4(l->fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (!l->gate.on_error(
              err, "the side channel of a listen comm on device " + std::to_string(dev_), now) ||
          !l->gate.starved(now))
        return Status::kOk;
      // This process holds its own descriptors: the connector is refused with the cause
      // (through the spare descriptor) and this accept fails, both within about 2 s.
      const std::string text = "the listening process (device " + std::to_string(dev_) +
                               ") cannot accept: " + l->gate.starved_text(now) +
                               "; raise its descriptor limit (ulimit -n)";
      if (err == EMFILE || err == ENFILE) {
        const WireRefusal w = make_refusal(Refusal::kNoResources, TransportKind::kIb, false,
                                           nullptr, l->listen_id, 0, text);
        (void)refuse_with_spare(l->fd, &w, sizeof(w));
      }
      R2CCL_WARN("accept on device %d failed: %s", dev_, text.c_str());
      return Status::kSystem;
    }
    l->gate.on_accepted(now);
    set_socket_options(fd, cfg_.tcp_user_timeout);
    sc_fd_ = fd;
    sc_got_ = 0;
    setup_start_ = now;
    stage_ = 1;
  }
  if (stage_ > 0 && now - setup_start_ > cfg_.connect_timeout) {
    R2CCL_WARN("accept: the connecting peer did not finish the setup within R2CCL_CONNECT_TIMEOUT");
    return Status::kRemote;
  }
  if (!sc_write(nullptr, 0)) return Status::kRemote;
  if (stage_ == 1) {
    IbSetupMsg m;
    WireRefusal refusal;
    const int r = read_setup(&m, &refusal);
    if (r == 0) return Status::kOk;
    if (r == 2) {
      // A connector that cannot use our handle (the other transport, another wire version)
      // says why: with our secret, this listen comm's accept fails (now and from now on).
      if (refusal.listen_id == l->listen_id && secrets_equal(refusal.secret, l->secret, 16)) {
        const Status st = refusal_status(static_cast<Refusal>(refusal.reason));
        l->refuse(st, refusal.text);
        peer_told_ = true;
        return st;
      }
      refuse_stranger(Refusal::kAborted, "a refusal without this listen comm's id and secret");
      return Status::kOk;
    }
    if (r < 0) {
      refuse_stranger(Refusal::kAborted, "closed before its hello");
      return Status::kOk;
    }
    std::string bad;
    if (m.magic != kIbMsgMagic || m.type != static_cast<uint16_t>(SetupType::kHello)) {
      refuse_stranger(Refusal::kAborted, "not an r2ccl verbs hello");
      return Status::kOk;
    }
    if (m.version != kIbWireVersion) {
      refuse_stranger(Refusal::kVersion,
                      version_mismatch_text(static_cast<uint8_t>(TransportKind::kIb), m.version,
                                            kIbWireVersion));
      return Status::kOk;
    }
    if (!secrets_equal(m.secret, l->secret, 16)) {
      refuse_stranger(Refusal::kWrongSecret,
                      "wrong secret (the handle is not this listen comm's, or it is corrupted)");
      return Status::kOk;
    }
    if (m.listen_id != l->listen_id) {
      refuse_stranger(Refusal::kUnknownListen, "no such listen comm (a stale handle)");
      return Status::kOk;
    }
    if (m.npaths == 0 || m.npaths > kMaxIbPaths || !knobs_valid(m.knobs, kMaxQpsPerPath, &bad) ||
        m.chunk_size != m.knobs.chunk_size) {
      refuse_stranger(
          Refusal::kMalformed,
          "malformed hello: " + (bad.empty() ? std::to_string(m.npaths) + " candidate HCAs" : bad));
      return Status::kOk;
    }
    engaged_ = true;  // our peer: from here on a failure is told to it
    listen_id_ = l->listen_id;
    // Both ends' knobs (transport/handshake.h): the smaller chunk size and QP count, the
    // sender's adaptive-routing write mode.
    const WireKnobs own = rt_->knobs(nqps_, ar_);
    const Negotiated n = negotiate(m.knobs, own);
    nqps_ = n.streams;
    ar_ = n.adaptive_routing;
    memcpy(secret_, l->secret, 16);
    conn_id_ = m.conn_id;
    peer_proc_ = m.proc_id;
    chunk_size_ = n.chunk_size;
    peer_area_ = m.area_addr;
    // Pair paths (engine/path_plan.h): our primary with theirs (same link layer); each of
    // our backups with an unused candidate of theirs by pair_score (transport/ib/pairing.h):
    // the same subnet under both ends' real prefixes first (a rail-aligned fabric routes
    // rail k only to rail k), then other subnets of the link layer (routed), else the next
    // one in their order.
    const std::vector<int> mine = rt_->path_set(rt_->device_rail(dev_));
    const int npeer = static_cast<int>(m.npaths);
    std::vector<PairEnd> mine_end;
    for (int hca : mine) mine_end.push_back(local_end(hca));
    std::vector<RailPair> pairs =
        pair_rails(static_cast<int>(mine.size()), npeer, false, [&](int i, int j) {
          if ((i == 0) != (j == 0)) return 0;
          if (i == 0) return m.hca[j].link_layer == mine_end[i].link_layer ? 1 : 0;
          return pair_score(mine_end[i], wire_end(m.hca[j]));
        });
    if (pairs.empty() || pairs[0].local != 0) {
      // Both ends must agree (docs/ARCHITECTURE.md): refused at both, one message.
      const HcaInfo& h = rt_->hcas()[mine[0]];
      const std::string text = std::string(
                                   "link layer mismatch: the connecting process's "
                                   "primary HCA port is ") +
                               ll_name(m.hca[0].link_layer) + ", the listening process's (" +
                               h.name + ") is " + ll_name(h.link_layer) +
                               "; both ends of a connection need the same link layer";
      R2CCL_WARN("accept on device %d: %s", dev_, text.c_str());
      refuse_peer(Refusal::kMismatch, text);
      return refusal_status(Refusal::kMismatch);
    }
    IbSetupMsg reply = setup_msg(SetupType::kReply);
    for (const auto& pr : pairs) {
      if (paths_.size() >= m.npaths) break;
      Path p;
      p.index = static_cast<int>(paths_.size());
      p.hca = mine[pr.local];
      p.peer = m.hca[pr.peer];
      reply.hca[p.index].pair = static_cast<uint16_t>(pr.peer);
      paths_.push_back(std::move(p));
      paths_desc_.push_back(PathDesc{paths_.back().hca, "", true, 0});
    }
    slots_len_ = paths_.size() * nqps_ * kRqDepth * kCtrlSlot;
    slots_ = static_cast<char*>(aligned_alloc(4096, page_round(slots_len_)));
    for (auto& p : paths_) {
      R2CCL_CHECK(register_area_on(p.hca));
      R2CCL_CHECK(register_slots_on(p.hca));
      R2CCL_CHECK(create_path_qps(p));
      const uint16_t pair = reply.hca[p.index].pair;
      fill_wire_hca(p.hca, &reply.hca[p.index]);
      reply.hca[p.index].pair = pair;
      for (int q = 0; q < nqps_; ++q) reply.qpn[p.index][q] = p.qps[q]->qp_num;
    }
    reply.npaths = static_cast<uint32_t>(paths_.size());
    reply.qps_per_path = static_cast<uint32_t>(nqps_);
    reply.knobs = own;
    reply.area_addr = reinterpret_cast<uintptr_t>(area_);
    reply.chunk_size = chunk_size_;
    if (!sc_write(&reply, sizeof(reply))) return Status::kRemote;
    stage_ = 2;
  }
  if (stage_ == 2) {
    IbSetupMsg m;
    WireRefusal refusal;
    const int r = read_setup(&m, &refusal);
    if (r == 0) return Status::kOk;
    if (r == 2) {
      peer_told_ = true;
      R2CCL_WARN("accept on device %d: the connecting peer ended the setup: %s", dev_,
                 refusal.text);
      return refusal_status(static_cast<Refusal>(refusal.reason));
    }
    if (r < 0 || !is_setup(m, SetupType::kReady, secret_) || m.npaths != paths_.size()) {
      R2CCL_WARN("accept: the peer's READY is missing or invalid");
      return Status::kRemote;
    }
    for (auto& p : paths_) R2CCL_CHECK(connect_path_qps(p, m.qpn[p.index], p.peer));
    IbSetupMsg d = setup_msg(SetupType::kDone);
    if (!sc_write(&d, sizeof(d))) return Status::kRemote;
    finish_setup();
    *done = true;
  }
  return Status::kOk;
}

void Conn::finish_setup() {
  sockaddr_storage sa;
  socklen_t sl = sizeof(sa);
  if (sc_fd_ >= 0 && getpeername(sc_fd_, reinterpret_cast<sockaddr*>(&sa), &sl) == 0)
    sc_peer_ = addr_to_string(sa);
  std::string list;
  for (auto& p : paths_) {
    char peer[64];
    snprintf(peer, sizeof(peer), "%s",
             p.peer.link_layer == IBV_LINK_LAYER_ETHERNET
                 ? gid_to_string(p.peer.gid).c_str()
                 : ("lid " + std::to_string(p.peer.lid)).c_str());
    desc(p).label = rail_of(p) + " -> " + peer;
    list += (list.empty() ? "" : ", ") + desc(p).label;
  }
  // A backup paired across subnets works only where the fabric routes (RoCE v2, IB
  // routers): said once per connection, per path.
  for (const auto& p : paths_) {
    if (p.index == 0) continue;
    const PairEnd a = local_end(p.hca), b = wire_end(p.peer);
    if (pair_score(a, b) != kPairRouted || a.subnet_bits == 0 || b.subnet_bits == 0) continue;
    R2CCL_INFO(NCCL_NET | NCCL_INIT,
               "%s connection on dev %d: backup path %d (%s) crosses subnets (%s here, %s at "
               "the peer): usable where the fabric routes between them (RoCE v2, IB routers), "
               "preferred last",
               role_ == Role::kSend ? "send" : "recv", dev_, p.index, desc(p).label.c_str(),
               subnet_text(a).c_str(), subnet_text(b).c_str());
  }
  stage_ = 10;
  listen_ = nullptr;
  R2CCL_INFO(NCCL_NET | NCCL_INIT,
             "%s connection on dev %d: %zu paths (%s), %d QPs per path, chunk %llu KiB%s",
             role_ == Role::kSend ? "send" : "recv", dev_, paths_.size(), list.c_str(), nqps_,
             static_cast<unsigned long long>(chunk_size_ / 1024),
             ar_ ? ", adaptive-routing writes" : "");
}

// ------------------------------------------------------------------------------------------
// Posting

int Conn::alloc_wr() {
  if (free_wrs_.empty()) {
    wrs_.emplace_back();
    return static_cast<int>(wrs_.size() - 1);
  }
  const int i = free_wrs_.back();
  free_wrs_.pop_back();
  return i;
}

int Conn::submit(Path& p, int q, const WrRec& rec, ibv_send_wr* wr, PathSink& sink, TimeUs now) {
  const int wi = alloc_wr();
  wrs_[wi] = rec;
  WrRec& w = wrs_[wi];
  w.path = static_cast<int8_t>(p.index);
  w.qp = static_cast<uint8_t>(q);
  w.used = true;
  w.gen = desc(p).generation;
  wr->wr_id = static_cast<uint64_t>(wi);
  wr->send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  const int e = ibv_post_send(p.qps[q], wr, &bad);
  if (e != 0) {
    w = WrRec{};
    free_wrs_.push_back(wi);
    // ENOMEM: the send queue is full (its slots wait for completions to be polled): try
    // again later. The slot counts make this rare; it is never a dead path.
    if (e == ENOMEM) return kSqFull;
    char d[64];
    snprintf(d, sizeof(d), "ibv_post_send: %s", strerror(e));
    sink.on_path_error(p.index, FailCause::kRetryExceeded, d, now);
    return -1;
  }
  p.outstanding++;
  p.q_out[q]++;
  return wi;
}

int Conn::post_write(Path& p, int q, uint8_t kind, const void* local, uint32_t len, uint32_t lkey,
                     uint64_t raddr, uint32_t rkey, bool imm, uint32_t immv, uint64_t seq,
                     uint32_t idx, PathSink& sink, TimeUs now) {
  WrRec rec;
  rec.kind = kind;
  rec.seq = seq;
  rec.idx = idx;
  ibv_sge sge{reinterpret_cast<uintptr_t>(local), len, lkey};
  ibv_send_wr wr{};
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  wr.opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  if (imm) wr.imm_data = htonl(immv);
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return submit(p, q, rec, &wr, sink, now);
}

PostResult Conn::post_chunk(int path, const ChunkOut& c, PathSink& sink, TimeUs now) {
  Path& p = paths_[path];
  const int q = chunk_qp(p);
  if (q < 0) return PostResult::kFull;
  // The buffer's rkey on this path died with the peer HCA's old incarnation (its device was
  // reopened after a fatal error since the CTS): its chunks go on the other paths.
  auto rkey_alive = [&](const Path& x) {
    return ((c.remote->rkey_epochs >> (4 * x.index)) & 0xfu) == (x.peer.epoch & 0xfu);
  };
  if (!rkey_alive(p)) {
    for (const Path& o : paths_)
      if (o.index != p.index && ready(o.index) && rkey_alive(o) &&
          ((c.remote->allowed >> o.index) & 1u))
        return PostResult::kNotHere;
    // No other path can take it now: rather than wait for ever, this message fails.
    sink.on_fatal(Status::kRemote,
                  "the receiver's HCA of the only usable path was reset (device-fatal error) "
                  "while this message was in flight, and its buffer's rkey died with it",
                  now);
    return PostResult::kFailed;
  }
  p.rr = static_cast<uint32_t>(q) + 1;
  const ibv_mr* lmr = mr_on(static_cast<const IbMr*>(c.mhandle), p.hca, p.epoch);
  if (c.mhandle && c.len > 0 && !lmr) {
    sink.on_path_error(p.index, FailCause::kSetup,
                       "the buffer is not registered on this HCA (its device had a fatal error)",
                       now);
    return PostResult::kFailed;
  }
  const uint32_t lkey = lmr ? lmr->lkey : 0;
  const uint64_t raddr = c.remote->addr + c.offset;
  const uint32_t rkey = c.remote->rkey[p.index];
  const uint32_t immv = imm_encode(c.seq, c.last, c.idx);
  int wi = 0;
  int parts = 0;  // work requests of this chunk posted
  if (ar_) {
    // Adaptive routing may reorder a write's packets: payload first, then (last chunk) the
    // message size, then a 0-byte write with immediate; RC completes them in order.
    if (c.len > 0) {
      wi = post_write(p, q, kWrDataPart, c.src, c.len, lkey, raddr, rkey, false, 0, c.seq, c.idx,
                      sink, now);
      parts += wi >= 0;
    }
    const int slot = static_cast<int>(c.seq % kFifoDepth);
    if (wi >= 0 && c.last) {
      area_->sizes[slot] = c.total;
      wi = post_write(p, q, kWrDataPart, &area_->sizes[slot], 8, area_mr_[p.hca]->lkey,
                      peer_area_ + offsetof(IbArea, sizes) + slot * 8, p.peer.area_rkey, false, 0,
                      c.seq, c.idx, sink, now);
      parts += wi >= 0;
    }
    if (wi >= 0)
      wi = post_write(p, q, kWrData, nullptr, 0, 0, raddr, rkey, true, immv, c.seq, c.idx, sink,
                      now);
  } else {
    wi = post_write(p, q, kWrData, c.src, c.len, lkey, raddr, rkey, true, immv, c.seq, c.idx, sink,
                    now);
  }
  if (wi >= 0) p.rq_consumed[q]++;  // its immediate takes a receive at the peer
  if (wi == kSqFull && parts == 0) return PostResult::kFull;  // nothing of it went out
  if (wi == kSqFull) {
    // Part of the chunk is posted and the rest cannot be: the slot count was wrong.
    sink.on_path_error(p.index, FailCause::kRetryExceeded,
                       "ibv_post_send: ENOMEM in the middle of a chunk (the send queue held more "
                       "than its slot count)",
                       now);
    return PostResult::kFailed;
  }
  return wi < 0 ? PostResult::kFailed : PostResult::kPosted;
}

PostResult Conn::post_cts(int path, const CtsOut& c, PathSink& sink, TimeUs now) {
  Path& p = paths_[path];
  if (qp0_room(p) <= 8) return PostResult::kFull;
  const int slot = static_cast<int>(c.seq % kFifoDepth);
  CtsRecord& r = area_->cts_out[slot];
  const auto* mr = static_cast<const IbMr*>(c.mhandle);
  r.addr = reinterpret_cast<uintptr_t>(c.buf);
  r.size = c.capacity;
  r.epochs = 0;
  r.excluded = 0;
  for (size_t i = 0; i < paths_.size(); ++i) {
    const bool allowed = !mr || ((mr->allowed >> i) & 1u);
    const ibv_mr* m = allowed ? mr_on(mr, paths_[i].hca, paths_[i].epoch) : nullptr;
    r.rkey[i] = m ? m->rkey : 0;
    r.epochs = static_cast<uint16_t>(r.epochs | ((paths_[i].epoch & 0xfu) << (4 * i)));
    // No MR for the path's QPs (deferred while its device is dead, or made again after a
    // reopen and failed): the sender must not write there with rkey 0, a remote access
    // error that ends the connection.
    if (!allowed || (mr && !m)) r.excluded = static_cast<uint16_t>(r.excluded | (1u << i));
  }
  r.tag = c.tag;
  r.seq1 = c.seq + 1;
  const int wi = post_write(p, 0, kWrCts, &r, sizeof(r), area_mr_[p.hca]->lkey,
                            peer_area_ + offsetof(IbArea, fifo) + slot * sizeof(CtsRecord),
                            p.peer.area_rkey, false, 0, c.seq, 0, sink, now);
  if (wi == kSqFull) return PostResult::kFull;
  return wi < 0 ? PostResult::kFailed : PostResult::kPosted;
}

IbCtrlMsg Conn::wire_msg(WireCtrl t, int path, uint32_t gen) const {
  IbCtrlMsg m{};
  m.magic = kIbMsgMagic;
  m.type = static_cast<uint16_t>(t);
  m.path = static_cast<uint16_t>(path);
  m.gen = gen;
  return m;
}

PostResult Conn::post_ctrl(int path, const CtrlMsg& c, PathSink& sink, TimeUs now) {
  IbCtrlMsg m{};
  switch (c.type) {
    case CtrlType::kAck:
      m = wire_msg(WireCtrl::kAckState, 0, 0);
      m.a = c.seq;
      m.b = c.prefix | (static_cast<uint64_t>(c.base) << 32);
      m.c = c.bitmap;
      break;
    case CtrlType::kFail:
    case CtrlType::kFailAck:
      m = wire_msg(c.type == CtrlType::kFail ? WireCtrl::kFail : WireCtrl::kFailAck, c.path, c.gen);
      m.id = c.id;
      break;
    case CtrlType::kDrain:
      m = wire_msg(WireCtrl::kDrain, c.path, c.gen);
      m.a = c.on ? 1 : 0;
      break;
    case CtrlType::kTruncated:
      m = wire_msg(WireCtrl::kTruncated, 0, 0);
      m.a = c.seq;
      m.b = c.size;
      break;
    case CtrlType::kAddr:
    case CtrlType::kAddrAck:
      // Never sent: verbs has no PathCaps::address_notices (a GID change rides on REBUILD).
      return PostResult::kPosted;
  }
  if (path < 0) {
    // No RDMA path is usable: the side channel carries control messages.
    return sc_fd_ >= 0 && sc_write(&m, sizeof(m)) ? PostResult::kPosted : PostResult::kFull;
  }
  return send_on(paths_[path], m, sink, now);
}

// An RDMA SEND of `m` on QP 0 of the path (control stays in order), from a slot of the
// connection area.
PostResult Conn::send_on(Path& p, const IbCtrlMsg& m, PathSink& sink, TimeUs now) {
  if (qp0_room(p) <= 4) return PostResult::kFull;
  if (role_ == Role::kSend && rq_credits(p, 0) < 1) return PostResult::kFull;
  int slot = -1;
  for (int i = 0; i < kFifoDepth && slot < 0; ++i)
    if (!ctrl_slot_busy_[i]) slot = i;
  if (slot < 0) return PostResult::kFull;
  area_->ctrl_out[slot] = m;
  WrRec rec;
  rec.kind = kWrCtrl;
  rec.ctrl_slot = slot;
  ibv_sge sge{reinterpret_cast<uintptr_t>(&area_->ctrl_out[slot]), sizeof(IbCtrlMsg),
              area_mr_[p.hca]->lkey};
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  const int wi = submit(p, 0, rec, &wr, sink, now);
  if (wi == kSqFull) return PostResult::kFull;
  if (wi < 0) return PostResult::kFailed;
  if (role_ == Role::kSend) p.rq_consumed[0]++;
  ctrl_slot_busy_[slot] = true;
  return PostResult::kPosted;
}

bool Conn::send_wire(const IbCtrlMsg& m, PathSink& sink, TimeUs now) {
  const int cp = sink.control_path();
  if (cp >= 0 && send_on(paths_[cp], m, sink, now) == PostResult::kPosted) return true;
  return sc_fd_ >= 0 && sc_write(&m, sizeof(m));
}

bool Conn::probe(int path, PathSink& sink, TimeUs now) {
  Path& p = paths_[path];
  if (qp0_room(p) <= 2) return false;
  const uint64_t raddr = peer_area_ + offsetof(IbArea, scratch);
  return post_write(p, 0, kWrProbe, nullptr, 0, 0, raddr, p.peer.area_rkey, false, 0, 0, 0, sink,
                    now) >= 0;
}

void Conn::flush(PathSink& sink, TimeUs now) {
  (void)sink;
  (void)now;
  sc_write(nullptr, 0);  // what the side channel could not take yet
}

// ------------------------------------------------------------------------------------------
// Completions

void Conn::poll_path(Path& p, PathSink& sink, TimeUs now) {
  if (!p.cq) return;
  ibv_wc wc[kPollBatch];
  for (int round = 0; round < 8; ++round) {
    const int n = ibv_poll_cq(p.cq, kPollBatch, wc);
    if (n <= 0) return;
    for (int i = 0; i < n; ++i) {
      if (wc[i].wr_id & kRecvWrFlag)
        on_recv_wc(p, wc[i], sink, now);
      else
        on_send_wc(p, wc[i], sink, now);
      if (!p.cq) return;  // destroyed by a rebuild triggered from a control message
    }
    if (n < kPollBatch) return;
  }
}

void Conn::on_send_wc(Path& p, const ibv_wc& wc, PathSink& sink, TimeUs now) {
  if (wc.wr_id >= wrs_.size() || !wrs_[wc.wr_id].used) return;
  const WrRec w = wrs_[wc.wr_id];
  wrs_[wc.wr_id] = WrRec{};
  free_wrs_.push_back(static_cast<int>(wc.wr_id));
  if (w.kind == kWrCtrl && w.ctrl_slot >= 0) ctrl_slot_busy_[w.ctrl_slot] = false;
  if (w.gen != desc(p).generation || w.path != p.index)
    return;  // an earlier generation of the path
  p.outstanding--;
  if (w.qp < p.q_out.size()) p.q_out[w.qp]--;
  if (w.kind == kWrCredit) p.credit_in_flight = false;
  if (wc.status == IBV_WC_SUCCESS) {
    sink.on_path_alive(p.index, now);
    switch (w.kind) {
      case kWrData: sink.on_chunk_acked(p.index, w.seq, w.idx, now); break;
      case kWrCts: sink.on_cts_delivered(w.seq, now); break;
      case kWrProbe: sink.on_probe_ok(p.index, now, 0); break;
      default: break;
    }
    return;
  }
  if (recoverable(wc.status)) {
    sink.on_path_error(p.index, FailCause::kRetryExceeded, v_.wc_status_str(wc.status), now);
    return;
  }
  char why[160];
  snprintf(why, sizeof(why),
           "work completion %s (vendor error 0x%x) on path %s: fatal, not failed over",
           v_.wc_status_str(wc.status), wc.vendor_err, desc(p).label.c_str());
  sink.on_fatal(fatal_status(wc.status), why, now);
}

void Conn::on_recv_wc(Path& p, const ibv_wc& wc, PathSink& sink, TimeUs now) {
  const uint32_t gen = static_cast<uint32_t>((wc.wr_id >> 32) & 0x7fffffffu);
  const size_t slot = wc.wr_id & 0xffffffffu;
  if (gen != desc(p).generation || slot * kCtrlSlot >= slots_len_) return;
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR && !p.stopped)
      sink.on_path_error(p.index, FailCause::kRetryExceeded, v_.wc_status_str(wc.status), now);
    return;
  }
  const int per_path = nqps_ * kRqDepth;
  const int q = static_cast<int>((slot % per_path) / kRqDepth);
  const int k = static_cast<int>(slot % kRqDepth);
  const bool repost = !p.qps.empty() && q < static_cast<int>(p.qps.size());
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    if (repost) post_recv_slot(p, q, k);
    if (landed_on_.empty()) landed_on_.assign(rt_->hcas().size(), false);
    landed_on_[p.hca] = true;    // the next iflush reads through this HCA
    peer_rebuilt(p, sink, now);  // a chunk on this generation: the sender's QPs are connected
    const uint32_t imm = ntohl(wc.imm_data);
    const uint32_t idx = imm_idx(imm);
    const bool last = imm_last(imm);
    uint32_t len = wc.byte_len;
    if (ar_) {
      // The payload came as a plain write: its length is the chunk size, the last one's is
      // known from the message size the sender wrote first.
      if (last) {
        const uint64_t total = area_->sizes[imm_seq7(imm) % kFifoDepth];
        const uint64_t off = static_cast<uint64_t>(idx) * chunk_size_;
        len = total >= off ? static_cast<uint32_t>(std::min<uint64_t>(total - off, UINT32_MAX))
                           : UINT32_MAX;
      } else {
        len = static_cast<uint32_t>(chunk_size_);
      }
    }
    sink.on_chunk_placed(p.index, imm_seq7(imm), kImmSeqBits, idx, len, last, now);
    return;
  }
  if (wc.opcode == IBV_WC_RECV) {
    IbCtrlMsg m;
    memcpy(&m, slots_ + slot * kCtrlSlot, sizeof(m));
    if (repost) post_recv_slot(p, q, k);
    if (wc.byte_len >= sizeof(m) && m.magic == kIbMsgMagic) {
      sink.on_path_alive(p.index, now);
      on_wire_ctrl(p.index, m, sink, now);
      return;
    }
    R2CCL_WARN("path %s: malformed control message (%u bytes) ignored", desc(p).label.c_str(),
               wc.byte_len);
    return;
  }
  if (repost) post_recv_slot(p, q, k);
}

// ------------------------------------------------------------------------------------------
// Control messages

void Conn::on_wire_ctrl(int via, const IbCtrlMsg& m, PathSink& sink, TimeUs now) {
  const WireCtrl t = static_cast<WireCtrl>(m.type);
  CtrlMsg c;
  switch (t) {
    case WireCtrl::kBye:
      bye_seen_ = true;
      sink.on_peer_bye(now);
      return;
    case WireCtrl::kAckState:
      c.type = CtrlType::kAck;
      c.seq = m.a;
      if (m.b == UINT64_MAX) {  // the whole message (r2ccl before wire version 2)
        c.prefix = UINT32_MAX;
      } else {
        c.prefix = static_cast<uint32_t>(m.b);
        c.base = static_cast<uint32_t>(m.b >> 32);
      }
      c.bitmap = m.c;
      sink.on_ctrl(via, c, now);
      return;
    case WireCtrl::kTruncated:
      c.type = CtrlType::kTruncated;
      c.seq = m.a;
      c.size = m.b;
      sink.on_ctrl(via, c, now);
      return;
    case WireCtrl::kFail:
    case WireCtrl::kFailAck:
    case WireCtrl::kDrain:
      c.type = t == WireCtrl::kFail      ? CtrlType::kFail
               : t == WireCtrl::kFailAck ? CtrlType::kFailAck
                                         : CtrlType::kDrain;
      c.path = m.path;
      c.gen = m.gen;
      c.id = m.id;
      c.on = m.a != 0;
      sink.on_ctrl(via, c, now);
      return;
    default: break;
  }
  if (m.path >= paths_.size()) {
    R2CCL_WARN("control message for path %u of %zu ignored", m.path, paths_.size());
    return;
  }
  switch (t) {
    case WireCtrl::kRebuild:
      if (role_ == Role::kRecv) on_rebuild(m, sink, now);
      break;
    case WireCtrl::kRebuildDone:
      if (role_ == Role::kRecv && m.gen == paths_desc_[m.path].generation)
        peer_rebuilt(paths_[m.path], sink, now);
      break;
    case WireCtrl::kRebuildAck:
    case WireCtrl::kRebuildNak:
      if (role_ == Role::kSend) on_rebuild_ack(m, sink, now);
      break;
    default: R2CCL_WARN("unknown control message type %u ignored", m.type);
  }
}

void Conn::read_side_channel(PathSink& sink, TimeUs now) {
  if (sc_fd_ < 0) return;
  for (;;) {
    const int r = sc_read_exact(sc_in_, sizeof(IbCtrlMsg), &sc_got_);
    if (r == 0) return;
    if (r < 0) {
      ::close(sc_fd_);
      sc_fd_ = -1;
      if (!bye_seen_) sink.on_peer_gone("its side channel closed without BYE", now);
      return;
    }
    sc_got_ = 0;
    IbCtrlMsg m;
    memcpy(&m, sc_in_, sizeof(m));
    if (m.magic != kIbMsgMagic) {
      R2CCL_WARN("side channel: malformed control message ignored");
      continue;
    }
    on_wire_ctrl(-1, m, sink, now);
  }
}

// Sender: new CTS records in the FIFO, in sequence order.
void Conn::poll_fifo(PathSink& sink, TimeUs now) {
  for (int k = 0; k < kFifoDepth; ++k) {
    const int slot = static_cast<int>(next_cts_seq_ % kFifoDepth);
    volatile CtsRecord* c = &area_->fifo[slot];
    if (c->seq1 != next_cts_seq_ + 1) return;
    std::atomic_thread_fence(std::memory_order_acquire);
    CtsRecord r;
    memcpy(&r, const_cast<CtsRecord*>(&area_->fifo[slot]), sizeof(r));
    RemoteBuffer rb;
    rb.addr = r.addr;
    for (int i = 0; i < kMaxIbPaths && i < kMaxPathsPerConn; ++i) rb.rkey[i] = r.rkey[i];
    rb.rkey_epochs = r.epochs;
    rb.allowed = ~static_cast<uint32_t>(r.excluded);
    sink.on_cts(next_cts_seq_, r.size, rb, now);
    next_cts_seq_++;
  }
}

void Conn::check_qp_events(PathSink& sink, TimeUs now) {
  bool lost = false;
  const std::vector<Runtime::QpEvent> evs = rt_->qp_events_after(qp_events_seen_, &lost);
  for (const auto& e : evs) qp_events_seen_ = std::max(qp_events_seen_, e.seq);
  for (auto& p : paths_) {
    if (p.stopped || p.qps.empty()) continue;
    std::string why;
    for (const auto& e : evs) {
      if (e.ctx != p.cq->context) continue;
      if (e.cq == p.cq) why = "its CQ reported an error (IBV_EVENT_CQ_ERR)";
      for (size_t q = 0; q < p.qps.size() && why.empty(); ++q)
        if (e.cq == nullptr && p.qps[q]->qp_num == e.qp_num)
          why = "QP " + std::to_string(e.qp_num) + ": async event " + v_.event_type_str(e.type);
    }
    if (lost && why.empty())  // behind the ring: look at the QPs themselves
      for (auto* qp : p.qps)
        if (qp->state == IBV_QPS_ERR) why = "QP " + std::to_string(qp->qp_num) + " is in ERR";
    if (!why.empty()) sink.on_path_error(p.index, FailCause::kAsyncError, why.c_str(), now);
  }
  for (size_t h = 0; h < flushq_.size(); ++h) {
    const FlushQp& f = flushq_[h];
    if (!f.qp) continue;
    for (const auto& e : evs)
      if (e.ctx == f.qp->context &&
          ((e.cq && e.cq == f.cq) || (!e.cq && e.qp_num == f.qp->qp_num))) {
        drop_flush_qp(static_cast<int>(h));
        break;
      }
  }
}

void Conn::poll(PathSink& sink, TimeUs now) {
  if (stage_ != 10) return;
  if (rt_->qp_event_seq() != qp_events_seen_) check_qp_events(sink, now);
  read_side_channel(sink, now);
  for (auto& p : paths_) {
    poll_path(p, sink, now);
    publish_credits(p, sink, now);
  }
  if (role_ == Role::kSend) poll_fifo(sink, now);
  for (auto& p : paths_) {
    if (!p.rebuilding || now <= p.rebuild_deadline) continue;
    p.rebuilding = false;
    destroy_path_qps(p);
    sink.on_reconnect_failed(p.index, false, "no answer to the rebuild request", now);
  }
}

// ------------------------------------------------------------------------------------------
// Failure, failback

void Conn::stop_path(int path, bool from_peer, TimeUs now) {
  (void)now;
  Path& p = paths_[path];
  p.stopped = true;
  // Our QPs of the path go to ERR: nothing more is sent or lands, every posted WR flushes.
  // (Test hook no_bilateral_err: the receiver leaves them in RTS when the sender says so.)
  if (rt_->env().hooks.bilateral_err || !(from_peer && role_ == Role::kRecv)) qps_to_err(p);
}

void Conn::quiesce(int path, PathSink& sink, TimeUs now) {
  // Every chunk that landed on the path before its QPs entered ERR has its completion in
  // the CQ already, ahead of its QP's flushes (a QP's completions are in order): all of them
  // are read before the landed state is reported, however many there are (16 QPs x 128
  // receives flush 2048). Finite: after ERR only flushes come, and a flushed receive is not
  // posted again.
  Path& p = paths_[path];
  ibv_wc wc[kPollBatch];
  for (int guard = 0; p.cq && guard < (1 << 16); ++guard) {
    const int n = ibv_poll_cq(p.cq, kPollBatch, wc);
    if (n <= 0) break;
    for (int i = 0; i < n && p.cq; ++i) {
      if (wc[i].wr_id & kRecvWrFlag)
        on_recv_wc(p, wc[i], sink, now);
      else
        on_send_wc(p, wc[i], sink, now);
    }
  }
}

bool Conn::can_reconnect(int path, PathSink& sink) const {
  (void)path;
  return role_ == Role::kSend && !paths_[path].rebuilding &&
         (sink.control_path() >= 0 || sc_fd_ >= 0);
}

void Conn::reconnect(int path, PathSink& sink, TimeUs now) {
  Path& p = paths_[path];
  destroy_path_qps(p);
  desc(p).generation++;
  if (create_path_qps(p) != Status::kOk) {
    destroy_path_qps(p);
    sink.on_reconnect_failed(p.index, false, "could not create the QPs", now);
    return;
  }
  p.stopped = true;  // not in service until the peer connected its QPs
  IbCtrlMsg m = wire_msg(WireCtrl::kRebuild, p.index, desc(p).generation);
  m.n = static_cast<uint32_t>(nqps_);
  for (int q = 0; q < nqps_; ++q) m.qpn[q] = p.qps[q]->qp_num;
  fill_wire_hca(p.hca, &m.hca);
  p.rebuilding = true;
  p.rebuild_deadline = now + std::max<TimeUs>(4 * cfg_.heartbeat_interval, 500 * kUsPerMs);
  if (!send_wire(m, sink, now)) {
    p.rebuilding = false;
    destroy_path_qps(p);
    sink.on_reconnect_failed(p.index, false, "no channel to the peer for the rebuild request", now);
  }
}

void Conn::on_rebuild(const IbCtrlMsg& m, PathSink& sink, TimeUs now) {
  Path& p = paths_[m.path];
  IbCtrlMsg out = wire_msg(WireCtrl::kRebuildNak, m.path, m.gen);
  if (!rt_->live(p.hca).link_up.load() || m.n != static_cast<uint32_t>(nqps_)) {
    send_wire(out, sink, now);
    return;
  }
  if (!p.stopped) sink.on_path_error(p.index, FailCause::kPeerNotice, "the peer rebuilds it", now);
  destroy_path_qps(p);
  desc(p).generation = m.gen;
  if (create_path_qps(p) != Status::kOk || connect_path_qps(p, m.qpn, m.hca) != Status::kOk) {
    destroy_path_qps(p);
    send_wire(out, sink, now);
    return;
  }
  // Nothing is posted on the new QPs until the sender has connected its own (its probes
  // passed, REBUILD_DONE): a write to a sender QP still in INIT would be lost and fail the
  // path again. Receives are posted, so the sender's chunks land meanwhile.
  p.awaiting_peer = true;
  out.type = static_cast<uint16_t>(WireCtrl::kRebuildAck);
  out.n = static_cast<uint32_t>(nqps_);
  for (int q = 0; q < nqps_; ++q) out.qpn[q] = p.qps[q]->qp_num;
  fill_wire_hca(p.hca, &out.hca);
  send_wire(out, sink, now);
}

void Conn::peer_rebuilt(Path& p, PathSink& sink, TimeUs now) {
  if (!p.awaiting_peer) return;
  p.awaiting_peer = false;
  sink.on_reconnected(p.index, now);
}

void Conn::on_rebuild_ack(const IbCtrlMsg& m, PathSink& sink, TimeUs now) {
  Path& p = paths_[m.path];
  if (!p.rebuilding || m.gen != desc(p).generation) return;
  p.rebuilding = false;
  if (static_cast<WireCtrl>(m.type) == WireCtrl::kRebuildNak ||
      m.n != static_cast<uint32_t>(nqps_) || connect_path_qps(p, m.qpn, m.hca) != Status::kOk) {
    destroy_path_qps(p);
    sink.on_reconnect_failed(p.index, false, "the peer could not rebuild the path", now);
    return;
  }
  p.stopped = false;
  sink.on_reconnected(p.index, now);
}

void Conn::path_recovered(int path, PathSink& sink, TimeUs now) {
  // The receiver may post on the path again: the sender's QPs are connected and passed.
  send_wire(wire_msg(WireCtrl::kRebuildDone, path, paths_desc_[path].generation), sink, now);
}

void Conn::say_goodbye(TimeUs now) {
  (void)now;
  if (sc_fd_ < 0 || stage_ != 10) return;
  IbCtrlMsg m = wire_msg(WireCtrl::kBye, 0, 0);
  ::send(sc_fd_, &m, sizeof(m), MSG_NOSIGNAL | MSG_DONTWAIT);
}

void Conn::abort(TimeUs now) {
  (void)now;
  for (auto& p : paths_) {
    qps_to_err(p);
    p.stopped = true;
  }
}

// ------------------------------------------------------------------------------------------
// iflush

Status Conn::make_flush_qp(int hca) {
  const HcaInfo h = rt_->hca_snapshot(hca);
  R2CCL_CHECK(refresh_area_mrs(h, hca));
  FlushQp& f = flushq_[hca];
  f.epoch = h.epoch;
  f.cq = v_.create_cq(h.ctx, 64, nullptr, nullptr, 0);
  if (!f.cq) return Status::kSystem;
  f.qp = make_qp(v_, h, f.cq, 32, 1, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE);
  if (!f.qp) return Status::kSystem;
  IbWireHca self;
  fill_wire_hca(hca, &self);
  if (qp_to_rts(v_, f.qp, h, self, f.qp->qp_num, cfg_, 0) != 0) return Status::kSystem;
  return Status::kOk;
}

void Conn::drop_flush_qp(int hca) {
  FlushQp& f = flushq_[hca];
  if (f.qp) v_.destroy_qp(f.qp);
  if (f.cq) v_.destroy_cq(f.cq);
  f = FlushQp{};
}

// One 1-byte READ of `addr` through `hca`'s loopback QP (made first if needed); false, with a
// WARN naming the HCA, when the QP cannot be made or the READ not posted.
bool Conn::post_flush_read(int hca, uint64_t token, uintptr_t addr, uint32_t rkey) {
  if (flushq_.empty()) flushq_.assign(rt_->hcas().size(), FlushQp{});
  if (!flushq_[hca].qp && make_flush_qp(hca) != Status::kOk) {
    R2CCL_WARN("iflush: cannot set up the loopback flush QP on %s: %s", rt_->rail_name(hca).c_str(),
               strerror(errno));
    drop_flush_qp(hca);
    return false;
  }
  ibv_sge sge{reinterpret_cast<uintptr_t>(&area_->scratch[0]), 1, area_mr_[hca]->lkey};
  ibv_send_wr wr{};
  wr.wr_id = token;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = addr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  const int e = ibv_post_send(flushq_[hca].qp, &wr, &bad);
  if (e != 0) {
    R2CCL_WARN("iflush: ibv_post_send of the flush read on %s: %s", rt_->rail_name(hca).c_str(),
               strerror(e));
    drop_flush_qp(hca);
    return false;
  }
  return true;
}

Status Conn::start_flush(int n, void** data, const int* sizes, void** mhandles, uint64_t* token) {
  *token = 0;
  int last = -1;
  for (int i = 0; i < n; ++i) {
    const auto* mr = mhandles ? static_cast<const IbMr*>(mhandles[i]) : nullptr;
    if (sizes[i] > 0 && mr && (mr->type != NCCL_PTR_HOST || rt_->env().hooks.force_flush)) last = i;
  }
  if (last < 0) return Status::kOk;  // host memory: nothing to flush
  const auto* mr = static_cast<const IbMr*>(mhandles[last]);
  const size_t nhcas = rt_->hcas().size();
  if (landed_on_.empty()) landed_on_.assign(nhcas, false);
  FlushRec rec;
  rec.token = next_flush_++;
  rec.addr = reinterpret_cast<uintptr_t>(data[last]);
  rec.rkey.assign(nhcas, 0);
  rec.tries.assign(nhcas, 0);
  auto flush_mr = [&](int h) -> const ibv_mr* {
    if (!mr->by_hca[h]) return nullptr;
    const uint32_t ep = rt_->hca_epoch(h);
    if (flushq_.size() > static_cast<size_t>(h) && flushq_[h].qp && flushq_[h].epoch != ep)
      drop_flush_qp(h);  // made on a dead incarnation of the device
    return mr_on(mr, h, ep);
  };
  for (size_t h = 0; h < nhcas; ++h) {
    if (!landed_on_[h]) continue;
    const ibv_mr* m = flush_mr(static_cast<int>(h));
    if (!m) continue;
    rec.rkey[h] = m->rkey;
    rec.pending.push_back(static_cast<int>(h));
  }
  // Nothing landed through an HCA since the last flush (the data came before it, or on the
  // side channel): one READ through the primary HCA still orders what is in flight there.
  if (rec.pending.empty()) {
    if (const ibv_mr* m = flush_mr(paths_[0].hca)) {
      rec.rkey[paths_[0].hca] = m->rkey;
      rec.pending.push_back(paths_[0].hca);
    }
  }
  for (int h : rec.pending) {
    ++rec.tries[h];
    if (!post_flush_read(h, rec.token, rec.addr, rec.rkey[h])) return Status::kSystem;
    landed_on_[h] = false;
  }
  *token = rec.token;
  flushes_.push_back(std::move(rec));
  return Status::kOk;
}

// Completes the flush `token` once a READ through each of its HCAs has. A READ that fails
// (the HCA's port went down, its loopback QP broke) is posted again on a new loopback QP, at
// most 3 times per HCA; after that only this flush fails (ncclSystemError), naming the HCA.
int Conn::test_flush(uint64_t token, Status* err) {
  constexpr int kFlushTries = 3;
  *err = Status::kOk;
  for (size_t h = 0; h < flushq_.size(); ++h) {
    ibv_wc wc[8];
    const int n = flushq_[h].cq ? ibv_poll_cq(flushq_[h].cq, 8, wc) : 0;
    bool broken = false;
    for (int i = 0; i < n; ++i) {
      auto rec = std::find_if(flushes_.begin(), flushes_.end(),
                              [&](const FlushRec& r) { return r.token == wc[i].wr_id; });
      if (rec == flushes_.end()) continue;
      auto it = std::find(rec->pending.begin(), rec->pending.end(), static_cast<int>(h));
      if (it == rec->pending.end()) continue;
      if (wc[i].status == IBV_WC_SUCCESS) {
        rec->pending.erase(it);
        continue;
      }
      broken = true;
      if (rec->tries[h] >= kFlushTries) {
        R2CCL_WARN("iflush: the flush read through %s completed with %s %d times",
                   rt_->rail_name(static_cast<int>(h)).c_str(), v_.wc_status_str(wc[i].status),
                   rec->tries[h]);
        rec->failed = true;
      }
    }
    if (!broken) continue;
    drop_flush_qp(static_cast<int>(h));  // in ERR: every later READ on it would flush too
    for (auto& rec : flushes_) {
      const bool waits = std::find(rec.pending.begin(), rec.pending.end(), static_cast<int>(h)) !=
                         rec.pending.end();
      if (!waits || rec.failed) continue;
      ++rec.tries[h];
      if (!post_flush_read(static_cast<int>(h), rec.token, rec.addr, rec.rkey[h]))
        rec.failed = true;
    }
  }
  auto rec = std::find_if(flushes_.begin(), flushes_.end(),
                          [&](const FlushRec& r) { return r.token == token; });
  if (rec == flushes_.end()) {
    *err = Status::kInternal;
    return -1;
  }
  if (rec->failed) {
    flushes_.erase(rec);
    *err = Status::kSystem;
    return -1;
  }
  if (!rec->pending.empty()) return 0;
  flushes_.erase(rec);
  return 1;
}

}  // namespace r2ccl::net::ib
