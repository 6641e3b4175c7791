#!/usr/bin/env bash
# Time-to-accuracy benchmark (issue 27): the quickstart's comparison (Fashion-MNIST MLP, batch
# 256, 8 epochs, seeds 1-3, the quickstart's 2 BLAS threads) for SGD, Adam, K-FAC with exact
# damped inverses (--inverse cholesky), K-FAC with randomized low-rank factors (--inverse
# randomized) and NG-SGD, each optimizer at its default settings, from the same initialisations
# and batch orders. Prints one table of epochs to the target accuracy, seconds per epoch, time to
# target, final accuracy and their ratios to SGD, then one line per target of the issue ("target
# ...: MET" or "MISSED by ..."). docs/benchmarks.md has the figures of a run on a quiet machine.
#
#   bash scripts/time_to_accuracy.sh                  about 5 minutes on 2 cores
#   bash scripts/time_to_accuracy.sh --seeds 1 --epochs 3   a shorter look
# Options: --out DIR (default results/time_to_accuracy), --threads N (default 2), --seeds A,B,..
# (default 1,2,3), --epochs N (default 8), --rank R (the low-rank run's rank, default the demo's
# 32; the run is then named kfac+rankRf).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_BUILD_DIR:-$root/build}
out=$root/results/time_to_accuracy
threads=2
seeds=1,2,3
epochs=8
rank=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift ;;
    --threads) threads=$2; shift ;;
    --seeds) seeds=$2; shift ;;
    --epochs) epochs=$2; shift ;;
    --rank) rank=(--rank "$2"); shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "time_to_accuracy.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ ! -x "$build/examples/fashion_mnist" ] || [ ! -f "$build/CMakeCache.txt" ]; then
  "$root/scripts/install_deps.sh"
  source "$root/scripts/ccache.sh"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKFAC_ENABLE_EXAMPLES=ON "${ccache_args[@]}" >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target fashion_mnist >/dev/null
rm -rf "$out"
mkdir -p "$out"
common=(--epochs "$epochs" --seeds "$seeds" --threads "$threads" --eval-every 20 --model-figures defaults --out "$out")
run() {  # what, then the demo's flags
  local what=$1; shift
  echo "== $what" >&2
  "$build/examples/fashion_mnist" "${common[@]}" "$@" >>"$out/stdout.txt" 2>&1
}
run "SGD, Adam, NG-SGD" --optimizer sgd,adam,ngsgd
run "K-FAC, exact damped inverses (kfac+cholesky)" --optimizer kfac --inverse cholesky --append
run "K-FAC, randomized low-rank factors (the demo's default)" --optimizer kfac --inverse randomized "${rank[@]}" --append
python3 "$root/scripts/time_to_accuracy_report.py" "$out" --epochs "$epochs" | tee "$out/report.txt"
