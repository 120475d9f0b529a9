// r2ccl_tune: measured sweeps -> a tuner rules file.
//
//   r2ccl_tune [-o FILE] [--nodes N] [--ranks N] [--coll NAME] RUN...
//   RUN: ALGO/PROTO=FILE   a sweep measured with NCCL_ALGO=ALGO NCCL_PROTO=PROTO
//        FILE              a file whose runs are labelled by "# r2ccl_tune: ALGO/PROTO" lines
//
// Input: the table nccl-tests and r2ccl_perf print (size count type redop root time algbw
// busbw #wrong [in-place columns]); '#' lines are comments. The collective comes from
// r2ccl_perf's header ("op: allreduce"), nccl-tests' ("all_reduce_perf"), a
// "# r2ccl_tune: ALGO/PROTO COLL" label, or --coll. The rank count from "ranks: N" or --ranks.
// For every collective and measured size, the label with the smallest out-of-place time wins
// (repeated rows are averaged); consecutive sizes with the same winner become one rule whose
// range runs from just above the previous measured size to its last size (the last rule is
// open-ended), so the rules tile every size.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "rules.h"

using namespace r2ccl::tuner;

namespace {

struct Label {
  int algo = -1, proto = -1;
};

struct Sample {
  double sum_us = 0;
  int n = 0;
};

// samples[coll][size][label index]
using Samples = std::map<int, std::map<uint64_t, std::map<int, Sample>>>;

struct State {
  std::vector<Label> labels;
  Samples samples;
  int ranks = -1;
};

[[noreturn]] void die(const std::string& m) {
  fprintf(stderr, "r2ccl_tune: %s\n(see r2ccl_tune --help)\n", m.c_str());
  exit(2);
}

bool parse_label(const std::string& s, Label* out) {
  size_t slash = s.find('/');
  if (slash == std::string::npos) return false;
  out->algo = parse_algo(s.substr(0, slash));
  out->proto = parse_proto(s.substr(slash + 1));
  return out->algo >= 0 && out->proto >= 0;
}

int label_index(State* st, const Label& l) {
  for (size_t i = 0; i < st->labels.size(); ++i)
    if (st->labels[i].algo == l.algo && st->labels[i].proto == l.proto) return static_cast<int>(i);
  st->labels.push_back(l);
  return static_cast<int>(st->labels.size()) - 1;
}

int coll_from_text(const std::string& line) {
  static const std::pair<const char*, int> names[] = {{"all_reduce_perf", 4},
                                                      {"all_gather_perf", 2},
                                                      {"reduce_scatter_perf", 3},
                                                      {"broadcast_perf", 0},
                                                      {"reduce_perf", 1}};
  for (auto& [n, c] : names)
    if (line.find(n) != std::string::npos) return c;
  size_t op = line.find("op: ");
  if (op != std::string::npos) {
    std::istringstream in(line.substr(op + 4));
    std::string w;
    in >> w;
    return parse_coll(w);
  }
  return -1;
}

void read_run(State* st, const std::string& path, int label, int coll) {
  std::ifstream f(path);
  if (!f) die("cannot open " + path);
  std::string line;
  int lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    if (!line.empty() && line[0] == '#') {
      size_t tag = line.find("r2ccl_tune:");
      if (tag != std::string::npos) {
        std::istringstream in(line.substr(tag + 11));
        std::string l, c;
        in >> l >> c;
        Label lb;
        if (!parse_label(l, &lb))
          die(path + ":" + std::to_string(lineno) + ": bad label '" + l + "'");
        label = label_index(st, lb);
        if (!c.empty()) {
          coll = parse_coll(c);
          if (coll < 0)
            die(path + ":" + std::to_string(lineno) + ": unknown collective '" + c + "'");
        }
        continue;
      }
      int c = coll_from_text(line);
      if (c >= 0) coll = c;
      size_t r = line.find("ranks: ");
      if (r != std::string::npos) st->ranks = atoi(line.c_str() + r + 7);
      continue;
    }
    std::istringstream in(line);
    std::vector<std::string> tok;
    std::string t;
    while (in >> t) tok.push_back(t);
    if (tok.empty()) continue;
    if (tok.size() < 9) continue;  // not a table row (nccl-tests prints other text too)
    char* end = nullptr;
    uint64_t size = strtoull(tok[0].c_str(), &end, 10);
    if (*end) continue;
    double us = strtod(tok[5].c_str(), &end);
    if (*end || !(us > 0)) continue;
    if (label < 0) die(path + ":" + std::to_string(lineno) + ": a table row before any label");
    if (coll < 0)
      die(path + ": unknown collective (use --coll or a '# r2ccl_tune: A/P COLL' label)");
    Sample& s = st->samples[coll][size][label];
    s.sum_us += us;
    ++s.n;
  }
}

