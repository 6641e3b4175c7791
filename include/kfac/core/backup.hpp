#pragma once
/// \file backup.hpp
/// \brief Copies of state buffers taken before a step changes them, so that a step that fails
/// can put everything back (the "a throwing call changes nothing" guarantee).

#include <Kokkos_Core.hpp>
#include <vector>

#include "kfac/core/block.hpp"

namespace kfac {
namespace impl {

/// A device-to-device copy of `b`, in a view of its own.
template <class Exec>
Kokkos::View<char*, typename Exec::memory_space> copy_of(const Exec& exec, const Buffer& b) {
  Kokkos::View<char*, typename Exec::memory_space> copy(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::backup"), b.bytes());
  Kokkos::deep_copy(exec, copy, Kokkos::View<char*, typename Exec::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(static_cast<char*>(b.data), b.bytes()));
  return copy;
}

/// Copies the bytes of each buffer of `from` into the equally sized buffer of `to` (device to
/// device).
template <class Exec>
void copy_into(const Exec& exec, const std::vector<Buffer>& from, const std::vector<Buffer>& to) {
  using U = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
  for (std::size_t k = 0; k < from.size() && k < to.size(); ++k)
    Kokkos::deep_copy(exec, Kokkos::View<char*, typename Exec::memory_space, U>(static_cast<char*>(to[k].data), to[k].bytes()),
                      Kokkos::View<const char*, typename Exec::memory_space, U>(static_cast<const char*>(from[k].data), from[k].bytes()));
}

/// Sets every byte of `b` to 0 (0.0 in float and double).
template <class Exec>
void zero(const Exec& exec, const Buffer& b) {
  Kokkos::deep_copy(exec, Kokkos::View<char*, typename Exec::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(static_cast<char*>(b.data), b.bytes()), char(0));
}

/// A copy of `b` (float or double values) times `scale`, in a view of its own.
template <class Exec>
Kokkos::View<char*, typename Exec::memory_space> scaled_copy_of(const Exec& exec, const Buffer& b, double scale) {
  auto copy = copy_of(exec, b);
  const std::size_t n = b.count;
  if (b.scalar_size == 8) {
    auto* p = reinterpret_cast<double*>(copy.data());
    Kokkos::parallel_for("kfac::statistics::scale", Kokkos::RangePolicy<Exec>(exec, 0, n),
                         KOKKOS_LAMBDA(std::size_t i) { p[i] *= scale; });
  } else {
    auto* p = reinterpret_cast<float*>(copy.data());
    const float s = float(scale);
    Kokkos::parallel_for("kfac::statistics::scale", Kokkos::RangePolicy<Exec>(exec, 0, n),
                         KOKKOS_LAMBDA(std::size_t i) { p[i] *= s; });
  }
  return copy;
}

template <class Exec>
class StateBackup {
 public:
  using memory_space = typename Exec::memory_space;
  /// Copies `b` (device to device).
  void save(const Exec& exec, const Buffer& b) {
    if (b.bytes() == 0) return;
    saved_.push_back({b, copy_of(exec, b)});
  }
  /// Writes every saved copy back, newest last-saved first, then forgets them.
  void restore(const Exec& exec) {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) Kokkos::deep_copy(exec, view(it->first), it->second);
    exec.fence();
    saved_.clear();
  }
  void clear() { saved_.clear(); }
  /// The saved copy of `b`, or nullptr when `b` was not saved.
  const void* copy_for(const Buffer& b) const {
    for (const auto& s : saved_)
      if (s.first.data == b.data && s.first.bytes() == b.bytes()) return s.second.data();
    return nullptr;
  }

 private:
  static Kokkos::View<char*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> view(const Buffer& b) {
    return Kokkos::View<char*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(static_cast<char*>(b.data), b.bytes());
  }
  std::vector<std::pair<Buffer, Kokkos::View<char*, memory_space>>> saved_;
};

}  // namespace impl
}  // namespace kfac
