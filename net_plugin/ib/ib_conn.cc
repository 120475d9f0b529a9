#include "ib/ib_conn.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "r2ccl/log.h"
#include "sock/socket_util.h"

namespace r2ccl::net::ib {
namespace {

constexpr int kSqDepth = 256;     // send WRs per QP
constexpr int kRqDepth = 128;     // posted receives per QP (control SENDs and chunk immediates)
constexpr int kSqReserve = 24;    // send WRs per QP kept for CTS, probes and control messages
constexpr int kPollBatch = 32;
constexpr uint64_t kRecvWrFlag = 1ull << 63;

enum WrKind : uint8_t { kWrData = 1, kWrDataPart, kWrCts, kWrProbe, kWrCtrl };

bool recoverable(ibv_wc_status s) {
  return s == IBV_WC_RETRY_EXC_ERR || s == IBV_WC_RNR_RETRY_EXC_ERR || s == IBV_WC_WR_FLUSH_ERR;
}

Status fatal_status(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_REM_ABORT_ERR:
    case IBV_WC_REM_INV_RD_REQ_ERR:
      return Status::kRemote;
    default:
      return Status::kInternal;
  }
}

const char* ll_name(int ll) { return ll == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB"; }

bool same_ipv4_24(const uint8_t* a, const uint8_t* b) {
  static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(a, mapped, 12) == 0 && memcmp(b, mapped, 12) == 0 && memcmp(a + 12, b + 12, 3) == 0;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Listen comm

IbListen::IbListen(IbRuntime* r, int d) : rt(r), dev(d) {
  rt->random_bytes(secret, sizeof(secret));
  listen_id = rt->random_u64();
  std::string err;
  fd = open_rail_listener(rt->side_rail(), &err);
  if (fd < 0) R2CCL_WARN("listen: side-channel listener on %s: %s", rt->side_rail().name.c_str(), err.c_str());
}

IbListen::~IbListen() {
  if (fd >= 0) ::close(fd);
}

// ------------------------------------------------------------------------------------------
// Construction, teardown, memory

IbConn::IbConn(IbRuntime* rt, IbRole role, int dev, int traffic_class)
    : rt_(rt), cfg_(rt->cfg()), v_(rt->v()), role_(role), dev_(dev) {
  tc_ = traffic_class != NCCL_NET_TRAFFIC_CLASS_UNDEF ? traffic_class : static_cast<int>(cfg_.ib_tc);
  nqps_ = static_cast<int>(cfg_.ib_qps_per_path);
  const int primary = rt_->devices()[dev];
  ar_ = cfg_.ib_ar < 0 ? rt_->hcas()[primary].link_layer == IBV_LINK_LAYER_INFINIBAND : cfg_.ib_ar == 1;
  const size_t area_len = (sizeof(IbArea) + 4095) & ~size_t(4095);
  area_ = static_cast<IbArea*>(aligned_alloc(4096, area_len));
  memset(area_, 0, area_len);
  area_mr_.assign(rt_->hcas().size(), nullptr);
  slots_mr_.assign(rt_->hcas().size(), nullptr);
  ctrl_slot_busy_.assign(kFifoDepth, false);
  for (auto& r : reqs_) r.conn = this;
  setup_start_ = now_us();
}

IbConn::~IbConn() {
  for (auto& p : paths_) destroy_path_qps(p);
  if (flush_qp_) v_.destroy_qp(flush_qp_);
  if (flush_cq_) v_.destroy_cq(flush_cq_);
  for (auto* mr : area_mr_)
    if (mr) v_.dereg_mr(mr);
  for (auto* mr : slots_mr_)
    if (mr) v_.dereg_mr(mr);
  free(area_);
  free(slots_);
  if (sc_fd_ >= 0) ::close(sc_fd_);
  for (auto& p : paths_)
    if (p.counted_failed) rt_->live(p.hca).failed_paths--;
}

Status IbConn::register_area_on(int hca) {
  if (area_mr_[hca]) return Status::kOk;
  const size_t len = (sizeof(IbArea) + 4095) & ~size_t(4095);
  area_mr_[hca] = v_.reg_mr(rt_->hcas()[hca].pd, area_, len,
                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!area_mr_[hca]) {
    R2CCL_WARN("ibv_reg_mr of the connection area on %s: %s", rt_->hcas()[hca].name.c_str(),
               strerror(errno));
    return Status::kSystem;
  }
  return Status::kOk;
}

Status IbConn::reg_mr(void* data, size_t size, int type, IbMr** out) {
  *out = nullptr;
  auto* m = new IbMr();
  m->data = data;
  m->size = size;
  m->type = type;
  m->by_hca.assign(rt_->hcas().size(), nullptr);
  // The path set is fixed at setup and failback re-creates QPs on the same HCAs, so one
  // registration per HCA of the set stays valid for the connection's life.
  for (const auto& p : paths_) {
    if (m->by_hca[p.hca]) continue;
    std::string err;
    void* mr = rt_->mr_cache(p.hca).acquire(data, size, &err);
    if (!mr) {
      R2CCL_WARN("regMr of %zu bytes at %p on %s: %s", size, data, rt_->hcas()[p.hca].name.c_str(),
                 err.c_str());
      dereg_mr(m);
      return Status::kSystem;
    }
    m->by_hca[p.hca] = static_cast<ibv_mr*>(mr);
  }
  *out = m;
  return Status::kOk;
}

Status IbConn::reg_mr_dmabuf(void* data, size_t size, uint64_t offset, int fd, IbMr** out) {
  *out = nullptr;
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
  for (const auto& p : paths_) {
    if (m->by_hca[p.hca]) continue;
    m->by_hca[p.hca] = v_.reg_dmabuf_mr(rt_->hcas()[p.hca].pd, offset, size,
                                        reinterpret_cast<uintptr_t>(data), fd,
                                        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                            IBV_ACCESS_REMOTE_READ);
    if (!m->by_hca[p.hca]) {
      R2CCL_WARN("ibv_reg_dmabuf_mr of %zu bytes (fd %d, offset %llu) on %s: %s", size, fd,
                 static_cast<unsigned long long>(offset), rt_->hcas()[p.hca].name.c_str(),
                 strerror(errno));
      dereg_mr(m);
      return Status::kSystem;
    }
  }
  *out = m;
  return Status::kOk;
}

void IbConn::dereg_mr(IbMr* m) {
  if (!m) return;
  for (size_t h = 0; h < m->by_hca.size(); ++h) {
    if (!m->by_hca[h]) continue;
    if (m->cached) rt_->mr_cache(static_cast<int>(h)).release(m->by_hca[h]);
    else v_.dereg_mr(m->by_hca[h]);
  }
  delete m;
}

// ------------------------------------------------------------------------------------------
// QPs

void IbConn::fill_wire_hca(int hca, IbWireHca* w) {
  HcaInfo h = rt_->hca_snapshot(hca);
  memset(w, 0, sizeof(*w));
  w->link_layer = static_cast<uint8_t>(h.link_layer);
  w->port = static_cast<uint8_t>(h.port);
  w->mtu = static_cast<uint8_t>(h.active_mtu);
  w->gid_index = static_cast<uint8_t>(h.gid_index < 0 ? 0 : h.gid_index);
  w->lid = h.lid;
  memcpy(w->gid, h.gid, 16);
  w->area_rkey = area_mr_[hca] ? area_mr_[hca]->rkey : 0;
}

void IbConn::post_recv_slot(Path& p, int q, int k) {
  const size_t slot = (static_cast<size_t>(p.index) * nqps_ + q) * kRqDepth + k;
  ibv_sge sge{reinterpret_cast<uintptr_t>(slots_ + slot * kCtrlSlot), static_cast<uint32_t>(kCtrlSlot),
              slots_mr_[p.hca]->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = kRecvWrFlag | (static_cast<uint64_t>(p.gen) << 32) | slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  ibv_post_recv(p.qps[q], &wr, &bad);
}

Status IbConn::create_path_qps(Path& p) {
  const HcaInfo& h = rt_->hcas()[p.hca];
  p.cq = v_.create_cq(h.ctx, nqps_ * (kSqDepth + kRqDepth), nullptr, nullptr, 0);
  if (!p.cq) {
    R2CCL_WARN("ibv_create_cq on %s: %s", h.name.c_str(), strerror(errno));
    return Status::kSystem;
  }
  for (int q = 0; q < nqps_; ++q) {
    ibv_qp_init_attr ia{};
    ia.send_cq = p.cq;
    ia.recv_cq = p.cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = kSqDepth;
    ia.cap.max_recv_wr = kRqDepth;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ibv_qp* qp = v_.create_qp(h.pd, &ia);
    if (!qp) {
      R2CCL_WARN("ibv_create_qp on %s: %s", h.name.c_str(), strerror(errno));
      return Status::kSystem;
    }
    p.qps.push_back(qp);
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<uint8_t>(h.port);
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
    int e = v_.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (e != 0) {
      R2CCL_WARN("QP %u on %s to INIT: %s", qp->qp_num, h.name.c_str(), strerror(e));
      return Status::kSystem;
    }
    for (int k = 0; k < kRqDepth; ++k) post_recv_slot(p, q, k);
  }
  return Status::kOk;
}

Status IbConn::connect_path_qps(Path& p, const uint32_t* peer_qpn, const IbWireHca& peer) {
  HcaInfo h = rt_->hca_snapshot(p.hca);
  p.peer = peer;
  p.peer_qpn.assign(peer_qpn, peer_qpn + nqps_);
  for (int q = 0; q < nqps_; ++q) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = static_cast<ibv_mtu>(std::min<int>(h.active_mtu ? h.active_mtu : static_cast<int>(IBV_MTU_1024),
                                                    peer.mtu ? peer.mtu : static_cast<int>(IBV_MTU_1024)));
    a.dest_qp_num = peer_qpn[q];
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = static_cast<uint8_t>(h.port);
    a.ah_attr.sl = static_cast<uint8_t>(cfg_.ib_sl);
    if (h.link_layer == IBV_LINK_LAYER_ETHERNET) {
      a.ah_attr.is_global = 1;
      memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(h.gid_index);
      a.ah_attr.grh.hop_limit = 255;
      a.ah_attr.grh.traffic_class = static_cast<uint8_t>(tc_);
    } else {
      a.ah_attr.dlid = peer.lid;
    }
    int e = v_.modify_qp(p.qps[q], &a,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                             IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (e != 0) {
      R2CCL_WARN("QP %u on %s to RTR: %s", p.qps[q]->qp_num, h.name.c_str(), strerror(e));
      return Status::kSystem;
    }
    ibv_qp_attr b{};
    b.qp_state = IBV_QPS_RTS;
    b.timeout = static_cast<uint8_t>(cfg_.ib_timeout);
    b.retry_cnt = static_cast<uint8_t>(cfg_.ib_retry_cnt);
    b.rnr_retry = 7;
    b.sq_psn = 0;
    b.max_rd_atomic = 1;
    e = v_.modify_qp(p.qps[q], &b,
                     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                         IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (e != 0) {
      R2CCL_WARN("QP %u on %s to RTS: %s", p.qps[q]->qp_num, h.name.c_str(), strerror(e));
      return Status::kSystem;
    }
  }
  return Status::kOk;
}

void IbConn::destroy_path_qps(Path& p) {
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
    if (w.kind == kWrCts && w.req && w.req->used && w.req->seq == w.seq && !w.req->cts_acked)
      w.req->cts_path = -1;
    w = WrRec{};
    free_wrs_.push_back(static_cast<int>(i));
  }
  for (auto* qp : p.qps) v_.destroy_qp(qp);
  p.qps.clear();
  if (p.cq) v_.destroy_cq(p.cq);
  p.cq = nullptr;
  p.outstanding = 0;
  p.inflight_bytes = 0;
  p.probe_out = false;
}

// ------------------------------------------------------------------------------------------
// Side channel

bool IbConn::sc_write(const void* buf, size_t len) {
  if (sc_fd_ < 0) return false;
  const char* b = static_cast<const char*>(buf);
  sc_out_.insert(sc_out_.end(), b, b + len);
  while (!sc_out_.empty()) {
    ssize_t n = ::send(sc_fd_, sc_out_.data(), sc_out_.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sc_out_.erase(sc_out_.begin(), sc_out_.begin() + n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    return false;
  }
  return true;
}

int IbConn::read_setup(IbSetupMsg* m) {
  const int r = sc_read_exact(sc_in_, sizeof(IbSetupMsg), &sc_got_);
  if (r > 0) {
    memcpy(m, sc_in_, sizeof(*m));
    sc_got_ = 0;
  }
  return r;
}

// 1: `len` bytes are in buf; 0: not yet; -1: end-of-file or error.
int IbConn::sc_read_exact(void* buf, size_t len, size_t* got) {
  while (*got < len) {
    ssize_t n = ::recv(sc_fd_, static_cast<char*>(buf) + *got, len - *got, MSG_DONTWAIT);
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

IbSetupMsg IbConn::setup_msg(SetupType t) const {
  IbSetupMsg m{};
  m.magic = kIbHandleMagic;
  m.version = kIbWireVersion;
  m.type = static_cast<uint16_t>(t);
  memcpy(m.secret, secret_, 16);
  return m;
}

bool IbConn::is_setup(const IbSetupMsg& m, SetupType t, const uint8_t* secret) {
  return m.magic == kIbHandleMagic && m.version == kIbWireVersion &&
         m.type == static_cast<uint16_t>(t) && memcmp(m.secret, secret, 16) == 0;
}

Status IbConn::connect_step(const IbWireHandle& h, bool* done) {
  *done = false;
  const TimeUs now = now_us();
  if (now - setup_start_ > cfg_.connect_timeout) {
    R2CCL_WARN("connect: no answer from the peer's side channel within R2CCL_CONNECT_TIMEOUT "
               "(%.0f s)", cfg_.connect_timeout / 1e6);
    return Status::kRemote;
  }
  if (stage_ == 0) {
    memcpy(secret_, h.secret, 16);
    listen_id_ = h.listen_id;
    std::string err;
    sc_fd_ = open_rail_socket(rt_->side_rail(), cfg_.tcp_user_timeout, &err);
    if (sc_fd_ < 0) {
      R2CCL_WARN("connect: side channel: %s", err.c_str());
      return Status::kSystem;
    }
    sockaddr_storage peer{};
    if (h.family == AF_INET) {
      auto* s = reinterpret_cast<sockaddr_in*>(&peer);
      s->sin_family = AF_INET;
      s->sin_port = h.port;
      memcpy(&s->sin_addr, h.addr, 4);
    } else {
      auto* s = reinterpret_cast<sockaddr_in6*>(&peer);
      s->sin6_family = AF_INET6;
      s->sin6_port = h.port;
      memcpy(&s->sin6_addr, h.addr, 16);
    }
    int e = start_connect(sc_fd_, peer);
    if (e != 0) {
      R2CCL_WARN("connect: side channel to %s: %s", addr_to_string(peer).c_str(), strerror(-e));
      return Status::kRemote;
    }
    stage_ = 1;
  }
  if (stage_ == 1) {
    int e = finish_connect(sc_fd_);
    if (e == -EINPROGRESS) return Status::kOk;
    if (e != 0) {
      // The peer's listener is not there (yet): retry from a fresh socket.
      ::close(sc_fd_);
      sc_fd_ = -1;
      stage_ = 0;
      return Status::kOk;
    }
    candidates_ = rt_->path_set(rt_->devices()[dev_]);
    IbSetupMsg m = setup_msg(SetupType::kHello);
    m.listen_id = listen_id_;
    m.chunk_size = static_cast<uint64_t>(cfg_.chunk_size);
    m.area_addr = reinterpret_cast<uintptr_t>(area_);
    m.qps_per_path = static_cast<uint32_t>(nqps_);
    m.npaths = static_cast<uint32_t>(std::min<size_t>(candidates_.size(), kMaxIbPaths));
    for (uint32_t i = 0; i < m.npaths; ++i) {
      R2CCL_CHECK(register_area_on(candidates_[i]));
      fill_wire_hca(candidates_[i], &m.hca[i]);
    }
    chunk_ = m.chunk_size;
    if (!sc_write(&m, sizeof(m))) return Status::kRemote;
    stage_ = 2;
  }
  if (!sc_write(nullptr, 0)) return Status::kRemote;
  if (stage_ == 2) {
    IbSetupMsg m;
    const int r = read_setup(&m);
    if (r == 0) return Status::kOk;
    if (r < 0 || !is_setup(m, SetupType::kReply, secret_) || m.npaths == 0 || m.npaths > kMaxIbPaths || m.qps_per_path != static_cast<uint32_t>(nqps_)) {
      R2CCL_WARN("connect: the peer's setup reply is missing or invalid (%s)",
                 r < 0 ? "side channel closed" : "bad magic, version, secret, path count or QP count");
      return Status::kRemote;
    }
    peer_area_ = m.area_addr;
    const size_t nslots = static_cast<size_t>(m.npaths) * nqps_ * kRqDepth;
    slots_len_ = nslots * kCtrlSlot;
    slots_ = static_cast<char*>(aligned_alloc(4096, (slots_len_ + 4095) & ~size_t(4095)));
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
    }
    for (auto& p : paths_) {
      if (!slots_mr_[p.hca]) {
        slots_mr_[p.hca] = v_.reg_mr(rt_->hcas()[p.hca].pd, slots_, slots_len_, IBV_ACCESS_LOCAL_WRITE);
        if (!slots_mr_[p.hca]) return Status::kSystem;
      }
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
    const int r = read_setup(&m);
    if (r == 0) return Status::kOk;
    if (r < 0 || !is_setup(m, SetupType::kDone, secret_)) {
      R2CCL_WARN("connect: the peer did not confirm the connection");
      return Status::kRemote;
    }
    setup_complete(now);
    *done = true;
  }
  return Status::kOk;
}

Status IbConn::accept_step(IbListen* l, bool* done) {
  *done = false;
  const TimeUs now = now_us();
  if (stage_ == 0) {
    if (l->fd < 0) return Status::kSystem;
    int fd = ::accept4(l->fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return Status::kOk;
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
    const int r = read_setup(&m);
    if (r == 0) return Status::kOk;
    if (r < 0 || !is_setup(m, SetupType::kHello, l->secret) || m.listen_id != l->listen_id || m.npaths == 0 || m.npaths > kMaxIbPaths ||
        m.qps_per_path != static_cast<uint32_t>(nqps_) || m.chunk_size < 4096 ||
        m.chunk_size > (64ull << 20)) {
      R2CCL_WARN("accept: refused a side-channel connection: %s",
                 r < 0 ? "closed before its hello"
                       : m.qps_per_path != static_cast<uint32_t>(nqps_)
                           ? "R2CCL_IB_QPS_PER_PATH differs between the two ends"
                           : "bad magic, version, secret, listen id or chunk size");
      ::close(sc_fd_);
      sc_fd_ = -1;
      stage_ = 0;
      return Status::kOk;
    }
    memcpy(secret_, l->secret, 16);
    chunk_ = m.chunk_size;
    peer_area_ = m.area_addr;
    // Pair paths: our primary with theirs; each of our backups with an unused candidate of
    // theirs on the same link layer, preferring the same IPv4 /24 (a rail-aligned fabric
    // routes rail k only to rail k), else the next one in their order.
    std::vector<int> mine = rt_->path_set(rt_->devices()[dev_]);
    std::vector<bool> used(m.npaths, false);
    IbSetupMsg reply = setup_msg(SetupType::kReply);
    for (size_t i = 0; i < mine.size() && paths_.size() < m.npaths; ++i) {
      const HcaInfo& h = rt_->hcas()[mine[i]];
      int pick = -1;
      if (i == 0) {
        if (m.hca[0].link_layer == h.link_layer) pick = 0;
      } else {
        for (uint32_t j = 1; j < m.npaths && pick < 0; ++j)
          if (!used[j] && m.hca[j].link_layer == h.link_layer && same_ipv4_24(m.hca[j].gid, h.gid))
            pick = static_cast<int>(j);
        for (uint32_t j = 1; j < m.npaths && pick < 0; ++j)
          if (!used[j] && m.hca[j].link_layer == h.link_layer) pick = static_cast<int>(j);
      }
      if (pick < 0) {
        if (i == 0) {
          R2CCL_WARN("accept: the peer's primary HCA is %s, ours (%s) is %s: cannot connect",
                     ll_name(m.hca[0].link_layer), h.name.c_str(), ll_name(h.link_layer));
          return Status::kInternal;
        }
        continue;
      }
      used[pick] = true;
      Path p;
      p.index = static_cast<int>(paths_.size());
      p.hca = mine[i];
      p.peer = m.hca[pick];
      reply.hca[p.index].pair = static_cast<uint16_t>(pick);
      paths_.push_back(std::move(p));
    }
    const size_t nslots = paths_.size() * nqps_ * kRqDepth;
    slots_len_ = nslots * kCtrlSlot;
    slots_ = static_cast<char*>(aligned_alloc(4096, (slots_len_ + 4095) & ~size_t(4095)));
    for (auto& p : paths_) {
      R2CCL_CHECK(register_area_on(p.hca));
      if (!slots_mr_[p.hca]) {
        slots_mr_[p.hca] = v_.reg_mr(rt_->hcas()[p.hca].pd, slots_, slots_len_, IBV_ACCESS_LOCAL_WRITE);
        if (!slots_mr_[p.hca]) return Status::kSystem;
      }
      R2CCL_CHECK(create_path_qps(p));
      const uint16_t pair = reply.hca[p.index].pair;
      fill_wire_hca(p.hca, &reply.hca[p.index]);
      reply.hca[p.index].pair = pair;
      for (int q = 0; q < nqps_; ++q) reply.qpn[p.index][q] = p.qps[q]->qp_num;
    }
    reply.npaths = static_cast<uint32_t>(paths_.size());
    reply.qps_per_path = static_cast<uint32_t>(nqps_);
    reply.area_addr = reinterpret_cast<uintptr_t>(area_);
    reply.chunk_size = chunk_;
    if (!sc_write(&reply, sizeof(reply))) return Status::kRemote;
    stage_ = 2;
  }
  if (stage_ == 2) {
    IbSetupMsg m;
    const int r = read_setup(&m);
    if (r == 0) return Status::kOk;
    if (r < 0 || !is_setup(m, SetupType::kReady, secret_) || m.npaths != paths_.size()) {
      R2CCL_WARN("accept: the peer's READY is missing or invalid");
      return Status::kRemote;
    }
    for (auto& p : paths_) R2CCL_CHECK(connect_path_qps(p, m.qpn[p.index], p.peer));
    IbSetupMsg d = setup_msg(SetupType::kDone);
    if (!sc_write(&d, sizeof(d))) return Status::kRemote;
    setup_complete(now);
    *done = true;
  }
  return Status::kOk;
}

void IbConn::setup_complete(TimeUs now) {
  std::string desc;
  for (auto& p : paths_) {
    const HcaInfo& h = rt_->hcas()[p.hca];
    p.health.reset(new PathHealth(rt_->health(), PathState::kHealthy, now));
    p.port_err_seen = rt_->live(p.hca).port_err_events.load();
    p.last_probe = now;
    p.ack_progress = now;
    char peer[64];
    snprintf(peer, sizeof(peer), "%s", p.peer.link_layer == IBV_LINK_LAYER_ETHERNET
                                           ? gid_to_string(p.peer.gid).c_str()
                                           : ("lid " + std::to_string(p.peer.lid)).c_str());
    p.label = h.name + ":" + std::to_string(h.port) + " -> " + peer;
    desc += (desc.empty() ? "" : ", ") + p.label;
  }
  stage_ = 10;
  rt_->register_conn(this);
  R2CCL_INFO(NCCL_NET | NCCL_INIT, "%s connection on dev %d: %zu paths (%s), %d QPs per path, chunk %llu KiB%s",
             role_ == IbRole::kSend ? "send" : "recv", dev_, paths_.size(), desc.c_str(), nqps_,
             static_cast<unsigned long long>(chunk_ / 1024), ar_ ? ", adaptive-routing writes" : "");
}

// ------------------------------------------------------------------------------------------
// Posting

int IbConn::alloc_wr() {
  if (free_wrs_.empty()) {
    wrs_.emplace_back();
    return static_cast<int>(wrs_.size() - 1);
  }
  int i = free_wrs_.back();
  free_wrs_.pop_back();
  return i;
}

int IbConn::submit(Path& p, int q, const WrRec& rec, ibv_send_wr* wr, TimeUs now) {
  const int wi = alloc_wr();
  wrs_[wi] = rec;
  WrRec& w = wrs_[wi];
  w.path = static_cast<int8_t>(p.index);
  w.used = true;
  w.gen = p.gen;
  w.posted = now;
  w.idle_probe = p.outstanding == 0;
  wr->wr_id = static_cast<uint64_t>(wi);
  wr->send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  const int e = ibv_post_send(p.qps[q], wr, &bad);
  if (e != 0) {
    w = WrRec{};
    free_wrs_.push_back(wi);
    char d[64];
    snprintf(d, sizeof(d), "ibv_post_send: %s", strerror(e));
    fail_path(p, FailCause::kRetryExceeded, now, d, false);
    return -1;
  }
  if (p.outstanding++ == 0) p.ack_progress = now;
  return wi;
}

int IbConn::post_write(Path& p, int q, uint8_t kind, const void* local, uint32_t len, uint32_t lkey,
                       uint64_t raddr, uint32_t rkey, bool imm, uint32_t immv, IbRequest* req,
                       uint64_t seq, uint32_t idx, TimeUs now) {
  WrRec rec;
  rec.kind = kind;
  rec.req = req;
  rec.seq = seq;
  rec.idx = idx;
  rec.len = len;
  ibv_sge sge{reinterpret_cast<uintptr_t>(local), len, lkey};
  ibv_send_wr wr{};
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  wr.opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  if (imm) wr.imm_data = htonl(immv);
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return submit(p, q, rec, &wr, now);
}

std::string IbConn::rail_of(const Path& p) const {
  const HcaInfo& h = rt_->hcas()[p.hca];
  return h.name + ":" + std::to_string(h.port);
}

int IbConn::control_path() const {
  for (const auto& p : paths_)
    if (p.health && (p.health->carries_data() || p.health->state() == PathState::kDraining) &&
        !p.qps.empty())
      return p.index;
  return -1;
}

bool IbConn::any_usable() const { return control_path() >= 0; }

void IbConn::queue_ctrl(const IbCtrlMsg& m) { ctrlq_.push_back(m); }

void IbConn::queue_state_then(const IbCtrlMsg& last) {
  // The receiver's landed-chunk state, then `last` (FAIL or FAIL_ACK), in one ordered burst:
  // the sender replays only what is not in this state.
  for (IbRequest* r : active_) {
    if (r->send || r->done || r->rmsg.landed_count() == 0) continue;
    // prefix + one 64-chunk bitmap per window up to the highest chunk seen
    const uint32_t pre = r->rmsg.prefix();
    for (uint32_t base = pre; base == pre || base < r->rmsg.span(); base += 64) {
      IbCtrlMsg m{};
      m.magic = kIbHandleMagic;
      m.type = static_cast<uint16_t>(CtrlType::kAckState);
      m.a = r->seq;
      m.b = pre | (static_cast<uint64_t>(base) << 32);
      m.c = r->rmsg.window_bitmap(base);
      queue_ctrl(m);
    }
  }
  for (const auto& h : history_) {
    IbCtrlMsg m{};
    m.magic = kIbHandleMagic;
    m.type = static_cast<uint16_t>(CtrlType::kAckState);
    m.a = h.first;
    m.b = UINT64_MAX;
    queue_ctrl(m);
  }
  queue_ctrl(last);
}

void IbConn::flush_ctrl(TimeUs now) {
  while (!ctrlq_.empty()) {
    const int cp = control_path();
    if (cp < 0) {
      // No healthy RDMA path: the side channel carries control messages.
      if (sc_fd_ < 0 || !sc_write(&ctrlq_.front(), sizeof(IbCtrlMsg))) return;
      ctrlq_.pop_front();
      continue;
    }
    Path& p = paths_[cp];
    if (p.outstanding >= nqps_ * kSqDepth - 4) return;
    int slot = -1;
    for (int i = 0; i < kFifoDepth; ++i)
      if (!ctrl_slot_busy_[i]) {
        slot = i;
        break;
      }
    if (slot < 0) return;
    area_->ctrl_out[slot] = ctrlq_.front();
    WrRec rec;
    rec.kind = kWrCtrl;
    rec.ctrl_slot = slot;
    ibv_sge sge{reinterpret_cast<uintptr_t>(&area_->ctrl_out[slot]), sizeof(IbCtrlMsg),
                area_mr_[p.hca]->lkey};
    ibv_send_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    if (submit(p, 0, rec, &wr, now) < 0) continue;  // QP 0: control stays in order
    ctrl_slot_busy_[slot] = true;
    ctrlq_.pop_front();
  }
}

// ------------------------------------------------------------------------------------------
// Completions

void IbConn::poll_path(Path& p, TimeUs now, bool successes_only) {
  if (!p.cq) return;
  ibv_wc wc[kPollBatch];
  for (int round = 0; round < 8; ++round) {
    int n = ibv_poll_cq(p.cq, kPollBatch, wc);
    if (n <= 0) return;
    for (int i = 0; i < n; ++i) {
      if (successes_only && wc[i].status != IBV_WC_SUCCESS) continue;
      if (wc[i].wr_id & kRecvWrFlag) on_recv_wc(p, wc[i], now);
      else on_send_wc(p, wc[i], now);
      if (!p.cq) return;  // destroyed by a rebuild triggered from a control message
    }
    if (n < kPollBatch) return;
  }
}

void IbConn::on_send_wc(Path& p, const ibv_wc& wc, TimeUs now) {
  if (wc.wr_id >= wrs_.size() || !wrs_[wc.wr_id].used) return;
  if (gave_up_) return;  // the requests have failed; the QPs are torn down at close
  WrRec w = wrs_[wc.wr_id];
  wrs_[wc.wr_id] = WrRec{};
  free_wrs_.push_back(static_cast<int>(wc.wr_id));
  if (w.kind == kWrCtrl && w.ctrl_slot >= 0) ctrl_slot_busy_[w.ctrl_slot] = false;
  if (w.gen != p.gen || w.path != p.index) return;  // an earlier generation of the path
  p.outstanding--;
  if (w.kind == kWrData) p.inflight_bytes -= std::min<uint64_t>(p.inflight_bytes, w.len);
  if (wc.status == IBV_WC_SUCCESS) {
    p.ack_progress = now;
    switch (w.kind) {
      case kWrData:
        if (w.req && w.req->used && w.req->send && w.req->seq == w.seq)
          w.req->smsg.apply_ack(0, w.idx, 1, [](int, uint32_t) {});
        break;
      case kWrCts:
        if (w.req && w.req->used && !w.req->send && w.req->seq == w.seq) w.req->cts_acked = true;
        break;
      case kWrProbe: {
        p.probe_out = false;
        if (!p.health) break;
        if (p.health->state() == PathState::kProbing) {
          if (p.health->on_probe_pass(now)) {
            if (p.counted_failed) {
              p.counted_failed = false;
              rt_->live(p.hca).failed_paths--;
            }
            rt_->live(p.hca).failbacks++;
            if (role_ == IbRole::kSend) {
              IbCtrlMsg d{};
              d.magic = kIbHandleMagic;
              d.type = static_cast<uint16_t>(CtrlType::kRebuildDone);
              d.path = static_cast<uint16_t>(p.index);
              d.gen = p.gen;
              queue_ctrl(d);
            }
            log_event("failback: rail %s is back (path %d re-created its QPs and passed %d probes); "
                      "it carries traffic again",
                      rail_of(p).c_str(), p.index, rt_->health().probe_count);
          }
        } else if (w.idle_probe) {
          int d = p.health->on_rtt_sample(now - w.posted, now);
          if (d > 0)
            log_event("shadow routing: rail %s probe RTT %.2f ms exceeds its baseline %.2f ms + %.1f "
                      "sigma; draining it (kept connected)",
                      rail_of(p).c_str(), (now - w.posted) / 1e3, p.health->rtt_mean_us() / 1e3,
                      rt_->health().latency_sigma);
          else if (d < 0)
            log_event("shadow routing: rail %s probe RTT is back to its baseline; it carries traffic again",
                      rail_of(p).c_str());
        }
        break;
      }
      default:
        break;
    }
    return;
  }
  // Errors.
  if (w.kind == kWrProbe) p.probe_out = false;
  if (w.kind == kWrCts && w.req && w.req->used && w.req->seq == w.seq && !w.req->cts_acked)
    w.req->cts_path = -1;
  if (recoverable(wc.status)) {
    fail_path(p, FailCause::kRetryExceeded, now, v_.wc_status_str(wc.status), false);
    return;
  }
  char why[160];
  snprintf(why, sizeof(why), "work completion %s (vendor error 0x%x) on path %s: fatal, not failed over",
           v_.wc_status_str(wc.status), wc.vendor_err, p.label.c_str());
  give_up(fatal_status(wc.status), why);
}

void IbConn::on_recv_wc(Path& p, const ibv_wc& wc, TimeUs now) {
  const uint32_t gen = static_cast<uint32_t>((wc.wr_id >> 32) & 0x7fffffffu);
  const size_t slot = wc.wr_id & 0xffffffffu;
  if (gen != p.gen || slot * kCtrlSlot >= slots_len_) return;
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR && p.health && p.health->connected())
      fail_path(p, FailCause::kRetryExceeded, now, v_.wc_status_str(wc.status), false);
    return;
  }
  const int per_path = nqps_ * kRqDepth;
  const int q = static_cast<int>((slot % per_path) / kRqDepth);
  const int k = static_cast<int>(slot % kRqDepth);
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    peer_rebuilt(p, now);  // a chunk on this generation: the sender's QPs are connected
    on_chunk(p, ntohl(wc.imm_data), wc.byte_len, now);
  } else if (wc.opcode == IBV_WC_RECV) {
    IbCtrlMsg m;
    memcpy(&m, slots_ + slot * kCtrlSlot, sizeof(m));
    if (wc.byte_len >= sizeof(m) && m.magic == kIbHandleMagic) {
      if (!p.qps.empty() && q < static_cast<int>(p.qps.size())) post_recv_slot(p, q, k);
      on_ctrl(&p, m, now);
      return;
    }
    R2CCL_WARN("path %s: malformed control message (%u bytes) ignored", p.label.c_str(), wc.byte_len);
  }
  if (!p.qps.empty() && q < static_cast<int>(p.qps.size())) post_recv_slot(p, q, k);
}

void IbConn::on_chunk(Path& p, uint32_t imm, uint32_t len, TimeUs now) {
  IbRequest* r = find_recv_seq7(imm_seq7(imm));
  if (!r) {
    rt_->live(p.hca).discarded_chunks++;
    return;
  }
  const uint32_t idx = imm_idx(imm);
  const bool last = imm_last(imm);
  if (ar_) {
    if (last) {
      const uint64_t total = area_->sizes[r->seq % kFifoDepth];
      const uint64_t off = static_cast<uint64_t>(idx) * chunk_;
      len = total >= off ? static_cast<uint32_t>(std::min<uint64_t>(total - off, UINT32_MAX)) : UINT32_MAX;
    } else {
      len = static_cast<uint32_t>(chunk_);
    }
  }
  const char* why = "";
  switch (r->rmsg.check_placed(idx, len, last, chunk_, rt_->hooks().guard, &why)) {
    case ChunkVerdict::kWrite:
      r->rmsg.mark_landed(idx, rt_->hooks().guard);
      if (r->rmsg.complete()) {
        r->done = true;
        history_.emplace_back(r->seq, r->rmsg.nchunks());
        while (history_.size() > 64) history_.pop_front();
      }
      break;
    case ChunkVerdict::kDuplicate:
      rt_->live(p.hca).discarded_chunks++;
      break;
    case ChunkVerdict::kProtocolError:
      fail_path(p, FailCause::kProtocol, now, why, false);
      break;
  }
}

// ------------------------------------------------------------------------------------------
// Control messages

void IbConn::on_ctrl(Path* via, const IbCtrlMsg& m, TimeUs now) {
  (void)via;
  const CtrlType t = static_cast<CtrlType>(m.type);
  if (t == CtrlType::kBye) {
    peer_closed_ = true;
    bye_at_ = now;
    return;
  }
  if (t == CtrlType::kAckState) {
    IbRequest* r = find_send(m.a);
    if (!r) return;
    if (m.b == UINT64_MAX) r->smsg.apply_ack(r->smsg.nchunks(), 0, 0, [](int, uint32_t) {});
    else r->smsg.apply_ack(static_cast<uint32_t>(m.b), static_cast<uint32_t>(m.b >> 32), m.c, [](int, uint32_t) {});
    return;
  }
  if (m.path >= paths_.size()) {
    R2CCL_WARN("control message for path %u of %zu ignored", m.path, paths_.size());
    return;
  }
  Path& p = paths_[m.path];
  IbCtrlMsg out{};
  out.magic = kIbHandleMagic;
  out.path = m.path;
  out.gen = m.gen;
  out.id = m.id;
  switch (t) {
    case CtrlType::kFail:
      if (m.gen == p.gen && p.health && p.health->connected())
        fail_path(p, FailCause::kPeerNotice, now, "the peer declared it failed", true);
      out.type = static_cast<uint16_t>(CtrlType::kFailAck);
      if (role_ == IbRole::kRecv) queue_state_then(out);
      else {
        if (m.gen == p.gen && p.gate_pending) open_gate(p, now);
        queue_ctrl(out);
      }
      break;
    case CtrlType::kFailAck:
      for (auto it = notices_.begin(); it != notices_.end();)
        it = it->id == m.id ? notices_.erase(it) : it + 1;
      if (role_ == IbRole::kSend && m.gen == p.gen && p.gate_pending) open_gate(p, now);
      break;
    case CtrlType::kRebuild:
      if (role_ == IbRole::kRecv) on_rebuild(m, now);
      break;
    case CtrlType::kRebuildDone:
      if (role_ == IbRole::kRecv && m.gen == p.gen) peer_rebuilt(p, now);
      break;
    case CtrlType::kDrain:
      if (role_ == IbRole::kSend && p.peer_drain != (m.a != 0)) {
        p.peer_drain = m.a != 0;
        log_event("r2ccl predict: the peer %s its end of path %d (%s): %s",
                  p.peer_drain ? "drains" : "no longer drains", p.index, p.label.c_str(),
                  p.peer_drain ? "no new chunks on it" : "it carries data again");
      }
      break;
    case CtrlType::kRebuildAck:
    case CtrlType::kRebuildNak:
      if (role_ == IbRole::kSend) on_rebuild_ack(m, now);
      break;
    default:
      R2CCL_WARN("unknown control message type %u ignored", m.type);
  }
}

// ------------------------------------------------------------------------------------------
// Failure, replay, failback

void IbConn::fail_path(Path& p, FailCause cause, TimeUs now, const char* detail, bool from_peer) {
  if (!p.health || !p.health->on_failure(cause, now)) return;  // exactly once per failure
  p.probe_out = false;
  HcaLive& l = rt_->live(p.hca);
  l.paths_failed++;
  if (!p.counted_failed) {
    p.counted_failed = true;
    l.failed_paths++;
  }
  const bool bilateral = rt_->hooks().bilateral_err;
  // Our QPs of the path go to ERR: nothing more is sent or lands, every posted WR flushes.
  // (Test hook no_bilateral_err: the receiver leaves them in RTS when the sender says so.)
  if (bilateral || !(from_peer && role_ == IbRole::kRecv)) {
    for (auto* qp : p.qps) {
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_ERR;
      v_.modify_qp(qp, &a, IBV_QP_STATE);
    }
  }
  const int cp = control_path();
  const char* to = cp >= 0 ? paths_[cp].label.c_str() : "no usable path";
  if (role_ == IbRole::kSend)
    log_event("path on rail %s failed (%s: %s)%s; path %d's traffic now on %s%s", rail_of(p).c_str(),
              fail_cause_name(cause), detail, from_peer ? " [peer notice]" : "", p.index, to,
              bilateral && cause != FailCause::kPeerNotice
                  ? "; replay waits for the receiver's QP error transition"
                  : "");
  else
    log_event("path on rail %s failed (%s: %s)%s at the receiving end; %s, landed state goes to "
              "the sender",
              rail_of(p).c_str(), fail_cause_name(cause), detail, from_peer ? " [peer notice]" : "",
              bilateral || !from_peer ? "QPs in ERR" : "QPs left in RTS (test hook no_bilateral_err)");
  if (p.health->take_holddown_started())
    log_event("hold-down: rail %s flapped %d times within %.0f s; not used for %.1f s",
              rail_of(p).c_str(), static_cast<int>(cfg_.holddown_flaps), cfg_.holddown_window / 1e6,
              p.health->current_holddown() / 1e6);
  if (role_ == IbRole::kSend) {
    Recovery rec{p.index, cause, now, now - p.ack_progress, 0, rail_of(p)};
    recoveries_.push_back(rec);
    if (!bilateral || cause == FailCause::kPeerNotice) open_gate(p, now);
    else p.gate_pending = true;
  } else {
    // Every chunk that landed on this path before its QPs entered ERR has its completion in
    // the CQ already: take them into account before telling the sender what landed.
    poll_path(p, now);
    for (IbRequest* r : active_)
      if (!r->send && r->cts_path == p.index && !r->cts_acked) r->cts_path = -1;
  }
  if (!from_peer) {  // tell the other end; re-sent from check_paths until answered
    notices_.push_back({next_notice_++, p.index, p.gen, now});
    send_notice(notices_.back());
  }
  flush_ctrl(now);
}

void IbConn::send_notice(const Notice& n) {
  IbCtrlMsg m{};
  m.magic = kIbHandleMagic;
  m.type = static_cast<uint16_t>(CtrlType::kFail);
  m.path = static_cast<uint16_t>(n.path);
  m.gen = n.gen;
  m.id = n.id;
  // The receiver's FAIL promises its landed state (and QPs in ERR): the state goes first.
  if (role_ == IbRole::kRecv) queue_state_then(m);
  else queue_ctrl(m);
}

void IbConn::open_gate(Path& p, TimeUs now) {
  (void)now;
  p.gate_pending = false;
  int n = 0;
  for (IbRequest* r : active_)
    if (r->send) n += r->smsg.fail_path(p.index, rt_->hooks().replay);
  for (auto& rec : recoveries_)
    if (rec.path == p.index) rec.replayed += n;
  HcaLive& l = rt_->live(p.hca);
  l.switchovers++;
  const int cp = control_path();
  log_event("switchover: rail %s failed (%s); path %d -> %s; %d chunks to replay", rail_of(p).c_str(),
            fail_cause_name(p.health->last_cause()), p.index,
            cp >= 0 ? ("rail " + rail_of(paths_[cp])).c_str() : "no usable rail", n);
}

void IbConn::check_recoveries(TimeUs now) {
  for (auto it = recoveries_.begin(); it != recoveries_.end();) {
    bool pending = paths_[it->path].gate_pending;
    for (IbRequest* r : active_)
      pending |= r->send && r->smsg.replay_outstanding() > 0;
    if (pending || !any_usable()) {
      ++it;
      continue;
    }
    log_event("Successfully recovered in %.3f s (rail %s: %s, detected after %.0f ms, %d chunks "
              "replayed)",
              (now - it->detect) / 1e6, it->rail.c_str(), fail_cause_name(it->cause),
              it->silent / 1e3, it->replayed);
    it = recoveries_.erase(it);
  }
}

void IbConn::start_rebuild(Path& p, TimeUs now) {
  destroy_path_qps(p);
  p.gen++;
  if (create_path_qps(p) != Status::kOk) {
    destroy_path_qps(p);
    p.health->on_reconnect_failed(now);
    return;
  }
  IbCtrlMsg m{};
  m.magic = kIbHandleMagic;
  m.type = static_cast<uint16_t>(CtrlType::kRebuild);
  m.path = static_cast<uint16_t>(p.index);
  m.gen = p.gen;
  m.n = static_cast<uint32_t>(nqps_);
  for (int q = 0; q < nqps_; ++q) m.qpn[q] = p.qps[q]->qp_num;
  fill_wire_hca(p.hca, &m.hca);
  p.rebuilding = true;
  p.rebuild_deadline = now + std::max<TimeUs>(4 * cfg_.heartbeat_interval, 500 * kUsPerMs);
  queue_ctrl(m);
  flush_ctrl(now);
}

void IbConn::on_rebuild(const IbCtrlMsg& m, TimeUs now) {
  Path& p = paths_[m.path];
  IbCtrlMsg out{};
  out.magic = kIbHandleMagic;
  out.path = m.path;
  out.gen = m.gen;
  if (!rt_->live(p.hca).port_active.load() || m.n != static_cast<uint32_t>(nqps_)) {
    out.type = static_cast<uint16_t>(CtrlType::kRebuildNak);
    queue_ctrl(out);
    flush_ctrl(now);
    return;
  }
  if (p.health->connected()) fail_path(p, FailCause::kPeerNotice, now, "the peer rebuilds it", true);
  destroy_path_qps(p);
  p.gen = m.gen;
  if (create_path_qps(p) != Status::kOk || connect_path_qps(p, m.qpn, m.hca) != Status::kOk) {
    destroy_path_qps(p);
    out.type = static_cast<uint16_t>(CtrlType::kRebuildNak);
    queue_ctrl(out);
    flush_ctrl(now);
    return;
  }
  // Nothing is posted on the new QPs until the sender has connected its own (its probes
  // passed, REBUILD_DONE): a write to a sender QP still in INIT would be lost and fail the
  // path again. Receives are posted, so the sender's chunks land meanwhile.
  p.awaiting_peer = true;
  out.type = static_cast<uint16_t>(CtrlType::kRebuildAck);
  out.n = static_cast<uint32_t>(nqps_);
  for (int q = 0; q < nqps_; ++q) out.qpn[q] = p.qps[q]->qp_num;
  fill_wire_hca(p.hca, &out.hca);
  queue_ctrl(out);
  flush_ctrl(now);
}

void IbConn::peer_rebuilt(Path& p, TimeUs now) {
  if (!p.awaiting_peer) return;
  p.awaiting_peer = false;
  p.health->on_reconnected(now);
  p.ack_progress = now;
  p.last_probe = now;
}

void IbConn::on_rebuild_ack(const IbCtrlMsg& m, TimeUs now) {
  Path& p = paths_[m.path];
  if (!p.rebuilding || m.gen != p.gen) return;
  p.rebuilding = false;
  if (static_cast<CtrlType>(m.type) == CtrlType::kRebuildNak || m.n != static_cast<uint32_t>(nqps_) ||
      connect_path_qps(p, m.qpn, m.hca) != Status::kOk) {
    destroy_path_qps(p);
    p.health->on_reconnect_failed(now);
    return;
  }
  p.health->on_reconnected(now);
  p.ack_progress = now;
}

void IbConn::give_up(Status st, const char* why) {
  if (gave_up_) return;
  gave_up_ = true;
  error_ = st;
  // The connection is over at both ends: nothing more may land in NCCL's buffers (it may
  // free them once the error is reported), and the peer learns at once (BYE) instead of
  // after its own failover timeout.
  for (auto& p : paths_)
    for (auto* qp : p.qps) {
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_ERR;
      v_.modify_qp(qp, &a, IBV_QP_STATE);
    }
  say_goodbye();
  log_event("give-up: %s connection on device %d (%s): %s; %zu pending requests "
            "fail with %s",
            role_ == IbRole::kSend ? "send" : "recv", dev_,
            rt_->hcas()[rt_->devices()[dev_]].name.c_str(), why, active_.size(),
            st == Status::kRemote ? "ncclRemoteError" : st == Status::kSystem ? "ncclSystemError"
                                                                               : "ncclInternalError");
}

// ------------------------------------------------------------------------------------------
// Progress

void IbConn::check_paths(TimeUs now) {
  const TimeUs hb = cfg_.heartbeat_interval;
  for (auto& p : paths_) {
    HcaLive& l = rt_->live(p.hca);
    const uint32_t errs = l.port_err_events.load();
    if (errs != p.port_err_seen) {
      p.port_err_seen = errs;
      if (p.health->connected()) fail_path(p, FailCause::kLinkDown, now, "port error event", false);
    }
    if (!p.health->connected()) {
      if (p.rebuilding && now > p.rebuild_deadline) {
        p.rebuilding = false;
        destroy_path_qps(p);
        p.health->on_reconnect_failed(now);
      }
      if (role_ == IbRole::kSend && !p.rebuilding && !p.gate_pending && l.port_active.load() &&
          p.health->should_reconnect(now) && (any_usable() || sc_fd_ >= 0))
        start_rebuild(p, now);
      continue;
    }
    if (p.qps.empty()) continue;
    if (ack_watchdog_expired(p.outstanding > 0, p.ack_progress, now, cfg_.ack_timeout)) {
      char d[96];
      snprintf(d, sizeof(d), "no completion for %.0f ms with %d work requests outstanding",
               (now - p.ack_progress) / 1e3, p.outstanding);
      fail_path(p, p.inflight_bytes > 0 ? FailCause::kAckTimeout : FailCause::kHeartbeatMiss, now, d,
                false);
      continue;
    }
    const bool probing = p.health->state() == PathState::kProbing;
    if (!p.probe_out && (probing || (p.outstanding == 0 && now - p.last_probe >= hb))) {
      p.last_probe = now;
      p.probe_out = true;
      const uint64_t raddr = peer_area_ + offsetof(IbArea, scratch);
      post_write(p, 0, kWrProbe, nullptr, 0, 0, raddr, p.peer.area_rkey, false, 0, nullptr, 0, 0, now);
    }
  }
  // Unanswered failure notices go out again (the path they left on may have died too).
  for (auto& n : notices_) {
    if (now - n.sent_at < 2 * hb) continue;
    n.sent_at = now;
    send_notice(n);
  }
}

void IbConn::read_side_channel(TimeUs now) {
  if (sc_fd_ < 0) return;
  for (;;) {
    int r = sc_read_exact(sc_in_, sizeof(IbCtrlMsg), &sc_got_);
    if (r == 0) return;
    if (r < 0) {
      ::close(sc_fd_);
      sc_fd_ = -1;
      if (!peer_closed_) {
        peer_gone_ = true;
        log_event("the peer's side channel closed without BYE: the peer process is gone");
      }
      return;
    }
    sc_got_ = 0;
    IbCtrlMsg m;
    memcpy(&m, sc_in_, sizeof(m));
    if (m.magic != kIbHandleMagic) {
      R2CCL_WARN("side channel: malformed control message ignored");
      continue;
    }
    on_ctrl(nullptr, m, now);
  }
}

void IbConn::schedule_chunks(TimeUs now) {
  std::vector<PathLoad>& loads = loads_;  // reused: no allocation on the data path
  loads.resize(paths_.size());
  for (size_t i = 0; i < paths_.size(); ++i) {
    const Path& p = paths_[i];
    const bool up = !p.qps.empty() && p.outstanding < nqps_ * (kSqDepth - kSqReserve);
    // A port the failure predictor drains is used like a path draining for RTT outliers:
    // only when nothing else can carry data.
    const bool predicted =
        p.peer_drain || rt_->live(p.hca).predict_drain.load(std::memory_order_relaxed);
    loads[i] = PathLoad{p.health->carries_data() && up && !predicted, p.inflight_bytes,
                        static_cast<uint64_t>(cfg_.path_window),
                        static_cast<double>(std::max(1, rt_->hcas()[p.hca].speed_mbps)),
                        (p.health->state() == PathState::kDraining ||
                         (predicted && p.health->carries_data())) &&
                            up};
  }
  for (IbRequest* r : active_) {
    if (!r->send) continue;
    uint32_t idx;
    while (r->smsg.peek_next(&idx)) {
      const uint32_t len = r->smsg.chunk_len(idx);
      const int pi = pick_path(loads, cfg_.stripe, len);
      if (pi < 0) return;
      Path& p = paths_[pi];
      const int q = static_cast<int>(p.rr++ % p.qps.size());
      const uint64_t off = r->smsg.chunk_offset(idx);
      const bool last = idx + 1 == r->smsg.nchunks();
      const uint32_t lkey = r->mr->by_hca[p.hca] ? r->mr->by_hca[p.hca]->lkey : 0;
      const uint64_t raddr = r->cts.addr + off;
      const uint32_t rkey = r->cts.rkey[p.index];
      const uint32_t immv = imm_encode(r->seq, last, idx);
      const bool replay = r->smsg.take_next(pi);
      int wi = 0;
      if (ar_) {
        // Adaptive routing may reorder a write's packets: payload first, then (last chunk)
        // the message size, then a 0-byte write with immediate; RC completes them in order.
        if (len > 0)
          wi = post_write(p, q, kWrDataPart, r->data + off, len, lkey, raddr, rkey, false, 0, r,
                          r->seq, idx, now);
        if (wi >= 0 && last) {
          area_->sizes[r->seq % kFifoDepth] = r->size;
          wi = post_write(p, q, kWrDataPart, &area_->sizes[r->seq % kFifoDepth], 8,
                          area_mr_[p.hca]->lkey,
                          peer_area_ + offsetof(IbArea, sizes) + (r->seq % kFifoDepth) * 8,
                          p.peer.area_rkey, false, 0, r, r->seq, idx, now);
        }
        if (wi >= 0)
          wi = post_write(p, q, kWrData, nullptr, 0, 0, raddr, rkey, true, immv, r, r->seq, idx, now);
      } else {
        wi = post_write(p, q, kWrData, r->data + off, len, lkey, raddr, rkey, true, immv, r, r->seq,
                        idx, now);
      }
      if (wi < 0) return;  // the path failed; its chunks replay once the gate opens
      wrs_[wi].len = len;  // the chunk record carries the payload length for in-flight bytes
      p.inflight_bytes += len;
      loads[pi].inflight_bytes += len;
      p.chunks_sent++;
      HcaLive& l = rt_->live(p.hca);
      (replay ? l.chunks_replayed : l.chunks_sent)++;
      l.bytes_sent += len;
    }
  }
}

// Receiver: tells the sender when this node's failure predictor drains or returns the HCA
// port of a path, so the sender moves new chunks off it (it decides where chunks go).
void IbConn::tell_drains() {
  for (auto& p : paths_) {
    const bool d = rt_->live(p.hca).predict_drain.load(std::memory_order_relaxed);
    if (d == p.drain_sent) continue;
    p.drain_sent = d;
    IbCtrlMsg m{};
    m.magic = kIbHandleMagic;
    m.type = static_cast<uint16_t>(CtrlType::kDrain);
    m.path = static_cast<uint16_t>(p.index);
    m.gen = p.gen;
    m.a = d ? 1 : 0;
    queue_ctrl(m);
  }
}

void IbConn::post_ctss(TimeUs now) {
  for (IbRequest* r : active_) {
    if (r->send || r->done || r->cts_path >= 0) continue;
    const int cp = control_path();
    if (cp < 0) return;
    Path& p = paths_[cp];
    if (p.outstanding >= nqps_ * kSqDepth - 8) return;
    const int slot = static_cast<int>(r->seq % kFifoDepth);
    CtsRecord& c = area_->cts_out[slot];
    c.addr = reinterpret_cast<uintptr_t>(r->rmsg.buffer());
    c.size = r->size;
    for (size_t i = 0; i < paths_.size(); ++i)
      c.rkey[i] = r->mr && r->mr->by_hca[paths_[i].hca] ? r->mr->by_hca[paths_[i].hca]->rkey : 0;
    c.tag = r->tag;
    c.seq1 = r->seq + 1;
    if (post_write(p, 0, kWrCts, &c, sizeof(c), area_mr_[p.hca]->lkey,
                   peer_area_ + offsetof(IbArea, fifo) + slot * sizeof(CtsRecord), p.peer.area_rkey,
                   false, 0, r, r->seq, 0, now) < 0)
      return;
    r->cts_path = cp;
  }
}

void IbConn::progress(TimeUs now) {
  if (stage_ != 10 || gave_up_) return;
  read_side_channel(now);
  if (peer_closed_) {
    // The peer closed on purpose (BYE), or gave up. Completions already in the CQs still
    // count: a receive whose data landed before the BYE was read completes (the sender saw
    // it acknowledged and closed). What is still pending a second later cannot finish.
    if (!active_.empty() && !gave_up_)
      for (auto& p : paths_) poll_path(p, now, true);
    if (gave_up_) return;
    if (!active_.empty() && now - bye_at_ > kUsPerSec && error_ == Status::kOk) {
      error_ = Status::kRemote;
      log_event("give-up: %s connection on device %d: the peer closed the connection (BYE) with "
                "%zu requests pending; they fail with ncclRemoteError",
                role_ == IbRole::kSend ? "send" : "recv", dev_, active_.size());
    }
    return;
  }
  for (auto& p : paths_) poll_path(p, now);
  if (gave_up_) return;
  check_paths(now);
  if (role_ == IbRole::kSend) schedule_chunks(now);
  else {
    post_ctss(now);
    tell_drains();
  }
  flush_ctrl(now);
  if (role_ == IbRole::kSend) check_recoveries(now);
  const bool expired = give_up_timer_.update(any_usable(), now, cfg_.failover_timeout);
  if (!give_up_timer_.waiting()) return;
  if (peer_gone_)
    give_up(Status::kRemote, "no usable path, and the peer process is gone (side channel closed)");
  else if (expired)
    give_up(GiveUpTimer::status(false), "no usable path: no HCA path reaches the peer within R2CCL_FAILOVER_TIMEOUT");
}

// ------------------------------------------------------------------------------------------
// Data path entry points

IbRequest* IbConn::free_request() {
  for (auto& r : reqs_)
    if (!r.used) return &r;
  return nullptr;
}

IbRequest* IbConn::find_send(uint64_t seq) {
  for (IbRequest* r : active_)
    if (r->send && r->seq == seq) return r;
  return nullptr;
}

IbRequest* IbConn::find_recv_seq7(uint32_t seq7) {
  for (IbRequest* r : active_)
    if (!r->send && !r->done && (r->seq & ((1u << kImmSeqBits) - 1)) == seq7) return r;
  return nullptr;
}

void IbConn::finish_request(IbRequest* r) {
  active_.erase(std::remove(active_.begin(), active_.end(), r), active_.end());
  r->used = false;
  r->done = false;
}

Status IbConn::isend(void* data, uint64_t size, IbMr* mr, IbRequest** out) {
  *out = nullptr;
  const TimeUs now = now_us();
  if (error_ != Status::kOk) return error_;
  if (!mr) {
    R2CCL_WARN("isend: no memory handle (regMr was not called for this buffer)");
    return Status::kInternal;
  }
  const int slot = static_cast<int>(next_send_seq_ % kFifoDepth);
  volatile CtsRecord* c = &area_->fifo[slot];
  if (c->seq1 != next_send_seq_ + 1) {
    progress(now);
    if (error_ != Status::kOk) return error_;
    if (c->seq1 != next_send_seq_ + 1) return Status::kOk;  // no CTS yet: NCCL calls again
  }
  IbRequest* r = free_request();
  if (!r) return Status::kOk;
  std::atomic_thread_fence(std::memory_order_acquire);
  memcpy(&r->cts, const_cast<CtsRecord*>(&area_->fifo[slot]), sizeof(CtsRecord));
  if (size > r->cts.size) {
    R2CCL_WARN("isend: %llu bytes, but the matching receive posted only %llu bytes",
               static_cast<unsigned long long>(size), static_cast<unsigned long long>(r->cts.size));
    return Status::kInternal;
  }
  r->used = true;
  r->send = true;
  r->done = false;
  r->seq = next_send_seq_++;
  r->data = static_cast<const char*>(data);
  r->size = size;
  r->mr = mr;
  r->smsg.reset(r->seq, size, chunk_);
  active_.push_back(r);
  *out = r;
  progress(now);
  return Status::kOk;
}

Status IbConn::irecv(void* data, uint64_t size, int tag, IbMr* mr, IbRequest** out) {
  *out = nullptr;
  const TimeUs now = now_us();
  if (error_ != Status::kOk) return error_;
  if (!mr) {
    R2CCL_WARN("irecv: no memory handle (regMr was not called for this buffer)");
    return Status::kInternal;
  }
  IbRequest* r = free_request();
  if (!r) return Status::kOk;
  r->used = true;
  r->send = false;
  r->done = false;
  r->seq = next_recv_seq_++;
  r->data = static_cast<const char*>(data);
  r->size = size;
  r->mr = mr;
  r->rmsg.reset(r->seq, static_cast<char*>(data), size);
  r->tag = tag;
  r->cts_path = -1;
  r->cts_acked = false;
  active_.push_back(r);
  *out = r;
  progress(now);
  return Status::kOk;
}

Status IbConn::test(IbRequest* r, int* done, int* size) {
  *done = 0;
  if (r->flush) {
    ibv_wc wc[8];
    const int n = ibv_poll_cq(flush_cq_, 8, wc);
    for (int i = 0; i < n; ++i) {
      IbRequest& f = reqs_[wc[i].wr_id % NCCL_NET_MAX_REQUESTS];
      if (wc[i].status != IBV_WC_SUCCESS) {
        R2CCL_WARN("iflush: flush read completed with %s", v_.wc_status_str(wc[i].status));
        error_ = Status::kSystem;
      }
      f.done = true;
    }
    if (!r->done) return error_;
    *done = 1;
    if (size) *size = 0;
    r->flush = false;
    r->used = false;
    r->done = false;
    return error_;
  }
  if (!r->done) {
    progress(now_us());
    if (r->send && r->smsg.complete()) r->done = true;
  }
  if (!r->done) {
    if (error_ != Status::kOk) {
      finish_request(r);
      return error_;
    }
    return Status::kOk;
  }
  *done = 1;
  if (size) *size = static_cast<int>(r->send ? r->size : r->rmsg.total());
  finish_request(r);
  return Status::kOk;
}

Status IbConn::make_flush_qp() {
  const Path& p = paths_[0];
  HcaInfo h = rt_->hca_snapshot(p.hca);
  flush_cq_ = v_.create_cq(h.ctx, 64, nullptr, nullptr, 0);
  if (!flush_cq_) return Status::kSystem;
  ibv_qp_init_attr ia{};
  ia.send_cq = flush_cq_;
  ia.recv_cq = flush_cq_;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 32;
  ia.cap.max_recv_wr = 1;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  flush_qp_ = v_.create_qp(h.pd, &ia);
  if (!flush_qp_) return Status::kSystem;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = static_cast<uint8_t>(h.port);
  a.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
  if (v_.modify_qp(flush_qp_, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    return Status::kSystem;
  IbWireHca self;
  fill_wire_hca(p.hca, &self);
  ibv_qp_attr r{};
  r.qp_state = IBV_QPS_RTR;
  r.path_mtu = static_cast<ibv_mtu>(h.active_mtu ? h.active_mtu : static_cast<int>(IBV_MTU_1024));
  r.dest_qp_num = flush_qp_->qp_num;
  r.max_dest_rd_atomic = 1;
  r.min_rnr_timer = 12;
  r.ah_attr.port_num = static_cast<uint8_t>(h.port);
  if (h.link_layer == IBV_LINK_LAYER_ETHERNET) {
    r.ah_attr.is_global = 1;
    memcpy(r.ah_attr.grh.dgid.raw, self.gid, 16);
    r.ah_attr.grh.sgid_index = static_cast<uint8_t>(h.gid_index);
    r.ah_attr.grh.hop_limit = 255;
  } else {
    r.ah_attr.dlid = self.lid;
  }
  if (v_.modify_qp(flush_qp_, &r,
                   IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return Status::kSystem;
  ibv_qp_attr t{};
  t.qp_state = IBV_QPS_RTS;
  t.timeout = static_cast<uint8_t>(cfg_.ib_timeout);
  t.retry_cnt = static_cast<uint8_t>(cfg_.ib_retry_cnt);
  t.rnr_retry = 7;
  t.max_rd_atomic = 1;
  if (v_.modify_qp(flush_qp_, &t,
                   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                       IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    return Status::kSystem;
  return Status::kOk;
}

Status IbConn::iflush(int n, void** data, const int* sizes, IbMr** mrs, IbRequest** out) {
  *out = nullptr;
  if (error_ != Status::kOk) return error_;
  int last = -1;
  for (int i = 0; i < n; ++i)
    if (sizes[i] > 0 && mrs[i] && (mrs[i]->type != NCCL_PTR_HOST || rt_->hooks().force_flush))
      last = i;
  if (last < 0) return Status::kOk;  // host memory: nothing to flush
  if (!flush_qp_) {
    Status s = make_flush_qp();
    if (s != Status::kOk) {
      R2CCL_WARN("iflush: cannot set up the loopback flush QP on %s: %s", rail_of(paths_[0]).c_str(),
                 strerror(errno));
      return s;
    }
  }
  IbRequest* r = free_request();
  if (!r) return Status::kOk;  // NCCL calls again
  const int hca = paths_[0].hca;
  ibv_sge sge{reinterpret_cast<uintptr_t>(&area_->scratch[0]), 1, area_mr_[hca]->lkey};
  ibv_send_wr wr{};
  wr.wr_id = static_cast<uint64_t>(r - reqs_);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(data[last]);
  wr.wr.rdma.rkey = mrs[last]->by_hca[hca] ? mrs[last]->by_hca[hca]->rkey : 0;
  ibv_send_wr* bad = nullptr;
  int e = ibv_post_send(flush_qp_, &wr, &bad);
  if (e != 0) {
    R2CCL_WARN("iflush: ibv_post_send of the flush read: %s", strerror(e));
    return Status::kSystem;
  }
  r->used = true;
  r->send = false;
  r->done = false;
  r->flush = true;
  r->size = 0;
  *out = r;
  return Status::kOk;
}

void IbConn::say_goodbye() {
  if (sc_fd_ < 0 || stage_ != 10) return;
  IbCtrlMsg m{};
  m.magic = kIbHandleMagic;
  m.type = static_cast<uint16_t>(CtrlType::kBye);
  ::send(sc_fd_, &m, sizeof(m), MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace r2ccl::net::ib
