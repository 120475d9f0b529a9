// r2ccl TCP wire formats: the 128-byte NCCL handle, the frame header, and the hello that
// opens every path connection. All integers little-endian (x86-64/aarch64 native); a
// big-endian host is rejected at compile time. Thread-safety: plain data.
//
// Frame = 40-byte header, then `len` payload bytes (DATA: chunk payload; HELLO/HELLO_ACK:
// a HelloBody). Field use per type:
//   HELLO      a=the connector's wire version (kWireVersion), len=sizeof(HelloBody)
//   HELLO_ACK  a=the listener's wire version, len=sizeof(HelloBody)
//   DATA       seq=message, a=chunk index, b=chunk count, off=offset, total=message bytes,
//              flags kFrameEager: an eager message, sent without the CTS (PathCaps::eager);
//              kFrameLazyAck (with kFrameEager): its ACK may wait (ChunkOut::lazy_ack)
//   CTS        seq=message, total=posted receive capacity, a=tag
//   ACK        seq=message, a=prefix (every chunk below landed; the chunk count: all), b=window
//              base, total=bitmap of landed chunks [base, base+64), off=eager credit freed
//              (bytes, cumulative; CtrlMsg::credit; 0 from a peer without eager messages)
//   FAIL       a=path index declared failed, b=its generation, seq=notice id, total=the
//              cause (engine FailCause; 0 before wire version 4) (answered by FAIL_ACK)
//   FAIL_ACK   a=path index, b=generation, seq=notice id
//   DRAIN      a=path index, b=generation, off=1 drained / 0 returned (receiver -> sender:
//              its node's failure predictor drains the receiver's rail of the path)
//   PING/PONG  seq=probe id, off=sender timestamp (us, echoed)
//   BYE        the sender of it closed the connection on purpose (NCCL closed the comm):
//              not a failure, nothing is logged; pending requests fail with a remote error
//   TRUNCATED  seq=message, total=bytes of the isend (sender -> receiver: larger than the
//              posted receive; the receive fails)
//   SETUP_DONE total=bitmap of paths the connector got up, a=number of paths
//              (first frame on the first path that is up)
//   ADDR       seq=notice id, a=the sender's rail index, b=family | prefix_len << 8 |
//              listener port (network order) << 16, off and total=the rail's address (16
//              bytes, an IPv4 address in the first 4): the rail has this address now, or is
//              usable again (answered by ADDR_ACK)
//   ADDR_ACK   seq=notice id
// A listener that refuses a HELLO answers a WireRefusal (transport/handshake.h, 256 bytes, no
// frame header: its magic is not a frame's) naming why, then closes; so does the per-process
// listener get one from a connector of the other transport or wire version, which fails the
// listen comm's accept().
#pragma once

#include <cstddef>
#include <cstdint>

#include "r2ccl/nccl_abi.h"
#include "transport/handshake.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "r2ccl wire formats assume a little-endian host"
#endif

