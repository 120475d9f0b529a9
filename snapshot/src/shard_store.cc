// ShardStore (r2ccl/snapshot/shard_store.h). Spill file format, little-endian, 64-byte header
// followed by the payload:
//   0  magic "R2SHARD\0"       8   u32 version (2)      12  u32 header bytes (64)
//   16 u32 rank                20  u32 buffer           24  u64 step
//   32 u64 base step           40  u64 payload bytes    48  u64 payload checksum (XXH3-64)
//   56 u32 0 (reserved)                                 60  u32 low 32 bits of XXH3-64 of 0..59
// A file is valid when its name, r<rank>_s<step>_b<buffer>.shard, matches its header, the
// header check holds, its payload size is within max_shard_bytes and the file is exactly
// 64 + payload bytes long. The payload checksum is checked whenever the file is read (the
// disk hop). Version 1 files (zlib CRC-32) are not read: they are reported and moved aside.
#include "r2ccl/snapshot/shard_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "r2ccl/snapshot/big_buffer.h"
#include "r2ccl/snapshot/log.h"

namespace r2ccl::snap {
namespace {

constexpr char kMagic[8] = {'R', '2', 'S', 'H', 'A', 'R', 'D', '\0'};
constexpr uint32_t kVersion = 2;
constexpr size_t kHeaderBytes = 64;
constexpr const char* kLockName = "LOCK";
constexpr const char* kShardSuffix = ".shard";
constexpr const char* kTmpSuffix = ".tmp";
constexpr const char* kBadSuffix = ".bad";

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

uint32_t header_check(const uint8_t* h) { return static_cast<uint32_t>(XXH3_64bits(h, 60)); }

void encode_header(const ShardInfo& info, uint8_t* h) {
  memset(h, 0, kHeaderBytes);
  memcpy(h, kMagic, sizeof(kMagic));
  put_u32(h + 8, kVersion);
  put_u32(h + 12, kHeaderBytes);
  put_u32(h + 16, info.key.rank);
  put_u32(h + 20, info.key.buffer);
  put_u64(h + 24, info.key.step);
  put_u64(h + 32, info.base_step);
  put_u64(h + 40, info.size);
  put_u64(h + 48, info.checksum);
  put_u32(h + 60, header_check(h));
}

// Parses and checks a header (not the payload). On failure *why says what is wrong.
bool decode_header(const uint8_t* h, uint64_t max_bytes, ShardInfo* out, std::string* why) {
  if (memcmp(h, kMagic, sizeof(kMagic)) != 0) {
    *why = "bad magic";
    return false;
  }
  if (get_u32(h + 60) != header_check(h)) {
    *why = "header checksum mismatch";
    return false;
  }
  if (get_u32(h + 8) != kVersion || get_u32(h + 12) != kHeaderBytes) {
    *why = "unsupported version " + std::to_string(get_u32(h + 8));
    return false;
  }
  ShardInfo info;
  info.key.rank = get_u32(h + 16);
  info.key.buffer = get_u32(h + 20);
  info.key.step = get_u64(h + 24);
  info.base_step = get_u64(h + 32);
  info.size = get_u64(h + 40);
  info.checksum = get_u64(h + 48);
  if (info.base_step > info.key.step) {
    *why = "base step after the step";
    return false;
  }
  if (info.size > max_bytes) {
    *why = "payload of " + std::to_string(info.size) + " bytes over the maximum of " +
           std::to_string(max_bytes);
    return false;
  }
  info.spilled = true;
  *out = info;
  return true;
}

bool read_full(int fd, void* buf, size_t n, uint64_t off) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = EIO;  // a short file: callers check the length first
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return true;
}

bool write_full(int fd, const void* buf, size_t n) {
  const auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = EIO;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

std::string errno_text(const char* what) { return std::string(what) + ": " + strerror(errno); }

// Writes header + payload to dir_fd/name and fsyncs it. False with *why on failure.
bool write_shard_file(int dir_fd, const std::string& name, const ShardInfo& info,
                      const uint8_t* bytes, std::string* why) {
  int fd = openat(dir_fd, name.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    *why = errno_text(("create " + name).c_str());
    return false;
  }
  uint8_t h[kHeaderBytes];
  encode_header(info, h);
  bool ok = write_full(fd, h, sizeof(h)) && write_full(fd, bytes, info.size);
  if (!ok) *why = errno_text(("write " + name).c_str());
  if (ok && fsync(fd) != 0) {
    *why = errno_text(("fsync " + name).c_str());
    ok = false;
  }
  if (close(fd) != 0 && ok) {
    *why = errno_text(("close " + name).c_str());
    ok = false;
  }
  return ok;
}

bool ends_with(const std::string& s, const char* suffix) {
  size_t n = strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Parses "r<rank>_s<step>_b<buffer>.shard" exactly (no leading zeros, signs or spaces).
bool parse_name(const std::string& name, ShardKey* key) {
  unsigned rank = 0, buffer = 0;
  unsigned long long step = 0;
  int used = 0;
  if (sscanf(name.c_str(), "r%u_s%llu_b%u.shard%n", &rank, &step, &buffer, &used) != 3) {
    return false;
  }
  ShardKey k{rank, static_cast<uint64_t>(step), buffer};
  char canon[96];
  snprintf(canon, sizeof(canon), "r%" PRIu32 "_s%" PRIu64 "_b%" PRIu32 "%s", k.rank, k.step,
           k.buffer, kShardSuffix);
  if (name != canon) return false;
  *key = k;
  return true;
}

}  // namespace

uint64_t shard_checksum(const void* data, size_t n) { return XXH3_64bits(data, n); }

std::shared_ptr<uint8_t> alloc_shard_bytes(size_t n) {
  // Not initialised: the caller fills every byte (a read, a copy). Huge pages: big_buffer.h.
  uint8_t* p = big_alloc(n, false);
  if (!p) return nullptr;
  try {
    return std::shared_ptr<uint8_t>(p, BigFree{n});
  } catch (...) {  // the control block (shared_ptr frees p itself when it throws)
    return nullptr;
  }
}

std::string to_string(const ShardKey& k) {
  char buf[96];
  snprintf(buf, sizeof(buf), "rank %" PRIu32 " step %" PRIu64 " buffer %" PRIu32, k.rank, k.step,
           k.buffer);
  return buf;
}

const char* store_status_name(StoreStatus s) {
  switch (s) {
    case StoreStatus::kOk: return "ok";
    case StoreStatus::kNotFound: return "not-found";
    case StoreStatus::kCorrupt: return "corrupt";
    case StoreStatus::kBadCrc: return "bad-crc";
    case StoreStatus::kTooLarge: return "too-large";
    case StoreStatus::kFull: return "full";
    case StoreStatus::kIoError: return "io-error";
    case StoreStatus::kInvalid: return "invalid";
    case StoreStatus::kClosed: return "closed";
  }
  return "unknown";
}

ShardStore::ShardStore(StoreConfig cfg) : cfg_(std::move(cfg)) {}

ShardStore::~ShardStore() {
  std::string err;
  if (close(&err) != StoreStatus::kOk) {
    SNAP_WARN("snapshot store: closing %s: %s", cfg_.spill_dir.c_str(), err.c_str());
  }
}

std::string ShardStore::file_name(const ShardKey& key) const {
  char buf[96];
  snprintf(buf, sizeof(buf), "r%" PRIu32 "_s%" PRIu64 "_b%" PRIu32 "%s", key.rank, key.step,
           key.buffer, kShardSuffix);
  return buf;
}

std::string ShardStore::spill_path(const ShardKey& key) const {
  if (cfg_.spill_dir.empty()) return "";
  return cfg_.spill_dir + "/" + file_name(key);
}

StoreStatus ShardStore::open(OpenReport* report, std::string* err) {
  // The scan holds mu_: nothing else can do anything useful before open() has returned (every
  // other call returns kClosed or empty results until then).
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ != State::kNew) {
    if (err) *err = "snapshot store: open() called twice or after close()";
    return StoreStatus::kClosed;
  }
  if (cfg_.max_shard_bytes == 0 || (cfg_.spill_dir.empty() && cfg_.memory_limit_bytes == 0)) {
    if (err)
      *err =
          "snapshot store: max_shard_bytes and (without a spill directory) "
          "memory_limit_bytes must be > 0";
    return StoreStatus::kInvalid;
  }
  OpenReport rep;
  if (cfg_.spill_dir.empty()) {
    state_ = State::kOpen;
    if (report) *report = rep;
    return StoreStatus::kOk;
  }
  const std::string& dir = cfg_.spill_dir;
  // Shards are training state: the directory is private to the daemon's user (0700; files are
  // created 0600). An existing directory keeps its mode.
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(dir).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (!ec && ::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    ec = std::error_code(errno, std::generic_category());
  }
  if (ec) {
    if (err) *err = "snapshot store: cannot create spill directory " + dir + ": " + ec.message();
    return StoreStatus::kIoError;
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) {
    if (err) *err = "snapshot store: " + errno_text(("open " + dir).c_str());
    return StoreStatus::kIoError;
  }
  int lfd = openat(dfd, kLockName, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lfd < 0 || flock(lfd, LOCK_EX | LOCK_NB) != 0) {
    const bool busy = lfd >= 0 && errno == EWOULDBLOCK;
    std::string why =
        busy ? "in use by another store" : errno_text(("lock " + dir + "/" + kLockName).c_str());
    if (lfd >= 0) ::close(lfd);
    ::close(dfd);
    if (err) *err = "snapshot store: spill directory " + dir + ": " + why;
    return StoreStatus::kIoError;
  }

  std::vector<std::string> names;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) {
    ::close(lfd);
    ::close(dfd);
    if (err) *err = "snapshot store: cannot list " + dir + ": " + ec.message();
    return StoreStatus::kIoError;
  }
  std::sort(names.begin(), names.end());
  auto skip = [&](const std::string& msg) {
    std::string m = "snapshot store: " + dir + "/" + msg;
    SNAP_WARN("%s", m.c_str());
    rep.skipped.push_back(m);
    ++stats_.files_skipped;
  };
  for (const std::string& name : names) {
    if (name == kLockName || ends_with(name, kBadSuffix)) continue;
    ShardKey key;
    if (ends_with(name, kTmpSuffix) &&
        parse_name(name.substr(0, name.size() - strlen(kTmpSuffix)), &key)) {
      unlinkat(dfd, name.c_str(), 0);
      skip(name + ": leftover of an interrupted write, removed");
      continue;
    }
    if (!parse_name(name, &key)) {
      skip(name + ": not a shard file, left alone");
      continue;
    }
    struct stat st {};
    if (fstatat(dfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      skip(name + ": " + errno_text("stat") + ", left alone");
      continue;
    }
    if (!S_ISREG(st.st_mode)) {
      skip(name + ": not a regular file, left alone");
      continue;
    }
    int fd = openat(dfd, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
      skip(name + ": " + errno_text("open") + ", left alone");
      continue;
    }
    std::string why;
    ShardInfo info;
    uint8_t h[kHeaderBytes];
    if (fstat(fd, &st) != 0) {
      why = errno_text("stat");
    } else if (static_cast<uint64_t>(st.st_size) < kHeaderBytes) {
      why = "truncated (" + std::to_string(st.st_size) + " bytes, no complete header)";
    } else if (!read_full(fd, h, sizeof(h), 0)) {
      why = errno_text("read");
    } else if (decode_header(h, cfg_.max_shard_bytes, &info, &why)) {
      if (info.key != key) {
        why = "header names " + to_string(info.key);
      } else if (static_cast<uint64_t>(st.st_size) != kHeaderBytes + info.size) {
        why = "length " + std::to_string(st.st_size) + " bytes, header says " +
              std::to_string(kHeaderBytes + info.size);
      }
    }
    ::close(fd);
    if (!why.empty()) {
      std::string bad = name + kBadSuffix;
      if (renameat(dfd, name.c_str(), dfd, bad.c_str()) == 0) {
        skip(name + ": " + why + "; moved to " + bad);
      } else {
        skip(name + ": " + why + "; " + errno_text("cannot move it aside"));
      }
      continue;
    }
    Entry e;
    e.info = info;
    e.where = Where::kDisk;
    e.gen = next_gen_++;
    index_.emplace(key, std::move(e));
    stats_.spilled_bytes += info.size;
    ++stats_.shards_spilled;
    ++rep.indexed;
  }
  dir_fd_ = dfd;
  lock_fd_ = lfd;
  state_ = State::kOpen;
  if (rep.indexed > 0 || !rep.skipped.empty()) {
    SNAP_INFO("snapshot store: %s: %" PRIu64
              " spilled shards indexed, %zu files "
              "skipped",
              dir.c_str(), rep.indexed, rep.skipped.size());
  }
  if (report) *report = std::move(rep);
  return StoreStatus::kOk;
}

StoreStatus ShardStore::close(std::string* err) {
  std::unique_lock<std::mutex> lk(mu_);
  if (state_ == State::kNew) state_ = State::kClosed;
  if (state_ == State::kClosed) return StoreStatus::kOk;
  if (state_ == State::kClosing) {  // another thread is closing: wait for it
    idle_cv_.wait(lk, [&] { return state_ == State::kClosed; });
    return StoreStatus::kOk;
  }
  state_ = State::kClosing;
  idle_cv_.wait(lk, [&] { return active_ == 0; });
  std::vector<Victim> victims;
  if (dir_fd_ >= 0 && cfg_.spill_on_close) pick_victims_locked(&victims, true);
  lk.unlock();
  std::string serr;
  const bool ok = victims.empty() || spill(&victims, &serr);
  lk.lock();
  index_.clear();
  lru_.clear();
  spilling_bytes_ = 0;
  stats_.memory_bytes = stats_.spilled_bytes = 0;
  stats_.shards_in_memory = stats_.shards_spilled = 0;
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
  if (dir_fd_ >= 0) ::close(dir_fd_);
  lock_fd_ = dir_fd_ = -1;
  state_ = State::kClosed;
  idle_cv_.notify_all();
  if (!ok) {
    if (err) *err = "snapshot store: not every shard was spilled at close: " + serr;
    return StoreStatus::kIoError;
  }
  return StoreStatus::kOk;
}

bool ShardStore::enter_locked(std::string* err) {
  if (state_ != State::kOpen) {
    if (err) *err = state_ == State::kNew ? "snapshot store: not open" : "snapshot store: closed";
    return false;
  }
  ++active_;
  return true;
}

void ShardStore::leave() {
  std::lock_guard<std::mutex> lk(mu_);
  if (--active_ == 0) idle_cv_.notify_all();
}

StoreStatus ShardStore::check_size(uint64_t bytes, std::string* err) const {
  if (bytes > cfg_.max_shard_bytes) {
    if (err) {
      *err = "snapshot store: shard of " + std::to_string(bytes) + " bytes over the maximum of " +
             std::to_string(cfg_.max_shard_bytes);
    }
    return StoreStatus::kTooLarge;
  }
  return StoreStatus::kOk;
}

void ShardStore::drop_locked(std::map<ShardKey, Entry>::iterator it) {
  Entry& e = it->second;
  switch (e.where) {
    case Where::kMemory:
      lru_.erase(e.lru);
      stats_.memory_bytes -= e.info.size;
      --stats_.shards_in_memory;
      break;
    case Where::kSpilling:  // the spiller finds the entry gone and discards its temp file
      spilling_bytes_ -= e.info.size;
      stats_.memory_bytes -= e.info.size;
      --stats_.shards_in_memory;
      break;
    case Where::kDisk:
      // Under mu_, so a spill of a new shard with this key (renamed under mu_) cannot be
      // removed by mistake.
      if (dir_fd_ >= 0 && unlinkat(dir_fd_, file_name(it->first).c_str(), 0) != 0 &&
          errno != ENOENT) {
        SNAP_WARN("snapshot store: cannot remove %s: %s", spill_path(it->first).c_str(),
                  strerror(errno));
      }
      stats_.spilled_bytes -= e.info.size;
      --stats_.shards_spilled;
      break;
  }
  index_.erase(it);
}

void ShardStore::pick_victims_locked(std::vector<Victim>* out, bool all) {
  while (!lru_.empty() &&
         (all || stats_.memory_bytes - spilling_bytes_ > cfg_.memory_limit_bytes)) {
    ShardKey k = lru_.back();
    lru_.pop_back();
    Entry& e = index_.find(k)->second;
    e.where = Where::kSpilling;
    spilling_bytes_ += e.info.size;
    out->push_back(Victim{k, e.gen, e.info, e.bytes});
  }
}

bool ShardStore::spill(std::vector<Victim>* victims, std::string* err) {
  std::lock_guard<std::mutex> io(io_mu_);
  bool all_ok = true;
  bool renamed = false;
  for (Victim& v : *victims) {
    const std::string name = file_name(v.key);
    const std::string tmp = name + kTmpSuffix;
    std::string why;
    ShardInfo info = v.info;
    bool wrote = write_shard_file(dir_fd_, tmp, info, v.bytes.get(), &why);
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(v.key);
    const bool current =
        it != index_.end() && it->second.gen == v.gen && it->second.where == Where::kSpilling;
    if (wrote && current) {
      if (renameat(dir_fd_, tmp.c_str(), dir_fd_, name.c_str()) == 0) {
        Entry& e = it->second;
        e.where = Where::kDisk;
        e.bytes.reset();
        e.info.spilled = true;
        spilling_bytes_ -= e.info.size;
        stats_.memory_bytes -= e.info.size;
        --stats_.shards_in_memory;
        stats_.spilled_bytes += e.info.size;
        ++stats_.shards_spilled;
        ++stats_.spills;
        renamed = true;
        v.bytes.reset();
        continue;
      }
      why = errno_text(("rename " + tmp).c_str());
      wrote = false;
    }
    unlinkat(dir_fd_, tmp.c_str(), 0);  // replaced or pruned meanwhile, or the write failed
    if (current) {  // the write failed: the shard stays in memory, least recently used
      Entry& e = it->second;
      e.where = Where::kMemory;
      spilling_bytes_ -= e.info.size;
      e.lru = lru_.insert(lru_.end(), v.key);
      ++stats_.spill_failures;
      all_ok = false;
      SNAP_WARN("snapshot store: cannot spill shard %s to %s: %s", to_string(v.key).c_str(),
                cfg_.spill_dir.c_str(), why.c_str());
      if (err) *err = "shard " + to_string(v.key) + ": " + why;
    }
    v.bytes.reset();
  }
  if (renamed && fsync(dir_fd_) != 0) {
    SNAP_WARN("snapshot store: fsync %s: %s (spilled shards may not survive a crash)",
              cfg_.spill_dir.c_str(), strerror(errno));
  }
  return all_ok;
}

StoreStatus ShardStore::put(const ShardKey& key, uint64_t base_step, uint64_t checksum,
                            const void* data, size_t size, std::string* err) {
  StoreStatus st = check_size(size, err);
  if (st != StoreStatus::kOk) return st;
  if (size > 0 && data == nullptr) {
    if (err) *err = "snapshot store: put of " + to_string(key) + " without data";
    return StoreStatus::kInvalid;
  }
  std::shared_ptr<uint8_t> copy = alloc_shard_bytes(size);
  if (!copy) {
    if (err) *err = "snapshot store: cannot allocate " + std::to_string(size) + " bytes";
    return StoreStatus::kFull;
  }
  if (size) std::memcpy(copy.get(), data, size);
  return put_shared(key, base_step, checksum, std::move(copy), size, err);
}

StoreStatus ShardStore::put(const ShardKey& key, uint64_t base_step, uint64_t checksum,
                            std::vector<uint8_t> bytes, std::string* err) {
  auto owner = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  const size_t n = owner->size();
  std::shared_ptr<const uint8_t> p(owner, owner->data());
  return put_shared(key, base_step, checksum, std::move(p), n, err);
}

StoreStatus ShardStore::put_shared(const ShardKey& key, uint64_t base_step, uint64_t checksum,
                                   std::shared_ptr<const uint8_t> bytes, size_t size,
                                   std::string* err) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!enter_locked(err)) return StoreStatus::kClosed;
  }
  struct Leave {
    ShardStore* s;
    ~Leave() { s->leave(); }
  } leave_guard{this};

  if (base_step > key.step) {
    if (err)
      *err = "snapshot store: shard " + to_string(key) + " has base step " +
             std::to_string(base_step) + " after its step";
    return StoreStatus::kInvalid;
  }
  StoreStatus st = check_size(size, err);
  if (st != StoreStatus::kOk) return st;
  if (size > 0 && !bytes) {
    if (err) *err = "snapshot store: put of " + to_string(key) + " without data";
    return StoreStatus::kInvalid;
  }
  // The one check of the hop that brought these bytes (outside the lock).
  const uint64_t got = shard_checksum(bytes.get(), size);
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.checksum_bytes += size;
  }
  if (got != checksum) {
    char msg[256];
    snprintf(msg, sizeof(msg),
             "snapshot store: shard %s refused: checksum 0x%016" PRIx64
             " of its %zu"
             " bytes, sender said 0x%016" PRIx64 " (the sender's copy is bad)",
             to_string(key).c_str(), got, size, checksum);
    SNAP_WARN("%s", msg);
    if (err) *err = msg;
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.crc_failures_put;
    return StoreStatus::kBadCrc;
  }
  auto sp = std::move(bytes);

  std::vector<Victim> victims;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(key);
    uint64_t replaced_in_memory = 0;
    if (it != index_.end()) {
      Entry& e = it->second;
      if (!e.info.corrupt && e.info.size == size && e.info.checksum == checksum &&
          e.info.base_step == base_step) {  // a duplicate (a retried send)
        if (e.where == Where::kMemory) lru_.splice(lru_.begin(), lru_, e.lru);
        return StoreStatus::kOk;
      }
      if (e.where != Where::kDisk) replaced_in_memory = e.info.size;
    }
    if (cfg_.spill_dir.empty() &&
        stats_.memory_bytes - replaced_in_memory + size > cfg_.memory_limit_bytes) {
      if (err) {
        *err = "snapshot store: no room for shard " + to_string(key) + " (" + std::to_string(size) +
               " bytes; " + std::to_string(stats_.memory_bytes) + " of " +
               std::to_string(cfg_.memory_limit_bytes) + " in use, no spill directory)";
      }
      return StoreStatus::kFull;
    }
    if (it != index_.end()) drop_locked(it);
    Entry e;
    e.info.key = key;
    e.info.base_step = base_step;
    e.info.size = size;
    e.info.checksum = checksum;
    e.where = Where::kMemory;
    e.gen = gen = next_gen_++;
    e.bytes = std::move(sp);
    e.lru = lru_.insert(lru_.begin(), key);
    index_.emplace(key, std::move(e));
    stats_.memory_bytes += size;
    ++stats_.shards_in_memory;
    if (dir_fd_ >= 0) {
      // A shard larger than the whole limit cannot stay in memory: it spills itself rather
      // than push every other shard out first.
      if (size > cfg_.memory_limit_bytes) {
        Entry& ne = index_.find(key)->second;
        lru_.erase(ne.lru);
        ne.where = Where::kSpilling;
        spilling_bytes_ += size;
        victims.push_back(Victim{key, gen, ne.info, ne.bytes});
      }
      pick_victims_locked(&victims, false);
    }
  }
  if (victims.empty()) return StoreStatus::kOk;
  std::string serr;
  if (spill(&victims, &serr)) return StoreStatus::kOk;
  // A spill failed. If memory is still over its limit and this shard is still in memory, refuse
  // it rather than grow without bound.
  std::lock_guard<std::mutex> lk(mu_);
  auto it = index_.find(key);
  if (it != index_.end() && it->second.gen == gen && it->second.where == Where::kMemory &&
      stats_.memory_bytes > cfg_.memory_limit_bytes) {
    drop_locked(it);
    if (err)
      *err = "snapshot store: shard " + to_string(key) + " refused: memory full and " +
             "spilling failed (" + serr + ")";
    return StoreStatus::kIoError;
  }
  return StoreStatus::kOk;
}

