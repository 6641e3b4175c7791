#pragma once
// Device-callable math that exists under one name in both Kokkos 3.4 and 4.x.
#include <Kokkos_Core.hpp>

#include "kfac/config.hpp"

namespace kfac {
namespace impl {

template <class T>
KOKKOS_INLINE_FUNCTION T sqrt_(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::sqrt(x);
#else
  return Kokkos::Experimental::sqrt(x);
#endif
}

template <class T>
KOKKOS_INLINE_FUNCTION T exp_(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::exp(x);
#else
  return Kokkos::Experimental::exp(x);
#endif
}

template <class T>
KOKKOS_INLINE_FUNCTION T abs_(T x) {
  return x < T(0) ? -x : x;
}

/// True for finite values. Written without isfinite so it compiles on every backend.
template <class T>
KOKKOS_INLINE_FUNCTION bool finite_(T x) {
  return (x - x) == T(0);
}

template <class T, class Exec>
using Matrix = Kokkos::View<T**, Kokkos::LayoutLeft, typename Exec::memory_space>;

/// 2-D ranges whose first index runs fastest, across tiles and inside them, for kernels over
/// LayoutLeft matrices. `Kokkos::Rank<2, Iterate::Left>` alone orders only the tiles: inside a
/// tile the host default is row-major, which made such kernels stride through memory (5-20x
/// slower on the Serial backend at n >= 1024).
template <class Exec>
using ColumnMajorRange =
    Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2, Kokkos::Iterate::Left, Kokkos::Iterate::Left>>;
/// The same with the last index fastest, for kernels over LayoutRight matrices.
template <class Exec>
using RowMajorRange =
    Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2, Kokkos::Iterate::Right, Kokkos::Iterate::Right>>;
template <class T, class Exec>
using Vector = Kokkos::View<T*, typename Exec::memory_space>;

template <class Exec>
constexpr bool host_accessible_v =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename Exec::memory_space>::accessible;

}  // namespace impl
}  // namespace kfac
