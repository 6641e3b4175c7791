// Layers of examples/common: forward against naive double loops, backward against central
// finite differences of L = <forward(x), r> for a fixed random r (so dL/dy = r).

#include "common/batch_norm2d.hpp"
#include "common/conv2d.hpp"
#include "common/cross_entropy.hpp"
#include "common/dense.hpp"
#include "common/max_pool2d.hpp"
#include "common/network.hpp"
#include "common/relu.hpp"
#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <vector>

namespace {

using nn::Mode;
using nn::Tensor;

constexpr float layer_h = 1e-2f;  // finite-difference step: float outputs, O(1) inputs
constexpr double tol = 2e-3;      // absolute and relative

/// Compares `analytic` (copied to the host before probing) with central differences of `loss`
/// in `count` elements of `v` picked at random (all of them if the view is small).
template <class View>
void check_gradient(const char* what, const View& v, const std::vector<float>& analytic,
                    const std::function<double()>& loss, nn::SplitMix64& rng, std::size_t count = 24,
                    float h = layer_h) {
  REQUIRE(analytic.size() == v.size());
  const std::size_t n = v.size();
  for (std::size_t k = 0; k < std::min(count, n); ++k) {
    const std::size_t i = n <= count ? k : std::size_t(rng.below(n));
    const float orig = test::get(v, i);
    test::set(v, i, orig + h);
    const double up = loss();
    test::set(v, i, orig - h);
    const double down = loss();
    test::set(v, i, orig);
    const double fd = (up - down) / (2.0 * double(h));
    INFO(what << "[" << i << "]: finite difference " << fd << ", backward " << analytic[i]);
    CHECK(analytic[i] == Approx(fd).margin(tol).epsilon(tol));
  }
}

template <class Layer>
struct Probe {
  Layer& layer;
  Tensor x, r;
  double loss() { return test::dot(layer.forward(x, Mode::train), r); }
};

/// Runs forward, builds r, runs backward, and returns (dx on the host, r).
template <class Layer>
std::vector<float> forward_backward(Layer& layer, const Tensor& x, Tensor& r, nn::SplitMix64& rng) {
  const Tensor y = layer.forward(x, Mode::train);
  r = test::random_tensor(int(y.extent(0)), int(y.extent(1)), int(y.extent(2)), int(y.extent(3)), rng);
  return test::to_host(layer.backward(r, true));
}

}  // namespace

TEST_CASE("Dense forward matches a double reference and backward matches finite differences", "[layers][dense]") {
  nn::SplitMix64 rng(11);
  const int n = 3, in = 5, out = 4;
  nn::Dense layer(in, out, true, nn::Init::he, rng);
  test::from_host(layer.bias(), test::uniform(out, rng));
  const Tensor x = test::random_tensor(n, in, 1, 1, rng);

  const auto y = test::to_host(layer.forward(x, Mode::train));
  const auto xs = test::to_host(x), w = test::to_host(layer.weight()), b = test::to_host(layer.bias());
  for (int s = 0; s < n; ++s)
    for (int o = 0; o < out; ++o) {
      double ref = b[o];
      for (int i = 0; i < in; ++i) ref += double(xs[s * in + i]) * w[o * in + i];
      CHECK(y[s * out + o] == Approx(ref).margin(1e-5));
    }

  Tensor r;
  const auto dx = forward_backward(layer, x, r, rng);
  const auto dw = test::to_host(layer.weight_grad()), db = test::to_host(layer.bias_grad());
  Probe<nn::Dense> p{layer, x, r};
  auto loss = [&] { return p.loss(); };
  check_gradient("dx", x, dx, loss, rng);
  check_gradient("dW", layer.weight(), dw, loss, rng);
  check_gradient("db", layer.bias(), db, loss, rng);
  CHECK(layer.output_grad().extent(0) == std::size_t(n));
  CHECK(layer.input().extent(1) == std::size_t(in));
}

