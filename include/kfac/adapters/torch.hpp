#pragma once
/// \file torch.hpp
/// \brief Opt-in adapter: K-FAC for a LibTorch (C++ PyTorch) model on the CPU, in a few lines.
///
/// \code
/// #include <kfac/adapters/torch.hpp>
///
/// kfac::adapters::TorchPreconditioner kfac_pre(*model, kfac::Options{}.with_damping(1e-3));
/// // in the model's forward: route each registered module's call through observed()
/// x = kfac::adapters::observed(conv1, x);          // instead of conv1(x)
/// // the training loop:
/// loss.backward();
/// kfac_pre.precondition();                          // between backward() and optimizer.step()
/// optimizer.step();
/// \endcode
///
/// **Registration.** The constructor walks `model.named_modules()` once and registers every
/// `torch::nn::Linear`, `Conv2d`, `BatchNorm2d` (affine), `LayerNorm` (affine, over the last
/// dimension) and `Embedding` (dense gradients; kfac::EmbeddingFisher) under its path ("features.0"),
/// except the modules matched by TorchOptions::with_skip (name patterns with `*` and `?`, or
/// types) and frozen modules (every parameter `requires_grad = false`, as kfac-pytorch skips
/// them; listed by frozen() and skipped()). A module kfac cannot handle — a grouped or depthwise convolution, non-zero padding
/// modes, asymmetric 'same' padding, an Embedding with sparse gradients or scale_grad_by_freq (or,
/// with float32 parameters, more than 2^24 ids), or any other module owning parameters (an
/// EmbeddingBag, a custom module with its own parameters) — is named in a kfac::Error unless it is
/// skipped: its parameters are never left unpreconditioned silently. With
/// TorchOptions::with_fallback(TorchFallback::diagonal), a module with parameters that no registered
/// kind takes (MultiheadAttention with its out_proj, a custom module, a module sharing a parameter)
/// instead has each parameter registered on its own under kfac::DiagonalFisher ("attn.in_proj_weight";
/// a shared parameter once, under its first owner), observed() counting its calls' samples.
///
/// **Inputs.** LibTorch 1.13's C++ modules have no forward hooks (and `forward` is not
/// virtual), so nothing can intercept `conv1(x)`. The least intrusive way that works is a call
/// wrapper: `observed(conv1, x)` runs `conv1(x)` and, for a registered module in training mode
/// with autograd on, on a step that wants observations, keeps a reference to the input (no copy;
/// BatchNorm2d and LayerNorm: the normalized input, computed as the module does; Embedding: its
/// integer ids of shape (batch) or (batch, tokens, ...), read as the Scalar's values at precondition())
/// and hooks the output tensor (`register_hook`) for its gradient. For any other module, or when
/// no TorchPreconditioner is alive, it is just `conv1(x)`. The model needs no access to the
/// preconditioner.
///
/// **precondition()** checks that every registered module due for a factor update was observed
/// (the "hooks never fired" case: a module called as `conv1(x)` or functionally), hands the
/// observations to kfac as unmanaged views over the tensors' memory (a copy only for a
/// non-contiguous tensor), preconditions each parameter's `.grad()` in place (no copy) and
/// drops the observations. Skipped modules' gradients are not touched.
///
/// **Runtime choices** are made here, not by the user: the Preconditioner's Scalar is the
/// parameters' dtype (float32 or float64), the execution space Kokkos's default host space.
/// CPU only: Debian's libtorch-dev is CPU-only, and a CUDA tensor raises a kfac::Error. The
/// communicator is kfac::SerialComm (serial only for now: see docs/torch.md).

#include <torch/torch.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <vector>

#include "kfac/adapters/raw.hpp"
#include "kfac/kfac.hpp"
#if KFAC_HAVE_MPI
#include "kfac/distributed/mpi_comm.hpp"
#endif

