#include "net_harness.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace r2ccl::test {
namespace {

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

void child_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  if (level > NCCL_LOG_WARN && !getenv("R2CCL_TEST_VERBOSE")) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "[pid %d] %s\n", getpid(), msg);
}

bool write_all(int fd, const void* p, size_t n) {
  auto* b = static_cast<const char*>(p);
  while (n) {
    ssize_t w = ::write(fd, b, n);
    if (w <= 0) return false;
    b += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n) {
  auto* b = static_cast<char*>(p);
  while (n) {
    ssize_t r = ::read(fd, b, n);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

int status_code(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return -1;
}

}  // namespace

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'')
      q += "'\\''";
    else
      q += c;
  }
  return q + "'";
}

std::string perf_command(const std::map<std::string, std::string>& env, const std::string& args,
                         int timeout_s) {
  std::string cmd = "env";
  for (const auto& kv : env) cmd += " " + shell_quote(kv.first + "=" + kv.second);
  cmd += " " + shell_quote(env_or("R2CCL_TEST_PERF", "r2ccl_perf"));
  cmd += " --plugin " + shell_quote(env_or("R2CCL_TEST_PLUGIN", "r2ccl"));
  cmd += " --timeout " + std::to_string(timeout_s) + " " + args;
  return cmd;
}

std::vector<PerfRow> perf_rows(const std::string& output) {
  std::vector<PerfRow> rows;
  std::istringstream in(output);
  std::string line;
  bool in_table = false;
  while (std::getline(in, line)) {
    if (line.find("#wrong") != std::string::npos) {
      in_table = true;
      continue;
    }
    if (!in_table || line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::vector<std::string> tok;
    std::string t;
    while (ls >> t) tok.push_back(t);
    // size count type redop root time algbw busbw #wrong
    if (tok.size() != 9 || tok[0].find_first_not_of("0123456789") != std::string::npos) continue;
    PerfRow r;
    r.size = std::stoll(tok[0]);
    r.wrong = tok.back();
    rows.push_back(r);
  }
  return rows;
}

PerfRanksResult run_perf_ranks(const std::map<std::string, std::string>& env,
                               const std::string& rendezvous, int nranks, const std::string& args,
                               int timeout_s) {
  PerfRanksResult res;
  res.status.assign(static_cast<size_t>(nranks), -1);
  res.output.resize(static_cast<size_t>(nranks));
  // One shell: every rank in the background, its output and then its exit status in files of
  // its own; `wait` returns once every rank has exited (each is bounded by --timeout).
  std::vector<std::string> outs, rcs;
  std::string script;
  for (int r = 0; r < nranks; ++r) {
    outs.push_back(temp_path("perf-rank" + std::to_string(r) + ".out"));
    rcs.push_back(temp_path("perf-rank" + std::to_string(r) + ".rc"));
    const std::string cmd =
        perf_command(env,
                     "--rendezvous " + shell_quote(rendezvous) + " --rank " + std::to_string(r) +
                         " --nranks " + std::to_string(nranks) + " " + args,
                     timeout_s);
    script += "{ " + cmd + " > " + shell_quote(outs.back()) + " 2>&1; echo $? > " +
              shell_quote(rcs.back()) + "; } & ";
  }
  script += "wait";
  run_command(script);
  for (int r = 0; r < nranks; ++r) {
    res.output[r] = read_file(outs[r]);
    const std::string rc = read_file(rcs[r]);
    if (!rc.empty()) res.status[r] = atoi(rc.c_str());
    unlink(outs[r].c_str());
    unlink(rcs[r].c_str());
  }
  return res;
}

int free_loopback_port(int family, std::string* err) {
  int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = std::string("socket: ") + strerror(errno);
    return 0;
  }
  sockaddr_storage ss{};
  socklen_t len;
  if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_loopback;
    len = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    len = sizeof(*a);
  }
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    *err = std::string("bind: ") + strerror(errno);
  } else {
    len = sizeof(ss);
    getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
    port = ntohs(family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                    : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  }
  close(fd);
  return port;
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = getenv(name);
  return v && *v ? v : fallback;
}

bool load_plugin(Plugin* p, std::string* err, const char* path) {
#ifdef R2CCL_BINARY_DIR
  const char* fallback = R2CCL_BINARY_DIR "/lib/libnccl-net-r2ccl.so";
#else
  const char* fallback = "libnccl-net-r2ccl.so";
#endif
  std::string so = path ? path : env_or("R2CCL_TEST_PLUGIN", fallback);
  p->dl = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!p->dl) {
    *err = std::string("dlopen ") + so + ": " + dlerror();
    return false;
  }
  p->net = static_cast<const ncclNet_v11_t*>(dlsym(p->dl, "ncclNetPlugin_v11"));
  if (!p->net) {
    *err = "no ncclNetPlugin_v11 in " + so;
    return false;
  }
  return true;
}

void* Endpoint::mhandle_for(void* buf, size_t size) {
  // A registration covers what it was made for: a buffer reused for more bytes (a test's one
  // big buffer, messages of growing sizes) is registered again, as NCCL registers each
  // buffer whole. Earlier registrations stay until the endpoint closes (requests may use them).
  for (auto& m : mrs)
    if (m.buf == buf && m.size >= size) return m.mh;
  void* mh = nullptr;
  const ncclResult_t r = plugin.net->regMr(comm, buf, size, mr_type, &mh);
  if (r != ncclSuccess || !mh) {
    reg_error = r != ncclSuccess ? r : ncclInternalError;
    return nullptr;
  }
  mrs.push_back({buf, size, mh});
  return mh;
}

