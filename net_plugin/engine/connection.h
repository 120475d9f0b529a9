// Connection: one side of one NCCL connection, over a set of paths on several rails, for
// every transport. It owns, once: requests and sequencing, chunk tracking and replay,
// duplicates and the stale-data guard, the receiver's acknowledgements and landed state,
// failure notices and their acknowledgements, the replay gate of transports that must
// quiesce a failed path at both ends first, recoveries and the "Successfully recovered"
// line, give-up, draining (the failure predictor) and shadow routing (latency outliers),
// failback, and every event line. The transport below (transport/path_io.h) only moves
// bytes and reports events.
//
// Eager messages (PathCaps::eager; docs/ARCHITECTURE.md "Eager messages"): an isend of at
// most the negotiated R2CCL_EAGER_THRESHOLD bytes, with eager credit left, goes at once as one
// chunk without waiting for the CTS; the receiver places it into the posted buffer, or keeps
// it in its bounded eager area until the irecv with its sequence is posted. With
// R2CCL_EAGER_COPY the isend completes once its bytes are copied into an internal request
// that is acknowledged and replayed like any other. The receiver returns credit on its ACKs.
//
// Data flow (receiver-driven): irecv posts a CTS (sequence, capacity, where the buffer is);
// isend needs the CTS with its sequence (NULL request until then); the message is cut into
// chunks of the connection's chunk size; a path takes chunks while its unacknowledged bytes
// are under R2CCL_PATH_WINDOW (stripe off: the primary, or once it cannot carry data every
// survivor; on: every healthy path; among several, the one that would finish the chunk
// first by its measured goodput, engine/goodput.h); a chunk is acknowledged by the receiver's ACK
// (TCP) or by its RC completion (verbs); a send completes when every chunk is acknowledged.
//
// Failure: any detector (transport error, link-down event, the acknowledgement watchdog, the
// heartbeat rule) fails the path exactly once (PathHealth). The detecting end tells the
// other (FAIL, re-sent until FAIL_ACK). The receiver reports what landed (ACK state); the
// sender re-queues the failed path's unacknowledged chunks and sends them again on a
// survivor from the caller's buffer (at once, or once the receiver's FAIL/FAIL_ACK says the
// path is quiet at its end when PathCaps::quiesce_before_replay).
//
// Event lines (log_event: NCCL WARN plus one timestamped line on the event sink), the same
// for both transports; users and scripts parse their prefixes:
//   path on rail R failed (CAUSE[: DETAIL]) at the sending|receiving end of conn ID[; ...]
//   switchover: rail R failed (CAUSE[: DETAIL]); path P of conn ID -> rail R2; N chunks to replay
//   backup path on rail R failed (CAUSE[: DETAIL]); conn ID keeps rail R2
//   Successfully recovered in X s (rail R: CAUSE, detected after D ms, N chunks replayed)
//   failback: rail R is back (path P of conn ID reconnected and passed K probes); ...
//   hold-down: rail R flapped K times within W s; not used for H s
//   shadow routing: rail R probe RTT ...
//   r2ccl predict: the peer drains|no longer drains its end of path P (LABEL) of conn ID: ...
//   give-up: send|recv conn ID on device D (R): WHY; N pending requests fail with RESULT
//
// Threads: isend/irecv/iflush/test on NCCL's proxy thread, progress also on the runtime's
// background thread for connections the proxy thread left idle; whoever holds the progress
// token (try_enter) owns the connection and its transport, the others back off (NULL request
// / not done). reg_mr/dereg_mr (through io()) on NCCL's service thread. Nothing blocks.
// Every entry point takes `now` (microseconds, CLOCK_MONOTONIC) from its caller; the engine
// reads no clock of its own, so unit tests drive it with a manual clock.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "engine/conn_policy.h"
#include "engine/goodput.h"
#include "engine/link_live.h"
#include "engine/path_health.h"
#include "engine/rail_env.h"
#include "engine/recv_message.h"
#include "engine/scheduler.h"
#include "engine/send_message.h"
#include "engine/test_hooks.h"
#include "r2ccl/nccl_abi.h"
#include "r2ccl/params.h"
#include "r2ccl/status.h"
#include "transport/path_io.h"

