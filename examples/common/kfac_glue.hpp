#pragma once
/// \file kfac_glue.hpp
/// \brief The one file of the examples that talks to kfac: SGD with momentum on gradients that
/// kfac::Preconditioner has preconditioned.
///
/// Define KFAC_EXAMPLES_WITHOUT_KFAC to build the examples without the library (the K-FAC
/// optimizer then throws on construction).

#include "common/cross_entropy.hpp"
#include "common/network.hpp"
#include "common/rng.hpp"
#include "common/sigmoid_cross_entropy.hpp"
#include "common/sgd.hpp"
#include "common/world.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <cstdio>
#include <type_traits>
#include <vector>

#if !defined(KFAC_EXAMPLES_WITHOUT_KFAC) && __has_include(<kfac/kfac.hpp>)
#define KFAC_EXAMPLES_HAVE_KFAC 1
#include <kfac/kfac.hpp>
#include <kfac/planning/calibration.hpp>
#include <kfac/planning/cost_model.hpp>
#if KFAC_EXAMPLES_HAVE_MPI
#include <kfac/distributed/mpi_comm.hpp>
#endif
#else
#define KFAC_EXAMPLES_HAVE_KFAC 0
#endif

namespace nn {

/// \brief The cost model's K-FAC step, in seconds: the mean step and its parts (factors and
/// their averaging per factor update, decompositions per decomposition step); zeros without kfac.
struct KfacStepCost {
  double step_s = 0, factors_s = 0, averaging_s = 0, decomposition_s = 0, preconditioning_s = 0;
  long factor_interval = 1, inv_interval = 1;
};

#if KFAC_EXAMPLES_HAVE_KFAC
/// \brief The machine figures the examples' cost-model line predicts with.
struct ModelFigures {
  kfac::MachineFigures machine;  ///< kfac::MachineFigures' defaults unless measured
  bool measured = false;
};
/// \brief Collective over `world`: kfac::measure_machine_figures on every rank at once (about
/// a second and a half), with the BLAS threads already set.
inline ModelFigures measure_model_figures(const World& world) {
  ModelFigures f;
  f.measured = true;
#if KFAC_EXAMPLES_HAVE_MPI
  if (world.size() > 1) {
    f.machine = kfac::measure_machine_figures(ExecSpace(), kfac::MpiComm(world.comm()));
    return f;
  }
#endif
  (void)world;
  f.machine = kfac::measure_machine_figures(ExecSpace(), kfac::SerialComm());
  return f;
}
#else
struct ModelFigures {
  bool measured = false;
};
inline ModelFigures measure_model_figures(const World&) { return {}; }
#endif

/// \brief The large-batch recipe's settings (--recipe and the flags after it in --help).
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | string | name | "none", or "large-batch" (kfac::recipes::large_batch) | none |
/// | double | warmup_epochs | linear warm-up of the learning rate from its batch-256 value; < 0: K-FAC 0.25, SGD and Adam 1 (a quarter epoch let SGD diverge at batch 4096) | -1 |
/// | double | decay_power | polynomial decay power to the last epoch | 2 |
/// | double | kl_clip_power | K-FAC's kl_clip times (batch / 256)^q | 1 |
/// | double | damping_start | K-FAC's damping at step 0, decaying to its damping over one epoch; 0: damping x min(10, batch / 256) | 0 |
/// | double | fresh_epochs | K-FAC's factors and decompositions every step for this long | 1 |
/// | double | max_interval_epochs | then intervals doubling every epoch up to this many epochs' steps | 0.5 |
/// | long, long, double | batch, steps_per_epoch, epochs | the run's (set by nn::Trainer) | 256, 1, 1 |
struct RecipeSettings {
  std::string name = "none";
  double warmup_epochs = -1.0;
  double decay_power = 2.0;
  double kl_clip_power = 1.0;
  double damping_start = 0.0;
  double fresh_epochs = 1.0;
  double max_interval_epochs = 0.5;
  long batch = 256;
  long steps_per_epoch = 1;
  double epochs = 1;
};

/// | type | name | description | default |
/// |---|---|---|---|
/// | double | lr | SGD learning rate, also the one KL clipping assumes | 0.1 |
/// | double | momentum | SGD momentum applied to the preconditioned gradient | 0.9 |
/// | double | weight_decay | L2 on weights, added after preconditioning (as kfac-pytorch does) | 0 |
/// | double | damping | Tikhonov damping of the factors | 0.1 |
/// | double | kl_clip | bound on the step's KL divergence; 0 disables | 1e-3 |
/// | double | factor_decay | running-average weight of the old factors | 0.95 |
/// | long | factor_update_steps | steps between factor updates | 10 |
/// | long | inv_update_steps | steps between decompositions | 100 |
/// | string | inverse | "eigen" (kfac::Eigendecomposition), "cholesky" (damped inverses) or "randomized" (kfac::RandomizedEigen: top-`rank` eigenpairs, the rest as their mean) | eigen |
/// | int | rank | kfac::RandomizedEigen::with_rank (inverse "randomized"): eigenpairs kept per factor | 32 |
/// | bool | factored_damping | kfac::RandomizedEigen::with_factored_damping (inverse "randomized"): each factor damped by √damping, the "cholesky" form | false |
/// | string | factor_precision | "float" (kfac::Precision<float>) or "half" (kfac::HalfPrecision: binary16 factors, float decompositions, Osawa et al.) for the Dense/Conv2d factors | float |
/// | bool | pi_damping | Cholesky's π-damping (kfac::Cholesky::with_pi_damping); off: π = 1, the form the sweeps tuned | false |
/// | long | decomposition_delay | kfac::Options::decomposition_delay: decompositions used d steps after they fall due, computed meanwhile | 0 |
/// | double | eigen_refresh | kfac::Eigendecomposition::with_refresh_tolerance (inverse "eigen"): eigenvalues refreshed in the kept eigenbasis while within this relative distance of the factor | 0 |
/// | string | fisher | G from output gradients at the data's targets, or "sampled" at the model's | empirical |
/// | int | fisher_samples | "sampled": draws per sample on a statistics step (a backward pass each) | 1 |
/// | uint64 | fisher_seed | "sampled": the run's seed, from which each step's draws derive | 1 |
///
/// These are the CNN's settings; nn::default_kfac(model) gives each model's (docs/fashion_mnist.md
/// has the sweeps behind them). Damping 1e-3 let momentum SGD diverge on the MLP. Updating
/// factors every step and decomposing every 10 doubled the CNN's step time for no visible gain.
struct KfacSettings {
  double lr = 0.1;
  double momentum = 0.9;
  double weight_decay = 0.0;
  double damping = 0.1;
  double kl_clip = 1e-3;
  double factor_decay = 0.95;
  long factor_update_steps = 10;
  long inv_update_steps = 100;
  std::string inverse = "eigen";
  int rank = 32;
  bool factored_damping = false;
  bool pi_damping = false;
  std::string factor_precision = "float";
  long decomposition_delay = 0;
  double eigen_refresh = 0;
  /// KAISA's gradient-worker fraction under MPI (kfac::Kaisa::with_grad_worker_fraction):
  /// 1 = COMM-OPT (every rank preconditions every layer), 1/world = MEM-OPT; 0 picks it from
  /// `strategy` and the world size.
  double grad_worker_fraction = 0;
  /// comm-opt (f = 1), hybrid (f = 1/2), mem-opt (f = 1/world), or auto: on several ranks the
  /// fraction, split preconditioning and reduce-to-owner the cost model predicts fastest for
  /// this network with `figures`, chosen at the first step (see KfacSgd::chosen()); a setting
  /// marked as given below is kept.
  std::string strategy = "auto";
  bool reduce_to_owner = false;       ///< kfac::Kaisa::with_reduce_to_owner
  bool split_preconditioning = false; ///< kfac::Kaisa::with_split_preconditioning
  bool reduce_to_owner_given = false, split_preconditioning_given = false;  ///< set by the user: auto keeps them
  ModelFigures figures;               ///< the machine figures --strategy auto predicts with
  bool overlap_communication = true;  ///< kfac::Kaisa::with_overlap_communication
  /// kfac::recipes::large_batch with lr, damping and kl_clip above as the values tuned at the
  /// recipe's reference batch 256 (see recipe_of), or none.
  RecipeSettings recipe;
  /// Self-tuned (kfac::SelfTuning with kfac::Adaptive's defaults, docs/self_tuning.md): step size,
  /// momentum and damping chosen every step from the exact curvature, so lr, momentum, damping
  /// and kl_clip above are not used; a network whose layers all have an R-op (every kind has one).
  bool adaptive = false;
  /// With `adaptive`: the quadratic model solved (R-op products) every this many steps after the
  /// first 10, the solves' weighted means of alpha and mu used in between (kfac::Adaptive::solve_interval).
  long adaptive_solve_interval = 1;
  std::string fisher = "empirical";  ///< --fisher: "empirical" or "sampled" (see the table)
  int fisher_samples = 1;            ///< --fisher-samples
  std::uint64_t fisher_seed = 1;     ///< the run's --seed (set by nn::Trainer and the autoencoder)
};

/// \brief Refuses a --fisher or --fisher-samples value, naming the flag.
inline void check_fisher(const KfacSettings& s) {
  if (s.fisher != "empirical" && s.fisher != "sampled")
    throw std::invalid_argument("--fisher: expected empirical or sampled (got '" + s.fisher + "')");
  if (s.fisher_samples < 1)
    throw std::invalid_argument("--fisher-samples: expected N >= 1 (got " + std::to_string(s.fisher_samples) + ")");
}

/// \brief The gradient-worker fraction `s` asks for on `world_size` ranks (see KfacSettings).
inline double resolve_grad_worker_fraction(const KfacSettings& s, int world_size) {
  if (s.grad_worker_fraction > 0) return s.grad_worker_fraction;
  const double mem = 1.0 / double(world_size > 0 ? world_size : 1);
  if (s.strategy == "comm-opt" || world_size <= 1) return 1.0;
  if (s.strategy == "mem-opt") return mem;
  if (s.strategy == "hybrid") return mem > 0.5 ? mem : 0.5;
  if (s.strategy == "auto") return 0;  // chosen by KfacSgd at its first step
  throw std::invalid_argument("unknown K-FAC strategy '" + s.strategy + "' (expected auto, comm-opt, hybrid or mem-opt)");
}

/// \brief True when KfacSgd chooses the distribution with the cost model (--strategy auto on several ranks).
inline bool strategy_is_auto(const KfacSettings& s, int world_size) {
  return world_size > 1 && s.grad_worker_fraction <= 0 && s.strategy == "auto";
}

#if KFAC_EXAMPLES_HAVE_KFAC

/// \brief kfac::Options of `s`, for the mean-reduced loss of the examples' cross-entropy.
inline kfac::Options kfac_options(const KfacSettings& s) {
  return kfac::Options{}
      .with_lr(s.lr)
      .with_damping(s.damping)
      .with_kl_clip(s.kl_clip)
      .with_factor_decay(s.factor_decay)
      .with_factor_update_steps(s.factor_update_steps)
      .with_inv_update_steps(s.inv_update_steps)
      .with_decomposition_delay(s.decomposition_delay)
      .with_loss_reduction(kfac::LossReduction::mean);
}

/// \brief The KAISA distribution of `s` on `world_size` ranks (under --strategy auto, COMM-OPT
/// until KfacSgd chooses at its first step).
inline kfac::Kaisa kfac_distribution(const KfacSettings& s, int world_size = 1) {
  const double f = resolve_grad_worker_fraction(s, world_size);
  return kfac::Kaisa{}
      .with_grad_worker_fraction(f > 0 ? f : 1.0)
      .with_reduce_to_owner(s.reduce_to_owner)
      .with_split_preconditioning(s.split_preconditioning)
      .with_overlap_communication(s.overlap_communication);
}

/// \brief The recipe of `r` around a learning rate `lr` tuned at batch 256, with a warm-up of
/// `default_warmup` epochs unless `r` sets one.
inline kfac::recipes::LargeBatch recipe_of(const RecipeSettings& r, double lr, double default_warmup) {
  return kfac::recipes::large_batch(r.batch, r.steps_per_epoch, r.epochs)
      .with_lr(lr)
      .with_warmup_epochs(std::min(r.warmup_epochs >= 0 ? r.warmup_epochs : default_warmup, r.epochs))
      .with_polynomial_decay(r.decay_power);
}
/// \brief K-FAC's large-batch recipe (KfacSettings::recipe.name == "large-batch"): lr, damping
/// and kl_clip of `s` are the batch-256 values it scales and schedules (docs/large_batch.md).
inline kfac::recipes::LargeBatch recipe_of(const KfacSettings& s) {
  const RecipeSettings& r = s.recipe;
  auto k = recipe_of(r, s.lr, 0.25).with_damping(s.damping).with_kl_clip(s.kl_clip, r.kl_clip_power)
               .with_stale_fisher(r.fresh_epochs, 1.0, r.max_interval_epochs);
  if (r.damping_start > 0) k.with_damping_ramp(r.damping_start, 1.0);
  return k;
}

/// \brief The first-order counterpart of the recipe for an SGD or Adam rate `base` tuned at
/// batch 256: the same linear scaling, warm-up and decay (Goyal et al.'s rule).
inline std::function<double(long)> first_order_lr(const RecipeSettings& r, double base) {
  return recipe_of(r, base, 1.0).lr_schedule();
}

/// \brief kfac's description of an example layer (the shapes register_layer and the cost model take).
inline kfac::Dense kfac_layer_of(const Dense& layer) {
  return kfac::Dense(layer.in_features(), layer.out_features(), layer.has_bias());
}
inline kfac::Conv2d kfac_layer_of(const Conv2d& layer) {
  const Conv2dShape& c = layer.shape();
  return kfac::Conv2d(c.in_channels, c.out_channels, c.kernel_h, c.kernel_w)
      .with_stride(c.stride, c.stride)
      .with_padding(c.padding, c.padding)
      .with_bias(c.bias);
}

/// \brief The curvature kind of each of the examples' losses at its logits (kfac::SelfTuning).
inline kfac::LossCurvature loss_curvature(const SoftmaxCrossEntropy&) {
  return kfac::LossCurvature::softmax_cross_entropy;
}
inline kfac::LossCurvature loss_curvature(const SigmoidCrossEntropy&) {
  return kfac::LossCurvature::sigmoid_cross_entropy;
}

/// \brief y += a x, elementwise (a free function: nvcc rejects device lambdas in private members).
inline void add_scaled(float a, const ConstVector& x, const Vector& y) {
  Kokkos::parallel_for("nn::kfac::axpy", Kokkos::RangePolicy<ExecSpace>(0, y.extent(0)),
                       KOKKOS_LAMBDA(const std::size_t i) { y(i) += a * x(i); });
}

/// \brief What the host hands KfacSgd::step_adaptive about its loss on this step's batch.
struct AdaptiveLoss {
  kfac::LossCurvature curvature;  ///< loss_curvature(the loss)
  Tensor logits;                  ///< the outputs of the forward pass the gradients came from
  double before;                  ///< the mean loss on the batch at the parameters of that pass
  std::function<double()> after;  ///< the same loss at the parameters now (a Mode::probe forward on the same batch)
};

/// \brief What register_layer<L, Symmetric, Cholesky<>> registers for the examples' float
/// preconditioners, with KfacSettings::pi_damping (factors in `Prec`).
template <class Prec = kfac::Precision<float>>
auto cholesky_method(bool pi_damping) {
  return kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>, Prec>(kfac::Cholesky<>{}.with_pi_damping(pi_damping));
}

class KfacSgd {
 public:
  /// \param world [in] one process, or the ranks whose factors are averaged (MPI)
  KfacSgd(Network& net, const KfacSettings& s, const World& world = World())
      : sgd_(net.params(), SgdOptions{}.with_lr(s.lr).with_momentum(s.momentum).with_weight_decay(s.weight_decay)) {
    if (s.inverse != "eigen" && s.inverse != "cholesky" && s.inverse != "randomized")
      throw std::invalid_argument("unknown K-FAC inverse '" + s.inverse + "' (expected eigen, cholesky or randomized)");
    if (s.rank < 1) throw std::invalid_argument("K-FAC rank " + std::to_string(s.rank) + ": expected >= 1");
    if (s.factor_precision != "float" && s.factor_precision != "half")
      throw std::invalid_argument("unknown K-FAC factor precision '" + s.factor_precision + "' (expected float or half)");
    if (s.recipe.name != "none" && s.recipe.name != "large-batch")
      throw std::invalid_argument("unknown recipe '" + s.recipe.name + "' (expected none or large-batch)");
    check_fisher(s);
    kfac::Options options = kfac_options(s);
    kaisa_ = kfac_distribution(s, world.size());
    if (s.recipe.name == "large-batch") {
      const kfac::recipes::LargeBatch r = recipe_of(s);
      options = r.options(options);
      lr_ = r.lr_schedule();
    }
    if (s.adaptive) {
      if (!net.has_rop())
        throw std::invalid_argument("self-tuned K-FAC (--adaptive) needs an R-op of every layer");
      const kfac::Adaptive adaptive =
          kfac::Adaptive{}.with_weight_decay(s.weight_decay).with_solve_interval(s.adaptive_solve_interval);
#if KFAC_EXAMPLES_HAVE_MPI
      // Several ranks: the quadratic model's scalars and the losses are summed over them.
      if (world.size() > 1) mpi_tune_ = std::make_unique<MpiTuning>(adaptive, ExecSpace(), kfac::MpiComm(world.comm()));
#endif
      if (!mpi_tune_) tune_ = std::make_unique<Tuning>(adaptive);
      with_tuning([&](auto& tune) {
        // lambda + eta is the damping; the solve chooses the step's length: no KL clip, no schedule.
        options = options.with_damping(tune.damping()).with_kl_clip(0.0).with_lr(1.0);
        for (const Param& p : net.params()) tune.add_parameter(p.name, p.grad);
      });
      lr_ = nullptr;
      params_ = net.params();
    }
    options_ = options;
    settings_ = s;
    world_ = world;
    if (world.size() > 1 && !KFAC_EXAMPLES_HAVE_MPI) throw std::runtime_error("data-parallel K-FAC needs kfac built with MPI");
    if (!strategy_is_auto(s, world.size())) construct(net);  // else at the first step, when the rows are known
  }

