#pragma once
/// \file adam.hpp
/// \brief Adam (Kingma and Ba 2015) with bias correction and optional L2 weight decay.

#include "common/tensor.hpp"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace nn {

/// | type | name | description | default |
/// |---|---|---|---|
/// | double | lr | step size | 1e-3 |
/// | double | beta1 | decay of the first-moment average | 0.9 |
/// | double | beta2 | decay of the second-moment average | 0.999 |
/// | double | eps | added to the root of the second moment | 1e-8 |
/// | double | weight_decay | L2 coefficient added to the gradient of weights | 0 |
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  AdamOptions with_lr(double v) const { auto o = *this; o.lr = v; return o; }
  AdamOptions with_weight_decay(double v) const { auto o = *this; o.weight_decay = v; return o; }
};

class Adam {
 public:
  Adam(std::vector<Param> params, AdamOptions options) : params_(std::move(params)), opt_(options) {
    for (const Param& p : params_) {
      m_.emplace_back("nn::adam::m:" + p.name, p.value.extent(0));
      v_.emplace_back("nn::adam::v:" + p.name, p.value.extent(0));
    }
  }

  void step() {
    ++t_;
    const float b1 = float(opt_.beta1), b2 = float(opt_.beta2), eps = float(opt_.eps);
    // w -= lr * mhat / (sqrt(vhat) + eps), with mhat = m / c1 and vhat = v / c2 folded into scalars.
    const double c1 = 1.0 - std::pow(opt_.beta1, double(t_)), c2 = 1.0 - std::pow(opt_.beta2, double(t_));
    const float step = float(opt_.lr / c1), root_c2 = float(std::sqrt(c2));
    for (std::size_t k = 0; k < params_.size(); ++k) {
      const Vector w = params_[k].value, g = params_[k].grad, m = m_[k], v = v_[k];
      const float wd = params_[k].decay ? float(opt_.weight_decay) : 0.0f;
      Kokkos::parallel_for("nn::adam::step", Kokkos::RangePolicy<ExecSpace>(0, int(w.extent(0))),
                           KOKKOS_LAMBDA(const int i) {
                             const float gi = g(i) + wd * w(i);
                             m(i) = b1 * m(i) + (1.0f - b1) * gi;
                             v(i) = b2 * v(i) + (1.0f - b2) * gi * gi;
                             w(i) -= step * m(i) / (std::sqrt(v(i)) / root_c2 + eps);
                           });
    }
  }

  const AdamOptions& options() const { return opt_; }
  void set_lr(double lr) { opt_.lr = lr; }

 private:
  std::vector<Param> params_;
  AdamOptions opt_;
  std::vector<Vector> m_, v_;
  long t_ = 0;
};

}  // namespace nn
