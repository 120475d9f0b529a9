#include "path_health.h"

#include <algorithm>
#include <cmath>

namespace r2ccl::net {

HealthParams health_params_from(const Config& c) {
  HealthParams h;
  h.probe_count = static_cast<int>(c.probe_count);
  h.reconnect_min = c.reconnect_min;
  h.reconnect_max = c.reconnect_max;
  h.holddown_flaps = static_cast<int>(c.holddown_flaps);
  h.holddown_window = c.holddown_window;
  h.holddown_min = c.holddown_min;
  h.holddown_max = c.holddown_max;
  h.holddown_reset = c.holddown_reset;
  h.latency_sigma = c.latency_sigma;
  h.rtt_floor = c.latency_min_excess;
  return h;
}

const char* path_state_name(PathState s) {
  switch (s) {
    case PathState::kHealthy: return "healthy";
    case PathState::kDraining: return "draining";
    case PathState::kFailed: return "failed";
    case PathState::kProbing: return "probing";
  }
  return "?";
}

const char* fail_cause_name(FailCause c) {
  switch (c) {
    case FailCause::kNone: return "none";
    case FailCause::kLinkDown: return "link down";
    case FailCause::kSocketError: return "socket error";
    case FailCause::kPeerClosed: return "peer closed the connection";
    case FailCause::kAckTimeout: return "acknowledgement timeout";
    case FailCause::kHeartbeatMiss: return "heartbeat miss";
    case FailCause::kPeerNotice: return "failure notice from peer";
    case FailCause::kProtocol: return "protocol error";
    case FailCause::kSetup: return "not connected at setup";
    case FailCause::kRetryExceeded: return "completion error";
    case FailCause::kAsyncError: return "async error event";
    case FailCause::kAddressChanged: return "address changed";
  }
  return "?";
}

bool cause_means_peer_gone(FailCause c) {
  return c == FailCause::kPeerClosed || c == FailCause::kProtocol;
}

PathHealth::PathHealth(const HealthParams& p, PathState initial, TimeUs now)
    : p_(p), state_(initial), healthy_since_(now), backoff_(p.reconnect_min) {}

bool PathHealth::on_failure(FailCause cause, TimeUs now) {
  if (state_ == PathState::kFailed) return false;
  const bool was_up = state_ == PathState::kHealthy || state_ == PathState::kDraining;
  state_ = PathState::kFailed;
  cause_ = cause;
  probes_ = 0;
  if (!was_up) {
    // Failed again while probing: keep backing off, so a rail that accepts connections but
    // never passes its probes is retried ever more slowly (up to reconnect_max).
    backoff_ = std::min(backoff_ * 2, p_.reconnect_max);
    next_attempt_ = std::max(now + backoff_, holddown_until_);
    return true;
  }
  backoff_ = p_.reconnect_min;
  next_attempt_ = now + backoff_;
  // A renumbered rail did nothing wrong: an address change (DHCP, NetworkManager) is not a
  // flap, and must not hold a healthy rail down.
  if (cause == FailCause::kAddressChanged) return true;
  // A stable stretch resets the hold-down ladder.
  if (now - healthy_since_ >= p_.holddown_reset) {
    holddown_len_ = 0;
    failures_.clear();
  }
  failures_.push_back(now);
  while (!failures_.empty() && now - failures_.front() > p_.holddown_window) failures_.pop_front();
  if (static_cast<int>(failures_.size()) >= p_.holddown_flaps) {
    holddown_len_ =
        holddown_len_ == 0 ? p_.holddown_min : std::min(holddown_len_ * 2, p_.holddown_max);
    holddown_until_ = now + holddown_len_;
    next_attempt_ = std::max(next_attempt_, holddown_until_);
    holddown_started_ = true;
  }
  return true;
}

void PathHealth::on_reconnected(TimeUs now) {
  (void)now;
  state_ = PathState::kProbing;
  probes_ = 0;
}

void PathHealth::on_reconnect_failed(TimeUs now) {
  if (state_ == PathState::kProbing) state_ = PathState::kFailed;
  backoff_ = std::min(backoff_ * 2, p_.reconnect_max);
  next_attempt_ = std::max(now + backoff_, holddown_until_);
}

bool PathHealth::on_probe_pass(TimeUs now) {
  if (state_ != PathState::kProbing) return false;
  if (++probes_ < p_.probe_count) return false;
  state_ = PathState::kHealthy;
  healthy_since_ = now;
  backoff_ = p_.reconnect_min;
  return true;
}

void PathHealth::on_link_up(TimeUs now) {
  if (state_ != PathState::kFailed) return;
  backoff_ = p_.reconnect_min;
  next_attempt_ = std::max(now, holddown_until_);
}

bool PathHealth::should_reconnect(TimeUs now) const {
  return state_ == PathState::kFailed && now >= next_attempt_ && now >= holddown_until_;
}

bool PathHealth::set_draining(bool on) {
  if (on && state_ == PathState::kHealthy) {
    state_ = PathState::kDraining;
    return true;
  }
  if (!on && state_ == PathState::kDraining) {
    state_ = PathState::kHealthy;
    return true;
  }
  return false;
}

double RttBaseline::std_us() const { return n_ > 1 ? std::sqrt(m2_ / (n_ - 1)) : 0.0; }

int RttBaseline::sample(TimeUs rtt, TimeUs now) {
  if (p_.latency_sigma <= 0) return 0;
  const double x = static_cast<double>(rtt);
  if (n_ < p_.rtt_baseline_samples) {
    ++n_;
    const double d = x - mean_;
    mean_ += d / n_;
    m2_ += d * (x - mean_);
    last_high_ = false;
    return 0;
  }
  const double limit =
      mean_ + std::max(p_.latency_sigma * std_us(), static_cast<double>(p_.rtt_floor));
  last_high_ = x > limit;
  if (x > limit) {
    normals_ = 0;
    if (outliers_++ == 0) run_start_ = now;
    if (outliers_ >= p_.rtt_outlier_run && now - run_start_ >= p_.rtt_outlier_span && !outlier_) {
      outlier_ = true;
      return +1;
    }
    return 0;
  }
  outliers_ = 0;
  if (n_ < 64) {
    ++n_;
    const double d = x - mean_;
    mean_ += d / n_;
    m2_ += d * (x - mean_);
  }
  if (outlier_ && ++normals_ >= p_.rtt_outlier_run) {
    outlier_ = false;
    normals_ = 0;
    return -1;
  }
  return 0;
}

}  // namespace r2ccl::net