namespace r2ccl::net {

class Connection;

enum class Role : uint8_t { kSend, kRecv };

// What the process gives every connection.
struct ConnEnv {
  const Config* cfg = nullptr;
  HealthParams health;
  TestHooks hooks;
  RailTable* rails = nullptr;
  // The process's links (engine/link_live.h); null: every path gets a private link.
  LinkTable* links = nullptr;
};

// NCCL's request handle.
struct Request {
  enum class Kind : uint8_t { kSend, kRecv, kFlush };
  Connection* conn = nullptr;
  bool used = false;
  bool done = false;
  Kind kind = Kind::kSend;
  uint64_t seq = 0;
  const char* data = nullptr;  // send: the caller's buffer
  uint64_t size = 0;           // send: bytes; recv: capacity
  void* mhandle = nullptr;
  int tag = 0;
  // sender
  SendMessage smsg;
  RemoteBuffer remote;
  // The paths that may carry this message (bit i = path i): what the sender's registration
  // and the receiver's both allow (PathIo::allowed_paths, RemoteBuffer::allowed).
  uint32_t allowed = kAllPaths;
  // receiver
  RecvMessage rmsg;
  std::vector<uint32_t> dirty_windows;  // windows with chunks not yet acknowledged
  int ack_path = -1;                    // path the latest chunk came on
  int cts_path = -1;                    // path the CTS went on, -1: (re)post it
  bool cts_delivered = false;           // the transport confirmed the CTS arrived
  TimeUs posted_at = 0;                 // when irecv posted it (a small one's CTS waits)
  // flush
  uint64_t flush_token = 0;
  // eager messages (PathCaps::eager, size <= the negotiated threshold)
  bool eager = false;      // sender: sent without a CTS; receiver: arrived so
  bool lazy_ack = false;   // receiver, eager: the sender's request completed, the ACK may wait
  bool internal = false;   // sender: the engine's own copy of a completed eager isend (not
                           // NCCL's), released when acknowledged
  std::vector<char> copy;  // internal: the bytes (data points here)
};

class Connection final : public PathSink {
 public:
  // `io` has finished its setup: its paths are known.
  Connection(const ConnEnv& env, Role role, int dev, std::unique_ptr<PathIo> io, TimeUs now);
  ~Connection() override;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // --- data path (token held) ---
  // OK with *req = NULL means "call again" (no CTS yet, all 32 requests in use).
  Status isend(void* data, uint64_t size, int tag, void* mhandle, Request** req, TimeUs now);
  Status irecv(void* data, uint64_t size, int tag, void* mhandle, Request** req, TimeUs now);
  // *req = NULL when nothing needs flushing (host memory).
  Status iflush(int n, void** data, const int* sizes, void** mhandles, Request** req, TimeUs now);
  // Errors: the connection's error (the request is released then).
  Status test(Request* r, int* done, int* size, TimeUs now);
  void progress(TimeUs now);
  // Best effort, never waits: tells the peer this end closes on purpose.
  // NCCL closed the comm: held acknowledgements go first (the sender's close waits for them),
  // then BYE on every path.
  void say_goodbye(TimeUs now);

  // --- the progress token ---
  bool try_enter() {
    int e = 0;
    return token_.compare_exchange_strong(e, 1, std::memory_order_acquire);
  }
  void leave(TimeUs now) {
    last_progress_.store(now, std::memory_order_relaxed);
    token_.store(0, std::memory_order_release);
  }
  // Leaves without counting as progress (the background thread only looked at it).
  void leave_untouched() { token_.store(0, std::memory_order_release); }
  // What an idle connection waits for (PathIo::wait_fds); false: progress it on every pass
  // (the transport cannot say, or control messages wait for a path). Token held.
  bool wait_fds(std::vector<pollfd>* out) const { return ctrlq_.empty() && io_->wait_fds(out); }
  // An idle connection whose descriptors say what it waits for: when its timers next need a
  // progress pass if nothing arrives (microseconds, the callers' clock), assuming it is also
  // progressed whenever a rail event, a link's verdict or shadow-routing change, or a
  // predicted drain happens in the process (RuntimeBase). 0: it has work under way (requests,
  // notices, a failed, probing or reconnecting path, chunks in flight): progress it every
  // RuntimeBase::kIdleTick as before. Token held.
  TimeUs idle_due(TimeUs now) const;
  TimeUs last_progress() const { return last_progress_.load(std::memory_order_relaxed); }

