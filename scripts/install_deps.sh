#!/usr/bin/env bash
# Installs the Debian 12 packages kfac needs, skipping what is already there. Run as root
# (or with sudo available).
set -euo pipefail
packages=(
  build-essential cmake pkg-config
  libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev
  libeigen3-dev catch2
  libopenmpi-dev openmpi-bin
  libopenblas-dev liblapacke-dev
  zlib1g-dev gnuplot-nox ccache
  clang libclang-rt-14-dev
  dataset-fashion-mnist fortunes   # fortunes: English text for the character GPT (scripts/transformer_benchmark.sh)
  libtorch-dev
  doxygen
  python3-torch python3-numpy python3-dev pybind11-dev python3-pytest python3-torchvision python3-mpi4py
  python3-venv python3-setuptools python3-wheel ninja-build   # pip install of the Python package (docs/python.md)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "kfac: all packages present"
  exit 0
fi
echo "kfac: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
