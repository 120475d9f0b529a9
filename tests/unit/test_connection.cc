// engine::Connection over an in-memory transport (MemIo) and a manual clock: no sockets, no
// threads, no sleeps. Two connections (sender, receiver) are joined by a MemWire with a fixed
// one-way latency per path. MemIo runs in either of the two shapes the real transports have:
//  - "receiver places" (TCP): the receiver reads each chunk into the place the engine names
//    and acknowledges it with ACK control messages;
//  - "NIC places" (verbs): a chunk lands in the receiver's buffer by itself (an RDMA write),
//    the sender's completion acknowledges it, and a failed path must be quiesced at both
//    ends before the sender replays (the gate).
// Faults: a path cut (everything on it silently lost: a black hole), a path reset (both ends
// see an error), a path that comes back (reconnects succeed again).
// Each case fails when the behaviour it names is broken (replay off, notices lost, ...).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/connection.h"
#include "engine/path_plan.h"
#include "r2ccl/log.h"
#include "r2ccl/params.h"
#include "support/net_harness.h"
#include "support/stream.h"

using namespace r2ccl;
using namespace r2ccl::net;

namespace {

constexpr TimeUs kT0 = 5000 * kUsPerSec;
constexpr TimeUs kStep = 100;  // manual clock step, us

class MemRails : public RailTable {
 public:
  explicit MemRails(int n) : live_(new RailLive[n]), n_(n) {
    for (int i = 0; i < n; ++i) names_.push_back("mem" + std::to_string(i));
  }
  int rail_count() const override { return n_; }
  RailLive& live(int r) override { return live_[r]; }
  const std::string& rail_name(int r) const override { return names_[r]; }
  int rail_speed_mbps(int) const override { return 10000; }
  const char* link_event_source() const override { return "test link event"; }

 private:
  std::unique_ptr<RailLive[]> live_;
  std::vector<std::string> names_;
  int n_;
};

class MemIo;

// What travels between the two ends.
struct Item {
  enum Kind { kChunk, kChunkDone, kCts, kCtrl, kProbe, kProbeAck } kind = kChunk;
  int path = 0;
  uint32_t gen = 0;
  TimeUs at = 0;
  ChunkOut chunk;
  std::vector<char> payload;
  uint64_t seq = 0;
  uint64_t cap = 0;
  RemoteBuffer rb;
  CtrlMsg ctrl;
};

struct MemWire {
  TimeUs latency = 200;
  bool nic_places = false;
  bool cut[kMaxPathsPerConn] = {};  // black hole: everything posted on it is lost
  // stall[side][path]: what travels towards that side on the path waits, nothing is lost (a
  // TCP stream in retransmission backoff; the other direction keeps flowing).
  bool stall[2][kMaxPathsPerConn] = {};
  // A stalled stream behind a lost segment: later segments still reach the kernel, which
  // "hears" them (TCP's ACK clock) though the application gets nothing until the hole is
  // repaired. Only with heard_from_items.
  bool stall_heard = false;
  bool refuse[kMaxPathsPerConn] = {};  // reconnects are refused (nothing listens)
  std::deque<Item> to[2];              // to[side]: in flight towards that side
  MemIo* end[2] = {nullptr, nullptr};
  int chunks_posted[kMaxPathsPerConn] = {};
  int fail_acks_dropped = 0;  // FAIL_ACKs still to drop (tests of re-sent notices)
  // Eager messages (receiver places only): the threshold both ends negotiated, 0 = off.
  uint64_t eager = 0;
  int cts_posted = 0;
};

class MemIo final : public PathIo {
 public:
  MemIo(MemWire* w, int side, int npaths) : w_(w), side_(side) {
    conn_id_ = 0x1234;
    chunk_size_ = 64 * 1024;
    eager_threshold_ = w->eager;
    for (int i = 0; i < npaths; ++i)
      paths_desc_.push_back(PathDesc{i, "mem" + std::to_string(i), true, 0});
    stopped_.assign(npaths, false);
    last_rx_.assign(npaths, 0);
    kernel_ack_.assign(npaths, 0);
    reconnect_at_.assign(npaths, 0);
    peer_reconnected_.assign(npaths, false);
    w_->end[side] = this;
  }
  PathCaps caps() const override {
    PathCaps c;
    c.receiver_acks = !w_->nic_places;
    c.quiesce_before_replay = w_->nic_places;
    c.eager = !w_->nic_places && w_->eager > 0;
    return c;
  }
  bool ready(int p) const override { return !stopped_[p]; }

  void poll(PathSink& sink, TimeUs now) override {
    for (int p = 0; p < npaths(); ++p) {
      if (peer_reconnected_[p]) {  // the peer re-created the path
        peer_reconnected_[p] = false;
        paths_desc_[p].generation++;
        stopped_[p] = false;
        sink.on_reconnected(p, now);
      }
      if (reconnect_at_[p] && now >= reconnect_at_[p]) {
        reconnect_at_[p] = 0;
        if (w_->refuse[p] || w_->cut[p]) {
          sink.on_reconnect_failed(p, w_->refuse[p], "refused", now);
        } else {
          paths_desc_[p].generation++;
          stopped_[p] = false;
          w_->end[1 - side_]->peer_reconnected_[p] = true;
          sink.on_reconnected(p, now);
        }
      }
    }
    std::deque<Item>& in = w_->to[side_];
    std::vector<Item> due;
    for (auto i = in.begin(); i != in.end() && i->at <= now;) {
      if (w_->stall[side_][i->path]) {
        if (w_->stall_heard) last_rx_[i->path] = std::max(last_rx_[i->path], i->at);
        ++i;
        continue;
      }
      due.push_back(std::move(*i));
      i = in.erase(i);
    }
    for (Item& it : due) {
      if (stopped_[it.path] || it.gen != paths_desc_[it.path].generation) continue;
      last_rx_[it.path] = now;
      sink.on_path_alive(it.path, now);
      deliver(it, sink, now);
    }
  }
  void flush(PathSink&, TimeUs) override {}

  PostResult post_chunk(int p, const ChunkOut& c, PathSink&, TimeUs now) override {
    Item it;
    it.kind = Item::kChunk;
    it.chunk = c;
    it.payload.assign(c.src, c.src + c.len);
    it.rb = *c.remote;
    w_->chunks_posted[p]++;
    send(p, std::move(it), now);
    return PostResult::kPosted;
  }
  PostResult post_cts(int p, const CtsOut& c, PathSink&, TimeUs now) override {
    Item it;
    it.kind = Item::kCts;
    it.seq = c.seq;
    it.cap = c.capacity;
    it.rb.addr = reinterpret_cast<uintptr_t>(c.buf);
    it.rb.allowed = allowed;  // what this end's registration allows (verbs: CTS excluded)
    w_->cts_posted++;
    send(p, std::move(it), now);
    return PostResult::kPosted;
  }
  PostResult post_ctrl(int p, const CtrlMsg& m, PathSink&, TimeUs now) override {
    if (p < 0) return PostResult::kFull;
    Item it;
    it.kind = Item::kCtrl;
    it.ctrl = m;
    send(p, std::move(it), now);
    sent_ctrl.push_back(m);
    return PostResult::kPosted;
  }
  bool probe(int p, PathSink&, TimeUs now) override {
    ++probes[p];
    Item it;
    it.kind = Item::kProbe;
    send(p, std::move(it), now);
    return true;
  }
  void stop_path(int p, bool, TimeUs) override {
    stopped_[p] = true;
    // What this end had not sent yet is gone with its sockets / QPs.
    auto& out = w_->to[1 - side_];
    for (auto it = out.begin(); it != out.end();)
      it = it->path == p && it->gen == paths_desc_[p].generation && !w_->nic_places ? out.erase(it)
                                                                                    : it + 1;
  }
  bool can_reconnect(int, PathSink&) const override { return side_ == 0; }
  void reconnect(int p, PathSink&, TimeUs now) override { reconnect_at_[p] = now + 1000; }
  TimeUs stall_floor(int) const override { return floor; }
  TimeUs heard_within(int p, TimeUs now) const override {
    if (!heard_from_items) return heard;
    TimeUs last = last_rx_[p];
    // (The latest ACK may still be on its way: counted as heard now, 2 x latency early.)
    if (!w_->cut[p]) last = std::max(last, std::min(kernel_ack_[p], now));
    return last ? now - last : INT64_MAX;
  }
  void say_goodbye(TimeUs) override {}
  uint32_t allowed_paths(const void*) const override { return allowed; }

  // The transport resets the path at this end (an error the next poll reports).
  void reset(int p, PathSink& sink, TimeUs now) {
    sink.on_path_error(p, FailCause::kSocketError, "reset", now);
  }

