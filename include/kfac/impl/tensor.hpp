#pragma once
// The type-erased forms in which observations and gradients cross into a layer.
#include <Kokkos_Core.hpp>
#include <array>
#include <string>

namespace kfac {
namespace impl {

/// A rank-4 row-major view; rank-2 (batch, features) data is seen as (batch, features, 1, 1)
/// and rank-3 (batch, tokens, features) data as (batch, tokens, features, 1), which have the
/// same memory layout.
template <class Scalar, class Exec>
using Tensor4 = Kokkos::View<const Scalar****, Kokkos::LayoutRight, typename Exec::memory_space,
                             Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
/// A gradient seen as a row-major matrix (rows = outputs, cols = flattened inputs).
template <class Scalar, class Exec>
using GradMatrix = Kokkos::View<Scalar**, Kokkos::LayoutRight, typename Exec::memory_space,
                                Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class Scalar, class Exec>
using GradVector = Kokkos::View<Scalar*, Kokkos::LayoutRight, typename Exec::memory_space,
                                Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// The extents of an observation seen as rank 4 (trailing 1s), and the rank it was handed in
/// with (2, 3 or 4), which tells a (batch, tokens, 1) sequence from a (batch, features) matrix.
struct Extents : std::array<long, 4> {
  int rank = 4;
  std::string str() const;
};

inline std::string extents_string(const long* e, int rank) {
  std::string s = "(";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(e[i]);
  return s + ")";
}

inline std::string Extents::str() const { return extents_string(data(), rank); }

/// Whether extents are those of feature rows of `width` values: rank 2 (batch, width), rank 3
/// (batch, tokens, width), or rank 4 (batch, width, 1, 1); never a rank-1 view (token ids).
inline bool are_feature_rows(const Extents& e, long width) {
  if (e.rank < 2) return false;
  if (e.rank == 3) return e[2] == width && e[3] == 1;
  return e[1] == width && e[2] == 1 && e[3] == 1;
}
/// Tokens per sample of feature rows that passed are_feature_rows: the middle extent of a
/// (batch, tokens, width) view, else 1. Needs no rank: a (batch, width) view seen as (batch,
/// width, 1, 1) has e[2] = 1, which equals the width only when the width is 1, and then e[1] = 1.
inline long tokens_of(const Extents& e, long width) { return e[2] == width && e[3] == 1 ? e[1] : 1; }

template <class T4>
Extents extents_of(const T4& t, int rank = 4) {
  return {{long(t.extent(0)), long(t.extent(1)), long(t.extent(2)), long(t.extent(3))}, rank};
}

/// dst(i) = src(i) converted to dst's scalar, for i < src.extent(0) (dst at least as long).
template <class Exec, class Src, class Dst>
void copy_converted(const Exec& exec, const char* label, const Src& src, const Dst& dst) {
  using T = typename Dst::non_const_value_type;
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Exec>(exec, 0, int(src.extent(0))), KOKKOS_LAMBDA(int i) { dst(i) = T(src(i)); });
}

/// Per unit c of a normalization layer, adds the sums over `n` samples of the products of the
/// per-sample gradients \f$g^\gamma = \sum_p s\,dy\,\hat x\f$ and \f$g^\beta = \sum_p s\,dy\f$ (p over
/// `positions` per sample) to `sums(c, 0..2)` = (gg, gb, bb). Value (k, c, p) of x̂ and dy sits at
/// k * sample_stride + c * unit_stride + p * position_stride. Shared by BatchNorm2d (units =
/// channels, positions = H W) and LayerNorm (units = features, positions = tokens).
template <class Exec, class T, class Sums>
void add_unit_products(const Exec& exec, const char* label, const T* xs, const T* gs, double scale, int n, int units,
                       int positions, std::size_t sample_stride, std::size_t unit_stride, std::size_t position_stride,
                       const Sums& sums) {
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Exec>(exec, 0, units), KOKKOS_LAMBDA(int c) {
        double gg = 0, gb = 0, bb = 0;
        for (int k = 0; k < n; ++k) {
          double g_gamma = 0, g_beta = 0;
          for (int p = 0; p < positions; ++p) {
            const std::size_t at = k * sample_stride + c * unit_stride + p * position_stride;
            const double g = scale * double(gs[at]);
            g_gamma += g * double(xs[at]);
            g_beta += g;
          }
          gg += g_gamma * g_gamma;
          gb += g_gamma * g_beta;
          bb += g_beta * g_beta;
        }
        sums(c, 0) += gg;
        sums(c, 1) += gb;
        sums(c, 2) += bb;
      });
}

}  // namespace impl
}  // namespace kfac
