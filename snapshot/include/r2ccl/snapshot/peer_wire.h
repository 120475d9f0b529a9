// The daemon-to-daemon data-plane protocol of r2ccl_snapshotd (version 3: 80-byte ShardMeta
// with an XXH3-64 checksum and the generation).
// Little-endian host layout (x86-64 and aarch64 clusters); every frame is a fixed 16-byte header
// followed by `length` payload bytes. The receiver checks the length against the type's fixed size,
// or its bounds for the two variable-size types, BEFORE reading or allocating anything
// (peer_payload_ok).
//
// Every connection carries frames one way: each daemon opens one connection to every peer and
// sends on it; it reads what peers send on the connections they opened to it. A request (MARKER,
// FETCH) is answered on the responder's own connection to the requester.
//
//   HELLO      first frame on every connection: the sender's node id, its incarnation (a new
//              one tells the receiver the peer restarted: its own connection to the old
//              process is stale and is reopened, so answers are not written into it) and the job
//              token (compared in constant time; a wrong token or an id not in the peer list closes
//              the connection, logged with the peer's address)
//   SHARD      one encoded shard for the receiver to hold as a replica: ShardMeta + payload
//              (payload <= the receiver's max shard size, checked before allocating)
//   HELD       a replica holds every buffer of (rank, step) with each buffer's chain back to
//              its base: sent when it happens and in answer to a MARKER; to the coordinator
//   RETRACT    the replica no longer holds (rank, step) in full (pruned, or a shard failed its
//              checksum): the coordinator stops counting it
//   MARKER     the coordinator's marker for a step (or for everything held, after a
//              coordinator change); every node answers with its HELD frames then MARKER_DONE
//   MARKER_DONE  a node's answer to a marker is complete
//   FETCH      asks the receiver for the chain that restores (rank, buffer, step)
//   FETCHED    one shard of such a chain (ShardMeta + payload), or its end / a refusal
//
// Membership, the coordinator, the agreed record, the newest complete step and the KV are on
// etcd (control_plane.h); heartbeats are UDP datagrams on their own thread (heartbeat.h). Types
// 2, 3, 8 and 11 (the old HEARTBEAT, AGREED, COMPLETE and KV frames) are refused.
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
  kShard = 4,
  kHeld = 5,
  kMarker = 6,
  kMarkerDone = 7,
  kFetch = 9,
  kFetched = 10,
  kRetract = 12,
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
  uint64_t incarnation;  // the sender's registration (control_plane.h); 0: not registered yet
};
static_assert(sizeof(HelloBody) == 80, "hello layout");

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
  uint64_t generation;     // the agreed record's generation when the step was taken
};
static_assert(sizeof(ShardMeta) == 80, "shard meta layout");

struct HeldBody {
  uint32_t node_id;  // the replica
  uint32_t rank;
  uint32_t world;      // ranks in the job at that step
  uint32_t home_node;  // the rank's node (its copy there is not a replica)
  uint64_t step;
  uint64_t generation;  // the step's generation (ShardMeta::generation)
};
static_assert(sizeof(HeldBody) == 32, "held layout (HELD and RETRACT)");

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
    case PeerMsg::kShard:
      return length >= sizeof(ShardMeta) && length - sizeof(ShardMeta) <= max_shard_bytes;
    case PeerMsg::kHeld: return length == sizeof(HeldBody);
    case PeerMsg::kMarker: return length == sizeof(MarkerBody);
    case PeerMsg::kMarkerDone: return length == sizeof(MarkerDoneBody);
    case PeerMsg::kFetch: return length == sizeof(FetchBody);
    case PeerMsg::kFetched:
      return length == sizeof(FetchedHead) ||
             (length >= sizeof(FetchedHead) + sizeof(ShardMeta) &&
              length - sizeof(FetchedHead) - sizeof(ShardMeta) <= max_shard_bytes);
    case PeerMsg::kRetract: return length == sizeof(HeldBody);
  }
  return false;
}

}  // namespace r2ccl::snap
