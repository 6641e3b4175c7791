// NonFinitePolicy::skip for every layer type and call order at 2 ranks, the NaN on the last rank
// only: every rank skips, nothing throws (skip_scenario.hpp; single process: test_skip).
#include "mpi_harness.hpp"
#include "skip_scenario.hpp"

using namespace kfac_test::skip;

TEST_CASE("skip: a NaN on one rank skips the step on every rank, for every layer and call order", "[mpi][skip][nonfinite]") {
  using kfac_test::mpi::everywhere;
  const int rank = kfac_test::mpi::rank_in(), world = kfac_test::mpi::size_of();
  for (const Case& c : all_cases()) {
    kfac_test::mpi::Pre pre(skip_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD)),
        twin(skip_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD));
    register_layers(pre);
    register_layers(twin);
    run_case(pre, twin, c, rank == world - 1, rank, [](bool b) { return everywhere(b); });
  }
}
