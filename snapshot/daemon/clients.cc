// r2ccl_snapshotd: the local client socket (daemon.h): the training processes' HELLO, shards,
// queries, fetches and KV, and the STATE frame pushed to them.

#include "daemon.h"

namespace snapd {

// ---- KV (etcd keys under the job prefix; the watch fills kv_) ----

bool Daemon::kv_valid(const KvBody& kv) {
  const size_t n = strnlen(kv.key, kKvKeyBytes);
  return n > 0 && n < kKvKeyBytes && kv.value_bytes <= kKvMaxValue;
}

// ---- local clients ----

bool Daemon::open_local(std::string* err) {
  struct stat st;
  if (lstat(o_.socket_path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      *err = "--socket " + o_.socket_path + " exists and is not a socket: not replacing it";
      return false;
    }
    ::unlink(o_.socket_path.c_str());  // a stale socket from a previous run
  }
  // Bound under a temporary name, made listening and given its mode, then renamed into
  // place: a client that finds the path can connect at once, and never sees a looser mode.
  const std::string tmp = o_.socket_path + ".tmp" + std::to_string(getpid());
  ::unlink(tmp.c_str());
  std::error_code ec;
  const mode_t old = umask(0177);
  local_.open(ulocal(), ec);
  if (!ec) local_.bind(ulocal::endpoint(tmp), ec);
  umask(old);
  if (!ec) local_.listen(64, ec);
  if (ec) {
    *err = "cannot listen on the client socket " + o_.socket_path + ": " + ec.message();
    ::unlink(tmp.c_str());
    return false;
  }
  mode_t mode = 0600;
  if (!o_.socket_group.empty()) {
    struct group* g = getgrnam(o_.socket_group.c_str());
    if (!g || chown(tmp.c_str(), static_cast<uid_t>(-1), g->gr_gid) != 0) {
      *err = "--socket-group " + o_.socket_group + ": no such group, or cannot chown " +
             o_.socket_path;
      ::unlink(tmp.c_str());
      return false;
    }
    mode = 0660;
  }
  if (chmod(tmp.c_str(), mode) != 0 || std::rename(tmp.c_str(), o_.socket_path.c_str()) != 0) {
    *err = "cannot chmod or rename the client socket into " + o_.socket_path;
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

void Daemon::accept_local() {
  local_.async_accept([this](const std::error_code& ec, ulocal::socket s) {
    if (accept_failed(
            ec, local_, [this] { accept_local(); }, "client"))
      return;
    {
      auto c = std::make_shared<ClientConn>(std::move(s));
      hello_deadline(c);
      clients_.insert(c);
      read_loop(
          c, kClientMagic, kClientVersion,
          [this, c](uint16_t t, uint64_t len) {
            if (t >= uint16_t(ClientMsg::kState)) return false;  // daemon-to-client types
            if ((c->id < 0) != (t == uint16_t(ClientMsg::kHello))) return false;
            return client_payload_ok(t, len, o_.store.max_shard_bytes);
          },
          [this](const std::shared_ptr<ClientConn>& cc) { return handle_client(cc); },
          [](const std::shared_ptr<ClientConn>&) {}, "client");
    }
    accept_local();
  });
}

bool Daemon::handle_client(const std::shared_ptr<ClientConn>& c) {
  const uint8_t* p = c->body.data();
  switch (static_cast<ClientMsg>(c->h.type)) {
    case ClientMsg::kHello: {
      ClientHelloBody b;
      std::memcpy(&b, p, sizeof(b));
      if (b.world == 0 || b.world > 65536 || b.rank >= b.world) {
        refuse(c, "rank " + std::to_string(b.rank) + " of world " + std::to_string(b.world) +
                      " (accepted: world 1..65536, rank < world)");
        return false;
      }
      for (const auto& o : clients_)
        if (o != c && o->open && o->id == int64_t(b.rank)) {
          refuse(c, "rank " + std::to_string(b.rank) +
                        " is already connected to this daemon (one process per rank; a "
                        "replacement opens after the lost process is gone)");
          return false;
        }
      if (client_world_ && b.world != client_world_)
        SNAP_WARN(
            "client rank %u says the job has %u ranks; earlier clients said %u (steps taken "
            "from now on have %u ranks)",
            b.rank, b.world, client_world_, b.world);
      client_world_ = b.world;
      c->id = b.rank;
      c->world = b.world;
      SNAP_INFO("client rank %u of %u (pid %d) connected", b.rank, b.world, b.pid);
      send(c, client_frame(ClientMsg::kState, state_body(*c)), false);
      return true;
    }
    case ClientMsg::kShard: {
      ShardMeta m;
      std::memcpy(&m, p, sizeof(m));
      m.home_node = o_.self;
      std::string err;
      if (m.rank != uint32_t(c->id) || m.world != c->world) {
        refuse(c, "shard of rank " + std::to_string(m.rank) + " world " + std::to_string(m.world) +
                      " on the connection of rank " + std::to_string(c->id) + " world " +
                      std::to_string(c->world));
        return false;
      }
      if (m.payload_bytes != c->body.size() - sizeof(m) || !Holdings::valid(m, &err)) {
        refuse(c, err.empty() ? "shard payload size does not match its header" : err);
        return false;
      }
      note_take(m);
      ingest(c, m, "home", true);
      return false;  // reading resumes when the worker stored it
    }
    case ClientMsg::kQuery:
      ++c->queries;  // what tells the answer from a STATE pushed before (client_wire.h)
      send(c, client_frame(ClientMsg::kState, state_body(*c)), false);
      return true;
    case ClientMsg::kFetch: {
      FetchBody b;
      std::memcpy(&b, p, sizeof(b));
      client_fetch(c, b);
      return true;
    }
    case ClientMsg::kKvPut: {
      auto kv = std::make_shared<KvBody>();
      std::memcpy(kv.get(), p, sizeof(KvBody));
      if (!kv_valid(*kv)) {
        refuse(c, "malformed KV (key 1..63 bytes NUL-terminated, value <= 4096 bytes)");
        return false;
      }
      cp_->kv_put(std::string(kv->key, strnlen(kv->key, kKvKeyBytes)),
                  std::string(reinterpret_cast<const char*>(kv->value), kv->value_bytes));
      return true;
    }
    case ClientMsg::kKvGet: {
      KvGetBody g;
      std::memcpy(&g, p, sizeof(g));
      auto out = std::make_shared<KvBody>();
      std::memset(out.get(), 0, sizeof(KvBody));
      const size_t n = strnlen(g.key, kKvKeyBytes);
      std::memcpy(out->key, g.key, std::min(n, kKvKeyBytes - 1));
      auto it = kv_.find(std::string(g.key, n));
      if (it == kv_.end() || n == 0 || n >= kKvKeyBytes) {
        out->origin_node = kKvAbsent;
      } else {
        out->origin_node = o_.self;
        out->value_bytes = static_cast<uint32_t>(std::min(it->second.size(), kKvMaxValue));
        std::memcpy(out->value, it->second.data(), out->value_bytes);
      }
      send(c, client_frame(ClientMsg::kKvValue, *out), false);
      return true;
    }
    default: break;
  }
  return false;
}

StateBody Daemon::state_body(const ClientConn& c) const {
  StateBody s{};
  s.node_id = o_.self;
  s.queries = c.queries;
  s.has_complete = complete_ ? 1 : 0;
  s.complete_step = complete_.value_or(0);
  s.agreed = written_;
  if (record_) {
    // The record's restore step, until a newer step of this generation is complete (training
    // went on after the recovery): the same on every node, both come from etcd.
    s.generation = record_->generation;
    const bool newer = complete_ && complete_generation_ == record_->generation &&
                       record_->restore_step && *complete_ > *record_->restore_step;
    s.has_restore = record_->restore_step && !newer ? 1 : 0;
    s.restore_step = s.has_restore ? *record_->restore_step : 0;
  }
  return s;
}

void Daemon::push_state() {
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (!(*it)->open) {
      it = clients_.erase(it);
      continue;
    }
    if ((*it)->id >= 0) send(*it, client_frame(ClientMsg::kState, state_body(**it)), false);
    ++it;
  }
}

}  // namespace snapd
