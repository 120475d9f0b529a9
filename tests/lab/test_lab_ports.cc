// 1,000 communicators from one process to 4 peer processes over a 900-port ephemeral range, in
// a network namespace of the test's own (lab/port_scale.h says what it proves). About 4 s
// here, so it is in the regular lab suite, not the long one.
#include "lab/port_scale.h"

using namespace r2ccl::test;

TEST_CASE("ports: 1,000 connections from one process to 4 peers over a 900-port ephemeral range",
          "[lab][ports]") {
  port_scale_scenario(1000, 4, 900);
}
