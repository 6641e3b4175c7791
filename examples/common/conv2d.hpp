#pragma once
/// \file conv2d.hpp
/// \brief 2-D convolution (cross-correlation, as in every framework), NCHW, by im2col + GEMM.

#include "common/init.hpp"
#include "common/tensor.hpp"

#include <KokkosBlas3_gemm.hpp>

#include <stdexcept>
#include <vector>

namespace nn {

/// \brief Shape settings of a Conv2d, built with `with_*` calls.
struct Conv2dShape {
  int in_channels, out_channels, kernel_h, kernel_w;
  int stride = 1, padding = 0;
  bool bias = true;
  Conv2dShape with_stride(int s) const { auto c = *this; c.stride = s; return c; }
  Conv2dShape with_padding(int p) const { auto c = *this; c.padding = p; return c; }
  Conv2dShape with_bias(bool b) const { auto c = *this; c.bias = b; return c; }
};

/// Kernels of Conv2d, outside the class: nvcc rejects device lambdas in private members.
namespace detail {

/// cols(c*kh*kw + a*kw + e, (s*Ho + i)*Wo + j) = x(s, c, i*stride - pad + a, j*stride - pad + e),
/// 0 in the padding. One work item per (patch entry, sample, output row).
inline void unfold(const Conv2dShape& shape, const Tensor& x, const Matrix& cols, int ho, int wo) {
  const int kh = shape.kernel_h, kw = shape.kernel_w, st = shape.stride, pad = shape.padding;
  const int h = int(x.extent(2)), w = int(x.extent(3));
  Kokkos::parallel_for("nn::conv2d::unfold", range3(cols.extent(0), x.extent(0), ho),
                       KOKKOS_LAMBDA(const int k, const int s, const int i) {
                         const int c = k / (kh * kw), a = (k / kw) % kh, e = k % kw;
                         const int ih = i * st - pad + a;
                         const int q0 = (s * ho + i) * wo;
                         for (int j = 0; j < wo; ++j) {
                           const int iw = j * st - pad + e;
                           cols(k, q0 + j) = (ih >= 0 && ih < h && iw >= 0 && iw < w) ? x(s, c, ih, iw) : 0.0f;
                         }
                       });
}

/// The adjoint of unfold: dx(s, c) accumulates every patch entry that copied one of its pixels.
/// One work item per (sample, channel), visiting patch entries in a fixed order: no atomics.
inline void fold(const Conv2dShape& shape, const Matrix& dcols, const Tensor& dx, int ho, int wo) {
  const int kh = shape.kernel_h, kw = shape.kernel_w, st = shape.stride, pad = shape.padding;
  const int h = int(dx.extent(2)), w = int(dx.extent(3));
  Kokkos::parallel_for("nn::conv2d::fold", range2(dx.extent(0), dx.extent(1)), KOKKOS_LAMBDA(const int s, const int c) {
    for (int ih = 0; ih < h; ++ih)
      for (int iw = 0; iw < w; ++iw) dx(s, c, ih, iw) = 0.0f;
    for (int a = 0; a < kh; ++a)
      for (int e = 0; e < kw; ++e) {
        const int k = (c * kh + a) * kw + e;
        for (int i = 0; i < ho; ++i) {
          const int ih = i * st - pad + a;
          if (ih < 0 || ih >= h) continue;
          const int q0 = (s * ho + i) * wo;
          for (int j = 0; j < wo; ++j) {
            const int iw = j * st - pad + e;
            if (iw >= 0 && iw < w) dx(s, c, ih, iw) += dcols(k, q0 + j);
          }
        }
      }
  });
}

/// y(s, o, i, j) = ymat(o, (s*Ho + i)*Wo + j) + b(o) (b empty: no bias), the R-op's reordering to NCHW.
inline void rop_to_nchw(const Matrix& ymat, const ConstVector& b, const Tensor& y) {
  const int ho = int(y.extent(2)), wo = int(y.extent(3));
  const bool has_bias = b.extent(0) > 0;
  Kokkos::parallel_for("nn::conv2d::rop_to_nchw", range3(y.extent(0), y.extent(1), ho),
                       KOKKOS_LAMBDA(const int s, const int o, const int i) {
                         const float bo = has_bias ? b(o) : 0.0f;
                         for (int j = 0; j < wo; ++j) y(s, o, i, j) = ymat(o, (s * ho + i) * wo + j) + bo;
                       });
}

}  // namespace detail

/// \brief Conv2d with weight (O, C, kh, kw) and optional bias (O).
///
/// The whole batch is unfolded into one patch matrix `cols` of shape (K, N*P), K = C*kh*kw patch
/// entries by N*P output locations (P = Ho*Wo), so forward and both gradients are single GEMMs:
/// \f$Y = W\,\mathrm{cols}\f$, \f$dW = dY\,\mathrm{cols}^T\f$, \f$d\mathrm{cols} = W^T dY\f$ with
/// Y and dY in (O, N*P) order. In that order every other kernel reads and writes whole rows of
/// Wo contiguous values: the unfold, its adjoint (fold) and the reordering to NCHW. Each
/// kernel writes each output once, so there are no atomics and results repeat bitwise.
class Conv2d {
 public:
  Conv2d(Conv2dShape shape, Init init, SplitMix64& rng)
      : s_(shape), weight_("nn::conv2d::W", shape.out_channels, shape.in_channels, shape.kernel_h, shape.kernel_w),
        bias_("nn::conv2d::b", shape.bias ? shape.out_channels : 0),
        dweight_("nn::conv2d::dW", shape.out_channels, shape.in_channels, shape.kernel_h, shape.kernel_w),
        dbias_("nn::conv2d::db", shape.bias ? shape.out_channels : 0), cols_("nn::conv2d::cols"),
        ymat_("nn::conv2d::ymat"), y_("nn::conv2d::y"), dymat_("nn::conv2d::dymat"), dcols_("nn::conv2d::dcols"),
        dx_("nn::conv2d::dx"), rcols_("nn::conv2d::rcols"), rymat_("nn::conv2d::rymat"), ry_("nn::conv2d::ry") {
    if (shape.stride < 1 || shape.padding < 0 || shape.kernel_h < 1 || shape.kernel_w < 1)
      throw std::invalid_argument("nn::Conv2d: expected stride >= 1, padding >= 0, kernel >= 1");
    fill_uniform(weight_, init_bound(init, long(patch_size())), rng);
  }

