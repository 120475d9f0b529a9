// The snapshot sidecar end to end on loopback: several r2ccl_snapshotd ("nodes", each with its
// own health board, client socket and spill directory) and one training "rank" per node using
// the client library (libr2ccl-snapshot). The scenarios:
//  - a node dies after one shard of step N reached its replicas, before N's marker round can
//    complete: the survivors are told (a new membership), restore N-1, never the partial N; a
//    replacement node's rank restores N-1 from the replicas; training goes on;
//  - beyond the memory limit shards spill, and restore is still exact; a replica's corrupted
//    shard is caught by its checksum and the next replica serves the chain; a restarted daemon
//    serves what it spilled;
//  - a minority partition does not act (no coordinator, no new agreed record), the majority does.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "etcd_fixture.h"
#include "net_harness.h"
#include "r2ccl/health_board.h"
#include "r2ccl/snapshot_client.h"

using namespace r2ccl;

namespace {

std::string daemon_path() {
  return test::env_or("R2CCL_TEST_SNAPSHOTD", R2CCL_BINARY_DIR "/bin/r2ccl_snapshotd");
}

// N daemons on 127.0.0.1, heartbeat 100 ms, a 1 s lease, and their own etcd.
struct Cluster {
  int n = 0;
  std::string tag, peers, token, topology;
  std::unique_ptr<test::EtcdCluster> etcd;
  std::vector<std::string> boards, sockets, spills, logs;
  std::vector<pid_t> pids;
  std::vector<std::string> extra;  // more daemon arguments for every node

