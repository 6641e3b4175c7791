#pragma once
/// \file network.hpp
/// \brief A sequential network of named layers, and the two Fashion-MNIST models.

#include "common/batch_norm2d.hpp"
#include "common/conv2d.hpp"
#include "common/dense.hpp"
#include "common/flatten.hpp"
#include "common/max_pool2d.hpp"
#include "common/relu.hpp"
#include "common/sigmoid.hpp"

#include <stdexcept>
#include <type_traits>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace nn {

/// \brief Every layer kind the network knows; code that must tell them apart (the K-FAC glue)
/// visits the variant, so a new kind is a compile error there rather than a silent skip.
using Layer = std::variant<Dense, Conv2d, BatchNorm2d, ReLU, MaxPool2d, Flatten, Sigmoid>;

/// \brief Whether a layer kind has a forward-mode pass, `rop(dx, direction)`.
template <class L, class = void>
struct supports_rop : std::false_type {};
template <class L>
struct supports_rop<L, std::void_t<decltype(std::declval<L&>().rop(Tensor(), std::vector<ConstVector>()))>>
    : std::true_type {};

class Network {
 public:
  void add(std::string name, Layer layer) { layers_.push_back({std::move(name), std::move(layer)}); }

  /// \param x [in] (N, C, H, W); must stay alive until the next forward (layers keep it)
  /// \return the logits (N, classes, 1, 1), owned by the last layer
  Tensor forward(const Tensor& x, Mode mode) {
    Tensor a = x;
    for (auto& l : layers_) a = std::visit([&](auto& layer) { return layer.forward(a, mode); }, l.layer);
    return a;
  }

  /// \brief Back-propagates the gradient of the loss wrt the logits; fills every parameter
  /// gradient. Input gradients are computed only down to the first layer with parameters
  /// (for the MLP that skips a 256x784 GEMM per step).
  void backward(const Tensor& dlogits) {
    std::size_t first_trainable = layers_.size();
    for (std::size_t i = 0; i < layers_.size() && first_trainable == layers_.size(); ++i)
      if (!std::visit([](const auto& layer) { return layer.params().empty(); }, layers_[i].layer))
        first_trainable = i;
    Tensor g = dlogits;
    for (std::size_t i = layers_.size(); i-- > first_trainable;) {
      const bool need_dx = i > first_trainable;
      g = std::visit([&](auto& layer) { return layer.backward(g, need_dx); }, layers_[i].layer);
    }
  }

  /// \brief Forward mode (R-op): the Jacobian-vector product \f$J v\f$ of the outputs at the
  /// input and parameters of the last forward pass, along a parameter direction v (one pass).
  /// \param direction [in] one view per parameter, in params()' order, each of its size
  /// \return (N, outputs, 1, 1), owned by the last layer until the next rop
  /// \throws std::invalid_argument on a layer kind without an R-op (every kind of nn::Layer has one)
  Tensor rop(const std::vector<ConstVector>& direction) {
    std::size_t next = 0;
    Tensor t;  // empty: zero, until the first layer with parameters
    for (auto& l : layers_)
      t = std::visit(
          [&](auto& layer) -> Tensor {
            using L = std::decay_t<decltype(layer)>;
            const std::size_t count = layer.params().size();
            if (next + count > direction.size())
              throw std::invalid_argument("nn::Network::rop: " + std::to_string(direction.size()) +
                                          " directions for more parameters");
            std::vector<ConstVector> own(direction.begin() + long(next), direction.begin() + long(next + count));
            next += count;
            if constexpr (supports_rop<L>::value) {
              return layer.rop(t, own);
            } else {
              throw std::invalid_argument("nn::Network::rop: layer '" + l.name + "' has no forward mode (R-op)");
            }
          },
          l.layer);
    if (next != direction.size())
      throw std::invalid_argument("nn::Network::rop: " + std::to_string(direction.size()) + " directions for " +
                                  std::to_string(next) + " parameters");
    return t;
  }

  /// \brief Whether rop() serves every layer.
  bool has_rop() const {
    bool all = true;
    for (const auto& l : layers_)
      all = all && std::visit([](const auto& layer) { return supports_rop<std::decay_t<decltype(layer)>>::value; },
                              l.layer);
    return all;
  }

  std::vector<Param> params() const {
    std::vector<Param> all;
    for (const auto& l : layers_)
      for (Param p : std::visit([](const auto& layer) { return layer.params(); }, l.layer)) {
        p.name = l.name + "." + p.name;
        all.push_back(std::move(p));
      }
    return all;
  }

  /// \brief Calls f(name, layer) for each layer, with the layer as its concrete type.
  template <class F>
  void for_each_layer(F&& f) {
    for (auto& l : layers_) std::visit([&](auto& layer) { f(l.name, layer); }, l.layer);
  }

