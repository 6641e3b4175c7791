#pragma once
/// \file diagonal_fisher.hpp
/// \brief The diagonal Fisher as a method object: the generic fallback any parameter
/// (kfac::Parameter) can be registered with.

#include <memory>
#include <string>
#include <type_traits>

#include "kfac/layers/parameter.hpp"
#include "kfac/methods/diagonal/diagonal_fisher_block.hpp"
#include "kfac/core/method_settings.hpp"

namespace kfac {

/// \brief Preconditions a kfac::Parameter by its damped diagonal Fisher, estimated from the
/// squared gradient (kfac::DiagonalFisherBlock states the scaling): the default method of
/// Parameter, so that a model's every parameter can be preconditioned.
///
/// \tparam Prec Precision<Factor, Decomposition>; ScalarPrecision = the Preconditioner's Scalar.
///
/// No settings of its own beyond the per-layer overrides (damping, factor_decay, intervals;
/// inv_update_steps has nothing to decompose).
///
/// \code
/// pre.register_layer("pos", kfac::Parameter(1024, 768));  // DiagonalFisher<>
/// // each step: pre.observe_output_grad("pos", any (batch, ...) tensor); pre.set_gradient("pos", dpos);
/// \endcode
template <class Prec = ScalarPrecision>
struct DiagonalFisher : impl::LayerOverrides<DiagonalFisher<Prec>> {
  static_assert(impl::is_precision<Prec>::value || std::is_same<Prec, ScalarPrecision>::value,
                "kfac::DiagonalFisher<Prec>: the template argument must be a precision");
  using method_tag = void;
  static constexpr const char* name = "diagonal_fisher";

  template <class LayerType>
  static constexpr bool accepts = std::is_same<LayerType, Parameter>::value;

  template <class LayerType, class Scalar, class Exec>
  using block_type = DiagonalFisherBlock<impl::resolve_precision_t<Prec, Scalar>, Scalar, Exec>;

  template <class Scalar, class Exec, class LayerType>
  std::unique_ptr<impl::Block<Scalar, Exec>> make_block(const std::string& layer_name, const LayerType& layer) const {
    if constexpr (!accepts<LayerType>) return nullptr;  // unreachable: register_layer's static_assert failed
    else return std::make_unique<block_type<LayerType, Scalar, Exec>>(layer_name, layer);
  }
};

}  // namespace kfac
