// LinkMonitor and link_is_up.
//  [unit]: libnl loads here; open/fd/drain/close life cycle; link_is_up("lo"); a missing libnl
//          (injected library names) makes open() fail with exactly one WARN.
//  [lab]:  needs root and `ip netns add`: a veth pair in a fresh network namespace; a forked child
//          joins the namespace, remounts /sys for it and runs the monitor while this process
//          changes the links with `ip -n NS ...`. Measures event latency after `ip link set down`,
//          and checks carrier loss on the peer, link up, removal (RTM_DELLINK) and the sysfs
//          resync after a receive-buffer overflow. Skipped with a WARN where namespaces cannot
//          be made.
#include <fcntl.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "netlink/link_monitor.h"
#include "r2ccl/clock.h"
#include "r2ccl/log.h"

using Catch::Matchers::Contains;
using r2ccl::TimeUs;
using r2ccl::net::link_is_up;
using r2ccl::net::LinkMonitor;

namespace {

// Captures WARNs through the NCCL logger hook (so none reach stderr) while alive.
std::mutex g_warn_mu;
std::vector<std::string> g_warns;

void capture_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt,
                    ...) {
  if (level != NCCL_LOG_WARN) return;
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_warn_mu);
  g_warns.emplace_back(buf);
}

class WarnCapture {
 public:
  WarnCapture() {
    std::lock_guard<std::mutex> lk(g_warn_mu);
    g_warns.clear();
    r2ccl::set_nccl_logger(&capture_logger);
  }
  ~WarnCapture() { r2ccl::set_nccl_logger(nullptr); }
  std::vector<std::string> warns() const {
    std::lock_guard<std::mutex> lk(g_warn_mu);
    return g_warns;
  }
};

// Restores the default libnl names however the test ends.
struct DefaultLibNames {
  ~DefaultLibNames() { LinkMonitor::set_library_names_for_testing("", ""); }
};

}  // namespace

TEST_CASE("LinkMonitor: libnl is available on this host", "[unit]") {
  std::string why = "unset";
  REQUIRE(LinkMonitor::library_available(&why));
  CHECK(why.empty());
  CHECK(LinkMonitor::library_available(nullptr));
}

