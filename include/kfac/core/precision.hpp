#pragma once
/// \file precision.hpp
/// \brief Precision policy: the scalar types used for factor storage and for decompositions.
///
/// Large-batch K-FAC (Osawa et al. 2019) keeps factors in reduced precision and runs the
/// decompositions in a wider type. Gradients use the scalar type of the Preconditioner (the
/// host framework's type); preconditioning arithmetic is done in the decomposition type.
///
/// Half-precision factors: `Precision<Half, float>` stores binary16 (kfac::Half) on every
/// backend. `Precision<KokkosHalf, float>` asks for Kokkos' own `half_t`: where the Kokkos build
/// has a real two-byte half_t (CUDA builds; `KOKKOS_HALF_T_IS_FLOAT` false) it stores the same
/// binary16 bits as kfac::Half; where half_t is `float` in disguise (Kokkos 3.4's Serial and
/// OpenMP builds) it is refused at compile time instead of silently storing 4 bytes a value.
/// (`Precision<Kokkos::Experimental::half_t, float>` itself cannot be told from
/// `Precision<float>` on those builds: there it is the same type.)

#include <Kokkos_Core.hpp>
#include <type_traits>

#include "kfac/core/half.hpp"

namespace kfac {

/// Tag: factors stored as Kokkos::Experimental::half_t, which must be a real half type.
struct KokkosHalf {};

namespace impl {
#if defined(KOKKOS_HALF_T_IS_FLOAT) && !KOKKOS_HALF_T_IS_FLOAT
inline constexpr bool kokkos_half_is_float = false;
template <class F>
inline constexpr bool is_kokkos_half_v =
    std::is_same<F, KokkosHalf>::value || std::is_same<F, Kokkos::Experimental::half_t>::value;
#else
inline constexpr bool kokkos_half_is_float = true;
template <class F>
inline constexpr bool is_kokkos_half_v = std::is_same<F, KokkosHalf>::value;
#endif
template <class F>
inline constexpr bool is_half_v = std::is_same<F, Half>::value || is_kokkos_half_v<F>;
}  // namespace impl

/// \brief Chooses the scalar types of one layer.
/// \tparam Factor storage type of the running Kronecker factors: float, double, kfac::Half
///         (binary16), or KokkosHalf / Kokkos::Experimental::half_t where that is a real half
///         type (stored as kfac::Half).
/// \tparam Decomposition type of eigenvectors/inverses and of the preconditioning arithmetic
///         (float or double).
template <class Factor, class Decomposition = Factor>
struct Precision {
  static_assert(!(std::is_same<Factor, KokkosHalf>::value && impl::kokkos_half_is_float),
                "kfac::Precision<KokkosHalf, ...>: Kokkos::Experimental::half_t is float in "
                "this Kokkos build (KOKKOS_HALF_T_IS_FLOAT; Kokkos 3.4 without CUDA), so factors "
                "would take 4 bytes a value; use kfac::Half (binary16 storage on every backend) "
                "or float");
  static_assert(std::is_floating_point<Factor>::value || impl::is_half_v<Factor>,
                "kfac::Precision: Factor must be float, double, kfac::Half or KokkosHalf");
  static_assert(std::is_floating_point<Decomposition>::value,
                "kfac::Precision: Decomposition must be float or double");
  using factor_type = std::conditional_t<impl::is_half_v<Factor>, Half, Factor>;
  using decomposition_type = Decomposition;
};

using DoublePrecision = Precision<double>;
using SinglePrecision = Precision<float>;
/// Factors stored in float, decompositions in double.
using MixedPrecision = Precision<float, double>;
/// Factors stored in binary16, decompositions in float (Osawa et al. 2019).
using HalfPrecision = Precision<Half, float>;

namespace impl {
template <class T>
struct is_precision : std::false_type {};
template <class F, class D>
struct is_precision<Precision<F, D>> : std::true_type {};
}  // namespace impl

}  // namespace kfac
