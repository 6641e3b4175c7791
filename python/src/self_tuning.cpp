// kfac._kfac.SelfTuning: kfac::SelfTuning (include/kfac/adaptive/self_tuning.hpp) for the Python
// package's kfac.SelfTuning (python/kfac/self_tuning.py, docs/self_tuning.md). Its own translation
// unit, registered by register_self_tuning() from the module init in kfac_python.cpp: the
// preconditioner's bindings and these compile in parallel.
//
// The object owns one flat buffer per parameter (torch tensors of the parameters' dtype, whose
// memory kfac::SelfTuning reads and rewrites): Python copies the gradient in before capture(),
// the preconditioned gradient in before solve(), and the update out after it. Own buffers rather
// than the .grad tensors themselves, because autograd may replace a .grad between steps
// (zero_grad(set_to_none=True)) while kfac::SelfTuning keeps the buffers it registered.
#include <torch/extension.h>
#undef CHECK

#include <pybind11/stl.h>

#include <Kokkos_Core.hpp>
#include <kfac/adaptive/self_tuning.hpp>
#include <kfac/core/comm_precision.hpp>
#include <kfac/core/hash.hpp>
#include <kfac/distributed/serial_comm.hpp>
#if KFAC_HAVE_MPI
#include <kfac/distributed/mpi_comm.hpp>
#endif
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "torch_dist_comm.hpp"

namespace py = pybind11;

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;

py::dict step_dict(const kfac::AdaptiveStep& s) {
  py::dict d;
  d["alpha"] = s.alpha;
  d["mu"] = s.mu;
  d["momentum"] = s.momentum;
  d["linear_term"] = s.linear_term;
  d["curvature_term"] = s.curvature_term;
  d["damping_term"] = s.damping_term;
  d["predicted"] = s.predicted;
  d["damping"] = s.damping;
  return d;
}

py::dict update_dict(const kfac::DampingUpdate& u) {
  py::dict d;
  d["rho"] = u.rho;
  d["loss_change"] = u.loss_change;
  d["damping_before"] = u.damping_before;
  d["damping"] = u.damping;
  return d;
}

kfac::LossCurvature curvature_of(const std::string& kind) {
  if (kind == "softmax_cross_entropy") return kfac::LossCurvature::softmax_cross_entropy;
  if (kind == "squared_error") return kfac::LossCurvature::squared_error;
  if (kind == "sigmoid_cross_entropy") return kfac::LossCurvature::sigmoid_cross_entropy;
  throw kfac::Error("", "loss curvature '" + kind +
                            "': expected 'softmax_cross_entropy', 'squared_error' or 'sigmoid_cross_entropy'");
}

kfac::Adaptive adaptive_from(const py::dict& d) {
  kfac::Adaptive a;
  const auto real = [&](const char* key, double fallback) {
    return d.contains(key) ? d[key].cast<double>() : fallback;
  };
  const auto flag = [&](const char* key, bool fallback) { return d.contains(key) ? d[key].cast<bool>() : fallback; };
  a.with_initial_damping(real("initial_damping", a.initial_damping))
      .with_damping_bounds(real("min_damping", a.min_damping), real("max_damping", a.max_damping))
      .with_update_interval(d.contains("update_interval") ? d["update_interval"].cast<long>() : a.update_interval)
      .with_damping_decay(real("damping_decay", a.damping_decay))
      .with_thresholds(real("lower_threshold", a.lower_threshold), real("upper_threshold", a.upper_threshold))
      .with_weight_decay(real("weight_decay", a.weight_decay))
      .with_momentum(flag("use_momentum", a.use_momentum))
      .with_damping_adaptation(flag("adapt_damping", a.adapt_damping))
      .with_rho_including_damping(flag("rho_includes_damping", a.rho_includes_damping))
      .with_solve_interval(d.contains("solve_interval") ? d["solve_interval"].cast<long>() : a.solve_interval)
      .with_solve_warmup(d.contains("solve_warmup") ? d["solve_warmup"].cast<long>() : a.solve_warmup);
  return a;
}

