// etcd TLS and etcd authentication, against a real etcd on 127.0.0.1 (tests/support/
// etcd_fixture.h, TLS mode: a test CA, etcd's certificate and a client certificate made with
// openssl at start). The etcd client (snapshot/include/r2ccl/snapshot/etcd.h) over https with
// a client certificate; with authentication on, the right password, a wrong one and none; the
// TLS refusals (no client certificate, a CA that did not sign etcd's certificate), which must
// name the endpoint and end within the client's timeout; and r2ccl_snapshotd registering
// through --etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file, or logging a
// wrong password by name.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "etcd_fixture.h"
#include "net_harness.h"
#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/etcd.h"

using namespace r2ccl;
namespace etcd = r2ccl::snap::etcd;
using Catch::Contains;
using Transport = test::EtcdCluster::Transport;

namespace {

const char* kRootPassword = "r2ccl-test-root-pw";

// A started etcd (REQUIREd), in TLS mode, optionally with authentication on.
void start_etcd(test::EtcdCluster& etcd, bool auth) {
  std::string err;
  const bool up = etcd.start(&err);
  INFO(err);
  REQUIRE(up);
  if (auth) {
    const bool on = etcd.enable_auth(kRootPassword, &err);
    INFO(err);
    REQUIRE(on);
  }
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Every operation the daemon's control plane uses, on keys under `p`: put, range, a
// transaction (both branches), a lease (grant, keep-alive, a key on it, revoke).
void check_operations(etcd::Client& c, const std::string& p) {
  etcd::Status s = c.put(p + "a", "one");
  INFO(s.message);
  REQUIRE(s.ok());
  std::vector<etcd::KeyValue> kv;
  REQUIRE(c.range(p + "a", "", &kv).ok());
  REQUIRE(kv.size() == 1);
  CHECK(kv[0].value == "one");

  // Create-if-absent: the first transaction creates p/b and reads p/a, the second finds p/b.
  const etcd::Compare absent{etcd::Compare::kCreate, etcd::Compare::kEqual, p + "b", 0, ""};
  const etcd::Op put_b{etcd::Op::kPut, p + "b", "two", "", 0};
  const etcd::Op get_a{etcd::Op::kRange, p + "a", "", "", 0};
  etcd::TxnResult tr;
  s = c.txn({absent}, {put_b, get_a}, {}, &tr);
  REQUIRE(s.ok());
  CHECK(tr.succeeded);
  REQUIRE(tr.ranges.size() == 1);
  REQUIRE(tr.ranges[0].size() == 1);
  CHECK(tr.ranges[0][0].value == "one");
  REQUIRE(c.txn({absent}, {put_b}, {}, &tr).ok());
  CHECK_FALSE(tr.succeeded);

  int64_t lease = 0, ttl = 0;
  s = c.lease_grant(30, &lease);
  REQUIRE(s.ok());
  CHECK(lease != 0);
  REQUIRE(c.put(p + "leased", "x", lease).ok());
  REQUIRE(c.lease_keepalive(lease, &ttl).ok());
  CHECK(ttl > 0);
  REQUIRE(c.lease_revoke(lease).ok());
  REQUIRE(c.range(p, etcd::prefix_end(p), &kv).ok());
  CHECK(kv.size() == 2);  // p/a and p/b; p/leased went with its lease
}

}  // namespace

TEST_CASE("etcd TLS: put, get, a transaction and a lease over https with a client certificate",
          "[snapshot][etcd]") {
  test::EtcdCluster etcd("etcdtls", 1, Transport::kTls);
  start_etcd(etcd, false);
  CHECK_THAT(etcd.endpoints(), Catch::StartsWith("https://127.0.0.1:"));
  const etcd::Options o = etcd.client_options();
  CHECK(!o.ca_file.empty());
  CHECK(!o.cert_file.empty());
  CHECK(o.user.empty());
  etcd::Client c(o);
  check_operations(c, "/tls/");
  // The fixture's own reader goes over TLS too.
  std::string v;
  CHECK(etcd.get("/tls/b", &v));
  CHECK(v == "two");
  CHECK(etcd.get_prefix("/tls/").size() == 2);
}

TEST_CASE(
    "etcd TLS: no client certificate, or a CA that did not sign etcd's, is refused by name "
    "within the timeout",
    "[snapshot][etcd]") {
  test::EtcdCluster etcd("etcdtlsno", 1, Transport::kTls);
  start_etcd(etcd, false);
  const std::string ep = etcd.endpoint(0);
  constexpr int kTimeoutMs = 1000;
  // A bound for "did not hang": the client's timeout plus room for a loaded 2-core machine
  // (both refusals in fact come within one TLS handshake, a few ms).
  constexpr double kBoundMs = kTimeoutMs + 1500;

  {  // no client certificate
    etcd::Options o = etcd.client_options();
    o.timeout_ms = kTimeoutMs;
    o.cert_file.clear();
    o.key_file.clear();
    etcd::Client c(o);
    const auto t0 = std::chrono::steady_clock::now();
    const etcd::Status s = c.put("/tls/x", "1");
    const double took = ms_since(t0);
    INFO(s.message);
    CHECK_FALSE(s.ok());
    CHECK_THAT(s.message, Contains(ep + "/v3/kv/put: "));
    // Which error curl reports (a write that failed, or the read of etcd's TLS alert) depends
    // on which came first; the message says what to check either way.
    CHECK_THAT(s.message, Contains("etcd ended the TLS connection and this client has no "
                                   "certificate"));
    CHECK(took < kBoundMs);
  }
  {  // a CA that did not sign etcd's certificate
    etcd::Options o = etcd.client_options();
    o.timeout_ms = kTimeoutMs;
    o.ca_file = etcd.tls_files().other_ca;
    etcd::Client c(o);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<etcd::KeyValue> kv;
    const etcd::Status s = c.range("/tls/x", "", &kv);
    const double took = ms_since(t0);
    INFO(s.message);
    CHECK_FALSE(s.ok());
    CHECK_THAT(s.message, Contains(ep + "/v3/kv/range: "));
    CHECK_THAT(s.message, Contains("unable to get local issuer certificate"));
    CHECK_THAT(s.message, Contains("not signed by the CA file given"));
    CHECK(took < kBoundMs);
  }
  // Nothing of the refused requests reached etcd.
  std::string v;
  CHECK_FALSE(etcd.get("/tls/x", &v));
}

TEST_CASE("etcd authentication: the right password works; a wrong one, or none, is refused by name",
          "[snapshot][etcd]") {
  test::EtcdCluster etcd("etcdauth", 1, Transport::kTls);
  start_etcd(etcd, true);
  const std::string ep = etcd.endpoint(0);
  const etcd::Options right = etcd.client_options();
  REQUIRE(right.user == "root");
  REQUIRE(right.password == kRootPassword);

  // The right password: every operation, and a watch (its own connection and token) from the
  // revision after the one read now, so that it cannot start after the writes it must see.
  etcd::Client c(right);
  std::vector<etcd::KeyValue> none_yet;
  int64_t rev = 0;
  REQUIRE(c.range("/auth/", etcd::prefix_end("/auth/"), &none_yet, &rev).ok());
  REQUIRE(rev > 0);
  std::mutex mu;
  std::vector<std::string> seen;
  std::atomic<bool> link{false};
  etcd::Watch w(
      right, "/auth/", rev + 1,
      [&](const std::vector<etcd::WatchEvent>& evs, int64_t) {
        std::lock_guard<std::mutex> l(mu);
        for (const auto& e : evs) seen.push_back(e.kv.key + "=" + e.kv.value);
      },
      [] { return int64_t(0); }, [&](bool up) { link = up; });
  check_operations(c, "/auth/");
  bool watched = false;
  for (int i = 0; i < 250 && !watched; ++i) {
    {
      std::lock_guard<std::mutex> l(mu);
      watched = std::find(seen.begin(), seen.end(), "/auth/b=two") != seen.end();
    }
    if (!watched) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(watched);
  CHECK(link);

  // A wrong password: the authentication, its user and the endpoint are named.
  etcd::Options o = right;
  o.password = "not-the-password";
  {
    etcd::Client bad(o);
    const etcd::Status s = bad.put("/auth/x", "1");
    INFO(s.message);
    CHECK(s.code == etcd::Status::kError);
    CHECK_THAT(s.message, Contains("etcd authentication as user 'root' failed: " + ep +
                                   "/v3/auth/authenticate: HTTP 400: "));
    CHECK_THAT(s.message, Contains("invalid user ID or password"));
  }
  // No user at all: etcd's "user name is empty", with what to set.
  o.user.clear();
  o.password.clear();
  {
    etcd::Client none(o);
    const etcd::Status s = none.put("/auth/x", "1");
    INFO(s.message);
    CHECK(s.code == etcd::Status::kError);
    CHECK_THAT(s.message, Contains(ep + "/v3/kv/put: HTTP 400: etcdserver: user name is empty"));
    CHECK_THAT(s.message, Contains("etcd has authentication on"));
    std::vector<etcd::KeyValue> kv;
    CHECK_FALSE(none.range("/auth/a", "", &kv).ok());
  }
  std::string v;
  CHECK_FALSE(etcd.get("/auth/x", &v));

  // etcd's tokens live in its memory: after a restart the client's token is invalid, and the
  // client authenticates again by itself.
  etcd.kill_member(0);
  std::string err;
  REQUIRE(etcd.restart_member(0, &err));
  etcd::Status s;
  for (int i = 0; i < 100; ++i) {
    s = c.put("/auth/after-restart", "3");
    if (s.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  INFO(s.message);
  CHECK(s.ok());
  CHECK(etcd.get("/auth/after-restart", &v));
}

namespace {

std::string daemon_path() {
  return test::env_or("R2CCL_TEST_SNAPSHOTD", R2CCL_BINARY_DIR "/bin/r2ccl_snapshotd");
}

// One r2ccl_snapshotd with `args` appended, its stderr into `log`; stopped (SIGKILL) and reaped
// by the destructor when still running.
struct Daemon {
  pid_t pid = -1;
  std::string log;
  Daemon(const std::vector<std::string>& args, const std::string& log_path) : log(log_path) {
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with the test, however it ends
      FILE* f = freopen(log.c_str(), "w", stderr);
      FILE* g = freopen("/dev/null", "w", stdout);  // ctest must not wait on a daemon's stdout
      (void)f;
      (void)g;
      std::vector<std::string> a{"r2ccl_snapshotd"};
      a.insert(a.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (auto& x : a) argv.push_back(const_cast<char*>(x.c_str()));
      argv.push_back(nullptr);
      execv(daemon_path().c_str(), argv.data());
      _exit(127);
    }
  }
  ~Daemon() { stop(SIGKILL); }
  // The exit status once it exited (128 + signal), -1 while it runs.
  int exited() {
    int st = 0;
    if (pid <= 0 || waitpid(pid, &st, WNOHANG) != pid) return -1;
    pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  void stop(int sig) {
    if (pid <= 0) return;
    kill(pid, sig);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
};

}  // namespace

TEST_CASE(
    "snapshotd: registers through etcd TLS and authentication; a wrong password is logged "
    "by name and never registers",
    "[snapshot][etcd]") {
  test::EtcdCluster etcd("snapdtls", 1, Transport::kTls);
  start_etcd(etcd, true);
  const std::string tag = "snapdtls" + std::to_string(getpid());
  std::string err;
  const int port = test::free_loopback_port(AF_INET, &err);
  INFO(err);
  REQUIRE(port > 0);
  const std::string peers = test::temp_path(tag + "-peers"), token = test::temp_path(tag + "-tok"),
                    pw = test::temp_path(tag + "-pw"), bad_pw = test::temp_path(tag + "-badpw");
  std::ofstream(peers) << "0 127.0.0.1:" << port << "\n";
  std::ofstream(token) << "job-" << tag << "\n";
  std::ofstream(pw) << kRootPassword << "\n";
  std::ofstream(bad_pw) << "not-the-password\n";
  const auto& tls = etcd.tls_files();
  auto args = [&](const std::string& job, const std::string& password_file) {
    return std::vector<std::string>{"--id",
                                    "0",
                                    "--peers",
                                    peers,
                                    "--token-file",
                                    token,
                                    "--board",
                                    job,
                                    "--socket",
                                    test::temp_path(job + ".sock"),
                                    "--period-ms",
                                    "100",
                                    "--etcd",
                                    etcd.endpoints(),
                                    "--job",
                                    job,
                                    "--lease-ttl",
                                    "3",
                                    "--etcd-ca",
                                    tls.ca,
                                    "--etcd-cert",
                                    tls.client_cert,
                                    "--etcd-key",
                                    tls.client_key,
                                    "--etcd-user",
                                    "root",
                                    "--etcd-password-file",
                                    password_file};
  };
  const std::string good_job = tag + "-good", bad_job = tag + "-bad";
  board::remove_board(good_job);
  board::remove_board(bad_job);

  // The right password: node 0's member key appears under the job's prefix.
  {
    Daemon d(args(good_job, pw), test::temp_path(tag + "-good.log"));
    const std::string members = "/r2ccl/" + good_job + "/members/";
    std::vector<std::pair<std::string, std::string>> kv;
    std::string log;
    // The key is written before the daemon logs it: wait for both.
    for (int i = 0; i < 200 && d.exited() < 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      kv = etcd.get_prefix(members);
      log = test::read_file(d.log);
      if (!kv.empty() && log.find("etcd: registered node 0") != std::string::npos) break;
    }
    INFO(log);
    REQUIRE(kv.size() == 1);
    CHECK(kv[0].first == members + "0000");
    CHECK_THAT(log, Contains("etcd: registered node 0"));
    CHECK(log.find("etcd unreachable") == std::string::npos);
    d.stop(SIGTERM);
  }

  // A wrong password: the daemon runs on (as with etcd unreachable), says why it cannot
  // register, naming the authentication and the endpoint, and never registers.
  {
    Daemon d(args(bad_job, bad_pw), test::temp_path(tag + "-bad.log"));
    const std::string want = "etcd authentication as user 'root' failed: " + etcd.endpoint(0);
    std::string log;
    for (int i = 0; i < 100 && log.find(want) == std::string::npos && d.exited() < 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      log = test::read_file(d.log);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a few more periods
    CHECK(d.exited() == -1);
    log = test::read_file(d.log);
    INFO(log);
    CHECK_THAT(log, Contains("WARN etcd: cannot register node 0: " + want));
    CHECK_THAT(log, Contains("invalid user ID or password"));
    CHECK(test::count_lines_containing(log, want) == 1);  // said once, not every period
    CHECK(log.find("etcd: registered node") == std::string::npos);
    CHECK(etcd.get_prefix("/r2ccl/" + bad_job + "/").empty());
    d.stop(SIGTERM);
  }
  board::remove_board(good_job);
  board::remove_board(bad_job);
  for (const std::string& f : {peers, token, pw, bad_pw}) unlink(f.c_str());
}
