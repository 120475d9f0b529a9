/* libr2ccl-snapshot: the snapshot client of issue 6. A training process registers its state
 * buffers (parameters, optimizer state) and calls r2ccl_snap_take() every step; the library
 * delta-encodes them (codec.h: XOR + byte shuffle + zstd, a chunk where few elements changed
 * as their indices and values, a full base every K snapshots,
 * opt-in lossy FP16/BF16) on its own thread and sends one SHARD per buffer to the node's
 * r2ccl_snapshotd over its Unix socket (protocol: r2ccl/snapshot/client_wire.h). After a
 * failure, r2ccl_snap_restore() fetches the newest step that is complete on every rank and
 * decodes it back into the registered buffers.
 *
 * Units: sizes in bytes, timeouts in microseconds (int64; a negative timeout waits without a
 * deadline, bounded only by the daemon closing the connection), durations in seconds.
 *
 * Errors: every function returns R2CCL_SNAP_OK (0) or a negative R2CCL_SNAP_ERR_* code;
 * r2ccl_snap_last_error() then gives a message naming the thing at fault and the accepted
 * form. Output parameters are written only on success (documented exceptions: the stats of
 * r2ccl_snap_take(), and *n of r2ccl_snap_kv_get()/r2ccl_snap_get_rng_state() on
 * R2CCL_SNAP_ERR_TOO_SMALL). Nothing is thrown across this API; nothing calls exit().
 *
 * Threads: a handle has one "training thread" role: r2ccl_snap_register(), take(), flush(),
 * restore(), set_loss_scale(), set_rng_state(), get_loss_scale(), get_rng_state() (they are
 * serialised by an internal mutex, so a second thread calling them waits, but they are meant
 * for one thread). r2ccl_snap_state(), r2ccl_snap_wait_event(), kv_put() and kv_get() may be
 * called from any thread, also concurrently with the training thread. r2ccl_snap_close() is
 * called once, when no other call on the handle is in progress. All socket I/O runs on the
 * library's two background threads (a reader and an encoder/sender) or under a send mutex.
 * r2ccl_snap_last_error() is per calling thread.
 *
 * Environment (read at r2ccl_snap_open(); an invalid value fails open with
 * R2CCL_SNAP_ERR_CONFIG naming the variable and the accepted form):
 *   R2CCL_SNAPSHOT_SOCKET      the daemon's socket when open() gets NULL
 *   R2CCL_HEALTH_BOARD         board name; default socket /tmp/r2ccl-snapshotd-<name>.sock
 *                              ("default" when unset)
 *   R2CCL_SNAPSHOT_INTERVAL    snapshot steps that are multiples of N (1..1000000000, default 1)
 *   R2CCL_SNAPSHOT_BASE_EVERY  a full base every K snapshots per buffer (1..1000000, default 8)
 *   R2CCL_SNAPSHOT_TAKE        cow (default): take() write-protects the host buffers and returns;
 *                              copy: take() copies them (see r2ccl_snap_take())
 *   R2CCL_SNAPSHOT_RESTORE     direct (default): restore() decodes into the host buffers;
 *                              staged: into scratch, copied over only when every buffer decoded
 *                              (see r2ccl_snap_restore())
 */
#ifndef R2CCL_SNAPSHOT_CLIENT_H_
#define R2CCL_SNAPSHOT_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- return codes ---- */
#define R2CCL_SNAP_OK 0
#define R2CCL_SNAP_ERR_INVALID (-1) /* bad argument or call order (misuse) */
#define R2CCL_SNAP_ERR_CONFIG (-2)  /* an R2CCL_SNAPSHOT_* variable is invalid */
#define R2CCL_SNAP_ERR_CONNECT (-3) /* the daemon's socket cannot be reached (not running?) */
#define R2CCL_SNAP_ERR_CONNECTION                                                          \
  (-4)                                  /* the connection was lost or the daemon broke the \
                                           protocol; sticky: close the handle and open again */
#define R2CCL_SNAP_ERR_TIMEOUT (-5)     /* the timeout passed first (nothing else wrong) */
#define R2CCL_SNAP_ERR_NO_SNAPSHOT (-6) /* restore: the daemon has no complete step */
#define R2CCL_SNAP_ERR_REFUSED                           \
  (-7) /* restore: the daemon refused a FETCH (not held, \
          corrupt, busy) */
