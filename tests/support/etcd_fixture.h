// A real etcd for the snapshot daemon's tests (issue 15): 1 or 3 members on 127.0.0.1, each
// with a temporary data directory and free ports, started from Debian's etcd-server
// (/usr/bin/etcd, or R2CCL_TEST_ETCD). Tests use it to kill the etcd leader, to stop etcd
// (SIGSTOP: unreachable without closing connections) and to read what the daemons wrote.
// Thread-safety: none; one test thread owns a cluster.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace r2ccl::test {

class EtcdCluster {
 public:
  // `tag` names the data directories and logs. Election timeout and heartbeat are short
  // (500 ms / 50 ms) so a leader kill is survived within about a second.
  explicit EtcdCluster(const std::string& tag, int members = 1);
  ~EtcdCluster();  // kills every member, removes the data directories
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  // Starts every member and waits (up to 20 s) until the cluster serves a write. False with
  // *err (the members' logs) otherwise; also false when no etcd binary exists.
  bool start(std::string* err);
  // "http://127.0.0.1:P1,http://127.0.0.1:P2,..." for --etcd.
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
  static std::string binary();

 private:
  bool spawn(int i, bool fresh);
  std::string tag_;
  std::vector<int> client_ports_, peer_ports_;
  std::vector<pid_t> pids_;
  std::vector<std::string> dirs_, logs_;
};

}  // namespace r2ccl::test
