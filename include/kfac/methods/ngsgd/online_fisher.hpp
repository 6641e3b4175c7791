#pragma once
/// \file online_fisher.hpp
/// \brief One online low-rank-plus-identity estimate of a covariance matrix, updated from
/// minibatches of rows by the recurrence of Povey, Zhang & Khudanpur (2014), "Parallel training
/// of DNNs with natural gradient and parameter averaging", appendix (Kaldi's
/// OnlineNaturalGradient).
///
/// The estimate of a D x D matrix is \f$F = R^T \mathrm{diag}(d) R + \rho I\f$ with R (r x D) of
/// orthonormal rows. One update from rows X (N of them, normaliser n, so that
/// \f$S = X^T X / n\f$) with \f$\eta = 1 - e^{-N_s/h}\f$ (\f$N_s\f$ samples, h the history):
/// \f[ T = \eta S + (1 - \eta) F,\quad Y = R T,\quad Y Y^T = U C U^T \ (c_1 \ge \dots \ge c_r),\f]
/// \f[ c_i \leftarrow \max(c_i, (\rho (1-\eta))^2),\quad R' = C^{-1/2} U^T Y,\quad
///     \rho' = \frac{\mathrm{tr}\,T - \sum_i \sqrt{c_i}}{D - r},\quad d' = \sqrt{c} - \rho', \f]
/// then, with \f$f = \max(\epsilon, \delta \max_i \sqrt{c_i})\f$, \f$\rho' \leftarrow
/// \max(\rho', f)\f$ and \f$d' \leftarrow \max(d', f)\f$ (Kaldi; `relative_d_floor` off: d'
/// floored at \f$\epsilon\f$ only), and \f$\eta\f$ is capped at `eta_cap` (Kaldi: 0.9). One step
/// of subspace iteration, so R' spans the leading eigenvectors of T ever better. When
/// \f$c_1 > 10^6 c_r\f$ or a \f$c_i\f$ was floored, rounding may have cost R' its
/// orthonormality: if \f$R'R'^T\f$ differs from I by more than 1e-3 in some entry, R' is
/// replaced by \f$L^{-1} R'\f$, L the Cholesky factor of \f$R'R'^T\f$, or, when that fails or
/// some entry of \f$L^{-1}\f$ is 100 or more, by Gram-Schmidt on its rows (Kaldi's
/// ReorthogonalizeRt1).
///
/// Preconditioning uses the smoothed estimate \f$\hat F = F + \frac{\alpha}{D}\mathrm{tr}(F) I
/// = R^T \mathrm{diag}(d) R + \beta I\f$, \f$\beta = \rho(1+\alpha) + \frac{\alpha}{D}\sum_i d_i\f$,
/// whose inverse by the Woodbury identity is
/// \f$\hat F^{-1} = \beta^{-1}(I - R^T \mathrm{diag}(e) R)\f$, \f$e_i = d_i / (d_i + \beta)\f$.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/error.hpp"
#include "kfac/linalg/eigh.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/squared_norm.hpp"

