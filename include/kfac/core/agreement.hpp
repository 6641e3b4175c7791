#pragma once
/// \file agreement.hpp
/// \brief The one agreement at the top of every step(): each rank's local verdict (its
/// validation error, whether it saw NaN/Inf under the skip policy, a hash of its registration,
/// a hash of everything that decides the step's sequence of collectives, of the step's
/// hyperparameter values and of every other setting that changes the result) is combined in a
/// single small allreduce, so that every rank throws the same kfac::Error, or skips, together —
/// a fault on one rank never leaves the others waiting in a collective. Only when the hashes
/// differ does a second exchange compare the settings by name (differing_settings), so that the
/// error names the setting.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/core/block.hpp"
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
  std::uint64_t settings = 0;  ///< settings_hash(): the step's hyperparameter values
  /// Hash of configuration_text(): the Options fields and every method setting
  std::uint64_t configuration = 0;
  long client = 0;             ///< which preconditioner of the communicator steps (next_client_of)
};

/// A communicator that numbers its clients and names scopes (kfac::MpiComm).
template <class C, class = void>
struct has_clients : std::false_type {};
template <class C>
struct has_clients<C, std::void_t<decltype(std::declval<const C&>().next_client())>> : std::true_type {};
/// The next client number of `c` (0 for a communicator that does not count them).
template <class C>
long next_client_of(const C& c) {
  if constexpr (has_clients<C>::value) return c.next_client();
  else return 0;
}
inline void append_part(std::string& s, const std::string& part) { s += part; }
inline void append_part(std::string& s, const char* part) { s += part; }
inline void append_part(std::string& s, long part) { s += std::to_string(part); }
/// `c.scope(parts...)` (strings and numbers, joined) where the communicator names scopes in
/// its timeout messages; nothing is built for one that does not.
template <class C, class... Parts>
auto comm_scope(const C& c, const Parts&... parts) {
  if constexpr (has_clients<C>::value) {
    std::string what;
    (append_part(what, parts), ...);
    return c.scope(what);
  } else {
    return 0;
  }
}

/// The agreement's test of "every rank passed the same value": each rank contributes the pair
/// (v, ~v) to an allreduce_max; all passed the same v exactly when max(v) == ~max(~v). Writes
/// the pair at `pair` (two longs of the allreduce's buffer).
inline void put_same_pair(long* pair, long v) {
  pair[0] = v;
  pair[1] = ~v;
}
/// After the allreduce_max: whether every rank passed the same value in this pair.
inline bool same_on_every_rank(const long* pair) { return pair[0] == ~pair[1]; }

/// Appends the line `name=value` to a settings text (the form differing_settings compares).
inline void put_setting(std::string& text, const std::string& name, const std::string& value) {
  text += name + "=" + value + "\n";
}
/// The Options fields that are not hyperparameters (those enter values_text at each step), by name.
inline std::string options_text(const Options& o) {
  std::string t, skip;
  for (const auto& s : o.skip_layers) skip += (skip.empty() ? "" : ",") + s;
  const std::pair<const char*, std::string> fields[] = {
      {"loss_reduction", std::to_string(int(o.loss_reduction))},
      {"initial_factors", std::to_string(int(o.initial_factors))},
      {"precompute_reciprocal", std::to_string(int(o.precompute_reciprocal))},
      {"skip_layers", skip},
      {"nonfinite", std::to_string(int(o.nonfinite))},
      {"max_damping_retries", std::to_string(o.max_damping_retries)},
      {"damping_retry_factor", number(o.damping_retry_factor)},
      {"decomposition_delay", std::to_string(o.decomposition_delay)},
  };
  for (const auto& [name, value] : fields) put_setting(t, std::string("Options::") + name, value);
  return t;
}
/// The hyperparameter values of one step, by name, each prefixed by `prefix` (a layer's name and a dot, or "").
inline std::string values_text(const std::string& prefix, const StepValues& v) {
  std::string t;
  put_setting(t, prefix + "lr", number(v.lr));
  put_setting(t, prefix + "damping", number(v.damping));
  put_setting(t, prefix + "factor_decay", number(v.factor_decay));
  put_setting(t, prefix + "kl_clip", number(v.kl_clip));
  put_setting(t, prefix + "factor_update_steps", std::to_string(v.factor_update_steps));
  put_setting(t, prefix + "inv_update_steps", std::to_string(v.inv_update_steps));
  return t;
}
/// A method's settings ("name=value,...", Block::settings) as lines, each named `prefix` + name.
inline std::string method_text(const std::string& prefix, const std::string& settings) {
  std::string t;
  for (std::size_t at = 0; at < settings.size();) {
    std::size_t end = settings.find(',', at);
    if (end == std::string::npos) end = settings.size();
    t += prefix + settings.substr(at, end - at) + "\n";
    at = end + 1;
  }
  return t;
}

