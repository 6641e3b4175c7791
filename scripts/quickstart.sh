#!/usr/bin/env bash
# Installs what is missing, builds kfac's Fashion-MNIST example and runs the main job:
# the MLP trained with SGD, Adam and K-FAC side by side (seeds 1-3, 8 epochs each, under 3 minutes
# on 2 cores), with a summary table, a CSV log and a plot in results/.
# Extra arguments go to the example (see docs/fashion_mnist.md or --help).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KFAC_BUILD_DIR:-$root/build}
"$root/scripts/install_deps.sh"
source "$root/scripts/ccache.sh"
# The same configuration as scripts/test.sh, so that running both commands builds once.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKFAC_ENABLE_EXAMPLES=ON "${ccache_args[@]}"
cmake --build "$build" -j "$(nproc)" --target fashion_mnist
"$build/examples/fashion_mnist" --out "$root/results" "$@"