TEST_CASE("LinkMonitor: open, fd, drain, close", "[unit]") {
  WarnCapture cap;
  std::vector<LinkMonitor::Event> ev;
  LinkMonitor m;
  CHECK(m.fd() == -1);
  m.drain(&ev);  // not open: no-op
  CHECK(ev.empty());
  m.close();  // not open: no-op

  REQUIRE(m.open());
  const int fd = m.fd();
  REQUIRE(fd >= 0);
  CHECK((fcntl(fd, F_GETFL) & O_NONBLOCK) != 0);
  CHECK((fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);
  CHECK(m.open());  // already open
  CHECK(m.fd() == fd);
  CHECK(m.resyncs() == 0);

  // Nothing (or only whatever the host's links happen to do) is pending: returns at once.
  const TimeUs t0 = r2ccl::now_us();
  m.drain(&ev);
  CHECK(r2ccl::now_us() - t0 < 100 * r2ccl::kUsPerMs);
  m.drain(nullptr);  // tolerated

  m.close();
  CHECK(m.fd() == -1);
  errno = 0;
  CHECK(fcntl(fd, F_GETFD) == -1);
  CHECK(errno == EBADF);
  m.close();  // idempotent
  m.drain(&ev);

  REQUIRE(m.open());  // reopen after close
  CHECK(m.fd() >= 0);

  int fd2 = -1;
  {
    LinkMonitor m2;  // a second monitor in the same process
    REQUIRE(m2.open());
    fd2 = m2.fd();
    CHECK(fd2 != m.fd());
  }
  errno = 0;
  CHECK(fcntl(fd2, F_GETFD) == -1);  // the destructor closed it
  CHECK(errno == EBADF);
  CHECK(cap.warns().empty());
}

TEST_CASE("link_is_up reads sysfs", "[unit]") {
  CHECK(link_is_up("lo"));  // operstate "unknown", IFF_UP, carrier 1
  CHECK_FALSE(link_is_up("r2lm-nosuch0"));
  CHECK_FALSE(link_is_up(""));
  CHECK_FALSE(link_is_up("."));
  CHECK_FALSE(link_is_up(".."));
  CHECK_FALSE(link_is_up("../net/lo"));
  CHECK_FALSE(link_is_up("lo/"));
  CHECK_FALSE(link_is_up("a-name-far-too-long-for-ifnamsiz"));
}

TEST_CASE("LinkMonitor: missing libnl disables the monitor with one WARN", "[unit]") {
  DefaultLibNames restore;
  WarnCapture cap;
  std::vector<LinkMonitor::Event> ev;

  SECTION("library not found") {
    LinkMonitor::set_library_names_for_testing("libr2ccl-test-absent-nl.so.200", "");
    std::string why;
    CHECK_FALSE(LinkMonitor::library_available(&why));
    CHECK_THAT(why, Contains("libr2ccl-test-absent-nl.so.200") && Contains("not found"));
    CHECK(cap.warns().empty());  // asking does not warn
    for (int i = 0; i < 3; ++i) {
      LinkMonitor m;
      CHECK_FALSE(m.open());
      CHECK(m.fd() == -1);
      m.drain(&ev);
      m.close();
    }
    CHECK(ev.empty());
    const auto w = cap.warns();
    REQUIRE(w.size() == 1);
    CHECK_THAT(w[0], Contains("link notifications disabled") &&
                         Contains("libr2ccl-test-absent-nl.so.200 not found") &&
                         Contains("socket errors") && Contains("heartbeats") &&
                         Contains("acknowledgement watchdog"));
  }

  SECTION("symbol missing") {
    // A real library that lacks the libnl-route symbols.
    LinkMonitor::set_library_names_for_testing("", "libc.so.6");
    std::string why;
    CHECK_FALSE(LinkMonitor::library_available(&why));
    CHECK_THAT(why, Contains("symbol rtnl_link_get_ifindex missing from libc.so.6"));
    LinkMonitor a, b;
    CHECK_FALSE(a.open());
    CHECK_FALSE(b.open());
    const auto w = cap.warns();
    REQUIRE(w.size() == 1);
    CHECK_THAT(
        w[0], Contains("link notifications disabled") && Contains("symbol") && Contains("missing"));
  }

  // Back to the real libraries: works again.
  LinkMonitor::set_library_names_for_testing("", "");
  REQUIRE(LinkMonitor::library_available(nullptr));
  LinkMonitor m;
  CHECK(m.open());
}

// ---------------------------------------------------------------------------------------------
// Lab tests.

namespace {

int sh(const std::string& cmd) {
  int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  return rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

// A network namespace with a veth pair r2lm0 <-> r2lm1, both up; removed on destruction.
class LabNetns {
 public:
  LabNetns() : name_("r2lm-test-" + std::to_string(getpid())) {}
  ~LabNetns() {
    if (created_) sh("ip netns del " + name_);
  }
  // False, with the reason, where this host cannot make one.
  bool create(std::string* why) {
    if (geteuid() != 0) {
      *why = "not root";
      return false;
    }
    sh("ip netns del " + name_);  // leftover of a killed run with the same pid
    if (sh("ip netns add " + name_) != 0) {
      *why = "`ip netns add " + name_ + "` failed";
      return false;
    }
    created_ = true;
    if (ip("link add r2lm0 type veth peer name r2lm1") != 0 || ip("link set r2lm0 up") != 0 ||
        ip("link set r2lm1 up") != 0) {
      *why = "cannot create a veth pair in " + name_;
      return false;
    }
    return true;
  }
  int ip(const std::string& args) const { return sh("ip -n " + name_ + " " + args); }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  bool created_ = false;
};

bool write_line(int fd, const std::string& s) {
  std::string l = s + "\n";
  return write(fd, l.data(), l.size()) == static_cast<ssize_t>(l.size());
}

// Blocking; false on EOF.
bool read_line(int fd, std::string* out) {
  out->clear();
  char c;
  for (;;) {
    ssize_t n = read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    if (c == '\n') return true;
    out->push_back(c);
  }
}

// Child side: join the namespace and give it its own /sys (what `ip netns exec` does).
// Returns an error text, or "" on success; *sysfs tells whether /sys now shows the namespace.
std::string child_enter(const std::string& ns, bool* sysfs) {
  *sysfs = false;
  int nsfd = open(("/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
  if (nsfd < 0) return "open /run/netns: " + std::string(strerror(errno));
  int rc = setns(nsfd, CLONE_NEWNET);
  close(nsfd);
  if (rc != 0) return "setns: " + std::string(strerror(errno));
  *sysfs = unshare(CLONE_NEWNS) == 0 &&
           mount("none", "/", "none", MS_SLAVE | MS_REC, nullptr) == 0 &&
           umount2("/sys", MNT_DETACH) == 0 && mount("sysfs", "/sys", "sysfs", 0, nullptr) == 0;
  return "";
}

// Collects events until, for every name in `want`, an event with that name satisfying `match`
// was seen, or the deadline passes. Records the first matching event time per name.
template <typename Match>
void wait_events(LinkMonitor* m, const std::vector<std::string>& want, TimeUs deadline, Match match,
                 std::map<std::string, TimeUs>* first, std::vector<LinkMonitor::Event>* all) {
  for (;;) {
    bool done = true;
    for (const auto& w : want) done = done && first->count(w);
    TimeUs now = r2ccl::now_us();
    if (done || now >= deadline) return;
    pollfd p{m->fd(), POLLIN, 0};
    poll(&p, 1, static_cast<int>((deadline - now) / r2ccl::kUsPerMs) + 1);
    std::vector<LinkMonitor::Event> ev;
    m->drain(&ev);
    for (const auto& e : ev) {
      if (match(e) && !first->count(e.ifname)) (*first)[e.ifname] = e.when;
      all->push_back(e);
    }
  }
}

// Sets or clears IFF_UP with the classic ioctl, in the caller's network namespace.
bool set_admin_up(const char* ifname, bool up) {
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) return false;
  ifreq ifr{};
  std::snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname);
  bool ok = ioctl(s, SIOCGIFFLAGS, &ifr) == 0;
  if (ok) {
    ifr.ifr_flags = static_cast<short>(up ? (ifr.ifr_flags | IFF_UP) : (ifr.ifr_flags & ~IFF_UP));
    ok = ioctl(s, SIOCSIFFLAGS, &ifr) == 0;
  }
  int saved = errno;
  close(s);
  errno = saved;
  return ok;
}

enum class Scenario { kTransitions, kOverflow };

// The child: reports "key value" lines on `res`, takes "go <t_before_us>" lines from `cmd`.
[[noreturn]] void child_main(const std::string& ns, Scenario sc, int cmd, int res) {
  alarm(60);  // never outlive a wedged parent
  auto say = [res](const std::string& k, long long v) {
    write_line(res, k + " " + std::to_string(v));
  };
  bool sysfs = false;
  std::string err = child_enter(ns, &sysfs);
  if (!err.empty()) {
    write_line(res, "error " + err);
    _exit(2);
  }
  say("sysfs", sysfs);
  LinkMonitor m;
  const bool opened = sc == Scenario::kOverflow ? m.open(1) : m.open();
  say("open", opened);
  if (!opened) _exit(3);
  if (sysfs) {
    // A veth's carrier comes on asynchronously once both ends are up: the kernel's linkwatch
    // batches such non-urgent changes, up to a second apart (net/core/link_watch.c), so a
    // read right after `ip link set up` may still say down on a busy host (a fresh-clone CI
    // run read 0 here). Wait for it, up to 3 s.
    bool up = false;
    for (int i = 0; i < 300 && !(up = link_is_up("r2lm0")); ++i) usleep(10000);
    say("init_r2lm0_up", up);
  }
  std::vector<LinkMonitor::Event> all;
  m.drain(&all);
  all.clear();
  if (sc == Scenario::kTransitions) {
    // The monitor's own latency: from the return of the ioctl that changes the flags to the
    // event coming out of drain(), no process start in between.
    const std::vector<std::string> own{"r2lm0"};
    for (bool up : {false, true}) {
      if (!set_admin_up("r2lm0", up)) {
        write_line(res, "error SIOCSIFFLAGS: " + std::string(strerror(errno)));
        _exit(5);
      }
      const TimeUs t = r2ccl::now_us();
      std::map<std::string, TimeUs> first;
      wait_events(
          &m, own, t + r2ccl::kUsPerSec, [up](const LinkMonitor::Event& e) { return e.up == up; },
          &first, &all);
      say(up ? "self_up_us" : "self_down_us", first.count("r2lm0") ? first["r2lm0"] - t : -1);
    }
    all.clear();
  }
  write_line(res, "ready");

  std::string line;
  auto next_go = [&](TimeUs* t) {
    if (!read_line(cmd, &line) || line.rfind("go ", 0) != 0) _exit(4);
    *t = std::atoll(line.c_str() + 3);
  };
  const std::vector<std::string> both{"r2lm0", "r2lm1"};
  TimeUs t = 0;

  if (sc == Scenario::kTransitions) {
    struct Step {
      const char* key;
      bool up;
      bool removed;
    };
    for (const Step& s :
         {Step{"down", false, false}, Step{"up", true, false}, Step{"del", false, true}}) {
      next_go(&t);
      std::map<std::string, TimeUs> first;
      wait_events(
          &m, both, t + 3 * r2ccl::kUsPerSec,
          [&](const LinkMonitor::Event& e) { return e.up == s.up && (!s.removed || e.removed); },
          &first, &all);
      for (const auto& n : both) {
        say(std::string(s.key) + "_" + n + "_us", first.count(n) ? first[n] - t : -1);
      }
      if (sysfs && !s.removed) {
        say(std::string(s.key) + "_sysfs_r2lm0", link_is_up("r2lm0"));
        say(std::string(s.key) + "_sysfs_r2lm1", link_is_up("r2lm1"));
      }
      write_line(res, "step_done");
    }
    say("resyncs", static_cast<long long>(m.resyncs()));
  } else {
    next_go(&t);  // the parent has flapped r2lm0 many times without us reading
    std::vector<LinkMonitor::Event> ev;
    m.drain(&ev);
    say("events", static_cast<long long>(ev.size()));
    say("resyncs", static_cast<long long>(m.resyncs()));
    int last_up = -1;
    for (const auto& e : ev)
      if (e.ifname == "r2lm0") last_up = e.up;
    say("last_r2lm0_up", last_up);
    write_line(res, "step_done");
  }
  m.close();
  _exit(0);
}

// Parent side of one child run.
class Child {
 public:
  Child(const std::string& ns, Scenario sc) {
    int c[2], r[2];
    if (pipe2(c, O_CLOEXEC) != 0 || pipe2(r, O_CLOEXEC) != 0) return;
    fflush(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      close(c[1]);
      close(r[0]);
      child_main(ns, sc, c[0], r[1]);
    }
    close(c[0]);
    close(r[1]);
    cmd_ = c[1];
    res_ = r[0];
  }
  ~Child() {
    if (cmd_ >= 0) close(cmd_);
    if (res_ >= 0) close(res_);
    if (pid_ > 0) {
      int st = 0;
      // Give it a moment to finish on its own, then kill it (by its pid: we forked it).
      for (int i = 0; i < 200 && waitpid(pid_, &st, WNOHANG) == 0; ++i) usleep(10000);
      if (waitpid(pid_, &st, WNOHANG) == 0) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &st, 0);
      }
    }
  }
  // Reads "key value" lines into results until `until` (true) or EOF/error line (false).
  bool read_until(const std::string& until) {
    std::string l;
    while (read_line(res_, &l)) {
      if (l == until) return true;
      if (l.rfind("error ", 0) == 0) {
        error = l.substr(6);
        return false;
      }
      auto sp = l.find(' ');
      if (sp != std::string::npos) results[l.substr(0, sp)] = std::atoll(l.c_str() + sp + 1);
    }
    return false;
  }
  void go(TimeUs t) { write_line(cmd_, "go " + std::to_string(t)); }
  long long get(const std::string& k) const {
    auto it = results.find(k);
    return it == results.end() ? -2 : it->second;
  }

  std::map<std::string, long long> results;
  std::string error;

 private:
  pid_t pid_ = -1;
  int cmd_ = -1, res_ = -1;
};

}  // namespace

