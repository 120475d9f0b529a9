// r2ccl_snapshot_bench: the snapshot sidecar's benchmarks (issue 6; docs/BENCHMARKS.md,
// "Snapshot sidecar"). Starts its own loopback cluster of r2ccl_snapshotd processes (one per
// "node": own peer port, client socket, health board), runs training ranks as threads of this
// process through the client C API (libr2ccl-snapshot), and prints one line per measurement,
// `key value unit`, then a human table (lines starting with '|' or '#').
//
//   --mode take      2 nodes, world 1: rank 0 on node 0 (node 1 holds the replica). Registers
//                    --bytes of FP16 state and takes --steps snapshots: take()'s blocking time
//                    (copy, wait), the background encode/send, encoded bytes and ratio, the
//                    lossy codec's max error, and the time until the step is complete (held by
//                    a replica). --codec both runs lossless, then lossy, each on a new cluster.
//   --mode restore   3 nodes, world 1: a few takes, then r2ccl_snap_restore() timed from the
//                    home copy (node 0), from a replica held on the rank's new node (node 0's
//                    daemon SIGKILLed, a replacement rank on node 1), and from the replicas over
//                    TCP (a replacement daemon for node 0, empty, and a rank on it).
//   --mode recovery  --nodes N daemons, one rank per node, --bytes in total split across them;
//                    --kills times: SIGKILL a non-coordinator daemon (in turn), then the phases:
//                    detection (the first survivor's suspicion in its log, or the victim's
//                    member key deleted by etcd when its lease ran out), agreement (every
//                    survivor wrote the new record to its board), rebuild
//                    (r2ccl_snap_rebuild_comm on every rank with a fake NCCL table: the unique
//                    id through the KV; NCCL's init itself is not run), restore (the survivors
//                    from their home copies and a pre-started standby rank on a surviving node
//                    from the replicas, all at once), then a cold replacement daemon + rank
//                    restoring from the replicas, and the cluster whole again. --path says
//                    which eviction path the configuration is meant to take (suspicion:
//                    heartbeat 100 ms; lease: heartbeat 2000 ms, so a 3 s lease runs out
//                    before any suspicion); p50/p99 over the kills that took it.
//   --mode decode    no cluster: one buffer of --bytes FP16, --steps snapshots (a base and
//                    deltas) encoded as the client does, then the chain decoded frame by frame
//                    (DeltaDecoder::apply_streaming) and in one pass (apply_chain), best of 5
//                    each, into warm memory, checked bit for bit.
//   --mode pages     no cluster: the first user-mode access of --bytes of fresh memory, as
//                    staging was allocated before (mmap with MAP_POPULATE, then one store per
//                    4 KiB page) and as it is now (big_alloc: huge pages, prefaulted by stores),
//                    and a memset of memory already touched; best of 3.
// The control plane: a one-member etcd started here (free loopback ports, a temporary data
// directory, killed at exit), or --etcd URL; each cluster is its own job (/r2ccl/TAG/), its keys
// deleted at the end. Log stamps are CLOCK_MONOTONIC, std::chrono::steady_clock here.
//
// State model: FP16 weights N(0, 0.02); a step moves --changed-fraction of them (default 1 %,
// drawn with replacement) by --lr * N(0,1) (default 1e-4, clipped at 4 sigma), or, with
// --update adam, the state is an FP16 Adam first moment m = 0.9 m + 0.1 g, g ~ N(0, 1e-3), every
// element changing every step. Normal samples come from a table of 2^20 draws of
// std::normal_distribution picked by a xoshiro256** index (fast enough for 2^29 elements).
//
// Exit status: 0 every measurement ran (numbers are reported, not judged); 1 something failed
// (the message says what); 2 bad arguments.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>

#include "local_etcd.h"
#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/big_buffer.h"
#include "r2ccl/snapshot/codec.h"
#include "r2ccl/snapshot/coordinator.h"
#include "r2ccl/snapshot/etcd.h"
#include "r2ccl/snapshot_client.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

struct Fail : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void fail(const std::string& m) { throw Fail(m); }
void check(int rc, const std::string& what) {
  if (rc != R2CCL_SNAP_OK)
    fail(what + ": " + r2ccl_snap_strerror(rc) + ": " + r2ccl_snap_last_error(nullptr));
}
void note(const std::string& m) { fprintf(stderr, "[bench] %s\n", m.c_str()); }

// ---- output: `key value unit` lines as measured, the human table at the end ----
struct Report {
  std::vector<std::string> table;
  void put(const std::string& key, double v, const char* unit) {
    if (std::isnan(v))
      printf("%s nan %s\n", key.c_str(), unit);
    else
      printf("%s %.6g %s\n", key.c_str(), v, unit);
    fflush(stdout);
  }
  void row(const std::string& r) { table.push_back(r); }
  void print_table() const {
    printf("#\n");
    for (const auto& r : table) printf("%s\n", r.c_str());
    fflush(stdout);
  }
};
Report out;

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
double vmax(const std::vector<double>& v) {
  return v.empty() ? NAN : *std::max_element(v.begin(), v.end());
}
std::string fmt(double v, const char* f = "%.3f") {
  if (std::isnan(v)) return "-";
  char b[64];
  snprintf(b, sizeof(b), f, v);
  return b;
}
std::string mib(double bytes) { return fmt(bytes / (1 << 20), "%.1f"); }

uint64_t parse_size(const std::string& s) {
  char* end = nullptr;
  const double v = strtod(s.c_str(), &end);
  std::string suf(end);
  double m = 1;
  if (suf == "K" || suf == "KiB")
    m = 1024.0;
  else if (suf == "M" || suf == "MiB")
    m = 1024.0 * 1024;
  else if (suf == "G" || suf == "GiB")
    m = 1024.0 * 1024 * 1024;
  else if (!suf.empty())
    throw CLI::ValidationError("--bytes", "'" + s + "': a number with K, M or G");
  if (!(v > 0)) throw CLI::ValidationError("--bytes", "'" + s + "': must be > 0");
  return static_cast<uint64_t>(v * m);
}

// ---- the state model ----
struct Rng {  // xoshiro256**
  uint64_t s[4];
  explicit Rng(uint64_t seed) {
    for (auto& x : s) {  // splitmix64
      seed += 0x9e3779b97f4a7c15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      x = z ^ (z >> 31);
    }
  }
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t next() {
    const uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
  }
};
const std::vector<float>& normal_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(1u << 20);
    std::mt19937_64 g(12345);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : v) x = std::max(-4.0f, std::min(4.0f, nd(g)));
    return v;
  }();
  return t;
}

struct ModelCfg {
  std::string update = "sparse";  // sparse | adam
  double changed_fraction = 0.01;
  double lr = 1e-4;
};

// One rank's FP16 state (its registered buffers are slices of `h`).
struct State {
  std::vector<uint16_t> h;
  ModelCfg cfg;
  Rng rng;
  State(size_t bytes, const ModelCfg& c, uint64_t seed) : h(bytes / 2), cfg(c), rng(seed) {
    const float* nt = normal_table().data();
    const float sd = cfg.update == "adam" ? 1e-3f : 0.02f;
    for (auto& x : h) x = r2ccl::snap::float_to_fp16(sd * nt[rng.next() >> 44]);
  }
  void update() {
    const float* nt = normal_table().data();
    const size_t n = h.size();
    if (cfg.update == "adam") {
      for (size_t i = 0; i < n; ++i)
        h[i] = r2ccl::snap::float_to_fp16(0.9f * r2ccl::snap::fp16_to_float(h[i]) +
                                          0.1f * 1e-3f * nt[rng.next() >> 44]);
      return;
    }
    const float lr = static_cast<float>(cfg.lr);
    if (cfg.changed_fraction >= 1) {
      for (size_t i = 0; i < n; ++i)
        h[i] = r2ccl::snap::float_to_fp16(r2ccl::snap::fp16_to_float(h[i]) +
                                          lr * nt[rng.next() >> 44]);
      return;
    }
    const size_t k = static_cast<size_t>(cfg.changed_fraction * static_cast<double>(n));
    for (size_t j = 0; j < k; ++j) {
      const uint64_t r = rng.next();
      const size_t i = static_cast<size_t>((r >> 20) % n);
      h[i] = r2ccl::snap::float_to_fp16(r2ccl::snap::fp16_to_float(h[i]) + lr * nt[r & 0xfffff]);
    }
  }
  uint64_t hash() const {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(h.data());
    const size_t nw = h.size() * 2 / 8;
    uint64_t a = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < nw; ++i) a = (a ^ w[i]) * 0x100000001b3ull;
    for (size_t i = nw * 4; i < h.size(); ++i) a = (a ^ h[i]) * 0x100000001b3ull;
    return a;
  }
  void zero() { std::fill(h.begin(), h.end(), uint16_t(0)); }
};

