#pragma once
/// \file kfac_glue.hpp
/// \brief The one file of the examples that talks to kfac: SGD with momentum on gradients that
/// kfac::Preconditioner has preconditioned.
///
/// Define KFAC_EXAMPLES_WITHOUT_KFAC to build the examples without the library (the K-FAC
/// optimizer then throws on construction).

#include "common/network.hpp"
#include "common/sgd.hpp"

#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#if !defined(KFAC_EXAMPLES_WITHOUT_KFAC) && __has_include(<kfac/kfac.hpp>)
#define KFAC_EXAMPLES_HAVE_KFAC 1
#include <kfac/kfac.hpp>
#else
#define KFAC_EXAMPLES_HAVE_KFAC 0
#endif

namespace nn {

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
///
/// The defaults come from short sweeps on Fashion-MNIST (both models, 120-240 steps, batch 256):
/// damping 1e-3 let momentum SGD diverge on the MLP; 0.03-0.1 were stable and alike. Updating
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
};

#if KFAC_EXAMPLES_HAVE_KFAC

class KfacSgd {
 public:
  KfacSgd(Network& net, const KfacSettings& s)
      : pre_(std::make_unique<Preconditioner>(kfac::Options{}
                                                  .with_lr(s.lr)
                                                  .with_damping(s.damping)
                                                  .with_kl_clip(s.kl_clip)
                                                  .with_factor_decay(s.factor_decay)
                                                  .with_factor_update_steps(s.factor_update_steps)
                                                  .with_inv_update_steps(s.inv_update_steps)
                                                  .with_loss_reduction(kfac::LossReduction::mean))),
        sgd_(net.params(), SgdOptions{}.with_lr(s.lr).with_momentum(s.momentum).with_weight_decay(s.weight_decay)) {
    net.for_each_layer([&](const std::string& name, const auto& layer) {
      using L = std::decay_t<decltype(layer)>;
      if constexpr (std::is_same_v<L, Dense>) {
        pre_->register_layer<kfac::Dense>(name, kfac::Dense(layer.in_features(), layer.out_features(), layer.has_bias()));
      } else if constexpr (std::is_same_v<L, Conv2d>) {
        const Conv2dShape& c = layer.shape();
        pre_->register_layer<kfac::Conv2d>(name, kfac::Conv2d(c.in_channels, c.out_channels, c.kernel_h, c.kernel_w)
                                                     .with_stride(c.stride, c.stride)
                                                     .with_padding(c.padding, c.padding)
                                                     .with_bias(c.bias));
      } else if constexpr (std::is_same_v<L, BatchNorm2d>) {
        pre_->register_layer<kfac::BatchNorm2d, kfac::UnitWise>(name, kfac::BatchNorm2d(layer.channels()));
      }
    });
  }

  /// \brief After forward and backward: hand kfac the observations and gradients, let it
  /// precondition the gradients in place, then take the SGD step with them.
  void step(Network& net) {
    const bool observe = pre_->wants_observations();
    net.for_each_layer([&](const std::string& name, const auto& layer) {
      using L = std::decay_t<decltype(layer)>;
      if constexpr (std::is_same_v<L, Dense> || std::is_same_v<L, Conv2d>) {
        if (observe) {
          pre_->observe_input(name, layer.input());
          pre_->observe_output_grad(name, layer.output_grad());
        }
        pre_->set_gradient(name, layer.weight_grad(), layer.bias_grad());
      } else if constexpr (std::is_same_v<L, BatchNorm2d>) {
        if (observe) {
          pre_->observe_input(name, layer.normalized_input());
          pre_->observe_output_grad(name, layer.output_grad());
        }
        pre_->set_gradient(name, layer.gamma_grad(), layer.beta_grad());
      }
    });
    pre_->step();
    sgd_.step();
  }

  /// \brief The KL-clip scale of the last step (1 = unclipped), for diagnostics.
  double last_kl_scale() const { return pre_->last_kl_scale(); }

 private:
  using Preconditioner = kfac::Preconditioner<float, ExecSpace>;
  std::unique_ptr<Preconditioner> pre_;  // held by pointer so KfacSgd moves whatever kfac allows
  Sgd sgd_;
};

#else

class KfacSgd {
 public:
  KfacSgd(Network&, const KfacSettings&) {
    throw std::runtime_error("this build of the examples has no kfac (KFAC_EXAMPLES_WITHOUT_KFAC)");
  }
  void step(Network&) {}
  double last_kl_scale() const { return 1.0; }
};

#endif

}  // namespace nn
