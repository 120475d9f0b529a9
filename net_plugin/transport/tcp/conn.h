// tcp::Conn: the TCP transport's side of one NCCL connection (a PathIo under
// engine::Connection). Each path is one or more TCP streams (R2CCL_NSOCKS_PER_PATH) bound to
// its rail; frames are a 40-byte header plus payload (wire.h).
//
// What it does, and nothing more: connection setup (a rail query to the peer's per-process
// listener, then one HELLO per stream, SETUP_DONE), frame encoding and decoding, reading each
// chunk's payload straight into the place the engine names (re-asking before every partial
// read), PING/PONG probes, reconnecting a failed path with a higher generation (connector),
// attaching the peer's reconnected streams (acceptor), the kernel's TCP ACK age
// (TCP_INFO) as a liveness hint, the predictor's retransmit counters, and the in-process
// fault injector's effects on its sockets.
//
// Threads: as engine::Connection (the progress token holder drives it); push_incoming from
// the runtime's background thread (locked inbox).
#pragma once

#include <algorithm>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "engine/connection.h"
#include "sock/rails.h"
#include "sock/sock_errors.h"
#include "transport/tcp/wire.h"
#include "transport/transport.h"

namespace r2ccl::net::tcp {

class Runtime;

// An authenticated incoming stream, handed from the background thread to its owner.
struct Incoming {
  int fd = -1;
  int local_rail = 0;
  HelloBody hello{};
};

class Listen final : public Listener {
 public:
  Listen(Runtime* rt, int dev);
  ~Listen() override;
  Runtime* rt;
  std::mutex inbox_mu;
  // Checked hellos of new connections, in arrival order; several connectors may be in it at
  // once (NCCL can connect several send comms before it calls accept). Guarded by inbox_mu.
  std::vector<Incoming> inbox;
  // Connections this listen comm accepted (latest kRecentAccepts; service thread only): a
  // late stream of one of them is closed, never mistaken for a new connection.
  static constexpr size_t kRecentAccepts = 64;
  std::deque<uint64_t> accepted;
  bool was_accepted(uint64_t conn_id) const {
    return std::find(accepted.begin(), accepted.end(), conn_id) != accepted.end();
  }
};

class Conn final : public ConnIo {
 public:
  // Connector (role kSend) from NCCL's handle, or acceptor (kRecv) for `listen`.
  Conn(Runtime* rt, const WireHandle& h, int dev);
  Conn(Runtime* rt, Listen* listen);
  ~Conn() override;

  Status setup_step(bool* done, TimeUs now) override;
  // Background thread: a reconnected stream for this connection (acceptor side).
  void push_incoming(Incoming in);
  bool is_acceptor() const { return role_ == Role::kRecv; }
  const uint8_t* secret() const { return secret_; }

  // --- PathIo ---
  PathCaps caps() const override {
    PathCaps c;
    c.receiver_acks = true;
    c.quiesce_before_replay = false;
    c.address_notices = true;
    c.eager = true;
    return c;
  }
  void poll(PathSink& sink, TimeUs now) override;
  void flush(PathSink& sink, TimeUs now) override;
  bool ready(int path) const override { return paths_[path].attached_ok(); }
  PostResult post_chunk(int path, const ChunkOut& c, PathSink& sink, TimeUs now) override;
  PostResult post_cts(int path, const CtsOut& c, PathSink& sink, TimeUs now) override;
  PostResult post_ctrl(int path, const CtrlMsg& m, PathSink& sink, TimeUs now) override;
  bool probe(int path, PathSink& sink, TimeUs now) override;
  void stop_path(int path, bool from_peer, TimeUs now) override;
  bool can_reconnect(int path, PathSink& sink) const override;
  bool address_stale(int path) const override;
  uint64_t link_key(int path) const override;
  void reconnect(int path, PathSink& sink, TimeUs now) override;
  // The kernel's last TCP ACK on the path's sockets (TCP_INFO).
  TimeUs heard_within(int path, TimeUs now) const override;
  TimeUs fault_start(int path, TimeUs now) const override;
  void say_goodbye(TimeUs now) override;
  std::string peer_name() const override;
  bool wait_fds(std::vector<pollfd>* out) const override;

