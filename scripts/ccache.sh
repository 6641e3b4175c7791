# Sourced by the build scripts (test.sh, quickstart.sh, sanitize.sh, test_backend.sh) after
# install_deps.sh, with $root set to the clone: routes their compiles through ccache, with its
# cache in ${KFAC_CACHE_DIR:-~/.cache/kfac}/ccache (next to the Kokkos prefixes) and the clone as
# base dir, so that a fresh clone on the same machine reuses every object whose sources, headers
# and flags did not change. The folder is left out of the hash (CCACHE_NOHASHDIR): the sanitizer
# build's debug information then names the clone the object was first compiled in.
# KFAC_CCACHE=0 compiles without it. Sets ccache_args, the cmake arguments to add.
ccache_args=()
if [ "${KFAC_CCACHE:-1}" = 1 ] && command -v ccache > /dev/null; then
  export CCACHE_DIR=${KFAC_CACHE_DIR:-$HOME/.cache/kfac}/ccache CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
  ccache_args=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
