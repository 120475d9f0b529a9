// The .so as NCCL sees it: exported symbols, the four net tables and the extension, device
// properties through every API version, a checked AllReduce through every API version, and
// init-time configuration errors. Anything that initialises the plugin runs in a forked child
// (the plugin reads its R2CCL_* variables once per process).
#include <dlfcn.h>
#include <time.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "r2ccl/ext.h"
#include "r2ccl/nccl_abi.h"
#include "support/net_harness.h"

using namespace r2ccl::test;

namespace {

const char* kTwoRails = "lo@127.0.0.1,lo@127.0.0.2";

std::string plugin_path() { return env_or("R2CCL_TEST_PLUGIN", ""); }

double mono_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

// NCCL-like logger for the children: prints every message with its level, to stderr.
void stderr_logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  const char* tag = level == NCCL_LOG_WARN ? "WARN" : level == NCCL_LOG_INFO ? "INFO" : "OTHER";
  fprintf(stderr, "NCCL %s %s\n", tag, msg);
}

// Child-side checks: print what failed and return 1 from the child function.
#define CHILD_CHECK(cond)                                                              \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "child check failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

void* open_plugin_or_die() {
  void* dl = dlopen(plugin_path().c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    fprintf(stderr, "dlopen %s: %s\n", plugin_path().c_str(), dlerror());
    _exit(90);
  }
  return dl;
}

// Fields every version has (v8 layout and later).
template <typename P>
int check_common_props(const P& p, int dev) {
  const char* want = dev == 0 ? "lo@127.0.0.1" : "lo@127.0.0.2";
  CHILD_CHECK(p.name != nullptr);
  if (strcmp(p.name, want) != 0) {
    fprintf(stderr, "device %d is named '%s', expected '%s'\n", dev, p.name, want);
    return 1;
  }
  CHILD_CHECK(p.ptrSupport == NCCL_PTR_HOST);
  CHILD_CHECK(p.maxRecvs == 1);
  CHILD_CHECK(p.speed > 0);
  CHILD_CHECK(p.maxComms > 0);
  CHILD_CHECK(p.latency >= 0);
  CHILD_CHECK(p.netDeviceType == NCCL_NET_DEVICE_HOST);
  CHILD_CHECK(p.netDeviceVersion == 0);
  return 0;
}

template <typename P>
int check_v9_props(const P& p, int dev) {
  if (int rc = check_common_props(p, dev)) return rc;
  CHILD_CHECK(p.maxP2pBytes > 0);
  CHILD_CHECK(p.maxP2pBytes <= NCCL_MAX_NET_SIZE_BYTES);
  CHILD_CHECK(p.maxCollBytes > 0);
  CHILD_CHECK(p.maxCollBytes <= NCCL_MAX_NET_SIZE_BYTES);
  CHILD_CHECK(p.vProps.ndevs == 1);
  CHILD_CHECK(p.vProps.devs[0] == dev);
  return 0;
}

// devices() == 2, then every device's properties through `get`, then bad devices fail.
template <typename P, typename Get, typename Check>
int check_devices(ncclResult_t (*devices)(int*), Get get, Check check) {
  int ndev = -1;
  CHILD_CHECK(devices(&ndev) == ncclSuccess);
  if (ndev != 2) {
    fprintf(stderr, "devices() = %d, expected 2\n", ndev);
    return 1;
  }
  std::set<std::string> names;
  for (int d = 0; d < ndev; ++d) {
    P p;
    memset(&p, 0xAB, sizeof(p));  // every field must be written
    CHILD_CHECK(get(d, &p) == ncclSuccess);
    if (int rc = check(p, d)) return rc;
    names.insert(p.name);
  }
  CHILD_CHECK(names.size() == 2);
  for (int bad : {-1, 2, 1000}) {
    P p;
    memset(&p, 0, sizeof(p));
    if (get(bad, &p) == ncclSuccess) {
      fprintf(stderr, "getProperties(%d) succeeded with %d devices\n", bad, ndev);
      return 1;
    }
  }
  return 0;
}