/// The products of one solve, as Python hands them (tensors of the parameters' dtype).
struct Products {
  at::Tensor outputs, along_proposal, along_previous;  ///< (batch, outputs); undefined when not given
  std::string loss;
  std::string reduction;
  double loss_scale = 1.0;
};

/// kfac::SelfTuning of one Scalar and communicator, behind a type-erased interface.
class Tuner {
 public:
  virtual ~Tuner() = default;
  virtual void capture() = 0;
  virtual bool needs_previous_product() const = 0;
  virtual at::Tensor previous_update(std::size_t i) const = 0;
  virtual bool wants_loss_change() const = 0;
  virtual kfac::AdaptiveStep solve(const Products& p) = 0;
  virtual bool wants_products() const = 0;
  virtual kfac::AdaptiveStep apply_last() = 0;
  virtual long steps() const = 0;
  virtual kfac::DampingUpdate update_damping(double before, double after) = 0;
  virtual double lambda() const = 0;
  virtual double damping() const = 0;
  virtual long solves() const = 0;
  virtual long damping_updates() const = 0;
  virtual kfac::AdaptiveStep last_step() const = 0;
  virtual kfac::DampingUpdate last_damping_update() const = 0;
  virtual std::string save() const = 0;
  virtual void load(const std::string& bytes) = 0;
};

template <class Scalar, class Comm>
class TunerOf final : public Tuner {
 public:
  using tuning_type = kfac::SelfTuning<Scalar, Exec, Comm>;
  using view_type = typename tuning_type::products_type::view_type;

  TunerOf(const kfac::Adaptive& settings, Comm comm, const std::vector<std::string>& names,
          const std::vector<at::Tensor>& buffers)
      : tune_(settings, Exec{}, std::move(comm)), names_(names), buffers_(buffers) {
    for (std::size_t i = 0; i < names.size(); ++i) {
      Kokkos::View<Scalar*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(
          buffers[i].data_ptr<Scalar>(), std::size_t(buffers[i].numel()));
      tune_.add_parameter(names[i], v);
    }
  }
  void capture() override { tune_.capture_gradient(); }
  bool needs_previous_product() const override { return tune_.needs_previous_product(); }
  at::Tensor previous_update(std::size_t i) const override {
    const auto u = tune_.previous_update(names_.at(i));
    return torch::from_blob(const_cast<Scalar*>(u.data()), {int64_t(u.extent(0))}, buffers_.at(i).options()).clone();
  }
  bool wants_loss_change() const override { return tune_.wants_loss_change(); }
  kfac::AdaptiveStep solve(const Products& p) override {
    kfac::OutputProducts<Scalar, Exec> o;
    o.loss = curvature_of(p.loss);
    if (p.reduction != "mean" && p.reduction != "sum")
      throw kfac::Error("", "loss reduction '" + p.reduction + "': expected 'mean' or 'sum'");
    o.reduction = p.reduction == "mean" ? kfac::LossReduction::mean : kfac::LossReduction::sum;
    o.loss_scale = p.loss_scale;
    o.outputs = view(p.outputs);
    o.along_proposal = view(p.along_proposal);
    o.along_previous = view(p.along_previous);
    return tune_.solve(o);
  }
  bool wants_products() const override { return tune_.wants_products(); }
  kfac::AdaptiveStep apply_last() override { return tune_.apply_last(); }
  long steps() const override { return tune_.steps(); }
  kfac::DampingUpdate update_damping(double before, double after) override {
    return tune_.update_damping(before, after);
  }
  double lambda() const override { return tune_.lambda(); }
  double damping() const override { return tune_.damping()(0); }
  long solves() const override { return tune_.solves(); }
  long damping_updates() const override { return tune_.damping_updates(); }
  kfac::AdaptiveStep last_step() const override { return tune_.last_step(); }
  kfac::DampingUpdate last_damping_update() const override { return tune_.last_damping_update(); }
  std::string save() const override {
    std::ostringstream os;
    tune_.save(os);
    return os.str();
  }
  void load(const std::string& bytes) override {
    std::istringstream is(bytes);
    tune_.load(is);
  }

