// The fake NIC: cross-process transport and the per-process NIC thread.
//
// Transport: each process listens on the pathname Unix socket $FAKEVERBS_DIR/nic-<pid>.sock
// (pathname sockets work across network namespaces that share the filesystem). To send to
// the QP dest_qp_num, a requester reads the owner pid from the symlink
// $FAKEVERBS_DIR/qp-<qpn>, connects once to that pid's socket (the connection is reused for
// every QP towards that process) and writes one REQ message per work request: a fixed Hdr
// followed by the payload. The target's NIC thread executes it against its own memory and
// replies with an ACK on the same connection (RDMA READ data rides on the ACK).
//
// Loss comes from the fault state only, never from the clock: a connect that fails (dead
// process), a connection that closes with packets unacknowledged (the peer died), a down port
// at either end, a blackholed QP, a target QP that does not exist, is not in RTR/RTS, or whose
// port address does not match the packet's destination. The target's NIC answers a packet it
// drops with a kAckLost notice (the silence a real requester hears, made explicit), so a
// requester knows which of its packets are lost; one delivered waits for its ACK however late
// the target's NIC thread runs. The retry timer completes the oldest outstanding WR once it is
// lost with IBV_WC_RETRY_EXC_ERR (no retransmission).
//
// The NIC thread polls (ppoll, no spinning) the listening socket, an eventfd used to wake it,
// and every connection; reads without the lock; then, under State::mu, handles the messages,
// flushes pending output, and runs the timers, whose earliest deadline is its next timeout.

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "fake_internal.h"

