#pragma once
/// \file precision.hpp
/// \brief Precision policy: the scalar types used for factor storage and for decompositions.
///
/// Large-batch K-FAC (Osawa et al. 2019) keeps factors in reduced precision and runs the
/// decompositions in a wider type. Gradients use the scalar type of the Preconditioner (the
/// host framework's type); preconditioning arithmetic is done in the decomposition type.

#include <type_traits>

namespace kfac {

/// \brief Chooses the scalar types of one layer.
/// \tparam Factor storage type of the running Kronecker factors (float or double).
/// \tparam Decomposition type of eigenvectors/inverses and of the preconditioning arithmetic.
template <class Factor, class Decomposition = Factor>
struct Precision {
  static_assert(std::is_floating_point<Factor>::value,
                "kfac::Precision: Factor must be float or double");
  static_assert(std::is_floating_point<Decomposition>::value,
                "kfac::Precision: Decomposition must be float or double");
  using factor_type = Factor;
  using decomposition_type = Decomposition;
};

using DoublePrecision = Precision<double>;
using SinglePrecision = Precision<float>;
/// Factors stored in float, decompositions in double.
using MixedPrecision = Precision<float, double>;

namespace impl {
template <class T>
struct is_precision : std::false_type {};
template <class F, class D>
struct is_precision<Precision<F, D>> : std::true_type {};
}  // namespace impl

}  // namespace kfac
