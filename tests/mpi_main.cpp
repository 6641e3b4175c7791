// Catch2's main for MPI tests: MPI and Kokkos live for the whole run; only rank 0 reports
// successes, every rank reports failures, and the exit code is the worst over ranks.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <catch2/catch.hpp>

int main(int argc, char* argv[]) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  int result = Catch::Session().run(argc, argv);
  Kokkos::finalize();
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
