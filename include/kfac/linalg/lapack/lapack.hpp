#pragma once
// The host vendor path: LAPACK (syevd, potrf + potri) and CBLAS (syrk, gemm, dot) serve every
// execution space that can read host memory, in float and double, when kfac is built with
// KFAC_ENABLE_LAPACK (KFAC_HAVE_LAPACK). Included by linalg/vendor.hpp.
#include <cblas.h>
#include <lapacke.h>

#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "kfac/linalg/common.hpp"

namespace kfac {
namespace impl {

inline int lapack_syevd(int n, double* a, int ld, double* w) {
  return LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'U', n, a, ld, w);
}
/// LAPACKE_ssyevd's own workspace query hands the size back as a float, which rounds it below
/// what ssyevd needs once 1 + 6n + 2n^2 passes 2^24 (n = 6273 failed with info = -9): the
/// documented minimum sizes are passed instead.
inline int lapack_syevd(int n, float* a, int ld, float* w) {
  const lapack_int lwork = 1 + 6 * lapack_int(n) + 2 * lapack_int(n) * lapack_int(n), liwork = 3 + 5 * lapack_int(n);
  std::vector<float> work(std::size_t(lwork > 0 ? lwork : 1));
  std::vector<lapack_int> iwork(static_cast<std::size_t>(liwork));
  return LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, 'V', 'U', n, a, ld, w, work.data(), lwork, iwork.data(), liwork);
}
inline int lapack_potrf(int n, double* a, int ld) { return LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', n, a, ld); }
inline int lapack_potrf(int n, float* a, int ld) { return LAPACKE_spotrf(LAPACK_COL_MAJOR, 'U', n, a, ld); }
inline int lapack_potri(int n, double* a, int ld) { return LAPACKE_dpotri(LAPACK_COL_MAJOR, 'U', n, a, ld); }
inline int lapack_potri(int n, float* a, int ld) { return LAPACKE_spotri(LAPACK_COL_MAJOR, 'U', n, a, ld); }
/// Upper triangle of C = alpha op(R) op(R)^T + beta C, op(R) = R^T (k x n, trans) or R (n x k).
inline void blas_syrk(bool trans, int n, int k, double alpha, const double* r, int ldr,
                      double beta, double* c, int ldc) {
  cblas_dsyrk(CblasColMajor, CblasUpper, trans ? CblasTrans : CblasNoTrans, n, k, alpha, r, ldr,
              beta, c, ldc);
}
inline void blas_syrk(bool trans, int n, int k, float alpha, const float* r, int ldr, float beta,
                      float* c, int ldc) {
  cblas_ssyrk(CblasColMajor, CblasUpper, trans ? CblasTrans : CblasNoTrans, n, k, alpha, r, ldr,
              beta, c, ldc);
}
/// C = op(A) B (n x n, column-major), op(A) = A^T when `trans`.
inline void blas_square_gemm(bool trans, int n, const double* a, int lda, const double* b, int ldb, double* c, int ldc) {
  cblas_dgemm(CblasColMajor, trans ? CblasTrans : CblasNoTrans, CblasNoTrans, n, n, n, 1.0, a, lda, b, ldb, 0.0, c, ldc);
}
inline void blas_square_gemm(bool trans, int n, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  cblas_sgemm(CblasColMajor, trans ? CblasTrans : CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

/// Host-accessible spaces, in float and double.
template <class Exec, class T>
using if_lapack_t = std::enable_if_t<host_accessible_v<Exec> && vendor_scalar_v<T>>;

template <class Exec, class T>
struct Vendor<op::Eigh, Exec, T, if_lapack_t<Exec, T>> {
  static constexpr bool available = true;
  static void run(const Exec& exec, const Matrix<T, Exec>& q, const Vector<T, Exec>& w, SolverWorkspace<T, Exec>&) {
    exec.fence();
    const int info = lapack_syevd(int(q.extent(0)), q.data(), leading_dimension(q), w.data());
    if (info != 0) throw Error("", "LAPACK syevd failed with info = " + std::to_string(info));
  }
};

template <class Exec, class T>
struct Vendor<op::SpdInverse, Exec, T, if_lapack_t<Exec, T>> {
  static constexpr bool available = true;
  static void run(const Exec& exec, const Matrix<T, Exec>& a, SolverWorkspace<T, Exec>&) {
    exec.fence();
    const int n = int(a.extent(0)), ld = leading_dimension(a);
    int info = lapack_potrf(n, a.data(), ld);
    if (info > 0) throw_not_positive_definite(info);
    if (info == 0) info = lapack_potri(n, a.data(), ld);
    if (info != 0) throw Error("", "LAPACK potrf/potri failed with info = " + std::to_string(info));
  }
};

template <class Exec, class T>
struct Vendor<op::SyrkT, Exec, T, if_lapack_t<Exec, T>> {
  static constexpr bool available = true;
  /// R k x n, LayoutLeft or LayoutRight (a row-major R is the column-major R^T: no copy).
  template <class R>
  static void run(const Exec& exec, T alpha, const R& r, T beta, const Matrix<T, Exec>& c) {
    exec.fence();
    const int n = int(c.extent(0)), k = int(r.extent(0)), ldc = leading_dimension(c);
    if constexpr (std::is_same<typename R::array_layout, Kokkos::LayoutRight>::value)
      blas_syrk(false, n, k, alpha, r.data(), n, beta, c.data(), ldc);
    else
      blas_syrk(true, n, k, alpha, r.data(), leading_dimension(r), beta, c.data(), ldc);
  }
};

template <class Exec, class T>
struct Vendor<op::SquareGemm, Exec, T, if_lapack_t<Exec, T>> {
  static constexpr bool available = true;
  static void run(const Exec& exec, bool trans, const Matrix<T, Exec>& a, const Matrix<T, Exec>& b,
                  const Matrix<T, Exec>& c) {
    exec.fence();
    blas_square_gemm(trans, int(a.extent(0)), a.data(), leading_dimension(a), b.data(), leading_dimension(b),
                     c.data(), leading_dimension(c));
  }
};

template <class Exec, class T>
struct Vendor<op::SquaredNorm, Exec, T, if_lapack_t<Exec, T>> {
  static constexpr bool available = true;
  /// dsdot (float, accumulated in double) or ddot over the view's span.
  template <class M>
  static double run(const Exec& exec, const M& m) {
    exec.fence();
    const int n = int(m.span());
    if constexpr (std::is_same<T, float>::value) return cblas_dsdot(n, m.data(), 1, m.data(), 1);
    else return cblas_ddot(n, m.data(), 1, m.data(), 1);
  }
};

}  // namespace impl
}  // namespace kfac
