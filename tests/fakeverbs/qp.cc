// Fake RC queue pairs: creation, the state machine (ibv_modify_qp), post_send / post_recv and
// the requester-side completion logic.
//
// Send queue model: every posted send WR becomes a SendWr in Qp::sq, in posting order. It is
// transmitted at once (kSent), or kept (kQueued) while something earlier blocks the QP (a
// held write, a blackhole, a WR that already failed locally), or held by the hold_write fault
// (kHeld). ACKs mark WRs kDone; completions are generated strictly from the head of sq
// (advance_sq_locked), so they come in posting order. The first error completion moves the
// QP to ERR, which flushes everything behind it with IBV_WC_WR_FLUSH_ERR.
//
// All functions run under State::mu.

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "fake_internal.h"

namespace fv {

namespace {

// 0 with errno set when the counter file cannot be opened.
uint32_t alloc_qpn() {
  if (g->qpn_fd < 0) {
    std::string path = g->dir + "/qpn";
    g->qpn_fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (g->qpn_fd < 0) return 0;
    g->owned_fds.push_back(g->qpn_fd);
  }
  const int fd = g->qpn_fd;
  uint32_t v = 0;
  if (flock(fd, LOCK_EX) == 0) {
    char buf[32] = {};
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    v = n > 0 ? static_cast<uint32_t>(strtoul(buf, nullptr, 10)) : 0;
    if (v < 0x100 || v >= 0xffffff) v = 0x100;
    std::string next = std::to_string(v + 1) + "\n";
    if (ftruncate(fd, 0) != 0 || pwrite(fd, next.data(), next.size(), 0) < 0) v = 0;
    flock(fd, LOCK_UN);
  }
  if (v == 0) errno = EIO;
  return v;
}

ibv_wc_opcode wc_opcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ: return IBV_WC_RDMA_READ;
    default: return IBV_WC_SEND;
  }
}

void push_send_cqe(Qp* qp, const SendWr& w, ibv_wc_status st) {
  ibv_wc wc{};
  wc.wr_id = w.wr_id;
  wc.status = st;
  wc.opcode = wc_opcode(w.op);
  wc.byte_len = w.len;
  wc.qp_num = qp->qpn;
  push_cqe(qp->scq, wc, w.slot_end);
}

void push_recv_flush(Qp* qp, const RecvWr& r) {
  ibv_wc wc{};
  wc.wr_id = r.wr_id;
  wc.status = IBV_WC_WR_FLUSH_ERR;
  wc.opcode = IBV_WC_RECV;
  wc.qp_num = qp->qpn;
  push_cqe(qp->rcq, wc);
}

// Drops every WR without completions (to RESET, or destroyed).
void discard_all(Qp* qp) {
  qp->sq.clear();
  qp->rq.clear();
  qp->inq.clear();
  qp->lagged.clear();
  qp->held_block = qp->blackholed = qp->err_pending = qp->retx_block = qp->gap = false;
}

// Is SGE [addr, addr+len) inside MR `key` of `pd` with `need` access?
Mr* check_sge(const ibv_sge& s, Pd* pd, int need) {
  Mr* m = find_mr(s.lkey);
  if (!m || m->pd != pd || (need && (m->access & need) != need)) return nullptr;
  if (s.addr < m->iova || s.addr - m->iova > m->len || s.length > m->len - (s.addr - m->iova))
    return nullptr;
  return m;
}

char* sge_ptr(const Mr* m, const ibv_sge& s) { return m->addr + (s.addr - m->iova); }

}  // namespace

long long one_try_us(const Qp* qp) {
  if (g->retry_us_env > 0) return std::max(1ll, g->retry_us_env / (qp->attr.retry_cnt + 1));
  if (qp->attr.timeout == 0) return -1;
  const double us = 4.096 * std::ldexp(1.0, std::min<int>(qp->attr.timeout, 40)) /
                    static_cast<double>(g->time_scale);
  return std::max(1ll, static_cast<long long>(std::min(us, 1e15)));
}

long long retry_us(const Qp* qp) {
  if (g->retry_us_env > 0) return g->retry_us_env;
  if (qp->attr.timeout == 0) return -1;  // IB: timeout 0 = wait forever
  double us = 4.096 * std::ldexp(1.0, std::min<int>(qp->attr.timeout, 40)) *
              (qp->attr.retry_cnt + 1) / static_cast<double>(g->time_scale);
  return static_cast<long long>(std::min(us, 1e15));
}

