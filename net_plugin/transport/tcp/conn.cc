#include "transport/tcp/conn.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <string_view>

#include "engine/link_live.h"
#include "engine/path_plan.h"
#include "fault/fault_injector.h"
#include "r2ccl/log.h"
#include "r2ccl/random.h"
#include "sock/socket_util.h"
#include "sock/tcp_info.h"
#include "transport/tcp/runtime.h"

namespace r2ccl::net::tcp {
namespace {

constexpr size_t kDiscardBytes = 64 * 1024;
constexpr TimeUs kPathHandshakeTimeout = 1 * kUsPerSec;
constexpr int kFramesPerRead = 32;  // bound the work of one progress call per stream
constexpr uint64_t kBytesPerRead = 8ull << 20;
constexpr size_t kCtrlBatch = 32;     // control frames (40 B headers) per system call
constexpr size_t kStageBytes = 4096;  // a stream's read stage: headers and small payloads

FrameHeader frame(FrameType t) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint8_t>(t);
  return h;
}

sockaddr_storage wire_to_sockaddr(uint8_t family, const uint8_t* addr, uint16_t port_net) {
  sockaddr_storage s{};
  if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&s);
    a->sin6_family = AF_INET6;
    memcpy(&a->sin6_addr, addr, 16);
    a->sin6_port = port_net;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&s);
    a->sin_family = AF_INET;
    memcpy(&a->sin_addr, addr, 4);
    a->sin_port = port_net;
  }
  return s;
}

std::string wire_name(const WireRail& w) {
  char name[sizeof(w.name) + 1] = {};
  memcpy(name, w.name, sizeof(w.name));
  return name;
}

// A peer rail's address, without port ("10.0.0.2", "fd00::2").
std::string rail_addr_string(const WireRail& w) {
  return addr_to_string(wire_to_sockaddr(w.family, w.addr, 0));
}

// Warn once per process and message (missing rails are reported per rail, not per connection).
void warn_once(const std::string& msg) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lk(mu);
  if (seen.insert(msg).second) R2CCL_WARN("%s", msg.c_str());
}

}  // namespace

// ------------------------------------------------------------------------------------------
Listen::Listen(Runtime* r, int d) : rt(r) {
  dev = d;
  rt->new_identity(this);
  rt->register_listen(this);
}

Listen::~Listen() {
  rt->unregister_listen(this);
  std::lock_guard<std::mutex> lk(inbox_mu);
  for (auto& in : inbox) ::close(in.fd);
  inbox.clear();
}

// ------------------------------------------------------------------------------------------
Conn::Conn(Runtime* rt, Role role, int dev)
    : rt_(rt), cfg_(rt->cfg()), role_(role), dev_(dev), discard_(kDiscardBytes) {
  n_streams_ = static_cast<int>(cfg_.nsocks_per_path);
  backups_ = static_cast<int>(cfg_.backup_paths);
  // The sender cuts messages into the connection's chunk size (the smaller of both ends'
  // R2CCL_CHUNK_SIZE, negotiated at setup); the receiver places chunks by the offsets in
  // their headers.
  chunk_size_ = static_cast<uint64_t>(cfg_.chunk_size);
}

Conn::Conn(Runtime* rt, const WireHandle& h, int dev) : Conn(rt, Role::kSend, dev) { handle_ = h; }

Conn::Conn(Runtime* rt, Listen* listen) : Conn(rt, Role::kRecv, listen->dev) { listen_ = listen; }

Conn::~Conn() { close_all(); }

void Conn::close_all() {
  if (peer_check_fd_ >= 0) ::close(peer_check_fd_);
  peer_check_fd_ = -1;
  for (auto& p : paths_) {
    close_streams(p);
    for (auto& hs : p.reconnect)
      if (hs.fd >= 0) ::close(hs.fd);
    p.reconnect.clear();
  }
  if (control_hs_.fd >= 0) ::close(control_hs_.fd);
  control_hs_.fd = -1;
  for (auto& hs : setup_hs_)
    if (hs.fd >= 0) ::close(hs.fd);
  setup_hs_.clear();
  std::lock_guard<std::mutex> lk(inbox_mu_);
  for (auto& in : inbox_) ::close(in.fd);
  inbox_.clear();
}

std::string Conn::rail_name(int r) const {
  const auto& rails = rt_->rails();
  return r >= 0 && r < static_cast<int>(rails.size()) ? rails[r].name : std::string("?");
}

void Conn::close_streams(Path& p) {
  for (auto& s : p.streams) {
    if (s.fd >= 0) ::close(s.fd);
    s = Stream{};
  }
  p.attached = 0;
}

// ------------------------------------------------------------------------------------------
// Handshakes (connector side): connect, send HELLO, read HELLO_ACK.

void Conn::start_handshake(Handshake* hs, int local_rail, int peer_rail, uint32_t flags,
                           uint32_t gen, TimeUs now, const Rail* local) {
  sockaddr_storage peer;
  if (peer_rail >= 0) {
    const WireRail& w = peer_rails_[peer_rail];
    peer = wire_to_sockaddr(w.family, w.addr, w.port);
  } else {
    const WireEndpoint& e = handle_.endpoints[control_candidate_ % handle_.n_endpoints];
    peer = wire_to_sockaddr(e.family, e.addr, e.port);
  }
  hs->stage = 0;
  hs->off = hs->got = 0;
  hs->err = 0;
  hs->op = SockOp::kConnect;
  hs->refused = false;
  hs->note.clear();
  hs->deadline = now + kPathHandshakeTimeout;
  hs->what = rail_name(local_rail) + " -> " + addr_port_string(peer);
  if (FaultInjector::instance().query(local_rail, now).down) {
    hs->stage = -1;
    hs->err = ENETUNREACH;
    return;
  }
  SockFailure why;
  hs->fd =
      open_rail_socket(local ? *local : rt_->rail_now(local_rail), cfg_.tcp_user_timeout, &why);
  if (hs->fd < 0) {
    hs->stage = -1;
    hs->err = why.err;  // as the kernel said it (EMFILE, EADDRNOTAVAIL, ...), classified later
    hs->op = why.op;
    return;
  }
  int rc = start_connect(hs->fd, peer);
  if (rc < 0) {
    hs->stage = -1;
    hs->err = -rc;
    return;
  }
  FrameHeader h = frame(FrameType::kHello);
  h.len = sizeof(HelloBody);
  h.a = kWireVersion;
  HelloBody b{};
  memcpy(b.secret, secret_, 16);
  b.listen_id = listen_id_;
  b.conn_id = conn_id_;
  b.path = static_cast<uint32_t>(hs->path);
  b.stream = static_cast<uint32_t>(hs->stream);
  b.n_paths = static_cast<uint32_t>(paths_.size());
  b.n_streams = static_cast<uint32_t>(n_streams_);
  b.flags = flags;
  b.generation = gen;
  b.rail = static_cast<uint32_t>(local_rail);
  b.knobs = rt_->knobs();
  rt_->fill_wire_rails(&b);
  hs->out.resize(sizeof(h) + sizeof(b));
  memcpy(hs->out.data(), &h, sizeof(h));
  memcpy(hs->out.data() + sizeof(h), &b, sizeof(b));
}

bool Conn::Handshake::out_of_resources() const {
  return refused && refusal.reason == static_cast<uint8_t>(Refusal::kNoResources);
}

bool Conn::Handshake::cannot_heal() const {
  return out_of_resources() || (!refused && classify_errno(err, op) == ErrClass::kPermanent);
}

std::string Conn::Handshake::cause() const {
  if (!note.empty()) return note;
  if (refused) return std::string("refused by the peer: ") + refusal.text;
  if (err == 0) return "no answer";
  const std::string d = describe_errno(err, op);
  return op == SockOp::kSocket || op == SockOp::kBind ? std::string(sock_op_name(op)) + "(): " + d
                                                      : d;
}

