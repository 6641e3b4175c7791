#pragma once
/// \file embedding_block.hpp
/// \brief The block of an Embedding: diag(A) from token counts, G from the output gradients,
/// preconditioned by the damped inverse of diag(A) ⊗ G through G's eigendecomposition (one
/// decomposable unit), or in closed form when G is kept diagonal.

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/precision.hpp"
#include "kfac/layers/embedding.hpp"
#include "kfac/methods/kfac/eigendecomposition.hpp"
#include "kfac/methods/kfac/factors.hpp"
#include "kfac/methods/kfac/kronecker_statistics.hpp"

namespace kfac {

/// \brief The running factors of an Embedding and their preconditioning (Eschenhagen et al.
/// 2023's K-FAC-expand with exact one-hot inputs; see kfac::Embedding).
///
/// Statistics: \f$a_v\f$ = the running mean of count_v / (N T), `vocabulary` values (diag(A),
/// never a vocabulary x vocabulary matrix), and G (dim x dim, its upper triangle for Symmetric,
/// its diagonal for Diagonal), each a running average with the factor decay, as K-FAC's factors.
/// Preconditioning, for the (vocabulary x dim) gradient X and \f$G = Q \mathrm{diag}(g) Q^T\f$
/// (eigenvalues clamped at 0): \f$Y = X Q\f$, \f$Y_{vi} \leftarrow Y_{vi} / (a_v g_i + \gamma)\f$,
/// \f$V = Y Q^T\f$, which is \f$(\mathrm{diag}(a) \otimes G + \gamma I)^{-1} \mathrm{vec}(X)\f$ (X row
/// by row), the damping of kfac::Eigendecomposition's \f$(A \otimes G + \gamma I)^{-1}\f$. With a
/// diagonal G: \f$V_{vi} = X_{vi} / (a_v G_{ii} + \gamma)\f$, no unit.
/// The unit (GUnit) is G's eigendecomposition with a copy of diag(A) taken with it: between two
/// decompositions the apply uses A and G of one step, as K-FAC does.
/// Memory: O(vocabulary + dim²) for the statistics and the unit; the apply's intermediate
/// (dim x vocabulary, like the gradient) on a rank that preconditions.
/// \tparam FactorPolicy how G is kept: Symmetric, Full or Diagonal.
/// \tparam Eigen the eigendecomposition policy of G (kfac::Eigendecomposition<Backend>).
/// \tparam Prec Precision<Factor, Decomposition> (not kfac::Half factors).
/// \tparam Scalar the host framework's type of observations and gradients.
/// \tparam Exec the Kokkos execution space.
template <class FactorPolicy, class Eigen, class Prec, class Scalar, class Exec>
class EmbeddingBlock final : public impl::Block<Scalar, Exec> {
  static_assert(!std::is_same<typename Prec::factor_type, Half>::value,
                "kfac::EmbeddingFisher: half-precision factors (kfac::Half) are not implemented for Embedding; store "
                "its factors in float or double");
  static constexpr bool diagonal = FactorPolicy::is_diagonal;
  using F = typename Prec::factor_type;
  using D = typename Prec::decomposition_type;
  using memory_space = typename Exec::memory_space;
  using FMatrix = impl::Matrix<F, Exec>;
  using DMatrix = impl::Matrix<D, Exec>;
  using Rows = Kokkos::View<F**, Kokkos::LayoutRight, memory_space>;
  using Ids = Kokkos::View<int*, memory_space>;
  using Fact = typename Eigen::template Factorization<D, Exec>;

 public:
  using base = impl::Block<Scalar, Exec>;
  using typename base::tensor_type;

  EmbeddingBlock(std::string name, const Embedding& layer, Eigen eigen = Eigen{})
      : base(std::move(name), describe(layer, eigen)), layer_(layer), eigen_(std::move(eigen)), nv_(layer.vocabulary()),
        nd_(layer.dim()), gradient_(layer.vocabulary(), layer.dim(), false) {
    this->use_gradient(gradient_);
    // the output gradient needs the padding tokens of the ids observed before it
    this->use_observations(impl::ObservationPairs(layer, impl::ObservationPairs::Order::input_first));
    if constexpr (!diagonal) this->use_units({&unit_});
  }