/// The settings of `mine` that differ from `root`'s (both settings texts), named, e.g.
/// "Options::precompute_reciprocal (rank 0: 0, rank 1: 1)"; at most three, then "...".
inline std::string settings_diff(const std::string& root, const std::string& mine, int rank) {
  auto parse = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> lines;
    for (std::size_t at = 0; at < text.size();) {
      std::size_t end = text.find('\n', at);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(at, end - at);
      const std::size_t eq = line.find('=');
      lines.emplace_back(line.substr(0, eq), eq == std::string::npos ? "" : line.substr(eq + 1));
      at = end + 1;
    }
    return lines;
  };
  const auto theirs = parse(root), ours = parse(mine);
  std::string out;
  int found = 0;
  auto add = [&](const std::string& name, const std::string& a, const std::string& b) {
    if (++found <= 3)
      out += (out.empty() ? "" : "; ") + name + " (rank 0: " + a + ", rank " + std::to_string(rank) + ": " + b + ")";
  };
  // Named pairs, not structured bindings: C++17 lambdas may not capture those (clang refuses).
  for (const auto& line : ours) {
    const std::string& name = line.first;
    const auto it = std::find_if(theirs.begin(), theirs.end(), [&](const auto& l) { return l.first == name; });
    if (it == theirs.end()) add(name, "(none)", line.second);
    else if (it->second != line.second) add(name, it->second, line.second);
  }
  for (const auto& line : theirs) {
    const std::string& name = line.first;
    if (std::none_of(ours.begin(), ours.end(), [&](const auto& l) { return l.first == name; })) add(name, line.second, "(none)");
  }
  if (found > 3) out += "; and " + std::to_string(found - 3) + " more";
  return out;
}

/// Collective over `dist`, on a mismatch only: rank 0's settings text (`text` there) goes to
/// every rank, each compares its own, and the lowest rank that differs tells every rank which
/// settings differ (settings_diff). Empty when no named setting differs.
template <class Dist>
std::string differing_settings(const Dist& dist, const std::string& text, int rank, int world) {
  const std::string diff = settings_diff(dist.share_message(rank == 0 ? text : "", 0), text, rank);
  long first = diff.empty() ? 0L : long(world - rank);
  dist.agree_max(&first, 1);
  if (first == 0) return "";
  const int root = world - int(first);
  return dist.share_message(rank == root ? diff : "", root);
}

/// The error of a collective load whose ranks loaded different replicated content (`mine`:
/// this rank's impl::replicated_hash): a second exchange, only then, names the ranks whose
/// content differs from rank 0's. Collective over `dist`.
template <class Dist>
Error content_differs(const Dist& dist, std::uint64_t mine, int rank, int world) {
  const bool differs = dist.share_message(rank == 0 ? std::to_string(mine) : "", 0) != std::to_string(mine);
  long d[2] = {differs ? long(world - rank) : 0L, differs ? long(rank) : -1L};
  dist.agree_max(d, 2);
  const long first = world - d[0], last = d[1];
  const std::string ranks = first == last ? "rank " + std::to_string(first)
                                          : "ranks " + std::to_string(first) + " to " + std::to_string(last) + " (some)";
  return Error("", "the ranks loaded checkpoints of different content: " + ranks +
                       " loaded step counters, schedules or averaged statistics that differ from rank 0's (a "
                       "checkpoint of another run, or of another step?); nothing was loaded on any rank");
}

/// Hash of the hyperparameter values in force at this step: the global ones and every
/// layer's (its overrides), so that ranks given different lr, damping, kl_clip, factor_decay
/// or intervals refuse the step together instead of drifting apart.
template <class DueList>
std::uint64_t settings_hash(const StepValues& v, const DueList& due) {
  std::string s;
  auto put = [&](const StepValues& x) {
    const double d[4] = {x.lr, x.damping, x.factor_decay, x.kl_clip};
    const long n[2] = {x.factor_update_steps, x.inv_update_steps};
    s.append(reinterpret_cast<const char*>(d), sizeof(d));
    s.append(reinterpret_cast<const char*>(n), sizeof(n));
  };
  put(v);
  for (const auto& d : due) put(d.values);
  return fnv1a(s);
}

/// Hash of what decides the collectives of a step: the step count, which layers update
/// statistics and decompositions, and the options that shape the communication (the
/// distribution's own settings are agreed at registration, in its signature()).
template <class DueList>
std::uint64_t sequence_hash(long step, const DueList& due, const Options& o) {
  std::string s = std::to_string(step) + ";" + std::to_string(int(o.nonfinite)) + ";" +
                  std::to_string(o.decomposition_delay) + ";";
  for (const auto& d : due) s += char('0' + int(d.factor) + 2 * int(d.inv) + 4 * int(d.defer));
  return fnv1a(s);
}

