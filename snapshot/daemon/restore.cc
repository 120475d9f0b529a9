// r2ccl_snapshotd: restore (daemon.h): a FETCH answered from the local store, or the chain
// fetched from the nearest peer that holds it, checked, and passed on to the client.

#include "daemon.h"

namespace snapd {

// ---- restore ----

// Answers a FETCH from what this node holds: the chain oldest first, or one refusal frame
// (not held; corrupt, when a shard failed its CRC: it is then dropped from the index). The
// shards are read on the worker thread; `out` gets the frames on the loop.
void Daemon::serve_fetch(const FetchBody& b, FrameKind kind, std::function<void(Frame)> out,
                         std::function<void(bool)> done) {
  auto refusal = [kind, b](FetchStatus why) {
    FetchedHead head{b.request, uint32_t(why), 0, 0, kNoNode};
    return kind == FrameKind::kClientFetched
               ? make_frame(kClientMagic, kClientVersion, uint16_t(ClientMsg::kFetched), &head,
                            sizeof(head))
               : make_frame(kPeerMagic, kPeerVersion, uint16_t(PeerMsg::kFetched), &head,
                            sizeof(head));
  };
  std::vector<ShardMeta> items;
  for (uint64_t st : holdings_.chain(b.rank, b.buffer, b.step)) {
    ShardMeta m;
    if (!holdings_.describe(ShardKey{b.rank, st, b.buffer}, &m)) break;
    items.push_back(m);
  }
  if (items.empty()) {
    out(refusal(FetchStatus::kNotHeld));
    if (done) done(false);
    return;
  }
  read_chain(
      std::move(items), kind, b.request,
      [this, out, done, refusal](std::vector<Frame> frames, StoreStatus st, ShardKey bad,
                                 std::string err) {
        if (st != StoreStatus::kOk) {
          SNAP_WARN("cannot serve %s: %s (%s)", to_string(bad).c_str(), store_status_name(st),
                    err.c_str());
          if (st == StoreStatus::kCorrupt || st == StoreStatus::kNotFound) {
            const std::vector<HeldStep> had = holdings_.full_steps();
            holdings_.remove(bad);
            retract(lost_steps(had));
          }
          out(refusal(st == StoreStatus::kCorrupt ? FetchStatus::kCorrupt : FetchStatus::kNotHeld));
          if (done) done(false);
          return;
        }
        for (auto& f : frames) out(std::move(f));
        if (done) done(true);
      });
}

void Daemon::client_fetch(const std::shared_ptr<ClientConn>& c, const FetchBody& b) {
  if (b.buffer == 0 && b.avoid_node == kNoNode)
    m_.counter(M::kRecoveries).inc();  // one restore of one rank
  if (b.avoid_node == o_.self)
    SNAP_WARN(
        "restore of rank %u buffer %u step %llu: the client found this node's copy corrupt; "
        "asking the replicas",
        b.rank, b.buffer, static_cast<unsigned long long>(b.step));
  if (b.avoid_node != o_.self && !holdings_.chain(b.rank, b.buffer, b.step).empty()) {
    // From the local store (a survivor's home copy, or this node is a replica); frames are
    // kept until the whole chain was read, and a failure falls back to the peers.
    auto local = std::make_shared<std::vector<Frame>>();
    serve_fetch(
        b, FrameKind::kClientFetched, [local](Frame f) { local->push_back(std::move(f)); },
        [this, c, b, local](bool ok) {
          if (ok) {
            for (auto& f : *local) send(c, std::move(f), false);
          } else {
            fetch_from_peers(c, b);
          }
        });
    return;
  }
  fetch_from_peers(c, b);
}

void Daemon::fetch_from_peers(const std::shared_ptr<ClientConn>& c, const FetchBody& b) {
  PendingFetch pf;
  pf.id = ++fetch_ids_;
  pf.client = c;
  pf.client_request = b.request;
  pf.want = b;
  // Candidates: the live nodes, and the agreed record's members this daemon has not heard
  // from yet (a replacement node asks before every first heartbeat arrived).
  const std::vector<uint32_t> lv = live();
  std::set<uint32_t> cand(lv.begin(), lv.end());
  if (record_)
    for (const auto& m : record_->members) cand.insert(m.id);
  cand.erase(b.avoid_node);
  const std::vector<uint32_t> all(cand.begin(), cand.end());
  pf.candidates = choose_replicas(o_.self, all, o_.topology, rtt_us_, all.size());
  // Striping: a rank's buffers start at different replicas among the nearest R (the rest of
  // the order is kept), so a restore pulls from all of them at once.
  const size_t near = std::min<size_t>(o_.replicas, pf.candidates.size());
  if (near > 1)
    std::rotate(pf.candidates.begin(), pf.candidates.begin() + (b.stripe % near),
                pf.candidates.begin() + near);
  fetches_[pf.id] = std::move(pf);
  ask_next(fetches_[pf.id]);
}

void Daemon::ask_next(PendingFetch& pf) {
  pf.frames.clear();
  if (pf.next >= pf.candidates.size() && !pf.second_pass && !pf.silent.empty()) {
    pf.candidates = pf.silent;
    pf.next = 0;
    pf.second_pass = true;
  }
  if (pf.next >= pf.candidates.size()) {
    FetchedHead h{pf.client_request, uint32_t(FetchStatus::kNotHeld), 0, 0, kNoNode};
    if (auto c = pf.client.lock())
      send(c,
           make_frame(kClientMagic, kClientVersion, uint16_t(ClientMsg::kFetched), &h, sizeof(h)),
           false);
    SNAP_WARN("restore of rank %u buffer %u step %llu: no live node holds its chain", pf.want.rank,
              pf.want.buffer, static_cast<unsigned long long>(pf.want.step));
    fetches_.erase(pf.id);
    return;
  }
  pf.asked = pf.candidates[pf.next++];
  pf.asked_at = now_us();
  FetchBody q = pf.want;
  q.request = pf.id;
  q.stripe = 0;
  q.avoid_node = kNoNode;
  send_peer(pf.asked, peer_frame(PeerMsg::kFetch, q));
}

void Daemon::fetches_lost(uint32_t peer, const std::string& why) {
  std::vector<uint64_t> ids;
  for (auto& [id, pf] : fetches_)
    if (pf.asked == peer) ids.push_back(id);
  for (uint64_t id : ids) {
    auto it = fetches_.find(id);
    if (it == fetches_.end()) continue;
    pass_over(it->second, why);
  }
}

void Daemon::pass_over(PendingFetch& pf, const std::string& why) {
  SNAP_WARN("restore of rank %u buffer %u step %llu: node %u %s; asking the next replica",
            pf.want.rank, pf.want.buffer, static_cast<unsigned long long>(pf.want.step), pf.asked,
            why.c_str());
  pf.silent.push_back(pf.asked);
  ask_next(pf);
}

// A FETCHED frame from a peer: a refusal moves on to the next replica; a shard is checked
// (its checksum: the one check of the peer hop) on the worker thread, with the connection's
// reading paused meanwhile (frames of a connection stay in order); a whole chain goes on to
// the client around the received bytes (no copy). Returns whether reading resumes now.
bool Daemon::on_fetched(uint32_t peer, const std::shared_ptr<PeerConn>& in) {
  FetchedHead h;
  std::memcpy(&h, in->body.data(), sizeof(h));
  auto it = fetches_.find(h.request);
  if (it == fetches_.end() || it->second.asked != peer) return true;
  PendingFetch& pf = it->second;
  if (h.status != uint32_t(FetchStatus::kOk)) {
    SNAP_WARN(
        "restore of rank %u buffer %u step %llu: node %u answered %s; asking the next replica",
        pf.want.rank, pf.want.buffer, static_cast<unsigned long long>(pf.want.step), peer,
        h.status == uint32_t(FetchStatus::kCorrupt) ? "corrupt (checksum)" : "not held");
    ask_next(pf);
    return true;
  }
  if (in->body.size() < sizeof(FetchedHead) + sizeof(ShardMeta)) {
    SNAP_WARN(
        "restore of rank %u buffer %u step %llu: node %u answered kOk without a shard; "
        "asking the next replica",
        pf.want.rank, pf.want.buffer, static_cast<unsigned long long>(pf.want.step), peer);
    ask_next(pf);
    return true;
  }
  auto body = std::make_shared<Bytes>(std::move(in->body));
  in->body = {};
  const uint64_t id = h.request;
  asio::post(work_, [this, in, body, peer, id] {
    ShardMeta m;
    std::memcpy(&m, body->data() + sizeof(FetchedHead), sizeof(m));
    const size_t pn = body->size() - sizeof(FetchedHead) - sizeof(m);
    const bool sum_ok =
        m.payload_bytes == pn &&
        shard_checksum(body->data() + sizeof(FetchedHead) + sizeof(m), pn) == m.checksum;
    asio::post(io_, [this, in, body, peer, id, sum_ok] {
      fetched_checked(peer, id, body, sum_ok);
      resume_reading(in);
    });
  });
  return false;
}

void Daemon::fetched_checked(uint32_t peer, uint64_t id, const std::shared_ptr<Bytes>& body,
                             bool sum_ok) {
  auto it = fetches_.find(id);
  if (it == fetches_.end() || it->second.asked != peer) return;
  PendingFetch& pf = it->second;
  FetchedHead h;
  std::memcpy(&h, body->data(), sizeof(h));
  ShardMeta m;
  std::memcpy(&m, body->data() + sizeof(h), sizeof(m));
  if (h.index != pf.frames.size() || h.count == 0 || h.index >= h.count || m.rank != pf.want.rank ||
      m.buffer != pf.want.buffer || !sum_ok) {
    SNAP_WARN(
        "restore of rank %u buffer %u step %llu: node %u sent a bad or corrupt shard; asking the "
        "next replica",
        pf.want.rank, pf.want.buffer, static_cast<unsigned long long>(pf.want.step), peer);
    return ask_next(pf);
  }
  pf.frames.push_back(body);
  if (h.index + 1 < h.count) return;
  if (auto c = pf.client.lock()) {
    for (auto& f : pf.frames) {
      FetchedHead fh;
      std::memcpy(&fh, f->data(), sizeof(fh));
      fh.request = pf.client_request;
      constexpr size_t kFixed = sizeof(FetchedHead) + sizeof(ShardMeta);
      std::shared_ptr<const uint8_t> pay(f, f->data() + kFixed);
      send(
          c,
          make_frame(kClientMagic, kClientVersion, uint16_t(ClientMsg::kFetched), &fh, sizeof(fh),
                     f->data() + sizeof(fh), sizeof(ShardMeta), std::move(pay), f->size() - kFixed),
          false);
    }
  }
  fetches_.erase(it);
}

}  // namespace snapd
