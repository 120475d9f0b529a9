// The transport interface: what the multipath connection (engine/connection.h) asks of a
// transport backend for one NCCL connection, and the events a backend reports back.
//
//   api -> engine (Connection) -> PathIo  <- {transport/tcp, transport/ib}
//                              <- PathSink (events, called from inside PathIo::poll)
//
// A backend moves bytes and reports what happened; it never decides. Requests, sequencing,
// chunk tracking and replay, duplicates, failure notices, recoveries, give-up, draining,
// shadow routing and every event line live in the engine, once for both transports.
//
// A backend owns, per connection: its wire format, connection setup, each path's I/O
// resources (TCP streams / RC QPs and a CQ), probes, reconnecting a failed path (TCP: new
// streams with a higher generation; verbs: re-created QPs), and the connection's memory
// registrations. Paths are numbered 0..npaths-1 in the order of the engine's path plan
// (engine/path_plan.h): 0 is the primary.
//
// Two physical differences the engine is told about (PathCaps), never guesses:
//  - receiver_acks: TCP needs the receiver to acknowledge chunks (ACK control messages); on
//    verbs the sender's RC completion of an RDMA write is the acknowledgement;
//  - quiesce_before_replay: verbs writes bypass the receiver's CPU, so a failed path's QPs
//    must be in ERR at both ends and the receiver's landed state known before the sender
//    replays (the "gate"); on TCP the receiver's stale-data guard decides every byte.
//
// Threads: every call, and every PathSink callback, runs on the thread holding the
// connection's progress token (engine/connection.h). Nothing here blocks. Times are
// microseconds on CLOCK_MONOTONIC (r2ccl/clock.h), passed in by the caller.
#pragma once

#include <poll.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/path_health.h"
#include "r2ccl/clock.h"
#include "r2ccl/nccl_abi.h"
#include "r2ccl/status.h"

