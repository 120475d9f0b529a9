#include "r2ccl/snapshot/control_plane.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include <openssl/evp.h>

#include "r2ccl/snapshot/log.h"

namespace r2ccl::snap {

using etcd::Compare;
using etcd::Op;

namespace {
std::string pad(uint64_t v, int width) {
  char b[32];
  snprintf(b, sizeof(b), "%0*" PRIu64, width, v);
  return b;
}
uint64_t random_incarnation() {
  std::random_device rd;
  const uint64_t v = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(now_us());
  return v ? v : 1;
}
bool parse_id(const std::string& s, uint32_t* out) {
  if (s.empty() || s.size() > 6 || s.find_first_not_of("0123456789") != std::string::npos)
    return false;
  *out = uint32_t(std::stoul(s));
  return *out < uint32_t(board::kMaxNodes);
}
}  // namespace

std::string ControlPlane::member_key(const std::string& p, uint32_t id) {
  return p + "members/" + pad(id, 4);
}
std::string ControlPlane::election_key(const std::string& p, uint32_t id) {
  return p + "election/" + pad(id, 4);
}
std::string ControlPlane::epoch_key(const std::string& p, uint64_t epoch) {
  return p + "records/" + pad(epoch, 20);
}
std::string ControlPlane::suspect_key(const std::string& p, uint32_t target, uint32_t observer) {
  return p + "suspect/" + pad(target, 4) + "/" + pad(observer, 4);
}

ControlPlane::ControlPlane(Config c, Events e) : c_(std::move(c)), e_(std::move(e)) {
  // Chosen now, not at the first registration: the daemon's first HELLOs to its peers go out
  // before etcd answers, and a peer reopens its connection to a restarted node only when the
  // HELLO names a new incarnation (with 0 it kept writing answers into the dead process's
  // socket, and a replacement's FETCHes waited 10 periods).
  incarnation_ = random_incarnation();
  kv_ = std::make_unique<etcd::Client>(c_.etcd);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(c_.token.data(), c_.token.size(), md, &n, EVP_sha256(), nullptr);
  static const char* hex = "0123456789abcdef";
  for (unsigned i = 0; i < std::min(n, 16u); ++i) {
    job_ += hex[md[i] >> 4];
    job_ += hex[md[i] & 15];
  }
}
ControlPlane::~ControlPlane() { stop(false); }

void ControlPlane::start() {
  thread_ = std::thread([this] { run(); });
}

void ControlPlane::stop(bool leave) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  watch_.reset();
  if (leave && lease_) {
    const etcd::Status s = kv_->lease_revoke(lease_);
    if (s.ok())
      SNAP_INFO("etcd: left the job (lease revoked)");
    else
      SNAP_WARN("etcd: could not revoke this node's lease on exit: %s", s.message.c_str());
  }
  lease_ = 0;
}

