// Catch2 v2 main for the rdma suite (real InfiniBand/RoCE hardware): exits 77 (ctest
// SKIP_RETURN_CODE) unless the real verbs library lists an HCA with an active port.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "catch_run.h"
#include "r2ccl/params.h"
#include "transport/ib/devices.h"
#include "transport/ib/verbs_api.h"

int main(int argc, char** argv) {
  std::string err;
  const char* lib = getenv("R2CCL_IBVERBS_LIB");
  const auto* v = r2ccl::net::ib::VerbsApi::load(lib && *lib ? lib : "libibverbs.so.1", &err);
  if (!v) {
    fprintf(stderr, "rdma tests need libibverbs: %s: skipped\n", err.c_str());
    return 77;
  }
  const r2ccl::Config* cfg = nullptr;
  if (!r2ccl::process_config(&cfg, &err)) {
    fprintf(stderr, "rdma tests: %s\n", err.c_str());
    return 2;
  }
  std::unique_ptr<r2ccl::net::ib::HcaSet> set;
  if (!r2ccl::net::ib::HcaSet::discover(v, *cfg, &set, &err)) {
    fprintf(stderr, "rdma tests: %s\n", err.c_str());
    return 2;
  }
  if (!set->any_active()) {
    fprintf(stderr, "rdma tests need an HCA with an active port (%zu ports found): skipped\n",
            set->hcas().size());
    return 77;
  }
  set.reset();
  return r2ccl_catch_run(argc, argv);
}
