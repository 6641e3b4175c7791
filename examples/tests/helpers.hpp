#pragma once
// Shared by the example tests: element access that works in any memory space, random tensors,
// and a small synthetic classification set that needs no files.

#include "common/dataset.hpp"
#include "common/rng.hpp"
#include "common/tensor.hpp"

#include <vector>

namespace test {

/// Element i (in memory order) of a contiguous view.
template <class View>
float get(const View& v, std::size_t i) {
  float value = 0.0f;
  Kokkos::deep_copy(value, Kokkos::subview(nn::Vector(v.data(), v.size()), i));
  return value;
}

template <class View>
void set(const View& v, std::size_t i, float value) {
  Kokkos::deep_copy(Kokkos::subview(nn::Vector(v.data(), v.size()), i), value);
}

template <class View>
std::vector<float> to_host(const View& v) {
  std::vector<float> out(v.size());
  Kokkos::View<float*, Kokkos::HostSpace> h(out.data(), out.size());
  Kokkos::deep_copy(h, nn::Vector(v.data(), v.size()));
  return out;
}

template <class View>
void from_host(const View& v, const std::vector<float>& values) {
  Kokkos::View<const float*, Kokkos::HostSpace> h(values.data(), values.size());
  Kokkos::deep_copy(nn::Vector(v.data(), v.size()), h);
}

inline std::vector<float> uniform(std::size_t n, nn::SplitMix64& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<float> v(n);
  for (auto& x : v) x = float(rng.uniform(lo, hi));
  return v;
}

inline nn::Tensor random_tensor(int n, int c, int h, int w, nn::SplitMix64& rng) {
  nn::Tensor t("test::x", n, c, h, w);
  from_host(t, uniform(t.size(), rng));
  return t;
}

/// \f$\sum_i a_i b_i\f$ in double.
template <class View>
double dot(const View& a, const View& b) {
  const auto x = to_host(a), y = to_host(b);
  double s = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) s += double(x[i]) * double(y[i]);
  return s;
}

/// Ten classes of 1x28x28 "images": a random prototype per class plus noise, with pixel scales
/// spread over two orders of magnitude, so the problem is learnable but badly conditioned.
inline nn::Dataset synthetic(int n, std::uint64_t seed, double noise = 1.0) {
  nn::SplitMix64 rng(seed);
  std::vector<float> proto(10 * 784), scale(784);
  for (auto& p : proto) p = float(rng.normal());
  for (auto& s : scale) s = float(std::pow(10.0, rng.uniform(-1.0, 1.0)));
  std::vector<float> pixels(std::size_t(n) * 784);
  std::vector<int> labels(n);
  for (int i = 0; i < n; ++i) {
    labels[i] = int(rng.below(10));
    for (int k = 0; k < 784; ++k)
      pixels[std::size_t(i) * 784 + k] = scale[k] * (proto[labels[i] * 784 + k] + float(noise * rng.normal()));
  }
  return nn::make_dataset(pixels, labels, 1, 28, 28, 10);
}

}  // namespace test
