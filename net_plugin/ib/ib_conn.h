// One side of one NCCL connection over the verbs transport: a path set (primary HCA port plus
// preheated backups), each path with R2CCL_IB_QPS_PER_PATH RC QPs in RTS and its own CQ.
//
// Data flow (receiver-driven, the multipath engine's model):
//  - irecv writes a CtsRecord (buffer address, capacity, the buffer's rkey on every path's
//    HCA) into the sender's FIFO slot by RDMA WRITE on a healthy path;
//  - isend waits for the matching CTS (NULL request until then), then the scheduler puts each
//    chunk on a path as RDMA WRITE WITH IMMEDIATE straight into the posted buffer; a chunk is
//    acknowledged by its successful RC completion;
//  - the receiver counts chunk arrivals from receive completions (RecvMessage::check_placed),
//    duplicates counted once.
//
// Failure (bilateral, lossless):
//  - detection: IBV_EVENT_PORT_ERR on the path's port; a completion with retry-exceeded or
//    flush status (other error statuses are fatal and fail the requests, never a failover);
//    the engine's acknowledgement watchdog on busy paths; 0-byte RDMA-write probes on idle
//    and backup paths (a probe outstanding past R2CCL_ACK_TIMEOUT fails the path);
//  - the end that detects moves its QPs of the path to ERR and tells the other end (FAIL,
//    on a surviving path or the side channel); the receiver moves its QPs to ERR, drains the
//    path's CQ, sends its landed-chunk state (ACK_STATE) and only then FAIL / FAIL_ACK. The
//    sender replays the chunks still unacknowledged only after that, so no late write of the
//    failed path can land in a buffer that NCCL already got back, and no replayed chunk is a
//    duplicate of one the receiver already completed;
//  - failback: once the local port is active and the hold-down/backoff allow, the sender
//    re-creates the path's QPs and asks the receiver to do the same (REBUILD); the path
//    carries data again after R2CCL_PROBE_COUNT probes pass.
//
// Threads: as the TCP transport. connect/accept/close on NCCL's service thread;
// isend/irecv/test on its proxy thread; the runtime's background thread progresses idle
// connections. The progress token (try_enter) serialises them; nothing blocks.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "engine/conn_policy.h"
#include "engine/path_health.h"
#include "engine/recv_message.h"
#include "engine/scheduler.h"
#include "engine/send_message.h"
#include "ib/ib_runtime.h"
#include "ib/ib_wire.h"
#include "r2ccl/nccl_abi.h"

namespace r2ccl::net::ib {

class IbConn;

// A registration handle (NCCL's mhandle): the buffer registered on every HCA of the
// connection's path set.
struct IbMr {
  std::vector<ibv_mr*> by_hca;  // indexed by runtime HCA index; nullptr where not registered
  void* data = nullptr;
  size_t size = 0;
  int type = NCCL_PTR_HOST;  // NCCL_PTR_HOST, _CUDA or _DMABUF
  bool cached = true;        // from the MR cache (released), else deregistered directly
};

struct IbRequest {
  IbConn* conn = nullptr;
  bool used = false;
  bool send = false;
  bool done = false;
  uint64_t seq = 0;
  const char* data = nullptr;
  uint64_t size = 0;  // send: bytes; recv: capacity
  IbMr* mr = nullptr;
  // sender
  SendMessage smsg;
  CtsRecord cts{};
  // receiver
  RecvMessage rmsg;
  int tag = 0;            // NCCL's tag, carried in the CTS record
  int cts_path = -1;      // path whose CTS write is outstanding, -1 = not posted
  bool cts_acked = false;
  // flush (iflush): an RDMA READ through the loopback QP, done at its completion
  bool flush = false;
};

enum class IbRole { kSend, kRecv };

class IbListen {
 public:
  IbListen(IbRuntime* rt, int dev);
  ~IbListen();
  IbRuntime* rt;
  int dev;
  int fd = -1;  // side-channel listener
  uint64_t listen_id = 0;
  uint8_t secret[16];
  std::unique_ptr<IbConn> building;
};

class IbConn {
 public:
  IbConn(IbRuntime* rt, IbRole role, int dev, int traffic_class);
  ~IbConn();

  // --- setup (service thread) ---
  Status connect_step(const IbWireHandle& h, bool* done);
  Status accept_step(IbListen* l, bool* done);

  // --- memory (service thread, concurrently with the data path) ---
  Status reg_mr(void* data, size_t size, int type, IbMr** out);
  // DMA-BUF registration (ibv_reg_dmabuf_mr) on every HCA of the path set; fd is NCCL's and
  // stays NCCL's (it closes it after the call). Not cached.
  Status reg_mr_dmabuf(void* data, size_t size, uint64_t offset, int fd, IbMr** out);
  void dereg_mr(IbMr* mr);

