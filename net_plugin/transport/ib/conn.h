// ib::Conn: the verbs transport's side of one NCCL connection (a PathIo under
// engine::Connection). A path is R2CCL_IB_QPS_PER_PATH RC QPs on one HCA port with its own
// CQ, connected to the peer's QPs on the HCA the path plan paired it with.
//
// What it does, and nothing more:
//  - setup over the TCP side channel (HELLO / REPLY / READY / DONE, wire.h): candidate HCAs,
//    pairing, QP numbers, the connection areas; both ends' QPs are in RTS before either
//    returns the comm. The side channel stays open: control messages when no RDMA path is
//    usable, BYE, and its end-of-file without BYE says the peer process is gone;
//  - data: the receiver's CTS record is an RDMA WRITE into slot seq % 64 of the sender's
//    FIFO (seq1 last, polled here); chunks are RDMA WRITE WITH IMMEDIATE straight into the
//    posted buffer (adaptive routing: a plain write, then a 0-byte write with immediate; the
//    last chunk also writes the size into the receiver's area first); a chunk is
//    acknowledged by its successful RC completion; control messages are RDMA SENDs on QP 0;
//  - probes are 0-byte RDMA writes; a path stops by moving its QPs to ERR (both ends, the
//    engine's quiesce gate); a failed path is re-created (REBUILD / REBUILD_ACK, then
//    REBUILD_DONE once the sender's probes passed);
//  - completions: success of a chunk write = acknowledged; retry-exceeded, RNR-retry-exceeded
//    and flush = the path failed; any other error (remote access, local protection) is fatal;
//  - memory registration on every HCA of the path set (with the runtime's MR caches), and
//    the GPU flush (iflush): a 1-byte RDMA READ through a QP connected to itself, on every
//    HCA that landed data since the last flush.
//
// Threads: as engine::Connection (the progress token holder drives it); reg_mr/dereg_mr on
// NCCL's service thread (the MR caches lock).
#pragma once

#include <atomic>
#include <deque>
#include <string>
#include <vector>

#include "engine/connection.h"
#include "sock/sock_errors.h"
#include "transport/ib/pairing.h"
#include "transport/ib/runtime.h"
#include "transport/ib/wire.h"
#include "transport/transport.h"

namespace r2ccl::net::ib {

// A registration handle (NCCL's mhandle): the buffer registered on every HCA of the
// connection's path set that may reach it (a GPU buffer: the primary and the backups within
// NCCL_NET_GDR_LEVEL of its GPU, transport/ib/gdr.h).
struct IbMr {
  std::vector<ibv_mr*> by_hca;  // indexed by runtime HCA index; nullptr where not registered
  // Per HCA: the MR cache the registration came from (cached) and the device incarnation
  // (HcaInfo::epoch) it was made on; an older one is made again on first use (Conn::mr_on).
  std::vector<std::shared_ptr<MrCache>> cache_by_hca;
  std::vector<uint32_t> epoch_by_hca;
  // Per HCA: no registration yet because the device was dead when it was asked for (a fatal
  // error, its reset not done; epoch_by_hca is that incarnation), or making it again after
  // a reopen failed: mr_on makes it for a QP of a later incarnation.
  std::vector<bool> deferred_by_hca;
  uint32_t allowed = kAllPaths;  // paths (bit i = path i) whose HCA holds a registration
  void* data = nullptr;
  size_t size = 0;
  int type = NCCL_PTR_HOST;  // NCCL_PTR_HOST, _CUDA or _DMABUF
  bool cached = true;        // from the MR cache (released), else deregistered directly
};

class Listen final : public Listener {
 public:
  Listen(Runtime* rt, int dev);
  ~Listen() override;
  Runtime* rt;
  int fd = -1;      // side-channel listener
  AcceptGate gate;  // accept4 out of descriptors: paused (service thread)
};

class Conn final : public ConnIo {
 public:
  // Connector (role kSend) from NCCL's handle, or acceptor (kRecv) for `listen`.
  Conn(Runtime* rt, const IbWireHandle& h, int dev, int traffic_class);
  Conn(Runtime* rt, Listen* listen);
  ~Conn() override;

  Status setup_step(bool* done, TimeUs now) override;

