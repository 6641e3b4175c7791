#pragma once
// Dense linear algebra kfac needs, each dispatched to a vendor library where one serves the
// execution space (BLAS/LAPACK on the host, cuBLAS/cuSOLVER on CUDA) and to a portable Kokkos
// implementation otherwise. The portable path is always compiled and always tested.
#include <KokkosBlas3_gemm.hpp>
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "kfac/error.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/impl/ordered_sum.hpp"
#if defined(KFAC_HAVE_CUSOLVER)
#include "kfac/impl/cusolver.hpp"
#endif

#if defined(KFAC_HAVE_LAPACK)
#include <cblas.h>
#include <lapacke.h>
#endif

namespace kfac {

/// \brief Backend tags for the decompositions of the inversion policies.
/// `AutoBackend` uses a vendor library where one serves the execution space (LAPACK on the
/// host, cuSOLVER on CUDA) and the portable Kokkos implementation otherwise; `PortableBackend`
/// always uses the portable one (slow, O(n^3) on one thread for the eigensolver, but it runs
/// on any backend and is the reference the vendor paths are tested against).
struct AutoBackend {};
struct PortableBackend {};

namespace impl {

#if defined(KFAC_HAVE_LAPACK)
inline int lapack_syevd(int n, double* a, int ld, double* w) {
  return LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'U', n, a, ld, w);
}
/// LAPACKE_ssyevd's own workspace query hands the size back as a float, which rounds it below
/// what ssyevd needs once 1 + 6n + 2n^2 passes 2^24 (n = 6273 failed with info = -9): the
/// documented minimum sizes are passed instead.
inline int lapack_syevd(int n, float* a, int ld, float* w) {
  const lapack_int lwork = 1 + 6 * lapack_int(n) + 2 * lapack_int(n) * lapack_int(n), liwork = 3 + 5 * lapack_int(n);
  std::vector<float> work(std::size_t(lwork > 0 ? lwork : 1));
  std::vector<lapack_int> iwork(static_cast<std::size_t>(liwork));
  return LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, 'V', 'U', n, a, ld, w, work.data(), lwork, iwork.data(), liwork);
}
inline int lapack_potrf(int n, double* a, int ld) { return LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', n, a, ld); }
inline int lapack_potrf(int n, float* a, int ld) { return LAPACKE_spotrf(LAPACK_COL_MAJOR, 'U', n, a, ld); }
inline int lapack_potri(int n, double* a, int ld) { return LAPACKE_dpotri(LAPACK_COL_MAJOR, 'U', n, a, ld); }
inline int lapack_potri(int n, float* a, int ld) { return LAPACKE_spotri(LAPACK_COL_MAJOR, 'U', n, a, ld); }
/// Upper triangle of C = alpha op(R) op(R)^T + beta C, op(R) = R^T (k x n, trans) or R (n x k).
inline void blas_syrk(bool trans, int n, int k, double alpha, const double* r, int ldr,
                      double beta, double* c, int ldc) {
  cblas_dsyrk(CblasColMajor, CblasUpper, trans ? CblasTrans : CblasNoTrans, n, k, alpha, r, ldr,
              beta, c, ldc);
}
inline void blas_syrk(bool trans, int n, int k, float alpha, const float* r, int ldr, float beta,
                      float* c, int ldc) {
  cblas_ssyrk(CblasColMajor, CblasUpper, trans ? CblasTrans : CblasNoTrans, n, k, alpha, r, ldr,
              beta, c, ldc);
}
/// C = op(A) B (n x n, column-major), op(A) = A^T when `trans`.
inline void blas_square_gemm(bool trans, int n, const double* a, int lda, const double* b, int ldb, double* c, int ldc) {
  cblas_dgemm(CblasColMajor, trans ? CblasTrans : CblasNoTrans, CblasNoTrans, n, n, n, 1.0, a, lda, b, ldb, 0.0, c, ldc);
}
inline void blas_square_gemm(bool trans, int n, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  cblas_sgemm(CblasColMajor, trans ? CblasTrans : CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}
#endif

// Which vendor path serves an entry: one availability trait per vendor library, so that an entry
// reads "vendor path if available, else the portable one" and a new backend adds a trait and its
// calls, not conditions inside the entries.

/// LAPACK and CBLAS serve host-accessible spaces (when kfac was built with them).
template <class Exec, class Backend>
constexpr bool use_lapack_v =
#if defined(KFAC_HAVE_LAPACK)
    host_accessible_v<Exec> && std::is_same<Backend, AutoBackend>::value;
#else
    false;
#endif

/// cuSOLVER serves Kokkos::Cuda (when kfac was built with it).
template <class Exec, class Backend>
constexpr bool use_cusolver_v =
#if defined(KFAC_HAVE_CUSOLVER)
    std::is_same<Exec, Kokkos::Cuda>::value && std::is_same<Backend, AutoBackend>::value;
#else
    false;
#endif

/// \brief Scratch memory of one factorization, kept between decompositions (a member of the
/// policies' Factorization objects): the vendor solver's workspace and info word (cuSOLVER),
/// and an n x n matrix for the portable paths (Cholesky factor, Jacobi's working copy). Grown
/// when a call needs more, never shrunk.
template <class T, class Exec>
struct SolverWorkspace {
  using memory_space = typename Exec::memory_space;
  Kokkos::View<T*, memory_space> work;
  Kokkos::View<int, memory_space> info;
  Matrix<T, Exec> scratch;

  /// At least `count` values of work (and the info word).
  T* work_for(std::size_t count) {
    if (work.extent(0) < count) work = Kokkos::View<T*, memory_space>("kfac::linalg::work", count);
    if (info.data() == nullptr) info = Kokkos::View<int, memory_space>("kfac::linalg::info");
    return work.data();
  }
  /// An n x n scratch matrix (contents undefined).
  const Matrix<T, Exec>& scratch_for(int n) {
    if (int(scratch.extent(0)) != n)
      scratch = Matrix<T, Exec>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::linalg::scratch"), n, n);
    return scratch;
  }
};

/// Throws kfac::Error "linalg::<entry>: <what>" unless ok (the shape checks of the entries).
inline void require_shape(bool ok, const char* entry, const char* what, std::size_t r0, std::size_t c0,
                          std::size_t r1 = 0, std::size_t c1 = 0) {
  if (ok) return;
  std::string msg = std::string("linalg::") + entry + ": " + what + " (got " + std::to_string(r0) + " x " +
                    std::to_string(c0);
  if (r1 || c1) msg += " and " + std::to_string(r1) + " x " + std::to_string(c1);
  throw Error("", msg + ")");
}

/// Checks that `f` is square and `m` has its shape (entries taking a factor and an n x n output).
template <class F, class M>
void require_square_pair(const char* entry, const F& f, const M& m) {
  static_assert(unsigned(F::rank) == 2 && unsigned(M::rank) == 2, "kfac::impl: matrices must be rank 2");
  require_shape(f.extent(0) == f.extent(1), entry, "the factor must be square", f.extent(0), f.extent(1));
  require_shape(m.extent(0) == f.extent(0) && m.extent(1) == f.extent(0), entry,
                "the output must have the factor's shape", f.extent(0), f.extent(1), m.extent(0), m.extent(1));
}

/// C = alpha op(A) op(B) + beta C, on the execution space's default instance.
template <class Exec, class A, class B, class C>
void gemm(const Exec& exec, const char* ta, const char* tb, typename C::non_const_value_type alpha,
          const A& a, const B& b, typename C::non_const_value_type beta, const C& c) {
  const bool at = ta[0] != 'N' && ta[0] != 'n', bt = tb[0] != 'N' && tb[0] != 'n';
  const std::size_t m = at ? a.extent(1) : a.extent(0), ka = at ? a.extent(0) : a.extent(1);
  const std::size_t kb = bt ? b.extent(1) : b.extent(0), n = bt ? b.extent(0) : b.extent(1);
  require_shape(ka == kb, "gemm", "op(A) and op(B) do not chain", m, ka, kb, n);
  require_shape(c.extent(0) == m && c.extent(1) == n, "gemm", "C must be op(A) op(B)'s shape", c.extent(0),
                c.extent(1), m, n);
#if defined(KOKKOSKERNELS_VERSION) && KOKKOSKERNELS_VERSION >= 40000
  KokkosBlas::gemm(exec, ta, tb, alpha, a, b, beta, c);
#else
  (void)exec;
  KokkosBlas::gemm(ta, tb, alpha, a, b, beta, c);
#endif
}

/// Upper triangle of C = alpha R^T R + beta C for R (k x n), column-major (LayoutLeft) or
/// row-major (LayoutRight). A row-major R is the column-major R^T, so no layout needs a copy.
/// The portable path computes the full product with GEMM; the BLAS path uses syrk (half the
/// flops).
template <class Exec, class T, class R>
void syrk_t_upper(const Exec& exec, T alpha, const R& r, T beta, const Matrix<T, Exec>& c) {
  constexpr bool row_major = std::is_same<typename R::array_layout, Kokkos::LayoutRight>::value;
  static_assert(row_major || std::is_same<typename R::array_layout, Kokkos::LayoutLeft>::value,
                "kfac::impl::syrk_t_upper: R must be LayoutLeft or LayoutRight");
  require_shape(c.extent(0) == c.extent(1) && r.extent(1) == c.extent(0), "syrk", "C must be n x n for R k x n",
                c.extent(0), c.extent(1), r.extent(0), r.extent(1));
  const int n = int(c.extent(0)), k = int(r.extent(0));
  if (n == 0) return;
#if defined(KFAC_HAVE_LAPACK)
  if constexpr (host_accessible_v<Exec>) {
    exec.fence();
    const int ldc = int(c.stride(1));
    if constexpr (row_major)
      blas_syrk(false, n, k, alpha, r.data(), n, beta, c.data(), ldc);
    else
      blas_syrk(true, n, k, alpha, r.data(), k > 0 ? int(r.stride(1)) : 1, beta, c.data(), ldc);
    return;
  }
#endif
  if constexpr (row_major) {
    const Kokkos::View<const T**, Kokkos::LayoutLeft, typename Exec::memory_space,
                       Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        rt(r.data(), n, k);
    gemm(exec, "N", "T", alpha, rt, rt, beta, c);
  } else {
    gemm(exec, "T", "N", alpha, r, r, beta, c);
  }
}

/// Copies the upper triangle of src into the whole of dst (symmetrizing, converting type).
template <class Exec, class S, class D>
void symmetric_copy(const Exec& exec, const S& src, const D& dst) {
  using T = typename D::non_const_value_type;
  const int n = int(src.extent(0));
  Kokkos::parallel_for(
      "kfac::linalg::symmetric_copy",
      ColumnMajorRange<Exec>(exec, {0, 0}, {n, n}),
      KOKKOS_LAMBDA(int i, int j) { dst(i, j) = T(i <= j ? src(i, j) : src(j, i)); });
}

/// Adds shift to the diagonal.
template <class Exec, class M>
void add_diagonal(const Exec& exec, const M& m, typename M::non_const_value_type shift) {
  Kokkos::parallel_for(
      "kfac::linalg::add_diagonal", Kokkos::RangePolicy<Exec>(exec, 0, int(m.extent(0))),
      KOKKOS_LAMBDA(int i) { m(i, i) += shift; });
}

// ---------------------------------------------------------------- portable eigensolver
/// Cyclic Jacobi on a symmetric matrix `a` (full, overwritten). On return q holds the
/// eigenvectors as columns and w the eigenvalues in ascending order (LAPACK's convention).
/// One thread does the work, so it runs on any backend; it is the reference implementation.
template <class Exec, class T>
void jacobi_eigh(const Exec& exec, const Matrix<T, Exec>& a, const Matrix<T, Exec>& q,
                 const Vector<T, Exec>& w, int max_sweeps = 60) {
  const int n = int(a.extent(0));
  Kokkos::View<int, typename Exec::memory_space> converged("kfac::jacobi::converged");
  Kokkos::parallel_for(
      "kfac::linalg::jacobi_eigh", Kokkos::RangePolicy<Exec>(exec, 0, 1), KOKKOS_LAMBDA(int) {
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < n; ++j) q(i, j) = T(i == j);
        T norm2 = 0;
        for (int j = 0; j < n; ++j)
          for (int i = 0; i < n; ++i) norm2 += a(i, j) * a(i, j);
        const T eps = sizeof(T) == 4 ? T(1e-7) : T(1e-15);
        converged() = 0;
        for (int sweep = 0; sweep < max_sweeps; ++sweep) {
          T off = 0;
          for (int j = 1; j < n; ++j)
            for (int i = 0; i < j; ++i) off += a(i, j) * a(i, j);
          if (off <= eps * eps * norm2) { converged() = 1; break; }
          for (int p = 0; p < n - 1; ++p)
            for (int r = p + 1; r < n; ++r) {
              const T apr = a(p, r);
              if (apr == T(0)) continue;
              const T theta = (a(r, r) - a(p, p)) / (T(2) * apr);
              const T t = (theta >= 0 ? T(1) : T(-1)) /
                          (abs_(theta) + sqrt_(theta * theta + T(1)));
              const T c = T(1) / sqrt_(t * t + T(1)), s = t * c;
              for (int k = 0; k < n; ++k) {
                const T akp = a(k, p), akr = a(k, r);
                a(k, p) = c * akp - s * akr;
                a(k, r) = s * akp + c * akr;
              }
              for (int k = 0; k < n; ++k) {
                const T apk = a(p, k), ark = a(r, k);
                a(p, k) = c * apk - s * ark;
                a(r, k) = s * apk + c * ark;
              }
              for (int k = 0; k < n; ++k) {
                const T qkp = q(k, p), qkr = q(k, r);
                q(k, p) = c * qkp - s * qkr;
                q(k, r) = s * qkp + c * qkr;
              }
            }
        }
        if (n <= 1) converged() = 1;
        for (int i = 0; i < n; ++i) w(i) = a(i, i);
        // selection sort, ascending, moving eigenvector columns along
        for (int i = 0; i < n - 1; ++i) {
          int m = i;
          for (int j = i + 1; j < n; ++j)
            if (w(j) < w(m)) m = j;
          if (m != i) {
            const T tw = w(i); w(i) = w(m); w(m) = tw;
            for (int k = 0; k < n; ++k) { const T tq = q(k, i); q(k, i) = q(k, m); q(k, m) = tq; }
          }
        }
      });
  auto h = Kokkos::create_mirror_view(converged);
  Kokkos::deep_copy(h, converged);
  if (!h())
    throw Error("", "Jacobi eigensolver did not converge in " + std::to_string(max_sweeps) + " sweeps");
}

/// Symmetric eigendecomposition of the upper triangle of `f`: q (eigenvectors, columns) and
/// w (ascending eigenvalues). `f` is left untouched; `ws` keeps scratch memory between calls.
template <class Backend, class Exec, class F, class T>
void eigh(const Exec& exec, const F& f, const Matrix<T, Exec>& q, const Vector<T, Exec>& w,
          SolverWorkspace<T, Exec>& ws, int jacobi_sweeps = 60) {
  require_square_pair("eigh", f, q);
  require_shape(w.extent(0) == f.extent(0), "eigh", "w must have one entry per row of the factor", f.extent(0),
                f.extent(1), w.extent(0), 1);
  const int n = int(f.extent(0));
#if defined(KFAC_HAVE_LAPACK)
  if constexpr (use_lapack_v<Exec, Backend>) {
    (void)ws;
    // syevd reads only the upper triangle: a plain copy (a memcpy) does when no type changes.
    if constexpr (std::is_same<typename F::non_const_value_type, T>::value &&
                  std::is_same<typename F::array_layout, Kokkos::LayoutLeft>::value)
      Kokkos::deep_copy(exec, q, f);
    else
      symmetric_copy(exec, f, q);
    exec.fence();
    const int info = lapack_syevd(n, q.data(), int(q.stride(1)), w.data());
    if (info != 0) throw Error("", "LAPACK syevd failed with info = " + std::to_string(info));
    return;
  }
#endif
  symmetric_copy(exec, f, q);
#if defined(KFAC_HAVE_CUSOLVER)
  if constexpr (use_cusolver_v<Exec, Backend>) {
    cusolver_eigh(exec, q, w, ws);
    return;
  }
#endif
  const Matrix<T, Exec>& work = ws.scratch_for(n);
  Kokkos::deep_copy(exec, work, q);
  jacobi_eigh(exec, work, q, w, jacobi_sweeps);
}

/// \brief Eigenvalues of the upper triangle of `f` in the kept orthonormal basis `q`: with
/// \f$B = Q^T F Q\f$, sets w = diag(B) (clamped at 0) and returns true when
/// \f$\|B - \mathrm{diag}(B)\|_F \le \tau \|F\|_F\f$; then \f$Q\,\mathrm{diag}(w)\,Q^T\f$ is within
/// \f$\tau\|F\|_F\f$ of F in the Frobenius norm (an orthogonal change of basis keeps the norm, and F
/// is positive semidefinite, so no diagonal entry is clamped). Returns false, leaving w as it was,
/// otherwise. Two n x n GEMMs and O(n^2) more; `fq`, `b` are n x n scratch, `col` 2n scratch.
/// Launches only range kernels and, on the LAPACK path, BLAS: it may run on a second host thread.
template <class Backend, class Exec, class F, class T>
bool refresh_eigenvalues(const Exec& exec, const F& f, const Matrix<T, Exec>& q, const Vector<T, Exec>& w,
                         double tau, const Matrix<T, Exec>& full, const Matrix<T, Exec>& fq,
                         const Matrix<T, Exec>& b, const Kokkos::View<double*, typename Exec::memory_space>& col) {
  const int n = int(f.extent(0));
  symmetric_copy(exec, f, full);
#if defined(KFAC_HAVE_LAPACK)
  if constexpr (use_lapack_v<Exec, Backend>) {
    exec.fence();
    const int ld = n > 0 ? int(q.stride(1)) : 1;
    blas_square_gemm(false, n, full.data(), int(full.stride(1)), q.data(), ld, fq.data(), int(fq.stride(1)));
    blas_square_gemm(true, n, q.data(), ld, fq.data(), int(fq.stride(1)), b.data(), int(b.stride(1)));
  } else
#endif
  {
    gemm(exec, "N", "N", T(1), full, q, T(0), fq);
    gemm(exec, "T", "N", T(1), q, fq, T(0), b);
  }
  Kokkos::parallel_for(  // per column: off-diagonal and total sums of squares (no reduction kernel)
      "kfac::eigen::refresh_norms", Kokkos::RangePolicy<Exec>(exec, 0, n), KOKKOS_LAMBDA(int j) {
        double off = 0, all = 0;
        for (int i = 0; i < n; ++i) {
          const double v = double(b(i, j));
          all += v * v;
          if (i != j) off += v * v;
        }
        col(j) = off;
        col(n + j) = all;
      });
  exec.fence();
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), col);
  double off = 0, all = 0;
  for (int j = 0; j < n; ++j) {
    off += host(j);
    all += host(n + j);
  }
  if (!(off <= tau * tau * all)) return false;
  Kokkos::parallel_for(
      "kfac::eigen::refresh_diagonal", Kokkos::RangePolicy<Exec>(exec, 0, n),
      KOKKOS_LAMBDA(int j) { w(j) = b(j, j) > T(0) ? b(j, j) : T(0); });
  return true;
}

