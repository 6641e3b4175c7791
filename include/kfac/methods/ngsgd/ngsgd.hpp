#pragma once
/// \file ngsgd.hpp
/// \brief Kaldi's online natural gradient (NG-SGD) as a method object: Povey, Zhang &
/// Khudanpur (2014), "Parallel training of DNNs with natural gradient and parameter averaging"
/// (arXiv:1410.7455), section 3 and appendix C; Kaldi's nnet3 OnlineNaturalGradient.

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "kfac/core/method_settings.hpp"
#include "kfac/methods/ngsgd/ngsgd_block.hpp"

namespace kfac {

/// \brief Online natural gradient for a Dense or Conv2d layer: the gradient X is replaced by
/// \f$\gamma \hat F_{out}^{-1} X \hat F_{in}^{-1}\f$, each \f$\hat F\f$ a smoothed online estimate
/// \f$R^T D R + \rho I\f$ of the covariance of the input rows (with the bias column) or of the
/// output-gradient rows, and \f$\gamma\f$ the scale that keeps \f$\|X\|_F\f$ (see
/// online_fisher.hpp for the recurrence, ngsgd_block.hpp for the block, docs/ngsgd.md).
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | long | rank_in | rank r of the input-side estimate, 0 <= r < in + bias | min(20, (in + 1)/2), at most in + bias - 1 |
/// | long | rank_out | rank of the output-side estimate, 0 <= r < out | min(80, (out + 1)/2), at most out - 1 |
/// | long | update_period | steps between updates of the estimates after the first initial_updates (>= 1) | 4 |
/// | long | initial_updates | the first steps, each of which updates (Kaldi: its 10 initial updates after the first call, so 11; 0 or 1: steps 0, P, 2P, ..., kfac before 2026-12-03) | 11 |
/// | long | init_iterations | recurrence steps on the first minibatch before the first update (>= 0); 0: Kaldi's 1 when a side's first minibatch has <= rank rows, else 3 | 0 |
/// | double | symmetry_breaker | first entry of each row of the starting basis before normalising (others 1); 1: equal entries (kfac before 2026-12-03), which keeps the all-ones vector in the start subspace | 1.1 |
/// | double | num_samples_history | samples the estimate remembers: a minibatch of N samples has weight \f$\eta = \min(\eta_{cap}, 1 - e^{-N/h})\f$ (> 0) | 2000 |
/// | double | eta_cap | upper bound of \f$\eta\f$, in (0, 1]; 1: no cap | 0.9 |
/// | double | alpha | smoothing towards the identity: \f$\hat F = F + \frac{\alpha}{D}\mathrm{tr}(F) I\f$ (>= 0) | 4 |
/// | double | epsilon | absolute floor of \f$\rho\f$ and of each \f$d_i\f$ (> 0) | 1e-10 |
/// | double | delta | relative floor: \f$\rho, d_i \ge \delta \max_j \sqrt{c_j}\f$, in (0, 1) | 5e-4 |
/// | bool | relative_d_floor | floor d at \f$\max(\epsilon, \delta \max_j \sqrt{c_j})\f$ as Kaldi; false: at \f$\epsilon\f$ only | true |
///
/// The defaults are Kaldi's (natural-gradient-online.cc); with_legacy_defaults() restores
/// kfac's choices before 2026-12-03. The schedule is the layer's statistics interval: the
/// constructor, with_update_period and with_initial_updates set the per-layer override
/// factor_update_steps to \f$s \mapsto (s + 1 < n_{init}) ? 1 : P\f$, which updates at steps
/// 0, 1, ..., 10, 10 + P, 10 + 2P, ... (Kaldi's Updating(): \f$t \le 10\f$ or \f$(t - 10) \bmod P = 0\f$),
/// so the Preconditioner asks for observations only on update steps (wants_observations()).
/// Steps are the Preconditioner's, so register NG-SGD layers before the first step (Kaldi
/// counts each component's calls). A later with_factor_update_steps replaces the schedule.
/// Damping, factor decay and the
/// decomposition interval of Options do not apply to NG-SGD layers. KL clipping does: see
/// docs/ngsgd.md (kl_clip 0 is recommended when only NG-SGD layers are registered).
/// Settings out of range throw kfac::Error naming the layer at registration.
///
/// \code
/// pre.register_layer("fc1", kfac::Dense(784, 256), kfac::NGSGD{}.with_rank_in(30).with_update_period(2));
/// \endcode
struct NGSGD : impl::LayerOverrides<NGSGD> {
  using method_tag = void;
  static constexpr const char* name = "ngsgd";

