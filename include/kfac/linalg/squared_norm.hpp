#pragma once
// The squared Frobenius norm of a contiguous view, accumulated in double.
#include <Kokkos_Core.hpp>

#include "kfac/impl/ordered_sum.hpp"
#include "kfac/linalg/vendor.hpp"

namespace kfac {
namespace impl {

/// \f$\|m\|_F^2\f$ of a contiguous view (any layout), accumulated in double: the host BLAS's
/// dsdot / ddot where it serves (op::SquaredNorm; on NG-SGD's every-step path the portable
/// reduction took three times as long on the host), impl::sum_of_squares elsewhere.
template <class Exec, class M>
double squared_norm(const Exec& exec, const M& m) {
  using T = typename M::non_const_value_type;
  if constexpr (Vendor<op::SquaredNorm, Exec, T>::available)
    return Vendor<op::SquaredNorm, Exec, T>::run(exec, m);
  else
    return sum_of_squares(exec, m);
}

}  // namespace impl
}  // namespace kfac
