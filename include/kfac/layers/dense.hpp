#pragma once
/// \file dense.hpp
/// \brief Layer-type policy for fully connected layers, y = W x + b.

#include <string>

#include "kfac/error.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief Fully connected layer `y = W x + b`, W of shape (out, in), on samples or on sequences.
///
/// Kronecker factors (Martens & Grosse 2015): \f$A = E[\bar a \bar a^T]\f$ with
/// \f$\bar a = (x, 1)\f$ when the layer has a bias (bias as a column of ones), and
/// \f$G = E[g g^T]\f$, g the per-sample gradient of the loss with respect to y.
/// The gradient is the matrix [dW | db] of shape (out, in + bias).
///
/// Observations: input (batch, in) or, for a layer applied to every token of a sequence,
/// (batch, tokens, in); output gradient (batch, out) or (batch, tokens, out), with the input's
/// token count. Row-major. A sequence's weight gradient sums over its tokens; the two
/// approximations of Eschenhagen et al. (2023) give its Fisher a Kronecker form
/// (with N sequences of T tokens, a and g the input and per-sequence output gradient of each token):
/// - Tokens::expand (default): tokens act as extra samples,
///   \f$A = \frac{1}{NT}\sum_{n,t} \bar a_{nt} \bar a_{nt}^T\f$,
///   \f$G = \frac{1}{N}\sum_{n,t} g_{nt} g_{nt}^T\f$;
/// - Tokens::reduce: tokens are reduced before the outer products, inputs averaged and output
///   gradients summed, \f$A = \frac{1}{N}\sum_n \bar a_n \bar a_n^T\f$ with
///   \f$\bar a_n = \frac{1}{T}\sum_t \bar a_{nt}\f$, \f$G = \frac{1}{N}\sum_n g_n g_n^T\f$ with
///   \f$g_n = \sum_t g_{nt}\f$.
/// Both are exact when T = 1. "Per-sequence" output gradients are those of the loss of one
/// sequence: with LossReduction::mean (the mean over the batch dimension), kfac multiplies the
/// observed gradients by N, so a loss averaged over every token of the batch gives each
/// sequence the mean over its tokens.
class Dense {
 public:
  static constexpr bool is_kronecker = true;
  static constexpr const char* kind = "dense";
  /// How a (batch, tokens, in) observation forms A and G (see the class description).
  enum class Tokens { expand, reduce };

  Dense(index_t in, index_t out, bool bias = true) : in_(in), out_(out), bias_(bias) {
    if (in < 1 || out < 1) throw Error("", "Dense: expected in >= 1 and out >= 1");
  }
  /// The approximation for sequences: Tokens::expand (default) or Tokens::reduce.
  Dense& with_tokens(Tokens t) {
    tokens_ = t;
    return *this;
  }

  index_t in() const { return in_; }
  index_t out() const { return out_; }
  bool bias() const { return bias_; }
  Tokens tokens() const { return tokens_; }
  index_t a_dim() const { return in_ + (bias_ ? 1 : 0); }
  index_t g_dim() const { return out_; }
  std::string describe() const {
    return std::string(kind) + "(in=" + std::to_string(in_) + ",out=" + std::to_string(out_) +
           ",bias=" + std::to_string(int(bias_)) + (tokens_ == Tokens::reduce ? ",tokens=reduce" : "") + ")";
  }

  /// Empty when the input extents are valid, else what was expected.
  std::string check_input(const impl::Extents& e) const {
    if (!impl::are_feature_rows(e, in_))
      return "input has shape " + e.str() + ", expected (batch, " + std::to_string(in_) + ") or (batch, tokens, " +
             std::to_string(in_) + ")";
    return {};
  }
  std::string check_output_grad(const impl::Extents& e, const impl::Extents& input) const {
    if (!impl::are_feature_rows(e, out_))
      return "output gradient has shape " + e.str() + ", expected (batch, " + std::to_string(out_) +
             ") or (batch, tokens, " + std::to_string(out_) + ")";
    const long t = impl::tokens_of(e, out_), t_in = impl::tokens_of(input, in_);
    if (input[0] > 0 && t != t_in)
      return "output gradient has shape " + e.str() + ": " + std::to_string(t) +
             " tokens per sample, but the input it pairs with has " + std::to_string(t_in);
    return {};
  }
  /// Extents of the weight gradient seen as a matrix.
  index_t weight_rows() const { return out_; }
  index_t weight_cols() const { return in_; }

