#pragma once
/// \file agreement.hpp
/// \brief The one agreement at the top of every step(): each rank's local verdict (its
/// validation error, whether it saw NaN/Inf under the skip policy, a hash of its registration
/// and a hash of everything that decides the step's sequence of collectives) is combined in a
/// single small allreduce, so that every rank throws the same kfac::Error, or skips, together —
/// a fault on one rank never leaves the others waiting in a collective.

#include <cstdint>
#include <optional>
#include <string>

#include "kfac/core/hash.hpp"
#include "kfac/core/options.hpp"
#include "kfac/error.hpp"

namespace kfac {
namespace impl {

/// What one rank found before the step's first collective.
struct LocalVerdict {
  std::optional<Error> error;  ///< the rank's own validation error
  bool poisoned = false;       ///< NaN/Inf seen under NonFinitePolicy::skip
  std::uint64_t registration = 0, sequence = 0;
};

/// Hash of what decides the collectives of a step: the step count, which layers update
/// statistics and decompositions, and the options that shape the communication.
template <class DueList>
std::uint64_t sequence_hash(long step, const DueList& due, const Options& o) {
  std::string s = std::to_string(step) + ";" + std::to_string(o.bucket_bytes) + ";" +
                  std::to_string(int(o.comm_precision)) + ";" + std::to_string(int(o.nonfinite)) + ";" + std::to_string(o.decomposition_delay) + ";";
  for (const auto& d : due) s += char('0' + int(d.factor) + 2 * int(d.inv) + 4 * int(d.defer));
  return fnv1a(s);
}

/// The message of `e` without the "kfac: layer '...': " prefix Error adds.
inline std::string bare_message(const Error& e) {
  const std::string what = e.what();
  const std::string prefix = e.layer().empty() ? "kfac: " : "kfac: layer '" + e.layer() + "': ";
  return what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what;
}

/// Combines the verdicts of all ranks of `dist` (one allreduce; a broadcast more only when
/// some rank failed). Throws the same kfac::Error on every rank; returns true when the step
/// is to be skipped everywhere.
template <class Dist>
bool agree_on_step(const Dist& dist, const LocalVerdict& mine, int rank, int world) {
  if (world == 1) {
    if (mine.error) throw *mine.error;
    return mine.poisoned;
  }
  // Max of h and of ~h: all ranks passed the same h exactly when max(h) == ~max(~h).
  long v[6] = {mine.error ? long(world - rank) : 0L,
               mine.poisoned ? 1L : 0L,
               long(mine.registration),
               long(~mine.registration),
               long(mine.sequence),
               long(~mine.sequence)};
  dist.agree_max(v, 6);
  if (v[0] > 0) {  // the lowest failing rank tells everyone what it saw
    const int root = world - int(v[0]);
    const std::string layer = dist.share_message(mine.error && rank == root ? mine.error->layer() : "", root);
    const std::string what = dist.share_message(mine.error && rank == root ? bare_message(*mine.error) : "", root);
    throw Error(layer, what + " (on rank " + std::to_string(root) + "; the step was refused on every rank)");
  }
  if (v[2] != ~v[3])
    throw Error("", "ranks registered different layers, shapes, methods or distribution options; "
                    "the step was refused on every rank");
  if (v[4] != ~v[5])
    throw Error("", "ranks disagree on this step's schedule or communication options (step count, "
                    "statistics/decomposition steps, bucket_bytes, comm_precision, nonfinite policy); "
                    "the step was refused on every rank");
  return v[1] > 0;
}

}  // namespace impl
}  // namespace kfac