namespace fv {

namespace {

int g_owner_pid = 0;  // the process whose socket file the exit handler removes

bool make_addr(const std::string& name, sockaddr_un* a) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  std::string full = g->dir + "/" + name;
  if (full.size() < sizeof a->sun_path) {
    memcpy(a->sun_path, full.c_str(), full.size() + 1);
    return true;
  }
  // A long FAKEVERBS_DIR: go through an fd of the directory.
  static int dirfd = -1;
  static int dirfd_pid = 0;
  if (dirfd < 0 || dirfd_pid != getpid()) {
    dirfd = open(g->dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    dirfd_pid = getpid();
    if (dirfd < 0) return false;
    g->owned_fds.push_back(dirfd);
  }
  int n = snprintf(a->sun_path, sizeof a->sun_path, "/proc/self/fd/%d/%s", dirfd, name.c_str());
  return n > 0 && static_cast<size_t>(n) < sizeof a->sun_path;
}

void set_bufs(int fd) {
  int sz = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
}

void kick_at(TimePoint t) {
  if (t < g->nic_wake_at) {
    g->nic_wake_at = t;
    wake_nic();
  }
}

// The RNR NAK timer of encoding `t` (IBA spec, table "Encoding for RNR NAK Timer Field":
// 0 = 655.36 ms, 1 = 0.01 ms ... 12 = 0.64 ms ... 31 = 491.52 ms).
std::chrono::microseconds rnr_delay(uint8_t t) {
  static const double kMs[32] = {655.36, 0.01,  0.02,  0.03,   0.04,   0.06,   0.08,   0.12,
                                 0.16,   0.24,  0.32,  0.48,   0.64,   0.96,   1.28,   1.92,
                                 2.56,   3.84,  5.12,  7.68,   10.24,  15.36,  20.48,  30.72,
                                 40.96,  61.44, 81.92, 122.88, 163.84, 245.76, 327.68, 491.52};
  return std::chrono::microseconds(std::max(
      1ll, static_cast<long long>(kMs[t & 31] * 1000 / static_cast<double>(g->time_scale))));
}

// The file says "there were NAKs" at once (the first one) and is brought up to date at most
// every 100 ms: a target NAKing every 0.64 ms must not spend its NIC thread on file writes
// under the lock. In-process callers read the exact count (fakeverbs_rnr_naks).
void count_rnr_nak_locked(Device* d) {
  ++d->rnr_naks;
  static TimePoint next_write{};
  static int writer_pid = 0;
  const TimePoint now = Clock::now();
  if (writer_pid == getpid() && now < next_write) return;
  writer_pid = getpid();
  next_write = now + std::chrono::milliseconds(100);
  uint64_t total = 0;
  for (const Device* x : g->devices) total += x->rnr_naks;
  const std::string path = g->dir + "/rnr-naks-" + std::to_string(getpid());
  if (FILE* f = fopen(path.c_str(), "w")) {
    fprintf(f, "%llu\n", static_cast<unsigned long long>(total));
    fclose(f);
  }
}

// Writes as much of c->out as the socket takes. Locked.
void flush_conn(Conn* c) {
  while (!c->dead && !c->out.empty()) {
    auto& b = c->out.front();
    ssize_t n =
        send(c->fd, b.data() + c->out_off, b.size() - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c->out_off += static_cast<size_t>(n);
      if (c->out_off == b.size()) {
        c->out.pop_front();
        c->out_off = 0;
      }
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      c->dead = true;  // the NIC thread closes it
      c->out.clear();
      wake_nic();
    }
  }
}

void conn_send(const std::shared_ptr<Conn>& c, std::vector<char> buf) {
  if (c->dead) return;
  bool was_empty = c->out.empty();
  c->out.push_back(std::move(buf));
  if (was_empty) {
    flush_conn(c.get());
    if (!c->out.empty()) wake_nic();  // the NIC thread must poll for POLLOUT
  }
}

std::shared_ptr<Conn> get_outbound(int pid, const Device* dev) {
  auto it = g->outbound.find({pid, dev});
  if (it != g->outbound.end() && !it->second->dead) return it->second;
  sockaddr_un a;
  if (!make_addr("nic-" + std::to_string(pid) + ".sock", &a)) return nullptr;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  set_bufs(fd);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return nullptr;
  }
  auto c = std::make_shared<Conn>();
  c->fd = fd;
  c->peer_pid = pid;
  c->dev = dev;
  g->conns[fd] = c;
  g->outbound[{pid, dev}] = c;
  wake_nic();  // poll the new connection
  return c;
}

void send_ack(const std::shared_ptr<Conn>& c, const Hdr& req, uint32_t from_qpn, uint8_t status,
              const char* data = nullptr, uint32_t len = 0) {
  if (!c) return;
  std::vector<char> b(sizeof(Hdr) + len);
  Hdr h{};
  h.magic = kMagic;
  h.type = kAck;
  h.op = req.op;
  h.status = status;
  h.src_pid = static_cast<uint32_t>(getpid());
  h.src_qpn = from_qpn;
  h.dst_qpn = req.src_qpn;
  h.seq = req.seq;
  h.len = len;
  memcpy(b.data(), &h, sizeof h);
  if (len) memcpy(b.data() + sizeof h, data, len);
  conn_send(c, std::move(b));
}

// Would the fabric and the target port deliver this packet to QP q? (README "Addressing".)
bool addr_matches(const Qp* q, const Hdr& h) {
  const Device* d = q->dev;
  if (d->eth != (h.is_eth != 0)) return false;
  // P_Key check at the target (IBA vol. 1 10.9.3): a mismatch is dropped silently.
  const uint16_t mine = q->attr.pkey_index < d->pkeys.size() ? d->pkeys[q->attr.pkey_index] : 0;
  if (!pkeys_match(h.pkey, mine)) return false;
  // A packet larger than the target port's active MTU is dropped (the requester's port
  // checked its own at transmit). Messages are cut into packets of path_mtu bytes.
  const uint32_t largest = std::min(std::max(h.len, h.rd_len), mtu_bytes(h.path_mtu));
  if (largest > mtu_bytes(d->active_mtu)) return false;
  if (!d->eth && !h.has_grh && d->grh_required) return false;
  if (!d->eth && h.dlid != d->lid) return false;
  if (!h.has_grh) return true;
  // GRH (RoCE: always): the destination GID must be one of the port's, on the VLAN the
  // requester's source GID is on (RoCE frames carry their netdev's VLAN tag).
  for (const auto& e : d->gids)
    if (e.valid && memcmp(e.gid.raw, h.dgid, 16) == 0 && (!d->eth || vlan_of_gid(e) == h.vlan))
      return true;
  return false;
}

// A REQ arrived for one of our QPs. Locked.
void handle_req(const std::shared_ptr<Conn>& c, const Hdr& h, std::vector<char> pay) {
  auto it = g->qps.find(h.dst_qpn);
  if (it == g->qps.end()) return;
  Qp* q = it->second;
  if (!q->dev->active || q->blackholed || (q->state != IBV_QPS_RTR && q->state != IBV_QPS_RTS) ||
      !addr_matches(q, h)) {
    send_ack(c, h, h.dst_qpn, kAckLost);  // lost: no real ACK
    return;
  }
  if (q->gap) {  // after a partial write: out of sequence, discarded
    send_ack(c, h, h.dst_qpn, kAckLost);
    return;
  }
  Inbound in;
  in.h = h;
  in.payload = std::move(pay);
  in.conn = c;
  if (g->delay_us > 0) {
    in.ready_at = Clock::now() + std::chrono::microseconds(random_us_locked(g->delay_us));
    if (!q->inq.empty()) in.ready_at = std::max(in.ready_at, q->inq.back().ready_at);
    kick_at(in.ready_at);
  }
  q->inq.push_back(std::move(in));
  process_inbound_locked(q);
}

void scatter_read(Qp* q, SendWr* w, const std::vector<char>& data) {
  size_t off = 0;
  for (const auto& s : w->read_sges) {
    Mr* m = find_mr(s.lkey);
    if (!m || m->pd != q->pd || s.addr < m->iova || s.addr - m->iova + s.length > m->len) {
      w->status = IBV_WC_LOC_PROT_ERR;
      return;
    }
    size_t n = std::min<size_t>(s.length, data.size() - off);
    if (n) memcpy(m->addr + (s.addr - m->iova), data.data() + off, n);
    off += n;
  }
}

void release_held(HeldWrite hw);

// A sent WR's packet or ACK is lost: its retry timer runs. Locked.
void mark_lost_locked(Qp* q, SendWr* w) {
  if (w->st == SendWr::kRnr) w->st = SendWr::kSent;  // its target is gone: nobody resends it
  if (w->st != SendWr::kSent || w->lost) return;
  w->lost = true;
  long long rt = retry_us(q);
  if (rt >= 0) kick_at(std::max(w->sent_at, q->last_progress) + std::chrono::microseconds(rt));
}

// The connection of device `dev` to process `pid` closed: what its QPs sent there
// unacknowledged is lost.
void peer_gone_locked(int pid, const Device* dev) {
  for (auto& kv : g->qps) {
    Qp* q = kv.second;
    if (q->peer_pid != pid || q->dev != dev) continue;
    q->peer_pid = 0;
    for (auto& w : q->sq) mark_lost_locked(q, &w);
  }
}

// An ACK arrived for one of our QPs. Locked.
void handle_ack(const Hdr& h, const std::vector<char>& pay) {
  auto it = g->qps.find(h.dst_qpn);
  if (it == g->qps.end()) return;
  Qp* q = it->second;
  if (q->state != IBV_QPS_RTS) return;
  SendWr* w = nullptr;
  for (auto& x : q->sq)
    if (x.seq == h.seq && (x.st == SendWr::kSent || x.st == SendWr::kRnr)) w = &x;
  if (!w) return;
  if (!q->dev->active || q->blackholed || h.status == kAckLost) {
    mark_lost_locked(q, w);  // the packet, or this ACK (a down port, a black hole), is lost
    return;
  }
  TimePoint now = Clock::now();
  q->last_progress = now;
  if (q->retx_block && w->tries > 0) {
    // The resent packet got through: what waited behind it goes now (unless another
    // dropped packet still waits).
    bool waiting = false;
    for (auto& x : q->sq) waiting = waiting || (x.retx && &x != w);
    if (!waiting) {
      q->retx_block = false;
      for (auto& x : q->sq) {
        if (q->retx_block || q->held_block || q->blackholed || q->err_pending) break;
        if (x.st == SendWr::kQueued) transmit_locked(q, &x);
      }
    }
  }
  switch (h.status) {
    case kAckOk:
      w->st = SendWr::kDone;
      w->status = IBV_WC_SUCCESS;
      if (w->op == IBV_WR_RDMA_READ) scatter_read(q, w, pay);
      if (w->op == IBV_WR_RDMA_WRITE || w->op == IBV_WR_RDMA_WRITE_WITH_IMM)
        on_write_acked_locked(*w);
      break;
    case kAckRnrWait:
      w->st = SendWr::kRnr;  // the target retries it, or ends it with kAckRnrFail
      return;
    case kAckRnrFail:
      w->st = SendWr::kDone;
      w->status = IBV_WC_RNR_RETRY_EXC_ERR;
      break;
    case kAckRemAccess:
      w->st = SendWr::kDone;
      w->status = IBV_WC_REM_ACCESS_ERR;
      break;
    case kAckRemInv:
      w->st = SendWr::kDone;
      w->status = IBV_WC_REM_INV_REQ_ERR;
      break;
    default:
      w->st = SendWr::kDone;
      w->status = IBV_WC_REM_OP_ERR;
      break;
  }
  advance_sq_locked(q);
}

void push_recv_cqe(Qp* q, const RecvWr& r, ibv_wc_status st, ibv_wc_opcode op, uint32_t len,
                   const Hdr& h, bool imm) {
  ibv_wc wc{};
  wc.wr_id = r.wr_id;
  wc.status = st;
  wc.opcode = op;
  wc.byte_len = len;
  wc.qp_num = q->qpn;
  wc.src_qp = h.src_qpn;
  wc.slid = h.slid;
  if (imm && st == IBV_WC_SUCCESS) {
    wc.wc_flags = IBV_WC_WITH_IMM;
    wc.imm_data = h.imm;
  }
  if (g->recv_lag_us > 0 || !q->lagged.empty()) {
    const TimePoint now = Clock::now();
    TimePoint due = now + std::chrono::microseconds(random_us_locked(g->recv_lag_us));
    if (!q->lagged.empty()) due = std::max(due, q->lagged.back().first);
    q->lagged.emplace_back(due, wc);
    wake_nic();
    return;
  }
  push_cqe(q->rcq, wc);
}

}  // namespace