  // The link of path p: link_base + p (0: private links, the default).
  uint64_t link_key(int p) const override { return link_base ? link_base + p : 0; }
  uint64_t link_base = 0;
  int probes[kMaxPathsPerConn] = {};  // probes posted per path
  TimeUs heard = INT64_MAX;
  TimeUs floor = 0;  // stall_floor: the transport's own recovery time (verbs retransmissions)
  // true: the transport "hears" the peer whenever anything of the peer's arrives on the path
  // (TCP's ACK clock), instead of the fixed `heard`.
  bool heard_from_items = false;
  std::vector<CtrlMsg> sent_ctrl;
  // The paths every buffer of this end may travel on (verbs: a GPU buffer and backups
  // beyond NCCL_NET_GDR_LEVEL).
  uint32_t allowed = kAllPaths;

 private:
  void send(int p, Item it, TimeUs now) {
    if (w_->cut[p] || stopped_[p]) return;  // lost
    // TCP's ACK clock: the peer's kernel acknowledges what this end sends one round trip
    // later, even while the stream towards this end waits behind a lost segment (a pure ACK is
    // no part of that stream). Only a cut path (a black hole) silences it.
    kernel_ack_[p] = std::max(kernel_ack_[p], now + 2 * w_->latency);
    it.path = p;
    it.gen = paths_desc_[p].generation;
    it.at = now + w_->latency;
    w_->to[1 - side_].push_back(std::move(it));
  }
  void reply(const Item& from, Item it, TimeUs now) {
    it.path = from.path;
    it.gen = from.gen;
    it.at = now + w_->latency;
    if (w_->cut[from.path]) return;
    w_->to[1 - side_].push_back(std::move(it));
  }
  void deliver(Item& it, PathSink& sink, TimeUs now) {
    switch (it.kind) {
      case Item::kChunk: {
        const ChunkOut& c = it.chunk;
        if (w_->nic_places) {
          // The NIC writes into the posted buffer; the sender's completion follows.
          memcpy(reinterpret_cast<char*>(it.rb.addr) + c.offset, it.payload.data(), c.len);
          sink.on_chunk_placed(it.path, c.seq & 127, 7, c.idx, c.len, c.last, now);
          Item done;
          done.kind = Item::kChunkDone;
          done.seq = c.seq;
          done.chunk = c;
          reply(it, std::move(done), now);
          return;
        }
        ChunkHeader h{c.seq, c.offset, c.total, c.idx, c.nchunks, c.len, c.eager, c.lazy_ack};
        ChunkPlace pl = sink.on_chunk_header(it.path, h, now);
        if (pl.action == ChunkPlace::Action::kProtocolError) {
          sink.on_path_error(it.path, FailCause::kProtocol, pl.why, now);
          return;
        }
        if (pl.action != ChunkPlace::Action::kRead || !sink.chunk_wanted(pl)) return;
        if (c.len > 0) memcpy(pl.dst, it.payload.data(), c.len);  // an empty chunk has no buffer
        sink.on_chunk_read(it.path, pl, true, now);
        return;
      }
      case Item::kChunkDone: sink.on_chunk_acked(it.path, it.chunk.seq, it.chunk.idx, now); return;
      case Item::kCts: sink.on_cts(it.seq, it.cap, it.rb, now); return;
      case Item::kCtrl:
        if (it.ctrl.type == CtrlType::kFailAck && w_->fail_acks_dropped > 0) {
          w_->fail_acks_dropped--;
          return;
        }
        sink.on_ctrl(it.path, it.ctrl, now);
        return;
      case Item::kProbe: {
        Item ack;
        ack.kind = Item::kProbeAck;
        reply(it, std::move(ack), now);
        return;
      }
      case Item::kProbeAck: sink.on_probe_ok(it.path, now, 0); return;
    }
  }

