#pragma once
/// \file kronecker_block.hpp
/// \brief The K-FAC block of one Kronecker-factored layer, composed from a layer-type, factor,
/// inversion and precision policy.

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/precision.hpp"
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

/// \f$\pi\f$ of Martens & Grosse (2015, §6.3) from the traces of the two factors, 1 when a trace
/// is 0 or the ratio is not finite (a factor of zeros must not make the damping infinite).
inline double pi_from_traces(double trace_a, index_t dim_a, double trace_g, index_t dim_g) {
  const double pi = std::sqrt((trace_a / double(dim_a)) / (trace_g / double(dim_g)));
  return pi > 0 && std::isfinite(pi) ? pi : 1.0;
}

/// Whether an inversion policy asks for π-damping (only the explicit-inverse ones have the setting).
template <class P, class = void>
struct has_pi_damping : std::false_type {};
template <class P>
struct has_pi_damping<P, std::void_t<decltype(std::declval<const P&>().pi_damping)>> : std::true_type {};
/// Passes of an inversion policy's divided apply (split preconditioning), 0 when it has none.
template <class P, class = void>
struct split_passes_of : std::integral_constant<int, 0> {};
template <class P>
struct split_passes_of<P, std::void_t<decltype(P::split_passes)>> : std::integral_constant<int, P::split_passes> {};
/// Whether a layer type says when its observations are their rows themselves (Dense:
/// `a_rows_are_input`, `g_rows_are_output_grad`); layer types without them always copy.
template <class L, class = void>
struct has_rows_in_place : std::false_type {};
template <class L>
struct has_rows_in_place<L, std::void_t<decltype(std::declval<const L&>().a_rows_are_input()),
                                        decltype(std::declval<const L&>().g_rows_are_output_grad())>>
    : std::true_type {};
/// Whether an inversion policy's settings depend on the layer's factor sizes (RandomizedEigen:
/// "exact" for a layer it decomposes exactly); the others give `settings()` alone.
template <class P, class = void>
struct has_layer_settings : std::false_type {};
template <class P>
struct has_layer_settings<P, std::void_t<decltype(std::declval<const P&>().settings(index_t(1), index_t(1)))>>
    : std::true_type {};
/// Whether a policy's factorization is built from the factor's size and the policy (its buffer
/// sizes depend on a setting: RandomizedEigen's rank), rather than from the size alone.
template <class Fact, class P>
using builds_with_settings = std::is_constructible<Fact, index_t, const P&>;
template <class P, class = void>
struct host_thread_safe : std::false_type {};
template <class P>
struct host_thread_safe<P, std::void_t<decltype(P::host_thread_safe), typename P::backend_type>>
    : std::integral_constant<bool, P::host_thread_safe> {};

}  // namespace impl

/// \brief K-FAC state of one layer whose Fisher block is approximated by \f$G \otimes A\f$.
/// \tparam LayerType Dense or Conv2d: how observations become factor statistics.
/// \tparam FactorPolicy Full, Symmetric or Diagonal.
/// \tparam InversePolicy Eigendecomposition<>, RandomizedEigen<>, Cholesky<> or NewtonSchulz
///         (ignored for Diagonal, whose damped inverse is closed-form).
/// \tparam Prec Precision<Factor, Decomposition>.
/// \tparam Scalar the host framework's type of observations and gradients.
/// \tparam Exec the Kokkos execution space.
template <class LayerType, class FactorPolicy, class InversePolicy, class Prec, class Scalar,
          class Exec>
