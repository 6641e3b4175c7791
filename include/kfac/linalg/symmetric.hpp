#pragma once
// Element kernels on symmetric matrices kept as one triangle: mirror, copy with a type change,
// shift of the diagonal. Portable (range kernels), on every backend.
#include <Kokkos_Core.hpp>

#include "kfac/impl/math.hpp"

namespace kfac {
namespace impl {

/// Copies the upper triangle of src into the whole of dst (symmetrizing, converting type).
template <class Exec, class S, class D>
void symmetric_copy(const Exec& exec, const S& src, const D& dst) {
  using T = typename D::non_const_value_type;
  const int n = int(src.extent(0));
  Kokkos::parallel_for(
      "kfac::linalg::symmetric_copy",
      ColumnMajorRange<Exec>(exec, {0, 0}, {n, n}),
      KOKKOS_LAMBDA(int i, int j) { dst(i, j) = T(i <= j ? src(i, j) : src(j, i)); });
}

/// Adds shift to the diagonal.
template <class Exec, class M>
void add_diagonal(const Exec& exec, const M& m, typename M::non_const_value_type shift) {
  Kokkos::parallel_for(
      "kfac::linalg::add_diagonal", Kokkos::RangePolicy<Exec>(exec, 0, int(m.extent(0))),
      KOKKOS_LAMBDA(int i) { m(i, i) += shift; });
}

/// Copies the upper triangle of `a` onto its lower one.
template <class Exec, class M>
void mirror_upper(const Exec& exec, const M& a) {
  const int n = int(a.extent(0));
  Kokkos::parallel_for(
      "kfac::linalg::mirror_upper", Kokkos::RangePolicy<Exec>(exec, 0, n),
      KOKKOS_LAMBDA(int j) { for (int i = j + 1; i < n; ++i) a(i, j) = a(j, i); });
}

}  // namespace impl
}  // namespace kfac
