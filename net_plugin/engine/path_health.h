// PathHealth: the per-path state machine of the multipath engine. Pure logic: it is fed
// events with timestamps from an injected clock and owns no socket, thread or timer.
//
//   HEALTHY --failure--> FAILED --reconnected--> PROBING --N probes pass--> HEALTHY
//   HEALTHY --RTT outliers--> DRAINING (connected, no new chunks) --RTT normal--> HEALTHY
//
// Flapping: the `holddown_flaps`-th failure within `holddown_window` starts a hold-down
// (no reconnect attempts) of `holddown_min`, doubling per further flap up to `holddown_max`,
// back to the minimum after `holddown_reset` of stable health. A long outage is retried with
// exponential backoff (reconnect_min..reconnect_max) forever, never given up on.
// Times are microseconds (TimeUs). Thread-safety: none; the owner serialises calls.
#pragma once

#include <cstdint>
#include <deque>

#include "r2ccl/clock.h"
#include "r2ccl/params.h"

namespace r2ccl::net {

enum class PathState : uint8_t { kHealthy, kDraining, kFailed, kProbing };
const char* path_state_name(PathState s);

enum class FailCause : uint8_t {
  kNone,
  kLinkDown,        // netlink: the rail's interface lost carrier or went admin-down
  kSocketError,     // send/recv error (ENETUNREACH, ETIMEDOUT from TCP_USER_TIMEOUT, ...)
  kPeerClosed,      // end-of-file or reset from the peer
  kAckTimeout,      // acknowledgement watchdog on a busy path
  kHeartbeatMiss,   // nothing received for 3 heartbeat periods
  kPeerNotice,      // the other end declared the path failed
  kProtocol,        // the peer sent a frame that breaks the protocol
  kSetup,           // the path could not be connected at setup
  kRetryExceeded,   // verbs: a work completion with retry-exceeded or flush status
  kAsyncError,      // verbs: an asynchronous error event on one of the path's QPs or its CQ
  kAddressChanged,  // the address a path's sockets use at either end was removed or replaced
};
const char* fail_cause_name(FailCause c);
// True for causes that say the peer process is gone (or broke the protocol) rather than a
// local rail problem: with no path left they fail requests with ncclRemoteError at once.
bool cause_means_peer_gone(FailCause c);

struct HealthParams {
  int probe_count = 3;
  TimeUs reconnect_min = 50 * kUsPerMs;
  TimeUs reconnect_max = 2 * kUsPerSec;
  int holddown_flaps = 3;
  TimeUs holddown_window = 10 * kUsPerSec;
  TimeUs holddown_min = 1 * kUsPerSec;
  TimeUs holddown_max = 60 * kUsPerSec;
  TimeUs holddown_reset = 60 * kUsPerSec;
  double latency_sigma = 3.0;  // 0 disables shadow routing
  int rtt_baseline_samples = 8;
  int rtt_outlier_run = 3;  // consecutive outliers to drain, consecutive normals to return
  // The outliers of a run must also span this long: a stall of the machine shorter than that
  // is not a rail queueing (3 probes spanned 300 ms at the old 100 ms heartbeat; at 30 ms, 3
  // probes fit inside one 100 ms stall of a loaded host).
  TimeUs rtt_outlier_span = 300 * kUsPerMs;
  TimeUs rtt_floor = 5 * kUsPerMs;  // an RTT within baseline + floor is never an outlier
};

// The R2CCL_* knobs (probe count, reconnect backoff, hold-down, latency sigma) as HealthParams.
HealthParams health_params_from(const Config& cfg);

class PathHealth {
 public:
  PathHealth(const HealthParams& p, PathState initial, TimeUs now);

  PathState state() const { return state_; }
  bool carries_data() const { return state_ == PathState::kHealthy; }
  bool connected() const { return state_ != PathState::kFailed; }
  FailCause last_cause() const { return cause_; }

  // Any failure. Returns true if the path was not already failed (a new failure). A failure
  // with cause kAddressChanged does not count as a flap (no hold-down).
  bool on_failure(FailCause cause, TimeUs now);
  // The transport connected the path again; probing starts.
  void on_reconnected(TimeUs now);
  // A reconnect attempt failed: back off.
  void on_reconnect_failed(TimeUs now);
  // One probe round trip passed. Returns true when this made the path HEALTHY (failback).
  bool on_probe_pass(TimeUs now);
  // The rail's link came back (netlink). Allows an immediate reconnect attempt unless held down.
  void on_link_up(TimeUs now);
  // Shadow routing (RttBaseline below, kept per rail pair): drain a HEALTHY path (true) or
  // bring a DRAINING one back (false). Returns true when the state changed; any other state
  // is left alone.
  bool set_draining(bool on);

  // FAILED, not held down, and the backoff delay has passed.
  bool should_reconnect(TimeUs now) const;
  bool held_down(TimeUs now) const { return now < holddown_until_; }
  TimeUs holddown_until() const { return holddown_until_; }
  TimeUs current_holddown() const { return holddown_len_; }
  // True exactly once after on_failure started a new hold-down (for the log line).
  bool take_holddown_started() {
    bool r = holddown_started_;
    holddown_started_ = false;
    return r;
  }

 private:
  HealthParams p_;
  PathState state_;
  FailCause cause_ = FailCause::kNone;
  TimeUs healthy_since_;
  TimeUs next_attempt_ = 0;
  TimeUs backoff_;
  int probes_ = 0;
  std::deque<TimeUs> failures_;  // failure times inside the flap window
  TimeUs holddown_until_ = 0;
  TimeUs holddown_len_ = 0;  // 0 = next hold-down uses holddown_min
  bool holddown_started_ = false;
};

// Shadow routing's judge: the baseline of idle probe round-trip times (Welford over the first
// rtt_baseline_samples, then refined by normal samples with bounded weight so drift is
// followed) and runs of outliers (above mean + max(latency_sigma x std, rtt_floor)).
// rtt_outlier_run outliers in a row, spanning rtt_outlier_span, start an outlier period, as
// many normal samples in a row
// end it. latency_sigma 0: never an outlier. Times in microseconds. Thread-safety: none.
class RttBaseline {
 public:
  explicit RttBaseline(const HealthParams& p) : p_(p) {}
  // One round trip, measured at `now`. Returns +1 when an outlier period starts, -1 when it
  // ends, 0 otherwise.
  int sample(TimeUs rtt, TimeUs now);
  bool outlier() const { return outlier_; }
  // Whether the latest sample was above the limit (an outlier, counted or not).
  bool last_high() const { return last_high_; }
  // Forgets a run that just started an outlier period (it was not the path's: the caller
  // saw every path's RTT rise at once), so a later run of outliers starts one again.
  void forget_run() {
    outlier_ = false;
    outliers_ = 0;
  }
  double mean_us() const { return mean_; }
  double std_us() const;

 private:
  HealthParams p_;
  int n_ = 0;
  double mean_ = 0, m2_ = 0;
  int outliers_ = 0, normals_ = 0;
  TimeUs run_start_ = 0;  // the first outlier of the current run
  bool outlier_ = false;
  bool last_high_ = false;
};

}  // namespace r2ccl::net