  // `slot` keeps the test cases of one process on different ports.
  Cluster(int nodes, const std::string& name, bool spill, int slot, int etcd_members = 1)
      : n(nodes) {
    tag = name + std::to_string(getpid());
    etcd = std::make_unique<test::EtcdCluster>(tag, etcd_members);
    std::string err;
    const bool up = etcd->start(&err);
    INFO(err);
    REQUIRE(up);
    const int base = 21000 + (getpid() % 700) * 16 + slot * 5;
    peers = test::temp_path(tag + "-peers");
    token = test::temp_path(tag + "-token");
    {
      std::ofstream p(peers);
      for (int i = 0; i < n; ++i) p << i << " 127.0.0.1:" << base + i << "\n";
      std::ofstream(token) << "job-" << tag << "\n";
    }
    for (int i = 0; i < n; ++i) {
      boards.push_back(tag + "-b" + std::to_string(i));
      board::remove_board(boards.back());
      sockets.push_back(test::temp_path(tag + "-n" + std::to_string(i) + ".sock"));
      spills.push_back(spill ? test::temp_path(tag + "-spill" + std::to_string(i)) : "");
      logs.push_back(test::temp_path(tag + "-node" + std::to_string(i) + ".log"));
      pids.push_back(-1);
    }
  }
  ~Cluster() {
    for (int i = 0; i < n; ++i) stop(i, SIGKILL);
    for (auto& b : boards) board::remove_board(b);
  }
  void start(int i, const std::string& env = "") {
    ::unlink(
        sockets[i].c_str());  // a killed daemon's socket file: wait_socket waits for the new one
    fflush(stdout);           // the child's freopen would write the parent's buffered output again
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
      FILE* f = freopen(logs[i].c_str(), "a", stderr);
      FILE* g = freopen("/dev/null", "w", stdout);  // ctest must not wait on a daemon's stdout
      (void)f;
      (void)g;
      if (!env.empty()) putenv(const_cast<char*>(env.c_str()));
      std::vector<std::string> a{"r2ccl_snapshotd",
                                 "--id",
                                 std::to_string(i),
                                 "--peers",
                                 peers,
                                 "--token-file",
                                 token,
                                 "--board",
                                 boards[i],
                                 "--period-ms",
                                 "100",
                                 "--socket",
                                 sockets[i],
                                 "--etcd",
                                 etcd->endpoints(),
                                 "--job",
                                 tag,
                                 "--lease-ttl",
                                 "1"};
      if (!spills[i].empty()) a.insert(a.end(), {"--spill-dir", spills[i]});
      if (!topology.empty()) a.insert(a.end(), {"--topology", topology});
      a.insert(a.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& s : a) argv.push_back(const_cast<char*>(s.c_str()));
      argv.push_back(nullptr);
      execv(daemon_path().c_str(), argv.data());
      _exit(127);
    }
    pids[i] = pid;
  }
  void stop(int i, int sig) {
    if (pids[i] <= 0) return;
    kill(pids[i], sig);
    int st;
    waitpid(pids[i], &st, 0);
    pids[i] = -1;
  }
  // Waits for node i's client socket to exist (the daemon is up).
  bool wait_socket(int i, int ms = 5000) {
    for (int w = 0; w <= ms; w += 20) {
      struct stat st;
      if (stat(sockets[i].c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // No daemon reported a sanitizer finding (the ASan phase runs this test too).
  void check_clean() const {
    const std::string logs = all_logs();
    INFO(logs);
    CHECK(logs.find("AddressSanitizer") == std::string::npos);
    CHECK(logs.find("runtime error:") == std::string::npos);
  }
  std::string all_logs() const {
    std::string s;
    for (int i = 0; i < n; ++i)
      s += "--- node " + std::to_string(i) + "\n" + test::read_file(logs[i]);
    return s;
  }
};

// One training rank: two buffers whose content is a function of (rank, step).
struct Rank {
  uint32_t rank = 0, world = 0;
  r2ccl_snap_t* h = nullptr;
  std::vector<float> weights;
  std::vector<uint8_t> state;

  Rank(uint32_t r, uint32_t w, size_t floats) : rank(r), world(w), weights(floats), state(4096) {}
  ~Rank() { close(); }
  void close() {
    r2ccl_snap_close(h);
    h = nullptr;
  }
  uint32_t salt = 0;  // a second timeline of the same steps (after a restore) differs
  float weight(uint32_t rank, uint64_t step, size_t i) const {
    // Every 7th element moves each step; the rest keep their value (deltas compress).
    const double v = std::sin(0.001 * static_cast<double>(i) + rank) +
                     (i % 7 == 0 ? 0.01 * static_cast<double>(step) + 0.5 * salt : 0.0);
    return static_cast<float>(v);
  }
  void fill(uint64_t step) {
    for (size_t i = 0; i < weights.size(); ++i) weights[i] = weight(rank, step, i);
    for (size_t i = 0; i < state.size(); ++i)
      state[i] = static_cast<uint8_t>(rank * 31 + step * 7 + i);
  }
  bool holds(uint64_t step) const {
    for (size_t i = 0; i < weights.size(); ++i)
      if (weights[i] != weight(rank, step, i)) return false;
    for (size_t i = 0; i < state.size(); ++i)
      if (state[i] != static_cast<uint8_t>(rank * 31 + step * 7 + i)) return false;
    return true;
  }
  int open(const std::string& socket) {
    int rc = r2ccl_snap_open(socket.c_str(), rank, world, &h);
    if (rc) return rc;
    rc = r2ccl_snap_register(h, 0, weights.data(), weights.size() * sizeof(float),
                             R2CCL_SNAP_DTYPE_F32, R2CCL_SNAP_CODEC_LOSSLESS, 0);
    if (rc) return rc;
    return r2ccl_snap_register(h, 1, state.data(), state.size(), R2CCL_SNAP_DTYPE_BYTES,
                               R2CCL_SNAP_CODEC_LOSSLESS, 0);
  }
  int take(uint64_t step) {
    fill(step);
    r2ccl_snap_set_loss_scale(h, 1024.0 * static_cast<double>(step));
    int rc = r2ccl_snap_take(h, step, nullptr);
    return rc ? rc : r2ccl_snap_flush(h, 10 * 1000000);
  }
};

std::string err_of(int rc) {
  return std::string(r2ccl_snap_strerror(rc)) + ": " + r2ccl_snap_last_error(nullptr);
}

// Waits until h's daemon says `pred(state)`.
template <class Pred>
bool wait_state(r2ccl_snap_t* h, int ms, Pred pred, r2ccl_snap_state_t* out) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (r2ccl_snap_state(h, out) == 0 && pred(*out)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

bool complete_at_least(r2ccl_snap_t* h, uint64_t step, int ms = 10000) {
  r2ccl_snap_state_t s;
  return wait_state(
      h, ms,
      [&](const r2ccl_snap_state_t& x) { return x.has_complete_step && x.complete_step >= step; },
      &s);
}

// GET /metrics from the daemon whose log says "Prometheus metrics on ... (port N)".
std::string scrape(const std::string& log) {
  const std::string text = test::read_file(log);
  const size_t at = text.find("/metrics (port ");
  if (at == std::string::npos) return "";
  const int port = std::atoi(text.c_str() + at + 15);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

// The value of the first series of `name` (with or without labels) on a metrics page; -1 if absent.
double metric(const std::string& page, const std::string& name) {
  std::istringstream in(page);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    const char next = line[name.size()];
    if (next != ' ' && next != '{') continue;
    return std::atof(line.c_str() + line.rfind(' ') + 1);
  }
  return -1;
}

// Waits until `board` holds an agreed record with `members` members.
bool wait_board_members(const std::string& b, int members, int ms = 10000) {
  for (int w = 0; w <= ms; w += 20) {
    board::AgreedRecord r;
    std::string err;
    if (board::read_agreed_record(b, &r, &err) && board::member_count(r) == members) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

void flip_byte(const std::string& path, long offset) {
  FILE* f = fopen(path.c_str(), "r+b");
  REQUIRE(f != nullptr);
  REQUIRE(fseek(f, offset, SEEK_SET) == 0);
  const int c = fgetc(f);
  REQUIRE(c != EOF);
  REQUIRE(fseek(f, offset, SEEK_SET) == 0);
  fputc(c ^ 0x5a, f);
  fclose(f);
}

}  // namespace

namespace {

// The record every node's board holds now, read with its members as a sorted id list.
std::vector<int> board_members(const std::string& board, uint64_t* epoch) {
  board::AgreedRecord r;
  std::string err;
  std::vector<int> ids;
  *epoch = 0;
  if (!board::read_agreed_record(board, &r, &err)) return ids;
  *epoch = r.epoch;
  for (uint32_t id = 0; id < r.n_nodes && id < uint32_t(board::kMaxNodes); ++id)
    if (r.members[id / 64] & (1ull << (id % 64))) ids.push_back(int(id));
  return ids;
}

// Waits until every listed node's board shows the same epoch and exactly `members`.
bool boards_agree(Cluster& c, const std::vector<int>& nodes, const std::vector<int>& members,
                  int ms, uint64_t after = 0) {
  for (int w = 0; w <= ms; w += 50) {
    bool ok = true;
    uint64_t e0 = 0;
    for (size_t k = 0; k < nodes.size() && ok; ++k) {
      uint64_t e = 0;
      ok = board_members(c.boards[nodes[k]], &e) == members && e > after;
      if (k == 0) e0 = e;
      ok = ok && e == e0;
    }
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// The invariants every run must keep (issue 15), from etcd's keys and the daemons' logs:
//  - at most one record per epoch: each records/E key says epoch E, and every daemon that wrote
//    epoch E into its board wrote the same members;
//  - epochs only increase on every node, and never go back across its restarts (logs are
//    appended; a restarted daemon first reads the record it had);
//  - the record's members all hold a lease now (members/ keys), once the cluster settled;
//  - evictions of live nodes: at most `max_evictions`.
void check_invariants(Cluster& c, int max_evictions) {
  const std::string prefix = "/r2ccl/" + c.tag + "/";
  std::map<uint64_t, std::string> by_epoch;
  for (const auto& [k, v] : c.etcd->get_prefix(prefix + "records/")) {
    const uint64_t e = std::stoull(k.substr(k.rfind('/') + 1));
    INFO(k << " = " << v);
    CHECK(v.find("\"epoch\":" + std::to_string(e) + ",") != std::string::npos);
  }
  int evictions = 0;
  for (int i = 0; i < c.n; ++i) {
    std::istringstream lines(test::read_file(c.logs[i]));
    std::string line;
    uint64_t last = 0;
    bool restarted = true;  // the first record a (re)started daemon reads may repeat its last
    while (std::getline(lines, line)) {
      if (line.find("INFO etcd: evicted node") != std::string::npos) ++evictions;
      if (line.find(" listening on ") != std::string::npos) restarted = true;
      const size_t at = line.find("agreed record epoch ");
      if (at == std::string::npos) continue;
      const uint64_t e = std::stoull(line.substr(at + 20));
      const size_t m = line.find("members {");
      const std::string ids = line.substr(m + 9, line.find('}', m) - m - 9);
      INFO("node " << i << ": " << line);
      if (restarted)
        CHECK(e >= last);  // never back, across restarts
      else
        CHECK(e > last);  // only forward within one run
      restarted = false;
      last = e;
      auto [it, fresh] = by_epoch.insert({e, ids});
      CHECK(it->second == ids);  // one membership per epoch, on every node
    }
  }
  CHECK(evictions <= max_evictions);
  std::string rec;
  REQUIRE(c.etcd->get(prefix + "record", &rec));
  std::set<int> leased;
  for (const auto& [k, v] : c.etcd->get_prefix(prefix + "members/"))
    leased.insert(std::stoi(k.substr(k.rfind('/') + 1)));
  uint64_t e = 0;
  for (int i = 0; i < c.n; ++i)
    if (c.pids[i] > 0) {
      INFO("node " << i << " record " << rec);
      for (int id : board_members(c.boards[i], &e)) CHECK(leased.count(id));
    }
}

}  // namespace

TEST_CASE("snapshot cluster: a node lost mid-replication; survivors restore N-1, never N",
          "[snapshot]") {
  constexpr int kNodes = 4;
  constexpr uint64_t kN = 4;
  Cluster c(kNodes, "snapcl", false, 0);
  c.extra = {"--metrics", "127.0.0.1:0"};
  for (int i = 0; i < kNodes; ++i)
    c.start(i, i == 3 ? "R2CCL_SNAPD_TEST_EXIT_AFTER_SHARDS=4:1" : "");
  for (int i = 0; i < kNodes; ++i) REQUIRE(c.wait_socket(i));
  for (int i = 0; i < kNodes; ++i) {
    INFO(c.all_logs());
    REQUIRE(wait_board_members(c.boards[i], 4));  // epoch 1 has all four
  }
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < kNodes; ++r) {
    ranks.push_back(std::make_unique<Rank>(r, kNodes, 20000));
    const int rc = ranks[r]->open(c.sockets[r]);
    INFO(err_of(rc));
    REQUIRE(rc == 0);
  }
  // Steps 1..N-1 on every rank; they become complete.
  for (uint64_t s = 1; s < kN; ++s)
    for (auto& r : ranks) {
      const int rc = r->take(s);
      INFO(err_of(rc));
      REQUIRE(rc == 0);
    }
  {
    INFO(c.all_logs());
    REQUIRE(complete_at_least(ranks[0]->h, kN - 1));
  }
  // Node 0's Prometheus endpoint shows the takes, the replication and the cut.
  {
    // Every replica gets every chain within a few periods (a step completes with one).
    std::string page;
    for (int w = 0; w < 5000; w += 100) {
      page = scrape(c.logs[0]);
      if (metric(page, "r2ccl_snapshot_shards_sent_total") >= 3 * 3 * (kN - 1) &&
          metric(page, "r2ccl_snapshot_shards_received_total") >= 3 * 3 * (kN - 1))
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    INFO(page);
    CHECK(page.rfind("HTTP/1.1 200", 0) == 0);  // prometheus-cpp's Exposer (civetweb)
    CHECK(metric(page, "r2ccl_snapshot_takes_total") == kN - 1);
    CHECK(metric(page, "r2ccl_snapshot_shards_sent_total") >=
          3 * 3 * (kN - 1));  // 3 replicas, 3 buffers
    CHECK(metric(page, "r2ccl_snapshot_shards_received_total") >= 3 * 3 * (kN - 1));
    CHECK(metric(page, "r2ccl_snapshot_newest_complete_step") >= kN - 1);
    CHECK(metric(page, "r2ccl_snapshot_live_nodes") == 4);
    double coordinators = 0;  // exactly one daemon acts (whichever etcd elected)
    for (int i = 0; i < kNodes; ++i)
      coordinators += metric(scrape(c.logs[i]), "r2ccl_snapshot_coordinator");
    CHECK(coordinators == 1);
    CHECK(metric(page, "r2ccl_snapshot_replication_lag_seconds") >= 0);
    CHECK(metric(page, "r2ccl_snapshot_agreed_members") == 4);
    CHECK(metric(page, "r2ccl_snapshot_store_memory_bytes") > 0);
  }
  // Step N: node 3's daemon dies after the first shard of step N reached its replicas.
  for (auto& r : ranks) r->take(kN);
  r2ccl_snap_state_t st;
  {
    INFO(c.all_logs());
    for (int r = 0; r < 3; ++r)
      REQUIRE(wait_state(
          ranks[r]->h, 10000,
          [](const r2ccl_snap_state_t& x) {
            return x.member_count == 3 && (x.members[0] & 8u) == 0;
          },
          &st));
  }
  int status = 0;
  REQUIRE(waitpid(c.pids[3], &status, 0) == c.pids[3]);
  c.pids[3] = -1;
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 3);  // the test hook, not a crash
  ranks[3]->close();
  // The newest complete step is N-1 and stays there.
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  for (int r = 0; r < 3; ++r) {
    REQUIRE(r2ccl_snap_state(ranks[r]->h, &st) == 0);
    REQUIRE(st.has_complete_step);
    CHECK(st.complete_step == kN - 1);
  }
  // Survivors restore N-1 (they hold N's values now).
  for (int r = 0; r < 3; ++r) {
    CHECK(ranks[r]->holds(kN));
    uint64_t step = 0;
    const int rc = r2ccl_snap_restore(ranks[r]->h, 10 * 1000000, &step);
    INFO("rank " << r << ": " << err_of(rc));
    REQUIRE(rc == 0);
    CHECK(step == kN - 1);
    CHECK(ranks[r]->holds(kN - 1));
    double ls = 0;
    REQUIRE(r2ccl_snap_get_loss_scale(ranks[r]->h, &ls) == 0);
    CHECK(ls == 1024.0 * (kN - 1));
  }
  // A replacement node 3 (empty) and its rank restore N-1 from the replicas; it reads the KV
  // published before it existed (B8).
  REQUIRE(r2ccl_snap_kv_put(ranks[0]->h, "nccl-uid-epoch1", "uid-A", 5) == 0);
  c.start(3);
  REQUIRE(c.wait_socket(3));
  ranks[3] = std::make_unique<Rank>(3, kNodes, 20000);
  ranks[3]->fill(99);
  REQUIRE(ranks[3]->open(c.sockets[3]) == 0);
  {
    INFO(c.all_logs());
    REQUIRE(complete_at_least(ranks[3]->h, kN - 1));
    uint64_t step = 0;
    const int rc = r2ccl_snap_restore(ranks[3]->h, 10 * 1000000, &step);
    INFO(err_of(rc));
    REQUIRE(rc == 0);
    CHECK(step == kN - 1);
    CHECK(ranks[3]->holds(kN - 1));
    char v[16];
    size_t vn = 0;
    REQUIRE(r2ccl_snap_kv_get(ranks[3]->h, "nccl-uid-epoch1", v, sizeof(v), &vn, 5000000) == 0);
    CHECK(std::string(v, vn) == "uid-A");
  }
  // Training goes on from N-1 on another timeline (B5): a different step N on all four. The old
  // N's shards (the rolled-back generation, still on some replicas) must not count toward it.
  // First rank 3 alone: the old timeline's N of ranks 0-2 (held in full by their replicas
  // before the loss) must not make N complete with it.
  ranks[3]->salt = 1;
  REQUIRE(ranks[3]->take(kN) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  {
    r2ccl_snap_state_t s3;
    REQUIRE(r2ccl_snap_state(ranks[0]->h, &s3) == 0);
    INFO(c.all_logs());
    CHECK((!s3.has_complete_step || s3.complete_step < kN));
  }
  for (int r = 0; r < 3; ++r) {
    ranks[r]->salt = 1;
    REQUIRE(ranks[r]->take(kN) == 0);
  }
  {
    INFO(c.all_logs());
    CHECK(complete_at_least(ranks[0]->h, kN));
  }
  for (int r = 0; r < kNodes; ++r) {
    ranks[r]->fill(1);
    uint64_t step = 0;
    const int rc = r2ccl_snap_restore(ranks[r]->h, 10 * 1000000, &step);
    INFO("rank " << r << ": " << err_of(rc) << "\n" << c.all_logs());
    REQUIRE(rc == 0);
    CHECK(step == kN);
    CHECK(ranks[r]->holds(kN));  // the new timeline's N, bit for bit
  }
  for (auto& r : ranks) REQUIRE(r->take(kN + 1) == 0);
  {
    INFO(c.all_logs());
    CHECK(complete_at_least(ranks[0]->h, kN + 1));
  }
  {
    const std::string page = scrape(c.logs[1]);
    INFO(page);
    CHECK(metric(page, "r2ccl_snapshot_nodes_failed_total") >= 1);
    CHECK(metric(page, "r2ccl_snapshot_nodes_rejoined_total") >= 1);
    CHECK(metric(page, "r2ccl_snapshot_recoveries_total") == 2);  // rank 1 restored twice
  }
  const std::string logs = c.all_logs();
  CHECK(logs.find("test hook: exiting after 1 shards of step 4") != std::string::npos);
  CHECK(logs.find("node 3: no heartbeat for") != std::string::npos);
  CHECK(logs.find("dropped") != std::string::npos);  // the old N's shards, on a new generation
  check_invariants(c, 1);
  c.check_clean();
}

TEST_CASE("snapshot cluster: spill beyond the memory limit, a corrupt replica, a restarted daemon",
          "[snapshot]") {
  constexpr int kNodes = 4;
  Cluster c(kNodes, "snapsp", true, 1);
  // Node 3 sits under one leaf with node 0, node 1 under the next leaf, node 2 across the
  // spine: a restore for rank 3 asks 0, then 1, then 2.
  c.topology = test::temp_path(c.tag + "-topo");
  std::ofstream(c.topology) << "0 s0/l0\n3 s0/l0\n1 s0/l1\n2 s1/l2\n";
  c.extra = {"--mem-limit-mb", "1"};
  for (int i = 0; i < kNodes; ++i) c.start(i);
  for (int i = 0; i < kNodes; ++i) REQUIRE(c.wait_socket(i));
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < kNodes; ++r) {
    ranks.push_back(std::make_unique<Rank>(r, kNodes, 512 * 1024));  // 2 MiB of weights
    REQUIRE(ranks[r]->open(c.sockets[r]) == 0);
  }
  for (uint64_t s = 1; s <= 2; ++s)
    for (auto& r : ranks) REQUIRE(r->take(s) == 0);
  {
    INFO(c.all_logs());
    REQUIRE(complete_at_least(ranks[0]->h, 2));
  }
  // Rank 3's base of buffer 0 (2 MiB, over the 1 MiB limit) spilled on every replica.
  const std::string f0 = c.spills[0] + "/r3_s1_b0.shard", f1 = c.spills[1] + "/r3_s1_b0.shard",
                    f2 = c.spills[2] + "/r3_s1_b0.shard";
  struct stat sb;
  REQUIRE(stat(f0.c_str(), &sb) == 0);
  REQUIRE(stat(f1.c_str(), &sb) == 0);
  REQUIRE(stat(f2.c_str(), &sb) == 0);
  // Node 3 is lost.
  c.stop(3, SIGKILL);
  ranks[3]->close();
  r2ccl_snap_state_t st;
  REQUIRE(wait_state(
      ranks[0]->h, 10000, [](const r2ccl_snap_state_t& x) { return x.member_count == 3; }, &st));
  // Corrupt the copies on nodes 0 and 1 (a payload byte: the header stays valid).
  flip_byte(f0, static_cast<long>(sb.st_size / 2));
  flip_byte(f1, static_cast<long>(sb.st_size / 2));
  // A replacement node 3: its rank's restore finds 0 and 1 corrupt and gets the chain from 2.
  c.start(3);
  REQUIRE(c.wait_socket(3));
  ranks[3] = std::make_unique<Rank>(3, kNodes, 512 * 1024);
  REQUIRE(ranks[3]->open(c.sockets[3]) == 0);
  REQUIRE(complete_at_least(ranks[3]->h, 2));
  uint64_t step = 0;
  int rc = r2ccl_snap_restore(ranks[3]->h, 20 * 1000000, &step);
  {
    INFO(err_of(rc) << "\n" << c.all_logs());
    REQUIRE(rc == 0);
    CHECK(step == 2);
    CHECK(ranks[3]->holds(2));
    const std::string log3 = test::read_file(c.logs[3]);
    CHECK(log3.find("node 0 answered corrupt (checksum)") != std::string::npos);
    CHECK(log3.find("node 1 answered corrupt (checksum)") != std::string::npos);
    CHECK(test::read_file(c.logs[0]).find("cannot serve rank 3 step 1 buffer 0: corrupt") !=
          std::string::npos);
    CHECK(c.all_logs().find("no longer holds it (retracted)") != std::string::npos);  // B6
  }
  // Node 2 restarts (clean stop: what was in memory spills); rank 3, now on node 2's daemon,
  // restores from what node 2 serves from its spill directory (0's and 1's copies are bad).
  ranks[3]->close();
  c.stop(2, SIGTERM);
  c.start(2);
  REQUIRE(c.wait_socket(2));
  Rank again(3, kNodes, 512 * 1024);
  REQUIRE(again.open(c.sockets[2]) == 0);
  {
    INFO(c.all_logs());
    REQUIRE(complete_at_least(again.h, 2));
  }
  rc = r2ccl_snap_restore(again.h, 20 * 1000000, &step);
  {
    INFO(err_of(rc) << "\n" << c.all_logs());
    REQUIRE(rc == 0);
    CHECK(step == 2);
    CHECK(again.holds(2));
    CHECK(test::read_file(c.logs[2]).find("from the spill directory") != std::string::npos);
  }
  c.check_clean();
}

TEST_CASE("snapshot cluster: one cut link evicts at most one of its ends, and boards agree",
          "[snapshot]") {
  // B1: 3 nodes, only 0<->1 cut. Each suspects the other; node 2 hears both: no second
  // observer, nobody is evicted, one coordinator, one record, the same KV everywhere.
  constexpr int kNodes = 3;
  Cluster c(kNodes, "snapcut", false, 2);
  const std::string b0 = test::temp_path(c.tag + "-block0"),
                    b1 = test::temp_path(c.tag + "-block1");
  std::ofstream(b0) << "";
  std::ofstream(b1) << "";
  for (int i = 0; i < kNodes; ++i)
    c.start(i, i == 0   ? "R2CCL_SNAPD_TEST_BLOCK_FILE=" + b0
               : i == 1 ? "R2CCL_SNAPD_TEST_BLOCK_FILE=" + b1
                        : "");
  for (int i = 0; i < kNodes; ++i) REQUIRE(c.wait_socket(i));
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, {0, 1, 2}, {0, 1, 2}, 10000));
  }
  uint64_t epoch = 0;
  board_members(c.boards[0], &epoch);
  std::ofstream(b0) << "1\n";
  std::ofstream(b1) << "0\n";
  // Both ends publish a unique id; whichever came first is what every node reads.
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < kNodes; ++r) {
    ranks.push_back(std::make_unique<Rank>(r, kNodes, 1000));
    REQUIRE(ranks[r]->open(c.sockets[r]) == 0);
  }
  REQUIRE(r2ccl_snap_kv_put(ranks[0]->h, "nccl-uid", "from-0", 6) == 0);
  REQUIRE(r2ccl_snap_kv_put(ranks[1]->h, "nccl-uid", "from-1", 6) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // 25 periods, 2.5 leases
  std::set<std::string> seen;
  for (int r = 0; r < kNodes; ++r) {
    char buf[64];
    size_t n = 0;
    const int rc = r2ccl_snap_kv_get(ranks[r]->h, "nccl-uid", buf, sizeof(buf), &n, 5000000);
    INFO(err_of(rc));
    REQUIRE(rc == 0);
    seen.insert(std::string(buf, n));
  }
  CHECK(seen.size() == 1);
  const std::string logs = c.all_logs();
  INFO(logs);
  CHECK(logs.find("node 1: no heartbeat for") != std::string::npos);  // the cut is seen
  uint64_t e0 = 0, e1 = 0, e2 = 0;
  const auto m0 = board_members(c.boards[0], &e0), m1 = board_members(c.boards[1], &e1),
             m2 = board_members(c.boards[2], &e2);
  CHECK(m0 == m1);
  CHECK(m1 == m2);
  CHECK(e0 == e1);
  CHECK(e1 == e2);
  CHECK(m0.size() >= 2);  // at most one end evicted
  CHECK(e0 == epoch);     // here: neither (no second observer)
  check_invariants(c, 1);
  c.check_clean();
}

TEST_CASE("snapshot cluster: one-way reachability does not wedge; a killed node is published",
          "[snapshot]") {
  // B2: 5 nodes; node 0 receives nothing from anyone (its incoming traffic dropped) but is heard
  // by all. Node 0 suspects everyone, alone: nobody is evicted. Then node 3 is killed: its lease
  // runs out (and 1, 2, 4 suspect it): a new record without it within a few seconds.
  constexpr int kNodes = 5;
  Cluster c(kNodes, "snap1way", false, 3);
  const std::string b0 = test::temp_path(c.tag + "-block0");
  std::ofstream(b0) << "";
  for (int i = 0; i < kNodes; ++i) c.start(i, i == 0 ? "R2CCL_SNAPD_TEST_BLOCK_FILE=" + b0 : "");
  for (int i = 0; i < kNodes; ++i) REQUIRE(c.wait_socket(i));
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, 10000));
  }
  uint64_t epoch = 0;
  board_members(c.boards[1], &epoch);
  std::ofstream(b0) << "in:1 in:2 in:3 in:4\n";
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  {
    uint64_t e = 0;
    INFO(c.all_logs());
    CHECK(board_members(c.boards[1], &e).size() == 5);
    CHECK(e == epoch);
  }
  c.stop(3, SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, {0, 1, 2, 4}, {0, 1, 2, 4}, 10000, epoch));
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("published after " << took << " s");
  check_invariants(c, 1);
  c.check_clean();
}