// 1 done, 0 pending, -1 failed (hs->err and hs->op, or hs->refused).
int Conn::step_handshake(Handshake* hs, int local_rail, TimeUs now) {
  if (hs->stage < 0) return -1;
  auto fault = FaultInjector::instance().query(local_rail, now);
  if (fault.down) {
    hs->err = ENETUNREACH;
    return -1;
  }
  if (now > hs->deadline) {
    hs->err = ETIMEDOUT;
    return -1;
  }
  if (hs->stage == 0) {
    int rc = finish_connect(hs->fd);
    if (rc == -EINPROGRESS) return 0;
    if (rc < 0) {
      hs->err = -rc;
      return -1;
    }
    hs->stage = 1;
  }
  if (fault.blackhole) return 0;
  hs->op = SockOp::kIo;
  if (hs->stage == 1) {
    while (hs->off < hs->out.size()) {
      ssize_t n = ::send(hs->fd, hs->out.data() + hs->off, hs->out.size() - hs->off, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        hs->err = errno;
        return -1;
      }
      hs->off += static_cast<size_t>(n);
    }
    hs->stage = 2;
  }
  // The answer: a HELLO_ACK, or a refusal naming why (then the listener closes).
  for (;;) {
    const size_t want = looks_like_refusal(hs->in, hs->got) ? sizeof(WireRefusal) : sizeof(hs->in);
    if (hs->got >= want) break;
    ssize_t n = ::recv(hs->fd, hs->in + hs->got, want - hs->got, 0);
    if (n == 0) {
      hs->err = ECONNRESET;
      return -1;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      hs->err = errno;
      return -1;
    }
    hs->got += static_cast<size_t>(n);
    if (!looks_like_refusal(hs->in, hs->got) && hs->got >= sizeof(FrameHeader)) {
      FrameHeader h;
      memcpy(&h, hs->in, sizeof(h));
      if (h.magic != kFrameMagic || h.type != static_cast<uint8_t>(FrameType::kHelloAck) ||
          h.len != sizeof(HelloBody) || h.a != kWireVersion) {
        hs->err = EPROTO;
        return -1;
      }
    }
  }
  if (looks_like_refusal(hs->in, hs->got)) {
    hs->err = EPROTO;
    hs->refused = read_refusal(hs->in, hs->got, &hs->refusal);
    return -1;
  }
  HelloBody b;
  memcpy(&b, hs->in + sizeof(FrameHeader), sizeof(b));
  if (!secrets_equal(b.secret, secret_, 16) || b.n_rails == 0 || b.n_rails > kMaxRails) {
    hs->err = EACCES;
    return -1;
  }
  hs->stage = 3;
  return 1;
}

// ------------------------------------------------------------------------------------------
// Path plan (engine/path_plan.h): the primary on rail dev_, backups on other rails (another
// interface before an alias of the primary's), each matched to a peer rail on the same subnet
// (the same index first; by index when no rail pair shares a subnet).
Status Conn::plan_paths(const HelloBody& peer, int control_rail, int control_peer_rail,
                        TimeUs now) {
  (void)now;
  const auto& rails = rt_->rails();
  const int nl = static_cast<int>(rails.size());
  const int np = static_cast<int>(peer.n_rails);
  peer_rails_.assign(peer.rails, peer.rails + np);
  auto subnet = [&](int l, int p) {
    const WireRail& w = peer_rails_[p];
    return same_subnet(rails[l].family, addr_bytes(rails[l].addr), rails[l].prefix_len, w.family,
                       w.addr, w.prefix_len);
  };
  bool any_shared = false;
  for (int l = 0; l < nl; ++l)
    for (int p = 0; p < np; ++p) any_shared |= subnet(l, p);
  auto score = [&](int l, int p) {
    if (!any_shared) return p == l ? 1 : 0;
    if (!subnet(l, p)) return 0;
    return p == l ? 2 : 1;
  };
  // Report rails without a counterpart once per process.
  for (int l = 0; l < nl; ++l) {
    bool found = false;
    for (int p = 0; p < np && !found; ++p) found = score(l, p) > 0;
    if (!found)
      warn_once("rail " + rails[l].name +
                " has no peer rail on its subnet; it is not used for "
                "connections to that peer");
  }
  for (int p = 0; p < np; ++p) {
    bool found = false;
    for (int l = 0; l < nl && !found; ++l) found = score(l, p) > 0;
    if (!found)
      warn_once("peer rail " + wire_name(peer_rails_[p]) +
                " has no local rail on its subnet; it is not used");
  }
  const int want = 1 + backups_;
  // Nearest: another interface first (an alias shares the primary's NIC and fails with it).
  std::vector<int> order = order_rails(dev_, nl, nl, [&](int r) {
    bool reachable = false;
    for (int p = 0; p < np && !reachable; ++p) reachable = score(r, p) > 0;
    if (!reachable && r != control_rail) return -1;
    return rails[r].ifname == rails[dev_].ifname ? 1 : 0;
  });
  std::vector<RailPair> pairs =
      pair_rails(static_cast<int>(order.size()), np, true, [&](int i, int p) {
        if (order[i] == control_rail) return p == control_peer_rail ? 1 : 0;
        return score(order[i], p);
      });
  std::vector<std::pair<int, int>> plan;
  for (const auto& pr : pairs) {
    if (static_cast<int>(plan.size()) >= want) break;
    plan.push_back({order[pr.local], pr.peer});
  }
  // The control connection's rail pair is known to work: it is always in the plan.
  bool has_control = false;
  for (auto& e : plan) has_control |= e.first == control_rail;
  if (!has_control) {
    if (plan.empty() || static_cast<int>(plan.size()) < want)
      plan.push_back({control_rail, control_peer_rail});
    else
      plan.back() = {control_rail, control_peer_rail};
  }
  if (plan.size() < 2)
    warn_once("connections on device " + std::to_string(dev_) + " (" + rails[dev_].name +
              ") have no backup path: a failure of that rail fails them");
  paths_.clear();
  paths_.resize(plan.size());
  paths_desc_.assign(plan.size(), PathDesc{});
  for (size_t i = 0; i < plan.size(); ++i) {
    Path& p = paths_[i];
    p.index = static_cast<int>(i);
    desc(p).rail = plan[i].first;
    p.peer_rail = plan[i].second;
    desc(p).label = rails[rail_of(p)].name + " -> " + wire_name(peer_rails_[p.peer_rail]);
    p.streams.resize(n_streams_);
    p.reset_seen = FaultInjector::instance().query(rail_of(p), now).reset_epoch;
  }
  return Status::kOk;
}

// ------------------------------------------------------------------------------------------
Status Conn::setup_step(bool* done, TimeUs now) {
  return role_ == Role::kSend ? connect_step(done, now) : accept_step(done, now);
}

// A setup that cannot heal: the WARN names the device, the rail, the peer's address and the
// cause (the refusal's text, or the errno with the limit involved).
Status Conn::setup_failed(const Handshake& hs, const char* what) {
  const auto& rails = rt_->rails();
  R2CCL_WARN("connect on device %d (%s) failed: %s %s: %s; not retried", dev_,
             rails[dev_].name.c_str(), what, hs.what.c_str(), hs.cause().c_str());
  if (hs.refused) return refusal_status(static_cast<Refusal>(hs.refusal.reason));
  // A local limit or permission (socket, bind, connect) is this host's; a malformed answer
  // (EPROTO, a secret not echoed) is the peer's.
  return hs.op == SockOp::kIo ? Status::kRemote : Status::kSystem;
}

