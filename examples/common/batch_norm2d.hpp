#pragma once
/// \file batch_norm2d.hpp
/// \brief Batch normalisation over (N, H, W) per channel (Ioffe and Szegedy 2015).

#include "common/tensor.hpp"

#include <cmath>
#include <vector>

namespace nn {

/// \brief BatchNorm2d: \f$y = \gamma \hat{x} + \beta\f$, \f$\hat{x} = (x - \mu_c) / \sqrt{\sigma_c^2 + \epsilon}\f$.
///
/// Training uses the batch statistics (biased variance) and updates running statistics with
/// `momentum` (unbiased variance, as PyTorch does); evaluation uses the running statistics;
/// Mode::probe uses the batch statistics and leaves the running ones.
/// Channel sums accumulate in double so the result does not depend on the batch size's rounding.
class BatchNorm2d {
 public:
  explicit BatchNorm2d(int channels, double eps = 1e-5, double momentum = 0.1)
      : channels_(channels), eps_(eps), momentum_(momentum), gamma_("nn::bn::gamma", channels),
        beta_("nn::bn::beta", channels), dgamma_("nn::bn::dgamma", channels), dbeta_("nn::bn::dbeta", channels),
        running_mean_("nn::bn::running_mean", channels), running_var_("nn::bn::running_var", channels),
        inv_std_("nn::bn::inv_std", channels), mean_("nn::bn::mean", channels), xhat_("nn::bn::xhat"), y_("nn::bn::y"),
        dx_("nn::bn::dx"), rop_mean_("nn::bn::rop_mean", channels), rop_cov_("nn::bn::rop_cov", channels),
        ry_("nn::bn::ry") {
    Kokkos::deep_copy(gamma_, 1.0f);
    Kokkos::deep_copy(running_var_, 1.0f);
  }

  Tensor forward(const Tensor& x, Mode mode) {
    const int n = int(x.extent(0)), c_n = channels_, h = int(x.extent(2)), w = int(x.extent(3));
    const Vector inv_std = inv_std_, rmean = running_mean_, rvar = running_var_;
    const Vector mean = mean_;
    const float eps = float(eps_), mom = float(momentum_);
    batch_stats_ = mode != Mode::eval;
    if (batch_stats_) {
      const double m = double(n) * h * w;
      const bool update = mode == Mode::train;
      Kokkos::parallel_for("nn::bn::batch_stats", Kokkos::RangePolicy<ExecSpace>(0, c_n),
                           KOKKOS_LAMBDA(const int c) {
                             // Two passes (mean, then squared deviations) for an accurate variance.
                             double sum = 0.0, sum_sq = 0.0;
                             for (int s = 0; s < n; ++s) {
                               const float* plane = &x(s, c, 0, 0);  // H*W contiguous values
                               sum += sum_of(h * w, [&](int q) { return double(plane[q]); });
                             }
                             const double mu = sum / m;
                             for (int s = 0; s < n; ++s) {
                               const float* plane = &x(s, c, 0, 0);
                               sum_sq += sum_of(h * w, [&](int q) {
                                 const double d = plane[q] - mu;
                                 return d * d;
                               });
                             }
                             const double var = sum_sq / m;
                             mean(c) = float(mu);
                             inv_std(c) = float(1.0 / std::sqrt(var + eps));
                             if (update) {
                               rmean(c) = float((1.0 - mom) * rmean(c) + mom * mu);
                               rvar(c) = float((1.0 - mom) * rvar(c) + mom * var * (m > 1 ? m / (m - 1) : 1.0));
                             }
                           });
    } else {
      Kokkos::parallel_for("nn::bn::running_stats", Kokkos::RangePolicy<ExecSpace>(0, c_n),
                           KOKKOS_LAMBDA(const int c) {
                             mean(c) = rmean(c);
                             inv_std(c) = float(1.0 / std::sqrt(double(rvar(c)) + eps));
                           });
    }
    const Tensor xhat = xhat_.tensor(n, c_n, h, w), y = y_.tensor(n, c_n, h, w);
    const Vector gamma = gamma_, beta = beta_;
    Kokkos::parallel_for("nn::bn::normalize", range4(n, c_n, h, w),
                         KOKKOS_LAMBDA(const int s, const int c, const int r, const int col) {
                           const float v = (x(s, c, r, col) - mean(c)) * inv_std(c);
                           xhat(s, c, r, col) = v;
                           y(s, c, r, col) = gamma(c) * v + beta(c);
                         });
    xhat_view_ = xhat;
    return y;
  }

