// Wire formats of the verbs transport. Everything here crosses process boundaries (the NCCL
// handle, the TCP side channel, RDMA SENDs and RDMA writes into the peer's connection area),
// so every struct is fixed-size, trivially copyable and checked at compile time. Both ends
// run the same r2ccl version (kIbWireVersion is checked in the handle and the hello; a
// mismatch is refused at both ends, transport/handshake.h).
//
// Connection setup over the side channel (non-blocking on both ends, authenticated by the
// handle's 128-bit secret):
//   connector -> acceptor  HELLO   secret, listen id, connection id, chunk size, its candidate
//                                  HCAs (primary first, then backups nearest first)
//   acceptor -> connector  REPLY   the path set: for each path, its HCA, the connector's
//                                  candidate it pairs with, its QP numbers, area rkey
//   connector -> acceptor  READY   the connector's QP numbers (QPs now in RTS)
//   acceptor -> connector  DONE    the acceptor's QPs are in RTS; both ends return the comm
// HELLO carries the connector's knobs, REPLY the acceptor's and the negotiated chunk size and
// QPs per path (transport/handshake.h: the smaller of both ends; the adaptive-routing write
// mode is the sender's). Instead of any of these, either end may send a WireRefusal
// (handshake.h) naming why it ends the setup (the acceptor: a wrong secret, a malformed or
// mismatched hello, a setup it could not finish; the connector: one it could not finish), and
// the other end fails its connect or accept at once with that message. A connector of the
// other transport sends one too, instead of HELLO.
// The side channel then stays open: it carries control messages when no RDMA path is healthy
// (rebuilding paths after every HCA failed), BYE, and its end-of-file tells a peer process
// exited.
//
// Data: the receiver writes one CtsRecord per posted receive into the sender's FIFO (RDMA
// WRITE into the sender's connection area); the sender writes each chunk straight into the
// posted buffer with RDMA WRITE WITH IMMEDIATE, the immediate naming (sequence, last, index).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "r2ccl/nccl_abi.h"
#include "transport/handshake.h"

