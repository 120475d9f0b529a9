// The one classification of the errors a socket operation returns (both transports: TCP
// paths and the verbs side channel), and the text that names their cause.
//
// Connection setup and the background reconnects of a running connection's paths ask
// classify_errno() what an errno means and act on the answer:
//   kTransient  the network or the peer may heal it soon (a link flap, a peer still starting,
//               a reset): setup retries with backoff until R2CCL_CONNECT_TIMEOUT; a running
//               connection's path is retried in the background, for ever, with backoff.
//   kBounded    transient for a moment only: ECONNREFUSED at connect. The handle proves the
//               peer's listener existed when it was made (TCP: the per-process listener, open
//               from init on; verbs: the listen comm's side channel, open before its handle),
//               so a refusal that lasts kRefusedGrace means the listen comm was closed or its
//               process exited: setup fails then. A reconnect that is refused tells the engine
//               that nothing listens any more (the peer process is gone).
//   kPermanent  retrying soon cannot help: a local limit (descriptors, ephemeral ports), a
//               permission, a configuration error. Setup fails at once, naming the cause and
//               the limit; a running connection's path stays down, is warned about once per
//               cause, and is retried slowly (descriptors or ports may free up): a backup path
//               that hits EMFILE never kills a running connection.
// The table itself (errno, operation, class, meaning) is kErrnoRules in sock_errors.cc and
// docs/ARCHITECTURE.md ("Errors at setup"). An errno it does not name is transient (bounded by
// R2CCL_CONNECT_TIMEOUT at setup), as every error was before the table existed.
//
// Thread-safety: everything here may be called from any thread (first_time() locks).
#pragma once

#include <cstdint>
#include <string>

#include "r2ccl/clock.h"

namespace r2ccl::net {

// The operation an errno came from: one number can mean different things (EADDRNOTAVAIL at
// bind: the rail's address is not assigned, it is being renumbered; at connect: no local port
// is free towards that destination).
enum class SockOp : uint8_t { kSocket, kBind, kListen, kConnect, kAccept, kIo };
const char* sock_op_name(SockOp op);  // "socket", "bind", "listen", "connect", "accept", "I/O"

enum class ErrClass : uint8_t { kTransient, kBounded, kPermanent };
const char* err_class_name(ErrClass c);  // "transient", "transient (bounded)", "permanent"

// How long setup retries a connect that keeps being refused (kBounded).
constexpr TimeUs kRefusedGrace = 500 * kUsPerMs;

ErrClass classify_errno(int err, SockOp op);
// What the errno means at that operation, in a few words ("the process's descriptor limit"),
// or "" when the table does not name it.
const char* errno_meaning(int err, SockOp op);

// strerror(err), then the limit involved, read now: "Too many open files (RLIMIT_NOFILE soft
// 64, hard 524288)", "Too many open files in system (fs.file-max 9223372036854775807)",
// "Cannot assign requested address (no free local port: net.ipv4.ip_local_port_range 32768
// 60999)". Other errnos: strerror alone.
std::string describe_errno(int err, SockOp op);

// The limits, as describe_errno names them.
std::string nofile_limit_text();  // "RLIMIT_NOFILE soft 64, hard 524288"
std::string port_range_text();    // "net.ipv4.ip_local_port_range 32768 60999"

// True the first time this process sees `key`, then false: one WARN per cause.
bool first_time(const std::string& key);

// A listener whose accept4 fails for want of descriptors or kernel memory (EMFILE, ENFILE,
// ENOBUFS, ENOMEM): the connection stays in the kernel's accept queue and the listener stays
// readable, so whoever polls it would spin. It pauses for kAcceptPause instead (TCP: the
// background thread leaves it out of its poll; verbs: accept() does not try), warned once per
// process and cause, naming the limit, and accepts again after: once descriptors are free,
// the connectors' retries get through. Thread: the one that owns the listener.
constexpr TimeUs kAcceptPause = 100 * kUsPerMs;
class AcceptGate {
 public:
  bool paused(TimeUs now) const { return now < until_; }
  // accept4 on `where` ("rail eth0") failed with err: true when the listener pauses.
  bool on_error(int err, const std::string& where, TimeUs now);

 private:
  TimeUs until_ = 0;
};

}  // namespace r2ccl::net
