#pragma once
/// \file gradient_workspace.hpp
/// \brief The gradient a block preconditions and its result, written once for every method: the
/// caller's weight gradient and bias as the column-major X = [w b]^T, the preconditioned V of
/// the same shape, the KL-clip inner product <V, X> and the scaled write-back.
#include <Kokkos_Core.hpp>

#include <cstddef>

#include "kfac/config.hpp"
#include "kfac/core/buffer.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/impl/ordered_sum.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {
namespace impl {

/// \brief x = [w b]^T (and the same into `copy` when given): the caller's row-major (g x c)
/// weight gradient and bias, as the column-major (c + 1 or c) x g matrix a block preconditions.
/// Column i of x is row i of w followed by b(i), so on the host each row is one contiguous,
/// vectorisable copy; device backends use a two-index range whose fastest index is contiguous
/// on both sides.
template <class Exec, class W, class B, class X>
void load_transposed(const Exec& exec, const W& w, const B& b, const X& x, const X& copy = X()) {
  using T = typename X::non_const_value_type;
  const int rows = int(w.extent(0)), cols = int(w.extent(1)), total = int(x.extent(0));
  const bool both = copy.extent(0) == x.extent(0) && copy.extent(1) == x.extent(1) && copy.data() != nullptr;
  if constexpr (host_accessible_v<Exec>) {
    Kokkos::parallel_for(
        "kfac::gradient::load", Kokkos::RangePolicy<Exec>(exec, 0, rows), KOKKOS_LAMBDA(int i) {
          T* xi = &x(0, i);
          const auto* wi = &w(i, 0);
          for (int j = 0; j < cols; ++j) xi[j] = T(wi[j]);
          if (total > cols) xi[cols] = T(b(i));
          if (both) {
            T* ci = &copy(0, i);
            for (int j = 0; j < total; ++j) ci[j] = xi[j];
          }
        });
  } else {
    Kokkos::parallel_for(
        "kfac::gradient::load", ColumnMajorRange<Exec>(exec, {0, 0}, {total, rows}), KOKKOS_LAMBDA(int j, int i) {
          const T v = T(j < cols ? w(i, j) : b(i));
          x(j, i) = v;
          if (both) copy(j, i) = v;
        });
  }
}

/// \brief The inverse of load_transposed, scaled: w(i, j) = scale x(j, i), b(i) = scale x(c, i).
template <class Exec, class X, class W, class B>
void store_transposed(const Exec& exec, const X& x, double scale, const W& w, const B& b) {
  using T = typename W::non_const_value_type;
  using D = typename X::non_const_value_type;
  const int rows = int(w.extent(0)), cols = int(w.extent(1)), total = int(x.extent(0));
  const D s = D(scale);
  if constexpr (host_accessible_v<Exec>) {
    Kokkos::parallel_for(
        "kfac::gradient::store", Kokkos::RangePolicy<Exec>(exec, 0, rows), KOKKOS_LAMBDA(int i) {
          const D* xi = &x(0, i);
          T* wi = &w(i, 0);
          for (int j = 0; j < cols; ++j) wi[j] = T(s * xi[j]);
          if (total > cols) b(i) = T(s * xi[cols]);
        });
  } else {
    Kokkos::parallel_for(
        "kfac::gradient::store", ColumnMajorRange<Exec>(exec, {0, 0}, {total, rows}), KOKKOS_LAMBDA(int j, int i) {
          const T v = T(s * x(j, i));
          if (j < cols) w(i, j) = v; else b(i) = v;
        });
  }
}


/// \brief What Block's gradient members (load_gradient, inner_product, preconditioned,
/// write_back) call: GradientWorkspace, whatever the scalar its method preconditions in.
template <class Scalar, class Exec>
class GradientBuffers {
 public:
  using grad_matrix = GradMatrix<Scalar, Exec>;
  using grad_vector = GradVector<Scalar, Exec>;
  virtual ~GradientBuffers() = default;
  /// X = [w b]^T, allocating X and V at the first call.
  virtual void load(const Exec& exec, const grad_matrix& w, const grad_vector& b) = 0;
  /// \f$\langle V, X\rangle\f$ in double, in a fixed order (ordered_sum).
  virtual double inner_product(const Exec& exec) const = 0;
  /// V as a flat buffer (allocated if no gradient was loaded yet): what gradient receivers get.
  virtual Buffer output() = 0;
  /// [w b] = nu V^T.
  virtual void store(const Exec& exec, const grad_matrix& w, const grad_vector& b, double nu) const = 0;
  /// Bytes of X and V (0 before the first load).
  virtual std::size_t bytes() const = 0;
  /// Bytes of X and V once a gradient was loaded.
  virtual std::size_t planned_bytes() const = 0;
};

/// \brief X and V of one layer in the scalar `D` its method preconditions in: (cols + bias) x
/// rows, column-major, so column i is row i of the caller's gradient with its bias.
///
/// A block owns one as a member, hands it to Block::use_gradient in its constructor, and its
/// apply reads x() and writes v(). Two settings keep each method's arithmetic as it was written:
/// - start_from_x(): load() also copies X into V, for a method that preconditions V in place
///   (NG-SGD);
/// - terms_per_column(): the inner product's terms are whole columns (a unit-wise block's
///   unit), instead of single entries. The grouping is part of the sum's last bits.
template <class D, class Scalar, class Exec>
class GradientWorkspace final : public GradientBuffers<Scalar, Exec> {
 public:
  using Matrix = Kokkos::View<D**, Kokkos::LayoutLeft, typename Exec::memory_space>;
  using typename GradientBuffers<Scalar, Exec>::grad_matrix;
  using typename GradientBuffers<Scalar, Exec>::grad_vector;