  std::vector<TimeUs> last_rx_;     // when the peer's last item arrived, per path
  std::vector<TimeUs> kernel_ack_;  // when the peer's kernel ACKs this end's latest item
  MemWire* w_;
  int side_;
  std::vector<bool> stopped_;
  std::vector<TimeUs> reconnect_at_;
  std::vector<bool> peer_reconnected_;
};

Config test_config(std::map<std::string, std::string> env) {
  Config cfg;
  std::string err;
  std::vector<std::string> warnings, names;
  for (const auto& kv : env) names.push_back(kv.first);
  const bool ok = load_config(
      [&](const char* n) -> const char* {
        auto it = env.find(n);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      names, &cfg, &err, &warnings);
  INFO(err);
  REQUIRE(ok);
  return cfg;
}

// The event lines (log_event) of one test, from a temporary event sink.
struct EventLog {
  std::string path = test::temp_path("events");
  EventLog() { REQUIRE(set_event_sink(path, nullptr)); }
  ~EventLog() {
    set_event_sink("stderr", nullptr);
    unlink(path.c_str());
  }
  std::string text() const { return test::read_file(path); }
  int count(const std::string& s) const { return test::count_lines_containing(text(), s); }
};

// Links shared by several Pairs (engine/link_live.h): each end's process has its table;
// path p of every Pair runs over link `key + p`.
struct SharedLinks {
  LinkTable* send = nullptr;
  LinkTable* recv = nullptr;
  uint64_t key = 0;
};

// A sender and a receiver joined by a MemWire, driven by one manual clock.
struct Pair {
  explicit Pair(bool nic_places, int npaths = 2, std::map<std::string, std::string> env = {},
                TestHooks hooks = {}, uint64_t eager = 0, const SharedLinks* links = nullptr)
      : cfg(test_config(std::move(env))), srails(npaths), rrails(npaths) {
    wire.nic_places = nic_places;
    wire.eager = eager;
    ConnEnv e;
    e.cfg = &cfg;
    e.health = health_params_from(cfg);
    e.hooks = hooks;
    auto sio = std::make_unique<MemIo>(&wire, 0, npaths);
    auto rio = std::make_unique<MemIo>(&wire, 1, npaths);
    sio_ = sio.get();
    rio_ = rio.get();
    if (links) sio->link_base = rio->link_base = links->key;
    e.rails = &srails;  // each end has its own rails, as two processes do
    e.links = links ? links->send : nullptr;
    send = std::make_unique<Connection>(e, Role::kSend, 0, std::move(sio), now);
    e.rails = &rrails;
    e.links = links ? links->recv : nullptr;
    recv = std::make_unique<Connection>(e, Role::kRecv, 0, std::move(rio), now);
  }
  void step() {
    now += kStep;
    send->progress(now);
    if (!recv_paused) recv->progress(now);
  }
  bool recv_paused = false;  // the receiving process is stopped (SIGSTOP): it runs nothing
  void run(TimeUs us) {
    for (TimeUs end = now + us; now < end;) step();
  }
  // Posts one message of `n` bytes each way and returns both requests (NULL: not posted).
  bool post(const char* src, size_t n, char* dst, size_t cap, Request** sreq, Request** rreq) {
    REQUIRE(recv->irecv(dst, cap, 0, nullptr, rreq, now) == Status::kOk);
    REQUIRE(*rreq != nullptr);
    for (int i = 0; i < 1000 && !*sreq; ++i) {
      step();
      REQUIRE(send->isend(const_cast<char*>(src), n, 0, nullptr, sreq, now) == Status::kOk);
    }
    return *sreq != nullptr;
  }
  // Tests both requests until they complete or fail, for at most `us`. Returns the first
  // error or kOk; *done says whether both completed.
  Status wait(Request* s, Request* r, TimeUs us, bool* done) {
    int sd = 0, rd = 0, size = 0;
    for (TimeUs end = now + us; now < end && !(sd && rd);) {
      step();
      if (!sd) {
        const Status st = send->test(s, &sd, &size, now);
        if (st != Status::kOk) return st;
      }
      if (!rd) {
        const Status st = recv->test(r, &rd, &size, now);
        if (st != Status::kOk) return st;
      }
    }
    *done = sd && rd;
    return Status::kOk;
  }
  MemIo& sio() { return *sio_; }
  MemIo& rio() { return *rio_; }

  Config cfg;
  MemRails srails, rrails;
  MemWire wire;
  TimeUs now = kT0;
  std::unique_ptr<Connection> send, recv;
  MemIo* sio_ = nullptr;
  MemIo* rio_ = nullptr;
};

std::vector<char> pattern(size_t n, uint64_t seed) {
  std::vector<char> v(n);
  test::fill_pattern(v.data(), n, seed);
  return v;
}

// One message of `n` bytes (pattern `seed`) posted at both ends of `t`.
struct Message {
  Message(Pair& t, size_t n, uint64_t seed) : src(pattern(n, seed)), dst(n, 0) {
    REQUIRE(t.post(src.data(), src.size(), dst.data(), dst.size(), &s, &r));
  }
  std::vector<char> src, dst;
  Request* s = nullptr;
  Request* r = nullptr;
};

// Runs `t` until both requests of `m` complete (or `us` pass); true when they did, with every
// byte right.
bool arrives(Pair& t, Message& m, TimeUs us) {
  bool done = false;
  REQUIRE(t.wait(m.s, m.r, us, &done) == Status::kOk);
  return done && m.dst == m.src;
}

const char* shape_name(bool nic) { return nic ? "NIC places (verbs)" : "receiver places (TCP)"; }

}  // namespace

TEST_CASE("connection: a message arrives intact over the in-memory transport", "[connection]") {
  for (bool nic : {false, true}) {
    INFO(shape_name(nic));
    EventLog log;
    Pair t(nic);
    Message m(t, 1 << 20, 1);
    CHECK(arrives(t, m, 100 * kUsPerMs));
    CHECK(t.wire.chunks_posted[1] == 0);  // stripe off: backups carry nothing
    CHECK(log.count("switchover") == 0);
  }
}

TEST_CASE("connection: traffic in flight from the first chunk until the message completes",
          "[connection]") {
  // The TCP fault injector's resets wait for traffic_in_flight, so a receiver that never saw
  // its message in flight would never be reset (a fault test that proves nothing).
  for (bool nic : {false, true}) {
    INFO(shape_name(nic));
    Pair t(nic, 2, {{"R2CCL_CHUNK_SIZE", "64K"}, {"R2CCL_PATH_WINDOW", "64K"}});
    CHECK_FALSE(t.recv->traffic_in_flight(0));
    Message m(t, 1 << 20, 5);
    bool send_seen = false, recv_seen = false;
    int sd = 0, rd = 0, size = 0;
    for (int i = 0; i < 20000 && !(sd && rd); ++i) {
      t.step();
      send_seen = send_seen || t.send->traffic_in_flight(0);
      recv_seen = recv_seen || t.recv->traffic_in_flight(0);
      if (!sd) REQUIRE(t.send->test(m.s, &sd, &size, t.now) == Status::kOk);
      if (!rd) REQUIRE(t.recv->test(m.r, &rd, &size, t.now) == Status::kOk);
    }
    REQUIRE((sd && rd));
    CHECK(send_seen);
    CHECK(recv_seen);  // 16 chunks, one 64 KiB window at a time: seen part-landed
    CHECK_FALSE(t.recv->traffic_in_flight(0));
    CHECK_FALSE(t.send->traffic_in_flight(0));
  }
}

TEST_CASE("connection: liveness is probed once per link; a silent link fails every path on it",
          "[connection][link]") {
  // Two connections between the same two processes over the same two rail pairs (NCCL's
  // channels): one prober per link and end, so the probes do not multiply with connections,
  // and a black hole on rail pair 0 fails path 0 of both within 3 heartbeat periods and a
  // little, the prober's by its own rule, the other's by the prober's verdict.
  for (bool nic : {false, true}) {
    INFO(shape_name(nic));
    EventLog log;
    HealthParams hp;
    LinkTable ls(hp), lr(hp);
    SharedLinks links{&ls, &lr, 100};
    Pair a(nic, 2, {}, {}, 0, &links), b(nic, 2, {}, {}, 0, &links);
    for (MemIo* io : {&a.sio(), &a.rio(), &b.sio(), &b.rio()}) io->heard_from_items = true;
    CHECK(ls.size() == 2);
    CHECK(lr.size() == 2);
    const TimeUs hb = a.cfg.heartbeat_interval;
    REQUIRE(hb == 30 * kUsPerMs);
    auto step = [&] {
      a.step();
      b.now = a.now - kStep;
      b.step();
    };
    for (TimeUs end = a.now + kUsPerSec; a.now < end;) step();
    INFO(log.text());
    CHECK(log.count("failed (") == 0);
    // ~33 probes per link and end in 1 s (66 with a prober per path).
    for (int path = 0; path < 2; ++path) {
      const int sp = a.sio().probes[path] + b.sio().probes[path];
      const int rp = a.rio().probes[path] + b.rio().probes[path];
      CHECK(sp >= 25);
      CHECK(sp <= 40);
      CHECK(rp >= 25);
      CHECK(rp <= 40);
    }
    a.wire.cut[0] = b.wire.cut[0] = true;
    const TimeUs t0 = a.now;
    TimeUs fa = 0, fb = 0;
    while (a.now < t0 + kUsPerSec && !(fa && fb)) {
      step();
      if (!fa && a.send->path_state(0) == PathState::kFailed) fa = a.now;
      if (!fb && b.send->path_state(0) == PathState::kFailed) fb = b.now;
    }
    INFO(log.text());
    REQUIRE(fa);
    REQUIRE(fb);
    CHECK(fa - t0 <= 4 * hb + 10 * kUsPerMs);
    CHECK(fb - t0 <= 4 * hb + 10 * kUsPerMs);
    CHECK(log.count("its prober's finding") >= 1);
    CHECK(a.send->path_state(1) == PathState::kHealthy);
    CHECK(b.send->path_state(1) == PathState::kHealthy);
  }
}

TEST_CASE("connection: the last usable path waits 10 heartbeat periods, not 3",
          "[connection][link]") {
  // With no survivor, a descheduled peer process looks like a dead link (its kernel's ACKs
  // may wait for it too) and failing the path moves the traffic nowhere: the heartbeat rule
  // waits 10 periods there. With a survivor it stays at 3 (the black-hole target).
  for (bool nic : {false, true}) {
    INFO(shape_name(nic));
    EventLog log;
    Pair t(nic, 2);
    t.sio().heard_from_items = t.rio().heard_from_items = true;
    const TimeUs hb = t.cfg.heartbeat_interval;
    for (TimeUs end = t.now + 300 * kUsPerMs; t.now < end;) t.step();
    auto fails_after = [&](int path) {
      t.wire.cut[path] = true;
      const TimeUs t0 = t.now;
      while (t.now < t0 + kUsPerSec && t.send->path_state(path) != PathState::kFailed) t.step();
      return t.send->path_state(path) == PathState::kFailed ? t.now - t0 : INT64_MAX;
    };
    const TimeUs first = fails_after(1);
    const TimeUs last = fails_after(0);
    INFO(log.text());
    CHECK(first <= 4 * hb + 10 * kUsPerMs);
    CHECK(last >= 9 * hb);
    CHECK(last <= 11 * hb + 10 * kUsPerMs);
  }
}

TEST_CASE("links: RTTs high on every link at once are a stall, not one rail queueing",
          "[connection][link]") {
  HealthParams hp;
  LinkTable t(hp);
  auto a = t.get(1), b = t.get(2), c = t.get(3);
  const TimeUs now = kT0, window = 120 * kUsPerMs;
  auto sample = [&](LinkLive& l, bool high, TimeUs at) {
    l.sample_high = high;
    l.sampled_at = at;
  };
  // No other link sampled lately: a's outliers are its own.
  sample(*b, true, now - 2 * window);
  sample(*c, true, now - 2 * window);
  CHECK_FALSE(t.every_other_high(a.get(), now, window));
  // Every other link high within the window: a stall.
  sample(*b, true, now - 10 * kUsPerMs);
  sample(*c, true, now - 50 * kUsPerMs);
  CHECK(t.every_other_high(a.get(), now, window));
  // One other link normal: a rail of its own (the shadow-routing case).
  sample(*c, false, now - 5 * kUsPerMs);
  CHECK_FALSE(t.every_other_high(a.get(), now, window));
  // Private links (key 0) are not in the table: a process whose transport cannot share
  // links judges each path alone, as before.
  auto p0 = t.get(0);
  CHECK(t.size() == 3);
  CHECK_FALSE(t.every_other_high(p0.get(), now, window));
  // The baseline forgets a run it was told was not its rail's, and starts one again.
  RttBaseline r(hp);
  TimeUs clock = kT0;
  auto next = [&](TimeUs rtt) { return r.sample(rtt, clock += 150 * kUsPerMs); };
  for (int i = 0; i < hp.rtt_baseline_samples; ++i) next(100);
  CHECK(next(50 * kUsPerMs) == 0);
  CHECK(next(50 * kUsPerMs) == 0);
  CHECK(next(50 * kUsPerMs) == +1);
  CHECK(r.last_high());
  r.forget_run();
  CHECK_FALSE(r.outlier());
  CHECK(next(50 * kUsPerMs) == 0);
  CHECK(next(50 * kUsPerMs) == 0);
  CHECK(next(50 * kUsPerMs) == +1);
}

TEST_CASE("connection: an idle connection woken after its link's verdict fails its path",
          "[connection][link]") {
  // The background thread leaves an idle connection alone until its descriptors, a timer it
  // names (idle_due) or a process-wide event (a link's verdict) wake it; the silence it then
  // sees is the link's, not its own scheduling gap.
  HealthParams hp;
  LinkTable ls(hp), lr(hp);
  SharedLinks links{&ls, &lr, 100};
  EventLog log;
  Pair a(false, 2, {}, {}, 0, &links), b(false, 2, {}, {}, 0, &links);
  for (MemIo* io : {&a.sio(), &a.rio(), &b.sio(), &b.rio()}) io->heard_from_items = true;
  const TimeUs hb = a.cfg.heartbeat_interval;
  auto step = [&] {
    a.step();
    b.now = a.now - kStep;
    b.step();
  };
  for (TimeUs end = a.now + 200 * kUsPerMs; a.now < end;) step();
  // b's send connection: not a prober, quiet: no timer at all (the link's events wake it);
  // a's has the next probe and the heartbeat rule.
  const TimeUs due_a = a.send->idle_due(a.now), due_b = b.send->idle_due(a.now);
  CHECK(due_a > a.now);
  CHECK(due_a <= a.now + hb);
  CHECK(due_b == INT64_MAX);
  // A request under way: the tick as before.
  std::vector<char> dst(1024);
  Request* r = nullptr;
  REQUIRE(b.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, b.now) == Status::kOk);
  CHECK(b.recv->idle_due(b.now) == 0);
  // Rail pair 0 goes silent; only a runs until its prober's verdict.
  const uint32_t events = ls.events();
  a.wire.cut[0] = b.wire.cut[0] = true;
  const TimeUs t0 = a.now;
  while (a.now < t0 + kUsPerSec && a.send->path_state(0) != PathState::kFailed) a.step();
  REQUIRE(a.send->path_state(0) == PathState::kFailed);
  CHECK(ls.events() != events);  // the runtime wakes every idle connection
  // b's send connection wakes: it reads what reached it before the cut (the receiver's
  // beats), which does not count as the link being alive: nothing new within a period fails
  // it.
  b.now = a.now + 5 * kUsPerMs;
  const TimeUs woke = b.now;
  while (b.now < woke + 3 * hb && b.send->path_state(0) != PathState::kFailed) {
    b.send->progress(b.now);
    b.now += kStep;
  }
  INFO(log.text());
  CHECK(b.send->path_state(0) == PathState::kFailed);
  CHECK(b.now - woke <= hb + kUsPerMs);
  CHECK(log.count("path on rail mem0 failed (heartbeat miss: the link silent") == 1);
}

