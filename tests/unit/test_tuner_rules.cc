// The tuner's pure parts: the rules parser (r2ccl's format and NCCL's example CSV layout),
// malformed files, the cost model, and the version-neutral core on flat cost tables.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "cost_model.h"
#include "r2ccl/nccl_tuner_abi.h"
#include "rules.h"
#include "tuner_core.h"

using namespace r2ccl::tuner;

namespace {

std::mutex g_mu;
std::vector<std::string> g_logs;

void capture_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt,
                    ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(g_mu);
  g_logs.push_back(std::string(level == NCCL_LOG_WARN ? "WARN " : "INFO ") + msg);
}

std::vector<std::string> take_warns() {
  std::lock_guard<std::mutex> lk(g_mu);
  std::vector<std::string> w;
  for (auto& l : g_logs)
    if (l.rfind("WARN ", 0) == 0) w.push_back(l);
  g_logs.clear();
  return w;
}

std::string parse_error(const std::string& text) {
  RuleSet rs;
  std::string err;
  if (parse_rules(text, "t.conf", &rs, &err)) return "";
  return err;
}

std::string write_temp(const std::string& text) {
  char path[] = "/tmp/r2ccl-tuner-unit-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  close(fd);
  return path;
}

// A full 7 x 3 table with distinct positive costs and the given IGNORE cells.
std::vector<float> table_with(std::vector<std::pair<int, int>> ignore) {
  std::vector<float> t(kMaxAlgos * kMaxProtos);
  for (int i = 0; i < kMaxAlgos * kMaxProtos; ++i) t[i] = 10.0f + i;
  for (auto [a, p] : ignore) t[a * kMaxProtos + p] = NCCL_ALGO_PROTO_IGNORE;
  return t;
}

}  // namespace

TEST_CASE("r2ccl rule lines parse into rules", "[unit][tuner]") {
  RuleSet rs;
  std::string err;
  REQUIRE(
      parse_rules("# comment\n\n"
                  "allreduce 0-64K nodes=2+ ranks=any -> tree/ll channels=2  # small\n"
                  "any 1M+ pipeops=1-4 regbuff=1 -> ring/simple\n"
                  "broadcast any -> keep channels=3\n"
                  "allgather 4096 usable=0-20 -> pat/ll128\n"
                  "model on net_bw=25 net_lat=4 intra_bw=100 intra_lat=0.5 degraded_below=20\n",
                  "t.conf", &rs, &err));
  INFO(err);
  REQUIRE(rs.rules.size() == 4);
  const Rule& r0 = rs.rules[0];
  CHECK(r0.coll == ncclFuncAllReduce);
  CHECK(r0.bytes.lo == 0);
  CHECK(r0.bytes.hi == 65536);
  CHECK(r0.nodes.lo == 2);
  CHECK(r0.nodes.hi == UINT64_MAX);
  CHECK(r0.ranks.any());
  CHECK(r0.algo == NCCL_ALGO_TREE);
  CHECK(r0.proto == NCCL_PROTO_LL);
  CHECK(r0.channels == 2);
  CHECK(r0.line == 3);
  CHECK(rs.rules[1].coll == -1);
  CHECK(rs.rules[1].bytes.lo == 1u << 20);
  CHECK(rs.rules[1].pipe_ops.hi == 4);
  CHECK(rs.rules[1].reg_buff.lo == 1);
  CHECK(rs.rules[1].channels == -1);
  CHECK(rs.rules[2].algo == -1);
  CHECK(rs.rules[2].channels == 3);
  CHECK(rs.rules[3].usable.hi == 20);
  CHECK(rs.model.enabled);
  CHECK(rs.model.net_bw == 25);
  CHECK(rs.model.intra_lat == 0.5);
  CHECK(rs.model.degraded_below == 20);
  // format_rules writes what parse_rules reads back.
  RuleSet back;
  REQUIRE(parse_rules(format_rules(rs), "back", &back, &err));
  REQUIRE(back.rules.size() == rs.rules.size());
  CHECK(format_rules(back) == format_rules(rs));
}

