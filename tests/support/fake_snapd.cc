#include "fake_snapd.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "r2ccl/snapshot/client_wire.h"

namespace r2ccl::test {

using namespace r2ccl::snap;

struct FakeSnapd::Conn {
  int fd = -1;
  std::mutex send_mu;
  std::atomic<bool> closed{false};
  std::atomic<uint32_t> queries{0};  // QUERYs read (StateBody.queries)
  void close_now() {
    if (!closed.exchange(true)) ::shutdown(fd, SHUT_RDWR);
  }
  bool send(ClientMsg type, const void* a, size_t na, const void* b = nullptr, size_t nb = 0) {
    std::lock_guard<std::mutex> l(send_mu);
    PeerHeader h{kClientMagic, kClientVersion, static_cast<uint16_t>(type),
                 static_cast<uint32_t>(na + nb), 0};
    return write_all(&h, sizeof(h)) && write_all(a, na) && write_all(b, nb);
  }
  bool write_all(const void* p, size_t n) {
    size_t off = 0;
    while (off < n) {
      ssize_t w = ::send(fd, static_cast<const uint8_t*>(p) + off, n - off, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return false;
      off += static_cast<size_t>(w);
    }
    return true;
  }
  bool read_all(void* p, size_t n) {
    size_t off = 0;
    while (off < n) {
      ssize_t r = ::recv(fd, static_cast<uint8_t*>(p) + off, n - off, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      off += static_cast<size_t>(r);
    }
    return true;
  }
};

FakeSnapd::FakeSnapd(std::string socket_path, FakeSnapdOptions opt)
    : path_(std::move(socket_path)), opt_(opt) {}

FakeSnapd::~FakeSnapd() { stop(); }

bool FakeSnapd::start(std::string* err) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path_.size() >= sizeof(addr.sun_path)) {
    *err = "socket path too long";
    return false;
  }
  std::memcpy(addr.sun_path, path_.c_str(), path_.size());
  ::unlink(path_.c_str());
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listen_fd_, 64) != 0) {
    *err = std::string("fake snapd: ") + std::strerror(errno);
    return false;
  }
  acceptor_ = std::thread([this] { accept_main(); });
  return true;
}

void FakeSnapd::stop() {
  if (stopping_.exchange(true)) return;
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  ::unlink(path_.c_str());
  std::vector<std::thread> ts;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& c : conns_) c->close_now();
    ts.swap(threads_);
  }
  for (auto& t : ts) t.join();
  std::lock_guard<std::mutex> l(mu_);
  for (auto& c : conns_) ::close(c->fd);
  conns_.clear();
}

void FakeSnapd::accept_main() {
  while (!stopping_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    auto c = std::make_shared<Conn>();
    c->fd = fd;
    std::lock_guard<std::mutex> l(mu_);
    conns_.push_back(c);
    threads_.emplace_back([this, c] { conn_main(c); });
  }
}

void FakeSnapd::set_options(const FakeSnapdOptions& opt) {
  std::lock_guard<std::mutex> l(mu_);
  opt_ = opt;
}

void FakeSnapd::set_epoch(uint64_t epoch) {
  {
    std::lock_guard<std::mutex> l(mu_);
    opt_.epoch = epoch;
  }
  push_state_all();
}

bool FakeSnapd::has_complete() const {
  std::lock_guard<std::mutex> l(mu_);
  return has_complete_;
}
uint64_t FakeSnapd::complete_step() const {
  std::lock_guard<std::mutex> l(mu_);
  return complete_;
}

std::vector<uint64_t> FakeSnapd::steps_held(uint32_t rank, uint32_t buffer) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<uint64_t> out;
  for (const auto& [k, v] : store_)
    if (std::get<0>(k) == rank && std::get<1>(k) == buffer) out.push_back(std::get<2>(k));
  return out;
}