namespace {
// A cluster of `n` nodes with one rank each, steps 1..steps taken and complete.
void start_and_take(Cluster& c, std::vector<std::unique_ptr<Rank>>* ranks, uint64_t steps,
                    const std::vector<std::string>& env = {}) {
  for (int i = 0; i < c.n; ++i) c.start(i, i < int(env.size()) ? env[i] : "");
  for (int i = 0; i < c.n; ++i) REQUIRE(c.wait_socket(i));
  std::vector<int> all;
  for (int i = 0; i < c.n; ++i) all.push_back(i);
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, all, all, 10000));
  }
  for (int r = 0; r < c.n; ++r) {
    ranks->push_back(std::make_unique<Rank>(r, c.n, 4000));
    REQUIRE((*ranks)[r]->open(c.sockets[r]) == 0);
  }
  for (uint64_t s = 1; s <= steps; ++s)
    for (auto& r : *ranks) REQUIRE(r->take(s) == 0);
  INFO(c.all_logs());
  REQUIRE(complete_at_least((*ranks)[0]->h, steps));
}
// The node the log lines say is coordinator now (the last "elected coordinator" per node that
// did not say "not the coordinator" after it); -1 if none.
int coordinator_of(const Cluster& c) {
  int who = -1;
  double when = -1;
  for (int i = 0; i < c.n; ++i) {
    if (c.pids[i] <= 0) continue;
    std::istringstream lines(test::read_file(c.logs[i]));
    std::string line;
    bool on = false;
    double t = -1;
    while (std::getline(lines, line)) {
      if (line.find("etcd: elected coordinator") != std::string::npos) {
        on = true;
        t = std::atof(line.c_str() + 1);
      } else if (line.find("etcd: not the coordinator") != std::string::npos ||
                 line.find("listening on") != std::string::npos) {
        on = false;
      }
    }
    if (on && t > when) {
      who = i;
      when = t;
    }
  }
  return who;
}
}  // namespace

