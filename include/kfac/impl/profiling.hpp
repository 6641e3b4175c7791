#pragma once
/// \file profiling.hpp
/// \brief Named profiling regions (Kokkos Tools), so that a tool or a benchmark can time the
/// phases of a step: "kfac::step::statistics", "kfac::step::decompose",
/// "kfac::step::precondition", "kfac::step::kl_clip". Without a tool attached a region costs
/// a null-pointer test.

#include <Kokkos_Core.hpp>

namespace kfac {
namespace impl {

/// Pushes a region for its lifetime.
class ScopedRegion {
 public:
  explicit ScopedRegion(const char* name) { Kokkos::Profiling::pushRegion(name); }
  ~ScopedRegion() { Kokkos::Profiling::popRegion(); }
  ScopedRegion(const ScopedRegion&) = delete;
  ScopedRegion& operator=(const ScopedRegion&) = delete;
};

}  // namespace impl
}  // namespace kfac
