// The snapshot daemon's control plane on etcd (issue 15): liveness leases, the coordinator
// election, the agreed record, the consistent-cut step, suspicions and the KV, all under one
// per-job key prefix. The decisions are coordinator.h's (pure, on the daemon's loop); this class
// only talks to etcd, on a thread of its own, so a slow or unreachable etcd never stalls the
// data plane or the heartbeats.
//
// Keys (P = the job prefix, e.g. "/r2ccl/JOB/"):
//   P members/NNNN          MemberInfo JSON, attached to the daemon's lease (--lease-ttl, 3 s)
//   P election/NNNN         empty, attached to the same lease; the coordinator is the member
//                           whose key has the lowest create revision, and that revision is its
//                           fencing token
//   P w/record              the agreed record (coordinator.h), and P records/EEEEEEEEEEEEEEEEEEEE
//                           one per epoch, created only if absent, in the same transaction
//   P w/cut                 {"step":S,"generation":G,"epoch":E}: the newest complete step
//   P w/kv/KEY              a client's value, created only if absent (first writer wins)
//   P suspect/TTTT/OOOO     node OOOO does not hear node TTTT (attached to OOOO's lease)
// Every daemon watches P w/ only (the record, the cut, the KV): the churn of members,
// elections and suspicions is read by the coordinator alone, so a node loss in a large job does
// not fan hundreds of suspicion events out to every daemon. A daemon notices its own member key
// gone (an eviction) at its next keep-alive, which also reads the key.
// Every write of the coordinator (record, cut, eviction) is one transaction that first
// compares its election key's create revision with the one it won with: a coordinator whose
// lease ran out (paused, partitioned from etcd) is refused by etcd itself, whatever it thinks.
//
// Registration: a lease, then the member key (this start's incarnation) and a fresh election
// key. A predecessor on the same node id (a restart within the TTL) has its lease revoked
// first. When the member key disappears while the lease still lives, the node was evicted: it
// registers again with a new incarnation. When the lease itself ran out (an etcd outage longer
// than the TTL), it registers again with the same incarnation, so the coordinator keeps it in
// the record without a new epoch.
//
// etcd unreachable: one WARN line when it goes and one INFO line when it comes back; writes
// queued meanwhile (suspicions, KV) are retried, coordinator writes are dropped (the next period
// decides again on fresh reads).
//
// Thread-safety: the request methods (write_record, write_cut, evict, suspect, kv_put,
// set_gbps) may be called from any thread; they queue work for the control thread. The Events
// callbacks run on the control thread or the watch thread, never concurrently with themselves
// for the same callback; they must be quick (post to the caller's loop).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "r2ccl/clock.h"
#include "r2ccl/snapshot/coordinator.h"
#include "r2ccl/snapshot/etcd.h"

namespace r2ccl::snap {

class ControlPlane {
 public:
  struct Config {
    etcd::Options etcd;
    std::string prefix;  // ends with '/'
    uint32_t self = 0;
    TimeUs period = 500 * kUsPerMs;  // leader reads and suspicion refresh
    int64_t lease_ttl_s = 3;         // 1..3600
    std::string token;               // the job token: its SHA-256 digest marks our members
    // Test hook: with a pause longer than 3 periods between two control-loop turns (the
    // process was stopped), write the last record once more before reading anything, so a
    // test can see etcd refuse a fenced write.
    bool test_write_after_pause = false;
    // Test hook: milliseconds to wait, in every registration, right before the write that
    // makes this incarnation the member (a slow etcd during a restart), 0..10000.
    int test_register_delay_ms = 0;
  };
  struct View {  // what the coordinator reads every period
    std::vector<MemberInfo> registered;
    std::set<std::pair<uint32_t, uint32_t>> suspects;  // (target, observer)
    std::optional<Record> record;
    int64_t record_revision = 0;  // mod revision of P record (0: absent)
  };
  struct Events {
    std::function<void(const Record&)> record;                       // watch thread
    std::function<void(uint64_t step, uint64_t generation)> cut;     // watch thread
    std::function<void(const std::string&, const std::string&)> kv;  // watch thread
    std::function<void(bool leader)> leader;                         // control thread
    std::function<void(const View&)> view;                           // control thread, leader
    std::function<void(bool reachable)> etcd;                        // control thread
    std::function<void(uint64_t incarnation)> registered;            // control thread
    std::function<void(uint64_t step)> cut_failed;                   // control thread
  };