Status Conn::connect_step(bool* done, TimeUs now) {
  *done = false;
  const auto& rails = rt_->rails();
  if (setup_stage_ == 0) {
    memcpy(secret_, handle_.secret, 16);
    listen_id_ = handle_.listen_id;
    conn_id_ = rt_->random_u64();
    setup_start_ = now;
    setup_stage_ = 1;
    control_candidate_ = 0;
    control_hs_.fd = -1;
    control_hs_.stage = -1;
    control_hs_.err = 0;
  }
  if (now - setup_start_ > cfg_.connect_timeout) {
    const int err = control_hs_.err ? control_hs_.err : control_last_err_;
    R2CCL_WARN(
        "connect on device %d (%s) gave up after %.1f s: no endpoint of the peer answered "
        "(last: %s: %s)",
        dev_, rails[dev_].name.c_str(), cfg_.connect_timeout / 1e6, control_hs_.what.c_str(),
        err ? strerror(err) : "no answer");
    return Status::kRemote;
  }
  if (setup_stage_ == 1) {
    // The control connection: try the handle's endpoints in turn from the matching local rail.
    if (control_hs_.fd < 0 && control_hs_.stage == -1 && control_hs_.err == 0) {
      // Failed attempts back off (10 ms doubling to 1 s), so a peer that is unreachable for a
      // while is not flooded with connections until the connect timeout.
      if (now < control_retry_at_) return Status::kOk;
      const WireEndpoint& e = handle_.endpoints[control_candidate_ % handle_.n_endpoints];
      int local = dev_;
      auto on = [&](int l) {
        return same_subnet(rails[l].family, addr_bytes(rails[l].addr), rails[l].prefix_len,
                           e.family, e.addr, 32) ||
               same_subnet(rails[l].family, addr_bytes(rails[l].addr), rails[l].prefix_len,
                           e.family, e.addr, rails[l].prefix_len);
      };
      if (!on(dev_))
        for (int l = 0; l < static_cast<int>(rails.size()); ++l)
          if (on(l)) {
            local = l;
            break;
          }
      control_rail_ = local;
      paths_.clear();
      paths_desc_.clear();
      control_hs_.path = 0;
      control_hs_.stream = 0;
      start_handshake(&control_hs_, local, -1, kHelloQuery, 0, now);
    }
    int r = step_handshake(&control_hs_, control_rail_, now);
    if (r < 0) {
      if (control_hs_.fd >= 0) ::close(control_hs_.fd);
      control_hs_.fd = -1;
      control_hs_.stage = -1;
      // What cannot heal fails now (sock/sock_errors.h); a refusal lasting kRefusedGrace
      // means nothing listens at any of the handle's addresses any more.
      const ErrClass cls = control_hs_.refused ? ErrClass::kPermanent
                                               : classify_errno(control_hs_.err, control_hs_.op);
      if (cls == ErrClass::kPermanent) return setup_failed(control_hs_, "asking");
      if (cls == ErrClass::kBounded) {
        if (refused_since_ == 0) refused_since_ = now;
        if (now - refused_since_ >= kRefusedGrace) {
          R2CCL_WARN(
              "connect on device %d (%s) failed: nothing listens at the handle's addresses "
              "(last: %s: %s, for %.1f s): the listen comm's process exited; not retried",
              dev_, rails[dev_].name.c_str(), control_hs_.what.c_str(), strerror(control_hs_.err),
              (now - refused_since_) / 1e6);
          return Status::kRemote;
        }
      } else {
        refused_since_ = 0;
      }
      control_last_err_ = control_hs_.err;
      control_hs_.err = 0;  // next call starts the next candidate
      control_candidate_++;
      control_backoff_ =
          std::min<TimeUs>(control_backoff_ == 0 ? 10 * kUsPerMs : control_backoff_ * 2, kUsPerSec);
      control_retry_at_ = now + control_backoff_;
      return Status::kOk;
    }
    if (r == 0) return Status::kOk;
    HelloBody peer;
    memcpy(&peer, control_hs_.in + sizeof(FrameHeader), sizeof(peer));
    ::close(control_hs_.fd);  // the query connection only fetched the peer's rails
    control_hs_.fd = -1;
    // Both ends' knobs: this connection uses the negotiated ones (transport/handshake.h).
    std::string bad;
    if (!knobs_valid(peer.knobs, kMaxStreams, &bad)) {
      R2CCL_WARN("connect on device %d (%s) failed: the peer's answer (%s) is malformed: %s", dev_,
                 rails[dev_].name.c_str(), control_hs_.what.c_str(), bad.c_str());
      return Status::kRemote;
    }
    const Negotiated n = negotiate(rt_->knobs(), peer.knobs);
    n_streams_ = n.streams;
    backups_ = n.backup_paths;
    chunk_size_ = n.chunk_size;
    eager_threshold_ = n.eager_threshold;
    int peer_rail = handle_.endpoints[control_candidate_ % handle_.n_endpoints].rail;
    if (peer_rail >= static_cast<int>(peer.n_rails)) peer_rail = 0;
    R2CCL_CHECK(plan_paths(peer, control_rail_, peer_rail, now));
    setup_hs_.clear();
    for (auto& p : paths_) {
      for (int s = 0; s < n_streams_; ++s) {
        Handshake hs;
        hs.path = p.index;
        hs.stream = s;
        setup_hs_.push_back(std::move(hs));
        start_handshake(&setup_hs_.back(), rail_of(p), p.peer_rail, 0, 0, now);
      }
    }
    setup_stage_ = 2;
  }
  if (setup_stage_ == 2) {
    bool pending = false;
    const Handshake* permanent = nullptr;  // a path that failed for a cause that cannot heal
    for (auto& hs : setup_hs_) {
      if (hs.stage == 3 || hs.stage == -2) {
        if (hs.stage == -2 && !permanent && hs.cannot_heal()) permanent = &hs;
        continue;
      }
      int r = step_handshake(&hs, paths_desc_[hs.path].rail, now);
      if (r == 0) {
        pending = true;
      } else if (r > 0) {
        paths_[hs.path].streams[hs.stream].fd = hs.fd;
        hs.fd = -1;
      } else {
        if (hs.fd >= 0) ::close(hs.fd);
        hs.fd = -1;
        hs.stage = -2;
        // The listener refused a path it answered the query for (its listen comm closed
        // meanwhile, a malformed hello): the setup cannot succeed. One refused for want of
        // descriptors there waits in the background, as one that hits EMFILE here.
        if (hs.refused && !hs.out_of_resources()) return setup_failed(hs, "connecting");
        const bool perm = hs.cannot_heal();
        if (perm && !permanent) permanent = &hs;
        R2CCL_INFO(NCCL_NET | NCCL_INIT, "path %d (%s) not connected at setup: %s", hs.path,
                   hs.what.c_str(), hs.cause().c_str());
      }
    }
    if (pending) return Status::kOk;
    uint64_t bitmap = 0;
    for (auto& p : paths_) {
      bool up = true;
      for (auto& s : p.streams) up &= s.fd >= 0;
      if (up) {
        bitmap |= 1ull << p.index;
        p.attached = n_streams_;
      }
    }
    if (bitmap == 0) {
      for (auto& p : paths_) close_streams(p);
      // No path came up, one for a cause that cannot heal (descriptors, ports): fail now.
      if (permanent) return setup_failed(*permanent, "connecting");
      // Otherwise start over (the connect timeout bounds the retries).
      setup_stage_ = 1;
      control_candidate_++;
      return Status::kOk;
    }
    // The connection comes up: the paths that did not are retried in the background. Said only
    // now, as a connect that fails as a whole says so once (setup_failed) and retries nothing.
    for (const auto& hs : setup_hs_) {
      if (hs.stage != -2 || !hs.cannot_heal() || (bitmap >> hs.path & 1)) continue;
      if (first_time("setup path:" + rails[paths_desc_[hs.path].rail].name + ":" +
                     (hs.refused ? std::string("refused") : std::to_string(hs.err))))
        R2CCL_WARN(
            "path %d (%s) not connected at setup: %s; it is retried in the background, slowly "
            "(warned once per rail and cause)",
            hs.path, hs.what.c_str(), hs.cause().c_str());
    }
    for (auto& p : paths_) {
      if (bitmap >> p.index & 1) continue;
      close_streams(p);
      desc(p).up = false;
      warn_once("path on rail " + rt_->rails()[rail_of(p)].name +
                " could not be connected at setup; it will be retried in the background");
    }
    // SETUP_DONE on the first path that is up: a = number of paths, total = paths up.
    const int cpath = __builtin_ctzll(bitmap);
    FrameHeader sd = frame(FrameType::kSetupDone);
    sd.a = static_cast<uint32_t>(paths_.size());
    sd.total = bitmap;
    queue_ctrl(paths_[cpath], sd, now);
    flush_stream(paths_[cpath], paths_[cpath].streams[0], now);
    setup_hs_.clear();
    setup_stage_ = 3;
    *done = true;
    R2CCL_INFO(NCCL_NET | NCCL_INIT,
               "connected on device %d: %zu paths (%d up), %d streams each, chunk %llu KiB", dev_,
               paths_.size(), __builtin_popcountll(bitmap), n_streams_,
               static_cast<unsigned long long>(chunk_size_ / 1024));
  }
  return Status::kOk;
}

// SETUP_DONE is the first frame on its stream; anything else waits in the kernel until the
// connection runs.
bool Conn::peek_setup_done(Path& p, Stream& s) {
  FrameHeader h;
  ssize_t n = ::recv(s.fd, &h, sizeof(h), MSG_DONTWAIT | MSG_PEEK);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
    ::close(s.fd);
    s = Stream{};
    p.attached--;
    return false;
  }
  if (n != static_cast<ssize_t>(sizeof(h))) return true;
  if (h.magic != kFrameMagic || h.type != static_cast<uint8_t>(FrameType::kSetupDone)) return true;
  if (::recv(s.fd, &h, sizeof(h), MSG_DONTWAIT) != static_cast<ssize_t>(sizeof(h))) return true;
  setup_done_seen_ = true;
  setup_done_bitmap_ = h.total;
  setup_done_paths_ = h.a;
  return true;
}

