// The snapshot daemons' agreed record and the coordinator's decisions (issue 15), as pure logic
// (no sockets, no threads, an injected clock), next to Membership and CutTracker.
//
// Who decides: the coordinator is elected through etcd (control_plane.h) and writes the record
// only in transactions guarded by its election key, so two coordinators can never both write.
// What it decides, every period, from what etcd says (the registered members, each under a
// lease, and the suspicions the members published) and from its consistent-cut view:
//  - Evictions. A member is evicted only when at least two other registered members suspect it
//    (their accrual detectors stopped hearing it) and neither of those two is itself being
//    evicted. One cut link between two live nodes makes each suspect the other once: neither
//    has a second observer, so nobody is evicted (and never both). A node that nobody hears is
//    evicted as soon as two others agree; a dead one also loses its lease (the lease path).
//    With fewer than three members, only the lease path evicts.
//  - The record. A new record (epoch + 1) whenever the set of (id, incarnation) changes: a lease
//    expired or was revoked, a member was evicted, a member joined, or a member restarted (a new
//    incarnation is a loss and a join). A record that loses a member is a restore point: its
//    generation is one more than before and its restore_step is the newest step the cut view
//    holds complete without the lost members (the same step for every rank); a join alone keeps
//    both. When no step is complete without them, restore_step is none and the generation stays
//    (nobody can roll back, so no timeline ends). Such a record waits until the cut view is ready
//    (every member answered the marker for everything it holds, or 5 periods after this coordinator
//    started) so a coordinator that just took over never publishes what an empty view says.
//  - Grace: after this node's etcd connection came back, the coordinator does not drop members
//    whose keys are missing for `grace` (one lease TTL): daemons whose leases ran out during an
//    etcd outage re-register with their old incarnation and keep their place, with no new
//    epoch. The first record waits `grace` after taking over, so daemons started together are
//    all in epoch 1. A plain takeover (the old coordinator died) drops the missing at once.
// Thread-safety: none; the daemon's event loop owns a Planner. The encode/decode functions are
// pure and may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/health_board.h"

namespace r2ccl::snap {

// A registered daemon: etcd key <prefix>/members/<id>, attached to its lease.
struct MemberInfo {
  uint32_t id = 0;
  uint64_t incarnation = 0;  // random, new at every start and after an eviction
  int64_t lease = 0;         // etcd lease id
  float usable_gbps = 0;     // its node's usable network bandwidth, GB/s (0 = unknown)
  std::string job;           // digest of the job token (control_plane.h): members of another
                             // job sharing the prefix by mistake are ignored
  bool operator==(const MemberInfo& o) const { return id == o.id && incarnation == o.incarnation; }
};

// The agreed record: etcd key <prefix>/record, and <prefix>/records/<epoch> (one per epoch,
// created only if absent). JSON, e.g.
//   {"epoch":3,"generation":1,"restore_step":41,"restore_points":[41],"generation_step":41,
//    "leader":0,"leader_revision":17,
//    "members":[{"id":0,"incarnation":"123","gbps":12.5},...]}
// (restore_step null: no step is restorable; incarnations as strings, 64-bit; generation_step,
// the newest restore point or null, is written for readers of the older form, which had only
// it, and read when restore_points is absent.)
struct Record {
  uint64_t epoch = 0;       // 1, 2, ...: one per membership, never reused (etcd keeps them)
  uint64_t generation = 0;  // restore points so far; shards carry the generation they were taken in
  std::optional<uint64_t> restore_step;  // every rank restores this step in this epoch
  // The step each generation began from (the restore step of the record that started it):
  // generation k >= 1 began from restore_points[k - 1], so there are `generation` of them. A
  // shard of an older generation belongs to this timeline up to the smallest restore point of
  // the generations after its own; a step after that was rolled back.
  std::vector<uint64_t> restore_points;
  uint32_t leader = 0;              // the coordinator that wrote it
  int64_t leader_revision = 0;      // its election key's create revision (fencing token)
  std::vector<MemberInfo> members;  // ascending id
  bool has(uint32_t id) const;
  const MemberInfo* find(uint32_t id) const;
  bool same_members(const std::vector<MemberInfo>& m) const;
};
// Restore points a record may hold (decode_record refuses more): one per node loss that had a
// complete step to go back to, far beyond any job's, and small enough that the record stays
// well inside etcd's request limit (~1.5 MiB) and shard_current stays cheap.
constexpr uint64_t kMaxGenerations = 4096;
std::string encode_record(const Record& r);
// Returns false with *err saying what is malformed (the caller names the key).
bool decode_record(const std::string& text, Record* r, std::string* err);
std::string encode_member(const MemberInfo& m);
bool decode_member(const std::string& text, MemberInfo* m, std::string* err);
// The board's form: n_nodes = highest member id + 1 (at least `configured`), member bits,
// per-node usable GB/s.
board::AgreedRecord to_board(const Record& r, uint32_t configured);

// Whether a shard taken in generation `shard_generation` at `step` belongs to the timeline of
// `record`: its own generation, or an older one at or before every restore point since (a
// step after one of them was rolled back there, even if a later restore point is higher).
// False for older generations when the record lacks its restore points.
bool shard_current(const Record& record, uint64_t shard_generation, uint64_t step);

class Planner {
 public:
  // `period`: the heartbeat period; `grace`: see above (one lease TTL), both microseconds.
  Planner(uint32_t self, TimeUs period, TimeUs grace);

  // This node became coordinator at `now`: the first-record wait and the cut view's readiness
  // deadline start.
  void took_over(TimeUs now);
  // This node's etcd connection came back at `now` (coordinator or not): the grace starts.
  void etcd_back(TimeUs now);

  struct Input {
    std::vector<MemberInfo> registered;                // members/ keys, any order
    std::set<std::pair<uint32_t, uint32_t>> suspects;  // (target, observer)
    std::optional<Record> current;                     // the record in etcd, if any
    std::optional<uint64_t> newest_complete;  // the cut view, over `registered` minus evicted
    bool cut_ready = false;                   // every registered member answered the marker
    TimeUs now = 0;
  };
  struct Plan {
    std::vector<uint32_t> evict;   // members to evict (their keys deleted, leases revoked)
    std::optional<Record> next;    // the record to write, if the membership changed
    std::string why;               // one line for the log ("node 2 lost (lease)", ...)
    bool waiting_for_cut = false;  // a restore record is due but the cut view is not ready
  };
  // The members to evict and the record to write now. `members_after` (optional) receives the
  // member set the cut view should follow (registered minus evicted, in grace: plus the
  // current record's members still missing).
  Plan plan(const Input& in, std::vector<MemberInfo>* members_after = nullptr) const;

  TimeUs grace_until() const { return grace_until_; }
  TimeUs cut_deadline() const { return cut_deadline_; }

 private:
  uint32_t self_;
  TimeUs period_, grace_;
  TimeUs grace_until_ = 0, first_until_ = 0, cut_deadline_ = 0;
};

}  // namespace r2ccl::snap