TEST_CASE(
    "snapshot cluster: the coordinator killed: a restorable step stays, every rank restores it",
    "[snapshot]") {
  // B3 and B4: 4 nodes, steps 1..3 complete; the coordinator is killed with SIGKILL. The new
  // coordinator publishes a record whose restore step is 3 (never "none" from an empty view),
  // and every surviving rank restores that same step.
  Cluster c(4, "snapck", false, 4);
  std::vector<std::unique_ptr<Rank>> ranks;
  start_and_take(c, &ranks, 3);
  const int victim = coordinator_of(c);
  INFO(c.all_logs());
  REQUIRE(victim >= 0);
  uint64_t epoch = 0;
  board_members(c.boards[victim == 0 ? 1 : 0], &epoch);
  c.stop(victim, SIGKILL);
  ranks[victim]->close();
  std::vector<int> rest, members;
  for (int i = 0; i < 4; ++i)
    if (i != victim) rest.push_back(i);
  members = rest;
  REQUIRE(boards_agree(c, rest, members, 10000, epoch));
  // For a while after the takeover, every survivor's state still has step 3.
  for (int k = 0; k < 10; ++k) {
    for (int r : rest) {
      r2ccl_snap_state_t st;
      REQUIRE(r2ccl_snap_state(ranks[r]->h, &st) == 0);
      CHECK(st.has_complete_step);
      CHECK(st.complete_step == 3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (int r : rest) {
    ranks[r]->fill(77);
    uint64_t step = 0;
    const int rc = r2ccl_snap_restore(ranks[r]->h, 10 * 1000000, &step);
    INFO("rank " << r << ": " << err_of(rc));
    REQUIRE(rc == 0);
    CHECK(step == 3);
    CHECK(ranks[r]->holds(3));
  }
  std::string rec;
  REQUIRE(c.etcd->get("/r2ccl/" + c.tag + "/record", &rec));
  CHECK(rec.find("\"restore_step\":3") != std::string::npos);
  check_invariants(c, 1);
  c.check_clean();
}

TEST_CASE(
    "snapshot cluster: restarts: a daemon back within one period is a new incarnation; "
    "epochs survive a full restart",
    "[snapshot]") {
  // B7. Node 2 is killed and started again at once (within one heartbeat period, well inside
  // its lease): the coordinator sees a new incarnation, so a new epoch (a loss and a join).
  // Then every daemon stops and starts again: epochs go on from etcd, never back to 1.
  Cluster c(3, "snaprs", false, 5);
  std::vector<std::unique_ptr<Rank>> ranks;
  start_and_take(c, &ranks, 2);
  uint64_t epoch = 0;
  board_members(c.boards[0], &epoch);
  ranks[2]->close();
  c.stop(2, SIGKILL);
  c.start(2);
  REQUIRE(c.wait_socket(2));
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, {0, 1, 2}, {0, 1, 2}, 10000, epoch));
    CHECK(c.all_logs().find("restarted: new incarnation") != std::string::npos);
  }
  board_members(c.boards[0], &epoch);
  for (auto& r : ranks) r->close();
  for (int i = 0; i < 3; ++i) c.stop(i, SIGTERM);
  for (int i = 0; i < 3; ++i) c.start(i);
  for (int i = 0; i < 3; ++i) REQUIRE(c.wait_socket(i));
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, {0, 1, 2}, {0, 1, 2}, 10000, epoch));
  }
  check_invariants(c, 0);  // epochs increase in every log, across both restarts
  c.check_clean();
}

