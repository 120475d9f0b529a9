// The health board: one POSIX shared-memory segment per node and user, "/r2ccl-<uid>-<name>"
// (name from R2CCL_HEALTH_BOARD). Net plugin processes publish one slot per (process, rail);
// the snapshot coordinator publishes the agreed cluster record; the tuner and r2ccl_status
// read. Every reader treats the board as a hint: absent, stale, torn or corrupt data gives an
// error (the caller acts as if nothing were published), never a crash or an out-of-bounds read.
// docs/HEALTH-BOARD.md describes the layout and the protocol.
//
// Concurrency: every slot and the agreed record have their own seqlock (an even/odd sequence
// counter; odd = a write is in progress). A slot has one writer, its owner process, which
// claimed it with a CAS on the owner pid. Readers retry a bounded number of times and never
// block. Thread-safety: the free functions may be called from any thread; a Publisher's
// methods are serialised by an internal mutex.
//
// Assumption: every process using one board shares a pid namespace (a slot whose owner pid
// does not exist, kill(pid, 0) == ESRCH, is stale and may be reclaimed). Only remove_board()
// (shm_unlink) is safe while processes have the board mapped; truncating a live segment by
// hand can SIGBUS its users.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace r2ccl {
struct RailCounters;  // r2ccl/rail_stats.h
}

namespace r2ccl::board {

constexpr int kMaxNodes = 1024;

// The agreed cluster state: published by the snapshot sidecar's coordinator (later work; tests
// use a fake publisher), identical on every node once agreed. The tuner reads it at init.
struct AgreedRecord {
  uint64_t epoch = 0;                     // 0 = nothing agreed yet
  uint32_t n_nodes = 0;                   // nodes in the job
  uint32_t reserved = 0;
  uint64_t members[kMaxNodes / 64] = {};  // bitmap of live node ids
  float node_usable_gbps[kMaxNodes] = {}; // usable network bandwidth per node, GB/s; 0 = unknown
};
// Number of bits set in rec.members.
int member_count(const AgreedRecord& rec);

enum class Transport : uint8_t { kUnknown = 0, kTcp = 1, kIb = 2 };
enum class RailState : uint8_t { kUnknown = 0, kUp = 1, kFailed = 2, kDown = 3, kDraining = 4 };
const char* transport_name(Transport t);  // "tcp", "ib", "unknown"
const char* state_name(RailState s);      // "up", "failed", "down", "draining", "unknown"

constexpr size_t kRailNameLen = 48;  // including the terminating NUL
constexpr size_t kCauseLen = 48;

// What a process publishes for one rail. Plain data (it is copied into shared memory).
struct RailFields {
  char name[kRailNameLen] = {};  // "eth0", "mlx5_0:1"; set with set_text()
  Transport transport = Transport::kUnknown;
  RailState state = RailState::kUnknown;
  uint8_t pad_[2] = {};
  uint32_t usable_mbps = 0;  // usable bandwidth now (0 when the rail is down)
  uint64_t bytes_sent = 0;
  uint64_t chunks_sent = 0;
  uint64_t chunks_replayed = 0;
  uint64_t switchovers = 0;
  uint64_t failbacks = 0;
  uint64_t paths_failed = 0;
  int64_t last_switchover_us = 0;  // CLOCK_MONOTONIC microseconds; 0 = never
  char cause[kCauseLen] = {};      // short cause of the last switchover
  float risk = -1;                 // failure risk 0..1 from the predictor; -1 unknown
  uint32_t pad2_ = 0;
};
// Copies `s` into a fixed array, truncated, always NUL-terminated.
void set_text(char* dst, size_t cap, const std::string& s);

// One live slot as read back.
struct RailSlot {
  int slot = -1;        // index in the segment
  int32_t pid = 0;      // owner process
  int32_t rail = -1;    // the owner's rail index
  int64_t publish_us = 0;  // CLOCK_MONOTONIC time of the last publish
  RailFields f;
};

struct BoardView {
  std::vector<RailSlot> rails;  // live slots, by slot index
  bool has_agreed = false;      // an agreed record with epoch != 0 was read consistently
  AgreedRecord agreed;
  std::vector<int> torn_slots;  // slots still being written after the bounded retries
  int stale_slots = 0;          // slots owned by a process that no longer exists
  int agreed_torn = 0;          // 1 if the agreed record was torn after the retries
  uint32_t slot_count = 0;
  std::string segment;          // "/r2ccl-<uid>-<name>"
};

// False when a member bit is set at or beyond n_nodes (a corrupt record). read_* apply it.
bool agreed_record_consistent(const AgreedRecord& rec);

// Board name -> "/r2ccl-<uid>-<name>". Returns false with *err if the name is not
// [A-Za-z0-9_-]{1,64}.
bool segment_name(const std::string& board, std::string* out, std::string* err);

// Reads the agreed record from this node's board. Returns false (and *err says why: absent,
// version, truncated, corrupt, torn after retries) -> the caller acts as if nothing were agreed.
// A board without any agreed record yet returns true with epoch 0.
bool read_agreed_record(const std::string& board, AgreedRecord* out, std::string* err);

// Publishes (creating the board if needed). Thread-safe. Two publishers (threads or processes)
// are serialised by the record's sequence counter (a writer CASes it from even to odd); the
// last write wins. A writer that died mid-write is taken over after ~100 ms.
bool publish_agreed_record(const std::string& board, const AgreedRecord& rec, std::string* err);

// A consistent snapshot of every live slot + the agreed record, for r2ccl_status.
// Returns false with *err when the board is absent or unusable (see read_agreed_record).
bool read_board(const std::string& board, BoardView* out, std::string* err);

bool remove_board(const std::string& board);  // shm_unlink, for tests and tools

// Error kinds, so tools can pick an exit code. read_* set *kind when non-null.
enum class BoardError {
  kNone = 0, kAbsent, kInvalidName, kVersion, kTruncated, kCorrupt, kSystem
};
bool read_board(const std::string& board, BoardView* out, std::string* err, BoardError* kind);

// Per-rail publishing by a net plugin process: open once, then publish(rail index, fields) from
// the background thread; close releases the process's slots. Publishing is a few hundred
// bytes of memcpy and, the first time for a rail, a scan for a free slot; it never blocks.
class Publisher {
 public:
  Publisher() = default;
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Opens (creating if needed) the board. Returns false with *err on a bad name, a board of
  // another layout version, or a system error.
  bool open(const std::string& board, std::string* err);
  bool is_open() const;
  // Writes rail `rail`'s slot (claimed at the first call). Returns false when the board is not
  // open, no slot is free, or the process forked since open (the child does not publish).
  bool publish(int rail, const RailFields& f);
  // Frees this process's slots and unmaps the board.
  void close();
  const std::string& segment() const { return segment_; }