class KroneckerBlock final : public impl::Block<Scalar, Exec> {
  static_assert(LayerType::is_kronecker, "KroneckerBlock needs a Kronecker layer type");
  using F = typename Prec::factor_type;
  using C = impl::arithmetic_t<F>;  // observation rows and Gram products: float for Half
  using D = typename Prec::decomposition_type;
  using FMatrix = impl::Matrix<F, Exec>;
  using DMatrix = impl::Matrix<D, Exec>;
  // Observation rows keep the host framework's row-major layout: filling them is a contiguous
  // copy, and BLAS reads them as the column-major transpose (syrk without a transpose).
  using RMatrix = Kokkos::View<C**, Kokkos::LayoutRight, typename Exec::memory_space>;
  // An observation that is its own rows, read in place (see rows_in_place).
  using ConstRows = Kokkos::View<const C**, Kokkos::LayoutRight, typename Exec::memory_space,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using PMatrix = impl::Matrix<C, Exec>;  // pending Gram matrices, in the arithmetic type
  using Fact = typename InversePolicy::template Factorization<D, Exec>;
  static constexpr bool diagonal = FactorPolicy::is_diagonal;

 public:
  using base = impl::Block<Scalar, Exec>;
  using inversion_type = InversePolicy;
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using typename base::tensor_type;

  KroneckerBlock(std::string name, const LayerType& layer, InversePolicy inversion = InversePolicy{})
      : base(std::move(name), describe(layer, inversion)), layer_(layer), inversion_(std::move(inversion)),
        na_(layer.a_dim()), ng_(layer.g_dim()), gradient_(layer.weight_rows(), layer.weight_cols(), layer.bias()) {
    this->use_gradient(gradient_);
    this->use_observations(impl::ObservationPairs(layer));
    if constexpr (!diagonal) this->use_units({&unit_a_, &unit_g_});
  }

  /// \brief Unit 0 (A) or 1 (G): the factorization of one factor, computed with its share of
  /// the damping (pi-damping splits it between the two, from both factors' traces).
  class FactorUnit final : public impl::UnitState<Exec> {
   public:
    FactorUnit(KroneckerBlock& block, int side) : block_(block), side_(side) {}
    void release() override { fact_.reset(); }
    /// Retries of an eigendecomposition (which ignores the damping) decompose A + damping I and
    /// take the damping off the eigenvalues again; explicit inverses use the raised damping.
    void decompose(const Exec& exec, double damping, int attempt) override {
      if constexpr (!diagonal) {
        allocate();
        const double shift = attempt > 0 && InversePolicy::damping_at_apply ? damping : 0.0;
        // Explicit inverses add sqrt(damping) to their factor: damping pi^2 for A and
        // damping / pi^2 for G give pi sqrt(damping) and sqrt(damping) / pi (pi = 1: unchanged).
        const double pi = block_.pi_ > 0 ? block_.pi_ : block_.pi_damping(exec);
        if (side_ == 0) fact_->compute(exec, block_.a_, pi == 1.0 ? damping : damping * pi * pi, block_.inversion_, shift);
        else fact_->compute(exec, block_.g_, pi == 1.0 ? damping : damping / (pi * pi), block_.inversion_, shift);
      } else {
        (void)exec; (void)damping; (void)attempt;
      }
    }
    std::vector<impl::Buffer> buffers() override {
      allocate();
      if constexpr (!diagonal) return fact_->buffers();
      else return {};
    }
    const Fact* get() const { return fact_.get(); }

   private:
    void allocate() {
      if constexpr (!diagonal) {
        if (fact_) return;
        const index_t n = side_ == 0 ? block_.na_ : block_.ng_;
        if constexpr (impl::builds_with_settings<Fact, InversePolicy>::value) fact_ = std::make_unique<Fact>(n, block_.inversion_);
        else fact_ = std::make_unique<Fact>(n);
      }
    }

    KroneckerBlock& block_;
    int side_;
    std::unique_ptr<Fact> fact_;
  };

