#pragma once
/// \file comm_precision.hpp
/// \brief Payload precision of factor averaging across ranks, and the payload conversions
/// (host and device-callable, and as kernels in the data's memory space).

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kfac {

/// \brief Payload type of factor averaging (Osawa et al. 2019 communicate factors in half
/// precision). The running average itself stays in the factor's type.
enum class CommPrecision {
  native,    ///< the factor's own type
  float32,   ///< double factors travel as float
  bfloat16,  ///< 16-bit brain float; the reduction sums pairs in float and rounds back
};

namespace impl {

/// float -> bfloat16 bits, rounded to nearest even (host and device).
KOKKOS_INLINE_FUNCTION std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}
/// bfloat16 bits -> float (exact; host and device).
KOKKOS_INLINE_FUNCTION float from_bf16(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/// True when a payload needs no conversion: the factor's own type travels.
inline bool payload_is_native(CommPrecision payload, std::size_t scalar_size) {
  return payload == CommPrecision::native || (payload == CommPrecision::float32 && scalar_size == 4);
}
/// Bytes of one payload value (the converted type for float32 and bfloat16).
inline std::size_t payload_size(CommPrecision payload, std::size_t scalar_size) {
  return payload_is_native(payload, scalar_size) ? scalar_size : payload == CommPrecision::float32 ? 4 : 2;
}

/// \brief Converts `count` values of `data` (double or float, `scalar_size` bytes) to the
/// payload type into `out` (float for float32, bfloat16 bits for bfloat16), by a kernel on
/// `exec`; both pointers in Exec's memory. The same bits as the host loops of MpiComm::sum.
template <class Exec>
void pack_payload(const Exec& exec, const void* data, std::size_t count, std::size_t scalar_size,
                  CommPrecision payload, void* out) {
  using Range = Kokkos::RangePolicy<Exec>;
  const auto* d = static_cast<const double*>(data);
  const auto* f = static_cast<const float*>(data);
  if (payload == CommPrecision::float32) {
    auto* o = static_cast<float*>(out);
    Kokkos::parallel_for("kfac::payload::to_float", Range(exec, 0, count),
                         KOKKOS_LAMBDA(std::size_t i) { o[i] = float(d[i]); });
  } else {
    auto* o = static_cast<std::uint16_t*>(out);
    const bool wide = scalar_size == 8;
    Kokkos::parallel_for("kfac::payload::to_bf16", Range(exec, 0, count),
                         KOKKOS_LAMBDA(std::size_t i) { o[i] = to_bf16(wide ? float(d[i]) : f[i]); });
  }
}

/// The reverse of pack_payload: the summed payload `in` back into `data`'s type.
template <class Exec>
void unpack_payload(const Exec& exec, const void* in, std::size_t count, std::size_t scalar_size,
                    CommPrecision payload, void* data) {
  using Range = Kokkos::RangePolicy<Exec>;
  auto* d = static_cast<double*>(data);
  auto* f = static_cast<float*>(data);
  if (payload == CommPrecision::float32) {
    const auto* p = static_cast<const float*>(in);
    Kokkos::parallel_for("kfac::payload::from_float", Range(exec, 0, count),
                         KOKKOS_LAMBDA(std::size_t i) { d[i] = double(p[i]); });
  } else {
    const auto* p = static_cast<const std::uint16_t*>(in);
    const bool wide = scalar_size == 8;
    Kokkos::parallel_for(
        "kfac::payload::from_bf16", Range(exec, 0, count), KOKKOS_LAMBDA(std::size_t i) {
          if (wide)
            d[i] = double(from_bf16(p[i]));
          else
            f[i] = from_bf16(p[i]);
        });
  }
}

}  // namespace impl
}  // namespace kfac
