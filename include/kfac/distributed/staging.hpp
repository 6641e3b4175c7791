#pragma once
/// \file staging.hpp
/// \brief Hands device buffers to a communicator: directly when it can read them, else
/// through a host copy.

#include <Kokkos_Core.hpp>
#include <cstddef>

#include "kfac/impl/math.hpp"

namespace kfac {
namespace impl {

/// Runs `f` on a pointer the communicator may use: the buffer itself when it is host-accessible
/// or the communicator is CUDA-aware, otherwise a host copy that is written back afterwards.
template <class Exec, class Comm, class F>
void on_host(const Comm& comm, void* data, std::size_t bytes, F&& f) {
  if (host_accessible_v<Exec> || comm.cuda_aware()) {
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

}  // namespace impl
}  // namespace kfac
