#pragma once
/// \file eigendecomposition.hpp
/// \brief Inverse-free preconditioning by eigendecomposition (KAISA, Pauloski et al. 2022).
///
/// With \f$A = Q_A \Lambda_A Q_A^T\f$ and \f$G = Q_G \Lambda_G Q_G^T\f$ (eigenvalues clamped at 0),
/// the preconditioned gradient is the exact damped Kronecker solve
/// \f[ V = Q_G \left[ (Q_G^T X Q_A) \oslash (\lambda_G \lambda_A^T + \gamma) \right] Q_A^T
///       = \mathrm{mat}\left( (G \otimes A + \gamma I)^{-1} \mathrm{vec}(X) \right), \f]
/// X of shape (g_dim, a_dim), vec row-major. The damping \f$\gamma\f$ is applied at
/// preconditioning time, so it may change between decompositions, unless the reciprocal
/// \f$1/(\lambda_G \lambda_A^T + \gamma)\f$ is precomputed (Options::precompute_reciprocal).

#include <utility>

#include "kfac/core/block.hpp"
#include "kfac/linalg/eigh.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/symmetric.hpp"

namespace kfac {
namespace impl {

/// True when some eigenvalue is positive: a factorization's basis was computed, received or
/// restored (its eigenvalues start at 0). Reads them on the host.
template <class V>
bool any_positive(const V& lambda) {
  const auto l = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lambda);
  for (std::size_t i = 0; i < l.extent(0); ++i)
    if (l(i) > typename V::non_const_value_type(0)) return true;
  return false;
}

/// \brief The eigendecomposition of the upper triangle of `factor` + `shift` I into q (vectors)
/// and lambda (ascending values), with `shift` taken off the eigenvalues again and every
/// eigenvalue clamped at 0. `shift` > 0 (a retry) is the same decomposition in exact arithmetic
/// but another problem for the solver.
template <class Backend, class Exec, class F, class T>
void clamped_eigh(const Exec& exec, const F& factor, const Matrix<T, Exec>& q, const Vector<T, Exec>& lambda,
                  SolverWorkspace<T, Exec>& workspace, int jacobi_sweeps, double shift) {
  const int n = int(factor.extent(0));
  if (shift > 0) {
    Matrix<T, Exec> shifted(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::eigen::shifted"), n, n);
    symmetric_copy(exec, factor, shifted);
    add_diagonal(exec, shifted, T(shift));
    eigh<Backend>(exec, shifted, q, lambda, workspace, jacobi_sweeps);
  } else {
    eigh<Backend>(exec, factor, q, lambda, workspace, jacobi_sweeps);
  }
  auto l = lambda;
  const T s = T(shift);
  Kokkos::parallel_for(
      "kfac::eigen::clamp", Kokkos::RangePolicy<Exec>(exec, 0, int(l.extent(0))),
      KOKKOS_LAMBDA(int i) { const T v = l(i) - s; l(i) = v > T(0) ? v : T(0); });
}

/// Columns [c0, c1) of out divided by \f$\lambda_G \lambda_A^T + \gamma\f$ (or times the
/// precomputed reciprocal `r`, when it has out's shape). `la` and `lg` are contiguous vectors of
/// any scalar that converts to T (an Embedding's diag(A) is its stored factor).
template <class T, class Exec, class LA, class LG>
void scale_eigenbasis_columns(const Exec& exec, const LA& la, const LG& lg, double damping, const Matrix<T, Exec>& r,
                              const Matrix<T, Exec>& out, int c0, int c1) {
  const T d = T(damping);
  const bool pre = r.extent(0) == out.extent(0) && r.extent(1) == out.extent(1);
  const int rows = int(out.extent(0));
  if constexpr (host_accessible_v<Exec>) {
    // One column per iteration, la(j) read once: a loop the compiler vectorizes (a per-entry
    // kernel reloads every eigenvalue, as out may alias them). The same bits.
    Kokkos::parallel_for(
        "kfac::eigen::scale", Kokkos::RangePolicy<Exec>(exec, c0, c1), KOKKOS_LAMBDA(int j) {
          T* o = &out(0, j);
          const auto* g = lg.data();
          if (pre) {
            const T* rj = &r(0, j);
            for (int i = 0; i < rows; ++i) o[i] = o[i] * rj[i];
          } else {
            const T aj = T(la(j));
            for (int i = 0; i < rows; ++i) o[i] = o[i] / (T(g[i]) * aj + d);
          }
        });
  } else {
    Kokkos::parallel_for(
        "kfac::eigen::scale", ColumnMajorRange<Exec>(exec, {0, c0}, {rows, c1}),
        KOKKOS_LAMBDA(int i, int j) { out(i, j) = pre ? out(i, j) * r(i, j) : out(i, j) / (T(lg(i)) * T(la(j)) + d); });
  }
}

/// \brief out = \f$Q_G [(Q_G^T X Q_A) \oslash (\lambda_G \lambda_A^T + \gamma)] Q_A^T\f$ for
/// complete eigenbases (q_a a x a, q_g g x g); `work` has x's shape; `r` is the precomputed
/// reciprocal or empty.
template <class T, class Exec>
void eigenbasis_apply(const Exec& exec, const Matrix<T, Exec>& qa, const Vector<T, Exec>& la, const Matrix<T, Exec>& qg,
                      const Vector<T, Exec>& lg, const Matrix<T, Exec>& x, double damping, const Matrix<T, Exec>& r,
                      const Matrix<T, Exec>& work, const Matrix<T, Exec>& out) {
  gemm(exec, "T", "N", T(1), qg, x, T(0), work);    // Q_G^T X
  gemm(exec, "N", "N", T(1), work, qa, T(0), out);  // (Q_G^T X) Q_A
  scale_eigenbasis_columns(exec, la, lg, damping, r, out, 0, int(out.extent(1)));
  gemm(exec, "N", "N", T(1), qg, out, T(0), work);  // Q_G (...)
  gemm(exec, "N", "T", T(1), work, qa, T(0), out);  // (...) Q_A^T
}

}  // namespace impl

/// \brief Inversion policy: eigendecompositions of A and G, damping applied at preconditioning.
/// \tparam Backend AutoBackend (LAPACK syevd on the host, cuSOLVER on CUDA) or PortableBackend.
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | int | jacobi_sweeps | sweep limit of the portable Jacobi eigensolver (PortableBackend, or a backend without a vendor solver) | 60 |
/// | double | refresh_tolerance | τ > 0: a decomposition first tries the eigenvalues of the factor in the kept eigenbasis (two GEMMs, as EKFAC, George et al. 2018) and keeps them when the factor is within τ of that basis' reconstruction (relative Frobenius norm), else decomposes exactly; 0: always exactly | 0 |
template <class Backend = AutoBackend>
struct Eigendecomposition {
  static constexpr const char* name = "eigen";
  static constexpr bool damping_at_apply = true;
  /// compute() on the LAPACK path launches only range kernels and copies: it may run on a
  /// second host thread (Block::decomposes_off_thread).
  static constexpr bool host_thread_safe = true;
  using backend_type = Backend;