  /// \brief Under --strategy auto on several ranks (after the first step): the distribution the
  /// cost model chose and its prediction against the other candidates; empty otherwise.
  const std::string& chosen() const { return chosen_; }

  /// \brief KfacSettings::fisher "sampled", after the forward pass and before the data's backward
  /// pass: on a step that updates statistics, `fisher_samples` backward passes from the output
  /// gradients of `loss` at targets drawn from the model (Loss::sampled_grad at `logits`), each
  /// handed to kfac as one more observation of every layer's input and output gradient, so that
  /// G averages the draws (A is the same in each); the data's backward pass that follows then
  /// gives the gradient, and step() observes nothing more. kfac folds the observations into
  /// its pending statistics as they come (the Kronecker blocks' Gram matrices; BatchNorm2d's
  /// products), so the next pass may overwrite the layers' buffers. The draws derive from
  /// (fisher_seed, step, rank): each rank its own slice. Nothing otherwise ("empirical", or a
  /// step without statistics).
  template <class Loss>
  void observe_sampled(Network& net, const Tensor& logits, Loss& loss) {
    if (settings_.fisher != "sampled") return;
    const bool built = mpi_ || serial_;  // --strategy auto builds at the first step, a statistics step
    if (built && !wants_observations()) return;
    const long step = built ? step_count() : 0;
    SplitMix64 rng(derive_seed(derive_seed(settings_.fisher_seed, 4, std::uint64_t(step)), 0,
                               std::uint64_t(world_.rank())));
    for (int k = 0; k < settings_.fisher_samples; ++k) {
      net.backward(loss.sampled_grad(logits, rng));
      Kokkos::Profiling::pushRegion("kfac::examples::kfac");
      const auto t0 = std::chrono::steady_clock::now();
      if (!mpi_ && !serial_) choose_distribution(net);  // needs the rows of a backward pass
      with_preconditioner([&](auto& pre) { observe(net, pre, pre.wants_observations(), false); });
      kfac_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      Kokkos::Profiling::popRegion();
    }
  }

