// ShardStore: round trips, CRC checks at put and at get (memory and disk), spilling beyond the
// memory limit, restart on the same directory (clean stop and spilled-only), bad files in the
// directory, retention (prune keeps exactly the chain), size limits, concurrency and close.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/snapshot/shard_store.h"

using namespace r2ccl::snap;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/r2ccl-store-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string sub(const std::string& name) const { return path + "/" + name; }
};

// Deterministic bytes for a key, so any thread can check what it reads.
std::vector<uint8_t> payload(const ShardKey& k, size_t n) {
  std::vector<uint8_t> b(n);
  uint64_t x = (uint64_t{k.rank} << 40) ^ (k.step << 8) ^ k.buffer ^ 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b[i] = static_cast<uint8_t>(x);
  }
  return b;
}

StoreStatus put_shard(ShardStore& s, const ShardKey& k, uint64_t base, size_t n,
                      std::string* err = nullptr) {
  auto b = payload(k, n);
  const uint64_t sum = shard_checksum(b.data(), b.size());
  return s.put(k, base, sum, std::move(b), err);
}

void require_shard(ShardStore& s, const ShardKey& k, size_t n, uint64_t base) {
  std::vector<uint8_t> out;
  ShardInfo info;
  std::string err;
  INFO(to_string(k) << ": " << err);
  REQUIRE(s.get(k, &out, &info, &err) == StoreStatus::kOk);
  CHECK(out == payload(k, n));
  CHECK(info.key == k);
  CHECK(info.base_step == base);
  CHECK(info.size == n);
  CHECK(info.checksum == shard_checksum(out.data(), out.size()));
}

std::set<std::string> shard_files(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string n = e.path().filename().string();
    if (n.size() > 6 && n.compare(n.size() - 6, 6, ".shard") == 0) out.insert(n);
  }
  return out;
}

void flip_byte(const std::string& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  uint8_t b = 0;
  REQUIRE(pread(fd, &b, 1, static_cast<off_t>(offset)) == 1);
  b ^= 0x10;
  REQUIRE(pwrite(fd, &b, 1, static_cast<off_t>(offset)) == 1);
  ::close(fd);
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  REQUIRE(f.good());
}

StoreConfig config(const std::string& dir, uint64_t mem_limit, uint64_t max_shard = 1 << 20) {
  StoreConfig c;
  c.spill_dir = dir;
  c.memory_limit_bytes = mem_limit;
  c.max_shard_bytes = max_shard;
  return c;
}

constexpr uint64_t kHeader = 64;  // spill file header bytes (shard_store.cc)

}  // namespace

TEST_CASE("put/get round trip, duplicates and replacement", "[snapshot][store]") {
  ShardStore s(config("", 1 << 20));
  std::string err;
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  const ShardKey a{1, 10, 0}, b{1, 10, 1}, c{2, 11, 0};
  REQUIRE(put_shard(s, a, 10, 1000) == StoreStatus::kOk);
  REQUIRE(put_shard(s, b, 10, 0) == StoreStatus::kOk);  // an empty shard is a shard
  REQUIRE(put_shard(s, c, 8, 333) == StoreStatus::kOk);
  require_shard(s, a, 1000, 10);
  require_shard(s, b, 0, 10);
  require_shard(s, c, 333, 8);
  CHECK(s.contains(a));
  CHECK_FALSE(s.contains(ShardKey{1, 11, 0}));

  std::vector<uint8_t> out{1, 2, 3};
  ShardInfo info;
  info.size = 77;
  CHECK(s.get(ShardKey{9, 9, 9}, &out, &info, &err) == StoreStatus::kNotFound);
  CHECK(err.find("rank 9 step 9 buffer 9") != std::string::npos);
  CHECK(out == std::vector<uint8_t>{1, 2, 3});  // outputs untouched on error
  CHECK(info.size == 77);

  // A duplicate changes nothing; a different copy of the same key replaces it.
  REQUIRE(put_shard(s, a, 10, 1000) == StoreStatus::kOk);
  CHECK(s.stats().memory_bytes == 1333);
  std::vector<uint8_t> other(500, 0xab);
  REQUIRE(s.put(a, 9, shard_checksum(other.data(), other.size()), other.data(), other.size(),
                &err) == StoreStatus::kOk);
  REQUIRE(s.get(a, &out, &info, &err) == StoreStatus::kOk);
  CHECK(out == other);
  CHECK(info.base_step == 9);
  StoreStats st = s.stats();
  CHECK(st.memory_bytes == 833);
  CHECK(st.shards_in_memory == 3);
  CHECK(st.shards_spilled == 0);

  auto all = s.list();
  REQUIRE(all.size() == 3);
  CHECK(all[0].key == a);  // (rank, buffer, step) order
  CHECK(all[1].key == b);
  CHECK(all[2].key == c);

  CHECK(s.erase(b));
  CHECK_FALSE(s.erase(b));
  CHECK(s.get(b, &out, nullptr, &err) == StoreStatus::kNotFound);
}

