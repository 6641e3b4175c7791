#pragma once
/// \file preconditioner.hpp
/// \brief The Preconditioner: a registry of per-layer blocks, the step schedule and the public
/// boundary; distribution, checkpoints and the step's phases live in their own files.

#include <algorithm>
#include <cmath>
#include <istream>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "kfac/checkpoint/collective.hpp"
#include "kfac/core/agreement.hpp"
#include "kfac/core/any_layer.hpp"
#include "kfac/core/distribution_contract.hpp"
#include "kfac/core/registry.hpp"
#include "kfac/core/step_phases.hpp"
#include "kfac/core/traits.hpp"
#include "kfac/core/validation.hpp"
#include "kfac/distributed/independent.hpp"
#include "kfac/distributed/kaisa.hpp"
#include "kfac/distributed/serial_comm.hpp"
#include "kfac/methods/default_method.hpp"

namespace kfac {

/// \brief Preconditions the gradients of a set of named layers, each under its own method.
///
/// Per training step the host code (1) observes each layer's input and output gradient on
/// statistics-update steps (wants_observations()), (2) hands over each layer's gradient with
/// set_gradient(), (3) calls step(), which in order: updates the due layers' statistics and
/// averages them over the ranks, recomputes the due decompositions, preconditions every
/// gradient in place and rescales all of them by the KL-clip factor
/// \f$\nu = \min(1, \sqrt{\kappa / (\eta^2 \sum_l \langle V_l, \nabla_l \rangle)})\f$.
/// A layer's updates happen at steps \f$s_0\f$, \f$s_{k+1} = s_k + \mathrm{interval}(s_k)\f$ —
/// for constant intervals k: steps 0, k, 2k, ... (per-layer intervals: the method's overrides).
///
/// \tparam Scalar the type of the host framework's observations and gradients.
/// \tparam Exec a Kokkos execution space; all views must be accessible from it.
/// \tparam Comm a communicator (SerialComm, or MpiComm for distributed runs).
/// \tparam Distribution how work is spread over ranks: Kaisa (default) or Independent.
template <class Scalar = double, class Exec = Kokkos::DefaultExecutionSpace,
          class Comm = SerialComm, class Distribution = Kaisa>
class Preconditioner {
  static_assert(impl::PreconditionerArguments<Scalar, Exec, Comm, Distribution>::ok);  // each checked by name
  using entry_type = impl::Entry<Scalar, Exec>;

 public:
  using scalar_type = Scalar;
  using execution_space = Exec;
  using memory_space = typename Exec::memory_space;
  using block_type = impl::Block<Scalar, Exec>;
  using layer_base = block_type;  ///< the name of block_type in kfac 0.1

  /// \brief `options`: the settings every preconditioner reads (schedules, damping, KL clip, ...);
  /// `policy`: how work is spread over the ranks, with its settings, e.g.
  /// `kfac::Kaisa{}.with_grad_worker_fraction(0.5)` (kfac 0.2 read those from Options).
  explicit Preconditioner(Options options = Options{}, Exec exec = Exec{}, Comm comm = Comm{},
                          Distribution policy = Distribution{})
      : options_(std::move(options)), exec_(std::move(exec)), policy_(std::move(policy)),
        dist_(policy_, std::move(comm)), client_(impl::next_client_of(dist_.comm())) {
    StepValues::at(options_, 0);  // reject bad constants at construction
  }

