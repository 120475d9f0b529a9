// The exported NCCL tuner tables ncclTunerPlugin_v5 .. _v2 (name "R2CCL"). Each entry adapts
// its version's arguments to the version-neutral core (tuner_core.h) and is an exception
// firewall: nothing is thrown across the C ABI.
// Layouts: common/include/r2ccl/nccl_tuner_abi.h, from ../shared/reference/nccl-plugin-abi.md §5.
// Visibility: -fvisibility=hidden and a version script (r2ccl_tuner.map) that exports only
// these four symbols.
//
// Error policy (reference §5.4): init fails only on a configuration error (invalid R2CCL_*
// value, or a malformed rules file under R2CCL_TUNER_STRICT=1: ncclInvalidUsage) or when out
// of memory. getCollInfo never fails: internal trouble is a WARN and NCCL's table stands.
#include <mutex>
#include <new>

#include "r2ccl/nccl_tuner_abi.h"
#include "r2ccl/version.h"
#include "tuner_core.h"

using namespace r2ccl;
using namespace r2ccl::tuner;

#define R2CCL_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr char kName[] = "R2CCL";

Status init_any(void** ctx, size_t n_ranks, size_t n_nodes, ncclDebugLogger_t log, int api) {
  if (!ctx) {
    TUNER_WARN(log, "init: NULL context pointer");
    return Status::kInternal;
  }
  *ctx = nullptr;
  // The tuner's logger in the facade: for messages about calls without a usable context.
  if (log) set_nccl_logger(Component::kTuner, log);
  Options opts;
  std::string err;
  if (options_from_env(&opts, &err) != Status::kOk) {
    TUNER_WARN(log, "%s", err.c_str());
    return Status::kInvalidUsage;
  }
  static std::once_flag banner;
  std::call_once(banner, [&] {
    log_from(Component::kTuner, log, NCCL_LOG_INFO, NCCL_INIT | NCCL_TUNING, "init", __LINE__,
             "r2ccl %s (git %s), NCCL tuner API v%d, rules file: %s%s", R2CCL_VERSION_STRING,
             R2CCL_GIT_HASH, api, opts.rules_path.empty() ? "none" : opts.rules_path.c_str(),
             opts.strict ? " (strict)" : "");
  });
  Context* c = nullptr;
  R2CCL_CHECK(create_context(opts, n_ranks, n_nodes, log, api, &c));
  *ctx = c;
  return Status::kOk;
}

// init: configuration errors -> ncclInvalidUsage; anything thrown -> a WARN and an error.
#define INIT_FIREWALL(expr)                                                 \
  try {                                                                     \
    return to_nccl_result(expr);                                            \
  } catch (const std::bad_alloc&) {                                         \
    TUNER_WARN(log, "%s: out of memory", __func__);                         \
    return ncclSystemError;                                                 \
  } catch (...) {                                                           \
    TUNER_WARN(log, "%s: internal error (unexpected exception)", __func__); \
    return ncclInternalError;                                               \
  }

// getCollInfo/finalize: always ncclSuccess (an error would fail the collective or teardown).
#define CALL_FIREWALL(ctx, ...)                                                                \
  try {                                                                                        \
    if (!valid_context(ctx)) {                                                                 \
      static std::once_flag once;                                                              \
      std::call_once(once,                                                                     \
                     [] { TUNER_WARN(nullptr, "not an r2ccl tuner context; call ignored"); }); \
      return ncclSuccess;                                                                      \
    }                                                                                          \
    __VA_ARGS__;                                                                               \
    return ncclSuccess;                                                                        \
  } catch (...) {                                                                              \
    TUNER_WARN(nullptr, "%s: internal error (exception); NCCL's choice stands", __func__);     \
    return ncclSuccess;                                                                        \
  }

Context* as_ctx(void* p) { return static_cast<Context*>(p); }

// --- v5 (NCCL 2.28+) ---
ncclResult_t v5_init(void** ctx, uint64_t comm_id, size_t n_ranks, size_t n_nodes,
                     ncclDebugLogger_t log, ncclNvlDomainInfo_v5_t* nvl,
                     ncclTunerConstants_v5_t* constants) {
  (void)comm_id;  // not needed: every decision input is per context
  (void)nvl;
  (void)constants;  // left as NCCL loaded them
  INIT_FIREWALL(init_any(ctx, n_ranks, n_nodes, log, 5));
}

// --- v4, v3, v2 (ctx is init's last argument) ---
ncclResult_t v4_init(size_t n_ranks, size_t n_nodes, ncclDebugLogger_t log, void** ctx) {
  INIT_FIREWALL(init_any(ctx, n_ranks, n_nodes, log, 4));
}
ncclResult_t v3_init(size_t n_ranks, size_t n_nodes, ncclDebugLogger_t log, void** ctx) {
  INIT_FIREWALL(init_any(ctx, n_ranks, n_nodes, log, 3));
}
ncclResult_t v2_init(size_t n_ranks, size_t n_nodes, ncclDebugLogger_t log, void** ctx) {
  INIT_FIREWALL(init_any(ctx, n_ranks, n_nodes, log, 2));
}

// v5 and v4 share getCollInfo's signature.
ncclResult_t v4_get_coll_info(void* ctx, ncclFunc_t coll, size_t bytes, int pipe_ops, float** table,
                              int num_algo, int num_proto, int reg_buff, int* n_channels) {
  CALL_FIREWALL(ctx, {
    CallArgs a{static_cast<int>(coll), bytes, pipe_ops, reg_buff};
    (void)get_coll_info(as_ctx(ctx), a, reinterpret_cast<float*>(table), num_algo, num_proto,
                        n_channels);
  });
}
ncclResult_t v3_get_coll_info(void* ctx, ncclFunc_t coll, size_t bytes, int pipe_ops, float** table,
                              int num_algo, int num_proto, int* n_channels) {
  CALL_FIREWALL(ctx, {
    CallArgs a{static_cast<int>(coll), bytes, pipe_ops, -1};
    (void)get_coll_info(as_ctx(ctx), a, reinterpret_cast<float*>(table), num_algo, num_proto,
                        n_channels);
  });
}
ncclResult_t v2_get_coll_info(void* ctx, ncclFunc_t coll, size_t bytes, int coll_net, int nvls,
                              int pipe_ops, int* algorithm, int* protocol, int* n_channels) {
  CALL_FIREWALL(ctx, {
    CallArgs a{static_cast<int>(coll), bytes, pipe_ops, -1};
    get_coll_info_v2(as_ctx(ctx), a, coll_net, nvls, algorithm, protocol, n_channels);
  });
}

ncclResult_t e_finalize(void* ctx) {
  if (!ctx) return ncclSuccess;  // a failed init leaves no context
  CALL_FIREWALL(ctx, destroy_context(as_ctx(ctx)));
}

}  // namespace

R2CCL_EXPORT const ncclTuner_v5_t ncclTunerPlugin_v5 = {kName, v5_init, v4_get_coll_info,
                                                        e_finalize};
R2CCL_EXPORT const ncclTuner_v4_t ncclTunerPlugin_v4 = {kName, v4_init, v4_get_coll_info,
                                                        e_finalize};
R2CCL_EXPORT const ncclTuner_v3_t ncclTunerPlugin_v3 = {kName, v3_init, v3_get_coll_info,
                                                        e_finalize};
R2CCL_EXPORT const ncclTuner_v2_t ncclTunerPlugin_v2 = {kName, v2_init, v2_get_coll_info,
                                                        e_finalize};
