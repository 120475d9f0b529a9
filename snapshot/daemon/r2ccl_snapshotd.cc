// r2ccl_snapshotd: the per-node snapshot sidecar (issue 6; snapshot/README.md).
//
// - Control plane on etcd (control_plane.h, coordinator.h): each daemon's liveness is an etcd
//   lease; the coordinator is elected through etcd and writes the agreed record (epoch,
//   members, usable GB/s, generation, restore step) and the newest complete step only in
//   transactions fenced by its election key; every daemon watches them and writes the record
//   into its health board. KV values are etcd keys (create-if-absent).
// - Heartbeats (heartbeat.h): UDP on their own thread and socket, an accrual detector per peer.
//   A suspicion is published to etcd; the coordinator evicts only when two observers agree.
// - Shards: the node's training processes send their encoded snapshot shards over the local
//   Unix socket (client_wire.h); the daemon keeps a home copy and sends each shard to the
//   rank's replica nodes (the R nearest other live nodes: fewest hops in --topology, else the
//   measured heartbeat round trip). Replicas hold them in a ShardStore (memory limit, spill
//   directory, CRC-checked) and report to the coordinator which (rank, step) they hold in full.
// - Consistent cuts: the coordinator runs a marker round per new step (CutTracker); the newest
//   complete step (every rank held by >= 1 live replica) goes to every node, which prunes
//   older chains and tells its clients (the STATE frame is also the recovery event).
// - Restore: a client's FETCH is answered from the local store when it holds the chain, else
//   from the nearest peer that does; a corrupt or missing chain moves on to the next peer.
// - Generations: a record that loses a member is a restore point; shards carry the generation
//   they were taken in, and a step after the restore point of an older generation is dropped
//   everywhere (it belongs to a timeline that was rolled back).
//
// Threads: the event loop (asio, Debian's libasio-dev) for peers' data and clients; a worker
// for stores and chain reads; the heartbeat thread; the control-plane thread and its etcd
// watch. Decisions are made on the event loop. Exit status: 0 on SIGTERM/SIGINT, 2 on bad arguments
// or files (the message names which and the accepted form), 1 when a port, the socket or the spill
// directory cannot be opened.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <asio.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/file_util.h"
#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/client_wire.h"
#include "r2ccl/snapshot/control_plane.h"
#include "r2ccl/snapshot/coordinator.h"
#include "r2ccl/snapshot/cut.h"
#include "r2ccl/snapshot/etcd.h"
#include "r2ccl/snapshot/heartbeat.h"
#include "r2ccl/snapshot/holdings.h"
#include "r2ccl/snapshot/log.h"
#include "r2ccl/snapshot/membership.h"
#include "r2ccl/snapshot/metrics.h"
#include "r2ccl/snapshot/metrics_http.h"
#include "r2ccl/snapshot/peer_wire.h"
#include "r2ccl/snapshot/shard_store.h"

using asio::ip::tcp;
using ulocal = asio::local::stream_protocol;
using namespace r2ccl;
using namespace r2ccl::snap;
namespace M = r2ccl::snap::metrics;

