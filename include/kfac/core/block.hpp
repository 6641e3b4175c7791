#pragma once
/// \file block.hpp
/// \brief The per-layer block interface every method implements, and the buffer views that
/// distribution and checkpoints work on.
#include <cstddef>
#include <functional>
#include <utility>
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

/// Shares unit `unit` of one layer (its buffers) from a background thread
/// (Options::background_sharing); returns {bytes this rank sent, MPI calls}, which the calling
/// thread counts later. Empty: the distribution shares nothing in the background.
using BackgroundSharer = std::function<std::pair<std::size_t, std::size_t>(int unit, const std::vector<Buffer>&)>;

/// A running factor as communicated: an n x n column-major matrix sent whole or as its packed
/// upper triangle (n(n+1)/2 values), or a flat vector (diagonal, unit-wise: `n` values).
struct FactorBuffer {
  Buffer storage;
  index_t n = 0;
  bool matrix = false;  ///< n x n matrix (else a flat vector of n values)
  bool packed = false;  ///< matrix travels as its upper triangle
  const void* base = nullptr;  ///< the value before this step's update, to send the increment
  /// The one rank that needs the average (reduce-to-owner; -1: every rank). Such a buffer
  /// travels as it is, and its owner reads base + the average (base: decay x the old value).
  int owner = -1;
  std::size_t payload_count() const {
    return matrix ? (packed ? std::size_t(n) * (n + 1) / 2 : std::size_t(n) * n) : std::size_t(n);
  }
};

/// (value count, scalar size) of one state buffer, known before it is allocated.
using BufferShape = std::pair<std::size_t, std::size_t>;

}  // namespace impl

/// \brief What a computation runs, in the kinds of work kfac::MachineFigures prices: a method
/// states its own work (per decomposable unit, per preconditioning, per observation row) and
/// the cost model multiplies it by the machine's rates, so no method is restated in the planner.
struct Work {
  double eigh_n3 = 0;            ///< symmetric eigendecompositions (LAPACK syevd): sum of n^3
  double factorization_n3 = 0;   ///< Cholesky factorizations and their inverses (potrf + potri): sum of n^3
  double gemm_flops = 0;         ///< matrix products (GEMM, SYRK), in flops
  double iteration_flops = 0;    ///< GEMM flops of one iteration of an iterative solver (Newton-Schulz)
  double stream_bytes = 0;       ///< bytes read and written by element-wise passes
  std::size_t scalar = 8;        ///< bytes of the arithmetic's scalar (4: float rates apply)
  /// This work done `times` times (e.g. per observation row times the rows).
  Work times(double times) const {
    Work w = *this;
    w.eigh_n3 *= times;
    w.factorization_n3 *= times;
    w.gemm_flops *= times;
    w.iteration_flops *= times;
    w.stream_bytes *= times;
    return w;
  }
};

/// \brief The work of a block's step besides its units' decompositions (Block::plan).
struct BlockPlan {
  Work statistics_per_row;  ///< forming the statistics, per observation row of a factor update
  Work apply;               ///< preconditioning the whole gradient once
};

