#include "engine/connection.h"

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <cstring>

#include "r2ccl/log.h"

namespace r2ccl::net {
namespace {

constexpr size_t kHistory = 64;              // completed receives kept for duplicates
constexpr size_t kMaxQueuedCtrl = 8192;      // bound on control messages waiting for a path
constexpr TimeUs kByeGrace = 1 * kUsPerSec;  // pending requests after the peer's BYE
// Eager credit: each eager message costs its bytes plus this much (so the area also bounds
// how many messages it holds); the area is the larger of kMinEagerArea and 4 messages of the
// threshold's size. Both ends compute it from the negotiated threshold.
constexpr uint64_t kEagerEntryCost = 256;
constexpr uint64_t kMinEagerArea = 256 * 1024;
// A receive no larger than the eager threshold expects its message eagerly and posts its CTS
// only if still waiting after this long (ARCHITECTURE.md, "Eager messages").
constexpr TimeUs kSmallCtsDelay = 1 * kUsPerMs;
// How long the acknowledgement of a consumed eager message may wait for company (its sender's
// request completed on the copy; the ACK frees the copy and returns credit).
constexpr TimeUs kAckHold = 200;
constexpr size_t kMaxHeldAcks = 16;
uint64_t eager_cost(uint64_t len) { return len + kEagerEntryCost; }

std::string cause_text(FailCause c, const std::string& detail) {
  std::string s = fail_cause_name(c);
  if (!detail.empty()) s += ": " + detail;
  return s;
}

// "silent for 320 ms[, the transport last heard the peer 310 ms ago]" (heard: INT64_MAX when
// the transport cannot tell).
std::string silence(const char* what, TimeUs for_us, TimeUs heard) {
  char d[112];
  if (heard == INT64_MAX)
    snprintf(d, sizeof(d), "%s for %.0f ms", what, for_us / 1e3);
  else
    snprintf(d, sizeof(d), "%s for %.0f ms, the transport last heard the peer %.0f ms ago", what,
             for_us / 1e3, heard / 1e3);
  return d;
}

const char* result_name(Status st) {
  switch (st) {
    case Status::kRemote: return "ncclRemoteError";
    case Status::kSystem: return "ncclSystemError";
    case Status::kInvalidUsage: return "ncclInvalidUsage";
    default: return "ncclInternalError";
  }
}

}  // namespace

Connection::Connection(const ConnEnv& env, Role role, int dev, std::unique_ptr<PathIo> io,
                       TimeUs now)
    : env_(env), cfg_(*env.cfg), role_(role), dev_(dev), io_(std::move(io)) {
  caps_ = io_->caps();
  id_ = io_->conn_id();
  chunk_ = io_->chunk_size();
  eager_thr_ = caps_.eager ? std::min(io_->eager_threshold(), chunk_) : 0;
  eager_area_ = eager_thr_ > 0 ? std::max(kMinEagerArea, 4 * eager_cost(eager_thr_)) : 0;
  for (auto& r : reqs_) r.conn = this;
  const int n = io_->npaths();
  paths_.resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    Path& p = paths_[i];
    const PathDesc& d = io_->path(i);
    p.index = i;
    p.rail = d.rail;
    p.label = d.label;
    p.health = std::make_unique<PathHealth>(env_.health,
                                            d.up ? PathState::kHealthy : PathState::kFailed, now);
    p.last_alive = p.ack_progress = p.last_probe = now;
    p.link_id = new_link_path_id();
    attach_link(p);
    RailLive& rl = live(p);
    p.down_seen = rl.down_events.load();
    p.up_seen = rl.up_events.load();
    p.addr_seen = rl.addr_events.load();
    if (!d.up) {
      rl.failed_paths++;
      p.counted_failed = true;
    }
  }
  last_progress_.store(now);
}

Connection::~Connection() {
  for (auto& p : paths_) {
    resign_prober(p);
    if (p.counted_failed) live(p).failed_paths--;
    withdraw_goodput(p, p.last_send);
  }
}

// ------------------------------------------------------------------------------------------
// Paths

std::string Connection::rail_name(int rail) const {
  return rail >= 0 && rail < env_.rails->rail_count() ? env_.rails->rail_name(rail) : "?";
}

// A path that carries data, or could (draining). A path that is only probing does not
// count: a rail that reconnects but never passes its probes must not hold off give-up.
bool Connection::usable(const Path& p) const {
  const PathState s = p.health->state();
  return (s == PathState::kHealthy || s == PathState::kDraining) && io_->ready(p.index);
}

bool Connection::any_usable() const {
  for (const auto& p : paths_)
    if (usable(p)) return true;
  return false;
}

const Request* Connection::stranded() const {
  for (const Request* r : active_) {
    if (r->kind != Request::Kind::kSend || r->allowed == kAllPaths) continue;
    bool ok = false;
    for (const auto& p : paths_) ok |= p.index < 32 && ((r->allowed >> p.index) & 1u) && usable(p);
    if (!ok) return r;
  }
  return nullptr;
}

namespace {
// "0, 2" for the paths of `mask` among n.
std::string path_list(uint32_t mask, int n) {
  std::string s;
  for (int i = 0; i < n && i < 32; ++i)
    if ((mask >> i) & 1u) s += (s.empty() ? "" : ", ") + std::to_string(i);
  return s.empty() ? "none" : s;
}
}  // namespace

// Control traffic: the preferred path when usable, else the first healthy one, then a
// draining one, then one that is probing; -1 when none is connected.
int Connection::control_path(int prefer) const {
  if (prefer >= 0 && prefer < npaths() && usable(paths_[prefer])) return prefer;
  for (const auto& p : paths_)
    if (p.health->state() == PathState::kHealthy && io_->ready(p.index)) return p.index;
  for (const auto& p : paths_)
    if (usable(p)) return p.index;
  for (const auto& p : paths_)
    if (p.health->connected() && io_->ready(p.index)) return p.index;
  return -1;
}

int Connection::first_carrier() const {
  for (const auto& p : paths_)
    if (p.health->carries_data() && io_->ready(p.index)) return p.index;
  return -1;
}

void Connection::charge_rail(Path& p) {
  RailLive& rl = live(p);
  rl.paths_failed++;
  rl.switchovers += p.pending_switchovers;
  p.pending_switchovers = 0;
  p.charge_pending = false;
  if (!p.counted_failed && !p.health->connected()) {
    rl.failed_paths++;
    p.counted_failed = true;
  }
}

// A peer-caused failure becomes a rail failure once the peer shows it is alive after it: a
// frame on another path more than a heartbeat period later (what a process that died sent
// before it died arrives within that), or any path reconnecting. A gone peer never does.
void Connection::settle_charges(TimeUs now) {
  (void)now;
  if (peer_gone_ || gave_up_) return;
  for (auto& p : paths_) {
    if (!p.charge_pending) continue;
    bool alive = false;
    for (const auto& q : paths_)
      if (q.index != p.index && q.health->connected() &&
          q.last_alive > p.failed_at + cfg_.heartbeat_interval)
        alive = true;
    if (alive) charge_rail(p);
  }
}

bool Connection::peer_known_gone() const {
  if (peer_gone_) return true;
  if (role_ != Role::kSend) return false;
  bool refused = false;
  for (const auto& p : paths_) {
    if (p.health->connected()) return false;
    const RailLive& rl = env_.rails->live(p.rail);
    const bool local_down = !rl.link_up.load() || !rl.has_addr.load();
    if (!p.refused && !p.unreachable && !local_down) return false;
    refused |= p.refused;
  }
  return refused;
}

std::string Connection::peer_text() const {
  const std::string n = io_->peer_name();
  return n.empty() ? "the peer process" : "the peer process at " + n;
}

void Connection::mark_recovered(Path& p) {
  if (!p.counted_failed) return;
  live(p).failed_paths--;
  p.counted_failed = false;
}

// The peer's process is stalled (stopped, swapping, descheduled), not its rails broken, when
// no path has heard anything of it for longer than a heartbeat period while the transport
// below still hears its machine on some path (TCP: its kernel's ACKs of our heartbeats).
// Failing paths then would turn a pause into reconnects and replays on every rail; the
// heartbeat rule and the watchdog wait, for at most R2CCL_FAILOVER_TIMEOUT of such silence.
// A rail that breaks while the peer lives still fails at once: the peer's heartbeats keep
// arriving on its other paths. One path alone cannot tell the two apart and is never exempt.
bool Connection::peer_stalled(TimeUs now) const {
  // Runs on every progress pass: the transport is asked (TCP: a TCP_INFO read per stream)
  // only once the peer has been silent everywhere for a heartbeat period.
  const TimeUs hb = cfg_.heartbeat_interval;
  int connected = 0;
  TimeUs newest = 0;
  for (const auto& p : paths_) {
    if (!p.health->connected() || !io_->ready(p.index)) continue;
    ++connected;
    newest = std::max({newest, p.last_alive, p.link->heard.load(std::memory_order_relaxed)});
  }
  const TimeUs silent = now - newest;
  if (connected < 2 || silent <= hb || silent >= cfg_.failover_timeout) return false;
  for (const auto& p : paths_)
    if (p.health->connected() && io_->ready(p.index) && io_->heard_within(p.index, now) <= 3 * hb)
      return true;
  return false;
}

