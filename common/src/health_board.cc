#include "r2ccl/health_board.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "r2ccl/clock.h"
#include "r2ccl/rail_stats.h"

namespace r2ccl::board {

static_assert(std::is_trivially_copyable<RailFields>::value, "RailFields is copied into shm");
static_assert(std::is_trivially_copyable<AgreedRecord>::value, "AgreedRecord is copied into shm");
static_assert(std::is_trivially_copyable<RiskEntry>::value, "RiskEntry is copied into shm");
static_assert(std::is_trivially_copyable<SamplerPayload>::value, "copied into shm");
static_assert(sizeof(RailFields) == 184, "slot layout");
static_assert(sizeof(ShmSlot) == 256, "slot layout");
static_assert(sizeof(RiskEntry) == 112, "sampler layout: no implicit padding");
static_assert(sizeof(SamplerPayload) == 24 + kMaxRiskRails * sizeof(RiskEntry), "sampler layout");
static_assert(sizeof(SamplerBlock) == 7232, "sampler layout");
// docs/HEALTH-BOARD.md lists these offsets.
static_assert(offsetof(SegmentHeader, total_size) == 16 &&
                  offsetof(SegmentHeader, slot_count) == 24 &&
                  offsetof(SegmentHeader, agreed_offset) == 32 &&
                  offsetof(SegmentHeader, sampler_offset) == 40 &&
                  offsetof(SegmentHeader, slots_offset) == 48 &&
                  offsetof(SegmentHeader, creator_pid) == 52,
              "header layout");
static_assert(offsetof(SamplerBlock, p) == 16 && offsetof(SamplerPayload, e) == 24,
              "sampler layout");

namespace {

constexpr int kReadRetries = 64;     // seqlock attempts per slot / record
constexpr int kCreateWaitMs = 1000;  // how long an opener waits for the creator's magic
constexpr TimeUs kAgreedTakeoverUs = 100 * kUsPerMs;  // a dead agreed writer is taken over
// Sampling intervals above this count as this much in the hung-sampler test (no overflow, and a
// sampler that claims a day-long interval is still replaced within 10 hours).
constexpr int64_t kMaxSamplerIntervalUs = 3600 * kUsPerSec;

// Relaxed/acquire/release accesses to plain fields in shared memory (lock-free builtins work
// across processes; std::atomic objects cannot be placed there portably).
template <class T>
T load_acq(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <class T>
T load_rlx(const T* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
template <class T>
void store_rel(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
template <class T>
void store_rlx(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
template <class T>
bool cas(T* p, T expected, T desired) {
  return __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE);
}

constexpr uint64_t align64(uint64_t x) { return (x + 63) / 64 * 64; }
constexpr uint64_t agreed_offset() { return align64(sizeof(SegmentHeader)); }
constexpr uint64_t sampler_offset() { return align64(agreed_offset() + sizeof(AgreedBlock)); }
constexpr uint64_t slots_offset() { return align64(sampler_offset() + sizeof(SamplerBlock)); }
constexpr uint64_t total_size(uint32_t slots) {
  return slots_offset() + uint64_t{slots} * sizeof(ShmSlot);
}
static_assert(slots_offset() <= UINT32_MAX, "block offsets and sizes are u32 in the header");

std::string errno_text(const char* what) { return std::string(what) + ": " + strerror(errno); }

bool pid_alive(int32_t pid) {
  if (pid <= 0) return false;
  return !(::kill(pid, 0) != 0 && errno == ESRCH);
}

// Checks a header read from a segment of `file_size` bytes.
bool validate(const SegmentHeader& h, uint64_t file_size, const std::string& seg, std::string* err,
              BoardError* kind) {
  auto fail = [&](BoardError k, const std::string& m) {
    *kind = k;
    *err = "health board " + seg + ": " + m;
    return false;
  };
  if (h.magic == 0)
    return fail(BoardError::kCorrupt,
                "not initialised (being created, or its creator died; "
                "remove it with r2ccl_status --remove)");
  if (h.magic != kMagic) return fail(BoardError::kCorrupt, "corrupt (bad magic)");
  if (h.version != kLayoutVersion)
    return fail(BoardError::kVersion,
                "layout version " + std::to_string(h.version) + ", this build reads version " +
                    std::to_string(kLayoutVersion) +
                    " (a board of another r2ccl build; once no job of that build runs, remove "
                    "it with r2ccl_status --remove)");
  if (h.header_size != sizeof(SegmentHeader) || h.slot_size != sizeof(ShmSlot) ||
      h.agreed_size != sizeof(AgreedBlock) || h.sampler_size != sizeof(SamplerBlock) ||
      h.slot_count == 0 || h.slot_count > kMaxSlots || h.agreed_offset != agreed_offset() ||
      h.sampler_offset != sampler_offset() || h.slots_offset != slots_offset() ||
      h.total_size != total_size(h.slot_count))
    return fail(BoardError::kCorrupt, "corrupt (inconsistent sizes or counts in the header)");
  if (h.total_size > file_size)
    return fail(BoardError::kTruncated, "truncated (" + std::to_string(file_size) +
                                            " bytes, the header says " +
                                            std::to_string(h.total_size) + ")");
  return true;
}

// A mapped, validated segment.
struct Mapping {
  int fd = -1;
  void* base = nullptr;
  size_t size = 0;
  SegmentHeader* hdr() const { return static_cast<SegmentHeader*>(base); }
  AgreedBlock* agreed() const {
    return reinterpret_cast<AgreedBlock*>(static_cast<char*>(base) + hdr()->agreed_offset);
  }
  SamplerBlock* sampler() const {
    return reinterpret_cast<SamplerBlock*>(static_cast<char*>(base) + hdr()->sampler_offset);
  }
  ShmSlot* slot(uint32_t i) const {
    return reinterpret_cast<ShmSlot*>(static_cast<char*>(base) + hdr()->slots_offset) + i;
  }
  void reset() {
    if (base) ::munmap(base, size);
    if (fd >= 0) ::close(fd);
    base = nullptr;
    fd = -1;
    size = 0;
  }
};

// Reads the header with pread (no mapping yet, so a short file cannot fault), validates it
// against fstat and maps exactly total_size bytes.
bool map_existing(int fd, bool writable, const std::string& seg, Mapping* m, std::string* err,
                  BoardError* kind) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    *kind = BoardError::kSystem;
    *err = errno_text(("fstat " + seg).c_str());
    return false;
  }
  SegmentHeader h{};
  if (static_cast<uint64_t>(st.st_size) < sizeof(h) ||
      ::pread(fd, &h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h))) {
    *kind = st.st_size == 0 ? BoardError::kCorrupt : BoardError::kTruncated;
    *err = "health board " + seg + ": " +
           (st.st_size == 0
                ? std::string("not initialised (empty segment)")
                : "truncated (" + std::to_string(st.st_size) + " bytes, smaller than its header)");
    return false;
  }
  if (!validate(h, static_cast<uint64_t>(st.st_size), seg, err, kind)) return false;
  void* p = ::mmap(nullptr, h.total_size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                   fd, 0);
  if (p == MAP_FAILED) {
    *kind = BoardError::kSystem;
    *err = errno_text(("mmap " + seg).c_str());
    return false;
  }
  m->fd = fd;
  m->base = p;
  m->size = h.total_size;
  // Re-check the mapped header: a concurrent re-creation between pread and mmap is caught here.
  SegmentHeader again;
  memcpy(&again, p, sizeof(again));
  if (memcmp(&again, &h, sizeof(h)) != 0) {
    *err = "health board " + seg + ": changed while opening";
    *kind = BoardError::kCorrupt;
    ::munmap(p, h.total_size);
    m->base = nullptr;
    m->fd = -1;
    return false;
  }
  return true;
}

bool open_for_read(const std::string& board, Mapping* m, std::string* seg, std::string* err,
                   BoardError* kind) {
  if (!segment_name(board, seg, err)) {
    *kind = BoardError::kInvalidName;
    return false;
  }
  int fd = ::shm_open(seg->c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    *kind = errno == ENOENT ? BoardError::kAbsent : BoardError::kSystem;
    *err = errno == ENOENT ? "health board " + *seg + ": absent (nothing has published yet)"
                           : errno_text(("shm_open " + *seg).c_str());
    return false;
  }
  if (!map_existing(fd, false, *seg, m, err, kind)) {
    ::close(fd);
    return false;
  }
  return true;
}

// Opens the board read-write, creating it if absent. The creator makes the file with
// O_CREAT|O_EXCL, sizes and allocates it (posix_fallocate), writes the header and stores the magic
// last; others wait up to kCreateWaitMs for the magic.
bool open_for_write(const std::string& board, Mapping* m, std::string* seg, std::string* err) {
  BoardError kind = BoardError::kNone;
  if (!segment_name(board, seg, err)) return false;
  for (int attempt = 0; attempt < 2; ++attempt) {
    int fd = ::shm_open(seg->c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) {
      const uint64_t total = total_size(kDefaultSlots);
      // Allocate the pages now: a full /dev/shm must fail here (ENOSPC), not SIGBUS a later
      // write through the mapping.
      int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(total));
      if (rc != 0) {
        errno = rc;
        *err = errno_text(("allocating " + *seg).c_str());
        ::close(fd);
        ::shm_unlink(seg->c_str());
        return false;
      }
      void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        *err = errno_text(("mmap " + *seg).c_str());
        ::close(fd);
        ::shm_unlink(seg->c_str());
        return false;
      }
      auto* h = static_cast<SegmentHeader*>(p);  // the new file is zero-filled
      h->version = kLayoutVersion;
      h->header_size = sizeof(SegmentHeader);
      h->total_size = total;
      h->slot_count = kDefaultSlots;
      h->slot_size = sizeof(ShmSlot);
      h->agreed_offset = static_cast<uint32_t>(agreed_offset());
      h->agreed_size = sizeof(AgreedBlock);
      h->sampler_offset = static_cast<uint32_t>(sampler_offset());
      h->sampler_size = sizeof(SamplerBlock);
      h->slots_offset = static_cast<uint32_t>(slots_offset());
      h->creator_pid = static_cast<uint32_t>(::getpid());
      store_rel(&h->magic, kMagic);
      m->fd = fd;
      m->base = p;
      m->size = total;
      return true;
    }
    if (errno != EEXIST) {
      *err = errno_text(("shm_open " + *seg).c_str());
      return false;
    }
    fd = ::shm_open(seg->c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
      if (errno == ENOENT) continue;  // removed meanwhile: try to create it again
      *err = errno_text(("shm_open " + *seg).c_str());
      return false;
    }
    for (int waited = 0;; ++waited) {
      uint64_t magic = 0;
      struct stat st;
      if (::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= sizeof(SegmentHeader) &&
          ::pread(fd, &magic, sizeof(magic), 0) == static_cast<ssize_t>(sizeof(magic)) &&
          magic != 0)
        break;
      if (waited >= kCreateWaitMs) break;  // map_existing reports it
      ::usleep(1000);
    }
    if (!map_existing(fd, true, *seg, m, err, &kind)) {
      ::close(fd);
      return false;
    }
    return true;
  }
  *err = "health board " + *seg + ": could not create or open it";
  return false;
}

