// The snapshot client behind the C API (snapshot_client.h): one connection to the node's
// r2ccl_snapshotd, a reader thread (STATE, FETCHED, KV_VALUE) and an encoder/sender thread
// (take() hands it a staging set; it runs one DeltaEncoder per buffer and sends one SHARD per
// buffer). Errors are returned as Status {code, message}; nothing here throws past the C API's
// firewall (client.cc catches std::bad_alloc and anything else).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cow.h"
#include "r2ccl/snapshot/client_wire.h"
#include "r2ccl/snapshot/codec.h"
#include "r2ccl/snapshot_client.h"
#include "sock_io.h"

namespace r2ccl::snap::client {

struct Status {
  int code = R2CCL_SNAP_OK;
  std::string msg;
  bool ok() const { return code == R2CCL_SNAP_OK; }
};
inline Status fail(int code, std::string msg) { return Status{code, std::move(msg)}; }

// Environment read at open (R2CCL_SNAPSHOT_*).
struct Config {
  std::string socket_path;
  uint64_t interval = 1;
  uint32_t base_every = 8;
  bool take_cow = true;        // R2CCL_SNAPSHOT_TAKE=cow (default) | copy
  bool restore_direct = true;  // R2CCL_SNAPSHOT_RESTORE=direct (default) | staged
};
// Parses the environment; socket_arg (may be null) wins over R2CCL_SNAPSHOT_SOCKET.
Status load_config(const char* socket_arg, Config* out);

// The internal metadata buffer (the last buffer id): loss scale and RNG blob.
// Layout (little-endian): 0 u32 magic "R2SM", 4 u32 version 1, 8 u32 user buffers,
// 12 u32 rng bytes, 16 f64 loss scale, 24 u32 has loss scale, 28 u32 has rng, 32 u64 step,
// then zeros up to kMetaHeader, then the RNG blob (R2CCL_SNAP_MAX_RNG_BYTES, zero-padded).
constexpr uint32_t kMetaMagic = 0x4d533252u;  // "R2SM"
constexpr size_t kMetaHeader = 256;
constexpr size_t kMetaBytes = kMetaHeader + R2CCL_SNAP_MAX_RNG_BYTES;

class Client {
 public:
  static Status open(const Config& cfg, uint32_t rank, uint32_t world,
                     std::unique_ptr<Client>* out);
  ~Client();  // stops the threads, closes the socket (no flush)

  Status register_buffer(uint32_t id, void* ptr, size_t bytes, int dtype, int codec,
                         uint32_t flags);
  Status set_loss_scale(double v);
  Status get_loss_scale(double* out);
  Status set_rng_state(const void* blob, size_t n);
  Status get_rng_state(void* buf, size_t cap, size_t* n);
  Status take(uint64_t step, r2ccl_snap_take_stats_t* st);
  Status flush(int64_t timeout_us);
  Status state(r2ccl_snap_state_t* out);
  Status wait_event(int64_t timeout_us, r2ccl_snap_state_t* out);
  Status restore(int64_t timeout_us, uint64_t* step_out);
  Status kv_put(const char* key, const void* value, size_t n);
  Status kv_get(const char* key, void* buf, size_t cap, size_t* n, int64_t timeout_us);

 private:
  struct Buffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    DType dtype = DType::kBytes;
    Codec codec = Codec::kLossless;
    bool device = false;
    std::unique_ptr<DeltaEncoder> enc;
    uint64_t base_step = 0;  // step of the current chain's base (worker thread)
  };
  struct Staging {
    std::vector<PageBuf> bufs;  // one per buffer (user buffers + metadata), pre-faulted
    bool busy = false;
    uint64_t step = 0;
    uint64_t generation = 0;  // the agreed record's generation at take()
  };
  struct FinishedTake {
    bool valid = false;
    uint64_t step = 0;
    double encode_s = 0, send_s = 0, max_err = 0;
    uint64_t raw = 0, encoded = 0;
    uint32_t bases = 0;
  };
  struct Fetched {
    FetchedHead head{};
    ShardMeta meta{};
    PageBuf payload;  // the whole frame payload (FetchedHead, ShardMeta, shard bytes)
  };
  static const uint8_t* shard_of(const Fetched& f) {
    return f.payload.data() + sizeof(FetchedHead) + sizeof(ShardMeta);
  }

