#pragma once
/// \file torch_core.hpp
/// \brief The PyTorch adapters' shared core: one translation of modules to kfac layers and one
/// precondition() protocol, used by both front ends — the C++ `TorchPreconditioner`
/// (kfac/adapters/torch.hpp, modules seen through `observed()`) and the Python package
/// (python/, modules seen through forward-pre and full-backward hooks).
///
/// A front end describes each module that owns parameters as a TorchModuleSpec (its name, type,
/// whether its skip list matched it, and the translation its module-type registry found for it:
/// a function that returns the module's TorchLayer or the reason it has none). TorchCore checks
/// them all, names every module it cannot handle in one kfac::Error, picks the Preconditioner's
/// Scalar from the parameters' dtype, registers the layers, and keeps one TorchCapture per module
/// into which the front end's hooks record inputs and output gradients. Nothing here names a
/// layer kind: the built-in kinds' translations are in torch_kinds.hpp, registered by each front
/// end as a user registers a kind of their own. Included by torch.hpp after TorchOptions; not a
/// header of its own for users.

#include <array>
#include <functional>
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
  std::string (*types)();      ///< the module types kfac has a kind for now, as the user spells them
  const char* skip_hint;       ///< how to leave a module to the optimizer alone
  const char* accumulation;    ///< the name of the accumulation setting
  const char* not_observed;    ///< why a module was not observed
  const char* token_hint;      ///< how to choose a token reduction
};

using TorchExec = Kokkos::DefaultHostExecutionSpace;

struct TorchCapture;
/// What kfac sees of a tensor one call of a module recorded (its input, its output gradient).
using TorchView = std::function<at::Tensor(const TorchCapture&, const at::Tensor&)>;

/// \brief One module as kfac sees it: the kfac layer and method a kind's translation built for
/// it (a block factory per Scalar), the parameters whose gradients it preconditions, and how
/// the captured tensors become the observations the layer takes. Built by torch_layer() or a
/// built-in kind's translation (torch_kinds.hpp).
struct TorchLayer {
  std::string kind;         ///< kfac's layer kind ("dense"), as skip lists name it
  at::Tensor weight, bias;  ///< the parameters preconditioned in place; `bias` undefined when absent
  std::function<AnyLayer<float, TorchExec>(const std::string& name)> as_float;    ///< float parameters
  std::function<AnyLayer<double, TorchExec>(const std::string& name)> as_double;  ///< float64 parameters
  TorchView input;        ///< what kfac sees of one call's input (detached, on the CPU); checks it
  TorchView output_grad;  ///< of its output gradient; empty: the gradient as it comes
  /// The weight's gradient as the layer takes it (a view); empty: as it is.
  std::function<at::Tensor(const at::Tensor&)> weight_grad;
  std::function<std::string(at::ScalarType)> dtype_problem;  ///< why the parameters' dtype does not do; empty: any
  bool flattens_tokens = false;  ///< kfac-pytorch's expand flattens its tokens into the batch (Linear)

  template <class Scalar>
  AnyLayer<Scalar, TorchExec> make(const std::string& name) const {
    if constexpr (std::is_same<Scalar, float>::value) return as_float(name);
    else return as_double(name);
  }
};

/// \brief Builds `layer` under `method` for either Scalar: a method whose precision is the
/// Preconditioner's Scalar (every default method) serves float and float64 parameters alike.
/// `input` turns one call's input into the observation the layer takes.
template <class LayerType, class Method>
TorchLayer torch_layer(const LayerType& layer, const Method& method, TorchView input) {
  TorchLayer t;
  t.kind = LayerType::kind;
  t.as_float = [layer, method](const std::string&) { return any_layer<float, TorchExec>(layer, method); };
  t.as_double = [layer, method](const std::string&) { return any_layer<double, TorchExec>(layer, method); };
  t.input = std::move(input);
  return t;
}

/// What a kind's translation is handed besides the module.
struct TorchContext {
  const TorchFrontEnd& front;
  adapters::TokenReduction tokens;  ///< how Linear modules reduce tokens
};
/// One module's translation: its TorchLayer, or std::nullopt with the reason in `problem`.
using TorchTranslate = std::function<std::optional<TorchLayer>(const TorchContext&, std::string& problem)>;