TEST_CASE("connection: a stalled direction is not a dead path while the peer's heartbeats arrive",
          "[connection]") {
  // The sender's chunks and the answers to the receiver's probes wait 250 ms on path 0 (a TCP
  // stream in retransmission backoff); the receiver's own heartbeats still reach the sender,
  // so its transport hears the peer and the watchdog waits for 10x the acknowledgement
  // timeout instead of failing a live path. A heartbeat that waited for the answer to the
  // last one would fall silent here and fail it, and so would one beat per heartbeat period
  // (100 ms) against a 60 ms timeout: a receiver awaiting data beats 4 times per timeout.
  for (bool nic : {false, true}) {
    INFO(shape_name(nic));
    EventLog log;
    Pair t(nic, 2,
           {{"R2CCL_ACK_TIMEOUT", "60ms"},
            {"R2CCL_PATH_WINDOW", "256K"},
            {"R2CCL_CHUNK_SIZE", "64K"}});
    t.sio().heard_from_items = t.rio().heard_from_items = true;
    Message m(t, 4 << 20, 9);
    t.run(300);
    t.wire.stall[1][0] = true;
    t.run(250 * kUsPerMs);
    t.wire.stall[1][0] = false;
    CHECK(arrives(t, m, 2 * kUsPerSec));
    INFO(log.text());
    CHECK(log.count("failed (") == 0);
    CHECK(t.send->path_state(0) == PathState::kHealthy);
  }
}

TEST_CASE("connection: no path is failed while its transport may still recover it (stall floor)",
          "[connection]") {
  // Verbs-shaped (the transport hears nothing of the peer itself): path 0 goes silent both
  // ways for 250 ms, as a lost packet waits for the QP's retransmission. With the QP's two
  // retransmissions taking 400 ms (stall_floor) that is no failure; without the floor the
  // 100 ms watchdog fails the path (the control). A black hole longer than the floor still
  // fails it, no sooner than the floor.
  for (TimeUs floor : {TimeUs{0}, 400 * kUsPerMs}) {
    INFO("stall floor " << floor / kUsPerMs << " ms");
    EventLog log;
    Pair t(true, 2,
           {{"R2CCL_ACK_TIMEOUT", "100ms"},
            {"R2CCL_PATH_WINDOW", "256K"},
            {"R2CCL_CHUNK_SIZE", "64K"}});
    t.sio().floor = t.rio().floor = floor;
    Message m(t, 4 << 20, 9);
    t.run(300);
    t.wire.stall[0][0] = t.wire.stall[1][0] = true;
    t.run(250 * kUsPerMs);
    t.wire.stall[0][0] = t.wire.stall[1][0] = false;
    CHECK(arrives(t, m, 2 * kUsPerSec));
    INFO(log.text());
    if (floor == 0)
      CHECK(log.count("failed (") >= 1);
    else
      CHECK(log.count("failed (") == 0);
  }
  EventLog log;
  Pair t(
      true, 2,
      {{"R2CCL_ACK_TIMEOUT", "100ms"}, {"R2CCL_PATH_WINDOW", "256K"}, {"R2CCL_CHUNK_SIZE", "64K"}});
  t.sio().floor = t.rio().floor = 400 * kUsPerMs;
  Message m(t, 4 << 20, 9);
  t.run(300);
  t.wire.cut[0] = true;
  t.wire.refuse[0] = true;
  t.run(2 * kUsPerSec);
  CHECK(arrives(t, m, 3 * kUsPerSec));
  INFO(log.text());
  CHECK(log.count("switchover: rail mem0 failed") == 1);
  const std::vector<double> silent =
      test::log_numbers(log.text(), "(?:none|silent) for ([0-9]+) ms");
  REQUIRE(!silent.empty());
  CHECK(silent[0] >= 400);
}

TEST_CASE("connection: a paused peer process fails no path; a silent rail beside a live peer does",
          "[connection]") {
  // The receiving process stops for 2 s (SIGSTOP): nothing of it arrives on any path while
  // the transport below still hears its machine (TCP: its kernel ACKs our heartbeats). That
  // is a pause, not two broken rails: no path fails, the message completes after it. The
  // same silence on one path while the peer's heartbeats arrive on the other is a black hole
  // there, and the watchdog fails that path as before.
  for (bool whole_process : {true, false}) {
    INFO((whole_process ? "the whole receiving process pauses" : "only path 0 goes silent"));
    EventLog log;
    Pair t(false, 2,
           {{"R2CCL_ACK_TIMEOUT", "100ms"},
            {"R2CCL_PATH_WINDOW", "256K"},
            {"R2CCL_CHUNK_SIZE", "64K"}});
    t.sio().heard = 1000;  // the sender's kernel hears the peer's machine throughout
    Message m(t, 4 << 20, 9);
    t.run(300);
    if (whole_process) {
      t.recv_paused = true;
      t.run(2 * kUsPerSec);
      t.recv_paused = false;
    } else {
      t.wire.cut[0] = true;
      t.wire.refuse[0] = true;
      t.run(2 * kUsPerSec);
    }
    CHECK(arrives(t, m, 3 * kUsPerSec));
    INFO(log.text());
    if (whole_process) {
      CHECK(log.count("failed (") == 0);
      CHECK(t.send->path_state(0) == PathState::kHealthy);
    } else {
      CHECK(log.count("switchover: rail mem0 failed") == 1);  // whichever end saw it first
    }
  }
}

TEST_CASE("connection: a receiver keeps beating fast while its last acknowledgement may be delayed",
          "[connection]") {
  // TCP shape: the receive completes and its final acknowledgement waits 200 ms behind a lost
  // segment in the stream towards the sender, whose kernel still hears later segments. A
  // receiver that went back to one beat per 100 ms period once nothing was outstanding let the
  // sender's 60 ms watchdog fail a live path; beating 4 times per timeout for 4 timeouts
  // after the completion keeps the proof of life fresh.
  EventLog log;
  Pair t(false, 2, {{"R2CCL_ACK_TIMEOUT", "60ms"}, {"R2CCL_CHUNK_SIZE", "64K"}});
  t.sio().heard_from_items = t.rio().heard_from_items = true;
  t.wire.stall_heard = true;
  Message m(t, 256 << 10, 11);
  int rd = 0, sd = 0, size = 0;
  for (int i = 0; i < 20000 && !rd; ++i) {
    t.step();
    REQUIRE(t.recv->test(m.r, &rd, &size, t.now) == Status::kOk);
  }
  REQUIRE(rd);
  t.wire.stall[0][0] = true;  // the final acknowledgement and everything after it waits
  t.run(200 * kUsPerMs);
  t.wire.stall[0][0] = false;
  for (int i = 0; i < 20000 && !sd; ++i) {
    t.step();
    REQUIRE(t.send->test(m.s, &sd, &size, t.now) == Status::kOk);
  }
  CHECK(sd);
  INFO(log.text());
  CHECK(log.count("failed (") == 0);
}

