#pragma once
/// \file adaptive.hpp
/// \brief `kfac::Adaptive`, the settings of self-tuning K-FAC (Martens & Grosse 2015, sections 6.5
/// and 7): Levenberg-Marquardt adaptation of the damping \f$\lambda\f$ and the step size
/// \f$\alpha\f$ and momentum \f$\mu\f$ that minimise the quadratic model with the exact curvature.
/// The object that holds the state and runs the protocol is kfac::SelfTuning (self_tuning.hpp);
/// the protocol is described in docs/self_tuning.md.

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "kfac/core/options.hpp"
#include "kfac/error.hpp"

namespace kfac {

/// \brief The curvature of the host's loss with respect to its network's outputs (the matrix
/// \f$H_L\f$ of the generalised Gauss-Newton matrix \f$J^T H_L J\f$), per sample.
///
/// `softmax_cross_entropy`: outputs are logits z, \f$p = \mathrm{softmax}(z)\f$,
/// \f$H_L = \mathrm{diag}(p) - p p^T\f$ (also the Fisher of the categorical distribution).
/// `squared_error`: the per-sample loss \f$\frac12 \|y - t\|^2\f$ (a loss without the \f$\frac12\f$
/// gives `OutputProducts::loss_scale` = 2), \f$H_L = I\f$; outputs are not read.
/// `sigmoid_cross_entropy`: outputs are logits of independent Bernoulli outputs,
/// \f$H_L = \mathrm{diag}(p (1 - p))\f$ with \f$p = \sigma(z)\f$.
enum class LossCurvature { softmax_cross_entropy, squared_error, sigmoid_cross_entropy };

/// \brief The name of a LossCurvature, as errors and settings texts print it.
inline const char* to_string(LossCurvature c) {
  switch (c) {
    case LossCurvature::softmax_cross_entropy:
      return "softmax_cross_entropy";
    case LossCurvature::squared_error:
      return "squared_error";
    case LossCurvature::sigmoid_cross_entropy:
      return "sigmoid_cross_entropy";
  }
  return "unknown";
}

/// \brief Settings of self-tuning K-FAC, built with `with_*` calls; kfac::SelfTuning holds them.
///
/// The damping \f$\lambda\f$ is adapted by the Levenberg-Marquardt rule of Martens & Grosse
/// (2015, section 6.5): after every `update_interval` (\f$T_1\f$) solves, the reduction ratio
/// \f$\rho = (h(\theta + \delta) - h(\theta)) / M(\delta)\f$ of the last step multiplies
/// \f$\lambda\f$ by \f$\omega_1 = \mathrm{damping\_decay}^{T_1}\f$ when \f$\rho >\f$
/// `upper_threshold` and divides it by \f$\omega_1\f$ when \f$\rho <\f$ `lower_threshold`,
/// then clips it to [`min_damping`, `max_damping`]. The preconditioner's damping is tied to it:
/// kfac::SelfTuning::damping() gives \f$\lambda + \eta\f$, i.e. the factored Tikhonov damping
/// \f$\gamma = \sqrt{\lambda + \eta}\f$ of the paper's section 6.3 (kfac's damping is
/// \f$\gamma^2\f$; the paper's separate adaptation of \f$\gamma\f$, section 6.6, is not done).
///
/// `min_damping` defaults to 1e-4, not to a negligible value: the reduction ratio is measured on
/// the step's own batch, where the model predicts well (\f$\rho \approx 1\f$), so the rule lowers
/// \f$\lambda\f$ at nearly every update; at 1e-8 the preconditioner is then nearly undamped, the
/// proposal grows along directions the batch's curvature does not see, and training diverged
/// after a few epochs on the MLP demo (docs/self_tuning.md, "The damping's lower bound").
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | double | initial_damping | \f$\lambda_0\f$ | 0.001 |
/// | double | min_damping | lower bound of \f$\lambda\f$ | 1e-4 |
/// | double | max_damping | upper bound of \f$\lambda\f$ (may be infinite) | inf |
/// | long | update_interval | \f$T_1\f$: solves between two damping updates | 5 |
/// | double | damping_decay | \f$\omega_1^{1/T_1}\f$: the factor per step | 0.95 |
/// | double | lower_threshold | \f$\rho\f$ below it raises \f$\lambda\f$ | 0.25 |
/// | double | upper_threshold | \f$\rho\f$ above it lowers \f$\lambda\f$ | 0.75 |
/// | double | weight_decay | \f$\eta\f$: the \f$\ell_2\f$ coefficient the host's gradient includes | 0 |
/// | bool | use_momentum | solve for \f$\mu\f$ (off: \f$\mu = 0\f$) | true |
/// | bool | adapt_damping | run the Levenberg-Marquardt rule (off: \f$\lambda\f$ stays) | true |
/// | bool | rho_includes_damping | \f$\rho\f$'s \f$M\f$ has \f$\frac12\lambda\|\delta\|^2\f$ (the paper's) | true |
/// | long | solve_interval | steps per solve: products every k steps, apply_last() between | 1 (the paper's) |
/// | long | solve_warmup | with solve_interval > 1: the first solves, taken every step | 10 |
struct Adaptive {
  double initial_damping = 1e-3;
  double min_damping = 1e-4;
  double max_damping = std::numeric_limits<double>::infinity();
  long update_interval = 5;
  double damping_decay = 0.95;
  double lower_threshold = 0.25;
  double upper_threshold = 0.75;
  double weight_decay = 0.0;
  bool use_momentum = true;
  bool adapt_damping = true;
  bool rho_includes_damping = true;
  long solve_interval = 1;
  long solve_warmup = 10;

