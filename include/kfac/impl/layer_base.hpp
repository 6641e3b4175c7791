#pragma once
// The type-erased per-layer interface the Preconditioner holds. Virtual calls happen on the
// host only, once per layer and phase; every kernel inside is a template instantiation.
#include <cstddef>
#include <string>
#include <vector>

#include "kfac/impl/blas.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief Memory held by one layer, in bytes.
struct MemoryReport {
  std::string name;
  std::string kind;
  std::size_t factor_bytes = 0;         ///< running factors A and G (or the unit-wise blocks)
  std::size_t decomposition_bytes = 0;  ///< eigenvectors/eigenvalues or inverses
  std::size_t workspace_bytes = 0;      ///< gradient buffers and pending observations
  std::size_t total() const { return factor_bytes + decomposition_bytes + workspace_bytes; }
};

namespace impl {

/// A contiguous buffer of a layer's state, for communication and checkpoints.
struct Buffer {
  void* data = nullptr;
  std::size_t count = 0;       ///< number of scalars
  std::size_t scalar_size = 0; ///< 4 (float) or 8 (double)
  std::size_t bytes() const { return count * scalar_size; }
};

/// A running factor as communicated: an n x n column-major matrix sent whole or as its packed
/// upper triangle (n(n+1)/2 values), or a flat vector (diagonal, unit-wise: `n` values).
struct FactorBuffer {
  Buffer storage;
  index_t n = 0;
  bool matrix = false;  ///< n x n matrix (else a flat vector of n values)
  bool packed = false;  ///< matrix travels as its upper triangle
  std::size_t payload_count() const {
    return matrix ? (packed ? std::size_t(n) * (n + 1) / 2 : std::size_t(n) * n) : std::size_t(n);
  }
};

template <class Scalar, class Exec>
class LayerBase {
 public:
  using tensor_type = Tensor4<Scalar, Exec>;
  using grad_matrix = GradMatrix<Scalar, Exec>;
  using grad_vector = GradVector<Scalar, Exec>;

  explicit LayerBase(std::string name) : name_(std::move(name)) {}
  virtual ~LayerBase() = default;
  LayerBase(const LayerBase&) = delete;
  LayerBase& operator=(const LayerBase&) = delete;

  const std::string& name() const { return name_; }
  virtual const char* kind() const = 0;
  /// Layer type, shape and policies, identical on every rank that registered the same layer.
  virtual std::string signature() const = 0;
  virtual index_t weight_rows() const = 0;
  virtual index_t weight_cols() const = 0;
  virtual bool has_bias() const = 0;

  /// Empty when valid, otherwise what was expected.
  virtual std::string check_input(const Extents& e) const = 0;
  virtual std::string check_output_grad(const Extents& e) const = 0;
  virtual void observe_input(const Exec& exec, const tensor_type& x) = 0;
  virtual void observe_output_grad(const Exec& exec, const tensor_type& g, double scale) = 0;
  /// Empty when the pending observations can form a factor update, otherwise why not.
  virtual std::string observations_problem() const = 0;
  /// True when the pending observations would overflow the factor type (a non-finite factor).
  virtual bool observations_overflow() const = 0;
  virtual void clear_observations() = 0;

  virtual void update_factors(const Exec& exec, double decay) = 0;
  virtual bool has_factors() const = 0;
  /// The running factors, for averaging across ranks and for checkpoints.
  virtual std::vector<FactorBuffer> factors() = 0;
  /// Allocates the factors (for restoring a checkpoint) and marks them present.
  virtual void allocate_factors() = 0;
  /// Frees the factors and marks them absent (restoring a checkpoint saved before any update).
  virtual void release_factors() = 0;
  /// Shapes of the state buffers without allocating them: part 0 = factors, 1 = decomposition
  /// of A, 2 = decomposition of G; each entry (value count, scalar size).
  virtual std::vector<std::pair<std::size_t, std::size_t>> buffer_shapes(int part) const = 0;

  /// Decomposes factor `which` (0 = A, 1 = G), allocating both factorizations if needed.
  virtual void decompose(const Exec& exec, int which, double damping) = 0;
  /// Called once both factorizations are in place (computed here or received).
  virtual void finish_decomposition(const Exec& exec, double damping, bool precompute) = 0;
  virtual bool has_decomposition() const = 0;
  virtual void invalidate_decomposition() = 0;
  /// The factorization of `which` as raw buffers (allocated by decompose or allocate_decomposition).
  virtual std::vector<Buffer> decomposition_buffers(int which) = 0;
  virtual void allocate_decomposition() = 0;
  /// Relative cost of decomposing `which` (n^3) and of storing it (n^2).
  virtual double decomposition_flops(int which) const = 0;
  virtual double decomposition_memory(int which) const = 0;
  /// Number of factors that need a decomposition (2 for Kronecker layers, 0 for closed forms).
  virtual int decomposed_factors() const = 0;