// Seqlock read of `n` bytes at `src` guarded by `*seq`. Returns false when every attempt saw
// a write in progress or a change.
bool seq_read(const uint64_t* seq, const void* src, void* dst, size_t n) {
  for (int i = 0; i < kReadRetries; ++i) {
    uint64_t s1 = load_acq(seq);
    if ((s1 & 1) == 0) {
      memcpy(dst, src, n);
      __atomic_thread_fence(__ATOMIC_ACQUIRE);
      if (load_rlx(seq) == s1) return true;
    }
    if (i >= 8) sched_yield();
  }
  return false;
}

// Writer side. begin: seq -> odd (if a dead writer left it odd, it stays odd: we own it now).
uint64_t seq_begin(uint64_t* seq) {
  uint64_t s = load_rlx(seq);
  if ((s & 1) == 0) {
    store_rlx(seq, s + 1);
    s += 1;
  }
  __atomic_thread_fence(__ATOMIC_RELEASE);
  return s;  // odd
}
void seq_end(uint64_t* seq, uint64_t odd) { store_rel(seq, odd + 1); }

bool read_agreed_mapped(const Mapping& m, AgreedRecord* out) {
  AgreedBlock* b = m.agreed();
  return seq_read(&b->seq, &b->rec, out, sizeof(*out));
}