  PathIo& io() { return *io_; }
  uint64_t id() const { return id_; }
  Role role() const { return role_; }
  int dev() const { return dev_; }
  int npaths() const { return static_cast<int>(paths_.size()); }
  PathState path_state(int i) const { return paths_[i].health->state(); }
  Status error() const { return error_; }
  size_t pending_requests() const { return active_.size(); }
  // Sender: eager messages whose isend completed (R2CCL_EAGER_COPY) and that the receiver has
  // not acknowledged yet. The closing side progresses until there are none (token held).
  bool eager_unacked() const;
  // The negotiated eager threshold in use (bytes, 0: off) and the eager area's size (bytes
  // of credit), the same at both ends.
  uint64_t eager_threshold() const { return eager_thr_; }
  uint64_t eager_area() const { return eager_area_; }

  // --- PathSink ---
  void on_path_alive(int path, TimeUs now) override;
  void on_cts(uint64_t seq, uint64_t capacity, const RemoteBuffer& remote, TimeUs now) override;
  void on_chunk_acked(int path, uint64_t seq, uint32_t idx, TimeUs now) override;
  ChunkPlace on_chunk_header(int path, const ChunkHeader& h, TimeUs now) override;
  bool chunk_wanted(const ChunkPlace& place) const override;
  void on_chunk_read(int path, const ChunkPlace& place, bool clean, TimeUs now) override;
  void on_chunk_placed(int path, uint64_t seq_low, int seq_bits, uint32_t idx, uint32_t len,
                       bool last, TimeUs now) override;
  void on_cts_delivered(uint64_t seq, TimeUs now) override;
  void on_ctrl(int path, const CtrlMsg& m, TimeUs now) override;
  void on_path_error(int path, FailCause cause, const char* detail, TimeUs now) override;
  void on_probe_ok(int path, TimeUs now, TimeUs sent_at) override;
  void on_reconnected(int path, TimeUs now) override;
  void on_reconnect_failed(int path, bool refused, const char* detail, TimeUs now) override;
  void on_peer_address(int path, TimeUs now) override;
  void on_peer_bye(TimeUs now) override;
  void on_peer_gone(const char* evidence, TimeUs now) override;
  void on_fatal(Status st, const char* why, TimeUs now) override;
  int control_path() const override { return control_path(-1); }
  bool traffic_in_flight(int path) const override;

 private:
  struct Path {
    int index = 0;
    int rail = 0;
    std::string label;
    std::unique_ptr<PathHealth> health;
    uint64_t inflight_bytes = 0;  // sender: posted, not acknowledged
    TimeUs ack_progress = 0;      // last acknowledgement, or when the path turned busy
    TimeUs last_alive = 0;        // anything received on the path
    TimeUs last_probe = 0;
    TimeUs probe_sent = 0;
    bool probe_out = false;
    bool probe_idle = false;  // nothing was in flight when the probe left: a clean RTT
    // The latest probes: when each left and whether it was idle (answers that name their probe,
    // PathSink::on_probe_ok's sent_at, give RTTs even when the RTT exceeds the period).
    struct SentProbe {
      TimeUs at = 0;
      bool idle = false;
    };
    SentProbe sent[8];
    uint32_t sent_next = 0;
    uint32_t down_seen = 0;
    uint32_t up_seen = 0;
    uint32_t addr_seen = 0;  // RailLive::addr_events last handled
    bool counted_failed = false;
    bool gate_pending = false;  // sender: replay waits for the receiver's FAIL / FAIL_ACK
    bool reconnecting = false;  // sender: PathIo::reconnect in progress
    bool refused = false;       // sender: the latest reconnect was refused
    bool unreachable = false;   // sender: the latest reconnect failed for another reason
    // A failure the peer's end caused (end of file, reset, protocol error) is not charged to
    // the rail (failed_paths, paths_failed, switchovers) until the peer shows it is alive: a
    // dead peer process is not a bad rail.
    bool charge_pending = false;
    TimeUs failed_at = 0;
    uint32_t pending_switchovers = 0;
    bool peer_drain = false;  // sender: the receiver's node drains its end
    bool drain_sent = false;  // receiver: the drain state last told to the sender
    uint64_t chunks_sent = 0;
    // sender: the scheduler's goodput estimate (engine/goodput.h), what of it this path has
    // published into its rail's process-wide load (kbit/s), and its latest chunk
    PathGoodput goodput;
    uint64_t published_kbps = 0;
    TimeUs last_send = 0;
    // The link the path runs over (engine/link_live.h), the key it was taken with, the path's
    // id as the link's prober, since when it probes for the link, and the verdicts seen.
    std::shared_ptr<LinkLive> link;
    uint64_t link_key = 0;
    uint64_t link_id = 0;
    TimeUs prober_since = 0;
    uint32_t verdicts_seen = 0;
    // A verdict found the path alive within its last period: since when it must show new
    // life (0: no such watch), and its last sign of life then.
    TimeUs verdict_at = 0;
    TimeUs alive_at_verdict = 0;
  };
  struct Notice {
    uint64_t id;
    int path;
    uint32_t gen;
    TimeUs sent_at;
    FailCause cause;
  };
  // "My rail's address changed / it is usable again" (kAddr), re-sent every 2 heartbeat
  // periods until the peer's kAddrAck with its id.
  struct AddrNotice {
    uint64_t id;
    int rail;
    TimeUs sent_at;
  };
  struct Recovery {
    int path;
    FailCause cause;
    std::string detail;
    TimeUs detect;
    double detect_ms;
    bool carried;  // the path carried data when it failed
    int replayed;
    std::vector<uint64_t> seqs;
  };
  struct PendingCtrl {
    CtrlMsg m;
    int prefer;
  };
  struct Cts {
    uint64_t seq;
    uint64_t cap;
    RemoteBuffer remote;
  };
  struct Done {
    uint64_t seq;
    uint32_t nchunks;
  };
  // Receiver: an eager message that arrived before its irecv (the eager area).
  struct EagerEntry {
    uint64_t seq = 0;
    uint64_t total = 0;
    bool landed = false;    // every byte is in `data` (and it was acknowledged)
    bool lazy_ack = false;  // ChunkHeader::lazy_ack of the copy that created it
    std::vector<char> data;
  };

