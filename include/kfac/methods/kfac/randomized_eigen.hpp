#pragma once
/// \file randomized_eigen.hpp
/// \brief Randomized low-rank-plus-scaled-identity factors (Halko, Martinsson & Tropp 2011;
/// Puiu 2022, "Randomized K-FACs").
///
/// Each n x n factor F is replaced by
/// \f[ \tilde F = U \Lambda U^T + c\,(I - U U^T), \qquad U \in \mathbb{R}^{n \times k},\ U^T U = I,
///     \qquad c = \max\!\left(0, \frac{\mathrm{tr}(F) - \sum_i \Lambda_{ii}}{n - k}\right), \f]
/// with k = min(rank, n) approximate top eigenpairs \f$(U, \Lambda)\f$ from a randomized range
/// finder: \f$Y = F\,\Omega\f$ for an n x l start basis \f$\Omega\f$ (l = min(k + p, n)), q power
/// iterations \f$Y \leftarrow F\,\mathrm{orth}(Y)\f$, \f$Q = \mathrm{orth}(Y)\f$, and the
/// Rayleigh-Ritz step \f$Q^T F Q = V \Theta V^T\f$ (the small l x l eigh), U = Q V and
/// \f$\Lambda = \Theta\f$ for the k largest. Every step is a GEMM, a range kernel or the small
/// eigh, so it runs on every backend.
///
/// The complement scale c is the mean eigenvalue of F on the complement of U: it is
/// \f$\mathrm{tr}((I - UU^T) F (I - UU^T))/(n - k)\f$ (the Ritz values sum to
/// \f$\mathrm{tr}(U^T F U)\f$), which makes \f$c\,(I - UU^T)\f$ the closest multiple of the projector
/// to F's compression onto the complement in the Frobenius norm, and keeps \f$\mathrm{tr}(\tilde F) =
/// \mathrm{tr}(F)\f$. A plain truncation, c = 0 (one of the choices Puiu weighs), treats every
/// direction outside U as a zero eigenvalue, so the damped inverse amplifies the whole complement
/// by \f$1/\gamma\f$; the mean divides it by its average curvature, as the exact solve would on
/// average.
///
/// The preconditioned gradient is the exact solve with the approximated factors,
/// \f$\mathrm{mat}((\tilde G \otimes \tilde A + \gamma I)^{-1}\mathrm{vec}(X))\f$: X splits into
/// \f$U_G^T X U_A,\ U_G^T X P_A,\ P_G X U_A,\ P_G X P_A\f$ (\f$P = I - UU^T\f$), each divided by its
/// eigenvalue product plus \f$\gamma\f$, in O(g a (k_G + k_A)) flops without forming an n x n matrix.
///
/// A factor with rank >= n is decomposed exactly (as Eigendecomposition, bit for bit: the same
/// eigh, clamping and preconditioning), and so is one with rank + oversampling >= n, whose top k
/// eigenpairs are then exact. A layer whose factors are both exact has the signature setting
/// "exact", whatever the rank.
///
/// `with_factored_damping(true)` damps each factor instead:
/// \f$(\tilde G + \sqrt\gamma I)^{-1} X (\tilde A + \sqrt\gamma I)^{-1}\f$, every eigenvalue product
/// \f$xy + \gamma\f$ above becoming \f$(x + \sqrt\gamma)(y + \sqrt\gamma)\f$: the operator of
/// `Cholesky<>{}.with_pi_damping(false)` with the approximated factors (the same up to round-off
/// when both are exact), and the form the Fashion-MNIST MLP was tuned with.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/linalg/eigh.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/symmetric.hpp"
#include "kfac/linalg/syrk.hpp"
#include "kfac/methods/kfac/eigendecomposition.hpp"