namespace kfac {
namespace adapters {

/// \brief How a Linear reduces a (B, T, in) input (tokens), after Eschenhagen et al.,
/// "Kronecker-Factored Approximate Curvature for Modern Neural Network Architectures" (2023).
enum class TokenReduction {
  none,    ///< 3-D inputs raise a kfac::Error naming the module (default)
  expand,  ///< every token is a sample: (B T, in) rows; right when the loss is a mean over all B T tokens
  reduce,  ///< per sequence: inputs averaged and output gradients summed over tokens (K-FAC-reduce)
};

/// \brief What a module with trainable parameters that no registered kind takes gets.
enum class TorchFallback {
  none,      ///< a kfac::Error naming the module, unless TorchOptions::with_skip leaves it out (default)
  diagonal,  ///< each of its parameters on its own: kfac::Parameter under kfac::DiagonalFisher
};

/// \brief The adapter's own settings (kfac's are in kfac::Options).
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | vector<string> | skip | module paths (glob: `*` any run of characters, `?` one) or types (`Conv2d`, `torch::nn::Conv2d`, `torch::nn::Conv2dImpl`, or a kfac kind: `dense`, `conv2d`, ... as registered, `parameter` for the fallback's modules) left out | {} |
/// | TokenReduction | tokens | how Linear modules reduce 3-D inputs | none |
/// | long | accumulation_steps | k: each precondition() follows k micro-batches whose losses were each divided by k (PyTorch's gradient-accumulation recipe); output gradients are multiplied by k so that G is the per-sample factor, as for the one batch of all k micro-batches | 1 |
/// | TorchFallback | fallback | what a module with parameters that no kind takes gets | none: a kfac::Error |
/// | optional<MpiComm> | mpi | (builds with MPI) distribute kfac's work over these ranks | unset: serial |
struct TorchOptions {
  std::vector<std::string> skip;
  TokenReduction tokens = TokenReduction::none;
  long accumulation_steps = 1;
  TorchFallback fallback = TorchFallback::none;

  TorchOptions& with_skip(std::vector<std::string> patterns) { skip = std::move(patterns); return *this; }
  TorchOptions& with_token_reduction(TokenReduction t) { tokens = t; return *this; }
  /// \brief k micro-batches per precondition(), each loss divided by k: the preconditioned
  /// gradient then equals that of one batch of all k micro-batches (checked by the constructor:
  /// k >= 1; by precondition(): each module observed a multiple of k times).
  TorchOptions& with_accumulation_steps(long k) { accumulation_steps = k; return *this; }
  /// \brief TorchFallback::diagonal: every module with trainable parameters that no registered kind
  /// takes (and every module sharing a parameter with another) has each of its parameters registered
  /// on its own under kfac::DiagonalFisher, named "module.parameter"; a shared parameter once.
  TorchOptions& with_fallback(TorchFallback f) { fallback = f; return *this; }
#if KFAC_HAVE_MPI
  std::optional<MpiComm> mpi;
  /// \brief Data-parallel training: kfac's factors are averaged over `comm` (KAISA). The user
  /// still averages the gradients over the ranks before precondition().
  TorchOptions& with_mpi(MpiComm comm) { mpi = std::move(comm); return *this; }
#endif
};

class TorchPreconditioner;

}  // namespace adapters
namespace impl {
struct CppModules;
}  // namespace impl
}  // namespace kfac

#include "kfac/adapters/impl/torch_core.hpp"
#include "kfac/adapters/impl/torch_kinds.hpp"

namespace kfac {

namespace impl {

/// The module classes registered in TorchModuleKinds now, as the user spells them.
inline std::string cpp_module_types();

/// The wording of the C++ front end in the shared core's messages.
inline const TorchFrontEnd& cpp_front_end() {
  static const TorchFrontEnd f{
      "TorchPreconditioner", cpp_module_types,
      "add it to TorchOptions::with_skip to leave it to the optimizer alone", "TorchOptions::accumulation_steps",
      "its forward was not called through kfac::adapters::observed() in training mode with autograd on",
      "state how tokens reduce with TorchOptions::with_token_reduction(TokenReduction::expand or ::reduce)"};
  return f;
}

/// \brief The C++ front end's module types: each LibTorch module class with its kfac kind and
/// translation, the built-in ones first. A module takes the translation of the last registered
/// class it is an instance of (dynamic_cast: a subclass of torch::nn::LinearImpl is a Linear
/// unless its own class is registered).
class TorchModuleKinds {
 public:
  using Translate = std::function<std::optional<TorchLayer>(const torch::nn::Module&, const TorchContext&,
                                                             std::string& problem)>;
  struct Kind {
    std::string kind;       ///< kfac's layer kind, as TorchOptions::with_skip names it
    std::string type_name;  ///< the module class as the user spells it ("torch::nn::Linear")
    std::function<bool(const torch::nn::Module&)> matches;
    Translate translate;
  };
  static TorchModuleKinds& instance() {
    static TorchModuleKinds r;
    return r;
  }
  template <class ModuleImpl, class F>
  void add(std::string kind, F translate) {
    std::lock_guard<std::mutex> lock(mutex_);
    kinds_.push_back(Kind{std::move(kind), type_name_of(c10::demangle(typeid(ModuleImpl).name())),
                          [](const torch::nn::Module& m) { return m.as<ModuleImpl>() != nullptr; },
                          [translate](const torch::nn::Module& m, const TorchContext& ctx, std::string& problem) {
                            return std::optional<TorchLayer>(translate(*m.as<ModuleImpl>(), ctx, problem));
                          }});
  }
  /// The kind `m` takes; nullptr when no registered class matches it.
  std::shared_ptr<const Kind> find(const torch::nn::Module& m) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (std::size_t i = kinds_.size(); i-- > 0;)
      if (kinds_[i].matches(m)) return std::make_shared<const Kind>(kinds_[i]);
    return nullptr;
  }
  /// The registered module classes, each once, in registration order ("torch::nn::Linear, ...").
  std::string type_names() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> seen;
    std::string all;
    for (const Kind& k : kinds_)
      if (std::find(seen.begin(), seen.end(), k.type_name) == seen.end()) {
        all += (seen.empty() ? "" : ", ") + k.type_name;
        seen.push_back(k.type_name);
      }
    return all;
  }
  /// "torch::nn::Conv2d" for a class named "torch::nn::Conv2dImpl" (Module::name() spells it so).
  static std::string type_name_of(std::string n) {
    const std::string impl = "Impl";
    if (n.size() > impl.size() && n.compare(n.size() - impl.size(), impl.size(), impl) == 0)
      n.erase(n.size() - impl.size());
    return n;
  }

