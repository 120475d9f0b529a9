// Catch2 v2's implementation, compiled once for every test executable (r2ccl_catch_session).
// The mains (catch_main.cc, lab_main.cc, hw/hw_main.cc) call r2ccl_catch_run instead of
// compiling the implementation themselves: it is the costliest translation unit of the tests.
// Not built with the tests' precompiled catch.hpp: the implementation needs CATCH_CONFIG_RUNNER
// defined before the header.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "catch_run.h"

int r2ccl_catch_run(int argc, char** argv) { return Catch::Session().run(argc, argv); }