TEST_CASE("a CRC mismatch at put is refused and nothing is stored", "[snapshot][store]") {
  ShardStore s(config("", 1 << 20));
  std::string err;
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  const ShardKey k{3, 40, 1};
  auto b = payload(k, 256);
  const uint64_t good = shard_checksum(b.data(), b.size());
  CHECK(s.put(k, 40, good ^ 1, b, &err) == StoreStatus::kBadCrc);
  CHECK(err.find("rank 3 step 40 buffer 1") != std::string::npos);
  CHECK_FALSE(s.contains(k));
  CHECK(s.stats().crc_failures_put == 1);
  CHECK(s.stats().memory_bytes == 0);
  // The bytes damaged in transit: same refusal.
  auto bad = b;
  bad[100] ^= 1;
  CHECK(s.put(k, 40, good, bad, &err) == StoreStatus::kBadCrc);
  CHECK(s.stats().crc_failures_put == 2);
  CHECK(s.put(k, 40, good, b, &err) == StoreStatus::kOk);
  require_shard(s, k, 256, 40);
}

TEST_CASE("bad arguments and oversized shards are refused before any allocation",
          "[snapshot][store]") {
  ShardStore s(config("", 1 << 20, 4096));
  std::string err;
  CHECK(put_shard(s, ShardKey{0, 1, 0}, 1, 10) == StoreStatus::kClosed);  // not open yet
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  CHECK(s.check_size(4096, &err) == StoreStatus::kOk);
  CHECK(s.check_size(4097, &err) == StoreStatus::kTooLarge);
  CHECK(err.find("4097") != std::string::npos);
  CHECK(put_shard(s, ShardKey{0, 1, 0}, 1, 4097, &err) == StoreStatus::kTooLarge);
  // The pointer overload checks the size before it copies: a 1 TiB claim over 16 real bytes
  // is refused without touching (or allocating) anything.
  uint8_t small[16] = {};
  CHECK(s.put(ShardKey{0, 1, 0}, 1, 0, small, size_t{1} << 40, &err) == StoreStatus::kTooLarge);
  CHECK(s.put(ShardKey{0, 1, 0}, 1, 0, nullptr, 8, &err) == StoreStatus::kInvalid);
  CHECK(put_shard(s, ShardKey{0, 5, 0}, 6, 10, &err) == StoreStatus::kInvalid);  // base > step
  CHECK(s.stats().shards_in_memory == 0);

  StoreConfig bad = config("", 0);
  ShardStore z(bad);
  CHECK(z.open(nullptr, &err) == StoreStatus::kInvalid);
  CHECK(s.open(nullptr, &err) == StoreStatus::kClosed);  // twice
}

TEST_CASE("memory only: the limit is a hard limit", "[snapshot][store]") {
  ShardStore s(config("", 3000));
  std::string err;
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  REQUIRE(put_shard(s, ShardKey{0, 1, 0}, 1, 1000) == StoreStatus::kOk);
  REQUIRE(put_shard(s, ShardKey{0, 2, 0}, 1, 2000) == StoreStatus::kOk);
  CHECK(put_shard(s, ShardKey{0, 3, 0}, 1, 1, &err) == StoreStatus::kFull);
  CHECK(err.find("rank 0 step 3 buffer 0") != std::string::npos);
  // Replacing a shard with one of the same size fits.
  std::vector<uint8_t> b(1000, 7);
  CHECK(s.put(ShardKey{0, 1, 0}, 1, shard_checksum(b.data(), b.size()), b, &err) ==
        StoreStatus::kOk);
  CHECK(s.stats().memory_bytes == 3000);
}

