#include "conn.h"

#include "sock/tcp_info.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>

#include "../engine/scheduler.h"
#include "r2ccl/log.h"
#include "../sock/socket_util.h"

namespace r2ccl::net {
namespace {

constexpr size_t kDiscardBytes = 64 * 1024;
constexpr TimeUs kPathHandshakeTimeout = 1 * kUsPerSec;
constexpr size_t kHistory = 64;          // completed receives kept for duplicate acks
constexpr int kFramesPerRead = 32;       // bound the work of one progress call per stream
constexpr uint64_t kBytesPerRead = 8ull << 20;

FrameHeader frame(FrameType t) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint8_t>(t);
  return h;
}

bool secret_equal(const uint8_t* a, const uint8_t* b) {
  uint8_t d = 0;
  for (int i = 0; i < 16; ++i) d |= a[i] ^ b[i];
  return d == 0;
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

// Warn once per process and message (missing rails are reported per rail, not per connection).
void warn_once(const std::string& msg) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lk(mu);
  if (seen.insert(msg).second) R2CCL_WARN("%s", msg.c_str());
}

}  // namespace

// ------------------------------------------------------------------------------------------
ListenComm::ListenComm(Runtime* r, int d) : rt(r), dev(d) {
  rt->random_bytes(secret, sizeof(secret));
  listen_id = rt->random_u64();
  rt->register_listen(this);
}

ListenComm::~ListenComm() {
  rt->unregister_listen(this);
  std::lock_guard<std::mutex> lk(inbox_mu);
  for (auto& in : inbox) ::close(in.fd);
  inbox.clear();
}

// ------------------------------------------------------------------------------------------
Conn::Conn(Runtime* rt, Role role, int dev)
    : rt_(rt), cfg_(rt->cfg()), role_(role), dev_(dev), discard_(kDiscardBytes) {
  n_streams_ = static_cast<int>(cfg_.nsocks_per_path);
  for (auto& r : reqs_) r.conn = this;
  last_progress_.store(now_us());
}

Conn::~Conn() { close_all(); }

