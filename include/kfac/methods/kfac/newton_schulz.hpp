#pragma once
/// \file newton_schulz.hpp
/// \brief Damped inverses by the Newton-Schulz iteration: GEMM only, so it runs on any backend.
///
/// Same damping form as kfac::Cholesky, π-damping (Martens & Grosse 2015, §6.3) by default:
/// \f$V = (G + \frac{\sqrt{\gamma}}{\pi} I)^{-1} X (A + \pi\sqrt{\gamma} I)^{-1}\f$.
/// Iterates \f$X_{k+1} = X_k (2I - M X_k)\f$ from \f$X_0 = I/\|M\|_F\f$ until
/// \f$\|I - M X_k\|_F\f$ reaches round-off; converges for any SPD M.

#include <cmath>

#include "kfac/linalg/newton_schulz.hpp"
#include "kfac/methods/kfac/cholesky.hpp"

namespace kfac {

/// \brief Inversion policy: damped explicit inverses of A and G by Newton-Schulz iterations.
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | int | max_iterations | iterations before the inverse counts as failed (then retried with more damping) | 100 |
/// | double | tolerance | stop when \f$\|I - M X_k\|_F < \mathrm{tolerance} \sqrt{n}\f$; 0 = 1e-14 (double), 1e-6 (float) | 0 |
/// | bool | pi_damping | \f$\pi\f$ from the factors' traces (on) or \f$\pi = 1\f$ (off, kfac 0.1) | true |
struct NewtonSchulz : impl::PiDamping<NewtonSchulz>, impl::ExplicitInverseRows {
  static constexpr const char* name = "newton_schulz";
  static constexpr bool damping_at_apply = false;
  using backend_type = PortableBackend;

  int max_iterations = 100;
  double tolerance = 0;
  NewtonSchulz& with_max_iterations(int n) {
    if (n < 1) throw Error("", "NewtonSchulz: expected max_iterations >= 1");
    max_iterations = n;
    return *this;
  }
  NewtonSchulz& with_tolerance(double t) {
    if (!(t >= 0) || !std::isfinite(t)) throw Error("", "NewtonSchulz: expected a finite tolerance >= 0");
    tolerance = t;
    return *this;
  }
  /// As kfac 0.1's ("" or "it=..,tol=..") with π = 1; π-damping appends "pi".
  std::string settings() const {
    std::string s;
    if (max_iterations != 100 || tolerance != 0)
      s = "it=" + std::to_string(max_iterations) + ",tol=" + std::to_string(tolerance);
    if (pi_damping) s += s.empty() ? "pi" : ",pi";
    return s;
  }
  /// Every setting by name, for the agreement of settings across ranks (impl::agree_on_step).
  std::string describe() const {
    return "max_iterations=" + std::to_string(max_iterations) + ",tolerance=" + impl::number(tolerance) + "," +
           impl::PiDamping<NewtonSchulz>::describe();
  }
  static std::vector<std::size_t> counts(index_t n) { return {std::size_t(n) * n}; }
  /// Two n^3 GEMMs per iteration (about 30 iterations in practice: the cost model assumes
  /// MachineFigures::newton_schulz_iterations); the assignment balances n^3 either way.
  static impl::UnitCost cost(index_t n) {
    impl::UnitCost c{double(n) * n * n, double(n) * n};
    c.work.iteration_flops = 4.0 * c.flops;
    return c;
  }

  template <class T, class Exec>
  struct Factorization : impl::ExplicitInverse<T, Exec> {
    using impl::ExplicitInverse<T, Exec>::ExplicitInverse;
    int iterations = 0;  ///< iterations used by the last computation
    template <class F>
    void compute(const Exec& exec, const F& factor, double damping, const NewtonSchulz& s, double = 0) {
      iterations = impl::newton_schulz_inverse(exec, factor, T(std::sqrt(damping)), this->inv,
                                               s.max_iterations, s.tolerance);
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