/// \brief One module that owns parameters, as a front end found it.
struct TorchModuleSpec {
  std::string name;       ///< path in the model ("features.0"; "root" for the model itself)
  std::string type_name;  ///< the type as the front end spells it ("torch::nn::Conv2d", "torch.nn.Conv2d")
  bool skipped = false;     ///< left out by the front end: matched by its skip list, or `skip_reason`
  std::string skip_reason;  ///< why, when not the skip list (listed by skipped())
  bool all_frozen = false;  ///< every parameter it owns has requires_grad = false
  TorchTranslate translate;  ///< empty: no kind registered for its type
};

/// What a front end records for one registered module between two precondition() calls.
struct TorchCapture {
  std::string name;
  std::shared_ptr<const TorchLayer> layer;  ///< its observations' shapes
  adapters::TokenReduction tokens = adapters::TokenReduction::none;
  bool flatten_tokens = false;  ///< expand as kfac-pytorch does: tokens flattened into the batch
  const TorchFrontEnd* front = nullptr;
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

/// What kfac sees of one call's input: its kind's view of the detached input (TorchLayer::input).
inline at::Tensor torch_observation(const TorchCapture& c, const at::Tensor& x) {
  const std::string dev = torch_device_problem(x, "the input");
  if (!dev.empty()) throw Error(c.name, dev);
  return c.layer->input(c, x.detach());
}

/// The output gradient as kfac sees it, shaped like the call's input.
inline at::Tensor torch_output_grad(const TorchCapture& c, const at::Tensor& g) {
  return c.layer->output_grad ? c.layer->output_grad(c, g) : g;
}

/// The type-erased Preconditioner: one implementation per Scalar (float, double) and communicator.
class TorchBackend {
 public:
  virtual ~TorchBackend() = default;
  /// Registers `layer` under `name` (its factory of the backend's Scalar).
  virtual void add(const std::string& name, const TorchLayer& layer) = 0;
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

/// \brief The methods a front end's built-in kinds can build (torch_kinds.hpp). Each (method,
/// precision) pair is a block type the front end's translation unit compiles (about 50 per Scalar
/// for `all`), so a front end that offers no choice of method builds `default_only`: K-FAC with
/// eigendecompositions, BatchNorm's or LayerNorm's unit-wise Fisher, Embedding's EmbeddingFisher<>
/// and Parameter's DiagonalFisher<>, in the parameters' precision.
enum class TorchMethods { all, default_only };

/// The Preconditioner of one Scalar and communicator; the block types are the kinds' (TorchLayer).
template <class Scalar, class Comm>
class TorchBackendOf final : public TorchBackend {
 public:
  using preconditioner_type = Preconditioner<Scalar, TorchExec, Comm>;
  TorchBackendOf(Options o, Comm comm) : pre_(std::move(o), TorchExec{}, std::move(comm)) {}
  /// With the distribution's settings on its policy object (`o` then leaves them at their defaults).
  TorchBackendOf(Options o, Comm comm, Kaisa kaisa)
      : pre_(std::move(o), TorchExec{}, std::move(comm), std::move(kaisa)) {}

  void add(const std::string& name, const TorchLayer& layer) override {
    pre_.register_layer(name, layer.template make<Scalar>(name));
  }
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
  static std::size_t n(const at::Tensor& t, int d) { return std::size_t(t.size(d)); }
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
      c->flatten_tokens = on && c->layer->flattens_tokens && c->tokens == adapters::TokenReduction::expand;
  }

