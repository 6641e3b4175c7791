#pragma once
/// \file diagonal_fisher_block.hpp
/// \brief The block of a kfac::Parameter: a running diagonal Fisher from the squared gradient,
/// and the damped element-wise solve.

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include "kfac/core/block.hpp"
#include "kfac/core/precision.hpp"
#include "kfac/layers/parameter.hpp"

namespace kfac {

/// \brief The diagonal Fisher of one parameter (kfac::DiagonalFisher), in the manner of kfac-jax's
/// generic fallback block: no structure assumed, one curvature value per parameter entry.
///
/// Statistics: with X the gradient of the reduced loss over N samples (the batch counted by the
/// step's observations), \f$\hat f = N X \odot X\f$ under LossReduction::mean and
/// \f$\hat f = X \odot X / N\f$ under LossReduction::sum, both \f$(\sum_n \nabla\ell_n)^{\odot 2} / N\f$:
/// an estimate of the per-sample Fisher's diagonal \f$\frac1N \sum_n \nabla\ell_n^{\odot 2}\f$, unbiased when the
/// per-sample gradients are independent with zero mean (the true Fisher with sampled targets), as
/// K-FAC's factors are per-sample (G is scaled by N the same way), so that one damping serves both.
/// With the data's labels it also counts N times the squared mean gradient (the batch empirical
/// Fisher). The running \f$f \leftarrow \xi f + (1 - \xi) \hat f\f$ (\f$\hat f\f$ at the first update) is
/// averaged over the replica group. Preconditioning: \f$V = X / (f + \gamma)\f$ element-wise.
/// No units: nothing to decompose or distribute beyond f (rows x cols values).
/// Which reduction a step used is read from its observations' scale (the Preconditioner passes
/// the batch under mean, 1 under sum); observations of batch 1 only read as sum's (1/N).
/// \tparam Prec Precision<Factor, Decomposition> (not kfac::Half factors).
/// \tparam Scalar the host framework's type of gradients.
/// \tparam Exec the Kokkos execution space.
template <class Prec, class Scalar, class Exec>
class DiagonalFisherBlock final : public impl::Block<Scalar, Exec> {
  static_assert(!std::is_same<typename Prec::factor_type, Half>::value,
                "kfac::DiagonalFisher: half-precision statistics (kfac::Half) are not implemented; keep them in float "
                "or double");
  using F = typename Prec::factor_type;
  using D = typename Prec::decomposition_type;
  using memory_space = typename Exec::memory_space;
  using Values = Kokkos::View<F*, memory_space>;

 public:
  using base = impl::Block<Scalar, Exec>;
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using typename base::tensor_type;

  DiagonalFisherBlock(std::string name, const Parameter& layer)
      : base(std::move(name), describe(layer)), n_(std::size_t(layer.rows()) * std::size_t(layer.cols())),
        gradient_(layer.rows(), layer.cols(), false) {
    this->use_gradient(gradient_);
    this->use_observations(impl::ObservationPairs(layer));
  }

  /// The description: a (rows x cols) gradient, no bias; checkpoint and averaged state f (one
  /// flat vector); no units; per update one pass over the gradient (priced as the apply's
  /// stream), the apply one element-wise pass (X, f and V).
  static impl::BlockDescription describe(const Parameter& layer) {
    const std::size_t n = std::size_t(layer.rows()) * std::size_t(layer.cols());
    impl::BlockDescription d;
    d.kind = Parameter::kind;
    d.signature = layer.describe() + "/diagonal_fisher/f" + std::to_string(sizeof(F)) + "d" +
                  std::to_string(sizeof(D)) + "s" + std::to_string(sizeof(Scalar));
    d.rows = layer.rows();
    d.cols = layer.cols();
    d.checkpoint = {{n, sizeof(F)}};
    d.averaged = {{index_t(n), false, false}};
    d.memory.workspace = n * sizeof(F);  // the pending squared gradient
    d.plan.apply.stream_bytes = double(n) * double(2 * sizeof(D) + sizeof(F));
    d.plan.apply.scalar = sizeof(D);
    return d;
  }