/// The same with scratch memory for this call only.
template <class Backend, class Exec, class F, class T>
void eigh(const Exec& exec, const F& f, const Matrix<T, Exec>& q, const Vector<T, Exec>& w,
          int jacobi_sweeps = 60) {
  SolverWorkspace<T, Exec> ws;
  eigh<Backend>(exec, f, q, w, ws, jacobi_sweeps);
}

/// \brief Cholesky factorization L L^T of the full SPD matrix `a` into the lower triangle of
/// `l` (its upper triangle is left as copied). One team: each column's pivot is summed by one
/// thread (in the order of the former one-thread kernel), the entries below it by the team's
/// threads, each entry's sum in the same order, so the factor's bits do not depend on the team
/// size. `team_size` 0: the largest the backend allows for this kernel, at most n (Kokkos'
/// AUTO would give one thread per core's hardware threads on OpenMP, i.e. often 1). Returns 0,
/// or the 1-based column where a pivot was not positive. Portable: the reference the vendor
/// paths are tested against.
template <class Exec, class T>
int cholesky_lower(const Exec& exec, const Matrix<T, Exec>& a, const Matrix<T, Exec>& l, int team_size = 0) {
  const int n = int(a.extent(0));
  Kokkos::deep_copy(exec, l, a);
  Kokkos::View<int, typename Exec::memory_space> bad("kfac::cholesky::bad");
  using Policy = Kokkos::TeamPolicy<Exec>;
  using Member = typename Policy::member_type;
  const auto body = KOKKOS_LAMBDA(const Member& team) {
    for (int j = 0; j < n; ++j) {
      T d = T(0);
      Kokkos::single(
          Kokkos::PerTeam(team),
          [&](T& dj) {
            dj = l(j, j);
            for (int k = 0; k < j; ++k) dj -= l(j, k) * l(j, k);
            if (dj > T(0)) {
              dj = sqrt_(dj);
              l(j, j) = dj;
            } else {
              bad() = j + 1;
            }
          },
          d);
      if (!(d > T(0))) return;  // every thread sees the same broadcast pivot
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, j + 1, n), [&](int i) {
        T s = l(i, j);
        for (int k = 0; k < j; ++k) s -= l(i, k) * l(j, k);
        l(i, j) = s / d;
      });
      team.team_barrier();
    }
  };
  if (team_size <= 0) {
    const int most = Policy(exec, 1, 1).team_size_max(body, Kokkos::ParallelForTag());
    team_size = most < n ? most : n;
  }
  Kokkos::parallel_for("kfac::linalg::cholesky", Policy(exec, 1, team_size > 0 ? team_size : 1), body);
  auto hbad = Kokkos::create_mirror_view(bad);
  Kokkos::deep_copy(hbad, bad);
  return hbad();
}