// ---- The sampler block's seqlock word: bits 0..31 sequence, bits 32..63 the writer's pid.
uint64_t sampler_word(uint32_t seq, int32_t pid) {
  return uint64_t{static_cast<uint32_t>(pid)} << 32 | seq;
}

// Takes the block for writing: one CAS from an even sequence, or from an odd one whose writer
// no longer exists (it died mid-write) or is this process (an abandoned write of its own).
// False when another live process is writing (a displaced sampler that has not noticed yet):
// writing now would interleave with it undetectably.
bool sampler_begin(uint64_t* seq, int32_t me, uint64_t* odd_word) {
  for (int attempt = 0; attempt < 4; ++attempt) {
    const uint64_t w = load_acq(seq);
    const uint32_t s = static_cast<uint32_t>(w);
    const int32_t writer = static_cast<int32_t>(w >> 32);
    uint64_t next;
    if ((s & 1) == 0)
      next = sampler_word(s + 1, me);
    else if (writer == me || !pid_alive(writer))
      next = sampler_word(s + 2, me);
    else
      return false;
    if (cas(seq, w, next)) {
      __atomic_thread_fence(__ATOMIC_RELEASE);
      *odd_word = next;
      return true;
    }
  }
  return false;
}
void sampler_end(uint64_t* seq, uint64_t odd_word) {
  // Only the holder of an odd word writes it (others CAS it only once this pid is gone).
  store_rel(
      seq, sampler_word(static_cast<uint32_t>(odd_word) + 1, static_cast<int32_t>(odd_word >> 32)));
}