int props_child(int version) {
  void* dl = open_plugin_or_die();
  switch (version) {
    case 8: {
      auto* t = static_cast<const ncclNet_v8_t*>(dlsym(dl, "ncclNetPlugin_v8"));
      CHILD_CHECK(t && t->init(stderr_logger) == ncclSuccess);
      return check_devices<ncclNetProperties_v8_t>(t->devices, t->getProperties,
                                                   check_common_props<ncclNetProperties_v8_t>);
    }
    case 9: {
      auto* t = static_cast<const ncclNet_v9_t*>(dlsym(dl, "ncclNetPlugin_v9"));
      CHILD_CHECK(t && t->init(stderr_logger) == ncclSuccess);
      return check_devices<ncclNetProperties_v9_t>(t->devices, t->getProperties,
                                                   check_v9_props<ncclNetProperties_v9_t>);
    }
    case 10: {
      auto* t = static_cast<const ncclNet_v10_t*>(dlsym(dl, "ncclNetPlugin_v10"));
      CHILD_CHECK(t && t->init(stderr_logger, nullptr) == ncclSuccess);
      return check_devices<ncclNetProperties_v10_t>(t->devices, t->getProperties,
                                                    check_v9_props<ncclNetProperties_v10_t>);
    }
    case 11: {
      auto* t = static_cast<const ncclNet_v11_t*>(dlsym(dl, "ncclNetPlugin_v11"));
      CHILD_CHECK(t != nullptr);
      // init runs once per communicator: two live contexts, then finalize each; finalize
      // must also accept the NULL context of a failed init (reference §6.10).
      void* ctx1 = nullptr;
      void* ctx2 = nullptr;
      ncclNetCommConfig_v11_t cfg{NCCL_NET_TRAFFIC_CLASS_UNDEF};
      CHILD_CHECK(t->init(&ctx1, 1, &cfg, stderr_logger, nullptr) == ncclSuccess);
      CHILD_CHECK(t->init(&ctx2, 2, &cfg, stderr_logger, nullptr) == ncclSuccess);
      CHILD_CHECK(ctx1 != nullptr && ctx2 != nullptr && ctx1 != ctx2);
      int rc = check_devices<ncclNetProperties_v11_t>(t->devices, t->getProperties,
                                                      [](const ncclNetProperties_v11_t& p, int d) {
                                                        if (int r = check_v9_props(p, d)) return r;
                                                        CHILD_CHECK(p.maxMultiRequestSize == 1);
                                                        return 0;
                                                      });
      if (rc) return rc;
      CHILD_CHECK(t->finalize(ctx2) == ncclSuccess);
      CHILD_CHECK(t->finalize(ctx1) == ncclSuccess);
      CHILD_CHECK(t->finalize(nullptr) == ncclSuccess);
      return 0;
    }
  }
  return 2;
}

}  // namespace

TEST_CASE("exported dynamic symbols are exactly the four net tables and r2cclExt_v1", "[abi]") {
  const std::string so = plugin_path();
  REQUIRE_FALSE(so.empty());
  std::set<std::string> syms;
  for (const auto& [name, type] : dynamic_symbols(so)) {
    syms.insert(name);
    // Data objects (D/d initialised data, R/r read-only, B bss), not functions.
    CHECK((type == '?' || is_data_symbol(type)));
  }
  const std::set<std::string> want = {"ncclNetPlugin_v8", "ncclNetPlugin_v9", "ncclNetPlugin_v10",
                                      "ncclNetPlugin_v11", "r2cclExt_v1"};
  CHECK(syms == want);
}

TEST_CASE("the library does not link libnl (it must dlopen it at run time)", "[abi]") {
  const std::string so = plugin_path();
  std::string out;
  REQUIRE(run_command("ldd " + shell_quote(so), &out) == 0);
  INFO("ldd:\n" << out);
  CHECK(out.find("libnl") == std::string::npos);
  CHECK(out.find("not found") == std::string::npos);
  REQUIRE(run_command("objdump -p " + shell_quote(so), &out) == 0);
  std::istringstream in(out);
  std::string line;
  int needed = 0;
  while (std::getline(in, line))
    if (line.find("NEEDED") != std::string::npos) {
      ++needed;
      INFO("NEEDED line: " << line);
      CHECK(line.find("libnl") == std::string::npos);
    }
  CHECK(needed > 0);
}

