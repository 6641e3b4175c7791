// BatchNorm2d's unit-wise and diagonal Fisher against direct per-sample computation in double.
#include <array>
#include <vector>

#include "helpers.hpp"

using namespace kfac_test;

namespace {

/// Per-channel Fisher blocks (gg, gb, bb) = (1/N) sum_n of the products of the per-sample
/// gradients g_gamma = sum_hw scale dy xhat and g_beta = sum_hw scale dy.
std::vector<std::array<double, 3>> direct_fisher(const V4<double>& xhat, const V4<double>& dy,
                                                 double scale) {
  const int n = int(xhat.extent(0)), c = int(xhat.extent(1));
  std::vector<std::array<double, 3>> f(c, {0.0, 0.0, 0.0});
  for (int ch = 0; ch < c; ++ch)
    for (int k = 0; k < n; ++k) {
      double gg = 0, gb = 0;
      for (int i = 0; i < int(xhat.extent(2)); ++i)
        for (int j = 0; j < int(xhat.extent(3)); ++j) {
          gg += scale * dy(k, ch, i, j) * xhat(k, ch, i, j);
          gb += scale * dy(k, ch, i, j);
        }
      f[ch][0] += gg * gg / n;
      f[ch][1] += gg * gb / n;
      f[ch][2] += gb * gb / n;
    }
  return f;
}

/// (dgamma, dbeta) of channel c preconditioned by the 2x2 block, or by its diagonal.
std::array<double, 2> solve(const std::array<double, 3>& f, double damping, double dgamma,
                            double dbeta, bool unit_wise) {
  Eigen::Matrix2d m;
  m << f[0] + damping, unit_wise ? f[1] : 0.0, unit_wise ? f[1] : 0.0, f[2] + damping;
  const Eigen::Vector2d v = m.fullPivLu().solve(Eigen::Vector2d(dgamma, dbeta));
  return {v(0), v(1)};
}

V4<double> as4(const V2<double>& v) {
  V4<double> r("as4", v.extent(0), v.extent(1), 1, 1);
  for (int i = 0; i < int(v.extent(0)); ++i)
    for (int j = 0; j < int(v.extent(1)); ++j) r(i, j, 0, 0) = v(i, j);
  return r;
}

template <class Factor>
void check_fisher(const Pre& pre, const std::vector<std::array<double, 3>>& expect) {
  const auto f = pre.layer_as<BnLayer<Factor>>("bn").fisher();
  REQUIRE(f.extent(0) == expect.size());
  REQUIRE(f.extent(1) == 3);
  for (std::size_t c = 0; c < expect.size(); ++c)
    for (int k = 0; k < 3; ++k) {
      INFO("channel " << c << " entry " << k);
      CHECK(f(c, k) == Approx(expect[c][k]).epsilon(1e-13).margin(1e-15));
    }
}

/// One step on a BatchNorm2d "bn" with random data of shape (n, c, h, w) (rank-2 when h = 0).
template <class Factor>
void check_step(int n, int c, int h, int w, kfac::LossReduction reduction, unsigned seed) {
  Rng rng(seed);
  const double damping = 0.05;
  const double scale = reduction == kfac::LossReduction::mean ? double(n) : 1.0;
  Pre pre(plain_options(damping).with_loss_reduction(reduction));
  pre.register_layer<kfac::BatchNorm2d, Factor>("bn", kfac::BatchNorm2d(c));
  V4<double> xhat, dy;
  if (h == 0) {
    const auto x2 = random_view<double>(n, c, rng), g2 = random_view<double>(n, c, rng);
    pre.observe_input("bn", x2);
    pre.observe_output_grad("bn", g2);
    xhat = as4(x2);
    dy = as4(g2);
  } else {
    xhat = random_view4<double>(n, c, h, w, rng);
    dy = random_view4<double>(n, c, h, w, rng);
    pre.observe_input("bn", xhat);
    pre.observe_output_grad("bn", dy);
  }
  auto dgamma = random_vector<double>(c, rng), dbeta = random_vector<double>(c, rng);
  const auto g0 = clone(dgamma), b0 = clone(dbeta);
  pre.set_gradient("bn", dgamma, dbeta);
  pre.step();
  const auto f = direct_fisher(xhat, dy, scale);
  check_fisher<Factor>(pre, f);
  for (int ch = 0; ch < c; ++ch) {
    const auto v = solve(f[ch], damping, g0(ch), b0(ch), std::is_same<Factor, kfac::UnitWise>::value);
    INFO("channel " << ch);
    CHECK(dgamma(ch) == Approx(v[0]).epsilon(1e-12));
    CHECK(dbeta(ch) == Approx(v[1]).epsilon(1e-12));
  }
}

}  // namespace

