#pragma once
/// \file max_pool2d.hpp
/// \brief 2x2 max pooling with stride 2 (odd trailing rows and columns are dropped).

#include "common/tensor.hpp"

#include <vector>

namespace nn {

class MaxPool2d {
 public:
  MaxPool2d() : y_("nn::maxpool::y"), arg_("nn::maxpool::argmax"), dx_("nn::maxpool::dx"), ry_("nn::maxpool::ry") {}

  Tensor forward(const Tensor& x, Mode) {
    const int n = int(x.extent(0)), c_n = int(x.extent(1)), ho = int(x.extent(2)) / 2, wo = int(x.extent(3)) / 2;
    const Tensor y = y_.tensor(n, c_n, ho, wo);
    const auto arg = arg_.tensor(n, c_n, ho, wo);
    // Rows in parallel, columns in an inner loop with unconditional loads (see for_each_piece).
    Kokkos::parallel_for("nn::maxpool::forward", range3(n, c_n, ho),
                         KOKKOS_LAMBDA(const int s, const int c, const int oh) {
                           for (int ow = 0; ow < wo; ++ow) {
                             const float a = x(s, c, 2 * oh, 2 * ow), b = x(s, c, 2 * oh, 2 * ow + 1),
                                         d = x(s, c, 2 * oh + 1, 2 * ow), e = x(s, c, 2 * oh + 1, 2 * ow + 1);
                             // The first maximum in row-major order wins ties.
                             const float ab = b > a ? b : a, de = e > d ? e : d;
                             const int i_ab = b > a ? 1 : 0, i_de = e > d ? 3 : 2;
                             y(s, c, oh, ow) = de > ab ? de : ab;
                             arg(s, c, oh, ow) = de > ab ? i_de : i_ab;
                           }
                         });
    in_shape_[0] = n; in_shape_[1] = c_n; in_shape_[2] = int(x.extent(2)); in_shape_[3] = int(x.extent(3));
    arg_view_ = arg;
    return y;
  }

  /// Each input pixel takes the output gradient if it was its window's maximum, else 0.
  Tensor backward(const Tensor& dy, bool need_dx) {
    if (!need_dx) return Tensor();
    const Tensor dx = dx_.tensor(in_shape_[0], in_shape_[1], in_shape_[2], in_shape_[3]);
    const auto arg = arg_view_;
    const int ho = in_shape_[2] / 2, wo = in_shape_[3] / 2, w = in_shape_[3];
    Kokkos::parallel_for("nn::maxpool::backward", range3(dx.extent(0), dx.extent(1), dx.extent(2)),
                         KOKKOS_LAMBDA(const int s, const int c, const int ih) {
                           const int oh = ih / 2 < ho ? ih / 2 : ho - 1;  // clamped: loads stay in bounds
                           const bool row_pooled = ih / 2 < ho;
                           for (int iw = 0; iw < w; ++iw) {
                             const int ow = iw / 2 < wo ? iw / 2 : wo - 1;
                             const float g = dy(s, c, oh, ow);
                             const int k = arg(s, c, oh, ow);
                             const bool won = row_pooled && iw / 2 < wo && k == (ih % 2) * 2 + iw % 2;
                             dx(s, c, ih, iw) = won ? g : 0.0f;
                           }
                         });
    return dx;
  }

  /// \brief Forward mode (R-op): each output's tangent is that of the input its window took
  /// (the last forward's maximum; ties as there).
  /// \param dx [in] the input's tangent, or empty (zero); the result is then empty too
  Tensor rop(const Tensor& dx, const std::vector<ConstVector>&) {
    if (!dx.data()) return Tensor();
    const auto arg = arg_view_;
    const Tensor ry = ry_.tensor(arg.extent(0), arg.extent(1), arg.extent(2), arg.extent(3));
    const int wo = int(arg.extent(3));
    Kokkos::parallel_for("nn::maxpool::rop", range3(arg.extent(0), arg.extent(1), arg.extent(2)),
                         KOKKOS_LAMBDA(const int s, const int c, const int oh) {
                           for (int ow = 0; ow < wo; ++ow) {
                             const int k = arg(s, c, oh, ow);
                             ry(s, c, oh, ow) = dx(s, c, 2 * oh + k / 2, 2 * ow + k % 2);
                           }
                         });
    return ry;
  }

  std::vector<Param> params() const { return {}; }

 private:
  Buffer<float> y_;
  Buffer<int> arg_;
  Buffer<float> dx_, ry_;
  Kokkos::View<int****, Kokkos::LayoutRight, MemSpace> arg_view_;
  int in_shape_[4] = {0, 0, 0, 0};
};

}  // namespace nn
