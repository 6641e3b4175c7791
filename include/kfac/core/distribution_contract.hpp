#pragma once
/// \file distribution_contract.hpp
/// \brief What the per-rank state of a distribution policy must provide, in five parts, each
/// checked member by member with a static_assert that names the member (the Preconditioner
/// instantiates impl::DistributionContract for its policy's State). A strategy varies some
/// parts and takes the defaults of distributed/parts.hpp for the others:
///
/// | part | members | default (one rank's behaviour) |
/// |---|---|---|
/// | agreement | `comm()`, `signature(o)`, `check_same(sig)`, `agree_max(v)`, `agree_max(v, n)`, `share_message(s, root)`, `agreement_size()` | `LocalAgreement` (this rank alone) or `WorldAgreement` (every rank of the communicator) |
/// | placement | `plan(o, costs)`, `assignment()`, `holds(l)`, `computes(l, u)` | `LocalPlacement`: this rank holds and decomposes everything |
/// | factor averaging | `average(exec, all, o)`, `start_average(exec, all, o)`, `overlaps()`, `sends_increments(o, scalar_size)`, `payload_max(o)`, `factor_owner(o, l, u)`, `share_factors(exec, all)` | `NoFactorAveraging` |
/// | decomposition sharing | `share_unit(l, u, buffers)`, `shares_in_background(o)`, `background_sharer(l)`, `count_background(sent)` | `NoDecompositionSharing` |
/// | gradient sharing | `share_gradient(l, buffer)`, `shares_gradients()`, `split_parts(o, l)`, `split_part(l)`, `gather_rows(l, buffer, rows)` | `NoGradientSharing` |
///
/// and `request_type`, what its started collectives return (impl::request_of_t<Comm>).
/// `signature(o)` is always the policy's own: it names the policy and its settings, which every
/// rank must share.

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/buffer.hpp"
#include "kfac/core/options.hpp"
#include "kfac/core/started.hpp"

