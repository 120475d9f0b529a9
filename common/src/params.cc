#include "r2ccl/params.h"

#include "r2ccl/log.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>

extern char** environ;

namespace r2ccl {
namespace {

bool parse_int(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool parse_double(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  double v = strtod(s.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

const char* type_form(ParamType t) {
  switch (t) {
    case ParamType::kInt: return "an integer";
    case ParamType::kBool: return "0 or 1";
    case ParamType::kSize: return "bytes, optionally with K, M or G";
    case ParamType::kDuration: return "a duration: N (ms), Nus, Nms or Ns";
    case ParamType::kDouble: return "a number";
    case ParamType::kString: return "a string";
  }
  return "?";
}

std::string range_text(const ParamDef& d) {
  std::ostringstream o;
  switch (d.type) {
    case ParamType::kInt: o << "[" << (long long)d.min << ", " << (long long)d.max << "]"; break;
    case ParamType::kBool: o << "0 or 1"; break;
    case ParamType::kSize:
      o << "[" << (long long)d.min << ", " << (long long)d.max << "] bytes";
      break;
    case ParamType::kDuration:
      o << "[" << d.min / 1000.0 << " ms, " << d.max / 1000.0 << " ms]";
      break;
    case ParamType::kDouble: o << "[" << d.min << ", " << d.max << "]"; break;
    case ParamType::kString: o << "-"; break;
  }
  return o.str();
}

template <typename T>
bool assign(const ParamDef& d, const std::string& value, T* field, std::string* err);

bool check_range(const ParamDef& d, double v, const std::string& value, std::string* err) {
  if (v < d.min || v > d.max) {
    *err = std::string(d.name) + "='" + value +
           "' is out of range; accepted: " + type_form(d.type) + " in " + range_text(d);
    return false;
  }
  return true;
}

bool bad_form(const ParamDef& d, const std::string& value, std::string* err) {
  *err = std::string(d.name) + "='" + value + "' is not valid; accepted: " + type_form(d.type) +
         (d.type == ParamType::kString || d.type == ParamType::kBool ? std::string()
                                                                     : " in " + range_text(d));
  return false;
}

bool assign_value(const ParamDef& d, const std::string& value, int64_t* f, std::string* err) {
  int64_t v = 0;
  bool ok = d.type == ParamType::kSize       ? parse_size_bytes(value, &v)
            : d.type == ParamType::kDuration ? parse_duration_us(value, &v)
                                             : parse_int(value, &v);
  if (!ok) return bad_form(d, value, err);
  if (!check_range(d, static_cast<double>(v), value, err)) return false;
  *f = v;
  return true;
}
bool assign_value(const ParamDef& d, const std::string& value, bool* f, std::string* err) {
  if (value == "0")
    *f = false;
  else if (value == "1")
    *f = true;
  else
    return bad_form(d, value, err);
  return true;
}
bool assign_value(const ParamDef& d, const std::string& value, double* f, std::string* err) {
  double v = 0;
  if (!parse_double(value, &v)) return bad_form(d, value, err);
  if (!check_range(d, v, value, err)) return false;
  *f = v;
  return true;
}
bool assign_value(const ParamDef&, const std::string& value, std::string* f, std::string*) {
  *f = value;
  return true;
}

}  // namespace

bool parse_duration_us(const std::string& s, int64_t* out) {
  size_t i = 0;
  while (i < s.size() && (isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) i++;
  double num = 0;
  if (!parse_double(s.substr(0, i), &num) || num < 0) return false;
  std::string unit = s.substr(i);
  double mult;
  if (unit.empty() || unit == "ms")
    mult = 1e3;
  else if (unit == "us")
    mult = 1;
  else if (unit == "s")
    mult = 1e6;
  else
    return false;
  double v = num * mult;
  if (v > 9e18) return false;
  *out = static_cast<int64_t>(std::llround(v));
  return true;
}

bool parse_size_bytes(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  std::string num = s;
  int64_t mult = 1;
  char last = static_cast<char>(toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? 1024 : last == 'M' ? 1024 * 1024 : 1024LL * 1024 * 1024;
    num = s.substr(0, s.size() - 1);
  }
  int64_t v = 0;
  if (!parse_int(num, &v) || v < 0) return false;
  if (v > INT64_MAX / mult) return false;
  *out = v * mult;
  return true;
}

const std::vector<ParamDef>& param_table() {
  static const std::vector<ParamDef> table = {
#define R2CCL_PARAM_DEF(field, name, type, def, min, max, fb, help) \
  ParamDef{name,                                                    \
           ParamType::type,                                         \
           def,                                                     \
           static_cast<double>(min),                                \
           static_cast<double>(max),                                \
           fb,                                                      \
           help,                                                    \
           std::string(name) == "R2CCL_TEST_HOOKS"},
      R2CCL_PARAM_TABLE(R2CCL_PARAM_DEF)
#undef R2CCL_PARAM_DEF
  };
  return table;
}

EnvLookup process_env() {
  return [](const char* n) -> const char* { return getenv(n); };
}

Config default_config() {
  Config c;
  std::string err;
  std::vector<std::string> warnings;
  load_config([](const char*) -> const char* { return nullptr; }, {}, &c, &err, &warnings);
  return c;
}

bool load_config(const EnvLookup& env, const std::vector<std::string>& env_names, Config* out,
                 std::string* err, std::vector<std::string>* warnings) {
  Config c;
  std::set<std::string> known;
#define R2CCL_PARAM_LOAD(field, name, type, def, min, max, fb, help)                              \
  {                                                                                               \
    const ParamDef d{                                                                             \
        name, ParamType::type, def, static_cast<double>(min), static_cast<double>(max), fb, help, \
        false};                                                                                   \
    known.insert(name);                                                                           \
    const char* v = env(name);                                                                    \
    const char* fbn = fb;                                                                         \
    std::string source = "default";                                                               \
    if (v) {                                                                                      \
      source = name;                                                                              \
    } else if (fbn && env(fbn)) {                                                                 \
      v = env(fbn);                                                                               \
      source = fbn;                                                                               \
    }                                                                                             \
    std::string value = v ? v : def;                                                              \
    if (!assign_value(d, value, &c.field, err)) {                                                 \
      if (!v)                                                                                     \
        *err += " (built-in default; this is a bug)";                                             \
      else if (source != name)                                                                    \
        *err += " (read from " + source + ")";                                                    \
      return false;                                                                               \
    }                                                                                             \
    if (fbn) c.sources.push_back(std::string(name) + " from " + source);                          \
  }
  R2CCL_PARAM_TABLE(R2CCL_PARAM_LOAD)
#undef R2CCL_PARAM_LOAD
  // Cross-checks name both values and say which came from the defaults, so a user who set
  // only one of the pair sees what it collided with.
  auto given = [&](const char* name) {
    return env(name) ? std::string() : std::string(", the default");
  };
  auto ms = [](long long us) { return std::to_string(us / 1000) + " ms"; };
  auto pair_err = [&](const char* a, const std::string& av, const char* rel, const char* b,
                      const std::string& bv) {
    return std::string(a) + " (" + av + given(a) + ") must be " + rel + " " + b + " (" + bv +
           given(b) + ")";
  };
  if (c.reconnect_max < c.reconnect_min) {
    *err = pair_err("R2CCL_RECONNECT_MAX", ms(c.reconnect_max), ">=", "R2CCL_RECONNECT_MIN",
                    ms(c.reconnect_min));
    return false;
  }
  if (c.holddown_max < c.holddown_min) {
    *err = pair_err("R2CCL_HOLDDOWN_MAX", ms(c.holddown_max), ">=", "R2CCL_HOLDDOWN_MIN",
                    ms(c.holddown_min));
    return false;
  }
  if (c.predict_window < 2 * c.predict_interval ||
      c.predict_window / c.predict_interval > kMaxPredictWindowSteps) {
    *err = "R2CCL_PREDICT_WINDOW / R2CCL_PREDICT_INTERVAL is " +
           std::to_string(c.predict_window / c.predict_interval) + " samples (accepted: 2 to " +
           std::to_string(kMaxPredictWindowSteps) + "; the shipped model was trained on 24)";
    return false;
  }
  if (c.predict_return_threshold > c.predict_threshold) {
    auto num = [](double x) {
      char b[32];
      snprintf(b, sizeof(b), "%g", x);
      return std::string(b);
    };
    *err = pair_err("R2CCL_PREDICT_RETURN_THRESHOLD", num(c.predict_return_threshold),
                    "<=", "R2CCL_PREDICT_THRESHOLD", num(c.predict_threshold));
    return false;
  }
  if (c.predict_decider != "both" && c.predict_decider != "lstm" &&
      c.predict_decider != "baseline") {
    *err = "R2CCL_PREDICT_DECIDER='" + c.predict_decider + "' is not valid; accepted: both, " +
           "lstm or baseline";
    return false;
  }
  if (c.path_window < c.chunk_size) {
    *err = pair_err("R2CCL_PATH_WINDOW", std::to_string(c.path_window) + " bytes",
                    ">=", "R2CCL_CHUNK_SIZE", std::to_string(c.chunk_size) + " bytes");
    return false;
  }
  if (warnings) {
    // Variables of the snapshot client library and daemon (snapshot/), which share the
    // training process's environment with the plugins: theirs to check, not ours to warn about.
    static const char* const kSnapshotPrefixes[] = {"R2CCL_SNAPSHOT_", "R2CCL_SNAPD_",
                                                    "R2CCL_RECOVERY_", "R2CCL_NCCL_LIBRARY",
                                                    "R2CCL_PG_HOST"};
    auto snapshot_name = [](const std::string& n) {
      for (const char* p : kSnapshotPrefixes)
        if (n.rfind(p, 0) == 0) return true;
      return false;
    };
    for (const auto& n : env_names) {
      // R2CCL_TEST_* names are reserved for the test suite's own harness variables.
      if (n.rfind("R2CCL_", 0) == 0 && n.rfind("R2CCL_TEST_", 0) != 0 && !known.count(n) &&
          !snapshot_name(n))
        warnings->push_back("unknown variable " + n + " is ignored (see r2ccl_perf --params)");
    }
  }
  *out = std::move(c);
  return true;
}

bool process_config(const Config** out, std::string* err) {
  static std::once_flag once;
  static Config cfg;
  static bool ok = false;
  static std::string error;
  static std::vector<std::string> warnings;
  std::call_once(once, [] {
    std::vector<std::string> names;
    for (char** e = environ; e && *e; ++e) {
      const char* eq = strchr(*e, '=');
      if (eq) names.emplace_back(*e, eq - *e);
    }
    ok = load_config(process_env(), names, &cfg, &error, &warnings);
    for (const auto& w : warnings) R2CCL_WARN("%s", w.c_str());
  });
  if (!ok) {
    if (err) *err = error;
    return false;
  }
  *out = &cfg;
  return true;
}

std::string format_param_table(bool markdown) {
  std::ostringstream o;
  if (markdown) {
    o << "| variable | type | default | accepted | NCCL fallback | meaning |\n";
    o << "|---|---|---|---|---|---|\n";
  }
  for (const auto& d : param_table()) {
    std::string type = d.type == ParamType::kInt        ? "int"
                       : d.type == ParamType::kBool     ? "bool"
                       : d.type == ParamType::kSize     ? "size"
                       : d.type == ParamType::kDuration ? "duration"
                       : d.type == ParamType::kDouble   ? "number"
                                                        : "string";
    std::string help = d.test_only ? std::string("(test only) ") + d.help : d.help;
    if (markdown) {
      std::string h = help;
      for (size_t p = 0; (p = h.find('|', p)) != std::string::npos; p += 2) h.replace(p, 1, "\\|");
      o << "| `" << d.name << "` | " << type << " | `" << (*d.def ? d.def : "(empty)") << "` | "
        << range_text(d) << " | " << (d.nccl_fallback ? d.nccl_fallback : "-") << " | " << h
        << " |\n";
    } else {
      o << d.name << " (" << type << ", default '" << d.def << "', " << range_text(d);
      if (d.nccl_fallback) o << ", fallback " << d.nccl_fallback;
      o << ")\n    " << help << "\n";
    }
  }
  return o.str();
}

}  // namespace r2ccl
