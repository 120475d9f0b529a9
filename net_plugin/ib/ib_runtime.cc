#include "ib/ib_runtime.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "ib/ib_conn.h"
#include "r2ccl/log.h"

namespace r2ccl::net::ib {
namespace {

constexpr int kBgPollMs = 5;
// The background thread progresses a connection the proxy thread has not touched for this
// long (an idle connection still needs probes, failure detection and failback).
constexpr TimeUs kIdleProgressAfter = 10 * kUsPerMs;
constexpr TimeUs kBoardPeriod = 100 * kUsPerMs;  // health board publish period

std::mutex g_mu;
IbRuntime* g_rt = nullptr;  // never destroyed: the background thread may outlive main()

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
  R2CCL_WARN("verbs side channel on loopback (%s): no other interface has an address; set "
             "R2CCL_SOCKET_IFNAME for multi-node jobs", rails[0].name.c_str());
  *out = rails[0];
  return true;
}

}  // namespace

IbRuntime* IbRuntime::peek() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_rt;
}

Status IbRuntime::choose(bool* use_ib, std::string* why, std::string* err) {
  *use_ib = false;
  const Config* cfg = nullptr;
  if (!process_config(&cfg, err)) return Status::kInvalidUsage;
  const std::string& t = cfg->transport;
  if (t != "auto" && t != "ib" && t != "tcp") {
    *err = "R2CCL_TRANSPORT='" + t + "': accepted values are auto, ib and tcp";
    return Status::kInvalidUsage;
  }
  if (t == "tcp") {
    *why = "R2CCL_TRANSPORT=tcp";
    return Status::kOk;
  }
  std::string e;
  const VerbsApi* v = VerbsApi::load(cfg->ibverbs_lib, &e);
  if (!v) {
    if (t == "ib") {
      *err = "R2CCL_TRANSPORT=ib: " + e;
      return Status::kSystem;
    }
    if (getenv("R2CCL_IBVERBS_LIB"))  // set on purpose: its failure must not pass unnoticed
      R2CCL_WARN("R2CCL_TRANSPORT=auto: %s; using the TCP transport", e.c_str());
    *why = "no verbs library (" + e + ")";
    return Status::kOk;
  }
  std::unique_ptr<HcaSet> set;
  if (!HcaSet::discover(v, *cfg, &set, err)) return Status::kInvalidUsage;
  if (!set->any_active()) {
    if (t == "ib") {
      *err = "R2CCL_TRANSPORT=ib: no active HCA port" +
             std::string(cfg->ib_hca.empty() ? "" : " selected by R2CCL_IB_HCA=" + cfg->ib_hca) +
             " (" + std::to_string(set->hcas().size()) + " ports found)";
      return Status::kSystem;
    }
    *why = std::to_string(set->hcas().size()) + " HCA ports, none active";
    return Status::kOk;
  }
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_rt) {
    auto* rt = new IbRuntime();
    Status s = rt->init(cfg, v, std::move(set), err);
    if (s != Status::kOk) {
      delete rt;
      return s;
    }
    g_rt = rt;
  }
  *use_ib = true;
  *why = t == "ib" ? "R2CCL_TRANSPORT=ib" : "auto: an HCA port is active";
  return Status::kOk;
}

