// The snapshot client library (libr2ccl-snapshot, C API) against a fake r2ccl_snapshotd
// (tests/support/fake_snapd.h): exact lossless round trips over chains with a base every K, restore
// of the newest COMPLETE step (never a later partial one, nor an older one whose STATE reached the
// client after its QUERY), a replacement process restoring a lost rank, lossy buffers restored
// within their reported error, loss scale and RNG blob, take() returning before the encode/send
// finishes (slow daemon) and double buffering, the snapshot interval, bad environment values, no
// daemon, the daemon closing mid-restore, a refused FETCH leaving the buffers untouched, events,
// kv, and misuse.
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "fake_snapd.h"
#include "r2ccl/snapshot/codec.h"
#include "r2ccl/snapshot_client.h"

using r2ccl::test::FakeSnapd;
using r2ccl::test::FakeSnapdOptions;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/r2snapcXXXXXX";
    REQUIRE(mkdtemp(t) != nullptr);
    path = t;
  }
  ~TempDir() {
    std::string cmd = "rm -rf '" + path + "'";
    (void)!system(cmd.c_str());
  }
  std::string sock() const { return path + "/d.sock"; }
};

// Sets (or unsets, value == nullptr) an environment variable for the scope.
struct EnvVar {
  std::string name, old;
  bool had;
  EnvVar(const char* n, const char* value) : name(n) {
    const char* o = getenv(n);
    had = o != nullptr;
    if (had) old = o;
    if (value)
      setenv(n, value, 1);
    else
      unsetenv(n);
  }
  ~EnvVar() {
    if (had)
      setenv(name.c_str(), old.c_str(), 1);
    else
      unsetenv(name.c_str());
  }
};

struct Daemon {
  TempDir dir;
  FakeSnapd d;
  explicit Daemon(FakeSnapdOptions o = {}) : d(dir.sock(), o) {
    std::string err;
    REQUIRE(d.start(&err));
  }
};

r2ccl_snap_t* open_ok(const std::string& sock, uint32_t rank = 0, uint32_t world = 1) {
  r2ccl_snap_t* h = nullptr;
  int rc = r2ccl_snap_open(sock.c_str(), rank, world, &h);
  INFO(r2ccl_snap_last_error(nullptr));
  REQUIRE(rc == R2CCL_SNAP_OK);
  REQUIRE(h != nullptr);
  return h;
}

#define SNAP_OK(expr)                     \
  do {                                    \
    int rc_ = (expr);                     \
    INFO(r2ccl_snap_last_error(nullptr)); \
    REQUIRE(rc_ == R2CCL_SNAP_OK);        \
  } while (0)

// A model's state: an f32 "weights" buffer, an opaque byte buffer and an f16 buffer.
struct Model {
  std::vector<float> w;
  std::vector<uint8_t> bytes;
  std::vector<uint16_t> h;
  std::mt19937 rng{7};
  explicit Model(size_t n = 1 << 16) : w(n), bytes(10000), h(n / 2) {
    std::normal_distribution<float> nd(0, 0.02f);
    for (auto& x : w) x = nd(rng);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 7);
    for (auto& x : h) x = r2ccl::snap::float_to_fp16(nd(rng));
  }
  void step() {  // a sparse update
    std::uniform_int_distribution<size_t> pick(0, w.size() - 1);
    for (int i = 0; i < 500; ++i) w[pick(rng)] += 1e-3f;
    bytes[pick(rng) % bytes.size()] ^= 0x5a;
    for (int i = 0; i < 200; ++i) {
      size_t j = pick(rng) % h.size();
      h[j] = r2ccl::snap::float_to_fp16(r2ccl::snap::fp16_to_float(h[j]) + 1e-3f);
    }
  }
  void reg(r2ccl_snap_t* s, int h_codec = R2CCL_SNAP_CODEC_LOSSLESS) {
    SNAP_OK(r2ccl_snap_register(s, 0, w.data(), w.size() * 4, R2CCL_SNAP_DTYPE_F32,
                                R2CCL_SNAP_CODEC_LOSSLESS, 0));
    SNAP_OK(r2ccl_snap_register(s, 1, bytes.data(), bytes.size(), R2CCL_SNAP_DTYPE_BYTES,
                                R2CCL_SNAP_CODEC_LOSSLESS, 0));
    SNAP_OK(r2ccl_snap_register(s, 2, h.data(), h.size() * 2, R2CCL_SNAP_DTYPE_F16, h_codec, 0));
  }
  struct Copy {
    std::vector<float> w;
    std::vector<uint8_t> bytes;
    std::vector<uint16_t> h;
  };
  Copy copy() const { return {w, bytes, h}; }
  bool equals(const Copy& c) const { return w == c.w && bytes == c.bytes && h == c.h; }
  void scramble() {
    std::fill(w.begin(), w.end(), -1.f);
    std::fill(bytes.begin(), bytes.end(), 0xee);
    std::fill(h.begin(), h.end(), 0x3c00);
  }
};

