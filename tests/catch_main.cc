// Catch2 v2 main for the unit, abi and loopback suites: CATCH_CONFIG_MAIN's main, with the
// implementation compiled once in catch_session.cc.
#include "catch_run.h"

int main(int argc, char** argv) { return r2ccl_catch_run(argc, argv); }
