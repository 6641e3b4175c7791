// Built only by the ctest test refused_method_slots (tests/compile_fail.cmake), which expects this
// file NOT to compile, with KFAC's slot check as the only error.
#include <kfac/kfac.hpp>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  kfac::Preconditioner<double> pre;
  pre.register_layer("fc", kfac::Dense(3, 2), kfac::KFAC<kfac::Cholesky<>>{});  // the inversion in the factor slot
}
