#pragma once
/// \file preconditioner.hpp
/// \brief The K-FAC preconditioner: holds any mix of layers and runs the per-step schedule.

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kfac/batch_norm_layer.hpp"
#include "kfac/checkpoint.hpp"
#include "kfac/assignment.hpp"
#include "kfac/comm/serial_comm.hpp"
#include "kfac/inverse/eigendecomposition.hpp"
#include "kfac/kronecker_layer.hpp"
#include "kfac/layers/batch_norm.hpp"
#include "kfac/layers/conv2d.hpp"
#include "kfac/layers/dense.hpp"
#include "kfac/options.hpp"

namespace kfac {

namespace impl {
template <class LayerType>
struct default_factor {
  using type = Symmetric;
};
template <>
struct default_factor<BatchNorm2d> {
  using type = UnitWise;
};
}  // namespace impl

/// \brief K-FAC preconditioner for a set of named layers.
///
/// Per training step the host code (1) observes each layer's input and output gradient on
/// factor-update steps (wants_observations()), (2) hands over each layer's gradient with
/// set_gradient(), (3) calls step(), which in order: updates the running factors (every
/// factor_update_steps), recomputes decompositions (every inv_update_steps), preconditions every
/// gradient in place and rescales all of them by the KL-clip factor
/// \f$\nu = \min(1, \sqrt{\kappa / (\eta^2 \sum_l \langle V_l, \nabla_l \rangle)})\f$.
///
/// Factor and decomposition updates happen at steps \f$s_0 = 0\f$,
/// \f$s_{k+1} = s_k + \mathrm{interval}(s_k)\f$ — for constant intervals k: steps 0, k, 2k, ...
///
/// \tparam Scalar the type of the host framework's observations and gradients.
/// \tparam Exec a Kokkos execution space; all views must be accessible from it.
/// \tparam Comm a communicator policy (SerialComm, or MpiComm for distributed K-FAC).
template <class Scalar = double, class Exec = Kokkos::DefaultExecutionSpace,
          class Comm = SerialComm>
class Preconditioner {
 public:
  using scalar_type = Scalar;
  using execution_space = Exec;
  using memory_space = typename Exec::memory_space;
  using layer_base = impl::LayerBase<Scalar, Exec>;

  explicit Preconditioner(Options options = Options{}, Exec exec = Exec{}, Comm comm = Comm{})
      : options_(std::move(options)), exec_(std::move(exec)), comm_(std::move(comm)) {
    StepValues::at(options_, 0);  // reject bad constants at construction
  }

  /// \brief Registers a layer under a unique name.
  /// \tparam LayerType Dense, Conv2d or BatchNorm2d.
  /// \tparam FactorPolicy Symmetric (default), Full or Diagonal; UnitWise (default) or Diagonal
  ///         for BatchNorm2d.
  /// \tparam InversePolicy Eigendecomposition<> (default), Cholesky<> or NewtonSchulz.
  /// \tparam Prec Precision<factor, decomposition>; defaults to Scalar for both.
  template <class LayerType, class FactorPolicy = typename impl::default_factor<LayerType>::type,
            class InversePolicy = Eigendecomposition<>, class Prec = Precision<Scalar>>
  void register_layer(const std::string& name, const LayerType& layer) {
    static_assert(impl::is_precision<Prec>::value, "kfac: Prec must be a kfac::Precision<...>");
    if (name.empty()) throw Error("", "register_layer: a layer name must not be empty");
    if (index_.count(name)) throw Error(name, "a layer with this name is already registered");
    std::unique_ptr<layer_base> p;
    if constexpr (LayerType::is_kronecker) {
      static_assert(!std::is_same<FactorPolicy, UnitWise>::value,
                    "kfac: UnitWise is a BatchNorm2d factor policy");
      static_assert(!FactorPolicy::is_diagonal ||
                        std::is_same<InversePolicy, Eigendecomposition<>>::value,
                    "kfac: Diagonal factors are inverted in closed form; leave the inversion "
                    "policy at its default");
      p = std::make_unique<KroneckerLayer<LayerType, FactorPolicy, InversePolicy, Prec, Scalar, Exec>>(
          name, layer);
    } else {
      p = std::make_unique<BatchNormLayer<FactorPolicy, Prec, Scalar, Exec>>(name, layer);
    }
    index_[name] = layers_.size();
    Entry entry;
    entry.layer = std::move(p);
    entry.skipped = skipped(name, LayerType::kind);
    layers_.push_back(std::move(entry));
    registration_checked_ = false;
    // A layer registered after training started gets factors and a decomposition at the next
    // step, so the next step is made a factor-update and decomposition step.
    next_factor_step_ = std::min(next_factor_step_, step_);
    next_inv_step_ = std::min(next_inv_step_, step_);
  }

