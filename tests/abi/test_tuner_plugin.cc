// libnccl-tuner-r2ccl.so as NCCL sees it: the exported symbols, every API version (v2..v5)
// driven over every collective, 0 B..16 GiB, 1..8192 ranks and cost tables with IGNORE (-1)
// entries; contexts from several threads; malformed rules files (WARN or strict failure); and
// consistency: processes with different node-local state and the same agreed record choose
// identically, a new agreed record changes the choices of contexts created afterwards.
// Everything that loads the plugin runs in a forked child (fresh environment, fresh library).
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/health_board.h"
#include "r2ccl/nccl_tuner_abi.h"
#include "support/net_harness.h"

using namespace r2ccl::test;

namespace {

constexpr int kA = NCCL_NUM_ALGORITHMS, kP = NCCL_NUM_PROTOCOLS;

std::string tuner_path() { return env_or("R2CCL_TEST_TUNER", ""); }

#define CHILD_CHECK(cond)                                                              \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "child check failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

// ---- child side -------------------------------------------------------------------------
std::mutex g_log_mu;
std::vector<std::string> g_warns;

void capture_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt,
                    ...) {
  if (level != NCCL_LOG_WARN) return;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_log_mu);
  g_warns.push_back(msg);
}

// One loaded API version behind a version-neutral face.
struct Tuner {
  int v = 0;
  const void* sym = nullptr;
  ncclResult_t init(size_t nranks, size_t nnodes, void** ctx) const {
    switch (v) {
      case 5: {
        ncclNvlDomainInfo_v5_t nvl{1, 8, 8};
        static thread_local ncclTunerConstants_v5_t consts{};
        return static_cast<const ncclTuner_v5_t*>(sym)->init(ctx, 0x1234, nranks, nnodes,
                                                             capture_logger, &nvl, &consts);
      }
      case 4:
        return static_cast<const ncclTuner_v4_t*>(sym)->init(nranks, nnodes, capture_logger, ctx);
      case 3:
        return static_cast<const ncclTuner_v3_t*>(sym)->init(nranks, nnodes, capture_logger, ctx);
      default:
        return static_cast<const ncclTuner_v2_t*>(sym)->init(nranks, nnodes, capture_logger, ctx);
    }
  }
  // v3+ only.
  ncclResult_t call(void* ctx, int coll, size_t bytes, int pipe, float* table, int na, int np,
                    int reg, int* nch) const {
    float** t = reinterpret_cast<float**>(table);
    auto f = static_cast<ncclFunc_t>(coll);
    switch (v) {
      case 5:
        return static_cast<const ncclTuner_v5_t*>(sym)->getCollInfo(ctx, f, bytes, pipe, t, na, np,
                                                                    reg, nch);
      case 4:
        return static_cast<const ncclTuner_v4_t*>(sym)->getCollInfo(ctx, f, bytes, pipe, t, na, np,
                                                                    reg, nch);
      default:
        return static_cast<const ncclTuner_v3_t*>(sym)->getCollInfo(ctx, f, bytes, pipe, t, na, np,
                                                                    nch);
    }
  }
  ncclResult_t call_v2(void* ctx, int coll, size_t bytes, int collnet, int nvls, int pipe,
                       int* algo, int* proto, int* nch) const {
    return static_cast<const ncclTuner_v2_t*>(sym)->getCollInfo(
        ctx, static_cast<ncclFunc_t>(coll), bytes, collnet, nvls, pipe, algo, proto, nch);
  }
  ncclResult_t fini(void* ctx) const {
    switch (v) {
      case 5: return static_cast<const ncclTuner_v5_t*>(sym)->finalize(ctx);
      case 4: return static_cast<const ncclTuner_v4_t*>(sym)->destroy(ctx);
      case 3: return static_cast<const ncclTuner_v3_t*>(sym)->destroy(ctx);
      default: return static_cast<const ncclTuner_v2_t*>(sym)->destroy(ctx);
    }
  }
};

