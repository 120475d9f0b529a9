#include "r2ccl/predict/trace.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace r2ccl::predict {

namespace {

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : line) {
    if (ch == ',') {
      out.push_back(cur);
      cur.clear();
    } else if (ch != '\r') {
      cur += ch;
    }
  }
  out.push_back(cur);
  return out;
}

// A field as it may be shown in a message: printable ASCII only, at most 40 characters.
std::string shown(const std::string& s) {
  std::string o;
  for (char c : s.substr(0, 40)) o += (c >= 0x20 && c < 0x7f) ? c : '?';
  return s.size() > 40 ? o + "..." : o;
}

// Decimal numbers only ("12", "-0.5", "1e3"): no hex, inf or nan, which strtod would take.
bool parse_double(const std::string& s, double* out) {
  if (s.empty() || s.find_first_not_of("0123456789.eE+-") != std::string::npos) return false;
  char* end = nullptr;
  *out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(*out);
}

}  // namespace

bool TraceReader::open(const std::string& path, std::string* err) {
  path_ = path;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    *err = "cannot open trace " + path + ": " + std::strerror(errno);
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    *err = "cannot open trace " + path + ": not a regular file (a CSV file is expected)";
    return false;
  }
  in_.open(path);
  if (!in_) {
    *err = "cannot open trace " + path + ": " + std::strerror(errno);
    return false;
  }
  for (int c = 0; c < kNumCounters; ++c) col_counter_[c] = -1;
  return true;
}

std::string TraceReader::where(int col) const {
  std::string s = path_ + " line " + std::to_string(line_no_);
  if (col >= 0 && static_cast<size_t>(col) < header_.size()) s += " column " + header_[col];
  return s;
}

bool TraceReader::parse_widths(const std::string& line, std::string* err) {
  // "# widths: NAME=sat16 NAME=wrap32 ..." (every rail) or "# widths for PREFIX: ..." (rails
  // whose name starts with PREFIX).
  const size_t colon = line.find(':');
  ScopedWidths* scope = nullptr;
  const std::string head = line.substr(0, colon);
  if (head.rfind("# widths for ", 0) == 0) {
    const std::string prefix = head.substr(13);
    if (prefix.empty() || prefix.find_first_of(" ,") != std::string::npos) {
      *err = where(-1) + ": bad widths line '" + shown(line) +
             "' (accepted: '# widths: ...' or '# widths for PREFIX: ...', PREFIX the start of "
             "rail names, no spaces or commas)";
      return false;
    }
    scoped_.emplace_back();
    scope = &scoped_.back();
    scope->prefix = prefix;
  }
  std::istringstream is(line.substr(colon + 1));
  std::string item;
  bool named[kNumCounters] = {};
  while (is >> item) {
    const size_t eq = item.find('=');
    const int c = eq == std::string::npos ? -1 : counter_by_name(item.substr(0, eq));
    Width w;
    if (c < 0 || !parse_width(item.substr(eq + 1), &w)) {
      *err = where(-1) + ": bad width declaration '" + shown(item) +
             "' (accepted: COUNTER=satN or COUNTER=wrapN, N 1..64, COUNTER one of the counter "
             "columns)";
      return false;
    }
    if (named[c]) {
      *err = where(-1) + ": counter '" + counter_name(c) +
             "' is declared twice in one widths line (accepted: each counter once a line)";
      return false;
    }
    named[c] = true;
    if (scope) {
      scope->w[c] = w;
      scope->set[c] = true;
    } else {
      widths_[c] = w;
    }
  }
  return true;
}