  /// \brief True on factor-update steps: observations are used only then (and ignored otherwise).
  bool wants_observations() const { return step_ >= next_factor_step_; }
  /// \brief True when this step() will recompute decompositions.
  bool will_decompose() const { return step_ >= next_inv_step_; }
  /// \brief Number of completed step() calls.
  long step_count() const { return step_; }
  /// \brief Steps at which factors / decompositions were last updated (-1 if never).
  long last_factor_step() const { return last_factor_step_; }
  long last_decomposition_step() const { return last_inv_step_; }
  const Options& options() const { return options_; }
  const Exec& execution_space_instance() const { return exec_; }
  const Comm& communicator() const { return comm_; }
  std::vector<std::string> layer_names() const {
    std::vector<std::string> v;
    for (const auto& e : layers_) v.push_back(e.layer->name());
    return v;
  }

  /// \brief The activations entering a layer: (batch, in) for Dense, (N, C, H, W) for Conv2d,
  /// the normalized input xhat for BatchNorm2d. Row-major (LayoutRight) and contiguous.
  template <class View>
  void observe_input(const std::string& name, const View& x) {
    auto& e = entry(name);
    auto t = as_tensor(name, x, "input");
    fail_if(name, e.layer->check_input(impl::extents_of(t)));
    if (t.extent(0) == 0) throw Error(name, "input has an empty batch (batch = 0)");
    if (!wants_observations() || e.skipped) return;
    if (check_finite(name, t, "input")) e.layer->observe_input(exec_, t);
  }

  /// \brief The gradient of the loss with respect to the layer's output (pre-activation),
  /// as the host framework computed it for the reduced loss (see Options::loss_reduction).
  template <class View>
  void observe_output_grad(const std::string& name, const View& g) {
    auto& e = entry(name);
    auto t = as_tensor(name, g, "output gradient");
    if (t.extent(0) == 0) throw Error(name, "output gradient has an empty batch (batch = 0)");
    if (!wants_observations() || e.skipped) return;
    fail_if(name, e.layer->check_output_grad(impl::extents_of(t)));
    if (!check_finite(name, t, "output gradient")) return;
    const double scale =
        options_.loss_reduction == LossReduction::mean ? double(t.extent(0)) : 1.0;
    e.layer->observe_output_grad(exec_, t, scale);
  }

  /// \brief The gradient to precondition in place at the next step(): the weight gradient
  /// (out, in) or, for Conv2d, (O, C, kh, kw); and the bias gradient (out), or an empty view
  /// for a layer without bias. For BatchNorm2d: (dgamma, dbeta). The views must stay valid
  /// until step() returns.
  template <class W, class B = Kokkos::View<Scalar*, memory_space>>
  void set_gradient(const std::string& name, const W& weight, const B& bias = B()) {
    auto& e = entry(name);
    static_assert(std::is_same<typename W::non_const_value_type, Scalar>::value &&
                      std::is_same<typename B::non_const_value_type, Scalar>::value,
                  "kfac::set_gradient: gradients must have the Preconditioner's Scalar type");
    static_assert(Kokkos::SpaceAccessibility<Exec, typename W::memory_space>::accessible,
                  "kfac::set_gradient: gradient not accessible from the execution space");
    static_assert(!std::is_const<typename W::value_type>::value &&
                      !std::is_const<typename B::value_type>::value,
                  "kfac::set_gradient: gradients are preconditioned in place; pass non-const views");
    const index_t rows = e.layer->weight_rows(), cols = e.layer->weight_cols();
    long n = 1;
    for (unsigned r = 0; r < W::rank; ++r) n *= long(weight.extent(r));
    if (long(weight.extent(0)) != rows || n != long(rows) * cols)
      throw Error(name, "weight gradient has shape " + shape_string(weight) + ", expected " +
                            std::to_string(rows) + " x " + std::to_string(cols) + " values");
    if (!weight.span_is_contiguous() || (W::rank > 1 && !std::is_same<typename W::array_layout, Kokkos::LayoutRight>::value))
      throw Error(name, "weight gradient must be a contiguous row-major (LayoutRight) view");
    if (e.layer->has_bias() && (long(bias.extent(0)) != rows || !bias.span_is_contiguous()))
      throw Error(name, "bias gradient has length " + std::to_string(bias.extent(0)) +
                            ", expected a contiguous vector of length " + std::to_string(rows));
    if (!e.layer->has_bias() && bias.extent(0) != 0)
      throw Error(name, "layer has no bias but a bias gradient was given");
    e.w = typename layer_base::grad_matrix(const_cast<Scalar*>(weight.data()), rows, cols);
    e.b = typename layer_base::grad_vector(const_cast<Scalar*>(bias.data()), bias.extent(0));
    e.has_gradient = true;
  }

