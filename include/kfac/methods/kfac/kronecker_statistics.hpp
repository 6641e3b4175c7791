#pragma once
/// \file kronecker_statistics.hpp
/// \brief The statistics of a Kronecker-factored layer (Dense, Conv2d), shared by the K-FAC
/// block (kronecker_block.hpp) and the closed-form Diagonal one (diagonal/diagonal_block.hpp):
/// observations folded into pending Gram matrices, running factors A and G with their decay,
/// the checks on a step's observations, and the gradient workspace.

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/precision.hpp"
#include "kfac/linalg/syrk.hpp"
#include "kfac/methods/kfac/factors.hpp"

namespace kfac {
namespace impl {

/// \brief Folds one observation's rows R into the pending Gram matrix: \f$P = R^T R\f$ (first
/// observation of the step) or \f$P = P + R^T R\f$, the upper triangle by syrk, or only the
/// diagonal. A free function because nvcc rejects device lambdas in private members.
template <bool diagonal, class Exec, class RMatrix, class FMatrix>
void fold_observation(const Exec& exec, const RMatrix& rows, bool first, const FMatrix& p) {
  using F = typename FMatrix::non_const_value_type;
  if constexpr (diagonal) {
    const int m = int(rows.extent(0));
    Kokkos::parallel_for(
        "kfac::layer::diagonal_gram", Kokkos::RangePolicy<Exec>(exec, 0, int(p.extent(0))),
        KOKKOS_LAMBDA(int j) {
          F s = 0;
          for (int r = 0; r < m; ++r) s += rows(r, j) * rows(r, j);
          p(j, 0) = first ? s : p(j, 0) + s;
        });
  } else {
    syrk_t_upper(exec, F(1), rows, F(first ? 0 : 1), p);  // beta = 0 ignores p's old values
  }
}

/// \brief fold_observation into the pending Gram matrix `pending` of an n x n factor (n x 1
/// for diagonal ones), allocated at the first call and kept: each step's first observation
/// overwrites it (`first`, beta = 0), later ones add to it, so no step allocates or zeroes n x n
/// memory. Shared by every block that keeps a Kronecker factor's statistics (KroneckerStatistics,
/// EmbeddingBlock's G).
template <bool diagonal, class Exec, class Rows, class PMatrix>
void fold_into_pending(const Exec& exec, const Rows& rows, bool first, index_t n, PMatrix& pending) {
  using C = typename PMatrix::non_const_value_type;
  // The host BLAS's syrk, and GEMM (KokkosBlas, cuBLAS) alike, never read C when beta = 0,
  // and only the upper triangle is read afterwards; the portable path is still zeroed once,
  // at allocation, so that no uninitialised value is ever read by a kernel.
  constexpr bool overwritten = syrk_overwrites_v<Exec, C> || diagonal;
  if (pending.extent(0) == 0) {
    if constexpr (overwritten)
      pending = PMatrix(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::layer::pending"), n, diagonal ? 1 : n);
    else
      pending = PMatrix("kfac::layer::pending", n, diagonal ? 1 : n);
  }
  fold_observation<diagonal>(exec, rows, first, pending);
}

/// \brief \f$f = \beta_0 f + \alpha P\f$ from the pending Gram matrix P (its upper triangle, or
/// the diagonal), computed in P's arithmetic type C and rounded once to f's storage type
/// (kfac::Half: float arithmetic); \f$\beta_0 = 0\f$ ignores f's old values, as BLAS does.
/// `full` mirrors the upper triangle into the lower one. For one observation whose rows fit in
/// one of the BLAS's k-blocks this is bit for bit what syrk with \f$\alpha, \beta_0\f$ on the
/// rows gave: both round \f$\beta_0 f\f$ and \f$\alpha R^T R\f$ and then their sum.
template <bool diagonal, bool full, class Exec, class PMatrix, class FMatrix, class C>
void fold_factor(const Exec& exec, const PMatrix& p, C alpha, C beta0, const FMatrix& f) {
  using S = typename FMatrix::non_const_value_type;
  const int n = int(f.extent(0));
  Kokkos::parallel_for(
      "kfac::layer::fold_factor", Kokkos::RangePolicy<Exec>(exec, 0, int(f.extent(1))), KOKKOS_LAMBDA(int j) {
        const int rows = diagonal ? n : j + 1;
        if (beta0 == C(0))
          for (int i = 0; i < rows; ++i) f(i, j) = S(alpha * p(i, j));
        else
          for (int i = 0; i < rows; ++i) f(i, j) = S(beta0 * C(f(i, j)) + alpha * p(i, j));
      });
  if constexpr (full && !diagonal) {
    Kokkos::parallel_for(
        "kfac::layer::symmetrize", Kokkos::RangePolicy<Exec>(exec, 0, n),
        KOKKOS_LAMBDA(int j) { for (int i = j + 1; i < n; ++i) f(i, j) = f(j, i); });
  }
}

/// f = I (the upper triangle and, for `full`, the lower; a diagonal layout's column of ones).
template <bool diagonal, class Exec, class FMatrix>
void fill_identity(const Exec& exec, const FMatrix& f) {
  using S = typename FMatrix::non_const_value_type;
  const int n = int(f.extent(0)), cols = int(f.extent(1));
  Kokkos::parallel_for(
      "kfac::layer::identity", Kokkos::RangePolicy<Exec>(exec, 0, cols), KOKKOS_LAMBDA(int j) {
        if (diagonal) f(j, 0) = S(1);
        else
          for (int i = 0; i < n; ++i) f(i, j) = S(i == j ? 1 : 0);
      });
}

/// Trace of a pending Gram matrix (its diagonal: column 0 of the diagonal layout), in double:
/// the sum of squares of every row folded into it, with no pass over the rows. NaN or Inf in
/// an observation, or a square too large for P's type, makes it non-finite (a diagonal entry
/// bounds its row and column: \f$|P_{ij}| \le \sqrt{P_{ii} P_{jj}}\f$).
template <bool diagonal, class Exec, class PMatrix>
double pending_trace(const Exec& exec, const PMatrix& p) {
  return ordered_sum(exec, "kfac::layer::pending_trace", long(p.extent(0)),
                     KOKKOS_LAMBDA(long i) { return double(diagonal ? p(i, 0) : p(i, i)); });
}

/// Trace of a square factor, in double.
template <class Exec, class FMatrix>
double trace(const Exec& exec, const FMatrix& f) {
  return ordered_sum(exec, "kfac::layer::trace", long(f.extent(0)), KOKKOS_LAMBDA(long i) { return double(f(i, i)); });
}

/// Whether a layer type says when its observations are their rows themselves (Dense:
/// `a_rows_are_input`, `g_rows_are_output_grad`); layer types without them always copy.
template <class L, class = void>
struct has_rows_in_place : std::false_type {};
template <class L>
struct has_rows_in_place<L, std::void_t<decltype(std::declval<const L&>().a_rows_are_input()),
                                        decltype(std::declval<const L&>().g_rows_are_output_grad())>>
    : std::true_type {};
/// \brief The running factors \f$A = E[a a^T]\f$ and \f$G = E[g g^T]\f$ of one Kronecker layer
/// (or their diagonals), from the layer's observations; the method blocks built on it add how
/// they precondition (KroneckerBlock: units A and G and an inversion policy; DiagonalBlock: a
/// closed form).
/// \tparam LayerType Dense or Conv2d: how observations become factor statistics.
/// \tparam FactorPolicy Full, Symmetric or Diagonal.
/// \tparam Prec Precision<Factor, Decomposition>.
/// \tparam Scalar the host framework's type of observations and gradients.
/// \tparam Exec the Kokkos execution space.
template <class LayerType, class FactorPolicy, class Prec, class Scalar, class Exec>
class KroneckerStatistics : public Block<Scalar, Exec> {
  static_assert(LayerType::is_kronecker, "KroneckerStatistics needs a Kronecker layer type");

 protected:
  using F = typename Prec::factor_type;
  using C = arithmetic_t<F>;  // observation rows and Gram products: float for Half
  using D = typename Prec::decomposition_type;
  using FMatrix = Matrix<F, Exec>;
  // Observation rows keep the host framework's row-major layout: filling them is a contiguous
  // copy, and BLAS reads them as the column-major transpose (syrk without a transpose).
  using RMatrix = Kokkos::View<C**, Kokkos::LayoutRight, typename Exec::memory_space>;
  // An observation that is its own rows, read in place (see rows_in_place).
  using ConstRows = Kokkos::View<const C**, Kokkos::LayoutRight, typename Exec::memory_space,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using PMatrix = Matrix<C, Exec>;  // pending Gram matrices, in the arithmetic type
  static constexpr bool diagonal = FactorPolicy::is_diagonal;

 public:
  using base = Block<Scalar, Exec>;
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using typename base::tensor_type;

  /// What every Kronecker block's description holds: the gradient's shape, the checkpoint (A
  /// and G), what is averaged (both factors, packed for Symmetric), the pending Gram matrices
  /// kept between steps, the split rows (g), and the work of forming the statistics: per
  /// observation row, forming it (a + g values written and read) and one syrk per factor,
  /// n (n + 1) flops (diagonal factors: 2 n). The method adds its signature, units and apply.
  static BlockDescription describe_statistics(const LayerType& layer) {
    const index_t na = layer.a_dim(), ng = layer.g_dim();
    BlockDescription d;
    d.kind = LayerType::kind;
    d.rows = layer.weight_rows();
    d.cols = layer.weight_cols();
    d.bias = layer.bias();
    const std::size_t a = std::size_t(na), g = std::size_t(ng);
    d.checkpoint = {{diagonal ? a : a * a, sizeof(F)}, {diagonal ? g : g * g, sizeof(F)}};
    d.averaged = {{na, !diagonal, !diagonal && FactorPolicy::packed}, {ng, !diagonal, !diagonal && FactorPolicy::packed}};
    d.memory.workspace = (diagonal ? a + g : a * a + g * g) * sizeof(C);  // the pending Gram matrices
    d.split_rows = ng;
    const double da = double(na), dg = double(ng);
    d.plan.statistics_per_row.gemm_flops = diagonal ? 2.0 * (da + dg) : da * (da + 1) + dg * (dg + 1);
    d.plan.statistics_per_row.stream_bytes = 2.0 * double(sizeof(C)) * (da + dg);
    d.plan.statistics_per_row.scalar = sizeof(C);
    d.plan.apply.scalar = sizeof(D);
    return d;
  }
  /// The signature's tail every Kronecker block ends with: its storage, arithmetic and host types.
  static std::string precision_signature() {
    return "/f" + std::to_string(sizeof(F)) + "d" + std::to_string(sizeof(D)) + "s" + std::to_string(sizeof(Scalar));
  }

  KroneckerStatistics(std::string name, const LayerType& layer, BlockDescription description)
      : base(std::move(name), std::move(description)), layer_(layer), na_(layer.a_dim()), ng_(layer.g_dim()),
        gradient_(layer.weight_rows(), layer.weight_cols(), layer.bias()) {
    this->use_gradient(gradient_);
    this->use_observations(ObservationPairs(layer));
  }

  const LayerType& layer() const { return layer_; }

  void add_input(const Exec& exec, const tensor_type& x) override {
    const auto e = extents_of(x);
    const ConstRows in_place = rows_in_place(x, layer_.a_rows(e), na_, 0);
    if (in_place.data()) {
      fold(exec, in_place, this->observations().inputs() == 0, na_, a_pending_);  // may throw (allocation): nothing counted yet
    } else {
      RMatrix rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::layer::a_rows"),
                   layer_.a_rows(e), na_);
      layer_.fill_a_rows(exec, x, rows);
      fold(exec, rows, this->observations().inputs() == 0, na_, a_pending_);
    }
    a_trace_ = pending_trace<diagonal>(exec, a_pending_);
    a_norm_ += layer_.a_normalizer(e);
    a_samples_ += e[0];
  }
  void add_output_grad(const Exec& exec, const tensor_type& g, double scale) override {
    const auto e = extents_of(g);
    const ConstRows in_place = rows_in_place(g, layer_.g_rows(e), ng_, scale == 1.0 ? 1 : -1);
    if (in_place.data()) {
      fold(exec, in_place, this->observations().output_grads() == 0, ng_, g_pending_);
    } else {
      RMatrix rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::layer::g_rows"),
                   layer_.g_rows(e), ng_);
      layer_.fill_g_rows(exec, g, scale, rows);
      fold(exec, rows, this->observations().output_grads() == 0, ng_, g_pending_);
    }
    g_trace_ = pending_trace<diagonal>(exec, g_pending_);
    g_norm_ += layer_.g_normalizer(e);
    g_samples_ += e[0];
  }
  /// Scale: the larger new factor's trace. Overflow: either trace above the factor type's range.
  ObservationCheck check_observations() const override {
    ObservationCheck c;
    c.scale = std::max(a_norm_ > 0 ? a_trace_ / a_norm_ : 0.0, g_norm_ > 0 ? g_trace_ / g_norm_ : 0.0);
    const double big = largest_value<F>();
    c.overflow = a_norm_ != 0 && g_norm_ != 0 && (!(a_trace_ / a_norm_ <= big) || !(g_trace_ / g_norm_ <= big));
    const auto& seen = this->observations();
    if (seen.inputs() == 0 && seen.output_grads() == 0) c.problem = "no observations were given";
    else if (seen.inputs() == 0) c.problem = "no input was observed";
    else if (seen.output_grads() == 0) c.problem = "no output gradient was observed";
    else if (a_samples_ != g_samples_)
      c.problem = "observed " + std::to_string(a_samples_) + " input samples but " +
                  std::to_string(g_samples_) + " output-gradient samples";
    else if (c.overflow)
      c.problem = "observations would overflow the factor type (trace of the new A " +
                  std::to_string(a_trace_ / a_norm_) + ", G " + std::to_string(g_trace_ / g_norm_) +
                  "; largest value " + std::to_string(big) + ")";
    return c;
  }
  /// The pending Gram matrices are kept (their values are dead until the next step's first
  /// observation overwrites them): allocating them again each step cost more than their syrk.
  void drop_observations() override {
    a_norm_ = g_norm_ = 0;
    a_trace_ = g_trace_ = 0;
    a_samples_ = g_samples_ = 0;
  }