TEST_CASE("unit-wise BatchNorm Fisher and 2x2 solve", "[batch_norm][unit_wise]") {
  SECTION("(N, C, H, W), sum") { check_step<kfac::UnitWise>(3, 4, 2, 3, kfac::LossReduction::sum, 1); }
  SECTION("(N, C, H, W), mean") { check_step<kfac::UnitWise>(4, 2, 3, 3, kfac::LossReduction::mean, 2); }
  SECTION("(N, C)") { check_step<kfac::UnitWise>(5, 3, 0, 0, kfac::LossReduction::sum, 3); }
}

TEST_CASE("diagonal BatchNorm Fisher and division", "[batch_norm][diagonal]") {
  SECTION("(N, C, H, W), sum") { check_step<kfac::Diagonal>(3, 4, 2, 3, kfac::LossReduction::sum, 4); }
  SECTION("(N, C, H, W), mean") { check_step<kfac::Diagonal>(2, 3, 2, 2, kfac::LossReduction::mean, 5); }
  SECTION("(N, C)") { check_step<kfac::Diagonal>(6, 2, 0, 0, kfac::LossReduction::mean, 6); }
}

TEST_CASE("BatchNorm micro-batches average over all samples", "[batch_norm]") {
  Rng rng(8);
  const int c = 3;
  Pre pre(plain_options());
  pre.register_layer<kfac::BatchNorm2d>("bn", kfac::BatchNorm2d(c));
  // Two inputs first, then their gradients in the same order.
  const auto x1 = random_view4<double>(2, c, 2, 2, rng), x2 = random_view4<double>(3, c, 2, 2, rng);
  const auto g1 = random_view4<double>(2, c, 2, 2, rng), g2 = random_view4<double>(3, c, 2, 2, rng);
  pre.observe_input("bn", x1);
  pre.observe_input("bn", x2);
  pre.observe_output_grad("bn", g1);
  pre.observe_output_grad("bn", g2);
  auto dgamma = random_vector<double>(c, rng), dbeta = random_vector<double>(c, rng);
  pre.set_gradient("bn", dgamma, dbeta);
  pre.step();
  const auto f1 = direct_fisher(x1, g1, 1.0), f2 = direct_fisher(x2, g2, 1.0);
  std::vector<std::array<double, 3>> expect(c);
  for (int ch = 0; ch < c; ++ch)
    for (int k = 0; k < 3; ++k) expect[ch][k] = (2 * f1[ch][k] + 3 * f2[ch][k]) / 5;
  check_fisher<kfac::UnitWise>(pre, expect);
}

TEST_CASE("BatchNorm running average over two steps", "[batch_norm][running_average]") {
  Rng rng(9);
  const int c = 2;
  const double decay = 0.7;
  Pre pre(plain_options().with_factor_decay(decay));
  pre.register_layer<kfac::BatchNorm2d, kfac::Diagonal>("bn", kfac::BatchNorm2d(c));
  std::vector<std::array<double, 3>> running;
  for (int step = 0; step < 2; ++step) {
    const auto x = random_view4<double>(3, c, 2, 1, rng), g = random_view4<double>(3, c, 2, 1, rng);
    pre.observe_input("bn", x);
    pre.observe_output_grad("bn", g);
    auto dgamma = random_vector<double>(c, rng), dbeta = random_vector<double>(c, rng);
    pre.set_gradient("bn", dgamma, dbeta);
    pre.step();
    const auto fresh = direct_fisher(x, g, 1.0);
    if (step == 0) {
      running = fresh;  // the first update initializes
    } else {
      for (int ch = 0; ch < c; ++ch)
        for (int k = 0; k < 3; ++k) running[ch][k] = decay * running[ch][k] + (1 - decay) * fresh[ch][k];
    }
    INFO("step " << step);
    check_fisher<kfac::Diagonal>(pre, running);
  }
}