TEST_CASE("NCCL's example tuner CSV layout is accepted (8, 9 and 10 fields)", "[unit][tuner]") {
  RuleSet rs;
  std::string err;
  REQUIRE(
      parse_rules("allreduce,0,65536,tree,simple,2,1,-1,-1,1\n"
                  "allreduce,65537,1048576,ring,simple,4,4,32,1,0\n"
                  "allgather,0,4294967295,ring,simple,4,2,-1\n"
                  "reduce, 0, 4294967295, tree, simple, -1, -1, -1, 2\n",
                  "nccl.csv", &rs, &err));
  INFO(err);
  REQUIRE(rs.rules.size() == 4);
  CHECK(rs.rules[0].nodes.lo == 1);
  CHECK(rs.rules[0].nodes.hi == 1);
  CHECK(rs.rules[0].ranks.any());
  CHECK(rs.rules[0].pipe_ops.any());
  CHECK(rs.rules[0].reg_buff.lo == 1);
  CHECK(rs.rules[1].ranks.lo == 32);
  CHECK(rs.rules[1].reg_buff.hi == 0);
  CHECK(rs.rules[2].pipe_ops.any());
  CHECK(rs.rules[2].channels == 4);
  CHECK(rs.rules[3].channels == -1);
  CHECK(rs.rules[3].pipe_ops.lo == 2);
  // The example file shipped with the reference, when this checkout has it.
  const std::string ref =
      std::string(R2CCL_SOURCE_DIR) + "/../shared/reference/15_nccl_tuner_conf_nvidia_example.csv";
  if (access(ref.c_str(), R_OK) == 0) {
    RuleSet ex;
    REQUIRE(load_rules_file(ref, &ex, &err));
    INFO(err);
    CHECK(ex.rules.size() == 9);
  }
}

TEST_CASE("malformed rules name file, line and column", "[unit][tuner]") {
  struct Case {
    std::string text;
    const char* where;  // "t.conf:LINE:COL:"
    const char* what;
  } cases[] = {
      {"allreduce,0,100,ring,simple,2,1\n", "t.conf:1:1:", "8, 9 or 10"},
      {"# ok\nallreduce,0,100,ring,simple,2,1,1,1,1,1\n", "t.conf:2:1:", "got 11"},
      {"allreduce,-5,100,ring,simple,2,1,1\n", "t.conf:1:11:", "negative"},
      {"allreduce -5-100 -> ring/simple\n", "t.conf:1:11:", "negative"},
      {"allreduce,0,100,ring,simple,2,1,-7\n", "t.conf:1:33:", "negative"},
      {"allreduce,0,100,rong,simple,2,1,1\n", "t.conf:1:17:", "unknown algorithm"},
      {"allreduce,0,100,ring,fast,2,1,1\n", "t.conf:1:22:", "unknown protocol"},
      {"allsum,0,100,ring,simple,2,1,1\n", "t.conf:1:1:", "unknown collective"},
      {"\n\nallreduce 0-1K -> ring/simple channels=65\n", "t.conf:3:31:", "channels"},
      {"allreduce,0,99999999999999999999999,ring,simple,2,1,1\n", "t.conf:1:13:", "too large"},
      {"allreduce 0-99999999999999999T -> ring/simple\n", "t.conf:1:11:", "too large"},
      {"allreduce,100,10,ring,simple,2,1,1\n", "t.conf:1:15:", "below"},
      {"allreduce 0-1K nodes=x -> ring/simple\n", "t.conf:1:16:", "nodes"},
      {"allreduce 0-1K colour=red -> ring/simple\n", "t.conf:1:16:", "unknown condition"},
      {"allreduce 0-1K ring/simple\n", "t.conf:1:16:", "->"},
      {"model maybe\n", "t.conf:1:7:", "on"},
      {"model on net_bw=-3\n", "t.conf:1:10:", "net_bw"},
      {"model on speed=3\n", "t.conf:1:10:", "unknown parameter"},
      {"allreduce 0-1K -> ring/simple\n\x7f\x45\x4c\x46\x02\x01\x01\n", "t.conf:2:1:", "byte 0x7f"},
      {std::string("allreduce 0-1K -> ring/simple\nall\0reduce\n", 42), "t.conf:2:4:", "byte 0x00"},
  };
  for (const Case& c : cases) {
    INFO("text: " << c.text);
    std::string err = parse_error(c.text);
    INFO("error: " << err);
    CHECK(err.rfind(c.where, 0) == 0);
    CHECK(err.find(c.what) != std::string::npos);
  }
  // Binary junk with NUL bytes (std::string keeps them).
  std::string junk("\x01\x00\xff\xfe,,,\n", 8);
  CHECK(parse_error(junk).rfind("t.conf:1:1:", 0) == 0);
}

