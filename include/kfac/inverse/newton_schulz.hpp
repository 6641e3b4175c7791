#pragma once
/// \file newton_schulz.hpp
/// \brief Damped inverses by the Newton-Schulz iteration: GEMM only, so it runs on any backend.
///
/// Same damping form as kfac::Cholesky: \f$V = (G + \sqrt{\gamma} I)^{-1} X (A + \sqrt{\gamma} I)^{-1}\f$.
/// Iterates \f$X_{k+1} = X_k (2I - M X_k)\f$ from \f$X_0 = I/\|M\|_F\f$ until
/// \f$\|I - M X_k\|_F\f$ reaches round-off; converges for any SPD M.

#include <cmath>

#include "kfac/inverse/cholesky.hpp"

namespace kfac {

struct NewtonSchulz {
  static constexpr const char* name = "newton_schulz";
  static constexpr bool damping_at_apply = false;

  template <class T, class Exec>
  struct Factorization : impl::ExplicitInverse<T, Exec> {
    using impl::ExplicitInverse<T, Exec>::ExplicitInverse;
    int iterations = 0;  ///< iterations used by the last computation
    template <class F>
    void compute(const Exec& exec, const F& factor, double damping) {
      iterations = impl::newton_schulz_inverse(exec, factor, T(std::sqrt(damping)), this->inv);
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