int64_t FakeSnapd::base_step_of(uint32_t rank, uint32_t buffer, uint64_t step) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = store_.find({rank, buffer, step});
  return it == store_.end() ? -1 : static_cast<int64_t>(it->second.base_step);
}

bool FakeSnapd::send_state(Conn& c, int64_t complete_override) {
  StateBody s{};
  // The count before the state: a push from another thread that counts a QUERY was then built
  // after that QUERY was read, as the answer to it is.
  s.queries = c.queries.load();
  {
    std::lock_guard<std::mutex> l(mu_);
    s.node_id = 0;
    s.has_complete = has_complete_ || complete_override >= 0 ? 1 : 0;
    s.complete_step = complete_override >= 0 ? uint64_t(complete_override) : complete_;
    s.agreed.epoch = opt_.epoch;
    s.agreed.n_nodes = 1;
    s.agreed.members[0] = 1;
  }
  return c.send(ClientMsg::kState, &s, sizeof(s));
}

void FakeSnapd::push_state_all() {
  std::vector<std::shared_ptr<Conn>> cs;
  {
    std::lock_guard<std::mutex> l(mu_);
    cs = conns_;
  }
  for (auto& c : cs)
    if (!c->closed) send_state(*c);
}

void FakeSnapd::check_complete(uint64_t step) {
  auto it = steps_.find(step);
  if (it == steps_.end() || world_ == 0 || it->second.size() != world_) return;
  for (const auto& [rank, rs] : it->second)
    if (rs.n_buffers == 0 || rs.got.size() != rs.n_buffers) return;
  if (step > opt_.complete_limit) return;
  if (!has_complete_ || step > complete_) {
    has_complete_ = true;
    complete_ = step;
  }
}

