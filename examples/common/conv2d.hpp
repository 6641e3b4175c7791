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

/// \brief Conv2d with weight (O, C, kh, kw) and optional bias (O).
///
/// The batch is unfolded into one patch matrix `cols` of shape (N*Ho*Wo, C*kh*kw), so forward
/// and both gradients are single GEMMs; the unfold and its adjoint are plain gathers, which keeps
/// every kernel free of atomics and the results bitwise repeatable.
class Conv2d {
 public:
  Conv2d(Conv2dShape shape, Init init, SplitMix64& rng)
      : s_(shape), weight_("nn::conv2d::W", shape.out_channels, shape.in_channels, shape.kernel_h, shape.kernel_w),
        bias_("nn::conv2d::b", shape.bias ? shape.out_channels : 0),
        dweight_("nn::conv2d::dW", shape.out_channels, shape.in_channels, shape.kernel_h, shape.kernel_w),
        dbias_("nn::conv2d::db", shape.bias ? shape.out_channels : 0), cols_("nn::conv2d::cols"),
        ycols_("nn::conv2d::ycols"), y_("nn::conv2d::y"), dycols_("nn::conv2d::dycols"),
        dcols_("nn::conv2d::dcols"), dx_("nn::conv2d::dx") {
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
    const int o_ch = s_.out_channels, p = ho * wo;
    const Matrix cols = cols_.matrix(std::size_t(n) * p, patch_size());
    unfold(x, cols, ho, wo);
    const Matrix ycols = ycols_.matrix(std::size_t(n) * p, o_ch);
    KokkosBlas::gemm("N", "T", 1.0f, cols, weight_matrix(weight_), 0.0f, ycols);

    const Tensor y = y_.tensor(n, o_ch, ho, wo);
    const Vector b = bias_;
    const bool has_bias = s_.bias;
    Kokkos::parallel_for("nn::conv2d::to_nchw", Kokkos::RangePolicy<ExecSpace>(0, n * o_ch * p),
                         KOKKOS_LAMBDA(const int i) {
                           const int q = i % p, o = (i / p) % o_ch, s = i / (p * o_ch);
                           y(s, o, q / wo, q % wo) = ycols(s * p + q, o) + (has_bias ? b(o) : 0.0f);
                         });
    return y;
  }

  Tensor backward(const Tensor& dy, bool need_dx) {
    dy_ = dy;
    const int n = int(dy.extent(0)), o_ch = s_.out_channels, ho = int(dy.extent(2)), wo = int(dy.extent(3));
    const int p = ho * wo;
    const Matrix dycols = dycols_.matrix(std::size_t(n) * p, o_ch);
    Kokkos::parallel_for("nn::conv2d::from_nchw", Kokkos::RangePolicy<ExecSpace>(0, n * p * o_ch),
                         KOKKOS_LAMBDA(const int i) {
                           const int o = i % o_ch, q = (i / o_ch) % p, s = i / (o_ch * p);
                           dycols(s * p + q, o) = dy(s, o, q / wo, q % wo);
                         });
    const Matrix cols = cols_.matrix(std::size_t(n) * p, patch_size());
    KokkosBlas::gemm("T", "N", 1.0f, dycols, cols, 0.0f, weight_matrix(dweight_));
    if (s_.bias) {
      const Vector db = dbias_;
      Kokkos::parallel_for("nn::conv2d::bias_grad", Kokkos::RangePolicy<ExecSpace>(0, o_ch),
                           KOKKOS_LAMBDA(const int o) {
                             double sum = 0.0;
                             for (int s = 0; s < n; ++s)
                               for (int q = 0; q < p; ++q) sum += dy(s, o, q / wo, q % wo);
                             db(o) = float(sum);
                           });
    }
    if (!need_dx) return Tensor();
    const Matrix dcols = dcols_.matrix(std::size_t(n) * p, patch_size());
    KokkosBlas::gemm("N", "N", 1.0f, dycols, weight_matrix(weight_), 0.0f, dcols);
    const Tensor dx = dx_.tensor(n, x_.extent(1), x_.extent(2), x_.extent(3));
    fold(dcols, dx, ho, wo);
    return dx;
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

  /// cols(s*P + oh*Wo + ow, c*kh*kw + ki*kw + kj) = x(s, c, oh*stride - pad + ki, ow*stride - pad + kj), 0 outside.
  void unfold(const Tensor& x, const Matrix& cols, int ho, int wo) const {
    const int k = int(cols.extent(1)), kh = s_.kernel_h, kw = s_.kernel_w, st = s_.stride, pad = s_.padding;
    const int h = int(x.extent(2)), w = int(x.extent(3)), p = ho * wo;
    Kokkos::parallel_for("nn::conv2d::unfold", Kokkos::RangePolicy<ExecSpace>(0, int(cols.size())),
                         KOKKOS_LAMBDA(const int i) {
                           const int row = i / k, col = i % k;
                           const int s = row / p, q = row % p;
                           const int c = col / (kh * kw), kj = col % kw, ki = (col / kw) % kh;
                           const int ih = (q / wo) * st - pad + ki, iw = (q % wo) * st - pad + kj;
                           cols(row, col) = (ih >= 0 && ih < h && iw >= 0 && iw < w) ? x(s, c, ih, iw) : 0.0f;
                         });
  }

  /// The adjoint of unfold: each input pixel sums the patch entries that copied it.
  void fold(const Matrix& dcols, const Tensor& dx, int ho, int wo) const {
    const int kh = s_.kernel_h, kw = s_.kernel_w, st = s_.stride, pad = s_.padding;
    const int c_in = int(dx.extent(1)), h = int(dx.extent(2)), w = int(dx.extent(3)), p = ho * wo;
    Kokkos::parallel_for("nn::conv2d::fold", Kokkos::RangePolicy<ExecSpace>(0, int(dx.size())),
                         KOKKOS_LAMBDA(const int i) {
                           const int iw = i % w, ih = (i / w) % h, c = (i / (w * h)) % c_in, s = i / (w * h * c_in);
                           float sum = 0.0f;
                           for (int ki = 0; ki < kh; ++ki) {
                             const int oh_st = ih + pad - ki;
                             if (oh_st < 0 || oh_st % st != 0 || oh_st / st >= ho) continue;
                             for (int kj = 0; kj < kw; ++kj) {
                               const int ow_st = iw + pad - kj;
                               if (ow_st < 0 || ow_st % st != 0 || ow_st / st >= wo) continue;
                               sum += dcols(s * p + (oh_st / st) * wo + ow_st / st, (c * kh + ki) * kw + kj);
                             }
                           }
                           dx(s, c, ih, iw) = sum;
                         });
  }

  Conv2dShape s_;
  Tensor weight_;
  Vector bias_;
  Tensor dweight_;
  Vector dbias_;
  Buffer<float> cols_, ycols_, y_, dycols_, dcols_, dx_;
  Tensor x_, dy_;
};

}  // namespace nn
