// Bad-input suite. The plugin runs in a forked child process (fresh R2CCL_* environment, one
// rail on lo); this process plays a FAKE PEER that speaks the r2ccl wire format (tcp/wire.h)
// over plain sockets and feeds the plugin garbage handles, wrong secrets, truncated and
// garbage frames and chunk headers that lie. Every case checks that the plugin reports a clear
// error (a non-success ncclResult_t and a WARN or event line naming the problem), that nothing
// crashes, that nothing is written outside the posted buffer, and that nothing hangs: every
// wait here is bounded, and every child has an alarm() as a last resort.
//
// Memory checks: receive buffers are mmap'ed as [canary page][... buffer][PROT_NONE page] (the
// buffer ends exactly at the guard page), optionally with a readable canary page between the
// buffer and the guard. A child exits with kExitCorrupted when any canary byte changed.
// Note: the plugin writes chunk payloads with recv() straight into the posted buffer, so a
// write aimed into the guard page is refused by the kernel (EFAULT), not a SIGSEGV; the
// stale-guard case therefore also uses the readable canary page (the stray bytes land there)
// and, under AddressSanitizer, a heap buffer (ASan's recv interceptor aborts the child).
//
// Cases: 1 garbage handles, 2 wrong secret / junk on the listener, 3 truncated and garbage
// frames, 4 lying chunk headers, 5 the stale guard matters (R2CCL_TEST_HOOKS=no_stale_guard),
// 6 dedup matters (no_dedup), 7 stale chunks of a completed message, 8 data without a CTS,
// 9 a later path hello that disagrees with the first.
//
// Child <-> parent: fixed-size Msg records over two pipes (tags "handle", "accepted",
// "posted", "result", ...). R2CCL_TEST_KEEP_LOGS=1 keeps the children's log files.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "net_harness.h"
#include "transport/tcp/wire.h"

extern char** environ;

namespace {

using namespace r2ccl::net;
using namespace r2ccl::net::tcp;
namespace rt = r2ccl::test;

constexpr uint8_t kPoison = 0x5a;  // receive buffers before anything lands
constexpr uint8_t kCanary = 0xa5;  // memory around receive buffers
constexpr int kExitCorrupted = 3;  // child: memory outside the posted buffer changed
constexpr size_t kCap = 64 * 1024;

double now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void sleep_ms(int ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, nullptr);
}

struct IgnoreSigpipe {
  IgnoreSigpipe() { signal(SIGPIPE, SIG_IGN); }
} g_ignore_sigpipe;

bool write_all(int fd, const void* p, size_t n) {
  auto* b = static_cast<const char*>(p);
  while (n) {
    ssize_t w = ::write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    b += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Waits up to timeout_ms for fd to become readable. Returns true when it is.
bool readable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  int r = ::poll(&p, 1, timeout_ms < 0 ? 0 : timeout_ms);
  return r > 0;
}

// ------------------------------------------------------------------------------------------
// Parent <-> child messages.

struct Msg {
  char tag[16] = {};
  int64_t v[6] = {};
  uint8_t data[NCCL_NET_HANDLE_MAXSIZE] = {};
  bool is(const char* t) const { return strncmp(tag, t, sizeof(tag)) == 0; }
};

Msg make_msg(const char* tag, std::initializer_list<int64_t> v, const void* data, size_t n) {
  Msg m;
  snprintf(m.tag, sizeof(m.tag), "%s", tag);
  size_t i = 0;
  for (int64_t x : v)
    if (i < 6) m.v[i++] = x;
  if (data) memcpy(m.data, data, std::min(n, sizeof(m.data)));
  return m;
}

// Reads one Msg within timeout_ms. A Msg is far below PIPE_BUF, so it arrives whole.
bool read_msg(int fd, Msg* m, int timeout_ms) {
  if (!readable(fd, timeout_ms)) return false;
  ssize_t r = ::read(fd, m, sizeof(*m));
  return r == static_cast<ssize_t>(sizeof(*m));
}

// ------------------------------------------------------------------------------------------
// Child side: the plugin as NCCL would drive it.

void child_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  if (level > NCCL_LOG_WARN && !getenv("R2CCL_TEST_VERBOSE")) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s %s\n", level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
}

class ChildCtx {
 public:
  const ncclNet_v11_t* net = nullptr;
  void* ctx = nullptr;
  void* listen_comm = nullptr;
  void* comm = nullptr;
  int in_fd = -1;   // from the parent
  int out_fd = -1;  // to the parent

  void say(const char* tag, std::initializer_list<int64_t> v = {}, const void* data = nullptr,
           size_t n = 0) {
    Msg m = make_msg(tag, v, data, n);
    write_all(out_fd, &m, sizeof(m));
  }
  bool hear(Msg* m, int timeout_ms) {
    if (!pending_.empty()) {
      *m = pending_.front();
      pending_.erase(pending_.begin());
      return true;
    }
    return read_msg(in_fd, m, timeout_ms);
  }
  // Non-blocking: has the parent sent a message tagged `tag` (now or before)?
  bool heard(const char* tag) {
    Msg m;
    while (read_msg(in_fd, &m, 0)) pending_.push_back(m);
    for (const auto& p : pending_)
      if (p.is(tag)) return true;
    return false;
  }
  // listen(), "handle" to the parent, then accept() until it returns a comm ("accepted",
  // v0 = number of calls that returned NULL) or timeout_ms passes.
  bool listen_and_accept(int timeout_ms) {
    char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
    if (net->listen(ctx, 0, handle, &listen_comm) != ncclSuccess) {
      say("error", {1});
      return false;
    }
    say("handle", {}, handle, sizeof(handle));
    const double end = now_ms() + timeout_ms;
    int64_t nulls = 0;
    while (!comm) {
      ncclResult_t r = net->accept(listen_comm, &comm, nullptr);
      if (r != ncclSuccess) {
        say("accept-failed", {r, nulls});
        return false;
      }
      if (comm) break;
      ++nulls;
      if (now_ms() > end) {
        say("accept-timeout", {nulls});
        return false;
      }
      usleep(200);
    }
    say("accepted", {nulls});
    return true;
  }
  // irecv until the plugin hands out a request (it returns NULL while busy).
  ncclResult_t post_recv(void* buf, size_t size, void** req) {
    void* mh = nullptr;
    if (net->regMr(comm, buf, size, NCCL_PTR_HOST, &mh) != ncclSuccess) return ncclInternalError;
    mhandles_.push_back(mh);
    int tag = 0;
    *req = nullptr;
    const double end = now_ms() + 5000;
    while (!*req) {
      ncclResult_t r = net->irecv(comm, 1, &buf, &size, &tag, &mh, nullptr, req);
      if (r != ncclSuccess) return r;
      if (!*req && now_ms() > end) return ncclInProgress;
    }
    return ncclSuccess;
  }
  struct TestResult {
    ncclResult_t rc = ncclSuccess;
    bool done = false;
    int size = -1;
    double ms = 0;
  };
  // test() until done, an error, or timeout_ms.
  TestResult wait(void* req, int timeout_ms) {
    TestResult t;
    const double start = now_ms();
    for (;;) {
      int done = 0, size = -1;
      t.rc = net->test(req, &done, &size);
      t.ms = now_ms() - start;
      if (t.rc != ncclSuccess) return t;
      if (done) {
        t.done = true;
        t.size = size;
        return t;
      }
      if (t.ms > timeout_ms) return t;
      usleep(100);
    }
  }
  void close_all() {
    for (void* mh : mhandles_) net->deregMr(comm, mh);
    mhandles_.clear();
    if (comm) net->closeRecv(comm);
    if (listen_comm) net->closeListen(listen_comm);
    comm = listen_comm = nullptr;
  }

 private:
  std::vector<Msg> pending_;
  std::vector<void*> mhandles_;
};