  // paths
  bool usable(const Path& p) const;
  bool any_usable() const;
  // Sender: the first pending message none of whose allowed paths is usable, or nullptr.
  const Request* stranded() const;
  int control_path(int prefer) const;
  int first_carrier() const;
  std::string rail_name(int rail) const;
  RailLive& live(const Path& p) { return env_.rails->live(p.rail); }
  void check_paths(TimeUs now);
  // The path's link (PathIo::link_key), taken at setup and again after a reconnect whose key
  // changed; verdicts posted before now are not the path's.
  void attach_link(Path& p);
  // Path p probes for its link: it is the prober, or becomes it (none, the prober stopped
  // probing for 3 heartbeat periods, or p sends and the prober receives).
  bool link_prober(Path& p, TimeUs now);
  void resign_prober(Path& p);
  // The heartbeat rule for p's link, p being its prober; the link's verdict for p. True when
  // p failed.
  bool check_link(Path& p, bool stalled, TimeUs now);
  bool follow_verdict(Path& p, TimeUs now);
  void fail_path(Path& p, FailCause cause, const char* detail, TimeUs now);
  void open_gate(Path& p, TimeUs now);
  void mark_recovered(Path& p);
  // Rail accounting of a failure: at once, or once the peer is known alive (charge_pending).
  void charge_rail(Path& p);
  void settle_charges(TimeUs now);
  // The peer process is known gone: every path failed with the peer's end of file, reset or
  // protocol error or cannot be reached from here, and a reconnect was refused (nothing
  // listens on the peer's rails), or the transport saw the process end.
  bool peer_known_gone() const;
  // The peer process is paused (every path silent, its machine heard): no path is failed.
  bool peer_stalled(TimeUs now) const;
  // "ADDR (rail NAME)" of the peer as the transport knows it, for give-up lines.
  std::string peer_text() const;
  // control traffic
  void queue_ctrl(const CtrlMsg& m, int prefer = -1);
  void flush_ctrl(TimeUs now);
  void queue_recv_state(int prefer);
  void send_notice(const Notice& n);
  void resend_notices(TimeUs now);
  // Tells the peer that local rail `rail` has a new address or is usable again (only where
  // PathCaps::address_notices); supersedes an unanswered notice for the same rail.
  void announce_rail(int rail, TimeUs now);
  // What the rail's link and address events mean for path p (check_paths).
  void check_rail_events(Path& p, TimeUs now);
  // sender
  void schedule_chunks(TimeUs now);
  // The path's goodput estimate into its rail's load (publish), or out of it (withdraw:
  // the path is idle, failed or closing).
  void publish_goodput(Path& p, TimeUs now);
  void withdraw_goodput(Path& p, TimeUs now);
  void on_ack(uint64_t seq, uint32_t prefix, uint32_t base, uint64_t bitmap, TimeUs now);
  void finish_send_if_complete(Request* r);
  void check_recoveries(TimeUs now);
  // receiver
  void post_ctss(TimeUs now);
  void send_acks();
  // Receiver: a receive of `capacity` bytes expects its message eagerly (no CTS at once).
  bool expects_eager(uint64_t capacity) const { return eager_thr_ > 0 && capacity <= eager_thr_; }
  // Receiver: acknowledgements of consumed eager messages whose senders completed on their
  // copy wait (held_acks_) and go together, with other control traffic, or after
  // kAckHold, or once they return half the eager area's credit; `force`: now.
  void release_acks(TimeUs now, bool force);
  void tell_drains();
  void landed(Request* r, int path, uint32_t idx, TimeUs now);
  void mark_dirty(Request* r, uint32_t idx, int path);
  // end of the connection
  void give_up(Status st, const std::string& why, TimeUs now);
  void check_give_up(TimeUs now);
  void closing_progress(TimeUs now);
  Status peer_closed_error();
  // eager messages
  bool eager_fits(uint64_t size) const;
  Request* free_shadow();
  EagerEntry* find_entry(uint64_t seq);
  ChunkPlace place_in_area(int path, const ChunkHeader& h, TimeUs now);
  // A landed area entry meets its posted receive (if any): copied, the receive lands, the
  // entry is freed. Otherwise it is acknowledged as stored (first time only).
  void deliver_eager(EagerEntry* e, int path, TimeUs now);
  void erase_entry(uint64_t seq);
  // The receive's eager message does not fit its capacity: the connection fails (truncation).
  void eager_truncated(uint64_t seq, uint64_t size, uint64_t capacity, TimeUs now);
  // requests
  Request* free_request();
  Request* find_active(uint64_t seq);
  const Request* find_active(uint64_t seq) const;
  void release(Request* r);
  void remove_active(Request* r);

