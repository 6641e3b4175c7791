// Forward mode (R-op) of the examples' network: Network::rop's J v against central finite
// differences of an independent double-precision forward pass (host loops over the same float
// parameters), along a random parameter direction, for every layer kind: those of the MLP and the
// deep autoencoder (Flatten, Dense, ReLU, Sigmoid) and of the CNN (Conv2d with padding and stride,
// MaxPool2d, BatchNorm2d with batch statistics and with running ones); and the loss kinds'
// kfac::LossCurvature.

#include "common/kfac_glue.hpp"
#include "common/network.hpp"
#include "common/sigmoid_cross_entropy.hpp"
#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <type_traits>
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

using Forward = std::function<std::vector<double>(const std::vector<std::vector<double>>& theta)>;

/// J v of `net` at `x` (forward in `mode`) against central differences of `reference`, the same
/// function in double of the parameters (params()' order).
void check_rop(nn::Network& net, const nn::Tensor& x, nn::Mode mode, const Forward& reference, nn::SplitMix64& rng) {
  const nn::Tensor y = net.forward(x, mode);
  const std::vector<nn::Param> params = net.params();
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
  const std::vector<double> y_ref = reference(theta);
  const std::vector<float> y_net = test::to_host(y);
  REQUIRE(jv.size() == y_ref.size());
  for (std::size_t i = 0; i < y_ref.size(); ++i) REQUIRE(y_net[i] == Approx(y_ref[i]).margin(1e-4));

  const double h = 1e-6;
  auto moved = [&](double s) {
    std::vector<std::vector<double>> t = theta;
    for (std::size_t k = 0; k < t.size(); ++k)
      for (std::size_t j = 0; j < t[k].size(); ++j) t[k][j] += s * v[k][j];
    return reference(t);
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

/// J v of `net` (built like `ref`) on a random input against central differences of ref's double forward.
void check_rop(nn::Network& net, const Reference& ref, int n, nn::SplitMix64& rng) {
  REQUIRE(net.params().size() == 2 * (ref.widths.size() - 1));
  const nn::Tensor x = test::random_tensor(n, 1, 1, ref.widths[0], rng);
  const std::vector<double> xd = to_double(test::to_host(x));
  check_rop(net, x, nn::Mode::train, [&](const auto& theta) { return ref.forward(xd, n, theta); }, rng);
}

/// An NCHW activation in double.
struct Image {
  int n, c, h, w;
  std::vector<double> v;
  double& at(int s, int k, int i, int j) { return v[((std::size_t(s) * c + k) * h + i) * w + j]; }
  double at(int s, int k, int i, int j) const { return v[((std::size_t(s) * c + k) * h + i) * w + j]; }
};

/// Cross-correlation with weight (o, a.c, k, k), optional bias, stride and zero padding.
Image conv(const Image& a, const std::vector<double>& weight, const std::vector<double>* bias, int o, int k, int stride,
           int pad) {
  const int ho = (a.h + 2 * pad - k) / stride + 1, wo = (a.w + 2 * pad - k) / stride + 1;
  Image y{a.n, o, ho, wo, std::vector<double>(std::size_t(a.n) * o * ho * wo)};
  for (int s = 0; s < a.n; ++s)
    for (int q = 0; q < o; ++q)
      for (int i = 0; i < ho; ++i)
        for (int j = 0; j < wo; ++j) {
          double sum = bias ? (*bias)[q] : 0.0;
          for (int c = 0; c < a.c; ++c)
            for (int u = 0; u < k; ++u)
              for (int e = 0; e < k; ++e) {
                const int ih = i * stride - pad + u, iw = j * stride - pad + e;
                if (ih >= 0 && ih < a.h && iw >= 0 && iw < a.w)
                  sum += weight[((std::size_t(q) * a.c + c) * k + u) * k + e] * a.at(s, c, ih, iw);
              }
          y.at(s, q, i, j) = sum;
        }
  return y;
}

/// BatchNorm: the batch's mean and biased variance per channel, or the given running ones.
Image batch_norm(const Image& a, const std::vector<double>& gamma, const std::vector<double>& beta, bool batch,
                 const std::vector<double>& running_mean, const std::vector<double>& running_var) {
  Image y = a;
  const double m = double(a.n) * a.h * a.w;
  for (int c = 0; c < a.c; ++c) {
    double mu = running_mean[c], var = running_var[c];
    if (batch) {
      mu = var = 0;
      for (int s = 0; s < a.n; ++s)
        for (int i = 0; i < a.h; ++i)
          for (int j = 0; j < a.w; ++j) mu += a.at(s, c, i, j) / m;
      for (int s = 0; s < a.n; ++s)
        for (int i = 0; i < a.h; ++i)
          for (int j = 0; j < a.w; ++j) var += (a.at(s, c, i, j) - mu) * (a.at(s, c, i, j) - mu) / m;
    }
    for (int s = 0; s < a.n; ++s)
      for (int i = 0; i < a.h; ++i)
        for (int j = 0; j < a.w; ++j)
          y.at(s, c, i, j) = gamma[c] * (a.at(s, c, i, j) - mu) / std::sqrt(var + 1e-5) + beta[c];
  }
  return y;
}

Image relu(Image a) {
  for (double& e : a.v) e = e > 0 ? e : 0;
  return a;
}

Image max_pool(const Image& a) {
  Image y{a.n, a.c, a.h / 2, a.w / 2, std::vector<double>(std::size_t(a.n) * a.c * (a.h / 2) * (a.w / 2))};
  for (int s = 0; s < a.n; ++s)
    for (int c = 0; c < a.c; ++c)
      for (int i = 0; i < y.h; ++i)
        for (int j = 0; j < y.w; ++j)
          y.at(s, c, i, j) = std::fmax(std::fmax(a.at(s, c, 2 * i, 2 * j), a.at(s, c, 2 * i, 2 * j + 1)),
                                       std::fmax(a.at(s, c, 2 * i + 1, 2 * j), a.at(s, c, 2 * i + 1, 2 * j + 1)));
  return y;
}

/// conv(2->3, 3x3, pad 1, bias)-BN-ReLU-pool-conv(3->4, 3x3, stride 2, pad 1)-BN-ReLU-flatten-dense(16->5)
/// on (n, 2, 8, 8), with random BatchNorm scales and shifts.
nn::Network small_cnn(nn::SplitMix64& rng) {
  nn::Network net;
  net.add("conv1", nn::Conv2d(nn::Conv2dShape{2, 3, 3, 3}.with_padding(1), nn::Init::he, rng));
  net.add("bn1", nn::BatchNorm2d(3));
  net.add("relu1", nn::ReLU());
  net.add("pool1", nn::MaxPool2d());
  net.add("conv2", nn::Conv2d(nn::Conv2dShape{3, 4, 3, 3}.with_padding(1).with_stride(2).with_bias(false),
                              nn::Init::he, rng));
  net.add("bn2", nn::BatchNorm2d(4));
  net.add("relu2", nn::ReLU());
  net.add("flatten", nn::Flatten());
  net.add("fc", nn::Dense(16, 5, true, nn::Init::lecun, rng));
  for (const nn::Param& p : net.params())
    if (p.name == "bn1.gamma" || p.name == "bn2.gamma")
      test::from_host(p.value, test::uniform(p.value.size(), rng, 0.5, 1.5));
    else if (p.name == "bn1.beta" || p.name == "bn2.beta")
      test::from_host(p.value, test::uniform(p.value.size(), rng));
  return net;
}

/// small_cnn's function in double; `batch`: BatchNorm with batch statistics, else with `net`'s running ones.
Forward small_cnn_reference(nn::Network& net, const nn::Tensor& x, bool batch) {
  std::vector<std::vector<double>> running;  // bn1 mean, var, bn2 mean, var
  net.for_each_layer([&](const std::string&, auto& layer) {
    if constexpr (std::is_same_v<std::decay_t<decltype(layer)>, nn::BatchNorm2d>) {
      running.push_back(to_double(test::to_host(layer.running_mean())));
      running.push_back(to_double(test::to_host(layer.running_var())));
    }
  });
  Image in{int(x.extent(0)), 2, 8, 8, to_double(test::to_host(x))};
  return [=](const std::vector<std::vector<double>>& p) {
    REQUIRE(p.size() == 9);  // conv1 W b, bn1 gamma beta, conv2 W, bn2 gamma beta, fc W b
    Image a = max_pool(relu(batch_norm(conv(in, p[0], &p[1], 3, 3, 1, 1), p[2], p[3], batch, running[0], running[1])));
    a = relu(batch_norm(conv(a, p[4], nullptr, 4, 3, 2, 1), p[5], p[6], batch, running[2], running[3]));
    std::vector<double> y(std::size_t(a.n) * 5);
    for (int s = 0; s < a.n; ++s)
      for (int o = 0; o < 5; ++o) {
        double sum = p[8][o];
        for (int k = 0; k < 16; ++k) sum += p[7][std::size_t(o) * 16 + k] * a.v[std::size_t(s) * 16 + k];
        y[std::size_t(s) * 5 + o] = sum;
      }
    return y;
  };
}

}  // namespace

TEST_CASE("Network::rop matches central differences: Conv2d, BatchNorm2d (batch statistics), MaxPool2d", "[rop]") {
  nn::SplitMix64 rng(13);
  nn::Network net = small_cnn(rng);
  REQUIRE(net.has_rop());
  const nn::Tensor x = test::random_tensor(3, 2, 8, 8, rng);
  check_rop(net, x, nn::Mode::train, small_cnn_reference(net, x, true), rng);
  // Mode::probe is the same function (and leaves the running statistics).
  check_rop(net, x, nn::Mode::probe, small_cnn_reference(net, x, true), rng);
}

TEST_CASE("Network::rop after an evaluation forward: BatchNorm2d's running statistics are constants", "[rop]") {
  nn::SplitMix64 rng(17);
  nn::Network net = small_cnn(rng);
  const nn::Tensor x = test::random_tensor(3, 2, 8, 8, rng);
  net.forward(test::random_tensor(3, 2, 8, 8, rng), nn::Mode::train);  // running statistics away from (0, 1)
  check_rop(net, x, nn::Mode::eval, small_cnn_reference(net, x, false), rng);
}

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
  REQUIRE(nn::make_cnn(1).has_rop());
  REQUIRE(nn::make_peer_cnn(1).has_rop());
  const nn::Tensor x = test::random_tensor(2, 1, 28, 28, rng);
  net.forward(x, nn::Mode::train);
  std::vector<nn::ConstVector> zero;
  for (const nn::Param& p : net.params()) zero.push_back(nn::Vector("test::zero", p.value.size()));
  const std::vector<float> jv = test::to_host(net.rop(zero));
  for (float e : jv) REQUIRE(e == 0.0f);
  zero.pop_back();
  REQUIRE_THROWS_AS(net.rop(zero), std::invalid_argument);
}

TEST_CASE("Mode::probe normalises with the batch's statistics and leaves the running ones", "[rop]") {
  nn::SplitMix64 rng(19);
  nn::BatchNorm2d bn(2);
  const nn::Tensor x = test::random_tensor(4, 2, 3, 3, rng);
  const std::vector<float> train = test::to_host(bn.forward(x, nn::Mode::train));
  const std::vector<float> mean = test::to_host(bn.running_mean()), var = test::to_host(bn.running_var());
  const std::vector<float> probe = test::to_host(bn.forward(x, nn::Mode::probe));
  CHECK(probe == train);
  CHECK(test::to_host(bn.running_mean()) == mean);
  CHECK(test::to_host(bn.running_var()) == var);
  bn.forward(x, nn::Mode::train);
  CHECK(test::to_host(bn.running_mean()) != mean);
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
