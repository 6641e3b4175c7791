#pragma once
/// \file buffer.hpp
/// \brief The views of a block's state that distribution and checkpoints work on: flat buffers,
/// running factors in their payload form, and the copy between a factor and a payload.
#include <Kokkos_Core.hpp>

#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

#include "kfac/config.hpp"

namespace kfac {
namespace impl {

/// A contiguous buffer of a layer's state, for communication and checkpoints.
struct Buffer {
  void* data = nullptr;
  std::size_t count = 0;       ///< number of scalars
  std::size_t scalar_size = 0; ///< 4 (float) or 8 (double)
  std::size_t bytes() const { return count * scalar_size; }
};

/// Shares unit `unit` of one layer (its buffers) from a background thread
/// (Kaisa::background_sharing); returns {bytes this rank sent, MPI calls}, which the calling
/// thread counts later. Empty: the distribution shares nothing in the background.
using BackgroundSharer = std::function<std::pair<std::size_t, std::size_t>(int unit, const std::vector<Buffer>&)>;

/// A running factor as communicated: an n x n column-major matrix sent whole or as its packed
/// upper triangle (n(n+1)/2 values), or a flat vector (diagonal, unit-wise: `n` values).
struct FactorBuffer {
  Buffer storage;
  index_t n = 0;
  bool matrix = false;  ///< n x n matrix (else a flat vector of n values)
  bool packed = false;  ///< matrix travels as its upper triangle
  const void* base = nullptr;  ///< the value before this step's update, to send the increment
  /// The one rank that needs the average (reduce-to-owner; -1: every rank). Such a buffer
  /// travels as it is, and its owner reads base + the average (base: decay x the old value).
  int owner = -1;
  std::size_t payload_count() const {
    return matrix ? (packed ? std::size_t(n) * (n + 1) / 2 : std::size_t(n) * n) : std::size_t(n);
  }
};

/// (value count, scalar size) of one state buffer, known before it is allocated.
using BufferShape = std::pair<std::size_t, std::size_t>;

template <class V>
Buffer buffer_of(const V& v) {
  return Buffer{const_cast<void*>(static_cast<const void*>(v.data())), v.span(),
                sizeof(typename V::non_const_value_type)};
}

/// Copies factor `f` to (`to_flat`) or from a flat buffer starting at `offset`, in its payload
/// form: the packed upper triangle column by column (A(0,0), A(0,1), A(1,1), A(0,2), ...), the
/// whole column-major matrix, or the flat vector. Values read from the flat buffer are scaled.
/// `S` is the factor's storage type, `T` the flat buffer's arithmetic type (they differ for
/// kfac::Half factors, which travel as float).
///
/// With a `base` (a buffer of f's shape: the value before this step's update), the increment
/// travels instead: to_flat writes f - base, and reading sets f = base + scale * flat. Averaging
/// increments in a reduced-precision payload rounds the increment, not the running average, so
/// the average converges to the native one (rounding the average itself stalls it).
template <class Exec, class T, class S = T, class Flat>
void transfer_factor(const Exec& exec, const FactorBuffer& f, const Flat& flat, std::size_t offset,
                     bool to_flat, T scale = T(1), const S* base = nullptr) {
  S* data = static_cast<S*>(f.storage.data);
  const std::size_t o = offset;
  const bool inc = base != nullptr;
  if (!f.matrix) {
    Kokkos::parallel_for(
        "kfac::comm::transfer_vector", Kokkos::RangePolicy<Exec>(exec, 0, f.n), KOKKOS_LAMBDA(int i) {
          const T b = inc ? T(base[i]) : T(0);
          if (to_flat) flat(o + i) = T(data[i]) - b; else data[i] = S(b + T(flat(o + i)) * scale);
        });
    return;
  }
  using M = Kokkos::View<S**, Kokkos::LayoutLeft, typename Exec::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  M m(data, f.n, f.n);
  M bm(const_cast<S*>(inc ? base : data), f.n, f.n);
  const int n = f.n;
  const bool packed = f.packed;
  Kokkos::parallel_for(
      "kfac::comm::transfer_matrix", Kokkos::RangePolicy<Exec>(exec, 0, n), KOKKOS_LAMBDA(int j) {
        const std::size_t col = packed ? o + std::size_t(j) * (j + 1) / 2 : o + std::size_t(j) * n;
        const int rows = packed ? j + 1 : n;
        for (int i = 0; i < rows; ++i) {
          const T b = inc ? T(bm(i, j)) : T(0);
          if (to_flat) flat(col + i) = T(m(i, j)) - b; else m(i, j) = S(b + T(flat(col + i)) * scale);
        }
      });
}

}  // namespace impl
}  // namespace kfac
