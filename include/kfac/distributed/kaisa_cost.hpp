#pragma once
/// \file kaisa_cost.hpp
/// \brief kfac::Kaisa states its step to the cost model (Kaisa::state_cost): the work
/// assignment it plans, the factor-sum buckets it sends, who decomposes which unit and which
/// worker group receives it, the rows each gradient worker preconditions and the broadcasts to
/// the gradient receivers, in the order KaisaState and the Preconditioner run them. Included at
/// the end of kaisa.hpp; the sheet's type is a template parameter (kfac::CostSheet in
/// planning/), so this file needs nothing from planning/.

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/bucketing.hpp"
#include "kfac/distributed/kaisa.hpp"
#include "kfac/distributed/work_assignment.hpp"

namespace kfac {
namespace impl {

/// The members of layer l's worker group, in member order: the ranks that share its decompositions.
inline std::vector<int> worker_group_ranks(const WorkAssignment& a, std::size_t l) {
  std::vector<int> group;
  for (int j = 0; j < a.grad_workers(); ++j) group.push_back(a.rank_of(a.worker_group(l), j));
  return group;
}

/// The assignment KaisaState::plan() makes from the layers' unit costs.
template <class Sheet>
WorkAssignment kaisa_assignment(const Kaisa& k, const Sheet& sheet) {
  std::vector<std::vector<double>> costs(sheet.layers());
  for (std::size_t l = 0; l < sheet.layers(); ++l)
    if (!sheet.skipped(l))
      for (const auto& u : sheet.layer(l).unit_costs)
        costs[l].push_back(k.assignment_cost == AssignmentCost::memory ? u.memory : u.flops);
  return WorkAssignment(sheet.world(), k.grad_worker_fraction, costs, k.colocate_factors, k.group_layout,
                        k.placement);
}

/// KaisaState's factor averaging: the collectives of impl::factor_buckets (per storage type:
/// binary16, which travels as float, float, double; with reduce_to_owner, each decomposed
/// factor summed only to its decomposer: one MPI_Reduce instead of a reduce and a broadcast).
template <class Sheet>
void kaisa_factor_sums(const Kaisa& k, Sheet& sheet, const WorkAssignment& a) {
  if (sheet.world() == 1) return;
  std::vector<std::size_t> counts, sizes;
  std::vector<int> owners;
  for (std::size_t l = 0; l < sheet.layers(); ++l) {
    if (sheet.skipped(l)) continue;
    const auto& s = sheet.layer(l);
    const auto c = s.factor_payload_counts();
    const bool units = s.decomposed_factors() > 0 && int(c.size()) == s.decomposed_factors();
    std::vector<int> decomposers;
    for (std::size_t u = 0; u < c.size(); ++u) {
      counts.push_back(c[u]);
      sizes.push_back(s.factor_scalar);
      decomposers.push_back(units && k.reduce_to_owner ? a.decomposer(l, int(u)) : -1);
    }
    for (int r : factor_owners_of(decomposers, units && k.reduce_to_owner, s.units_coupled, s.factor_scalar))
      owners.push_back(r);
  }
  for (const auto& b : factor_buckets(counts, sizes, owners, k.bucket_bytes)) {
    const std::size_t size = flat_scalar_size(b.scalar_size);  // the flat buffer's scalar
    const std::size_t payload = k.comm_precision == CommPrecision::native    ? size
                                : k.comm_precision == CommPrecision::float32 ? 4
                                                                             : 2;
    const std::size_t count = bucket_count(b.bucket);
    sheet.sum_factors(count * payload, b.owner, count * size);
  }
}

/// The decomposition phase as Preconditioner::decompose runs it: every rank its own units, then
/// the agreement on failures, then each unit's buffers broadcast within its worker group, in
/// layer order (one-rank groups send nothing).
template <class Sheet>
void kaisa_decompositions(Sheet& sheet, const WorkAssignment& a) {
  for (std::size_t l = 0; l < sheet.layers(); ++l)
    if (!sheet.skipped(l))
      for (int u = 0; u < sheet.layer(l).decomposed_factors(); ++u) sheet.decompose(a.decomposer(l, u), l, u);
  sheet.agree();
  for (std::size_t l = 0; l < sheet.layers() && a.grad_workers() > 1; ++l) {
    const auto& s = sheet.layer(l);
    if (sheet.skipped(l)) continue;
    const std::vector<int> group = worker_group_ranks(a, l);
    for (int u = 0; u < s.decomposed_factors(); ++u)
      for (std::size_t count : s.decomposition_buffer_counts(u))
        sheet.share_decomposition(group, a.decomposer(l, u), count * s.decomposition_scalar);
  }
}

/// One pass of the preconditioning phase: each gradient worker's applies (its rows of a divided
/// layer, `passes[l]` > 0), then the all-gathers of the divided layers, in layer order.
template <class Sheet>
void kaisa_preconditioning_pass(Sheet& sheet, const WorkAssignment& a, const std::vector<int>& passes, int pass) {
  const int gw = a.grad_workers();
  for (std::size_t l = 0; l < sheet.layers(); ++l) {
    const auto& s = sheet.layer(l);
    if (sheet.skipped(l) || s.decomposed_factors() == 0) continue;  // closed forms: every rank, before
    if (passes[l] == 0 ? pass > 0 : pass >= passes[l]) continue;
    for (int j = 0; j < gw; ++j) {
      const int r = a.rank_of(a.worker_group(l), j);
      const auto rows = row_block(s.g_dim, j, gw);
      if (passes[l] == 0) sheet.precondition(r, l);
      else sheet.precondition_rows(r, l, rows.second - rows.first, passes[l]);
    }
  }
  for (std::size_t l = 0; l < sheet.layers(); ++l) {
    if (pass >= passes[l]) continue;
    const auto& s = sheet.layer(l);
    const std::size_t row_bytes = std::size_t(s.a_dim) * s.decomposition_scalar;
    std::vector<std::size_t> parts;
    for (int j = 0; j < gw; ++j) {
      const auto rows = row_block(s.g_dim, j, gw);
      parts.push_back(std::size_t(rows.second - rows.first) * row_bytes);
    }
    sheet.gather_gradient(worker_group_ranks(a, l), parts);
  }
}

/// The preconditioning phase as Preconditioner::precondition runs it: closed forms on every
/// rank, then pass by pass each gradient worker's layers (with split_preconditioning its rows,
/// followed by the all-gathers), then the receiver broadcasts in layer order: member j of the
/// layer's worker group sends to receiver group j (member j of every worker group).
template <class Sheet>
void kaisa_preconditioning(const Kaisa& k, Sheet& sheet, const WorkAssignment& a) {
  const int world = sheet.world(), gw = a.grad_workers();
  std::vector<int> passes(sheet.layers(), 0);  // of the divided applies (0: whole)
  for (std::size_t l = 0; l < sheet.layers(); ++l)
    if (!sheet.skipped(l) && k.split_preconditioning && world > 1 && gw > 1 && sheet.layer(l).decomposed_factors() > 0)
      passes[l] = sheet.layer(l).split_passes;
  const int most = passes.empty() ? 1 : std::max(1, *std::max_element(passes.begin(), passes.end()));
  for (std::size_t l = 0; l < sheet.layers(); ++l)  // layers without units: every rank applies its own (NG-SGD)
    if (!sheet.skipped(l) && sheet.layer(l).decomposed_factors() == 0)
      for (int r = 0; r < world; ++r) sheet.precondition(r, l);
  for (int pass = 0; pass < most; ++pass) kaisa_preconditioning_pass(sheet, a, passes, pass);
  for (std::size_t l = 0; l < sheet.layers() && gw < world; ++l) {
    const auto& s = sheet.layer(l);
    if (sheet.skipped(l) || s.decomposed_factors() == 0) continue;
    const std::size_t bytes = std::size_t(s.g_dim) * std::size_t(s.a_dim) * s.decomposition_scalar;
    for (int j = 0; j < gw; ++j) {
      std::vector<int> receivers;
      for (int g = 0; g < a.worker_groups(); ++g) receivers.push_back(a.rank_of(g, j));
      sheet.share_gradient(receivers, a.rank_of(a.worker_group(l), j), bytes);
    }
  }
}

}  // namespace impl

template <class Sheet>
void Kaisa::state_cost(Sheet& sheet) const {
  WorkAssignment a = impl::kaisa_assignment(*this, sheet);
  for (int r = 0; r < sheet.world(); ++r)
    for (std::size_t l = 0; l < sheet.layers(); ++l)
      if (!sheet.skipped(l)) sheet.hold(r, l, a.is_grad_worker(l, r));
  impl::kaisa_factor_sums(*this, sheet, a);
  impl::kaisa_decompositions(sheet, a);
  impl::kaisa_preconditioning(*this, sheet, a);
  sheet.assign(std::move(a));
}

}  // namespace kfac
