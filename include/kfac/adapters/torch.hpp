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
/// `torch::nn::Linear`, `Conv2d` and `BatchNorm2d` (affine) under its path ("features.0"),
/// except the modules matched by TorchOptions::with_skip (name patterns with `*` and `?`, or
/// types) and frozen modules (every parameter `requires_grad = false`, as kfac-pytorch skips
/// them; listed by frozen() and skipped()). A module kfac cannot handle — a grouped or depthwise convolution, non-zero padding
/// modes, asymmetric 'same' padding, or any other module owning parameters (an Embedding, a
/// LayerNorm, a custom module with its own parameters) — is named in a kfac::Error unless it is
/// skipped: its parameters are never left unpreconditioned silently.
///
/// **Inputs.** LibTorch 1.13's C++ modules have no forward hooks (and `forward` is not
/// virtual), so nothing can intercept `conv1(x)`. The least intrusive way that works is a call
/// wrapper: `observed(conv1, x)` runs `conv1(x)` and, for a registered module in training mode
/// with autograd on, on a step that wants observations, keeps a reference to the input (no copy;
/// BatchNorm2d: the normalized input, computed with the batch statistics as the module does)
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
#include <memory>
#include <mutex>
#include <string>
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

/// \brief The adapter's own settings (kfac's are in kfac::Options).
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | vector<string> | skip | module paths (glob: `*` any run of characters, `?` one) or types (`Conv2d`, `torch::nn::Conv2d`, `torch::nn::Conv2dImpl`, kfac kinds `dense`, `conv2d`, `batch_norm`) left out | {} |
/// | TokenReduction | tokens | how Linear modules reduce 3-D inputs | none |
/// | long | accumulation_steps | k: each precondition() follows k micro-batches whose losses were each divided by k (PyTorch's gradient-accumulation recipe); output gradients are multiplied by k so that G is the per-sample factor, as for the one batch of all k micro-batches | 1 |
/// | optional<MpiComm> | mpi | (builds with MPI) distribute kfac's work over these ranks | unset: serial |
struct TorchOptions {
  std::vector<std::string> skip;
  TokenReduction tokens = TokenReduction::none;
  long accumulation_steps = 1;

  TorchOptions& with_skip(std::vector<std::string> patterns) { skip = std::move(patterns); return *this; }
  TorchOptions& with_token_reduction(TokenReduction t) { tokens = t; return *this; }
  /// \brief k micro-batches per precondition(), each loss divided by k: the preconditioned
  /// gradient then equals that of one batch of all k micro-batches (checked by the constructor:
  /// k >= 1; by precondition(): each module observed a multiple of k times).
  TorchOptions& with_accumulation_steps(long k) { accumulation_steps = k; return *this; }
#if KFAC_HAVE_MPI
  std::optional<MpiComm> mpi;
  /// rief Data-parallel training: kfac's factors are averaged over `comm` (KAISA). The user
  /// still averages the gradients over the ranks before precondition().
  TorchOptions& with_mpi(MpiComm comm) { mpi = std::move(comm); return *this; }
#endif
};

class TorchPreconditioner;

}  // namespace adapters

namespace impl {

enum class TorchKind { dense, conv2d, batch_norm };
struct ModuleProblem;

/// What observed() records for one registered module between two precondition() calls.
struct TorchCapture {
  std::string name;
  TorchKind kind = TorchKind::dense;
  adapters::TokenReduction tokens = adapters::TokenReduction::none;
  double bn_eps = 1e-5;
  bool wanted = true;   ///< the next step updates this module's statistics
  long generation = 0;  ///< bumped when the observations are dropped; stale hooks then do nothing
  std::mutex mutex;     ///< hooks may run on autograd's threads
  std::vector<at::Tensor> inputs, grads;  ///< per call: the input kfac sees, its output gradient
  std::vector<long> tokens_per_row;       ///< per call: T for TokenReduction::reduce, else 1

  void clear() {
    std::lock_guard<std::mutex> lock(mutex);
    inputs.clear();
    grads.clear();
    tokens_per_row.clear();
    ++generation;
  }
};

/// Module -> capture, for observed(); one TorchPreconditioner per module at a time.
class TorchRegistry {
 public:
  static TorchRegistry& instance() {
    static TorchRegistry r;
    return r;
  }
  std::shared_ptr<TorchCapture> find(const torch::nn::Module* m) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = map_.find(m);
    return it == map_.end() ? nullptr : it->second;
  }
  bool insert(const torch::nn::Module* m, std::shared_ptr<TorchCapture> c) {
    std::lock_guard<std::mutex> lock(mutex_);
    return map_.emplace(m, std::move(c)).second;
  }
  void erase(const torch::nn::Module* m) {
    std::lock_guard<std::mutex> lock(mutex_);
    map_.erase(m);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<TorchCapture>> map_;
};

/// "features.*" matches "features.0" and "features.0.conv"; '?' matches one character.
inline bool glob_match(const char* p, const char* s) {
  if (*p == '\0') return *s == '\0';
  if (*p == '*') return glob_match(p + 1, s) || (*s != '\0' && glob_match(p, s + 1));
  return *s != '\0' && (*p == '?' || *p == *s) && glob_match(p + 1, s + 1);
}

inline std::string torch_device_problem(const at::Tensor& t, const char* what) {
  if (!t.defined() || t.device().is_cpu()) return {};
  return std::string(what) + " is on " + t.device().str() +
         "; kfac's LibTorch adapter works on CPU tensors only (Debian's libtorch-dev is CPU-only)";
}

/// The type-erased Preconditioner: one implementation per Scalar (float, double).
class TorchBackend {
 public:
  virtual ~TorchBackend() = default;
  virtual void add(const std::string& name, const Dense& l) = 0;
  virtual void add(const std::string& name, const Conv2d& l) = 0;
  virtual void add(const std::string& name, const BatchNorm2d& l) = 0;
  virtual bool wants_observations() const = 0;
  virtual bool wants_observations(const std::string& name) const = 0;
  virtual bool is_skipped(const std::string& name) const = 0;
  /// Tensors contiguous, of the backend's dtype, rank 2 or 4.
  virtual void observe(const std::string& name, const at::Tensor& x, const at::Tensor& g) = 0;
  /// `b` undefined for a layer without bias.
  virtual void set_gradient(const std::string& name, const at::Tensor& w, const at::Tensor& b) = 0;
  virtual void step() = 0;
  virtual long step_count() const = 0;
  virtual double last_kl_scale() const = 0;
  virtual const Options& options() const = 0;
  /// The maximum of `v` over the ranks (v itself in a serial run).
  virtual long agree_max(long v) const = 0;
};

using TorchExec = Kokkos::DefaultHostExecutionSpace;

template <class Scalar, class Comm>
class TorchBackendOf final : public TorchBackend {
 public:
  using preconditioner_type = Preconditioner<Scalar, TorchExec, Comm>;
  TorchBackendOf(Options o, Comm comm) : pre_(std::move(o), TorchExec{}, std::move(comm)) {}