  ConnEnv env_;
  const Config& cfg_;
  Role role_;
  int dev_;
  std::unique_ptr<PathIo> io_;
  PathCaps caps_;
  uint64_t id_ = 0;
  uint64_t chunk_ = 0;
  std::vector<Path> paths_;
  std::atomic<int> token_{0};
  std::atomic<TimeUs> last_progress_{0};

  Request reqs_[NCCL_NET_MAX_REQUESTS];
  std::deque<Request*> active_;  // posted, not complete, in sequence order
  std::deque<Cts> cts_;          // sender: CTS not yet matched, in sequence order
  uint64_t next_send_seq_ = 0;
  uint64_t next_recv_seq_ = 0;
  // eager messages (0: off)
  uint64_t eager_thr_ = 0;
  uint64_t eager_area_ = 0;
  uint64_t eager_sent_ = 0;        // sender: credit spent, cumulative (bytes)
  uint64_t eager_freed_seen_ = 0;  // sender: credit the receiver returned, cumulative
  std::vector<std::unique_ptr<Request>> shadows_;  // sender: internal requests (pool)
  std::vector<std::unique_ptr<EagerEntry>> area_;  // receiver: the eager area
  std::vector<std::unique_ptr<EagerEntry>> spare_entries_;
  uint64_t area_used_ = 0;    // receiver: credit held by area_ (bytes)
  uint64_t eager_freed_ = 0;  // receiver: credit of consumed eager messages, cumulative
  std::deque<Done> history_;  // receiver: recently completed receives
  std::deque<PendingCtrl> ctrlq_;
  std::vector<PendingCtrl> held_acks_;  // receiver: see release_acks
  TimeUs held_since_ = 0;
  uint64_t held_credit_ = 0;
  std::deque<Notice> notices_;
  uint64_t next_notice_ = 1;
  std::deque<AddrNotice> addr_notices_;
  std::vector<Recovery> recoveries_;
  std::vector<Recovery> gated_;  // sender: failures whose replay waits for the gate
  std::vector<PathLoad> loads_;  // schedule_chunks scratch

  GiveUpTimer give_up_timer_;
  Status error_ = Status::kOk;
  bool gave_up_ = false;
  bool peer_closed_ = false;  // the peer sent BYE
  TimeUs bye_at_ = 0;
  bool peer_gone_ = false;  // the transport saw the peer's process end
  std::string peer_gone_why_;
  TimeUs last_check_ = 0;
  TimeUs last_recv_done_ = 0;  // receiver: when a receive last completed (0: never)
  friend class ConnectionTestPeer;
};

}  // namespace r2ccl::net
