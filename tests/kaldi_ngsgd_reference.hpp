#pragma once
// An independent double-precision model of Kaldi's nnet3 OnlineNaturalGradient and of how
// NaturalGradientAffineComponent calls it, written from the structure of Kaldi's code
// (src/nnet3/natural-gradient-online.{h,cc}, nnet-simple-component.cc), not from kfac's.
//
// Kaldi stores W = E^{1/2} R and updates it from the products H = X W^T, J = H^T X, K = J J^T,
// L = H^T H of the rows X being preconditioned; kfac forms Y = R T instead. The two agree only
// if both follow the same recurrence, which is what the tests check. Everything here is in
// double and dense (Eigen); the multi-threading locks of Kaldi are left out (one thread).
#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kaldi_ref {

using Mat = Eigen::MatrixXd;
using Vec = Eigen::VectorXd;

/// Z = U diag(c) U^T with c descending (Kaldi's Eig + SortSvd), each c_i floored at `floor`;
/// returns whether the new basis must be re-orthogonalised (c_1 > 1e6 c_r, or a c_i floored).
inline bool sorted_floored_eig(const Mat& z, double floor, Vec& c, Mat& u) {
  Eigen::SelfAdjointEigenSolver<Mat> es(z);
  c = es.eigenvalues().reverse();
  u = es.eigenvectors().rowwise().reverse();
  bool reorth = c(0) > 1e6 * c(c.size() - 1);
  for (int a = 0; a < c.size(); ++a)
    if (c(a) < floor) { c(a) = floor; reorth = true; }
  return reorth;
}

/// One OnlineNaturalGradient: the settings with Kaldi's defaults, the counter t of calls, and
/// the state (W, d, rho).
struct OnlineNaturalGradient {
  int rank = 40, update_period = 1;
  double num_samples_history = 2000, alpha = 4, epsilon = 1e-10, delta = 5e-4;
  int t = 0;  // calls to precondition() so far; 0: not initialised
  Mat w;      // rank x D, E^{1/2} R
  Vec d;
  double rho = -1e10;
  int cholesky_fallbacks = 0;  // how often the Gram-Schmidt fallback ran

  /// R with orthonormal rows: row r holds 1.1, 1, 1, ... (normalised) at columns r, r + rank, ...
  static Mat special_start(int rows, int cols) {
    Mat r = Mat::Zero(rows, cols);
    const double first = 1.1;
    for (int i = 0; i < rows; ++i) {
      int n = 0;
      for (int c = i; c < cols; c += rows) ++n;
      const double scale = 1.0 / std::sqrt(first * first + (n - 1));
      for (int c = i, k = 0; c < cols; c += rows, ++k) r(i, c) = scale * (k == 0 ? first : 1.0);
    }
    return r;
  }

  double eta(int n) const { return std::min(0.9, 1.0 - std::exp(-double(n) / num_samples_history)); }
  bool updating() const { return t <= 10 || (t - 10) % update_period == 0; }

  /// e_i = 1 / (beta / d_i + 1) and its square roots.
  static void e_of(const Vec& dv, double beta, Vec& e, Vec& se, Vec& ise) {
    e = (beta * dv.cwiseInverse().array() + 1.0).inverse().matrix();
    se = e.cwiseSqrt();
    ise = se.cwiseInverse();
  }
  double beta_of(const Vec& dv, double r, int dim) const { return r * (1 + alpha) + alpha * dv.sum() / dim; }

  void init_default(int dim) {
    if (rank >= dim) rank = dim - 1;
    if (rank == 0) return;
    rho = epsilon;
    d = Vec::Constant(rank, epsilon);
    const double e = 1.0 / (2.0 + (dim + rank) * alpha / dim);
    w = special_start(rank, dim) * std::sqrt(e);
    t = 0;
  }

  void init(const Mat& x0) {
    OnlineNaturalGradient copy(*this);
    copy.init_default(int(x0.cols()));
    copy.t = 1;
    const int iters = x0.rows() <= copy.rank ? 1 : 3;
    for (int i = 0; i < iters; ++i) {
      Mat x = x0;
      copy.precondition(x, nullptr);
    }
    rank = copy.rank;
    w = copy.w;
    d = copy.d;
    rho = copy.rho;
  }

  /// Replaces the rows x (N x D) by x (I - R^T E R), sets *scale to Kaldi's per-side gamma.
  void precondition(Mat& x, double* scale) {
    if (x.cols() == 1) {
      if (scale) *scale = 1;
      return;
    }
    if (t == 0) init(x);
    const bool upd = updating();
    const double initial = x.squaredNorm();
    internal(initial, upd, x);
    if (scale) *scale = initial <= 0 ? 1.0 : std::sqrt(initial / x.squaredNorm());
    t += 1;
  }