bool ShardStore::contains(const ShardKey& key) const {
  std::lock_guard<std::mutex> lk(mu_);
  return index_.count(key) != 0;
}

std::vector<ShardInfo> ShardStore::list() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<ShardInfo> out;
  out.reserve(index_.size());
  for (const auto& kv : index_) out.push_back(kv.second.info);
  return out;
}

void ShardStore::mark_corrupt(const ShardKey& key, uint64_t gen, const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = index_.find(key);
  if (it == index_.end() || it->second.gen != gen) return;  // replaced or dropped meanwhile
  if (!it->second.info.corrupt) {
    it->second.info.corrupt = true;
    ++stats_.crc_failures_get;
    SNAP_WARN("snapshot store: shard %s is corrupt (%s): not served", to_string(key).c_str(),
              why.c_str());
  }
}

StoreStatus ShardStore::read_file(const ShardKey& key, ShardRef* out, std::string* why) {
  const std::string name = file_name(key);
  int fd = openat(dir_fd_, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    *why = errno_text(("open " + spill_path(key)).c_str());
    return errno == ENOENT ? StoreStatus::kNotFound : StoreStatus::kIoError;
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    *why = errno_text(("stat " + spill_path(key)).c_str());
    return StoreStatus::kIoError;
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  uint8_t h[kHeaderBytes];
  if (file_bytes < kHeaderBytes) {
    *why =
        "spill file " + spill_path(key) + " truncated to " + std::to_string(file_bytes) + " bytes";
    return StoreStatus::kCorrupt;
  }
  if (!read_full(fd, h, sizeof(h), 0)) {
    *why = errno_text(("read " + spill_path(key)).c_str());
    return StoreStatus::kIoError;
  }
  ShardInfo fi;
  std::string hwhy;
  if (!decode_header(h, cfg_.max_shard_bytes, &fi, &hwhy)) {
    *why = "spill file " + spill_path(key) + ": " + hwhy;
    return StoreStatus::kCorrupt;
  }
  if (fi.key != key) {
    *why = "spill file " + spill_path(key) + " holds " + to_string(fi.key);
    return StoreStatus::kCorrupt;
  }
  if (file_bytes != kHeaderBytes + fi.size) {  // checked before allocating the payload
    *why = "spill file " + spill_path(key) + " is " + std::to_string(file_bytes) +
           " bytes, its header says " + std::to_string(kHeaderBytes + fi.size);
    return StoreStatus::kCorrupt;
  }
  std::shared_ptr<uint8_t> data = alloc_shard_bytes(size_t(fi.size));
  if (!data) {
    *why = "cannot allocate " + std::to_string(fi.size) + " bytes for " + spill_path(key);
    return StoreStatus::kIoError;
  }
  if (!read_full(fd, data.get(), size_t(fi.size), kHeaderBytes)) {
    *why = errno_text(("read " + spill_path(key)).c_str());
    return StoreStatus::kIoError;
  }
  // The one check of the disk hop.
  const uint64_t got = shard_checksum(data.get(), size_t(fi.size));
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.checksum_bytes += fi.size;
  }
  if (got != fi.checksum) {
    char msg[96];
    snprintf(msg, sizeof(msg), ": payload checksum 0x%016" PRIx64 ", header says 0x%016" PRIx64,
             got, fi.checksum);
    *why = "spill file " + spill_path(key) + msg;
    return StoreStatus::kCorrupt;
  }
  out->info = fi;
  out->data = std::move(data);
  return StoreStatus::kOk;
}