  // --- PathIo ---
  PathCaps caps() const override { return PathCaps{false, true}; }
  void poll(PathSink& sink, TimeUs now) override;
  void flush(PathSink& sink, TimeUs now) override;
  bool ready(int path) const override;
  // Send-queue slots: a chunk takes 1 work request (3 with adaptive-routing writes).
  bool has_room(int path) const override;
  TimeUs stall_floor(int path) const override;
  PostResult post_chunk(int path, const ChunkOut& c, PathSink& sink, TimeUs now) override;
  PostResult post_cts(int path, const CtsOut& c, PathSink& sink, TimeUs now) override;
  PostResult post_ctrl(int path, const CtrlMsg& m, PathSink& sink, TimeUs now) override;
  bool probe(int path, PathSink& sink, TimeUs now) override;
  void stop_path(int path, bool from_peer, TimeUs now) override;
  // Drains the path's CQ: what landed before its QPs entered ERR is reported.
  void quiesce(int path, PathSink& sink, TimeUs now) override;
  bool can_reconnect(int path, PathSink& sink) const override;
  void reconnect(int path, PathSink& sink, TimeUs now) override;
  void path_recovered(int path, PathSink& sink, TimeUs now) override;
  void say_goodbye(TimeUs now) override;
  std::string peer_name() const override { return sc_peer_; }
  // (local HCA, the peer's HCA port and GID, the peer process): shared by every connection
  // between the two processes over that HCA pair; 0 while the peer process is unknown.
  uint64_t link_key(int path) const override;
  void abort(TimeUs now) override;
  Status start_flush(int n, void** data, const int* sizes, void** mhandles,
                     uint64_t* token) override;
  int test_flush(uint64_t token, Status* err) override;
  Status reg_mr(void* data, size_t size, int type, void** mhandle) override;
  Status reg_mr_dmabuf(void* data, size_t size, uint64_t offset, int fd, void** mhandle) override;
  void dereg_mr(void* mhandle) override;
  uint32_t allowed_paths(const void* mhandle) const override;

 private:
  struct WrRec {
    uint8_t kind = 0;
    int8_t path = -1;
    uint8_t qp = 0;  // index in Path::qps (its send-queue slot)
    bool used = false;
    uint32_t gen = 0;
    uint64_t seq = 0;
    uint32_t idx = 0;
    int ctrl_slot = -1;
  };
  // A path's label and generation are in PathIo::paths_desc_ (its rail is `hca`).
  struct Path {
    int index = 0;
    int hca = 0;         // local runtime HCA index (the rail)
    uint32_t epoch = 0;  // the HCA's incarnation its QPs and CQ were made on
    IbWireHca peer{};    // the peer's HCA of this path
    ibv_cq* cq = nullptr;
    std::vector<ibv_qp*> qps;
    uint32_t rr = 0;
    int outstanding = 0;  // send WRs not completed
    // Per QP: send WRs posted and not yet completed. A slot is free again only once its
    // completion is polled (mlx5), so a QP takes at most kSqDepth; a full QP is
    // back-pressure (PostResult::kFull), never a dead path.
    std::vector<int> q_out;
    // Receive credits (IbArea::credit_in), per QP of this generation. Sender: receives its
    // immediates and SENDs consumed at the peer. Receiver: receives posted again, and the
    // counts last written to the sender (one credit write in flight at a time).
    std::vector<uint32_t> rq_consumed;
    std::vector<uint32_t> rq_reposted;
    std::vector<uint32_t> rq_published;
    bool credit_in_flight = false;
    bool stopped = false;        // QPs in ERR (or left in RTS by the test hook): out of service
    bool rebuilding = false;     // sender: REBUILD sent, waiting for the answer
    bool awaiting_peer = false;  // receiver: rebuilt, waiting for the sender's REBUILD_DONE
    TimeUs rebuild_deadline = 0;
  };