TEST_CASE("beyond the memory limit the least recently used shards spill; get is unchanged",
          "[snapshot][store]") {
  TempDir d;
  const std::string dir = d.sub("spill");  // created by open()
  ShardStore s(config(dir, 10000));
  std::string err;
  OpenReport rep;
  REQUIRE(s.open(&rep, &err) == StoreStatus::kOk);
  CHECK(rep.indexed == 0);
  CHECK(rep.skipped.empty());
  std::vector<ShardKey> keys;
  for (uint32_t r = 0; r < 4; ++r)
    for (uint64_t step = 1; step <= 5; ++step) keys.push_back(ShardKey{r, step, 0});
  for (const auto& k : keys) {
    REQUIRE(put_shard(s, k, 1, 1000) == StoreStatus::kOk);
    // Keep rank 0 step 1 hot: it must never be the least recently used one.
    require_shard(s, keys[0], 1000, 1);
  }
  StoreStats st = s.stats();
  CHECK(st.memory_bytes <= 10000);
  CHECK(st.memory_bytes + st.spilled_bytes == 20000);
  CHECK(st.shards_in_memory + st.shards_spilled == 20);
  CHECK(st.shards_spilled == 10);
  CHECK(st.spills == 10);
  auto files = shard_files(dir);
  CHECK(files.size() == 10);
  CHECK(files.count("r0_s1_b0.shard") == 0);  // the hot one stayed in memory
  CHECK(files.count("r0_s2_b0.shard") == 1);  // the coldest spilled first
  CHECK(fs::file_size(s.spill_path(ShardKey{0, 2, 0})) == kHeader + 1000);
  for (const auto& k : keys) require_shard(s, k, 1000, 1);
  // Reading a spilled shard does not bring it back into memory.
  CHECK(s.stats().shards_spilled == 10);
  for (const auto& info : s.list())
    CHECK(info.spilled == (files.count("r" + std::to_string(info.key.rank) + "_s" +
                                       std::to_string(info.key.step) + "_b0.shard") == 1));

  // A shard larger than the whole memory limit (but within the maximum) goes straight to disk,
  // and pushes nothing else out.
  REQUIRE(put_shard(s, ShardKey{7, 1, 0}, 1, 20000) == StoreStatus::kOk);
  CHECK(s.stats().memory_bytes == 10000);
  CHECK(s.stats().shards_spilled == 11);
  CHECK(fs::exists(s.spill_path(ShardKey{7, 1, 0})));
  require_shard(s, ShardKey{7, 1, 0}, 20000, 1);
  // No temp files are left behind.
  for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().extension().string() != ".tmp");
}