TEST_CASE("net tables: name R2CCL, required slots set, optional ones NULL", "[abi]") {
  void* dl = dlopen(plugin_path().c_str(), RTLD_NOW | RTLD_LOCAL);
  INFO("dlopen: " << (dl ? "" : dlerror()));
  REQUIRE(dl != nullptr);

  SECTION("v8") {
    auto* t = static_cast<const ncclNet_v8_t*>(dlsym(dl, "ncclNetPlugin_v8"));
    REQUIRE(t != nullptr);
    REQUIRE(t->name != nullptr);
    CHECK(std::string(t->name) == "R2CCL");
    CHECK(t->init);
    CHECK(t->devices);
    CHECK(t->getProperties);
    CHECK(t->listen);
    CHECK(t->connect);
    CHECK(t->accept);
    CHECK(t->regMr);
    CHECK(t->regMrDmaBuf == nullptr);
    CHECK(t->deregMr);
    CHECK(t->isend);
    CHECK(t->irecv);
    CHECK(t->iflush);
    CHECK(t->test);
    CHECK(t->closeSend);
    CHECK(t->closeRecv);
    CHECK(t->closeListen);
    CHECK(t->getDeviceMr == nullptr);
    CHECK(t->irecvConsumed == nullptr);
  }
  SECTION("v9") {
    auto* t = static_cast<const ncclNet_v9_t*>(dlsym(dl, "ncclNetPlugin_v9"));
    REQUIRE(t != nullptr);
    REQUIRE(t->name != nullptr);
    CHECK(std::string(t->name) == "R2CCL");
    CHECK(t->init);
    CHECK(t->devices);
    CHECK(t->getProperties);
    CHECK(t->listen);
    CHECK(t->connect);
    CHECK(t->accept);
    CHECK(t->regMr);
    CHECK(t->regMrDmaBuf == nullptr);
    CHECK(t->deregMr);
    CHECK(t->isend);
    CHECK(t->irecv);
    CHECK(t->iflush);
    CHECK(t->test);
    CHECK(t->closeSend);
    CHECK(t->closeRecv);
    CHECK(t->closeListen);
    CHECK(t->getDeviceMr == nullptr);
    CHECK(t->irecvConsumed == nullptr);
    CHECK(t->makeVDevice == nullptr);
  }
  SECTION("v10") {
    auto* t = static_cast<const ncclNet_v10_t*>(dlsym(dl, "ncclNetPlugin_v10"));
    REQUIRE(t != nullptr);
    REQUIRE(t->name != nullptr);
    CHECK(std::string(t->name) == "R2CCL");
    CHECK(t->init);
    CHECK(t->devices);
    CHECK(t->getProperties);
    CHECK(t->listen);
    CHECK(t->connect);
    CHECK(t->accept);
    CHECK(t->regMr);
    CHECK(t->regMrDmaBuf == nullptr);
    CHECK(t->deregMr);
    CHECK(t->isend);
    CHECK(t->irecv);
    CHECK(t->iflush);
    CHECK(t->test);
    CHECK(t->closeSend);
    CHECK(t->closeRecv);
    CHECK(t->closeListen);
    CHECK(t->getDeviceMr == nullptr);
    CHECK(t->irecvConsumed == nullptr);
    CHECK(t->makeVDevice == nullptr);
  }
  SECTION("v11") {
    auto* t = static_cast<const ncclNet_v11_t*>(dlsym(dl, "ncclNetPlugin_v11"));
    REQUIRE(t != nullptr);
    REQUIRE(t->name != nullptr);
    CHECK(std::string(t->name) == "R2CCL");
    CHECK(t->init);
    CHECK(t->devices);
    CHECK(t->getProperties);
    CHECK(t->listen);
    CHECK(t->connect);
    CHECK(t->accept);
    CHECK(t->regMr);
    CHECK(t->regMrDmaBuf == nullptr);
    CHECK(t->deregMr);
    CHECK(t->isend);
    CHECK(t->irecv);
    CHECK(t->iflush);
    CHECK(t->test);
    CHECK(t->closeSend);
    CHECK(t->closeRecv);
    CHECK(t->closeListen);
    CHECK(t->getDeviceMr == nullptr);
    CHECK(t->irecvConsumed == nullptr);
    CHECK(t->makeVDevice == nullptr);
    CHECK(t->finalize);
    CHECK(t->setNetAttr == nullptr);
  }
  SECTION("r2cclExt_v1") {
    auto* e = static_cast<const r2cclExt_v1_t*>(dlsym(dl, R2CCL_EXT_SYMBOL_V1));
    REQUIRE(e != nullptr);
    CHECK(e->version == 1);
    CHECK(e->getStats != nullptr);
  }
  SECTION("nothing else NCCL probes for") {
    for (const char* s : {"ncclNetPlugin_v7", "ncclNetPlugin_v6", "ncclNetPlugin_v12",
                          "ncclCollNetPlugin_v11", "ncclTunerPlugin_v5", "ncclGinPlugin_v11"}) {
      INFO(s);
      CHECK(dlsym(dl, s) == nullptr);
    }
  }
  dlclose(dl);
}

