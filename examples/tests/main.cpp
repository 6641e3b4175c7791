// Catch2's main for the example tests, in its own translation unit; Kokkos lives for the whole run.
#define CATCH_CONFIG_RUNNER
#include <Kokkos_Core.hpp>
#include <catch2/catch.hpp>

int main(int argc, char* argv[]) {
  Kokkos::initialize(argc, argv);
  const int result = Catch::Session().run(argc, argv);
  Kokkos::finalize();
  return result;
}
