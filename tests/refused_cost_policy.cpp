// Built only by the ctest test refused_cost_policy (tests/compile_fail.cmake), which expects this
// file NOT to compile, with CostModel::predict's static_assert naming the missing member as the
// only error: a distribution policy that does not state its cost (no state_cost).
#include <kfac/kfac.hpp>
#include <kfac/planning/cost_model.hpp>

struct Unpriced {
  using distribution_tag = void;
  static constexpr const char* name = "unpriced";
};

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  const kfac::CostModel model({kfac::LayerShape::of("fc", kfac::Dense(3, 2))});
  return int(model.predict(2, kfac::Options{}, Unpriced{}).world);
}
