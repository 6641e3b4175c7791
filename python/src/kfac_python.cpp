// kfac._kfac: the Python package's extension module (docs/python.md). A thin layer over the
// PyTorch adapters' shared core (kfac/adapters/impl/torch_core.hpp): the Python side finds the
// modules and owns the hooks; this module turns their descriptions into TorchModuleSpecs, builds
// the impl::TorchCore, records what the hooks see, and runs precondition(). One translation unit.
#include <torch/extension.h>
// LibTorch's logging (glog) defines CHECK; kfac does not use it, but keep the names clean.
#undef CHECK

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <Kokkos_Core.hpp>
#include <chrono>
#include <kfac/adapters/torch.hpp>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "torch_dist_comm.hpp"

namespace py = pybind11;
using kfac::impl::TorchModuleSpec;

// python/src/self_tuning.cpp: _kfac.SelfTuning (kfac::SelfTuning), its own translation unit.
void register_self_tuning(py::module_& m);
using kfac::python::TorchDistComm;

namespace {

// ---- Kokkos: initialised on first use, finalised at exit -----------------------------------
// Not at import: Python programs fork after `import` (DataLoader workers, torch.multiprocessing),
// and a child must not inherit a started runtime it cannot use.

class PyPreconditioner;
std::set<PyPreconditioner*>& live() {
  static std::set<PyPreconditioner*> s;
  return s;
}
bool& kokkos_started_here() {
  static bool b = false;
  return b;
}
bool& finalized() {
  static bool b = false;
  return b;
}

void ensure_kokkos() {
  if (finalized()) throw kfac::Error("", "kfac was finalized (interpreter exit); no new preconditioner can be built");
  if (!Kokkos::is_initialized()) {
    Kokkos::initialize();
    kokkos_started_here() = true;
  }
}

// ---- hyperparameters: a constant Python can replace (load_state_dict), or a Python callable --------
template <class T>
struct Cell {
  std::function<T(long)> fn;  ///< empty: the constant
  T value{};
};

template <class T>
void set_cell(Cell<T>& c, const py::object& v) {
  if (PyCallable_Check(v.ptr())) {
    c.fn = v.cast<std::function<T(long)>>();
  } else {
    c.fn = nullptr;
    c.value = v.cast<T>();
  }
}

struct Hyper {
  Cell<double> lr, damping, factor_decay, kl_clip;
  Cell<long> factor_update_steps, inv_update_steps;

