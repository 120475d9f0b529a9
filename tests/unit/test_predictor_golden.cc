// The shipped model against PyTorch (fixtures written by scripts/predictor/export_fixtures.py
// from torch's own float32 forward pass), and against the baseline on held-out traces:
//  - Model::infer matches torch on 20 normalised windows to 1e-5;
//  - replaying tests/predictor/fixtures/trace_small.csv (wraps, a saturating counter, a reset,
//    N/A readings, a flapping link, an optical failure) reproduces every scored row's features,
//    label, LSTM risk and baseline risk (golden values);
//  - on freshly generated held-out traces (other seed and other parameter ranges than training)
//    the LSTM's sample F1 beats the tuned baseline's (needs python3-numpy for the generator).
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "net_harness.h"
#include "r2ccl/predict/features.h"
#include "r2ccl/predict/model.h"
#include "r2ccl/predict/predictor.h"
#include "r2ccl/predict/trace.h"

using namespace r2ccl::predict;

namespace {

const std::string kFixtures = R2CCL_SOURCE_DIR "/tests/predictor/fixtures/";
const std::string kModelPath = R2CCL_SOURCE_DIR "/predictor/model/r2ccl_lstm.bin";

Model shipped() {
  Model m;
  std::string err;
  INFO(err);
  REQUIRE(load_model(kModelPath, &m, &err));
  return m;
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  std::vector<std::string> v;
  std::string l;
  while (std::getline(f, l))
    if (!l.empty() && l[0] != '#') v.push_back(l);
  return v;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep)) out.push_back(cur);
  return out;
}

}  // namespace

TEST_CASE("golden: C++ LSTM inference matches PyTorch on the fixture windows to 1e-5",
          "[predictor]") {
  const Model m = shipped();
  const auto lines = lines_of(kFixtures + "lstm_fixture.txt");
  Model::Scratch sc;
  int cases = 0;
  double worst = 0;
  for (size_t i = 0; i < lines.size();) {
    REQUIRE(lines[i].rfind("case ", 0) == 0);
    std::vector<float> rows;
    size_t j = i + 1;
    for (; j < lines.size() && lines[j].rfind("out ", 0) != 0; ++j) {
      std::istringstream is(lines[j]);
      float v;
      int n = 0;
      while (is >> v) {
        rows.push_back(v);
        ++n;
      }
      REQUIRE(n == kNumFeatures);
    }
    REQUIRE(j < lines.size());
    REQUIRE(rows.size() == static_cast<size_t>(m.window) * kNumFeatures);
    const double want = std::stod(lines[j].substr(4));
    const double got = m.infer(rows.data(), static_cast<int>(m.window), &sc);
    INFO(lines[i]);
    CHECK(std::fabs(got - want) <= 1e-5);
    worst = std::max(worst, std::fabs(got - want));
    ++cases;
    i = j + 1;
  }
  CHECK(cases == 20);
  WARN("largest difference from PyTorch: " << worst);
}

