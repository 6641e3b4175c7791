// Catch2's main for MPI tests: MPI and Kokkos live for the whole run; only rank 0 reports
// successes, every rank reports failures, and the exit code is the worst over ranks.
// MPI_THREAD_MULTIPLE is asked for, so that kfac shares deferred decompositions from their
// background threads (Kaisa::background_sharing); KFAC_TEST_MPI_THREADS=single asks for
// MPI_THREAD_SINGLE instead, the fallback path.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>

int main(int argc, char* argv[]) {
  const char* threads = std::getenv("KFAC_TEST_MPI_THREADS");
  const bool single = threads && std::strcmp(threads, "single") == 0;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, single ? MPI_THREAD_SINGLE : MPI_THREAD_MULTIPLE, &provided);
  Kokkos::initialize(argc, argv);
  int result = Catch::Session().run(argc, argv);
  Kokkos::finalize();
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