// A receive buffer that ends exactly at a PROT_NONE page:
//   [canary: one page + slack][buffer: size][canary: post_pages pages][PROT_NONE page]
class GuardedBuffer {
 public:
  GuardedBuffer(size_t size, size_t post_pages) : size_(size) {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t body = (size + page_ - 1) / page_ * page_;
    map_len_ = page_ + body + post_pages * page_ + page_;
    map_ = static_cast<char*>(
        mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      return;
    }
    char* guard = map_ + map_len_ - page_;
    mprotect(guard, page_, PROT_NONE);
    post_ = guard - post_pages * page_;
    post_len_ = post_pages * page_;
    data_ = post_ - size;
    memset(map_, kCanary, static_cast<size_t>(guard - map_));
    memset(data_, kPoison, size_);
  }
  ~GuardedBuffer() {
    if (map_) munmap(map_, map_len_);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  bool ok() const { return map_ != nullptr; }
  char* data() const { return data_; }
  // Changed canary bytes before / after the buffer.
  size_t pre_changed() const { return count_not(map_, static_cast<size_t>(data_ - map_), kCanary); }
  size_t post_changed() const { return count_not(post_, post_len_, kCanary); }
  // Buffer bytes that are no longer the poison value.
  size_t written() const { return count_not(data_, size_, kPoison); }

  static size_t count_not(const char* p, size_t n, uint8_t v) {
    size_t c = 0;
    for (size_t i = 0; i < n; ++i) c += static_cast<uint8_t>(p[i]) != v;
    return c;
  }

 private:
  size_t size_;
  size_t page_ = 4096;
  size_t map_len_ = 0;
  char* map_ = nullptr;
  char* data_ = nullptr;
  char* post_ = nullptr;
  size_t post_len_ = 0;
};

// ------------------------------------------------------------------------------------------
// Parent side: the child process running the plugin.

using Env = std::vector<std::pair<std::string, std::string>>;
using ChildFn = std::function<int(ChildCtx&)>;
class FakePeer;

class Child {
 public:
  Child(const Env& env, const ChildFn& fn) {
    err_path_ = rt::temp_path("bad-input-stderr");
    log_path_ = rt::temp_path("bad-input-events");
    const std::string plugin = rt::env_or("R2CCL_TEST_PLUGIN", "libnccl-net-r2ccl.so");
    int to_child[2], to_parent[2];
    if (pipe(to_child) != 0) return;
    if (pipe(to_parent) != 0) {
      ::close(to_child[0]);
      ::close(to_child[1]);
      return;
    }
    fflush(stdout);
    fflush(stderr);
    pid_ = fork();
    if (pid_ == 0) {
      ::close(to_child[1]);
      ::close(to_parent[0]);
      _exit(child_main(env, fn, plugin, to_child[0], to_parent[1]));
    }
    ::close(to_child[0]);
    ::close(to_parent[1]);
    to_ = to_child[1];
    from_ = to_parent[0];
  }
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      int st;
      waitpid(pid_, &st, 0);
    }
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
    if (!getenv("R2CCL_TEST_KEEP_LOGS")) {
      unlink(err_path_.c_str());
      unlink(log_path_.c_str());
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  bool started() const { return pid_ > 0; }
  void tell(const char* tag, std::initializer_list<int64_t> v = {}, const void* data = nullptr,
            size_t n = 0) {
    Msg m = make_msg(tag, v, data, n);
    write_all(to_, &m, sizeof(m));
  }
  // The next message from the child within timeout_ms; meanwhile the fake peer (if given)
  // answers the plugin's pings.
  bool next(Msg* m, int timeout_ms, FakePeer* pump = nullptr);
  // The next message must carry `tag` (else last_error() says what came instead).
  bool expect(const char* tag, Msg* m, int timeout_ms, FakePeer* pump = nullptr) {
    if (!next(m, timeout_ms, pump)) {
      last_error_ = std::string("no '") + tag + "' from the child within " +
                    std::to_string(timeout_ms) + " ms";
      return false;
    }
    if (!m->is(tag)) {
      last_error_ = std::string("expected '") + tag + "' from the child, got '" +
                    std::string(m->tag, strnlen(m->tag, sizeof(m->tag))) +
                    "' (v0=" + std::to_string(m->v[0]) + ")";
      return false;
    }
    return true;
  }
  // Exit code, or 128 + signal number; -1 when it was still running after timeout_ms (killed).
  int wait_exit(int timeout_ms) {
    if (reaped_) return status_;
    const double end = now_ms() + timeout_ms;
    int st = 0;
    for (;;) {
      if (waitpid(pid_, &st, WNOHANG) == pid_) break;
      if (now_ms() > end) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &st, 0);
        reaped_ = true;
        status_ = -1;
        return status_;
      }
      sleep_ms(5);
    }
    reaped_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -2;
    return status_;
  }
  // "bye", then the exit status.
  int finish(int timeout_ms = 5000) {
    tell("bye");
    return wait_exit(timeout_ms);
  }
  // The child's stderr (WARN lines, sanitizer reports) and its R2CCL_LOG_FILE event lines.
  std::string log() const {
    return rt::read_file(err_path_) + "--- R2CCL_LOG_FILE ---\n" + rt::read_file(log_path_);
  }
  // Only the child's stderr.
  std::string err_log() const { return rt::read_file(err_path_); }
  const std::string& last_error() const { return last_error_; }

 private:
  int child_main(const Env& env, const ChildFn& fn, const std::string& plugin, int in_fd,
                 int out_fd) {
    alarm(60);  // last resort against a hang; the parent's waits are far shorter
    int efd = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (efd >= 0) {
      dup2(efd, 2);
      ::close(efd);
    }
    // A fresh r2ccl environment: none of the parent's R2CCL_* / NCCL_* settings.
    std::vector<std::string> drop;
    for (char** e = environ; *e; ++e) {
      std::string kv(*e);
      if (kv.rfind("R2CCL_", 0) == 0 || kv.rfind("NCCL_", 0) == 0)
        drop.push_back(kv.substr(0, kv.find('=')));
    }
    for (const auto& n : drop) unsetenv(n.c_str());
    setenv("R2CCL_SOCKET_IFNAME", "lo@127.0.0.1", 1);
    setenv("R2CCL_FAILOVER_TIMEOUT", "1s", 1);
    setenv("R2CCL_CONNECT_TIMEOUT", "5s", 1);
    // Quiet heartbeats unless a case asks for them: a fake peer busy elsewhere must not look
    // dead (the cases that exercise pings lower it and answer them).
    setenv("R2CCL_HEARTBEAT_INTERVAL", "10s", 1);
    for (const auto& kv : env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
    setenv("R2CCL_LOG_FILE", log_path_.c_str(), 1);

    ChildCtx c;
    c.in_fd = in_fd;
    c.out_fd = out_fd;
    rt::Plugin p;
    std::string err;
    if (!rt::load_plugin(&p, &err, plugin.c_str())) {
      fprintf(stderr, "%s\n", err.c_str());
      c.say("error", {90});
      return 90;
    }
    c.net = p.net;
    ncclNetCommConfig_v11_t cfg{-1};
    ncclResult_t r = c.net->init(&c.ctx, 0x5eed, &cfg, child_logger, nullptr);
    if (r != ncclSuccess) {
      fprintf(stderr, "init failed: %d\n", r);
      c.say("error", {91});
      return 91;
    }
    int rc = fn(c);
    fflush(stdout);
    fflush(stderr);
    return rc;
  }

  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  bool reaped_ = false;
  int status_ = -1;
  std::string err_path_, log_path_, last_error_;
};

// ------------------------------------------------------------------------------------------
// The fake peer: one TCP connection speaking the r2ccl wire format.

class FakePeer {
 public:
  enum class Read { kFrame, kTimeout, kClosed, kError };

  FakePeer() = default;
  ~FakePeer() { close(); }
  FakePeer(const FakePeer&) = delete;
  FakePeer& operator=(const FakePeer&) = delete;

  // TCP connection to endpoint `ep` of the handle (blocking, bounded).
  bool dial(const WireHandle& h, int ep = 0) {
    close();
    const WireEndpoint& e = h.endpoints[ep];
    if (e.family != AF_INET) return false;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = e.port;
    memcpy(&a.sin_addr, e.addr, 4);
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return false;
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    timeval tv{2, 0};
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      close();
      return false;
    }
    in_.clear();
    closed_ = false;
    return true;
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool is_open() const { return fd_ >= 0; }