#define R2CCL_SNAP_ERR_CORRUPT                            \
  (-8) /* restore: a shard failed its checks (CRC, chain, \
          sizes). What a failed restore leaves in the     \
          buffers: r2ccl_snap_restore() */
#define R2CCL_SNAP_ERR_NOMEM (-9)
#define R2CCL_SNAP_ERR_UNSUPPORTED (-10) /* device memory in a build without USE_CUDA */
#define R2CCL_SNAP_ERR_TOO_SMALL (-11)   /* the caller's buffer is too small; *n says the size */
#define R2CCL_SNAP_ERR_ENCODE                                                           \
  (-12)                           /* a background encode failed (reported by the next   \
                                     take/flush; that step's snapshot is incomplete and \
                                     the next one is a base) */
#define R2CCL_SNAP_ERR_CUDA (-13) /* a CUDA copy failed */

/* ---- buffer description ---- */
#define R2CCL_SNAP_DTYPE_BYTES 0 /* opaque bytes (element size 1) */
#define R2CCL_SNAP_DTYPE_F32 1
#define R2CCL_SNAP_DTYPE_F16 2
#define R2CCL_SNAP_DTYPE_BF16 3

#define R2CCL_SNAP_CODEC_LOSSLESS 0 /* exact (any dtype) */
#define R2CCL_SNAP_CODEC_LOSSY                              \
  1 /* FP16/BF16 deltas as int8 codes with a per-256 scale; \
       error reported per take (stats.prev_max_abs_error) */

#define R2CCL_SNAP_FLAG_DEVICE 1u /* ptr is CUDA device memory (needs a USE_CUDA build) */

#define R2CCL_SNAP_MAX_RNG_BYTES 65536 /* largest RNG-state blob */
#define R2CCL_SNAP_MAX_KV_VALUE 4096   /* largest kv value; keys are 1..63 bytes, no NUL */
#define R2CCL_SNAP_MAX_NODES 1024

typedef struct r2ccl_snap r2ccl_snap_t; /* opaque handle */

/* What take() measured. Filled on every return of take(), also on errors (zeros then). */
typedef struct r2ccl_snap_take_stats {
  int skipped; /* 1: this step is not a multiple of R2CCL_SNAPSHOT_INTERVAL */
  uint64_t step;
  double copy_seconds; /* copying the registered buffers to staging: the caller's overhead */
  double wait_seconds; /* waiting for a free staging set (both still being encoded/sent) */
  /* The newest take whose shards were all written to the socket before this call: */
  int prev_valid; /* 0: none finished yet */
  uint64_t prev_step;
  double prev_encode_seconds;  /* encoding every buffer (background thread) */
  double prev_send_seconds;    /* writing the shards to the socket (background thread) */
  uint64_t prev_raw_bytes;     /* registered bytes (+ the internal metadata buffer) */
  uint64_t prev_encoded_bytes; /* frame bytes sent */
  double prev_ratio;           /* raw / encoded */
  double prev_max_abs_error;   /* largest error over the lossy buffers (0: exact) */
  uint32_t prev_base_buffers;  /* buffers sent as a full base */
} r2ccl_snap_take_stats_t;

/* The daemon's latest STATE. */
typedef struct r2ccl_snap_state {
  uint64_t epoch;         /* agreed membership epoch; 0: nothing agreed yet */
  uint32_t node_id;       /* the local daemon's node */
  uint32_t n_nodes;       /* nodes in the job */
  uint32_t member_count;  /* live nodes (bits set in members) */
  int has_complete_step;  /* 1: complete_step is valid */
  uint64_t complete_step; /* newest step held on every rank (what restore() restores) */
  uint64_t members[R2CCL_SNAP_MAX_NODES / 64]; /* bitmap of live node ids */
  uint32_t changes;         /* wait_event(): R2CCL_SNAP_CHANGED_* bits; state(): 0 */
  uint64_t states_received; /* STATE frames received on this handle so far */
} r2ccl_snap_state_t;

#define R2CCL_SNAP_CHANGED_EPOCH 1u
#define R2CCL_SNAP_CHANGED_COMPLETE 2u