Status Conn::accept_step(bool* done, TimeUs now) {
  *done = false;
  Listen* l = listen_;
  if (setup_stage_ == 0) {
    setup_start_ = now;
    setup_stage_ = 1;
    memcpy(secret_, l->secret, 16);
    listen_id_ = l->listen_id;
  }
  if (now - setup_start_ > cfg_.connect_timeout) {
    R2CCL_WARN("accept on device %d (%s) gave up after %.1f s: the peer did not finish connecting",
               dev_, rt_->rails()[dev_].name.c_str(), cfg_.connect_timeout / 1e6);
    return Status::kRemote;
  }
  // One accept takes one connection: the streams of the first connector in the inbox (its
  // conn id); those of other connectors stay there, in order, for the next accepts.
  std::vector<Incoming> in, others;
  {
    std::lock_guard<std::mutex> lk(l->inbox_mu);
    in.swap(l->inbox);
  }
  for (auto& inc : in) {
    const HelloBody& b = inc.hello;
    if (l->was_accepted(b.conn_id)) {
      ::close(inc.fd);  // a late stream of a connection already accepted
      continue;
    }
    if (!paths_.empty() && b.conn_id != conn_id_) {
      others.push_back(inc);
      continue;
    }
    if (paths_.empty()) {
      if (b.n_paths == 0 || b.n_paths > kMaxPaths || b.n_streams == 0 ||
          b.n_streams > kMaxStreams || b.n_rails == 0 || b.n_rails > kMaxRails) {
        R2CCL_WARN("refused a connection on %s: its hello declares %u paths, %u streams, %u rails",
                   rail_name(inc.local_rail).c_str(), b.n_paths, b.n_streams, b.n_rails);
        ::close(inc.fd);
        continue;
      }
      conn_id_ = b.conn_id;
      n_streams_ = static_cast<int>(b.n_streams);
      const Negotiated n = negotiate(b.knobs, rt_->knobs());  // the listener checked them
      chunk_size_ = n.chunk_size;
      eager_threshold_ = n.eager_threshold;
      peer_rails_.assign(b.rails, b.rails + b.n_rails);
      paths_.resize(b.n_paths);
      paths_desc_.assign(b.n_paths, PathDesc{});
      for (uint32_t i = 0; i < b.n_paths; ++i) {
        Path& p = paths_[i];
        p.index = static_cast<int>(i);
        desc(p).rail = dev_;
        p.streams.resize(n_streams_);
      }
    }
    if (b.conn_id != conn_id_ || b.path >= paths_.size() ||
        b.stream >= static_cast<uint32_t>(n_streams_)) {
      ::close(inc.fd);
      continue;
    }
    Path& p = paths_[b.path];
    desc(p).rail = inc.local_rail;
    // Index the rail table the first hello filled: a later hello may claim other rail counts.
    p.peer_rail = b.rail < peer_rails_.size() ? static_cast<int>(b.rail) : 0;
    desc(p).label = rail_name(rail_of(p)) + " <- " + wire_name(peer_rails_[p.peer_rail]);
    p.reset_seen = FaultInjector::instance().query(rail_of(p), now).reset_epoch;
    if (p.streams[b.stream].fd >= 0)
      ::close(p.streams[b.stream].fd);
    else
      p.attached++;
    p.streams[b.stream].fd = inc.fd;
  }
  if (!others.empty()) {
    std::lock_guard<std::mutex> lk(l->inbox_mu);
    l->inbox.insert(l->inbox.begin(), others.begin(), others.end());
  }
  // No stream of a connection has come, and this process cannot accept one (it holds its
  // own descriptors): fail now, naming the limit; the waiting connectors are refused with it.
  std::string starved;
  if (paths_.empty() && rt_->accept_starved(now, setup_start_, &starved)) {
    R2CCL_WARN("accept on device %d (%s) failed: %s; raise the descriptor limit (ulimit -n)", dev_,
               rt_->rails()[dev_].name.c_str(), starved.c_str());
    return Status::kSystem;
  }
  bool any_stream = false;
  for (auto& p : paths_)
    for (auto& s : p.streams) {
      if (s.fd >= 0 && !setup_done_seen_) peek_setup_done(p, s);
      any_stream |= s.fd >= 0;
    }
  if (!setup_done_seen_) {
    // Every stream of the chosen connector closed before its SETUP_DONE (it gave up, or
    // starts over with new streams): take whichever connector is first in the inbox now.
    if (!paths_.empty() && !any_stream) {
      paths_.clear();
      paths_desc_.clear();
    }
    return Status::kOk;
  }
  if (setup_done_paths_ == 0 || setup_done_paths_ > paths_.size()) {
    R2CCL_WARN("accept on device %d: the peer declared %u paths", dev_, setup_done_paths_);
    return Status::kRemote;
  }
  for (auto& p : paths_) {
    const bool want = (setup_done_bitmap_ >> p.index) & 1;
    if (want && p.attached < n_streams_) return Status::kOk;  // a hand-over is still in flight
  }
  for (size_t i = setup_done_paths_; i < paths_.size(); ++i) close_streams(paths_[i]);
  paths_.resize(setup_done_paths_);
  paths_desc_.resize(setup_done_paths_);
  for (auto& p : paths_) {
    if ((setup_done_bitmap_ >> p.index) & 1) continue;
    close_streams(p);
    desc(p).up = false;
    if (desc(p).label.empty()) desc(p).label = rail_name(rail_of(p)) + " <- ?";
  }
  setup_stage_ = 3;
  l->accepted.push_back(conn_id_);
  if (l->accepted.size() > Listen::kRecentAccepts) l->accepted.pop_front();
  listen_ = nullptr;
  *done = true;
  R2CCL_INFO(NCCL_NET | NCCL_INIT, "accepted on device %d: %zu paths (%d up), %d streams each",
             dev_, paths_.size(), __builtin_popcountll(setup_done_bitmap_), n_streams_);
  return Status::kOk;
}

// ------------------------------------------------------------------------------------------
// Frames out.

void Conn::queue_ctrl(Path& p, FrameHeader h, TimeUs now) {
  if (p.streams.empty()) return;
  OutFrame f;
  f.h = h;
  f.h.len = 0;
  const TimeUs delay = FaultInjector::instance().query(rail_of(p), now).delay;
  f.not_before = delay > 0 ? now + delay : 0;
  p.streams[0].ctrlq.push_back(f);
}

bool Conn::flush_stream(Path& p, Stream& s, TimeUs now) {
  if (s.fd < 0) return true;
  // A black hole writes nothing and the frames wait: TCP on a real black hole loses no byte
  // of a live connection, its retransmissions deliver them once the hole closes
  // (RAIL-LAB.md), unless a detector fails the path first and its queues go with it.
  if (FaultInjector::instance().query(rail_of(p), now).blackhole) return true;
  for (int guard = 0; guard < 64; ++guard) {
    if (!s.cur_active) {
      if (!s.ctrlq.empty()) {
        // Control frames are headers only: every one that is due goes in one system call (an
        // acknowledgement and a probe queued in the same pass, several acknowledgements).
        s.batch.clear();
        while (!s.ctrlq.empty() && s.batch.size() < kCtrlBatch &&
               s.ctrlq.front().not_before <= now) {
          s.batch.push_back(s.ctrlq.front().h);
          s.ctrlq.pop_front();
        }
        if (s.batch.empty()) return true;  // delayed (fault injection): data waits behind it
        s.cur_ctrl = true;
      } else if (!s.dataq.empty()) {
        s.cur_ctrl = false;
      } else {
        return true;
      }
      s.cur_active = true;
      s.cur_off = 0;
    }
    // What is left of the current frame (or control batch), as at most 2 pieces.
    iovec iov[2];
    int n_iov = 0;
    size_t total = 0;
    if (s.cur_ctrl) {
      total = s.batch.size() * sizeof(FrameHeader);
      iov[0].iov_base = reinterpret_cast<char*>(s.batch.data()) + s.cur_off;
      iov[0].iov_len = total - s.cur_off;
      n_iov = 1;
    } else {
      OutFrame& f = s.dataq.front();
      if (f.not_before > now) return true;
      total = sizeof(FrameHeader) + f.h.len;
      if (s.cur_off < sizeof(FrameHeader)) {
        iov[n_iov].iov_base = reinterpret_cast<char*>(&f.h) + s.cur_off;
        iov[n_iov].iov_len = sizeof(FrameHeader) - s.cur_off;
        ++n_iov;
        if (f.h.len) {
          iov[n_iov].iov_base = const_cast<char*>(f.payload);
          iov[n_iov].iov_len = f.h.len;
          ++n_iov;
        }
      } else {
        size_t po = s.cur_off - sizeof(FrameHeader);
        iov[0].iov_base = const_cast<char*>(f.payload) + po;
        iov[0].iov_len = f.h.len - po;
        n_iov = 1;
      }
    }
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = n_iov;
    ssize_t n = ::sendmsg(s.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
      watch_window(s, true, now);
      return true;
    }
    if (s.window_shut) watch_window(s, false, now);
    s.cur_off += static_cast<size_t>(n);
    if (s.cur_off < total) return true;
    s.cur_active = false;
    if (!s.cur_ctrl) s.dataq.pop_front();
  }
  return true;
}

// A peer whose process is paused (SIGSTOP, swapping) stops reading, and its kernel, still up,
// advertises a zero window (or one below a segment) once the socket's receive buffer is full.
// This end's kernel then probes the window, backing off (one RTO, >= 200 ms by default, then
// doubling), and with TCP_USER_TIMEOUT set it aborts the socket (ETIMEDOUT) once the window
// has stayed shut that long although every probe is answered (Linux >= 5.11,
// tcp_probe_timer): a paused peer would
// fail every busy path after ~0.4 s. The engine's paused-peer rule (Connection::peer_stalled)
// decides such silences, so while the window is shut the socket's user timeout is raised to
// R2CCL_FAILOVER_TIMEOUT, and set back once it opens; heard_within counts the answered probes
// as hearing the peer's machine, and a rail that dies meanwhile leaves a probe unanswered.
// Looked at when the stream cannot take more bytes, every 10 ms on a path with chunks in
// flight (poll), and while its window is shut; at most every 10 ms per stream.
void Conn::watch_window(Stream& s, bool blocked, TimeUs now) {
  constexpr TimeUs kLookEvery = 10 * kUsPerMs;
  if ((!blocked && !s.window_shut) || now < s.next_window_look) return;
  s.next_window_look = now + kLookEvery;
  TcpPeerView v;
  if (!read_tcp_peer(s.fd, &v) || !v.window_known) return;  // older kernel: no rule
  // Shut: less than one segment. A receiver that stops reading advertises 0, or (its buffer
  // filling unevenly) a sliver smaller than a segment; either way this end cannot send and its
  // kernel probes the window under the user timeout (the sliver was seen in a fresh-clone CI run).
  const bool shut = v.window < std::max<uint32_t>(v.mss, 1);
  if (shut == s.window_shut) return;
  s.window_shut = shut;
  if (cfg_.tcp_user_timeout > 0 && !patient_)  // else the silence rule raised it already
    set_user_timeout(s.fd, shut ? std::max(cfg_.failover_timeout, cfg_.tcp_user_timeout)
                                : cfg_.tcp_user_timeout);
}

