// Shared pieces of the rail-lab suites (lab and long): a RAII rail lab, message streams with
// every byte checked, and timing helpers. Header-only, every function inline: the files of a
// suite are linked into one test executable.
#pragma once

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "net_harness.h"

namespace r2ccl::test {

// A rail lab for one test case; torn down on destruction.
class Lab {
 public:
  // `extra`: more `railab.sh up` options (e.g. "--latency 60").
  Lab(int rails, const std::string& rate, const std::string& extra = "") {
    prefix_ = "rt" + std::to_string(getpid() % 100000);
    std::string cmd = railab() + " up --rails " + std::to_string(rails) + " --prefix " + prefix_;
    if (!rate.empty()) cmd += " --rate " + rate;
    if (!extra.empty()) cmd += " " + extra;
    std::string out;
    ok_ = run_command(cmd, &out) == 0;
    if (!ok_) FAIL("railab up failed: " << out);
  }
  ~Lab() { run_command(railab() + " down --prefix " + prefix_); }
  std::string a() const { return prefix_ + "a"; }
  std::string b() const { return prefix_ + "b"; }
  // Runs a railab fault; returns its output (with the [SEC.USEC] stamp).
  std::string fault(const std::string& args) const {
    std::string out;
    run_command(railab() + " fault " + args + " --prefix " + prefix_, &out);
    return out;
  }
  // tx_bytes of rail0..rail(n-1) on `side` (the kernel's counters: what it really sent).
  std::vector<double> tx_bytes(int n, const std::string& side = "a") const {
    std::string cmd = "cat";
    for (int i = 0; i < n; ++i)
      cmd += " /sys/class/net/rail" + std::to_string(i) + "/statistics/tx_bytes";
    std::istringstream in(exec(side, cmd));
    std::vector<double> v;
    double x;
    while (in >> x) v.push_back(x);
    v.resize(static_cast<size_t>(n), 0.0);
    return v;
  }
  std::string exec(const std::string& side, const std::string& cmd) const {
    std::string out;
    run_command(railab() + " --prefix " + prefix_ + " exec " + side + " " + cmd, &out);
    return out;
  }
  static std::string railab() {
    return "bash " + env_or("R2CCL_TEST_RAILAB", R2CCL_SOURCE_DIR "/scripts/railab.sh");
  }

 private:
  std::string prefix_;
  bool ok_ = false;
};

inline PairOptions lab_pair(const Lab& lab, const std::string& tag) {
  PairOptions o;
  o.sender_netns = lab.a();
  o.receiver_netns = lab.b();
  o.env["R2CCL_SOCKET_IFNAME"] = "rail";
  o.sender_env["R2CCL_LOG_FILE"] = temp_path(tag + "-send.log");
  o.receiver_env["R2CCL_LOG_FILE"] = temp_path(tag + "-recv.log");
  o.sender_stderr = temp_path(tag + "-send.err");
  o.receiver_stderr = temp_path(tag + "-recv.err");
  return o;
}

// Sender and receiver bodies for a stream of `count` messages of `bytes`, every byte checked.
struct Stream {
  size_t bytes;
  int count;
  int timeout_ms;
  std::string started;  // file created once the first send is posted
};

inline int send_stream(Endpoint& ep, const Stream& s) {
  std::vector<char> buf(s.bytes);
  for (int i = 0; i < s.count; ++i) {
    fill_pattern(buf.data(), buf.size(), static_cast<uint64_t>(i) + 1);
    void* req = nullptr;
    ncclResult_t r = ep.post_send(buf.data(), buf.size(), &req, s.timeout_ms);
    if (r == ncclSuccess && i == 0 && !s.started.empty()) std::ofstream(s.started) << mono_us();
    if (r == ncclSuccess) r = ep.wait(req, s.timeout_ms);
    if (r != ncclSuccess) {
      fprintf(stderr, "send %d failed: %d\n", i, r);
      return 10;
    }
  }
  return 0;
}

// A stream that lasts until the file `stop` exists: messages of `bytes` (every byte a pattern of
// the message's index), one every `pace_ms` (0: back to back), then a 1-byte message that tells
// the receiver to stop. `started` is created once the first send is posted; when `done` is not
// empty, the CLOCK_MONOTONIC stamp (us) of every completed send is appended to it.
inline int send_until_stop(Endpoint& ep, size_t bytes, const std::string& started,
                           const std::string& stop, int pace_ms = 0, const std::string& done = "") {
  std::vector<char> buf(bytes);
  std::ofstream out;
  if (!done.empty()) out.open(done);
  for (int i = 0;; ++i) {
    const bool last = access(stop.c_str(), F_OK) == 0;
    const size_t n = last ? 1 : bytes;
    fill_pattern(buf.data(), n, static_cast<uint64_t>(i) + 1);
    void* req = nullptr;
    ncclResult_t r = ep.post_send(buf.data(), n, &req, 60000);
    if (r == ncclSuccess && i == 0) std::ofstream(started) << mono_us();
    if (r == ncclSuccess) r = ep.wait(req, 60000);
    if (r != ncclSuccess) {
      fprintf(stderr, "send %d failed: %d\n", i, r);
      return 10;
    }
    if (out.is_open()) out << mono_us() << "\n" << std::flush;
    if (last) return 0;
    if (pace_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pace_ms));
  }
}