  bool send_raw(const void* p, size_t n) {
    auto* b = static_cast<const char*>(p);
    while (n) {
      ssize_t w = ::send(fd_, b, n, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return false;
      b += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  }
  // Header, then h.len payload bytes from `payload` (zeros when null).
  bool send_frame(const FrameHeader& h, const void* payload = nullptr) {
    std::vector<char> out(sizeof(h) + h.len, 0);
    memcpy(out.data(), &h, sizeof(h));
    if (payload && h.len) memcpy(out.data() + sizeof(h), payload, h.len);
    return send_raw(out.data(), out.size());
  }
  static FrameHeader frame(FrameType t) {
    FrameHeader h{};
    h.magic = kFrameMagic;
    h.type = static_cast<uint8_t>(t);
    return h;
  }
  bool send_data(uint64_t seq, uint32_t idx, uint32_t nchunks, uint64_t off, uint64_t total,
                 const void* payload, uint32_t len) {
    FrameHeader h = frame(FrameType::kData);
    h.seq = seq;
    h.a = idx;
    h.b = nchunks;
    h.off = off;
    h.total = total;
    h.len = len;
    return send_frame(h, payload);
  }

  static HelloBody hello_body(const WireHandle& h, uint32_t flags, uint64_t conn_id) {
    HelloBody b{};
    memcpy(b.secret, h.secret, 16);
    b.listen_id = h.listen_id;
    b.conn_id = conn_id;
    b.path = 0;
    b.stream = 0;
    b.n_paths = 1;
    b.n_streams = 1;
    b.flags = flags;
    b.generation = 0;
    b.rail = 0;
    b.knobs.chunk_size = 512 * 1024;
    b.knobs.backup_paths = 0;
    b.knobs.streams = 1;
    b.knobs.kind = static_cast<uint8_t>(TransportKind::kTcp);
    b.n_rails = 1;
    WireRail& r = b.rails[0];
    r.family = AF_INET;
    r.prefix_len = 8;
    r.port = 0;  // the fake never listens: only a sender reconnects
    const uint8_t lo[4] = {127, 0, 0, 1};
    memcpy(r.addr, lo, 4);
    snprintf(r.name, sizeof(r.name), "fake@127.0.0.1");
    return b;
  }
  bool send_hello(const HelloBody& b, uint32_t version = kWireVersion) {
    FrameHeader h = frame(FrameType::kHello);
    h.len = sizeof(HelloBody);
    h.a = version;
    return send_frame(h, &b);
  }

  // The listener's answer to a refused hello: a WireRefusal (transport/handshake.h), then the
  // close. False when something else came, or nothing within timeout_ms.
  bool wait_refusal(WireRefusal* out, int timeout_ms) {
    const double end = now_ms() + timeout_ms;
    for (;;) {
      if (in_.size() >= sizeof(WireRefusal)) {
        const bool ok = read_refusal(in_.data(), in_.size(), out);
        in_.erase(in_.begin(), in_.begin() + sizeof(WireRefusal));
        return ok;
      }
      const double left = end - now_ms();
      if (closed_ || fd_ < 0 || left <= 0) return false;
      if (!readable(fd_, static_cast<int>(left) + 1)) continue;
      char buf[4096];
      ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE)))
        closed_ = true;
      else if (n > 0)
        in_.insert(in_.end(), buf, buf + n);
    }
  }

  // The next frame, whatever its type (no ping handling).
  Read read_frame(FrameHeader* h, std::vector<char>* body, int timeout_ms) {
    const double end = now_ms() + timeout_ms;
    for (;;) {
      if (in_.size() >= sizeof(FrameHeader)) {
        memcpy(h, in_.data(), sizeof(*h));
        if (h->len > (1u << 20)) return Read::kError;  // the plugin never sends such frames
        const size_t need = sizeof(*h) + h->len;
        if (in_.size() >= need) {
          if (body) body->assign(in_.begin() + sizeof(*h), in_.begin() + need);
          in_.erase(in_.begin(), in_.begin() + need);
          return Read::kFrame;
        }
      }
      if (closed_) return Read::kClosed;
      if (fd_ < 0) return Read::kError;
      const double left = end - now_ms();
      if (left <= 0) return Read::kTimeout;
      if (!readable(fd_, static_cast<int>(left) + 1)) continue;
      char buf[65536];
      ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE))) {
        closed_ = true;
      } else if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return Read::kError;
      } else {
        in_.insert(in_.end(), buf, buf + n);
      }
    }
  }
  // The next frame that is not a PING, oldest first (frames that pump() read count too);
  // PINGs are answered with PONG (seq and off echoed). Every such frame is kept in frames().
  Read next(FrameHeader* h, int timeout_ms) {
    if (!unclaimed_.empty()) {
      *h = unclaimed_.front();
      unclaimed_.erase(unclaimed_.begin());
      return Read::kFrame;
    }
    Read r = read_non_ping(h, timeout_ms);
    if (r == Read::kFrame) frames_.push_back(*h);
    return r;
  }
  // Answers pings for `ms` milliseconds or until the peer closes; other frames are kept for
  // next() / wait_for().
  Read pump(int ms) {
    const double end = now_ms() + ms;
    FrameHeader h;
    for (;;) {
      const double left = end - now_ms();
      if (left <= 0) return Read::kTimeout;
      Read r = read_non_ping(&h, static_cast<int>(left) + 1);
      if (r == Read::kClosed || r == Read::kError) return r;
      if (r == Read::kFrame) {
        frames_.push_back(h);
        unclaimed_.push_back(h);
      }
    }
  }
  // Waits for a frame matching `pred` (answering pings); frames before it are dropped from the
  // unclaimed queue. False on timeout or close.
  bool wait_for(const std::function<bool(const FrameHeader&)>& pred, int timeout_ms,
                FrameHeader* out = nullptr) {
    const double end = now_ms() + timeout_ms;
    FrameHeader h;
    for (;;) {
      const double left = end - now_ms();
      if (left <= 0 && unclaimed_.empty()) return false;
      if (next(&h, left > 0 ? static_cast<int>(left) + 1 : 0) != Read::kFrame) return false;
      if (pred(h)) {
        if (out) *out = h;
        return true;
      }
    }
  }
  // True when the plugin closed (or reset) the connection within timeout_ms.
  bool wait_closed(int timeout_ms) {
    const double end = now_ms() + timeout_ms;
    FrameHeader h;
    for (;;) {
      const double left = end - now_ms();
      if (left <= 0) return false;
      Read r = next(&h, static_cast<int>(left) + 1);
      if (r == Read::kClosed) return true;
      if (r == Read::kError) return false;
    }
  }

  // The connector's side of setup, as conn.cc does it with one path and one stream:
  // 1) a rail query (HELLO with kHelloQuery, answered by HELLO_ACK, then closed by the
  //    listener), 2) the path connection (HELLO, HELLO_ACK), 3) SETUP_DONE (1 path, bitmap 1).
  bool connect_as_sender(const WireHandle& h, std::string* err) {
    uint64_t conn_id = 0xfa4e000000000000ull ^ static_cast<uint64_t>(now_ms() * 1000) ^
                       (static_cast<uint64_t>(getpid()) << 20);
    for (int step = 0; step < 2; ++step) {
      const bool query = step == 0;
      if (!dial(h)) return fail(err, "cannot connect to the handle's endpoint");
      if (!send_hello(hello_body(h, query ? kHelloQuery : 0, query ? 0 : conn_id)))
        return fail(err, "cannot send the hello");
      FrameHeader a;
      std::vector<char> body;
      if (read_frame(&a, &body, 3000) != Read::kFrame) return fail(err, "no HELLO_ACK");
      if (a.magic != kFrameMagic || a.type != static_cast<uint8_t>(FrameType::kHelloAck) ||
          body.size() != sizeof(HelloBody))
        return fail(err, "malformed HELLO_ACK");
      HelloBody b;
      memcpy(&b, body.data(), sizeof(b));
      if (memcmp(b.secret, h.secret, 16) != 0 || b.n_rails < 1 || b.n_rails > kMaxRails)
        return fail(err, "HELLO_ACK does not echo the secret / has no rails");
      if (query && !wait_closed(3000)) return fail(err, "the listener kept the query open");
    }
    FrameHeader sd = frame(FrameType::kSetupDone);
    sd.a = 1;
    sd.total = 1;
    if (!send_frame(sd)) return fail(err, "cannot send SETUP_DONE");
    return true;
  }

  // Every non-PING frame received so far.
  const std::vector<FrameHeader>& frames() const { return frames_; }
  int pings() const { return pings_; }
  int count(FrameType t, uint64_t seq) const {
    int n = 0;
    for (const auto& f : frames_) n += f.type == static_cast<uint8_t>(t) && f.seq == seq;
    return n;
  }

 private:
  static bool fail(std::string* err, const char* what) {
    if (err) *err = what;
    return false;
  }
  Read read_non_ping(FrameHeader* h, int timeout_ms) {
    const double end = now_ms() + timeout_ms;
    for (;;) {
      const double left = end - now_ms();
      Read r = read_frame(h, nullptr, left > 0 ? static_cast<int>(left) : 0);
      if (r != Read::kFrame) return r;
      if (h->type != static_cast<uint8_t>(FrameType::kPing)) return r;
      FrameHeader p = frame(FrameType::kPong);
      p.seq = h->seq;
      p.off = h->off;
      send_frame(p);
      ++pings_;
    }
  }

  int fd_ = -1;
  bool closed_ = false;
  std::vector<char> in_;
  std::vector<FrameHeader> frames_;     // history
  std::vector<FrameHeader> unclaimed_;  // read by pump(), not yet returned by next()
  int pings_ = 0;
};

