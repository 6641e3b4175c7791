#pragma once
/// \file torch_kinds.hpp
/// \brief The PyTorch adapters' built-in kinds: Linear, Conv2d, BatchNorm2d, LayerNorm, Embedding
/// and the diagonal fallback's Parameter. Each is one translation from the module's settings to a
/// TorchLayer (the kfac layer, its method for the front end's TorchMethods, how a call's tensors
/// become its observations), shared by both front ends, which register them in their module-type
/// registries through the entry point a user's kind goes through (docs/torch.md, docs/python.md).

#include <array>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>

namespace kfac {
namespace impl {

/// \brief The built-in kinds' method choices for one Scalar under the front end's TorchMethods.
template <TorchMethods Set>
struct TorchBuiltinMethods {
  template <class Scalar>
  using any_layer_type = AnyLayer<Scalar, TorchExec>;

  /// Calls `f` with the Precision<F, D> that `p` names (the Scalar's for TorchPrecision::scalar).
  template <class Scalar, class F>
  static any_layer_type<Scalar> with_precision(TorchPrecision p, F&& f) {
    switch (p) {
      case TorchPrecision::scalar: return f(Precision<Scalar>{});
      case TorchPrecision::half_float: return f(HalfPrecision{});
      case TorchPrecision::float_float: return f(SinglePrecision{});
      case TorchPrecision::float_double: return f(MixedPrecision{});
      case TorchPrecision::double_double: return f(DoublePrecision{});
      case TorchPrecision::double_float: return f(Precision<double, float>{});
    }
    return f(Precision<Scalar>{});
  }
  static std::string not_offered(const char* kind) {
    return std::string(kind) + ": this front end builds the default method in the parameters' precision only "
                               "(TorchMethods::default_only)";
  }
  /// K-FAC with one of its inversions, or NG-SGD (Dense, Conv2d).
  template <class Scalar, class Layer>
  static any_layer_type<Scalar> kronecker(const std::string& name, const Layer& l, const TorchMethod& m) {
    if constexpr (Set == TorchMethods::default_only) {
      const auto* eigen = std::get_if<Eigendecomposition<>>(&m.method);
      if (!eigen || m.precision != TorchPrecision::scalar) throw Error(name, not_offered(Layer::kind));
      return any_layer<Scalar, TorchExec>(l, KFAC<Symmetric, Eigendecomposition<>, Precision<Scalar>>{*eigen});
    } else {
      return std::visit(
          [&](const auto& method) -> any_layer_type<Scalar> {
            using M = std::decay_t<decltype(method)>;
            if constexpr (std::is_same<M, NGSGD>::value) return any_layer<Scalar, TorchExec>(l, method);
            else
              return with_precision<Scalar>(m.precision, [&](auto prec) -> any_layer_type<Scalar> {
                return any_layer<Scalar, TorchExec>(l, KFAC<Symmetric, M, decltype(prec)>{method});
              });
          },
          m.method);
    }
  }
  /// A unit-wise layer's UnitWiseFisher, or a Parameter's DiagonalFisher, in the precision `p` names.
  template <class Scalar, class Layer>
  static any_layer_type<Scalar> unit_wise(const std::string& name, const Layer& l, TorchPrecision p) {
    if constexpr (Set == TorchMethods::default_only) {
      if (p != TorchPrecision::scalar) throw Error(name, not_offered(Layer::kind));
      if constexpr (std::is_same<Layer, Parameter>::value)
        return any_layer<Scalar, TorchExec>(l, DiagonalFisher<Precision<Scalar>>{});
      else return any_layer<Scalar, TorchExec>(l, UnitWiseFisher<UnitWise, Precision<Scalar>>{});
    } else {
      return with_precision<Scalar>(p, [&](auto prec) -> any_layer_type<Scalar> {
        using P = decltype(prec);
        if constexpr (std::is_same<typename P::factor_type, Half>::value)
          throw Error(name, std::string(Layer::kind) +
                                ": half-precision factors are for Kronecker layers; store it in float or double");
        else if constexpr (std::is_same<Layer, Parameter>::value)
          return any_layer<Scalar, TorchExec>(l, DiagonalFisher<P>{});
        else return any_layer<Scalar, TorchExec>(l, UnitWiseFisher<UnitWise, P>{});
      });
    }
  }
  /// EmbeddingFisher<Symmetric or Diagonal, Eigendecomposition<>, P> in the precision `m` names,
  /// G decomposed with the settings of `m`'s Eigendecomposition<> (the only method an Embedding
  /// has); default_only: EmbeddingFisher<> in the parameters' precision.
  template <class Scalar>
  static any_layer_type<Scalar> embedding(const std::string& name, const Embedding& l, const TorchMethod& m) {
    const auto* eigen = std::get_if<Eigendecomposition<>>(&m.method);
    if (!eigen) throw Error(name, "embedding: its method is EmbeddingFisher (G's eigendecomposition), not another one");
    if constexpr (Set == TorchMethods::default_only) {
      if (m.diagonal || m.precision != TorchPrecision::scalar) throw Error(name, not_offered(Embedding::kind));
      using Default = EmbeddingFisher<Symmetric, Eigendecomposition<>, Precision<Scalar>>;
      return any_layer<Scalar, TorchExec>(l, Default{*eigen});
    } else {
      return with_precision<Scalar>(m.precision, [&](auto prec) -> any_layer_type<Scalar> {
        using P = decltype(prec);
        if constexpr (std::is_same<typename P::factor_type, Half>::value)
          throw Error(name, "embedding: half-precision factors are for Kronecker layers; store it in float or double");
        else if (m.diagonal)
          return any_layer<Scalar, TorchExec>(l, EmbeddingFisher<Diagonal, Eigendecomposition<>, P>{*eigen});
        else return any_layer<Scalar, TorchExec>(l, EmbeddingFisher<Symmetric, Eigendecomposition<>, P>{*eigen});
      });
    }
  }
};

/// A TorchLayer of kind `kind` whose block factory is `make(Scalar{}, name)`.
template <class Make>
TorchLayer torch_builtin(const char* kind, const at::Tensor& weight, const at::Tensor& bias, Make make,
                         TorchView input, TorchView output_grad = {}) {
  TorchLayer t;
  t.kind = kind;
  t.weight = weight;
  t.bias = bias;
  t.as_float = [make](const std::string& name) { return make(float{}, name); };
  t.as_double = [make](const std::string& name) { return make(double{}, name); };
  t.input = std::move(input);
  t.output_grad = std::move(output_grad);
  return t;
}

/// A call's output gradient over tokens, shaped as its input (Linear, LayerNorm, Embedding).
inline at::Tensor torch_tokens_output_grad(const TorchCapture& c, const at::Tensor& g) {
  return g.dim() > 2 ? torch_tokens(c, g) : g;
}

/// \brief Linear: Dense(in, out), its tokens reduced as the front end's TokenReduction says; the
/// input as it is, over tokens as (batch, tokens, in) or, under kfac-pytorch's conventions,
/// flattened into (batch x tokens, in).
template <TorchMethods Set>
TorchLayer torch_linear(int64_t in, int64_t out, const at::Tensor& weight, const at::Tensor& bias,
                        const TorchMethod& m, const TorchContext& ctx) {
  const Dense l = Dense(index_t(in), index_t(out), bias.defined())
                      .with_tokens(ctx.tokens == adapters::TokenReduction::reduce ? Dense::Tokens::reduce
                                                                                  : Dense::Tokens::expand);
  TorchLayer t = torch_builtin(
      Dense::kind, weight, bias,
      [l, m](auto scalar, const std::string& name) {
        return TorchBuiltinMethods<Set>::template kronecker<decltype(scalar)>(name, l, m);
      },
      [](const TorchCapture& c, const at::Tensor& xd) {
        if (xd.dim() == 2) return xd;
        if (xd.dim() < 2)
          throw Error(c.name, "input has shape " + torch_shape(xd) + "; kfac needs a batch dimension (batch, in)");
        if (c.tokens == adapters::TokenReduction::none)
          throw Error(c.name, "input has shape " + torch_shape(xd) + " (a sequence: batch, tokens, ..., in); " +
                                  c.front->token_hint);
        return torch_tokens(c, xd);
      },
      torch_tokens_output_grad);
  t.flattens_tokens = true;
  return t;
}

/// The settings of a Conv2d module that its kind reads.
struct TorchConv2dSettings {
  int64_t in_channels = 0, out_channels = 0, groups = 1;
  std::array<int64_t, 2> kernel{{1, 1}}, stride{{1, 1}}, dilation{{1, 1}}, padding{{0, 0}};
  bool padding_same = false;
  std::string padding_mode = "zeros";
  Conv2d::FactorScaling scaling = Conv2d::FactorScaling::kfc;  ///< KFC's or kfac-pytorch's factors
};

/// \brief Conv2d with zero, symmetric padding and one group; its input as it is, (N, C, H, W).
template <TorchMethods Set>
std::optional<TorchLayer> torch_conv2d(const TorchConv2dSettings& s, const at::Tensor& weight, const at::Tensor& bias,
                                       const TorchMethod& m, std::string& problem) {
  if (s.groups != 1) {
    problem = s.groups == s.in_channels
                  ? "depthwise convolutions (groups = in_channels = " + std::to_string(s.groups) + ") are not supported"
                  : "grouped convolutions (groups = " + std::to_string(s.groups) + ") are not supported";
    return std::nullopt;
  }
  if (s.padding_mode != "zeros") {
    problem = "only zero padding is supported (padding_mode " + s.padding_mode + ")";
    return std::nullopt;
  }
  std::array<int64_t, 2> pad = s.padding;
  if (s.padding_same)
    for (int i = 0; i < 2; ++i) {
      const int64_t total = s.dilation[i] * (s.kernel[i] - 1);
      if (total % 2 != 0) {
        problem =
            "padding 'same' with an even dilated kernel pads asymmetrically; kfac supports symmetric padding only";
        return std::nullopt;
      }
      pad[i] = total / 2;
    }
  Conv2d l(index_t(s.in_channels), index_t(s.out_channels), index_t(s.kernel[0]), index_t(s.kernel[1]));
  l.with_stride(index_t(s.stride[0]), index_t(s.stride[1])).with_padding(index_t(pad[0]), index_t(pad[1]))
      .with_dilation(index_t(s.dilation[0]), index_t(s.dilation[1])).with_bias(bias.defined())
      .with_factor_scaling(s.scaling);
  return torch_builtin(
      Conv2d::kind, weight, bias,
      [l, m](auto scalar, const std::string& name) {
        return TorchBuiltinMethods<Set>::template kronecker<decltype(scalar)>(name, l, m);
      },
      [](const TorchCapture& c, const at::Tensor& xd) {
        if (xd.dim() != 4)
          throw Error(c.name, "input has shape " + torch_shape(xd) + "; kfac needs a batched (N, C, H, W) input");
        return xd;
      });
}

/// \brief BatchNorm2d (affine): the unit-wise Fisher of its scale and shift, observing the
/// normalized input x̂ as training mode computes it (batch mean, biased batch variance).
template <TorchMethods Set>
TorchLayer torch_batch_norm(int64_t num_features, double eps, const at::Tensor& weight, const at::Tensor& bias,
                            TorchPrecision p) {
  const BatchNorm2d l = BatchNorm2d(index_t(num_features));
  return torch_builtin(
      BatchNorm2d::kind, weight, bias,
      [l, p](auto scalar, const std::string& name) {
        return TorchBuiltinMethods<Set>::template unit_wise<decltype(scalar)>(name, l, p);
      },
      [eps](const TorchCapture& c, const at::Tensor& xd) {
        if (xd.dim() != 4) throw Error(c.name, "input has shape " + torch_shape(xd) + ", expected (N, C, H, W)");
        const at::Tensor mean = xd.mean({0, 2, 3}, /*keepdim=*/true);
        const at::Tensor var = xd.var({0, 2, 3}, /*unbiased=*/false, /*keepdim=*/true);
        return (xd - mean) * torch::rsqrt(var + eps);
      });
}

/// \brief LayerNorm over the last dimension: the unit-wise Fisher of its scale (and shift),
/// observing each row normalized over its last dimension with the biased variance, as the module.
template <TorchMethods Set>
std::optional<TorchLayer> torch_layer_norm(int64_t num_features, int64_t normalized_dims, double eps,
                                           const at::Tensor& weight, const at::Tensor& bias, TorchPrecision p,
                                           std::string& problem) {
  if (normalized_dims != 1) {
    problem = "normalizes over its last " + std::to_string(normalized_dims) +
              " dimensions; kfac's LayerNorm normalizes over the last one";
    return std::nullopt;
  }
  const LayerNorm l(index_t(num_features), bias.defined());
  return torch_builtin(
      LayerNorm::kind, weight, bias,
      [l, p](auto scalar, const std::string& name) {
        return TorchBuiltinMethods<Set>::template unit_wise<decltype(scalar)>(name, l, p);
      },
      [eps](const TorchCapture& c, const at::Tensor& xd) {
        if (xd.dim() < 2)
          throw Error(c.name, "input has shape " + torch_shape(xd) + "; kfac needs a batch dimension (batch, ..., D)");
        const at::Tensor mean = xd.mean({-1}, /*keepdim=*/true);
        const at::Tensor var = xd.var({-1}, /*unbiased=*/false, /*keepdim=*/true);
        const at::Tensor xhat = (xd - mean) * torch::rsqrt(var + eps);
        return xd.dim() == 2 ? xhat : torch_tokens(c, xhat);
      },
      torch_tokens_output_grad);
}

/// The settings of an Embedding module that its kind reads.
struct TorchEmbeddingSettings {
  int64_t num_embeddings = 0, embedding_dim = 0;
  std::optional<int64_t> padding_idx;  ///< as the module holds it (negative: from the end)
  bool sparse = false;                 ///< sparse gradients (refused)
  bool scale_grad_by_freq = false;     ///< rows' gradients divided by their counts (refused)
};

/// \brief Embedding: EmbeddingFisher over its integer ids, read as the Scalar's values.
template <TorchMethods Set>
std::optional<TorchLayer> torch_embedding(const TorchEmbeddingSettings& s, const at::Tensor& weight,
                                          const TorchMethod& m, const TorchFrontEnd& front, std::string& problem) {
  // max_norm is accepted: the module renormalizes the rows it looks up in place, outside
  // autograd, before the lookup, so the weight's gradient is the plain lookup's, the one
  // kfac's factors describe.
  const int64_t vocabulary = s.num_embeddings;
  if (s.sparse) {
    problem = std::string("sparse gradients (its sparse option): kfac preconditions a dense weight gradient; turn "
                          "sparse off, or ") + front.skip_hint;
    return std::nullopt;
  }
  if (s.scale_grad_by_freq) {
    problem = std::string("scale_grad_by_freq divides each row's gradient by its id's count in the batch, which "
                          "kfac's factors do not describe; turn it off, or ") + front.skip_hint;
    return std::nullopt;
  }
  if (vocabulary < 1 || s.embedding_dim < 1) {
    problem = "has shape (" + std::to_string(vocabulary) + ", " + std::to_string(s.embedding_dim) +
              "); kfac needs at least one id and one dimension";
    return std::nullopt;
  }
  Embedding l(index_t(vocabulary), index_t(s.embedding_dim));
  if (s.padding_idx) {
    const int64_t p = *s.padding_idx < 0 ? *s.padding_idx + vocabulary : *s.padding_idx;
    if (p < 0 || p >= vocabulary) {
      problem = "padding_idx " + std::to_string(*s.padding_idx) + " is outside its " + std::to_string(vocabulary) +
                " ids";
      return std::nullopt;
    }
    l.with_padding_index(index_t(p));
  }
  TorchLayer t = torch_builtin(
      Embedding::kind, weight, at::Tensor(),
      [l, m](auto scalar, const std::string& name) {
        return TorchBuiltinMethods<Set>::template embedding<decltype(scalar)>(name, l, m);
      },
      [](const TorchCapture& c, const at::Tensor& xd) {
        if (!c10::isIntegralType(xd.scalar_type(), /*includeBool=*/false))
          throw Error(c.name, std::string("input of dtype ") + c10::toString(xd.scalar_type()) +
                                  "; an Embedding's input is integer token ids");
        if (xd.dim() < 1)
          throw Error(c.name, "input has shape (); kfac needs token ids of shape (batch) or (batch, tokens)");
        // The ids as they are (the backend's Scalar at precondition()); tokens over several
        // dimensions are one run of tokens per sample, as torch_tokens reshapes a Linear's.
        return xd.dim() <= 2 ? xd : xd.reshape({xd.size(0), -1});
      },
      torch_tokens_output_grad);
  // Token ids reach kfac as the Scalar's values: a float holds every integer only up to 2^24.
  const std::string hint = front.skip_hint;
  t.dtype_problem = [vocabulary, hint](at::ScalarType dtype) {
    constexpr int64_t exact_float_ids = int64_t(1) << 24;
    if (dtype != at::kFloat || vocabulary <= exact_float_ids) return std::string();
    return "a vocabulary of " + std::to_string(vocabulary) +
           " ids with float32 parameters: kfac reads token ids as float32, exact only up to 2^24 = 16777216; use "
           "float64 parameters, or " + hint;
  };
  return t;
}

/// \brief One parameter under the diagonal Fisher (the generic fallback): its front end records
/// only the sample count of each call of the module owning it (any tensor of shape (batch, ...)).
template <TorchMethods Set>
std::optional<TorchLayer> torch_parameter(const at::Tensor& weight, TorchPrecision p, std::string& problem) {
  const int64_t count = weight.defined() ? weight.numel() : 0;
  if (count < 1) {
    problem = "is an empty parameter; kfac needs at least one value";
    return std::nullopt;
  }
  const int64_t rows = weight.dim() == 0 ? 1 : weight.size(0);
  const Parameter l(index_t(rows), index_t(count / rows));
  TorchLayer t = torch_builtin(
      Parameter::kind, weight, at::Tensor(),
      [l, p](auto scalar, const std::string& name) {
        return TorchBuiltinMethods<Set>::template unit_wise<decltype(scalar)>(name, l, p);
      },
      [](const TorchCapture& c, const at::Tensor& xd) {
        if (xd.dim() < 1) throw Error(c.name, "sample count of shape (); expected a tensor of shape (batch, ...)");
        return xd.reshape({xd.size(0), -1});
      });
  // Any shape, as (rows, rest).
  t.weight_grad = [](const at::Tensor& g) { return g.reshape({g.dim() == 0 ? 1 : g.size(0), -1}); };
  return t;
}

}  // namespace impl
}  // namespace kfac