void FakeSnapd::conn_main(std::shared_ptr<Conn> c) {
  constexpr uint64_t kMaxShard = 1ull << 30;
  for (;;) {
    PeerHeader h{};
    if (!c->read_all(&h, sizeof(h))) break;
    if (h.magic != kClientMagic || h.version != kClientVersion ||
        !client_payload_ok(h.type, h.length, kMaxShard))
      break;
    auto type = static_cast<ClientMsg>(h.type);
    if (type == ClientMsg::kShard) {
      int64_t delay;
      {
        std::lock_guard<std::mutex> l(mu_);
        delay = opt_.shard_read_delay_us;
      }
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    }
    std::vector<uint8_t> p(h.length);
    if (h.length && !c->read_all(p.data(), p.size())) break;
    switch (type) {
      case ClientMsg::kHello: {
        ClientHelloBody hello;
        std::memcpy(&hello, p.data(), sizeof(hello));
        {
          std::lock_guard<std::mutex> l(mu_);
          world_ = hello.world;
        }
        if (!send_state(*c)) c->close_now();
        break;
      }
      case ClientMsg::kQuery: {
        int64_t stale;
        {
          std::lock_guard<std::mutex> l(mu_);
          stale = opt_.stale_state_on_query;
        }
        if (stale >= 0) {
          if (!send_state(*c, stale)) {
            c->close_now();
            break;
          }
          pollfd p{c->fd, POLLIN, 0};
          (void)::poll(&p, 1, 500);
        }
        ++c->queries;
        if (!send_state(*c)) c->close_now();
        break;
      }
      case ClientMsg::kShard: {
        ShardMeta m;
        std::memcpy(&m, p.data(), sizeof(m));
        if (m.payload_bytes != p.size() - sizeof(m)) {
          c->close_now();
          break;
        }
        bool pushed = false;
        {
          std::lock_guard<std::mutex> l(mu_);
          bool had = has_complete_;
          uint64_t before = complete_;
          Shard sh;
          sh.base_step = m.base_step;
          sh.frame = std::move(p);
          store_[{m.rank, m.buffer, m.step}] = std::move(sh);
          RankStep& rs = steps_[m.step][m.rank];
          rs.n_buffers = m.n_buffers;
          rs.got.insert(m.buffer);
          check_complete(m.step);
          pushed = has_complete_ != had || complete_ != before;
        }
        ++shards_;
        if (pushed) push_state_all();
        break;
      }
      case ClientMsg::kFetch: {
        FetchBody f;
        std::memcpy(&f, p.data(), sizeof(f));
        std::vector<std::vector<uint8_t>> chain;
        bool refuse = false, close_after_one = false, corrupt = false;
        uint32_t refuse_status = 0;
        if (f.avoid_node != kNoNode) ++avoiding_;
        {
          std::lock_guard<std::mutex> l(mu_);
          int n = fetches_++;
          close_after_one = opt_.close_on_fetch >= 0 && n == opt_.close_on_fetch;
          if (opt_.refuse_buffer >= 0 && f.buffer == static_cast<uint32_t>(opt_.refuse_buffer)) {
            refuse = true;
            refuse_status = opt_.refuse_status;
          }
          corrupt = opt_.corrupt_buffer >= 0 &&
                    f.buffer == static_cast<uint32_t>(opt_.corrupt_buffer) &&
                    f.avoid_node != kCorruptNode;
          auto it = store_.find({f.rank, f.buffer, f.step});
          if (it != store_.end() && !refuse) {
            uint64_t base = it->second.base_step;
            for (auto j = store_.lower_bound({f.rank, f.buffer, base});
                 j != store_.end() && std::get<0>(j->first) == f.rank &&
                 std::get<1>(j->first) == f.buffer && std::get<2>(j->first) <= f.step;
                 ++j)
              if (j->second.base_step == base) chain.push_back(j->second.frame);
          }
        }
        FetchedHead head{};
        head.request = f.request;
        if (refuse || chain.empty()) {
          head.status = refuse ? refuse_status : static_cast<uint32_t>(FetchStatus::kNotHeld);
          c->send(ClientMsg::kFetched, &head, sizeof(head));
        } else {
          head.count = static_cast<uint32_t>(chain.size());
          head.source_node = corrupt ? kCorruptNode : 0;
          if (corrupt && chain[0].size() > sizeof(ShardMeta)) chain[0].back() ^= 0x10;
          for (uint32_t i = 0; i < chain.size(); ++i) {
            head.index = i;
            c->send(ClientMsg::kFetched, &head, sizeof(head), chain[i].data(), chain[i].size());
            if (close_after_one) break;
          }
        }
        if (close_after_one) c->close_now();
        break;
      }
      case ClientMsg::kKvPut: {
        KvBody kv;
        std::memcpy(&kv, p.data(), sizeof(kv));
        if (kv.value_bytes > kKvMaxValue) {
          c->close_now();
          break;
        }
        std::lock_guard<std::mutex> l(mu_);
        kv_[std::string(kv.key, strnlen(kv.key, kKvKeyBytes))] =
            std::vector<uint8_t>(kv.value, kv.value + kv.value_bytes);
        break;
      }
      case ClientMsg::kKvGet: {
        KvGetBody q;
        std::memcpy(&q, p.data(), sizeof(q));
        auto reply = std::make_unique<KvBody>();
        std::memset(reply.get(), 0, sizeof(KvBody));
        std::memcpy(reply->key, q.key, kKvKeyBytes);
        reply->key[kKvKeyBytes - 1] = 0;
        {
          std::lock_guard<std::mutex> l(mu_);
          auto it = kv_.find(std::string(reply->key));
          if (it == kv_.end()) {
            reply->origin_node = kKvAbsent;
          } else {
            reply->origin_node = 0;
            reply->value_bytes = static_cast<uint32_t>(it->second.size());
            std::memcpy(reply->value, it->second.data(), it->second.size());
          }
        }
        c->send(ClientMsg::kKvValue, reply.get(), sizeof(KvBody));
        break;
      }
      default: c->close_now(); break;
    }
    if (c->closed) break;
  }
  c->close_now();
}

}  // namespace r2ccl::test
