#pragma once
/// \file torch_core.hpp
/// \brief The PyTorch adapters' shared core: one translation of modules to kfac layers and one
/// precondition() protocol, used by both front ends — the C++ `TorchPreconditioner`
/// (kfac/adapters/torch.hpp, modules seen through `observed()`) and the Python package
/// (python/, modules seen through forward-pre and full-backward hooks).
///
/// A front end describes each module that owns parameters as a TorchModuleSpec (what it is, its
/// settings, its parameter tensors, whether its skip list matched it); TorchCore checks them all,
/// names every module it cannot handle in one kfac::Error, picks the Preconditioner's Scalar from
/// the parameters' dtype, registers the layers, and keeps one TorchCapture per module into which
/// the front end's hooks record inputs and output gradients. Included by torch.hpp after
/// TorchOptions; not a header of its own for users.

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace kfac {
namespace impl {

enum class TorchKind { dense, conv2d, batch_norm, layer_norm, embedding, parameter };

/// \brief The scalar types of a module's factors and decompositions (kfac::Precision<F, D>).
enum class TorchPrecision {
  scalar,         ///< the Preconditioner's Scalar (the parameters' dtype) for both
  half_float,     ///< kfac::HalfPrecision: binary16 factors, float decompositions
  float_float,    ///< kfac::SinglePrecision
  float_double,   ///< kfac::MixedPrecision: float factors, double decompositions
  double_double,  ///< kfac::DoublePrecision
  double_float,   ///< Precision<double, float>: double factors, float decompositions
};

/// \brief The method a Linear or Conv2d module gets, with its settings: K-FAC with one of its
/// inversions (KFAC<Symmetric, Inversion, Prec>) or NG-SGD (which keeps its estimates in the
/// Scalar: `precision` is not read). BatchNorm2d and LayerNorm modules get UnitWiseFisher<UnitWise,
/// Prec>; Embedding modules EmbeddingFisher<Symmetric, or Diagonal with `diagonal`, Eigendecomposition<>,
/// Prec>, whose G is decomposed with the settings of the Eigendecomposition<> alternative.
struct TorchMethod {
  std::variant<Eigendecomposition<>, Cholesky<>, NewtonSchulz, RandomizedEigen<>, NGSGD> method;
  TorchPrecision precision = TorchPrecision::scalar;
  bool diagonal = false;  ///< Embedding: keep only diag(G) (EmbeddingFisher<Diagonal>)
};

/// \brief The wording of one front end in the core's error messages.
struct TorchFrontEnd {
  const char* preconditioner;  ///< "TorchPreconditioner"
  const char* types;           ///< the supported module types as the user spells them
  const char* skip_hint;       ///< how to leave a module to the optimizer alone
  const char* accumulation;    ///< the name of the accumulation setting
  const char* not_observed;    ///< why a module was not observed
  const char* token_hint;      ///< how to choose a token reduction
};

/// \brief One module that owns parameters, as a front end found it.
struct TorchModuleSpec {
  /// parameter: one parameter tensor (`weight`) under the diagonal Fisher, the generic fallback;
  /// its front end records only the sample count of each call of the module owning it.
  enum class Type { linear, conv2d, batch_norm, layer_norm, embedding, parameter, other };
  std::string name;       ///< path in the model ("features.0"; "root" for the model itself)
  std::string type_name;  ///< the type as the front end spells it ("torch::nn::Conv2d", "torch.nn.Conv2d")
  Type type = Type::other;
  bool skipped = false;     ///< left out by the front end: matched by its skip list, or `skip_reason`
  std::string skip_reason;  ///< why, when not the skip list (listed by skipped())
  bool all_frozen = false;  ///< every parameter it owns has requires_grad = false
  TorchMethod method;  ///< Linear, Conv2d, Embedding: the method; BatchNorm2d, LayerNorm: its precision only
  Conv2d::FactorScaling conv_scaling = Conv2d::FactorScaling::kfc;  ///< Conv2d: KFC's or kfac-pytorch's factors
  at::Tensor weight, bias;  ///< undefined when absent
  int64_t in_features = 0, out_features = 0;                      ///< Linear
  int64_t in_channels = 0, out_channels = 0, groups = 1;          ///< Conv2d
  std::array<int64_t, 2> kernel{{1, 1}}, stride{{1, 1}}, dilation{{1, 1}}, padding{{0, 0}};
  bool padding_same = false;
  std::string padding_mode = "zeros";
  int64_t num_features = 0;    ///< BatchNorm2d; LayerNorm: the size of its last normalized dimension
  int64_t normalized_dims = 1;  ///< LayerNorm: the dimensions it normalizes over (kfac: the last one)
  double eps = 1e-5;
  int64_t num_embeddings = 0, embedding_dim = 0;  ///< Embedding
  std::optional<int64_t> padding_idx;            ///< Embedding: as the module holds it (negative: from the end)
  bool sparse = false;                            ///< Embedding: sparse gradients (refused)
  bool scale_grad_by_freq = false;                ///< Embedding: rows' gradients divided by their counts (refused)
};

/// What a front end records for one registered module between two precondition() calls.
struct TorchCapture {
  std::string name;
  TorchKind kind = TorchKind::dense;
  adapters::TokenReduction tokens = adapters::TokenReduction::none;
  bool flatten_tokens = false;  ///< expand as kfac-pytorch does: tokens flattened into the batch
  const TorchFrontEnd* front = nullptr;
  double bn_eps = 1e-5;  ///< BatchNorm2d, LayerNorm
  bool wanted = true;   ///< the next step updates this module's statistics
  long generation = 0;  ///< bumped when the observations are dropped; stale hooks then do nothing
  std::mutex mutex;     ///< hooks may run on autograd's threads
  std::vector<at::Tensor> inputs, grads;  ///< per call: the input kfac sees, its output gradient

  void clear() {
    std::lock_guard<std::mutex> lock(mutex);
    inputs.clear();
    grads.clear();
    ++generation;
  }
  /// \brief Records one call's input (already as kfac sees it); returns its slot.
  std::size_t add_input(at::Tensor seen) {
    std::lock_guard<std::mutex> lock(mutex);
    inputs.push_back(std::move(seen));
    grads.emplace_back();
    return inputs.size() - 1;
  }
  /// \brief The output gradient of the call in `slot`, recorded in `generation`.
  void set_grad(std::size_t slot, long gen, const at::Tensor& g) {
    std::lock_guard<std::mutex> lock(mutex);
    if (generation == gen && slot < grads.size()) grads[slot] = g.detach();
  }
  /// \brief The output gradient of the latest call still waiting for one (a module's backward
  /// hooks fire in the reverse order of its calls within one graph). False when none waits.
  bool set_latest_grad(const at::Tensor& g) {
    std::lock_guard<std::mutex> lock(mutex);
    for (std::size_t i = grads.size(); i-- > 0;)
      if (!grads[i].defined()) {
        grads[i] = g.detach();
        return true;
      }
    return false;
  }
};

inline std::string torch_shape(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

inline std::string torch_device_problem(const at::Tensor& t, const char* what) {
  if (!t.defined() || t.device().is_cpu()) return {};
  return std::string(what) + " is on " + t.device().str() +
         "; kfac's PyTorch adapters work on CPU tensors only (Debian's PyTorch is CPU-only)";
}

struct ModuleProblem {
  std::string name, why;
};
/// One problem: an Error naming the module; several: one Error naming each of them.
inline void throw_module_problems(const std::vector<ModuleProblem>& problems, const std::string& what) {
  if (problems.size() == 1) throw Error(problems.front().name, problems.front().why);
  if (problems.empty()) return;
  std::string all = what + ": ";
  for (std::size_t i = 0; i < problems.size(); ++i)
    all += (i ? "; " : "") + ("'" + problems[i].name + "' " + problems[i].why);
  throw Error("", all);
}

/// A Linear's or LayerNorm's input or output gradient over tokens (batch, ..., features):
/// (batch, tokens, features), or (batch x tokens, features) for kfac-pytorch's expand (Linear).
inline at::Tensor torch_tokens(const TorchCapture& c, const at::Tensor& t) {
  const int64_t width = t.size(-1);
  return c.flatten_tokens ? t.reshape({-1, width}) : t.reshape({t.size(0), -1, width});
}

/// What kfac sees of one call's input: the input itself (Linear, Conv2d), a Linear's input over
/// tokens as (batch, tokens, in) (kfac's Dense reduces the tokens as the module's TokenReduction
/// says) or, under kfac-pytorch's conventions, flattened into (batch x tokens, in), or the
/// normalized input x̂ (BatchNorm2d). No copy unless x̂ needs one.
inline at::Tensor torch_observation(const TorchCapture& c, const at::Tensor& x) {
  const std::string dev = torch_device_problem(x, "the input");
  if (!dev.empty()) throw Error(c.name, dev);
  const at::Tensor xd = x.detach();
  switch (c.kind) {
    case TorchKind::dense: {
      if (xd.dim() == 2) return xd;
      if (xd.dim() < 2) throw Error(c.name, "input has shape " + torch_shape(xd) + "; kfac needs a batch dimension (batch, in)");
      if (c.tokens == adapters::TokenReduction::none)
        throw Error(c.name, "input has shape " + torch_shape(xd) + " (a sequence: batch, tokens, ..., in); " +
                                c.front->token_hint);
      return torch_tokens(c, xd);
    }
    case TorchKind::conv2d:
      if (xd.dim() != 4) throw Error(c.name, "input has shape " + torch_shape(xd) + "; kfac needs a batched (N, C, H, W) input");
      return xd;
    case TorchKind::batch_norm: {
      if (xd.dim() != 4) throw Error(c.name, "input has shape " + torch_shape(xd) + ", expected (N, C, H, W)");
      // Training mode normalizes with the batch mean and the biased batch variance.
      const at::Tensor mean = xd.mean({0, 2, 3}, /*keepdim=*/true);
      const at::Tensor var = xd.var({0, 2, 3}, /*unbiased=*/false, /*keepdim=*/true);
      return (xd - mean) * torch::rsqrt(var + c.bn_eps);
    }
    case TorchKind::layer_norm: {
      if (xd.dim() < 2)
        throw Error(c.name, "input has shape " + torch_shape(xd) + "; kfac needs a batch dimension (batch, ..., D)");
      // Each row normalized over its last dimension, with the biased variance, as the module does.
      const at::Tensor mean = xd.mean({-1}, /*keepdim=*/true);
      const at::Tensor var = xd.var({-1}, /*unbiased=*/false, /*keepdim=*/true);
      const at::Tensor xhat = (xd - mean) * torch::rsqrt(var + c.bn_eps);
      return xd.dim() == 2 ? xhat : torch_tokens(c, xhat);
    }
    case TorchKind::embedding: {
      if (!c10::isIntegralType(xd.scalar_type(), /*includeBool=*/false))
        throw Error(c.name, std::string("input of dtype ") + c10::toString(xd.scalar_type()) +
                                "; an Embedding's input is integer token ids");
      if (xd.dim() < 1)
        throw Error(c.name, "input has shape (); kfac needs token ids of shape (batch) or (batch, tokens)");
      // The ids as they are (the backend's Scalar at precondition()); tokens over several
      // dimensions are one run of tokens per sample, as torch_tokens reshapes a Linear's.
      return xd.dim() <= 2 ? xd : xd.reshape({xd.size(0), -1});
    }
    case TorchKind::parameter:  // the sample count: any tensor whose first extent is the batch
      if (xd.dim() < 1) throw Error(c.name, "sample count of shape (); expected a tensor of shape (batch, ...)");
      return xd.reshape({xd.size(0), -1});
  }
  return xd;
}

/// The output gradient as kfac sees it, shaped like the call's input.
inline at::Tensor torch_output_grad(const TorchCapture& c, const at::Tensor& g) {
  const bool over_features =
      c.kind == TorchKind::dense || c.kind == TorchKind::layer_norm || c.kind == TorchKind::embedding;
  return over_features && g.dim() > 2 ? torch_tokens(c, g) : g;
}

/// The type-erased Preconditioner: one implementation per Scalar (float, double) and communicator.
class TorchBackend {
 public:
  virtual ~TorchBackend() = default;
  virtual void add(const std::string& name, const Dense& l, const TorchMethod& m) = 0;
  virtual void add(const std::string& name, const Conv2d& l, const TorchMethod& m) = 0;
  virtual void add(const std::string& name, const BatchNorm2d& l, TorchPrecision p) = 0;
  virtual void add(const std::string& name, const LayerNorm& l, TorchPrecision p) = 0;
  virtual void add(const std::string& name, const Embedding& l, const TorchMethod& m) = 0;
  virtual void add(const std::string& name, const Parameter& l, TorchPrecision p) = 0;
  virtual bool wants_observations() const = 0;
  virtual bool wants_observations(const std::string& name) const = 0;
  virtual bool is_skipped(const std::string& name) const = 0;
  /// Tensors contiguous, of the backend's dtype, rank 1 (an Embedding's ids), 2, 3 or 4.
  virtual void observe(const std::string& name, const at::Tensor& x, const at::Tensor& g) = 0;
  /// `b` undefined for a layer without bias.
  virtual void set_gradient(const std::string& name, const at::Tensor& w, const at::Tensor& b) = 0;
  virtual void step() = 0;
  virtual long step_count() const = 0;
  virtual void set_step_count(long step) = 0;
  virtual double last_kl_scale() const = 0;
  virtual const Options& options() const = 0;
  /// The KAISA policy object the Preconditioner was built with (its settings).
  virtual const Kaisa& distribution() const = 0;
  /// The maximum of `v` over the ranks (v itself in a serial run).
  virtual long agree_max(long v) const = 0;
  /// The Preconditioner's checkpoint (save()/load()) as bytes.
  virtual std::string save() const = 0;
  virtual bool load(const std::string& bytes) = 0;
};

using TorchExec = Kokkos::DefaultHostExecutionSpace;

/// \brief The methods a backend can build. Each (method, precision) pair is a block type the
/// backend's translation unit compiles (about 50 per Scalar for `all`), so a front end that
/// offers no choice of method builds `default_only`: K-FAC with eigendecompositions,
/// BatchNorm's or LayerNorm's unit-wise Fisher and Embedding's EmbeddingFisher<>, in the
/// parameters' precision.
enum class TorchMethods { all, default_only };

template <class Scalar, class Comm, TorchMethods Set = TorchMethods::all>
class TorchBackendOf final : public TorchBackend {
 public:
  using preconditioner_type = Preconditioner<Scalar, TorchExec, Comm>;
  TorchBackendOf(Options o, Comm comm) : pre_(std::move(o), TorchExec{}, std::move(comm)) {}
  /// With the distribution's settings on its policy object (`o` then leaves them at their defaults).
  TorchBackendOf(Options o, Comm comm, Kaisa kaisa)
      : pre_(std::move(o), TorchExec{}, std::move(comm), std::move(kaisa)) {}

  void add(const std::string& name, const Dense& l, const TorchMethod& m) override { add_kronecker(name, l, m); }
  void add(const std::string& name, const Conv2d& l, const TorchMethod& m) override { add_kronecker(name, l, m); }
  void add(const std::string& name, const BatchNorm2d& l, TorchPrecision p) override { add_unit_wise(name, l, p); }
  void add(const std::string& name, const LayerNorm& l, TorchPrecision p) override { add_unit_wise(name, l, p); }
  void add(const std::string& name, const Embedding& l, const TorchMethod& m) override { add_embedding(name, l, m); }
  void add(const std::string& name, const Parameter& l, TorchPrecision p) override { add_unit_wise(name, l, p); }
  bool wants_observations() const override { return pre_.wants_observations(); }
  bool wants_observations(const std::string& name) const override { return pre_.wants_observations(name); }
  bool is_skipped(const std::string& name) const override { return pre_.is_skipped(name); }
  void observe(const std::string& name, const at::Tensor& x, const at::Tensor& g) override {
    with_view(x, [&](const auto& v) { pre_.observe_input(name, v); });
    with_view(g, [&](const auto& v) { pre_.observe_output_grad(name, v); });
  }
  void set_gradient(const std::string& name, const at::Tensor& w, const at::Tensor& b) override {
    const auto bias = b.defined() ? adapters::from_raw(b.data_ptr<Scalar>(), n(b, 0))
                                  : adapters::from_raw(static_cast<Scalar*>(nullptr), 0);
    Scalar* wp = w.data_ptr<Scalar>();
    if (w.dim() == 4) pre_.set_gradient(name, adapters::from_raw(wp, n(w, 0), n(w, 1), n(w, 2), n(w, 3)), bias);
    else if (w.dim() == 2) pre_.set_gradient(name, adapters::from_raw(wp, n(w, 0), n(w, 1)), bias);
    else pre_.set_gradient(name, adapters::from_raw(wp, n(w, 0)), bias);
  }
  void step() override { pre_.step(); }
  long step_count() const override { return pre_.step_count(); }
  void set_step_count(long step) override { pre_.set_step_count(step); }
  double last_kl_scale() const override { return pre_.last_kl_scale(); }
  const Options& options() const override { return pre_.options(); }
  const Kaisa& distribution() const override { return pre_.distribution(); }
  long agree_max(long v) const override { return pre_.communicator().allreduce_max(v); }
  std::string save() const override {
    std::ostringstream os;
    pre_.save(os);
    return os.str();
  }
  bool load(const std::string& bytes) override {
    std::istringstream is(bytes);
    return pre_.load(is);
  }

  preconditioner_type& preconditioner() { return pre_; }

 private:
  /// Calls `f` with a read-only view of an observation of rank 1, 2, 3 or 4.
  template <class F>
  static void with_view(const at::Tensor& t, F&& f) {
    const Scalar* p = t.data_ptr<Scalar>();
    if (t.dim() == 4) f(adapters::from_raw(p, n(t, 0), n(t, 1), n(t, 2), n(t, 3)));
    else if (t.dim() == 3) f(adapters::from_raw(p, n(t, 0), n(t, 1), n(t, 2)));
    else if (t.dim() == 2) f(adapters::from_raw(p, n(t, 0), n(t, 1)));
    else f(adapters::from_raw(p, n(t, 0)));
  }
  /// Calls `f` with the Precision<F, D> that `p` names (the Scalar's for TorchPrecision::scalar).
  template <class F>
  static void with_precision(TorchPrecision p, F&& f) {
    switch (p) {
      case TorchPrecision::scalar: return f(Precision<Scalar>{});
      case TorchPrecision::half_float: return f(HalfPrecision{});
      case TorchPrecision::float_float: return f(SinglePrecision{});
      case TorchPrecision::float_double: return f(MixedPrecision{});
      case TorchPrecision::double_double: return f(DoublePrecision{});
      case TorchPrecision::double_float: return f(Precision<double, float>{});
    }
  }
  /// A unit-wise layer's UnitWiseFisher, or a Parameter's DiagonalFisher, in the precision `p` names.
  template <class Layer>
  void add_unit_wise(const std::string& name, const Layer& l, TorchPrecision p) {
    if constexpr (Set == TorchMethods::default_only) {
      if (p != TorchPrecision::scalar) throw Error(name, not_offered(Layer::kind));
      if constexpr (std::is_same<Layer, Parameter>::value)
        pre_.register_layer(name, l, DiagonalFisher<Precision<Scalar>>{});
      else pre_.register_layer(name, l, UnitWiseFisher<UnitWise, Precision<Scalar>>{});
    } else {
      with_precision(p, [&](auto prec) {
        using P = decltype(prec);
        if constexpr (std::is_same<typename P::factor_type, Half>::value)
          throw Error(name, std::string(Layer::kind) +
                                ": half-precision factors are for Kronecker layers; store it in float or double");
        else if constexpr (std::is_same<Layer, Parameter>::value) pre_.register_layer(name, l, DiagonalFisher<P>{});
        else pre_.register_layer(name, l, UnitWiseFisher<UnitWise, P>{});
      });
    }
  }
  /// EmbeddingFisher<Symmetric or Diagonal, Eigendecomposition<>, P> in the precision `m` names,
  /// G decomposed with the settings of `m`'s Eigendecomposition<> (the only method an Embedding
  /// has); default_only: EmbeddingFisher<> in the parameters' precision.
  void add_embedding(const std::string& name, const Embedding& l, const TorchMethod& m) {
    const auto* eigen = std::get_if<Eigendecomposition<>>(&m.method);
    if (!eigen) throw Error(name, "embedding: its method is EmbeddingFisher (G's eigendecomposition), not another one");
    if constexpr (Set == TorchMethods::default_only) {
      if (m.diagonal || m.precision != TorchPrecision::scalar) throw Error(name, not_offered(Embedding::kind));
      pre_.register_layer(name, l, EmbeddingFisher<Symmetric, Eigendecomposition<>, Precision<Scalar>>{*eigen});
    } else {
      with_precision(m.precision, [&](auto prec) {
        using P = decltype(prec);
        if constexpr (std::is_same<typename P::factor_type, Half>::value)
          throw Error(name, "embedding: half-precision factors are for Kronecker layers; store it in float or double");
        else if (m.diagonal) pre_.register_layer(name, l, EmbeddingFisher<Diagonal, Eigendecomposition<>, P>{*eigen});
        else pre_.register_layer(name, l, EmbeddingFisher<Symmetric, Eigendecomposition<>, P>{*eigen});
      });
    }
  }
  template <class Layer>
  void add_kronecker(const std::string& name, const Layer& l, const TorchMethod& m) {
    if constexpr (Set == TorchMethods::default_only) {
      const auto* eigen = std::get_if<Eigendecomposition<>>(&m.method);
      if (!eigen || m.precision != TorchPrecision::scalar) throw Error(name, not_offered(Layer::kind));
      pre_.register_layer(name, l, KFAC<Symmetric, Eigendecomposition<>, Precision<Scalar>>{*eigen});
    } else {
      std::visit(
          [&](const auto& method) {
            using M = std::decay_t<decltype(method)>;
            if constexpr (std::is_same<M, NGSGD>::value) pre_.register_layer(name, l, method);
            else
              with_precision(m.precision, [&](auto prec) {
                pre_.register_layer(name, l, KFAC<Symmetric, M, decltype(prec)>{method});
              });
          },
          m.method);
    }
  }
  static std::size_t n(const at::Tensor& t, int d) { return std::size_t(t.size(d)); }
  static std::string not_offered(const char* kind) {
    return std::string(kind) + ": this front end builds the default method in the parameters' precision only "
                               "(TorchMethods::default_only)";
  }
  preconditioner_type pre_;
};

/// \brief The shared core of both front ends: translation, registration, the precondition()
/// protocol. The front end owns the hooks that fill captures().
class TorchCore {
 public:
  /// \brief Translates every spec (all problems in one kfac::Error), then registers the layers
  /// with a Preconditioner whose Scalar is the parameters' dtype. `make_backend(dtype, options)`
  /// builds it (the front end chooses the communicator).
  template <class MakeBackend>
  TorchCore(const std::vector<TorchModuleSpec>& specs, Options options, adapters::TokenReduction tokens,
            long accumulation_steps, const TorchFrontEnd& front, MakeBackend&& make_backend);

  /// \brief Preconditions every registered module's parameter gradients in place, after the
  /// checks (see TorchPreconditioner::precondition()); drops the observations either way.
  void precondition();

  const std::vector<std::shared_ptr<TorchCapture>>& captures() const { return captures_; }
  std::vector<std::string> modules() const;
  const std::vector<std::string>& skipped() const { return skipped_; }
  const std::vector<std::string>& frozen() const { return frozen_; }
  at::ScalarType dtype() const { return dtype_; }
  TorchBackend& backend() const { return *backend_; }
  long accumulation_steps() const { return accumulation_steps_; }
  /// \brief Whether the output gradients of accumulated micro-batches are multiplied by
  /// accumulation_steps (default: yes, so that G is the one batch's; kfac-pytorch's conventions:
  /// no, its G is the average of the micro-batches' own, of gradients k times smaller).
  void set_rescale_accumulated(bool on) { rescale_accumulated_ = on; }
  /// \brief Whether TokenReduction::expand flattens a Linear's tokens into its batch, as
  /// kfac-pytorch does (A and G both divided by batch x tokens; kfac-pytorch's conventions), instead
  /// of handing (batch, tokens, in) to kfac's Dense (Eschenhagen et al.'s expand: G divided by the
  /// batch; default).
  void set_flatten_tokens(bool on) {
    for (auto& c : captures_)
      c->flatten_tokens = on && c->kind == TorchKind::dense && c->tokens == adapters::TokenReduction::expand;
  }

 private:
  struct Entry {
    std::string name;
    at::Tensor weight, bias;  ///< the parameters (their .grad() is preconditioned)
  };
  std::vector<ModuleProblem> check_observed() const;
  void refresh_wanted();

  const TorchFrontEnd* front_;
  long accumulation_steps_;
  bool rescale_accumulated_ = true;
  at::ScalarType dtype_ = at::ScalarType::Undefined;
  std::unique_ptr<TorchBackend> backend_;
  std::vector<Entry> entries_;
  std::vector<std::shared_ptr<TorchCapture>> captures_;  ///< one per entry
  std::vector<std::string> skipped_;
  std::vector<std::string> frozen_;
};

/// \brief The kfac layer of one spec, or the reason it has none (appended to `problems`).
struct TorchTranslation {
  TorchKind kind = TorchKind::dense;
  std::optional<Dense> dense;
  std::optional<Conv2d> conv;
  std::optional<BatchNorm2d> bn;
  std::optional<LayerNorm> ln;
  std::optional<Embedding> emb;
  std::optional<Parameter> param;
};

inline std::optional<TorchTranslation> torch_translate(const TorchModuleSpec& s, const TorchFrontEnd& front,
                                                       std::string& problem) {
  TorchTranslation t;
  switch (s.type) {
    case TorchModuleSpec::Type::linear:
      t.dense.emplace(index_t(s.in_features), index_t(s.out_features), s.bias.defined());
      return t;
    case TorchModuleSpec::Type::conv2d: {
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
            problem = "padding 'same' with an even dilated kernel pads asymmetrically; kfac supports symmetric padding only";
            return std::nullopt;
          }
          pad[i] = total / 2;
        }
      t.kind = TorchKind::conv2d;
      t.conv.emplace(index_t(s.in_channels), index_t(s.out_channels), index_t(s.kernel[0]), index_t(s.kernel[1]));
      t.conv->with_stride(index_t(s.stride[0]), index_t(s.stride[1])).with_padding(index_t(pad[0]), index_t(pad[1]))
          .with_dilation(index_t(s.dilation[0]), index_t(s.dilation[1])).with_bias(s.bias.defined())
          .with_factor_scaling(s.conv_scaling);
      return t;
    }
    case TorchModuleSpec::Type::batch_norm:
      t.kind = TorchKind::batch_norm;
      t.bn.emplace(index_t(s.num_features));
      return t;
    case TorchModuleSpec::Type::layer_norm:
      if (s.normalized_dims != 1) {
        problem = "normalizes over its last " + std::to_string(s.normalized_dims) +
                  " dimensions; kfac's LayerNorm normalizes over the last one";
        return std::nullopt;
      }
      t.kind = TorchKind::layer_norm;
      t.ln.emplace(index_t(s.num_features), s.bias.defined());
      return t;
    case TorchModuleSpec::Type::embedding: {
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
      t.kind = TorchKind::embedding;
      t.emb.emplace(index_t(vocabulary), index_t(s.embedding_dim));
      if (s.padding_idx) {
        const int64_t p = *s.padding_idx < 0 ? *s.padding_idx + vocabulary : *s.padding_idx;
        if (p < 0 || p >= vocabulary) {
          problem = "padding_idx " + std::to_string(*s.padding_idx) + " is outside its " + std::to_string(vocabulary) +
                    " ids";
          return std::nullopt;
        }
        t.emb->with_padding_index(index_t(p));
      }
      return t;
    }
    case TorchModuleSpec::Type::parameter: {
      const int64_t count = s.weight.defined() ? s.weight.numel() : 0;
      if (count < 1) {
        problem = "is an empty parameter; kfac needs at least one value";
        return std::nullopt;
      }
      const int64_t rows = s.weight.dim() == 0 ? 1 : s.weight.size(0);
      t.kind = TorchKind::parameter;
      t.param.emplace(index_t(rows), index_t(count / rows));
      return t;
    }
    case TorchModuleSpec::Type::other: break;
  }
  problem = std::string("owns parameters but kfac has no layer type for it (supported: ") + front.types + "); " +
            front.skip_hint;
  return std::nullopt;
}

template <class MakeBackend>
TorchCore::TorchCore(const std::vector<TorchModuleSpec>& specs, Options options, adapters::TokenReduction tokens,
                     long accumulation_steps, const TorchFrontEnd& front, MakeBackend&& make_backend)
    : front_(&front), accumulation_steps_(accumulation_steps) {
  if (accumulation_steps < 1)
    throw Error("", std::string(front.accumulation) + " must be >= 1 (got " + std::to_string(accumulation_steps) + ")");
  struct Found {
    const TorchModuleSpec* spec;
    TorchTranslation layer;
  };
  std::vector<Found> found;
  std::vector<std::pair<const void*, std::string>> owners;  // parameter memory -> the module registering it
  std::vector<ModuleProblem> problems;
  for (const TorchModuleSpec& s : specs) {
    if (s.skipped) {
      const std::string why = s.skip_reason.empty() ? "skip list" : s.skip_reason;
      skipped_.push_back(s.name + " (" + s.type_name + ", " + why + ")");
      continue;
    }
    // Frozen (kfac-pytorch skips them too): nothing for the optimizer to update, nothing to precondition.
    if (s.all_frozen) {
      skipped_.push_back(s.name + " (" + s.type_name + ", frozen: requires_grad = false)");
      frozen_.push_back(s.name);
      continue;
    }
    auto problem = [&](const std::string& why) { problems.push_back({s.name, "(" + s.type_name + ") " + why}); };
    std::string why;
    std::optional<TorchTranslation> t = torch_translate(s, front, why);
    if (!t) {
      problem(why);
      continue;
    }
    const bool weight_frozen = !s.weight.requires_grad();
    if (s.bias.defined() && weight_frozen != !s.bias.requires_grad()) {
      problem(std::string("its ") + (weight_frozen ? "weight" : "bias") + " is frozen (requires_grad = false) but its " +
              (weight_frozen ? "bias" : "weight") + " is not; freeze both, or " + front.skip_hint);
      continue;
    }
    for (const at::Tensor* p : {&s.weight, &s.bias}) {  // the first problem of the module only
      const std::string dev = torch_device_problem(*p, "a parameter");
      if (!dev.empty()) why = dev;
      else if (p->defined() && p->scalar_type() != at::kFloat && p->scalar_type() != at::kDouble)
        why = std::string("parameters of dtype ") + c10::toString(p->scalar_type()) + "; kfac supports float32 and float64";
      else if (p->defined() && dtype_ != at::ScalarType::Undefined && p->scalar_type() != dtype_)
        why = std::string("parameters of dtype ") + c10::toString(p->scalar_type()) + " where the other modules' are " +
              c10::toString(dtype_) + "; one model, one dtype";
      else if (p->defined()) dtype_ = p->scalar_type();
      if (!why.empty()) break;
    }
    // Tied weights (an Embedding's weight reused by the head): each module would precondition the
    // one gradient in place for its own factors.
    for (const at::Tensor* p : {&s.weight, &s.bias})
      for (const auto& [memory, owner] : owners)
        if (why.empty() && p->defined() && p->data_ptr() != nullptr && p->data_ptr() == memory)
          why = std::string("its ") + (p == &s.weight ? "weight" : "bias") + " is also a parameter of '" + owner +
                "' (tied weights): kfac preconditions each module's gradient for its own factors; " + front.skip_hint;
    if (!why.empty()) {
      problem(why);
      continue;
    }
    for (const at::Tensor* p : {&s.weight, &s.bias})
      if (p->defined() && p->data_ptr() != nullptr) owners.emplace_back(p->data_ptr(), s.name);
    found.push_back({&s, std::move(*t)});
  }
  // Token ids reach kfac as the Scalar's values: a float holds every integer only up to 2^24.
  constexpr int64_t exact_float_ids = int64_t(1) << 24;
  for (const Found& f : found)
    if (f.layer.emb && dtype_ == at::kFloat && f.spec->num_embeddings > exact_float_ids)
      problems.push_back({f.spec->name, "(" + f.spec->type_name + ") a vocabulary of " +
                                            std::to_string(f.spec->num_embeddings) +
                                            " ids with float32 parameters: kfac reads token ids as float32, exact "
                                            "only up to 2^24 = 16777216; use float64 parameters, or " +
                                            front.skip_hint});
  throw_module_problems(problems, "modules kfac cannot handle");
  if (found.empty())
    throw Error("", std::string("the model has no ") + front.types + " module to precondition");

  backend_ = make_backend(dtype_, std::move(options));
  for (const Found& f : found) {
    const TorchModuleSpec& s = *f.spec;
    if (f.layer.dense)
      backend_->add(s.name, Dense(*f.layer.dense).with_tokens(tokens == adapters::TokenReduction::reduce
                                                                  ? Dense::Tokens::reduce : Dense::Tokens::expand),
                    s.method);
    else if (f.layer.conv) backend_->add(s.name, *f.layer.conv, s.method);
    else if (f.layer.ln) backend_->add(s.name, *f.layer.ln, s.method.precision);
    else if (f.layer.emb) backend_->add(s.name, *f.layer.emb, s.method);
    else if (f.layer.param) backend_->add(s.name, *f.layer.param, s.method.precision);
    else backend_->add(s.name, *f.layer.bn, s.method.precision);
    auto capture = std::make_shared<TorchCapture>();
    capture->name = s.name;
    capture->kind = f.layer.kind;
    capture->tokens = tokens;
    capture->front = front_;
    capture->bn_eps = s.eps;
    captures_.push_back(capture);
    entries_.push_back({s.name, s.weight, s.bias});
  }
  refresh_wanted();
}

inline std::vector<std::string> TorchCore::modules() const {
  std::vector<std::string> v;
  for (const auto& e : entries_) v.push_back(e.name);
  return v;
}

inline std::vector<ModuleProblem> TorchCore::check_observed() const {
  std::vector<ModuleProblem> missing;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    const TorchCapture& c = *captures_[i];
    if (backend_->is_skipped(c.name)) continue;
    std::string why;
    const long k = accumulation_steps_;
    if (!e.weight.requires_grad())
      why = std::string("its parameters were frozen (requires_grad = false) after the ") + front_->preconditioner +
            " was built; build a new one (frozen modules are skipped at construction)";
    else if (!e.weight.grad().defined()) why = "its parameters have no gradient (was backward() run through it?)";
    else if (!torch_device_problem(e.weight.grad(), "its gradient").empty())
      why = torch_device_problem(e.weight.grad(), "its gradient");
    else if (c.wanted && c.inputs.empty())
      why = std::string("not observed: ") + front_->not_observed;
    else if (c.wanted && long(c.inputs.size()) % k != 0)
      why = "observed " + std::to_string(c.inputs.size()) + " times, not a multiple of " + front_->accumulation + " = " +
            std::to_string(k) + " (one call per micro-batch, or the same number of calls in each)";
    else if (c.wanted)
      for (std::size_t j = 0; j < c.grads.size() && why.empty(); ++j)
        if (!c.grads[j].defined())
          why = "the output gradient of call " + std::to_string(j + 1) + " of " + std::to_string(c.grads.size()) +
                " never arrived (no backward() through that output since the forward?)";
    if (!why.empty()) missing.push_back({c.name, why});
  }
  return missing;
}