bool Child::next(Msg* m, int timeout_ms, FakePeer* pump) {
  const double end = now_ms() + timeout_ms;
  for (;;) {
    const double left = end - now_ms();
    if (!pump || !pump->is_open()) return read_msg(from_, m, left > 0 ? static_cast<int>(left) : 0);
    if (read_msg(from_, m, 0)) return true;
    if (left <= 0) return false;
    FakePeer::Read r = pump->pump(static_cast<int>(std::min(left, 5.0)) + 1);
    if (r == FakePeer::Read::kClosed || r == FakePeer::Read::kError)
      pump = nullptr;  // nothing left to answer: plain wait
  }
}

bool has(const std::string& log, const std::string& needle) {
  return log.find(needle) != std::string::npos;
}

std::vector<char> pattern(size_t n, uint64_t seed) {
  std::vector<char> v(n);
  rt::fill_pattern(v.data(), n, seed);
  return v;
}

FrameHeader data_header(uint64_t seq, uint32_t idx, uint32_t nchunks, uint64_t off, uint64_t total,
                        uint32_t len) {
  FrameHeader h = FakePeer::frame(FrameType::kData);
  h.seq = seq;
  h.a = idx;
  h.b = nchunks;
  h.off = off;
  h.total = total;
  h.len = len;
  return h;
}

auto is_frame(FrameType t, uint64_t seq) {
  return
      [t, seq](const FrameHeader& h) { return h.type == static_cast<uint8_t>(t) && h.seq == seq; };
}

// ------------------------------------------------------------------------------------------
// Child bodies.

// One receive into a guarded buffer:
//   "handle", "accepted", "posted", then "result" {rc, done, ms, pre_changed, post_changed,
//   written}; waits for "bye". Exits kExitCorrupted when memory outside the buffer changed.
struct RecvPlan {
  size_t cap = kCap;
  size_t post_pages = 0;  // readable canary pages between the buffer and the guard page
  bool heap = false;      // a plain heap buffer instead (AddressSanitizer case)
  int wait_ms = 8000;
};

int child_receive_one(ChildCtx& c, const RecvPlan& plan) {
  if (!c.listen_and_accept(10000)) return 10;
  GuardedBuffer gb(plan.cap, plan.post_pages);
  std::vector<char> heap;
  char* buf = gb.data();
  if (plan.heap) {
    heap.assign(plan.cap, static_cast<char>(kPoison));
    buf = heap.data();
  }
  if (!gb.ok()) return 11;
  void* req = nullptr;
  ncclResult_t r = c.post_recv(buf, plan.cap, &req);
  if (r != ncclSuccess) {
    c.say("post-failed", {r});
    return 12;
  }
  c.say("posted");
  ChildCtx::TestResult t = c.wait(req, plan.wait_ms);
  const size_t pre = gb.pre_changed(), post = gb.post_changed();
  const size_t written =
      plan.heap ? GuardedBuffer::count_not(buf, plan.cap, kPoison) : gb.written();
  c.say("result", {t.rc, t.done, static_cast<int64_t>(t.ms), static_cast<int64_t>(pre),
                   static_cast<int64_t>(post), static_cast<int64_t>(written)});
  Msg m;
  c.hear(&m, 10000);
  c.close_all();
  return pre || post ? kExitCorrupted : 0;
}

// ------------------------------------------------------------------------------------------
// Parent helpers for the receive cases.

struct ReceiveSession {
  std::unique_ptr<Child> child;
  FakePeer fake;
  WireHandle handle{};
};

// Starts a receiver child running `fn`, connects the fake as its sender and waits for the
// child's "posted" and the CTS of message 0 (capacity `cap`).
void start_session(ReceiveSession* s, const Env& env, const ChildFn& fn, uint64_t cap) {
  s->child = std::make_unique<Child>(env, fn);
  REQUIRE(s->child->started());
  Msg m;
  bool ok = s->child->expect("handle", &m, 10000);
  INFO(s->child->last_error() << "\nchild log:\n" << s->child->log());
  REQUIRE(ok);
  memcpy(&s->handle, m.data, sizeof(s->handle));
  std::string err;
  ok = s->fake.connect_as_sender(s->handle, &err) &&
       s->child->expect("accepted", &m, 5000, &s->fake) &&
       s->child->expect("posted", &m, 5000, &s->fake);
  INFO("setup: " << err << s->child->last_error() << "\nchild log:\n" << s->child->log());
  REQUIRE(ok);
  FrameHeader cts;
  REQUIRE(s->fake.wait_for(is_frame(FrameType::kCts, 0), 5000, &cts));
  CHECK(cts.total == cap);
}

void start_receive(ReceiveSession* s, const Env& env, const RecvPlan& plan) {
  start_session(
      s, env, [plan](ChildCtx& c) { return child_receive_one(c, plan); }, plan.cap);
}

struct Verdict {
  bool got = false;
  ncclResult_t rc = ncclSuccess;
  bool done = false;
  int64_t child_ms = 0;  // from posting the receive to test()'s verdict
  double parent_ms = 0;  // from the bad input to the verdict
  int64_t pre_changed = 0;
  int64_t post_changed = 0;
  int64_t written = 0;
};

Verdict await_result(ReceiveSession* s, int timeout_ms = 8000) {
  Verdict v;
  const double t0 = now_ms();
  Msg m;
  v.got = s->child->expect("result", &m, timeout_ms, &s->fake);
  v.parent_ms = now_ms() - t0;
  if (!v.got) return v;
  v.rc = static_cast<ncclResult_t>(m.v[0]);
  v.done = m.v[1] != 0;
  v.child_ms = m.v[2];
  v.pre_changed = m.v[3];
  v.post_changed = m.v[4];
  v.written = m.v[5];
  return v;
}

// Polls the child's logs until `needle` shows up (true) or timeout_ms passes.
bool wait_log(const Child& c, const std::string& needle, int timeout_ms) {
  const double end = now_ms() + timeout_ms;
  for (;;) {
    if (has(c.log(), needle)) return true;
    if (now_ms() > end) return false;
    sleep_ms(10);
  }
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif
#else
constexpr bool kAsan = false;
#endif

}  // namespace

// ==========================================================================================
// 1. Garbage handles.

