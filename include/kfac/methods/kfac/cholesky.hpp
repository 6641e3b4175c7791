#pragma once
/// \file cholesky.hpp
/// \brief Damped explicit inverses by Cholesky factorization.
///
/// Uses the factored Tikhonov damping of Martens & Grosse (2015, §6.3):
/// \f[ V = (G + \tfrac{\sqrt{\gamma}}{\pi} I)^{-1} X (A + \pi\sqrt{\gamma} I)^{-1}, \qquad
///     \pi = \sqrt{\frac{\mathrm{tr}(A)/\dim A}{\mathrm{tr}(G)/\dim G}}, \f]
/// with \f$\pi\f$ from the factors being inverted (\f$\pi = 1\f$ when a trace is 0 or
/// \f$\pi\f$ is not finite), or with \f$\pi = 1\f$ throughout when `pi_damping` is off (kfac
/// 0.1's form). kfac-pytorch's INVERSE method adds \f$\gamma\f$ itself to each factor:
/// `with_damping_on_each_factor(true)` does that (\f$(G + \gamma I)^{-1} X (A + \gamma I)^{-1}\f$;
/// with π-damping, \f$\gamma\pi^2\f$ and \f$\gamma/\pi^2\f$). The damping is baked in when
/// the inverse is computed (every inv_update_steps).

#include <cmath>
#include <utility>

#include "kfac/core/block.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/spd_inverse.hpp"