namespace kfac {
namespace impl {

/// \brief Entry (i, j) of the fixed standard-normal test matrix with `seed`: a counter-based
/// generator (SplitMix64's output function on the counter), two uniforms per entry, Box-Muller.
/// Computed in double on the host, so every rank and every backend starts from the same bits;
/// column j does not depend on the matrix's width, so a warm start can draw only some columns.
inline double standard_normal(std::uint64_t seed, std::uint64_t i, std::uint64_t j) {
  const auto mix = [](std::uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  const std::uint64_t stream = mix(seed ^ mix(j));
  const double u1 = double((mix(stream + 2 * i) >> 11) + 1) * 0x1.0p-53;  // (0, 1]
  const double u2 = double(mix(stream + 2 * i + 1) >> 11) * 0x1.0p-53;    // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

/// Columns [c0, c1) of y set to columns `first`, `first` + 1, ... of the test matrix, times `scale`.
template <class M>
void fill_standard_normal(const M& y, int c0, int c1, std::uint64_t seed, std::uint64_t first, double scale) {
  using T = typename M::non_const_value_type;
  if (c1 <= c0) return;
  const auto cols = Kokkos::subview(y, Kokkos::ALL, std::make_pair(c0, c1));
  const auto host = Kokkos::create_mirror_view(cols);
  for (int j = 0; j < c1 - c0; ++j)
    for (int i = 0; i < int(y.extent(0)); ++i) host(i, j) = T(scale * standard_normal(seed, i, first + j));
  Kokkos::deep_copy(cols, host);
}

/// \brief Orthonormalizes the columns of y (n x l) in `passes` >= 2 passes of SVQB (Stathopoulos
/// & Wu 2002), GEMMs and the small eigh only: with D the inverse column norms,
/// \f$D Y^T Y D = W \Theta W^T\f$ and \f$Y \leftarrow Y D W \Theta^{-1/2}\f$. The scaling by D
/// makes a pass exact for orthogonal columns of any lengths (F U for an exact basis U). The
/// first pass adds \f$l\,\epsilon\,\theta_{max}\f$ to \f$\Theta\f$ (the shift of shifted
/// CholeskyQR, Fukaya et al. 2020), so that any condition number is reduced to one the later
/// passes make orthonormal to round-off; a direction at or below that level (Y rank-deficient,
/// e.g. for a factor of low rank) is replaced by a column of fixed random numbers, which the
/// later passes orthogonalize. The result is in y; `tmp` (y's shape), `gram`, `vecs` (l x l)
/// and `theta` (l) are scratch.
template <class Backend, class T, class Exec>
void orthonormalize(const Exec& exec, Matrix<T, Exec>& y, Matrix<T, Exec>& tmp, const Matrix<T, Exec>& gram,
                    const Matrix<T, Exec>& vecs, const Vector<T, Exec>& theta, SolverWorkspace<T, Exec>& ws,
                    int passes, std::uint64_t seed) {
  const int n = int(y.extent(0)), l = int(y.extent(1));
  const double eps = double(std::numeric_limits<T>::epsilon());
  Vector<T, Exec> norms("kfac::randomized::norms", l), scale("kfac::randomized::scale", l);
  const auto scale_host = Kokkos::create_mirror_view(scale);
  for (int pass = 0; pass < passes; ++pass) {
    syrk_t_upper(exec, T(1), y, T(0), gram);
    auto gm = gram;
    auto d = norms;
    Kokkos::parallel_for(
        "kfac::randomized::column_norms", Kokkos::RangePolicy<Exec>(exec, 0, l),
        KOKKOS_LAMBDA(int i) { d(i) = gm(i, i) > T(0) ? T(1) / sqrt_(gm(i, i)) : T(1); });
    Kokkos::parallel_for(
        "kfac::randomized::scale_gram", ColumnMajorRange<Exec>(exec, {0, 0}, {l, l}),
        KOKKOS_LAMBDA(int i, int j) { if (i <= j) gm(i, j) *= d(i) * d(j); });
    eigh<Backend>(exec, gram, vecs, theta, ws);
    exec.fence();
    const auto th = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), theta);
    const double top = th(l - 1) > 0 ? double(th(l - 1)) : 0.0;
    const double shift = pass == 0 ? l * eps * top : 0.0, floor = eps * (top > 0 ? top : 1.0);
    std::vector<int> replaced;  // directions Y does not resolve (NaN included): random columns instead
    for (int i = 0; i < l; ++i) {
      if (pass == 0 && !(double(th(i)) > shift)) replaced.push_back(i);
      const double t = double(th(i)) + shift;
      scale_host(i) = T(1 / std::sqrt(t > floor ? t : floor));
    }
    Kokkos::deep_copy(scale, scale_host);
    auto v = vecs;
    auto s = scale;
    Kokkos::parallel_for(
        "kfac::randomized::scale_vectors", ColumnMajorRange<Exec>(exec, {0, 0}, {l, l}),
        KOKKOS_LAMBDA(int i, int j) { v(i, j) *= d(i) * s(j); });
    gemm(exec, "N", "N", T(1), y, vecs, T(0), tmp);
    exec.fence();
    // Unit-norm random columns (entries of variance 1/n), drawn apart from the start basis.
    for (int i : replaced) fill_standard_normal(tmp, i, i + 1, seed, (std::uint64_t(1) << 32) + i, 1 / std::sqrt(double(n)));
    std::swap(y, tmp);
  }
}

/// \brief Sets the kept eigenvalues \f$\Lambda\f$ = the top k of the l Ritz values `theta`
/// (ascending) minus `shift`, clamped at 0, and the complement scale
/// \f$c = \max(0, (\mathrm{tr}(F) - \sum \Theta_{top})/(n - k) - \mathrm{shift})\f$ (0 when k = n).
/// `trace` is that of the decomposed (shifted) matrix.
template <class T, class Exec>
void keep_top_eigenvalues(const Exec& exec, const Vector<T, Exec>& theta, double trace, double shift, int n,
                          const Vector<T, Exec>& lambda, const Vector<T, Exec>& complement) {
  const int k = int(lambda.extent(0)), l = int(theta.extent(0));
  exec.fence();
  const auto th = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), theta);
  double top = 0;
  for (int i = l - k; i < l; ++i) top += double(th(i));
  const double c = k < n ? (trace - top) / double(n - k) - shift : 0.0;
  Kokkos::deep_copy(complement, T(c > 0 ? c : 0));
  auto lam = lambda;
  auto t = theta;
  const T s = T(shift);
  Kokkos::parallel_for(
      "kfac::randomized::clamp", Kokkos::RangePolicy<Exec>(exec, 0, k), KOKKOS_LAMBDA(int i) {
        const T v = t(l - k + i) - s;
        lam(i) = v > T(0) ? v : T(0);
      });
}