  void add(const std::string& name, const Dense& l) override { pre_.register_layer(name, l); }
  void add(const std::string& name, const Conv2d& l) override { pre_.register_layer(name, l); }
  void add(const std::string& name, const BatchNorm2d& l) override { pre_.register_layer(name, l); }
  bool wants_observations() const override { return pre_.wants_observations(); }
  bool wants_observations(const std::string& name) const override { return pre_.wants_observations(name); }
  bool is_skipped(const std::string& name) const override { return pre_.is_skipped(name); }
  void observe(const std::string& name, const at::Tensor& x, const at::Tensor& g) override {
    const Scalar* xp = x.data_ptr<Scalar>();
    const Scalar* gp = g.data_ptr<Scalar>();
    if (x.dim() == 4) pre_.observe_input(name, adapters::from_raw(xp, n(x, 0), n(x, 1), n(x, 2), n(x, 3)));
    else pre_.observe_input(name, adapters::from_raw(xp, n(x, 0), n(x, 1)));
    if (g.dim() == 4) pre_.observe_output_grad(name, adapters::from_raw(gp, n(g, 0), n(g, 1), n(g, 2), n(g, 3)));
    else pre_.observe_output_grad(name, adapters::from_raw(gp, n(g, 0), n(g, 1)));
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
  double last_kl_scale() const override { return pre_.last_kl_scale(); }
  const Options& options() const override { return pre_.options(); }
  long agree_max(long v) const override { return pre_.communicator().allreduce_max(v); }

  preconditioner_type& preconditioner() { return pre_; }

 private:
  static std::size_t n(const at::Tensor& t, int d) { return std::size_t(t.size(d)); }
  preconditioner_type pre_;
};

}  // namespace impl

namespace adapters {

/// \brief Runs `module(x)`; for a module registered with a TorchPreconditioner, in training
/// mode, with autograd on and on a step that wants observations, also records the input and
/// hooks the output for its gradient. Works with any module holder (`torch::nn::Linear`, ...)
/// or `std::shared_ptr` to a module.
template <class ModuleRef>
at::Tensor observed(ModuleRef& module, const at::Tensor& x);

/// \brief K-FAC for the Linear, Conv2d and BatchNorm2d modules of a LibTorch model (CPU).
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
  const std::vector<std::string>& skipped() const { return skipped_; }
  /// \brief The paths of the modules left out because their parameters were frozen
  /// (`requires_grad = false`) when the preconditioner was built; the optimizer alone sees them.
  const std::vector<std::string>& frozen() const { return frozen_; }
  /// \brief The parameters' dtype, which is the Preconditioner's Scalar.
  at::ScalarType dtype() const { return dtype_; }
  /// \brief True when the next precondition() updates some module's statistics.
  bool wants_observations() const { return backend_->wants_observations(); }
  long step_count() const { return backend_->step_count(); }
  double last_kl_scale() const { return backend_->last_kl_scale(); }
  /// \brief The Preconditioner underneath, for checkpoints (save/load), memory reports and
  /// inspection. \throws kfac::Error when Scalar is not the parameters' dtype or Comm not the
  /// communicator in use (SerialComm, or MpiComm under TorchOptions::with_mpi).
  template <class Scalar, class Comm = SerialComm>
  Preconditioner<Scalar, impl::TorchExec, Comm>& preconditioner();

 private:
  struct Entry {
    std::shared_ptr<impl::TorchCapture> capture;
    const torch::nn::Module* module;
    at::Tensor weight, bias;  ///< the parameters (their .grad() is preconditioned)
  };
  void register_module(const std::string& name, const std::shared_ptr<torch::nn::Module>& m,
                       std::vector<std::string>& problems);
  bool is_skipped(const std::string& name, const torch::nn::Module& m) const;
  std::vector<impl::ModuleProblem> check_observed() const;
  void refresh_wanted();

  TorchOptions torch_options_;
  at::ScalarType dtype_ = at::ScalarType::Undefined;
  std::unique_ptr<impl::TorchBackend> backend_;
  std::vector<Entry> entries_;
  std::vector<std::string> skipped_;
  std::vector<std::string> frozen_;
};

}  // namespace adapters
}  // namespace kfac

#include "kfac/adapters/impl/torch_impl.hpp"
