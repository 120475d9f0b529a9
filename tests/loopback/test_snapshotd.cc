// r2ccl_snapshotd, several daemons on loopback (one "node" each, each with its own health
// board) and a real etcd (tests/support/etcd_fixture.h): they register, elect a coordinator,
// and publish the agreed record into every board; a killed node is suspected by the other two
// and evicted, and the new record leaves it out; a wrong job token is refused and logged and
// never counted (neither on the peer port nor in etcd); a restarted node rejoins.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "etcd_fixture.h"
#include "net_harness.h"
#include "r2ccl/health_board.h"

using namespace r2ccl;

namespace {

std::string daemon_path() {
  return test::env_or("R2CCL_TEST_SNAPSHOTD", R2CCL_BINARY_DIR "/bin/r2ccl_snapshotd");
}

struct Node {
  pid_t pid = -1;
  std::string log;
};

Node start(int id, const std::string& peers, const std::string& token, const std::string& board,
           const std::string& tag, const std::string& etcd, const std::string& job) {
  Node n;
  n.log = test::temp_path(tag + "-node" + std::to_string(id) + ".log");
  n.pid = fork();
  if (n.pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with the test, however it ends
    FILE* f = freopen(n.log.c_str(), "w", stderr);
    FILE* g = freopen("/dev/null", "w", stdout);  // ctest must not wait on a daemon's stdout
    (void)f;
    (void)g;
    const std::string ids = std::to_string(id);
    execl(daemon_path().c_str(), "r2ccl_snapshotd", "--id", ids.c_str(), "--peers", peers.c_str(),
          "--token-file", token.c_str(), "--board", board.c_str(), "--period-ms", "100", "--etcd",
          etcd.c_str(), "--job", job.c_str(), "--lease-ttl", "1", static_cast<char*>(nullptr));
    _exit(127);
  }
  return n;
}

void stop(Node& n, int sig = SIGTERM) {
  if (n.pid <= 0) return;
  kill(n.pid, sig);
  int st;
  waitpid(n.pid, &st, 0);
  n.pid = -1;
}

// Waits up to `ms` for `board`'s agreed record to have exactly `members` and epoch > `after`.
bool wait_record(const std::string& board, int members, uint64_t after, int ms,
                 board::AgreedRecord* out) {
  for (int waited = 0; waited <= ms; waited += 20) {
    std::string err;
    if (board::read_agreed_record(board, out, &err) && out->epoch > after &&
        board::member_count(*out) == members)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

}  // namespace

TEST_CASE("snapshotd: membership, a killed node, a wrong token, a rejoin", "[snapshot]") {
  const std::string tag = "snapd" + std::to_string(getpid());
  const int base = 27000 + (getpid() % 2000) * 3;
  const std::string peers = test::temp_path(tag + "-peers"),
                    token = test::temp_path(tag + "-token"), bad = test::temp_path(tag + "-bad");
  {
    std::ofstream p(peers);
    for (int i = 0; i < 3; ++i) p << i << " 127.0.0.1:" << base + i << "\n";
    std::ofstream(token) << "job-" << getpid() << "\n";
    std::ofstream(bad) << "not-the-job\n";
  }
  std::vector<std::string> boards;
  for (int i = 0; i < 3; ++i) {
    boards.push_back(tag + "-b" + std::to_string(i));
    board::remove_board(boards.back());
  }
  std::vector<Node> nodes;
  // Every daemon is stopped however the test ends (a failed REQUIRE included).
  struct Reaper {
    std::vector<Node>* v;
    ~Reaper() {
      for (auto& n : *v) stop(n, SIGKILL);
    }
  } reaper{&nodes};
  test::EtcdCluster etcd("snapd");
  std::string eerr;
  const bool etcd_up = etcd.start(&eerr);
  INFO(eerr);
  REQUIRE(etcd_up);
  const std::string ep = etcd.endpoints();
  for (int i = 0; i < 3; ++i) nodes.push_back(start(i, peers, token, boards[i], tag, ep, tag));
  std::string logs;
  auto collect = [&] {
    logs.clear();
    for (auto& n : nodes) logs += test::read_file(n.log);
  };

  // All three agree on {0, 1, 2}.
  board::AgreedRecord r;
  uint64_t epoch = 0;
  for (int i = 0; i < 3; ++i) {
    const bool agreed = wait_record(boards[i], 3, 0, 5000, &r);
    collect();  // after the wait: a failure shows what the daemons did meanwhile
    INFO(logs);
    REQUIRE(agreed);
    epoch = std::max(epoch, r.epoch);
  }
  CHECK(r.n_nodes == 3);

  // Node 0 dies: 1 and 2 suspect it (or its lease runs out) and agree on {1, 2}.
  stop(nodes[0], SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 1; i < 3; ++i) {
    const bool agreed = wait_record(boards[i], 2, epoch, 3000, &r);
    collect();  // after the wait: which step was slow (suspicion, lease, record write)
    INFO(logs);
    INFO("node " << i << " waited "
                 << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
                 << " s after node 0's SIGKILL");
    REQUIRE(agreed);
    CHECK((r.members[0] & 1ULL) == 0);
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 2.0);  // 3 periods of 100 ms + scheduling; generous for a loaded 2-core machine
  epoch = r.epoch;

  // A daemon with the wrong token, claiming to be node 0: refused and logged, never counted.
  // Waits for the refusals in the logs (up to 10 s: a daemon built with AddressSanitizer
  // starts slowly on a loaded machine), then a little longer for a wrong count to show.
  Node intruder = start(0, peers, bad, tag + "-bx", tag, ep, tag);
  for (int waited = 0; waited < 10000; waited += 50) {
    collect();  // node 0's log is the intruder's now (the same id and tag)
    if (logs.find("refused a peer connection from 127.0.0.1") != std::string::npos &&
        logs.find("wrong job token") != std::string::npos &&
        logs.find("registered under another job token") != std::string::npos)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stop(intruder);
  collect();
  {
    INFO(logs);
    CHECK(logs.find("refused a peer connection from 127.0.0.1") != std::string::npos);
    CHECK(logs.find("wrong job token") != std::string::npos);
    CHECK(logs.find("registered under another job token") != std::string::npos);
    std::string err;
    REQUIRE(board::read_agreed_record(boards[1], &r, &err));
  }
  CHECK(board::member_count(r) == 2);
  CHECK(r.epoch == epoch);

  // Node 0 restarts with the right token and rejoins: {0, 1, 2} again, a newer epoch.
  nodes[0] = start(0, peers, token, boards[0], tag + "-again", ep, tag);
  for (int i = 0; i < 3; ++i) {
    const bool agreed = wait_record(boards[i], 3, epoch, 5000, &r);
    collect();
    INFO(logs);
    REQUIRE(agreed);
  }
  for (auto& n : nodes) stop(n);
  collect();
  INFO(logs);
  CHECK(logs.find("suspected (published to etcd") != std::string::npos);
  for (const auto& b : boards) board::remove_board(b);
  board::remove_board(tag + "-bx");
}

namespace {
// Runs the daemon with `args` (after --id 0 --peers P --token-file T) until it exits or
// `ms` passes (then SIGTERM); returns the exit status and fills *log with its stderr.
int run_daemon(const std::vector<std::string>& args, const std::string& peers,
               const std::string& token, int ms, std::string* log) {
  const std::string out = test::temp_path("snapd-run.log");
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* f = freopen(out.c_str(), "w", stderr);
    FILE* g = freopen("/dev/null", "w", stdout);
    (void)f;
    (void)g;
    std::vector<std::string> a{"r2ccl_snapshotd", "--id", "0", "--peers", peers,
                               "--token-file",    token};
    a.insert(a.end(), args.begin(), args.end());
    if (std::find(args.begin(), args.end(), "--etcd") == args.end())
      a.insert(a.end(), {"--etcd", "http://127.0.0.1:9"});  // no etcd there
    std::vector<char*> argv;
    for (auto& x : a) argv.push_back(const_cast<char*>(x.c_str()));
    argv.push_back(nullptr);
    execv(daemon_path().c_str(), argv.data());
    _exit(127);
  }
  int st = 0;
  for (int w = 0; w < ms; w += 20) {
    if (waitpid(pid, &st, WNOHANG) == pid) {
      *log = test::read_file(out);
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGTERM);
  waitpid(pid, &st, 0);
  *log = test::read_file(out);
  return -1;  // still running after ms
}
}  // namespace

TEST_CASE("snapshotd: bad start-up settings are refused by name; a host name binds its address",
          "[snapshot]") {
  const std::string tag = "snapdargs" + std::to_string(getpid());
  const int port = 27000 + (getpid() % 2000) * 3 + 2;
  const std::string peers = test::temp_path(tag + "-peers"), token = test::temp_path(tag + "-tok"),
                    sock = test::temp_path(tag + ".sock");
  std::ofstream(token) << "job\n";
  std::string log;
  { std::ofstream(peers) << "0 127.0.0.1:" << port << "\n"; }
  CHECK(run_daemon({"--socket", sock, "--spill-dir", "/nonexistent-r2ccl/x"}, peers, token, 5000,
                   &log) == 2);
  CHECK_THAT(log, Catch::Contains("--spill-dir /nonexistent-r2ccl/x: its parent directory"));
  CHECK(access("/nonexistent-r2ccl", F_OK) != 0);  // nothing created
  CHECK(run_daemon({"--socket", sock, "--socket-group", "no-such-group-r2ccl"}, peers, token, 5000,
                   &log) == 2);
  CHECK_THAT(log, Catch::Contains("--socket-group no-such-group-r2ccl: no such group"));
  CHECK(run_daemon({"--socket", ""}, peers, token, 5000, &log) == 2);
  CHECK_THAT(log, Catch::Contains("--socket is empty"));
  CHECK(run_daemon({"--socket", sock}, test::temp_path(tag + "-missing"), token, 5000, &log) == 2);
  CHECK_THAT(log, Catch::Contains("--peers"));
  CHECK_THAT(log, Catch::Contains("No such file or directory"));
  CHECK(run_daemon({"--socket", sock, "--metrics", "localhost:9464"}, peers, token, 5000, &log) ==
        2);
  CHECK_THAT(log, Catch::Contains("--metrics: 'localhost:9464'") &&
                      Catch::Contains("accepted: ADDR:PORT with a numeric IPv4 address"));
  CHECK(run_daemon({"--socket", sock, "--metrics", "203.0.113.1:9"}, peers, token, 5000, &log) ==
        1);
  CHECK_THAT(log, Catch::Contains("--metrics: cannot listen on 203.0.113.1:9: "));
  CHECK(run_daemon({"--socket", sock, "--etcd", "etcd.example:2379"}, peers, token, 5000, &log) ==
        2);
  CHECK_THAT(log, Catch::Contains("--etcd: etcd endpoint 'etcd.example:2379' (accepted: "
                                  "http://HOST:PORT or https://HOST:PORT"));
  CHECK(run_daemon({"--socket", sock, "--job", "a/b"}, peers, token, 5000, &log) == 2);
  CHECK_THAT(log, Catch::Contains("--job 'a/b' (accepted: 1-64 letters, digits"));
  setenv("R2CCL_SNAPD_TEST_REGISTER_DELAY_MS", "1s", 1);  // the child inherits it
  CHECK(run_daemon({"--socket", sock}, peers, token, 5000, &log) == 2);
  unsetenv("R2CCL_SNAPD_TEST_REGISTER_DELAY_MS");
  CHECK_THAT(log, Catch::Contains("R2CCL_SNAPD_TEST_REGISTER_DELAY_MS=\"1s\" is not valid "
                                  "(accepted: milliseconds, 0..10000"));
  CHECK(access(sock.c_str(), F_OK) != 0);  // a failed start leaves no socket behind
  // A name in this node's own line: it listens on that name's address, not on every interface.
  { std::ofstream(peers) << "0 localhost:" << port << "\n"; }
  // etcd unreachable: the daemon runs on (and says so once).
  CHECK(run_daemon({"--socket", sock}, peers, token, 2500, &log) == -1);  // ran until stopped
  CHECK_THAT(log, Catch::Contains("etcd unreachable ("));
  CHECK_THAT(log, Catch::Contains("listening on 127.0.0.1 port") ||
                      Catch::Contains("listening on ::1 port"));
  // Every line is common's facade, stamped: "[SEC.USEC] SNAPSHOT/R2CCL LEVEL message".
  {
    std::istringstream lines(log);
    std::string line;
    int n = 0;
    const std::regex facade("\\[[0-9]+\\.[0-9]{6}\\] SNAPSHOT/R2CCL (INFO|WARN) .+");
    while (std::getline(lines, line)) {
      INFO(line);
      CHECK(std::regex_match(line, facade));
      ++n;
    }
    CHECK(n >= 1);
    CHECK_THAT(log, Catch::Contains("SNAPSHOT/R2CCL INFO node 0 of 1 listening on "));
  }
  { std::ofstream(peers) << "0 no-such-host.invalid:" << port << "\n"; }
  CHECK(run_daemon({"--socket", sock}, peers, token, 10000, &log) == 1);
  CHECK_THAT(log,
             Catch::Contains(
                 "SNAPSHOT/R2CCL WARN cannot resolve this node's host 'no-such-host.invalid'"));
}