namespace kfac {

namespace impl {
/// \brief The π-damping setting of the explicit-inverse policies, a base so that both spell it
/// once: `with_pi_damping(false)` selects \f$\pi = 1\f$ (kfac 0.1's form, and its signature).
template <class Policy>
struct PiDamping {
  bool pi_damping = true;
  /// The setting by name, for the agreement of settings across ranks (impl::agree_on_step).
  std::string describe() const { return "pi_damping=" + std::to_string(int(pi_damping)); }
  Policy& with_pi_damping(bool on) {
    pi_damping = on;
    return static_cast<Policy&>(*this);
  }
};

/// Shared by the policies that hold explicit damped inverses.
template <class T, class Exec>
struct ExplicitInverse {
  Matrix<T, Exec> inv;
  explicit ExplicitInverse(index_t n = 0)
      : inv(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::inverse"), n, n) {}
  std::size_t bytes() const { return inv.size() * sizeof(T); }
  std::vector<Buffer> buffers() const { return {buffer_of(inv)}; }
};

template <class T, class Exec>
void apply_explicit_inverses(const Exec& exec, const Matrix<T, Exec>& inv_a,
                             const Matrix<T, Exec>& inv_g, const Matrix<T, Exec>& x,
                             const Matrix<T, Exec>& work, const Matrix<T, Exec>& out) {
  gemm(exec, "N", "N", T(1), inv_g, x, T(0), work);
  gemm(exec, "N", "N", T(1), work, inv_a, T(0), out);
}

/// \brief Columns [c0, c1) of out = inv_g x inv_a (split preconditioning: in the block's
/// transposed storage they are rows of V), from columns c0..c1 of inv_a alone:
/// work(:, c) = x inv_a(:, c), then out(:, c) = inv_g work(:, c), 1/p of both GEMMs' flops.
template <class T, class Exec>
void apply_explicit_inverse_columns(const Exec& exec, const Matrix<T, Exec>& inv_a,
                                    const Matrix<T, Exec>& inv_g, const Matrix<T, Exec>& x,
                                    const Matrix<T, Exec>& work, const Matrix<T, Exec>& out, index_t c0,
                                    index_t c1) {
  if (c1 <= c0) return;
  const auto cols = std::make_pair(c0, c1);
  const auto w = Kokkos::subview(work, Kokkos::ALL, cols);
  gemm(exec, "N", "N", T(1), x, Kokkos::subview(inv_a, Kokkos::ALL, cols), T(0), w);
  gemm(exec, "N", "N", T(1), inv_g, w, T(0), Kokkos::subview(out, Kokkos::ALL, cols));
}

/// The split-preconditioning pass of the explicit-inverse policies: one pass, one all-gather.
struct ExplicitInverseRows {
  /// Preconditioning a g x a gradient: two GEMMs, \f$G^{-1} X A^{-1}\f$.
  static Work apply_work(index_t g, index_t a) {
    Work w;
    w.gemm_flops = 2.0 * double(g) * double(a) * double(g + a);
    return w;
  }
  static constexpr int split_passes = 1;
  template <class Fact, class T, class Exec>
  static void apply_rows(const Exec& exec, const Fact& a, const Fact& g, const Matrix<T, Exec>& x, double,
                         const Matrix<T, Exec>&, const Matrix<T, Exec>& work, const Matrix<T, Exec>& out, int,
                         index_t c0, index_t c1) {
    apply_explicit_inverse_columns(exec, a.inv, g.inv, x, work, out, c0, c1);
  }
};
}  // namespace impl

/// \brief Inversion policy: damped explicit inverses of A and G by Cholesky factorization.
/// \tparam Backend AutoBackend (LAPACK potrf/potri on the host, cuSOLVER potrf/potri on CUDA)
/// or PortableBackend (team-parallel Cholesky).
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | bool | pi_damping | \f$\pi\f$ from the factors' traces (on) or \f$\pi = 1\f$ (off, kfac 0.1) | true |
/// | bool | damping_on_each_factor | add \f$\gamma\f$ (kfac-pytorch's INVERSE), not \f$\sqrt{\gamma}\f$, to each factor | false |
template <class Backend = AutoBackend>
struct Cholesky : impl::PiDamping<Cholesky<Backend>>, impl::ExplicitInverseRows {
  bool damping_on_each_factor = false;
  Cholesky& with_damping_on_each_factor(bool on) {
    damping_on_each_factor = on;
    return *this;
  }
  /// The settings by name, for the agreement across ranks.
  std::string describe() const {
    return impl::PiDamping<Cholesky<Backend>>::describe() +
           ",damping_on_each_factor=" + std::to_string(int(damping_on_each_factor));
  }
  static constexpr const char* name = "cholesky";
  static constexpr bool damping_at_apply = false;
  /// compute() on the LAPACK path launches only range kernels and copies: it may run on a
  /// second host thread (Block::decomposes_off_thread).
  static constexpr bool host_thread_safe = true;
  using backend_type = Backend;
  /// "pi" with π-damping; "" for kfac 0.1's π = 1, whose checkpoints then still load; "each"
  /// added for damping on each factor.
  std::string settings() const {
    std::string s = this->pi_damping ? "pi" : "";
    if (damping_on_each_factor) s += s.empty() ? "each" : ",each";
    return s;
  }
  /// Buffers of one factorization of an n x n factor: the damped inverse.
  static std::vector<std::size_t> counts(index_t n) { return {std::size_t(n) * n}; }
  static impl::UnitCost cost(index_t n) {
    impl::UnitCost c{double(n) * n * n, double(n) * n};
    c.work.factorization_n3 = c.flops;
    return c;
  }

  template <class T, class Exec>
  struct Factorization : impl::ExplicitInverse<T, Exec> {
    using impl::ExplicitInverse<T, Exec>::ExplicitInverse;
    /// The solver's scratch memory, reused by every decomposition of this factor.
    impl::SolverWorkspace<T, Exec> workspace;
    template <class F>
    void compute(const Exec& exec, const F& factor, double damping, const Cholesky& c, double = 0) {
      const double added = c.damping_on_each_factor ? damping : std::sqrt(damping);
      impl::spd_inverse<Backend>(exec, factor, T(added), this->inv, workspace);
    }
  };

  template <class T, class Exec>
  static void apply(const Exec& exec, const Factorization<T, Exec>& a,
                    const Factorization<T, Exec>& g, const impl::Matrix<T, Exec>& x, double,
                    const impl::Matrix<T, Exec>&, const impl::Matrix<T, Exec>& work,
                    const impl::Matrix<T, Exec>& out) {
    impl::apply_explicit_inverses(exec, a.inv, g.inv, x, work, out);
  }
};

}  // namespace kfac
