#pragma once
/// \file observations.hpp
/// \brief Which observations of a step belong together, written once for every block: the k-th
/// output gradient of a step pairs with the k-th input, and each new observation is checked
/// against the layer and against its partner before a block folds it.
#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kfac/impl/tensor.hpp"

namespace kfac {
namespace impl {

/// \brief The extents of a step's observations and their pairing.
///
/// Inputs and output gradients may come in either order (a framework's forward pass may run
/// again before the backward pass of the first), unless the block needs the input first
/// (BatchNorm keeps the normalized input until its gradient arrives). An observation whose
/// partner was not seen yet in this step is checked against the last input seen, of this step
/// or an earlier one, so that a Conv2d gradient's spatial size is still checked.
class ObservationPairs {
 public:
  enum class Order { either, input_first };

  ObservationPairs() = default;
  /// The checks of `layer`: check_input(e) and check_output_grad(grad, input), each returning
  /// the problem or an empty string.
  template <class Layer>
  explicit ObservationPairs(const Layer& layer, Order order = Order::either)
      : input_check_([layer](const Extents& e) { return layer.check_input(e); }),
        grad_check_([layer](const Extents& g, const Extents& in) { return layer.check_output_grad(g, in); }),
        order_(order) {}

  bool has_checks() const { return bool(input_check_); }

  /// The problem with an input of extents `e` observed now, or an empty string.
  std::string check_input(const Extents& e) const {
    std::string why = input_check_(e);
    const std::size_t k = inputs_.size();
    if (!why.empty() || k >= grads_.size()) return why;
    // The output gradient it pairs with was observed first: check that pair now.
    const std::string pair = grads_[k][0] != e[0] ? "the batches differ" : grad_check_(grads_[k], e);
    if (pair.empty()) return {};
    return "input has shape " + e.str() + " but the output gradient observed before it " +
           "(observation " + std::to_string(k + 1) + " of this step) has shape " + grads_[k].str() +
           ": " + pair;
  }
  /// The problem with an output gradient of extents `e` observed now, or an empty string. A
  /// batch mismatch is refused here, so the bad observation stays out of the block; a check of
  /// the whole pending update later could only refuse all of it.
  std::string check_output_grad(const Extents& e) const {
    const std::size_t k = grads_.size();
    if (order_ == Order::input_first) {
      if (k >= inputs_.size())
        return "output gradient observed without a matching input (call observe_input first)";
      return grad_check_(e, inputs_[k]);  // the layer's check includes the batch
    }
    if (k < inputs_.size() && e[0] != inputs_[k][0])
      return "output gradient has batch " + std::to_string(e[0]) + " but the input it pairs with (observation " +
             std::to_string(k + 1) + " of this step) has batch " + std::to_string(inputs_[k][0]);
    return grad_check_(e, k < inputs_.size() ? inputs_[k] : last_input_);
  }

  /// The layer's own check of an output gradient of extents `e` that pairs with no input (one
  /// observed on a step that takes no observations: its shape is still checked), or an empty
  /// string.
  std::string check_output_grad_alone(const Extents& e) const { return grad_check_(e, Extents{{0, 0, 0, 0}, 4}); }

  void add_input(const Extents& e) {
    inputs_.push_back(e);
    last_input_ = e;
  }
  void add_output_grad(const Extents& e) { grads_.push_back(e); }
  /// Forgets this step's observations (the last input stays, for the next step's checks).
  void clear() {
    inputs_.clear();
    grads_.clear();
  }

  /// Inputs and output gradients observed in this step.
  std::size_t inputs() const { return inputs_.size(); }
  std::size_t output_grads() const { return grads_.size(); }

 private:
  std::function<std::string(const Extents&)> input_check_;
  std::function<std::string(const Extents&, const Extents&)> grad_check_;
  Order order_ = Order::either;
  std::vector<Extents> inputs_, grads_;
  Extents last_input_{{0, 0, 0, 0}, 4};
};

}  // namespace impl
}  // namespace kfac
