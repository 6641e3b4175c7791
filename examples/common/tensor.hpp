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
using ConstVector = Kokkos::View<const float*, MemSpace>;  ///< a parameter direction (R-op)
using Labels = Kokkos::View<int*, MemSpace>;

/// \brief Index space of an elementwise kernel over (N, C, H, W). A multidimensional range keeps
/// index arithmetic out of the kernels (integer division per element would dominate on a CPU)
/// and still exposes every element as parallel work on a GPU.
using Range4 = Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<4>>;
using Range3 = Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>;
using Range2 = Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>;

inline Range4 range4(std::size_t n, std::size_t c, std::size_t h, std::size_t w) {
  return Range4({0, 0, 0, 0}, {long(n), long(c), long(h), long(w)});
}
inline Range3 range3(std::size_t n, std::size_t c, std::size_t h) {
  return Range3({0, 0, 0}, {long(n), long(c), long(h)});
}
inline Range2 range2(std::size_t rows, std::size_t cols) { return Range2({0, 0}, {long(rows), long(cols)}); }

/// \brief Calls f(begin, end) on contiguous pieces covering [0, n), in parallel: long pieces when
/// the execution space is the host, so that the loop inside f vectorises, and single elements
/// on a GPU. (Compiled one index at a time, a select such as `v > 0 ? v : 0` became a branch
/// that mispredicted on half of all activations, which made ReLU ten times slower than a copy.)
/// Inside f, load every operand before selecting, so the select needs no conditional load.
template <class F>
void for_each_piece(const char* label, std::size_t n, const F& f) {
  constexpr std::size_t piece = Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible ? 4096 : 1;
  const std::size_t pieces = (n + piece - 1) / piece;
  Kokkos::parallel_for(label, Kokkos::RangePolicy<ExecSpace>(0, pieces), KOKKOS_LAMBDA(const std::size_t i) {
    f(i * piece, (i + 1) * piece < n ? (i + 1) * piece : n);
  });
}

/// \brief \f$\sum_{i<n} f(i)\f$ in double with four independent partial sums, so that the adds
/// overlap instead of each waiting for the last (one running sum is bound by add latency).
template <class F>
KOKKOS_INLINE_FUNCTION double sum_of(int n, const F& f) {
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    a0 += f(i);
    a1 += f(i + 1);
    a2 += f(i + 2);
    a3 += f(i + 3);
  }
  for (; i < n; ++i) a0 += f(i);
  return (a0 + a1) + (a2 + a3);
}

/// \brief Whether a forward pass is part of training (batch statistics, running statistics
/// updated) or of evaluation (running statistics); `probe` is the training function without the
/// running statistics' update, for a second look at the same batch (self-tuned K-FAC's loss after
/// its update), so that the running statistics move once per step.
enum class Mode { train, eval, probe };

/// \brief The (N, C*H*W) matrix over the memory of `t`. Unmanaged: `t`'s owner keeps it alive.
inline Matrix as_matrix(const Tensor& t) {
  return Matrix(t.data(), t.extent(0), t.extent(1) * t.extent(2) * t.extent(3));
}

/// \brief The (N, C, 1, 1) tensor over the memory of `m`. Unmanaged, like as_matrix.
inline Tensor as_tensor(const Matrix& m) { return Tensor(m.data(), m.extent(0), m.extent(1), 1, 1); }

/// \brief The elements of `t` in memory order. Unmanaged, like as_matrix.
inline Vector as_vector(const Tensor& t) { return Vector(t.data(), t.size()); }

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
    if (size > store_.extent(0)) {
      const std::string label = store_.label();
      store_ = Kokkos::View<T*, MemSpace>();  // free the old block before taking the new one
      store_ = Kokkos::View<T*, MemSpace>(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), size);
    }
  }

  Kokkos::View<T*, MemSpace> store_;
};

/// \brief An (N, K) result computed on the host from an (N, K) input, in `out`: `fill(x, y, n, k)`
/// with host views of the input `x` and the result `y` (mirrors, or the views themselves on a host
/// space). For sequential host work whose result must not depend on the execution space or its
/// threads: the sampled Fisher's draws.
/// \return (N, K, 1, 1) over `out`, valid until `out` grows
template <class Fill>
Tensor fill_on_host(const Tensor& input, Buffer<float>& out, Fill&& fill) {
  const Matrix x = as_matrix(input);
  const int n = int(x.extent(0)), k = int(x.extent(1));
  const auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  const Matrix y = out.matrix(std::size_t(n), std::size_t(k));
  const auto yh = Kokkos::create_mirror_view(y);
  fill(xh, yh, n, k);
  Kokkos::deep_copy(y, yh);
  return as_tensor(y);
}

/// \brief A trainable parameter as optimizers see it: flat views of the value and its gradient.
struct Param {
  std::string name;
  Vector value;
  Vector grad;
  bool decay;  ///< whether weight decay applies (weights yes; biases and BatchNorm affine no)
};

}  // namespace nn
