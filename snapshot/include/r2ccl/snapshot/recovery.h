// After a node loss (issue 6): the learning-rate hint the client library hands to the training
// loop, and the timing of the recovery's phases with the line that reports it.
//
// RecoveryHint: for `lr_steps` optimizer steps after a recovery (default 3) the training loop is
// advised to scale its learning rate by `lr_factor` (default 0.8): state restored from an older
// snapshot and a smaller world make the first steps noisier. Configured by
//   R2CCL_RECOVERY_LR_FACTOR  a number in (0, 1]   (1 disables the hint)
//   R2CCL_RECOVERY_LR_STEPS   an integer 0..1000   (0 disables the hint)
// A bad value is reported (an error naming the variable, the value, the accepted form and the
// default kept; also logged as a WARN) and the default is kept; an empty value counts as unset.
//
// RecoveryTimer: named phases (detect, membership, comm rebuild, restore, ...) on an injected
// monotonic clock (microseconds; SystemClock by default), and the report line
//   [R2CCL] Successfully recovered in X s (node loss: NODES; PHASE S s, PHASE S s, ...)
// X and every S in seconds with 3 decimals; NODES joined by ','. The net plugin's rail
// switchover uses the same phrase with "(rail ...)" (ARCHITECTURE.md section 7), so logs tell
// the two apart by what follows the parenthesis. Names are cleaned so the line stays parsable:
// ',', ';', '(', ')' and control characters become '_' (node names also lose spaces).
//
// Thread-safety: RecoveryHint is a value; the parsing functions are pure except for the
// environment read and the WARN. A RecoveryTimer is owned by one recovery thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "r2ccl/clock.h"

namespace r2ccl::snap {

constexpr const char* kRecoveryLrFactorEnv = "R2CCL_RECOVERY_LR_FACTOR";
constexpr const char* kRecoveryLrStepsEnv = "R2CCL_RECOVERY_LR_STEPS";
constexpr double kDefaultRecoveryLrFactor = 0.8;
constexpr int kDefaultRecoveryLrSteps = 3;
constexpr int kMaxRecoveryLrSteps = 1000;

struct RecoveryHint {
  double lr_factor = kDefaultRecoveryLrFactor;  // in (0, 1]
  int lr_steps = kDefaultRecoveryLrSteps;       // 0..1000

  // The learning-rate multiplier for an optimizer step, given the number of steps completed
  // since the recovery (0 = the first step after it): lr_factor for 0 <= steps < lr_steps,
  // 1.0 otherwise (also for negative counts: no recovery yet).
  double factor_for_step(int64_t steps_since_recovery) const;
  // Whether the hint changes anything at all.
  bool active() const { return lr_steps > 0 && lr_factor < 1.0; }
};

// Parse one variable's value (whitespace around it is ignored). false with *err naming `name`,
// the value and the accepted form; *out untouched.
bool parse_recovery_lr_factor(const std::string& name, const std::string& value, double* out,
                              std::string* err);
bool parse_recovery_lr_steps(const std::string& name, const std::string& value, int* out,
                             std::string* err);

// Reads R2CCL_RECOVERY_LR_FACTOR and R2CCL_RECOVERY_LR_STEPS through `getenv` (the process
// environment by default; tests pass a table). Each bad value keeps its default, is logged as a
// WARN and appended to *errors (when not null).
using GetEnv = std::function<const char*(const char* name)>;
RecoveryHint recovery_hint_from_env(std::vector<std::string>* errors, const GetEnv& getenv = {});

// Conventional phase names (any name is accepted).
constexpr const char* kPhaseDetect = "detect";
constexpr const char* kPhaseMembership = "membership";
constexpr const char* kPhaseCommRebuild = "comm rebuild";
constexpr const char* kPhaseRestore = "restore";

struct PhaseTime {
  std::string name;
  double seconds = 0;
};

// "[R2CCL] Successfully recovered in X s (node loss: NODES; P S s, ...)" (header comment).
// Without nodes NODES is "unknown"; without phases the "; ..." part is left out.
std::string format_recovered_line(double total_seconds, const std::vector<std::string>& nodes,
                                  const std::vector<PhaseTime>& phases);

class RecoveryTimer {
 public:
  explicit RecoveryTimer(const Clock& clock = SystemClock::instance());

  // Starts the recovery now, or at `t` (e.g. when the lost node was last heard, so detection
  // time counts). Forgets any earlier phases.
  void start();
  void start_at(TimeUs t);
  // Ends the running phase (if any) and starts `name` (start() is implied if not started). A
  // name used again adds to its first entry, which keeps its place in the order.
  void begin(const std::string& name);
  // Ends the running phase (no-op without one).
  void end_phase();
  // Ends the running phase and stops the total.
  void finish();

  bool started() const { return started_; }
  // Start to finish (or to now while running), seconds; 0 before start.
  double total_seconds() const;
  // Completed phases plus the running one up to now, in first-begin order.
  std::vector<PhaseTime> phases() const;
  // format_recovered_line(total_seconds(), nodes, phases()).
  std::string recovered_line(const std::vector<std::string>& nodes) const;

 private:
  const Clock& clock_;
  bool started_ = false;
  bool finished_ = false;
  TimeUs start_ = 0;
  TimeUs end_ = 0;
  int running_ = -1;  // index into names_/spent_, or -1
  TimeUs running_since_ = 0;
  std::vector<std::string> names_;
  std::vector<TimeUs> spent_;
};

}  // namespace r2ccl::snap
