#pragma once
// SYRK: the Gram products of the factors' observation rows.
#include <Kokkos_Core.hpp>
#include <type_traits>

#include "kfac/linalg/common.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/vendor.hpp"

namespace kfac {
namespace impl {

/// Whether `syrk_t_upper` on `Exec` for `T` leaves C unread when beta = 0 (so C may start
/// uninitialised): the vendor syrk (op::SyrkT) and Kokkos Kernels' GEMM never read it, and the
/// portable caller zeroes its C once anyway (KroneckerStatistics).
template <class Exec, class T>
constexpr bool syrk_overwrites_v = Vendor<op::SyrkT, Exec, T>::available;

/// Upper triangle of C = alpha R^T R + beta C for R (k x n), column-major (LayoutLeft) or
/// row-major (LayoutRight). A row-major R is the column-major R^T, so no layout needs a copy.
/// The portable path computes the full product with GEMM; the vendor path (op::SyrkT) uses
/// syrk (half the flops).
template <class Exec, class T, class R>
void syrk_t_upper(const Exec& exec, T alpha, const R& r, T beta, const Matrix<T, Exec>& c) {
  constexpr bool row_major = std::is_same<typename R::array_layout, Kokkos::LayoutRight>::value;
  static_assert(row_major || std::is_same<typename R::array_layout, Kokkos::LayoutLeft>::value,
                "kfac::impl::syrk_t_upper: R must be LayoutLeft or LayoutRight");
  require_shape(c.extent(0) == c.extent(1) && r.extent(1) == c.extent(0), "syrk", "C must be n x n for R k x n",
                c.extent(0), c.extent(1), r.extent(0), r.extent(1));
  const int n = int(c.extent(0)), k = int(r.extent(0));
  if (n == 0) return;
  if constexpr (Vendor<op::SyrkT, Exec, T>::available) {
    Vendor<op::SyrkT, Exec, T>::run(exec, alpha, r, beta, c);
  } else if constexpr (row_major) {
    const Kokkos::View<const T**, Kokkos::LayoutLeft, typename Exec::memory_space,
                       Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        rt(r.data(), n, k);
    gemm(exec, "N", "T", alpha, rt, rt, beta, c);
  } else {
    gemm(exec, "T", "N", alpha, r, r, beta, c);
  }
}

}  // namespace impl
}  // namespace kfac