  void internal(double tr_x, bool upd, Mat& x) {
    const int n = int(x.rows()), dim = int(x.cols()), r = rank;
    const double et = eta(n);
    const Mat h = x * w.transpose();
    if (!upd) {
      x -= h * w;
      return;
    }
    Mat j = h.transpose() * x;
    const Mat l = h.transpose() * h, k = j * j.transpose();
    Vec e, se, ise;
    e_of(d, beta_of(d, rho, dim), e, se, ise);
    // Z_t, the r x r matrix whose eigenvalues are C_t
    const Vec dr = (d.array() + rho).matrix();
    const double en = et / n, e1 = 1 - et;
    Mat z(r, r);
    for (int a = 0; a < r; ++a)
      for (int b = 0; b < r; ++b)
        z(a, b) = en * en * ise(a) * k(a, b) * ise(b) + en * e1 * ise(a) * l(a, b) * ise(b) * (dr(a) + dr(b)) +
                  (a == b ? e1 * e1 * dr(a) * dr(a) : 0.0);
    Vec c;
    Mat u;
    const bool reorth = sorted_floored_eig(z, std::pow(rho * (1 - et), 2), c, u);
    x -= h * w;
    const Vec sc = c.cwiseSqrt();
    double rho1 = (et / n * tr_x + (1 - et) * (dim * rho + d.sum()) - sc.sum()) / (dim - r);
    Vec d1 = (sc.array() - rho1).matrix();
    const double floor_val = std::max(epsilon, delta * sc.maxCoeff());
    rho1 = std::max(rho1, floor_val);
    d1 = d1.cwiseMax(floor_val);
    // W_{t+1} = A_t B_t
    Vec e1v, se1, ise1;
    e_of(d1, beta_of(d1, rho1, dim), e1v, se1, ise1);
    for (int a = 0; a < r; ++a) j.row(a) += (1 - et) / en * dr(a) * w.row(a);
    Mat at = u.transpose();
    for (int a = 0; a < r; ++a)
      for (int b = 0; b < r; ++b) at(a, b) *= en * se1(a) / sc(a) * ise(b);
    Mat w1 = at * j;
    if (reorth) reorthogonalize(d1, rho1, w1);
    w = w1;
    d = d1;
    rho = rho1;
  }

  void reorthogonalize(const Vec& d1, double rho1, Mat& w1) {
    const int r = int(w1.rows()), dim = int(w1.cols());
    Vec e, se, ise;
    e_of(d1, beta_of(d1, rho1, dim), e, se, ise);
    const Mat o = ise.asDiagonal() * (w1 * w1.transpose()) * ise.asDiagonal();
    if ((o - Mat::Identity(r, r)).cwiseAbs().maxCoeff() <= 1e-3) return;
    Eigen::LLT<Mat> llt(o);
    bool ok = llt.info() == Eigen::Success;
    Mat cinv;
    if (ok) {
      cinv = llt.matrixL().solve(Mat::Identity(r, r));
      double mx = -1e300;  // Kaldi's TpMatrix::Max: the largest entry of the lower triangle
      for (int a = 0; a < r; ++a)
        for (int b = 0; b <= a; ++b) mx = std::max(mx, cinv(a, b));
      ok = mx < 100.0;
    }
    if (!ok) {
      ++cholesky_fallbacks;
      w1 = gram_schmidt(w1);
      w1 = se.asDiagonal() * w1;
      return;
    }
    for (int a = 0; a < r; ++a)
      for (int b = 0; b < a; ++b) cinv(a, b) *= se(a) * ise(b);
    w1 = cinv.triangularView<Eigen::Lower>() * w1;
  }

  /// Rows orthonormalised in order, each again when it lost 99% of itself (as Kaldi's
  /// OrthogonalizeRows does; an exactly zero row would be randomised there, and throws here).
  static Mat gram_schmidt(Mat m) {
    for (int i = 0; i < m.rows(); ++i) {
      for (int pass = 0;; ++pass) {
        const double start = m.row(i).squaredNorm();
        for (int k = 0; k < i; ++k) m.row(i) -= m.row(i).dot(m.row(k)) * m.row(k);
        const double end = m.row(i).squaredNorm();
        if (end == 0 || pass > 100) throw std::runtime_error("gram_schmidt: dependent rows");
        if (end > 0.01 * start) {
          m.row(i) /= std::sqrt(end);
          break;
        }
      }
    }
    return m;
  }

  /// R = E^{-1/2} W, the orthonormal basis kfac stores.
  Mat basis() const {
    Vec e, se, ise;
    e_of(d, beta_of(d, rho, int(w.cols())), e, se, ise);
    return ise.asDiagonal() * w;
  }
};

/// NaturalGradientAffineComponent's use: input rows with a ones column and output-derivative
/// rows preconditioned by one estimate each; the update direction is
/// in_scale * out_scale * out_hat^T [in_hat] (out x (in + 1)).
struct AffineComponent {
  OnlineNaturalGradient in, out;
  AffineComponent(int rank_in, int rank_out, int update_period, double history) {
    for (auto* p : {&in, &out}) {
      p->update_period = update_period;
      p->num_samples_history = history;
    }
    in.rank = rank_in;
    out.rank = rank_out;
  }
  /// x: N x (in + 1) with the ones column already in place; g: N x out.
  Mat direction(Mat x, Mat g) {
    double si = 1, so = 1;
    in.precondition(x, &si);
    out.precondition(g, &so);
    return si * so * g.transpose() * x;
  }
};

}  // namespace kaldi_ref
