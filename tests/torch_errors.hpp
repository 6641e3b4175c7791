#pragma once
// The LibTorch adapter tests' view of a kfac::Error: its message (and the layer it names), or a
// marker when none was thrown.
#include <kfac/error.hpp>
#include <string>

namespace kfac_test {

template <class F>
std::string error_of(F&& f, std::string* layer = nullptr) {
  try {
    f();
  } catch (const kfac::Error& e) {
    if (layer) *layer = e.layer();
    return e.what();
  }
  return "(no kfac::Error)";
}
inline bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace kfac_test
