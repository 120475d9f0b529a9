// What the two transports' connection setups share on the wire and in their decisions:
//  - HandleHead, the first 52 bytes of every r2ccl handle (TCP's WireHandle, verbs'
//    IbWireHandle): magic, wire version, transport kind, the listen comm's secret and id, and
//    the address where the listen comm's process answers setup messages. So a connector of
//    either transport recognises a handle of the other (auto picked verbs on one host and TCP
//    on the other) or of another wire version, and can tell the listener;
//  - WireRefusal, the one message that ends a setup on purpose, in either direction and on
//    either transport: a listener refusing a connector (wrong secret, no such listen comm,
//    malformed or mismatched hello) or a connector refusing a listener (transport or version
//    mismatch, a setup it cannot finish). It names the cause in a text both ends log as is,
//    so both say the same. A listener that gets one with the listen comm's secret fails that
//    comm's accept() at once instead of waiting R2CCL_CONNECT_TIMEOUT;
//  - WireKnobs and negotiate(): what each end chose (chunk size, backup paths, streams or QPs
//    per path, striping, adaptive-routing writes) and the rule that makes both ends use the
//    same values (docs/ARCHITECTURE.md, "What the two ends negotiate").
//
// Wire formats: fixed-size, trivially copyable, little-endian (the transports' wire.h check
// the host at compile time). WireRefusal's layout is frozen (kRefusalVersion 1): any later
// r2ccl must still read it, whatever its transports' wire versions.
// Threads: plain data and pure functions; negotiate() warns once per process per knob (locked).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "r2ccl/status.h"

