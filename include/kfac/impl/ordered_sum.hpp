#pragma once
/// \file ordered_sum.hpp
/// \brief Floating-point sums whose order kfac fixes itself, so that a host backend's result does
/// not depend on the backend, the thread count or the Kokkos version; and the two checks of a
/// view built on them (sum of squares, count of non-finite entries).
///
/// Kokkos' parallel_reduce promises a sum, not an order: Kokkos 3.4's OpenMP combines per-thread
/// partials, and Kokkos 4's OpenMP already differs from Serial in the last bit with one thread.
/// ordered_sum cuts the terms (column-major over rows x cols) into chunks of kOrderedSumChunk,
/// sums each chunk from its first term to its last (one chunk per parallel iteration), and adds
/// the chunks' sums in chunk order on the host. Every step depends on the number of terms only,
/// so Serial, OpenMP and Threads give the same bits on Kokkos 3.4 and 4.x alike. Up to one chunk
/// it is exactly the left-to-right sum that Kokkos::Serial's parallel_reduce computes, so results
/// (and the checkpoint fixtures written with it) do not move on Serial; above it the chunks give
/// OpenMP its parallelism, as parallel_reduce did. A caller that wants more instruction-level
/// parallelism makes each term a short sum of its own (sum_of_squares: blocks of 8). On a device backend (CUDA) it is a parallel_reduce: agreement with the host there
/// is a tolerance anyway (cuBLAS and cuSOLVER replace OpenBLAS and LAPACK; docs/backends.md).

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <vector>

#include "kfac/impl/math.hpp"