  std::vector<Buffer> checkpoint_state() override {
    return {buffer_of(a_), buffer_of(g_)};
  }
  void allocate_state() override {
    allocate_factor_storage();
    this->set_statistics(true);
  }
  void release_state() override {
    a_ = FMatrix();
    g_ = FMatrix();
    this->set_statistics(false);
  }
  void start_statistics_at_identity(const Exec& exec) override {
    allocate_factor_storage();
    fill_identity<diagonal>(exec, a_);
    fill_identity<diagonal>(exec, g_);
    this->set_statistics(true);
  }
  void update_statistics(const Exec& exec, double decay) override {
    allocate_factor_storage();
    accumulate(exec, a_pending_, a_norm_, decay, a_);
    accumulate(exec, g_pending_, g_norm_, decay, g_);
    this->set_statistics(true);
  }

  // ---- read access for tests, distribution and checkpoints
  /// Factor A: (a_dim x a_dim) with the upper triangle valid (the whole matrix for Full), or
  /// (a_dim x 1) for Diagonal.
  const FMatrix& factor_a() const { return a_; }
  const FMatrix& factor_g() const { return g_; }
  /// The packed upper triangle of A or G (column by column: A(0,0), A(0,1), A(1,1), A(0,2), ...),
  /// n(n+1)/2 values: what distribution sends for Symmetric factors (as float for Half).
  Kokkos::View<C*, typename Exec::memory_space> packed_factor(int which) const {
    static_assert(!diagonal, "packed_factor: diagonal factors have no triangle");
    const FMatrix f = which == 0 ? a_ : g_;
    const index_t n = index_t(f.extent(0));
    Kokkos::View<C*, typename Exec::memory_space> p("kfac::layer::packed", std::size_t(n) * (n + 1) / 2);
    transfer_factor<Exec, C, F>(Exec(), FactorBuffer{buffer_of(f), n, true, true}, p, 0, true);
    return p;
  }