void release_lagged_locked(Qp* q, TimePoint until) {
  while (!q->lagged.empty() && q->lagged.front().first <= until) {
    push_cqe(q->rcq, q->lagged.front().second);
    q->lagged.pop_front();
  }
}

namespace {

// Runs due retry / RNR timers; returns the next deadline. Locked.
TimePoint run_qp_timers(TimePoint now) {
  TimePoint next = kNever;
  for (auto& kv : g->qps) {
    Qp* q = kv.second;
    release_lagged_locked(q, now);
    if (!q->lagged.empty()) next = std::min(next, q->lagged.front().first);
    if (q->retx_block && q->state == IBV_QPS_RTS) {
      // Retransmission of dropped packets, one local ACK timeout after each try.
      const long long t = one_try_us(q);
      for (auto& w : q->sq) {
        if (w.st != SendWr::kSent || !w.retx || w.lost || t < 0) continue;
        const TimePoint due = w.sent_at + std::chrono::microseconds(t);
        if (due > now) {
          next = std::min(next, due);
          continue;
        }
        if (w.tries >= static_cast<int>(q->attr.retry_cnt)) {
          w.retx = false;
          w.st = SendWr::kDone;
          w.status = IBV_WC_RETRY_EXC_ERR;
          continue;
        }
        w.tries++;
        transmit_locked(q, &w);
        if (w.retx) next = std::min(next, w.sent_at + std::chrono::microseconds(t));
      }
      advance_sq_locked(q);
      if (q->state != IBV_QPS_RTS) continue;
    }
    if (q->state == IBV_QPS_RTS && !q->blackholed && !q->sq.empty()) {
      SendWr& w = q->sq.front();
      TimePoint dl = kNever;
      ibv_wc_status st = IBV_WC_RETRY_EXC_ERR;
      if (w.st == SendWr::kSent && w.lost) {
        long long rt = retry_us(q);
        if (rt >= 0) dl = std::max(w.sent_at, q->last_progress) + std::chrono::microseconds(rt);
      }
      if (dl <= now) {
        w.st = SendWr::kDone;
        w.status = st;
        advance_sq_locked(q);
      } else {
        next = std::min(next, dl);
      }
    }
    const bool receiving = q->state == IBV_QPS_RTR || q->state == IBV_QPS_RTS;
    if (receiving && !q->inq.empty() && q->inq.front().rnr_notified) {
      if (q->inq.front().retry_at <= now) process_inbound_locked(q);  // the retransmission
      if (!q->inq.empty() && q->inq.front().rnr_notified)
        next = std::min(next, q->inq.front().retry_at);
    }
    if (receiving && !q->inq.empty() && !q->inq.front().rnr_notified &&
        q->inq.front().ready_at != TimePoint{}) {  // FAKEVERBS_DELAY_US
      if (q->inq.front().ready_at <= now) process_inbound_locked(q);
      if (!q->inq.empty() && !q->inq.front().rnr_notified && q->inq.front().ready_at > now)
        next = std::min(next, q->inq.front().ready_at);
    }
  }
  return next;
}

bool read_conn(Conn* c, std::vector<std::pair<Hdr, std::vector<char>>>* msgs) {
  for (int budget = 0; budget < 256; ++budget) {
    ssize_t n;
    bool in_hdr = c->in_hgot < sizeof(Hdr);
    if (in_hdr)
      n = read(c->fd, reinterpret_cast<char*>(&c->in_hdr) + c->in_hgot, sizeof(Hdr) - c->in_hgot);
    else
      n = read(c->fd, c->in_pay.data() + c->in_pgot, c->in_pay.size() - c->in_pgot);
    if (n == 0) return false;
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
    if (in_hdr) {
      c->in_hgot += static_cast<size_t>(n);
      if (c->in_hgot < sizeof(Hdr)) continue;
      if (c->in_hdr.magic != kMagic || c->in_hdr.len > kMaxMsg) return false;
      c->in_pay.assign(c->in_hdr.len, 0);
      c->in_pgot = 0;
    } else {
      c->in_pgot += static_cast<size_t>(n);
    }
    if (c->in_hgot == sizeof(Hdr) && c->in_pgot == c->in_pay.size()) {
      msgs->emplace_back(c->in_hdr, std::move(c->in_pay));
      c->in_pay = {};
      c->in_hgot = c->in_pgot = 0;
    }
  }
  return true;
}

void nic_main() {
  // A real HCA answers whatever the host's CPUs do; this thread is the fake's HCA, so it runs
  // ahead of ordinary work where the process may raise its priority (root, as in CI): on a
  // 2-core machine beside a parallel build, a NIC thread at nice 0 was seen silent for
  // 600 ms, which the plugin rightly reads as a dead path. Best effort: failure is ignored.
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), -10);
  struct Msg {
    std::shared_ptr<Conn> c;
    Hdr h;
    std::vector<char> pay;
  };
  std::vector<pollfd> pfds;
  std::vector<std::shared_ptr<Conn>> pc;  // parallel to pfds[2..]
  std::vector<Msg> msgs;
  std::vector<int> accepted;
  std::vector<std::shared_ptr<Conn>> broken, writable;
  State* s = g;
  for (;;) {
    TimePoint dl;
    TimePoint now;
    {
      std::lock_guard<std::mutex> l(s->mu);
      for (int fd : accepted) {
        auto c = std::make_shared<Conn>();
        c->fd = fd;
        s->conns[fd] = c;
      }
      for (auto& m : msgs) {
        if (m.h.type == kReq)
          handle_req(m.c, m.h, std::move(m.pay));
        else if (m.h.type == kAck)
          handle_ack(m.h, m.pay);
      }
      for (auto& c : broken) c->dead = true;
      for (auto& c : writable) flush_conn(c.get());
      accepted.clear();
      msgs.clear();
      broken.clear();
      writable.clear();
      for (auto it = s->conns.begin(); it != s->conns.end();) {
        auto& c = it->second;
        if (!c->dead) {
          ++it;
          continue;
        }
        auto ob = s->outbound.find({c->peer_pid, c->dev});
        if (c->peer_pid && ob != s->outbound.end() && ob->second == c) {
          s->outbound.erase(ob);
          peer_gone_locked(c->peer_pid, c->dev);
        }
        close(c->fd);
        c->fd = -1;
        it = s->conns.erase(it);
      }
      now = Clock::now();
      dl = std::min(run_qp_timers(now), run_fault_timers_locked(now));
      s->nic_wake_at = dl;
      pfds.assign(2, pollfd{});
      pfds[0] = {s->wake_fd, POLLIN, 0};
      pfds[1] = {s->listen_fd, POLLIN, 0};
      pc.clear();
      for (auto& kv : s->conns) {
        short ev = POLLIN;
        if (!kv.second->out.empty()) ev |= POLLOUT;
        pfds.push_back({kv.first, ev, 0});
        pc.push_back(kv.second);
      }
    }
    timespec ts{};
    timespec* tsp = nullptr;
    if (dl != kNever) {
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(dl - now).count();
      if (ns < 0) ns = 0;
      ts.tv_sec = ns / 1000000000;
      ts.tv_nsec = ns % 1000000000;
      tsp = &ts;
    }
    int r = ppoll(pfds.data(), pfds.size(), tsp, nullptr);
    if (r <= 0) continue;
    if (pfds[0].revents) {
      uint64_t v;
      while (read(s->wake_fd, &v, sizeof v) > 0) {
      }
    }
    if (pfds[1].revents) {
      for (;;) {
        int fd = accept4(s->listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        set_bufs(fd);
        accepted.push_back(fd);
      }
    }
    for (size_t i = 2; i < pfds.size(); ++i) {
      Conn* c = pc[i - 2].get();
      short re = pfds[i].revents;
      if (re & (POLLIN | POLLHUP | POLLERR)) {
        std::vector<std::pair<Hdr, std::vector<char>>> got;
        bool ok = read_conn(c, &got);
        for (auto& x : got) msgs.push_back(Msg{pc[i - 2], x.first, std::move(x.second)});
        if (!ok) broken.push_back(pc[i - 2]);
      }
      if (re & POLLOUT) writable.push_back(pc[i - 2]);
    }
  }
}