TEST_CASE("bad input: garbage handles make connect fail with a WARN about the handle",
          "[bad_input]") {
  // The child connect()s with every handle the parent sends ("try" + 128 bytes) until connect
  // returns an error or a comm or 4 s pass, and answers "tried" {rc, got comm, calls, ms}.
  // "listen" makes it listen and answer "handle" (a real handle to corrupt).
  Child child({{"R2CCL_CONNECT_TIMEOUT", "1s"}}, [](ChildCtx& c) {
    Msg m;
    while (c.hear(&m, 30000)) {
      if (m.is("listen")) {
        char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
        ncclResult_t r = c.net->listen(c.ctx, 0, handle, &c.listen_comm);
        c.say("handle", {r}, handle, sizeof(handle));
        continue;
      }
      if (!m.is("try")) break;
      char handle[NCCL_NET_HANDLE_MAXSIZE];
      memcpy(handle, m.data, sizeof(handle));
      void* comm = nullptr;
      ncclResult_t r = ncclSuccess;
      int64_t calls = 0;
      const double t0 = now_ms();
      while (!comm && now_ms() - t0 < 4000) {
        r = c.net->connect(c.ctx, 0, handle, &comm, nullptr);
        ++calls;
        if (r != ncclSuccess) break;
        usleep(200);
      }
      c.say("tried", {r, comm != nullptr, calls, static_cast<int64_t>(now_ms() - t0)});
      if (comm) c.net->closeSend(comm);
    }
    c.close_all();
    return 0;
  });
  REQUIRE(child.started());

  WireHandle good{};
  good.magic = kHandleMagic;
  good.version = kWireVersion;
  good.kind = static_cast<uint8_t>(TransportKind::kTcp);
  good.n_endpoints = 1;
  good.endpoints[0].family = AF_INET;
  good.endpoints[0].port = htons(9);
  good.endpoints[0].addr[0] = 127;
  good.endpoints[0].addr[3] = 1;

  struct Variant {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string warn;    // besides "handle"
    bool tells = false;  // an r2ccl handle of another version: the listener is told first
  };
  const std::string not_ours = "not an r2ccl v" + std::to_string(kWireVersion) + " handle";
  std::vector<Variant> variants;
  auto as_bytes = [](const WireHandle& h) {
    std::vector<uint8_t> b(NCCL_NET_HANDLE_MAXSIZE, 0);
    memcpy(b.data(), &h, sizeof(h));
    return b;
  };
  {
    std::vector<uint8_t> b(NCCL_NET_HANDLE_MAXSIZE);
    rt::fill_pattern(b.data(), b.size(), 0xbad);
    variants.push_back({"random 128 bytes", b, not_ours});
  }
  variants.push_back({"all zero", std::vector<uint8_t>(NCCL_NET_HANDLE_MAXSIZE, 0), not_ours});
  {
    WireHandle h = good;
    h.n_endpoints = 9;
    variants.push_back({"valid magic, n_endpoints=9", as_bytes(h), "9 endpoints"});
  }
  {
    WireHandle h = good;
    h.n_endpoints = 0;
    variants.push_back({"valid magic, n_endpoints=0", as_bytes(h), "0 endpoints"});
  }
  {
    WireHandle h = good;
    h.endpoints[0].family = 77;
    variants.push_back({"valid magic, family 77", as_bytes(h), "address family 77"});
  }
  {
    WireHandle h = good;
    h.n_endpoints = 2;
    h.endpoints[1] = h.endpoints[0];
    h.endpoints[1].family = 77;
    variants.push_back({"second endpoint with family 77", as_bytes(h), "address family 77"});
  }
  {
    // Another wire version of r2ccl: the connector tells the handle's listener (nothing
    // listens at port 9: it cannot), then fails naming both versions.
    WireHandle h = good;
    h.version = kWireVersion + 1;
    variants.push_back({"valid magic, the next version", as_bytes(h),
                        "wire version mismatch (TCP): the connecting process speaks version " +
                            std::to_string(kWireVersion) + ", the listening process version " +
                            std::to_string(kWireVersion + 1),
                        true});
  }
  {
    WireHandle h = good;
    h.version = 2;  // before the common handle head: nobody to tell
    variants.push_back({"valid magic, version 2", as_bytes(h), "wire version 2", false});
  }

  for (const auto& v : variants) {
    INFO("handle: " << v.name);
    const size_t before = child.err_log().size();
    child.tell("try", {}, v.bytes.data(), v.bytes.size());
    Msg m;
    const bool ok = child.expect("tried", &m, 6000);
    INFO(child.last_error());
    REQUIRE(ok);
    const std::string log = child.err_log().substr(before);
    INFO("new log:\n" << log);
    CHECK(m.v[0] != ncclSuccess);      // an error, not a pending connect
    CHECK(m.v[1] == 0);                // no comm
    if (!v.tells) CHECK(m.v[2] == 1);  // refused on the first call
    CHECK(m.v[3] < (v.tells ? 2000 : 1000));
    CHECK(has(log, "WARN"));
    CHECK(has(log, v.tells ? "listening process" : "handle"));
    CHECK(has(log, v.warn));
  }

  SECTION("well-formed handle with a wrong secret: the listener says so, connect fails at once") {
    // A real handle of the child's own listener with the secret flipped: the listener refuses
    // the rail query and answers why; the connect fails with ncclRemoteError on the spot
    // (it was retried until R2CCL_CONNECT_TIMEOUT), naming the cause and the address.
    child.tell("listen");
    Msg m;
    REQUIRE(child.expect("handle", &m, 5000));
    REQUIRE(m.v[0] == ncclSuccess);
    m.data[offsetof(WireHandle, secret)] ^= 0xff;
    const size_t before = child.err_log().size();
    child.tell("try", {}, m.data, sizeof(m.data));
    REQUIRE(child.expect("tried", &m, 8000));
    const std::string log = child.err_log().substr(before);
    INFO("new log:\n" << log.substr(0, 4000));
    CHECK(m.v[0] == ncclRemoteError);
    CHECK(m.v[1] == 0);
    CHECK(m.v[3] < 900);  // well before the 1 s connect timeout
    CHECK_FALSE(has(log, "gave up after"));
    CHECK(has(log, "refused by the peer: wrong secret"));
    CHECK(has(log, "-> 127.0.0.1:"));
    CHECK(rt::count_lines_containing(log, "wrong secret") >= 1);
  }
  child.tell("bye");
  CHECK(child.wait_exit(5000) == 0);
}

// ==========================================================================================
// 2. Wrong secret on the listener.

namespace {
// listen, accept ("handle", "accepted"), then wait for "bye".
int child_accept_only(ChildCtx& c) {
  if (!c.listen_and_accept(15000)) return 10;
  Msg m;
  c.hear(&m, 10000);
  c.close_all();
  return 0;
}
}  // namespace