  /// \brief After forward and backward (and gradient averaging): hand kfac the observations and
  /// gradients, let it precondition the gradients in place, then take the SGD step with them.
  /// The Kokkos Tools regions "kfac::examples::kfac" (everything kfac does in the step) and
  /// "kfac::examples::observe" (the observe_* and set_gradient calls) let bench_step_cost time
  /// them; the library's own regions name the phases of step().
  void step(Network& net) {
    Kokkos::Profiling::pushRegion("kfac::examples::kfac");
    const auto t0 = std::chrono::steady_clock::now();
    if (!mpi_ && !serial_) choose_distribution(net);
    const long step = step_count();  // the step being taken
    with_preconditioner([&](auto& pre) { precondition(net, pre, from_data()); });
    kfac_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    Kokkos::Profiling::popRegion();
    if (lr_) sgd_.set_lr(lr_(step));  // the rate K-FAC's KL clip assumed at this step
    sgd_.step();
  }

  /// \brief Self-tuned step (KfacSettings::adaptive; docs/self_tuning.md's protocol), after
  /// forward and backward on this step's batch: the gradients (plus weight decay) are captured,
  /// preconditioned into the proposal P, the network's R-op gives J P (and J U0 along the previous
  /// update), kfac::SelfTuning solves for the step size and momentum, and the parameters move by
  /// the update U (learning rate 1); every update_interval steps the loss at the new parameters,
  /// `loss.after()`, updates the damping. Counted in kfac_seconds() except the R-op and loss passes.
  /// Under MPI (the gradients averaged over the ranks first) each rank's R-op products are of its
  /// own slice of the batch, and kfac::SelfTuning sums the model's scalars and losses over the ranks.
  void step_adaptive(Network& net, const AdaptiveLoss& loss) {
    if (!tune_ && !mpi_tune_) throw std::logic_error("KfacSgd::step_adaptive without KfacSettings::adaptive");
    Kokkos::Profiling::pushRegion("kfac::examples::kfac");
    auto t0 = std::chrono::steady_clock::now();
    if (!mpi_ && !serial_) choose_distribution(net);
    if (settings_.weight_decay > 0) add_weight_decay(params_, settings_.weight_decay);
    with_preconditioner([&](auto& pre) { observe(net, pre, from_data() && pre.wants_observations(), true); });
    with_tuning([](auto& tune) {
      if (tune.wants_products()) tune.capture_gradient();  // else apply_last(): the solves' means
    });
    with_preconditioner([](auto& pre) { pre.step(); });
    kfac_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    Kokkos::Profiling::popRegion();
    with_tuning([&](auto& tune) { products_step(net, loss, tune); });
  }

