#include "client_impl.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

#include "r2ccl/snapshot/shard_store.h"  // shard_checksum

#ifdef R2CCL_USE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace r2ccl::snap::client {

static_assert(R2CCL_SNAP_MAX_NODES == board::kMaxNodes, "state bitmap size");

namespace {
// Whether CUDA knows `p` as pinned (page-locked, registered) host memory: a GPU copies into such
// memory by DMA, which page protection does not see, so copy-on-write must not be used for it.
bool pinned_host(const void* p) {
#ifdef R2CCL_USE_CUDA
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // plain pageable memory on older runtimes: not an error
    return false;
  }
  return a.type == cudaMemoryTypeHost;
#else
  (void)p;
  return false;
#endif
}
}  // namespace
static_assert(R2CCL_SNAP_MAX_KV_VALUE == kKvMaxValue, "kv value size");

namespace {

using SteadyClock = std::chrono::steady_clock;
constexpr int64_t kNoDeadline = INT64_MAX;
constexpr int64_t kOpenTimeoutUs = 10 * 1000000LL;  // first STATE after HELLO
constexpr int64_t kKvPollUs = 10000;                // kv_get's poll period
constexpr uint32_t kMaxChainFrames = 1u << 20;      // sanity bound on FETCHED count

int64_t mono_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             SteadyClock::now().time_since_epoch())
      .count();
}
double secs_since(int64_t t0) { return double(mono_us() - t0) * 1e-6; }
int64_t deadline_after(int64_t timeout_us) {
  if (timeout_us < 0) return kNoDeadline;
  int64_t now = mono_us();
  return timeout_us > kNoDeadline - now ? kNoDeadline : now + timeout_us;
}
// cv.wait with an absolute mono_us() deadline; returns pred().
template <class Pred>
bool wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& l, int64_t deadline,
                Pred pred) {
  if (deadline == kNoDeadline) {
    cv.wait(l, pred);
    return true;
  }
  auto tp = SteadyClock::time_point(std::chrono::microseconds(deadline));
  return cv.wait_until(l, tp, pred);
}