  /// \brief Sets \f$\lambda_0\f$. \param v [in] finite, > 0
  Adaptive& with_initial_damping(double v) {
    initial_damping = v;
    return *this;
  }
  /// \brief Sets the bounds of \f$\lambda\f$. \param lo [in] >= 0 \param hi [in] >= lo (may be infinite)
  Adaptive& with_damping_bounds(double lo, double hi) {
    min_damping = lo;
    max_damping = hi;
    return *this;
  }
  /// \brief Sets \f$T_1\f$. \param v [in] >= 1
  Adaptive& with_update_interval(long v) {
    update_interval = v;
    return *this;
  }
  /// \brief Sets the per-step factor (\f$\omega_1\f$ is its \f$T_1\f$-th power). \param v [in] in (0, 1)
  Adaptive& with_damping_decay(double v) {
    damping_decay = v;
    return *this;
  }
  /// \brief Sets the thresholds of \f$\rho\f$. \param lo [in] lower \param hi [in] upper, > lo
  Adaptive& with_thresholds(double lo, double hi) {
    lower_threshold = lo;
    upper_threshold = hi;
    return *this;
  }
  /// \brief Sets \f$\eta\f$. \param v [in] finite, >= 0
  Adaptive& with_weight_decay(double v) {
    weight_decay = v;
    return *this;
  }
  /// \brief Solves for the momentum \f$\mu\f$ too, or not. \param on [in] true: \f$\alpha\f$ and \f$\mu\f$
  Adaptive& with_momentum(bool on) {
    use_momentum = on;
    return *this;
  }
  /// \brief Runs the Levenberg-Marquardt rule, or keeps \f$\lambda_0\f$. \param on [in] true: adapt
  Adaptive& with_damping_adaptation(bool on) {
    adapt_damping = on;
    return *this;
  }
  /// \brief Whether \f$\rho\f$'s model includes the damping term. \param on [in] true: the paper's
  Adaptive& with_rho_including_damping(bool on) {
    rho_includes_damping = on;
    return *this;
  }

  /// \brief Solves the model every `v` steps after the warm-up and in between applies the solves'
  /// weighted means of \f$\alpha, \mu\f$ (SelfTuning::apply_last): the products, the host's
  /// dearest part of a step, every `v` steps.
  /// \param v [in] >= 1 (1: every step)
  Adaptive& with_solve_interval(long v) {
    solve_interval = v;
    return *this;
  }
  /// \brief With solve_interval > 1: the first `v` steps solve (the reused \f$\alpha, \mu\f$ are
  /// the mean of the solves after the first, so they need some). \param v [in] >= 2
  Adaptive& with_solve_warmup(long v) {
    solve_warmup = v;
    return *this;
  }

