// Forward mode (R-op) of the examples' network: Network::rop's J v against central finite
// differences of an independent double-precision forward pass (host loops over the same float
// parameters), along a random parameter direction, for the layer kinds the MLP and the deep
// autoencoder use (Flatten, Dense, ReLU, Sigmoid); and the loss kinds' kfac::LossCurvature.

#include "common/kfac_glue.hpp"
#include "common/network.hpp"
#include "common/sigmoid_cross_entropy.hpp"
#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

namespace {

enum class Act { none, relu, sigmoid };

/// The reference network: widths[i] -> widths[i+1] dense layers, act[i] after layer i.
struct Reference {
  std::vector<int> widths;
  std::vector<Act> act;

  /// Outputs (n, widths.back()) of `x` (n, widths[0]) with parameters `p` (weight, bias per layer).
  std::vector<double> forward(const std::vector<double>& x, int n, const std::vector<std::vector<double>>& p) const {
    std::vector<double> a = x;
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      const int in = widths[l], out = widths[l + 1];
      const std::vector<double>&w = p[2 * l], &b = p[2 * l + 1];
      std::vector<double> y(std::size_t(n) * out);
      for (int i = 0; i < n; ++i)
        for (int o = 0; o < out; ++o) {
          double s = b[o];
          for (int j = 0; j < in; ++j) s += w[std::size_t(o) * in + j] * a[std::size_t(i) * in + j];
          if (act[l] == Act::relu) s = s > 0 ? s : 0;
          if (act[l] == Act::sigmoid) s = 1 / (1 + std::exp(-s));
          y[std::size_t(i) * out + o] = s;
        }
      a = std::move(y);
    }
    return a;
  }
};

std::vector<double> to_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

/// J v of `net` (built like `ref`) on `x` against central differences of ref's double forward.
void check_rop(nn::Network& net, const Reference& ref, int n, nn::SplitMix64& rng) {
  const nn::Tensor x = test::random_tensor(n, 1, 1, ref.widths[0], rng);
  const nn::Tensor y = net.forward(x, nn::Mode::train);
  const std::vector<nn::Param> params = net.params();
  REQUIRE(params.size() == 2 * (ref.widths.size() - 1));
  std::vector<std::vector<double>> theta, v;
  std::vector<nn::ConstVector> direction;
  std::vector<nn::Vector> keep;
  for (const nn::Param& p : params) {
    theta.push_back(to_double(test::to_host(p.value)));
    const std::vector<float> d = test::uniform(p.value.size(), rng);
    v.push_back(to_double(d));
    nn::Vector dv("test::direction", d.size());
    test::from_host(dv, d);
    keep.push_back(dv);
    direction.push_back(dv);
  }
  const std::vector<float> jv = test::to_host(net.rop(direction));
  const std::vector<double> xd = to_double(test::to_host(x));
  const std::vector<double> y_ref = ref.forward(xd, n, theta);
  const std::vector<float> y_net = test::to_host(y);
  REQUIRE(jv.size() == y_ref.size());
  for (std::size_t i = 0; i < y_ref.size(); ++i) REQUIRE(y_net[i] == Approx(y_ref[i]).margin(1e-4));

  const double h = 1e-6;
  auto moved = [&](double s) {
    std::vector<std::vector<double>> t = theta;
    for (std::size_t k = 0; k < t.size(); ++k)
      for (std::size_t j = 0; j < t[k].size(); ++j) t[k][j] += s * v[k][j];
    return ref.forward(xd, n, t);
  };
  const std::vector<double> up = moved(h), down = moved(-h);
  double scale = 0;
  for (std::size_t i = 0; i < up.size(); ++i) scale = std::fmax(scale, std::fabs((up[i] - down[i]) / (2 * h)));
  REQUIRE(scale > 1e-3);  // a direction that moves the outputs
  for (std::size_t i = 0; i < up.size(); ++i) {
    const double fd = (up[i] - down[i]) / (2 * h);
    INFO("output " << i << ": finite difference " << fd << ", R-op " << jv[i]);
    CHECK(double(jv[i]) == Approx(fd).margin(2e-4 * scale).epsilon(2e-4));
  }
}

}  // namespace

