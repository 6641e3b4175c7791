#!/usr/bin/env bash
# One CI leg per Kokkos backend, on top of scripts/build_kokkos.sh (which builds Kokkos 3.4.01 +
# Kokkos Kernels from Debian's trilinos source into a cache outside the clone, once).
#
# Usage: scripts/test_backend.sh <openmp|cuda> [extra cmake args]
#   openmp: configures kfac against the OpenMP prefix in build-openmp, builds the tests, examples
#           and benchmarks, and runs the whole suite with OMP_NUM_THREADS=2 (the MPI tests get one
#           thread per rank from CMake). test_backend_equivalence compares Kokkos::OpenMP with
#           Kokkos::Serial in one binary.
#   cuda:   configures against the CUDA prefix in build-cuda (nvcc_wrapper, -arch=sm_80, warnings
#           as errors in kfac's own targets) and builds the tests, examples and benchmarks:
#           compile and link only, nothing runs (no GPU on the CI machine).
# KFAC_BACKEND_BUILD_DIR overrides the build folder; KFAC_BUILD_JOBS (default 2) the parallelism;
# KFAC_BACKEND_TARGETS (space-separated) builds only those targets instead of everything.
# Compiles go through ccache (scripts/ccache.sh; KFAC_CCACHE=0 compiles without it).
# Each phase's wall time is printed as "test_backend: <backend> <phase> <seconds> s".
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
backend=${1:-}
case "$backend" in
  openmp | cuda) ;;
  *) echo "usage: $0 <openmp|cuda> [extra cmake args]" >&2; exit 64 ;;
esac
shift
jobs=${KFAC_BUILD_JOBS:-2}
build=${KFAC_BACKEND_BUILD_DIR:-$root/build-$backend}
log() { echo "test_backend: $*" >&2; }
phase_start=$(date +%s)
phase() { local now; now=$(date +%s); log "$backend $1 $((now - phase_start)) s"; phase_start=$now; }
leg_start=$phase_start

"$root/scripts/install_deps.sh"
prefix=$("$root/scripts/build_kokkos.sh" "$backend" | tail -n 1)
phase kokkos

# The Python package is built and tested by the Serial suite (scripts/test.sh) only: it links
# the same kfac core, and an OpenMP or CUDA Kokkos inside the interpreter is not what its tests
# (which fork gloo workers) are written for.
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DKFAC_ENABLE_TESTS=ON
            -DKFAC_ENABLE_EXAMPLES=ON -DKFAC_ENABLE_BENCHMARKS=ON -DKFAC_ENABLE_PYTHON=OFF)
source "$root/scripts/ccache.sh"
cmake_args+=("${ccache_args[@]}")
[ ${#ccache_args[@]} -gt 0 ] && ccache --zero-stats > /dev/null
if [ "$backend" = cuda ]; then
  cuda_bin=$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")
  export PATH=$cuda_bin:$PATH
  # nvcc_wrapper defaults to sm_35, which CUDA 13 no longer has: CMake's compiler check needs the
  # architecture Kokkos was built for (Kokkos' targets add the same flag to every kfac target).
  cmake_args+=(-DCMAKE_CXX_COMPILER="$prefix/bin/nvcc_wrapper" -DCMAKE_CXX_FLAGS=-arch=sm_80
               -DKFAC_WARNINGS_AS_ERRORS=ON)
fi
# What each leg builds by default (the whole suite stays in the Serial leg, scripts/test.sh):
# OpenMP: the Serial-vs-OpenMP comparison of every policy combination, the MPI suite, deferred
#   decompositions on a second host thread next to OpenMP's, and the demo trained data-parallel.
# CUDA: three units that together compile every labelled kernel and allocation of include/kfac
#   (scripts/kernel_labels.sh checks it below): the backend comparison, the demo with the examples'
#   network library, and tests/kernel_coverage.cpp for the rest.
# KFAC_BACKEND_TARGETS overrides the list; KFAC_BACKEND_TARGETS=all builds everything.
openmp_targets="test_backend_equivalence test_mpi_distributed test_deferred examples_test_data_parallel"
cuda_targets="fashion_mnist kernel_coverage"
if [ "$backend" = openmp ]; then targets=${KFAC_BACKEND_TARGETS:-$openmp_targets}; else targets=${KFAC_BACKEND_TARGETS:-$cuda_targets}; fi
# The chosen targets build side by side as the dependencies of one target, kfac_target_set.
if [ "$targets" = all ]; then cmake_args+=(-DKFAC_TARGET_SET=); else cmake_args+=("-DKFAC_TARGET_SET=$(echo $targets | tr ' ' ';')"); fi
cmake -S "$root" -B "$build" "${cmake_args[@]}" "$@"
phase configure
if [ "$targets" = all ]; then
  cmake --build "$build" -j "$jobs"
else
  cmake --build "$build" -j "$jobs" --target kfac_target_set
fi
phase build
if [ ${#ccache_args[@]} -gt 0 ]; then
  log "$backend ccache: $(ccache --print-stats | awk -F'\t' '$1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" {h += $2} $1 == "cache_miss" {m = $2} END {print h + 0 " hits, " m + 0 " misses"}')"
fi

if [ "$backend" = openmp ]; then
  cd "$build"
  only=()
  # Each target's tests: its own name and the MPI tests' rank counts, as in scripts/sanitize.sh
  # (not other executables that share a prefix).
  # shellcheck disable=SC2086
  [ "$targets" = all ] || only=(-R "^($(echo $targets | tr ' ' '|'))(_thread_single)?(_np[0-9]+)?\$")
  OMP_NUM_THREADS=2 OMP_PROC_BIND=false ctest --output-on-failure -j "${KFAC_TEST_JOBS:-1}" "${only[@]}"
  phase ctest
else
  built=()
  if [ "$targets" = all ]; then
    mapfile -t built < <(bash "$root/scripts/kernel_labels.sh" executables "$build")
  else
    # shellcheck disable=SC2086
    for t in $targets; do
      f=$(find "$build" -type f -name "$t" -perm -u+x | head -n 1)
      [ -n "$f" ] || { log "cuda: $t was not built"; exit 1; }
      built+=("$f")
    done
  fi
  serial=${KFAC_BUILD_DIR:-$root/build}  # scripts/test.sh's build, which CI runs first
  if [ -n "${KFAC_BACKEND_TARGETS:-}" ] && [ "$targets" != all ]; then
    log "cuda: KFAC_BACKEND_TARGETS given: kernel labels not checked"
  elif [ -d "$serial/tests" ]; then
    bash "$root/scripts/kernel_labels.sh" check "$serial" "${built[@]}"
  else
    log "cuda: no Serial build in $serial to compare kernel labels with (run scripts/test.sh first): not checked"
  fi
  log "cuda: built (compile and link only); nothing runs without a GPU"
fi
log "$backend leg done in $(($(date +%s) - leg_start)) s"
