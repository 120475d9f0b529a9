// The daemon-to-daemon protocol of r2ccl_snapshotd (version 3: 72-byte ShardMeta, XXH3-64).
// Little-endian host layout (x86-64 and aarch64 clusters); every frame is a fixed 16-byte header
// followed by `length` payload bytes. The receiver checks the length against the type's fixed size,
// or its bounds for the two variable-size types, BEFORE reading or allocating anything
// (peer_payload_ok).
//
// Every connection carries frames one way: each daemon opens one connection to every peer and
// sends on it; it reads what peers send on the connections they opened to it. A request (MARKER,
// FETCH) is answered on the responder's own connection to the requester.
//
//   HELLO      first frame on every connection: the sender's node id and the job token
//              (compared in constant time; a wrong token or an id not in the peer list closes
//              the connection, logged with the peer's address)
//   HEARTBEAT  every period: node id, highest agreed epoch seen, usable network bandwidth
//              (GB/s, from its health board), and an echo of the receiver's last heartbeat time
//              so the receiver measures the round trip on its own clock
//   AGREED     the coordinator's agreed cluster record (board::AgreedRecord)
//   SHARD      one encoded shard for the receiver to hold as a replica: ShardMeta + payload
//              (payload <= the receiver's max shard size, checked before allocating)
//   HELD       a replica holds every buffer of (rank, step) with each buffer's chain back to
//              its base: sent when it happens and in answer to a MARKER; to the coordinator
//   MARKER     the coordinator's marker for a step (or for everything held, after a
//              coordinator change); every node answers with its HELD frames then MARKER_DONE
//   MARKER_DONE  a node's answer to a marker is complete
//   COMPLETE   the coordinator's newest complete step (every rank held by >= 1 live replica)
//   FETCH      asks the receiver for the chain that restores (rank, buffer, step)
//   FETCHED    one shard of such a chain (ShardMeta + payload), or its end / a refusal
//   KV         a small key/value (an NCCL unique id, a rendezvous address) for every node:
//              sent to the coordinator, which sends it on to every live node
//
// The token authenticates peers of one job against misconfiguration and stray jobs; it is sent
// as is (no TLS): run the daemons on a trusted management network.
#pragma once

#include <cstddef>
#include <cstdint>

#include "r2ccl/health_board.h"

namespace r2ccl::snap {

constexpr uint32_t kPeerMagic = 0x4e533252;  // "R2SN" little-endian
constexpr uint16_t kPeerVersion = 3;
constexpr size_t kTokenBytes = 64;    // tokens are 1..64 bytes, zero-padded on the wire
constexpr size_t kKvKeyBytes = 64;    // keys are 1..63 bytes, NUL-padded
constexpr size_t kKvMaxValue = 4096;  // value bytes

enum class PeerMsg : uint16_t {
  kHello = 1,
  kHeartbeat = 2,
  kAgreed = 3,
  kShard = 4,
  kHeld = 5,
  kMarker = 6,
  kMarkerDone = 7,
  kComplete = 8,
  kFetch = 9,
  kFetched = 10,
  kKv = 11,
};

struct PeerHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;    // PeerMsg
  uint32_t length;  // payload bytes that follow
  uint32_t reserved;
};
static_assert(sizeof(PeerHeader) == 16, "peer header layout");

struct HelloBody {
  uint32_t node_id;
  uint32_t token_len;
  uint8_t token[kTokenBytes];
};
static_assert(sizeof(HelloBody) == 72, "hello layout");

struct HeartbeatBody {
  uint32_t node_id;
  float usable_gbps;     // 0 = unknown
  uint64_t epoch;        // highest agreed epoch the sender has seen
  int64_t sent_us;       // the sender's CLOCK_MONOTONIC at sending (microseconds)
  int64_t echo_us;       // sent_us of the receiver's latest heartbeat the sender got; 0: none
  int64_t echo_held_us;  // how long the sender held that echo before sending (microseconds)
};
static_assert(sizeof(HeartbeatBody) == 40, "heartbeat layout");

// Describes one shard (SHARD, FETCHED, and the client's SHARD): who it belongs to, where it
// sits in its chain, and its payload (an encoded frame, codec.h), followed by payload_bytes.
struct ShardMeta {
  uint32_t rank;           // job-wide rank
  uint32_t buffer;         // the rank's buffer id
  uint32_t n_buffers;      // buffers the rank snapshots at this step (all ids < n_buffers)
  uint32_t world;          // ranks in the job at this step
  uint32_t home_node;      // the node the rank runs on
  uint32_t reserved;       // 0
  uint64_t checksum;       // shard_checksum() (XXH3-64) of the payload: computed once by the
                           // producer (the client), checked once by each hop's receiver
  uint64_t step;           // training step of the snapshot
  uint64_t base_step;      // step of its chain's base (== step: a base)
  uint64_t seq;            // the frame's sequence number (codec.h)
  uint64_t base_seq;       // the chain base's sequence number
  uint64_t payload_bytes;  // bytes that follow
};
static_assert(sizeof(ShardMeta) == 72, "shard meta layout");