  /// \brief step_adaptive's second half on `tune` (public: a template over the communicator's tuning type).
  template <class Tune>
  void products_step(Network& net, const AdaptiveLoss& loss, Tune& tune) {
    if (!tune.wants_products()) {  // Adaptive::solve_interval: no products at this step
      const auto t0 = std::chrono::steady_clock::now();
      tune.apply_last();
      for (const Param& p : params_) add_scaled(-1.0f, p.grad, p.value);
      Kokkos::fence();
      kfac_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return;
    }
    kfac::OutputProducts<float, ExecSpace> products;
    products.loss = loss.curvature;
    products.outputs = as_matrix(loss.logits);
    std::vector<ConstVector> along;
    for (const Param& p : params_) along.push_back(p.grad);
    const Matrix jp = as_matrix(net.rop(along));
    const Matrix jp_copy = along_proposal_.matrix(jp.extent(0), jp.extent(1));
    Kokkos::deep_copy(jp_copy, jp);
    products.along_proposal = jp_copy;
    if (tune.needs_previous_product()) {
      along.clear();
      for (const Param& p : params_) along.push_back(tune.previous_update(p.name));
      products.along_previous = as_matrix(net.rop(along));
    }
    const auto t0 = std::chrono::steady_clock::now();
    tune.solve(products);
    for (const Param& p : params_) add_scaled(-1.0f, p.grad, p.value);
    Kokkos::fence();
    kfac_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (tune.wants_loss_change()) tune.update_damping(loss.before, loss.after());
  }

