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
//                    3 steps, SIGKILL one daemon, then the phases: detection and agreement
//                    (from the daemons' logs: CLOCK_MONOTONIC stamps, the clock of
//                    std::chrono::steady_clock here), notification (every survivor's
//                    wait_event shows the new membership), the unique-id exchange of a
//                    communicator rebuild through kv_put/kv_get (NCCL's init itself is not
//                    run: no GPU), the survivors' parallel restore from their home copies, and
//                    a replacement daemon + rank restoring from the replicas.
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
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/codec.h"
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

// ---- a loopback cluster of r2ccl_snapshotd ----
struct Cluster {
  std::string daemon, dir, peers, token, tag;
  int n = 0, period_ms = 100;
  std::vector<std::string> boards, sockets, logs, extra;
  std::vector<pid_t> pids;
  bool keep = false;

  Cluster(const std::string& daemon_path, const std::string& workdir, int nodes, int period,
          std::vector<std::string> more, bool keep_files)
      : daemon(daemon_path), n(nodes), period_ms(period), extra(std::move(more)), keep(keep_files) {
    std::string t = workdir + "/r2ccl-bench.XXXXXX";
    if (!mkdtemp(t.data())) fail("cannot create a directory under " + workdir);
    dir = t;
    tag = "r2bench" + std::to_string(getpid()) + "-" + dir.substr(dir.size() - 6);
    peers = dir + "/peers";
    token = dir + "/token";
    // Free loopback ports: bound to port 0 together, then released (a small race, loopback only).
    std::vector<int> fds;
    std::ofstream p(peers);
    for (int i = 0; i < n; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t len = sizeof(a);
      if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
          getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
        fail("cannot find a free loopback port");
      fds.push_back(fd);
      p << i << " 127.0.0.1:" << ntohs(a.sin_port) << "\n";
    }
    p.close();
    for (int fd : fds) ::close(fd);
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
                               sockets[i]};
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
  // Lines of node i's log saying a peer missed 3 heartbeats (a node declared failed).
  int declared_failed(int i) const {
    std::istringstream s(read(i));
    std::string line;
    int n = 0;
    while (std::getline(s, line)) n += line.find("missed 3 heartbeats") != std::string::npos;
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
  uint64_t bytes = 1ull << 30;
  int steps = 10, nodes = 4, period_ms = 100, buffers = 1, victim = -1;
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
  Cluster c(o.daemon, o.workdir, 2, o.period_ms, daemon_extra(o), o.keep);
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
  Cluster c(o.daemon, o.workdir, 3, o.period_ms, daemon_extra(o), o.keep);
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
  out.row("## restore, " + codec + ": " + mib(double(o.bytes)) + " MiB FP16, step " +
          std::to_string(S) + " (chain: base at step 1 + " + std::to_string(S - 1) + " deltas)");
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

// ---- --mode recovery ----
void run_recovery(const Opts& o) {
  const int n = o.nodes;
  const int victim = o.victim >= 0 ? o.victim : n - 1;
  const std::string codec = o.codec == "both" ? "lossless" : o.codec;
  const std::string k = "recovery.n" + std::to_string(n) + ".p" + std::to_string(o.period_ms) + ".";
  const size_t per = (o.bytes / uint64_t(n)) & ~size_t(511);
  note("recovery: " + std::to_string(n) + " nodes, period " + std::to_string(o.period_ms) +
       " ms, " + mib(double(per)) + " MiB per rank, victim node " + std::to_string(victim));
  Cluster c(o.daemon, o.workdir, n, o.period_ms, daemon_extra(o), o.keep);
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
  if (std::isnan(wait_for(ranks[0]->h, 30, members_are(uint32_t(n)))))
    fail("the daemons did not agree on a membership of " + std::to_string(n));
  constexpr uint64_t kSteps = 3;
  for (uint64_t s = 1; s <= kSteps; ++s) {
    parallel(n, [&](size_t i) {
      Rank& r = *ranks[i];
      if (s > 1) r.st->update();
      check(r2ccl_snap_take(r.h, s, nullptr), "take");
      check(r2ccl_snap_flush(r.h, int64_t(o.timeout_s * 1e6)), "flush");
      r.hash_at[s] = r.st->hash();
    });
    if (std::isnan(wait_for(ranks[0]->h, o.timeout_s, complete_at_least(s))))
      fail("step " + std::to_string(s) + " did not become complete (logs kept in " + c.dir + ")");
  }
  int flaps = 0;
  for (int i = 0; i < n; ++i) flaps += c.declared_failed(i);
  out.put(k + "spurious_node_failures", flaps, "events");
  // Training is at step 4 when the node dies.
  parallel(n, [&](size_t i) { ranks[i]->st->update(); });
  std::vector<int> surv;
  for (int i = 0; i < n; ++i)
    if (i != victim) surv.push_back(i);
  const bool majority = 2 * surv.size() > size_t(n);
  std::this_thread::sleep_for(std::chrono::milliseconds(2 * o.period_ms));  // a quiet moment
  const double t_kill = now_s();
  c.stop(victim, SIGKILL);
  ranks[victim]->close();
  // Notification: every survivor's client sees the membership without the victim.
  std::vector<double> seen(surv.size(), NAN);
  const double detect_timeout = std::max(10.0, 20 * o.period_ms / 1000.0);
  parallel(surv.size(), [&](size_t j) {
    seen[j] = wait_for(ranks[surv[j]]->h, detect_timeout, [&](const r2ccl_snap_state_t& s) {
      return s.member_count == uint32_t(n - 1) && !has_member(s, uint32_t(victim));
    });
  });
  const double notified = vmax(seen) - t_kill;
  // From the logs: the coordinator (lowest surviving id) declares the victim failed; each
  // survivor writes the new agreed record to its board.
  const std::string vs = "node " + std::to_string(victim) + " missed 3 heartbeats";
  const double declared = c.log_time(surv[0], t_kill, {vs}) - t_kill;
  double first_declared = NAN;
  std::vector<double> written;
  for (int i : surv) {
    const double d = c.log_time(i, t_kill, {vs}) - t_kill;
    if (!std::isnan(d) && !(first_declared <= d)) first_declared = d;
    written.push_back(c.log_time(i, t_kill, {"agreed record epoch", "written to board"}) - t_kill);
  }
  const double agreed_all = vmax(written);
  out.put(k + "nodes", n, "nodes");
  out.put(k + "period_ms", o.period_ms, "ms");
  out.put(k + "state_bytes_per_rank", double(per), "B");
  out.put(k + "majority_after_loss", majority ? 1 : 0, "bool");
  out.put(k + "detect_seconds", declared, "s");
  out.put(k + "detect_first_seconds", first_declared, "s");
  out.put(k + "agreed_all_seconds", agreed_all, "s");
  out.put(k + "agreement_seconds", agreed_all - declared, "s");
  out.put(k + "notified_all_seconds", notified, "s");
  // Communicator rebuild: the unique-id exchange among survivors (kv). NCCL's init is not run.
  r2ccl_snap_state_t st{};
  r2ccl_snap_state(ranks[surv[0]]->h, &st);
  const std::string key = "bench-ncclid-e" + std::to_string(st.epoch);
  std::vector<double> got(surv.size(), NAN);
  double t_put = NAN;
  std::atomic<int> ready{0};
  parallel(surv.size(), [&](size_t j) {
    Rank& r = *ranks[surv[j]];
    ready++;
    while (ready.load() < int(surv.size())) std::this_thread::yield();
    if (j == 0) {
      uint8_t id[128];
      for (int b = 0; b < 128; ++b) id[b] = uint8_t(b * 37 + st.epoch);
      t_put = now_s();
      check(r2ccl_snap_kv_put(r.h, key.c_str(), id, sizeof(id)), "kv_put");
      got[j] = now_s();
      return;
    }
    uint8_t buf[256];
    size_t len = 0;
    const int rc = r2ccl_snap_kv_get(r.h, key.c_str(), buf, sizeof(buf), &len, int64_t(10e6));
    if (rc == R2CCL_SNAP_OK && len == 128) got[j] = now_s();
  });
  const double kv_all = vmax(got) - t_put;
  bool kv_ok = true;
  for (double g : got) kv_ok = kv_ok && !std::isnan(g);
  kv_ok = kv_ok && surv.size() > 1;  // one survivor has nobody to send the id to
  out.put(k + "kv_id_exchange_seconds", kv_ok ? kv_all : NAN, "s");
  // Survivors restore their home copies, in parallel.
  std::vector<double> rs(surv.size(), NAN);
  std::vector<uint64_t> rstep(surv.size(), 0);
  const double t_r0 = now_s();
  parallel(surv.size(), [&](size_t j) {
    Rank& r = *ranks[surv[j]];
    const double a = now_s();
    check(r2ccl_snap_restore(r.h, int64_t(o.timeout_s * 1e6), &rstep[j]),
          "restore rank " + std::to_string(r.rank));
    rs[j] = now_s() - a;
    if (codec == "lossless" && r.st->hash() != r.hash_at[rstep[j]])
      fail("rank " + std::to_string(r.rank) + ": restored state differs from step " +
           std::to_string(rstep[j]));
  });
  const double restore_wall = now_s() - t_r0;
  out.put(k + "restored_step", double(rstep[0]), "step");
  out.put(k + "survivor_restore_seconds.max", vmax(rs), "s");
  out.put(k + "survivor_restore_seconds.median", median(rs), "s");
  out.put(k + "survivor_restore_wall_seconds", restore_wall, "s");
  // The replacement node: a new daemon (empty) and the lost rank restoring from replicas.
  const double t_start = now_s();
  c.start(victim);
  c.wait_socket(victim);
  const double up = now_s() - t_start;
  Rank& v = *ranks[victim];
  v.st->zero();
  v.open(c.sockets[victim], o.buffers, codec_of(codec));
  const double known = wait_for(v.h, o.timeout_s, [&](const r2ccl_snap_state_t& s) {
    return s.member_count == uint32_t(n) && s.has_complete_step && s.complete_step >= rstep[0];
  });
  uint64_t vstep = 0;
  const double a = now_s();
  const int vrc = std::isnan(known) ? R2CCL_SNAP_ERR_TIMEOUT
                                    : r2ccl_snap_restore(v.h, int64_t(o.timeout_s * 1e6), &vstep);
  const double vt = now_s() - a;
  if (vrc != R2CCL_SNAP_OK)
    note(std::string("replacement restore: ") + r2ccl_snap_strerror(vrc) + ": " +
         r2ccl_snap_last_error(nullptr));
  const bool vok =
      vrc == R2CCL_SNAP_OK && (codec != "lossless" || v.st->hash() == v.hash_at[vstep]);
  out.put(k + "replacement_daemon_socket_seconds", up, "s");
  out.put(k + "replacement_rejoined_seconds", known - t_start, "s");
  out.put(k + "replacement_restore_seconds", vrc == R2CCL_SNAP_OK ? vt : NAN, "s");
  out.put(k + "replacement_restored_step", vrc == R2CCL_SNAP_OK ? double(vstep) : NAN, "step");
  out.put(k + "replacement_verified", vok ? 1 : 0, "bool");
  double hwm = 0;
  for (int i = 0; i < n; ++i)
    if (!std::isnan(c.hwm_mib(i))) hwm = std::max(hwm, c.hwm_mib(i));
  out.put(k + "daemon_peak_rss_mib.max", hwm, "MiB");
  out.put(k + "bench_peak_rss_mib", maxrss_mib(), "MiB");
  out.row("## recovery: " + std::to_string(n) + " nodes, heartbeat " + std::to_string(o.period_ms) +
          " ms, " + mib(double(per)) + " MiB per rank (" + mib(double(per) * n) +
          " MiB total), node " + std::to_string(victim) + " SIGKILLed" +
          (majority ? "" : " (survivors are no majority: nothing is agreed)"));
  out.row("| phase | s (from the kill unless said) |");
  out.row("|---|---|");
  out.row("| detection: coordinator (node " + std::to_string(surv[0]) + ") declares node " +
          std::to_string(victim) + " failed | " + fmt(declared) + " |");
  out.row("| agreement: every survivor wrote the new record | " + fmt(agreed_all) + " |");
  out.row("| notification: every survivor's wait_event() shows it | " + fmt(notified) + " |");
  out.row("| unique-id exchange, kv_put -> every survivor's kv_get (NCCL init not run) | " +
          (kv_ok             ? fmt(kv_all)
           : surv.size() > 1 ? "failed"
                             : "n/a (one survivor)") +
          " (own) |");
  out.row("| survivors' restore from home copies, parallel (wall) | " + fmt(restore_wall) +
          " (own; per rank max " + fmt(vmax(rs)) + ") |");
  out.row("| replacement daemon: spawn -> rejoined, complete step known | " + fmt(known - t_start) +
          " (own) |");
  out.row("| replacement rank's restore from replicas | " +
          (vrc == R2CCL_SNAP_OK ? fmt(vt) : "failed") + " (own) |");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"r2ccl_snapshot_bench: the snapshot sidecar's benchmarks on a loopback cluster"};
  Opts o;
  std::string bytes = "1G";
  app.add_option("--mode", o.mode, "take | restore | recovery")
      ->check(CLI::IsMember({"take", "restore", "recovery"}));
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
  app.add_option("--lr", o.model.lr, "sparse: step size of a moved element (default 1e-4)");
  app.add_option("--buffers", o.buffers, "registered buffers the state is split into (default 1)")
      ->check(CLI::Range(1, 64));
  app.add_option("--step-ms", o.step_ms,
                 "take: a training step of this many ms between takes, no flush (default 0: flush "
                 "after each take)");
  app.add_option("--nodes", o.nodes, "recovery: nodes, one rank each (2..8)")
      ->check(CLI::Range(2, 8));
  app.add_option("--victim", o.victim, "recovery: the node killed (default the last)");
  app.add_option("--period-ms", o.period_ms, "heartbeat period of the daemons (default 100)")
      ->check(CLI::Range(10, 60000));
  app.add_option("--mem-limit-mb", o.mem_limit_mb,
                 "daemons' --mem-limit-mb (default: the daemon's)");
  app.add_option("--timeout-s", o.timeout_s, "bound on each wait (default 120)");
  app.add_option("--workdir", o.workdir, "where the cluster's files go (default /tmp)");
  app.add_option("--seed", o.seed, "state seed");
  app.add_flag("--keep", o.keep, "keep the daemons' logs and files");
  CLI11_PARSE(app, argc, argv);
  try {
    o.bytes = parse_size(bytes);
  } catch (const CLI::Error& e) {
    return app.exit(e);
  }
  if (o.bytes % 2 || o.bytes < 4096) {
    fprintf(stderr, "--bytes must be even and at least 4096\n");
    return 2;
  }
  if (o.victim >= o.nodes) {
    fprintf(stderr, "--victim must be below --nodes\n");
    return 2;
  }
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
  try {
    const auto t0 = Clock::now();
    if (o.mode == "take") {
      if (o.codec != "lossy") run_take(o, "lossless");
      if (o.codec != "lossless") run_take(o, "lossy");
    } else if (o.mode == "restore") {
      run_restore(o);
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
