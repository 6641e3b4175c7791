#pragma once
/// \file error.hpp
/// \brief The one exception type kfac throws.

#include <stdexcept>
#include <string>

namespace kfac {

/// \brief Thrown on any misuse or failure detected at kfac's public boundary.
///
/// The message names the layer (when there is one) and the violated expectation. Every
/// function that throws leaves the preconditioner in the state it had before the call.
class Error : public std::runtime_error {
 public:
  Error(std::string layer, const std::string& what)
      : std::runtime_error(layer.empty() ? "kfac: " + what
                                         : "kfac: layer '" + layer + "': " + what),
        layer_(std::move(layer)) {}

  /// \brief The layer the error is about; empty for errors that concern no single layer.
  const std::string& layer() const noexcept { return layer_; }

 private:
  std::string layer_;
};

namespace impl {
/// The message of `e` without the "kfac: layer '...': " prefix Error adds.
inline std::string bare_message(const Error& e) {
  const std::string what = e.what();
  const std::string prefix = e.layer().empty() ? "kfac: " : "kfac: layer '" + e.layer() + "': ";
  return what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what;
}
/// `e` about layer `name` (a check that did not know the layer).
inline Error about_layer(const std::string& name, const Error& e) { return Error(name, bare_message(e)); }
}  // namespace impl

}  // namespace kfac
