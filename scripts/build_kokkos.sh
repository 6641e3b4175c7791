#!/usr/bin/env bash
# Builds standalone Kokkos 3.4.01 and Kokkos Kernels 3.4.01 (BLAS component only, no explicit
# instantiations) from Debian's trilinos source package and installs them into a cache folder
# outside the repository, for building kfac against a Kokkos other than Debian's Serial-only one.
#
# Usage: scripts/build_kokkos.sh <openmp|cuda> [prefix]
#   prefix defaults to ${KFAC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kfac}/kokkos-<backend>.
#   The source is unpacked once into <cache>/src and shared by both backends; build trees go to
#   <prefix>.build. Work already done (source, install stamp) is skipped. KFAC_BUILD_JOBS sets
#   the parallelism (default 2). Progress goes to stderr; the last line on stdout is the prefix.
#
# openmp: Serial + OpenMP backends, OpenBLAS as Kokkos Kernels' BLAS TPL.
# cuda:   Serial + CUDA (sm_80, lambdas on, nvcc_wrapper), cuBLAS TPL. Kokkos 3.4.01 needs three
#         guards for CUDA 13 (half conversions, cudaMemPrefetchAsync, cudaGraphAddDependencies);
#         the script adds them to the unpacked source, each under CUDA_VERSION >= 13000.
# KFAC_KOKKOS_CONFIGURE_ONLY=1 stops after configuring Kokkos (exit status 2, prints the build folder).
#
# Then: cmake -S . -B build-openmp -DCMAKE_PREFIX_PATH=<prefix> ...
set -euo pipefail

backend=${1:-}
case "$backend" in
  openmp | cuda) ;;
  *) echo "usage: $0 <openmp|cuda> [prefix]" >&2; exit 64 ;;
esac
cache=${KFAC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kfac}
prefix=${2:-$cache/kokkos-$backend}
jobs=${KFAC_BUILD_JOBS:-2}
srcroot=$cache/src
stamp=$prefix/.kfac-kokkos-$backend
log() { echo "build_kokkos: $*" >&2; }
sudo_if() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ -f "$stamp" ]; then
  log "$backend already installed in $prefix ($(cat "$stamp"))"
  echo "$prefix"
  exit 0
fi
start=$(date +%s)

# ---- tools ----------------------------------------------------------------------------------
need=()
for pkg in build-essential cmake dpkg-dev libopenblas-dev liblapack-dev; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  sudo_if apt-get update -qq
  sudo_if env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
fi

# ---- source: Debian's trilinos package (Kokkos 3.4.01 under packages/kokkos*) ----------------
shopt -s nullglob
srcs=("$srcroot"/trilinos-*/)
src=${srcs[0]:-}
if [ -z "$src" ] || [ ! -f "$src/packages/kokkos-kernels/CMakeLists.txt" ]; then
  if ! apt-cache showsrc trilinos >/dev/null 2>&1 || [ -z "$(apt-cache showsrc trilinos 2>/dev/null)" ]; then
    log "adding deb-src entries for bookworm and bookworm-updates (main)"
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' |
      sudo_if tee /etc/apt/sources.list.d/kfac-deb-src.sources >/dev/null
    sudo_if apt-get update -qq
  fi
  t=$(date +%s)
  mkdir -p "$srcroot"
  (cd "$srcroot" && apt-get source -qq trilinos >&2)
  srcs=("$srcroot"/trilinos-*/)
  src=${srcs[0]:?apt-get source trilinos left no trilinos-* folder}
  log "trilinos source unpacked in $src ($(($(date +%s) - t)) s)"
fi
src=${src%/}

# ---- CUDA 13 guards for Kokkos 3.4.01 (each under CUDA_VERSION >= 13000, so other builds are
# unchanged; applied once to the shared source, marked KFAC_CUDA13) --------------------------------
cuda_src=$src/packages/kokkos/core/src/Cuda
if ! grep -q KFAC_CUDA13 "$cuda_src/Kokkos_Cuda_Half.hpp"; then
  log "adding the CUDA-13 guards to Kokkos 3.4.01"
  python3 - "$cuda_src" <<'PY'
import sys
d = sys.argv[1]
def guard(name, old, new):
    path = f"{d}/{name}"
    text = open(path).read()
    assert old in text, f"{path}: expected code not found"
    open(path, "w").write(text.replace(old, new, 1))
# The CUDA >= 11.1 half conversions do not compile with CUDA 13; the older branch does.
guard("Kokkos_Cuda_Half.hpp", "#if (CUDA_VERSION < 11100)\n",
      "#if (CUDA_VERSION < 11100) || (CUDA_VERSION >= 13000)  // KFAC_CUDA13\n")
# cudaMemPrefetchAsync takes a cudaMemLocation and flags since CUDA 13.
old = ("    CUDA_SAFE_CALL(cudaMemPrefetchAsync(ptr, bytes, space.cuda_device(),\n"
       "                                        space.cuda_stream()));\n")
