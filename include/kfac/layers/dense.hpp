#pragma once
/// \file dense.hpp
/// \brief Layer-type policy for fully connected layers, y = W x + b.

#include <string>

#include "kfac/error.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief Fully connected layer `y = W x + b`, W of shape (out, in).
///
/// Kronecker factors (Martens & Grosse 2015): \f$A = E[\bar a \bar a^T]\f$ with
/// \f$\bar a = (x, 1)\f$ when the layer has a bias (bias as a column of ones), and
/// \f$G = E[g g^T]\f$, g the per-sample gradient of the loss with respect to y.
/// The gradient is the matrix [dW | db] of shape (out, in + bias).
///
/// Observations: input (batch, in); output gradient (batch, out). Row-major.
class Dense {
 public:
  static constexpr bool is_kronecker = true;
  static constexpr const char* kind = "dense";

  Dense(index_t in, index_t out, bool bias = true) : in_(in), out_(out), bias_(bias) {
    if (in < 1 || out < 1) throw Error("", "Dense: expected in >= 1 and out >= 1");
  }

  index_t in() const { return in_; }
  index_t out() const { return out_; }
  bool bias() const { return bias_; }
  index_t a_dim() const { return in_ + (bias_ ? 1 : 0); }
  index_t g_dim() const { return out_; }
  std::string describe() const {
    return std::string(kind) + "(in=" + std::to_string(in_) + ",out=" + std::to_string(out_) +
           ",bias=" + std::to_string(int(bias_)) + ")";
  }

  /// Empty when the input extents are valid, else what was expected.
  std::string check_input(const impl::Extents& e) const {
    if (e[1] != in_ || e[2] != 1 || e[3] != 1)
      return "input has shape " + impl::extents_string(e.data(), 4) + ", expected (batch, " +
             std::to_string(in_) + ")";
    return {};
  }
  std::string check_output_grad(const impl::Extents& e, const impl::Extents&) const {
    if (e[1] != out_ || e[2] != 1 || e[3] != 1)
      return "output gradient has shape " + impl::extents_string(e.data(), 4) +
             ", expected (batch, " + std::to_string(out_) + ")";
    return {};
  }
  /// Extents of the weight gradient seen as a matrix.
  index_t weight_rows() const { return out_; }
  index_t weight_cols() const { return in_; }

  /// Rows of the matrices whose Gram products give A and G:
  /// A = rows_a^T rows_a / a_normalizer, G = rows_g^T rows_g / g_normalizer.
  index_t a_rows(const impl::Extents& input) const { return index_t(input[0]); }
  index_t g_rows(const impl::Extents& grad) const { return index_t(grad[0]); }
  double a_normalizer(const impl::Extents& input) const { return double(input[0]); }
  double g_normalizer(const impl::Extents& grad) const { return double(grad[0]); }
  /// Whether the input (batch, in), row-major, is rows_a itself (no bias column): a block whose
  /// arithmetic type is the input's then folds it without copying it. The output gradient is
  /// rows_g itself whenever it needs no scaling.
  bool a_rows_are_input() const { return !bias_; }
  bool g_rows_are_output_grad() const { return true; }

  template <class Exec, class Scalar, class Rows>
  void fill_a_rows(const Exec& exec, const impl::Tensor4<Scalar, Exec>& x, const Rows& rows) const {
    using T = typename Rows::non_const_value_type;
    const int n = int(x.extent(0)), in = in_;
    const bool bias = bias_;
    Kokkos::parallel_for(
        "kfac::dense::a_rows",
        impl::RowMajorRange<Exec>(exec, {0, 0}, {n, in + int(bias)}),
        KOKKOS_LAMBDA(int r, int c) { rows(r, c) = c < in ? T(x(r, c, 0, 0)) : T(1); });
  }
  template <class Exec, class Scalar, class Rows>
  void fill_g_rows(const Exec& exec, const impl::Tensor4<Scalar, Exec>& g, double scale,
                   const Rows& rows) const {
    using T = typename Rows::non_const_value_type;
    const int n = int(g.extent(0)), out = out_;
    const T s = T(scale);
    Kokkos::parallel_for(
        "kfac::dense::g_rows",
        impl::RowMajorRange<Exec>(exec, {0, 0}, {n, out}),
        KOKKOS_LAMBDA(int r, int c) { rows(r, c) = s * T(g(r, c, 0, 0)); });
  }

 private:
  index_t in_, out_;
  bool bias_;
};

}  // namespace kfac
