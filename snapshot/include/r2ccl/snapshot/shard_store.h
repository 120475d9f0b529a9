// ShardStore: the shards r2ccl_snapshotd holds for its peers (snapshot/README.md, "Shard store
// and consistent cuts").
//
// A shard is one rank's encoded snapshot frame of one buffer at one step: opaque bytes from the
// delta codec, keyed by (job-wide rank, step, buffer id), with the step of the base frame its
// chain starts from (a base frame has base_step == step) and the checksum of its bytes
// (shard_checksum(): XXH3-64), both supplied by the sender.
//
// - Shards are held in memory up to StoreConfig::memory_limit_bytes; beyond it the least
//   recently used ones spill to StoreConfig::spill_dir, one file per shard (written to a temp
//   name, fsync'd, renamed, directory fsync'd). get() reads a spilled shard transparently and
//   does not bring it back into memory.
// - One checksum check per hop, never more: a shard's checksum is verified when it is stored
//   (put: the hop that brought it; a mismatch is refused, the sender's copy is bad) and when a
//   spilled shard is read back from its file (the disk hop; a mismatch returns kCorrupt naming
//   the shard, so the caller can use another replica, and the shard stays marked corrupt).
//   Bytes held in memory are not hashed again when served (view(), get()): whoever receives
//   them over the next hop checks them once (the requesting daemon, the client).
// - A new store on the same directory serves what was spilled: open() indexes every valid shard
//   file; bad or truncated ones are reported, moved aside (NAME.bad) and never trusted.
// - close() (and the destructor) spill every shard still in memory when spill_on_close is set
//   (the default), so a restart after a clean stop loses nothing. After a crash, what was only
//   in memory is lost (the other replicas hold it).
// - prune(keep) keeps what restores step `keep` (and anything newer) and drops the rest.
//
// Sizes are bytes of shard payload (file headers are not counted). Every size is checked against
// StoreConfig::max_shard_bytes before anything is allocated for it.
//
// Thread-safety: every method may be called from any thread, concurrently (close() included;
// it waits for calls in progress and refuses new ones). One mutex guards the index; checksums
// are computed and shard files written and read outside it. The only disk operations made under it
// are metadata ones (rename, unlink). Spill writes are serialised by a second mutex. One store
// per directory: open() takes an exclusive flock on DIR/LOCK.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace r2ccl::snap {

// The checksum of a shard's bytes: XXH3-64 (libxxhash, XXH3_64bits(data, n), seed 0), what
// senders put in ShardMeta::checksum. Thread-safe; about 10+ GB/s on one core (SSE2 build).
uint64_t shard_checksum(const void* data, size_t n);
// `n` uninitialised bytes (n == 0: a 1-byte allocation) for a shard, or null when the
// allocation fails. Thread-safe.
std::shared_ptr<uint8_t> alloc_shard_bytes(size_t n);

// Orders by (rank, buffer, step): one (rank, buffer) chain is contiguous, oldest step first.
struct ShardKey {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t buffer = 0;
  bool operator==(const ShardKey& o) const {
    return rank == o.rank && step == o.step && buffer == o.buffer;
  }
  bool operator!=(const ShardKey& o) const { return !(*this == o); }
  bool operator<(const ShardKey& o) const {
    if (rank != o.rank) return rank < o.rank;
    if (buffer != o.buffer) return buffer < o.buffer;
    return step < o.step;
  }
};
// "rank 3 step 40 buffer 1": how every message names a shard.
std::string to_string(const ShardKey& k);

// What the store knows about one shard.
struct ShardInfo {
  ShardKey key;
  uint64_t base_step = 0;  // the step of the base frame of its chain (== key.step: a base)
  uint64_t size = 0;       // payload bytes
  uint64_t checksum = 0;   // shard_checksum() of the payload
  bool spilled = false;    // in the spill directory (false: in memory)
  bool corrupt = false;    // failed its check when last read (or reported); get() refuses it
};

// A shard's bytes held by reference (view()): info.size bytes at data, valid for as long as the
// ShardRef (or a copy of its shared_ptr) lives, whatever the store does with the shard
// meanwhile (replace, spill, prune). Read-only.
struct ShardRef {
  ShardInfo info;
  std::shared_ptr<const uint8_t> data;
};