void advance_sq_locked(Qp* qp) {
  while (!qp->sq.empty() && qp->sq.front().st == SendWr::kDone) {
    SendWr w = std::move(qp->sq.front());
    qp->sq.pop_front();
    if (w.status != IBV_WC_SUCCESS) {
      push_send_cqe(qp, w, w.status);
      qp_to_error_locked(qp);
      return;
    }
    if (w.signaled) push_send_cqe(qp, w, IBV_WC_SUCCESS);
  }
}

void qp_to_error_locked(Qp* qp) {
  release_lagged_locked(qp, kNever);  // completed WRs come before the flushes
  qp->state = IBV_QPS_ERR;
  qp->box.pub.state = IBV_QPS_ERR;
  for (const auto& w : qp->sq) push_send_cqe(qp, w, IBV_WC_WR_FLUSH_ERR);
  for (const auto& r : qp->rq) push_recv_flush(qp, r);
  discard_all(qp);
}

}  // namespace fv

using namespace fv;

FV_API ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* ia) {
  std::lock_guard<std::mutex> l(g->mu);
  if (ia->qp_type != IBV_QPT_RC) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (ia->srq) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  const ibv_qp_cap& c = ia->cap;
  if (!ia->send_cq || !ia->recv_cq || c.max_send_wr > kMaxWr || c.max_recv_wr > kMaxWr ||
      c.max_send_sge > kMaxSge || c.max_recv_sge > kMaxSge || c.max_inline_data > kMaxInline ||
      ia->send_cq->context != pd->context || ia->recv_cq->context != pd->context) {
    errno = EINVAL;
    return nullptr;
  }
  if (reinterpret_cast<PdBox*>(pd)->impl->ctx->dead) {
    errno = EIO;
    return nullptr;
  }
  uint32_t qpn = alloc_qpn();
  if (!qpn) return nullptr;  // errno: why the counter could not be read
  std::string reg = g->dir + "/qp-" + std::to_string(qpn);
  unlink(reg.c_str());  // a stale entry from a wrapped counter
  if (symlink(std::to_string(getpid()).c_str(), reg.c_str()) != 0) {
    errno = EIO;
    return nullptr;
  }
  auto* q = new Qp();
  q->box.impl = q;
  q->pd = reinterpret_cast<PdBox*>(pd)->impl;
  q->ctx = q->pd->ctx;
  q->dev = q->ctx->dev;
  q->scq = reinterpret_cast<CqBox*>(ia->send_cq)->impl;
  q->rcq = reinterpret_cast<CqBox*>(ia->recv_cq)->impl;
  q->qpn = qpn;
  q->cap = c;
  q->cap.max_send_wr = std::max(1u, c.max_send_wr);
  q->cap.max_recv_wr = std::max(1u, c.max_recv_wr);
  q->cap.max_send_sge = std::max(1u, c.max_send_sge);
  q->cap.max_recv_sge = std::max(1u, c.max_recv_sge);
  ia->cap = q->cap;
  q->sig_all = ia->sq_sig_all != 0;
  q->pd->users++;
  q->scq->users++;
  q->rcq->users++;
  ibv_qp& x = q->box.pub;
  x.context = pd->context;
  x.qp_context = ia->qp_context;
  x.pd = pd;
  x.send_cq = ia->send_cq;
  x.recv_cq = ia->recv_cq;
  x.handle = qpn;
  x.qp_num = qpn;
  x.state = IBV_QPS_RESET;
  x.qp_type = IBV_QPT_RC;
  pthread_mutex_init(&x.mutex, nullptr);
  pthread_cond_init(&x.cond, nullptr);
  g->qps[qpn] = q;
  return &x;
}

FV_API int ibv_destroy_qp(ibv_qp* qp) {
  std::lock_guard<std::mutex> l(g->mu);
  Qp* q = reinterpret_cast<QpBox*>(qp)->impl;
  discard_all(q);
  g->qps.erase(q->qpn);
  std::string reg = g->dir + "/qp-" + std::to_string(q->qpn);
  unlink(reg.c_str());
  // Like the kernel (uverbs), drop the destroyed QP's async events not yet read.
  auto& ev = q->ctx->events;
  ev.erase(std::remove_if(ev.begin(), ev.end(),
                          [&](const ibv_async_event& e) {
                            return (e.event_type == IBV_EVENT_QP_FATAL ||
                                    e.event_type == IBV_EVENT_QP_REQ_ERR ||
                                    e.event_type == IBV_EVENT_QP_ACCESS_ERR) &&
                                   e.element.qp == qp;
                          }),
           ev.end());
  // Like real providers, remove the destroyed QP's completions still in its CQs.
  // (Cq::slot_ends runs parallel to Cq::wcs and loses the same entries.)
  for (Cq* c : {q->scq, q->rcq}) {
    size_t k = 0;
    for (size_t i = 0; i < c->wcs.size(); ++i) {
      if (c->wcs[i].qp_num == q->qpn) continue;
      c->wcs[k] = c->wcs[i];
      c->slot_ends[k] = c->slot_ends[i];
      ++k;
    }
    c->wcs.resize(k);
    c->slot_ends.resize(k);
    if (q->scq == q->rcq) break;
  }
  q->pd->users--;
  q->scq->users--;
  q->rcq->users--;
  delete q;
  return 0;
}