ncclResult_t Endpoint::post_send(void* buf, size_t size, void** req, int timeout_ms) {
  *req = nullptr;
  void* mh = mhandle_for(buf, size ? size : 1);
  if (!mh) return reg_error;
  double end = now_s() + timeout_ms / 1e3;
  while (!*req) {
    ncclResult_t r = plugin.net->isend(comm, buf, size, 0, mh, nullptr, req);
    if (r != ncclSuccess) return r;
    if (!*req && now_s() > end) return ncclInProgress;  // timed out
  }
  return ncclSuccess;
}

ncclResult_t Endpoint::post_recv(void* buf, size_t size, void** req, int timeout_ms) {
  *req = nullptr;
  void* mh = mhandle_for(buf, size ? size : 1);
  if (!mh) return reg_error;
  double end = now_s() + timeout_ms / 1e3;
  int tag = 0;
  while (!*req) {
    ncclResult_t r = plugin.net->irecv(comm, 1, &buf, &size, &tag, &mh, nullptr, req);
    if (r != ncclSuccess) return r;
    if (!*req && now_s() > end) return ncclInProgress;
  }
  return ncclSuccess;
}

ncclResult_t Endpoint::wait(void* req, int timeout_ms, int* size_out) {
  double end = now_s() + timeout_ms / 1e3;
  for (;;) {
    int done = 0, size = 0;
    ncclResult_t r = plugin.net->test(req, &done, &size);
    if (r != ncclSuccess) return r;
    if (done) {
      if (size_out) *size_out = size;
      return ncclSuccess;
    }
    if (now_s() > end) return ncclInProgress;
  }
}

ncclResult_t wait_all(Endpoint& ep, std::vector<void*>& reqs, int timeout_ms,
                      std::vector<int>* sizes_out) {
  if (sizes_out) sizes_out->assign(reqs.size(), -1);
  std::vector<char> pending(reqs.size(), 0);
  size_t left = 0;
  for (size_t i = 0; i < reqs.size(); ++i)
    if (reqs[i]) {
      pending[i] = 1;
      ++left;
    }
  double end = now_s() + timeout_ms / 1e3;
  while (left) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (!pending[i]) continue;
      int done = 0, size = 0;
      ncclResult_t r = ep.plugin.net->test(reqs[i], &done, &size);
      if (r != ncclSuccess) return r;
      if (done) {
        pending[i] = 0;
        --left;
        if (sizes_out) (*sizes_out)[i] = size;
      }
    }
    if (left && now_s() > end) return ncclInProgress;
  }
  return ncclSuccess;
}

bool Endpoint::say(const void* record) { return write_all(to_peer, record, kNoteBytes); }

bool Endpoint::say_text(const char* text) {
  char rec[kNoteBytes] = {};
  snprintf(rec, sizeof(rec), "%s", text);
  return say(rec);
}

bool Endpoint::hear(void* record, int timeout_ms) {
  pollfd p{from_peer, POLLIN, 0};
  const double end = now_s() + timeout_ms / 1e3;
  for (;;) {
    const int left = static_cast<int>((end - now_s()) * 1e3);
    const int r = ::poll(&p, 1, left > 0 ? left : 0);
    if (r > 0) return read_all(from_peer, record, kNoteBytes);
    if (r < 0 && errno != EINTR) return false;
    if (r == 0 && now_s() >= end) return false;
  }
}

ncclResult_t Endpoint::send(void* buf, size_t size, int timeout_ms, int* size_out) {
  void* req = nullptr;
  ncclResult_t r = post_send(buf, size, &req, timeout_ms);
  if (r != ncclSuccess) return r;
  return wait(req, timeout_ms, size_out);
}

ncclResult_t Endpoint::recv(void* buf, size_t size, int timeout_ms, int* size_out) {
  void* req = nullptr;
  ncclResult_t r = post_recv(buf, size, &req, timeout_ms);
  if (r != ncclSuccess) return r;
  return wait(req, timeout_ms, size_out);
}

ncclResult_t connect_until(Endpoint& ep, int dev, void* handle, double limit_s, void** comm,
                           double* secs) {
  *comm = nullptr;
  const double t0 = now_s();
  ncclResult_t r = ncclSuccess;
  while (!*comm) {
    r = ep.plugin.net->connect(ep.ctx, dev, handle, comm, nullptr);
    if (r != ncclSuccess) break;
    if (!*comm && now_s() - t0 > limit_s) {
      r = ncclInProgress;
      break;
    }
    if (!*comm) usleep(200);
  }
  *secs = now_s() - t0;
  return r;
}

ncclResult_t accept_until(Endpoint& ep, void* listen, double limit_s, void** comm, double* secs,
                          double* slowest) {
  *comm = nullptr;
  const double t0 = now_s();
  ncclResult_t r = ncclSuccess;
  if (slowest) *slowest = 0;
  while (!*comm) {
    const double c0 = now_s();
    r = ep.plugin.net->accept(listen, comm, nullptr);
    if (slowest && now_s() - c0 > *slowest) *slowest = now_s() - c0;
    if (r != ncclSuccess) break;
    if (!*comm && now_s() - t0 > limit_s) {
      r = ncclInProgress;
      break;
    }
    if (!*comm) usleep(200);
  }
  *secs = now_s() - t0;
  return r;
}

static bool enter_netns(const std::string& name) {
  if (name.empty()) return true;
  std::string path = "/var/run/netns/" + name;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
    fprintf(stderr, "cannot enter network namespace %s: %s\n", name.c_str(), strerror(errno));
    if (fd >= 0) close(fd);
    return false;
  }
  close(fd);
  return true;
}

