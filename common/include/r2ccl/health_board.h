// The health board: one POSIX shared-memory segment per node and user, "/r2ccl-<uid>-<name>"
// (name from R2CCL_HEALTH_BOARD). Net plugin processes publish one slot per (process, rail);
// one of them, elected through the sampler block, also publishes the failure predictor's risk
// per rail; the snapshot coordinator publishes the agreed cluster record; the tuner, the net
// plugins and r2ccl_status read. Every reader treats the board as a hint: absent, stale, torn or
// corrupt data gives an error (the caller acts as if nothing were published), never a crash or
// an out-of-bounds read. docs/HEALTH-BOARD.md describes the layout and the protocol.
//
// Concurrency: every slot, the agreed record and the sampler block have their own seqlock (an
// even/odd sequence counter; odd = a write is in progress). A slot has one writer, its owner
// process, which claimed it with a CAS on the owner pid; the sampler block likewise has one
// owner (the sampler), elected with a CAS. Readers retry a bounded number of times and never
// block. Thread-safety: the free functions may be called from any thread; a Publisher's
// methods may be called from any thread of the process that opened it and are serialised by an
// internal mutex (none blocks on another process).
//
// Times on the board are CLOCK_MONOTONIC microseconds (r2ccl::now_us()), comparable across the
// processes of one node.
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

// The agreed cluster state: published by the snapshot sidecar's coordinator (snapshot/; tests
// use a fake publisher), identical on every node once agreed. The tuner reads it at init.
struct AgreedRecord {
  uint64_t epoch = 0;    // 0 = nothing agreed yet
  uint32_t n_nodes = 0;  // nodes in the job
  uint32_t reserved = 0;
  uint64_t members[kMaxNodes / 64] = {};   // bitmap of live node ids
  float node_usable_gbps[kMaxNodes] = {};  // usable network bandwidth per node, GB/s; 0 = unknown
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
  // Not written by the plugins (-1 = unknown): the predictor's risk per rail is in the
  // sampler block (read_sampler, BoardView::sampler), once per node rather than per process.
  float risk = -1;
  uint32_t pad2_ = 0;
  // TCP rails: TCP_INFO total_retrans, and tcpi_segs_out, summed over this process's sockets
  // on the rail (cumulative; the predictor's `retrans` and `tx_packets`). 0 on verbs rails.
  uint64_t tcp_retrans = 0;
  uint64_t tcp_segs_out = 0;
};
// Copies `s` into a fixed array, truncated, always NUL-terminated.
void set_text(char* dst, size_t cap, const std::string& s);

// One live slot as read back.
struct RailSlot {
  int slot = -1;           // index in the segment
  int32_t pid = 0;         // owner process
  int32_t rail = -1;       // the owner's rail index
  int64_t publish_us = 0;  // CLOCK_MONOTONIC time of the last publish
  RailFields f;
};

// ---- The failure predictor's sampler block --------------------------------------------------
// One process per node (the first net plugin process to claim it, Publisher::claim_sampler)
// samples the NICs' counters and publishes each rail's failure risk here; the others read it.

constexpr int kMaxRiskRails = 64;  // rails one sampler can publish

enum class RiskSource : uint8_t { kNone = 0, kLstm = 1, kBaseline = 2, kBoth = 3 };
const char* risk_source_name(RiskSource s);  // "lstm", "baseline", "both", "none"

// One rail's risk, written by the sampler. Plain data (it is copied into shared memory).
struct RiskEntry {
  char rail[kRailNameLen] = {};  // the rail's name as the transports name it: "eth0", "mlx5_0:1"
  float risk = -1;               // failure probability within the horizon, 0..1; -1 unknown
  // ccl_retransmit_ratio over the predictor window, 0..1; -1 unknown
  float retransmit_ratio = -1;
  RiskSource source = RiskSource::kNone;
  uint8_t drain = 0;  // 1: the sampler decided to drain this rail (hysteresis applied)
  // With drain: seconds from the publish time the rail stays drained at least (what is left of
  // R2CCL_PREDICT_MIN_DRAIN or a flap hold), 0..3600 (a reader clamps), so that a sampler
  // taking over keeps it. 0: no such hold. In what was padding before: a writer that does not
  // know it writes 0.
  uint16_t hold_s = 0;
  uint8_t pad_[4] = {};
  char top[kCauseLen] = {};  // top contributing counters, e.g. "symbol_err,rcv_err"
};

// The sampler block as read back (read_sampler, BoardView::sampler).
//
// Risks are served only while they are live: `rails` is non-empty only when the owner process
// exists, the payload was written by that owner (not by a predecessor) and its last publish is
// at most kSamplerStaleIntervals x interval_us old (the age at which another process may take
// the block over). Otherwise `rails` is empty and a reader acts as if every risk were unknown:
//   - no sampler (owner 0) or a dead owner: owner = 0, publish_us = interval_us = 0;
//   - an owner that has not published since it claimed: owner set, publish_us = 0;
//   - a hung owner (publish too old): owner, publish_us and interval_us set (its age shows).
struct SamplerView {
  int32_t owner = 0;        // sampler pid, 0 none
  int64_t publish_us = 0;   // CLOCK_MONOTONIC us of the last publish
  int64_t interval_us = 0;  // the sampler's sampling interval
  std::vector<RiskEntry> rails;
};

