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
/// \param counts [in] each item's number of values
/// \param limit [in] the most values of one bucket (0 is taken as 1)
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

/// The scalar a factor of `storage` bytes travels as: kfac::Half (2) as float, others as stored.
inline std::size_t flat_scalar_size(std::size_t storage) { return storage == 2 ? 4 : storage; }

/// One factor-averaging collective: buffers of one scalar size summed to one owner (-1: to
/// every rank). `items` index the caller's list; the pieces of `bucket` index `items`.
struct FactorBucket {
  std::size_t scalar_size = 0;
  int owner = -1;
  std::vector<std::size_t> items;
  Bucket bucket;
};

/// \brief The factor-averaging collectives of factors with `counts[i]` payload values of
/// `sizes[i]` bytes each, summed to `owners[i]` (-1: every rank): per storage size (binary16,
/// float, double), the factors of every rank first, then owner by owner in rank order, each group cut
/// by plan_buckets into buckets of at most `bucket_bytes` of the flat scalar (items kept whole). kfac::Kaisa sends
/// exactly these, and the cost model counts them.
inline std::vector<FactorBucket> factor_buckets(const std::vector<std::size_t>& counts,
                                                const std::vector<std::size_t>& sizes,
                                                const std::vector<int>& owners, std::size_t bucket_bytes) {
  std::vector<FactorBucket> out;
  int last = -1;
  for (int o : owners) last = std::max(last, o);
  for (std::size_t size : {std::size_t(2), std::size_t(4), std::size_t(8)})
    for (int owner = -1; owner <= last; ++owner) {
      std::vector<std::size_t> items, c;
      for (std::size_t i = 0; i < counts.size(); ++i)
        if (sizes[i] == size && owners[i] == owner) {
          items.push_back(i);
          c.push_back(counts[i]);
        }
      for (auto& b : plan_buckets(c, bucket_bytes / flat_scalar_size(size), false))
        out.push_back({size, owner, items, std::move(b)});
    }
  return out;
}

/// \brief The rank each of one layer's averaged buffers is reduced to under reduce-to-owner
/// (-1: every rank), given the decomposer of each buffer's unit. Only buffers that are the
/// block's decomposable units (`units`) and not binary16 (`scalar_size` 2, summed to every
/// rank and rounded once) go to an owner; and when decomposing one unit reads the others
/// (`coupled`: pi-damping reads both factors' traces) only if one rank decomposes them all.
/// The one rule Kaisa's factor averaging and the cost model both follow.
inline std::vector<int> factor_owners_of(const std::vector<int>& decomposers, bool units, bool coupled,
                                         std::size_t scalar_size) {
  std::vector<int> owners(decomposers.size(), -1);
  if (!units || scalar_size == 2) return owners;
  for (int d : decomposers)
    if (coupled && d != decomposers.front()) return owners;
  return decomposers;
}

}  // namespace impl
}  // namespace kfac
