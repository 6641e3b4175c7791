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
    const Vector xv = as_vector(x), yv = as_vector(y);
    for_each_piece("nn::relu::forward", x.size(), KOKKOS_LAMBDA(const std::size_t begin, const std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) {
        const float v = xv(i);
        yv(i) = v > 0.0f ? v : 0.0f;
      }
    });
    y_view_ = y;
    return y;
  }

  /// The derivative at 0 is taken as 0, as every framework does.
  Tensor backward(const Tensor& dy, bool need_dx) {
    if (!need_dx) return Tensor();
    const Tensor dx = dx_.tensor(dy.extent(0), dy.extent(1), dy.extent(2), dy.extent(3));
    const Vector dyv = as_vector(dy), dxv = as_vector(dx), yv = as_vector(y_view_);
    for_each_piece("nn::relu::backward", dy.size(), KOKKOS_LAMBDA(const std::size_t begin, const std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) {
        const float g = dyv(i), v = yv(i);
        dxv(i) = v > 0.0f ? g : 0.0f;
      }
    });
    return dx;
  }

  std::vector<Param> params() const { return {}; }

 private:
  Buffer<float> y_, dx_;
  Tensor y_view_;
};

}  // namespace nn
