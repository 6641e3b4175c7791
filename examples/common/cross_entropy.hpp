#pragma once
/// \file cross_entropy.hpp
/// \brief Softmax cross-entropy with mean reduction over the batch.

#include "common/rng.hpp"
#include "common/tensor.hpp"

#include <cmath>
#include <vector>

namespace nn {

/// \brief Sums over a batch, so that evaluation can add batches before dividing.
struct BatchStats {
  double loss_sum = 0.0;  ///< sum over samples of -log p(label)
  long correct = 0;       ///< samples whose arg-max logit is the label
  long count = 0;
  double mean_loss() const { return count ? loss_sum / double(count) : 0.0; }
  double accuracy() const { return count ? double(correct) / double(count) : 0.0; }
  BatchStats& operator+=(const BatchStats& o) {
    loss_sum += o.loss_sum;
    correct += o.correct;
    count += o.count;
    return *this;
  }
};

/// Kernels of SoftmaxCrossEntropy, outside the class: nvcc rejects device lambdas in private
/// members. Per sample: loss(i, 0), hit(i, 0) and, when `want_grad`, the row g(i, :).
namespace detail {

inline BatchStats softmax_cross_entropy(const Matrix& z, const Labels& labels, bool want_grad, const Matrix& g,
                                        const Kokkos::View<double**, Kokkos::LayoutRight, MemSpace>& loss,
                                        const Kokkos::View<int**, Kokkos::LayoutRight, MemSpace>& hit) {
  const int n = int(z.extent(0)), k = int(z.extent(1));
  const float inv_n = 1.0f / float(n);
  Kokkos::parallel_for("nn::xent::per_sample", Kokkos::RangePolicy<ExecSpace>(0, n),
                       KOKKOS_LAMBDA(const int i) {
                         int arg = 0;
                         for (int j = 1; j < k; ++j)
                           if (z(i, j) > z(i, arg)) arg = j;
                         const double zmax = z(i, arg);
                         double sum = 0.0;
                         for (int j = 0; j < k; ++j) sum += std::exp(double(z(i, j)) - zmax);
                         const int y = labels(i);
                         loss(i, 0) = std::log(sum) - (double(z(i, y)) - zmax);
                         hit(i, 0) = arg == y ? 1 : 0;
                         if (want_grad)
                           for (int j = 0; j < k; ++j) {
                             const double p = std::exp(double(z(i, j)) - zmax) / sum;
                             g(i, j) = float(p - (j == y ? 1.0 : 0.0)) * inv_n;
                           }
                       });
  BatchStats stats;
  stats.count = n;
  Kokkos::parallel_reduce("nn::xent::loss_sum", Kokkos::RangePolicy<ExecSpace>(0, n),
                          KOKKOS_LAMBDA(const int i, double& acc) { acc += loss(i, 0); }, stats.loss_sum);
  Kokkos::parallel_reduce("nn::xent::correct", Kokkos::RangePolicy<ExecSpace>(0, n),
                          KOKKOS_LAMBDA(const int i, long& acc) { acc += hit(i, 0); }, stats.correct);
  return stats;
}

}  // namespace detail

/// \brief \f$L = \frac{1}{N}\sum_i -\log \mathrm{softmax}(z_i)_{y_i}\f$ and its gradient
/// \f$\partial L / \partial z_i = (\mathrm{softmax}(z_i) - e_{y_i}) / N\f$.
class SoftmaxCrossEntropy {
 public:
  SoftmaxCrossEntropy() : grad_("nn::xent::grad"), loss_("nn::xent::loss"), hit_("nn::xent::hit") {}

  /// \param logits [in] (N, K, 1, 1)
  /// \param labels [in] N labels in [0, K)
  BatchStats forward(const Tensor& logits, const Labels& labels) { return run(logits, labels, false); }

  /// \brief forward, and also the gradient of the mean loss wrt the logits, in grad().
  BatchStats forward_backward(const Tensor& logits, const Labels& labels) { return run(logits, labels, true); }

  /// \brief (N, K, 1, 1) gradient from the last forward_backward.
  const Tensor& grad() const { return grad_view_; }

  /// \brief The gradient of the mean loss at labels drawn from the model's own predictive
  /// distribution, \f$y_i \sim \mathrm{softmax}(z_i)\f$, one uniform of `rng` per sample in
  /// sample order: \f$(p_i - e_{y_i}) / N\f$. Its outer products average to
  /// \f$(\mathrm{diag}(p_i) - p_i p_i^T) / N^2\f$, the loss's curvature at the logits (the true
  /// Fisher, Martens & Grosse 2015, section 5). Drawn on the host in double, so a run repeats
  /// whatever the thread count; in its own buffer (grad() stays).
  /// \param logits [in] (N, K, 1, 1)
  /// \return (N, K, 1, 1), valid until the next call
  const Tensor& sampled_grad(const Tensor& logits, SplitMix64& rng) {
    sampled_view_ = fill_on_host(logits, sampled_, [&](const auto& z, const auto& g, int n, int k) {
      std::vector<double> p(std::size_t(k), 0.0);
      for (int i = 0; i < n; ++i) {
        double zmax = z(i, 0), sum = 0.0;
        for (int j = 1; j < k; ++j) zmax = std::fmax(zmax, double(z(i, j)));
        for (int j = 0; j < k; ++j) sum += (p[std::size_t(j)] = std::exp(double(z(i, j)) - zmax));
        const double u = rng.uniform() * sum;  // y: the first class whose cumulative weight exceeds u
        int y = k - 1;
        double below = 0.0;
        for (int j = 0; j < k - 1; ++j)
          if (u < (below += p[std::size_t(j)])) {
            y = j;
            break;
          }
        for (int j = 0; j < k; ++j) g(i, j) = float((p[std::size_t(j)] / sum - (j == y ? 1.0 : 0.0)) / double(n));
      }
    });
    return sampled_view_;
  }

 private:
  BatchStats run(const Tensor& logits, const Labels& labels, bool want_grad) {
    const Matrix z = as_matrix(logits);
    const int n = int(z.extent(0)), k = int(z.extent(1));
    const Matrix g = want_grad ? grad_.matrix(n, k) : Matrix();
    const auto loss = loss_.matrix(n, 1);
    const auto hit = hit_.matrix(n, 1);
    const BatchStats stats = detail::softmax_cross_entropy(z, labels, want_grad, g, loss, hit);
    if (want_grad) grad_view_ = as_tensor(g);
    return stats;
  }

  Buffer<float> grad_;
  Buffer<double> loss_;
  Buffer<int> hit_;
  Tensor grad_view_;
  Buffer<float> sampled_{"nn::xent::sampled_grad"};
  Tensor sampled_view_;
};

}  // namespace nn