// Tells the peer "done" on done_out, then waits for the peer's "done" on done_in (EOF, a
// dead peer, counts as done too) for at most timeout_s.
static void finish_barrier(int done_out, int done_in, int timeout_s) {
  char b = 1;
  if (::write(done_out, &b, 1) != 1) return;
  pollfd p{done_in, POLLIN, 0};
  double end = now_s() + timeout_s;
  while (now_s() < end) {
    int r = ::poll(&p, 1, 100);
    if (r > 0) return;
    if (r < 0 && errno != EINTR) return;
  }
}

static int child_main(const PairOptions& o, bool is_sender, int handle_fd, int peer_pid,
                      const EndpointFn& fn, int done_out, int done_in, int note_fd) {
  if (!enter_netns(is_sender ? o.sender_netns : o.receiver_netns)) return 89;
  const std::string& errfile = is_sender ? o.sender_stderr : o.receiver_stderr;
  if (!errfile.empty() && !freopen(errfile.c_str(), "w", stderr)) return 88;
  if (!errfile.empty()) setvbuf(stderr, nullptr, _IOLBF, 0);
  for (const auto& kv : o.env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  for (const auto& kv : (is_sender ? o.sender_env : o.receiver_env))
    setenv(kv.first.c_str(), kv.second.c_str(), 1);
  Endpoint ep;
  ep.dev = o.dev;
  ep.peer_pid = peer_pid;
  // Receiver -> sender records go through the handle pipe, sender -> receiver through note_fd.
  ep.to_peer = is_sender ? note_fd : handle_fd;
  ep.from_peer = is_sender ? handle_fd : note_fd;
  std::string err;
  if (!load_plugin(&ep.plugin, &err)) {
    fprintf(stderr, "%s\n", err.c_str());
    return 90;
  }
  ncclNetCommConfig_v11_t cfg{-1};
  ncclResult_t r = ep.plugin.net->init(&ep.ctx, 0x1234, &cfg, child_logger, nullptr);
  if (r != ncclSuccess) {
    fprintf(stderr, "init failed: %d\n", r);
    return 91;
  }
  if (!o.skip_connect) {
    const std::vector<int> devs = o.devs.empty() ? std::vector<int>{o.dev} : o.devs;
    const size_t n = devs.size();
    // One handle buffer per connection: connect() keeps its state in the handle it is given.
    std::vector<std::vector<char>> handles(n, std::vector<char>(NCCL_NET_HANDLE_MAXSIZE, 0));
    std::vector<void*> comms(n, nullptr);
    double end = now_s() + o.connect_timeout_ms / 1e3;
    if (!is_sender) {
      std::vector<void*> listens(n, nullptr);
      for (size_t i = 0; i < n; ++i) {
        if (ep.plugin.net->listen(ep.ctx, devs[i], handles[i].data(), &listens[i]) != ncclSuccess) {
          fprintf(stderr, "listen on device %d (connection %zu) failed\n", devs[i], i);
          return 92;
        }
      }
      for (size_t i = 0; i < n; ++i)
        if (!write_all(handle_fd, handles[i].data(), NCCL_NET_HANDLE_MAXSIZE)) return 93;
      // Accept every connection, round-robin (accept never blocks).
      for (size_t done = 0; done < n;) {
        for (size_t i = 0; i < n; ++i) {
          if (comms[i]) continue;
          if (ep.plugin.net->accept(listens[i], &comms[i], nullptr) != ncclSuccess) {
            fprintf(stderr, "accept of connection %zu failed\n", i);
            return 94;
          }
          if (comms[i]) {
            ++done;
            ep.plugin.net->closeListen(listens[i]);
          }
        }
        if (done < n && now_s() > end) {
          fprintf(stderr, "accept: %zu of %zu connections after %d ms\n", done, n,
                  o.connect_timeout_ms);
          return 95;
        }
      }
    } else {
      for (size_t i = 0; i < n; ++i)
        if (!read_all(handle_fd, handles[i].data(), NCCL_NET_HANDLE_MAXSIZE)) return 93;
      for (size_t done = 0; done < n;) {
        for (size_t i = 0; i < n; ++i) {
          if (comms[i]) continue;
          if (ep.plugin.net->connect(ep.ctx, devs[i], handles[i].data(), &comms[i], nullptr) !=
              ncclSuccess) {
            fprintf(stderr, "connect of connection %zu (device %d) failed\n", i, devs[i]);
            return 94;
          }
          if (comms[i]) ++done;
        }
        if (done < n && now_s() > end) {
          fprintf(stderr, "connect: %zu of %zu connections after %d ms\n", done, n,
                  o.connect_timeout_ms);
          return 95;
        }
      }
    }
    ep.comm = comms[0];
    ep.dev = devs[0];
    for (size_t i = 0; i < n; ++i) {
      Endpoint c;
      c.plugin = ep.plugin;
      c.ctx = ep.ctx;
      c.comm = comms[i];
      c.dev = devs[i];
      c.peer_pid = ep.peer_pid;
      ep.conns.push_back(std::move(c));
    }
  }
  int rc = fn(ep);
  fflush(stdout);
  fflush(stderr);
  if (o.finish_together && rc == 0) finish_barrier(done_out, done_in, o.timeout_s);
  // Close what is still open, as NCCL does when a communicator is destroyed: the plugin tells
  // the peer (BYE), so the peer does not log our exit as a rail failure.
  // conns[0] is the same connection as ep.comm (a body that closes it itself sets ep.comm to
  // nullptr); the others are only in conns.
  if (rc == 0) {
    auto close_fn = is_sender ? ep.plugin.net->closeSend : ep.plugin.net->closeRecv;
    if (ep.comm) close_fn(ep.comm);
    for (size_t i = 1; i < ep.conns.size(); ++i)
      if (ep.conns[i].comm) close_fn(ep.conns[i].comm);
  }
  return rc;
}

PairResult run_pair(const PairOptions& o, const EndpointFn& sender, const EndpointFn& receiver) {
  PairResult res;
  int fds[2];
  if (pipe(fds) != 0) return res;
  int notes[2];  // sender -> receiver (Endpoint::say/hear)
  if (pipe(notes) != 0) {
    close(fds[0]);
    close(fds[1]);
    return res;
  }
  // finish_together: one pipe per direction, each child writes "done" into its own and
  // polls the other's.
  int s2r[2] = {-1, -1}, r2s[2] = {-1, -1};
  if (o.finish_together && (pipe(s2r) != 0 || pipe(r2s) != 0)) {
    close(fds[0]);
    close(fds[1]);
    return res;
  }
  fflush(stdout);  // or the children flush the parent's buffered output a second time
  fflush(stderr);
  double t0 = now_s();
  pid_t rpid = fork();
  if (rpid == 0) {
    close(fds[0]);
    close(notes[1]);
    if (o.finish_together) {
      close(r2s[0]);
      close(s2r[1]);
    }
    _exit(child_main(o, false, fds[1], 0, receiver, r2s[1], s2r[0], notes[0]));
  }
  pid_t spid = fork();
  if (spid == 0) {
    close(fds[1]);
    close(notes[0]);
    if (o.finish_together) {
      close(s2r[0]);
      close(r2s[1]);
    }
    _exit(child_main(o, true, fds[0], rpid, sender, s2r[1], r2s[0], notes[1]));
  }
  close(fds[0]);
  close(fds[1]);
  close(notes[0]);
  close(notes[1]);
  for (int fd : {s2r[0], s2r[1], r2s[0], r2s[1]})
    if (fd >= 0) close(fd);
  int sst = -1, rst = -1;
  bool s_done = false, r_done = false;
  while (!(s_done && r_done)) {
    int st;
    if (!s_done && waitpid(spid, &st, WNOHANG) == spid) {
      s_done = true;
      sst = status_code(st);
    }
    if (!r_done && waitpid(rpid, &st, WNOHANG) == rpid) {
      r_done = true;
      rst = status_code(st);
    }
    if (now_s() - t0 > o.timeout_s) {
      if (!s_done) kill(spid, SIGKILL);
      if (!r_done) kill(rpid, SIGKILL);
    }
    if (!(s_done && r_done)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  res.sender_status = sst;
  res.receiver_status = rst;
  res.seconds = now_s() - t0;
  return res;
}

namespace {

// "0100007F:9C41" (/proc/net/tcp, IPv4) -> "127.0.0.1:40001"; IPv6 addresses stay as hex.
std::string proc_net_addr(const std::string& hexaddr) {
  const size_t colon = hexaddr.find(':');
  if (colon == std::string::npos) return hexaddr;
  const std::string a = hexaddr.substr(0, colon);
  const unsigned port = static_cast<unsigned>(strtoul(hexaddr.c_str() + colon + 1, nullptr, 16));
  std::string host = a;
  if (a.size() == 8) {
    in_addr ia;
    ia.s_addr = static_cast<in_addr_t>(strtoul(a.c_str(), nullptr, 16));
    char b[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &ia, b, sizeof(b));
    host = b;
  }
  return host + ":" + std::to_string(port);
}

const char* tcp_state_name(int st) {
  static const char* const names[] = {"?",          "ESTABLISHED", "SYN_SENT",  "SYN_RECV",
                                      "FIN_WAIT1",  "FIN_WAIT2",   "TIME_WAIT", "CLOSE",
                                      "CLOSE_WAIT", "LAST_ACK",    "LISTEN",    "CLOSING"};
  return st > 0 && st < 12 ? names[st] : "?";
}

}  // namespace

std::vector<SocketFd> socket_fds() {
  // inode -> (kind, state, description), from the kernel's socket tables.
  struct Entry {
    std::string kind, state, text;
  };
  std::map<std::string, Entry> by_inode;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::istringstream in(read_file(table));
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::vector<std::string> f;
      std::string t;
      while (ls >> t) f.push_back(t);
      if (f.size() < 10) continue;
      const std::string st = tcp_state_name(static_cast<int>(strtol(f[3].c_str(), nullptr, 16)));
      by_inode[f[9]] = {"tcp", st,
                        "tcp " + proc_net_addr(f[1]) + " -> " + proc_net_addr(f[2]) + " " + st};
    }
  }
  for (const char* table : {"/proc/net/unix", "/proc/net/netlink"}) {
    std::istringstream in(read_file(table));
    std::string line;
    std::getline(in, line);
    const std::string kind = strstr(table, "unix") ? "unix" : "netlink";
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::vector<std::string> f;
      std::string t;
      while (ls >> t) f.push_back(t);
      // unix: the inode is field 6; netlink: the last field.
      if (kind == "unix" && f.size() > 6) by_inode[f[6]] = {kind, "", kind};
      if (kind == "netlink" && !f.empty()) by_inode[f.back()] = {kind, "", kind};
    }
  }
  std::vector<SocketFd> out;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char link[64] = {};
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    if (readlink(path.c_str(), link, sizeof(link) - 1) <= 0 || strncmp(link, "socket:[", 8) != 0)
      continue;
    std::string inode(link + 8);
    if (!inode.empty() && inode.back() == ']') inode.pop_back();
    SocketFd s;
    s.fd = atoi(e->d_name);
    auto it = by_inode.find(inode);
    s.kind = it != by_inode.end() ? it->second.kind : "other";
    s.tcp_state = it != by_inode.end() ? it->second.state : "";
    s.text =
        std::string("fd ") + e->d_name + ": " + (it != by_inode.end() ? it->second.text : link);
    out.push_back(s);
  }
  closedir(d);
  return out;
}

