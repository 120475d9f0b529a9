# Sourced (not run) by the scripts that configure a build directory: their cmake options, in
# one place.
#   R2CCL_BUILD_OPTS       build/, the main build: test.sh builds everything there, demo.sh and
#                          the bench_*.sh scripts the targets they run (configured only when
#                          missing). One set of options for all of them: configuring build/
#                          with others (another build type) would recompile everything there.
#                          Release (-O3, no debug info: the quickest full build here, see
#                          docs/BENCHMARKS.md "Build time"), warnings as errors (R2CCL_WERROR
#                          is off by default, for users' compilers; on for developers and CI).
#   R2CCL_ASAN_BUILD_OPTS  build-asan/ (test.sh): AddressSanitizer + UBSan, Debug (-O0 -g,
#                          assertions on). Not -O1, although its tests would run faster: with the
#                          sanitizers GCC 12 compiles 2-3x slower at -O1 than at -O0 here, and
#                          this build is the test command's longest phase; -g costs ~5 %.
#   R2CCL_CUDA_BUILD_OPTS  build-cuda/ (test.sh, compile only where a CUDA toolkit is installed).
R2CCL_BUILD_OPTS=(-DCMAKE_BUILD_TYPE=Release -DR2CCL_WERROR=ON)
R2CCL_ASAN_BUILD_OPTS=(-DCMAKE_BUILD_TYPE=Debug -DSANITIZE=address,undefined -DR2CCL_WERROR=ON)
R2CCL_CUDA_BUILD_OPTS=(-DCMAKE_BUILD_TYPE=Release -DR2CCL_WERROR=ON -DUSE_CUDA=ON
                       -DR2CCL_BUILD_TESTS=OFF)
