#pragma once
/// \file data_parallel.hpp
/// \brief Data-parallel gradient averaging for codes without a framework's DDP.

#include <Kokkos_Core.hpp>
#include <cstring>
#include <vector>

#include "kfac/comm/comm_precision.hpp"
#include "kfac/error.hpp"
#include "kfac/impl/layer_base.hpp"

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
    const std::size_t limit = std::max<std::size_t>(1, bucket_bytes_ / sizeof(T));
    std::vector<T> bucket;
    std::vector<impl::Buffer> members;
    auto flush = [&] {
      if (members.empty()) return;
      comm_.sum(bucket.data(), bucket.size(), sizeof(T), CommPrecision::native);
      ++collectives_;
      const T inv = T(1) / T(comm_.size());
      std::size_t off = 0;
      for (auto& m : members) {
        T* d = static_cast<T*>(m.data);
        for (std::size_t i = 0; i < m.count; ++i) d[i] = bucket[off + i] * inv;
        off += m.count;
      }
      bucket.clear();
      members.clear();
    };
    for (const auto& b : buffers_) {
      if (b.scalar_size != sizeof(T)) continue;
      // A view larger than a bucket travels in pieces of its own.
      for (std::size_t start = 0; start < b.count;) {
        const std::size_t room = limit - bucket.size();
        const std::size_t take = std::min(room, b.count - start);
        const T* src = static_cast<const T*>(b.data) + start;
        bucket.insert(bucket.end(), src, src + take);
        members.push_back(impl::Buffer{static_cast<T*>(b.data) + start, take, sizeof(T)});
        start += take;
        if (bucket.size() == limit) flush();
      }
    }
    flush();
  }

  Comm comm_;
  std::size_t bucket_bytes_;
  std::vector<impl::Buffer> buffers_;
  std::size_t collectives_ = 0;
};

}  // namespace kfac