 private:
  friend class PublisherTestPeer;  // tests: leave a slot mid-write
  struct Map;
  int claim_locked();
  bool write_locked(int rail, const RailFields& f, bool finish);

  mutable std::mutex mu_;
  Map* map_ = nullptr;
  pid_t pid_ = 0;
  std::string segment_;
  std::vector<int> slot_of_rail_;  // rail -> slot index, -1 unclaimed
};

// Publisher-side helper, one per rail, kept by the publishing thread: copies a transport's
// RailCounters into `f` and stamps the last switchover. When the switchover counter moved
// since the previous call, last_switchover_us = now and cause = `cause_if_switched` (the
// counters say that a switchover happened, not exactly when: the stamp is within one publish
// period).
class RailPublishState {
 public:
  void fill(const RailCounters& c, int64_t now_us, const char* cause_if_switched, RailFields* f);

 private:
  uint64_t seen_switchovers_ = 0;
  int64_t last_us_ = 0;
  char cause_[kCauseLen] = {};
};

// ---- Layout (version kLayoutVersion). Exposed for tests and documentation. -----------------
constexpr uint64_t kMagic = 0x4452414f42434352ULL;  // "RCCBOARD" little-endian
constexpr uint32_t kLayoutVersion = 1;
constexpr uint32_t kDefaultSlots = 256;
constexpr uint32_t kMaxSlots = 65536;

struct SegmentHeader {
  uint64_t magic;          // kMagic, written last by the creator (release)
  uint32_t version;        // kLayoutVersion
  uint32_t header_size;    // sizeof(SegmentHeader)
  uint64_t total_size;     // bytes of the whole segment
  uint32_t slot_count;
  uint32_t slot_size;      // sizeof(ShmSlot)
  uint64_t agreed_offset;  // offset of the AgreedBlock
  uint64_t slots_offset;   // offset of slot 0
  uint32_t agreed_size;    // sizeof(AgreedBlock)
  uint32_t creator_pid;
  uint8_t pad[64 - 56];
};
static_assert(sizeof(SegmentHeader) == 64, "header layout");

struct alignas(64) AgreedBlock {
  uint64_t seq;  // seqlock: odd while written
  uint64_t pad[7];
  AgreedRecord rec;
};

struct SlotPayload {
  int32_t pid;
  int32_t rail;
  int64_t publish_us;
  RailFields f;
};

struct alignas(64) ShmSlot {
  uint64_t seq;   // seqlock: odd while written
  int32_t owner;  // claiming pid (CAS), 0 = free
  int32_t pad;
  SlotPayload p;
};

}  // namespace r2ccl::board