// Writes `p` if `me` owns the block (checked after taking the seqlock, so a process taken over
// while waiting never overwrites its successor's payload). `finish` false: leave it odd (tests).
bool write_sampler(SamplerBlock* b, int32_t me, const SamplerPayload& p, bool finish) {
  uint64_t odd = 0;
  if (!sampler_begin(&b->seq, me, &odd)) return false;
  if (load_acq(&b->owner) != me) {
    sampler_end(&b->seq, odd);  // nothing written
    return false;
  }
  memcpy(&b->p, &p, sizeof(p));
  if (finish) sampler_end(&b->seq, odd);
  return true;
}

// The hung test: a publish more than kSamplerStaleIntervals intervals away from `now` (either
// way: a time in the future is a corrupt value, not a fresh one). interval <= 0 is corrupt.
bool sampler_expired(int64_t publish_us, int64_t interval_us, int64_t now) {
  if (interval_us <= 0) return true;
  const uint64_t limit =
      static_cast<uint64_t>(kSamplerStaleIntervals) * std::min(interval_us, kMaxSamplerIntervalUs);
  const uint64_t age = now >= publish_us
                           ? static_cast<uint64_t>(now) - static_cast<uint64_t>(publish_us)
                           : static_cast<uint64_t>(publish_us) - static_cast<uint64_t>(now);
  return age > limit;
}

float unit_or_unknown(float x) { return x >= 0.0f && x <= 1.0f ? x : -1.0f; }  // NaN -> -1

// The payload's leading fields (what claim_sampler reads).
struct SamplerHead {
  int32_t pid;
  uint32_t n;
  int64_t publish_us;
  int64_t interval_us;
};
static_assert(sizeof(SamplerHead) == offsetof(SamplerPayload, e) &&
                  offsetof(SamplerHead, publish_us) == offsetof(SamplerPayload, publish_us) &&
                  offsetof(SamplerHead, interval_us) == offsetof(SamplerPayload, interval_us),
              "SamplerHead is the payload's prefix");

