#pragma once
/// \file ngsgd.hpp
/// \brief Kaldi's online natural gradient (NG-SGD) as a method object: Povey, Zhang &
/// Khudanpur (2014), "Parallel training of DNNs with natural gradient and parameter averaging"
/// (arXiv:1410.7455), section 3 and appendix C; Kaldi's nnet3 OnlineNaturalGradient.

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "kfac/methods/method_settings.hpp"
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
/// | long | update_period | minibatches between updates of the estimates (>= 1) | 4 |
/// | double | num_samples_history | samples the estimate remembers: a minibatch of N samples has weight \f$\eta = 1 - e^{-N/h}\f$ (> 0) | 2000 |
/// | double | alpha | smoothing towards the identity: \f$\hat F = F + \frac{\alpha}{D}\mathrm{tr}(F) I\f$ (>= 0) | 4 |
/// | double | epsilon | floor of \f$\rho\f$ and of each \f$d_i\f$ (> 0) | 1e-10 |
/// | double | delta | relative floor: \f$\rho \ge \delta \max_i (d_i + \rho)\f$, in (0, 1) | 5e-4 |
///
/// The update period is the layer's statistics interval: with_update_period(p) sets the
/// per-layer override factor_update_steps to p, so the Preconditioner asks for observations
/// only on update steps (wants_observations()), and every statistics update is one step of the
/// recurrence. A later with_factor_update_steps (e.g. a function of the step, to reproduce
/// Kaldi's ten initial every-minibatch updates) replaces it. Damping, factor decay and the
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
  long update_period = 4;
  double num_samples_history = 2000, alpha = 4, epsilon = 1e-10, delta = 5e-4;

  NGSGD() { factor_update_steps = Hyperparameter<long>(update_period); }

  NGSGD& with_rank_in(long r) { rank_in = r; return *this; }
  NGSGD& with_rank_out(long r) { rank_out = r; return *this; }
  /// Both ranks.
  NGSGD& with_rank(long r) { rank_in = rank_out = r; return *this; }
  NGSGD& with_update_period(long p) {
    update_period = p;
    factor_update_steps = Hyperparameter<long>(p);
    return *this;
  }
  NGSGD& with_num_samples_history(double h) { num_samples_history = h; return *this; }
  NGSGD& with_alpha(double a) { alpha = a; return *this; }
  NGSGD& with_epsilon(double e) { epsilon = e; return *this; }
  NGSGD& with_delta(double d) { delta = d; return *this; }

  template <class LayerType>
  static constexpr bool accepts = LayerType::is_kronecker;

  template <class LayerType, class Scalar, class Exec>
  using block_type = NGSGDLayer<LayerType, Scalar, Exec>;

  /// The settings for `layer`, defaults resolved (Kaldi's, clamped below the dimension).
  template <class LayerType>
  NGSGDSettings settings_for(const LayerType& layer) const {
    NGSGDSettings s;
    const long in = long(layer.weight_cols()), out = long(layer.weight_rows());
    s.rank_in = rank_in ? *rank_in : std::max(0L, std::min({20L, (in + 1) / 2, long(layer.a_dim()) - 1}));
    s.rank_out = rank_out ? *rank_out : std::max(0L, std::min({80L, (out + 1) / 2, out - 1}));
    s.update_period = update_period;
    s.recurrence = {num_samples_history, alpha, epsilon, delta};
    return s;
  }

  template <class Scalar, class Exec, class LayerType>
  std::unique_ptr<impl::Block<Scalar, Exec>> make_block(const std::string& layer_name,
                                                       const LayerType& layer) const {
    return std::make_unique<block_type<LayerType, Scalar, Exec>>(layer_name, layer, settings_for(layer));
  }
};

}  // namespace kfac