void wait_complete(FakeSnapd& d, uint64_t step) {
  for (int i = 0; i < 500 && !(d.has_complete() && d.complete_step() >= step); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(d.has_complete());
  REQUIRE(d.complete_step() == step);
}

// Takes steps 1..last of `m` (one model step before each), flushes, and waits until `last` is
// complete at the daemon.
void take_until_complete(r2ccl_snap_t* s, Model& m, FakeSnapd& d, uint64_t last) {
  for (uint64_t step = 1; step <= last; ++step) {
    m.step();
    SNAP_OK(r2ccl_snap_take(s, step, nullptr));
  }
  SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  wait_complete(d, last);
}

// Flushes, waits until `step` is complete at the daemon, restores and returns the step restored.
uint64_t flush_and_restore(r2ccl_snap_t* s, FakeSnapd& d, uint64_t step) {
  SNAP_OK(r2ccl_snap_flush(s, 20 * 1000000));
  wait_complete(d, step);
  uint64_t restored = 0;
  SNAP_OK(r2ccl_snap_restore(s, 20 * 1000000, &restored));
  return restored;
}

// flush() means "written to the socket": the fake may still be reading the last shard.
void wait_shards(FakeSnapd& d, uint64_t n) {
  for (int i = 0; i < 500 && d.shards_received() < n; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(d.shards_received() == n);
}

}  // namespace

TEST_CASE("snapshot client: exact round trip over chains with a base every K") {
  EnvVar k("R2CCL_SNAPSHOT_BASE_EVERY", "3");
  EnvVar iv("R2CCL_SNAPSHOT_INTERVAL", nullptr);
  Daemon dm;
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  Model m;
  m.reg(s);
  std::vector<Model::Copy> at(8);
  r2ccl_snap_take_stats_t st{};
  for (uint64_t step = 1; step <= 7; ++step) {
    m.step();
    at[step] = m.copy();
    SNAP_OK(r2ccl_snap_take(s, step, &st));
    CHECK(st.skipped == 0);
    CHECK(st.step == step);
    if (step >= 3) {  // takes before this one have finished by now (flush below)
      CHECK(st.prev_valid == 1);
      CHECK(st.prev_step == step - 1);
      CHECK(st.prev_raw_bytes > m.w.size() * 4);
      CHECK(st.prev_ratio > 0);
      CHECK(st.prev_max_abs_error == 0);
    }
    SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  }
  wait_shards(dm.d, 28);
  // Bases at 1, 4, 7 for every buffer (the metadata buffer 3 included).
  for (uint32_t b = 0; b < 4; ++b) {
    CHECK(dm.d.steps_held(0, b) == std::vector<uint64_t>{1, 2, 3, 4, 5, 6, 7});
    for (uint64_t step = 1; step <= 7; ++step)
      CHECK(dm.d.base_step_of(0, b, step) == int64_t((step - 1) / 3 * 3 + 1));
  }
  // A sparse delta compresses far better than the base.
  SNAP_OK(r2ccl_snap_take(s, 8, &st));
  CHECK(st.prev_step == 7);
  CHECK(st.prev_base_buffers == 4);  // 7 is a base
  SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  m.step();
  SNAP_OK(r2ccl_snap_take(s, 9, &st));
  CHECK(st.prev_step == 8);
  CHECK(st.prev_base_buffers == 0);
  CHECK(st.prev_ratio > 5);
  SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  wait_complete(dm.d, 9);

  at.resize(10);
  at[8] = at[7];
  at[9] = m.copy();
  m.scramble();
  uint64_t restored = 0;
  SNAP_OK(r2ccl_snap_restore(s, 10 * 1000000, &restored));
  CHECK(restored == 9);
  CHECK(m.equals(at[9]));

  // The next take continues with a new chain (a base) and must be beyond the restored step.
  CHECK(r2ccl_snap_take(s, 9, &st) == R2CCL_SNAP_ERR_INVALID);
  CHECK(std::string(r2ccl_snap_last_error(s)).find("beyond") != std::string::npos);
  SNAP_OK(r2ccl_snap_take(s, 10, &st));
  SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  wait_shards(dm.d, 40);
  for (uint32_t b = 0; b < 4; ++b) CHECK(dm.d.base_step_of(0, b, 10) == 10);
  r2ccl_snap_close(s);
}

TEST_CASE("snapshot client: restore gives the newest complete step, not a later partial one") {
  EnvVar k("R2CCL_SNAPSHOT_BASE_EVERY", "3");
  FakeSnapdOptions o;
  o.complete_limit = 5;  // steps 6.. never complete (a rank's replicas did not get them)
  Daemon dm(o);
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  Model m;
  m.reg(s);
  std::vector<Model::Copy> at(9);
  for (uint64_t step = 1; step <= 8; ++step) {
    m.step();
    at[step] = m.copy();
    SNAP_OK(r2ccl_snap_take(s, step, nullptr));
  }
  SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  r2ccl_snap_state_t stt{};
  wait_complete(dm.d, 5);
  m.scramble();
  uint64_t restored = 0;
  SNAP_OK(r2ccl_snap_restore(s, 10 * 1000000, &restored));
  CHECK(restored == 5);
  CHECK(m.equals(at[5]));  // chain 4 (base), 5
  SNAP_OK(r2ccl_snap_state(s, &stt));
  CHECK(stt.has_complete_step == 1);
  CHECK(stt.complete_step == 5);
  CHECK(stt.epoch == 1);
  CHECK(stt.member_count == 1);
  CHECK(stt.members[0] == 1);
  r2ccl_snap_close(s);
}

// Step 4 is complete at the daemon, but the STATE it pushed for step 3 is still on its way when
// restore() sends its QUERY (a CI run under AddressSanitizer on busy cores: the client's reader
// thread had not run yet) and the answer comes late: restore() restores what the answer says.
TEST_CASE("snapshot client: restore goes by the answer to its QUERY, not an older STATE") {
  Daemon dm;
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  Model m;
  m.reg(s);
  take_until_complete(s, m, dm.d, 4);
  Model::Copy at4 = m.copy();
  FakeSnapdOptions o;
  o.stale_state_on_query = 3;
  dm.d.set_options(o);
  // Twice: in the second restore the older STATE counts the first QUERY, not this one.
  for (int i = 0; i < 2; ++i) {
    m.scramble();
    uint64_t restored = 0;
    SNAP_OK(r2ccl_snap_restore(s, 10 * 1000000, &restored));
    CHECK(restored == 4);
    CHECK(m.equals(at4));
  }
  r2ccl_snap_close(s);
}

TEST_CASE("snapshot client: lossy buffer, loss scale and RNG blob; a replacement process") {
  EnvVar k("R2CCL_SNAPSHOT_BASE_EVERY", "4");
  FakeSnapdOptions o;
  o.complete_limit = 3;
  Daemon dm(o);
  r2ccl_snap_t* s = open_ok(dm.dir.sock(), 1, 2);
  r2ccl_snap_t* other = open_ok(dm.dir.sock(), 0, 2);  // rank 0: one opaque buffer
  std::vector<uint8_t> r0(4096, 1);
  SNAP_OK(r2ccl_snap_register(other, 0, r0.data(), r0.size(), R2CCL_SNAP_DTYPE_BYTES,
                              R2CCL_SNAP_CODEC_LOSSLESS, 0));
  Model m;
  m.reg(s, R2CCL_SNAP_CODEC_LOSSY);
  // Dense changes on the lossy buffer (every element).
  std::mt19937 g(3);
  std::normal_distribution<float> nd(0, 1e-3f);
  std::vector<uint8_t> blob1(5000), blob2(300, 9);
  for (size_t i = 0; i < blob1.size(); ++i) blob1[i] = uint8_t(i * 13 + 1);
  Model::Copy at3;
  r2ccl_snap_take_stats_t st{};
  for (uint64_t step = 1; step <= 4; ++step) {
    m.step();
    for (auto& x : m.h) x = r2ccl::snap::float_to_fp16(r2ccl::snap::fp16_to_float(x) + nd(g));
    SNAP_OK(r2ccl_snap_set_loss_scale(s, step == 3 ? 1024.0 : 2048.0));
    SNAP_OK(r2ccl_snap_set_rng_state(s, step == 3 ? blob1.data() : blob2.data(),
                                     step == 3 ? blob1.size() : blob2.size()));
    if (step == 3) at3 = m.copy();
    SNAP_OK(r2ccl_snap_take(s, step, &st));
    SNAP_OK(r2ccl_snap_take(other, step, nullptr));
    SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  }
  // Step 4's take reported step 3's lossy error (steps 2, 3 are lossy deltas).
  CHECK(st.prev_step == 3);
  double err3 = st.prev_max_abs_error;
  CHECK(err3 > 0);
  CHECK(err3 < 1e-3);
  SNAP_OK(r2ccl_snap_flush(other, 10 * 1000000));
  wait_complete(dm.d, 3);

  // The process of rank 1 is lost; a replacement opens with its rank id and restores.
  r2ccl_snap_close(s);
  Model fresh;
  fresh.scramble();
  r2ccl_snap_t* s2 = open_ok(dm.dir.sock(), 1, 2);
  fresh.reg(s2, R2CCL_SNAP_CODEC_LOSSY);
  double ls = 0;
  CHECK(r2ccl_snap_get_loss_scale(s2, &ls) == R2CCL_SNAP_ERR_NO_SNAPSHOT);
  uint64_t restored = 0;
  SNAP_OK(r2ccl_snap_restore(s2, 10 * 1000000, &restored));
  CHECK(restored == 3);
  CHECK(fresh.w == at3.w);
  CHECK(fresh.bytes == at3.bytes);
  double max_err = 0;
  for (size_t i = 0; i < at3.h.size(); ++i)
    max_err = std::max(max_err, double(std::fabs(r2ccl::snap::fp16_to_float(fresh.h[i]) -
                                                 r2ccl::snap::fp16_to_float(at3.h[i]))));
  CHECK(max_err <= err3 * 1.0001 + 1e-12);
  SNAP_OK(r2ccl_snap_get_loss_scale(s2, &ls));
  CHECK(ls == 1024.0);
  std::vector<uint8_t> got(R2CCL_SNAP_MAX_RNG_BYTES);
  size_t n = 0;
  CHECK(r2ccl_snap_get_rng_state(s2, got.data(), 10, &n) == R2CCL_SNAP_ERR_TOO_SMALL);
  CHECK(n == blob1.size());
  SNAP_OK(r2ccl_snap_get_rng_state(s2, got.data(), got.size(), &n));
  got.resize(n);
  CHECK(got == blob1);
  // The replacement continues: step 4 again (beyond 3), a base replacing the lost process's
  // step 4 (buffer 3, the metadata, is sent last).
  SNAP_OK(r2ccl_snap_take(s2, 4, nullptr));
  SNAP_OK(r2ccl_snap_flush(s2, 10 * 1000000));
  for (int i = 0; i < 500 && dm.d.base_step_of(1, 3, 4) != 4; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(dm.d.base_step_of(1, 0, 4) == 4);
  r2ccl_snap_close(s2);
  r2ccl_snap_close(other);
}

TEST_CASE("snapshot client: take() returns before the encode/send; double buffering") {
  FakeSnapdOptions o;
  o.shard_read_delay_us = 120000;  // the daemon reads each shard 120 ms late
  Daemon dm(o);
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  std::mt19937 g(5);
  std::vector<std::vector<uint32_t>> bufs(4, std::vector<uint32_t>(1 << 18));  // 4 x 1 MiB
  for (auto& b : bufs)
    for (auto& x : b) x = g();  // incompressible: each frame is ~1 MiB, beyond socket buffers
  for (uint32_t i = 0; i < 4; ++i)
    SNAP_OK(r2ccl_snap_register(s, i, bufs[i].data(), bufs[i].size() * 4, R2CCL_SNAP_DTYPE_F32,
                                R2CCL_SNAP_CODEC_LOSSLESS, 0));
  auto rerandomize = [&] {  // so every delta is as large as a base
    for (auto& b : bufs)
      for (auto& x : b) x = g();
  };
  r2ccl_snap_take_stats_t st{};
  double t0 = now_s();
  SNAP_OK(r2ccl_snap_take(s, 1, &st));
  double take1 = now_s() - t0;
  CHECK(st.wait_seconds < 0.05);
  CHECK(st.copy_seconds < 0.2);
  // The second take gets the other staging set without waiting...
  rerandomize();
  SNAP_OK(r2ccl_snap_take(s, 2, &st));
  CHECK(st.wait_seconds < 0.1);
  // ...the third waits for the first to be sent (4 shards of 1 MiB x 120 ms).
  rerandomize();
  SNAP_OK(r2ccl_snap_take(s, 3, &st));
  CHECK(st.wait_seconds > 0.2);
  double t1 = now_s();
  SNAP_OK(r2ccl_snap_flush(s, 30 * 1000000));
  double flush = now_s() - t1;
  CHECK(flush > 0.3);
  CHECK(take1 < flush / 3);
  wait_shards(dm.d, 15);
  // A flush that cannot finish in time says so.
  rerandomize();
  SNAP_OK(r2ccl_snap_take(s, 4, &st));
  CHECK(st.prev_step == 3);
  CHECK(st.prev_send_seconds > 0.1);
  CHECK(r2ccl_snap_flush(s, 1000) == R2CCL_SNAP_ERR_TIMEOUT);
  SNAP_OK(r2ccl_snap_flush(s, 30 * 1000000));
  r2ccl_snap_close(s);
}

TEST_CASE("snapshot client: interval skips steps") {
  EnvVar iv("R2CCL_SNAPSHOT_INTERVAL", "3");
  Daemon dm;
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  std::vector<uint8_t> b(1000, 3);
  SNAP_OK(r2ccl_snap_register(s, 0, b.data(), b.size(), 0, 0, 0));
  r2ccl_snap_take_stats_t st{};
  for (uint64_t step = 1; step <= 7; ++step) {
    SNAP_OK(r2ccl_snap_take(s, step, &st));
    CHECK(st.skipped == (step % 3 == 0 ? 0 : 1));
  }
  SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  wait_shards(dm.d, 4);
  CHECK(dm.d.steps_held(0, 0) == std::vector<uint64_t>{3, 6});
  r2ccl_snap_close(s);
}

TEST_CASE("snapshot client: bad environment values fail open, naming the variable") {
  TempDir dir;  // no daemon: configuration is checked first
  struct Case {
    const char* var;
    const char* value;
  };
  for (Case c : {Case{"R2CCL_SNAPSHOT_INTERVAL", "0"}, Case{"R2CCL_SNAPSHOT_INTERVAL", "abc"},
                 Case{"R2CCL_SNAPSHOT_INTERVAL", "-2"}, Case{"R2CCL_SNAPSHOT_INTERVAL", ""},
                 Case{"R2CCL_SNAPSHOT_BASE_EVERY", "0"}, Case{"R2CCL_SNAPSHOT_BASE_EVERY", "8x"},
                 Case{"R2CCL_SNAPSHOT_BASE_EVERY", "99999999999999999999999"}}) {
    EnvVar e(c.var, c.value);
    r2ccl_snap_t* h = nullptr;
    CHECK(r2ccl_snap_open(dir.sock().c_str(), 0, 1, &h) == R2CCL_SNAP_ERR_CONFIG);
    CHECK(h == nullptr);
    std::string msg = r2ccl_snap_last_error(nullptr);
    INFO(msg);
    CHECK(msg.find(c.var) != std::string::npos);
    CHECK(msg.find("accepted: an integer 1..") != std::string::npos);
  }
  for (const char* v : {"", "Direct", "copy", "staged "}) {
    EnvVar e("R2CCL_SNAPSHOT_RESTORE", v);
    r2ccl_snap_t* h = nullptr;
    CHECK(r2ccl_snap_open(dir.sock().c_str(), 0, 1, &h) == R2CCL_SNAP_ERR_CONFIG);
    CHECK(h == nullptr);
    std::string msg = r2ccl_snap_last_error(nullptr);
    INFO(msg);
    CHECK(msg.find("R2CCL_SNAPSHOT_RESTORE='" + std::string(v) + "'") != std::string::npos);
    CHECK(msg.find("accepted: direct") != std::string::npos);
    CHECK(msg.find("staged") != std::string::npos);
  }
}

TEST_CASE("snapshot client: no daemon gives a clear error naming the socket") {
  TempDir dir;
  r2ccl_snap_t* h = nullptr;
  CHECK(r2ccl_snap_open(dir.sock().c_str(), 0, 1, &h) == R2CCL_SNAP_ERR_CONNECT);
  std::string msg = r2ccl_snap_last_error(nullptr);
  CHECK(msg.find(dir.sock()) != std::string::npos);
  CHECK(msg.find("r2ccl_snapshotd running") != std::string::npos);
  {  // default path from the environment
    EnvVar a("R2CCL_SNAPSHOT_SOCKET", nullptr);
    EnvVar b("R2CCL_HEALTH_BOARD", "nosuchboard42");
    CHECK(r2ccl_snap_open(nullptr, 0, 1, &h) == R2CCL_SNAP_ERR_CONNECT);
    CHECK(std::string(r2ccl_snap_last_error(nullptr))
              .find("/tmp/r2ccl-snapshotd-nosuchboard42.sock") != std::string::npos);
    EnvVar c("R2CCL_SNAPSHOT_SOCKET", (dir.path + "/env.sock").c_str());
    CHECK(r2ccl_snap_open(nullptr, 0, 1, &h) == R2CCL_SNAP_ERR_CONNECT);
    CHECK(std::string(r2ccl_snap_last_error(nullptr)).find(dir.path + "/env.sock") !=
          std::string::npos);
  }
  CHECK(h == nullptr);
  CHECK(r2ccl_snap_open(dir.sock().c_str(), 2, 2, &h) == R2CCL_SNAP_ERR_INVALID);
  CHECK(r2ccl_snap_open(dir.sock().c_str(), 0, 0, &h) == R2CCL_SNAP_ERR_INVALID);
}

TEST_CASE("snapshot client: the daemon closing mid-restore is an error, not a hang") {
  const std::string mode = GENERATE(as<std::string>{}, "staged", "direct");
  INFO(mode);
  EnvVar e("R2CCL_SNAPSHOT_RESTORE", mode.c_str());
  FakeSnapdOptions o;
  o.close_on_fetch = 1;  // second FETCH: one chain frame, then the connection closes
  Daemon dm(o);
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  Model m;
  m.reg(s);
  take_until_complete(s, m, dm.d, 3);
  m.step();
  Model::Copy before = m.copy();
  uint64_t restored = 77;
  double t0 = now_s();
  CHECK(r2ccl_snap_restore(s, 60 * 1000000, &restored) == R2CCL_SNAP_ERR_CONNECTION);
  CHECK(now_s() - t0 < 5);
  CHECK(restored == 77);
  std::string msg = r2ccl_snap_last_error(s);
  INFO(msg);
  // Buffer 1's chain is cut short, or (the close seen first) buffer 2's FETCH cannot be sent:
  // either way the message names the restore, a buffer and the cause.
  CHECK(msg.find("restore of step 3, rank 0, buffer ") != std::string::npos);
  CHECK(msg.find("closed the connection") != std::string::npos);
  // Staged: nothing written. Direct: buffer 0 may have been decoded, and then the message
  // says the buffers were partly or wholly overwritten.
  if (mode == "staged" || msg.find("partly or wholly overwritten") == std::string::npos)
    CHECK(m.equals(before));
  // Sticky: everything after says the connection is gone.
  CHECK(r2ccl_snap_take(s, 4, nullptr) == R2CCL_SNAP_ERR_CONNECTION);
  r2ccl_snap_state_t stt{};
  CHECK(r2ccl_snap_state(s, &stt) == R2CCL_SNAP_ERR_CONNECTION);
  // wait_event still reports the change that came before the loss (complete step 3), then
  // the loss.
  SNAP_OK(r2ccl_snap_wait_event(s, 5 * 1000000, &stt));
  CHECK(stt.changes == R2CCL_SNAP_CHANGED_COMPLETE);
  CHECK(r2ccl_snap_wait_event(s, 5 * 1000000, &stt) == R2CCL_SNAP_ERR_CONNECTION);
  r2ccl_snap_close(s);
}

// R2CCL_SNAPSHOT_RESTORE=staged: a failed restore leaves the registered buffers as they were.
// direct (the default) decodes into them: a failure after a decode began says so, and the next
// restore brings every buffer back bit for bit.
TEST_CASE("snapshot client: a refused FETCH is an error; staged leaves the buffers untouched") {
  const std::string mode = GENERATE(as<std::string>{}, "staged", "direct");
  INFO(mode);
  EnvVar e("R2CCL_SNAPSHOT_RESTORE", mode.c_str());
  const bool staged = mode == "staged";
  FakeSnapdOptions o;
  o.refuse_buffer = 2;  // kCorrupt
  Daemon dm(o);
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  Model m;
  m.reg(s);
  take_until_complete(s, m, dm.d, 2);
  m.step();
  Model::Copy before = m.copy();
  uint64_t restored = 0;
  CHECK(r2ccl_snap_restore(s, 10 * 1000000, &restored) == R2CCL_SNAP_ERR_REFUSED);
  std::string msg = r2ccl_snap_last_error(s);
  INFO(msg);
  CHECK(msg.find("buffer 2") != std::string::npos);
  CHECK(msg.find("kCorrupt") != std::string::npos);
  const bool overwritten = msg.find("partly or wholly overwritten") != std::string::npos;
  if (staged) {
    // Buffers 0 and 1 may have been decoded already: still nothing written.
    CHECK(m.equals(before));
    CHECK_FALSE(overwritten);
  } else if (!m.equals(before)) {
    CHECK(overwritten);  // a decode began: the message says the buffers hold part of it
    CHECK(msg.find("R2CCL_SNAPSHOT_RESTORE=staged") != std::string::npos);
  }
  // The metadata buffer (id 3, after the three user buffers) refused: buffers 0 and 1 were taken
  // by the decoding threads before it and are decoded whatever happens to it, so direct mode
  // has overwritten them, and says so; staged has not.
  o.refuse_buffer = 3;
  dm.d.set_options(o);
  CHECK(r2ccl_snap_restore(s, 10 * 1000000, &restored) == R2CCL_SNAP_ERR_REFUSED);
  msg = r2ccl_snap_last_error(s);
  CHECK(msg.find("buffer 3 (metadata)") != std::string::npos);
  if (staged) {
    CHECK(m.equals(before));
    CHECK(msg.find("partly or wholly overwritten") == std::string::npos);
  } else {
    CHECK_FALSE(m.equals(before));
    CHECK(msg.find("partly or wholly overwritten") != std::string::npos);
  }
  o.refuse_buffer = -1;
  dm.d.set_options(o);
  SNAP_OK(r2ccl_snap_restore(s, 10 * 1000000, &restored));
  CHECK(restored == 2);
  // Staging set 1 was lent to the receiver during both restores (the failed one left frames
  // in flight): two takes back to back use both sets again, and the later one restores bit
  // for bit.
  m.step();
  SNAP_OK(r2ccl_snap_take(s, 3, nullptr));
  m.step();
  SNAP_OK(r2ccl_snap_take(s, 4, nullptr));
  Model::Copy at4 = m.copy();
  SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  wait_complete(dm.d, 4);
  m.step();
  SNAP_OK(r2ccl_snap_restore(s, 10 * 1000000, &restored));
  CHECK(restored == 4);
  CHECK(m.equals(at4));
  r2ccl_snap_close(s);
}

TEST_CASE("snapshot client: restore without a complete step, and a different registration") {
  Daemon dm;
  r2ccl_snap_t* s = open_ok(dm.dir.sock(), 0, 2);  // rank 1 never takes: nothing completes
  std::vector<uint8_t> b(100, 1);
  uint64_t restored = 0;
  CHECK(r2ccl_snap_restore(s, 1000000, &restored) == R2CCL_SNAP_ERR_INVALID);  // no buffer
  SNAP_OK(r2ccl_snap_register(s, 0, b.data(), b.size(), 0, 0, 0));
  SNAP_OK(r2ccl_snap_take(s, 1, nullptr));
  CHECK(r2ccl_snap_restore(s, 1000000, &restored) == R2CCL_SNAP_ERR_NO_SNAPSHOT);
  // Rank 1 takes with two buffers; a process restoring rank 1 with one buffer is refused.
  r2ccl_snap_t* r1 = open_ok(dm.dir.sock(), 1, 2);
  std::vector<uint8_t> c(100, 2), d(50, 3);
  SNAP_OK(r2ccl_snap_register(r1, 0, c.data(), c.size(), 0, 0, 0));
  SNAP_OK(r2ccl_snap_register(r1, 1, d.data(), d.size(), 0, 0, 0));
  SNAP_OK(r2ccl_snap_take(r1, 1, nullptr));
  SNAP_OK(r2ccl_snap_flush(r1, 10 * 1000000));
  wait_complete(dm.d, 1);
  r2ccl_snap_close(r1);
  r2ccl_snap_t* r1b = open_ok(dm.dir.sock(), 1, 2);
  SNAP_OK(r2ccl_snap_register(r1b, 0, c.data(), c.size(), 0, 0, 0));
  CHECK(r2ccl_snap_restore(r1b, 10 * 1000000, &restored) == R2CCL_SNAP_ERR_INVALID);
  CHECK(std::string(r2ccl_snap_last_error(r1b)).find("same order") != std::string::npos);
  r2ccl_snap_close(r1b);
  // The same buffers but a different size: the decoder refuses it (CORRUPT), nothing written
  // (staged; direct may have decoded buffer 1 already, and says so).
  EnvVar staged("R2CCL_SNAPSHOT_RESTORE", "staged");
  r2ccl_snap_t* r1c = open_ok(dm.dir.sock(), 1, 2);
  std::vector<uint8_t> c2(101, 9), d2(50, 9);
  SNAP_OK(r2ccl_snap_register(r1c, 0, c2.data(), c2.size(), 0, 0, 0));
  SNAP_OK(r2ccl_snap_register(r1c, 1, d2.data(), d2.size(), 0, 0, 0));
  CHECK(r2ccl_snap_restore(r1c, 10 * 1000000, &restored) == R2CCL_SNAP_ERR_CORRUPT);
  CHECK(c2 == std::vector<uint8_t>(101, 9));
  CHECK(d2 == std::vector<uint8_t>(50, 9));
  r2ccl_snap_close(r1c);
  // Direct, every buffer a different size: every chain is refused by its checks before anything
  // is written, so the buffers are untouched and the message does not say otherwise.
  {
    EnvVar direct("R2CCL_SNAPSHOT_RESTORE", "direct");
    r2ccl_snap_t* r1d = open_ok(dm.dir.sock(), 1, 2);
    std::vector<uint8_t> c3(101, 8), d3(52, 8);
    SNAP_OK(r2ccl_snap_register(r1d, 0, c3.data(), c3.size(), 0, 0, 0));
    SNAP_OK(r2ccl_snap_register(r1d, 1, d3.data(), d3.size(), 0, 0, 0));
    CHECK(r2ccl_snap_restore(r1d, 10 * 1000000, &restored) == R2CCL_SNAP_ERR_CORRUPT);
    const std::string m3 = r2ccl_snap_last_error(r1d);
    INFO(m3);
    CHECK(m3.find("overwritten") == std::string::npos);
    CHECK(c3 == std::vector<uint8_t>(101, 8));
    CHECK(d3 == std::vector<uint8_t>(52, 8));
    r2ccl_snap_close(r1d);
  }
  r2ccl_snap_close(s);
}

TEST_CASE("snapshot client: events, kv and misuse") {
  Daemon dm;
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  r2ccl_snap_state_t st{};
  CHECK(r2ccl_snap_wait_event(s, 50000, &st) == R2CCL_SNAP_ERR_TIMEOUT);
  std::thread bump([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    dm.d.set_epoch(2);
  });
  SNAP_OK(r2ccl_snap_wait_event(s, 5 * 1000000, &st));
  bump.join();
  CHECK(st.epoch == 2);
  CHECK(st.changes == R2CCL_SNAP_CHANGED_EPOCH);
  CHECK(r2ccl_snap_wait_event(s, 20000, &st) == R2CCL_SNAP_ERR_TIMEOUT);  // reported once

  std::vector<uint16_t> b(512, 0x3c00);
  // misuse
  CHECK(r2ccl_snap_register(s, 1, b.data(), 1024, R2CCL_SNAP_DTYPE_F16, 0, 0) ==
        R2CCL_SNAP_ERR_INVALID);  // ids are dense
  CHECK(r2ccl_snap_register(s, 0, b.data(), 1023, R2CCL_SNAP_DTYPE_F16, 0, 0) ==
        R2CCL_SNAP_ERR_INVALID);  // not a multiple of the element size
  CHECK(r2ccl_snap_register(s, 0, b.data(), 1024, R2CCL_SNAP_DTYPE_F32, R2CCL_SNAP_CODEC_LOSSY,
                            0) == R2CCL_SNAP_ERR_INVALID);  // lossy needs f16/bf16
  CHECK(r2ccl_snap_register(s, 0, b.data(), 1024, 9, 0, 0) == R2CCL_SNAP_ERR_INVALID);
#ifndef R2CCL_USE_CUDA
  CHECK(r2ccl_snap_register(s, 0, b.data(), 1024, R2CCL_SNAP_DTYPE_F16, 0,
                            R2CCL_SNAP_FLAG_DEVICE) == R2CCL_SNAP_ERR_UNSUPPORTED);
  CHECK(std::string(r2ccl_snap_last_error(s)).find("USE_CUDA") != std::string::npos);
#endif
  CHECK(r2ccl_snap_take(s, 1, nullptr) == R2CCL_SNAP_ERR_INVALID);  // nothing registered
  SNAP_OK(r2ccl_snap_register(s, 0, b.data(), 1024, R2CCL_SNAP_DTYPE_F16, 0, 0));
  std::vector<uint8_t> big(R2CCL_SNAP_MAX_RNG_BYTES + 1);
  CHECK(r2ccl_snap_set_rng_state(s, big.data(), big.size()) == R2CCL_SNAP_ERR_INVALID);
  SNAP_OK(r2ccl_snap_take(s, 5, nullptr));
  CHECK(r2ccl_snap_take(s, 5, nullptr) == R2CCL_SNAP_ERR_INVALID);  // steps grow
  CHECK(r2ccl_snap_register(s, 1, b.data(), 1024, R2CCL_SNAP_DTYPE_F16, 0, 0) ==
        R2CCL_SNAP_ERR_INVALID);  // after the first take
  SNAP_OK(r2ccl_snap_flush(s, 10 * 1000000));
  // The completed step is an event too.
  SNAP_OK(r2ccl_snap_wait_event(s, 5 * 1000000, &st));
  CHECK(st.changes == R2CCL_SNAP_CHANGED_COMPLETE);
  CHECK(st.complete_step == 5);

  // kv
  SNAP_OK(r2ccl_snap_kv_put(s, "pg-2", "10.0.0.1:29500", 14));
  char val[64] = {};
  size_t n = 0;
  SNAP_OK(r2ccl_snap_kv_get(s, "pg-2", val, sizeof(val), &n, 1000000));
  CHECK(std::string(val, n) == "10.0.0.1:29500");
  CHECK(r2ccl_snap_kv_get(s, "pg-2", val, 3, &n, 1000000) == R2CCL_SNAP_ERR_TOO_SMALL);
  CHECK(n == 14);
  double t0 = now_s();
  CHECK(r2ccl_snap_kv_get(s, "absent", val, sizeof(val), &n, 100000) == R2CCL_SNAP_ERR_TIMEOUT);
  double waited = now_s() - t0;
  CHECK(waited >= 0.09);
  CHECK(waited < 2);
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    r2ccl_snap_kv_put(s, "late", "x", 1);
  });
  SNAP_OK(r2ccl_snap_kv_get(s, "late", val, sizeof(val), &n, 5 * 1000000));
  later.join();
  CHECK(n == 1);
  std::string long_key(64, 'k');
  CHECK(r2ccl_snap_kv_put(s, long_key.c_str(), "x", 1) == R2CCL_SNAP_ERR_INVALID);
  CHECK(r2ccl_snap_kv_put(s, "k", big.data(), R2CCL_SNAP_MAX_KV_VALUE + 1) ==
        R2CCL_SNAP_ERR_INVALID);
  CHECK(std::string(r2ccl_snap_strerror(R2CCL_SNAP_ERR_TIMEOUT)) == "R2CCL_SNAP_ERR_TIMEOUT");
  r2ccl_snap_close(s);
  r2ccl_snap_close(nullptr);
}

