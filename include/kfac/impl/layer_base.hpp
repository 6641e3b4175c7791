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

/// A factor as a flat buffer of its stored values, for communication and checkpoints.
struct FactorBuffer {
  const char* which;  // "A", "G" or "F"
  index_t n;          // matrix extent (n x n); for diagonal and unit-wise factors the entry count
  bool packed;        // travels as the packed upper triangle
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
  virtual void clear_observations() = 0;

  virtual void update_factors(const Exec& exec, double decay) = 0;
  virtual bool has_factors() const = 0;
  virtual void update_decomposition(const Exec& exec, double damping, bool precompute) = 0;
  virtual bool has_decomposition() const = 0;

  /// Preconditions (w, b) into an internal buffer and returns sum(v .* grad) for KL clipping.
  virtual double precondition(const Exec& exec, const grad_matrix& w, const grad_vector& b,
                              double damping) = 0;
  /// Writes nu * v back into (w, b).
  virtual void write_back(const Exec& exec, const grad_matrix& w, const grad_vector& b,
                          double nu) = 0;
  virtual MemoryReport memory() const = 0;

 private:
  std::string name_;
};

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