  int out_height(int h) const { return (h + 2 * s_.padding - s_.kernel_h) / s_.stride + 1; }
  int out_width(int w) const { return (w + 2 * s_.padding - s_.kernel_w) / s_.stride + 1; }

  Tensor forward(const Tensor& x, Mode) {
    if (int(x.extent(1)) != s_.in_channels)
      throw std::invalid_argument("nn::Conv2d: input channels do not match the layer");
    x_ = x;
    const int n = int(x.extent(0)), ho = out_height(int(x.extent(2))), wo = out_width(int(x.extent(3)));
    const int o_ch = s_.out_channels;
    const Matrix cols = cols_.matrix(patch_size(), std::size_t(n) * ho * wo);
    unfold(x, cols, ho, wo);
    const Matrix ymat = ymat_.matrix(o_ch, std::size_t(n) * ho * wo);
    KokkosBlas::gemm("N", "N", 1.0f, weight_matrix(weight_), cols, 0.0f, ymat);

    const Tensor y = y_.tensor(n, o_ch, ho, wo);
    const Vector b = bias_;
    const bool has_bias = s_.bias;
    Kokkos::parallel_for("nn::conv2d::to_nchw", range3(n, o_ch, ho),
                         KOKKOS_LAMBDA(const int s, const int o, const int i) {
                           const float bo = has_bias ? b(o) : 0.0f;
                           for (int j = 0; j < wo; ++j) y(s, o, i, j) = ymat(o, (s * ho + i) * wo + j) + bo;
                         });
    return y;
  }

