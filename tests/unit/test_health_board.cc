// The health board (common/include/r2ccl/health_board.h): roundtrip, concurrent writers from
// several processes against a reader (no torn read is ever returned), a writer killed
// mid-write, slot reclaim, corrupt/truncated/wrong-version segments (a version-1 board
// included), the agreed record across processes, the predictor's sampler block (election
// across processes, takeover of a dead or hung sampler, risks round trip, torn and corrupt
// blocks), name validation, and the r2ccl_status tool. Every test uses its own board name and
// removes it at the end.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "r2ccl/clock.h"
#include "r2ccl/health_board.h"
#include "r2ccl/rail_stats.h"
#include "transport/factory.h"

namespace r2ccl::board {
// Test peer: publishes a slot but leaves its sequence odd, as a writer killed mid-write does.
class PublisherTestPeer {
 public:
  static bool publish_unfinished(Publisher& p, int rail, const RailFields& f) {
    std::lock_guard<std::mutex> g(p.mu_);
    return p.write_locked(rail, f, false);
  }
  // Writes the sampler block but leaves its sequence odd.
  static bool publish_risks_unfinished(Publisher& p, const std::vector<RiskEntry>& rails) {
    std::lock_guard<std::mutex> g(p.mu_);
    return p.write_sampler_locked(rails, r2ccl::now_us(), false);
  }
};
}  // namespace r2ccl::board

namespace {

using namespace r2ccl::board;

// A board name unique to this process and test; removed on scope exit.
struct TestBoard {
  std::string name;
  explicit TestBoard(const char* tag) : name("test-" + std::to_string(getpid()) + "-" + tag) {
    remove_board(name);
  }
  ~TestBoard() { remove_board(name); }
  std::string seg() const {
    std::string s, e;
    segment_name(name, &s, &e);
    return s;
  }
};

// Fields satisfying the invariant a reader checks: every counter derives from `k`.
RailFields fields_for(uint64_t k, int rail) {
  RailFields f;
  set_text(f.name, sizeof(f.name), "rail" + std::to_string(rail) + "-" + std::to_string(k));
  f.transport = rail % 2 ? Transport::kIb : Transport::kTcp;
  f.state = RailState::kUp;
  f.usable_mbps = static_cast<uint32_t>(k % 100000);
  f.bytes_sent = k * 7;
  f.chunks_sent = k;
  f.chunks_replayed = k / 3;
  f.switchovers = k + 1;
  f.failbacks = k + 2;
  f.paths_failed = k + 3;
  f.last_switchover_us = static_cast<int64_t>(k) * 11;
  set_text(f.cause, sizeof(f.cause), "cause-" + std::to_string(k));
  f.risk = static_cast<float>(k % 1000);
  return f;
}

bool consistent(const RailSlot& s) {
  const RailFields& f = s.f;
  uint64_t k = f.chunks_sent;
  std::string want_name = "rail" + std::to_string(s.rail) + "-" + std::to_string(k);
  return f.bytes_sent == k * 7 && f.chunks_replayed == k / 3 && f.switchovers == k + 1 &&
         f.failbacks == k + 2 && f.paths_failed == k + 3 &&
         f.last_switchover_us == static_cast<int64_t>(k) * 11 &&
         f.usable_mbps == static_cast<uint32_t>(k % 100000) && want_name == f.name &&
         std::string("cause-" + std::to_string(k)) == f.cause;
}

AgreedRecord agreed_for(uint64_t k) {
  AgreedRecord r;
  r.epoch = k;
  r.n_nodes = kMaxNodes;  // every member bit is a valid node id
  for (auto& w : r.members) w = k;
  for (auto& g : r.node_usable_gbps) g = static_cast<float>(k % 4096);
  return r;
}

bool agreed_consistent(const AgreedRecord& r) {
  if (r.epoch == 0) return r.n_nodes == 0;
  if (r.n_nodes != static_cast<uint32_t>(kMaxNodes)) return false;
  for (auto w : r.members)
    if (w != r.epoch) return false;
  for (auto g : r.node_usable_gbps)
    if (g != static_cast<float>(r.epoch % 4096)) return false;
  return true;
}

void write_at(const std::string& seg, off_t off, const void* data, size_t n) {
  int fd = shm_open(seg.c_str(), O_RDWR, 0);
  REQUIRE(fd >= 0);
  REQUIRE(pwrite(fd, data, n, off) == static_cast<ssize_t>(n));
  close(fd);
}

void truncate_to(const std::string& seg, off_t size) {
  int fd = shm_open(seg.c_str(), O_RDWR, 0);
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, size) == 0);
  close(fd);
}

SegmentHeader header_of(const std::string& seg) {
  SegmentHeader h{};
  int fd = shm_open(seg.c_str(), O_RDONLY, 0);
  REQUIRE(fd >= 0);
  REQUIRE(pread(fd, &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h)));
  close(fd);
  return h;
}

// The raw sampler block, bypassing the reader's checks (what is really in shared memory).
SamplerBlock raw_sampler(const std::string& seg) {
  SegmentHeader h = header_of(seg);
  SamplerBlock b;
  int fd = shm_open(seg.c_str(), O_RDONLY, 0);
  REQUIRE(fd >= 0);
  REQUIRE(pread(fd, &b, sizeof(b), h.sampler_offset) == static_cast<ssize_t>(sizeof(b)));
  close(fd);
  return b;
}

constexpr size_t kPayloadN = offsetof(SamplerBlock, p) + offsetof(SamplerPayload, n);
constexpr size_t kPayloadE = offsetof(SamplerBlock, p) + offsetof(SamplerPayload, e);

off_t sampler_field(const std::string& seg, size_t offset_in_block) {
  return static_cast<off_t>(header_of(seg).sampler_offset + offset_in_block);
}

// The risk of `rail` in `v`, or -2 when it has no entry (so a CHECK fails instead of crashing).
float risk_in(const SamplerView& v, const std::string& rail) {
  const RiskEntry* e = find_risk(v, rail);
  return e ? e->risk : -2;
}

RiskEntry risk_for(const std::string& rail, float risk, RiskSource src = RiskSource::kLstm,
                   float retrans = -1, bool drain = false, const std::string& top = "") {
  RiskEntry e;
  set_text(e.rail, sizeof(e.rail), rail);
  e.risk = risk;
  e.retransmit_ratio = retrans;
  e.source = src;
  e.drain = drain ? 1 : 0;
  set_text(e.top, sizeof(e.top), top);
  return e;
}

// A child process that runs `body` (its exit status) once the parent writes to `go`, and
// tells the parent through `ready` what `setup` returned. For sampler tests across processes.
struct Kid {
  pid_t pid = -1;
  int go = -1, ready = -1;
  template <class Setup, class Body>
  Kid(Setup setup, Body body) {
    int g[2], r[2];
    REQUIRE(pipe(g) == 0);
    REQUIRE(pipe(r) == 0);
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      close(g[1]);
      close(r[0]);
      char c = setup() ? 'y' : 'n';
      if (write(r[1], &c, 1) != 1) _exit(90);
      if (read(g[0], &c, 1) != 1) _exit(91);  // parent closed the pipe: just exit
      _exit(body());
    }
    close(g[0]);
    close(r[1]);
    go = g[1];
    ready = r[0];
  }
  char wait_ready() {
    char c = 0;
    REQUIRE(read(ready, &c, 1) == 1);
    return c;
  }
  int run_body() {  // releases the child's body and returns its exit status
    char c = 'g';
    REQUIRE(write(go, &c, 1) == 1);
    int st = 0;
    REQUIRE(waitpid(pid, &st, 0) == pid);
    pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  ~Kid() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    if (go >= 0) close(go);
    if (ready >= 0) close(ready);
  }
};

