#include "tuner_core.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <vector>

#include "cost_model.h"
#include "r2ccl/health_board.h"
#include "r2ccl/nccl_tuner_abi.h"
#include "r2ccl/params.h"

namespace r2ccl::tuner {
namespace {

std::atomic<int> g_live{0};

// Every communicator's tuner init reads the rules file again: a lenient-mode complaint about
// it (a skipped row, a file that could not be used) is warned once per process and message.
bool first_warning(const std::string& msg) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lk(mu);
  return seen.insert(msg).second;
}

// Warn for the first 3 skipped choices of a context, then every 1000th.
bool should_warn(std::atomic<uint64_t>* counter, uint64_t* n) {
  *n = counter->fetch_add(1, std::memory_order_relaxed) + 1;
  return *n <= 3 || *n % 1000 == 0;
}

bool rule_matches(const Rule& r, const Context& c, const CallArgs& a) {
  if (r.coll >= 0 && r.coll != a.coll) return false;
  if (!r.bytes.contains(a.bytes)) return false;
  if (!r.nodes.contains(c.n_nodes)) return false;
  if (!r.ranks.contains(c.n_ranks)) return false;
  if (!r.pipe_ops.any() &&
      (a.pipe_ops < 0 || !r.pipe_ops.contains(static_cast<uint64_t>(a.pipe_ops))))
    return false;
  if (!r.reg_buff.any() &&
      (a.reg_buff < 0 || !r.reg_buff.contains(static_cast<uint64_t>(a.reg_buff))))
    return false;
  if (!r.usable.any()) {
    if (!c.agreed.present || c.agreed.min_usable <= 0) return false;
    const double v = c.agreed.min_usable;
    if (v < static_cast<double>(r.usable.lo) || v > static_cast<double>(r.usable.hi)) return false;
  }
  return true;
}

}  // namespace

AgreedView read_agreed_view(const std::string& board, std::string* why) {
  AgreedView v;
  if (board.empty() || board == "none") {
    if (why) *why = "no health board (R2CCL_HEALTH_BOARD=none)";
    return v;
  }
  auto rec = std::make_unique<board::AgreedRecord>();
  std::string err;
  if (!board::read_agreed_record(board, rec.get(), &err)) {
    if (why) *why = "no agreed record: " + err;
    return v;
  }
  if (rec->epoch == 0) {
    if (why) *why = "no agreed record yet (epoch 0)";
    return v;
  }
  v.present = true;
  v.epoch = rec->epoch;
  v.n_nodes = rec->n_nodes;
  double mn = 0;
  for (int i = 0; i < board::kMaxNodes; ++i) {
    if (!(rec->members[i / 64] >> (i % 64) & 1)) continue;
    ++v.members;
    const double bw = rec->node_usable_gbps[i];
    if (bw > 0 && std::isfinite(bw) && (mn == 0 || bw < mn)) mn = bw;
  }
  v.min_usable = mn;
  if (why) why->clear();
  return v;
}

Status options_from_env(Options* out, std::string* err) {
  Config cfg;
  std::vector<std::string> warnings;
  if (!load_config(process_env(), {}, &cfg, err, &warnings)) return Status::kInvalidUsage;
  out->rules_path = cfg.tuner_config;
  out->strict = cfg.tuner_strict;
  out->board = cfg.health_board;
  return Status::kOk;
}

Status create_context(const Options& opts, uint64_t n_ranks, uint64_t n_nodes,
                      ncclDebugLogger_t logger, int api, Context** out) {
  *out = nullptr;
  auto ctx = std::make_unique<Context>();
  ctx->n_ranks = n_ranks;
  ctx->n_nodes = n_nodes;
  ctx->api = api;
  ctx->logger = logger;
  auto rs = std::make_shared<RuleSet>();
  if (!opts.rules_path.empty()) {
    std::string err;
    std::vector<std::string> skipped;
    if (!load_rules_file(opts.rules_path, rs.get(), &err, opts.strict ? nullptr : &skipped)) {
      if (opts.strict) {
        TUNER_WARN(logger, "rules file %s (R2CCL_TUNER_STRICT=1: tuner init fails)", err.c_str());
        return Status::kInvalidUsage;
      }
      if (first_warning(err))
        TUNER_WARN(logger, "rules file %s; the tuner runs with no rules", err.c_str());
      *rs = RuleSet{};
      rs->source = opts.rules_path;
    }
    for (const std::string& row : skipped) {
      if (!first_warning(row)) continue;
      TUNER_WARN(logger,
                 "rules file %s; that row is skipped, %zu rules kept (R2CCL_TUNER_STRICT=1 makes "
                 "a malformed row fail tuner init)",
                 row.c_str(), rs->rules.size());
    }
  }
  std::string why;
  ctx->agreed = read_agreed_view(opts.board, &why);
  const ModelParams& m = rs->model;
  ctx->net_bw_eff = m.net_bw;
  const double threshold = m.degraded_below > 0 ? m.degraded_below : m.net_bw;
  if (ctx->agreed.present && ctx->agreed.min_usable > 0 && ctx->agreed.min_usable < threshold)
    ctx->net_bw_eff = std::min(m.net_bw, ctx->agreed.min_usable);
  ctx->rules = std::move(rs);
  if (ctx->agreed.present)
    TUNER_INFO(logger,
               "context: %llu ranks, %llu nodes, %zu rules, model %s; agreed record epoch %llu, "
               "%d member nodes, min usable %.1f GB/s, model network bandwidth %.1f GB/s",
               static_cast<unsigned long long>(n_ranks), static_cast<unsigned long long>(n_nodes),
               ctx->rules->rules.size(), m.enabled ? "on" : "off",
               static_cast<unsigned long long>(ctx->agreed.epoch), ctx->agreed.members,
               ctx->agreed.min_usable, ctx->net_bw_eff);
  else
    TUNER_INFO(logger, "context: %llu ranks, %llu nodes, %zu rules, model %s; %s",
               static_cast<unsigned long long>(n_ranks), static_cast<unsigned long long>(n_nodes),
               ctx->rules->rules.size(), m.enabled ? "on" : "off", why.c_str());
  g_live.fetch_add(1);
  *out = ctx.release();
  return Status::kOk;
}