  int jacobi_sweeps = 60;
  double refresh_tolerance = 0;
  Eigendecomposition& with_jacobi_sweeps(int n) {
    if (n < 1) throw Error("", "Eigendecomposition: expected jacobi_sweeps >= 1");
    jacobi_sweeps = n;
    return *this;
  }
  Eigendecomposition& with_refresh_tolerance(double tau) {
    if (!(tau >= 0 && tau < 1)) throw Error("", "Eigendecomposition: expected 0 <= refresh_tolerance < 1");
    refresh_tolerance = tau;
    return *this;
  }
  /// Settings that differ from the defaults, for the layer's signature ("" at the defaults, so
  /// signatures, and checkpoints, of default-built policies stay those of kfac 0.1).
  std::string settings() const {
    std::string s = jacobi_sweeps == 60 ? "" : "sweeps=" + std::to_string(jacobi_sweeps);
    if (refresh_tolerance > 0) s += std::string(s.empty() ? "" : ",") + "refresh=" + std::to_string(refresh_tolerance);
    return s;
  }
  /// Every setting by name, for the agreement of settings across ranks (impl::agree_on_step).
  std::string describe() const {
    return "jacobi_sweeps=" + std::to_string(jacobi_sweeps) + ",refresh_tolerance=" + impl::number(refresh_tolerance);
  }
  /// Buffers of one factorization of an n x n factor: Q and lambda.
  static std::vector<std::size_t> counts(index_t n) { return {std::size_t(n) * n, std::size_t(n)}; }
  /// Relative cost of one decomposition of an n x n factor, and of what it stores.
  static impl::UnitCost cost(index_t n) {
    impl::UnitCost c{double(n) * n * n, double(n) * n};
    c.work.eigh_n3 = c.flops;
    return c;
  }
  /// Preconditioning a g x a gradient: four GEMMs, \f$Q_G^T X Q_A\f$ and back.
  static Work apply_work(index_t g, index_t a) {
    Work w;
    w.gemm_flops = 4.0 * double(g) * double(a) * double(g + a);
    return w;
  }

