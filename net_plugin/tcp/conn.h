// One side of one NCCL connection over the multipath TCP transport: a set of paths (primary
// on the NCCL device's rail, preheated backups on other rails), each with one or more TCP
// streams bound to its rail.
//
// Data flow (receiver-driven): irecv sends a CTS (sequence, capacity); isend needs the
// matching CTS; the message goes as chunks (40-byte header + payload, read straight into the
// posted buffer); the receiver acknowledges chunks cumulatively per message (prefix +
// 64-chunk bitmap) on any healthy path; a send completes only when every chunk is
// acknowledged. When a path fails, its unacknowledged chunks are replayed on a survivor from
// the caller's buffer and the other end is told with an acknowledged FAIL notice.
//
// Threads: connect/accept/close run on NCCL's service thread; isend/irecv/test on its proxy
// thread; the runtime's background thread progresses idle connections. Whoever holds the
// progress token (try_enter) owns the sockets; the others back off (NULL request / not done)
// instead of waiting. Nothing here blocks.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../engine/conn_policy.h"
#include "../engine/path_health.h"
#include "../engine/recv_message.h"
#include "../engine/scheduler.h"
#include "../engine/send_message.h"
#include "r2ccl/nccl_abi.h"
#include "r2ccl/status.h"
#include "runtime.h"
#include "wire.h"

namespace r2ccl::net {

class Conn;

struct Request {
  Conn* conn = nullptr;
  bool used = false;
  bool send = false;
  bool done = false;
  uint64_t seq = 0;
  const char* data = nullptr;  // send: caller's buffer
  uint64_t size = 0;           // send: bytes; recv: capacity
  SendMessage smsg;
  RecvMessage rmsg;
  std::vector<uint32_t> dirty_windows;  // recv: windows with chunks not yet acknowledged
  int ack_path = -1;                    // recv: path the latest chunk came on
};

struct OutFrame {
  FrameHeader h{};
  const char* payload = nullptr;
  std::vector<char> owned;  // control payloads
  TimeUs not_before = 0;    // injected send delay
  bool data = false;
  uint32_t gen = 0;         // path generation the frame was queued for
};

struct Stream {
  int fd = -1;
  std::deque<OutFrame> ctrlq;
  std::deque<OutFrame> dataq;
  bool cur_active = false;
  bool cur_ctrl = false;
  size_t cur_off = 0;
  // reader
  FrameHeader rh{};
  size_t rh_got = 0;
  bool in_payload = false;
  uint64_t p_left = 0;
  uint64_t p_done = 0;
  Request* p_req = nullptr;  // DATA being written into a posted buffer (nullptr: discard)
  uint32_t p_idx = 0;
  bool p_clean = true;       // every byte so far went into the posted buffer
  // TCP_INFO counters already added to the rail's totals (the failure predictor's retransmit
  // signal); a new socket starts from 0.
  uint32_t tcpi_retrans = 0;
  uint32_t tcpi_segs_out = 0;
};

struct Handshake {
  int fd = -1;
  int path = 0;
  int stream = 0;
  int stage = 0;  // 0 connecting, 1 sending hello, 2 reading hello-ack
  TimeUs deadline = 0;
  std::vector<char> out;
  size_t off = 0;
  char in[sizeof(FrameHeader) + sizeof(HelloBody)];
  size_t got = 0;
  int err = 0;
  std::string what;
};

struct Path {
  int index = 0;
  int local_rail = 0;
  int peer_rail = 0;
  std::string label;  // "lo@127.0.0.1 -> lo@127.0.0.2"
  std::unique_ptr<PathHealth> health;
  std::vector<Stream> streams;
  uint32_t generation = 0;
  uint32_t rr = 0;
  uint64_t inflight_bytes = 0;
  TimeUs ack_progress = 0;
  TimeUs last_rx = 0;
  TimeUs last_tx = 0;
  uint64_t ping_id = 0;
  TimeUs ping_sent = 0;
  bool ping_outstanding = false;
  bool ping_sent_idle = false;  // nothing was in flight when the ping left: a clean RTT sample
  uint32_t down_seen = 0;
  uint32_t up_seen = 0;
  uint32_t reset_seen = 0;
  bool counted_failed = false;
  bool refused = false;  // connector: the latest reconnect was refused (nothing listens)
  std::vector<Handshake> reconnect;  // connector side
  int attached = 0;                  // acceptor side: streams attached in this generation
  uint64_t chunks_sent = 0;
  bool peer_drain = false;  // sender: the peer's end of this path is drained (kFlagDrained)
  // Every stream of the path has a socket.
  bool attached_ok() const {
    if (streams.empty()) return false;
    for (const auto& s : streams)
      if (s.fd < 0) return false;
    return true;
  }
};

class ListenComm {
 public:
  ListenComm(Runtime* rt, int dev);
  ~ListenComm();
  Runtime* rt;
  int dev;
  uint64_t listen_id = 0;
  uint8_t secret[16];
  std::mutex inbox_mu;
  std::vector<Incoming> inbox;  // guarded by inbox_mu
  std::unique_ptr<Conn> building;
  TimeUs first_accept = 0;
};

enum class Role { kSend, kRecv };

class Conn {
 public:
  Conn(Runtime* rt, Role role, int dev);
  ~Conn();

  // --- setup (service thread) ---
  // Connector: returns kOk with *done=false while still connecting.
  Status connect_step(const WireHandle& h, bool* done);
  // Acceptor: feeds an authenticated incoming stream; returns kOk with *done when complete.
  Status accept_step(ListenComm* l, bool* done);

  // --- data path (proxy thread) ---
  Status isend(void* data, uint64_t size, Request** req);
  Status irecv(void* data, uint64_t size, Request** req);
  Status test(Request* r, int* done, int* size);

