// BatchNorm2d's unit-wise and diagonal Fisher against direct per-sample computation in double.
#include <array>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <kfac/planning/cost_model.hpp>

#include "helpers.hpp"

#include "feature_scale.hpp"  // a layer kind the tests define alone

using kfac_test::FeatureScale;

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

namespace {
using V3d = Kokkos::View<double***, Kokkos::LayoutRight, Kokkos::HostSpace>;

V3d random3(int n, int t, int d, Rng& rng) {
  V3d v("rand3", n, t, d);
  for (std::size_t i = 0; i < v.span(); ++i) v.data()[i] = rng.uniform() - 0.5;
  return v;
}

/// LayerNorm's per-feature Fisher from per-sample gradients in double: g_gamma = sum over the
/// sample's tokens of scale dy xhat, g_beta = sum of scale dy; blocks (gg, gb, bb) summed over
/// samples (the caller divides by the samples).
void add_layer_norm_fisher(const V3d& xhat, const V3d& dy, double scale, std::vector<std::array<double, 3>>& f) {
  const int n = int(xhat.extent(0)), t = int(xhat.extent(1)), d = int(xhat.extent(2));
  f.resize(d, {0.0, 0.0, 0.0});
  for (int k = 0; k < n; ++k)
    for (int j = 0; j < d; ++j) {
      double gg = 0, gb = 0;
      for (int i = 0; i < t; ++i) {
        gg += scale * dy(k, i, j) * xhat(k, i, j);
        gb += scale * dy(k, i, j);
      }
      f[j][0] += gg * gg;
      f[j][1] += gg * gb;
      f[j][2] += gb * gb;
    }
}

template <class Factor>
using LnLayer = kfac::LayerNormBlock<Factor, kfac::DoublePrecision, double, Host>;
}  // namespace

TEST_CASE("LayerNorm over tokens: per-feature Fisher and solve against per-sample gradients in double",
          "[layer_norm][unit_wise][tokens]") {
  const int d = 5, t = 3;
  for (const bool shift : {true, false})
    for (const bool unit_wise : {true, false})
      for (const auto reduction : {kfac::LossReduction::sum, kfac::LossReduction::mean}) {
        INFO("shift " << shift << " unit-wise " << unit_wise << " mean " << (reduction == kfac::LossReduction::mean));
        Rng rng(31 + 4 * shift + 2 * unit_wise);
        const double damping = 0.05;
        Pre pre(plain_options(damping).with_loss_reduction(reduction));
        if (unit_wise) pre.register_layer("ln", kfac::LayerNorm(d, shift));
        else pre.register_layer("ln", kfac::LayerNorm(d, shift), kfac::UnitWiseFisher<kfac::Diagonal>{});
        std::vector<std::array<double, 3>> f;
        int samples = 0;
        for (const int n : {4, 2}) {  // two micro-batches
          const V3d xhat = random3(n, t, d, rng), dy = random3(n, t, d, rng);
          pre.observe_input("ln", xhat);
          pre.observe_output_grad("ln", dy);
          add_layer_norm_fisher(xhat, dy, reduction == kfac::LossReduction::mean ? double(n) : 1.0, f);
          samples += n;
        }
        const auto dg = random_vector<double>(d, rng), db = shift ? random_vector<double>(d, rng) : V1<double>();
        const auto g0 = clone(dg), b0 = clone(db);
        pre.set_gradient("ln", dg, db);
        pre.step();
        const auto fisher = unit_wise ? pre.layer_as<LnLayer<kfac::UnitWise>>("ln").fisher()
                                      : pre.layer_as<LnLayer<kfac::Diagonal>>("ln").fisher();
        for (int j = 0; j < d; ++j) {
          INFO("feature " << j);
          for (int k = 0; k < 3; ++k) CHECK(fisher(j, k) == Approx(f[j][k] / samples).epsilon(1e-13).margin(1e-15));
          std::array<double, 3> fj = {f[j][0] / samples, f[j][1] / samples, f[j][2] / samples};
          if (shift) {
            const auto want = solve(fj, damping, g0(j), b0(j), unit_wise);
            CHECK(dg(j) == Approx(want[0]).epsilon(1e-12));
            CHECK(db(j) == Approx(want[1]).epsilon(1e-12));
          } else {  // scale only (RMSNorm): the 1x1 block
            CHECK(dg(j) == Approx(g0(j) / (fj[0] + damping)).epsilon(1e-12));
          }
        }
      }
}

