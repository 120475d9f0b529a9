// r2ccl_snapshotd: the per-node snapshot sidecar (issue 6). This first part runs the cluster
// membership: authenticated peer connections (job token), heartbeats, failure detection (3
// missed periods), the coordinator rule (lowest live id, acting only with a strict majority),
// and the agreed cluster record published into every node's health board for the tuner.
// Snapshot shards, consistent cuts and recovery build on it (snapshot/README.md).
//
//   r2ccl_snapshotd --id N --peers FILE --token-file FILE [--board NAME] [--period-ms MS]
//
// One event loop (asio, Debian's libasio-dev) on one thread. Exit status: 0 on SIGTERM/SIGINT,
// 2 on bad arguments or files (the message names which and the accepted form), 1 when the peer
// port cannot be opened.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <asio.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/membership.h"
#include "r2ccl/snapshot/peer_wire.h"

using asio::ip::tcp;
using namespace r2ccl;
using namespace r2ccl::snap;

namespace {

// One line on stderr, stamped with CLOCK_MONOTONIC seconds (the plugins' event-line clock).
void say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void say(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  fprintf(stderr, "[%.6f] [r2ccl_snapshotd] %s\n", now_us() / 1e6, buf);
}

bool token_equal(const uint8_t* a, const uint8_t* b, size_t n) {
  uint8_t d = 0;
  for (size_t i = 0; i < n; ++i) d |= a[i] ^ b[i];
  return d == 0;
}

template <typename Body>
std::shared_ptr<std::vector<uint8_t>> frame(PeerMsg type, const Body& body) {
  auto f = std::make_shared<std::vector<uint8_t>>(sizeof(PeerHeader) + sizeof(Body));
  PeerHeader h{kPeerMagic, kPeerVersion, static_cast<uint16_t>(type),
               static_cast<uint32_t>(sizeof(Body)), 0};
  std::memcpy(f->data(), &h, sizeof(h));
  std::memcpy(f->data() + sizeof(h), &body, sizeof(Body));
  return f;
}

class Daemon {
 public:
  Daemon(uint32_t self, std::vector<PeerSpec> peers, std::string token, std::string board,
         TimeUs period)
      : self_(self),
        peers_(std::move(peers)),
        token_(std::move(token)),
        board_(std::move(board)),
        period_(period),
        mem_(self, ids(peers_), period, now_us()),
        acceptor_(io_),
        timer_(io_),
        signals_(io_, SIGINT, SIGTERM) {}