void Connection::check_paths(TimeUs now) {
  const TimeUs hb = cfg_.heartbeat_interval;
  // If this process itself was not scheduled for a while (an overloaded host), the silence
  // it sees is its own: shift the liveness clocks by the gap instead of blaming the paths. An
  // idle connection is checked every RuntimeBase::kIdleTick (25 ms) or when something
  // arrives: gaps up to a heartbeat period are its normal cadence.
  // (Not the last sign of life of a path that follows its link's prober: it was not expected
  // to hear anything, and its link's verdict compares against it.)
  if (last_check_ != 0 && now - last_check_ > hb) {
    const TimeUs gap = now - last_check_;
    for (auto& p : paths_) {
      if (p.health->state() == PathState::kProbing ||
          p.link->prober.load(std::memory_order_relaxed) == p.link_id)
        p.last_alive += gap;
      p.ack_progress += gap;
    }
  }
  last_check_ = now;
  // While the sender may be waiting for acknowledgements (a receive outstanding, or one
  // completed less than 4 acknowledgement timeouts ago: its last acknowledgement may still be
  // in a TCP stream recovering a loss) the receiver beats 4 times per timeout. The sender's
  // watchdog takes "the transport below heard the peer within the timeout" as proof that a
  // rail without acknowledgements is alive, so that proof must never be a heartbeat period
  // old; the beats also let the stalled stream's kernel see the loss (SACK) and repair it
  // sooner than by timeout. Otherwise (and at the sender) one beat per period.
  const bool awaiting = role_ == Role::kRecv &&
                        ((last_recv_done_ != 0 && now - last_recv_done_ < 4 * cfg_.ack_timeout) ||
                         std::any_of(active_.begin(), active_.end(), [](const Request* r) {
                           return r->kind == Request::Kind::kRecv && !r->done;
                         }));
  const TimeUs beat = awaiting ? std::min(hb, std::max<TimeUs>(cfg_.ack_timeout / 4, 1)) : hb;
  const bool stalled = peer_stalled(now);
  for (auto& p : paths_) {
    // The watchdog counts again from when the paused peer can answer.
    if (stalled) p.ack_progress = std::max(p.ack_progress, now);
    check_rail_events(p, now);
    RailLive& rl = live(p);
    if (!p.health->connected()) {
      // Failback: the sending side reconnects once the link is up, the rail has an address,
      // and backoff/hold-down allow.
      if (role_ == Role::kSend && !p.reconnecting && !p.gate_pending && rl.link_up.load() &&
          rl.has_addr.load() && p.health->should_reconnect(now) &&
          io_->can_reconnect(p.index, *this)) {
        p.reconnecting = true;
        io_->reconnect(p.index, *this, now);
      }
      continue;
    }
    if (!io_->ready(p.index)) continue;  // the peer is re-creating the path
    const bool probing = p.health->state() == PathState::kProbing;
    // Shadow routing is the link's: every sending path of it drains and returns together.
    if (role_ == Role::kSend && p.health->set_draining(p.link->shadowed.load()))
      R2CCL_INFO(NCCL_NET, "path %d (%s) of conn %016" PRIx64 " %s (shadow routing on its link)",
                 p.index, p.label.c_str(), id_,
                 p.health->carries_data() ? "carries traffic again" : "drained");
    // Probes. The link's prober beats every period whether or not the last one was answered:
    // it is how the peer hears this end (its transport's ACK clock too) while the other
    // direction waits (a TCP stream in retransmission backoff holds the answer back). A
    // reconnected path proves itself with its own probes, the next once one is answered. An
    // awaiting receiver beats on every path (the sender's watchdog asks each path's
    // transport whether it heard the peer).
    if (!probing && follow_verdict(p, now)) continue;
    const bool prober = !probing && link_prober(p, now);
    // A busy sending path whose acknowledgements stall probes too, 4 times per
    // R2CCL_ACK_TIMEOUT: the watchdog asks its transport whether the peer's machine still
    // answers (TCP: the kernel's last ACK), and a path that only waits for acknowledgements
    // sends nothing its kernel could have had answered (a starved receiver process then looked
    // like a black hole).
    // (Only where the transport has such evidence: verbs cannot tell, and its probes would
    // only queue behind the stalled writes.)
    const bool acks_stalled = role_ == Role::kSend && p.inflight_bytes > 0 &&
                              now - p.ack_progress >= cfg_.ack_timeout / 2 &&
                              io_->heard_within(p.index, now) != INT64_MAX;
    const bool beats = probing || prober || awaiting || acks_stalled;
    const TimeUs period =
        acks_stalled ? std::min(beat, std::max<TimeUs>(cfg_.ack_timeout / 4, 1)) : beat;
    if (beats && (now - p.last_probe >= period || (probing && !p.probe_out))) {
      const bool superseded = p.probe_out;
      if (io_->probe(p.index, *this, now)) {
        p.probe_out = true;
        p.probe_sent = p.last_probe = now;
        if (prober) p.link->probed_at.store(now, std::memory_order_relaxed);
        // Without an echo of its send time (verbs completions carry no id) the next answer may
        // be the earlier probe's: no RTT then.
        p.probe_idle = !superseded && p.inflight_bytes == 0;
        p.sent[p.sent_next++ % 8] = {now, p.inflight_bytes == 0};
      }
      if (!p.health->connected()) continue;  // posting the probe failed the path
    }
    const TimeUs floor = io_->stall_floor(p.index);
    if (prober && check_link(p, stalled, now)) continue;
    if (probing) {
      // A reconnected path's own heartbeat rule (it has no share in its link's liveness yet).
      // If the transport below still hears from the peer (TCP: the kernel's ACKs), the rail
      // works and the peer process is merely slow. Neither this rule nor the watchdog calls a
      // path dead while the transport below may still recover it itself (verbs: two QP
      // retransmissions), and the watchdog also waits until what is in flight was due at the
      // rail's speed (a 64 MiB chunk takes 5.4 ms at 100 Gbps): one rule for both transports
      // (ARCHITECTURE.md, detection table).
      if (now - p.last_alive > std::max(3 * hb, floor) && !stalled) {
        const TimeUs heard = io_->heard_within(p.index, now);
        if (heard > 3 * hb) {
          fail_path(p, FailCause::kHeartbeatMiss,
                    silence("silent", now - p.last_alive, heard).c_str(), now);
          continue;
        }
      }
    }
    // Acknowledgement watchdog (sender): chunks in flight, no acknowledgement progress. A
    // black hole also silences the transport below; a congested or lossy-but-alive rail
    // (TCP recovering a drop) still gets its ACKs, so the watchdog then waits 10x longer.
    // inflight bytes x 8 / Mbps = microseconds
    const TimeUs due = static_cast<TimeUs>(
        p.inflight_bytes * 8 /
        static_cast<uint64_t>(std::max(1, env_.rails->rail_speed_mbps(p.rail))));
    if (role_ == Role::kSend && !stalled &&
        ack_watchdog_expired(p.inflight_bytes > 0, p.ack_progress, now,
                             std::max(cfg_.ack_timeout, floor) + due)) {
      const TimeUs heard = io_->heard_within(p.index, now);
      if (heard > cfg_.ack_timeout ||
          now - p.ack_progress > std::max(10 * cfg_.ack_timeout, floor) + due) {
        fail_path(p, FailCause::kAckTimeout, silence("none", now - p.ack_progress, heard).c_str(),
                  now);
        continue;
      }
    }
  }
  // Unanswered failure notices go out again (the path they left on may have died too).
  for (auto& n : notices_) {
    if (now - n.sent_at < 2 * hb) continue;
    n.sent_at = now;
    send_notice(n);
  }
  for (auto& n : addr_notices_) {
    if (now - n.sent_at < 2 * hb) continue;
    n.sent_at = now;
    CtrlMsg m;
    m.type = CtrlType::kAddr;
    m.id = n.id;
    m.path = static_cast<uint16_t>(n.rail);
    queue_ctrl(m);
  }
}

void Connection::attach_link(Path& p) {
  const uint64_t key = io_->link_key(p.index);
  if (p.link && key == p.link_key && key != 0) return;
  resign_prober(p);
  p.link_key = key;
  p.link = env_.links ? env_.links->get(key) : std::make_shared<LinkLive>(env_.health);
  p.verdicts_seen = p.link->verdicts.load();
}

bool Connection::link_prober(Path& p, TimeUs now) {
  LinkLive& l = *p.link;
  uint64_t cur = l.prober.load(std::memory_order_acquire);
  if (cur == p.link_id) return true;
  const TimeUs hb = cfg_.heartbeat_interval;
  const bool sends = role_ == Role::kSend;
  const bool stopped = cur != 0 && now - l.probed_at.load(std::memory_order_relaxed) > 3 * hb;
  if (cur != 0 && !stopped && !(sends && !l.prober_sends.load(std::memory_order_relaxed)))
    return false;
  if (!l.prober.compare_exchange_strong(cur, p.link_id, std::memory_order_acq_rel)) return false;
  l.prober_sends.store(sends, std::memory_order_relaxed);
  l.probed_at.store(now, std::memory_order_relaxed);
  p.prober_since = now;
  p.last_probe = 0;  // probe now
  return true;
}

void Connection::resign_prober(Path& p) {
  if (!p.link) return;
  uint64_t me = p.link_id;
  // Another path of the link takes over at its next check; idle ones are woken for it.
  if (p.link->prober.compare_exchange_strong(me, 0, std::memory_order_acq_rel) && env_.links)
    env_.links->note_event();
}