int count_socket_fds() { return static_cast<int>(socket_fds().size()); }

int count_tcp_connections() {
  int n = 0;
  for (const SocketFd& s : socket_fds()) n += s.kind == "tcp" && s.tcp_state != "LISTEN";
  return n;
}

namespace {

// Waits for a byte (or EOF: the writer is gone) on each of `fds`, for at most timeout_s.
void wait_readable(const std::vector<int>& fds, int timeout_s) {
  std::vector<char> seen(fds.size(), 0);
  size_t left = fds.size();
  const double end = now_s() + timeout_s;
  while (left > 0 && now_s() < end) {
    std::vector<pollfd> p;
    std::vector<size_t> idx;
    for (size_t i = 0; i < fds.size(); ++i)
      if (!seen[i]) {
        p.push_back({fds[i], POLLIN, 0});
        idx.push_back(i);
      }
    const int r = ::poll(p.data(), p.size(), 100);
    if (r < 0 && errno != EINTR) return;
    for (size_t j = 0; r > 0 && j < p.size(); ++j)
      if (p[j].revents) {
        seen[idx[j]] = 1;
        --left;
      }
  }
}

}  // namespace

bool raise_nofile(long n, std::string* err) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    *err = std::string("getrlimit(RLIMIT_NOFILE): ") + strerror(errno);
    return false;
  }
  const rlimit was = rl;
  rl.rlim_cur = static_cast<rlim_t>(n);
  if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < rl.rlim_cur) rl.rlim_max = rl.rlim_cur;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    *err = "setrlimit(RLIMIT_NOFILE) to " + std::to_string(n) + " (soft " +
           std::to_string(static_cast<long long>(was.rlim_cur)) + ", hard " +
           std::to_string(static_cast<long long>(was.rlim_max)) +
           "; raising the hard limit needs CAP_SYS_RESOURCE): " + strerror(errno);
    return false;
  }
  return true;
}