Status IbRuntime::init(const Config* cfg, const VerbsApi* v, std::unique_ptr<HcaSet> set,
                       std::string* err) {
  cfg_ = cfg;
  v_ = v;
  set_ = std::move(set);
  if (!parse_test_hooks(cfg_->test_hooks, &hooks_, err)) return Status::kInvalidUsage;
  if (!hooks_.replay || !hooks_.guard.dedup || !hooks_.bilateral_err)
    R2CCL_WARN("R2CCL_TEST_HOOKS=%s: protections are switched off; this is for tests only",
               cfg_->test_hooks.c_str());
  std::string sink_err;
  if (!set_event_sink(cfg_->log_file, &sink_err)) {
    *err = sink_err;
    return Status::kInvalidUsage;
  }
  if (!pick_side_rail(*cfg_, &side_rail_, err)) return Status::kInvalidUsage;
  health_ = health_params_from(*cfg_);
  const auto& h = set_->hcas();
  live_.reset(new HcaLive[h.size()]);
  for (size_t i = 0; i < h.size(); ++i) {
    live_[i].port_active = h[i].active;
    if (h[i].active && h[i].gid_index >= 0) devices_.push_back(static_cast<int>(i));
    ibv_pd* pd = h[i].pd;
    size_t same = i;
    for (size_t j = 0; j < i; ++j)
      if (h[j].pd == pd) same = j;
    if (same != i) {  // another port of the same device: its PD, its cache
      mr_cache_of_.push_back(mr_cache_of_[same]);
      continue;
    }
    const VerbsApi* vv = v_;
    mr_cache_of_.push_back(mr_caches_.size());
    mr_caches_.emplace_back(new MrCache(
        [vv, pd](uintptr_t start, size_t len, std::string* e) -> void* {
          ibv_mr* mr = vv->reg_mr(pd, reinterpret_cast<void*>(start), len,
                                  IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                      IBV_ACCESS_REMOTE_READ);
          if (!mr) *e = std::string("ibv_reg_mr: ") + strerror(errno);
          return mr;
        },
        [vv](void* mr) { vv->dereg_mr(static_cast<ibv_mr*>(mr)); },
        static_cast<size_t>(sysconf(_SC_PAGESIZE))));
  }
  if (devices_.empty()) {
    *err = "no active HCA port has a usable GID (check R2CCL_IB_GID_INDEX / "
           "R2CCL_IB_ADDR_FAMILY / R2CCL_IB_ADDR_RANGE)";
    return Status::kSystem;
  }
  // Async events are read without blocking by the background thread.
  for (const auto& x : h) {
    int fl = fcntl(x.ctx->async_fd, F_GETFL);
    if (fl >= 0) fcntl(x.ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
  }
  if (cfg_->health_board != "none") {
    std::string berr;
    if (board_.open(cfg_->health_board, &berr)) board_rails_.resize(h.size());
    else R2CCL_WARN("health board off: %s", berr.c_str());
  }
  std::vector<PredictAgent::Rail> prails;
  for (size_t i = 0; i < h.size(); ++i) {
    predict::RailSpec ps;
    ps.name = h[i].name + ":" + std::to_string(h[i].port);  // as on the board
    ps.kind = predict::RailSpec::Kind::kIb;
    ps.device = h[i].name;
    ps.port = h[i].port;
    prails.push_back({ps, &live_[i]});
  }
  predict_.init(*cfg_, std::move(prails), &board_, cfg_->health_board);
  bg_ = std::thread([this] { bg_loop(); });
  bg_.detach();
  return Status::kOk;
}

std::vector<int> IbRuntime::path_set(int primary) const {
  std::vector<int> out{primary};
  const auto& h = hcas();
  for (int i : backup_order(h, primary)) {
    if (static_cast<int>(out.size()) > cfg_->backup_paths) break;
    if (h[i].link_layer != h[primary].link_layer || h[i].gid_index < 0) continue;
    if (std::find(devices_.begin(), devices_.end(), i) == devices_.end()) continue;
    out.push_back(i);
  }
  return out;
}

HcaInfo IbRuntime::hca_snapshot(int i) {
  std::lock_guard<std::mutex> g(hca_mu_);
  return hcas()[i];
}

void IbRuntime::register_conn(IbConn* c) {
  std::lock_guard<std::mutex> g(registry_mu_);
  conns_.push_back(c);
}

void IbRuntime::unregister_conn(IbConn* c) {
  std::lock_guard<std::mutex> g(registry_mu_);
  conns_.erase(std::remove(conns_.begin(), conns_.end(), c), conns_.end());
}

uint64_t IbRuntime::random_u64() { return rng_.next(); }

void IbRuntime::random_bytes(void* out, size_t n) { rng_.bytes(out, n); }

void IbRuntime::handle_async(int i) {
  const auto& h = hcas();
  ibv_context* ctx = h[i].ctx;
  for (int k = 0; k < 64; ++k) {
    ibv_async_event ev;
    if (v_->get_async_event(ctx, &ev) != 0) return;  // EAGAIN: drained
    const ibv_event_type t = ev.event_type;
    int port = (t == IBV_EVENT_PORT_ERR || t == IBV_EVENT_PORT_ACTIVE || t == IBV_EVENT_GID_CHANGE ||
                t == IBV_EVENT_LID_CHANGE)
                   ? ev.element.port_num
                   : 0;
    v_->ack_async_event(&ev);
    for (size_t j = 0; j < h.size(); ++j) {
      if (h[j].ctx != ctx || (port != 0 && h[j].port != port)) continue;
      HcaLive& l = live_[j];
      if (t == IBV_EVENT_PORT_ERR) {
        if (l.port_active.exchange(false)) l.port_err_events++;
        log_event("%s:%d port error event (port down)", h[j].name.c_str(), h[j].port);
      } else if (t == IBV_EVENT_PORT_ACTIVE) {
        bool changed = false;
        {
          std::lock_guard<std::mutex> g(hca_mu_);
          changed = set_->refresh_port(static_cast<int>(j), nullptr);
        }
        if (changed) l.gid_changes++;
        if (!l.port_active.exchange(true)) l.port_active_events++;
        log_event("%s:%d port active event", h[j].name.c_str(), h[j].port);
      } else if (t == IBV_EVENT_GID_CHANGE || t == IBV_EVENT_LID_CHANGE) {
        bool active = false, changed = false;
        {
          std::lock_guard<std::mutex> g(hca_mu_);
          changed = set_->refresh_port(static_cast<int>(j), &active);
        }
        if (changed) {
          l.gid_changes++;
          log_event("%s:%d address change: GID re-selected, now %s", h[j].name.c_str(),
                    h[j].port, describe(hca_snapshot(static_cast<int>(j))).c_str());
        }
      } else {
        R2CCL_WARN("%s: async event %s", h[j].name.c_str(), v_->event_type_str(t));
      }
      if (port == 0) break;
    }
  }
}

void IbRuntime::progress_idle_conns() {
  TimeUs now = now_us();
  std::lock_guard<std::mutex> lk(registry_mu_);
  for (IbConn* c : conns_) {
    if (now - c->last_progress() < kIdleProgressAfter) continue;
    if (!c->try_enter()) continue;
    c->progress(now_us());
    c->leave();
  }
}

void IbRuntime::bg_loop() {
  const auto& h = hcas();
  std::vector<pollfd> fds;
  std::vector<int> owner;  // fds[k] belongs to HCA owner[k] (first port of the device)
  for (size_t i = 0; i < h.size(); ++i) {
    bool seen = false;
    for (int o : owner) seen |= h[o].ctx == h[i].ctx;
    if (seen) continue;
    fds.push_back({h[i].ctx->async_fd, POLLIN, 0});
    owner.push_back(static_cast<int>(i));
  }
  for (;;) {
    for (auto& f : fds) f.revents = 0;
    ::poll(fds.data(), fds.size(), kBgPollMs);
    for (size_t k = 0; k < fds.size(); ++k)
      if (fds[k].revents & POLLIN) handle_async(owner[k]);
    progress_idle_conns();
    const TimeUs now = now_us();
    predict_.tick(now);
    publish_board(now);
  }
}

void IbRuntime::publish_board(TimeUs now) {
  if (board_rails_.empty() || now < board_next_) return;
  board_next_ = now + kBoardPeriod;
  const auto& h = hcas();
  for (size_t i = 0; i < h.size(); ++i) {
    HcaLive& l = live_[i];
    const bool up = l.port_active.load();
    board::RailFields f;
    snprintf(f.name, sizeof(f.name), "%s:%d", h[i].name.c_str(), h[i].port);
    f.transport = board::Transport::kIb;
    f.state = !up ? board::RailState::kDown
              : l.failed_paths.load() > 0 ? board::RailState::kFailed
              : l.predict_drain.load()    ? board::RailState::kDraining
                                          : board::RailState::kUp;
    f.usable_mbps = up ? static_cast<uint32_t>(h[i].speed_mbps) : 0;
    board_rails_[i].fill(l, now, up ? "path failure" : "port error", &f);
    board_.publish(static_cast<int>(i), f);
  }
}

std::string IbRuntime::stats_json() {
  std::ostringstream o;
  uint64_t sw = 0, rp = 0;
  o << "{\"transport\":\"ib\",\"rails\":[";
  const auto& h = hcas();
  for (size_t i = 0; i < h.size(); ++i) {
    HcaLive& l = live_[i];
    const char* state = !l.port_active.load() ? "down" : l.failed_paths.load() > 0 ? "failed" : "up";
    if (i) o << ",";
    append_rail_json(o, h[i].name + ":" + std::to_string(h[i].port), state, l);
    sw += l.switchovers.load();
    rp += l.chunks_replayed.load();
  }
  o << "],\"switchovers\":" << sw << ",\"replays\":" << rp << "}";
  return o.str();
}

}  // namespace r2ccl::net::ib