TEST_CASE("bad input: a hello with a wrong secret is refused and the listener survives",
          "[bad_input]") {
  Child child({}, child_accept_only);
  REQUIRE(child.started());
  Msg m;
  REQUIRE(child.expect("handle", &m, 10000));
  WireHandle h;
  memcpy(&h, m.data, sizeof(h));

  {
    FakePeer bad;
    REQUIRE(bad.dial(h));
    HelloBody b = FakePeer::hello_body(h, 0, 0x1111);
    b.secret[3] ^= 0x40;
    REQUIRE(bad.send_hello(b));
    // No HELLO_ACK: the cause (WireRefusal), then the close.
    WireRefusal r;
    REQUIRE(bad.wait_refusal(&r, 3000));
    CHECK(r.reason == static_cast<uint8_t>(Refusal::kWrongSecret));
    CHECK(r.from_connector == 0);
    CHECK(has(r.text, "wrong secret"));
    for (uint8_t x : r.secret) CHECK(x == 0);  // the listener never sends its secret
    CHECK(bad.wait_closed(3000));
    CHECK(bad.frames().empty());
    CHECK(wait_log(child, "wrong secret", 2000));
  }
  {
    // A wrong secret on a rail query too.
    FakePeer bad;
    REQUIRE(bad.dial(h));
    HelloBody b = FakePeer::hello_body(h, kHelloQuery, 0);
    b.secret[0] ^= 1;
    REQUIRE(bad.send_hello(b));
    WireRefusal r;
    REQUIRE(bad.wait_refusal(&r, 3000));
    CHECK(r.reason == static_cast<uint8_t>(Refusal::kWrongSecret));
    CHECK(bad.wait_closed(3000));
    CHECK(bad.frames().empty());
  }
  {
    // Another wire version's hello: refused, naming both versions.
    FakePeer bad;
    REQUIRE(bad.dial(h));
    REQUIRE(bad.send_hello(FakePeer::hello_body(h, kHelloQuery, 0), kWireVersion + 1));
    WireRefusal r;
    REQUIRE(bad.wait_refusal(&r, 3000));
    CHECK(r.reason == static_cast<uint8_t>(Refusal::kVersion));
    CHECK(has(r.text, "version " + std::to_string(kWireVersion + 1)));
    CHECK(bad.wait_closed(3000));
  }
  {
    // Not a hello at all.
    FakePeer bad;
    REQUIRE(bad.dial(h));
    std::vector<char> junk = pattern(sizeof(FrameHeader) + sizeof(HelloBody), 0x6a6e);
    REQUIRE(bad.send_raw(junk.data(), junk.size()));
    CHECK(bad.wait_closed(3000));
    CHECK(wait_log(child, "not an r2ccl hello", 2000));
  }
  {
    // Right secret, unknown listen id.
    FakePeer bad;
    REQUIRE(bad.dial(h));
    HelloBody b = FakePeer::hello_body(h, 0, 0x2222);
    b.listen_id ^= 0x5555;
    REQUIRE(bad.send_hello(b));
    WireRefusal r;
    REQUIRE(bad.wait_refusal(&r, 3000));
    CHECK(r.reason == static_cast<uint8_t>(Refusal::kUnknownListen));
    CHECK(bad.wait_closed(3000));
    CHECK(wait_log(child, "unknown listen id", 2000));
  }
  const std::string log = child.log();
  INFO("child log:\n" << log);
  // Two wrong-secret hellos within a second: the listener logs the first and counts the
  // second (at most one WARN a second per reason, so a hostile peer cannot flood the log).
  CHECK(rt::count_lines_containing(log, "wrong secret") == 1);
  CHECK(has(log, "WARN"));
  // accept() kept returning NULL: nothing from the child.
  CHECK_FALSE(child.next(&m, 300));

  // The listener survived: a correct connection still completes accept.
  FakePeer good;
  std::string err;
  const bool ok = good.connect_as_sender(h, &err) && child.expect("accepted", &m, 5000, &good);
  INFO(err << child.last_error());
  REQUIRE(ok);
  CHECK(m.v[0] > 0);  // accept() returned NULL meanwhile
  CHECK(child.finish() == 0);
}

// ==========================================================================================
// 3. Truncated and garbage frames after a correct setup.

TEST_CASE("bad input: truncated and garbage frames fail the receive with ncclRemoteError",
          "[bad_input]") {
  struct FrameCase {
    const char* name;
    std::vector<char> bytes;
    bool close_after;
    const char* cause;  // what the log must name
  };
  auto raw = [](const FrameHeader& h, size_t n = sizeof(FrameHeader), size_t payload = 0) {
    std::vector<char> b(sizeof(h) + payload, 0x33);
    memcpy(b.data(), &h, sizeof(h));
    b.resize(n + payload);
    return b;
  };
  std::vector<FrameCase> cases;
  cases.push_back({"20 bytes of a header, then close",
                   raw(data_header(0, 0, 16, 0, kCap, 4096), 20), true,
                   "peer closed the connection: end of file"});
  {
    FrameHeader h = data_header(0, 0, 16, 0, kCap, 4096);
    h.magic = 0xbeef;
    cases.push_back({"bad magic", raw(h), false, "protocol error: bad frame magic"});
  }
  {
    FrameHeader h = FakePeer::frame(FrameType::kPing);
    h.seq = 1;
    h.len = 8;
    cases.push_back({"control frame (PING) with len 8", raw(h, sizeof(h), 8), false,
                     "protocol error: control frame with a payload"});
  }
  {
    FrameHeader h = FakePeer::frame(FrameType::kPing);
    h.type = 0x77;
    cases.push_back(
        {"unknown frame type 0x77", raw(h), false, "protocol error: unknown frame type"});
  }
  {
    FrameHeader h = data_header(0, 0, 16, 0, kCap, kMaxFramePayload + 1);
    cases.push_back({"DATA longer than the largest chunk", raw(h), false,
                     "protocol error: chunk longer than the largest chunk size"});
  }
  {
    FrameHeader h = FakePeer::frame(FrameType::kCts);
    h.total = kCap;
    cases.push_back({"CTS sent to the receiving side", raw(h), false,
                     "protocol error: clear-to-send sent to the receiving side"});
  }

  for (const auto& fc : cases) {
    INFO("case: " << fc.name);
    ReceiveSession s;
    start_receive(&s, {}, RecvPlan{});
    REQUIRE(s.fake.send_raw(fc.bytes.data(), fc.bytes.size()));
    if (fc.close_after) s.fake.close();
    Verdict v = await_result(&s);
    const std::string log = s.child->log();
    INFO("child log:\n" << log);
    REQUIRE(v.got);
    CHECK(v.rc == ncclRemoteError);
    CHECK(v.parent_ms < 3000);
    CHECK(v.written == 0);
    CHECK(has(log, fc.cause));
    CHECK(has(log, "fail with ncclRemoteError"));
    if (!fc.close_after) CHECK(s.fake.wait_closed(2000));  // the plugin dropped the path
    CHECK(s.child->finish() == 0);
  }
}

// ==========================================================================================
// 4. Lying chunk headers: never a write outside the posted buffer.

TEST_CASE("bad input: lying chunk headers are protocol errors, never writes", "[bad_input]") {
  struct Lie {
    const char* name;
    std::vector<FrameHeader> frames;  // sent in order, each with its payload
    const char* cause;
    int64_t written;  // buffer bytes legitimately written before the lie
  };
  const uint32_t kChunk = 4096;
  std::vector<Lie> lies = {
      {"total larger than the posted capacity",
       {data_header(0, 0, 32, 0, 2 * kCap, kChunk)},
       "message larger than the posted receive",
       0},
      {"off + len beyond total (into the guard page)",
       {data_header(0, 15, 16, kCap - kChunk + 64, kCap, kChunk)},
       "chunk offset/length outside the message",
       0},
      {"offset that wraps around 2^64",
       {data_header(0, 1, 16, ~0ull - 1023, kCap, kChunk)},
       "chunk offset/length outside the message",
       0},
      {"chunk index == chunk count",
       {data_header(0, 16, 16, 0, kCap, kChunk)},
       "chunk index out of range",
       0},
      {"chunk count absurdly large",
       {data_header(0, 0, 1000000, 0, kCap, kChunk)},
       "chunk count does not fit the message size",
       0},
      {"chunk count 0",
       {data_header(0, 0, 0, 0, kCap, kChunk)},
       "chunk count does not fit the message size",
       0},
      {"total differs between two chunks",
       {data_header(0, 0, 16, 0, kCap, kChunk), data_header(0, 1, 16, kChunk, kCap / 2, kChunk)},
       "chunk header disagrees with earlier chunks",
       kChunk},
      {"chunk count differs between two chunks",
       {data_header(0, 0, 16, 0, kCap, kChunk), data_header(0, 1, 8, kChunk, kCap, kChunk)},
       "chunk header disagrees with earlier chunks",
       kChunk},
  };
  const std::vector<char> payload(kChunk, 0x11);
  for (const auto& lie : lies) {
    INFO("lie: " << lie.name);
    ReceiveSession s;
    start_receive(&s, {}, RecvPlan{});
    for (const auto& h : lie.frames) s.fake.send_frame(h, payload.data());  // may fail: closed
    Verdict v = await_result(&s);
    const std::string log = s.child->log();
    INFO("child log:\n" << log);
    REQUIRE(v.got);
    CHECK(v.rc == ncclRemoteError);
    CHECK(v.parent_ms < 3000);
    CHECK(v.pre_changed == 0);  // nothing before the buffer
    CHECK(v.written == lie.written);
    CHECK(has(log, std::string("protocol error: ") + lie.cause));
    CHECK(s.child->finish() == 0);  // 0: no canary changed, no crash
  }
}