// The silence rule: nothing at all has arrived from the peer on any path for longer than a
// heartbeat period (it beats every period, and a receiver awaiting data 4 times per
// R2CCL_ACK_TIMEOUT), so its process is paused or every rail is down. Either way the kernel
// must not abort the sockets under TCP_USER_TIMEOUT meanwhile: a paused receiver's kernel
// may drop in-window data it has no buffer for, and the retransmissions then run into the
// user timeout (a fresh-clone CI run failed both paths so); the engine's rules decide such
// silences (a paused peer: Connection::peer_stalled; rails down: the heartbeat rule, whose
// kernel ACK evidence stops too). The timeouts are raised to R2CCL_FAILOVER_TIMEOUT on every
// stream and set back at the first byte from the peer.
void Conn::quiet_peer(TimeUs now) {
  if (cfg_.tcp_user_timeout <= 0 || patient_ || last_rx_ == 0) return;
  const TimeUs quiet =
      std::min<TimeUs>(cfg_.heartbeat_interval + cfg_.heartbeat_interval / 4, 150 * kUsPerMs);
  if (now - last_rx_ <= quiet) return;
  patient_ = true;
  for (auto& p : paths_)
    for (auto& st : p.streams)
      if (st.fd >= 0)
        set_user_timeout(st.fd, std::max(cfg_.failover_timeout, cfg_.tcp_user_timeout));
}

void Conn::heard_peer(TimeUs now) {
  last_rx_ = now;
  if (!patient_) return;
  patient_ = false;
  for (auto& p : paths_)
    for (auto& st : p.streams)
      if (st.fd >= 0 && !st.window_shut) set_user_timeout(st.fd, cfg_.tcp_user_timeout);
}

PostResult Conn::post_chunk(int path, const ChunkOut& c, PathSink& sink, TimeUs now) {
  (void)sink;
  FaultInjector::instance().arm();
  Path& p = paths_[path];
  OutFrame f;
  f.h = frame(FrameType::kData);
  f.h.len = c.len;
  f.h.seq = c.seq;
  f.h.off = c.offset;
  f.h.total = c.total;
  f.h.a = c.idx;
  f.h.b = c.nchunks;
  f.h.flags = c.eager ? static_cast<uint8_t>(kFrameEager | (c.lazy_ack ? kFrameLazyAck : 0)) : 0;
  f.payload = c.src;
  const TimeUs delay = FaultInjector::instance().query(rail_of(p), now).delay;
  f.not_before = delay > 0 ? now + delay : 0;
  p.streams[p.rr++ % p.streams.size()].dataq.push_back(f);
  return PostResult::kPosted;
}

PostResult Conn::post_cts(int path, const CtsOut& c, PathSink& sink, TimeUs now) {
  (void)sink;
  FaultInjector::instance().arm();
  FrameHeader h = frame(FrameType::kCts);
  h.seq = c.seq;
  h.total = c.capacity;
  h.a = static_cast<uint32_t>(c.tag);
  queue_ctrl(paths_[path], h, now);
  return PostResult::kPosted;
}

PostResult Conn::post_ctrl(int path, const CtrlMsg& m, PathSink& sink, TimeUs now) {
  (void)sink;
  if (path < 0) return PostResult::kFull;  // no fallback channel: wait for a path
  FrameHeader h{};
  switch (m.type) {
    case CtrlType::kAck:
      FaultInjector::instance().arm();  // a receiver of eager messages sends no CTS
      h = frame(FrameType::kAck);
      h.seq = m.seq;
      h.a = m.prefix;
      h.b = m.base;
      h.total = m.bitmap;
      h.off = m.credit;
      break;
    case CtrlType::kFail:
    case CtrlType::kFailAck:
      h = frame(m.type == CtrlType::kFail ? FrameType::kFail : FrameType::kFailAck);
      h.seq = m.id;
      h.a = m.path;
      h.b = m.gen;
      h.total = static_cast<uint64_t>(m.cause);
      break;
    case CtrlType::kDrain:
      h = frame(FrameType::kDrain);
      h.a = m.path;
      h.b = m.gen;
      h.off = m.on ? 1 : 0;
      break;
    case CtrlType::kTruncated:
      h = frame(FrameType::kTruncated);
      h.seq = m.seq;
      h.total = m.size;
      break;
    case CtrlType::kAddr: {
      // m.path is our rail: its address and listener now.
      if (m.path >= rt_->rails().size()) return PostResult::kPosted;  // nothing to tell
      const WireRail w = rt_->wire_rail(m.path);
      h = frame(FrameType::kAddr);
      h.seq = m.id;
      h.a = m.path;
      h.b = static_cast<uint32_t>(w.family) | static_cast<uint32_t>(w.prefix_len) << 8 |
            static_cast<uint32_t>(w.port) << 16;
      memcpy(&h.off, w.addr, 8);
      memcpy(&h.total, w.addr + 8, 8);
      break;
    }
    case CtrlType::kAddrAck:
      h = frame(FrameType::kAddrAck);
      h.seq = m.id;
      break;
  }
  queue_ctrl(paths_[path], h, now);
  return PostResult::kPosted;
}

bool Conn::probe(int path, PathSink& sink, TimeUs now) {
  (void)sink;
  Path& p = paths_[path];
  FrameHeader f = frame(FrameType::kPing);
  f.seq = ++p.ping_id;
  f.off = static_cast<uint64_t>(now);
  queue_ctrl(p, f, now);
  return true;
}

