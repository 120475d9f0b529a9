// Test harness: loads an NCCL net plugin exactly as NCCL does (dlopen RTLD_NOW|RTLD_LOCAL,
// dlsym of ncclNetPlugin_v11) and runs the two ends of one connection in two forked
// processes, so each test case gets fresh processes with its own environment (the plugin
// parses its R2CCL_* variables once per process).
//
// Typical use inside a Catch2 TEST_CASE:
//   PairOptions o; o.env = {{"R2CCL_SOCKET_IFNAME", "lo@127.0.0.1,lo@127.0.0.2"}};
//   PairResult r = run_pair(o,
//       [](Endpoint& s) { ... return 0; },   // sender process: exit code
//       [](Endpoint& r) { ... return 0; });  // receiver process
//   REQUIRE(r.sender_status == 0); REQUIRE(r.receiver_status == 0);
// Endpoint functions print what went wrong to stderr and return non-zero; they must not use
// Catch assertions (they run in child processes).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "r2ccl/nccl_abi.h"

namespace r2ccl::test {

struct Plugin {
  void* dl = nullptr;
  const ncclNet_v11_t* net = nullptr;
};
// Loads the .so at `path` (default: $R2CCL_TEST_PLUGIN). Returns false with *err.
bool load_plugin(Plugin* p, std::string* err, const char* path = nullptr);

struct Endpoint {
  Plugin plugin;
  void* ctx = nullptr;
  void* comm = nullptr;  // send comm (sender) or recv comm (receiver)
  int dev = 0;
  int peer_pid = 0;
  // Posts one isend/irecv (retrying NULL requests) and waits for it. Returns the first
  // non-success result, or ncclSuccess; *size gets the reported size. timeout in ms.
  ncclResult_t send(void* buf, size_t size, int timeout_ms, int* size_out = nullptr);
  ncclResult_t recv(void* buf, size_t size, int timeout_ms, int* size_out = nullptr);
  // Non-blocking building blocks. A failed regMr fails the post with its result, as it
  // fails NCCL's operation (the plugin never gets a buffer without its registration).
  ncclResult_t post_send(void* buf, size_t size, void** req, int timeout_ms);
  ncclResult_t post_recv(void* buf, size_t size, void** req, int timeout_ms);
  ncclResult_t wait(void* req, int timeout_ms, int* size_out = nullptr);
  // The registration of [buf, buf + size) (made at first use, kept until the endpoint
  // closes); nullptr when regMr failed, with its result in reg_error.
  void* mhandle_for(void* buf, size_t size);
  ncclResult_t reg_error = ncclSuccess;
  // The buffer type mhandle_for registers with (NCCL_PTR_CUDA: a GPU buffer as NCCL would
  // register it; host memory stands in where the plugin accepts that, e.g. the verbs
  // transport with R2CCL_TEST_HOOKS=gpu_pci=PATH).
  int mr_type = NCCL_PTR_HOST;
  struct Registration {
    void* buf;
    size_t size;
    void* mh;
  };
  std::vector<Registration> mrs;
  // Every connection of the pair, in PairOptions::devs order (one entry, on `dev`, when devs
  // is empty). conns[0] has the same comm and dev as this Endpoint; each entry keeps its own
  // registrations, so use one or the other for a given buffer.
  std::vector<Endpoint> conns;
  // A channel to the other process of run_pair, for cases that run their own listen, connect
  // and accept (PairOptions::skip_connect): records of kNoteBytes, delivered in order. A
  // handle fits one record; so does a short text (note_text). hear: false when nothing came
  // within timeout_ms (0: do not wait) or the other process exited.
  static constexpr size_t kNoteBytes = NCCL_NET_HANDLE_MAXSIZE;
  bool say(const void* record);
  bool say_text(const char* text);
  bool hear(void* record, int timeout_ms);
  int to_peer = -1;    // write end (set by run_pair)
  int from_peer = -1;  // read end
};

// Waits for every request in `reqs` (skipping NULL entries), testing them round-robin so no
// request is tested again once it reported done. sizes_out (optional) gets each reported
// size. Returns the first non-success result, or ncclInProgress when timeout_ms passed.
ncclResult_t wait_all(Endpoint& ep, std::vector<void*>& reqs, int timeout_ms,
                      std::vector<int>* sizes_out = nullptr);

// connect() until it returns a comm or an error, or `limit_s` passes (then ncclInProgress);
// *secs: how long it took. For cases that connect themselves (PairOptions::skip_connect).
ncclResult_t connect_until(Endpoint& ep, int dev, void* handle, double limit_s, void** comm,
                           double* secs);
// accept() the same way; *slowest (optional): the longest single accept() call (accept never
// blocks).
ncclResult_t accept_until(Endpoint& ep, void* listen, double limit_s, void** comm, double* secs,
                          double* slowest = nullptr);

struct PairOptions {
  std::map<std::string, std::string> env;           // both processes
  std::map<std::string, std::string> sender_env;    // sender only
  std::map<std::string, std::string> receiver_env;  // receiver only
  int dev = 0;
  // Network namespaces (names under /var/run/netns) the two processes enter before loading
  // the plugin; empty: stay in the current one. Used by the rail-lab tests.
  std::string sender_netns;
  std::string receiver_netns;
  // When set, the process's stderr (the plugin's WARN/INFO lines) goes to this file.
  std::string sender_stderr;
  std::string receiver_stderr;
  int connect_timeout_ms = 20000;
  int timeout_s = 300;  // both children are killed after this long
  // Runs in the receiver process after connect (or instead of it when skip_connect). With
  // skip_connect neither process listens or connects: the functions do it themselves and
  // exchange handles over Endpoint::say/hear.
  bool skip_connect = false;
  // When true, a process whose function returned waits (at most timeout_s) until the other
  // one's function returned too, before it exits: a peer that exits early closes its sockets,
  // which the other side would see (and log) as a rail failure. A process whose function
  // failed does not wait; a peer that exits (fails, dies) ends the wait at once.
  bool finish_together = false;
  // Connections to open between the two processes, one per entry, on that device (the same
  // device index on both sides). Empty: one connection on `dev`. See Endpoint::conns.
  std::vector<int> devs;
};

struct PairResult {
  int sender_status = -1;  // exit code, or 128+signal
  int receiver_status = -1;
  double seconds = 0;
};

using EndpointFn = std::function<int(Endpoint&)>;
PairResult run_pair(const PairOptions& o, const EndpointFn& sender, const EndpointFn& receiver);

// Several processes, each a rank with its own environment, connected as `links` says: one
// connection per (sender rank, receiver rank) entry, on device `dev`, set up before `fn` runs
// (handles go through pipes; connects and accepts are interleaved, never blocking). Each
// process runs fn(member); its exit code is fn's result. Whatever is still open when fn
// returns 0 is closed, as NCCL would (BYE). For cases a pair cannot show (a third process
// dies while the other two keep working).
struct GroupOptions {
  int nranks = 3;
  std::map<std::string, std::string> env;                    // every rank
  std::vector<std::map<std::string, std::string>> rank_env;  // per rank (may be shorter)
  std::vector<std::pair<int, int>> links;                    // (sender rank, receiver rank)
  int dev = 0;
  std::vector<std::string> stderr_files;  // per rank, optional ("" keeps the test's stderr)
  int connect_timeout_ms = 20000;
  int timeout_s = 120;  // every rank is killed after this long
};
struct GroupMember {
  int rank = 0;
  std::map<int, Endpoint> send_to;    // peer rank -> send comm to it
  std::map<int, Endpoint> recv_from;  // peer rank -> recv comm from it
  Plugin plugin;
  void* ctx = nullptr;
};
struct GroupResult {
  std::vector<int> status;  // per rank: exit code, or 128+signal
  double seconds = 0;
};
using GroupFn = std::function<int(GroupMember&)>;
GroupResult run_group(const GroupOptions& o, const GroupFn& fn);

// One process (the hub) holding send comms to `peers` other processes, each holding the
// receive comms of its connections: one rank talking to several, each process forked from
// here with the plugin loaded and initialised as in run_pair. Connection k of peer p is
// hub.conns[p * conns_per_peer + k] (its peer_pid is that peer's pid) and ep.conns[k] in
// peer p (ep.comm is conns[0]; peer_pid 0). Each peer listens on every one of its
// connections first (one listen comm each, closed once accepted) and accepts them
// round-robin while the hub connects. Bodies run on each child's main thread, as in run_pair:
// print what went wrong to stderr, return non-zero; no Catch. After every body returned, the
// processes wait for each other (a body that failed does not wait; a process that exits ends
// the others' wait), then each closes the comms still open. Harness exit codes: 88 the
// descriptor limit, 89 the namespace, 90 dlopen, 91 init, 92 listen, 93 handle exchange, 94
// a failed connect or accept, 95 connections still missing after connect_timeout_ms, 97
// sockets left after close.
struct HubOptions {
  std::map<std::string, std::string> env;  // every process
  int peers = 4;
  int conns_per_peer = 1;
  // The device of connection k of every peer: devs[k % devs.size()] (same index both sides);
  // empty: device 0.
  std::vector<int> devs;
  // A network namespace (name under /var/run/netns) every process enters before loading the
  // plugin; empty: stay in the current one.
  std::string netns;
  // RLIMIT_NOFILE soft limit each process sets before loading the plugin (raising the hard
  // limit too where it is lower, which needs CAP_SYS_RESOURCE); 0: unchanged.
  long nofile = 0;
  // At most this many of the hub's connects in progress at once (started, no comm yet); 0: all
  // at once. Each connection opens several sockets to a peer's one listener per rail, whose
  // backlog (256) may otherwise overflow into SYN retransmissions (a second or more each).
  int connect_window = 0;
  int connect_timeout_ms = 120000;  // every connect and accept, in all
  int timeout_s = 300;              // every process is killed after this long
  // After closing, each process waits (at most 30 s) until it holds no TCP socket but the
  // plugin's listeners (count_tcp_connections() == 0), and exits 97 listing the sockets left
  // otherwise: a descriptor leak at close.
  bool check_sockets_released = false;
};

struct HubResult {
  int hub_status = -1;           // exit code, or 128+signal
  std::vector<int> peer_status;  // by peer
  double seconds = 0;
};

using PeerFn = std::function<int(Endpoint&, int peer)>;
HubResult run_hub(const HubOptions& o, const EndpointFn& hub, const PeerFn& peer);

// Sets this process's RLIMIT_NOFILE soft limit to n, raising the hard limit too where it is
// lower (that needs CAP_SYS_RESOURCE). False with *err naming both limits and the errno text.
bool raise_nofile(long n, std::string* err);

// The socket descriptors this process holds (/proc/self/fd entries that are sockets), each
// described from the kernel's tables (/proc/net/tcp, tcp6, unix, netlink of the current
// network namespace).
struct SocketFd {
  int fd = -1;
  std::string kind;       // "tcp", "unix", "netlink" or "other"
  std::string tcp_state;  // "LISTEN", "ESTABLISHED", ... (tcp only)
  std::string text;       // "fd 7: tcp 127.0.0.1:40001 -> 127.0.0.2:40007 ESTABLISHED"
};
std::vector<SocketFd> socket_fds();
int count_socket_fds();  // socket_fds().size()
// TCP sockets of this process that are not listeners: connections, open or closing.
int count_tcp_connections();

// A network namespace of the calling test's own, /var/run/netns/r2ccl-TAG-PID, with lo up;
// deleted by the destructor (so also when a REQUIRE fails). Needs root: ok() is false, with
// error(), where it cannot be made. Settings made inside (sysctls of the namespace, such as
// net.ipv4.ip_local_port_range) leave the host's untouched.
class TempNetns {
 public:
  explicit TempNetns(const std::string& tag);
  ~TempNetns();
  TempNetns(const TempNetns&) = delete;
  TempNetns& operator=(const TempNetns&) = delete;
  bool ok() const { return ok_; }
  const std::string& name() const { return name_; }
  const std::string& error() const { return error_; }
  // Runs the shell command `cmd` inside the namespace; returns its exit status (output, with
  // stderr, in *out).
  int exec(const std::string& cmd, std::string* out = nullptr) const;

