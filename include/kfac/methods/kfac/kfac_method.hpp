#pragma once
/// \file kfac_method.hpp
/// \brief K-FAC as a method object (Martens & Grosse 2015; distributed as in KAISA, Pauloski
/// et al. 2022): a factor policy, an inversion policy with its settings, and a precision.

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "kfac/core/precision.hpp"
#include "kfac/core/traits.hpp"
#include "kfac/methods/diagonal/diagonal_block.hpp"
#include "kfac/methods/kfac/cholesky.hpp"
#include "kfac/methods/kfac/eigendecomposition.hpp"
#include "kfac/methods/kfac/factors.hpp"
#include "kfac/methods/kfac/kronecker_block.hpp"
#include "kfac/methods/kfac/newton_schulz.hpp"
#include "kfac/methods/kfac/randomized_eigen.hpp"
#include "kfac/core/method_settings.hpp"

namespace kfac {

/// \brief Kronecker-factored preconditioning of a Dense or Conv2d layer,
/// \f$(G \otimes A + \gamma I)^{-1}\f$ (or the factored-damping inverses of Cholesky / Newton–Schulz).
///
/// \tparam FactorPolicy Symmetric (default), Full or Diagonal.
/// \tparam Inversion Eigendecomposition<> (default), RandomizedEigen<>, Cholesky<> or NewtonSchulz; an object, so
///         its settings (e.g. NewtonSchulz::with_max_iterations) travel with the method.
/// \tparam Prec Precision<Factor, Decomposition>; ScalarPrecision = the Preconditioner's Scalar.
///
/// \code
/// pre.register_layer("fc1", kfac::Dense(784, 256),
///                    kfac::KFAC<kfac::Full, kfac::NewtonSchulz>(kfac::NewtonSchulz{}.with_max_iterations(50))
///                        .with_damping(3e-3).with_inv_update_steps(20));
/// \endcode
template <class FactorPolicy = Symmetric, class Inversion = Eigendecomposition<>,
          class Prec = ScalarPrecision>
struct KFAC : impl::LayerOverrides<KFAC<FactorPolicy, Inversion, Prec>> {
  // One check per template argument, in order, so that an argument in the wrong slot
  // (KFAC<Cholesky<>>) is named as such rather than by a member it lacks.
  static_assert(is_factor_policy_v<FactorPolicy>,
                "kfac::KFAC<Factor, Inversion, Prec>: the first template argument must be a factor "
                "policy (kfac::Symmetric, kfac::Full, kfac::Diagonal); the inversion goes second, "
                "e.g. kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>>");
  static_assert(is_inversion_v<Inversion>,
                "kfac::KFAC<Factor, Inversion, Prec>: the second template argument must be an "
                "inversion policy (kfac::Eigendecomposition<>, kfac::RandomizedEigen<>, kfac::Cholesky<>, "
                "kfac::NewtonSchulz)");
  static_assert(impl::is_precision<Prec>::value || std::is_same<Prec, ScalarPrecision>::value,
                "kfac::KFAC<Factor, Inversion, Prec>: the third template argument must be a precision "
                "(kfac::ScalarPrecision, kfac::MixedPrecision, kfac::HalfPrecision, kfac::Precision<F, D>)");
  static_assert(!std::is_same<FactorPolicy, UnitWise>::value,
                "kfac::KFAC: UnitWise is a BatchNorm2d approximation; use kfac::UnitWiseFisher");
  static_assert(!impl::factor_is_diagonal<FactorPolicy>::value || std::is_same<Inversion, Eigendecomposition<>>::value,
                "kfac::KFAC: Diagonal factors are inverted in closed form; leave the inversion "
                "policy at its default");
  /// All template arguments in their slots: make_block instantiates the block only then (no
  /// page of errors from inside it after the static_asserts above).
  static constexpr bool well_formed = is_factor_policy_v<FactorPolicy> && is_inversion_v<Inversion> &&
                                      (impl::is_precision<Prec>::value || std::is_same<Prec, ScalarPrecision>::value) &&
                                      !std::is_same<FactorPolicy, UnitWise>::value;
  using method_tag = void;
  using factor_policy = FactorPolicy;
  using inversion_type = Inversion;
  static constexpr const char* name = "kfac";

  Inversion inversion{};

  KFAC() = default;
  explicit KFAC(Inversion inv) : inversion(std::move(inv)) {}
  KFAC& with_inversion(Inversion inv) {
    inversion = std::move(inv);
    return *this;
  }

  template <class LayerType>
  static constexpr bool accepts = LayerType::is_kronecker;

  /// The typed per-layer state, once the layer, Scalar and Exec are known: KroneckerBlock, or
  /// DiagonalBlock (a closed form) for Diagonal factors.
  template <class LayerType, class Scalar, class Exec>
  using block_type = std::conditional_t<
      impl::factor_is_diagonal<FactorPolicy>::value,
      DiagonalBlock<LayerType, impl::resolve_precision_t<Prec, Scalar>, Scalar, Exec>,
      KroneckerBlock<LayerType, FactorPolicy, Inversion, impl::resolve_precision_t<Prec, Scalar>, Scalar, Exec>>;

  template <class Scalar, class Exec, class LayerType>
  std::unique_ptr<impl::Block<Scalar, Exec>> make_block(const std::string& layer_name,
                                                       const LayerType& layer) const {
    if constexpr (!well_formed) return nullptr;  // unreachable: a static_assert above failed
    else if constexpr (impl::factor_is_diagonal<FactorPolicy>::value)
      return std::make_unique<block_type<LayerType, Scalar, Exec>>(layer_name, layer);
    else return std::make_unique<block_type<LayerType, Scalar, Exec>>(layer_name, layer, inversion);
  }
};

}  // namespace kfac