// The interval the sampler tests use: a sampler is hung after 10 of them (1 s).
constexpr int64_t kTestIntervalUs = 100 * r2ccl::kUsPerMs;

}  // namespace

TEST_CASE("board names are validated", "[board]") {
  std::string seg, err;
  REQUIRE(segment_name("default", &seg, &err));
  CHECK(seg == "/r2ccl-" + std::to_string(getuid()) + "-default");
  CHECK(segment_name("A-z_09", &seg, &err));
  CHECK(segment_name(std::string(64, 'x'), &seg, &err));
  for (const char* bad : {"", "a/b", "a b", "..", "x.y", "é"}) {
    err.clear();
    CHECK_FALSE(segment_name(bad, &seg, &err));
    CHECK(err.find("accepted names") != std::string::npos);
  }
  CHECK_FALSE(segment_name(std::string(65, 'x'), &seg, &err));
  AgreedRecord r;
  CHECK_FALSE(read_agreed_record("bad/name", &r, &err));
  Publisher p;
  CHECK_FALSE(p.open("bad/name", &err));
  CHECK_FALSE(p.is_open());
}

TEST_CASE("publish and read back; close releases the slots", "[board]") {
  TestBoard b("rt");
  std::string err;
  BoardView v;
  BoardError kind = BoardError::kNone;
  CHECK_FALSE(read_board(b.name, &v, &err, &kind));
  CHECK(kind == BoardError::kAbsent);
  CHECK(err.find("absent") != std::string::npos);

  Publisher p;
  REQUIRE(p.open(b.name, &err));
  CHECK(p.segment() == b.seg());
  REQUIRE(p.publish(0, fields_for(5, 0)));
  REQUIRE(p.publish(3, fields_for(9, 3)));
  REQUIRE(p.publish(0, fields_for(6, 0)));  // same slot again
  CHECK_FALSE(p.publish(-1, fields_for(1, 0)));
  CHECK_FALSE(p.publish(1 << 30, fields_for(1, 0)));
  REQUIRE(read_board(b.name, &v, &err));
  CHECK(v.segment == b.seg());
  CHECK(v.slot_count == kDefaultSlots);
  REQUIRE(v.rails.size() == 2);
  CHECK(v.torn_slots.empty());
  CHECK_FALSE(v.has_agreed);
  for (const auto& r : v.rails) {
    CHECK(r.pid == getpid());
    CHECK(consistent(r));
    CHECK(r.publish_us > 0);
    CHECK(r.publish_us <= r2ccl::now_us());
  }
  CHECK(v.rails[0].rail == 0);
  CHECK(v.rails[0].f.chunks_sent == 6);
  CHECK(v.rails[1].rail == 3);
  CHECK(v.rails[1].f.transport == Transport::kIb);
  CHECK(std::string(transport_name(v.rails[1].f.transport)) == "ib");
  CHECK(std::string(state_name(RailState::kDraining)) == "draining");

  // An existing board without an agreed record: true, epoch 0.
  AgreedRecord r;
  r.epoch = 77;
  REQUIRE(read_agreed_record(b.name, &r, &err));
  CHECK(r.epoch == 0);

  p.close();
  CHECK_FALSE(p.publish(0, fields_for(1, 0)));
  REQUIRE(read_board(b.name, &v, &err));
  CHECK(v.rails.empty());
  CHECK(v.stale_slots == 0);
}

TEST_CASE("several processes write while a reader reads: no torn read is returned", "[board]") {
  TestBoard b("conc");
  constexpr int kWriters = 4;
  constexpr int kRailsPerWriter = 3;
  constexpr int kRunMs = 400;
  pid_t kids[kWriters + 1];
  for (int w = 0; w <= kWriters; ++w) {
    kids[w] = fork();
    REQUIRE(kids[w] >= 0);
    if (kids[w] == 0) {
      std::string e;
      auto until = r2ccl::now_us() + kRunMs * r2ccl::kUsPerMs;
      if (w == kWriters) {  // the agreed-record writer
        for (uint64_t k = 1; r2ccl::now_us() < until; ++k)
          if (!publish_agreed_record(b.name, agreed_for(k), &e)) _exit(3);
        _exit(0);
      }
      Publisher p;
      if (!p.open(b.name, &e)) _exit(1);
      for (uint64_t k = 1; r2ccl::now_us() < until; ++k)
        for (int r = 0; r < kRailsPerWriter; ++r)
          if (!p.publish(r, fields_for(k * 10 + r, r))) _exit(2);
      _exit(0);  // no close: the slots stay, owned by a dead process (stale)
    }
  }
  int reads = 0, rails_seen = 0, agreed_seen = 0, torn = 0;
  std::string err;
  auto until = r2ccl::now_us() + (kRunMs + 100) * r2ccl::kUsPerMs;
  while (r2ccl::now_us() < until) {
    BoardView v;
    if (!read_board(b.name, &v, &err)) continue;  // not created yet
    ++reads;
    for (const auto& s : v.rails) {
      ++rails_seen;
      if (!consistent(s))
        FAIL("torn slot " << s.slot << " returned: chunks_sent " << s.f.chunks_sent);
    }
    torn += static_cast<int>(v.torn_slots.size());
    if (v.has_agreed) {
      ++agreed_seen;
      if (!agreed_consistent(v.agreed)) FAIL("torn agreed record returned");
    }
    AgreedRecord a;
    if (read_agreed_record(b.name, &a, &err) && !agreed_consistent(a)) FAIL("torn agreed record");
  }
  for (pid_t k : kids) {
    int st = 0;
    REQUIRE(waitpid(k, &st, 0) == k);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
  }
  INFO("reads " << reads << " rails " << rails_seen << " torn-skipped " << torn);
  CHECK(reads > 10);
  CHECK(rails_seen > 0);
  CHECK(agreed_seen > 0);
  // The writers are gone: their slots are stale, not live.
  BoardView v;
  REQUIRE(read_board(b.name, &v, &err));
  CHECK(v.rails.empty());
  CHECK(v.stale_slots == kWriters * kRailsPerWriter);
  REQUIRE(v.has_agreed);
  CHECK(agreed_consistent(v.agreed));
}

TEST_CASE("processes racing to create the board all open the same one", "[board]") {
  TestBoard b("race");
  constexpr int kKids = 8;
  int go[2];
  REQUIRE(pipe(go) == 0);
  pid_t kids[kKids];
  int done[2];
  REQUIRE(pipe(done) == 0);
  for (int i = 0; i < kKids; ++i) {
    kids[i] = fork();
    REQUIRE(kids[i] >= 0);
    if (kids[i] == 0) {
      close(go[1]);
      char c;
      if (read(go[0], &c, 1) != 0) _exit(4);  // released when the parent closes the pipe
      Publisher p;
      std::string e;
      if (!p.open(b.name, &e)) _exit(1);
      if (!p.publish(0, fields_for(i, 0))) _exit(2);
      c = 'x';
      if (write(done[1], &c, 1) != 1) _exit(3);
      pause();  // stay alive (the slot stays live) until the parent has read the board
      _exit(0);
    }
  }
  close(go[0]);
  close(go[1]);  // go
  close(done[1]);
  int ready = 0;
  char c;
  while (ready < kKids && read(done[0], &c, 1) == 1) ++ready;
  close(done[0]);
  CHECK(ready == kKids);
  std::string err;
  BoardView v;
  bool ok = read_board(b.name, &v, &err);
  for (pid_t k : kids) kill(k, SIGKILL);
  for (pid_t k : kids) waitpid(k, nullptr, 0);
  REQUIRE(ok);
  CHECK(v.rails.size() == kKids);
  for (const auto& s : v.rails) CHECK(consistent(s));
}