// read_sampler on a mapped board; *why without the segment name.
bool read_sampler_mapped(const Mapping& m, SamplerView* out, std::string* why) {
  SamplerBlock* b = m.sampler();
  const int32_t owner = load_acq(&b->owner);
  SamplerPayload p;
  if (!seq_read(&b->seq, &b->p, &p, sizeof(p))) {
    *why = "sampler block torn after " + std::to_string(kReadRetries) +
           " attempts (its writer hung or died mid-write?)";
    return false;
  }
  if (p.n > static_cast<uint32_t>(kMaxRiskRails)) {
    *why = "corrupt sampler block (" + std::to_string(p.n) + " rails, at most " +
           std::to_string(kMaxRiskRails) + ")";
    return false;
  }
  SamplerView v;
  if (owner != 0 && pid_alive(owner)) {
    v.owner = owner;
    if (p.pid == owner) {  // else: its predecessor's payload, or nothing published yet
      v.publish_us = p.publish_us;
      v.interval_us = p.interval_us;
      if (!sampler_expired(p.publish_us, p.interval_us, now_us())) {
        v.rails.assign(p.e, p.e + p.n);
        for (RiskEntry& e : v.rails) {
          e.rail[kRailNameLen - 1] = 0;  // never trust a terminator from shared memory
          e.top[kCauseLen - 1] = 0;
          e.risk = unit_or_unknown(e.risk);
          e.retransmit_ratio = unit_or_unknown(e.retransmit_ratio);
          if (e.source != RiskSource::kLstm && e.source != RiskSource::kBaseline &&
              e.source != RiskSource::kBoth)
            e.source = RiskSource::kNone;
          e.drain = e.drain ? 1 : 0;
          e.hold_s = e.drain ? std::min<uint16_t>(e.hold_s, kMaxHoldS) : 0;
          memset(e.pad_, 0, sizeof(e.pad_));
        }
      }
    }
  }
  *out = std::move(v);
  return true;
}

}  // namespace

// ------------------------------------------------------------------------------------------

int member_count(const AgreedRecord& rec) {
  int n = 0;
  for (uint64_t w : rec.members) n += __builtin_popcountll(w);
  return n;
}

const char* transport_name(Transport t) {
  switch (t) {
    case Transport::kTcp: return "tcp";
    case Transport::kIb: return "ib";
    default: return "unknown";
  }
}

const char* risk_source_name(RiskSource s) {
  switch (s) {
    case RiskSource::kLstm: return "lstm";
    case RiskSource::kBaseline: return "baseline";
    case RiskSource::kBoth: return "both";
    default: return "none";
  }
}

const RiskEntry* find_risk(const SamplerView& v, const std::string& rail) {
  if (rail.size() >= kRailNameLen) return nullptr;  // no entry can hold that name
  for (const RiskEntry& e : v.rails)
    if (strncmp(e.rail, rail.c_str(), kRailNameLen) == 0) return &e;  // e.rail may lack a NUL
  return nullptr;
}

const char* state_name(RailState s) {
  switch (s) {
    case RailState::kUp: return "up";
    case RailState::kFailed: return "failed";
    case RailState::kDown: return "down";
    case RailState::kDraining: return "draining";
    default: return "unknown";
  }
}

void set_text(char* dst, size_t cap, const std::string& s) {
  if (cap == 0) return;
  size_t n = std::min(s.size(), cap - 1);
  memcpy(dst, s.data(), n);
  memset(dst + n, 0, cap - n);
}

bool agreed_record_consistent(const AgreedRecord& rec) {
  // Members are node ids below n_nodes: a bit at or beyond it means a corrupt record (readers
  // would otherwise disagree about which nodes count).
  for (int id = static_cast<int>(rec.n_nodes); id < kMaxNodes; ++id)
    if (rec.members[id / 64] >> (id % 64) & 1u) return false;
  return true;
}

bool segment_name(const std::string& board, std::string* out, std::string* err) {
  bool ok = !board.empty() && board.size() <= 64;
  for (char c : board)
    ok = ok && ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '-');
  if (!ok) {
    if (err)
      *err = "health board name '" + board +
             "': accepted names are 1 to 64 characters of A-Z a-z 0-9 _ -";
    return false;
  }
  *out = "/r2ccl-" + std::to_string(::getuid()) + "-" + board;
  return true;
}

bool remove_board(const std::string& board) {
  std::string seg, err;
  if (!segment_name(board, &seg, &err)) return false;
  return ::shm_unlink(seg.c_str()) == 0;
}

