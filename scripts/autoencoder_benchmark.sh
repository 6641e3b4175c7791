#!/usr/bin/env bash
# Deep-autoencoder benchmark (issue 44 item 4; docs/self_tuning.md, "Autoencoder benchmark"): the
# network of Hinton & Salakhutdinov 2006 as Martens & Grosse 2015 train it, on Fashion-MNIST's
# training images (examples/autoencoder), every run on the same budget of training seconds:
# SGD with momentum and Adam, each swept over 5 learning rates, K-FAC swept over learning rate
# and damping, and self-tuned K-FAC (kfac::SelfTuning's defaults: one configuration, no sweep).
# The sweeps run at seed 1; each optimizer's best configuration (lowest final training error)
# then runs at the other seeds. Writes OUT/{runs.csv,summary.md,error_steps.svg,error_time.svg}
# and prints one "target ...: MET | MISSED by x | NOT MEASURED (why)" line per target
# (scripts/autoencoder_report.py).
#
#   bash scripts/autoencoder_benchmark.sh --quick   1 seed, 12 s per run, the middle 3 rates of SGD and Adam,
#                                                   2000 images evaluated (11 runs, < 5 min)
#   bash scripts/autoencoder_benchmark.sh           3 seeds, 180 s per run (23 runs, about 75 min on 2 cores)
# Options: --out DIR (default results/autoencoder), --budget S, --seeds N, --threads N (default 2).
# KFAC_BUILD_DIR: the build folder holding examples/autoencoder (built there when missing).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_BUILD_DIR:-$root/build}
out=$root/results/autoencoder
quick=0 budget=180 seeds=3 threads=2 evals=30 eval_subset=10000
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 budget=12 seeds=1 evals=10 eval_subset=2000 ;;
    --out) out=$2; shift ;;
    --budget) budget=$2; shift ;;
    --seeds) seeds=$2; shift ;;
    --threads) threads=$2; shift ;;
    *) echo "autoencoder_benchmark.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
program=$build/examples/autoencoder
if [ ! -x "$program" ]; then
  source "$root/scripts/ccache.sh"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${ccache_args[@]}" > /dev/null
  cmake --build "$build" -j "$(nproc)" --target autoencoder
fi
mkdir -p "$out"
runs=$out/runs.csv
rm -f "$runs"
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads

sgd_rates=(0.001 0.003 0.01 0.03 0.1)
adam_rates=(1e-4 3e-4 1e-3 3e-3 1e-2)
if [ "$quick" = 1 ]; then  # the middle three: what fits under 5 minutes with a start-up and 11 evaluations per run
  sgd_rates=("${sgd_rates[@]:1:3}")
  adam_rates=("${adam_rates[@]:1:3}")
fi
kfac_configs=("0.1 0.1" "0.3 0.1" "0.1 1" "0.3 1")  # K-FAC tuned: "lr damping"
run() {  # run SEED ARGS...: one run, its rows appended to runs.csv
  local seed=$1
  shift
  "$program" --seed "$seed" --budget "$budget" --evals "$evals" --eval-subset "$eval_subset" --threads "$threads" \
    --out "$runs" "$@" | grep '^#' || true
}
configs=()
for lr in "${sgd_rates[@]}"; do configs+=("--optimizer sgd --lr $lr"); done
for lr in "${adam_rates[@]}"; do configs+=("--optimizer adam --lr $lr"); done
for c in "${kfac_configs[@]}"; do
  set -- $c
  configs+=("--optimizer kfac --lr $1 --damping $2")
done
configs+=("--optimizer kfac --adaptive")
echo "sweep at seed 1: ${#configs[@]} runs of ${budget} s"
for c in "${configs[@]}"; do
  # shellcheck disable=SC2086
  run 1 $c
done
if [ "$seeds" -gt 1 ]; then
  best=$(/usr/bin/python3 "$root/scripts/autoencoder_report.py" --best "$runs")
  echo "best configurations at seed 1, run at seeds 2..$seeds:"
  echo "$best"
  while read -r args; do
    for seed in $(seq 2 "$seeds"); do
      # shellcheck disable=SC2086
      run "$seed" $args
    done
  done <<< "$best"
fi
/usr/bin/python3 "$root/scripts/autoencoder_report.py" "$runs" --out "$out" --seeds "$seeds" --budget "$budget" \
  $([ "$quick" = 1 ] && echo --quick)