TEST_CASE("connection: a path cut mid-message is detected and its chunks replayed, exactly once",
          "[connection]") {
  for (bool nic : {false, true}) {
    for (bool replay : {true, false}) {
      INFO(shape_name(nic) << (replay ? "" : ", replay off (test hook no_replay)"));
      EventLog log;
      TestHooks hooks;
      hooks.replay = replay;
      Pair t(nic, 2,
             {{"R2CCL_ACK_TIMEOUT", "20ms"},
              {"R2CCL_PATH_WINDOW", "256K"},
              {"R2CCL_CHUNK_SIZE", "64K"}},
             hooks);
      Message m(t, 4 << 20, 2);
      t.run(300);  // some chunks are in flight on path 0
      t.wire.cut[0] = true;
      t.wire.refuse[0] = true;  // no failback during the test
      bool done = false;
      REQUIRE(t.wait(m.s, m.r, 2 * kUsPerSec, &done) == Status::kOk);
      if (!replay) {
        CHECK_FALSE(done);  // what was lost on path 0 is never sent again
        continue;
      }
      CHECK(done);
      CHECK(m.dst == m.src);
      INFO(log.text());
      CHECK(log.count("path on rail mem0 failed (acknowledgement timeout") == 1);
      CHECK(log.count("switchover: rail mem0 failed") == 1);
      const auto lost = test::to_replay_counts(log.text());
      const auto rec = test::replayed_counts(log.text());
      REQUIRE(lost.size() == 1);
      REQUIRE(rec.size() == 1);
      CHECK(lost[0] > 0);
      CHECK(rec[0] == lost[0]);
      CHECK(t.srails.live(1).chunks_replayed.load() == static_cast<uint64_t>(lost[0]));
      CHECK(t.send->path_state(0) == PathState::kFailed);
      CHECK(t.recv->path_state(0) == PathState::kFailed);  // told by the FAIL notice
    }
  }
}

TEST_CASE("connection: stripe off, a failed primary's traffic spreads over every survivor",
          "[connection]") {
  // R2CCL_FAILOVER_SPREAD=1: both backups carry the failed primary's chunks;
  // 0 (the default for now): the first backup alone, as before.
  for (bool spread : {true, false}) {
    INFO("R2CCL_FAILOVER_SPREAD=" << spread);
    EventLog log;
    Pair t(false, 3,
           {{"R2CCL_ACK_TIMEOUT", "20ms"},
            {"R2CCL_PATH_WINDOW", "256K"},
            {"R2CCL_CHUNK_SIZE", "64K"},
            {"R2CCL_FAILOVER_SPREAD", spread ? "1" : "0"}});
    Message m(t, 8 << 20, 3);
    t.run(300);  // chunks in flight on path 0 only (the fault-free default is unchanged)
    CHECK(t.wire.chunks_posted[0] > 0);
    CHECK(t.wire.chunks_posted[1] == 0);
    CHECK(t.wire.chunks_posted[2] == 0);
    t.wire.cut[0] = true;
    t.wire.refuse[0] = true;
    REQUIRE(arrives(t, m, 2 * kUsPerSec));
    CHECK(log.count("switchover: rail mem0 failed") == 1);
    CHECK(t.wire.chunks_posted[1] > 0);
    if (spread) {
      CHECK(t.wire.chunks_posted[2] > 0);
      // Equal survivors share about equally.
      const double a = static_cast<double>(t.wire.chunks_posted[1]);
      const double b = static_cast<double>(t.wire.chunks_posted[2]);
      CHECK(a / (a + b) == Approx(0.5).margin(0.15));
    } else {
      CHECK(t.wire.chunks_posted[2] == 0);
    }
  }
}

TEST_CASE("connection: verbs-shaped replay waits for the receiver's quiesce (the gate)",
          "[connection]") {
  for (bool bilateral : {true, false}) {
    INFO(std::string(bilateral ? "gate on" : "gate off (test hook no_bilateral_err)"));
    EventLog log;
    TestHooks hooks;
    hooks.bilateral_err = bilateral;
    Pair t(
        true, 2,
        {{"R2CCL_ACK_TIMEOUT", "20ms"}, {"R2CCL_PATH_WINDOW", "256K"}, {"R2CCL_CHUNK_SIZE", "64K"}},
        hooks);
    Message m(t, 4 << 20, 3);
    t.run(300);
    t.wire.cut[0] = true;
    t.wire.refuse[0] = true;
    // Until the receiver's FAIL_ACK arrives nothing of path 0 is replayed (new chunks may go
    // to path 1 meanwhile): run to just after the sender's detection and look.
    for (int i = 0; i < 100000 && log.count("path on rail mem0 failed") == 0; ++i) t.step();
    INFO(log.text());
    CHECK((log.count("replay waits for the receiver") == 1) == bilateral);
    CHECK((t.srails.live(1).chunks_replayed.load() == 0) == bilateral);
    CHECK(arrives(t, m, 2 * kUsPerSec));
    CHECK(log.count("switchover: rail mem0 failed") == 1);
  }
}

TEST_CASE("connection: a lost FAIL_ACK makes the notice go again until answered", "[connection]") {
  EventLog log;
  Pair t(
      false, 2,
      {{"R2CCL_ACK_TIMEOUT", "20ms"}, {"R2CCL_PATH_WINDOW", "256K"}, {"R2CCL_CHUNK_SIZE", "64K"}});
  t.wire.fail_acks_dropped = 2;
  Message m(t, 2 << 20, 4);
  t.run(300);
  t.wire.cut[0] = true;
  t.wire.refuse[0] = true;
  CHECK(arrives(t, m, 2 * kUsPerSec));
  t.run(kUsPerSec);  // several heartbeat periods: re-sent every 2
  int fails = 0;
  for (const auto& c : t.sio().sent_ctrl) fails += c.type == CtrlType::kFail;
  CHECK(fails >= 3);  // the first two answers were lost
  CHECK(t.wire.fail_acks_dropped == 0);
  const int after = fails;
  t.run(kUsPerSec);
  fails = 0;
  for (const auto& c : t.sio().sent_ctrl) fails += c.type == CtrlType::kFail;
  CHECK(fails == after);  // answered: no more re-sends
}

TEST_CASE(
    "connection: a silent backup path fails by the heartbeat rule, not while the transport "
    "still hears the peer",
    "[connection]") {
  for (bool transport_hears : {false, true}) {
    INFO(std::string(transport_hears ? "the transport below still hears the peer" : "silent"));
    EventLog log;
    Pair t(false, 2, {{"R2CCL_HEARTBEAT_INTERVAL", "10ms"}});
    if (transport_hears) t.sio().heard = t.rio().heard = 0;
    t.run(50 * kUsPerMs);
    t.wire.cut[1] = true;
    t.wire.refuse[1] = true;
    t.run(19 * kUsPerMs);  // the last sign of life was at most 1 period before: under 3
    CHECK(t.send->path_state(1) == PathState::kHealthy);
    t.run(30 * kUsPerMs);
    INFO(log.text());
    if (transport_hears) {
      CHECK(t.send->path_state(1) == PathState::kHealthy);
      continue;
    }
    CHECK(t.send->path_state(1) == PathState::kFailed);
    CHECK(log.count("path on rail mem1 failed (heartbeat miss") >= 1);
    CHECK(log.count("backup path on rail mem1 failed") == 1);  // it carried nothing
    CHECK(log.count("switchover") == 0);
  }
}

TEST_CASE(
    "connection: a peer-caused path failure is charged to its rail only once the peer "
    "shows it is alive",
    "[connection]") {
  // End of file on a path: the peer's process may have died (then no rail is to blame, and
  // the rail's failed_paths, paths_failed and switchovers stay untouched) or something broke
  // that one path (then the peer keeps talking on its other path, and the rail is charged).
  for (bool peer_alive : {true, false}) {
    INFO((peer_alive ? "the peer keeps beating on path 1" : "the peer falls silent everywhere"));
    EventLog log;
    Pair t(false, 2,
           {{"R2CCL_ACK_TIMEOUT", "20ms"},
            {"R2CCL_HEARTBEAT_INTERVAL", "10ms"},
            {"R2CCL_FAILOVER_TIMEOUT", "10s"}});
    Message m(t, 4 << 20, 9);
    t.run(300);               // chunks in flight on path 0
    t.wire.refuse[0] = true;  // no reconnect of path 0 during the test
    if (!peer_alive) {
      t.wire.cut[1] = true;
      t.wire.refuse[1] = true;
    }
    t.send->on_path_error(0, FailCause::kPeerClosed, "end of file", t.now);
    t.run(5 * kUsPerMs);
    INFO(log.text());
    CHECK(t.send->path_state(0) == PathState::kFailed);
    CHECK(log.count("path on rail mem0 failed (peer closed the connection") == 1);
    CHECK(t.srails.live(0).failed_paths.load() == 0);  // not yet: nobody knows who is to blame
    CHECK(t.srails.live(0).paths_failed.load() == 0);
    t.run(100 * kUsPerMs);  // 10 heartbeat periods
    if (peer_alive) {
      CHECK(t.srails.live(0).failed_paths.load() == 1);
      CHECK(t.srails.live(0).paths_failed.load() == 1);
      CHECK(t.srails.live(0).switchovers.load() == 1);
    } else {
      CHECK(t.srails.live(0).failed_paths.load() == 0);
      CHECK(t.srails.live(0).paths_failed.load() == 0);
      CHECK(t.srails.live(0).switchovers.load() == 0);
    }
  }
}