  Conn(Runtime* rt, Role role, int dev, int traffic_class);
  // setup
  Status connect_step(bool* done, TimeUs now);
  Status accept_step(bool* done, TimeUs now);
  IbSetupMsg setup_msg(SetupType t) const;  // header with this connection's secret
  bool is_setup(const IbSetupMsg& m, SetupType t, const uint8_t* secret) const;
  Status register_area_on(int hca);
  Status register_slots_on(int hca);
  // The connection area's and control slots' MRs on `hca` made again when the device was
  // reopened after a fatal error since they were registered (h.epoch newer).
  Status refresh_area_mrs(const HcaInfo& h, int hca);
  // m's MR on `hca` for a QP of incarnation `epoch`, registered (from the MR cache) if it was
  // made on an older one or deferred; nullptr if m is not for `hca` at all, the QP's
  // incarnation is not newer than a deferred registration's dead one, or (WARN) the new
  // registration failed (a dma-buf buffer cannot be made again: its descriptor is NCCL's).
  ibv_mr* mr_on(const IbMr* m, int hca, uint32_t epoch);
  // Asynchronous QP / CQ errors (Runtime::qp_events_after) on this connection's QPs: their
  // paths fail now, and a loopback flush QP is dropped (made again at the next flush).
  void check_qp_events(PathSink& sink, TimeUs now);
  Status create_path_qps(Path& p);
  Status connect_path_qps(Path& p, const uint32_t* peer_qpn, const IbWireHca& peer);
  void destroy_path_qps(Path& p);
  void qps_to_err(Path& p);
  void fill_wire_hca(int hca, IbWireHca* w);
  // HCA `hca` as one end of a pairing (transport/ib/pairing.h), its current GID and subnet.
  PairEnd local_end(int hca);
  void finish_setup();
  bool sc_write(const void* buf, size_t len);
  int sc_read_exact(void* buf, size_t len, size_t* got);
  // The next setup message from the side channel: 1 read (into *m), 2 the peer's refusal
  // (into *refusal), 0 not yet, -1 closed.
  int read_setup(IbSetupMsg* m, WireRefusal* refusal);
  // Tells the peer why this end ends the setup and closes the side channel.
  void refuse_peer(Refusal r, const std::string& text);
  // Acceptor: refuses a side-channel connection that is not this listen comm's peer (told
  // why unless r is kAborted) and waits for the next.
  void refuse_stranger(Refusal r, const std::string& text);
  // Connector: a failed side-channel connect, classified (sock/sock_errors.h): kOk to retry.
  Status connect_failed(int err, SockOp op, const std::string& text, TimeUs now);
  Status fail_connect(const std::string& why, Status st);
  std::string side_peer() const;  // the side channel's peer address
  void post_recv_slot(Path& p, int q, int k);
  // data path
  int alloc_wr();
  // Posts `wr` (signaled) on QP q of path p; returns the record index, or -1 after telling
  // the sink the path failed.
  int submit(Path& p, int q, const WrRec& rec, ibv_send_wr* wr, PathSink& sink, TimeUs now);
  int post_write(Path& p, int q, uint8_t kind, const void* local, uint32_t len, uint32_t lkey,
                 uint64_t raddr, uint32_t rkey, bool imm, uint32_t immv, uint64_t seq, uint32_t idx,
                 PathSink& sink, TimeUs now);
  void poll_path(Path& p, PathSink& sink, TimeUs now);
  void on_send_wc(Path& p, const ibv_wc& wc, PathSink& sink, TimeUs now);
  void on_recv_wc(Path& p, const ibv_wc& wc, PathSink& sink, TimeUs now);
  void on_wire_ctrl(int via, const IbCtrlMsg& m, PathSink& sink, TimeUs now);
  void poll_fifo(PathSink& sink, TimeUs now);
  void read_side_channel(PathSink& sink, TimeUs now);
  // The backend's own control messages (REBUILD, BYE): on the engine's control path, else
  // the side channel.
  bool send_wire(const IbCtrlMsg& m, PathSink& sink, TimeUs now);
  PostResult send_on(Path& p, const IbCtrlMsg& m, PathSink& sink, TimeUs now);
  IbCtrlMsg wire_msg(WireCtrl t, int path, uint32_t gen) const;
  void on_rebuild(const IbCtrlMsg& m, PathSink& sink, TimeUs now);
  void on_rebuild_ack(const IbCtrlMsg& m, PathSink& sink, TimeUs now);
  void peer_rebuilt(Path& p, PathSink& sink, TimeUs now);
  int chunk_room(const Path& p, int q) const;
  int chunk_qp(const Path& p) const;
  int qp0_room(const Path& p) const;
  int rq_credits(const Path& p, int q) const;
  void publish_credits(Path& p, PathSink& sink, TimeUs now);
  Status make_flush_qp(int hca);
  void drop_flush_qp(int hca);
  bool post_flush_read(int hca, uint64_t token, uintptr_t addr, uint32_t rkey);
  std::string rail_of(const Path& p) const;
  // The paths a GPU buffer at `data` (NCCL_PTR_CUDA / DMABUF) may use: the primary, and each
  // backup whose HCA is within NCCL_NET_GDR_LEVEL of the buffer's GPU (gdr.h); only the
  // primary when the GPU cannot be located. Logs the decision once per connection (INFO;
  // WARN when no backup is left). Service thread (regMr).
  uint32_t gpu_paths(const void* data);
  PathDesc& desc(const Path& p) { return paths_desc_[p.index]; }