/// Trace of a square matrix, in double.
template <class Exec, class M>
double diagonal_sum(const Exec& exec, const M& m) {
  return ordered_sum(exec, "kfac::randomized::trace", long(m.extent(0)), KOKKOS_LAMBDA(long i) { return double(m(i, i)); });
}

/// \brief The factors of one layer's low-rank solve: bases (n x k), kept eigenvalues (k) and
/// complement scales (1 value each) of A and G, as views, and the damping's form.
template <class T, class Exec>
struct LowRankPair {
  Matrix<T, Exec> ua, ug;
  Vector<T, Exec> la, lg, ca, cg;
  /// Factored damping: \f$w(x, y) = 1/((x + \sqrt\gamma)(y + \sqrt\gamma))\f$, the solve with
  /// \f$(\tilde G + \sqrt\gamma I) \otimes (\tilde A + \sqrt\gamma I)\f$ (Cholesky's form with \f$\pi = 1\f$).
  bool factored = false;
  /// The shift s added to every eigenvalue in \f$1/((x + s)(y + s) + d)\f$: \f$\sqrt\gamma\f$
  /// when factored, else 0 (x + 0 is x: the same bits).
  T shift(double damping) const { return factored ? T(std::sqrt(damping)) : T(0); }
  /// The d of \f$1/((x + s)(y + s) + d)\f$: 0 when factored, else \f$\gamma\f$.
  T added(double damping) const { return factored ? T(0) : T(damping); }
};

/// \brief A coefficient of low_rank_apply, with \f$w(x, y) = 1/(xy + \gamma)\f$:
/// \f$w(x, y) - [\mathrm{sub}_A]\,w(x, c_A) - [\mathrm{sub}_G]\,w(c_G, y) +
/// [\mathrm{sub}_A \wedge \mathrm{sub}_G]\,w(c_G, c_A)\f$. With x, y a kept eigenvalue of G and
/// of A and sub_A, sub_G "that factor has a complement" it is the core coefficient C_ij; with
/// y = c_A and sub_A false it is \f$\alpha_i\f$; with x = c_G and sub_G false \f$\beta_j\f$; with
/// both scales and neither flag \f$s_4\f$.
template <class T>
KOKKOS_INLINE_FUNCTION T block_coefficient(T x, T y, T cg, T ca, T d, bool sub_a, bool sub_g) {
  T v = T(1) / (x * y + d);
  if (sub_a) v -= T(1) / (x * ca + d);
  if (sub_g) v -= T(1) / (cg * y + d);
  if (sub_a && sub_g) v += T(1) / (cg * ca + d);
  return v;
}

