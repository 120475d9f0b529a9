// The 60 s version of the random-toggle lab test (label long; scripts/test.sh --long): over a
// minute of random flaps the hold-down must engage and grow, with no error and no lost byte.
#include "lab/lab_util.h"

using namespace r2ccl::test;

TEST_CASE("long: a rail toggled at random for 60 s: no errors, hold-down engages repeatedly",
          "[long]") {
  random_toggle_scenario(60, 2);
}