// ---- recovery: the C helpers over a fake NCCL (function table) and the fake daemon's KV ----

// File-local (anonymous namespace): the unit suite's files share one executable, and another
// file has a fake_nccl of its own.
namespace {
namespace fake_nccl {
// A fake NCCL shared by the "ranks" (threads) of one test: versions, ids and communicators.
std::mutex mu;
int version = 22605;  // 2.26.5: no shrink
bool shrink_fails = false;
std::vector<std::string> calls;
int ids_made = 0;
struct Comm {
  int nranks, rank;
  std::string id;
};
void note(const std::string& c) {
  std::lock_guard<std::mutex> g(mu);
  calls.push_back(c);
}
int get_version(int* v) {
  *v = version;
  return 0;
}
int get_unique_id(void* id) {
  std::lock_guard<std::mutex> g(mu);
  std::memset(id, 0, 128);
  std::snprintf(static_cast<char*>(id), 128, "fake-id-%d", ++ids_made);
  calls.push_back("get_unique_id");
  return 0;
}
int init_rank(void** comm, int nranks, const void* id, int rank) {
  note("init_rank " + std::to_string(rank) + "/" + std::to_string(nranks) + " " +
       static_cast<const char*>(id));
  *comm = new Comm{nranks, rank, static_cast<const char*>(id)};
  return 0;
}
int shrink(void* comm, int* ex, int n, void** newcomm, void*, int flags) {
  auto* c = static_cast<Comm*>(comm);
  note("shrink from " + std::to_string(c->rank) + " excluding " + std::to_string(n) + " flags " +
       std::to_string(flags));
  if (shrink_fails) return 3;  // ncclInternalError
  int below = 0;
  for (int i = 0; i < n; ++i) below += ex[i] < c->rank;
  *newcomm = new Comm{c->nranks - n, c->rank - below, c->id};
  return 0;
}
int abort_comm(void* comm) {
  note("abort " + std::to_string(static_cast<Comm*>(comm)->rank));
  delete static_cast<Comm*>(comm);
  return 0;
}
int destroy_comm(void* comm) {
  note("destroy " + std::to_string(static_cast<Comm*>(comm)->rank));
  delete static_cast<Comm*>(comm);
  return 0;
}
const char* error_string(int r) { return r == 3 ? "internal error (fake)" : "fake error"; }
r2ccl_snap_nccl_ops_t table(bool with_shrink) {
  r2ccl_snap_nccl_ops_t t{};
  t.get_version = get_version;
  t.get_unique_id = get_unique_id;
  t.comm_init_rank = init_rank;
  t.comm_shrink = with_shrink ? shrink : nullptr;
  t.comm_abort = abort_comm;
  t.comm_destroy = destroy_comm;
  t.get_error_string = error_string;
  return t;
}
void reset(int v, bool fails) {
  std::lock_guard<std::mutex> g(mu);
  version = v;
  shrink_fails = fails;
  calls.clear();
  ids_made = 0;
}
}  // namespace fake_nccl
}  // namespace

