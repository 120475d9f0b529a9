#include "local_etcd.h"

#include <curl/curl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "r2ccl/snapshot/etcd.h"

namespace r2ccl::snap {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs `cmd` through the shell with stderr joined to stdout (kept in *out); its exit status,
// or -1 when it could not be run.
int run_command(const std::string& cmd, std::string* out = nullptr) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0)
    if (out) out->append(buf, n);
  const int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

size_t append(char* p, size_t s, size_t n, void* u) {
  static_cast<std::string*>(u)->append(p, s * n);
  return s * n;
}
// One POST to etcd's gateway with the TLS files of `tls` (none for http). Requests of the
// fixture that etcd serves without a token (maintenance status; the auth setup, made before
// authentication is on) use it directly. *out: the answer, or curl's error text.
bool post(const std::string& url, const std::string& body, const LocalEtcd::TlsFiles& tls,
          std::string* out) {
  CURL* c = curl_easy_init();
  if (!c) return false;
  char why[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 1000L);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, out);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, why);
  if (!tls.ca.empty()) {
    curl_easy_setopt(c, CURLOPT_CAINFO, tls.ca.c_str());
    curl_easy_setopt(c, CURLOPT_SSLCERT, tls.client_cert.c_str());
    curl_easy_setopt(c, CURLOPT_SSLKEY, tls.client_key.c_str());
  }
  const CURLcode rc = curl_easy_perform(c);
  long code = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
  curl_easy_cleanup(c);
  if (rc != CURLE_OK) *out = why[0] ? why : curl_easy_strerror(rc);
  return rc == CURLE_OK && code == 200;
}

// The openssl configuration of the test certificates: extensions only, the subjects are given
// with -subj. Go's TLS (etcd) checks the CA's basicConstraints and each leaf's extended key
// usage. etcd's server certificate also serves as the client certificate of etcd's gateway
// when it connects to its own gRPC port, which asks for one (--client-cert-auth): hence
// clientAuth next to serverAuth.
const char* kOpensslConfig = R"([req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = IP:127.0.0.1
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
)";

}  // namespace

int free_loopback_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof(a);
  int port = -1;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

LocalEtcd::LocalEtcd(const std::string& tag, int members, Transport transport,
                     const std::string& binary, const std::string& dir)
    : tag_(tag + std::to_string(getpid())), binary_(binary), transport_(transport) {
  std::string base = dir;
  if (base.empty()) {
    const char* t = getenv("TMPDIR");
    base = t && *t ? t : "/tmp";
  }
  // Everything of this cluster (data directories, logs, certificates) in one directory,
  // removed with it.
  std::string d = base + "/r2ccl-" + tag_ + "-XXXXXX";
  if (mkdtemp(d.data())) home_ = d;
  for (int i = 0; i < members; ++i) {
    client_ports_.push_back(free_loopback_port());
    peer_ports_.push_back(free_loopback_port());
    pids_.push_back(-1);
    dirs_.push_back(path("etcd" + std::to_string(i)));
    logs_.push_back(path("etcd" + std::to_string(i) + ".log"));
  }
}

std::string LocalEtcd::path(const std::string& what) const { return home_ + "/" + what; }

LocalEtcd::~LocalEtcd() {
  for (pid_t& p : pids_)
    if (p > 0) {
      kill(p, SIGCONT);
      kill(p, SIGKILL);
      waitpid(p, nullptr, 0);
    }
  std::error_code ec;
  if (!home_.empty()) std::filesystem::remove_all(home_, ec);
}

std::string LocalEtcd::endpoint(int i) const {
  return std::string(transport_ == Transport::kTls ? "https" : "http") +
         "://127.0.0.1:" + std::to_string(client_ports_[i]);
}

etcd::Options LocalEtcd::client_options() const {
  etcd::Options o;
  std::string perr;
  etcd::parse_endpoints(endpoints(), &o, &perr);
  o.ca_file = tls_.ca;
  o.cert_file = tls_.client_cert;
  o.key_file = tls_.client_key;
  if (!root_password_.empty()) {
    o.user = "root";
    o.password = root_password_;
  }
  return o;
}

