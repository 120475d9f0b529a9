// The full matrix of fault-free verbs data-path shapes on the fake (label long;
// scripts/test.sh --long): chunk sizes 4 KiB .. 64 MiB in powers of 4 x 1, 4 and 16 QPs per
// path x adaptive routing on and off (the CI subset is in tests/loopback/test_ib_fake.cc),
// once as the fake delivers, once with random per-packet delays at the target.
#include "support/data_shapes.h"

using namespace r2ccl::test;

namespace {

// Every shape as a SECTION, each checked with `extra` in both processes' environment.
void every_shape(const std::map<std::string, std::string>& extra) {
  if (fake_verbs_lib().empty()) {
    WARN("R2CCL_TEST_FAKEVERBS is not set (run through ctest)");
    return;
  }
  for (size_t chunk = 4096; chunk <= 64ull << 20; chunk *= 4)
    for (int qps : {1, 4, 16})
      for (bool ar : {false, true}) {
        const DataShape s{chunk, qps, ar};
        SECTION(shape_text(s)) { check_shape_clean(s, extra); }
      }
}

}  // namespace

TEST_CASE("long: every verbs data-path shape on the fake streams intact, no path fails", "[long]") {
  every_shape({});
}

TEST_CASE(
    "long: every verbs data-path shape with random per-packet delays at the target (seeded "
    "FAKEVERBS_DELAY_US): intact, no path fails",
    "[long]") {
  every_shape({{"FAKEVERBS_DELAY_US", "3000"}});
}
