// NonFinitePolicy::skip for every layer type and call order, single process (skip_scenario.hpp;
// the same cases at 2 ranks: test_mpi_skip).
#include "skip_scenario.hpp"

using namespace kfac_test::skip;

TEST_CASE("skip: a NaN in any observation of any layer, in any call order, skips the step", "[skip][nonfinite]") {
  for (const Case& c : all_cases()) {
    kfac::Preconditioner<double, Host> pre(skip_options()), twin(skip_options());
    register_layers(pre);
    register_layers(twin);
    run_case(pre, twin, c, true, 0, [](bool b) { return b; });
  }
}