namespace r2ccl::net::ib {

constexpr uint32_t kIbMsgMagic = 0x42493252;  // "R2IB": setup and control messages
// 7: IbSetupMsg::proc_id (the sending process, so paths of every connection between two
//    processes over the same HCA pair share one liveness: engine/link_live.h);
// 6: IbWireHca::subnet_bits and gid_type (backups paired by real subnets, not IPv4 /24);
// 5: CtsRecord::excluded (GPU buffers stay off backup HCAs beyond NCCL_NET_GDR_LEVEL);
// 4: receive credits (IbArea::credit_in, written by the receiver); 3: the handle starts with
//    the common head (transport/handshake.h), knobs in HELLO/REPLY,
//    refusals (WireRefusal), TRUNCATED control messages; 2: the connection id in the setup
//    messages.
constexpr uint16_t kIbWireVersion = 7;
constexpr int kMaxIbPaths = 4;      // primary + up to 3 backups (R2CCL_BACKUP_PATHS <= 3)
constexpr int kMaxQpsPerPath = 16;  // R2CCL_IB_QPS_PER_PATH maximum
constexpr int kFifoDepth = 64;      // CTS slots; > NCCL_NET_MAX_REQUESTS outstanding receives

// The NCCL handle (listen -> connect), 128 bytes with the connect state at its end: the
// common head and nothing more (its listener address is the side channel's).
using IbWireHandle = HandleHead;
static_assert(sizeof(IbWireHandle) <= NCCL_NET_HANDLE_MAXSIZE - 16,
              "handle leaves room for connect state");

// One HCA port as the peer must see it to address it.
struct IbWireHca {
  uint8_t link_layer;  // IBV_LINK_LAYER_INFINIBAND (1) or IBV_LINK_LAYER_ETHERNET (2)
  uint8_t port;
  uint8_t mtu;  // enum ibv_mtu
  uint8_t gid_index;
  uint16_t lid;
  uint16_t pair;  // REPLY: index of the connector's candidate this path pairs with
  uint8_t gid[16];
  uint32_t area_rkey;  // rkey of the sender's/receiver's connection area on this HCA
  uint8_t flags;       // kWireHca* (was reserved, zero, before; so old peers send none)
  uint8_t epoch;       // the HCA's incarnation, low 8 bits (HcaInfo::epoch; + 1 per reopen)
  // Leading bits of gid that name the HCA's subnet (transport/ib/pairing.h: IB 64, RoCE
  // IPv4-mapped 96 + its netdev's IPv4 prefix), 0 unknown; the GID's type (kGidTypeIb,
  // kGidTypeRoceV1, kGidTypeRoceV2; 0xff unknown).
  uint8_t subnet_bits;
  uint8_t gid_type;
};
// The port requires a GRH on every packet it receives (ibv_port_attr.flags has
// IBV_QPF_GRH_REQUIRED): the peer's QPs to it must address by GID, on IB too.
constexpr uint8_t kWireHcaGrhRequired = 1;
static_assert(sizeof(IbWireHca) == 32, "IbWireHca layout");

enum class SetupType : uint16_t { kHello = 1, kReply = 2, kReady = 3, kDone = 4, kCtrl = 5 };

struct IbSetupMsg {
  uint32_t magic;
  uint16_t version;
  uint16_t type;  // SetupType
  uint8_t secret[16];
  uint64_t listen_id;
  uint64_t conn_id;     // chosen by the connector; both ends name the connection by it
  uint64_t chunk_size;  // the connector's R2CCL_CHUNK_SIZE: the connection's chunk size
  uint64_t area_addr;   // the sender's connection area (its CTS FIFO) / the receiver's
  uint32_t npaths;
  uint32_t qps_per_path;  // HELLO: the connector's; REPLY: the negotiated count
  WireKnobs knobs;        // HELLO: the connector's own; REPLY: the acceptor's own
  IbWireHca hca[kMaxIbPaths];
  uint32_t qpn[kMaxIbPaths][kMaxQpsPerPath];
  // The sending process (RuntimeBase::process_id: random, fixed for the process's life, never
  // 0), in every setup message. Names the peer process in PathIo::link_key.
  uint64_t proc_id;
};
static_assert(sizeof(IbSetupMsg) == 88 + 32 * kMaxIbPaths + 4 * kMaxIbPaths * kMaxQpsPerPath,
              "IbSetupMsg layout");
static_assert(sizeof(IbSetupMsg) >= sizeof(WireRefusal), "a setup read holds a refusal");
// Wire versions 3..6 had no proc_id: their setup messages are this long, so a reader of one
// takes it whole and refuses the version instead of waiting for 8 more bytes.
constexpr size_t kIbSetupMsgSizeV6 = offsetof(IbSetupMsg, proc_id);

// A clear-to-send record, written by the receiver into slot seq % kFifoDepth of the sender's
// FIFO. seq1 = sequence + 1 is the last field, so a record is valid once seq1 matches.
struct CtsRecord {
  uint64_t addr;               // posted buffer
  uint64_t size;               // its capacity, bytes
  uint32_t rkey[kMaxIbPaths];  // the buffer's rkey on the receiver's HCA of each path
  int32_t tag;
  // The receiver HCA's incarnation (HcaInfo::epoch, low 4 bits) that rkey[i] was made on,
  // path i in bits 4i..4i+3: after that device is reopened the rkey is dead, and the sender
  // sends the buffer's chunks only on paths whose peer HCA (IbWireHca::epoch) matches.
  uint16_t epochs;
  // Bit i: the buffer is not registered on the receiver's HCA of path i (a GPU buffer beyond
  // NCCL_NET_GDR_LEVEL from that HCA): the sender must not write it through path i.
  uint16_t excluded;
  uint64_t seq1;
};
static_assert(sizeof(CtsRecord) == 48, "CtsRecord layout");

// Control messages: RDMA SEND on a healthy path, or framed on the side channel.
enum class WireCtrl : uint16_t {
  kFail = 1,         // path, gen, id: "I declared this path failed"; the receiver sends it only
                     // after its QPs of the path are in ERR and its landed state was sent
  kFailAck = 2,      // id, path, gen: answered FAIL (the receiver: QPs in ERR, state sent)
  kAckState = 3,     // a = seq, b = prefix | (base << 32), c = 64-chunk bitmap from base;
                     // b = UINT64_MAX: the whole message has landed
  kRebuild = 4,      // path, gen, hca, qpn[n]: re-created QPs for a failed path (sender asks)
  kRebuildAck = 5,   // path, gen, hca, qpn[n]: the peer's re-created QPs, in RTS
  kRebuildNak = 6,   // path, gen: the peer cannot rebuild now (its port is down)
  kBye = 7,          // closing on purpose
  kRebuildDone = 8,  // path, gen: the sender's re-created QPs passed their probes; the
                     // receiver may now post on the path (before, its QPs might still
                     // address a sender QP that is not connected yet)
  kDrain = 9,        // path, a = 1 or 0 (receiver -> sender): the receiver's node's failure
                     // predictor drains (1) or returns (0) the receiver's HCA port of the path;
                     // the sender moves new chunks off it. Sent on every change.
  kTruncated = 10,   // a = seq, b = bytes of the isend (sender -> receiver): larger than the
                     // posted receive of `seq`; the receive fails
};

struct IbCtrlMsg {
  uint32_t magic;  // kIbMsgMagic
  uint16_t type;   // WireCtrl
  uint16_t path;
  uint32_t gen;
  uint32_t n;  // QP numbers in qpn[]
  uint64_t id;
  uint64_t a, b, c;
  IbWireHca hca;  // REBUILD / REBUILD_ACK: the sender of the message's HCA, current GID
  uint32_t qpn[kMaxQpsPerPath];
};
static_assert(sizeof(IbCtrlMsg) == 48 + 32 + 4 * kMaxQpsPerPath, "IbCtrlMsg layout");
constexpr size_t kCtrlSlot = 256;  // receive buffer per posted receive
static_assert(sizeof(IbCtrlMsg) <= kCtrlSlot, "control message fits a receive slot");

// The 32-bit immediate of a chunk write: sequence (low 7 bits), last-chunk flag, index.
constexpr uint32_t kImmSeqBits = 7;
constexpr uint32_t kImmIdxMask = (1u << 24) - 1;
constexpr uint32_t imm_encode(uint64_t seq, bool last, uint32_t idx) {
  return (static_cast<uint32_t>(seq & ((1u << kImmSeqBits) - 1)) << 25) | (last ? 1u << 24 : 0u) |
         (idx & kImmIdxMask);
}
constexpr uint32_t imm_seq7(uint32_t imm) { return imm >> 25; }
constexpr bool imm_last(uint32_t imm) { return (imm >> 24) & 1u; }
constexpr uint32_t imm_idx(uint32_t imm) { return imm & kImmIdxMask; }

// The connection area, registered on every HCA of the path set with remote write access.
// Sender: the CTS FIFO (written by the receiver) and a probe target. Receiver: the CTS
// staging records (the source of its CTS writes), the size slots of adaptive-routing mode
// (written by the sender) and a probe target.
struct IbArea {
  CtsRecord fifo[kFifoDepth];      // sender: incoming CTS
  CtsRecord cts_out[kFifoDepth];   // receiver: outgoing CTS (RDMA write source)
  uint64_t sizes[kFifoDepth];      // receiver: message sizes (adaptive routing mode)
  uint64_t scratch[8];             // 0-byte probe writes target this
  IbCtrlMsg ctrl_out[kFifoDepth];  // outgoing control messages (RDMA SEND source)
  // Receive credits. Each RDMA WRITE WITH IMMEDIATE and each SEND consumes a receive posted
  // at the target QP; with none the target answers RNR NAK and the sender waits
  // min_rnr_timer (0.64 ms) per try. The receiver counts the receives it posts again on
  // each QP and RDMA-writes its counts, (generation << 32) | count mod 2^32, into the
  // sender's credit_in (from its credit_out), at most one such write in flight per path;
  // the sender posts a consumer on QP q only while it has consumed fewer than the QP's
  // receive depth (128) beyond what the receiver reported reposted.
  uint64_t credit_in[kMaxIbPaths][kMaxQpsPerPath];   // sender: the receiver's repost counts
  uint64_t credit_out[kMaxIbPaths][kMaxQpsPerPath];  // receiver: the credit write's source
};
static_assert(std::is_trivially_copyable<IbArea>::value, "IbArea is raw memory");

}  // namespace r2ccl::net::ib