  std::optional<long> rank_in, rank_out;  ///< unset: the defaults of the table
  long update_period = 4, initial_updates = 11, init_iterations = 0;
  double num_samples_history = 2000, alpha = 4, epsilon = 1e-10, delta = 5e-4;
  double eta_cap = 0.9, symmetry_breaker = 1.1;
  bool relative_d_floor = true;

  NGSGD() { reschedule(); }

  NGSGD& with_rank_in(long r) { rank_in = r; return *this; }
  NGSGD& with_rank_out(long r) { rank_out = r; return *this; }
  /// Both ranks.
  NGSGD& with_rank(long r) { rank_in = rank_out = r; return *this; }
  NGSGD& with_update_period(long p) {
    update_period = p;
    return reschedule();
  }
  NGSGD& with_initial_updates(long n) {
    initial_updates = n;
    return reschedule();
  }
  NGSGD& with_init_iterations(long n) { init_iterations = n; return *this; }
  NGSGD& with_symmetry_breaker(double first) { symmetry_breaker = first; return *this; }
  NGSGD& with_eta_cap(double cap) { eta_cap = cap; return *this; }
  NGSGD& with_relative_d_floor(bool on) { relative_d_floor = on; return *this; }
  /// \brief kfac's NG-SGD before 2026-12-03 (docs/ngsgd.md, "Kaldi's behaviour and the former
  /// one"): equal-entries start, three initialisation iterations always, no cap on eta, d
  /// floored at epsilon only, updates at steps 0, P, 2P, ...
  NGSGD& with_legacy_defaults() {
    symmetry_breaker = 1;
    init_iterations = 3;
    eta_cap = 1;
    relative_d_floor = false;
    return with_initial_updates(0);
  }
  NGSGD& with_num_samples_history(double h) { num_samples_history = h; return *this; }
  NGSGD& with_alpha(double a) { alpha = a; return *this; }
  NGSGD& with_epsilon(double e) { epsilon = e; return *this; }
  NGSGD& with_delta(double d) { delta = d; return *this; }

  template <class LayerType>
  static constexpr bool accepts = LayerType::is_kronecker;

  template <class LayerType, class Scalar, class Exec>
  using block_type = NGSGDBlock<LayerType, Scalar, Exec>;

  /// The settings for `layer`, defaults resolved (Kaldi's, clamped below the dimension).
  template <class LayerType>
  NGSGDSettings settings_for(const LayerType& layer) const {
    NGSGDSettings s;
    const long in = long(layer.weight_cols()), out = long(layer.weight_rows());
    s.rank_in = rank_in ? *rank_in : std::max(0L, std::min({20L, (in + 1) / 2, long(layer.a_dim()) - 1}));
    s.rank_out = rank_out ? *rank_out : std::max(0L, std::min({80L, (out + 1) / 2, out - 1}));
    s.update_period = update_period;
    s.initial_updates = initial_updates;
    s.init_iterations = init_iterations;
    s.symmetry_breaker = symmetry_breaker;
    s.recurrence = {num_samples_history, alpha, epsilon, delta, eta_cap, relative_d_floor};
    return s;
  }

  template <class Scalar, class Exec, class LayerType>
  std::unique_ptr<impl::Block<Scalar, Exec>> make_block(const std::string& layer_name,
                                                       const LayerType& layer) const {
    return std::make_unique<block_type<LayerType, Scalar, Exec>>(layer_name, layer, settings_for(layer));
  }

 private:
  /// Kaldi's schedule as the layer's statistics interval (see the table).
  NGSGD& reschedule() {
    const long n = initial_updates, p = update_period;
    factor_update_steps = Hyperparameter<long>([n, p](long step) { return step + 1 < n ? 1L : p; });
    return *this;
  }
};

}  // namespace kfac