void Conn::close_all() {
  for (auto& p : paths_) {
    close_streams(p);
    for (auto& hs : p.reconnect)
      if (hs.fd >= 0) ::close(hs.fd);
    p.reconnect.clear();
    if (p.counted_failed) {
      rt_->live(p.local_rail).failed_paths--;
      p.counted_failed = false;
    }
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
  p.ping_outstanding = false;
}

// ------------------------------------------------------------------------------------------
// Handshakes (connector side): connect, send HELLO, read HELLO_ACK.

void Conn::start_handshake(Handshake* hs, int local_rail, int peer_rail, uint32_t flags,
                           uint32_t gen, TimeUs now) {
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
  hs->deadline = now + kPathHandshakeTimeout;
  hs->what = rail_name(local_rail) + " -> " + addr_to_string(peer);
  if (FaultInjector::instance().query(local_rail, now).down) {
    hs->stage = -1;
    hs->err = ENETUNREACH;
    return;
  }
  std::string err;
  hs->fd = open_rail_socket(rt_->rails()[local_rail], cfg_.tcp_user_timeout, &err);
  if (hs->fd < 0) {
    hs->stage = -1;
    hs->err = ENETDOWN;
    hs->what += ": " + err;
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
  rt_->fill_wire_rails(&b);
  hs->out.resize(sizeof(h) + sizeof(b));
  memcpy(hs->out.data(), &h, sizeof(h));
  memcpy(hs->out.data() + sizeof(h), &b, sizeof(b));
}

// 1 done, 0 pending, -1 failed (hs->err).
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
  while (hs->got < sizeof(hs->in)) {
    ssize_t n = ::recv(hs->fd, hs->in + hs->got, sizeof(hs->in) - hs->got, 0);
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
    if (hs->got >= sizeof(FrameHeader)) {
      FrameHeader h;
      memcpy(&h, hs->in, sizeof(h));
      if (h.magic != kFrameMagic || h.type != static_cast<uint8_t>(FrameType::kHelloAck) ||
          h.len != sizeof(HelloBody)) {
        hs->err = EPROTO;
        return -1;
      }
    }
  }
  HelloBody b;
  memcpy(&b, hs->in + sizeof(FrameHeader), sizeof(b));
  if (!secret_equal(b.secret, secret_) || b.n_rails == 0 || b.n_rails > kMaxRails) {
    hs->err = EACCES;
    return -1;
  }
  return 1;
}

// ------------------------------------------------------------------------------------------
// Path plan: primary on rail dev_, backups on the next rails; each local rail is matched to a
// peer rail on the same subnet (then by index when no rail pair shares a subnet).
Status Conn::plan_paths(const HelloBody& peer, int control_rail, int control_peer_rail) {
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
  std::vector<int> used(np, 0);
  auto match = [&](int l) {
    if (!any_shared) return l < np ? l : -1;
    int best = -1;
    for (int p = 0; p < np; ++p) {
      if (!subnet(l, p)) continue;
      if (p == l && !used[p]) return p;
      if (best < 0 || (used[best] && !used[p])) best = p;
    }
    return best;
  };
  // Report rails without a counterpart once per process.
  for (int l = 0; l < nl; ++l)
    if (match(l) < 0)
      warn_once("rail " + rails[l].name + " has no peer rail on its subnet; it is not used for "
                "connections to that peer");
  for (int p = 0; p < np; ++p) {
    bool found = !any_shared ? p < nl : false;
    for (int l = 0; l < nl && !found; ++l) found = subnet(l, p);
    if (!found) {
      char name[sizeof(peer_rails_[p].name) + 1] = {};
      memcpy(name, peer_rails_[p].name, sizeof(peer_rails_[p].name));
      warn_once(std::string("peer rail ") + name + " has no local rail on its subnet; it is not used");
    }
  }
  const int want = 1 + static_cast<int>(cfg_.backup_paths);
  std::vector<std::pair<int, int>> plan;
  for (int k = 0; k < nl && static_cast<int>(plan.size()) < want; ++k) {
    int l = (dev_ + k) % nl;
    int p = l == control_rail ? control_peer_rail : match(l);
    if (p < 0) continue;
    used[p]++;
    plan.push_back({l, p});
  }
  bool has_control = false;
  for (auto& e : plan) has_control |= e.first == control_rail;
  if (!has_control) plan.back() = {control_rail, control_peer_rail};
  if (plan.size() < 2)
    warn_once("connections on device " + std::to_string(dev_) + " (" + rails[dev_].name +
              ") have no backup path: a failure of that rail fails them");
  TimeUs now = now_us();
  paths_.clear();
  paths_.resize(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    Path& p = paths_[i];
    p.index = static_cast<int>(i);
    p.local_rail = plan[i].first;
    p.peer_rail = plan[i].second;
    char name[sizeof(peer_rails_[0].name) + 1] = {};
    memcpy(name, peer_rails_[p.peer_rail].name, sizeof(peer_rails_[0].name));
    p.label = rails[p.local_rail].name + " -> " + name;
    p.streams.resize(n_streams_);
    p.health = std::make_unique<PathHealth>(rt_->health_params(), PathState::kHealthy, now);
    p.down_seen = rt_->live(p.local_rail).down_events.load();
    p.up_seen = rt_->live(p.local_rail).up_events.load();
    p.reset_seen = FaultInjector::instance().query(p.local_rail, now).reset_epoch;
  }
  return Status::kOk;
}

// ------------------------------------------------------------------------------------------
Status Conn::connect_step(const WireHandle& h, bool* done) {
  *done = false;
  TimeUs now = now_us();
  const auto& rails = rt_->rails();
  if (setup_stage_ == 0) {
    handle_ = h;
    memcpy(secret_, h.secret, 16);
    listen_id_ = h.listen_id;
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
    R2CCL_WARN("connect on device %d (%s) gave up after %.1f s: no endpoint of the peer answered "
               "(last: %s: %s)",
               dev_, rails[dev_].name.c_str(), cfg_.connect_timeout / 1e6, control_hs_.what.c_str(),
               err ? strerror(err) : "no answer");
    return Status::kRemote;
  }
  if (setup_stage_ == 1) {
    // The control connection: try the handle's endpoints in turn from the matching local rail.
    if (control_hs_.fd < 0 && control_hs_.stage == -1 && control_hs_.err == 0) {
      // Failed attempts back off (10 ms doubling to 1 s), so a peer that refuses us (a stale
      // handle, a wrong secret) is not flooded with connections until the connect timeout.
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
      control_hs_.path = 0;
      control_hs_.stream = 0;
      start_handshake(&control_hs_, local, -1, kHelloQuery, 0, now);
    }
    int r = step_handshake(&control_hs_, control_rail_, now);
    if (r < 0) {
      if (control_hs_.fd >= 0) ::close(control_hs_.fd);
      control_hs_.fd = -1;
      control_hs_.stage = -1;
      control_last_err_ = control_hs_.err;
      control_hs_.err = 0;  // next call starts the next candidate
      control_candidate_++;
      control_backoff_ = std::min<TimeUs>(control_backoff_ == 0 ? 10 * kUsPerMs : control_backoff_ * 2,
                                          kUsPerSec);
      control_retry_at_ = now + control_backoff_;
      return Status::kOk;
    }
    if (r == 0) return Status::kOk;
    HelloBody peer;
    memcpy(&peer, control_hs_.in + sizeof(FrameHeader), sizeof(peer));
    ::close(control_hs_.fd);  // the query connection only fetched the peer's rails
    control_hs_.fd = -1;
    int peer_rail = handle_.endpoints[control_candidate_ % handle_.n_endpoints].rail;
    if (peer_rail >= static_cast<int>(peer.n_rails)) peer_rail = 0;
    R2CCL_CHECK(plan_paths(peer, control_rail_, peer_rail));
    setup_hs_.clear();
    for (auto& p : paths_) {
      for (int s = 0; s < n_streams_; ++s) {
        Handshake hs;
        hs.path = p.index;
        hs.stream = s;
        setup_hs_.push_back(std::move(hs));
        start_handshake(&setup_hs_.back(), p.local_rail, p.peer_rail, 0, 0, now);
      }
    }
    setup_stage_ = 2;
  }
  if (setup_stage_ == 2) {
    bool pending = false;
    for (auto& hs : setup_hs_) {
      if (hs.stage == 3 || hs.stage == -2) continue;
      int r = step_handshake(&hs, paths_[hs.path].local_rail, now);
      if (r == 0) {
        pending = true;
      } else if (r > 0) {
        paths_[hs.path].streams[hs.stream].fd = hs.fd;
        hs.fd = -1;
        hs.stage = 3;
      } else {
        if (hs.fd >= 0) ::close(hs.fd);
        hs.fd = -1;
        hs.stage = -2;
        R2CCL_INFO(NCCL_NET | NCCL_INIT, "path %d (%s) not connected at setup: %s", hs.path,
                   hs.what.c_str(), strerror(hs.err));
      }
    }
    if (pending) return Status::kOk;
    uint64_t bitmap = 0;
    for (auto& p : paths_) {
      bool up = true;
      for (auto& s : p.streams) up &= s.fd >= 0;
      if (up) {
        bitmap |= 1ull << p.index;
        p.last_rx = p.last_tx = now;
      } else {
        close_streams(p);
        p.health = std::make_unique<PathHealth>(rt_->health_params(), PathState::kFailed, now);
        rt_->live(p.local_rail).failed_paths++;
        p.counted_failed = true;
        warn_once("path on rail " + rt_->rails()[p.local_rail].name +
                  " could not be connected at setup; it will be retried in the background");
      }
    }
    if (bitmap == 0) {
      // Nothing came up: start over (the connect timeout bounds the retries).
      for (auto& p : paths_) close_streams(p);
      setup_stage_ = 1;
      control_candidate_++;
      return Status::kOk;
    }
    // SETUP_DONE on the first path that is up: a = number of paths, total = paths up.
    int cpath = __builtin_ctzll(bitmap);
    FrameHeader sd = frame(FrameType::kSetupDone);
    sd.a = static_cast<uint32_t>(paths_.size());
    sd.total = bitmap;
    queue_ctrl(paths_[cpath], sd);
    flush_stream(paths_[cpath], paths_[cpath].streams[0], now);
    setup_hs_.clear();
    setup_stage_ = 3;
    rt_->register_conn(this);
    *done = true;
    R2CCL_INFO(NCCL_NET | NCCL_INIT, "connected on device %d: %zu paths (%d up), %d streams each",
               dev_, paths_.size(), __builtin_popcountll(bitmap), n_streams_);
  }
  return Status::kOk;
}

// ------------------------------------------------------------------------------------------
Status Conn::accept_step(ListenComm* l, bool* done) {
  *done = false;
  TimeUs now = now_us();
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
  std::vector<Incoming> in;
  {
    std::lock_guard<std::mutex> lk(l->inbox_mu);
    in.swap(l->inbox);
  }
  for (auto& inc : in) {
    const HelloBody& b = inc.hello;
    if (paths_.empty()) {
      if (b.n_paths == 0 || b.n_paths > kMaxPaths || b.n_streams == 0 || b.n_streams > kMaxStreams ||
          b.n_rails == 0 || b.n_rails > kMaxRails) {
        R2CCL_WARN("refused a connection on %s: its hello declares %u paths, %u streams, %u rails",
                   rail_name(inc.local_rail).c_str(), b.n_paths, b.n_streams, b.n_rails);
        ::close(inc.fd);
        continue;
      }
      conn_id_ = b.conn_id;
      n_streams_ = static_cast<int>(b.n_streams);
      peer_rails_.assign(b.rails, b.rails + b.n_rails);
      paths_.resize(b.n_paths);
      for (uint32_t i = 0; i < b.n_paths; ++i) {
        Path& p = paths_[i];
        p.index = static_cast<int>(i);
        p.local_rail = dev_;
        p.streams.resize(n_streams_);
        p.health = std::make_unique<PathHealth>(rt_->health_params(), PathState::kHealthy, now);
      }
    }
    if (b.conn_id != conn_id_ || b.path >= paths_.size() || b.stream >= static_cast<uint32_t>(n_streams_)) {
      ::close(inc.fd);
      continue;
    }
    Path& p = paths_[b.path];
    p.local_rail = inc.local_rail;
    // Index the rail table the first hello filled: a later hello may claim other rail counts.
    p.peer_rail = b.rail < peer_rails_.size() ? static_cast<int>(b.rail) : 0;
    char name[sizeof(peer_rails_[0].name) + 1] = {};
    memcpy(name, peer_rails_[p.peer_rail].name, sizeof(peer_rails_[0].name));
    p.label = rail_name(p.local_rail) + " <- " + name;
    p.down_seen = rt_->live(p.local_rail).down_events.load();
    p.up_seen = rt_->live(p.local_rail).up_events.load();
    p.reset_seen = FaultInjector::instance().query(p.local_rail, now).reset_epoch;
    if (p.streams[b.stream].fd >= 0) ::close(p.streams[b.stream].fd);
    else p.attached++;
    p.streams[b.stream].fd = inc.fd;
    p.last_rx = p.last_tx = now;
  }
  // Read frames until SETUP_DONE (reads only; no health checks before setup completes).
  for (auto& p : paths_) {
    for (auto& s : p.streams) {
      if (s.fd < 0) continue;
      FailCause cause = FailCause::kNone;
      const char* why = nullptr;
      if (!read_stream(p, s, now, &cause, &why)) {
        ::close(s.fd);
        s = Stream{};
        p.attached--;
      }
    }
  }
  if (!setup_done_seen_) return Status::kOk;
  if (setup_done_paths_ == 0 || setup_done_paths_ > paths_.size()) {
    R2CCL_WARN("accept on device %d: the peer declared %u paths", dev_, setup_done_paths_);
    return Status::kRemote;
  }
  for (auto& p : paths_) {
    bool want = (setup_done_bitmap_ >> p.index) & 1;
    if (want && p.attached < n_streams_) return Status::kOk;  // a hand-over is still in flight
  }
  for (size_t i = setup_done_paths_; i < paths_.size(); ++i) close_streams(paths_[i]);
  paths_.resize(setup_done_paths_);
  for (auto& p : paths_) {
    bool want = (setup_done_bitmap_ >> p.index) & 1;
    if (!want) {
      close_streams(p);
      p.health = std::make_unique<PathHealth>(rt_->health_params(), PathState::kFailed, now);
      rt_->live(p.local_rail).failed_paths++;
      p.counted_failed = true;
    }
    p.last_rx = p.last_tx = now;
  }
  setup_stage_ = 3;
  rt_->register_conn(this);
  *done = true;
  R2CCL_INFO(NCCL_NET | NCCL_INIT, "accepted on device %d: %zu paths (%d up), %d streams each", dev_,
             paths_.size(), __builtin_popcountll(setup_done_bitmap_), n_streams_);
  return Status::kOk;
}

// ------------------------------------------------------------------------------------------
// Frames out.

void Conn::queue_ctrl(Path& p, FrameHeader h, std::vector<char> payload) {
  if (p.streams.empty()) return;
  OutFrame f;
  f.h = h;
  f.h.len = static_cast<uint32_t>(payload.size());
  f.owned = std::move(payload);
  f.payload = f.owned.empty() ? nullptr : f.owned.data();
  TimeUs now = now_us();
  TimeUs delay = FaultInjector::instance().query(p.local_rail, now).delay;
  f.not_before = delay > 0 ? now + delay : 0;
  f.gen = p.generation;
  p.streams[0].ctrlq.push_back(std::move(f));
}

int Conn::control_path(int prefer) const {
  if (prefer >= 0 && prefer < static_cast<int>(paths_.size()) &&
      paths_[prefer].health->state() == PathState::kHealthy && paths_[prefer].attached_ok())
    return prefer;
  for (const auto& p : paths_)
    if (p.health->state() == PathState::kHealthy && p.attached_ok()) return p.index;
  for (const auto& p : paths_)
    if (p.health->connected() && p.attached_ok()) return p.index;
  return -1;
}

bool Conn::send_ctrl_any(FrameHeader h, int prefer) {
  int i = control_path(prefer);
  if (i < 0) return false;
  queue_ctrl(paths_[i], h);
  return true;
}

bool Conn::flush_stream(Path& p, Stream& s, TimeUs now) {
  if (s.fd < 0) return true;
  auto fault = FaultInjector::instance().query(p.local_rail, now);
  for (int guard = 0; guard < 64; ++guard) {
    if (!s.cur_active) {
      if (!s.ctrlq.empty()) {
        s.cur_ctrl = true;
      } else if (!s.dataq.empty()) {
        s.cur_ctrl = false;
      } else {
        return true;
      }
      s.cur_active = true;
      s.cur_off = 0;
    }
    OutFrame& f = s.cur_ctrl ? s.ctrlq.front() : s.dataq.front();
    if (f.not_before > now) return true;
    const size_t total = sizeof(FrameHeader) + f.h.len;
    if (fault.blackhole) {
      s.cur_off = total;  // silently discarded at the socket layer
    } else {
      iovec iov[2];
      int n_iov = 0;
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
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = n_iov;
      ssize_t n = ::sendmsg(s.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        return false;
      }
      s.cur_off += static_cast<size_t>(n);
      p.last_tx = now;
    }
    if (s.cur_off < total) return true;
    s.cur_active = false;
    if (s.cur_ctrl) s.ctrlq.pop_front();
    else s.dataq.pop_front();
  }
  return true;
}

// ------------------------------------------------------------------------------------------
// Frames in.

bool Conn::read_stream(Path& p, Stream& s, TimeUs now, FailCause* cause, const char** why) {
  if (s.fd < 0) return true;
  if (FaultInjector::instance().query(p.local_rail, now).blackhole) return true;
  const GuardOptions& g = rt_->guard();
  int frames = 0;
  uint64_t bytes = 0;
  while (frames < kFramesPerRead && bytes < kBytesPerRead) {
    ssize_t n;
    if (!s.in_payload) {
      n = ::recv(s.fd, reinterpret_cast<char*>(&s.rh) + s.rh_got, sizeof(FrameHeader) - s.rh_got,
                 MSG_DONTWAIT);
    } else {
      uint64_t seq = s.rh.seq;
      Request* r = s.p_req;
      bool write = r && r->used && !r->done && r->seq == seq &&
                   (!g.stale_guard || r->rmsg.wants(s.p_idx, g.dedup));
      char* dst;
      size_t want;
      if (write) {
        dst = r->rmsg.buffer() + s.rh.off + s.p_done;
        want = static_cast<size_t>(s.p_left);
      } else {
        s.p_clean = false;
        dst = discard_.data();
        want = static_cast<size_t>(std::min<uint64_t>(s.p_left, discard_.size()));
      }
      n = ::recv(s.fd, dst, want, MSG_DONTWAIT);
    }
    if (n == 0) {
      *cause = FailCause::kPeerClosed;
      *why = "end of file";
      return false;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      *cause = (errno == ECONNRESET || errno == EPIPE) ? FailCause::kPeerClosed : FailCause::kSocketError;
      *why = strerror(errno);
      return false;
    }
    p.last_rx = now;
    bytes += static_cast<uint64_t>(n);
    if (!s.in_payload) {
      s.rh_got += static_cast<size_t>(n);
      if (s.rh_got < sizeof(FrameHeader)) continue;
      s.rh_got = 0;
      ++frames;
      if (s.rh.magic != kFrameMagic) {
        *cause = FailCause::kProtocol;
        *why = "bad frame magic";
        return false;
      }
      if (!handle_frame(p, s, now, why)) {
        *cause = FailCause::kProtocol;
        return false;
      }
      if (s.in_payload && s.p_left == 0) finish_payload(p, s, now);
    } else {
      if (s.p_req && s.p_clean) s.p_done += static_cast<uint64_t>(n);
      else s.p_done += static_cast<uint64_t>(n);
      s.p_left -= static_cast<uint64_t>(n);
      if (s.p_left == 0) finish_payload(p, s, now);
    }
  }
  return true;
}

Request* Conn::find_send(uint64_t seq) {
  for (Request* r : active_)
    if (r->seq == seq) return r;
  return nullptr;
}

Request* Conn::find_recv(uint64_t seq) { return find_send(seq); }

bool Conn::handle_frame(Path& p, Stream& s, TimeUs now, const char** why) {
  const FrameHeader& h = s.rh;
  const auto type = static_cast<FrameType>(h.type);
  if (type != FrameType::kData && h.len != 0) {
    *why = "control frame with a payload";
    return false;
  }
  switch (type) {
    case FrameType::kData: {
      if (role_ != Role::kRecv) {
        *why = "data frame sent to the sending side";
        return false;
      }
      if (h.len > kMaxFramePayload) {
        *why = "chunk longer than the largest chunk size";
        return false;
      }
      s.in_payload = true;
      s.p_left = h.len;
      s.p_done = 0;
      s.p_req = nullptr;
      s.p_idx = h.a;
      s.p_clean = true;
      Request* r = find_recv(h.seq);
      if (!r) {
        if (h.seq >= next_recv_seq_) {
          *why = "data for a message that has no clear-to-send";
          return false;
        }
        rt_->live(p.local_rail).discarded_chunks++;
        for (const auto& d : history_) {
          if (d.seq != h.seq) continue;
          FrameHeader a = frame(FrameType::kAck);
          a.seq = d.seq;
          a.a = d.nchunks;
          send_ctrl_any(a, p.index);
        }
        return true;
      }
      const char* bad = nullptr;
      ChunkVerdict v = r->rmsg.check(h.total, h.b, h.a, h.off, h.len, rt_->guard(), &bad);
      if (v == ChunkVerdict::kProtocolError) {
        *why = bad;
        return false;
      }
      if (v == ChunkVerdict::kDuplicate) {
        rt_->live(p.local_rail).discarded_chunks++;
        uint32_t base = h.a / 64 * 64;
        if (std::find(r->dirty_windows.begin(), r->dirty_windows.end(), base) == r->dirty_windows.end())
          r->dirty_windows.push_back(base);
        r->ack_path = p.index;
        return true;
      }
      s.p_req = r;
      return true;
    }
    case FrameType::kCts:
      if (role_ != Role::kSend) {
        *why = "clear-to-send sent to the receiving side";
        return false;
      }
      on_cts(h.seq, h.total);
      return true;
    case FrameType::kAck:
      if (role_ != Role::kSend) {
        *why = "acknowledgement sent to the receiving side";
        return false;
      }
      on_ack(h.seq, h.a, h.b, h.total, now);
      return true;
    case FrameType::kFail: {
      FrameHeader a = frame(FrameType::kFailAck);
      a.seq = h.seq;
      a.a = h.a;
      queue_ctrl(p, a);
      if (h.a < paths_.size() && paths_[h.a].generation == h.b && paths_[h.a].index != p.index)
        fail_path(paths_[h.a], FailCause::kPeerNotice, now, "notice from the peer", false);
      return true;
    }
    case FrameType::kFailAck:
      for (auto it = notices_.begin(); it != notices_.end(); ++it)
        if (it->id == h.seq) {
          notices_.erase(it);
          break;
        }
      return true;
    case FrameType::kPing: {
      FrameHeader a = frame(FrameType::kPong);
      a.seq = h.seq;
      a.off = h.off;
      if (rt_->live(p.local_rail).predict_drain.load(std::memory_order_relaxed))
        a.flags |= kFlagDrained;
      queue_ctrl(p, a);
      note_peer_drain(p, (h.flags & kFlagDrained) != 0);
      if (role_ == Role::kRecv && p.health->state() == PathState::kProbing &&
          p.health->on_probe_pass(now)) {
        mark_recovered(p);
        R2CCL_INFO(NCCL_NET, "path %d (%s) is back after reconnect", p.index, p.label.c_str());
      }
      return true;
    }
    case FrameType::kPong: {
      note_peer_drain(p, (h.flags & kFlagDrained) != 0);
      if (!p.ping_outstanding || h.seq != p.ping_id) return true;
      p.ping_outstanding = false;
      TimeUs rtt = now - static_cast<TimeUs>(h.off);
      if (role_ == Role::kSend && p.health->state() == PathState::kProbing) {
        if (p.health->on_probe_pass(now)) {
          rt_->live(p.local_rail).failbacks++;
          mark_recovered(p);
          resend_notices();
          log_event("failback: rail %s is back (path %d of conn %016llx reconnected and passed %d "
                    "probes); it carries traffic again",
                    rail_name(p.local_rail).c_str(), p.index,
                    static_cast<unsigned long long>(conn_id_), static_cast<int>(cfg_.probe_count));
        }
        return true;
      }
      if (role_ == Role::kSend && p.ping_sent_idle) {
        int d = p.health->on_rtt_sample(rtt, now);
        if (d > 0)
          log_event("shadow routing: rail %s probe RTT %.2f ms exceeds its baseline %.2f ms + %.1f "
                    "sigma; draining it (kept connected)",
                    rail_name(p.local_rail).c_str(), rtt / 1e3, p.health->rtt_mean_us() / 1e3,
                    cfg_.latency_sigma);
        else if (d < 0)
          log_event("shadow routing: rail %s probe RTT is back to its baseline; it carries traffic again",
                    rail_name(p.local_rail).c_str());
      }
      return true;
    }
    case FrameType::kBye:
      // NCCL closed the comm at the other end: not a failure. From here on paths end quietly;
      // acknowledgements the peer sent before its BYE on other paths are still read, and
      // whatever is still pending after a grace period can never complete.
      if (!peer_closed_) {
        peer_closed_ = true;
        bye_at_ = now;
      }
      return true;
    case FrameType::kSetupDone:
      setup_done_seen_ = true;
      setup_done_bitmap_ = h.total;
      setup_done_paths_ = h.a;
      return true;
    default:
      *why = "unknown frame type";
      return false;
  }
}

void Conn::finish_payload(Path& p, Stream& s, TimeUs now) {
  (void)now;
  s.in_payload = false;
  Request* r = s.p_req;
  s.p_req = nullptr;
  if (!r || !s.p_clean || !r->used || r->done || r->seq != s.rh.seq) return;
  const GuardOptions& g = rt_->guard();
  r->rmsg.mark_landed(s.p_idx, g);
  r->ack_path = p.index;
  if (r->rmsg.complete()) {
    r->done = true;
    r->dirty_windows.clear();
    FrameHeader a = frame(FrameType::kAck);
    a.seq = r->seq;
    a.a = r->rmsg.nchunks();
    send_ctrl_any(a, p.index);
    history_.push_back({r->seq, r->rmsg.nchunks()});
    if (history_.size() > kHistory) history_.pop_front();
    active_.erase(std::find(active_.begin(), active_.end(), r));
    return;
  }
  uint32_t base = s.p_idx / 64 * 64;
  if (std::find(r->dirty_windows.begin(), r->dirty_windows.end(), base) == r->dirty_windows.end())
    r->dirty_windows.push_back(base);
}

void Conn::send_acks() {
  for (Request* r : active_) {
    if (r->dirty_windows.empty()) continue;
    for (uint32_t base : r->dirty_windows) {
      FrameHeader a = frame(FrameType::kAck);
      a.seq = r->seq;
      a.a = r->rmsg.prefix();
      a.b = base;
      a.total = r->rmsg.window_bitmap(base);
      send_ctrl_any(a, r->ack_path);
    }
    r->dirty_windows.clear();
  }
}

void Conn::on_cts(uint64_t seq, uint64_t cap) {
  if (seq < next_send_seq_) return;  // duplicate after a failover
  for (const auto& c : cts_)
    if (c.seq == seq) return;
  if (seq >= next_send_seq_ + 4 * NCCL_NET_MAX_REQUESTS) return;  // not a plausible receive
  auto it = cts_.begin();
  while (it != cts_.end() && it->seq < seq) ++it;
  cts_.insert(it, Cts{seq, cap});
}

void Conn::on_ack(uint64_t seq, uint32_t prefix, uint32_t base, uint64_t bitmap, TimeUs now) {
  Request* r = find_send(seq);
  if (!r) return;
  r->smsg.apply_ack(prefix, base, bitmap, [&](int path, uint32_t len) {
    if (path < 0 || path >= static_cast<int>(paths_.size())) return;
    Path& q = paths_[path];
    q.inflight_bytes = q.inflight_bytes > len ? q.inflight_bytes - len : 0;
    q.ack_progress = now;
  });
  if (r->smsg.complete()) {
    r->done = true;
    active_.erase(std::find(active_.begin(), active_.end(), r));
  }
}

// ------------------------------------------------------------------------------------------
// Failure handling.

void Conn::fail_path(Path& p, FailCause cause, TimeUs now, const char* detail, bool notify) {
  const bool was_data = p.health->carries_data();
  const int first_data = [&] {
    for (const auto& q : paths_)
      if (q.health->carries_data()) return q.index;
    return -1;
  }();
  const TimeUs last_alive = std::max(p.last_rx, p.ack_progress);
  if (!p.health->on_failure(cause, now)) return;
  p.peer_drain = false;  // learnt again from the first probe after a reconnect
  close_streams(p);
  for (auto& hs : p.reconnect)
    if (hs.fd >= 0) ::close(hs.fd);
  p.reconnect.clear();
  RailLive& rl = rt_->live(p.local_rail);
  rl.paths_failed++;
  if (!p.counted_failed) {
    rl.failed_paths++;
    p.counted_failed = true;
  }
  const std::string rail = rail_name(p.local_rail);
  // Evidence of the fault's start: the injector knows it; otherwise the last sign of life.
  TimeUs fault_at = FaultInjector::instance().last_start(p.local_rail, now);
  if (fault_at == 0 || fault_at < last_alive - 1000 * kUsPerMs) fault_at = last_alive;
  const double detect_ms = fault_at > 0 && fault_at <= now ? (now - fault_at) / 1e3 : 0.0;

  if (role_ == Role::kSend) {
    int replayed = 0;
    std::vector<uint64_t> seqs;
    for (Request* r : active_) {
      int n = r->smsg.fail_path(p.index, rt_->replay_enabled());
      if (n > 0) {
        replayed += n;
        seqs.push_back(r->seq);
      }
    }
    p.inflight_bytes = 0;
    const bool carried = was_data && (cfg_.stripe || p.index == first_data);
    int next = -1;
    for (const auto& q : paths_)
      if (q.health->carries_data()) {
        next = q.index;
        break;
      }
    if (carried || replayed > 0) {
      rl.switchovers++;
      log_event("switchover: rail %s failed (%s%s%s); path %d of conn %016llx -> %s; %d chunks to "
                "replay",
                rail.c_str(), fail_cause_name(cause), detail ? ": " : "", detail ? detail : "",
                p.index, static_cast<unsigned long long>(conn_id_),
                next >= 0 ? ("rail " + rail_name(paths_[next].local_rail)).c_str() : "no usable rail",
                replayed);
      recoveries_.push_back(Recovery{p.index, cause, now, static_cast<TimeUs>(detect_ms * 1000),
                                     replayed, seqs, rail});
    } else {
      log_event("backup path on rail %s failed (%s%s%s); conn %016llx keeps %s",
                rail.c_str(), fail_cause_name(cause), detail ? ": " : "", detail ? detail : "",
                static_cast<unsigned long long>(conn_id_),
                next >= 0 ? ("rail " + rail_name(paths_[next].local_rail)).c_str() : "no usable rail");
    }
  } else {
    log_event("path on rail %s failed (%s%s%s) at the receiving end of conn %016llx",
              rail.c_str(), fail_cause_name(cause), detail ? ": " : "", detail ? detail : "",
              static_cast<unsigned long long>(conn_id_));
    resend_recv_state(-1);
  }
  if (p.health->take_holddown_started())
    log_event("hold-down: rail %s flapped %d times within %.0f s; not used for %.1f s",
              rail.c_str(), static_cast<int>(cfg_.holddown_flaps), cfg_.holddown_window / 1e6,
              p.health->current_holddown() / 1e6);
  if (notify) notices_.push_back(Notice{next_notice_++, p.index, p.generation});
  resend_notices();
}

void Conn::resend_notices() {
  for (const auto& n : notices_) {
    FrameHeader f = frame(FrameType::kFail);
    f.seq = n.id;
    f.a = static_cast<uint32_t>(n.path);
    f.b = n.gen;
    send_ctrl_any(f, -1);
  }
}

void Conn::say_goodbye() {
  TimeUs now = now_us();
  for (auto& p : paths_) {
    if (!p.health->connected() || !p.attached_ok()) continue;
    queue_ctrl(p, frame(FrameType::kBye));
    flush_stream(p, p.streams[0], now);  // best effort, never waits
  }
}

void Conn::mark_recovered(Path& p) {
  if (!p.counted_failed) return;
  rt_->live(p.local_rail).failed_paths--;
  p.counted_failed = false;
}

void Conn::resend_recv_state(int prefer) {
  for (Request* r : active_) {
    FrameHeader c = frame(FrameType::kCts);
    c.seq = r->seq;
    c.total = r->size;
    send_ctrl_any(c, prefer);
    if (r->rmsg.nchunks() != 0) {
      FrameHeader a = frame(FrameType::kAck);
      a.seq = r->seq;
      a.a = r->rmsg.prefix();
      a.b = r->rmsg.prefix() / 64 * 64;
      a.total = r->rmsg.window_bitmap(a.b);
      send_ctrl_any(a, prefer);
      for (uint32_t base = a.b + 64; base < r->rmsg.nchunks(); base += 64) {
        uint64_t bm = r->rmsg.window_bitmap(base);
        if (!bm) continue;
        FrameHeader w = a;
        w.b = base;
        w.total = bm;
        send_ctrl_any(w, prefer);
      }
    }
  }
  for (const auto& d : history_) {
    FrameHeader a = frame(FrameType::kAck);
    a.seq = d.seq;
    a.a = d.nchunks;
    send_ctrl_any(a, prefer);
  }
}

// A path that carries (or could carry, when draining) data. A path that is only probing does
// not count: a rail that reconnects but never passes its probes must not hold off give-up.
bool Conn::any_usable() const {
  for (const auto& p : paths_)
    if (p.health->state() == PathState::kHealthy || p.health->state() == PathState::kDraining)
      return true;
  return false;
}

void Conn::give_up(Status st, const char* why) {
  if (gave_up_) return;
  gave_up_ = true;
  error_ = st;
  log_event("give-up: conn %016llx on device %d (%s) has no usable path: %s; %zu pending "
            "requests fail with %s",
            static_cast<unsigned long long>(conn_id_), dev_, rail_name(dev_).c_str(), why,
            active_.size(), st == Status::kRemote ? "ncclRemoteError" : "ncclSystemError");
}

void Conn::check_recoveries(TimeUs now) {
  for (auto it = recoveries_.begin(); it != recoveries_.end();) {
    bool done = true;
    for (uint64_t seq : it->seqs) {
      Request* r = find_send(seq);
      if (r && r->smsg.replay_outstanding() > 0) done = false;
    }
    if (!done) {
      ++it;
      continue;
    }
    log_event("Successfully recovered in %.3f s (rail %s: %s, detected after %.0f ms, %d chunks "
              "replayed)",
              (now - it->detect) / 1e6, it->rail.c_str(), fail_cause_name(it->cause),
              it->since_fault_ms_x1000 / 1e3, it->replayed);
    it = recoveries_.erase(it);
  }
}

void Conn::push_incoming(Incoming in) {
  std::lock_guard<std::mutex> lk(inbox_mu_);
  inbox_.push_back(in);
}

void Conn::drain_inbox(TimeUs now) {
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
    attach_stream(static_cast<int>(b.path), static_cast<int>(b.stream), b.generation, inc.fd, now);
  }
}

