// r2ccl_perf rendezvous: a tiny TCP all-gather service used to exchange the opaque net handles,
// per-size results and stats between ranks. Never carries benchmark data.
//
// Protocol (all integers little-endian host order; ranks share an architecture):
//   client -> server  u32 rank                                  once, after connect
//   per round:
//   client -> server  u32 len, len bytes                       this rank's blob
//   server -> client  nranks x (u32 len, len bytes)           every rank's blob, by rank
// The server serves rounds until a client closes; then it closes every connection, so the
// other ranks see an error instead of hanging when one rank dies.
// Thread-safety: a server runs on its own thread; a client is used by one thread.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace r2perf {

class RdvServer {
 public:
  ~RdvServer();
  // Binds HOST:PORT (PORT 0 = any free port; an empty host = every address) and listens.
  // Throws PerfError.
  void listen(const std::string& host, int port);
  int port() const { return port_; }
  int fd() const { return fd_; }
  // Serves nranks clients until the end (see above), on a thread of its own.
  void start(int nranks);
  // Waits up to timeout_s for the server to finish (every client gone). A process that hosts
  // the server must not exit before, or the last answers may never be written.
  bool wait(double timeout_s);
  void close_listen();

 private:
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;  // detached by the destructor if still running
  std::shared_ptr<std::atomic<bool>> done_;
};

class RdvClient {
 public:
  ~RdvClient();
  // Connects (retrying until `timeout_s`) and says hello. Throws PerfError.
  void connect(const std::string& host, int port, int rank, int nranks, double timeout_s);
  // Sends this rank's blob and returns every rank's blob, indexed by rank. Throws PerfError.
  std::vector<std::string> allgather(const std::string& mine);
  void barrier() { allgather(std::string()); }
  void close();
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  int nranks_ = 0;
};

// "HOST:PORT" -> host, port. Returns false when malformed.
bool parse_host_port(const std::string& s, std::string* host, int* port);

}  // namespace r2perf
