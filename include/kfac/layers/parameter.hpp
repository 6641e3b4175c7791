#pragma once
/// \file parameter.hpp
/// \brief Layer-type policy for any parameter tensor, seen as a (rows x cols) matrix: the kind
/// that kfac::DiagonalFisher preconditions, so that every parameter of a model can be registered.

#include <string>

#include "kfac/error.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief Any parameter, of rows x cols values (a tensor of shape (d0, d1, ..., dk) is (d0, d1 ...
/// dk); a vector of n values is (n, 1)), whose curvature is not modelled by a layer's structure.
///
/// Its statistics come from its gradient (Block::observe_gradient), not from activations. What it
/// observes is only the number of samples the gradient was computed over: on a statistics
/// step, observe_output_grad(name, t) with any tensor t whose first extent is the batch (its
/// values are never read; an input observation is accepted the same way, and only its batch is
/// checked). Gradient: the parameter's, row-major as rows x cols values, no bias.
/// Not a Kronecker layer type (`is_kronecker` is false); its method is kfac::DiagonalFisher,
/// its default.
class Parameter {
 public:
  static constexpr bool is_kronecker = false;
  static constexpr const char* kind = "parameter";

  /// \param rows [in] the parameter's first dimension (>= 1)
  /// \param cols [in] the product of its other dimensions (>= 1; 1 for a vector)
  explicit Parameter(index_t rows, index_t cols = 1) : rows_(rows), cols_(cols) {
    if (rows < 1 || cols < 1)
      throw Error("", "Parameter: expected rows >= 1 and cols >= 1, got " + std::to_string(rows) + " x " +
                          std::to_string(cols));
  }

  index_t rows() const { return rows_; }
  index_t cols() const { return cols_; }
  index_t weight_rows() const { return rows_; }
  index_t weight_cols() const { return cols_; }
  std::string describe() const {
    return std::string(kind) + "(" + std::to_string(rows_) + "x" + std::to_string(cols_) + ")";
  }

  /// Any shape: only the batch (the first extent) is read.
  std::string check_input(const impl::Extents&) const { return {}; }
  /// Any shape whose batch equals that of the input it pairs with, when there is one.
  std::string check_output_grad(const impl::Extents& e, const impl::Extents& input) const {
    if (input[0] == 0 || e[0] == input[0]) return {};
    return "sample count of shape " + e.str() + " (batch " + std::to_string(e[0]) +
           ") differs from the batch of the input it pairs with, " + input.str();
  }

 private:
  index_t rows_, cols_;
};

}  // namespace kfac
