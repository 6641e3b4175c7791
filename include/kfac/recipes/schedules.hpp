#pragma once
/// \file schedules.hpp
/// \brief Schedules for training with large mini-batches: epochs as well as steps, learning-rate
/// warm-up and decay, damping ramps, stale-Fisher intervals that start after a fresh phase, and
/// the KL-clip bound for a batch size.
///
/// Every schedule here is a pure function of the optimizer step (0-based), the step the
/// Preconditioner counts and saves in its checkpoints: a run restored at step k evaluates the
/// same function at k, k + 1, ... and so continues the schedule it left. Each returns a
/// `std::function` that a kfac::Hyperparameter accepts as it is.
///
/// References: Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
/// (linear scaling of the learning rate with the batch, linear warm-up from the small-batch
/// rate); Osawa et al. 2019, "Large-Scale Distributed Second-Order Optimization Using
/// Kronecker-Factored Approximate Curvature for Deep Convolutional Neural Networks" (CVPR;
/// polynomial learning-rate decay after a short constant phase, Fisher statistics every step
/// early in training and less often once they settle).

#include <cmath>
#include <functional>
#include <string>
#include <utility>

#include "kfac/core/options.hpp"
#include "kfac/error.hpp"

namespace kfac {
namespace schedules {

/// \brief Converts between epochs and optimizer steps for a fixed number of steps per epoch.
///
/// Epoch e (a real number) begins at step round(e * steps_per_epoch); step s lies in epoch
/// s / steps_per_epoch.
class EpochClock {
 public:
  /// \param steps_per_epoch [in] optimizer steps in one pass over the training set (>= 1)
  explicit EpochClock(long steps_per_epoch) : steps_(steps_per_epoch) {
    if (steps_per_epoch < 1)
      throw Error("", "EpochClock: steps_per_epoch = " + std::to_string(steps_per_epoch) + ": expected >= 1");
  }
  long steps_per_epoch() const { return steps_; }
  /// \brief The first step of (fractional) epoch `epochs` (>= 0).
  long step_at(double epochs) const {
    if (!(epochs >= 0) || !std::isfinite(epochs))
      throw Error("", "EpochClock: epochs = " + std::to_string(epochs) + ": expected a finite value >= 0");
    return std::lround(epochs * double(steps_));
  }
  /// \brief The (fractional) epoch that step `step` lies in.
  double epoch_of(long step) const { return double(step) / double(steps_); }