// A sampler whose last publish is older than this many of its intervals is hung: another
// process may take the block over, and readers no longer serve its risks.
constexpr int kSamplerStaleIntervals = 10;

// The entry of `rail` (exact, case-sensitive name match) in `v.rails`, or nullptr. The pointer
// is into `v` and lives as long as `v` is not modified. Any thread.
const RiskEntry* find_risk(const SamplerView& v, const std::string& rail);
// The longest RiskEntry::hold_s a reader takes (R2CCL_PREDICT_MIN_DRAIN's and the flap hold's
// most, an hour); more reads as this.
constexpr uint16_t kMaxHoldS = 3600;

struct BoardView {
  std::vector<RailSlot> rails;  // live slots, by slot index
  bool has_agreed = false;      // an agreed record with epoch != 0 was read consistently
  AgreedRecord agreed;
  // true: the sampler block was read consistently and is valid (as read_sampler returning
  // true); sampler.owner == 0 then means "no live sampler". false: sampler_error says why
  // (torn, corrupt) and sampler is empty.
  bool has_sampler = false;
  SamplerView sampler;
  std::string sampler_error;
  std::vector<int> torn_slots;  // slots still being written after the bounded retries
  int stale_slots = 0;          // slots owned by a process that no longer exists
  int agreed_torn = 0;          // 1 if the agreed record was torn after the retries
  uint32_t slot_count = 0;
  std::string segment;  // "/r2ccl-<uid>-<name>"
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

// Reads the sampler block: a consistent copy (seqlock, at most 64 attempts, never blocks),
// checked: n <= kMaxRiskRails, strings NUL-terminated, a risk or retransmit ratio outside 0..1
// (or NaN) read as -1, an unknown source as kNone, drain as 0/1. Returns false with *err when
// the board is absent or unusable (as read_agreed_record), the block is torn after the retries
// (its writer is still writing, or hung mid-write) or corrupt. Returns true otherwise, with the
// live risks only (see SamplerView: a dead or hung sampler's risks are never served). Any
// thread; a few microseconds plus one kill(pid, 0).
bool read_sampler(const std::string& board, SamplerView* out, std::string* err);

bool remove_board(const std::string& board);  // shm_unlink, for tests and tools

// Error kinds, so tools can pick an exit code. read_* set *kind when non-null.
enum class BoardError { kNone = 0, kAbsent, kInvalidName, kVersion, kTruncated, kCorrupt, kSystem };
bool read_board(const std::string& board, BoardView* out, std::string* err, BoardError* kind);

// Per-rail publishing by a net plugin process: open once, then publish(rail index, fields) from
// the background thread; close releases the process's slots. Publishing is a few hundred
// bytes of memcpy and, the first time for a rail, a scan for a free slot; it never blocks.
//
// The sampler: every process calls claim_sampler(interval) once per sampling interval from its
// background thread; the one that gets true samples and calls publish_risks(). The others read
// the risks with read_sampler(). A process that exits (or hangs for kSamplerStaleIntervals
// intervals) is replaced by the next process to call claim_sampler. Ownership is per process
// (by pid): a process uses one Publisher.
//
// Every method may be called from any thread of the process that called open(); calls are
// serialised by an internal mutex. In a child forked after open(), every method except
// is_open()/segment() returns false or does nothing (the child neither publishes nor claims,
// and close() in the child leaves the parent's slots and sampler ownership alone).
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
  // Makes this process the node's sampler if no live process is: CASes the block's owner from
  // 0 to this pid, or takes the block over when its owner no longer exists (kill(pid, 0) ==
  // ESRCH) or is hung (its last publish is older than kSamplerStaleIntervals x its interval;
  // an owner that has not published since claiming counts from when this publisher first saw
  // it). A process that takes the block clears the previous sampler's risks (publishes an empty
  // set) so that they are never served under the new owner. `interval_us` (> 0, microseconds)
  // is this process's sampling interval: the hung test others apply to it, published with each
  // publish_risks. Returns true when this process is the sampler (now or already); false when
  // another live process is, or when the board is not open, interval_us <= 0, or the process
  // forked since open. Cost: an atomic load, and when another process owns the block one
  // kill(pid, 0) and a seqlock read of 24 bytes; never blocks. Call it every interval.
  bool claim_sampler(int64_t interval_us);
  // The sampler publishes its rails' risks. `now_us` is r2ccl::now_us() (CLOCK_MONOTONIC
  // microseconds: other processes compare it with their own clock to detect a hung sampler).
  // Strings are copied truncated and NUL-terminated; values are stored as given (readers
  // sanitise). Returns false, publishing nothing, when this process is not the sampler (never
  // claimed, or taken over as hung), the board is not open, the process forked, or another live
  // process is in the middle of a write to the block (a displaced sampler: try again next
  // interval). More than kMaxRiskRails entries: the first kMaxRiskRails are published and the
  // call returns false (the caller is told that rails were dropped).
  bool publish_risks(const std::vector<RiskEntry>& rails, int64_t now_us);
  // Frees this process's slots, releases the sampler block if this process owns it (its risks
  // are cleared, owner = 0, so that another process takes over at its next claim_sampler), and
  // unmaps the board.
  void close();
  const std::string& segment() const { return segment_; }

