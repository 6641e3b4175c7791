#pragma once
// Where a vendor library serves a linear-algebra entry, Kokkos Kernels style: one availability
// trait, `Vendor<Op, Exec, T>`, false unless a vendor folder specializes it for an operation,
// an execution space and a scalar type. The entries (eigh.hpp, spd_inverse.hpp, ...) read
// "vendor path where it is available and the backend is AutoBackend, else the portable one";
// the portable path is always compiled and is the reference the vendor paths are tested
// against. A vendor folder (lapack/, cusolver/) holds its library's calls and its
// specializations; a new backend's solver is one more folder, included at the end of this file
// under its KFAC_HAVE_* macro (config.hpp), and its library linked in CMakeLists.txt.
#include <type_traits>

#include "kfac/config.hpp"
#include "kfac/linalg/common.hpp"

namespace kfac {
namespace impl {

/// The vendor path of `Op` is taken: it is available and the backend allows it.
template <class Op, class Exec, class T, class Backend = AutoBackend>
constexpr bool vendor_path_v = Vendor<Op, Exec, T>::available && std::is_same<Backend, AutoBackend>::value;

}  // namespace impl
}  // namespace kfac

// The vendor folders, each specializing Vendor for what its library serves.
#if defined(KFAC_HAVE_LAPACK)
#include "kfac/linalg/lapack/lapack.hpp"
#endif
#if defined(KFAC_HAVE_CUSOLVER)
#include "kfac/linalg/cusolver/cusolver.hpp"
#endif