void Conn::flush(PathSink& sink, TimeUs now) {
  for (auto& p : paths_) {
    if (!p.attached_ok()) continue;
    for (auto& s : p.streams) {
      if (!flush_stream(p, s, now)) {
        const int e = errno;
        sink.on_path_error(
            p.index,
            e == EPIPE || e == ECONNRESET ? FailCause::kPeerClosed : FailCause::kSocketError,
            strerror(e), now);
        break;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Frames in.

// Reads what the stream has, frame by frame, within kFramesPerRead and kBytesPerRead. Headers and
// small payloads come through the stream's stage (kStageBytes): one recv takes a small frame
// whole, or several control frames; a payload of at least a stage's size is read straight into
// its destination. A read that returns less than it asked for emptied the socket: no further
// recv (it would only say EAGAIN) until the next pass.
bool Conn::read_stream(Path& p, Stream& s, PathSink& sink, TimeUs now, FailCause* cause,
                       const char** why) {
  if (s.fd < 0) return true;
  if (FaultInjector::instance().query(rail_of(p), now).blackhole) return true;
  if (s.stage.empty()) s.stage.resize(kStageBytes);
  int frames = 0;
  uint64_t bytes = 0;
  bool drained = false;
  while (frames < kFramesPerRead && bytes < kBytesPerRead) {
    if (s.st_off == s.st_len) {
      if (drained) return true;
      const bool direct = s.in_payload && s.p_left >= kStageBytes;
      char* dst = s.stage.data();
      size_t want = kStageBytes;
      if (direct) {
        // The stale-data guard, again before every partial read: the chunk may have landed on
        // another path, or its receive may have completed or failed, meanwhile.
        if (s.place.action == ChunkPlace::Action::kRead && sink.chunk_wanted(s.place)) {
          dst = s.place.dst + s.p_done;
          want = static_cast<size_t>(s.p_left);
        } else {
          s.p_clean = false;
          dst = discard_.data();
          want = static_cast<size_t>(std::min<uint64_t>(s.p_left, discard_.size()));
        }
      }
      const ssize_t n = ::recv(s.fd, dst, want, MSG_DONTWAIT);
      if (n == 0) {
        *cause = FailCause::kPeerClosed;
        *why = "end of file";
        return false;
      }
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        *cause = (errno == ECONNRESET || errno == EPIPE) ? FailCause::kPeerClosed
                                                         : FailCause::kSocketError;
        *why = strerror(errno);
        return false;
      }
      sink.on_path_alive(p.index, now);
      heard_peer(now);
      bytes += static_cast<uint64_t>(n);
      drained = static_cast<size_t>(n) < want;
      if (direct) {
        s.p_done += static_cast<uint64_t>(n);
        s.p_left -= static_cast<uint64_t>(n);
        if (s.p_left == 0) finish_payload(p, s, sink, now);
        continue;
      }
      s.st_off = 0;
      s.st_len = static_cast<size_t>(n);
    }
    const size_t avail = s.st_len - s.st_off;
    const char* in = s.stage.data() + s.st_off;
    if (s.in_payload) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(s.p_left, avail));
      // The stale-data guard before every copy, as before every partial read.
      if (s.place.action == ChunkPlace::Action::kRead && sink.chunk_wanted(s.place))
        memcpy(s.place.dst + s.p_done, in, take);
      else
        s.p_clean = false;
      s.st_off += take;
      s.p_done += take;
      s.p_left -= take;
      if (s.p_left == 0) finish_payload(p, s, sink, now);
      continue;
    }
    const size_t take = std::min(avail, sizeof(FrameHeader) - s.rh_got);
    memcpy(reinterpret_cast<char*>(&s.rh) + s.rh_got, in, take);
    s.st_off += take;
    s.rh_got += take;
    if (s.rh_got < sizeof(FrameHeader)) continue;
    s.rh_got = 0;
    ++frames;
    if (s.rh.magic != kFrameMagic) {
      *cause = FailCause::kProtocol;
      *why = "bad frame magic";
      return false;
    }
    if (!handle_frame(p, s, sink, now, why)) {
      *cause = FailCause::kProtocol;
      return false;
    }
    if (s.in_payload && s.p_left == 0) finish_payload(p, s, sink, now);
    if (p.stopped) return true;  // a frame made the engine stop this path
  }
  return true;
}

bool Conn::handle_frame(Path& p, Stream& s, PathSink& sink, TimeUs now, const char** why) {
  const FrameHeader& h = s.rh;
  const auto type = static_cast<FrameType>(h.type);
  if (type != FrameType::kData && h.len != 0) {
    *why = "control frame with a payload";
    return false;
  }
  switch (type) {
    case FrameType::kData: {
      if (h.len > kMaxFramePayload) {
        *why = "chunk longer than the largest chunk size";
        return false;
      }
      ChunkHeader ch;
      ch.seq = h.seq;
      ch.offset = h.off;
      ch.total = h.total;
      ch.idx = h.a;
      ch.nchunks = h.b;
      ch.len = h.len;
      ch.eager = (h.flags & kFrameEager) != 0;
      ch.lazy_ack = ch.eager && (h.flags & kFrameLazyAck) != 0;
      s.place = sink.on_chunk_header(p.index, ch, now);
      if (s.place.action == ChunkPlace::Action::kProtocolError) {
        *why = s.place.why;
        return false;
      }
      s.in_payload = true;
      s.p_left = h.len;
      s.p_done = 0;
      s.p_clean = true;
      return true;
    }
    case FrameType::kCts:
      if (role_ != Role::kSend) {
        *why = "clear-to-send sent to the receiving side";
        return false;
      }
      sink.on_cts(h.seq, h.total, RemoteBuffer{}, now);
      return true;
    case FrameType::kAck: {
      if (role_ != Role::kSend) {
        *why = "acknowledgement sent to the receiving side";
        return false;
      }
      CtrlMsg m;
      m.type = CtrlType::kAck;
      m.seq = h.seq;
      m.prefix = h.a;
      m.base = h.b;
      m.bitmap = h.total;
      m.credit = h.off;
      sink.on_ctrl(p.index, m, now);
      return true;
    }
    case FrameType::kTruncated: {
      if (role_ != Role::kRecv) {
        *why = "truncation notice sent to the sending side";
        return false;
      }
      CtrlMsg m;
      m.type = CtrlType::kTruncated;
      m.seq = h.seq;
      m.size = h.total;
      sink.on_ctrl(p.index, m, now);
      return true;
    }
    case FrameType::kFail:
    case FrameType::kFailAck:
    case FrameType::kDrain: {
      CtrlMsg m;
      m.type = type == FrameType::kFail      ? CtrlType::kFail
               : type == FrameType::kFailAck ? CtrlType::kFailAck
                                             : CtrlType::kDrain;
      m.id = h.seq;
      m.path = static_cast<uint16_t>(std::min<uint32_t>(h.a, 0xffff));
      m.gen = h.b;
      m.on = h.off != 0;
      // Only the cause that changes what the receiver does; anything else is a plain notice.
      if (type == FrameType::kFail && h.total == static_cast<uint64_t>(FailCause::kAddressChanged))
        m.cause = FailCause::kAddressChanged;
      sink.on_ctrl(p.index, m, now);
      return true;
    }
    case FrameType::kPing: {
      FrameHeader a = frame(FrameType::kPong);
      a.seq = h.seq;
      a.off = h.off;
      queue_ctrl(p, a, now);
      return true;
    }
    case FrameType::kPong:
      // An answer to one of the latest probes (off: its send time, echoed); an older one
      // (from before a reconnect) proves nothing about the path now.
      if (h.seq <= p.ping_id && h.seq + 8 > p.ping_id)
        sink.on_probe_ok(p.index, now,
                         h.off <= static_cast<uint64_t>(now) ? static_cast<TimeUs>(h.off) : 0);
      return true;
    case FrameType::kBye: sink.on_peer_bye(now); return true;
    case FrameType::kAddr: {
      if (!take_peer_address(h, sink, now, why)) return false;
      CtrlMsg m;
      m.type = CtrlType::kAddr;
      m.id = h.seq;
      m.path = static_cast<uint16_t>(h.a);
      sink.on_ctrl(p.index, m, now);
      return true;
    }
    case FrameType::kAddrAck: {
      CtrlMsg m;
      m.type = CtrlType::kAddrAck;
      m.id = h.seq;
      sink.on_ctrl(p.index, m, now);
      return true;
    }
    case FrameType::kSetupDone:
      return true;  // a repeat from the setup (the connector sends one per setup)
    default: *why = "unknown frame type"; return false;
  }
}

void Conn::finish_payload(Path& p, Stream& s, PathSink& sink, TimeUs now) {
  s.in_payload = false;
  const ChunkPlace pl = s.place;
  s.place = ChunkPlace{};
  if (pl.action != ChunkPlace::Action::kRead) return;
  sink.on_chunk_read(p.index, pl, s.p_clean, now);
}

bool Conn::wait_fds(std::vector<pollfd>* out) const {
  // Injected faults run on timers and delayed frames; handed-over streams wait in the inbox.
  if (FaultInjector::instance().enabled()) return false;
  if (role_ == Role::kRecv) {
    std::lock_guard<std::mutex> lk(inbox_mu_);
    if (!inbox_.empty()) return false;
  }
  for (const auto& p : paths_) {
    for (const auto& hs : p.reconnect)
      if (hs.fd >= 0 && hs.stage >= 0 && hs.stage < 3)
        out->push_back({hs.fd, static_cast<short>(hs.stage == 2 ? POLLIN : POLLOUT), 0});
    if (!p.attached_ok()) continue;
    for (const auto& st : p.streams) {
      if (st.st_off < st.st_len) return false;  // frames read but not yet handled
      const bool out_pending = st.cur_active || !st.ctrlq.empty() || !st.dataq.empty();
      out->push_back({st.fd, static_cast<short>(POLLIN | (out_pending ? POLLOUT : 0)), 0});
    }
  }
  if (peer_check_fd_ >= 0) out->push_back({peer_check_fd_, POLLIN | POLLOUT, 0});
  return true;
}

void Conn::poll(PathSink& sink, TimeUs now) {
  if (role_ == Role::kRecv) drain_inbox(sink, now);
  for (auto& p : paths_)
    if (!p.reconnect.empty()) step_reconnect(sink, p, now);
  apply_injected_resets(sink, now);
  // One poll(2) says which streams have something to read, instead of a recv per stream that
  // mostly answers EAGAIN: the proxy thread calls this in a tight loop while it waits, and a
  // recv locks the socket (an arriving segment then waits in its backlog; poll does not
  // lock). Streams with frames already in their stage are read whatever it says.
  read_fds_.clear();
  read_at_.clear();
  for (auto& p : paths_) {
    if (!p.attached_ok()) continue;
    for (size_t i = 0; i < p.streams.size(); ++i) {
      if (p.streams[i].fd < 0) continue;
      read_fds_.push_back({p.streams[i].fd, POLLIN, 0});
      read_at_.push_back({p.index, static_cast<int>(i)});
    }
  }
  const bool polled =
      !read_fds_.empty() && ::poll(read_fds_.data(), static_cast<nfds_t>(read_fds_.size()), 0) >= 0;
  for (size_t k = 0; k < read_fds_.size(); ++k) {
    Path& p = paths_[static_cast<size_t>(read_at_[k].first)];
    if (!p.attached_ok()) continue;  // failed or stopped by what an earlier stream read
    Stream& s = p.streams[static_cast<size_t>(read_at_[k].second)];
    if (s.fd != read_fds_[k].fd) continue;
    if (polled && read_fds_[k].revents == 0 && s.st_off == s.st_len) continue;
    FailCause cause = FailCause::kNone;
    const char* why = nullptr;
    if (!read_stream(p, s, sink, now, &cause, &why)) sink.on_path_error(p.index, cause, why, now);
  }
  if (now >= next_tcp_info_) sample_tcp_info(now);
  // The zero-window rule also looks without an EAGAIN: what a stopped receiver cannot take
  // may sit in this end's socket buffer with nothing more to write. Every 10 ms, only on paths
  // with chunks in flight; and the silence rule (quiet_peer) at the same pace.
  if (now >= next_window_look_) {
    next_window_look_ = now + 10 * kUsPerMs;
    quiet_peer(now);
    for (auto& p : paths_)
      if (p.attached_ok() && sink.traffic_in_flight(p.index))
        for (auto& st : p.streams)
          if (st.fd >= 0) watch_window(st, true, now);
  }
  if (role_ == Role::kRecv) check_peer_process(sink, now);
}

// The acceptor cannot reconnect; with every path down it asks the kernel whether the peer's
// process still listens on its rail: a refused connect (ECONNREFUSED: no listener on that
// address and port) means the process is gone, so pending receives need not wait for
// R2CCL_FAILOVER_TIMEOUT. An accepted one is closed at once (the peer's listener logs it at
// INFO as closed before its hello); anything else (unreachable, no answer) proves nothing.
void Conn::check_peer_process(PathSink& sink, TimeUs now) {
  constexpr TimeUs kPeerCheckPeriod = 200 * kUsPerMs, kPeerCheckTimeout = 1 * kUsPerSec;
  bool any_attached = false;
  for (const auto& p : paths_) any_attached |= p.attached > 0 && !p.stopped;
  if (any_attached || peer_check_done_ || paths_.empty() || peer_rails_.empty()) {
    if (peer_check_fd_ >= 0) ::close(peer_check_fd_);
    peer_check_fd_ = -1;
    peer_check_at_ = any_attached ? 0 : peer_check_at_;
    return;
  }
  auto gone = [&] {
    peer_check_done_ = true;
    const int pr = paths_[peer_check_path_].peer_rail;
    const WireRail& w = peer_rails_[pr >= 0 ? pr : 0];
    sink.on_peer_gone(("its listener on rail " + wire_name(w) + " refuses connections").c_str(),
                      now);
  };
  if (peer_check_fd_ < 0) {
    if (peer_check_at_ == 0) peer_check_at_ = now + kPeerCheckPeriod;  // the sender reconnects
    if (now < peer_check_at_) return;
    peer_check_path_ = (peer_check_path_ + 1) % static_cast<int>(paths_.size());
    const Path& p = paths_[peer_check_path_];
    if (!rt_->live(rail_of(p)).link_up.load() ||
        FaultInjector::instance().query(rail_of(p), now).down) {
      peer_check_at_ = now + kPeerCheckPeriod;
      return;
    }
    SockFailure why;  // cannot open one now (descriptors): try again later, proves nothing
    peer_check_fd_ = open_rail_socket(rt_->rail_now(rail_of(p)), cfg_.tcp_user_timeout, &why);
    const WireRail& w = peer_rails_[p.peer_rail >= 0 ? p.peer_rail : 0];
    if (peer_check_fd_ >= 0 &&
        start_connect(peer_check_fd_, wire_to_sockaddr(w.family, w.addr, w.port)) ==
            -ECONNREFUSED) {
      ::close(peer_check_fd_);
      peer_check_fd_ = -1;
      gone();
      return;
    }
    peer_check_at_ = now + kPeerCheckTimeout;
    return;
  }
  const int rc = finish_connect(peer_check_fd_);
  if (rc == -EINPROGRESS && now < peer_check_at_) return;
  ::close(peer_check_fd_);
  peer_check_fd_ = -1;
  peer_check_at_ = now + kPeerCheckPeriod;
  if (rc == -ECONNREFUSED) gone();
}

// ------------------------------------------------------------------------------------------
// Paths

void Conn::stop_path(int path, bool from_peer, TimeUs now) {
  (void)from_peer;
  (void)now;
  Path& p = paths_[path];
  close_streams(p);
  p.stopped = true;
  for (auto& hs : p.reconnect)
    if (hs.fd >= 0) ::close(hs.fd);
  p.reconnect.clear();
}

bool Conn::can_reconnect(int path, PathSink& sink) const {
  (void)path;
  (void)sink;
  return role_ == Role::kSend;  // only the connecting side reconnects
}

void Conn::reconnect(int path, PathSink& sink, TimeUs now) {
  (void)sink;
  Path& p = paths_[path];
  // The local address is resolved again on every attempt: it may have changed without the
  // runtime knowing yet (no netlink), and then the runtime is told.
  bool has = false;
  Rail local = rt_->rail_now(rail_of(p), &has);
  sockaddr_storage a{};
  int plen = local.prefix_len;
  std::vector<IfAddr> ifs;
  if (!read_system_interfaces(&ifs)) {
    // Unknown now (out of descriptors): the runtime's address, as it last knew it.
  } else if (resolve_rail_address(local, ifs, &a, &plen)) {
    if (!has || !same_address(a, local.addr) || plen != local.prefix_len) rt_->recheck_addresses();
    local.addr = a;
    local.family = a.ss_family;
    local.addrlen = a.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    local.prefix_len = plen;
    has = true;
  } else if (has) {
    rt_->recheck_addresses();
    has = false;
  }
  const WireRail& w = peer_rails_[p.peer_rail];
  std::string note;
  if (!has) {
    note = "rail " + local.name + " has no usable address";
  } else if (!same_subnet(local.family, addr_bytes(local.addr), local.prefix_len, w.family, w.addr,
                          w.prefix_len)) {
    const std::string mine = addr_to_string(local.addr) + "/" + std::to_string(local.prefix_len);
    const std::string theirs = rail_addr_string(w) + "/" + std::to_string(w.prefix_len);
    note = "rail " + local.name + " (" + mine + ") and the peer's rail " + wire_name(w) + " (" +
           theirs + ") are not in one subnet";
    if (first_time("subnet:" + local.name + ":" + mine + ":" + theirs))
      R2CCL_WARN(
          "path %d of conn %016llx: %s; the path is not used until an address changes (warned "
          "once per address pair)",
          p.index, static_cast<unsigned long long>(conn_id_), note.c_str());
  }
  p.reconnect.assign(n_streams_, Handshake{});
  for (int s = 0; s < n_streams_; ++s) {
    Handshake& hs = p.reconnect[s];
    hs.path = p.index;
    hs.stream = s;
    if (!note.empty()) {
      hs.stage = -1;
      hs.err = ENETUNREACH;
      hs.note = note;
      continue;
    }
    start_handshake(&hs, rail_of(p), p.peer_rail, kHelloReconnect, desc(p).generation + 1, now,
                    &local);
  }
}

bool Conn::address_stale(int path) const {
  const Path& p = paths_[path];
  int fd = -1;
  for (const auto& s : p.streams)
    if (s.fd >= 0) {
      fd = s.fd;
      break;
    }
  if (fd < 0) return false;
  sockaddr_storage mine{}, theirs{};
  socklen_t ml = sizeof(mine), tl = sizeof(theirs);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &ml) != 0) return false;
  bool has = false;
  const Rail local = rt_->rail_now(rail_of(p), &has);
  if (!has || !same_address(mine, local.addr)) return true;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &tl) != 0) return false;
  if (p.peer_rail < 0 || p.peer_rail >= static_cast<int>(peer_rails_.size())) return false;
  const WireRail& w = peer_rails_[p.peer_rail];
  const sockaddr_storage peer = wire_to_sockaddr(w.family, w.addr, w.port);
  return !same_address(theirs, peer);
}