FV_API int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* a, int mask) {
  std::lock_guard<std::mutex> l(g->mu);
  Qp* q = reinterpret_cast<QpBox*>(qp)->impl;
  ibv_qp_state cur = q->state;
  ibv_qp_state to = (mask & IBV_QP_STATE) ? a->qp_state : cur;
  if ((mask & IBV_QP_CUR_STATE) && a->cur_qp_state != cur) return EINVAL;
  auto has = [&](int m) { return (mask & m) == m; };
  if (to == IBV_QPS_RESET) {
    discard_all(q);
    q->sq_freed = q->sq_posted;  // RESET empties the send queue, polled or not
    q->state = IBV_QPS_RESET;
    q->box.pub.state = IBV_QPS_RESET;
    q->attr = ibv_qp_attr{};
    q->peer_pid = 0;
    return 0;
  }
  if (to == IBV_QPS_ERR) {
    if (cur != IBV_QPS_ERR) qp_to_error_locked(q);
    return 0;
  }
  if (q->ctx->dead) return EIO;  // the device is in fatal error: no transition but to ERR/RESET
  bool ok = false;
  if (cur == IBV_QPS_RESET && to == IBV_QPS_INIT) {
    ok = has(IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) &&
         a->port_num == 1 && a->pkey_index < q->dev->pkeys.size();
  } else if (cur == IBV_QPS_INIT && to == IBV_QPS_INIT) {
    ok = true;
  } else if (cur == IBV_QPS_INIT && to == IBV_QPS_RTR) {
    ok = has(IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) &&
         a->path_mtu >= IBV_MTU_256 && a->path_mtu <= IBV_MTU_4096 && a->dest_qp_num != 0 &&
         a->dest_qp_num <= 0xffffff;
    // The kernel refuses an AV without GRH on RoCE and on a port that requires one
    // (rdma_check_ah_attr, drivers/infiniband/core/verbs.c): EINVAL.
    const ibv_global_route& gr = a->ah_attr.grh;
    const bool grh_ok = gr.sgid_index < q->dev->gids.size() && q->dev->gids[gr.sgid_index].valid;
    if (ok && (q->dev->eth || q->dev->grh_required) && !a->ah_attr.is_global) ok = false;
    if (ok && a->ah_attr.is_global) ok = grh_ok;
    if (ok && !q->dev->eth) ok = a->ah_attr.dlid != 0 && a->ah_attr.port_num <= 1;
  } else if (cur == IBV_QPS_RTR && to == IBV_QPS_RTS) {
    ok = has(IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
             IBV_QP_MAX_QP_RD_ATOMIC) &&
         a->retry_cnt <= 7 && a->rnr_retry <= 7 && a->timeout <= 31;
  } else if (cur == IBV_QPS_RTS && to == IBV_QPS_RTS) {
    ok = !(mask & (IBV_QP_AV | IBV_QP_DEST_QPN | IBV_QP_PORT));
  }
  if (!ok) return EINVAL;
  ibv_qp_attr& s = q->attr;
  if (mask & IBV_QP_PKEY_INDEX) s.pkey_index = a->pkey_index;
  if (mask & IBV_QP_PORT) s.port_num = a->port_num;
  if (mask & IBV_QP_ACCESS_FLAGS) s.qp_access_flags = a->qp_access_flags;
  if (mask & IBV_QP_AV) s.ah_attr = a->ah_attr;
  if (mask & IBV_QP_PATH_MTU) s.path_mtu = a->path_mtu;
  if (mask & IBV_QP_DEST_QPN) {
    s.dest_qp_num = a->dest_qp_num;
    q->peer_pid = 0;
    preconnect_locked(q);
  }
  if (mask & IBV_QP_RQ_PSN) s.rq_psn = a->rq_psn;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) s.max_dest_rd_atomic = a->max_dest_rd_atomic;
  if (mask & IBV_QP_MIN_RNR_TIMER) s.min_rnr_timer = a->min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) s.timeout = a->timeout;
  if (mask & IBV_QP_RETRY_CNT) s.retry_cnt = a->retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) s.rnr_retry = a->rnr_retry;
  if (mask & IBV_QP_SQ_PSN) s.sq_psn = a->sq_psn;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) s.max_rd_atomic = a->max_rd_atomic;
  q->state = to;
  q->box.pub.state = to;
  return 0;
}