TEST_CASE("a writer killed mid-write: readers give up on its slot, a new process reclaims it",
          "[board]") {
  TestBoard b("kill");
  int pfd[2];
  REQUIRE(pipe(pfd) == 0);
  pid_t kid = fork();
  REQUIRE(kid >= 0);
  if (kid == 0) {
    std::string e;
    Publisher p;
    bool ok = p.open(b.name, &e) && p.publish(1, fields_for(4, 1)) &&
              PublisherTestPeer::publish_unfinished(p, 0, fields_for(3, 0));
    char c = ok ? 'y' : 'n';
    if (write(pfd[1], &c, 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  close(pfd[1]);
  char c = 0;
  REQUIRE(read(pfd[0], &c, 1) == 1);
  close(pfd[0]);
  REQUIRE(c == 'y');
  kill(kid, SIGKILL);
  int st = 0;
  REQUIRE(waitpid(kid, &st, 0) == kid);

  std::string err;
  BoardView v;
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(read_board(b.name, &v, &err));
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took < std::chrono::seconds(1));  // bounded retries, no wait on the dead writer
  CHECK(v.rails.empty());
  REQUIRE(v.torn_slots.size() == 1);
  CHECK(v.stale_slots == 1);  // its finished slot: owner dead
  const int dead_torn = v.torn_slots[0];

  // Free slots are taken first; once they are gone, the dead process's slots are reclaimed.
  Publisher p;
  REQUIRE(p.open(b.name, &err));
  for (int r = 0; r < static_cast<int>(kDefaultSlots); ++r) REQUIRE(p.publish(r, fields_for(r, r)));
  CHECK_FALSE(p.publish(kDefaultSlots, fields_for(1, 0)));  // board full
  REQUIRE(read_board(b.name, &v, &err));
  CHECK(v.torn_slots.empty());
  CHECK(v.stale_slots == 0);
  REQUIRE(v.rails.size() == kDefaultSlots);
  bool reclaimed = false;
  for (const auto& s : v.rails) {
    CHECK(consistent(s));
    CHECK(s.pid == getpid());
    reclaimed |= s.slot == dead_torn;
  }
  CHECK(reclaimed);
  p.close();
}

TEST_CASE("agreed record across processes; absent board", "[board]") {
  TestBoard b("agreed");
  AgreedRecord r;
  std::string err;
  CHECK_FALSE(read_agreed_record(b.name, &r, &err));
  CHECK(err.find("absent") != std::string::npos);
  CHECK(err.find(b.seg()) != std::string::npos);

  pid_t kid = fork();
  REQUIRE(kid >= 0);
  if (kid == 0) {
    AgreedRecord a;
    a.epoch = 42;
    a.n_nodes = 4;
    a.members[0] = 0b1011;
    a.node_usable_gbps[0] = 50;
    a.node_usable_gbps[1] = 25.5f;
    a.node_usable_gbps[3] = 50;
    std::string e;
    _exit(publish_agreed_record(b.name, a, &e) ? 0 : 1);
  }
  int st = 0;
  REQUIRE(waitpid(kid, &st, 0) == kid);
  REQUIRE(WEXITSTATUS(st) == 0);
  REQUIRE(read_agreed_record(b.name, &r, &err));
  CHECK(r.epoch == 42);
  CHECK(r.n_nodes == 4);
  CHECK(member_count(r) == 3);
  CHECK(r.node_usable_gbps[1] == 25.5f);
  BoardView v;
  REQUIRE(read_board(b.name, &v, &err));
  CHECK(v.has_agreed);
  CHECK(v.agreed.epoch == 42);

  // A writer that died mid-write leaves the record's sequence odd: readers report it torn,
  // the next publisher takes over after ~100 ms.
  uint64_t odd = 1001;
  write_at(b.seg(), static_cast<off_t>(sizeof(SegmentHeader)), &odd, sizeof(odd));
  CHECK_FALSE(read_agreed_record(b.name, &r, &err));
  CHECK(err.find("torn") != std::string::npos);
  REQUIRE(read_board(b.name, &v, &err));
  CHECK_FALSE(v.has_agreed);
  CHECK(v.agreed_torn == 1);
  REQUIRE(publish_agreed_record(b.name, agreed_for(7), &err));
  REQUIRE(read_agreed_record(b.name, &r, &err));
  CHECK(r.epoch == 7);
  CHECK(agreed_consistent(r));

  // An insane node count is corrupt.
  AgreedRecord bad = agreed_for(8);
  bad.n_nodes = kMaxNodes + 1;
  REQUIRE(publish_agreed_record(b.name, bad, &err));
  CHECK_FALSE(read_agreed_record(b.name, &r, &err));
  CHECK(err.find("corrupt") != std::string::npos);

  // So is a member id at or beyond the node count.
  AgreedRecord beyond;
  beyond.epoch = 9;
  beyond.n_nodes = 2;
  beyond.members[0] = 0b101;  // node 2 of 2
  REQUIRE(publish_agreed_record(b.name, beyond, &err));
  err.clear();
  CHECK_FALSE(read_agreed_record(b.name, &r, &err));
  CHECK(err.find("beyond") != std::string::npos);
}

TEST_CASE("corrupt, truncated and wrong-version segments are refused without a crash", "[board]") {
  TestBoard b("corrupt");
  std::string err;
  auto fresh = [&] {
    remove_board(b.name);
    AgreedRecord a = agreed_for(3);
    REQUIRE(publish_agreed_record(b.name, a, &err));
    Publisher p;
    REQUIRE(p.open(b.name, &err));
    REQUIRE(p.publish(0, fields_for(1, 0)));
  };
  auto expect_bad = [&](BoardError want, const char* words) {
    AgreedRecord r;
    BoardView v;
    BoardError kind = BoardError::kNone;
    err.clear();
    CHECK_FALSE(read_agreed_record(b.name, &r, &err));
    CHECK(err.find(words) != std::string::npos);
    CHECK(err.find(b.seg()) != std::string::npos);
    CHECK_FALSE(read_board(b.name, &v, &err, &kind));
    CHECK(kind == want);
    CHECK(err.find(words) != std::string::npos);
  };
  SECTION("truncated below the size in the header") {
    fresh();
    truncate_to(b.seg(), 4096);
    expect_bad(BoardError::kTruncated, "truncated");
  }
  SECTION("truncated below the header") {
    fresh();
    truncate_to(b.seg(), 10);
    expect_bad(BoardError::kTruncated, "truncated");
  }
  SECTION("empty (a creator died before sizing it)") {
    fresh();
    truncate_to(b.seg(), 0);
    expect_bad(BoardError::kCorrupt, "not initialised");
    // A publisher waits ~1 s for a creator's magic, then gives up (the plugin WARNs once).
    Publisher p;
    auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(p.open(b.name, &err));
    CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(900));
    CHECK(err.find("not initialised") != std::string::npos);
  }
  SECTION("bad magic") {
    fresh();
    uint64_t m = 0x1234;
    write_at(b.seg(), offsetof(SegmentHeader, magic), &m, sizeof(m));
    expect_bad(BoardError::kCorrupt, "bad magic");
  }
  SECTION("wrong layout version; a publisher refuses it too") {
    fresh();
    uint32_t ver = kLayoutVersion + 1;
    write_at(b.seg(), offsetof(SegmentHeader, version), &ver, sizeof(ver));
    expect_bad(BoardError::kVersion, "version");
    Publisher p;
    CHECK_FALSE(p.open(b.name, &err));
    CHECK(err.find("version") != std::string::npos);
  }
  SECTION("sampler block offset or size not this layout's") {
    fresh();
    SegmentHeader h = header_of(b.seg());
    uint32_t off = h.sampler_offset + 64;
    write_at(b.seg(), offsetof(SegmentHeader, sampler_offset), &off, sizeof(off));
    expect_bad(BoardError::kCorrupt, "corrupt");
    SamplerView sv;
    CHECK_FALSE(read_sampler(b.name, &sv, &err));
    CHECK(err.find("corrupt") != std::string::npos);
    off = h.sampler_offset;
    write_at(b.seg(), offsetof(SegmentHeader, sampler_offset), &off, sizeof(off));
    BoardView v;
    REQUIRE(read_board(b.name, &v, &err));  // restored: readable again
    uint32_t size = h.sampler_size - 64;
    write_at(b.seg(), offsetof(SegmentHeader, sampler_size), &size, sizeof(size));
    expect_bad(BoardError::kCorrupt, "corrupt");
    size = ~0u;
    write_at(b.seg(), offsetof(SegmentHeader, sampler_size), &size, sizeof(size));
    expect_bad(BoardError::kCorrupt, "corrupt");
  }
  SECTION("other block offsets not this layout's") {
    fresh();
    SegmentHeader h = header_of(b.seg());
    uint32_t off = h.slots_offset - 64;  // slots overlapping the sampler block
    write_at(b.seg(), offsetof(SegmentHeader, slots_offset), &off, sizeof(off));
    expect_bad(BoardError::kCorrupt, "corrupt");
    off = h.slots_offset;
    write_at(b.seg(), offsetof(SegmentHeader, slots_offset), &off, sizeof(off));
    off = 0;
    write_at(b.seg(), offsetof(SegmentHeader, agreed_offset), &off, sizeof(off));
    expect_bad(BoardError::kCorrupt, "corrupt");
  }
  SECTION("sampler block with more rails than it holds") {
    fresh();
    Publisher p;
    REQUIRE(p.open(b.name, &err));
    REQUIRE(p.publish(0, fields_for(1, 0)));
    REQUIRE(p.claim_sampler(kTestIntervalUs));
    REQUIRE(p.publish_risks({risk_for("eth0", 0.5f)}, r2ccl::now_us()));
    uint32_t n = kMaxRiskRails + 1;
    write_at(b.seg(), sampler_field(b.seg(), kPayloadN), &n, sizeof(n));
    SamplerView sv;
    CHECK_FALSE(read_sampler(b.name, &sv, &err));
    CHECK(err.find("corrupt sampler block") != std::string::npos);
    BoardView v;
    REQUIRE(read_board(b.name, &v, &err));  // the slots and the agreed record stay readable
    CHECK_FALSE(v.has_sampler);
    CHECK(v.sampler_error.find("corrupt") != std::string::npos);
    CHECK(v.rails.size() == 1);
    CHECK(v.has_agreed);
  }
  SECTION("garbage risk entries behind a valid sampler header: sanitised, in bounds") {
    fresh();
    Publisher p;
    REQUIRE(p.open(b.name, &err));
    REQUIRE(p.claim_sampler(kTestIntervalUs));
    REQUIRE(p.publish_risks({}, r2ccl::now_us()));
    // All 0xff: NaN risks and ratios, source 255, drain 255, unterminated strings.
    std::vector<unsigned char> junk(sizeof(RiskEntry) * kMaxRiskRails, 0xff);
    write_at(b.seg(), sampler_field(b.seg(), kPayloadE), junk.data(), junk.size());
    uint32_t n = kMaxRiskRails;
    write_at(b.seg(), sampler_field(b.seg(), kPayloadN), &n, sizeof(n));
    SamplerView sv;
    REQUIRE(read_sampler(b.name, &sv, &err));
    REQUIRE(sv.rails.size() == static_cast<size_t>(kMaxRiskRails));
    for (const auto& e : sv.rails) {
      CHECK(strlen(e.rail) == kRailNameLen - 1);
      CHECK(strlen(e.top) == kCauseLen - 1);
      CHECK(e.risk == -1);
      CHECK(e.retransmit_ratio == -1);
      CHECK(e.source == RiskSource::kNone);
      CHECK(e.drain == 1);
      CHECK(e.hold_s == kMaxHoldS);  // 65535 s read as an hour, the most a hold can be
    }
    // Out-of-range values from a buggy sampler read as unknown too.
    REQUIRE(p.publish_risks({risk_for("a", 1.5f, RiskSource::kLstm, -0.5f),
                             risk_for("b", 1.0f, RiskSource::kLstm, 0.0f)},
                            r2ccl::now_us()));
    REQUIRE(read_sampler(b.name, &sv, &err));
    REQUIRE(find_risk(sv, "a"));
    REQUIRE(find_risk(sv, "b"));
    CHECK(find_risk(sv, "a")->risk == -1);
    CHECK(find_risk(sv, "a")->retransmit_ratio == -1);
    CHECK(find_risk(sv, "b")->risk == 1.0f);
    CHECK(find_risk(sv, "b")->retransmit_ratio == 0.0f);
    // The hold a new sampler inherits: kept with a drain, clamped to an hour, 0 without one.
    std::vector<RiskEntry> held = {risk_for("h", 0.9f, RiskSource::kBaseline, 0, true),
                                   risk_for("x", 0.9f, RiskSource::kBaseline, 0, true),
                                   risk_for("u", 0.1f, RiskSource::kBaseline, 0, false)};
    held[0].hold_s = 1190;
    held[1].hold_s = 5000;
    held[2].hold_s = 600;
    REQUIRE(p.publish_risks(held, r2ccl::now_us()));
    REQUIRE(read_sampler(b.name, &sv, &err));
    REQUIRE(find_risk(sv, "h"));
    REQUIRE(find_risk(sv, "x"));
    REQUIRE(find_risk(sv, "u"));
    CHECK(find_risk(sv, "h")->hold_s == 1190);
    CHECK(find_risk(sv, "x")->hold_s == kMaxHoldS);
    CHECK(find_risk(sv, "u")->hold_s == 0);
  }
  SECTION("insane slot count") {
    fresh();
    uint32_t n = 1u << 30;
    write_at(b.seg(), offsetof(SegmentHeader, slot_count), &n, sizeof(n));
    expect_bad(BoardError::kCorrupt, "corrupt");
  }
  SECTION("huge total size") {
    fresh();
    uint64_t n = ~0ull;
    write_at(b.seg(), offsetof(SegmentHeader, total_size), &n, sizeof(n));
    expect_bad(BoardError::kCorrupt, "corrupt");
  }
  SECTION("garbage bytes everywhere") {
    fresh();
    std::vector<unsigned char> junk(64 * 1024);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (auto& c : junk) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      c = static_cast<unsigned char>(x);
    }
    write_at(b.seg(), 0, junk.data(), junk.size());
    expect_bad(BoardError::kCorrupt, "bad magic");
  }
  SECTION("garbage slots behind a valid header: every slot is read in bounds") {
    fresh();
    std::vector<unsigned char> junk(kDefaultSlots * sizeof(ShmSlot), 0xff);
    // Even sequence numbers, owners that do not exist, unterminated strings.
    for (uint32_t i = 0; i < kDefaultSlots; ++i) {
      uint64_t seq = 2;
      memcpy(&junk[i * sizeof(ShmSlot)], &seq, sizeof(seq));
      int32_t pid = getpid();
      memcpy(&junk[i * sizeof(ShmSlot) + offsetof(ShmSlot, p) + offsetof(SlotPayload, pid)], &pid,
             sizeof(pid));
    }
    SegmentHeader h;
    int fd = shm_open(b.seg().c_str(), O_RDONLY, 0);
    REQUIRE(fd >= 0);
    REQUIRE(pread(fd, &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h)));
    close(fd);
    write_at(b.seg(), static_cast<off_t>(h.slots_offset), junk.data(), junk.size());
    BoardView v;
    REQUIRE(read_board(b.name, &v, &err));
    REQUIRE(v.rails.size() == kDefaultSlots);
    for (const auto& s : v.rails) {
      CHECK(strlen(s.f.name) == kRailNameLen - 1);
      CHECK(strlen(s.f.cause) == kCauseLen - 1);
    }
  }
}

