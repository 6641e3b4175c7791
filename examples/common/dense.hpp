#pragma once
/// \file dense.hpp
/// \brief Fully connected layer \f$y = x W^T + b\f$.

#include "common/init.hpp"
#include "common/tensor.hpp"

#include <KokkosBlas3_gemm.hpp>

#include <vector>

namespace nn {

/// \brief Dense layer with weight (out, in) row-major and an optional bias (out).
///
/// Keeps what K-FAC needs after a training step: the input activation (N, in) and the gradient
/// of the loss wrt the output (N, out), along with dW and db.
class Dense {
 public:
  Dense(int in, int out, bool bias, Init init, SplitMix64& rng)
      : in_(in), out_(out), has_bias_(bias), weight_("nn::dense::W", out, in),
        bias_("nn::dense::b", bias ? out : 0), dweight_("nn::dense::dW", out, in),
        dbias_("nn::dense::db", bias ? out : 0), y_("nn::dense::y"), dx_("nn::dense::dx"), ry_("nn::dense::ry") {
    fill_uniform(weight_, init_bound(init, in), rng);  // bias starts at zero
  }

  /// \param x [in] (N, in, 1, 1) or any (N, C, H, W) with C*H*W == in
  Tensor forward(const Tensor& x, Mode) {
    x_ = x;
    const Matrix xm = as_matrix(x);
    const int n = int(xm.extent(0));
    const Matrix y = y_.matrix(n, out_);
    KokkosBlas::gemm("N", "T", 1.0f, xm, weight_, 0.0f, y);
    if (has_bias_) {
      const Vector b = bias_;
      Kokkos::parallel_for("nn::dense::add_bias", range2(n, out_),
                           KOKKOS_LAMBDA(const int i, const int o) { y(i, o) += b(o); });
    }
    return as_tensor(y);
  }

  /// \param dy [in] gradient of the loss wrt the output, (N, out, 1, 1)
  /// \param need_dx [in] false for the first layer, whose input gradient nobody uses
  /// \return gradient wrt the input, shaped like the input (empty when !need_dx)
  Tensor backward(const Tensor& dy, bool need_dx) {
    dy_ = as_matrix(dy);
    const Matrix dym = dy_;
    const Matrix xm = as_matrix(x_);
    KokkosBlas::gemm("T", "N", 1.0f, dym, xm, 0.0f, dweight_);
    if (has_bias_) {
      const Vector db = dbias_;
      const int n = int(dym.extent(0));
      Kokkos::parallel_for("nn::dense::bias_grad", Kokkos::RangePolicy<ExecSpace>(0, out_),
                           KOKKOS_LAMBDA(const int o) {
                             double s = 0.0;
                             for (int i = 0; i < n; ++i) s += dym(i, o);
                             db(o) = float(s);
                           });
    }
    if (!need_dx) return Tensor();
    const Matrix dx = dx_.matrix(dym.extent(0), in_);
    KokkosBlas::gemm("N", "N", 1.0f, dym, weight_, 0.0f, dx);
    return Tensor(dx.data(), x_.extent(0), x_.extent(1), x_.extent(2), x_.extent(3));
  }

  /// \brief Forward mode (R-op) at the input and parameters of the last forward pass: the
  /// directional derivative of the output, \f$\dot y = \dot x W^T + x\,\dot W^T + \dot b\f$.
  /// \param dx [in] \f$\dot x\f$ shaped like the input, or empty (zero: the input does not move)
  /// \param direction [in] \f$\dot W\f$ (out*in, row-major) and, with a bias, \f$\dot b\f$: params()' order
  /// \return \f$\dot y\f$, (N, out, 1, 1), owned by this layer until its next rop
  Tensor rop(const Tensor& dx, const std::vector<ConstVector>& direction) {
    const Matrix xm = as_matrix(x_);
    const int n = int(xm.extent(0));
    const Matrix ry = ry_.matrix(n, out_);
    const Kokkos::View<const float**, Kokkos::LayoutRight, MemSpace> dw(direction.at(0).data(), out_, in_);
    KokkosBlas::gemm("N", "T", 1.0f, xm, dw, 0.0f, ry);
    if (dx.data()) KokkosBlas::gemm("N", "T", 1.0f, as_matrix(dx), weight_, 1.0f, ry);
    if (has_bias_) {
      const ConstVector db = direction.at(1);
      Kokkos::parallel_for("nn::dense::rop_bias", range2(n, out_),
                           KOKKOS_LAMBDA(const int i, const int o) { ry(i, o) += db(o); });
    }
    return as_tensor(ry);
  }

  std::vector<Param> params() const {
    std::vector<Param> p{{"weight", flat(weight_), flat(dweight_), true}};
    if (has_bias_) p.push_back({"bias", bias_, dbias_, false});
    return p;
  }

  int in_features() const { return in_; }
  int out_features() const { return out_; }
  bool has_bias() const { return has_bias_; }
  const Matrix& weight() const { return weight_; }
  const Vector& bias() const { return bias_; }
  const Matrix& weight_grad() const { return dweight_; }
  const Vector& bias_grad() const { return dbias_; }  ///< empty without bias
  /// \brief Input of the last forward pass as (N, in).
  Matrix input() const { return as_matrix(x_); }
  /// \brief Gradient of the loss wrt the output from the last backward pass, (N, out).
  const Matrix& output_grad() const { return dy_; }

 private:
  int in_, out_;
  bool has_bias_;
  Matrix weight_;
  Vector bias_;
  Matrix dweight_;
  Vector dbias_;
  Buffer<float> y_, dx_, ry_;
  Tensor x_;
  Matrix dy_;
};

}  // namespace nn