// A CA, etcd's certificate and a client certificate signed by it, and a second CA, with EC
// P-256 keys (each made in milliseconds; RSA keys take longer on a loaded machine).
bool LocalEtcd::make_certificates(std::string* err) {
  const std::string tls_dir = path("tls");
  if (mkdir(tls_dir.c_str(), 0700) != 0) {
    *err = "cannot create " + tls_dir + ": " + strerror(errno);
    return false;
  }
  const std::string d = tls_dir + "/";
  std::ofstream(d + "openssl.cnf") << kOpensslConfig;
  const std::string cnf = " -config " + shell_quote(d + "openssl.cnf");
  const std::string newkey = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  auto q = [&](const std::string& f) { return shell_quote(d + f); };
  auto self_signed = [&](const std::string& name, const std::string& subject) {
    return "openssl req -x509" + cnf + " -extensions ca" + newkey + " -days 2 -keyout " +
           q(name + ".key") + " -out " + q(name + ".crt") + " -subj " + shell_quote(subject);
  };
  auto signed_by_ca = [&](const std::string& name, const std::string& subject, int serial) {
    return "openssl req -new" + cnf + newkey + " -keyout " + q(name + ".key") + " -out " +
           q(name + ".csr") + " -subj " + shell_quote(subject) + " && openssl x509 -req -in " +
           q(name + ".csr") + " -CA " + q("ca.crt") + " -CAkey " + q("ca.key") + " -set_serial " +
           std::to_string(serial) + " -days 2 -extfile " + q("openssl.cnf") + " -extensions " +
           name + " -out " + q(name + ".crt");
  };
  // The client's subject has no CN: with authentication on, etcd's gateway refuses a client
  // certificate that has one (local_etcd.h).
  const std::string cmd = self_signed("ca", "/CN=r2ccl test CA") + " && " +
                          signed_by_ca("server", "/CN=r2ccl-test-etcd", 2) + " && " +
                          signed_by_ca("client", "/O=r2ccl-test-client", 3) + " && " +
                          self_signed("other", "/CN=r2ccl test CA (another one)");
  std::string out;
  if (run_command("(" + cmd + ")", &out) != 0) {  // run_command's 2>&1 then covers every step
    *err = "the test certificates could not be made (openssl: scripts/setup.sh installs it):\n" +
           cmd + "\n" + out;
    return false;
  }
  tls_.ca = d + "ca.crt";
  tls_.server_cert = d + "server.crt";
  tls_.server_key = d + "server.key";
  tls_.client_cert = d + "client.crt";
  tls_.client_key = d + "client.key";
  tls_.other_ca = d + "other.crt";
  return true;
}
std::string LocalEtcd::endpoints() const {
  std::string s;
  for (int i = 0; i < members(); ++i) s += (i ? "," : "") + endpoint(i);
  return s;
}