namespace r2ccl::net {

constexpr int kMaxPathsPerConn = 4;  // primary + R2CCL_BACKUP_PATHS (at most 3)

// Bit i set: path i. Every path of a connection: kAllPaths.
constexpr uint32_t kAllPaths = ~0u;

// The receiver's posted buffer as the sender may address it (from the CTS): verbs needs the
// address and one rkey per path (the buffer is registered on the HCAs of the path set that
// may reach it); TCP needs nothing (the receiver places every byte itself).
struct RemoteBuffer {
  uint64_t addr = 0;
  uint32_t rkey[kMaxPathsPerConn] = {};
  // The paths the receiver's registration lets carry this buffer's bytes (PathIo::
  // allowed_paths at the receiver).
  uint32_t allowed = kAllPaths;
  uint32_t rkey_epochs =
      0;  // the transport's tag of the rkeys (verbs: CtsRecord::epochs, 4 bits per path)
};

// Control messages the engine exchanges with its peer. A backend encodes them in its own
// wire format (TCP frame header, verbs RDMA SEND) and delivers the peer's through
// PathSink::on_ctrl. Field use per type:
//   kAck      seq = message, prefix = every chunk below landed (the chunk count: the whole
//             message), base/bitmap = landed chunks [base, base+64); credit = the receiver's
//             eager credit (every ACK, whatever its message: bytes, cumulative; see
//             PathCaps::eager)
//   kFail     id = notice id, path, gen: "I declared this path failed" (answered by kFailAck);
//             cause = why, where the backend carries it (TCP; else kNone)
//   kFailAck  id, path, gen
//   kDrain    path, on: the receiver's node drains (1) or returns (0) its rail of the path
// kTruncated (sender -> receiver): the isend matching receive `seq` is `size` bytes, more
// than the receive's capacity; the receive fails (NCCL fails a truncated message too).
//   kAddr     id = notice id, path = the sender's LOCAL RAIL index (not a path): "my rail's
//             address changed, or the rail is usable again"; the backend adds the rail's
//             current address and listener to its encoding, and the receiving backend
//             records them and reports PathSink::on_peer_address for each path to that rail
//             before it delivers the message (answered by kAddrAck). Only where
//             PathCaps::address_notices.
//   kAddrAck  id
enum class CtrlType : uint8_t {
  kAck = 1,
  kFail = 2,
  kFailAck = 3,
  kDrain = 4,
  kTruncated = 5,
  kAddr = 6,
  kAddrAck = 7,
};

struct CtrlMsg {
  CtrlType type = CtrlType::kAck;
  uint16_t path = 0;
  uint32_t gen = 0;
  uint64_t seq = 0;
  uint64_t id = 0;
  uint32_t prefix = 0;
  uint32_t base = 0;
  uint64_t bitmap = 0;
  uint64_t size = 0;  // kTruncated: the isend's bytes
  // kAck: eager credit the receiver has freed since the connection started (bytes, cumulative,
  // monotonic; 0 = none or eager off). The sender takes the largest value it has seen.
  uint64_t credit = 0;
  bool on = false;
  FailCause cause = FailCause::kNone;  // kFail
};

// One chunk to put on a path (sender).
struct ChunkOut {
  const char* src = nullptr;  // the caller's buffer + offset
  void* mhandle = nullptr;    // the request's registration (regMr's handle)
  const RemoteBuffer* remote = nullptr;
  uint64_t seq = 0;
  uint64_t offset = 0;
  uint64_t total = 0;  // message bytes
  uint32_t idx = 0;
  uint32_t nchunks = 0;
  uint32_t len = 0;
  bool last = false;
  uint64_t chunk_size = 0;  // the connection's chunk size
  // An eager message (PathCaps::eager): one chunk sent without the receiver's CTS, into its
  // eager area when no receive is posted yet. `remote` is then an empty RemoteBuffer.
  bool eager = false;
  // Eager only: the sending request already completed (the engine's copy, R2CCL_EAGER_COPY),
  // so the receiver may hold its acknowledgement back briefly and send several at once.
  bool lazy_ack = false;
};

// One clear-to-send (receiver): the posted buffer of receive `seq`.
struct CtsOut {
  uint64_t seq = 0;
  uint64_t capacity = 0;
  int tag = 0;
  char* buf = nullptr;
  void* mhandle = nullptr;
};

// A chunk header the receiver must place itself (TCP): where to read its payload.
struct ChunkHeader {
  uint64_t seq = 0;
  uint64_t offset = 0;
  uint64_t total = 0;
  uint32_t idx = 0;
  uint32_t nchunks = 0;
  uint32_t len = 0;
  bool eager = false;     // sent without a CTS (ChunkOut::eager)
  bool lazy_ack = false;  // its acknowledgement may wait (ChunkOut::lazy_ack; eager only)
};
struct ChunkPlace {
  enum class Action : uint8_t { kRead, kDiscard, kProtocolError } action = Action::kDiscard;
  char* dst = nullptr;        // kRead: buffer + offset
  const void* req = nullptr;  // opaque request the bytes belong to (for chunk_wanted)
  uint64_t seq = 0;
  uint32_t idx = 0;
  const char* why = nullptr;  // kProtocolError
  bool area = false;          // the engine's own: `req` is an eager-area entry, not a request
};

enum class PostResult : uint8_t {
  kPosted,
  kFull,    // no room now (send queue, control slots): try again on a later pass
  kFailed,  // the path failed while posting; the backend has told the sink
  // post_chunk only: this chunk cannot go on this path, which is fine otherwise (verbs: the
  // buffer's rkey there died with the peer HCA's old incarnation); the engine sends it, and
  // the rest of this pass, on the other paths.
  kNotHere,
};

struct PathCaps {
  bool receiver_acks = true;
  bool quiesce_before_replay = false;
  // The backend addresses paths by the rails' IP addresses, which can change under a running
  // connection (DHCP, NetworkManager, container re-plumbing): the engine tells the peer
  // (kAddr) when a rail's address changes or its link comes back, and asks
  // PathIo::address_stale. TCP: yes. Verbs: no (a GID change travels in its REBUILD).
  bool address_notices = false;
  // The transport carries eager messages (ChunkOut/ChunkHeader::eager, CtrlMsg::credit) and
  // sets eager_threshold() from both ends' knobs. TCP: yes. Verbs: no (its chunks are RDMA
  // writes into the posted buffer, which needs the CTS's address and rkeys).
  bool eager = false;
};

// Events from a backend. Implemented by engine::Connection.
class PathSink {
 public:
  virtual ~PathSink() = default;
  // Anything at all arrived on the path (bytes, a completion): the path and the peer live.
  virtual void on_path_alive(int path, TimeUs now) = 0;
  // Sender: the CTS of receive `seq` arrived.
  virtual void on_cts(uint64_t seq, uint64_t capacity, const RemoteBuffer& remote, TimeUs now) = 0;
  // Sender: chunk `idx` of message `seq` is acknowledged by the transport (verbs: its RC
  // completion).
  virtual void on_chunk_acked(int path, uint64_t seq, uint32_t idx, TimeUs now) = 0;
  // Receiver, TCP: where the payload of this chunk goes. Called once per chunk header.
  virtual ChunkPlace on_chunk_header(int path, const ChunkHeader& h, TimeUs now) = 0;
  // Receiver, TCP: may the rest of `place`'s payload still be written? (Re-checked before
  // every partial read: the chunk may have landed on another path meanwhile.)
  virtual bool chunk_wanted(const ChunkPlace& place) const = 0;
  // Receiver, TCP: the payload of `place` has been read; clean = every byte went into the
  // posted buffer.
  virtual void on_chunk_read(int path, const ChunkPlace& place, bool clean, TimeUs now) = 0;
  // Receiver, verbs: the NIC placed chunk `idx` (len bytes) of the receive whose sequence
  // has `seq_low` in its low `seq_bits` bits; `last` marks the message's last chunk.
  virtual void on_chunk_placed(int path, uint64_t seq_low, int seq_bits, uint32_t idx, uint32_t len,
                               bool last, TimeUs now) = 0;
  // Receiver: the CTS of receive `seq` reached the sender (verbs: its write completed).
  virtual void on_cts_delivered(uint64_t seq, TimeUs now) = 0;
  virtual void on_ctrl(int path, const CtrlMsg& m, TimeUs now) = 0;
  // The path failed (socket error, end of file, completion error, protocol error, the
  // peer re-created it). The engine decides what follows; exactly once per failure.
  virtual void on_path_error(int path, FailCause cause, const char* detail, TimeUs now) = 0;
  // A probe posted by PathIo::probe came back. `sent_at`: when it left (the `now` of its
  // PathIo::probe call, echoed by the peer: TCP), so an answer to an earlier probe than the
  // latest still gives a round trip; 0 when the transport cannot tell which probe it was
  // (verbs): then it is taken as the latest probe's answer.
  virtual void on_probe_ok(int path, TimeUs now, TimeUs sent_at) = 0;
  // The path is connected again (connector: its reconnect finished; acceptor: the peer
  // re-created it). Probing starts.
  virtual void on_reconnected(int path, TimeUs now) = 0;
  // A reconnect started by PathIo::reconnect failed. refused: nothing listens any more
  // (the peer's process is gone).
  virtual void on_reconnect_failed(int path, bool refused, const char* detail, TimeUs now) = 0;
  // The peer's rail at the far end of `path` has a new address, or is usable again (its
  // kAddr): the backend has recorded it (and dropped a reconnect in progress to the old one).
  virtual void on_peer_address(int path, TimeUs now) = 0;
  // The peer closed the connection on purpose (BYE).
  virtual void on_peer_bye(TimeUs now) = 0;
  // The peer's process is gone (a channel ended without BYE), with the evidence.
  virtual void on_peer_gone(const char* evidence, TimeUs now) = 0;
  // An error that failover cannot heal (verbs: remote access, local protection): the
  // connection fails with `st`.
  virtual void on_fatal(Status st, const char* why, TimeUs now) = 0;
  // The path the engine would send control traffic on now, or -1 (for a backend's own
  // messages, such as a verbs REBUILD).
  virtual int control_path() const = 0;
  // Whether a message is in flight on the path now (sender: unacknowledged chunks on it;
  // receiver: a receive whose first chunk header was accepted or first chunk placed, not yet
  // complete). The TCP fault injector's resets wait for it.
  virtual bool traffic_in_flight(int path) const = 0;
};

// Where a path goes, as the backend knows it (for the engine's logs and counters).
struct PathDesc {
  int rail = 0;             // local rail (runtime index)
  std::string label;        // "lo@127.0.0.1 -> lo@127.0.0.2", "mlx5_0:1 -> ::ffff:10.0.0.2"
  bool up = true;           // connected at setup
  uint32_t generation = 0;  // incremented by every reconnect (failure notices carry it, so a
                            // stale notice about an earlier generation is ignored); both
                            // ends agree on it
};

class PathIo {
 public:
  virtual ~PathIo() = default;

