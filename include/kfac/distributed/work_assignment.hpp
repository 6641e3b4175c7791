#pragma once
/// \file work_assignment.hpp
/// \brief KAISA work assignment (Pauloski et al. 2022): who decomposes which factor, who
/// preconditions which layer, who receives preconditioned gradients.
///
/// With world size W and gradient-worker fraction f, each layer has gw = f W gradient workers
/// (gw must divide W). Ranks form W/gw worker groups and gw receiver groups; each receiver group
/// holds exactly one member of every worker group: member j of worker group k is rank
/// rank_of(k, j) = k + j W/gw (GroupLayout::contiguous_receivers, the default) or k gw + j
/// (contiguous_workers). A layer is owned by one worker group: its members hold both
/// decompositions and compute the preconditioned gradient; member j broadcasts it to receiver
/// group j. f = 1 is COMM-OPT (every rank preconditions every layer,
/// no gradient broadcast), f = 1/W is MEM-OPT (one rank per layer), values in between HYBRID.
/// Layers go to worker groups and factors to ranks by greedy longest-processing-time first on
/// a cost (n^3 compute or n^2 memory), optionally keeping a layer's A and G on one rank.

#include <algorithm>
#include <functional>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "kfac/core/options.hpp"
#include "kfac/error.hpp"

namespace kfac {
/// \brief The cost a greedy assignment balances.
enum class AssignmentCost { compute, memory };

/// \brief How KAISA's rank grid is laid out: worker groups (the gw ranks that share a layer's
/// decompositions, every inv_update_steps) and receiver groups (one member of every worker
/// group; they share preconditioned gradients every step under HYBRID/MEM-OPT).
///
/// `contiguous_receivers` (default, as kfac-pytorch): receiver group j is the consecutive ranks
/// j W/gw ... (j+1) W/gw - 1 and worker groups are strided, so with node-major rank numbering the
/// every-step gradient broadcasts stay inside a node and only the rarer decomposition broadcasts
/// cross nodes. `contiguous_workers` (kfac 0.1): worker groups are consecutive ranks.
enum class GroupLayout { contiguous_receivers, contiguous_workers };

/// \brief The question a placement answers: the groups exist (world / grad_workers worker
/// groups of grad_workers ranks, member j of group k being rank_of(k, j)); each layer gets a
/// worker group and each of its units a member of that group.
struct PlacementProblem {
  int world = 1, grad_workers = 1, worker_groups = 1;
  GroupLayout layout = GroupLayout::contiguous_receivers;
  /// Per layer, the cost of each of its decomposable units (none: closed form or skipped).
  std::vector<std::vector<double>> costs;
  bool colocate = true;  ///< Kaisa::colocate_factors (a placement may ignore it)
  /// Member j (= receiver group j) of worker group k.
  int rank_of(int k, int j) const {
    return layout == GroupLayout::contiguous_workers ? k * grad_workers + j : k + j * worker_groups;
  }
};

/// \brief A placement's answer: per layer its worker group, and the rank of each of its units.
struct Placement {
  std::vector<int> group;
  std::vector<std::vector<int>> decomposer;
};

/// \brief A placement scheme (Kaisa::with_placement): a function of the problem; the
/// assignment validates what it returns. Empty: greedy_placement.
using Placer = std::function<Placement(const PlacementProblem&)>;

/// \brief KAISA's placement: layers to worker groups, then units to ranks, each by greedy
/// longest-processing-time first (largest total first, to the least loaded group; a layer's
/// units to the least loaded member, all on one member when colocated).
inline Placement greedy_placement(const PlacementProblem& p) {
  const std::size_t n = p.costs.size();
  Placement out;
  out.group.assign(n, 0);
  out.decomposer.assign(n, {});
  auto total = [&](std::size_t l) { return std::accumulate(p.costs[l].begin(), p.costs[l].end(), 0.0); };
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return total(a) > total(b); });
  std::vector<double> group_load(std::size_t(p.worker_groups), 0.0), rank_load(std::size_t(p.world), 0.0);
  // The least loaded member of worker group k, members in group order.
  auto least_member = [&](int k) {
    int best = p.rank_of(k, 0);
    for (int j = 1; j < p.grad_workers; ++j)
      if (rank_load[std::size_t(p.rank_of(k, j))] < rank_load[std::size_t(best)]) best = p.rank_of(k, j);
    return std::size_t(best);
  };
  for (std::size_t l : order) {
    const double c = total(l);
    const std::size_t k = std::size_t(std::min_element(group_load.begin(), group_load.end()) - group_load.begin());
    out.group[l] = int(k);
    group_load[k] += c;
    auto& d = out.decomposer[l];
    d.assign(p.costs[l].size(), p.rank_of(int(k), 0));
    if (p.costs[l].empty()) continue;
    if (p.colocate) {
      const std::size_t r = least_member(int(k));
      std::fill(d.begin(), d.end(), int(r));
      rank_load[r] += c;
      continue;
    }
    // larger unit first, each to the least loaded rank of the group
    std::vector<std::size_t> units(p.costs[l].size());
    std::iota(units.begin(), units.end(), 0);
    std::stable_sort(units.begin(), units.end(), [&](std::size_t a, std::size_t b) { return p.costs[l][a] > p.costs[l][b]; });
    for (std::size_t u : units) {
      const std::size_t r = least_member(int(k));
      rank_load[r] += p.costs[l][u];
      d[u] = int(r);
    }
  }
  return out;
}