TEST_CASE("connection: a failed path comes back after its probes and carries traffic again",
          "[connection]") {
  EventLog log;
  Pair t(false, 2, {{"R2CCL_ACK_TIMEOUT", "20ms"}, {"R2CCL_PROBE_COUNT", "3"}});
  t.run(10 * kUsPerMs);
  t.sio().reset(0, *t.send, t.now);  // path 0 resets at the sender
  t.run(5 * kUsPerMs);
  CHECK(t.send->path_state(0) != PathState::kHealthy);
  t.run(500 * kUsPerMs);  // reconnect backoff (50 ms), 3 probes
  INFO(log.text());
  CHECK(t.send->path_state(0) == PathState::kHealthy);
  CHECK(log.count("failback: rail mem0 is back") == 1);
  CHECK(t.srails.live(0).failed_paths.load() == 0);
  CHECK(t.rrails.live(0).failed_paths.load() == 0);
  // Traffic goes back to the primary.
  const int before = t.wire.chunks_posted[0];
  Message m(t, 1 << 20, 5);
  CHECK(arrives(t, m, kUsPerSec));
  CHECK(t.wire.chunks_posted[0] > before);
}

TEST_CASE(
    "connection: with no path left requests fail after R2CCL_FAILOVER_TIMEOUT, at once when "
    "every reconnect is refused",
    "[connection]") {
  for (bool refused : {false, true}) {
    INFO(std::string(refused ? "the peer's process is gone (reconnects refused)" : "rails down"));
    EventLog log;
    Pair t(false, 2,
           {{"R2CCL_ACK_TIMEOUT", "20ms"},
            {"R2CCL_FAILOVER_TIMEOUT", "1s"},
            {"R2CCL_PATH_WINDOW", "256K"},
            {"R2CCL_CHUNK_SIZE", "64K"}});
    Message m(t, 2 << 20, 6);
    t.run(300);
    for (int p = 0; p < 2; ++p) {
      t.wire.cut[p] = true;
      t.wire.refuse[p] = refused;
      t.sio().reset(p, *t.send, t.now);
    }
    // The sender fails within the timeout (+ a margin for the reconnect attempts), never
    // before it when only the rails are down.
    const TimeUs t0 = t.now;
    int sd = 0, size = 0;
    Status st = Status::kOk;
    while (st == Status::kOk && t.now - t0 < 3 * kUsPerSec) {
      t.step();
      st = t.send->test(m.s, &sd, &size, t.now);
    }
    INFO(log.text());
    CHECK(sd == 0);
    if (refused) {
      CHECK(st == Status::kRemote);
      CHECK(t.now - t0 < 500 * kUsPerMs);
      CHECK(log.count("a reconnect was refused") == 1);
    } else {
      CHECK(st == Status::kSystem);
      CHECK(t.now - t0 >= 1 * kUsPerSec);
      CHECK(t.now - t0 < 1200 * kUsPerMs);
    }
    CHECK(log.count("give-up: send conn") == 1);
  }
}

TEST_CASE("connection: a duplicate chunk is discarded and counted, the receive completes once",
          "[connection]") {
  // Replay crossing the original: the receiver sees chunk 0 twice (receiver places), or the
  // NIC places it twice.
  for (bool nic : {false, true}) {
    INFO(shape_name(nic));
    Pair t(nic);
    Message m(t, 256 * 1024, 7);
    // Copy the first chunk in flight and deliver it again right after.
    Item copy;
    bool have = false;
    for (int i = 0; i < 100 && !have; ++i) {
      for (const auto& it : t.wire.to[1])
        if (it.kind == Item::kChunk && it.chunk.idx == 0) {
          copy = it;
          have = true;
        }
      if (!have) t.step();
    }
    REQUIRE(have);
    copy.at += 50;
    t.wire.to[1].push_back(copy);
    CHECK(arrives(t, m, 100 * kUsPerMs));
    CHECK(t.rrails.live(0).discarded_chunks.load() == 1);
  }
}

TEST_CASE("connection: a receiver's drained rail moves the sender's chunks off it",
          "[connection]") {
  EventLog log;
  Pair t(false);
  t.rrails.live(0).predict_drain = true;  // the receiver's node drains rail 0: only DRAIN tells
  t.run(10 * kUsPerMs);
  CHECK(log.count("r2ccl predict: the peer drains its end of path 0") == 1);
  Message m(t, 1 << 20, 8);
  CHECK(arrives(t, m, 100 * kUsPerMs));
  CHECK(t.wire.chunks_posted[0] == 0);
  CHECK(t.wire.chunks_posted[1] > 0);
}

TEST_CASE(
    "connection: a message goes only on the paths both ends' registrations allow, replays "
    "included; with none of them usable it fails like a connection without a path",
    "[connection]") {
  for (bool nic : {false, true}) {
    INFO(shape_name(nic));
    EventLog log;
    Pair t(nic, 3,
           {{"R2CCL_ACK_TIMEOUT", "20ms"},
            {"R2CCL_FAILOVER_TIMEOUT", "500ms"},
            {"R2CCL_STRIPE", "1"},
            {"R2CCL_PATH_WINDOW", "256K"},
            {"R2CCL_CHUNK_SIZE", "64K"}});
    // The receiver's buffers may not come through path 1, the sender's not through path 2.
    t.rio().allowed = 0b101;
    t.sio().allowed = 0b011;
    {
      Message m(t, 2 << 20, 7);
      t.run(300);  // chunks in flight on path 0
      t.wire.cut[0] = true;
      t.wire.refuse[0] = true;
      bool done = false;
      // Only path 0 may carry it: its failure strands the message, which fails (the send's
      // test() reports the give-up).
      CHECK(t.wait(m.s, m.r, 3 * kUsPerSec, &done) == Status::kSystem);
      CHECK_FALSE(done);
    }
    INFO(log.text());
    CHECK(t.wire.chunks_posted[1] == 0);
    CHECK(t.wire.chunks_posted[2] == 0);
    CHECK(log.count("give-up: send conn") == 1);
    CHECK(log.count("no usable path may carry message 0 within R2CCL_FAILOVER_TIMEOUT: its "
                    "buffers allow only path(s) 0") == 1);
    CHECK(log.count("usable: path(s) 1, 2") == 1);
    CHECK(t.send->error() == Status::kSystem);
  }
  for (bool nic : {false, true}) {
    INFO(shape_name(nic) << ": an allowed backup is left");
    Pair t(nic, 3,
           {{"R2CCL_ACK_TIMEOUT", "20ms"},
            {"R2CCL_STRIPE", "1"},
            {"R2CCL_PATH_WINDOW", "256K"},
            {"R2CCL_CHUNK_SIZE", "64K"}});
    t.rio().allowed = 0b101;
    Message m(t, 4 << 20, 8);
    t.run(300);
    t.wire.cut[0] = true;
    t.wire.refuse[0] = true;
    CHECK(arrives(t, m, 3 * kUsPerSec));  // replayed on path 2, the only other allowed one
    CHECK(t.wire.chunks_posted[1] == 0);
    CHECK(t.wire.chunks_posted[2] > 0);
  }
}

TEST_CASE("path plan: primary, then backups nearest first; peers paired by score, unused first",
          "[connection][path_plan]") {
  // Distance: rail 3 is nearest, then 1; rail 2 is unusable.
  auto d = [](int r) { return r == 3 ? 0 : r == 1 ? 1 : r == 2 ? -1 : 5; };
  CHECK(order_rails(0, 4, 3, d) == std::vector<int>{0, 3, 1});
  CHECK(order_rails(2, 4, 4, d) == std::vector<int>{2, 3, 1, 0});
  CHECK(order_rails(0, 4, 1, d) == std::vector<int>{0});
  // Ties keep device order after the primary.
  CHECK(order_rails(1, 4, 4, [](int) { return 0; }) == std::vector<int>{1, 2, 3, 0});
  CHECK(order_rails(5, 4, 2, d).empty());  // no such primary
  // Pairing: same index preferred (score 2), any compatible (1), incompatible (0).
  auto score = [](int l, int p) { return p == 3 ? 0 : p == l ? 2 : 1; };
  auto pairs = pair_rails(3, 4, false, score);
  REQUIRE(pairs.size() == 3);
  CHECK(pairs[0].peer == 0);
  CHECK(pairs[1].peer == 1);
  CHECK(pairs[2].peer == 2);
  // Without reuse a local rail with nothing left unpaired is left out; with reuse it shares.
  auto only0 = [](int, int p) { return p == 0 ? 1 : 0; };
  CHECK(pair_rails(2, 2, false, only0).size() == 1);
  auto shared = pair_rails(2, 2, true, only0);
  REQUIRE(shared.size() == 2);
  CHECK(shared[1].peer == 0);
}

// ------------------------------------------------------------------------------------------
// Eager messages (receiver places, PathCaps::eager): threshold 4 KiB, chunk 64 KiB.

