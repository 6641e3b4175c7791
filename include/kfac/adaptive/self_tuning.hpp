#pragma once
/// \file self_tuning.hpp
/// \brief `kfac::SelfTuning`: the state and protocol of self-tuning K-FAC (Martens & Grosse 2015,
/// sections 6.5 and 7). kfac cannot run the host's network, so the host hands it the products it
/// can compute (its outputs' Jacobian-vector products along the proposal and the previous update,
/// with the loss's curvature kind, or the curvature's quadratic forms themselves); kfac forms the
/// quadratic model, solves the 2x2 system for step size and momentum, rewrites the update in the
/// host's gradient buffers, and adapts the damping by the Levenberg-Marquardt rule. Every scalar
/// is summed over the ranks through the communicator, so \f$\alpha, \mu, \lambda\f$ are the same
/// bits on every rank. Protocol and a worked example: docs/self_tuning.md.

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdint>
#include <istream>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "kfac/adaptive/adaptive.hpp"
#include "kfac/adaptive/impl/quadratic_model.hpp"
#include "kfac/checkpoint/format.hpp"
#include "kfac/core/agreement.hpp"
#include "kfac/core/options.hpp"
#include "kfac/core/traits.hpp"
#include "kfac/distributed/serial_comm.hpp"
#include "kfac/error.hpp"
#include "kfac/impl/ordered_sum.hpp"

namespace kfac {

/// \brief The products a host computes for one solve: its network's outputs and the
/// Jacobian-vector products of the outputs along the two directions kfac names (forward mode,
/// an R-op pass, or finite differences), on this rank's batch.
///
/// `along_proposal` is \f$J P\f$ with P the preconditioned gradient the buffers hold after
/// Preconditioner::step(); `along_previous` is \f$J U_0\f$ with \f$U_0\f$ the previous update
/// (SelfTuning::previous_update()), needed when SelfTuning::needs_previous_product() is true and
/// left empty otherwise. All are (batch, outputs), row-major, in the execution space's memory.
template <class Scalar, class Exec>
struct OutputProducts {
  using view_type = Kokkos::View<const Scalar**, Kokkos::LayoutRight, typename Exec::memory_space>;
  LossCurvature loss = LossCurvature::softmax_cross_entropy;  ///< the loss's curvature at the outputs
  LossReduction reduction = LossReduction::mean;              ///< how the host's loss reduced its batch
  double loss_scale = 1.0;   ///< the per-sample loss is this times the kind's (curvature scales with it)
  view_type outputs;         ///< logits (softmax, sigmoid); may be empty for squared error
  view_type along_proposal;  ///< \f$J P\f$
  view_type along_previous;  ///< \f$J U_0\f$ (empty when not needed)
};

/// \brief The exact curvature's quadratic forms, for a host that forms them itself (e.g. by
/// Gauss-Newton-vector products): \f$P^T F_r P\f$, \f$P^T F_r U_0\f$, \f$U_0^T F_r U_0\f$ of this
/// rank's loss \f$h_r\f$ as the host reduced it over its `batch` samples. NaN marks a form not given.
struct CurvatureForms {
  long batch = 0;                                              ///< this rank's samples
  LossReduction reduction = LossReduction::mean;               ///< how \f$h_r\f$ reduced them
  double proposal = std::numeric_limits<double>::quiet_NaN();  ///< \f$P^T F_r P\f$
  double cross = std::numeric_limits<double>::quiet_NaN();     ///< \f$P^T F_r U_0\f$
  double previous = std::numeric_limits<double>::quiet_NaN();  ///< \f$U_0^T F_r U_0\f$
};

/// \brief Self-tuning K-FAC: step size, momentum and Levenberg-Marquardt damping from the
/// quadratic model with the exact curvature (Martens & Grosse 2015, sections 6.5 and 7).
///
/// Per step the host (1) calls capture_gradient() once its gradient buffers hold the gradient
/// (after any averaging over ranks, before Preconditioner::step() overwrites them), (2) runs
/// Preconditioner::step(), (3) computes the products along the buffers (and along
/// previous_update() when needs_previous_product()) and calls solve(), which rewrites the buffers
/// to the update U; the host then moves its parameters by \f$\theta \leftarrow \theta - U\f$
/// (learning rate 1); (4) when wants_loss_change(), evaluates its loss at the new parameters on
/// the same batch and calls update_damping(). With Adaptive::solve_interval > 1, on a step where
/// wants_products() is false the host skips (1) and (3)'s products and calls apply_last() instead
/// of solve(). The Preconditioner takes its damping from
/// damping(). The whole objective is \f$h = \f$ the mean of the per-sample losses over every rank's
/// batch (LossReduction::mean), or the mean over ranks of each rank's summed loss (sum); the
/// gradient handed in must be that objective's (plus \f$\eta\theta\f$ with weight decay).
///
/// Every public call that throws changes nothing, on any rank: everything is checked and agreed
/// on before anything is written. solve(), update_damping(), save() when asked, and load() are
/// collective over the communicator.
///
/// \tparam Scalar the gradients' and products' type (float or double)
/// \tparam Exec the Kokkos execution space the buffers live in
/// \tparam Comm the communicator (SerialComm, MpiComm)
template <class Scalar = double, class Exec = Kokkos::DefaultExecutionSpace, class Comm = SerialComm>
class SelfTuning {
  static_assert(std::is_floating_point<Scalar>::value, "kfac::SelfTuning<Scalar, ...>: Scalar must be float or double");
  static_assert(Kokkos::is_execution_space<Exec>::value, "kfac::SelfTuning: Exec must be a Kokkos execution space");
  static_assert(is_communicator_v<Comm>,
                "kfac::SelfTuning: Comm must be a communicator (kfac::SerialComm, kfac::MpiComm)");