// The peer process is named by its listener on the peer rail (address and port: one
// listener per process and rail), so the key is (local rail, that listener).
uint64_t Conn::link_key(int path) const {
  const Path& p = paths_[path];
  if (p.peer_rail < 0 || p.peer_rail >= static_cast<int>(peer_rails_.size())) return 0;
  const WireRail& w = peer_rails_[p.peer_rail];
  char key[4 + 1 + 2 + sizeof(w.addr)];
  const int32_t local = rail_of(p);
  memcpy(key, &local, 4);
  key[4] = static_cast<char>(w.family);
  memcpy(key + 5, &w.port, 2);
  memcpy(key + 7, w.addr, sizeof(w.addr));
  return link_key_of(key, sizeof(key));
}

bool Conn::take_peer_address(const FrameHeader& h, PathSink& sink, TimeUs now, const char** why) {
  const int family = static_cast<int>(h.b & 0xff);
  const int plen = static_cast<int>((h.b >> 8) & 0xff);
  if (h.a >= peer_rails_.size() || (family != AF_INET && family != AF_INET6) ||
      plen > (family == AF_INET ? 32 : 128)) {
    *why = "address notice with a bad rail, family or prefix length";
    return false;
  }
  WireRail& w = peer_rails_[h.a];
  WireRail n = w;
  n.family = static_cast<uint8_t>(family);
  n.prefix_len = static_cast<uint8_t>(plen);
  n.port = static_cast<uint16_t>(h.b >> 16);
  memset(n.addr, 0, sizeof(n.addr));
  memcpy(n.addr, &h.off, 8);
  memcpy(n.addr + 8, &h.total, 8);
  if (family == AF_INET) memset(n.addr + 4, 0, sizeof(n.addr) - 4);
  const bool changed = memcmp(&n, &w, sizeof(n)) != 0;
  if (changed)
    R2CCL_INFO(NCCL_NET, "conn %016llx: the peer's rail %s is now %s/%d port %u",
               static_cast<unsigned long long>(conn_id_), wire_name(w).c_str(),
               rail_addr_string(n).c_str(), plen, ntohs(n.port));
  w = n;
  for (auto& p : paths_) {
    if (p.peer_rail != static_cast<int>(h.a)) continue;
    if (!p.reconnect.empty()) {
      // Going to the old address, or backing off: start over at once.
      for (auto& hs : p.reconnect)
        if (hs.fd >= 0) ::close(hs.fd);
      p.reconnect.clear();
      sink.on_reconnect_failed(p.index, false, "the peer's rail has a new address", now);
    }
    sink.on_peer_address(p.index, now);
  }
  return true;
}

