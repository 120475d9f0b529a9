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
// Sources (one class, Daemon, its member functions defined by concern):
//   daemon.h         this overview, the frame and connection types, the class
//   main.cc          the command line: options parsed and checked, then Daemon::run()
//   daemon.cc        construction, run() (store, ports, socket, threads, shutdown), the period
//                    (tick), the metrics of loop-owned state, the index of held shards, the
//                    block-file test hook
//   peers.cc         peer connections: accept, connect, HELLO, the peer frames' dispatch
//   replication.cc   shards: stored by the worker, sent to the replicas, chains resent
//   coordination.cc  consistent cuts (the coordinator's marker rounds), the control plane's
//                    events (records, suspicions, evictions), the health board
//   restore.cc       FETCH: served from the local store, or fetched from the peers
//   clients.cc       the local client socket: HELLO, shards, state, fetches, KV
// The decisions are pure classes with their own tests (no sockets, no threads, an injected
// clock): coordinator.h (Planner), cut.h (CutTracker), holdings.h, membership.h, accrual.h.
//
// Threads: the event loop (asio, Debian's libasio-dev) for peers' data and clients; a worker
// for stores and chain reads; the heartbeat thread; the control-plane thread and its etcd
// watch. Decisions are made on the event loop. Exit status: 0 on SIGTERM/SIGINT, 2 on bad arguments
// or files (the message names which and the accepted form), 1 when a port, the socket or the spill
// directory cannot be opened.
#pragma once

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

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
#include "r2ccl/snapshot/big_buffer.h"
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

// A named namespace (not an anonymous one): the class is shared by the sources above.
namespace snapd {

// Byte buffers whose resize() does not zero what it adds (a shard body of a gigabyte is filled by
// the socket 1 MiB at a time; zeroing it first would stall the event loop), on huge pages from
// 2 MiB on (big_buffer.h: the first user access of 4 KiB pages was what restores waited on).
using Bytes = std::vector<uint8_t, BigAlloc<uint8_t>>;

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
inline Frame make_frame(uint32_t magic, uint16_t version, uint16_t type, const void* a, size_t an,
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
  int64_t id = -1;       // peer node id (peer connections) or rank (clients), once HELLO checked
  uint32_t world = 0;    // clients: the job's world size
  uint32_t queries = 0;  // clients: QUERYs read (every STATE to it carries the count)
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
  int test_register_delay_ms = 0;  // ControlPlane::Config's
};

class Daemon {
 public:
  explicit Daemon(Options o);
  int run();

 private:
  const PeerSpec* find(uint32_t id) const {
    for (const auto& p : o_.peers)
      if (p.id == id) return &p;
    return nullptr;
  }
  bool blocked(int64_t peer) const { return peer >= 0 && blocked_.count(uint32_t(peer)); }
  int64_t coordinator() const { return cp_ ? cp_->coordinator_id() : -1; }

  // ---- writing (the templates are shared by peers and clients) ----
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
  bool send_peer(uint32_t id, Frame f);

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

  // ---- peers (peers.cc; these two templates serve the client socket too) ----
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
  void accept();
  bool handle_peer(const std::shared_ptr<PeerConn>& in);
  void connect(const std::shared_ptr<PeerConn>& o, uint32_t id);

  // ---- shards (replication.cc) ----
  // Defined in replication.cc and instantiated there for PeerConn and ClientConn.
  template <class C>
  void ingest(const std::shared_ptr<C>& c, const ShardMeta& m, const char* as, bool forward);
  void after_store(const ShardMeta& m, StoreStatus st, const std::string& err, const char* as);
  void report_held(const HeldBody& h);
  void forward_shard(const ShardMeta& m, const Frame& f);
  void send_chain(uint32_t node, uint32_t rank, uint32_t buffer, uint64_t step, bool include_step,
                  std::function<void(bool)> done = nullptr);
  // How read_chain frames each shard: FETCHED to a client or a peer (FetchedHead + ShardMeta +
  // payload), or SHARD to a replica (ShardMeta + payload).
  enum class FrameKind { kClientFetched, kPeerFetched, kPeerShard };
  using ChainDone = std::function<void(std::vector<Frame>, StoreStatus, ShardKey, std::string)>;
  void read_chain(std::vector<ShardMeta> items, FrameKind kind, uint64_t request, ChainDone done);
  void resync_replicas();

