#pragma once
/// \file default_method.hpp
/// \brief The method a layer type gets when register_layer is given none, and the mapping of
/// the first API's policy lists (register_layer<Layer, Factor, Inversion, Prec>) onto methods.

#include <type_traits>

#include "kfac/layers/embedding.hpp"
#include "kfac/layers/parameter.hpp"
#include "kfac/methods/diagonal/diagonal_fisher.hpp"
#include "kfac/methods/embedding/embedding_fisher.hpp"
#include "kfac/methods/kfac/kfac_method.hpp"
#include "kfac/methods/unit_wise/unit_wise_fisher.hpp"

namespace kfac {

/// \brief default_method<L>::type: KFAC<> for Kronecker layer types (Dense, Conv2d),
/// EmbeddingFisher<> for Embedding, DiagonalFisher<> for Parameter, UnitWiseFisher<> for the others
/// (BatchNorm2d, LayerNorm).
/// Specialize it for a layer type of your own.
template <class LayerType, class = void>
struct default_method {
  using type = std::conditional_t<LayerType::is_kronecker, KFAC<>, UnitWiseFisher<>>;
};
template <>
struct default_method<Embedding> {
  using type = EmbeddingFisher<>;
};
template <>
struct default_method<Parameter> {
  using type = DiagonalFisher<>;
};

namespace impl {
template <class LayerType>
struct default_factor {
  using type = std::conditional_t<LayerType::is_kronecker, Symmetric, UnitWise>;
};

/// The method named by a policy list: K-FAC for Kronecker layers, the unit-wise Fisher otherwise.
template <class LayerType, class FactorPolicy, class Inversion, class Prec>
using method_from_policies =
    std::conditional_t<LayerType::is_kronecker, KFAC<FactorPolicy, Inversion, Prec>,
                       UnitWiseFisher<FactorPolicy, Prec>>;
/// Placeholder of register_layer's policy list: "not given".
struct UnsetPolicy {};

/// The method of register_layer<LayerType, FactorPolicy, Inversion, Prec>: default_method when
/// no policy was given, else the one the policies name.
template <class LayerType, class FactorPolicy, class Inversion, class Prec, class Scalar>
using method_for = std::conditional_t<
    std::is_same<FactorPolicy, UnsetPolicy>::value && std::is_same<Inversion, Eigendecomposition<>>::value &&
        std::is_same<Prec, Precision<Scalar>>::value,
    typename default_method<LayerType>::type,
    method_from_policies<LayerType,
                         std::conditional_t<std::is_same<FactorPolicy, UnsetPolicy>::value,
                                            typename default_factor<LayerType>::type, FactorPolicy>,
                         Inversion, Prec>>;
}  // namespace impl

}  // namespace kfac