 private:
  long steps_;
};

namespace impl_check {
inline void finite(const char* who, const char* what, double v, bool positive) {
  if (!std::isfinite(v) || (positive ? !(v > 0) : !(v >= 0)))
    throw Error("", std::string(who) + ": " + what + " = " + std::to_string(v) + ": expected a finite value " +
                        (positive ? "> 0" : ">= 0"));
}
}  // namespace impl_check

/// \brief Linear scaling rule (Goyal et al. 2017): the learning rate for `batch` given the one
/// tuned at `reference_batch`, \f$\eta \cdot B / B_{ref}\f$.
inline double linear_scaling(double lr, long reference_batch, long batch) {
  impl_check::finite("linear_scaling", "lr", lr, true);
  if (reference_batch < 1 || batch < 1) throw Error("", "linear_scaling: expected batch sizes >= 1");
  return lr * double(batch) / double(reference_batch);
}

/// \brief Linear warm-up into another schedule: `from` at step 0, rising linearly to
/// `then(warmup_steps)` at step `warmup_steps`, and `then(s)` from there on:
/// \f$v(s) = v_0 + (\mathrm{then}(W) - v_0)\, s / W\f$ for \f$s < W\f$.
/// `warmup_steps` = 0 gives `then` unchanged.
inline std::function<double(long)> linear_warmup(double from, long warmup_steps, std::function<double(long)> then) {
  impl_check::finite("linear_warmup", "from", from, false);
  if (warmup_steps < 0) throw Error("", "linear_warmup: warmup_steps = " + std::to_string(warmup_steps) + ": expected >= 0");
  if (!then) throw Error("", "linear_warmup: the schedule after the warm-up is empty");
  const double to = then(warmup_steps);
  return [from, warmup_steps, to, then = std::move(then)](long s) {
    if (s >= warmup_steps) return then(s);
    return from + (to - from) * (double(s) / double(warmup_steps));
  };
}

/// \brief Polynomial decay, the learning-rate plan of Osawa et al. 2019: `value` before step
/// `start`, then \f$v_{end} + (v - v_{end})(1 - (s - s_0)/(s_1 - s_0))^p\f$ until step `end`,
/// and `final_value` from `end` on. Power 1 is a linear decay.
inline std::function<double(long)> polynomial_decay(double value, long start, long end, double power,
                                                    double final_value = 0.0) {
  impl_check::finite("polynomial_decay", "value", value, false);
  impl_check::finite("polynomial_decay", "power", power, true);
  impl_check::finite("polynomial_decay", "final_value", final_value, false);
  if (start < 0 || end <= start)
    throw Error("", "polynomial_decay: start = " + std::to_string(start) + ", end = " + std::to_string(end) +
                        ": expected 0 <= start < end");
  return [=](long s) {
    if (s < start) return value;
    if (s >= end) return final_value;
    const double left = 1.0 - double(s - start) / double(end - start);
    return final_value + (value - final_value) * std::pow(left, power);
  };
}

/// \brief Geometric ramp between two positive values: `from` up to step `start`, `to` from step
/// `end` on, \f$v_0 (v_1 / v_0)^{(s - s_0)/(s_1 - s_0)}\f$ in between. For damping: a large value
/// while the factors are young (a step close to SGD's), decaying to the tuned one.
inline std::function<double(long)> geometric_ramp(double from, double to, long start, long end) {
  impl_check::finite("geometric_ramp", "from", from, true);
  impl_check::finite("geometric_ramp", "to", to, true);
  if (start < 0 || end < start)
    throw Error("", "geometric_ramp: start = " + std::to_string(start) + ", end = " + std::to_string(end) +
                        ": expected 0 <= start <= end");
  return [=](long s) {
    if (s <= start) return s < end ? from : to;
    if (s >= end) return to;
    return from * std::pow(to / from, double(s - start) / double(end - start));
  };
}

/// \brief Stale-Fisher intervals after a fresh phase (Osawa et al. 2019): `first` for the steps
/// before `hold`; from step `hold` on the interval is 2 first, doubling every `double_every`
/// steps, and never above `max_interval`:
/// \f$\min(i_{max},\ i_0 \cdot 2^{1 + \lfloor (s - h)/d \rfloor})\f$ for \f$s \ge h\f$.
/// Usable for factor_update_steps and inv_update_steps alike.
inline std::function<long(long)> stale_fisher_after(long hold, long first, long max_interval, long double_every) {
  if (hold < 0 || first < 1 || max_interval < first || double_every < 1)
    throw Error("", "stale_fisher_after: expected hold >= 0, 1 <= first <= max_interval and double_every >= 1");
  return [=](long s) {
    if (s < hold) return first;
    long interval = first;
    for (long doublings = 1 + (s - hold) / double_every; doublings > 0 && interval < max_interval; --doublings)
      interval = interval > max_interval / 2 ? max_interval : 2 * interval;  // no overflow near LONG_MAX
    return interval;
  };
}

/// \brief The KL-clip bound for `batch` given the one tuned at `reference_batch`:
/// \f$\kappa (B / B_{ref})^q\f$.
///
/// What the clip does to the step: K-FAC's update is \f$\nu \eta V\f$ with
/// \f$\nu = \min(1, \sqrt{\kappa / (\eta^2 \langle V, \nabla \rangle)})\f$, so when it binds the
/// step's squared Fisher norm is \f$\kappa\f$ whatever the learning rate. Under the linear
/// scaling rule \f$\eta \propto B\f$ while \f$\langle V, \nabla\rangle\f$ falls like 1/B where the
/// gradient's sampling noise dominates it (small batches, many parameters) and stays put where
/// the mean gradient does. A fixed \f$\kappa\f$ therefore binds more and more often as the batch
/// grows, until the clip alone sets every step and the learning rate (and its warm-up and decay)
/// stops mattering. q = 1 keeps the clip binding as often as at the reference batch in the
/// noise-dominated regime, q = 2 in the mean-dominated one.
inline double kl_clip_for_batch(double kl_clip, long reference_batch, long batch, double power = 1.0) {
  impl_check::finite("kl_clip_for_batch", "kl_clip", kl_clip, false);
  impl_check::finite("kl_clip_for_batch", "power", power, false);
  if (reference_batch < 1 || batch < 1) throw Error("", "kl_clip_for_batch: expected batch sizes >= 1");
  return kl_clip * std::pow(double(batch) / double(reference_batch), power);
}

}  // namespace schedules
}  // namespace kfac
