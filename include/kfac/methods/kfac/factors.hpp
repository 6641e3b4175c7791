#pragma once
/// \file factors.hpp
/// \brief Factor-approximation policies: how a layer's curvature block is stored.
///
/// Contract: a factor policy is a tag with `static constexpr const char* name`, `bool is_diagonal`
/// (store only the diagonal of each Kronecker factor) and `bool packed` (the factor is exchanged
/// between ranks as its packed upper triangle). Every factor is a running average
/// \f$F \leftarrow \xi F + (1-\xi) \hat F\f$ with \f$\xi\f$ = factor_decay; the first update
/// initializes \f$F = \hat F\f$.

namespace kfac {

/// \brief Full Kronecker factors, stored and communicated as full n x n matrices.
struct Full {
  static constexpr const char* name = "full";
  static constexpr bool is_diagonal = false;
  static constexpr bool packed = false;
};

/// \brief Symmetric Kronecker factors: only the upper triangle is computed (BLAS syrk) and the
/// packed triangle of n(n+1)/2 values is what distribution sends (Osawa et al. 2019).
/// Preconditioning results are identical to kfac::Full.
struct Symmetric {
  static constexpr const char* name = "symmetric";
  static constexpr bool is_diagonal = false;
  static constexpr bool packed = true;
};

/// \brief Diagonal approximation. For Kronecker layers, only diag(A) and diag(G) are kept and
/// the damped inverse is closed-form, \f$V_{ij} = X_{ij} / (G_{ii} A_{jj} + \lambda)\f$; for
/// BatchNorm the per-parameter diagonal Fisher of (gamma, beta).
struct Diagonal {
  static constexpr const char* name = "diagonal";
  static constexpr bool is_diagonal = true;
  static constexpr bool packed = false;
};

/// \brief Unit-wise Fisher for BatchNorm (Osawa et al. 2019): one 2x2 block over
/// \f$(\gamma_c, \beta_c)\f$ per channel, inverted in closed form.
struct UnitWise {
  static constexpr const char* name = "unit_wise";
  static constexpr bool is_diagonal = false;
  static constexpr bool packed = false;
};

}  // namespace kfac
