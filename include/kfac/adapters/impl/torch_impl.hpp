#pragma once
/// \file torch_impl.hpp
/// \brief Definitions for kfac/adapters/torch.hpp (included at its end).

#include <optional>
#include <utility>

namespace kfac {
namespace impl {

/// The module type as written in C++ ("torch::nn::Conv2d") from Module::name().
inline std::string torch_type_name(const torch::nn::Module& m) {
  std::string n = m.name();
  const std::string impl = "Impl";
  if (n.size() > impl.size() && n.compare(n.size() - impl.size(), impl.size(), impl) == 0)
    n.erase(n.size() - impl.size());
  return n;
}

template <class Scalar, class Comm>
using CppTorchBackend = TorchBackendOf<Scalar, Comm>;

/// The built-in kinds, registered as a user's kind is (adapters::register_torch_module). The
/// LibTorch front end offers no choice of method (the Python package does), so it compiles the
/// default ones only (TorchMethods::default_only).
inline TorchModuleKinds::TorchModuleKinds() {
  constexpr TorchMethods Set = TorchMethods::default_only;
  namespace nn = torch::nn;
  add<nn::LinearImpl>(Dense::kind, [](const nn::LinearImpl& l, const TorchContext& ctx, std::string&) {
    const auto& o = l.options;
    return torch_linear<Set>(o.in_features(), o.out_features(), l.weight, o.bias() ? l.bias : at::Tensor(),
                             TorchMethod{}, ctx);
  });
  add<nn::Conv2dImpl>(Conv2d::kind, [](const nn::Conv2dImpl& c, const TorchContext&, std::string& problem) {
    const auto& o = c.options;
    TorchConv2dSettings s;
    s.in_channels = o.in_channels();
    s.out_channels = o.out_channels();
    s.groups = o.groups();
    s.kernel = *o.kernel_size();
    s.stride = *o.stride();
    s.dilation = *o.dilation();
    if (const auto* p = c10::get_if<torch::ExpandingArray<2>>(&o.padding())) s.padding = **p;
    s.padding_same = c10::get_if<torch::enumtype::kSame>(&o.padding()) != nullptr;
    s.padding_mode = torch::enumtype::get_enum_name(o.padding_mode());
    if (s.padding_mode == "kZeros") s.padding_mode = "zeros";
    return torch_conv2d<Set>(s, c.weight, o.bias() ? c.bias : at::Tensor(), TorchMethod{}, problem);
  });
  add<nn::BatchNorm2dImpl>(BatchNorm2d::kind, [](const nn::BatchNorm2dImpl& b, const TorchContext&, std::string&) {
    return torch_batch_norm<Set>(b.options.num_features(), b.options.eps(), b.weight, b.bias, TorchPrecision::scalar);
  });
  add<nn::LayerNormImpl>(LayerNorm::kind, [](const nn::LayerNormImpl& n, const TorchContext&, std::string& problem) {
    const auto& shape = n.options.normalized_shape();
    return torch_layer_norm<Set>(shape.back(), int64_t(shape.size()), n.options.eps(), n.weight, n.bias,
                                 TorchPrecision::scalar, problem);
  });
  add<nn::EmbeddingImpl>(Embedding::kind, [](const nn::EmbeddingImpl& e, const TorchContext& ctx,
                                              std::string& problem) {
    const auto& o = e.options;
    TorchEmbeddingSettings s;
    s.num_embeddings = o.num_embeddings();
    s.embedding_dim = o.embedding_dim();
    if (o.padding_idx()) s.padding_idx = *o.padding_idx();
    s.sparse = o.sparse();
    s.scale_grad_by_freq = o.scale_grad_by_freq();
    return torch_embedding<Set>(s, e.weight, TorchMethod{}, ctx.front, problem);
  });
}
}  // namespace impl

namespace adapters {

template <class ModuleRef>
at::Tensor observed(ModuleRef& module, const at::Tensor& x) {
  auto* mod = module.get();  // ModuleHolder::get() or std::shared_ptr::get()
  const auto capture = impl::TorchRegistry::instance().find(mod);
  if (!capture || !capture->wanted || !mod->is_training() || !at::GradMode::is_enabled()) return mod->forward(x);
  at::Tensor seen = impl::torch_observation(*capture, x);
  at::Tensor y = mod->forward(x);
  if (!y.requires_grad()) return y;
  long generation;
  {
    std::lock_guard<std::mutex> lock(capture->mutex);
    generation = capture->generation;
  }
  const std::size_t slot = capture->add_input(std::move(seen));
  y.register_hook([capture, slot, generation](const at::Tensor& g) { capture->set_grad(slot, generation, g); });
  return y;
}

inline TorchPreconditioner::TorchPreconditioner(const torch::nn::Module& model, Options options,
                                                TorchOptions torch_options)
    : torch_options_(std::move(torch_options)) {
  // What each module owning parameters is, for the shared translation (impl::TorchCore).
  std::vector<impl::TorchModuleSpec> specs;
  std::vector<const torch::nn::Module*> modules;
  // The root by reference (named_modules(include_self) would need it held in a shared_ptr).
  std::vector<std::pair<std::string, const torch::nn::Module*>> all{{"root", &model}};
  for (const auto& item : model.named_modules("", /*include_self=*/false)) all.emplace_back(item.key(), item.value().get());
  for (const auto& [name, module] : all) {
    const torch::nn::Module& m = *module;
    const auto own = m.named_parameters(/*recurse=*/false);
    if (own.is_empty()) continue;  // containers, activations, BatchNorm2d(affine=false), ...
    const auto kind = impl::TorchModuleKinds::instance().find(m);
    impl::TorchModuleSpec s;
    s.name = name;
    s.type_name = impl::torch_type_name(m);
    s.skipped = is_skipped(name, m, kind ? kind->kind : std::string());
    s.all_frozen = true;
    for (const auto& p : own) s.all_frozen = s.all_frozen && !p.value().requires_grad();
    if (kind)
      s.translate = [kind, &m](const impl::TorchContext& ctx, std::string& problem) {
        return kind->translate(m, ctx, problem);
      };
    specs.push_back(std::move(s));
    modules.push_back(&m);
  }
  core_ = std::make_unique<impl::TorchCore>(
      specs, std::move(options), torch_options_.tokens, torch_options_.accumulation_steps, impl::cpp_front_end(),
      [&](at::ScalarType dtype, Options o) -> std::unique_ptr<impl::TorchBackend> {
#if KFAC_HAVE_MPI
        if (torch_options_.mpi) {
          const MpiComm& mpi = *torch_options_.mpi;
          if (dtype == at::kDouble) return std::make_unique<impl::CppTorchBackend<double, MpiComm>>(std::move(o), mpi);
          return std::make_unique<impl::CppTorchBackend<float, MpiComm>>(std::move(o), mpi);
        }
#endif
        if (dtype == at::kDouble)
          return std::make_unique<impl::CppTorchBackend<double, SerialComm>>(std::move(o), SerialComm{});
        return std::make_unique<impl::CppTorchBackend<float, SerialComm>>(std::move(o), SerialComm{});
      });
  // The registered modules, in the core's order, for observed().
  const std::vector<std::string> names = core_->modules();
  for (std::size_t i = 0, j = 0; i < names.size(); ++i) {
    while (specs[j].name != names[i]) ++j;
    registered_.push_back(modules[j]);
  }
  for (std::size_t i = 0; i < registered_.size(); ++i)
    if (!impl::TorchRegistry::instance().insert(registered_[i], core_->captures()[i])) {
      for (std::size_t j = 0; j < i; ++j) impl::TorchRegistry::instance().erase(registered_[j]);
      const std::string name = names[i];
      registered_.clear();
      throw Error(name, "the module is already registered with another kfac::adapters::TorchPreconditioner");
    }
}

inline TorchPreconditioner::~TorchPreconditioner() {
  for (const auto* m : registered_) impl::TorchRegistry::instance().erase(m);
}

inline bool TorchPreconditioner::is_skipped(const std::string& name, const torch::nn::Module& m,
                                            const std::string& kind) const {
  const std::string type = impl::torch_type_name(m);                          // torch::nn::Conv2d
  const std::string short_type = type.substr(type.rfind(':') == std::string::npos ? 0 : type.rfind(':') + 1);
  for (const auto& s : torch_options_.skip)
    if (impl::glob_match(s.c_str(), name.c_str()) || s == type || s == type + "Impl" || s == short_type ||
        (!kind.empty() && s == kind))
      return true;
  return false;
}

inline std::vector<std::string> TorchPreconditioner::modules() const { return core_->modules(); }

inline void TorchPreconditioner::precondition() { core_->precondition(); }

template <class Scalar, class Comm>
Preconditioner<Scalar, impl::TorchExec, Comm>& TorchPreconditioner::preconditioner() {
  auto* b = dynamic_cast<impl::CppTorchBackend<Scalar, Comm>*>(&core_->backend());
  bool mpi = false;
#if KFAC_HAVE_MPI
  mpi = bool(torch_options_.mpi);
#endif
  if (!b)
    throw Error("", std::string("preconditioner<Scalar, Comm>(): the adapter holds a Preconditioner<") +
                        (dtype() == at::kDouble ? "double" : "float") + ", ..., " + (mpi ? "MpiComm" : "SerialComm") + ">");
  return b->preconditioner();
}

}  // namespace adapters
}  // namespace kfac
