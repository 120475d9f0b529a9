#include "rules.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <strings.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "r2ccl/file_util.h"

namespace r2ccl::tuner {
namespace {

const char* const kCollNames[kNumColls] = {"broadcast", "reduce", "allgather", "reducescatter",
                                           "allreduce"};
const char* const kAlgoNames[kMaxAlgos] = {
    "tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
const char* const kProtoNames[kMaxProtos] = {"ll", "ll128", "simple"};

constexpr size_t kMaxFileBytes = 1 << 20;
constexpr size_t kMaxLineBytes = 4096;

int find_name(const char* const* names, int n, const std::string& s) {
  for (int i = 0; i < n; ++i)
    if (strcasecmp(names[i], s.c_str()) == 0) return i;
  return -1;
}

// One parse error, with the 1-based column it points at.
struct Error {
  int col = 0;
  std::string msg;
};

struct Token {
  std::string text;
  int col;  // 1-based
};

std::vector<Token> split_ws(const std::string& line) {
  std::vector<Token> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    if (i >= line.size()) break;
    size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t' && line[j] != '\r') ++j;
    out.push_back({line.substr(i, j - i), static_cast<int>(i) + 1});
    i = j;
  }
  return out;
}

std::vector<Token> split_csv(const std::string& line) {
  std::vector<Token> out;
  size_t start = 0;
  while (true) {
    size_t comma = line.find(',', start);
    size_t end = comma == std::string::npos ? line.size() : comma;
    size_t a = start, b = end;
    while (a < b && (line[a] == ' ' || line[a] == '\t' || line[a] == '\r')) ++a;
    while (b > a && (line[b - 1] == ' ' || line[b - 1] == '\t' || line[b - 1] == '\r')) --b;
    out.push_back({line.substr(a, b - a), static_cast<int>(a) + 1});
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// Unsigned integer with an optional K/M/G/T suffix (powers of 1024). Rejects signs, junk
// and overflow.
bool parse_u64(const std::string& s, bool allow_suffix, uint64_t* out, std::string* why) {
  if (s.empty()) {
    *why = "empty number";
    return false;
  }
  if (s[0] == '-') {
    *why = "negative value '" + s + "'";
    return false;
  }
  uint64_t v = 0;
  size_t i = 0;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
    uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (v > (UINT64_MAX - d) / 10) {
      *why = "number too large '" + s + "'";
      return false;
    }
    v = v * 10 + d;
  }
  if (i == 0) {
    *why = "not a number '" + s + "'";
    return false;
  }
  if (i < s.size()) {
    int shift = -1;
    if (allow_suffix && i + 1 == s.size()) {
      switch (s[i]) {
        case 'K':
        case 'k': shift = 10; break;
        case 'M':
        case 'm': shift = 20; break;
        case 'G':
        case 'g': shift = 30; break;
        case 'T':
        case 't': shift = 40; break;
        default: break;
      }
    }
    if (shift < 0) {
      *why = "not a number '" + s + "'";
      return false;
    }
    if (v > (UINT64_MAX >> shift)) {
      *why = "number too large '" + s + "'";
      return false;
    }
    v <<= shift;
  }
  *out = v;
  return true;
}

// "any", "N", "A-B", "A+".
bool parse_range(const std::string& s, bool allow_suffix, Range* out, std::string* why) {
  Range r;
  if (strcasecmp(s.c_str(), "any") == 0) {
    *out = r;
    return true;
  }
  if (!s.empty() && s.back() == '+') {
    if (!parse_u64(s.substr(0, s.size() - 1), allow_suffix, &r.lo, why)) return false;
    *out = r;
    return true;
  }
  size_t dash = s.find('-', 1);
  if (dash == std::string::npos) {
    if (!parse_u64(s, allow_suffix, &r.lo, why)) return false;
    r.hi = r.lo;
  } else {
    if (!parse_u64(s.substr(0, dash), allow_suffix, &r.lo, why)) return false;
    if (!parse_u64(s.substr(dash + 1), allow_suffix, &r.hi, why)) return false;
    if (r.hi < r.lo) {
      *why = "range '" + s + "' ends before it starts";
      return false;
    }
  }
  *out = r;
  return true;
}

// CSV integer field: -1 means any/keep, else a non-negative integer.
bool parse_csv_int(const std::string& s, bool allow_suffix, bool* wildcard, uint64_t* v,
                   std::string* why) {
  if (s == "-1") {
    *wildcard = true;
    return true;
  }
  *wildcard = false;
  return parse_u64(s, allow_suffix, v, why);
}

bool parse_channels(const std::string& s, int* out, std::string* why) {
  if (s == "-1" || strcasecmp(s.c_str(), "any") == 0 || strcasecmp(s.c_str(), "keep") == 0) {
    *out = -1;
    return true;
  }
  uint64_t v = 0;
  if (!parse_u64(s, false, &v, why)) return false;
  if (v < 1 || v > static_cast<uint64_t>(kMaxChannels)) {
    *why = "channels " + s + " outside 1.." + std::to_string(kMaxChannels) + " (or -1)";
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

bool parse_positive_double(const std::string& s, double* out, std::string* why) {
  errno = 0;
  char* end = nullptr;
  double v = strtod(s.c_str(), &end);
  if (s.empty() || !end || *end != '\0' || errno != 0 || !std::isfinite(v) || v < 0 || v > 1e9) {
    *why = "expected a number in 0..1e9, got '" + s + "'";
    return false;
  }
  *out = v;
  return true;
}

bool parse_csv_line(const std::string& line, Rule* r, Error* e) {
  std::vector<Token> f = split_csv(line);
  if (f.size() < 8 || f.size() > 10) {
    e->col = 1;
    e->msg = "expected 8, 9 or 10 comma-separated fields (NCCL tuner CSV), got " +
             std::to_string(f.size());
    return false;
  }
  std::string why;
  auto fail = [&](const Token& t, const std::string& m) {
    e->col = t.col;
    e->msg = m;
    return false;
  };
  r->coll = parse_coll(f[0].text);
  if (r->coll < 0) return fail(f[0], "unknown collective '" + f[0].text + "'");
  uint64_t lo = 0, hi = 0;
  if (!parse_u64(f[1].text, true, &lo, &why)) return fail(f[1], "min_bytes: " + why);
  if (!parse_u64(f[2].text, true, &hi, &why)) return fail(f[2], "max_bytes: " + why);
  if (hi < lo) return fail(f[2], "max_bytes is below min_bytes");
  r->bytes = {lo, hi};
  r->algo = parse_algo(f[3].text);
  if (r->algo < 0) return fail(f[3], "unknown algorithm '" + f[3].text + "'");
  r->proto = parse_proto(f[4].text);
  if (r->proto < 0) return fail(f[4], "unknown protocol '" + f[4].text + "'");
  if (!parse_channels(f[5].text, &r->channels, &why)) return fail(f[5], why);
  Range* exact[4] = {&r->nodes, &r->ranks, &r->pipe_ops, &r->reg_buff};
  const char* names[4] = {"nNodes", "nRanks", "numPipeOps", "regBuff"};
  for (size_t i = 6; i < f.size(); ++i) {
    bool wild = false;
    uint64_t v = 0;
    if (!parse_csv_int(f[i].text, false, &wild, &v, &why))
      return fail(f[i], std::string(names[i - 6]) + ": " + why);
    if (wild) continue;
    if (i == 9 && v > 1) return fail(f[i], "regBuff must be 0, 1 or -1");
    *exact[i - 6] = {v, v};
  }
  return true;
}

bool parse_model_line(const std::vector<Token>& t, ModelParams* m, Error* e) {
  if (t.size() < 2) {
    e->col = t[0].col;
    e->msg = "model: expected 'on' or 'off'";
    return false;
  }
  if (strcasecmp(t[1].text.c_str(), "on") == 0) {
    m->enabled = true;
  } else if (strcasecmp(t[1].text.c_str(), "off") == 0) {
    m->enabled = false;
  } else {
    e->col = t[1].col;
    e->msg = "model: expected 'on' or 'off', got '" + t[1].text + "'";
    return false;
  }
  for (size_t i = 2; i < t.size(); ++i) {
    size_t eq = t[i].text.find('=');
    std::string k = eq == std::string::npos ? t[i].text : t[i].text.substr(0, eq);
    std::string v = eq == std::string::npos ? "" : t[i].text.substr(eq + 1);
    double* dst = k == "net_bw"           ? &m->net_bw
                  : k == "net_lat"        ? &m->net_lat
                  : k == "intra_bw"       ? &m->intra_bw
                  : k == "intra_lat"      ? &m->intra_lat
                  : k == "degraded_below" ? &m->degraded_below
                                          : nullptr;
    e->col = t[i].col;
    if (!dst || eq == std::string::npos) {
      e->msg = "model: unknown parameter '" + t[i].text +
               "' (net_bw, net_lat, intra_bw, intra_lat, degraded_below)";
      return false;
    }
    std::string why;
    if (!parse_positive_double(v, dst, &why)) {
      e->msg = "model: " + k + ": " + why;
      return false;
    }
    if ((dst == &m->net_bw || dst == &m->intra_bw) && *dst <= 0) {
      e->msg = "model: " + k + " must be positive";
      return false;
    }
  }
  return true;
}

bool parse_native_line(const std::vector<Token>& t, Rule* r, Error* e) {
  std::string why;
  auto fail = [&](const Token& tok, const std::string& m) {
    e->col = tok.col;
    e->msg = m;
    return false;
  };
  size_t arrow = 0;
  while (arrow < t.size() && t[arrow].text != "->") ++arrow;
  if (arrow == t.size())
    return fail(t.back(), "expected '-> ALGO/PROTO' (or a comma-separated NCCL CSV row)");
  if (arrow < 2) return fail(t[0], "expected '<collective> <bytes>' before '->'");
  if (strcasecmp(t[0].text.c_str(), "any") == 0) {
    r->coll = -1;
  } else {
    r->coll = parse_coll(t[0].text);
    if (r->coll < 0) return fail(t[0], "unknown collective '" + t[0].text + "'");
  }
  if (!parse_range(t[1].text, true, &r->bytes, &why)) return fail(t[1], "bytes: " + why);
  std::vector<std::string> seen;  // a repeated condition is a typo, never "the last one wins"
  for (size_t i = 2; i < arrow; ++i) {
    size_t eq = t[i].text.find('=');
    if (eq == std::string::npos) return fail(t[i], "expected key=value, got '" + t[i].text + "'");
    std::string k = t[i].text.substr(0, eq), v = t[i].text.substr(eq + 1);
    Range* dst = k == "nodes"     ? &r->nodes
                 : k == "ranks"   ? &r->ranks
                 : k == "pipeops" ? &r->pipe_ops
                 : k == "regbuff" ? &r->reg_buff
                 : k == "usable"  ? &r->usable
                                  : nullptr;
    if (!dst)
      return fail(t[i], "unknown condition '" + k + "' (nodes, ranks, pipeops, regbuff, usable)");
    if (std::find(seen.begin(), seen.end(), k) != seen.end())
      return fail(t[i], "condition '" + k + "' given twice");
    seen.push_back(k);
    if (!parse_range(v, false, dst, &why)) return fail(t[i], k + ": " + why);
    if (dst == &r->reg_buff && !dst->any() && dst->hi > 1)
      return fail(t[i], "regbuff must be 0, 1 or any");
  }
  if (arrow + 1 >= t.size()) return fail(t[arrow], "expected ALGO/PROTO or 'keep' after '->'");
  const Token& ap = t[arrow + 1];
  if (strcasecmp(ap.text.c_str(), "keep") == 0) {
    r->algo = r->proto = -1;
  } else {
    size_t slash = ap.text.find('/');
    if (slash == std::string::npos) return fail(ap, "expected ALGO/PROTO, got '" + ap.text + "'");
    r->algo = parse_algo(ap.text.substr(0, slash));
    if (r->algo < 0) return fail(ap, "unknown algorithm '" + ap.text.substr(0, slash) + "'");
    r->proto = parse_proto(ap.text.substr(slash + 1));
    if (r->proto < 0) return fail(ap, "unknown protocol '" + ap.text.substr(slash + 1) + "'");
  }
  for (size_t i = arrow + 2; i < t.size(); ++i) {
    if (t[i].text.rfind("channels=", 0) != 0)
      return fail(t[i], "unexpected '" + t[i].text + "' (only channels=N may follow)");
    if (i > arrow + 2) return fail(t[i], "channels= given twice");
    if (!parse_channels(t[i].text.substr(9), &r->channels, &why)) return fail(t[i], why);
  }
  if (r->algo < 0 && r->channels < 0) return fail(ap, "'keep' without channels= does nothing");
  return true;
}

}  // namespace

const char* coll_name(int c) { return c >= 0 && c < kNumColls ? kCollNames[c] : "any"; }
const char* algo_name(int a) { return a >= 0 && a < kMaxAlgos ? kAlgoNames[a] : "undef"; }
const char* proto_name(int p) { return p >= 0 && p < kMaxProtos ? kProtoNames[p] : "undef"; }
int parse_coll(const std::string& s) { return find_name(kCollNames, kNumColls, s); }
int parse_algo(const std::string& s) { return find_name(kAlgoNames, kMaxAlgos, s); }
int parse_proto(const std::string& s) { return find_name(kProtoNames, kMaxProtos, s); }

bool parse_rules(const std::string& text, const std::string& name, RuleSet* out, std::string* err,
                 std::vector<std::string>* skipped) {
  RuleSet rs;
  rs.source = name;
  auto where = [&](int line, int col, const std::string& msg) {
    return name + ":" + std::to_string(line) + ":" + std::to_string(col) + ": " + msg;
  };
  auto report = [&](int line, int col, const std::string& msg) {
    if (err) *err = where(line, col, msg);
    return false;
  };
  // A malformed row: the whole file fails, or (lenient) the row alone is dropped.
  bool failed = false;
  auto bad_row = [&](int line, int col, const std::string& msg) {
    if (skipped) {
      skipped->push_back(where(line, col, msg));
    } else {
      report(line, col, msg);
      failed = true;
    }
  };
  if (text.size() > kMaxFileBytes) return report(0, 0, "file larger than 1 MiB");
  size_t pos = 0;
  int lineno = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    pos = nl == std::string::npos ? text.size() : nl + 1;
    ++lineno;
    size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    if (line.size() > kMaxLineBytes) {
      bad_row(lineno, 1, "line longer than 4096 bytes");
      if (failed) return false;
      continue;
    }
    size_t bad_byte = line.size();
    for (size_t i = 0; i < line.size() && bad_byte == line.size(); ++i) {
      unsigned char c = static_cast<unsigned char>(line[i]);
      if ((c < 0x20 && c != '\t' && c != '\r') || c >= 0x7f) bad_byte = i;
    }
    if (bad_byte != line.size()) {
      char b[64];
      snprintf(b, sizeof(b), "unexpected byte 0x%02x (not a text file?)",
               static_cast<unsigned char>(line[bad_byte]));
      // Not a malformed row but not a text file: the whole file goes, lenient or not.
      return report(lineno, static_cast<int>(bad_byte) + 1, b);
    }
    Error e;
    if (line.find(',') != std::string::npos) {
      Rule r;
      r.line = lineno;
      if (parse_csv_line(line, &r, &e))
        rs.rules.push_back(r);
      else
        bad_row(lineno, e.col, e.msg);
      if (failed) return false;
      continue;
    }
    std::vector<Token> t = split_ws(line);
    if (t.empty()) continue;
    if (strcasecmp(t[0].text.c_str(), "model") == 0) {
      // A model line is applied only whole: parsed into a copy first.
      ModelParams m = rs.model;
      if (parse_model_line(t, &m, &e))
        rs.model = m;
      else
        bad_row(lineno, e.col, e.msg);
      if (failed) return false;
      continue;
    }
    Rule r;
    r.line = lineno;
    if (parse_native_line(t, &r, &e))
      rs.rules.push_back(r);
    else
      bad_row(lineno, e.col, e.msg);
    if (failed) return false;
  }
  *out = std::move(rs);
  return true;
}

bool load_rules_file(const std::string& path, RuleSet* out, std::string* err,
                     std::vector<std::string>* skipped) {
  // A regular file only: a directory would read as empty, a FIFO would block tuner init (and
  // so NCCL's communicator creation) forever (read_regular_file opens it non-blocking).
  std::string text, why;
  if (!read_regular_file(path, kMaxFileBytes, &text, &why)) {
    if (err) {
      if (why == "not a regular file")
        *err = path + ":0:0: not a regular file (R2CCL_TUNER_CONFIG must name a rules file)";
      else if (why.rfind("larger than", 0) == 0)
        *err = path + ":0:0: file larger than 1 MiB";
      else
        *err = path + ":0:0: " + why;  // never a partial rule set
    }
    return false;
  }
  return parse_rules(text, path, out, err, skipped);
}

namespace {
std::string range_text(const Range& r) {
  if (r.any()) return "any";
  if (r.lo == r.hi) return std::to_string(r.lo);
  if (r.hi == UINT64_MAX) return std::to_string(r.lo) + "+";
  return std::to_string(r.lo) + "-" + std::to_string(r.hi);
}
}  // namespace

std::string format_rules(const RuleSet& rs) {
  std::ostringstream o;
  if (rs.model.enabled) {
    o << "model on net_bw=" << rs.model.net_bw << " net_lat=" << rs.model.net_lat
      << " intra_bw=" << rs.model.intra_bw << " intra_lat=" << rs.model.intra_lat
      << " degraded_below=" << rs.model.degraded_below << "\n";
  }
  for (const Rule& r : rs.rules) {
    o << coll_name(r.coll) << " " << range_text(r.bytes);
    if (!r.nodes.any()) o << " nodes=" << range_text(r.nodes);
    if (!r.ranks.any()) o << " ranks=" << range_text(r.ranks);
    if (!r.pipe_ops.any()) o << " pipeops=" << range_text(r.pipe_ops);
    if (!r.reg_buff.any()) o << " regbuff=" << range_text(r.reg_buff);
    if (!r.usable.any()) o << " usable=" << range_text(r.usable);
    o << " -> ";
    if (r.algo < 0)
      o << "keep";
    else
      o << algo_name(r.algo) << "/" << proto_name(r.proto);
    if (r.channels > 0) o << " channels=" << r.channels;
    o << "\n";
  }
  return o.str();
}

}  // namespace r2ccl::tuner