namespace kfac {
namespace impl {
namespace ngsgd {

using HostExec = Kokkos::DefaultHostExecutionSpace;
using HostMatrix = Matrix<double, HostExec>;

/// The settings of one estimate's recurrence (NGSGD's, see ngsgd.hpp).
struct Recurrence {
  double num_samples_history = 2000, alpha = 4, epsilon = 1e-10, delta = 5e-4;
  double eta_cap = 0.9;          ///< Kaldi's Eta(): eta never above 0.9
  bool relative_d_floor = true;  ///< Kaldi: d floored at max(epsilon, delta max sqrt(c)), not epsilon
};

/// Kaldi's starting basis: row i has entries at columns i, i + r, i + 2r, ..., the first `first`
/// and the others 1, normalised (orthonormal rows, no zero row or column). With first = 1.1
/// (Kaldi's symmetry breaker) no combination of the rows is the all-ones vector, a direction
/// in which softmax + cross-entropy output gradients have no variance; with first = 1 the
/// all-ones vector lies in the span and stays there.
template <class Exec, class T>
void special_orthonormal(const Exec& exec, const Matrix<T, Exec>& r, double first) {
  const int rank = int(r.extent(0)), dim = int(r.extent(1));
  Kokkos::parallel_for(
      "kfac::ngsgd::init_basis", ColumnMajorRange<Exec>(exec, {0, 0}, {rank, dim}),
      KOKKOS_LAMBDA(int i, int j) {
        const int count = (dim - 1 - i) / rank + 1;
        const double scale = 1 / sqrt_(first * first + double(count - 1));
        r(i, j) = j % rank == i ? T(scale * (j == i ? first : 1.0)) : T(0);
      });
}

/// y(i, j) += w (d_i + rho) r(i, j), with dr = (d_0, ..., d_{r-1}, rho).
template <class Exec, class T>
void add_scaled_basis(const Exec& exec, const Matrix<T, Exec>& y, const Matrix<T, Exec>& r,
                      const Vector<double, Exec>& dr, double w) {
  const int rank = int(r.extent(0)), dim = int(r.extent(1));
  Kokkos::parallel_for(
      "kfac::ngsgd::prior_term", ColumnMajorRange<Exec>(exec, {0, 0}, {rank, dim}),
      KOKKOS_LAMBDA(int i, int j) { y(i, j) += T(w * (dr(i) + dr(rank))) * r(i, j); });
}

/// e_i = d_i / (d_i + beta), beta = rho (1 + alpha) + alpha/D sum_i d_i: the Woodbury weights
/// of the smoothed estimate (see the file comment).
template <class Exec, class T>
void woodbury_weights(const Exec& exec, const Vector<double, Exec>& dr, double alpha, int dim,
                      const Vector<T, Exec>& e) {
  const int rank = int(e.extent(0));
  Kokkos::parallel_for(
      "kfac::ngsgd::woodbury_weights", Kokkos::RangePolicy<Exec>(exec, 0, 1), KOKKOS_LAMBDA(int) {
        double sum = 0;
        for (int i = 0; i < rank; ++i) sum += dr(i);
        const double beta = dr(rank) * (1 + alpha) + alpha * sum / dim;
        for (int i = 0; i < rank; ++i) e(i) = T(dr(i) / (dr(i) + beta));
      });
}

/// Scales row i (rows = true) or column i of m by e(i).
template <class Exec, class M, class T>
void scale_by(const Exec& exec, const M& m, const Vector<T, Exec>& e, bool rows) {
  Kokkos::parallel_for(
      "kfac::ngsgd::scale", ColumnMajorRange<Exec>(exec, {0, 0}, {int(m.extent(0)), int(m.extent(1))}),
      KOKKOS_LAMBDA(int i, int j) { m(i, j) *= e(rows ? i : j); });
}

/// The two sides of the Woodbury update of NGSGDBlock::apply: left(:, k) = r_in(k, :)^T for
/// k < r_in (columns r_in.. hold Q' already), right = [diag(e_in) p; r_out].
template <class Exec, class T>
void stack_factors(const Exec& exec, const Matrix<T, Exec>& r_in, const Matrix<T, Exec>& p,
                   const Vector<T, Exec>& e_in, const Matrix<T, Exec>& r_out, const Matrix<T, Exec>& left,
                   const Matrix<T, Exec>& right) {
  const int ri = int(r_in.extent(0)), ro = int(r_out.extent(0)), a = int(left.extent(0)), g = int(right.extent(1));
  if (ri > 0)
    Kokkos::parallel_for(
        "kfac::ngsgd::stack_left", ColumnMajorRange<Exec>(exec, {0, 0}, {a, ri}),
        KOKKOS_LAMBDA(int i, int k) { left(i, k) = r_in(k, i); });
  Kokkos::parallel_for(
      "kfac::ngsgd::stack_right", ColumnMajorRange<Exec>(exec, {0, 0}, {ri + ro, g}),
      KOKKOS_LAMBDA(int k, int j) { right(k, j) = k < ri ? e_in(k) * p(k, j) : r_out(k - ri, j); });
}

/// Host copy of a small device matrix, in double.
template <class Exec, class T>
HostMatrix to_host(const Matrix<T, Exec>& m) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m);
  HostMatrix out("kfac::ngsgd::host", m.extent(0), m.extent(1));
  for (std::size_t j = 0; j < m.extent(1); ++j)
    for (std::size_t i = 0; i < m.extent(0); ++i) out(i, j) = double(h(i, j));
  return out;
}
template <class Exec, class T>
Matrix<T, Exec> to_device(const HostMatrix& h) {
  Matrix<T, Exec> m("kfac::ngsgd::small", h.extent(0), h.extent(1));
  auto mh = Kokkos::create_mirror_view(m);
  for (std::size_t j = 0; j < h.extent(1); ++j)
    for (std::size_t i = 0; i < h.extent(0); ++i) mh(i, j) = T(h(i, j));
  Kokkos::deep_copy(m, mh);
  return m;
}

/// Lower Cholesky factor of the symmetric o in place; false when o is not positive definite.
inline bool cholesky_lower(HostMatrix& o) {
  const int n = int(o.extent(0));
  for (int j = 0; j < n; ++j) {
    double s = o(j, j);
    for (int k = 0; k < j; ++k) s -= o(j, k) * o(j, k);
    if (!(s > 0)) return false;
    o(j, j) = std::sqrt(s);
    for (int i = j + 1; i < n; ++i) {
      double t = o(i, j);
      for (int k = 0; k < j; ++k) t -= o(i, k) * o(j, k);
      o(i, j) = t / o(j, j);
    }
    for (int i = 0; i < j; ++i) o(i, j) = 0;
  }
  return true;
}
/// Inverse of a lower triangular matrix.
inline HostMatrix lower_inverse(const HostMatrix& l) {
  const int n = int(l.extent(0));
  HostMatrix inv("kfac::ngsgd::l_inverse", n, n);
  for (int j = 0; j < n; ++j) {
    inv(j, j) = 1 / l(j, j);
    for (int i = j + 1; i < n; ++i) {
      double s = 0;
      for (int k = j; k < i; ++k) s += l(i, k) * inv(k, j);
      inv(i, j) = -s / l(i, i);
    }
  }
  return inv;
}

/// Kaldi's check on the Cholesky repair: every entry of \f$L^{-1}\f$ (lower triangle) below 100.
inline bool inverse_in_range(const HostMatrix& l_inv) {
  for (std::size_t j = 0; j < l_inv.extent(1); ++j)
    for (std::size_t i = j; i < l_inv.extent(0); ++i)
      if (!(l_inv(i, j) < 100)) return false;
  return true;
}

/// Gram-Schmidt on the rows of m in order (Kaldi's OrthogonalizeRows): a row that kept at most
/// 1% of its squared norm is orthogonalised again (rounding), and an exactly zero row is
/// replaced by a fixed pseudo-random one (Kaldi draws a random one; fixed here so that runs
/// are reproducible).
inline void gram_schmidt_rows(HostMatrix& m) {
  const int rows = int(m.extent(0)), cols = int(m.extent(1));
  unsigned long long seed = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < rows; ++i) {
    for (int pass = 0;; ++pass) {
      if (pass > 100) throw Error("", "NG-SGD: Gram-Schmidt on the basis did not converge");
      double start = 0, end = 0;
      for (int j = 0; j < cols; ++j) start += m(i, j) * m(i, j);
      for (int k = 0; k < i; ++k) {
        double dot = 0;
        for (int j = 0; j < cols; ++j) dot += m(i, j) * m(k, j);
        for (int j = 0; j < cols; ++j) m(i, j) -= dot * m(k, j);
      }
      for (int j = 0; j < cols; ++j) end += m(i, j) * m(i, j);
      if (end > 0.01 * start) {
        const double s = 1 / std::sqrt(end);
        for (int j = 0; j < cols; ++j) m(i, j) *= s;
        break;
      }
      if (end == 0)
        for (int j = 0; j < cols; ++j) {
          seed = seed * 6364136223846793005ull + 1442695040888963407ull;
          m(i, j) = double(seed >> 11) / double(1ull << 53) - 0.5;
        }
    }
  }
}