void Conn::step_reconnect(PathSink& sink, Path& p, TimeUs now) {
  bool pending = false, failed = false;
  int err = 0;
  for (auto& hs : p.reconnect) {
    if (hs.stage == 3) continue;
    const int r = step_handshake(&hs, rail_of(p), now);
    if (r == 0)
      pending = true;
    else if (r < 0) {
      failed = true;
      err = hs.err;
    }
  }
  if (failed) {
    const Handshake* f = nullptr;
    for (auto& hs : p.reconnect)
      if (hs.stage != 3 && (hs.err != 0 || hs.refused) && !f) f = &hs;
    const std::string cause = f ? f->cause() : std::string(strerror(err));
    // Nothing accepts this path any more when nothing listens (the peer's process is gone) or
    // the peer has no such connection (it closed it).
    const bool refused =
        f && (f->refused ? f->refusal.reason == static_cast<uint8_t>(Refusal::kUnknownConn)
                         : f->err == ECONNREFUSED);
    // A cause that cannot heal soon (descriptors, ports, a refusal): warned once per rail and
    // cause; the path stays down and the engine retries it with its backoff (slowly), so a
    // backup path that hits EMFILE never ends a running connection.
    if (f && (f->refused || classify_errno(f->err, f->op) == ErrClass::kPermanent) &&
        first_time("reconnect:" + rt_->rails()[rail_of(p)].name + ":" +
                   (f->refused ? std::string(refusal_name(static_cast<Refusal>(f->refusal.reason)))
                               : std::to_string(f->err))))
      R2CCL_WARN(
          "reconnect of path %d (%s) of conn %016llx: %s; the path stays down and is retried "
          "slowly (warned once per rail and cause)",
          p.index, f->what.c_str(), static_cast<unsigned long long>(conn_id_), cause.c_str());
    for (auto& hs : p.reconnect)
      if (hs.fd >= 0) ::close(hs.fd);
    p.reconnect.clear();
    sink.on_reconnect_failed(p.index, refused, cause.c_str(), now);
    return;
  }
  if (pending) return;
  close_streams(p);
  p.streams.assign(n_streams_, Stream{});
  for (int s = 0; s < n_streams_; ++s) {
    p.streams[s].fd = p.reconnect[s].fd;
    p.reconnect[s].fd = -1;
  }
  p.reconnect.clear();
  p.attached = n_streams_;
  p.stopped = false;
  desc(p).generation++;
  sink.on_reconnected(p.index, now);
}

void Conn::push_incoming(Incoming in) {
  std::lock_guard<std::mutex> lk(inbox_mu_);
  inbox_.push_back(in);
}

void Conn::drain_inbox(PathSink& sink, TimeUs now) {
  std::vector<Incoming> in;
  {
    std::unique_lock<std::mutex> lk(inbox_mu_, std::try_to_lock);
    if (!lk.owns_lock() || inbox_.empty()) return;
    in.swap(inbox_);
  }
  for (auto& inc : in) {
    const HelloBody& b = inc.hello;
    if (b.path >= paths_.size() || b.stream >= static_cast<uint32_t>(n_streams_)) {
      ::close(inc.fd);
      continue;
    }
    attach_stream(sink, static_cast<int>(b.path), static_cast<int>(b.stream), b.generation, inc.fd,
                  now);
  }
}

void Conn::attach_stream(PathSink& sink, int path, int stream, uint32_t gen, int fd, TimeUs now) {
  Path& p = paths_[path];
  if (gen < desc(p).generation) {
    ::close(fd);
    return;
  }
  if (gen > desc(p).generation) {
    // The peer re-created the path: the old generation has failed at its end.
    if (p.attached_ok())
      sink.on_path_error(p.index, FailCause::kPeerNotice, "peer reconnected the path", now);
    close_streams(p);
    p.streams.assign(n_streams_, Stream{});
    desc(p).generation = gen;
  }
  if (p.streams[stream].fd >= 0)
    ::close(p.streams[stream].fd);
  else
    p.attached++;
  p.streams[stream] = Stream{};
  p.streams[stream].fd = fd;
  if (p.attached == n_streams_) {
    p.stopped = false;
    sink.on_reconnected(p.index, now);
  }
}

// An abortive reset, as a dying NIC or a reset from the network would cause: the connection
// ends with RST and whatever the kernel still had queued is lost. The descriptor number stays
// valid (a fresh, unconnected socket takes its place), so the next read or write on it fails
// and the ordinary socket-error detector reports the path, as it would a real reset.
void Conn::abort_socket(int fd) {
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  int fresh = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fresh >= 0) {
    ::dup2(fresh, fd);  // closes the connected socket (RST) and keeps the number
    ::close(fresh);
  } else {
    ::shutdown(fd, SHUT_RDWR);
  }
}

// An injected reset waits until this connection has a message in flight on the rail, so the
// fault always hits traffic (R2CCL_FAULT_INJECT's contract; see fault/fault_injector.h).
void Conn::apply_injected_resets(PathSink& sink, TimeUs now) {
  for (auto& p : paths_) {
    const auto fault = FaultInjector::instance().query(rail_of(p), now);
    if (fault.reset_epoch == p.reset_seen) continue;
    if (p.attached_ok() && !sink.traffic_in_flight(p.index)) continue;
    p.reset_seen = fault.reset_epoch;
    for (auto& s : p.streams)
      if (s.fd >= 0) abort_socket(s.fd);
  }
}

// Smallest time since any stream of the path received a TCP ACK (TCP_INFO), microseconds; 0
// for a stream whose peer advertises a window below one segment with every window probe
// answered: the peer's kernel answers however far apart the backed-off probes have grown
// (200 ms, 400 ms, 800 ms ...: more than 3 heartbeat periods apart within a 2 s pause). Read
// from the kernel, not from watch_window's flag, which may not have looked yet (a fresh-clone
// CI run failed a paused receiver's path by heartbeat miss, "last heard the peer 1288 ms ago").
TimeUs Conn::heard_within(int path, TimeUs now) const {
  (void)now;
  TimeUs best = INT64_MAX;
  for (const auto& s : paths_[path].streams) {
    TcpPeerView v;
    if (s.fd < 0 || !read_tcp_peer(s.fd, &v)) continue;
    const bool answering =
        v.window_known && v.window < std::max<uint32_t>(v.mss, 1) && v.unanswered_probes == 0;
    best = std::min<TimeUs>(best, answering ? 0 : static_cast<TimeUs>(v.last_ack_ms) * kUsPerMs);
  }
  return best;
}

TimeUs Conn::fault_start(int path, TimeUs now) const {
  return FaultInjector::instance().last_start(rail_of(paths_[path]), now);
}

// The failure predictor's retransmit signal on TCP rails: what the kernel retransmitted on
// this connection's sockets since the last read, added to the rails' totals once a second.
void Conn::sample_tcp_info(TimeUs now) {
  next_tcp_info_ = now + kUsPerSec;
  // A stream whose window opened while it had nothing more to send gets its timeout back.
  for (auto& p : paths_)
    for (auto& st : p.streams)
      if (st.fd >= 0 && st.window_shut) watch_window(st, false, now);
  if (!cfg_.predict) return;
  for (auto& p : paths_) {
    RailLive& l = rt_->live(rail_of(p));
    for (auto& st : p.streams) {
      TcpCounters tc;
      if (st.fd < 0 || !read_tcp_counters(st.fd, &tc)) continue;
      l.tcp_retrans.fetch_add(static_cast<uint32_t>(tc.total_retrans - st.tcpi_retrans),
                              std::memory_order_relaxed);
      l.tcp_segs_out.fetch_add(static_cast<uint32_t>(tc.segs_out - st.tcpi_segs_out),
                               std::memory_order_relaxed);
      st.tcpi_retrans = tc.total_retrans;
      st.tcpi_segs_out = tc.segs_out;
    }
  }
}

// The peer's listener on the rail of path 0 ("ADDR:PORT"): it names the peer process.
std::string Conn::peer_name() const {
  if (paths_.empty() || peer_rails_.empty()) return "";
  const int r =
      paths_[0].peer_rail >= 0 && paths_[0].peer_rail < static_cast<int>(peer_rails_.size())
          ? paths_[0].peer_rail
          : 0;
  const WireRail& w = peer_rails_[r];
  return addr_to_string(wire_to_sockaddr(w.family, w.addr, w.port));
}

void Conn::say_goodbye(TimeUs now) {
  for (auto& p : paths_) {
    if (!p.attached_ok()) continue;
    queue_ctrl(p, frame(FrameType::kBye), now);
    flush_stream(p, p.streams[0], now);  // best effort, never waits
  }
}

}  // namespace r2ccl::net::tcp
