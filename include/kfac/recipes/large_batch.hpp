#pragma once
/// \file large_batch.hpp
/// \brief A recipe for K-FAC at large mini-batches after Osawa et al. 2019 ("Large-Scale
/// Distributed Second-Order Optimization Using Kronecker-Factored Approximate Curvature for
/// Deep Convolutional Neural Networks", CVPR): the learning rate scaled with the batch and
/// warmed up, then decayed polynomially (or in steps); damping that starts higher by the batch's scale (at most 10x) and decays;
/// Fisher statistics and decompositions every step in the first epoch, then at intervals that
/// double every epoch up to a cap; and a KL-clip bound scaled with the batch.
///
/// What differs from Osawa et al.: they warm up only at their largest batches and start their
/// decay at epoch 1-1.5 with powers 3.5-11 over 35-50 epochs (their chainerkfac configurations);
/// here the warm-up always runs (it is a no-op at the reference batch) and the decay runs from
/// the warm-up's end to the end of training with power 2 by default, for runs of a few epochs.
/// Their stale-Fisher intervals adapt to how much the factors changed; these follow a fixed
/// doubling, which needs no extra statistic and is the same on every rank by construction.
/// They use no KL clip (their momentum and weight rescaling bound the step instead); here the
/// clip stays, with a bound scaled with the batch (schedules::kl_clip_for_batch).
///
/// Every part is a schedule of kfac/recipes/schedules.hpp, a pure function of the step, so a
/// preconditioner restored from a checkpoint (which saves the step count) continues it.

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>

#include "kfac/core/options.hpp"
#include "kfac/error.hpp"
#include "kfac/recipes/schedules.hpp"

namespace kfac {
namespace recipes {

/// \brief The settings of the large-batch recipe, built with `with_*` calls; options() puts
/// them into kfac::Options, and each schedule is also available alone.
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | long | batch | samples per step over all ranks | (constructor) |
/// | long | steps_per_epoch | optimizer steps per epoch | (constructor) |
/// | double | epochs | length of training, in epochs (the decay ends there) | (constructor) |
/// | long | reference_batch | the batch `lr` and `kl_clip` were tuned at | 256 |
/// | double | lr | learning rate at the reference batch (scaled by batch / reference_batch) | 0.1 |
/// | double | warmup_epochs | linear warm-up from lr to the scaled rate | 0.25 |
/// | double | decay_power | polynomial decay power from the warm-up's end to `epochs` (unless step decay is on) | 2 |
/// | double | final_lr_fraction | the decayed rate at `epochs`, as a fraction of the scaled rate | 0.01 |
/// | double | step_decay_factor, step_decay_epochs | step decay: rate times factor every this many epochs after the warm-up | 0.1, 0 (off) |
/// | double | damping | damping after the ramp | 0.01 |
/// | double | damping_start | damping at step 0, decaying geometrically to `damping`; 0: damping x min(10, batch / reference_batch), i.e. no ramp at the reference batch | 0 |
/// | double | damping_epochs | length of the damping ramp | 1 |
/// | double | kl_clip | KL-clip bound at the reference batch (0: no clip) | 0.01 |
/// | double | kl_clip_power | q in kappa (batch / reference_batch)^q | 1 |
/// | double | fresh_epochs | factors and decompositions every step for this long | 1 |
/// | double | double_every_epochs | then the interval doubles this often | 1 |
/// | double | max_interval_epochs | and is capped at this many epochs' steps (at least 1 step) | 0.5 |
/// | long | inv_per_factor | decomposition interval = this x the factor interval | 1 |
struct LargeBatch {
  long batch = 0;
  long steps_per_epoch = 0;
  double epochs = 0;
  long reference_batch = 256;
  double lr = 0.1;
  double warmup_epochs = 0.25;
  double decay_power = 2.0;
  double final_lr_fraction = 0.01;
  double step_decay_factor = 0.1;
  double step_decay_epochs = 0.0;
  double damping = 0.01;
  double damping_start = 0.0;
  double damping_epochs = 1.0;
  double kl_clip = 0.01;
  double kl_clip_power = 1.0;
  double fresh_epochs = 1.0;
  double double_every_epochs = 1.0;
  double max_interval_epochs = 0.5;
  long inv_per_factor = 1;

