#pragma once
/// \file bucketed_sum.hpp
/// \brief Host views averaged in place over ranks, in buckets: the loop that GradientAverager
/// and ParameterAverager share (each value x becomes post * sum_r(pre_r * x_r)).

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/distributed/bucketing.hpp"
#include "kfac/distributed/comm_precision.hpp"
#include "kfac/error.hpp"

namespace kfac {
namespace impl {

/// The buffer of a contiguous, host-accessible float or double view, for an averager.
template <class View>
Buffer host_buffer_of(const View& v, const char* who) {
  using T = typename View::non_const_value_type;
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "kfac: averaged views must be float or double");
  static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename View::memory_space>::accessible,
                "kfac: averaged views must be host-accessible (stage device views through a mirror)");
  if (!v.span_is_contiguous()) throw Error("", std::string(who) + ": views must be contiguous");
  return buffer_of(v);
}

/// \brief Every value x of the buffers of scalar type T becomes post * sum over ranks of
/// (pre * x), in place, in buckets of at most `bucket_bytes` (views split across buckets).
/// Comm::sum gives every rank the same bits, so the result is identical on every rank.
/// Returns the collectives used.
template <class T, class Comm>
std::size_t bucketed_sum(const Comm& comm, const std::vector<Buffer>& all, std::size_t bucket_bytes,
                         T pre, T post) {
  std::vector<Buffer> mine;
  std::vector<std::size_t> counts;
  for (const auto& b : all)
    if (b.scalar_size == sizeof(T)) {
      mine.push_back(b);
      counts.push_back(b.count);
    }
  const auto buckets = plan_buckets(counts, bucket_bytes / sizeof(T), true);
  std::vector<T> bucket;
  for (const auto& pieces : buckets) {
    bucket.clear();
    for (const auto& p : pieces) {
      const T* src = static_cast<const T*>(mine[p.item].data) + p.start;
      for (std::size_t i = 0; i < p.count; ++i) bucket.push_back(pre * src[i]);
    }
    comm.sum(bucket.data(), bucket.size(), sizeof(T), CommPrecision::native);
    std::size_t off = 0;
    for (const auto& p : pieces) {
      T* d = static_cast<T*>(mine[p.item].data) + p.start;
      for (std::size_t i = 0; i < p.count; ++i) d[i] = bucket[off + i] * post;
      off += p.count;
    }
  }
  return buckets.size();
}

}  // namespace impl
}  // namespace kfac