TEST_CASE("snapshot client: communicator rebuild through a fake NCCL and the daemon's KV") {
  Daemon d;
  // Old communicator of 4 ranks; rank 3 lost. Ranks 0-2 survive.
  auto run = [&](bool replacement, bool with_shrink, std::vector<int>* new_ranks,
                 std::vector<int>* new_sizes, std::vector<std::string>* ids) {
    const r2ccl_snap_nccl_ops_t t = fake_nccl::table(with_shrink);
    std::vector<std::thread> th;
    std::vector<int> rc(4, -100);
    new_ranks->assign(4, -1);
    new_sizes->assign(4, 0);
    ids->assign(4, "");
    const int lost[] = {3};
    for (int r = 0; r < (replacement ? 4 : 3); ++r) {
      th.emplace_back([&, r] {
        r2ccl_snap_t* h = nullptr;
        if (r2ccl_snap_open(d.dir.sock().c_str(), r, 4, &h) != 0) return;
        void* old = r == 3 ? nullptr : new fake_nccl::Comm{4, r, "old"};
        void* nc = nullptr;
        rc[r] = r2ccl_snap_rebuild_comm(h, &t, old, r, 4, lost, 1, lost, replacement ? 1 : 0, 7,
                                        5 * 1000000, &nc, &(*new_ranks)[r], &(*new_sizes)[r]);
        if (rc[r] == 0) {
          (*ids)[r] = static_cast<fake_nccl::Comm*>(nc)->id;
          delete static_cast<fake_nccl::Comm*>(nc);
        }
        r2ccl_snap_close(h);
      });
    }
    for (auto& x : th) x.join();
    return rc;
  };
  std::vector<int> nr, ns;
  std::vector<std::string> ids;
  SECTION("NCCL 2.26: abort and re-init with an id from rank 0, a replacement takes rank 3") {
    fake_nccl::reset(22605, false);
    auto rc = run(true, true, &nr, &ns, &ids);
    CHECK(rc == std::vector<int>{0, 0, 0, 0});
    CHECK(nr == std::vector<int>{0, 1, 2, 3});
    CHECK(ns == std::vector<int>{4, 4, 4, 4});
    CHECK(ids[0] == "fake-id-1");  // one id, made once, received by every rank through the KV
    CHECK(ids[1] == ids[0]);
    CHECK(ids[3] == ids[0]);
    CHECK(fake_nccl::ids_made == 1);
    CHECK(std::count_if(fake_nccl::calls.begin(), fake_nccl::calls.end(),
                        [](const std::string& c) { return c.rfind("abort", 0) == 0; }) == 3);
  }
  SECTION("NCCL 2.27 without a replacement: the survivors shrink") {
    fake_nccl::reset(22703, false);
    auto rc = run(false, true, &nr, &ns, &ids);
    CHECK(rc[0] == 0);
    CHECK(rc[2] == 0);
    CHECK(nr[2] == 2);
    CHECK(ns[2] == 3);
    CHECK(fake_nccl::ids_made == 0);
    CHECK(fake_nccl::calls[0].find("shrink") == 0);
  }
  SECTION("a failing shrink falls back to a re-init on every survivor") {
    fake_nccl::reset(22703, true);
    auto rc = run(false, true, &nr, &ns, &ids);
    CHECK(rc[0] == 0);
    CHECK(rc[1] == 0);
    CHECK(rc[2] == 0);
    CHECK(ns[1] == 3);
    CHECK(ids[1] == ids[0]);
    CHECK(fake_nccl::ids_made == 1);
  }
  SECTION("bad arguments and a table without required calls are refused") {
    fake_nccl::reset(22605, false);
    r2ccl_snap_t* h = open_ok(d.dir.sock());
    r2ccl_snap_nccl_ops_t t = fake_nccl::table(false);
    t.comm_init_rank = nullptr;
    const int lost[] = {1};
    void* nc = nullptr;
    int a = 0, b = 0;
    CHECK(r2ccl_snap_rebuild_comm(h, &t, nullptr, 0, 2, lost, 1, nullptr, 0, 1, 1000, &nc, &a,
                                  &b) == R2CCL_SNAP_ERR_INVALID);
    CHECK_THAT(std::string(r2ccl_snap_last_error(nullptr)), Catch::Contains("comm_init_rank"));
    t = fake_nccl::table(false);
    CHECK(r2ccl_snap_rebuild_comm(h, &t, nullptr, 0, 2, lost, 0, nullptr, 0, 1, 1000, &nc, &a,
                                  &b) == R2CCL_SNAP_ERR_INVALID);
    // Rank 2 of 3 waits for the id that rank 1 (the lowest survivor) would publish; rank 1
    // never calls: a timeout naming the key, not a hang.
    const int lost0[] = {0};
    void* old = new fake_nccl::Comm{3, 2, "old"};
    CHECK(r2ccl_snap_rebuild_comm(h, &t, old, 2, 3, lost0, 1, nullptr, 0, 9, 200000, &nc, &a, &b) ==
          R2CCL_SNAP_ERR_TIMEOUT);
    CHECK_THAT(std::string(r2ccl_snap_last_error(nullptr)), Catch::Contains("r2ccl.rebuild.e9"));
    r2ccl_snap_close(h);
  }
}