FV_API int ibv_query_qp(ibv_qp* qp, ibv_qp_attr* a, int /*mask*/, ibv_qp_init_attr* init) {
  std::lock_guard<std::mutex> l(g->mu);
  Qp* q = reinterpret_cast<QpBox*>(qp)->impl;
  *a = q->attr;
  a->qp_state = q->state;
  a->cur_qp_state = q->state;
  a->cap = q->cap;
  if (init) {
    memset(init, 0, sizeof *init);
    init->qp_context = qp->qp_context;
    init->send_cq = qp->send_cq;
    init->recv_cq = qp->recv_cq;
    init->cap = q->cap;
    init->qp_type = IBV_QPT_RC;
    init->sq_sig_all = q->sig_all;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------
// Data path (context ops).

int fv_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  std::lock_guard<std::mutex> l(g->mu);
  Qp* q = reinterpret_cast<QpBox*>(qp)->impl;
  Device* d = q->dev;
  int rc = 0;
  if (d->arm_sq_full > 0 && q->state == IBV_QPS_RTS) {  // as if other WRs held every slot
    d->arm_sq_full--;
    if (bad) *bad = wr;
    return ENOMEM;
  }
  for (; wr; wr = wr->next) {
    if (q->sq_posted - q->sq_freed >= q->cap.max_send_wr) {
      rc = ENOMEM;  // every slot waits for a completion to be polled
      break;
    }
    if (q->state == IBV_QPS_ERR) {  // accepted, flushed at once
      SendWr w;
      w.wr_id = wr->wr_id;
      w.op = wr->opcode;
      w.slot_end = ++q->sq_posted;
      push_send_cqe(q, w, IBV_WC_WR_FLUSH_ERR);
      continue;
    }
    bool is_write = wr->opcode == IBV_WR_RDMA_WRITE || wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    bool is_send = wr->opcode == IBV_WR_SEND || wr->opcode == IBV_WR_SEND_WITH_IMM;
    bool is_read = wr->opcode == IBV_WR_RDMA_READ;
    bool inl = (wr->send_flags & IBV_SEND_INLINE) != 0;
    uint64_t total = 0;
    for (int i = 0; i < std::max(wr->num_sge, 0); ++i) total += wr->sg_list[i].length;
    if (q->state != IBV_QPS_RTS || (!is_write && !is_send && !is_read) || wr->num_sge < 0 ||
        wr->num_sge > static_cast<int>(q->cap.max_send_sge) || (wr->num_sge && !wr->sg_list) ||
        total > kMaxMsg || (inl && (is_read || total > q->cap.max_inline_data))) {
      rc = EINVAL;
      break;
    }
    if (!g->posted_any) {
      g->posted_any = true;
      g->first_post = Clock::now();
      wake_nic();  // after_ms triggers start counting now
    }
    q->sq.emplace_back();
    SendWr& w = q->sq.back();
    w.wr_id = wr->wr_id;
    w.seq = q->next_seq++;
    w.slot_end = ++q->sq_posted;
    w.ordinal = ++g->ordinal;
    w.op = wr->opcode;
    w.signaled = q->sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    w.len = static_cast<uint32_t>(total);
    w.raddr = is_send ? 0 : wr->wr.rdma.remote_addr;
    // Local protection: every SGE inside an MR of this QP's PD with the right lkey.
    std::vector<const Mr*> mrs;
    bool prot_ok = true;
    if (!inl) {
      for (int i = 0; i < wr->num_sge && prot_ok; ++i) {
        Mr* m = check_sge(wr->sg_list[i], q->pd, is_read ? IBV_ACCESS_LOCAL_WRITE : 0);
        prot_ok = m != nullptr;
        mrs.push_back(m);
      }
    }
    if (d->arm_lkey > 0) {
      d->arm_lkey--;
      prot_ok = false;
    }
    if (!prot_ok || q->err_pending) {
      // Fails when it reaches the head (after the WRs before it), or flushes behind another
      // failed WR.
      w.st = q->err_pending ? SendWr::kQueued : SendWr::kDone;
      w.status = IBV_WC_LOC_PROT_ERR;
      q->err_pending = true;
      continue;
    }
    // Build the packet: header + gathered payload (the payload is captured now).
    size_t pay = is_read ? 0 : total;
    w.pkt.resize(sizeof(Hdr) + pay);
    Hdr h{};
    h.magic = kMagic;
    h.type = kReq;
    h.op = static_cast<uint8_t>(wr->opcode);
    h.is_eth = d->eth;
    h.src_pid = static_cast<uint32_t>(getpid());
    h.src_qpn = q->qpn;
    h.dst_qpn = q->attr.dest_qp_num;
    h.imm = wr->imm_data;
    h.len = static_cast<uint32_t>(pay);
    h.rd_len = is_read ? static_cast<uint32_t>(total) : 0;
    h.seq = w.seq;
    h.rnr_retry = q->attr.rnr_retry;
    if (!is_send) {
      h.raddr = wr->wr.rdma.remote_addr;
      h.rkey = wr->wr.rdma.rkey;
      // Zero-length ops check no key (probes), so the fault waits for one that carries data.
      if ((is_write || is_read) && total > 0 && d->arm_rkey > 0) {
        d->arm_rkey--;
        h.rkey |= 0x80000000u;  // never a valid key
      }
    }
    h.has_grh = q->attr.ah_attr.is_global ? 1 : 0;
    if (h.has_grh) {
      memcpy(h.dgid, q->attr.ah_attr.grh.dgid.raw, 16);
      const uint8_t si = q->attr.ah_attr.grh.sgid_index;
      h.vlan = si < d->gids.size() ? static_cast<uint16_t>(vlan_of_gid(d->gids[si])) : 0;
    }
    h.pkey = q->attr.pkey_index < d->pkeys.size() ? d->pkeys[q->attr.pkey_index] : 0;
    h.path_mtu = static_cast<uint8_t>(q->attr.path_mtu);
    h.dlid = q->attr.ah_attr.dlid;
    h.slid = d->lid;
    memcpy(w.pkt.data(), &h, sizeof h);
    char* p = w.pkt.data() + sizeof h;
    for (int i = 0; i < wr->num_sge && !is_read; ++i) {
      const ibv_sge& s = wr->sg_list[i];
      const char* src = inl ? reinterpret_cast<const char*>(s.addr) : sge_ptr(mrs[i], s);
      if (s.length) memcpy(p, src, s.length);
      p += s.length;
    }
    if (is_read) w.read_sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
    if (!is_read) d->bytes_posted += total;
    if (is_write && total > 0 && d->arm_hold > 0) {  // a zero-length probe is never held
      d->arm_hold--;
      HeldWrite hw;
      hw.pkt = std::move(w.pkt);
      hw.raddr = w.raddr;
      hw.len = w.len;
      hw.ordinal = w.ordinal;
      hw.k = d->hold_k;
      hw.src_qpn = q->qpn;
      hw.seq = w.seq;
      hw.dst_qpn = q->attr.dest_qp_num;
      g->held.push_back(std::move(hw));
      w.pkt.clear();
      w.st = SendWr::kHeld;
      q->held_block = true;
    } else if (q->held_block || q->blackholed || q->retx_block) {
      if (total > 0 && d->arm_drop > 0) {
        d->arm_drop--;
        w.drops_left = d->drop_tries;
      }
      w.st = SendWr::kQueued;
      if (q->blackholed) w.pkt.clear();
    } else {
      if (total > 0 && d->arm_drop > 0) {
        d->arm_drop--;
        w.drops_left = d->drop_tries;
      }
      transmit_locked(q, &w);
    }
    check_byte_triggers_locked(d);
  }
  if (rc && bad) *bad = wr;
  advance_sq_locked(q);
  return rc;
}

int fv_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  std::lock_guard<std::mutex> l(g->mu);
  Qp* q = reinterpret_cast<QpBox*>(qp)->impl;
  int rc = 0;
  for (; wr; wr = wr->next) {
    if (q->state == IBV_QPS_RESET || wr->num_sge < 0 ||
        wr->num_sge > static_cast<int>(q->cap.max_recv_sge) || (wr->num_sge && !wr->sg_list)) {
      rc = EINVAL;
      break;
    }
    RecvWr r;
    r.wr_id = wr->wr_id;
    r.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
    if (q->state == IBV_QPS_ERR) {
      push_recv_flush(q, r);
      continue;
    }
    if (q->rq.size() >= q->cap.max_recv_wr) {
      rc = ENOMEM;
      break;
    }
    q->rq.push_back(std::move(r));
  }
  if (rc && bad) *bad = wr;
  if (!q->inq.empty()) process_inbound_locked(q);  // a packet may be waiting (RNR)
  return rc;
}