TEST_CASE("sampler: claim, risks round trip, forked child and other processes, close releases",
          "[board][sampler]") {
  TestBoard b("sampler");
  std::string err;
  SamplerView sv;
  CHECK_FALSE(read_sampler(b.name, &sv, &err));
  CHECK(err.find("absent") != std::string::npos);

  Publisher p;
  REQUIRE(p.open(b.name, &err));
  CHECK_FALSE(p.claim_sampler(0));  // an interval is required
  CHECK_FALSE(p.publish_risks({risk_for("eth0", 0.5f)}, r2ccl::now_us()));  // not claimed
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == 0);

  // A child forked after open never claims, even a free block.
  pid_t kid = fork();
  REQUIRE(kid >= 0);
  if (kid == 0) _exit(p.claim_sampler(kTestIntervalUs) ? 1 : 0);
  int st = 0;
  REQUIRE(waitpid(kid, &st, 0) == kid);
  CHECK(WEXITSTATUS(st) == 0);
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == 0);

  const int64_t t0 = r2ccl::now_us();
  REQUIRE(p.claim_sampler(kTestIntervalUs));
  CHECK(p.claim_sampler(kTestIntervalUs));  // already the sampler
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == getpid());
  CHECK(sv.interval_us == kTestIntervalUs);
  CHECK(sv.publish_us >= t0);  // the claim published an empty set
  CHECK(sv.rails.empty());

  const std::string long_name(60, 'n');
  std::vector<RiskEntry> rails = {
      risk_for("eth0", 0.125f, RiskSource::kLstm, 0.001f),
      risk_for("mlx5_0:1", 0.75f, RiskSource::kBaseline, 0.072f, true, "symbol_err,rcv_err"),
      risk_for(long_name, -1, RiskSource::kNone, -1, false, std::string(80, 't')),
  };
  rails[2].rail[kRailNameLen - 1] = 'x';  // an unterminated name: the publisher terminates it
  const int64_t t1 = r2ccl::now_us();
  REQUIRE(p.publish_risks(rails, t1));
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == getpid());
  CHECK(sv.publish_us == t1);
  REQUIRE(sv.rails.size() == 3);
  const RiskEntry* e = find_risk(sv, "eth0");
  REQUIRE(e);
  CHECK(e->risk == 0.125f);
  CHECK(e->retransmit_ratio == 0.001f);
  CHECK(e->source == RiskSource::kLstm);
  CHECK(e->drain == 0);
  e = find_risk(sv, "mlx5_0:1");
  REQUIRE(e);
  CHECK(e->risk == 0.75f);
  CHECK(e->source == RiskSource::kBaseline);
  CHECK(std::string(risk_source_name(e->source)) == "baseline");
  CHECK(e->drain == 1);
  CHECK(std::string(e->top) == "symbol_err,rcv_err");
  CHECK(find_risk(sv, long_name) == nullptr);  // names longer than a slot holds never match
  e = find_risk(sv, long_name.substr(0, kRailNameLen - 1));
  REQUIRE(e);
  CHECK(e->risk == -1);
  CHECK(strlen(e->top) == kCauseLen - 1);
  CHECK(find_risk(sv, "eth1") == nullptr);
  CHECK(find_risk(sv, "") == nullptr);
  CHECK(find_risk(SamplerView{}, "eth0") == nullptr);

  BoardView v;
  REQUIRE(read_board(b.name, &v, &err));
  REQUIRE(v.has_sampler);
  CHECK(v.sampler_error.empty());
  CHECK(v.sampler.owner == getpid());
  CHECK(v.sampler.rails.size() == 3);

  // Another process cannot claim while this one lives, and cannot publish.
  Kid other([&] { return true; },
            [&] {
              Publisher q;
              std::string e2;
              if (!q.open(b.name, &e2)) return 1;
              if (q.claim_sampler(kTestIntervalUs)) return 2;
              if (q.publish_risks({risk_for("eth0", 1)}, r2ccl::now_us())) return 3;
              return 0;
            });
  REQUIRE(other.wait_ready() == 'y');
  CHECK(other.run_body() == 0);
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(risk_in(sv, "eth0") == 0.125f);  // untouched

  // More than kMaxRiskRails: the first 64 are published, and the call says false.
  std::vector<RiskEntry> many;
  for (int i = 0; i < kMaxRiskRails + 6; ++i)
    many.push_back(risk_for("r" + std::to_string(i), static_cast<float>(i) / 100));
  CHECK_FALSE(p.publish_risks(many, r2ccl::now_us()));
  REQUIRE(read_sampler(b.name, &sv, &err));
  REQUIRE(sv.rails.size() == static_cast<size_t>(kMaxRiskRails));
  CHECK(std::string(sv.rails.back().rail) == "r63");
  CHECK(find_risk(sv, "r64") == nullptr);
  CHECK(p.publish_risks({}, r2ccl::now_us()));  // an empty set is a valid publish
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.rails.empty());
  CHECK(sv.owner == getpid());

  // close releases the block at once: another process claims it at its first try.
  REQUIRE(p.publish_risks(rails, r2ccl::now_us()));
  p.close();
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == 0);
  CHECK(sv.rails.empty());
  CHECK(raw_sampler(b.seg()).p.n == 0);  // cleared, not merely hidden
  Kid next([&] { return true; },
           [&] {
             Publisher q;
             std::string e2;
             if (!q.open(b.name, &e2)) return 1;
             return q.claim_sampler(kTestIntervalUs) ? 0 : 2;
           });
  REQUIRE(next.wait_ready() == 'y');
  CHECK(next.run_body() == 0);
}