  /// \brief Unit 0, "G": the eigendecomposition of diag(A) ⊗ G, that is G's (kfac::Eigendecomposition's
  /// factorization) and diag(A) itself, copied when G is decomposed. The apply reads only the
  /// unit, as every block with units does: the statistics may still be being averaged while it
  /// runs (Kaisa::overlap_communication), and A and G are those of one decomposition step,
  /// as K-FAC's factors are.
  class GUnit final : public impl::UnitState<Exec> {
   public:
    explicit GUnit(EmbeddingBlock& block) : block_(block) {}
    void release() override {
      fact_.reset();
      a_ = Kokkos::View<D*, memory_space>();
    }
    /// A retry (`attempt` > 0) decomposes G + damping I and takes the damping off again, as
    /// K-FAC's eigendecomposition does.
    void decompose(const Exec& exec, double damping, int attempt) override {
      allocate();
      fact_->compute(exec, block_.g_, damping, block_.eigen_, attempt > 0 ? damping : 0.0);
      impl::copy_converted(exec, "kfac::embedding::decomposed_a", block_.a_, a_);
    }
    /// G's eigenvectors and eigenvalues, then diag(A).
    std::vector<impl::Buffer> buffers() override {
      allocate();
      auto b = fact_->buffers();
      b.push_back(impl::buffer_of(a_));
      return b;
    }
    const Fact* get() const { return fact_.get(); }
    /// diag(A) as it was decomposed (empty before).
    const Kokkos::View<D*, memory_space>& a() const { return a_; }
    std::size_t bytes() const { return fact_ ? fact_->bytes() + a_.size() * sizeof(D) : 0; }

   private:
    void allocate() {
      if (fact_) return;
      fact_ = std::make_unique<Fact>(block_.nd_);
      a_ = Kokkos::View<D*, memory_space>("kfac::embedding::decomposed_a", block_.nv_);
    }
    EmbeddingBlock& block_;
    std::unique_ptr<Fact> fact_;
    Kokkos::View<D*, memory_space> a_;
  };

  /// The description: a (vocabulary x dim) weight, no bias; checkpoint and averaged state diag(A)
  /// (vocabulary values) and G (dim x dim, packed for Symmetric; dim values for Diagonal); unit G
  /// (an eigendecomposition of dim x dim, and diag(A)) unless G is diagonal; per token, G's syrk;
  /// the apply's two GEMMs (dim² vocabulary flops each) and, on a holder, their intermediate.
  static impl::BlockDescription describe(const Embedding& layer, const Eigen& eigen) {
    const std::size_t v = std::size_t(layer.vocabulary()), n = std::size_t(layer.dim());
    const double dv = double(v), dn = double(n);
    impl::BlockDescription d;
    d.kind = Embedding::kind;
    const std::string settings = diagonal ? "" : eigen.settings();
    d.signature = layer.describe() + "/" + FactorPolicy::name + "/" +
                  (diagonal ? std::string("closed_form") : std::string(Eigen::name)) +
                  (settings.empty() ? "" : "[" + settings + "]") + "/f" + std::to_string(sizeof(F)) + "d" +
                  std::to_string(sizeof(D)) + "s" + std::to_string(sizeof(Scalar));
    if (!diagonal) d.settings = eigen.describe();
    d.rows = layer.vocabulary();
    d.cols = layer.dim();
    d.checkpoint = {{v, sizeof(F)}, {diagonal ? n : n * n, sizeof(F)}};
    d.averaged = {{layer.vocabulary(), false, false}, {layer.dim(), !diagonal, !diagonal && FactorPolicy::packed}};
    d.memory.workspace = v * sizeof(double) + (diagonal ? n : n * n) * sizeof(F);  // the pending counts and Gram matrix
    if (!diagonal) {
      impl::Unit u{eigen.cost(layer.dim()), {}, "G"};
      u.cost.memory += dv;  // the copy of diag(A)
      u.cost.work.scalar = sizeof(D);
      u.cost.work.stream_bytes = dv * double(sizeof(F) + sizeof(D));
      for (std::size_t c : eigen.counts(layer.dim())) u.shapes.push_back({c, sizeof(D)});
      u.shapes.push_back({v, sizeof(D)});
      d.units.push_back(std::move(u));
      d.memory.holder_workspace = n * v * sizeof(D);
      d.plan.apply.gemm_flops = 4.0 * dn * dn * dv;
    }
    d.plan.apply.scalar = sizeof(D);
    d.plan.statistics_per_row.gemm_flops = diagonal ? 2.0 * dn : dn * (dn + 1);
    d.plan.statistics_per_row.stream_bytes = 2.0 * double(sizeof(F)) * dn;
    d.plan.statistics_per_row.scalar = sizeof(F);
    return d;
  }