TEST_CASE("LinkMonitor: veth down/up/delete in a namespace arrive within 1 s", "[lab]") {
  REQUIRE(LinkMonitor::library_available(nullptr));
  LabNetns ns;
  std::string why;
  if (!ns.create(&why)) {
    WARN("skipped: " << why);
    return;
  }
  Child child(ns.name(), Scenario::kTransitions);
  REQUIRE(child.read_until("ready"));
  REQUIRE(child.get("open") == 1);
  const bool sysfs = child.get("sysfs") == 1;
  if (sysfs) CHECK(child.get("init_r2lm0_up") == 1);
  std::printf("[lab] ioctl IFF_UP off/on in the child: event out of drain() after %lld / %lld us\n",
              child.get("self_down_us"), child.get("self_up_us"));
  CHECK(child.get("self_down_us") >= 0);
  CHECK(child.get("self_down_us") < r2ccl::kUsPerSec);
  CHECK(child.get("self_up_us") >= 0);
  CHECK(child.get("self_up_us") < r2ccl::kUsPerSec);

  struct Step {
    const char* key;
    const char* cmd;
  };
  for (const Step& s : {Step{"down", "link set r2lm0 down"}, Step{"up", "link set r2lm0 up"},
                        Step{"del", "link del r2lm0"}}) {
    const TimeUs t = r2ccl::now_us();
    child.go(t);
    REQUIRE(ns.ip(s.cmd) == 0);
    const TimeUs ip_us = r2ccl::now_us() - t;
    REQUIRE(child.read_until("step_done"));
    const long long own = child.get(std::string(s.key) + "_r2lm0_us");
    const long long peer = child.get(std::string(s.key) + "_r2lm1_us");
    std::printf(
        "[lab] ip %-22s: r2lm0 event after %lld us, peer r2lm1 after %lld us "
        "(the ip command itself took %lld us)\n",
        s.cmd, own, peer, static_cast<long long>(ip_us));
    CHECK(own >= 0);
    CHECK(own < r2ccl::kUsPerSec);
    CHECK(peer >= 0);  // the peer's carrier change (down, up) or removal
    if (sysfs && std::string(s.key) != "del") {
      const int want = std::string(s.key) == "up";
      CHECK(child.get(std::string(s.key) + "_sysfs_r2lm0") == want);
      CHECK(child.get(std::string(s.key) + "_sysfs_r2lm1") == want);  // carrier follows peer
    }
  }
  child.read_until("");  // to EOF: collects the trailing results
  CHECK(child.get("resyncs") == 0);
  if (!sysfs) WARN("could not remount /sys in the namespace: sysfs checks skipped");
}

