#include "perf_rdv.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "perf_net.h"  // PerfError

namespace r2perf {
namespace {

bool write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool read_blob(int fd, std::string* out) {
  uint32_t len = 0;
  if (!read_all(fd, &len, sizeof(len))) return false;
  out->resize(len);
  return len == 0 || read_all(fd, &(*out)[0], len);
}

bool write_blob(int fd, const std::string& s) {
  uint32_t len = static_cast<uint32_t>(s.size());
  return write_all(fd, &len, sizeof(len)) && (len == 0 || write_all(fd, s.data(), len));
}

void nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void serve_fd(int lfd, int nranks) {
  std::vector<int> fds(static_cast<size_t>(nranks), -1);
  auto close_all = [&] {
    for (int& f : fds) {
      if (f >= 0) close(f);
      f = -1;
    }
  };
  int joined = 0;
  while (joined < nranks) {
    int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      break;
    }
    nodelay(fd);
    uint32_t rank = 0;
    if (!read_all(fd, &rank, sizeof(rank)) || rank >= static_cast<uint32_t>(nranks) ||
        fds[rank] >= 0) {
      close(fd);  // a stray or duplicate client: ignore it
      continue;
    }
    fds[rank] = fd;
    joined++;
  }
  close(lfd);
  if (joined < nranks) {
    close_all();
    return;
  }
  // Rounds. Every connection is polled all the time, so a rank that dies while the others
  // are busy (or waiting for their answer) releases everybody at once.
  struct In {
    std::string blob;
    unsigned char len_bytes[4];
    size_t got;
    bool done;
  };
  std::vector<In> in(static_cast<size_t>(nranks));
  std::vector<pollfd> pf(static_cast<size_t>(nranks));
  for (;;) {
    for (In& i : in) {
      i.blob.clear();
      i.got = 0;
      i.done = false;
    }
    int pending = nranks;
    while (pending > 0) {
      for (int r = 0; r < nranks; r++)
        pf[r] = {fds[r], static_cast<short>(in[r].done ? POLLRDHUP : (POLLIN | POLLRDHUP)), 0};
      if (poll(pf.data(), pf.size(), -1) < 0) {
        if (errno == EINTR) continue;
        close_all();
        return;
      }
      for (int r = 0; r < nranks; r++) {
        In& i = in[r];
        if (!pf[r].revents) continue;
        if (i.done) {  // answered its part and hung up: it is gone
          close_all();
          return;
        }
        ssize_t n;
        if (i.got < 4) {
          n = recv(fds[r], i.len_bytes + i.got, 4 - i.got, MSG_DONTWAIT);
        } else {
          uint32_t len;
          memcpy(&len, i.len_bytes, 4);
          i.blob.resize(len);
          n = recv(fds[r], &i.blob[i.got - 4], len - (i.got - 4), MSG_DONTWAIT);  // len > 0
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (n <= 0) {
          close_all();  // a rank left (normally: the end): release everybody
          return;
        }
        i.got += static_cast<size_t>(n);
        if (i.got >= 4) {
          uint32_t len;
          memcpy(&len, i.len_bytes, 4);
          if (i.got == 4 + static_cast<size_t>(len)) {
            i.blob.resize(len);
            i.done = true;
            pending--;
          }
        }
      }
    }
    std::string all;
    for (const In& i : in) {
      uint32_t len = static_cast<uint32_t>(i.blob.size());
      all.append(reinterpret_cast<const char*>(&len), sizeof(len));
      all += i.blob;
    }
    for (int r = 0; r < nranks; r++) {
      if (!write_all(fds[r], all.data(), all.size())) {
        close_all();
        return;
      }
    }
  }
}

}  // namespace

bool parse_host_port(const std::string& s, std::string* host, int* port) {
  size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon + 1 >= s.size()) return false;
  std::string h = s.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  char* end = nullptr;
  long p = strtol(s.c_str() + colon + 1, &end, 10);
  if (*end || p <= 0 || p > 65535) return false;
  *host = h;
  *port = static_cast<int>(p);
  return true;
}

RdvServer::~RdvServer() {
  close_listen();
  if (thread_.joinable()) thread_.detach();  // it owns everything it touches
}

void RdvServer::close_listen() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void RdvServer::listen(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string ps = std::to_string(port);
  int g = getaddrinfo(host.empty() ? nullptr : host.c_str(), ps.c_str(), &hints, &res);
  if (g != 0) throw PerfError("rendezvous: cannot resolve '" + host + "': " + gai_strerror(g));
  std::string err = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      fd_ = fd;
      break;
    }
    err = strerror(errno);
    close(fd);
  }
  freeaddrinfo(res);
  if (fd_ < 0)
    throw PerfError("rendezvous: cannot listen on " + (host.empty() ? std::string("*") : host) +
                    ":" + ps + ": " + err);
}

void RdvServer::start(int nranks) {
  int lfd = fd_;
  fd_ = -1;  // the thread owns it now
  done_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<bool>> done = done_;
  thread_ = std::thread([lfd, nranks, done] {
    serve_fd(lfd, nranks);
    done->store(true);
  });
}

bool RdvServer::wait(double timeout_s) {
  if (!thread_.joinable()) return true;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!done_->load()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  thread_.join();
  return true;
}

RdvClient::~RdvClient() { close(); }

void RdvClient::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void RdvClient::connect(const std::string& host, int port, int rank, int nranks, double timeout_s) {
  nranks_ = nranks;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::string ps = std::to_string(port);
  std::string err;
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int g = getaddrinfo(host.c_str(), ps.c_str(), &hints, &res);
    if (g != 0) {
      err = gai_strerror(g);
    } else {
      for (addrinfo* a = res; a && fd_ < 0; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          fd_ = fd;
        } else {
          err = strerror(errno);
          ::close(fd);
        }
      }
      freeaddrinfo(res);
    }
    if (fd_ >= 0) break;
    if (std::chrono::steady_clock::now() > deadline)
      throw PerfError("rendezvous: cannot connect to " + host + ":" + ps + ": " + err);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  nodelay(fd_);
  uint32_t r = static_cast<uint32_t>(rank);
  if (!write_all(fd_, &r, sizeof(r))) throw PerfError("rendezvous: hello failed");
}

std::vector<std::string> RdvClient::allgather(const std::string& mine) {
  const char* lost = "rendezvous connection lost (another rank failed or exited)";
  if (fd_ < 0 || !write_blob(fd_, mine)) throw PerfError(lost);
  std::vector<std::string> out(static_cast<size_t>(nranks_));
  for (auto& b : out)
    if (!read_blob(fd_, &b)) throw PerfError(lost);
  return out;
}

}  // namespace r2perf
