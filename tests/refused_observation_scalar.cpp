// Built only by the ctest test refused_observation_scalar (tests/compile_fail.cmake), which
// expects this file NOT to compile, with the Scalar check as the only error (no Kokkos after it).
#include <kfac/kfac.hpp>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  kfac::Preconditioner<float> pre;
  pre.register_layer("fc", kfac::Dense(3, 2));
  Kokkos::View<double**, Kokkos::LayoutRight> x("x", 4, 3);
  pre.observe_input("fc", x);  // double observations into a float preconditioner
}