namespace {

// The pipes of one run_hub: per peer, its handles (peer -> hub) and the finish barrier in
// both directions.
struct HubPipes {
  std::vector<std::array<int, 2>> handles, up, down;
  void close_all_but(const std::vector<int>& keep) const {
    for (const auto* v : {&handles, &up, &down})
      for (const auto& p : *v)
        for (int fd : p)
          if (std::find(keep.begin(), keep.end(), fd) == keep.end()) ::close(fd);
  }
};

// Common to the hub and the peers: namespace, limits, environment, plugin, init.
int hub_child_setup(const HubOptions& o, Endpoint* ep) {
  if (!enter_netns(o.netns)) return 89;
  std::string err;
  if (o.nofile > 0 && !raise_nofile(o.nofile, &err)) {
    fprintf(stderr, "[pid %d] %s\n", getpid(), err.c_str());
    return 88;
  }
  for (const auto& kv : o.env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  if (!load_plugin(&ep->plugin, &err)) {
    fprintf(stderr, "%s\n", err.c_str());
    return 90;
  }
  ncclNetCommConfig_v11_t cfg{-1};
  if (ep->plugin.net->init(&ep->ctx, 0x1234, &cfg, child_logger, nullptr) != ncclSuccess) {
    fprintf(stderr, "init failed\n");
    return 91;
  }
  return 0;
}

int dev_of(const HubOptions& o, int k) {
  return o.devs.empty() ? 0 : o.devs[static_cast<size_t>(k) % o.devs.size()];
}

// Closes every comm still open, then (check_sockets_released) waits until no TCP socket but
// the listeners is left.
int hub_child_close(const HubOptions& o, Endpoint& ep, bool send) {
  auto close_fn = send ? ep.plugin.net->closeSend : ep.plugin.net->closeRecv;
  for (auto& c : ep.conns)
    if (c.comm) close_fn(c.comm);
  if (!o.check_sockets_released) return 0;
  const double end = now_s() + 30;
  int n = count_tcp_connections();
  while (n > 0 && now_s() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    n = count_tcp_connections();
  }
  if (n > 0) {
    std::string list;
    for (const SocketFd& s : socket_fds()) list += s.text + "\n";
    fprintf(stderr,
            "[pid %d] %s: %d TCP sockets besides the listeners still open 30 s after closing %zu "
            "connections:\n%s",
            getpid(), send ? "hub" : "peer", n, ep.conns.size(), list.c_str());
    return 97;
  }
  return 0;
}

int hub_main(const HubOptions& o, const HubPipes& pp, const std::vector<pid_t>& peer_pids,
             const EndpointFn& fn) {
  Endpoint ep;
  if (int rc = hub_child_setup(o, &ep)) return rc;
  const int P = o.peers, K = o.conns_per_peer, n = P * K;
  std::vector<std::vector<char>> handles(static_cast<size_t>(n),
                                         std::vector<char>(NCCL_NET_HANDLE_MAXSIZE, 0));
  for (int p = 0; p < P; ++p)
    for (int k = 0; k < K; ++k)
      if (!read_all(pp.handles[p][0], handles[p * K + k].data(), NCCL_NET_HANDLE_MAXSIZE)) {
        fprintf(stderr, "hub: no handle %d from peer %d\n", k, p);
        return 93;
      }
  // Started in peer-interleaved order (connection k of peer 0, of peer 1, ...), so every peer
  // accepts all along; at most connect_window in progress.
  std::vector<int> order;
  for (int k = 0; k < K; ++k)
    for (int p = 0; p < P; ++p) order.push_back(p * K + k);
  std::vector<void*> comms(static_cast<size_t>(n), nullptr);
  std::vector<int> active;
  size_t next = 0;
  int done = 0;
  const double end = now_s() + o.connect_timeout_ms / 1e3;
  while (done < n) {
    while (next < order.size() &&
           (o.connect_window <= 0 || static_cast<int>(active.size()) < o.connect_window))
      active.push_back(order[next++]);
    for (size_t j = 0; j < active.size();) {
      const int i = active[j];
      if (ep.plugin.net->connect(ep.ctx, dev_of(o, i % K), handles[i].data(), &comms[i], nullptr) !=
          ncclSuccess) {
        fprintf(stderr, "hub: connect of connection %d (peer %d) failed after %d connected\n",
                i % K, i / K, done);
        return 94;
      }
      if (comms[i]) {
        ++done;
        active.erase(active.begin() + static_cast<long>(j));
      } else {
        ++j;
      }
    }
    if (done < n && now_s() > end) {
      fprintf(stderr, "hub: %d of %d connections after %d ms\n", done, n, o.connect_timeout_ms);
      return 95;
    }
  }
  for (int i = 0; i < n; ++i) {
    Endpoint c;
    c.plugin = ep.plugin;
    c.ctx = ep.ctx;
    c.comm = comms[i];
    c.dev = dev_of(o, i % K);
    c.peer_pid = peer_pids[i / K];
    ep.conns.push_back(std::move(c));
  }
  ep.comm = comms[0];
  int rc = fn(ep);
  fflush(stdout);
  fflush(stderr);
  if (rc != 0) return rc;
  std::vector<int> ups;
  for (const auto& u : pp.up) ups.push_back(u[0]);
  wait_readable(ups, o.timeout_s);
  char b = 1;
  for (const auto& d : pp.down)
    if (::write(d[1], &b, 1) != 1) {
      // That peer is gone; nothing to tell it.
    }
  return hub_child_close(o, ep, true);
}

int peer_main(const HubOptions& o, const HubPipes& pp, int p, const PeerFn& fn) {
  Endpoint ep;
  if (int rc = hub_child_setup(o, &ep)) return rc;
  const int K = o.conns_per_peer;
  std::vector<void*> listens(static_cast<size_t>(K), nullptr),
      comms(static_cast<size_t>(K), nullptr);
  std::vector<char> h(NCCL_NET_HANDLE_MAXSIZE, 0);
  for (int k = 0; k < K; ++k) {
    if (ep.plugin.net->listen(ep.ctx, dev_of(o, k), h.data(), &listens[k]) != ncclSuccess) {
      fprintf(stderr, "peer %d: listen %d failed\n", p, k);
      return 92;
    }
    if (!write_all(pp.handles[p][1], h.data(), h.size())) return 93;
  }
  int done = 0;
  const double end = now_s() + o.connect_timeout_ms / 1e3;
  while (done < K) {
    for (int k = 0; k < K; ++k) {
      if (comms[k]) continue;
      if (ep.plugin.net->accept(listens[k], &comms[k], nullptr) != ncclSuccess) {
        fprintf(stderr, "peer %d: accept of connection %d failed after %d accepted\n", p, k, done);
        return 94;
      }
      if (comms[k]) {
        ++done;
        ep.plugin.net->closeListen(listens[k]);
      }
    }
    if (done < K && now_s() > end) {
      fprintf(stderr, "peer %d: %d of %d connections accepted after %d ms\n", p, done, K,
              o.connect_timeout_ms);
      return 95;
    }
  }
  for (int k = 0; k < K; ++k) {
    Endpoint c;
    c.plugin = ep.plugin;
    c.ctx = ep.ctx;
    c.comm = comms[k];
    c.dev = dev_of(o, k);
    c.peer_pid = 0;  // the hub is forked after the peers
    ep.conns.push_back(std::move(c));
  }
  ep.comm = comms[0];
  int rc = fn(ep, p);
  fflush(stdout);
  fflush(stderr);
  if (rc != 0) return rc;
  char b = 1;
  if (::write(pp.up[p][1], &b, 1) == 1) wait_readable({pp.down[p][0]}, o.timeout_s);
  return hub_child_close(o, ep, false);
}

}  // namespace

HubResult run_hub(const HubOptions& o, const EndpointFn& hub, const PeerFn& peer) {
  HubResult res;
  res.peer_status.assign(static_cast<size_t>(o.peers), -1);
  HubPipes pp;
  for (int p = 0; p < o.peers; ++p)
    for (auto* v : {&pp.handles, &pp.up, &pp.down}) {
      std::array<int, 2> fds{-1, -1};
      if (pipe(fds.data()) != 0) {
        pp.close_all_but({});
        return res;
      }
      v->push_back(fds);
    }
  fflush(stdout);
  fflush(stderr);
  const double t0 = now_s();
  std::vector<pid_t> pids;
  for (int p = 0; p < o.peers; ++p) {
    const pid_t pid = fork();
    if (pid == 0) {
      pp.close_all_but({pp.handles[p][1], pp.up[p][1], pp.down[p][0]});
      _exit(peer_main(o, pp, p, peer));
    }
    pids.push_back(pid);
  }
  const pid_t hpid = fork();
  if (hpid == 0) {
    std::vector<int> keep;
    for (int p = 0; p < o.peers; ++p) {
      keep.push_back(pp.handles[p][0]);
      keep.push_back(pp.up[p][0]);
      keep.push_back(pp.down[p][1]);
    }
    pp.close_all_but(keep);
    _exit(hub_main(o, pp, pids, hub));
  }
  pp.close_all_but({});
  std::vector<pid_t> all = pids;
  all.push_back(hpid);
  std::vector<int> status(all.size(), -1);
  size_t left = all.size();
  bool killed = false;
  while (left > 0) {
    for (size_t i = 0; i < all.size(); ++i) {
      int st;
      if (status[i] == -1 && all[i] > 0 && waitpid(all[i], &st, WNOHANG) == all[i]) {
        status[i] = status_code(st);
        --left;
      } else if (all[i] <= 0 && status[i] == -1) {
        status[i] = -2;  // fork failed
        --left;
      }
    }
    if (!killed && now_s() - t0 > o.timeout_s) {
      for (size_t i = 0; i < all.size(); ++i)
        if (status[i] == -1 && all[i] > 0) kill(all[i], SIGKILL);
      killed = true;
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int p = 0; p < o.peers; ++p) res.peer_status[p] = status[p];
  res.hub_status = status.back();
  res.seconds = now_s() - t0;
  return res;
}

TempNetns::TempNetns(const std::string& tag) {
  name_ = "r2ccl-" + tag + "-" + std::to_string(getpid());
  std::string out;
  run_command("ip netns del " + shell_quote(name_) + " 2>/dev/null");  // a stale one
  if (run_command("ip netns add " + shell_quote(name_), &out) != 0) {
    error_ = "ip netns add " + name_ + ": " + out;
    return;
  }
  ok_ = true;
  if (exec("ip link set lo up", &out) != 0) {
    error_ = "ip link set lo up in " + name_ + ": " + out;
    ok_ = false;
  }
}

TempNetns::~TempNetns() {
  if (!name_.empty()) run_command("ip netns del " + shell_quote(name_) + " 2>/dev/null");
}

int TempNetns::exec(const std::string& cmd, std::string* out) const {
  return run_command("ip netns exec " + shell_quote(name_) + " sh -c " + shell_quote(cmd), out);
}

// One rank of run_group: handles[k] is the pipe of links[k] (the receiver writes its handle
// into [1], the sender reads [0]).
static int group_member_main(const GroupOptions& o, int rank,
                             const std::vector<std::array<int, 2>>& handles, const GroupFn& fn) {
  if (rank < static_cast<int>(o.stderr_files.size()) && !o.stderr_files[rank].empty()) {
    if (!freopen(o.stderr_files[rank].c_str(), "w", stderr)) return 88;
    setvbuf(stderr, nullptr, _IOLBF, 0);
  }
  for (const auto& kv : o.env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  if (rank < static_cast<int>(o.rank_env.size()))
    for (const auto& kv : o.rank_env[rank]) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  GroupMember m;
  m.rank = rank;
  std::string err;
  if (!load_plugin(&m.plugin, &err)) {
    fprintf(stderr, "%s\n", err.c_str());
    return 90;
  }
  ncclNetCommConfig_v11_t cfg{-1};
  if (m.plugin.net->init(&m.ctx, 0x1234, &cfg, child_logger, nullptr) != ncclSuccess) {
    fprintf(stderr, "rank %d: init failed\n", rank);
    return 91;
  }
  struct Link {
    int peer;
    bool send;
    std::vector<char> handle;
    void* listen = nullptr;
    void* comm = nullptr;
  };
  std::vector<Link> links;
  for (size_t k = 0; k < o.links.size(); ++k) {
    const auto& l = o.links[k];
    if (l.second == rank) {
      Link x{l.first, false, std::vector<char>(NCCL_NET_HANDLE_MAXSIZE, 0)};
      if (m.plugin.net->listen(m.ctx, o.dev, x.handle.data(), &x.listen) != ncclSuccess) return 92;
      if (!write_all(handles[k][1], x.handle.data(), x.handle.size())) return 93;
      links.push_back(std::move(x));
    }
  }
  for (size_t k = 0; k < o.links.size(); ++k) {
    const auto& l = o.links[k];
    if (l.first == rank) {
      Link x{l.second, true, std::vector<char>(NCCL_NET_HANDLE_MAXSIZE, 0)};
      if (!read_all(handles[k][0], x.handle.data(), x.handle.size())) return 93;
      links.push_back(std::move(x));
    }
  }
  const double end = now_s() + o.connect_timeout_ms / 1e3;
  for (size_t done = 0; done < links.size();) {
    done = 0;
    for (auto& x : links) {
      if (!x.comm) {
        const ncclResult_t r =
            x.send ? m.plugin.net->connect(m.ctx, o.dev, x.handle.data(), &x.comm, nullptr)
                   : m.plugin.net->accept(x.listen, &x.comm, nullptr);
        if (r != ncclSuccess) {
          fprintf(stderr, "rank %d: %s rank %d failed: %d\n", rank,
                  x.send ? "connect to" : "accept from", x.peer, r);
          return 94;
        }
        if (x.comm && x.listen) m.plugin.net->closeListen(x.listen);
      }
      done += x.comm != nullptr;
    }
    if (done < links.size() && now_s() > end) {
      fprintf(stderr, "rank %d: %zu of %zu connections after %d ms\n", rank, done, links.size(),
              o.connect_timeout_ms);
      return 95;
    }
  }
  for (auto& x : links) {
    Endpoint ep;
    ep.plugin = m.plugin;
    ep.ctx = m.ctx;
    ep.comm = x.comm;
    ep.dev = o.dev;
    (x.send ? m.send_to : m.recv_from)[x.peer] = ep;
  }
  const int rc = fn(m);
  fflush(stdout);
  fflush(stderr);
  if (rc == 0) {
    for (auto& kv : m.send_to)
      if (kv.second.comm) m.plugin.net->closeSend(kv.second.comm);
    for (auto& kv : m.recv_from)
      if (kv.second.comm) m.plugin.net->closeRecv(kv.second.comm);
  }
  return rc;
}

GroupResult run_group(const GroupOptions& o, const GroupFn& fn) {
  GroupResult res;
  res.status.assign(o.nranks, -1);
  std::vector<std::array<int, 2>> handles(o.links.size());
  for (auto& h : handles)
    if (pipe(h.data()) != 0) return res;
  fflush(stdout);
  fflush(stderr);
  const double t0 = now_s();
  std::vector<pid_t> pids(o.nranks, -1);
  for (int r = 0; r < o.nranks; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) _exit(group_member_main(o, r, handles, fn));
  }
  for (auto& h : handles) {
    close(h[0]);
    close(h[1]);
  }
  int left = o.nranks;
  while (left > 0) {
    for (int r = 0; r < o.nranks; ++r) {
      int st;
      if (pids[r] > 0 && waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        res.status[r] = status_code(st);
        pids[r] = -1;
        --left;
      }
    }
    if (now_s() - t0 > o.timeout_s)
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  res.seconds = now_s() - t0;
  return res;
}

ChildResult run_child(const std::map<std::string, std::string>& env, const std::function<int()>& fn,
                      int timeout_s) {
  ChildResult res;
  std::string out_path = temp_path("child-output");
  int out_fd = ::open(out_path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
  if (out_fd < 0) {
    res.output = "cannot create " + out_path;
    return res;
  }
  fflush(stdout);
  fflush(stderr);
  double t0 = now_s();
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out_fd, 1);
    dup2(out_fd, 2);
    for (const auto& kv : env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
    int rc = fn();
    fflush(stdout);
    fflush(stderr);
    _exit(rc);
  }
  ::close(out_fd);
  if (pid < 0) {
    res.output = "fork failed";
    return res;
  }
  int st = 0;
  bool killed = false;
  for (;;) {
    pid_t w = waitpid(pid, &st, WNOHANG);
    if (w == pid) break;
    if (!killed && now_s() - t0 > timeout_s) {
      kill(pid, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  res.status = status_code(st);
  res.seconds = now_s() - t0;
  res.output = read_file(out_path);
  if (killed) res.output += "\n[harness: killed after " + std::to_string(timeout_s) + " s]\n";
  unlink(out_path.c_str());
  return res;
}

void fill_pattern(void* buf, size_t n, uint64_t seed) {
  auto* b = static_cast<uint8_t*>(buf);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    memcpy(b + i, &x, 8);
  }
  for (; i < n; ++i) b[i] = static_cast<uint8_t>(i * 131 + seed);
}

long long check_pattern(const void* buf, size_t n, uint64_t seed) {
  auto* b = static_cast<const uint8_t*>(buf);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if (memcmp(b + i, &x, 8) != 0) return static_cast<long long>(i);
  }
  for (; i < n; ++i)
    if (b[i] != static_cast<uint8_t>(i * 131 + seed)) return static_cast<long long>(i);
  return -1;
}

std::string temp_path(const std::string& tag) {
  static std::atomic<int> counter{0};
  const std::string path = env_or("TMPDIR", "/tmp") + "/r2ccl-test-" + std::to_string(getpid()) +
                           "-" + std::to_string(counter++) + "-" + tag;
  // Unique within this process; anything already there was left by an earlier process that
  // had the same pid (a daemon would append to its log, and a test read both runs' lines).
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  return path;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int count_lines_containing(const std::string& text, const std::string& needle) {
  int n = 0;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.find(needle) != std::string::npos) ++n;
  return n;
}

long long mono_us() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

std::vector<double> stamps_of(const std::string& text, const std::string& needle) {
  std::vector<double> v;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(needle) == std::string::npos) continue;
    size_t a = line.find('[');
    size_t b = line.find(']');
    if (a == std::string::npos || b == std::string::npos || b < a) continue;
    v.push_back(strtod(line.c_str() + a + 1, nullptr));
  }
  return v;
}

std::map<std::string, char> dynamic_symbols(const std::string& so) {
  std::map<std::string, char> syms;
  std::string out;
  if (run_command("nm -D --defined-only " + shell_quote(so), &out) != 0) return syms;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::vector<std::string> tok;
    std::string t;
    while (ls >> t) tok.push_back(t);
    if (tok.size() < 2) continue;
    syms[tok.back()] = tok.size() == 3 && tok[1].size() == 1 ? tok[1][0] : '?';
  }
  return syms;
}

int run_command(const std::string& cmd, std::string* output) {
  std::string full = cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  std::string out;
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int st = pclose(p);
  if (output) *output = out;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace r2ccl::test