TEST_CASE("snapshot client: the recovery hint and the recovery line") {
  double f = 0;
  int steps = 0;
  {
    EnvVar a("R2CCL_RECOVERY_LR_FACTOR", nullptr), b("R2CCL_RECOVERY_LR_STEPS", nullptr);
    SNAP_OK(r2ccl_snap_recovery_hint(&f, &steps));
    CHECK(f == 0.8);
    CHECK(steps == 3);
  }
  {
    EnvVar a("R2CCL_RECOVERY_LR_FACTOR", "1.0"), b("R2CCL_RECOVERY_LR_STEPS", "5");
    SNAP_OK(r2ccl_snap_recovery_hint(&f, &steps));
    CHECK(f == 1.0);
    CHECK(steps == 5);
  }
  {
    EnvVar a("R2CCL_RECOVERY_LR_FACTOR", "2"), b("R2CCL_RECOVERY_LR_STEPS", nullptr);
    CHECK(r2ccl_snap_recovery_hint(&f, &steps) == R2CCL_SNAP_ERR_CONFIG);
    CHECK(f == 0.8);  // the default is kept
    CHECK_THAT(std::string(r2ccl_snap_last_error(nullptr)),
               Catch::Contains("R2CCL_RECOVERY_LR_FACTOR"));
  }
  const char* names[] = {"detect", "rebuild", "restore"};
  const double secs[] = {0.3, 0.25, 1.5};
  char buf[256];
  SNAP_OK(r2ccl_snap_log_recovered("3", 3, names, secs, buf, sizeof(buf)));
  CHECK(std::string(buf) ==
        "[R2CCL] Successfully recovered in 2.050 s (node loss: 3; detect 0.300 s, rebuild 0.250 "
        "s, restore 1.500 s)");
  char tiny[8];
  CHECK(r2ccl_snap_log_recovered("3", 3, names, secs, tiny, sizeof(tiny)) ==
        R2CCL_SNAP_ERR_TOO_SMALL);
  const double bad[] = {0.1, -1, 0};
  CHECK(r2ccl_snap_log_recovered("3", 3, names, bad, buf, sizeof(buf)) == R2CCL_SNAP_ERR_INVALID);
}