bool LocalEtcd::spawn(int i, bool fresh) {
  std::string cluster;
  for (int k = 0; k < members(); ++k)
    cluster += (k ? "," : "") + std::string("m") + std::to_string(k) +
               "=http://127.0.0.1:" + std::to_string(peer_ports_[k]);
  const std::string c = endpoint(i), p = "http://127.0.0.1:" + std::to_string(peer_ports_[i]);
  std::vector<std::string> a{binary_,
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
  if (transport_ == Transport::kTls)
    a.insert(a.end(), {"--cert-file", tls_.server_cert, "--key-file", tls_.server_key,
                       "--client-cert-auth", "--trusted-ca-file", tls_.ca});
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

bool LocalEtcd::start(std::string* err) {
  if (access(binary_.c_str(), X_OK) != 0) {
    *err = "no etcd at " + binary_ + " (scripts/setup.sh installs Debian's etcd-server)";
    return false;
  }
  if (home_.empty()) {
    *err = "cannot create a directory for etcd's data (r2ccl-" + tag_ + "-XXXXXX)";
    return false;
  }
  if (transport_ == Transport::kTls && tls_.ca.empty() && !make_certificates(err)) return false;
  for (int i = 0; i < members(); ++i)
    if (!spawn(i, true)) {
      *err = "fork failed";
      return false;
    }
  etcd::Options o = client_options();
  o.timeout_ms = 500;
  etcd::Client cl(o);
  for (int w = 0; w < 200; ++w) {
    if (cl.put("/r2ccl-test/ready", "1").ok()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  *err = "etcd did not serve a write within 20 s:\n" + logs();
  return false;
}

int LocalEtcd::leader() const {
  for (int i = 0; i < members(); ++i) {
    std::string a;
    // etcd answers the status without a token, also with authentication on.
    if (pids_[i] <= 0 || !post(endpoint(i) + "/v3/maintenance/status", "{}", tls_, &a)) continue;
    try {
      auto j = nlohmann::json::parse(a);
      if (j.value("leader", std::string()) == j["header"].value("member_id", std::string("x")))
        return i;
    } catch (const std::exception&) {
    }
  }
  return -1;
}

void LocalEtcd::kill_member(int i) {
  if (pids_[i] <= 0) return;
  kill(pids_[i], SIGCONT);
  kill(pids_[i], SIGKILL);
  waitpid(pids_[i], nullptr, 0);
  pids_[i] = -1;
}

void LocalEtcd::pause_member(int i, bool on) {
  if (pids_[i] > 0) kill(pids_[i], on ? SIGSTOP : SIGCONT);
}

bool LocalEtcd::restart_member(int i, std::string* err) {
  if (pids_[i] > 0) return true;
  if (!spawn(i, false)) {
    *err = "fork failed";
    return false;
  }
  return true;
}

bool LocalEtcd::enable_auth(const std::string& password, std::string* err) {
  int live = 0;
  while (live < members() && pids_[live] <= 0) ++live;
  if (live == members() || password.empty()) {
    *err = live == members() ? "no etcd member is running" : "enable_auth: empty password";
    return false;
  }
  // Any member forwards these to the leader. etcd refuses to turn authentication on unless a
  // user "root" with the root role exists (the role itself is built in).
  struct Step {
    const char* path;
    nlohmann::json body;
  };
  const Step steps[] = {
      {"/v3/auth/user/add", {{"name", "root"}, {"password", password}}},
      {"/v3/auth/user/grant", {{"user", "root"}, {"role", "root"}}},
      {"/v3/auth/enable", nlohmann::json::object()},
  };
  for (const Step& s : steps) {
    const std::string url = endpoint(live) + s.path;
    std::string answer;
    if (!post(url, s.body.dump(), tls_, &answer)) {
      *err = url + ": " + answer;
      return false;
    }
  }
  root_password_ = password;
  return true;
}

bool LocalEtcd::get(const std::string& key, std::string* value) const {
  etcd::Client cl(client_options());
  std::vector<etcd::KeyValue> kv;
  value->clear();
  if (!cl.range(key, "", &kv).ok() || kv.empty()) return false;
  *value = kv[0].value;
  return true;
}

std::vector<std::pair<std::string, std::string>> LocalEtcd::get_prefix(
    const std::string& prefix) const {
  etcd::Client cl(client_options());
  std::vector<etcd::KeyValue> kv;
  std::vector<std::pair<std::string, std::string>> out;
  if (!cl.range(prefix, etcd::prefix_end(prefix), &kv).ok()) return out;
  for (auto& x : kv) out.push_back({x.key, x.value});
  return out;
}

std::string LocalEtcd::logs() const {
  std::string s;
  for (int i = 0; i < members(); ++i) {
    const std::string t = read_file(logs_[i]);
    s += "--- etcd member " + std::to_string(i) + "\n" +
         (t.size() > 4000 ? t.substr(t.size() - 4000) : t) + read_file(logs_[i] + ".stderr");
  }
  return s;
}

}  // namespace r2ccl::snap
