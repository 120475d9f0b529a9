#include "r2ccl/snapshot/recovery.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "r2ccl/snapshot/log.h"

#include "text.h"

namespace r2ccl::snap {

using text::trim;

namespace {

std::string seconds3(double s) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3f", s);
  return buf;
}

std::string shortest(double d) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", d);
  return buf;
}

// Keeps the report line parsable: separators and control characters become '_'.
std::string clean(const std::string& s, bool allow_space) {
  std::string o = s;
  for (char& c : o) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (c == ',' || c == ';' || c == '(' || c == ')' || u < 0x20 || u == 0x7f ||
        (!allow_space && c == ' '))
      c = '_';
  }
  return o;
}

}  // namespace

double RecoveryHint::factor_for_step(int64_t steps_since_recovery) const {
  if (steps_since_recovery < 0 || steps_since_recovery >= lr_steps) return 1.0;
  return lr_factor;
}

bool parse_recovery_lr_factor(const std::string& name, const std::string& value, double* out,
                              std::string* err) {
  const std::string v = trim(value);
  double d = 0;
  // from_chars: no locale, no "inf"/"nan" spelled with signs, whole string must be used.
  auto r = std::from_chars(v.data(), v.data() + v.size(), d);
  if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || !std::isfinite(d) ||
      !(d > 0.0) || d > 1.0) {
    *err = name + "=\"" + value + "\" is not accepted: expected a number in (0, 1], e.g. " +
           "0.8 (1 disables the learning-rate hint)";
    return false;
  }
  *out = d;
  return true;
}

bool parse_recovery_lr_steps(const std::string& name, const std::string& value, int* out,
                             std::string* err) {
  const std::string v = trim(value);
  int n = 0;
  auto r = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || n < 0 ||
      n > kMaxRecoveryLrSteps) {
    *err = name + "=\"" + value + "\" is not accepted: expected an integer 0.." +
           std::to_string(kMaxRecoveryLrSteps) + " (steps after a recovery; 0 disables the hint)";
    return false;
  }
  *out = n;
  return true;
}

RecoveryHint recovery_hint_from_env(std::vector<std::string>* errors, const GetEnv& getenv) {
  auto get = [&](const char* name) -> const char* {
    return getenv ? getenv(name) : std::getenv(name);
  };
  RecoveryHint h;
  auto report = [&](const std::string& e) {
    SNAP_WARN("recovery hint: %s", e.c_str());
    if (errors) errors->push_back(e);
  };
  if (const char* f = get(kRecoveryLrFactorEnv); f && *f) {
    std::string err;
    if (!parse_recovery_lr_factor(kRecoveryLrFactorEnv, f, &h.lr_factor, &err))
      report(err + "; keeping the default " + shortest(kDefaultRecoveryLrFactor));
  }
  if (const char* s = get(kRecoveryLrStepsEnv); s && *s) {
    std::string err;
    if (!parse_recovery_lr_steps(kRecoveryLrStepsEnv, s, &h.lr_steps, &err))
      report(err + "; keeping the default " + std::to_string(kDefaultRecoveryLrSteps));
  }
  return h;
}

std::string format_recovered_line(double total_seconds, const std::vector<std::string>& nodes,
                                  const std::vector<PhaseTime>& phases) {
  std::string s =
      "[R2CCL] Successfully recovered in " + seconds3(total_seconds) + " s (node loss: ";
  if (nodes.empty()) {
    s += "unknown";
  } else {
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (i) s += ",";
      s += clean(nodes[i], false);
    }
  }
  for (size_t i = 0; i < phases.size(); ++i) {
    s += i ? ", " : "; ";
    s += clean(phases[i].name, true) + " " + seconds3(phases[i].seconds) + " s";
  }
  s += ")";
  return s;
}

RecoveryTimer::RecoveryTimer(const Clock& clock) : clock_(clock) {}

void RecoveryTimer::start() { start_at(clock_.now()); }

void RecoveryTimer::start_at(TimeUs t) {
  started_ = true;
  finished_ = false;
  start_ = t;
  end_ = 0;
  running_ = -1;
  names_.clear();
  spent_.clear();
}

void RecoveryTimer::begin(const std::string& name) {
  if (!started_ || finished_) start();
  end_phase();
  size_t i = 0;
  while (i < names_.size() && names_[i] != name) ++i;
  if (i == names_.size()) {
    names_.push_back(name);
    spent_.push_back(0);
  }
  running_ = static_cast<int>(i);
  running_since_ = clock_.now();
}

void RecoveryTimer::end_phase() {
  if (running_ < 0) return;
  const TimeUs now = clock_.now();
  if (now > running_since_) spent_[static_cast<size_t>(running_)] += now - running_since_;
  running_ = -1;
}

void RecoveryTimer::finish() {
  if (!started_ || finished_) return;
  end_phase();
  end_ = clock_.now();
  finished_ = true;
}

double RecoveryTimer::total_seconds() const {
  if (!started_) return 0;
  const TimeUs end = finished_ ? end_ : clock_.now();
  return end > start_ ? static_cast<double>(end - start_) / kUsPerSec : 0.0;
}

std::vector<PhaseTime> RecoveryTimer::phases() const {
  std::vector<PhaseTime> out;
  const TimeUs now = clock_.now();
  for (size_t i = 0; i < names_.size(); ++i) {
    TimeUs us = spent_[i];
    if (static_cast<int>(i) == running_ && now > running_since_) us += now - running_since_;
    out.push_back({names_[i], static_cast<double>(us) / kUsPerSec});
  }
  return out;
}

std::string RecoveryTimer::recovered_line(const std::vector<std::string>& nodes) const {
  return format_recovered_line(total_seconds(), nodes, phases());
}

}  // namespace r2ccl::snap