class WorkAssignment {
 public:
  WorkAssignment() = default;
  /// \param world [in] number of ranks.
  /// \param fraction [in] gradient-worker fraction f in [1/world, 1].
  /// \param costs [in] per layer, the cost of each of its decomposable units (K-FAC: A, G;
  ///        none for closed-form and skipped layers).
  /// \param colocate [in] decompose all units of a layer on the same rank.
  /// \param layout [in] which groups are consecutive ranks (see kfac::GroupLayout).
  /// \param placer [in] who places layers and units (empty: greedy_placement); what it returns
  ///        is checked (a kfac::Error names the first layer placed outside the groups).
  WorkAssignment(int world, double fraction, const std::vector<std::vector<double>>& costs,
                 bool colocate, GroupLayout layout = GroupLayout::contiguous_receivers, const Placer& placer = {})
      : world_(world), layout_(layout) {
    if (!(fraction >= 1.0 / world - 1e-12 && fraction <= 1.0 + 1e-12))
      throw Error("", "grad_worker_fraction = " + std::to_string(fraction) + ": expected a value in [1/" +
                          std::to_string(world) + ", 1]");
    gw_ = std::max(1, int(std::lround(fraction * world)));
    if (world % gw_ != 0)
      throw Error("", "grad_worker_fraction = " + std::to_string(fraction) + " gives " +
                          std::to_string(gw_) + " gradient workers, which does not divide the " +
                          std::to_string(world) + " ranks");
    groups_ = world / gw_;
    const PlacementProblem problem{world, gw_, groups_, layout, costs, colocate};
    Placement p = placer ? placer(problem) : greedy_placement(problem);
    check(p, costs);
    group_ = std::move(p.group);
    decomposer_ = std::move(p.decomposer);
    rank_load_.assign(std::size_t(world), 0.0);
    for (std::size_t l = 0; l < costs.size(); ++l)
      for (std::size_t u = 0; u < costs[l].size(); ++u) rank_load_[std::size_t(decomposer_[l][u])] += costs[l][u];
  }

  /// Two units (A, G) per layer, as costs pairs.
  WorkAssignment(int world, double fraction, const std::vector<std::pair<double, double>>& costs,
                 bool colocate, GroupLayout layout = GroupLayout::contiguous_receivers)
      : WorkAssignment(world, fraction, pairs_to_units(costs), colocate, layout) {}

  int world() const { return world_; }
  /// Number of layers assigned.
  std::size_t layers() const { return group_.size(); }
  int grad_workers() const { return gw_; }
  /// Worker group (0 .. W/gw - 1) that owns layer l.
  int worker_group(std::size_t l) const { return group_.at(l); }
  /// Rank that decomposes unit `which` of layer l (K-FAC: 0 = A, 1 = G); -1 when the layer has
  /// no such unit (closed forms, skipped layers).
  int decomposer(std::size_t l, int which) const {
    const auto& d = decomposer_.at(l);
    return which >= 0 && std::size_t(which) < d.size() ? d[std::size_t(which)] : -1;
  }
  bool is_grad_worker(std::size_t l, int rank) const { return worker_group_of(rank) == group_.at(l); }
  /// Worker group (0 .. W/gw - 1) and receiver group (0 .. gw - 1) a rank belongs to; the rank's
  /// index inside its worker group is its receiver group, and vice versa.
  int worker_group_of(int rank) const { return contiguous() ? rank / gw_ : rank % groups_; }
  int receiver_group_of(int rank) const { return contiguous() ? rank % gw_ : rank / groups_; }
  /// Member j (= receiver group j) of worker group k.
  int rank_of(int k, int j) const { return contiguous() ? k * gw_ + j : k + j * groups_; }
  int worker_groups() const { return groups_; }
  GroupLayout layout() const { return layout_; }
  /// Decomposition cost assigned to each rank.
  const std::vector<double>& rank_load() const { return rank_load_; }

 private:
  static std::vector<std::vector<double>> pairs_to_units(const std::vector<std::pair<double, double>>& c) {
    std::vector<std::vector<double>> u;
    for (const auto& p : c) u.push_back({p.first, p.second});
    return u;
  }
  bool contiguous() const { return layout_ == GroupLayout::contiguous_workers; }
  /// A placement's answer fits the groups: one group per layer, one member of it per unit.
  void check(const Placement& p, const std::vector<std::vector<double>>& costs) const {
    if (p.group.size() != costs.size() || p.decomposer.size() != costs.size())
      throw Error("", "placement: expected a worker group and a decomposer list for each of the " +
                          std::to_string(costs.size()) + " layers");
    for (std::size_t l = 0; l < costs.size(); ++l) {
      const std::string which = "placement of layer " + std::to_string(l) + ": ";
      if (p.group[l] < 0 || p.group[l] >= groups_)
        throw Error("", which + "worker group " + std::to_string(p.group[l]) + " is not in [0, " + std::to_string(groups_) + ")");
      if (p.decomposer[l].size() != costs[l].size())
        throw Error("", which + "expected " + std::to_string(costs[l].size()) + " decomposers, one per unit");
      for (int r : p.decomposer[l])
        if (r < 0 || r >= world_ || worker_group_of(r) != p.group[l])
          throw Error("", which + "rank " + std::to_string(r) + " is not a member of its worker group " + std::to_string(p.group[l]));
    }
  }
  int world_ = 1, gw_ = 1, groups_ = 1;
  GroupLayout layout_ = GroupLayout::contiguous_receivers;
  std::vector<int> group_;
  std::vector<std::vector<int>> decomposer_;
  std::vector<double> rank_load_;
};

}  // namespace kfac