// Daemons started and not yet reaped, for the SIGINT/SIGTERM handler (kill() is
// async-signal-safe): an interrupted benchmark leaves no daemon behind.
constexpr int kMaxChildren = 64;
std::atomic<pid_t> g_children[kMaxChildren];
void track(pid_t pid, bool add) {
  for (auto& c : g_children) {
    pid_t want = add ? 0 : pid;
    if (c.compare_exchange_strong(want, add ? pid : 0)) return;
  }
}
extern "C" void on_signal(int sig) {
  for (auto& c : g_children) {
    const pid_t p = c.load();
    if (p > 0) kill(p, SIGKILL);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

int free_port() {
  const int port = r2ccl::snap::free_loopback_port();
  if (port < 0) fail("cannot find a free loopback port");
  return port;
}

namespace etcd = r2ccl::snap::etcd;

// Every change under a job's etcd prefix, stamped with the steady clock (CLOCK_MONOTONIC, the
// daemons' log clock) when this process's watch delivered it.
struct EtcdTrace {
  struct Ev {
    double t;
    bool put;
    std::string key, value;
  };
  std::string prefix;
  mutable std::mutex mu;
  std::vector<Ev> evs;
  std::unique_ptr<etcd::Watch> watch;
  EtcdTrace(const std::string& url, const std::string& pfx) : prefix(pfx) {
    etcd::Options eo;
    eo.endpoints = {url};
    etcd::Client c(eo);
    std::vector<etcd::KeyValue> now;
    int64_t rev = 0;
    const etcd::Status st = c.range(prefix, etcd::prefix_end(prefix), &now, &rev);
    if (!st.ok()) fail("etcd " + url + ": " + st.message);
    watch = std::make_unique<etcd::Watch>(
        eo, prefix, rev + 1,
        [this](const std::vector<etcd::WatchEvent>& e, int64_t) {
          const double t = now_s();
          std::lock_guard<std::mutex> l(mu);
          for (const auto& x : e)
            evs.push_back({t, x.type == etcd::WatchEvent::kPut, x.kv.key, x.kv.value});
        },
        [url, this] {
          etcd::Options o2;
          o2.endpoints = {url};
          etcd::Client c2(o2);
          std::vector<etcd::KeyValue> all;
          int64_t r = 0;
          c2.range(prefix, etcd::prefix_end(prefix), &all, &r);
          return r;
        },
        nullptr);
  }
  // When the first event after `after` of that kind under prefix + `key` came; NaN: none.
  double first_time(double after, bool put, const std::string& key) const {
    const std::vector<double> t = distinct_times(after, put, key);
    return t.empty() ? NAN : t.front();
  }
  // Times of the events after `after` of that kind under prefix + `key`, distinct keys only.
  std::vector<double> distinct_times(double after, bool put, const std::string& key) const {
    std::lock_guard<std::mutex> l(mu);
    std::vector<double> t;
    std::vector<std::string> seen;
    for (const auto& e : evs)
      if (e.t >= after && e.put == put &&
          e.key.compare(0, prefix.size() + key.size(), prefix + key) == 0 &&
          std::find(seen.begin(), seen.end(), e.key) == seen.end()) {
        seen.push_back(e.key);
        t.push_back(e.t);
      }
    return t;
  }
  // The newest record put after `after` with epoch >= `epoch` (decoded), and when it came.
  bool record(double after, uint64_t epoch, r2ccl::snap::Record* r, double* t) const {
    std::lock_guard<std::mutex> l(mu);
    for (const auto& e : evs) {
      if (e.t < after || !e.put || e.key != prefix + "w/record") continue;
      std::string err;
      if (r2ccl::snap::decode_record(e.value, r, &err) && r->epoch >= epoch) {
        *t = e.t;
        return true;
      }
    }
    return false;
  }
};

// ---- a loopback cluster of r2ccl_snapshotd ----
struct Cluster {
  std::string daemon, dir, peers, token, tag, etcd_url, prefix;
  int n = 0, period_ms = 100, lease_ttl = 3;
  std::vector<std::string> boards, sockets, logs, extra;
  std::vector<pid_t> pids;
  bool keep = false;

  // `etcd_url`: the control plane's etcd; the cluster's keys live under /r2ccl/TAG/ (its own
  // job name) and are deleted at the end.
  Cluster(const std::string& daemon_path, const std::string& workdir, int nodes, int period,
          std::vector<std::string> more, bool keep_files, const std::string& etcd, int ttl)
      : daemon(daemon_path),
        etcd_url(etcd),
        n(nodes),
        period_ms(period),
        lease_ttl(ttl),
        extra(std::move(more)),
        keep(keep_files) {
    std::string t = workdir + "/r2ccl-bench.XXXXXX";
    if (!mkdtemp(t.data())) fail("cannot create a directory under " + workdir);
    dir = t;
    tag = "r2bench" + std::to_string(getpid()) + "-" + dir.substr(dir.size() - 6);
    prefix = "/r2ccl/" + tag + "/";
    peers = dir + "/peers";
    token = dir + "/token";
    std::ofstream p(peers);
    for (int i = 0; i < n; ++i) p << i << " 127.0.0.1:" << free_port() << "\n";
    p.close();
    std::ofstream(token) << "bench-" << tag << "\n";
    ::chmod(token.c_str(), 0600);
    for (int i = 0; i < n; ++i) {
      boards.push_back(tag + "-b" + std::to_string(i));
      r2ccl::board::remove_board(boards.back());
      sockets.push_back(dir + "/n" + std::to_string(i) + ".sock");
      logs.push_back(dir + "/node" + std::to_string(i) + ".log");
      pids.push_back(-1);
    }
  }
  ~Cluster() {
    for (int i = 0; i < n; ++i) stop(i, SIGKILL);
    for (auto& b : boards) r2ccl::board::remove_board(b);
    etcd::Options eo;
    eo.endpoints = {etcd_url};
    etcd::Client(eo).del(prefix, etcd::prefix_end(prefix));
    if (keep || std::uncaught_exceptions() > 0) {
      note("kept " + dir);
    } else {
      for (int i = 0; i < n; ++i) {
        ::unlink(logs[i].c_str());
        ::unlink(sockets[i].c_str());
      }
      ::unlink(peers.c_str());
      ::unlink(token.c_str());
      ::rmdir(dir.c_str());
    }
  }
  void start(int i) {
    ::unlink(sockets[i].c_str());
    std::vector<std::string> a{daemon,
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
                               etcd_url,
                               "--job",
                               tag,
                               "--lease-ttl",
                               std::to_string(lease_ttl)};
    a.insert(a.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, logs[i].c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, daemon.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) fail("cannot start " + daemon + ": " + strerror(rc));
    pids[i] = pid;
    track(pid, true);
  }
  void stop(int i, int sig) {
    if (pids[i] <= 0) return;
    kill(pids[i], sig);
    int st;
    waitpid(pids[i], &st, 0);
    track(pids[i], false);
    pids[i] = -1;
  }
  // Lines of node i's log saying its heartbeats stopped hearing a peer (a suspicion).
  int declared_failed(int i) const {
    std::istringstream s(read(i));
    std::string line;
    int n = 0;
    while (std::getline(s, line))
      n += line.find("no heartbeat for") != std::string::npos &&
           line.find("suspected") != std::string::npos;
    return n;
  }
  void wait_socket(int i, int ms = 10000) {
    for (int w = 0; w <= ms; w += 5) {
      struct stat st;
      if (stat(sockets[i].c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) return;
      int status;
      if (pids[i] > 0 && waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        track(pids[i], false);
        pids[i] = -1;
        fail("node " + std::to_string(i) + "'s daemon exited; its log:\n" + read(i));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    fail("node " + std::to_string(i) + "'s client socket did not appear; its log:\n" + read(i));
  }
  std::string read(int i) const {
    std::ifstream f(logs[i]);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  // Peak resident memory of node i's daemon (VmHWM), MiB; NaN when it is not running.
  double hwm_mib(int i) const {
    if (pids[i] <= 0) return NAN;
    std::ifstream f("/proc/" + std::to_string(pids[i]) + "/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
    return NAN;
  }
  // The first line of node i's log stamped after `after` containing every string in `has`.
  std::string log_line(int i, double after, const std::vector<std::string>& has) const {
    std::istringstream s(read(i));
    std::string line;
    while (std::getline(s, line)) {
      double t = 0;
      if (sscanf(line.c_str(), "[%lf]", &t) != 1 || t < after) continue;
      bool all = true;
      for (const auto& h : has) all = all && line.find(h) != std::string::npos;
      if (all) return line;
    }
    return "";
  }
  // The CLOCK_MONOTONIC stamp (s) of the first line of node i's log after `after` containing
  // every string in `has`; NaN when none.
  double log_time(int i, double after, const std::vector<std::string>& has) const {
    std::istringstream s(read(i));
    std::string line;
    while (std::getline(s, line)) {
      double t = 0;
      if (sscanf(line.c_str(), "[%lf]", &t) != 1 || t < after) continue;
      bool all = true;
      for (const auto& h : has) all = all && line.find(h) != std::string::npos;
      if (all) return t;
    }
    return NAN;
  }
};

// ---- one rank: a handle and its state ----
struct Rank {
  uint32_t rank = 0, world = 1;
  r2ccl_snap_t* h = nullptr;
  std::unique_ptr<State> st;
  std::map<uint64_t, uint64_t> hash_at;  // step -> state hash when it was taken
  ~Rank() { r2ccl_snap_close(h); }
  void close() {
    r2ccl_snap_close(h);
    h = nullptr;
  }
  void open(const std::string& socket, int buffers, int codec) {
    check(r2ccl_snap_open(socket.c_str(), rank, world, &h), "open rank " + std::to_string(rank));
    const size_t total = st->h.size(), per = (total + buffers - 1) / buffers;
    uint32_t id = 0;
    for (size_t off = 0; off < total; off += per) {
      const size_t cnt = std::min(per, total - off);
      check(
          r2ccl_snap_register(h, id++, st->h.data() + off, cnt * 2, R2CCL_SNAP_DTYPE_F16, codec, 0),
          "register");
    }
  }
};

// Waits until h's daemon reports `pred(state)` (wait_event, so no polling delay). Returns the
// time (steady clock, s) it was seen, or NaN on timeout.
double wait_for(r2ccl_snap_t* h, double timeout_s,
                const std::function<bool(const r2ccl_snap_state_t&)>& pred,
                r2ccl_snap_state_t* last = nullptr) {
  const double end = now_s() + timeout_s;
  r2ccl_snap_state_t s{};
  if (r2ccl_snap_state(h, &s) == 0 && pred(s)) {
    if (last) *last = s;
    return now_s();
  }
  while (now_s() < end) {
    const int rc = r2ccl_snap_wait_event(h, static_cast<int64_t>((end - now_s()) * 1e6) + 1, &s);
    if (rc == R2CCL_SNAP_ERR_TIMEOUT) break;
    check(rc, "wait_event");
    if (pred(s)) {
      if (last) *last = s;
      return now_s();
    }
  }
  if (last) r2ccl_snap_state(h, last);
  return NAN;
}
auto complete_at_least(uint64_t step) {
  return [step](const r2ccl_snap_state_t& s) {
    return s.has_complete_step && s.complete_step >= step;
  };
}
auto members_are(uint32_t count) {
  return [count](const r2ccl_snap_state_t& s) { return s.epoch > 0 && s.member_count == count; };
}
bool has_member(const r2ccl_snap_state_t& s, uint32_t id) {
  return (s.members[id / 64] >> (id % 64)) & 1u;
}

void parallel(size_t n, const std::function<void(size_t)>& f) {
  std::vector<std::thread> t;
  std::vector<std::string> errs(n);
  for (size_t i = 0; i < n; ++i)
    t.emplace_back([&, i] {
      try {
        f(i);
      } catch (const std::exception& e) {
        errs[i] = e.what();
      }
    });
  for (auto& x : t) x.join();
  for (auto& e : errs)
    if (!e.empty()) fail(e);
}

double maxrss_mib() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

struct Opts {
  std::string mode = "take", daemon, workdir = "/tmp", codec = "both";
  std::string etcd_url, etcd_bin = "/usr/bin/etcd", path = "suspicion";
  int lease_ttl = 3, kills = 10;
  uint64_t bytes = 1ull << 30;
  int steps = 10, nodes = 4, period_ms = 100, buffers = 1;
  double step_ms = 0, timeout_s = 120;
  int mem_limit_mb = 0;
  uint64_t seed = 1;
  bool keep = false;
  ModelCfg model;
};

std::vector<std::string> daemon_extra(const Opts& o) {
  std::vector<std::string> e;
  if (o.mem_limit_mb > 0) e = {"--mem-limit-mb", std::to_string(o.mem_limit_mb)};
  return e;
}

int codec_of(const std::string& c) {
  return c == "lossy" ? R2CCL_SNAP_CODEC_LOSSY : R2CCL_SNAP_CODEC_LOSSLESS;
}

// ---- --mode take ----
struct StepRec {
  uint64_t step = 0;
  double update = NAN, call = NAN, copy = NAN, wait = NAN, flush = NAN, replicated = NAN;
  bool harvested = false;
  double encode = NAN, send = NAN, ratio = NAN, err = NAN;
  uint64_t raw = 0, encoded = 0;
  uint32_t bases = 0;
};

void run_take(const Opts& o, const std::string& codec) {
  const std::string k = "take." + o.model.update + "." + codec + ".";
  note("take, " + codec + ": 2 nodes, rank 0 on node 0 with " + mib(double(o.bytes)) +
       " MiB of FP16");
  Cluster c(o.daemon, o.workdir, 2, o.period_ms, daemon_extra(o), o.keep, o.etcd_url, o.lease_ttl);
  c.start(0);
  c.start(1);
  c.wait_socket(0);
  c.wait_socket(1);
  Rank r;
  const auto t_init = Clock::now();
  r.st = std::make_unique<State>(o.bytes, o.model, o.seed);
  out.put(k + "state_init_seconds", secs(t_init, Clock::now()), "s");
  r.open(c.sockets[0], o.buffers, codec_of(codec));
  if (std::isnan(wait_for(r.h, 20, members_are(2))))
    fail("the 2 daemons did not agree on a membership");
  std::vector<StepRec> recs;
  std::map<uint64_t, size_t> idx;
  auto harvest = [&](const r2ccl_snap_take_stats_t& s) {
    if (!s.prev_valid || !idx.count(s.prev_step)) return;
    StepRec& x = recs[idx[s.prev_step]];
    if (x.harvested) return;
    x.harvested = true;
    x.encode = s.prev_encode_seconds;
    x.send = s.prev_send_seconds;
    x.raw = s.prev_raw_bytes;
    x.encoded = s.prev_encoded_bytes;
    x.ratio = s.prev_ratio;
    x.err = s.prev_max_abs_error;
    x.bases = s.prev_base_buffers;
  };
  const bool pipelined = o.step_ms > 0;
  int incomplete = 0;
  auto step_start = Clock::now();
  for (int i = 1; i <= o.steps; ++i) {
    StepRec x;
    x.step = static_cast<uint64_t>(i);
    if (i > 1) {
      const auto a = Clock::now();
      r.st->update();
      x.update = secs(a, Clock::now());
    }
    if (pipelined) {
      std::this_thread::sleep_until(step_start +
                                    std::chrono::microseconds(int64_t(o.step_ms * 1000)));
      step_start = Clock::now();
    }
    r2ccl_snap_take_stats_t s{};
    const auto a = Clock::now();
    check(r2ccl_snap_take(r.h, x.step, &s), "take step " + std::to_string(i));
    const auto b = Clock::now();
    x.call = secs(a, b);
    x.copy = s.copy_seconds;
    x.wait = s.wait_seconds;
    idx[x.step] = recs.size();
    recs.push_back(x);
    harvest(s);
    if (!pipelined) {
      check(r2ccl_snap_flush(r.h, int64_t(o.timeout_s * 1e6)), "flush");
      const auto f = Clock::now();
      recs.back().flush = secs(b, f);
      // A step that does not become complete in time is reported (NaN) and the run goes on:
      // a later step can complete it (the newest complete step only grows).
      const double t = wait_for(r.h, std::min(o.timeout_s, 60.0), complete_at_least(x.step));
      if (std::isnan(t)) {
        ++incomplete;
        note("step " + std::to_string(i) + " did not become complete in " +
             fmt(std::min(o.timeout_s, 60.0), "%g") + " s (nodes declared failed so far: " +
             std::to_string(c.declared_failed(0) + c.declared_failed(1)) + ")");
      }
      recs.back().replicated = t - std::chrono::duration<double>(b.time_since_epoch()).count();
    }
    fprintf(stderr, "[bench]   step %d: take %.3f s (copy %.3f, wait %.3f)\n", i, x.call, x.copy,
            x.wait);
  }
  // One more take after a flush hands back the stats of the last measured step.
  check(r2ccl_snap_flush(r.h, int64_t(o.timeout_s * 1e6)), "flush");
  const double t_done =
      wait_for(r.h, std::min(o.timeout_s, 60.0), complete_at_least(uint64_t(o.steps)));
  if (std::isnan(t_done)) note("the last step did not become complete in time");
  {
    r2ccl_snap_take_stats_t s{};
    check(r2ccl_snap_take(r.h, uint64_t(o.steps) + 1, &s), "harvest take");
    harvest(s);
    check(r2ccl_snap_flush(r.h, int64_t(o.timeout_s * 1e6)), "flush");
  }
  // The reference: one memcpy of the whole state into memory already faulted in, and one
  // overwrite of it (what a training step that rewrites every buffer costs), both in this run;
  // then the same overwrite right after a take(), when copy-on-write makes the writer copy the
  // chunks the background thread has not copied yet.
  const size_t state_bytes = r.st->h.size() * 2;
  std::vector<uint8_t> dst(state_bytes, 1);
  std::vector<double> mc;
  for (int i = 0; i < 3; ++i) {
    const auto a = Clock::now();
    std::memcpy(dst.data(), r.st->h.data(), state_bytes);
    mc.push_back(secs(a, Clock::now()));
  }
  dst.clear();
  dst.shrink_to_fit();
  auto overwrite = [&](uint16_t v) {
    const auto a = Clock::now();
    std::fill(r.st->h.begin(), r.st->h.end(), v);
    return secs(a, Clock::now());
  };
  const double ow_plain = overwrite(0x3c00);
  double ow_after = NAN, take_ow = NAN;
  {
    const auto a = Clock::now();
    check(r2ccl_snap_take(r.h, uint64_t(o.steps) + 2, nullptr), "take before the overwrite");
    take_ow = secs(a, Clock::now());
    ow_after = overwrite(0x3c01);
    check(r2ccl_snap_flush(r.h, int64_t(o.timeout_s * 1e6)), "flush");
  }
  const double memcpy_s = median(mc);
  out.put(k + "memcpy_seconds.median", memcpy_s, "s");
  out.put(k + "overwrite_seconds", ow_plain, "s");
  out.put(k + "overwrite_after_take.take_call_seconds", take_ow, "s");
  out.put(k + "overwrite_after_take.overwrite_seconds", ow_after, "s");
  const char* tm = getenv("R2CCL_SNAPSHOT_TAKE");
  const std::string take_mode = tm && *tm ? tm : "cow";
  std::vector<double> call, copy, wait, upd, enc_b, enc_d, send_b, send_d, ratio_b, ratio_d,
      bytes_b, bytes_d, repl_b, repl_d, flush_b, flush_d, err;
  for (const auto& x : recs) {
    call.push_back(x.call);
    copy.push_back(x.copy);
    wait.push_back(x.wait);
    if (!std::isnan(x.update)) upd.push_back(x.update);
    if (!x.harvested) continue;
    const bool base = x.bases > 0;
    (base ? enc_b : enc_d).push_back(x.encode);
    (base ? send_b : send_d).push_back(x.send);
    (base ? ratio_b : ratio_d).push_back(x.ratio);
    (base ? bytes_b : bytes_d).push_back(double(x.encoded));
    if (!std::isnan(x.replicated)) (base ? repl_b : repl_d).push_back(x.replicated);
    if (!std::isnan(x.flush)) (base ? flush_b : flush_d).push_back(x.flush);
    if (codec == "lossy" && !base) err.push_back(x.err);
  }
  out.put(k + "bytes", double(o.bytes), "B");
  out.put(k + "steps", double(recs.size()), "steps");
  out.put(k + "take_call_seconds.median", median(call), "s");
  out.put(k + "take_call_seconds.max", vmax(call), "s");
  out.put(k + "take_call_over_memcpy", median(call) / memcpy_s, "x");
  out.put(k + "copy_seconds.median", median(copy), "s");
  out.put(k + "copy_seconds.max", vmax(copy), "s");
  out.put(k + "wait_seconds.median", median(wait), "s");
  out.put(k + "wait_seconds.max", vmax(wait), "s");
  out.put(k + "update_seconds.median", median(upd), "s");
  out.put(k + "base.steps", double(enc_b.size()), "steps");
  out.put(k + "base.encode_seconds.median", median(enc_b), "s");
  out.put(k + "base.send_seconds.median", median(send_b), "s");
  out.put(k + "base.encoded_bytes.median", median(bytes_b), "B");
  out.put(k + "base.ratio.median", median(ratio_b), "x");
  out.put(k + "delta.steps", double(enc_d.size()), "steps");
  out.put(k + "delta.encode_seconds.median", median(enc_d), "s");
  out.put(k + "delta.encode_seconds.max", vmax(enc_d), "s");
  out.put(k + "delta.send_seconds.median", median(send_d), "s");
  out.put(k + "delta.encoded_bytes.median", median(bytes_d), "B");
  out.put(k + "delta.ratio.median", median(ratio_d), "x");
  if (!pipelined) {
    out.put(k + "base.flush_seconds.median", median(flush_b), "s");
    out.put(k + "delta.flush_seconds.median", median(flush_d), "s");
    out.put(k + "base.replicated_seconds.median", median(repl_b), "s");
    out.put(k + "delta.replicated_seconds.median", median(repl_d), "s");
    out.put(k + "delta.replicated_seconds.max", vmax(repl_d), "s");
  }
  if (codec == "lossy") out.put(k + "delta.max_abs_error.max", vmax(err), "abs");
  out.put(k + "spurious_node_failures", c.declared_failed(0) + c.declared_failed(1), "events");
  out.put(k + "incomplete_steps", incomplete, "steps");
  out.put(k + "node0.daemon_peak_rss_mib", c.hwm_mib(0), "MiB");
  out.put(k + "node1.daemon_peak_rss_mib", c.hwm_mib(1), "MiB");
  out.put(k + "bench_peak_rss_mib", maxrss_mib(), "MiB");

  out.row("## take, " + codec + ": " + mib(double(o.bytes)) + " MiB FP16, " + o.model.update +
          (o.model.update == "sparse"
               ? " (" + fmt(o.model.changed_fraction * 100, "%g") + " % changed)"
               : "") +
          ", " + std::to_string(o.buffers) + " buffer(s), " +
          (pipelined ? "step " + fmt(o.step_ms, "%g") + " ms" : "flush after each take"));
  out.row(
      "| step | kind | take() s | copy s | wait s | encode s | send s | encoded MiB | ratio | max "
      "err | complete after s |");
  out.row("|---|---|---|---|---|---|---|---|---|---|---|");
  for (const auto& x : recs)
    out.row(
        "| " + std::to_string(x.step) + " | " +
        (!x.harvested ? "?"
         : x.bases    ? "base"
                      : "delta") +
        " | " + fmt(x.call) + " | " + fmt(x.copy) + " | " + fmt(x.wait) + " | " + fmt(x.encode) +
        " | " + fmt(x.send) + " | " + (x.harvested ? mib(double(x.encoded)) : "-") + " | " +
        fmt(x.ratio, "%.2f") + " | " + (codec == "lossy" ? fmt(x.err, "%.2e") : "0") + " | " +
        (std::isnan(x.replicated) && !pipelined ? std::string("not in 60 s") : fmt(x.replicated)) +
        " |");
  out.row("# take() blocked (median) " + fmt(median(call)) + " s against one memcpy of the " +
          mib(double(state_bytes)) + " MiB state " + fmt(memcpy_s) + " s in this run (" +
          fmt(median(call) / memcpy_s, "%.2f") + "x; R2CCL_SNAPSHOT_TAKE=" + take_mode +
          "); overwriting the whole state: " + fmt(ow_plain) + " s, right after a take() " +
          fmt(ow_after) + " s (take() " + fmt(take_ow) + " s)");
  out.row("# nodes declared failed during the run (spurious: nothing was killed): " +
          std::to_string(c.declared_failed(0) + c.declared_failed(1)) +
          "; steps not complete in time: " + std::to_string(incomplete));
  r.close();
}

// ---- --mode restore ----
void run_restore(const Opts& o) {
  const std::string codec = o.codec == "both" ? "lossless" : o.codec;
  const std::string k = "restore." + codec + ".";
  const int steps = std::max(1, std::min(o.steps, 8));
  note("restore: 3 nodes, rank 0 on node 0 with " + mib(double(o.bytes)) + " MiB, " +
       std::to_string(steps) + " takes");
  Cluster c(o.daemon, o.workdir, 3, o.period_ms, daemon_extra(o), o.keep, o.etcd_url, o.lease_ttl);
  for (int i = 0; i < 3; ++i) c.start(i);
  for (int i = 0; i < 3; ++i) c.wait_socket(i);
  Rank r;
  r.st = std::make_unique<State>(o.bytes, o.model, o.seed);
  r.open(c.sockets[0], o.buffers, codec_of(codec));
  if (std::isnan(wait_for(r.h, 20, members_are(3))))
    fail("the 3 daemons did not agree on a membership");
  const uint64_t S = uint64_t(steps);
  for (uint64_t s = 1; s <= S; ++s) {
    if (s > 1) r.st->update();
    check(r2ccl_snap_take(r.h, s, nullptr), "take");
    check(r2ccl_snap_flush(r.h, int64_t(o.timeout_s * 1e6)), "flush");
    r.hash_at[s] = r.st->hash();
  }
  if (std::isnan(wait_for(r.h, o.timeout_s, complete_at_least(S))))
    fail("step " + std::to_string(S) + " not complete in time (logs kept in " + c.dir + ")");
  out.put(k + "spurious_node_failures",
          c.declared_failed(0) + c.declared_failed(1) + c.declared_failed(2), "events");
  const bool exact = codec == "lossless";
  auto verify = [&](const char* what) {
    const bool ok = r.st->hash() == r.hash_at[S];
    out.put(k + what + ".verified", exact ? (ok ? 1 : 0) : NAN, "bool");
    if (exact && !ok)
      fail(std::string("restore ") + what + ": the state differs from step " + std::to_string(S));
  };
  auto timed_restore = [&](const char* what) {
    uint64_t step = 0;
    const auto a = Clock::now();
    check(r2ccl_snap_restore(r.h, int64_t(o.timeout_s * 1e6), &step),
          std::string("restore ") + what);
    const double t = secs(a, Clock::now());
    if (step != S) fail(std::string("restore ") + what + " gave step " + std::to_string(step));
    out.put(k + what + ".seconds", t, "s");
    out.put(k + what + ".gb_per_s", double(o.bytes) / t / 1e9, "GB/s");
    verify(what);
    return t;
  };
  // 1. From the home copy: the state moved on (one more update), restore brings back step S.
  r.st->update();
  const double t_home = timed_restore("home");
  r.close();
  // 2. Node 0 dies; a replacement rank 0 on node 1, whose daemon holds a replica.
  const auto t_kill = Clock::now();
  c.stop(0, SIGKILL);
  r.st->zero();
  r.open(c.sockets[1], o.buffers, codec_of(codec));
  const double seen = wait_for(r.h, o.timeout_s, [](const r2ccl_snap_state_t& s) {
    return s.member_count == 2 && !has_member(s, 0) && s.has_complete_step;
  });
  out.put(k + "node_loss_to_new_membership_seconds",
          seen - std::chrono::duration<double>(t_kill.time_since_epoch()).count(), "s");
  const double t_local = timed_restore("replica_local");
  r.close();
  // 3. A replacement daemon for node 0 (empty) and a rank on it: the chain comes over TCP.
  const auto t_start = Clock::now();
  c.start(0);
  c.wait_socket(0);
  const double up = secs(t_start, Clock::now());
  r.st->zero();
  r.open(c.sockets[0], o.buffers, codec_of(codec));
  const double known = wait_for(r.h, o.timeout_s, [&](const r2ccl_snap_state_t& s) {
    return s.member_count == 3 && s.has_complete_step && s.complete_step >= S;
  });
  if (std::isnan(known)) fail("the replacement node never learnt the complete step");
  out.put(k + "replacement_daemon_socket_seconds", up, "s");
  out.put(k + "replacement_knows_complete_step_seconds",
          known - std::chrono::duration<double>(t_start.time_since_epoch()).count(), "s");
  const double t_remote = timed_restore("replica_remote");
  r.close();
  for (int i = 0; i < 3; ++i)
    out.put(k + "node" + std::to_string(i) + ".daemon_peak_rss_mib", c.hwm_mib(i), "MiB");
  out.put(k + "bench_peak_rss_mib", maxrss_mib(), "MiB");
  const char* rm = getenv("R2CCL_SNAPSHOT_RESTORE");
  out.row("## restore, " + codec + ": " + mib(double(o.bytes)) + " MiB FP16, step " +
          std::to_string(S) + " (chain: base at step 1 + " + std::to_string(S - 1) +
          " deltas), R2CCL_SNAPSHOT_RESTORE=" + (rm && *rm ? rm : "direct (default)"));
  out.row("| from | restore() s | GB/s | bit-exact |");
  out.row("|---|---|---|---|");
  const std::string ex = exact ? "yes" : "n/a (lossy)";
  out.row("| home copy (local daemon) | " + fmt(t_home) + " | " +
          fmt(double(o.bytes) / t_home / 1e9, "%.2f") + " | " + ex + " |");
  out.row("| replica on the rank's new node (home node killed) | " + fmt(t_local) + " | " +
          fmt(double(o.bytes) / t_local / 1e9, "%.2f") + " | " + ex + " |");
  out.row("| replicas over TCP (replacement daemon) | " + fmt(t_remote) + " | " +
          fmt(double(o.bytes) / t_remote / 1e9, "%.2f") + " | " + ex + " |");
}

// ---- --mode decode ----
void run_decode(const Opts& o) {
  State st(o.bytes, o.model, o.seed);
  r2ccl::snap::EncoderConfig ec;
  ec.dtype = r2ccl::snap::DType::kF16;
  ec.size_bytes = o.bytes;
  ec.base_every = uint32_t(std::max(o.steps, 1));
  ec.payload_crc = false;  // as the client: its shard checksum covers the frame
  std::string err;
  auto enc = r2ccl::snap::DeltaEncoder::create(ec, &err);
  if (!enc) fail("encoder: " + err);
  const int steps = std::max(1, std::min(o.steps, 64));
  std::vector<std::vector<uint8_t>> frames(static_cast<size_t>(steps));
  for (int s = 0; s < steps; ++s) {
    if (s) st.update();
    if (!enc->encode(st.h.data(), &frames[size_t(s)], nullptr, &err)) fail("encode: " + err);
  }
  std::vector<const uint8_t*> ptr;
  std::vector<size_t> len;
  size_t wire = 0;
  for (const auto& f : frames) {
    ptr.push_back(f.data());
    len.push_back(f.size());
    wire += f.size();
  }
  r2ccl::snap::BigBytes into = r2ccl::snap::make_big(o.bytes, true);
  auto dec = r2ccl::snap::DeltaDecoder::create(r2ccl::snap::DType::kF16, o.bytes, &err, into.get());
  if (!dec) fail("decoder: " + err);
  auto best_of = [&](const std::function<void()>& fn) {
    double best = 1e300;
    for (int r = 0; r < 5; ++r) {
      std::memset(into.get(), 0xa5, o.bytes);
      dec->reset();
      const auto a = Clock::now();
      fn();
      best = std::min(best, secs(a, Clock::now()));
      if (std::memcmp(into.get(), st.h.data(), o.bytes) != 0) fail("decoded state differs");
    }
    return best;
  };
  const double one_by_one = best_of([&] {
    for (size_t k = 0; k < frames.size(); ++k)
      if (!dec->apply_streaming(ptr[k], len[k], &err)) fail("apply_streaming: " + err);
  });
  const double chain = best_of([&] {
    if (!dec->apply_chain(ptr.data(), len.data(), ptr.size(), &err)) fail("apply_chain: " + err);
  });
  out.put("decode.frames", double(steps), "frames");
  out.put("decode.wire_mib", double(wire) / 1048576.0, "MiB");
  out.put("decode.frame_by_frame.seconds", one_by_one, "s");
  out.put("decode.chain.seconds", chain, "s");
  out.row("## decode: " + mib(double(o.bytes)) + " MiB FP16, a base + " +
          std::to_string(steps - 1) + " deltas (" + fmt(double(wire) / 1048576.0, "%.1f") +
          " MiB encoded), one thread, best of 5");
  out.row("| decoder | s | GB/s of state |");
  out.row("|---|---|---|");
  out.row("| frame by frame (apply_streaming) | " + fmt(one_by_one, "%.4f") + " | " +
          fmt(double(o.bytes) / one_by_one / 1e9, "%.2f") + " |");
  out.row("| one pass (apply_chain) | " + fmt(chain, "%.4f") + " | " +
          fmt(double(o.bytes) / chain / 1e9, "%.2f") + " |");
  out.row("# both bit-exact (every run compared with the state; a difference exits 1)");
}

// ---- --mode pages ----
void run_pages(const Opts& o) {
  const size_t n = o.bytes;
  auto touch = [n](uint8_t* p) {
    volatile uint8_t* v = p;
    for (size_t i = 0; i < n; i += 4096) v[i] = 1;
  };
  // Each way 3 times in a row: the first in the process, and the best (memory the kernel just
  // got back from the previous round).
  struct Way {
    double alloc_first = 0, touch_first = 0, alloc_best = 1e300, touch_best = 1e300;
  } pop, big;
  double warm = 1e300;
  for (int r = 0; r < 3; ++r) {
    auto a = Clock::now();
    void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                     -1, 0);
    if (m == MAP_FAILED) fail("mmap of " + std::to_string(n) + " bytes");
    auto b = Clock::now();
    touch(static_cast<uint8_t*>(m));
    auto c = Clock::now();
    if (r == 0) pop.alloc_first = secs(a, b), pop.touch_first = secs(b, c);
    pop.alloc_best = std::min(pop.alloc_best, secs(a, b));
    pop.touch_best = std::min(pop.touch_best, secs(b, c));
    a = Clock::now();
    std::memset(m, 2, n);
    warm = std::min(warm, secs(a, Clock::now()));
    ::munmap(m, n);
  }
  for (int r = 0; r < 3; ++r) {
    auto a = Clock::now();
    uint8_t* p = r2ccl::snap::big_alloc(n, true);
    if (!p) fail("big_alloc of " + std::to_string(n) + " bytes");
    auto b = Clock::now();
    touch(p);
    auto c = Clock::now();
    if (r == 0) big.alloc_first = secs(a, b), big.touch_first = secs(b, c);
    big.alloc_best = std::min(big.alloc_best, secs(a, b));
    big.touch_best = std::min(big.touch_best, secs(b, c));
    r2ccl::snap::big_free(p, n);
  }
  out.put("pages.populate.map_seconds_first", pop.alloc_first, "s");
  out.put("pages.populate.first_access_seconds_first", pop.touch_first, "s");
  out.put("pages.populate.map_seconds_best", pop.alloc_best, "s");
  out.put("pages.populate.first_access_seconds_best", pop.touch_best, "s");
  out.put("pages.big_alloc.prefault_seconds_first", big.alloc_first, "s");
  out.put("pages.big_alloc.first_access_seconds_first", big.touch_first, "s");
  out.put("pages.big_alloc.prefault_seconds_best", big.alloc_best, "s");
  out.put("pages.big_alloc.first_access_seconds_best", big.touch_best, "s");
  out.put("pages.warm_memset_seconds", warm, "s");
  out.row("## fresh memory: " + mib(double(n)) + " MiB (first of 3 in this process / best of 3)");
  out.row("| allocation | allocate s | then one store to each 4 KiB page s | sum s |");
  out.row("|---|---|---|---|");
  auto row = [](const char* what, double a1, double t1, double ab, double tb) {
    out.row(std::string("| ") + what + " | " + fmt(a1) + " / " + fmt(ab) + " | " + fmt(t1) + " / " +
            fmt(tb) + " | " + fmt(a1 + t1) + " / " + fmt(ab + tb) + " |");
  };
  row("mmap + MAP_POPULATE (staging before)", pop.alloc_first, pop.touch_first, pop.alloc_best,
      pop.touch_best);
  row("big_alloc(prefault) (now)", big.alloc_first, big.touch_first, big.alloc_best,
      big.touch_best);
  out.row("| (a memset of all of it, already touched: best) | | " + fmt(warm) + " | |");
}

// ---- --mode recovery ----
// NCCL for r2ccl_snap_rebuild_comm without a GPU: every call succeeds at once (version 2.19, no
// ncclCommShrink, so every rank re-initialises with a new unique id). What is timed is the
// library's own part of a rebuild: the id made by the lowest surviving rank, published through
// the daemons' KV (etcd) and waited for by every other rank; ncclCommInitRank itself is not run.
namespace fake_nccl {
int comm_obj = 0, old_obj = 0;
int get_version(int* v) {
  *v = 21905;
  return 0;
}
int get_unique_id(void* id) {
  std::memset(id, 0x5a, 128);
  return 0;
}
int init_rank(void** comm, int, const void*, int) {
  *comm = &comm_obj;
  return 0;
}
int release(void*) { return 0; }
const char* error_string(int) { return "fake NCCL"; }
const r2ccl_snap_nccl_ops_t kOps = {get_version, get_unique_id, init_rank,   nullptr,
                                    release,     release,       error_string};
}  // namespace fake_nccl

// Nearest-rank percentile (q in (0, 1]): with 10 samples p99 is the largest.
double pct(std::vector<double> v, double q) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t i = size_t(std::ceil(q * double(v.size())));
  return v[std::min(v.size(), std::max<size_t>(i, 1)) - 1];
}

struct KillRec {
  int victim = -1;
  uint64_t epoch = 0, restore_step = 0;
  std::string path = "?";  // what the coordinator's record line says: suspicion | lease
  // From the kill, s:
  double suspect = NAN;      // first survivor's log: "node V: no heartbeat ... suspected"
  double second = NAN;       // the second observer's suspicion key in etcd
  double member_gone = NAN;  // V's member key deleted (lease expiry, or the eviction)
  double record = NAN;       // the new record in etcd
  double boards = NAN;       // every survivor wrote it to its board
  double notified = NAN;     // every survivor's wait_event() shows it
  double detect = NAN, agreement = NAN, rebuild = NAN, restore = NAN, total = NAN;
  double standby_open = NAN, survivor_restore_max = NAN, standby_restore = NAN;
  double repl_up = NAN, repl_rejoined = NAN, repl_restore = NAN;
  double t_kill = NAN, t_back = NAN;  // absolute: the kill, and the cluster whole again
};

void run_recovery(const Opts& o) {
  namespace S = r2ccl::snap;
  const int n = o.nodes;
  const std::string codec = o.codec == "both" ? "lossless" : o.codec;
  const std::string k = "recovery.n" + std::to_string(n) + "." + o.path + ".";
  const size_t per = (o.bytes / uint64_t(n)) & ~size_t(511);
  note("recovery: " + std::to_string(n) + " nodes, " + o.path + " path: heartbeat " +
       std::to_string(o.period_ms) + " ms, lease TTL " + std::to_string(o.lease_ttl) + " s, " +
       mib(double(per)) + " MiB per rank, " + std::to_string(o.kills) + " kills");
  Cluster c(o.daemon, o.workdir, n, o.period_ms, daemon_extra(o), o.keep, o.etcd_url, o.lease_ttl);
  EtcdTrace tr(o.etcd_url, c.prefix);
  for (int i = 0; i < n; ++i) c.start(i);
  for (int i = 0; i < n; ++i) c.wait_socket(i);
  std::vector<std::unique_ptr<Rank>> ranks(n);
  parallel(n, [&](size_t i) {
    ranks[i] = std::make_unique<Rank>();
    ranks[i]->rank = uint32_t(i);
    ranks[i]->world = uint32_t(n);
    ranks[i]->st = std::make_unique<State>(per, o.model, o.seed + i);
    ranks[i]->open(c.sockets[i], o.buffers, codec_of(codec));
  });
  const double wait_s = std::max(30.0, 4.0 * o.lease_ttl + 30 * o.period_ms / 1000.0);
  for (int i = 0; i < n; ++i)
    if (std::isnan(wait_for(ranks[i]->h, wait_s, members_are(uint32_t(n)))))
      fail("the daemons did not agree on a membership of " + std::to_string(n) + " (logs kept in " +
           c.dir + ")");
  uint64_t step = 0;
  auto take_steps = [&](int count) {
    for (int t = 0; t < count; ++t) {
      const uint64_t s = ++step;
      parallel(n, [&](size_t i) {
        Rank& r = *ranks[i];
        r.st->update();
        check(r2ccl_snap_take(r.h, s, nullptr), "take");
        check(r2ccl_snap_flush(r.h, int64_t(o.timeout_s * 1e6)), "flush");
        r.hash_at[s] = r.st->hash();
      });
    }
    for (int i = 0; i < n; ++i)
      if (std::isnan(wait_for(ranks[i]->h, o.timeout_s, complete_at_least(step))))
        fail("step " + std::to_string(step) + " did not become complete (logs kept in " + c.dir +
             ")");
  };
  take_steps(2);
  Rng jitter(o.seed * 7919 + uint64_t(n));
  std::vector<KillRec> kills;
  for (int kk = 0; kk < o.kills; ++kk) {
    KillRec x;
    // The victim: the non-coordinator nodes in turn (the coordinator is the newest record's
    // writer; killing it adds an election, not measured here).
    r2ccl_snap_state_t st0{};
    r2ccl_snap_state(ranks[0]->h, &st0);
    S::Record cur;
    double tcur = 0;
    const int coord = tr.record(0, st0.epoch, &cur, &tcur) ? int(cur.leader) : 0;
    std::vector<int> cands;
    for (int i = 0; i < n; ++i)
      if (i != coord) cands.push_back(i);
    const int V = cands[size_t(kk) % cands.size()];
    x.victim = V;
    std::vector<int> surv;
    for (int i = 0; i < n; ++i)
      if (i != V) surv.push_back(i);
    // Training moved on past the complete step; the kill lands at a random phase of the
    // heartbeat and keep-alive periods.
    parallel(n, [&](size_t i) { ranks[i]->st->update(); });
    std::this_thread::sleep_for(std::chrono::microseconds(
        50000 + int64_t((jitter.next() >> 11) % uint64_t(o.period_ms * 1000))));
    // The standby: a process already running on a surviving node (its state buffers
    // allocated), which takes over rank V once the new record is out.
    const int host = surv[0];
    Rank sb;
    sb.rank = uint32_t(V);
    sb.world = uint32_t(n);
    sb.st = std::make_unique<State>(per, o.model, o.seed + 1000);
    sb.st->zero();
    x.t_kill = now_s();
    const double t_kill = x.t_kill;
    c.stop(V, SIGKILL);
    ranks[V]->close();
    std::vector<double> seen(surv.size(), NAN);
    const double detect_timeout = std::max(20.0, 3.0 * o.lease_ttl + 20 * o.period_ms / 1000.0);
    parallel(surv.size(), [&](size_t j) {
      seen[j] = wait_for(ranks[surv[j]]->h, detect_timeout, [&](const r2ccl_snap_state_t& s) {
        return s.member_count == uint32_t(n - 1) && !has_member(s, uint32_t(V));
      });
    });
    for (double t : seen)
      if (std::isnan(t))
        fail("kill " + std::to_string(kk) + " (node " + std::to_string(V) +
             "): a survivor never saw the new membership (logs kept in " + c.dir + ")");
    x.notified = vmax(seen) - t_kill;
    r2ccl_snap_state_t st{};
    r2ccl_snap_state(ranks[surv[0]]->h, &st);
    x.epoch = st.epoch;
    // Rebuild and restore, every rank at once: the survivors, and the standby taking over V.
    const double t0 = now_s();
    std::vector<double> rb_end(n, NAN), rs_end(n, NAN), rs_len(n, NAN);
    std::vector<uint64_t> rstep(n, 0);
    double sb_open = NAN;
    const int lost[1] = {V};
    parallel(size_t(n), [&](size_t j) {
      const bool standby = j == surv.size();
      Rank& r = standby ? sb : *ranks[surv[j]];
      if (standby) {
        r.open(c.sockets[host], o.buffers, codec_of(codec));
        sb_open = now_s() - t0;
      }
      void* nc = nullptr;
      int nr = -1, nn = 0;
      check(r2ccl_snap_rebuild_comm(r.h, &fake_nccl::kOps, standby ? nullptr : &fake_nccl::old_obj,
                                    int(r.rank), n, lost, 1, lost, 1, x.epoch, int64_t(10e6), &nc,
                                    &nr, &nn),
            "rebuild_comm rank " + std::to_string(r.rank));
      rb_end[j] = now_s();
      check(r2ccl_snap_restore(r.h, int64_t(o.timeout_s * 1e6), &rstep[j]),
            "restore rank " + std::to_string(r.rank));
      rs_end[j] = now_s();
      rs_len[j] = rs_end[j] - rb_end[j];
      const uint64_t want = ranks[r.rank]->hash_at[rstep[j]];
      if (codec == "lossless" && r.st->hash() != want)
        fail("rank " + std::to_string(r.rank) + (standby ? " (standby)" : "") +
             ": restored state differs from step " + std::to_string(rstep[j]));
    });
    x.standby_open = sb_open;
    x.rebuild = vmax(rb_end) - t0;
    x.restore = vmax(rs_end) - vmax(rb_end);
    x.restore_step = rstep[0];
    x.standby_restore = rs_len[surv.size()];
    rs_len.pop_back();
    x.survivor_restore_max = vmax(rs_len);
    for (size_t j = 0; j < surv.size(); ++j)
      if (rstep[j] != rstep[0]) fail("the ranks restored different steps");
    sb.close();
    // From the logs and etcd's events.
    const std::string vs = "node " + std::to_string(V) + ": no heartbeat for";
    for (int i : surv) {
      const double d = c.log_time(i, t_kill, {vs, "suspected"}) - t_kill;
      if (!std::isnan(d) && !(x.suspect <= d)) x.suspect = d;
    }
    char vid[8];
    snprintf(vid, sizeof(vid), "%04d", V);
    std::vector<double> obs = tr.distinct_times(t_kill, true, std::string("suspect/") + vid + "/");
    std::sort(obs.begin(), obs.end());
    if (obs.size() >= 2) x.second = obs[1] - t_kill;
    x.member_gone = tr.first_time(t_kill, false, std::string("members/") + vid) - t_kill;
    S::Record rec;
    double trec = NAN;
    if (tr.record(t_kill, x.epoch, &rec, &trec)) {
      x.record = trec - t_kill;
      const std::string line =
          c.log_line(int(rec.leader), t_kill,
                     {"coordinator: wrote record epoch " + std::to_string(rec.epoch) + " ("});
      x.path = line.find("evicted") != std::string::npos      ? "suspicion"
               : line.find("lease gone") != std::string::npos ? "lease"
                                                              : "?";
      if (!rec.restore_step || *rec.restore_step != x.restore_step)
        fail("the ranks restored step " + std::to_string(x.restore_step) +
             ", the record says another");
    }
    std::vector<double> boards;
    for (int i : surv)
      boards.push_back(
          c.log_time(i, t_kill,
                     {"agreed record epoch " + std::to_string(x.epoch) + ",", "written to board"}) -
          t_kill);
    x.boards = vmax(boards);
    x.detect = x.path == "suspicion" ? x.suspect : x.path == "lease" ? x.member_gone : NAN;
    x.agreement = x.boards - x.detect;
    x.total = vmax(rs_end) - t_kill - x.detect;
    // The replacement: a new, empty daemon for node V and rank V on it, from the replicas.
    const double t_s = now_s();
    c.start(V);
    c.wait_socket(V);
    x.repl_up = now_s() - t_s;
    Rank& v = *ranks[V];
    v.st->zero();
    v.open(c.sockets[V], o.buffers, codec_of(codec));
    const double known = wait_for(v.h, o.timeout_s, [&](const r2ccl_snap_state_t& s) {
      return s.member_count == uint32_t(n) && s.has_complete_step &&
             s.complete_step >= x.restore_step;
    });
    if (std::isnan(known))
      fail("the replacement for node " + std::to_string(V) + " did not rejoin (logs kept in " +
           c.dir + ")");
    x.repl_rejoined = known - t_s;
    uint64_t vstep = 0;
    const double a = now_s();
    check(r2ccl_snap_restore(v.h, int64_t(o.timeout_s * 1e6), &vstep), "replacement restore");
    x.repl_restore = now_s() - a;
    if (codec == "lossless" && v.st->hash() != v.hash_at[vstep])
      fail("the replacement's restored state differs from step " + std::to_string(vstep));
    for (int i : surv)
      if (std::isnan(wait_for(ranks[i]->h, o.timeout_s, members_are(uint32_t(n)))))
        fail("the survivors did not see the replacement rejoin");
    step = std::max(step, x.restore_step);
    x.t_back = now_s();
    fprintf(stderr,
            "[bench]   kill %d: node %d, path %s, detect %.3f, agreement %.3f, rebuild %.3f, "
            "restore %.3f (step %llu), total after detection %.3f; replacement rejoined %.3f\n",
            kk, V, x.path.c_str(), x.detect, x.agreement, x.rebuild, x.restore,
            (unsigned long long)x.restore_step, x.total, x.repl_rejoined);
    kills.push_back(x);
    if (kk + 1 < o.kills) take_steps(2);
  }
  // Suspicions of nodes that were not down at the time, and leases of live daemons that ran
  // out: the configuration's false alarms.
  int spurious = 0, lease_lapses = 0;
  for (int i = 0; i < n; ++i) {
    std::istringstream ls(c.read(i));
    std::string line;
    while (std::getline(ls, line)) {
      double t = 0;
      unsigned id = 0;
      if (sscanf(line.c_str(), "[%lf]", &t) != 1) continue;
      if (line.find("this node's lease expired") != std::string::npos) {
        ++lease_lapses;
        int after = -1;
        for (size_t q = 0; q < kills.size(); ++q)
          if (kills[q].t_kill <= t) after = int(q);
        note("node " + std::to_string(i) + ": its lease ran out while it was running, " +
             (after < 0 ? "before the first kill"
                        : fmt(t - kills[size_t(after)].t_kill) + " s after kill " +
                              std::to_string(after) + " (of node " +
                              std::to_string(kills[size_t(after)].victim) + ")"));
      }
      const size_t p = line.find("] node ");
      if (line.find("no heartbeat for") == std::string::npos || p == std::string::npos ||
          sscanf(line.c_str() + p, "] node %u:", &id) != 1)
        continue;
      bool genuine = false;
      for (const auto& x : kills)
        genuine = genuine || (x.victim == int(id) && t >= x.t_kill && t <= x.t_back);
      spurious += !genuine;
    }
  }
  std::vector<KillRec> ok;
  std::map<std::string, int> paths;
  for (const auto& x : kills) {
    paths[x.path]++;
    if (x.path == o.path) ok.push_back(x);
  }
  out.put(k + "nodes", n, "nodes");
  out.put(k + "period_ms", o.period_ms, "ms");
  out.put(k + "lease_ttl_s", o.lease_ttl, "s");
  out.put(k + "state_bytes_per_rank", double(per), "B");
  out.put(k + "kills", double(kills.size()), "kills");
  out.put(k + "kills_on_this_path", double(ok.size()), "kills");
  out.put(k + "spurious_suspicions", spurious, "events");
  out.put(k + "live_lease_lapses", lease_lapses, "events");
  struct Phase {
    const char* key;
    const char* what;
    std::function<double(const KillRec&)> get;
  };
  const bool sus = o.path == "suspicion";
  std::vector<Phase> phases = {
      {"detect",
       sus ? "detection: kill -> first survivor suspects (heartbeats)"
           : "detection: kill -> lease expired (member key gone)",
       [](const KillRec& x) { return x.detect; }},
      {"second_observer", "  kill -> the second observer's suspicion in etcd",
       [](const KillRec& x) { return x.second; }},
      {"record", "  kill -> the new record in etcd", [](const KillRec& x) { return x.record; }},
      {"agreement", "agreement: detection -> every survivor wrote the record to its board",
       [](const KillRec& x) { return x.agreement; }},
      {"notified", "  kill -> every survivor's wait_event() shows it",
       [](const KillRec& x) { return x.notified; }},
      {"rebuild",
       "rebuild: unique-id exchange of r2ccl_snap_rebuild_comm over the KV, standby's open "
       "included (fake NCCL: init not run)",
       [](const KillRec& x) { return x.rebuild; }},
      {"restore",
       "restore: every rank restores restore_step (survivors: home copy; standby: replicas)",
       [](const KillRec& x) { return x.restore; }},
      {"total_after_detect",
       "**recovery after detection** (agreement + notification + rebuild + restore)",
       [](const KillRec& x) { return x.total; }},
      {"total", "kill -> every rank restored", [](const KillRec& x) { return x.total + x.detect; }},
      {"survivor_restore_max", "  a survivor's restore (longest)",
       [](const KillRec& x) { return x.survivor_restore_max; }},
      {"standby_restore", "  the standby's restore",
       [](const KillRec& x) { return x.standby_restore; }},
      {"standby_open", "  the standby's open + register",
       [](const KillRec& x) { return x.standby_open; }},
      {"replacement_rejoined", "cold replacement daemon: spawn -> rejoined, complete step known",
       [](const KillRec& x) { return x.repl_rejoined; }},
      {"replacement_restore", "  its rank's restore from the replicas",
       [](const KillRec& x) { return x.repl_restore; }},
  };
  std::string pathcount;
  for (const auto& [p, cnt] : paths)
    pathcount += (pathcount.empty() ? "" : ", ") + p + " " + std::to_string(cnt);
  out.row("## recovery: " + std::to_string(n) + " nodes, " + o.path + " path (heartbeat " +
          std::to_string(o.period_ms) + " ms, lease TTL " + std::to_string(o.lease_ttl) + " s), " +
          mib(double(per)) + " MiB per rank, " + std::to_string(kills.size()) +
          " SIGKILLs of non-coordinator nodes in turn (paths seen: " + pathcount + ")");
  out.row("| phase | p50 s | p99 s | max s | kills |");
  out.row("|---|---|---|---|---|");
  for (const auto& ph : phases) {
    std::vector<double> v;
    for (const auto& x : ok) v.push_back(ph.get(x));
    const double p50 = pct(v, 0.5), p99 = pct(v, 0.99);
    size_t cnt = 0;
    for (double d : v) cnt += !std::isnan(d);
    out.put(k + ph.key + "_seconds.p50", p50, "s");
    out.put(k + ph.key + "_seconds.p99", p99, "s");
    out.row(std::string("| ") + ph.what + " | " + fmt(p50) + " | " + fmt(p99) + " | " +
            fmt(vmax(v)) + " | " + std::to_string(cnt) + " |");
  }
  out.row("# false alarms: " + std::to_string(spurious) + " suspicions of live nodes, " +
          std::to_string(lease_lapses) +
          " leases of live daemons ran out; p99 of n samples is "
          "the nearest rank (of 10: the largest)");
  double hwm = 0;
  for (int i = 0; i < n; ++i)
    if (!std::isnan(c.hwm_mib(i))) hwm = std::max(hwm, c.hwm_mib(i));
  out.put(k + "daemon_peak_rss_mib.max", hwm, "MiB");
  out.put(k + "bench_peak_rss_mib", maxrss_mib(), "MiB");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"r2ccl_snapshot_bench: the snapshot sidecar's benchmarks on a loopback cluster"};
  Opts o;
  std::string bytes = "1G";
  app.add_option("--mode", o.mode, "take | restore | recovery | decode | pages")
      ->check(CLI::IsMember({"take", "restore", "recovery", "decode", "pages"}));
  app.add_option("--daemon", o.daemon, "r2ccl_snapshotd (default: next to this tool)")
      ->type_name("PATH");
  app.add_option(
      "--bytes", bytes,
      "FP16 state: per rank (take, restore) or in total (recovery); K/M/G suffixes (default 1G)");
  app.add_option("--steps", o.steps,
                 "snapshots taken (take: default 10; restore: chain length, at most 8)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--codec", o.codec,
                 "lossless | lossy | both (take; restore/recovery use lossless for both)")
      ->check(CLI::IsMember({"lossless", "lossy", "both"}));
  app.add_option("--update", o.model.update, "sparse (weights) | adam (dense FP16 first moment)")
      ->check(CLI::IsMember({"sparse", "adam"}));
  app.add_option("--changed-fraction", o.model.changed_fraction,
                 "sparse: elements moved per step (default 0.01; >= 1: all)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--lr", o.model.lr, "sparse: step size of a moved element (default 1e-4)")
      ->check(CLI::Range(1e-12, 1e3));
  app.add_option("--buffers", o.buffers, "registered buffers the state is split into (default 1)")
      ->check(CLI::Range(1, 64));
  app.add_option("--step-ms", o.step_ms,
                 "take: a training step of this many ms between takes, no flush (default 0: flush "
                 "after each take)")
      ->check(CLI::Range(0, 3600000));
  app.add_option("--nodes", o.nodes, "recovery: nodes, one rank each (3..8)")
      ->check(CLI::Range(3, 8));
  app.add_option("--period-ms", o.period_ms,
                 "heartbeat period of the daemons (default 100; recovery --path lease: 2000)")
      ->check(CLI::Range(10, 60000));
  app.add_option("--lease-ttl", o.lease_ttl, "daemons' etcd lease TTL, s (default 3)")
      ->check(CLI::Range(1, 3600));
  app.add_option("--path", o.path,
                 "recovery: the eviction path the configuration is meant to take: suspicion "
                 "(heartbeats, two observers) | lease (the lease runs out first; default period "
                 "2000 ms); kills that took the other path are counted, not summarised")
      ->check(CLI::IsMember({"suspicion", "lease"}));
  app.add_option("--kills", o.kills, "recovery: node kills, one after another (default 10)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--etcd", o.etcd_url,
                 "an etcd to use (http://HOST:PORT); default: a one-member etcd started here")
      ->type_name("URL");
  app.add_option("--etcd-bin", o.etcd_bin,
                 "etcd started when --etcd is absent (default /usr/bin/etcd)")
      ->type_name("PATH")
      ->check(CLI::ExistingFile);
  app.add_option("--mem-limit-mb", o.mem_limit_mb,
                 "daemons' --mem-limit-mb (default: the daemon's)")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--timeout-s", o.timeout_s, "bound on each wait (default 120)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--workdir", o.workdir, "where the cluster's files go (default /tmp)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--seed", o.seed, "state seed");
  app.add_flag("--keep", o.keep, "keep the daemons' logs and files");
  CLI11_PARSE(app, argc, argv);
  if (!std::isfinite(o.model.lr)) {  // NaN passes CLI::Range
    fprintf(stderr, "--lr: %g, expected a finite value in [1e-12, 1000]\n", o.model.lr);
    return 2;
  }
  try {
    o.bytes = parse_size(bytes);
  } catch (const CLI::Error& e) {
    return app.exit(e);
  }
  if (o.bytes % 2 || o.bytes < 4096) {
    fprintf(stderr, "--bytes must be even and at least 4096\n");
    return 2;
  }
  if (o.mode == "recovery" && o.path == "lease" && !app.count("--period-ms")) o.period_ms = 2000;
  if (o.daemon.empty()) {
    char self[4096];
    const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    std::string dir = len > 0 ? std::string(self, size_t(len)) : std::string(argv[0]);
    dir = dir.substr(0, dir.find_last_of('/') + 1);
    o.daemon = dir + "r2ccl_snapshotd";
  }
  if (access(o.daemon.c_str(), X_OK) != 0) {
    fprintf(stderr, "no executable r2ccl_snapshotd at %s (use --daemon)\n", o.daemon.c_str());
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  std::unique_ptr<r2ccl::snap::LocalEtcd> local_etcd;
  try {
    const auto t0 = Clock::now();
    const bool cluster = o.mode != "decode" && o.mode != "pages";
    if (cluster && o.etcd_url.empty()) {
      // One member on 127.0.0.1 (free ports, a temporary data directory under --workdir),
      // killed at exit: raft heartbeat 50 ms and election timeout 500 ms, so it elects itself
      // sooner and etcd's smallest lease TTL is 1 s. fsync is etcd's default (on).
      const auto te = Clock::now();
      local_etcd = std::make_unique<r2ccl::snap::LocalEtcd>(
          "bench", 1, r2ccl::snap::LocalEtcd::Transport::kHttp, o.etcd_bin, o.workdir);
      std::string err;
      if (!local_etcd->start(&err)) fail("etcd: " + err);
      o.etcd_url = local_etcd->endpoints();
      note("etcd " + o.etcd_url + " ready after " + fmt(secs(te, Clock::now())) + " s");
    }
    if (o.mode == "take") {
      if (o.codec != "lossy") run_take(o, "lossless");
      if (o.codec != "lossless") run_take(o, "lossy");
    } else if (o.mode == "restore") {
      run_restore(o);
    } else if (o.mode == "decode") {
      run_decode(o);
    } else if (o.mode == "pages") {
      run_pages(o);
    } else {
      run_recovery(o);
    }
    out.put(o.mode + ".run_seconds", secs(t0, Clock::now()), "s");
    out.print_table();
  } catch (const Fail& e) {
    out.print_table();
    fprintf(stderr, "r2ccl_snapshot_bench: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fprintf(stderr, "r2ccl_snapshot_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