  /// \brief \f$\omega_1 = \mathrm{damping\_decay}^{T_1}\f$.
  double omega() const { return std::pow(damping_decay, double(update_interval)); }

  /// \brief Throws kfac::Error naming the first setting out of its range.
  void validate() const {
    const auto bad = [](const char* name, double v, const char* expected) {
      std::ostringstream os;
      os.precision(17);
      os << "Adaptive::" << name << " = " << v << ": expected " << expected;
      throw Error("", os.str());
    };
    if (!(min_damping >= 0) || !std::isfinite(min_damping)) bad("min_damping", min_damping, "a finite value >= 0");
    if (!(max_damping >= min_damping)) bad("max_damping", max_damping, "a value >= min_damping");
    if (!(initial_damping > 0) || !std::isfinite(initial_damping))
      bad("initial_damping", initial_damping, "a finite value > 0");
    if (!(initial_damping >= min_damping && initial_damping <= max_damping))
      bad("initial_damping", initial_damping, "a value in [min_damping, max_damping]");
    if (update_interval < 1) bad("update_interval", double(update_interval), "an interval >= 1");
    if (!(damping_decay > 0 && damping_decay < 1)) bad("damping_decay", damping_decay, "a value in (0, 1)");
    if (!std::isfinite(lower_threshold)) bad("lower_threshold", lower_threshold, "a finite value");
    if (!(upper_threshold > lower_threshold) || !std::isfinite(upper_threshold))
      bad("upper_threshold", upper_threshold, "a finite value > lower_threshold");
    if (!(weight_decay >= 0) || !std::isfinite(weight_decay)) bad("weight_decay", weight_decay, "a finite value >= 0");
    if (solve_interval < 1) bad("solve_interval", double(solve_interval), "an interval >= 1");
    if (solve_warmup < 2) bad("solve_warmup", double(solve_warmup), "a count >= 2 (the first solve is not reused)");
  }

  /// \brief The settings as `name=value` lines (checkpoints compare them).
  std::string describe() const {
    std::ostringstream os;
    os.precision(17);
    os << "initial_damping=" << initial_damping << "\nmin_damping=" << min_damping << "\nmax_damping=" << max_damping
       << "\nupdate_interval=" << update_interval << "\ndamping_decay=" << damping_decay
       << "\nlower_threshold=" << lower_threshold << "\nupper_threshold=" << upper_threshold
       << "\nweight_decay=" << weight_decay << "\nuse_momentum=" << use_momentum << "\nadapt_damping=" << adapt_damping
       << "\nrho_includes_damping=" << rho_includes_damping << "\nsolve_interval=" << solve_interval
       << "\nsolve_warmup=" << solve_warmup << "\n";
    return os.str();
  }
};

/// \brief What one kfac::SelfTuning::solve() chose and predicted. The update is
/// \f$\delta = \alpha\Delta + \mu\delta_0\f$; the model's change splits into its three terms,
/// \f$M(\delta) = \f$ `linear_term` + `curvature_term` + `damping_term`.
struct AdaptiveStep {
  double alpha = 0;           ///< the step size \f$\alpha\f$
  double mu = 0;              ///< the momentum \f$\mu\f$ (0 on the first solve, or without momentum)
  bool momentum = false;      ///< true when \f$\mu\f$ was solved for (a 2x2 system)
  double linear_term = 0;     ///< \f$\nabla h^T \delta\f$
  double curvature_term = 0;  ///< \f$\frac12 \delta^T (F + \eta I) \delta\f$, F the exact curvature
  double damping_term = 0;    ///< \f$\frac12 \lambda \|\delta\|^2\f$
  double predicted = 0;       ///< the model change \f$\rho\f$ divides by (Adaptive::rho_includes_damping)
  double damping = 0;         ///< \f$\lambda\f$ the solve used
};

/// \brief What one kfac::SelfTuning::update_damping() did.
struct DampingUpdate {
  double rho = 0;             ///< the reduction ratio (NaN when the model predicted no change)
  double loss_change = 0;     ///< \f$h(\theta + \delta) - h(\theta)\f$, averaged over the ranks
  double damping_before = 0;  ///< \f$\lambda\f$ before
  double damping = 0;         ///< \f$\lambda\f$ after
};

}  // namespace kfac
