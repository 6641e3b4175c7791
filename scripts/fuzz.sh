#!/usr/bin/env bash
# Builds the checkpoint-loader fuzzer (libFuzzer + ASan + UBSan, clang++) and runs it for a
# bounded time on a copy of the seed corpus fuzz/corpus. Exits non-zero when it finds a crash,
# a sanitizer report, a leak, a timeout or an oversized allocation; the input that caused it is
# left in $KFAC_FUZZ_BUILD_DIR/artifacts (rerun it with: <build>/checkpoint_fuzzer <file>).
#
# Usage: scripts/fuzz.sh [seconds]      fuzz for `seconds` (default 60)
#        scripts/fuzz.sh --make-corpus   rebuild fuzz/corpus from fuzz/make_corpus.cpp, plus the
#                                        v1 checkpoints of tests/fixtures/checkpoint_v1 as v1_*
#   KFAC_FUZZ_BUILD_DIR    build folder (default: build-fuzz)
#   KFAC_FUZZ_INCLUDE_DIR  kfac headers to fuzz (default: include; for trying a patch)
#   CXX                    compiler (default: clang++-14, else clang++)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_FUZZ_BUILD_DIR:-$root/build-fuzz}
include=${KFAC_FUZZ_INCLUDE_DIR:-$root/include}
cxx=${CXX:-$(command -v clang++-14 || command -v clang++ || true)}
[ -n "$cxx" ] || { echo "kfac fuzz: clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 2; }
mkdir -p "$build"

flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -Wall -Wextra -Wpedantic
  -fno-sanitize-recover=undefined -DKFAC_HAVE_LAPACK=1
  -I"$root/fuzz" -I"$include" -I/usr/include/trilinos -isystem /usr/include/eigen3
  -I/usr/include/"$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)")
libs=(-ltrilinos_kokkoskernels -ltrilinos_kokkoscore -llapacke -lopenblas -ldl)

# Rebuilds $1 from $2 unless it is newer than the sources and headers it depends on.
build_one() {
  local out=$1 src=$2 sanitize=$3
  if [ -x "$out" ] && [ "$out" -nt "$root/fuzz/checkpoint_fuzz_common.hpp" ] && [ "$out" -nt "$src" ] &&
     [ -z "$(find "$include/kfac" -newer "$out" -name '*.hpp' -print -quit)" ] &&
     [ "$(cat "$out.flags" 2>/dev/null)" = "$cxx ${flags[*]}" ]; then
    return
  fi
  echo "kfac fuzz: compiling $(basename "$src") with $cxx"
  "$cxx" "${flags[@]}" "$sanitize" "$src" -o "$out" "${libs[@]}"
  echo "$cxx ${flags[*]}" > "$out.flags"
}

export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:report_error_type=1:${UBSAN_OPTIONS:-}"
export LSAN_OPTIONS="suppressions=$root/fuzz/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-}"

if [ "${1:-}" = "--make-corpus" ]; then
  build_one "$build/make_corpus" "$root/fuzz/make_corpus.cpp" -fsanitize=address,undefined
  rm -rf "$root/fuzz/corpus"
  mkdir -p "$root/fuzz/corpus"
  "$build/make_corpus" "$root/fuzz/corpus"
  # Format-version-1 checkpoints written by commit 1859ea4 (tests/fixtures/make_v1_fixtures.cpp):
  # today's code can no longer write them, so they are copied, not regenerated.
  for f in "$root"/tests/fixtures/checkpoint_v1/*.kfacckpt; do
    cp "$f" "$root/fuzz/corpus/v1_$(basename "$f" .kfacckpt)"
  done
  exit 0
fi

seconds=${1:-60}
build_one "$build/checkpoint_fuzzer" "$root/fuzz/checkpoint_fuzzer.cpp" -fsanitize=fuzzer,address,undefined
work="$build/corpus"
rm -rf "$work" "$build/artifacts"
mkdir -p "$work" "$build/artifacts"
cp "$root"/fuzz/corpus/* "$work"/
log="$build/fuzz.log"
echo "kfac fuzz: running for $seconds s on $(ls "$work" | wc -l) seeds (log: $log)"
set +e
started=$SECONDS
"$build/checkpoint_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -malloc_limit_mb=256 -print_final_stats=1 -dict="$root/fuzz/checkpoint.dict" \
  -artifact_prefix="$build/artifacts/" "$work" > "$log" 2>&1
rc=$?
elapsed=$((SECONDS - started))
set -e
tail -n 25 "$log"
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
crashes=$(find "$build/artifacts" -type f | wc -l)
echo "kfac fuzz: ${execs:-?} executions in $elapsed s (${rate:-?} exec/s), corpus $(ls "$work" | wc -l) inputs, crashes: $crashes, exit code $rc"
if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
  find "$build/artifacts" -type f -print | sed 's/^/kfac fuzz: failing input /'
  exit 1
fi