  /// \brief Runs one K-FAC step; see the class description. On a kfac::Error nothing changed.
  void step() {
    const StepValues v = StepValues::at(options_, step_);
    const bool factor_step = wants_observations(), inv_step = will_decompose();
    if (options_.nonfinite == NonFinitePolicy::skip) {
      for (const auto& e : layers_)
        if (!e.skipped && ((e.has_gradient && (impl::count_nonfinite(exec_, e.w) > 0 ||
                                               impl::count_nonfinite(exec_, e.b) > 0)) ||
                           (factor_step && e.layer->observations_overflow())))
          poisoned_ = true;
      if (comm_.allreduce_max(poisoned_ ? 1L : 0L) > 0) {
        skip_step();
        return;
      }
    }
    // Validate everything before changing anything.
    for (const auto& e : layers_) {
      if (e.skipped) continue;
      const auto& n = e.layer->name();
      if (!e.has_gradient)
        throw Error(n, "no gradient was set for step " + std::to_string(step_) +
                           " (call set_gradient before step)");
      if (options_.nonfinite == NonFinitePolicy::raise) {
        const long bad = impl::count_nonfinite(exec_, e.w) + impl::count_nonfinite(exec_, e.b);
        if (bad > 0)
          throw Error(n, "gradient contains " + std::to_string(bad) +
                             " NaN/Inf value(s) at step " + std::to_string(step_));
      }
      if (factor_step) {
        const std::string why = e.layer->observations_problem();
        if (!why.empty())
          throw Error(n, why + " before the factor update at step " + std::to_string(step_));
      } else if (!e.layer->has_factors()) {
        throw Error(n, "has no factors yet: it must be observed on a factor-update step before "
                       "it can be preconditioned");
      }
    }
    if (!registration_checked_) check_registration();
    if (factor_step) {
      for (auto& e : layers_)
        if (!e.skipped) e.layer->update_factors(exec_, v.factor_decay);
      average_factors();
      last_factor_step_ = step_;
      next_factor_step_ = step_ + v.factor_update_steps;
    }
    decompose(inv_step, v.damping);
    if (inv_step) {
      last_inv_step_ = step_;
      next_inv_step_ = step_ + v.inv_update_steps;
    }
    precondition(v.damping);
    // Every rank holds every V now, so every rank computes the same KL-clip scale.
    double vg = 0;
    for (auto& e : layers_)
      if (!e.skipped) vg += e.layer->inner_product(exec_);
    last_nu_ = 1.0;
    if (v.kl_clip > 0 && vg != 0)
      last_nu_ = std::min(1.0, std::sqrt(v.kl_clip / std::abs(vg * v.lr * v.lr)));
    for (auto& e : layers_)
      if (!e.skipped) e.layer->write_back(exec_, e.w, e.b, last_nu_);
    exec_.fence();
    for (auto& e : layers_) {
      e.has_gradient = false;
      e.w = {};
      e.b = {};
    }
    ++step_;
  }

  /// \brief Collective: checks that every rank registered the same layers, shapes, policies and
  /// distribution options, and (re)computes the work assignment. Called by the first step()
  /// after a registration; throws the same kfac::Error on every rank on a mismatch.
  void check_registration() {
    std::string sig = "f=" + std::to_string(options_.grad_worker_fraction) +
                      ";c=" + std::to_string(int(options_.assignment_cost)) +
                      ";co=" + std::to_string(int(options_.colocate_factors)) +
                      ";p=" + std::to_string(int(options_.comm_precision)) + ";";
    for (const auto& e : layers_)
      sig += e.layer->name() + ":" + e.layer->signature() + (e.skipped ? ":skip" : "") + ";";
    if (!comm_.all_equal(sig))
      throw Error("", "ranks registered different layers, shapes, policies or distribution "
                      "options (rank " + std::to_string(comm_.rank()) + " has: " + sig + ")");
    std::vector<std::pair<double, double>> costs;
    for (const auto& e : layers_) {
      const bool mem = options_.assignment_cost == AssignmentCost::memory;
      if (e.skipped) { costs.push_back({0.0, 0.0}); continue; }
      costs.push_back({mem ? e.layer->decomposition_memory(0) : e.layer->decomposition_flops(0),
                       mem ? e.layer->decomposition_memory(1) : e.layer->decomposition_flops(1)});
    }
    WorkAssignment next(comm_.size(), options_.grad_worker_fraction, costs, options_.colocate_factors);
    if (!groups_made_) {
      comm_.free_groups();
      worker_comm_ = comm_.make_group(next.worker_group_of(comm_.rank()));
      receiver_comm_ = comm_.make_group(next.receiver_group_of(comm_.rank()));
      groups_made_ = true;
    }
    assignment_ = std::move(next);
    registration_checked_ = true;
  }

