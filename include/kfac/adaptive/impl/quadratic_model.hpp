#pragma once
/// \file quadratic_model.hpp
/// \brief The arithmetic of self-tuning K-FAC (Martens & Grosse 2015, sections 6.5 and 7): the
/// per-sample curvature forms of a loss at the outputs, the 2x2 solve for step size and
/// momentum, the model's change and the Levenberg-Marquardt rule. Free functions, so that the
/// kernels' KOKKOS_LAMBDAs sit where nvcc accepts them, and the tests reach the closed forms.

#include <Kokkos_Core.hpp>
#include <cmath>

#include "kfac/adaptive/adaptive.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/impl/ordered_sum.hpp"

namespace kfac {
namespace impl {

/// \brief \f$\sum_i a_i^T H_L(z_i) b_i\f$ over the rows i of (batch, outputs) views, in double and
/// in ordered_sum's fixed order. Softmax: \f$\sum_k p_k (a_k - \bar a)(b_k - \bar b)\f$ with
/// \f$\bar a = \sum_k p_k a_k\f$ (the same value as \f$a^T(\mathrm{diag}(p) - pp^T)b\f$, and never
/// negative when a = b).
/// \param exec [in] the execution space instance
/// \param loss [in] the loss's curvature kind
/// \param z [in] the outputs (logits), (batch, outputs); not read for squared error
/// \param a [in] one Jacobian-vector product, (batch, outputs)
/// \param b [in] the other, (batch, outputs)
template <class Exec, class View>
double curvature_form(const Exec& exec, LossCurvature loss, const View& z, const View& a, const View& b) {
  const long n = long(a.extent(0)), k = long(a.extent(1));
  const int kind = int(loss);
  constexpr int softmax = int(LossCurvature::softmax_cross_entropy),
                sigmoid = int(LossCurvature::sigmoid_cross_entropy);
  return ordered_sum(
      exec, "kfac::adaptive::curvature", n, KOKKOS_LAMBDA(long i) {
        double s = 0;
        if (kind == softmax) {
          double m = double(z(i, 0));
          for (long c = 1; c < k; ++c) m = double(z(i, c)) > m ? double(z(i, c)) : m;
          double total = 0, abar = 0, bbar = 0;
          for (long c = 0; c < k; ++c) {
            const double e = exp_(double(z(i, c)) - m);
            total += e;
            abar += e * double(a(i, c));
            bbar += e * double(b(i, c));
          }
          abar /= total;
          bbar /= total;
          for (long c = 0; c < k; ++c)
            s += exp_(double(z(i, c)) - m) / total * (double(a(i, c)) - abar) * (double(b(i, c)) - bbar);
        } else if (kind == sigmoid) {
          for (long c = 0; c < k; ++c) {
            const double p = 1.0 / (1.0 + exp_(-double(z(i, c))));
            s += p * (1.0 - p) * double(a(i, c)) * double(b(i, c));
          }
        } else {
          for (long c = 0; c < k; ++c) s += double(a(i, c)) * double(b(i, c));
        }
        return s;
      });
}

/// \brief \f$\langle a, b\rangle\f$ of two flat views of n entries, in double, in ordered_sum's order.
/// \param exec [in] the execution space instance
/// \param a [in] the first vector
/// \param b [in] the second vector
template <class Exec, class A, class B>
double adaptive_dot(const Exec& exec, const A& a, const B& b) {
  return ordered_sum(
      exec, "kfac::adaptive::inner_product", long(a.extent(0)),
      KOKKOS_LAMBDA(long i) { return double(a(i)) * double(b(i)); });
}

/// \brief In place: `update` = alpha `update` + mu `previous`, then `previous` = `update`.
/// \param exec [in] the execution space instance
/// \param update [in,out] the host's buffer: the proposal in, the update out
/// \param previous [in,out] the previous update in, the new one out
/// \param alpha [in] the step size
/// \param mu [in] the momentum
template <class Exec, class U, class P>
void adaptive_update(const Exec& exec, const U& update, const P& previous, double alpha, double mu) {
  using T = typename U::non_const_value_type;
  Kokkos::parallel_for(
      "kfac::adaptive::update", Kokkos::RangePolicy<Exec>(exec, 0, long(update.extent(0))), KOKKOS_LAMBDA(long i) {
        const T v = T(alpha * double(update(i)) + mu * double(previous(i)));
        update(i) = v;
        previous(i) = v;
      });
}

/// \brief The quadratic model's terms over every rank: proposal \f$\Delta\f$ (index p), previous
/// update \f$\delta_0\f$ (index m), gradient g. Signs: the buffers hold \f$-\Delta\f$ and
/// \f$-\delta_0\f$ (what the host subtracts), which changes none of the products below.
struct QuadraticTerms {
  double fpp = 0, fpm = 0, fmm = 0;  ///< the exact curvature's forms \f$\Delta^T F \Delta\f$, ...
  double dpp = 0, dpm = 0, dmm = 0;  ///< \f$\|\Delta\|^2\f$, \f$\Delta^T\delta_0\f$, \f$\|\delta_0\|^2\f$
  double gp = 0, gm = 0;             ///< \f$g^T P\f$, \f$g^T U_0\f$ of the buffers (\f$= -\nabla h^T\Delta\f$, ...)
  bool previous = false;             ///< the second direction takes part
};

/// \brief Relative size below which the 2x2 determinant counts as zero (the two directions
/// parallel): the solve then takes \f$\alpha\f$ alone.
constexpr double kSingularPair = 1e-12;

/// \brief \f$\alpha, \mu\f$ minimising \f$M(\alpha\Delta + \mu\delta_0)\f$ with
/// \f$C = F + (\lambda + \eta) I\f$: \f$[[\Delta^T C \Delta, \Delta^T C \delta_0], [\cdot,
/// \delta_0^T C \delta_0]] [\alpha, \mu]^T = -[\nabla h^T \Delta, \nabla h^T \delta_0]^T\f$ by
/// Cramer's rule; \f$\alpha\f$ alone without a previous update or when the determinant is below
/// kSingularPair times the diagonal's product. The caller has checked \f$\Delta^T C\Delta > 0\f$.
/// \param t [in] the terms
/// \param lambda [in] the damping \f$\lambda\f$
/// \param eta [in] the weight decay \f$\eta\f$
/// \param rho_includes_damping [in] whether `predicted` includes the damping term
inline AdaptiveStep solve_quadratic_model(const QuadraticTerms& t, double lambda, double eta,
                                          bool rho_includes_damping) {
  const double shift = lambda + eta;
  const double m11 = t.fpp + shift * t.dpp, m12 = t.fpm + shift * t.dpm, m22 = t.fmm + shift * t.dmm;
  AdaptiveStep s;
  s.damping = lambda;
  const double det = m11 * m22 - m12 * m12;
  if (t.previous && m22 > 0 && det > kSingularPair * m11 * m22) {
    s.alpha = (t.gp * m22 - t.gm * m12) / det;
    s.mu = (m11 * t.gm - m12 * t.gp) / det;
    s.momentum = true;
  } else {
    s.alpha = t.gp / m11;
  }
  const double a = s.alpha, m = s.mu;
  const double norm2 = a * a * t.dpp + 2 * a * m * t.dpm + m * m * t.dmm;
  s.linear_term = -(a * t.gp + m * t.gm);
  s.curvature_term = 0.5 * (a * a * t.fpp + 2 * a * m * t.fpm + m * m * t.fmm) + 0.5 * eta * norm2;
  s.damping_term = 0.5 * lambda * norm2;
  s.predicted = s.linear_term + s.curvature_term + (rho_includes_damping ? s.damping_term : 0.0);
  return s;
}

/// \brief The Levenberg-Marquardt rule: \f$\lambda\omega_1\f$ when \f$\rho >\f$ upper,
/// \f$\lambda/\omega_1\f$ when \f$\rho <\f$ lower or not finite (the loss blew up), else
/// \f$\lambda\f$; clipped to the bounds.
/// \param lambda [in] the damping now
/// \param rho [in] the reduction ratio
/// \param s [in] the settings
inline double levenberg_marquardt(double lambda, double rho, const Adaptive& s) {
  const double omega = s.omega();
  double next = lambda;
  if (!std::isfinite(rho) || rho < s.lower_threshold)
    next = lambda / omega;
  else if (rho > s.upper_threshold)
    next = lambda * omega;
  return next < s.min_damping ? s.min_damping : next > s.max_damping ? s.max_damping : next;
}

}  // namespace impl
}  // namespace kfac
