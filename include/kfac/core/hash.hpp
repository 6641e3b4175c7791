#pragma once
/// \file hash.hpp
/// \brief The one hash kfac uses (checkpoint checksums, registration and agreement checks):
/// 64-bit FNV-1a.

#include <cstddef>
#include <cstdint>
#include <string>

namespace kfac {
namespace impl {

inline std::uint64_t fnv1a_bytes(const char* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= 1099511628211ull;
  }
  return h;
}
inline std::uint64_t fnv1a(const std::string& s) { return fnv1a_bytes(s.data(), s.size()); }

}  // namespace impl
}  // namespace kfac