namespace kfac {
namespace impl {

/// Terms per chunk: part of the sum's definition (another value gives other last bits, the same
/// on every host backend).
constexpr long kOrderedSumChunk = 4096;
/// Chunks one parallel iteration sums side by side (speed only: the bits do not depend on it).
constexpr long kOrderedSumLanes = 2;

/// \brief \f$\sum_{i < cols} \sum_{j < rows} f(j, i)\f$ in double, in the fixed order above.
/// \param exec [in] the execution space instance the terms are computed on
/// \param label [in] the kernel's label (`kfac::<area>::<op>`)
/// \param rows [in] the range of j
/// \param cols [in] the range of i
/// \param f [in] `double f(long j, long i)`, callable on Exec (a KOKKOS_LAMBDA)
template <class Exec, class F>
double ordered_sum(const Exec& exec, const char* label, long rows, long cols, const F& f) {
  const long n = rows * cols;
  if (n <= 0) return 0;
  if constexpr (host_accessible_v<Exec>) {
    // Each chunk is one chain of dependent additions, which runs at the adder's latency. One
    // parallel iteration advances kOrderedSumLanes whole chunks in lockstep, each with its own
    // accumulator: the chains interleave (the adder's throughput instead of its latency) while
    // every chunk is still summed from its first term to its last, so the bits do not change.
    const long chunks = (n + kOrderedSumChunk - 1) / kOrderedSumChunk, full = n / kOrderedSumChunk;
    const long groups = (chunks + kOrderedSumLanes - 1) / kOrderedSumLanes;
    std::vector<double> part(std::size_t(chunks), 0.0);
    double* p = part.data();
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<Exec>(exec, 0, groups), KOKKOS_LAMBDA(long group) {
          const long c0 = group * kOrderedSumLanes;
          if (c0 + kOrderedSumLanes <= full && rows >= kOrderedSumChunk / 16) {
            long j[kOrderedSumLanes], i[kOrderedSumLanes];
            double s[kOrderedSumLanes];
            for (long c = 0; c < kOrderedSumLanes; ++c) {
              j[c] = (c0 + c) * kOrderedSumChunk % rows;
              i[c] = (c0 + c) * kOrderedSumChunk / rows;
              s[c] = 0;
            }
            // Segments in which no lane leaves its column: no index bookkeeping inside.
            for (long done = 0; done < kOrderedSumChunk;) {
              long step = kOrderedSumChunk - done;
              for (long c = 0; c < kOrderedSumLanes; ++c) step = rows - j[c] < step ? rows - j[c] : step;
              for (long t = 0; t < step; ++t)
                for (long c = 0; c < kOrderedSumLanes; ++c) s[c] += f(j[c] + t, i[c]);
              for (long c = 0; c < kOrderedSumLanes; ++c)
                if ((j[c] += step) == rows) {
                  j[c] = 0;
                  ++i[c];
                }
              done += step;
            }
            for (long c = 0; c < kOrderedSumLanes; ++c) p[c0 + c] = s[c];
            return;
          }
          for (long c = c0; c < c0 + kOrderedSumLanes && c < chunks; ++c) {  // one chunk at a time
            const long begin = c * kOrderedSumChunk, end = begin + kOrderedSumChunk < n ? begin + kOrderedSumChunk : n;
            long j = begin % rows, i = begin / rows;
            double s = 0;
            for (long t = begin; t < end; ++t) {
              s += f(j, i);
              if (++j == rows) {
                j = 0;
                ++i;
              }
            }
            p[c] = s;
          }
        });
    exec.fence();  // the host reads the partial sums
    double s = 0;
    for (const double x : part) s += x;
    return s;
  } else {
    double s = 0;
    Kokkos::parallel_reduce(
        label, Kokkos::RangePolicy<Exec>(exec, 0, n),
        KOKKOS_LAMBDA(long t, double& acc) { acc += f(t % rows, t / rows); }, s);
    return s;
  }
}

/// \brief \f$\sum_{i < n} f(i)\f$ in double, in ordered_sum's fixed order.
/// \param exec [in] the execution space instance the terms are computed on
/// \param label [in] the kernel's label (`kfac::<area>::<op>`)
/// \param n [in] the number of terms
/// \param f [in] `double f(long i)`, callable on Exec
template <class Exec, class F>
double ordered_sum(const Exec& exec, const char* label, long n, const F& f) {
  return ordered_sum(exec, label, n, 1L, KOKKOS_LAMBDA(long j, long) { return f(j); });
}

/// Sum of squares of a matrix's entries, in double.
template <class Exec, class M>
double sum_of_squares(const Exec& exec, const M& m) {
  // Eight-term blocks as the terms: a plain reduction is one dependent chain of additions on a
  // serial backend and ran 5x slower than this (as long as the copy it checks); ordered_sum's
  // fixed order makes the result the same on every host backend.
  constexpr long w = 8;
  const long size = long(m.span()), full = size / w;
  const auto* p = m.data();
  return ordered_sum(exec, "kfac::check::sum_of_squares", full + 1, KOKKOS_LAMBDA(long b) {
    const long end = b < full ? (b + 1) * w : size;
    double part = 0;
    for (long i = b * w; i < end; ++i) part += double(p[i]) * double(p[i]);
    return part;
  });
}

/// Counts the non-finite entries of any view, on its execution space.
template <class Exec, class V>
long count_nonfinite(const Exec& exec, const V& v) {
  long bad = 0;
  const auto* p = v.data();
  Kokkos::parallel_reduce(
      "kfac::check::nonfinite", Kokkos::RangePolicy<Exec>(exec, 0, long(v.span())),
      KOKKOS_LAMBDA(long i, long& s) { s += finite_(p[i]) ? 0 : 1; }, bad);
  return bad;
}

/// Counts the entries of a view that are NaN/Inf or of magnitude above `limit`, on its
/// execution space (the pass of count_nonfinite, one comparison more).
template <class Exec, class V>
long count_beyond(const Exec& exec, const V& v, double limit) {
  long bad = 0;
  const auto* p = v.data();
  Kokkos::parallel_reduce(
      "kfac::check::beyond", Kokkos::RangePolicy<Exec>(exec, 0, long(v.span())),
      KOKKOS_LAMBDA(long i, long& s) {
        const double x = double(p[i]);
        s += (x <= limit && x >= -limit) ? 0 : 1;
      },
      bad);
  return bad;
}

}  // namespace impl
}  // namespace kfac
