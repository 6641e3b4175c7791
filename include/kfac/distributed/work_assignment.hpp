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
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "kfac/core/options.hpp"
#include "kfac/error.hpp"

namespace kfac {


class WorkAssignment {
 public:
  WorkAssignment() = default;
  /// \param world [in] number of ranks.
  /// \param fraction [in] gradient-worker fraction f in [1/world, 1].
  /// \param costs [in] per layer, the cost of each of its decomposable units (K-FAC: A, G;
  ///        none for closed-form and skipped layers).
  /// \param colocate [in] decompose all units of a layer on the same rank.
  /// \param layout [in] which groups are consecutive ranks (see kfac::GroupLayout).
  WorkAssignment(int world, double fraction, const std::vector<std::vector<double>>& costs,
                 bool colocate, GroupLayout layout = GroupLayout::contiguous_receivers)
      : world_(world), layout_(layout) {
    if (!(fraction >= 1.0 / world - 1e-12 && fraction <= 1.0 + 1e-12))
      throw Error("", "grad_worker_fraction = " + std::to_string(fraction) + ": expected a value in [1/" +
                          std::to_string(world) + ", 1]");
    gw_ = std::max(1, int(std::lround(fraction * world)));
    if (world % gw_ != 0)
      throw Error("", "grad_worker_fraction = " + std::to_string(fraction) + " gives " +
                          std::to_string(gw_) + " gradient workers, which does not divide the " +
                          std::to_string(world) + " ranks");
    const int groups = world / gw_;
    groups_ = groups;
    const std::size_t n = costs.size();
    group_.assign(n, 0);
    decomposer_.assign(n, {});
    auto total = [&](std::size_t l) { return std::accumulate(costs[l].begin(), costs[l].end(), 0.0); };
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return total(a) > total(b); });
    std::vector<double> group_load(std::size_t(groups), 0.0), rank_load(std::size_t(world), 0.0);
    auto least = [](const std::vector<double>& v, std::size_t lo, std::size_t hi) {
      std::size_t best = lo;
      for (std::size_t i = lo; i < hi; ++i)
        if (v[i] < v[best]) best = i;
      return best;
    };
    // The least loaded member of worker group k, members in group order.
    auto least_member = [&](const std::vector<double>& load, int k) {
      int best = rank_of(k, 0);
      for (int j = 1; j < gw_; ++j)
        if (load[std::size_t(rank_of(k, j))] < load[std::size_t(best)]) best = rank_of(k, j);
      return std::size_t(best);
    };
    for (std::size_t l : order) {
      const double c = total(l);
      const std::size_t k = least(group_load, 0, group_load.size());
      group_[l] = int(k);
      group_load[k] += c;
      auto& d = decomposer_[l];
      d.assign(costs[l].size(), rank_of(int(k), 0));
      if (costs[l].empty()) continue;
      if (colocate) {
        const std::size_t r = least_member(rank_load, int(k));
        std::fill(d.begin(), d.end(), int(r));
        rank_load[r] += c;
        continue;
      }
      // larger unit first, each to the least loaded rank of the group
      std::vector<std::size_t> units(costs[l].size());
      std::iota(units.begin(), units.end(), 0);
      std::stable_sort(units.begin(), units.end(),
                       [&](std::size_t a, std::size_t b) { return costs[l][a] > costs[l][b]; });
      for (std::size_t u : units) {
        const std::size_t r = least_member(rank_load, int(k));
        rank_load[r] += costs[l][u];
        d[u] = int(r);
      }
    }
    rank_load_ = rank_load;
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
  int world_ = 1, gw_ = 1, groups_ = 1;
  GroupLayout layout_ = GroupLayout::contiguous_receivers;
  std::vector<int> group_;
  std::vector<std::vector<int>> decomposer_;
  std::vector<double> rank_load_;
};

}  // namespace kfac