void unlink_socket_at_exit() {
  if (g_owner_pid == getpid() && !g->sock_path.empty()) unlink(g->sock_path.c_str());
}

void release_held(HeldWrite hw) {
  auto it = g->qps.find(hw.src_qpn);
  int pid = lookup_qp_owner(hw.dst_qpn);
  const bool delivered =
      pid > 0 && it != g->qps.end() && send_packet_locked(pid, it->second->dev, std::move(hw.pkt));
  if (it == g->qps.end()) return;
  Qp* q = it->second;
  if (q->state != IBV_QPS_RTS) return;
  bool mine = false;  // the WR may be gone (flushed, QP reset and reused)
  for (auto& w : q->sq) mine = mine || (w.seq == hw.seq && w.st == SendWr::kHeld);
  if (!mine) return;
  bool still_held = false;
  for (auto& w : q->sq) {
    if (w.seq == hw.seq && w.st == SendWr::kHeld) {
      w.st = SendWr::kSent;
      w.sent_at = Clock::now();
      if (!delivered) mark_lost_locked(q, &w);
    } else if (w.st == SendWr::kHeld) {
      still_held = true;
      break;
    } else if (w.st == SendWr::kQueued && !q->blackholed && !q->err_pending) {
      transmit_locked(q, &w);
    }
  }
  q->held_block = still_held;
}

}  // namespace