/// \brief Every coefficient of low_rank_apply for one damping, in r (x's shape): C in the top-left
/// k_G x k_A block, \f$\alpha\f$ in column k_A (when A has a complement), \f$\beta\f$ in row
/// k_G (when G has one), \f$s_4\f$ at (k_G, k_A). Both exact: \f$1/(\lambda_G \lambda_A^T +
/// \gamma)\f$, Eigendecomposition's bits.
template <class T, class Exec>
void low_rank_reciprocal(const Exec& exec, const LowRankPair<T, Exec>& f, double damping, const Matrix<T, Exec>& r) {
  const int kg = int(f.ug.extent(1)), ka = int(f.ua.extent(1));
  const bool has_g = kg < int(r.extent(0)), has_a = ka < int(r.extent(1));
  const T s = f.shift(damping), d = f.added(damping);
  auto la = f.la, lg = f.lg, ca = f.ca, cg = f.cg;
  Kokkos::parallel_for(
      "kfac::randomized::reciprocal", ColumnMajorRange<Exec>(exec, {0, 0}, {kg + has_g, ka + has_a}),
      KOKKOS_LAMBDA(int i, int j) {
        r(i, j) = block_coefficient((i < kg ? lg(i) : cg(0)) + s, (j < ka ? la(j) : ca(0)) + s, cg(0) + s, ca(0) + s, d,
                                    j < ka && has_a, i < kg && has_g);
      });
}

/// \brief m(i, j) *= c(i) on rows [0, rows) and columns [0, cols). On the host each c(i) is
/// computed once, not once per entry (a coefficient of low_rank_apply costs one to three
/// divisions, which the compiler cannot hoist out of a per-entry kernel: m may alias the
/// eigenvalues it reads); on a device one thread per entry. The same bits either way.
template <class Exec, class M, class C>
void scale_rows_by(const Exec& exec, const char* label, const M& m, int rows, int cols, const C& c) {
  if constexpr (host_accessible_v<Exec>) {
    Kokkos::parallel_for(label, Kokkos::RangePolicy<Exec>(exec, 0, rows), KOKKOS_LAMBDA(int i) {
      const auto ci = c(i);
      for (int j = 0; j < cols; ++j) m(i, j) *= ci;
    });
  } else {
    Kokkos::parallel_for(label, ColumnMajorRange<Exec>(exec, {0, 0}, {rows, cols}),
                         KOKKOS_LAMBDA(int i, int j) { m(i, j) *= c(i); });
  }
}

/// \brief out(i, j) += x(i, j) c(j) when x is given, else out(i, j) *= c(j), on rows [0, rows)
/// and columns [0, cols): scale_rows_by's counterpart for columns (on the host each c(j) once and
/// a contiguous loop down the column).
template <class Exec, class M, class X, class C>
void scale_columns_by(const Exec& exec, const char* label, const M& out, const X& x, int rows, int cols, const C& c) {
  const bool add = x.data() != nullptr;
  if constexpr (host_accessible_v<Exec>) {
    Kokkos::parallel_for(label, Kokkos::RangePolicy<Exec>(exec, 0, cols), KOKKOS_LAMBDA(int j) {
      const auto cj = c(j);
      auto* o = &out(0, j);
      if (add) {
        const auto* xj = &x(0, j);
        for (int i = 0; i < rows; ++i) o[i] += xj[i] * cj;
      } else {
        for (int i = 0; i < rows; ++i) o[i] *= cj;
      }
    });
  } else {
    Kokkos::parallel_for(label, ColumnMajorRange<Exec>(exec, {0, 0}, {rows, cols}), KOKKOS_LAMBDA(int i, int j) {
      if (add) out(i, j) += x(i, j) * c(j);
      else out(i, j) *= c(j);
    });
  }
}

