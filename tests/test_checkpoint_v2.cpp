// Checkpoints in format version 2 written by commit 334b1ae (main before the core restructuring
// of issue 25, see fixtures/make_v2_fixtures.cpp) keep loading: the restored run has the recorded
// counters, continues bit for bit as itself restored again, and as the code that wrote them did
// and as a replay from scratch does to the rounding of another BLAS kernel, for
// eigendecompositions saved mid-run, a decomposition saved in flight (decomposition_delay),
// float unit-wise, diagonal, NG-SGD and Conv2d blocks saved with and without decompositions,
// and explicit inverses under per-layer schedules.
#include <algorithm>
#include <kfac/kfac.hpp>
#include <sstream>
#include <string>
#include <vector>

#ifndef KFAC_FIXTURE_DIR
#define KFAC_FIXTURE_DIR "tests/fixtures/checkpoint_v2"
#endif

#include "checkpoint_fixture.hpp"
#include "fixtures/v2_scenario.hpp"

using namespace kfac_v2;
using kfac_fixture::expected;
using kfac_fixture::fixture;
using kfac_fixture::relative_difference;

// EigenNet's "mixed" layer keeps float factors.
template <long Delay>
struct kfac_fixture::statistics_scalar<EigenNet<Delay>> {
  using type = float;
};

namespace {

std::string checkpoint_file(const Scenario& sc) { return fixture(std::string(sc.name) + ".kfacckpt"); }

/// Loads the scenario's v2 file into a registered preconditioner (fresh or used): every saved
/// decomposition restores (one process, the same layout).
template <class Net>
auto v2_file(const Scenario& sc) {
  return [&sc](typename Net::Pre& pre) {
    std::istringstream is(checkpoint_file(sc), std::ios::binary);
    CHECK(pre.load(is));
  };
}

template <class Net>
void check_fixture(const Scenario& sc) {
  using T = typename Net::scalar_type;
  {
    INFO("scenario " << sc.name << ": the file is what the scenario says (version 2, decompositions saved, in flight)");
    CHECK(checkpoint_flags(checkpoint_file(sc)) == (sc.with_decompositions ? 1 : 0) + (sc.in_flight ? 2 : 0));
  }
  const auto got = kfac_fixture::check_fixture<Net>(sc, v2_file<Net>(sc), "commit 334b1ae");
  if (sc.in_flight) {
    INFO("scenario " << sc.name);
    // The fixture pins the decomposition in flight: the same state restored without it (all
    // decompositions recomputed at once) continues differently.
    typename Net::Pre without(Net::options());
    Net::register_layers(without);
    replay<Net>(without, {sc.name, sc.saved_at, false});
    const auto other = resume<Net>(without, sc);
    double largest = 0;
    for (std::size_t k = 0; k < other.size(); ++k) largest = std::max(largest, relative_difference<T>(other[k], got[k]));
    CHECK(largest > 100 * kfac_fixture::tolerance_of<Net>());
  }
}

}  // namespace

TEST_CASE("v2 checkpoints load and resume as the code that wrote them did", "[checkpoint][v2]") {
  SECTION("eigendecompositions, saved mid-run and before any step") {
    for (const auto& sc : eigen_scenarios) check_fixture<EigenNet<0>>(sc);
  }
  SECTION("a deferred decomposition in flight") {
    for (const auto& sc : delayed_scenarios) check_fixture<EigenNet<delay>>(sc);
  }
  SECTION("float unit-wise, diagonal, NG-SGD and Conv2d blocks, with and without decompositions") {
    for (const auto& sc : float_scenarios) check_fixture<FloatNet>(sc);
  }
  SECTION("explicit inverses under per-layer schedules") {
    for (const auto& sc : inverse_scenarios) check_fixture<InverseNet>(sc);
  }
}
