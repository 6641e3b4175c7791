#pragma once
/// \file rng.hpp
/// \brief A small seeded generator, so that initialisation and shuffling repeat exactly.

#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace nn {

/// \brief SplitMix64 (Steele, Lea and Flood 2014): one 64-bit state, passes BigCrush, and any
/// seed (zero included) is a good one, which is all a deterministic demo needs.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  /// \brief Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }

  /// \brief Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

  /// \brief Standard normal by Box-Muller (one draw per call; the spare is dropped for simplicity).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

  /// \brief Uniform integer in [0, n), without modulo bias.
  std::uint64_t below(std::uint64_t n) {
    const std::uint64_t limit = ~std::uint64_t(0) - (~std::uint64_t(0) % n);
    std::uint64_t r = next();
    while (r >= limit) r = next();
    return r % n;
  }

 private:
  std::uint64_t state_;
};

/// \brief A seed for a named purpose (e.g. the shuffle of epoch 3), derived from the run seed so
/// that streams do not overlap.
inline std::uint64_t derive_seed(std::uint64_t seed, std::uint64_t purpose, std::uint64_t index = 0) {
  SplitMix64 g(seed ^ (purpose * 0xD1B54A32D192ED03ull) ^ (index * 0x8CB92BA72F3D8DD7ull));
  return g.next();
}

/// \brief The permutation 0..n-1 shuffled by Fisher-Yates.
inline std::vector<int> permutation(int n, SplitMix64& rng) {
  std::vector<int> p(n);
  std::iota(p.begin(), p.end(), 0);
  for (int i = n - 1; i > 0; --i) {
    const int j = int(rng.below(std::uint64_t(i) + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

}  // namespace nn