  // ---- consistent cuts (coordination.cc) ----
  struct Round {
    uint32_t id = 0;
    uint64_t step = 0;
    std::set<uint32_t> waiting;
    TimeUs started = 0;
  };
  void on_held(const HeldBody& h);
  void answer_marker(uint32_t coordinator, const MarkerBody& b);
  void coordinate_cuts(TimeUs now);
  bool cut_ready() const;
  void on_retract(const HeldBody& h);
  void retract(const std::vector<HeldStep>& gone);
  bool shard_wanted(const ShardMeta& m) const;
  void apply_complete(std::optional<uint64_t> step);
  void prune_before(uint64_t keep);
  std::vector<HeldStep> lost_steps(const std::vector<HeldStep>& had);

  // ---- restore (restore.cc) ----
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
  void serve_fetch(const FetchBody& b, FrameKind kind, std::function<void(Frame)> out,
                   std::function<void(bool)> done = nullptr);
  void client_fetch(const std::shared_ptr<ClientConn>& c, const FetchBody& b);
  void fetch_from_peers(const std::shared_ptr<ClientConn>& c, const FetchBody& b);
  void ask_next(PendingFetch& pf);
  // Fetches waiting on `peer` move on to their next replica now (it is kept for a second
  // pass): the FETCH never left (the connection to it could not be made) or its process is
  // gone (it came back as a new incarnation). `why` goes into the log line. Loop thread.
  void fetches_lost(uint32_t peer, const std::string& why);
  // Logs why pf's replica is passed over (kept for a second pass) and asks the next.
  void pass_over(PendingFetch& pf, const std::string& why);
  bool on_fetched(uint32_t peer, const std::shared_ptr<PeerConn>& in);
  void fetched_checked(uint32_t peer, uint64_t id, const std::shared_ptr<Bytes>& body, bool sum_ok);

  // ---- local clients and the KV (clients.cc) ----
  static bool kv_valid(const KvBody& kv);
  bool open_local(std::string* err);
  void accept_local();
  bool handle_client(const std::shared_ptr<ClientConn>& c);
  StateBody state_body(const ClientConn& c) const;  // the STATE for client c, now
  void push_state();

  // ---- metrics, the index, the period, test hooks (daemon.cc) ----
  void note_take(const ShardMeta& m);
  void refresh_metrics();
  std::string index_path() const;
  void reload_index();
  void save_index();
  void tick();
  void read_block_file();

  // ---- membership, the control plane's events, the health board (coordination.cc) ----
  std::vector<uint32_t> live() const;
  void on_suspect(uint32_t id, bool on);
  void start_control_plane();
  void on_view(const ControlPlane::View& v);
  void apply_record(const Record& r);
  void write_board(const board::AgreedRecord& r, const std::string& how);
  float local_usable_gbps();

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
  std::set<uint32_t> ever_failed_;  // nodes declared failed at least once ("back" vs "up")
  std::string board_error_;         // the last health-board error logged
  uint32_t client_world_ = 0;       // the world size the latest client said
  std::map<uint32_t, uint64_t> peer_incarnation_;       // from their HELLOs
  std::map<uint32_t, int64_t> rtt_us_;                  // from the heartbeats
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

extern template void Daemon::ingest(const std::shared_ptr<PeerConn>&, const ShardMeta&, const char*,
                                    bool);
extern template void Daemon::ingest(const std::shared_ptr<ClientConn>&, const ShardMeta&,
                                    const char*, bool);

}  // namespace snapd
