// Liveness shared per link: a link is one rail pair between this process and one peer
// process (local rail, peer rail, peer process). Every path of every connection that runs over
// the same link shares one LinkLive, so liveness is probed once per link, not once per path:
// NCCL opens channels x peers connections per process (512 for 64 peers x 8 channels), and a
// per-path heartbeat fast enough to find a black hole within 150 ms would multiply with them.
//
// The rules (engine/connection.cc, check_paths; docs/ARCHITECTURE.md, detection table):
//  - whatever any path of the link receives makes the link heard (`heard`);
//  - one healthy path of the link is its prober (`prober`, a path id): it probes every
//    R2CCL_HEARTBEAT_INTERVAL and applies the heartbeat rule for the link with its own
//    transport's evidence (TCP: the kernel's ACKs of its probes). A path whose prober stopped
//    probing for 3 periods (closed, failed, never progressed) takes over; a sending path takes
//    over from a receiving one (only a sender's idle probes give clean RTTs);
//  - a prober that finds the link silent fails its own path and posts a verdict
//    (`verdicts`, `silent_since`): every other path of the link that has heard nothing itself
//    since then fails too, at its next check;
//  - shadow routing: the prober's idle probe round trips feed the link's RttBaseline; when it
//    starts or ends an outlier period `shadowed` flips, and every sending path of the link
//    drains or returns.
// A transport that cannot name the peer process (PathIo::link_key 0) gets a private LinkLive
// per path: the same rules over one path, i.e. per-path probing.
//
// Threads: LinkLive's fields are atomics written by whichever thread drives a connection of
// the link (proxy or background thread); `rtt` under `rtt_mu`. LinkTable: any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "engine/path_health.h"
#include "r2ccl/clock.h"

namespace r2ccl::net {

struct LinkLive {
  explicit LinkLive(const HealthParams& hp) : rtt(hp) {}
  std::atomic<TimeUs> heard{0};           // latest frame from the peer on any path (us)
  std::atomic<uint64_t> prober{0};        // the probing path's id (0: none)
  std::atomic<bool> prober_sends{false};  // the prober is a sending path
  std::atomic<TimeUs> probed_at{0};       // when the prober last probed
  std::atomic<uint32_t> verdicts{0};      // the prober found the link silent: the count
  std::atomic<TimeUs> silent_since{0};    // the latest verdict: the link was last heard then
  std::atomic<bool> shadowed{false};      // the link's probe RTTs are outliers now
  // The prober's latest RTT sample: when, and whether it was above the baseline's limit.
  std::atomic<TimeUs> sampled_at{0};
  std::atomic<bool> sample_high{false};
  std::mutex rtt_mu;
  RttBaseline rtt;  // guarded by rtt_mu
};

class LinkTable {
 public:
  explicit LinkTable(const HealthParams& hp) : hp_(hp) {}
  // The link of `key` (PathIo::link_key), shared with every other holder of the same key; a
  // private one for key 0. Entries live while some path holds them.
  std::shared_ptr<LinkLive> get(uint64_t key);
  // Links in the table (shared ones only; stats and tests).
  size_t size();
  // True when at least one other link of the table was sampled within `window` of `now` and
  // every such link's latest sample was high too: RTTs that rise on every rail pair at once
  // are this machine or its peers stalling (CPU starvation, a paused process), not one rail
  // queueing, and draining every rail would move traffic nowhere. Any thread.
  bool every_other_high(const LinkLive* self, TimeUs now, TimeUs window);
  // A verdict, a shadow-routing change or a prober resigning on some link: the count, so the
  // runtime can progress its idle connections, which otherwise wait for their descriptors
  // and timers (Connection::idle_due). Any thread.
  void note_event() { events_.fetch_add(1, std::memory_order_release); }
  uint32_t events() const { return events_.load(std::memory_order_acquire); }

 private:
  HealthParams hp_;
  std::mutex mu_;
  std::unordered_map<uint64_t, std::weak_ptr<LinkLive>> map_;  // guarded by mu_
  std::atomic<uint32_t> events_{0};
};

// A path id for LinkLive::prober: unique in the process, never 0.
uint64_t new_link_path_id();

// A link key (PathIo::link_key) from the bytes that name a link (the transport's local rail,
// peer rail and peer process): a hash of them, never 0. Any thread.
uint64_t link_key_of(const void* bytes, size_t len);

}  // namespace r2ccl::net