  /// Counts the samples (the first extent) and reads the loss reduction from `scale`.
  void add_output_grad(const Exec&, const tensor_type& g, double scale) override {
    const double batch = double(g.extent(0));
    samples_ += batch;
    mean_ = mean_ || (batch > 1 && scale == batch);
  }
  /// A statistics update needs the samples counted: at least one output-gradient observation.
  impl::ObservationCheck check_observations() const override {
    impl::ObservationCheck c;
    if (this->observations().output_grads() == 0)
      c.problem = "no observations were given (a parameter observes its sample count: observe_output_grad with "
                  "any tensor whose first extent is the batch)";
    return c;
  }
  void drop_observations() override {
    samples_ = 0;
    mean_ = false;
  }
  /// \f$\hat f\f$ = c X ⊙ X into the pending values, c = N (mean) or 1 / N (sum); a retry replaces it.
  void observe_gradient(const Exec& exec, const grad_matrix& w, const grad_vector&) override {
    if (pending_.extent(0) == 0) pending_ = Values("kfac::diagonal_fisher::pending", n_);
    const double c = mean_ ? samples_ : 1.0 / samples_;
    auto pending = pending_;
    const Scalar* x = w.data();
    Kokkos::parallel_for(
        "kfac::diagonal_fisher::square", Kokkos::RangePolicy<Exec>(exec, 0, long(n_)),
        KOKKOS_LAMBDA(long k) { pending(k) = F(c * double(x[k]) * double(x[k])); });
  }
  /// \f$f = \xi f + (1 - \xi) \hat f\f$ (\f$\hat f\f$ at the first update).
  void update_statistics(const Exec& exec, double decay) override {
    allocate_storage();
    const bool had = this->has_statistics();
    const double old_w = had ? decay : 0.0, new_w = had ? 1.0 - decay : 1.0;
    auto f = f_;
    auto pending = pending_;
    Kokkos::parallel_for(
        "kfac::diagonal_fisher::update", Kokkos::RangePolicy<Exec>(exec, 0, long(n_)),
        KOKKOS_LAMBDA(long k) { f(k) = F(old_w * double(f(k)) + new_w * double(pending(k))); });
    this->set_statistics(true);
  }

  std::vector<impl::Buffer> checkpoint_state() override { return {impl::buffer_of(f_)}; }
  void allocate_state() override {
    allocate_storage();
    this->set_statistics(true);
  }
  void release_state() override {
    f_ = Values();
    this->set_statistics(false);
  }

  /// \f$V_k = X_k / (f_k + \gamma)\f$: X is the row-major gradient, read as one flat vector.
  void precondition(const Exec& exec, double damping, const impl::ApplyPart&) override {
    const D* x = gradient_.x().data();
    D* v = gradient_.v().data();
    auto f = f_;
    const D d = D(damping);
    Kokkos::parallel_for(
        "kfac::diagonal_fisher::solve", Kokkos::RangePolicy<Exec>(exec, 0, long(n_)),
        KOKKOS_LAMBDA(long k) { v[k] = x[k] / (D(f(k)) + d); });
  }
  /// factor_bytes: f; workspace_bytes: the gradient's X and V, and the pending values once a
  /// gradient was observed.
  MemoryReport memory() const override {
    return {this->name(), this->kind(), f_.size() * sizeof(F), 0, gradient_.bytes() + pending_.size() * sizeof(F)};
  }

  /// The running diagonal f (rows x cols values, row-major; empty before the first update).
  const Values& diagonal() const { return f_; }

 private:
  void allocate_storage() {
    if (f_.extent(0) == 0) f_ = Values("kfac::diagonal_fisher::f", n_);
  }

  std::size_t n_;
  double samples_ = 0;  // N of this step's observations
  bool mean_ = false;   // some observation was scaled by its batch (LossReduction::mean)
  Values pending_, f_;
  impl::GradientWorkspace<D, Scalar, Exec> gradient_;
};

}  // namespace kfac