  /// \brief Backward of a training-mode forward (the batch statistics depend on x).
  Tensor backward(const Tensor& dy, bool need_dx) {
    dy_ = dy;
    const int n = int(dy.extent(0)), c_n = channels_, h = int(dy.extent(2)), w = int(dy.extent(3));
    const Tensor xhat = xhat_view_;
    const Vector dgamma = dgamma_, dbeta = dbeta_;
    Kokkos::parallel_for("nn::bn::param_grad", Kokkos::RangePolicy<ExecSpace>(0, c_n),
                         KOKKOS_LAMBDA(const int c) {
                           double sg = 0.0, sb = 0.0;
                           for (int s = 0; s < n; ++s) {
                             const float* g = &dy(s, c, 0, 0);
                             const float* xh = &xhat(s, c, 0, 0);
                             sg += sum_of(h * w, [&](int q) { return double(g[q]) * double(xh[q]); });
                             sb += sum_of(h * w, [&](int q) { return double(g[q]); });
                           }
                           dgamma(c) = float(sg);
                           dbeta(c) = float(sb);
                         });
    if (!need_dx) return Tensor();
    // dx = gamma * inv_std / M * (M dy - sum(dy) - xhat * sum(dy xhat))
    const Tensor dx = dx_.tensor(n, c_n, h, w);
    const Vector gamma = gamma_, inv_std = inv_std_;
    const float m = float(n) * float(h) * float(w);
    Kokkos::parallel_for("nn::bn::input_grad", range4(n, c_n, h, w),
                         KOKKOS_LAMBDA(const int s, const int c, const int r, const int col) {
                           dx(s, c, r, col) = gamma(c) * inv_std(c) / m *
                                              (m * dy(s, c, r, col) - dbeta(c) - xhat(s, c, r, col) * dgamma(c));
                         });
    return dx;
  }

  /// \brief Forward mode (R-op) of the function the last forward computed:
  /// \f$\dot y = \dot\gamma \hat{x} + \dot\beta + \gamma \dot{\hat{x}}\f$. After a training (or probe)
  /// forward the batch statistics depend on x, and per channel (means over N, H, W)
  /// \f$\dot{\hat{x}} = r(\dot x - \overline{\dot x} - \hat{x}\,\overline{\hat{x}\dot x})\f$ with
  /// \f$r = 1/\sqrt{\sigma^2 + \epsilon}\f$ (from \f$\dot\mu = \overline{\dot x}\f$,
  /// \f$\dot r = -r^2\,\overline{\hat{x}\dot x}\f$); after an evaluation forward the running
  /// statistics are constants and \f$\dot{\hat{x}} = r\dot x\f$. Gradients come from training
  /// forwards, so self-tuned K-FAC's curvature products use the first form.
  /// \param dx [in] \f$\dot x\f$ shaped like the input, or empty (zero)
  /// \param direction [in] \f$\dot\gamma\f$ and \f$\dot\beta\f$: params()' order
  /// \return \f$\dot y\f$, (N, C, H, W), owned by this layer until its next rop
  Tensor rop(const Tensor& dx, const std::vector<ConstVector>& direction) {
    const Tensor xhat = xhat_view_;
    const int n = int(xhat.extent(0)), c_n = channels_, h = int(xhat.extent(2)), w = int(xhat.extent(3));
    const Vector mean_dx = rop_mean_, cov = rop_cov_;  // per channel: mean of dx, mean of xhat * dx
    const bool moving = dx.data() != nullptr, batch = batch_stats_ && moving;
    if (batch) {
      const double m = double(n) * h * w;
      Kokkos::parallel_for("nn::bn::rop_stats", Kokkos::RangePolicy<ExecSpace>(0, c_n), KOKKOS_LAMBDA(const int c) {
        double sum = 0.0, sum_xd = 0.0;
        for (int s = 0; s < n; ++s) {
          const float* d = &dx(s, c, 0, 0);
          const float* xh = &xhat(s, c, 0, 0);
          sum += sum_of(h * w, [&](int q) { return double(d[q]); });
          sum_xd += sum_of(h * w, [&](int q) { return double(xh[q]) * double(d[q]); });
        }
        mean_dx(c) = float(sum / m);
        cov(c) = float(sum_xd / m);
      });
    }
    const Tensor ry = ry_.tensor(n, c_n, h, w);
    const ConstVector dgamma = direction.at(0), dbeta = direction.at(1);
    const Vector gamma = gamma_, inv_std = inv_std_;
    Kokkos::parallel_for("nn::bn::rop", range4(n, c_n, h, w),
                         KOKKOS_LAMBDA(const int s, const int c, const int r, const int col) {
                           const float v = xhat(s, c, r, col);
                           float out = dgamma(c) * v + dbeta(c);
                           if (moving) {
                             const float d = batch ? dx(s, c, r, col) - mean_dx(c) - v * cov(c) : dx(s, c, r, col);
                             out += gamma(c) * inv_std(c) * d;
                           }
                           ry(s, c, r, col) = out;
                         });
    return ry;
  }

  std::vector<Param> params() const {
    return {{"gamma", gamma_, dgamma_, false}, {"beta", beta_, dbeta_, false}};
  }

  int channels() const { return channels_; }
  const Vector& gamma() const { return gamma_; }
  const Vector& beta() const { return beta_; }
  const Vector& gamma_grad() const { return dgamma_; }
  const Vector& beta_grad() const { return dbeta_; }
  const Vector& running_mean() const { return running_mean_; }
  const Vector& running_var() const { return running_var_; }
  /// \brief The normalised input \f$\hat{x}\f$ (N, C, H, W) of the last forward pass.
  const Tensor& normalized_input() const { return xhat_view_; }
  /// \brief Gradient of the loss wrt the output y from the last backward pass.
  const Tensor& output_grad() const { return dy_; }

 private:
  int channels_;
  double eps_, momentum_;
  Vector gamma_, beta_, dgamma_, dbeta_, running_mean_, running_var_, inv_std_, mean_;
  Buffer<float> xhat_, y_, dx_;
  Tensor xhat_view_, dy_;
  Vector rop_mean_, rop_cov_;
  Buffer<float> ry_;
  bool batch_stats_ = true;  ///< whether the last forward normalised with the batch's statistics
};

}  // namespace nn
