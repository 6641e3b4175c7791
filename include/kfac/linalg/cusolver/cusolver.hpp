#pragma once
// The CUDA vendor path: cuSOLVER's syevd and potrf + potri serve Kokkos::Cuda in float and
// double, when Kokkos has CUDA (KFAC_HAVE_CUSOLVER, config.hpp; KFAC_DISABLE_CUSOLVER turns it
// off). Included by linalg/vendor.hpp. Compiled and linked on the CPU-only development machine,
// not run there (docs/backends.md).
#include <Kokkos_Core.hpp>
#include <cusolverDn.h>
#include <string>
#include <type_traits>

#include "kfac/linalg/common.hpp"
#include "kfac/linalg/cusolver/handles.hpp"

namespace kfac {
namespace impl {

inline cusolverStatus_t cusolver_syevd_buffer(cusolverDnHandle_t h, int n, double* a, int ld, double* w, int* lwork) {
  return cusolverDnDsyevd_bufferSize(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, ld, w, lwork);
}
inline cusolverStatus_t cusolver_syevd_buffer(cusolverDnHandle_t h, int n, float* a, int ld, float* w, int* lwork) {
  return cusolverDnSsyevd_bufferSize(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, ld, w, lwork);
}
inline cusolverStatus_t cusolver_syevd(cusolverDnHandle_t h, int n, double* a, int ld, double* w, double* work,
                                       int lwork, int* info) {
  return cusolverDnDsyevd(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, ld, w, work, lwork, info);
}
inline cusolverStatus_t cusolver_syevd(cusolverDnHandle_t h, int n, float* a, int ld, float* w, float* work,
                                       int lwork, int* info) {
  return cusolverDnSsyevd(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, ld, w, work, lwork, info);
}
/// potrf (factor) or potri (inverse from the factor), upper triangle: the workspace size.
template <class T>
cusolverStatus_t cusolver_pot_buffer(cusolverDnHandle_t h, bool inverse, int n, T* a, int ld, int* lwork) {
  const cublasFillMode_t up = CUBLAS_FILL_MODE_UPPER;
  if constexpr (std::is_same<T, double>::value)
    return inverse ? cusolverDnDpotri_bufferSize(h, up, n, a, ld, lwork) : cusolverDnDpotrf_bufferSize(h, up, n, a, ld, lwork);
  else
    return inverse ? cusolverDnSpotri_bufferSize(h, up, n, a, ld, lwork) : cusolverDnSpotrf_bufferSize(h, up, n, a, ld, lwork);
}
/// potrf or potri, upper triangle, in place.
template <class T>
cusolverStatus_t cusolver_pot(cusolverDnHandle_t h, bool inverse, int n, T* a, int ld, T* work, int lwork, int* info) {
  const cublasFillMode_t up = CUBLAS_FILL_MODE_UPPER;
  if constexpr (std::is_same<T, double>::value)
    return inverse ? cusolverDnDpotri(h, up, n, a, ld, work, lwork, info) : cusolverDnDpotrf(h, up, n, a, ld, work, lwork, info);
  else
    return inverse ? cusolverDnSpotri(h, up, n, a, ld, work, lwork, info) : cusolverDnSpotrf(h, up, n, a, ld, work, lwork, info);
}

/// The info word cuSOLVER wrote on exec's stream.
template <class Info>
int cusolver_info(const Kokkos::Cuda& exec, const Info& info) {
  auto h = Kokkos::create_mirror_view(info);
  Kokkos::deep_copy(exec, h, info);
  exec.fence();
  return h();
}

/// In-place eigendecomposition of the symmetric matrix q (upper triangle read) on exec's
/// stream; `ws` (SolverWorkspace) keeps the device workspace between calls.
template <class Q, class W, class Ws>
void cusolver_eigh(const Kokkos::Cuda& exec, const Q& q, const W& w, Ws& ws) {
  const int n = int(q.extent(0)), ld = leading_dimension(q);
  cusolverDnHandle_t h = CusolverHandles::get(exec);
  int lwork = 0;
  if (cusolver_syevd_buffer(h, n, q.data(), ld, w.data(), &lwork) != CUSOLVER_STATUS_SUCCESS)
    throw Error("", "linalg: cusolverDn syevd_bufferSize failed");
  auto* work = ws.work_for(std::size_t(lwork));
  if (cusolver_syevd(h, n, q.data(), ld, w.data(), work, lwork, ws.info.data()) != CUSOLVER_STATUS_SUCCESS)
    throw Error("", "linalg: cusolverDn syevd failed to launch");
  const int info = cusolver_info(exec, ws.info);
  if (info != 0) throw Error("", "linalg: cusolverDn syevd failed with info = " + std::to_string(info));
}

/// In-place inverse of the SPD matrix a (upper triangle read and written) by potrf + potri on
/// exec's stream. Throws, like the LAPACK path, when a is not positive definite.
template <class A, class Ws>
void cusolver_spd_inverse_upper(const Kokkos::Cuda& exec, const A& a, Ws& ws) {
  const int n = int(a.extent(0)), ld = leading_dimension(a);
  cusolverDnHandle_t h = CusolverHandles::get(exec);
  int lwork_f = 0, lwork_i = 0;
  if (cusolver_pot_buffer(h, false, n, a.data(), ld, &lwork_f) != CUSOLVER_STATUS_SUCCESS ||
      cusolver_pot_buffer(h, true, n, a.data(), ld, &lwork_i) != CUSOLVER_STATUS_SUCCESS)
    throw Error("", "linalg: cusolverDn potrf/potri_bufferSize failed");
  const int lwork = lwork_f > lwork_i ? lwork_f : lwork_i;
  auto* work = ws.work_for(std::size_t(lwork));
  if (cusolver_pot(h, false, n, a.data(), ld, work, lwork, ws.info.data()) != CUSOLVER_STATUS_SUCCESS)
    throw Error("", "linalg: cusolverDn potrf failed to launch");
  int info = cusolver_info(exec, ws.info);
  if (info > 0) throw_not_positive_definite(info);
  if (info == 0) {
    if (cusolver_pot(h, true, n, a.data(), ld, work, lwork, ws.info.data()) != CUSOLVER_STATUS_SUCCESS)
      throw Error("", "linalg: cusolverDn potri failed to launch");
    info = cusolver_info(exec, ws.info);
  }
  if (info != 0) throw Error("", "linalg: cusolverDn potrf/potri failed with info = " + std::to_string(info));
}

/// Kokkos::Cuda, in float and double.
template <class Exec, class T>
using if_cusolver_t = std::enable_if_t<std::is_same<Exec, Kokkos::Cuda>::value && vendor_scalar_v<T>>;

template <class Exec, class T>
struct Vendor<op::Eigh, Exec, T, if_cusolver_t<Exec, T>> {
  static constexpr bool available = true;
  static void run(const Exec& exec, const Matrix<T, Exec>& q, const Vector<T, Exec>& w, SolverWorkspace<T, Exec>& ws) {
    cusolver_eigh(exec, q, w, ws);
  }
};

template <class Exec, class T>
struct Vendor<op::SpdInverse, Exec, T, if_cusolver_t<Exec, T>> {
  static constexpr bool available = true;
  static void run(const Exec& exec, const Matrix<T, Exec>& a, SolverWorkspace<T, Exec>& ws) {
    cusolver_spd_inverse_upper(exec, a, ws);
  }
};

}  // namespace impl
}  // namespace kfac
