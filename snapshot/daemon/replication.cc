// r2ccl_snapshotd: shard replication (daemon.h): a shard stored by the worker thread, the home
// copy sent to the rank's replicas, the chains a new or reconnected replica lacks resent.

#include "daemon.h"

namespace snapd {

// ---- shards ----

// A received shard (in c->body: ShardMeta + payload) is stored by the worker thread: the
// checksum check (the one of this hop) and any spill write stay off the event loop, which
// keeps heartbeats going while gigabytes arrive. The store keeps the received buffer itself
// (no copy), and the replicas are sent those same bytes with the producer's checksum (not
// computed again). Back on the loop it is indexed and reported, the home copy goes to the
// replicas, and the connection's reading resumes.
template <class C>
void Daemon::ingest(const std::shared_ptr<C>& c, const ShardMeta& m, const char* as, bool forward) {
  auto body = std::make_shared<Bytes>(std::move(c->body));
  c->body = {};
  asio::post(work_, [this, c, m, body, as, forward] {
    std::shared_ptr<const uint8_t> pay(body, body->data() + sizeof(ShardMeta));
    std::string err;
    const StoreStatus st = store_.put_shared(ShardKey{m.rank, m.step, m.buffer}, m.base_step,
                                             m.checksum, pay, m.payload_bytes, &err);
    Frame f;
    if (st == StoreStatus::kOk && forward)
      f = make_frame(kPeerMagic, kPeerVersion, uint16_t(PeerMsg::kShard), &m, sizeof(m), nullptr, 0,
                     pay, m.payload_bytes);
    asio::post(io_, [this, c, m, st, err, f, as] {
      after_store(m, st, err, as);
      if (st == StoreStatus::kOk && f) forward_shard(m, f);
      resume_reading(c);
    });
  });
}

void Daemon::after_store(const ShardMeta& m, StoreStatus st, const std::string& err,
                         const char* as) {
  const ShardKey k{m.rank, m.step, m.buffer};
  if (st != StoreStatus::kOk) {
    SNAP_WARN("cannot hold the %s shard %s: %s (%s)", as, to_string(k).c_str(),
              store_status_name(st), err.c_str());
    holdings_.remove(k);
    return;
  }
  index_dirty_ = true;
  ++shards_held_;
  if (holdings_.add(m) && m.home_node != o_.self) {
    HeldBody h{o_.self, m.rank, m.world, m.home_node, m.step, m.generation};
    report_held(h);
  }
}

void Daemon::report_held(const HeldBody& h) {
  if (coordinator() == int64_t(o_.self))
    on_held(h);
  else if (coordinator() >= 0)
    send_peer(uint32_t(coordinator()), peer_frame(PeerMsg::kHeld, h));
}

void Daemon::forward_shard(const ShardMeta& m, const Frame& f) {
  if (dying_) return;
  const std::vector<uint32_t> reps =
      choose_replicas(o_.self, live(), o_.topology, rtt_us_, o_.replicas);
  auto& known = replicas_of_[(uint64_t(m.rank) << 32) | m.buffer];
  for (uint32_t r : reps) {
    // A new replica for this (rank, buffer), or one whose connection was lost: first the
    // chain it is missing (from the home copy). Only a replica that took the frame counts.
    if (!known.count(r)) send_chain(r, m.rank, m.buffer, m.step, false);
    if (send_peer(r, f)) {
      known.insert(r);
      m_.counter(M::kShardsSent).inc();
      m_.counter(M::kShardBytesSent).inc(double(m.payload_bytes));
    } else {
      known.erase(r);
    }
  }
  for (auto it = known.begin(); it != known.end();)
    it = std::find(reps.begin(), reps.end(), *it) == reps.end() ? known.erase(it) : std::next(it);
  if (exit_after_ && m.step == exit_step_ && ++exit_count_ >= exit_after_) {
    // Test hook (R2CCL_SNAPD_TEST_EXIT_AFTER_SHARDS=STEP:N): the node dies after N shards of
    // STEP went to its replicas, before the step's round can complete.
    SNAP_INFO("test hook: exiting after %llu shards of step %llu were sent to replicas",
              static_cast<unsigned long long>(exit_count_),
              static_cast<unsigned long long>(exit_step_));
    dying_ = true;
    auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(300));
    t->async_wait([t](const std::error_code&) { _exit(3); });
  }
}