struct HeldBody {
  uint32_t node_id;  // the replica
  uint32_t rank;
  uint32_t world;      // ranks in the job at that step
  uint32_t home_node;  // the rank's node (its copy there is not a replica)
  uint64_t step;
};
static_assert(sizeof(HeldBody) == 24, "held layout");

struct MarkerBody {
  uint64_t epoch;  // the coordinator's agreed epoch
  uint64_t step;   // the step of the round; ignored when all != 0
  uint32_t all;    // 1: report everything held (a new coordinator rebuilding its view)
  uint32_t round;  // the coordinator's round number, echoed in MARKER_DONE
};
static_assert(sizeof(MarkerBody) == 24, "marker layout");

struct MarkerDoneBody {
  uint32_t node_id;
  uint32_t round;
};
static_assert(sizeof(MarkerDoneBody) == 8, "marker done layout");

struct CompleteBody {
  uint64_t epoch;  // the coordinator's agreed epoch
  uint64_t step;   // newest complete step; valid when has_step
  uint32_t has_step;
  uint32_t reserved;
};
static_assert(sizeof(CompleteBody) == 24, "complete layout");

struct FetchBody {
  uint64_t request;  // the requester's id, echoed
  uint64_t step;     // restore this step
  uint32_t rank;
  uint32_t buffer;
  // Clients: the n-th replica to try first when the chain comes from peers (the daemon stripes
  // a rank's buffers over its replicas with it: buffer b uses stripe b). Peers: 0.
  uint32_t stripe;
  // Clients: a copy served to this request failed the client's check: the node that served it
  // (kNoNode: none) is skipped (and, when it is this daemon, its copy is marked corrupt).
  uint32_t avoid_node;
};
static_assert(sizeof(FetchBody) == 32, "fetch layout");
constexpr uint32_t kNoNode = 0xffffffffu;

// FETCHED: this header, then (status kOk only) a ShardMeta and its payload. The chain comes
// oldest first (the base), `index` counting from 0 up to `count` - 1; a refusal or an empty
// answer is one frame with status != kOk.
enum class FetchStatus : uint32_t { kOk = 0, kNotHeld = 1, kCorrupt = 2, kBusy = 3 };
struct FetchedHead {
  uint64_t request;
  uint32_t status;  // FetchStatus
  uint32_t index;
  uint32_t count;
  uint32_t source_node;  // the node whose store served the shard (kNoNode in a refusal)
};
static_assert(sizeof(FetchedHead) == 24, "fetched layout");

struct KvBody {
  char key[kKvKeyBytes];  // NUL-terminated, 1..63 bytes
  uint32_t value_bytes;   // <= kKvMaxValue
  uint32_t origin_node;
  uint8_t value[kKvMaxValue];
};
static_assert(sizeof(KvBody) == 64 + 8 + kKvMaxValue, "kv layout");

// Whether `length` payload bytes are acceptable for a frame of `type`, given the receiver's
// largest shard (`max_shard_bytes`). Unknown types are refused.
inline bool peer_payload_ok(uint16_t type, uint64_t length, uint64_t max_shard_bytes) {
  switch (static_cast<PeerMsg>(type)) {
    case PeerMsg::kHello: return length == sizeof(HelloBody);
    case PeerMsg::kHeartbeat: return length == sizeof(HeartbeatBody);
    case PeerMsg::kAgreed: return length == sizeof(board::AgreedRecord);
    case PeerMsg::kShard:
      return length >= sizeof(ShardMeta) && length - sizeof(ShardMeta) <= max_shard_bytes;
    case PeerMsg::kHeld: return length == sizeof(HeldBody);
    case PeerMsg::kMarker: return length == sizeof(MarkerBody);
    case PeerMsg::kMarkerDone: return length == sizeof(MarkerDoneBody);
    case PeerMsg::kComplete: return length == sizeof(CompleteBody);
    case PeerMsg::kFetch: return length == sizeof(FetchBody);
    case PeerMsg::kFetched:
      return length == sizeof(FetchedHead) ||
             (length >= sizeof(FetchedHead) + sizeof(ShardMeta) &&
              length - sizeof(FetchedHead) - sizeof(ShardMeta) <= max_shard_bytes);
    case PeerMsg::kKv: return length == sizeof(KvBody);
  }
  return false;
}

}  // namespace r2ccl::snap
