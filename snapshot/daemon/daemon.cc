// r2ccl_snapshotd: the daemon's life (daemon.h): construction, run() (the store, the ports, the
// socket and the threads opened; shutdown), the period, metrics, the index, a test hook.

#include "daemon.h"

namespace snapd {

Daemon::Daemon(Options o)
    : o_(std::move(o)),
      planner_(o_.self, o_.period, o_.lease_ttl_s * kUsPerSec),
      store_(o_.store),
      cut_(o_.replicas),
      acceptor_(io_),
      local_(io_),
      timer_(io_),
      signals_(io_, SIGINT, SIGTERM) {
  if (const char* e = getenv("R2CCL_SNAPD_TEST_EXIT_AFTER_SHARDS")) {
    unsigned long long st = 0, n = 0;
    if (sscanf(e, "%llu:%llu", &st, &n) == 2 && n > 0) {
      exit_step_ = st;
      exit_after_ = n;
    }
  }
  if (const char* e = getenv("R2CCL_SNAPD_TEST_BLOCK_FILE")) block_file_ = e;
  M::register_standard(&m_);
  m_.gauge(M::kConfiguredNodes).set(double(o_.peers.size()));
}

int Daemon::run() {
  std::string err;
  OpenReport rep;
  if (store_.open(&rep, &err) != StoreStatus::kOk) {
    SNAP_WARN("cannot open the shard store: %s", err.c_str());
    return 1;
  }
  for (const auto& s : rep.skipped) SNAP_WARN("spill directory: skipped %s", s.c_str());
  reload_index();
  const PeerSpec* me = find(o_.self);
  std::error_code ec;
  tcp::endpoint ep(asio::ip::make_address(me->host, ec), me->port);
  if (ec) {
    // A name: listen on the address it resolves to (never on every interface).
    tcp::resolver res(io_);
    auto r = res.resolve(me->host, std::to_string(me->port), ec);
    if (ec || r.empty()) {
      SNAP_WARN("cannot resolve this node's host '%s' (peer list line of node %u): %s",
                me->host.c_str(), o_.self, ec ? ec.message().c_str() : "no address");
      return 1;
    }
    ep = r.begin()->endpoint();
  }
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(64, ec);
  if (ec) {
    SNAP_WARN("cannot listen on %s:%u: %s", me->host.c_str(), me->port, ec.message().c_str());
    return 1;
  }
  if (!open_local(&err)) {
    SNAP_WARN("%s", err.c_str());
    return 1;
  }
  if (!o_.metrics_addr.empty()) {
    http_ = std::make_unique<M::HttpServer>(io_, [this] { refresh_metrics(); });
    http_->add(m_.collectable());
    http_->add(std::make_shared<M::BoardCollectable>(o_.board));
    http_->add(std::make_shared<M::StoreCollectable>([this] { return store_.stats(); }));
    if (!http_->listen(o_.metrics_addr, &err)) {
      SNAP_WARN("--metrics: %s", err.c_str());
      ::unlink(o_.socket_path.c_str());
      return 1;
    }
    SNAP_INFO("Prometheus metrics on http://%s:%u/metrics (port %u)",
              http_->endpoint().address().to_string().c_str(), http_->port(), http_->port());
  }
  SNAP_INFO(
      "node %u of %zu listening on %s port %u, heartbeat every %.0f ms, board %s, clients on %s, "
      "%u replicas per shard, shards in memory up to %llu MiB%s%s",
      o_.self, o_.peers.size(), ep.address().to_string().c_str(), me->port, o_.period / 1e3,
      o_.board.c_str(), o_.socket_path.c_str(), o_.replicas,
      static_cast<unsigned long long>(o_.store.memory_limit_bytes >> 20),
      o_.store.spill_dir.empty() ? "" : ", spilling to ", o_.store.spill_dir.c_str());
  if (holdings_.size())
    SNAP_INFO("serving %zu shards from the spill directory (newest step %llu)", holdings_.size(),
              static_cast<unsigned long long>(holdings_.newest_step()));
  for (const auto& p : o_.peers)
    if (p.id != o_.self) {
      outs_[p.id] = std::make_shared<PeerConn>(tcp::socket(io_));
      outs_[p.id]->open = outs_[p.id]->connected = false;  // connected by the first tick
    }
  HeartbeatService::Config hc;
  hc.self = o_.self;
  hc.peers = o_.peers;
  hc.token = o_.token;
  hc.period = o_.period;
  hc.block_file = block_file_;
  hb_ = std::make_unique<HeartbeatService>(hc, [this](uint32_t id, bool on) {
    asio::post(io_, [this, id, on] { on_suspect(id, on); });
  });
  if (!hb_->start(&err)) {
    SNAP_WARN("%s", err.c_str());
    ::unlink(o_.socket_path.c_str());
    return 1;
  }
  start_control_plane();
  accept();
  accept_local();
  signals_.async_wait([this](const std::error_code&, int sig) {
    SNAP_INFO("signal %d: exiting", sig);
    io_.stop();
  });
  tick();
  io_.run();
  cp_->stop(true);  // a clean exit: the lease goes now, not after its TTL
  hb_->stop();
  work_.join();  // what it still stores lands in the store before it is closed
  std::string e2;
  if (store_.close(&e2) != StoreStatus::kOk) SNAP_WARN("closing the shard store: %s", e2.c_str());
  save_index();
  ::unlink(o_.socket_path.c_str());
  return 0;
}

// ---- metrics ----

// A take of a local rank: its first shard opens it, its last buffer closes it (the time
// between is the client's background encode and send of that take, as seen here).
void Daemon::note_take(const ShardMeta& m) {
  auto& t = takes_[m.rank];
  if (m.buffer == 0 || t.step != m.step) t = Take{m.step, now_us(), 0};
  t.bytes += m.payload_bytes;
  if (m.buffer + 1 == m.n_buffers) {
    m_.counter(M::kTakes).inc();
    m_.histogram(M::kTakeBytes).observe(double(t.bytes));
    m_.histogram(M::kTakeSeconds).observe((now_us() - t.started) / 1e6);
    step_arrived_[m.step] = now_us();
  }
}

// At every scrape, on the loop (HttpServer): the gauges of loop-owned state. The board and
// the store are read by their collectables on the scraping thread.
void Daemon::refresh_metrics() {
  m_.gauge(M::kLiveNodes).set(double(live().size()));
  m_.gauge(M::kMembershipEpoch).set(double(written_.epoch));
  m_.gauge(M::kCoordinator).set(acting_ ? 1 : 0);
}

// ---- the index of held shards, persisted beside the spill files ----

std::string Daemon::index_path() const {
  return o_.store.spill_dir.empty() ? std::string() : o_.store.spill_dir + "/holdings.idx";
}

void Daemon::reload_index() {
  const std::string path = index_path();
  if (path.empty()) return;
  std::ifstream f(path, std::ios::binary);
  if (!f) return;
  std::map<ShardKey, ShardInfo> listed;
  for (const auto& i : store_.list()) listed[i.key] = i;
  ShardMeta m;
  size_t bad = 0;
  while (f.read(reinterpret_cast<char*>(&m), sizeof(m))) {
    std::string err;
    auto it = listed.find(ShardKey{m.rank, m.step, m.buffer});
    if (it == listed.end() || it->second.size != m.payload_bytes || !Holdings::valid(m, &err)) {
      ++bad;
      continue;
    }
    holdings_.add(m);
  }
  if (bad) SNAP_WARN("index %s: %zu entries without a valid shard were ignored", path.c_str(), bad);
}

void Daemon::save_index() {
  const std::string path = index_path();
  if (path.empty() || !index_dirty_) return;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    for (const ShardMeta& m : holdings_.all())
      f.write(reinterpret_cast<const char*>(&m), sizeof(m));
    if (!f) {
      SNAP_WARN("cannot write %s", tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) SNAP_WARN("cannot rename %s", tmp.c_str());
  index_dirty_ = false;
}

// ---- the period ----

void Daemon::tick() {
  const TimeUs now = now_us();
  read_block_file();
  const float gbps = local_usable_gbps();
  hb_->set_gbps(gbps);
  cp_->set_gbps(gbps);
  for (const auto& [id, p] : hb_->snapshot()) {
    if (p.rtt_us >= 0) rtt_us_[id] = p.rtt_us;
    // A peer heard before whose last heartbeat is more than 1.5 periods old missed one.
    if (p.ever_heard && !suspected_.count(id) && now - p.last_heard > o_.period * 3 / 2)
      m_.counter(M::kHeartbeatsMissed).inc();
  }
  m_.counter(M::kHeartbeatsSent).inc(double(hb_->sent() - hb_sent_));
  m_.counter(M::kHeartbeatsReceived).inc(double(hb_->received() - hb_received_));
  hb_sent_ = hb_->sent();
  hb_received_ = hb_->received();
  for (auto& [id, o] : outs_) {
    if (blocked(id) || suspected_.count(id)) continue;
    if (!o->open) {
      // What was queued to it is gone: its chains are resent once it is connected again.
      // (A fetch asked of it waits on: its answer comes on the peer's own connection to this
      // node, so a broken connection from here does not mean it is lost.)
      for (auto& [rb, reps] : replicas_of_) reps.erase(id);
      connect(o, id);
    }
  }
  if (acting_) coordinate_cuts(now);
  // Fetches whose peer did not answer within 10 periods (3 when it is suspected) move on.
  std::vector<uint64_t> late;
  for (auto& [id, pf] : fetches_)
    if (now - pf.asked_at > 10 * o_.period ||
        (suspected_.count(pf.asked) && now - pf.asked_at > 3 * o_.period))
      late.push_back(id);
  for (uint64_t id : late) {
    auto it = fetches_.find(id);
    if (it == fetches_.end()) continue;
    pass_over(it->second, "did not answer within " +
                              std::to_string((now - it->second.asked_at) / 1000) + " ms");
  }
  resync_replicas();
  for (auto it = clients_.begin(); it != clients_.end();)
    it = (*it)->open ? std::next(it) : clients_.erase(it);
  if (++ticks_ % 10 == 0) save_index();
  timer_.expires_after(std::chrono::microseconds(o_.period));
  timer_.async_wait([this](const std::error_code& ec) {
    if (!ec) tick();
  });
}

// Test hook (R2CCL_SNAPD_TEST_BLOCK_FILE): node ids whose traffic is dropped both ways;
// "in:ID" drops only what comes from ID (one-way reachability). Heartbeats read the same file.
void Daemon::read_block_file() {
  if (block_file_.empty()) return;
  std::set<uint32_t> both, in;
  std::ifstream f(block_file_);
  std::string w;
  while (f >> w) {
    const bool only_in = w.rfind("in:", 0) == 0;
    const std::string n = only_in ? w.substr(3) : w;
    if (n.empty() || n.size() > 6 || n.find_first_not_of("0123456789") != std::string::npos)
      continue;
    (only_in ? in : both).insert(uint32_t(std::stoul(n)));
  }
  if (both != blocked_ || in != blocked_in_) {
    std::string a, b;
    for (uint32_t x : both) a += (a.empty() ? "" : ",") + std::to_string(x);
    for (uint32_t x : in) b += (b.empty() ? "" : ",") + std::to_string(x);
    SNAP_INFO("test hook: dropping all traffic with nodes {%s}, incoming from {%s}", a.c_str(),
              b.c_str());
    blocked_ = both;
    blocked_in_ = in;
    for (uint32_t x : both) {
      auto it = outs_.find(x);
      if (it != outs_.end()) close_conn(it->second);
    }
  }
}

}  // namespace snapd
