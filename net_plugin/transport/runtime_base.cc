#include "transport/runtime_base.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "netlink/link_monitor.h"
#include "r2ccl/log.h"
#include "sock/rails.h"
#include "sock/socket_util.h"

namespace r2ccl::net {
namespace {

constexpr TimeUs kBoardPeriod = 100 * kUsPerMs;     // health board publish period
constexpr TimeUs kTellTimeout = 1 * kUsPerSec;      // a refusing connector's try to tell the peer
constexpr uint32_t kOldIbHandleMagic = 0x42493252;  // "R2IB": verbs handles of wire version <= 2

// The connector of a handle it cannot use (the other transport's, another wire version's):
// it tells the listening process (a WireRefusal with the handle's secret, to the handle's
// listener address) so that process's accept() fails at once too, then fails its own connect
// with the same message. Never becomes a connection: every PathIo call is a no-op.
class RefusingConnect final : public ConnIo {
 public:
  RefusingConnect(int dev, const HandleHead& head, const WireRefusal& refusal, Status st)
      : dev_(dev), head_(head), refusal_(refusal), st_(st) {}
  ~RefusingConnect() override {
    if (fd_ >= 0) ::close(fd_);
  }

  Status setup_step(bool* done, TimeUs now) override {
    *done = false;
    if (start_ == 0) {
      start_ = now;
      sockaddr_storage peer{};
      if (!to_sockaddr(&peer)) return finish("the handle's listener address is not IPv4/IPv6");
      fd_ = ::socket(peer.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd_ < 0) return finish(describe_errno(errno, SockOp::kSocket));
      const int e = start_connect(fd_, peer);
      if (e != 0) return finish(describe_errno(-e, SockOp::kConnect));
    }
    if (!connected_) {
      const int e = finish_connect(fd_);
      if (e == -EINPROGRESS) return now - start_ > kTellTimeout ? finish("no answer") : Status::kOk;
      if (e != 0) return finish(describe_errno(-e, SockOp::kConnect));
      connected_ = true;
    }
    const char* b = reinterpret_cast<const char*>(&refusal_);
    while (sent_ < sizeof(refusal_)) {
      const ssize_t n = ::send(fd_, b + sent_, sizeof(refusal_) - sent_, MSG_NOSIGNAL);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return now - start_ > kTellTimeout ? finish("no room to send") : Status::kOk;
      if (n <= 0) return finish(describe_errno(errno, SockOp::kIo));
      sent_ += static_cast<size_t>(n);
    }
    return finish("");
  }

  PathCaps caps() const override { return PathCaps{}; }
  void poll(PathSink&, TimeUs) override {}
  void flush(PathSink&, TimeUs) override {}
  bool ready(int) const override { return false; }
  PostResult post_chunk(int, const ChunkOut&, PathSink&, TimeUs) override {
    return PostResult::kFull;
  }
  PostResult post_cts(int, const CtsOut&, PathSink&, TimeUs) override { return PostResult::kFull; }
  PostResult post_ctrl(int, const CtrlMsg&, PathSink&, TimeUs) override {
    return PostResult::kFull;
  }
  bool probe(int, PathSink&, TimeUs) override { return false; }
  void stop_path(int, bool, TimeUs) override {}
  bool can_reconnect(int, PathSink&) const override { return false; }
  void reconnect(int, PathSink&, TimeUs) override {}
  void say_goodbye(TimeUs) override {}

 private:
  bool to_sockaddr(sockaddr_storage* s) const {
    const WireAddr& a = head_.listener;
    if (a.family == AF_INET) {
      auto* v4 = reinterpret_cast<sockaddr_in*>(s);
      v4->sin_family = AF_INET;
      v4->sin_port = a.port;
      memcpy(&v4->sin_addr, a.addr, 4);
      return true;
    }
    if (a.family == AF_INET6) {
      auto* v6 = reinterpret_cast<sockaddr_in6*>(s);
      v6->sin6_family = AF_INET6;
      v6->sin6_port = a.port;
      memcpy(&v6->sin6_addr, a.addr, 16);
      return true;
    }
    return false;
  }
  // The connect fails with the refusal's message; `untold` says why the listener could not
  // be told ("" when it was).
  Status finish(const std::string& untold) {
    if (fd_ >= 0) ::close(fd_);  // everything was sent (or nothing can be): a plain close
    fd_ = -1;
    const std::string where = wire_addr_string(head_.listener);
    R2CCL_WARN("connect on device %d: %s (%s %s%s%s)", dev_, refusal_.text,
               untold.empty() ? "told the listening process at"
                              : "could not tell the listening "
                                "process at",
               where.c_str(), untold.empty() ? "" : ": ", untold.c_str());
    return st_;
  }

