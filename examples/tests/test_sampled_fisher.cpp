// The sampled (true) Fisher of the examples' losses (--fisher sampled): the outer products of
// Loss::sampled_grad, averaged over many draws, against the losses' curvature at the logits
// computed independently in double (softmax cross-entropy: diag(p) - p p^T; sigmoid
// cross-entropy: diag(p(1 - p))), per sample; through a small network's backward pass, the
// Kronecker factor G of its first layer against the mean of J^T F J; and nn::KfacSgd's step. The
// tolerance is 5 standard errors of each averaged entry (estimated from the draws) plus float
// rounding; drawing from another distribution (uniform labels, the data's labels, fair coins)
// fails it.

#include "common/cross_entropy.hpp"
#include "common/kfac_glue.hpp"
#include "common/network.hpp"
#include "common/sigmoid_cross_entropy.hpp"
#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

/// Running mean and variance of every entry of a (rows x rows) matrix of draws.
struct Moments {
  int rows;
  std::vector<double> sum, sum_sq;
  long draws = 0;
  explicit Moments(int r) : rows(r), sum(std::size_t(r) * r), sum_sq(std::size_t(r) * r) {}
  /// Adds the outer product of `v` (rows values).
  void add(const std::vector<double>& v) {
    for (int a = 0; a < rows; ++a)
      for (int b = 0; b < rows; ++b) {
        const double x = v[std::size_t(a)] * v[std::size_t(b)];
        sum[std::size_t(a) * rows + b] += x;
        sum_sq[std::size_t(a) * rows + b] += x * x;
      }
    ++draws;
  }
  double mean(int a, int b) const { return sum[std::size_t(a) * rows + b] / double(draws); }
  double standard_error(int a, int b) const {
    const double m = mean(a, b), var = sum_sq[std::size_t(a) * rows + b] / double(draws) - m * m;
    return std::sqrt(std::max(var, 0.0) / double(draws));
  }
};

/// Checks `m` against `expected` (row-major rows x rows) entry by entry; returns the largest
/// |error| / standard error seen, for the record.
double check_against(const Moments& m, const std::vector<double>& expected, const char* what) {
  double worst = 0;
  for (int a = 0; a < m.rows; ++a)
    for (int b = 0; b < m.rows; ++b) {
      const double err = std::fabs(m.mean(a, b) - expected[std::size_t(a) * m.rows + b]);
      const double se = m.standard_error(a, b);
      INFO(what << " entry (" << a << ", " << b << "): mean " << m.mean(a, b) << ", expected "
                << expected[std::size_t(a) * m.rows + b] << ", standard error " << se);
      CHECK(err <= 5.0 * se + 1e-6);
      if (se > 0) worst = std::max(worst, err / se);
    }
  std::printf("%s: %ld draws, largest |error| / standard error %.2f\n", what, m.draws, worst);
  return worst;
}

/// Row i of an (n, k) tensor, in double, times `scale`.
std::vector<double> row(const std::vector<float>& values, int i, int k, double scale) {
  std::vector<double> r(static_cast<std::size_t>(k));
  for (int j = 0; j < k; ++j) r[std::size_t(j)] = scale * double(values[std::size_t(i) * k + j]);
  return r;
}

/// The per-sample curvature at logits z (n x k) of each loss, in double: softmax cross-entropy's
/// diag(p) - p p^T, or sigmoid cross-entropy's diag(p(1 - p)).
std::vector<double> softmax_fisher(const std::vector<float>& z, int i, int k) {
  std::vector<double> p(static_cast<std::size_t>(k)), f(static_cast<std::size_t>(k) * k);
  double zmax = -1e300, sum = 0;
  for (int j = 0; j < k; ++j) zmax = std::max(zmax, double(z[std::size_t(i) * k + j]));
  for (int j = 0; j < k; ++j) sum += (p[std::size_t(j)] = std::exp(double(z[std::size_t(i) * k + j]) - zmax));
  for (double& x : p) x /= sum;
  for (int a = 0; a < k; ++a)
    for (int b = 0; b < k; ++b)
      f[std::size_t(a) * k + b] = (a == b ? p[std::size_t(a)] : 0.0) - p[std::size_t(a)] * p[std::size_t(b)];
  return f;
}
std::vector<double> sigmoid_fisher(const std::vector<float>& z, int i, int k) {
  std::vector<double> f(std::size_t(k) * k, 0.0);
  for (int j = 0; j < k; ++j) {
    const double p = 1.0 / (1.0 + std::exp(-double(z[std::size_t(i) * k + j])));
    f[std::size_t(j) * k + j] = p * (1 - p);
  }
  return f;
}