namespace {

constexpr uint64_t kEagerThr = 4096;

// Sends `n` bytes; true when the isend was accepted within `tries` passes.
Request* isend_now(Pair& t, const std::vector<char>& src, int tries = 1) {
  Request* s = nullptr;
  for (int i = 0; i < tries && !s; ++i) {
    REQUIRE(t.send->isend(const_cast<char*>(src.data()), src.size(), 0, nullptr, &s, t.now) ==
            Status::kOk);
    if (!s) t.step();
  }
  return s;
}

bool test_done(Connection& c, Request* r, TimeUs now, int* size = nullptr) {
  int d = 0, sz = 0;
  REQUIRE(c.test(r, &d, &sz, now) == Status::kOk);
  if (size) *size = sz;
  return d != 0;
}

}  // namespace

TEST_CASE("connection: an eager isend goes without a CTS; the irecv posted later gets its bytes",
          "[connection][eager]") {
  for (bool copy : {true, false}) {
    INFO((copy ? "R2CCL_EAGER_COPY=1" : "R2CCL_EAGER_COPY=0"));
    Pair t(false, 2, {{"R2CCL_EAGER_COPY", copy ? "1" : "0"}}, {}, kEagerThr);
    REQUIRE(t.send->eager_threshold() == kEagerThr);
    for (uint64_t n : {uint64_t{0}, uint64_t{8}, kEagerThr - 1, kEagerThr}) {
      INFO("size " << n);
      const int cts_before = t.wire.cts_posted;
      auto src = pattern(n, n + 1);
      Request* s = isend_now(t, src);  // no irecv posted: a rendezvous isend would wait
      REQUIRE(s != nullptr);
      if (copy) {
        CHECK(test_done(*t.send, s, t.now));   // completes on the copy, before any ACK
        std::fill(src.begin(), src.end(), 0);  // NCCL may reuse its buffer at once
        src = pattern(n, n + 1);
      }
      t.run(2 * kUsPerMs);  // stored in the receiver's eager area, acknowledged
      if (!copy) CHECK(test_done(*t.send, s, t.now));  // the stored copy was acknowledged
      CHECK(t.send->pending_requests() == 0);
      std::vector<char> dst(n + 100, 0);
      Request* r = nullptr;
      REQUIRE(t.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, t.now) == Status::kOk);
      REQUIRE(r != nullptr);
      int size = -1;
      CHECK(test_done(*t.recv, r, t.now, &size));  // from the area, at once
      CHECK(size == static_cast<int>(n));
      CHECK(std::equal(src.begin(), src.end(), dst.begin()));
      t.run(kUsPerMs);
      CHECK(t.wire.cts_posted == cts_before);  // no CTS for a message already there
    }
  }
}

TEST_CASE("connection: eager sizes around the threshold, irecv posted first or not",
          "[connection][eager]") {
  Pair t(false, 2, {}, {}, kEagerThr);
  uint64_t seed = 100;
  for (bool irecv_first : {true, false}) {
    for (uint64_t n : {kEagerThr - 1, kEagerThr, kEagerThr + 1, uint64_t{20000}}) {
      INFO("size " << n << (irecv_first ? ", irecv first" : ", isend first"));
      const bool eager = n <= kEagerThr;
      auto src = pattern(n, ++seed);
      std::vector<char> dst(n, 0);
      Request *s = nullptr, *r = nullptr;
      if (irecv_first) REQUIRE(t.recv->irecv(dst.data(), n, 0, nullptr, &r, t.now) == Status::kOk);
      s = isend_now(t, src);
      if (eager) CHECK(s != nullptr);
      if (!eager && !irecv_first) CHECK(s == nullptr);  // waits for the CTS
      if (!irecv_first) REQUIRE(t.recv->irecv(dst.data(), n, 0, nullptr, &r, t.now) == Status::kOk);
      if (!s) s = isend_now(t, src, 1000);
      REQUIRE(s != nullptr);
      REQUIRE(r != nullptr);
      bool done = false;
      REQUIRE(t.wait(s, r, 100 * kUsPerMs, &done) == Status::kOk);
      CHECK(done);
      CHECK(dst == src);
    }
  }
  t.run(kUsPerMs);
  CHECK(t.rrails.live(0).discarded_chunks.load() == 0);
}

TEST_CASE("connection: eager credit bounds what the sender sends before the receiver consumes",
          "[connection][eager]") {
  Pair t(false, 2, {}, {}, kEagerThr);
  const uint64_t area = t.send->eager_area();
  REQUIRE(area == t.recv->eager_area());
  const uint64_t cost = kEagerThr + 256;
  // The receiver posts nothing: the sender sends until its credit is spent, then waits.
  std::vector<std::vector<char>> srcs;
  int sent = 0;
  for (int i = 0; i < 1000; ++i) {
    srcs.push_back(pattern(kEagerThr, 500 + i));
    Request* s = isend_now(t, srcs.back(), 20);
    if (!s) {
      srcs.pop_back();
      break;
    }
    CHECK(test_done(*t.send, s, t.now));
    ++sent;
  }
  CHECK(sent == static_cast<int>(area / cost));
  CHECK(t.send->path_state(0) == PathState::kHealthy);  // the receiver accepted all of it
  // The receiver consumes them in order; the credit returns and the next one goes.
  for (int i = 0; i < sent; ++i) {
    std::vector<char> dst(kEagerThr);
    Request* r = nullptr;
    REQUIRE(t.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, t.now) == Status::kOk);
    REQUIRE(r != nullptr);
    CHECK(test_done(*t.recv, r, t.now));
    CHECK(dst == srcs[static_cast<size_t>(i)]);
  }
  t.run(2 * kUsPerMs);
  auto more = pattern(kEagerThr, 9);
  CHECK(isend_now(t, more) != nullptr);
}

TEST_CASE(
    "connection: eager messages cut mid-flight are replayed on a survivor (not without "
    "replay)",
    "[connection][eager]") {
  for (bool replay : {true, false}) {
    INFO((replay ? "replay on" : "replay off (test hook no_replay)"));
    EventLog log;
    TestHooks hooks;
    hooks.replay = replay;
    Pair t(false, 2, {{"R2CCL_ACK_TIMEOUT", "20ms"}}, hooks, kEagerThr);
    constexpr int kN = 8;
    std::vector<std::vector<char>> srcs, dsts(kN, std::vector<char>(kEagerThr, 0));
    std::vector<Request*> rs(kN, nullptr);
    for (int i = 0; i < kN / 2; ++i)  // half posted before, half after the data arrives
      REQUIRE(t.recv->irecv(dsts[i].data(), kEagerThr, 0, nullptr, &rs[i], t.now) == Status::kOk);
    t.run(kUsPerMs);
    t.wire.cut[0] = true;  // everything sent from now on path 0 is lost
    t.wire.refuse[0] = true;
    for (int i = 0; i < kN; ++i) {
      srcs.push_back(pattern(kEagerThr, 700 + i));
      Request* s = isend_now(t, srcs.back());
      REQUIRE(s != nullptr);
      CHECK(test_done(*t.send, s, t.now));  // complete on the copy
    }
    for (int i = kN / 2; i < kN; ++i)
      REQUIRE(t.recv->irecv(dsts[i].data(), kEagerThr, 0, nullptr, &rs[i], t.now) == Status::kOk);
    bool all = false;
    for (TimeUs end = t.now + 2 * kUsPerSec; t.now < end && !all;) {
      t.step();
      all = true;
      for (int i = 0; i < kN; ++i) {
        if (!rs[i]) continue;
        int d = 0, sz = 0;
        REQUIRE(t.recv->test(rs[i], &d, &sz, t.now) == Status::kOk);
        if (d) rs[i] = nullptr;
        all &= d != 0;
      }
    }
    if (!replay) {
      CHECK_FALSE(all);  // what was lost on path 0 is never sent again
      continue;
    }
    CHECK(all);
    for (int i = 0; i < kN; ++i) CHECK(dsts[i] == srcs[i]);
    INFO(log.text());
    CHECK(log.count("switchover: rail mem0 failed") == 1);
    CHECK(t.srails.live(1).chunks_replayed.load() == static_cast<uint64_t>(kN));
    t.run(10 * kUsPerMs);
    CHECK_FALSE(t.send->eager_unacked());
  }
}

TEST_CASE("connection: a duplicate eager message is discarded, in the area or after delivery",
          "[connection][eager]") {
  Pair t(false, 2, {}, {}, kEagerThr);
  auto src = pattern(1000, 3);
  REQUIRE(isend_now(t, src) != nullptr);
  Item copy;
  for (const auto& it : t.wire.to[1])
    if (it.kind == Item::kChunk) copy = it;
  REQUIRE(copy.chunk.eager);
  t.run(kUsPerMs);
  copy.at = t.now;
  t.wire.to[1].push_back(copy);  // a replay crossing the stored original
  t.run(kUsPerMs);
  CHECK(t.rrails.live(0).discarded_chunks.load() == 1);
  std::vector<char> dst(1000);
  Request* r = nullptr;
  REQUIRE(t.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, t.now) == Status::kOk);
  CHECK(test_done(*t.recv, r, t.now));
  CHECK(dst == src);
  copy.at = t.now;
  t.wire.to[1].push_back(copy);  // and one after the receive completed
  t.run(kUsPerMs);
  CHECK(t.rrails.live(0).discarded_chunks.load() == 2);
  CHECK(t.send->path_state(0) == PathState::kHealthy);
}

