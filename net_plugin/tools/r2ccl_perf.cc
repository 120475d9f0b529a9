// r2ccl_perf: a mini-NCCL driver for NCCL net plugins (r2ccl or any other). It loads a plugin
// the way NCCL does, calls it the way one NCCL generation (net API v8..v11) does, runs ring
// collectives between processes on host memory through nothing but the plugin API, and
// prints nccl-tests' table. See --help and perf_coll.h.
//
// Processes: with --ranks N the parent forks N ranks on this host and serves the rendezvous on
// loopback; with --rendezvous ADDR --rank R --nranks N each rank is started by hand (rank 0
// serves the rendezvous; ADDR is HOST:PORT, [IPV6]:PORT or [IPV6%SCOPE]:PORT, perf_rdv.h). Each
// rank sets R2CCL_RANK before it dlopens the plugin.
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "perf_coll.h"
#include "perf_net.h"
#include "perf_rdv.h"
#include "perf_stats.h"
#include "r2ccl/ext.h"
#include "r2ccl/nccl_abi.h"
#include "r2ccl/params.h"

namespace r2perf {
namespace {

constexpr size_t kMaxSlice = 1ull << 30;  // NCCL never posts more than 1 GiB at once
constexpr int kMaxRanksExact = 256;       // float sums of the --check data stay exact

struct Options {
  std::string plugin = "r2ccl";
  int net_api = 0;
  int ranks = 2;
  bool ranks_set = false;
  std::string rendezvous;
  RdvAddress rdv;  // --rendezvous, parsed
  int rank = -1;
  int nranks = -1;
  int channels = 1;
  int dev = 0;
  Op op = Op::kAllReduce;
  size_t slice = 1 << 20;
  int inflight = 4;
  bool check = false;
  size_t min_bytes = 8;
  size_t max_bytes = 64 << 20;
  int factor = 2;
  size_t step = 0;
  int iters = 20;
  int warmup = 2;
  int repeat = 1;
  bool stats = false;
  bool expect_replay = false;
  std::string inject;   // --inject SPEC (armed through r2cclExt_v1.armFaults)
  int inject_pass = 1;  // --inject-pass K
  bool params = false;
  bool markdown = false;
  int timeout = 600;
  bool flush = true;
  double idle_s = 0;  // --idle SEC: connections open and idle this long before the sweep
};

const char kUsage[] =
    "Usage: r2ccl_perf [options]\n"
    "Mini-NCCL driver: runs ring collectives between processes through an NCCL net plugin\n"
    "(host memory, nothing but the plugin API) and prints nccl-tests' table.\n"
    "\n"
    "Plugin\n"
    "  --plugin X        net plugin to load (default r2ccl). As NCCL_NET_PLUGIN: dlopen(X); if\n"
    "                    that fails and X has no '/' and is not lib*.so, libnccl-net-X.so.\n"
    "                    Then, for names without '/', relative to this executable's\n"
    "                    directory: ../lib/ (build and install tree), ../net_plugin/.\n"
    "  --net-api V       8, 9, 10 or 11: use ncclNetPlugin_vV and call it like that NCCL\n"
    "                    generation (default: the newest the plugin exports, v11..v8).\n"
    "                    v11: init(ctx, commId, config) per communicator, finalize at the end;\n"
    "                    v10: init once, config on connect; v9+: irecv sees the 0x1\n"
    "                    OPTIONAL_RECV_COMPLETION sentinel; v8: int sizes.\n"
    "\n"
    "Ranks\n"
    "  --ranks N         ranks to fork on this host (default 2)\n"
    "  --rendezvous ADDR multi-host: every rank meets at ADDR, rank 0's address, one of\n"
    "                      HOST:PORT          a host name or an IPv4 address\n"
    "                      [IPV6]:PORT        an IPv6 address, e.g. [fd00::1]:29500\n"
    "                      [IPV6%SCOPE]:PORT  SCOPE: an interface of this host, by name or\n"
    "                                         index; required for a link-local fe80::/10\n"
    "                                         address, e.g. [fe80::1%eth0]:29500, refused\n"
    "                                         for any other\n"
    "                    PORT: 1..65535. Rank 0 listens on PORT: for an IPv6 address on that\n"
    "                    address (it must be rank 0's), for an IPv4 address on 0.0.0.0, for a\n"
    "                    name on every address of its families ([::] dual-stack where it has\n"
    "                    IPv6). Each rank names its own SCOPE (interface names differ by\n"
    "                    host). Refused at once (exit 2): a missing or out-of-range port,\n"
    "                    unbalanced brackets, IPv6 without brackets, an empty host, an\n"
    "                    unknown interface, a name that does not resolve.\n"
    "  --rank R          this process's rank (with --rendezvous)\n"
    "  --nranks N        number of ranks (with --rendezvous)\n"
    "  --timeout SEC     fail a run that takes longer than this (default 600)\n"
    "\n"
    "Topology\n"
    "  --channels C      independent rings (default 1, at most 512: NCCL opens up to 64 per\n"
    "                    peer; more stand for the connections of several peers); channel c\n"
    "                    uses device (dev0+c)%ndev\n"
    "  --dev D           dev0, the device of channel 0 (default 0)\n"
    "\n"
    "Work\n"
    "  --op OP           allreduce (float sum; ring reduce-scatter + all-gather), allgather,\n"
    "                    broadcast (ring pipeline from rank 0), sendrecv (to the next rank,\n"
    "                    from the previous one) or send (one direction: rank 0 sends to rank\n"
    "                    1, other ranks idle). Default allreduce.\n"
    "  -b, --minbytes S  smallest size (default 8); K, M, G suffixes (powers of 1024); 0 is fine\n"
    "  -e, --maxbytes S  largest size (default 64M)\n"
    "  -f, --stepfactor F  multiply the size by F (default 2)\n"
    "  -i, --stepbytes S add S to the size instead of multiplying\n"
    "  -n, --iters N     timed iterations per size (default 20)\n"
    "  -w, --warmup_iters N  untimed iterations per size (default 2)\n"
    "  --repeat R        run the whole sweep R times on the same connections, printing\n"
    "                    '# pass k/R' before each table (default 1)\n"
    "  --idle SEC        once every connection is up, leave them idle SEC seconds (1..3600) and\n"
    "                    print per rank the setup time and the process's CPU time meanwhile\n"
    "                    (the plugin's background work: probes, progress), then run the sweep\n"
    "  --slice BYTES     cut each ring step into slices of this size (default 1M, max 1G)\n"
    "  --inflight K      isend and irecv requests outstanding per connection (1..8, default 4)\n"
    "  --no-flush        do not call iflush after each receive (default: call it; a NULL\n"
    "                    flush request counts as done)\n"
    "\n"
    "Checks and output\n"
    "  -c, --check [0|1] verify every element of every timed iteration bit for bit (data setup\n"
    "                    and verification are not timed); mismatches are the #wrong column\n"
    "  --stats           after the run print the plugin's r2cclExt_v1 statistics per rank\n"
    "                    (chunks = first sends on the rail; replayed = chunks re-sent on it\n"
    "                    after another rail failed; switchovers = times traffic left it)\n"
    "  --inject SPEC     arm in-process faults (R2CCL_FAULT_INJECT syntax, 'at' counting from\n"
    "                    the start of the pass given by --inject-pass) through the plugin's\n"
    "                    r2cclExt_v1.armFaults; each rank arms the entries for its rank\n"
    "  --inject-pass K   the pass at whose start --inject is armed (default 1)\n"
    "  --expect-replay   exit non-zero unless the stats (summed over ranks) show at least one\n"
    "                    replayed chunk; implies --stats\n"
    "  --params [--markdown]  print the R2CCL_* parameter table and exit\n"
    "  -h, --help        this text\n"
    "\n"
    "Environment: NCCL_DEBUG=WARN (default) or INFO for the plugin's log lines; every rank\n"
    "gets R2CCL_RANK=<rank> before the plugin is loaded.\n"
    "Exit status: 0 when every rank finished, no plugin call failed and (with --check) no\n"
    "element was wrong; 1 otherwise; 2 for a usage error.\n";

[[noreturn]] void usage_error(const std::string& msg) {
  fprintf(stderr, "r2ccl_perf: %s\n(see r2ccl_perf --help)\n", msg.c_str());
  exit(2);
}

long parse_long(const std::string& opt, const std::string& v, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  long x = strtol(v.c_str(), &end, 10);
  if (v.empty() || *end || errno || x < lo || x > hi)
    usage_error(opt + ": '" + v + "' is not an integer in [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "]");
  return x;
}

size_t parse_size(const std::string& opt, const std::string& v) {
  int64_t b = 0;
  if (!r2ccl::parse_size_bytes(v, &b))
    usage_error(opt + ": '" + v + "' is not a size (bytes, with an optional K, M or G suffix)");
  return static_cast<size_t>(b);
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i], v;
    bool has_eq = false;
    if (a.rfind("--", 0) == 0 && a.find('=') != std::string::npos) {
      v = a.substr(a.find('=') + 1);
      a = a.substr(0, a.find('='));
      has_eq = true;
    }
    auto value = [&]() -> std::string {
      if (has_eq) return v;
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      fputs(kUsage, stdout);
      exit(0);
    } else if (a == "--plugin") {
      o.plugin = value();
    } else if (a == "--net-api") {
      o.net_api = static_cast<int>(parse_long(a, value(), 8, 11));
    } else if (a == "--ranks") {
      o.ranks = static_cast<int>(parse_long(a, value(), 1, 4096));
      o.ranks_set = true;
    } else if (a == "--rendezvous") {
      o.rendezvous = value();
      std::string err;
      if (!parse_rdv_address(o.rendezvous, &o.rdv, &err)) usage_error("--rendezvous: " + err);
    } else if (a == "--rank") {
      o.rank = static_cast<int>(parse_long(a, value(), 0, 1 << 20));
    } else if (a == "--nranks") {
      o.nranks = static_cast<int>(parse_long(a, value(), 1, 1 << 20));
    } else if (a == "--channels") {
      o.channels = static_cast<int>(parse_long(a, value(), 1, 512));
    } else if (a == "--dev") {
      o.dev = static_cast<int>(parse_long(a, value(), 0, 1 << 20));
    } else if (a == "--op") {
      std::string op = value();
      if (op == "allreduce")
        o.op = Op::kAllReduce;
      else if (op == "allgather")
        o.op = Op::kAllGather;
      else if (op == "broadcast")
        o.op = Op::kBroadcast;
      else if (op == "sendrecv")
        o.op = Op::kSendRecv;
      else if (op == "send")
        o.op = Op::kSend;
      else
        usage_error("--op: '" + op + "' is not allreduce, allgather, broadcast, sendrecv or send");
    } else if (a == "-b" || a == "--minbytes") {
      o.min_bytes = parse_size(a, value());
    } else if (a == "-e" || a == "--maxbytes") {
      o.max_bytes = parse_size(a, value());
    } else if (a == "-f" || a == "--stepfactor") {
      o.factor = static_cast<int>(parse_long(a, value(), 2, 1 << 20));
      o.step = 0;
    } else if (a == "-i" || a == "--stepbytes") {
      o.step = parse_size(a, value());
      if (o.step == 0) usage_error(a + " must be > 0");
    } else if (a == "-n" || a == "--iters") {
      o.iters = static_cast<int>(parse_long(a, value(), 1, INT_MAX));
    } else if (a == "-w" || a == "--warmup_iters") {
      o.warmup = static_cast<int>(parse_long(a, value(), 0, INT_MAX));
    } else if (a == "--repeat") {
      o.repeat = static_cast<int>(parse_long(a, value(), 1, INT_MAX));
    } else if (a == "--idle") {
      o.idle_s = static_cast<double>(parse_long(a, value(), 1, 3600));
    } else if (a == "--slice") {
      o.slice = parse_size(a, value());
      if (o.slice < sizeof(float) || o.slice > kMaxSlice) usage_error("--slice must be in [4, 1G]");
    } else if (a == "--inflight") {
      o.inflight = static_cast<int>(parse_long(a, value(), 1, 8));
    } else if (a == "--no-flush") {
      o.flush = false;
    } else if (a == "-c" || a == "--check") {
      // Optional 0|1 argument, as nccl-tests' -c.
      if (has_eq)
        o.check = parse_long(a, v, 0, 1) != 0;
      else if (i + 1 < argc && (strcmp(argv[i + 1], "0") == 0 || strcmp(argv[i + 1], "1") == 0))
        o.check = argv[++i][0] == '1';
      else
        o.check = true;
    } else if (a == "--stats") {
      o.stats = true;
    } else if (a == "--inject") {
      o.inject = value();
    } else if (a == "--inject-pass") {
      o.inject_pass = static_cast<int>(parse_long(a, value(), 1, 1000000));
    } else if (a == "--expect-replay") {
      o.expect_replay = true;
      o.stats = true;
    } else if (a == "--params") {
      o.params = true;
    } else if (a == "--markdown") {
      o.markdown = true;
    } else if (a == "--timeout") {
      o.timeout = static_cast<int>(parse_long(a, value(), 1, 86400 * 7));
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  if (o.params) return o;
  if (o.min_bytes > o.max_bytes) usage_error("-b is larger than -e");
  if (!o.rendezvous.empty()) {
    if (o.ranks_set) usage_error("--ranks is for one host; with --rendezvous use --rank/--nranks");
    if (o.rank < 0 || o.nranks < 1) usage_error("--rendezvous needs --rank R and --nranks N");
    if (o.rank >= o.nranks) usage_error("--rank must be < --nranks");
  } else if (o.rank >= 0 || o.nranks > 0) {
    usage_error("--rank/--nranks need --rendezvous ADDR");
  }
  int n = o.rendezvous.empty() ? o.ranks : o.nranks;
  if (o.check && o.op == Op::kAllReduce && n > kMaxRanksExact)
    usage_error("--check of allreduce supports at most 256 ranks (exact float sums)");
  return o;
}

// The sizes of the sweep, after rounding to whole elements; repeats are dropped.
std::vector<Geometry> sweep_sizes(const Options& o, int nranks) {
  std::vector<Geometry> out;
  size_t size = o.min_bytes;
  for (;;) {
    Geometry g = geometry(o.op, size, nranks);
    if (out.empty() || out.back().bytes != g.bytes) out.push_back(g);
    size_t next = o.step ? size + o.step : (size == 0 ? 1 : size * static_cast<size_t>(o.factor));
    if (next <= size || next > o.max_bytes) break;
    size = next;
  }
  return out;
}

// The options that decide which messages and rendezvous rounds a rank takes part in. Ranks
// started by hand (--rendezvous) must agree on them.
std::string protocol_options(const Options& o) {
  char b[256];
  snprintf(b, sizeof(b),
           "--op %s --channels %d -b %zu -e %zu -f %d -i %zu -n %d -w %d "
           "--repeat %d --check %d --stats %d",
           op_name(o.op), o.channels, o.min_bytes, o.max_bytes, o.factor, o.step, o.iters, o.warmup,
           o.repeat, o.check ? 1 : 0, o.stats ? 1 : 0);
  return b;
}

// ---------------------------------------------------------------- per-rank diagnostics

int g_rank = -1;
int g_timeout = 600;
char g_phase[256] = "starting";

void set_phase(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void set_phase(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_phase, sizeof(g_phase), fmt, ap);
  va_end(ap);
}

void on_alarm(int) {
  char buf[512];
  int n = snprintf(buf, sizeof(buf),
                   "r2ccl_perf: rank %d: timeout: still running after %d s "
                   "(--timeout) while %s\n",
                   g_rank, g_timeout, g_phase);
  if (n > 0) {
    ssize_t w = write(STDERR_FILENO, buf, std::min(static_cast<size_t>(n), sizeof(buf) - 1));
    (void)w;
  }
  _exit(1);
}

// Ends this rank as soon as the rendezvous server drops the connection (another rank died),
// instead of waiting in the data path for a peer that is gone.
class Watchdog {
 public:
  ~Watchdog() { stop(); }
  void start(int fd) {
    stop_ = false;
    th_ = std::thread([this, fd] {
      while (!stop_.load()) {
        pollfd p{fd, POLLRDHUP, 0};
        int n = poll(&p, 1, 100);
        if (n > 0 && !stop_.load()) {
          char buf[512];
          int m = snprintf(buf, sizeof(buf),
                           "r2ccl_perf: rank %d: another rank failed "
                           "(rendezvous closed) while %s; exiting\n",
                           g_rank, g_phase);
          ssize_t w = write(STDERR_FILENO, buf, std::min(static_cast<size_t>(m), sizeof(buf) - 1));
          (void)w;
          _exit(1);
        }
      }
    });
  }
  void stop() {
    stop_ = true;
    if (th_.joinable()) th_.join();
  }