/// Copies the upper triangle of `a` onto its lower one.
template <class Exec, class M>
void mirror_upper(const Exec& exec, const M& a) {
  const int n = int(a.extent(0));
  Kokkos::parallel_for(
      "kfac::linalg::mirror_upper", Kokkos::RangePolicy<Exec>(exec, 0, n),
      KOKKOS_LAMBDA(int j) { for (int i = j + 1; i < n; ++i) a(i, j) = a(j, i); });
}

/// Inverse of the symmetric positive definite matrix given by the upper triangle of `f`, plus
/// `shift` on its diagonal, into `inv` (full). Throws when the matrix is not positive definite.
/// `ws` keeps the solver's scratch memory between calls.
template <class Backend, class Exec, class F, class T>
void spd_inverse(const Exec& exec, const F& f, T shift, const Matrix<T, Exec>& inv, SolverWorkspace<T, Exec>& ws) {
  require_square_pair("spd_inverse", f, inv);
  const int n = int(f.extent(0));
  symmetric_copy(exec, f, inv);
  add_diagonal(exec, inv, shift);
#if defined(KFAC_HAVE_LAPACK)
  if constexpr (use_lapack_v<Exec, Backend>) {
    exec.fence();
    const int ld = n > 0 ? int(inv.stride(1)) : 1;
    int info = lapack_potrf(n, inv.data(), ld);
    if (info > 0)
      throw Error("", "Cholesky factorization broke down at column " + std::to_string(info) +
                          ": factor + damping is not positive definite");
    if (info == 0) info = lapack_potri(n, inv.data(), ld);
    if (info != 0) throw Error("", "LAPACK potrf/potri failed with info = " + std::to_string(info));
    mirror_upper(exec, inv);
    return;
  }
#endif
#if defined(KFAC_HAVE_CUSOLVER)
  if constexpr (use_cusolver_v<Exec, Backend>) {
    cusolver_spd_inverse_upper(exec, inv, ws);
    mirror_upper(exec, inv);
    return;
  }
#endif
  // Portable: a team-parallel Cholesky L L^T, then one column of the inverse per thread.
  const Matrix<T, Exec>& l = ws.scratch_for(n);
  const int bad = cholesky_lower(exec, inv, l);
  if (bad)
    throw Error("", "Cholesky factorization broke down at column " + std::to_string(bad) +
                        ": factor + damping is not positive definite");
  Kokkos::parallel_for(
      "kfac::linalg::cholesky_inverse", Kokkos::RangePolicy<Exec>(exec, 0, n), KOKKOS_LAMBDA(int c) {
        for (int i = 0; i < n; ++i) {  // forward: L y = e_c
          T s = T(i == c);
          for (int k = 0; k < i; ++k) s -= l(i, k) * inv(k, c);
          inv(i, c) = s / l(i, i);
        }
        for (int i = n - 1; i >= 0; --i) {  // backward: L^T x = y
          T s = inv(i, c);
          for (int k = i + 1; k < n; ++k) s -= l(k, i) * inv(k, c);
          inv(i, c) = s / l(i, i);
        }
      });
}

