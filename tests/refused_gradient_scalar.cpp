// Built only by the ctest test refused_gradient_scalar (tests/compile_fail.cmake), which expects
// this file NOT to compile, with the Scalar check as the only error.
#include <kfac/kfac.hpp>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  kfac::Preconditioner<float, Kokkos::DefaultHostExecutionSpace> pre;
  pre.register_layer("fc", kfac::Dense(3, 2));
  Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace> w("w", 2, 3);
  Kokkos::View<double*, Kokkos::HostSpace> b("b", 2);
  pre.set_gradient("fc", w, b);  // double gradients into a float preconditioner
}