  /// \brief The current work assignment (valid after the first step()).
  const WorkAssignment& assignment() const { return assignment_; }

  /// \brief Steps skipped because some rank saw NaN/Inf (NonFinitePolicy::skip).
  long skipped_steps() const { return skipped_steps_; }
  /// \brief Decompositions that succeeded only after raising the damping.
  long damping_retries() const { return damping_retries_; }

  /// \brief Writes the whole state (factors, decompositions unless told not to, step counters,
  /// schedule state, layer names and signatures) to a versioned, checksummed binary stream.
  /// Call between steps: observations of a step not yet taken are not saved.
  void save(std::ostream& os, bool with_decompositions = true) const {
    impl::ByteWriter w;
    for (long v : {step_, next_factor_step_, next_inv_step_, last_factor_step_, last_inv_step_})
      w.put(std::int64_t(v));
    w.put(std::int32_t(comm_.size()));
    w.put(std::int32_t(comm_.rank()));
    w.put(std::uint32_t(with_decompositions ? 1 : 0));
    w.put(std::uint32_t(layers_.size()));
    for (const auto& e : layers_) {
      auto& layer = *e.layer;
      w.put_string(layer.name());
      w.put_string(layer.signature());
      w.put(std::uint8_t(layer.has_factors()));
      auto put_buffers = [&](const std::vector<impl::Buffer>& bufs) {
        w.put(std::uint32_t(bufs.size()));
        for (const auto& b : bufs) {
          w.put(std::uint8_t(b.scalar_size));
          w.put(std::uint64_t(b.count));
          const std::string bytes = to_host_bytes(b);
          w.put_raw(bytes.data(), bytes.size());
        }
      };
      std::vector<impl::Buffer> fb;
      if (layer.has_factors())
        for (auto& f : layer.factors()) fb.push_back(f.storage);
      put_buffers(fb);
      const bool dec = with_decompositions && layer.has_decomposition() &&
                       (layer.decomposed_factors() == 0 || !layer.decomposition_buffers(0).empty());
      w.put(std::uint8_t(dec));
      w.put(e.decomposition_damping);
      for (int which = 0; which < 2; ++which)
        put_buffers(dec ? layer.decomposition_buffers(which) : std::vector<impl::Buffer>{});
    }
    impl::write_checkpoint(os, w.bytes());
  }

  /// \brief Restores a state written by save(). Checks version, checksum, layer names, shapes
  /// and policies first and changes nothing if any check fails. Factors are global and restore
  /// at any world size; decompositions are per rank and are restored only when the world size
  /// and rank match on every rank (otherwise they are recomputed at the next step). Collective
  /// with a communicator: every rank calls load(), and a checkpoint refused on one rank is
  /// refused on all. Returns true when the decompositions were restored.
  bool load(std::istream& is) {
    CheckpointPlan cp;
    std::optional<Error> refused;
    try {
      cp = parse_checkpoint(is);
    } catch (const Error& e) {
      refused = e;
    }
    // Decompositions are restored on all ranks or on none: ranks that disagree about which
    // layers still need one would mismatch the broadcasts of the next step. A rank's own
    // checkpoint fits only when it holds every decomposition the current work assignment gives
    // the rank (it may have been saved under another grad_worker_fraction).
    if (!registration_checked_) check_registration();  // collective, like the rest of load()
    bool mine = !refused && cp.world == comm_.size() && cp.rank == comm_.rank();
    for (std::size_t l = 0; mine && l < cp.layers.size(); ++l) {
      const auto& p = cp.layers[l];
      if (!layers_[l].skipped && p.has_factors && !p.has_decomposition &&
          layers_[l].layer->decomposed_factors() > 0 && assignment_.is_grad_worker(l, comm_.rank()))
        mine = false;
    }
    const long verdict = comm_.allreduce_max(refused ? 2L : mine ? 0L : 1L);
    if (refused) throw *refused;
    if (verdict == 2) throw Error("", "another rank refused its checkpoint; nothing was loaded");
    const bool same_layout = verdict == 0;
    const auto& plan = cp.layers;
    const long* counters = cp.counters;
    const std::uint32_t count = std::uint32_t(plan.size());
    // Everything checked: apply.
    bool restored_decompositions = true;
    for (std::uint32_t i = 0; i < count; ++i) {
      auto& e = layers_[i];
      auto& layer = *e.layer;
      const auto& p = plan[i];
      layer.clear_observations();
      e.has_gradient = false;
      if (p.has_factors) {
        layer.allocate_factors();
        auto fs = layer.factors();
        for (std::size_t k = 0; k < fs.size(); ++k) from_host_bytes(fs[k].storage, p.factors[k]);
      } else {
        layer.release_factors();
      }
      e.decomposition_damping = p.damping;
      if (p.has_decomposition && same_layout) {
        if (layer.decomposed_factors() > 0) {
          layer.allocate_decomposition();
          for (int which = 0; which < 2; ++which) {
            auto bufs = layer.decomposition_buffers(which);
            for (std::size_t k = 0; k < bufs.size(); ++k) from_host_bytes(bufs[k], p.dec[which][k]);
          }
        }
        layer.finish_decomposition(exec_, p.damping, options_.precompute_reciprocal);
      } else {
        layer.invalidate_decomposition();
        if (p.has_decomposition) restored_decompositions = false;
      }
    }
    step_ = counters[0];
    next_factor_step_ = counters[1];
    next_inv_step_ = counters[2];
    for (const auto& p : plan)  // a layer saved without factors gets them at the next step
      if (!p.has_factors) next_factor_step_ = next_inv_step_ = step_;
    last_factor_step_ = counters[3];
    last_inv_step_ = counters[4];
    poisoned_ = false;
    exec_.fence();
    return restored_decompositions;
  }