/* Connects to the node's daemon (socket_path, or NULL: R2CCL_SNAPSHOT_SOCKET, else
 * /tmp/r2ccl-snapshotd-<R2CCL_HEALTH_BOARD or "default">.sock), sends HELLO (rank < world,
 * world 1..65536) and waits up to 10 s for the first STATE. Errors: CONFIG (environment),
 * CONNECT (no daemon at the path: the message names it), CONNECTION, TIMEOUT, INVALID. */
int r2ccl_snap_open(const char* socket_path, uint32_t rank, uint32_t world, r2ccl_snap_t** out);

/* Registers buffer `id`: ids are dense, 0..n-1 in registration order (id must equal the
 * number registered so far). `bytes` > 0 and a multiple of the dtype's size; the memory must
 * stay valid until close. Lossy needs F16/BF16. flags: R2CCL_SNAP_FLAG_DEVICE for CUDA memory.
 * Only before the first take() or restore(). Memory: the library holds 3x the registered bytes
 * (two staging sets, faulted in at the first take(), and the encoder's reconstruction), on
 * transparent huge pages where the kernel has them; restore receives the frames into a staging
 * set (and fresh memory for what does not fit in it while it runs). */
int r2ccl_snap_register(r2ccl_snap_t* h, uint32_t id, void* ptr, size_t bytes, int dtype, int codec,
                        uint32_t flags);

/* The loss scale and an opaque RNG-state blob (<= R2CCL_SNAP_MAX_RNG_BYTES), copied into the
 * internal metadata buffer (the last buffer id, n registered) at every take() and given back
 * after restore(). get_* return R2CCL_SNAP_ERR_NO_SNAPSHOT when never set nor restored. */
int r2ccl_snap_set_loss_scale(r2ccl_snap_t* h, double loss_scale);
int r2ccl_snap_get_loss_scale(r2ccl_snap_t* h, double* out);
int r2ccl_snap_set_rng_state(r2ccl_snap_t* h, const void* blob, size_t n);
/* Copies the blob into buf (cap bytes) and sets *n; TOO_SMALL sets *n to the size needed. */
int r2ccl_snap_get_rng_state(r2ccl_snap_t* h, void* buf, size_t cap, size_t* n);

/* Snapshots `step` if it is a multiple of R2CCL_SNAPSHOT_INTERVAL (else returns 0 with
 * stats->skipped = 1). Steps must grow (after restore(): beyond the restored step). Takes a
 * free staging set (waiting only while both sets are still being encoded/sent) and returns;
 * the background thread encodes and sends. The snapshot is the buffers' contents at this call,
 * bit for bit, whatever is written to them after it returns:
 *  - R2CCL_SNAPSHOT_TAKE=cow (default), host buffers: take() copies only the partial first and
 *    last page of each buffer and write-protects the rest (mprotect); the background thread
 *    copies it in 2 MiB+ chunks, unprotecting each; a CPU store to a chunk not copied yet
 *    faults and the library's SIGSEGV handler (chained to any earlier one) copies that chunk
 *    first. take() then blocks for microseconds to a few ms, and the cost of the copy moves to
 *    the background thread and, for the chunks written before it got to them, to the writer.
 *    Only CPU stores are caught: a buffer written by the kernel (read(2) into it: EFAULT while
 *    protected) or by a device (DMA, cudaMemcpy into pinned host memory, RDMA) before the
 *    previous take's capture completed (flush(), or the next take()) needs
 *    R2CCL_SNAPSHOT_TAKE=copy. The pages are made read-write again. If another SIGSEGV handler
 *    replaced the library's without chaining, take() copies (as with copy).
 *    Write-protecting costs one page-table entry per page: from the first take on, the
 *    background thread, while idle, turns each buffer's whole 2 MiB pages that are fully
 *    resident into transparent huge pages (MADV_COLLAPSE, Linux >= 6.1; not where the caller
 *    advised MADV_NOHUGEPAGE, nor while a restore runs), so a take of 1 GiB protects 512
 *    entries instead of 262144 (docs/BENCHMARKS.md: blocked 0.002 s instead of 0.05 s on the
 *    test machine). The copy chunks start on 2 MiB boundaries, so the huge pages stay.
 *  - copy, and device buffers: take() copies every buffer before it returns.
 * An error of an earlier take on the background thread is returned here (ENCODE once;
 * CONNECTION sticky). stats may be NULL. */