// Sends `node` the home copies of the chain that restores (rank, buffer, step), oldest first,
// without the step's own shard unless include_step. The shards are read on the worker thread;
// `done(ok)` runs on the loop (false: a shard could not be read or sent, the replica then
// does not count).
void Daemon::send_chain(uint32_t node, uint32_t rank, uint32_t buffer, uint64_t step,
                        bool include_step, std::function<void(bool)> done) {
  std::vector<ShardMeta> items;
  for (uint64_t s : holdings_.chain(rank, buffer, step)) {
    if (s == step && !include_step) break;
    ShardMeta d;
    if (!holdings_.describe(ShardKey{rank, s, buffer}, &d)) {
      if (done) done(false);
      return;
    }
    items.push_back(d);
  }
  if (items.empty()) {
    if (done) done(true);
    return;
  }
  read_chain(std::move(items), FrameKind::kPeerShard, 0,
             [this, node, done](std::vector<Frame> frames, StoreStatus st, ShardKey, std::string) {
               bool ok = st == StoreStatus::kOk;
               for (auto& f : frames) {
                 if (!ok) break;
                 const uint64_t n = f->size() - sizeof(PeerHeader) - sizeof(ShardMeta);
                 ok = send_peer(node, std::move(f));
                 if (ok) {
                   m_.counter(M::kShardsSent).inc();
                   m_.counter(M::kShardBytesSent).inc(double(n));
                 }
               }
               if (done) done(ok);
             });
}

// Takes the shards `items` (oldest first) from the store on the worker thread, by reference
// (a spilled one is read from its file and checked there: the disk hop; one in memory is
// not hashed again, its receiver checks it) and frames them around those bytes; `done` runs
// on the loop with the frames, or with the status, key and message of the first shard that
// could not be read.
void Daemon::read_chain(std::vector<ShardMeta> items, FrameKind kind, uint64_t request,
                        ChainDone done) {
  asio::post(work_, [this, items = std::move(items), kind, request, done = std::move(done)] {
    std::vector<Frame> frames;
    StoreStatus st = StoreStatus::kOk;
    ShardKey bad{};
    std::string err;
    for (size_t i = 0; i < items.size(); ++i) {
      ShardMeta m = items[i];
      const ShardKey k{m.rank, m.step, m.buffer};
      ShardRef ref;
      st = store_.view(k, &ref, &err);
      if (st != StoreStatus::kOk) {
        bad = k;
        frames.clear();
        break;
      }
      m.checksum = ref.info.checksum;
      m.payload_bytes = ref.info.size;
      const size_t n = size_t(ref.info.size);
      FetchedHead h{request, uint32_t(FetchStatus::kOk), uint32_t(i), uint32_t(items.size()),
                    o_.self};
      if (kind == FrameKind::kPeerShard)
        frames.push_back(make_frame(kPeerMagic, kPeerVersion, uint16_t(PeerMsg::kShard), &m,
                                    sizeof(m), nullptr, 0, std::move(ref.data), n));
      else if (kind == FrameKind::kPeerFetched)
        frames.push_back(make_frame(kPeerMagic, kPeerVersion, uint16_t(PeerMsg::kFetched), &h,
                                    sizeof(h), &m, sizeof(m), std::move(ref.data), n));
      else
        frames.push_back(make_frame(kClientMagic, kClientVersion, uint16_t(ClientMsg::kFetched), &h,
                                    sizeof(h), &m, sizeof(m), std::move(ref.data), n));
    }
    asio::post(io_, [done, frames = std::move(frames), st, bad, err]() mutable {
      done(std::move(frames), st, bad, err);
    });
  });
}

// Every period: each rank homed here has its newest held step's chains on its R nearest live
// nodes. A replica that joined, replaced a lost one, or lost its connection (and with it what
// was queued) gets the chains it lacks from the home copies, so a step taken while a peer
// was unreachable still completes, and a lost replica is replaced.
void Daemon::resync_replicas() {
  if (dying_) return;
  std::map<uint32_t, HeldStep> newest;  // rank -> newest step held in full here, at home
  for (const HeldStep& h : holdings_.full_steps())
    if (h.home_node == o_.self) newest[h.rank] = h;
  if (newest.empty()) return;
  const std::vector<uint32_t> reps =
      choose_replicas(o_.self, live(), o_.topology, rtt_us_, o_.replicas);
  for (const auto& [rank, h] : newest) {
    ShardMeta d;
    if (!holdings_.describe(ShardKey{rank, h.step, 0}, &d)) continue;
    for (uint32_t b = 0; b < d.n_buffers; ++b) {
      auto& known = replicas_of_[(uint64_t(rank) << 32) | b];
      const uint64_t rb = (uint64_t(rank) << 32) | b;
      for (uint32_t r : reps) {
        if (known.count(r)) continue;
        known.insert(r);  // now, so the next period does not send it again while in flight
        send_chain(r, rank, b, h.step, true, [this, rb, r](bool ok) {
          if (!ok) replicas_of_[rb].erase(r);
        });
      }
    }
  }
}

template void Daemon::ingest(const std::shared_ptr<PeerConn>&, const ShardMeta&, const char*, bool);
template void Daemon::ingest(const std::shared_ptr<ClientConn>&, const ShardMeta&, const char*,
                             bool);

}  // namespace snapd
