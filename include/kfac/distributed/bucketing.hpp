#pragma once
/// \file bucketing.hpp
/// \brief The one bucketing routine: how a list of buffers is cut into collectives of at most
/// `limit` values. Factor averaging, GradientAverager and the cost model all call it, so the
/// bytes the cost model predicts are the bytes the library sends.

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kfac {
namespace impl {

/// A piece of item `item`: values [start, start + count).
struct BucketPiece {
  std::size_t item = 0, start = 0, count = 0;
};
using Bucket = std::vector<BucketPiece>;

/// \brief Cuts items of `counts[i]` values into buckets of at most `limit` values, in order.
/// \param split [in] false: items stay whole (a bucket closes before an item that would
///        overflow it; an item larger than `limit` travels alone); true: items are cut so that
///        every bucket but the last holds exactly `limit` values.
/// Items with count 0 are left out.
inline std::vector<Bucket> plan_buckets(const std::vector<std::size_t>& counts, std::size_t limit,
                                        bool split) {
  limit = std::max<std::size_t>(1, limit);
  std::vector<Bucket> buckets;
  Bucket current;
  std::size_t filled = 0;
  auto close = [&] {
    if (current.empty()) return;
    buckets.push_back(std::move(current));
    current.clear();
    filled = 0;
  };
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const std::size_t n = counts[i];
    if (n == 0) continue;
    if (!split) {
      if (!current.empty() && filled + n > limit) close();
      current.push_back({i, 0, n});
      filled += n;
      continue;
    }
    for (std::size_t start = 0; start < n;) {
      const std::size_t take = std::min(limit - filled, n - start);
      current.push_back({i, start, take});
      filled += take;
      start += take;
      if (filled == limit) close();
    }
  }
  close();
  return buckets;
}

/// Values in a bucket.
inline std::size_t bucket_count(const Bucket& b) {
  std::size_t n = 0;
  for (const auto& p : b) n += p.count;
  return n;
}

}  // namespace impl
}  // namespace kfac
