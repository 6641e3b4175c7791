#pragma once
/// \file bucketed_sum.hpp
/// \brief Views averaged in place over ranks, in buckets: the loop that GradientAverager and
/// ParameterAverager share (each value x becomes post * sum_r(pre_r * x_r)).

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/bucketing.hpp"
#include "kfac/core/comm_precision.hpp"
#include "kfac/distributed/staging.hpp"
#include "kfac/error.hpp"

namespace kfac {
namespace impl {

/// The buffer of a contiguous float or double view in memory that Exec can access, for an
/// averager (`who` names it in the error).
template <class Exec, class View>
Buffer averaged_buffer_of(const View& v, const char* who) {
  using T = typename View::non_const_value_type;
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "kfac: averaged views must be float or double");
  static_assert(Kokkos::SpaceAccessibility<Exec, typename View::memory_space>::accessible,
                "kfac: averaged views must be in memory that the averager's Exec can access "
                "(device views: an averager with Exec = Kokkos::DefaultExecutionSpace)");
  if (!v.span_is_contiguous()) throw Error("", std::string(who) + ": views must be contiguous");
  return buffer_of(v);
}

/// \brief Collective (one hash over ranks): throws the same kfac::Error on every rank, before
/// any data moves, unless every rank registered the same number, sizes and scalar types of
/// views with averager `who`. Without it, different sizes end in MPI's own abort
/// (MPI_ERR_TRUNCATE) or a wrong average.
template <class Comm>
void check_same_buffers(const Comm& comm, const std::vector<Buffer>& buffers, const char* who, const char* kind) {
  std::string sig = std::string(who) + ":" + std::to_string(buffers.size()) + ";";
  for (const auto& b : buffers) sig += std::to_string(b.scalar_size) + "x" + std::to_string(b.count) + ";";
  if (!comm.all_equal(sig))
    throw Error("", std::string(who) + ": ranks registered different " + kind + " views (count, sizes or types; rank " +
                        std::to_string(comm.rank()) + " has " + std::to_string(buffers.size()) + " view(s): " + sig +
                        "); nothing was averaged");
}

/// Copies `count` values of `src` (from `src_off`) into `dst` (from `dst_off`), each times
/// `scale`; both in Exec's memory. A free function: nvcc rejects device lambdas in private members.
template <class Exec, class T>
void copy_scaled(const Exec& exec, T* dst, std::size_t dst_off, const T* src, std::size_t src_off,
                 std::size_t count, T scale) {
  Kokkos::parallel_for(
      "kfac::averager::copy", Kokkos::RangePolicy<Exec>(exec, 0, count),
      KOKKOS_LAMBDA(std::size_t i) { dst[dst_off + i] = src[src_off + i] * scale; });
}

/// \brief Every value x of the buffers of scalar type T becomes post * sum over ranks of
/// (pre * x), in place, in buckets of at most `bucket_bytes` (views split across buckets).
/// Buckets are packed and unpacked by kernels on `exec` into `staging` (grown as needed, in
/// Exec's memory); a communicator that cannot read that memory gets a host copy. Comm::sum
/// gives every rank the same bits, so the result is identical on every rank. Returns the
/// collectives used.
template <class T, class Exec, class Comm>
std::size_t bucketed_sum(const Exec& exec, const Comm& comm, const std::vector<Buffer>& all,
                         std::size_t bucket_bytes, T pre, T post,
                         Kokkos::View<char*, typename Exec::memory_space>& staging) {
  std::vector<Buffer> mine;
  std::vector<std::size_t> counts;
  for (const auto& b : all)
    if (b.scalar_size == sizeof(T)) {
      mine.push_back(b);
      counts.push_back(b.count);
    }
  // A view larger than a bucket travels in pieces of its own.
  const auto buckets = plan_buckets(counts, bucket_bytes / sizeof(T), true);
  for (const auto& pieces : buckets) {
    const std::size_t count = bucket_count(pieces);
    if (staging.extent(0) < count * sizeof(T))
      staging = Kokkos::View<char*, typename Exec::memory_space>("kfac::averager::staging", count * sizeof(T));
    T* flat = reinterpret_cast<T*>(staging.data());
    std::size_t off = 0;
    for (const auto& p : pieces) {  // pack
      copy_scaled(exec, flat, off, static_cast<const T*>(mine[p.item].data), p.start, p.count, pre);
      off += p.count;
    }
    exec.fence();  // before the communicator reads the bucket
    on_host<Exec>(comm, flat, count * sizeof(T),
                  [&](void* data) { comm.sum(data, count, sizeof(T), CommPrecision::native); });
    off = 0;
    for (const auto& p : pieces) {  // unpack
      copy_scaled(exec, static_cast<T*>(mine[p.item].data), p.start, flat, off, p.count, post);
      off += p.count;
    }
  }
  exec.fence();  // the values are read next, maybe on the host
  return buckets.size();
}

}  // namespace impl
}  // namespace kfac
