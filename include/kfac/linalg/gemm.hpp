#pragma once
// GEMM. `gemm` is Kokkos Kernels' (which calls the vendor BLAS itself: OpenBLAS on the host,
// cuBLAS on CUDA); `square_gemm` is the n x n product of the eigenvalue refresh, which may run
// on a second host thread and so uses the host BLAS directly where it serves (no Kokkos kernel).
#include <KokkosBlas3_gemm.hpp>
#include <Kokkos_Core.hpp>
#include <cstddef>

#include "kfac/linalg/common.hpp"
#include "kfac/linalg/vendor.hpp"

namespace kfac {
namespace impl {

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

/// C = op(A) B for n x n matrices, op(A) = A^T when `trans`: the host BLAS where it serves
/// (op::SquareGemm), else `gemm`.
template <class Backend, class Exec, class T>
void square_gemm(const Exec& exec, bool trans, const Matrix<T, Exec>& a, const Matrix<T, Exec>& b,
                 const Matrix<T, Exec>& c) {
  if constexpr (vendor_path_v<op::SquareGemm, Exec, T, Backend>)
    Vendor<op::SquareGemm, Exec, T>::run(exec, trans, a, b, c);
  else
    gemm(exec, trans ? "T" : "N", "N", T(1), a, b, T(0), c);
}

}  // namespace impl
}  // namespace kfac