bool read_agreed_record(const std::string& board, AgreedRecord* out, std::string* err) {
  Mapping m;
  std::string seg;
  BoardError kind;
  if (!open_for_read(board, &m, &seg, err, &kind)) return false;
  AgreedRecord rec;
  bool ok = read_agreed_mapped(m, &rec);
  m.reset();
  if (!ok) {
    *err = "health board " + seg + ": agreed record torn after " + std::to_string(kReadRetries) +
           " attempts (its writer died mid-write?)";
    return false;
  }
  if (rec.n_nodes > static_cast<uint32_t>(kMaxNodes)) {
    *err = "health board " + seg + ": corrupt agreed record (" + std::to_string(rec.n_nodes) +
           " nodes, at most " + std::to_string(kMaxNodes) + ")";
    return false;
  }
  if (!agreed_record_consistent(rec)) {
    *err = "health board " + seg + ": corrupt agreed record (a member id at or beyond its " +
           std::to_string(rec.n_nodes) + " nodes)";
    return false;
  }
  *out = rec;
  return true;
}

bool read_sampler(const std::string& board, SamplerView* out, std::string* err) {
  Mapping m;
  std::string seg, why;
  BoardError kind;
  if (!open_for_read(board, &m, &seg, err, &kind)) return false;
  bool ok = read_sampler_mapped(m, out, &why);
  m.reset();
  if (!ok) *err = "health board " + seg + ": " + why;
  return ok;
}

bool publish_agreed_record(const std::string& board, const AgreedRecord& rec, std::string* err) {
  Mapping m;
  std::string seg;
  if (!open_for_write(board, &m, &seg, err)) return false;
  uint64_t* seq = &m.agreed()->seq;
  // Take the write: CAS even -> odd. A sequence that stays odd for kAgreedTakeoverUs belongs
  // to a writer that died mid-write: CAS odd -> odd + 2 takes it over.
  TimeUs first_odd = 0;
  uint64_t mine = 0;
  for (;;) {
    uint64_t s = load_acq(seq);
    if ((s & 1) == 0) {
      if (cas(seq, s, s + 1)) {
        mine = s + 1;
        break;
      }
      continue;
    }
    TimeUs now = now_us();
    if (first_odd == 0) first_odd = now;
    if (now - first_odd >= kAgreedTakeoverUs && cas(seq, s, s + 2)) {
      mine = s + 2;
      break;
    }
    sched_yield();
  }
  __atomic_thread_fence(__ATOMIC_RELEASE);
  memcpy(&m.agreed()->rec, &rec, sizeof(rec));
  seq_end(seq, mine);
  m.reset();
  return true;
}

bool read_board(const std::string& board, BoardView* out, std::string* err) {
  return read_board(board, out, err, nullptr);
}

bool read_board(const std::string& board, BoardView* out, std::string* err, BoardError* kind) {
  BoardError k = BoardError::kNone;
  Mapping m;
  BoardView v;
  if (!open_for_read(board, &m, &v.segment, err, &k)) {
    if (kind) *kind = k;
    return false;
  }
  v.slot_count = m.hdr()->slot_count;
  for (uint32_t i = 0; i < v.slot_count; ++i) {
    ShmSlot* s = m.slot(i);
    int32_t owner = load_acq(&s->owner);
    if (owner == 0) continue;
    SlotPayload p;
    if (!seq_read(&s->seq, &s->p, &p, sizeof(p))) {
      v.torn_slots.push_back(static_cast<int>(i));
      continue;
    }
    if (p.pid == 0) continue;  // claimed, nothing published yet
    if (!pid_alive(p.pid)) {
      ++v.stale_slots;
      continue;
    }
    RailSlot r;
    r.slot = static_cast<int>(i);
    r.pid = p.pid;
    r.rail = p.rail;
    r.publish_us = p.publish_us;
    r.f = p.f;
    r.f.name[kRailNameLen - 1] = 0;  // never trust a terminator from shared memory
    r.f.cause[kCauseLen - 1] = 0;
    v.rails.push_back(r);
  }
  AgreedRecord rec;
  if (read_agreed_mapped(m, &rec)) {
    if (rec.epoch != 0 && rec.n_nodes <= static_cast<uint32_t>(kMaxNodes) &&
        agreed_record_consistent(rec)) {
      v.has_agreed = true;
      v.agreed = rec;
    }
  } else {
    v.agreed_torn = 1;
  }
  v.has_sampler = read_sampler_mapped(m, &v.sampler, &v.sampler_error);
  m.reset();
  *out = std::move(v);
  if (kind) *kind = BoardError::kNone;
  return true;
}