  std::size_t size() const { return layers_.size(); }

 private:
  struct Named {
    std::string name;
    Layer layer;
  };
  std::vector<Named> layers_;
};

/// \brief 784-256-256-10 perceptron with ReLU.
inline Network make_mlp(std::uint64_t seed) {
  SplitMix64 rng(derive_seed(seed, 1));
  Network net;
  net.add("flatten", Flatten());
  net.add("fc1", Dense(784, 256, true, Init::he, rng));
  net.add("relu1", ReLU());
  net.add("fc2", Dense(256, 256, true, Init::he, rng));
  net.add("relu2", ReLU());
  net.add("fc3", Dense(256, 10, true, Init::lecun, rng));
  return net;
}

/// \brief conv(1->16,3x3,pad 1)-BN-ReLU-pool-conv(16->32,3x3,pad 1)-BN-ReLU-pool-dense(32*7*7->10).
/// The convolutions have no bias: the BatchNorm after each would cancel it.
inline Network make_cnn(std::uint64_t seed) {
  SplitMix64 rng(derive_seed(seed, 1));
  Network net;
  net.add("conv1", Conv2d(Conv2dShape{1, 16, 3, 3}.with_padding(1).with_bias(false), Init::he, rng));
  net.add("bn1", BatchNorm2d(16));
  net.add("relu1", ReLU());
  net.add("pool1", MaxPool2d());
  net.add("conv2", Conv2d(Conv2dShape{16, 32, 3, 3}.with_padding(1).with_bias(false), Init::he, rng));
  net.add("bn2", BatchNorm2d(32));
  net.add("relu2", ReLU());
  net.add("pool2", MaxPool2d());
  net.add("flatten", Flatten());
  net.add("fc", Dense(32 * 7 * 7, 10, true, Init::lecun, rng));
  return net;
}

/// \brief The MLP of the kfac-pytorch comparison (issue 15): 784-1024-1024-10 with ReLU.
inline Network make_peer_mlp(std::uint64_t seed) {
  SplitMix64 rng(derive_seed(seed, 1));
  Network net;
  net.add("flatten", Flatten());
  net.add("fc1", Dense(784, 1024, true, Init::he, rng));
  net.add("relu1", ReLU());
  net.add("fc2", Dense(1024, 1024, true, Init::he, rng));
  net.add("relu2", ReLU());
  net.add("fc3", Dense(1024, 10, true, Init::lecun, rng));
  return net;
}

/// \brief The CNN of the kfac-pytorch comparison (issue 15), without BatchNorm or padding:
/// conv(1->32,3x3)-ReLU-pool-conv(32->64,3x3)-ReLU-pool-dense(64*5*5->10), biases everywhere.
inline Network make_peer_cnn(std::uint64_t seed) {
  SplitMix64 rng(derive_seed(seed, 1));
  Network net;
  net.add("conv1", Conv2d(Conv2dShape{1, 32, 3, 3}, Init::he, rng));
  net.add("relu1", ReLU());
  net.add("pool1", MaxPool2d());
  net.add("conv2", Conv2d(Conv2dShape{32, 64, 3, 3}, Init::he, rng));
  net.add("relu2", ReLU());
  net.add("pool2", MaxPool2d());
  net.add("flatten", Flatten());
  net.add("fc", Dense(64 * 5 * 5, 10, true, Init::lecun, rng));
  return net;
}

/// \brief The deep autoencoder of Hinton & Salakhutdinov (2006) as Martens & Grosse (2015,
/// section 13) train it: 784-1000-500-250-30 and the mirrored decoder 30-250-500-1000-784,
/// logistic units everywhere except the linear 30-unit code layer; the last layer's outputs are
/// logits (the loss applies the output sigmoid: SigmoidCrossEntropy). Weights U(+-sqrt(3/fan_in)).
inline Network make_autoencoder(std::uint64_t seed) {
  SplitMix64 rng(derive_seed(seed, 1));
  Network net;
  net.add("flatten", Flatten());
  const int widths[] = {784, 1000, 500, 250, 30, 250, 500, 1000, 784};
  for (int i = 0; i < 8; ++i) {
    net.add("fc" + std::to_string(i + 1), Dense(widths[i], widths[i + 1], true, Init::lecun, rng));
    if (i != 3 && i != 7) net.add("sigmoid" + std::to_string(i + 1), Sigmoid());
  }
  return net;
}

inline Network make_model(const std::string& name, std::uint64_t seed) {
  if (name == "mlp") return make_mlp(seed);
  if (name == "cnn") return make_cnn(seed);
  if (name == "peer-mlp") return make_peer_mlp(seed);
  if (name == "peer-cnn") return make_peer_cnn(seed);
  throw std::invalid_argument("unknown model '" + name + "' (expected mlp, cnn, peer-mlp or peer-cnn)");
}

}  // namespace nn