  Client(const Config& cfg, uint32_t rank, uint32_t world, int fd);
  void reader_main();
  void worker_main();
  Status send(ClientMsg type, const void* a, size_t na, const void* b = nullptr, size_t nb = 0);
  Status dead_status();                    // under mu_
  Status background_status(bool consume);  // under work_mu_
  // First take/restore: metadata encoder, staging sets. for_take: both sets are faulted in
  // now; else (a restore first) only the set-0 buffers a restore decodes into (staged mode,
  // device buffers), the rest on first use.
  Status freeze(bool for_take);
  Status make_encoder(Buffer* b, uint64_t first_seq, std::string* err);
  void fill_meta(uint8_t* out, uint64_t step) const;
  Status wait_idle(int64_t deadline_us);
  void fill_prev(r2ccl_snap_take_stats_t* st);  // under work_mu_
  void fill_state(const StateBody& s, r2ccl_snap_state_t* out) const;
  Status copy_in(const Buffer& b, uint8_t* dst);         // registered buffer -> staging
  Status copy_out(const Buffer& b, const uint8_t* src);  // scratch -> registered buffer
  // restore(): fetches buffer i's chain of step S and decodes it into decs[i] (any thread).
  // *overwritten is set when it starts decoding into the caller's buffer (direct).
  Status restore_buffer(uint32_t i, uint64_t S, DeltaDecoder* dec, uint64_t request,
                        int64_t deadline, std::atomic<bool>* overwritten);
  bool decodes_direct(uint32_t i) const {  // restore() decodes buffer i into the caller's memory
    return cfg_.restore_direct && i < n_user_ && !bufs_[i].device;
  }
  uint64_t start_fetch(uint32_t i, uint64_t S, uint32_t avoid, Status* s);

  const Config cfg_;
  const uint32_t rank_, world_;
  int fd_;

  // Training-thread calls (register, take, flush, restore, set_*/get_*).
  std::mutex train_mu_;
  std::vector<Buffer> bufs_;  // user buffers, then (after freeze) the metadata buffer
  uint32_t n_user_ = 0;
  bool frozen_ = false;
  bool has_last_step_ = false;
  uint64_t last_step_ = 0;
  double loss_scale_ = 0;
  bool has_loss_scale_ = false;
  std::vector<uint8_t> rng_;
  bool has_rng_ = false;
  std::atomic<uint64_t> max_shard_bytes_{65536};

  // Sends (any thread).
  std::mutex send_mu_;

  // Received (reader thread -> callers).
  std::mutex mu_;
  std::condition_variable cv_;
  bool dead_ = false;
  std::string dead_reason_;
  StateBody state_{};
  uint64_t states_ = 0;
  StateBody event_base_{};                         // what wait_event() last returned
  std::map<uint64_t, std::deque<Fetched>> inbox_;  // request -> its FETCHED frames (others dropped)
  // Receive buffers during a restore (pool_mu_): staging set 1, idle then and faulted in by
  // earlier takes, is lent to the reader, and every decoded frame's buffer comes back here
  // for the next frame, so a restore touches little fresh memory (first-touch page clearing
  // was most of a restore's time). Outside a restore the pool is off and empty.
  std::mutex pool_mu_;
  std::vector<PageBuf> pool_;
  bool pool_on_ = false;
  bool take_pooled(size_t n, PageBuf* out);  // reader thread: a pooled buffer of >= n bytes
  void recycle(PageBuf b);                   // a frame's buffer, done with
  void lend_staging();                       // restore start (train_mu_ held, sets idle)
  void reclaim_staging();                    // restore end: set 1 whole again
  uint64_t next_request_ = 1;
  uint32_t queries_ = 0;  // QUERYs sent (train_mu_: only restore() sends them), mod 2^32
  std::deque<KvBody> kv_values_;
  std::mutex kv_mu_;  // one kv_get at a time

  // Copy-on-write capture of the host buffers (take_cow): begun by take(), completed by the
  // worker before it encodes that set (or by the next take()). cow_mu_ serialises both.
  std::mutex cow_mu_;
  CowBuffers cow_;
  bool cow_ready_ = false;  // init() succeeded (at freeze)
  // Under work_mu_: the worker has huge pages to make (cow.h), from the first take on, and
  // not while a restore runs.
  bool collapse_ = false, collapse_started_ = false, restoring_ = false;
  std::vector<bool> cow_skip_;  // per user buffer: copied at take() (device, pinned host)
  int cow_set_ = -1;            // the staging set a capture in progress fills
  std::string cow_note_;        // why the last take() copied instead (for the stats' reader)

  // Encoder/sender thread.
  std::mutex work_mu_;
  std::condition_variable work_cv_;
  Staging sets_[2];
  std::deque<int> jobs_;
  bool working_ = false;
  bool stop_ = false;
  Status bg_error_;        // first background error not yet reported
  FinishedTake finished_;  // the newest take fully sent

  std::thread reader_, worker_;
};

}  // namespace r2ccl::snap::client
