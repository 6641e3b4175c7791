#pragma once
/// \file config.hpp
/// \brief Version and feature macros of kfac.

#include <Kokkos_Core.hpp>

// The one place the version is written: CMakeLists.txt's project() reads it from here, and the
// installed kfacConfigVersion.cmake carries it (find_package(kfac 0.3)).
#define KFAC_VERSION_MAJOR 0
#define KFAC_VERSION_MINOR 3
#define KFAC_VERSION_PATCH 0
/// The version as a string, "0.3.0".
#define KFAC_VERSION_STRING "0.3.0"

#if defined(KOKKOS_ENABLE_CUDA) && !defined(KFAC_DISABLE_CUSOLVER)
/// cuSOLVER/cuBLAS are used for decompositions of factors living in CUDA memory.
#define KFAC_HAVE_CUSOLVER 1
#endif

namespace kfac {

/// Index type of matrix extents. LAPACK and cuSOLVER take 32-bit ints, and K-FAC factors
/// never come close to 2^31 rows.
using index_t = int;

}  // namespace kfac
