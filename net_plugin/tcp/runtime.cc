#include "runtime.h"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "../engine/test_hooks.h"
#include "conn.h"
#include "link_monitor.h"
#include "r2ccl/log.h"
#include "../sock/socket_util.h"

namespace r2ccl::net {
namespace {

constexpr TimeUs kIncomingHelloTimeout = 2 * kUsPerSec;
constexpr int kBgPollMs = 2;              // background loop period
constexpr TimeUs kIdleProgressAfter = 2 * kUsPerMs;
constexpr TimeUs kBoardPeriod = 100 * kUsPerMs;  // health board publish period

std::mutex g_rt_mu;
Runtime* g_rt = nullptr;        // never destroyed: the background thread may outlive main()
Status g_rt_status = Status::kOk;
std::string g_rt_error;
bool g_rt_tried = false;

}  // namespace

Runtime* Runtime::peek() {
  std::lock_guard<std::mutex> lk(g_rt_mu);
  return g_rt;
}

Status Runtime::get(Runtime** out, std::string* err) {
  std::lock_guard<std::mutex> lk(g_rt_mu);
  if (!g_rt_tried) {
    g_rt_tried = true;
    auto* rt = new Runtime();
    g_rt_status = rt->init(&g_rt_error);
    if (g_rt_status == Status::kOk) g_rt = rt;
    // On failure the half-built runtime is leaked on purpose: its listeners are closed by
    // init, and nothing else refers to it.
  }
  if (g_rt_status != Status::kOk) {
    if (err) *err = g_rt_error;
    return g_rt_status;
  }
  *out = g_rt;
  return Status::kOk;
}

Status Runtime::init(std::string* err) {
  if (!process_config(&cfg_, err)) return Status::kInvalidUsage;
  std::string sink_err;
  if (!set_event_sink(cfg_->log_file, &sink_err)) {
    *err = sink_err;
    return Status::kInvalidUsage;
  }
  std::string var = getenv("R2CCL_SOCKET_IFNAME")  ? "R2CCL_SOCKET_IFNAME"
                    : getenv("NCCL_SOCKET_IFNAME") ? "NCCL_SOCKET_IFNAME"
                                                   : "auto-detection";
  if (!select_rails(cfg_->socket_ifname, var, system_interfaces(),
                    static_cast<int>(cfg_->speed_mbps), &rails_, err))
    return Status::kInvalidUsage;
  TestHooks hooks;
  if (!parse_test_hooks(cfg_->test_hooks, &hooks, err)) return Status::kInvalidUsage;
  guard_ = hooks.guard;
  replay_ = hooks.replay;
  if (!replay_ || !guard_.dedup || !guard_.stale_guard)
    R2CCL_WARN("R2CCL_TEST_HOOKS=%s: protections are switched off; this is for tests only",
               cfg_->test_hooks.c_str());
  std::vector<FaultSpec> faults;
  if (!parse_fault_specs(cfg_->fault_inject, &faults, err)) return Status::kInvalidUsage;
  rank_ = static_cast<int>(cfg_->rank);
  for (const auto& f : faults)
    if (f.rail >= static_cast<int>(rails_.size())) {
      *err = "R2CCL_FAULT_INJECT names rail " + std::to_string(f.rail) + " but there are only " +
             std::to_string(rails_.size()) + " rails";
      return Status::kInvalidUsage;
    }
  FaultInjector::instance().configure(faults, rank_);
  if (FaultInjector::instance().enabled())
    R2CCL_WARN("fault injection armed for rank %d: %s", rank_, cfg_->fault_inject.c_str());

  health_ = health_params_from(*cfg_);

  live_.reset(new RailLive[rails_.size()]);
  for (size_t i = 0; i < rails_.size(); ++i) {
    live_[i].link_up = interface_running(rails_[i].ifname);
    int fd = open_rail_listener(rails_[i], err);
    if (fd < 0) {
      for (int f : listen_fds_) ::close(f);
      listen_fds_.clear();
      return Status::kSystem;
    }
    listen_fds_.push_back(fd);
    listen_ports_.push_back(local_port(fd));
  }
  if (cfg_->health_board != "none") {
    std::string berr;
    if (board_.open(cfg_->health_board, &berr)) board_rails_.resize(rails_.size());
    else R2CCL_WARN("health board off: %s", berr.c_str());
  }
  std::vector<PredictAgent::Rail> prails;
  for (size_t i = 0; i < rails_.size(); ++i) {
    predict::RailSpec ps;
    ps.name = rails_[i].name;
    ps.kind = predict::RailSpec::Kind::kEth;
    ps.device = rails_[i].ifname;
    prails.push_back({ps, &live_[i]});
  }
  predict_.init(*cfg_, std::move(prails), &board_, cfg_->health_board);
  bg_ = std::thread([this] { bg_loop(); });
  bg_.detach();
  return Status::kOk;
}

void Runtime::fill_wire_rails(HelloBody* h) const {
  h->n_rails = static_cast<uint32_t>(std::min<size_t>(rails_.size(), kMaxRails));
  for (uint32_t i = 0; i < h->n_rails; ++i) {
    WireRail& w = h->rails[i];
    memset(&w, 0, sizeof(w));
    w.family = static_cast<uint8_t>(rails_[i].family);
    w.prefix_len = static_cast<uint8_t>(rails_[i].prefix_len);
    w.port = listen_ports_[i];
    memcpy(w.addr, addr_bytes(rails_[i].addr), rails_[i].family == AF_INET ? 4 : 16);
    snprintf(w.name, sizeof(w.name), "%s", rails_[i].name.c_str());
  }
}

void Runtime::register_listen(ListenComm* l) {
  std::lock_guard<std::mutex> lk(registry_mu_);
  listens_.push_back(l);
}
void Runtime::unregister_listen(ListenComm* l) {
  std::lock_guard<std::mutex> lk(registry_mu_);
  listens_.erase(std::remove(listens_.begin(), listens_.end(), l), listens_.end());
}
void Runtime::register_conn(Conn* c) {
  std::lock_guard<std::mutex> lk(registry_mu_);
  conns_.push_back(c);
}
void Runtime::unregister_conn(Conn* c) {
  // Taking the registry lock also waits out a background progress pass over `c`.
  std::lock_guard<std::mutex> lk(registry_mu_);
  conns_.erase(std::remove(conns_.begin(), conns_.end(), c), conns_.end());
}

uint64_t Runtime::random_u64() { return rng_.next(); }

void Runtime::random_bytes(void* out, size_t n) { rng_.bytes(out, n); }

// ------------------------------------------------------------------------------------------
// Background thread.

void Runtime::accept_new(int rail) {
  for (int k = 0; k < 16; ++k) {
    sockaddr_storage from;
    socklen_t fl = sizeof(from);
    int fd = ::accept4(listen_fds_[rail], reinterpret_cast<sockaddr*>(&from), &fl,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    set_socket_options(fd, cfg_->tcp_user_timeout);
    Pending p;
    p.fd = fd;
    p.rail = rail;
    p.deadline = now_us() + kIncomingHelloTimeout;
    p.got = 0;
    pending_.push_back(p);
  }
}

void Runtime::service_handshakes() {
  TimeUs now = now_us();
  for (size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    bool drop = false, complete = false;
    const char* why = nullptr;
    // The in-process injector acts on the listener's sockets too: a black-holed or reset
    // rail answers no hello (it times out or is dropped).
    auto fault = FaultInjector::instance().query(p.rail, now);
    if (fault.down || fault.blackhole) {
      if (now > p.deadline || fault.down) {
        ::close(p.fd);
        pending_[i] = pending_.back();
        pending_.pop_back();
      } else {
        ++i;
      }
      continue;
    }
    while (!drop && p.got < sizeof(p.buf)) {
      ssize_t n = ::recv(p.fd, p.buf + p.got, sizeof(p.buf) - p.got, MSG_DONTWAIT);
      if (n == 0) {
        drop = true;
        why = "closed before its hello";
      } else if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          drop = true;
          why = strerror(errno);
        }
        break;
      } else {
        p.got += static_cast<size_t>(n);
        if (p.got >= sizeof(FrameHeader)) {
          FrameHeader h;
          memcpy(&h, p.buf, sizeof(h));
          if (h.magic != kFrameMagic || h.type != static_cast<uint8_t>(FrameType::kHello) ||
              h.len != sizeof(HelloBody)) {
            drop = true;
            why = "not an r2ccl hello";
          }
        }
      }
    }
    if (!drop && p.got == sizeof(p.buf)) complete = true;
    if (!drop && !complete && now > p.deadline) {
      drop = true;
      why = "no hello within 2 s";
    }
    if (complete) {
      Incoming in;
      in.fd = p.fd;
      in.local_rail = p.rail;
      memcpy(&in.hello, p.buf + sizeof(FrameHeader), sizeof(HelloBody));
      std::lock_guard<std::mutex> lk(registry_mu_);
      Conn* target_conn = nullptr;
      ListenComm* target_listen = nullptr;
      bool bad_secret = false;
      if (in.hello.flags & kHelloReconnect) {
        for (Conn* c : conns_)
          if (c->id() == in.hello.conn_id && c->role() == Role::kRecv) {
            if (memcmp(c->secret(), in.hello.secret, 16) == 0) target_conn = c;
            else bad_secret = true;
          }
      } else {
        for (ListenComm* l : listens_)
          if (l->listen_id == in.hello.listen_id) {
            if (memcmp(l->secret, in.hello.secret, 16) == 0) target_listen = l;
            else bad_secret = true;
          }
      }
      if (!target_conn && !target_listen) {
        drop = true;
        why = bad_secret ? "wrong secret" : "unknown connection or listen id";
      } else {
        // HELLO_ACK: our rails, and the secret echoed back (the connector checks it).
        char out[sizeof(FrameHeader) + sizeof(HelloBody)];
        FrameHeader h{};
        h.magic = kFrameMagic;
        h.type = static_cast<uint8_t>(FrameType::kHelloAck);
        h.len = sizeof(HelloBody);
        HelloBody b{};
        memcpy(b.secret, in.hello.secret, 16);
        b.conn_id = in.hello.conn_id;
        fill_wire_rails(&b);
        memcpy(out, &h, sizeof(h));
        memcpy(out + sizeof(h), &b, sizeof(b));
        ssize_t n = ::send(p.fd, out, sizeof(out), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n != static_cast<ssize_t>(sizeof(out))) {
          drop = true;
          why = "could not answer the hello";
        } else if (in.hello.flags & kHelloQuery) {
          ::close(p.fd);  // answered: the connector now knows our rails
        } else if (target_conn) {
          target_conn->push_incoming(in);
        } else {
          std::lock_guard<std::mutex> il(target_listen->inbox_mu);
          target_listen->inbox.push_back(in);
        }
      }
    }
    if (drop) {
      sockaddr_storage peer;
      socklen_t pl = sizeof(peer);
      std::string from = getpeername(p.fd, reinterpret_cast<sockaddr*>(&peer), &pl) == 0
                             ? addr_to_string(peer)
                             : std::string("?");
      // An aborted reconnect (closed before its hello) is routine; anything else is not.
      if (why && strcmp(why, "closed before its hello") == 0)
        R2CCL_INFO(NCCL_NET, "connection on rail %s from %s closed before its hello",
                   rails_[p.rail].name.c_str(), from.c_str());
      else {
        // At most one WARN a second per reason: a misconfigured or hostile peer must not flood
        // the log, and a new kind of refusal is always shown.
        Refusals& rf = refusals_[why ? why : "?"];
        if (now - rf.last_warn >= kUsPerSec) {
          R2CCL_WARN("refused a connection on rail %s from %s: %s%s", rails_[p.rail].name.c_str(),
                     from.c_str(), why ? why : "?",
                     rf.suppressed ? (" (" + std::to_string(rf.suppressed) +
                                      " more like it in the last second)").c_str()
                                   : "");
          rf.last_warn = now;
          rf.suppressed = 0;
        } else {
          ++rf.suppressed;
        }
      }
      ::close(p.fd);
    }
    if (drop || complete) {
      pending_[i] = pending_.back();
      pending_.pop_back();
    } else {
      ++i;
    }
  }
}