TEST_CASE("the cost model prefers low latency for small and bandwidth for large", "[unit][tuner]") {
  ModelParams m;
  m.enabled = true;
  auto best = [&](int coll, uint64_t bytes, uint64_t ranks, uint64_t nodes) {
    double bt = -1;
    int ba = -1, bp = -1;
    for (int a = 0; a < kMaxAlgos; ++a)
      for (int p = 0; p < kMaxProtos; ++p) {
        double t = predict_us(m, m.net_bw, coll, bytes, ranks, nodes, a, p);
        if (t >= 0 && (bt < 0 || t < bt)) {
          bt = t;
          ba = a;
          bp = p;
        }
      }
    return std::make_pair(ba, bp);
  };
  // Many nodes, tiny allreduce: tree (log depth) with LL.
  CHECK(best(ncclFuncAllReduce, 8, 1024, 128) == std::make_pair(NCCL_ALGO_TREE, NCCL_PROTO_LL));
  // Huge allreduce: ring with SIMPLE.
  CHECK(best(ncclFuncAllReduce, 8ull << 30, 64, 8) ==
        std::make_pair(NCCL_ALGO_RING, NCCL_PROTO_SIMPLE));
  // No model for CollNet/NVLS, tree outside AllReduce, PAT with several ranks per node.
  CHECK(predict_us(m, 50, ncclFuncAllReduce, 1024, 16, 2, NCCL_ALGO_NVLS, NCCL_PROTO_SIMPLE) < 0);
  CHECK(predict_us(m, 50, ncclFuncAllGather, 1024, 16, 2, NCCL_ALGO_TREE, NCCL_PROTO_SIMPLE) < 0);
  CHECK(predict_us(m, 50, ncclFuncAllGather, 1024, 16, 2, NCCL_ALGO_PAT, NCCL_PROTO_SIMPLE) < 0);
  CHECK(predict_us(m, 50, ncclFuncAllGather, 1024, 16, 16, NCCL_ALGO_PAT, NCCL_PROTO_SIMPLE) > 0);
  // Less bandwidth: never faster.
  CHECK(predict_us(m, 10, ncclFuncAllReduce, 1 << 30, 16, 2, NCCL_ALGO_RING, NCCL_PROTO_SIMPLE) >
        predict_us(m, 50, ncclFuncAllReduce, 1 << 30, 16, 2, NCCL_ALGO_RING, NCCL_PROTO_SIMPLE));
  // Degenerate shapes do not blow up.
  for (uint64_t n : {0ull, 1ull, 8192ull})
    for (uint64_t nn : {0ull, 1ull, 8192ull})
      CHECK(predict_us(m, 50, ncclFuncAllReduce, 16ull << 30, n, nn, NCCL_ALGO_RING,
                       NCCL_PROTO_LL) > 0);
}

