// r2ccl_snapshotd: peer connections (daemon.h): accepted, or connected with this node's HELLO;
// an accepted one's HELLO and job token checked, then each of its frames dispatched.

#include "daemon.h"

namespace snapd {

namespace {

bool token_equal(const uint8_t* a, const uint8_t* b, size_t n) {
  uint8_t d = 0;
  for (size_t i = 0; i < n; ++i) d |= a[i] ^ b[i];
  return d == 0;
}

}  // namespace

bool Daemon::send_peer(uint32_t id, Frame f) {
  if (id == o_.self || blocked(id)) return false;
  auto it = outs_.find(id);
  if (it == outs_.end()) return false;
  // A closed connection (the peer was declared failed, or a write failed) is reopened now
  // rather than at the next period: an answer to a peer that just came back is not dropped.
  if (!it->second->open) connect(it->second, id);
  return send(it->second, std::move(f), false);
}

// ---- peers ----

void Daemon::accept() {
  acceptor_.async_accept([this](const std::error_code& ec, tcp::socket s) {
    if (accept_failed(
            ec, acceptor_, [this] { accept(); }, "peer"))
      return;
    {
      auto in = std::make_shared<PeerConn>(std::move(s));
      hello_deadline(in);
      read_loop(
          in, kPeerMagic, kPeerVersion,
          [this, in](uint16_t t, uint64_t len) {
            if (in->id < 0 && t != uint16_t(PeerMsg::kHello)) return false;
            return peer_payload_ok(t, len, o_.store.max_shard_bytes);
          },
          [this](const std::shared_ptr<PeerConn>& c) { return handle_peer(c); },
          [](const std::shared_ptr<PeerConn>&) {}, "peer");
    }
    accept();
  });
}

bool Daemon::handle_peer(const std::shared_ptr<PeerConn>& in) {
  const auto type = static_cast<PeerMsg>(in->h.type);
  if (type == PeerMsg::kHello) {
    if (in->id >= 0) {
      refuse(in, "a second HELLO");
      return false;
    }
    HelloBody b;
    std::memcpy(&b, in->body.data(), sizeof(b));
    uint8_t mine[kTokenBytes] = {};
    std::memcpy(mine, o_.token.data(), o_.token.size());
    if (b.token_len != o_.token.size() || !token_equal(b.token, mine, kTokenBytes)) {
      refuse(in, "wrong job token");
      return false;
    }
    if (!find(b.node_id) || b.node_id == o_.self) {
      refuse(in, "node id " + std::to_string(b.node_id) + " is not a peer in the peer list");
      return false;
    }
    in->id = b.node_id;
    if (b.incarnation) {
      // A new incarnation: the peer restarted, and this daemon's connection to its old process
      // may still look open (nothing was written to it since): reopen it before an answer is
      // written into it and lost.
      uint64_t& known = peer_incarnation_[b.node_id];
      const bool restarted = known && known != b.incarnation;
      known = b.incarnation;
      if (restarted) {
        auto it = outs_.find(b.node_id);
        if (it != outs_.end() && it->second->open) {
          SNAP_INFO("node %u restarted (new incarnation): reopening the connection to it",
                    b.node_id);
          close_conn(it->second);
          for (auto& [rb, reps] : replicas_of_) reps.erase(b.node_id);
          connect(it->second, b.node_id);
        }
        // Its old process will answer nothing more.
        fetches_lost(b.node_id, "restarted (new incarnation)");
      }
    }
    return true;
  }
  const uint32_t peer = static_cast<uint32_t>(in->id);
  if (blocked(peer) || blocked_in_.count(peer)) return true;  // test hook: a partition
  const uint8_t* p = in->body.data();
  switch (type) {
    case PeerMsg::kHello: break;
    case PeerMsg::kShard: {
      ShardMeta m;
      std::memcpy(&m, p, sizeof(m));
      std::string err;
      if (m.payload_bytes != in->body.size() - sizeof(m) || !Holdings::valid(m, &err)) {
        refuse(in, err.empty() ? "shard payload size does not match its header" : err);
        return false;
      }
      m_.counter(M::kShardsReceived).inc();
      m_.counter(M::kShardBytesReceived).inc(double(m.payload_bytes));
      if (!shard_wanted(m)) return true;  // a rolled-back timeline: dropped
      ingest(in, m, "replica", false);
      return false;  // reading resumes when the worker stored it
    }
    case PeerMsg::kHeld: {
      HeldBody b;
      std::memcpy(&b, p, sizeof(b));
      if (b.node_id != peer) return true;
      on_held(b);
      return true;
    }
    case PeerMsg::kRetract: {
      HeldBody b;
      std::memcpy(&b, p, sizeof(b));
      if (b.node_id != peer) return true;
      on_retract(b);
      return true;
    }
    case PeerMsg::kMarker: {
      MarkerBody b;
      std::memcpy(&b, p, sizeof(b));
      // Answered whoever asks: a new coordinator's marker may arrive before this node's own
      // election read names it, and reporting holdings is harmless.
      answer_marker(peer, b);
      return true;
    }
    case PeerMsg::kMarkerDone: {
      MarkerDoneBody b;
      std::memcpy(&b, p, sizeof(b));
      if (round_ && b.round == round_->id) round_->waiting.erase(peer);
      if (b.round == 0) answered_all_.insert(peer);  // the marker for everything held
      return true;
    }
    case PeerMsg::kFetch: {
      FetchBody b;
      std::memcpy(&b, p, sizeof(b));
      serve_fetch(b, FrameKind::kPeerFetched,
                  [this, peer](Frame f) { send_peer(peer, std::move(f)); });
      return true;
    }
    case PeerMsg::kFetched: return on_fetched(peer, in);
  }
  return false;
}

void Daemon::connect(const std::shared_ptr<PeerConn>& o, uint32_t id) {
  if (o->open) return;  // connected, or connecting
  const PeerSpec* spec = find(id);
  std::error_code ec;
  auto addr = asio::ip::make_address(spec->host, ec);
  if (ec) {  // a name: resolve synchronously once per attempt (peer lists are small)
    tcp::resolver res(io_);
    auto r = res.resolve(spec->host, std::to_string(spec->port), ec);
    if (ec || r.empty()) {
      if (accept_errors_.insert("resolve" + spec->host).second)
        SNAP_WARN("cannot resolve node %u's host '%s': %s (retrying every period)", id,
                  spec->host.c_str(), ec ? ec.message().c_str() : "no address");
      return;
    }
    addr = r.begin()->endpoint().address();
  }
  // Frames sent while connecting queue up behind the HELLO; a failed attempt drops them
  // (and the next period retries).
  auto fresh = std::make_shared<PeerConn>(tcp::socket(io_));
  fresh->connected = false;
  fresh->id = id;
  outs_[id] = fresh;
  fresh->sock.async_connect(tcp::endpoint(addr, spec->port), [this, fresh,
                                                              id](const std::error_code& e) {
    if (e || !fresh->open) {
      close_conn(fresh);
      // The FETCHes queued behind the HELLO never left: ask elsewhere now rather than
      // after 10 periods (20 s at a 2 s period). Not for an attempt closed on purpose
      // (aborted) or already replaced by a newer one, which carries its own queue.
      auto cur = outs_.find(id);
      if (e && e != asio::error::operation_aborted && cur != outs_.end() && cur->second == fresh)
        fetches_lost(id, "cannot be reached (" + e.message() + ")");
      return;
    }
    HelloBody h{};
    h.node_id = o_.self;
    h.token_len = static_cast<uint32_t>(o_.token.size());
    std::memcpy(h.token, o_.token.data(), o_.token.size());
    h.incarnation = cp_ ? cp_->incarnation() : 0;
    fresh->latest[uint16_t(PeerMsg::kHello)] = peer_frame(PeerMsg::kHello, h);
    fresh->connected = true;
    pump(fresh);
  });
}

}  // namespace snapd