namespace kfac {
namespace impl {

/// \cond
// One detection trait per member: KFAC_IMPL_MEMBER(trait, expression in S (the State) and E (the
// execution space)). Not for doxygen, which cannot parse the macro calls.
#define KFAC_IMPL_MEMBER(trait, expression)                                              \
  template <class S, class E, class = void>                                              \
  struct trait : std::false_type {};                                                     \
  template <class S, class E>                                                            \
  struct trait<S, E, std::void_t<decltype(expression)>> : std::true_type {};

KFAC_IMPL_MEMBER(has_request_type, std::declval<typename S::request_type>())
KFAC_IMPL_MEMBER(has_comm, std::declval<const S&>().comm())
KFAC_IMPL_MEMBER(has_signature, std::string(std::declval<const S&>().signature(std::declval<const Options&>())))
KFAC_IMPL_MEMBER(has_check_same, bool(std::declval<S&>().check_same(std::string())))
KFAC_IMPL_MEMBER(has_agree_max, long(std::declval<const S&>().agree_max(1L)))
KFAC_IMPL_MEMBER(has_agree_max_n, std::declval<const S&>().agree_max(static_cast<long*>(nullptr), 1))
KFAC_IMPL_MEMBER(has_share_message, std::string(std::declval<const S&>().share_message(std::string(), 0)))
KFAC_IMPL_MEMBER(has_agreement_size, int(std::declval<const S&>().agreement_size()))

KFAC_IMPL_MEMBER(has_plan, std::declval<S&>().plan(std::declval<const Options&>(),
                                                   std::declval<const std::vector<std::vector<UnitCost>>&>()))
KFAC_IMPL_MEMBER(has_assignment, std::declval<const S&>().assignment())
KFAC_IMPL_MEMBER(has_holds, bool(std::declval<const S&>().holds(std::size_t())))
KFAC_IMPL_MEMBER(has_computes, bool(std::declval<const S&>().computes(std::size_t(), 0)))

KFAC_IMPL_MEMBER(has_average, std::declval<S&>().average(std::declval<const E&>(),
                                                         std::declval<const std::vector<FactorBuffer>&>(),
                                                         std::declval<const Options&>()))
KFAC_IMPL_MEMBER(has_start_average,
                 StartedSums<typename S::request_type>(std::declval<S&>().start_average(
                     std::declval<const E&>(), std::declval<const std::vector<FactorBuffer>&>(),
                     std::declval<const Options&>())))
KFAC_IMPL_MEMBER(has_overlaps, bool(std::declval<const S&>().overlaps()))
KFAC_IMPL_MEMBER(has_sends_increments,
                 bool(std::declval<const S&>().sends_increments(std::declval<const Options&>(), std::size_t())))
KFAC_IMPL_MEMBER(has_payload_max, double(std::declval<const S&>().payload_max(std::declval<const Options&>())))
KFAC_IMPL_MEMBER(has_factor_owner,
                 int(std::declval<const S&>().factor_owner(std::declval<const Options&>(), std::size_t(), 0)))
KFAC_IMPL_MEMBER(has_share_factors, std::declval<const S&>().share_factors(
                                        std::declval<const E&>(), std::declval<const std::vector<FactorBuffer>&>()))

KFAC_IMPL_MEMBER(has_share_unit, std::vector<typename S::request_type>(std::declval<S&>().share_unit(
                                     std::size_t(), 0, std::declval<const std::vector<Buffer>&>())))
KFAC_IMPL_MEMBER(has_shares_in_background,
                 bool(std::declval<const S&>().shares_in_background(std::declval<const Options&>())))
KFAC_IMPL_MEMBER(has_background_sharer, BackgroundSharer(std::declval<S&>().background_sharer(std::size_t())))
KFAC_IMPL_MEMBER(has_count_background,
                 std::declval<S&>().count_background(std::pair<std::size_t, std::size_t>()))

KFAC_IMPL_MEMBER(has_share_gradient, typename S::request_type(std::declval<S&>().share_gradient(
                                         std::size_t(), std::declval<const Buffer&>())))
KFAC_IMPL_MEMBER(has_shares_gradients, bool(std::declval<const S&>().shares_gradients()))
KFAC_IMPL_MEMBER(has_split_parts, int(std::declval<const S&>().split_parts(std::declval<const Options&>(), std::size_t())))
KFAC_IMPL_MEMBER(has_split_part, int(std::declval<const S&>().split_part(std::size_t())))
KFAC_IMPL_MEMBER(has_gather_rows, typename S::request_type(std::declval<S&>().gather_rows(
                                      std::size_t(), std::declval<const Buffer&>(), index_t())))

#undef KFAC_IMPL_MEMBER
/// \endcond

/// Instantiated by the Preconditioner for its policy's State on execution space Exec: one
/// static_assert per member of the contract above, each naming the member and its part.
template <class S, class Exec>
struct DistributionContract {
  static_assert(has_request_type<S, Exec>::value,
                "kfac distribution State: needs `using request_type = impl::request_of_t<Comm>;`");
  // agreement
  static_assert(has_comm<S, Exec>::value, "kfac distribution State (agreement): needs `const Comm& comm() const`");
  static_assert(has_signature<S, Exec>::value,
                "kfac distribution State (agreement): needs `std::string signature(const Options&) const` naming the "
                "policy and its settings");
  static_assert(has_check_same<S, Exec>::value,
                "kfac distribution State (agreement): needs `bool check_same(const std::string& signature)`");
  static_assert(has_agree_max<S, Exec>::value, "kfac distribution State (agreement): needs `long agree_max(long) const`");
  static_assert(has_agree_max_n<S, Exec>::value,
                "kfac distribution State (agreement): needs `void agree_max(long* values, int n) const`");
  static_assert(has_share_message<S, Exec>::value,
                "kfac distribution State (agreement): needs `std::string share_message(const std::string&, int root) const`");
  static_assert(has_agreement_size<S, Exec>::value,
                "kfac distribution State (agreement): needs `int agreement_size() const`");
  // placement
  static_assert(has_plan<S, Exec>::value,
                "kfac distribution State (placement): needs `void plan(const Options&, const std::vector<std::vector<"
                "impl::UnitCost>>& costs)`");
  static_assert(has_assignment<S, Exec>::value,
                "kfac distribution State (placement): needs `const WorkAssignment& assignment() const`");
  static_assert(has_holds<S, Exec>::value, "kfac distribution State (placement): needs `bool holds(std::size_t layer) const`");
  static_assert(has_computes<S, Exec>::value,
                "kfac distribution State (placement): needs `bool computes(std::size_t layer, int unit) const`");
  // factor averaging
  static_assert(has_average<S, Exec>::value,
                "kfac distribution State (factor averaging): needs `void average(const Exec&, const std::vector<impl::"
                "FactorBuffer>&, const Options&)`");
  static_assert(has_start_average<S, Exec>::value,
                "kfac distribution State (factor averaging): needs `impl::StartedSums<request_type> start_average("
                "const Exec&, const std::vector<impl::FactorBuffer>&, const Options&)`");
  static_assert(has_overlaps<S, Exec>::value, "kfac distribution State (factor averaging): needs `bool overlaps() const`");
  static_assert(has_sends_increments<S, Exec>::value,
                "kfac distribution State (factor averaging): needs `bool sends_increments(const Options&, std::size_t "
                "scalar_size) const`");
  static_assert(has_payload_max<S, Exec>::value,
                "kfac distribution State (factor averaging): needs `double payload_max(const Options&) const`");
  static_assert(has_factor_owner<S, Exec>::value,
                "kfac distribution State (factor averaging): needs `int factor_owner(const Options&, std::size_t layer, "
                "int unit) const`");
  static_assert(has_share_factors<S, Exec>::value,
                "kfac distribution State (factor averaging): needs `void share_factors(const Exec&, const std::vector<"
                "impl::FactorBuffer>&) const`");
  // decomposition sharing
  static_assert(has_share_unit<S, Exec>::value,
                "kfac distribution State (decomposition sharing): needs `std::vector<request_type> share_unit(std::size_t "
                "layer, int unit, const std::vector<impl::Buffer>&)`");
  static_assert(has_shares_in_background<S, Exec>::value,
                "kfac distribution State (decomposition sharing): needs `bool shares_in_background(const Options&) const`");
  static_assert(has_background_sharer<S, Exec>::value,
                "kfac distribution State (decomposition sharing): needs `impl::BackgroundSharer background_sharer("
                "std::size_t layer)`");
  static_assert(has_count_background<S, Exec>::value,
                "kfac distribution State (decomposition sharing): needs `void count_background(std::pair<std::size_t, "
                "std::size_t> sent)`");
  // gradient sharing
  static_assert(has_share_gradient<S, Exec>::value,
                "kfac distribution State (gradient sharing): needs `request_type share_gradient(std::size_t layer, "
                "const impl::Buffer&)`");
  static_assert(has_shares_gradients<S, Exec>::value,
                "kfac distribution State (gradient sharing): needs `bool shares_gradients() const`");
  static_assert(has_split_parts<S, Exec>::value,
                "kfac distribution State (gradient sharing): needs `int split_parts(const Options&, std::size_t layer) const`");
  static_assert(has_split_part<S, Exec>::value,
                "kfac distribution State (gradient sharing): needs `int split_part(std::size_t layer) const`");
  static_assert(has_gather_rows<S, Exec>::value,
                "kfac distribution State (gradient sharing): needs `request_type gather_rows(std::size_t layer, const "
                "impl::Buffer&, index_t rows)`");
  static constexpr bool ok = true;
};

}  // namespace impl
}  // namespace kfac