// Heartbeat rule, applied by the link's prober: nothing heard on the link for 3 periods. If
// the transport below still hears from the peer (TCP: the kernel's ACKs of this path's
// probes), the rail works and the peer process is merely slow. A path that just became the
// prober has not probed long enough for its transport's evidence to count. Never sooner than
// the transport's own recovery could work (verbs: two QP retransmissions; ARCHITECTURE.md,
// detection table). On the connection's last usable path the rule waits 10 periods instead
// of 3: with no other path, a peer process that is merely descheduled (an overloaded host) looks
// like a dead link, since its kernel's ACKs may wait for it too (a socket it holds locked, or a
// delayed ACK), and failing the path would move the traffic nowhere (seen in a CI run: the
// surviving rail of a 2-rail lab failed after 90 ms of such silence, and came back 51 ms later).
bool Connection::check_link(Path& p, bool stalled, TimeUs now) {
  LinkLive& l = *p.link;
  const TimeUs hb = cfg_.heartbeat_interval;
  const TimeUs heard = std::max(p.last_alive, l.heard.load(std::memory_order_relaxed));
  if (stalled || now - heard <= std::max(3 * hb, io_->stall_floor(p.index)) ||
      now - p.prober_since <= 3 * hb)
    return false;  // the common case, without looking at the other paths
  const bool survivor = std::any_of(paths_.begin(), paths_.end(),
                                    [&](const Path& q) { return &q != &p && usable(q); });
  const TimeUs rule = (survivor ? 3 : 10) * hb;
  if (now - heard <= rule) return false;
  const TimeUs below = io_->heard_within(p.index, now);
  if (below <= rule) return false;
  l.silent_since.store(heard, std::memory_order_relaxed);
  p.verdicts_seen = l.verdicts.fetch_add(1, std::memory_order_release) + 1;
  if (env_.links) env_.links->note_event();  // wakes the link's idle connections
  fail_path(p, FailCause::kHeartbeatMiss, silence("silent", now - heard, below).c_str(), now);
  return true;
}

// The prober's verdict fails every other path of the link that has not heard anything within
// the last period. One that did (a busy path reading what reached its socket before the
// fault, or a flow the fault spared: black holes in a fabric may hit some 5-tuples only) must
// hear something new within one more period, or it fails too.
bool Connection::follow_verdict(Path& p, TimeUs now) {
  const TimeUs hb = cfg_.heartbeat_interval;
  LinkLive& l = *p.link;
  const uint32_t v = l.verdicts.load(std::memory_order_acquire);
  if (v != p.verdicts_seen) {
    p.verdicts_seen = v;
    if (now - p.last_alive <= hb) {
      p.verdict_at = now;
      p.alive_at_verdict = p.last_alive;
      return false;
    }
  } else if (p.verdict_at == 0 || p.last_alive > p.alive_at_verdict) {
    p.verdict_at = 0;
    return false;
  } else if (now - p.verdict_at <= hb) {
    return false;
  }
  const TimeUs since = l.silent_since.load(std::memory_order_relaxed);
  p.verdict_at = 0;
  fail_path(
      p, FailCause::kHeartbeatMiss,
      silence("the link silent", now - since, INT64_MAX).append(" (its prober's finding)").c_str(),
      now);
  return true;
}

void Connection::check_rail_events(Path& p, TimeUs now) {
  RailLive& rl = live(p);
  const uint32_t down = rl.down_events.load(std::memory_order_relaxed);
  if (down != p.down_seen) {
    p.down_seen = down;
    if (!rl.link_up.load() && p.health->connected())
      fail_path(p, FailCause::kLinkDown, env_.rails->link_event_source(), now);
  }
  const uint32_t up = rl.up_events.load(std::memory_order_relaxed);
  if (up != p.up_seen) {
    p.up_seen = up;
    p.health->on_link_up(now);
    // The peer may be backing off its reconnects to this rail: tell it the rail is back.
    if (rl.link_up.load() && rl.has_addr.load()) announce_rail(p.rail, now);
  }
  const uint32_t addr = rl.addr_events.load(std::memory_order_acquire);
  if (addr == p.addr_seen) return;
  p.addr_seen = addr;
  // The path's sockets use the old address: nothing sent on them arrives any more.
  if (p.health->connected() && io_->address_stale(p.index))
    fail_path(p, FailCause::kAddressChanged,
              rl.has_addr.load() ? "the rail's local address was replaced"
                                 : "the rail's local address was removed",
              now);
  if (rl.has_addr.load()) {
    p.health->on_link_up(now);  // reconnect from the new address now, not after backoff
    if (rl.link_up.load()) announce_rail(p.rail, now);
  }
}

void Connection::announce_rail(int rail, TimeUs now) {
  if (!caps_.address_notices) return;
  for (const auto& n : addr_notices_)
    if (n.rail == rail && n.sent_at == now) return;  // another path on the rail just told it
  addr_notices_.erase(std::remove_if(addr_notices_.begin(), addr_notices_.end(),
                                     [&](const AddrNotice& n) { return n.rail == rail; }),
                      addr_notices_.end());
  addr_notices_.push_back({next_notice_++, rail, now});
  CtrlMsg m;
  m.type = CtrlType::kAddr;
  m.id = addr_notices_.back().id;
  m.path = static_cast<uint16_t>(rail);
  queue_ctrl(m);
}

void Connection::fail_path(Path& p, FailCause cause, const char* detail_c, TimeUs now) {
  const std::string detail = detail_c ? detail_c : "";
  const bool was_data = p.health->carries_data();
  const int first_data = first_carrier();
  const TimeUs last_alive = std::max(p.last_alive, p.ack_progress);
  if (!p.health->on_failure(cause, now)) return;  // exactly once per failure
  const bool from_peer = cause == FailCause::kPeerNotice;
  resign_prober(p);
  p.verdict_at = 0;
  p.probe_out = false;
  p.peer_drain = false;  // learnt again after the path comes back
  p.drain_sent = false;
  p.inflight_bytes = 0;
  p.goodput.on_stop();
  withdraw_goodput(p, now);
  io_->stop_path(p.index, from_peer, now);
  p.failed_at = now;
  p.pending_switchovers = 0;
  p.charge_pending = cause_means_peer_gone(cause) || peer_gone_ || peer_closed_;
  if (!p.charge_pending) charge_rail(p);
  const std::string rail = rail_name(p.rail);
  // Evidence of the fault's start: an injector knows it; otherwise the last sign of life.
  TimeUs fault_at = io_->fault_start(p.index, now);
  if (fault_at == 0 || fault_at < last_alive - 1000 * kUsPerMs) fault_at = last_alive;
  const double detect_ms = fault_at > 0 && fault_at <= now ? (now - fault_at) / 1e3 : 0.0;
  const bool gate =
      role_ == Role::kSend && caps_.quiesce_before_replay && env_.hooks.bilateral_err && !from_peer;
  log_event("path on rail %s failed (%s) at the %s end of conn %016" PRIx64 "%s", rail.c_str(),
            cause_text(cause, detail).c_str(), role_ == Role::kSend ? "sending" : "receiving", id_,
            gate ? "; replay waits for the receiver's QP error transition" : "");
  if (p.health->take_holddown_started())
    log_event("hold-down: rail %s flapped %d times within %.0f s; not used for %.1f s",
              rail.c_str(), static_cast<int>(cfg_.holddown_flaps), cfg_.holddown_window / 1e6,
              p.health->current_holddown() / 1e6);
  if (role_ == Role::kSend) {
    Recovery rec{p.index, cause,     detail,
                 now,     detect_ms, was_data && (cfg_.stripe || p.index == first_data),
                 0,       {}};
    gated_.erase(std::remove_if(gated_.begin(), gated_.end(),
                                [&](const Recovery& g) { return g.path == p.index; }),
                 gated_.end());
    gated_.push_back(rec);
    p.gate_pending = gate;
    if (!gate) open_gate(p, now);
  } else {
    // Every chunk that landed before the path stopped counts before the landed state goes
    // to the sender (verbs: its completions are in the CQ already).
    if (caps_.quiesce_before_replay) io_->quiesce(p.index, *this, now);
    // CTS the sender may not have got go again on a surviving path.
    for (Request* r : active_)
      if (r->kind == Request::Kind::kRecv && !r->cts_delivered) r->cts_path = -1;
    queue_recv_state(-1);
  }
  if (!from_peer) {  // tell the other end; re-sent until answered
    notices_.push_back({next_notice_++, p.index, io_->generation(p.index), now, cause});
    send_notice(notices_.back());
  }
  resend_notices(now);
}

// Sender: the failed path's unacknowledged chunks go back to their messages' queues and are
// sent again on a survivor.
void Connection::open_gate(Path& p, TimeUs now) {
  (void)now;
  p.gate_pending = false;
  auto it = std::find_if(gated_.begin(), gated_.end(),
                         [&](const Recovery& g) { return g.path == p.index; });
  if (it == gated_.end()) return;
  Recovery rec = *it;
  gated_.erase(it);
  for (Request* r : active_) {
    if (r->kind != Request::Kind::kSend) continue;
    const int n = r->smsg.fail_path(p.index, env_.hooks.replay);
    if (n > 0) {
      rec.replayed += n;
      rec.seqs.push_back(r->seq);
    }
  }
  p.inflight_bytes = 0;
  const int next = first_carrier();
  const std::string to = next >= 0 ? "rail " + rail_name(paths_[next].rail) : "no usable rail";
  const std::string rail = rail_name(p.rail);
  if (rec.carried || rec.replayed > 0) {
    if (p.charge_pending)
      p.pending_switchovers++;
    else
      live(p).switchovers++;
    log_event("switchover: rail %s failed (%s); path %d of conn %016" PRIx64
              " -> %s; %d chunks to replay%s",
              rail.c_str(), cause_text(rec.cause, rec.detail).c_str(), p.index, id_, to.c_str(),
              rec.replayed,
              env_.hooks.replay || rec.replayed == 0 ? "" : " (not replayed: test hook no_replay)");
    recoveries_.push_back(std::move(rec));
  } else {
    log_event("backup path on rail %s failed (%s); conn %016" PRIx64 " keeps %s", rail.c_str(),
              cause_text(rec.cause, rec.detail).c_str(), id_, to.c_str());
  }
}

void Connection::check_recoveries(TimeUs now) {
  for (auto it = recoveries_.begin(); it != recoveries_.end();) {
    bool done = any_usable();
    for (uint64_t seq : it->seqs) {
      const Request* r = find_active(seq);
      if (r && r->smsg.replay_outstanding() > 0) done = false;
    }
    if (!done) {
      ++it;
      continue;
    }
    // Under the test hook no_replay nothing was replayed: the line says so.
    const bool hooked = !env_.hooks.replay && it->replayed > 0;
    char tail[80] = "";
    if (hooked)
      snprintf(tail, sizeof(tail), "; %d in flight not replayed (test hook no_replay)",
               it->replayed);
    log_event(
        "Successfully recovered in %.3f s (rail %s: %s, detected after %.0f ms, %d chunks "
        "replayed)%s",
        (now - it->detect) / 1e6, rail_name(paths_[it->path].rail).c_str(),
        fail_cause_name(it->cause), it->detect_ms, hooked ? 0 : it->replayed, tail);
    it = recoveries_.erase(it);
  }
}