TEST_CASE("LinkMonitor: lost notifications are resynced from sysfs", "[lab]") {
  REQUIRE(LinkMonitor::library_available(nullptr));
  LabNetns ns;
  std::string why;
  if (!ns.create(&why)) {
    WARN("skipped: " << why);
    return;
  }
  Child child(ns.name(), Scenario::kOverflow);
  REQUIRE(child.read_until("ready"));
  REQUIRE(child.get("open") == 1);
  if (child.get("sysfs") != 1) {
    WARN("skipped: cannot remount /sys inside the namespace");
    return;
  }
  // Flap r2lm0 many times with one ip process, ending up, while the child does not read.
  char path[] = "/tmp/r2lm-batch-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  std::string batch;
  for (int i = 0; i < 50; ++i) batch += "link set r2lm0 down\nlink set r2lm0 up\n";
  REQUIRE(write(fd, batch.data(), batch.size()) == static_cast<ssize_t>(batch.size()));
  close(fd);
  const int rc = ns.ip(std::string("-batch ") + path);
  unlink(path);
  REQUIRE(rc == 0);
  usleep(100 * 1000);  // let linkwatch settle the final operstate
  child.go(r2ccl::now_us());
  REQUIRE(child.read_until("step_done"));
  std::printf("[lab] overflow: %lld events, %lld resyncs after 100 flaps\n", child.get("events"),
              child.get("resyncs"));
  CHECK(child.get("resyncs") >= 1);
  CHECK(child.get("last_r2lm0_up") == 1);
}