void Runtime::progress_idle_conns() {
  TimeUs now = now_us();
  std::lock_guard<std::mutex> lk(registry_mu_);
  for (Conn* c : conns_) {
    if (now - c->last_progress() < kIdleProgressAfter) continue;
    if (!c->try_enter()) continue;
    c->progress(now);
    c->leave();
  }
}

void Runtime::bg_loop() {
  LinkMonitor monitor;
  if (cfg_->link_events && monitor.open()) {
    link_events_active_ = true;
    // Re-read after subscribing, so no transition between init and now is missed.
    for (size_t i = 0; i < rails_.size(); ++i) {
      bool up = interface_running(rails_[i].ifname);
      if (live_[i].link_up.exchange(up) != up) (up ? live_[i].up_events : live_[i].down_events)++;
    }
  } else if (!cfg_->link_events) {
    R2CCL_INFO(NCCL_NET | NCCL_INIT, "link notifications off (R2CCL_LINK_EVENTS=0)");
  }
  std::vector<pollfd> fds;
  std::vector<LinkMonitor::Event> events;
  for (;;) {
    fds.clear();
    for (int fd : listen_fds_) fds.push_back({fd, POLLIN, 0});
    if (monitor.fd() >= 0) fds.push_back({monitor.fd(), POLLIN, 0});
    for (const auto& p : pending_) fds.push_back({p.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), kBgPollMs);
    for (size_t r = 0; r < listen_fds_.size(); ++r)
      if (fds[r].revents & POLLIN) accept_new(static_cast<int>(r));
    if (!pending_.empty()) service_handshakes();
    if (monitor.fd() >= 0) {
      events.clear();
      monitor.drain(&events);
      for (const auto& e : events) {
        for (size_t i = 0; i < rails_.size(); ++i) {
          if (rails_[i].ifname != e.ifname) continue;
          bool was = live_[i].link_up.exchange(e.up);
          if (was == e.up) continue;
          if (e.up) live_[i].up_events++;
          else live_[i].down_events++;
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

void Runtime::publish_board(TimeUs now) {
  if (board_rails_.empty() || now < board_next_) return;
  board_next_ = now + kBoardPeriod;
  for (size_t i = 0; i < rails_.size(); ++i) {
    RailLive& l = live_[i];
    const bool up = l.link_up.load();
    board::RailFields f;
    board::set_text(f.name, sizeof(f.name), rails_[i].name);
    f.transport = board::Transport::kTcp;
    f.state = !up ? board::RailState::kDown
              : l.failed_paths.load() > 0 ? board::RailState::kFailed
              : l.predict_drain.load()    ? board::RailState::kDraining
                                          : board::RailState::kUp;
    f.usable_mbps = up ? static_cast<uint32_t>(rails_[i].speed_mbps) : 0;
    board_rails_[i].fill(l, now, up ? "path failure" : "link down", &f);
    board_.publish(static_cast<int>(i), f);
  }
}

std::string Runtime::stats_json() {
  std::ostringstream o;
  uint64_t sw = 0, rp = 0;
  o << "{\"rails\":[";
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
