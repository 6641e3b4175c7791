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

/// Value i of `data` (double when `wide`, else float) as a payload value into `out[i]`: a
/// float (`to_float`: the float32 payload of double data) or bfloat16 bits. The one
/// definition of the conversion, for the kernels and the host loops alike.
KOKKOS_INLINE_FUNCTION void pack_value(const void* data, bool wide, bool to_float, void* out, std::size_t i) {
  const float v = wide ? float(static_cast<const double*>(data)[i]) : static_cast<const float*>(data)[i];
  if (to_float) static_cast<float*>(out)[i] = v;
  else static_cast<std::uint16_t*>(out)[i] = to_bf16(v);
}
/// The reverse of pack_value: payload value `in[i]` (a float when `from_float`, else bfloat16
/// bits) into `data[i]` (double when `wide`, else float).
KOKKOS_INLINE_FUNCTION void unpack_value(const void* in, bool wide, bool from_float, void* data, std::size_t i) {
  const float v = from_float ? static_cast<const float*>(in)[i] : from_bf16(static_cast<const std::uint16_t*>(in)[i]);
  if (wide) static_cast<double*>(data)[i] = double(v);
  else static_cast<float*>(data)[i] = v;
}

/// \brief Converts `count` values of `data` (double or float, `scalar_size` bytes) to the
/// payload type into `out` (float for float32, bfloat16 bits for bfloat16), by a kernel on
/// `exec`; both pointers in Exec's memory.
template <class Exec>
void pack_payload(const Exec& exec, const void* data, std::size_t count, std::size_t scalar_size,
                  CommPrecision payload, void* out) {
  const bool wide = scalar_size == 8, to_float = payload == CommPrecision::float32;
  Kokkos::parallel_for("kfac::payload::pack", Kokkos::RangePolicy<Exec>(exec, 0, count),
                       KOKKOS_LAMBDA(std::size_t i) { pack_value(data, wide, to_float, out, i); });
}
/// The reverse of pack_payload: the summed payload `in` back into `data`'s type.
template <class Exec>
void unpack_payload(const Exec& exec, const void* in, std::size_t count, std::size_t scalar_size,
                    CommPrecision payload, void* data) {
  const bool wide = scalar_size == 8, from_float = payload == CommPrecision::float32;
  Kokkos::parallel_for("kfac::payload::unpack", Kokkos::RangePolicy<Exec>(exec, 0, count),
                       KOKKOS_LAMBDA(std::size_t i) { unpack_value(in, wide, from_float, data, i); });
}
/// pack_payload on the calling thread, for host memory outside Kokkos (MpiComm::sum).
inline void pack_payload_host(const void* data, std::size_t count, std::size_t scalar_size, CommPrecision payload,
                              void* out) {
  for (std::size_t i = 0; i < count; ++i) pack_value(data, scalar_size == 8, payload == CommPrecision::float32, out, i);
}
/// unpack_payload on the calling thread, for host memory outside Kokkos (MpiComm::sum).
inline void unpack_payload_host(const void* in, std::size_t count, std::size_t scalar_size, CommPrecision payload,
                                void* data) {
  for (std::size_t i = 0; i < count; ++i) unpack_value(in, scalar_size == 8, payload == CommPrecision::float32, data, i);
}

}  // namespace impl
}  // namespace kfac