/// Draws `draws` sampled gradients of `loss` at random logits (n x k) and checks each sample's
/// averaged outer product of N g (the gradient of the per-sample loss) against `fisher`.
template <class Loss>
void check_loss(Loss& loss, int n, int k, int draws, const char* what,
                const std::function<std::vector<double>(const std::vector<float>&, int, int)>& fisher) {
  nn::SplitMix64 init(7);
  const nn::Tensor logits = test::random_tensor(n, k, 1, 1, init);
  const std::vector<float> z = test::to_host(logits);
  std::vector<Moments> per_sample(static_cast<std::size_t>(n), Moments(k));
  nn::SplitMix64 rng(nn::derive_seed(1, 4));
  for (int d = 0; d < draws; ++d) {
    const std::vector<float> g = test::to_host(loss.sampled_grad(logits, rng));
    for (int i = 0; i < n; ++i) per_sample[std::size_t(i)].add(row(g, i, k, double(n)));
  }
  for (int i = 0; i < n; ++i) check_against(per_sample[std::size_t(i)], fisher(z, i, k), what);
}

}  // namespace

TEST_CASE("softmax cross-entropy: sampled outer products average to diag(p) - p p^T", "[sampled_fisher]") {
  nn::SoftmaxCrossEntropy loss;
  check_loss(loss, 3, 5, 4000, "softmax cross-entropy", softmax_fisher);
}

TEST_CASE("sigmoid cross-entropy: sampled outer products average to diag(p(1 - p))", "[sampled_fisher]") {
  nn::SigmoidCrossEntropy loss;
  check_loss(loss, 3, 6, 4000, "sigmoid cross-entropy", sigmoid_fisher);
}

TEST_CASE("sampled gradients: their own buffer, the same draws from the same seed", "[sampled_fisher]") {
  nn::SplitMix64 init(3);
  const nn::Tensor logits = test::random_tensor(8, 10, 1, 1, init);
  nn::Labels labels("labels", 8);
  nn::SoftmaxCrossEntropy loss;
  loss.forward_backward(logits, labels);
  const std::vector<float> data_grad = test::to_host(loss.grad());
  nn::SplitMix64 a(11), b(11);
  const std::vector<float> first = test::to_host(loss.sampled_grad(logits, a));
  CHECK(test::to_host(loss.grad()) == data_grad);
  CHECK(test::to_host(loss.sampled_grad(logits, b)) == first);
  CHECK(first != data_grad);
}

// Through the network: the first layer's output gradients g = J^T (N dL/dz) of a
// Dense(4 -> 6) - Sigmoid - Dense(6 -> 3) network under sampled labels average, over the batch and
// the draws, to mean_i J_i^T F_i J_i with J_i = W2 diag(s_i (1 - s_i)) (s = sigmoid of the first
// layer's output), in double from the same parameters: what K-FAC's G of that layer estimates.
TEST_CASE("sampled Fisher through a network: the first layer's G is the mean of J^T F J", "[sampled_fisher]") {
  const int n = 4, in = 4, hidden = 6, out = 3, draws = 3000;
  nn::SplitMix64 rng_init(5);
  nn::Network net;
  net.add("fc1", nn::Dense(in, hidden, true, nn::Init::lecun, rng_init));
  net.add("sig", nn::Sigmoid());
  net.add("fc2", nn::Dense(hidden, out, true, nn::Init::lecun, rng_init));
  const std::vector<nn::Param> params = net.params();
  for (const nn::Param& p : params) test::from_host(p.value, test::uniform(p.value.size(), rng_init, -1.5, 1.5));
  const nn::Tensor x = test::random_tensor(n, in, 1, 1, rng_init);
  const nn::Tensor logits = net.forward(x, nn::Mode::train);
  const std::vector<float> z = test::to_host(logits), xs = test::to_host(x);
  const std::vector<float> w1 = test::to_host(params[0].value), b1 = test::to_host(params[1].value);
  const std::vector<float> w2 = test::to_host(params[2].value);
  std::vector<double> expected(std::size_t(hidden) * hidden, 0.0);
  for (int i = 0; i < n; ++i) {
    std::vector<double> j(std::size_t(out) * hidden);  // dz / dh, (out x hidden)
    for (int h = 0; h < hidden; ++h) {
      double a = b1[std::size_t(h)];
      for (int c = 0; c < in; ++c) a += double(w1[std::size_t(h) * in + c]) * double(xs[std::size_t(i) * in + c]);
      const double s = 1.0 / (1.0 + std::exp(-a));
      for (int o = 0; o < out; ++o)
        j[std::size_t(o) * hidden + h] = double(w2[std::size_t(o) * hidden + h]) * s * (1 - s);
    }
    const std::vector<double> f = softmax_fisher(z, i, out);
    for (int a = 0; a < hidden; ++a)
      for (int b = 0; b < hidden; ++b) {
        double v = 0;
        for (int o = 0; o < out; ++o)
          for (int q = 0; q < out; ++q)
            v += j[std::size_t(o) * hidden + a] * f[std::size_t(o) * out + q] * j[std::size_t(q) * hidden + b];
        expected[std::size_t(a) * hidden + b] += v / double(n);
      }
  }
  nn::SoftmaxCrossEntropy loss;
  nn::SplitMix64 rng(nn::derive_seed(2, 4));
  Moments g_factor(hidden);
  for (int d = 0; d < draws; ++d) {
    net.backward(loss.sampled_grad(logits, rng));
    nn::Dense* fc1 = nullptr;
    net.for_each_layer([&](const std::string& name, auto& layer) {
      if constexpr (std::is_same_v<std::decay_t<decltype(layer)>, nn::Dense>)
        if (name == "fc1") fc1 = &layer;
    });
    REQUIRE(fc1);
    const nn::Matrix dy = fc1->output_grad();
    std::vector<float> g(dy.size());
    Kokkos::deep_copy(Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>(g.data(), n, hidden), dy);
    for (int i = 0; i < n; ++i) g_factor.add(row(g, i, hidden, double(n)));  // per-sample rows: G's mean over n
  }
  check_against(g_factor, expected, "network G (softmax)");
}

