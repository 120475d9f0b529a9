// Connection-level failure policy shared by every transport backend (TCP and verbs), so the
// rules do not fork per transport. Pure logic over timestamps from the caller's clock.
//
//  - Acknowledgement watchdog: a path with unacknowledged work whose acknowledgements have
//    made no progress for R2CCL_ACK_TIMEOUT has failed (a silent black hole: the link is up,
//    nothing comes back). "Progress" is the time of the last acknowledgement, or the time
//    the path went from idle to busy.
//  - Give-up: with no usable path, pending requests fail after R2CCL_FAILOVER_TIMEOUT, with
//    ncclRemoteError when every path ended because the peer went away (peer_gone), else
//    ncclSystemError (no local rail reaches the peer).
// Times are microseconds. Thread-safety: none; the owning connection serialises calls.
#pragma once

#include "r2ccl/clock.h"
#include "r2ccl/status.h"

namespace r2ccl::net {

inline bool ack_watchdog_expired(bool busy, TimeUs progress_at, TimeUs now, TimeUs timeout) {
  return busy && now - progress_at > timeout;
}

class GiveUpTimer {
 public:
  // Call on every progress pass. Returns true when the connection must give up now.
  bool update(bool any_usable, TimeUs now, TimeUs timeout) {
    if (any_usable) {
      since_ = 0;
      return false;
    }
    if (since_ == 0) since_ = now;
    return now - since_ >= timeout;
  }
  bool waiting() const { return since_ != 0; }
  TimeUs since() const { return since_; }
  static Status status(bool peer_gone) { return peer_gone ? Status::kRemote : Status::kSystem; }

 private:
  TimeUs since_ = 0;
};

}  // namespace r2ccl::net
