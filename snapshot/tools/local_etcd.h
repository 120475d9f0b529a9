// A local etcd on 127.0.0.1 for the snapshot daemon's tests and benchmarks (issue 15): 1 or 3
// members, each with its own data directory and free ports, started from Debian's etcd-server
// (/usr/bin/etcd unless told otherwise). The tests use it to kill the etcd leader, to stop
// etcd (SIGSTOP: unreachable without closing connections) and to read what the daemons wrote;
// r2ccl_snapshot_bench starts its one member with it. Optionally over TLS (certificates made at
// start() with the openssl command line) and with etcd authentication on (enable_auth());
// plain http without authentication by default. Members die with the thread that started
// them (PR_SET_PDEATHSIG), however the process ends.
// Thread-safety: none; one thread owns a cluster.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "r2ccl/snapshot/etcd.h"

namespace r2ccl::snap {

// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released: a small
// race, loopback only); -1 when no socket could be bound.
int free_loopback_port();

class LocalEtcd {
 public:
  enum class Transport {
    kHttp,  // plain http client URLs
    // https client URLs; etcd asks every client for a certificate signed by the test CA
    // (--client-cert-auth, --trusted-ca-file). Peer URLs stay plain http.
    kTls,
  };
  // PEM files of the TLS mode (EC P-256 keys, valid 2 days), in a temporary directory made by
  // start(); all empty for kHttp. The client certificate has no Common Name: with
  // authentication on, etcd's gateway refuses (HTTP 400) any client certificate that has one.
  struct TlsFiles {
    std::string ca;                       // the test CA, which signed the two certificates below
    std::string server_cert, server_key;  // etcd's: subjectAltName IP:127.0.0.1
    std::string client_cert, client_key;  // a client's (extendedKeyUsage clientAuth)
    std::string other_ca;                 // a second CA, which signed nothing etcd uses
  };

  // `tag` names the cluster's directory (data, logs, certificates; made under `dir`, $TMPDIR
  // or /tmp when empty, and removed by the destructor);
  // `binary`: the etcd executable. Election timeout and heartbeat are short (500 ms / 50 ms),
  // so a leader kill is survived within about a second and etcd's smallest lease TTL
  // (ceil(1.5 x election timeout) s) is 1 s.
  explicit LocalEtcd(const std::string& tag, int members = 1,
                     Transport transport = Transport::kHttp,
                     const std::string& binary = "/usr/bin/etcd", const std::string& dir = "");
  ~LocalEtcd();  // kills every member, removes the data and certificate directories
  LocalEtcd(const LocalEtcd&) = delete;
  LocalEtcd& operator=(const LocalEtcd&) = delete;

  // Starts every member and waits (up to 20 s) until the cluster serves a write. False with
  // *err (the members' logs) otherwise; also false when no etcd binary exists, and in TLS mode
  // when the certificates could not be made (openssl's output in *err).
  bool start(std::string* err);
  // Turns etcd authentication on, through the JSON gateway: user "root" with `password`,
  // granted the root role, then /v3/auth/enable. From then on the fixture's own helpers
  // (get, get_prefix, client_options) authenticate as root. After start(); false with *err
  // (the request that failed and etcd's answer) otherwise.
  bool enable_auth(const std::string& password, std::string* err);
  // "http://127.0.0.1:P1,http://127.0.0.1:P2,..." for --etcd ("https://..." in TLS mode).
  std::string endpoints() const;
  std::string endpoint(int i) const;
  int members() const { return int(pids_.size()); }
  // The member index that is the raft leader now, -1 if none answers.
  int leader() const;
  void kill_member(int i);                       // SIGKILL
  void pause_member(int i, bool on);             // SIGSTOP / SIGCONT
  bool restart_member(int i, std::string* err);  // after kill_member: same data directory
  // The value of one key ("" and false when absent or etcd does not answer), and every key
  // under a prefix with its value.
  bool get(const std::string& key, std::string* value) const;
  std::vector<std::pair<std::string, std::string>> get_prefix(const std::string& prefix) const;
  std::string logs() const;
  const std::string& binary() const { return binary_; }

  Transport transport() const { return transport_; }
  const TlsFiles& tls_files() const { return tls_; }
  // What a client needs to reach this cluster: every endpoint, the CA and client certificate
  // in TLS mode, and root's name and password once enable_auth() succeeded.
  snap::etcd::Options client_options() const;

 private:
  bool spawn(int i, bool fresh);
  bool make_certificates(std::string* err);
  std::string path(const std::string& what) const;  // home_/what
  std::string tag_, binary_;
  std::string home_;  // this cluster's directory ("" when it could not be made)
  Transport transport_;
  TlsFiles tls_;
  std::string root_password_;  // set once authentication is on
  std::vector<int> client_ports_, peer_ports_;
  std::vector<pid_t> pids_;
  std::vector<std::string> dirs_, logs_;
};

}  // namespace r2ccl::snap