  template <class T, class Exec>
  struct Factorization {
    impl::Matrix<T, Exec> q;
    impl::Vector<T, Exec> lambda;
    /// The solver's scratch memory, reused by every decomposition of this factor.
    impl::SolverWorkspace<T, Exec> workspace;
    /// Decompositions of this factor computed here: exactly, and as refreshes (refresh_tolerance).
    long exact = 0, refreshed = 0;

    explicit Factorization(index_t n = 0)
        : q(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::eigen::q"), n, n),
          lambda("kfac::eigen::lambda", n) {}
    std::size_t bytes() const { return (q.size() + lambda.size()) * sizeof(T); }
    std::vector<impl::Buffer> buffers() const { return {impl::buffer_of(q), impl::buffer_of(lambda)}; }
    /// True when q holds an eigenbasis — computed here, received or restored from a checkpoint:
    /// some eigenvalue is positive (lambda starts at 0). A refresh starts from it, so that a
    /// resumed run refreshes where the uninterrupted one does.
    bool has_basis() const { return impl::any_positive(lambda); }

    /// `shift` > 0 (a retry): decomposes factor + shift I and subtracts shift from the
    /// eigenvalues, the same decomposition in exact arithmetic but another problem for the solver.
    template <class F>
    void compute(const Exec& exec, const F& factor, double /*damping*/,
                 const Eigendecomposition& settings, double shift = 0) {
      const int n = int(factor.extent(0));
      if (settings.refresh_tolerance > 0 && shift == 0 && has_basis()) {
        if (refresh_.extent(0) != std::size_t(n)) {
          refresh_ = impl::Matrix<T, Exec>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::eigen::refresh"), n, 2 * n);
          norms_ = Kokkos::View<double*, typename Exec::memory_space>("kfac::eigen::refresh_norms", 2 * n);
        }
        const impl::Matrix<T, Exec> fq = Kokkos::subview(refresh_, Kokkos::ALL, std::make_pair(0, n));
        const impl::Matrix<T, Exec> b = Kokkos::subview(refresh_, Kokkos::ALL, std::make_pair(n, 2 * n));
        if (impl::refresh_eigenvalues<Backend>(exec, factor, q, lambda, settings.refresh_tolerance,
                                               workspace.scratch_for(n), fq, b, norms_)) {
          ++refreshed;
          return;
        }
      }
      ++exact;
      impl::clamped_eigh<Backend>(exec, factor, q, lambda, workspace, settings.jacobi_sweeps, shift);
    }

   private:
    impl::Matrix<T, Exec> refresh_;  // F Q and Q^T F Q, side by side (refresh_tolerance > 0)
    Kokkos::View<double*, typename Exec::memory_space> norms_;
  };