  int dev_;
  HandleHead head_;
  WireRefusal refusal_;
  Status st_;
  int fd_ = -1;
  TimeUs start_ = 0;
  bool connected_ = false;
  size_t sent_ = 0;
};

}  // namespace

Status RuntimeBase::init_base(const Config* cfg, const Traits& traits, std::vector<RailInfo> rails,
                              std::vector<Device> devices, int mr_types, std::string knobs,
                              std::string* err) {
  cfg_ = cfg;
  traits_ = traits;
  devices_ = std::move(devices);
  mr_types_ = mr_types;
  knobs_ = std::move(knobs);
  std::string sink_err;
  if (!set_event_sink(cfg_->log_file, &sink_err)) {
    *err = sink_err;
    return Status::kInvalidUsage;
  }
  env_.cfg = cfg_;
  env_.health = health_params_from(*cfg_);
  env_.rails = this;
  links_ = std::make_unique<LinkTable>(env_.health);
  while (process_id_ == 0) process_id_ = rng_.next();
  env_.links = links_.get();
  if (!parse_test_hooks(cfg_->test_hooks, &env_.hooks, err)) return Status::kInvalidUsage;
  const TestHooks& h = env_.hooks;
  if (!h.replay || !h.guard.dedup || !h.guard.stale_guard || !h.bilateral_err)
    R2CCL_WARN("R2CCL_TEST_HOOKS=%s: protections are switched off; this is for tests only",
               cfg_->test_hooks.c_str());
  rails_ = std::move(rails);
  live_.reset(new RailLive[rails_.size()]);
  for (size_t i = 0; i < rails_.size(); ++i) live_[i].link_up = rails_[i].link_up;
  if (cfg_->health_board != "none") {
    std::string berr;
    if (board_.open(cfg_->health_board, &berr))
      board_rails_.resize(rails_.size());
    else
      R2CCL_WARN("health board off: %s", berr.c_str());
  }
  std::vector<PredictAgent::Rail> prails;
  for (size_t i = 0; i < rails_.size(); ++i) prails.push_back({rails_[i].predict, &live_[i]});
  predict_.init(*cfg_, std::move(prails), &board_, cfg_->health_board);
  return Status::kOk;
}

std::string RuntimeBase::banner() const {
  std::string s = std::to_string(devices_.size()) + " rails: ";
  for (size_t i = 0; i < devices_.size(); ++i) s += (i ? ", " : "") + devices_[i].description;
  return s + "; " + knobs_;
}

Status RuntimeBase::properties(int dev, DeviceProps* p) const {
  if (dev < 0 || dev >= device_count()) {
    R2CCL_WARN("getProperties: device %d does not exist (%d devices)", dev, device_count());
    return Status::kInternal;
  }
  const Device& d = devices_[dev];
  *p = DeviceProps{};
  p->name = d.name.c_str();
  p->pci_path = d.pci_path.empty() ? nullptr : d.pci_path.c_str();
  p->guid = d.guid;
  p->speed_mbps = rails_[d.rail].speed_mbps;
  p->ptr_support = mr_types_;
  p->port = d.port;
  return Status::kOk;
}

int RuntimeBase::arm_faults(const char* spec) {
  (void)spec;
  R2CCL_WARN(
      "armFaults: the in-process fault injector acts on TCP sockets; this process uses "
      "the %s transport (verbs faults come from the fake verbs provider, tests/fakeverbs)",
      traits_.name);
  return -1;
}

void RuntimeBase::new_identity(Listener* l) {
  l->listen_id = rng_.next();
  rng_.bytes(l->secret, sizeof(l->secret));
}

void RuntimeBase::start_background() {
  bg_ = std::thread([this] { bg_loop(); });
  bg_.detach();
}

void RuntimeBase::register_conn(Connection* c) {
  std::lock_guard<std::mutex> lk(registry_mu_);
  conns_.push_back(c);
  const uint64_t serial = next_serial_++;
  serial_of_[c] = serial;
  bg_conns_[serial].c = c;
  new_conns_.push_back(serial);
}

void RuntimeBase::unregister_conn(Connection* c) {
  // Taking the registry lock also waits out a background progress pass over `c`. Its
  // descriptors leave the epoll set when they close; stale serials in the background
  // thread's lists find no entry.
  std::lock_guard<std::mutex> lk(registry_mu_);
  conns_.erase(std::remove(conns_.begin(), conns_.end(), c), conns_.end());
  auto it = serial_of_.find(c);
  if (it != serial_of_.end()) {
    bg_conns_.erase(it->second);
    serial_of_.erase(it);
  }
}

// ------------------------------------------------------------------------------------------
// connect / accept / close

Status RuntimeBase::connect(int dev, int traffic_class, void* handle, Connection** out) {
  *out = nullptr;
  if (dev < 0 || dev >= device_count()) {
    R2CCL_WARN("connect: device %d does not exist (%d devices)", dev, device_count());
    return Status::kInternal;
  }
  using State = HandleConnectState<ConnIo>;
  ConnIo* io = State::get(handle, traits_.connect_magic);
  if (!io) {
    Status st = Status::kOk;
    std::unique_ptr<ConnIo> made = refuse_handle(dev, handle, &st);
    if (!made && st == Status::kOk) made = new_conn_io(dev, traffic_class, handle, nullptr, &st);
    if (!made) return st;
    io = made.release();
    State::set(handle, traits_.connect_magic, io);
  }
  void* done_io = nullptr;
  R2CCL_CHECK(State::step(handle, io, &done_io,
                          [&](ConnIo* c, bool* done) { return c->setup_step(done, now_us()); }));
  if (!done_io) return Status::kOk;
  auto* c = new Connection(env_, Role::kSend, dev,
                           std::unique_ptr<PathIo>(static_cast<ConnIo*>(done_io)), now_us());
  register_conn(c);
  *out = c;
  return Status::kOk;
}

Status RuntimeBase::accept(Listener* l, Connection** out) {
  *out = nullptr;
  // Refused by the peer that holds the handle (a transport or version mismatch): at once,
  // on every call, with the peer's message (logged once).
  std::string why;
  Status rs = l->refusal(&why);
  if (rs != Status::kOk) {
    if (l->building) l->building.reset();
    if (!l->refusal_logged) R2CCL_WARN("accept on device %d: %s", l->dev, why.c_str());
    l->refusal_logged = true;
    return rs;
  }
  if (!l->building) {
    Status st = Status::kOk;
    l->building = new_conn_io(l->dev, NCCL_NET_TRAFFIC_CLASS_UNDEF, nullptr, l, &st);
    if (!l->building) return st;
  }
  bool done = false;
  const Status s = l->building->setup_step(&done, now_us());
  if (s != Status::kOk) {
    l->building.reset();
    rs = l->refusal(&why);  // the transport took it from the peer during this step
    if (rs != Status::kOk && !l->refusal_logged) {
      R2CCL_WARN("accept on device %d: %s", l->dev, why.c_str());
      l->refusal_logged = true;
    }
    return s;
  }
  if (!done) return Status::kOk;
  auto* c = new Connection(env_, Role::kRecv, l->dev, std::move(l->building), now_us());
  register_conn(c);
  *out = c;
  return Status::kOk;
}

std::unique_ptr<ConnIo> RuntimeBase::refuse_handle(int dev, const void* handle, Status* st) {
  HandleHead head;
  memcpy(&head, handle, sizeof(head));
  const uint8_t mine = static_cast<uint8_t>(traits_.kind);
  if (head.magic == kOldIbHandleMagic || (head.magic == kHandleMagic && head.version < 3)) {
    // Before the common head (wire version 3): the listener cannot read a refusal either.
    R2CCL_WARN(
        "connect on device %d: the handle is an r2ccl %s handle of wire version %u; this process "
        "speaks %s version %u: every process of a job must run the same r2ccl",
        dev, head.magic == kOldIbHandleMagic ? "verbs" : "TCP", head.version,
        transport_kind_name(mine).c_str(), traits_.wire_version);
    *st = Status::kInvalidUsage;
    return nullptr;
  }
  if (head.magic != kHandleMagic || (head.kind == mine && head.version == traits_.wire_version))
    return nullptr;  // this transport's own handle, or no r2ccl handle: the transport checks
  const Refusal why = head.kind != mine ? Refusal::kTransport : Refusal::kVersion;
  const std::string text = why == Refusal::kTransport
                               ? transport_mismatch_text(mine, head.kind)
                               : version_mismatch_text(mine, traits_.wire_version, head.version);
  const WireRefusal r = make_refusal(why, traits_.kind, true, head.secret, head.listen_id, 0, text);
  return std::unique_ptr<ConnIo>(new RefusingConnect(dev, head, r, refusal_status(why)));
}

WireKnobs RuntimeBase::own_knobs(int streams) const {
  WireKnobs k{};
  k.chunk_size = static_cast<uint64_t>(cfg_->chunk_size);
  k.backup_paths = static_cast<uint8_t>(cfg_->backup_paths);
  k.streams = static_cast<uint8_t>(streams);
  k.stripe = cfg_->stripe ? 1 : 0;
  k.kind = static_cast<uint8_t>(traits_.kind);
  set_eager_threshold(&k, static_cast<uint64_t>(cfg_->eager_threshold));
  return k;
}

void RuntimeBase::close(Connection* c) {
  if (!c) return;
  unregister_conn(c);
  // After unregistering, the background thread can no longer pick the connection; NCCL has
  // stopped its proxy thread before closing. The token is free or freed within one pass.
  while (!c->try_enter()) {
  }
  // Eager isends that completed on their copy (R2CCL_EAGER_COPY) are NCCL's completed sends:
  // their bytes must reach the receiver before the paths close. Bounded: a receiver that is
  // gone fails the connection (error) or the bound ends the wait.
  const TimeUs t0 = now_us();
  const TimeUs bound = std::min<TimeUs>(cfg_->failover_timeout, 5 * kUsPerSec);
  while (c->eager_unacked() && c->error() == Status::kOk && now_us() - t0 < bound) {
    c->progress(now_us());
    if (c->eager_unacked()) usleep(50);
  }
  c->say_goodbye(now_us());
  delete c;
}

// ------------------------------------------------------------------------------------------
// Background thread

uint64_t RuntimeBase::idle_signature() {
  uint64_t sig = links_->events();
  for (size_t i = 0; i < rails_.size(); ++i) {
    const RailLive& l = live_[i];
    sig += l.down_events.load() + l.up_events.load() + l.addr_events.load();
    sig = sig * 3 + (l.predict_drain.load() ? 1 : 0);
  }
  return sig;
}

bool RuntimeBase::watch(uint64_t serial, TimeUs now) {
  if (epfd_ < 0) return false;
  BgConn& b = bg_conns_[serial];
  scratch_fds_.clear();
  if (!b.c->wait_fds(&scratch_fds_)) return false;
  for (const pollfd& f : scratch_fds_) {
    epoll_event ev{};
    ev.events = EPOLLONESHOT | ((f.events & POLLIN) ? EPOLLIN : 0u) |
                ((f.events & POLLOUT) ? EPOLLOUT : 0u);
    ev.data.u64 = serial;
    // Re-arm; a descriptor new to the set (a reconnected stream, or one whose number an
    // earlier, closed socket had) is added.
    if (epoll_ctl(epfd_, EPOLL_CTL_MOD, f.fd, &ev) != 0 && errno == ENOENT &&
        epoll_ctl(epfd_, EPOLL_CTL_ADD, f.fd, &ev) != 0)
      R2CCL_WARN("background thread: cannot watch descriptor %d: %s", f.fd, strerror(errno));
  }
  TimeUs due = b.c->idle_due(now);
  if (due == 0) due = now + kIdleTick;  // work under way: the tick
  b.due = due;
  b.watched = true;
  timers_.push({due, serial});
  return true;
}

void RuntimeBase::wake_conn(uint64_t serial, TimeUs now) {
  auto it = bg_conns_.find(serial);
  if (it == bg_conns_.end() || !it->second.watched) return;  // closed, or looked at already
  BgConn& b = it->second;
  b.watched = false;
  Connection* c = b.c;
  if (now - c->last_progress() < traits_.idle_progress_after || !c->try_enter()) {
    if (!b.active) active_.push_back(serial);
    b.active = true;
    return;
  }
  const TimeUs t = now_us();
  c->progress(t);
  if (!watch(serial, t)) {
    if (!b.active) active_.push_back(serial);
    b.active = true;
  }
  c->leave(t);
}

int RuntimeBase::idle_pass(TimeUs now) {
  // New connections start active: the proxy thread is about to drive them.
  for (uint64_t serial : new_conns_) {
    auto it = bg_conns_.find(serial);
    if (it == bg_conns_.end() || it->second.active) continue;
    it->second.active = true;
    active_.push_back(serial);
  }
  new_conns_.clear();
  // A rail event, a link's verdict or shadow-routing change, or a predicted drain: every
  // watched connection looks (Connection::idle_due counts on it).
  const uint64_t sig = idle_signature();
  if (sig != idle_sig_) {
    idle_sig_ = sig;
    std::vector<uint64_t> all;
    for (const auto& e : bg_conns_)
      if (e.second.watched) all.push_back(e.first);
    for (uint64_t serial : all) wake_conn(serial, now);
  }
  // Ready descriptors.
  epoll_event evs[256];
  int n;
  while ((n = epoll_wait(epfd_, evs, 256, 0)) > 0) {
    for (int i = 0; i < n; ++i) wake_conn(evs[i].data.u64, now_us());
    if (n < 256) break;
  }
  // Due timers (a superseded entry no longer matches its connection's).
  while (!timers_.empty() && timers_.top().first <= now) {
    const auto [due, serial] = timers_.top();
    timers_.pop();
    auto it = bg_conns_.find(serial);
    if (it != bg_conns_.end() && it->second.watched && it->second.due == due)
      wake_conn(serial, now_us());
  }
  // Active connections: idle ones are progressed, and watched once their transport can say
  // what they wait for (verbs cannot: progressed on every pass, as before).
  size_t keep = 0;
  for (size_t i = 0; i < active_.size(); ++i) {
    const uint64_t serial = active_[i];
    auto it = bg_conns_.find(serial);
    if (it == bg_conns_.end()) continue;
    BgConn& b = it->second;
    Connection* c = b.c;
    if (now - c->last_progress() < traits_.idle_progress_after || !c->try_enter()) {
      active_[keep++] = serial;
      continue;
    }
    const TimeUs t = now_us();
    c->progress(t);
    if (watch(serial, t)) {
      b.active = false;
    } else {
      active_[keep++] = serial;
    }
    c->leave(t);
  }
  active_.resize(keep);
  if (!active_.empty()) return traits_.bg_poll_ms;
  const TimeUs next =
      timers_.empty() ? now + kIdleWaitMax : std::min(timers_.top().first, now + kIdleWaitMax);
  return static_cast<int>(std::max<TimeUs>(next - now + kUsPerMs - 1, 0) / kUsPerMs);
}

void RuntimeBase::bg_loop() {
  // Netlink link notifications for the rails that have an interface (both transports; a
  // verbs port's own events come through the transport's descriptors).
  LinkMonitor monitor;
  const bool any_if = std::any_of(rails_.begin(), rails_.end(),
                                  [](const RailInfo& r) { return !r.ifname.empty(); });
  if (any_if && cfg_->link_events && monitor.open()) {
    // Re-read after subscribing, so no transition between init and now is missed.
    for (size_t i = 0; i < rails_.size(); ++i) {
      if (rails_[i].ifname.empty()) continue;
      const bool up = interface_running(rails_[i].ifname);
      if (live_[i].link_up.exchange(up) != up) (up ? live_[i].up_events : live_[i].down_events)++;
    }
  } else if (any_if && !cfg_->link_events) {
    R2CCL_INFO(NCCL_NET | NCCL_INIT, "link notifications off (R2CCL_LINK_EVENTS=0)");
  }
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0)
    R2CCL_WARN("background thread: epoll_create1: %s; idle connections are progressed every %d ms",
               strerror(errno), traits_.bg_poll_ms);
  std::vector<pollfd> fds;
  std::vector<LinkMonitor::Event> events;
  int timeout = 0;
  for (;;) {
    fds.clear();
    bg_add_fds(&fds);
    const size_t own = fds.size();
    if (monitor.fd() >= 0) fds.push_back({monitor.fd(), POLLIN, 0});
    // The watched connections' descriptors: readable epoll set.
    if (epfd_ >= 0) fds.push_back({epfd_, POLLIN, 0});
    ::poll(fds.data(), fds.size(), timeout);
    bg_on_fds(fds.data(), own, now_us());
    if (monitor.fd() >= 0) {
      events.clear();
      monitor.drain(&events);
      for (const auto& e : events) {
        if (e.address) {
          on_address_event(e.ifindex, e.when);
          continue;
        }
        for (size_t i = 0; i < rails_.size(); ++i) {
          if (rails_[i].ifname.empty() || rails_[i].ifname != e.ifname) continue;
          const bool was = live_[i].link_up.exchange(e.up);
          if (was == e.up) continue;
          (e.up ? live_[i].up_events : live_[i].down_events)++;
          R2CCL_INFO(NCCL_NET, "rail %s: link %s (netlink)", rails_[i].name.c_str(),
                     e.up ? "up" : (e.removed ? "removed" : "down"));
        }
      }
    }
    {
      std::lock_guard<std::mutex> lk(registry_mu_);
      timeout = idle_pass(now_us());
    }
    const TimeUs now = now_us();
    predict_.tick(now);
    publish_board(now);
  }
}