 private:
  TorchModuleKinds();
  mutable std::mutex mutex_;
  std::vector<Kind> kinds_;
};

inline std::string cpp_module_types() { return TorchModuleKinds::instance().type_names(); }

/// Module -> its captures, for observed(); one TorchPreconditioner per module at a time. A module
/// has one capture, or with the diagonal fallback one per parameter (each counting its samples).
class TorchRegistry {
 public:
  using Captures = std::vector<std::shared_ptr<TorchCapture>>;
  static TorchRegistry& instance() {
    static TorchRegistry r;
    return r;
  }
  Captures find(const torch::nn::Module* m) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = map_.find(m);
    return it == map_.end() ? Captures{} : it->second;
  }
  bool insert(const torch::nn::Module* m, Captures c) {
    std::lock_guard<std::mutex> lock(mutex_);
    return map_.emplace(m, std::move(c)).second;
  }
  void erase(const torch::nn::Module* m) {
    std::lock_guard<std::mutex> lock(mutex_);
    map_.erase(m);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, Captures> map_;
};

/// "features.*" matches "features.0" and "features.0.conv"; '?' matches one character.
inline bool glob_match(const char* p, const char* s) {
  if (*p == '\0') return *s == '\0';
  if (*p == '*') return glob_match(p + 1, s) || (*s != '\0' && glob_match(p, s + 1));
  return *s != '\0' && (*p == '?' || *p == *s) && glob_match(p + 1, s + 1);
}

}  // namespace impl