void RailPublishState::fill(const RailCounters& c, int64_t now, const char* cause_if_switched,
                            RailFields* f) {
  f->bytes_sent = c.bytes_sent.load(std::memory_order_relaxed);
  f->chunks_sent = c.chunks_sent.load(std::memory_order_relaxed);
  f->chunks_replayed = c.chunks_replayed.load(std::memory_order_relaxed);
  f->switchovers = c.switchovers.load(std::memory_order_relaxed);
  f->failbacks = c.failbacks.load(std::memory_order_relaxed);
  f->paths_failed = c.paths_failed.load(std::memory_order_relaxed);
  f->tcp_retrans = c.tcp_retrans.load(std::memory_order_relaxed);
  f->tcp_segs_out = c.tcp_segs_out.load(std::memory_order_relaxed);
  if (f->switchovers != seen_switchovers_) {
    seen_switchovers_ = f->switchovers;
    last_us_ = now;
    set_text(cause_, sizeof(cause_), cause_if_switched ? cause_if_switched : "");
  }
  f->last_switchover_us = last_us_;
  memcpy(f->cause, cause_, sizeof(cause_));
}

// ------------------------------------------------------------------------------------------
// Publisher

struct Publisher::Map {
  Mapping m;
};

Publisher::~Publisher() { close(); }

bool Publisher::is_open() const {
  std::lock_guard<std::mutex> g(mu_);
  return map_ != nullptr;
}

bool Publisher::open(const std::string& board, std::string* err) {
  std::lock_guard<std::mutex> g(mu_);
  if (map_) {
    *err = "health board publisher already open on " + segment_;
    return false;
  }
  auto* mp = new Map();
  std::string seg;
  if (!open_for_write(board, &mp->m, &seg, err)) {
    delete mp;
    return false;
  }
  map_ = mp;
  segment_ = seg;
  pid_ = ::getpid();
  slot_of_rail_.clear();
  sampler_interval_us_ = 0;
  watch_owner_ = 0;
  watch_since_us_ = 0;
  return true;
}

int Publisher::claim_locked() {
  const Mapping& m = map_->m;
  const uint32_t n = m.hdr()->slot_count;
  // Free slots first, then slots of dead processes (reclaimed).
  for (int pass = 0; pass < 2; ++pass) {
    for (uint32_t i = 0; i < n; ++i) {
      ShmSlot* s = m.slot(i);
      int32_t owner = load_acq(&s->owner);
      if (pass == 0 ? owner != 0 : (owner == 0 || pid_alive(owner))) continue;
      if (!cas(&s->owner, owner, static_cast<int32_t>(pid_))) continue;
      return static_cast<int>(i);
    }
  }
  return -1;
}

bool Publisher::write_locked(int rail, const RailFields& f, bool finish) {
  if (!map_ || rail < 0 || rail >= static_cast<int>(kMaxSlots) || ::getpid() != pid_) return false;
  if (static_cast<size_t>(rail) >= slot_of_rail_.size()) slot_of_rail_.resize(rail + 1, -1);
  int& idx = slot_of_rail_[rail];
  if (idx < 0) idx = claim_locked();
  if (idx < 0) return false;
  ShmSlot* s = map_->m.slot(static_cast<uint32_t>(idx));
  SlotPayload p;
  p.pid = static_cast<int32_t>(pid_);
  p.rail = rail;
  p.publish_us = now_us();
  p.f = f;
  uint64_t odd = seq_begin(&s->seq);
  memcpy(&s->p, &p, sizeof(p));
  if (finish) seq_end(&s->seq, odd);
  return true;
}

bool Publisher::publish(int rail, const RailFields& f) {
  std::lock_guard<std::mutex> g(mu_);
  return write_locked(rail, f, true);
}