TEST_CASE("Conv2d forward matches a direct convolution and backward matches finite differences",
          "[layers][conv2d]") {
  nn::SplitMix64 rng(12);
  const int n = 2, c = 3, hh = 7, ww = 6, o = 4, kh = 3, kw = 2, stride = 2, pad = 1;
  nn::Conv2d layer(nn::Conv2dShape{c, o, kh, kw}.with_stride(stride).with_padding(pad), nn::Init::he, rng);
  test::from_host(layer.bias(), test::uniform(o, rng));
  const Tensor x = test::random_tensor(n, c, hh, ww, rng);

  const Tensor y = layer.forward(x, Mode::train);
  const int ho = (hh + 2 * pad - kh) / stride + 1, wo = (ww + 2 * pad - kw) / stride + 1;
  REQUIRE(int(y.extent(2)) == ho);
  REQUIRE(int(y.extent(3)) == wo);
  const auto ys = test::to_host(y), xs = test::to_host(x), w = test::to_host(layer.weight()),
             b = test::to_host(layer.bias());
  for (int s = 0; s < n; ++s)
    for (int oc = 0; oc < o; ++oc)
      for (int i = 0; i < ho; ++i)
        for (int j = 0; j < wo; ++j) {
          double ref = b[oc];
          for (int ci = 0; ci < c; ++ci)
            for (int a = 0; a < kh; ++a)
              for (int e = 0; e < kw; ++e) {
                const int ih = i * stride - pad + a, iw = j * stride - pad + e;
                if (ih < 0 || ih >= hh || iw < 0 || iw >= ww) continue;
                ref += double(xs[((s * c + ci) * hh + ih) * ww + iw]) * w[((oc * c + ci) * kh + a) * kw + e];
              }
          CHECK(ys[((s * o + oc) * ho + i) * wo + j] == Approx(ref).margin(1e-5));
        }

  Tensor r;
  const auto dx = forward_backward(layer, x, r, rng);
  const auto dw = test::to_host(layer.weight_grad()), db = test::to_host(layer.bias_grad());
  Probe<nn::Conv2d> p{layer, x, r};
  auto loss = [&] { return p.loss(); };
  check_gradient("dx", x, dx, loss, rng, 40);
  check_gradient("dW", layer.weight(), dw, loss, rng, 40);
  check_gradient("db", layer.bias(), db, loss, rng);
}

TEST_CASE("BatchNorm2d normalises per channel and backward matches finite differences", "[layers][batchnorm]") {
  nn::SplitMix64 rng(13);
  const int n = 4, c = 3, hh = 3, ww = 2;
  nn::BatchNorm2d layer(c);
  test::from_host(layer.gamma(), test::uniform(c, rng, 0.5, 1.5));
  test::from_host(layer.beta(), test::uniform(c, rng));
  const Tensor x = test::random_tensor(n, c, hh, ww, rng);

  layer.forward(x, Mode::train);
  const auto xhat = test::to_host(layer.normalized_input());
  for (int ch = 0; ch < c; ++ch) {
    double sum = 0.0, sq = 0.0;
    for (int s = 0; s < n; ++s)
      for (int q = 0; q < hh * ww; ++q) {
        const double v = xhat[(s * c + ch) * hh * ww + q];
        sum += v;
        sq += v * v;
      }
    const double m = n * hh * ww;
    CHECK(sum / m == Approx(0.0).margin(1e-5));
    CHECK(sq / m == Approx(1.0).epsilon(1e-3));  // 1 - eps/var
  }

  Tensor r;
  const auto dx = forward_backward(layer, x, r, rng);
  CHECK(layer.output_grad().data() == r.data());
  const auto dgamma = test::to_host(layer.gamma_grad()), dbeta = test::to_host(layer.beta_grad());
  Probe<nn::BatchNorm2d> p{layer, x, r};
  auto loss = [&] { return p.loss(); };
  check_gradient("dx", x, dx, loss, rng, 48);
  check_gradient("dgamma", layer.gamma(), dgamma, loss, rng);
  check_gradient("dbeta", layer.beta(), dbeta, loss, rng);
}