TEST_CASE("core: a rule forces its entry to 0, IGNORE entries never change", "[unit][tuner]") {
  std::string path = write_temp(
      "allreduce 0-64K -> tree/ll channels=2\n"
      "allreduce 0-64K -> ring/ll128\n"
      "allgather any -> keep channels=5\n");
  Options o;
  o.rules_path = path;
  o.board = "none";
  Context* c = nullptr;
  REQUIRE(create_context(o, 16, 2, capture_logger, 5, &c) == r2ccl::Status::kOk);
  REQUIRE(c != nullptr);
  take_warns();

  // First rule applies.
  auto t = table_with({{NCCL_ALGO_NVLS, NCCL_PROTO_LL}});
  auto before = t;
  int nch = 0;
  Choice ch =
      get_coll_info(c, {ncclFuncAllReduce, 1024, 1, 0}, t.data(), kMaxAlgos, kMaxProtos, &nch);
  CHECK(ch.algo == NCCL_ALGO_TREE);
  CHECK(ch.proto == NCCL_PROTO_LL);
  CHECK(nch == 2);
  for (int i = 0; i < kMaxAlgos * kMaxProtos; ++i)
    CHECK(t[i] == (i == NCCL_ALGO_TREE * kMaxProtos + NCCL_PROTO_LL ? 0.0f : before[i]));

  // tree/ll is IGNORE: the rule is skipped with a WARN, the next one applies (no channels).
  t = table_with({{NCCL_ALGO_TREE, NCCL_PROTO_LL}});
  before = t;
  nch = 0;
  ch = get_coll_info(c, {ncclFuncAllReduce, 1024, 1, 0}, t.data(), kMaxAlgos, kMaxProtos, &nch);
  CHECK(ch.algo == NCCL_ALGO_RING);
  CHECK(nch == 0);
  CHECK(t[NCCL_ALGO_TREE * kMaxProtos + NCCL_PROTO_LL] == NCCL_ALGO_PROTO_IGNORE);
  CHECK(t[NCCL_ALGO_RING * kMaxProtos + NCCL_PROTO_LL128] == 0.0f);
  auto w = take_warns();
  REQUIRE(w.size() == 1);
  CHECK(w[0].find(path + ":1:") != std::string::npos);

  // Both IGNORE: nothing changes; warnings are rate limited.
  for (int k = 0; k < 50; ++k) {
    t = table_with({{NCCL_ALGO_TREE, NCCL_PROTO_LL}, {NCCL_ALGO_RING, NCCL_PROTO_LL128}});
    before = t;
    nch = 0;
    ch = get_coll_info(c, {ncclFuncAllReduce, 1024, 1, 0}, t.data(), kMaxAlgos, kMaxProtos, &nch);
    CHECK(ch.algo == -1);
    CHECK(t == before);
    CHECK(nch == 0);
  }
  CHECK(take_warns().size() <= 3);

  // Channel-only rule; no matching rule; a table of 6 algorithms (NCCL <= 2.22).
  t = table_with({});
  before = t;
  nch = 0;
  get_coll_info(c, {ncclFuncAllGather, 1 << 20, 1, -1}, t.data(), kMaxAlgos, kMaxProtos, &nch);
  CHECK(t == before);
  CHECK(nch == 5);
  nch = 0;
  get_coll_info(c, {ncclFuncBroadcast, 1 << 20, 1, -1}, t.data(), 6, kMaxProtos, &nch);
  CHECK(t == before);
  CHECK(nch == 0);
  // Unusable calls are ignored, never crash.
  get_coll_info(c, {9, 1, 1, -1}, t.data(), kMaxAlgos, kMaxProtos, &nch);
  get_coll_info(c, {ncclFuncAllReduce, 1, 1, -1}, nullptr, kMaxAlgos, kMaxProtos, &nch);
  CHECK(t == before);
  take_warns();
  destroy_context(c);
  unlink(path.c_str());
}

TEST_CASE("rules: with a skip list a malformed row is dropped alone, with its position",
          "[unit][tuner]") {
  const std::string text =
      "allreduce 0-64K -> tree/ll\n"
      "allreduce,1,2\n"  // too few fields
      "model net_bw=notanumber\n"
      "bogus line\n" +
      std::string(5000, 'x') + "\n" + "allgather 0-1M -> ring/simple\n";
  RuleSet rs;
  std::string err;
  std::vector<std::string> skipped;
  REQUIRE(parse_rules(text, "t.conf", &rs, &err, &skipped));
  CHECK(rs.rules.size() == 2);
  CHECK(rs.rules[0].line == 1);
  CHECK(rs.rules[1].line == 6);
  REQUIRE(skipped.size() == 4);
  CHECK(skipped[0].rfind("t.conf:2:", 0) == 0);
  CHECK(skipped[1].rfind("t.conf:3:", 0) == 0);
  CHECK(skipped[2].rfind("t.conf:4:", 0) == 0);
  CHECK(skipped[3].rfind("t.conf:5:1: line longer than 4096 bytes", 0) == 0);
  // Without a skip list the first malformed row fails the whole file, as before.
  RuleSet none;
  CHECK_FALSE(parse_rules(text, "t.conf", &none, &err));
  CHECK(err.rfind("t.conf:2:", 0) == 0);
  // A file over the size limit, or not text at all, fails either way.
  CHECK_FALSE(parse_rules(std::string(2 << 20, '#'), "big", &rs, &err, &skipped));
  CHECK_FALSE(
      parse_rules("allreduce 0-64K -> tree/ll\n\x7f"
                  "ELF\n",
                  "bin", &rs, &err, &skipped));
  CHECK(err.rfind("bin:2:1: unexpected byte 0x7f", 0) == 0);
}

