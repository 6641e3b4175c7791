// Built only by the ctest test refused_exec_memory_space (tests/compile_fail.cmake), which expects
// this file NOT to compile, with the Preconditioner's static_assert as the only error.
#include <kfac/kfac.hpp>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  kfac::Preconditioner<double, Kokkos::HostSpace> pre;  // a memory space where an execution space belongs
  pre.register_layer("fc", kfac::Dense(3, 2));
  pre.step();
}
