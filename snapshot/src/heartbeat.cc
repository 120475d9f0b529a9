#include "r2ccl/snapshot/heartbeat.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "r2ccl/snapshot/log.h"

namespace r2ccl::snap {
namespace {

bool resolve(const PeerSpec& p, sockaddr_storage* out, socklen_t* len) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  const std::string port = std::to_string(p.port);
  if (getaddrinfo(p.host.c_str(), port.c_str(), &hints, &res) != 0 || !res) return false;
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return true;
}
std::string addr_text(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET)
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, host, sizeof(host));
  else if (a.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, host, sizeof(host));
  return host;
}

}  // namespace

HeartbeatService::HeartbeatService(Config c, std::function<void(uint32_t, bool)> on_suspect)
    : c_(std::move(c)), on_suspect_(std::move(on_suspect)) {
  AccrualDetector::Config dc;
  dc.period = c_.period;
  dc.threshold = c_.phi_threshold;
  for (const auto& p : c_.peers)
    if (p.id != c_.self) {
      peers_[p.id] = Peer{};
      det_.emplace(p.id, AccrualDetector(dc));
    }
}

HeartbeatService::~HeartbeatService() { stop(); }

bool HeartbeatService::start(std::string* err) {
  const PeerSpec* me = nullptr;
  for (const auto& p : c_.peers)
    if (p.id == c_.self) me = &p;
  sockaddr_storage a{};
  socklen_t alen = 0;
  if (!me || !resolve(*me, &a, &alen)) {
    *err = "heartbeats: cannot resolve this node's address in the peer list";
    return false;
  }
  fd_ = socket(a.ss_family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&a), alen) != 0) {
    *err = "heartbeats: cannot bind UDP " + addr_text(a) + " port " + std::to_string(me->port) +
           ": " + strerror(errno);
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    return false;
  }
  thread_ = std::thread([this] { run(); });
  return true;
}

void HeartbeatService::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

std::map<uint32_t, HeartbeatService::Peer> HeartbeatService::snapshot() const {
  std::lock_guard<std::mutex> l(mu_);
  return peers_;
}

void HeartbeatService::read_block_file() {
  if (c_.block_file.empty()) return;
  std::ifstream f(c_.block_file);
  std::set<uint32_t> out, in;
  std::string w;
  while (f >> w) {
    const bool only_in = w.rfind("in:", 0) == 0;
    const std::string n = only_in ? w.substr(3) : w;
    if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) continue;
    const uint32_t id = uint32_t(std::stoul(n));
    in.insert(id);
    if (!only_in) out.insert(id);
  }
  std::lock_guard<std::mutex> l(mu_);
  blocked_out_ = out;
  blocked_in_ = in;
}

void HeartbeatService::send_all(TimeUs now) {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& p : c_.peers) {
    if (p.id == c_.self || blocked_out_.count(p.id)) continue;
    sockaddr_storage a{};
    socklen_t alen = 0;
    if (!resolve(p, &a, &alen)) {
      if (logged_.insert("resolve" + p.host).second)
        SNAP_WARN("heartbeats: cannot resolve node %u's host '%s' (retrying every period)", p.id,
                  p.host.c_str());
      continue;
    }
    HeartbeatDatagram d{};
    d.magic = kHeartbeatMagic;
    d.version = kHeartbeatVersion;
    d.node_id = c_.self;
    d.usable_gbps = gbps_.load();
    d.incarnation = incarnation_.load();
    d.sent_us = now;
    auto it = last_.find(p.id);
    if (it != last_.end()) {
      d.echo_us = it->second.first;
      d.echo_held_us = now - it->second.second;
    }
    d.token_len = uint32_t(c_.token.size());
    std::memcpy(d.token, c_.token.data(), std::min(c_.token.size(), sizeof(d.token)));
    if (sendto(fd_, &d, sizeof(d), MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&a), alen) ==
        ssize_t(sizeof(d)))
      ++sent_;
  }
}

void HeartbeatService::receive(TimeUs now) {
  for (;;) {
    HeartbeatDatagram d;
    sockaddr_storage from{};
    socklen_t flen = sizeof(from);
    const ssize_t n =
        recvfrom(fd_, &d, sizeof(d), MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&from), &flen);
    if (n < 0) return;
    uint8_t mine[64] = {};
    std::memcpy(mine, c_.token.data(), std::min(c_.token.size(), sizeof(mine)));
    uint8_t diff = 0;
    if (n == ssize_t(sizeof(d)))
      for (size_t i = 0; i < sizeof(mine); ++i) diff |= uint8_t(mine[i] ^ d.token[i]);
    std::lock_guard<std::mutex> l(mu_);
    const bool ok = n == ssize_t(sizeof(d)) && d.magic == kHeartbeatMagic &&
                    d.version == kHeartbeatVersion && d.token_len == c_.token.size() && diff == 0 &&
                    peers_.count(d.node_id);
    if (!ok) {
      ++dropped_;
      if (logged_.insert("bad" + addr_text(from)).second)
        SNAP_WARN(
            "heartbeats: dropped a datagram from %s (size, magic, version, token or node "
            "id not of this job)",
            addr_text(from).c_str());
      continue;
    }
    if (blocked_in_.count(d.node_id)) continue;
    ++received_;
    Peer& p = peers_[d.node_id];
    det_.at(d.node_id).heard(now);
    p.ever_heard = true;
    p.last_heard = now;
    if (std::isfinite(d.usable_gbps) && d.usable_gbps >= 0) p.usable_gbps = d.usable_gbps;
    p.incarnation = d.incarnation;
    last_[d.node_id] = {d.sent_us, now};
    if (d.echo_us > 0 && d.echo_held_us >= 0) {
      const int64_t rtt = now - d.echo_us - d.echo_held_us;
      if (rtt >= 0 && rtt < 60 * kUsPerSec)
        p.rtt_us = p.rtt_us < 0 ? rtt : (p.rtt_us * 7 + rtt) / 8;
    }
  }
}

void HeartbeatService::run() {
  TimeUs next_send = now_us();
  int turns = 0;
  while (!stop_) {
    TimeUs now = now_us();
    if (now >= next_send) {
      if (turns++ % 5 == 0) read_block_file();
      send_all(now);
      next_send = now + c_.period;
    }
    pollfd pf{fd_, POLLIN, 0};
    const int wait_ms =
        int(std::max<TimeUs>(1, std::min<TimeUs>(next_send - now, 50 * kUsPerMs) / kUsPerMs));
    poll(&pf, 1, wait_ms);
    now = now_us();
    receive(now);
    std::vector<std::pair<uint32_t, bool>> changes;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (auto& [id, p] : peers_) {
        const AccrualDetector& det = det_.at(id);
        p.phi = det.phi(now);
        const bool s = det.suspected(now);
        if (s != p.suspected) {
          p.suspected = s;
          changes.push_back({id, s});
        }
      }
    }
    for (const auto& [id, s] : changes) on_suspect_(id, s);
  }
}

}  // namespace r2ccl::snap