  // --- data path (proxy thread, token held) ---
  Status isend(void* data, uint64_t size, IbMr* mr, IbRequest** req);
  Status irecv(void* data, uint64_t size, int tag, IbMr* mr, IbRequest** req);
  Status test(IbRequest* r, int* done, int* size);
  // GPU receives: makes the NIC's writes visible to the GPU with a 1-byte RDMA READ of the
  // last buffer through a QP connected to itself (the read's completion orders after the
  // writes). *req = NULL when no buffer needs it (host memory). Receiver side only.
  Status iflush(int n, void** data, const int* sizes, IbMr** mrs, IbRequest** req);

  bool try_enter() {
    int e = 0;
    return token_.compare_exchange_strong(e, 1, std::memory_order_acquire);
  }
  void leave() {
    last_progress_.store(now_us(), std::memory_order_relaxed);
    token_.store(0, std::memory_order_release);
  }
  TimeUs last_progress() const { return last_progress_.load(std::memory_order_relaxed); }
  void progress(TimeUs now);
  // Best effort, non-blocking: tells the peer this end closes on purpose.
  void say_goodbye();

 private:
  struct WrRec {
    uint8_t kind = 0;
    int8_t path = -1;
    bool used = false;
    uint32_t gen = 0;
    IbRequest* req = nullptr;
    uint64_t seq = 0;
    uint32_t idx = 0;
    uint32_t len = 0;
    int ctrl_slot = -1;
    TimeUs posted = 0;
    bool idle_probe = false;
  };
  struct Path {
    int index = 0;
    int hca = 0;              // local runtime HCA index
    IbWireHca peer{};         // the peer's HCA of this path
    std::string label;
    std::unique_ptr<PathHealth> health;
    ibv_cq* cq = nullptr;
    std::vector<ibv_qp*> qps;
    std::vector<uint32_t> peer_qpn;
    uint32_t gen = 0;
    uint32_t rr = 0;
    uint64_t inflight_bytes = 0;
    int outstanding = 0;      // send WRs not completed
    TimeUs ack_progress = 0;  // last completion, or when the path turned busy
    TimeUs last_probe = 0;
    bool probe_out = false;
    uint32_t port_err_seen = 0;
    bool counted_failed = false;
    bool gate_pending = false;  // sender: replay waits for the receiver's FAIL/FAIL_ACK
    bool rebuilding = false;
    bool awaiting_peer = false;  // receiver: rebuilt, waiting for the sender's REBUILD_DONE
    TimeUs rebuild_deadline = 0;
    std::vector<uint32_t> new_qpn;  // rebuild: QPs created, not yet connected
    uint64_t chunks_sent = 0;
    bool peer_drain = false;  // sender: the receiver's end is drained by its predictor (kDrain)
    bool drain_sent = false;  // receiver: the drain state last told to the sender
  };
  struct Notice {
    uint64_t id;
    int path;
    uint32_t gen;
    TimeUs sent_at;
  };
  struct Recovery {
    int path;
    FailCause cause;
    TimeUs detect;
    TimeUs silent;  // since the path's last completion, at detection
    int replayed;
    std::string rail;
  };