  Cell<double>* real(const std::string& name) {
    if (name == "lr") return &lr;
    if (name == "damping") return &damping;
    if (name == "factor_decay") return &factor_decay;
    if (name == "kl_clip") return &kl_clip;
    return nullptr;
  }
  Cell<long>* integer(const std::string& name) {
    if (name == "factor_update_steps") return &factor_update_steps;
    if (name == "inv_update_steps") return &inv_update_steps;
    return nullptr;
  }
  void set(const std::string& name, const py::object& v) {
    if (auto* c = real(name)) set_cell(*c, v);
    else if (auto* i = integer(name)) set_cell(*i, v);
    else throw kfac::Error("", "unknown hyperparameter '" + name + "'");
  }
};

template <class T>
kfac::Hyperparameter<T> from_cell(std::shared_ptr<Hyper> h, Cell<T> Hyper::*cell) {
  return kfac::Hyperparameter<T>(std::function<T(long)>([h, cell](long step) {
    const Cell<T>& c = (*h).*cell;
    return c.fn ? c.fn(step) : c.value;
  }));
}

template <class E>
E choice(const py::dict& d, const char* key, std::initializer_list<std::pair<const char*, E>> values, E fallback) {
  if (!d.contains(key) || d[key].is_none()) return fallback;
  const std::string v = py::str(d[key]);
  std::string all;
  for (const auto& [name, e] : values) {
    if (v == name) return e;
    all += (all.empty() ? "'" : ", '") + std::string(name) + "'";
  }
  throw kfac::Error("", std::string(key) + " = '" + v + "': expected one of " + all);
}

/// kfac::Options from the Python package's settings (hyperparameters through the cells).
kfac::Options options_from(const py::dict& d, const std::shared_ptr<Hyper>& h) {
  kfac::Options o;
  o.with_lr(from_cell(h, &Hyper::lr))
      .with_damping(from_cell(h, &Hyper::damping))
      .with_factor_decay(from_cell(h, &Hyper::factor_decay))
      .with_kl_clip(from_cell(h, &Hyper::kl_clip))
      .with_factor_update_steps(from_cell(h, &Hyper::factor_update_steps))
      .with_inv_update_steps(from_cell(h, &Hyper::inv_update_steps));
  o.with_loss_reduction(choice(d, "loss_reduction", {{"mean", kfac::LossReduction::mean}, {"sum", kfac::LossReduction::sum}},
                               kfac::LossReduction::mean));
  o.with_nonfinite_policy(choice(d, "nonfinite", {{"raise", kfac::NonFinitePolicy::raise}, {"skip", kfac::NonFinitePolicy::skip}},
                                 kfac::NonFinitePolicy::raise));
  if (d.contains("precompute_reciprocal")) o.with_precompute_reciprocal(d["precompute_reciprocal"].cast<bool>());
  o.with_initial_factors(choice(d, "initial_factors",
                                {{"batch", kfac::InitialFactors::batch}, {"identity", kfac::InitialFactors::identity}},
                                kfac::InitialFactors::batch));
  if (d.contains("decomposition_delay")) o.with_decomposition_delay(d["decomposition_delay"].cast<long>());
  return o;
}

/// The KAISA distribution policy from the Python package's settings (kfac-pytorch's
/// grad_worker_fraction, assignment_strategy, colocate_factors, allreduce_bucket_cap_mb).
kfac::Kaisa kaisa_from(const py::dict& d) {
  kfac::Kaisa k;
  k.with_assignment_cost(choice(d, "assignment_cost",
                                {{"compute", kfac::AssignmentCost::compute}, {"memory", kfac::AssignmentCost::memory}},
                                kfac::AssignmentCost::compute));
  if (d.contains("grad_worker_fraction")) k.with_grad_worker_fraction(d["grad_worker_fraction"].cast<double>());
  if (d.contains("colocate_factors")) k.with_colocate_factors(d["colocate_factors"].cast<bool>());
  if (d.contains("bucket_bytes")) k.with_bucket_bytes(d["bucket_bytes"].cast<std::size_t>());
  return k;
}

/// The backend of the parameters' dtype over `comm`, its distribution set by `kaisa`.
template <class Comm>
std::unique_ptr<kfac::impl::TorchBackend> backend_for(at::ScalarType dtype, kfac::Options o, Comm comm,
                                                      const kfac::Kaisa& kaisa) {
  if (dtype == at::kDouble)
    return std::make_unique<kfac::impl::TorchBackendOf<double, Comm>>(std::move(o), std::move(comm), kaisa);
  return std::make_unique<kfac::impl::TorchBackendOf<float, Comm>>(std::move(o), std::move(comm), kaisa);
}

std::shared_ptr<Hyper> hyper_from(const py::dict& d) {
  auto h = std::make_shared<Hyper>();
  const std::pair<const char*, py::object> defaults[] = {
      {"lr", py::float_(0.1)},          {"damping", py::float_(0.001)},       {"factor_decay", py::float_(0.95)},
      {"kl_clip", py::float_(0.001)},   {"factor_update_steps", py::int_(1)}, {"inv_update_steps", py::int_(1)}};
  for (const auto& [name, fallback] : defaults) h->set(name, d.contains(name) ? py::object(d[name]) : fallback);
  return h;
}

template <class T, std::size_t N>
std::array<T, N> pair_of(const py::handle& v) {
  std::array<T, N> a{};
  if (py::isinstance<py::int_>(v)) a.fill(v.cast<T>());
  else {
    const auto seq = v.cast<std::vector<T>>();
    if (seq.size() != N) throw kfac::Error("", "expected " + std::to_string(N) + " values");
    std::copy(seq.begin(), seq.end(), a.begin());
  }
  return a;
}

/// One module's method from its Python object (kfac/methods.py: Method._core_spec), settings
/// under the C++ objects' names; the Python side has checked them and resolved the precision.
kfac::impl::TorchMethod method_from(const std::string& module, const py::dict& m) {
  using kfac::impl::TorchPrecision;
  kfac::impl::TorchMethod t;
  t.precision = choice(m, "precision",
                       {{"scalar", TorchPrecision::scalar},
                        {"half_float", TorchPrecision::half_float},
                        {"float_float", TorchPrecision::float_float},
                        {"float_double", TorchPrecision::float_double},
                        {"double_double", TorchPrecision::double_double},
                        {"double_float", TorchPrecision::double_float}},
                       TorchPrecision::scalar);
  const std::string kind = m["kind"].cast<std::string>();
  const auto real = [&](const char* key) { return m[key].cast<double>(); };
  const auto integer = [&](const char* key) { return m[key].cast<long>(); };
  const auto flag = [&](const char* key) { return m[key].cast<bool>(); };
  if (kind == "eigen") {
    t.method = kfac::Eigendecomposition<>{}
                   .with_jacobi_sweeps(int(integer("jacobi_sweeps")))
                   .with_refresh_tolerance(real("refresh_tolerance"));
  } else if (kind == "randomized_eigen") {
    t.method = kfac::RandomizedEigen<>{}
                   .with_rank(int(integer("rank")))
                   .with_oversampling(int(integer("oversampling")))
                   .with_power_iterations(int(integer("power_iterations")))
                   .with_warm_start(flag("warm_start"))
                   .with_factored_damping(flag("factored_damping"))
                   .with_seed(m["seed"].cast<std::uint64_t>());
  } else if (kind == "cholesky") {
    t.method = kfac::Cholesky<>{}.with_pi_damping(flag("pi_damping")).with_damping_on_each_factor(
        flag("damping_on_each_factor"));
  } else if (kind == "newton_schulz") {
    t.method = kfac::NewtonSchulz{}
                   .with_max_iterations(int(integer("max_iterations")))
                   .with_tolerance(real("tolerance"))
                   .with_pi_damping(flag("pi_damping"));
  } else if (kind == "ngsgd") {
    kfac::NGSGD n;
    if (!m["rank_in"].is_none()) n.with_rank_in(integer("rank_in"));
    if (!m["rank_out"].is_none()) n.with_rank_out(integer("rank_out"));
    n.with_update_period(integer("update_period"))
        .with_initial_updates(integer("initial_updates"))
        .with_init_iterations(integer("init_iterations"))
        .with_num_samples_history(real("num_samples_history"))
        .with_alpha(real("alpha"))
        .with_epsilon(real("epsilon"))
        .with_delta(real("delta"))
        .with_eta_cap(real("eta_cap"))
        .with_symmetry_breaker(real("symmetry_breaker"))
        .with_relative_d_floor(flag("relative_d_floor"));
    t.method = n;
  } else if (kind == "embedding_fisher") {  // G's eigendecomposition, or diag(G) alone
    t.method = kfac::Eigendecomposition<>{}
                   .with_jacobi_sweeps(int(integer("jacobi_sweeps")))
                   .with_refresh_tolerance(real("refresh_tolerance"));
    t.diagonal = flag("diagonal");
  } else if (kind != "unit_wise_fisher" && kind != "diagonal_fisher") {  // only their precision is read
    throw kfac::Error(module, "method '" + kind + "': not one of kfac.methods'");
  }
  return t;
}

// ---- the core's kinds: the layer a module description of each kind becomes -------------------
// Python maps module classes onto these kinds (kfac.register_module, kfac/modules.py); a kind of
// its own needs a layer policy, which only C++ can define (docs/python.md).

using kfac::impl::TorchLayer;
using Methods = kfac::impl::TorchMethods;
/// One kind's reading of a module description (its settings, weight and bias) into its layer.
using KindReader = std::function<std::optional<TorchLayer>(const py::dict&, const kfac::impl::TorchMethod&,
                                                           const kfac::impl::TorchContext&, std::string& problem)>;

at::Tensor tensor_or_none(const py::dict& d, const char* key) {
  return d.contains(key) && !d[key].is_none() ? d[key].cast<at::Tensor>() : at::Tensor();
}

/// The core's kinds by name (the 'type' of a module description).
struct CoreKinds {
  std::map<std::string, KindReader> readers;
  CoreKinds();
  void add(const std::string& name, KindReader read) { readers[name] = std::move(read); }
};
CoreKinds& core_kinds() {
  static CoreKinds kinds;
  return kinds;
}

/// The built-in kinds, every method and precision (kfac.methods offers them all).
CoreKinds::CoreKinds() {
  constexpr Methods all = Methods::all;
  using kfac::impl::TorchContext;
  using kfac::impl::TorchMethod;
  add("linear", [](const py::dict& d, const TorchMethod& m, const TorchContext& ctx, std::string&) {
    return kfac::impl::torch_linear<all>(d["in_features"].cast<int64_t>(), d["out_features"].cast<int64_t>(),
                                         tensor_or_none(d, "weight"), tensor_or_none(d, "bias"), m, ctx);
  });
  add("conv2d", [](const py::dict& d, const TorchMethod& m, const TorchContext&, std::string& problem) {
    kfac::impl::TorchConv2dSettings s;
    s.in_channels = d["in_channels"].cast<int64_t>();
    s.out_channels = d["out_channels"].cast<int64_t>();
    s.groups = d["groups"].cast<int64_t>();
    s.kernel = pair_of<int64_t, 2>(d["kernel_size"]);
    s.stride = pair_of<int64_t, 2>(d["stride"]);
    s.dilation = pair_of<int64_t, 2>(d["dilation"]);
    const py::object pad = d["padding"];
    if (py::isinstance<py::str>(pad)) {
      const std::string p = pad.cast<std::string>();
      s.padding_same = p == "same";
      if (p != "same" && p != "valid")
        throw kfac::Error(d["name"].cast<std::string>(), "padding '" + p + "': expected 'same', 'valid' or numbers");
    } else {
      s.padding = pair_of<int64_t, 2>(pad);
    }
    s.padding_mode = d["padding_mode"].cast<std::string>();
    // kfac-pytorch's Conv2d factor scaling (docs/python.md, Conventions).
    if (d.contains("conventions") && d["conventions"].cast<std::string>() == "kfac-pytorch")
      s.scaling = kfac::Conv2d::FactorScaling::kfac_pytorch;
    return kfac::impl::torch_conv2d<all>(s, tensor_or_none(d, "weight"), tensor_or_none(d, "bias"), m, problem);
  });
  add("batch_norm", [](const py::dict& d, const TorchMethod& m, const TorchContext&, std::string&) {
    return kfac::impl::torch_batch_norm<all>(d["num_features"].cast<int64_t>(), d["eps"].cast<double>(),
                                             tensor_or_none(d, "weight"), tensor_or_none(d, "bias"), m.precision);
  });
  add("layer_norm", [](const py::dict& d, const TorchMethod& m, const TorchContext&, std::string& problem) {
    const int64_t dims = d.contains("normalized_dims") ? d["normalized_dims"].cast<int64_t>() : 1;
    return kfac::impl::torch_layer_norm<all>(d["num_features"].cast<int64_t>(), dims, d["eps"].cast<double>(),
                                             tensor_or_none(d, "weight"), tensor_or_none(d, "bias"), m.precision,
                                             problem);
  });
  add("embedding", [](const py::dict& d, const TorchMethod& m, const TorchContext& ctx, std::string& problem) {
    kfac::impl::TorchEmbeddingSettings s;
    s.num_embeddings = d["num_embeddings"].cast<int64_t>();
    s.embedding_dim = d["embedding_dim"].cast<int64_t>();
    if (!d["padding_idx"].is_none()) s.padding_idx = d["padding_idx"].cast<int64_t>();
    s.sparse = d["sparse"].cast<bool>();
    s.scale_grad_by_freq = d["scale_grad_by_freq"].cast<bool>();
    return kfac::impl::torch_embedding<all>(s, tensor_or_none(d, "weight"), m, ctx.front, problem);
  });
  add("parameter", [](const py::dict& d, const TorchMethod& m, const TorchContext&, std::string& problem) {
    return kfac::impl::torch_parameter<all>(tensor_or_none(d, "weight"), m.precision, problem);
  });
}

/// A Python callable (tensor -> tensor) as a view of a capture: the module's own translation of
/// its observations (kfac.register_module's input= and output_grad=).
kfac::impl::TorchView python_view(py::object f) {
  auto held = std::make_shared<py::object>(std::move(f));
  return [held](const kfac::impl::TorchCapture& c, const at::Tensor& t) {
    py::gil_scoped_acquire gil;
    const py::object seen = (*held)(t);
    if (!THPVariable_Check(seen.ptr()))
      throw kfac::Error(c.name, "its observation function returned a " +
                                    std::string(py::str(py::type::of(seen).attr("__name__"))) + ", not a tensor");
    return seen.cast<at::Tensor>();
  };
}

/// One module's description from the Python side (kfac/preconditioner.py: _describe): its kind
/// ('type'), read by that kind when the core registers it.
TorchModuleSpec spec_from(const py::dict& d) {
  TorchModuleSpec s;
  s.name = d["name"].cast<std::string>();
  s.type_name = d["type_name"].cast<std::string>();
  s.skipped = d.contains("skipped") && d["skipped"].cast<bool>();
  if (d.contains("skip_reason")) s.skip_reason = d["skip_reason"].cast<std::string>();
  s.all_frozen = d.contains("all_frozen") && d["all_frozen"].cast<bool>();
  const std::string type = d["type"].cast<std::string>();
  if (type == "other") return s;
  const auto kind = core_kinds().readers.find(type);
  if (kind == core_kinds().readers.end()) throw kfac::Error(s.name, "kind '" + type + "': not one of the core's kinds");
  kfac::impl::TorchMethod method;
  if (d.contains("method")) method = method_from(s.name, d["method"].cast<py::dict>());
  const KindReader read = kind->second;
  s.translate = [d, method, read](const kfac::impl::TorchContext& ctx, std::string& problem) {
    std::optional<TorchLayer> t = read(d, method, ctx, problem);
    if (t && d.contains("input") && !d["input"].is_none()) t->input = python_view(d["input"]);
    if (t && d.contains("output_grad") && !d["output_grad"].is_none()) t->output_grad = python_view(d["output_grad"]);
    return t;
  };
  return s;
}

/// The module classes registered with kfac.register_module now, as Python spells them.
std::string python_module_types() {
  py::gil_scoped_acquire gil;
  return py::module_::import("kfac.preconditioner").attr("_registered_types")().cast<std::string>();
}

const kfac::impl::TorchFrontEnd& python_front_end() {
  static const kfac::impl::TorchFrontEnd f{
      "KFACPreconditioner", python_module_types,
      "add its name or class to skip_layers to leave it to the optimizer alone", "accumulation_steps",
      "its forward-pre hook did not fire on this factor-update step (was it called in training mode, with autograd "
      "on, through module(x) rather than functionally?)",
      "choose how tokens reduce with token_reduction='expand' or 'reduce'"};
  return f;
}

/// One preconditioner: the shared core plus the hyperparameter cells.
class PyPreconditioner {
 public:
  PyPreconditioner(const py::list& modules, const py::dict& settings) {
    ensure_kokkos();
    hyper_ = hyper_from(settings);
    std::vector<TorchModuleSpec> specs;
    for (const auto& m : modules) specs.push_back(spec_from(m.cast<py::dict>()));
    const auto tokens = choice(settings, "token_reduction",
                               {{"none", kfac::adapters::TokenReduction::none},
                                {"expand", kfac::adapters::TokenReduction::expand},
                                {"reduce", kfac::adapters::TokenReduction::reduce}},
                               kfac::adapters::TokenReduction::none);
    const long k = settings.contains("accumulation_steps") ? settings["accumulation_steps"].cast<long>() : 1;
    const kfac::Kaisa kaisa = kaisa_from(settings);
    core_ = std::make_unique<kfac::impl::TorchCore>(
        specs, options_from(settings, hyper_), tokens, k, python_front_end(),
        [&](at::ScalarType dtype, kfac::Options o) -> std::unique_ptr<kfac::impl::TorchBackend> {
#if KFAC_HAVE_MPI
          // Data-parallel over an mpi4py communicator (its Fortran handle: no mpi4py headers needed).
          if (settings.contains("mpi_comm") && !settings["mpi_comm"].is_none()) {
            const MPI_Comm c = MPI_Comm_f2c(MPI_Fint(settings["mpi_comm"].attr("py2f")().cast<int>()));
            return backend_for(dtype, std::move(o), kfac::MpiComm(c), kaisa);
          }
#endif
          // Data-parallel: kfac's factors averaged over torch.distributed's default group (KAISA).
          if (settings.contains("process_group") && !settings["process_group"].is_none())
            return backend_for(dtype, std::move(o), TorchDistComm(settings["process_group"].cast<TorchDistComm::PG>()),
                               kaisa);
          return backend_for(dtype, std::move(o), kfac::SerialComm{}, kaisa);
        });
    if (settings.contains("rescale_accumulated")) core_->set_rescale_accumulated(settings["rescale_accumulated"].cast<bool>());
    if (settings.contains("flatten_tokens")) core_->set_flatten_tokens(settings["flatten_tokens"].cast<bool>());
    live().insert(this);
  }
  ~PyPreconditioner() {
    live().erase(this);
  }
  PyPreconditioner(const PyPreconditioner&) = delete;
  PyPreconditioner& operator=(const PyPreconditioner&) = delete;

