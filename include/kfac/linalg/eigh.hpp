#pragma once
// Symmetric eigendecomposition: the vendor syevd (op::Eigh) or the portable cyclic Jacobi, and
// the cheap refresh of the eigenvalues in a kept basis.
#include <Kokkos_Core.hpp>
#include <string>
#include <type_traits>

#include "kfac/error.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/linalg/common.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/symmetric.hpp"
#include "kfac/linalg/vendor.hpp"

namespace kfac {
namespace impl {

/// Cyclic Jacobi on a symmetric matrix `a` (full, overwritten). On return q holds the
/// eigenvectors as columns and w the eigenvalues in ascending order (LAPACK's convention).
/// One thread does the work, so it runs on any backend; it is the reference implementation.
template <class Exec, class T>
void jacobi_eigh(const Exec& exec, const Matrix<T, Exec>& a, const Matrix<T, Exec>& q,
                 const Vector<T, Exec>& w, int max_sweeps = 60) {
  const int n = int(a.extent(0));
  Kokkos::View<int, typename Exec::memory_space> converged("kfac::jacobi::converged");
  Kokkos::parallel_for(
      "kfac::linalg::jacobi_eigh", Kokkos::RangePolicy<Exec>(exec, 0, 1), KOKKOS_LAMBDA(int) {
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < n; ++j) q(i, j) = T(i == j);
        T norm2 = 0;
        for (int j = 0; j < n; ++j)
          for (int i = 0; i < n; ++i) norm2 += a(i, j) * a(i, j);
        const T eps = sizeof(T) == 4 ? T(1e-7) : T(1e-15);
        converged() = 0;
        for (int sweep = 0; sweep < max_sweeps; ++sweep) {
          T off = 0;
          for (int j = 1; j < n; ++j)
            for (int i = 0; i < j; ++i) off += a(i, j) * a(i, j);
          if (off <= eps * eps * norm2) { converged() = 1; break; }
          for (int p = 0; p < n - 1; ++p)
            for (int r = p + 1; r < n; ++r) {
              const T apr = a(p, r);
              if (apr == T(0)) continue;
              const T theta = (a(r, r) - a(p, p)) / (T(2) * apr);
              const T t = (theta >= 0 ? T(1) : T(-1)) /
                          (abs_(theta) + sqrt_(theta * theta + T(1)));
              const T c = T(1) / sqrt_(t * t + T(1)), s = t * c;
              for (int k = 0; k < n; ++k) {
                const T akp = a(k, p), akr = a(k, r);
                a(k, p) = c * akp - s * akr;
                a(k, r) = s * akp + c * akr;
              }
              for (int k = 0; k < n; ++k) {
                const T apk = a(p, k), ark = a(r, k);
                a(p, k) = c * apk - s * ark;
                a(r, k) = s * apk + c * ark;
              }
              for (int k = 0; k < n; ++k) {
                const T qkp = q(k, p), qkr = q(k, r);
                q(k, p) = c * qkp - s * qkr;
                q(k, r) = s * qkp + c * qkr;
              }
            }
        }
        if (n <= 1) converged() = 1;
        for (int i = 0; i < n; ++i) w(i) = a(i, i);
        // selection sort, ascending, moving eigenvector columns along
        for (int i = 0; i < n - 1; ++i) {
          int m = i;
          for (int j = i + 1; j < n; ++j)
            if (w(j) < w(m)) m = j;
          if (m != i) {
            const T tw = w(i); w(i) = w(m); w(m) = tw;
            for (int k = 0; k < n; ++k) { const T tq = q(k, i); q(k, i) = q(k, m); q(k, m) = tq; }
          }
        }
      });
  auto h = Kokkos::create_mirror_view(converged);
  Kokkos::deep_copy(h, converged);
  if (!h())
    throw Error("", "Jacobi eigensolver did not converge in " + std::to_string(max_sweeps) + " sweeps");
}

/// Symmetric eigendecomposition of the upper triangle of `f`: q (eigenvectors, columns) and
/// w (ascending eigenvalues). `f` is left untouched; `ws` keeps scratch memory between calls.
/// The vendor path (op::Eigh) reads q's upper triangle only, so a plain copy (a memcpy) fills
/// it when no type or layout changes; the portable Jacobi needs the whole symmetric matrix.
template <class Backend, class Exec, class F, class T>
void eigh(const Exec& exec, const F& f, const Matrix<T, Exec>& q, const Vector<T, Exec>& w,
          SolverWorkspace<T, Exec>& ws, int jacobi_sweeps = 60) {
  require_square_pair("eigh", f, q);
  require_shape(w.extent(0) == f.extent(0), "eigh", "w must have one entry per row of the factor", f.extent(0),
                f.extent(1), w.extent(0), 1);
  if constexpr (vendor_path_v<op::Eigh, Exec, T, Backend>) {
    if constexpr (std::is_same<typename F::non_const_value_type, T>::value &&
                  std::is_same<typename F::array_layout, Kokkos::LayoutLeft>::value)
      Kokkos::deep_copy(exec, q, f);
    else
      symmetric_copy(exec, f, q);
    Vendor<op::Eigh, Exec, T>::run(exec, q, w, ws);
  } else {
    symmetric_copy(exec, f, q);
    const Matrix<T, Exec>& work = ws.scratch_for(int(f.extent(0)));
    Kokkos::deep_copy(exec, work, q);
    jacobi_eigh(exec, work, q, w, jacobi_sweeps);
  }
}

/// The same with scratch memory for this call only.
template <class Backend, class Exec, class F, class T>
void eigh(const Exec& exec, const F& f, const Matrix<T, Exec>& q, const Vector<T, Exec>& w,
          int jacobi_sweeps = 60) {
  SolverWorkspace<T, Exec> ws;
  eigh<Backend>(exec, f, q, w, ws, jacobi_sweeps);
}

/// \brief Eigenvalues of the upper triangle of `f` in the kept orthonormal basis `q`: with
/// \f$B = Q^T F Q\f$, sets w = diag(B) (clamped at 0) and returns true when
/// \f$\|B - \mathrm{diag}(B)\|_F \le \tau \|F\|_F\f$; then \f$Q\,\mathrm{diag}(w)\,Q^T\f$ is within
/// \f$\tau\|F\|_F\f$ of F in the Frobenius norm (an orthogonal change of basis keeps the norm, and F
/// is positive semidefinite, so no diagonal entry is clamped). Returns false, leaving w as it was,
/// otherwise. Two n x n GEMMs and O(n^2) more; `fq`, `b` are n x n scratch, `col` 2n scratch.
/// Launches only range kernels and, on the host vendor path, BLAS: it may run on a second host
/// thread.
template <class Backend, class Exec, class F, class T>
bool refresh_eigenvalues(const Exec& exec, const F& f, const Matrix<T, Exec>& q, const Vector<T, Exec>& w,
                         double tau, const Matrix<T, Exec>& full, const Matrix<T, Exec>& fq,
                         const Matrix<T, Exec>& b, const Kokkos::View<double*, typename Exec::memory_space>& col) {
  const int n = int(f.extent(0));
  symmetric_copy(exec, f, full);
  square_gemm<Backend>(exec, false, full, q, fq);
  square_gemm<Backend>(exec, true, q, fq, b);
  Kokkos::parallel_for(  // per column: off-diagonal and total sums of squares (no reduction kernel)
      "kfac::eigen::refresh_norms", Kokkos::RangePolicy<Exec>(exec, 0, n), KOKKOS_LAMBDA(int j) {
        double off = 0, all = 0;
        for (int i = 0; i < n; ++i) {
          const double v = double(b(i, j));
          all += v * v;
          if (i != j) off += v * v;
        }
        col(j) = off;
        col(n + j) = all;
      });
  exec.fence();
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), col);
  double off = 0, all = 0;
  for (int j = 0; j < n; ++j) {
    off += host(j);
    all += host(n + j);
  }
  if (!(off <= tau * tau * all)) return false;
  Kokkos::parallel_for(
      "kfac::eigen::refresh_diagonal", Kokkos::RangePolicy<Exec>(exec, 0, n),
      KOKKOS_LAMBDA(int j) { w(j) = b(j, j) > T(0) ? b(j, j) : T(0); });
  return true;
}

}  // namespace impl
}  // namespace kfac
