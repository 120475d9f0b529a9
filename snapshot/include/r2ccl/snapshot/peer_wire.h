// The daemon-to-daemon protocol of r2ccl_snapshotd (version 1). Little-endian host layout
// (x86-64 and aarch64 clusters); every frame is a fixed header followed by `length` payload
// bytes, and the receiver checks the type's exact or maximum payload size BEFORE reading or
// allocating anything.
//
//   HELLO      first frame on every connection: protocol version, the sender's node id, and
//              the job token (compared in constant time; a wrong token or an id not in the peer
//              list closes the connection, logged with the peer's address)
//   HEARTBEAT  every period: node id, the sender's membership epoch, its node's usable network
//              bandwidth (GB/s, from its health board)
//   AGREED     the coordinator's agreed cluster record (board::AgreedRecord), written by every
//              receiver into its node's health board when its epoch is newer
//
// The token authenticates peers of one job against misconfiguration and stray jobs; it is sent
// as is (no TLS): run the daemons on a trusted management network.
#pragma once

#include <cstddef>
#include <cstdint>

#include "r2ccl/health_board.h"

namespace r2ccl::snap {

constexpr uint32_t kPeerMagic = 0x4e533252;  // "R2SN" little-endian
constexpr uint16_t kPeerVersion = 1;
constexpr size_t kTokenBytes = 64;           // tokens are 1..64 bytes, zero-padded on the wire

enum class PeerMsg : uint16_t { kHello = 1, kHeartbeat = 2, kAgreed = 3 };

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
  float usable_gbps;  // 0 = unknown
  uint64_t epoch;
};
static_assert(sizeof(HeartbeatBody) == 16, "heartbeat layout");

// The payload size a frame of `type` must have; 0 for an unknown type (the connection is
// closed).
inline size_t peer_payload_size(uint16_t type) {
  switch (static_cast<PeerMsg>(type)) {
    case PeerMsg::kHello: return sizeof(HelloBody);
    case PeerMsg::kHeartbeat: return sizeof(HeartbeatBody);
    case PeerMsg::kAgreed: return sizeof(board::AgreedRecord);
  }
  return 0;
}

}  // namespace r2ccl::snap