namespace impl {

/// What one decomposable unit (K-FAC: factor A or G) costs: the greedy work assignment
/// balances `flops` (AssignmentCost::compute) or `memory` (AssignmentCost::memory), in the
/// relative units n^3 and n^2; `work` is what decomposing it runs, for the cost model's times.
struct UnitCost {
  double flops = 0;
  double memory = 0;
  Work work{};
};

/// One decomposable unit of a block (K-FAC: the factor A or G): what decomposing it costs and
/// the shapes of the buffers that carry it (Block::unit_buffers) between ranks.
struct Unit {
  UnitCost cost;
  std::vector<BufferShape> shapes;
};

/// \brief What a block is, fixed when it is built: its method's constructor fills it, and the
/// core, the distribution, checkpoints and the cost model read it instead of asking the block.
struct BlockDescription {
  const char* kind = "";  ///< the layer kind Options::skip_layers matches
  /// Layer type, shape, method, its settings and precision: equal on every rank that
  /// registered the same layer (the registration agreement compares it).
  std::string signature;
  index_t rows = 0, cols = 0;  ///< the weight gradient's shape
  bool bias = false;
  std::vector<BufferShape> checkpoint;  ///< the shapes of checkpoint_state()'s buffers
  std::vector<Unit> units;              ///< decomposable units (closed forms: none)
  /// True when decomposing one unit reads the other units' statistics (K-FAC's pi-damping
  /// reads both factors' traces): reduce-to-owner then keeps them on one rank or on all.
  bool units_coupled = false;
  /// True when decompose(), after prepare_decomposition(), may run on a second host thread
  /// while the first launches other kernels (Options::decomposition_delay): it launches only
  /// range kernels and copies on a Kokkos::Serial space and calls LAPACK.
  bool decomposes_off_thread = false;
  /// Passes of a divided apply (0: not divisible; closed forms, BatchNorm, NG-SGD). Pass k
  /// computes rows [r0, r1) of its output in preconditioned(); the ranks sharing the layer
  /// gather every pass's rows before pass k + 1 starts, and the last pass's output is V.
  int split_passes = 0;
  /// Output rows of a divided apply (K-FAC: the weight gradient's rows g); row i is values
  /// [i c, (i + 1) c) of preconditioned(), c = its count / split_rows.
  index_t split_rows = 0;
  /// The work of forming the statistics and of preconditioning, for the cost model (default:
  /// neither is modelled).
  BlockPlan plan;
};

/// \brief The per-layer unit a Preconditioner holds: one registered layer under one method.
///
/// Contract (every method's block implements all of it; none needs stubs):
/// - description: a value given to the constructor (BlockDescription): kind, signature,
///   gradient shape, checkpoint shapes, the decomposable units with their costs, the split of
///   the apply and the planned work; the accessors below read it, no virtual call;
/// - observations: checks that return why an observation is refused (empty when valid), then
///   observe_*; pending observations become statistics only in update_statistics(), and stay
///   pending until clear_observations(), so a step that fails can be retried;
/// - statistics from the gradient (Shampoo-like methods): observe_gradient(w, b) is called on
///   each statistics-update step, just before update_statistics(), with this step's (validated)
///   gradient. What it takes is pending like an observation, and a retried step calls it again:
///   the new call replaces what the failed attempt took (never adds to it). Default: nothing;
/// - state: averaged_state() is what the replica group averages after each statistics update
///   (K-FAC: the running factors); checkpoint_state() is what a checkpoint must hold to resume
///   (everything averaged, plus state that must never be averaged, e.g. a method's private
///   subspaces). Both are views of the block's own buffers;
/// - decomposable units (BlockDescription::units, K-FAC: A and G; closed forms: none): each is
///   computed on one rank by decompose(u), shared as unit_buffers(u), and
///   finish_decomposition() runs once all are in place;
/// - preconditioning: load_gradient, apply, inner_product (for KL clipping), preconditioned()
///   (the buffer shared with gradient receivers), write_back; optionally a divided apply
///   (split_passes, apply_rows) whose rows the layer's holders compute in parts and gather.
/// Virtual calls happen on the host, once per layer and phase; the kernels inside are templates.
template <class Scalar, class Exec>
class Block {
 public:
  using tensor_type = Tensor4<Scalar, Exec>;
  using grad_matrix = GradMatrix<Scalar, Exec>;
  using grad_vector = GradVector<Scalar, Exec>;

  Block(std::string name, BlockDescription description)
      : name_(std::move(name)), description_(std::move(description)) {}
  virtual ~Block() = default;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  const std::string& name() const { return name_; }
  /// What this block is (identity, gradient shape, units, split, planned work): fixed when built.
  const BlockDescription& description() const { return description_; }
  const char* kind() const { return description_.kind; }
  const std::string& signature() const { return description_.signature; }
  index_t weight_rows() const { return description_.rows; }
  index_t weight_cols() const { return description_.cols; }
  bool has_bias() const { return description_.bias; }
  const std::vector<BufferShape>& checkpoint_shapes() const { return description_.checkpoint; }
  /// Decomposable units (K-FAC: A and G; closed forms: none).
  int units() const { return int(description_.units.size()); }
  bool units_coupled() const { return description_.units_coupled; }
  const UnitCost& unit_cost(int u) const { return description_.units[std::size_t(u)].cost; }
  const std::vector<BufferShape>& unit_shapes(int u) const { return description_.units[std::size_t(u)].shapes; }
  bool decomposes_off_thread() const { return description_.decomposes_off_thread; }
  int split_passes() const { return description_.split_passes; }
  index_t split_rows() const { return description_.split_rows; }
  const BlockPlan& plan() const { return description_.plan; }

