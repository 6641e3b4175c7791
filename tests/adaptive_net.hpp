#pragma once
// A host for the self-tuning tests (test_adaptive, test_mpi_adaptive): a two-layer tanh network
// with softmax cross-entropy in double, its backward pass with K-FAC observations, Jacobian-vector
// products by central finite differences, and the closed forms of the quadratic model written
// independently of kfac (explicit H_L per sample, long double, Cramer's rule).
#include <cmath>
#include <cstdint>
#include <kfac/kfac.hpp>
#include <vector>

#include "reference.hpp"

namespace kfac_test {
namespace adaptive {

using HostSpace = Kokkos::HostSpace;
using M = Kokkos::View<double**, Kokkos::LayoutRight, HostSpace>;
using Vec = Kokkos::View<double*, Kokkos::LayoutRight, HostSpace>;
using Flat = std::vector<double>;

/// x (n, d) from (seed) and learnable labels in [0, k): the largest entry of T x for a fixed T.
struct Batch {
  M x;
  std::vector<int> y;
  Batch(int n, int d, int k, std::uint64_t seed) : x("x", n, d), y(std::size_t(n)) {
    Rng rng(seed), teacher(7);
    std::vector<double> t(std::size_t(k * d));
    for (auto& v : t) v = teacher.uniform();
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < d; ++j) x(i, j) = rng.uniform();
      double best = -1e300;
      for (int c = 0; c < k; ++c) {
        double s = 0;
        for (int j = 0; j < d; ++j) s += t[std::size_t(c * d + j)] * x(i, j);
        if (s > best) best = s, y[std::size_t(i)] = c;
      }
    }
  }
  int n() const { return int(x.extent(0)); }
};

/// fc1: tanh(x W1^T + b1), fc2: h W2^T + b2 (logits).
struct Net {
  int d, h, k;
  M W1, W2, dW1, dW2;
  Vec b1, b2, db1, db2;
  M hidden, logits, dpre1, dlogits;
  Net(int d_, int h_, int k_, std::uint64_t seed)
      : d(d_),
        h(h_),
        k(k_),
        W1("W1", h_, d_),
        W2("W2", k_, h_),
        dW1("dW1", h_, d_),
        dW2("dW2", k_, h_),
        b1("b1", h_),
        b2("b2", k_),
        db1("db1", h_),
        db2("db2", k_) {
    Rng rng(seed);
    for (std::size_t i = 0; i < W1.span(); ++i) W1.data()[i] = rng.uniform() / std::sqrt(double(d));
    for (std::size_t i = 0; i < W2.span(); ++i) W2.data()[i] = rng.uniform() / std::sqrt(double(h));
    for (int i = 0; i < h; ++i) b1(i) = 0.1 * rng.uniform();
  }
  /// The parameters and their gradients as (pointer, size), in one fixed order.
  std::vector<std::pair<double*, std::size_t>> params() const {
    return {{W1.data(), W1.span()}, {b1.data(), b1.span()}, {W2.data(), W2.span()}, {b2.data(), b2.span()}};
  }
  std::vector<std::pair<double*, std::size_t>> grads() const {
    return {{dW1.data(), dW1.span()}, {db1.data(), db1.span()}, {dW2.data(), dW2.span()}, {db2.data(), db2.span()}};
  }
  static Flat flat(const std::vector<std::pair<double*, std::size_t>>& parts) {
    Flat f;
    for (const auto& p : parts) f.insert(f.end(), p.first, p.first + p.second);
    return f;
  }
  static void assign(const std::vector<std::pair<double*, std::size_t>>& parts, const Flat& f) {
    std::size_t o = 0;
    for (const auto& p : parts)
      for (std::size_t i = 0; i < p.second; ++i) p.first[i] = f[o++];
  }
  /// Logits of a batch (also kept in `hidden` and `logits`).
  M forward(const M& x) {
    const int n = int(x.extent(0));
    hidden = M("hidden", n, h);
    logits = M("logits", n, k);
    for (int i = 0; i < n; ++i) {
      for (int o = 0; o < h; ++o) {
        double s = b1(o);
        for (int j = 0; j < d; ++j) s += W1(o, j) * x(i, j);
        hidden(i, o) = std::tanh(s);
      }
      for (int o = 0; o < k; ++o) {
        double s = b2(o);
        for (int j = 0; j < h; ++j) s += W2(o, j) * hidden(i, j);
        logits(i, o) = s;
      }
    }
    return logits;
  }
  /// Mean softmax cross-entropy of logits.
  static double loss(const M& z, const std::vector<int>& y) {
    const int n = int(z.extent(0)), k = int(z.extent(1));
    double total = 0;
    for (int i = 0; i < n; ++i) {
      double m = z(i, 0);
      for (int c = 1; c < k; ++c) m = std::max(m, z(i, c));
      double s = 0;
      for (int c = 0; c < k; ++c) s += std::exp(z(i, c) - m);
      total += m + std::log(s) - z(i, y[std::size_t(i)]);
    }
    return total / n;
  }
  double loss_at(const Batch& b) { return loss(forward(b.x), b.y); }
  /// Forward and backward on a batch: gradients of the mean loss into dW*, db*; the output
  /// gradients of both layers in dpre1 and dlogits. Returns the loss.
  double backward(const Batch& b) {
    forward(b.x);
    const int n = b.n();
    dlogits = M("dlogits", n, k);
    dpre1 = M("dpre1", n, h);
    for (int i = 0; i < n; ++i) {
      double m = logits(i, 0), s = 0;
      for (int c = 1; c < k; ++c) m = std::max(m, logits(i, c));
      for (int c = 0; c < k; ++c) s += std::exp(logits(i, c) - m);
      for (int c = 0; c < k; ++c)
        dlogits(i, c) = (std::exp(logits(i, c) - m) / s - (c == b.y[std::size_t(i)] ? 1.0 : 0.0)) / n;
      for (int j = 0; j < h; ++j) {
        double g = 0;
        for (int c = 0; c < k; ++c) g += dlogits(i, c) * W2(c, j);
        dpre1(i, j) = g * (1 - hidden(i, j) * hidden(i, j));
      }
    }
    for (int o = 0; o < k; ++o) {
      db2(o) = 0;
      for (int j = 0; j < h; ++j) dW2(o, j) = 0;
      for (int i = 0; i < n; ++i) {
        db2(o) += dlogits(i, o);
        for (int j = 0; j < h; ++j) dW2(o, j) += dlogits(i, o) * hidden(i, j);
      }
    }
    for (int o = 0; o < h; ++o) {
      db1(o) = 0;
      for (int j = 0; j < d; ++j) dW1(o, j) = 0;
      for (int i = 0; i < n; ++i) {
        db1(o) += dpre1(i, o);
        for (int j = 0; j < d; ++j) dW1(o, j) += dpre1(i, o) * b.x(i, j);
      }
    }
    return loss(logits, b.y);
  }
  /// J v of the logits along a flat direction, by central differences with step eps.
  M jvp(const M& x, const Flat& v, double eps = 1e-5) {
    const auto ps = params();
    const Flat theta = flat(ps);
    Flat plus(theta), minus(theta);
    for (std::size_t i = 0; i < theta.size(); ++i) {
      plus[i] += eps * v[i];
      minus[i] -= eps * v[i];
    }
    assign(ps, plus);
    M zp("zp", x.extent(0), std::size_t(k));
    Kokkos::deep_copy(zp, forward(x));
    assign(ps, minus);
    M zm = forward(x);
    assign(ps, theta);
    M j("jv", x.extent(0), std::size_t(k));
    for (std::size_t i = 0; i < j.span(); ++i) j.data()[i] = (zp.data()[i] - zm.data()[i]) / (2 * eps);
    forward(x);
    return j;
  }
};