  // --- identity, set by the backend's setup ---
  uint64_t conn_id() const { return conn_id_; }  // how both ends name the connection
  uint64_t chunk_size() const { return chunk_size_; }
  // Largest message (bytes) sent eagerly, both ends' R2CCL_EAGER_THRESHOLD negotiated (the
  // smaller, at most the chunk size); 0: every message waits for its CTS.
  uint64_t eager_threshold() const { return eager_threshold_; }
  int npaths() const { return static_cast<int>(paths_desc_.size()); }
  const PathDesc& path(int i) const { return paths_desc_[i]; }
  uint32_t generation(int i) const { return paths_desc_[i].generation; }

  virtual PathCaps caps() const = 0;
  // Reads whatever arrived and reports it to `sink`; also runs the backend's timers
  // (handshakes, rebuild deadlines, injected faults).
  virtual void poll(PathSink& sink, TimeUs now) = 0;
  // Writes out what is queued (frames, control messages).
  virtual void flush(PathSink& sink, TimeUs now) = 0;
  // The path can carry traffic now (every stream attached / QPs present).
  virtual bool ready(int path) const = 0;
  // Room for one more chunk on the path (send queue depth). Default: always.
  virtual bool has_room(int path) const;
  virtual PostResult post_chunk(int path, const ChunkOut& c, PathSink& sink, TimeUs now) = 0;
  virtual PostResult post_cts(int path, const CtsOut& c, PathSink& sink, TimeUs now) = 0;
  // A control message on `path`, or with path == -1 on the backend's fallback channel (verbs
  // side channel) when no path is usable; kFull when there is none.
  virtual PostResult post_ctrl(int path, const CtrlMsg& m, PathSink& sink, TimeUs now) = 0;
  // A probe on the path; its answer is PathSink::on_probe_ok, its loss a path error or the
  // engine's heartbeat rule. False when it could not be posted now.
  virtual bool probe(int path, PathSink& sink, TimeUs now) = 0;