  /// \brief A copy of what kfac::SelfTuning reports (its accessors' names), on any communicator.
  class TuningView {
   public:
    template <class Tune>
    explicit TuningView(const Tune& t)
        : solves_(t.solves()), updates_(t.damping_updates()), lambda_(t.lambda()), last_(t.last_step()),
          last_update_(t.last_damping_update()) {}
    long solves() const { return solves_; }
    long damping_updates() const { return updates_; }
    double lambda() const { return lambda_; }
    const kfac::AdaptiveStep& last_step() const { return last_; }
    const kfac::DampingUpdate& last_damping_update() const { return last_update_; }

   private:
    long solves_, updates_;
    double lambda_;
    kfac::AdaptiveStep last_;
    kfac::DampingUpdate last_update_;
  };
  /// \brief Self-tuned: the settings' state (lambda, the last step's alpha and mu); empty otherwise.
  std::optional<TuningView> tuning() const {
    if (tune_) return TuningView(*tune_);
    if (mpi_tune_) return TuningView(*mpi_tune_);
    return std::nullopt;
  }

  /// \brief Seconds spent in kfac (observe_*, set_gradient and step()) on this rank so far.
  double kfac_seconds() const { return kfac_seconds_; }

  /// \brief kfac::CostModel's prediction with `figures` for this network, these options and
  /// `world` ranks, with the observation rows of the last step's batch on this rank (times
  /// `world`: the global batch): what kfac_seconds() should come to per step. Call it after a step.
  KfacStepCost predicted(Network& net, int world, const ModelFigures& figures = {}) const {
    return cost_of(plan(net, world, figures).predict(world, options_, kaisa_));
  }