  /// \brief Registers `layer` under a unique name with a method object, e.g.
  /// `register_layer("fc1", Dense(784, 256), KFAC<Full, Cholesky<>>{}.with_damping(1e-2))`.
  template <class LayerType, class Method>
  void register_layer(const std::string& name, const LayerType& layer, const Method& method) {
    static_assert(is_layer_type_v<LayerType>,
                  "kfac::register_layer: the second argument must be a layer type (kfac::Dense, kfac::Conv2d, "
                  "kfac::BatchNorm2d, kfac::LayerNorm, kfac::Embedding, kfac::Parameter)");
    static_assert(is_method_v<Method>, "kfac::register_layer: the third argument must be a method object (kfac::KFAC<...>, kfac::UnitWiseFisher<...>)");
    static_assert(Method::template accepts<LayerType>, "kfac::register_layer: this method does not handle this layer type");
    register_layer(name, impl::any_layer<Scalar, Exec>(layer, method));
  }
  /// \brief Registers a layer and method whose types a front end chose at run time
  /// (impl::any_layer(layer, method); the PyTorch adapters' kinds), with the same checks.
  void register_layer(const std::string& name, const impl::AnyLayer<Scalar, Exec>& layer) {
    impl::add_layer(reg_, name, layer, options_, step_);
    // The new layer gets statistics and a decomposition at the next step, and so does every
    // layer (the work assignment changes, and ranks must agree on what is due).
    everything_due_at(step_);
    registration_checked_ = false;
  }
  /// \brief Sets the step counter, e.g. to a host's own count after restoring its checkpoint
  /// without kfac's: hyperparameters given as functions of the step read `step` next, and every
  /// layer takes statistics and a decomposition at the next step(), as after register_layer.
  /// Every rank must set the same (step() checks that the ranks agree on the step).
  void set_step_count(long step) {
    if (step < 0) throw Error("", "set_step_count: expected a step >= 0, got " + std::to_string(step));
    step_ = step;
    everything_due_at(step);
  }
  /// \brief The policy-list form: default_method<LayerType> when no policy is given, else
  /// KFAC<FactorPolicy, Inversion, Prec> (Dense, Conv2d) or UnitWiseFisher<FactorPolicy, Prec>.
  template <class LayerType, class FactorPolicy = impl::UnsetPolicy, class Inversion = Eigendecomposition<>,
            class Prec = Precision<Scalar>>
  void register_layer(const std::string& name, const LayerType& layer) {
    static_assert(impl::is_precision<Prec>::value, "kfac: Prec must be a kfac::Precision<...>");
    static_assert(is_inversion_v<Inversion>, "kfac: the inversion policy must be Eigendecomposition<>, RandomizedEigen<>, Cholesky<> or NewtonSchulz");
    register_layer(name, layer, impl::method_for<LayerType, FactorPolicy, Inversion, Prec, Scalar>{});
  }

  /// \brief True on steps that update some layer's statistics (observations are used only then).
  bool wants_observations() const { return reg_.size() == 0 || reg_.any_due(step_, true); }
  /// \brief True when this step updates the statistics of layer `name`.
  bool wants_observations(const std::string& name) const { return factor_due(reg_.at(name)); }
  /// \brief True when this step() will recompute some decomposition.
  bool will_decompose() const { return reg_.any_due(step_, false); }
  long step_count() const { return step_; }
  /// \brief Steps at which some layer's statistics / decompositions were last updated (-1: never).
  long last_factor_step() const { return last_factor_step_; }
  long last_decomposition_step() const { return last_inv_step_; }
  const Options& options() const { return options_; }
  const Exec& execution_space_instance() const { return exec_; }
  const Comm& communicator() const { return dist_.comm(); }
  std::vector<std::string> layer_names() const { return reg_.names(); }

  /// \brief The activations entering a layer: (batch, in) or (batch, tokens, in) for Dense,
  /// (N, C, H, W) for Conv2d, the normalized input xhat for BatchNorm2d. Row-major (LayoutRight)
  /// and contiguous.
  template <class View>
  void observe_input(const std::string& name, const View& x) {
    auto& e = reg_.at(name);
    const auto t = impl::as_tensor<Scalar, Exec>(name, x, "input");
    if (!impl::take_input(exec_, options_, e, t, int(View::rank), factor_due(e))) poisoned_ = true;
  }
  /// \brief The gradient of the loss with respect to the layer's output (pre-activation),
  /// as the host framework computed it for the reduced loss (see Options::loss_reduction).
  template <class View>
  void observe_output_grad(const std::string& name, const View& g) {
    auto& e = reg_.at(name);
    const auto t = impl::as_tensor<Scalar, Exec>(name, g, "output gradient");
    if (!impl::take_output_grad(exec_, options_, e, t, int(View::rank), factor_due(e))) poisoned_ = true;
  }
  /// \brief The gradient to precondition in place at the next step(): the weight gradient
  /// (out, in) or, for Conv2d, (O, C, kh, kw); and the bias gradient (out), or an empty view
  /// for a layer without bias. For BatchNorm2d: (dgamma, dbeta). The views must stay valid
  /// until step() returns, and no two layers' gradients may share memory (tied weights: each
  /// layer preconditions its own in place).
  template <class W, class B = Kokkos::View<Scalar*, memory_space>>
  void set_gradient(const std::string& name, const W& weight, const B& bias = B()) {
    auto& entry = reg_.at(name);
    if constexpr (Kokkos::is_view<W>::value && Kokkos::is_view<B>::value)
      impl::check_gradient_not_shared(reg_, name, weight, bias);
    impl::take_gradient<Scalar, Exec>(entry, weight, bias);
  }