int r2ccl_snap_take(r2ccl_snap_t* h, uint64_t step, r2ccl_snap_take_stats_t* stats);

/* Waits until every take so far has been encoded and written to the socket. TIMEOUT when
 * timeout_us passed first; a background error as for take(). */
int r2ccl_snap_flush(r2ccl_snap_t* h, int64_t timeout_us);

/* The latest STATE (changes = 0). Never blocks on the daemon. */
int r2ccl_snap_state(r2ccl_snap_t* h, r2ccl_snap_state_t* out);

/* Waits until a STATE whose epoch or complete step differs from the one this function last
 * returned (initially: the first STATE of open()) arrives, and returns it with `changes`
 * naming what changed (changes in between are coalesced). TIMEOUT when none came;
 * CONNECTION when the daemon closed the connection. */
int r2ccl_snap_wait_event(r2ccl_snap_t* h, int64_t timeout_us, r2ccl_snap_state_t* out);

/* Restores the newest complete step S into every registered buffer (and the loss scale and
 * RNG blob): flushes pending takes, asks the daemon for S (QUERY: S as the daemon has it once it
 * read the QUERY, never an older step whose STATE was still on its way to this handle), asks for
 * every buffer's chain at once (the daemon stripes them over the replicas), checks each shard's
 * checksum once and decodes each chain as it arrives (up to 4 threads; one pass over the buffer
 * per chain, base and deltas together):
 *  - R2CCL_SNAPSHOT_RESTORE=direct (default): straight into the registered host buffers. An
 *    error (REFUSED, CORRUPT, TIMEOUT, CONNECTION) found before any buffer's chain passed its
 *    checks leaves them untouched; one found after leaves some or all of them overwritten, and
 *    its message says "partly or wholly overwritten": restore again before using them. The
 *    fastest way, and a replacement process needs no scratch memory for it.
 *  - staged: into scratch (a staging set); only when every buffer decoded and the metadata
 *    checked out are the registered buffers overwritten, so any error leaves them untouched. One
 *    more copy of the state.
 * Device buffers are always staged (decoded on the host, then cudaMemcpy). The next take()
 * starts a new chain (a base) and must be beyond S. A replacement process opens with the lost
 * rank's id. timeout_us bounds the whole call. Errors: NO_SNAPSHOT, REFUSED, CORRUPT, CONNECTION,
 * TIMEOUT, INVALID (nothing registered), CUDA. */
int r2ccl_snap_restore(r2ccl_snap_t* h, int64_t timeout_us, uint64_t* step_out);

/* Publishes key -> value to every node (through the daemons' coordinator). */
int r2ccl_snap_kv_put(r2ccl_snap_t* h, const char* key, const void* value, size_t n);
/* Asks the local daemon for key every ~10 ms until it is known or timeout_us passes (TIMEOUT).
 * Copies the value into buf (cap bytes), *n = its size; TOO_SMALL sets *n to the size. */
int r2ccl_snap_kv_get(r2ccl_snap_t* h, const char* key, void* buf, size_t cap, size_t* n,
                      int64_t timeout_us);

/* ---- recovery after a node loss ----
 * The survivors learn of a lost node from r2ccl_snap_wait_event() (the membership shrank); the
 * job's launcher starts a replacement process, which opens with the lost rank's id. Then every
 * rank rebuilds its communicator (below), restores the newest complete step
 * (r2ccl_snap_restore(); a replacement gets it from the replicas), applies the hint, and logs
 * the recovery line. */

/* The post-recovery hint: multiply the learning rate by *lr_factor for the first *steps steps
 * after a recovery. From R2CCL_RECOVERY_LR_FACTOR (a number in (0, 1], default 0.8) and
 * R2CCL_RECOVERY_LR_STEPS (0..1000, default 3); an invalid value keeps the default and returns
 * R2CCL_SNAP_ERR_CONFIG with the outputs set (the message names the variable and the accepted
 * form). Any thread. */
int r2ccl_snap_recovery_hint(double* lr_factor, int* steps);