void ControlPlane::enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> l(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

Compare ControlPlane::fence() const {
  Compare f;
  f.key = election_key(c_.prefix, c_.self);
  f.target = Compare::kCreate;
  f.result = Compare::kEqual;
  f.number = election_rev_;
  return f;
}

void ControlPlane::note(const etcd::Status& s) {
  const bool up = s.code != etcd::Status::kUnreachable;
  if (up == reachable_.load()) return;
  reachable_ = up;
  if (!up) {
    unreachable_since_ = now_us();
    SNAP_WARN(
        "etcd unreachable (%s): training and replication go on; no membership or restore "
        "decision until it is back",
        s.message.c_str());
  } else {
    SNAP_INFO("etcd reachable again after %.1f s", (now_us() - unreachable_since_) / 1e6);
  }
  if (e_.etcd) e_.etcd(up);
}

// etcd refused a registration step (an outage is note()'s to say). The daemon tries again
// every period, so without this line a wrong password, a missing permission or a certificate
// etcd rejects would look like a daemon that silently never joins; each new reason is logged
// once, not every period.
bool ControlPlane::register_refused(const etcd::Status& s) {
  if (s.code == etcd::Status::kError && s.message != register_error_) {
    register_error_ = s.message;
    SNAP_WARN("etcd: cannot register node %u: %s; trying again every period", c_.self,
              s.message.c_str());
  }
  return false;
}

bool ControlPlane::do_register(bool new_incarnation) {
  if (new_incarnation || incarnation_ == 0) incarnation_ = random_incarnation();
  // A predecessor on this id (a restart within its TTL, or our own earlier try): its member key
  // is replaced in one write, then its lease revoked, so its suspicions go with it. Never the
  // other way round: between a revoke and the new member key the id is missing from etcd, and a
  // coordinator that reads then records a loss and a join where a restart happened.
  std::vector<etcd::KeyValue> old;
  etcd::Status s = kv_->range(member_key(c_.prefix, c_.self), "", &old);
  note(s);
  if (!s.ok()) return register_refused(s);
  int64_t predecessor = 0;
  if (!old.empty() && old[0].lease && old[0].lease != lease_) {
    MemberInfo prev;
    std::string err;
    if (!decode_member(old[0].value, &prev, &err) || prev.job != job_) {
      // Another job's daemon holds this id under our prefix (a misconfiguration): leave it be.
      if (foreign_.insert("self/" + old[0].value).second)
        SNAP_WARN(
            "etcd: node id %u is registered under another job token at %s; not "
            "registering until it is gone (check --job and --token-file)",
            c_.self, old[0].key.c_str());
      return false;
    }
    predecessor = old[0].lease;
  }
  const int64_t own_before = lease_;  // our own expired or evicted registration, or 0
  int64_t fresh = 0;
  s = kv_->lease_grant(c_.lease_ttl_s, &fresh);
  note(s);
  if (!s.ok()) return register_refused(s);
  lease_ = fresh;
  MemberInfo me;
  me.id = c_.self;
  me.incarnation = incarnation_;
  me.lease = lease_;
  me.usable_gbps = gbps_.load();
  me.job = job_;
  gbps_published_ = me.usable_gbps;
  if (c_.test_register_delay_ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(c_.test_register_delay_ms));
  // The member key and the end of any old election key in one transaction: a paused
  // predecessor fails its fence from the moment this incarnation is the member.
  etcd::TxnResult tr;
  Op put_member{Op::kPut, member_key(c_.prefix, c_.self), encode_member(me), "", lease_};
  Op del_election{Op::kDelete, election_key(c_.prefix, c_.self), "", "", 0};
  s = kv_->txn({}, {put_member, del_election}, {}, &tr);
  note(s);
  if (!s.ok()) return register_refused(s);
  if (predecessor) kv_->lease_revoke(predecessor);
  if (own_before && own_before != predecessor) kv_->lease_revoke(own_before);
  // A new election key (created now: its create revision is our fence), in a second
  // transaction: etcd refuses two operations on one key in one.
  Op put_election{Op::kPut, election_key(c_.prefix, c_.self), "", "", lease_};
  Op get_election{Op::kRange, election_key(c_.prefix, c_.self), "", "", 0};
  tr = etcd::TxnResult{};
  s = kv_->txn({}, {put_election, get_election}, {}, &tr);
  note(s);
  if (!s.ok()) return register_refused(s);
  election_rev_ = !tr.ranges.empty() && !tr.ranges[0].empty() ? tr.ranges[0][0].create_revision : 0;
  registered_ = true;
  register_error_.clear();
  member_deleted_ = false;
  last_keepalive_ = now_us();
  suspecting_.clear();
  SNAP_INFO("etcd: registered node %u (incarnation %" PRIu64 ", lease %" PRId64 ", TTL %" PRId64
            " s)",
            c_.self, incarnation_.load(), lease_, c_.lease_ttl_s);
  if (e_.registered) e_.registered(incarnation_);
  return true;
}

void ControlPlane::keepalive() {
  int64_t ttl = 0;
  etcd::Status s = kv_->lease_keepalive(lease_, &ttl);
  note(s);
  if (!s.ok()) return;
  last_keepalive_ = now_us();
  // Our member key: gone while the lease lives means an eviction (read at every keep-alive;
  // the watch covers only P w/).
  std::vector<etcd::KeyValue> mine;
  if (ttl > 0 && kv_->range(member_key(c_.prefix, c_.self), "", &mine).ok() && mine.empty())
    member_deleted_ = true;
  const bool deleted = member_deleted_.exchange(false);
  if (ttl <= 0) {
    // Expired (an outage longer than the TTL, or this process was stopped): keep the
    // incarnation when the record still has it, so the coordinator keeps this node in place.
    std::lock_guard<std::mutex> l(record_mu_);
    const bool kept = last_record_ && last_record_->find(c_.self) &&
                      last_record_->find(c_.self)->incarnation == incarnation_;
    SNAP_WARN("etcd: this node's lease expired; registering again (%s incarnation)",
              kept ? "same" : "new");
    registered_ = false;
    lease_ = 0;
    if (leader_) {
      leader_ = false;
      if (e_.leader) e_.leader(false);
    }
    do_register(!kept);
    return;
  }
  if (deleted) {
    // Our member key went while the lease lives: the coordinator evicted this node.
    {
      SNAP_WARN(
          "etcd: this node was evicted (suspected by two others); registering again with a "
          "new incarnation");
      if (leader_) {
        leader_ = false;
        if (e_.leader) e_.leader(false);
      }
      do_register(true);
    }
  }
}

void ControlPlane::elect() {
  // Only the oldest election key (one key, whatever the job's size).
  const std::string p = c_.prefix + "election/";
  etcd::KeyValue oldest;
  bool found = false;
  etcd::Status s = kv_->oldest(p, etcd::prefix_end(p), &oldest, &found);
  note(s);
  if (!s.ok()) return;
  const etcd::KeyValue* low = found ? &oldest : nullptr;
  uint32_t low_id = 0;
  coordinator_ =
      low && parse_id(low->key.substr(c_.prefix.size() + 9), &low_id) ? int64_t(low_id) : -1;
  const bool me =
      low && low->key == election_key(c_.prefix, c_.self) && low->create_revision == election_rev_;
  if (me != leader_.load()) {
    leader_ = me;
    if (me)
      SNAP_INFO("etcd: elected coordinator (fencing revision %" PRId64 ")", election_rev_);
    else
      SNAP_INFO("etcd: not the coordinator");
    if (e_.leader) e_.leader(me);
  }
}

void ControlPlane::read_view() {
  View v;
  const std::string mp = c_.prefix + "members/", sp = c_.prefix + "suspect/";
  std::vector<etcd::KeyValue> ms, ss, rs;
  etcd::Status s = kv_->range(mp, etcd::prefix_end(mp), &ms);
  if (s.ok()) s = kv_->range(sp, etcd::prefix_end(sp), &ss);
  if (s.ok()) s = kv_->range(record_key(c_.prefix), "", &rs);
  note(s);
  if (!s.ok()) return;
  for (const auto& kv : ms) {
    MemberInfo m;
    std::string err;
    if (!decode_member(kv.value, &m, &err)) {
      SNAP_WARN("etcd key %s: %s; ignored", kv.key.c_str(), err.c_str());
      continue;
    }
    m.lease = kv.lease;
    if (m.job != job_) {
      if (foreign_.insert(std::to_string(m.id) + "/" + m.job).second)
        SNAP_WARN("etcd: node %u is registered under another job token (%s); ignored", m.id,
                  kv.key.c_str());
      continue;
    }
    v.registered.push_back(m);
  }
  for (const auto& kv : ss) {
    // P suspect/TTTT/OOOO
    const std::string rest = kv.key.substr(sp.size());
    const size_t slash = rest.find('/');
    uint32_t t = 0, o = 0;
    if (slash != std::string::npos && parse_id(rest.substr(0, slash), &t) &&
        parse_id(rest.substr(slash + 1), &o))
      v.suspects.insert({t, o});
  }
  if (!rs.empty()) {
    Record r;
    std::string err;
    if (decode_record(rs[0].value, &r, &err)) {
      v.record = r;
      v.record_revision = rs[0].mod_revision;
    } else {
      SNAP_WARN("etcd key %s: %s; the next record replaces it", rs[0].key.c_str(), err.c_str());
      v.record_revision = rs[0].mod_revision;
    }
  }
  if (e_.view) e_.view(v);
}

int64_t ControlPlane::initial_read() {
  std::vector<etcd::KeyValue> all;
  int64_t rev = 0;
  for (;;) {
    const std::string w = c_.prefix + "w/";
    etcd::Status s = kv_->range(w, etcd::prefix_end(w), &all, &rev);
    note(s);
    if (s.ok()) break;
    std::unique_lock<std::mutex> l(mu_);
    if (cv_.wait_for(l, std::chrono::microseconds(c_.period), [this] { return stop_; })) return 0;
  }
  std::vector<etcd::WatchEvent> evs;
  for (auto& kv : all) evs.push_back({etcd::WatchEvent::kPut, std::move(kv)});
  on_watch(evs);
  return rev;
}

void ControlPlane::on_watch(const std::vector<etcd::WatchEvent>& evs) {
  const std::string kvp = c_.prefix + "w/kv/";
  for (const auto& ev : evs) {
    const std::string& k = ev.kv.key;
    if (ev.type == etcd::WatchEvent::kDelete) {
      if (k == member_key(c_.prefix, c_.self)) {
        member_deleted_ = true;
        cv_.notify_all();
      }
      continue;
    }
    if (k == record_key(c_.prefix)) {
      Record r;
      std::string err;
      if (!decode_record(ev.kv.value, &r, &err)) {
        SNAP_WARN("etcd key %s: %s; ignored", k.c_str(), err.c_str());
        continue;
      }
      {
        std::lock_guard<std::mutex> l(record_mu_);
        if (last_record_ && r.epoch < last_record_->epoch) continue;  // never backwards
        last_record_ = r;
      }
      if (e_.record) e_.record(r);
    } else if (k == cut_key(c_.prefix)) {
      try {
        auto j = nlohmann::json::parse(ev.kv.value);
        const uint64_t step = j.at("step").get<uint64_t>();
        const uint64_t gen = j.value("generation", uint64_t(0));
        if (e_.cut) e_.cut(step, gen);
      } catch (const std::exception& e) {
        SNAP_WARN("etcd key %s: %s (accepted: {\"step\":N,\"generation\":G}); ignored", k.c_str(),
                  e.what());
      }
    } else if (k.compare(0, kvp.size(), kvp) == 0) {
      if (e_.kv) e_.kv(k.substr(kvp.size()), ev.kv.value);
    }
  }
}

void ControlPlane::run() {
  while (!do_register(false)) {
    std::unique_lock<std::mutex> l(mu_);
    if (cv_.wait_for(l, std::chrono::microseconds(c_.period), [this] { return stop_; })) return;
  }
  const int64_t rev = initial_read();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_) return;
  }
  watch_ = std::make_unique<etcd::Watch>(
      c_.etcd, c_.prefix + "w/", rev + 1,
      [this](const std::vector<etcd::WatchEvent>& evs, int64_t) { on_watch(evs); },
      [this] {
        // Compacted past our revision: read everything again.
        std::vector<etcd::KeyValue> all;
        int64_t r = 0;
        const std::string w = c_.prefix + "w/";
        if (!kv_->range(w, etcd::prefix_end(w), &all, &r).ok()) return int64_t(0);
        std::vector<etcd::WatchEvent> evs;
        for (auto& kv : all) evs.push_back({etcd::WatchEvent::kPut, std::move(kv)});
        on_watch(evs);
        return r;
      },
      nullptr);
  const TimeUs ka_every = std::max<TimeUs>(c_.lease_ttl_s * kUsPerSec / 3, 100 * kUsPerMs);
  TimeUs next_turn = now_us(), last_turn = now_us();
  // The test hook's stale view: whether this node coordinated, and its fence, at the end of
  // the turn before a pause (a stop can land in the middle of a turn, whose keep-alive then
  // finds the lease expired and steps down before the next turn sees the pause).
  bool led_before = false;
  Compare fence_before = fence();
  for (;;) {
    std::deque<std::function<void()>> jobs;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait_until(
          l, std::chrono::steady_clock::time_point(std::chrono::microseconds(next_turn)),
          [&] { return stop_ || (!jobs_.empty() && reachable_.load()) || member_deleted_.load(); });
      if (stop_) return;
      jobs.swap(jobs_);
    }
    const TimeUs now = now_us();
    const bool paused = now - last_turn > 3 * c_.period + ka_every;
    last_turn = now;
    if (paused && c_.test_write_after_pause && led_before) {
      std::optional<Record> r;
      {
        std::lock_guard<std::mutex> l(record_mu_);
        r = last_record_;
      }
      if (r) {
        // Test hook: what a stopped coordinator would do with its stale view on waking up.
        r->epoch += 1;
        etcd::TxnResult tr;
        etcd::Status s =
            kv_->txn({fence_before},
                     {{Op::kPut, record_key(c_.prefix), encode_record(*r), "", 0},
                      {Op::kPut, epoch_key(c_.prefix, r->epoch), encode_record(*r), "", 0}},
                     {}, &tr);
        SNAP_INFO("test hook: a write after a %.1f s pause was %s", (now - next_turn) / 1e6,
                  s.ok() && tr.succeeded ? "ACCEPTED" : "refused by the fence");
      }
    }
    if (!registered_) {
      if (!do_register(false)) {
        next_turn = now + c_.period;
        continue;
      }
    }
    if (member_deleted_ || now - last_keepalive_ >= ka_every) keepalive();
    if (!registered_) {
      next_turn = now_us() + c_.period;
      continue;
    }
    for (auto& j : jobs) j();
    if (gbps_published_ < 0 ||
        std::abs(gbps_.load() - gbps_published_) > 0.1f * std::max(gbps_published_, 0.1f)) {
      MemberInfo me{c_.self, incarnation_, lease_, gbps_.load(), job_};
      if (kv_->put(member_key(c_.prefix, c_.self), encode_member(me), lease_).ok())
        gbps_published_ = me.usable_gbps;
    }
    if (now >= next_turn) {
      elect();
      if (leader_) read_view();
      // At least every 250 ms: a long heartbeat period must not delay the lease path.
      next_turn = now + std::min<TimeUs>(c_.period, 250 * kUsPerMs);
    }
    led_before = leader_;
    fence_before = fence();
  }
}