TEST_CASE("snapshot cluster: a paused coordinator's write is refused by its fence", "[snapshot]") {
  // SIGSTOP the coordinator for 3 lease TTLs: the others elect another and write a record
  // without it. On SIGCONT its first act (the test hook) is a record write from its stale
  // view: etcd refuses it (its election key is gone). It then registers again.
  Cluster c(3, "snapfe", false, 6);
  std::vector<std::unique_ptr<Rank>> ranks;
  const std::string hook = "R2CCL_SNAPD_TEST_WRITE_AFTER_PAUSE=1";
  start_and_take(c, &ranks, 1, {hook, hook, hook});
  const int victim = coordinator_of(c);
  REQUIRE(victim >= 0);
  uint64_t epoch = 0;
  board_members(c.boards[victim == 0 ? 1 : 0], &epoch);
  kill(c.pids[victim], SIGSTOP);
  std::vector<int> rest;
  for (int i = 0; i < 3; ++i)
    if (i != victim) rest.push_back(i);
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, rest, rest, 10000, epoch));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  kill(c.pids[victim], SIGCONT);
  {
    INFO(c.all_logs());
    REQUIRE(boards_agree(c, {0, 1, 2}, {0, 1, 2}, 10000, epoch + 1));
  }
  const std::string log = test::read_file(c.logs[victim]);
  INFO(log);
  CHECK(log.find("was refused by the fence") != std::string::npos);
  CHECK(log.find("was ACCEPTED") == std::string::npos);
  check_invariants(c, 1);
  c.check_clean();
}

