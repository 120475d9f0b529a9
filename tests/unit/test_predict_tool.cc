// r2ccl_predict from the command line: features and labels for training, replay and live
// output, and clear errors (exit 1) for bad traces and bad weights, exit 3 for usage.
#include <unistd.h>
#include <zlib.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fake_counters.h"
#include "net_harness.h"
#include "r2ccl/params.h"
#include "r2ccl/predict/model.h"
#include "r2ccl/predict/predictor.h"

using namespace r2ccl::test;

namespace {

std::string tool() { return env_or("R2CCL_TEST_PREDICT", R2CCL_BINARY_DIR "/bin/r2ccl_predict"); }
const char* kModel = R2CCL_SOURCE_DIR "/predictor/model/r2ccl_lstm.bin";

// The tool's exit status (-1 when it died of a signal), stdout and stderr in *out.
int run(const std::string& args, std::string* out) { return run_command(tool() + " " + args, out); }

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  REQUIRE(f.good());
}

// The cells of a trace's rows of one rail (plain CSV: the tool's --record writes no quotes).
std::vector<std::vector<std::string>> rail_rows(const std::string& trace, const std::string& rail) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream lines(trace);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("," + rail + ",") == std::string::npos) continue;
    std::vector<std::string> f;
    std::istringstream cells(line);
    for (std::string c; std::getline(cells, c, ',');) f.push_back(c);
    rows.push_back(std::move(f));
  }
  return rows;
}

// The shape in a .npy header: "(11, 8)" or "(11,)".
std::string npy_shape(const std::string& path) {
  const std::string s = read_file(path);
  const size_t a = s.find("'shape': ("), b = s.find(')', a);
  if (a == std::string::npos || b == std::string::npos) return "?";
  return s.substr(a + 10 - 1, b - (a + 10) + 2);
}

}  // namespace

TEST_CASE("r2ccl_predict --features: rows, labels and events of a trace", "[predict]") {
  const std::string dir = temp_path("predict-tool-features");
  run_command("rm -rf " + dir + " && mkdir -p " + dir);
  // Rail a: a reading every 5 s from 0 to 60 s, link down at 50 s (one row), up again after.
  std::string trace = "t_s,rail,link,speed_mbps,symbol_err,scenario\n";
  for (int t = 0; t <= 60; t += 5)
    trace += std::to_string(t) + ",a," + (t == 50 ? "0" : "1") + ",100000," +
             std::to_string(t * 3) + ",optical\n";
  trace += "0,b,1,100000,0,idle\n5,b,1,100000,0,idle\n";
  trace += "0,c,0,100000,0,idle\n";  // starts down: not a failure event
  write(dir + "/t.csv", trace);
  std::string out;
  REQUIRE(run("--features " + dir + "/t.csv --out " + dir + "/f", &out) == 0);
  INFO(out);
  // Scored rows: a at 5..45 and 55, 60 (the first row primes, 50 is down) = 11; b at 5 = 1.
  CHECK(npy_shape(dir + "/f/x.npy") == "(12, 11)");
  CHECK(npy_shape(dir + "/f/label.npy") == "(12,)");
  CHECK(npy_shape(dir + "/f/event_t.npy") == "(1,)");
  // Positive: a failure within (t, t + 30]: t = 20, 25, ..., 45.
  CHECK_THAT(out, Catch::Contains("12 rows (6 positive), 3 rails, 1 failure events"));
  const std::string meta = read_file(dir + "/f/meta.json");
  CHECK_THAT(meta, Catch::Contains("\"rails\": [\"a\", \"b\", \"c\"]"));
  CHECK_THAT(meta, Catch::Contains("\"scenarios\": [\"optical\", \"idle\"]"));
  // The label is 1 byte per row after the 128-byte header.
  const std::string lab = read_file(dir + "/f/label.npy");
  REQUIRE(lab.size() == 128 + 12);
  std::string labels;
  for (size_t i = 128; i < lab.size(); ++i) labels += static_cast<char>('0' + lab[i]);
  CHECK(labels == "000111111000");  // a: 5..45, then 55, 60; b: 5
  run_command("rm -rf " + dir);
}