  /// \brief The KL-clip scale applied by the last step().
  double last_kl_scale() const { return last_nu_; }

  /// \brief Memory held per layer.
  std::vector<MemoryReport> memory_report() const {
    std::vector<MemoryReport> r;
    for (const auto& e : layers_) r.push_back(e.layer->memory());
    return r;
  }

  /// \brief The layer object, for inspection (factors, decompositions). Throws if unknown.
  const layer_base& layer(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw Error(name, "no layer with this name is registered");
    return *layers_[it->second].layer;
  }
  /// \brief Typed access, e.g. `pre.layer_as<KroneckerLayer<...>>("fc1").factor_a()`.
  template <class L>
  const L& layer_as(const std::string& name) const {
    const auto* p = dynamic_cast<const L*>(&layer(name));
    if (!p) throw Error(name, "layer_as: the layer has a different policy combination");
    return *p;
  }
  bool is_skipped(const std::string& name) const { return entry_c(name).skipped; }

 private:
  struct Entry {
    std::unique_ptr<layer_base> layer;
    bool skipped = false;
    bool has_gradient = false;
    double decomposition_damping = 0;
    typename layer_base::grad_matrix w;
    typename layer_base::grad_vector b;
  };

  /// A checked checkpoint, not yet applied. The value pointers point into `body` (moving the
  /// plan moves the vector's buffer, so they stay valid).
  struct CheckpointPlan {
    struct Layer {
      bool has_factors = false, has_decomposition = false;
      double damping = 0;
      std::vector<const char*> factors, dec[2];
    };
    std::vector<char> body;
    long counters[5] = {};
    int world = 0, rank = 0;
    std::vector<Layer> layers;
  };