void Conn::attach_stream(int path, int stream, uint32_t gen, int fd, TimeUs now) {
  Path& p = paths_[path];
  if (gen < p.generation) {
    ::close(fd);
    return;
  }
  if (gen > p.generation) {
    if (p.health->connected())
      fail_path(p, FailCause::kPeerNotice, now, "peer reconnected the path", false);
    close_streams(p);
    p.streams.assign(n_streams_, Stream{});
    p.generation = gen;
  }
  if (p.streams[stream].fd >= 0) ::close(p.streams[stream].fd);
  else p.attached++;
  p.streams[stream] = Stream{};
  p.streams[stream].fd = fd;
  if (p.attached == n_streams_) {
    p.last_rx = p.last_tx = now;
    p.health->on_reconnected(now);
    // Control frames may have been dropped while no path was up: send the receive state and
    // any unacknowledged failure notices again on the path that came back.
    resend_recv_state(p.index);
    resend_notices();
    R2CCL_INFO(NCCL_NET, "path %d (%s) reconnected by the peer (generation %u); probing", p.index,
               p.label.c_str(), gen);
  }
}

void Conn::start_reconnect(Path& p, TimeUs now) {
  p.reconnect.assign(n_streams_, Handshake{});
  for (int s = 0; s < n_streams_; ++s) {
    p.reconnect[s].path = p.index;
    p.reconnect[s].stream = s;
    start_handshake(&p.reconnect[s], p.local_rail, p.peer_rail, kHelloReconnect, p.generation + 1,
                    now);
  }
}