/// \brief One estimate \f$R^T \mathrm{diag}(d) R + \rho I\f$ (see the file comment).
/// \tparam T the type of R and of the rows it is updated from.
/// State: R (r x D, column-major) and dr = (d_0, ..., d_{r-1}, rho) in double, both in the
/// execution space's memory, so that checkpoints and rollbacks can treat them as buffers.
template <class T, class Exec>
class OnlineFisher {
 public:
  using matrix = Matrix<T, Exec>;
  /// Rows as the host framework lays them out: (N x D) row-major.
  using rows_type = Kokkos::View<T**, Kokkos::LayoutRight, typename Exec::memory_space>;

  OnlineFisher() = default;
  OnlineFisher(index_t dim, index_t rank) : dim_(dim), rank_(rank) {}

  index_t dim() const { return dim_; }
  index_t rank() const { return rank_; }
  bool allocated() const { return dr_.extent(0) > 0; }
  const matrix& basis() const { return r_; }
  const Vector<double, Exec>& values() const { return dr_; }

  void allocate() {
    if (allocated()) return;
    r_ = matrix("kfac::ngsgd::R", rank_, dim_);
    dr_ = Vector<double, Exec>("kfac::ngsgd::d_rho", rank_ + 1);
  }
  void release() {
    r_ = matrix();
    dr_ = Vector<double, Exec>();
  }
  std::vector<Buffer> buffers() { return {buffer_of(r_), buffer_of(dr_)}; }
  std::vector<BufferShape> shapes() const {
    return {{std::size_t(rank_) * dim_, sizeof(T)}, {std::size_t(rank_) + 1, sizeof(double)}};
  }
  std::size_t bytes() const { return r_.span() * sizeof(T) + dr_.span() * sizeof(double); }