  /// \brief The KL-clip scale of the last step (1 = unclipped), for diagnostics.
  double last_kl_scale() const { return mpi_ ? mpi_->last_kl_scale() : serial_ ? serial_->last_kl_scale() : 1.0; }
  /// \brief Bytes K-FAC's collectives sent from this rank so far (0 on one process).
  std::size_t bytes_sent() const {
#if KFAC_EXAMPLES_HAVE_MPI
    if (mpi_) return mpi_->communicator().bytes_sent();
#endif
    return 0;
  }

 private:
  using SerialPreconditioner = kfac::Preconditioner<float, ExecSpace, kfac::SerialComm>;
#if KFAC_EXAMPLES_HAVE_MPI
  using MpiPreconditioner = kfac::Preconditioner<float, ExecSpace, kfac::MpiComm>;
#else
  using MpiPreconditioner = SerialPreconditioner;  // never constructed
#endif

  kfac::Options options_;
  kfac::Kaisa kaisa_;      ///< the distribution (chosen at the first step under --strategy auto)
  KfacSettings settings_;  ///< the inversion and its settings registered, and what --strategy auto chooses among
  World world_;
  std::string chosen_;
  std::function<double(long)> lr_;  ///< the recipe's learning rate; empty: constant
  double kfac_seconds_ = 0;

  void construct(Network& net) {
#if KFAC_EXAMPLES_HAVE_MPI
    if (world_.size() > 1)
      mpi_ = std::make_unique<MpiPreconditioner>(options_, ExecSpace(), kfac::MpiComm(world_.comm()), kaisa_);
#endif
    if (!mpi_) serial_ = std::make_unique<SerialPreconditioner>(options_, ExecSpace(), kfac::SerialComm{}, kaisa_);
    with_preconditioner([&](auto& pre) { register_layers(net, pre); });
  }

  /// --strategy auto: every gradient-worker count w dividing the P ranks (fraction w/P: COMM-OPT
  /// w = P, HYBRID, MEM-OPT w = 1), with and without split preconditioning and reduce-to-owner (those the user set kept),
  /// priced by the cost model for this network, the rows of the first batch and the measured
  /// figures; the cheapest predicted step wins (the first listed on a tie). Rank 0's choice is
  /// every rank's, so that ranks with slightly different figures still agree.
  void choose_distribution(Network& net) {
    const int world = world_.size();
    const kfac::CostModel model = plan(net, world, settings_.figures);
    std::vector<int> workers;  // P first: COMM-OPT wins ties
    for (int w = world; w >= 1; --w)
      if (world % w == 0) workers.push_back(w);
    struct Candidate {
      kfac::Kaisa kaisa;
      double seconds;
      std::string name;
    };
    std::vector<Candidate> candidates;
    for (int w : workers)
      for (int split = 0; split < 2; ++split)
        for (int own = 0; own < 2; ++own) {
          if (settings_.split_preconditioning_given && bool(split) != settings_.split_preconditioning) continue;
          if (settings_.reduce_to_owner_given && bool(own) != settings_.reduce_to_owner) continue;
          if (split && w == 1) continue;  // one gradient worker per layer: nothing to divide
          const kfac::Kaisa k = kfac::Kaisa(kaisa_).with_grad_worker_fraction(double(w) / double(world))
                                    .with_split_preconditioning(split).with_reduce_to_owner(own);
          char name[64];
          std::snprintf(name, sizeof name, "%s%s%s", w == world ? "comm-opt" : w == 1 ? "mem-opt" : ("hybrid(" + std::to_string(w) + ")").c_str(),
                        split ? "+split" : "", own ? "+own" : "");
          candidates.push_back({k, model.predict(world, options_, k).step_seconds(), name});
        }
    std::size_t best = 0;
    for (std::size_t i = 1; i < candidates.size(); ++i)
      if (candidates[i].seconds < candidates[best].seconds) best = i;
    std::vector<double> pick{world_.rank() == 0 ? double(best) : 0.0};
    world_.sum(pick);
    best = std::size_t(pick[0]);
    kaisa_ = candidates[best].kaisa;
    auto ms = [](double s) {
      char b[32];
      std::snprintf(b, sizeof b, "%.2f ms", 1e3 * s);
      return std::string(b);
    };
    chosen_ = candidates[best].name + " (cost model per step: " + ms(candidates[best].seconds);
    for (std::size_t i = 0; i < candidates.size(); ++i)
      if (i != best) chosen_ += "; " + candidates[i].name + " " + ms(candidates[i].seconds);
    chosen_ += ")";
    construct(net);
  }

