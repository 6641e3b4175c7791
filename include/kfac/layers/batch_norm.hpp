#pragma once
/// \file batch_norm.hpp
/// \brief Layer-type policy for BatchNorm scale-and-shift, y = gamma * xhat + beta.

#include <string>

#include "kfac/error.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief BatchNorm's affine part per channel c: \f$y = \gamma_c \hat x + \beta_c\f$.
///
/// Not Kronecker-factored: following Osawa et al. (2019) its Fisher is taken block-diagonal per
/// channel (unit-wise, 2x2 over \f$(\gamma_c, \beta_c)\f$) or fully diagonal, built from
/// per-sample gradients \f$g^\gamma_{n,c} = \sum_{hw} \partial_y \hat x\f$ and
/// \f$g^\beta_{n,c} = \sum_{hw} \partial_y\f$. Pick the approximation with the factor policy
/// kfac::UnitWise (default) or kfac::Diagonal.
///
/// Observations: the normalized input \f$\hat x\f$ (N, C, H, W) or (N, C), and the gradient of
/// the loss with respect to y, same shape. Gradient: (dgamma, dbeta), each of length C.
class BatchNorm2d {
 public:
  static constexpr bool is_kronecker = false;
  static constexpr const char* kind = "batch_norm";

  explicit BatchNorm2d(index_t channels) : c_(channels) {
    if (c_ < 1) throw Error("", "BatchNorm2d: expected channels >= 1");
  }
  index_t channels() const { return c_; }
  index_t weight_rows() const { return c_; }
  index_t weight_cols() const { return 1; }
  std::string describe() const { return std::string(kind) + "(c=" + std::to_string(c_) + ")"; }

  std::string check_input(const impl::Extents& e) const {
    if (e[1] != c_)
      return "input has shape " + impl::extents_string(e.data(), 4) + ", expected (batch, " +
             std::to_string(c_) + ", H, W)";
    return {};
  }
  std::string check_output_grad(const impl::Extents& e, const impl::Extents& input) const {
    if (e[1] != c_ || (input[0] > 0 && (e[0] != input[0] || e[2] != input[2] || e[3] != input[3])))
      return "output gradient has shape " + impl::extents_string(e.data(), 4) +
             ", expected (batch, " + std::to_string(c_) + ", H, W) matching the input";
    return {};
  }

 private:
  index_t c_;
};

}  // namespace kfac