  /// \brief Runs one step; see the class description. On a kfac::Error nothing changed.
  void step() {
    [[maybe_unused]] const auto scope = impl::comm_scope(communicator(), "Preconditioner::step at step ", step_);
    // Everything this rank can find wrong is found before the step's first collective, and
    // agreed on in one allreduce: every rank throws the same error, or skips, together.
    std::vector<impl::Due> due(reg_.size());
    impl::LocalVerdict mine;
    StepValues v{};
    try {
      v = StepValues::at(options_, step_);
      due = impl::due_at(reg_, in_flight_, options_, step_, fresh_);
      const double payload_max = dist_.payload_max(options_);
      mine.poisoned = poisoned_ || (options_.nonfinite == NonFinitePolicy::skip && impl::nonfinite_step(reg_, due, exec_, payload_max));
      impl::validate_step(reg_, due, options_, exec_, step_, mine.poisoned, payload_max);
      impl::check_skip_layers(options_, reg_,
                              {Dense::kind, Conv2d::kind, BatchNorm2d::kind, LayerNorm::kind, Parameter::kind});
      mine.settings = impl::settings_hash(v, due);
    } catch (const Error& e) {
      mine.error = e;
    }
    mine.registration = impl::fnv1a(registration_signature());
    mine.sequence = impl::sequence_hash(step_, due, options_);
    mine.configuration = dist_.agreement_size() > 1 ? impl::fnv1a(configuration_text()) : 0;
    mine.client = client_;
    const auto describe = [&] { return settings_text(v, due); };
    if (impl::agree_on_step(dist_, mine, communicator().rank(), dist_.agreement_size(), describe)) return skip_step();
    if (!registration_checked_) check_registration();
    impl::StepPhases<Scalar, Exec, dist_type> phases(exec_, reg_, dist_, in_flight_, options_, due, step_);
    phases.update_statistics();
    const long retries = phases.decompose();  // on failure: restored, and throws on every rank
    damping_retries_ += retries;
    phases.commit(step_, last_factor_step_, last_inv_step_);
    phases.precondition();
    last_nu_ = phases.clip_and_write_back(v.kl_clip, v.lr);
    for (auto& e : reg_.entries()) e.clear_gradient();
    fresh_ = false;
    ++step_;
  }

  /// \brief Collective: checks that every rank registered the same layers, shapes, methods and
  /// distribution options, and (re)computes the work assignment; layers this rank no longer
  /// holds release their decompositions. Called by the first step() after a registration.
  void check_registration() {
    const std::string sig = registration_signature();
    if (!dist_.check_same(sig))
      throw Error("", "ranks registered different layers, shapes, policies or distribution "
                      "options (rank " + std::to_string(communicator().rank()) + " has: " + sig + ")");
    impl::assign_work(exec_, reg_, dist_, options_);
    registration_checked_ = true;
  }
  /// \brief The distribution policy in use, with its settings.
  const Distribution& distribution() const { return policy_; }
  /// \brief The current work assignment (valid after the first step()).
  const WorkAssignment& assignment() const { return dist_.assignment(); }
  /// \brief Steps skipped because some rank saw NaN/Inf (NonFinitePolicy::skip).
  long skipped_steps() const { return skipped_steps_; }
  /// \brief Decompositions that succeeded only after raising the damping.
  long damping_retries() const { return damping_retries_; }