/// Combines the verdicts of all ranks of `dist` (one allreduce; a broadcast more only when
/// some rank failed, and a comparison of the settings by name only when some hash differs:
/// `describe()` returns this rank's settings text, every setting as a `name=value` line).
/// Throws the same kfac::Error on every rank; returns true when the step is to be skipped
/// everywhere.
template <class Dist, class Describe>
bool agree_on_step(const Dist& dist, const LocalVerdict& mine, int rank, int world, const Describe& describe) {
  if (world == 1) {
    if (mine.error) throw *mine.error;
    return mine.poisoned;
  }
  long v[12] = {mine.error ? long(world - rank) : 0L, mine.poisoned ? 1L : 0L};
  put_same_pair(v + 2, long(mine.registration));
  put_same_pair(v + 4, long(mine.sequence));
  put_same_pair(v + 6, long(mine.settings));
  put_same_pair(v + 8, mine.client);
  put_same_pair(v + 10, long(mine.configuration));
  dist.agree_max(v, 12);
  if (v[0] > 0) {  // the lowest failing rank tells everyone what it saw
    const int root = world - int(v[0]);
    const std::string layer = dist.share_message(mine.error && rank == root ? mine.error->layer() : "", root);
    const std::string what = dist.share_message(mine.error && rank == root ? bare_message(*mine.error) : "", root);
    throw Error(layer, what + " (on rank " + std::to_string(root) + "; the step was refused on every rank)");
  }
  if (!same_on_every_rank(v + 8))
    throw Error("", "two preconditioners that share one communicator were stepped in different orders on "
                    "different ranks (this rank stepped its preconditioner number " + std::to_string(mine.client) +
                    " of this communicator); the step was refused on every rank");
  const char* what = nullptr;
  if (!same_on_every_rank(v + 2))
    what = "ranks registered different layers, shapes, methods or distribution options";
  else if (!same_on_every_rank(v + 4))
    what = "ranks disagree on this step's schedule or communication options (step count, "
           "statistics/decomposition steps, bucket_bytes, comm_precision, nonfinite policy)";
  else if (!same_on_every_rank(v + 6))
    what = "ranks disagree on this step's hyperparameter values (lr, damping, factor_decay, kl_clip, "
           "update intervals, or a layer's override of them)";
  else if (!same_on_every_rank(v + 10))
    what = "ranks disagree on settings that change the result (Options fields or a layer's method settings)";
  if (what == nullptr) return v[1] > 0;
  const std::string named = differing_settings(dist, describe(), rank, world);
  throw Error("", std::string(what) + (named.empty() ? "" : ": " + named) + "; the step was refused on every rank");
}

/// What the ranks' registrations must agree on: the distribution's signature, then each
/// layer's name, method signature and whether it is skipped.
template <class Reg>
std::string registration_signature(const std::string& distribution, const Reg& reg) {
  std::string sig = distribution;
  for (const auto& e : reg.entries())
    sig += e.block->name() + ":" + e.block->signature() + (e.skipped ? ":skip" : "") + ";";
  return sig;
}
/// Every setting that changes the result and is fixed at registration, by name: the Options
/// fields that are not hyperparameters and each layer's method settings (Block::settings).
template <class Reg>
std::string configuration_text(const Options& o, const Reg& reg) {
  std::string t = options_text(o);
  for (const auto& e : reg.entries()) t += method_text(e.block->name() + ".", e.block->settings());
  return t;
}
/// What the ranks agree on at a step, by name, compared only when a hash differs
/// (differing_settings): the registration, the step's schedule and hyperparameter values (each
/// layer's, with its overrides); the caller appends configuration_text().
template <class Reg, class DueList>
std::string settings_text(const std::string& distribution, const Reg& reg, long step, const StepValues& v,
                          const DueList& due) {
  std::string t;  // the registration first: what differs there is named before its consequences
  put_setting(t, "distribution", distribution);
  for (const auto& e : reg.entries())
    put_setting(t, e.block->name() + ".method", e.block->signature() + (e.skipped ? " (skipped)" : ""));
  put_setting(t, "step", std::to_string(step));
  t += values_text("", v);
  for (std::size_t l = 0; l < reg.size(); ++l) {
    const std::string layer = reg[l].block->name() + ".";
    put_setting(t, layer + "updates", std::string(due[l].factor ? "statistics" : "") +
                                          (due[l].inv ? " decomposition" : "") + (due[l].defer ? " deferred" : ""));
    t += values_text(layer, due[l].values);
  }
  return t;
}

}  // namespace impl
}  // namespace kfac
