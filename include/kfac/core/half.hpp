#pragma once
/// \file half.hpp
/// \brief IEEE 754 binary16 storage for Kronecker factors (Osawa et al. 2019 keep factors in
/// half precision), on every backend.
///
/// `kfac::Half` is a storage type, not an arithmetic one: two bytes holding binary16 bits,
/// converted to float (exactly) for every computation and back with round-to-nearest-even.
/// The conversions are written out in integer arithmetic, so Serial, OpenMP and CUDA store the
/// same bits for the same float; Kokkos' `half_t` is only a real two-byte type on some builds
/// (it is `float` in disguise on Kokkos 3.4's Serial and OpenMP), see precision.hpp.

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace kfac {
namespace impl {

/// float -> binary16 bits, rounded to nearest even; overflow to infinity, NaN stays NaN
/// (quiet, sign kept). Host and device.
KOKKOS_INLINE_FUNCTION std::uint16_t to_half_bits(float f) {
  std::uint32_t u;
  memcpy(&u, &f, 4);
  const std::uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return std::uint16_t(sign | (a > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (a >= 0x477FF000u) return std::uint16_t(sign | 0x7C00u);  // >= 65520: rounds past 65504
  std::uint32_t r, rem, halfway;
  if (a < 0x38800000u) {  // below 2^-14: a subnormal half (units of 2^-24) or zero
    if (a <= 0x33000000u) return std::uint16_t(sign);  // <= 2^-25 rounds to (even) zero
    const std::uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - e;
    r = m >> shift;
    rem = m & ((1u << shift) - 1);
    halfway = 1u << (shift - 1);
  } else {  // normal: rebias the exponent (127 - 15) and drop 13 mantissa bits
    const std::uint32_t b = a - 0x38000000u;
    r = b >> 13;
    rem = b & 0x1FFFu;
    halfway = 0x1000u;
  }
  if (rem > halfway || (rem == halfway && (r & 1u))) ++r;  // a carry moves into the exponent
  return std::uint16_t(sign | r);
}

/// binary16 bits -> float, exactly. Host and device.
KOKKOS_INLINE_FUNCTION float from_half_bits(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  std::uint32_t u;
  if (e == 0x1Fu) {
    u = sign | 0x7F800000u | (m << 13);
  } else if (e == 0) {
    const float v = float(m) * 5.9604644775390625e-08f;  // m 2^-24, exact in float
    return sign ? -v : v;
  } else {
    u = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

}  // namespace impl

/// \brief Two bytes of IEEE binary16: a factor storage type (`Precision<Half, float>`).
/// Converts explicitly from float (rounding to nearest even) and implicitly to float (exact).
struct Half {
  std::uint16_t bits;
  Half() = default;
  KOKKOS_INLINE_FUNCTION explicit Half(float f) : bits(impl::to_half_bits(f)) {}
  KOKKOS_INLINE_FUNCTION operator float() const { return impl::from_half_bits(bits); }
  /// Largest finite value, 65504.
  static constexpr double max() { return 65504.0; }
};
static_assert(sizeof(Half) == 2 && std::is_trivially_copyable<Half>::value, "kfac::Half: 2 bytes");

namespace impl {
/// The type factor statistics are computed in before they are stored: float for Half.
template <class F>
using arithmetic_t = std::conditional_t<std::is_same<F, Half>::value, float, F>;

/// Largest finite value of a factor storage type.
template <class F>
constexpr double largest_value() {
  if constexpr (std::is_same<F, Half>::value) return Half::max();
  else return double(std::numeric_limits<F>::max());
}
}  // namespace impl

}  // namespace kfac