TEST_CASE("r2ccl_predict: bad traces, bad weights and bad usage are named", "[predict]") {
  const std::string dir = temp_path("predict-tool-bad");
  run_command("rm -rf " + dir + " && mkdir -p " + dir);
  std::string out;
  write(dir + "/bad.csv", "t_s,rail,symbol_err\n0,a,1\n5,a,x7\n");
  CHECK(run("--replay " + dir + "/bad.csv --model " + kModel, &out) == 1);
  CHECK_THAT(out, Catch::Contains("bad.csv line 3 column symbol_err"));
  // The error alone: no table header printed ahead of a trace that fails before any row shows.
  CHECK(out.find("link risk") == std::string::npos);
  CHECK(run("--features " + dir + "/bad.csv --out " + dir + "/f", &out) == 1);
  CHECK(run("--replay " + dir + "/missing.csv --model " + kModel, &out) == 1);
  CHECK_THAT(out,
             Catch::Contains("cannot open trace") && Catch::Contains("No such file or directory"));
  CHECK(run("--evaluate " + dir + " --model " + kModel, &out) == 1);  // a directory
  CHECK_THAT(out, Catch::Contains("not a regular file"));

  write(dir + "/junk.bin", std::string(4096, 'z'));
  CHECK(run("--info --model " + dir + "/junk.bin", &out) == 1);
  CHECK_THAT(out, Catch::Contains("junk.bin"));
  CHECK_THAT(out, Catch::Contains("bad magic"));
  std::string good = read_file(kModel);
  REQUIRE(good.size() > 1000);
  std::string flipped = good;
  flipped[200] = static_cast<char>(flipped[200] ^ 0x40);
  write(dir + "/flipped.bin", flipped);
  CHECK(run("--info --model " + dir + "/flipped.bin", &out) == 1);
  CHECK_THAT(out, Catch::Contains("checksum mismatch"));
  write(dir + "/short.bin", good.substr(0, good.size() / 2));
  CHECK(run("--info --model " + dir + "/short.bin", &out) == 1);
  // --info prints the rise rule, and says when the file's own window is too short for it:
  // lag 20 needs 41 samples of the 24 (the lag is the f32 after the thresholds and k, at byte
  // 8 + 20 + 4 + 2 x 4 x 11 + 16 + 4 = 140; the CRC-32 of the bytes before it ends the file).
  CHECK(run("--info --model " + std::string(kModel), &out) == 0);
  CHECK_THAT(out, Catch::Contains("baseline rise rule: err_excess up >= ") &&
                      !Catch::Contains("never fires"));
  CHECK_THAT(out, Catch::Contains("weights file version " +
                                  std::to_string(r2ccl::predict::kModelVersion) + ", features 11"));
  CHECK_THAT(out, Catch::Contains("baseline fall rule (built in): err_excess and err_slope count "
                                  "0 where err_excess fell by >= 0.8 over the last 4 steps"));
  std::string lag20 = good;
  float shipped_lag = 0;
  std::memcpy(&shipped_lag, &good[140], 4);
  REQUIRE(shipped_lag == static_cast<float>(r2ccl::predict::default_baseline().rise_lag));
  const float twenty = 20;
  std::memcpy(&lag20[140], &twenty, 4);
  const uint32_t crc = static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(lag20.data()), static_cast<uInt>(lag20.size() - 4)));
  for (int i = 0; i < 4; ++i) lag20[lag20.size() - 4 + i] = static_cast<char>(crc >> (8 * i));
  write(dir + "/lag20.bin", lag20);
  CHECK(run("--info --model " + dir + "/lag20.bin", &out) == 0);
  CHECK_THAT(out, Catch::Contains("last two 20-step intervals") &&
                      Catch::Contains("note: the baseline's rise rule compares 41 samples; the "
                                      "file's window of 24 samples keeps 24, so it never fires"));
  // Without --model, an unusable R2CCL_PREDICT_MODEL means the baseline, said so.
  write(dir + "/ok.csv", "t_s,rail,symbol_err\n0,a,1\n5,a,2\n");
  CHECK(run_command(
            "R2CCL_PREDICT_MODEL=" + dir + "/junk.bin " + tool() + " --replay " + dir + "/ok.csv",
            &out) == 0);
  CHECK_THAT(out, Catch::Contains("the threshold baseline decides"));
  CHECK_THAT(out, Catch::Contains("summary (baseline decides; drain at risk"));
  // With the weights, the default decider (the baseline, with the file's thresholds) says
  // what decides, and so do the others.
  CHECK(run("--replay " + dir + "/ok.csv --model " + kModel, &out) == 0);
  CHECK_THAT(out, Catch::Contains("summary (baseline decides;"));
  CHECK(out.find("link risk") < out.find("summary ("));  // the table's header, ahead
  CHECK(run("--replay " + dir + "/ok.csv --model " + kModel + " --decider both", &out) == 0);
  CHECK_THAT(out, Catch::Contains("summary (both (the baseline raised by the LSTM up to 1.4 x"));
  CHECK(run("--replay " + dir + "/ok.csv --model " + kModel + " --decider lstm", &out) == 0);
  CHECK_THAT(out, Catch::Contains("summary (LSTM decides;"));
  CHECK(run("--replay " + dir + "/ok.csv --model " + kModel + " --decider both --lstm-cap 2",
            &out) == 0);
  CHECK_THAT(out, Catch::Contains("up to 2 x its risk) decides;"));
  // Real-valued options refuse what is not a finite number in range; "nan" passed CLI11's
  // range check and turned both into the LSTM alone.
  for (const char* bad : {"0.5", "nan", "NaN", "inf", "abc", "101", "1.4x", ""}) {
    INFO("--lstm-cap '" << bad << "'");
    CHECK(run("--replay " + dir + "/ok.csv --model " + kModel + " --lstm-cap '" + bad + "'",
              &out) == 3);
    CHECK_THAT(out, Catch::Contains("expected a number in [1, 100]"));
    // A number out of range is said to be one.
    CHECK_THAT(out, Catch::Contains(std::string(bad) == "0.5" || std::string(bad) == "101"
                                        ? "is out of range"
                                        : "is not a number"));
  }
  for (const char* opt : {"--threshold", "--return-threshold", "--down-hold", "--min-drain",
                          "--min-lead", "--lead-window", "--horizon", "--interval"}) {
    INFO(opt);
    CHECK(run("--replay " + dir + "/ok.csv --model " + kModel + " " + opt + " nan", &out) == 3);
    CHECK_THAT(out, Catch::Contains("is not a number: expected a number in ["));
  }
  CHECK(run("--replay " + dir + "/ok.csv --model " + kModel + " --min-drain 5000", &out) == 3);
  CHECK_THAT(out, Catch::Contains("--min-drain: '5000' is out of range: expected a number in "
                                  "[0, 3600]"));
  CHECK(run("--replay " + dir + "/ok.csv --model " + kModel + " --lstm-cap 1.0", &out) == 0);

  // Things a first user tried: named, not misread.
  write(dir + "/bom.csv", "\xEF\xBB\xBFt_s,rail,symbol_err\n0,a,1\n5,a,2\n");
  CHECK(run("--replay " + dir + "/bom.csv --model " + kModel, &out) == 0);
  write(dir + "/dup.csv", "t_s,rail,symbol_err,symbol_err\n0,a,1,1\n");
  CHECK(run("--replay " + dir + "/dup.csv --model " + kModel, &out) == 1);
  CHECK_THAT(out, Catch::Contains("column 'symbol_err' appears twice"));
  write(dir + "/hex.csv", "t_s,rail\n0x10,a\n");
  CHECK(run("--replay " + dir + "/hex.csv --model " + kModel, &out) == 1);
  CHECK_THAT(out, Catch::Contains("'0x10' is not a number of seconds"));
  write(dir + "/junk.csv", "t_s,rail\n\x01\x02\xff,a\n");
  CHECK(run("--replay " + dir + "/junk.csv --model " + kModel, &out) == 1);
  CHECK(out.find('\x01') == std::string::npos);  // shown as '?', not echoed raw
  CHECK(run("--replay " + dir + "/ok.csv --rail nosuch --model " + kModel, &out) == 1);
  CHECK_THAT(out, Catch::Contains("no rail named 'nosuch'"));
  CHECK(out.find("link risk") == std::string::npos);
  // Nothing to score (a header alone; one row per rail): said, by --replay as by --evaluate,
  // not an empty table and summary with exit 0.
  write(dir + "/header.csv", "t_s,rail,symbol_err\n");
  write(dir + "/onerow.csv", "t_s,rail,symbol_err\n0,a,1\n0,b,1\n");
  for (const char* mode : {"--replay", "--evaluate"})
    for (const char* f : {"/header.csv", "/onerow.csv"}) {
      INFO(mode << " " << f);
      CHECK(run(std::string(mode) + " " + dir + f + " --model " + kModel, &out) == 1);
      CHECK_THAT(out, Catch::Contains("no step with the link up to score"));
      CHECK(out.find("summary (") == std::string::npos);
    }
  // A link down after the first row and never up again: nothing to score, but --replay has the
  // failure to show (and a summary that counts it); --evaluate has no step to judge it by.
  write(dir + "/downonly.csv", "t_s,rail,link,symbol_err\n0,a,1,0\n5,a,0,0\n10,a,0,0\n");
  CHECK(run("--replay " + dir + "/downonly.csv --model " + kModel, &out) == 0);
  CHECK_THAT(out, Catch::Contains("LINK DOWN (not drained)") &&
                      Catch::Contains("a                failures 1, drained before 0"));
  CHECK(run("--evaluate " + dir + "/downonly.csv --model " + kModel, &out) == 1);
  CHECK_THAT(out, Catch::Contains("no step with the link up to score"));
  // Another interval than the model's 5 s is noted once (stderr), by both modes; 5 s is not.
  {
    std::string slow = "t_s,rail,symbol_err\n", fast = slow;
    for (int i = 0; i < 20; ++i) {
      slow += std::to_string(30 * i) + ",a," + std::to_string(i) + "\n";
      fast += std::to_string(5 * i) + ",a," + std::to_string(i) + "\n";
    }
    write(dir + "/slow.csv", slow);
    write(dir + "/fast.csv", fast);
    const std::string note =
        "slow.csv's samples are about 30 s apart; the model was trained at 5 s";
    for (const char* mode : {"--replay", "--evaluate"}) {
      INFO(mode);
      run(std::string(mode) + " " + dir + "/slow.csv --model " + kModel, &out);
      CHECK_THAT(out, Catch::Contains(note) && Catch::Contains("span 6 x the time"));
      CHECK(out.find(note) == out.rfind(note));  // once
      run(std::string(mode) + " " + dir + "/fast.csv --model " + kModel, &out);
      CHECK(out.find("samples are about") == std::string::npos);
    }
  }
  write(dir + "/magic12.bin", std::string("R2PRDLST\x01\0\0\0", 12));
  CHECK(run("--info --model " + dir + "/magic12.bin", &out) == 1);
  CHECK_THAT(out, Catch::Contains("truncated"));
  CHECK(run_command("R2CCL_PREDICT_MODEL=/nonexistent/w.bin " + tool() + " --info", &out) == 1);
  CHECK(out.find("baseline decides") == std::string::npos);

  CHECK(run("", &out) == 3);
  CHECK_THAT(out, Catch::Contains("Usage: r2ccl_predict"));  // no arguments: the whole help
  // A usage error: the error and where the options are, not 50 lines of help burying it.
  CHECK(run("--replay " + dir + "/ok.csv --bogus", &out) == 3);
  CHECK_THAT(out, Catch::Contains("--bogus"));
  CHECK_THAT(out, Catch::Contains("r2ccl_predict --help lists the options"));
  CHECK(std::count(out.begin(), out.end(), '\n') <= 3);
  // A misspelt mode is named, not reported as a missing one.
  CHECK(run("--evalute " + dir + "/ok.csv", &out) == 3);
  CHECK_THAT(out, Catch::Contains("unknown option --evalute"));
  CHECK(run("--evaluate " + dir + "/ok.csv --max-drains=3", &out) == 3);
  CHECK_THAT(out, Catch::Contains("unknown option --max-drains"));
  CHECK(run("--replay a.csv --live", &out) == 3);
  CHECK(run("--features " + dir + "/ok.csv", &out) == 3);
  CHECK_THAT(out, Catch::Contains("--out"));
  CHECK(run("--replay " + dir + "/ok.csv --threshold 0.3 --return-threshold 0.5", &out) == 3);
  run_command("rm -rf " + dir);
}

