// The failure predictor's models: the LSTM read from a versioned, checksummed weights file
// (layout in docs/PREDICTOR.md "Weights file"), and the threshold baseline, which is always
// available (its tuned thresholds are compiled in and also carried by the weights file).
//
// Inference is hand-written (a 1-layer LSTM of a few thousand weights does not need a linear
// algebra library): PyTorch's torch.nn.LSTM equations, gates in PyTorch's order i, f, g, o
// (PyTorch 1.13 documentation of torch.nn.LSTM), float32 throughout.
// Thread-safety: a Model is immutable after load and may be shared by threads; each thread
// passes its own Scratch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "r2ccl/predict/features.h"

namespace r2ccl::predict {

constexpr char kModelMagic[8] = {'R', '2', 'P', 'R', 'D', 'L', 'S', 'T'};
// 2: the trend features (issue 17); 3: recent_downs (11 features); 4: the baseline's rise rule;
// 5: counts since a reset step no counter's history, and the baseline's fall rule
constexpr uint32_t kModelVersion = 5;
constexpr size_t kModelMaxBytes = 1024 * 1024;  // the budget: under 1 MB

// The threshold detector: the mean of the last `steps` raw rows of features 0..3, risk =
// min(1, 0.7 * max_i(mean_i / threshold_i)); a threshold <= 0 or not finite is unused.
// err_excess (feature 0) counts at the lower of its mean and its latest value: a burst that
// has fallen back under the threshold does not drain the rail on the mean's memory of it, and
// a rising rate, whose latest value is above its mean, is judged by the mean as before. While
// err_excess stands below its mean (falling back), err_slope (feature 1) counts the same way:
// the mean of a slope still holds the burst's rise for a window after the rate turned down.
// The rise rule (rise_lag > 0) makes the risk 1 at a row whose err_excess (feature 0, a log
// rate over the rail's own floor) rose over each of the last two rise_lag-row intervals by at
// least rise_least, the later rise at least rise_ratio times the earlier, and is rise_level or
// more: a rate that keeps growing, as a creep's does, seen minutes before the k-row mean
// catches up with a fast one. A floor that steps up and stays gives shrinking rises, and a
// burst is a step up and back: either fires it only while its window straddles the step (at
// most 2 rows with rise_ratio >= 1, under the 3 samples R2CCL_PREDICT_ENTER_SAMPLES holds a
// drain back for). It needs 2 * rise_lag + 1 rows (fewer: it does not fire).
// The fall rule: where err_excess stands kFallLeast or more below its value kFallLag rows
// back, err_excess and err_slope count 0. A burst's decaying tail is a rate that has just
// fallen hard, and the mean of the last `steps` rows, which still holds the burst, does not
// drain the rail on it; a creep's rate does not fall so. It needs kFallLag + 1 rows.
// docs/PREDICTOR.md "Baseline".
struct BaselineParams {
  float threshold[4] = {};
  int steps = 1;
  int rise_lag = 0;      // rows; 0 = no rise rule
  float rise_least = 0;  // err_excess units (natural log of 1 + errors per second)
  float rise_ratio = 0;  // later rise / earlier rise, at least
  float rise_level = 0;  // err_excess units
};
constexpr int kFallLag = 4;         // rows (20 s at the 5 s interval)
constexpr float kFallLeast = 0.8f;  // err_excess units: the rate fell to under 0.45x
constexpr int kRiseMaxLag = 1024;   // rows: the most a weights file may ask for
// The compiled-in baseline, tuned by scripts/predictor/train.py (predictor/model/
// baseline_defaults.h).
BaselineParams default_baseline();

// Risk of the baseline over a window's raw rows (oldest first). 0 with no rows.
// If `ratio` is non-null it receives mean_i / threshold_i per feature 0..3, and `rising`
// whether the rise rule fired (both for the "top counters" line).
float baseline_risk(const FeatureRow* rows, int n, const BaselineParams& p,
                    float ratio[4] = nullptr, bool* rising = nullptr);
// Whether the rise rule of `p` fires at the last of `n` rows (oldest first).
bool baseline_rising(const FeatureRow* rows, int n, const BaselineParams& p);
// What a window of `window_steps` rows takes from baseline `p`, for a one-time note: its
// thresholds averaged over fewer rows than tuned, its rise rule never judged; "" when neither.
// `setting` names what set the window ("--window-steps 6"). Any thread.
std::string baseline_window_note(const BaselineParams& p, int window_steps,
                                 const std::string& setting);

struct Model {
  uint32_t n_features = 0;         // kNumFeatures
  uint32_t hidden = 0;             // H
  uint32_t window = 0;             // W, the steps the model was trained on
  uint32_t horizon_s = 0;          // failure horizon, seconds (30)
  float interval_s = 0;            // sampling interval the model was trained at, seconds
  std::vector<float> mean, stdev;  // [F] normalisation
  BaselineParams baseline;
  std::vector<float> w_ih, w_hh, b_ih, b_hh;  // [4H x F], [4H x H], [4H], [4H]
  std::vector<float> w_out;                   // [H]
  float b_out = 0;
  std::string metadata;  // JSON text from the file (not interpreted)
  size_t file_bytes = 0;
  // The recurrent weights transposed at load ([F x 4H], [H x 4H]) with the two biases summed,
  // so that inference runs over contiguous gate rows (vectorisable).
  std::vector<float> w_ih_t, w_hh_t, bias;

  struct Scratch {
    std::vector<float> h, c, gates;
  };
  // Probability of a failure within horizon_s, from `n` already *normalised* rows (oldest
  // first). Callers left-pad with zero rows to `window`; any n >= 1 works. Allocates only
  // the first time a Scratch is used.
  float infer(const float* rows, int n, Scratch* s) const;
  // Normalises a raw row into `out` ((x - mean) / std).
  void normalise(const FeatureRow& raw, float* out) const;
};

// Parses a weights file's bytes. On failure returns false and *err names the problem
// ("bad magic", "version 3, this build reads 1", "checksum mismatch", "truncated: ...").
bool parse_model(const uint8_t* data, size_t n, Model* out, std::string* err);
// Reads and parses `path`. Files over kModelMaxBytes are refused without reading them whole.
bool load_model(const std::string& path, Model* out, std::string* err);

}  // namespace r2ccl::predict