enum class [[nodiscard]] StoreStatus : int{
    kOk = 0,
    kNotFound,  // no such shard (never stored, pruned, erased)
    kCorrupt,   // the stored copy failed its check (spill file) or was reported corrupt
    kBadCrc,    // put(): the bytes do not match the sender's checksum (the sender's copy is bad)
    kTooLarge,  // over StoreConfig::max_shard_bytes
    kFull,      // memory limit reached and no spill directory (or spilling failed: kIoError)
    kIoError,   // the spill directory failed (open, write, fsync, rename, lock)
    kInvalid,   // bad argument or configuration (base_step > step, zero limits)
    kClosed,    // open() not called yet, or close() called
};
// "ok", "not-found", "corrupt", "bad-crc", "too-large", "full", "io-error", "invalid", "closed".
const char* store_status_name(StoreStatus s);

struct StoreConfig {
  // Where shards spill, one file per shard (created if missing). Empty: memory only (put()
  // beyond the memory limit returns kFull).
  std::string spill_dir;
  uint64_t memory_limit_bytes = 1ull << 30;  // payload bytes held in memory before spilling
  uint64_t max_shard_bytes = 1ull << 30;     // larger shards are refused (kTooLarge); > 0
  bool spill_on_close = true;                // close() spills what is in memory (see above)
};

struct StoreStats {
  uint64_t memory_bytes = 0;   // payload bytes in memory (including shards being spilled)
  uint64_t spilled_bytes = 0;  // payload bytes in the spill directory (indexed shards)
  uint64_t shards_in_memory = 0;
  uint64_t shards_spilled = 0;
  uint64_t spills = 0;            // shards written to the spill directory since construction
  uint64_t spill_failures = 0;    // spill writes that failed (the shard stayed in memory)
  uint64_t crc_failures_put = 0;  // put() refused for a checksum mismatch
  uint64_t crc_failures_get = 0;  // shards found corrupt when read back or reported corrupt
  uint64_t checksum_bytes = 0;    // bytes hashed by the store (put, spill file reads)
  uint64_t files_skipped = 0;     // files open() did not index (bad, truncated, foreign, temp)
  uint64_t pruned = 0;            // shards dropped by prune() and erase()
};

// What open() found in the spill directory.
struct OpenReport {
  uint64_t indexed = 0;              // valid shard files now served
  std::vector<std::string> skipped;  // one message per file not indexed, naming it and why
};

// What prune() dropped.
struct PruneResult {
  uint64_t shards = 0;
  uint64_t bytes = 0;  // payload bytes (memory and disk)
};

class ShardStore {
 public:
  explicit ShardStore(StoreConfig cfg);
  // close(); errors are logged, never thrown.
  ~ShardStore();
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  // Validates the configuration, creates (mode 0700) and locks the spill directory (if any) and
  // indexes the shard files in it. Files that are not valid shard files are reported in
  // *report (and logged) and not indexed: shard files with a bad header or length are renamed
  // NAME.bad, leftover temp files (NAME.tmp, from a write interrupted by a crash) are deleted,
  // foreign files and directories are left alone. Payload CRCs of indexed files are checked
  // when served, not here.
  // Errors: kInvalid (configuration), kIoError (directory cannot be created, opened, listed or
  // locked: another store holds it), kClosed (called twice, or after close()). *err says why.
  // report may be null.
  StoreStatus open(OpenReport* report, std::string* err);

  // Spills what is in memory (spill_on_close), releases the directory; later calls return
  // kClosed. Waits for the calls in progress. Idempotent: a second call returns kOk. kIoError
  // when a shard could not be spilled (it is lost; *err names it).
  StoreStatus close(std::string* err);

  // Refuses a size before anything is allocated for it: kTooLarge when bytes >
  // max_shard_bytes, else kOk. For the protocol layer, before it allocates a receive buffer.
  StoreStatus check_size(uint64_t bytes, std::string* err) const;

  // Stores a shard (replacing one with the same key; an identical one, same size, base and
  // checksum, is only marked as recently used), held by reference: `size` bytes at `bytes`,
  // which must not change afterwards (an aliasing shared_ptr into a larger received frame is
  // fine: nothing is copied). Verifies shard_checksum(bytes) == checksum first (one pass, on
  // the calling thread). May spill least recently used shards (this thread writes them).
  // Errors: kTooLarge, kBadCrc (logged; counted), kInvalid (base_step > step, null bytes),
  // kFull (memory only, and the limit would be exceeded), kIoError (spilling failed and memory
  // is over its limit: the shard is not stored), kClosed. Nothing is stored on error.
  StoreStatus put_shared(const ShardKey& key, uint64_t base_step, uint64_t checksum,
                         std::shared_ptr<const uint8_t> bytes, size_t size, std::string* err);
  // The same, the vector moved in (not copied).
  StoreStatus put(const ShardKey& key, uint64_t base_step, uint64_t checksum,
                  std::vector<uint8_t> bytes, std::string* err);
  // The same, copying `size` bytes from `data` (size checked first).
  StoreStatus put(const ShardKey& key, uint64_t base_step, uint64_t checksum, const void* data,
                  size_t size, std::string* err);