  // setup helpers
  IbSetupMsg setup_msg(SetupType t) const;  // header with this connection's secret
  static bool is_setup(const IbSetupMsg& m, SetupType t, const uint8_t* secret);
  Status register_area_on(int hca);
  Status create_path_qps(Path& p);
  Status connect_path_qps(Path& p, const uint32_t* peer_qpn, const IbWireHca& peer);
  void destroy_path_qps(Path& p);
  void fill_wire_hca(int hca, IbWireHca* w);
  bool sc_write(const void* buf, size_t len);
  int sc_read_exact(void* buf, size_t len, size_t* got);
  // The next setup message from the side channel: 1 read (into *m), 0 not yet, -1 closed.
  int read_setup(IbSetupMsg* m);
  void setup_complete(TimeUs now);
  void post_recv_slot(Path& p, int q, int k);
  // data path
  int alloc_wr();
  // successes_only: after the peer's BYE, take what already landed and ignore the errors of
  // its teardown.
  void poll_path(Path& p, TimeUs now, bool successes_only = false);
  void on_send_wc(Path& p, const ibv_wc& wc, TimeUs now);
  void on_recv_wc(Path& p, const ibv_wc& wc, TimeUs now);
  void on_chunk(Path& p, uint32_t imm, uint32_t len, TimeUs now);
  void on_ctrl(Path* via, const IbCtrlMsg& m, TimeUs now);
  // Posts `wr` (signaled) on QP q of path p with a work-request record built from `rec`;
  // returns the record index, or -1 after failing the path.
  int submit(Path& p, int q, const WrRec& rec, ibv_send_wr* wr, TimeUs now);
  // Posts one signaled RDMA WRITE (with immediate when `imm`); returns its work-request
  // record index, or -1 (the path was failed).
  int post_write(Path& p, int q, uint8_t kind, const void* local, uint32_t len, uint32_t lkey,
                  uint64_t raddr, uint32_t rkey, bool imm, uint32_t immv, IbRequest* req,
                  uint64_t seq, uint32_t idx, TimeUs now);
  void schedule_chunks(TimeUs now);
  void pick_up_cts();
  void post_ctss(TimeUs now);
  void tell_drains();
  void check_paths(TimeUs now);
  void fail_path(Path& p, FailCause cause, TimeUs now, const char* detail, bool from_peer);
  void open_gate(Path& p, TimeUs now);
  void queue_ctrl(const IbCtrlMsg& m);
  void queue_state_then(const IbCtrlMsg& last);
  void send_notice(const Notice& n);  // FAIL for a path this end declared failed
  void flush_ctrl(TimeUs now);
  void read_side_channel(TimeUs now);
  void start_rebuild(Path& p, TimeUs now);
  void on_rebuild(const IbCtrlMsg& m, TimeUs now);
  void on_rebuild_ack(const IbCtrlMsg& m, TimeUs now);
  void peer_rebuilt(Path& p, TimeUs now);
  void check_recoveries(TimeUs now);
  void give_up(Status st, const char* why);
  Status make_flush_qp();
  int control_path() const;
  std::string rail_of(const Path& p) const;
  bool any_usable() const;
  IbRequest* free_request();
  IbRequest* find_send(uint64_t seq);
  IbRequest* find_recv_seq7(uint32_t seq7);
  void finish_request(IbRequest* r);

  IbRuntime* rt_;
  const Config& cfg_;
  const VerbsApi& v_;
  IbRole role_;
  int dev_;
  int tc_;
  bool ar_ = false;
  uint64_t chunk_ = 0;
  int nqps_ = 1;
  std::vector<Path> paths_;
  std::atomic<int> token_{0};
  std::atomic<TimeUs> last_progress_{0};
  Status error_ = Status::kOk;
  bool gave_up_ = false;
  GiveUpTimer give_up_timer_;

  // connection area and control receive slots, registered on every HCA of the path set
  IbArea* area_ = nullptr;
  std::vector<ibv_mr*> area_mr_;   // by runtime HCA index
  char* slots_ = nullptr;          // control receive buffers
  size_t slots_len_ = 0;
  std::vector<ibv_mr*> slots_mr_;  // by runtime HCA index
  uint64_t peer_area_ = 0;
  std::vector<bool> ctrl_slot_busy_;
  std::deque<IbCtrlMsg> ctrlq_;

  std::vector<PathLoad> loads_;  // schedule_chunks scratch
  std::vector<WrRec> wrs_;
  std::vector<int> free_wrs_;

  IbRequest reqs_[NCCL_NET_MAX_REQUESTS];
  std::deque<IbRequest*> active_;  // posted, not completed, in sequence order
  uint64_t next_send_seq_ = 0;
  uint64_t next_recv_seq_ = 0;
  std::deque<std::pair<uint64_t, uint32_t>> history_;  // receiver: recently completed (seq, nchunks)

  std::deque<Notice> notices_;
  uint64_t next_notice_ = 1;
  std::vector<Recovery> recoveries_;

  // iflush: a QP on the primary HCA connected to itself (created at the first flush)
  ibv_cq* flush_cq_ = nullptr;
  ibv_qp* flush_qp_ = nullptr;

  // side channel
  int sc_fd_ = -1;
  std::vector<char> sc_out_;
  char sc_in_[sizeof(IbSetupMsg)];
  size_t sc_got_ = 0;
  bool peer_gone_ = false;    // side channel ended without BYE
  bool peer_closed_ = false;  // BYE received
  TimeUs bye_at_ = 0;

  // setup state
  int stage_ = 0;
  TimeUs setup_start_ = 0;
  uint8_t secret_[16] = {};
  uint64_t listen_id_ = 0;
  std::vector<int> candidates_;  // connector: its HCAs in preference order
  IbSetupMsg msg_{};
  friend class IbListen;
};

}  // namespace r2ccl::net::ib
