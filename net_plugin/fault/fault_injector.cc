#include "fault_injector.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace r2ccl::net {
namespace {

// A decimal integer in [lo, hi], the whole of `v`: strtoll's ERANGE and the range are both
// checked, so a product with kUsPerMs below cannot overflow.
bool parse_num(const std::string& v, long long lo, long long hi, long long* out) {
  if (v.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long x = strtoll(v.c_str(), &end, 10);
  if (*end || errno == ERANGE || x < lo || x > hi) return false;
  *out = x;
  return true;
}

constexpr long long kMaxMs = 86400000;      // at and for: one day, in milliseconds
constexpr long long kMaxDelayMs = 60000;    // delay:MS
constexpr long long kMaxRank = 2147483647;  // an int

}  // namespace

bool parse_fault_specs(const std::string& s, std::vector<FaultSpec>* out, std::string* err) {
  const std::string ms = std::to_string(kMaxMs);
  const std::string form =
      "accepted: entries 'rank=R,rail=N,at=MS,kind=reset|blackhole|delay:MS[,for=MS]' separated "
      "by ';', each key once; R in [-1, " +
      std::to_string(kMaxRank) + "] (-1: every rank), " + "N in [0, 15], at in [0, " + ms +
      "], for in [1, " + ms + "], delay in [1, " + std::to_string(kMaxDelayMs) + "] (ms)";
  out->clear();
  size_t start = 0;
  while (start < s.size()) {
    size_t semi = s.find(';', start);
    std::string entry =
        s.substr(start, semi == std::string::npos ? std::string::npos : semi - start);
    start = semi == std::string::npos ? s.size() : semi + 1;
    if (entry.empty()) continue;
    FaultSpec f;
    bool have_kind = false, have_rail = false, have_at = false;
    std::vector<std::string> seen;
    size_t p = 0;
    while (p <= entry.size()) {
      size_t comma = entry.find(',', p);
      std::string kv = entry.substr(p, comma == std::string::npos ? std::string::npos : comma - p);
      p = comma == std::string::npos ? entry.size() + 1 : comma + 1;
      size_t eq = kv.find('=');
      if (eq == std::string::npos) {
        *err = "R2CCL_FAULT_INJECT: '" + kv + "' is not key=value; " + form;
        return false;
      }
      std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
      if (std::find(seen.begin(), seen.end(), k) != seen.end()) {
        *err = "R2CCL_FAULT_INJECT: '" + k + "' given twice in entry '" + entry + "'; " + form;
        return false;
      }
      seen.push_back(k);
      long long n = 0;
      if (k == "rank" && parse_num(v, -1, kMaxRank, &n)) {
        f.rank = static_cast<int>(n);
      } else if (k == "rail" && parse_num(v, 0, 15, &n)) {
        f.rail = static_cast<int>(n);
        have_rail = true;
      } else if (k == "at" && parse_num(v, 0, kMaxMs, &n)) {
        f.at = n * kUsPerMs;
        have_at = true;
      } else if (k == "for" && parse_num(v, 1, kMaxMs, &n)) {
        f.duration = n * kUsPerMs;
      } else if (k == "kind" && (v == "reset" || v == "blackhole")) {
        f.kind = v == "reset" ? FaultSpec::Kind::kReset : FaultSpec::Kind::kBlackhole;
        have_kind = true;
      } else if (k == "kind" && v.rfind("delay:", 0) == 0 &&
                 parse_num(v.substr(6), 1, kMaxDelayMs, &n)) {
        f.kind = FaultSpec::Kind::kDelay;
        f.delay = n * kUsPerMs;
        have_kind = true;
      } else {
        *err = "R2CCL_FAULT_INJECT: bad '" + kv + "'; " + form;
        return false;
      }
    }
    std::vector<const char*> missing;
    if (!have_rail) missing.push_back("rail");
    if (!have_at) missing.push_back("at");
    if (!have_kind) missing.push_back("kind");
    if (!missing.empty()) {
      std::string need;
      for (size_t i = 0; i < missing.size(); ++i)
        need += std::string(i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + missing[i];
      *err = "R2CCL_FAULT_INJECT: entry '" + entry + "' needs " + need + "; " + form;
      return false;
    }
    out->push_back(f);
  }
  return true;
}

FaultInjector& FaultInjector::instance() {
  static FaultInjector* inj = new FaultInjector();  // never destroyed: used by the bg thread
  return *inj;
}

void FaultInjector::configure(const std::vector<FaultSpec>& specs, int my_rank) {
  specs_.clear();
  for (const auto& s : specs)
    if (s.rank < 0 || s.rank == my_rank) specs_.push_back(s);
}

void FaultInjector::arm() {
  if (specs_.empty() || t0_.load(std::memory_order_relaxed) != 0) return;
  TimeUs expected = 0;
  t0_.compare_exchange_strong(expected, now_us());
}

void FaultInjector::arm_now(const std::vector<FaultSpec>& specs, int my_rank) {
  if (t0_.load(std::memory_order_acquire) != 0) return;  // one schedule per process
  configure(specs, my_rank);
  if (!specs_.empty()) t0_.store(now_us(), std::memory_order_release);
}

FaultInjector::RailFault FaultInjector::query(int rail, TimeUs now) const {
  RailFault r;
  TimeUs t0 = t0_.load(std::memory_order_acquire);
  if (t0 == 0) return r;
  for (const auto& s : specs_) {
    if (s.rail != rail) continue;
    TimeUs start = t0 + s.at;
    if (now < start) continue;
    bool active = s.duration == 0 || now < start + s.duration;
    if (s.kind == FaultSpec::Kind::kReset) {
      r.reset_epoch++;
      r.down |= active;
    } else if (active && s.kind == FaultSpec::Kind::kBlackhole) {
      r.blackhole = true;
    } else if (active && s.kind == FaultSpec::Kind::kDelay) {
      r.delay += s.delay;
    }
  }
  return r;
}

TimeUs FaultInjector::last_start(int rail, TimeUs now) const {
  TimeUs t0 = t0_.load(std::memory_order_relaxed);
  TimeUs best = 0;
  if (t0 == 0) return 0;
  for (const auto& s : specs_)
    if (s.rail == rail && t0 + s.at <= now && t0 + s.at > best) best = t0 + s.at;
  return best;
}

}  // namespace r2ccl::net