// The library's lines on stderr are common's facade: "SNAPSHOT/R2CCL WARN ..." messages and the
// recovery line as an event, "[SEC.USEC] [R2CCL] Successfully recovered in ..." (the stamp and
// tag of the net plugin's recoveries; run_example.py and the docs look for that phrase).
TEST_CASE("snapshot client: its stderr lines carry the SNAPSHOT/R2CCL prefix or the event stamp") {
  fflush(stderr);
  char path[] = "/tmp/r2snapc-err-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  const int saved = dup(2);
  REQUIRE(saved >= 0);
  dup2(fd, 2);
  int hint_rc = 0, log_rc = 0;
  {
    EnvVar a("R2CCL_RECOVERY_LR_FACTOR", "2"), b("R2CCL_RECOVERY_LR_STEPS", nullptr);
    double f = 0;
    int steps = 0;
    hint_rc = r2ccl_snap_recovery_hint(&f, &steps);
  }
  const char* names[] = {"detect", "restore"};
  const double secs[] = {0.5, 0.25};
  char buf[256];
  log_rc = r2ccl_snap_log_recovered("3", 2, names, secs, buf, sizeof(buf));
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  FILE* f = fopen(path, "r");
  REQUIRE(f != nullptr);
  std::vector<std::string> lines;
  char line[1024];
  while (fgets(line, sizeof(line), f)) lines.emplace_back(line);
  fclose(f);
  unlink(path);
  CHECK(hint_rc == R2CCL_SNAP_ERR_CONFIG);
  CHECK(log_rc == R2CCL_SNAP_OK);
  REQUIRE(lines.size() == 2);
  INFO(lines[0] << lines[1]);
  CHECK(lines[0].rfind("SNAPSHOT/R2CCL WARN recovery hint: R2CCL_RECOVERY_LR_FACTOR=\"2\"", 0) ==
        0);
  CHECK(std::regex_match(lines[1], std::regex("\\[[0-9]+\\.[0-9]{6}\\] \\[R2CCL\\] Successfully "
                                              "recovered in 0\\.750 s \\(node loss: 3; detect "
                                              "0\\.500 s, restore 0\\.250 s\\)\n")));
  CHECK(
      std::string(buf) ==
      "[R2CCL] Successfully recovered in 0.750 s (node loss: 3; detect 0.500 s, restore 0.250 s)");
}

