#include "transport/runtime_base.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "netlink/link_monitor.h"
#include "r2ccl/log.h"
#include "sock/rails.h"

namespace r2ccl::net {
namespace {

constexpr TimeUs kBoardPeriod = 100 * kUsPerMs;  // health board publish period

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
}

void RuntimeBase::unregister_conn(Connection* c) {
  // Taking the registry lock also waits out a background progress pass over `c`.
  std::lock_guard<std::mutex> lk(registry_mu_);
  conns_.erase(std::remove(conns_.begin(), conns_.end(), c), conns_.end());
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
    std::unique_ptr<ConnIo> made = new_conn_io(dev, traffic_class, handle, nullptr, &st);
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
  if (!l->building) {
    Status st = Status::kOk;
    l->building = new_conn_io(l->dev, NCCL_NET_TRAFFIC_CLASS_UNDEF, nullptr, l, &st);
    if (!l->building) return st;
  }
  bool done = false;
  const Status s = l->building->setup_step(&done, now_us());
  if (s != Status::kOk) {
    l->building.reset();
    return s;
  }
  if (!done) return Status::kOk;
  auto* c = new Connection(env_, Role::kRecv, l->dev, std::move(l->building), now_us());
  register_conn(c);
  *out = c;
  return Status::kOk;
}

void RuntimeBase::close(Connection* c) {
  if (!c) return;
  unregister_conn(c);
  // After unregistering, the background thread can no longer pick the connection; NCCL has
  // stopped its proxy thread before closing. The token is free or freed within one pass.
  while (!c->try_enter()) {
  }
  c->say_goodbye(now_us());
  delete c;
}

// ------------------------------------------------------------------------------------------
// Background thread

void RuntimeBase::progress_idle_conns() {
  const TimeUs now = now_us();
  std::lock_guard<std::mutex> lk(registry_mu_);
  for (Connection* c : conns_) {
    if (now - c->last_progress() < traits_.idle_progress_after) continue;
    if (!c->try_enter()) continue;
    const TimeUs t = now_us();
    c->progress(t);
    c->leave(t);
  }
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
  std::vector<pollfd> fds;
  std::vector<LinkMonitor::Event> events;
  for (;;) {
    fds.clear();
    bg_add_fds(&fds);
    const size_t own = fds.size();
    if (monitor.fd() >= 0) fds.push_back({monitor.fd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), traits_.bg_poll_ms);
    bg_on_fds(fds.data(), own, now_us());
    if (monitor.fd() >= 0) {
      events.clear();
      monitor.drain(&events);
      for (const auto& e : events) {
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
    progress_idle_conns();
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
  o << "],\"switchovers\":" << sw << ",\"replays\":" << rp << "}";
  return o.str();
}

}  // namespace r2ccl::net
