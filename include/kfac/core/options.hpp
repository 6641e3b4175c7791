#pragma once
/// \file options.hpp
/// \brief Hyperparameters of the Preconditioner, each a constant or a function of the step.

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kfac/error.hpp"

namespace kfac {

/// \brief How the host framework reduced the loss over the batch.
///
/// With a mean-reduced loss the output gradients a layer sees are 1/batch of the per-sample
/// gradients, so G computed from them would be batch^2 too small, and a fixed damping would
/// then dominate it (K-FAC silently degrades to clipped SGD). kfac multiplies output gradients
/// by the batch size before forming G when the reduction is `mean`, so that G is the Fisher
/// factor of per-sample gradients either way.
enum class LossReduction { mean, sum };

/// \brief What a layer's running factors start from.
///
/// `batch` (kfac's default): the first statistics update sets each factor to its batch estimate.
/// `identity` (kfac-pytorch's): factors start at the identity, so the first update gives
/// decay I + (1 - decay) (batch estimate), and later ones average as usual. Blocks whose
/// statistics are not Kronecker factors (BatchNorm2d's unit-wise Fisher, NG-SGD) start from
/// their first batch either way.
enum class InitialFactors { batch, identity };

/// \brief What happens when observations or gradients contain NaN/Inf.
///
/// `raise`: observe_* throws kfac::Error at once, on the rank that saw it (single-process use).
/// `skip`: the value is recorded, and step() decides globally (one small collective): if any rank
/// saw a non-finite observation or gradient, every rank skips the whole K-FAC update of that step
/// (factors and decompositions keep their last good values, gradients are left as given) and
/// counts it in Preconditioner::skipped_steps().
enum class NonFinitePolicy { raise, skip };

/// \brief A hyperparameter: a constant, or a function of the optimizer step (0-based).
template <class T>
class Hyperparameter {
 public:
  Hyperparameter(T value) : fn_([value](long) { return value; }) {}  // NOLINT: implicit by design
  Hyperparameter(std::function<T(long)> fn) : fn_(std::move(fn)) {}  // NOLINT
  template <class F, class = std::enable_if_t<std::is_invocable_r<T, F, long>::value &&
                                              !std::is_convertible<F, T>::value>>
  Hyperparameter(F fn) : fn_(std::function<T(long)>(std::move(fn))) {}  // NOLINT
  T operator()(long step) const { return fn_(step); }

 private:
  std::function<T(long)> fn_;
};

/// \brief Ready-made schedules.
namespace schedules {
/// \brief Stale-Fisher schedule (after Osawa et al. 2019): the interval between updates starts
/// at `first` steps and doubles every `double_every` steps, up to `max_interval`.
/// Factors change fast early in training and slowly later, so later updates can be sparser.
inline std::function<long(long)> stale_fisher(long first, long max_interval, long double_every) {
  if (first < 1 || max_interval < first || double_every < 1)
    throw Error("", "stale_fisher: expected 1 <= first <= max_interval and double_every >= 1");
  return [=](long step) {
    long interval = first;
    for (long s = double_every; s <= step && interval < max_interval; s += double_every)
      interval *= 2;
    return interval < max_interval ? interval : max_interval;
  };
}
/// \brief Step decay: `value * factor^(step / every)`.
inline std::function<double(long)> step_decay(double value, double factor, long every) {
  if (every < 1) throw Error("", "step_decay: every = " + std::to_string(every) + ": expected an interval >= 1");
  if (!(factor > 0) || !std::isfinite(factor) || !std::isfinite(value))
    throw Error("", "step_decay: expected a finite value and a finite factor > 0");
  return [=](long step) { return value * std::pow(factor, double(step / every)); };
}
}  // namespace schedules

/// \brief The settings every Preconditioner reads, whatever its distribution and methods, built
/// with `with_*` calls. How work is spread over ranks is the distribution policy's (kfac::Kaisa,
/// the Preconditioner's fourth argument); a layer's inversion, factors and precision are its
/// method object's. kfac 0.2's distribution fields here (grad_worker_fraction, reduce_to_owner,
/// ...) are kfac::Kaisa's settings of the same names since 0.3 (docs/distributed.md).
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | double | lr | learning rate used by KL clipping | 0.1 |
/// | double | damping | Tikhonov damping added to the Kronecker product | 0.001 |
/// | double | factor_decay | running-average weight of the old factor, in [0, 1) ([0, 1] from the identity) | 0.95 |
/// | double | kl_clip | KL-clip bound; 0 disables clipping | 0.001 |
/// | long | factor_update_steps | interval between factor updates | 1 |
/// | long | inv_update_steps | interval between decompositions | 10 |
/// | LossReduction | loss_reduction | how the loss was reduced over the batch | mean |
/// | InitialFactors | initial_factors | what Kronecker factors start from: the first batch, or the identity (kfac-pytorch) | batch |
/// | bool | precompute_reciprocal | store 1/(lambda_G lambda_A^T + damping) at decomposition time | false |
/// | vector<string> | skip_layers | layer names or kinds ("dense", "conv2d", "batch_norm") left unpreconditioned | {} |
/// | NonFinitePolicy | nonfinite | raise at once, or skip the step on every rank | raise |
/// | int | max_damping_retries | decomposition failures retried with more damping | 3 |
/// | double | damping_retry_factor | damping multiplier of each retry (> 1) | 10 |
/// | long | decomposition_delay | d: a decomposition due at step s is computed from the statistics of step s (on a second host thread where the backend allows it) and used from step s + d; 0 = at once; at most every layer's inv_update_steps | 0 |
struct Options {
  Hyperparameter<double> lr{0.1};
  Hyperparameter<double> damping{0.001};
  Hyperparameter<double> factor_decay{0.95};
  Hyperparameter<double> kl_clip{0.001};
  Hyperparameter<long> factor_update_steps{1L};
  Hyperparameter<long> inv_update_steps{10L};
  LossReduction loss_reduction = LossReduction::mean;
  InitialFactors initial_factors = InitialFactors::batch;
  bool precompute_reciprocal = false;
  std::vector<std::string> skip_layers;
  NonFinitePolicy nonfinite = NonFinitePolicy::raise;
  int max_damping_retries = 3;
  double damping_retry_factor = 10.0;
  long decomposition_delay = 0;