TEST_CASE("init, devices and getProperties through each API version", "[abi]") {
  for (int v : {8, 9, 10, 11}) {
    ChildResult r = run_child({{"R2CCL_SOCKET_IFNAME", kTwoRails}, {"R2CCL_LOG_FILE", "none"}},
                              [v] { return props_child(v); });
    INFO("net API v" << v << ", child output:\n" << r.output);
    CHECK(r.status == 0);
  }
}

TEST_CASE("r2cclExt_v1 getStats has snprintf semantics and lists both rails", "[abi]") {
  ChildResult r = run_child({{"R2CCL_SOCKET_IFNAME", kTwoRails}, {"R2CCL_LOG_FILE", "none"}}, [] {
    void* dl = open_plugin_or_die();
    auto* t = static_cast<const ncclNet_v11_t*>(dlsym(dl, "ncclNetPlugin_v11"));
    auto* e = static_cast<const r2cclExt_v1_t*>(dlsym(dl, R2CCL_EXT_SYMBOL_V1));
    CHILD_CHECK(t && e);
    void* ctx = nullptr;
    CHILD_CHECK(t->init(&ctx, 7, nullptr, stderr_logger, nullptr) == ncclSuccess);
    size_t n = e->getStats(nullptr, 0);
    CHILD_CHECK(n > 2);
    std::vector<char> buf(n + 1, 'x');
    CHILD_CHECK(e->getStats(buf.data(), buf.size()) == n);
    CHILD_CHECK(strlen(buf.data()) == n);
    std::string js(buf.data());
    fprintf(stderr, "stats: %s\n", js.c_str());
    CHILD_CHECK(js.front() == '{' && js.back() == '}');
    CHILD_CHECK(js.find("\"rails\"") != std::string::npos);
    CHILD_CHECK(js.find("\"lo@127.0.0.1\"") != std::string::npos);
    CHILD_CHECK(js.find("\"lo@127.0.0.2\"") != std::string::npos);
    CHILD_CHECK(js.find("\"switchovers\":0") != std::string::npos);
    CHILD_CHECK(js.find("\"replays\":0") != std::string::npos);
    char small[10];
    memset(small, 'x', sizeof(small));
    CHILD_CHECK(e->getStats(small, sizeof(small)) == n);  // truncated: still the full length
    CHILD_CHECK(strlen(small) == sizeof(small) - 1);
    CHILD_CHECK(memcmp(small, js.data(), sizeof(small) - 1) == 0);
    CHILD_CHECK(t->finalize(ctx) == ncclSuccess);
    return 0;
  });
  INFO("child output:\n" << r.output);
  CHECK(r.status == 0);
}

TEST_CASE("the library survives dlclose after init (NCCL 2.28 unloads it)", "[abi]") {
  ChildResult r = run_child({{"R2CCL_SOCKET_IFNAME", kTwoRails}, {"R2CCL_LOG_FILE", "none"}}, [] {
    void* dl = open_plugin_or_die();
    auto* t = static_cast<const ncclNet_v11_t*>(dlsym(dl, "ncclNetPlugin_v11"));
    CHILD_CHECK(t != nullptr);
    void* ctx = nullptr;
    ncclNetCommConfig_v11_t cfg{NCCL_NET_TRAFFIC_CLASS_UNDEF};
    CHILD_CHECK(t->init(&ctx, 1, &cfg, stderr_logger, nullptr) == ncclSuccess);
    CHILD_CHECK(t->finalize(ctx) == ncclSuccess);
    CHILD_CHECK(dlclose(dl) == 0);
    // The plugin's background thread keeps running; if the code were unmapped it would crash.
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, nullptr);
    return 0;
  });
  INFO("child output:\n" << r.output);
  CHECK(r.status == 0);
}

