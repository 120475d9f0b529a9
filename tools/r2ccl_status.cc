// r2ccl_status: prints this node's health board (docs/HEALTH-BOARD.md).
//
//   r2ccl_status [--board NAME] [--json] [--watch SEC] [--sample-ms MS] [--remove]
//
// Header: the segment, slot counts and the predictor's sampler (pid, age of its last publish).
// Per rail: owner pid, rail, transport, state, usable bandwidth, throughput (bytes_sent delta
// between two reads --sample-ms apart, default 200; in --watch mode between two refreshes),
// REPLAY (chunks_replayed / chunks_sent), and from the sampler block, matched by rail name:
// RETRANS (the predictor's ccl_retransmit_ratio over its window), RISK, its SOURCE (lstm or
// baseline) and DRAIN when the sampler drains the rail; then switchovers, failbacks, the last
// switchover's age and cause. After the table: a warning per rail whose retransmit ratio is
// above 5 %, torn slots, and the agreed record. Exit codes: 0 shown, 1 board absent, 2 board
// unusable (corrupt, truncated, other layout version, bad name), 3 usage.
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>

#include "r2ccl/clock.h"
#include "r2ccl/health_board.h"

namespace {

using namespace r2ccl::board;
using Key = std::tuple<int, int32_t, int32_t>;  // slot, pid, rail

// Above this retransmit ratio a rail's physical link is suspect (a warning after the table).
constexpr double kRetransWarn = 0.05;

struct Options {
  std::string board;
  bool json = false;
  double watch_s = 0;
  int sample_ms = 200;
  bool remove = false;
};

void usage(FILE* f) {
  fprintf(f,
          "usage: r2ccl_status [--board NAME] [--json] [--watch SEC] [--sample-ms MS] [--remove]\n"
          "  --board NAME    health board name (default: $R2CCL_HEALTH_BOARD, else 'default')\n"
          "  --json          one JSON object (per refresh with --watch)\n"
          "  --watch SEC     refresh every SEC seconds until interrupted\n"
          "  --sample-ms MS  throughput window: two reads MS apart (default 200; 0: none)\n"
          "  --remove        unlink the board's shared-memory segment and exit\n"
          "exit: 0 ok, 1 board absent, 2 board unusable, 3 usage\n");
}

// Parses the command line into *o (CLI11). -1: parsed; otherwise the exit status: 0 after
// --help, 3 for a usage error (CLI11's reason and the usage on stderr).
int parse_args(int argc, char** argv, Options* o) {
  const char* env = getenv("R2CCL_HEALTH_BOARD");
  o->board = env && *env ? env : "default";
  CLI::App app{"prints this node's health board", "r2ccl_status"};
  app.add_option("--board", o->board, "health board name")
      ->type_name("NAME")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_flag("--json", o->json, "one JSON object (per refresh with --watch)");
  app.add_option_function<std::string>(
         "--watch",
         [o](const std::string& v) {
           char* end = nullptr;
           o->watch_s = strtod(v.c_str(), &end);
           if (*end || !(o->watch_s > 0) || o->watch_s > 86400)
             throw CLI::ValidationError("--watch",
                                        "'" + v + "' is not a number of seconds in (0, 86400]");
         },
         "refresh every SEC seconds until interrupted")
      ->type_name("SEC")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option_function<std::string>(
         "--sample-ms",
         [o](const std::string& v) {
           char* end = nullptr;
           long ms = strtol(v.c_str(), &end, 10);
           if (*end || v.empty() || ms < 0 || ms > 60000)
             throw CLI::ValidationError("--sample-ms",
                                        "'" + v + "' is not an integer in [0, 60000]");
           o->sample_ms = static_cast<int>(ms);
         },
         "throughput window: two reads MS apart")
      ->type_name("MS")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_flag("--remove", o->remove, "unlink the board's shared-memory segment and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    usage(stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    fprintf(stderr, "r2ccl_status: %s\n", e.what());
    usage(stderr);
    return 3;
  }
  return -1;
}

// Throughput in Mbps from the previous read of the same (slot, pid, rail), or NaN.
double throughput_mbps(const std::map<Key, RailSlot>& prev, const RailSlot& s) {
  auto it = prev.find(Key{s.slot, s.pid, s.rail});
  if (it == prev.end()) return NAN;
  const RailSlot& p = it->second;
  if (s.publish_us <= p.publish_us || s.f.bytes_sent < p.f.bytes_sent) return NAN;
  double us = static_cast<double>(s.publish_us - p.publish_us);
  return static_cast<double>(s.f.bytes_sent - p.f.bytes_sent) * 8.0 / us;  // bits/us = Mbps
}

double ratio(uint64_t a, uint64_t b) { return b ? static_cast<double>(a) / b : 0.0; }

// The sampler's entry for a slot's rail, or nullptr (no live sampler, or no such rail).
const RiskEntry* risk_of(const BoardView& v, const RailSlot& s) {
  return v.has_sampler ? find_risk(v.sampler, s.f.name) : nullptr;
}

// Seconds since the sampler's last publish; NaN when it has not published. (Doubles: the
// times come from shared memory and may be anything.)
double sampler_age_s(const SamplerView& sv, int64_t now) {
  return sv.publish_us ? (static_cast<double>(now) - static_cast<double>(sv.publish_us)) / 1e6
                       : NAN;
}

// A live owner whose last publish is too old: the readers no longer serve its risks.
bool sampler_stale(const SamplerView& sv, int64_t now) {
  return sv.owner != 0 && sv.publish_us != 0 &&
         (sv.interval_us <= 0 ||
          sampler_age_s(sv, now) > kSamplerStaleIntervals * (sv.interval_us / 1e6));
}

// A float from the board as JSON: its shortest decimal form (0.83, not 0.8299999833106995).
nlohmann::json json_float(float x) {
  char b[32];
  snprintf(b, sizeof(b), "%.7g", static_cast<double>(x));
  return nlohmann::json(strtod(b, nullptr));
}

nlohmann::json to_json(const BoardView& v, const std::map<Key, RailSlot>& prev, int64_t now) {
  nlohmann::json j;
  j["segment"] = v.segment;
  j["slot_count"] = v.slot_count;
  j["stale_slots"] = v.stale_slots;
  j["torn_slots"] = v.torn_slots;
  j["rails"] = nlohmann::json::array();
  for (const auto& s : v.rails) {
    nlohmann::json r;
    r["slot"] = s.slot;
    r["pid"] = s.pid;
    r["rail"] = s.rail;
    r["name"] = s.f.name;
    r["transport"] = transport_name(s.f.transport);
    r["state"] = state_name(s.f.state);
    r["usable_mbps"] = s.f.usable_mbps;
    r["bytes_sent"] = s.f.bytes_sent;
    r["chunks_sent"] = s.f.chunks_sent;
    r["chunks_replayed"] = s.f.chunks_replayed;
    r["replay_ratio"] = ratio(s.f.chunks_replayed, s.f.chunks_sent);
    r["tcp_retrans"] = s.f.tcp_retrans;
    r["tcp_segs_out"] = s.f.tcp_segs_out;
    double t = throughput_mbps(prev, s);
    r["throughput_mbps"] = std::isnan(t) ? nlohmann::json() : nlohmann::json(t);
    r["switchovers"] = s.f.switchovers;
    r["failbacks"] = s.f.failbacks;
    r["paths_failed"] = s.f.paths_failed;
    r["last_switchover_ago_s"] = s.f.last_switchover_us
                                     ? nlohmann::json((now - s.f.last_switchover_us) / 1e6)
                                     : nlohmann::json();
    r["last_switchover_cause"] = s.f.cause;
    const RiskEntry* e = risk_of(v, s);
    r["risk"] = e && e->risk >= 0 ? json_float(e->risk) : nlohmann::json();
    r["risk_source"] = e && e->source != RiskSource::kNone
                           ? nlohmann::json(risk_source_name(e->source))
                           : nlohmann::json();
    r["drain"] = e && e->drain;
    // How long the sampler keeps the rail drained at least from now (its least drain time or
    // flap hold still to run); null without one.
    const double hold_left =
        e && e->drain && e->hold_s ? e->hold_s - (now - v.sampler.publish_us) / 1e6 : 0;
    r["drain_hold_s"] = hold_left > 0 ? nlohmann::json(hold_left) : nlohmann::json();
    r["ccl_retransmit_ratio"] =
        e && e->retransmit_ratio >= 0 ? json_float(e->retransmit_ratio) : nlohmann::json();
    r["top_counters"] = e && e->top[0] ? nlohmann::json(e->top) : nlohmann::json();
    r["publish_age_s"] = (now - s.publish_us) / 1e6;
    j["rails"].push_back(r);
  }
  // The sampler: null when none is live (or its block is unreadable: sampler_error says why).
  if (v.has_sampler && v.sampler.owner != 0) {
    nlohmann::json sj;
    sj["pid"] = v.sampler.owner;
    double age = sampler_age_s(v.sampler, now);
    sj["age_s"] = std::isnan(age) ? nlohmann::json() : nlohmann::json(age);
    sj["interval_s"] = v.sampler.interval_us / 1e6;
    sj["stale"] = sampler_stale(v.sampler, now);
    sj["rails"] = v.sampler.rails.size();
    j["sampler"] = sj;
  } else {
    j["sampler"] = nullptr;
  }
  j["sampler_error"] = v.has_sampler ? nlohmann::json() : nlohmann::json(v.sampler_error);
  if (v.has_agreed) {
    nlohmann::json a;
    a["epoch"] = v.agreed.epoch;
    a["n_nodes"] = v.agreed.n_nodes;
    a["members"] = member_count(v.agreed);
    nlohmann::json g = nlohmann::json::array();
    for (uint32_t i = 0; i < v.agreed.n_nodes; ++i) g.push_back(v.agreed.node_usable_gbps[i]);
    a["node_usable_gbps"] = g;
    j["agreed"] = a;
  } else {
    j["agreed"] = nullptr;
  }
  j["agreed_torn"] = v.agreed_torn != 0;
  return j;
}

// Slot strings come from other processes' shared memory: a control character (a corrupt
// slot, an interface name with an escape sequence) must not reach the terminal.
std::string printable(const char* text) {
  std::string out;
  for (const char* c = text; *c; ++c)
    out += (static_cast<unsigned char>(*c) < 0x20 || *c == 0x7f) ? '?' : *c;
  return out;
}

std::string fmt_rate(double mbps) {
  char b[32];
  if (std::isnan(mbps)) return "-";
  if (mbps >= 1000)
    snprintf(b, sizeof(b), "%.2f Gb/s", mbps / 1000);
  else
    snprintf(b, sizeof(b), "%.1f Mb/s", mbps);
  return b;
}

std::string fmt_sampler(const BoardView& v, int64_t now) {
  if (!v.has_sampler) return "sampler unreadable (" + v.sampler_error + ")";
  const SamplerView& sv = v.sampler;
  if (sv.owner == 0) return "no sampler";
  char b[128];
  if (sv.publish_us == 0) {
    snprintf(b, sizeof(b), "sampler pid %d, nothing published yet", sv.owner);
  } else {
    snprintf(b, sizeof(b), "sampler pid %d, published %.1f s ago%s", sv.owner,
             sampler_age_s(sv, now), sampler_stale(sv, now) ? " (stale: risks not shown)" : "");
  }
  return b;
}

void print_text(const BoardView& v, const std::map<Key, RailSlot>& prev, int64_t now) {
  printf("health board %s: %u slots, %zu live, %d stale, %zu torn; %s\n", v.segment.c_str(),
         v.slot_count, v.rails.size(), v.stale_slots, v.torn_slots.size(),
         printable(fmt_sampler(v, now).c_str()).c_str());
  if (!v.rails.empty())
    printf("%-8s %-4s %-20s %-5s %-8s %10s %12s %8s %8s %5s %-8s %-5s %5s %5s  %s\n", "PID", "RAIL",
           "NAME", "TRANS", "STATE", "USABLE", "THROUGHPUT", "REPLAY", "RETRANS", "RISK", "SOURCE",
           "DRAIN", "SWOV", "FBACK", "LAST SWITCHOVER");
  for (const auto& s : v.rails) {
    char last[96] = "-";
    if (s.f.last_switchover_us)
      snprintf(last, sizeof(last), "%.1f s ago (%s)", (now - s.f.last_switchover_us) / 1e6,
               s.f.cause[0] ? printable(s.f.cause).c_str() : "?");
    char usable[24];
    snprintf(usable, sizeof(usable), "%u Mb/s", s.f.usable_mbps);
    const RiskEntry* e = risk_of(v, s);
    char retrans[24] = "-", risk[24] = "-";
    if (e && e->retransmit_ratio >= 0)
      snprintf(retrans, sizeof(retrans), "%.3f%%", 100.0 * e->retransmit_ratio);
    if (e && e->risk >= 0) snprintf(risk, sizeof(risk), "%.2f", e->risk);
    const char* source = e && e->source != RiskSource::kNone ? risk_source_name(e->source) : "-";
    printf("%-8d %-4d %-20s %-5s %-8s %10s %12s %7.3f%% %8s %5s %-8s %-5s %5llu %5llu  %s\n", s.pid,
           s.rail, printable(s.f.name).c_str(), transport_name(s.f.transport),
           state_name(s.f.state), usable, fmt_rate(throughput_mbps(prev, s)).c_str(),
           100.0 * ratio(s.f.chunks_replayed, s.f.chunks_sent), retrans, risk, source,
           e && e->drain ? "DRAIN" : "", static_cast<unsigned long long>(s.f.switchovers),
           static_cast<unsigned long long>(s.f.failbacks), last);
  }
  // One warning per rail of the sampler (a rail is shared by every process on it).
  if (v.has_sampler) {
    std::string unmatched;
    for (const RiskEntry& e : v.sampler.rails) {
      if (e.retransmit_ratio > kRetransWarn)
        printf(
            "rail %s: retransmit ratio %.1f %% (> %.0f %%): check the physical link (cable, "
            "transceiver, port)\n",
            printable(e.rail).c_str(), 100.0 * e.retransmit_ratio, 100 * kRetransWarn);
      bool on_board = false;
      for (const auto& s : v.rails) on_board |= strcmp(s.f.name, e.rail) == 0;
      if (!on_board) unmatched += (unmatched.empty() ? "" : ", ") + printable(e.rail);
    }
    if (!unmatched.empty())
      printf("sampler rails without a slot on the board: %s\n", unmatched.c_str());
  }
  for (int t : v.torn_slots)
    printf("slot %d: being written for too long (its writer died mid-write?)\n", t);
  if (v.has_agreed)
    printf("agreed record: epoch %llu, %u nodes, %d members\n",
           static_cast<unsigned long long>(v.agreed.epoch), v.agreed.n_nodes,
           member_count(v.agreed));
  else
    printf("agreed record: %s\n", v.agreed_torn ? "torn (its writer died mid-write?)" : "none yet");
}

std::map<Key, RailSlot> index(const BoardView& v) {
  std::map<Key, RailSlot> m;
  for (const auto& s : v.rails) m[Key{s.slot, s.pid, s.rail}] = s;
  return m;
}

}  // namespace