  /// Copies (w, b) into the layer's gradient buffer X.
  virtual void load_gradient(const Exec& exec, const grad_matrix& w, const grad_vector& b) = 0;
  /// V = preconditioned X, into the layer's output buffer.
  virtual void apply(const Exec& exec, double damping) = 0;
  /// sum(V .* X), for KL clipping.
  virtual double inner_product(const Exec& exec) const = 0;
  /// The output buffer V (broadcast to gradient receivers).
  virtual Buffer preconditioned() = 0;
  /// Writes nu * V back into (w, b).
  virtual void write_back(const Exec& exec, const grad_matrix& w, const grad_vector& b,
                          double nu) = 0;
  virtual MemoryReport memory() const = 0;

 private:
  std::string name_;
};

template <class V>
Buffer buffer_of(const V& v) {
  return Buffer{const_cast<void*>(static_cast<const void*>(v.data())), v.span(),
                sizeof(typename V::non_const_value_type)};
}

/// Copies factor `f` to (`to_flat`) or from a flat buffer starting at `offset`, in its payload
/// form: the packed upper triangle column by column (A(0,0), A(0,1), A(1,1), A(0,2), ...), the
/// whole column-major matrix, or the flat vector. Values read from the flat buffer are scaled.
template <class Exec, class T, class Flat>
void transfer_factor(const Exec& exec, const FactorBuffer& f, const Flat& flat, std::size_t offset,
                     bool to_flat, T scale = T(1)) {
  T* data = static_cast<T*>(f.storage.data);
  const std::size_t o = offset;
  if (!f.matrix) {
    Kokkos::parallel_for(
        "kfac::comm::transfer_vector", Kokkos::RangePolicy<Exec>(exec, 0, f.n), KOKKOS_LAMBDA(int i) {
          if (to_flat) flat(o + i) = data[i]; else data[i] = flat(o + i) * scale;
        });
    return;
  }
  Kokkos::View<T**, Kokkos::LayoutLeft, typename Exec::memory_space,
               Kokkos::MemoryTraits<Kokkos::Unmanaged>>
      m(data, f.n, f.n);
  const int n = f.n;
  const bool packed = f.packed;
  Kokkos::parallel_for(
      "kfac::comm::transfer_matrix", Kokkos::RangePolicy<Exec>(exec, 0, n), KOKKOS_LAMBDA(int j) {
        const std::size_t col = packed ? o + std::size_t(j) * (j + 1) / 2 : o + std::size_t(j) * n;
        const int rows = packed ? j + 1 : n;
        for (int i = 0; i < rows; ++i) {
          if (to_flat) flat(col + i) = m(i, j); else m(i, j) = flat(col + i) * scale;
        }
      });
}

/// Sum of squares of a matrix's entries, in double.
template <class Exec, class M>
double sum_of_squares(const Exec& exec, const M& m) {
  // Eight independent partial sums per index: a plain reduction is one dependent chain of
  // additions on a serial backend and ran 5x slower than this (as long as the copy it checks).
  constexpr long w = 8;
  const long size = long(m.span()), full = size / w;
  const auto* p = m.data();
  double s = 0;
  Kokkos::parallel_reduce(
      "kfac::check::sum_of_squares", Kokkos::RangePolicy<Exec>(exec, 0, full + 1),
      KOKKOS_LAMBDA(long b, double& acc) {
        const long end = b < full ? (b + 1) * w : size;
        double part = 0;
        for (long i = b * w; i < end; ++i) part += double(p[i]) * double(p[i]);
        acc += part;
      },
      s);
  return s;
}

/// Counts the non-finite entries of any view, on its execution space.
template <class Exec, class V>
long count_nonfinite(const Exec& exec, const V& v) {
  long bad = 0;
  const auto* p = v.data();
  Kokkos::parallel_reduce(
      "kfac::check::nonfinite", Kokkos::RangePolicy<Exec>(exec, 0, long(v.span())),
      KOKKOS_LAMBDA(long i, long& s) { s += finite_(p[i]) ? 0 : 1; }, bad);
  return bad;
}

}  // namespace impl
}  // namespace kfac