 private:
  struct OutFrame {
    FrameHeader h{};
    const char* payload = nullptr;
    TimeUs not_before = 0;  // injected send delay
  };
  struct Stream {
    int fd = -1;
    std::deque<OutFrame> ctrlq;
    std::deque<OutFrame> dataq;
    bool cur_active = false;
    bool cur_ctrl = false;  // the frames going out are `batch`, else dataq's front
    size_t cur_off = 0;
    std::vector<FrameHeader> batch;  // control frames taken from ctrlq, sent as one
    // reader
    std::vector<char> stage;  // read stage (kStageBytes, conn.cc), allocated on first read
    size_t st_off = 0;        // stage bytes handled so far
    size_t st_len = 0;        // stage bytes read
    FrameHeader rh{};
    size_t rh_got = 0;
    bool in_payload = false;
    uint64_t p_left = 0;
    ChunkPlace place;     // where the payload being read goes (kDiscard: nowhere)
    uint64_t p_done = 0;  // bytes of the payload read so far
    bool p_clean = true;  // every byte so far went into the posted buffer
    // TCP_INFO counters already added to the rail's totals (the failure predictor's
    // retransmit signal); a new socket starts from 0.
    uint32_t tcpi_retrans = 0;
    uint32_t tcpi_segs_out = 0;
    // Zero-window rule (watch_window): the peer's window is shut and the socket's
    // TCP_USER_TIMEOUT is raised; the next look at the window is not before next_window_look.
    bool window_shut = false;
    TimeUs next_window_look = 0;
  };
  struct Handshake {
    int fd = -1;
    int path = 0;
    int stream = 0;
    int stage = 0;  // 0 connecting, 1 sending hello, 2 reading hello-ack, 3 done; < 0 failed
    TimeUs deadline = 0;
    std::vector<char> out;
    size_t off = 0;
    char in[sizeof(FrameHeader) + sizeof(HelloBody)];  // HELLO_ACK, or a WireRefusal
    size_t got = 0;
    int err = 0;                   // failed: the errno (sock/sock_errors.h classifies it)
    SockOp op = SockOp::kConnect;  // ... and the call it came from
    bool refused = false;          // failed: the listener refused the hello (refusal below)
    WireRefusal refusal{};
    std::string what;  // "RAIL -> PEER ADDRESS"
    std::string note;  // failed before any socket call: why (cause() says it)
    // Why it failed, for a message: the refusal's text, or the errno with its limit.
    std::string cause() const;
    // Refused because the listening process is out of descriptors (Refusal::kNoResources).
    bool out_of_resources() const;
    // Failed for a cause that retrying soon cannot heal: a permanent errno, or the above.
    bool cannot_heal() const;
  };
  static_assert(sizeof(FrameHeader) + sizeof(HelloBody) >= sizeof(WireRefusal),
                "a handshake's buffer holds a refusal");
  // A path's rail, label, generation and setup state are in PathIo::paths_desc_.
  struct Path {
    int index = 0;
    int peer_rail = 0;
    std::vector<Stream> streams;
    uint32_t rr = 0;
    uint64_t ping_id = 0;
    bool stopped = false;
    uint32_t reset_seen = 0;
    std::vector<Handshake> reconnect;  // connector side
    int attached = 0;                  // acceptor side: streams attached in this generation
    // Every stream of the path has a socket.
    bool attached_ok() const {
      if (streams.empty() || stopped) return false;
      for (const auto& s : streams)
        if (s.fd < 0) return false;
      return true;
    }
  };