StoreStatus ShardStore::get(const ShardKey& key, std::vector<uint8_t>* out, ShardInfo* info,
                            std::string* err) {
  ShardRef r;
  StoreStatus st = view(key, &r, err);
  if (st != StoreStatus::kOk) return st;
  if (out) {
    if (r.info.size)
      out->assign(r.data.get(), r.data.get() + r.info.size);
    else
      out->clear();
  }
  if (info) *info = r.info;
  return StoreStatus::kOk;
}

StoreStatus ShardStore::view(const ShardKey& key, ShardRef* out, std::string* err) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!enter_locked(err)) return StoreStatus::kClosed;
  }
  struct Leave {
    ShardStore* s;
    ~Leave() { s->leave(); }
  } leave_guard{this};

  auto corrupt = [&](const std::string& why) {
    if (err)
      *err = "snapshot store: shard " + to_string(key) + " is corrupt (" + why +
             "); use another replica";
    return StoreStatus::kCorrupt;
  };
  // A spilled shard's file can be replaced (a new put, spilled) or removed (prune) while it is
  // read; look it up again then. Three rounds of that in a row would take a pathological churn.
  for (int attempt = 0; attempt < 3; ++attempt) {
    ShardInfo cur;
    uint64_t gen = 0;
    std::shared_ptr<const uint8_t> bytes;
    bool in_memory = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = index_.find(key);
      if (it == index_.end()) {
        if (err) *err = "snapshot store: no shard " + to_string(key);
        return StoreStatus::kNotFound;
      }
      Entry& e = it->second;
      if (e.info.corrupt) return corrupt("failed its check when last served");
      cur = e.info;
      gen = e.gen;
      in_memory = e.where != Where::kDisk;
      if (in_memory) bytes = e.bytes;
      if (e.where == Where::kMemory) lru_.splice(lru_.begin(), lru_, e.lru);
    }
    if (in_memory) {
      // Checked when it was stored; memory is not a hop (the reader of what is served checks).
      out->info = cur;
      out->data = std::move(bytes);
      return StoreStatus::kOk;
    }
    ShardRef fr;
    std::string why;
    StoreStatus st = read_file(key, &fr, &why);
    if (st == StoreStatus::kOk) {
      *out = std::move(fr);
      return StoreStatus::kOk;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = index_.find(key);
      const bool changed = it == index_.end() || it->second.gen != gen;
      if (changed) continue;  // replaced or dropped while we read: look again
    }
    if (st == StoreStatus::kCorrupt || st == StoreStatus::kNotFound) {
      // An indexed file that is missing or bad: both mean this copy cannot be served.
      mark_corrupt(key, gen, why);
      return corrupt(why);
    }
    SNAP_WARN("snapshot store: reading shard %s: %s", to_string(key).c_str(), why.c_str());
    if (err) *err = "snapshot store: shard " + to_string(key) + ": " + why;
    return st;
  }
  if (err) *err = "snapshot store: shard " + to_string(key) + " kept changing while read";
  return StoreStatus::kIoError;
}

