#pragma once
/// \file unit_wise_fisher.hpp
/// \brief BatchNorm's unit-wise (or diagonal) Fisher as a method object (Osawa et al. 2019).

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "kfac/core/method_settings.hpp"
#include "kfac/methods/unit_wise/batch_norm_block.hpp"

namespace kfac {
namespace impl {
template <class L, class = void>
struct has_unit_products : std::false_type {};
template <class L>
struct has_unit_products<L, std::void_t<decltype(std::declval<const L&>().units()),
                                        decltype(std::declval<const L&>().bias())>>
    : std::integral_constant<bool, !L::is_kronecker> {};
}  // namespace impl

/// \brief Per-unit 2x2 Fisher blocks over \f$(\gamma_c, \beta_c)\f$ of a normalization layer
/// (the channels of a BatchNorm2d, the features of a LayerNorm), inverted in closed form.
/// \tparam Approx UnitWise (default: the 2x2 blocks) or Diagonal (their diagonals).
/// \tparam Prec Precision<Factor, Decomposition>; ScalarPrecision = the Preconditioner's Scalar.
template <class Approx = UnitWise, class Prec = ScalarPrecision>
struct UnitWiseFisher : impl::LayerOverrides<UnitWiseFisher<Approx, Prec>> {
  static_assert(std::is_same<Approx, UnitWise>::value || std::is_same<Approx, Diagonal>::value,
                "kfac::UnitWiseFisher: the approximation is kfac::UnitWise or kfac::Diagonal");
  using method_tag = void;
  static constexpr const char* name = "unit_wise";

  /// Layer types with units of a scale and an optional shift: BatchNorm2d, LayerNorm, or one of
  /// yours with `units()`, `bias()` and `add_unit_products` (see LayerNorm).
  template <class LayerType>
  static constexpr bool accepts = impl::has_unit_products<LayerType>::value;

  template <class LayerType, class Scalar, class Exec>
  using block_type = BatchNormBlock<Approx, impl::resolve_precision_t<Prec, Scalar>, Scalar, Exec, LayerType>;

  template <class Scalar, class Exec, class LayerType>
  std::unique_ptr<impl::Block<Scalar, Exec>> make_block(const std::string& layer_name,
                                                       const LayerType& layer) const {
    if constexpr (std::is_same<Approx, UnitWise>::value || std::is_same<Approx, Diagonal>::value)
      return std::make_unique<block_type<LayerType, Scalar, Exec>>(layer_name, layer);
    else return nullptr;  // unreachable: the static_assert above failed
  }
};

}  // namespace kfac
