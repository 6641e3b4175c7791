#!/usr/bin/env bash
# Batch-scaling benchmark (issue 30): epochs, steps and time to a test accuracy for SGD, Adam
# and K-FAC as the batch grows, each optimizer under the large-batch recipe (--recipe
# large-batch: K-FAC under kfac::recipes::large_batch, SGD and Adam with its learning-rate
# plan), from the same initialisations and batch orders. Builds the Fashion-MNIST example it
# needs, writes one table, a plot of epochs to target against the batch, and ends with one line
# per target of the issue: "target ...: MET", "MISSED by ..." or "NOT MEASURED".
#
#   bash scripts/batch_scaling.sh --quick   MLP at batches 256 and 4096, seed 1 (about 2 minutes)
#   bash scripts/batch_scaling.sh           MLP at 256, 1024, 4096, 16384 (a sweep of 3 rates per
#                                           optimizer on seed 1, seeds 2 and 3 at the best); the
#                                           CNN at 4096 (2 rates for SGD and K-FAC, 1 for Adam, on
#                                           seed 1; seeds 2 and 3 at the best) and at 256 (seed 1,
#                                           one rate each, each run ended at 91%): under 2 hours on
#                                           2 cores (see docs/large_batch.md)
# Options: --out DIR (default results/batch_scaling), --threads N (BLAS threads, default 2).
# docs/large_batch.md explains the recipe and the figures.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_BUILD_DIR:-$root/build}
quick=0
out=$root/results/batch_scaling
threads=2
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out=$2; shift ;;
    --threads) threads=$2; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "batch_scaling.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ ! -x "$build/examples/fashion_mnist" ] || [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKFAC_ENABLE_EXAMPLES=ON >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target fashion_mnist >/dev/null
demo=$build/examples/fashion_mnist
rm -rf "$out"
mkdir -p "$out/runs"
start=$(date +%s)

# Epochs per batch: larger batches get more epochs, so that SGD has a chance to reach the
# target (the recipe's decay always ends at the last epoch).
epochs_for() {  # model batch
  case "$1:$2" in
    mlp:256) echo 6 ;; mlp:1024) echo 8 ;; mlp:4096) echo 12 ;; mlp:16384) echo 16 ;;
    cnn:*) echo 10 ;;
  esac
}
# Evaluations fine enough to time the target, at least one per step: about 10 per epoch for the
# MLP, 5 for the CNN (an evaluation of the CNN costs about 1/20 of a training epoch).
eval_for() {  # model batch
  local steps=$((60000 / $2)) per=10; [ "$1" = cnn ] && per=5
  local e=$((steps / per)); [ "$e" -lt 1 ] && e=1; echo "$e"
}
target_for() {  # model
  if [ "$1" = cnn ]; then echo 0.91; else echo 0.88; fi
}

# One configuration: runs the demo for one model, batch and optimizer with the given learning
# rates (rates at batch 256) and seeds, into its own folder; further arguments go to the demo.
run() {  # model batch optimizer lrs seeds [demo options...]
  local model=$1 batch=$2 opt=$3 lrs=$4 seeds=$5
  shift 5
  local dir=$out/runs/${model}_b${batch}_${opt}_s${seeds//,/-}
  mkdir -p "$dir"
  echo "== $model batch $batch $opt lr $lrs seeds $seeds $* ($(( $(date +%s) - start ))s so far)"
  "$demo" --recipe large-batch --model "$model" --batch "$batch" --epochs "$(epochs_for "$model" "$batch")" \
    --eval-every "$(eval_for "$model" "$batch")" --target-acc "$(target_for "$model")" --optimizer "$opt" \
    --lr-"$opt" "$lrs" --seeds "$seeds" --threads "$threads" --model-figures defaults --out "$dir" "$@" \
    >"$dir/stdout.txt" 2>&1 || true
  grep -E "^(sgd|adam|kfac)\+lb " "$dir/stdout.txt" | head -n 20 | sed 's/^/   /' || true
}

# The best rate of seed 1 (least time to target; else best final accuracy) for the other seeds.
best_lr() {  # model batch optimizer target
  python3 "$root/scripts/batch_scaling_report.py" --best "$out/runs/${1}_b${2}_${3}_s1" "$4"
}

if [ "$quick" = 1 ]; then
  for b in 256 4096; do
    run mlp $b sgd 0.0125,0.025,0.05 1
    run mlp $b adam 0.002 1
    run mlp $b kfac 0.1 1
  done
else
  # The CNN's share is cut to fit 2 hours: its runs take 5-7 minutes each (10 epochs).
  declare -A sweep=([mlp:sgd]=0.0125,0.025,0.05 [mlp:adam]=0.001,0.002,0.004 [mlp:kfac]=0.05,0.1,0.2
                    [cnn:sgd]=0.0125,0.025 [cnn:adam]=0.0005 [cnn:kfac]=0.05,0.1)
  for cfg in mlp:256 mlp:1024 mlp:4096 mlp:16384 cnn:4096; do
    model=${cfg%%:*}; b=${cfg##*:}
    for opt in sgd adam kfac; do
      run "$model" "$b" "$opt" "${sweep[$model:$opt]}" 1
      run "$model" "$b" "$opt" "$(best_lr "$model" "$b" "$opt" "$(target_for "$model")")" 2,3
    done
  done
  # The CNN at batch 256 gives the epochs of the reference batch: seed 1, the demo's rates, each
  # run ended at its first evaluation at 91% (its epochs and time to 91% are those of a full run).
  run cnn 256 sgd 0.05 1 --stop-at-target 1
  run cnn 256 adam 0.001 1 --stop-at-target 1
  run cnn 256 kfac 0.05 1 --stop-at-target 1
fi

echo "benchmark time: $(( $(date +%s) - start ))s; machine load now: $(uptime | sed 's/.*load average/load average/')"
python3 "$root/scripts/batch_scaling_report.py" --report "$out" $([ "$quick" = 1 ] && echo --quick)