// ==========================================================================================
// 5. The stale guard is what prevents the out-of-bounds write.

TEST_CASE("bad input: without the stale guard a lying header writes outside the buffer",
          "[bad_input]") {
  const uint32_t kChunk = 4096;
  const uint32_t kOver = 64;  // bytes beyond the end of the buffer
  const FrameHeader lie = data_header(0, 15, 16, kCap - kChunk + kOver, kCap, kChunk);
  const std::vector<char> payload(kChunk, 0x11);
  const Env no_guard = {{"R2CCL_TEST_HOOKS", "no_stale_guard"}};

  SECTION("readable canary page after the buffer: guard on -> refused, off -> written") {
    for (int hook = 0; hook < 2; ++hook) {
      INFO("R2CCL_TEST_HOOKS=" << (hook ? "no_stale_guard" : "(none)"));
      RecvPlan plan;
      plan.post_pages = 1;
      ReceiveSession s;
      start_receive(&s, hook ? no_guard : Env{}, plan);
      REQUIRE(s.fake.send_frame(lie, payload.data()));
      if (hook) {
        // The plugin took the lying chunk as landed (chunk 15 acknowledged); then the fake
        // goes away so the receive ends.
        FrameHeader ack;
        CHECK(s.fake.wait_for(is_frame(FrameType::kAck, 0), 3000, &ack));
        CHECK((ack.total >> 15 & 1) == 1);
        s.fake.close();
      }
      Verdict v = await_result(&s);
      const std::string log = s.child->log();
      INFO("child log:\n" << log);
      REQUIRE(v.got);
      CHECK(v.rc == ncclRemoteError);
      CHECK(v.pre_changed == 0);
      if (!hook) {
        CHECK(v.post_changed == 0);
        CHECK(has(log, "chunk offset/length outside the message"));
        CHECK(s.child->finish() == 0);
      } else {
        CHECK(v.post_changed == kOver);  // the stray bytes landed after the buffer
        CHECK(has(log, "protections are switched off"));
        CHECK(s.child->finish() == kExitCorrupted);  // the child did not exit cleanly
      }
    }
  }

  SECTION("buffer ends at a PROT_NONE page: the write is aimed into the guard page") {
    // recv() into a PROT_NONE page fails with EFAULT (the kernel writes, so no SIGSEGV): the
    // path fails with a socket error naming "Bad address" instead of the protocol error. The
    // chunk is two read stages long (8 KiB), so its end is read by recv() straight into the
    // buffer; a payload within one stage is copied from it by the plugin, and that copy would
    // fault in user space instead.
    constexpr uint32_t kLong = 8192;
    const FrameHeader lie_long = data_header(0, 7, 8, kCap - kLong + kOver, kCap, kLong);
    const std::vector<char> payload_long(kLong, 0x11);
    ReceiveSession s;
    start_receive(&s, no_guard, RecvPlan{});
    REQUIRE(s.fake.send_frame(lie_long, payload_long.data()));
    Verdict v = await_result(&s);
    const std::string log = s.child->log();
    INFO("child log:\n" << log);
    REQUIRE(v.got);
    CHECK(v.rc != ncclSuccess);
    CHECK_FALSE(has(log, "chunk offset/length outside the message"));
    CHECK(has(log, "Bad address"));
    CHECK(v.pre_changed == 0);
    s.child->finish();
  }

  if (kAsan) {
    SECTION("AddressSanitizer: heap buffer, the stray write aborts the child") {
      for (int hook = 0; hook < 2; ++hook) {
        INFO("R2CCL_TEST_HOOKS=" << (hook ? "no_stale_guard" : "(none)"));
        RecvPlan plan;
        plan.heap = true;
        ReceiveSession s;
        start_receive(&s, hook ? no_guard : Env{}, plan);
        REQUIRE(s.fake.send_frame(lie, payload.data()));
        if (hook) {
          const int st = s.child->wait_exit(10000);
          const std::string log = s.child->log();
          INFO("child log:\n" << log.substr(0, 6000));
          CHECK(st != 0);   // did not exit cleanly
          CHECK(st != -1);  // and did not hang
          CHECK(has(log, "AddressSanitizer"));
          CHECK(has(log, "heap-buffer-overflow"));
        } else {
          Verdict v = await_result(&s);
          INFO("child log:\n" << s.child->log());
          REQUIRE(v.got);
          CHECK(v.rc == ncclRemoteError);
          CHECK(s.child->finish() == 0);
        }
      }
    }
  }
}

// ==========================================================================================
// 6. Duplicate chunks are not counted twice.

namespace {
constexpr uint64_t kSeed6 = 0x6006;

// One 8 KiB receive; on completion reports whether the parent had announced chunk 1 yet.
// "result" {rc, done, ms, chunk 1 announced before done, bytes 4096.. still poison, all right}
int child_dedup(ChildCtx& c) {
  if (!c.listen_and_accept(10000)) return 10;
  GuardedBuffer gb(8192, 0);
  if (!gb.ok()) return 11;
  void* req = nullptr;
  if (c.post_recv(gb.data(), 8192, &req) != ncclSuccess) return 12;
  c.say("posted");
  ChildCtx::TestResult t = c.wait(req, 8000);
  const bool announced = c.heard("chunk1");
  const bool tail_poison = GuardedBuffer::count_not(gb.data() + 4096, 4096, kPoison) == 0;
  const bool all_right = rt::check_pattern(gb.data(), 8192, kSeed6) == -1;
  c.say("result", {t.rc, t.done, static_cast<int64_t>(t.ms), announced, tail_poison, all_right});
  Msg m;
  c.hear(&m, 10000);
  c.close_all();
  return gb.pre_changed() || gb.post_changed() ? kExitCorrupted : 0;
}
}  // namespace

TEST_CASE("bad input: a duplicate chunk does not complete the receive early", "[bad_input]") {
  const std::vector<char> msg = pattern(8192, kSeed6);
  for (int hook = 0; hook < 2; ++hook) {
    INFO("R2CCL_TEST_HOOKS=" << (hook ? "no_dedup" : "(none)"));
    // Real heartbeats: the fake must answer the pings through the 300 ms pause.
    Env env = {{"R2CCL_HEARTBEAT_INTERVAL", "100ms"}};
    if (hook) env.push_back({"R2CCL_TEST_HOOKS", "no_dedup"});
    ReceiveSession s;
    start_session(&s, env, child_dedup, 8192);
    FakePeer& f = s.fake;
    REQUIRE(f.send_data(0, 0, 2, 0, 8192, msg.data(), 4096));
    FrameHeader ack;
    REQUIRE(f.wait_for(is_frame(FrameType::kAck, 0), 3000, &ack));  // chunk 0 landed
    CHECK(ack.a == 1);
    REQUIRE(f.send_data(0, 0, 2, 0, 8192, msg.data(), 4096));  // the duplicate
    f.pump(300);
    bool complete_before_chunk1 = false;
    for (const auto& fr : f.frames())
      complete_before_chunk1 |=
          fr.type == static_cast<uint8_t>(FrameType::kAck) && fr.seq == 0 && fr.a == 2;
    s.child->tell("chunk1");
    f.send_data(0, 1, 2, 4096, 8192, msg.data() + 4096, 4096);  // may fail when already done
    Msg m;
    const bool ok = s.child->expect("result", &m, 5000, &f);
    const std::string log = s.child->log();
    INFO(s.child->last_error());
    REQUIRE(ok);
    INFO("child log:\n" << log);
    CHECK(m.v[0] == ncclSuccess);
    CHECK(m.v[1] == 1);
    CHECK(f.pings() > 0);  // heartbeats were answered
    if (!hook) {
      CHECK(m.v[3] == 1);  // done only after chunk 1 was announced
      CHECK(m.v[4] == 0);
      CHECK(m.v[5] == 1);  // every byte right
      CHECK_FALSE(complete_before_chunk1);
      // The final ACK says every chunk landed.
      CHECK(f.wait_for(
          [](const FrameHeader& h) {
            return h.type == static_cast<uint8_t>(FrameType::kAck) && h.seq == 0 && h.a == 2;
          },
          2000));
    } else {
      CHECK(m.v[3] == 0);  // done before chunk 1 was even sent
      CHECK(m.v[4] == 1);  // bytes 4096..8191 never written
      CHECK(m.v[5] == 0);
      CHECK(complete_before_chunk1);  // the sender was told "all landed" too
    }
    CHECK(s.child->finish() == 0);
  }
}