  /// Each `with_*` call checks its arguments (and the recipe they make, check()) and leaves the
  /// recipe as it was when it throws.
  LargeBatch& with_reference_batch(long b) {
    return set("with_reference_batch", [&](LargeBatch& r) { r.reference_batch = b; });
  }
  LargeBatch& with_lr(double v) { return set("with_lr", [&](LargeBatch& r) { r.lr = v; }); }
  LargeBatch& with_warmup_epochs(double e) {
    return set("with_warmup_epochs", [&](LargeBatch& r) { r.warmup_epochs = e; });
  }
  /// \brief Polynomial decay with this power to `final_fraction` of the scaled rate (the default plan).
  LargeBatch& with_polynomial_decay(double power, double final_fraction = 0.01) {
    if (!(power >= 0) || !std::isfinite(power))
      refuse("with_polynomial_decay: power = " + std::to_string(power) + ": expected a finite value >= 0");
    return set("with_polynomial_decay", [&](LargeBatch& r) {
      r.decay_power = power;
      r.final_lr_fraction = final_fraction;
      r.step_decay_epochs = 0;
    });
  }
  /// \brief Step decay instead: the rate times `factor` every `every_epochs` (> 0) after the warm-up.
  LargeBatch& with_step_decay(double factor, double every_epochs) {
    if (!(every_epochs > 0) || !std::isfinite(every_epochs))
      refuse("with_step_decay: every_epochs = " + std::to_string(every_epochs) +
             ": expected a finite number of epochs > 0 (with_polynomial_decay selects the other plan)");
    return set("with_step_decay", [&](LargeBatch& r) {
      r.step_decay_factor = factor;
      r.step_decay_epochs = every_epochs;
    });
  }
  /// \brief Damping `value` after the ramp (see damping_start).
  LargeBatch& with_damping(double value) { return set("with_damping", [&](LargeBatch& r) { r.damping = value; }); }
  LargeBatch& with_damping_ramp(double start_value, double over_epochs) {
    return set("with_damping_ramp", [&](LargeBatch& r) {
      r.damping_start = start_value;
      r.damping_epochs = over_epochs;
    });
  }
  LargeBatch& with_kl_clip(double value, double power = 1.0) {
    return set("with_kl_clip", [&](LargeBatch& r) {
      r.kl_clip = value;
      r.kl_clip_power = power;
    });
  }
  LargeBatch& with_stale_fisher(double fresh, double double_every, double max_interval) {
    return set("with_stale_fisher", [&](LargeBatch& r) {
      r.fresh_epochs = fresh;
      r.double_every_epochs = double_every;
      r.max_interval_epochs = max_interval;
    });
  }
  LargeBatch& with_inv_per_factor(long k) {
    return set("with_inv_per_factor", [&](LargeBatch& r) { r.inv_per_factor = k; });
  }

  /// \brief The clock of this run (steps_per_epoch).
  schedules::EpochClock clock() const { return schedules::EpochClock(steps_per_epoch); }
  /// \brief The peak learning rate: lr scaled linearly with the batch.
  double scaled_lr() const { return schedules::linear_scaling(lr, reference_batch, batch); }

  /// \brief The learning-rate schedule for a rate `base` tuned at the reference batch: linear
  /// warm-up from `base` to base x batch / reference_batch, then the decay. With base = lr it
  /// is K-FAC's; an SGD or Adam run gets the same plan around its own base (the fair
  /// first-order counterpart, Goyal et al.'s rule).
  std::function<double(long)> lr_schedule(double base) const {
    check();
    const auto c = clock();
    const double peak = schedules::linear_scaling(base, reference_batch, batch);
    const long warm = c.step_at(warmup_epochs), end = c.step_at(epochs);
    std::function<double(long)> decay;
    if (step_decay_epochs > 0) {
      const long every = std::max(1L, c.step_at(step_decay_epochs));
      decay = [peak, warm, every, factor = step_decay_factor](long s) {
        return peak * std::pow(factor, double(s < warm ? 0 : (s - warm) / every));
      };
    } else {
      decay = schedules::polynomial_decay(peak, warm, std::max(end, warm + 1), decay_power, final_lr_fraction * peak);
    }
    return schedules::linear_warmup(base, warm, std::move(decay));
  }
  /// \brief K-FAC's learning rate (Options::lr, and the rate its SGD step must use).
  std::function<double(long)> lr_schedule() const { return lr_schedule(lr); }
  std::function<double(long)> damping_schedule() const {
    check();
    return schedules::geometric_ramp(initial_damping(), damping, 0, clock().step_at(damping_epochs));
  }
  /// \brief The damping at step 0: damping_start, or by default damping times the batch's scale
  /// over the reference batch, at most 10. Large steps on young factors are what the ramp
  /// guards against, and they come with the scaled learning rate: at the reference batch
  /// there is no ramp.
  double initial_damping() const {
    if (damping_start > 0) return damping_start;
    return damping * std::min(10.0, std::max(1.0, double(batch) / double(reference_batch)));
  }
  double scaled_kl_clip() const { return schedules::kl_clip_for_batch(kl_clip, reference_batch, batch, kl_clip_power); }
  std::function<long(long)> factor_intervals() const {
    check();
    const auto c = clock();
    const long cap = std::max(1L, c.step_at(max_interval_epochs));
    return schedules::stale_fisher_after(c.step_at(fresh_epochs), 1, cap, std::max(1L, c.step_at(double_every_epochs)));
  }
  std::function<long(long)> inv_intervals() const {
    auto f = factor_intervals();
    return [f = std::move(f), k = inv_per_factor](long s) { return k * f(s); };
  }