  virtual std::string check_input(const Extents& e) const = 0;
  virtual std::string check_output_grad(const Extents& e) const = 0;
  // Observations. The defaults describe a method that takes none (its statistics come from the
  // gradient, observe_gradient): it then overrides none of the four below.
  virtual void observe_input(const Exec&, const tensor_type&) {}
  virtual void observe_output_grad(const Exec&, const tensor_type&, double /*scale*/) {}
  /// Empty when the pending observations can form a statistics update, otherwise why not.
  virtual std::string observations_problem() const { return {}; }
  /// True when the pending observations would overflow the statistics' type.
  virtual bool observations_overflow() const { return false; }
  /// The largest value the pending observations' statistics can reach (K-FAC: the larger new
  /// factor's trace); a reduced-precision payload is checked against it. 0: not known.
  virtual double observations_scale() const { return 0; }
  virtual void clear_observations() = 0;
  /// Statistics from the gradient: called on statistics-update steps, before
  /// update_statistics(), with the gradient set for this step; replaces (not adds to) what an
  /// earlier call of the same step took, so a failed step can be retried (see the contract).
  virtual void observe_gradient(const Exec&, const grad_matrix&, const grad_vector&) {}

  /// Folds the pending observations into the running statistics (kept pending, see above).
  virtual void update_statistics(const Exec& exec, double decay) = 0;
  virtual bool has_statistics() const = 0;
  virtual std::vector<FactorBuffer> averaged_state() = 0;
  virtual std::vector<Buffer> checkpoint_state() = 0;
  /// Allocates the checkpoint state (to restore into it) and marks the statistics present.
  virtual void allocate_state() = 0;
  /// Frees the statistics and marks them absent.
  virtual void release_state() = 0;

  virtual void allocate_units() {}
  /// Frees the decompositions and the buffers only their holder needs.
  virtual void release_units() {}
  /// Computes unit u from the statistics, allocating the units if needed. `attempt` >= 1 is a
  /// retry of a failed decompose() with the raised damping: a block whose decomposition does
  /// not depend on the damping changes the problem then (K-FAC's eigendecomposition solves
  /// F + damping I), so that a retry is not the same computation.
  virtual void decompose(const Exec&, int /*u*/, double /*damping*/, int /*attempt*/ = 0) {}
  virtual std::vector<Buffer> unit_buffers(int) { return {}; }
  /// Computes on the calling thread what decompose() reads besides the statistics (K-FAC: the
  /// pi of pi-damping, from the factors' traces), once per decomposition of the layer.
  virtual void prepare_decomposition(const Exec&) {}
  /// Called once every unit is in place (computed here or received).
  virtual void finish_decomposition(const Exec&, double, bool) {}

  virtual void load_gradient(const Exec& exec, const grad_matrix& w, const grad_vector& b) = 0;
  /// V = preconditioned X, into the block's output buffer.
  virtual void apply(const Exec& exec, double damping) = 0;

  // Split preconditioning (Options::split_preconditioning; BlockDescription::split_passes > 0).
  /// Pass `pass` of a divided apply, rows [r0, r1) (possibly empty) of its output.
  virtual void apply_rows(const Exec&, double, int, index_t, index_t) {}
  /// sum(V .* X), for KL clipping.
  virtual double inner_product(const Exec& exec) const = 0;
  virtual Buffer preconditioned() = 0;
  /// Writes nu * V back into (w, b).
  virtual void write_back(const Exec& exec, const grad_matrix& w, const grad_vector& b,
                          double nu) = 0;
  virtual MemoryReport memory() const = 0;
  /// What memory() will report after a step (buffers kept between steps included), computed from the
  /// shapes without allocating: on a rank that holds the decompositions or not, for a skipped
  /// layer or not. The cost model reads this instead of restating the formula.
  virtual MemoryReport planned_memory(bool holder, bool skipped, bool precompute) const = 0;