 public:
  using memory_space = typename Exec::memory_space;
  using flat_type = Kokkos::View<Scalar*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using owned_type = Kokkos::View<Scalar*, memory_space>;
  using products_type = OutputProducts<Scalar, Exec>;

  /// \param settings [in] the settings (validated here)
  /// \param exec [in] the execution space instance kernels run on
  /// \param comm [in] the communicator the scalars are summed over
  explicit SelfTuning(Adaptive settings = Adaptive{}, Exec exec = Exec{}, Comm comm = Comm{})
      : settings_(settings), exec_(exec), comm_(comm), state_(std::make_shared<Shared>()) {
    settings_.validate();
    state_->lambda = settings_.initial_damping;
  }

  /// \brief Registers one of the host's gradient buffers (a weight or a bias of any rank, contiguous):
  /// the update is formed over every registered buffer, in registration order. Before the first
  /// capture_gradient() only; every rank registers the same buffers.
  /// \param name [in] a unique name (errors and checkpoints use it)
  /// \param grad [in] the buffer; it must stay valid while this object uses it
  template <class View>
  void add_parameter(const std::string& name, const View& grad) {
    static_assert(Kokkos::is_view<View>::value, "kfac::SelfTuning::add_parameter: a Kokkos::View");
    static_assert(std::is_same<typename View::non_const_value_type, Scalar>::value,
                  "kfac::SelfTuning::add_parameter: the buffer must have SelfTuning's Scalar type");
    static_assert(!std::is_const<typename View::value_type>::value,
                  "kfac::SelfTuning::add_parameter: the buffer is rewritten in place: not a const view");
    static_assert(Kokkos::SpaceAccessibility<Exec, typename View::memory_space>::accessible,
                  "kfac::SelfTuning::add_parameter: the buffer must be accessible from Exec");
    if (started_) throw Error(name, "SelfTuning::add_parameter after the first capture_gradient()");
    for (const auto& p : params_)
      if (p.name == name) throw Error(name, "SelfTuning::add_parameter: the name is already registered");
    if (!grad.span_is_contiguous() || grad.span() != grad.size())
      throw Error(name, "SelfTuning::add_parameter: the buffer must be contiguous");
    Param p;
    p.name = name;
    p.buffer = flat_type(grad.data(), grad.size());
    p.gradient = owned_type(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::adaptive::gradient"), grad.size());
    p.previous = owned_type("kfac::adaptive::previous", grad.size());
    params_.push_back(std::move(p));
  }

  /// \brief The preconditioner's damping, \f$\lambda + \eta\f$ at every step, read from this
  /// object's state: pass it to Options::with_damping (one home for \f$\lambda\f$). It stays valid
  /// after this object is gone (it shares the state).
  Hyperparameter<double> damping() const {
    auto s = state_;
    const double eta = settings_.weight_decay;
    return Hyperparameter<double>(std::function<double(long)>([s, eta](long) { return s->lambda + eta; }));
  }
  /// \brief \f$\lambda\f$ now.
  double lambda() const { return state_->lambda; }
  /// \brief The settings.
  const Adaptive& settings() const { return settings_; }
  /// \brief Completed solves.
  long solves() const { return solves_; }
  /// \brief Updates formed so far: solves and apply_last() calls.
  long steps() const { return steps_; }
  /// \brief Completed damping updates.
  long damping_updates() const { return updates_; }
  /// \brief The last solve's result (all zero before the first).
  const AdaptiveStep& last_step() const { return last_; }
  /// \brief The last damping update's result (all zero before the first).
  const DampingUpdate& last_damping_update() const { return last_update_; }

  /// \brief Copies every registered buffer as the gradient of this step. Call it after the
  /// gradients are final (averaged over ranks) and before Preconditioner::step().
  void capture_gradient() {
    if (params_.empty()) throw Error("", "SelfTuning::capture_gradient: no parameter was registered (add_parameter)");
    for (auto& p : params_) Kokkos::deep_copy(exec_, p.gradient, p.buffer);
    started_ = true;
    captured_ = true;
  }

  /// \brief True when this step's update needs the host's products and solve(): at each of the
  /// first Adaptive::solve_warmup steps, then at every Adaptive::solve_interval-th step (so always
  /// with the default interval 1). When false the host may skip capture_gradient() and its
  /// products and call apply_last() (solve() is accepted too).
  bool wants_products() const { return solves_ < settings_.solve_warmup || steps_ % settings_.solve_interval == 0; }
  /// \brief The \f$\alpha, \mu\f$ apply_last() uses: the means of the solves' values after the
  /// first, each solve's weight falling by kReuseDecay per later solve (0 before the second solve).
  std::pair<double, double> reused_step() const {
    if (!(reuse_weight_ > 0)) return {0.0, 0.0};
    return {reuse_alpha_ / reuse_weight_, reuse_mu_ / reuse_weight_};
  }

  /// \brief Collective (one small agreement, no products). On a step where wants_products() is
  /// false: rewrites each registered buffer to \f$U = \bar\alpha P + \bar\mu U_0\f$ with
  /// reused_step()'s means of the past solves (one batch's \f$\alpha, \mu\f$ are noisy: reused
  /// alone they made the demo diverge), kept as the next \f$U_0\f$; the host then moves its
  /// parameters by \f$\theta \leftarrow \theta - U\f$. No damping update follows it (the model
  /// was not solved at this step).
  /// \return the last solve's result with the \f$\alpha, \mu\f$ that were applied
  AdaptiveStep apply_last() {
    std::optional<Error> mine;
    try {
      if (params_.empty()) throw Error("", "SelfTuning::apply_last: no parameter was registered (add_parameter)");
      if (solves_ < 2)
        throw Error("", "SelfTuning::apply_last: " + std::to_string(solves_) +
                            " solves so far; the reused step size is the mean of the solves after the first");
      if (wants_products())
        throw Error("", "SelfTuning::apply_last: this step's solve is due (wants_products(): step " +
                            std::to_string(steps_) + ", Adaptive::solve_interval = " +
                            std::to_string(settings_.solve_interval) + "): call solve()");
    } catch (const Error& e) {
      mine = e;
    }
    agree(mine, Call::apply_last);
    AdaptiveStep applied = last_;
    std::tie(applied.alpha, applied.mu) = reused_step();
    for (auto& p : params_) impl::adaptive_update(exec_, p.buffer, p.previous, applied.alpha, applied.mu);
    exec_.fence();
    pending_ = false;
    captured_ = false;
    ++steps_;
    return applied;
  }

  /// \brief True when the next solve() needs OutputProducts::along_previous (or
  /// CurvatureForms::cross and CurvatureForms::previous): momentum is on and a previous update exists.
  bool needs_previous_product() const { return settings_.use_momentum && has_previous_; }
  /// \brief The previous update \f$U_0\f$ of a registered buffer, flat (the host's JVP direction).
  /// \param name [in] the name given to add_parameter
  Kokkos::View<const Scalar*, memory_space> previous_update(const std::string& name) const {
    return param(name).previous;
  }
  /// \brief True when the last solve() is due for a damping update: the host then evaluates its
  /// loss at the new parameters on the same batch and calls update_damping(). Due after solves
  /// \f$T_1, 2T_1, \dots\f$ (counted from 1) when Adaptive::adapt_damping is on.
  bool wants_loss_change() const {
    return settings_.adapt_damping && pending_ && solves_ % settings_.update_interval == 0;
  }

  /// \brief Collective. Forms the quadratic model from the host's products, solves for
  /// \f$\alpha, \mu\f$, rewrites each registered buffer to \f$U = \alpha P + \mu U_0\f$ (kept as
  /// the next \f$U_0\f$) and records the model's change for update_damping().
  /// \param products [in] this rank's outputs and Jacobian-vector products
  AdaptiveStep solve(const products_type& products) {
    return solve_from([&](bool two, double local[3]) {
      check_products(products, two);
      const auto& a = products.along_proposal;
      const auto& b = two ? products.along_previous : products.along_proposal;
      const double scale = products.loss_scale;
      local[0] = scale * impl::curvature_form(exec_, products.loss, products.outputs, a, a);
      if (two) {
        local[1] = scale * impl::curvature_form(exec_, products.loss, products.outputs, a, b);
        local[2] = scale * impl::curvature_form(exec_, products.loss, products.outputs, b, b);
      }
      return products.reduction == LossReduction::mean ? double(a.extent(0)) : 1.0;
    });
  }

  /// \brief Collective. As solve(const products_type&), from the curvature's quadratic forms the
  /// host formed itself.
  /// \param forms [in] this rank's forms
  AdaptiveStep solve(const CurvatureForms& forms) {
    return solve_from([&](bool two, double local[3]) {
      if (forms.batch < 1)
        throw Error("", "CurvatureForms::batch = " + std::to_string(forms.batch) +
                            ": expected the samples of this rank's loss, >= 1");
      if (std::isnan(forms.proposal)) throw Error("", "CurvatureForms::proposal is missing (NaN)");
      if (two && std::isnan(forms.cross))
        throw Error("", "CurvatureForms::cross is missing (NaN): momentum is on and a previous update exists");
      if (two && std::isnan(forms.previous))
        throw Error("", "CurvatureForms::previous is missing (NaN): momentum is on and a previous update exists");
      const double f[3] = {forms.proposal, two ? forms.cross : 0.0, two ? forms.previous : 0.0};
      const char* names[3] = {"proposal", "cross", "previous"};
      for (int k = 0; k < 3; ++k)
        if (!std::isfinite(f[k])) throw Error("", std::string("CurvatureForms::") + names[k] + " is not finite");
      if (f[0] < 0 || f[2] < 0 || f[1] * f[1] > f[0] * f[2] * (1 + 1e-12))
        throw Error("", "CurvatureForms: a negative curvature product (proposal = " + show(f[0]) +
                            ", cross = " + show(f[1]) + ", previous = " + show(f[2]) +
                            "): the exact curvature is positive semi-definite");
      const double weight = forms.reduction == LossReduction::mean ? double(forms.batch) : 1.0;
      for (int k = 0; k < 3; ++k) local[k] = weight * f[k];
      return weight;
    });
  }

  /// \brief Collective. Applies the Levenberg-Marquardt rule to the last solve: \f$\rho\f$ = the
  /// loss change over the model's change (Adaptive::lower_threshold, upper_threshold), then
  /// \f$\lambda\f$ clipped to the bounds. Only when wants_loss_change(). A non-finite
  /// `loss_after` (the step blew up) raises \f$\lambda\f$.
  /// \param loss_before [in] this rank's loss before the step, on its batch, reduced as its products were
  /// \param loss_after [in] the same loss at the new parameters, on the same batch
  DampingUpdate update_damping(double loss_before, double loss_after) {
    std::optional<Error> mine;
    try {
      if (!wants_loss_change())
        throw Error("", "SelfTuning::update_damping: no damping update is due (wants_loss_change() is false: " +
                            std::string(!settings_.adapt_damping ? "Adaptive::adapt_damping is off"
                                        : !pending_              ? "no solve() since the last update"
                                                    : "the last solve is not one of every update_interval") +
                            ")");
      if (!std::isfinite(loss_before)) throw Error("", "SelfTuning::update_damping: loss_before is not finite");
    } catch (const Error& e) {
      mine = e;
    }
    agree(mine, Call::update_damping);
    double s[3] = {pending_weight_ * loss_before, pending_weight_ * loss_after, pending_weight_};
    comm_.sum(s, 3, sizeof(double), CommPrecision::native);
    DampingUpdate u;
    u.loss_change = (s[1] - s[0]) / s[2];
    u.damping_before = state_->lambda;
    u.rho = last_.predicted < 0 ? u.loss_change / last_.predicted : std::numeric_limits<double>::quiet_NaN();
    u.damping = last_.predicted < 0 ? impl::levenberg_marquardt(state_->lambda, u.rho, settings_) : state_->lambda;
    state_->lambda = u.damping;
    pending_ = false;
    ++updates_;
    last_update_ = u;
    return u;
  }

  /// \brief Writes the adaptive state (\f$\lambda\f$, counters, the pending model change, each
  /// buffer's previous update) as a checksummed stream in kfac's checkpoint envelope. Not
  /// collective; each rank writes its own (they are the same on every rank).
  /// \param os [in] the stream
  void save(std::ostream& os) const {
    impl::ByteWriter w;
    w.put_string(kTag);
    w.put_string(settings_.describe());
    w.put(std::uint32_t(sizeof(Scalar)));
    w.put(state_->lambda);
    w.put(solves_);
    w.put(steps_);
    w.put(updates_);
    for (double x : {reuse_alpha_, reuse_mu_, reuse_weight_}) w.put(x);
    w.put(std::uint8_t(has_previous_));
    w.put(std::uint8_t(pending_));
    w.put(pending_weight_);
    // Field by field: the structs' padding bytes are not part of the state (ranks compare the bytes).
    for (const double x :
         {last_.alpha, last_.mu, last_.linear_term, last_.curvature_term, last_.damping_term, last_.predicted,
          last_.damping, last_update_.rho, last_update_.loss_change, last_update_.damping_before, last_update_.damping})
      w.put(x);
    w.put(std::uint8_t(last_.momentum));
    w.put(std::uint32_t(params_.size()));
    for (const auto& p : params_) {
      w.put_string(p.name);
      w.put(std::uint64_t(p.previous.size()));
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), p.previous);
      w.put_raw(h.data(), h.size() * sizeof(Scalar));
    }
    impl::write_checkpoint(os, w.bytes());
  }