 protected:
  /// The memory of what this class holds: the running factors (factor_bytes), the gradient
  /// and the pending Gram matrices (workspace_bytes). A block adds its units and buffers.
  MemoryReport statistics_memory() const {
    MemoryReport r{this->name(), this->kind(), 0, 0, 0};
    r.factor_bytes = (a_.size() + g_.size()) * sizeof(F);
    r.workspace_bytes = this->gradient_.bytes() + (a_pending_.size() + g_pending_.size()) * sizeof(C);
    return r;
  }
  void allocate_factor_storage() {
    if (a_.extent(0) == 0) {
      a_ = FMatrix("kfac::layer::A", na_, diagonal ? 1 : na_);
      g_ = FMatrix("kfac::layer::G", ng_, diagonal ? 1 : ng_);
    }
  }
  /// f = decay f + (1 - decay) sum_k rows_k^T rows_k / norm (f = the new value on the first update).
  void accumulate(const Exec& exec, const PMatrix& pending, double norm, double decay, const FMatrix& f) {
    const bool had = this->has_statistics();
    const double new_weight = had ? 1.0 - decay : 1.0;
    fold_factor<diagonal, std::is_same<FactorPolicy, Full>::value>(
        exec, pending, C(new_weight / norm), C(had ? decay : 0.0), f);
  }

