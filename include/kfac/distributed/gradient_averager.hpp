#pragma once
/// \file gradient_averager.hpp
/// \brief Data-parallel gradient averaging for codes without a framework's DDP.

#include <Kokkos_Core.hpp>
#include <cstring>
#include <vector>

#include "kfac/distributed/comm_precision.hpp"
#include "kfac/distributed/bucketing.hpp"
#include "kfac/error.hpp"
#include "kfac/core/block.hpp"

namespace kfac {

/// \brief Averages a fixed set of gradient views over ranks, in place, in buckets of at most
/// `bucket_bytes` (one collective per bucket). The result is bit-identical on every rank.
///
/// Register the views once with add(); call average() after every backward pass. Views must be
/// contiguous, of float or double, and host-accessible (device views: stage through a mirror).
/// \tparam Comm SerialComm or MpiComm.
template <class Comm>
class GradientAverager {
 public:
  explicit GradientAverager(Comm comm, std::size_t bucket_bytes = std::size_t(16) << 20)
      : comm_(std::move(comm)), bucket_bytes_(bucket_bytes) {
    if (bucket_bytes_ < 8) throw Error("", "GradientAverager: bucket_bytes must be at least 8");
  }

  template <class View>
  void add(const View& v) {
    using T = typename View::non_const_value_type;
    static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                  "GradientAverager: gradients must be float or double");
    static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename View::memory_space>::accessible,
                  "GradientAverager: gradients must be host-accessible");
    if (!v.span_is_contiguous()) throw Error("", "GradientAverager: gradient views must be contiguous");
    buffers_.push_back(impl::buffer_of(v));
  }

  /// Replaces every registered gradient by its mean over ranks.
  void average() {
    collectives_ = 0;
    if (comm_.size() == 1) return;
    average_typed<float>();
    average_typed<double>();
  }
  /// Collectives used by the last average().
  std::size_t collectives() const { return collectives_; }

 private:
  template <class T>
  void average_typed() {
    std::vector<impl::Buffer> mine;
    std::vector<std::size_t> counts;
    for (const auto& b : buffers_)
      if (b.scalar_size == sizeof(T)) {
        mine.push_back(b);
        counts.push_back(b.count);
      }
    // A view larger than a bucket travels in pieces of its own.
    const auto buckets = impl::plan_buckets(counts, bucket_bytes_ / sizeof(T), true);
    std::vector<T> bucket;
    const T inv = T(1) / T(comm_.size());
    for (const auto& pieces : buckets) {
      bucket.clear();
      for (const auto& p : pieces) {
        const T* src = static_cast<const T*>(mine[p.item].data) + p.start;
        bucket.insert(bucket.end(), src, src + p.count);
      }
      comm_.sum(bucket.data(), bucket.size(), sizeof(T), CommPrecision::native);
      ++collectives_;
      std::size_t off = 0;
      for (const auto& p : pieces) {
        T* d = static_cast<T*>(mine[p.item].data) + p.start;
        for (std::size_t i = 0; i < p.count; ++i) d[i] = bucket[off + i] * inv;
        off += p.count;
      }
    }
  }

  Comm comm_;
  std::size_t bucket_bytes_;
  std::vector<impl::Buffer> buffers_;
  std::size_t collectives_ = 0;
};

}  // namespace kfac