void ControlPlane::write_record(Record r, int64_t expected_revision,
                                std::function<void(bool, const std::string&)> done) {
  enqueue([this, r, expected_revision, done] {
    Record w = r;
    w.leader = c_.self;
    w.leader_revision = election_rev_;
    Compare same_record{Compare::kMod, Compare::kEqual, record_key(c_.prefix), expected_revision,
                        ""};
    Compare new_epoch{Compare::kVersion, Compare::kEqual, epoch_key(c_.prefix, w.epoch), 0, ""};
    const std::string text = encode_record(w);
    etcd::TxnResult tr;
    etcd::Status s = kv_->txn({fence(), same_record, new_epoch},
                              {{Op::kPut, record_key(c_.prefix), text, "", 0},
                               {Op::kPut, epoch_key(c_.prefix, w.epoch), text, "", 0}},
                              {}, &tr);
    note(s);
    const bool ok = s.ok() && tr.succeeded;
    const std::string why = !s.ok() ? s.message
                            : ok    ? ""
                                    : "refused: not the coordinator any more, or the record "
                                      "changed since it was read";
    if (!ok) SNAP_WARN("etcd: record epoch %" PRIu64 " not written: %s", w.epoch, why.c_str());
    if (done) done(ok, why);
  });
}

void ControlPlane::write_cut(uint64_t step, uint64_t generation, uint64_t epoch) {
  enqueue([this, step, generation, epoch] {
    const std::string v =
        nlohmann::json{{"step", step}, {"generation", generation}, {"epoch", epoch}}.dump();
    etcd::TxnResult tr;
    etcd::Status s = kv_->txn({fence()}, {{Op::kPut, cut_key(c_.prefix), v, "", 0}}, {}, &tr);
    note(s);
    if (!s.ok() || !tr.succeeded) {
      SNAP_WARN("etcd: newest complete step %" PRIu64 " not written: %s", step,
                s.ok() ? "refused: not the coordinator any more" : s.message.c_str());
      if (e_.cut_failed) e_.cut_failed(step);
    }
  });
}