TEST_CASE(
    "sampler: a sampler in another process holds the block while it lives; its risks die "
    "with it; the next process takes over",
    "[board][sampler]") {
  TestBoard b("sampler-dead");
  std::string err;
  Kid sampler(
      [&] {
        static Publisher q;  // lives until _exit: the block stays owned by the child
        std::string e2;
        return q.open(b.name, &e2) && q.claim_sampler(kTestIntervalUs) &&
               q.publish_risks(
                   {risk_for("eth0", 0.9f, RiskSource::kLstm, 0.2f, true), risk_for("eth1", 0.1f)},
                   r2ccl::now_us());
      },
      [] { return 0; });  // exits without close, as a killed process would
  REQUIRE(sampler.wait_ready() == 'y');

  Publisher p;
  REQUIRE(p.open(b.name, &err));
  CHECK_FALSE(p.claim_sampler(kTestIntervalUs));
  CHECK_FALSE(p.publish_risks({risk_for("eth0", 0)}, r2ccl::now_us()));
  SamplerView sv;
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == sampler.pid);
  REQUIRE(sv.rails.size() == 2);
  REQUIRE(find_risk(sv, "eth0"));
  CHECK(find_risk(sv, "eth0")->drain == 1);

  const pid_t dead = sampler.pid;
  REQUIRE(sampler.run_body() == 0);
  // Its risks are still in shared memory, but a dead owner's risks are not served.
  SamplerBlock raw = raw_sampler(b.seg());
  CHECK(raw.owner == dead);
  CHECK(raw.p.n == 2);
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == 0);
  CHECK(sv.publish_us == 0);
  CHECK(sv.rails.empty());

  REQUIRE(p.claim_sampler(kTestIntervalUs));
  raw = raw_sampler(b.seg());
  CHECK(raw.owner == getpid());
  CHECK(raw.p.pid == getpid());
  CHECK(raw.p.n == 0);  // the predecessor's risks were cleared at the takeover
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == getpid());
  CHECK(sv.rails.empty());
  REQUIRE(p.publish_risks({risk_for("eth1", 0.3f)}, r2ccl::now_us()));
  REQUIRE(read_sampler(b.name, &sv, &err));
  REQUIRE(sv.rails.size() == 1);
  CHECK(risk_in(sv, "eth1") == 0.3f);
}