bool valid_context(const void* p) {
  return p && static_cast<const Context*>(p)->magic == Context::kMagic;
}

void destroy_context(Context* ctx) {
  if (!valid_context(ctx)) return;
  ctx->magic = 0;
  delete ctx;
  g_live.fetch_sub(1);
}

int live_contexts() { return g_live.load(); }

Choice get_coll_info(Context* ctx, const CallArgs& a, float* table, int num_algo, int num_proto,
                     int* n_channels) {
  Choice ch;
  if (!valid_context(ctx)) return ch;  // the ABI layer has warned
  if (!table || num_algo <= 0 || num_proto <= 0 || a.coll < 0 || a.coll >= kNumColls) {
    uint64_t n = 0;
    if (should_warn(&ctx->bad_calls, &n))
      TUNER_WARN(ctx->logger,
                 "getCollInfo: unusable call (collective %d, table %p, %d x %d); NCCL's choice "
                 "stands (%llu such calls)",
                 a.coll, static_cast<void*>(table), num_algo, num_proto,
                 static_cast<unsigned long long>(n));
    return ch;
  }
  const int na = std::min(num_algo, kMaxAlgos), np = std::min(num_proto, kMaxProtos);
  auto cell = [&](int al, int pr) -> float& { return table[al * num_proto + pr]; };
  const RuleSet& rs = *ctx->rules;

  // Model first (it rewrites every modelled entry), then a rule's forced choice on top.
  if (rs.model.enabled) {
    for (int al = 0; al < na; ++al)
      for (int pr = 0; pr < np; ++pr) {
        float& c = cell(al, pr);
        if (!(c >= 0.0f)) continue;  // IGNORE (or NaN): never touched
        const double t = predict_us(rs.model, ctx->net_bw_eff, a.coll, a.bytes, ctx->n_ranks,
                                    ctx->n_nodes, al, pr);
        if (t >= 0) c = static_cast<float>(std::max(t, 1e-3));
      }
  }
  for (const Rule& r : rs.rules) {
    if (!rule_matches(r, *ctx, a)) continue;
    if (r.algo >= 0) {
      const bool in_table = r.algo < na && r.proto < np;
      if (!in_table || !(cell(r.algo, r.proto) >= 0.0f)) {
        uint64_t n = 0;
        if (should_warn(&ctx->skipped, &n))
          TUNER_WARN(ctx->logger,
                     "%s:%d: %s/%s is not available for this %s of %llu bytes (%s); rule "
                     "skipped (%llu skips on this communicator)",
                     rs.source.c_str(), r.line, algo_name(r.algo), proto_name(r.proto),
                     coll_name(a.coll), static_cast<unsigned long long>(a.bytes),
                     in_table ? "cost table entry is -1" : "not in this NCCL's table",
                     static_cast<unsigned long long>(n));
        continue;  // the next matching rule may apply
      }
      cell(r.algo, r.proto) = 0.0f;
      ch.algo = r.algo;
      ch.proto = r.proto;
    }
    ch.rule_line = r.line;
    if (r.channels > 0 && n_channels) *n_channels = r.channels;
    break;
  }
  return ch;
}

void get_coll_info_v2(Context* ctx, const CallArgs& a, int coll_net_support, int nvls_support,
                      int* algorithm, int* protocol, int* n_channels) {
  // NCCL 2.21's algorithms (no PAT). Unknown cost = 1e30 so only real choices win.
  constexpr int kNa = 6;
  constexpr float kUnknown = 1e30f;
  float table[kNa * kMaxProtos];
  for (int al = 0; al < kNa; ++al) {
    const bool collnet = al == 2 || al == 3, nvls = al == 4 || al == 5;
    const bool ok = (!collnet || coll_net_support) && (!nvls || nvls_support);
    for (int pr = 0; pr < kMaxProtos; ++pr)
      table[al * kMaxProtos + pr] = ok ? kUnknown : NCCL_ALGO_PROTO_IGNORE;
  }
  Choice ch = get_coll_info(ctx, a, table, kNa, kMaxProtos, n_channels);
  if (ch.algo >= 0) {
    if (algorithm && protocol) {
      *algorithm = ch.algo;
      *protocol = ch.proto;
    }
    return;
  }
  if (!valid_context(ctx) || !ctx->rules->model.enabled || !algorithm || !protocol) return;
  int best = -1;
  for (int i = 0; i < kNa * kMaxProtos; ++i)
    if (table[i] >= 0.0f && table[i] < kUnknown && (best < 0 || table[i] < table[best])) best = i;
  if (best >= 0) {
    *algorithm = best / kMaxProtos;
    *protocol = best % kMaxProtos;
  }
}

}  // namespace r2ccl::tuner
