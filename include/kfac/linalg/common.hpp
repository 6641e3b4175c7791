#pragma once
// What every linear-algebra entry shares: the backend tags a policy chooses with, the scratch
// memory a factorization keeps between calls, the shape checks, the errors every path (portable
// or vendor) reports in the same words, and the availability trait `Vendor` that the vendor
// folders specialize (linalg/vendor.hpp lists them).
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <string>
#include <type_traits>

#include "kfac/error.hpp"
#include "kfac/impl/math.hpp"

namespace kfac {

/// \brief Backend tags for the decompositions of the inversion policies.
/// `AutoBackend` uses a vendor library where one serves the execution space (LAPACK on the
/// host, cuSOLVER on CUDA) and the portable Kokkos implementation otherwise; `PortableBackend`
/// always uses the portable one (slow, O(n^3) on one thread for the eigensolver, but it runs
/// on any backend and is the reference the vendor paths are tested against).
struct AutoBackend {};
struct PortableBackend {};

namespace impl {

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

/// The scalars the vendor libraries (LAPACK, cuSOLVER) serve: float and double.
template <class T>
constexpr bool vendor_scalar_v = std::is_same<T, float>::value || std::is_same<T, double>::value;

/// Column-major leading dimension of a matrix view, at least 1 (as BLAS, LAPACK and cuSOLVER
/// require, also for an empty matrix).
template <class M>
int leading_dimension(const M& m) {
  const int ld = int(m.stride(1));
  return ld > 0 ? ld : 1;
}

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

/// The error of a Cholesky factorization whose pivot at 1-based `column` was not positive, in
/// the words of every path.
[[noreturn]] inline void throw_not_positive_definite(int column) {
  throw Error("", "Cholesky factorization broke down at column " + std::to_string(column) +
                      ": factor + damping is not positive definite");
}

/// The operations a vendor folder may serve (the first argument of `Vendor`).
namespace op {
struct Eigh {};         ///< syevd: eigenvectors and ascending eigenvalues of the upper triangle, in place
struct SpdInverse {};   ///< potrf + potri: inverse of an SPD upper triangle, in place (upper written)
struct SyrkT {};        ///< upper triangle of C = alpha R^T R + beta C
struct SquareGemm {};   ///< C = op(A) B for n x n matrices, launching no Kokkos kernel
struct SquaredNorm {};  ///< sum of squares of a contiguous float/double array, accumulated in double
}  // namespace op

/// \brief Whether a vendor library serves operation `Op` on `Exec` for scalar `T`. A vendor
/// folder specializes it (fourth argument an `enable_if` on `Exec` and `T`) with `available =
/// true` and a static `run` of the operation's signature.
template <class Op, class Exec, class T, class Enable = void>
struct Vendor {
  static constexpr bool available = false;
};

}  // namespace impl
}  // namespace kfac