  ControlPlane(Config c, Events e);
  ~ControlPlane();  // stop(false)
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;

  void start();
  // Ends the threads; with `leave`, revokes this node's lease first (a clean exit: the others
  // see it gone at once instead of after the TTL).
  void stop(bool leave);

  // Coordinator writes, guarded by the election key (dropped when not the coordinator).
  // `done(ok, why)` runs on the control thread.
  void write_record(Record r, int64_t expected_revision,
                    std::function<void(bool, const std::string&)> done = nullptr);
  void write_cut(uint64_t step, uint64_t generation, uint64_t epoch);
  void evict(const MemberInfo& m);
  // This node's suspicion of `target` (on: published under this node's lease; off: deleted).
  void suspect(uint32_t target, bool on);
  // Create-if-absent; `done(ok, why)` on the control thread (ok also when the key existed).
  void kv_put(std::string key, std::string value);
  void set_gbps(float gbps);

  // This process's incarnation: random and non-zero from construction on (the first HELLOs
  // carry it), new when the node registers again after an eviction. Any thread.
  uint64_t incarnation() const { return incarnation_.load(); }
  bool leader() const { return leader_.load(); }
  // The elected coordinator's node id as of the last election read; -1: none known.
  int64_t coordinator_id() const { return coordinator_.load(); }
  bool reachable() const { return reachable_.load(); }
  const std::string& prefix() const { return c_.prefix; }

  static std::string member_key(const std::string& prefix, uint32_t id);
  static std::string election_key(const std::string& prefix, uint32_t id);
  static std::string record_key(const std::string& prefix) { return prefix + "w/record"; }
  static std::string epoch_key(const std::string& prefix, uint64_t epoch);
  static std::string cut_key(const std::string& prefix) { return prefix + "w/cut"; }
  static std::string suspect_key(const std::string& prefix, uint32_t target, uint32_t observer);
  static std::string kv_key(const std::string& prefix, const std::string& key) {
    return prefix + "w/kv/" + key;
  }

 private:
  void run();
  bool do_register(bool new_incarnation);
  bool register_refused(const etcd::Status& s);  // logs a new reason once; returns false
  void keepalive();
  void elect();
  void read_view();
  int64_t initial_read();  // record, cut and KV now; returns the revision read
  void on_watch(const std::vector<etcd::WatchEvent>& evs);
  void note(const etcd::Status& s);
  void enqueue(std::function<void()> job);
  etcd::Compare fence() const;

  Config c_;
  Events e_;
  std::unique_ptr<etcd::Client> kv_;
  std::unique_ptr<etcd::Watch> watch_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::set<uint32_t> suspecting_;  // targets this node publishes a suspicion of
  bool stop_ = false;
  std::atomic<uint64_t> incarnation_{0};
  std::atomic<bool> leader_{false}, reachable_{true};
  std::atomic<bool> member_deleted_{false};
  std::atomic<int64_t> coordinator_{-1};
  std::atomic<float> gbps_{0};
  float gbps_published_ = -1;
  int64_t lease_ = 0;
  int64_t election_rev_ = 0;  // create revision of this node's election key
  bool registered_ = false;
  TimeUs last_keepalive_ = 0;
  TimeUs unreachable_since_ = 0;
  std::optional<Record> last_record_;  // what the watch delivered last
  std::mutex record_mu_;
  std::string job_;                // hex SHA-256 of the token (first 16 bytes)
  std::set<std::string> foreign_;  // members of another job, logged once
  std::string register_error_;     // the registration refusal logged last
};

}  // namespace r2ccl::snap
