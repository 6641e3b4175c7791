#pragma once
/// \file sigmoid_cross_entropy.hpp
/// \brief The deep autoencoder's reconstruction loss: sigmoid cross-entropy of logits against
/// targets in [0, 1], summed over the outputs of a sample and averaged over the batch; with it,
/// the squared error of the sigmoid's outputs (Martens & Grosse 2015's reported training error).

#include "common/rng.hpp"
#include "common/tensor.hpp"

#include <cmath>

namespace nn {

/// \brief Sums over a batch of reconstructions.
struct ReconstructionStats {
  double loss_sum = 0.0;          ///< sum over samples of the summed cross-entropy
  double squared_error_sum = 0.0; ///< sum over samples of \f$\|\sigma(z) - t\|^2\f$
  long count = 0;
  double mean_loss() const { return count ? loss_sum / double(count) : 0.0; }
  double mean_squared_error() const { return count ? squared_error_sum / double(count) : 0.0; }
  ReconstructionStats& operator+=(const ReconstructionStats& o) {
    loss_sum += o.loss_sum;
    squared_error_sum += o.squared_error_sum;
    count += o.count;
    return *this;
  }
};

namespace detail {

/// Per sample i: loss(i, 0) = sum_j softplus(z) - t z, loss(i, 1) = sum_j (sigmoid(z) - t)^2 and,
/// when `want_grad`, g(i, :) = (sigmoid(z) - t) / N. Outside the class: nvcc rejects device
/// lambdas in private members.
inline ReconstructionStats sigmoid_cross_entropy(const Matrix& z, const Matrix& t, bool want_grad, const Matrix& g,
                                                 const Kokkos::View<double**, Kokkos::LayoutRight, MemSpace>& loss) {
  const int n = int(z.extent(0)), k = int(z.extent(1));
  const float inv_n = 1.0f / float(n);
  Kokkos::parallel_for("nn::sigmoid_xent::per_sample", Kokkos::RangePolicy<ExecSpace>(0, n),
                       KOKKOS_LAMBDA(const int i) {
                         double l = 0.0, e = 0.0;
                         for (int j = 0; j < k; ++j) {
                           const double x = z(i, j), target = t(i, j);
                           // softplus(x) = max(x, 0) + log(1 + exp(-|x|)), stable at both ends
                           l += (x > 0 ? x : 0.0) + std::log1p(std::exp(-std::fabs(x))) - target * x;
                           const double p = 1.0 / (1.0 + std::exp(-x));
                           e += (p - target) * (p - target);
                           if (want_grad) g(i, j) = float(p - target) * inv_n;
                         }
                         loss(i, 0) = l;
                         loss(i, 1) = e;
                       });
  ReconstructionStats stats;
  stats.count = n;
  Kokkos::parallel_reduce("nn::sigmoid_xent::loss_sum", Kokkos::RangePolicy<ExecSpace>(0, n),
                          KOKKOS_LAMBDA(const int i, double& acc) { acc += loss(i, 0); }, stats.loss_sum);
  Kokkos::parallel_reduce("nn::sigmoid_xent::error_sum", Kokkos::RangePolicy<ExecSpace>(0, n),
                          KOKKOS_LAMBDA(const int i, double& acc) { acc += loss(i, 1); }, stats.squared_error_sum);
  return stats;
}

}  // namespace detail

/// \brief \f$L = \frac1N \sum_i \sum_j [\log(1 + e^{z_{ij}}) - t_{ij} z_{ij}]\f$ (the
/// cross-entropy of Bernoulli outputs \f$\sigma(z)\f$, up to the targets' constant entropy) and
/// its gradient \f$(\sigma(z_i) - t_i) / N\f$; its curvature at the logits is
/// \f$\mathrm{diag}(\sigma(1 - \sigma))\f$ per sample (kfac::LossCurvature::sigmoid_cross_entropy).
class SigmoidCrossEntropy {
 public:
  SigmoidCrossEntropy() : grad_("nn::sigmoid_xent::grad"), loss_("nn::sigmoid_xent::loss") {}

  /// \param logits [in] (N, K, 1, 1) or any (N, ...) of K values per sample
  /// \param targets [in] the same shape, values in [0, 1]
  ReconstructionStats forward(const Tensor& logits, const Tensor& targets) { return run(logits, targets, false); }

  /// \brief forward, and also the gradient of the mean loss wrt the logits, in grad().
  ReconstructionStats forward_backward(const Tensor& logits, const Tensor& targets) {
    return run(logits, targets, true);
  }

  /// \brief (N, K, 1, 1) gradient from the last forward_backward.
  const Tensor& grad() const { return grad_view_; }

  /// \brief The gradient of the mean loss at targets drawn from the model's own predictive
  /// distribution, \f$t_{ij} \sim \mathrm{Bernoulli}(\sigma(z_{ij}))\f$, one uniform of `rng` per
  /// output in memory order: \f$(\sigma(z_i) - t_i) / N\f$. Its outer products average to
  /// \f$\mathrm{diag}(\sigma(1 - \sigma)) / N^2\f$ per sample, the loss's curvature at the logits (the
  /// outputs are independent: no off-diagonal terms). Drawn on the host in double (a run repeats
  /// whatever the thread count); in its own buffer (grad() stays).
  /// \param logits [in] (N, K, 1, 1) or any (N, ...) of K values per sample
  /// \return (N, K, 1, 1), valid until the next call
  const Tensor& sampled_grad(const Tensor& logits, SplitMix64& rng) {
    sampled_view_ = fill_on_host(logits, sampled_, [&](const auto& z, const auto& g, int n, int k) {
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < k; ++j) {
          const double p = 1.0 / (1.0 + std::exp(-double(z(i, j))));
          g(i, j) = float((p - (rng.uniform() < p ? 1.0 : 0.0)) / double(n));
        }
    });
    return sampled_view_;
  }

 private:
  ReconstructionStats run(const Tensor& logits, const Tensor& targets, bool want_grad) {
    const Matrix z = as_matrix(logits), t = as_matrix(targets);
    const int n = int(z.extent(0)), k = int(z.extent(1));
    const Matrix g = want_grad ? grad_.matrix(n, k) : Matrix();
    const ReconstructionStats stats = detail::sigmoid_cross_entropy(z, t, want_grad, g, loss_.matrix(n, 2));
    if (want_grad) grad_view_ = as_tensor(g);
    return stats;
  }

  Buffer<float> grad_;
  Buffer<double> loss_;
  Tensor grad_view_;
  Buffer<float> sampled_{"nn::sigmoid_xent::sampled_grad"};
  Tensor sampled_view_;
};

}  // namespace nn
