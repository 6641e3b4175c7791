#!/usr/bin/env bash
# Transformer benchmark (issue 43 item 7; docs/transformers.md): a small ViT on Fashion-MNIST
# and a character GPT on Debian's fortunes text, AdamW against SGD + kfac (K-FAC-expand and
# K-FAC-reduce), each optimizer swept over four step sizes (AdamW's lr, K-FAC's KL clip) on the same steps and seeds.
# Builds the Python package (CMake, build/python) when it is missing, then runs
# benchmarks/python/transformer_benchmark.py: results/transformers/{runs.csv,summary.md,*.svg}
# and one "target ...: MET | MISSED by x | NOT MEASURED (why)" line per target.
#
#   bash scripts/transformer_benchmark.sh --quick     one seed, two settings, short runs (< 5 min)
#   bash scripts/transformer_benchmark.sh             3 seeds, 4 settings each: ViT and GPT (about 86 minutes)
# Other options go to the Python script (--out DIR, --workloads vit,gpt).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_BUILD_DIR:-$root/build}
"$root/scripts/install_deps.sh"
if ! ls "$build"/python/kfac/_kfac*.so > /dev/null 2>&1; then
  source "$root/scripts/ccache.sh"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${ccache_args[@]}" > /dev/null
  cmake --build "$build" -j "$(nproc)" --target kfac_python
fi
cd "$root"
PYTHONPATH="$build/python" OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 /usr/bin/python3 \
  benchmarks/python/transformer_benchmark.py --out "$root/results/transformers" "$@"