TEST_CASE("connection: lying eager headers are protocol errors, never writes",
          "[connection][eager]") {
  Pair t(false, 2, {}, {}, kEagerThr);
  auto hdr = [](uint64_t seq, uint64_t len) {
    ChunkHeader h{seq, 0, len, 0, 1, static_cast<uint32_t>(len), true};
    return h;
  };
  struct Case {
    const char* what;
    ChunkHeader h;
    const char* why;
  };
  ChunkHeader split = hdr(0, 100);
  split.nchunks = 2;
  ChunkHeader offset = hdr(0, 100);
  offset.offset = 8;
  offset.len = 92;
  const Case cases[] = {
      {"larger than the threshold", hdr(0, kEagerThr + 1), "larger than the negotiated"},
      {"not one whole message", split, "not one whole message"},
      {"an offset", offset, "not one whole message"},
      {"far ahead of the receives", hdr(1u << 20, 100), "too far ahead"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    const ChunkPlace pl = t.recv->on_chunk_header(0, c.h, t.now);
    CHECK(pl.action == ChunkPlace::Action::kProtocolError);
    CHECK(std::string(pl.why ? pl.why : "").find(c.why) != std::string::npos);
  }
  // Beyond the credit: the area fills to its size, then the next one is refused.
  const uint64_t cost = kEagerThr + 256;
  uint64_t seq = 0;
  for (; (seq + 1) * cost <= t.recv->eager_area(); ++seq) {
    const ChunkPlace pl = t.recv->on_chunk_header(0, hdr(seq, kEagerThr), t.now);
    REQUIRE(pl.action == ChunkPlace::Action::kRead);
    REQUIRE(pl.area);
  }
  const ChunkPlace over = t.recv->on_chunk_header(0, hdr(seq, kEagerThr), t.now);
  CHECK(over.action == ChunkPlace::Action::kProtocolError);
  CHECK(std::string(over.why).find("beyond the receiver's eager credit") != std::string::npos);
  // A connection without eager messages refuses an eager header.
  Pair off(false, 2);
  const ChunkPlace pl = off.recv->on_chunk_header(0, hdr(0, 8), off.now);
  CHECK(pl.action == ChunkPlace::Action::kProtocolError);
}

TEST_CASE("connection: a small irecv posts its CTS only if its eager message is late",
          "[connection][eager]") {
  // A receive no larger than the threshold expects its message eagerly: no CTS (a frame each
  // way per message) unless it still waits after 1 ms.
  Pair t(false, 2, {}, {}, kEagerThr);
  auto src = pattern(kEagerThr, 11);
  std::vector<char> dst(kEagerThr, 0);
  Request* r = nullptr;
  REQUIRE(t.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, t.now) == Status::kOk);
  t.run(500);
  CHECK(t.wire.cts_posted == 0);
  Request* s = isend_now(t, src);
  REQUIRE(s != nullptr);
  bool done = false;
  REQUIRE(t.wait(s, r, 10 * kUsPerMs, &done) == Status::kOk);
  CHECK(done);
  CHECK(dst == src);
  t.run(2 * kUsPerMs);
  CHECK(t.wire.cts_posted == 0);
  // Nothing comes for 1 ms: the CTS goes (once); the message still arrives.
  REQUIRE(t.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, t.now) == Status::kOk);
  t.run(2 * kUsPerMs);
  CHECK(t.wire.cts_posted == 1);
  src = pattern(kEagerThr, 12);
  s = isend_now(t, src);
  REQUIRE(s != nullptr);
  REQUIRE(t.wait(s, r, 10 * kUsPerMs, &done) == Status::kOk);
  CHECK(done);
  CHECK(dst == src);
  CHECK(t.wire.cts_posted == 1);
}

TEST_CASE("connection: acknowledgements of eager messages completed on their copy go together",
          "[connection][eager]") {
  // R2CCL_EAGER_COPY=1: the isend completed on the copy, so the receiver holds the ACK of a
  // consumed message back (200 us, or half the area's credit) and sends the held ones at once;
  // 0: NCCL's request waits for the ACK, which goes in the pass that completed the receive.
  for (bool copy : {true, false}) {
    INFO((copy ? "R2CCL_EAGER_COPY=1" : "R2CCL_EAGER_COPY=0"));
    Pair t(false, 2, {{"R2CCL_EAGER_COPY", copy ? "1" : "0"}}, {}, kEagerThr);
    constexpr int kN = 4;
    std::vector<std::vector<char>> srcs, dsts(kN, std::vector<char>(1000, 0));
    std::vector<Request*> rs(kN, nullptr);
    for (int i = 0; i < kN; ++i)
      REQUIRE(t.recv->irecv(dsts[i].data(), 1000, 0, nullptr, &rs[i], t.now) == Status::kOk);
    for (int i = 0; i < kN; ++i) {
      srcs.push_back(pattern(1000, 40 + i));
      REQUIRE(isend_now(t, srcs.back()) != nullptr);
    }
    auto acks = [&] {
      return std::count_if(t.rio().sent_ctrl.begin(), t.rio().sent_ctrl.end(),
                           [](const CtrlMsg& m) { return m.type == CtrlType::kAck; });
    };
    int done = 0;
    TimeUs done_at = 0;
    long acks_at_done = -1;
    for (TimeUs end = t.now + 10 * kUsPerMs; t.now < end && done < kN;) {
      t.step();
      for (auto& r : rs)
        if (r && test_done(*t.recv, r, t.now)) {
          r = nullptr;
          ++done;
        }
    }
    REQUIRE(done == kN);
    done_at = t.now;
    acks_at_done = acks();
    for (int i = 0; i < kN; ++i) CHECK(std::equal(srcs[i].begin(), srcs[i].end(), dsts[i].begin()));
    if (!copy) {
      CHECK(acks_at_done == kN);
      continue;
    }
    CHECK(acks_at_done == 0);
    TimeUs acked_at = 0;
    while (t.now < done_at + 2 * kUsPerMs && !acked_at) {
      t.step();
      if (acks() == kN) acked_at = t.now;  // all in one pass: 0, then kN
      REQUIRE((acks() == 0 || acks() == kN));
    }
    REQUIRE(acked_at);
    CHECK(acked_at - done_at >= 200 - kStep);
    CHECK(acked_at - done_at <= 200 + kStep);
    t.run(kUsPerMs);
    CHECK_FALSE(t.send->eager_unacked());  // every copy released
  }
}

TEST_CASE("connection: a rendezvous isend against a small irecv fails as truncated, never waits",
          "[connection][eager]") {
  // The caller's error NCCL never makes: the sender holds more than the threshold, the
  // receiver posted less. The small irecv's late CTS carries its capacity, so both fail as
  // truncated instead of waiting for a CTS without end.
  EventLog log;
  Pair t(false, 2, {}, {}, kEagerThr);
  auto src = pattern(3 * kEagerThr, 13);
  std::vector<char> dst(1000, 0);
  Request* r = nullptr;
  REQUIRE(t.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, t.now) == Status::kOk);
  Request* s = nullptr;
  Status st = Status::kOk;
  for (TimeUs end = t.now + 50 * kUsPerMs; t.now < end && st == Status::kOk;) {
    st = t.send->isend(src.data(), src.size(), 0, nullptr, &s, t.now);
    t.step();
  }
  CHECK(st == Status::kInternal);
  t.run(kUsPerMs);
  CHECK(t.recv->error() == Status::kInternal);
  CHECK(std::all_of(dst.begin(), dst.end(), [](char c) { return c == 0; }));
  INFO(log.text());
  CHECK(log.count("(truncated)") >= 1);
}

TEST_CASE("connection: an eager isend larger than the irecv fails both as truncated",
          "[connection][eager]") {
  for (bool irecv_first : {true, false}) {
    INFO((irecv_first ? "irecv first" : "isend first"));
    EventLog log;
    Pair t(false, 2, {}, {}, kEagerThr);
    auto src = pattern(2000, 5);
    std::vector<char> dst(1000, 0);
    Request* r = nullptr;
    if (irecv_first) {
      REQUIRE(t.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, t.now) == Status::kOk);
      t.step();  // the CTS is on its way, not there yet
    }
    REQUIRE(isend_now(t, src) != nullptr);
    t.run(kUsPerMs);
    if (!irecv_first) (void)t.recv->irecv(dst.data(), dst.size(), 0, nullptr, &r, t.now);
    t.run(kUsPerMs);
    CHECK(t.recv->error() == Status::kInternal);
    CHECK(std::all_of(dst.begin(), dst.end(), [](char c) { return c == 0; }));
    INFO(log.text());
    CHECK(log.count("(truncated)") == 1);
  }
}
