// The snapshot daemons' end-to-end test harness (issue 15), shared by the loopback cluster test
// and the long soak: N r2ccl_snapshotd on 127.0.0.1 with their own etcd (etcd_fixture.h), one
// training "rank" per node on the client library, and the checks every run must pass
// (check_invariants). Header-only: it uses Catch2's macros, so only test sources include it.
// Thread-safety: none; the test thread owns a Cluster.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
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

namespace r2ccl::test::snapd {

inline std::string daemon_path() {
  return test::env_or("R2CCL_TEST_SNAPSHOTD", R2CCL_BINARY_DIR "/bin/r2ccl_snapshotd");
}

// N daemons on 127.0.0.1, heartbeat 100 ms, a 1 s lease (both settable), and their own etcd.
struct Cluster {
  int n = 0;
  std::string tag, peers, token, topology;
  std::unique_ptr<test::EtcdCluster> etcd;
  std::vector<std::string> boards, sockets, spills, logs;
  std::vector<pid_t> pids;
  std::vector<std::string> extra;  // more daemon arguments for every node
  int period_ms = 100;             // --period-ms of every node
  int lease_ttl_s = 1;             // --lease-ttl of every node

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
      // The daemon dies with the test: a test killed outright (a timeout, the OOM killer) must
      // not leave daemons loading the machine for the next tests.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
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
                                 std::to_string(period_ms),
                                 "--socket",
                                 sockets[i],
                                 "--etcd",
                                 etcd->endpoints(),
                                 "--job",
                                 tag,
                                 "--lease-ttl",
                                 std::to_string(lease_ttl_s)};
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

inline std::string err_of(int rc) {
  return std::string(r2ccl_snap_strerror(rc)) + ": " + r2ccl_snap_last_error(nullptr);
}

// Waits until h's daemon says `pred(state)`.
template <class Pred>
inline bool wait_state(r2ccl_snap_t* h, int ms, Pred pred, r2ccl_snap_state_t* out) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (r2ccl_snap_state(h, out) == 0 && pred(*out)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

inline bool complete_at_least(r2ccl_snap_t* h, uint64_t step, int ms = 10000) {
  r2ccl_snap_state_t s;
  return wait_state(
      h, ms,
      [&](const r2ccl_snap_state_t& x) { return x.has_complete_step && x.complete_step >= step; },
      &s);
}

// GET /metrics from the daemon whose log says "Prometheus metrics on ... (port N)".
inline std::string scrape(const std::string& log) {
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
inline double metric(const std::string& page, const std::string& name) {
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
inline bool wait_board_members(const std::string& b, int members, int ms = 10000) {
  for (int w = 0; w <= ms; w += 20) {
    board::AgreedRecord r;
    std::string err;
    if (board::read_agreed_record(b, &r, &err) && board::member_count(r) == members) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

inline void flip_byte(const std::string& path, long offset) {
  FILE* f = fopen(path.c_str(), "r+b");
  REQUIRE(f != nullptr);
  REQUIRE(fseek(f, offset, SEEK_SET) == 0);
  const int c = fgetc(f);
  REQUIRE(c != EOF);
  REQUIRE(fseek(f, offset, SEEK_SET) == 0);
  fputc(c ^ 0x5a, f);
  fclose(f);
}

// The record every node's board holds now, read with its members as a sorted id list.
inline std::vector<int> board_members(const std::string& board, uint64_t* epoch) {
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
inline bool boards_agree(Cluster& c, const std::vector<int>& nodes, const std::vector<int>& members,
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
inline void check_invariants(Cluster& c, int max_evictions) {
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
  REQUIRE(c.etcd->get(prefix + "w/record", &rec));
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

// A cluster of `n` nodes with one rank each, steps 1..steps taken and complete.
inline void start_and_take(Cluster& c, std::vector<std::unique_ptr<Rank>>* ranks, uint64_t steps,
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
inline int coordinator_of(const Cluster& c) {
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

}  // namespace r2ccl::test::snapd