bool ShardStore::report_corrupt(const ShardKey& key, const std::string& why) {
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_ != State::kOpen) return false;
    auto it = index_.find(key);
    if (it == index_.end()) return false;
    gen = it->second.gen;
  }
  mark_corrupt(key, gen, why);
  return true;
}

bool ShardStore::erase(const ShardKey& key) {
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ != State::kOpen) return false;
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  drop_locked(it);
  ++stats_.pruned;
  return true;
}

PruneResult ShardStore::prune(uint64_t keep) {
  PruneResult res;
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ != State::kOpen) return res;
  auto it = index_.begin();
  while (it != index_.end()) {
    // One (rank, buffer) chain group: [it, group_end), oldest step first.
    const uint32_t rank = it->first.rank, buffer = it->first.buffer;
    auto group_end = it;
    auto target = index_.end();  // the newest shard at or before `keep`
    while (group_end != index_.end() && group_end->first.rank == rank &&
           group_end->first.buffer == buffer) {
      if (group_end->first.step <= keep) target = group_end;
      ++group_end;
    }
    if (target != index_.end()) {
      const uint64_t base = target->second.info.base_step;
      while (it != group_end) {
        auto cur = it++;
        const ShardInfo& si = cur->second.info;
        const bool needed = si.key.step > keep || (si.key.step >= base && si.base_step == base);
        if (!needed) {
          res.bytes += si.size;
          ++res.shards;
          ++stats_.pruned;
          drop_locked(cur);
        }
      }
    }
    it = group_end;
  }
  return res;
}

StoreStats ShardStore::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

}  // namespace r2ccl::snap