TEST_CASE("Network::rop matches central differences: Dense, ReLU, Flatten", "[rop]") {
  nn::SplitMix64 rng(7);
  nn::Network net;
  net.add("flatten", nn::Flatten());
  net.add("fc1", nn::Dense(12, 9, true, nn::Init::he, rng));
  net.add("relu1", nn::ReLU());
  net.add("fc2", nn::Dense(9, 7, true, nn::Init::he, rng));
  net.add("relu2", nn::ReLU());
  net.add("fc3", nn::Dense(7, 4, true, nn::Init::lecun, rng));
  REQUIRE(net.has_rop());
  check_rop(net, Reference{{12, 9, 7, 4}, {Act::relu, Act::relu, Act::none}}, 5, rng);
}

TEST_CASE("Network::rop matches central differences: the autoencoder's Sigmoid and linear code layer", "[rop]") {
  nn::SplitMix64 rng(11);
  nn::Network net;
  net.add("flatten", nn::Flatten());
  const std::vector<int> w{10, 8, 3, 8, 10};
  for (int i = 0; i < 4; ++i) {
    net.add("fc" + std::to_string(i), nn::Dense(w[i], w[i + 1], true, nn::Init::lecun, rng));
    if (i != 1 && i != 3) net.add("sigmoid" + std::to_string(i), nn::Sigmoid());
  }
  check_rop(net, Reference{w, {Act::sigmoid, Act::none, Act::sigmoid, Act::none}}, 6, rng);
}

TEST_CASE("Network::rop along one layer's parameters only is that layer's own R-op; refusals", "[rop]") {
  nn::SplitMix64 rng(3);
  nn::Network net = nn::make_autoencoder(1);
  REQUIRE(net.has_rop());
  REQUIRE(!nn::make_cnn(1).has_rop());
  const nn::Tensor x = test::random_tensor(2, 1, 28, 28, rng);
  net.forward(x, nn::Mode::train);
  std::vector<nn::ConstVector> zero;
  for (const nn::Param& p : net.params()) zero.push_back(nn::Vector("test::zero", p.value.size()));
  const std::vector<float> jv = test::to_host(net.rop(zero));
  for (float e : jv) REQUIRE(e == 0.0f);
  zero.pop_back();
  REQUIRE_THROWS_AS(net.rop(zero), std::invalid_argument);
  nn::Network cnn = nn::make_cnn(1);
  cnn.forward(x, nn::Mode::train);
  std::vector<nn::ConstVector> d;
  for (const nn::Param& p : cnn.params()) d.push_back(p.grad);
  REQUIRE_THROWS_WITH(cnn.rop(d), Catch::Contains("conv1") && Catch::Contains("R-op"));
}

TEST_CASE("SigmoidCrossEntropy: loss, squared error and gradient against double loops", "[rop][loss]") {
  nn::SplitMix64 rng(5);
  const int n = 4, k = 6;
  const nn::Tensor z = test::random_tensor(n, k, 1, 1, rng);
  nn::Tensor t("test::t", n, k, 1, 1);
  test::from_host(t, test::uniform(t.size(), rng, 0.0, 1.0));
  nn::SigmoidCrossEntropy loss;
  const nn::ReconstructionStats s = loss.forward_backward(z, t);
  const auto zh = test::to_host(z), th = test::to_host(t), g = test::to_host(loss.grad());
  double l = 0, e = 0;
  for (int i = 0; i < n * k; ++i) {
    const double p = 1 / (1 + std::exp(-double(zh[i])));
    l += std::log(1 + std::exp(double(zh[i]))) - th[i] * zh[i];
    e += (p - th[i]) * (p - th[i]);
    CHECK(g[i] == Approx((p - th[i]) / n).margin(1e-7));
  }
  CHECK(s.mean_loss() == Approx(l / n).epsilon(1e-6));
  CHECK(s.mean_squared_error() == Approx(e / n).epsilon(1e-6));
#if KFAC_EXAMPLES_HAVE_KFAC
  CHECK(nn::loss_curvature(loss) == kfac::LossCurvature::sigmoid_cross_entropy);
  CHECK(nn::loss_curvature(nn::SoftmaxCrossEntropy()) == kfac::LossCurvature::softmax_cross_entropy);
#endif
}