  /// \brief `base` with lr, damping, kl_clip and both update intervals set by the recipe (the
  /// rest, e.g. factor_decay or the distribution settings, as given).
  Options options(Options base = Options{}) const {
    return base.with_lr(lr_schedule())
        .with_damping(damping_schedule())
        .with_kl_clip(scaled_kl_clip())
        .with_factor_update_steps(factor_intervals())
        .with_inv_update_steps(inv_intervals());
  }

  /// \brief Throws kfac::Error naming the first setting out of range.
  void check() const {
    auto bad = [](const std::string& what) { throw Error("", "recipes::large_batch: " + what); };
    if (batch < 1 || reference_batch < 1) bad("batch sizes must be >= 1");
    if (steps_per_epoch < 1) bad("steps_per_epoch must be >= 1");
    if (!(epochs > 0) || !std::isfinite(epochs)) bad("epochs must be a finite value > 0");
    if (!(lr > 0) || !std::isfinite(lr)) bad("lr must be a finite value > 0");
    if (!(warmup_epochs >= 0) || !(warmup_epochs <= epochs)) bad("warmup_epochs must lie in [0, epochs]");
    if (!(final_lr_fraction > 0) || !(final_lr_fraction <= 1)) bad("final_lr_fraction must lie in (0, 1] (the rate stays > 0)");
    if (step_decay_epochs > 0 && !(step_decay_factor > 0 && step_decay_factor <= 1)) bad("step_decay_factor must lie in (0, 1]");
    if (!(decay_power >= 0) || !std::isfinite(decay_power)) bad("decay_power must be a finite value >= 0");
    if (!(step_decay_epochs >= 0) || !std::isfinite(step_decay_epochs)) bad("step_decay_epochs must be a finite value >= 0");
    if (!(damping > 0) || !(damping_start >= 0) || !std::isfinite(damping) || !std::isfinite(damping_start))
      bad("damping must be a finite value > 0 and damping_start a finite value >= 0");
    if (!(kl_clip >= 0) || !std::isfinite(kl_clip) || !std::isfinite(kl_clip_power))
      bad("kl_clip must be a finite value >= 0 and its power finite");
    const double lengths[] = {damping_epochs, fresh_epochs, double_every_epochs, max_interval_epochs};
    for (double e : lengths)
      if (!(e >= 0) || !std::isfinite(e)) bad("epoch lengths must be finite values >= 0 (double_every_epochs > 0)");
    if (!(double_every_epochs > 0)) bad("epoch lengths must be finite values >= 0 (double_every_epochs > 0)");
    if (inv_per_factor < 1) bad("inv_per_factor must be >= 1");
  }

 private:
  [[noreturn]] static void refuse(const std::string& what) { throw Error("", "recipes::large_batch: " + what); }
  /// Applies `change` to a copy, checks it, and only then keeps it.
  template <class F>
  LargeBatch& set(const char* call, F&& change) {
    LargeBatch next = *this;
    change(next);
    try {
      next.check();
    } catch (const Error& e) {
      refuse(std::string(call) + ": " + impl::bare_message(e).substr(std::string("recipes::large_batch: ").size()));
    }
    return *this = next;
  }
};

/// \brief The large-batch recipe for `batch` samples per step, `steps_per_epoch` steps per
/// epoch and `epochs` epochs of training, with the defaults of LargeBatch; adjust with its
/// `with_*` calls, then `options()`:
/// `kfac::Preconditioner<> pre(kfac::recipes::large_batch(4096, 14, 8).with_lr(0.1).options());`
inline LargeBatch large_batch(long batch, long steps_per_epoch, double epochs) {
  LargeBatch r;
  r.batch = batch;
  r.steps_per_epoch = steps_per_epoch;
  r.epochs = epochs;
  r.check();
  return r;
}

}  // namespace recipes
}  // namespace kfac