  /// Reads and checks a checkpoint against this preconditioner; throws kfac::Error, changes nothing.
  CheckpointPlan parse_checkpoint(std::istream& is) const {
    CheckpointPlan cp;
    cp.body = impl::read_checkpoint(is);
    impl::ByteReader r(cp.body.data(), cp.body.size());
    long* counters = cp.counters;
    for (int k = 0; k < 5; ++k) counters[k] = long(r.get<std::int64_t>("step counters"));
    cp.world = r.get<std::int32_t>("world size");
    cp.rank = r.get<std::int32_t>("rank");
    r.get<std::uint32_t>("flags");
    const std::uint32_t count = r.get<std::uint32_t>("layer count");
    if (count != layers_.size())
      throw Error("", "checkpoint has " + std::to_string(count) + " layers, this preconditioner has " +
                          std::to_string(layers_.size()));
    // Real counters stay far below 2^53; the bound keeps step() from overflowing `long`.
    constexpr long max_step = 1L << 53;
    for (int k = 0; k < 3; ++k)
      if (counters[k] < 0 || counters[k] > max_step)
        throw Error("", "checkpoint has step counter " + std::to_string(counters[k]) + ": corrupt");
    for (int k = 3; k < 5; ++k)
      if (counters[k] < -1 || counters[k] >= counters[0])
        throw Error("", "checkpoint has last-update step " + std::to_string(counters[k]) +
                            " at step " + std::to_string(counters[0]) + ": corrupt");
    auto& plan = cp.layers;
    plan.resize(count);
    for (std::uint32_t i = 0; i < count; ++i) {
      auto& layer = *layers_[i].layer;
      const std::string name = r.get_string("layer name");
      const std::string sig = r.get_string("layer signature");
      if (name != layer.name())
        throw Error(layer.name(), "checkpoint has layer '" + name + "' in this position");
      if (sig != layer.signature())
        throw Error(name, "checkpoint was written for " + sig + ", this layer is " + layer.signature());
      auto& p = plan[i];
      p.has_factors = r.get<std::uint8_t>("factor flag") != 0;
      auto read_buffers = [&](int part, std::vector<const char*>& out) {
        const auto shapes = layer.buffer_shapes(part);
        const std::uint32_t n = r.get<std::uint32_t>("buffer count");
        if (n == 0) return;
        if (n != shapes.size())
          throw Error(name, "checkpoint buffer count " + std::to_string(n) + " does not match " +
                                std::to_string(shapes.size()));
        for (const auto& [cnt, size] : shapes) {
          const auto ss = r.get<std::uint8_t>("scalar size");
          const auto c = r.get<std::uint64_t>("value count");
          if (ss != size || c != cnt)
            throw Error(name, "checkpoint buffer has " + std::to_string(c) + " values of " +
                                  std::to_string(int(ss)) + " bytes, expected " + std::to_string(cnt) +
                                  " of " + std::to_string(size));
          const char* values = r.get_raw(std::size_t(c) * ss, "buffer values");
          // save() never writes NaN/Inf (factors and decompositions are checked when made);
          // loading one would poison every later decomposition.
          if (!impl::all_finite(values, std::size_t(c), ss))
            throw Error(name, "checkpoint has NaN/Inf values in its saved state: corrupt");
          out.push_back(values);
        }
      };
      read_buffers(0, p.factors);
      if (p.has_factors != !p.factors.empty())
        throw Error(name, "checkpoint factor flag disagrees with its buffers: corrupt");
      p.has_decomposition = r.get<std::uint8_t>("decomposition flag") != 0;
      p.damping = r.get<double>("decomposition damping");
      if (!std::isfinite(p.damping) || p.damping < 0 || (p.has_decomposition && p.damping == 0))
        throw Error(name, "checkpoint has decomposition damping " + std::to_string(p.damping) +
                              ": corrupt");
      read_buffers(1, p.dec[0]);
      read_buffers(2, p.dec[1]);
      if (p.has_decomposition && !p.has_factors)
        throw Error(name, "checkpoint has a decomposition without factors: corrupt");
      if (p.has_decomposition && layer.decomposed_factors() > 0 && (p.dec[0].empty() || p.dec[1].empty()))
        throw Error(name, "checkpoint decomposition flag disagrees with its buffers: corrupt");
    }
    if (!r.done()) throw Error("", "checkpoint has trailing bytes: corrupt");
    return cp;
  }

  /// Averages every running factor over ranks, in buckets of at most bucket_bytes, symmetric
  /// factors as packed upper triangles. The sum is bit-identical on all ranks.
  void average_factors() {
    if (comm_.size() == 1) return;
    std::vector<impl::FactorBuffer> all;
    for (auto& e : layers_)
      if (!e.skipped)
        for (auto& f : e.layer->factors()) all.push_back(f);
    for (std::size_t size : {std::size_t(4), std::size_t(8)}) {
      std::vector<impl::FactorBuffer> bucket;
      std::size_t count = 0;
      const std::size_t limit = std::max<std::size_t>(1, options_.bucket_bytes / size);
      for (auto& f : all) {
        if (f.storage.scalar_size != size) continue;
        if (!bucket.empty() && count + f.payload_count() > limit) {
          if (size == 4) sum_bucket<float>(bucket, count); else sum_bucket<double>(bucket, count);
          bucket.clear();
          count = 0;
        }
        bucket.push_back(f);
        count += f.payload_count();
      }
      if (!bucket.empty()) {
        if (size == 4) sum_bucket<float>(bucket, count); else sum_bucket<double>(bucket, count);
      }
    }
  }
  template <class T>
  void sum_bucket(const std::vector<impl::FactorBuffer>& bucket, std::size_t count) {
    if (staging_bytes_ < count * sizeof(T)) {
      staging_ = Kokkos::View<char*, memory_space>("kfac::comm::staging", count * sizeof(T));
      staging_bytes_ = count * sizeof(T);
    }
    Kokkos::View<T*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> flat(
        reinterpret_cast<T*>(staging_.data()), count);
    std::size_t off = 0;
    for (const auto& f : bucket) {  // pack
      impl::transfer_factor<Exec, T>(exec_, f, flat, off, true);
      off += f.payload_count();
    }
    exec_.fence();
    on_host(flat.data(), count * sizeof(T), [&](void* p) {
      comm_.sum(p, count, sizeof(T), options_.comm_precision);
    });
    const T inv_world = T(1) / T(comm_.size());
    off = 0;
    for (const auto& f : bucket) {  // unpack and average
      impl::transfer_factor<Exec, T>(exec_, f, flat, off, false, inv_world);
      off += f.payload_count();
    }
  }