TEST_CASE("r2ccl_predict --live and --info", "[predict]") {
  const std::string root = temp_path("predict-tool-live");
  run_command("rm -rf " + root);
  FakeNic nic(root, "eth7", 25000);
  std::string out;
  CHECK(run("--live --count 2 --interval 0.05 --sysfs-root " + root + " --model " + kModel, &out) ==
        0);
  INFO(out);
  CHECK(count_lines_containing(out, "eth7") == 2);
  CHECK_THAT(out, Catch::Contains("lstm"));
  // --record: the samples as a trace that the tool itself reads back.
  const std::string rec = root + "/rec.csv";
  CHECK(run("--live --count 3 --interval 0.05 --sysfs-root " + root + " --record " + rec +
                " --model " + kModel,
            &out) == 0);
  const std::string trace = read_file(rec);
  // The priming round + 3, each with the link state and speed read.
  CHECK(count_lines_containing(trace, ",eth7,1,25000,") == 4);
  // An Ethernet rail has no IB symbol counter: its column is empty after the priming round
  // (unknown on replay), not 0. Columns: t_s, rail, link, speed, retrans, tx_packets,
  // rx_packets, tx_bytes, rx_bytes, symbol_err, ...
  int empty_symbol = 0;
  for (const auto& f : rail_rows(trace, "eth7")) {
    REQUIRE(f.size() > 9);
    empty_symbol += f[9].empty();
    CHECK_FALSE(f[8].empty());  // rx_bytes is read
  }
  CHECK(empty_symbol == 3);
  CHECK(run("--features " + rec + " --out " + root + "/f", &out) == 0);
  CHECK_THAT(out, Catch::Contains("3 rows (0 positive), 1 rails"));
  {
    // A counter reset while recording: its sum restarts at the count since the reset, so that
    // a replay reads a reset there too, not an ordinary count over the step.
    const std::string rec2 = root + "/rec2.csv";
    auto rec_lines = [&] { return count_lines_containing(read_file(rec2), ",eth7,"); };
    int rc = -2;
    std::string live_out;
    std::thread live([&] {
      rc = run("--live --count 300 --interval 0.01 --sysfs-root " + root + " --record " + rec2 +
                   " --model " + kModel,
               &live_out);
    });
    for (int i = 0; i < 4000 && rec_lines() < 3; ++i) usleep(5000);
    nic.advance(10, NicRates{});  // rx_bytes + 15.6 GB
    const int before = rec_lines();
    for (int i = 0; i < 4000 && rec_lines() < before + 2; ++i) usleep(5000);
    write(nic.dir() + "/statistics/rx_bytes.tmp", "1000\n");
    REQUIRE(::rename((nic.dir() + "/statistics/rx_bytes.tmp").c_str(),
                     (nic.dir() + "/statistics/rx_bytes").c_str()) == 0);
    live.join();
    REQUIRE(rc == 0);
    std::vector<double> rx;  // column 8
    for (const auto& f : rail_rows(read_file(rec2), "eth7")) {
      REQUIRE(f.size() > 8);
      rx.push_back(std::stod(f[8]));
    }
    REQUIRE(rx.size() > 5);
    CHECK(*std::max_element(rx.begin(), rx.end()) > 1e10);
    CHECK(rx.back() == 1000);  // restarted at the count since the reset
  }
  CHECK(run("--live --count 1 --interval 0.05 --sysfs-root " + root + "/nothing", &out) == 1);
  CHECK_THAT(out, Catch::Contains("no rails under"));
  CHECK(run("--info --model " + std::string(kModel), &out) == 0);
  CHECK_THAT(out, Catch::Contains("features 11, hidden"));
  CHECK_THAT(out, Catch::Contains("limit 1048576"));
  run_command("rm -rf " + root);
}

