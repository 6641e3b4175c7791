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
#include "kfac/distributed/parts.hpp"

namespace kfac {

struct Independent {
  using distribution_tag = void;
  static constexpr const char* name = "independent";

  /// Every part one rank's: this rank alone agrees, holds and decomposes everything, averages
  /// and shares nothing.
  template <class Exec, class Comm>
  class State : public impl::LocalAgreement<Comm>,
                public impl::LocalPlacement,
                public impl::NoFactorAveraging<Exec, impl::request_of_t<Comm>>,
                public impl::NoDecompositionSharing<impl::request_of_t<Comm>>,
                public impl::NoGradientSharing<impl::request_of_t<Comm>> {
   public:
    using request_type = impl::request_of_t<Comm>;
    State(const Independent&, Comm comm) : impl::LocalAgreement<Comm>(std::move(comm)) {}
    std::string signature(const Options&) const { return "independent;"; }
  };

  /// States one step to the cost model (`Sheet` is kfac::CostSheet): every rank decomposes
  /// every unit of every layer and applies every layer; nothing is sent.
  template <class Sheet>
  void state_cost(Sheet& sheet) const {
    for (int r = 0; r < sheet.world(); ++r) sheet.compute_everything(r);
  }
};

}  // namespace kfac
