#pragma once
// A distribution scheme defined outside the library: round-robin owners. Layer l goes to
// worker group l mod groups; the units, counted over all layers in order, go to the members of
// their layer's group in turn. It is a kfac::Placer only: the averaging, sharing and gathering
// stay kfac::Kaisa's.
#include <kfac/distributed/work_assignment.hpp>

namespace kfac_test {

inline kfac::Placement round_robin(const kfac::PlacementProblem& p) {
  kfac::Placement out;
  int next = 0;
  for (std::size_t l = 0; l < p.costs.size(); ++l) {
    const int k = int(l % std::size_t(p.worker_groups));
    out.group.push_back(k);
    out.decomposer.emplace_back();
    for (std::size_t u = 0; u < p.costs[l].size(); ++u) out.decomposer.back().push_back(p.rank_of(k, next++ % p.grad_workers));
  }
  return out;
}

}  // namespace kfac_test