namespace adapters {

/// \brief Runs `module(x, rest...)`; for a module registered with a TorchPreconditioner, in training
/// mode, with autograd on and on a step that wants observations, also records the input and
/// hooks the output for its gradient, or for a module under the diagonal fallback only counts the
/// call's samples (any forward: `observed(attn, q, k, v)`). Works with any module holder
/// (`torch::nn::Linear`, ...) or `std::shared_ptr` to a module. A registered module whose forward
/// returns no tensor (and has a kind) is a kfac::Error naming it.
template <class ModuleRef, class... Rest>
auto observed(ModuleRef& module, const at::Tensor& x, Rest&&... rest);

/// \brief One module as kfac sees it (impl::TorchLayer): the layer and method, the parameters
/// it preconditions, and how a call's input (and output gradient) become its observations.
using TorchLayer = impl::TorchLayer;
/// What a translation is handed besides the module: the front end's wording and token reduction.
using TorchContext = impl::TorchContext;
using impl::torch_layer;

/// \brief Registers a LibTorch module class as a kfac kind, for every TorchPreconditioner built
/// afterwards: a module that is a `ModuleImpl` (or derives from it, unless its own class is
/// registered) is translated by `translate(const ModuleImpl&, const TorchContext&, std::string&
/// problem)`, which returns its TorchLayer (`torch_layer(layer, method, input)` builds one), or
/// std::nullopt with the reason kfac cannot handle the module in `problem`. `kind` is the layer's
/// kind as TorchOptions::with_skip names it. The built-in kinds (Linear, Conv2d, BatchNorm2d,
/// LayerNorm, Embedding) are registered the same way; registering one of their classes again
/// replaces its translation. docs/torch.md, "A module kind of your own".
template <class ModuleImpl, class Translate>
void register_torch_module(std::string kind, Translate translate) {
  impl::TorchModuleKinds::instance().add<ModuleImpl>(std::move(kind), std::move(translate));
}

/// \brief K-FAC for the Linear, Conv2d, BatchNorm2d, LayerNorm and Embedding modules of a LibTorch model (CPU).
/// Under MPI (TorchOptions::with_mpi) every rank builds one from the same model and calls
/// precondition() at every step; a check that fails on one rank fails on all.
/// See the file description for the protocol; docs/torch.md for the whole page.
class TorchPreconditioner {
 public:
  /// \brief Registers every supported module of `model` (see the file description).
  /// \param model [in] the root module; `*model` for a module holder or shared pointer.
  /// \param options [in] kfac's settings (damping, intervals, loss reduction, ...).
  /// \param torch_options [in] the skip list and the token reduction.
  /// \throws kfac::Error naming the modules kfac cannot handle, parameters on a GPU, or dtypes
  ///         other than float32/float64 (or mixed).
  explicit TorchPreconditioner(const torch::nn::Module& model, Options options = Options{},
                               TorchOptions torch_options = TorchOptions{});
  ~TorchPreconditioner();
  TorchPreconditioner(const TorchPreconditioner&) = delete;
  TorchPreconditioner& operator=(const TorchPreconditioner&) = delete;

  /// \brief Preconditions every registered module's parameter gradients in place. Call after
  /// `backward()` and before `optimizer.step()`. On a factor-update step every registered
  /// module must have been observed (see observed()).
  /// \throws kfac::Error naming every module that was not observed, whose output gradient
  ///         never arrived, whose parameters have no gradient or were frozen after construction,
  ///         or observed a number of times that is not a multiple of
  ///         TorchOptions::accumulation_steps; kfac's own errors otherwise.
  ///         The observations are dropped either way; kfac's state is unchanged.
  void precondition();

  /// \brief The registered module paths, in model order.
  std::vector<std::string> modules() const;
  /// \brief Modules with parameters that were left out, with the reason ("skip list",
  /// "frozen: requires_grad = false").
  const std::vector<std::string>& skipped() const { return core_->skipped(); }
  /// \brief The paths of the modules left out because their parameters were frozen
  /// (`requires_grad = false`) when the preconditioner was built; the optimizer alone sees them.
  const std::vector<std::string>& frozen() const { return core_->frozen(); }
  /// \brief The parameters' dtype, which is the Preconditioner's Scalar.
  at::ScalarType dtype() const { return core_->dtype(); }
  /// \brief True when the next precondition() updates some module's statistics.
  bool wants_observations() const { return core_->backend().wants_observations(); }
  long step_count() const { return core_->backend().step_count(); }
  /// Preconditioner::set_step_count: every module gets statistics and a decomposition next.
  void set_step_count(long step) { core_->backend().set_step_count(step); }
  double last_kl_scale() const { return core_->backend().last_kl_scale(); }
  /// \brief The Preconditioner underneath, for checkpoints (save/load), memory reports and
  /// inspection. \throws kfac::Error when Scalar is not the parameters' dtype or Comm not the
  /// communicator in use (SerialComm, or MpiComm under TorchOptions::with_mpi).
  template <class Scalar, class Comm = SerialComm>
  Preconditioner<Scalar, impl::TorchExec, Comm>& preconditioner();

 private:
  bool is_skipped(const std::string& name, const torch::nn::Module& m, const std::string& kind) const;
  /// Hands observed() each registered module's captures (impl::TorchRegistry).
  void register_captures(const impl::CppModules& found);

  TorchOptions torch_options_;
  std::unique_ptr<impl::TorchCore> core_;
  std::vector<const torch::nn::Module*> registered_;  ///< in the order of core_->captures()
};

}  // namespace adapters
}  // namespace kfac

#include "kfac/adapters/impl/torch_impl.hpp"
