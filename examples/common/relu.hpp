#pragma once
/// \file relu.hpp
/// \brief Rectified linear unit \f$y = \max(x, 0)\f$.

#include "common/tensor.hpp"

#include <vector>

namespace nn {

class ReLU {
 public:
  ReLU() : y_("nn::relu::y"), dx_("nn::relu::dx"), ry_("nn::relu::ry") {}

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
    return mask_by_output("nn::relu::backward", dy, dx_);
  }

  /// \brief Forward mode (R-op): \f$\dot y = \dot x\f$ where the input was positive, else 0.
  /// \param dx [in] the input's tangent, or empty (zero); the result is then empty too
  Tensor rop(const Tensor& dx, const std::vector<ConstVector>&) {
    if (!dx.data()) return Tensor();
    return mask_by_output("nn::relu::rop", dx, ry_);
  }

  std::vector<Param> params() const { return {}; }

  /// \brief t where the last forward's output is positive, else 0, into a tensor of `out`
  /// (public: it holds a device lambda).
  Tensor mask_by_output(const char* label, const Tensor& t, Buffer<float>& out) {
    const Tensor r = out.tensor(t.extent(0), t.extent(1), t.extent(2), t.extent(3));
    const Vector tv = as_vector(t), rv = as_vector(r), yv = as_vector(y_view_);
    for_each_piece(label, t.size(), KOKKOS_LAMBDA(const std::size_t begin, const std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) {
        const float g = tv(i), v = yv(i);
        rv(i) = v > 0.0f ? g : 0.0f;
      }
    });
    return r;
  }

 private:
  Buffer<float> y_, dx_, ry_;
  Tensor y_view_;
};

}  // namespace nn