/* Formats "[R2CCL] Successfully recovered in X s (node loss: NODES; P1 S1 s, P2 S2 s, ...)",
 * X the sum of the phases' seconds (3 decimals), NODES `lost_nodes` (e.g. "3" or "3,5"; NULL:
 * "unknown"), logs it as an event, one line "[SEC.USEC] [R2CCL] Successfully recovered in ..."
 * on stderr (SEC.USEC: CLOCK_MONOTONIC), and copies it without the stamp, NUL-terminated, into
 * buf (cap bytes; buf may be NULL). TOO_SMALL when it does not fit (the line is still logged).
 * The phrase, stamp and tag match the net plugin's rail recoveries, which say "(rail ...)"
 * instead. Any thread. */
int r2ccl_snap_log_recovered(const char* lost_nodes, int n_phases, const char* const* phase_names,
                             const double* phase_seconds, char* buf, size_t cap);

/* The NCCL calls a communicator rebuild needs, in NCCL's own signatures (NCCL 2.x public API:
 * ncclGetVersion, ncclGetUniqueId, ncclCommInitRank (its 128-byte ncclUniqueId passed here by
 * pointer), ncclCommShrink (NCCL >= 2.27; NULL when absent), ncclCommAbort, ncclCommDestroy,
 * ncclGetErrorString). Return values are ncclResult_t (0 = ncclSuccess). Tests pass a fake
 * table; NULL makes the library dlopen libnccl.so.2 (or R2CCL_NCCL_LIBRARY) at run time. */
typedef struct r2ccl_snap_nccl_ops {
  int (*get_version)(int* version);
  int (*get_unique_id)(void* unique_id_128);
  int (*comm_init_rank)(void** comm, int nranks, const void* unique_id_128, int rank);
  int (*comm_shrink)(void* comm, int* exclude_ranks, int n_exclude, void** new_comm, void* config,
                     int shrink_flags);
  int (*comm_abort)(void* comm);
  int (*comm_destroy)(void* comm);
  const char* (*get_error_string)(int result);
} r2ccl_snap_nccl_ops_t;

/* Rebuilds this rank's NCCL communicator after the loss of `lost_ranks` (old ranks of the lost
 * nodes; n_lost >= 1) of an `old_nranks` communicator. Ranks in `replaced_ranks` (a subset of
 * lost_ranks) are taken over by replacement processes, which call this too with old_comm NULL
 * and old_rank = the rank they take over. Without replacements and with NCCL >= 2.27 the
 * survivors shrink (ncclCommShrink, NCCL_SHRINK_ABORT); otherwise every old communicator is
 * aborted and a new one initialised with a unique id that the lowest surviving rank creates and
 * publishes through the daemons' KV ("r2ccl.rebuild.e<epoch>"), waited for at most
 * id_timeout_us. A failed shrink falls back to that re-init on every rank. On success
 * *new_comm, *new_rank and *new_nranks describe the new communicator; the old one has been
 * released. Errors: INVALID (arguments that do not fit; nothing done), CONFIG (libnccl.so.2
 * cannot be loaded or lacks a symbol: the message names it), TIMEOUT (the unique id did not
 * come), CONNECTION (the NCCL call or the KV failed: the message names the call and NCCL's
 * text). Training thread; every rank of the plan must call it (NCCL's calls are collective). */
int r2ccl_snap_rebuild_comm(r2ccl_snap_t* h, const r2ccl_snap_nccl_ops_t* ops, void* old_comm,
                            int old_rank, int old_nranks, const int* lost_ranks, int n_lost,
                            const int* replaced_ranks, int n_replaced, uint64_t epoch,
                            int64_t id_timeout_us, void** new_comm, int* new_rank, int* new_nranks);

/* Stops the background threads and closes the connection. Does NOT flush: takes not yet
 * written are dropped (call r2ccl_snap_flush() first). NULL is a no-op. */
void r2ccl_snap_close(r2ccl_snap_t* h);

/* The calling thread's message for its last failed call (any handle, or open()); "" if none.
 * h is accepted for symmetry and may be NULL. Valid until that thread's next call. */
const char* r2ccl_snap_last_error(const r2ccl_snap_t* h);
/* "R2CCL_SNAP_ERR_TIMEOUT", ... ("unknown" for other values). */
const char* r2ccl_snap_strerror(int code);

#ifdef __cplusplus
}
#endif

#endif /* R2CCL_SNAPSHOT_CLIENT_H_ */
