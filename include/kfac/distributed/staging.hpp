#pragma once
/// \file staging.hpp
/// \brief Hands device buffers to a communicator: directly when it can read them, else
/// through a host copy; reduced-precision payloads converted by kernels where the data lives.

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "kfac/core/comm_precision.hpp"
#include "kfac/impl/math.hpp"

namespace kfac {
namespace impl {

/// Runs `f` on a pointer the communicator may use: the buffer itself when it is host-accessible
/// or the communicator is CUDA-aware, otherwise a host copy that is written back afterwards.
template <class Exec, class Comm, class F>
void on_host(const Comm& comm, void* data, std::size_t bytes, F&& f, bool force_host = false) {
  if (host_accessible_v<Exec> || (comm.device_aware() && !force_host)) {
    f(data);
    return;
  }
  using memory_space = typename Exec::memory_space;
  Kokkos::View<char*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> d(static_cast<char*>(data), bytes);
  auto h = Kokkos::create_mirror_view(d);
  Kokkos::deep_copy(h, d);
  f(h.data());
  Kokkos::deep_copy(d, h);
}

template <class T, class = void>
struct has_sum_converted : std::false_type {};
template <class T>
struct has_sum_converted<T, std::void_t<decltype(std::declval<const T&>().sum_converted(
                                nullptr, std::size_t(0), CommPrecision::float32))>> : std::true_type {};

/// \brief Comm::sum of `count` values of `data` (in Exec's memory, `scalar_size` bytes each)
/// with a `payload` precision. A float32 or bfloat16 payload is converted by kernels on `exec`
/// into `scratch` (grown as needed, in Exec's memory) and summed with Comm::sum_converted: a
/// CUDA-aware communicator gets the device buffer (native) or the converted one (float32); a
/// bfloat16 payload, whose reduction is a host function, always goes through a host copy of
/// the 16-bit buffer, as does everything for a communicator that is not CUDA-aware. A
/// communicator without sum_converted gets a host copy of the data and converts it itself.
/// With `root` >= 0 only that rank receives the sum (Comm::sum's reduce-to-owner form).
template <class Exec, class Comm>
void sum_payload(const Exec& exec, const Comm& comm, void* data, std::size_t count, std::size_t scalar_size,
                 CommPrecision payload, Kokkos::View<char*, typename Exec::memory_space>& scratch,
                 int root = -1) {
  if (count == 0 || comm.size() == 1) return;
  exec.fence();  // the data is complete before MPI or a host copy reads it
  const bool native = payload_is_native(payload, scalar_size);
  if constexpr (!has_sum_converted<Comm>::value) {
    on_host<Exec>(comm, data, count * scalar_size, [&](void* p) { comm.sum(p, count, scalar_size, payload, root); },
                  !native);
    return;
  } else {
    if (native) {
      on_host<Exec>(comm, data, count * scalar_size, [&](void* p) { comm.sum(p, count, scalar_size, payload, root); });
      return;
    }
    const std::size_t bytes = count * payload_size(payload, scalar_size);
    if (scratch.extent(0) < bytes)
      scratch = Kokkos::View<char*, typename Exec::memory_space>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::payload"), bytes);
    pack_payload(exec, data, count, scalar_size, payload, scratch.data());
    exec.fence();
    on_host<Exec>(comm, scratch.data(), bytes, [&](void* p) { comm.sum_converted(p, count, payload, root); },
                  payload == CommPrecision::bfloat16);
    unpack_payload(exec, scratch.data(), count, scalar_size, payload, data);
    exec.fence();  // the values are read next, maybe on the host
  }
}

}  // namespace impl
}  // namespace kfac