 private:
  friend class PublisherTestPeer;  // tests: leave a slot or the sampler block mid-write
  struct Map;
  int claim_locked();
  bool write_locked(int rail, const RailFields& f, bool finish);
  // Writes the sampler payload (pid, rails, now, sampler_interval_us_) if this process owns the
  // block; `finish` false leaves the sequence odd (tests: a writer killed mid-write).
  bool write_sampler_locked(const std::vector<RiskEntry>& rails, int64_t now, bool finish);

  mutable std::mutex mu_;
  Map* map_ = nullptr;
  pid_t pid_ = 0;
  std::string segment_;
  std::vector<int> slot_of_rail_;    // rail -> slot index, -1 unclaimed
  int64_t sampler_interval_us_ = 0;  // this process's interval, from claim_sampler
  int32_t watch_owner_ = 0;          // an owner seen without a publish of its own...
  int64_t watch_since_us_ = 0;       // ...since this time (the hung test for it)
};

// Publisher-side helper, one per rail, kept by the publishing thread: copies a transport's
// RailCounters (traffic, switchover and TCP_INFO counters) into `f` and stamps the last
// switchover. When the switchover counter moved since the previous call, last_switchover_us =
// now and cause = `cause_if_switched` (the counters say that a switchover happened, not exactly
// when: the stamp is within one publish period).
class RailPublishState {
 public:
  void fill(const RailCounters& c, int64_t now_us, const char* cause_if_switched, RailFields* f);

 private:
  uint64_t seen_switchovers_ = 0;
  int64_t last_us_ = 0;
  char cause_[kCauseLen] = {};
};

// ---- Layout (version kLayoutVersion). Exposed for tests and documentation. -----------------
// Segment: SegmentHeader | AgreedBlock | SamplerBlock | ShmSlot[slot_count], each 64-byte
// aligned. Version 1 (no sampler block, u64 offsets) is refused as "layout version 1".
constexpr uint64_t kMagic = 0x4452414f42434352ULL;  // "RCCBOARD" little-endian
constexpr uint32_t kLayoutVersion = 2;
constexpr uint32_t kDefaultSlots = 256;
constexpr uint32_t kMaxSlots = 65536;

struct SegmentHeader {
  uint64_t magic;        // kMagic, written last by the creator (release)
  uint32_t version;      // kLayoutVersion
  uint32_t header_size;  // sizeof(SegmentHeader)
  uint64_t total_size;   // bytes of the whole segment
  uint32_t slot_count;
  uint32_t slot_size;       // sizeof(ShmSlot)
  uint32_t agreed_offset;   // offset of the AgreedBlock
  uint32_t agreed_size;     // sizeof(AgreedBlock)
  uint32_t sampler_offset;  // offset of the SamplerBlock
  uint32_t sampler_size;    // sizeof(SamplerBlock)
  uint32_t slots_offset;    // offset of slot 0
  uint32_t creator_pid;
  uint8_t pad[64 - 56];
};
static_assert(sizeof(SegmentHeader) == 64, "header layout");

struct alignas(64) AgreedBlock {
  uint64_t seq;  // seqlock: odd while written
  uint64_t pad[7];
  AgreedRecord rec;
};

// What the sampler writes under the block's seqlock.
struct SamplerPayload {
  int32_t pid;          // the process that wrote this payload; 0 = cleared (no sampler)
  uint32_t n;           // valid entries in e[], <= kMaxRiskRails (more = corrupt)
  int64_t publish_us;   // CLOCK_MONOTONIC us of the write
  int64_t interval_us;  // the writer's sampling interval, us
  RiskEntry e[kMaxRiskRails];
};

struct alignas(64) SamplerBlock {
  // Seqlock word: bits 0..31 the sequence (odd while written), bits 32..63 the pid of the last
  // (or current) writer. A writer takes it with one CAS from even, or from odd when that pid
  // no longer exists; so a displaced, still-running sampler never writes concurrently with its
  // successor.
  uint64_t seq;
  int32_t owner;  // the sampler's pid (CAS), 0 = none
  int32_t pad;
  SamplerPayload p;
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
