#pragma once
/// \file relu.hpp
/// \brief Rectified linear unit \f$y = \max(x, 0)\f$.

#include "common/tensor.hpp"

#include <vector>

namespace nn {

class ReLU {
 public:
  ReLU() : y_("nn::relu::y"), dx_("nn::relu::dx") {}

  Tensor forward(const Tensor& x, Mode) {
    const Tensor y = y_.tensor(x.extent(0), x.extent(1), x.extent(2), x.extent(3));
    const Matrix xm = as_matrix(x), ym = as_matrix(y);
    const int k = int(xm.extent(1));
    Kokkos::parallel_for("nn::relu::forward", Kokkos::RangePolicy<ExecSpace>(0, int(x.size())),
                         KOKKOS_LAMBDA(const int i) {
                           const float v = xm(i / k, i % k);
                           ym(i / k, i % k) = v > 0.0f ? v : 0.0f;
                         });
    y_view_ = y;
    return y;
  }

  /// The derivative at 0 is taken as 0, as every framework does.
  Tensor backward(const Tensor& dy, bool need_dx) {
    if (!need_dx) return Tensor();
    const Tensor dx = dx_.tensor(dy.extent(0), dy.extent(1), dy.extent(2), dy.extent(3));
    const Matrix dym = as_matrix(dy), dxm = as_matrix(dx), ym = as_matrix(y_view_);
    const int k = int(dym.extent(1));
    Kokkos::parallel_for("nn::relu::backward", Kokkos::RangePolicy<ExecSpace>(0, int(dy.size())),
                         KOKKOS_LAMBDA(const int i) {
                           dxm(i / k, i % k) = ym(i / k, i % k) > 0.0f ? dym(i / k, i % k) : 0.0f;
                         });
    return dx;
  }

  std::vector<Param> params() const { return {}; }

 private:
  Buffer<float> y_, dx_;
  Tensor y_view_;
};

}  // namespace nn