  /// r = 1 / (lambda_G lambda_A^T + damping), shape (g, a).
  template <class T, class Exec>
  static void reciprocal(const Exec& exec, const Factorization<T, Exec>& a,
                         const Factorization<T, Exec>& g, double damping,
                         const impl::Matrix<T, Exec>& r) {
    auto la = a.lambda;
    auto lg = g.lambda;
    const T d = T(damping);
    Kokkos::parallel_for(
        "kfac::eigen::reciprocal",
        impl::ColumnMajorRange<Exec>(exec, {0, 0}, {int(r.extent(0)), int(r.extent(1))}),
        KOKKOS_LAMBDA(int i, int j) { r(i, j) = T(1) / (lg(i) * la(j) + d); });
  }

  /// out = preconditioned x; `work` has x's shape; `r` is the precomputed reciprocal or empty.
  template <class T, class Exec>
  static void apply(const Exec& exec, const Factorization<T, Exec>& a,
                    const Factorization<T, Exec>& g, const impl::Matrix<T, Exec>& x,
                    double damping, const impl::Matrix<T, Exec>& r,
                    const impl::Matrix<T, Exec>& work, const impl::Matrix<T, Exec>& out) {
    impl::eigenbasis_apply(exec, a.q, a.lambda, g.q, g.lambda, x, damping, r, work, out);
  }

  /// Split preconditioning: pass 0 computes columns [c0, c1) of the middle matrix
  /// \f$W = (Q_G^T X Q_A) \oslash (\lambda_G \lambda_A^T + \gamma)\f$ from columns c0..c1 of
  /// \f$Q_A\f$; once every holder's columns of W are gathered into `out`, pass 1 computes
  /// columns [c0, c1) of \f$Q_G W Q_A^T\f$ from rows c0..c1 of \f$Q_A\f$. Each pass does
  /// (c1 - c0) / a of the whole apply's flops.
  static constexpr int split_passes = 2;
  template <class T, class Exec>
  static void apply_rows(const Exec& exec, const Factorization<T, Exec>& a, const Factorization<T, Exec>& g,
                         const impl::Matrix<T, Exec>& x, double damping, const impl::Matrix<T, Exec>& r,
                         const impl::Matrix<T, Exec>& work, const impl::Matrix<T, Exec>& out, int pass,
                         index_t c0, index_t c1) {
    if (c1 <= c0) return;
    const auto cols = std::make_pair(c0, c1);
    const auto w = Kokkos::subview(work, Kokkos::ALL, cols);
    const auto o = Kokkos::subview(out, Kokkos::ALL, cols);
    if (pass == 0) {
      impl::gemm(exec, "N", "N", T(1), x, Kokkos::subview(a.q, Kokkos::ALL, cols), T(0), w);  // X Q_A(:, c)
      impl::gemm(exec, "T", "N", T(1), g.q, w, T(0), o);                                     // Q_G^T (...)
      scale_columns(exec, a, g, damping, r, out, c0, c1);
    } else {
      // Rows c of Q_A, copied into a column-major block: BLAS cannot read a row block in place.
      const int n = int(a.q.extent(1));
      impl::Matrix<T, Exec> rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::eigen::rows"), c1 - c0, n);
      auto q = a.q;
      Kokkos::parallel_for(
          "kfac::eigen::copy_rows", impl::ColumnMajorRange<Exec>(exec, {0, 0}, {c1 - c0, n}),
          KOKKOS_LAMBDA(int i, int j) { rows(i, j) = q(c0 + i, j); });
      impl::gemm(exec, "N", "T", T(1), out, rows, T(0), w);  // W Q_A(c, :)^T, W gathered in out
      impl::gemm(exec, "N", "N", T(1), g.q, w, T(0), o);     // Q_G (...)
    }
  }

  /// Columns [c0, c1) of out divided by \f$\lambda_G \lambda_A^T + \gamma\f$ (or times the
  /// precomputed reciprocal `r`, when it has out's shape).
  template <class T, class Exec>
  static void scale_columns(const Exec& exec, const Factorization<T, Exec>& a, const Factorization<T, Exec>& g,
                            double damping, const impl::Matrix<T, Exec>& r, const impl::Matrix<T, Exec>& out,
                            int c0, int c1) {
    impl::scale_eigenbasis_columns(exec, a.lambda, g.lambda, damping, r, out, c0, c1);
  }
};

}  // namespace kfac