  // The shard's bytes by reference, without a copy: a shard in memory is handed out as is (it
  // was checked when stored); a spilled one is read from its file into a new buffer and its
  // file header and checksum are verified (the disk hop), without bringing it back into memory.
  // Sets *out only on success. Errors: kNotFound, kCorrupt (logged; counted; the shard stays
  // marked corrupt until a put of the same key replaces it; *err names rank, step and buffer),
  // kIoError (the file could not be read), kClosed.
  StoreStatus view(const ShardKey& key, ShardRef* out, std::string* err);
  // view(), then a copy of the payload into *out (resized) and the description into *info
  // (either may be null).
  StoreStatus get(const ShardKey& key, std::vector<uint8_t>* out, ShardInfo* info,
                  std::string* err);
  // A reader of a served copy found it corrupt (its checksum failed over the next hop, which
  // may also be a bad transfer): the shard is marked corrupt (logged, counted in
  // crc_failures_get) and refused from then on. False when absent or the store is not open.
  bool report_corrupt(const ShardKey& key, const std::string& why);

  // Whether the shard is indexed (false before open() and after close()).
  bool contains(const ShardKey& key) const;
  // Every indexed shard, in ShardKey order (empty before open() and after close()).
  std::vector<ShardInfo> list() const;

  // Drops one shard (memory and file; counted in stats().pruned). False when absent, or when
  // the store is not open.
  bool erase(const ShardKey& key);

  // Retention, given the newest complete step `keep` (CutTracker::newest_complete()). For each
  // (rank, buffer): the chain that restores `keep` is kept (the newest shard at or before
  // `keep`, its base B = that shard's base_step, and every shard of the chain, base_step == B,
  // with step in [B, keep]), and every shard newer than `keep` (still in flight); the other
  // shards at or before `keep` (older chains) are dropped, from memory and disk. A file that
  // cannot be removed is logged. Returns what was dropped ({} when the store is not open).
  PruneResult prune(uint64_t keep);

  // A consistent copy of the counters (gauges read 0 after close()).
  StoreStats stats() const;
  // The spill file a shard has or would have: DIR/r<rank>_s<step>_b<buffer>.shard ("" without a
  // spill directory). For operators and tests.
  std::string spill_path(const ShardKey& key) const;

 private:
  enum class Where : uint8_t { kMemory, kSpilling, kDisk };
  struct Entry {
    ShardInfo info;
    Where where = Where::kMemory;
    uint64_t gen = 0;  // bumped by every put, so a spill of a replaced shard is not committed
    std::shared_ptr<const uint8_t> bytes;  // kMemory, kSpilling: info.size bytes
    std::list<ShardKey>::iterator lru;     // kMemory only
  };
  struct Victim {
    ShardKey key;
    uint64_t gen;
    ShardInfo info;
    std::shared_ptr<const uint8_t> bytes;
  };
  enum class State : uint8_t { kNew, kOpen, kClosing, kClosed };

  // All *_locked functions need mu_ held.
  bool enter_locked(std::string* err);  // state check + ++active_
  void leave();
  void drop_locked(std::map<ShardKey, Entry>::iterator it);
  void pick_victims_locked(std::vector<Victim>* out, bool all);
  // Writes the victims' files (under io_mu_), commits them under mu_. False if one failed.
  bool spill(std::vector<Victim>* victims, std::string* err);
  // Reads and checks a spill file (header, length, checksum: counted in checksum_bytes).
  StoreStatus read_file(const ShardKey& key, ShardRef* out, std::string* why);
  void mark_corrupt(const ShardKey& key, uint64_t gen, const std::string& why);
  std::string file_name(const ShardKey& key) const;

  const StoreConfig cfg_;
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  State state_ = State::kNew;        // guarded by mu_
  int active_ = 0;                   // calls in progress; guarded by mu_
  std::map<ShardKey, Entry> index_;  // guarded by mu_
  std::list<ShardKey> lru_;          // kMemory shards, most recent first; mu_
  uint64_t next_gen_ = 1;            // mu_
  uint64_t spilling_bytes_ = 0;      // bytes of kSpilling shards; mu_
  StoreStats stats_;                 // mu_
  std::mutex io_mu_;                 // serialises spill writes (the temp file name)
  int dir_fd_ = -1;                  // set by open(), closed by close()
  int lock_fd_ = -1;
};

}  // namespace r2ccl::snap
