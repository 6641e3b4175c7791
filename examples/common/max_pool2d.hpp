#pragma once
/// \file max_pool2d.hpp
/// \brief 2x2 max pooling with stride 2 (odd trailing rows and columns are dropped).

#include "common/tensor.hpp"

#include <vector>

namespace nn {

class MaxPool2d {
 public:
  MaxPool2d() : y_("nn::maxpool::y"), arg_("nn::maxpool::argmax"), dx_("nn::maxpool::dx") {}

  Tensor forward(const Tensor& x, Mode) {
    const int n = int(x.extent(0)), c_n = int(x.extent(1)), ho = int(x.extent(2)) / 2, wo = int(x.extent(3)) / 2;
    const Tensor y = y_.tensor(n, c_n, ho, wo);
    const auto arg = arg_.tensor(n, c_n, ho, wo);
    Kokkos::parallel_for("nn::maxpool::forward", Kokkos::RangePolicy<ExecSpace>(0, n * c_n * ho * wo),
                         KOKKOS_LAMBDA(const int i) {
                           const int ow = i % wo, oh = (i / wo) % ho, c = (i / (wo * ho)) % c_n, s = i / (wo * ho * c_n);
                           int best = 0;
                           float v = x(s, c, 2 * oh, 2 * ow);
                           for (int j = 1; j < 4; ++j) {  // first maximum wins ties
                             const float u = x(s, c, 2 * oh + j / 2, 2 * ow + j % 2);
                             if (u > v) { v = u; best = j; }
                           }
                           y(s, c, oh, ow) = v;
                           arg(s, c, oh, ow) = best;
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
    const int c_n = in_shape_[1], h = in_shape_[2], w = in_shape_[3], ho = h / 2, wo = w / 2;
    Kokkos::parallel_for("nn::maxpool::backward", Kokkos::RangePolicy<ExecSpace>(0, int(dx.size())),
                         KOKKOS_LAMBDA(const int i) {
                           const int iw = i % w, ih = (i / w) % h, c = (i / (w * h)) % c_n, s = i / (w * h * c_n);
                           const int oh = ih / 2, ow = iw / 2;
                           const bool won = oh < ho && ow < wo && arg(s, c, oh, ow) == (ih % 2) * 2 + iw % 2;
                           dx(s, c, ih, iw) = won ? dy(s, c, oh, ow) : 0.0f;
                         });
    return dx;
  }

  std::vector<Param> params() const { return {}; }

 private:
  Buffer<float> y_;
  Buffer<int> arg_;
  Buffer<float> dx_;
  Kokkos::View<int****, Kokkos::LayoutRight, MemSpace> arg_view_;
  int in_shape_[4] = {0, 0, 0, 0};
};

}  // namespace nn
