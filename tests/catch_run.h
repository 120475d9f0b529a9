// Runs the Catch2 session (command line, registered tests, reporters); returns main's exit code.
// Defined once in catch_session.cc, where Catch2's implementation is compiled.
#pragma once

int r2ccl_catch_run(int argc, char** argv);