  /// The cost model of this network as registered, with this rank's observation rows of the
  /// last backward pass times `world` (the global batch).
  kfac::CostModel plan(Network& net, int world, const ModelFigures& figures) const {
    kfac::CostModel model(figures.machine);
    PlanOnto onto{model};
    register_layers(net, onto);  // what the preconditioner registers
    net.for_each_layer([&](const std::string& name, const auto& layer) {
      using L = std::decay_t<decltype(layer)>;
      long rows = 0;  // this rank's observation rows of the last step
      if constexpr (std::is_same_v<L, Dense>) rows = long(layer.output_grad().extent(0));
      if constexpr (std::is_same_v<L, Conv2d>) {
        const auto& dy = layer.output_grad();  // (N, O, Ho, Wo): one row per sample and position
        rows = long(dy.extent(0)) * long(dy.extent(2)) * long(dy.extent(3));
      }
      if (rows > 0) model.layer(name).with_observation_rows(kfac::index_t(rows) * world);
    });
    return model;
  }

  static KfacStepCost cost_of(const kfac::CostPrediction& p) {
    KfacStepCost c;
    c.step_s = p.step_seconds();
    c.factors_s = p.factor_compute_seconds;
    c.averaging_s = p.factor_comm_seconds;
    c.decomposition_s = p.decomposition_phase_seconds;
    c.preconditioning_s = p.preconditioning_phase_seconds;
    c.factor_interval = p.factor_interval;
    c.inv_interval = p.inv_interval;
    return c;
  }

  /// Describes on a cost model what register_layer registers on the examples' preconditioners
  /// (Scalar float).
  struct PlanOnto {
    kfac::CostModel& model;
    template <class LayerType, class Method>
    void register_layer(const std::string& name, const LayerType& layer, const Method& method) {
      model.add<float>(name, layer, method);
    }
  };

  template <class F>
  void with_preconditioner(F&& f) {
    if (mpi_) f(*mpi_);
    else f(*serial_);
  }

  /// Registers every layer of `net` on `pre` (a preconditioner, or PlanOnto a cost model: one
  /// registration serves both).
  template <class Pre>
  void register_layers(Network& net, Pre& pre) const {
    auto kronecker_in = [&](auto precision, const std::string& name, const auto& kfac_layer) {
      using K = std::decay_t<decltype(kfac_layer)>;
      using Prec = decltype(precision);
      const KfacSettings& s = settings_;
      if (s.inverse == "cholesky") pre.register_layer(name, kfac_layer, cholesky_method<Prec>(s.pi_damping));
      else if (s.inverse == "randomized")
        pre.register_layer(name, kfac_layer, kfac::KFAC<kfac::Symmetric, kfac::RandomizedEigen<>, Prec>(
                                                 kfac::RandomizedEigen<>{}.with_rank(s.rank).with_factored_damping(s.factored_damping)));
      else if (s.eigen_refresh > 0)
        pre.register_layer(name, kfac_layer, kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>, Prec>(
                                                 kfac::Eigendecomposition<>{}.with_refresh_tolerance(s.eigen_refresh)));
      else if constexpr (std::is_same_v<Prec, kfac::Precision<float>>)
        pre.register_layer(name, kfac_layer, typename kfac::default_method<K>::type{});
      else pre.register_layer(name, kfac_layer, kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>, Prec>{});
    };
    auto kronecker = [&](const std::string& name, const auto& kfac_layer) {
      if (settings_.factor_precision == "half") kronecker_in(kfac::HalfPrecision{}, name, kfac_layer);
      else kronecker_in(kfac::Precision<float>{}, name, kfac_layer);
    };
    net.for_each_layer([&](const std::string& name, const auto& layer) {
      using L = std::decay_t<decltype(layer)>;
      if constexpr (std::is_same_v<L, Dense> || std::is_same_v<L, Conv2d>) {
        kronecker(name, kfac_layer_of(layer));
      } else if constexpr (std::is_same_v<L, BatchNorm2d>) {
        pre.register_layer(name, kfac::BatchNorm2d(layer.channels()), kfac::UnitWiseFisher<>{});
      }
    });
  }