  /// Kept for readers of the first API (statistics were called factors).
  bool has_factors() const { return has_statistics(); }

 private:
  std::string name_;
  BlockDescription description_;
};

/// Rows [first, second) of `rows` that part `part` of `parts` computes under split
/// preconditioning: contiguous blocks, sizes differing by at most one, in part order.
inline std::pair<index_t, index_t> row_block(index_t rows, int part, int parts) {
  const auto at = [&](int k) { return index_t((long long)rows * k / parts); };
  return {at(part), at(part + 1)};
}

template <class V>
Buffer buffer_of(const V& v) {
  return Buffer{const_cast<void*>(static_cast<const void*>(v.data())), v.span(),
                sizeof(typename V::non_const_value_type)};
}

/// Copies factor `f` to (`to_flat`) or from a flat buffer starting at `offset`, in its payload
/// form: the packed upper triangle column by column (A(0,0), A(0,1), A(1,1), A(0,2), ...), the
/// whole column-major matrix, or the flat vector. Values read from the flat buffer are scaled.
/// `S` is the factor's storage type, `T` the flat buffer's arithmetic type (they differ for
/// kfac::Half factors, which travel as float).
///
/// With a `base` (a buffer of f's shape: the value before this step's update), the increment
/// travels instead: to_flat writes f - base, and reading sets f = base + scale * flat. Averaging
/// increments in a reduced-precision payload rounds the increment, not the running average, so
/// the average converges to the native one (rounding the average itself stalls it).
template <class Exec, class T, class S = T, class Flat>
void transfer_factor(const Exec& exec, const FactorBuffer& f, const Flat& flat, std::size_t offset,
                     bool to_flat, T scale = T(1), const S* base = nullptr) {
  S* data = static_cast<S*>(f.storage.data);
  const std::size_t o = offset;
  const bool inc = base != nullptr;
  if (!f.matrix) {
    Kokkos::parallel_for(
        "kfac::comm::transfer_vector", Kokkos::RangePolicy<Exec>(exec, 0, f.n), KOKKOS_LAMBDA(int i) {
          const T b = inc ? T(base[i]) : T(0);
          if (to_flat) flat(o + i) = T(data[i]) - b; else data[i] = S(b + T(flat(o + i)) * scale);
        });
    return;
  }
  using M = Kokkos::View<S**, Kokkos::LayoutLeft, typename Exec::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  M m(data, f.n, f.n);
  M bm(const_cast<S*>(inc ? base : data), f.n, f.n);
  const int n = f.n;
  const bool packed = f.packed;
  Kokkos::parallel_for(
      "kfac::comm::transfer_matrix", Kokkos::RangePolicy<Exec>(exec, 0, n), KOKKOS_LAMBDA(int j) {
        const std::size_t col = packed ? o + std::size_t(j) * (j + 1) / 2 : o + std::size_t(j) * n;
        const int rows = packed ? j + 1 : n;
        for (int i = 0; i < rows; ++i) {
          const T b = inc ? T(bm(i, j)) : T(0);
          if (to_flat) flat(col + i) = T(m(i, j)) - b; else m(i, j) = S(b + T(flat(col + i)) * scale);
        }
      });
}

/// Sum of squares of a matrix's entries, in double.
template <class Exec, class M>
double sum_of_squares(const Exec& exec, const M& m) {
  // Eight-term blocks as the terms: a plain reduction is one dependent chain of additions on a
  // serial backend and ran 5x slower than this (as long as the copy it checks); ordered_sum's
  // fixed order makes the result the same on every host backend.
  constexpr long w = 8;
  const long size = long(m.span()), full = size / w;
  const auto* p = m.data();
  return ordered_sum(exec, "kfac::check::sum_of_squares", full + 1, KOKKOS_LAMBDA(long b) {
    const long end = b < full ? (b + 1) * w : size;
    double part = 0;
    for (long i = b * w; i < end; ++i) part += double(p[i]) * double(p[i]);
    return part;
  });
}

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