  Tensor backward(const Tensor& dy, bool need_dx) {
    dy_ = dy;
    const int n = int(dy.extent(0)), o_ch = s_.out_channels, ho = int(dy.extent(2)), wo = int(dy.extent(3));
    const Matrix dymat = dymat_.matrix(o_ch, std::size_t(n) * ho * wo);
    Kokkos::parallel_for("nn::conv2d::from_nchw", range3(n, o_ch, ho),
                         KOKKOS_LAMBDA(const int s, const int o, const int i) {
                           for (int j = 0; j < wo; ++j) dymat(o, (s * ho + i) * wo + j) = dy(s, o, i, j);
                         });
    const Matrix cols = cols_.matrix(patch_size(), std::size_t(n) * ho * wo);
    KokkosBlas::gemm("N", "T", 1.0f, dymat, cols, 0.0f, weight_matrix(dweight_));
    if (s_.bias) {
      const Vector db = dbias_;
      const int m = n * ho * wo;
      Kokkos::parallel_for("nn::conv2d::bias_grad", Kokkos::RangePolicy<ExecSpace>(0, o_ch),
                           KOKKOS_LAMBDA(const int o) {
                             double sum = 0.0;
                             for (int q = 0; q < m; ++q) sum += dymat(o, q);
                             db(o) = float(sum);
                           });
    }
    if (!need_dx) return Tensor();
    const Matrix dcols = dcols_.matrix(patch_size(), std::size_t(n) * ho * wo);
    KokkosBlas::gemm("T", "N", 1.0f, weight_matrix(weight_), dymat, 0.0f, dcols);
    const Tensor dx = dx_.tensor(n, x_.extent(1), x_.extent(2), x_.extent(3));
    fold(dcols, dx, ho, wo);
    return dx;
  }

  /// \brief Forward mode (R-op) at the input and parameters of the last forward pass, which is
  /// linear in each: \f$\dot Y = \dot W\,\mathrm{cols}(x) + W\,\mathrm{cols}(\dot x) + \dot b\f$.
  /// Reuses the patch matrix of the last forward (a backward pass reads it but leaves it).
  /// \param dx [in] \f$\dot x\f$ shaped like the input, or empty (zero: the input does not move)
  /// \param direction [in] \f$\dot W\f$ (O*C*kh*kw) and, with a bias, \f$\dot b\f$: params()' order
  /// \return \f$\dot y\f$, (N, O, Ho, Wo), owned by this layer until its next rop
  Tensor rop(const Tensor& dx, const std::vector<ConstVector>& direction) {
    const int n = int(x_.extent(0)), ho = out_height(int(x_.extent(2))), wo = out_width(int(x_.extent(3)));
    const std::size_t m = std::size_t(n) * ho * wo;
    const Matrix cols = cols_.matrix(patch_size(), m);  // the last forward's
    const Matrix ymat = rymat_.matrix(s_.out_channels, m);
    const Kokkos::View<const float**, Kokkos::LayoutRight, MemSpace> dw(direction.at(0).data(), s_.out_channels,
                                                                          patch_size());
    KokkosBlas::gemm("N", "N", 1.0f, dw, cols, 0.0f, ymat);
    if (dx.data()) {
      const Matrix rcols = rcols_.matrix(patch_size(), m);
      unfold(dx, rcols, ho, wo);
      KokkosBlas::gemm("N", "N", 1.0f, weight_matrix(weight_), rcols, 1.0f, ymat);
    }
    const Tensor ry = ry_.tensor(n, s_.out_channels, ho, wo);
    detail::rop_to_nchw(ymat, s_.bias ? direction.at(1) : ConstVector(), ry);
    return ry;
  }

  std::vector<Param> params() const {
    std::vector<Param> p{{"weight", flat(weight_), flat(dweight_), true}};
    if (s_.bias) p.push_back({"bias", bias_, dbias_, false});
    return p;
  }

  const Conv2dShape& shape() const { return s_; }
  const Tensor& weight() const { return weight_; }
  const Vector& bias() const { return bias_; }
  const Tensor& weight_grad() const { return dweight_; }
  const Vector& bias_grad() const { return dbias_; }  ///< empty without bias
  const Tensor& input() const { return x_; }           ///< (N, C, H, W) of the last forward
  const Tensor& output_grad() const { return dy_; }    ///< (N, O, Ho, Wo) of the last backward

 private:
  std::size_t patch_size() const { return std::size_t(s_.in_channels) * s_.kernel_h * s_.kernel_w; }

  Matrix weight_matrix(const Tensor& w) const { return Matrix(w.data(), s_.out_channels, patch_size()); }

  void unfold(const Tensor& x, const Matrix& cols, int ho, int wo) const { detail::unfold(s_, x, cols, ho, wo); }
  void fold(const Matrix& dcols, const Tensor& dx, int ho, int wo) const { detail::fold(s_, dcols, dx, ho, wo); }

  Conv2dShape s_;
  Tensor weight_;
  Vector bias_;
  Tensor dweight_;
  Vector dbias_;
  Buffer<float> cols_, ymat_, y_, dymat_, dcols_, dx_, rcols_, rymat_, ry_;
  Tensor x_, dy_;
};

}  // namespace nn