/// \brief out = \f$\mathrm{mat}((\tilde G \otimes \tilde A + \gamma I)^{-1}\mathrm{vec}(X))\f$ for
/// low-rank-plus-scaled-identity factors, X (g x a). With \f$K = U_G^T X\f$, \f$S = K U_A\f$,
/// \f$M = X U_A\f$ and the coefficients of block_coefficient (\f$s_4 = w(c_G, c_A)\f$, \f$\alpha_i =
/// w(\lambda_{G,i}, c_A) - s_4\f$, \f$\beta_j = w(c_G, \lambda_{A,j}) - s_4\f$, C):
/// \f[ V = s_4 X + U_G \left[\mathrm{diag}(\alpha) K + (S \odot C) U_A^T\right]
///       + M\,\mathrm{diag}(\beta)\,U_A^T, \f]
/// six GEMMs, 2 g a (k_G + k_A) + 2 a k_G k_A multiply-adds; the terms of an exact factor's
/// (empty) complement are left out. Both exact (and the damping not factored):
/// Eigendecomposition's apply, bit for bit. K, S
/// and M live in `work` and `out` (x's shape); `r` is low_rank_reciprocal's (every coefficient
/// then from its damping, as Eigendecomposition's precomputed reciprocal) or empty.
template <class T, class Exec>
void low_rank_apply(const Exec& exec, const LowRankPair<T, Exec>& f, const Matrix<T, Exec>& x, double damping,
                    const Matrix<T, Exec>& r, const Matrix<T, Exec>& work, const Matrix<T, Exec>& out) {
  using Part = Kokkos::View<T**, Kokkos::LayoutLeft, typename Exec::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const int g = int(x.extent(0)), a = int(x.extent(1)), kg = int(f.ug.extent(1)), ka = int(f.ua.extent(1));
  const bool has_g = kg < g, has_a = ka < a;
  if (!has_g && !has_a && !f.factored) {
    eigenbasis_apply(exec, f.ua, f.la, f.ug, f.lg, x, damping, r, work, out);
    return;
  }
  const T s0 = f.shift(damping), d = f.added(damping);
  const bool pre = r.extent(0) == out.extent(0) && r.extent(1) == out.extent(1);
  auto la = f.la, lg = f.lg, ca = f.ca, cg = f.cg;
  const Part k(work.data(), kg, a), s(out.data(), kg, ka);
  gemm(exec, "T", "N", T(1), f.ug, x, T(0), k);  // K = U_G^T X
  gemm(exec, "N", "N", T(1), k, f.ua, T(0), s);  // S = K U_A
  Kokkos::parallel_for(
      "kfac::randomized::core", ColumnMajorRange<Exec>(exec, {0, 0}, {kg, ka}), KOKKOS_LAMBDA(int i, int j) {
        s(i, j) *= pre ? r(i, j) : block_coefficient(lg(i) + s0, la(j) + s0, cg(0) + s0, ca(0) + s0, d, has_a, has_g);
      });
  if (has_a) {
    scale_rows_by(exec, "kfac::randomized::scale_rows", k, kg, a, KOKKOS_LAMBDA(int i) {
      return pre ? r(i, ka) : block_coefficient(lg(i) + s0, ca(0) + s0, cg(0) + s0, ca(0) + s0, d, false, has_g);
    });
  }
  gemm(exec, "N", "T", T(1), s, f.ua, T(has_a ? 1 : 0), k);  // diag(alpha) K + (S o C) U_A^T
  gemm(exec, "N", "N", T(1), f.ug, k, T(0), out);            // U_G (...)
  if (!has_g) return;
  if (has_a) {
    scale_columns_by(exec, "kfac::randomized::add_scaled", out, x, g, a, KOKKOS_LAMBDA(int) {
      return pre ? r(kg, ka) : block_coefficient(cg(0) + s0, ca(0) + s0, cg(0) + s0, ca(0) + s0, d, false, false);
    });
  }
  const Part m(work.data(), g, ka);
  gemm(exec, "N", "N", T(1), x, f.ua, T(0), m);  // M = X U_A
  scale_columns_by(exec, "kfac::randomized::scale_columns", m, Part(), g, ka, KOKKOS_LAMBDA(int j) {
    return pre ? r(kg, j) : block_coefficient(cg(0) + s0, la(j) + s0, cg(0) + s0, ca(0) + s0, d, has_a, false);
  });
  gemm(exec, "N", "T", T(1), m, f.ua, T(1), out);  // + M diag(beta) U_A^T
}

}  // namespace impl

