#pragma once
/// \file init.hpp
/// \brief Deterministic parameter initialisation.

#include "common/rng.hpp"
#include "common/tensor.hpp"

#include <cmath>

namespace nn {

/// \brief How a layer's weights are scaled, given the fan-in of one output.
enum class Init {
  he,     ///< U(-sqrt(6/fan_in), +): keeps activation variance through a following ReLU (He et al. 2015)
  lecun,  ///< U(-sqrt(3/fan_in), +): unit variance without a ReLU; used for the logits layer
};

inline double init_bound(Init init, long fan_in) {
  return std::sqrt((init == Init::he ? 6.0 : 3.0) / double(fan_in));
}

/// \brief Fills every element of a contiguous view with U(-bound, bound), in memory order.
template <class View>
void fill_uniform(const View& v, double bound, SplitMix64& rng) {
  auto host = Kokkos::create_mirror_view(v);
  float* p = host.data();
  for (std::size_t i = 0; i < host.size(); ++i) p[i] = float(rng.uniform(-bound, bound));
  Kokkos::deep_copy(v, host);
}

}  // namespace nn