  Options& with_lr(Hyperparameter<double> v) { lr = std::move(v); return *this; }
  Options& with_damping(Hyperparameter<double> v) { damping = std::move(v); return *this; }
  Options& with_factor_decay(Hyperparameter<double> v) { factor_decay = std::move(v); return *this; }
  Options& with_kl_clip(Hyperparameter<double> v) { kl_clip = std::move(v); return *this; }
  Options& with_factor_update_steps(Hyperparameter<long> v) { factor_update_steps = std::move(v); return *this; }
  Options& with_inv_update_steps(Hyperparameter<long> v) { inv_update_steps = std::move(v); return *this; }
  Options& with_loss_reduction(LossReduction r) { loss_reduction = r; return *this; }
  Options& with_initial_factors(InitialFactors f) { initial_factors = f; return *this; }
  Options& with_precompute_reciprocal(bool b) { precompute_reciprocal = b; return *this; }
  Options& with_skip_layers(std::vector<std::string> names) { skip_layers = std::move(names); return *this; }
  Options& with_nonfinite_policy(NonFinitePolicy p) { nonfinite = p; return *this; }
  Options& with_max_damping_retries(int n) { max_damping_retries = n; return *this; }
  Options& with_decomposition_delay(long d) {
    if (d < 0) throw Error("", "decomposition_delay: expected a number of steps >= 0");
    decomposition_delay = d;
    return *this;
  }
  Options& with_damping_retry_factor(double f) {
    if (!(f > 1) || !std::isfinite(f)) throw Error("", "damping_retry_factor: expected a finite value > 1");
    damping_retry_factor = f;
    return *this;
  }
};

/// \brief The hyperparameter values in force at one step, checked.
struct StepValues {
  double lr, damping, factor_decay, kl_clip;
  long factor_update_steps, inv_update_steps;

  static StepValues at(const Options& o, long step) {
    StepValues v{o.lr(step), o.damping(step), o.factor_decay(step), o.kl_clip(step),
                 o.factor_update_steps(step), o.inv_update_steps(step)};
    auto bad = [&](const char* name, double x, const char* want) {
      throw Error("", std::string(name) + " = " + std::to_string(x) + " at step " +
                          std::to_string(step) + ": expected " + want);
    };
    if (!(v.lr > 0) || !std::isfinite(v.lr)) bad("lr", v.lr, "a finite value > 0");
    if (!(v.damping > 0) || !std::isfinite(v.damping)) bad("damping", v.damping, "a finite value > 0");
    // From the identity, decay 1 keeps the factors at I (kfac-pytorch allows it); from the batch it
    // would keep the first batch's forever.
    const bool from_identity = o.initial_factors == InitialFactors::identity;
    if (from_identity ? !(v.factor_decay >= 0 && v.factor_decay <= 1) : !(v.factor_decay >= 0 && v.factor_decay < 1))
      bad("factor_decay", v.factor_decay, from_identity ? "a value in [0, 1] (factors from the identity)" : "a value in [0, 1)");
    if (!(v.kl_clip >= 0) || !std::isfinite(v.kl_clip)) bad("kl_clip", v.kl_clip, "a finite value >= 0");
    if (v.factor_update_steps < 1) bad("factor_update_steps", double(v.factor_update_steps), "an interval >= 1");
    if (v.inv_update_steps < 1) bad("inv_update_steps", double(v.inv_update_steps), "an interval >= 1");
    return v;
  }
};

}  // namespace kfac