  /// Decompositions: each factor on its assigned rank, broadcast within the layer's worker group.
  void decompose(bool inv_step, double damping) {
    const int me = comm_.rank();
    std::vector<char> due(layers_.size());
    for (std::size_t l = 0; l < layers_.size(); ++l)
      due[l] = !layers_[l].skipped && (inv_step || !layers_[l].layer->has_decomposition());
    // This rank's decompositions first. A failure is raised only once every rank knows of it:
    // the other ranks would otherwise wait forever in the broadcasts below.
    std::optional<Error> failed;
    long failed_layer = 0;  // 1-based, so that 0 means none
    for (std::size_t l = 0; l < layers_.size() && !failed; ++l) {
      auto& e = layers_[l];
      if (!due[l] || e.layer->decomposed_factors() == 0 || !assignment_.is_grad_worker(l, me)) continue;
      e.layer->allocate_decomposition();
      for (int which = 0; which < 2 && !failed; ++which) {
        if (assignment_.decomposer(l, which) != me) continue;
        try {
          decompose_with_retries(e, which, damping);
        } catch (const Error& err) {
          failed = err;
          failed_layer = long(l) + 1;
        }
      }
    }
    if (comm_.size() > 1) {
      const long any = comm_.allreduce_max(failed_layer);
      if (any > 0 && !failed)
        throw Error(layers_[std::size_t(any - 1)].layer->name(),
                    "decomposition failed on another rank (see that rank's error)");
    }
    if (failed) throw *failed;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      auto& e = layers_[l];
      if (!due[l]) continue;
      e.decomposition_damping = damping;
      if (e.layer->decomposed_factors() == 0) {
        e.layer->finish_decomposition(exec_, damping, options_.precompute_reciprocal);
        continue;
      }
      if (!assignment_.is_grad_worker(l, me)) continue;
      exec_.fence();
      for (int which = 0; which < 2; ++which) {
        const int root = assignment_.decomposer(l, which) % assignment_.grad_workers();
        for (auto& b : e.layer->decomposition_buffers(which)) broadcast(b, root, worker_comm_);
      }
      e.layer->finish_decomposition(exec_, damping, options_.precompute_reciprocal);
    }
  }

  /// A failed decomposition (LAPACK info, Cholesky breakdown, Newton-Schulz divergence) is
  /// retried with 10x the damping, up to max_damping_retries times, then reported.
  void decompose_with_retries(Entry& e, int which, double damping) {
    double d = damping;
    for (int attempt = 0;; ++attempt) {
      try {
        e.layer->decompose(exec_, which, d);
        for (const auto& b : e.layer->decomposition_buffers(which))
          if (nonfinite_in(b) > 0)
            throw Error(e.layer->name(), "decomposition has NaN/Inf values (is the factor finite?)");
        if (attempt > 0) ++damping_retries_;
        return;
      } catch (const Error& err) {
        if (attempt >= options_.max_damping_retries)
          throw Error(e.layer->name(), std::string("decomposition of ") + (which == 0 ? "A" : "G") +
                                           " failed after " + std::to_string(attempt) +
                                           " damping increase(s): " + err.what());
        d *= 10;
      }
    }
  }

