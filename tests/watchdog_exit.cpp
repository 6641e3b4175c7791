// Driver of the watchdog_exit tests (watchdog_exit.cmake, issue 46): rank 1 is late for the first
// step()'s collective, by `late` seconds ("late": then it carries on) or for ever ("absent"),
// while rank 0 times out (KFAC_COMM_TIMEOUT). Each rank prints the kfac::Error it got, destroys
// its preconditioner and communicator, finalizes Kokkos and MPI, and prints its exit code last.
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/kfac.hpp>
#include <string>
#include <thread>

int main(int argc, char* argv[]) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string scenario = argc > 1 ? argv[1] : "late";
  const double late = argc > 2 ? std::atof(argv[2]) : 3.0;
  int rc = 0;
  Kokkos::initialize(argc, argv);
  {
    using Host = Kokkos::DefaultHostExecutionSpace;
    kfac::Preconditioner<double, Host, kfac::MpiComm> pre(kfac::Options{}, Host{}, kfac::MpiComm(MPI_COMM_WORLD));
    pre.register_layer("fc", kfac::Dense(3, 2), kfac::KFAC<>{});
    Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace> x("x", 4, 3), g("g", 4, 2), w("w", 2, 3);
    Kokkos::View<double*, Kokkos::HostSpace> b("b", 2);
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 3; ++j) x(i, j) = 0.1 * (i + 1) + j;
    Kokkos::deep_copy(g, 0.5);
    Kokkos::deep_copy(w, 1.0);
    Kokkos::deep_copy(b, 1.0);
    pre.observe_input("fc", x);
    pre.observe_output_grad("fc", g);
    pre.set_gradient("fc", w, b);
    if (rank == 1) {
      const double seconds = scenario == "absent" ? 3600.0 : late;
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    }
    try {
      pre.step();
      std::printf("rank %d: step completed\n", rank);
    } catch (const kfac::Error& e) {
      std::printf("rank %d: kfac::Error: %s\n", rank, e.what());
      rc = 1;
    }
    std::fflush(stdout);
  }  // the preconditioner and its communicator are freed here
  Kokkos::finalize();
  MPI_Finalize();
  std::printf("rank %d: finalized, exit code %d\n", rank, rc);
  return rc;
}