// Strict decimal in [lo, hi].
bool parse_u64(const char* s, uint64_t lo, uint64_t hi, uint64_t* out) {
  if (!s || !*s) return false;
  uint64_t v = 0;
  for (const char* p = s; *p; ++p) {
    if (*p < '0' || *p > '9') return false;
    uint64_t d = uint64_t(*p - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  if (v < lo || v > hi) return false;
  *out = v;
  return true;
}

// Upper bound of an encoded frame of a buffer of `bytes` (header + zstd's worst case).
uint64_t frame_bound(uint64_t bytes) { return kFrameHeaderBytes + bytes + bytes / 128 + 65536; }

const char* fetch_status_name(uint32_t s) {
  switch (static_cast<FetchStatus>(s)) {
    case FetchStatus::kOk: return "kOk";
    case FetchStatus::kNotHeld: return "kNotHeld (no live replica holds that shard)";
    case FetchStatus::kCorrupt: return "kCorrupt (the held copy failed its CRC)";
    case FetchStatus::kBusy: return "kBusy (the daemon cannot serve it now; try again)";
  }
  return "unknown";
}

void put_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void put_u64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t get_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

bool key_ok(const char* key, size_t* len) {
  if (!key) return false;
  size_t n = strnlen(key, kKvKeyBytes);
  if (n == 0 || n >= kKvKeyBytes) return false;
  *len = n;
  return true;
}

// A variable of two values: *out = true for `first`, false for `second`, unchanged when unset;
// anything else is a CONFIG error naming the variable and `accepted`.
Status parse_choice(const char* var, const char* first, const char* second, const char* accepted,
                    bool* out) {
  const char* s = std::getenv(var);
  if (!s) return {};
  if (std::strcmp(s, first) == 0 || std::strcmp(s, second) == 0) {
    *out = std::strcmp(s, first) == 0;
    return {};
  }
  return fail(R2CCL_SNAP_ERR_CONFIG,
              std::string(var) + "='" + s + "' is invalid (accepted: " + accepted + ")");
}

}  // namespace

Status load_config(const char* socket_arg, Config* out) {
  Config c;
  if (socket_arg && *socket_arg) {
    c.socket_path = socket_arg;
  } else if (const char* s = std::getenv("R2CCL_SNAPSHOT_SOCKET"); s && *s) {
    c.socket_path = s;
  } else {
    const char* b = std::getenv("R2CCL_HEALTH_BOARD");
    c.socket_path = std::string("/tmp/r2ccl-snapshotd-") + (b && *b ? b : "default") + ".sock";
  }
  if (const char* s = std::getenv("R2CCL_SNAPSHOT_INTERVAL")) {
    if (!parse_u64(s, 1, 1000000000ull, &c.interval))
      return fail(R2CCL_SNAP_ERR_CONFIG,
                  std::string("R2CCL_SNAPSHOT_INTERVAL='") + s +
                      "' is invalid (accepted: an integer 1..1000000000, snapshot the steps that "
                      "are multiples of it; default 1)");
  }
  if (const char* s = std::getenv("R2CCL_SNAPSHOT_BASE_EVERY")) {
    uint64_t v = 0;
    if (!parse_u64(s, 1, 1000000, &v))
      return fail(R2CCL_SNAP_ERR_CONFIG,
                  std::string("R2CCL_SNAPSHOT_BASE_EVERY='") + s +
                      "' is invalid (accepted: an integer 1..1000000, a full base every K "
                      "snapshots of a buffer; default 8)");
    c.base_every = static_cast<uint32_t>(v);
  }
  Status st = parse_choice("R2CCL_SNAPSHOT_TAKE", "cow", "copy",
                           "cow, take() write-protects the buffers and the background thread "
                           "copies them, the default; copy, take() copies them",
                           &c.take_cow);
  if (st.ok())
    st = parse_choice("R2CCL_SNAPSHOT_RESTORE", "direct", "staged",
                      "direct, restore() decodes into the host buffers, the default; staged, it "
                      "decodes into scratch and overwrites the buffers only once every buffer "
                      "decoded, so an error leaves them untouched",
                      &c.restore_direct);
  if (!st.ok()) return st;
  *out = std::move(c);
  return {};
}

// ---------------------------------------------------------------------------------------------
// open / close

Client::Client(const Config& cfg, uint32_t rank, uint32_t world, int fd)
    : cfg_(cfg), rank_(rank), world_(world), fd_(fd) {}

Status Client::open(const Config& cfg, uint32_t rank, uint32_t world,
                    std::unique_ptr<Client>* out) {
  if (world < 1 || world > 65536)
    return fail(R2CCL_SNAP_ERR_INVALID,
                "open: world " + std::to_string(world) + " (accepted: 1..65536 ranks)");
  if (rank >= world)
    return fail(R2CCL_SNAP_ERR_INVALID, "open: rank " + std::to_string(rank) + " (accepted: 0.." +
                                            std::to_string(world - 1) + " for world " +
                                            std::to_string(world) + ")");
  std::string err;
  int fd = connect_unix(cfg.socket_path, &err);
  if (fd < 0) return fail(R2CCL_SNAP_ERR_CONNECT, err);
  std::unique_ptr<Client> c(new Client(cfg, rank, world, fd));
  c->reader_ = std::thread([p = c.get()] { p->reader_main(); });
  ClientHelloBody hello{rank, world, static_cast<int32_t>(::getpid()), 0};
  Status s = c->send(ClientMsg::kHello, &hello, sizeof(hello));
  if (!s.ok()) return s;
  {
    std::unique_lock<std::mutex> l(c->mu_);
    bool got = wait_until(c->cv_, l, deadline_after(kOpenTimeoutUs),
                          [&] { return c->states_ > 0 || c->dead_; });
    if (c->states_ == 0) {
      if (got) return c->dead_status();
      return fail(R2CCL_SNAP_ERR_TIMEOUT, "open: r2ccl_snapshotd at " + cfg.socket_path +
                                              " sent no STATE within 10 s of HELLO");
    }
    c->event_base_ = c->state_;
  }
  c->worker_ = std::thread([p = c.get()] { p->worker_main(); });
  *out = std::move(c);
  return {};
}

Client::~Client() {
  {
    std::lock_guard<std::mutex> l(work_mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  ::shutdown(fd_, SHUT_RDWR);  // wakes the reader and fails any send in progress
  if (worker_.joinable()) worker_.join();
  if (reader_.joinable()) reader_.join();
  {
    std::lock_guard<std::mutex> l(cow_mu_);
    cow_.finish();  // the buffers writable again before the staging sets go
  }
  ::close(fd_);
}

Status Client::dead_status() {
  return fail(R2CCL_SNAP_ERR_CONNECTION, "connection to r2ccl_snapshotd at " + cfg_.socket_path +
                                             " lost: " + dead_reason_ +
                                             " (close the handle and open again)");
}

Status Client::send(ClientMsg type, const void* a, size_t na, const void* b, size_t nb) {
  std::string err;
  {
    std::lock_guard<std::mutex> l(send_mu_);
    {
      std::lock_guard<std::mutex> lm(mu_);
      if (dead_) return dead_status();
    }
    if (write_frame(fd_, static_cast<uint16_t>(type), a, na, b, nb, &err)) return {};
  }
  // A failed write may have left part of a frame: the stream is unusable from here on.
  std::lock_guard<std::mutex> lm(mu_);
  if (!dead_) {
    dead_ = true;
    dead_reason_ = err;
  }
  ::shutdown(fd_, SHUT_RDWR);
  cv_.notify_all();
  return dead_status();
}

// ---------------------------------------------------------------------------------------------
// reader thread

void Client::reader_main() {
  std::string err;
  for (;;) {
    uint16_t type = 0;
    PageBuf p;
    const bool got = read_frame_into(
        fd_, max_shard_bytes_.load(), &type,
        [this, &p](size_t n) { return take_pooled(n, &p) || p.alloc(n) ? p.data() : nullptr; },
        &err);
    if (!got) break;
    if (type == static_cast<uint16_t>(ClientMsg::kState)) {
      StateBody s;
      std::memcpy(&s, p.data(), sizeof(s));
      std::lock_guard<std::mutex> l(mu_);
      state_ = s;
      ++states_;
      cv_.notify_all();
    } else if (type == static_cast<uint16_t>(ClientMsg::kFetched)) {
      Fetched f;
      std::memcpy(&f.head, p.data(), sizeof(f.head));
      if (p.size() > sizeof(FetchedHead)) {
        std::memcpy(&f.meta, p.data() + sizeof(FetchedHead), sizeof(ShardMeta));
        uint64_t have = p.size() - sizeof(FetchedHead) - sizeof(ShardMeta);
        if (f.meta.payload_bytes != have) {
          err = "FETCHED shard announces " + std::to_string(f.meta.payload_bytes) +
                " payload bytes but carries " + std::to_string(have);
          break;
        }
      }
      f.payload = std::move(p);
      std::lock_guard<std::mutex> l(mu_);
      auto it = inbox_.find(f.head.request);
      if (it != inbox_.end()) {
        it->second.push_back(std::move(f));
        cv_.notify_all();
      }
    } else if (type == static_cast<uint16_t>(ClientMsg::kKvValue)) {
      KvBody kv;
      std::memcpy(&kv, p.data(), sizeof(kv));
      if (kv.origin_node != kKvAbsent && kv.value_bytes > kKvMaxValue) {
        err = "KV_VALUE with " + std::to_string(kv.value_bytes) + " value bytes (accepted: 0.." +
              std::to_string(kKvMaxValue) + ")";
        break;
      }
      std::lock_guard<std::mutex> l(mu_);
      kv_values_.push_back(kv);
      while (kv_values_.size() > 64) kv_values_.pop_front();
      cv_.notify_all();
    } else {
      err = "unexpected frame type " + std::to_string(type) +
            " from the daemon (accepted: STATE 101, FETCHED 102, KV_VALUE 103)";
      break;
    }
  }
  std::lock_guard<std::mutex> l(mu_);
  if (!dead_) {
    dead_ = true;
    dead_reason_ = err;
  }
  ::shutdown(fd_, SHUT_RDWR);
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// registration and metadata

Status Client::make_encoder(Buffer* b, uint64_t first_seq, std::string* err) {
  EncoderConfig ec;
  ec.dtype = b->dtype;
  ec.size_bytes = b->bytes;
  ec.codec = b->codec;
  ec.base_every = cfg_.base_every;
  ec.first_seq = first_seq;
  ec.payload_crc = false;  // ShardMeta::checksum covers the whole frame: one pass, not two
  auto enc = DeltaEncoder::create(ec, err);
  if (!enc) return fail(R2CCL_SNAP_ERR_INVALID, *err);
  b->enc = std::move(enc);
  return {};
}

Status Client::register_buffer(uint32_t id, void* ptr, size_t bytes, int dtype, int codec,
                               uint32_t flags) {
  std::lock_guard<std::mutex> l(train_mu_);
  std::string what = "register buffer " + std::to_string(id) + ": ";
  if (frozen_)
    return fail(R2CCL_SNAP_ERR_INVALID,
                what + "called after the first take/restore (register every buffer before)");
  if (id != n_user_)
    return fail(R2CCL_SNAP_ERR_INVALID, what + "ids are dense in registration order (accepted: " +
                                            std::to_string(n_user_) + ")");
  if (!ptr || bytes == 0)
    return fail(R2CCL_SNAP_ERR_INVALID, what +
                                            "null pointer or 0 bytes (accepted: memory of "
                                            "> 0 bytes, valid until close)");
  if (dtype < R2CCL_SNAP_DTYPE_BYTES || dtype > R2CCL_SNAP_DTYPE_BF16)
    return fail(R2CCL_SNAP_ERR_INVALID, what + "dtype " + std::to_string(dtype) +
                                            " (accepted: 0 bytes, 1 f32, 2 f16, 3 bf16)");
  if (codec != R2CCL_SNAP_CODEC_LOSSLESS && codec != R2CCL_SNAP_CODEC_LOSSY)
    return fail(R2CCL_SNAP_ERR_INVALID,
                what + "codec " + std::to_string(codec) + " (accepted: 0 lossless, 1 lossy)");
  if (flags & ~R2CCL_SNAP_FLAG_DEVICE)
    return fail(R2CCL_SNAP_ERR_INVALID, what + "flags 0x" + std::to_string(flags) +
                                            " (accepted: 0 or R2CCL_SNAP_FLAG_DEVICE)");
  bool device = (flags & R2CCL_SNAP_FLAG_DEVICE) != 0;
#ifndef R2CCL_USE_CUDA
  if (device)
    return fail(R2CCL_SNAP_ERR_UNSUPPORTED,
                what +
                    "device memory (R2CCL_SNAP_FLAG_DEVICE), but libr2ccl-snapshot was built "
                    "without USE_CUDA (rebuild with -DUSE_CUDA=ON, or register a host copy)");
#endif
  Buffer b;
  b.ptr = ptr;
  b.bytes = bytes;
  b.dtype = static_cast<DType>(dtype);
  b.codec = codec == R2CCL_SNAP_CODEC_LOSSY ? Codec::kLossyDynRange : Codec::kLossless;
  b.device = device;
  std::string err;
  Status s = make_encoder(&b, 0, &err);
  if (!s.ok()) return fail(s.code, what + s.msg);
  bufs_.push_back(std::move(b));
  ++n_user_;
  uint64_t fb = frame_bound(bytes);
  if (fb > max_shard_bytes_.load()) max_shard_bytes_.store(fb);
  return {};
}

Status Client::freeze(bool for_take) {
  Buffer m;
  m.ptr = nullptr;
  m.bytes = kMetaBytes;
  m.dtype = DType::kBytes;
  std::string err;
  Status s = make_encoder(&m, 0, &err);
  if (!s.ok()) return s;
  bufs_.push_back(std::move(m));
  for (Staging& st : sets_) {
    st.bufs.clear();
    for (uint32_t i = 0; i < bufs_.size(); ++i) {
      const Buffer& b = bufs_[i];
      // Takes copy into either set; a restore receives the chains into set 1 (room for a whole
      // frame of its buffer) and decodes into the caller's host buffers, or into set 0 (staged
      // mode, device buffers, the metadata). The first take faults both sets in, so a
      // survivor's recovery does not pay for first touches (most of a restore's time before:
      // docs/BENCHMARKS.md); a process whose first call is a restore (a replacement) faults in
      // only the set-0 buffers it decodes into, the rest on first use.
      PageBuf p;
      const bool set0 = &st == &sets_[0];
      const bool populate = for_take || (set0 && !decodes_direct(i));
      if (!p.alloc(b.bytes, populate, set0 ? 0 : frame_bound(b.bytes))) {
        bufs_.pop_back();
        sets_[0].bufs.clear();
        sets_[1].bufs.clear();
        return fail(R2CCL_SNAP_ERR_NOMEM,
                    "cannot allocate staging of " + std::to_string(b.bytes) + " bytes");
      }
      st.bufs.push_back(std::move(p));
    }
  }
  uint64_t fb = frame_bound(kMetaBytes);
  if (fb > max_shard_bytes_.load()) max_shard_bytes_.store(fb);
  if (cfg_.take_cow) {
    std::vector<std::pair<uint8_t*, size_t>> host;
    for (uint32_t i = 0; i < n_user_; ++i) {
      // Device buffers, and host memory a GPU may DMA into, are copied at take() instead.
      const bool skip = bufs_[i].device || pinned_host(bufs_[i].ptr);
      cow_skip_.push_back(skip);
      host.emplace_back(skip ? nullptr : static_cast<uint8_t*>(bufs_[i].ptr),
                        skip ? 0 : bufs_[i].bytes);
    }
    std::string why;
    cow_ready_ = cow_.init(host, &why);
    if (!cow_ready_) cow_note_ = why;
  }
  frozen_ = true;
  return {};
}

void Client::fill_meta(uint8_t* out, uint64_t step) const {
  std::memset(out, 0, kMetaBytes);
  put_u32(out + 0, kMetaMagic);
  put_u32(out + 4, 1);
  put_u32(out + 8, n_user_);
  put_u32(out + 12, static_cast<uint32_t>(rng_.size()));
  std::memcpy(out + 16, &loss_scale_, 8);
  put_u32(out + 24, has_loss_scale_ ? 1 : 0);
  put_u32(out + 28, has_rng_ ? 1 : 0);
  put_u64(out + 32, step);
  if (!rng_.empty()) std::memcpy(out + kMetaHeader, rng_.data(), rng_.size());
}

Status Client::set_loss_scale(double v) {
  std::lock_guard<std::mutex> l(train_mu_);
  loss_scale_ = v;
  has_loss_scale_ = true;
  return {};
}

Status Client::get_loss_scale(double* out) {
  std::lock_guard<std::mutex> l(train_mu_);
  if (!has_loss_scale_)
    return fail(R2CCL_SNAP_ERR_NO_SNAPSHOT,
                "get_loss_scale: none set (set_loss_scale) nor restored (restore)");
  *out = loss_scale_;
  return {};
}

Status Client::set_rng_state(const void* blob, size_t n) {
  std::lock_guard<std::mutex> l(train_mu_);
  if (n > R2CCL_SNAP_MAX_RNG_BYTES || (n && !blob))
    return fail(R2CCL_SNAP_ERR_INVALID,
                "set_rng_state: " + std::to_string(n) + " bytes (accepted: 0.." +
                    std::to_string(R2CCL_SNAP_MAX_RNG_BYTES) + " bytes, non-null)");
  rng_.assign(static_cast<const uint8_t*>(blob), static_cast<const uint8_t*>(blob) + n);
  has_rng_ = true;
  return {};
}

Status Client::get_rng_state(void* buf, size_t cap, size_t* n) {
  std::lock_guard<std::mutex> l(train_mu_);
  if (!has_rng_)
    return fail(R2CCL_SNAP_ERR_NO_SNAPSHOT,
                "get_rng_state: none set (set_rng_state) nor restored (restore)");
  if (cap < rng_.size()) {
    *n = rng_.size();
    return fail(R2CCL_SNAP_ERR_TOO_SMALL, "get_rng_state: the blob is " +
                                              std::to_string(rng_.size()) + " bytes, buffer " +
                                              std::to_string(cap));
  }
  if (!rng_.empty()) std::memcpy(buf, rng_.data(), rng_.size());
  *n = rng_.size();
  return {};
}

// ---------------------------------------------------------------------------------------------
// take: copy on the caller's thread, encode and send on the worker

Status Client::copy_in(const Buffer& b, uint8_t* dst) {
  if (!b.device) {
    std::memcpy(dst, b.ptr, b.bytes);
    return {};
  }
#ifdef R2CCL_USE_CUDA
  cudaError_t e = cudaMemcpy(dst, b.ptr, b.bytes, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess)
    return fail(R2CCL_SNAP_ERR_CUDA, std::string("cudaMemcpy device->host of ") +
                                         std::to_string(b.bytes) +
                                         " bytes failed: " + cudaGetErrorString(e));
  return {};
#else
  return fail(R2CCL_SNAP_ERR_UNSUPPORTED, "device memory in a build without USE_CUDA");
#endif
}

Status Client::copy_out(const Buffer& b, const uint8_t* src) {
  if (!b.device) {
    std::memcpy(b.ptr, src, b.bytes);
    return {};
  }
#ifdef R2CCL_USE_CUDA
  cudaError_t e = cudaMemcpy(b.ptr, src, b.bytes, cudaMemcpyHostToDevice);
  if (e != cudaSuccess)
    return fail(R2CCL_SNAP_ERR_CUDA, std::string("cudaMemcpy host->device of ") +
                                         std::to_string(b.bytes) +
                                         " bytes failed: " + cudaGetErrorString(e));
  return {};
#else
  return fail(R2CCL_SNAP_ERR_UNSUPPORTED, "device memory in a build without USE_CUDA");
#endif
}

Status Client::background_status(bool consume) {
  Status s = bg_error_;
  if (consume) bg_error_ = Status{};
  return s;
}

void Client::fill_prev(r2ccl_snap_take_stats_t* st) {
  if (!finished_.valid) return;
  st->prev_valid = 1;
  st->prev_step = finished_.step;
  st->prev_encode_seconds = finished_.encode_s;
  st->prev_send_seconds = finished_.send_s;
  st->prev_raw_bytes = finished_.raw;
  st->prev_encoded_bytes = finished_.encoded;
  st->prev_ratio = finished_.encoded ? double(finished_.raw) / double(finished_.encoded) : 0;
  st->prev_max_abs_error = finished_.max_err;
  st->prev_base_buffers = finished_.bases;
}

Status Client::take(uint64_t step, r2ccl_snap_take_stats_t* st) {
  std::lock_guard<std::mutex> lt(train_mu_);
  st->step = step;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (dead_) return dead_status();
  }
  if (n_user_ == 0)
    return fail(R2CCL_SNAP_ERR_INVALID, "take: no buffer registered (r2ccl_snap_register first)");
  if (step % cfg_.interval != 0) {
    st->skipped = 1;
    std::lock_guard<std::mutex> l(work_mu_);
    fill_prev(st);
    return {};
  }
  if (has_last_step_ && step <= last_step_)
    return fail(R2CCL_SNAP_ERR_INVALID,
                "take: step " + std::to_string(step) + " is not beyond step " +
                    std::to_string(last_step_) +
                    " (steps must grow; after restore, beyond the restored step)");
  if (!frozen_) {
    Status s = freeze(true);
    if (!s.ok()) return s;
  }
  int64_t t0 = mono_us();
  int set = -1;
  {
    std::unique_lock<std::mutex> l(work_mu_);
    Status bg = background_status(true);
    if (!bg.ok()) return bg;
    work_cv_.wait(l, [&] { return !sets_[0].busy || !sets_[1].busy || stop_; });
    if (stop_) return fail(R2CCL_SNAP_ERR_INVALID, "take: the handle is closing");
    set = !sets_[0].busy ? 0 : 1;
    for (size_t i = 0; i < sets_[set].bufs.size(); ++i)
      if (!sets_[set].bufs[i].data() && bufs_[i].bytes > 0)
        return fail(R2CCL_SNAP_ERR_NOMEM,
                    "take: a staging buffer could not be mapped again after a restore");
    sets_[set].busy = true;
  }
  int64_t t1 = mono_us();
  st->wait_seconds = double(t1 - t0) * 1e-6;
  uint64_t generation = 0;  // the timeline this step belongs to (coordinator.h)
  {
    std::lock_guard<std::mutex> l(mu_);
    generation = state_.generation;
  }
  Status cs;
  if (cow_ready_) {
    // Copy-on-write: protect and return; the worker (or a faulting store) copies (cow.h).
    std::lock_guard<std::mutex> lc(cow_mu_);
    cow_.finish();  // the previous take's capture, if the worker has not completed it yet
    std::vector<uint8_t*> dst;
    for (uint32_t i = 0; i < n_user_; ++i) dst.push_back(sets_[set].bufs[i].data());
    std::string why;
    cow_set_ = cow_.begin(dst, &why) ? set : -1;
    if (!why.empty()) cow_note_ = why;
    for (uint32_t i = 0; i < n_user_ && cs.ok(); ++i)
      if (cow_skip_[i]) cs = copy_in(bufs_[i], sets_[set].bufs[i].data());
    if (!cs.ok()) {
      cow_.finish();
      cow_set_ = -1;
    }
  } else {
    for (uint32_t i = 0; i < n_user_ && cs.ok(); ++i)
      cs = copy_in(bufs_[i], sets_[set].bufs[i].data());
  }
  if (cs.ok()) fill_meta(sets_[set].bufs[n_user_].data(), step);
  st->copy_seconds = secs_since(t1);
  {
    std::lock_guard<std::mutex> l(work_mu_);
    if (!cs.ok()) {
      sets_[set].busy = false;
    } else {
      sets_[set].step = step;
      sets_[set].generation = generation;
      jobs_.push_back(set);
      // From the first take on, the worker makes the buffers' huge pages while idle (not
      // before: a replacement's first call, restore(), has the cores to itself).
      if (!collapse_started_) collapse_ = collapse_started_ = cow_ready_;
    }
    fill_prev(st);
  }
  work_cv_.notify_all();
  if (!cs.ok()) return cs;
  last_step_ = step;
  has_last_step_ = true;
  return {};
}

void Client::worker_main() {
  std::vector<uint8_t> frame;
  for (;;) {
    int set;
    {
      std::unique_lock<std::mutex> l(work_mu_);
      // Idle: the copy-on-write buffers become huge pages, one 2 MiB page per step (cow.h),
      // so that take() write-protects 512x fewer page table entries; not while a restore
      // runs. kBusy (a capture not completed yet: a take() is queueing its job, or failed
      // after protecting): try again 10 ms later or at the next job.
      for (;;) {
        if (stop_) return;
        if (!jobs_.empty()) break;
        if (collapse_ && !restoring_) {
          l.unlock();
          CowBuffers::Collapse c;
          {
            std::lock_guard<std::mutex> lc(cow_mu_);
            c = cow_.collapse_step();
          }
          l.lock();
          if (c == CowBuffers::Collapse::kDone) collapse_ = false;
          if (c == CowBuffers::Collapse::kBusy)
            work_cv_.wait_for(l, std::chrono::milliseconds(10),
                              [&] { return stop_ || !jobs_.empty(); });
          continue;
        }
        work_cv_.wait(l, [&] { return stop_ || !jobs_.empty() || (collapse_ && !restoring_); });
      }
      set = jobs_.front();
      jobs_.pop_front();
      working_ = true;
    }
    Staging& sg = sets_[set];
    FinishedTake ft;
    ft.step = sg.step;
    Status s;
    {
      std::lock_guard<std::mutex> lc(cow_mu_);
      if (cow_set_ == set) {  // complete the copy-on-write capture before encoding it
        cow_.finish();
        cow_set_ = -1;
      }
    }
    const uint32_t n = static_cast<uint32_t>(bufs_.size());
    for (uint32_t i = 0; i < n && s.ok(); ++i) {
      Buffer& b = bufs_[i];
      EncodeStats es;
      std::string err;
      int64_t t0 = mono_us();
      if (!b.enc->encode(sg.bufs[i].data(), &frame, &es, &err)) {
        s = fail(R2CCL_SNAP_ERR_ENCODE, "encoding buffer " + std::to_string(i) + " of step " +
                                            std::to_string(sg.step) + " failed: " + err +
                                            " (that step is incomplete; the next is a base)");
        break;
      }
      ft.encode_s += secs_since(t0);
      if (es.is_base) b.base_step = sg.step;
      ShardMeta m{};
      m.rank = rank_;
      m.buffer = i;
      m.n_buffers = n;
      m.world = world_;
      m.home_node = 0;  // the daemon fills it in
      m.reserved = 0;
      m.checksum = shard_checksum(frame.data(), frame.size());  // the producer's one pass
      m.step = sg.step;
      m.generation = sg.generation;
      m.base_step = b.base_step;
      m.seq = es.seq;
      m.base_seq = es.base_seq;
      m.payload_bytes = frame.size();
      int64_t t1 = mono_us();
      s = send(ClientMsg::kShard, &m, sizeof(m), frame.data(), frame.size());
      ft.send_s += secs_since(t1);
      ft.raw += es.raw_bytes;
      ft.encoded += es.frame_bytes;
      if (es.codec == Codec::kLossyDynRange) ft.max_err = std::max(ft.max_err, es.max_abs_error);
      if (es.is_base) ++ft.bases;
    }
    {
      std::lock_guard<std::mutex> l(work_mu_);
      sg.busy = false;
      working_ = false;
      if (s.ok()) {
        ft.valid = true;
        finished_ = ft;
      } else if (bg_error_.ok()) {
        bg_error_ = s;
      }
    }
    work_cv_.notify_all();
  }
}

Status Client::wait_idle(int64_t deadline) {
  std::unique_lock<std::mutex> l(work_mu_);
  bool idle = wait_until(work_cv_, l, deadline, [&] { return jobs_.empty() && !working_; });
  if (!idle)
    return fail(R2CCL_SNAP_ERR_TIMEOUT,
                std::to_string(jobs_.size() + (working_ ? 1 : 0)) +
                    " snapshot(s) still being encoded/sent when the timeout passed");
  return {};
}

Status Client::flush(int64_t timeout_us) {
  std::lock_guard<std::mutex> lt(train_mu_);
  Status s = wait_idle(deadline_after(timeout_us));
  if (!s.ok()) return fail(s.code, "flush: " + s.msg);
  std::lock_guard<std::mutex> l(work_mu_);
  return background_status(true);
}

// ---------------------------------------------------------------------------------------------
// state and events

void Client::fill_state(const StateBody& s, r2ccl_snap_state_t* out) const {
  std::memset(out, 0, sizeof(*out));
  out->epoch = s.agreed.epoch;
  out->node_id = s.node_id;
  out->n_nodes = s.agreed.n_nodes;
  out->member_count = static_cast<uint32_t>(board::member_count(s.agreed));
  out->has_complete_step = s.has_complete ? 1 : 0;
  out->complete_step = s.has_complete ? s.complete_step : 0;
  std::memcpy(out->members, s.agreed.members, sizeof(out->members));
}

Status Client::state(r2ccl_snap_state_t* out) {
  std::lock_guard<std::mutex> l(mu_);
  if (dead_) return dead_status();
  fill_state(state_, out);
  out->states_received = states_;
  return {};
}

Status Client::wait_event(int64_t timeout_us, r2ccl_snap_state_t* out) {
  auto changes = [&] {
    uint32_t c = 0;
    if (state_.agreed.epoch != event_base_.agreed.epoch) c |= R2CCL_SNAP_CHANGED_EPOCH;
    if ((state_.has_complete != 0) != (event_base_.has_complete != 0) ||
        (state_.has_complete && state_.complete_step != event_base_.complete_step))
      c |= R2CCL_SNAP_CHANGED_COMPLETE;
    return c;
  };
  std::unique_lock<std::mutex> l(mu_);
  wait_until(cv_, l, deadline_after(timeout_us), [&] { return dead_ || changes() != 0; });
  uint32_t c = changes();
  if (c) {
    fill_state(state_, out);
    out->changes = c;
    out->states_received = states_;
    event_base_ = state_;
    return {};
  }
  if (dead_) return dead_status();
  return fail(R2CCL_SNAP_ERR_TIMEOUT, "wait_event: no change of epoch or complete step within " +
                                          std::to_string(timeout_us) + " us");
}

// ---------------------------------------------------------------------------------------------
// restore

Status Client::restore(int64_t timeout_us, uint64_t* step_out) {
  std::lock_guard<std::mutex> lt(train_mu_);
  const int64_t deadline = deadline_after(timeout_us);
  if (n_user_ == 0)
    return fail(R2CCL_SNAP_ERR_INVALID,
                "restore: no buffer registered (register the same buffers, in the same order, as "
                "the process that took the snapshots)");
  if (!frozen_) {
    Status s = freeze(false);
    if (!s.ok()) return s;
  }
  Status s = wait_idle(deadline);
  if (!s.ok()) return fail(s.code, "restore: " + s.msg);
  {
    std::lock_guard<std::mutex> l(work_mu_);
    background_status(true);  // an earlier take's failure does not concern restore
    restoring_ = true;        // no huge pages made meanwhile: the decoders have the cores
  }
  struct Resume {  // ... and again once restore returns
    Client* c;
    ~Resume() {
      {
        std::lock_guard<std::mutex> l(c->work_mu_);
        c->restoring_ = false;
      }
      c->work_cv_.notify_all();
    }
  } resume{this};
  const uint32_t query = ++queries_;
  s = send(ClientMsg::kQuery, nullptr, 0);
  if (!s.ok()) return s;
  StateBody st;
  {
    // The answer is the first STATE that counts this QUERY, not merely the next STATE: one the
    // daemon pushed before it read the QUERY may still have been on its way, and its older
    // complete step would restore less than the newest. Counts compare mod 2^32; the daemon
    // answers in order, so a later STATE counts this QUERY too (a timed-out restore's late
    // answer does not).
    auto answered = [&] { return int32_t(state_.queries - query) >= 0; };
    std::unique_lock<std::mutex> l(mu_);
    wait_until(cv_, l, deadline, [&] { return dead_ || answered(); });
    if (!answered()) {
      if (dead_) return dead_status();
      return fail(R2CCL_SNAP_ERR_TIMEOUT, "restore: no STATE answered QUERY within the timeout");
    }
    st = state_;
  }
  // The agreed record's restore step when it is a restore point (the same on every node: it
  // comes from etcd), else the newest complete step.
  if (st.has_restore) {
    st.has_complete = 1;
    st.complete_step = st.restore_step;
  }
  if (!st.has_complete)
    return fail(R2CCL_SNAP_ERR_NO_SNAPSHOT,
                "restore: the daemon has no complete snapshot step (no take() has reached every "
                "rank's replicas yet)");
  const uint64_t S = st.complete_step;
  const uint32_t n = static_cast<uint32_t>(bufs_.size());

  struct FetchGuard {  // stop accepting FETCHED frames when restore returns
    Client* c;
    ~FetchGuard() {
      std::map<uint64_t, std::deque<Fetched>> left;
      {
        std::lock_guard<std::mutex> l(c->mu_);
        left.swap(c->inbox_);
      }
      for (auto& [id, q] : left)
        for (Fetched& f : q) c->recycle(std::move(f.payload));
      c->reclaim_staging();
    }
  } guard{this};
  lend_staging();

  // Every buffer's chain is asked for at once (the daemon stripes them over the replicas) and
  // decoded as it arrives, by up to 4 threads (this one included): straight into the caller's
  // host buffers (direct, the default: no copy, and no scratch to fault in for a replacement),
  // or into staging set 0 (staged mode, device buffers, the metadata), copied over only once
  // every buffer decoded and the metadata checked out.
  bool any_direct = false;
  std::vector<std::unique_ptr<DeltaDecoder>> decs(n);
  for (uint32_t i = 0; i < n; ++i) {
    std::string err;
    const bool direct = decodes_direct(i);
    any_direct = any_direct || direct;
    uint8_t* into = direct ? static_cast<uint8_t*>(bufs_[i].ptr) : sets_[0].bufs[i].data();
    decs[i] = DeltaDecoder::create(bufs_[i].dtype, bufs_[i].bytes, &err, into);
    if (!decs[i])
      return fail(R2CCL_SNAP_ERR_NOMEM,
                  "restore: decoder for buffer " + std::to_string(i) + ": " + err);
  }
  if (any_direct) {
    // The buffers are written from here on: no copy-on-write capture may still hold them
    // write-protected (wait_idle() saw every take encoded, which completes its capture).
    std::lock_guard<std::mutex> l(cow_mu_);
    cow_.finish();
  }
  std::atomic<bool> overwritten{false};
  // An error after a direct decode began writing says so: the buffers then hold some or all of
  // the restore (a chain refused by its checks wrote nothing).
  auto failed_after = [&](Status st) {
    if (overwritten.load())
      st.msg +=
          "; the registered host buffers were partly or wholly overwritten "
          "(R2CCL_SNAPSHOT_RESTORE=direct): restore again, or set "
          "R2CCL_SNAPSHOT_RESTORE=staged to leave them untouched on errors";
    return st;
  };
  const uint32_t hw = std::max(1u, std::thread::hardware_concurrency());
  const uint32_t nthreads = std::min<uint32_t>({n, hw, 4});
  // FETCHes go out a window ahead of the decoders (2 per decoding thread, at least the
  // replica count's worth: the daemon still stripes them over the replicas): chains that
  // arrive long before they are decoded would each need fresh receive memory, and first-touch
  // page clearing, not the wire, was what a restore waited on.
  const uint32_t window = std::max<uint32_t>(2 * nthreads, 3);
  std::vector<uint64_t> req(n);
  std::vector<Status> res(n);
  std::mutex fetch_mu;
  uint32_t sent = 0;
  // Sends the FETCHes of buffers [sent, upto); false (res[] says why) when the connection
  // died while they went out (the daemon closed it after an earlier one).
  auto send_upto = [&](uint32_t upto) {
    std::lock_guard<std::mutex> l(fetch_mu);
    for (; sent < std::min(upto, n); ++sent) {
      Status fs;
      req[sent] = start_fetch(sent, S, kNoNode, &fs);
      if (!fs.ok()) {
        res[sent] = fail(fs.code, "restore of step " + std::to_string(S) + ", rank " +
                                      std::to_string(rank_) + ", buffer " + std::to_string(sent) +
                                      ": sending FETCH: " + fs.msg);
        return false;
      }
    }
    return true;
  };
  std::atomic<uint32_t> next{0};
  std::atomic<bool> failed{false};
  if (!send_upto(window)) failed.store(true);
  auto work = [&] {
    for (;;) {
      const uint32_t i = next.fetch_add(1);
      if (i >= n || failed.load()) return;
      if (!send_upto(i + window)) {
        failed.store(true);
        std::lock_guard<std::mutex> l(fetch_mu);
        if (i >= sent) return;  // this buffer's FETCH never went out: res[] has the error
      }
      res[i] = restore_buffer(i, S, decs[i].get(), req[i], deadline, &overwritten);
      if (!res[i].ok()) failed.store(true);
    }
  };
  std::vector<std::thread> pool;
  for (uint32_t t = 1; t < nthreads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (uint32_t i = 0; i < n; ++i)
    if (!res[i].ok()) return failed_after(res[i]);
  // Metadata: checked before anything is copied to the caller's buffers.
  const uint8_t* md = decs[n_user_]->state();
  uint32_t rng_n = get_u32(md + 12);
  if (get_u32(md) != kMetaMagic || get_u32(md + 4) != 1 || get_u32(md + 8) != n_user_ ||
      rng_n > R2CCL_SNAP_MAX_RNG_BYTES)
    return failed_after(fail(
        R2CCL_SNAP_ERR_CORRUPT,
        "restore of step " + std::to_string(S) +
            ": the metadata buffer is not valid (magic, version 1, " + std::to_string(n_user_) +
            " user buffers, RNG blob <= " + std::to_string(R2CCL_SNAP_MAX_RNG_BYTES) + " bytes)"));
  bool any_staged = false;
  for (uint32_t i = 0; i < n_user_; ++i) any_staged = any_staged || !decodes_direct(i);
  if (any_staged) {
    std::vector<Status> cr(n_user_);
    std::atomic<uint32_t> nx{0};
    auto copy = [&] {
      for (uint32_t i; (i = nx.fetch_add(1)) < n_user_;)
        if (!decodes_direct(i)) cr[i] = copy_out(bufs_[i], decs[i]->state());
    };
    std::vector<std::thread> cp;
    for (uint32_t t = 1; t < nthreads; ++t) cp.emplace_back(copy);
    copy();
    for (auto& t : cp) t.join();
    for (uint32_t i = 0; i < n_user_; ++i)
      if (!cr[i].ok())
        return failed_after(
            fail(cr[i].code, "restore: buffer " + std::to_string(i) + ": " + cr[i].msg));
  }
  std::memcpy(&loss_scale_, md + 16, 8);
  has_loss_scale_ = get_u32(md + 24) != 0;
  has_rng_ = get_u32(md + 28) != 0;
  rng_.assign(md + kMetaHeader, md + kMetaHeader + rng_n);
  // New chains from here: a base at the next take, sequence numbers continuing.
  for (uint32_t i = 0; i < n; ++i) bufs_[i].enc->restart(decs[i]->last_seq() + 1);
  last_step_ = S;
  has_last_step_ = true;
  *step_out = S;
  return {};
}

bool Client::take_pooled(size_t n, PageBuf* out) {
  std::lock_guard<std::mutex> l(pool_mu_);
  if (!pool_on_) return false;
  size_t best = pool_.size();
  // A frame much smaller than a pooled buffer (a delta) gets memory of its own: it would hold
  // a whole buffer's room while its chain waits for the rest. Among buffers of the same size,
  // the one recycled last (the pool's back): a replacement's set 1 was never touched, and
  // reusing warm buffers touches window-many fresh ones instead of one per chain.
  for (size_t i = pool_.size(); i-- > 0;)
    if (pool_[i].capacity() >= n && pool_[i].capacity() / 4 <= n &&
        (best == pool_.size() || pool_[i].capacity() < pool_[best].capacity()))
      best = i;
  if (best == pool_.size()) return false;
  *out = std::move(pool_[best]);
  pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(best));
  out->resize(n);
  return true;
}

void Client::recycle(PageBuf b) {
  std::lock_guard<std::mutex> l(pool_mu_);
  if (pool_on_ && b.data()) pool_.push_back(std::move(b));
}  // else freed here

void Client::lend_staging() {
  std::lock_guard<std::mutex> l(pool_mu_);
  pool_on_ = true;
  for (PageBuf& b : sets_[1].bufs) pool_.push_back(std::move(b));
}

// Set 1's buffers come back from the pool; one still held by a frame in flight (a restore that
// failed or timed out) stays with that frame and set 1 gets a new, unfaulted one instead. The
// other pooled buffers are freed.
void Client::reclaim_staging() {
  std::vector<PageBuf> pooled;
  {
    std::lock_guard<std::mutex> l(pool_mu_);
    pool_on_ = false;
    pooled.swap(pool_);
  }
  std::vector<PageBuf>& set1 = sets_[1].bufs;
  for (size_t i = 0; i < set1.size(); ++i) {
    const size_t bytes = bufs_[i].bytes, cap = frame_bound(bytes);
    PageBuf* pick = nullptr;
    for (PageBuf& b : pooled)
      if (b.data() && b.capacity() >= cap && (!pick || b.capacity() < pick->capacity())) pick = &b;
    if (pick) {
      set1[i] = std::move(*pick);
      set1[i].resize(bytes);
    } else if (!set1[i].alloc(bytes, false, cap)) {
      // Nothing faulted yet: an mmap without MAP_POPULATE fails only when the address space
      // is exhausted; the next take that uses set 1 reports it.
      set1[i].reset();
    }
  }
}

// Sends a FETCH for buffer i's chain at step S (a new request id, its inbox opened first so no
// answer is dropped); avoid: a node whose copy failed here (kNoNode: none). Returns the id.
uint64_t Client::start_fetch(uint32_t i, uint64_t S, uint32_t avoid, Status* s) {
  FetchBody fb{};
  {
    std::lock_guard<std::mutex> l(mu_);
    fb.request = next_request_++;
    inbox_[fb.request];
  }
  fb.step = S;
  fb.rank = rank_;
  fb.buffer = i;
  fb.stripe = i;
  fb.avoid_node = avoid;
  *s = send(ClientMsg::kFetch, &fb, sizeof(fb));
  return fb.request;
}

// One buffer's chain: frames in order, each checked as it comes (header, chain position,
// checksum: the one check of the last hop), then decoded together in one pass over the state
// (DeltaDecoder::apply_chain: the chain's frames XOR together per chunk, so the state is
// written once instead of once per frame). A shard that fails its checksum is asked for again
// from elsewhere (the daemon skips the node that served it), up to twice.
Status Client::restore_buffer(uint32_t i, uint64_t S, DeltaDecoder* dec, uint64_t request,
                              int64_t deadline, std::atomic<bool>* overwritten) {
  const uint32_t n = static_cast<uint32_t>(bufs_.size());
  const std::string where = "restore of step " + std::to_string(S) + ", rank " +
                            std::to_string(rank_) + ", buffer " + std::to_string(i) +
                            (i == n_user_ ? " (metadata)" : "");
  std::string err;
  std::vector<Fetched> chain;
  struct Recycle {  // every frame's buffer goes back to the pool, however this returns
    Client* c;
    std::vector<Fetched>* v;
    ~Recycle() {
      for (Fetched& f : *v) c->recycle(std::move(f.payload));
      v->clear();
    }
  } recycle_chain{this, &chain};
  for (int attempt = 0;; ++attempt) {
    err.clear();
    uint32_t count = 0;
    uint64_t last_step = 0;
    uint32_t bad_source = kNoNode;
    for (Fetched& f : chain) recycle(std::move(f.payload));
    chain.clear();
    for (uint32_t idx = 0;; ++idx) {
      Fetched f;
      {
        std::unique_lock<std::mutex> l(mu_);
        auto& q = inbox_[request];
        wait_until(cv_, l, deadline, [&] { return dead_ || !q.empty(); });
        if (q.empty()) {
          if (dead_) {
            Status d = dead_status();
            return fail(d.code, where + ": " + d.msg);
          }
          return fail(R2CCL_SNAP_ERR_TIMEOUT, where +
                                                  ": the chain did not arrive within the "
                                                  "timeout (" +
                                                  std::to_string(idx) + " frame(s) received)");
        }
        f = std::move(q.front());
        q.pop_front();
      }
      if (f.head.status != static_cast<uint32_t>(FetchStatus::kOk))
        return fail(R2CCL_SNAP_ERR_REFUSED, where + ": the daemon refused FETCH: status " +
                                                std::to_string(f.head.status) + " " +
                                                fetch_status_name(f.head.status));
      if (f.payload.size() == sizeof(FetchedHead))
        return fail(R2CCL_SNAP_ERR_CORRUPT, where + ": FETCHED with status kOk but no shard");
      if (f.head.count == 0 || f.head.count > kMaxChainFrames || f.head.index != idx ||
          (idx > 0 && f.head.count != count))
        return fail(R2CCL_SNAP_ERR_CORRUPT,
                    where + ": FETCHED frame index " + std::to_string(f.head.index) + " of " +
                        std::to_string(f.head.count) + " (expected index " + std::to_string(idx) +
                        (idx ? " of " + std::to_string(count) : "") + ", count 1.." +
                        std::to_string(kMaxChainFrames) + ")");
      count = f.head.count;
      const ShardMeta& m = f.meta;
      if (m.rank != rank_ || m.buffer != i || m.step > S || (idx > 0 && m.step <= last_step))
        return fail(R2CCL_SNAP_ERR_CORRUPT,
                    where + ": FETCHED shard names rank " + std::to_string(m.rank) + " buffer " +
                        std::to_string(m.buffer) + " step " + std::to_string(m.step) +
                        " (expected this rank and buffer, growing steps up to " +
                        std::to_string(S) + ")");
      if (m.n_buffers != n)
        return fail(R2CCL_SNAP_ERR_INVALID,
                    where + ": the snapshot has " + std::to_string(m.n_buffers) +
                        " buffers (with the metadata buffer), this process registered " +
                        std::to_string(n_user_) +
                        " + 1 (register the same buffers, in the same "
                        "order, as the process that took it)");
      if (shard_checksum(shard_of(f), m.payload_bytes) != m.checksum) {
        bad_source = f.head.source_node;
        err = "shard of step " + std::to_string(m.step) + " fails its checksum (XXH3-64)" +
              (bad_source != kNoNode ? " as served by node " + std::to_string(bad_source) : "");
        recycle(std::move(f.payload));
        break;
      }
      last_step = m.step;
      chain.push_back(std::move(f));
      if (idx + 1 == count) break;
    }
    if (bad_source == kNoNode && err.empty()) {
      if (last_step != S)
        return fail(R2CCL_SNAP_ERR_CORRUPT, where + ": the chain ends at step " +
                                                std::to_string(last_step) + ", not at " +
                                                std::to_string(S));
      std::vector<const uint8_t*> frames;
      std::vector<size_t> sizes;
      for (const Fetched& f : chain) {
        frames.push_back(shard_of(f));
        sizes.push_back(f.meta.payload_bytes);
      }
      dec->reset();
      bool writing = false;
      const bool ok = dec->apply_chain(frames.data(), sizes.data(), chain.size(), &err, &writing);
      if (writing && decodes_direct(i)) overwritten->store(true);
      if (!ok)
        return fail(R2CCL_SNAP_ERR_CORRUPT, where + ": chain of steps " +
                                                std::to_string(chain.front().meta.step) + ".." +
                                                std::to_string(S) + ": " + err);
      return {};
    }
    // A corrupt copy: drop what else comes for this request and ask again, avoiding its node.
    {
      std::lock_guard<std::mutex> l(mu_);
      inbox_.erase(request);
    }
    if (attempt == 2 || bad_source == kNoNode)
      return fail(R2CCL_SNAP_ERR_CORRUPT, where + ": " + err);
    Status s;
    request = start_fetch(i, S, bad_source, &s);
    if (!s.ok()) return s;
    err.clear();
  }
}

// ---------------------------------------------------------------------------------------------
// kv

Status Client::kv_put(const char* key, const void* value, size_t n) {
  size_t kn = 0;
  if (!key_ok(key, &kn))
    return fail(R2CCL_SNAP_ERR_INVALID, "kv_put: key (accepted: 1..63 bytes, NUL-terminated)");
  if (n > kKvMaxValue || (n && !value))
    return fail(R2CCL_SNAP_ERR_INVALID,
                "kv_put '" + std::string(key, kn) + "': " + std::to_string(n) +
                    " value bytes (accepted: 0.." + std::to_string(kKvMaxValue) + ")");
  auto kv = std::make_unique<KvBody>();
  std::memset(kv.get(), 0, sizeof(KvBody));
  std::memcpy(kv->key, key, kn);
  kv->value_bytes = static_cast<uint32_t>(n);
  if (n) std::memcpy(kv->value, value, n);
  Status s = send(ClientMsg::kKvPut, kv.get(), sizeof(KvBody));
  if (!s.ok()) return fail(s.code, "kv_put '" + std::string(key, kn) + "': " + s.msg);
  return {};
}

Status Client::kv_get(const char* key, void* buf, size_t cap, size_t* n, int64_t timeout_us) {
  size_t kn = 0;
  if (!key_ok(key, &kn))
    return fail(R2CCL_SNAP_ERR_INVALID, "kv_get: key (accepted: 1..63 bytes, NUL-terminated)");
  const std::string k(key, kn);
  const int64_t deadline = deadline_after(timeout_us);
  std::lock_guard<std::mutex> lk(kv_mu_);
  KvGetBody q{};
  std::memcpy(q.key, key, kn);
  for (;;) {
    {
      std::lock_guard<std::mutex> l(mu_);
      kv_values_.clear();
    }
    Status s = send(ClientMsg::kKvGet, &q, sizeof(q));
    if (!s.ok()) return fail(s.code, "kv_get '" + k + "': " + s.msg);
    std::unique_lock<std::mutex> l(mu_);
    auto match = [&] {
      for (const KvBody& v : kv_values_)
        if (strncmp(v.key, key, kKvKeyBytes) == 0) return true;
      return false;
    };
    wait_until(cv_, l, deadline, [&] { return dead_ || match(); });
    for (const KvBody& v : kv_values_) {
      if (strncmp(v.key, key, kKvKeyBytes) != 0) continue;
      if (v.origin_node == kKvAbsent) break;  // not yet published: poll again
      if (cap < v.value_bytes) {
        *n = v.value_bytes;
        return fail(R2CCL_SNAP_ERR_TOO_SMALL, "kv_get '" + k + "': the value is " +
                                                  std::to_string(v.value_bytes) +
                                                  " bytes, buffer " + std::to_string(cap));
      }
      if (v.value_bytes) std::memcpy(buf, v.value, v.value_bytes);
      *n = v.value_bytes;
      return {};
    }
    if (dead_) {
      Status d = dead_status();
      return fail(d.code, "kv_get '" + k + "': " + d.msg);
    }
    int64_t now = mono_us();
    if (now >= deadline)
      return fail(R2CCL_SNAP_ERR_TIMEOUT, "kv_get '" + k + "': not published within " +
                                              std::to_string(timeout_us / 1000) + " ms");
    wait_until(cv_, l, std::min(deadline, now + kKvPollUs), [&] { return dead_; });
  }
}

}  // namespace r2ccl::snap::client