  /// The block's description: unit 0 is A, unit 1 is G (Diagonal: no units, a closed form).
  static impl::BlockDescription describe(const LayerType& layer, const InversePolicy& inversion) {
    const index_t na = layer.a_dim(), ng = layer.g_dim();
    impl::BlockDescription d;
    d.kind = LayerType::kind;
    std::string settings;
    if constexpr (diagonal) settings = "";
    else if constexpr (impl::has_layer_settings<InversePolicy>::value) settings = inversion.settings(na, ng);
    else settings = inversion.settings();
    d.signature = layer.describe() + "/" + FactorPolicy::name + "/" +
                  (diagonal ? "closed_form" : InversePolicy::name) +
                  (settings.empty() ? "" : "[" + settings + "]") + "/f" + std::to_string(sizeof(F)) +
                  "d" + std::to_string(sizeof(D)) + "s" + std::to_string(sizeof(Scalar));
    d.rows = layer.weight_rows();
    d.cols = layer.weight_cols();
    d.bias = layer.bias();
    const std::size_t a = std::size_t(na), g = std::size_t(ng);
    d.checkpoint = {{diagonal ? a : a * a, sizeof(F)}, {diagonal ? g : g * g, sizeof(F)}};
    d.averaged = {{na, !diagonal, !diagonal && FactorPolicy::packed}, {ng, !diagonal, !diagonal && FactorPolicy::packed}};
    // Kept between steps: the pending Gram matrices (from the first observation on), and on a
    // holder the apply's intermediate (g a) and a precomputed reciprocal (g a).
    d.memory.workspace = (diagonal ? a + g : a * a + g * g) * sizeof(C);
    if constexpr (!diagonal) {
      d.memory.holder_workspace = g * a * sizeof(D);
      if (InversePolicy::damping_at_apply) d.memory.precomputed = g * a * sizeof(D);
      for (index_t n : {na, ng}) {
        impl::Unit u{inversion.cost(n), {}, d.units.empty() ? "A" : "G"};
        u.cost.work.scalar = sizeof(D);
        for (std::size_t c : inversion.counts(n)) u.shapes.push_back({c, sizeof(D)});
        d.units.push_back(std::move(u));
      }
      if constexpr (impl::has_pi_damping<InversePolicy>::value) d.units_coupled = inversion.pi_damping;
#if defined(KOKKOS_ENABLE_SERIAL)
      if constexpr (impl::host_thread_safe<InversePolicy>::value)
        d.decomposes_off_thread = std::is_same<Exec, Kokkos::Serial>::value &&
                                  std::is_same<Kokkos::DefaultHostExecutionSpace, Kokkos::Serial>::value &&
                                  impl::use_lapack_v<Exec, typename InversePolicy::backend_type>;
#endif
      d.split_passes = impl::split_passes_of<InversePolicy>::value;  // Diagonal: element-wise, not divided
    }
    d.split_rows = ng;
    // Per observation row, forming it (a + g values written and read) and one syrk per factor,
    // n (n + 1) flops (diagonal factors: 2 n); preconditioning as the inversion policy states
    // it (diagonal factors: element-wise, not modelled).
    const double da = double(na), dg = double(ng);
    d.plan.statistics_per_row.gemm_flops = diagonal ? 2.0 * (da + dg) : da * (da + 1) + dg * (dg + 1);
    d.plan.statistics_per_row.stream_bytes = 2.0 * double(sizeof(C)) * (da + dg);
    d.plan.statistics_per_row.scalar = sizeof(C);
    if constexpr (!diagonal) d.plan.apply = inversion.apply_work(ng, na);
    d.plan.apply.scalar = sizeof(D);
    return d;
  }

  const LayerType& layer() const { return layer_; }