// take() returns before the buffers are copied (copy-on-write, the default) or after (copy):
// either way the snapshot is the state at take(), bit for bit, when every byte of every buffer
// is overwritten the moment take() returns (by this thread and by another one).
TEST_CASE(
    "snapshot client: take() snapshots the state at the call even when it is overwritten "
    "right after") {
  for (const char* mode : {"cow", "copy"}) {
    // Restores decode into the buffers (direct) or copy them over from scratch (staged).
    const char* restore_mode = mode[1] == 'o' ? "direct" : "staged";
    INFO(mode << ", restore " << restore_mode);
    EnvVar e("R2CCL_SNAPSHOT_TAKE", mode);
    EnvVar er("R2CCL_SNAPSHOT_RESTORE", restore_mode);
    Daemon dm;
    r2ccl_snap_t* s = open_ok(dm.dir.sock());
    // 12 MiB (6 copy-on-write chunks, not page aligned), 3 bytes (under a page), 1 MiB.
    std::vector<float> big((12u << 20) / 4 + 3);
    std::vector<uint8_t> tiny(3);
    std::vector<uint16_t> mid((1u << 20) / 2);
    SNAP_OK(r2ccl_snap_register(s, 0, big.data(), big.size() * 4, R2CCL_SNAP_DTYPE_F32,
                                R2CCL_SNAP_CODEC_LOSSLESS, 0));
    SNAP_OK(r2ccl_snap_register(s, 1, tiny.data(), tiny.size(), R2CCL_SNAP_DTYPE_BYTES,
                                R2CCL_SNAP_CODEC_LOSSLESS, 0));
    SNAP_OK(r2ccl_snap_register(s, 2, mid.data(), mid.size() * 2, R2CCL_SNAP_DTYPE_F16,
                                R2CCL_SNAP_CODEC_LOSSLESS, 0));
    auto fill = [&](uint32_t v) {
      for (size_t i = 0; i < big.size(); ++i) big[i] = float(i % 1000) + float(v);
      for (size_t i = 0; i < tiny.size(); ++i) tiny[i] = uint8_t(v + i);
      for (size_t i = 0; i < mid.size(); ++i) mid[i] = uint16_t(i * 3 + v);
    };
    auto holds = [&](uint32_t v) {
      for (size_t i = 0; i < big.size(); ++i)
        if (big[i] != float(i % 1000) + float(v)) return false;
      for (size_t i = 0; i < tiny.size(); ++i)
        if (tiny[i] != uint8_t(v + i)) return false;
      for (size_t i = 0; i < mid.size(); ++i)
        if (mid[i] != uint16_t(i * 3 + v)) return false;
      return true;
    };
    // Step 1 (a base): A at take(), B written at once, half of it by another thread.
    fill(1);
    SNAP_OK(r2ccl_snap_take(s, 1, nullptr));
    std::thread other([&] {
      for (size_t i = big.size() / 2; i < big.size(); ++i) big[i] = -1.f;
    });
    for (size_t i = 0; i < big.size() / 2; ++i) big[i] = -2.f;
    std::memset(tiny.data(), 0xab, tiny.size());
    std::memset(mid.data(), 0xcd, mid.size() * 2);
    other.join();
    CHECK(flush_and_restore(s, dm.d, 1) == 1);
    CHECK(holds(1));
    // Steps 2 and 3 (a new base, a delta): each overwritten right after its take().
    fill(2);
    SNAP_OK(r2ccl_snap_take(s, 2, nullptr));
    fill(3);
    SNAP_OK(r2ccl_snap_take(s, 3, nullptr));
    fill(4);
    CHECK(flush_and_restore(s, dm.d, 3) == 3);
    CHECK(holds(3));
    r2ccl_snap_close(s);
  }
}

