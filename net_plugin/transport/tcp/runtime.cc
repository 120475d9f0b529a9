#include "transport/tcp/runtime.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "fault/fault_injector.h"
#include "r2ccl/log.h"
#include "r2ccl/random.h"
#include "sock/socket_util.h"
#include "transport/tcp/conn.h"

namespace r2ccl::net::tcp {
namespace {

constexpr TimeUs kIncomingHelloTimeout = 2 * kUsPerSec;

}  // namespace

Status Runtime::create(const Config* cfg, std::unique_ptr<Runtime>* out, std::string* err) {
  std::unique_ptr<Runtime> rt(new Runtime());
  R2CCL_CHECK(rt->init(cfg, err));
  *out = std::move(rt);
  return Status::kOk;
}

static_assert(kMaxRails == static_cast<int>(kMaxRailsPerProcess),
              "the HELLO's rail table holds every rail select_rails keeps");

Status Runtime::init(const Config* cfg, std::string* err) {
  std::string var = getenv("R2CCL_SOCKET_IFNAME")  ? "R2CCL_SOCKET_IFNAME"
                    : getenv("NCCL_SOCKET_IFNAME") ? "NCCL_SOCKET_IFNAME"
                                                   : "auto-detection";
  if (!select_rails(cfg->socket_ifname, var, system_interfaces(), static_cast<int>(cfg->speed_mbps),
                    &rails_, err))
    return Status::kInvalidUsage;
  std::vector<FaultSpec> faults;
  if (!parse_fault_specs(cfg->fault_inject, &faults, err)) return Status::kInvalidUsage;
  rank_ = static_cast<int>(cfg->rank);
  for (const auto& f : faults)
    if (f.rail >= static_cast<int>(rails_.size())) {
      *err = "R2CCL_FAULT_INJECT names rail " + std::to_string(f.rail) + " but there are only " +
             std::to_string(rails_.size()) + " rails";
      return Status::kInvalidUsage;
    }
  std::vector<RailInfo> info;
  std::vector<Device> devices;  // every rail is an NCCL device
  for (size_t d = 0; d < rails_.size(); ++d) {
    const Rail& r = rails_[d];
    RailInfo i;
    i.name = r.name;
    i.speed_mbps = r.speed_mbps;
    i.ifname = r.ifname;
    i.link_up = interface_running(r.ifname);
    i.predict.name = r.name;
    i.predict.kind = predict::RailSpec::Kind::kEth;
    i.predict.device = r.ifname;
    info.push_back(std::move(i));
    devices.push_back(Device{static_cast<int>(d), r.name, r.pci_path, d, 0,
                             r.name + " (" + std::to_string(r.speed_mbps) + " Mbps)"});
  }
  // Eager messages are at most one chunk (transport/handshake.h, negotiate): a larger
  // R2CCL_EAGER_THRESHOLD is lowered to the chunk size, said once here.
  const long long eager = std::min<long long>(cfg->eager_threshold, cfg->chunk_size);
  if (cfg->eager_threshold > cfg->chunk_size)
    R2CCL_WARN(
        "R2CCL_EAGER_THRESHOLD=%lld is above R2CCL_CHUNK_SIZE=%lld: messages of at most %lld "
        "bytes go eagerly (an eager message is one chunk)",
        static_cast<long long>(cfg->eager_threshold), static_cast<long long>(cfg->chunk_size),
        eager);
  char knobs[200];
  snprintf(knobs, sizeof(knobs),
           "%lld backup paths, chunk %lld KiB, %lld streams per path, stripe %s, eager up to %lld "
           "bytes",
           static_cast<long long>(cfg->backup_paths),
           static_cast<long long>(cfg->chunk_size / 1024),
           static_cast<long long>(cfg->nsocks_per_path), cfg->stripe ? "on" : "off", eager);
  const Traits traits{"TCP",
                      board::Transport::kTcp,
                      0x52324343434f4e4eull /* "R2CCCONN" */,
                      "link down",
                      "netlink",
                      2,
                      2 * kUsPerMs,
                      TransportKind::kTcp,
                      kWireVersion};
  R2CCL_CHECK(
      init_base(cfg, traits, std::move(info), std::move(devices), NCCL_PTR_HOST, knobs, err));
  FaultInjector::instance().configure(faults, rank_);
  if (FaultInjector::instance().enabled())
    R2CCL_WARN("fault injection armed for rank %d: %s", rank_, cfg->fault_inject.c_str());
  for (size_t i = 0; i < rails_.size(); ++i) {
    const int fd = open_rail_listener(rails_[i], err);
    if (fd < 0) {
      for (int f : listen_fds_) ::close(f);
      listen_fds_.clear();
      return Status::kSystem;
    }
    listen_fds_.push_back(fd);
    listen_ports_.push_back(local_port(fd));
  }
  rail_has_addr_.assign(rails_.size(), 1);
  accept_gates_.resize(listen_fds_.size());
  keep_spare_descriptor();
  start_background();
  return Status::kOk;
}

Status Runtime::listen(int dev, void* handle, Listener** out) {
  *out = nullptr;
  const int n = device_count();
  if (dev < 0 || dev >= n) {
    R2CCL_WARN("listen: device %d does not exist (%d devices)", dev, n);
    return Status::kInternal;
  }
  auto* l = new Listen(this, dev);
  WireHandle h{};
  h.magic = kHandleMagic;
  h.version = kWireVersion;
  h.kind = static_cast<uint8_t>(TransportKind::kTcp);
  memcpy(h.secret, l->secret, 16);
  h.listen_id = l->listen_id;
  for (int k = 0; k < n && h.n_endpoints < kMaxHandleEndpoints; ++k) {
    const int r = (dev + k) % n;
    const WireRail w = wire_rail(r);
    WireEndpoint& e = h.endpoints[h.n_endpoints++];
    e.family = w.family;
    e.rail = static_cast<uint8_t>(r);
    e.port = w.port;
    memcpy(e.addr, w.addr, sizeof(e.addr));
  }
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(handle, &h, sizeof(h));
  *out = l;
  return Status::kOk;
}

std::unique_ptr<ConnIo> Runtime::new_conn_io(int dev, int traffic_class, const void* handle,
                                             Listener* accept, Status* st) {
  (void)traffic_class;
  if (accept) return std::unique_ptr<ConnIo>(new Conn(this, static_cast<Listen*>(accept)));
  WireHandle h;
  memcpy(&h, handle, sizeof(h));
  if (h.magic != kHandleMagic || h.version != kWireVersion ||
      h.kind != static_cast<uint8_t>(TransportKind::kTcp) || h.n_endpoints == 0 ||
      h.n_endpoints > kMaxHandleEndpoints) {
    R2CCL_WARN(
        "connect: the handle is not an r2ccl v%u handle of the TCP transport (magic %08x, "
        "version %u, %u endpoints); was it made by another net plugin, or do both ends use "
        "the same R2CCL_TRANSPORT?",
        kWireVersion, h.magic, h.version, h.n_endpoints);
    *st = Status::kInternal;
    return nullptr;
  }
  for (int i = 0; i < h.n_endpoints; ++i)
    if (h.endpoints[i].family != AF_INET && h.endpoints[i].family != AF_INET6) {
      R2CCL_WARN("connect: handle endpoint %d has address family %u", i, h.endpoints[i].family);
      *st = Status::kInternal;
      return nullptr;
    }
  return std::unique_ptr<ConnIo>(new Conn(this, h, dev));
}

int Runtime::arm_faults(const char* spec) {
  if (!spec) {
    R2CCL_WARN("armFaults: no fault schedule given");
    return -1;
  }
  std::vector<FaultSpec> specs;
  std::string err;
  if (!parse_fault_specs(spec, &specs, &err)) {
    R2CCL_WARN("armFaults: %s", err.c_str());
    return -1;
  }
  for (const auto& f : specs)
    if (f.rail >= static_cast<int>(rails_.size())) {
      R2CCL_WARN("armFaults: rail %d does not exist (%zu rails)", f.rail, rails_.size());
      return -1;
    }
  FaultInjector::instance().arm_now(specs, rank_);
  R2CCL_WARN("fault injection armed for rank %d: %s", rank_, spec);
  return 0;
}

Rail Runtime::rail_now(int r, bool* has_addr) const {
  std::lock_guard<std::mutex> lk(addr_mu_);
  if (has_addr) *has_addr = rail_has_addr_.empty() || rail_has_addr_[r];
  return rails_[r];
}

WireRail Runtime::wire_rail(int r) const {
  WireRail w;
  memset(&w, 0, sizeof(w));
  std::lock_guard<std::mutex> lk(addr_mu_);
  const Rail& rail = rails_[r];
  w.family = static_cast<uint8_t>(rail.family);
  w.prefix_len = static_cast<uint8_t>(rail.prefix_len);
  w.port = listen_ports_[r];
  memcpy(w.addr, addr_bytes(rail.addr), rail.family == AF_INET ? 4 : 16);
  snprintf(w.name, sizeof(w.name), "%s", rail.name.c_str());
  return w;
}

void Runtime::fill_wire_rails(HelloBody* h) const {
  h->n_rails = static_cast<uint32_t>(std::min<size_t>(rails_.size(), kMaxRails));
  for (uint32_t i = 0; i < h->n_rails; ++i) h->rails[i] = wire_rail(static_cast<int>(i));
}

void Runtime::on_address_event(int ifindex, TimeUs now) { refresh_addresses(ifindex, now); }

void Runtime::refresh_addresses(int ifindex, TimeUs now) {
  (void)now;
  std::vector<IfAddr> ifs;
  if (!read_system_interfaces(&ifs)) return;  // unknown (out of descriptors), not gone
  for (size_t r = 0; r < rails_.size(); ++r) {
    if (ifindex >= 0 && rails_[r].ifindex != ifindex) continue;
    Rail cur = rail_now(static_cast<int>(r));
    bool had = false;
    {
      std::lock_guard<std::mutex> lk(addr_mu_);
      had = rail_has_addr_[r];
    }
    sockaddr_storage a{};
    int plen = cur.prefix_len;
    const bool has = resolve_rail_address(cur, ifs, &a, &plen);
    if (has == had && (!has || (same_address(a, cur.addr) && plen == cur.prefix_len))) continue;
    const std::string before =
        had ? addr_to_string(cur.addr) + "/" + std::to_string(cur.prefix_len) : "none";
    uint16_t port = 0;
    {
      std::lock_guard<std::mutex> lk(addr_mu_);
      port = listen_ports_[r];
    }
    if (has) {
      cur.addr = a;
      cur.family = a.ss_family;
      cur.addrlen = a.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      cur.prefix_len = plen;
      // Where the peers will reconnect: the same port when it is free, else a new one (the
      // address notice carries it).
      std::string err;
      int fd = open_rail_listener(cur, &err, port);
      if (fd < 0) fd = open_rail_listener(cur, &err, 0);
      if (fd < 0) {
        R2CCL_WARN("rail %s: cannot listen on its new address %s: %s; peers cannot reconnect to it",
                   cur.name.c_str(), addr_to_string(a).c_str(), err.c_str());
      } else {
        ::close(listen_fds_[r]);
        listen_fds_[r] = fd;
        port = local_port(fd);
      }
    }
    {
      std::lock_guard<std::mutex> lk(addr_mu_);
      if (has) {
        rails_[r].addr = cur.addr;
        rails_[r].family = cur.family;
        rails_[r].addrlen = cur.addrlen;
        rails_[r].prefix_len = cur.prefix_len;
      }
      listen_ports_[r] = port;
      rail_has_addr_[r] = has;
    }
    RailLive& l = live(static_cast<int>(r));
    l.has_addr.store(has, std::memory_order_relaxed);
    l.addr_events.fetch_add(1, std::memory_order_release);
    const std::string after =
        has ? addr_to_string(cur.addr) + "/" + std::to_string(cur.prefix_len) : "none";
    R2CCL_WARN("rail %s: address %s -> %s%s", cur.name.c_str(), before.c_str(), after.c_str(),
               has ? "; its paths reconnect from/to it and the peers are told"
                   : "; its paths are out of service until it has one");
  }
}

void Runtime::register_listen(Listen* l) {
  std::lock_guard<std::mutex> lk(listens_mu_);
  listens_.push_back(l);
}

void Runtime::unregister_listen(Listen* l) {
  std::lock_guard<std::mutex> lk(listens_mu_);
  listens_.erase(std::remove(listens_.begin(), listens_.end(), l), listens_.end());
}

// ------------------------------------------------------------------------------------------
// Background thread: the listeners and the hellos of incoming streams.

void Runtime::bg_add_fds(std::vector<pollfd>* fds) {
  // A listener that cannot accept for want of descriptors sits out its pause: it would stay
  // readable and spin the poll (-1: poll ignores the entry, the indices stay per rail).
  const TimeUs now = now_us();
  for (size_t r = 0; r < listen_fds_.size(); ++r)
    fds->push_back({accept_gates_[r].paused(now) ? -1 : listen_fds_[r], POLLIN, 0});
  for (const auto& p : pending_) fds->push_back({p.fd, POLLIN, 0});
}

void Runtime::bg_on_fds(const pollfd* fds, size_t n, TimeUs now) {
  for (size_t r = 0; r < listen_fds_.size() && r < n; ++r)
    if ((fds[r].revents & POLLIN) && fds[r].fd == listen_fds_[r])
      accept_new(static_cast<int>(r), now);
  // Addresses are read again on netlink events, when a connection asks, and once a second
  // whatever happens (no libnl, or a lost event; one getifaddrs, some 50 us).
  if (addr_recheck_.exchange(false, std::memory_order_relaxed) || now >= next_addr_check_) {
    next_addr_check_ = now + kAddrCheckPeriod;
    refresh_addresses(-1, now);
  }
  if (!pending_.empty()) service_handshakes(now);
}

void Runtime::accept_new(int rail, TimeUs now) {
  AcceptGate& gate = accept_gates_[rail];
  for (int k = 0; k < 16; ++k) {
    sockaddr_storage from;
    socklen_t fl = sizeof(from);
    const int fd = ::accept4(listen_fds_[rail], reinterpret_cast<sockaddr*>(&from), &fl,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      // EAGAIN: drained. EMFILE and the like: pause this listener (warned once per cause).
      // Anything else (a connector that gave up meanwhile): the next poll tries again.
      const int err = errno;
      if (gate.on_error(err, "rail " + rails_[rail].name, now) && gate.starved(now) &&
          (err == EMFILE || err == ENFILE))
        refuse_waiting(rail, now);
      return;
    }
    gate.on_accepted(now);
    set_socket_options(fd, cfg().tcp_user_timeout);
    Pending p;
    p.fd = fd;
    p.rail = rail;
    p.from = addr_to_string(from);
    p.deadline = now + kIncomingHelloTimeout;
    p.got = 0;
    pending_.push_back(std::move(p));
  }
}

// The connections waiting on a starved listener are refused with the cause (through the
// spare descriptor), so their connectors fail now, naming this process's limit, instead of
// waiting R2CCL_CONNECT_TIMEOUT. A running connection's reconnect that is refused so retries
// slowly; it does not end its connection.
void Runtime::refuse_waiting(int rail, TimeUs now) {
  const std::string text = "the listening process (rail " + rails_[rail].name +
                           ") cannot accept: " + accept_gates_[rail].starved_text(now) +
                           "; raise its descriptor limit (ulimit -n)";
  const WireRefusal w =
      make_refusal(Refusal::kNoResources, TransportKind::kTcp, false, nullptr, 0, 0, text);
  int n = 0;
  while (n < 16 && refuse_with_spare(listen_fds_[rail], &w, sizeof(w))) ++n;
  if (n > 0 && first_time("accept starved:" + rails_[rail].name))
    R2CCL_WARN("refused %d waiting connection%s on rail %s: %s (warned once per rail)", n,
               n == 1 ? "" : "s", rails_[rail].name.c_str(), text.c_str());
}

bool Runtime::accept_starved(TimeUs now, TimeUs since, std::string* why) const {
  for (size_t r = 0; r < accept_gates_.size(); ++r)
    if (accept_gates_[r].starved(now, since)) {
      *why = "the listener on rail " + rails_[r].name +
             " cannot accept: " + accept_gates_[r].starved_text(now);
      return true;
    }
  return false;
}

// HELLO_ACK: our rails and knobs, and the secret echoed back (the connector checks it).
bool Runtime::answer_hello(const Incoming& in) const {
  char out[sizeof(FrameHeader) + sizeof(HelloBody)];
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint8_t>(FrameType::kHelloAck);
  h.len = sizeof(HelloBody);
  h.a = kWireVersion;
  HelloBody b{};
  memcpy(b.secret, in.hello.secret, 16);
  b.conn_id = in.hello.conn_id;
  b.knobs = knobs();
  fill_wire_rails(&b);
  memcpy(out, &h, sizeof(h));
  memcpy(out + sizeof(h), &b, sizeof(b));
  return ::send(in.fd, out, sizeof(out), MSG_NOSIGNAL | MSG_DONTWAIT) ==
         static_cast<ssize_t>(sizeof(out));
}

WireKnobs Runtime::knobs() const { return own_knobs(static_cast<int>(cfg().nsocks_per_path)); }

// A checked hello: answered, then handed to its owner (a failed path's new streams to the
// receiving connection, a new connection's to its listen comm) under the owner's registry
// lock, so the owner cannot be closed meanwhile; a rail query is answered and closed. False
// with *why and *refusal when the hello is refused (the caller answers the refusal when it
// has one, and closes the socket).
bool Runtime::route_hello(const Incoming& in, const char** why, Refusal* refusal) {
  *refusal = Refusal::kAborted;
  bool bad_secret = false, unanswered = false;
  bool found;
  if (in.hello.flags & kHelloReconnect) {
    found = find_conn([&](Connection* c) {
      if (c->role() != Role::kRecv || c->id() != in.hello.conn_id) return false;
      auto& t = static_cast<Conn&>(c->io());
      if (!secrets_equal(t.secret(), in.hello.secret, 16)) {
        bad_secret = true;
        return false;
      }
      if (!answer_hello(in))
        unanswered = true;
      else
        t.push_incoming(in);
      return true;
    });
  } else {
    std::lock_guard<std::mutex> lk(listens_mu_);
    found = false;
    for (Listen* l : listens_) {
      if (l->listen_id != in.hello.listen_id) continue;
      if (!secrets_equal(l->secret, in.hello.secret, 16)) {
        bad_secret = true;
        continue;
      }
      found = true;
      if (!answer_hello(in)) {
        unanswered = true;
      } else if (in.hello.flags & kHelloQuery) {
        ::close(in.fd);  // answered: the connector now knows our rails
      } else {
        std::lock_guard<std::mutex> il(l->inbox_mu);
        l->inbox.push_back(in);
      }
      break;
    }
  }
  if (!found) {
    const bool reconnect = (in.hello.flags & kHelloReconnect) != 0;
    *why = bad_secret  ? "wrong secret (the handle is not that listen comm's, or it is corrupted)"
           : reconnect ? "unknown connection id (the connection was closed)"
                       : "unknown listen id (the listen comm was closed, or the handle is stale)";
    *refusal = bad_secret  ? Refusal::kWrongSecret
               : reconnect ? Refusal::kUnknownConn
                           : Refusal::kUnknownListen;
    return false;
  }
  if (unanswered) {
    *why = "could not answer the hello";
    return false;
  }
  return true;
}

// A WireRefusal from a connector that cannot use this listen comm's handle (the other
// transport, another wire version): the listen comm with that id and secret fails its
// accept() with the connector's message. False with *why when it names none of ours.
bool Runtime::take_refusal(const WireRefusal& r, const char** why) {
  std::lock_guard<std::mutex> lk(listens_mu_);
  for (Listen* l : listens_) {
    if (l->listen_id != r.listen_id) continue;
    if (!secrets_equal(l->secret, r.secret, 16)) {
      *why = "a refusal with a wrong secret";
      return false;
    }
    l->refuse(refusal_status(static_cast<Refusal>(r.reason)), r.text);
    return true;
  }
  *why = "a refusal for an unknown listen id";
  return false;
}

// Answers a refused hello with the cause (best effort: the socket closes right after).
void Runtime::send_refusal(int fd, Refusal r, const Incoming& in, const std::string& text) const {
  const WireRefusal w = make_refusal(r, TransportKind::kTcp, false, nullptr, in.hello.listen_id,
                                     in.hello.conn_id, text);
  if (::send(fd, &w, sizeof(w), MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof(w)))
    R2CCL_INFO(NCCL_NET, "could not send the refusal (%s): %s", refusal_name(r), strerror(errno));
}

void Runtime::service_handshakes(TimeUs now) {
  for (size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    bool drop = false, complete = false;
    const char* why = nullptr;
    // The in-process injector acts on the listener's sockets too: a black-holed or reset
    // rail answers no hello (it times out or is dropped).
    auto fault = FaultInjector::instance().query(p.rail, now);
    if (fault.down || fault.blackhole) {
      if (now > p.deadline || fault.down) {
        ::close(p.fd);
        pending_[i] = pending_.back();
        pending_.pop_back();
      } else {
        ++i;
      }
      continue;
    }
    // What arrives is a HELLO (frame header + body) or a connector's WireRefusal.
    bool refusal_msg = looks_like_refusal(p.buf, p.got);
    bool answer = false;  // refused with a reason the connector is told
    Refusal reason = Refusal::kAborted;
    std::string reason_text;
    auto want = [&] { return refusal_msg ? sizeof(WireRefusal) : sizeof(p.buf); };
    while (!drop && p.got < want()) {
      ssize_t n = ::recv(p.fd, p.buf + p.got, want() - p.got, MSG_DONTWAIT);
      if (n == 0) {
        drop = true;
        why = "closed before its hello";
      } else if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          drop = true;
          why = strerror(errno);
        }
        break;
      } else {
        p.got += static_cast<size_t>(n);
        refusal_msg = looks_like_refusal(p.buf, p.got);
        if (!refusal_msg && p.got >= sizeof(FrameHeader)) {
          FrameHeader h;
          memcpy(&h, p.buf, sizeof(h));
          if (h.magic != kFrameMagic || h.type != static_cast<uint8_t>(FrameType::kHello)) {
            drop = true;
            why = "not an r2ccl hello";
          } else if (h.a != kWireVersion) {
            drop = answer = true;
            reason = Refusal::kVersion;
            reason_text = version_mismatch_text(static_cast<uint8_t>(TransportKind::kTcp),
                                                h.a ? h.a : 2, kWireVersion);
            why = "wire version mismatch";
          } else if (h.len != sizeof(HelloBody)) {
            drop = true;
            why = "not an r2ccl hello";
          }
        }
      }
    }
    if (!drop && p.got == want()) complete = true;
    if (!drop && !complete && now > p.deadline) {
      drop = true;
      why = "no hello within 2 s";
    }
    Incoming in;
    in.fd = p.fd;
    in.local_rail = p.rail;
    if (complete && refusal_msg) {
      // A connector that cannot use the handle told us why: that listen comm's accept fails.
      WireRefusal r;
      if (!read_refusal(p.buf, p.got, &r))
        why = "a refusal of an unknown version";
      else if (take_refusal(r, &why))
        why = nullptr;
      drop = true;
      complete = false;
    } else if (complete) {
      memcpy(&in.hello, p.buf + sizeof(FrameHeader), sizeof(HelloBody));
      std::string bad;
      if (!(in.hello.flags & kHelloReconnect) && !knobs_valid(in.hello.knobs, kMaxStreams, &bad)) {
        drop = answer = true;
        reason = Refusal::kMalformed;
        reason_text = "malformed hello: " + bad;
        why = "malformed hello (knobs)";
      } else if (!route_hello(in, &why, &reason)) {
        drop = true;
        answer = reason != Refusal::kAborted;
        reason_text = why;
      }
    }
    if (answer) send_refusal(p.fd, reason, in, reason_text);
    if (drop) {
      const std::string& from = p.from;
      // An aborted reconnect (closed before its hello) is routine; anything else is not.
      if (!why) {
        // a refusal taken: the listen comm's accept() says it
      } else if (strcmp(why, "closed before its hello") == 0) {
        R2CCL_INFO(NCCL_NET, "connection on rail %s from %s closed before its hello",
                   rails_[p.rail].name.c_str(), from.c_str());
      } else {
        // At most one WARN a second per reason: a misconfigured or hostile peer must not flood
        // the log, and a new kind of refusal is always shown.
        Refusals& rf = refusals_[why ? why : "?"];
        if (now - rf.last_warn >= kUsPerSec) {
          R2CCL_WARN("refused a connection on rail %s from %s: %s%s", rails_[p.rail].name.c_str(),
                     from.c_str(), why ? why : "?",
                     rf.suppressed ? (" (" + std::to_string(rf.suppressed) +
                                      " more like it in the last second)")
                                         .c_str()
                                   : "");
          rf.last_warn = now;
          rf.suppressed = 0;
        } else {
          ++rf.suppressed;
        }
      }
      ::close(p.fd);
    }
    if (drop || complete) {
      pending_[i] = pending_.back();
      pending_.pop_back();
    } else {
      ++i;
    }
  }
}

}  // namespace r2ccl::net::tcp