  // Moves the path out of service: no more bytes go out or land on it (TCP: sockets closed;
  // verbs: QPs to ERR). from_peer: the peer declared it failed (test hook no_bilateral_err
  // leaves a receiver's QPs in RTS then).
  virtual void stop_path(int path, bool from_peer, TimeUs now) = 0;
  // Receiver: reports through `sink` every chunk that landed on a stopped path before it
  // stopped (verbs: drains its CQ), so the landed state the engine sends is complete.
  // Default: nothing can land by itself (the receiver reads every byte).
  virtual void quiesce(int path, PathSink& sink, TimeUs now);
  // Whether a reconnect could start now (verbs: a control channel to the peer exists).
  virtual bool can_reconnect(int path, PathSink& sink) const = 0;
  // Connector/sender: starts reconnecting a failed path; the outcome is on_reconnected or
  // on_reconnect_failed.
  virtual void reconnect(int path, PathSink& sink, TimeUs now) = 0;
  // Sender: the reconnected path passed its probes (verbs tells the receiver it may post).
  // Default: nothing to tell.
  virtual void path_recovered(int path, PathSink& sink, TimeUs now);
  // Time since the transport below last heard from the peer on this path (TCP: the kernel's
  // last TCP ACK), microseconds. Default INT64_MAX: the transport cannot tell.
  virtual TimeUs heard_within(int path, TimeUs now) const;
  // Microseconds of silence within which the transport below may still recover the path on
  // its own (verbs: two QP retransmissions, 2 x 4.096 us x 2^R2CCL_IB_TIMEOUT), so neither the
  // heartbeat rule nor the watchdog may call the path dead sooner. Default 0 (TCP: the
  // kernel's ACKs say directly whether the rail works).
  virtual TimeUs stall_floor(int path) const;
  // Evidence of an injected fault on the path: when it started. Default 0: none known.
  virtual TimeUs fault_start(int path, TimeUs now) const;
  // The path's connection uses an address that is no longer current at either end (TCP: its
  // sockets are bound to an address the local rail no longer has, or connected to one the
  // peer's rail no longer has): it cannot carry anything and is failed at once. Default:
  // false (only where PathCaps::address_notices).
  virtual bool address_stale(int path) const;