 private:
  std::atomic<bool> stop_{true};
  std::thread th_;
};

// ---------------------------------------------------------------- one rank

struct Hello {
  uint64_t comm_id;
  int32_t pid;
  int32_t api;
  char name[32];
  char host[64];
};

struct Result {
  double us;
  uint64_t wrong;
};

template <typename T>
std::string to_blob(const T& t) {
  return std::string(reinterpret_cast<const char*>(&t), sizeof(T));
}
template <typename T>
T from_blob(const std::string& s) {
  if (s.size() < sizeof(T)) throw PerfError("rendezvous: short message from a peer");
  T t;
  memcpy(&t, s.data(), sizeof(T));
  return t;
}

void check_call(ncclResult_t r, const char* call, int ch) {
  if (r == ncclSuccess) return;
  char buf[200];
  snprintf(buf, sizeof(buf), "%s(channel %d) failed: %s (%d)", call, ch, nccl_result_name(r),
           static_cast<int>(r));
  throw PerfError(buf);
}

std::string format_time(double us) {
  char b[32];
  if (us < 1e4)
    snprintf(b, sizeof(b), "%7.2f", us);
  else if (us < 1e5)
    snprintf(b, sizeof(b), "%7.1f", us);
  else
    snprintf(b, sizeof(b), "%7.0f", us);
  return b;
}

void print_columns() {
  printf("#\n#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size", "count", "type", "redop",
         "root", "time", "algbw", "busbw", "#wrong");
  printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)", "(elements)", "", "", "",
         "(us)", "(GB/s)", "(GB/s)", "");
}