  /// Frees kfac's state before Kokkos is finalized at exit; the object is then unusable.
  void release() { core_.reset(); }

  kfac::impl::TorchCore& core() const {
    if (!core_) throw kfac::Error("", "this KFACPreconditioner was released at interpreter exit");
    return *core_;
  }
  void observe_input(std::size_t i, const at::Tensor& x) {
    auto& c = *core().captures().at(i);
    c.add_input(kfac::impl::torch_observation(c, x));
  }
  bool observe_output_grad(std::size_t i, const at::Tensor& g) { return core().captures().at(i)->set_latest_grad(g); }
  std::vector<bool> wanted() const {
    std::vector<bool> w;
    for (const auto& c : core().captures()) w.push_back(c->wanted);
    return w;
  }
  void set_hyperparameter(const std::string& name, const py::object& v) { hyper_->set(name, v); }
  py::bytes save() const { return py::bytes(core().backend().save()); }
  bool load(const py::bytes& b) { return core().backend().load(std::string(b)); }

 private:
  std::shared_ptr<Hyper> hyper_;
  std::unique_ptr<kfac::impl::TorchCore> core_;
};

void finalize() {
  for (PyPreconditioner* p : live()) p->release();
  if (kokkos_started_here() && Kokkos::is_initialized()) Kokkos::finalize();
  finalized() = true;
}

// ---- the C++ adapter on the same model, for the tests' equality check ---------------------------
// A LibTorch twin of tests/test_python.py's RefNet (same module names, same forward), driven by
// kfac::adapters::TorchPreconditioner through observed().
struct RefNetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  RefNetImpl(int64_t flat, int64_t classes) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).stride({2, 1}).padding({1, 2}).dilation({1, 2})));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(4));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 5, 3).padding(1).bias(false)));
    fc1 = register_module("fc1", torch::nn::Linear(flat, 6));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(6, classes).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x) {
    using kfac::adapters::observed;
    at::Tensor h = torch::relu(observed(bn1, observed(conv1, x)));
    h = torch::relu(observed(conv2, h)).flatten(1);
    return observed(fc2, torch::relu(observed(fc1, h)));
  }
};

