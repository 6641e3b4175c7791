#pragma once
/// \file comm_precision.hpp
/// \brief Payload precision of factor averaging across ranks.

namespace kfac {

/// \brief Payload type of factor averaging (Osawa et al. 2019 communicate factors in half
/// precision). The running average itself stays in the factor's type.
enum class CommPrecision {
  native,    ///< the factor's own type
  float32,   ///< double factors travel as float
  bfloat16,  ///< 16-bit brain float; the reduction sums pairs in float and rounds back
};

}  // namespace kfac