namespace r2ccl::net {

enum class TransportKind : uint8_t { kTcp = 1, kIb = 2 };
// "TCP", "IB (verbs)", or "unknown transport N".
std::string transport_kind_name(uint8_t kind);

// An address on the wire (TCP: a handle endpoint; both: where a listener answers).
struct WireAddr {
  uint8_t family;  // AF_INET or AF_INET6
  uint8_t rail;    // TCP: the listening process's rail index; verbs: 0
  uint16_t port;   // network byte order
  uint8_t addr[16];
};
static_assert(sizeof(WireAddr) == 20, "WireAddr layout");
// "127.0.0.1:5000", "[fe80::1]:5000".
std::string wire_addr_string(const WireAddr& a);

// Every r2ccl handle starts with this (wire version 3 of both transports on).
constexpr uint32_t kHandleMagic = 0x4c433252;  // "R2CL"
struct HandleHead {
  uint32_t magic;    // kHandleMagic
  uint16_t version;  // the transport's wire version (TCP kWireVersion, verbs kIbWireVersion)
  uint8_t spare;     // the transport's own (TCP: its number of endpoints)
  uint8_t kind;      // TransportKind
  uint8_t secret[16];
  uint64_t listen_id;
  WireAddr listener;  // TCP: the per-process listener on the first endpoint's rail (endpoint
                      // 0); verbs: the listen comm's side channel
};
static_assert(offsetof(HandleHead, listener) == 32 && sizeof(HandleHead) == 56,
              "HandleHead layout (52 bytes, padded to 56)");
static_assert(offsetof(HandleHead, secret) == 8, "the secret's offset in every handle");

// ---------------------------------------------------------------------------------------------
// Refusals. Causes are permanent: the side that gets one fails its connect or accept at once.
enum class Refusal : uint8_t {
  kWrongSecret = 1,    // listener -> connector: the hello's secret is not the listen comm's
  kUnknownListen = 2,  // listener -> connector: no such listen comm (closed, or a stale handle)
  kUnknownConn = 3,    // listener -> connector: a reconnect for a connection that is gone
  kVersion = 4,        // either way: the two ends speak different wire versions
  kTransport = 5,      // connector -> listener: the two ends use different transports
  kMismatch = 6,       // either way: a setting both ends must agree on differs
  kMalformed = 7,      // listener -> connector: the hello's fields are out of range
  kAborted = 8,        // either way: the sender could not finish its half of the setup
  kNoResources = 9,    // listener -> connector: the listening process has been out of
                       // descriptors for kAcceptStarvedLimit (sock/sock_errors.h); the text
                       // names its limit. Setup: fatal for the query, a path waits in the
                       // background; a running connection's reconnect retries slowly
};
const char* refusal_name(Refusal r);  // "wrong secret", "no such listen comm", ...

constexpr uint32_t kRefusalMagic = 0x46523252;  // "R2RF"; its first 2 bytes are not a TCP frame's
constexpr uint8_t kRefusalVersion = 1;
struct WireRefusal {
  uint32_t magic;          // kRefusalMagic
  uint8_t version;         // kRefusalVersion
  uint8_t reason;          // Refusal
  uint8_t from_kind;       // TransportKind of the sender
  uint8_t from_connector;  // 1: sent by the connecting side, 0: by the listening side
  uint8_t secret[16];      // connector -> listener: the handle's secret (proves it holds the
                           // handle); listener -> connector: zeros
  uint64_t listen_id;
  uint64_t conn_id;
  char text[216];  // NUL-terminated: the cause, naming both values, as both ends log it
};
static_assert(sizeof(WireRefusal) == 256, "WireRefusal layout");

WireRefusal make_refusal(Refusal r, TransportKind from, bool from_connector,
                         const uint8_t* secret16, uint64_t listen_id, uint64_t conn_id,
                         const std::string& text);
// True when the first `got` bytes that arrived start a WireRefusal (4 are enough to tell).
bool looks_like_refusal(const void* buf, size_t got);
// A complete WireRefusal from `buf`: false when the magic or version is wrong. The text is
// made NUL-terminated.
bool read_refusal(const void* buf, size_t len, WireRefusal* out);
// The status the refused side's connect or accept returns: kInvalidUsage for a configuration
// the two ends must share (transport, version, a must-agree setting), kRemote otherwise (the
// peer refused, or could not finish).
Status refusal_status(Refusal r);

// The message both ends log for a transport mismatch: the connecting and the listening
// process's transports, named.
std::string transport_mismatch_text(uint8_t connector_kind, uint8_t listener_kind);
// ... and for a wire version mismatch.
std::string version_mismatch_text(uint8_t kind, unsigned connector_version,
                                  unsigned listener_version);

// ---------------------------------------------------------------------------------------------
// Knobs: each end's own choice, exchanged in the setup (TCP: the rail query's HELLO and its
// answer; verbs: HELLO and REPLY).
struct WireKnobs {
  uint64_t chunk_size;       // R2CCL_CHUNK_SIZE, bytes
  uint8_t backup_paths;      // R2CCL_BACKUP_PATHS
  uint8_t streams;           // TCP: R2CCL_NSOCKS_PER_PATH; verbs: R2CCL_IB_QPS_PER_PATH
  uint8_t stripe;            // R2CCL_STRIPE
  uint8_t adaptive_routing;  // verbs: 1 when this end writes chunks in adaptive-routing mode
  uint8_t kind;              // TransportKind
  // R2CCL_EAGER_THRESHOLD, bytes, 24 bits little-endian (set_eager_threshold/
  // eager_threshold_of). These bytes were reserved and zero before, so an older peer announces
  // 0 and its connections stay without eager messages: no wire version change.
  uint8_t eager_threshold[3];
};
static_assert(sizeof(WireKnobs) == 16, "WireKnobs layout");
// Largest R2CCL_EAGER_THRESHOLD the knobs can carry (24 bits).
constexpr uint64_t kMaxWireEagerThreshold = (1u << 24) - 1;
// Stores `bytes` (capped at kMaxWireEagerThreshold) into k.eager_threshold.
void set_eager_threshold(WireKnobs* k, uint64_t bytes);
uint64_t eager_threshold_of(const WireKnobs& k);

// What a connection uses, from both ends' knobs; the same at both ends whichever calls it.
struct Negotiated {
  uint64_t chunk_size = 0;        // the smaller of the two
  int backup_paths = 0;           // the smaller of the two
  int streams = 1;                // the smaller of the two
  bool adaptive_routing = false;  // the sending side's (verbs)
  uint64_t eager_threshold = 0;   // the smaller of the two, at most chunk_size; 0: off
};
// `sender` are the knobs of the connection's sending (connecting) side. Each knob whose two
// values differ is warned about once per process, naming both values and the one in use.
Negotiated negotiate(const WireKnobs& sender, const WireKnobs& receiver);
// A WireKnobs a peer sent is usable: a chunk size in R2CCL_CHUNK_SIZE's range, at least one
// stream, at most `max_streams`, at most 3 backups. False with *why naming the field.
bool knobs_valid(const WireKnobs& k, int max_streams, std::string* why);

}  // namespace r2ccl::net