  // --- any thread holding the token ---
  bool try_enter() {
    int e = 0;
    return token_.compare_exchange_strong(e, 1, std::memory_order_acquire);
  }
  void leave() {
    last_progress_.store(now_us(), std::memory_order_relaxed);
    token_.store(0, std::memory_order_release);
  }
  void progress(TimeUs now);
  TimeUs last_progress() const { return last_progress_.load(std::memory_order_relaxed); }

  // Background thread: a reconnected stream for this connection (acceptor side).
  void push_incoming(Incoming in);
  uint64_t id() const { return conn_id_; }
  const uint8_t* secret() const { return secret_; }
  Role role() const { return role_; }
  void close_all();
  // Tells the peer, best effort and without waiting, that this end closes on purpose.
  void say_goodbye();

 private:
  // frames
  void queue_ctrl(Path& p, FrameHeader h, std::vector<char> payload = {});
  bool send_ctrl_any(FrameHeader h, int prefer = -1);
  bool flush_stream(Path& p, Stream& s, TimeUs now);
  bool read_stream(Path& p, Stream& s, TimeUs now, FailCause* cause, const char** why);
  bool handle_frame(Path& p, Stream& s, TimeUs now, const char** why);
  void finish_payload(Path& p, Stream& s, TimeUs now);
  // paths
  void fail_path(Path& p, FailCause cause, TimeUs now, const char* detail, bool notify);
  void close_streams(Path& p);
  int control_path(int prefer) const;
  bool any_usable() const;
  void check_paths(TimeUs now);
  TimeUs kernel_heard_within(const Path& p) const;
  bool message_in_flight(const Path& p) const;
  static void abort_socket(int fd);
  void schedule_chunks(TimeUs now);
  void sample_tcp_info(TimeUs now);
  void note_peer_drain(Path& p, bool drained);
  void send_acks();
  void on_ack(uint64_t seq, uint32_t prefix, uint32_t base, uint64_t bitmap, TimeUs now);
  void on_cts(uint64_t seq, uint64_t cap);
  void resend_recv_state(int prefer);
  void mark_recovered(Path& p);
  void resend_notices();
  void check_recoveries(TimeUs now);
  void give_up(Status st, const char* why);
  void drain_inbox(TimeUs now);
  void attach_stream(int path, int stream, uint32_t gen, int fd, TimeUs now);
  void start_reconnect(Path& p, TimeUs now);
  void step_reconnect(Path& p, TimeUs now);
  Status plan_paths(const HelloBody& peer, int control_rail, int control_peer_rail);
  void start_handshake(Handshake* hs, int local_rail, int peer_rail, uint32_t flags, uint32_t gen,
                       TimeUs now);
  int step_handshake(Handshake* hs, int local_rail, TimeUs now);
  Request* find_send(uint64_t seq);
  Request* free_request();
  Request* find_recv(uint64_t seq);
  std::string rail_name(int r) const;

  Runtime* rt_;
  const Config& cfg_;
  Role role_;
  int dev_;
  uint64_t conn_id_ = 0;
  uint8_t secret_[16] = {};
  uint64_t listen_id_ = 0;
  int n_streams_ = 1;
  std::vector<Path> paths_;
  std::vector<WireRail> peer_rails_;
  std::atomic<int> token_{0};
  std::atomic<TimeUs> last_progress_{0};
  Status error_ = Status::kOk;
  std::vector<char> discard_;
  std::vector<PathLoad> loads_;  // schedule_chunks scratch

  Request reqs_[NCCL_NET_MAX_REQUESTS];
  std::deque<Request*> active_;  // posted, not completed, in sequence order
  // sender
  struct Cts {
    uint64_t seq;
    uint64_t cap;
  };
  std::deque<Cts> cts_;
  uint64_t next_send_seq_ = 0;
  TimeUs next_tcp_info_ = 0;  // next TCP_INFO read for the failure predictor
  uint64_t next_cts_seq_ = 0;  // next CTS sequence not yet seen
  // receiver
  uint64_t next_recv_seq_ = 0;
  struct Done {
    uint64_t seq;
    uint32_t nchunks;
  };
  std::deque<Done> history_;  // recently completed receives, for duplicate acknowledgement
  // failure notices
  struct Notice {
    uint64_t id;
    int path;
    uint32_t gen;
  };
  std::deque<Notice> notices_;
  uint64_t next_notice_ = 1;
  // recoveries in progress (sender)
  struct Recovery {
    int path;
    FailCause cause;
    TimeUs detect;
    TimeUs since_fault_ms_x1000;
    int replayed;
    std::vector<uint64_t> seqs;
    std::string rail;
  };
  std::vector<Recovery> recoveries_;
  GiveUpTimer give_up_timer_;
  TimeUs last_check_ = 0;
  bool gave_up_ = false;
  bool peer_closed_ = false;  // the peer sent BYE
  TimeUs bye_at_ = 0;
  // setup
  int setup_stage_ = 0;
  TimeUs setup_start_ = 0;
  WireHandle handle_{};
  int control_candidate_ = 0;
  Handshake control_hs_;
  TimeUs control_retry_at_ = 0;
  TimeUs control_backoff_ = 0;
  int control_last_err_ = 0;  // errno of the latest failed control handshake (timeout WARN)
  int control_rail_ = -1;
  std::vector<Handshake> setup_hs_;
  uint64_t setup_done_bitmap_ = 0;
  bool setup_done_seen_ = false;
  uint32_t setup_done_paths_ = 0;
  std::mutex inbox_mu_;
  std::vector<Incoming> inbox_;  // guarded by inbox_mu_
  friend class ConnTestPeer;
};

}  // namespace r2ccl::net