TEST_CASE("sampler: a hung sampler is taken over after 10 intervals and cannot write again",
          "[board][sampler]") {
  TestBoard b("sampler-hung");
  std::string err;
  static Publisher q;  // the child's (a copy of the parent's unopened one after fork)
  Kid hung(
      [&] {
        std::string e2;
        return q.open(b.name, &e2) && q.claim_sampler(kTestIntervalUs) &&
               q.publish_risks({risk_for("eth0", 0.9f)}, r2ccl::now_us());
      },
      [&] {
        // Woken after its successor took over: it must neither publish nor reclaim.
        if (q.publish_risks({risk_for("eth0", 0.01f)}, r2ccl::now_us())) return 1;
        if (q.claim_sampler(kTestIntervalUs)) return 2;
        return 0;
      });
  REQUIRE(hung.wait_ready() == 'y');
  const int64_t published = r2ccl::now_us();

  Publisher p;
  REQUIRE(p.open(b.name, &err));
  CHECK_FALSE(p.claim_sampler(kTestIntervalUs));  // fresh: 10 intervals = 1 s
  SamplerView sv;
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == hung.pid);
  CHECK(sv.rails.size() == 1);

  usleep(static_cast<useconds_t>(kSamplerStaleIntervals * kTestIntervalUs + 100000));
  REQUIRE(r2ccl::now_us() - published > kSamplerStaleIntervals * kTestIntervalUs);
  // Hung: still the owner, but its risks are no longer served; its last publish shows.
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == hung.pid);
  CHECK(sv.publish_us > 0);
  CHECK(sv.interval_us == kTestIntervalUs);
  CHECK(sv.rails.empty());

  REQUIRE(p.claim_sampler(kTestIntervalUs));
  REQUIRE(p.publish_risks({risk_for("eth0", 0.4f)}, r2ccl::now_us()));
  CHECK(hung.run_body() == 0);
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == getpid());
  REQUIRE(sv.rails.size() == 1);
  CHECK(risk_in(sv, "eth0") == 0.4f);  // the displaced sampler's write did not land
  p.close();
}

TEST_CASE(
    "sampler: an owner that never publishes is taken over after 10 of the claimant's "
    "intervals",
    "[board][sampler]") {
  TestBoard b("sampler-silent");
  std::string err;
  Publisher p;
  REQUIRE(p.open(b.name, &err));
  // A live process owns the block but has written nothing (its claim's clearing write lost).
  Kid silent([] { return true; }, [] { return 0; });
  REQUIRE(silent.wait_ready() == 'y');
  int32_t owner = silent.pid;
  write_at(b.seg(), sampler_field(b.seg(), offsetof(SamplerBlock, owner)), &owner, sizeof(owner));
  SamplerView sv;
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == silent.pid);
  CHECK(sv.publish_us == 0);                      // nothing of its own yet
  CHECK_FALSE(p.claim_sampler(kTestIntervalUs));  // starts watching it
  usleep(static_cast<useconds_t>(kTestIntervalUs * 3));
  CHECK_FALSE(p.claim_sampler(kTestIntervalUs));
  usleep(static_cast<useconds_t>(kSamplerStaleIntervals * kTestIntervalUs));
  CHECK(p.claim_sampler(kTestIntervalUs));
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == getpid());
  p.close();
}

TEST_CASE("sampler: a block left mid-write is torn while its writer lives, taken over after",
          "[board][sampler]") {
  TestBoard b("sampler-torn");
  std::string err;
  Kid writer(
      [&] {
        static Publisher q;
        std::string e2;
        return q.open(b.name, &e2) && q.claim_sampler(kTestIntervalUs) &&
               PublisherTestPeer::publish_risks_unfinished(q, {risk_for("eth0", 0.5f)});
      },
      [] { return 0; });
  REQUIRE(writer.wait_ready() == 'y');

  SamplerView sv;
  auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(read_sampler(b.name, &sv, &err));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));  // bounded retries
  CHECK(err.find("torn") != std::string::npos);
  CHECK(err.find(b.seg()) != std::string::npos);
  BoardView v;
  REQUIRE(read_board(b.name, &v, &err));  // the rest of the board stays readable
  CHECK_FALSE(v.has_sampler);
  CHECK(v.sampler_error.find("torn") != std::string::npos);
  CHECK(v.sampler.owner == 0);

  Publisher p;
  REQUIRE(p.open(b.name, &err));
  CHECK_FALSE(p.claim_sampler(kTestIntervalUs));  // its owner lives
  REQUIRE(writer.run_body() == 0);                // dies with the sequence odd
  REQUIRE(p.claim_sampler(kTestIntervalUs));      // the dead writer's sequence is taken over
  REQUIRE(read_sampler(b.name, &sv, &err));
  CHECK(sv.owner == getpid());
  CHECK(sv.rails.empty());
  CHECK((raw_sampler(b.seg()).seq & 1) == 0);

  // The owner's own abandoned write (it cannot be mid-write itself) does not block it either.
  REQUIRE(PublisherTestPeer::publish_risks_unfinished(p, {risk_for("eth0", 0.5f)}));
  CHECK_FALSE(read_sampler(b.name, &sv, &err));
  REQUIRE(p.publish_risks({risk_for("eth0", 0.25f)}, r2ccl::now_us()));
  REQUIRE(read_sampler(b.name, &sv, &err));
  REQUIRE(sv.rails.size() == 1);
  CHECK(sv.rails[0].risk == 0.25f);
  p.close();
}

