#!/usr/bin/env bash
# Which of kfac's labelled kernels and allocations (the "kfac::<area>::<op>" strings under
# include/kfac) a set of built executables instantiated: a label's string is in a binary only
# when the template that holds it was compiled there. The CUDA leg uses it to show that its few
# nvcc units compile every kernel that the whole Serial suite compiles (scripts/test_backend.sh).
# g++ may build a short label's std::string from immediates instead of the literal, so a label can
# be compiled yet invisible: the check therefore compares with the labels visible in a reference
# build (the Serial leg's, same compiler and flags), not with the source.
#
# Usage: scripts/kernel_labels.sh check <reference build dir> <file>...
#            exits 1 and lists every label of include/kfac that some executable of the reference
#            build holds and none of the files does (labels of host-only code excepted, below)
#        scripts/kernel_labels.sh cover <file>...   a greedy cover: the fewest files, in order,
#                                                   whose labels together are the union of all
#        scripts/kernel_labels.sh list <file>       the labels one file holds
#        scripts/kernel_labels.sh executables <dir> the suite's executables in a build folder
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:-}
shift || true
[ $# -gt 0 ] || { echo "usage: $0 <check|cover|list> <file>..." >&2; exit 64; }

# Labels of host-only code, not compiled for a device backend: kfac::comm::in_flight is the
# staging of factor sums that overlap the preconditioning, which runs only where the execution
# space is host accessible (KaisaState::overlaps_sums(); on a device the sums block).
host_only=${KFAC_HOST_ONLY_LABELS-kfac::comm::in_flight}

# The suite's executables in a build folder: tests, example tests, benchmarks, the demos.
executables() { find "$1" -type f -perm -u+x \( -name 'test_*' -o -name 'examples_*' -o -name 'bench*' -o -name '*fashion_mnist' \); }
library_labels() {
  grep -rhoE '"kfac::[a-z_0-9]+::[a-z_0-9:]+"' "$root/include/kfac" | tr -d '"' | sort -u
}
# The library's labels a file holds. g++ often builds a label's std::string without its literal,
# from 16-byte constants and 8-byte immediates (bytes 0-15 or 0-7, then on from there; the last
# piece may overlap the one before it, or be 4 bytes or fewer): a label counts as held when the
# whole string is there, or pieces of it that cover it that way.
pieces='{ n = length($0); k = 0; p[++k] = $0
  for (i = 1; i <= n; i += 8) { if (i + 15 <= n) p[++k] = substr($0, i, 16); if (i + 7 <= n) p[++k] = substr($0, i, 8) }
  if (n >= 16) p[++k] = substr($0, n - 15); if (n >= 8) p[++k] = substr($0, n - 7) }'
lib=$(library_labels)
lib_pieces=$(awk "$pieces"' { for (j = 1; j <= k; ++j) print p[j] }' <<< "$lib")
labels_in() {
  local found
  found=$(grep -aoF -f <(echo "$lib_pieces") "$1" | sort -u || true)
  awk 'NR == FNR { f[$0] = 1; next }
       { n = length($0); if ($0 in f) { print; next }
         for (i = 1; ; ) {
           rem = n - i + 1
           if (rem <= 4) { print; break }
           if (rem >= 16 && (substr($0, i, 16) in f)) { i += 16; continue }
           if (rem < 16 && n >= 16 && (substr($0, n - 15) in f)) { print; break }
           if (rem >= 8 && (substr($0, i, 8) in f)) { i += 8; continue }
           if (rem < 8 && (substr($0, n - 7) in f)) { print; break }
           break
         } }' <(echo "$found") <(echo "$lib")
}

case "$mode" in
  list) labels_in "$1" ;;
  executables) executables "$1" ;;
  check)
    ref=$1
    shift
    mapfile -t ref_files < <(executables "$ref")
    [ ${#ref_files[@]} -gt 0 ] || { echo "kernel_labels: no executables in the reference build $ref" >&2; exit 2; }
    have=$(for f in "$@"; do labels_in "$f"; done | sort -u)
    want=$(comm -12 <(echo "$lib") <(for f in "${ref_files[@]}"; do labels_in "$f"; done | sort -u))
    missing=$(comm -23 <(echo "$want") <(echo "$have"))
    for h in $host_only; do missing=$(echo "$missing" | grep -vx "$h" || true); done
    total=$(echo "$want" | wc -l)
    if [ -n "$missing" ]; then
      echo "kernel_labels: $(echo "$missing" | wc -l) of the $total labels of include/kfac in $ref are in none of the $# files:" >&2
      echo "$missing" | sed 's/^/  /' >&2
      exit 1
    fi
    echo "kernel_labels: the $# files hold all $total labels of include/kfac that $ref's executables hold${host_only:+ (host-only, not checked: $host_only)}"
    ;;
  cover)
    declare -A set
    for f in "$@"; do set[$f]=$(labels_in "$f" | tr '\n' ' '); done
    want=$(for f in "$@"; do labels_in "$f"; done | sort -u)
    covered=""
    while :; do
      best="" best_n=0
      for f in "$@"; do
        n=$(comm -23 <(echo "${set[$f]}" | tr ' ' '\n' | grep . | sort -u) <(echo "$covered" | tr ' ' '\n' | grep . | sort -u) | wc -l)
        if [ "$n" -gt "$best_n" ]; then best=$f best_n=$n; fi
      done
      [ -n "$best" ] || break
      echo "$best +$best_n"
      covered="$covered ${set[$best]}"
    done
    echo "cover: $(echo "$covered" | tr ' ' '\n' | grep . | sort -u | wc -l) of $(echo "$want" | grep -c .) labels"
    ;;
  *) echo "usage: $0 <check|cover|list> <file>..." >&2; exit 64 ;;
esac