  /// The observation itself as its m x n rows, when the layer type says it is (which: 0 input,
  /// 1 output gradient, -1 neither) and it is in the arithmetic type: the syrk then reads the
  /// caller's memory during the observe call, with no copy (the same values, so the same bits).
  /// An empty view otherwise.
  ConstRows rows_in_place(const tensor_type& t, index_t m, index_t n, int which) const {
    if constexpr (std::is_same<Scalar, C>::value && has_rows_in_place<LayerType>::value) {
      const bool same = which == 0 ? layer_.a_rows_are_input() : which == 1 && layer_.g_rows_are_output_grad();
      if (same) return ConstRows(t.data(), m, n);
    } else {
      (void)t; (void)m; (void)n; (void)which;
    }
    return ConstRows();
  }

  /// Folds one observation's rows into its pending Gram matrix (fold_into_pending), so that
  /// only O(n^2) stays between observe and step, whatever the batch. The rows themselves live
  /// only during the observe call.
  template <class Rows>
  void fold(const Exec& exec, const Rows& rows, bool first, index_t n, PMatrix& pending) {
    fold_into_pending<diagonal>(exec, rows, first, n, pending);
  }

  LayerType layer_;
  index_t na_, ng_;
  // Sum of R^T R over this step's observations (upper triangle), persistent across steps:
  // (a^2 + g^2) values of C from the first observation on, (a + g) for Diagonal.
  PMatrix a_pending_, g_pending_;
  double a_norm_ = 0, g_norm_ = 0;
  double a_trace_ = 0, g_trace_ = 0;  // traces of the pending Gram matrices (sums of squares of their rows)
  long a_samples_ = 0, g_samples_ = 0;
  FMatrix a_, g_;
  // X^T and V^T are (a_dim x g_dim) column-major: the memory order of the caller's row-major
  // (g_dim x a_dim) gradient, so that loading and storing it are contiguous copies.
  GradientWorkspace<D, Scalar, Exec> gradient_;
};

}  // namespace impl
}  // namespace kfac