struct Buffers {
  void* mem[3] = {nullptr, nullptr, nullptr};
  ~Buffers() {
    for (void* m : mem) free(m);
  }
};

void* alloc_buf(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) throw PerfError("out of memory");
  memset(p, 0, bytes);
  return p;
}

int rank_main(const Options& o, int rank, int nranks, const RdvAddress& rdv_addr, bool serve) {
  g_rank = rank;
  g_timeout = o.timeout;
  set_log_rank(rank);
  signal(SIGALRM, on_alarm);
  alarm(static_cast<unsigned>(o.timeout));
  const bool root = rank == 0;
  int rc = 0;
  Watchdog watchdog;
  try {
    std::unique_ptr<RdvServer> server;
    if (serve) {
      server.reset(new RdvServer);
      server->listen(rdv_addr);
      server->start(nranks);
    }
    set_phase("connecting to the rendezvous %s", rdv_addr.text().c_str());
    RdvClient rdv;
    rdv.connect(rdv_addr, rank, nranks, o.timeout);
    watchdog.start(rdv.fd());

    // Load and initialise the plugin, as one NCCL communicator of nranks ranks.
    set_phase("loading the plugin");
    setenv("R2CCL_RANK", std::to_string(rank).c_str(), 1);
    Net net;
    net.load(o.plugin, o.net_api);
    Hello me{};
    if (root) {
      std::random_device rd;
      me.comm_id =
          (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    me.pid = static_cast<int32_t>(getpid());
    me.api = net.api();
    snprintf(me.name, sizeof(me.name), "%s", net.name().c_str());
    gethostname(me.host, sizeof(me.host) - 1);
    const std::string my_opts = protocol_options(o);
    std::vector<Hello> hellos;
    std::vector<std::string> hello_blobs = rdv.allgather(to_blob(me) + my_opts);
    for (int r = 0; r < nranks; r++) {
      hellos.push_back(from_blob<Hello>(hello_blobs[r]));
      std::string theirs = hello_blobs[r].substr(sizeof(Hello));
      if (theirs != my_opts)
        throw PerfError("rank " + std::to_string(r) + " runs with different options: '" + theirs +
                        "' there, '" + my_opts + "' here");
    }
    for (const Hello& h : hellos)
      if (h.api != me.api || strcmp(h.name, me.name) != 0)
        throw PerfError("ranks loaded different plugins: '" + std::string(me.name) + "' v" +
                        std::to_string(me.api) + " here, '" + h.name + "' v" +
                        std::to_string(h.api) + " elsewhere");
    const uint64_t comm_id = hellos[0].comm_id;

    set_phase("init");
    net.init_process();
    void* ctx = net.init_comm(comm_id);
    int ndev = net.devices();
    if (o.dev >= ndev)
      throw PerfError("--dev " + std::to_string(o.dev) + " but the plugin has " +
                      std::to_string(ndev) + " device(s)");
    const int C = o.channels;
    std::vector<Channel> chans(static_cast<size_t>(C));
    std::vector<DevInfo> props(static_cast<size_t>(ndev));
    std::vector<bool> have_props(static_cast<size_t>(ndev), false);
    size_t slice = o.slice;
    std::string dev_names;
    for (int c = 0; c < C; c++) {
      int d = (o.dev + c) % ndev;
      chans[c].dev = d;
      if (!have_props[d]) {
        props[d] = net.properties(d);
        have_props[d] = true;
        if (!(props[d].ptr_support & NCCL_PTR_HOST))
          throw PerfError("device " + std::to_string(d) + " (" + props[d].name +
                          ") does not support NCCL_PTR_HOST");
        if (props[d].max_recvs < 1)
          throw PerfError("device " + std::to_string(d) + " reports maxRecvs < 1");
        if (net.api() >= 9 && props[d].max_p2p_bytes == 0)
          throw PerfError("device " + std::to_string(d) + " reports maxP2pBytes 0");
        if (props[d].max_p2p_bytes) slice = std::min(slice, props[d].max_p2p_bytes);
      }
      dev_names +=
          (c ? "  " : "") + std::string("dev ") + std::to_string(d) + " [" + props[d].name + "]";
    }
    slice = std::max<size_t>(sizeof(float), slice / sizeof(float) * sizeof(float));

    // listen on every channel; exchange the handles (and agree on the slice size).
    set_phase("listen");
    std::string blob(sizeof(uint64_t) + static_cast<size_t>(C) * NCCL_NET_HANDLE_MAXSIZE, '\0');
    uint64_t slice64 = slice;
    memcpy(&blob[0], &slice64, sizeof(slice64));
    for (int c = 0; c < C; c++) {
      char* h = &blob[sizeof(uint64_t) + static_cast<size_t>(c) * NCCL_NET_HANDLE_MAXSIZE];
      check_call(net.listen(ctx, chans[c].dev, h, &chans[c].listen_comm), "listen", c);
      if (!chans[c].listen_comm) throw PerfError("listen returned a NULL listenComm");
    }
    blob += dev_names;
    std::vector<std::string> all = rdv.allgather(blob);
    std::vector<std::string> names(static_cast<size_t>(nranks));
    for (int r = 0; r < nranks; r++) {
      if (all[r].size() < blob.size() - dev_names.size())
        throw PerfError("rendezvous: ranks disagree on --channels");
      uint64_t s;
      memcpy(&s, all[r].data(), sizeof(s));
      slice = std::min<size_t>(slice, s);
      names[r] = all[r].substr(sizeof(uint64_t) + static_cast<size_t>(C) * NCCL_NET_HANDLE_MAXSIZE);
    }
    const int next = (rank + 1) % nranks;
    // connect to the next rank, accept from the previous one, both non-blocking and driven in
    // turn. The handle buffer stays the same across connect retries, as in NCCL.
    std::vector<std::vector<char>> peer(static_cast<size_t>(C));
    for (int c = 0; c < C; c++)
      peer[c].assign(
          all[next].begin() + static_cast<long>(sizeof(uint64_t) + c * NCCL_NET_HANDLE_MAXSIZE),
          all[next].begin() +
              static_cast<long>(sizeof(uint64_t) + (c + 1) * NCCL_NET_HANDLE_MAXSIZE));
    set_phase("connect/accept");
    const auto setup_start = std::chrono::steady_clock::now();
    for (int pending = 2 * C; pending > 0;) {
      bool progress = false;
      for (int c = 0; c < C; c++) {
        Channel& ch = chans[c];
        if (!ch.send_comm) {
          check_call(net.connect(ctx, ch.dev, peer[c].data(), &ch.send_comm), "connect", c);
          if (ch.send_comm) pending--, progress = true;
        }
        if (!ch.recv_comm) {
          check_call(net.accept(ch.listen_comm, &ch.recv_comm), "accept", c);
          if (ch.recv_comm) {
            pending--, progress = true;
            check_call(net.close_listen(ch.listen_comm), "closeListen", c);
            ch.listen_comm = nullptr;
          }
        }
      }
      if (!progress) usleep(100);
    }

    const double setup_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();
    if (o.idle_s > 0) {
      // The plugin's background work alone: this thread sleeps, so the process's CPU time
      // over the idle period is everything else (background threads, probes).
      set_phase("idle");
      rusage r0{}, r1{};
      getrusage(RUSAGE_SELF, &r0);
      const auto t0 = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(std::chrono::duration<double>(o.idle_s));
      getrusage(RUSAGE_SELF, &r1);
      const double wall =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      auto us = [](const timeval& t) { return t.tv_sec * 1e6 + t.tv_usec; };
      const double cpu_us = us(r1.ru_utime) - us(r0.ru_utime) + us(r1.ru_stime) - us(r0.ru_stime);
      printf(
          "# rank %d: setup of %d send + %d receive connections took %.3f s; idle %.1f s: "
          "%.1f ms CPU (user %.1f, sys %.1f) = %.2f %% of a core\n",
          rank, C, C, setup_s, wall, cpu_us / 1e3, (us(r1.ru_utime) - us(r0.ru_utime)) / 1e3,
          (us(r1.ru_stime) - us(r0.ru_stime)) / 1e3, 100.0 * cpu_us / 1e6 / wall);
      fflush(stdout);
    }

    // Buffers, registered on the comms that use them.
    set_phase("regMr");
    const bool reduce = o.op == Op::kAllReduce;
    const size_t buf_bytes = std::max<size_t>(4096, (o.max_bytes + 4095) / 4096 * 4096);
    const size_t slot_bytes = std::min(slice, std::max<size_t>(sizeof(float), o.max_bytes / 4 * 4));
    Buffers bufs;
    bufs.mem[0] = alloc_buf(buf_bytes);
    bufs.mem[1] = alloc_buf(buf_bytes);
    if (reduce) bufs.mem[2] = alloc_buf(slot_bytes * static_cast<size_t>(o.inflight) * C);
    float* sendbuf = static_cast<float*>(bufs.mem[0]);
    float* recvbuf = static_cast<float*>(bufs.mem[1]);
    for (int c = 0; c < C; c++) {
      Channel& ch = chans[c];
      check_call(net.reg_mr(ch.send_comm, sendbuf, buf_bytes, &ch.mh_send_sendbuf), "regMr", c);
      check_call(net.reg_mr(ch.send_comm, recvbuf, buf_bytes, &ch.mh_send_recvbuf), "regMr", c);
      check_call(net.reg_mr(ch.recv_comm, recvbuf, buf_bytes, &ch.mh_recv_recvbuf), "regMr", c);
      if (reduce) {
        ch.scratch =
            static_cast<char*>(bufs.mem[2]) + slot_bytes * static_cast<size_t>(o.inflight) * c;
        check_call(net.reg_mr(ch.recv_comm, ch.scratch,
                              slot_bytes * static_cast<size_t>(o.inflight), &ch.mh_recv_scratch),
                   "regMr", c);
      }
    }

    // On an error (a PerfError unwinding), close every connection before the buffers are
    // freed, as NCCL's abort closes its comms: a NIC (or the fake verbs provider's NIC thread)
    // may still be writing into them.
    struct CloseOnError {
      Net& net;
      std::vector<Channel>& chans;
      int uncaught = std::uncaught_exceptions();
      ~CloseOnError() {
        if (std::uncaught_exceptions() == uncaught) return;
        for (auto& ch : chans) {
          if (ch.send_comm) net.close_send(ch.send_comm);
          if (ch.recv_comm) net.close_recv(ch.recv_comm);
          ch.send_comm = ch.recv_comm = nullptr;
        }
      }
    } close_on_error{net, chans};

    EngineConfig ec;
    ec.rank = rank;
    ec.nranks = nranks;
    ec.inflight = o.inflight;
    ec.slice_bytes = slice;
    ec.slot_bytes = slot_bytes;
    ec.flush = o.flush;
    Engine eng(&net, ec, &chans, sendbuf, recvbuf);
    const std::vector<Geometry> sizes = sweep_sizes(o, nranks);

    if (root) {
      printf("# r2ccl_perf  op: %s  ranks: %d  channels: %d  minBytes: %zu  maxBytes: %zu  ",
             op_name(o.op), nranks, C, o.min_bytes, o.max_bytes);
      if (o.step)
        printf("step: %zu(bytes)", o.step);
      else
        printf("step: %d(factor)", o.factor);
      printf(
          "  warmup iters: %d  iters: %d  slice: %zu  inflight: %d  flush: %d  validation: %d"
          "  repeat: %d\n",
          o.warmup, o.iters, slice, o.inflight, o.flush ? 1 : 0, o.check ? 1 : 0, o.repeat);
      printf("# plugin: %s  api: v%d  name: %s\n", net.path().c_str(), net.api(),
             net.name().c_str());
      printf("#\n# Using devices\n");
      for (int r = 0; r < nranks; r++)
        printf("#  Rank %2d Pid %7d on %10s  %s\n", r, hellos[r].pid, hellos[r].host,
               names[r].c_str());
      fflush(stdout);
    }

    // The sweep.
    uint64_t wrong_total = 0;
    double busbw_sum = 0;
    int rows = 0;
    for (int pass = 1; pass <= o.repeat; pass++) {
      double pass_busbw = 0;
      int pass_rows = 0;
      if (!o.inject.empty() && pass == o.inject_pass) {
        auto* ext = static_cast<const r2cclExt_v1_t*>(net.symbol(R2CCL_EXT_SYMBOL_V1));
        const char* why = !ext              ? "the plugin exports no r2cclExt_v1"
                          : !ext->armFaults ? "the plugin's r2cclExt_v1 has no armFaults"
                          : ext->armFaults(o.inject.c_str()) != 0
                              ? "the plugin refused it (its WARN line above says why)"
                              : nullptr;
        if (why) {
          fprintf(stderr, "r2ccl_perf: rank %d: --inject '%s': %s\n", rank, o.inject.c_str(), why);
          return 1;
        }
      }
      if (root) {
        printf("#\n# pass %d/%d\n", pass, o.repeat);
        print_columns();
        fflush(stdout);
      }
      for (size_t si = 0; si < sizes.size(); si++) {
        const Geometry& g = sizes[si];
        eng.plan(o.op, g);
        set_phase("pass %d, %s of %zu bytes, warmup", pass, op_name(o.op), g.bytes);
        for (int w = 0; w < o.warmup; w++) eng.run();
        double total_us = 0;
        uint64_t wrong = 0;
        using clk = std::chrono::steady_clock;
        if (o.check) {
          for (int it = 0; it < o.iters; it++) {
            uint32_t seed =
                static_cast<uint32_t>(pass * 1000003u + si * 1009u + static_cast<uint32_t>(it) + 1);
            eng.fill(seed);
            set_phase("pass %d, %s of %zu bytes, barrier before iteration %d", pass, op_name(o.op),
                      g.bytes, it);
            rdv.barrier();
            set_phase("pass %d, %s of %zu bytes, iteration %d", pass, op_name(o.op), g.bytes, it);
            auto t0 = clk::now();
            eng.run();
            total_us += std::chrono::duration<double, std::micro>(clk::now() - t0).count();
            wrong += eng.verify(seed);
          }
        } else {
          rdv.barrier();
          set_phase("pass %d, %s of %zu bytes, timed iterations", pass, op_name(o.op), g.bytes);
          auto t0 = clk::now();
          for (int it = 0; it < o.iters; it++) eng.run();
          total_us = std::chrono::duration<double, std::micro>(clk::now() - t0).count();
        }
        set_phase("pass %d, %s of %zu bytes, gathering results", pass, op_name(o.op), g.bytes);
        Result mine{total_us / o.iters, wrong};
        double us = 0;
        uint64_t w = 0;
        for (const std::string& b : rdv.allgather(to_blob(mine))) {
          Result r = from_blob<Result>(b);
          us = std::max(us, r.us);
          w += r.wrong;
        }
        wrong_total += w;
        double algbw = us > 0 ? static_cast<double>(g.bytes) / (us * 1e3) : 0;
        double busbw = algbw * busbw_factor(o.op, nranks);
        busbw_sum += busbw;
        pass_busbw += busbw;
        rows++;
        pass_rows++;
        if (root) {
          printf("%12zu  %12zu  %8s  %6s  %6d  %7s  %6.2f  %6.2f  %6s\n", g.bytes, g.count, "float",
                 redop_name(o.op), op_root(o.op), format_time(us).c_str(), algbw, busbw,
                 o.check ? std::to_string(w).c_str() : "N/A");
          fflush(stdout);
        }
      }
      if (root && o.repeat > 1) {
        printf("# pass %d/%d avg bus bandwidth: %g\n", pass, o.repeat,
               pass_rows ? pass_busbw / pass_rows : 0.0);
        fflush(stdout);
      }
    }
    if (root) {
      if (o.check)
        printf("# Out of bounds values : %" PRIu64 " %s\n", wrong_total,
               wrong_total ? "FAILED" : "OK");
      else
        printf("# Out of bounds values : not checked (use --check)\n");
      printf("# Avg bus bandwidth    : %g\n", rows ? busbw_sum / rows : 0.0);
      printf("# wrong total: %" PRIu64 "%s\n#\n", wrong_total, o.check ? "" : " (not checked)");
      fflush(stdout);
    }
    if (wrong_total) rc = 1;

    if (o.stats) {
      set_phase("stats");
      std::vector<std::string> blobs = rdv.allgather(read_plugin_stats(net));
      StatsSummary sum = summarize_stats(blobs, root ? stdout : nullptr);
      if (sum.bad) rc = 1;
      if (o.expect_replay) {
        if (root)
          printf("# expect-replay: %" PRIu64 " replayed chunk(s) over all ranks: %s\n", sum.replays,
                 sum.replays > 0 ? "OK" : "FAILED");
        if (sum.replays == 0) rc = 1;
      }
      if (root) fflush(stdout);
    }

    set_phase("teardown");
    for (int c = 0; c < C; c++) {
      Channel& ch = chans[c];
      check_call(net.dereg_mr(ch.send_comm, ch.mh_send_sendbuf), "deregMr", c);
      check_call(net.dereg_mr(ch.send_comm, ch.mh_send_recvbuf), "deregMr", c);
      check_call(net.dereg_mr(ch.recv_comm, ch.mh_recv_recvbuf), "deregMr", c);
      if (ch.mh_recv_scratch)
        check_call(net.dereg_mr(ch.recv_comm, ch.mh_recv_scratch), "deregMr", c);
      check_call(net.close_send(ch.send_comm), "closeSend", c);
      check_call(net.close_recv(ch.recv_comm), "closeRecv", c);
    }
    net.finalize_comm(ctx);

    // Leave together: nobody's exit may look like a failure to the others.
    set_phase("final barrier");
    watchdog.stop();
    rdv.barrier();
    rdv.close();
    // The rank that hosts the rendezvous stays until every rank has its last answer.
    if (server && !server->wait(10))
      fprintf(stderr, "r2ccl_perf: rank %d: the rendezvous did not finish within 10 s\n", rank);
  } catch (const PerfError& e) {
    watchdog.stop();
    fflush(stdout);
    fprintf(stderr, "r2ccl_perf: rank %d: %s\n", rank, e.what());
    return 1;
  }
  alarm(0);
  return rc;
}

// ---------------------------------------------------------------- process management

int run_local(const Options& o) {
  RdvServer server;
  server.listen("127.0.0.1", 0);
  const int n = o.ranks;
  fflush(stdout);
  fflush(stderr);
  std::vector<pid_t> pids(static_cast<size_t>(n), -1);
  for (int r = 0; r < n; r++) {
    pid_t pid = fork();
    if (pid < 0) {
      perror("r2ccl_perf: fork");
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      server.close_listen();
      RdvAddress local;
      local.kind = RdvAddress::Kind::kIPv4;
      local.host = "127.0.0.1";
      local.port = server.port();
      int rc = rank_main(o, r, n, local, false);
      fflush(stdout);
      fflush(stderr);
      _exit(rc);
    }
    pids[r] = pid;
  }
  server.start(n);

  using clk = std::chrono::steady_clock;
  const auto deadline = clk::now() + std::chrono::seconds(o.timeout + 5);
  const auto grace = std::chrono::seconds(15);
  clk::time_point first_failure{};
  bool failed = false, killed = false;
  int rc = 0, left = n;
  while (left > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) continue;
      int r = static_cast<int>(it - pids.begin());
      *it = -1;
      left--;
      bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok) {
        rc = 1;
        if (WIFEXITED(status))
          fprintf(stderr, "r2ccl_perf: rank %d exited with status %d\n", r, WEXITSTATUS(status));
        else if (WIFSIGNALED(status))
          fprintf(stderr, "r2ccl_perf: rank %d was killed by signal %d (%s)\n", r, WTERMSIG(status),
                  strsignal(WTERMSIG(status)));
        if (!failed) first_failure = clk::now();
        failed = true;
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;
    usleep(20000);
    bool timeout = clk::now() > deadline;
    bool stuck = failed && clk::now() > first_failure + grace;
    if ((timeout || stuck) && !killed) {
      if (timeout)
        fprintf(stderr, "r2ccl_perf: timeout: the run took longer than %d s; killing the ranks\n",
                o.timeout);
      else
        fprintf(stderr,
                "r2ccl_perf: a rank failed and others are still running %d s later; "
                "killing them\n",
                static_cast<int>(grace.count()));
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
      killed = true;
      rc = 1;
    }
  }
  return rc;
}

int main_impl(int argc, char** argv) {
  Options o = parse_args(argc, argv);
  if (o.params) {
    fputs(r2ccl::format_param_table(o.markdown).c_str(), stdout);
    return 0;
  }
  try {
    if (o.rendezvous.empty()) return run_local(o);
    return rank_main(o, o.rank, o.nranks, o.rdv, o.rank == 0);
  } catch (const PerfError& e) {
    fprintf(stderr, "r2ccl_perf: %s\n", e.what());
    return 1;
  }
}

}  // namespace
}  // namespace r2perf

int main(int argc, char** argv) { return r2perf::main_impl(argc, argv); }
