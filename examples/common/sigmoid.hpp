#pragma once
/// \file sigmoid.hpp
/// \brief Logistic unit \f$y = 1 / (1 + e^{-x})\f$ (the deep autoencoder's hidden units).

#include "common/tensor.hpp"

#include <cmath>
#include <vector>

namespace nn {

class Sigmoid {
 public:
  Sigmoid() : y_("nn::sigmoid::y"), dx_("nn::sigmoid::dx"), ry_("nn::sigmoid::ry") {}

  Tensor forward(const Tensor& x, Mode) {
    const Tensor y = y_.tensor(x.extent(0), x.extent(1), x.extent(2), x.extent(3));
    const Vector xv = as_vector(x), yv = as_vector(y);
    for_each_piece("nn::sigmoid::forward", x.size(), KOKKOS_LAMBDA(const std::size_t begin, const std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) yv(i) = 1.0f / (1.0f + std::exp(-xv(i)));
    });
    y_view_ = y;
    return y;
  }

  /// \f$\partial y / \partial x = y (1 - y)\f$, from the output kept by forward.
  Tensor backward(const Tensor& dy, bool need_dx) {
    if (!need_dx) return Tensor();
    return scale_by_slope("nn::sigmoid::backward", dy, dx_);
  }

  /// \brief Forward mode (R-op): \f$\dot y = y (1 - y)\,\dot x\f$.
  /// \param dx [in] the input's tangent, or empty (zero); the result is then empty too
  Tensor rop(const Tensor& dx, const std::vector<ConstVector>&) {
    if (!dx.data()) return Tensor();
    return scale_by_slope("nn::sigmoid::rop", dx, ry_);
  }

  std::vector<Param> params() const { return {}; }

  /// \brief t * y (1 - y) elementwise into a tensor of `out` (public: it holds a device lambda).
  Tensor scale_by_slope(const char* label, const Tensor& t, Buffer<float>& out) {
    const Tensor r = out.tensor(t.extent(0), t.extent(1), t.extent(2), t.extent(3));
    const Vector tv = as_vector(t), rv = as_vector(r), yv = as_vector(y_view_);
    for_each_piece(label, t.size(), KOKKOS_LAMBDA(const std::size_t begin, const std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) {
        const float v = yv(i);
        rv(i) = tv(i) * v * (1.0f - v);
      }
    });
    return r;
  }

 private:
  Buffer<float> y_, dx_, ry_;
  Tensor y_view_;
};

}  // namespace nn