  /// \param rows [in] the weight gradient's rows (V's columns)
  /// \param cols [in] the weight gradient's columns
  /// \param bias [in] whether a bias follows each row (one more row of X)
  GradientWorkspace(index_t rows, index_t cols, bool bias) : rows_(rows), n_(cols + (bias ? 1 : 0)) {}

  GradientWorkspace& start_from_x() {
    start_from_x_ = true;
    return *this;
  }
  GradientWorkspace& terms_per_column() {
    per_column_ = true;
    return *this;
  }

  /// X = [w b]^T from the last load().
  const Matrix& x() const { return x_; }
  /// V, the preconditioned X: what the block's apply writes.
  const Matrix& v() const { return v_; }
  void allocate() {
    if (x_.extent(0) != 0) return;
    x_ = Matrix("kfac::gradient::x", n_, rows_);
    v_ = Matrix("kfac::gradient::v", n_, rows_);
  }

  void load(const Exec& exec, const grad_matrix& w, const grad_vector& b) override {
    allocate();
    load_transposed(exec, w, b, x_, start_from_x_ ? v_ : Matrix());
  }
  double inner_product(const Exec& exec) const override {
    auto v = v_;
    auto x = x_;
    if (per_column_) {
      const long n = long(n_);
      return ordered_sum(exec, "kfac::gradient::vx_sum", long(rows_), KOKKOS_LAMBDA(long i) {
        double s = 0;
        for (long j = 0; j < n; ++j) s += double(v(j, i)) * double(x(j, i));
        return s;
      });
    }
    return ordered_sum(exec, "kfac::gradient::vx_sum", long(n_), long(rows_),
                       KOKKOS_LAMBDA(long j, long i) { return double(v(j, i)) * double(x(j, i)); });
  }
  Buffer output() override {
    allocate();
    return buffer_of(v_);
  }
  void store(const Exec& exec, const grad_matrix& w, const grad_vector& b, double nu) const override {
    store_transposed(exec, v_, nu, w, b);
  }
  std::size_t bytes() const override { return (x_.span() + v_.span()) * sizeof(D); }
  /// Bytes of X and V once allocated.
  std::size_t planned_bytes() const override { return 2 * std::size_t(n_) * std::size_t(rows_) * sizeof(D); }

 private:
  index_t rows_, n_;
  bool start_from_x_ = false, per_column_ = false;
  Matrix x_, v_;
};

}  // namespace impl
}  // namespace kfac