// ==========================================================================================
// 7. Stale data for a completed message is discarded and acknowledged.

namespace {
constexpr uint64_t kSeed7a = 0x7000, kSeed7b = 0x7001;

int child_stale(ChildCtx& c) {
  if (!c.listen_and_accept(10000)) return 10;
  GuardedBuffer b0(8192, 0), b1(8192, 0);
  if (!b0.ok() || !b1.ok()) return 11;
  void* r0 = nullptr;
  void* r1 = nullptr;
  if (c.post_recv(b0.data(), 8192, &r0) != ncclSuccess) return 12;
  c.say("posted");
  ChildCtx::TestResult t0 = c.wait(r0, 8000);
  if (t0.rc != ncclSuccess || !t0.done) {
    c.say("result0", {t0.rc, t0.done});
    return 13;
  }
  if (c.post_recv(b1.data(), 8192, &r1) != ncclSuccess) return 14;
  c.say("posted1", {rt::check_pattern(b0.data(), 8192, kSeed7a) == -1});
  Msg m;
  if (!c.hear(&m, 10000) || !m.is("stale-sent")) return 15;
  ChildCtx::TestResult t1 = c.wait(r1, 200);  // not done: nothing of message 1 sent yet
  c.say("check", {t1.rc, t1.done, rt::check_pattern(b0.data(), 8192, kSeed7a) == -1,
                  static_cast<int64_t>(b1.written())});
  t1 = c.wait(r1, 8000);
  c.say("result", {t1.rc, t1.done, t1.size, rt::check_pattern(b1.data(), 8192, kSeed7b) == -1});
  c.hear(&m, 10000);
  c.close_all();
  const bool bad = b0.pre_changed() || b0.post_changed() || b1.pre_changed() || b1.post_changed();
  return bad ? kExitCorrupted : 0;
}
}  // namespace

TEST_CASE("bad input: stale chunks of a completed message are discarded and acknowledged",
          "[bad_input]") {
  const std::vector<char> m0 = pattern(8192, kSeed7a), m1 = pattern(8192, kSeed7b);
  const std::vector<char> junk(4096, static_cast<char>(0xee));
  ReceiveSession s;
  start_session(&s, {}, child_stale, 8192);
  FakePeer& f = s.fake;
  REQUIRE(f.send_data(0, 0, 2, 0, 8192, m0.data(), 4096));
  REQUIRE(f.send_data(0, 1, 2, 4096, 8192, m0.data() + 4096, 4096));
  auto full_ack0 = [](const FrameHeader& h) {
    return h.type == static_cast<uint8_t>(FrameType::kAck) && h.seq == 0 && h.a == 2;
  };
  REQUIRE(f.wait_for(full_ack0, 3000));
  Msg m;
  REQUIRE(s.child->expect("posted1", &m, 5000, &f));
  CHECK(m.v[0] == 1);  // message 0 arrived intact
  REQUIRE(f.wait_for(is_frame(FrameType::kCts, 1), 3000));

  // Chunk 0 of message 0 again, with other bytes: discarded, answered with a full ACK.
  REQUIRE(f.send_data(0, 0, 2, 0, 8192, junk.data(), 4096));
  FrameHeader ack;
  CHECK(f.wait_for(full_ack0, 3000, &ack));
  CHECK(ack.a == 2);
  s.child->tell("stale-sent");
  REQUIRE(s.child->expect("check", &m, 5000, &f));
  CHECK(m.v[0] == ncclSuccess);
  CHECK(m.v[1] == 0);  // message 1 not completed by it
  CHECK(m.v[2] == 1);  // message 0's buffer untouched
  CHECK(m.v[3] == 0);  // message 1's buffer untouched

  // The connection still works: message 1 arrives normally.
  REQUIRE(f.send_data(1, 0, 2, 0, 8192, m1.data(), 4096));
  REQUIRE(f.send_data(1, 1, 2, 4096, 8192, m1.data() + 4096, 4096));
  REQUIRE(s.child->expect("result", &m, 5000, &f));
  const std::string log = s.child->log();
  INFO("child log:\n" << log);
  CHECK(m.v[0] == ncclSuccess);
  CHECK(m.v[1] == 1);
  CHECK(m.v[2] == 8192);
  CHECK(m.v[3] == 1);
  CHECK_FALSE(has(log, "protocol error"));
  CHECK(s.child->finish() == 0);
}

// ==========================================================================================
// 8. DATA for a message that has no clear-to-send.

TEST_CASE("bad input: data for a message without a CTS is a protocol error", "[bad_input]") {
  const std::vector<char> payload(4096, 0x22);
  for (uint64_t seq : {uint64_t{1}, uint64_t{1000}, ~uint64_t{0}}) {
    INFO("DATA for message " << seq << " (only message 0 posted)");
    ReceiveSession s;
    start_receive(&s, {}, RecvPlan{});
    s.fake.send_data(seq, 0, 16, 0, kCap, payload.data(), 4096);
    Verdict v = await_result(&s);
    const std::string log = s.child->log();
    INFO("child log:\n" << log);
    REQUIRE(v.got);
    CHECK(v.rc == ncclRemoteError);
    CHECK(v.parent_ms < 3000);
    CHECK(v.written == 0);
    CHECK(has(log, "protocol error: data for a message that has no clear-to-send"));
    CHECK(s.child->finish() == 0);
  }
}

// ==========================================================================================
// 9. Path hellos that disagree with the first one.

TEST_CASE("bad input: a later path hello that disagrees with the first is handled safely",
          "[bad_input]") {
  // The first hello of a connection declares 2 paths and 1 rail; the second (path 1) claims
  // 16 rails and rail 10. The acceptor must not index its 1-entry peer rail table with 10.
  Child child({}, child_accept_only);
  REQUIRE(child.started());
  Msg m;
  REQUIRE(child.expect("handle", &m, 10000));
  WireHandle h;
  memcpy(&h, m.data, sizeof(h));
  const uint64_t conn_id = 0x9a9a9a9a12345678ull;
  FakePeer p0, p1;
  for (int path = 0; path < 2; ++path) {
    FakePeer& f = path ? p1 : p0;
    REQUIRE(f.dial(h));
    HelloBody b = FakePeer::hello_body(h, 0, conn_id);
    b.n_paths = 2;
    b.path = static_cast<uint32_t>(path);
    if (path == 1) {
      b.n_rails = kMaxRails;
      b.rail = 10;
      for (uint32_t r = 1; r < kMaxRails; ++r) b.rails[r] = b.rails[0];
    }
    REQUIRE(f.send_hello(b));
    FrameHeader a;
    std::vector<char> body;
    REQUIRE(f.read_frame(&a, &body, 3000) == FakePeer::Read::kFrame);
    CHECK(a.type == static_cast<uint8_t>(FrameType::kHelloAck));
  }
  FrameHeader sd = FakePeer::frame(FrameType::kSetupDone);
  sd.a = 2;
  sd.total = 3;
  REQUIRE(p0.send_frame(sd));
  const bool accepted = child.expect("accepted", &m, 5000, &p0);
  const int st = child.finish();
  INFO(child.last_error() << "\nchild log:\n" << child.log());
  CHECK(accepted);
  CHECK(st == 0);
}