// The client is the last hop's reader: it checks each shard once (its checksum), and a copy that
// fails is asked for again from elsewhere (the daemon skips the node that served it).
TEST_CASE("snapshot client: a corrupt shard is caught by its checksum and fetched again") {
  FakeSnapdOptions o;
  o.corrupt_buffer = 1;
  Daemon dm(o);
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  Model m;
  m.reg(s);
  take_until_complete(s, m, dm.d, 2);
  Model::Copy at2 = m.copy();
  m.scramble();
  uint64_t restored = 0;
  SNAP_OK(r2ccl_snap_restore(s, 10 * 1000000, &restored));
  CHECK(restored == 2);
  CHECK(m.equals(at2));
  CHECK(dm.d.fetches_avoiding() == 1);
  r2ccl_snap_close(s);
}

namespace {
// AnonHugePages (bytes) of the mappings that overlap [p, p + n), from /proc/self/smaps (a
// mapping merged with a neighbour counts the neighbour's too: compare with >=).
size_t huge_bytes_in(const void* p, size_t n) {
  const auto lo = reinterpret_cast<uintptr_t>(p), hi = lo + n;
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (!f) return 0;
  char line[512];
  bool in = false;
  size_t total = 0;
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long a, b, kb;
    if (std::sscanf(line, "%lx-%lx ", &a, &b) == 2)
      in = a < hi && b > lo;
    else if (in && std::sscanf(line, "AnonHugePages: %lu kB", &kb) == 1)
      total += kb * 1024;
  }
  std::fclose(f);
  return total;
}
// A 2 MiB-aligned anonymous mapping of n bytes (a multiple of 2 MiB), every page touched
// (touch: false, none).
uint8_t* aligned_map(size_t n, bool touch = true) {
  const size_t huge = 2u << 20;
  void* m = mmap(nullptr, n + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(m != MAP_FAILED);
  auto* p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(m) + huge - 1) / huge * huge);
  if (p > m) munmap(m, size_t(p - static_cast<uint8_t*>(m)));
  if (p + n < static_cast<uint8_t*>(m) + n + huge)
    munmap(p + n, size_t(static_cast<uint8_t*>(m) + n + huge - (p + n)));
  if (touch) std::memset(p, 1, n);
  return p;
}
}  // namespace

// Copy-on-write takes write-protect the buffers: on 2 MiB huge pages that is one page table
// entry per 2 MiB instead of 512. From the first take on, the library's worker turns the
// buffers' whole 2 MiB pages into huge pages while idle (MADV_COLLAPSE), except where the caller
// advised MADV_NOHUGEPAGE; snapshots stay exact through stores that fault on huge pages.
TEST_CASE("snapshot client: copy-on-write buffers become huge pages, exactly captured") {
  const size_t huge = 2u << 20;
  {
    uint8_t* probe = aligned_map(huge);
    const bool can = madvise(probe, huge, 25 /* MADV_COLLAPSE */) == 0;
    munmap(probe, huge);
    if (!can) {
      WARN("MADV_COLLAPSE not available here (Linux >= 6.1 with THP): nothing to check");
      return;
    }
  }
  EnvVar e("R2CCL_SNAPSHOT_TAKE", "cow");
  Daemon dm;
  r2ccl_snap_t* s = open_ok(dm.dir.sock());
  const size_t na = 16 * huge, nb = 4 * huge, nc = 8 * huge, nd = 8 * huge;
  uint8_t* a = aligned_map(na);
  uint8_t* b = aligned_map(nb);
  REQUIRE(madvise(b, nb, MADV_NOHUGEPAGE) == 0);
  const size_t b_huge_before = huge_bytes_in(b, nb);
  // c: MADV_NOHUGEPAGE on its first 2 MiB only (the rest is collapsed); d: one byte written per
  // 2 MiB (sparse: not made resident whole).
  uint8_t* c = aligned_map(nc);
  REQUIRE(madvise(c, huge, MADV_NOHUGEPAGE) == 0);
  uint8_t* d = aligned_map(nd, false);
  for (size_t i = 0; i < nd; i += huge) d[i] = 1;
  SNAP_OK(r2ccl_snap_register(s, 0, a, na, R2CCL_SNAP_DTYPE_BYTES, R2CCL_SNAP_CODEC_LOSSLESS, 0));
  SNAP_OK(r2ccl_snap_register(s, 1, b, nb, R2CCL_SNAP_DTYPE_BYTES, R2CCL_SNAP_CODEC_LOSSLESS, 0));
  SNAP_OK(r2ccl_snap_register(s, 2, c, nc, R2CCL_SNAP_DTYPE_BYTES, R2CCL_SNAP_CODEC_LOSSLESS, 0));
  SNAP_OK(r2ccl_snap_register(s, 3, d, nd, R2CCL_SNAP_DTYPE_BYTES, R2CCL_SNAP_CODEC_LOSSLESS, 0));
  auto fill = [&](uint8_t v) {
    for (size_t i = 0; i < na; ++i) a[i] = uint8_t(i * 7 + v);
    for (size_t i = 0; i < nb; ++i) b[i] = uint8_t(i * 3 + v);
  };
  auto holds = [&](uint8_t v) {
    for (size_t i = 0; i < na; ++i)
      if (a[i] != uint8_t(i * 7 + v)) return false;
    for (size_t i = 0; i < nb; ++i)
      if (b[i] != uint8_t(i * 3 + v)) return false;
    return true;
  };
  fill(1);
  SNAP_OK(r2ccl_snap_take(s, 1, nullptr));
  SNAP_OK(r2ccl_snap_flush(s, 20 * 1000000));
  size_t got = 0;
  for (int i = 0; i < 200 && (got = huge_bytes_in(a, na)) < na; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(got >= na);                              // every 2 MiB page of a
  CHECK(huge_bytes_in(b, nb) == b_huge_before);  // b as the caller asked
  for (int i = 0; i < 200 && huge_bytes_in(c + huge, nc - huge) < nc - huge; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(huge_bytes_in(c + huge, nc - huge) >= nc - huge);  // c after its first 2 MiB
  CHECK(huge_bytes_in(d, nd) == 0);                        // d stays sparse
  // A take on huge pages, then every byte overwritten by two threads (each store to a chunk
  // not copied yet faults and copies its 2 MiB first).
  fill(2);
  SNAP_OK(r2ccl_snap_take(s, 2, nullptr));
  std::thread other([&] { std::memset(a + na / 2, 0xee, na / 2); });
  std::memset(a, 0xdd, na / 2);
  std::memset(b, 0xcc, nb);
  other.join();
  CHECK(huge_bytes_in(a, na) >= na);  // the copied chunks were made writable whole
  CHECK(flush_and_restore(s, dm.d, 2) == 2);
  CHECK(holds(2));
  r2ccl_snap_close(s);
  munmap(a, na);
  munmap(b, nb);
  munmap(c, nc);
  munmap(d, nd);
}