void wake_nic() {
  if (g->wake_fd < 0) return;
  uint64_t one = 1;
  ssize_t r = write(g->wake_fd, &one, sizeof one);
  (void)r;
}

void start_nic_locked() {
  if (g->nic_started) return;
  sockaddr_un a;
  std::string name = "nic-" + std::to_string(getpid()) + ".sock";
  g->sock_path = g->dir + "/" + name;
  if (!make_addr(name, &a)) {
    fprintf(stderr, "fakeverbs: cannot form a socket address under %s\n", g->dir.c_str());
    return;
  }
  unlink(a.sun_path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(fd, 512) != 0) {
    fprintf(stderr, "fakeverbs: cannot listen on %s: %s\n", g->sock_path.c_str(), strerror(errno));
    if (fd >= 0) close(fd);
    return;
  }
  g->listen_fd = fd;
  g->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  g->owned_fds.push_back(fd);
  g->owned_fds.push_back(g->wake_fd);
  static bool registered = false;
  if (!registered) {
    registered = true;
    atexit(unlink_socket_at_exit);
  }
  g_owner_pid = getpid();
  std::thread(nic_main).detach();
  g->nic_started = true;
}

int lookup_qp_owner(uint32_t qpn) {
  char buf[32];
  std::string p = g->dir + "/qp-" + std::to_string(qpn);
  ssize_t n = readlink(p.c_str(), buf, sizeof buf - 1);
  if (n <= 0) return -1;
  buf[n] = 0;
  return atoi(buf);
}