  Runtime* rt_;
  const Config& cfg_;
  const VerbsApi& v_;
  Role role_;
  int dev_;
  int tc_;
  Listen* listen_ = nullptr;  // acceptor, during setup
  IbWireHandle handle_{};
  bool ar_ = false;
  int nqps_ = 1;
  std::vector<Path> paths_;

  // connection area and control receive slots, registered on every HCA of the path set
  IbArea* area_ = nullptr;
  std::vector<ibv_mr*> area_mr_;  // by runtime HCA index
  char* slots_ = nullptr;         // control receive buffers
  size_t slots_len_ = 0;
  std::vector<ibv_mr*> slots_mr_;     // by runtime HCA index
  std::vector<uint32_t> area_epoch_;  // by runtime HCA index: incarnation of area/slots MRs
  uint64_t qp_events_seen_ = 0;       // Runtime::qp_event_seq() handled
  uint64_t peer_area_ = 0;
  std::vector<bool> ctrl_slot_busy_;
  uint64_t next_cts_seq_ = 0;  // sender: the next CTS to look for in the FIFO

  std::vector<WrRec> wrs_;
  std::vector<int> free_wrs_;

  // iflush: a READ through every HCA that landed data since the last flush, each on that
  // HCA's QP connected to itself (created at its first flush, re-created after an error).
  // A READ through HCA A orders only A's writes into GPU memory, so data landed by a backup
  // HCA (after a failover, or striping) needs a READ through that HCA.
  struct FlushQp {
    ibv_cq* cq = nullptr;
    ibv_qp* qp = nullptr;
    uint32_t epoch = 0;
  };
  struct FlushRec {
    uint64_t token = 0;
    uintptr_t addr = 0;          // the byte read back
    std::vector<uint32_t> rkey;  // by runtime HCA index
    std::vector<int> pending;    // HCAs whose READ has not completed
    std::vector<int> tries;      // by runtime HCA index: READs posted for this flush
    bool failed = false;
  };
  std::vector<FlushQp> flushq_;  // by runtime HCA index
  std::vector<bool> landed_on_;  // by runtime HCA index: data landed since the last flush
  std::deque<FlushRec> flushes_;
  uint64_t next_flush_ = 1;

  // side channel
  int sc_fd_ = -1;
  std::string sc_peer_;     // the side channel's far end ("ADDR:PORT"), set at setup
  uint64_t peer_proc_ = 0;  // the peer process (IbSetupMsg::proc_id), set at setup
  std::vector<char> sc_out_;
  char sc_in_[sizeof(IbSetupMsg)];
  size_t sc_got_ = 0;
  bool bye_seen_ = false;
  bool engaged_ = false;      // setup: both ends are committed (HELLO sent / a valid one taken)
  bool peer_told_ = false;    // setup: the peer was told why it ends, or told us
  TimeUs refused_since_ = 0;  // connector: its side-channel connects are refused since then
  TimeUs retry_at_ = 0;       // connector: the next side-channel connect, after a failure
  TimeUs backoff_ = 0;

  // setup state
  int stage_ = 0;
  TimeUs setup_start_ = 0;
  uint8_t secret_[16] = {};
  uint64_t listen_id_ = 0;
  std::vector<int> candidates_;          // connector: its HCAs in preference order
  std::atomic<bool> gdr_logged_{false};  // gpu_paths' decision was logged
};

}  // namespace r2ccl::net::ib
