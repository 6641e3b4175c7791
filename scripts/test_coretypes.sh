#!/usr/bin/env bash
# The CI leg "tests that hold on every kernel" (issue 46, tests/README.md): reruns the numerical
# tests of an existing Serial build under each OpenBLAS kernel family this CPU can execute
# (OPENBLAS_CORETYPE; Debian's OpenBLAS is a DYNAMIC_ARCH build), so that a comparison written
# against one family's rounding fails here and not on another machine. Nothing is rebuilt.
#
# Usage: scripts/test_coretypes.sh [extra ctest args]
#   KFAC_BUILD_DIR        the built tree (scripts/test.sh's, default $root/build)
#   KFAC_CORETYPES        the families to run (default: every one /proc/cpuinfo allows)
#   KFAC_CORETYPE_TESTS   ctest -R regex of the numerical tests (default below)
#   KFAC_TEST_JOBS        ctest's parallelism (default: nproc; MPI tests hold one core per rank)
# Exits non-zero, naming them, if any family fails or is not the one OpenBLAS then uses.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_BUILD_DIR:-$root/build}
if [ ! -f "$build/CTestTestfile.cmake" ]; then
  echo "test_coretypes.sh: no built test tree in $build (run scripts/test.sh first)" >&2
  exit 2
fi

# Which families the CPU can execute, from its flags: Prescott SSE3, Sandybridge AVX, Haswell
# AVX2 + FMA, SkylakeX AVX-512 F/BW/VL/DQ, Cooperlake also BF16, Zen an AMD CPU with AVX2.
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
vendor=$(grep -m1 '^vendor_id' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
has() {
  local f
  for f in "$@"; do [[ $flags == *" $f "* ]] || return 1; done
}
detected=()
has pni && detected+=(Prescott)  # SSE3 is "pni" in /proc/cpuinfo
has avx && detected+=(Sandybridge)
has avx2 fma && detected+=(Haswell)
has avx512f avx512bw avx512vl avx512dq && detected+=(SkylakeX)
has avx512f avx512bw avx512vl avx512dq avx512_bf16 && detected+=(Cooperlake)
[ "$vendor" = AuthenticAMD ] && has avx2 && detected+=(Zen)
read -r -a coretypes <<< "${KFAC_CORETYPES:-${detected[*]}}"
if [ "${#coretypes[@]}" = 0 ]; then
  echo "test_coretypes.sh: no OpenBLAS kernel family detected on this CPU" >&2
  exit 2
fi

# The numerical tests: every unit, MPI and example test whose results go through the BLAS, MPI
# ones at 2 ranks (test_mpi_restart at its only size, 4; examples_test_data_parallel, the most
# sensitive to the kernels, at 2 and 3). Left out: what does not compute (install_consumer,
# design_layout, api_docs*, the compile-fail tests refused_* and half_t_refused, the examples'
# command-line runs *_help, *_fresh_dir, *_stop_at_target*, *_recipe, *_strategy_auto), the
# Fashion-MNIST and Python runs, benchmark smokes and scaling runs (minutes each, no comparison
# across kernels), and MPI tests of timing or faults (watchdog, faults, the 8-rank load).
tests=${KFAC_CORETYPE_TESTS:-'^(test_(dense_preconditioning|randomized_eigen|half_precision|deferred|conv2d|batch_norm|schedules|large_batch|adapters|cost_model|checkpoint_v[12]|core|shampoo|ngsgd|ngsgd_kaldi|backend_equivalence|linalg|skip|reliability|torch_adapter)|test_mpi_(distributed|distributed_thread_single|cost_model|round_robin|core|parameter_averager|comm_precision|shampoo|skip|pipeline)_np2|test_mpi_restart_np4|test_torch_mpi_np2|examples_test_(idx_reader|layers|training|ngsgd_training)|examples_test_(fdg_stage|parameter_averaging)_np2|examples_test_data_parallel_np[23])$'}

# A probe that loads OpenBLAS: any test executable, listing its tests.
probe=$build/tests/test_linalg
[ -x "$probe" ] || probe=

failed=()
summary=()
for c in "${coretypes[@]}"; do
  if [ -n "$probe" ]; then
    out=$(OPENBLAS_VERBOSE=2 OPENBLAS_CORETYPE=$c "$probe" --list-test-names-only 2>&1 || true)
    used=$(awk '/^Core:/ { print $2; exit }' <<< "$out")
    if [ "$used" != "$c" ]; then
      echo "test_coretypes.sh: OPENBLAS_CORETYPE=$c gave OpenBLAS core '$used'" >&2
      failed+=("$c (OpenBLAS used '$used')")
      continue
    fi
  fi
  echo "== OPENBLAS_CORETYPE=$c"
  start=$(date +%s)
  rc=0
  (cd "$build" && OPENBLAS_CORETYPE=$c ctest --output-on-failure -j "${KFAC_TEST_JOBS:-$(nproc)}" -R "$tests" "$@") || rc=$?
  seconds=$(($(date +%s) - start))
  if [ "$rc" = 0 ]; then summary+=("$c: passed in ${seconds} s"); else
    summary+=("$c: FAILED in ${seconds} s")
    failed+=("$c")
  fi
done

echo "== test_coretypes.sh, per OpenBLAS kernel family:"
printf '  %s\n' "${summary[@]}"
if [ "${#failed[@]}" != 0 ]; then
  echo "test_coretypes.sh: failed under: ${failed[*]}" >&2
  exit 1
fi