  // While the connection is idle (no proxy-thread call for a while) the background thread
  // progresses it when one of these descriptors is ready, and otherwise only every
  // RuntimeBase::kIdleTick: appends {fd, events} (POLLIN for input, POLLOUT for queued output
  // or a connect in progress). False when the backend cannot say what it waits for (then the
  // connection is progressed on every background pass). Descriptors may be stale by the time
  // they are polled: a spurious wake-up only. Token holder. Default: false.
  virtual bool wait_fds(std::vector<pollfd>* out) const;
  // The link the path runs over (engine/link_live.h): a key, the same in every connection of
  // this process, naming (local rail, peer rail, peer process); paths with equal keys share
  // one liveness (one prober, one heartbeat rule, one RTT baseline). 0: the transport cannot
  // name the peer process: the path gets a private link. May change when the
  // path reconnects (the peer's rail got another address). Token holder. Default 0.
  virtual uint64_t link_key(int path) const;
  // Tells the peer, best effort and without waiting, that this end closes on purpose.
  virtual void say_goodbye(TimeUs now) = 0;
  // The peer as the logs name it ("10.0.0.2:43210"; "" when unknown). Any thread holding
  // the connection's progress token.
  virtual std::string peer_name() const { return ""; }
  // The connection failed for good: nothing more may land in NCCL's buffers. Default:
  // nothing lands by itself.
  virtual void abort(TimeUs now);

  // GPU receives: makes the NIC's writes of the last buffer visible (verbs: an RDMA READ
  // through a loopback QP). *token = 0 when nothing needs flushing (the default: host
  // memory). Errors name the cause.
  virtual Status start_flush(int n, void** data, const int* sizes, void** mhandles,
                             uint64_t* token);
  // 1 done, 0 pending, or -1 with *err.
  virtual int test_flush(uint64_t token, Status* err);

  // Memory registration (NCCL's regMr/regMrDmaBuf/deregMr): the buffer on every rail of
  // the path set. Service thread, concurrently with the data path. Defaults: host memory
  // needs no registration (a plain handle); DMA-BUF is refused (not advertised).
  virtual Status reg_mr(void* data, size_t size, int type, void** mhandle);
  // The paths (bit i = path i) that may carry the bytes of a buffer registered as `mhandle`
  // (nullptr: an unregistered buffer). The engine sends a message's chunks, replays included,
  // only on paths its own registration and the receiver's (RemoteBuffer::allowed) both allow.
  // Verbs: a GPU buffer is not registered on backup HCAs beyond NCCL_NET_GDR_LEVEL. Default:
  // kAllPaths. Proxy thread (isend), concurrently with reg_mr of other buffers.
  virtual uint32_t allowed_paths(const void* mhandle) const;
  virtual Status reg_mr_dmabuf(void* data, size_t size, uint64_t offset, int fd, void** mhandle);
  virtual void dereg_mr(void* mhandle);

 protected:
  uint64_t conn_id_ = 0;
  uint64_t chunk_size_ = 0;
  uint64_t eager_threshold_ = 0;
  std::vector<PathDesc> paths_desc_;
};

}  // namespace r2ccl::net
