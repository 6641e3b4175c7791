#pragma once
/// \file any_layer.hpp
/// \brief impl::AnyLayer: a layer and its method with their types erased, for front ends that
/// choose the layer at run time (the PyTorch adapters) and must not depend on the communicator.

#include <functional>
#include <memory>
#include <string>

#include "kfac/core/block.hpp"
#include "kfac/core/method_settings.hpp"
#include "kfac/core/traits.hpp"

namespace kfac {
namespace impl {

/// \brief What Preconditioner::register_layer needs of one layer: its kind (for the skip list),
/// a factory of its block (called with the layer's name; again for the shadows of deferred
/// decompositions) and the method's per-layer overrides. Built by any_layer(layer, method).
template <class Scalar, class Exec>
struct AnyLayer {
  std::string kind;
  std::function<std::unique_ptr<Block<Scalar, Exec>>(const std::string& name)> make;
  Overrides overrides;
};

/// \brief `layer` under `method`, with their types erased (the block type is instantiated here).
template <class Scalar, class Exec, class LayerType, class Method>
AnyLayer<Scalar, Exec> any_layer(const LayerType& layer, const Method& method) {
  static_assert(is_layer_type_v<LayerType>, "kfac::impl::any_layer: the first argument must be a layer type");
  static_assert(is_method_v<Method>, "kfac::impl::any_layer: the second argument must be a method object");
  static_assert(Method::template accepts<LayerType>,
                "kfac::impl::any_layer: this method does not handle this layer type");
  return {LayerType::kind,
          [layer, method](const std::string& name) { return method.template make_block<Scalar, Exec>(name, layer); },
          overrides_of(method)};
}

}  // namespace impl
}  // namespace kfac
