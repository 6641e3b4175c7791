#pragma once
/// \file collective.hpp
/// \brief Preconditioner::save and Preconditioner::load as collectives: what every rank does
/// around the format of serializer.hpp (owners share their factors before a save; a load is
/// checked on every rank, agreed in one collective, and applied everywhere or nowhere).

#include <cstdint>
#include <istream>
#include <optional>
#include <ostream>
#include <string>

#include "kfac/checkpoint/serializer.hpp"
#include "kfac/core/agreement.hpp"
#include "kfac/core/step_phases.hpp"

namespace kfac {
namespace impl {

/// The step counters a checkpoint carries: the step, and the last steps that updated some
/// layer's statistics and some decomposition (-1: never).
struct StepCounters {
  long step = 0, last_factor = -1, last_inv = -1;
};

/// Writes the state of a Preconditioner (see Preconditioner::save). Collective with
/// reduce-to-owner: the owners share the global factors first.
template <class Scalar, class Exec, class Dist, class Flying>
void save_state(std::ostream& os, const Exec& exec, const Registry<Scalar, Exec>& reg, const Dist& dist,
                const Flying& flying, const Options& o, const StepCounters& c, bool with_decompositions) {
  share_owned_factors(exec, reg, dist, o, dist.assignment().layers());
  const long counters[3] = {c.step, c.last_factor, c.last_inv};
  save_checkpoint(os, reg, flying.snapshot(), counters, dist.comm().size(), dist.comm().rank(), with_decompositions);
}

/// What load_state restored.
struct Loaded {
  bool decompositions = false;  ///< every saved decomposition was restored
  bool everywhere = false;      ///< every rank restored its decompositions (same world and rank)
  StepCounters counters;
};

/// Reads a checkpoint into a Preconditioner's registry (see Preconditioner::load): parses and
/// checks it, runs `check_registration()` (collective, like the rest), then one collective
/// carries every rank's verdict and a hash of its replicated content. A checkpoint refused on
/// one rank is refused on all, and so is one whose replicated content differs between the
/// ranks; then nothing changed. Else the state is applied on every rank.
template <class Scalar, class Exec, class Dist, class Flying, class CheckRegistration>
Loaded load_state(std::istream& is, const Exec& exec, Registry<Scalar, Exec>& reg, Dist& dist, Flying& flying,
                  const Options& o, CheckRegistration&& check_registration) {
  CheckpointPlan cp;
  std::optional<Error> refused;
  try {
    cp = parse_checkpoint(is, reg);
  } catch (const Error& e) {
    refused = e;
  }
  check_registration();
  const int size = dist.comm().size(), rank = dist.comm().rank();
  const bool mine = !refused && decompositions_fit(cp, reg, size, rank, [&](std::size_t l) { return dist.holds(l); });
  // One collective: the verdict, and whether every rank loaded the same replicated content.
  const int world = dist.agreement_size();
  const std::uint64_t content = refused || world == 1 ? 0 : replicated_hash(cp, reg);
  long v[3] = {refused ? 2L : mine ? 0L : 1L, 0, 0};
  put_same_pair(v + 1, long(content));
  if (world > 1) dist.agree_max(v, 3);
  const long verdict = v[0];
  if (refused) throw *refused;
  if (verdict == 2) throw Error("", "another rank refused its checkpoint; nothing was loaded");
  if (world > 1 && !same_on_every_rank(v + 1)) throw content_differs(dist, content, rank, world);
  Loaded got;
  got.decompositions = apply_checkpoint(cp, reg, flying, verdict == 0, exec, o.precompute_reciprocal);
  got.everywhere = verdict == 0;
  got.counters = {cp.counters[0], cp.counters[3], cp.counters[4]};
  return got;
}

}  // namespace impl
}  // namespace kfac