  /// Rows of the matrices whose Gram products give A and G:
  /// A = rows_a^T rows_a / a_normalizer, G = rows_g^T rows_g / g_normalizer.
  index_t a_rows(const impl::Extents& input) const { return index_t(input[0]) * expanded(input, in_); }
  index_t g_rows(const impl::Extents& grad) const { return index_t(grad[0]) * expanded(grad, out_); }
  double a_normalizer(const impl::Extents& input) const { return double(input[0]) * double(expanded(input, in_)); }
  double g_normalizer(const impl::Extents& grad) const { return double(grad[0]); }
  /// Whether the input (batch[, tokens], in), row-major, is rows_a itself (no bias column, no
  /// reduction over tokens): a block whose arithmetic type is the input's then folds it without
  /// copying it. The output gradient is rows_g itself whenever it needs no scaling.
  bool a_rows_are_input() const { return !bias_ && tokens_ == Tokens::expand; }
  bool g_rows_are_output_grad() const { return tokens_ == Tokens::expand; }

  template <class Exec, class Scalar, class Rows>
  void fill_a_rows(const Exec& exec, const impl::Tensor4<Scalar, Exec>& x, const Rows& rows) const {
    using T = typename Rows::non_const_value_type;
    const impl::Extents e = impl::extents_of(x);
    const int n = int(e[0]), t = int(impl::tokens_of(e, in_)), in = in_;
    const bool bias = bias_;
    const Scalar* xs = x.data();
    if (tokens_ == Tokens::expand || t == 1) {
      Kokkos::parallel_for(
          "kfac::dense::a_rows", impl::RowMajorRange<Exec>(exec, {0, 0}, {n * t, in + int(bias)}),
          KOKKOS_LAMBDA(int r, int c) { rows(r, c) = c < in ? T(xs[std::size_t(r) * in + c]) : T(1); });
      return;
    }
    const T inv_t = T(1) / T(t);
    Kokkos::parallel_for(
        "kfac::dense::a_rows_reduce", impl::RowMajorRange<Exec>(exec, {0, 0}, {n, in + int(bias)}),
        KOKKOS_LAMBDA(int r, int c) {
          if (c == in) { rows(r, c) = T(1); return; }
          T sum = T(0);
          for (int k = 0; k < t; ++k) sum += T(xs[(std::size_t(r) * t + k) * in + c]);
          rows(r, c) = sum * inv_t;
        });
  }
  template <class Exec, class Scalar, class Rows>
  void fill_g_rows(const Exec& exec, const impl::Tensor4<Scalar, Exec>& g, double scale,
                   const Rows& rows) const {
    using T = typename Rows::non_const_value_type;
    const impl::Extents e = impl::extents_of(g);
    const int n = int(e[0]), t = int(impl::tokens_of(e, out_)), out = out_;
    const int r_n = tokens_ == Tokens::expand ? n * t : n, per_row = tokens_ == Tokens::expand ? 1 : t;
    const T s = T(scale);
    const Scalar* gs = g.data();
    Kokkos::parallel_for(
        "kfac::dense::g_rows", impl::RowMajorRange<Exec>(exec, {0, 0}, {r_n, out}), KOKKOS_LAMBDA(int r, int c) {
          T sum = T(0);
          for (int k = 0; k < per_row; ++k) sum += T(gs[(std::size_t(r) * per_row + k) * out + c]);
          rows(r, c) = s * sum;
        });
  }

 private:
  index_t expanded(const impl::Extents& e, index_t width) const {
    return tokens_ == Tokens::expand ? index_t(impl::tokens_of(e, width)) : 1;
  }

 private:
  index_t in_, out_;
  bool bias_;
  Tokens tokens_ = Tokens::expand;
};

}  // namespace kfac
