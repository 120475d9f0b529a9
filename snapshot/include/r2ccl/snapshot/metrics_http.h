// The /metrics endpoint of r2ccl_snapshotd: a minimal HTTP/1.0 responder on the daemon's asio
// event loop (header-only: r2ccl_snapshot_core does not use asio; include this where
// ASIO_STANDALONE is defined, as the daemon target does).
//
//   GET /metrics (or HEAD; a query string is ignored) -> 200, Content-Type
//       "text/plain; version=0.0.4; charset=utf-8", the body from the callback;
//   another path -> 404; another method -> 405 (Allow: GET, HEAD); a malformed request line
//   -> 400; a request header over max_request_bytes (8 KiB) -> 431; the callback throwing
//   -> 500. Every response has Content-Length and "Connection: close", and the connection is
//   closed after it (no keep-alive; Prometheus opens one per scrape, at most one every few
//   seconds).
//
// Nothing blocks the loop: every read, write and accept is asynchronous. Each connection has a
// deadline (timeout, 5 s) to deliver its request header, then another to take the response; a
// connection that misses one is closed (a client that connects and sends nothing holds one
// socket for 5 s, never the loop). After the response the server half-closes and reads (and
// discards) what the client still sends, up to 64 KiB or 1 s, before closing, so that a client
// whose oversized request was refused reads the 431 rather than a reset. At most
// max_connections (64) are open at once; connections beyond are closed when accepted. The body
// callback runs on the loop thread: keep it quick (rendering a registry and reading the health
// board take microseconds).
//
// Threads: construct, listen(), stop() and destroy on the loop's thread (or while the loop is
// not running); stats() from any thread. Destroy the server before its io_context. Handlers
// that are still queued when the server is destroyed find it stopped and do nothing.
#pragma once

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

namespace r2ccl::snap::metrics {

// Parses the --metrics flag: "ADDR:PORT" with a numeric IPv4 address or "[IPV6]:PORT", port
// 0..65535 (0: the kernel picks one; HttpServer::port() reports it). Returns false with *err
// naming the value and the accepted form.
inline bool parse_listen_address(const std::string& s, asio::ip::tcp::endpoint* ep,
                                 std::string* err) {
  const std::string form =
      " (accepted: ADDR:PORT with a numeric IPv4 address or [IPv6]:PORT, port 0-65535, e.g. "
      "127.0.0.1:9464, 0.0.0.0:9464, [::1]:9464)";
  std::string host, port;
  if (!s.empty() && s[0] == '[') {
    const size_t close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      *err = "'" + s + "' is not an address and port" + form;
      return false;
    }
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    const size_t colon = s.rfind(':');
    if (colon == std::string::npos || colon == 0 || s.find(':') != colon) {
      *err = "'" + s + "' is not an address and port" + form;
      return false;
    }
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  unsigned long p = 0;
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || (p = std::stoul(port)) > 65535) {
    *err = "'" + s + "': port '" + port + "' is not 0-65535" + form;
    return false;
  }
  std::error_code ec;
  const asio::ip::address a = asio::ip::make_address(host, ec);
  if (ec || (s[0] == '[') != a.is_v6()) {
    *err = "'" + s + "': '" + host + "' is not a numeric address" + form;
    return false;
  }
  *ep = asio::ip::tcp::endpoint(a, static_cast<uint16_t>(p));
  return true;
}

struct HttpServerOptions {
  size_t max_request_bytes = 8192;          // request line + headers, terminator included
  std::chrono::milliseconds timeout{5000};  // to receive the request; again to send
  size_t max_connections = 64;              // open at once; more are closed at accept
};

class HttpServer {
 public:
  using BodyFn = std::function<std::string()>;
  using Options = HttpServerOptions;
  struct Stats {
    uint64_t accepted = 0;   // connections accepted (busy ones included)
    uint64_t ok = 0;         // 200 responses
    uint64_t not_found = 0;  // 404
    uint64_t refused = 0;    // 400, 405, 431 and 500 responses
    uint64_t timeouts = 0;   // connections closed for missing a deadline
    uint64_t busy = 0;       // connections closed at accept (max_connections open)
  };