/// The same with scratch memory for this call only.
template <class Backend, class Exec, class F, class T>
void spd_inverse(const Exec& exec, const F& f, T shift, const Matrix<T, Exec>& inv) {
  SolverWorkspace<T, Exec> ws;
  spd_inverse<Backend>(exec, f, shift, inv, ws);
}

/// Inverse of (upper triangle of f) + shift I by the Newton-Schulz iteration
/// X <- X (2I - M X), started at X0 = I / ||M||_F. GEMM only, so it runs on any backend.
template <class Exec, class F, class T>
int newton_schulz_inverse(const Exec& exec, const F& f, T shift, const Matrix<T, Exec>& x,
                          int max_iterations = 100, double tolerance = 0) {
  require_square_pair("newton_schulz_inverse", f, x);
  const int n = int(f.extent(0));
  Matrix<T, Exec> m("kfac::ns::m", n, n), t("kfac::ns::t", n, n), y("kfac::ns::y", n, n);
  symmetric_copy(exec, f, m);
  add_diagonal(exec, m, shift);
  // Fixed-order sums (ordered_sum.hpp): the start and the iteration count are the same on every
  // host backend, so the result is too.
  const double fro2 = ordered_sum(exec, "kfac::linalg::frobenius", n, n,
                                  KOKKOS_LAMBDA(long i, long j) { return double(m(i, j)) * double(m(i, j)); });
  const T inv_norm = T(1.0 / std::sqrt(fro2));
  Kokkos::parallel_for(
      "kfac::linalg::ns_init",
      ColumnMajorRange<Exec>(exec, {0, 0}, {n, n}),
      KOKKOS_LAMBDA(int i, int j) { x(i, j) = i == j ? inv_norm : T(0); });
  // 0 = the type's default: about 10 and 100 ulps of the residual's entries.
  const double tol = (tolerance > 0 ? tolerance : sizeof(T) == 4 ? 1e-6 : 1e-14) * std::sqrt(double(n));
  double previous = 1e300;
  for (int it = 1; it <= max_iterations; ++it) {
    gemm(exec, "N", "N", T(1), m, x, T(0), t);  // t = M X
    const double res2 = ordered_sum(exec, "kfac::linalg::ns_residual", n, n, KOKKOS_LAMBDA(long i, long j) {
      const double r = double(i == j) - double(t(i, j));
      return r * r;
    });
    const double res = std::sqrt(res2);
    if (!std::isfinite(res)) throw Error("", "Newton-Schulz iteration diverged");
    if (res < tol || (res < 1e-2 && res >= previous)) return it;  // converged or at round-off
    previous = res;
    // y = 2X - X t
    Kokkos::deep_copy(exec, y, x);
    gemm(exec, "N", "N", T(-1), x, t, T(2), y);
    Kokkos::deep_copy(exec, x, y);
  }
  throw Error("", "Newton-Schulz iteration did not converge in " + std::to_string(max_iterations) +
                      " iterations (increase damping)");
}

}  // namespace impl
}  // namespace kfac