TEST_CASE("checked AllReduce through each net API version (r2ccl_perf)", "[abi]") {
  const std::string perf = env_or("R2CCL_TEST_PERF", "");
  REQUIRE_FALSE(perf.empty());
  for (int v : {8, 9, 10, 11}) {
    std::string out;
    std::string cmd =
        perf_command({{"R2CCL_SOCKET_IFNAME", kTwoRails}, {"R2CCL_LOG_FILE", "none"}},
                     "--ranks 2 --net-api " + std::to_string(v) + " -b 8 -e 4M -f 8 --check");
    int rc = run_command(cmd, &out);
    INFO("net API v" << v << ": " << cmd << "\n" << out);
    CHECK(rc == 0);
    CHECK(out.find("api: v" + std::to_string(v) + "  name: R2CCL") != std::string::npos);
    std::vector<PerfRow> rows = perf_rows(out);
    std::vector<long long> sizes;
    for (const auto& row : rows) {
      sizes.push_back(row.size);
      INFO("size " << row.size);
      CHECK(row.wrong == "0");
    }
    CHECK(sizes == std::vector<long long>{8, 64, 512, 4096, 32768, 262144, 2097152});
    CHECK(out.find("# wrong total: 0") != std::string::npos);
  }
}

namespace {

// Runs init (v11) in a child with `env`; the child's exit status is init's result.
ChildResult init_child(const std::map<std::string, std::string>& env, double* init_seconds) {
  std::string timing = temp_path("init-seconds");
  ChildResult r = run_child(env, [timing] {
    void* dl = open_plugin_or_die();
    auto* t = static_cast<const ncclNet_v11_t*>(dlsym(dl, "ncclNetPlugin_v11"));
    if (!t) return 90;
    void* ctx = nullptr;
    ncclNetCommConfig_v11_t cfg{NCCL_NET_TRAFFIC_CLASS_UNDEF};
    double t0 = mono_s();
    ncclResult_t res = t->init(&ctx, 1, &cfg, stderr_logger, nullptr);
    double dt = mono_s() - t0;
    if (FILE* f = fopen(timing.c_str(), "w")) {
      fprintf(f, "%f\n", dt);
      fclose(f);
    }
    if (res == ncclSuccess) {
      int ndev = -1;
      if (t->devices(&ndev) != ncclSuccess) return 80;
      printf("devices: %d\n", ndev);
    }
    t->finalize(ctx);  // NCCL calls finalize even after a failed init
    return static_cast<int>(res);
  });
  *init_seconds = atof(read_file(timing).c_str());
  unlink(timing.c_str());
  return r;
}

}  // namespace

TEST_CASE("bad configuration fails init with a message naming the variable", "[abi]") {
  double secs = 0;
  SECTION("R2CCL_CHUNK_SIZE=1 is out of range: ncclInvalidUsage") {
    ChildResult r =
        init_child({{"R2CCL_SOCKET_IFNAME", kTwoRails}, {"R2CCL_CHUNK_SIZE", "1"}}, &secs);
    INFO("child output:\n" << r.output);
    CHECK(r.status == ncclInvalidUsage);
    CHECK(count_lines_containing(r.output, "R2CCL_CHUNK_SIZE") >= 1);
  }
  SECTION("R2CCL_SOCKET_IFNAME=nosuchif0: init fails fast") {
    ChildResult r = init_child({{"R2CCL_SOCKET_IFNAME", "nosuchif0"}}, &secs);
    INFO("child output:\n" << r.output << "init took " << secs << " s");
    CHECK(r.status != 0);
    CHECK(r.status < 80);  // an ncclResult_t, not a crash or a harness failure
    CHECK(secs < 5.0);
    CHECK(count_lines_containing(r.output, "R2CCL_SOCKET_IFNAME") >= 1);
    CHECK(count_lines_containing(r.output, "nosuchif0") >= 1);
  }
  SECTION("unknown R2CCL_BOGUS=1: a warning naming it, init succeeds") {
    ChildResult r = init_child({{"R2CCL_SOCKET_IFNAME", kTwoRails}, {"R2CCL_BOGUS", "1"}}, &secs);
    INFO("child output:\n" << r.output);
    CHECK(r.status == ncclSuccess);
    CHECK(r.output.find("devices: 2") != std::string::npos);
    bool warned = false;
    std::istringstream in(r.output);
    std::string line;
    while (std::getline(in, line))
      warned |=
          line.find("WARN") != std::string::npos && line.find("R2CCL_BOGUS") != std::string::npos;
    CHECK(warned);
  }
}