TEST_CASE("a version-1 board is refused by readers, publishers and r2ccl_status",
          "[board][sampler]") {
  TestBoard b("v1");
  // Version 1's header: u64 block offsets, no sampler block, slots right after the agreed block.
  struct V1Header {
    uint64_t magic;
    uint32_t version;
    uint32_t header_size;
    uint64_t total_size;
    uint32_t slot_count;
    uint32_t slot_size;
    uint64_t agreed_offset;
    uint64_t slots_offset;
    uint32_t agreed_size;
    uint32_t creator_pid;
    uint8_t pad[8];
  };
  static_assert(sizeof(V1Header) == 64, "v1 header");
  V1Header h{};
  h.magic = kMagic;
  h.version = 1;
  h.header_size = 64;
  h.slot_count = 256;
  h.slot_size = 256;
  h.agreed_offset = 64;
  h.agreed_size = sizeof(AgreedBlock);
  h.slots_offset = (64 + sizeof(AgreedBlock) + 63) / 64 * 64;
  h.total_size = h.slots_offset + 256 * 256;
  h.creator_pid = static_cast<uint32_t>(getpid());
  int fd = shm_open(b.seg().c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, static_cast<off_t>(h.total_size)) == 0);
  REQUIRE(pwrite(fd, &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h)));
  close(fd);

  std::string err;
  BoardView v;
  BoardError kind = BoardError::kNone;
  CHECK_FALSE(read_board(b.name, &v, &err, &kind));
  CHECK(kind == BoardError::kVersion);
  CHECK(err.find("layout version 1") != std::string::npos);
  SamplerView sv;
  err.clear();
  CHECK_FALSE(read_sampler(b.name, &sv, &err));
  CHECK(err.find("layout version 1") != std::string::npos);
  AgreedRecord r;
  CHECK_FALSE(read_agreed_record(b.name, &r, &err));
  Publisher p;
  err.clear();
  CHECK_FALSE(p.open(b.name, &err));
  CHECK(err.find("layout version 1") != std::string::npos);
  CHECK_FALSE(p.claim_sampler(kTestIntervalUs));
#ifdef R2CCL_BINARY_DIR
  std::string cmd = std::string(R2CCL_BINARY_DIR) + "/bin/r2ccl_status --board " + b.name + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  REQUIRE(f);
  std::string out;
  char buf[512];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  int st = pclose(f);
  CHECK(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 2);
  CHECK(out.find("layout version 1") != std::string::npos);
#endif
}

TEST_CASE("RailPublishState copies the counters and stamps switchovers", "[board]") {
  r2ccl::RailCounters c;
  c.bytes_sent = 1000;
  c.chunks_sent = 10;
  c.chunks_replayed = 2;
  c.tcp_retrans = 7;
  c.tcp_segs_out = 700;
  RailPublishState st;
  RailFields f;
  st.fill(c, 5000, "path failure", &f);
  CHECK(f.bytes_sent == 1000);
  CHECK(f.chunks_replayed == 2);
  CHECK(f.tcp_retrans == 7);
  CHECK(f.tcp_segs_out == 700);
  CHECK(f.last_switchover_us == 0);
  c.switchovers = 1;
  c.tcp_retrans = 9;
  st.fill(c, 6000, "link down", &f);
  CHECK(f.tcp_retrans == 9);
  CHECK(f.last_switchover_us == 6000);
  CHECK(std::string(f.cause) == "link down");
  st.fill(c, 7000, "path failure", &f);  // no new switchover: the stamp stays
  CHECK(f.last_switchover_us == 6000);
  CHECK(std::string(f.cause) == "link down");
}

// The TCP runtime publishes its rails from its background thread. Runs in a forked child (the
// runtime is a per-process singleton with a thread that never ends).
TEST_CASE("the TCP runtime publishes each rail; R2CCL_HEALTH_BOARD=none publishes nothing",
          "[board]") {
  TestBoard b("runtime");
  for (const std::string& name : {b.name, std::string("none"), std::string("bad/name")}) {
    int pfd[2], errp[2];
    REQUIRE(pipe(pfd) == 0);
    REQUIRE(pipe(errp) == 0);
    pid_t kid = fork();
    REQUIRE(kid >= 0);
    if (kid == 0) {
      dup2(errp[1], 2);  // the WARN of the bad name is checked below
      setenv("R2CCL_HEALTH_BOARD", name.c_str(), 1);
      setenv("R2CCL_TRANSPORT", "tcp", 1);
      setenv("R2CCL_SOCKET_IFNAME", "lo@127.0.0.1,lo@127.0.0.2", 1);
      setenv("R2CCL_LINK_EVENTS", "0", 1);
      setenv("R2CCL_LOG_FILE", "none", 1);
      r2ccl::net::Transport* rt = nullptr;
      std::string why, e;
      char c = r2ccl::net::get_transport(&rt, &why, &e) == r2ccl::Status::kOk ? 'y' : 'n';
      if (write(pfd[1], &c, 1) != 1) _exit(1);
      pause();
      _exit(0);
    }
    close(pfd[1]);
    char c = 0;
    REQUIRE(read(pfd[0], &c, 1) == 1);
    close(pfd[0]);
    CHECK(c == 'y');  // neither "none" nor a bad name fails init
    BoardView v;
    std::string err;
    bool ok = false;
    if (name == b.name) {
      for (int i = 0; i < 100 && !(ok = read_board(b.name, &v, &err) && v.rails.size() == 2); ++i)
        usleep(10000);
    }
    kill(kid, SIGKILL);
    waitpid(kid, nullptr, 0);
    close(errp[1]);
    std::string log;
    char buf[1024];
    ssize_t n;
    while ((n = read(errp[0], buf, sizeof(buf))) > 0) log.append(buf, static_cast<size_t>(n));
    close(errp[0]);
    if (name == "bad/name")
      CHECK(log.find("health board off") != std::string::npos);
    else
      CHECK(log.find("health board") == std::string::npos);
    if (name != b.name) continue;
    REQUIRE(ok);
    for (const auto& r : v.rails) {
      CHECK(r.pid == kid);
      CHECK(r.f.transport == Transport::kTcp);
      CHECK(r.f.state == RailState::kUp);
      CHECK(r.f.usable_mbps > 0);
      CHECK(r.f.last_switchover_us == 0);
      CHECK(r.f.risk == -1);
    }
    CHECK(std::string(v.rails[0].f.name) == "lo@127.0.0.1");
    CHECK(std::string(v.rails[1].f.name) == "lo@127.0.0.2");
  }
  // "none" must not have created a board named "none" (or any other).
  std::string seg, err;
  REQUIRE(segment_name("none", &seg, &err));
  struct stat st;
  CHECK(stat(("/dev/shm" + seg).c_str(), &st) != 0);
}

#ifdef R2CCL_BINARY_DIR
namespace {
struct Run {
  int rc = -1;
  std::string out;
};
Run run_status(const std::string& args) {
  std::string cmd = std::string(R2CCL_BINARY_DIR) + "/bin/r2ccl_status " + args + " 2>&1";
  Run r;
  FILE* f = popen(cmd.c_str(), "r");
  REQUIRE(f);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) r.out.append(buf, n);
  int st = pclose(f);
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}
}  // namespace

