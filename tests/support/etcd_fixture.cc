#include "etcd_fixture.h"

#include <curl/curl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "net_harness.h"
#include "r2ccl/snapshot/etcd.h"

namespace r2ccl::test {
namespace etcd = r2ccl::snap::etcd;
namespace {

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof(a);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0)
    port = ntohs(a.sin_port);
  close(fd);
  return port;
}

size_t append(char* p, size_t s, size_t n, void* u) {
  static_cast<std::string*>(u)->append(p, s * n);
  return s * n;
}
bool post(const std::string& url, const std::string& body, std::string* out) {
  CURL* c = curl_easy_init();
  if (!c) return false;
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 1000L);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, out);
  const CURLcode rc = curl_easy_perform(c);
  long code = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
  curl_easy_cleanup(c);
  return rc == CURLE_OK && code == 200;
}

}  // namespace

std::string EtcdCluster::binary() { return env_or("R2CCL_TEST_ETCD", "/usr/bin/etcd"); }

EtcdCluster::EtcdCluster(const std::string& tag, int members)
    : tag_(tag + std::to_string(getpid())) {
  for (int i = 0; i < members; ++i) {
    client_ports_.push_back(free_port());
    peer_ports_.push_back(free_port());
    pids_.push_back(-1);
    dirs_.push_back(temp_path(tag_ + "-etcd" + std::to_string(i)));
    logs_.push_back(temp_path(tag_ + "-etcd" + std::to_string(i) + ".log"));
  }
}

EtcdCluster::~EtcdCluster() {
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (pids_[i] > 0) {
      kill(pids_[i], SIGCONT);
      kill(pids_[i], SIGKILL);
      waitpid(pids_[i], nullptr, 0);
    }
    const std::string rm = "rm -rf '" + dirs_[i] + "'";
    if (system(rm.c_str()) != 0) {
    }
  }
}

std::string EtcdCluster::endpoint(int i) const {
  return "http://127.0.0.1:" + std::to_string(client_ports_[i]);
}
std::string EtcdCluster::endpoints() const {
  std::string s;
  for (int i = 0; i < members(); ++i) s += (i ? "," : "") + endpoint(i);
  return s;
}

bool EtcdCluster::spawn(int i, bool fresh) {
  std::string cluster;
  for (int k = 0; k < members(); ++k)
    cluster += (k ? "," : "") + std::string("m") + std::to_string(k) +
               "=http://127.0.0.1:" + std::to_string(peer_ports_[k]);
  const std::string c = endpoint(i), p = "http://127.0.0.1:" + std::to_string(peer_ports_[i]);
  std::vector<std::string> a{binary(),
                             "--name",
                             "m" + std::to_string(i),
                             "--data-dir",
                             dirs_[i],
                             "--listen-client-urls",
                             c,
                             "--advertise-client-urls",
                             c,
                             "--listen-peer-urls",
                             p,
                             "--initial-advertise-peer-urls",
                             p,
                             "--initial-cluster",
                             cluster,
                             "--initial-cluster-token",
                             tag_,
                             "--initial-cluster-state",
                             "new",
                             "--heartbeat-interval",
                             "50",
                             "--election-timeout",
                             "500",
                             "--logger",
                             "zap",
                             "--log-outputs",
                             logs_[i]};
  (void)fresh;
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // etcd dies with the test, however the test ends
    FILE* f = freopen("/dev/null", "w", stdout);
    FILE* g = freopen((logs_[i] + ".stderr").c_str(), "a", stderr);
    (void)f;
    (void)g;
    std::vector<char*> argv;
    for (auto& s : a) argv.push_back(const_cast<char*>(s.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  pids_[i] = pid;
  return true;
}

bool EtcdCluster::start(std::string* err) {
  if (access(binary().c_str(), X_OK) != 0) {
    *err = binary() + " not found (scripts/setup.sh installs Debian's etcd-server)";
    return false;
  }
  for (int i = 0; i < members(); ++i)
    if (!spawn(i, true)) {
      *err = "fork failed";
      return false;
    }
  etcd::Options o;
  std::string perr;
  etcd::parse_endpoints(endpoints(), &o, &perr);
  o.timeout_ms = 500;
  etcd::Client cl(o);
  for (int w = 0; w < 200; ++w) {
    if (cl.put("/r2ccl-test/ready", "1").ok()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  *err = "etcd did not serve a write within 20 s:\n" + logs();
  return false;
}

int EtcdCluster::leader() const {
  for (int i = 0; i < members(); ++i) {
    std::string a;
    if (pids_[i] <= 0 || !post(endpoint(i) + "/v3/maintenance/status", "{}", &a)) continue;
    try {
      auto j = nlohmann::json::parse(a);
      if (j.value("leader", std::string()) == j["header"].value("member_id", std::string("x")))
        return i;
    } catch (const std::exception&) {
    }
  }
  return -1;
}

void EtcdCluster::kill_member(int i) {
  if (pids_[i] <= 0) return;
  kill(pids_[i], SIGCONT);
  kill(pids_[i], SIGKILL);
  waitpid(pids_[i], nullptr, 0);
  pids_[i] = -1;
}

void EtcdCluster::pause_member(int i, bool on) {
  if (pids_[i] > 0) kill(pids_[i], on ? SIGSTOP : SIGCONT);
}

bool EtcdCluster::restart_member(int i, std::string* err) {
  if (pids_[i] > 0) return true;
  if (!spawn(i, false)) {
    *err = "fork failed";
    return false;
  }
  return true;
}

bool EtcdCluster::get(const std::string& key, std::string* value) const {
  etcd::Options o;
  std::string perr;
  etcd::parse_endpoints(endpoints(), &o, &perr);
  etcd::Client cl(o);
  std::vector<etcd::KeyValue> kv;
  value->clear();
  if (!cl.range(key, "", &kv).ok() || kv.empty()) return false;
  *value = kv[0].value;
  return true;
}

std::vector<std::pair<std::string, std::string>> EtcdCluster::get_prefix(
    const std::string& prefix) const {
  etcd::Options o;
  std::string perr;
  etcd::parse_endpoints(endpoints(), &o, &perr);
  etcd::Client cl(o);
  std::vector<etcd::KeyValue> kv;
  std::vector<std::pair<std::string, std::string>> out;
  if (!cl.range(prefix, etcd::prefix_end(prefix), &kv).ok()) return out;
  for (auto& x : kv) out.push_back({x.key, x.value});
  return out;
}

std::string EtcdCluster::logs() const {
  std::string s;
  for (int i = 0; i < members(); ++i) {
    const std::string t = read_file(logs_[i]);
    s += "--- etcd member " + std::to_string(i) + "\n" +
         (t.size() > 4000 ? t.substr(t.size() - 4000) : t) + read_file(logs_[i] + ".stderr");
  }
  return s;
}

}  // namespace r2ccl::test