/// sum_i a_i^T (diag(p_i) - p_i p_i^T) b_i as an explicit matrix product, in long double.
inline long double softmax_form(const M& z, const M& a, const M& b) {
  const int n = int(z.extent(0)), k = int(z.extent(1));
  long double total = 0;
  for (int i = 0; i < n; ++i) {
    std::vector<long double> p(static_cast<std::size_t>(k));
    long double s = 0;
    for (int c = 0; c < k; ++c) s += p[std::size_t(c)] = std::exp((long double)z(i, c));
    for (auto& x : p) x /= s;
    for (int r = 0; r < k; ++r)
      for (int c = 0; c < k; ++c) {
        const long double h = (r == c ? p[std::size_t(r)] : 0.0L) - p[std::size_t(r)] * p[std::size_t(c)];
        total += (long double)a(i, r) * h * (long double)b(i, c);
      }
  }
  return total;
}
inline long double dot(const Flat& a, const Flat& b) {
  long double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (long double)a[i] * (long double)b[i];
  return s;
}

/// The closed form: alpha, mu and the model's change, from explicit terms, by Cramer's rule.
struct Closed {
  long double alpha = 0, mu = 0, linear = 0, curvature = 0, damping = 0;
};
/// F terms already averaged; g, P, U0 flat; lambda, eta.
inline Closed closed_form(long double fpp, long double fpm, long double fmm, const Flat& g, const Flat& p,
                          const Flat* u0, long double lambda, long double eta) {
  const long double c = lambda + eta, dpp = dot(p, p), gp = dot(g, p);
  const long double dpm = u0 ? dot(p, *u0) : 0, dmm = u0 ? dot(*u0, *u0) : 0, gm = u0 ? dot(g, *u0) : 0;
  const long double a11 = fpp + c * dpp, a12 = fpm + c * dpm, a22 = fmm + c * dmm;
  Closed r;
  if (u0) {
    const long double det = a11 * a22 - a12 * a12;
    r.alpha = (gp * a22 - a12 * gm) / det;
    r.mu = (a11 * gm - a12 * gp) / det;
  } else {
    r.alpha = gp / a11;
  }
  const long double n2 = r.alpha * r.alpha * dpp + 2 * r.alpha * r.mu * dpm + r.mu * r.mu * dmm;
  r.linear = -(r.alpha * gp + r.mu * gm);
  r.curvature = 0.5L * (r.alpha * r.alpha * fpp + 2 * r.alpha * r.mu * fpm + r.mu * r.mu * fmm) + 0.5L * eta * n2;
  r.damping = 0.5L * lambda * n2;
  return r;
}

}  // namespace adaptive
}  // namespace kfac_test
