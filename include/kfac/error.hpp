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

}  // namespace kfac