// ------------------------------------------------------------------------------------------
// Control traffic

void Connection::queue_ctrl(const CtrlMsg& m, int prefer) {
  if (ctrlq_.size() >= kMaxQueuedCtrl) {
    // Nothing has been able to leave for a long while: drop the oldest acknowledgement (the
    // landed state is sent again whole after the next failure or reconnect).
    auto it = std::find_if(ctrlq_.begin(), ctrlq_.end(),
                           [](const PendingCtrl& q) { return q.m.type == CtrlType::kAck; });
    if (it == ctrlq_.end()) return;
    ctrlq_.erase(it);
  }
  ctrlq_.push_back({m, prefer});
}

void Connection::flush_ctrl(TimeUs now) {
  while (!ctrlq_.empty()) {
    const PendingCtrl& q = ctrlq_.front();
    const int cp = control_path(q.prefer);
    CtrlMsg m = q.m;
    if (m.type == CtrlType::kAck) m.credit = eager_freed_;  // the latest, whatever is queued
    // No path at all: the transport's fallback channel, if it has one (verbs side channel).
    const PostResult r = io_->post_ctrl(cp, m, *this, now);
    if (r == PostResult::kFull) return;
    if (r == PostResult::kPosted) ctrlq_.pop_front();
    // kFailed: the path failed while posting; try the next one.
  }
}

// Receiver: everything that landed (prefix + 64-chunk bitmaps of every receive with landed
// chunks, and the recently completed ones whole), so the sender replays only the rest.
// Supersedes acknowledgements still queued.
void Connection::queue_recv_state(int prefer) {
  ctrlq_.erase(std::remove_if(ctrlq_.begin(), ctrlq_.end(),
                              [](const PendingCtrl& q) { return q.m.type == CtrlType::kAck; }),
               ctrlq_.end());
  held_acks_.clear();  // the history below covers them
  held_credit_ = 0;
  for (Request* r : active_) {
    if (r->kind != Request::Kind::kRecv || r->rmsg.landed_count() == 0) continue;
    CtrlMsg a;
    a.type = CtrlType::kAck;
    a.seq = r->seq;
    a.prefix = r->rmsg.prefix();
    const uint32_t first = a.prefix / 64 * 64;
    for (uint32_t base = first; base == first || base < r->rmsg.span(); base += 64) {
      const uint64_t bm = r->rmsg.window_bitmap(base);
      if (base != first && !bm) continue;
      a.base = base;
      a.bitmap = bm;
      queue_ctrl(a, prefer);
    }
    r->dirty_windows.clear();
  }
  for (const auto& d : history_) {
    CtrlMsg a;
    a.type = CtrlType::kAck;
    a.seq = d.seq;
    a.prefix = d.nchunks;
    queue_ctrl(a, prefer);
  }
  for (const auto& e : area_) {  // eager messages stored before their irecv
    if (!e->landed) continue;
    CtrlMsg a;
    a.type = CtrlType::kAck;
    a.seq = e->seq;
    a.prefix = 1;
    queue_ctrl(a, prefer);
  }
}

void Connection::send_notice(const Notice& n) {
  for (const auto& q : ctrlq_)
    if (q.m.type == CtrlType::kFail && q.m.id == n.id) return;  // still waiting to leave
  CtrlMsg m;
  m.type = CtrlType::kFail;
  m.id = n.id;
  m.path = static_cast<uint16_t>(n.path);
  m.gen = n.gen;
  m.cause = n.cause;
  queue_ctrl(m);
}

void Connection::resend_notices(TimeUs now) {
  for (auto& n : notices_) {
    n.sent_at = now;
    send_notice(n);
  }
}

void Connection::on_ctrl(int via, const CtrlMsg& m, TimeUs now) {
  if (gave_up_ || (peer_closed_ && m.type != CtrlType::kAck)) return;
  if (m.type == CtrlType::kAck) {
    if (role_ != Role::kSend) return;
    // Credit is cumulative: the largest value wins; never more than was spent.
    if (m.credit > eager_freed_seen_) eager_freed_seen_ = std::min(m.credit, eager_sent_);
    on_ack(m.seq, m.prefix, m.base, m.bitmap, now);
    return;
  }
  if (m.type == CtrlType::kTruncated) {
    const Request* r = role_ == Role::kRecv ? find_active(m.seq) : nullptr;
    if (!r) return;  // not ours (any more)
    eager_truncated(m.seq, m.size, r->size, now);
    return;
  }
  if (m.type == CtrlType::kAddr) {
    // The backend has recorded the peer's rail and told on_peer_address for its paths.
    CtrlMsg a;
    a.type = CtrlType::kAddrAck;
    a.id = m.id;
    a.path = m.path;
    queue_ctrl(a, via);
    return;
  }
  if (m.type == CtrlType::kAddrAck) {
    addr_notices_.erase(std::remove_if(addr_notices_.begin(), addr_notices_.end(),
                                       [&](const AddrNotice& n) { return n.id == m.id; }),
                        addr_notices_.end());
    return;
  }
  if (m.path >= paths_.size()) {
    R2CCL_WARN("conn %016" PRIx64 ": control message for path %u of %zu ignored", id_, m.path,
               paths_.size());
    return;
  }
  Path& p = paths_[m.path];
  const bool current = m.gen == io_->generation(p.index);
  switch (m.type) {
    case CtrlType::kFail: {
      // A notice naming the path it came on is stale (that path works): ignore it.
      if (current && via != p.index) {
        if (p.health->connected() && m.cause == FailCause::kAddressChanged)
          fail_path(p, FailCause::kAddressChanged, "the peer's address on the rail changed", now);
        else if (p.health->connected())
          fail_path(p, FailCause::kPeerNotice, "the peer declared it failed", now);
        else if (role_ == Role::kRecv)
          queue_recv_state(-1);  // its FAIL_ACK promises it
        else if (p.gate_pending)
          open_gate(p, now);
      } else if (role_ == Role::kRecv) {
        queue_recv_state(-1);
      }
      CtrlMsg a;
      a.type = CtrlType::kFailAck;
      a.id = m.id;
      a.path = m.path;
      a.gen = m.gen;
      queue_ctrl(a, via);
      break;
    }
    case CtrlType::kFailAck:
      notices_.erase(std::remove_if(notices_.begin(), notices_.end(),
                                    [&](const Notice& n) { return n.id == m.id; }),
                     notices_.end());
      if (role_ == Role::kSend && current && p.gate_pending) open_gate(p, now);
      break;
    case CtrlType::kDrain:
      if (role_ != Role::kSend || p.peer_drain == m.on) break;
      p.peer_drain = m.on;
      log_event("r2ccl predict: the peer %s its end of path %d (%s) of conn %016" PRIx64 ": %s",
                m.on ? "drains" : "no longer drains", p.index, p.label.c_str(), id_,
                m.on ? "no new chunks on it" : "it carries data again");
      break;
    default: break;
  }
}

// ------------------------------------------------------------------------------------------
// Sender

void Connection::on_cts(uint64_t seq, uint64_t cap, const RemoteBuffer& remote, TimeUs now) {
  (void)now;
  if (role_ != Role::kSend) return;
  if (seq < next_send_seq_) return;  // duplicate after a failover
  for (const auto& c : cts_)
    if (c.seq == seq) return;
  if (seq >= next_send_seq_ + 4 * NCCL_NET_MAX_REQUESTS) return;  // not a plausible receive
  auto it = cts_.begin();
  while (it != cts_.end() && it->seq < seq) ++it;
  cts_.insert(it, Cts{seq, cap, remote});
}

void Connection::on_ack(uint64_t seq, uint32_t prefix, uint32_t base, uint64_t bitmap, TimeUs now) {
  Request* r = find_active(seq);
  if (!r || r->kind != Request::Kind::kSend) return;
  r->smsg.apply_ack(prefix, base, bitmap, [&](int path, uint32_t len) {
    if (path < 0 || path >= npaths()) return;
    Path& q = paths_[path];
    q.inflight_bytes = q.inflight_bytes > len ? q.inflight_bytes - len : 0;
    q.ack_progress = now;
    if (q.goodput.on_ack(len, q.inflight_bytes, 4 * chunk_, now)) publish_goodput(q, now);
  });
  finish_send_if_complete(r);
}

void Connection::on_chunk_acked(int path, uint64_t seq, uint32_t idx, TimeUs now) {
  on_path_alive(path, now);
  on_ack(seq, 0, idx, 1, now);
}

void Connection::finish_send_if_complete(Request* r) {
  if (!r->smsg.complete()) return;
  r->done = true;
  remove_active(r);
  if (r->internal) r->used = false;  // nobody tests it: back to the pool
}

// A path with nothing in flight that got no chunk for this long is `starving` (scheduler.h):
// it may take a chunk while a faster path is full, so its estimate stays current.
constexpr TimeUs kStarveUs = 100 * kUsPerMs;
// A path idle for this long withdraws its goodput from its rail's load.
constexpr TimeUs kWithdrawUs = 2 * PathGoodput::kMaxSampleUs;

void Connection::publish_goodput(Path& p, TimeUs now) {
  const auto kbps = static_cast<uint64_t>(p.goodput.mbps() * 1000.0);
  rail_publish(live(p), static_cast<int64_t>(kbps) - static_cast<int64_t>(p.published_kbps), true,
               now);
  p.published_kbps = kbps;
}

