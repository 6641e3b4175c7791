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
/// Observations: the normalized input \f$\hat x\f$ (N, C, H, W), (N, C, L) or (N, C), and the
/// gradient of the loss with respect to y, same shape. Gradient: (dgamma, dbeta), each of length C.
class BatchNorm2d {
 public:
  static constexpr bool is_kronecker = false;
  static constexpr const char* kind = "batch_norm";

  explicit BatchNorm2d(index_t channels) : c_(channels) {
    if (c_ < 1) throw Error("", "BatchNorm2d: expected channels >= 1");
  }
  index_t channels() const { return c_; }
  /// The units of the unit-wise Fisher (its channels), and whether each has a shift (always).
  index_t units() const { return c_; }
  bool bias() const { return true; }
  index_t weight_rows() const { return c_; }
  index_t weight_cols() const { return 1; }
  std::string describe() const { return std::string(kind) + "(c=" + std::to_string(c_) + ")"; }

  std::string check_input(const impl::Extents& e) const {
    if (e.rank < 2 || e[1] != c_)
      return "input has shape " + e.str() + ", expected (batch, " +
             std::to_string(c_) + ", H, W)";
    return {};
  }
  std::string check_output_grad(const impl::Extents& e, const impl::Extents& input) const {
    if (e.rank < 2 || e[1] != c_ || (input[0] > 0 && (e[0] != input[0] || e[2] != input[2] || e[3] != input[3])))
      return "output gradient has shape " + e.str() +
             ", expected (batch, " + std::to_string(c_) + ", H, W) matching the input";
    return {};
  }

  /// Adds, per channel c, the sums over samples of the per-sample products
  /// \f$(g^\gamma g^\gamma, g^\gamma g^\beta, g^\beta g^\beta)\f$ of one micro-batch to
  /// `sums(c, 0..2)`, with \f$g = \sum_{hw}\f$ of scale times the output gradient (times x̂ for
  /// \f$\gamma\f$).
  template <class Exec, class XHat, class Grad, class Sums>
  void add_unit_products(const Exec& exec, const XHat& xhat, const Grad& dy, double scale, const Sums& sums) const {
    const std::size_t hw = dy.extent(2) * dy.extent(3);
    impl::add_unit_products(exec, "kfac::bn::per_sample", xhat.data(), dy.data(), scale, int(dy.extent(0)), int(c_),
                            int(hw), std::size_t(c_) * hw, hw, 1, sums);
  }

 private:
  index_t c_;
};

}  // namespace kfac