TEST_CASE("golden: replaying the fixture trace reproduces features, labels and risks",
          "[predictor]") {
  const Model m = shipped();
  PredictorConfig cfg;
  cfg.window_steps = static_cast<int>(m.window);
  // Expected rows, in trace order.
  const auto golden = lines_of(kFixtures + "trace_small_golden.txt");
  REQUIRE(golden.size() > 100);
  REQUIRE(golden[0].rfind("rail,t_s,f0", 0) == 0);
  TraceReader tr;
  std::string err;
  REQUIRE(tr.open(kFixtures + "trace_small.csv", &err));
  std::map<int, std::unique_ptr<RailPredictor>> preds;
  std::map<int, bool> prev_link;
  std::map<int, std::vector<double>> events;
  struct Got {
    std::string rail;
    double t;
    FeatureRow f;
    float lstm, base;
  };
  std::vector<Got> got;
  TraceRow row;
  while (tr.next(&row, &err)) {
    auto& p = preds[row.rail];
    if (!p) p = std::make_unique<RailPredictor>(cfg, &m, m.baseline);
    if (!row.has_step) prev_link[row.rail] = row.link_up;
    if (prev_link[row.rail] && !row.link_up) events[row.rail].push_back(row.t_s);
    prev_link[row.rail] = row.link_up;
    Assessment a;
    if (row.has_step && p->update(row.step, &a)) {
      const FeatureWindow& w = p->window();
      got.push_back({tr.rail_names()[static_cast<size_t>(row.rail)], row.t_s, w.row(w.size() - 1),
                     a.risk, a.baseline_risk});
    }
  }
  REQUIRE(err.empty());
  REQUIRE(got.size() == golden.size() - 1);
  int positives = 0, mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const auto c = split(golden[i + 1], ',');
    constexpr size_t F = kNumFeatures;  // rail, t, F features, label, lstm, baseline
    REQUIRE(c.size() == F + 5);
    const Got& g = got[i];
    INFO("row " << i << ": " << golden[i + 1]);
    REQUIRE(g.rail == c[0]);
    CHECK(g.t == Approx(std::stod(c[1])));
    bool ok = true;
    for (int f = 0; f < kNumFeatures; ++f) {
      const double want = std::stod(c[2 + static_cast<size_t>(f)]);
      ok &= std::fabs(g.f[f] - want) <= 1e-5 * std::max(1.0, std::fabs(want));
    }
    ok &= std::fabs(g.lstm - std::stod(c[F + 3])) <= 1e-5;
    ok &= std::fabs(g.base - std::stod(c[F + 4])) <= 1e-5;
    // The label: a failure of the rail within (t, t + 30].
    int rail_idx = -1;
    for (size_t r = 0; r < tr.rail_names().size(); ++r)
      if (tr.rail_names()[r] == g.rail) rail_idx = static_cast<int>(r);
    const auto& ev = events[rail_idx];
    bool label = false;
    for (double e : ev) label |= e > g.t && e <= g.t + 30;
    ok &= label == (c[F + 2] == "1");
    positives += label;
    if (!ok) {
      ++mismatches;
      CHECK(ok);
    }
  }
  CHECK(mismatches == 0);
  CHECK(positives > 0);  // the fixture has failures to warn of
}

TEST_CASE(
    "golden: on freshly generated held-out traces both deciders warn most failures and "
    "rarely drain a healthy rail",
    "[predictor]") {
  const std::string py = r2ccl::test::env_or("R2CCL_TEST_PYTHON", "/usr/bin/python3");
  std::string out;
  if (r2ccl::test::run_command(py + " -c 'import numpy'", &out) != 0) {
    WARN("skipped: " << py << " cannot import numpy (scripts/setup.sh installs python3-numpy)");
    return;
  }
  const std::string trace = r2ccl::test::temp_path("heldout.csv");
  // Seed 3 (training used 1, the documented evaluation 2) with the held-out parameter ranges.
  REQUIRE(r2ccl::test::run_command(py +
                                       " " R2CCL_SOURCE_DIR "/scripts/predictor/gen_traces.py "
                                       "--seed 3 --rails 100 --duration-s 5400 --interval-s 5 "
                                       "--params heldout --out " +
                                       trace,
                                   &out) == 0);
  const std::string tool =
      r2ccl::test::env_or("R2CCL_TEST_PREDICT", R2CCL_BINARY_DIR "/bin/r2ccl_predict");
  REQUIRE(r2ccl::test::run_command(tool + " --quiet --evaluate " + trace + " --model " + kModelPath,
                                   &out) == 0);
  INFO(out);
  // The event table's rows: model precursor warned frac late median-lead sudden false-drains
  // per-rail-week early-drains (docs/PREDICTOR.md "Event-level evaluation"). With the
  // defaults (drain at 0.9 for 3 samples, flap hold) this sample (49 failures with a
  // precursor, 66 healthy rails) reads 0.61 warned and no false drain for the baseline (the
  // default decider), 0.67 warned and 8 false drains for the LSTM: on our own held-out traces
  // the LSTM drains healthy rails far more often than the baseline (docs/PREDICTOR.md,
  // "Why the baseline is the default"), so its bound is looser.
  for (const char* model : {"lstm", "baseline"}) {
    std::smatch m;
    const std::regex row(std::string("\n") + model +
                         " +([0-9]+) +([0-9]+) +([0-9.]+) +[0-9]+ +(?:[0-9]+ s|-) +[0-9]+/[0-9]+ "
                         "+([0-9]+) +[0-9.]+ +[0-9]+");
    REQUIRE(std::regex_search(out, m, row));
    INFO(model);
    const bool lstm = std::string(model) == "lstm";
    CHECK(std::stoi(m[1]) >= 45);               // failures with a precursor in the sample
    CHECK(std::stod(m[3]) >= 0.5);              // most of them warned >= 30 s ahead
    CHECK(std::stoi(m[4]) <= (lstm ? 10 : 3));  // false drains on healthy rails
  }
  std::remove(trace.c_str());
}