const char* kHelp =
    "usage: r2ccl_tune [-o FILE] [--nodes N] [--ranks N] [--coll NAME] RUN...\n"
    "  RUN: ALGO/PROTO=FILE (a sweep run with NCCL_ALGO=ALGO NCCL_PROTO=PROTO), or FILE with\n"
    "       '# r2ccl_tune: ALGO/PROTO [COLL]' lines labelling the runs it holds.\n"
    "  Reads nccl-tests / r2ccl_perf tables and writes an R2CCL_TUNER_CONFIG rules file that\n"
    "  picks the fastest algorithm/protocol per size range.\n";

}  // namespace

int main(int argc, char** argv) {
  State st;
  std::string out_path, nodes, ranks_opt;
  int coll_opt = -1;
  std::vector<std::string> runs;
  CLI::App app{"measured sweeps -> a tuner rules file", "r2ccl_tune"};
  app.add_option("-o", out_path, "write the rules to FILE instead of stdout")
      ->type_name("FILE")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--nodes", nodes, "node count of the rules")
      ->type_name("N")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--ranks", ranks_opt, "rank count of the rules")
      ->type_name("N")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option_function<std::string>(
         "--coll",
         [&coll_opt](const std::string& v) {
           coll_opt = parse_coll(v);
           if (coll_opt < 0) throw CLI::ValidationError("--coll", "unknown collective '" + v + "'");
         },
         "collective of the runs")
      ->type_name("NAME")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("RUN", runs, "ALGO/PROTO=FILE, or FILE with '# r2ccl_tune:' labels");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    fputs(kHelp, stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    die(e.what());
  }
  if (runs.empty()) die("no runs given");
  for (const std::string& r : runs) {
    size_t eq = r.find('=');
    Label lb;
    if (eq != std::string::npos && parse_label(r.substr(0, eq), &lb))
      read_run(&st, r.substr(eq + 1), label_index(&st, lb), coll_opt);
    else
      read_run(&st, r, -1, coll_opt);
  }
  if (st.samples.empty()) die("no table rows found");

  RuleSet rs;
  Range node_range, rank_range;
  std::string why;
  if (!nodes.empty()) {
    uint64_t v = strtoull(nodes.c_str(), nullptr, 10);
    if (v == 0) die("--nodes must be a positive number");
    node_range = {v, v};
  }
  if (!ranks_opt.empty()) {
    uint64_t v = strtoull(ranks_opt.c_str(), nullptr, 10);
    if (v == 0) die("--ranks must be a positive number");
    rank_range = {v, v};
  } else if (st.ranks > 0) {
    rank_range = {static_cast<uint64_t>(st.ranks), static_cast<uint64_t>(st.ranks)};
  }
  std::ostringstream notes;
  for (auto& [coll, by_size] : st.samples) {
    int cur = -1;
    uint64_t lo = 0, prev = 0;
    bool first = true;
    auto emit = [&](uint64_t hi) {
      Rule r;
      r.coll = coll;
      r.bytes = {lo, hi};
      r.nodes = node_range;
      r.ranks = rank_range;
      r.algo = st.labels[cur].algo;
      r.proto = st.labels[cur].proto;
      rs.rules.push_back(r);
    };
    for (auto& [size, by_label] : by_size) {
      int best = -1;
      double best_us = 0;
      for (auto& [l, s] : by_label) {
        double us = s.sum_us / s.n;
        if (best < 0 || us < best_us) {
          best = l;
          best_us = us;
        }
      }
      if (by_label.size() < st.labels.size())
        notes << "# " << coll_name(coll) << " " << size << " B: measured by " << by_label.size()
              << " of " << st.labels.size() << " runs\n";
      if (!first && best != cur) {
        emit(prev);
        lo = prev + 1;
      }
      first = false;
      cur = best;
      prev = size;
    }
    emit(UINT64_MAX);
  }
  std::ostringstream o;
  o << "# Written by r2ccl_tune from";
  for (auto& r : runs) o << " " << r;
  o << "\n# Fastest measured algorithm/protocol per size range (first match wins).\n"
    << notes.str() << format_rules(rs);
  // Check that what we write reads back.
  RuleSet back;
  std::string err;
  if (!parse_rules(o.str(), "output", &back, &err))
    die("internal error: output does not parse: " + err);
  if (out_path.empty()) {
    fputs(o.str().c_str(), stdout);
  } else {
    std::ofstream f(out_path);
    f << o.str();
    if (!f) die("cannot write " + out_path);
  }
  return 0;
}
