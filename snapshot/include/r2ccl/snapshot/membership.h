// Membership of the snapshot daemons (issue 6): the peer list, heartbeat failure detection and
// the coordinator rule, as pure logic driven by an injected clock (no sockets, no threads).
//
//  - A peer is live from its first heartbeat (only this node is live at the start). A live
//    node that misses `miss_limit` (3) heartbeat periods in a row is declared failed; one
//    heard from again is live again (a restarted daemon rejoins).
//  - The coordinator is the lowest live node id, and it acts only while it sees a strict
//    majority of all configured nodes (itself included), so the two sides of a partition can
//    never both act: at most one side has a majority.
//  - A starting node listens for `miss_limit` periods before it may act (the time in which a
//    silent peer would be declared failed): daemons started together hear each other first, so
//    a node whose lower-id peer's first heartbeat is merely late does not speak for a
//    membership without it.
//  - Every change of the live set increments the membership epoch (the agreed record's epoch
//    once the coordinator publishes it).
// Thread-safety: none; the daemon's event loop owns a Membership.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/health_board.h"

namespace r2ccl::snap {

struct PeerSpec {
  uint32_t id = 0;    // node id, unique in the job, < board::kMaxNodes
  std::string host;   // address or name
  uint16_t port = 0;  // the daemon's peer port
};

// Parses a host file: one node per line, "ID HOST:PORT" ("ID [IPV6]:PORT" for IPv6); '#' starts
// a comment; blank lines are ignored. Returns false with *err naming the line and the accepted
// form on a malformed line, a duplicate id or address, an id >= board::kMaxNodes, or no node.
bool parse_peers(const std::string& text, std::vector<PeerSpec>* out, std::string* err);

class Membership {
 public:
  // `self` must be one of `ids`. `period` is the heartbeat period (microseconds).
  Membership(uint32_t self, const std::vector<uint32_t>& ids, TimeUs period, TimeUs now,
             int miss_limit = 3);

  // A heartbeat (or any authenticated message) from `from` at `now`. Unknown ids are ignored
  // (returns false).
  bool on_heard(uint32_t from, TimeUs now);
  // Declares failed every live node silent for more than miss_limit periods, and ends the
  // start-up listening time once miss_limit periods have passed since construction. Returns
  // the nodes newly declared failed (empty most of the time). Call at least once per period.
  std::vector<uint32_t> tick(TimeUs now);

  bool alive(uint32_t id) const;
  std::vector<uint32_t> live() const;  // ascending
  size_t configured() const { return ids_.size(); }
  uint32_t self() const { return self_; }
  uint32_t coordinator() const;  // lowest live id (self is always live to itself)
  bool has_majority() const { return 2 * live().size() > ids_.size(); }
  // True when this node is the coordinator and sees a majority: only then may it act
  // (publish the agreed record, run marker rounds, announce recoveries).
  // Never during the start-up listening time (settled() false).
  bool acts_as_coordinator() const { return settled_ && coordinator() == self_ && has_majority(); }
  bool settled() const { return settled_; }
  uint64_t epoch() const { return epoch_; }

  // The agreed record for the current membership: epoch, n_nodes = the highest configured id
  // + 1, the live nodes' bits, and each live node's usable bandwidth (GB/s) from `usable_gbps`
  // (indexed by node id; missing entries 0 = unknown).
  board::AgreedRecord agreed_record(const std::vector<float>& usable_gbps) const;

 private:
  struct Node {
    uint32_t id;
    TimeUs last_heard;
    bool alive;
  };
  uint32_t self_;
  TimeUs period_;
  TimeUs started_;
  bool settled_ = false;
  int miss_limit_;
  std::vector<uint32_t> ids_;  // ascending
  std::vector<Node> nodes_;    // same order
  uint64_t epoch_ = 1;
};

}  // namespace r2ccl::snap