  void add_input(const Exec& exec, const tensor_type& x) override {
    const auto e = impl::extents_of(x);
    const ConstRows in_place = rows_in_place(x, layer_.a_rows(e), na_, 0);
    if (in_place.data()) {
      fold(exec, in_place, this->observations().inputs() == 0, na_, a_pending_);  // may throw (allocation): nothing counted yet
    } else {
      RMatrix rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::layer::a_rows"),
                   layer_.a_rows(e), na_);
      layer_.fill_a_rows(exec, x, rows);
      fold(exec, rows, this->observations().inputs() == 0, na_, a_pending_);
    }
    a_trace_ = impl::pending_trace<diagonal>(exec, a_pending_);
    a_norm_ += layer_.a_normalizer(e);
    a_samples_ += e[0];
  }
  void add_output_grad(const Exec& exec, const tensor_type& g, double scale) override {
    const auto e = impl::extents_of(g);
    const ConstRows in_place = rows_in_place(g, layer_.g_rows(e), ng_, scale == 1.0 ? 1 : -1);
    if (in_place.data()) {
      fold(exec, in_place, this->observations().output_grads() == 0, ng_, g_pending_);
    } else {
      RMatrix rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::layer::g_rows"),
                   layer_.g_rows(e), ng_);
      layer_.fill_g_rows(exec, g, scale, rows);
      fold(exec, rows, this->observations().output_grads() == 0, ng_, g_pending_);
    }
    g_trace_ = impl::pending_trace<diagonal>(exec, g_pending_);
    g_norm_ += layer_.g_normalizer(e);
    g_samples_ += e[0];
  }
  /// Scale: the larger new factor's trace. Overflow: either trace above the factor type's range.
  impl::ObservationCheck check_observations() const override {
    impl::ObservationCheck c;
    c.scale = std::max(a_norm_ > 0 ? a_trace_ / a_norm_ : 0.0, g_norm_ > 0 ? g_trace_ / g_norm_ : 0.0);
    const double big = impl::largest_value<F>();
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

  std::vector<impl::Buffer> checkpoint_state() override {
    return {impl::buffer_of(a_), impl::buffer_of(g_)};
  }
  void allocate_state() override {
    allocate_factor_storage();
    this->set_statistics(true);
    pi_ = 0;
  }
  void release_state() override {
    a_ = FMatrix();
    g_ = FMatrix();
    this->set_statistics(false);
  }
  void update_statistics(const Exec& exec, double decay) override {
    allocate_factor_storage();
    accumulate(exec, a_pending_, a_norm_, decay, a_);
    accumulate(exec, g_pending_, g_norm_, decay, g_);
    this->set_statistics(true);
    pi_ = 0;
  }

  /// Frees both factorizations, and the products only a holder computes from them (the
  /// precomputed reciprocal, the apply's intermediate).
  void release_units() override {
    base::release_units();
    reciprocal_ = DMatrix();
    work_ = DMatrix();
  }
  void prepare_decomposition(const Exec& exec) override { pi_ = pi_damping(exec); }
  void finish_decomposition(const Exec& exec, double damping, bool precompute) override {
    if constexpr (!diagonal && InversePolicy::damping_at_apply) {
      if (precompute) {
        if (reciprocal_.extent(0) == 0) reciprocal_ = DMatrix("kfac::layer::reciprocal", na_, ng_);
        InversePolicy::reciprocal(exec, *unit_g_.get(), *unit_a_.get(), damping, reciprocal_);
      } else {
        reciprocal_ = DMatrix();
      }
    } else {
      (void)exec; (void)damping; (void)precompute;
    }
  }
  /// The whole V, or pass `part.pass` of a divided apply: columns [first, last) of the
  /// transposed output V^T (a x g), rows first..last of V.
  void precondition(const Exec& exec, double damping, const impl::ApplyPart& part) override {
    if constexpr (diagonal) {
      auto out = gradient_.v();
      auto x = gradient_.x();
      auto a = a_;
      auto g = g_;
      const D d = D(damping);
      Kokkos::parallel_for(
          "kfac::layer::diagonal_solve",
          impl::ColumnMajorRange<Exec>(exec, {0, 0}, {na_, ng_}),
          KOKKOS_LAMBDA(int j, int i) { out(j, i) = x(j, i) / (D(g(i, 0)) * D(a(j, 0)) + d); });
      (void)part;
    } else {
      ensure_work();
      if (part.whole()) {
        InversePolicy::apply(exec, *unit_g_.get(), *unit_a_.get(), gradient_.x(), damping, reciprocal_, work_, gradient_.v());
      } else if constexpr (impl::split_passes_of<InversePolicy>::value > 0) {
        InversePolicy::apply_rows(exec, *unit_g_.get(), *unit_a_.get(), gradient_.x(), damping, reciprocal_, work_, gradient_.v(),
                                  part.pass, part.first, part.last);
      }
    }
  }
  /// Bytes this process holds, with a = a_dim, g = g_dim: factor_bytes (a^2 + g^2)
  /// sizeof(Factor), (a + g) for Diagonal, 0 before the first factor update;
  /// decomposition_bytes the two factorizations in sizeof(Decomposition), i.e.
  /// (a^2 + a + g^2 + g) for Eigendecomposition and (a^2 + g^2) for explicit inverses, plus g a
  /// for a precomputed reciprocal, 0 for Diagonal; workspace_bytes 2 g a sizeof(Decomposition)
  /// once a gradient was loaded (gradient in, preconditioned gradient out), plus g a for the
  /// intermediate product once this process preconditioned it (gradient workers; not Diagonal),
  /// plus, from the layer's first observation on, the pending Gram matrices of the
  /// observations, (a^2 + g^2) sizeof(Factor) ((a + g) for Diagonal; float for Half factors)
  /// whatever the batch and their number. They are kept between steps, also on steps without a
  /// factor update, so that no step allocates them again.
  MemoryReport memory() const override {
    MemoryReport r{this->name(), this->kind(), 0, 0, 0};
    r.factor_bytes = (a_.size() + g_.size()) * sizeof(F);
    for (const auto* unit : {&unit_a_, &unit_g_})
      if (unit->get()) r.decomposition_bytes += unit->get()->bytes();
    r.decomposition_bytes += reciprocal_.size() * sizeof(D);
    r.workspace_bytes = gradient_.bytes() + work_.size() * sizeof(D);
    r.workspace_bytes += (a_pending_.size() + g_pending_.size()) * sizeof(C);
    return r;
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
    impl::transfer_factor<Exec, C, F>(Exec(), impl::FactorBuffer{impl::buffer_of(f), n, true, true}, p, 0, true);
    return p;
  }
  const Fact* decomposition_a() const { return unit_a_.get(); }
  const InversePolicy& inversion() const { return inversion_; }
  const Fact* decomposition_g() const { return unit_g_.get(); }

 private:
  void allocate_factor_storage() {
    if (a_.extent(0) == 0) {
      a_ = FMatrix("kfac::layer::A", na_, diagonal ? 1 : na_);
      g_ = FMatrix("kfac::layer::G", ng_, diagonal ? 1 : ng_);
    }
  }
  /// Only gradient workers apply, so only they hold the intermediate product.
  void ensure_work() {
    if (work_.extent(0) == 0) work_ = DMatrix("kfac::layer::work", na_, ng_);
  }

  /// π of Martens & Grosse (2015, §6.3) when the inversion policy uses π-damping, else 1.
  /// Both factors are on every rank that decomposes either (they are averaged everywhere).
  double pi_damping(const Exec& exec) const {
    if constexpr (impl::has_pi_damping<InversePolicy>::value && !diagonal) {
      if (!inversion_.pi_damping) return 1.0;
      return impl::pi_from_traces(impl::trace(exec, a_), na_, impl::trace(exec, g_), ng_);
    } else {
      (void)exec;
      return 1.0;
    }
  }

  /// f = decay f + (1 - decay) sum_k rows_k^T rows_k / norm (f = the new value on the first update).
  void accumulate(const Exec& exec, const PMatrix& pending, double norm, double decay, const FMatrix& f) {
    const bool had = this->has_statistics();
    const double new_weight = had ? 1.0 - decay : 1.0;
    impl::fold_factor<diagonal, std::is_same<FactorPolicy, Full>::value>(
        exec, pending, C(new_weight / norm), C(had ? decay : 0.0), f);
  }

  /// The observation itself as its m x n rows, when the layer type says it is (which: 0 input,
  /// 1 output gradient, -1 neither) and it is in the arithmetic type: the syrk then reads the
  /// caller's memory during the observe call, with no copy (the same values, so the same bits).
  /// An empty view otherwise.
  ConstRows rows_in_place(const tensor_type& t, index_t m, index_t n, int which) const {
    if constexpr (std::is_same<Scalar, C>::value && impl::has_rows_in_place<LayerType>::value) {
      const bool same = which == 0 ? layer_.a_rows_are_input() : which == 1 && layer_.g_rows_are_output_grad();
      if (same) return ConstRows(t.data(), m, n);
    } else {
      (void)t; (void)m; (void)n; (void)which;
    }
    return ConstRows();
  }

  /// Folds one observation's rows into its pending Gram matrix, so that only O(n^2) stays
  /// between observe and step, whatever the batch. The rows themselves live only during the
  /// observe call. The Gram matrix is allocated at the layer's first observation and kept for
  /// the layer's lifetime: each step's first observation overwrites it (beta = 0), later ones
  /// add to it (beta = 1), so no step allocates or zeroes n x n memory.
  template <class Rows>
  void fold(const Exec& exec, const Rows& rows, bool first, index_t n, PMatrix& pending) {
    // The host BLAS's syrk, and GEMM (KokkosBlas, cuBLAS) alike, never read C when beta = 0,
    // and only the upper triangle is read afterwards; the portable path is still zeroed once,
    // at allocation, so that no uninitialised value is ever read by a kernel.
#if defined(KFAC_HAVE_LAPACK)
    constexpr bool overwritten = impl::host_accessible_v<Exec> || diagonal;
#else
    constexpr bool overwritten = diagonal;
#endif
    if (pending.extent(0) == 0) {
      if constexpr (overwritten)
        pending = PMatrix(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::layer::pending"), n, diagonal ? 1 : n);
      else
        pending = PMatrix("kfac::layer::pending", n, diagonal ? 1 : n);
    }
    impl::fold_observation<diagonal>(exec, rows, first, pending);
  }

  LayerType layer_;
  InversePolicy inversion_;
  index_t na_, ng_;
  // Sum of R^T R over this step's observations (upper triangle), persistent across steps:
  // (a^2 + g^2) values of C from the first observation on, (a + g) for Diagonal.
  PMatrix a_pending_, g_pending_;
  double a_norm_ = 0, g_norm_ = 0;
  double a_trace_ = 0, g_trace_ = 0;  // traces of the pending Gram matrices (sums of squares of their rows)
  double pi_ = 0;  // pi of the factors being decomposed (prepare_decomposition); 0: not known
  long a_samples_ = 0, g_samples_ = 0;
  FMatrix a_, g_;
  FactorUnit unit_a_{*this, 0}, unit_g_{*this, 1};  // the factorizations of A and G (none for Diagonal)
  // X^T and V^T (gradient_), the intermediate product work_ and reciprocal_ are (a_dim x g_dim)
  // column-major: the memory order of the caller's row-major (g_dim x a_dim) gradient, so that
  // loading and storing it are contiguous copies. Preconditioning X^T with the roles of A and G
  // exchanged yields V^T, because every inversion policy computes f(G) X h(A) with f(G), h(A)
  // symmetric.
  impl::GradientWorkspace<D, Scalar, Exec> gradient_;
  DMatrix reciprocal_, work_;
};

/// The former name (blocks were called layers until 2026-12), kept for code written against it.
template <class LayerType, class FactorPolicy, class InversePolicy, class Prec, class Scalar, class Exec>
using KroneckerLayer = KroneckerBlock<LayerType, FactorPolicy, InversePolicy, Prec, Scalar, Exec>;

}  // namespace kfac
