#pragma once
/// \file embedding_fisher.hpp
/// \brief The Kronecker-factored Fisher of an Embedding as a method object: diag(A) from token
/// counts and G from output gradients (Eschenhagen et al. 2023's K-FAC-expand with one-hot
/// inputs), inverted through G's eigendecomposition.

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "kfac/layers/embedding.hpp"
#include "kfac/methods/embedding/embedding_block.hpp"
#include "kfac/methods/kfac/eigendecomposition.hpp"
#include "kfac/methods/kfac/factors.hpp"
#include "kfac/core/method_settings.hpp"

namespace kfac {
namespace impl {
template <class T>
struct is_eigendecomposition : std::false_type {};
template <class Backend>
struct is_eigendecomposition<Eigendecomposition<Backend>> : std::true_type {};
}  // namespace impl

/// \brief Preconditions a kfac::Embedding with the damped inverse of \f$\mathrm{diag}(A) \otimes G\f$
/// (kfac::EmbeddingBlock): its default method.
///
/// \tparam FactorPolicy how G is kept: Symmetric (default: its upper triangle, averaged as the
///         packed triangle), Full, or Diagonal (only diag(G): a closed-form apply, nothing to
///         decompose).
/// \tparam Eigen the eigendecomposition of G, an object with its settings
///         (kfac::Eigendecomposition<Backend>: jacobi_sweeps, refresh_tolerance).
/// \tparam Prec Precision<Factor, Decomposition>; ScalarPrecision = the Preconditioner's Scalar.
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | Eigen | eigen | G's eigendecomposition and its settings (`with_eigendecomposition`) | `Eigen{}` |
///
/// \code
/// pre.register_layer("tok", kfac::Embedding(50257, 768).with_padding_index(0));  // EmbeddingFisher<>
/// pre.register_layer("pos", kfac::Embedding(1024, 768), kfac::EmbeddingFisher<kfac::Diagonal>{});
/// \endcode
template <class FactorPolicy = Symmetric, class Eigen = Eigendecomposition<>, class Prec = ScalarPrecision>
struct EmbeddingFisher : impl::LayerOverrides<EmbeddingFisher<FactorPolicy, Eigen, Prec>> {
  static_assert(std::is_same<FactorPolicy, Symmetric>::value || std::is_same<FactorPolicy, Full>::value ||
                    std::is_same<FactorPolicy, Diagonal>::value,
                "kfac::EmbeddingFisher<Factor, Eigen, Prec>: G is kept as kfac::Symmetric, kfac::Full or "
                "kfac::Diagonal");
  static_assert(impl::is_eigendecomposition<Eigen>::value,
                "kfac::EmbeddingFisher<Factor, Eigen, Prec>: the second template argument must be "
                "kfac::Eigendecomposition<Backend> (G's decomposition)");
  static_assert(impl::is_precision<Prec>::value || std::is_same<Prec, ScalarPrecision>::value,
                "kfac::EmbeddingFisher<Factor, Eigen, Prec>: the third template argument must be a precision");
  /// All template arguments in their slots: make_block instantiates the block only then.
  static constexpr bool well_formed =
      (std::is_same<FactorPolicy, Symmetric>::value || std::is_same<FactorPolicy, Full>::value ||
       std::is_same<FactorPolicy, Diagonal>::value) &&
      impl::is_eigendecomposition<Eigen>::value &&
      (impl::is_precision<Prec>::value || std::is_same<Prec, ScalarPrecision>::value);
  using method_tag = void;
  using factor_policy = FactorPolicy;
  static constexpr const char* name = "embedding_fisher";

  Eigen eigen{};

  EmbeddingFisher() = default;
  explicit EmbeddingFisher(Eigen e) : eigen(std::move(e)) {}
  /// G's eigendecomposition settings (unused with a diagonal G).
  EmbeddingFisher& with_eigendecomposition(Eigen e) {
    eigen = std::move(e);
    return *this;
  }

  template <class LayerType>
  static constexpr bool accepts = std::is_same<LayerType, Embedding>::value;

  template <class LayerType, class Scalar, class Exec>
  using block_type = EmbeddingBlock<FactorPolicy, Eigen, impl::resolve_precision_t<Prec, Scalar>, Scalar, Exec>;

  template <class Scalar, class Exec, class LayerType>
  std::unique_ptr<impl::Block<Scalar, Exec>> make_block(const std::string& layer_name, const LayerType& layer) const {
    if constexpr (!well_formed || !accepts<LayerType>) return nullptr;  // unreachable: a static_assert failed
    else return std::make_unique<block_type<LayerType, Scalar, Exec>>(layer_name, layer, eigen);
  }
};

}  // namespace kfac