/// \brief Inversion policy: randomized low-rank-plus-scaled-identity factors (the top-k
/// eigenpairs by a randomized range finder with power iterations, warm-started from the last
/// basis), damping applied at preconditioning. The file comment has the math.
/// \tparam Backend of the small eigh (and of the exact decomposition of small factors):
/// AutoBackend (LAPACK on the host, cuSOLVER on CUDA) or PortableBackend.
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | int | rank | k: eigenpairs kept per factor, >= 1; a factor with n <= k is decomposed exactly | 64 |
/// | int | oversampling | p: extra columns of the range finder, >= 0 (l = min(k + p, n) columns; k + p >= n decomposes exactly and keeps the top k) | 16 |
/// | int | power_iterations | q: products with F between the first and the Rayleigh-Ritz step, each after an orthonormalization, >= 0 | 1 |
/// | bool | warm_start | start from the last basis U (and p columns of the test matrix) once the factorization holds one (subspace iteration across decompositions); false: from the test matrix every time | true |
/// | bool | factored_damping | \f$(\tilde G + \sqrt\gamma I)^{-1} X (\tilde A + \sqrt\gamma I)^{-1}\f$ (Cholesky's form, \f$\pi = 1\f$) instead of \f$(\tilde G \otimes \tilde A + \gamma I)^{-1}\f$ | false |
/// | uint64 | seed | of the test matrix \f$\Omega\f$ (standard_normal: the same bits on every rank and backend) | 0x6b666163 |
///
/// Split preconditioning: `split_passes` = 0, the layer is not divided (its apply is already
/// O(g a k)); its gradient workers each apply the whole layer.
template <class Backend = AutoBackend>
struct RandomizedEigen {
  static constexpr const char* name = "randomized_eigen";
  static constexpr bool damping_at_apply = true;
  /// compute() launches GEMMs through Kokkos Kernels: it stays on the calling thread.
  static constexpr bool host_thread_safe = false;
  static constexpr int split_passes = 0;
  static constexpr std::uint64_t default_seed = 0x6b666163;  // "kfac"
  using backend_type = Backend;

  int rank = 64;
  int oversampling = 16;
  int power_iterations = 1;
  bool warm_start = true;
  bool factored_damping = false;
  std::uint64_t seed = default_seed;

  RandomizedEigen& with_rank(int k) {
    if (k < 1) throw Error("", "RandomizedEigen: expected rank >= 1");
    rank = k;
    return *this;
  }
  RandomizedEigen& with_oversampling(int p) {
    if (p < 0) throw Error("", "RandomizedEigen: expected oversampling >= 0");
    oversampling = p;
    return *this;
  }
  RandomizedEigen& with_power_iterations(int q) {
    if (q < 0) throw Error("", "RandomizedEigen: expected power_iterations >= 0");
    power_iterations = q;
    return *this;
  }
  RandomizedEigen& with_warm_start(bool on) {
    warm_start = on;
    return *this;
  }
  /// Damps each factor by \f$\sqrt\gamma\f$: \f$(\tilde G + \sqrt\gamma I)^{-1} X (\tilde A + \sqrt\gamma I)^{-1}\f$,
  /// the form of `Cholesky<>{}.with_pi_damping(false)` with the approximated factors, instead of
  /// \f$(\tilde G \otimes \tilde A + \gamma I)^{-1}\f$.
  RandomizedEigen& with_factored_damping(bool on) {
    factored_damping = on;
    return *this;
  }
  RandomizedEigen& with_seed(std::uint64_t s) {
    seed = s;
    return *this;
  }

