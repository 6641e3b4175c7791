#pragma once
/// \file independent.hpp
/// \brief No distribution: every rank keeps, decomposes and applies its own state and takes
/// part in no collective. For jobs whose ranks see different data and must not average their
/// curvature (Kaldi's independent jobs with parameter averaging, FDG's pipeline stages), and
/// for ranks that register different layers.

#include <cmath>
#include <string>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/in_flight.hpp"
#include "kfac/core/options.hpp"
#include "kfac/distributed/work_assignment.hpp"

namespace kfac {

struct Independent {
  using distribution_tag = void;
  static constexpr const char* name = "independent";

  template <class Exec, class Comm>
  class State {
   public:
    using request_type = impl::request_of_t<Comm>;
    State(const Independent&, Comm comm) : comm_(std::move(comm)) {}
    const Comm& comm() const { return comm_; }
    std::string signature(const Options&) const { return "independent;"; }
    bool check_same(const std::string&) const { return true; }
    void plan(const Options&, const std::vector<std::vector<impl::UnitCost>>& costs) {
      std::vector<std::vector<double>> c(costs.size());
      for (std::size_t l = 0; l < costs.size(); ++l) c[l].assign(costs[l].size(), 0.0);
      assignment_ = WorkAssignment(1, 1.0, c, true);
    }
    /// A one-rank assignment: everything on this rank.
    const WorkAssignment& assignment() const { return assignment_; }
    bool holds(std::size_t) const { return true; }
    bool computes(std::size_t, int) const { return true; }
    long agree_max(long v) const { return v; }
    void agree_max(long*, int) const {}
    std::string share_message(const std::string& s, int) const { return s; }
    /// Ranks decide alone: the agreement at the top of a step involves only this rank.
    int agreement_size() const { return 1; }
    bool sends_increments(const Options&, std::size_t) const { return false; }
    double payload_max(const Options&) const { return HUGE_VAL; }
    void average(const Exec&, const std::vector<impl::FactorBuffer>&, const Options&) {}
    /// Nothing travels, so nothing overlaps (Kaisa::overlap_communication does nothing).
    std::vector<request_type> start_average(const Exec&, const std::vector<impl::FactorBuffer>&, const Options&) {
      return {};
    }
    void finish_average(const Exec&) {}
    bool overlaps() const { return false; }
    int factor_owner(const Options&, std::size_t, int) const { return -1; }
    void share_factors(const Exec&, const std::vector<impl::FactorBuffer>&) const {}
    std::vector<request_type> share_unit(std::size_t, int, const std::vector<impl::Buffer>&) { return {}; }
    bool shares_in_background(const Options&) const { return false; }
    impl::BackgroundSharer background_sharer(std::size_t) { return {}; }
    void count_background(std::pair<std::size_t, std::size_t>) {}
    request_type share_gradient(std::size_t, const impl::Buffer&) { return {}; }
    bool shares_gradients() const { return false; }
    /// No rank shares a layer's preconditioning (Kaisa::split_preconditioning does nothing).
    int split_parts(const Options&, std::size_t) const { return 1; }
    int split_part(std::size_t) const { return 0; }
    request_type gather_rows(std::size_t, const impl::Buffer&, index_t) { return {}; }

   private:
    Comm comm_;
    WorkAssignment assignment_;
  };
};

}  // namespace kfac