bool Publisher::write_sampler_locked(const std::vector<RiskEntry>& rails, int64_t now,
                                     bool finish) {
  if (!map_ || ::getpid() != pid_) return false;
  SamplerBlock* b = map_->m.sampler();
  const int32_t me = static_cast<int32_t>(pid_);
  if (load_acq(&b->owner) != me) return false;
  SamplerPayload p{};  // every byte set: RiskEntry has no implicit padding
  p.pid = me;
  p.n = static_cast<uint32_t>(std::min(rails.size(), static_cast<size_t>(kMaxRiskRails)));
  p.publish_us = now;
  p.interval_us = sampler_interval_us_;
  for (uint32_t i = 0; i < p.n; ++i) {
    p.e[i] = rails[i];
    p.e[i].rail[kRailNameLen - 1] = 0;
    p.e[i].top[kCauseLen - 1] = 0;
    memset(p.e[i].pad_, 0, sizeof(p.e[i].pad_));
  }
  return write_sampler(b, me, p, finish);
}

bool Publisher::claim_sampler(int64_t interval_us) {
  std::lock_guard<std::mutex> g(mu_);
  if (!map_ || ::getpid() != pid_ || interval_us <= 0) return false;
  SamplerBlock* b = map_->m.sampler();
  const int32_t me = static_cast<int32_t>(pid_);
  const int32_t owner = load_acq(&b->owner);
  if (owner == me) {
    sampler_interval_us_ = interval_us;
    return true;
  }
  if (owner != 0 && pid_alive(owner)) {
    // A live owner is replaced only when hung: judged by its own last publish, or, when the
    // payload is not its own (it has not published since claiming, or the block is torn), by
    // how long this publisher has seen it in that state.
    SamplerHead h;
    const TimeUs now = now_us();
    bool hung;
    if (seq_read(&b->seq, &b->p, &h, sizeof(h)) && h.pid == owner) {
      watch_owner_ = 0;
      hung = sampler_expired(h.publish_us, h.interval_us, now);
    } else if (watch_owner_ != owner) {
      watch_owner_ = owner;
      watch_since_us_ = now;
      hung = false;
    } else {
      hung = sampler_expired(watch_since_us_, interval_us, now);
    }
    if (!hung) return false;
  }
  if (!cas(&b->owner, owner, me)) return false;  // another process was faster
  sampler_interval_us_ = interval_us;
  watch_owner_ = 0;
  // Clear the predecessor's risks: readers must not serve them under the new owner. If a
  // displaced sampler is still mid-write this fails; its payload names its own pid, which
  // readers ignore, and this process's first publish_risks replaces it.
  write_sampler_locked({}, now_us(), true);
  return true;
}

bool Publisher::publish_risks(const std::vector<RiskEntry>& rails, int64_t now) {
  std::lock_guard<std::mutex> g(mu_);
  if (!write_sampler_locked(rails, now, true)) return false;
  return rails.size() <= static_cast<size_t>(kMaxRiskRails);
}

void Publisher::close() {
  std::lock_guard<std::mutex> g(mu_);
  if (!map_) return;
  if (::getpid() == pid_) {
    for (int idx : slot_of_rail_) {
      if (idx < 0) continue;
      ShmSlot* s = map_->m.slot(static_cast<uint32_t>(idx));
      SlotPayload empty{};
      uint64_t odd = seq_begin(&s->seq);
      memcpy(&s->p, &empty, sizeof(empty));
      seq_end(&s->seq, odd);
      store_rel(&s->owner, int32_t{0});
    }
    SamplerBlock* b = map_->m.sampler();
    const int32_t me = static_cast<int32_t>(pid_);
    if (load_acq(&b->owner) == me) {
      const SamplerPayload empty{};       // pid 0, n 0: no sampler's risks
      write_sampler(b, me, empty, true);  // best effort: owner 0 alone hides the risks too
      cas(&b->owner, me, int32_t{0});
    }
  }
  map_->m.reset();
  delete map_;
  map_ = nullptr;
  slot_of_rail_.clear();
}

}  // namespace r2ccl::board