/// RefNet with the given parameters (by name), of their dtype.
std::shared_ptr<RefNetImpl> refnet_with(const py::dict& params) {
  const at::Tensor w1 = params["fc1.weight"].cast<at::Tensor>(), w2 = params["fc2.weight"].cast<at::Tensor>();
  auto net = std::make_shared<RefNetImpl>(w1.size(1), w2.size(0));
  net->to(w1.scalar_type());
  torch::NoGradGuard no_grad;
  for (auto& p : net->named_parameters()) p.value().copy_(params[py::str(p.key())].cast<at::Tensor>());
  return net;
}

/// Runs the C++ adapter for len(batches) steps on RefNet with the given parameters; returns,
/// per step, the preconditioned gradients by parameter name and the KL-clip scale.
py::list cpp_adapter_steps(const py::dict& params, const py::list& batches, const py::dict& settings) {
  ensure_kokkos();
  auto net = refnet_with(params);
  kfac::adapters::TorchPreconditioner kp(*net, options_from(settings, hyper_from(settings)));
  std::vector<std::pair<at::Tensor, at::Tensor>> xy;
  for (const auto& b : batches) xy.push_back(b.cast<std::pair<at::Tensor, at::Tensor>>());
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> steps;
  std::vector<double> scales;
  {
    py::gil_scoped_release no_gil;  // LibTorch's autograd engine refuses to run holding the GIL
    for (const auto& [x, y] : xy) {
      net->zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
      kp.precondition();
      steps.emplace_back();
      for (const auto& p : net->named_parameters()) steps.back().emplace_back(p.key(), p.value().grad().clone());
      scales.push_back(kp.last_kl_scale());
    }
  }
  py::list out;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    py::dict grads;
    for (const auto& [name, g] : steps[i]) grads[py::str(name)] = g;
    out.append(py::make_tuple(grads, scales[i]));
  }
  return out;
}

