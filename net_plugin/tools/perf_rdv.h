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

// The forms --rendezvous accepts, for messages and --help.
extern const char* const kRdvForms;

// A rendezvous address as given to --rendezvous, checked on this host by parse_rdv_address.
struct RdvAddress {
  enum class Kind { kName, kIPv4, kIPv6 };
  Kind kind = Kind::kName;
  std::string host;       // the host name or numeric address, without brackets and scope
  std::string scope;      // IPv6 only: the scope as given (interface name or index), or ""
  unsigned scope_id = 0;  // its interface index on this host; 0 when no scope
  int port = 0;           // 1..65535
  // As the user writes it: HOST:PORT, [ADDR]:PORT or [ADDR%SCOPE]:PORT.
  std::string text() const;
};

// Parses a rendezvous address in one of the forms of kRdvForms:
//   HOST:PORT          a host name or an IPv4 address (a name must resolve here, getaddrinfo)
//   [IPV6]:PORT        a numeric IPv6 address in brackets
//   [IPV6%SCOPE]:PORT  with SCOPE, an interface name or index of this host (if_nametoindex):
//                      required for a link-local address (fe80::/10), refused for any other
// PORT is decimal, 1..65535. Refused: an empty host, a missing port, a port out of range,
// unbalanced brackets, an IPv6 address without brackets, brackets around anything but an
// IPv6 address, a multicast address, an unknown interface, a host name that does not resolve
// (with the resolver's gai_strerror text). Returns false with *err = "'S': the problem;
// accepted: <forms>" (the caller prefixes its option name); *out is set only on success.
// Any thread; may block in the resolver for a host name.
bool parse_rdv_address(const std::string& s, RdvAddress* out, std::string* err);

class RdvServer {
 public:
  ~RdvServer();
  // Binds HOST:PORT (PORT 0 = any free port; an empty host = every address) and listens.
  // Throws PerfError.
  void listen(const std::string& host, int port);
  // Listens for a --rendezvous run (rank 0) on `a`'s port: an IPv6 address on that address
  // itself (with its scope); an IPv4 address on every IPv4 address (0.0.0.0); a host name on
  // every address of each family it resolves to (a dual-stack [::] when it has an IPv6
  // address and this host can listen on IPv6, else 0.0.0.0). Throws PerfError naming the
  // address and the errno text.
  void listen(const RdvAddress& a);
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
  // Connects to `a` over its family (a host name: each address it resolves to, in the
  // resolver's order), retrying refused or unreachable connects until `timeout_s`, and says
  // hello. Throws PerfError: at once when no socket of the family can be made here (IPv6
  // disabled), else after timeout_s with the last errno text.
  void connect(const RdvAddress& a, int rank, int nranks, double timeout_s);
  // Sends this rank's blob and returns every rank's blob, indexed by rank. Throws PerfError.
  std::vector<std::string> allgather(const std::string& mine);
  void barrier() { allgather(std::string()); }
  void close();
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  int nranks_ = 0;
};

}  // namespace r2perf
