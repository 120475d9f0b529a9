// Catch2 v2 main for the unit, abi and loopback suites.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
