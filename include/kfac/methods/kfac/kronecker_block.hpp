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

#include "kfac/methods/kfac/kronecker_statistics.hpp"

namespace kfac {
namespace impl {

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

/// \brief K-FAC state of one layer whose Fisher block is approximated by \f$G \otimes A\f$, the
/// factors inverted by an inversion policy (Diagonal factors: DiagonalBlock, a closed form).
/// \tparam LayerType Dense or Conv2d: how observations become factor statistics.
/// \tparam FactorPolicy Full or Symmetric.
/// \tparam InversePolicy Eigendecomposition<>, RandomizedEigen<>, Cholesky<> or NewtonSchulz.
/// \tparam Prec Precision<Factor, Decomposition>.
/// \tparam Scalar the host framework's type of observations and gradients.
/// \tparam Exec the Kokkos execution space.
template <class LayerType, class FactorPolicy, class InversePolicy, class Prec, class Scalar,
          class Exec>
class KroneckerBlock final : public impl::KroneckerStatistics<LayerType, FactorPolicy, Prec, Scalar, Exec> {
  static_assert(!FactorPolicy::is_diagonal, "Diagonal factors have their own block, kfac::DiagonalBlock");
  using statistics = impl::KroneckerStatistics<LayerType, FactorPolicy, Prec, Scalar, Exec>;
  using typename statistics::C;
  using typename statistics::D;
  using DMatrix = impl::Matrix<D, Exec>;
  using Fact = typename InversePolicy::template Factorization<D, Exec>;

 public:
  using base = impl::Block<Scalar, Exec>;
  using inversion_type = InversePolicy;
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using typename base::tensor_type;

  KroneckerBlock(std::string name, const LayerType& layer, InversePolicy inversion = InversePolicy{})
      : statistics(std::move(name), layer, describe(layer, inversion)), inversion_(std::move(inversion)) {
    this->use_units({&unit_a_, &unit_g_});
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
      allocate();
      const double shift = attempt > 0 && InversePolicy::damping_at_apply ? damping : 0.0;
      // Explicit inverses add sqrt(damping) to their factor: damping pi^2 for A and
      // damping / pi^2 for G give pi sqrt(damping) and sqrt(damping) / pi (pi = 1: unchanged).
      const double pi = block_.pi_ > 0 ? block_.pi_ : block_.pi_damping(exec);
      if (side_ == 0) fact_->compute(exec, block_.a_, pi == 1.0 ? damping : damping * pi * pi, block_.inversion_, shift);
      else fact_->compute(exec, block_.g_, pi == 1.0 ? damping : damping / (pi * pi), block_.inversion_, shift);
    }
    std::vector<impl::Buffer> buffers() override {
      allocate();
      return fact_->buffers();
    }
    const Fact* get() const { return fact_.get(); }

   private:
    void allocate() {
      if (fact_) return;
      const index_t n = side_ == 0 ? block_.na_ : block_.ng_;
      if constexpr (impl::builds_with_settings<Fact, InversePolicy>::value) fact_ = std::make_unique<Fact>(n, block_.inversion_);
      else fact_ = std::make_unique<Fact>(n);
    }

    KroneckerBlock& block_;
    int side_;
    std::unique_ptr<Fact> fact_;
  };

  /// The block's description: the statistics' (KroneckerStatistics::describe_statistics), unit
  /// 0 A and unit 1 G, the apply's passes and work as the inversion policy states them, and on
  /// a holder the apply's intermediate (g a) and a precomputed reciprocal (g a).
  static impl::BlockDescription describe(const LayerType& layer, const InversePolicy& inversion) {
    const index_t na = layer.a_dim(), ng = layer.g_dim();
    impl::BlockDescription d = statistics::describe_statistics(layer);
    std::string settings;
    if constexpr (impl::has_layer_settings<InversePolicy>::value) settings = inversion.settings(na, ng);
    else settings = inversion.settings();
    d.signature = layer.describe() + "/" + FactorPolicy::name + "/" + InversePolicy::name +
                  (settings.empty() ? "" : "[" + settings + "]") + statistics::precision_signature();
    d.settings = inversion.describe();
    const std::size_t a = std::size_t(na), g = std::size_t(ng);
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
                                impl::vendor_path_v<impl::op::Eigh, Exec, D, typename InversePolicy::backend_type> &&
                                impl::vendor_path_v<impl::op::SpdInverse, Exec, D, typename InversePolicy::backend_type>;
#endif
    d.split_passes = impl::split_passes_of<InversePolicy>::value;
    d.plan.apply = inversion.apply_work(ng, na);
    d.plan.apply.scalar = sizeof(D);
    return d;
  }