  /// Kaldi's starting point: the special orthonormal basis (`first` its symmetry breaker, see
  /// special_orthonormal), d = rho = epsilon.
  void init_default(const Exec& exec, double epsilon, double first) {
    allocate();
    if (rank_ > 0) special_orthonormal(exec, r_, first);
    Kokkos::deep_copy(exec, dr_, epsilon);
  }
  /// Copies the state into `other` (allocated as needed).
  void copy_to(const Exec& exec, OnlineFisher& other) const {
    other.dim_ = dim_;
    other.rank_ = rank_;
    other.allocate();
    Kokkos::deep_copy(exec, other.r_, r_);
    Kokkos::deep_copy(exec, other.dr_, dr_);
  }

  /// \brief One step of the recurrence from the rows of `list` (together), \f$S = \sum_k
  /// X_k^T X_k / \f$ `norm`.
  /// \param exec [in] the execution space instance the kernels run on
  /// \param list [in] the matrices \f$X_k\f$, rows of width dim() (row-major)
  /// \param norm [in] the divisor of \f$\sum_k X_k^T X_k\f$
  /// \param sum_squares [in] \f$\sum_k \|X_k\|_F^2\f$ (so tr S = sum_squares / norm).
  /// \param samples [in] the samples the rows came from (\f$N_s\f$ in \f$\eta\f$).
  /// \param s [in] the recurrence's constants (Kaldi's defaults in Recurrence)
  void update(const Exec& exec, const std::vector<rows_type>& list, double norm,
              double sum_squares, double samples, const Recurrence& s) {
    if (rank_ == 0) return;
    const int r = rank_, n_dim = dim_;
    const double eta = std::min(s.eta_cap, 1 - std::exp(-samples / s.num_samples_history));
    using Unmanaged = Kokkos::View<const T**, Kokkos::LayoutLeft, typename Exec::memory_space,
                                   Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    // Y = R T = (eta/norm) (R X^T) X + (1 - eta) diag(d + rho) R, since R F = diag(d + rho) R.
    matrix y("kfac::ngsgd::Y", r, n_dim);
    for (std::size_t k = 0; k < list.size(); ++k) {
      const int rows = int(list[k].extent(0));
      if (rows == 0) continue;
      const Unmanaged xt(list[k].data(), n_dim, rows);  // the row-major rows, transposed
      matrix h("kfac::ngsgd::H", r, rows);
      gemm(exec, "N", "N", T(1), r_, xt, T(0), h);
      gemm(exec, "N", "T", T(eta / norm), h, xt, T(1), y);
    }
    add_scaled_basis(exec, y, r_, dr_, 1 - eta);
    matrix z("kfac::ngsgd::Z", r, r);
    gemm(exec, "N", "T", T(1), y, y, T(0), z);
    exec.fence();

    auto dr = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dr_);
    const double rho = dr(r);
    double sum_d = 0;
    for (int i = 0; i < r; ++i) sum_d += dr(i);
    HostMatrix zh = to_host<Exec, T>(z), q("kfac::ngsgd::U", r, r);
    Vector<double, HostExec> w("kfac::ngsgd::c", r);
    eigh<AutoBackend>(HostExec(), zh, q, w);  // ascending; c below is descending
    std::vector<double> c(r), sqrt_c(r);
    for (int i = 0; i < r; ++i) c[i] = w(r - 1 - i);
    bool reorthogonalize = c[0] > 1e6 * c[r - 1];
    const double floor_c = (rho * (1 - eta)) * (rho * (1 - eta));
    double sum_sqrt_c = 0, max_sqrt_c = 0;
    for (int i = 0; i < r; ++i) {
      if (c[i] < floor_c) { c[i] = floor_c; reorthogonalize = true; }
      sqrt_c[i] = std::sqrt(c[i]);
      sum_sqrt_c += sqrt_c[i];
      max_sqrt_c = std::max(max_sqrt_c, sqrt_c[i]);
    }
    if (!(sum_sqrt_c > 0))
      throw Error("", "NG-SGD estimate degenerated (all of Y Y^T is zero); are the observations zero?");
    const double trace_t = eta * sum_squares / norm + (1 - eta) * (n_dim * rho + sum_d);
    double rho1 = (trace_t - sum_sqrt_c) / double(n_dim - r);
    const double floor = std::max(s.epsilon, s.delta * max_sqrt_c);
    for (int i = 0; i < r; ++i) dr(i) = std::max(sqrt_c[i] - rho1, s.relative_d_floor ? floor : s.epsilon);
    dr(r) = std::max(rho1, floor);

