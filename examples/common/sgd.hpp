#pragma once
/// \file sgd.hpp
/// \brief Stochastic gradient descent with heavy-ball momentum and L2 weight decay.

#include "common/tensor.hpp"

#include <string>
#include <utility>
#include <vector>

namespace nn {

/// | type | name | description | default |
/// |---|---|---|---|
/// | double | lr | learning rate | 0.1 |
/// | double | momentum | heavy-ball coefficient; 0 for plain SGD | 0.9 |
/// | double | weight_decay | L2 coefficient added to the gradient of weights (not biases or BN) | 0 |
struct SgdOptions {
  double lr = 0.1;
  double momentum = 0.9;
  double weight_decay = 0.0;
  SgdOptions with_lr(double v) const { auto o = *this; o.lr = v; return o; }
  SgdOptions with_momentum(double v) const { auto o = *this; o.momentum = v; return o; }
  SgdOptions with_weight_decay(double v) const { auto o = *this; o.weight_decay = v; return o; }
};

/// \brief \f$v \leftarrow \mu v + g + \lambda w,\; w \leftarrow w - \eta v\f$ (the PyTorch form).
class Sgd {
 public:
  Sgd(std::vector<Param> params, SgdOptions options) : params_(std::move(params)), opt_(options) {
    for (const Param& p : params_) velocity_.emplace_back("nn::sgd::velocity:" + p.name, p.value.extent(0));
  }

  void step() {
    const float lr = float(opt_.lr), mu = float(opt_.momentum);
    for (std::size_t k = 0; k < params_.size(); ++k) {
      const Vector w = params_[k].value, g = params_[k].grad, v = velocity_[k];
      const float wd = params_[k].decay ? float(opt_.weight_decay) : 0.0f;
      Kokkos::parallel_for("nn::sgd::step", Kokkos::RangePolicy<ExecSpace>(0, int(w.extent(0))),
                           KOKKOS_LAMBDA(const int i) {
                             v(i) = mu * v(i) + g(i) + wd * w(i);
                             w(i) -= lr * v(i);
                           });
    }
  }

  const SgdOptions& options() const { return opt_; }
  void set_lr(double lr) { opt_.lr = lr; }
  /// \brief The momentum buffers, one per parameter in order (what periodic averaging may average).
  const std::vector<Vector>& velocity() const { return velocity_; }

 private:
  std::vector<Param> params_;
  SgdOptions opt_;
  std::vector<Vector> velocity_;
};

}  // namespace nn