TEST_CASE("r2ccl_status prints the board, as text and JSON; absent 1, corrupt 2", "[board]") {
  const std::string bin = std::string(R2CCL_BINARY_DIR) + "/bin/r2ccl_status";
  REQUIRE(access(bin.c_str(), X_OK) == 0);
  TestBoard b("status");
  Run r = run_status("--board " + b.name);
  CHECK(r.rc == 1);
  CHECK(r.out.find("absent") != std::string::npos);

  std::string err;
  Publisher p;
  REQUIRE(p.open(b.name, &err));
  RailFields f = fields_for(30, 0);
  f.switchovers = 2;
  f.last_switchover_us = r2ccl::now_us() - 5 * r2ccl::kUsPerSec;
  set_text(f.cause, sizeof(f.cause), "link down");
  REQUIRE(p.publish(0, f));
  AgreedRecord a = agreed_for(5);
  a.members[0] = 0b111;
  for (int i = 1; i < kMaxNodes / 64; ++i) a.members[i] = 0;
  REQUIRE(publish_agreed_record(b.name, a, &err));

  // No sampler yet: the risk columns say unknown.
  r = run_status("--board " + b.name + " --sample-ms 0");
  CHECK(r.rc == 0);
  {
    INFO(r.out);
    CHECK(r.out.find("no sampler") != std::string::npos);
    CHECK(r.out.find("REPLAY") != std::string::npos);
    size_t row = r.out.find("\n" + std::to_string(getpid()));
    REQUIRE(row != std::string::npos);
    std::string line = r.out.substr(row + 1, r.out.find('\n', row + 1) - row - 1);
    CHECK(line.find("DRAIN") == std::string::npos);
    // REPLAY, then RETRANS, RISK and SOURCE unknown.
    CHECK(line.find("33.333%        -     - -") != std::string::npos);
    CHECK(r.out.find("check the physical link") == std::string::npos);
  }
  r = run_status("--board " + b.name + " --json --sample-ms 0");
  REQUIRE(r.rc == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["sampler"].is_null());
  CHECK(j["rails"][0]["risk"].is_null());
  CHECK(j["rails"][0]["ccl_retransmit_ratio"].is_null());
  CHECK(j["rails"][0]["drain"] == false);

  // This process is the sampler: rail0-30 drains at risk 0.83 with 7.2 % retransmits; eth9 has
  // no slot on the board.
  REQUIRE(p.claim_sampler(kTestIntervalUs * 50));  // 5 s: not stale while the tool runs
  std::vector<RiskEntry> risks = {
      risk_for("rail0-30", 0.83f, RiskSource::kBaseline, 0.072f, true, "symbol_err,rcv_err"),
      risk_for("eth9", 0.01f, RiskSource::kLstm, 0.001f)};
  risks[0].hold_s = 1200;  // drained at least 20 more minutes (R2CCL_PREDICT_MIN_DRAIN)
  REQUIRE(p.publish_risks(risks, r2ccl::now_us()));

  r = run_status("--board " + b.name + " --sample-ms 0");
  CHECK(r.rc == 0);
  INFO(r.out);
  CHECK(r.out.find("rail0-30") != std::string::npos);
  CHECK(r.out.find("link down") != std::string::npos);
  CHECK(r.out.find("epoch 5") != std::string::npos);
  CHECK(r.out.find("sampler pid " + std::to_string(getpid()) + ", published ") !=
        std::string::npos);
  for (const char* col : {"REPLAY", "RETRANS", "RISK", "SOURCE", "DRAIN"})
    CHECK(r.out.find(col) != std::string::npos);
  // The rail's row: replay 33.333 %, retransmits 7.200 %, risk 0.83, baseline, DRAIN.
  size_t row = r.out.find("\n" + std::to_string(getpid()));
  REQUIRE(row != std::string::npos);
  std::string line = r.out.substr(row + 1, r.out.find('\n', row + 1) - row - 1);
  CHECK(line.find("33.333%") != std::string::npos);
  CHECK(line.find("7.200%") != std::string::npos);
  CHECK(line.find(" 0.83 ") != std::string::npos);
  CHECK(line.find("baseline") != std::string::npos);
  CHECK(line.find("DRAIN") != std::string::npos);
  CHECK(r.out.find("rail rail0-30: retransmit ratio 7.2 % (> 5 %): check the physical link "
                   "(cable, transceiver, port)") != std::string::npos);
  CHECK(r.out.find("rail eth9: retransmit") == std::string::npos);  // 0.1 %: no warning
  CHECK(r.out.find("sampler rails without a slot on the board: eth9") != std::string::npos);

  r = run_status("--board " + b.name + " --json --sample-ms 0");
  REQUIRE(r.rc == 0);
  j = nlohmann::json::parse(r.out);
  REQUIRE(j["rails"].size() == 1);
  CHECK(j["rails"][0]["pid"] == getpid());
  CHECK(j["rails"][0]["name"] == "rail0-30");
  CHECK(j["rails"][0]["transport"] == "tcp");
  CHECK(j["rails"][0]["state"] == "up");
  CHECK(j["rails"][0]["chunks_sent"] == 30);
  CHECK(j["rails"][0]["replay_ratio"].get<double>() == Approx(10.0 / 30));
  CHECK(j["rails"][0]["last_switchover_cause"] == "link down");
  CHECK(j["rails"][0]["last_switchover_ago_s"].get<double>() >= 5.0);
  CHECK(j["rails"][0]["risk"].get<double>() == Approx(0.83));
  CHECK(j["rails"][0]["risk_source"] == "baseline");
  CHECK(j["rails"][0]["drain"] == true);
  REQUIRE(j["rails"][0]["drain_hold_s"].is_number());
  CHECK(j["rails"][0]["drain_hold_s"].get<double>() <= 1200);
  CHECK(j["rails"][0]["drain_hold_s"].get<double>() > 1190);
  CHECK(j["rails"][0]["ccl_retransmit_ratio"].get<double>() == Approx(0.072));
  CHECK(j["rails"][0]["top_counters"] == "symbol_err,rcv_err");
  CHECK(j["sampler"]["pid"] == getpid());
  CHECK(j["sampler"]["age_s"].get<double>() >= 0);
  CHECK(j["sampler"]["age_s"].get<double>() < 5);
  CHECK(j["sampler"]["rails"] == 2);
  CHECK(j["sampler"]["stale"] == false);
  CHECK(j["sampler_error"].is_null());
  CHECK(j["agreed"]["epoch"] == 5);
  CHECK(j["agreed"]["members"] == 3);

  // Throughput from two reads 200 ms apart while a thread-free publisher keeps publishing:
  // the tool samples; this process publishes in between from a child.
  pid_t kid = fork();
  REQUIRE(kid >= 0);
  if (kid == 0) {
    Publisher q;
    std::string e;
    if (!q.open(b.name, &e)) _exit(1);
    auto until = r2ccl::now_us() + 1500 * r2ccl::kUsPerMs;
    for (uint64_t k = 1; r2ccl::now_us() < until; ++k) {
      RailFields g = fields_for(k, 1);
      g.bytes_sent = k * 1000000;  // 1 MB per 10 ms = 800 Mbps
      q.publish(1, g);
      usleep(10000);
    }
    _exit(0);
  }
  usleep(200000);
  r = run_status("--board " + b.name + " --json");
  int st = 0;
  waitpid(kid, &st, 0);
  REQUIRE(r.rc == 0);
  j = nlohmann::json::parse(r.out);
  bool found = false;
  for (const auto& x : j["rails"])
    if (x["pid"] == kid) {
      found = true;
      REQUIRE(x["throughput_mbps"].is_number());
      CHECK(x["throughput_mbps"].get<double>() > 100);
      CHECK(x["risk"].is_null());  // no sampler entry for its rail
      CHECK(x["risk_source"].is_null());
      CHECK(x["ccl_retransmit_ratio"].is_null());
      CHECK(x["top_counters"].is_null());
      CHECK(x["drain"] == false);
      CHECK(x["drain_hold_s"].is_null());
    }
  CHECK(found);

  // Corrupt: exit 2, naming the segment.
  uint64_t m = 1;
  write_at(b.seg(), 0, &m, sizeof(m));
  r = run_status("--board " + b.name);
  CHECK(r.rc == 2);
  CHECK(r.out.find(b.seg()) != std::string::npos);
  r = run_status("--board bad/name");
  CHECK(r.rc == 2);
  p.close();
}
#endif