#if KFAC_EXAMPLES_HAVE_KFAC
namespace {

/// One K-FAC step as nn::Trainer takes it (forward, the sampled passes, the data's backward pass,
/// the preconditioned SGD step) on a small fixed network and batch; returns the parameters' change
/// and, in `data_grad`, the data's gradient the step started from.
std::vector<float> kfac_step(const nn::KfacSettings& s, std::vector<float>* data_grad = nullptr) {
  nn::SplitMix64 rng(9);
  nn::Network net;
  net.add("fc1", nn::Dense(5, 7, true, nn::Init::lecun, rng));
  net.add("sig", nn::Sigmoid());
  net.add("fc2", nn::Dense(7, 4, true, nn::Init::lecun, rng));
  const nn::Tensor x = test::random_tensor(16, 5, 1, 1, rng);
  nn::Labels labels("labels", 16);
  Kokkos::parallel_for("test::labels", Kokkos::RangePolicy<nn::ExecSpace>(0, 16),
                       KOKKOS_LAMBDA(const int i) { labels(i) = (3 * i) % 4; });
  auto flat = [&](bool grads) {
    std::vector<float> all;
    for (const nn::Param& p : net.params())
      for (float v : test::to_host(grads ? p.grad : p.value)) all.push_back(v);
    return all;
  };
  const std::vector<float> before = flat(false);
  nn::KfacSgd kfac(net, s);
  nn::SoftmaxCrossEntropy loss;
  const nn::Tensor logits = net.forward(x, nn::Mode::train);
  loss.forward_backward(logits, labels);
  kfac.observe_sampled(net, logits, loss);
  net.backward(loss.grad());
  if (data_grad) *data_grad = flat(true);
  kfac.step(net);
  std::vector<float> change = flat(false);
  for (std::size_t i = 0; i < change.size(); ++i) change[i] -= before[i];
  return change;
}

nn::KfacSettings sampled_settings(std::uint64_t seed) {
  nn::KfacSettings s;
  s.inverse = "eigen";
  s.kl_clip = 0;
  s.momentum = 0;
  s.lr = 1;
  s.factor_update_steps = 1;
  s.inv_update_steps = 1;
  s.fisher = "sampled";
  s.fisher_seed = seed;
  return s;
}

}  // namespace

// The statistics come from the draws: the same seed gives the same step, another seed another
// (a sampler that observed nothing, or the data's outputs, would give one step for every seed),
// and two draws another again; the gradient preconditioned is the data's: under a damping far
// above the factors' eigenvalues the step is -lr g / damping with g the data's gradient (not the
// last sampled pass's).
TEST_CASE("KfacSgd --fisher sampled: statistics from the draws, the step from the data's gradient",
          "[sampled_fisher][kfac]") {
  const std::vector<float> a = kfac_step(sampled_settings(1));
  CHECK(kfac_step(sampled_settings(1)) == a);
  CHECK(kfac_step(sampled_settings(2)) != a);
  nn::KfacSettings two = sampled_settings(1);
  two.fisher_samples = 2;
  CHECK(kfac_step(two) != a);
  nn::KfacSettings empirical = sampled_settings(1);
  empirical.fisher = "empirical";
  CHECK(kfac_step(empirical) != a);

  nn::KfacSettings damped = sampled_settings(1);
  damped.damping = damped.lr = 1e4;  // lr / (damping + eigenvalue) ~ 1: a float step of -g
  std::vector<float> g;
  const std::vector<float> step = kfac_step(damped, &g);
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    err += std::pow(double(step[i]) + double(g[i]), 2);
    norm += double(g[i]) * double(g[i]);
  }
  CHECK(std::sqrt(err) <= 1e-3 * std::sqrt(norm));
}
#endif
