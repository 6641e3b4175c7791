#pragma once
/// \file flatten.hpp
/// \brief (N, C, H, W) -> (N, C*H*W, 1, 1): a reinterpretation of the same memory, no copy.

#include "common/tensor.hpp"

#include <vector>

namespace nn {

class Flatten {
 public:
  Tensor forward(const Tensor& x, Mode) {
    for (int d = 0; d < 4; ++d) in_shape_[d] = x.extent(d);
    return as_tensor(as_matrix(x));
  }

  Tensor backward(const Tensor& dy, bool need_dx) {
    if (!need_dx) return Tensor();
    return Tensor(dy.data(), in_shape_[0], in_shape_[1], in_shape_[2], in_shape_[3]);
  }

  /// \brief Forward mode (R-op): the tangent reshaped like the output (empty stays empty).
  Tensor rop(const Tensor& dx, const std::vector<ConstVector>&) {
    if (!dx.data()) return Tensor();
    return as_tensor(as_matrix(dx));
  }

  std::vector<Param> params() const { return {}; }

 private:
  std::size_t in_shape_[4] = {0, 0, 0, 0};
};

}  // namespace nn