  /// \brief Collective. Restores a state written by save() into the same registration and
  /// settings; checks everything first and changes nothing when any check fails on any rank,
  /// or when the ranks loaded different states.
  /// \param is [in] the stream
  void load(std::istream& is) {
    std::optional<Error> mine;
    Loaded l;
    std::string content;
    try {
      std::uint32_t version = 0;
      const auto body = impl::read_checkpoint(is, version);
      content.assign(body.data(), body.size());
      impl::ByteReader r(body.data(), body.size());
      const std::string tag = r.get_string("tag");
      if (tag == "kfac::SelfTuning v1")
        throw Error("", "SelfTuning::load: a kfac 0.3.0 checkpoint (kfac::SelfTuning v1), without the step count "
                        "Adaptive::solve_interval needs: not loadable; start the tuning afresh");
      if (tag != kTag) throw Error("", "not a kfac::SelfTuning checkpoint");
      const std::string settings = r.get_string("settings");
      if (settings != settings_.describe())
        throw Error("", "SelfTuning::load: the checkpoint's settings differ from this object's (checkpoint:\n" +
                            settings + "this object:\n" + settings_.describe() + ")");
      if (r.get<std::uint32_t>("scalar size") != sizeof(Scalar))
        throw Error("", "SelfTuning::load: the checkpoint holds another Scalar type");
      l.lambda = r.get<double>("damping");
      l.solves = r.get<long>("solves");
      l.steps = r.get<long>("steps");
      l.updates = r.get<long>("damping updates");
      for (double* x : {&l.reuse_alpha, &l.reuse_mu, &l.reuse_weight}) *x = r.get<double>("reused step");
      l.has_previous = r.get<std::uint8_t>("previous flag") != 0;
      l.pending = r.get<std::uint8_t>("pending flag") != 0;
      l.pending_weight = r.get<double>("pending weight");
      for (double* x : {&l.last.alpha, &l.last.mu, &l.last.linear_term, &l.last.curvature_term, &l.last.damping_term,
                        &l.last.predicted, &l.last.damping, &l.last_update.rho, &l.last_update.loss_change,
                        &l.last_update.damping_before, &l.last_update.damping})
        *x = r.get<double>("last step");
      l.last.momentum = r.get<std::uint8_t>("last step") != 0;
      if (!l.in_range(settings_))
        throw Error("", "SelfTuning::load: the checkpoint's damping or counters are out of range (corrupt)");
      const auto count = r.get<std::uint32_t>("parameter count");
      if (count != params_.size())
        throw Error("", "SelfTuning::load: the checkpoint holds " + std::to_string(count) +
                            " parameters, this object " + std::to_string(params_.size()));
      for (const auto& p : params_) {
        const std::string name = r.get_string("parameter name");
        if (name != p.name) throw Error(p.name, "SelfTuning::load: the checkpoint has '" + name + "' in its place");
        const auto n = r.get<std::uint64_t>("parameter size");
        if (n != p.previous.size())
          throw Error(p.name, "SelfTuning::load: " + std::to_string(n) + " values in the checkpoint, " +
                                  std::to_string(p.previous.size()) + " registered");
        const char* raw = r.get_raw(n * sizeof(Scalar), "previous update");
        if (!impl::all_finite(raw, n, sizeof(Scalar)))
          throw Error(p.name, "SelfTuning::load: the checkpoint's previous update is not finite");
        l.previous.emplace_back(raw, n * sizeof(Scalar));
      }
      if (!r.done()) throw Error("", "SelfTuning::load: trailing bytes after the state (corrupt)");
    } catch (const Error& e) {
      mine = e;
    }
    agree(mine, Call::load);
    if (!comm_.all_equal(content))
      throw Error("", "SelfTuning::load: the ranks loaded different states; nothing was loaded");
    for (std::size_t k = 0; k < params_.size(); ++k) {
      Kokkos::View<const Scalar*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(
          reinterpret_cast<const Scalar*>(l.previous[k].data()), params_[k].previous.size());
      auto mirror = Kokkos::create_mirror_view(params_[k].previous);
      Kokkos::deep_copy(mirror, h);
      Kokkos::deep_copy(params_[k].previous, mirror);
    }
    state_->lambda = l.lambda;
    solves_ = l.solves;
    steps_ = l.steps;
    updates_ = l.updates;
    reuse_alpha_ = l.reuse_alpha;
    reuse_mu_ = l.reuse_mu;
    reuse_weight_ = l.reuse_weight;
    has_previous_ = l.has_previous;
    pending_ = l.pending;
    pending_weight_ = l.pending_weight;
    last_ = l.last;
    last_update_ = l.last_update;
    captured_ = false;
  }