  HttpServer(asio::io_context& io, BodyFn body, Options opt = Options())
      : impl_(std::make_shared<Impl>(io, std::move(body), opt)) {}
  ~HttpServer() { stop(); }
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts accepting. Returns false with *err naming the address on failure.
  bool listen(const asio::ip::tcp::endpoint& ep, std::string* err) {
    std::error_code ec;
    auto& a = impl_->acceptor;
    a.open(ep.protocol(), ec);
    if (!ec) a.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
    if (!ec) a.bind(ep, ec);
    if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      std::error_code ignore;
      a.close(ignore);
      *err = "cannot listen on " + ep.address().to_string() + ":" + std::to_string(ep.port()) +
             ": " + ec.message();
      return false;
    }
    impl_->stopped = false;
    impl_->accept();
    return true;
  }
  // listen() on a "ADDR:PORT" string (parse_listen_address).
  bool listen(const std::string& addr_port, std::string* err) {
    asio::ip::tcp::endpoint ep;
    return parse_listen_address(addr_port, &ep, err) && listen(ep, err);
  }

  // The bound endpoint (port 0 resolved); a default endpoint when not listening.
  asio::ip::tcp::endpoint endpoint() const {
    std::error_code ec;
    auto ep = impl_->acceptor.local_endpoint(ec);
    return ec ? asio::ip::tcp::endpoint() : ep;
  }
  uint16_t port() const { return endpoint().port(); }

  // Stops accepting and closes every open connection. Idempotent.
  void stop() { impl_->stop(); }

  Stats stats() const {
    Stats s;
    s.accepted = impl_->accepted.load();
    s.ok = impl_->ok.load();
    s.not_found = impl_->not_found.load();
    s.refused = impl_->refused.load();
    s.timeouts = impl_->timeouts.load();
    s.busy = impl_->busy.load();
    return s;
  }

 private:
  struct Conn;
  // The state handlers share (held by the server and by every connection and pending accept),
  // so a handler that runs after the server is gone touches nothing freed.
  struct Impl : std::enable_shared_from_this<Impl> {
    Impl(asio::io_context& io_, BodyFn body_, Options opt_)
        : io(io_), acceptor(io_), retry(io_), body(std::move(body_)), opt(opt_) {}
    asio::io_context& io;
    asio::ip::tcp::acceptor acceptor;
    asio::steady_timer retry;  // accept errors (EMFILE): retry later, never spin
    BodyFn body;
    Options opt;
    bool stopped = true;
    uint64_t next_id = 0;
    std::map<uint64_t, std::weak_ptr<Conn>> conns;  // open connections
    std::atomic<uint64_t> accepted{0}, ok{0}, not_found{0}, refused{0}, timeouts{0}, busy{0};

    void accept() {
      auto self = shared_from_this();
      acceptor.async_accept([self](const std::error_code& ec, asio::ip::tcp::socket s) {
        if (self->stopped) return;
        if (ec) {
          if (ec == asio::error::operation_aborted) return;
          self->retry.expires_after(std::chrono::milliseconds(100));
          self->retry.async_wait([self](const std::error_code& e) {
            if (!e && !self->stopped) self->accept();
          });
          return;
        }
        ++self->accepted;
        if (self->conns.size() >= self->opt.max_connections) {
          ++self->busy;
          std::error_code ignore;
          s.close(ignore);
        } else {
          auto c = std::make_shared<Conn>(self, std::move(s), self->next_id++);
          self->conns[c->id] = c;
          c->start();
        }
        self->accept();
      });
    }
    void stop() {
      if (stopped && !acceptor.is_open()) return;
      stopped = true;
      std::error_code ignore;
      acceptor.close(ignore);
      retry.cancel();
      auto open = std::move(conns);
      conns.clear();
      for (auto& [id, w] : open)
        if (auto c = w.lock()) c->close();
    }
  };

  struct Conn : std::enable_shared_from_this<Conn> {
    enum class Phase { kRequest, kResponse, kDrain, kClosed };
    static constexpr size_t kDrainBytes = 64 * 1024;

    Conn(std::shared_ptr<Impl> s, asio::ip::tcp::socket so, uint64_t i)
        : srv(std::move(s)), sock(std::move(so)), timer(srv->io), id(i) {}
    std::shared_ptr<Impl> srv;
    asio::ip::tcp::socket sock;
    asio::steady_timer timer;
    uint64_t id;
    Phase phase = Phase::kRequest;
    std::string req;
    std::array<char, 1024> chunk{};
    std::string resp;
    size_t drained = 0;

    void start() {
      arm(srv->opt.timeout);
      read();
    }
    // (Re)arms the deadline of the current phase. A wait that already completed but whose
    // handler is still queued is recognised by the expiry having moved (see on_deadline).
    void arm(std::chrono::milliseconds d) {
      timer.expires_after(d);
      auto self = shared_from_this();
      timer.async_wait([self](const std::error_code& ec) {
        if (ec || self->phase == Phase::kClosed) return;
        if (self->timer.expiry() > std::chrono::steady_clock::now()) return;  // re-armed
        if (self->phase != Phase::kDrain) ++self->srv->timeouts;
        self->close();
      });
    }
    void read() {
      auto self = shared_from_this();
      sock.async_read_some(asio::buffer(chunk), [self](const std::error_code& ec, size_t n) {
        if (self->phase != Phase::kRequest) return;
        if (ec) return self->close();  // the client went away
        self->req.append(self->chunk.data(), n);
        self->on_data();
      });
    }
    void on_data() {
      const size_t max = srv->opt.max_request_bytes;
      size_t end = req.find("\r\n\r\n");
      if (end != std::string::npos) end += 4;
      const size_t lf = req.find("\n\n");  // bare LF line ends, tolerated
      if (lf != std::string::npos && (end == std::string::npos || lf + 2 < end)) end = lf + 2;
      if (end == std::string::npos) {
        if (req.size() >= max)
          return respond(431, "Request Header Fields Too Large",
                         "request header over " + std::to_string(max) + " bytes\n");
        return read();
      }
      if (end > max)
        return respond(431, "Request Header Fields Too Large",
                       "request header over " + std::to_string(max) + " bytes\n");
      handle(req.substr(0, req.find('\n')));
    }
    void handle(std::string line) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      // METHOD SP TARGET SP HTTP/x.y
      const size_t npos = std::string::npos;
      const size_t a = line.find(' ');
      const size_t b = a == npos ? npos : line.find(' ', a + 1);
      if (a == npos || a == 0 || b == npos || b == a + 1 || line.find(' ', b + 1) != npos ||
          line.compare(b + 1, 5, "HTTP/") != 0)
        return respond(400, "Bad Request", "malformed request line\n");
      const std::string method = line.substr(0, a);
      std::string target = line.substr(a + 1, b - a - 1);
      target = target.substr(0, target.find('?'));
      const bool head = method == "HEAD";
      if (method != "GET" && !head)
        return respond(405, "Method Not Allowed", "only GET and HEAD\n", head,
                       "Allow: GET, HEAD\r\n");
      if (target != "/metrics") {
        ++srv->not_found;
        return respond(404, "Not Found", "not found: the metrics are at /metrics\n", head);
      }
      std::string body;
      try {
        body = srv->body ? srv->body() : std::string();
      } catch (const std::exception& e) {
        return respond(500, "Internal Server Error", std::string("metrics: ") + e.what() + "\n",
                       head);
      } catch (...) {
        return respond(500, "Internal Server Error", "metrics: unknown error\n", head);
      }
      ++srv->ok;
      respond(200, "OK", body, head, "", "text/plain; version=0.0.4; charset=utf-8");
    }
    void respond(int code, const char* reason, const std::string& body, bool head = false,
                 const std::string& extra = "", const char* type = "text/plain; charset=utf-8") {
      if (code != 200 && code != 404) ++srv->refused;
      phase = Phase::kResponse;
      resp = "HTTP/1.0 " + std::to_string(code) + " " + reason + "\r\nContent-Type: " + type +
             "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + extra +
             "Connection: close\r\n\r\n";
      if (!head) resp += body;
      req.clear();
      req.shrink_to_fit();
      arm(srv->opt.timeout);
      auto self = shared_from_this();
      asio::async_write(sock, asio::buffer(resp), [self](const std::error_code& ec, size_t) {
        if (self->phase != Phase::kResponse) return;
        if (ec) return self->close();
        self->resp.clear();
        self->resp.shrink_to_fit();
        std::error_code ignore;
        self->sock.shutdown(asio::ip::tcp::socket::shutdown_send, ignore);
        self->phase = Phase::kDrain;
        self->arm(std::min(self->srv->opt.timeout, std::chrono::milliseconds(1000)));
        self->drain();
      });
    }
    // Reads and discards until the client closes (or the drain limit or deadline), so that
    // closing does not reset a connection whose response the client has not read yet.
    void drain() {
      auto self = shared_from_this();
      sock.async_read_some(asio::buffer(chunk), [self](const std::error_code& ec, size_t n) {
        if (self->phase != Phase::kDrain) return;
        self->drained += n;
        if (ec || self->drained > kDrainBytes) return self->close();
        self->drain();
      });
    }
    void close() {
      if (phase == Phase::kClosed) return;
      phase = Phase::kClosed;
      std::error_code ignore;
      timer.cancel();
      sock.close(ignore);
      srv->conns.erase(id);
    }
  };

  std::shared_ptr<Impl> impl_;
};

}  // namespace r2ccl::snap::metrics
