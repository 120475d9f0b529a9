// Reader of counter traces (docs/PREDICTOR.md "Trace format"): CSV rows of raw cumulative
// counter readings per rail, turned into Steps with the same delta rules as the live sampler.
// Used by r2ccl_predict --replay/--features and by tests.
// Thread-safety: none (one reader per thread).
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "r2ccl/predict/counters.h"

namespace r2ccl::predict {

struct TraceRow {
  int rail = -1;  // index in rail_names(), in order of first appearance
  double t_s = 0;
  bool link_up = true;
  bool has_step = false;  // false for a rail's first row (it only primes the deltas)
  Step step;
  int scenario = -1;  // index in scenarios()
  int line = 0;       // 1-based line number in the file
};

class TraceReader {
 public:
  // Opens `path`. False with *err ("cannot open ...").
  bool open(const std::string& path, std::string* err);
  // Next data row. Returns false at the end (*err empty) or on malformed input (*err names the
  // file, the line, the column and the accepted form).
  bool next(TraceRow* out, std::string* err);

  const std::vector<std::string>& rail_names() const { return rails_; }
  const std::vector<std::string>& scenarios() const { return scenarios_; }
  // The file-wide width of a counter ("# widths:"; undeclared: wrap64).
  Width width(int counter) const { return widths_[counter]; }
  // The width a rail's counter is read with: the file-wide one, or that of the last
  // "# widths for PREFIX:" line whose PREFIX starts the rail's name and declares the counter,
  // as they stood at the rail's first row.
  Width width_of(int rail, int counter) const {
    return state_[static_cast<size_t>(rail)].widths[counter];
  }

 private:
  bool parse_header(const std::string& line, std::string* err);
  bool parse_widths(const std::string& line, std::string* err);
  std::string where(int col) const;

  struct RailState {
    double t = 0;
    Reading prev[kNumCounters];
    Width widths[kNumCounters];
  };
  // "# widths for PREFIX: ..." lines, in file order.
  struct ScopedWidths {
    std::string prefix;
    Width w[kNumCounters];
    bool set[kNumCounters] = {};
  };
  std::vector<ScopedWidths> scoped_;
  std::ifstream in_;
  std::string path_;
  int line_no_ = 0;
  bool have_header_ = false;
  // column index of t_s, rail, link, speed_mbps, each counter, scenario (-1 absent)
  int col_t_ = -1, col_rail_ = -1, col_link_ = -1, col_speed_ = -1, col_scen_ = -1;
  int col_counter_[kNumCounters];
  std::vector<std::string> header_;
  Width widths_[kNumCounters];
  std::vector<std::string> rails_;
  std::map<std::string, int> rail_index_;
  std::vector<RailState> state_;
  std::vector<std::string> scenarios_;
  std::map<std::string, int> scenario_index_;
};

}  // namespace r2ccl::predict