 private:
  static constexpr const char* kTag = "kfac::SelfTuning v2";  // v2: the step count and the reused means
  static constexpr double kReuseDecay = 0.9;  ///< reused_step(): a solve's weight per later solve
  /// Which collective call an agreement belongs to: ranks in different calls refuse together.
  enum class Call : long { load = 0, solve = 1, update_damping = 2, apply_last = 3 };
  static const char* call_name(Call c) {
    return c == Call::solve ? "solve()" : c == Call::update_damping ? "update_damping()"
                                        : c == Call::apply_last     ? "apply_last()"
                                                                    : "load()";
  }
  struct Shared {
    double lambda = 0;
  };
  struct Param {
    std::string name;
    flat_type buffer;
    owned_type gradient, previous;
  };
  struct Loaded {
    double lambda = 0, pending_weight = 0, reuse_alpha = 0, reuse_mu = 0, reuse_weight = 0;
    bool in_range(const Adaptive& a) const {
      return lambda >= a.min_damping && lambda <= a.max_damping && solves >= 0 && steps >= solves && updates >= 0 &&
             std::isfinite(reuse_alpha) && std::isfinite(reuse_mu) && reuse_weight >= 0 && std::isfinite(reuse_weight);
    }
    long solves = 0, steps = 0, updates = 0;
    bool has_previous = false, pending = false;
    AdaptiveStep last;
    DampingUpdate last_update;
    std::vector<std::string> previous;
  };