  /// Gradient workers precondition their layers; receivers get V from their group's worker.
  /// Every rank first preconditions all of its own layers and only then takes part in the
  /// broadcasts, so that under MEM-OPT/HYBRID the ranks' GEMMs overlap instead of taking turns.
  void precondition(double damping) {
    const int me = comm_.rank();
    const auto received = [&](std::size_t l) {
      return layers_[l].layer->decomposed_factors() > 0 && !assignment_.is_grad_worker(l, me);
    };
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      auto& e = layers_[l];
      if (e.skipped) continue;
      e.layer->load_gradient(exec_, e.w, e.b);  // receivers too: X enters the KL-clip sum
      if (!received(l)) e.layer->apply(exec_, damping);
    }
    if (assignment_.grad_workers() == comm_.size()) return;
    exec_.fence();
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      auto& e = layers_[l];
      if (e.skipped || e.layer->decomposed_factors() == 0) continue;
      broadcast(e.layer->preconditioned(), assignment_.worker_group(l), receiver_comm_);
    }
  }

  void broadcast(const impl::Buffer& b, int root, int group) {
    if (comm_.size() == 1) return;
    on_host(b.data, b.bytes(), [&](void* p) { comm_.broadcast(p, b.bytes(), root, group); });
  }

  /// Runs `f` on a pointer MPI may use: the buffer itself when it is host-accessible or MPI is
  /// CUDA-aware, otherwise a host copy that is written back afterwards.
  template <class F>
  void on_host(void* data, std::size_t bytes, F&& f) {
    if (impl::host_accessible_v<Exec> || comm_.cuda_aware()) {
      f(data);
      return;
    }
    Kokkos::View<char*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> d(static_cast<char*>(data), bytes);
    auto h = Kokkos::create_mirror_view(d);
    Kokkos::deep_copy(h, d);
    f(h.data());
    Kokkos::deep_copy(d, h);
  }

  void skip_step() {
    for (auto& e : layers_) {
      e.layer->clear_observations();
      e.has_gradient = false;
      e.w = {};
      e.b = {};
    }
    poisoned_ = false;
    ++skipped_steps_;
    ++step_;
  }

  long nonfinite_in(const impl::Buffer& b) const {
    if (b.scalar_size == 8)
      return impl::count_nonfinite(exec_, Kokkos::View<const double*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(static_cast<const double*>(b.data), b.count));
    return impl::count_nonfinite(exec_, Kokkos::View<const float*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(static_cast<const float*>(b.data), b.count));
  }

  std::string to_host_bytes(const impl::Buffer& b) const {
    std::string out(b.bytes(), '\0');
    Kokkos::View<const char*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> d(
        static_cast<const char*>(b.data), b.bytes());
    Kokkos::View<char*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(&out[0], b.bytes());
    Kokkos::deep_copy(h, d);
    return out;
  }
  void from_host_bytes(const impl::Buffer& b, const char* src) {
    Kokkos::View<char*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> d(
        static_cast<char*>(b.data), b.bytes());
    Kokkos::View<const char*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(src, b.bytes());
    Kokkos::deep_copy(d, h);
  }

  bool skipped(const std::string& name, const char* kind) const {
    for (const auto& s : options_.skip_layers)
      if (s == name || s == kind) return true;
    return false;
  }
  Entry& entry(const std::string& name) { return const_cast<Entry&>(entry_c(name)); }
  const Entry& entry_c(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw Error(name, "no layer with this name is registered");
    return layers_[it->second];
  }
  static void fail_if(const std::string& name, const std::string& why) {
    if (!why.empty()) throw Error(name, why);
  }
  template <class View>
  static std::string shape_string(const View& v) {
    long e[8] = {};
    for (unsigned r = 0; r < View::rank; ++r) e[r] = long(v.extent(r));
    return impl::extents_string(e, int(View::rank));
  }

  /// Row-major rank-2 (batch, features) or rank-4 (N, C, H, W) view -> unmanaged rank-4 view.
  template <class View>
  typename layer_base::tensor_type as_tensor(const std::string& name, const View& v,
                                             const char* what) const {
    static_assert(Kokkos::is_view<View>::value, "kfac: observations must be Kokkos views");
    static_assert(View::rank == 2 || View::rank == 4,
                  "kfac: observations are (batch, features) or (N, C, H, W) views");
    static_assert(std::is_same<typename View::non_const_value_type, Scalar>::value,
                  "kfac: observations must have the Preconditioner's Scalar type");
    static_assert(Kokkos::SpaceAccessibility<Exec, typename View::memory_space>::accessible,
                  "kfac: observation not accessible from the execution space");
    if (!std::is_same<typename View::array_layout, Kokkos::LayoutRight>::value ||
        !v.span_is_contiguous())
      throw Error(name, std::string(what) + " must be a contiguous row-major (LayoutRight) view");
    const std::size_t d2 = View::rank == 4 ? v.extent(2) : 1, d3 = View::rank == 4 ? v.extent(3) : 1;
    return typename layer_base::tensor_type(v.data(), v.extent(0), v.extent(1), d2, d3);
  }
  /// False (and the step poisoned) when t has non-finite values under NonFinitePolicy::skip.
  template <class T>
  bool check_finite(const std::string& name, const T& t, const char* what) {
    const long bad = impl::count_nonfinite(exec_, t);
    if (bad == 0) return true;
    if (options_.nonfinite == NonFinitePolicy::skip) {
      poisoned_ = true;
      return false;
    }
    throw Error(name, std::string(what) + " contains " + std::to_string(bad) +
                          " NaN/Inf value(s); the observation was not used");
  }

  Options options_;
  Exec exec_;
  Comm comm_;
  std::vector<Entry> layers_;
  std::map<std::string, std::size_t> index_;
  long step_ = 0, next_factor_step_ = 0, next_inv_step_ = 0;
  long last_factor_step_ = -1, last_inv_step_ = -1;
  double last_nu_ = 1.0;
  bool poisoned_ = false;
  long skipped_steps_ = 0, damping_retries_ = 0;
  bool registration_checked_ = false, groups_made_ = false;
  int worker_comm_ = -1, receiver_comm_ = -1;
  WorkAssignment assignment_;
  Kokkos::View<char*, memory_space> staging_;
  std::size_t staging_bytes_ = 0;
};

}  // namespace kfac
