// The /metrics endpoint of r2ccl_snapshotd: prometheus-cpp's Exposer (civetweb, in
// prometheus-cpp-pull) serving the collectables added to it (header-only: it posts to the
// daemon's asio event loop, and r2ccl_snapshot_metrics does not use asio; include this where
// ASIO_STANDALONE is defined, as the daemon target does; link r2ccl_snapshot_metrics).
//
//   GET /metrics -> 200, "Content-Type: text/plain; charset=utf-8", the text exposition format
//   (prometheus-cpp's TextSerializer; gzip when the client accepts it), one connection per
//   request unless the client asks for keep-alive; paths not starting with /metrics -> 404
//   (civetweb matches a handler's URI as a prefix: /metricsx is served too). The page also
//   carries the Exposer's own exposer_transferred_bytes_total, exposer_scrapes_total and
//   exposer_request_latencies (a summary, microseconds).
//
// A scrape runs on one of civetweb's worker threads (Options::threads, 2): first `refresh`,
// posted to the event loop and waited for (up to refresh_timeout, 2 s; on time-out the page is
// served without waiting further, and stats().refresh_timeouts counts it), so that it may set
// gauges from loop-owned state; then the collectables in the order they were added, each on the
// worker thread (they must be thread-safe; an exception from one leaves its families out and is
// counted in stats().collect_errors). civetweb closes a connection that has not delivered its
// request within Options::timeout (5 s; civetweb's request_timeout_ms): a silent client holds
// one worker that long, so threads is 2 (the next scrape is served by the other one).
//
// Errors: listen() returns false with *err naming the address and the reason (parse error,
// address not on this host, port in use). Only IPv4: Debian's civetweb 1.15 is built without
// IPv6, and parse_listen_address refuses an [IPv6]:PORT with a message saying so.
//
// Threads: construct, listen(), stop() and destroy on the loop's thread (or while the loop is
// not running); add() and stats() from any thread. stop() wakes a scrape waiting for the loop
// and joins civetweb's threads (about 0.5 s: its poll interval); destroy the server before its
// io_context and before what its collectables read.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>

#include <asio.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "r2ccl/snapshot/metrics.h"

namespace r2ccl::snap::metrics {

// Parses the --metrics flag: "ADDR:PORT" with a numeric IPv4 address, port 0..65535 (0: the
// kernel picks one; HttpServer::port() reports it). Returns false with *err naming the value
// and the accepted form.
inline bool parse_listen_address(const std::string& s, asio::ip::tcp::endpoint* ep,
                                 std::string* err) {
  const std::string form =
      " (accepted: ADDR:PORT with a numeric IPv4 address, port 0-65535, e.g. 127.0.0.1:9464, "
      "0.0.0.0:9464)";
  if (!s.empty() && s[0] == '[') {
    *err = "'" + s +
           "': IPv6 is not served (the civetweb that prometheus-cpp serves with is built "
           "without IPv6 on Debian 12)" +
           form;
    return false;
  }
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || s.find(':') != colon) {
    *err = "'" + s + "' is not an address and port" + form;
    return false;
  }
  const std::string host = s.substr(0, colon), port = s.substr(colon + 1);
  unsigned long p = 0;
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || (p = std::stoul(port)) > 65535) {
    *err = "'" + s + "': port '" + port + "' is not 0-65535" + form;
    return false;
  }
  std::error_code ec;
  const asio::ip::address_v4 a = asio::ip::make_address_v4(host, ec);
  if (ec) {
    *err = "'" + s + "': '" + host + "' is not a numeric IPv4 address" + form;
    return false;
  }
  *ep = asio::ip::tcp::endpoint(a, static_cast<uint16_t>(p));
  return true;
}

struct HttpServerOptions {
  size_t threads = 2;                               // civetweb worker threads
  std::chrono::milliseconds timeout{5000};          // civetweb's request_timeout_ms
  std::chrono::milliseconds refresh_timeout{2000};  // the wait for `refresh` on the loop
};

class HttpServer {
 public:
  using RefreshFn = std::function<void()>;
  using Options = HttpServerOptions;
  struct Stats {
    uint64_t scrapes = 0;           // pages collected
    uint64_t refresh_timeouts = 0;  // scrapes served without the loop's refresh
    uint64_t collect_errors = 0;    // collectables that threw (their families left out)
  };

  // `refresh` (may be empty) runs on io's thread at the start of every scrape.
  explicit HttpServer(asio::io_context& io, RefreshFn refresh = {}, Options opt = Options())
      : io_(io), opt_(opt), page_(std::make_shared<PageCollectable>(io, std::move(refresh), opt)) {}
  ~HttpServer() { stop(); }
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Adds a collectable to the page (before or after listen()); the server shares its ownership.
  void add(std::shared_ptr<prometheus::Collectable> c) {
    std::lock_guard<std::mutex> g(page_->mu);
    page_->parts.push_back(std::move(c));
  }