  /// The statistics come from the data's backward pass ("empirical"), else from observe_sampled.
  bool from_data() const { return settings_.fisher != "sampled"; }
  bool wants_observations() const { return mpi_ ? mpi_->wants_observations() : serial_->wants_observations(); }
  long step_count() const { return mpi_ ? mpi_->step_count() : serial_->step_count(); }

  template <class Pre>
  static void precondition(Network& net, Pre& pre, bool from_data) {
    observe(net, pre, from_data && pre.wants_observations(), true);
    pre.step();
  }

  /// grad += weight_decay * value on the parameters that decay.
  static void add_weight_decay(const std::vector<Param>& params, double weight_decay) {
    for (const Param& p : params)
      if (p.decay) add_scaled(float(weight_decay), p.value, p.grad);
  }

  /// Hands `pre` the observations of every registered layer (`statistics`: a step that wants them)
  /// and its gradient (`gradients`).
  template <class Pre>
  static void observe(Network& net, Pre& pre, bool statistics, bool gradients) {
    const bool observe = statistics;
    Kokkos::Profiling::pushRegion("kfac::examples::observe");
    net.for_each_layer([&](const std::string& name, const auto& layer) {
      using L = std::decay_t<decltype(layer)>;
      if constexpr (std::is_same_v<L, Dense> || std::is_same_v<L, Conv2d>) {
        if (observe) {
          pre.observe_input(name, layer.input());
          pre.observe_output_grad(name, layer.output_grad());
        }
        if (gradients) pre.set_gradient(name, layer.weight_grad(), layer.bias_grad());
      } else if constexpr (std::is_same_v<L, BatchNorm2d>) {
        if (observe) {
          pre.observe_input(name, layer.normalized_input());
          pre.observe_output_grad(name, layer.output_grad());
        }
        if (gradients) pre.set_gradient(name, layer.gamma_grad(), layer.beta_grad());
      }
    });
    Kokkos::Profiling::popRegion();
  }

  using Tuning = kfac::SelfTuning<float, ExecSpace>;
#if KFAC_EXAMPLES_HAVE_MPI
  using MpiTuning = kfac::SelfTuning<float, ExecSpace, kfac::MpiComm>;
#else
  using MpiTuning = Tuning;  // never constructed
#endif
  // Self-tuned (KfacSettings::adaptive) only; at most one is set, as with the preconditioners.
  std::unique_ptr<Tuning> tune_;
  std::unique_ptr<MpiTuning> mpi_tune_;
  template <class F>
  void with_tuning(F&& f) {
    if (mpi_tune_) f(*mpi_tune_);
    else f(*tune_);
  }
  std::vector<Param> params_;     ///< self-tuned: the parameters the update moves
  Buffer<float> along_proposal_{"nn::kfac::along_proposal"};

  // Held by pointer so that KfacSgd moves whatever kfac allows; exactly one is set.
  std::unique_ptr<SerialPreconditioner> serial_;
  std::unique_ptr<MpiPreconditioner> mpi_;
  Sgd sgd_;
};

/// \brief Averages every parameter gradient of a network over the ranks of a World after each
/// backward pass (kfac::GradientAverager); nothing to do on one process.
class GradientSync {
 public:
  GradientSync(const Network& net, const World& world) {
#if KFAC_EXAMPLES_HAVE_MPI
    if (world.size() > 1) {
      averager_ = std::make_unique<kfac::GradientAverager<kfac::MpiComm, ExecSpace>>(kfac::MpiComm(world.comm()));
      for (const Param& p : net.params()) averager_->add(p.grad);
    }
#else
    (void)net;
    if (world.size() > 1) throw std::runtime_error("data-parallel training needs kfac built with MPI");
#endif
  }
  void average() {
#if KFAC_EXAMPLES_HAVE_MPI
    if (averager_) averager_->average();
#endif
  }

 private:
#if KFAC_EXAMPLES_HAVE_MPI
  std::unique_ptr<kfac::GradientAverager<kfac::MpiComm, ExecSpace>> averager_;
#endif
};

#else

inline std::function<double(long)> first_order_lr(const RecipeSettings&, double) {
  throw std::runtime_error("--recipe needs kfac (this build has none: KFAC_EXAMPLES_WITHOUT_KFAC)");
}

class KfacSgd {
 public:
  KfacSgd(Network&, const KfacSettings&, const World& = World()) {
    throw std::runtime_error("this build of the examples has no kfac (KFAC_EXAMPLES_WITHOUT_KFAC)");
  }
  void step(Network&) {}
  template <class Loss>
  void observe_sampled(Network&, const Tensor&, Loss&) {}
  double kfac_seconds() const { return 0.0; }
  KfacStepCost predicted(Network&, int, const ModelFigures& = {}) const { return {}; }
  const std::string& chosen() const { return chosen_; }
  double last_kl_scale() const { return 1.0; }
  std::size_t bytes_sent() const { return 0; }

 private:
  std::string chosen_;
};

class GradientSync {
 public:
  GradientSync(const Network&, const World& world) {
    if (world.size() > 1) throw std::runtime_error("data-parallel training needs kfac (and MPI)");
  }
  void average() {}
};

#endif

}  // namespace nn
