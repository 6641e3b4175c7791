#pragma once
// Inverse by the Newton-Schulz iteration: GEMMs only, on every backend.
#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>

#include "kfac/error.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/impl/ordered_sum.hpp"
#include "kfac/linalg/common.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/symmetric.hpp"

namespace kfac {
namespace impl {

/// Inverse of (upper triangle of f) + shift I by the Newton-Schulz iteration
/// X <- X (2I - M X), started at X0 = I / ||M||_F. GEMM only, so it runs on any backend.
template <class Exec, class F, class T>
int newton_schulz_inverse(const Exec& exec, const F& f, T shift, const Matrix<T, Exec>& x,
                          int max_iterations = 100, double tolerance = 0) {
  require_square_pair("newton_schulz_inverse", f, x);
  const int n = int(f.extent(0));
  Matrix<T, Exec> m("kfac::ns::m", n, n), t("kfac::ns::t", n, n), y("kfac::ns::y", n, n);
  symmetric_copy(exec, f, m);
  add_diagonal(exec, m, shift);
  // Fixed-order sums (ordered_sum.hpp): the start and the iteration count are the same on every
  // host backend, so the result is too.
  const double fro2 = ordered_sum(exec, "kfac::linalg::frobenius", n, n,
                                  KOKKOS_LAMBDA(long i, long j) { return double(m(i, j)) * double(m(i, j)); });
  const T inv_norm = T(1.0 / std::sqrt(fro2));
  Kokkos::parallel_for(
      "kfac::linalg::ns_init",
      ColumnMajorRange<Exec>(exec, {0, 0}, {n, n}),
      KOKKOS_LAMBDA(int i, int j) { x(i, j) = i == j ? inv_norm : T(0); });
  // 0 = the type's default: about 10 and 100 ulps of the residual's entries.
  const double tol = (tolerance > 0 ? tolerance : sizeof(T) == 4 ? 1e-6 : 1e-14) * std::sqrt(double(n));
  double previous = 1e300;
  for (int it = 1; it <= max_iterations; ++it) {
    gemm(exec, "N", "N", T(1), m, x, T(0), t);  // t = M X
    const double res2 = ordered_sum(exec, "kfac::linalg::ns_residual", n, n, KOKKOS_LAMBDA(long i, long j) {
      const double r = double(i == j) - double(t(i, j));
      return r * r;
    });
    const double res = std::sqrt(res2);
    if (!std::isfinite(res)) throw Error("", "Newton-Schulz iteration diverged");
    if (res < tol || (res < 1e-2 && res >= previous)) return it;  // converged or at round-off
    previous = res;
    // y = 2X - X t
    Kokkos::deep_copy(exec, y, x);
    gemm(exec, "N", "N", T(-1), x, t, T(2), y);
    Kokkos::deep_copy(exec, x, y);
  }
  throw Error("", "Newton-Schulz iteration did not converge in " + std::to_string(max_iterations) +
                      " iterations (increase damping)");
}

}  // namespace impl
}  // namespace kfac
