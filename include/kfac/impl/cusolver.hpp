#pragma once
// cuSOLVER path of the symmetric eigensolver, compiled only when Kokkos has CUDA.
// Not exercised on the CPU-only development machine; see docs/backends.md.
#include <Kokkos_Core.hpp>
#include <cusolverDn.h>
#include <string>

#include "kfac/error.hpp"

namespace kfac {
namespace impl {

inline cusolverDnHandle_t cusolver_handle() {
  static thread_local cusolverDnHandle_t handle = [] {
    cusolverDnHandle_t h = nullptr;
    if (cusolverDnCreate(&h) != CUSOLVER_STATUS_SUCCESS) throw Error("", "cusolverDnCreate failed");
    return h;
  }();
  return handle;
}

inline cusolverStatus_t cusolver_syevd_buffer(cusolverDnHandle_t h, int n, double* a, int ld,
                                              double* w, int* lwork) {
  return cusolverDnDsyevd_bufferSize(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, ld,
                                     w, lwork);
}
inline cusolverStatus_t cusolver_syevd_buffer(cusolverDnHandle_t h, int n, float* a, int ld,
                                              float* w, int* lwork) {
  return cusolverDnSsyevd_bufferSize(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, ld,
                                     w, lwork);
}
inline cusolverStatus_t cusolver_syevd(cusolverDnHandle_t h, int n, double* a, int ld, double* w,
                                       double* work, int lwork, int* info) {
  return cusolverDnDsyevd(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, ld, w, work,
                          lwork, info);
}
inline cusolverStatus_t cusolver_syevd(cusolverDnHandle_t h, int n, float* a, int ld, float* w,
                                       float* work, int lwork, int* info) {
  return cusolverDnSsyevd(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, ld, w, work,
                          lwork, info);
}

/// In-place eigendecomposition of the symmetric matrix q (upper triangle read) on exec's stream.
template <class Q, class W>
void cusolver_eigh(const Kokkos::Cuda& exec, const Q& q, const W& w) {
  using T = typename Q::non_const_value_type;
  const int n = int(q.extent(0)), ld = int(q.stride(1));
  cusolverDnHandle_t h = cusolver_handle();
  cusolverDnSetStream(h, exec.cuda_stream());
  int lwork = 0;
  if (cusolver_syevd_buffer(h, n, q.data(), ld, w.data(), &lwork) != CUSOLVER_STATUS_SUCCESS)
    throw Error("", "cusolverDn syevd_bufferSize failed");
  Kokkos::View<T*, Kokkos::CudaSpace> work("kfac::cusolver::work", lwork);
  Kokkos::View<int, Kokkos::CudaSpace> info("kfac::cusolver::info");
  if (cusolver_syevd(h, n, q.data(), ld, w.data(), work.data(), lwork, info.data()) !=
      CUSOLVER_STATUS_SUCCESS)
    throw Error("", "cusolverDn syevd failed to launch");
  auto hinfo = Kokkos::create_mirror_view(info);
  Kokkos::deep_copy(exec, hinfo, info);
  exec.fence();
  if (hinfo() != 0) throw Error("", "cusolverDn syevd failed with info = " + std::to_string(hinfo()));
}

}  // namespace impl
}  // namespace kfac