  /// Every setting ("r=64,p=16,q=1", then ",cold", ",factored" and ",seed=.." when not the defaults).
  std::string settings() const {
    std::string s = "r=" + std::to_string(rank) + ",p=" + std::to_string(oversampling) + ",q=" +
                    std::to_string(power_iterations);
    if (!warm_start) s += ",cold";
    if (factored_damping) s += ",factored";
    if (seed != default_seed) s += ",seed=" + std::to_string(seed);
    return s;
  }
  /// Every setting by name, for the agreement of settings across ranks (impl::agree_on_step).
  std::string describe() const {
    return "rank=" + std::to_string(rank) + ",oversampling=" + std::to_string(oversampling) +
           ",power_iterations=" + std::to_string(power_iterations) + ",warm_start=" + std::to_string(int(warm_start)) +
           ",factored_damping=" + std::to_string(int(factored_damping)) + ",seed=" + std::to_string(seed);
  }
  /// The settings of a layer with factors of a_dim and g_dim: "exact" when both are decomposed
  /// exactly (rank >= both), where no other setting changes the result ("exact,factored" with
  /// factored damping); else settings().
  std::string settings(index_t a_dim, index_t g_dim) const {
    return rank >= a_dim && rank >= g_dim ? (factored_damping ? "exact,factored" : "exact") : settings();
  }
  /// Columns kept for an n x n factor.
  index_t kept(index_t n) const { return rank < n ? rank : n; }
  /// Buffers of one factorization of an n x n factor: U (n x k), Lambda (k), c (1).
  std::vector<std::size_t> counts(index_t n) const {
    const std::size_t k = std::size_t(kept(n));
    return {std::size_t(n) * k, k, 1};
  }
  /// Relative cost of one decomposition of an n x n factor, and of what it stores (n k + k + 1).
  /// n^3 when decomposed exactly (k + p >= n), as Eigendecomposition's; else the GEMMs'
  /// multiply-adds, (q + 2) products F Y of n^2 l, 2q + 3 SVQB passes of 1.5 n l^2 (syrk and
  /// Y W), the Rayleigh-Ritz step's n l^2 + n l k, plus l^3 for each of the 2q + 4 small eighs.
  impl::UnitCost cost(index_t n) const {
    const double k = kept(n), l = std::min<double>(k + oversampling, n), nn = n;
    const double memory = nn * k + k + 1;
    impl::UnitCost c{nn * nn * nn, memory};
    if (l >= nn) {
      c.work.eigh_n3 = c.flops;
      return c;
    }
    const double q = power_iterations;
    const double gemms = (q + 2) * nn * nn * l + 1.5 * (2 * q + 3) * nn * l * l + nn * l * l + nn * l * k;
    c.flops = gemms + (2 * q + 4) * l * l * l;
    c.work.gemm_flops = 2 * gemms;  // multiply-adds: two flops each
    c.work.eigh_n3 = (2 * q + 4) * l * l * l;
    return c;
  }
  /// Preconditioning a g x a gradient: six GEMMs, 2 g a (k_G + k_A) + 2 a k_G k_A
  /// multiply-adds; Eigendecomposition's four when both factors keep every direction.
  Work apply_work(index_t g, index_t a) const {
    const double kg = double(kept(g)), ka = double(kept(a)), gg = double(g), aa = double(a);
    Work w;
    w.gemm_flops = kg == gg && ka == aa ? 4.0 * gg * aa * (gg + aa)
                                        : 2.0 * (2.0 * gg * aa * (kg + ka) + 2.0 * aa * kg * ka);
    return w;
  }

  template <class T, class Exec>
  struct Factorization {
    impl::Matrix<T, Exec> u;           ///< n x k basis, columns by ascending eigenvalue
    impl::Vector<T, Exec> lambda;      ///< k kept eigenvalues, ascending, >= 0
    impl::Vector<T, Exec> complement;  ///< c, the scale of I - U U^T (1 value; 0 when k = n)
    /// The small eigh's scratch memory (and the exact decomposition's), kept between decompositions.
    impl::SolverWorkspace<T, Exec> workspace;
    /// Decompositions computed here: exactly (k + p >= n), from the test matrix, from the last basis.
    long exact = 0, cold = 0, warm = 0;
    bool factored = false;  ///< RandomizedEigen::factored_damping

