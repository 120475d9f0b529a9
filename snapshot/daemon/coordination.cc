// r2ccl_snapshotd: the coordinator's consistent cuts, and the control plane's events (daemon.h):
// records, suspicions and evictions (the decisions: coordinator.h, cut.h), the health board.

#include "daemon.h"

namespace snapd {

// ---- consistent cuts (the coordinator) ----

void Daemon::on_held(const HeldBody& h) {
  if (!acting_) return;
  if (record_ && !shard_current(*record_, h.generation, h.step)) return;  // rolled back
  world_ = h.world;
  if (h.world != cut_.ranks()) cut_.set_ranks(h.world);  // applies to steps not seen yet
  cut_.set_home(h.rank, h.home_node);
  (void)cut_.on_held(h.node_id, h.rank, h.step);
  seen_step_ = std::max(seen_step_, h.step);
}

void Daemon::answer_marker(uint32_t coordinator, const MarkerBody& b) {
  for (const HeldStep& s :
       holdings_.full_steps(b.all ? std::nullopt : std::optional<uint64_t>(b.step))) {
    if (s.home_node == o_.self) continue;
    HeldBody h{o_.self, s.rank, s.world, s.home_node, s.step, s.generation};
    if (coordinator == o_.self)
      on_held(h);
    else
      send_peer(coordinator, peer_frame(PeerMsg::kHeld, h));
  }
  if (coordinator != o_.self)
    send_peer(coordinator, peer_frame(PeerMsg::kMarkerDone, MarkerDoneBody{o_.self, b.round}));
}

void Daemon::coordinate_cuts(TimeUs now) {
  const std::vector<uint32_t> live = cut_members_;
  const uint64_t epoch = record_ ? record_->epoch : 0;
  if (!cut_owned_ || cut_epoch_ != epoch) {
    if (!cut_owned_) {
      cut_ = CutTracker(o_.replicas);
      if (world_) cut_.set_ranks(world_);
      round_.reset();
      answered_all_.clear();
      answered_all_.insert(o_.self);
      SNAP_INFO("consistent cuts: rebuilding the view from every live node's holdings");
    }
    cut_owned_ = true;
    cut_epoch_ = epoch;
  }
  // Follow the membership: lost nodes' reports stop counting; new ones report everything.
  for (uint32_t n : cut_.live_nodes())
    if (std::find(live.begin(), live.end(), n) == live.end()) {
      cut_.on_node_lost(n);
      if (round_) round_->waiting.erase(n);
    }
  // New members report everything they hold; one that has not answered yet is asked again
  // every 10 periods (its connection may have been down).
  const bool again = ++marker_ticks_ % 10 == 0;
  for (uint32_t n : live)
    if (cut_.add_node(n) || (again && !answered_all_.count(n))) {
      MarkerBody all{epoch, 0, 1, 0};
      if (n == o_.self)
        answer_marker(o_.self, all);
      else
        send_peer(n, peer_frame(PeerMsg::kMarker, all));
    }
  // Close the open round when every live node answered, or after 5 periods.
  if (round_ && (round_->waiting.empty() || now - round_->started > 5 * o_.period)) {
    const StepStatus st = cut_.round_done(round_->step);
    if (!st.complete) {
      std::string miss;
      for (uint32_t r : cut_.missing(round_->step))
        miss += (miss.empty() ? "" : ",") + std::to_string(r);
      SNAP_INFO("round %u: step %llu incomplete (ranks without a live replica: {%s})", round_->id,
                static_cast<unsigned long long>(round_->step), miss.c_str());
    }
    round_.reset();
  }
  // A new round for the newest step heard of.
  const auto last = cut_.last_round();
  if (!round_ && seen_step_ > 0 && cut_.ranks() > 0 && (!last || seen_step_ > *last) &&
      cut_.begin_round(seen_step_)) {
    round_ = Round{++round_ids_, seen_step_, {}, now};
    MarkerBody mk{epoch, seen_step_, 0, round_->id};
    for (uint32_t n : live) {
      if (n == o_.self) {
        answer_marker(o_.self, mk);
      } else {
        round_->waiting.insert(n);
        send_peer(n, peer_frame(PeerMsg::kMarker, mk));
      }
    }
  }
  // The newest complete step goes to etcd (fenced), and from there to every node; it only
  // moves forward (a step that lost its replicas is handled by the next record's restore
  // step, which every rank then restores).
  const std::optional<uint64_t> nc = cut_.newest_complete();
  if (nc && (!cut_written_ || *nc > *cut_written_) && cut_ready()) {
    cut_written_ = nc;
    cp_->write_cut(*nc, record_ ? record_->generation : 0, epoch);
  }
}

// Every member the tracker follows answered the marker for everything it holds.
bool Daemon::cut_ready() const {
  for (uint32_t n : cut_members_)
    if (!answered_all_.count(n)) return false;
  return cut_owned_;
}

// A replica no longer holds (rank, step) in full.
void Daemon::on_retract(const HeldBody& h) {
  if (!acting_) return;
  if (cut_.on_retracted(h.node_id, h.rank, h.step))
    SNAP_INFO("rank %u step %llu: node %u no longer holds it (retracted)", h.rank,
              static_cast<unsigned long long>(h.step), h.node_id);
}

// This node no longer holds these steps in full (pruned, or a shard failed its checksum).
void Daemon::retract(const std::vector<HeldStep>& gone) {
  for (const HeldStep& g : gone) {
    if (g.home_node == o_.self) continue;
    HeldBody h{o_.self, g.rank, g.world, g.home_node, g.step, g.generation};
    if (coordinator() == int64_t(o_.self))
      on_retract(h);
    else if (coordinator() >= 0)
      send_peer(uint32_t(coordinator()), peer_frame(PeerMsg::kRetract, h));
  }
}

// Whether a shard belongs to the current timeline (not a step of a rolled-back generation).
bool Daemon::shard_wanted(const ShardMeta& m) const {
  return !record_ || shard_current(*record_, m.generation, m.step);
}

void Daemon::apply_complete(std::optional<uint64_t> step) {
  if (step == complete_) return;
  const std::optional<uint64_t> before = complete_;
  complete_ = step;
  SNAP_INFO("newest complete step: %s%s", step ? std::to_string(*step).c_str() : "none",
            before && step && *step < *before ? " (fell back: a replica was lost)" : "");
  if (step) {
    m_.gauge(M::kNewestCompleteStep).set(double(*step));
    // Replication lag: from the last shard of a step of this node's ranks arriving here to
    // the step being complete.
    auto it = step_arrived_.find(*step);
    if (it != step_arrived_.end()) m_.gauge(M::kReplicationLag).set((now_us() - it->second) / 1e6);
    step_arrived_.erase(step_arrived_.begin(), step_arrived_.upper_bound(*step));
  }
  // Keep the chains of the previous complete step too: a lost replica can make the newest
  // one incomplete again, and the fallback must still be restorable.
  // The chains of the record's restore step are pinned until a newer record.
  if (before && step && *step > *before) {
    uint64_t keep = *before;
    if (record_ && record_->restore_step) keep = std::min(keep, *record_->restore_step);
    prune_before(keep);
  }
  push_state();
}

void Daemon::prune_before(uint64_t keep) {
  const std::vector<HeldStep> had = holdings_.full_steps();
  const PruneResult pr = store_.prune(keep);
  if (!pr.shards) return;
  holdings_.retain(store_.list());
  index_dirty_ = true;
  retract(lost_steps(had));
}

// The steps of `had` no longer held in full.
std::vector<HeldStep> Daemon::lost_steps(const std::vector<HeldStep>& had) {
  std::set<std::pair<uint32_t, uint64_t>> now;
  for (const HeldStep& h : holdings_.full_steps()) now.insert({h.rank, h.step});
  std::vector<HeldStep> gone;
  for (const HeldStep& h : had)
    if (!now.count({h.rank, h.step})) gone.push_back(h);
  return gone;
}

// ---- membership: the local view, the control plane's events ----

// The nodes this daemon replicates to and fetches from: the agreed record's members it does
// not suspect (before the first record: every peer it has heard), and itself.
std::vector<uint32_t> Daemon::live() const {
  std::set<uint32_t> out{o_.self};
  if (record_) {
    for (const auto& m : record_->members)
      if (!suspected_.count(m.id)) out.insert(m.id);
  } else if (hb_) {
    for (const auto& [id, p] : hb_->snapshot())
      if (p.ever_heard && !p.suspected) out.insert(id);
  }
  return {out.begin(), out.end()};
}

void Daemon::on_suspect(uint32_t id, bool on) {
  if (on) {
    suspected_.insert(id);
    m_.counter(M::kNodesFailed).inc();
    ever_failed_.insert(id);
    SNAP_WARN(
        "node %u: no heartbeat for %.0f ms: suspected (published to etcd; the "
        "coordinator evicts only when a second node agrees)",
        id,
        hb_->snapshot()[id].last_heard ? (now_us() - hb_->snapshot()[id].last_heard) / 1e3 : 0.0);
    auto it = outs_.find(id);
    if (it != outs_.end()) close_conn(it->second);
  } else {
    suspected_.erase(id);
    m_.counter(M::kNodesRejoined).inc();
    SNAP_INFO("node %u: heard again", id);
  }
  cp_->suspect(id, on);
}

void Daemon::start_control_plane() {
  ControlPlane::Config c;
  c.etcd = o_.etcd;
  c.prefix = o_.prefix;
  c.self = o_.self;
  c.period = o_.period;
  c.lease_ttl_s = o_.lease_ttl_s;
  c.token = o_.token;
  c.test_write_after_pause = o_.test_write_after_pause;
  c.test_register_delay_ms = o_.test_register_delay_ms;
  ControlPlane::Events e;
  e.record = [this](const Record& r) { asio::post(io_, [this, r] { apply_record(r); }); };
  e.cut = [this](uint64_t step, uint64_t gen) {
    asio::post(io_, [this, step, gen] {
      // A step of a rolled-back timeline does not count; one at or before the restore point
      // does, whatever generation took it (a daemon that starts after a recovery reads the
      // cut written before it).
      if (record_ && !shard_current(*record_, gen, step)) return;
      complete_generation_ = gen;
      apply_complete(step);
    });
  };
  e.kv = [this](const std::string& k, const std::string& v) {
    asio::post(io_, [this, k, v] { kv_[k] = v; });
  };
  e.leader = [this](bool on) {
    asio::post(io_, [this, on] {
      acting_ = on;
      m_.gauge(M::kCoordinator).set(on ? 1 : 0);
      if (on) {
        planner_.took_over(now_us());
      } else {
        cut_owned_ = false;
      }
    });
  };
  e.etcd = [this](bool up) {
    asio::post(io_, [this, up] {
      if (up) planner_.etcd_back(now_us());  // leases may have run out meanwhile
    });
  };
  e.view = [this](const ControlPlane::View& v) { asio::post(io_, [this, v] { on_view(v); }); };
  e.registered = [this](uint64_t inc) { hb_->set_incarnation(inc); };
  e.cut_failed = [this](uint64_t step) {
    asio::post(io_, [this, step] {
      if (cut_written_ && *cut_written_ == step) cut_written_.reset();  // the next tick retries
    });
  };
  cp_ = std::make_unique<ControlPlane>(c, e);
  cp_->start();
}

// The coordinator's turn: evictions and the next record (coordinator.h decides).
void Daemon::on_view(const ControlPlane::View& v) {
  if (!acting_) return;
  Planner::Input in;
  in.registered = v.registered;
  in.suspects = v.suspects;
  in.current = v.record;
  in.now = now_us();
  // The cut view follows the members the planner keeps; it must be ready before a record
  // that loses a member says which step everyone restores.
  std::vector<MemberInfo> after;
  (void)planner_.plan(in, &after);
  std::vector<uint32_t> ids;
  for (const auto& m : after) ids.push_back(m.id);
  cut_members_ = ids;
  if (cut_owned_) {
    for (uint32_t n : cut_.live_nodes())
      if (std::find(ids.begin(), ids.end(), n) == ids.end()) {
        cut_.on_node_lost(n);
        answered_all_.erase(n);
        if (round_) round_->waiting.erase(n);
      }
    in.newest_complete = cut_.newest_complete();
  }
  in.cut_ready = cut_ready();
  const Planner::Plan p = planner_.plan(in);
  for (uint32_t t : p.evict)
    for (const auto& m : v.registered)
      if (m.id == t) cp_->evict(m);
  if (p.waiting_for_cut && !waiting_logged_) {
    waiting_logged_ = true;
    SNAP_INFO("a member is gone: waiting for every member's holdings before the restore record");
  }
  if (!p.next || (pending_epoch_ && *pending_epoch_ >= p.next->epoch)) return;
  waiting_logged_ = false;
  pending_epoch_ = p.next->epoch;
  const std::string why = p.why;
  const uint64_t epoch = p.next->epoch;
  cp_->write_record(*p.next, v.record_revision, [this, why, epoch](bool ok, const std::string&) {
    asio::post(io_, [this, ok, why, epoch] {
      if (ok)
        SNAP_INFO("coordinator: wrote record epoch %llu (%s)", (unsigned long long)epoch,
                  why.c_str());
      if (!ok && pending_epoch_ && *pending_epoch_ == epoch) pending_epoch_.reset();
    });
  });
}

// A record from etcd (every node, the coordinator included).
void Daemon::apply_record(const Record& r) {
  if (record_ && r.epoch <= record_->epoch) return;
  const uint64_t old_gen = record_ ? record_->generation : 0;
  record_ = r;
  if (pending_epoch_ && *pending_epoch_ <= r.epoch) pending_epoch_.reset();
  if (r.generation > old_gen) {
    // A restore point: the steps after it of older generations were rolled back.
    const std::vector<HeldStep> had = holdings_.full_steps();
    size_t dropped = 0;
    for (const ShardMeta& m : holdings_.all())
      if (!shard_current(r, m.generation, m.step)) {
        std::string err;
        store_.erase(ShardKey{m.rank, m.step, m.buffer});
        holdings_.remove(ShardKey{m.rank, m.step, m.buffer});
        ++dropped;
      }
    if (dropped) {
      index_dirty_ = true;
      SNAP_INFO("generation %llu (restore step %s): dropped %zu shards of rolled-back steps",
                (unsigned long long)r.generation,
                r.restore_step ? std::to_string(*r.restore_step).c_str() : "none", dropped);
      retract(lost_steps(had));
    }
    seen_step_ = r.restore_step.value_or(0);
  }
  // The complete step follows the timeline: one that was rolled back gives way to the restore
  // point, and a daemon with none yet (started after the recovery) takes the restore point.
  // Both come from etcd, so every node agrees whichever of record and cut it read first.
  if (complete_ ? !shard_current(r, complete_generation_, *complete_) : bool(r.restore_step)) {
    complete_generation_ = r.generation;
    cut_written_ = r.restore_step;
    apply_complete(r.restore_step);
  }
  write_board(to_board(r, uint32_t(o_.peers.size())), "from etcd");
}

void Daemon::write_board(const board::AgreedRecord& r, const std::string& how) {
  std::string err;
  if (!board::publish_agreed_record(o_.board, r, &err)) {
    if (err != board_error_)  // once per distinct error, not every period
      SNAP_WARN("cannot publish the agreed record to health board %s: %s", o_.board.c_str(),
                err.c_str());
    board_error_ = err;
    return;
  }
  board_error_.clear();
  written_ = r;
  std::string members;
  for (uint32_t id = 0; id < r.n_nodes && id < static_cast<uint32_t>(board::kMaxNodes); ++id)
    if (r.members[id / 64] & (1ULL << (id % 64)))
      members += (members.empty() ? "" : ",") + std::to_string(id);
  SNAP_INFO("agreed record epoch %llu, members {%s} written to board %s (%s)",
            static_cast<unsigned long long>(r.epoch), members.c_str(), o_.board.c_str(),
            how.c_str());
  push_state();
}

// This node's usable network bandwidth (GB/s): the rails its net plugins publish as up, once
// per rail name. 0 when the board is absent or shows none.
float Daemon::local_usable_gbps() {
  board::BoardView v;
  std::string err;
  if (!board::read_board(o_.board, &v, &err)) return 0;
  std::map<std::string, uint32_t> rails;
  for (const auto& s : v.rails)
    if (s.f.state == board::RailState::kUp) rails[s.f.name] = s.f.usable_mbps;
  double mbps = 0;
  for (const auto& [n, m] : rails) mbps += m;
  return static_cast<float>(mbps / 8000.0);
}

}  // namespace snapd