namespace {

bool token_equal(const uint8_t* a, const uint8_t* b, size_t n) {
  uint8_t d = 0;
  for (size_t i = 0; i < n; ++i) d |= a[i] ^ b[i];
  return d == 0;
}

// Byte buffers whose resize() does not zero what it adds: a shard body of a gigabyte is
// filled by the socket 1 MiB at a time, and zeroing it first would stall the event loop
// (value-initialising and faulting in every page at once).
template <class T>
struct UninitAlloc : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitAlloc<U>;
  };
  UninitAlloc() = default;
  template <class U>
  UninitAlloc(const UninitAlloc<U>&) {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-initialised: no zeroing
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
using Bytes = std::vector<uint8_t, UninitAlloc<uint8_t>>;

// An outgoing frame: `head` (the 16-byte header and the small fixed parts: FetchedHead,
// ShardMeta, a heartbeat) and, for a shard, its payload by reference (`tail`, kept alive by
// `keep`: the store's bytes, or a received frame). Written as one scatter-gather sequence, so
// shard bytes are never copied in user space on their way out.
struct Wire {
  Bytes head;
  std::shared_ptr<const uint8_t> keep;
  const uint8_t* tail = nullptr;
  size_t tail_n = 0;
  const uint8_t* data() const { return head.data(); }  // starts with the PeerHeader
  size_t size() const { return head.size() + tail_n; }
};
using Frame = std::shared_ptr<Wire>;

// A frame: the 16-byte header, up to two small pieces copied in, then `tail_n` bytes at `tail`
// by reference (none by default).
Frame make_frame(uint32_t magic, uint16_t version, uint16_t type, const void* a, size_t an,
                 const void* b = nullptr, size_t bn = 0,
                 std::shared_ptr<const uint8_t> tail = nullptr, size_t tail_n = 0) {
  auto f = std::make_shared<Wire>();
  f->head.resize(sizeof(PeerHeader) + an + bn);
  PeerHeader h{magic, version, type, static_cast<uint32_t>(an + bn + tail_n), 0};
  uint8_t* p = f->head.data();
  std::memcpy(p, &h, sizeof(h));
  p += sizeof(h);
  if (an) std::memcpy(p, a, an);
  if (bn) std::memcpy(p + an, b, bn);
  if (tail_n) {
    f->tail = tail.get();
    f->tail_n = tail_n;
    f->keep = std::move(tail);
  }
  return f;
}
template <typename Body>
Frame peer_frame(PeerMsg t, const Body& b) {
  return make_frame(kPeerMagic, kPeerVersion, static_cast<uint16_t>(t), &b, sizeof(b));
}
template <typename Body>
Frame client_frame(ClientMsg t, const Body& b) {
  return make_frame(kClientMagic, kClientVersion, static_cast<uint16_t>(t), &b, sizeof(b));
}

constexpr size_t kReadChunk = 1 << 20;  // bodies are read 1 MiB at a time (liveness on the way)

// One stream connection, either direction. Outgoing frames: `latest` (idempotent, one per
// type) first, then `queue` in order, bounded by `queue_limit` bytes (a frame beyond it is
// dropped and counted: a replica that falls that far behind is no replica of that step).
template <class Socket>
struct Conn {
  explicit Conn(Socket s) : sock(std::move(s)) {}
  Socket sock;
  PeerHeader h{};
  Bytes body;
  size_t got = 0;
  // open: frames are accepted (queued); connected: they are written. An outgoing peer
  // connection is open from its connect attempt on and connected once it succeeded (its HELLO,
  // the lowest type, goes first); accepted sockets are both from the start.
  bool open = true, connected = true, writing = false;
  std::map<uint16_t, Frame> latest;
  std::deque<Frame> queue;
  uint64_t queued_bytes = 0, dropped = 0;
  int64_t id = -1;     // peer node id (peer connections) or rank (clients), once HELLO checked
  uint32_t world = 0;  // clients: the job's world size
  // Set while a frame is being handled: reading the next one. A handler that passes work to
  // the worker thread (a shard) leaves it set and the work's completion calls it, so a
  // connection has at most one such frame in flight (backpressure). Cleared on close.
  std::function<void()> resume;
};
using PeerConn = Conn<tcp::socket>;
using ClientConn = Conn<ulocal::socket>;

struct Options {
  uint32_t self = 0;
  std::vector<PeerSpec> peers;
  std::string token;
  std::string board = "default";
  TimeUs period = 500 * kUsPerMs;
  std::string socket_path;
  std::string socket_group;
  StoreConfig store;
  uint32_t replicas = 3;
  std::map<uint32_t, std::vector<std::string>> topology;
  uint64_t queue_limit = 4ull << 30;
  std::string metrics_addr;  // "" = no metrics endpoint
  etcd::Options etcd;
  std::string prefix;  // the job's etcd key prefix, "/r2ccl/JOB/"
  int64_t lease_ttl_s = 3;
  bool test_write_after_pause = false;
};

class Daemon {
 public:
  explicit Daemon(Options o)
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

  int run() {
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

 private:
  const PeerSpec* find(uint32_t id) const {
    for (const auto& p : o_.peers)
      if (p.id == id) return &p;
    return nullptr;
  }
  bool blocked(int64_t peer) const { return peer >= 0 && blocked_.count(uint32_t(peer)); }

  // ---- writing ----
  // Returns whether the frame was accepted (queued or kept).
  template <class C>
  bool send(const std::shared_ptr<C>& c, Frame f, bool keep_latest) {
    if (!c->open) return false;
    if (keep_latest) {
      PeerHeader h;
      std::memcpy(&h, f->data(), sizeof(h));
      c->latest[h.type] = std::move(f);
    } else {
      if (c->queued_bytes + f->size() > o_.queue_limit) {
        if (c->dropped++ == 0)
          SNAP_WARN("send queue over %llu bytes: dropping frames",
                    (unsigned long long)o_.queue_limit);
        return false;
      }
      c->queued_bytes += f->size();
      c->queue.push_back(std::move(f));
    }
    pump(c);
    return true;
  }
  template <class C>
  void pump(const std::shared_ptr<C>& c) {
    if (c->writing || !c->open || !c->connected) return;
    Frame f;
    bool bulk = false;
    if (!c->latest.empty()) {
      auto it = c->latest.begin();
      f = std::move(it->second);
      c->latest.erase(it);
    } else if (!c->queue.empty()) {
      f = std::move(c->queue.front());
      c->queue.pop_front();
      bulk = true;
    } else {
      return;
    }
    c->writing = true;
    const std::array<asio::const_buffer, 2> bufs{asio::buffer(f->head),
                                                 asio::buffer(f->tail, f->tail_n)};
    asio::async_write(c->sock, bufs, [this, c, f, bulk](const std::error_code& ec, size_t) {
      c->writing = false;
      if (bulk) c->queued_bytes -= f->size();
      if (ec) {
        close_conn(c);
        return;
      }
      pump(c);
    });
  }
  template <class C>
  void close_conn(const std::shared_ptr<C>& c) {
    c->open = false;
    c->connected = false;
    c->latest.clear();
    c->queue.clear();
    c->queued_bytes = 0;
    c->resume = nullptr;
    std::error_code ignore;
    c->sock.close(ignore);
  }
  template <class C>
  void resume_reading(const std::shared_ptr<C>& c) {
    if (!c->open || !c->resume) return;
    auto r = std::move(c->resume);
    c->resume = nullptr;
    r();
  }
  bool send_peer(uint32_t id, Frame f) {
    if (id == o_.self || blocked(id)) return false;
    auto it = outs_.find(id);
    if (it == outs_.end()) return false;
    // A closed connection (the peer was declared failed, or a write failed) is reopened now
    // rather than at the next period: an answer to a peer that just came back is not dropped.
    if (!it->second->open) connect(it->second, id);
    return send(it->second, std::move(f), false);
  }

  // ---- reading: header, bounds check, body in 1 MiB pieces, dispatch ----
  template <class C, class Check, class Handle, class Progress>
  void read_loop(std::shared_ptr<C> c, uint32_t magic, uint16_t version, Check check, Handle handle,
                 Progress progress, const char* what) {
    asio::async_read(c->sock, asio::buffer(&c->h, sizeof(c->h)),
                     [=](const std::error_code& ec, size_t) {
                       if (ec) return close_conn(c);
                       std::string why;
                       if (c->h.magic != magic)
                         why = std::string("not an r2ccl ") + what + " (bad magic)";
                       else if (c->h.version != version)
                         why = "protocol version " + std::to_string(c->h.version) +
                               ", this daemon speaks " + std::to_string(version);
                       else if (!check(c->h.type, c->h.length))
                         why = "message type " + std::to_string(c->h.type) + " with " +
                               std::to_string(c->h.length) + " payload bytes";
                       if (!why.empty()) return refuse(c, why);
                       c->body.clear();
                       c->body.resize(c->h.length);  // bounded by check()
                       c->got = 0;
                       read_body(c, magic, version, check, handle, progress, what);
                     });
  }
  template <class C, class Check, class Handle, class Progress>
  void read_body(std::shared_ptr<C> c, uint32_t magic, uint16_t version, Check check, Handle handle,
                 Progress progress, const char* what) {
    if (c->got == c->body.size()) {
      c->resume = [=] { read_loop(c, magic, version, check, handle, progress, what); };
      if (handle(c)) resume_reading(c);  // false: refused (closed), or deferred to the worker
      return;
    }
    const size_t n = std::min(kReadChunk, c->body.size() - c->got);
    asio::async_read(c->sock, asio::buffer(c->body.data() + c->got, n),
                     [=](const std::error_code& ec, size_t k) {
                       if (ec) return close_conn(c);
                       c->got += k;
                       progress(c);
                       read_body(c, magic, version, check, handle, progress, what);
                     });
  }
  template <class C>
  std::string from(const std::shared_ptr<C>& c) {
    if constexpr (std::is_same_v<C, PeerConn>) {
      std::error_code ec;
      auto ep = c->sock.remote_endpoint(ec);
      return ec ? "?" : ep.address().to_string() + ":" + std::to_string(ep.port());
    } else {
      return "local client" + (c->id >= 0 ? " rank " + std::to_string(c->id) : std::string());
    }
  }
  template <class C>
  void refuse(const std::shared_ptr<C>& c, const std::string& why) {
    std::string who = from(c);
    const std::string key = who.substr(0, who.rfind(':')) + why;
    if constexpr (std::is_same_v<C, PeerConn>) m_.counter(M::kPeersRefused).inc();
    if (refused_.insert(key).second)  // once per address and reason
      SNAP_WARN("refused a %s connection from %s: %s",
                std::is_same_v<C, PeerConn> ? "peer" : "client", who.c_str(), why.c_str());
    close_conn(c);
  }

  // ---- peers ----
  // An accept that fails (out of file descriptors: EMFILE/ENFILE) is retried after 100 ms,
  // logged once per error, rather than at once (which would spin on the loop).
  template <class Acceptor, class Again>
  bool accept_failed(const std::error_code& ec, Acceptor& a, Again again, const char* what) {
    if (!ec) return false;
    if (ec == asio::error::operation_aborted || !a.is_open()) return true;
    if (accept_errors_.insert(std::string(what) + ec.message()).second)
      SNAP_WARN("cannot accept a %s connection: %s (retrying every 100 ms)", what,
                ec.message().c_str());
    auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(100));
    t->async_wait([t, again](const std::error_code&) { again(); });
    return true;
  }
  // A connection that has not sent its HELLO within 10 periods (at least 5 s) is closed, so
  // idle or half-open connections cannot hold file descriptors.
  template <class C>
  void hello_deadline(const std::shared_ptr<C>& c) {
    auto t = std::make_shared<asio::steady_timer>(
        io_, std::chrono::microseconds(std::max<TimeUs>(10 * o_.period, 5 * kUsPerSec)));
    std::weak_ptr<C> w = c;
    t->async_wait([this, t, w](const std::error_code&) {
      auto c = w.lock();
      if (c && c->open && c->id < 0) refuse(c, "no HELLO within the deadline");
    });
  }
  void accept() {
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

  bool handle_peer(const std::shared_ptr<PeerConn>& in) {
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
  void connect(const std::shared_ptr<PeerConn>& o, uint32_t id) {
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
    fresh->sock.async_connect(
        tcp::endpoint(addr, spec->port), [this, fresh, id](const std::error_code& e) {
          if (e || !fresh->open) return close_conn(fresh);
          HelloBody h{};
          h.node_id = o_.self;
          h.token_len = static_cast<uint32_t>(o_.token.size());
          std::memcpy(h.token, o_.token.data(), o_.token.size());
          fresh->latest[uint16_t(PeerMsg::kHello)] = peer_frame(PeerMsg::kHello, h);
          fresh->connected = true;
          pump(fresh);
        });
  }

  // ---- shards ----
  // A received shard (in c->body: ShardMeta + payload) is stored by the worker thread: the
  // checksum check (the one of this hop) and any spill write stay off the event loop, which
  // keeps heartbeats going while gigabytes arrive. The store keeps the received buffer itself
  // (no copy), and the replicas are sent those same bytes with the producer's checksum (not
  // computed again). Back on the loop it is indexed and reported, the home copy goes to the
  // replicas, and the connection's reading resumes.
  template <class C>
  void ingest(const std::shared_ptr<C>& c, const ShardMeta& m, const char* as, bool forward) {
    auto body = std::make_shared<Bytes>(std::move(c->body));
    c->body = {};
    asio::post(work_, [this, c, m, body, as, forward] {
      std::shared_ptr<const uint8_t> pay(body, body->data() + sizeof(ShardMeta));
      std::string err;
      const StoreStatus st = store_.put_shared(ShardKey{m.rank, m.step, m.buffer}, m.base_step,
                                               m.checksum, pay, m.payload_bytes, &err);
      Frame f;
      if (st == StoreStatus::kOk && forward)
        f = make_frame(kPeerMagic, kPeerVersion, uint16_t(PeerMsg::kShard), &m, sizeof(m), nullptr,
                       0, pay, m.payload_bytes);
      asio::post(io_, [this, c, m, st, err, f, as] {
        after_store(m, st, err, as);
        if (st == StoreStatus::kOk && f) forward_shard(m, f);
        resume_reading(c);
      });
    });
  }
  void after_store(const ShardMeta& m, StoreStatus st, const std::string& err, const char* as) {
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
  void report_held(const HeldBody& h) {
    if (coordinator() == int64_t(o_.self))
      on_held(h);
    else if (coordinator() >= 0)
      send_peer(uint32_t(coordinator()), peer_frame(PeerMsg::kHeld, h));
  }
  void forward_shard(const ShardMeta& m, const Frame& f) {
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
  void send_chain(uint32_t node, uint32_t rank, uint32_t buffer, uint64_t step, bool include_step,
                  std::function<void(bool)> done = nullptr) {
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
    read_chain(
        std::move(items), FrameKind::kPeerShard, 0,
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
  // How read_chain frames each shard: FETCHED to a client or a peer (FetchedHead + ShardMeta +
  // payload), or SHARD to a replica (ShardMeta + payload).
  enum class FrameKind { kClientFetched, kPeerFetched, kPeerShard };
  using ChainDone = std::function<void(std::vector<Frame>, StoreStatus, ShardKey, std::string)>;
  // Takes the shards `items` (oldest first) from the store on the worker thread, by reference
  // (a spilled one is read from its file and checked there: the disk hop; one in memory is
  // not hashed again, its receiver checks it) and frames them around those bytes; `done` runs
  // on the loop with the frames, or with the status, key and message of the first shard that
  // could not be read.
  void read_chain(std::vector<ShardMeta> items, FrameKind kind, uint64_t request, ChainDone done) {
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
          frames.push_back(make_frame(kClientMagic, kClientVersion, uint16_t(ClientMsg::kFetched),
                                      &h, sizeof(h), &m, sizeof(m), std::move(ref.data), n));
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
  void resync_replicas() {
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

  // ---- consistent cuts (the coordinator) ----
  struct Round {
    uint32_t id = 0;
    uint64_t step = 0;
    std::set<uint32_t> waiting;
    TimeUs started = 0;
  };
  void on_held(const HeldBody& h) {
    if (!acting_) return;
    if (record_ && !shard_current(*record_, h.generation, h.step)) return;  // rolled back
    world_ = h.world;
    if (h.world != cut_.ranks()) cut_.set_ranks(h.world);  // applies to steps not seen yet
    cut_.set_home(h.rank, h.home_node);
    (void)cut_.on_held(h.node_id, h.rank, h.step);
    seen_step_ = std::max(seen_step_, h.step);
  }
  void answer_marker(uint32_t coordinator, const MarkerBody& b) {
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
  void coordinate_cuts(TimeUs now) {
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
  bool cut_ready() const {
    for (uint32_t n : cut_members_)
      if (!answered_all_.count(n)) return false;
    return cut_owned_;
  }
  // A replica no longer holds (rank, step) in full.
  void on_retract(const HeldBody& h) {
    if (!acting_) return;
    if (cut_.on_retracted(h.node_id, h.rank, h.step))
      SNAP_INFO("rank %u step %llu: node %u no longer holds it (retracted)", h.rank,
                static_cast<unsigned long long>(h.step), h.node_id);
  }
  // This node no longer holds these steps in full (pruned, or a shard failed its checksum).
  void retract(const std::vector<HeldStep>& gone) {
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
  bool shard_wanted(const ShardMeta& m) const {
    return !record_ || shard_current(*record_, m.generation, m.step);
  }
  void apply_complete(std::optional<uint64_t> step) {
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
      if (it != step_arrived_.end())
        m_.gauge(M::kReplicationLag).set((now_us() - it->second) / 1e6);
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
  void prune_before(uint64_t keep) {
    const std::vector<HeldStep> had = holdings_.full_steps();
    const PruneResult pr = store_.prune(keep);
    if (!pr.shards) return;
    holdings_.retain(store_.list());
    index_dirty_ = true;
    retract(lost_steps(had));
  }
  // The steps of `had` no longer held in full.
  std::vector<HeldStep> lost_steps(const std::vector<HeldStep>& had) {
    std::set<std::pair<uint32_t, uint64_t>> now;
    for (const HeldStep& h : holdings_.full_steps()) now.insert({h.rank, h.step});
    std::vector<HeldStep> gone;
    for (const HeldStep& h : had)
      if (!now.count({h.rank, h.step})) gone.push_back(h);
    return gone;
  }

  // ---- restore ----
  struct PendingFetch {
    uint64_t id = 0;
    std::weak_ptr<ClientConn> client;
    uint64_t client_request = 0;
    FetchBody want{};
    std::vector<uint32_t> candidates;
    size_t next = 0;
    uint32_t asked = 0;
    TimeUs asked_at = 0;
    std::vector<uint32_t> silent;  // candidates that did not answer in time: asked once more
    bool second_pass = false;
    std::vector<std::shared_ptr<Bytes>> frames;  // FETCHED bodies received (and checked) so far
  };
  // Answers a FETCH from what this node holds: the chain oldest first, or one refusal frame
  // (not held; corrupt, when a shard failed its CRC: it is then dropped from the index). The
  // shards are read on the worker thread; `out` gets the frames on the loop.
  void serve_fetch(const FetchBody& b, FrameKind kind, std::function<void(Frame)> out,
                   std::function<void(bool)> done = nullptr) {
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
    read_chain(std::move(items), kind, b.request,
               [this, out, done, refusal](std::vector<Frame> frames, StoreStatus st, ShardKey bad,
                                          std::string err) {
                 if (st != StoreStatus::kOk) {
                   SNAP_WARN("cannot serve %s: %s (%s)", to_string(bad).c_str(),
                             store_status_name(st), err.c_str());
                   if (st == StoreStatus::kCorrupt || st == StoreStatus::kNotFound) {
                     const std::vector<HeldStep> had = holdings_.full_steps();
                     holdings_.remove(bad);
                     retract(lost_steps(had));
                   }
                   out(refusal(st == StoreStatus::kCorrupt ? FetchStatus::kCorrupt
                                                           : FetchStatus::kNotHeld));
                   if (done) done(false);
                   return;
                 }
                 for (auto& f : frames) out(std::move(f));
                 if (done) done(true);
               });
  }
  void client_fetch(const std::shared_ptr<ClientConn>& c, const FetchBody& b) {
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
  void fetch_from_peers(const std::shared_ptr<ClientConn>& c, const FetchBody& b) {
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
  void ask_next(PendingFetch& pf) {
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
      SNAP_WARN("restore of rank %u buffer %u step %llu: no live node holds its chain",
                pf.want.rank, pf.want.buffer, static_cast<unsigned long long>(pf.want.step));
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
  // A FETCHED frame from a peer: a refusal moves on to the next replica; a shard is checked
  // (its checksum: the one check of the peer hop) on the worker thread, with the connection's
  // reading paused meanwhile (frames of a connection stay in order); a whole chain goes on to
  // the client around the received bytes (no copy). Returns whether reading resumes now.
  bool on_fetched(uint32_t peer, const std::shared_ptr<PeerConn>& in) {
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
  void fetched_checked(uint32_t peer, uint64_t id, const std::shared_ptr<Bytes>& body,
                       bool sum_ok) {
    auto it = fetches_.find(id);
    if (it == fetches_.end() || it->second.asked != peer) return;
    PendingFetch& pf = it->second;
    FetchedHead h;
    std::memcpy(&h, body->data(), sizeof(h));
    ShardMeta m;
    std::memcpy(&m, body->data() + sizeof(h), sizeof(m));
    if (h.index != pf.frames.size() || h.count == 0 || h.index >= h.count ||
        m.rank != pf.want.rank || m.buffer != pf.want.buffer || !sum_ok) {
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
        send(c,
             make_frame(kClientMagic, kClientVersion, uint16_t(ClientMsg::kFetched), &fh,
                        sizeof(fh), f->data() + sizeof(fh), sizeof(ShardMeta), std::move(pay),
                        f->size() - kFixed),
             false);
      }
    }
    fetches_.erase(it);
  }

  // ---- KV (etcd keys under the job prefix; the watch fills kv_) ----
  static bool kv_valid(const KvBody& kv) {
    const size_t n = strnlen(kv.key, kKvKeyBytes);
    return n > 0 && n < kKvKeyBytes && kv.value_bytes <= kKvMaxValue;
  }

  // ---- local clients ----
  bool open_local(std::string* err) {
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
  void accept_local() {
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
  bool handle_client(const std::shared_ptr<ClientConn>& c) {
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
        send(c, client_frame(ClientMsg::kState, state_body()), false);
        return true;
      }
      case ClientMsg::kShard: {
        ShardMeta m;
        std::memcpy(&m, p, sizeof(m));
        m.home_node = o_.self;
        std::string err;
        if (m.rank != uint32_t(c->id) || m.world != c->world) {
          refuse(c, "shard of rank " + std::to_string(m.rank) + " world " +
                        std::to_string(m.world) + " on the connection of rank " +
                        std::to_string(c->id) + " world " + std::to_string(c->world));
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
        send(c, client_frame(ClientMsg::kState, state_body()), false);
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
  StateBody state_body() const {
    StateBody s{};
    s.node_id = o_.self;
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
  void push_state() {
    const Frame f = client_frame(ClientMsg::kState, state_body());
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (!(*it)->open) {
        it = clients_.erase(it);
        continue;
      }
      if ((*it)->id >= 0) send(*it, f, false);
      ++it;
    }
  }

  // ---- metrics ----
  // A take of a local rank: its first shard opens it, its last buffer closes it (the time
  // between is the client's background encode and send of that take, as seen here).
  void note_take(const ShardMeta& m) {
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
  void refresh_metrics() {
    m_.gauge(M::kLiveNodes).set(double(live().size()));
    m_.gauge(M::kMembershipEpoch).set(double(written_.epoch));
    m_.gauge(M::kCoordinator).set(acting_ ? 1 : 0);
  }

  // ---- the index of held shards, persisted beside the spill files ----
  std::string index_path() const {
    return o_.store.spill_dir.empty() ? std::string() : o_.store.spill_dir + "/holdings.idx";
  }
  void reload_index() {
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
    if (bad)
      SNAP_WARN("index %s: %zu entries without a valid shard were ignored", path.c_str(), bad);
  }
  void save_index() {
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
  void tick() {
    const TimeUs now = now_us();
    read_block_file();
    const float gbps = local_usable_gbps();
    hb_->set_gbps(gbps);
    cp_->set_gbps(gbps);
    for (const auto& [id, p] : hb_->snapshot())
      if (p.rtt_us >= 0) rtt_us_[id] = p.rtt_us;
    m_.counter(M::kHeartbeatsSent).inc(double(hb_->sent() - hb_sent_));
    m_.counter(M::kHeartbeatsReceived).inc(double(hb_->received() - hb_received_));
    hb_sent_ = hb_->sent();
    hb_received_ = hb_->received();
    for (auto& [id, o] : outs_) {
      if (blocked(id) || suspected_.count(id)) continue;
      if (!o->open) {
        // What was queued to it is gone: its chains are resent once it is connected again.
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
      it->second.silent.push_back(it->second.asked);
      ask_next(it->second);
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

  // ---- membership: the local view, the control plane's events ----
  // The nodes this daemon replicates to and fetches from: the agreed record's members it does
  // not suspect (before the first record: every peer it has heard), and itself.
  std::vector<uint32_t> live() const {
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
  int64_t coordinator() const { return cp_ ? cp_->coordinator_id() : -1; }
  void on_suspect(uint32_t id, bool on) {
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
  void start_control_plane() {
    ControlPlane::Config c;
    c.etcd = o_.etcd;
    c.prefix = o_.prefix;
    c.self = o_.self;
    c.period = o_.period;
    c.lease_ttl_s = o_.lease_ttl_s;
    c.token = o_.token;
    c.test_write_after_pause = o_.test_write_after_pause;
    ControlPlane::Events e;
    e.record = [this](const Record& r) { asio::post(io_, [this, r] { apply_record(r); }); };
    e.cut = [this](uint64_t step, uint64_t gen) {
      asio::post(io_, [this, step, gen] {
        if (record_ && gen < record_->generation) return;  // of a rolled-back timeline
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
  void on_view(const ControlPlane::View& v) {
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
  void apply_record(const Record& r) {
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
      if (complete_ && (!r.restore_step || *complete_ > *r.restore_step)) {
        complete_ = r.restore_step;
        cut_written_ = r.restore_step;
      }
      seen_step_ = r.restore_step.value_or(0);
    }
    write_board(to_board(r, uint32_t(o_.peers.size())), "from etcd");
  }
  // Test hook (R2CCL_SNAPD_TEST_BLOCK_FILE): node ids whose traffic is dropped both ways;
  // "in:ID" drops only what comes from ID (one-way reachability). Heartbeats read the same file.
  void read_block_file() {
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
  void write_board(const board::AgreedRecord& r, const std::string& how) {
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
  float local_usable_gbps() {
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

  Options o_;
  M::Registry m_;
  Planner planner_;
  ShardStore store_;
  Holdings holdings_;
  CutTracker cut_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  ulocal::acceptor local_;
  asio::steady_timer timer_;
  asio::signal_set signals_;
  std::map<uint32_t, std::shared_ptr<PeerConn>> outs_;
  std::set<std::shared_ptr<ClientConn>> clients_;
  std::set<std::string> refused_;
  std::set<std::string> accept_errors_;
  std::set<uint32_t> ever_failed_;      // nodes declared failed at least once ("back" vs "up")
  std::string board_error_;             // the last health-board error logged
  uint32_t client_world_ = 0;           // the world size the latest client said
  std::map<uint32_t, int64_t> rtt_us_;  // from the heartbeats
  std::map<uint64_t, std::set<uint32_t>> replicas_of_;  // (rank, buffer) -> replicas with its chain
  std::map<std::string, std::string> kv_;               // etcd's KV, from the watch
  std::map<uint64_t, PendingFetch> fetches_;
  uint64_t fetch_ids_ = 0;
  bool acting_ = false;
  std::unique_ptr<HeartbeatService> hb_;
  std::unique_ptr<ControlPlane> cp_;
  std::optional<Record> record_;           // the latest agreed record from etcd
  std::set<uint32_t> suspected_;           // peers this node's heartbeats do not hear
  std::vector<uint32_t> cut_members_;      // coordinator: the members the cut view follows
  std::set<uint32_t> answered_all_;        // coordinator: members that answered the "all" marker
  std::optional<uint64_t> cut_written_;    // coordinator: the newest complete step written
  std::optional<uint64_t> pending_epoch_;  // coordinator: a record being written
  bool waiting_logged_ = false;
  uint64_t marker_ticks_ = 0;
  uint64_t hb_sent_ = 0, hb_received_ = 0;
  board::AgreedRecord written_{};  // the record last written to this node's board
  // consistent cuts
  bool cut_owned_ = false;
  uint64_t cut_epoch_ = 0;
  std::optional<Round> round_;
  uint32_t round_ids_ = 0;
  uint64_t seen_step_ = 0;
  uint32_t world_ = 0;  // ranks in the job, from the latest HELD
  std::optional<uint64_t> complete_;
  uint64_t complete_generation_ = 0;  // the generation the complete step was taken in
  uint64_t shards_held_ = 0;
  bool index_dirty_ = false;
  uint64_t ticks_ = 0;
  // test hooks
  uint64_t exit_step_ = 0, exit_after_ = 0, exit_count_ = 0;
  bool dying_ = false;
  std::string block_file_;
  std::set<uint32_t> blocked_, blocked_in_;
  // metrics
  struct Take {
    uint64_t step = 0;
    TimeUs started = 0;
    uint64_t bytes = 0;
  };
  std::map<uint32_t, Take> takes_;           // local rank -> its take in progress
  std::map<uint64_t, TimeUs> step_arrived_;  // step -> when its last local shard arrived
  std::unique_ptr<M::HttpServer> http_;      // declared after io_: destroyed before it
  // The worker thread: shard stores (CRC, copy, spill) and chain reads for restores and
  // resyncs. FIFO, one thread, so the shards of a chain are stored in arrival order. Its
  // completions are posted back to io_.
  asio::thread_pool work_{1};
};

// Reads the file named by option `what` (e.g. "--peers"); *err names the option, the path and
// why (not a regular file, too large, or the system's reason).
bool read_text(const char* what, const std::string& path, std::string* out, std::string* err) {
  std::string why;
  if (read_regular_file(path, 16u << 20, out, &why)) return true;
  *err = std::string(what) + " " + path + ": " + why;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  // The daemon's stderr is its log: SNAP_WARN/SNAP_INFO lines stamped with CLOCK_MONOTONIC
  // seconds (the plugins' event-line clock), INFO always shown. Usage errors below stay plain
  // "r2ccl_snapshotd: ..." messages, like CLI11's.
  set_stderr_options(true, NCCL_LOG_INFO);
  Options o;
  uint32_t id = 0;
  std::string peers_file, token_file, topo_file, spill_dir;
  int period_ms = 500;
  uint64_t mem_mb = 4096, max_shard_mb = 1024;
  CLI::App app{"r2ccl snapshot sidecar: membership, shard replication, consistent cuts, restore",
               "r2ccl_snapshotd"};
  app.add_option("--id", id, "this node's id in the peer list")
      ->required()
      ->check(CLI::Range(0, board::kMaxNodes - 1));
  app.add_option("--peers", peers_file, "peer list: lines 'ID HOST:PORT'")
      ->required()
      ->type_name("FILE");
  app.add_option("--token-file", token_file, "the job token shared by all nodes (1-64 bytes)")
      ->required()
      ->type_name("FILE");
  app.add_option("--board", o.board, "this node's health board name (default 'default')")
      ->type_name("NAME");
  app.add_option("--period-ms", period_ms, "heartbeat period (default 500)")
      ->check(CLI::Range(10, 60000));
  app.add_option("--socket", o.socket_path,
                 "client socket (default /tmp/r2ccl-snapshotd-BOARD.sock; mode 0600)")
      ->type_name("PATH");
  app.add_option("--socket-group", o.socket_group,
                 "make the client socket 0660, owned by this group")
      ->type_name("GROUP");
  app.add_option("--spill-dir", spill_dir,
                 "where shards beyond --mem-limit-mb go (default: none, "
                 "the memory limit is hard)")
      ->type_name("DIR");
  app.add_option("--mem-limit-mb", mem_mb, "shard bytes held in memory, MiB (default 4096)")
      ->check(CLI::Range(uint64_t(1), uint64_t(1) << 30));
  app.add_option("--max-shard-mb", max_shard_mb, "largest shard accepted, MiB (default 1024)")
      ->check(CLI::Range(uint64_t(1), uint64_t(1) << 20));
  app.add_option("--replicas", o.replicas, "replica nodes per shard (default 3)")
      ->check(CLI::Range(1, 16));
  app.add_option("--metrics", o.metrics_addr,
                 "serve Prometheus metrics on ADDR:PORT "
                 "(numeric IPv4 address, e.g. 127.0.0.1:9464; port 0: any free port)")
      ->type_name("ADDR:PORT");
  std::string etcd_urls, job = "default", etcd_password_file;
  int lease_ttl = 3;
  app.add_option("--etcd", etcd_urls,
                 "etcd client URLs of the control plane: http(s)://HOST:PORT[,...] (required)")
      ->required()
      ->type_name("URL[,URL...]");
  app.add_option("--job", job,
                 "the job's name: its etcd keys live under /r2ccl/JOB/ (default 'default'; "
                 "letters, digits, '-', '_', '.')")
      ->type_name("NAME");
  app.add_option("--lease-ttl", lease_ttl,
                 "seconds of etcd silence after which this daemon counts as gone (default 3)")
      ->check(CLI::Range(1, 3600));
  app.add_option("--etcd-ca", o.etcd.ca_file, "CA certificate for https etcd URLs")
      ->type_name("FILE");
  app.add_option("--etcd-cert", o.etcd.cert_file, "client certificate for etcd (TLS)")
      ->type_name("FILE");
  app.add_option("--etcd-key", o.etcd.key_file, "client certificate's key for etcd (TLS)")
      ->type_name("FILE");
  app.add_option("--etcd-user", o.etcd.user, "etcd user (etcd authentication)")->type_name("NAME");
  app.add_option("--etcd-password-file", etcd_password_file,
                 "file holding the etcd user's password (first line)")
      ->type_name("FILE");
  app.add_option("--topology", topo_file,
                 "node places in the network: lines 'ID SWITCH/PATH' "
                 "(default: nearest by measured round trip)")
      ->type_name("FILE");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    fprintf(stderr, "r2ccl_snapshotd: %s\n%s", e.what(), app.help().c_str());
    return 2;
  }
  std::string text, err, token;
  if (!read_text("--peers", peers_file, &text, &err) || !parse_peers(text, &o.peers, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: %s\n", err.c_str());
    return 2;
  }
  if (!read_text("--token-file", token_file, &token, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: %s\n", err.c_str());
    return 2;
  }
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  if (token.empty() || token.size() > kTokenBytes) {
    fprintf(stderr, "r2ccl_snapshotd: the job token in %s has %zu bytes (accepted: 1..%zu)\n",
            token_file.c_str(), token.size(), kTokenBytes);
    return 2;
  }
  bool listed = false;
  for (const auto& p : o.peers) listed |= p.id == id;
  if (!listed) {
    fprintf(stderr, "r2ccl_snapshotd: --id %u is not in the peer list %s\n", id,
            peers_file.c_str());
    return 2;
  }
  std::string seg;
  if (!board::segment_name(o.board, &seg, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: --board: %s\n", err.c_str());
    return 2;
  }
  if (!topo_file.empty() && (!read_text("--topology", topo_file, &text, &err) ||
                             !parse_topology(text, &o.topology, &err))) {
    fprintf(stderr, "r2ccl_snapshotd: --topology: %s\n", err.c_str());
    return 2;
  }
  if (app.count("--socket") && o.socket_path.empty()) {
    fprintf(stderr,
            "r2ccl_snapshotd: --socket is empty (accepted: a path; leave the option out "
            "for /tmp/r2ccl-snapshotd-BOARD.sock)\n");
    return 2;
  }
  if (o.socket_path.empty()) o.socket_path = "/tmp/r2ccl-snapshotd-" + o.board + ".sock";
  if (!o.socket_group.empty() && !getgrnam(o.socket_group.c_str())) {
    fprintf(stderr, "r2ccl_snapshotd: --socket-group %s: no such group\n", o.socket_group.c_str());
    return 2;
  }
  if (!spill_dir.empty()) {
    // The directory itself is created (mode 0700) if missing, its parent must exist: a typo
    // does not silently create a tree.
    std::string parent = spill_dir;
    while (parent.size() > 1 && parent.back() == '/') parent.pop_back();
    const size_t slash = parent.rfind('/');
    parent = slash == std::string::npos ? "." : slash == 0 ? "/" : parent.substr(0, slash);
    struct stat st;
    if (stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      fprintf(stderr,
              "r2ccl_snapshotd: --spill-dir %s: its parent directory %s does not exist "
              "(the spill directory itself is created if missing)\n",
              spill_dir.c_str(), parent.c_str());
      return 2;
    }
  }
  // The socket is bound as PATH.tmpPID first: room for that suffix too.
  constexpr size_t kMaxSocketPath = sizeof(sockaddr_un::sun_path) - 16;
  if (o.socket_path.size() > kMaxSocketPath) {
    fprintf(stderr, "r2ccl_snapshotd: --socket %s is %zu bytes long (accepted: at most %zu)\n",
            o.socket_path.c_str(), o.socket_path.size(), kMaxSocketPath);
    return 2;
  }
  if (!o.metrics_addr.empty()) {
    asio::ip::tcp::endpoint ep;
    if (!M::parse_listen_address(o.metrics_addr, &ep, &err)) {
      fprintf(stderr, "r2ccl_snapshotd: --metrics: %s\n", err.c_str());
      return 2;
    }
  }
  if (!etcd::parse_endpoints(etcd_urls, &o.etcd, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: --etcd: %s\n", err.c_str());
    return 2;
  }
  if (job.empty() || job.size() > 64 ||
      job.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") !=
          std::string::npos) {
    fprintf(stderr,
            "r2ccl_snapshotd: --job '%s' (accepted: 1-64 letters, digits, '-', '_' or '.')\n",
            job.c_str());
    return 2;
  }
  for (const std::string* f : {&o.etcd.ca_file, &o.etcd.cert_file, &o.etcd.key_file})
    if (!f->empty() && access(f->c_str(), R_OK) != 0) {
      fprintf(stderr, "r2ccl_snapshotd: %s: cannot read it (%s)\n", f->c_str(), strerror(errno));
      return 2;
    }
  if (!etcd_password_file.empty()) {
    if (o.etcd.user.empty()) {
      fprintf(stderr, "r2ccl_snapshotd: --etcd-password-file needs --etcd-user\n");
      return 2;
    }
    if (!read_text("--etcd-password-file", etcd_password_file, &o.etcd.password, &err)) {
      fprintf(stderr, "r2ccl_snapshotd: %s\n", err.c_str());
      return 2;
    }
    o.etcd.password = o.etcd.password.substr(0, o.etcd.password.find('\n'));
  }
  o.prefix = "/r2ccl/" + job + "/";
  o.lease_ttl_s = lease_ttl;
  o.etcd.timeout_ms = std::max(200, std::min(1000, lease_ttl * 1000 / 3));
  o.test_write_after_pause = getenv("R2CCL_SNAPD_TEST_WRITE_AFTER_PAUSE") != nullptr;
  o.self = id;
  o.token = token;
  o.period = static_cast<TimeUs>(period_ms) * kUsPerMs;
  o.store.spill_dir = spill_dir;
  o.store.memory_limit_bytes = mem_mb << 20;
  o.store.max_shard_bytes = max_shard_mb << 20;
  Daemon d(std::move(o));
  return d.run();
}