bool load_tuner(int v, Tuner* t) {
  void* dl = dlopen(tuner_path().c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    fprintf(stderr, "dlopen %s: %s\n", tuner_path().c_str(), dlerror());
    return false;
  }
  std::string name = "ncclTunerPlugin_v" + std::to_string(v);
  t->v = v;
  t->sym = dlsym(dl, name.c_str());
  if (!t->sym) {
    fprintf(stderr, "dlsym %s failed\n", name.c_str());
    return false;
  }
  const char* n = *static_cast<const char* const*>(t->sym);
  if (!n || strcmp(n, "R2CCL") != 0) {
    fprintf(stderr, "%s.name is '%s'\n", name.c_str(), n ? n : "(null)");
    return false;
  }
  return true;
}

// ---- parent side ------------------------------------------------------------------------
struct TunerChild {
  int status = -1;  // exit code, or 128+signal
  std::string out;  // what the child wrote to its pipe
};

// Runs fn in a forked child with `env` set; fn writes its answer to the fd it is given.
TunerChild run_tuner_child(const std::vector<std::pair<std::string, std::string>>& env,
                           const std::function<int(int fd)>& fn) {
  int p[2];
  REQUIRE(pipe(p) == 0);
  fflush(nullptr);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(p[0]);
    for (auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    int rc = 1;
    try {
      rc = fn(p[1]);
    } catch (...) {
      fprintf(stderr, "child: exception\n");
    }
    close(p[1]);
    _exit(rc);
  }
  close(p[1]);
  TunerChild r;
  char buf[4096];
  ssize_t n;
  while ((n = read(p[0], buf, sizeof(buf))) > 0) r.out.append(buf, static_cast<size_t>(n));
  close(p[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

std::string write_temp(const std::string& text) {
  char path[] = "/tmp/r2ccl-tuner-abi-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  close(fd);
  return path;
}

// ---- the rules of the sweep, and an independent reference interpreter ----------------------
const char* kSweepRules =
    "# sweep rules\n"
    "allreduce 0-64K nodes=2+ -> tree/ll channels=2\n"
    "allreduce 0-64K -> ring/ll\n"
    "allreduce,65537,18446744073709551615,nvls,simple,16,-1,-1,-1,1\n"
    "allreduce 64K+ -> ring/simple\n"
    "allgather any ranks=1-16 -> pat/ll128 channels=4\n"
    "broadcast any -> keep channels=3\n"
    "reducescatter 1M+ pipeops=2+ -> ring/ll128\n";

struct RefRule {
  int coll;
  uint64_t lo, hi;
  uint64_t nodes_lo, ranks_hi;
  int pipe_lo;  // -1 any
  int reg;      // -1 any
  int algo, proto, ch;
};
const RefRule kRef[] = {
    {4, 0, 65536, 2, UINT64_MAX, -1, -1, 0, 0, 2},
    {4, 0, 65536, 0, UINT64_MAX, -1, -1, 1, 0, -1},
    {4, 65537, UINT64_MAX, 0, UINT64_MAX, -1, 1, 4, 2, 16},
    {4, 65536, UINT64_MAX, 0, UINT64_MAX, -1, -1, 1, 2, -1},
    {2, 0, UINT64_MAX, 0, 16, -1, -1, 6, 1, 4},
    {0, 0, UINT64_MAX, 0, UINT64_MAX, -1, -1, -1, -1, 3},
    {3, 1 << 20, UINT64_MAX, 0, UINT64_MAX, 2, -1, 1, 1, -1},
};

// avail(a, p): may the choice be applied. Returns the expected (algo, proto, channels).
struct Expect {
  int algo = -1, proto = -1, ch = -1;
};
Expect expect(int coll, uint64_t bytes, uint64_t ranks, uint64_t nodes, int pipe, int reg,
              const std::function<bool(int, int)>& avail) {
  for (const RefRule& r : kRef) {
    if (r.coll != coll || bytes < r.lo || bytes > r.hi || nodes < r.nodes_lo || ranks > r.ranks_hi)
      continue;
    if (r.pipe_lo >= 0 && pipe < r.pipe_lo) continue;
    if (r.reg >= 0 && reg != r.reg) continue;
    if (r.algo >= 0 && !avail(r.algo, r.proto)) continue;
    return {r.algo, r.proto, r.ch};
  }
  return {};
}

const uint64_t kSizes[] = {0,          1,          4095, 65536, 65537, 1 << 20, (1 << 20) + 1,
                           1ull << 30, 16ull << 30};
const uint64_t kRanks[] = {1, 2, 8, 16, 17, 1024, 8192};

// The sweep in one child for API version v.
int sweep_child(int v, int fd) {
  Tuner t;
  CHILD_CHECK(load_tuner(v, &t));
  std::mt19937 rng(1234 + v);
  long calls = 0;
  for (uint64_t ranks : kRanks) {
    for (uint64_t nodes : {uint64_t{1}, std::max<uint64_t>(1, ranks / 8), ranks}) {
      void* ctx = nullptr;
      CHILD_CHECK(t.init(ranks, nodes, &ctx) == ncclSuccess);
      CHILD_CHECK(ctx != nullptr);
      for (int coll = 0; coll < 5; ++coll)
        for (uint64_t bytes : kSizes)
          for (int pipe : {1, 4})
            for (int reg : {0, 1})
              for (int pattern = 0; pattern < 4; ++pattern) {
                ++calls;
                if (v == 2) {
                  const int collnet = pattern & 1, nvls = (pattern >> 1) & 1;
                  int algo = -1, proto = -1, nch = 0;
                  CHILD_CHECK(t.call_v2(ctx, coll, bytes, collnet, nvls, pipe, &algo, &proto,
                                        &nch) == ncclSuccess);
                  Expect e = expect(coll, bytes, ranks, nodes, pipe, -1, [&](int a, int) {
                    if (a == 6) return false;  // no PAT in v2's table
                    if (a == 2 || a == 3) return collnet != 0;
                    if (a == 4 || a == 5) return nvls != 0;
                    return true;
                  });
                  if (algo != e.algo || proto != e.proto || nch != std::max(e.ch, 0)) {
                    fprintf(
                        stderr,
                        "v2 coll %d bytes %llu ranks %llu nodes %llu pipe %d collnet %d nvls %d: "
                        "got %d/%d ch %d, want %d/%d ch %d\n",
                        coll, (unsigned long long)bytes, (unsigned long long)ranks,
                        (unsigned long long)nodes, pipe, collnet, nvls, algo, proto, nch, e.algo,
                        e.proto, e.ch);
                    return 1;
                  }
                  continue;
                }
                const int na = pattern == 3 ? 6 : kA;  // NCCL <= 2.22 tables have no PAT row
                std::vector<float> table(na * kP);
                for (auto& c : table) c = 1.0f + static_cast<float>(rng() % 1000);
                if (pattern >= 1)
                  for (auto& c : table)
                    if (rng() % 3 == 0) c = NCCL_ALGO_PROTO_IGNORE;
                if (pattern == 2)
                  for (int p = 0; p < kP; ++p)
                    table[0 * kP + p] = NCCL_ALGO_PROTO_IGNORE;  // no tree
                const std::vector<float> before = table;
                int nch = 0;
                CHILD_CHECK(t.call(ctx, coll, bytes, pipe, table.data(), na, kP, reg, &nch) ==
                            ncclSuccess);
                const int reg_seen = v >= 4 ? reg : -1;
                Expect e = expect(coll, bytes, ranks, nodes, pipe, reg_seen,
                                  [&](int a, int p) { return a < na && before[a * kP + p] >= 0; });
                for (int i = 0; i < na * kP; ++i) {
                  const bool chosen = e.algo >= 0 && i == e.algo * kP + e.proto;
                  const float want = chosen ? 0.0f : before[i];
                  if (table[i] != want || (before[i] < 0 && table[i] != NCCL_ALGO_PROTO_IGNORE)) {
                    fprintf(
                        stderr,
                        "v%d coll %d bytes %llu ranks %llu nodes %llu pipe %d reg %d pattern %d: "
                        "cell %d is %g (was %g), want %g\n",
                        v, coll, (unsigned long long)bytes, (unsigned long long)ranks,
                        (unsigned long long)nodes, pipe, reg, pattern, i, table[i], before[i],
                        want);
                    return 1;
                  }
                }
                if (nch != std::max(e.ch, 0)) {
                  fprintf(stderr, "v%d coll %d bytes %llu: nChannels %d, want %d\n", v, coll,
                          (unsigned long long)bytes, nch, std::max(e.ch, 0));
                  return 1;
                }
              }
      CHILD_CHECK(t.fini(ctx) == ncclSuccess);
    }
  }
  write_all(fd, std::to_string(calls));
  return 0;
}

// Decisions of one context over a fixed sweep, as text (argmin cell and channels per call).
std::string decision_digest(const Tuner& t, void* ctx) {
  std::ostringstream o;
  for (int coll = 0; coll < 5; ++coll)
    for (uint64_t bytes = 1; bytes <= (16ull << 30); bytes *= 4) {
      float table[kA * kP];
      for (int i = 0; i < kA * kP; ++i)
        table[i] = (i % 5 == 4) ? NCCL_ALGO_PROTO_IGNORE : 100.0f + i;
      int nch = 0;
      if (t.call(ctx, coll, bytes, 1, table, kA, kP, 0, &nch) != ncclSuccess) return "error";
      int best = -1;
      for (int i = 0; i < kA * kP; ++i)
        if (table[i] >= 0 && (best < 0 || table[i] < table[best])) best = i;
      o << best << ":" << nch << " ";
    }
  return o.str();
}

}  // namespace

TEST_CASE("tuner: exported dynamic symbols are exactly ncclTunerPlugin_v2..v5", "[abi][tuner]") {
  const std::string so = tuner_path();
  REQUIRE_FALSE(so.empty());
  std::set<std::string> syms;
  for (const auto& [name, type] : dynamic_symbols(so)) {
    syms.insert(name);
    CHECK((type == '?' || is_data_symbol(type)));  // tables are data objects, not functions
  }
  CHECK(syms == std::set<std::string>{"ncclTunerPlugin_v2", "ncclTunerPlugin_v3",
                                      "ncclTunerPlugin_v4", "ncclTunerPlugin_v5"});
  std::string out;
  // No libstdc++ dependency (linked statically) and nothing NCCL-internal to resolve.
  REQUIRE(run_command("ldd " + shell_quote(so), &out) == 0);
  CHECK(out.find("libstdc++") == std::string::npos);
}

TEST_CASE("tuner: every API version follows the rules; IGNORE entries never change",
          "[abi][tuner]") {
  const std::string rules = write_temp(kSweepRules);
  for (int v : {5, 4, 3, 2}) {
    INFO("API v" << v);
    TunerChild r = run_tuner_child({{"R2CCL_TUNER_CONFIG", rules}, {"R2CCL_HEALTH_BOARD", "none"}},
                                   [v](int fd) { return sweep_child(v, fd); });
    CHECK(r.status == 0);
    CHECK(std::atol(r.out.c_str()) > 1000);
  }
  unlink(rules.c_str());
}

TEST_CASE("tuner: no rules file leaves NCCL's table alone", "[abi][tuner]") {
  TunerChild r = run_tuner_child({{"R2CCL_HEALTH_BOARD", "none"}}, [](int) {
    for (int v : {5, 4, 3}) {
      Tuner t;
      CHILD_CHECK(load_tuner(v, &t));
      void* ctx = nullptr;
      CHILD_CHECK(t.init(64, 8, &ctx) == ncclSuccess);
      for (int coll = 0; coll < 5; ++coll)
        for (uint64_t bytes : kSizes) {
          float table[kA * kP];
          for (int i = 0; i < kA * kP; ++i) table[i] = i % 4 == 0 ? -1.0f : 3.0f * i;
          float before[kA * kP];
          memcpy(before, table, sizeof(table));
          int nch = 0;
          CHILD_CHECK(t.call(ctx, coll, bytes, 1, table, kA, kP, 0, &nch) == ncclSuccess);
          CHILD_CHECK(memcmp(table, before, sizeof(table)) == 0);
          CHILD_CHECK(nch == 0);
        }
      CHILD_CHECK(t.fini(ctx) == ncclSuccess);
    }
    Tuner t2;
    CHILD_CHECK(load_tuner(2, &t2));
    void* ctx = nullptr;
    CHILD_CHECK(t2.init(64, 8, &ctx) == ncclSuccess);
    int algo = -1, proto = -1, nch = 0;
    CHILD_CHECK(t2.call_v2(ctx, 4, 1024, 1, 1, 1, &algo, &proto, &nch) == ncclSuccess);
    CHILD_CHECK(algo == -1 && proto == -1 && nch == 0);
    CHILD_CHECK(t2.fini(ctx) == ncclSuccess);
    CHILD_CHECK(g_warns.empty());
    return 0;
  });
  CHECK(r.status == 0);
}

TEST_CASE("tuner: the cost model rewrites modelled entries only, never IGNORE", "[abi][tuner]") {
  const std::string rules = write_temp("model on net_bw=25 net_lat=5\n");
  TunerChild r =
      run_tuner_child({{"R2CCL_TUNER_CONFIG", rules}, {"R2CCL_HEALTH_BOARD", "none"}}, [](int) {
        Tuner t;
        CHILD_CHECK(load_tuner(5, &t));
        std::mt19937 rng(7);
        for (uint64_t ranks : kRanks) {
          void* ctx = nullptr;
          CHILD_CHECK(t.init(ranks, std::max<uint64_t>(1, ranks / 8), &ctx) == ncclSuccess);
          for (int coll = 0; coll < 5; ++coll)
            for (uint64_t bytes : kSizes) {
              float table[kA * kP];
              for (auto& c : table)
                c = rng() % 4 == 0 ? -1.0f : 1.25f + static_cast<float>(rng() % 100);
              float before[kA * kP];
              memcpy(before, table, sizeof(table));
              int nch = 0;
              CHILD_CHECK(t.call(ctx, coll, bytes, 1, table, kA, kP, 1, &nch) == ncclSuccess);
              CHILD_CHECK(nch == 0);
              for (int i = 0; i < kA * kP; ++i) {
                const int a = i / kP;
                if (before[i] < 0)
                  CHILD_CHECK(table[i] == NCCL_ALGO_PROTO_IGNORE);
                else
                  CHILD_CHECK(table[i] > 0);
                if (a >= 2 && a <= 5) CHILD_CHECK(table[i] == before[i]);  // CollNet/NVLS: no model
              }
              if (coll == 4 && before[1 * kP + 2] >= 0)
                CHILD_CHECK(table[1 * kP + 2] != before[1 * kP + 2]);
            }
          CHILD_CHECK(t.fini(ctx) == ncclSuccess);
        }
        // v2 with the model: some algorithm/protocol is always picked for AllReduce.
        Tuner t2;
        CHILD_CHECK(load_tuner(2, &t2));
        void* ctx = nullptr;
        CHILD_CHECK(t2.init(64, 8, &ctx) == ncclSuccess);
        int algo = -1, proto = -1, nch = 0;
        CHILD_CHECK(t2.call_v2(ctx, 4, 1 << 30, 0, 0, 1, &algo, &proto, &nch) == ncclSuccess);
        CHILD_CHECK(algo == NCCL_ALGO_RING && proto == NCCL_PROTO_SIMPLE);
        CHILD_CHECK(t2.fini(ctx) == ncclSuccess);
        return 0;
      });
  CHECK(r.status == 0);
  unlink(rules.c_str());
}

TEST_CASE("tuner: many contexts from several threads, finalized in mixed order", "[abi][tuner]") {
  const std::string rules = write_temp(kSweepRules);
  TunerChild r =
      run_tuner_child({{"R2CCL_TUNER_CONFIG", rules}, {"R2CCL_HEALTH_BOARD", "none"}}, [](int) {
        Tuner t5, t4;
        CHILD_CHECK(load_tuner(5, &t5));
        CHILD_CHECK(load_tuner(4, &t4));
        std::atomic<int> failures{0};
        std::vector<std::thread> threads;
        for (int th = 0; th < 8; ++th) {
          threads.emplace_back([&, th] {
            std::mt19937 rng(th);
            std::vector<std::pair<const Tuner*, void*>> live;
            for (int it = 0; it < 300; ++it) {
              const Tuner* t = rng() % 2 ? &t5 : &t4;
              void* ctx = nullptr;
              if (t->init(16, 2, &ctx) != ncclSuccess || !ctx) {
                ++failures;
                continue;
              }
              live.emplace_back(t, ctx);
              // Use a random live context (possibly created many iterations ago).
              auto& [ut, uctx] = live[rng() % live.size()];
              float table[kA * kP];
              for (int i = 0; i < kA * kP; ++i) table[i] = 50.0f + i;
              int nch = 0;
              if (ut->call(uctx, 4, 1024, 1, table, kA, kP, 0, &nch) != ncclSuccess ||
                  table[0 * kP + 0] != 0.0f || nch != 2)
                ++failures;
              // Finalize a random one, not necessarily the newest.
              if (live.size() > 4 || rng() % 3 == 0) {
                size_t k = rng() % live.size();
                if (live[k].first->fini(live[k].second) != ncclSuccess) ++failures;
                live.erase(live.begin() + static_cast<long>(k));
              }
            }
            for (auto& [lt, lc] : live)
              if (lt->fini(lc) != ncclSuccess) ++failures;
          });
        }
        for (auto& th : threads) th.join();
        CHILD_CHECK(failures.load() == 0);
        CHILD_CHECK(t5.fini(nullptr) == ncclSuccess);  // finalize of a failed init's NULL context
        CHILD_CHECK(g_warns.empty());
        return 0;
      });
  CHECK(r.status == 0);
  unlink(rules.c_str());
}

TEST_CASE(
    "tuner: a malformed row warns once with file and line and is skipped alone, or fails "
    "init when strict",
    "[abi][tuner]") {
  const std::vector<std::pair<std::string, std::string>> files = {
      {"allreduce,0,100,ring,simple,2,1\n", ":1:1:"},                      // wrong column count
      {"# c\nallreduce,0,-100,ring,simple,2,1,1\n", ":2:13:"},             // negative size
      {"allreduce 0-1K -> ring/simple\nbcast any -> ring/ll\n", ":2:1:"},  // unknown name
      {"allreduce 0-1K -> warp/simple\n", ":1:19:"},                       // unknown algorithm
      {"allreduce,0,123456789012345678901234567890,ring,simple,2,1,1\n", ":1:13:"},  // huge
      {"allreduce 0-1K -> ring/simple channels=100000\n", ":1:31:"},  // huge channels
      {std::string("\x7f"
                   "ELF\x02\x01\x01\0\0\0,\xff\xfe\n",
                   15),
       ":1:1:"},  // binary junk
  };
  for (const auto& [text, where] : files) {
    const std::string path = write_temp(text);
    INFO("file: " << text);
    // The one file with a good row besides the bad one: that row still rules allreduce.
    const bool rest_applies = text.rfind("allreduce 0-1K -> ring/simple\n", 0) == 0;
    // Default: init succeeds; the first init of a loaded tuner warns once naming the file,
    // line and column, a second communicator reading the same file does not warn again (a
    // reloaded library may warn again); the bad row is skipped and the others apply.
    TunerChild r = run_tuner_child(
        {{"R2CCL_TUNER_CONFIG", path}, {"R2CCL_HEALTH_BOARD", "none"}},
        [&, w = where, p = path](int) {
          for (int v : {5, 3}) {
            g_warns.clear();
            Tuner t;
            CHILD_CHECK(load_tuner(v, &t));
            void* ctx = nullptr;
            CHILD_CHECK(t.init(8, 2, &ctx) == ncclSuccess);
            CHILD_CHECK(ctx != nullptr);
            CHILD_CHECK(v == 5 ? g_warns.size() == 1 : g_warns.size() <= 1);
            if (!g_warns.empty()) {
              // Through NCCL's logger as common's facade's TUNER/R2CCL component.
              CHILD_CHECK(g_warns[0].rfind("TUNER/R2CCL rules file " + p, 0) == 0);
              if (g_warns[0].find(p + w) == std::string::npos) {
                fprintf(stderr, "WARN '%s' does not name %s%s\n", g_warns[0].c_str(), p.c_str(),
                        w.c_str());
                return 1;
              }
            }
            g_warns.clear();
            void* ctx2 = nullptr;
            CHILD_CHECK(t.init(8, 2, &ctx2) == ncclSuccess);
            CHILD_CHECK(g_warns.empty());
            float table[kA * kP];
            for (int i = 0; i < kA * kP; ++i) table[i] = 1.0f + i;
            float before[kA * kP];
            memcpy(before, table, sizeof(table));
            int nch = 0;
            CHILD_CHECK(t.call(ctx, 4, 100, 1, table, kA, kP, 0, &nch) == ncclSuccess);
            CHILD_CHECK((memcmp(table, before, sizeof(table)) != 0) == rest_applies);
            CHILD_CHECK(t.fini(ctx2) == ncclSuccess);
            CHILD_CHECK(t.fini(ctx) == ncclSuccess);
          }
          return 0;
        });
    CHECK(r.status == 0);
    // Strict: init fails with ncclInvalidUsage and leaves no context.
    r = run_tuner_child(
        {{"R2CCL_TUNER_CONFIG", path}, {"R2CCL_TUNER_STRICT", "1"}, {"R2CCL_HEALTH_BOARD", "none"}},
        [](int) {
          for (int v : {5, 4, 3, 2}) {
            Tuner t;
            CHILD_CHECK(load_tuner(v, &t));
            void* ctx = reinterpret_cast<void*>(0x1);
            CHILD_CHECK(t.init(8, 2, &ctx) == ncclInvalidUsage);
            CHILD_CHECK(ctx == nullptr);
            CHILD_CHECK(t.fini(ctx) == ncclSuccess);
          }
          return 0;
        });
    CHECK(r.status == 0);
    unlink(path.c_str());
  }
  // An invalid R2CCL_* value is a configuration error too.
  TunerChild r = run_tuner_child({{"R2CCL_TUNER_STRICT", "maybe"}}, [](int) {
    Tuner t;
    CHILD_CHECK(load_tuner(5, &t));
    void* ctx = nullptr;
    CHILD_CHECK(t.init(8, 2, &ctx) == ncclInvalidUsage);
    CHILD_CHECK(!g_warns.empty() && g_warns[0].find("R2CCL_TUNER_STRICT") != std::string::npos);
    return 0;
  });
  CHECK(r.status == 0);
}

TEST_CASE("tuner: identical choices across processes from the agreed record only", "[abi][tuner]") {
  namespace board = r2ccl::board;
  const std::string name = "tunertest" + std::to_string(getpid());
  const std::string rules = write_temp(
      "model on net_bw=50 net_lat=5\n"
      "allreduce 0-1M usable=0-20 -> ring/ll channels=7\n");
  auto record = [](uint64_t epoch, float slow) {
    auto rec = std::make_unique<board::AgreedRecord>();
    rec->epoch = epoch;
    rec->n_nodes = 4;
    rec->members[0] = 0xf;
    for (int i = 0; i < 4; ++i) rec->node_usable_gbps[i] = 50.0f;
    rec->node_usable_gbps[2] = slow;
    rec->node_usable_gbps[9] = 1.0f;  // not a member: ignored
    return rec;
  };
  std::string err;
  board::remove_board(name);

  // One "rank": its own R2CCL_RANK, its own rail state on the board (node-local), then a
  // tuner context over 32 ranks on 4 nodes; answers with the decisions' digest.
  auto rank_digest = [&](int rank, uint32_t rail_mbps, board::RailState state) {
    TunerChild r =
        run_tuner_child({{"R2CCL_TUNER_CONFIG", rules},
                         {"R2CCL_HEALTH_BOARD", name},
                         {"R2CCL_RANK", std::to_string(rank)}},
                        [&](int fd) {
                          board::Publisher pub;
                          std::string e;
                          CHILD_CHECK(pub.open(name, &e));
                          board::RailFields f;
                          board::set_text(f.name, sizeof(f.name), "eth" + std::to_string(rank));
                          f.state = state;
                          f.usable_mbps = rail_mbps;
                          CHILD_CHECK(pub.publish(0, f));
                          Tuner t;
                          CHILD_CHECK(load_tuner(5, &t));
                          void* ctx = nullptr;
                          CHILD_CHECK(t.init(32, 4, &ctx) == ncclSuccess);
                          write_all(fd, decision_digest(t, ctx));
                          CHILD_CHECK(t.fini(ctx) == ncclSuccess);
                          pub.close();
                          return 0;
                        });
    REQUIRE(r.status == 0);
    return r.out;
  };

  // No board at all: as if nothing were agreed.
  const std::string none = rank_digest(0, 100000, board::RailState::kUp);
  board::remove_board(name);
  REQUIRE(board::publish_agreed_record(name, *record(1, 50.0f), &err));
  INFO(err);
  const std::string d1 = rank_digest(0, 100000, board::RailState::kUp);
  CHECK(d1 == none);
  // Different ranks, different node-local rail states: the same choices.
  CHECK(rank_digest(1, 0, board::RailState::kDown) == d1);
  CHECK(rank_digest(2, 25000, board::RailState::kFailed) == d1);
  CHECK(rank_digest(3, 400000, board::RailState::kDraining) == d1);

  // A new agreed record (node 2 at 10 GB/s) changes the choices, identically everywhere.
  REQUIRE(board::publish_agreed_record(name, *record(2, 10.0f), &err));
  const std::string d2 = rank_digest(0, 100000, board::RailState::kUp);
  CHECK(d2 != d1);
  CHECK(rank_digest(1, 0, board::RailState::kDown) == d2);
  CHECK(rank_digest(5, 50000, board::RailState::kUp) == d2);

  // A context keeps the record it read at init; only contexts created afterwards change.
  REQUIRE(board::publish_agreed_record(name, *record(3, 50.0f), &err));
  TunerChild r =
      run_tuner_child({{"R2CCL_TUNER_CONFIG", rules}, {"R2CCL_HEALTH_BOARD", name}}, [&](int fd) {
        Tuner t;
        CHILD_CHECK(load_tuner(4, &t));
        void* before = nullptr;
        CHILD_CHECK(t.init(32, 4, &before) == ncclSuccess);
        std::string e;
        CHILD_CHECK(board::publish_agreed_record(name, *record(4, 10.0f), &e));  // fake publisher
        void* after = nullptr;
        CHILD_CHECK(t.init(32, 4, &after) == ncclSuccess);
        write_all(fd, decision_digest(t, before) + "|" + decision_digest(t, after));
        t.fini(before);
        t.fini(after);
        return 0;
      });
  REQUIRE(r.status == 0);
  CHECK(r.out == d1 + "|" + d2);
  board::remove_board(name);
  unlink(rules.c_str());
}