TEST_CASE("a shard corrupted on disk is refused by name; the others are served",
          "[snapshot][store]") {
  TempDir d;
  ShardStore s(config(d.path, 0));  // limit 0: every shard spills at once
  std::string err;
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  const ShardKey k1{1, 5, 0}, k2{1, 5, 1}, k3{2, 5, 0}, k4{3, 5, 0}, k5{4, 5, 0};
  for (const auto& k : {k1, k2, k3, k4, k5}) REQUIRE(put_shard(s, k, 5, 4000) == StoreStatus::kOk);
  REQUIRE(s.stats().shards_spilled == 5);

  SECTION("a payload byte flipped") { flip_byte(s.spill_path(k1), kHeader + 1234); }
  SECTION("a header byte flipped (its base step)") { flip_byte(s.spill_path(k1), 33); }
  SECTION("truncated") { fs::resize_file(s.spill_path(k1), kHeader + 100); }
  SECTION("deleted behind the store's back") { fs::remove(s.spill_path(k1)); }
  SECTION("another shard's file in its place") {
    fs::copy_file(s.spill_path(k5), s.spill_path(k1), fs::copy_options::overwrite_existing);
  }

  std::vector<uint8_t> out{42};
  CHECK(s.get(k1, &out, nullptr, &err) == StoreStatus::kCorrupt);
  INFO(err);
  CHECK(err.find("rank 1 step 5 buffer 0") != std::string::npos);
  CHECK(err.find("another replica") != std::string::npos);
  CHECK(out == std::vector<uint8_t>{42});
  CHECK(s.stats().crc_failures_get == 1);
  // Still refused, counted once; the other shards are untouched.
  CHECK(s.get(k1, &out, nullptr, &err) == StoreStatus::kCorrupt);
  CHECK(s.stats().crc_failures_get == 1);
  for (const auto& k : {k2, k3, k4, k5}) require_shard(s, k, 4000, 5);
  for (const auto& info : s.list()) CHECK(info.corrupt == (info.key == k1));
  // A good copy from another replica replaces it.
  REQUIRE(put_shard(s, k1, 5, 4000) == StoreStatus::kOk);
  require_shard(s, k1, 4000, 5);
}

TEST_CASE("a shard corrupted in memory is caught by its reader, once, and then refused",
          "[snapshot][store]") {
  ShardStore s(config("", 1 << 20));
  std::string err;
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  const ShardKey k{0, 3, 2};
  auto b = payload(k, 512);
  const uint64_t sum = shard_checksum(b.data(), b.size());
  // The store keeps the very buffer it was given (moved in): damage it through its data pointer
  // to stand for a memory error.
  uint8_t* raw = b.data();
  REQUIRE(s.put(k, 3, sum, std::move(b), &err) == StoreStatus::kOk);
  CHECK(s.stats().checksum_bytes == 512);  // put: the one check of the incoming hop
  raw[7] ^= 0x80;
  // Serving from memory hashes nothing (no hop) and copies nothing (view): the bytes go out
  // as they are, and the reader of the next hop checks them once against the stored checksum.
  ShardRef ref;
  REQUIRE(s.view(k, &ref, &err) == StoreStatus::kOk);
  CHECK(ref.data.get() == raw);
  CHECK(s.stats().checksum_bytes == 512);
  CHECK(shard_checksum(ref.data.get(), ref.info.size) != ref.info.checksum);
  // The reader reports it: refused from then on, counted once.
  CHECK(s.report_corrupt(k, "the requester's checksum failed"));
  std::vector<uint8_t> out;
  CHECK(s.get(k, &out, nullptr, &err) == StoreStatus::kCorrupt);
  CHECK(err.find("rank 0 step 3 buffer 2") != std::string::npos);
  CHECK(out.empty());
  CHECK(s.stats().crc_failures_get == 1);
  CHECK(s.report_corrupt(k, "again"));
  CHECK(s.stats().crc_failures_get == 1);
}

TEST_CASE("a spilled shard's file is checked once when read back, not again in memory",
          "[snapshot][store]") {
  TempDir d;
  ShardStore s(config(d.path, 0));
  std::string err;
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  const ShardKey k{1, 5, 0};
  REQUIRE(put_shard(s, k, 5, 4000) == StoreStatus::kOk);
  REQUIRE(s.stats().shards_spilled == 1);
  CHECK(s.stats().checksum_bytes == 4000);
  ShardRef ref;
  REQUIRE(s.view(k, &ref, &err) == StoreStatus::kOk);
  CHECK(s.stats().checksum_bytes == 8000);  // the disk hop: one pass
  CHECK(shard_checksum(ref.data.get(), ref.info.size) == ref.info.checksum);
  flip_byte(s.spill_path(k), kHeader + 17);
  CHECK(s.view(k, &ref, &err) == StoreStatus::kCorrupt);
  CHECK(s.stats().checksum_bytes == 12000);
  CHECK(s.stats().crc_failures_get == 1);
  // Marked corrupt: refused without reading (or hashing) the file again.
  CHECK(s.view(k, &ref, &err) == StoreStatus::kCorrupt);
  CHECK(s.stats().checksum_bytes == 12000);
}