    Factorization(index_t n, const RandomizedEigen& s)
        : u(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::randomized::u"), n, s.kept(n)),
          lambda("kfac::randomized::lambda", s.kept(n)), complement("kfac::randomized::complement", 1),
          factored(s.factored_damping) {}
    std::size_t bytes() const { return (u.size() + lambda.size() + complement.size()) * sizeof(T); }
    std::vector<impl::Buffer> buffers() const {
      return {impl::buffer_of(u), impl::buffer_of(lambda), impl::buffer_of(complement)};
    }
    /// True when u holds a basis (computed here, received, or restored from a checkpoint): some
    /// kept eigenvalue is positive (lambda starts at 0). A warm start begins from it, so that a
    /// resumed run continues where the uninterrupted one does.
    bool has_basis() const { return impl::any_positive(lambda); }

    /// `shift` > 0 (a retry): decomposes factor + shift I and takes shift off the eigenvalues and c.
    template <class F>
    void compute(const Exec& exec, const F& factor, double /*damping*/, const RandomizedEigen& settings,
                 double shift = 0) {
      const int n = int(factor.extent(0)), k = int(u.extent(1));
      const int l = k + settings.oversampling < n ? k + settings.oversampling : n;
      if (k == n) {  // Eigendecomposition's decomposition
        ++exact;
        impl::clamped_eigh<Backend>(exec, factor, u, lambda, workspace, 60, shift);
        Kokkos::deep_copy(complement, T(0));
        return;
      }
      if (l == n) {  // every column: decompose exactly, keep the top k; c = the mean of the others
        ++exact;
        impl::Matrix<T, Exec> q(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::randomized::q"), n, n);
        impl::Vector<T, Exec> w("kfac::randomized::w", n);
        impl::clamped_eigh<Backend>(exec, factor, q, w, workspace, 60, shift);
        Kokkos::deep_copy(u, Kokkos::subview(q, Kokkos::ALL, std::make_pair(n - k, n)));
        exec.fence();
        const auto wh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), w);
        double trace = 0;
        for (int i = 0; i < n; ++i) trace += double(wh(i));
        impl::keep_top_eigenvalues(exec, w, trace, 0.0, n, lambda, complement);
        return;
      }
      impl::Matrix<T, Exec> full(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::randomized::factor"), n, n);
      impl::symmetric_copy(exec, factor, full);
      if (shift > 0) impl::add_diagonal(exec, full, T(shift));
      const double trace = impl::diagonal_sum(exec, full);
      impl::Matrix<T, Exec> y(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::randomized::y"), n, l);
      impl::Matrix<T, Exec> tmp(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::randomized::tmp"), n, l);
      impl::Matrix<T, Exec> gram("kfac::randomized::gram", l, l), vecs("kfac::randomized::vecs", l, l);
      impl::Vector<T, Exec> theta("kfac::randomized::theta", l);
      if (settings.warm_start && has_basis()) {
        ++warm;
        Kokkos::deep_copy(Kokkos::subview(tmp, Kokkos::ALL, std::make_pair(0, k)), u);
        impl::fill_standard_normal(tmp, k, l, settings.seed, k, 1 / std::sqrt(double(n)));
      } else {
        ++cold;
        impl::fill_standard_normal(tmp, 0, l, settings.seed, 0, 1 / std::sqrt(double(n)));
      }
      impl::gemm(exec, "N", "N", T(1), full, tmp, T(0), y);  // Y = F Omega
      for (int it = 0; it < settings.power_iterations; ++it) {
        impl::orthonormalize<Backend>(exec, y, tmp, gram, vecs, theta, workspace, 2, settings.seed);
        impl::gemm(exec, "N", "N", T(1), full, y, T(0), tmp);  // Y = F orth(Y)
        std::swap(y, tmp);
      }
      impl::orthonormalize<Backend>(exec, y, tmp, gram, vecs, theta, workspace, 3, settings.seed);  // Q
      impl::gemm(exec, "N", "N", T(1), full, y, T(0), tmp);  // F Q
      impl::gemm(exec, "T", "N", T(1), y, tmp, T(0), gram);  // B = Q^T F Q
      impl::eigh<Backend>(exec, gram, vecs, theta, workspace);
      impl::gemm(exec, "N", "N", T(1), y, Kokkos::subview(vecs, Kokkos::ALL, std::make_pair(l - k, l)), T(0), u);
      impl::keep_top_eigenvalues(exec, theta, trace, shift, n, lambda, complement);
    }
  };

  template <class T, class Exec>
  static impl::LowRankPair<T, Exec> factors_of(const Factorization<T, Exec>& a, const Factorization<T, Exec>& g) {
    return {a.u, g.u, a.lambda, g.lambda, a.complement, g.complement, a.factored};
  }

  /// Every coefficient of the apply for `damping` (impl::low_rank_reciprocal;
  /// \f$1/(\lambda_G \lambda_A^T + \gamma)\f$ when both factors are exact, as Eigendecomposition's).
  template <class T, class Exec>
  static void reciprocal(const Exec& exec, const Factorization<T, Exec>& a, const Factorization<T, Exec>& g,
                         double damping, const impl::Matrix<T, Exec>& r) {
    impl::low_rank_reciprocal(exec, factors_of(a, g), damping, r);
  }

  /// out = preconditioned x; `work` has x's shape; `r` is the precomputed reciprocal or empty.
  template <class T, class Exec>
  static void apply(const Exec& exec, const Factorization<T, Exec>& a, const Factorization<T, Exec>& g,
                    const impl::Matrix<T, Exec>& x, double damping, const impl::Matrix<T, Exec>& r,
                    const impl::Matrix<T, Exec>& work, const impl::Matrix<T, Exec>& out) {
    impl::low_rank_apply(exec, factors_of(a, g), x, damping, r, work, out);
  }
};

}  // namespace kfac