void Connection::withdraw_goodput(Path& p, TimeUs now) {
  if (p.published_kbps == 0) return;
  rail_publish(live(p), -static_cast<int64_t>(p.published_kbps), false, now);
  p.published_kbps = 0;
}

void Connection::schedule_chunks(TimeUs now) {
  std::vector<PathLoad>& loads = loads_;  // reused: no allocation on the data path
  loads.resize(paths_.size());
  for (size_t i = 0; i < paths_.size(); ++i) {
    Path& p = paths_[i];
    const bool ready = io_->ready(p.index);
    // A rail the failure predictor drains (at either end) is used like a path draining for
    // RTT outliers: only when nothing else can carry data.
    const bool predicted =
        p.peer_drain || env_.rails->live(p.rail).predict_drain.load(std::memory_order_relaxed);
    if (p.inflight_bytes == 0 && p.published_kbps != 0 && now - p.last_send > kWithdrawUs)
      withdraw_goodput(p, now);
    const double weight =
        env_.hooks.goodput ? path_weight(p.goodput.measured(), p.goodput.mbps(),
                                         rail_spare_mbps(live(p), p.published_kbps),
                                         env_.rails->rail_speed_mbps(p.rail))
                           : static_cast<double>(std::max(1, env_.rails->rail_speed_mbps(p.rail)));
    loads[i] = PathLoad{
        p.health->carries_data() && ready && !predicted,
        p.inflight_bytes,
        static_cast<uint64_t>(cfg_.path_window),
        weight,
        (p.health->state() == PathState::kDraining || (predicted && p.health->carries_data())) &&
            ready,
        io_->has_room(p.index),
        p.inflight_bytes == 0 && now - p.last_send > kStarveUs};
  }
  // Stripe off: the primary (path 0) alone while it carries data; once it cannot, its chunks
  // spread over every survivor by the same rule as striping (R2CCL_FAILOVER_SPREAD=1), or go
  // to the first surviving backup (0).
  const bool stripe =
      cfg_.stripe || (cfg_.failover_spread && !loads.empty() && !loads[0].carries_data);
  for (Request* r : active_) {
    if (r->kind != Request::Kind::kSend) continue;
    uint32_t idx;
    while (r->smsg.peek_next(&idx)) {
      const uint32_t len = r->smsg.chunk_len(idx);
      const int pi = pick_path(loads, stripe, len, r->allowed, env_.hooks.goodput);
      if (pi < 0) return;
      Path& p = paths_[pi];
      ChunkOut c;
      c.offset = r->smsg.chunk_offset(idx);
      c.src = r->data + c.offset;
      c.mhandle = r->mhandle;
      c.remote = &r->remote;
      c.seq = r->seq;
      c.total = r->size;
      c.idx = idx;
      c.nchunks = r->smsg.nchunks();
      c.len = len;
      c.last = idx + 1 == c.nchunks;
      c.chunk_size = chunk_;
      c.eager = r->eager;
      c.lazy_ack = r->eager && r->internal;
      const PostResult res = io_->post_chunk(pi, c, *this, now);
      if (res == PostResult::kFull) {
        loads[pi].room = false;
        continue;
      }
      if (res == PostResult::kFailed || res == PostResult::kNotHere) {
        loads[pi].carries_data = loads[pi].draining = false;
        continue;
      }
      const bool replay = r->smsg.take_next(pi);
      p.goodput.on_send(p.inflight_bytes, now);
      p.last_send = now;
      loads[pi].starving = false;
      if (p.inflight_bytes == 0) p.ack_progress = now;
      p.inflight_bytes += len;
      loads[pi].inflight_bytes += len;
      loads[pi].room = io_->has_room(pi);
      p.chunks_sent++;
      RailLive& rl = live(p);
      (replay ? rl.chunks_replayed : rl.chunks_sent)++;
      rl.bytes_sent += len;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Receiver

void Connection::post_ctss(TimeUs now) {
  for (Request* r : active_) {
    if (r->kind != Request::Kind::kRecv || r->done || r->cts_path >= 0) continue;
    // A small receive's message comes eagerly: a CTS would be one more frame each way per
    // message. It goes after kSmallCtsDelay all the same: the sender may lack the credit, or
    // (a caller's error) hold a larger message, which the CTS's capacity then turns into a
    // truncation error instead of a wait without end.
    if (expects_eager(r->size) && now - r->posted_at < kSmallCtsDelay) continue;
    const int cp = control_path(-1);
    if (cp < 0) return;
    CtsOut c;
    c.seq = r->seq;
    c.capacity = r->size;
    c.tag = r->tag;
    c.buf = r->rmsg.buffer();
    c.mhandle = r->mhandle;
    const PostResult res = io_->post_cts(cp, c, *this, now);
    if (res == PostResult::kFull) return;
    if (res == PostResult::kPosted) r->cts_path = cp;
  }
}

void Connection::on_cts_delivered(uint64_t seq, TimeUs now) {
  (void)now;
  Request* r = find_active(seq);
  if (r && r->kind == Request::Kind::kRecv) r->cts_delivered = true;
}

void Connection::mark_dirty(Request* r, uint32_t idx, int path) {
  const uint32_t base = idx / 64 * 64;
  if (std::find(r->dirty_windows.begin(), r->dirty_windows.end(), base) == r->dirty_windows.end())
    r->dirty_windows.push_back(base);
  r->ack_path = path;
}

void Connection::landed(Request* r, int path, uint32_t idx, TimeUs now) {
  r->rmsg.mark_landed(idx, env_.hooks.guard);
  r->ack_path = path;
  if (!r->rmsg.complete()) {
    if (caps_.receiver_acks) mark_dirty(r, idx, path);
    return;
  }
  r->done = true;
  last_recv_done_ = now;
  r->dirty_windows.clear();
  if (r->eager) {
    // Consumed: its credit goes back to the sender on the ACK below (flush_ctrl), and a copy
    // still in the area (one that arrived before the irecv on a path that failed) goes.
    eager_freed_ += eager_cost(r->rmsg.total());
    erase_entry(r->seq);
  }
  if (caps_.receiver_acks) {
    CtrlMsg a;
    a.type = CtrlType::kAck;
    a.seq = r->seq;
    a.prefix = r->rmsg.nchunks();
    if (r->eager && r->lazy_ack) {
      if (held_acks_.empty()) held_since_ = now;
      held_acks_.push_back({a, path});
      held_credit_ += eager_cost(r->rmsg.total());
    } else {
      queue_ctrl(a, path);
    }
  }
  history_.push_back({r->seq, r->rmsg.nchunks()});
  if (history_.size() > kHistory) history_.pop_front();
  remove_active(r);
}

ChunkPlace Connection::on_chunk_header(int path, const ChunkHeader& h, TimeUs now) {
  on_path_alive(path, now);
  ChunkPlace pl;
  pl.seq = h.seq;
  pl.idx = h.idx;
  if (role_ != Role::kRecv) {
    pl.action = ChunkPlace::Action::kProtocolError;
    pl.why = "data frame sent to the sending side";
    return pl;
  }
  if (h.eager) {
    // A header that lies about an eager message fails its path before any byte is written.
    const char* bad = nullptr;
    if (eager_thr_ == 0)
      bad = "eager data on a connection without eager messages";
    else if (h.idx != 0 || h.nchunks != 1 || h.offset != 0 || h.len != h.total)
      bad = "an eager chunk that is not one whole message";
    else if (h.len > eager_thr_)
      bad = "an eager message larger than the negotiated R2CCL_EAGER_THRESHOLD";
    if (bad) {
      pl.action = ChunkPlace::Action::kProtocolError;
      pl.why = bad;
      return pl;
    }
  }
  Request* r = find_active(h.seq);
  if (!r || r->kind != Request::Kind::kRecv) {
    if (h.seq >= next_recv_seq_) {
      if (h.eager) return place_in_area(path, h, now);
      pl.action = ChunkPlace::Action::kProtocolError;
      pl.why = "data for a message that has no clear-to-send";
      return pl;
    }
    // A stale copy of a completed message (a replay crossing the original): discard it and
    // answer with a full acknowledgement, so the sender stops re-sending it.
    env_.rails->live(paths_[path].rail).discarded_chunks++;
    for (const auto& d : history_) {
      if (d.seq != h.seq) continue;
      CtrlMsg a;
      a.type = CtrlType::kAck;
      a.seq = d.seq;
      a.prefix = d.nchunks;
      queue_ctrl(a, path);
    }
    return pl;
  }
  if (h.eager && h.total > r->size) {  // the sender could not check: it had no CTS
    eager_truncated(r->seq, h.total, r->size, now);
    return pl;
  }
  const char* bad = nullptr;
  const ChunkVerdict v =
      r->rmsg.check(h.total, h.nchunks, h.idx, h.offset, h.len, env_.hooks.guard, &bad);
  if (v == ChunkVerdict::kProtocolError) {
    pl.action = ChunkPlace::Action::kProtocolError;
    pl.why = bad;
    return pl;
  }
  if (v == ChunkVerdict::kDuplicate) {
    env_.rails->live(paths_[path].rail).discarded_chunks++;
    mark_dirty(r, h.idx, path);
    return pl;
  }
  pl.action = ChunkPlace::Action::kRead;
  pl.dst = r->rmsg.buffer() + h.offset;
  pl.req = r;
  if (h.eager) {
    r->eager = true;
    r->lazy_ack = h.lazy_ack;
  }
  return pl;
}

// The stale-data guard, before every partial read: the message is still posted, not
// complete, and the chunk has not landed on another path meanwhile.
bool Connection::chunk_wanted(const ChunkPlace& pl) const {
  if (pl.area) {  // an eager-area entry: still there (it may have been freed), not yet whole
    for (const auto& e : area_)
      if (e.get() == pl.req) return e->seq == pl.seq && !e->landed;
    return false;
  }
  const auto* r = static_cast<const Request*>(pl.req);
  if (!r || !r->used || r->done || r->seq != pl.seq || r->kind != Request::Kind::kRecv)
    return false;
  return !env_.hooks.guard.stale_guard || r->rmsg.wants(pl.idx, env_.hooks.guard.dedup);
}

void Connection::on_chunk_read(int path, const ChunkPlace& pl, bool clean, TimeUs now) {
  if (!clean || !chunk_wanted(pl)) return;
  if (pl.area) {
    auto* e = static_cast<EagerEntry*>(const_cast<void*>(pl.req));
    e->landed = true;
    deliver_eager(e, path, now);
    return;
  }
  landed(static_cast<Request*>(const_cast<void*>(pl.req)), path, pl.idx, now);
}

void Connection::on_chunk_placed(int path, uint64_t seq_low, int seq_bits, uint32_t idx,
                                 uint32_t len, bool last, TimeUs now) {
  on_path_alive(path, now);
  const uint64_t mask = seq_bits >= 64 ? ~0ull : (1ull << seq_bits) - 1;
  Request* r = nullptr;
  for (Request* q : active_)
    if (q->kind == Request::Kind::kRecv && !q->done && (q->seq & mask) == (seq_low & mask)) {
      r = q;
      break;
    }
  if (!r) {
    env_.rails->live(paths_[path].rail).discarded_chunks++;
    return;
  }
  const char* why = "";
  switch (r->rmsg.check_placed(idx, len, last, chunk_, env_.hooks.guard, &why)) {
    case ChunkVerdict::kWrite: landed(r, path, idx, now); break;
    case ChunkVerdict::kDuplicate: env_.rails->live(paths_[path].rail).discarded_chunks++; break;
    case ChunkVerdict::kProtocolError: on_path_error(path, FailCause::kProtocol, why, now); break;
  }
}

// ------------------------------------------------------------------------------------------
// Eager messages

bool Connection::eager_fits(uint64_t size) const {
  return eager_thr_ > 0 && size <= eager_thr_ && role_ == Role::kSend &&
         eager_sent_ - eager_freed_seen_ + eager_cost(size) <= eager_area_;
}

TimeUs Connection::idle_due(TimeUs now) const {
  if (gave_up_ || peer_closed_ || !active_.empty() || !ctrlq_.empty() || !held_acks_.empty() ||
      !notices_.empty() || !addr_notices_.empty() || !recoveries_.empty() || !gated_.empty())
    return 0;
  // A receiver that completed a receive lately beats fast for a while (check_paths).
  if (role_ == Role::kRecv && last_recv_done_ != 0 && now - last_recv_done_ < 4 * cfg_.ack_timeout)
    return 0;
  const TimeUs hb = cfg_.heartbeat_interval;
  TimeUs due = INT64_MAX;
  for (const auto& p : paths_) {
    const PathState st = p.health->state();
    if ((st != PathState::kHealthy && st != PathState::kDraining) || p.inflight_bytes > 0 ||
        p.charge_pending || p.reconnecting || p.verdict_at != 0 || !io_->ready(p.index))
      return 0;
    const LinkLive& l = *p.link;
    if (l.prober.load(std::memory_order_relaxed) == p.link_id) {
      // The next probe, and the heartbeat rule should nothing arrive meanwhile.
      due = std::min(due, p.last_probe + hb);
      const TimeUs heard = std::max(p.last_alive, l.heard.load(std::memory_order_relaxed));
      due = std::min(due, std::max(heard, p.prober_since) + 3 * hb + 1);
    }
    // A path that follows its link's prober needs no timer: the prober resigning (failed,
    // closed) or posting a verdict is a process-wide event that wakes every idle connection.
  }
  return due;
}

bool Connection::eager_unacked() const {
  return std::any_of(active_.begin(), active_.end(), [](const Request* r) { return r->internal; });
}

Request* Connection::free_shadow() {
  for (auto& q : shadows_)
    if (!q->used) return q.get();
  shadows_.push_back(std::make_unique<Request>());
  shadows_.back()->conn = this;
  return shadows_.back().get();
}

Connection::EagerEntry* Connection::find_entry(uint64_t seq) {
  for (auto& e : area_)
    if (e->seq == seq) return e.get();
  return nullptr;
}

void Connection::erase_entry(uint64_t seq) {
  for (size_t i = 0; i < area_.size(); ++i) {
    if (area_[i]->seq != seq) continue;
    area_used_ -= std::min(area_used_, eager_cost(area_[i]->total));
    spare_entries_.push_back(std::move(area_[i]));
    area_.erase(area_.begin() + static_cast<long>(i));
    return;
  }
}

// Receiver: an eager message whose irecv is not posted yet goes into the area, within the
// credit the sender was given (a sender that exceeds it is in error: protocol error).
ChunkPlace Connection::place_in_area(int path, const ChunkHeader& h, TimeUs now) {
  (void)now;
  ChunkPlace pl;
  pl.seq = h.seq;
  pl.idx = h.idx;
  const auto error = [&](const char* why) {
    pl.action = ChunkPlace::Action::kProtocolError;
    pl.why = why;
    return pl;
  };
  EagerEntry* e = find_entry(h.seq);
  if (e) {
    if (e->total != h.total) return error("an eager message whose size changed between copies");
    if (e->landed && env_.hooks.guard.dedup) {  // a replay crossing the original
      env_.rails->live(paths_[path].rail).discarded_chunks++;
      CtrlMsg a;
      a.type = CtrlType::kAck;
      a.seq = h.seq;
      a.prefix = 1;
      queue_ctrl(a, path);
      return pl;
    }
  } else {
    // Every eager message beyond the posted receives holds credit, so the sender can be at
    // most area / kEagerEntryCost messages ahead.
    if (h.seq - next_recv_seq_ >= eager_area_ / kEagerEntryCost)
      return error("an eager message too far ahead of the posted receives");
    const uint64_t cost = eager_cost(h.len);
    if (area_used_ + cost > eager_area_)
      return error("an eager message beyond the receiver's eager credit");
    std::unique_ptr<EagerEntry> fresh;
    if (!spare_entries_.empty()) {
      fresh = std::move(spare_entries_.back());
      spare_entries_.pop_back();
    } else {
      fresh = std::make_unique<EagerEntry>();
    }
    fresh->seq = h.seq;
    fresh->total = h.total;
    fresh->landed = false;
    fresh->lazy_ack = h.lazy_ack;
    fresh->data.resize(h.len);
    area_used_ += cost;
    area_.push_back(std::move(fresh));
    e = area_.back().get();
  }
  // Another copy may be reading into the same entry: it writes the same bytes.
  pl.action = ChunkPlace::Action::kRead;
  pl.dst = e->data.data();
  pl.req = e;
  pl.area = true;
  return pl;
}

void Connection::deliver_eager(EagerEntry* e, int path, TimeUs now) {
  const uint64_t seq = e->seq;
  Request* r = find_active(seq);
  if (r && r->kind == Request::Kind::kRecv && !r->done) {
    if (e->total > r->size) {
      eager_truncated(r->seq, e->total, r->size, now);
      return;
    }
    const char* bad = nullptr;
    const ChunkVerdict v =
        r->rmsg.check(e->total, 1, 0, 0, static_cast<uint32_t>(e->total), env_.hooks.guard, &bad);
    if (v == ChunkVerdict::kWrite) {
      if (e->total > 0) memcpy(r->rmsg.buffer(), e->data.data(), e->total);
      r->eager = true;
      r->lazy_ack = e->lazy_ack;
      landed(r, path, 0, now);  // acknowledges, returns the credit, frees the entry
    }
    erase_entry(seq);
    return;
  }
  if (seq < next_recv_seq_) {  // its receive completed meanwhile from another copy
    erase_entry(seq);
    return;
  }
  // Stored: acknowledged now, so the sender's copy and its acknowledgement watchdog need not
  // wait for the irecv; the credit comes back when the irecv consumes it.
  CtrlMsg a;
  a.type = CtrlType::kAck;
  a.seq = e->seq;
  a.prefix = 1;
  queue_ctrl(a, path);
}

void Connection::eager_truncated(uint64_t seq, uint64_t size, uint64_t capacity, TimeUs now) {
  char why[160];
  snprintf(why, sizeof(why),
           "the isend matching irecv %llu is %llu bytes, larger than the irecv's %llu bytes "
           "(truncated)",
           static_cast<unsigned long long>(seq), static_cast<unsigned long long>(size),
           static_cast<unsigned long long>(capacity));
  give_up(Status::kInternal, why, now);
}

void Connection::say_goodbye(TimeUs now) {
  if (!held_acks_.empty() && error_ == Status::kOk) {
    release_acks(now, true);
    flush_ctrl(now);
    io_->flush(*this, now);
  }
  io_->say_goodbye(now);
}

void Connection::release_acks(TimeUs now, bool force) {
  if (held_acks_.empty()) return;
  if (!force && ctrlq_.empty() && now - held_since_ < kAckHold && held_credit_ < eager_area_ / 2 &&
      held_acks_.size() < kMaxHeldAcks)
    return;
  for (const auto& h : held_acks_) queue_ctrl(h.m, h.prefer);
  held_acks_.clear();
  held_credit_ = 0;
}

void Connection::send_acks() {
  for (Request* r : active_) {
    if (r->kind != Request::Kind::kRecv || r->dirty_windows.empty()) continue;
    for (uint32_t base : r->dirty_windows) {
      CtrlMsg a;
      a.type = CtrlType::kAck;
      a.seq = r->seq;
      a.prefix = r->rmsg.prefix();
      a.base = base;
      a.bitmap = r->rmsg.window_bitmap(base);
      queue_ctrl(a, r->ack_path);
    }
    r->dirty_windows.clear();
  }
}

// Receiver: tells the sender when this node's failure predictor drains or returns the rail
// of a path, so the sender moves new chunks off it (it decides where chunks go).
void Connection::tell_drains() {
  for (auto& p : paths_) {
    if (!p.health->connected()) continue;
    const bool d = live(p).predict_drain.load(std::memory_order_relaxed);
    if (d == p.drain_sent) continue;
    p.drain_sent = d;
    CtrlMsg m;
    m.type = CtrlType::kDrain;
    m.path = static_cast<uint16_t>(p.index);
    m.gen = io_->generation(p.index);
    m.on = d;
    queue_ctrl(m, p.index);
  }
}

// ------------------------------------------------------------------------------------------
// Transport events

bool Connection::traffic_in_flight(int path) const {
  if (role_ == Role::kSend) return path >= 0 && path < npaths() && paths_[path].inflight_bytes > 0;
  for (const Request* r : active_)
    // A message is in flight from its first accepted chunk header (TCP: payload may still be
    // arriving) or its first placed chunk (RDMA: the size is known only with the last).
    if (r->kind == Request::Kind::kRecv &&
        (r->rmsg.nchunks() != 0 || r->rmsg.landed_count() != 0) && !r->rmsg.complete())
      return true;
  for (const auto& e : area_)  // an eager message being read into the area
    if (!e->landed) return true;
  return false;
}

void Connection::on_path_alive(int path, TimeUs now) {
  if (path < 0 || path >= npaths()) return;
  Path& p = paths_[path];
  p.last_alive = now;
  std::atomic<TimeUs>& heard = p.link->heard;
  TimeUs h = heard.load(std::memory_order_relaxed);
  while (h < now && !heard.compare_exchange_weak(h, now, std::memory_order_relaxed)) {
  }
}

void Connection::on_path_error(int path, FailCause cause, const char* detail, TimeUs now) {
  if (path < 0 || path >= npaths()) return;
  if (peer_closed_ || gave_up_) {  // the connection is ending: paths end quietly
    io_->stop_path(path, true, now);
    return;
  }
  fail_path(paths_[path], cause, detail, now);
}

void Connection::on_probe_ok(int path, TimeUs now, TimeUs sent_at) {
  if (path < 0 || path >= npaths()) return;
  Path& p = paths_[path];
  // Which probe this answers: the one sent at `sent_at` when the transport says, else the
  // latest (a clean sample only if it superseded none).
  bool idle = p.probe_idle;
  TimeUs rtt = now - p.probe_sent;
  if (sent_at > 0) {
    idle = false;
    for (const auto& q : p.sent)
      if (q.at == sent_at) idle = q.idle;
    rtt = now - sent_at;
  }
  if (sent_at == 0 || sent_at == p.probe_sent) p.probe_out = false;
  p.last_alive = now;
  if (p.health->state() == PathState::kProbing) {
    if (!p.health->on_probe_pass(now)) return;
    mark_recovered(p);
    if (role_ == Role::kSend) {
      live(p).failbacks++;
      io_->path_recovered(p.index, *this, now);
      resend_notices(now);
      log_event("failback: rail %s is back (path %d of conn %016" PRIx64
                " reconnected and passed "
                "%d probes); it carries traffic again",
                rail_name(p.rail).c_str(), p.index, id_, env_.health.probe_count);
    } else {
      R2CCL_INFO(NCCL_NET, "path %d (%s) of conn %016" PRIx64 " is back after reconnect", p.index,
                 p.label.c_str(), id_);
    }
    return;
  }
  // Shadow routing: the link's prober, sending, feeds its idle probe RTTs to the link's
  // baseline; an outlier period drains every sending path of the link (check_paths).
  LinkLive& l = *p.link;
  if (role_ != Role::kSend || !idle || rtt < 0 ||
      l.prober.load(std::memory_order_relaxed) != p.link_id)
    return;
  int d;
  double mean;
  {
    std::lock_guard<std::mutex> lk(l.rtt_mu);
    d = l.rtt.sample(rtt, now);
    mean = l.rtt.mean_us();
    l.sample_high.store(l.rtt.last_high(), std::memory_order_relaxed);
    l.sampled_at.store(now, std::memory_order_relaxed);
  }
  // RTTs that rose on every link of the process at once are a stall of this machine or its
  // peers, not this rail queueing: nothing to drain towards.
  if (d > 0 && env_.links && env_.links->every_other_high(&l, now, 4 * cfg_.heartbeat_interval)) {
    {
      std::lock_guard<std::mutex> lk(l.rtt_mu);
      l.rtt.forget_run();
    }
    R2CCL_INFO(NCCL_NET,
               "shadow routing: rail %s probe RTT %.2f ms is high, but so is every other link's: "
               "a stall, not the rail; not drained",
               rail_name(p.rail).c_str(), rtt / 1e3);
    return;
  }
  if (d == 0) return;
  l.shadowed.store(d > 0, std::memory_order_relaxed);
  if (env_.links) env_.links->note_event();
  p.health->set_draining(d > 0);
  if (d > 0)
    log_event(
        "shadow routing: rail %s probe RTT %.2f ms exceeds its baseline %.2f ms + %.1f sigma; "
        "draining it (kept connected)",
        rail_name(p.rail).c_str(), rtt / 1e3, mean / 1e3, env_.health.latency_sigma);
  else
    log_event("shadow routing: rail %s probe RTT is back to its baseline; it carries traffic again",
              rail_name(p.rail).c_str());
}

void Connection::on_reconnected(int path, TimeUs now) {
  if (path < 0 || path >= npaths()) return;
  Path& p = paths_[path];
  p.reconnecting = false;
  p.refused = false;
  p.unreachable = false;
  p.health->on_reconnected(now);
  attach_link(p);  // the peer's rail may have another address now
  p.verdicts_seen = p.link->verdicts.load();
  p.verdict_at = 0;
  // The peer answered: whatever it seemed to cause was the rails'.
  for (auto& q : paths_)
    if (q.charge_pending) charge_rail(q);
  p.last_alive = p.ack_progress = p.last_probe = now;
  p.probe_out = false;
  p.inflight_bytes = 0;
  p.goodput.on_stop();
  R2CCL_INFO(NCCL_NET, "path %d (%s) of conn %016" PRIx64 " reconnected (generation %u); probing",
             p.index, p.label.c_str(), id_, io_->generation(p.index));
  // Whatever could not be said while no path was up goes again on the path that came back.
  if (role_ == Role::kRecv) queue_recv_state(p.index);
  resend_notices(now);
}

void Connection::on_reconnect_failed(int path, bool refused, const char* detail, TimeUs now) {
  if (path < 0 || path >= npaths()) return;
  Path& p = paths_[path];
  p.reconnecting = false;
  p.refused = refused;
  p.unreachable = !refused;
  p.health->on_reconnect_failed(now);
  R2CCL_INFO(NCCL_NET, "reconnect of path %d (%s) of conn %016" PRIx64 " failed: %s", p.index,
             p.label.c_str(), id_, detail ? detail : "?");
}

void Connection::on_peer_address(int path, TimeUs now) {
  if (path < 0 || path >= npaths() || gave_up_) return;
  Path& p = paths_[path];
  if (p.health->connected() && io_->address_stale(p.index))
    fail_path(p, FailCause::kAddressChanged, "the peer's address on the rail changed", now);
  // Reconnect to the new address now, not after the backoff the old one earned.
  p.health->on_link_up(now);
  R2CCL_INFO(NCCL_NET, "path %d (%s) of conn %016" PRIx64 ": the peer's rail has a new address",
             p.index, p.label.c_str(), id_);
}

void Connection::on_peer_bye(TimeUs now) {
  // NCCL closed the comm at the other end: not a failure. From here on paths end quietly;
  // what already arrived on other paths is still taken, and whatever is still pending after
  // a grace period can never complete.
  if (peer_closed_) return;
  peer_closed_ = true;
  bye_at_ = now;
}

void Connection::on_peer_gone(const char* evidence, TimeUs now) {
  (void)now;
  if (peer_gone_ || peer_closed_) return;
  peer_gone_ = true;
  peer_gone_why_ = evidence ? evidence : "";
  log_event("conn %016" PRIx64 " on device %d: %s: %s is gone", id_, dev_, peer_gone_why_.c_str(),
            peer_text().c_str());
}

void Connection::on_fatal(Status st, const char* why, TimeUs now) {
  if (peer_closed_) return;
  give_up(st, why ? why : "fatal error", now);
}

// ------------------------------------------------------------------------------------------
// End of the connection

void Connection::give_up(Status st, const std::string& why, TimeUs now) {
  if (gave_up_) return;
  gave_up_ = true;
  error_ = st;
  // Over at both ends: nothing more may land in NCCL's buffers (it may free them once the
  // error is reported), and the peer learns at once instead of after its own timeout.
  io_->abort(now);
  io_->say_goodbye(now);
  log_event("give-up: %s conn %016" PRIx64
            " on device %d (%s): %s; %zu pending requests fail with %s",
            role_ == Role::kSend ? "send" : "recv", id_, dev_,
            paths_.empty() ? "?" : rail_name(paths_[0].rail).c_str(), why.c_str(), active_.size(),
            result_name(st));
}

void Connection::check_give_up(TimeUs now) {
  // A peer known gone fails everything at once, usable paths or not (what they would carry
  // has nobody to go to): the transport saw its process end (verbs: the side channel closed
  // without BYE; TCP: its listener refuses connections), or, once no path is usable, every
  // path ended at the peer's end or cannot be reached from here and a reconnect was refused
  // (nothing listens on the peer's rails any more).
  if (peer_gone_) {
    give_up(Status::kRemote, peer_text() + " is gone (" + peer_gone_why_ + ")", now);
    return;
  }
  // A message restricted to some paths (its buffer may not travel on the others) counts like
  // a connection without a usable path when none of its paths is usable: it fails the same
  // way after R2CCL_FAILOVER_TIMEOUT, never spilling onto a path it may not use.
  const Request* stuck = any_usable() ? stranded() : nullptr;
  const bool expired = give_up_timer_.update(any_usable() && !stuck, now, cfg_.failover_timeout);
  if (!give_up_timer_.waiting()) return;
  if (stuck) {
    if (expired) {
      uint32_t up = 0;
      for (const auto& p : paths_)
        if (usable(p) && p.index < 32) up |= 1u << p.index;
      give_up(Status::kSystem,
              "no usable path may carry message " + std::to_string(stuck->seq) +
                  " within R2CCL_FAILOVER_TIMEOUT: its buffers allow only path(s) " +
                  path_list(stuck->allowed, npaths()) + " (the transport's log says why), " +
                  "usable: path(s) " + path_list(up, npaths()),
              now);
    }
    return;
  }
  // Otherwise the peer may be gone when every path ended with its end-of-file, reset or a
  // protocol error; but a live peer also closes a path it has declared failed, so that alone
  // is not enough before R2CCL_FAILOVER_TIMEOUT.
  bool all_gone = true;
  for (const auto& p : paths_) all_gone &= cause_means_peer_gone(p.health->last_cause());
  if (peer_known_gone())
    give_up(Status::kRemote,
            "no usable path: every path ended at the peer's end or cannot be reached, and a "
            "reconnect was refused: " +
                peer_text() + " is gone",
            now);
  else if (expired)
    give_up(GiveUpTimer::status(all_gone),
            all_gone ? "no usable path: " + peer_text() +
                           " closed every path and did not come back within R2CCL_FAILOVER_TIMEOUT"
                     : "no usable path: no local rail reaches " + peer_text() +
                           " within R2CCL_FAILOVER_TIMEOUT",
            now);
}

void Connection::closing_progress(TimeUs now) {
  io_->flush(*this, now);
  if (!active_.empty() && now - bye_at_ > kByeGrace) (void)peer_closed_error();
}

// After the peer's BYE: what is still pending (after the grace period) or newly posted can
// never complete. One line says so; an orderly close, with nothing pending, logs nothing.
Status Connection::peer_closed_error() {
  if (error_ != Status::kOk) return error_;
  error_ = Status::kRemote;
  log_event("give-up: %s conn %016" PRIx64
            " on device %d: the peer closed the connection (BYE) "
            "with %zu requests pending; they and later ones fail with ncclRemoteError",
            role_ == Role::kSend ? "send" : "recv", id_, dev_, active_.size());
  return error_;
}

void Connection::progress(TimeUs now) {
  if (gave_up_) return;
  io_->poll(*this, now);
  if (gave_up_) return;
  if (peer_closed_) {
    closing_progress(now);
    return;
  }
  check_paths(now);
  if (role_ == Role::kSend) {
    schedule_chunks(now);
  } else {
    post_ctss(now);
    if (caps_.receiver_acks) send_acks();
    tell_drains();
    release_acks(now, false);
  }
  flush_ctrl(now);
  io_->flush(*this, now);
  if (gave_up_) return;
  if (role_ == Role::kSend) check_recoveries(now);
  settle_charges(now);
  check_give_up(now);
}

// ------------------------------------------------------------------------------------------
// Requests

Request* Connection::free_request() {
  for (auto& q : reqs_)
    if (!q.used) return &q;
  return nullptr;
}

Request* Connection::find_active(uint64_t seq) {
  for (Request* r : active_)
    if (r->seq == seq) return r;
  return nullptr;
}

const Request* Connection::find_active(uint64_t seq) const {
  for (const Request* r : active_)
    if (r->seq == seq) return r;
  return nullptr;
}

void Connection::remove_active(Request* r) {
  active_.erase(std::remove(active_.begin(), active_.end(), r), active_.end());
}

void Connection::release(Request* r) {
  remove_active(r);
  r->used = false;
  r->done = false;
}

Status Connection::isend(void* data, uint64_t size, int tag, void* mhandle, Request** req,
                         TimeUs now) {
  *req = nullptr;
  if (error_ != Status::kOk) return error_;
  if (peer_closed_) return peer_closed_error();
  // An eager message needs credit, a rendezvous one its CTS; progress may bring either.
  auto have_cts = [&] { return !cts_.empty() && cts_.front().seq == next_send_seq_; };
  if (!eager_fits(size) && !have_cts()) {
    progress(now);
    if (error_ != Status::kOk) return error_;
    if (!eager_fits(size) && !have_cts()) return Status::kOk;  // no CTS (or credit) yet
  }
  if (have_cts() && size > cts_.front().cap) {
    // A caller's error NCCL would report as truncation. The connection fails at this end
    // (later calls return the error) and the receiver is told, so its request fails too
    // instead of waiting; the peer's give-up then closes the connection (BYE). (An eager
    // message sent before its CTS arrived is checked by the receiver instead.)
    R2CCL_WARN(
        "isend of %llu bytes on device %d is larger than the matching irecv %llu (%llu "
        "bytes): the connection fails at both ends",
        static_cast<unsigned long long>(size), dev_,
        static_cast<unsigned long long>(next_send_seq_),
        static_cast<unsigned long long>(cts_.front().cap));
    CtrlMsg m;
    m.type = CtrlType::kTruncated;
    m.seq = next_send_seq_;
    m.size = size;
    queue_ctrl(m, -1);
    flush_ctrl(now);
    io_->flush(*this, now);
    error_ = Status::kInternal;
    return error_;
  }
  const bool eager = eager_fits(size);
  const bool cts_here = have_cts();
  Request* r = free_request();
  if (!r) return Status::kOk;  // all 32 in use: NCCL calls again
  // The request that carries the bytes: NCCL's, or (eager copy) an internal one.
  Request* t = r;
  if (eager && cfg_.eager_copy) {
    t = free_shadow();
    t->copy.assign(static_cast<const char*>(data), static_cast<const char*>(data) + size);
  }
  r->used = true;
  r->done = false;
  r->kind = Request::Kind::kSend;
  r->seq = next_send_seq_++;
  r->size = size;
  r->eager = eager;
  r->internal = false;
  if (t != r) {
    t->used = true;
    t->done = false;
    t->kind = Request::Kind::kSend;
    t->seq = r->seq;
    t->size = size;
    t->eager = true;
    t->internal = true;
    r->done = true;  // NCCL's request completes now: its bytes are copied
  }
  t->data = t == r ? static_cast<const char*>(data) : t->copy.data();
  t->tag = tag;
  t->mhandle = t == r ? mhandle : nullptr;
  t->remote = cts_here ? cts_.front().remote : RemoteBuffer{};
  t->allowed = (t == r ? io_->allowed_paths(mhandle) : kAllPaths) & t->remote.allowed;
  t->smsg.reset(t->seq, size, chunk_);
  if (cts_here) cts_.pop_front();
  if (eager) eager_sent_ += eager_cost(size);
  active_.push_back(t);
  *req = r;
  progress(now);
  return Status::kOk;
}

Status Connection::irecv(void* data, uint64_t size, int tag, void* mhandle, Request** req,
                         TimeUs now) {
  *req = nullptr;
  if (error_ != Status::kOk) return error_;
  if (peer_closed_) return peer_closed_error();
  Request* r = free_request();
  if (!r) return Status::kOk;  // all 32 in use: NCCL calls again
  r->used = true;
  r->done = false;
  r->kind = Request::Kind::kRecv;
  r->seq = next_recv_seq_++;
  r->data = nullptr;
  r->size = size;
  r->tag = tag;
  r->mhandle = mhandle;
  r->dirty_windows.clear();
  r->ack_path = -1;
  r->cts_path = -1;
  r->cts_delivered = false;
  r->posted_at = now;
  r->eager = false;
  r->lazy_ack = false;
  r->internal = false;
  r->rmsg.reset(r->seq, static_cast<char*>(data), size);
  active_.push_back(r);
  *req = r;
  // An eager message that arrived before this irecv completes it now (no CTS goes out).
  if (EagerEntry* e = find_entry(r->seq); e && e->landed) deliver_eager(e, -1, now);
  // A large receive's CTS goes at once; a small one has none to send for now (post_ctss), and
  // its message is read by the next test(): a pass here would be one more poll(2) between
  // NCCL's irecv and its isend.
  if (!expects_eager(size)) progress(now);
  return Status::kOk;
}

Status Connection::iflush(int n, void** data, const int* sizes, void** mhandles, Request** req,
                          TimeUs now) {
  (void)now;
  *req = nullptr;
  if (error_ != Status::kOk) return error_;
  Request* r = free_request();
  if (!r) return Status::kOk;  // NCCL calls again
  uint64_t token = 0;
  R2CCL_CHECK(io_->start_flush(n, data, sizes, mhandles, &token));
  if (token == 0) return Status::kOk;  // host memory: nothing to flush, NCCL treats NULL as done
  r->used = true;
  r->done = false;
  r->kind = Request::Kind::kFlush;
  r->size = 0;
  r->flush_token = token;
  *req = r;
  return Status::kOk;
}

Status Connection::test(Request* r, int* done, int* size, TimeUs now) {
  *done = 0;
  if (r->kind == Request::Kind::kFlush) {
    Status err = Status::kOk;
    const int rc = io_->test_flush(r->flush_token, &err);
    if (rc < 0 || err != Status::kOk) {
      release(r);
      return err != Status::kOk ? err : Status::kSystem;
    }
    if (rc == 0) return Status::kOk;
    *done = 1;
    if (size) *size = 0;
    release(r);
    return Status::kOk;
  }
  if (!r->done) {
    if (error_ == Status::kOk) progress(now);
    if (!r->done) {
      if (error_ == Status::kOk) return Status::kOk;
      // The request fails: released, so nothing more is written for it.
      const Status e = error_;
      release(r);
      return e;
    }
  }
  *done = 1;
  if (size) *size = static_cast<int>(r->kind == Request::Kind::kSend ? r->size : r->rmsg.total());
  release(r);
  return Status::kOk;
}

}  // namespace r2ccl::net