  int run() {
    const PeerSpec* me = find(self_);
    std::error_code ec;
    tcp::endpoint ep(asio::ip::make_address(me->host, ec), me->port);
    if (ec) ep = tcp::endpoint(tcp::v4(), me->port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(64, ec);
    if (ec) {
      say("cannot listen on %s:%u: %s", me->host.c_str(), me->port, ec.message().c_str());
      return 1;
    }
    say("node %u of %zu listening on %s:%u, heartbeat every %.0f ms, board %s", self_,
        peers_.size(), me->host.c_str(), me->port, period_ / 1e3, board_.c_str());
    for (const auto& p : peers_)
      if (p.id != self_) outs_[p.id] = std::make_shared<Out>(io_, p);
    accept();
    signals_.async_wait([this](const std::error_code&, int sig) {
      say("signal %d: exiting", sig);
      io_.stop();
    });
    tick();
    io_.run();
    return 0;
  }

 private:
  struct Out {
    Out(asio::io_context& io, PeerSpec s) : sock(io), spec(std::move(s)) {}
    tcp::socket sock;
    PeerSpec spec;
    bool connected = false, connecting = false, writing = false;
    std::map<uint16_t, std::shared_ptr<std::vector<uint8_t>>> pending;  // by message type
  };

  static std::vector<uint32_t> ids(const std::vector<PeerSpec>& p) {
    std::vector<uint32_t> v;
    for (const auto& s : p) v.push_back(s.id);
    return v;
  }
  const PeerSpec* find(uint32_t id) const {
    for (const auto& p : peers_)
      if (p.id == id) return &p;
    return nullptr;
  }

  // ---- incoming connections: HELLO, then HEARTBEAT / AGREED frames ----
  void accept() {
    acceptor_.async_accept([this](const std::error_code& ec, tcp::socket s) {
      if (!ec) {
        auto in = std::make_shared<In>(std::move(s));
        read_header(in);
      }
      accept();
    });
  }
  struct In {
    explicit In(tcp::socket s) : sock(std::move(s)) {}
    tcp::socket sock;
    PeerHeader h{};
    std::vector<uint8_t> body;
    int64_t peer = -1;  // node id once the HELLO checked out
    std::string from() {
      std::error_code ec;
      auto ep = sock.remote_endpoint(ec);
      return ec ? "?" : ep.address().to_string() + ":" + std::to_string(ep.port());
    }
  };
  void refuse(const std::shared_ptr<In>& in, const std::string& why) {
    const std::string key = in->from().substr(0, in->from().rfind(':')) + why;
    if (refused_.insert(key).second)  // once per address and reason
      say("refused a peer connection from %s: %s", in->from().c_str(), why.c_str());
    std::error_code ec;
    in->sock.close(ec);
  }
  void read_header(std::shared_ptr<In> in) {
    asio::async_read(in->sock, asio::buffer(&in->h, sizeof(in->h)),
                     [this, in](const std::error_code& ec, size_t) {
                       if (ec) return;  // closed
                       const size_t want = peer_payload_size(in->h.type);
                       if (in->h.magic != kPeerMagic) return refuse(in, "not an r2ccl peer (bad magic)");
                       if (in->h.version != kPeerVersion)
                         return refuse(in, "protocol version " + std::to_string(in->h.version) +
                                               ", this daemon speaks " + std::to_string(kPeerVersion));
                       if (want == 0 || in->h.length != want)
                         return refuse(in, "message type " + std::to_string(in->h.type) +
                                               " with " + std::to_string(in->h.length) +
                                               " payload bytes");
                       if (in->peer < 0 && in->h.type != static_cast<uint16_t>(PeerMsg::kHello))
                         return refuse(in, "first message is not HELLO");
                       in->body.resize(want);  // bounded: at most sizeof(AgreedRecord)
                       asio::async_read(in->sock, asio::buffer(in->body),
                                        [this, in](const std::error_code& ec2, size_t) {
                                          if (ec2) return;
                                          if (handle(in)) read_header(in);
                                        });
                     });
  }
  bool handle(const std::shared_ptr<In>& in) {
    const TimeUs now = now_us();
    switch (static_cast<PeerMsg>(in->h.type)) {
      case PeerMsg::kHello: {
        HelloBody b;
        std::memcpy(&b, in->body.data(), sizeof(b));
        uint8_t mine[kTokenBytes] = {};
        std::memcpy(mine, token_.data(), token_.size());
        if (b.token_len != token_.size() || !token_equal(b.token, mine, kTokenBytes)) {
          refuse(in, "wrong job token");
          return false;
        }
        if (!find(b.node_id) || b.node_id == self_) {
          refuse(in, "node id " + std::to_string(b.node_id) + " is not a peer in the peer list");
          return false;
        }
        in->peer = b.node_id;
        mem_.on_heard(b.node_id, now);
        return true;
      }
      case PeerMsg::kHeartbeat: {
        HeartbeatBody b;
        std::memcpy(&b, in->body.data(), sizeof(b));
        if (b.node_id != in->peer) {
          refuse(in, "heartbeat for node " + std::to_string(b.node_id) + " on node " +
                         std::to_string(in->peer) + "'s connection");
          return false;
        }
        heard(b.node_id, now);
        if (b.node_id < gbps_.size() && std::isfinite(b.usable_gbps) && b.usable_gbps >= 0)
          gbps_[b.node_id] = b.usable_gbps;
        agreed_epoch_ = std::max(agreed_epoch_, b.epoch);
        return true;
      }
      case PeerMsg::kAgreed: {
        board::AgreedRecord r;
        std::memcpy(&r, in->body.data(), sizeof(r));
        heard(static_cast<uint32_t>(in->peer), now);
        // Only the coordinator in this node's view is followed; an older epoch is ignored. A
        // record of the epoch already written is taken when it differs: two nodes that briefly
        // both coordinated (one had not heard the other yet) may have used the same epoch, and
        // the lowest live id's record must win everywhere.
        if (static_cast<uint32_t>(in->peer) != mem_.coordinator() || r.epoch < written_epoch_ ||
            (r.epoch == written_epoch_ && same_membership(r, written_)))
          return true;
        if (!board::agreed_record_consistent(r)) {
          refuse(in, "inconsistent agreed record");
          return false;
        }
        write_board(r, "from coordinator " + std::to_string(in->peer));
        return true;
      }
    }
    return false;
  }
  static bool same_membership(const board::AgreedRecord& a, const board::AgreedRecord& b) {
    return a.n_nodes == b.n_nodes && std::memcmp(a.members, b.members, sizeof(a.members)) == 0;
  }
  void heard(uint32_t id, TimeUs now) {
    const bool was = mem_.alive(id);
    mem_.on_heard(id, now);
    if (!was) say("node %u is back (membership epoch %llu)", id,
                  static_cast<unsigned long long>(mem_.epoch()));
  }

  // ---- outgoing connections: one per peer, HELLO then periodic frames ----
  void connect(const std::shared_ptr<Out>& o) {
    if (o->connected || o->connecting) return;
    o->connecting = true;
    std::error_code ec;
    auto addr = asio::ip::make_address(o->spec.host, ec);
    if (ec) {  // a name: resolve synchronously once per attempt (peer lists are small)
      tcp::resolver res(io_);
      auto r = res.resolve(o->spec.host, std::to_string(o->spec.port), ec);
      if (ec || r.empty()) {
        o->connecting = false;
        return;
      }
      addr = r.begin()->endpoint().address();
    }
    o->sock = tcp::socket(io_);
    o->sock.async_connect(tcp::endpoint(addr, o->spec.port), [this, o](const std::error_code& e) {
      o->connecting = false;
      if (e) return;  // retried next period
      o->connected = true;
      HelloBody h{};
      h.node_id = self_;
      h.token_len = static_cast<uint32_t>(token_.size());
      std::memcpy(h.token, token_.data(), token_.size());
      o->pending.clear();
      send(o, frame(PeerMsg::kHello, h), static_cast<uint16_t>(PeerMsg::kHello));
    });
  }
  // Frames are idempotent (a newer heartbeat or record replaces an older one): each peer keeps
  // at most one pending frame per type, so a slow peer costs bounded memory, and the frames of
  // one period (heartbeat, agreed record) all go out in order behind the HELLO.
  void send(const std::shared_ptr<Out>& o, std::shared_ptr<std::vector<uint8_t>> f, uint16_t type) {
    if (!o->connected) return;
    o->pending[type] = std::move(f);
    pump(o);
  }
  void pump(const std::shared_ptr<Out>& o) {
    if (o->writing || o->pending.empty() || !o->connected) return;
    auto it = o->pending.begin();  // HELLO (type 1) first, then HEARTBEAT, then AGREED
    auto f = std::move(it->second);
    o->pending.erase(it);
    o->writing = true;
    asio::async_write(o->sock, asio::buffer(*f), [this, o, f](const std::error_code& ec, size_t) {
      o->writing = false;
      if (ec) {
        o->connected = false;
        o->pending.clear();
        std::error_code ignore;
        o->sock.close(ignore);
        return;
      }
      pump(o);
    });
  }

  // ---- the period: heartbeats, failure detection, the agreed record ----
  void tick() {
    const TimeUs now = now_us();
    for (uint32_t id : mem_.tick(now)) {
      say("node %u missed 3 heartbeats: declared failed (live: %zu of %zu, membership epoch %llu)",
          id, mem_.live().size(), mem_.configured(), static_cast<unsigned long long>(mem_.epoch()));
      auto it = outs_.find(id);
      if (it != outs_.end() && it->second->connected) {
        std::error_code ec;
        it->second->sock.close(ec);
        it->second->connected = false;
      }
    }
    gbps_.resize(board::kMaxNodes, 0.0f);
    gbps_[self_] = local_usable_gbps();
    HeartbeatBody hb{self_, gbps_[self_], agreed_epoch_};
    auto hbf = frame(PeerMsg::kHeartbeat, hb);
    for (auto& [id, o] : outs_) {
      connect(o);
      send(o, hbf, static_cast<uint16_t>(PeerMsg::kHeartbeat));
    }
    const bool acts = mem_.acts_as_coordinator();
    if (acts != acting_) {
      acting_ = acts;
      say(acts ? "coordinator: lowest live id with a majority (%zu of %zu live)"
               : "not acting as coordinator (%zu of %zu live)",
          mem_.live().size(), mem_.configured());
    }
    if (acts) coordinate();
    timer_.expires_after(std::chrono::microseconds(period_));
    timer_.async_wait([this](const std::error_code& ec) {
      if (!ec) tick();
    });
  }
  void coordinate() {
    board::AgreedRecord r = mem_.agreed_record(gbps_);
    const std::vector<uint32_t> live = mem_.live();
    // A new epoch when the membership changed, and also when another node has seen a higher
    // epoch than this coordinator's record (a restarted coordinator starts from nothing): the
    // record must supersede every earlier one, or the others would ignore it.
    if (live != agreed_members_ || written_epoch_ == 0 || agreed_epoch_ > current_.epoch) {
      agreed_members_ = live;
      agreed_epoch_ = std::max(agreed_epoch_, written_epoch_) + 1;
      current_ = r;
      current_.epoch = agreed_epoch_;
      write_board(current_, "as coordinator");
    } else {
      // Bandwidth changes ride along without a new epoch (the tuner reads it at init).
      std::memcpy(current_.node_usable_gbps, r.node_usable_gbps, sizeof(r.node_usable_gbps));
    }
    auto f = frame(PeerMsg::kAgreed, current_);
    for (auto& [id, o] : outs_)
      if (mem_.alive(id)) send(o, f, static_cast<uint16_t>(PeerMsg::kAgreed));
  }
  void write_board(const board::AgreedRecord& r, const std::string& how) {
    std::string err;
    if (!board::publish_agreed_record(board_, r, &err)) {
      say("cannot publish the agreed record to health board %s: %s", board_.c_str(), err.c_str());
      return;
    }
    written_epoch_ = r.epoch;
    written_ = r;
    agreed_epoch_ = std::max(agreed_epoch_, r.epoch);
    std::string members;
    for (uint32_t id = 0; id < r.n_nodes && id < static_cast<uint32_t>(board::kMaxNodes); ++id)
      if (r.members[id / 64] & (1ULL << (id % 64)))
        members += (members.empty() ? "" : ",") + std::to_string(id);
    say("agreed record epoch %llu, members {%s} written to board %s (%s)",
        static_cast<unsigned long long>(r.epoch), members.c_str(), board_.c_str(), how.c_str());
  }
  // This node's usable network bandwidth (GB/s): the rails its net plugins publish as up, once
  // per rail name. 0 when the board is absent or shows none.
  float local_usable_gbps() {
    board::BoardView v;
    std::string err;
    if (!board::read_board(board_, &v, &err)) return 0;
    std::map<std::string, uint32_t> rails;
    for (const auto& s : v.rails)
      if (s.f.state == board::RailState::kUp) rails[s.f.name] = s.f.usable_mbps;
    double mbps = 0;
    for (const auto& [n, m] : rails) mbps += m;
    return static_cast<float>(mbps / 8000.0);
  }

  uint32_t self_;
  std::vector<PeerSpec> peers_;
  std::string token_;
  std::string board_;
  TimeUs period_;
  Membership mem_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer timer_;
  asio::signal_set signals_;
  std::map<uint32_t, std::shared_ptr<Out>> outs_;
  std::set<std::string> refused_;
  std::vector<float> gbps_ = std::vector<float>(board::kMaxNodes, 0.0f);
  bool acting_ = false;
  uint64_t agreed_epoch_ = 0;   // the highest agreed epoch seen anywhere
  uint64_t written_epoch_ = 0;  // the epoch last written to this node's board
  std::vector<uint32_t> agreed_members_;
  board::AgreedRecord current_{};
  board::AgreedRecord written_{};  // the record last written to this node's board
};

bool read_text(const std::string& path, std::string* out, std::string* err) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    *err = "cannot read " + path;
    return false;
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  uint32_t id = 0;
  std::string peers_file, token_file, board = "default";
  int period_ms = 500;
  CLI::App app{"r2ccl snapshot sidecar: cluster membership and the agreed record", "r2ccl_snapshotd"};
  app.add_option("--id", id, "this node's id in the peer list")->required()->check(CLI::Range(0, board::kMaxNodes - 1));
  app.add_option("--peers", peers_file, "peer list: lines 'ID HOST:PORT'")->required()->type_name("FILE");
  app.add_option("--token-file", token_file, "the job token shared by all nodes (1-64 bytes)")
      ->required()->type_name("FILE");
  app.add_option("--board", board, "this node's health board name (default 'default')")->type_name("NAME");
  app.add_option("--period-ms", period_ms, "heartbeat period (default 500)")->check(CLI::Range(10, 60000));
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
  std::vector<PeerSpec> peers;
  if (!read_text(peers_file, &text, &err) || !parse_peers(text, &peers, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: %s\n", err.c_str());
    return 2;
  }
  if (!read_text(token_file, &token, &err)) {
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
  for (const auto& p : peers) listed |= p.id == id;
  if (!listed) {
    fprintf(stderr, "r2ccl_snapshotd: --id %u is not in the peer list %s\n", id, peers_file.c_str());
    return 2;
  }
  std::string seg;
  if (!board::segment_name(board, &seg, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: --board: %s\n", err.c_str());
    return 2;
  }
  Daemon d(id, std::move(peers), token, board, static_cast<TimeUs>(period_ms) * kUsPerMs);
  return d.run();
}