static int run(int argc, char** argv) {
  Options o;
  if (int rc = parse_args(argc, argv, &o); rc >= 0) return rc;
  std::string seg, err;
  if (!segment_name(o.board, &seg, &err)) {
    fprintf(stderr, "r2ccl_status: %s\n", err.c_str());
    return 2;
  }
  if (o.remove) {
    if (!remove_board(o.board)) {
      fprintf(stderr, "r2ccl_status: could not remove %s: %s\n", seg.c_str(), strerror(errno));
      return 1;
    }
    printf("removed %s\n", seg.c_str());
    return 0;
  }
  std::map<Key, RailSlot> prev;
  bool have_prev = false;
  for (;;) {
    BoardView v;
    BoardError kind = BoardError::kNone;
    if (!have_prev && o.sample_ms > 0) {
      if (read_board(o.board, &v, &err, &kind)) {
        prev = index(v);
        usleep(static_cast<useconds_t>(o.sample_ms) * 1000);
      }
    }
    if (!read_board(o.board, &v, &err, &kind)) {
      int rc = kind == BoardError::kAbsent ? 1 : kind == BoardError::kSystem ? 1 : 2;
      fprintf(stderr, "r2ccl_status: %s\n", err.c_str());
      if (o.json) {
        nlohmann::json j;
        j["segment"] = seg;
        j["error"] = err;
        printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
      }
      if (o.watch_s <= 0) return rc;
      have_prev = false;
    } else {
      int64_t now = r2ccl::now_us();
      if (o.json)
        printf("%s\n", to_json(v, prev, now)
                           .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                           .c_str());
      else
        print_text(v, prev, now);
      prev = index(v);
      have_prev = true;
      if (o.watch_s <= 0) return 0;
      if (!o.json) printf("\n");
    }
    fflush(stdout);
    usleep(static_cast<useconds_t>(o.watch_s * 1e6));
  }
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // never an abort: a bad byte in a name, a full disk...
    fprintf(stderr, "%s: error: %s\n", argv[0], e.what());
    return 2;
  }
}
