// What one daemon holds, by chain: the index the daemon keeps beside its ShardStore so it can
// say which (rank, step) it holds in full (the HELD reports of the consistent cut) and which
// shards restore a (rank, buffer, step) (the FETCH answers), without reading any payload.
//
// A (rank, step) is held in full when, for every buffer id below the step's n_buffers, the
// shard of that step is here AND its whole chain is: the base (seq == base_seq, at base_step)
// and every frame between, i.e. exactly seq - base_seq + 1 shards of that chain at steps in
// [base_step, step]. Frames of one (rank, buffer) have consecutive seqs (codec.h), so a count
// suffices once base and end are known. The rank's own home copy is indexed like any other;
// the coordinator decides what counts as a replica (CutTracker::set_home).
//
// Pure bookkeeping: no I/O, no clock, no threads; the daemon's event loop owns it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "r2ccl/snapshot/peer_wire.h"
#include "r2ccl/snapshot/shard_store.h"

namespace r2ccl::snap {

struct ChainEntry {
  uint64_t base_step = 0;
  uint64_t seq = 0;
  uint64_t base_seq = 0;
  uint64_t bytes = 0;
};

struct HeldStep {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t world = 0;
  uint32_t home_node = 0;
  uint64_t generation = 0;  // ShardMeta::generation of the step's shards
};

class Holdings {
 public:
  // Checks a shard's description against itself: buffer < n_buffers, rank < world, world >= 1,
  // base_step <= step, base_seq <= seq, a base (step == base_step) has seq == base_seq and a
  // delta has seq > base_seq. False with *err naming the field and the accepted form.
  static bool valid(const ShardMeta& m, std::string* err);

  // Indexes a shard that the store now holds (replacing an entry of the same key). Returns
  // true when this made (m.rank, m.step) held in full (it was not before).
  bool add(const ShardMeta& m);
  // Forgets one shard (pruned, erased, or found corrupt).
  void remove(const ShardKey& k);
  // Keeps only the keys the store still lists (after a prune).
  void retain(const std::vector<ShardInfo>& listed);

  bool held_in_full(uint32_t rank, uint64_t step) const;
  // Every (rank, step) held in full, by rank then step; `only_step` restricts to one step.
  std::vector<HeldStep> full_steps(std::optional<uint64_t> only_step = std::nullopt) const;
  // The steps whose shards restore (rank, buffer, step), oldest (the base) first; empty when
  // this node does not hold the whole chain.
  std::vector<uint64_t> chain(uint32_t rank, uint32_t buffer, uint64_t step) const;
  // The full description of an indexed shard (payload_bytes from the index); false if absent.
  bool describe(const ShardKey& k, ShardMeta* out) const;
  // Every indexed shard's description, in ShardKey order (to persist the index).
  std::vector<ShardMeta> all() const;
  // The newest step of any shard indexed (0 when none).
  uint64_t newest_step() const { return newest_; }
  size_t size() const { return entries_.size(); }

 private:
  bool chain_ok(uint32_t rank, uint32_t buffer, uint64_t step) const;
  std::map<ShardKey, ChainEntry> entries_;
  struct StepInfo {
    uint32_t n_buffers = 0;
    uint32_t world = 0;
    uint32_t home_node = 0;
    uint64_t generation = 0;
  };
  std::map<std::pair<uint32_t, uint64_t>, StepInfo> steps_;  // (rank, step)
  uint64_t newest_ = 0;
};

// Replica placement (issue 6: "the 3 nearest other nodes, fewest hops in a topology file, else
// measured RTT").
//
// Topology file: one node per line, `ID PATH`, PATH the node's place in the network tree as
// '/'-separated switch names from the top, e.g. `3 spine0/leaf2` ('#' comments, blank lines
// ignored). Hops between two nodes = 2 x (levels below their deepest common switch) + 2, i.e.
// 2 under one leaf, 4 across a spine; a node missing from the file is farther than any listed
// one. Returns false with *err naming the line and the accepted form.
bool parse_topology(const std::string& text, std::map<uint32_t, std::vector<std::string>>* out,
                    std::string* err);
int topology_hops(const std::map<uint32_t, std::vector<std::string>>& topo, uint32_t a, uint32_t b);

// Up to `want` replica nodes for a rank on `home`: the live nodes other than home, nearest
// first by (hops when a topology is given, then round trip in microseconds (unknown = last),
// then node id). Deterministic for equal inputs.
std::vector<uint32_t> choose_replicas(uint32_t home, const std::vector<uint32_t>& live,
                                      const std::map<uint32_t, std::vector<std::string>>& topo,
                                      const std::map<uint32_t, int64_t>& rtt_us, size_t want);

}  // namespace r2ccl::snap
