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

#include <atomic>
#include <cstddef>
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
// the connectors' retries get through.
// A shortage is a run of failed accept4s less than kAcceptStarvedLimit apart. One that lasts
// kAcceptStarvedLimit, and whose latest accept4 failed, cannot be waited out: the process holds
// its own descriptors. Then the accept() in progress fails (kSystem, starved_text() names the
// limit) and the waiting connectors are refused with the same cause (refuse_with_spare), so both
// ends fail within 2 s of the first failed accept4 instead of R2CCL_CONNECT_TIMEOUT. Accepts
// that succeed in between end the run only once they have gone on succeeding for
// kAcceptRecovered (the process frees descriptors as it goes: it makes progress). A success
// right before the next failure does not: a connector that gave up on a stream (TCP: after
// 1 s without an answer) closes it, the listener's end of it frees one descriptor, and the next
// waiting connection takes it, so the process is as short as before (seen on loaded machines:
// when such an accept restarted the clock, the refusal came 2-3 s after the first failure).
// Thread: on_error() and paused() on the thread that owns the listener; starved() and
// starved_text() on any thread (TCP: the accept() threads read the background thread's gates).
constexpr TimeUs kAcceptPause = 100 * kUsPerMs;
constexpr TimeUs kAcceptStarvedLimit = 1500 * kUsPerMs;  // + one pause: within 2 s (issue 13)
constexpr TimeUs kAcceptRecovered = 500 * kUsPerMs;
class AcceptGate {
 public:
  AcceptGate() = default;
  AcceptGate(const AcceptGate& o)
      : until_(o.until_),
        last_(o.last_.load()),
        since_(o.since_.load()),
        err_(o.err_.load()),
        ok_since_(o.ok_since_.load()) {}
  bool paused(TimeUs now) const { return now < until_; }
  // accept4 on `where` ("rail eth0") failed with err: true when the listener pauses (any
  // other errno, EAGAIN included, leaves the gate as it was).
  bool on_error(int err, const std::string& where, TimeUs now);
  // accept4 succeeded at `now`: nothing is starved until the next failure, which continues the
  // shortage if it comes less than kAcceptStarvedLimit after the previous failure and less than
  // kAcceptRecovered after the first success since.
  void on_accepted(TimeUs now);
  // The latest accept4 failed for want of descriptors, in a shortage that has lasted
  // kAcceptStarvedLimit or longer, and one failed so at or after `since` (an accept() in
  // progress passes its start: a shortage that ended meanwhile, not yet seen by the listener's
  // owner, does not count).
  bool starved(TimeUs now, TimeUs since = 0) const;
  // "Too many open files (RLIMIT_NOFILE soft 32, hard 524288) for 2.1 s".
  std::string starved_text(TimeUs now) const;

 private:
  TimeUs until_ = 0;
  std::atomic<TimeUs> last_{0};      // the latest failed accept4
  std::atomic<TimeUs> since_{0};     // the first accept4 of the current shortage failed then
  std::atomic<int> err_{0};          // its errno
  std::atomic<TimeUs> ok_since_{0};  // the first accept4 that succeeded since the latest
                                     // failure; 0: the latest accept4 failed
};

// One descriptor the process keeps in reserve (/dev/null, opened by keep_spare_descriptor()
// while descriptors are plentiful, at transport init) so that a listener out of descriptors
// can still take one waiting connection to refuse it: the spare is closed, the connection
// accepted, whatever it sent discarded, `msg` (len bytes, at most a socket buffer) sent, the
// connection closed and the spare reopened. True when a connection was refused; false when
// none waits, the spare is missing, or another thread took the freed descriptor meanwhile.
// Thread-safe (one lock for the spare).
void keep_spare_descriptor();
bool refuse_with_spare(int listen_fd, const void* msg, size_t len);

}  // namespace r2ccl::net
