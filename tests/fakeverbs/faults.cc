// Fault injection: FAKEVERBS_FAULTS (read with the devices) and fakeverbs_inject().
//
// Syntax: ';'-separated entries `kind,dev=NAME[,key=value...]`, with an optional trigger
// `after_bytes=N` (this process has posted N bytes of RDMA WRITE / SEND payload in total on
// that device, counted from process start) or `after_ms=N` (N ms after the process's first
// post_send). Without a trigger the fault fires at once. Kinds and their keys are listed in
// kForm below and explained in README.md.
//
// All functions run under State::mu.

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <set>

#include "fake_internal.h"

namespace fv {

namespace {

const char* const kForm =
    "accepted: kind,dev=NAME[,after_bytes=N|after_ms=N] with kind one of "
    "port_down[,for_ms=N][,gids=keep|readd|move] | port_up | "
    "flap,down_ms=A,up_ms=B[,count=N][,gids=keep|readd|move] | blackhole | "
    "hold_write[,release_after=K] | rkey_error | lkey_error | set_ipv4,addr=A.B.C.D | "
    "sq_full[,count=N] | device_fatal[,for_ms=N] | qp_fatal[,count=N] | ack_loss[,for_ms=N] | "
    "drop[,count=N][,tries=T] | partial[,count=N]";

bool num(const std::string& v, long long* out) {
  if (v.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long x = strtoll(v.c_str(), &end, 10);
  if (errno || *end || x < 0) return false;
  *out = x;
  return true;
}

bool parse_entry(const std::string& entry, Fault* f, std::string* why) {
  auto fields = split(entry, ',');
  f->text = entry;
  f->kind = trim(fields[0]);
  static const std::set<std::string> kinds = {
      "port_down", "port_up", "flap",         "blackhole", "hold_write", "rkey_error", "lkey_error",
      "set_ipv4",  "sq_full", "device_fatal", "qp_fatal",  "ack_loss",   "drop",       "partial"};
  if (!kinds.count(f->kind)) {
    *why = "unknown kind '" + f->kind + "'";
    return false;
  }
  std::set<std::string> allowed = {"dev", "after_bytes", "after_ms"};
  if (f->kind == "port_down") allowed.insert({"for_ms", "gids"});
  if (f->kind == "device_fatal" || f->kind == "ack_loss") allowed.insert("for_ms");
  if (f->kind == "flap") allowed.insert({"down_ms", "up_ms", "count", "gids"});
  if (f->kind == "hold_write") allowed.insert("release_after");
  if (f->kind == "set_ipv4") allowed.insert("addr");
  if (f->kind == "sq_full" || f->kind == "qp_fatal") allowed.insert("count");
  if (f->kind == "drop") allowed.insert({"count", "tries"});
  if (f->kind == "partial") allowed.insert("count");
  std::set<std::string> seen;
  for (size_t i = 1; i < fields.size(); ++i) {
    std::string kv = trim(fields[i]);
    size_t eq = kv.find('=');
    std::string k = kv.substr(0, eq), v = eq == std::string::npos ? "" : kv.substr(eq + 1);
    if (eq == std::string::npos || !allowed.count(k)) {
      *why = "unexpected '" + kv + "' for " + f->kind;
      return false;
    }
    if (!seen.insert(k).second) {
      *why = "'" + k + "' given twice";
      return false;
    }
    bool ok = true;
    if (k == "dev") {
      f->dev = find_device(v);
      if (!f->dev) {
        *why = "no device named '" + v + "'";
        return false;
      }
    } else if (k == "addr") {
      in_addr a;
      ok = inet_pton(AF_INET, v.c_str(), &a) == 1;
      f->addr = a.s_addr;
    } else if (k == "gids") {
      ok = v == "keep" || v == "readd" || v == "move";
      f->gids = v == "readd" ? kGidsReadd : v == "move" ? kGidsMove : kGidsKeep;
    } else if (k == "after_bytes") {
      ok = num(v, &f->after_bytes);
    } else if (k == "after_ms") {
      ok = num(v, &f->after_ms);
    } else if (k == "for_ms") {
      ok = num(v, &f->for_ms);
    } else if (k == "down_ms") {
      ok = num(v, &f->down_ms) && f->down_ms > 0;
    } else if (k == "up_ms") {
      ok = num(v, &f->up_ms) && f->up_ms > 0;
    } else if (k == "count") {
      ok = num(v, &f->count) && f->count > 0 && f->count <= 100000;
    } else if (k == "tries") {
      ok = num(v, &f->tries) && f->tries > 0 && f->tries <= 7;
    } else if (k == "release_after") {
      ok = num(v, &f->release_after) && f->release_after > 0;
    }
    if (!ok) {
      *why = "bad value in '" + kv + "'";
      return false;
    }
  }
  if (!f->dev) {
    *why = "missing dev=NAME";
    return false;
  }
  if (f->after_bytes >= 0 && f->after_ms >= 0) {
    *why = "give at most one of after_bytes and after_ms";
    return false;
  }
  if (f->kind == "flap" && (!seen.count("down_ms") || !seen.count("up_ms"))) {
    *why = "flap needs down_ms and up_ms";
    return false;
  }
  if (f->gids != kGidsKeep && !f->dev->eth) {
    *why = "gids=readd|move needs an eth device (RoCE GIDs come from IP addresses)";
    return false;
  }
  if (f->kind == "set_ipv4" && (!seen.count("addr") || !f->dev->eth)) {
    *why = "set_ipv4 needs addr=A.B.C.D and an eth device";
    return false;
  }
  return true;
}

void schedule(Device* d, TimePoint at, bool up, int gids, bool reset_done = false,
              bool ack_loss_done = false) {
  g->scheduled.push_back(Scheduled{at, d, up, gids, reset_done, ack_loss_done});
}

}  // namespace

bool parse_faults_locked(const std::string& spec, std::vector<Fault>* out, std::string* err) {
  for (const auto& raw : split(spec, ';')) {
    std::string e = trim(raw);
    if (e.empty()) continue;
    Fault f;
    std::string why;
    if (!parse_entry(e, &f, &why)) {
      *err = "fakeverbs: bad fault entry '" + e + "': " + why + " (" + kForm + ")";
      return false;
    }
    out->push_back(f);
  }
  if (out->empty()) {
    *err = std::string("fakeverbs: empty fault spec (") + kForm + ")";
    return false;
  }
  return true;
}

void fire_fault_locked(const Fault& f) {
  Device* d = f.dev;
  TimePoint now = Clock::now();
  if (f.kind == "port_down") {
    set_port_locked(d, false, f.gids);
    if (f.for_ms >= 0) schedule(d, now + std::chrono::milliseconds(f.for_ms), true, f.gids);
  } else if (f.kind == "port_up") {
    set_port_locked(d, true);
  } else if (f.kind == "flap") {
    set_port_locked(d, false, f.gids);
    auto period = std::chrono::milliseconds(f.down_ms + f.up_ms);
    for (long long i = 0; i < f.count; ++i) {
      if (i > 0) schedule(d, now + period * i, false, f.gids);
      schedule(d, now + period * i + std::chrono::milliseconds(f.down_ms), true, f.gids);
    }
  } else if (f.kind == "blackhole") {
    for (auto& kv : g->qps)
      if (kv.second->dev == d) kv.second->blackholed = true;
  } else if (f.kind == "hold_write") {
    d->arm_hold++;
    d->hold_k = static_cast<int>(f.release_after);
  } else if (f.kind == "rkey_error") {
    d->arm_rkey++;
  } else if (f.kind == "lkey_error") {
    d->arm_lkey++;
  } else if (f.kind == "sq_full") {
    d->arm_sq_full += static_cast<int>(f.count);
  } else if (f.kind == "set_ipv4") {
    set_ipv4_locked(d, f.addr);
  } else if (f.kind == "device_fatal") {
    if (std::find(g->fatal_devices.begin(), g->fatal_devices.end(), d) == g->fatal_devices.end())
      g->fatal_devices.push_back(d);
    if (f.for_ms >= 0)
      schedule(d, now + std::chrono::milliseconds(f.for_ms), true, kGidsKeep, true);
  } else if (f.kind == "drop") {
    d->arm_drop += static_cast<int>(f.count);
    d->drop_tries = static_cast<int>(f.tries);
  } else if (f.kind == "partial") {
    d->arm_partial += static_cast<int>(f.count);
  } else if (f.kind == "ack_loss") {
    d->ack_loss = true;
    if (f.for_ms >= 0)
      schedule(d, now + std::chrono::milliseconds(f.for_ms), true, kGidsKeep, false, true);
  } else if (f.kind == "qp_fatal") {
    // The `count` most recently created QPs of the device that are connected to another QP
    // (a loopback flush QP, connected to itself, is left alone) and in RTS.
    std::vector<uint32_t> mine;
    for (auto& kv : g->qps) {
      const Qp* q = kv.second;
      if (q->dev == d && !q->ctx->dead && q->state == IBV_QPS_RTS && q->attr.dest_qp_num != q->qpn)
        mine.push_back(kv.first);
    }
    std::sort(mine.begin(), mine.end());
    for (long long i = 0; i < f.count && !mine.empty(); ++i) {
      g->fatal_qpns.push_back(mine.back());
      mine.pop_back();
    }
  }
  wake_nic();  // new timers
}

void arm_or_fire_locked(const Fault& f) {
  if (f.after_bytes < 0 && f.after_ms < 0) {
    fire_fault_locked(f);
    return;
  }
  g->pending.push_back(f);
  if (f.after_bytes >= 0) check_byte_triggers_locked(f.dev);
}

void check_byte_triggers_locked(Device* d) {
  for (size_t i = 0; i < g->pending.size();) {
    const Fault& f = g->pending[i];
    if (f.after_bytes >= 0 && f.dev == d &&
        d->bytes_posted >= static_cast<uint64_t>(f.after_bytes)) {
      Fault x = f;
      g->pending.erase(g->pending.begin() + static_cast<long>(i));
      fire_fault_locked(x);
    } else {
      ++i;
    }
  }
}

TimePoint run_fault_timers_locked(TimePoint now) {
  TimePoint next = kNever;
  apply_fatal_locked();
  // Scheduled port changes, in time order.
  std::stable_sort(g->scheduled.begin(), g->scheduled.end(),
                   [](const Scheduled& a, const Scheduled& b) { return a.at < b.at; });
  while (!g->scheduled.empty() && g->scheduled.front().at <= now) {
    Scheduled s = g->scheduled.front();
    g->scheduled.erase(g->scheduled.begin());
    if (s.ack_loss_done)
      s.dev->ack_loss = false;
    else if (s.reset_done)
      device_back_locked(s.dev);
    else if (!s.dev->removed)
      set_port_locked(s.dev, s.up, s.gids);
  }
  if (!g->scheduled.empty()) next = g->scheduled.front().at;
  for (size_t i = 0; i < g->pending.size();) {
    const Fault& f = g->pending[i];
    if (f.after_ms >= 0 && g->posted_any) {
      TimePoint at = g->first_post + std::chrono::milliseconds(f.after_ms);
      if (at <= now) {
        Fault x = f;
        g->pending.erase(g->pending.begin() + static_cast<long>(i));
        fire_fault_locked(x);
        continue;
      }
      next = std::min(next, at);
    }
    ++i;
  }
  return next;
}

}  // namespace fv
