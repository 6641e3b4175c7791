#pragma once
/// \file raw.hpp
/// \brief Opt-in adapter: Kokkos views over memory the host framework owns, from a raw pointer
/// and extents.
///
/// The views are unmanaged and row-major (LayoutRight), the layout every kfac entry point
/// expects: no copy is made, nothing is freed, and the memory must outlive every use of the
/// view (for gradients handed to Preconditioner::set_gradient, until step() returns). A `T*`
/// gives a writable view (gradients are preconditioned in place through it), a `const T*` a
/// read-only one (enough for observations).
///
/// \code
/// float* x = ...;  // (batch, in), row-major, owned by the framework
/// pre.observe_input("fc1", kfac::adapters::from_raw(x, batch, in));
/// // device memory: name its space
/// pre.observe_input("fc1", kfac::adapters::from_raw<Kokkos::CudaSpace>(d_x, batch, in));
/// \endcode

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <string>

#include "kfac/error.hpp"

namespace kfac {
namespace impl {
inline void check_raw_pointer(const void* data, std::size_t count) {
  if (data == nullptr && count > 0)
    throw Error("", "adapters::from_raw: null pointer for " + std::to_string(count) + " values");
}
}  // namespace impl

namespace adapters {

/// \brief An unmanaged row-major view, e.g. `unmanaged_view<const float**>`.
/// \tparam DataType Kokkos data type (`T*`, `T**`, `T***`, `T****`, optionally const).
/// \tparam MemorySpace where the memory lives (default Kokkos::HostSpace).
template <class DataType, class MemorySpace = Kokkos::HostSpace>
using unmanaged_view = Kokkos::View<DataType, Kokkos::LayoutRight, MemorySpace,
                                    Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// \brief Rank-1 view of `n0` values at `data` (a bias gradient, BatchNorm's dgamma/dbeta).
/// \tparam MemorySpace the space `data` lives in; checked by nothing but the caller.
/// \param data [in] first value; may be null only when n0 is 0.
/// \param n0 [in] the number of values.
template <class MemorySpace = Kokkos::HostSpace, class T>
unmanaged_view<T*, MemorySpace> from_raw(T* data, std::size_t n0) {
  static_assert(Kokkos::is_memory_space<MemorySpace>::value,
                "kfac::adapters::from_raw: the template argument must be a Kokkos memory space");
  impl::check_raw_pointer(data, n0);
  return unmanaged_view<T*, MemorySpace>(data, n0);
}

/// \brief Rank-2 row-major view (n0 rows of n1 values): Dense observations (batch, features)
/// and weight gradients (out, in).
template <class MemorySpace = Kokkos::HostSpace, class T>
unmanaged_view<T**, MemorySpace> from_raw(T* data, std::size_t n0, std::size_t n1) {
  static_assert(Kokkos::is_memory_space<MemorySpace>::value,
                "kfac::adapters::from_raw: the template argument must be a Kokkos memory space");
  impl::check_raw_pointer(data, n0 * n1);
  return unmanaged_view<T**, MemorySpace>(data, n0, n1);
}

/// \brief Rank-3 row-major view: Dense observations over sequences (batch, tokens, features).
template <class MemorySpace = Kokkos::HostSpace, class T>
unmanaged_view<T***, MemorySpace> from_raw(T* data, std::size_t n0, std::size_t n1, std::size_t n2) {
  static_assert(Kokkos::is_memory_space<MemorySpace>::value,
                "kfac::adapters::from_raw: the template argument must be a Kokkos memory space");
  impl::check_raw_pointer(data, n0 * n1 * n2);
  return unmanaged_view<T***, MemorySpace>(data, n0, n1, n2);
}

/// \brief Rank-4 row-major view: NCHW activations and output gradients of Conv2d and
/// BatchNorm2d, and Conv2d weight gradients (O, C, kh, kw).
template <class MemorySpace = Kokkos::HostSpace, class T>
unmanaged_view<T****, MemorySpace> from_raw(T* data, std::size_t n0, std::size_t n1,
                                            std::size_t n2, std::size_t n3) {
  static_assert(Kokkos::is_memory_space<MemorySpace>::value,
                "kfac::adapters::from_raw: the template argument must be a Kokkos memory space");
  impl::check_raw_pointer(data, n0 * n1 * n2 * n3);
  return unmanaged_view<T****, MemorySpace>(data, n0, n1, n2, n3);
}

}  // namespace adapters
}  // namespace kfac