bool TraceReader::parse_header(const std::string& text, std::string* err) {
  std::string line = text;
  if (line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 byte-order mark
  header_ = split_csv(line);
  for (size_t i = 0; i < header_.size(); ++i) {
    const std::string& h = header_[i];
    const int col = static_cast<int>(i);
    if (std::count(header_.begin(), header_.begin() + col, h) > 0) {
      *err = where(-1) + ": column '" + shown(h) + "' appears twice";
      return false;
    }
    if (h == "t_s")
      col_t_ = col;
    else if (h == "rail")
      col_rail_ = col;
    else if (h == "link")
      col_link_ = col;
    else if (h == "speed_mbps")
      col_speed_ = col;
    else if (h == "scenario")
      col_scen_ = col;
    else if (counter_by_name(h) >= 0)
      col_counter_[counter_by_name(h)] = col;
    else {
      *err =
          where(-1) + ": unknown column '" + shown(h) + "' (docs/PREDICTOR.md lists the columns)";
      return false;
    }
  }
  if (col_t_ < 0 || col_rail_ < 0) {
    *err = where(-1) + ": the header needs at least the columns t_s and rail";
    return false;
  }
  have_header_ = true;
  return true;
}

bool TraceReader::next(TraceRow* out, std::string* err) {
  err->clear();
  std::string line;
  while (std::getline(in_, line)) {
    ++line_no_;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (line[0] == '#') {
      if (line.rfind("# widths:", 0) == 0 || line.rfind("# widths for ", 0) == 0) {
        if (have_header_) {
          *err = where(-1) +
                 ": a widths line after the header (widths lines come first, so "
                 "they hold for the whole file)";
          return false;
        }
        if (!parse_widths(line, err)) return false;
      }
      continue;
    }
    if (!have_header_) {
      if (!parse_header(line, err)) return false;
      continue;
    }
    const std::vector<std::string> f = split_csv(line);
    if (f.size() != header_.size()) {
      *err = where(-1) + ": " + std::to_string(f.size()) + " fields, the header has " +
             std::to_string(header_.size());
      return false;
    }
    TraceRow r;
    r.line = line_no_;
    if (!parse_double(f[col_t_], &r.t_s)) {
      *err = where(col_t_) + ": '" + shown(f[col_t_]) + "' is not a number of seconds";
      return false;
    }
    const std::string& name = f[col_rail_];
    if (name.empty()) {
      *err = where(col_rail_) + ": empty rail name";
      return false;
    }
    auto it = rail_index_.find(name);
    const bool first = it == rail_index_.end();
    if (first) {
      it = rail_index_.emplace(name, static_cast<int>(rails_.size())).first;
      rails_.push_back(name);
      state_.emplace_back();
      RailState& ns = state_.back();
      for (int c = 0; c < kNumCounters; ++c) ns.widths[c] = widths_[c];
      for (const ScopedWidths& sw : scoped_)
        if (name.rfind(sw.prefix, 0) == 0)
          for (int c = 0; c < kNumCounters; ++c)
            if (sw.set[c]) ns.widths[c] = sw.w[c];
    }
    r.rail = it->second;
    RailState& st = state_[static_cast<size_t>(r.rail)];
    if (col_link_ >= 0) {
      if (f[col_link_] != "0" && f[col_link_] != "1") {
        *err = where(col_link_) + ": '" + shown(f[col_link_]) + "' (accepted: 1 up, 0 down)";
        return false;
      }
      r.link_up = f[col_link_] == "1";
    }
    double speed = 0;
    if (col_speed_ >= 0 && !f[col_speed_].empty() && f[col_speed_] != "N/A" &&
        (!parse_double(f[col_speed_], &speed) || speed < 0)) {
      *err = where(col_speed_) + ": '" + shown(f[col_speed_]) + "' is not a speed in Mb/s";
      return false;
    }
    Step s;
    s.link_up = r.link_up;
    s.speed_mbps = speed;
    s.missing = (1u << kNumCounters) - 1;
    Reading curs[kNumCounters];
    Delta deltas[kNumCounters];
    for (int c = 0; c < kNumCounters; ++c) {
      Reading& cur = curs[c];
      if (col_counter_[c] >= 0) {
        const std::string& v = f[col_counter_[c]];
        if (!v.empty() && v != "N/A") {
          cur = parse_reading(v);
          if (!cur.present) {
            *err = where(col_counter_[c]) + ": '" + shown(v) +
                   "' is not a counter reading (accepted: an unsigned integer, empty or N/A)";
            return false;
          }
        }
      }
      deltas[c] = counter_delta(st.prev[c], cur, st.widths[c]);
      st.prev[c] = cur;
    }
    settle_resets(deltas, curs, kNumCounters);
    for (int c = 0; c < kNumCounters; ++c) {
      const Delta& d = deltas[c];
      // A saturated counter counts nothing more: unknown, not a quiet 0 (nor its last jump).
      if (d.kind != DeltaKind::kMissing && d.kind != DeltaKind::kSaturated) {
        s.d[c] = static_cast<double>(d.value);
        s.missing &= ~(1u << c);
        if (d.kind == DeltaKind::kReset) s.reset |= 1u << c;
      }
    }
    if (!first) {
      if (!(r.t_s > st.t)) {
        *err = where(col_t_) + ": time " + shown(f[col_t_]) + " does not increase for rail " +
               shown(name);
        return false;
      }
      s.dt_s = r.t_s - st.t;
      r.has_step = true;
    }
    st.t = r.t_s;
    r.step = s;
    if (col_scen_ >= 0) {
      const std::string& sc = f[col_scen_];
      auto si = scenario_index_.find(sc);
      if (si == scenario_index_.end()) {
        si = scenario_index_.emplace(sc, static_cast<int>(scenarios_.size())).first;
        scenarios_.push_back(sc);
      }
      r.scenario = si->second;
    }
    *out = r;
    return true;
  }
  if (!have_header_) *err = path_ + ": no header line";
  return false;
}

}  // namespace r2ccl::predict