void preconnect_locked(Qp* q) {
  const int pid = lookup_qp_owner(q->attr.dest_qp_num);
  if (pid > 0 && get_outbound(pid, q->dev)) q->peer_pid = pid;
}

bool send_packet_locked(int pid, const Device* dev, std::vector<char> pkt) {
  auto c = get_outbound(pid, dev);
  if (!c) return false;
  conn_send(c, std::move(pkt));
  return true;
}

void transmit_locked(Qp* q, SendWr* w) {
  w->st = SendWr::kSent;
  w->sent_at = Clock::now();
  w->lost = false;
  w->retx = false;
  if (w->drops_left > 0) {  // fault drop: lost on the wire this time; resent after one try
    w->drops_left--;
    w->retx = true;
    q->retx_block = true;
    const long long t = one_try_us(q);
    if (t >= 0) kick_at(w->sent_at + std::chrono::microseconds(t));
    return;
  }
  std::vector<char> pkt = std::move(w->pkt);
  w->pkt = {};
  int pid = -1;
  // A packet larger than this port's active MTU never leaves it.
  const Hdr* hp = pkt.size() >= sizeof(Hdr) ? reinterpret_cast<const Hdr*>(pkt.data()) : nullptr;
  const bool mtu_ok = !hp || std::min(std::max(hp->len, hp->rd_len), mtu_bytes(hp->path_mtu)) <=
                                 mtu_bytes(q->dev->active_mtu);
  if (q->dev->active && mtu_ok)  // else lost on a down port
    pid = q->peer_pid > 0 ? q->peer_pid : lookup_qp_owner(q->attr.dest_qp_num);
  if (pid > 0 && send_packet_locked(pid, q->dev, std::move(pkt))) {
    q->peer_pid = pid;
    return;
  }
  q->peer_pid = 0;  // no such QP anywhere, or a dead process
  mark_lost_locked(q, w);
}

