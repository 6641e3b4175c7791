#pragma once
/// \file layer_norm.hpp
/// \brief Layer-type policy for LayerNorm's elementwise affine part, y = gamma * xhat + beta,
/// over the last dimension (also RMSNorm-style, scale only).

#include <string>

#include "kfac/error.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief LayerNorm's affine part per feature d: \f$y = \gamma_d \hat x_d + \beta_d\f$, the
/// normalization over the last dimension (D features), applied to samples or to every token of
/// a sequence.
///
/// Not Kronecker-factored: as for BatchNorm2d (Osawa et al. 2019), its Fisher is taken
/// block-diagonal per feature (unit-wise, 2x2 over \f$(\gamma_d, \beta_d)\f$; 1x1 without a
/// shift) or diagonal, from the per-sample gradients \f$g^\gamma_{n,d} = \sum_t \partial_y \hat x\f$
/// and \f$g^\beta_{n,d} = \sum_t \partial_y\f$ (sums over the sample's tokens). Pick the
/// approximation with the method kfac::UnitWiseFisher (default kfac::UnitWise, or kfac::Diagonal).
///
/// Observations: the normalized input \f$\hat x\f$ (batch, D) or (batch, tokens, D) (for
/// RMSNorm, x divided by its root mean square), and the gradient of the loss with respect to y,
/// same shape. Gradient: dgamma (D), and dbeta (D) when the layer has a shift (`bias`).
class LayerNorm {
 public:
  static constexpr bool is_kronecker = false;
  static constexpr const char* kind = "layer_norm";

  /// \param features [in] D, the size of the normalized last dimension (>= 1)
  /// \param bias [in] whether the layer has a shift beta (false: RMSNorm-style, scale only)
  explicit LayerNorm(index_t features, bool bias = true) : d_(features), bias_(bias) {
    if (d_ < 1) throw Error("", "LayerNorm: expected features >= 1");
  }
  index_t features() const { return d_; }
  /// The units of the unit-wise Fisher (the features), and whether each has a shift.
  index_t units() const { return d_; }
  bool bias() const { return bias_; }
  index_t weight_rows() const { return d_; }
  index_t weight_cols() const { return 1; }
  std::string describe() const {
    return std::string(kind) + "(d=" + std::to_string(d_) + (bias_ ? "" : ",bias=0") + ")";
  }

  std::string check_input(const impl::Extents& e) const {
    if (!impl::are_feature_rows(e, d_))
      return "input has shape " + e.str() + ", expected (batch, " + std::to_string(d_) + ") or (batch, tokens, " +
             std::to_string(d_) + ")";
    return {};
  }
  std::string check_output_grad(const impl::Extents& e, const impl::Extents& input) const {
    if (!impl::are_feature_rows(e, d_) ||
        (input[0] > 0 && (e[0] != input[0] || impl::tokens_of(e, d_) != impl::tokens_of(input, d_))))
      return "output gradient has shape " + e.str() + ", expected (batch, " + std::to_string(d_) +
             ") or (batch, tokens, " + std::to_string(d_) + ") matching the input";
    return {};
  }

  /// Adds, per feature d, the sums over samples of the per-sample products
  /// \f$(g^\gamma g^\gamma, g^\gamma g^\beta, g^\beta g^\beta)\f$ of one micro-batch to
  /// `sums(d, 0..2)`, each g a sum over the sample's tokens of scale times the output gradient
  /// (times x̂ for \f$\gamma\f$).
  template <class Exec, class XHat, class Grad, class Sums>
  void add_unit_products(const Exec& exec, const XHat& xhat, const Grad& dy, double scale, const Sums& sums) const {
    const impl::Extents e = impl::extents_of(dy);
    const int t = int(impl::tokens_of(e, d_));
    impl::add_unit_products(exec, "kfac::layer_norm::per_sample", xhat.data(), dy.data(), scale, int(e[0]), int(d_),
                            t, std::size_t(t) * std::size_t(d_), 1, std::size_t(d_), sums);
  }

 private:
  index_t d_;
  bool bias_ = true;
};

}  // namespace kfac