    // R' = C^{-1/2} U^T Y.
    HostMatrix m("kfac::ngsgd::M", r, r);
    for (int i = 0; i < r; ++i)
      for (int k = 0; k < r; ++k) m(i, k) = q(k, r - 1 - i) / sqrt_c[i];
    gemm(exec, "N", "N", T(1), to_device<Exec, T>(m), y, T(0), r_);
    if (reorthogonalize) orthonormalize(exec);
    Kokkos::deep_copy(dr_, dr);
  }

  /// \brief Restores R's orthonormal rows as Kaldi's ReorthogonalizeRt1 does: nothing when
  /// \f$R R^T\f$ is the identity to 1e-3; else \f$R \leftarrow L^{-1} R\f$, \f$L L^T = R R^T\f$;
  /// Gram-Schmidt on the rows (gram_schmidt_rows) when the Cholesky factorisation fails or an
  /// entry of \f$L^{-1}\f$ is 100 or more (the rows were close to dependent). Returns which
  /// repair ran: 0 none, 1 Cholesky, 2 Gram-Schmidt.
  int orthonormalize(const Exec& exec) {
    const int r = rank_;
    matrix o("kfac::ngsgd::O", r, r);
    gemm(exec, "N", "T", T(1), r_, r_, T(0), o);
    exec.fence();
    HostMatrix oh = to_host<Exec, T>(o);
    double worst = 0;
    for (int j = 0; j < r; ++j)
      for (int i = 0; i < r; ++i) worst = std::max(worst, std::abs(oh(i, j) - (i == j ? 1.0 : 0.0)));
    if (worst <= 1e-3) return 0;
    HostMatrix l_inv;
    if (cholesky_lower(oh)) l_inv = lower_inverse(oh);
    if (l_inv.extent(0) == 0 || !inverse_in_range(l_inv)) {
      HostMatrix rh = to_host<Exec, T>(r_);
      gram_schmidt_rows(rh);
      Kokkos::deep_copy(exec, r_, to_device<Exec, T>(rh));
      return 2;
    }
    matrix copy("kfac::ngsgd::R_copy", r, dim_);
    Kokkos::deep_copy(exec, copy, r_);
    gemm(exec, "N", "N", T(1), to_device<Exec, T>(l_inv), copy, T(0), r_);
    return 1;
  }

 private:

  index_t dim_ = 0, rank_ = 0;
  matrix r_;
  Vector<double, Exec> dr_;
};

}  // namespace ngsgd
}  // namespace impl
}  // namespace kfac
