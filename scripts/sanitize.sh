#!/usr/bin/env bash
# Builds the test suite with AddressSanitizer + UndefinedBehaviorSanitizer (KFAC_ENABLE_SANITIZERS)
# in its own build folder and runs it under ctest. Any sanitizer report fails the run: ASan and
# UBSan halt on the first error, UBSan is compiled with -fno-sanitize-recover, and LeakSanitizer
# is on, with fuzz/lsan.supp silencing only leaks allocated inside third-party libraries.
#
# Usage: scripts/sanitize.sh [extra cmake args]
#   KFAC_ASAN_BUILD_DIR  build folder (default: build-asan)
#   KFAC_BUILD_JOBS      parallel compile jobs (default: nproc; each TU needs ~2 GB)
#   KFAC_TEST_JOBS       parallel ctest jobs (default: 1)
#   KFAC_ASAN_MPI        1 (default) runs the MPI tests under ASan too; 0 leaves them out
#   KFAC_ASAN_TESTS      the test executables built and run (default: the representative set
#                        below); "all" builds and runs the whole suite
#
# The default set (CI's leg; the whole suite runs without sanitizers in scripts/test.sh, and
# KFAC_ASAN_TESTS=all runs all of it here): every method and layer against the dense reference,
# the bad-input catalogue (refusals that must leave the state unchanged), deferred decompositions
# on a second thread, and the MPI fault suite (abandoned collectives, late and failing ranks).
# Four executables, not fifteen: each compiles in about two minutes of CPU under the sanitizers,
# and the leg is part of CI's 45-minute budget.
#
# The MPI tests (test_mpi_faults at 2-4 ranks) run under ASan: Open MPI's own allocations
# that outlive MPI_Finalize are suppressed by library name in fuzz/lsan.supp, which needs full
# allocation stacks (fast_unwind_on_malloc=0: Debian's libraries have no frame pointers).
#
# Not built here: the LibTorch adapter's tests (KFAC_ENABLE_TORCH=OFF): Debian's LibTorch is not
# built with the sanitizers and the adapter's tests have not been verified under them yet; the
# Serial suite (scripts/test.sh) runs them.
# Not run here: install_consumer (it installs and rebuilds an outside project without
# sanitizers, which tests packaging, not memory safety; scripts/test.sh runs it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_ASAN_BUILD_DIR:-$root/build-asan}
start=$(date +%s)
"$root/scripts/install_deps.sh"
source "$root/scripts/ccache.sh"

# -O0 -g1: full sanitizer coverage, and stacks with function, file and line (-g1 keeps the line
# tables, not the variables' debug info: test_core.cpp compiled in 33 s instead of 45 s with -g,
# 2026-12-04); -O0 compiles in a third less CPU time than -O1 (test_errors.cpp: 43 s against
# 64 s, 2026-12-06), and KFAC_TEST_OPTIMIZATION is emptied so that the tests keep it. NDEBUG is left
# undefined on purpose, so Eigen's and kfac's own assertions are live too. GCC 12 with
# -fsanitize=address gives false -Wmaybe-uninitialized warnings inside libstdc++'s <regex>
# (which Catch2 uses), so that one warning is off in this build only.
tests=${KFAC_ASAN_TESTS:-test_dense_preconditioning test_errors test_deferred test_mpi_faults}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -g1" -DKFAC_TEST_OPTIMIZATION= -DCMAKE_CXX_FLAGS="-Wno-maybe-uninitialized" \
  -DKFAC_ENABLE_SANITIZERS=ON -DKFAC_ENABLE_TESTS=ON \
  -DKFAC_ENABLE_EXAMPLES=OFF -DKFAC_ENABLE_BENCHMARKS=OFF -DKFAC_ENABLE_TORCH=OFF "${ccache_args[@]}" \
  "-DKFAC_TARGET_SET=$([ "$tests" = all ] || echo $tests | tr ' ' ';')" "$@"
if [ "$tests" = all ]; then
  cmake --build "$build" -j "${KFAC_BUILD_JOBS:-$(nproc)}"
else  # side by side, as the dependencies of one target (CMakeLists.txt, kfac_target_set)
  cmake --build "$build" -j "${KFAC_BUILD_JOBS:-$(nproc)}" --target kfac_target_set
fi
built=$(date +%s)

export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:exitcode=23:detect_leaks=1:fast_unwind_on_malloc=0:strict_string_checks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:report_error_type=1:exitcode=24:${UBSAN_OPTIONS:-}"
export LSAN_OPTIONS="suppressions=$root/fuzz/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-}"

exclude='^install_consumer$'
[ "${KFAC_ASAN_MPI:-1}" = 0 ] && exclude='^(install_consumer|test_mpi_.*)$'
cd "$build"
only=()
# Each named executable's tests: its own name, and the MPI tests' rank counts (_np2, ...,
# _thread_single_np2, ...), not other executables that share a prefix (test_ngsgd_kaldi).
# shellcheck disable=SC2086
[ "$tests" = all ] || only=(-R "^($(echo $tests | tr ' ' '|'))(_thread_single)?(_np[0-9]+)?\$")
ctest --output-on-failure -j "${KFAC_TEST_JOBS:-1}" -E "$exclude" "${only[@]}"
end=$(date +%s)
echo "kfac sanitize: build $((built - start)) s, tests $((end - built)) s, total $((end - start)) s"
