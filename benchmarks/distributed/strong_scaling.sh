#!/usr/bin/env bash
# Strong scaling of the Fashion-MNIST demo (issue 16): the same global batch split over 1, 2 and
# 4 ranks, one OpenBLAS thread per rank, SGD and K-FAC under every KAISA strategy, with and
# without reduce-to-owner and split preconditioning. Prints one Markdown row per run: s/epoch, time to the target accuracy,
# and the bytes rank 0 sent per step (gradient averaging + K-FAC's collectives, as the demo
# counts them with kfac::MpiComm::bytes_sent()), and for K-FAC kfac's measured time per step
# (observe + step() on rank 0) beside kfac::CostModel's prediction for the same run.
#
# Usage: benchmarks/distributed/strong_scaling.sh BUILD_DIR
# Environment (defaults in brackets): MODELS [mlp cnn], RANKS [1 2 4], EPOCHS [2], SEED [1],
#   TRAIN_SUBSET [0 = all 60000], TEST_SUBSET [0 = all], TARGET [0.88 for mlp, 0.85 for cnn],
#   OWNER [0 1] (reduce-to-owner settings tried), SPLIT [0 1] (split-preconditioning settings tried),
#   OVERLAP [1] (--overlap-communication of every K-FAC run: 0 times the blocking collectives),
#   FIGURES [measured] (--model-figures of every K-FAC run: the cost model's machine figures),
#   OUT [a temporary folder], DATA [the demo's].
# Runs with more ranks than cores are labelled "oversubscribed": their times are not scaling.
set -euo pipefail
build=${1:?usage: strong_scaling.sh BUILD_DIR}
demo=$build/examples/fashion_mnist
[ -x "$demo" ] || { echo "strong_scaling.sh: $demo not built (cmake --build $build --target fashion_mnist)" >&2; exit 2; }
models=${MODELS:-mlp cnn}
ranks_list=${RANKS:-1 2 4}
epochs=${EPOCHS:-2}
seed=${SEED:-1}
owners=${OWNER:-0 1}
splits=${SPLIT:-0 1}
overlap=${OVERLAP:-1}
figures=${FIGURES:-measured}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
cores=$(nproc)
extra=()
[ "${TRAIN_SUBSET:-0}" != 0 ] && extra+=(--train-subset "$TRAIN_SUBSET")
[ "${TEST_SUBSET:-0}" != 0 ] && extra+=(--test-subset "$TEST_SUBSET")
[ -n "${DATA:-}" ] && extra+=(--data "$DATA")
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

# One demo run; prints "s/epoch|time to target|bytes/step|kfac ms/step|model ms/step" from its
# log.csv and output (the last two "-" without K-FAC).
run() {
  local np=$1 dir=$2
  shift 2
  local cmd=("$demo" --epochs "$epochs" --seeds "$seed" --threads 1 --out "$dir" "${extra[@]}" "$@")
  if [ "$np" -gt 1 ]; then cmd=(mpiexec --allow-run-as-root --oversubscribe --bind-to none -n "$np" "${cmd[@]}"); fi
  "${cmd[@]}" > "$dir.txt" 2>&1 || { echo "failed: ${cmd[*]} (see $dir.txt)" >&2; exit 1; }
  local mb
  mb=$(grep -a -o 'communication: [0-9.e+]* MB sent per epoch' "$dir.txt" | head -1 | awk '{print $2}' || true)
  local kfac_ms model_ms
  kfac_ms=$(grep -a -o 'kfac per step: [0-9.]* ms' "$dir.txt" | head -1 | awk '{print $4}' || true)
  model_ms=$(grep -a -o 'cost model [0-9.]* ms' "$dir.txt" | head -1 | awk '{print $3}' || true)
  awk -F, -v target="$target" -v epochs="$epochs" -v mb="${mb:-0}" -v k="${kfac_ms:--}" -v m="${model_ms:--}" '
    NR > 1 { last = $6; steps = $5; if (hit == "" && $8 >= target) hit = $6 }
    END {
      per_epoch_steps = steps / epochs
      printf "%.2f|%s|%s|%s|%s\n", last / epochs, hit == "" ? "not reached" : sprintf("%.1f s", hit),
             mb == 0 ? "0" : sprintf("%.3g", mb * 1e6 / per_epoch_steps), k, m
    }' "$dir/log.csv"
}

echo "| model | ranks | optimizer | strategy | reduce-to-owner | split | s/epoch | time to target | bytes/step (rank 0) | kfac ms/step (rank 0) | model ms/step |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for model in $models; do
  target=${TARGET:-$([ "$model" = mlp ] && echo 0.88 || echo 0.85)}
  for np in $ranks_list; do
    label=$np
    [ "$np" -gt "$cores" ] && label="$np (oversubscribed)"
    IFS='|' read -r se tt bs km mm < <(run "$np" "$out/$model-np$np-sgd" --model "$model" --optimizer sgd --target-acc "$target")
    echo "| $model | $label | SGD | - | - | - | $se | $tt | $bs | $km | $mm |"
    strategies="comm-opt"
    [ "$np" -gt 1 ] && strategies="comm-opt mem-opt"
    [ "$np" -gt 2 ] && strategies="comm-opt hybrid mem-opt"
    for strategy in $strategies; do
      here=$owners
      here_split=$splits
      [ "$np" -eq 1 ] && here=0 && here_split=0  # one process sends nothing and divides nothing
      [ "$strategy" = mem-opt ] && here_split=0   # one gradient worker per layer: nothing to divide
      for own in $here; do
        for split in $here_split; do
          IFS='|' read -r se tt bs km mm < <(run "$np" "$out/$model-np$np-$strategy-own$own-split$split" --model "$model" \
            --optimizer kfac --strategy "$strategy" --reduce-to-owner "$own" --split-preconditioning "$split" \
            --overlap-communication "$overlap" --model-figures "$figures" --target-acc "$target")
          echo "| $model | $label | K-FAC | $strategy | $own | $split | $se | $tt | $bs | $km | $mm |"
        done
      done
    done
  done
done