void ControlPlane::evict(const MemberInfo& m) {
  enqueue([this, m] {
    Compare same{Compare::kLease, Compare::kEqual, member_key(c_.prefix, m.id), m.lease, ""};
    const std::string sp = c_.prefix + "suspect/" + pad(m.id, 4) + "/";
    etcd::TxnResult tr;
    etcd::Status s = kv_->txn({fence(), same},
                              {{Op::kDelete, member_key(c_.prefix, m.id), "", "", 0},
                               {Op::kDelete, election_key(c_.prefix, m.id), "", "", 0},
                               {Op::kDelete, sp, "", etcd::prefix_end(sp), 0}},
                              {}, &tr);
    note(s);
    if (s.ok() && tr.succeeded) {
      SNAP_INFO("etcd: evicted node %u (incarnation %" PRIu64 "): suspected by two others", m.id,
                m.incarnation);
      kv_->lease_revoke(m.lease);
    }
  });
}

void ControlPlane::suspect(uint32_t target, bool on) {
  enqueue([this, target, on] {
    if (on == (suspecting_.count(target) != 0)) return;
    const std::string k = suspect_key(c_.prefix, target, c_.self);
    etcd::Status s = on ? kv_->put(k, "", lease_) : kv_->del(k);
    note(s);
    if (s.ok()) {
      if (on)
        suspecting_.insert(target);
      else
        suspecting_.erase(target);
    } else if (s.code == etcd::Status::kUnreachable) {
      suspect(target, on);  // again at the next turn
    }
  });
}

void ControlPlane::kv_put(std::string key, std::string value) {
  enqueue([this, key, value] {
    const std::string k = kv_key(c_.prefix, key);
    etcd::TxnResult tr;
    etcd::Status s = kv_->txn({{Compare::kCreate, Compare::kEqual, k, 0, ""}},
                              {{Op::kPut, k, value, "", 0}}, {}, &tr);
    note(s);
    if (s.code == etcd::Status::kUnreachable) kv_put(key, value);  // again at the next turn
  });
}

void ControlPlane::set_gbps(float gbps) { gbps_ = gbps; }

}  // namespace r2ccl::snap