 private:
  struct Entry {
    std::string name;
    at::Tensor weight, bias;  ///< the parameters (their .grad() is preconditioned)
  };
  std::vector<ModuleProblem> check_observed() const;
  void refresh_wanted();
  using Owners = std::vector<std::pair<const void*, std::string>>;  ///< parameter memory -> its module
  /// What stops a translated module's parameters from being registered ("": nothing): half
  /// frozen, on another device, of another dtype than the others' (the first sets dtype_), or
  /// tied to a parameter of a module in `owners`.
  std::string parameter_problem(const TorchLayer& t, const Owners& owners);

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

template <class MakeBackend>
TorchCore::TorchCore(const std::vector<TorchModuleSpec>& specs, Options options, adapters::TokenReduction tokens,
                     long accumulation_steps, const TorchFrontEnd& front, MakeBackend&& make_backend)
    : front_(&front), accumulation_steps_(accumulation_steps) {
  if (accumulation_steps < 1)
    throw Error("", std::string(front.accumulation) + " must be >= 1 (got " + std::to_string(accumulation_steps) + ")");
  struct Found {
    const TorchModuleSpec* spec;
    TorchLayer layer;
  };
  std::vector<Found> found;
  Owners owners;
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
    std::optional<TorchLayer> t;
    if (s.translate) t = s.translate(TorchContext{front, tokens}, why);
    else why = "owns parameters but kfac has no layer type for it (supported: " + front.types() + "); " +
               front.skip_hint;
    if (!t) {
      problem(why);
      continue;
    }
    why = parameter_problem(*t, owners);
    if (!why.empty()) {
      problem(why);
      continue;
    }
    for (const at::Tensor* p : {&t->weight, &t->bias})
      if (p->defined() && p->data_ptr() != nullptr) owners.emplace_back(p->data_ptr(), s.name);
    found.push_back({&s, std::move(*t)});
  }
  for (const Found& f : found)  // what only the parameters' dtype decides (an Embedding's ids as float32)
    if (f.layer.dtype_problem) {
      const std::string why = f.layer.dtype_problem(dtype_);
      if (!why.empty()) problems.push_back({f.spec->name, "(" + f.spec->type_name + ") " + why});
    }
  throw_module_problems(problems, "modules kfac cannot handle");
  if (found.empty())
    throw Error("", "the model has no module to precondition (layer types: " + front.types() + ")");

  backend_ = make_backend(dtype_, std::move(options));
  for (const Found& f : found) {
    const TorchModuleSpec& s = *f.spec;
    backend_->add(s.name, f.layer);
    auto capture = std::make_shared<TorchCapture>();
    capture->name = s.name;
    capture->layer = std::make_shared<const TorchLayer>(f.layer);
    capture->tokens = tokens;
    capture->front = front_;
    captures_.push_back(capture);
    entries_.push_back({s.name, f.layer.weight, f.layer.bias});
  }
  refresh_wanted();
}

inline std::string TorchCore::parameter_problem(const TorchLayer& t, const Owners& owners) {
  const TorchFrontEnd& front = *front_;
  std::string why;
  const at::Tensor& weight = t.weight;
  const at::Tensor& bias = t.bias;
  const bool weight_frozen = !weight.requires_grad();
  if (bias.defined() && weight_frozen != !bias.requires_grad()) {
    return std::string("its ") + (weight_frozen ? "weight" : "bias") + " is frozen (requires_grad = false) but its " +
           (weight_frozen ? "bias" : "weight") + " is not; freeze both, or " + front.skip_hint;
  }
  for (const at::Tensor* p : {&weight, &bias}) {  // the first problem of the module only
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
  for (const at::Tensor* p : {&weight, &bias})
    for (const auto& [memory, owner] : owners)
      if (why.empty() && p->defined() && p->data_ptr() != nullptr && p->data_ptr() == memory)
        why = std::string("its ") + (p == &weight ? "weight" : "bias") + " is also a parameter of '" + owner +
              "' (tied weights): kfac preconditions each module's gradient for its own factors; " + front.skip_hint;
  return why;
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
    if (captures_[i]->layer->weight_grad) kw = captures_[i]->layer->weight_grad(kw);  // a view of kfac's copy
    backend_->set_gradient(e.name, kw, kb);
  }
  backend_->step();
  torch::NoGradGuard no_grad;
  for (auto& [grad, copy] : copy_back) grad.copy_(copy);
}

}  // namespace impl
}  // namespace kfac