 private:
  /// A (batch, outputs) view of a contiguous 2-D tensor of Scalar (checked by Python), or an
  /// empty view for an undefined tensor: kfac::SelfTuning names what is missing.
  static view_type view(const at::Tensor& t) {
    if (!t.defined()) return view_type();
    return view_type(t.data_ptr<Scalar>(), std::size_t(t.size(0)), std::size_t(t.size(1)));
  }
  tuning_type tune_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> buffers_;
};

template <class Scalar, class Comm>
std::unique_ptr<Tuner> tuner_of(const kfac::Adaptive& a, Comm comm, const std::vector<std::string>& names,
                                const std::vector<at::Tensor>& buffers) {
  return std::make_unique<TunerOf<Scalar, Comm>>(a, std::move(comm), names, buffers);
}

template <class Comm>
std::unique_ptr<Tuner> tuner_for(bool dbl, const kfac::Adaptive& a, Comm comm, const std::vector<std::string>& names,
                                 const std::vector<at::Tensor>& buffers) {
  if (dbl) return tuner_of<double>(a, std::move(comm), names, buffers);
  return tuner_of<float>(a, std::move(comm), names, buffers);
}

class PySelfTuning;
std::set<PySelfTuning*>& live() {
  static std::set<PySelfTuning*> s;
  return s;
}

/// The Python object: the buffers and the tuner. Built after a KFACPreconditioner (which starts
/// Kokkos); release() frees kfac's state before Kokkos is finalized at exit.
class PySelfTuning {
 public:
  /// \param names [in] the parameters' names, in the order of `sizes`
  /// \param sizes [in] their element counts
  /// \param dtype [in] 'float' or 'double'
  /// \param settings [in] kfac::Adaptive's settings by name, and the communicator (process_group,
  /// mpi_comm) the preconditioner was built with
  PySelfTuning(const std::vector<std::string>& names, const std::vector<int64_t>& sizes, const std::string& dtype,
               const py::dict& settings) {
    if (!Kokkos::is_initialized())
      throw kfac::Error("", "SelfTuning: build the KFACPreconditioner first (Kokkos is not running)");
    if (names.size() != sizes.size() || names.empty())
      throw kfac::Error("", "SelfTuning: expected one size per parameter name, and at least one parameter");
    if (dtype != "float" && dtype != "double")
      throw kfac::Error("", "SelfTuning: parameters of dtype '" + dtype + "'; expected float32 or float64");
    const bool dbl = dtype == "double";
    for (const int64_t n : sizes) buffers_.push_back(torch::zeros({n}, dbl ? at::kDouble : at::kFloat));
    const kfac::Adaptive a = adaptive_from(settings);
#if KFAC_HAVE_MPI
    if (settings.contains("mpi_comm") && !settings["mpi_comm"].is_none()) {
      const MPI_Comm c = MPI_Comm_f2c(MPI_Fint(settings["mpi_comm"].attr("py2f")().cast<int>()));
      tuner_ = tuner_for(dbl, a, kfac::MpiComm(c), names, buffers_);
    }
#endif
    using kfac::python::TorchDistComm;
    if (!tuner_ && settings.contains("process_group") && !settings["process_group"].is_none())
      tuner_ = tuner_for(dbl, a, TorchDistComm(settings["process_group"].cast<TorchDistComm::PG>()), names, buffers_);
    if (!tuner_) tuner_ = tuner_for(dbl, a, kfac::SerialComm{}, names, buffers_);
    live().insert(this);
  }
  ~PySelfTuning() { live().erase(this); }
  PySelfTuning(const PySelfTuning&) = delete;
  PySelfTuning& operator=(const PySelfTuning&) = delete;