namespace r2ccl::net::tcp {

// 4: ADDR and ADDR_ACK frames (a rail's new address, told to the peer);
// 3: the handle starts with the common head (transport kind; transport/handshake.h), the
//    HELLO carries the wire version and the knobs, a refused HELLO is answered (WireRefusal),
//    TRUNCATED frames;
// 2: DRAIN frames, generations in FAIL_ACK.
constexpr uint16_t kWireVersion = 4;
constexpr int kMaxHandleEndpoints = 4;
constexpr int kMaxRails = 16;   // = kMaxRailsPerProcess (sock/rails.h): select_rails keeps no more
constexpr int kMaxPaths = 4;    // primary + up to 3 backups
constexpr int kMaxStreams = 8;  // R2CCL_NSOCKS_PER_PATH maximum

// A listener address: family, the listening process's rail index, port, address.
using WireEndpoint = WireAddr;

// The handle NCCL's listen() gets, self-contained so another process can use it (PXN). Its
// first 52 bytes are the common HandleHead (endpoint 0 is the head's listener address).
struct WireHandle {
  uint32_t magic;  // kHandleMagic
  uint16_t version;
  uint8_t n_endpoints;
  uint8_t kind;        // TransportKind::kTcp
  uint8_t secret[16];  // random; a peer that does not present it is refused
  uint64_t listen_id;
  WireEndpoint endpoints[kMaxHandleEndpoints];  // listener addresses on different rails
};
static_assert(sizeof(WireHandle) <= NCCL_NET_HANDLE_MAXSIZE - 16,
              "handle must fit NCCL's 128 bytes and leave the connect state's 16");
static_assert(offsetof(WireHandle, version) == offsetof(HandleHead, version) &&
                  offsetof(WireHandle, n_endpoints) == offsetof(HandleHead, spare) &&
                  offsetof(WireHandle, kind) == offsetof(HandleHead, kind) &&
                  offsetof(WireHandle, secret) == offsetof(HandleHead, secret) &&
                  offsetof(WireHandle, listen_id) == offsetof(HandleHead, listen_id) &&
                  offsetof(WireHandle, endpoints) == offsetof(HandleHead, listener),
              "a TCP handle starts with the common head");

enum class FrameType : uint8_t {
  kData = 1,
  kCts = 2,
  kAck = 3,
  kFail = 4,
  kFailAck = 5,
  kPing = 6,
  kPong = 7,
  kHello = 8,
  kHelloAck = 9,
  kSetupDone = 10,
  kBye = 11,
  kDrain = 12,
  kTruncated = 13,
  kAddr = 14,
  kAddrAck = 15,
};
constexpr uint16_t kFrameMagic = 0x5232;  // "2R"
// FrameHeader::flags of a DATA frame. A peer that never negotiated eager messages (knob 0)
// never sets it.
constexpr uint8_t kFrameEager = 1;
// ... and with kFrameEager: the sender's request already completed, the ACK may wait (a peer
// that does not know it acknowledges at once, as before).
constexpr uint8_t kFrameLazyAck = 2;

struct FrameHeader {
  uint16_t magic;
  uint8_t type;
  uint8_t flags;
  uint32_t len;  // payload bytes following the header
  uint64_t seq;
  uint64_t off;
  uint64_t total;
  uint32_t a;
  uint32_t b;
};
static_assert(sizeof(FrameHeader) == 40, "frame header layout");

struct WireRail {
  uint8_t family;
  uint8_t prefix_len;
  uint16_t port;  // this process's listener port on the rail, network order
  uint8_t addr[16];
  char name[28];  // display name, NUL-terminated
};
static_assert(sizeof(WireRail) == 48, "rail layout");

// Payload of HELLO (connector -> listener) and HELLO_ACK (listener -> connector).
struct HelloBody {
  uint8_t secret[16];
  uint64_t listen_id;  // which NCCL listen comm (new connection)
  uint64_t conn_id;    // which connection (chosen by the connector)
  uint32_t path;       // path index inside the connection
  uint32_t stream;     // stream index inside the path
  uint32_t n_paths;
  uint32_t n_streams;
  uint32_t flags;  // kHelloReconnect
  uint32_t n_rails;
  uint32_t generation;  // incremented on every reconnect of the path
  uint32_t rail;        // connector's rail index for this path
  WireKnobs knobs;      // HELLO: the connector's own; HELLO_ACK: the listening process's
  WireRail rails[kMaxRails];
};
constexpr uint32_t kHelloReconnect = 1;
// Rail query: the listener answers HELLO_ACK (its rails) and closes; the connector plans its
// paths from the answer before opening them.
constexpr uint32_t kHelloQuery = 2;
static_assert(sizeof(HelloBody) == 80 + 48 * kMaxRails, "hello layout");

// Largest payload a frame may announce: the largest chunk (R2CCL_CHUNK_SIZE max, 64 MiB).
constexpr uint32_t kMaxFramePayload = 64u * 1024 * 1024;

}  // namespace r2ccl::net::tcp