TEST_CASE("core: a malformed row -> WARN once naming it, the other rows kept; strict fails",
          "[unit][tuner]") {
  std::string path =
      write_temp("allreduce 0-64K -> tree/ll\nallreduce,1,2\nallgather 0-1M -> ring/simple\n");
  Options o;
  o.rules_path = path;
  o.board = "none";
  const int live = live_contexts();
  Context* c = nullptr;
  REQUIRE(create_context(o, 8, 1, capture_logger, 4, &c) == r2ccl::Status::kOk);
  REQUIRE(c != nullptr);
  CHECK(c->rules->rules.size() == 2);  // rows 1 and 3; row 2 is dropped alone
  auto w = take_warns();
  REQUIRE(w.size() == 1);
  CHECK(w[0].find(path + ":2:1:") != std::string::npos);
  CHECK(w[0].find("2 rules kept") != std::string::npos);
  auto t = table_with({});
  auto before = t;
  int nch = 0;
  get_coll_info(c, {ncclFuncAllReduce, 1024, 1, 0}, t.data(), kMaxAlgos, kMaxProtos, &nch);
  CHECK(t != before);  // row 1 still rules
  destroy_context(c);
  // The next communicator reads the same file: the same row is not warned about again.
  REQUIRE(create_context(o, 8, 1, capture_logger, 4, &c) == r2ccl::Status::kOk);
  CHECK(c->rules->rules.size() == 2);
  CHECK(take_warns().empty());
  destroy_context(c);

  o.strict = true;
  c = reinterpret_cast<Context*>(0x1);
  CHECK(create_context(o, 8, 1, capture_logger, 4, &c) == r2ccl::Status::kInvalidUsage);
  CHECK(c == nullptr);
  CHECK(take_warns().size() == 1);
  CHECK(live_contexts() == live);
  // A missing file is malformed too.
  o.rules_path = path + ".missing";
  CHECK(create_context(o, 8, 1, capture_logger, 4, &c) == r2ccl::Status::kInvalidUsage);
  take_warns();
  unlink(path.c_str());
}