inline void TorchCore::refresh_wanted() {
  for (auto& c : captures_) {
    c->clear();
    c->wanted = !backend_->is_skipped(c->name) && backend_->wants_observations(c->name);
  }
}

inline void TorchCore::precondition() {
  struct Dropper {  // the observations are dropped however this ends
    TorchCore& self;
    ~Dropper() { self.refresh_wanted(); }
  } dropper{*this};
  // Everything that can fail is checked before kfac sees anything, so that a bad value leaves
  // no observation pending in kfac; and agreed on over the ranks, so that no rank waits in a
  // collective for one that threw.
  std::vector<ModuleProblem> problems = check_observed();
  auto as_kfac = [&](at::Tensor t) { return (t.scalar_type() == dtype_ ? t : t.to(dtype_)).contiguous(); };
  // Each micro-batch's loss was divided by k: its output gradients are 1/k of the per-sample
  // ones kfac's loss reduction expects (G would come out k^2 too small).
  const long k = rescale_accumulated_ ? accumulation_steps_ : 1;
  auto output_grad = [&](const at::Tensor& g) { return k == 1 ? as_kfac(g) : as_kfac(g * double(k)); };
  const bool check_finite = backend_->options().nonfinite == NonFinitePolicy::raise;
  struct Observation {
    const std::string* name;
    at::Tensor x, g;
  };
  std::vector<Observation> observations;
  for (const auto& cp : captures_) {
    const TorchCapture& c = *cp;
    if (!c.wanted || !problems.empty()) continue;
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      Observation o{&c.name, as_kfac(c.inputs[i]), output_grad(torch_output_grad(c, c.grads[i]))};
      if (check_finite && !torch::isfinite(o.x).all().item<bool>())
        problems.push_back({c.name, "non-finite values (NaN/Inf) in its input; nothing was preconditioned"});
      else if (check_finite && !torch::isfinite(o.g).all().item<bool>())
        problems.push_back({c.name, "non-finite values (NaN/Inf) in its output gradient; nothing was preconditioned"});
      observations.push_back(std::move(o));
    }
  }
  const long step = backend_->step_count();
  const long anywhere = backend_->agree_max(problems.empty() ? 0 : 1);
  throw_module_problems(problems, "modules not ready at step " + std::to_string(step));
  if (anywhere) throw Error("", "another rank's modules were not ready at step " + std::to_string(step) +
                                    " (its error names them); nothing was preconditioned");
  for (const auto& o : observations) backend_->observe(*o.name, o.x, o.g);
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (the .grad(), kfac's contiguous copy)
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (backend_->is_skipped(e.name)) continue;
    at::Tensor w = e.weight.grad(), b = e.bias.defined() ? e.bias.grad() : at::Tensor();
    if (e.bias.defined() && !b.defined()) {  // a bias without a gradient counts as 0
      at::Tensor bias = e.bias;
      b = bias.mutable_grad() = torch::zeros_like(bias);
    }
    at::Tensor kw = as_kfac(w), kb = b.defined() ? as_kfac(b) : b;
    if (kw.data_ptr() != w.data_ptr()) copy_back.emplace_back(w, kw);
    if (b.defined() && kb.data_ptr() != b.data_ptr()) copy_back.emplace_back(b, kb);
    if (captures_[i]->kind == TorchKind::parameter)  // any shape, as (rows, rest): a view of kfac's copy
      kw = kw.reshape({kw.dim() == 0 ? 1 : kw.size(0), -1});
    backend_->set_gradient(e.name, kw, kb);
  }
  backend_->step();
  torch::NoGradGuard no_grad;
  for (auto& [grad, copy] : copy_back) grad.copy_(copy);
}

}  // namespace impl
}  // namespace kfac