TEST_CASE("LayerNorm over one token equals LayerNorm over samples; mismatched tokens are refused by name",
          "[layer_norm][tokens][errors]") {
  Rng rng(8);
  const V3d xhat = random3(6, 1, 4, rng), dy = random3(6, 1, 4, rng);
  V2<double> x2(xhat.data(), 6, 4), g2(dy.data(), 6, 4);
  Pre seq(plain_options()), flat(plain_options());
  seq.register_layer("ln", kfac::LayerNorm(4));
  flat.register_layer("ln", kfac::LayerNorm(4));
  auto ga = random_vector<double>(4, rng), ba = random_vector<double>(4, rng);
  auto gb = clone(ga), bb = clone(ba);
  seq.observe_input("ln", xhat);
  seq.observe_output_grad("ln", dy);
  seq.set_gradient("ln", ga, ba);
  flat.observe_input("ln", x2);
  flat.observe_output_grad("ln", g2);
  flat.set_gradient("ln", gb, bb);
  seq.step();
  flat.step();
  CHECK(same_bits(ga, gb));
  CHECK(same_bits(ba, bb));
  seq.observe_input("ln", random3(2, 3, 4, rng));
  expect_error([&] { seq.observe_output_grad("ln", random3(2, 5, 4, rng)); }, "ln",
               {"(2, 5, 4)", "matching the input"});
  expect_error([&] { seq.observe_input("ln", random3(2, 3, 5, rng)); }, "ln", {"(2, 3, 5)", "(batch, tokens, 4)"});
  // A LayerNorm without a shift takes no bias gradient.
  Pre rms(plain_options());
  rms.register_layer("rms", kfac::LayerNorm(4, false));
  rms.observe_input("rms", x2);
  rms.observe_output_grad("rms", g2);
  expect_error([&] { rms.set_gradient("rms", ga, ba); }, "rms", {"bias"});
}

TEST_CASE("LayerNorm's Fisher survives a checkpoint bit for bit", "[layer_norm][checkpoint]") {
  Rng rng(12);
  auto make = [] {
    auto p = std::make_unique<Pre>(plain_options().with_factor_decay(0.9));
    p->register_layer("ln", kfac::LayerNorm(3));
    return p;
  };
  auto a = make();
  auto feed = [&](Pre& p, const V3d& x, const V3d& g, V1<double>& dg, V1<double>& db) {
    p.observe_input("ln", x);
    p.observe_output_grad("ln", g);
    p.set_gradient("ln", dg, db);
    p.step();
  };
  for (int s = 0; s < 3; ++s) {
    auto dg = random_vector<double>(3, rng), db = random_vector<double>(3, rng);
    feed(*a, random3(4, 2, 3, rng), random3(4, 2, 3, rng), dg, db);
  }
  std::stringstream bytes;
  a->save(bytes);
  auto b = make();
  REQUIRE(b->load(bytes));
  const V3d x = random3(4, 2, 3, rng), g = random3(4, 2, 3, rng);
  auto dga = random_vector<double>(3, rng), dba = random_vector<double>(3, rng);
  auto dgb = clone(dga), dbb = clone(dba);
  feed(*a, x, g, dga, dba);
  feed(*b, x, g, dgb, dbb);
  CHECK(same_bits(dga, dgb));
  CHECK(same_bits(dba, dbb));
}


TEST_CASE("a layer kind from a test file registers with the default method, checks and the cost model",
          "[layer_kinds][seam]") {
  static_assert(kfac::is_layer_type_v<FeatureScale>);
  static_assert(std::is_same<kfac::default_method<FeatureScale>::type, kfac::UnitWiseFisher<>>::value);
  Rng rng(4);
  Pre mine(plain_options().with_factor_decay(0.8)), ref(plain_options().with_factor_decay(0.8));
  mine.register_layer("s", FeatureScale{5});
  ref.register_layer("s", kfac::LayerNorm(5, false));
  for (int step = 0; step < 3; ++step) {
    const V3d x = random3(3, 4, 5, rng), g = random3(3, 4, 5, rng);
    auto a = random_vector<double>(5, rng);
    auto b = clone(a);
    for (Pre* p : {&mine, &ref}) {
      p->observe_input("s", x);
      p->observe_output_grad("s", g);
    }
    mine.set_gradient("s", a, V1<double>());
    ref.set_gradient("s", b, V1<double>());
    mine.step();
    ref.step();
    CHECK(same_bits(a, b));
  }
  expect_error([&] { mine.observe_input("s", random3(3, 4, 6, rng)); }, "s", {"(3, 4, 6)"});
  const auto shape = kfac::LayerShape::of("s", FeatureScale{5}, kfac::UnitWiseFisher<>{});
  CHECK(shape.kind == "feature_scale");
  CHECK(shape.channels == 5);
  CHECK(kfac::Options{}.with_skip_layers({"feature_scale"}).skip_layers.size() == 1);
  Pre skipping(plain_options().with_skip_layers({"feature_scale"}));
  skipping.register_layer("s", FeatureScale{5});
  CHECK(skipping.is_skipped("s"));
}