  static std::string show(double v) {
    std::ostringstream os;
    os.precision(17);
    os << v;
    return os.str();
  }
  const Param& param(const std::string& name) const {
    for (const auto& p : params_)
      if (p.name == name) return p;
    throw Error(name, "SelfTuning: no parameter of this name was registered");
  }
  void check_ready() const {
    if (params_.empty()) throw Error("", "SelfTuning::solve: no parameter was registered (add_parameter)");
    if (!captured_)
      throw Error("",
                  "SelfTuning::solve: no gradient was captured for this step (capture_gradient() before "
                  "Preconditioner::step())");
  }
  void check_products(const products_type& p, bool two) const {
    const auto& a = p.along_proposal;
    if (a.data() == nullptr || a.extent(0) == 0) throw Error("", "OutputProducts::along_proposal is missing");
    const std::string shape = "(" + std::to_string(a.extent(0)) + ", " + std::to_string(a.extent(1)) + ")";
    const auto same = [&](const typename products_type::view_type& v, const char* name) {
      if (v.extent(0) != a.extent(0) || v.extent(1) != a.extent(1))
        throw Error("", std::string("OutputProducts::") + name + " is (" + std::to_string(v.extent(0)) + ", " +
                            std::to_string(v.extent(1)) + "), along_proposal " + shape + ": expected the same shape");
    };
    if (two) {
      if (p.along_previous.data() == nullptr)
        throw Error("",
                    "OutputProducts::along_previous is missing: momentum is on and a previous update exists "
                    "(needs_previous_product())");
      same(p.along_previous, "along_previous");
    }
    if (p.loss != LossCurvature::squared_error) {
      if (p.outputs.data() == nullptr)
        throw Error("", std::string("OutputProducts::outputs is missing: ") + to_string(p.loss) + " needs the logits");
      same(p.outputs, "outputs");
    }
    if (!(p.loss_scale > 0) || !std::isfinite(p.loss_scale))
      throw Error("", "OutputProducts::loss_scale = " + show(p.loss_scale) + ": expected a finite value > 0");
    const auto finite = [&](const typename products_type::view_type& v, const char* name) {
      const long bad = impl::count_nonfinite(exec_, v);
      if (bad > 0)
        throw Error("", std::string("OutputProducts::") + name + " has " + std::to_string(bad) + " non-finite values");
    };
    finite(a, "along_proposal");
    if (two) finite(p.along_previous, "along_previous");
    if (p.loss != LossCurvature::squared_error) finite(p.outputs, "outputs");
  }
  /// One collective: the lowest rank with an error tells every rank, which all throw it; the
  /// ranks' counters and the call they are in (`call`: a rank in apply_last() while another is
  /// in solve() must not go on to unmatched sums) must agree. Throws on every rank alike.
  void agree(const std::optional<Error>& mine, Call call) {
    const int world = comm_.size(), rank = comm_.rank();
    const bool loading = call == Call::load;
    long v[7] = {mine ? long(world - rank) : 0L, 0, 0, 0, 0, 0, 0};
    impl::put_same_pair(v + 1, loading ? 0L : solves_);
    impl::put_same_pair(v + 3, loading ? 0L : long(has_previous_) + 2 * long(pending_));
    impl::put_same_pair(v + 5, loading ? 0L : 4 * steps_ + long(call));
    if (world > 1) comm_.allreduce_max(v, 7);
    if (v[0] > 0) {
      const int root = world - int(v[0]);
      if (world == 1) throw *mine;
      const std::string layer = comm_.broadcast_string(mine && rank == root ? mine->layer() : "", root);
      const std::string what = comm_.broadcast_string(mine && rank == root ? impl::bare_message(*mine) : "", root);
      throw Error(layer, what + " (on rank " + std::to_string(root) + "; nothing changed on any rank)");
    }
    if (!impl::same_on_every_rank(v + 1) || !impl::same_on_every_rank(v + 3) || !impl::same_on_every_rank(v + 5))
      throw Error("", "SelfTuning: the ranks are at different steps or calls (rank " + std::to_string(rank) +
                          " has made " + std::to_string(solves_) + " solves in " + std::to_string(steps_) +
                          " steps and is in " + call_name(call) + "); nothing changed on any rank");
  }
  /// This rank's checks and curvature sums (`forms(two, local)` fills local[3], returns the
  /// rank's weight, or throws what is wrong), then the collective solve.
  template <class Forms>
  AdaptiveStep solve_from(const Forms& forms) {
    std::optional<Error> mine;
    double local[3] = {0, 0, 0};
    double weight = 0;
    const bool two = needs_previous_product();
    try {
      check_ready();
      weight = forms(two, local);
    } catch (const Error& e) {
      mine = e;
    }
    return solve_with(mine, local, weight, two);
  }
  AdaptiveStep solve_with(const std::optional<Error>& mine, const double local[3], double weight, bool two) {
    impl::QuadraticTerms t;
    t.previous = two;
    double s[9] = {weight, local[0], local[1], local[2], 0, 0, 0, 0, 0};
    if (!mine) {
      for (const auto& p : params_) {
        s[4] += impl::adaptive_dot(exec_, p.buffer, p.buffer);
        s[7] += impl::adaptive_dot(exec_, p.gradient, p.buffer);
        if (two) {
          s[5] += impl::adaptive_dot(exec_, p.buffer, p.previous);
          s[6] += impl::adaptive_dot(exec_, p.previous, p.previous);
          s[8] += impl::adaptive_dot(exec_, p.gradient, p.previous);
        }
      }
    }
    agree(mine, Call::solve);
    comm_.sum(s, 9, sizeof(double), CommPrecision::native);
    const double ranks = double(comm_.size());
    t.fpp = s[1] / s[0];
    t.fpm = s[2] / s[0];
    t.fmm = s[3] / s[0];
    t.dpp = s[4] / ranks;
    t.dpm = s[5] / ranks;
    t.dmm = s[6] / ranks;
    t.gp = s[7] / ranks;
    t.gm = s[8] / ranks;
    const double shift = state_->lambda + settings_.weight_decay;
    const double m11 = t.fpp + shift * t.dpp;
    for (double x : s)
      if (!std::isfinite(x))
        throw Error("",
                    "SelfTuning::solve: the quadratic model is not finite (the gradient, the proposal or the "
                    "previous update holds NaN/Inf); nothing changed on any rank");
    if (!(m11 > 0))
      throw Error("", "SelfTuning::solve: the model's curvature along the proposal (Delta^T C Delta = " + show(m11) +
                          ") is not positive: the proposal is zero; nothing changed on any rank");
    const AdaptiveStep step =
        impl::solve_quadratic_model(t, state_->lambda, settings_.weight_decay, settings_.rho_includes_damping);
    if (!std::isfinite(step.alpha) || !std::isfinite(step.mu) || !std::isfinite(step.predicted))
      throw Error("", "SelfTuning::solve: the model's prediction is not finite (alpha = " + show(step.alpha) +
                          ", mu = " + show(step.mu) + ", M = " + show(step.predicted) +
                          "); nothing changed on any rank");
    for (auto& p : params_) impl::adaptive_update(exec_, p.buffer, p.previous, step.alpha, step.mu);
    exec_.fence();
    last_ = step;
    if (solves_ > 0) {  // the first solve's proposal comes from one batch's factors: not reused
      reuse_alpha_ = kReuseDecay * reuse_alpha_ + step.alpha;
      reuse_mu_ = kReuseDecay * reuse_mu_ + step.mu;
      reuse_weight_ = kReuseDecay * reuse_weight_ + 1.0;
    }
    pending_weight_ = s[0] > 0 ? weight : 0;
    pending_ = true;
    has_previous_ = true;
    captured_ = false;
    ++solves_;
    ++steps_;
    return step;
  }

  Adaptive settings_;
  Exec exec_;
  Comm comm_;
  std::shared_ptr<Shared> state_;  ///< \f$\lambda\f$, shared with the damping() hyperparameter
  std::vector<Param> params_;
  bool started_ = false, captured_ = false, has_previous_ = false, pending_ = false;
  long solves_ = 0, steps_ = 0, updates_ = 0;
  double reuse_alpha_ = 0, reuse_mu_ = 0, reuse_weight_ = 0;  ///< reused_step()'s weighted sums
  double pending_weight_ = 0;  ///< this rank's weight of its loss (its batch, or 1 for summed losses)
  AdaptiveStep last_;
  DampingUpdate last_update_;
};

}  // namespace kfac
