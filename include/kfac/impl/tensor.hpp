#pragma once
// The type-erased forms in which observations and gradients cross into a layer.
#include <Kokkos_Core.hpp>
#include <array>
#include <string>

namespace kfac {
namespace impl {

/// A rank-4 row-major view; rank-2 (batch, features) data is seen as (batch, features, 1, 1),
/// which has the same memory layout.
template <class Scalar, class Exec>
using Tensor4 = Kokkos::View<const Scalar****, Kokkos::LayoutRight, typename Exec::memory_space,
                             Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
/// A gradient seen as a row-major matrix (rows = outputs, cols = flattened inputs).
template <class Scalar, class Exec>
using GradMatrix = Kokkos::View<Scalar**, Kokkos::LayoutRight, typename Exec::memory_space,
                                Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class Scalar, class Exec>
using GradVector = Kokkos::View<Scalar*, Kokkos::LayoutRight, typename Exec::memory_space,
                                Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

using Extents = std::array<long, 4>;

inline std::string extents_string(const long* e, int rank) {
  std::string s = "(";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(e[i]);
  return s + ")";
}

template <class T4>
Extents extents_of(const T4& t) {
  return {long(t.extent(0)), long(t.extent(1)), long(t.extent(2)), long(t.extent(3))};
}

}  // namespace impl
}  // namespace kfac