TEST_CASE("snapshot cluster: etcd's leader killed (3 members); etcd unreachable for 10 s",
          "[snapshot]") {
  Cluster c(3, "snapet", false, 7, 3);
  std::vector<std::unique_ptr<Rank>> ranks;
  start_and_take(c, &ranks, 1);
  uint64_t epoch = 0;
  board_members(c.boards[0], &epoch);
  // The etcd leader dies: the members elect another; leases are kept (etcd extends them on a
  // leader change); no daemon is lost, the job keeps taking snapshots.
  const int leader = c.etcd->leader();
  REQUIRE(leader >= 0);
  c.etcd->kill_member(leader);
  for (auto& r : ranks) REQUIRE(r->take(2) == 0);
  {
    INFO(c.all_logs() << c.etcd->logs());
    CHECK(complete_at_least(ranks[0]->h, 2, 15000));
  }
  uint64_t e = 0;
  CHECK(board_members(c.boards[0], &e).size() == 3);
  CHECK(e == epoch);
  // etcd unreachable for 10 s (both remaining members stopped): training and replication go on,
  // no decision is made; when etcd is back, leases that ran out are registered again with the
  // same incarnation: no new epoch, no rebuild.
  for (int i = 0; i < 3; ++i)
    if (i != leader) c.etcd->pause_member(i, true);
  for (uint64_t s = 3; s <= 5; ++s) {
    for (auto& r : ranks) REQUIRE(r->take(s) == 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  }
  for (int i = 0; i < 3; ++i)
    if (i != leader) c.etcd->pause_member(i, false);
  {
    INFO(c.all_logs() << c.etcd->logs());
    CHECK(complete_at_least(ranks[0]->h, 5, 15000));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  const std::string logs = c.all_logs();
  INFO(logs);
  CHECK(board_members(c.boards[0], &e).size() == 3);
  CHECK(e == epoch);
  for (int i = 0; i < 3; ++i) {
    const std::string l = test::read_file(c.logs[i]);
    CHECK(l.find("WARN etcd unreachable") != std::string::npos);
    CHECK(l.find("etcd reachable again after") != std::string::npos);
  }
  check_invariants(c, 0);
  c.check_clean();
}