void RuntimeBase::publish_board(TimeUs now) {
  if (board_rails_.empty() || now < board_next_) return;
  board_next_ = now + kBoardPeriod;
  for (size_t i = 0; i < rails_.size(); ++i) {
    RailLive& l = live_[i];
    const bool up = l.link_up.load();
    board::RailFields f;
    board::set_text(f.name, sizeof(f.name), rails_[i].name);
    f.transport = traits_.board_kind;
    f.state = !up                         ? board::RailState::kDown
              : l.failed_paths.load() > 0 ? board::RailState::kFailed
              : l.predict_drain.load()    ? board::RailState::kDraining
                                          : board::RailState::kUp;
    f.usable_mbps = up ? static_cast<uint32_t>(rails_[i].speed_mbps) : 0;
    board_rails_[i].fill(l, now, up ? "path failure" : traits_.down_cause, &f);
    board_.publish(static_cast<int>(i), f);
  }
}

std::string RuntimeBase::stats_json() {
  std::ostringstream o;
  uint64_t sw = 0, rp = 0;
  o << "{\"transport\":\"" << board::transport_name(traits_.board_kind) << "\",\"rails\":[";
  for (size_t i = 0; i < rails_.size(); ++i) {
    RailLive& l = live_[i];
    const char* state = !l.link_up.load() ? "down" : l.failed_paths.load() > 0 ? "failed" : "up";
    if (i) o << ",";
    append_rail_json(o, rails_[i].name, state, l);
    sw += l.switchovers.load();
    rp += l.chunks_replayed.load();
  }
  o << "],\"switchovers\":" << sw << ",\"replays\":" << rp << ",\"links\":" << links_->size()
    << "}";
  return o.str();
}

}  // namespace r2ccl::net