TEST_CASE("r2ccl_predict --evaluate: failures warned, false drains per rail-week, by floor",
          "[predict]") {
  const std::string dir = temp_path("predict-tool-evaluate");
  run_command("rm -rf " + dir + " && mkdir -p " + dir);
  // One hour at 5 s. The shipped baseline drains at a mean of >= ~210 phy errors/s over 3
  // samples; the guard needs 3 such samples and allows 2 drains per rail-hour.
  std::string trace = "t_s,rail,link,speed_mbps,symbol_err,scenario\n";
  auto rows = [&](const std::string& rail, const std::string& sc, auto rate_at, double down_at) {
    double total = 0;
    for (int t = 0; t <= 3600; t += 5) {
      total += rate_at(t) * 5;
      const bool up = down_at < 0 || t < down_at;
      trace += std::to_string(t) + "," + rail + "," + (up ? "1" : "0") + ",100000," +
               std::to_string(static_cast<long long>(total)) + "," + sc + "\n";
      if (!up) break;
    }
  };
  // Quiet, then 10^4 errors/s from 600 s, link down at 900 s: warned 240-290 s ahead (the
  // baseline's mean over kBaselineSteps rows crosses its threshold, then 3 enter samples).
  rows(
      "f1", "creep", [](int t) { return t >= 600 ? 1e4 : 0.0; }, 900);
  // No precursor: reported apart.
  rows(
      "s1", "sudden-power", [](int) { return 0.0; }, 600);
  // Healthy, quiet.
  rows(
      "h1", "healthy", [](int) { return 0.0; }, -1);
  // Healthy with three 50 s error bursts 10 minutes apart: 2 drains, the third refused.
  rows(
      "h2", "healthy-burst",
      [](int t) { return (t % 600 >= 300 && t % 600 < 350 && t < 1800) ? 1e4 : 0.0; }, -1);
  write(dir + "/t.csv", trace);
  std::string out;
  // --min-drain 0: each burst's drain returns before the next burst (the least drain time
  // would hold the first through the second: that rule is tested on its own).
  REQUIRE(run("--evaluate " + dir + "/t.csv --model " + kModel + " --min-drain 0", &out) == 0);
  INFO(out);
  CHECK_THAT(out, Catch::Contains("event level: 4 rails (2 healthy, 2.0 rail-hours)"));
  CHECK_THAT(out, Catch::Contains("at most 2 drains per rail within an hour"));
  // model precursor warned frac late median-lead sudden false-drains per-rail-week early
  const size_t at = out.find("\nbaseline ");
  REQUIRE(at != std::string::npos);
  std::istringstream is(out.substr(at + 1, out.find('\n', at + 1) - at - 1));
  std::string name, frac, lead, unit, sudden;
  int precursor = -1, warned = -1, late = -1, false_drains = -1, early = -1;
  double per_week = -1;
  is >> name >> precursor >> warned >> frac >> late >> lead >> unit >> sudden >> false_drains >>
      per_week >> early;
  CHECK(precursor == 1);
  CHECK(warned == 1);
  CHECK(frac == "1.000");
  CHECK(late == 0);
  CHECK(std::stoi(lead) >= 240);
  CHECK(std::stoi(lead) <= 290);
  CHECK(sudden == "0/1");
  CHECK(false_drains == 2);          // the hourly limit stopped the third burst's
  CHECK(per_week == Approx(168.0));  // 2 drains in 2 healthy rail-hours
  CHECK(early == 0);
  CHECK_THAT(out, Catch::Contains("\n0               2        2.0"));  // both healthy: floor 0
  // Each floor's rate comes with its count: the baseline's 2 drains there, 168 per rail-week.
  CHECK_THAT(out, Catch::Contains("the number of drains in parentheses"));
  {
    const size_t f0 = out.find("\n0               2        2.0");
    REQUIRE(f0 != std::string::npos);
    std::istringstream row(out.substr(f0 + 1, out.find('\n', f0 + 1) - f0 - 1));
    std::string floor, rails, hours, lstm_rate, lstm_n, base_rate, base_n;
    row >> floor >> rails >> hours >> lstm_rate >> lstm_n >> base_rate >> base_n;
    CHECK(base_rate == "168.00");
    CHECK(base_n == "(2)");
  }
  // --events-out: the same counts, one line per event, each with its rail, time and reason.
  REQUIRE(run("--evaluate " + dir + "/t.csv --model " + kModel + " --min-drain 0 --events-out " +
                  dir + "/events.csv",
              &out) == 0);
  const std::string ev = read_file(dir + "/events.csv");
  INFO(ev);
  CHECK(ev.rfind("decider,event,outcome,rail,scenario,t_s,lead_s,floor,reason\n", 0) == 0);
  CHECK(count_lines_containing(ev, "baseline,failure,warned,f1,creep,900.000,") == 1);
  CHECK(count_lines_containing(ev, "baseline,sudden_failure,missed,s1,sudden-power,600.000,,0,") ==
        1);
  CHECK(count_lines_containing(ev, "baseline,false_drain,,h2,healthy-burst,") == 2);
  CHECK(count_lines_containing(ev, ",h1,") == 0);  // quiet: nothing to list
  CHECK(count_lines_containing(ev, ",early_drain,") == 0);
  // The warned failure's lead is the one the table gives; its reason names the error
  // counters, quoted (it holds commas).
  const size_t w = ev.find("baseline,failure,warned,f1,creep,900.000,");
  REQUIRE(w != std::string::npos);
  const std::string wl = ev.substr(w, ev.find('\n', w) - w);
  CHECK(std::stod(wl.substr(std::strlen("baseline,failure,warned,f1,creep,900.000,"))) ==
        Approx(std::stod(lead)).margin(0.5));
  CHECK_THAT(wl, Catch::Contains(",0,\"phy errors (symbol_err, "));
  // Only with --evaluate; a path that cannot be written fails before the trace is read.
  CHECK(run("--replay " + dir + "/t.csv --model " + kModel + " --events-out " + dir + "/e2.csv",
            &out) == 3);
  CHECK_THAT(out, Catch::Contains("--events-out: only with --evaluate"));
  CHECK(run("--evaluate " + dir + "/t.csv --model " + kModel + " --events-out " + dir +
                "/no/such/dir/e.csv",
            &out) == 1);
  CHECK_THAT(out, Catch::Contains("--events-out " + dir + "/no/such/dir/e.csv: cannot write it"));
  // A write that fails part way (a full disk) is an error too, not a shorter list.
  if (access("/dev/full", W_OK) == 0) {
    CHECK(run("--evaluate " + dir + "/t.csv --model " + kModel + " --events-out /dev/full", &out) ==
          1);
    CHECK_THAT(out, Catch::Contains("--events-out /dev/full: could not write it all: No space"));
  }
  // Never over the trace or the weights (it would empty them); never an empty name.
  const std::string trace_before = read_file(dir + "/t.csv");
  CHECK(run("--evaluate " + dir + "/t.csv --model " + kModel + " --events-out " + dir + "/t.csv",
            &out) == 1);
  CHECK_THAT(out, Catch::Contains("is the trace being evaluated (--evaluate); name another file"));
  CHECK(read_file(dir + "/t.csv") == trace_before);
  run_command(std::string("cp ") + kModel + " " + dir + "/m.bin");
  const std::string model_before = read_file(dir + "/m.bin");
  CHECK(run("--evaluate " + dir + "/t.csv --model " + dir + "/m.bin --events-out " + dir + "/m.bin",
            &out) == 1);
  CHECK_THAT(out, Catch::Contains("is the weights file read; name another file"));
  CHECK(read_file(dir + "/m.bin") == model_before);
  // ... however the weights were found: here through R2CCL_PREDICT_MODEL.
  CHECK(run_command("R2CCL_PREDICT_MODEL=" + dir + "/m.bin " + tool() + " --evaluate " + dir +
                        "/t.csv --events-out " + dir + "/m.bin",
                    &out) == 1);
  CHECK_THAT(out, Catch::Contains("is the weights file read; name another file"));
  CHECK(read_file(dir + "/m.bin") == model_before);
  CHECK(run("--evaluate " + dir + "/t.csv --model " + kModel + " --events-out ''", &out) == 3);
  CHECK_THAT(out, Catch::Contains("--events-out: needs a file name"));
  // A trace that turns out bad leaves no header-only list behind, and an earlier list at that
  // name as it was.
  write(dir + "/bad.csv", "t_s,rail,link,speed_mbps,symbol_err\n0,a,1,100000,0\n5,a,x,1,0\n");
  CHECK(run("--evaluate " + dir + "/bad.csv --model " + kModel + " --events-out " + dir +
                "/bad-events.csv",
            &out) == 1);
  CHECK(access((dir + "/bad-events.csv").c_str(), F_OK) != 0);
  CHECK(run("--evaluate " + dir + "/bad.csv --model " + kModel + " --events-out " + dir +
                "/events.csv",
            &out) == 1);
  CHECK(read_file(dir + "/events.csv") == ev);
  // A symlink at the name is replaced by the list, never written through: the file it pointed
  // at keeps its contents.
  write(dir + "/keep.txt", "keep me\n");
  run_command("ln -s " + dir + "/keep.txt " + dir + "/link.csv");
  CHECK(run("--evaluate " + dir + "/t.csv --model " + kModel + " --min-drain 0 --events-out " +
                dir + "/link.csv",
            &out) == 0);
  CHECK(read_file(dir + "/keep.txt") == "keep me\n");
  CHECK(read_file(dir + "/link.csv") == ev);
  // No temporary file is left beside them, after a success or an error.
  std::string ls;
  run_command("ls -a " + dir, &ls);
  CHECK_THAT(ls, !Catch::Contains(".tmp-"));
  // With 5 drains allowed, the third burst drains too.
  REQUIRE(run("--evaluate " + dir + "/t.csv --model " + std::string(kModel) +
                  " --max-drains-per-hour 5 --min-drain 0",
              &out) == 0);
  CHECK_THAT(out, Catch::Contains("at most 5 drains per rail within an hour"));
  const size_t at2 = out.find("\nbaseline ");
  REQUIRE(at2 != std::string::npos);
  std::istringstream is2(out.substr(at2 + 1, out.find('\n', at2 + 1) - at2 - 1));
  is2 >> name >> precursor >> warned >> frac >> late >> lead >> unit >> sudden >> false_drains;
  CHECK(false_drains == 3);
  // A window shorter than the baseline's mean is said, once; the default window is not.
  CHECK_THAT(out, !Catch::Contains("tuned on the mean of"));
  REQUIRE(run("--evaluate " + dir + "/t.csv --model " + std::string(kModel) + " --window-steps 6",
              &out) == 0);
  CHECK(count_lines_containing(out, "tuned on the mean of " +
                                        std::to_string(r2ccl::predict::default_baseline().steps) +
                                        " samples; --window-steps 6 keeps 6") == 1);
  run_command("rm -rf " + dir);
}