TEST_CASE("a restarted store serves what was spilled", "[snapshot][store]") {
  TempDir d;
  std::string err;
  std::vector<ShardKey> keys;
  for (uint32_t r = 0; r < 3; ++r)
    for (uint32_t b = 0; b < 2; ++b) keys.push_back(ShardKey{r, 20, b});

  SECTION("clean stop: close() spills what was in memory") {
    {
      ShardStore s(config(d.path, 2500));
      REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
      for (const auto& k : keys) REQUIRE(put_shard(s, k, 20, 1000) == StoreStatus::kOk);
      REQUIRE(s.stats().shards_spilled == 4);
      REQUIRE(s.close(&err) == StoreStatus::kOk);
      CHECK(s.close(&err) == StoreStatus::kOk);  // idempotent
      CHECK(put_shard(s, keys[0], 20, 10) == StoreStatus::kClosed);
      std::vector<uint8_t> out;
      CHECK(s.get(keys[0], &out, nullptr, &err) == StoreStatus::kClosed);
    }
    ShardStore s2(config(d.path, 2500));
    OpenReport rep;
    REQUIRE(s2.open(&rep, &err) == StoreStatus::kOk);
    CHECK(rep.indexed == 6);
    CHECK(rep.skipped.empty());
    for (const auto& k : keys) require_shard(s2, k, 1000, 20);
    CHECK(s2.stats().spilled_bytes == 6000);
  }
  SECTION("the destructor is a clean stop too") {
    {
      ShardStore s(config(d.path, 1 << 20));
      REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
      for (const auto& k : keys) REQUIRE(put_shard(s, k, 20, 1000) == StoreStatus::kOk);
      CHECK(s.stats().shards_spilled == 0);
    }
    ShardStore s2(config(d.path, 1 << 20));
    OpenReport rep;
    REQUIRE(s2.open(&rep, &err) == StoreStatus::kOk);
    CHECK(rep.indexed == 6);
    for (const auto& k : keys) require_shard(s2, k, 1000, 20);
  }
  SECTION("spill_on_close off (a crash loses the same): only the spilled ones survive") {
    {
      StoreConfig c = config(d.path, 2500);
      c.spill_on_close = false;
      ShardStore s(c);
      REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
      for (const auto& k : keys) REQUIRE(put_shard(s, k, 20, 1000) == StoreStatus::kOk);
    }
    ShardStore s2(config(d.path, 2500));
    OpenReport rep;
    REQUIRE(s2.open(&rep, &err) == StoreStatus::kOk);
    CHECK(rep.indexed == 4);
    for (size_t i = 0; i < 4; ++i) require_shard(s2, keys[i], 1000, 20);  // LRU: first in
    std::vector<uint8_t> out;
    CHECK(s2.get(keys[5], &out, nullptr, &err) == StoreStatus::kNotFound);
  }
}

TEST_CASE("one store per directory", "[snapshot][store]") {
  TempDir d;
  std::string err;
  ShardStore a(config(d.path, 100));
  REQUIRE(a.open(nullptr, &err) == StoreStatus::kOk);
  ShardStore b(config(d.path, 100));
  CHECK(b.open(nullptr, &err) == StoreStatus::kIoError);
  CHECK(err.find("in use") != std::string::npos);
  REQUIRE(a.close(&err) == StoreStatus::kOk);
  ShardStore c(config(d.path, 100));
  CHECK(c.open(nullptr, &err) == StoreStatus::kOk);
}

