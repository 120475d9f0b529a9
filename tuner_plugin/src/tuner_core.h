// The version-neutral tuner: per-communicator contexts and the getCollInfo decision.
// abi_tuner.cc adapts each ncclTunerPlugin_vN to these functions.
//
// Correctness rule (../shared/design/ARCHITECTURE.md §6): a decision depends only on the
// call's arguments, nRanks/nNodes, the rules file and the agreed cluster record as read at
// context init. Nothing node-local (rail state, clocks, R2CCL_RANK) is read here.
//
// Thread-safety: any number of contexts may be alive; create/destroy/get_coll_info may run on
// any threads at once. One context's get_coll_info may also run on several threads (its
// state is read-only after creation, its warning counters are atomic).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "r2ccl/log.h"
#include "r2ccl/nccl_abi.h"
#include "r2ccl/status.h"
#include "rules.h"

namespace r2ccl::tuner {

struct Options {
  std::string rules_path;         // R2CCL_TUNER_CONFIG; empty: no rules
  bool strict = false;            // R2CCL_TUNER_STRICT
  std::string board = "default";  // R2CCL_HEALTH_BOARD; "none": no agreed record
};

// What the tuner uses of the agreed cluster record (read once, at context init).
struct AgreedView {
  bool present = false;
  uint64_t epoch = 0;
  uint32_t n_nodes = 0;
  int members = 0;
  double min_usable = 0;  // GB/s, minimum positive node_usable_gbps over member nodes; 0: none
};
// Reads the board; absent, corrupt or epoch 0 -> present = false. *why gets the reason.
AgreedView read_agreed_view(const std::string& board, std::string* why);

struct Context {
  static constexpr uint64_t kMagic = 0x52324343544e5231ull;  // "R2CCTNR1"
  uint64_t magic = kMagic;
  uint64_t n_ranks = 0;
  uint64_t n_nodes = 0;
  int api = 0;
  ncclDebugLogger_t logger = nullptr;
  std::shared_ptr<const RuleSet> rules;  // never null
  AgreedView agreed;
  double net_bw_eff = 0;               // the model's network bandwidth after failure awareness
  std::atomic<uint64_t> skipped{0};    // rule choices skipped (IGNORE entry), for rate limiting
  std::atomic<uint64_t> bad_calls{0};  // calls with unusable arguments
};

// Options from the process environment (R2CCL_TUNER_CONFIG, R2CCL_TUNER_STRICT,
// R2CCL_HEALTH_BOARD), parsed afresh at every init. Invalid R2CCL_* values -> kInvalidUsage.
Status options_from_env(Options* out, std::string* err);

// Creates a context. A malformed rules file gives a WARN naming file, line and column and a
// context with no rules, or kInvalidUsage (and no context) when opts.strict.
Status create_context(const Options& opts, uint64_t n_ranks, uint64_t n_nodes,
                      ncclDebugLogger_t logger, int api, Context** out);
void destroy_context(Context* ctx);  // tolerates nullptr
int live_contexts();                 // for tests
bool valid_context(const void* ctx);

struct CallArgs {
  int coll = 0;
  uint64_t bytes = 0;
  int pipe_ops = -1;  // -1: unknown
  int reg_buff = -1;  // -1: unknown (v2, v3)
};

// Applies rules and model to a flat float[num_algo][num_proto] table. Never fails: trouble is
// a WARN and the table is left as it came. -1 entries never change; *n_channels changes only
// when a matching, applied rule asks. Returns the (algo, proto) forced to 0.0, or -1/-1.
struct Choice {
  int algo = -1;
  int proto = -1;
  int rule_line = 0;  // 0: none (model or nothing)
};
Choice get_coll_info(Context* ctx, const CallArgs& a, float* table, int num_algo, int num_proto,
                     int* n_channels);

// v2: no table. Builds one from collNetSupport/nvlsSupport, applies the same logic, and sets
// *algorithm/*protocol together (rule choice, else the model's fastest) or leaves both.
void get_coll_info_v2(Context* ctx, const CallArgs& a, int coll_net_support, int nvls_support,
                      int* algorithm, int* protocol, int* n_channels);

}  // namespace r2ccl::tuner

// Logging through common's facade (r2ccl/log.h) as Component::kTuner ("TUNER/R2CCL ..."):
// through `logger` (a context's, or init's), else the tuner's NCCL logger (the last one an init
// handed over, set_nccl_logger(Component::kTuner, ...)), else stderr.
#define TUNER_WARN(logger, ...)                                                                 \
  ::r2ccl::log_from(::r2ccl::Component::kTuner, (logger), NCCL_LOG_WARN, NCCL_TUNING, __FILE__, \
                    __LINE__, __VA_ARGS__)
#define TUNER_INFO(logger, ...)                                                                 \
  ::r2ccl::log_from(::r2ccl::Component::kTuner, (logger), NCCL_LOG_INFO, NCCL_TUNING, __func__, \
                    __LINE__, __VA_ARGS__)