  /// \brief Writes the whole state (statistics, decompositions unless told not to, schedules,
  /// layer names and signatures) as a versioned, checksummed stream (format: serializer.hpp).
  /// With Kaisa::reduce_to_owner, collective: the owners share the global factors first.
  void save(std::ostream& os, bool with_decompositions = true) const {
    [[maybe_unused]] const auto scope = impl::comm_scope(communicator(), "Preconditioner::save at step ", step_,
                                                             " (collective with reduce_to_owner: every rank calls it)");
    impl::save_state(os, exec_, reg_, dist_, in_flight_, options_, {step_, last_factor_step_, last_inv_step_},
                     with_decompositions);
  }
  /// \brief Restores a state written by save() (format version 2, or 1 from kfac 0.1). Checks
  /// everything first and changes nothing if any check fails. Statistics restore at any world
  /// size; decompositions only when world size and rank match on every rank. Collective: a
  /// checkpoint refused on one rank is refused on all, and so are checkpoints whose replicated
  /// content (step counters, schedules, averaged statistics: impl::replicated_hash) differs
  /// between the ranks of a replica group, e.g. one rank handed another run's file. Returns
  /// true when the decompositions were restored.
  bool load(std::istream& is) {
    [[maybe_unused]] const auto scope = impl::comm_scope(communicator(), "Preconditioner::load (collective)");
    const impl::Loaded got = impl::load_state(is, exec_, reg_, dist_, in_flight_, options_, [&] {
      if (!registration_checked_) check_registration();  // collective, like the rest of load()
    });
    step_ = got.counters.step;
    last_factor_step_ = got.counters.last_factor;
    last_inv_step_ = got.counters.last_inv;
    poisoned_ = false;
    fresh_ = !got.everywhere;  // decompositions restored everywhere: deferred ones resume in flight
    return got.decompositions;
  }

  /// \brief The KL-clip scale applied by the last step().
  double last_kl_scale() const { return last_nu_; }
  /// \brief Memory held per layer (the shadow block of a deferred decomposition in
  /// workspace_bytes).
  std::vector<MemoryReport> memory_report() const { return impl::memory_report(reg_, in_flight_); }
  /// \brief The block of a layer, for inspection. Throws if unknown.
  const block_type& layer(const std::string& name) const { return *reg_.at(name).block; }
  /// \brief Typed access, e.g. `pre.layer_as<KFAC<>::block_type<Dense, double, Host>>("fc1").factor_a()`.
  template <class L>
  const L& layer_as(const std::string& name) const {
    const auto* p = dynamic_cast<const L*>(&layer(name));
    if (!p) throw Error(name, "layer_as: the layer has a different policy combination");
    return *p;
  }
  bool is_skipped(const std::string& name) const { return reg_.at(name).skipped; }

 private:
  using dist_type = typename Distribution::template State<Exec, Comm>;
  static_assert(impl::DistributionContract<dist_type, Exec>::ok);  // each member checked by name

  /// Statistics and a decomposition for every layer at `step` at the latest; decompositions in
  /// flight are dropped, and the next ones run at once.
  void everything_due_at(long step) {
    reg_.everything_due_at(step);
    in_flight_.drop_all();
    fresh_ = true;
  }
  bool factor_due(const entry_type& e) const { return step_ >= e.schedule.next_factor; }
  std::string registration_signature() const { return impl::registration_signature(dist_.signature(options_), reg_); }
  std::string configuration_text() const { return impl::configuration_text(options_, reg_); }
  std::string settings_text(const StepValues& v, const std::vector<impl::Due>& due) const {
    return impl::settings_text(dist_.signature(options_), reg_, step_, v, due) + configuration_text();
  }

  void skip_step() {
    reg_.forget_step();
    poisoned_ = false;
    ++skipped_steps_;
    ++step_;
  }
  Options options_;
  Exec exec_;
  Distribution policy_;
  dist_type dist_;
  impl::Registry<Scalar, Exec> reg_;
  impl::in_flight_for<Scalar, Exec, dist_type> in_flight_;  ///< deferred decompositions; collectives during step()
  long step_ = 0, last_factor_step_ = -1, last_inv_step_ = -1;
  double last_nu_ = 1.0;
  bool poisoned_ = false, registration_checked_ = false;
  bool fresh_ = true;  ///< the next decompositions run at once (Options::decomposition_delay)
  long skipped_steps_ = 0, damping_retries_ = 0;
  long client_ = 0;  ///< this preconditioner's number among its communicator's (agreed every step)
};

}  // namespace kfac