// The receiving side of send_until_stop: every byte checked, until the 1-byte end marker.
inline int recv_until_marker(Endpoint& ep, size_t bytes) {
  std::vector<char> buf(bytes);
  for (int i = 0;; ++i) {
    int got = -1;
    ncclResult_t r = ep.recv(buf.data(), buf.size(), 60000, &got);
    if (r != ncclSuccess) {
      fprintf(stderr, "recv %d failed: %d\n", i, r);
      return 10;
    }
    const long long bad = check_pattern(buf.data(), static_cast<size_t>(got), i + 1ull);
    if (bad >= 0 || (got != 1 && got != static_cast<int>(bytes))) {
      fprintf(stderr, "recv %d: size %d, first wrong byte at %lld\n", i, got, bad);
      return 11;
    }
    if (got == 1) return 0;
  }
}

// Waits until `path` exists (the transfer started), then `ms` more. Bounded by 60 s.
inline void after_start(const std::string& path, int ms) {
  for (int i = 0; i < 6000 && access(path.c_str(), F_OK) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

inline int recv_stream(Endpoint& ep, const Stream& s) {
  std::vector<char> buf(s.bytes);
  for (int i = 0; i < s.count; ++i) {
    memset(buf.data(), 0xee, buf.size());
    int got = -1;
    ncclResult_t r = ep.recv(buf.data(), buf.size(), s.timeout_ms, &got);
    if (r != ncclSuccess) {
      fprintf(stderr, "recv %d failed: %d\n", i, r);
      return 10;
    }
    long long bad = check_pattern(buf.data(), buf.size(), static_cast<uint64_t>(i) + 1);
    if (got != static_cast<int>(s.bytes) || bad >= 0) {
      fprintf(stderr, "recv %d: size %d, first wrong byte at %lld\n", i, got, bad);
      return 11;
    }
  }
  return 0;
}

// Runs `fn` on a thread after `delay_ms`; join() waits for it.
class Later {
 public:
  Later(int delay_ms, std::function<void()> fn)
      : t_([=] {
          std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
          fn();
        }) {}
  ~Later() {
    if (t_.joinable()) t_.join();
  }

 private:
  std::thread t_;
};

// A rail of a 2-rail lab toggled down/up at random every 0.1-1.5 s for `seconds` under
// traffic: no errors, and the hold-down engages. The seed is printed and settable
// (R2CCL_TEST_SEED).
inline void random_toggle_scenario(int seconds, int min_holddowns) {
  Lab lab(2, "2gbit");
  unsigned seed = static_cast<unsigned>(atoi(
      env_or("R2CCL_TEST_SEED", std::to_string(std::random_device{}() % 100000).c_str()).c_str()));
  WARN("random flap seed " << seed << " (set R2CCL_TEST_SEED to repeat)");
  PairOptions o = lab_pair(lab, "toggle");
  const double rate_bytes_per_s = 200e6;  // conservative: keep traffic flowing past the flaps
  const size_t msg = 16u << 20;
  Stream s{msg, static_cast<int>((seconds + 3) * rate_bytes_per_s / msg), 60000,
           temp_path("toggle-started")};
  std::string flap_out;
  PairResult r;
  {
    Later flap(0, [&] {
      after_start(s.started, 300);
      flap_out = lab.fault("flap 0 --for " + std::to_string(seconds) + " --seed " +
                           std::to_string(seed) + " --min-ms 100 --max-ms 1500");
    });
    r = run_pair(
        o, [&](Endpoint& ep) { return send_stream(ep, s); },
        [&](Endpoint& ep) { return recv_stream(ep, s); });
  }
  std::string slog = read_file(o.sender_env["R2CCL_LOG_FILE"]);
  INFO("seed " << seed << "\nsender log:\n" << slog << "\nflap:\n" << flap_out);
  CHECK(r.sender_status == 0);
  CHECK(r.receiver_status == 0);
  CHECK(count_lines_containing(slog, "hold-down: rail rail0") >= min_holddowns);
  CHECK(count_lines_containing(slog, "give-up") == 0);
}

}  // namespace r2ccl::test