void Conn::step_reconnect(Path& p, TimeUs now) {
  bool pending = false, failed = false;
  int err = 0;
  for (auto& hs : p.reconnect) {
    if (hs.stage == 3) continue;
    int r = step_handshake(&hs, p.local_rail, now);
    if (r == 0) pending = true;
    else if (r > 0) hs.stage = 3;
    else {
      failed = true;
      err = hs.err;
    }
  }
  if (failed) {
    for (auto& hs : p.reconnect)
      if (hs.fd >= 0) ::close(hs.fd);
    p.reconnect.clear();
    if (err == ECONNREFUSED) p.refused = true;
    p.health->on_reconnect_failed(now);
    R2CCL_INFO(NCCL_NET, "reconnect of path %d (%s) failed: %s", p.index, p.label.c_str(),
               strerror(err));
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
  p.refused = false;
  p.attached = n_streams_;
  p.generation++;
  p.last_rx = p.last_tx = now;
  p.health->on_reconnected(now);
  R2CCL_INFO(NCCL_NET, "path %d (%s) reconnected (generation %u); probing", p.index,
             p.label.c_str(), p.generation);
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

bool Conn::message_in_flight(const Path& p) const {
  if (role_ == Role::kSend) return p.inflight_bytes > 0;
  for (const Request* r : active_)
    if (r->rmsg.nchunks() != 0 && !r->rmsg.complete()) return true;
  return false;
}

// Smallest time since any stream of the path received a TCP ACK (TCP_INFO), microseconds.
TimeUs Conn::kernel_heard_within(const Path& p) const {
  TimeUs best = INT64_MAX;
  for (const auto& s : p.streams) {
    if (s.fd < 0) continue;
    tcp_info ti{};
    socklen_t len = sizeof(ti);
    if (getsockopt(s.fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) continue;
    best = std::min<TimeUs>(best, static_cast<TimeUs>(ti.tcpi_last_ack_recv) * kUsPerMs);
  }
  return best;
}

void Conn::check_paths(TimeUs now) {
  const TimeUs hb = cfg_.heartbeat_interval;
  // If this process itself was not scheduled for a while (an overloaded host), the silence
  // it sees is its own: shift the liveness clocks by the gap instead of blaming the paths.
  if (last_check_ != 0 && now - last_check_ > hb / 2) {
    const TimeUs gap = now - last_check_;
    for (auto& p : paths_) {
      p.last_rx += gap;
      p.ack_progress += gap;
    }
  }
  last_check_ = now;
  for (auto& p : paths_) {
    RailLive& rl = rt_->live(p.local_rail);
    uint32_t down = rl.down_events.load(std::memory_order_relaxed);
    if (down != p.down_seen) {
      p.down_seen = down;
      if (!rl.link_up.load() && p.health->connected())
        fail_path(p, FailCause::kLinkDown, now, "netlink", true);
    }
    uint32_t up = rl.up_events.load(std::memory_order_relaxed);
    if (up != p.up_seen) {
      p.up_seen = up;
      p.health->on_link_up(now);
    }
    auto fault = FaultInjector::instance().query(p.local_rail, now);
    // An injected reset waits until this connection has a message in flight on the rail, so
    // the fault always hits traffic (R2CCL_FAULT_INJECT's contract; see fault_injector.h).
    if (fault.reset_epoch != p.reset_seen && (!p.health->connected() || message_in_flight(p))) {
      p.reset_seen = fault.reset_epoch;
      for (auto& s : p.streams)
        if (s.fd >= 0) abort_socket(s.fd);
    }
    if (!p.health->connected()) {
      if (role_ == Role::kSend) {
        if (!p.reconnect.empty()) step_reconnect(p, now);
        else if (p.health->should_reconnect(now) && rl.link_up.load()) start_reconnect(p, now);
      }
      continue;
    }
    if (!p.attached_ok()) continue;  // acceptor: a reconnect is being assembled
    const bool probing = p.health->state() == PathState::kProbing;
    if ((!p.ping_outstanding && (probing && role_ == Role::kSend)) || now - p.ping_sent >= hb) {
      FrameHeader f = frame(FrameType::kPing);
      if (rl.predict_drain.load(std::memory_order_relaxed)) f.flags |= kFlagDrained;
      f.seq = ++p.ping_id;
      f.off = static_cast<uint64_t>(now);
      p.ping_outstanding = true;
      p.ping_sent = now;
      p.ping_sent_idle = p.inflight_bytes == 0;
      queue_ctrl(p, f);
    }
    if (now - p.last_rx > 3 * hb) {
      // The peer's process answered nothing for 3 periods. If its kernel still acknowledges
      // our probes at the TCP level, the rail works and the peer process is merely slow.
      const TimeUs heard = kernel_heard_within(p);
      if (heard > 3 * hb) {
        char detail[96];
        snprintf(detail, sizeof(detail), "silent for %.0f ms, last TCP ACK %.0f ms ago",
                 (now - p.last_rx) / 1e3, heard == INT64_MAX ? -1.0 : heard / 1e3);
        fail_path(p, FailCause::kHeartbeatMiss, now, detail, true);
        continue;
      }
    }
    if (role_ == Role::kSend &&
        ack_watchdog_expired(p.inflight_bytes > 0, p.ack_progress, now, cfg_.ack_timeout)) {
      // No acknowledgement progress. A black hole also silences the kernel's TCP ACKs; a
      // congested or lossy-but-alive rail (TCP recovering a drop) still gets them. So the
      // watchdog fires when the kernel has heard nothing either, or after 10x the timeout.
      const TimeUs heard = kernel_heard_within(p);
      if (heard > cfg_.ack_timeout || now - p.ack_progress > 10 * cfg_.ack_timeout) {
        char detail[96];
        snprintf(detail, sizeof(detail), "none for %.0f ms, last TCP ACK %.0f ms ago",
                 (now - p.ack_progress) / 1e3, heard / 1e3);
        fail_path(p, FailCause::kAckTimeout, now, detail, true);
        continue;
      }
    }
  }
}

// The peer's failure predictor drains (or returns) its end of path p, as said by the flags of
// its probes. Only the data sender acts on it.
void Conn::note_peer_drain(Path& p, bool drained) {
  if (role_ != Role::kSend || p.peer_drain == drained) return;
  p.peer_drain = drained;
  log_event("r2ccl predict: the peer %s its end of path %d (%s) of conn %016llx: %s",
            drained ? "drains" : "no longer drains", p.index, p.label.c_str(),
            static_cast<unsigned long long>(conn_id_),
            drained ? "no new chunks on it" : "it carries data again");
}

// The failure predictor's retransmit signal on TCP rails: what the kernel retransmitted on
// this connection's sockets since the last read, added to the rails' totals once a second.
void Conn::sample_tcp_info(TimeUs now) {
  next_tcp_info_ = now + kUsPerSec;
  if (!cfg_.predict) return;
  for (auto& p : paths_) {
    RailLive& l = rt_->live(p.local_rail);
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

void Conn::schedule_chunks(TimeUs now) {
  std::vector<PathLoad>& loads = loads_;  // reused: no allocation on the data path
  loads.resize(paths_.size());
  for (size_t i = 0; i < paths_.size(); ++i) {
    const Path& p = paths_[i];
    // A rail the failure predictor drains is used like a path draining for RTT outliers:
    // only when nothing else can carry data.
    const bool predicted =
        p.peer_drain || rt_->live(p.local_rail).predict_drain.load(std::memory_order_relaxed);
    loads[i] = PathLoad{p.health->carries_data() && p.attached_ok() && !predicted,
                        p.inflight_bytes, static_cast<uint64_t>(cfg_.path_window),
                        static_cast<double>(rt_->rails()[p.local_rail].speed_mbps),
                        (p.health->state() == PathState::kDraining ||
                         (predicted && p.health->carries_data())) &&
                            p.attached_ok()};
  }
  for (Request* r : active_) {
    uint32_t idx;
    while (r->smsg.peek_next(&idx)) {
      uint32_t len = r->smsg.chunk_len(idx);
      int pi = pick_path(loads, cfg_.stripe, len);
      if (pi < 0) return;
      Path& p = paths_[pi];
      bool replay = r->smsg.take_next(pi);
      OutFrame f;
      f.h = frame(FrameType::kData);
      f.h.len = len;
      f.h.seq = r->seq;
      f.h.off = r->smsg.chunk_offset(idx);
      f.h.total = r->size;
      f.h.a = idx;
      f.h.b = r->smsg.nchunks();
      f.payload = r->data + f.h.off;
      f.data = true;
      f.gen = p.generation;
      TimeUs delay = FaultInjector::instance().query(p.local_rail, now).delay;
      f.not_before = delay > 0 ? now + delay : 0;
      Stream& s = p.streams[p.rr++ % p.streams.size()];
      s.dataq.push_back(std::move(f));
      if (p.inflight_bytes == 0) p.ack_progress = now;
      p.inflight_bytes += len;
      loads[pi].inflight_bytes += len;
      p.chunks_sent++;
      RailLive& rl = rt_->live(p.local_rail);
      (replay ? rl.chunks_replayed : rl.chunks_sent)++;
      rl.bytes_sent += len;
    }
  }
}

void Conn::progress(TimeUs now) {
  if (setup_stage_ != 3 || gave_up_) return;
  if (peer_closed_) {
    for (auto& p : paths_) {
      for (auto& st : p.streams) {
        FailCause cause = FailCause::kNone;
        const char* why = nullptr;
        if (st.fd >= 0 && !read_stream(p, st, now, &cause, &why)) {
          ::close(st.fd);
          st = Stream{};
        }
      }
    }
    if (!active_.empty() && now - bye_at_ > kUsPerSec) error_ = Status::kRemote;
    return;
  }
  if (role_ == Role::kRecv) drain_inbox(now);
  check_paths(now);
  for (auto& p : paths_) {
    if (!p.health->connected() || !p.attached_ok()) continue;
    for (auto& s : p.streams) {
      FailCause cause = FailCause::kNone;
      const char* why = nullptr;
      if (!read_stream(p, s, now, &cause, &why)) {
        fail_path(p, cause, now, why, true);
        break;
      }
    }
  }
  if (role_ == Role::kSend) schedule_chunks(now);
  else send_acks();
  if (now >= next_tcp_info_) sample_tcp_info(now);
  for (auto& p : paths_) {
    if (!p.health->connected() || !p.attached_ok()) continue;
    for (auto& s : p.streams) {
      if (!flush_stream(p, s, now)) {
        fail_path(p, errno == EPIPE || errno == ECONNRESET ? FailCause::kPeerClosed
                                                           : FailCause::kSocketError,
                  now, strerror(errno), true);
        break;
      }
    }
  }
  if (role_ == Role::kSend) check_recoveries(now);
  const bool expired = give_up_timer_.update(any_usable(), now, cfg_.failover_timeout);
  if (!give_up_timer_.waiting()) return;
  // The peer is gone when every path ended with its end-of-file, reset or a protocol error.
  // (A live peer also closes a path it has declared failed, so that alone is not enough.)
  // The connecting side knows for sure once every reconnect was refused: nothing listens on
  // the peer's rails any more (its process exited), so it fails at once.
  bool all_gone = true, all_refused = role_ == Role::kSend;
  for (const auto& p : paths_) {
    all_gone &= cause_means_peer_gone(p.health->last_cause());
    all_refused &= p.refused;
  }
  if (all_refused)
    give_up(Status::kRemote, "every reconnect was refused: the peer process is gone");
  else if (expired)
    give_up(GiveUpTimer::status(all_gone),
            all_gone ? "the peer closed every path and did not come back within "
                       "R2CCL_FAILOVER_TIMEOUT"
                     : "no local rail reaches the peer within R2CCL_FAILOVER_TIMEOUT");
}

// ------------------------------------------------------------------------------------------
// Data path entry points (proxy thread, token held by the caller).

Request* Conn::free_request() {
  for (auto& q : reqs_)
    if (!q.used) return &q;
  return nullptr;
}

Status Conn::isend(void* data, uint64_t size, Request** req) {
  *req = nullptr;
  if (peer_closed_) return Status::kRemote;
  if (error_ != Status::kOk) return error_;
  TimeUs now = now_us();
  progress(now);
  if (error_ != Status::kOk) return error_;
  if (cts_.empty() || cts_.front().seq != next_send_seq_) return Status::kOk;
  if (size > cts_.front().cap) {
    R2CCL_WARN("isend of %llu bytes on device %d is larger than the matching irecv (%llu bytes)",
               static_cast<unsigned long long>(size), dev_,
               static_cast<unsigned long long>(cts_.front().cap));
    return Status::kInternal;
  }
  Request* r = free_request();
  if (!r) return Status::kOk;  // all 32 in use: NCCL calls again
  FaultInjector::instance().arm();
  r->used = true;
  r->send = true;
  r->done = false;
  r->seq = next_send_seq_++;
  r->data = static_cast<const char*>(data);
  r->size = size;
  r->smsg.reset(r->seq, size, static_cast<uint64_t>(cfg_.chunk_size));
  cts_.pop_front();
  active_.push_back(r);
  *req = r;
  progress(now);
  return Status::kOk;
}

Status Conn::irecv(void* data, uint64_t size, Request** req) {
  *req = nullptr;
  if (peer_closed_) return Status::kRemote;
  if (error_ != Status::kOk) return error_;
  Request* r = free_request();
  if (!r) return Status::kOk;  // all 32 in use: NCCL calls again
  FaultInjector::instance().arm();
  TimeUs now = now_us();
  r->used = true;
  r->send = false;
  r->done = false;
  r->seq = next_recv_seq_++;
  r->data = nullptr;
  r->size = size;
  r->dirty_windows.clear();
  r->ack_path = -1;
  r->rmsg.reset(r->seq, static_cast<char*>(data), size);
  active_.push_back(r);
  FrameHeader c = frame(FrameType::kCts);
  c.seq = r->seq;
  c.total = size;
  send_ctrl_any(c, -1);
  *req = r;
  progress(now);
  return Status::kOk;
}

Status Conn::test(Request* r, int* done, int* size) {
  *done = 0;
  if (!r->done) {
    if (error_ == Status::kOk) progress(now_us());
    if (!r->done) return error_;
  }
  *done = 1;
  if (size) *size = static_cast<int>(r->send ? r->size : r->rmsg.total());
  r->used = false;
  r->done = false;
  return Status::kOk;
}

}  // namespace r2ccl::net