TEST_CASE("r2ccl_predict --evaluate: the share of link-up time spent drained", "[predict]") {
  // Two quiet rails of one node for an hour; n-a goes down once (one row at 1000 s). The flap
  // hold keeps it drained from 1005 s for 600 s, then the return rule (6 low samples, counted
  // during the hold) lets it back at the first sample past the hold: about 600 s of the 7,195 s
  // the two links were up, 8.3-8.5%. Nothing else drains.
  const std::string dir = temp_path("predict-tool-drained");
  run_command("rm -rf " + dir + " && mkdir -p " + dir);
  std::string trace = "t_s,rail,link,speed_mbps,symbol_err,scenario\n";
  for (int t = 0; t <= 3600; t += 5)
    for (const char* rail : {"n-a", "n-b"}) {
      const bool down = std::string(rail) == "n-a" && t == 1000;
      trace += std::to_string(t) + "," + rail + "," + (down ? "0" : "1") + ",100000,0," +
               (std::string(rail) == "n-a" ? "flap" : "healthy") + "\n";
    }
  write(dir + "/t.csv", trace);
  std::string out;
  REQUIRE(run("--evaluate " + dir + "/t.csv --model " + kModel, &out) == 0);
  INFO(out);
  REQUIRE_THAT(out, Catch::Contains("drained-%"));
  const size_t at = out.find("\nbaseline ");
  REQUIRE(at != std::string::npos);
  const std::string line = out.substr(at + 1, out.find('\n', at + 1) - at - 1);
  const double pct = std::stod(line.substr(line.find_last_of(' ') + 1));
  CHECK(pct >= 8.3);
  CHECK(pct <= 8.5);
  // With the hold off, nothing drains: 0.00.
  REQUIRE(run("--evaluate " + dir + "/t.csv --model " + std::string(kModel) + " --down-hold 0",
              &out) == 0);
  const size_t at2 = out.find("\nbaseline ");
  REQUIRE(at2 != std::string::npos);
  const std::string line2 = out.substr(at2 + 1, out.find('\n', at2 + 1) - at2 - 1);
  CHECK(std::stod(line2.substr(line2.find_last_of(' ') + 1)) == 0.0);
  run_command("rm -rf " + dir);
}