guard("Kokkos_CudaSpace.cpp", old,
      "#if CUDA_VERSION >= 13000  // KFAC_CUDA13\n"
      "    cudaMemLocation loc{};\n"
      "    loc.type = cudaMemLocationTypeDevice;\n"
      "    loc.id   = space.cuda_device();\n"
      "    CUDA_SAFE_CALL(cudaMemPrefetchAsync(ptr, bytes, loc, 0, space.cuda_stream()));\n"
      "#else\n" + old + "#endif\n")
# cudaGraphAddDependencies gained an edge-data argument in CUDA 13.
old = ("    CUDA_SAFE_CALL(\n"
       "        cudaGraphAddDependencies(m_graph, &pred_cuda_node, &cuda_node, 1));\n")
guard("Kokkos_Cuda_Graph_Impl.hpp", old,
      "#if CUDA_VERSION >= 13000  // KFAC_CUDA13\n"
      "    CUDA_SAFE_CALL(cudaGraphAddDependencies(m_graph, &pred_cuda_node, &cuda_node,\n"
      "                                            nullptr, 1));\n"
      "#else\n" + old + "#endif\n")
PY
fi

# ---- Kokkos ---------------------------------------------------------------------------------
common=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib
        -DCMAKE_INSTALL_RPATH="$prefix/lib" -DBUILD_SHARED_LIBS=ON
        -DCMAKE_CXX_STANDARD=17 -DCMAKE_CXX_EXTENSIONS=OFF)
kokkos_opts=(-DKokkos_ENABLE_SERIAL=ON)
kernels_opts=(-DKokkosKernels_ENABLE_TPL_BLAS=ON)
if [ "$backend" = openmp ]; then
  kokkos_opts+=(-DKokkos_ENABLE_OPENMP=ON)
else
  cuda_bin=$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")
  export PATH=$cuda_bin:$PATH
  command -v nvcc >/dev/null || { log "cuda: nvcc not found (PATH or /usr/local/cuda/bin)"; exit 1; }
  # nvcc_wrapper's default sm_35 does not exist in CUDA 13; lambdas are off by default in 3.4.
  kokkos_opts+=(-DKokkos_ENABLE_CUDA=ON -DKokkos_ENABLE_CUDA_LAMBDA=ON -DKokkos_ARCH_AMPERE80=ON
                -DCMAKE_CXX_COMPILER="$src/packages/kokkos/bin/nvcc_wrapper" -DCMAKE_CXX_FLAGS=-arch=sm_80)
  kernels_opts+=(-DKokkosKernels_ENABLE_TPL_CUBLAS=ON
                 -DCMAKE_CXX_COMPILER="$src/packages/kokkos/bin/nvcc_wrapper" -DCMAKE_CXX_FLAGS=-arch=sm_80)
fi
build=$prefix.build
t=$(date +%s)
cmake -S "$src/packages/kokkos" -B "$build/kokkos" "${common[@]}" "${kokkos_opts[@]}" >&2
if [ "${KFAC_KOKKOS_CONFIGURE_ONLY:-0}" = 1 ]; then
  log "Kokkos configured in $build/kokkos ($(($(date +%s) - t)) s); not built (KFAC_KOKKOS_CONFIGURE_ONLY=1)"
  echo "$build/kokkos"
  exit 2
fi
cmake --build "$build/kokkos" -j "$jobs" >&2
cmake --install "$build/kokkos" >&2
log "Kokkos built and installed ($(($(date +%s) - t)) s)"

# ---- Kokkos Kernels: BLAS only, no ETI (templates instantiate in the user's code) -------------
t=$(date +%s)
inst_off=()
for v in DOUBLE FLOAT COMPLEX_DOUBLE COMPLEX_FLOAT LAYOUTLEFT LAYOUTRIGHT OFFSET_INT OFFSET_SIZE_T \
         ORDINAL_INT ORDINAL_INT64_T EXECSPACE_SERIAL EXECSPACE_OPENMP MEMSPACE_HOSTSPACE; do
  inst_off+=("-DKokkosKernels_INST_$v=OFF")
done
if [ "$backend" = cuda ]; then
  inst_off+=(-DKokkosKernels_INST_EXECSPACE_CUDA=OFF -DKokkosKernels_INST_MEMSPACE_CUDASPACE=OFF
             -DKokkosKernels_INST_MEMSPACE_CUDAUVMSPACE=OFF)
fi
cmake -S "$src/packages/kokkos-kernels" -B "$build/kernels" "${common[@]}" -DKokkos_ROOT="$prefix" \
  -DKokkosKernels_ENABLED_COMPONENTS=BLAS -DKokkosKernels_ADD_DEFAULT_ETI=OFF "${inst_off[@]}" \
  -DKokkosKernels_ENABLE_TESTS=OFF -DKokkosKernels_ENABLE_EXAMPLES=OFF "${kernels_opts[@]}" >&2
cmake --build "$build/kernels" -j "$jobs" >&2
cmake --install "$build/kernels" >&2
log "Kokkos Kernels built and installed ($(($(date +%s) - t)) s)"

echo "Kokkos 3.4.01 + Kokkos Kernels 3.4.01 ($backend), built $(date -u +%Y-%m-%dT%H:%MZ) in $(($(date +%s) - start)) s" >"$stamp"
log "done in $(($(date +%s) - start)) s: $prefix"
echo "$prefix"