  void allocate_state() override {
    statistics::allocate_state();
    pi_ = 0;
  }
  void update_statistics(const Exec& exec, double decay) override {
    statistics::update_statistics(exec, decay);
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
    if constexpr (InversePolicy::damping_at_apply) {
      if (precompute) {
        if (reciprocal_.extent(0) == 0) reciprocal_ = DMatrix("kfac::layer::reciprocal", this->na_, this->ng_);
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
    ensure_work();
    const auto& w = this->gradient_;
    if (part.whole()) {
      InversePolicy::apply(exec, *unit_g_.get(), *unit_a_.get(), w.x(), damping, reciprocal_, work_, w.v());
    } else if constexpr (impl::split_passes_of<InversePolicy>::value > 0) {
      InversePolicy::apply_rows(exec, *unit_g_.get(), *unit_a_.get(), w.x(), damping, reciprocal_, work_, w.v(), part.pass,
                                part.first, part.last);
    }
  }
  /// Bytes this process holds, with a = a_dim, g = g_dim: factor_bytes (a^2 + g^2)
  /// sizeof(Factor), 0 before the first factor update; decomposition_bytes the two
  /// factorizations in sizeof(Decomposition), i.e. (a^2 + a + g^2 + g) for Eigendecomposition
  /// and (a^2 + g^2) for explicit inverses, plus g a for a precomputed reciprocal;
  /// workspace_bytes 2 g a sizeof(Decomposition) once a gradient was loaded (gradient in,
  /// preconditioned gradient out), plus g a for the intermediate product once this process
  /// preconditioned it (gradient workers), plus, from the layer's first observation on, the
  /// pending Gram matrices of the observations, (a^2 + g^2) sizeof(Factor) (float for Half
  /// factors) whatever the batch and their number. They are kept between steps, also on steps
  /// without a factor update, so that no step allocates them again.
  MemoryReport memory() const override {
    MemoryReport r = this->statistics_memory();
    for (const auto* unit : {&unit_a_, &unit_g_})
      if (unit->get()) r.decomposition_bytes += unit->get()->bytes();
    r.decomposition_bytes += reciprocal_.size() * sizeof(D);
    r.workspace_bytes += work_.size() * sizeof(D);
    return r;
  }

  const Fact* decomposition_a() const { return unit_a_.get(); }
  const InversePolicy& inversion() const { return inversion_; }
  const Fact* decomposition_g() const { return unit_g_.get(); }

 private:
  /// Only gradient workers apply, so only they hold the intermediate product.
  void ensure_work() {
    if (work_.extent(0) == 0) work_ = DMatrix("kfac::layer::work", this->na_, this->ng_);
  }

  /// π of Martens & Grosse (2015, §6.3) when the inversion policy uses π-damping, else 1.
  /// Both factors are on every rank that decomposes either (they are averaged everywhere).
  double pi_damping(const Exec& exec) const {
    if constexpr (impl::has_pi_damping<InversePolicy>::value) {
      if (!inversion_.pi_damping) return 1.0;
      return impl::pi_from_traces(impl::trace(exec, this->a_), this->na_, impl::trace(exec, this->g_), this->ng_);
    } else {
      (void)exec;
      return 1.0;
    }
  }

  InversePolicy inversion_;
  double pi_ = 0;  // pi of the factors being decomposed (prepare_decomposition); 0: not known
  FactorUnit unit_a_{*this, 0}, unit_g_{*this, 1};  // the factorizations of A and G
  // The intermediate product work_ and reciprocal_ are (a_dim x g_dim) column-major, as X^T
  // and V^T: preconditioning X^T with the roles of A and G exchanged yields V^T, because every
  // inversion policy computes f(G) X h(A) with f(G), h(A) symmetric.
  DMatrix reciprocal_, work_;
};

/// The former name (blocks were called layers until 2026-12), kept for code written against it.
template <class LayerType, class FactorPolicy, class InversePolicy, class Prec, class Scalar, class Exec>
using KroneckerLayer = KroneckerBlock<LayerType, FactorPolicy, InversePolicy, Prec, Scalar, Exec>;

}  // namespace kfac