/// Benchmark helper: seconds per step of RefNet's forward, backward and (with_kfac) the C++
/// adapter's precondition(), over `steps` steps on one batch, after `warmup` untimed ones.
double cpp_adapter_seconds_per_step(const py::dict& params, const at::Tensor& x, const at::Tensor& y,
                                    const py::dict& settings, int warmup, int steps, bool with_kfac) {
  ensure_kokkos();
  auto net = refnet_with(params);
  std::optional<kfac::adapters::TorchPreconditioner> kp;
  if (with_kfac) kp.emplace(*net, options_from(settings, hyper_from(settings)));
  py::gil_scoped_release no_gil;
  std::chrono::steady_clock::time_point start;
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) start = std::chrono::steady_clock::now();
    net->zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    if (kp) kp->precondition();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
}

}  // namespace

PYBIND11_MODULE(_kfac, m) {
  m.doc() = "kfac's extension module: the shared PyTorch core (use the package kfac, not this module)";
  // kfac::Error as kfac.KFACError (a RuntimeError) with the same text and the layer name.
  static PyObject* kfac_error = PyErr_NewException("kfac.KFACError", PyExc_RuntimeError, nullptr);
  m.add_object("KFACError", py::handle(kfac_error).inc_ref());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kfac::Error& e) {
      py::object inst = py::reinterpret_borrow<py::object>(kfac_error)(e.what());
      inst.attr("layer") = e.layer();
      PyErr_SetObject(kfac_error, inst.ptr());
    }
  });

  py::class_<PyPreconditioner>(m, "Core")
      .def(py::init<const py::list&, const py::dict&>(), py::arg("modules"), py::arg("settings"))
      .def("observe_input", &PyPreconditioner::observe_input)
      .def("observe_output_grad", &PyPreconditioner::observe_output_grad)
      .def("precondition", [](PyPreconditioner& p) { p.core().precondition(); })
      .def("wanted", &PyPreconditioner::wanted)
      .def("wants_observations", [](const PyPreconditioner& p) { return p.core().backend().wants_observations(); })
      .def("modules", [](const PyPreconditioner& p) { return p.core().modules(); })
      .def("skipped", [](const PyPreconditioner& p) { return p.core().skipped(); })
      .def("frozen", [](const PyPreconditioner& p) { return p.core().frozen(); })
      .def("dtype", [](const PyPreconditioner& p) { return std::string(c10::toString(p.core().dtype())); })
      .def("step_count", [](const PyPreconditioner& p) { return p.core().backend().step_count(); })
      .def("set_step_count", [](PyPreconditioner& p, long step) { p.core().backend().set_step_count(step); })
      .def("last_kl_scale", [](const PyPreconditioner& p) { return p.core().backend().last_kl_scale(); })
      .def("distribution",
           [](const PyPreconditioner& p) {
             const kfac::Kaisa& k = p.core().backend().distribution();
             py::dict d;
             d["grad_worker_fraction"] = k.grad_worker_fraction;
             d["assignment_cost"] = k.assignment_cost == kfac::AssignmentCost::memory ? "memory" : "compute";
             d["colocate_factors"] = k.colocate_factors;
             d["bucket_bytes"] = k.bucket_bytes;
             return d;
           })
      .def("set_hyperparameter", &PyPreconditioner::set_hyperparameter)
      .def("save", &PyPreconditioner::save)
      .def("load", &PyPreconditioner::load)
      .def("release", &PyPreconditioner::release);
  register_self_tuning(m);
  m.def("finalize", &finalize, "Frees every preconditioner's state and finalizes Kokkos (registered with atexit)");
  m.def("kokkos_initialized", [] { return Kokkos::is_initialized(); });
  m.def("core_kinds", [] {
    std::vector<std::string> v;
    for (const auto& k : core_kinds().readers) v.push_back(k.first);
    return v;
  }, "The kinds a module class can be mapped onto (kfac.register_module)");
#if KFAC_HAVE_MPI
  m.def("has_mpi", [] { return true; }, "True when built with MPI (mpi_comm= works)");
#else
  m.def("has_mpi", [] { return false; }, "True when built with MPI (mpi_comm= works)");
#endif
  m.def("_cpp_adapter_steps", &cpp_adapter_steps, "Test helper: the C++ TorchPreconditioner on RefNet");
  m.def("_cpp_adapter_seconds_per_step", &cpp_adapter_seconds_per_step,
        "Benchmark helper: seconds per step of RefNet with the C++ TorchPreconditioner (or without)");
}
