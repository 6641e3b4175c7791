#pragma once
// Inverse of a symmetric positive definite matrix: the vendor potrf + potri (op::SpdInverse) or
// the portable team-parallel Cholesky and column-parallel triangular solves.
#include <Kokkos_Core.hpp>

#include "kfac/impl/math.hpp"
#include "kfac/linalg/common.hpp"
#include "kfac/linalg/symmetric.hpp"
#include "kfac/linalg/vendor.hpp"

namespace kfac {
namespace impl {

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

/// Inverse of the symmetric positive definite matrix given by the upper triangle of `f`, plus
/// `shift` on its diagonal, into `inv` (full). Throws when the matrix is not positive definite.
/// `ws` keeps the solver's scratch memory between calls.
template <class Backend, class Exec, class F, class T>
void spd_inverse(const Exec& exec, const F& f, T shift, const Matrix<T, Exec>& inv, SolverWorkspace<T, Exec>& ws) {
  require_square_pair("spd_inverse", f, inv);
  const int n = int(f.extent(0));
  symmetric_copy(exec, f, inv);
  add_diagonal(exec, inv, shift);
  if constexpr (vendor_path_v<op::SpdInverse, Exec, T, Backend>) {
    Vendor<op::SpdInverse, Exec, T>::run(exec, inv, ws);
    mirror_upper(exec, inv);
    return;
  }
  // Portable: a team-parallel Cholesky L L^T, then one column of the inverse per thread.
  const Matrix<T, Exec>& l = ws.scratch_for(n);
  const int bad = cholesky_lower(exec, inv, l);
  if (bad) throw_not_positive_definite(bad);
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

}  // namespace impl
}  // namespace kfac