 private:
  std::string name_, error_;
  bool ok_ = false;
};

// Runs `fn` in one forked child (fresh process: set env, then fn, exit code = fn's result)
// with its stdout and stderr captured, killed after timeout_s. For tests that load the plugin
// themselves (init failures, properties, symbols) and must assert on what it printed.
struct ChildResult {
  int status = -1;     // exit code, or 128+signal
  std::string output;  // stdout and stderr, interleaved
  double seconds = 0;
};
ChildResult run_child(const std::map<std::string, std::string>& env, const std::function<int()>& fn,
                      int timeout_s = 120);

// Fills `n` bytes with a pattern derived from `seed`; check_pattern returns the first bad
// offset or -1.
void fill_pattern(void* buf, size_t n, uint64_t seed);
long long check_pattern(const void* buf, size_t n, uint64_t seed);

// Temporary file path unique to this process and tag (under $TMPDIR or /tmp). Nothing is
// there when it returns: what an earlier process with the same pid left is removed. Any
// thread.
std::string temp_path(const std::string& tag);
std::string read_file(const std::string& path);
int count_lines_containing(const std::string& text, const std::string& needle);

// CLOCK_MONOTONIC in microseconds (the clock of the plugin's and railab.sh's timestamps).
long long mono_us();
// Timestamps ("[SEC.USEC]" at the start of a line) of every line containing `needle`.
std::vector<double> stamps_of(const std::string& text, const std::string& needle);

// The defined dynamic symbols of a shared library (nm -D --defined-only): name -> nm's type
// letter ('?' when nm printed none). Empty on failure (nm missing, not an ELF file).
std::map<std::string, char> dynamic_symbols(const std::string& so);
// True for nm type letters of data objects (initialised, read-only, bss, unique), not code.
inline bool is_data_symbol(char t) { return std::string("DdRrBbVv").find(t) != std::string::npos; }

// Runs a shell command, returns its exit status and (optionally) its output.
int run_command(const std::string& cmd, std::string* output = nullptr);
// Single-quotes `s` for /bin/sh.
std::string shell_quote(const std::string& s);

// r2ccl_perf ($R2CCL_TEST_PERF) with the plugin under test ($R2CCL_TEST_PLUGIN), `env` set
// for it (and so for every rank), a bounded run (--timeout) and `args` appended verbatim.
std::string perf_command(const std::map<std::string, std::string>& env, const std::string& args,
                         int timeout_s = 120);
// The data rows of r2ccl_perf's tables (every pass): size in bytes and the #wrong column.
struct PerfRow {
  long long size = 0;
  std::string wrong;
};
std::vector<PerfRow> perf_rows(const std::string& output);
// r2ccl_perf ranks started by hand, as on several hosts: nranks processes of perf_command(env,
// "--rendezvous RDV --rank R --nranks N " + args, timeout_s), all at once on this host.
// status[r] is rank r's exit status (-1: unknown), output[r] its stdout and stderr.
struct PerfRanksResult {
  std::vector<int> status;
  std::vector<std::string> output;
};
PerfRanksResult run_perf_ranks(const std::map<std::string, std::string>& env,
                               const std::string& rendezvous, int nranks, const std::string& args,
                               int timeout_s = 120);
// A TCP port that was free on the loopback address of `family` (AF_INET: 127.0.0.1, AF_INET6:
// ::1) a moment ago: bound with port 0, read back, closed. 0 with *err (the socket or bind
// errno text) where that loopback cannot be used, e.g. IPv6 disabled.
int free_loopback_port(int family, std::string* err);
std::string env_or(const char* name, const char* fallback);

}  // namespace r2ccl::test