  // Binds and starts serving. Returns false with *err naming the address on failure.
  bool listen(const asio::ip::tcp::endpoint& ep, std::string* err) {
    const std::string where = ep.address().to_string() + ":" + std::to_string(ep.port());
    if (exposer_) {
      *err = "cannot listen on " + where + ": already listening";
      return false;
    }
    if (!ep.address().is_v4()) {
      *err = "cannot listen on " + where + ": only IPv4 is served";
      return false;
    }
    try {
      exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
          "listening_ports", where, "num_threads", std::to_string(opt_.threads),
          "request_timeout_ms", std::to_string(opt_.timeout.count())});
    } catch (const std::exception& e) {
      // civetweb says only "possible problem binding to port": bind here for the reason.
      std::error_code ec;
      asio::ip::tcp::acceptor a(io_);
      a.open(ep.protocol(), ec);
      if (!ec) a.bind(ep, ec);
      *err = "cannot listen on " + where + ": " + (ec ? ec.message() : std::string(e.what()));
      return false;
    }
    {
      std::lock_guard<std::mutex> g(page_->mu);
      page_->stopped = false;
    }
    exposer_->RegisterCollectable(page_);
    const std::vector<int> ports = exposer_->GetListeningPorts();
    bound_ = asio::ip::tcp::endpoint(
        ep.address(), ports.empty() ? ep.port() : static_cast<uint16_t>(ports.front()));
    return true;
  }
  // listen() on an "ADDR:PORT" string (parse_listen_address).
  bool listen(const std::string& addr_port, std::string* err) {
    asio::ip::tcp::endpoint ep;
    return parse_listen_address(addr_port, &ep, err) && listen(ep, err);
  }

  // The bound endpoint (port 0 resolved: Exposer::GetListeningPorts); a default endpoint when
  // not listening.
  asio::ip::tcp::endpoint endpoint() const { return bound_; }
  uint16_t port() const { return bound_.port(); }

  // Stops serving (wakes a scrape waiting for the loop, joins civetweb's threads). Idempotent.
  void stop() {
    {
      std::lock_guard<std::mutex> g(page_->mu);
      page_->stopped = true;
    }
    page_->cv.notify_all();
    exposer_.reset();
    bound_ = asio::ip::tcp::endpoint();
  }

  Stats stats() const {
    Stats s;
    s.scrapes = page_->scrapes.load();
    s.refresh_timeouts = page_->refresh_timeouts.load();
    s.collect_errors = page_->collect_errors.load();
    return s;
  }

 private:
  // The one collectable the Exposer sees: refresh on the loop, then the parts in order. Shared
  // with the handlers posted to the loop, so one that runs after the server is gone finds it
  // stopped and touches nothing else.
  struct PageCollectable : prometheus::Collectable, std::enable_shared_from_this<PageCollectable> {
    PageCollectable(asio::io_context& io_, RefreshFn refresh_, Options opt_)
        : io(io_), refresh(std::move(refresh_)), opt(opt_) {}
    asio::io_context& io;
    const RefreshFn refresh;
    const Options opt;
    mutable std::mutex mu;
    mutable std::condition_variable cv;
    bool stopped = true;                                          // mu
    std::vector<std::shared_ptr<prometheus::Collectable>> parts;  // mu
    mutable std::atomic<uint64_t> scrapes{0}, refresh_timeouts{0}, collect_errors{0};

    Page Collect() const override {
      ++scrapes;
      if (refresh && !run_refresh()) ++refresh_timeouts;
      std::vector<std::shared_ptr<prometheus::Collectable>> ps;
      {
        std::lock_guard<std::mutex> g(mu);
        if (stopped) return {};
        ps = parts;
      }
      Page page;
      for (const auto& p : ps) {
        try {
          Page part = p->Collect();
          page.insert(page.end(), std::make_move_iterator(part.begin()),
                      std::make_move_iterator(part.end()));
        } catch (...) {  // never into civetweb's C code
          ++collect_errors;
        }
      }
      return page;
    }
    // Runs `refresh` on the loop; true when it ran within opt.refresh_timeout.
    bool run_refresh() const {
      auto self = shared_from_this();
      auto done = std::make_shared<bool>(false);  // mu
      asio::post(io, [self, done] {
        {
          std::lock_guard<std::mutex> g(self->mu);
          if (self->stopped) return;
        }
        try {
          self->refresh();
        } catch (...) {
          ++self->collect_errors;
        }
        {
          std::lock_guard<std::mutex> g(self->mu);
          *done = true;
        }
        self->cv.notify_all();
      });
      std::unique_lock<std::mutex> lk(mu);
      return cv.wait_for(lk, opt.refresh_timeout, [&] { return *done || stopped; }) && *done;
    }
  };

  asio::io_context& io_;
  const Options opt_;
  std::shared_ptr<PageCollectable> page_;
  std::unique_ptr<prometheus::Exposer> exposer_;  // after page_: destroyed (joined) first
  asio::ip::tcp::endpoint bound_;
};

}  // namespace r2ccl::snap::metrics