TEST_CASE("BatchNorm2d evaluates with running statistics", "[layers][batchnorm]") {
  nn::SplitMix64 rng(14);
  nn::BatchNorm2d layer(2, 1e-5, 1.0);  // momentum 1: running stats = last batch's
  const Tensor x = test::random_tensor(8, 2, 2, 2, rng);
  const auto train = test::to_host(layer.forward(x, Mode::train));
  const auto eval = test::to_host(layer.forward(x, Mode::eval));
  // Same data, but eval divides by the unbiased variance: m/(m-1) with m = 32.
  for (std::size_t i = 0; i < train.size(); ++i)
    CHECK(eval[i] == Approx(train[i] * std::sqrt(31.0 / 32.0)).margin(1e-4));
}

TEST_CASE("ReLU and MaxPool2d backward match finite differences away from their kinks", "[layers]") {
  nn::SplitMix64 rng(15);
  const int n = 2, c = 2, hh = 5, ww = 4;  // odd height: the last row is dropped by pooling
  Tensor x("test::x", n, c, hh, ww);
  // Values 0.1 apart and at least 0.05 from zero, so a step of h never crosses a kink.
  const std::vector<int> order = nn::permutation(int(x.size()), rng);
  std::vector<float> v(x.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.1f * float(order[i] - int(v.size()) / 2) + 0.05f;
  test::from_host(x, v);

  nn::ReLU relu;
  Tensor r;
  const auto drelu = forward_backward(relu, x, r, rng);
  Probe<nn::ReLU> pr{relu, x, r};
  check_gradient("relu dx", x, drelu, [&] { return pr.loss(); }, rng, 80);

  nn::MaxPool2d pool;
  const auto dpool = forward_backward(pool, x, r, rng);
  CHECK(r.extent(2) == 2);
  Probe<nn::MaxPool2d> pp{pool, x, r};
  check_gradient("maxpool dx", x, dpool, [&] { return pp.loss(); }, rng, 80);
}

TEST_CASE("softmax cross-entropy: value, accuracy and gradient", "[layers][loss]") {
  nn::SplitMix64 rng(16);
  const int n = 5, k = 4;
  const Tensor z = test::random_tensor(n, k, 1, 1, rng);
  nn::Labels y("test::y", n);
  auto hy = Kokkos::create_mirror_view(y);
  for (int i = 0; i < n; ++i) hy(i) = i % k;
  Kokkos::deep_copy(y, hy);

  nn::SoftmaxCrossEntropy xent;
  const nn::BatchStats stats = xent.forward_backward(z, y);
  const auto zs = test::to_host(z);
  double ref = 0.0;
  long correct = 0;
  for (int i = 0; i < n; ++i) {
    double sum = 0.0;
    int arg = 0;
    for (int j = 0; j < k; ++j) {
      sum += std::exp(double(zs[i * k + j]));
      if (zs[i * k + j] > zs[i * k + arg]) arg = j;
    }
    ref += std::log(sum) - zs[i * k + i % k];
    correct += arg == i % k;
  }
  CHECK(stats.mean_loss() == Approx(ref / n).epsilon(1e-6));
  CHECK(stats.correct == correct);

  const auto g = test::to_host(xent.grad());
  check_gradient("dz", z, g, [&] { return nn::SoftmaxCrossEntropy().forward(z, y).mean_loss(); }, rng);
}

TEST_CASE("whole networks: parameter gradients match finite differences", "[layers][network]") {
  for (const char* model : {"mlp", "cnn"}) {
    DYNAMIC_SECTION(model) {
      nn::Network net = nn::make_model(model, 7);
      nn::SplitMix64 rng(17);
      const std::vector<int> labels{0, 3, 9, 3, 5, 1};
      const nn::Dataset data = nn::make_dataset(test::uniform(6 * 784, rng), labels, 1, 28, 28, 10);
      const nn::Batch b = nn::slice(data, 0, 6);
      nn::SoftmaxCrossEntropy xent;
      xent.forward_backward(net.forward(b.x, Mode::train), b.y);
      net.backward(xent.grad());
      auto loss = [&] { return nn::SoftmaxCrossEntropy().forward(net.forward(b.x, Mode::train), b.y).mean_loss(); };
      for (const nn::Param& p : net.params()) {
        const auto g = test::to_host(p.grad);
        check_gradient(p.name.c_str(), p.value, g, loss, rng, 4, 1e-3f);
      }
    }
  }
}