// The tuner logs through common's facade as "TUNER/R2CCL": through its context's logger, else
// the tuner's logger in the facade, else stderr; never through the net plugin's logger (a
// process, or this test binary, may hold both).
TEST_CASE("core: log lines are TUNER/R2CCL lines of common's facade", "[unit][tuner]") {
  std::string path = write_temp("allreduce 0-64K -> tree/ll\nallreduce,1,2\n");
  Options o;
  o.rules_path = path;
  o.board = "none";
  Context* c = nullptr;
  take_warns();
  REQUIRE(create_context(o, 8, 1, capture_logger, 4, &c) == r2ccl::Status::kOk);
  destroy_context(c);
  auto w = take_warns();
  REQUIRE(w.size() == 1);
  CHECK(w[0].rfind("WARN TUNER/R2CCL rules file " + path + ":2:1:", 0) == 0);

  // No context logger: stderr as "TUNER/R2CCL WARN ...", even with the net plugin's logger set.
  // (A new file each time: a malformed row is warned about once per process.)
  unlink(path.c_str());
  path = write_temp("allreduce 0-64K -> tree/ll\nallreduce,1,2\n");
  o.rules_path = path;
  r2ccl::set_nccl_logger(capture_logger);
  fflush(stderr);
  char out_path[] = "/tmp/r2ccl-tuner-unit-err-XXXXXX";
  const int fd = mkstemp(out_path);
  REQUIRE(fd >= 0);
  const int saved = dup(2);
  dup2(fd, 2);
  c = nullptr;
  const r2ccl::Status st = create_context(o, 8, 1, nullptr, 4, &c);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  r2ccl::set_nccl_logger(nullptr);
  REQUIRE(st == r2ccl::Status::kOk);
  destroy_context(c);
  std::ifstream in(out_path);
  std::string line;
  std::getline(in, line);
  unlink(out_path);
  CHECK(line.rfind("TUNER/R2CCL WARN rules file " + path + ":2:1:", 0) == 0);
  CHECK(take_warns().empty());  // nothing went to the net plugin's logger

  // The tuner's logger in the facade (set by the ABI layer at init) when a call names none.
  unlink(path.c_str());
  path = write_temp("allreduce 0-64K -> tree/ll\nallreduce,1,2\n");
  o.rules_path = path;
  r2ccl::set_nccl_logger(r2ccl::Component::kTuner, capture_logger);
  REQUIRE(create_context(o, 8, 1, nullptr, 4, &c) == r2ccl::Status::kOk);
  destroy_context(c);
  r2ccl::set_nccl_logger(r2ccl::Component::kTuner, nullptr);
  w = take_warns();
  REQUIRE(w.size() == 1);
  CHECK(w[0].rfind("WARN TUNER/R2CCL rules file ", 0) == 0);
  unlink(path.c_str());
}

TEST_CASE("core v2: algorithm and protocol are set together or not at all", "[unit][tuner]") {
  std::string path = write_temp("allreduce any -> nvls/simple\nallreduce any -> ring/ll\n");
  Options o;
  o.rules_path = path;
  o.board = "none";
  Context* c = nullptr;
  REQUIRE(create_context(o, 8, 1, capture_logger, 2, &c) == r2ccl::Status::kOk);
  int algo = -1, proto = -1, nch = 0;
  get_coll_info_v2(c, {ncclFuncAllReduce, 100, 1, -1}, 0, 1, &algo, &proto, &nch);
  CHECK(algo == NCCL_ALGO_NVLS);
  CHECK(proto == NCCL_PROTO_SIMPLE);
  algo = proto = -1;
  get_coll_info_v2(c, {ncclFuncAllReduce, 100, 1, -1}, 0, 0, &algo, &proto, &nch);  // no NVLS
  CHECK(algo == NCCL_ALGO_RING);
  CHECK(proto == NCCL_PROTO_LL);
  algo = proto = -1;
  get_coll_info_v2(c, {ncclFuncBroadcast, 100, 1, -1}, 0, 0, &algo, &proto, &nch);
  CHECK(algo == -1);
  CHECK(proto == -1);
  CHECK(nch == 0);
  destroy_context(c);
  take_warns();
  unlink(path.c_str());
}

TEST_CASE("rules: repeated conditions and non-regular files are errors, never silent",
          "[unit][tuner]") {
  CHECK(parse_error("allreduce any nodes=2 nodes=3 -> ring/simple\n").find("given twice") !=
        std::string::npos);
  CHECK(parse_error("allreduce any -> ring/simple channels=4 channels=8\n").find("given twice") !=
        std::string::npos);
  RuleSet rs;
  std::string err;
  const std::string dir = (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp") +
                          std::string("/rules-dir-") + std::to_string(getpid());
  REQUIRE(mkdir(dir.c_str(), 0700) == 0);
  CHECK_FALSE(load_rules_file(dir, &rs, &err));
  CHECK(err.find("not a regular file") != std::string::npos);
  // A FIFO must not block (NCCL's communicator creation would hang with it).
  const std::string fifo = dir + "/fifo";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  err.clear();
  CHECK_FALSE(load_rules_file(fifo, &rs, &err));
  CHECK(err.find("not a regular file") != std::string::npos);
  unlink(fifo.c_str());
  rmdir(dir.c_str());
}