  Conn(Runtime* rt, Role role, int dev);
  // setup
  Status connect_step(bool* done, TimeUs now);
  Status setup_failed(const Handshake& hs, const char* what);
  Status accept_step(bool* done, TimeUs now);
  Status plan_paths(const HelloBody& peer, int control_rail, int control_peer_rail, TimeUs now);
  // `local`: the local rail as resolved for this attempt (reconnects), else rail_now().
  void start_handshake(Handshake* hs, int local_rail, int peer_rail, uint32_t flags, uint32_t gen,
                       TimeUs now, const Rail* local = nullptr);
  // ADDR from the peer: records its rail's address and listener, drops reconnects in progress
  // to the old one, tells the engine per path. False with *why when the frame is malformed.
  bool take_peer_address(const FrameHeader& h, PathSink& sink, TimeUs now, const char** why);
  int step_handshake(Handshake* hs, int local_rail, TimeUs now);
  bool peek_setup_done(Path& p, Stream& s);
  // frames
  void queue_ctrl(Path& p, FrameHeader h, TimeUs now);
  bool flush_stream(Path& p, Stream& s, TimeUs now);
  void watch_window(Stream& s, bool blocked, TimeUs now);
  void quiet_peer(TimeUs now);
  void heard_peer(TimeUs now);
  bool read_stream(Path& p, Stream& s, PathSink& sink, TimeUs now, FailCause* cause,
                   const char** why);
  bool handle_frame(Path& p, Stream& s, PathSink& sink, TimeUs now, const char** why);
  void finish_payload(Path& p, Stream& s, PathSink& sink, TimeUs now);
  // paths
  void close_streams(Path& p);
  void close_all();
  void drain_inbox(PathSink& sink, TimeUs now);
  void attach_stream(PathSink& sink, int path, int stream, uint32_t gen, int fd, TimeUs now);
  void step_reconnect(PathSink& sink, Path& p, TimeUs now);
  void apply_injected_resets(PathSink& sink, TimeUs now);
  void sample_tcp_info(TimeUs now);
  static void abort_socket(int fd);
  std::string rail_name(int r) const;
  PathDesc& desc(const Path& p) { return paths_desc_[p.index]; }
  int rail_of(const Path& p) const { return paths_desc_[p.index].rail; }

  Runtime* rt_;
  const Config& cfg_;
  Role role_;
  int dev_;
  Listen* listen_ = nullptr;  // acceptor, during setup
  uint8_t secret_[16] = {};
  uint64_t listen_id_ = 0;
  int n_streams_ = 1;
  std::vector<Path> paths_;
  std::vector<WireRail> peer_rails_;
  std::vector<char> discard_;
  std::vector<pollfd> read_fds_;              // poll(): the streams it reads, this pass
  std::vector<std::pair<int, int>> read_at_;  // ... their (path, stream)
  TimeUs next_tcp_info_ = 0;                  // next TCP_INFO read for the failure predictor
  TimeUs next_window_look_ = 0;  // next zero-window look on the paths with chunks in flight
  TimeUs last_rx_ = 0;           // the last byte from the peer on any path
  bool patient_ = false;         // the silence rule raised every stream's TCP_USER_TIMEOUT
  // Acceptor: while no path is attached, whether the peer's process still listens (its
  // rail listeners live as long as it does): a connect to one, every kPeerCheckPeriod.
  void check_peer_process(PathSink& sink, TimeUs now);
  int peer_check_fd_ = -1;
  int peer_check_path_ = 0;
  TimeUs peer_check_at_ = 0;      // next check / the pending one's deadline
  bool peer_check_done_ = false;  // the peer was found gone

  // setup
  int setup_stage_ = 0;
  TimeUs setup_start_ = 0;
  WireHandle handle_{};
  int control_candidate_ = 0;
  Handshake control_hs_;
  TimeUs control_retry_at_ = 0;
  TimeUs control_backoff_ = 0;
  int control_last_err_ = 0;  // errno of the latest failed control handshake (timeout WARN)
  TimeUs refused_since_ = 0;  // the control handshakes are refused (ECONNREFUSED) since then
  int backups_ = 0;           // backup paths: R2CCL_BACKUP_PATHS negotiated with the listener
  int control_rail_ = -1;
  std::vector<Handshake> setup_hs_;
  uint64_t setup_done_bitmap_ = 0;
  bool setup_done_seen_ = false;
  uint32_t setup_done_paths_ = 0;
  mutable std::mutex inbox_mu_;
  std::vector<Incoming> inbox_;  // guarded by inbox_mu_
};

}  // namespace r2ccl::net::tcp
