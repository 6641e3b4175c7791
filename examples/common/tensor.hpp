#pragma once
/// \file tensor.hpp
/// \brief View types of the example network and the growable buffers its layers own.
///
/// Activations are always rank-4 NCHW; a dense activation is (N, features, 1, 1). All views are
/// LayoutRight so that a tensor and its (N, C*H*W) matrix view share memory without copies.

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <string>
#include <utility>

namespace nn {

using ExecSpace = Kokkos::DefaultExecutionSpace;
using MemSpace = ExecSpace::memory_space;

using Tensor = Kokkos::View<float****, Kokkos::LayoutRight, MemSpace>;  ///< (N, C, H, W)
using Matrix = Kokkos::View<float**, Kokkos::LayoutRight, MemSpace>;    ///< row-major
using Vector = Kokkos::View<float*, MemSpace>;
using Labels = Kokkos::View<int*, MemSpace>;

/// \brief Whether a forward pass is part of training (batch statistics) or of evaluation.
enum class Mode { train, eval };

/// \brief The (N, C*H*W) matrix over the memory of `t`. Unmanaged: `t`'s owner keeps it alive.
inline Matrix as_matrix(const Tensor& t) {
  return Matrix(t.data(), t.extent(0), t.extent(1) * t.extent(2) * t.extent(3));
}

/// \brief The (N, C, 1, 1) tensor over the memory of `m`. Unmanaged, like as_matrix.
inline Tensor as_tensor(const Matrix& m) { return Tensor(m.data(), m.extent(0), m.extent(1), 1, 1); }

/// \brief A 1-D view of all elements of a contiguous view (used to hand parameters to optimizers).
template <class View>
Vector flat(const View& v) {
  return Vector(v.data(), v.size());
}

/// \brief Storage that a layer reuses from step to step and grows when a larger batch arrives.
///
/// The views it hands out are unmanaged and stay valid until the next call that grows it; a
/// layer calls it only at the start of its own forward or backward pass, so every view that
/// refers to the previous contents is recomputed in the same pass.
template <class T>
class Buffer {
 public:
  explicit Buffer(std::string label = "nn::buffer") : store_(std::move(label), 0) {}

  Kokkos::View<T****, Kokkos::LayoutRight, MemSpace> tensor(std::size_t n, std::size_t c,
                                                              std::size_t h, std::size_t w) {
    grow(n * c * h * w);
    return Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>(store_.data(), n, c, h, w);
  }

  Kokkos::View<T**, Kokkos::LayoutRight, MemSpace> matrix(std::size_t rows, std::size_t cols) {
    grow(rows * cols);
    return Kokkos::View<T**, Kokkos::LayoutRight, MemSpace>(store_.data(), rows, cols);
  }

 private:
  void grow(std::size_t size) {
    if (size > store_.extent(0))
      Kokkos::realloc(Kokkos::WithoutInitializing, store_, size);
  }

  Kokkos::View<T*, MemSpace> store_;
};

/// \brief A trainable parameter as optimizers see it: flat views of the value and its gradient.
struct Param {
  std::string name;
  Vector value;
  Vector grad;
  bool decay;  ///< whether weight decay applies (weights yes; biases and BatchNorm affine no)
};

}  // namespace nn