  void release() { tuner_.reset(); }
  Tuner& tuner() const {
    if (!tuner_) throw kfac::Error("", "this SelfTuning was released at interpreter exit");
    return *tuner_;
  }
  const std::vector<at::Tensor>& buffers() const { return buffers_; }

 private:
  std::vector<at::Tensor> buffers_;
  std::unique_ptr<Tuner> tuner_;
};

at::Tensor optional_tensor(const py::object& o) { return o.is_none() ? at::Tensor() : o.cast<at::Tensor>(); }

}  // namespace

/// Registers _kfac.SelfTuning and _kfac.release_self_tuning (called by kfac_python.cpp's module init).
void register_self_tuning(py::module_& m) {
  py::class_<PySelfTuning>(m, "SelfTuning")
      .def(py::init<const std::vector<std::string>&, const std::vector<int64_t>&, const std::string&,
                    const py::dict&>(),
           py::arg("names"), py::arg("sizes"), py::arg("dtype"), py::arg("settings"))
      .def("buffers", &PySelfTuning::buffers, "The flat buffers kfac reads and rewrites, one per parameter")
      .def("capture", [](PySelfTuning& p) { p.tuner().capture(); })
      .def("needs_previous_product", [](const PySelfTuning& p) { return p.tuner().needs_previous_product(); })
      .def("previous_update", [](const PySelfTuning& p, std::size_t i) { return p.tuner().previous_update(i); })
      .def("wants_loss_change", [](const PySelfTuning& p) { return p.tuner().wants_loss_change(); })
      .def(
          "solve",
          [](PySelfTuning& p, const py::object& outputs, const py::object& along_proposal,
             const py::object& along_previous, const std::string& loss, const std::string& reduction,
             double loss_scale) {
            Products pr;
            pr.outputs = optional_tensor(outputs);
            pr.along_proposal = optional_tensor(along_proposal);
            pr.along_previous = optional_tensor(along_previous);
            pr.loss = loss;
            pr.reduction = reduction;
            pr.loss_scale = loss_scale;
            return step_dict(p.tuner().solve(pr));
          },
          py::arg("outputs"), py::arg("along_proposal"), py::arg("along_previous"), py::arg("loss"),
          py::arg("reduction"), py::arg("loss_scale"))
      .def("update_damping",
           [](PySelfTuning& p, double before, double after) {
             return update_dict(p.tuner().update_damping(before, after));
           })
      .def("lambda_", [](const PySelfTuning& p) { return p.tuner().lambda(); })
      .def("damping", [](const PySelfTuning& p) { return p.tuner().damping(); })
      .def("solves", [](const PySelfTuning& p) { return p.tuner().solves(); })
      .def("steps", [](const PySelfTuning& p) { return p.tuner().steps(); })
      .def("wants_products", [](const PySelfTuning& p) { return p.tuner().wants_products(); })
      .def("apply_last", [](PySelfTuning& p) { return step_dict(p.tuner().apply_last()); })
      .def("damping_updates", [](const PySelfTuning& p) { return p.tuner().damping_updates(); })
      .def("last_step", [](const PySelfTuning& p) { return step_dict(p.tuner().last_step()); })
      .def("last_damping_update", [](const PySelfTuning& p) { return update_dict(p.tuner().last_damping_update()); })
      .def("save", [](const PySelfTuning& p) { return py::bytes(p.tuner().save()); })
      .def("load", [](PySelfTuning& p, const py::bytes& b) { p.tuner().load(std::string(b)); })
      .def("release", &PySelfTuning::release);
  m.def(
      "release_self_tuning",
      [] {
        for (PySelfTuning* p : live()) p->release();
      },
      "Frees every SelfTuning's kfac state (before Kokkos is finalized at exit)");
}
