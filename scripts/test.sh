#!/usr/bin/env bash
# Installs what is missing, builds kfac with its tests, examples and benchmarks, and runs the
# whole test suite under ctest, as many tests at once as the machine has cores (a test of several
# processes holds one core per process: PROCESSORS). Usage: scripts/test.sh [extra cmake args]
#   KFAC_TEST_JOBS  ctest's parallelism (default: nproc)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_BUILD_DIR:-$root/build}
"$root/scripts/install_deps.sh"
source "$root/scripts/ccache.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKFAC_ENABLE_TESTS=ON \
  -DKFAC_ENABLE_EXAMPLES=ON -DKFAC_ENABLE_BENCHMARKS=ON "${ccache_args[@]}" "$@"
cmake --build "$build" -j "$(nproc)"
cd "$build"
ctest --output-on-failure -j "${KFAC_TEST_JOBS:-$(nproc)}"
