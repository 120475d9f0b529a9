// The protocol between the training processes of a node and their r2ccl_snapshotd (version 3:
// peer_wire.h's 80-byte ShardMeta and 32-byte FetchBody; StateBody.queries, new in 3), over
// the daemon's local Unix stream socket (`--socket PATH`, created mode 0600, or 0660 with
// `--socket-group`). Same framing as the peer protocol (peer_wire.h): a 16-byte header with
// magic "R2SC", then `length` payload bytes, checked against the type's size or bounds before
// anything is read or allocated; a bad frame closes the connection with a logged reason.
//
// Client -> daemon
//   HELLO    first frame: protocol version, the client's job-wide rank and the job's world size
//   SHARD    ShardMeta + payload: one encoded buffer of a snapshot (the daemon keeps a home copy
//            and sends it to the rank's replica nodes). No reply; the daemon's STATE tells when
//            a step became complete.
//   QUERY    asks for a STATE now. Every STATE counts the QUERYs read before it was built
//            (`queries`): one pushed before the daemon read a QUERY (an older complete step)
//            may reach the client after it sent that QUERY, so the answer is the first STATE
//            that counts it.
//   FETCH    FetchBody: the chain that restores (rank, buffer, step); answered by FETCHED frames
//            (peer_wire.h FetchedHead [+ ShardMeta + payload]), from the local store or a peer
//   KV_PUT   KvBody: publish a small value to every node (an etcd key, created only if absent:
//            the first writer's value is the one every node reads)
//   KV_GET   KvGetBody: the value of a key as this node knows it; answered by KV_VALUE
//
// Daemon -> client
//   STATE    StateBody: the agreed record, its generation and restore step, and the newest
//            complete step, sent after HELLO, after QUERY, and whenever one changes (the
//            recovery event: a member gone). restore() restores the record's restore step when
//            it has one (the same step on every node: it comes from etcd), else the newest
//            complete step; take() stamps its shards with the generation.
//   FETCHED  see FETCH
//   KV_VALUE KvBody; origin_node == kKvAbsent when the key is unknown
#pragma once

#include <cstddef>
#include <cstdint>

#include "r2ccl/health_board.h"
#include "r2ccl/snapshot/peer_wire.h"

namespace r2ccl::snap {

constexpr uint32_t kClientMagic = 0x43533252;  // "R2SC" little-endian
constexpr uint16_t kClientVersion = 3;
constexpr uint32_t kKvAbsent = 0xffffffffu;

enum class ClientMsg : uint16_t {
  kHello = 1,
  kShard = 2,
  kQuery = 3,
  kFetch = 4,
  kKvPut = 5,
  kKvGet = 6,
  kState = 101,
  kFetched = 102,
  kKvValue = 103,
};

struct ClientHelloBody {
  uint32_t rank;   // job-wide rank, < world
  uint32_t world;  // ranks in the job, 1..65536
  int32_t pid;
  uint32_t reserved;
};
static_assert(sizeof(ClientHelloBody) == 16, "client hello layout");

struct KvGetBody {
  char key[kKvKeyBytes];  // NUL-terminated, 1..63 bytes
};

struct StateBody {
  uint32_t node_id;            // the daemon's node
  uint32_t has_complete;       // 1: complete_step is valid
  uint64_t complete_step;      // newest complete step
  board::AgreedRecord agreed;  // epoch 0: nothing agreed yet
  uint64_t generation;         // the record's generation (restore points so far)
  uint32_t has_restore;        // 1: restore_step is valid (the record is a restore point)
  uint32_t queries;            // QUERYs the daemon had read on this connection when it built
                               // this STATE (mod 2^32)
  uint64_t restore_step;       // what every rank restores in this epoch
};

// Whether `length` payload bytes are acceptable for a client frame of `type` (either
// direction), given the largest shard accepted (`max_shard_bytes`).
inline bool client_payload_ok(uint16_t type, uint64_t length, uint64_t max_shard_bytes) {
  switch (static_cast<ClientMsg>(type)) {
    case ClientMsg::kHello: return length == sizeof(ClientHelloBody);
    case ClientMsg::kShard:
      return length >= sizeof(ShardMeta) && length - sizeof(ShardMeta) <= max_shard_bytes;
    case ClientMsg::kQuery: return length == 0;
    case ClientMsg::kFetch: return length == sizeof(FetchBody);
    case ClientMsg::kKvPut: return length == sizeof(KvBody);
    case ClientMsg::kKvGet: return length == sizeof(KvGetBody);
    case ClientMsg::kState: return length == sizeof(StateBody);
    case ClientMsg::kFetched:
      return length == sizeof(FetchedHead) ||
             (length >= sizeof(FetchedHead) + sizeof(ShardMeta) &&
              length - sizeof(FetchedHead) - sizeof(ShardMeta) <= max_shard_bytes);
    case ClientMsg::kKvValue: return length == sizeof(KvBody);
  }
  return false;
}

}  // namespace r2ccl::snap
