#include "transport/handshake.h"

#include <arpa/inet.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "r2ccl/log.h"
#include "sock/sock_errors.h"

namespace r2ccl::net {
namespace {

constexpr uint64_t kMinChunk = 4096, kMaxChunk = 64ull << 20;  // R2CCL_CHUNK_SIZE's range
constexpr int kMaxBackups = 3;                                 // R2CCL_BACKUP_PATHS's range

const char* streams_var(uint8_t kind) {
  return kind == static_cast<uint8_t>(TransportKind::kIb) ? "R2CCL_IB_QPS_PER_PATH"
                                                          : "R2CCL_NSOCKS_PER_PATH";
}

// One WARN per process and knob whose two ends differ (the first pair of values seen).
void note_knob(const char* var, const std::string& text) {
  if (first_time(std::string("knob:") + var)) R2CCL_WARN("%s", text.c_str());
}

void note_min(const char* var, uint64_t sender, uint64_t receiver) {
  if (sender == receiver) return;
  char t[256];
  snprintf(t, sizeof(t),
           "%s differs between the two ends of a connection: %llu at the sending end, %llu at "
           "the receiving end; the connection uses %llu (the smaller; both ends agree on it; "
           "warned once per process)",
           var, static_cast<unsigned long long>(sender), static_cast<unsigned long long>(receiver),
           static_cast<unsigned long long>(std::min(sender, receiver)));
  note_knob(var, t);
}

}  // namespace

std::string transport_kind_name(uint8_t kind) {
  switch (static_cast<TransportKind>(kind)) {
    case TransportKind::kTcp: return "TCP";
    case TransportKind::kIb: return "IB (verbs)";
  }
  return "unknown transport " + std::to_string(kind);
}

std::string wire_addr_string(const WireAddr& a) {
  char buf[INET6_ADDRSTRLEN] = "?";
  inet_ntop(a.family == AF_INET6 ? AF_INET6 : AF_INET, a.addr, buf, sizeof(buf));
  const std::string host = a.family == AF_INET6 ? "[" + std::string(buf) + "]" : buf;
  return host + ":" + std::to_string(ntohs(a.port));
}

const char* refusal_name(Refusal r) {
  switch (r) {
    case Refusal::kWrongSecret: return "wrong secret";
    case Refusal::kUnknownListen: return "no such listen comm";
    case Refusal::kUnknownConn: return "no such connection";
    case Refusal::kVersion: return "wire version mismatch";
    case Refusal::kTransport: return "transport mismatch";
    case Refusal::kMismatch: return "setting mismatch";
    case Refusal::kMalformed: return "malformed setup message";
    case Refusal::kAborted: return "setup aborted";
    case Refusal::kNoResources: return "out of descriptors";
  }
  return "refused";
}

WireRefusal make_refusal(Refusal r, TransportKind from, bool from_connector,
                         const uint8_t* secret16, uint64_t listen_id, uint64_t conn_id,
                         const std::string& text) {
  WireRefusal w{};
  w.magic = kRefusalMagic;
  w.version = kRefusalVersion;
  w.reason = static_cast<uint8_t>(r);
  w.from_kind = static_cast<uint8_t>(from);
  w.from_connector = from_connector ? 1 : 0;
  if (secret16) memcpy(w.secret, secret16, sizeof(w.secret));
  w.listen_id = listen_id;
  w.conn_id = conn_id;
  snprintf(w.text, sizeof(w.text), "%s", text.c_str());
  return w;
}

bool looks_like_refusal(const void* buf, size_t got) {
  if (got < sizeof(uint32_t)) return false;
  uint32_t m;
  memcpy(&m, buf, sizeof(m));
  return m == kRefusalMagic;
}

bool read_refusal(const void* buf, size_t len, WireRefusal* out) {
  if (len < sizeof(WireRefusal)) return false;
  memcpy(out, buf, sizeof(*out));
  out->text[sizeof(out->text) - 1] = '\0';
  return out->magic == kRefusalMagic && out->version == kRefusalVersion;
}

Status refusal_status(Refusal r) {
  switch (r) {
    case Refusal::kVersion:
    case Refusal::kTransport:
    case Refusal::kMismatch: return Status::kInvalidUsage;
    default: return Status::kRemote;
  }
}

std::string transport_mismatch_text(uint8_t connector_kind, uint8_t listener_kind) {
  return "transport mismatch: the connecting process uses " + transport_kind_name(connector_kind) +
         ", the listening process uses " + transport_kind_name(listener_kind) +
         "; every process of a job must pick the same transport (R2CCL_TRANSPORT; auto picks "
         "verbs only where an HCA port is active)";
}

std::string version_mismatch_text(uint8_t kind, unsigned connector_version,
                                  unsigned listener_version) {
  return "wire version mismatch (" + transport_kind_name(kind) +
         "): the connecting process speaks version " + std::to_string(connector_version) +
         ", the listening process version " + std::to_string(listener_version) +
         "; every process of a job must run the same r2ccl";
}

void set_eager_threshold(WireKnobs* k, uint64_t bytes) {
  bytes = std::min(bytes, kMaxWireEagerThreshold);
  for (int i = 0; i < 3; ++i) k->eager_threshold[i] = static_cast<uint8_t>(bytes >> (8 * i));
}

uint64_t eager_threshold_of(const WireKnobs& k) {
  return static_cast<uint64_t>(k.eager_threshold[0]) |
         static_cast<uint64_t>(k.eager_threshold[1]) << 8 |
         static_cast<uint64_t>(k.eager_threshold[2]) << 16;
}

Negotiated negotiate(const WireKnobs& sender, const WireKnobs& receiver) {
  Negotiated n;
  n.chunk_size = std::min(sender.chunk_size, receiver.chunk_size);
  const uint64_t es = eager_threshold_of(sender), er = eager_threshold_of(receiver);
  n.eager_threshold = std::min({es, er, n.chunk_size});
  note_min("R2CCL_EAGER_THRESHOLD", es, er);
  n.backup_paths = std::min(sender.backup_paths, receiver.backup_paths);
  n.streams = std::min(sender.streams, receiver.streams);
  n.adaptive_routing = sender.adaptive_routing != 0;
  note_min("R2CCL_CHUNK_SIZE", sender.chunk_size, receiver.chunk_size);
  note_min("R2CCL_BACKUP_PATHS", sender.backup_paths, receiver.backup_paths);
  note_min(streams_var(sender.kind), sender.streams, receiver.streams);
  if (sender.stripe != receiver.stripe)
    note_knob("R2CCL_STRIPE",
              std::string("R2CCL_STRIPE differs between the two ends of a connection: ") +
                  (sender.stripe ? "on" : "off") + " at the sending end, " +
                  (receiver.stripe ? "on" : "off") +
                  " at the receiving end; each connection follows its sender's setting (only "
                  "the sender schedules chunks; the receiver takes them on any path; warned "
                  "once per process)");
  if (sender.kind == static_cast<uint8_t>(TransportKind::kIb) &&
      sender.adaptive_routing != receiver.adaptive_routing)
    note_knob("R2CCL_IB_ADAPTIVE_ROUTING",
              std::string("R2CCL_IB_ADAPTIVE_ROUTING differs between the two ends of a "
                          "connection: ") +
                  (sender.adaptive_routing ? "on" : "off") + " at the sending end, " +
                  (receiver.adaptive_routing ? "on" : "off") +
                  " at the receiving end; each connection uses its sender's write mode and the "
                  "receiver adapts (warned once per process)");
  return n;
}

bool knobs_valid(const WireKnobs& k, int max_streams, std::string* why) {
  char t[160];
  if (k.chunk_size < kMinChunk || k.chunk_size > kMaxChunk) {
    snprintf(t, sizeof(t), "chunk size %llu is outside [%llu, %llu]",
             static_cast<unsigned long long>(k.chunk_size),
             static_cast<unsigned long long>(kMinChunk),
             static_cast<unsigned long long>(kMaxChunk));
  } else if (k.streams < 1 || k.streams > max_streams) {
    snprintf(t, sizeof(t), "%u streams per path is outside [1, %d]", k.streams, max_streams);
  } else if (k.backup_paths > kMaxBackups) {
    snprintf(t, sizeof(t), "%u backup paths is above %d", k.backup_paths, kMaxBackups);
  } else {
    return true;
  }
  *why = t;
  return false;
}

}  // namespace r2ccl::net