void process_inbound_locked(Qp* q) {
  while (!q->inq.empty() && (q->state == IBV_QPS_RTR || q->state == IBV_QPS_RTS)) {
    Inbound& in = q->inq.front();
    const Hdr& h = in.h;
    auto op = static_cast<ibv_wr_opcode>(h.op);
    if (in.ready_at != TimePoint{} && in.ready_at > Clock::now()) return;  // not yet
    if (q->gap) {
      send_ack(in.conn, h, q->qpn, kAckLost);
      q->inq.pop_front();
      continue;
    }
    bool needs_recv =
        op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_WRITE_WITH_IMM;
    bool rdma =
        op == IBV_WR_RDMA_WRITE || op == IBV_WR_RDMA_WRITE_WITH_IMM || op == IBV_WR_RDMA_READ;
    uint8_t st = kAckOk;
    Mr* m = nullptr;
    uint32_t len = op == IBV_WR_RDMA_READ ? h.rd_len : h.len;
    if (!rdma && !needs_recv) st = kAckRemInv;
    if (rdma && len > 0) {  // a zero-length RDMA op checks no key (a probe)
      int need = op == IBV_WR_RDMA_READ ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE;
      m = find_mr(h.rkey);
      if (!m || m->pd != q->pd || !(m->access & need) || !(q->attr.qp_access_flags & need) ||
          h.raddr < m->iova || h.raddr - m->iova > m->len || len > m->len - (h.raddr - m->iova))
        st = kAckRemAccess;
    }
    if (st == kAckOk && needs_recv) {
      const TimePoint now = Clock::now();
      if (in.rnr_notified && now < in.retry_at) return;  // the requester has not resent it yet
      if (q->rq.empty()) {  // receiver not ready: an RNR NAK (hold the packet as if resent)
        ++in.rnr_naks;
        count_rnr_nak_locked(q->dev);
        if (h.rnr_retry != 7 && in.rnr_naks > static_cast<int>(h.rnr_retry)) {
          send_ack(in.conn, h, q->qpn, kAckRnrFail);
          q->inq.clear();  // the requester's QP goes to ERR: what followed is discarded
          return;
        }
        if (!in.rnr_notified) send_ack(in.conn, h, q->qpn, kAckRnrWait);
        in.rnr_notified = true;
        in.retry_at = now + rnr_delay(q->attr.min_rnr_timer);
        kick_at(in.retry_at);
        return;
      }
      in.rnr_notified = false;
    }
    std::vector<char> resp;
    bool recv_failed = false;
    if (st == kAckOk) {
      if ((op == IBV_WR_RDMA_WRITE || op == IBV_WR_RDMA_WRITE_WITH_IMM) && len >= 2 &&
          q->dev->arm_partial > 0) {
        // The link died mid-message: the first packets landed, the rest never came. No
        // completion, no ACK; what follows on this QP is out of sequence.
        q->dev->arm_partial--;
        memcpy(m->addr + (h.raddr - m->iova), in.payload.data(), len / 2);
        q->gap = true;
        send_ack(in.conn, h, q->qpn, kAckLost);
        q->inq.pop_front();
        continue;
      }
      if ((op == IBV_WR_RDMA_WRITE || op == IBV_WR_RDMA_WRITE_WITH_IMM) && len) {
        char* dst = m->addr + (h.raddr - m->iova);
        if (m->cow_lost) {
          // the HCA writes the page the child got at fork: this process never sees it
        } else if (g->fence && (m->access & IBV_ACCESS_RELAXED_ORDERING))
          q->dev->fenced.push_back(FencedWrite{dst, std::move(in.payload), m});
        else
          memcpy(dst, in.payload.data(), len);
      }
      if (op == IBV_WR_RDMA_READ) apply_fenced_locked(q->dev);  // a flush through this device
      if (op == IBV_WR_RDMA_READ && len)
        resp.assign(m->addr + (h.raddr - m->iova), m->addr + (h.raddr - m->iova) + len);
      if (needs_recv) {
        RecvWr r = std::move(q->rq.front());
        q->rq.pop_front();
        if (op == IBV_WR_RDMA_WRITE_WITH_IMM) {
          push_recv_cqe(q, r, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, len, h, true);
        } else {
          uint64_t cap = 0;
          for (const auto& s : r.sges) cap += s.length;
          ibv_wc_status rs = IBV_WC_SUCCESS;
          if (len > cap) {
            rs = IBV_WC_LOC_LEN_ERR;
            st = kAckRemInv;
          } else {
            size_t off = 0;
            for (const auto& s : r.sges) {
              if (off >= len) break;
              Mr* rm = find_mr(s.lkey);
              if (!rm || rm->pd != q->pd || !(rm->access & IBV_ACCESS_LOCAL_WRITE) ||
                  s.addr < rm->iova || s.addr - rm->iova + s.length > rm->len) {
                rs = IBV_WC_LOC_PROT_ERR;
                st = kAckRemOp;
                break;
              }
              size_t n = std::min<size_t>(s.length, len - off);
              if (!rm->cow_lost)  // else the child's copy of the page gets it
                memcpy(rm->addr + (s.addr - rm->iova), in.payload.data() + off, n);
              off += n;
            }
          }
          push_recv_cqe(q, r, rs, IBV_WC_RECV, len, h, op == IBV_WR_SEND_WITH_IMM);
          recv_failed = rs != IBV_WC_SUCCESS;
        }
      }
    }
    send_ack(in.conn, h, q->qpn,
             st == kAckOk && q->dev->ack_loss ? static_cast<uint8_t>(kAckLost) : st, resp.data(),
             static_cast<uint32_t>(resp.size()));
    q->inq.pop_front();
    if (recv_failed) {
      qp_to_error_locked(q);
      return;
    }
  }
}

void apply_fenced_locked(Device* d, const Mr* only) {
  for (auto it = d->fenced.begin(); it != d->fenced.end();) {
    if (only && it->mr != only) {
      ++it;
      continue;
    }
    memcpy(it->dst, it->data.data(), it->data.size());
    it = d->fenced.erase(it);
  }
}

void on_write_acked_locked(const SendWr& w) {
  std::vector<HeldWrite> release;
  for (auto it = g->held.begin(); it != g->held.end();) {
    bool overlap = w.ordinal > it->ordinal &&
                   (it->len == 0 ? (w.raddr <= it->raddr && it->raddr < w.raddr + w.len)
                                 : (w.raddr < it->raddr + it->len && it->raddr < w.raddr + w.len));
    if (overlap && ++it->acked >= it->k) {
      release.push_back(std::move(*it));
      it = g->held.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& hw : release) release_held(std::move(hw));
}

}  // namespace fv
