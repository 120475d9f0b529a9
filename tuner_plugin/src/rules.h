// Tuner rules: the parsed form of an R2CCL_TUNER_CONFIG file, and its parser.
// Two line formats are accepted in one file (see tuner_plugin/README.md):
//  - r2ccl's own:  <coll|any> <bytes> [nodes=R] [ranks=R] [pipeops=R] [regbuff=R] [usable=R]
//                  -> <algo>/<proto>|keep [channels=N]
//                  model on|off [key=value ...]
//  - NCCL's example tuner CSV (a line with a comma): coll,min,max,algo,proto,channels,
//    nNodes,nRanks[,numPipeOps[,regBuff]]   (-1 = any / keep)
// Pure: no I/O except load_rules_file, no global state. Thread-safety: none needed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace r2ccl::tuner {

constexpr int kNumColls = 5;      // broadcast, reduce, allgather, reducescatter, allreduce
constexpr int kMaxAlgos = 7;      // tree, ring, collnet_direct, collnet_chain, nvls, nvls_tree, pat
constexpr int kMaxProtos = 3;     // ll, ll128, simple
constexpr int kMaxChannels = 64;  // NCCL's MAXCHANNELS

const char* coll_name(int coll);
const char* algo_name(int algo);
const char* proto_name(int proto);
int parse_coll(const std::string& s);   // -1 when unknown
int parse_algo(const std::string& s);   // -1 when unknown
int parse_proto(const std::string& s);  // -1 when unknown

// Inclusive range; lo > hi never happens after parsing. "any" = [0, UINT64_MAX].
struct Range {
  uint64_t lo = 0;
  uint64_t hi = UINT64_MAX;
  bool any() const { return lo == 0 && hi == UINT64_MAX; }
  bool contains(uint64_t v) const { return v >= lo && v <= hi; }
};

struct Rule {
  int coll = -1;  // -1: any collective
  Range bytes;
  Range nodes;
  Range ranks;
  Range pipe_ops;  // matched only when the API version passes numPipeOps (all do)
  Range reg_buff;  // any, [0,0] or [1,1]; a bounded range never matches on v2/v3 (unknown)
  Range usable;    // GB/s: min agreed usable bandwidth of member nodes; bounded ranges
                   // never match without an agreed record
  int algo = -1;   // -1 with proto -1: keep NCCL's choice (only channels)
  int proto = -1;
  int channels = -1;  // -1: leave nChannels alone
  int line = 0;       // source line, for logs
};

// Alpha-beta cost model parameters (`model` directive). Bandwidths in GB/s (bytes, like the
// health board's node_usable_gbps), per node for the network and per GPU intra-node;
// latencies in microseconds.
struct ModelParams {
  bool enabled = false;
  double net_bw = 50.0;     // net_bw=   per-node network bandwidth, GB/s (400 Gbit/s)
  double net_lat = 5.0;     // net_lat=  per network hop, us
  double intra_bw = 150.0;  // intra_bw= per-GPU intra-node bandwidth, GB/s
  double intra_lat = 1.0;   // intra_lat= per intra-node hop, us
  // Failure awareness: when the agreed record's minimum usable bandwidth of a member node is
  // below this (GB/s), the network bandwidth of every modelled algorithm becomes that minimum.
  // 0 (default): net_bw is the threshold.
  double degraded_below = 0.0;
};

struct RuleSet {
  std::vector<Rule> rules;  // first match wins
  ModelParams model;
  std::string source;  // file name, for logs
  bool empty() const { return rules.empty() && !model.enabled; }
};

// Parses `text` (the file's content; `name` is used in messages). On error returns false, sets
// *err to "NAME:LINE:COL: message" and leaves *out untouched. With `skipped` (the tuner's
// lenient mode) a malformed row (a rule, a model line, a line over 4096 bytes) is dropped
// alone and its "NAME:LINE:COL: message" appended there; a file over 1 MiB or with a non-text
// byte (not a rules file at all) still fails whole. Any thread; no state.
bool parse_rules(const std::string& text, const std::string& name, RuleSet* out, std::string* err,
                 std::vector<std::string>* skipped = nullptr);
// Reads and parses a file; a missing or unreadable file is an error ("NAME:0:0: ...").
// `skipped` as for parse_rules.
bool load_rules_file(const std::string& path, RuleSet* out, std::string* err,
                     std::vector<std::string>* skipped = nullptr);

// Writes a RuleSet in r2ccl's format (what r2ccl_tune emits; parse_rules reads it back).
std::string format_rules(const RuleSet& rs);

}  // namespace r2ccl::tuner