  /// Refuses ids that are not valid (kfac::Error naming the layer, nothing changed); else counts
  /// them into the pending diag(A), keeping them until their output gradient when a padding
  /// index must be masked out of G.
  void add_input(const Exec& exec, const tensor_type& x) override {
    const std::string why = layer_.check_ids(exec, x);
    if (!why.empty()) throw Error(this->name(), why);
    if (a_pending_.extent(0) == 0) a_pending_ = Kokkos::View<double*, memory_space>("kfac::embedding::counts", nv_);
    else if (this->observations().inputs() == 0) Kokkos::deep_copy(exec, a_pending_, 0.0);
    Ids ids(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::embedding::ids"), x.extent(0) * x.extent(1));
    layer_.take_ids(exec, x, ids, a_pending_);
    ids_.push_back(layer_.has_padding_index() ? ids : Ids());
    a_norm_ += double(x.extent(0)) * double(x.extent(1));
  }
  /// Folds the rows of G (scale times the output gradient per token, 0 for padding tokens) into
  /// the pending Gram matrix.
  void add_output_grad(const Exec& exec, const tensor_type& g, double scale) override {
    const std::size_t k = this->observations().output_grads();  // its ids' index
    const int rows_n = int(long(g.extent(0)) * impl::tokens_of(impl::extents_of(g), nd_));
    Rows rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::embedding::g_rows"), rows_n, nd_);
    layer_.fill_g_rows(exec, ids_[k], g, scale, rows);
    impl::fold_into_pending<diagonal>(exec, rows, k == 0, nd_, g_pending_);
    ids_[k] = Ids();  // folded: only O(dim²) stays pending
    g_trace_ = impl::pending_trace<diagonal>(exec, g_pending_);
    g_norm_ += double(g.extent(0));
  }
  /// Scale: the larger new factor's trace (A's is at most 1). Overflow: G's above the factor type's range.
  impl::ObservationCheck check_observations() const override {
    impl::ObservationCheck c;
    const double g_new = g_norm_ > 0 ? g_trace_ / g_norm_ : 0.0, big = impl::largest_value<F>();
    c.scale = std::max(a_norm_ > 0 ? 1.0 : 0.0, g_new);
    c.overflow = g_norm_ > 0 && !(g_new <= big);
    const auto& seen = this->observations();
    if (seen.inputs() == 0) c.problem = "no observations were given";
    else if (seen.output_grads() != seen.inputs())
      c.problem = "observed " + std::to_string(seen.inputs()) + " inputs (token ids) but " +
                  std::to_string(seen.output_grads()) + " output gradients";
    else if (c.overflow)
      c.problem = "observations would overflow the factor type (trace of the new G " + std::to_string(g_new) +
                  "; largest value " + std::to_string(big) + ")";
    return c;
  }
  /// The pending counts and Gram matrix are kept (each step's first observation overwrites them).
  void drop_observations() override {
    ids_.clear();
    a_norm_ = g_norm_ = g_trace_ = 0;
  }

  std::vector<impl::Buffer> checkpoint_state() override { return {impl::buffer_of(a_), impl::buffer_of(g_)}; }
  void allocate_state() override {
    allocate_factor_storage();
    this->set_statistics(true);
  }
  void release_state() override {
    a_ = Kokkos::View<F*, memory_space>();
    g_ = FMatrix();
    this->set_statistics(false);
  }
  /// diag(A) = 1 and G = I (InitialFactors::identity).
  void start_statistics_at_identity(const Exec& exec) override {
    allocate_factor_storage();
    Kokkos::deep_copy(exec, a_, F(1));
    impl::fill_identity<diagonal>(exec, g_);
    this->set_statistics(true);
  }
  /// \f$a = \xi a + (1 - \xi)\, \mathrm{count} / (NT)\f$ and \f$G = \xi G + (1 - \xi) \hat G\f$
  /// (the new values at the first update).
  void update_statistics(const Exec& exec, double decay) override {
    allocate_factor_storage();
    const bool had = this->has_statistics();
    const double old_w = had ? decay : 0.0, new_w = had ? 1.0 - decay : 1.0;
    auto a = a_;
    auto counts = a_pending_;
    const double w = new_w / a_norm_;
    Kokkos::parallel_for(
        "kfac::embedding::update_a", Kokkos::RangePolicy<Exec>(exec, 0, nv_),
        KOKKOS_LAMBDA(int v) { a(v) = F(old_w * double(a(v)) + w * counts(v)); });
    impl::fold_factor<diagonal, std::is_same<FactorPolicy, Full>::value>(exec, g_pending_, F(new_w / g_norm_), F(old_w),
                                                                       g_);
    this->set_statistics(true);
  }

  void release_units() override {
    base::release_units();
    work_ = DMatrix();
  }
  /// V = the damped inverse of diag(A) ⊗ G applied to X (see the class description). X and V
  /// are (dim x vocabulary) column-major in the workspace: the caller's gradient, transposed.
  void precondition(const Exec& exec, double damping, const impl::ApplyPart&) override {
    const auto& x = gradient_.x();
    const auto& out = gradient_.v();
    if constexpr (diagonal) {
      Kokkos::deep_copy(exec, out, x);
      impl::scale_eigenbasis_columns(exec, a_, Kokkos::subview(g_, Kokkos::ALL, 0), damping, DMatrix(), out, 0, nv_);
    } else {
      if (work_.extent(0) == 0) work_ = DMatrix("kfac::embedding::work", nd_, nv_);
      const Fact& f = *unit_.get();
      impl::gemm(exec, "T", "N", D(1), f.q, x, D(0), work_);  // (X Q)^T = Q^T X^T
      impl::scale_eigenbasis_columns(exec, unit_.a(), f.lambda, damping, DMatrix(), work_, 0, nv_);
      impl::gemm(exec, "N", "N", D(1), f.q, work_, D(0), out);  // (Y Q^T)^T = Q Y^T
    }
  }
  /// factor_bytes: diag(A) and G; decomposition_bytes: the unit (G's eigenbasis and the
  /// decomposed diag(A)) where decomposed or received; workspace_bytes: the gradient's X and V,
  /// the pending counts and Gram matrix from the first observation on, the apply's intermediate
  /// where it ran, and the ids kept for padding until their output gradient.
  MemoryReport memory() const override {
    MemoryReport r{this->name(), this->kind(), (a_.size() + g_.size()) * sizeof(F), 0, gradient_.bytes()};
    r.decomposition_bytes += unit_.bytes();
    r.workspace_bytes += a_pending_.size() * sizeof(double) + g_pending_.size() * sizeof(F) + work_.size() * sizeof(D);
    for (const auto& ids : ids_) r.workspace_bytes += ids.size() * sizeof(int);
    return r;
  }

  /// diag(A): `vocabulary` values.
  const Kokkos::View<F*, memory_space>& factor_a() const { return a_; }
  /// G: (dim x dim) with the upper triangle valid (the whole matrix for Full), or (dim x 1) for Diagonal.
  const FMatrix& factor_g() const { return g_; }
  /// G's eigendecomposition (null before the first decomposition, and for a diagonal G).
  const Fact* decomposition_g() const { return unit_.get(); }
  /// diag(A) as G's last decomposition took it (empty before it, and for a diagonal G).
  const Kokkos::View<D*, memory_space>& decomposition_a() const { return unit_.a(); }

 private:
  void allocate_factor_storage() {
    if (a_.extent(0) != 0) return;
    a_ = Kokkos::View<F*, memory_space>("kfac::embedding::A", nv_);
    g_ = FMatrix("kfac::embedding::G", nd_, diagonal ? 1 : nd_);
  }

  Embedding layer_;
  Eigen eigen_;
  index_t nv_, nd_;
  std::vector<Ids> ids_;                          // this step's ids, kept (padding only) until their gradient
  Kokkos::View<double*, memory_space> a_pending_;  // token counts of this step: whole numbers, exact
  impl::Matrix<F, Exec> g_pending_;               // sum of this step's rows R^T R (upper triangle, or diagonal)
  double a_norm_ = 0, g_norm_ = 0, g_trace_ = 0;  // N T and N of this step's observations; G's pending trace
  Kokkos::View<F*, memory_space> a_;
  FMatrix g_;
  GUnit unit_{*this};
  DMatrix work_;  // the apply's intermediate Y^T (dim x vocabulary)
  impl::GradientWorkspace<D, Scalar, Exec> gradient_;
};

}  // namespace kfac