TEST_CASE("bad, truncated and foreign files in the directory are skipped with a message",
          "[snapshot][store]") {
  TempDir d;
  std::string err;
  const ShardKey good1{0, 7, 0}, good2{1, 7, 0}, trunc{2, 7, 0}, lying{3, 7, 0};
  {
    ShardStore s(config(d.path, 0));
    REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
    for (const auto& k : {good1, good2, trunc, lying})
      REQUIRE(put_shard(s, k, 7, 3000) == StoreStatus::kOk);
  }
  fs::resize_file(d.sub("r2_s7_b0.shard"), 40);  // not even a whole header
  // A valid file under another shard's name.
  fs::rename(d.sub("r3_s7_b0.shard"), d.sub("r3_s8_b0.shard"));
  write_text(d.sub("r9_s1_b0.shard"), std::string(200, 'x'));  // longer than a header
  write_text(d.sub("notes.txt"), "an operator's notes");
  write_text(d.sub("r4_s1_b0.shard.tmp"), "half a write");
  // A header claiming a payload far beyond the maximum: refused before any allocation.
  {
    std::vector<uint8_t> f(kHeader + 10, 0);
    auto src = fs::path(d.sub("r0_s7_b0.shard"));
    std::ifstream in(src, std::ios::binary);
    in.read(reinterpret_cast<char*>(f.data()), kHeader);
    for (int i = 0; i < 8; ++i) f[40 + i] = 0xff;  // payload bytes: 2^64 - 1
    const auto hcrc = static_cast<uint32_t>(shard_checksum(f.data(), 60));  // well-formed otherwise
    for (int i = 0; i < 4; ++i) f[60 + i] = static_cast<uint8_t>(hcrc >> (8 * i));
    std::ofstream out(d.sub("r0_s9_b0.shard"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(f.data()), static_cast<std::streamsize>(f.size()));
  }
  fs::create_directory(d.sub("r5_s1_b0.shard"));  // not a regular file

  ShardStore s(config(d.path, 0));
  OpenReport rep;
  REQUIRE(s.open(&rep, &err) == StoreStatus::kOk);
  CHECK(rep.indexed == 2);
  std::string all;
  for (const auto& m : rep.skipped) all += m + "\n";
  INFO(all);
  CHECK(rep.skipped.size() == 7);
  CHECK(s.stats().files_skipped == 7);
  auto has = [&](const std::string& a, const std::string& b) {
    for (const auto& m : rep.skipped)
      if (m.find(a) != std::string::npos && m.find(b) != std::string::npos) return true;
    return false;
  };
  CHECK(has("r2_s7_b0.shard", "truncated"));
  CHECK(has("r3_s8_b0.shard", "header names rank 3 step 7 buffer 0"));
  CHECK(has("r9_s1_b0.shard", "bad magic"));
  CHECK(has("r0_s9_b0.shard", "over the maximum"));
  CHECK(has("notes.txt", "not a shard file"));
  CHECK(has("r4_s1_b0.shard.tmp", "interrupted write"));
  CHECK(has("r5_s1_b0.shard", "not a regular file"));
  require_shard(s, good1, 3000, 7);
  require_shard(s, good2, 3000, 7);
  std::vector<uint8_t> out;
  CHECK(s.get(trunc, &out, nullptr, &err) == StoreStatus::kNotFound);
  CHECK(s.get(ShardKey{3, 8, 0}, &out, nullptr, &err) == StoreStatus::kNotFound);
  // Bad shard files are moved aside (kept for a look, never trusted), temp files removed,
  // foreign files left alone.
  CHECK(fs::exists(d.sub("r2_s7_b0.shard.bad")));
  CHECK(fs::exists(d.sub("r9_s1_b0.shard.bad")));
  CHECK_FALSE(fs::exists(d.sub("r2_s7_b0.shard")));
  CHECK_FALSE(fs::exists(d.sub("r4_s1_b0.shard.tmp")));
  CHECK(fs::exists(d.sub("notes.txt")));
  REQUIRE(s.close(&err) == StoreStatus::kOk);

  // The next restart only mentions what is still not ours.
  ShardStore s2(config(d.path, 0));
  REQUIRE(s2.open(&rep, &err) == StoreStatus::kOk);
  CHECK(rep.indexed == 2);
  CHECK(rep.skipped.size() == 2);  // notes.txt and the directory
}

TEST_CASE("prune keeps exactly the chain that restores the kept step", "[snapshot][store]") {
  TempDir d;
  std::string err;
  // Memory for half of the shards: the others are on disk, and prune must remove their files.
  ShardStore s(config(d.path, 6 * 100));
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  // rank 0 buffer 0: chain A base 5 (5..9), chain B base 10 (10..14), chain C base 15 (15, 16).
  auto base_of = [](uint64_t step) { return step - step % 5; };
  for (uint64_t step = 5; step <= 16; ++step)
    REQUIRE(put_shard(s, ShardKey{0, step, 0}, base_of(step), 100) == StoreStatus::kOk);
  // rank 0 buffer 1: a single chain from 8.
  for (uint64_t step = 8; step <= 16; ++step)
    REQUIRE(put_shard(s, ShardKey{0, step, 1}, 8, 100) == StoreStatus::kOk);
  // rank 1 buffer 0: only newer shards (nothing at or before the kept step).
  REQUIRE(put_shard(s, ShardKey{1, 20, 0}, 20, 100) == StoreStatus::kOk);
  REQUIRE(s.stats().shards_spilled > 0);

  auto steps = [&](uint32_t rank, uint32_t buffer) {
    std::vector<uint64_t> out;
    for (const auto& i : s.list())
      if (i.key.rank == rank && i.key.buffer == buffer) out.push_back(i.key.step);
    return out;
  };

  PruneResult r = s.prune(13);
  // Chain B up to 13 and everything newer; chain A dropped.
  CHECK(steps(0, 0) == std::vector<uint64_t>{10, 11, 12, 13, 14, 15, 16});
  CHECK(steps(0, 1) == std::vector<uint64_t>{8, 9, 10, 11, 12, 13, 14, 15, 16});
  CHECK(steps(1, 0) == std::vector<uint64_t>{20});
  CHECK(r.shards == 5);
  CHECK(r.bytes == 500);
  for (uint64_t step = 5; step <= 9; ++step)
    CHECK_FALSE(fs::exists(s.spill_path(ShardKey{0, step, 0})));

  r = s.prune(15);
  CHECK(steps(0, 0) == std::vector<uint64_t>{15, 16});
  CHECK(steps(0, 1) == std::vector<uint64_t>{8, 9, 10, 11, 12, 13, 14, 15, 16});
  CHECK(r.shards == 5);
  r = s.prune(15);  // nothing more to drop
  CHECK(r.shards == 0);
  for (uint64_t step = 15; step <= 16; ++step) require_shard(s, ShardKey{0, step, 0}, 100, 15);

  StoreStats st = s.stats();
  CHECK(st.pruned == 10);
  CHECK(st.shards_in_memory + st.shards_spilled == 12);
  CHECK(st.memory_bytes + st.spilled_bytes == 1200);
  CHECK(shard_files(d.path).size() == st.shards_spilled);

  // The kept step has no shard of its own here (a missing step): the newest one before it and
  // its chain are kept.
  REQUIRE(put_shard(s, ShardKey{5, 30, 0}, 30, 10) == StoreStatus::kOk);
  REQUIRE(put_shard(s, ShardKey{5, 31, 0}, 30, 10) == StoreStatus::kOk);
  REQUIRE(put_shard(s, ShardKey{5, 40, 0}, 40, 10) == StoreStatus::kOk);
  s.prune(35);
  CHECK(steps(5, 0) == std::vector<uint64_t>{30, 31, 40});
}

TEST_CASE("concurrent puts, gets, prunes and stats from 4 threads", "[snapshot][store]") {
  TempDir d;
  std::string err;
  constexpr uint64_t kLimit = 64 * 1024;
  ShardStore s(config(d.path, kLimit));
  REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
  constexpr uint32_t kThreads = 4;
  constexpr uint64_t kSteps = 40;
  std::atomic<int> failures{0};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> progress[kThreads] = {};  // last step each writer finished
  auto size_of = [](const ShardKey& k) {
    return size_t{1000} + 97 * ((k.rank * 31 + k.step + k.buffer) % 50);
  };
  auto worker = [&](uint32_t t) {
    std::vector<uint8_t> out;
    std::string e;
    for (uint64_t step = 1; step <= kSteps; ++step) {
      for (uint32_t r = 0; r < kThreads; ++r) {
        // Threads t and t+2 store the same keys at once (same bytes, as replicas of one shard
        // are). Every shard is a base here: the pruner drops whole old steps.
        ShardKey k{r, step, t % 2};
        if (put_shard(s, k, step, size_of(k), &e) != StoreStatus::kOk) ++failures;
      }
      for (uint64_t back = 0; back < 3 && back < step; ++back) {
        ShardKey k{(t + 1) % kThreads, step - back, t % 2};
        StoreStatus st = s.get(k, &out, nullptr, &e);
        if (st != StoreStatus::kOk || out != payload(k, size_of(k))) ++failures;
      }
      progress[t] = step;
    }
  };
  std::thread pruner([&] {
    // Prunes below every writer's reads: everything older than the slowest writer's step - 5.
    while (!stop.load()) {
      uint64_t slowest = kSteps;
      for (auto& p : progress) slowest = std::min<uint64_t>(slowest, p.load());
      if (slowest > 5) s.prune(slowest - 5);
      StoreStats st = s.stats();
      // Over the limit only by the shards being spilled right now.
      if (st.memory_bytes > kLimit + 2 * kThreads * 6000) ++failures;
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> ts;
  for (uint32_t t = 0; t < kThreads; ++t) ts.emplace_back(worker, t);
  for (auto& t : ts) t.join();
  stop = true;
  pruner.join();
  CHECK(failures.load() == 0);

  const uint64_t keep = kSteps - 5;
  s.prune(keep);
  StoreStats st = s.stats();
  CHECK(st.memory_bytes <= kLimit);
  CHECK(st.spills > 0);
  CHECK(st.pruned > 0);
  CHECK(st.crc_failures_get == 0);
  uint64_t total = 0;
  size_t n = 0;
  std::vector<uint8_t> out;
  for (uint32_t r = 0; r < kThreads; ++r)
    for (uint64_t step = 1; step <= kSteps; ++step)
      for (uint32_t b = 0; b < 2; ++b) {
        ShardKey k{r, step, b};
        if (step < keep) {
          CHECK(s.get(k, &out, nullptr, &err) == StoreStatus::kNotFound);
          continue;
        }
        total += size_of(k);
        ++n;
        require_shard(s, k, size_of(k), step);
      }
  CHECK(st.memory_bytes + st.spilled_bytes == total);
  CHECK(st.shards_in_memory + st.shards_spilled == n);
  CHECK(shard_files(d.path).size() == st.shards_spilled);
}

TEST_CASE("close while other threads put and get: what was stored survives a restart",
          "[snapshot][store]") {
  TempDir d;
  std::string err;
  std::vector<ShardKey> stored[4];
  {
    ShardStore s(config(d.path, 16 * 1024));
    REQUIRE(s.open(nullptr, &err) == StoreStatus::kOk);
    std::atomic<int> unexpected{0};
    std::vector<std::thread> ts;
    for (uint32_t t = 0; t < 4; ++t) {
      ts.emplace_back([&, t] {
        std::vector<uint8_t> out;
        std::string e;
        for (uint64_t step = 1; step <= 2000; ++step) {
          ShardKey k{t, step, 0};
          StoreStatus st = put_shard(s, k, step, 700, &e);
          if (st == StoreStatus::kClosed) break;
          if (st != StoreStatus::kOk) ++unexpected;
          stored[t].push_back(k);
          st = s.get(k, &out, nullptr, &e);
          if (st == StoreStatus::kClosed) break;
          if (st != StoreStatus::kOk) ++unexpected;
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(s.close(&err) == StoreStatus::kOk);
    for (auto& t : ts) t.join();
    CHECK(unexpected.load() == 0);
  }
  ShardStore s2(config(d.path, 16 * 1024));
  OpenReport rep;
  REQUIRE(s2.open(&rep, &err) == StoreStatus::kOk);
  CHECK(rep.skipped.empty());
  size_t n = 0;
  for (const auto& v : stored) {
    n += v.size();
    for (const auto& k : v) require_shard(s2, k, 700, k.step);
  }
  CHECK(rep.indexed == n);
}