TEST_CASE("r2ccl_predict: its drain policy defaults are the parameter table's", "[predict]") {
  // The tool and the plugin must judge a trace the same way unless told otherwise: the
  // defaults --evaluate prints and --help states come from R2CCL_PREDICT_*'s defaults.
  r2ccl::Config c = r2ccl::default_config();
  const r2ccl::predict::PredictorConfig d = r2ccl::predict::predictor_config_from(c);
  std::string help;
  REQUIRE(run("--help", &help) == 0);
  auto help_of = [&](const std::string& opt) {  // the option's help, up to the next option
    const size_t a = help.find("\n  " + opt + " ");
    if (a == std::string::npos) return std::string("?");
    const size_t b = help.find("\n  --", a + 1);
    return help.substr(a, b == std::string::npos ? std::string::npos : b - a);
  };
  char buf[160];
  snprintf(buf, sizeof(buf), "default %.2g,", d.threshold);
  CHECK_THAT(help_of("--threshold"), Catch::Contains(buf));
  snprintf(buf, sizeof(buf), "default %.2g,", d.return_threshold);
  CHECK_THAT(help_of("--return-threshold"), Catch::Contains(buf));
  CHECK_THAT(help_of("--return-samples"),
             Catch::Contains("default " + std::to_string(d.return_samples) + ","));
  CHECK_THAT(help_of("--enter-samples"),
             Catch::Contains("default " + std::to_string(d.enter_samples) + ","));
  CHECK_THAT(help_of("--max-drains-per-hour"),
             Catch::Contains("default " + std::to_string(d.max_drains_per_hour) + ","));
  snprintf(buf, sizeof(buf), "default %.0f,", d.min_drain_s);
  CHECK_THAT(help_of("--min-drain"), Catch::Contains(buf));
  snprintf(buf, sizeof(buf), "default %.0f,", d.down_hold_s);
  CHECK_THAT(help_of("--down-hold"), Catch::Contains(buf));
  CHECK_THAT(help_of("--down-hold-after"),
             Catch::Contains("default " + std::to_string(d.down_hold_after) + ","));
  CHECK_THAT(help_of("--decider"), Catch::Contains("default " + c.predict_decider + ","));
  snprintf(buf, sizeof(buf), "default %.3g,", c.predict_lstm_cap);
  CHECK_THAT(help_of("--lstm-cap"), Catch::Contains(buf));
  // And what --evaluate runs with.
  const std::string dir = temp_path("predict-tool-defaults");
  run_command("rm -rf " + dir + " && mkdir -p " + dir);
  write(dir + "/t.csv",
        "t_s,rail,link,speed_mbps,retrans,tx_packets,rx_packets,tx_bytes,rx_bytes,symbol_err,"
        "rcv_err,link_recovery,link_downed,integrity,buf_overrun,scenario\n"
        "0,r0,1,100000,0,0,0,0,0,0,0,0,0,0,0,healthy\n"
        "5,r0,1,100000,0,0,0,0,0,0,0,0,0,0,0,healthy\n");
  std::string out;
  REQUIRE(run("--evaluate " + dir + "/t.csv --model " + kModel, &out) == 0);
  INFO(out);
  snprintf(buf, sizeof(buf),
           "drain at risk >= %.2f for %d samples, kept at least %.0f s, return below %.2f for %d,",
           d.threshold, d.enter_samples, d.min_drain_s, d.return_threshold, d.return_samples);
  CHECK_THAT(out, Catch::Contains(buf));
  CHECK_THAT(out, Catch::Contains("at most " + std::to_string(d.max_drains_per_hour) +
                                  " drains per rail within an hour"));
  snprintf(buf, sizeof(buf), "held out %.0f s after %d link-down", d.down_hold_s,
           d.down_hold_after);
  CHECK_THAT(out, Catch::Contains(buf));
  snprintf(buf, sizeof(buf), "raised by the LSTM up to %.3g x its own risk", c.predict_lstm_cap);
  CHECK_THAT(out, Catch::Contains(buf));
  for (const std::string name : {"lstm ", "baseline ", "both "}) {
    int rows = 0;  // lines that begin with the decider's name: the event and sample tables
    for (size_t at = out.find("\n" + name); at != std::string::npos;
         at = out.find("\n" + name, at + 1))
      ++rows;
    CHECK(rows == 2);
  }
}
