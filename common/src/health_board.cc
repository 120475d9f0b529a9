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
#include <cstring>
#include <type_traits>

#include "r2ccl/clock.h"
#include "r2ccl/rail_stats.h"

namespace r2ccl::board {

static_assert(std::is_trivially_copyable<RailFields>::value, "RailFields is copied into shm");
static_assert(std::is_trivially_copyable<AgreedRecord>::value, "AgreedRecord is copied into shm");
static_assert(sizeof(RailFields) == 168, "slot layout");
static_assert(sizeof(ShmSlot) == 256, "slot layout");

namespace {

constexpr int kReadRetries = 64;             // seqlock attempts per slot / record
constexpr int kCreateWaitMs = 1000;          // how long an opener waits for the creator's magic
constexpr TimeUs kAgreedTakeoverUs = 100 * kUsPerMs;  // a dead agreed writer is taken over

// Relaxed/acquire/release accesses to plain fields in shared memory (lock-free builtins work
// across processes; std::atomic objects cannot be placed there portably).
template <class T> T load_acq(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
template <class T> T load_rlx(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
template <class T> void store_rel(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
template <class T> void store_rlx(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
template <class T> bool cas(T* p, T expected, T desired) {
  return __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE);
}

uint64_t agreed_offset() { return (sizeof(SegmentHeader) + 63) / 64 * 64; }
uint64_t slots_offset() { return (agreed_offset() + sizeof(AgreedBlock) + 63) / 64 * 64; }
uint64_t total_size(uint32_t slots) { return slots_offset() + uint64_t{slots} * sizeof(ShmSlot); }

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
    return fail(BoardError::kCorrupt, "not initialised (being created, or its creator died; "
                                      "remove it with r2ccl_status --remove)");
  if (h.magic != kMagic) return fail(BoardError::kCorrupt, "corrupt (bad magic)");
  if (h.version != kLayoutVersion)
    return fail(BoardError::kVersion, "layout version " + std::to_string(h.version) +
                                          ", this build reads version " +
                                          std::to_string(kLayoutVersion));
  if (h.header_size != sizeof(SegmentHeader) || h.slot_size != sizeof(ShmSlot) ||
      h.agreed_size != sizeof(AgreedBlock) || h.slot_count == 0 || h.slot_count > kMaxSlots ||
      h.agreed_offset != agreed_offset() || h.slots_offset != slots_offset() ||
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
           (st.st_size == 0 ? std::string("not initialised (empty segment)")
                            : "truncated (" + std::to_string(st.st_size) +
                                  " bytes, smaller than its header)");
    return false;
  }
  if (!validate(h, static_cast<uint64_t>(st.st_size), seg, err, kind)) return false;
  void* p = ::mmap(nullptr, h.total_size, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                   MAP_SHARED, fd, 0);
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
// O_CREAT|O_EXCL, sizes and allocates it (posix_fallocate), writes the header and stores the magic last; others wait up to
// kCreateWaitMs for the magic.
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
      h->agreed_offset = agreed_offset();
      h->slots_offset = slots_offset();
      h->agreed_size = sizeof(AgreedBlock);
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
    *err = "health board " + seg + ": agreed record torn after " +
           std::to_string(kReadRetries) + " attempts (its writer died mid-write?)";
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
  if (!map_ || rail < 0 || rail >= static_cast<int>(kMaxSlots) || ::getpid() != pid_)
    return false;
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
  }
  map_->m.reset();
  delete map_;
  map_ = nullptr;
  slot_of_rail_.clear();
}

}  // namespace r2ccl::board
