#pragma once
// A small network with one layer of every policy kind, for the cost-model tests: registered on a
// Preconditioner and described as kfac::LayerShape from one list, plus one step's random data.
#include <kfac/planning/cost_model.hpp>
#include <kfac/kfac.hpp>
#include <string>
#include <vector>

#include "reference.hpp"

namespace kfac_test {

/// Calls reg.template operator()<Layer, Factor, Inverse, Precision>(name, layer) per layer:
/// eigen (Q and lambda), Cholesky with Full factors and no bias, Newton-Schulz, a conv with
/// float factors, closed-form Diagonal and BatchNorm, a wider dense layer, and binary16 factors.
template <class Reg>
void cost_model_net(Reg&& reg) {
  using kfac::DoublePrecision;
  using Eigen = kfac::Eigendecomposition<>;
  reg.template operator()<kfac::Dense, kfac::Symmetric, Eigen, DoublePrecision>("fc1", kfac::Dense(5, 4));
  reg.template operator()<kfac::Dense, kfac::Full, kfac::Cholesky<>, DoublePrecision>("fc2", kfac::Dense(4, 3, false));
  reg.template operator()<kfac::Dense, kfac::Symmetric, kfac::NewtonSchulz, DoublePrecision>("ns", kfac::Dense(3, 2));
  reg.template operator()<kfac::Conv2d, kfac::Symmetric, Eigen, kfac::MixedPrecision>(
      "conv", kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1));
  reg.template operator()<kfac::Dense, kfac::Diagonal, Eigen, DoublePrecision>("diag", kfac::Dense(6, 2));
  reg.template operator()<kfac::BatchNorm2d, kfac::UnitWise, Eigen, DoublePrecision>("bn", kfac::BatchNorm2d(3));
  reg.template operator()<kfac::Dense, kfac::Symmetric, Eigen, DoublePrecision>("fc3", kfac::Dense(7, 9));
  reg.template operator()<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>, kfac::HalfPrecision>("fc_half", kfac::Dense(4, 3));
}

/// Collects the net as kfac::LayerShape (local classes cannot have member templates).
struct CostModelShapes {
  std::vector<kfac::LayerShape> v;
  template <class L, class F, class I, class P>
  void operator()(const std::string& name, const L& layer) { v.push_back(kfac::LayerShape::of<L, F, I, P>(name, layer)); }
};
template <class Pre>
struct CostModelRegister {
  Pre& pre;
  template <class L, class F, class I, class P>
  void operator()(const std::string& name, const L& layer) { pre.template register_layer<L, F, I, P>(name, layer); }
};

/// The net as the cost model sees it.
inline std::vector<kfac::LayerShape> cost_model_net_shapes() {
  CostModelShapes shapes;
  cost_model_net(shapes);
  return shapes.v;
}

/// Registers the net on a Preconditioner.
template <class Pre>
void register_cost_model_net(Pre& pre) {
  cost_model_net(CostModelRegister<Pre>{pre});
}

/// One step's observations and gradients for the net (the views must outlive step()).
struct CostModelBatch {
  using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;
  using V1 = Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::HostSpace>;
  using V4 = Kokkos::View<double****, Kokkos::LayoutRight, Kokkos::HostSpace>;
  static constexpr int n = 8;
  V2 x1, g1, x2, g2, x3, g3, x4, g4, x5, g5, w1, w2, w3, w4, w5;
  V4 xc, gc, xb, gb, wc;
  V1 b1, b3, bc, b4, gamma, beta, b5;
  V2 x6, g6, w6;  // fc_half, drawn last so the other layers' data stays as it was
  V1 b6;

  explicit CostModelBatch(Rng& rng)
      : x1(random_view<double>(n, 5, rng)), g1(random_view<double>(n, 4, rng)),
        x2(random_view<double>(n, 4, rng)), g2(random_view<double>(n, 3, rng)),
        x3(random_view<double>(n, 3, rng)), g3(random_view<double>(n, 2, rng)),
        x4(random_view<double>(n, 6, rng)), g4(random_view<double>(n, 2, rng)),
        x5(random_view<double>(n, 7, rng)), g5(random_view<double>(n, 9, rng)),
        w1(random_view<double>(4, 5, rng)), w2(random_view<double>(3, 4, rng)),
        w3(random_view<double>(2, 3, rng)), w4(random_view<double>(2, 6, rng)),
        w5(random_view<double>(9, 7, rng)),
        xc(random_view4<double>(n, 2, 4, 4, rng)), gc(random_view4<double>(n, 3, 4, 4, rng)),
        xb(random_view4<double>(n, 3, 2, 2, rng)), gb(random_view4<double>(n, 3, 2, 2, rng)),
        wc(random_view4<double>(3, 2, 3, 3, rng)),
        b1(random_vector<double>(4, rng)), b3(random_vector<double>(2, rng)), bc(random_vector<double>(3, rng)),
        b4(random_vector<double>(2, rng)), gamma(random_vector<double>(3, rng)), beta(random_vector<double>(3, rng)),
        b5(random_vector<double>(9, rng)),
        x6(random_view<double>(n, 4, rng)), g6(random_view<double>(n, 3, rng)),
        w6(random_view<double>(3, 4, rng)), b6(random_vector<double>(3, rng)) {}

  template <class Pre>
  void feed(Pre& pre) const {
    if (pre.wants_observations()) {
      pre.observe_input("fc1", x1); pre.observe_output_grad("fc1", g1);
      pre.observe_input("fc2", x2); pre.observe_output_grad("fc2", g2);
      pre.observe_input("ns", x3); pre.observe_output_grad("ns", g3);
      pre.observe_input("conv", xc); pre.observe_output_grad("conv", gc);
      pre.observe_input("diag", x4); pre.observe_output_grad("diag", g4);
      pre.observe_input("bn", xb); pre.observe_output_grad("bn", gb);
      pre.observe_input("fc3", x5); pre.observe_output_grad("fc3", g5);
      pre.observe_input("fc_half", x6); pre.observe_output_grad("fc_half", g6);
    }
    pre.set_gradient("fc1", w1, b1);
    pre.set_gradient("fc2", w2);
    pre.set_gradient("ns", w3, b3);
    pre.set_gradient("conv", wc, bc);
    pre.set_gradient("diag", w4, b4);
    pre.set_gradient("bn", gamma, beta);
    pre.set_gradient("fc3", w5, b5);
    pre.set_gradient("fc_half", w6, b6);
  }
};

}  // namespace kfac_test
